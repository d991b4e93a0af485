//! How long the loop waited for its source: the time a future spent between answering
//! "pending" and being polled again (or dropped), added to a counter.
//!
//! Work done inside a poll is not waiting; only the gaps are counted, so a source whose
//! changes are always ready (a backlog) shows almost no wait however much it decodes.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use tokio::time::Instant;

pin_project_lite::pin_project! {
    /// See the module docs. `total` counts nanoseconds. It pins its future in place (no
    /// allocation): the loop builds one every turn, for a branch that may be disabled.
    pub(super) struct Waited<'a, F> {
        #[pin]
        inner: F,
        since: Option<Instant>,
        total: &'a AtomicU64,
    }

    impl<'a, F> PinnedDrop for Waited<'a, F> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            count(this.since, this.total);
        }
    }
}

impl<'a, F: Future> Waited<'a, F> {
    pub(super) fn new(inner: F, total: &'a AtomicU64) -> Self {
        Self { inner, since: None, total }
    }
}

/// Adds the wait since `since`, if the future was waiting, to `total`.
fn count(since: &mut Option<Instant>, total: &AtomicU64) {
    if let Some(since) = since.take() {
        total.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

impl<F: Future> Future for Waited<'_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        count(this.since, this.total);
        match this.inner.poll(cx) {
            Poll::Pending => {
                *this.since = Some(Instant::now());
                Poll::Pending
            }
            ready => ready,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn counts_the_gaps_between_polls_not_the_work_inside_them() {
        let total = AtomicU64::new(0);
        // Ready at once: no wait, however long the poll itself takes.
        Waited::new(async { std::thread::sleep(Duration::from_millis(20)) }, &total).await;
        assert!(total.load(Ordering::Relaxed) < 5_000_000, "{}", total.load(Ordering::Relaxed));
        Waited::new(tokio::time::sleep(Duration::from_millis(30)), &total).await;
        assert!(total.load(Ordering::Relaxed) >= 25_000_000, "{}", total.load(Ordering::Relaxed));
        // Dropped while pending: the wait so far counts.
        let before = total.load(Ordering::Relaxed);
        let _ =
            tokio::time::timeout(Duration::from_millis(30), Waited::new(std::future::pending::<()>(), &total)).await;
        assert!(total.load(Ordering::Relaxed) - before >= 25_000_000);
    }
}
