//! Cleanup beside reading: the finish of an acknowledged prefix runs as a task of its own
//! while the loop goes on reading; one at a time, in order, so the stored position never
//! passes an undeleted row.

use std::sync::Arc;

use metrics::counter;
use tracing::Instrument;

use super::Session;
use crate::error::Error;
use crate::metrics as m;
use crate::sink::Sink;
use crate::source::Source;

/// A finish running beside reading: the prefix it deletes and stores.
///
/// It runs as a task of its own: it may hold the source's SQL session while the loop, in a
/// handler, waits for the same session (a bad row read back from the table), so its progress
/// must not depend on the loop polling it. Dropped unfinished (the session itself was
/// dropped), it is aborted: its database transaction then never commits.
pub(super) struct Cleaning<P> {
    ids: Arc<[i64]>,
    position: P,
    run: AbortOnDrop<Result<u64, Error>>,
}

/// A task that is aborted when its handle is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<P: Clone + std::fmt::Display + Send + Sync + 'static, K: Sink> Session<'_, P, K> {
    /// Starts the finish of the acknowledged prefix beside reading, unless one runs (the
    /// next starts when it ends).
    pub(super) fn start_cleanup<S: Source<Position = P>>(&mut self, source: &mut S) -> Result<(), Error> {
        if self.cleaning.is_some() {
            return Ok(());
        }
        self.labels.lease.check().map_err(Error::fenced)?;
        let Some((ids, position)) = self.tracker.take_ready() else { return Ok(()) };
        // After a failed finish (the drain tries again), the earlier prefix goes first.
        let ids: Arc<[i64]> = match self.memory.unfinished.take() {
            Some((mut earlier, _)) => {
                earlier.extend(ids);
                earlier.into()
            }
            None => ids.into(),
        };
        // The task keeps the shard-partition's log span and the scope its errors' fixes name.
        let finish = crate::dberror::with_current_scope(source.finish(ids.clone(), position.clone()));
        let run = AbortOnDrop(tokio::spawn(finish.instrument(tracing::Span::current())));
        self.cleaning = Some(Cleaning { ids, position, run });
        Ok(())
    }

    /// The running finish ended with `result`.
    pub(super) fn cleaned<S: Source<Position = P>>(
        &mut self,
        source: &mut S,
        result: Result<u64, Error>,
    ) -> Result<(), Error> {
        let Some(Cleaning { ids, position, .. }) = self.cleaning.take() else { return Ok(()) };
        let deleted = match result {
            Ok(deleted) => deleted,
            Err(e) => {
                self.memory.unfinished = Some((ids.to_vec(), position));
                return Err(e);
            }
        };
        source.finished(position.clone());
        if let Some(eo) = &mut self.eo {
            eo.deleted(&ids);
        }
        // A suspect is sent alone until its row is deleted (a replay sends it again).
        if !self.memory.refused.is_empty() {
            for id in ids.iter() {
                self.memory.refused.remove(id);
            }
        }
        if !self.memory.suspects.is_empty() {
            for id in ids.iter() {
                self.memory.suspects.remove(id);
            }
        }
        self.done = Some(position);
        counter!(m::DELETED_ROWS, &self.metric_labels).increment(deleted);
        // Rows published by this session and deleted: past the halt (a prefix of transactions
        // without rows proves nothing — a retry first replays transactions published before).
        if !ids.is_empty() {
            self.memory.past_halt(self.labels);
        }
        self.memory.progressed = true;
        Ok(())
    }

    /// Waits for the running finish, if any, then finishes what is acknowledged now.
    pub(super) async fn cleanup_now<S: Source<Position = P>>(&mut self, source: &mut S) -> Result<(), Error> {
        loop {
            if self.cleaning.is_some() {
                let result = running(&mut self.cleaning).await;
                self.cleaned(source, result)?;
            }
            self.start_cleanup(source)?;
            if self.cleaning.is_none() {
                return Ok(());
            }
        }
    }
}

/// The running finish's outcome (pending for ever when none runs: the branch is disabled then).
pub(super) async fn running<P>(cleaning: &mut Option<Cleaning<P>>) -> Result<u64, Error> {
    match cleaning {
        Some(c) => (&mut c.run.0)
            .await
            .unwrap_or_else(|e| Err(Error::transient(format!("the cleanup task ended without an answer: {e}")))),
        None => std::future::pending().await,
    }
}
