//! What a shard-partition's task knows about its ownership: the owner epoch, and whether the
//! instance's ZooKeeper session can still be trusted to hold the lease.
//!
//! A lease alone is not safety: a process paused past its session timeout wakes up believing
//! it still owns its shard-partitions. So the session is trusted only for a while after the
//! server last answered: [`SessionLease::renew`] with the time a request was SENT moves the
//! deadline to `sent + session_timeout / 2` (the server heard us at or after `sent`, so it
//! cannot expire the session before `sent + session_timeout`). The streamer checks
//! [`OwnerLease::check`] before handing each record to Kafka and before each delete or
//! position write; the monotonic clock keeps running through SIGSTOP, so a resumed process
//! fails the check before it does anything. Records queued inside librdkafka before a pause
//! are covered by capping `message.timeout.ms` below the same bound (see `run.rs`).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// One instance's ZooKeeper session, shared by the tasks of every shard-partition it owns.
#[derive(Debug)]
pub(crate) struct SessionLease {
    instance: String,
    session_timeout: Duration,
    /// Nanoseconds since [`base`]; 0 means not trusted.
    valid_until: AtomicU64,
    /// Instance names of the live members, for deciding whether a slot's holder is gone.
    live: RwLock<HashSet<String>>,
    /// Woken by [`Self::revoke`] (see [`OwnerLease::ended`]).
    revoked: Notify,
}

impl SessionLease {
    pub(crate) fn new(instance: &str, session_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            instance: instance.into(),
            session_timeout,
            valid_until: AtomicU64::new(0),
            live: RwLock::new(HashSet::new()),
            revoked: Notify::new(),
        })
    }

    /// The server answered a request sent at `sent`.
    pub(crate) fn renew(&self, sent: Instant) {
        let until = nanos(sent + self.session_timeout / 2);
        self.valid_until.fetch_max(until, Ordering::SeqCst);
    }

    /// The session is lost (expired or closed): nothing may be produced or written any more.
    pub(crate) fn revoke(&self) {
        self.valid_until.store(0, Ordering::SeqCst);
        self.revoked.notify_waiters();
    }

    pub(crate) fn is_valid(&self) -> bool {
        nanos(Instant::now()) < self.valid_until.load(Ordering::SeqCst)
    }

    /// When the trust ends unless the server answers again.
    fn valid_until(&self) -> Instant {
        base() + Duration::from_nanos(self.valid_until.load(Ordering::SeqCst))
    }

    pub(crate) fn set_live_members(&self, instances: impl IntoIterator<Item = String>) {
        let mut live = self.live.write().unwrap_or_else(|e| e.into_inner());
        *live = instances.into_iter().collect();
    }

    pub(crate) fn instance(&self) -> &str {
        &self.instance
    }
}

/// The ownership of one shard-partition as its task sees it.
#[derive(Debug, Clone)]
pub(crate) struct OwnerLease {
    /// `None` without coordination: this instance owns everything, always.
    held: Option<(i64, Arc<SessionLease>)>,
    /// Set when the lease node itself is gone (deleted by an operator, a ZooKeeper restore)
    /// while the session lives: the lease may be granted again, so nothing more is produced.
    lost: Arc<AtomicBool>,
    /// Woken by [`Self::mark_lost`] (see [`Self::ended`]).
    lost_notify: Arc<Notify>,
}

impl OwnerLease {
    /// No coordination: the single instance owns every shard-partition at epoch 0.
    pub(crate) fn embedded() -> Self {
        Self { held: None, lost: Arc::default(), lost_notify: Arc::default() }
    }

    /// Held through ZooKeeper at `epoch` (the lease node's creation zxid).
    pub(crate) fn held(epoch: i64, session: Arc<SessionLease>) -> Self {
        Self { held: Some((epoch, session)), lost: Arc::default(), lost_notify: Arc::default() }
    }

    /// The lease node is gone: from now on [`Self::check`] fails.
    pub(crate) fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
        self.lost_notify.notify_waiters();
    }

    /// Resolves once [`Self::check`] fails: at once when the session is revoked or the lease
    /// marked lost, otherwise when the trust deadline passes without a renewal (it sleeps to
    /// the deadline and again to a renewed one). Never without coordination. A waiting stream
    /// costs no timer ticks: about one wake per renewal instead of a periodic check.
    pub(crate) async fn ended(&self) {
        let Some((_, session)) = &self.held else {
            return std::future::pending().await;
        };
        loop {
            let revoked = session.revoked.notified();
            let lost = self.lost_notify.notified();
            tokio::pin!(revoked, lost);
            // Registered before the check, so a revocation right after it is not missed.
            revoked.as_mut().enable();
            lost.as_mut().enable();
            if self.check().is_err() {
                return;
            }
            let until = tokio::time::Instant::from_std(session.valid_until());
            tokio::select! {
                _ = tokio::time::sleep_until(until) => {}
                _ = revoked => {}
                _ = lost => {}
            }
        }
    }

    /// The epoch stamped as `outbox-owner-epoch`, if coordinated.
    pub(crate) fn epoch(&self) -> Option<i64> {
        self.held.as_ref().map(|(e, _)| *e)
    }

    /// The epoch that guards database position writes (0 when not coordinated).
    pub(crate) fn db_epoch(&self) -> i64 {
        self.epoch().unwrap_or(0)
    }

    /// This instance's name (`None` when not coordinated).
    pub(crate) fn instance(&self) -> Option<&str> {
        self.held.as_ref().map(|(_, s)| s.instance())
    }

    /// Ok while this instance may produce records and write positions.
    pub(crate) fn check(&self) -> Result<(), String> {
        match &self.held {
            Some((epoch, _)) if self.lost.load(Ordering::SeqCst) => Err(format!(
                "the lease node (epoch {epoch}) is gone from ZooKeeper (deleted by hand, or a restore), so the lease may be granted to another instance; it stops without producing or writing a position"
            )),
            Some((epoch, session)) if !session.is_valid() => Err(format!(
                "this instance can no longer confirm its ZooKeeper session, so its lease (epoch {epoch}) may already be another instance's; it stops without producing or writing a position"
            )),
            _ => Ok(()),
        }
    }

    /// Whether `instance` is a live member (always true when not coordinated: never take a
    /// slot from anyone).
    pub(crate) fn is_live_member(&self, instance: &str) -> bool {
        match &self.held {
            Some((_, session)) => session.live.read().unwrap_or_else(|e| e.into_inner()).contains(instance),
            None => true,
        }
    }
}

#[cfg(test)]
impl OwnerLease {
    fn session_for_test(&self) -> &Arc<SessionLease> {
        &self.held.as_ref().expect("held").1
    }
}

/// The origin of the stored deadlines.
fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(|| Instant::now() - Duration::from_secs(1))
}

fn nanos(at: Instant) -> u64 {
    at.saturating_duration_since(base()).as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_trusted_for_half_the_session_timeout_after_a_sent_request() {
        let session = SessionLease::new("a", Duration::from_secs(10));
        let lease = OwnerLease::held(7, session.clone());
        assert!(lease.check().is_err(), "never renewed");
        session.renew(Instant::now());
        assert!(lease.check().is_ok());
        session.renew(Instant::now() - Duration::from_secs(6));
        assert!(lease.check().is_ok(), "an older answer never shortens the deadline");
        session.revoke();
        assert!(lease.check().unwrap_err().contains("epoch 7"));
        let lease = OwnerLease::held(8, SessionLease::new("c", Duration::from_secs(10)));
        lease.session_for_test().renew(Instant::now());
        let copy = lease.clone();
        lease.mark_lost();
        assert!(copy.check().unwrap_err().contains("lease node"), "every copy of the lease sees the loss");
        let stale = SessionLease::new("b", Duration::from_secs(10));
        stale.renew(Instant::now() - Duration::from_secs(6));
        assert!(!stale.is_valid(), "an answer to a request sent 6 s ago is no proof any more");
    }

    /// `ended` resolves when the trust runs out, is revoked, or the lease is marked lost — and
    /// not while renewals keep it trusted.
    #[tokio::test]
    async fn ended_resolves_when_the_check_would_fail() {
        let session = SessionLease::new("a", Duration::from_millis(400));
        let lease = OwnerLease::held(1, session.clone());
        session.renew(Instant::now());
        let started = Instant::now();
        lease.ended().await;
        assert!(started.elapsed() >= Duration::from_millis(150), "trusted for half the timeout first");
        assert!(lease.check().is_err());

        session.renew(Instant::now() + Duration::from_secs(60));
        let waiting = tokio::spawn({
            let lease = lease.clone();
            async move { lease.ended().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "a trusted lease has not ended");
        session.revoke();
        tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("revoking ends it at once").unwrap();

        session.renew(Instant::now() + Duration::from_secs(60));
        let other = OwnerLease::held(2, session.clone());
        let waiting = tokio::spawn({
            let other = other.clone();
            async move { other.ended().await }
        });
        tokio::task::yield_now().await;
        other.mark_lost();
        tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("a lost lease ends at once").unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(50), OwnerLease::embedded().ended()).await.is_err(),
            "an embedded lease never ends"
        );
    }

    #[test]
    fn embedded_ownership_is_always_valid_and_takes_nothing() {
        let lease = OwnerLease::embedded();
        assert!(lease.check().is_ok());
        assert_eq!(lease.db_epoch(), 0);
        assert!(lease.is_live_member("anyone"));
    }
}
