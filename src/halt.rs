//! A halted shard-partition: one ERROR, then retries until the halt's cause is gone.
//!
//! A halt is an error that retrying at once cannot fix: a row Kafka refuses (its topic does
//! not exist), a row the log holds in a form that cannot be published, a grant the database
//! refuses. The cause is usually fixed outside the streamer — the topic created, the row fixed
//! or skipped, the grant given — so the task does not wait for a restart. It stays `halted`
//! (state 3, `/readyz` shows the reason) and tries a new session after a growing interval:
//! `halt_retry_ms` (30 s by default), doubling up to [`HALT_RETRY_MAX`]. For a missing topic
//! it also asks the cluster's metadata every 5 s (or `halt_retry_ms`, if shorter) and tries at
//! once when the topic exists.
//!
//! A retry costs little, and never skips or reorders:
//!
//! * it starts from the stored position, which is before the row the stream halted at, and
//!   sends that row **alone** — everything before it acknowledged first, nothing after it sent
//!   before Kafka accepted it — so a retry that halts again resends only the rows of the bad
//!   row's own transaction that precede it (a transaction is deleted whole);
//! * an acknowledged prefix whose delete the database refused is finished first, before
//!   anything is read: a missing `DELETE` grant resends nothing, however often it is retried
//!   (a catch-up by polling keeps its own such prefix from one attempt to the next);
//! * the first record to a topic not yet seen waits for the cluster's metadata: a topic that
//!   does not exist (or whose metadata reports an error) gets its record sent alone, so
//!   nothing after a row naming a missing topic is published before it.
//!
//! The ERROR is logged once per reason, and again only after [`HALT_LOG_EVERY`] or when the
//! reason changes; each retry logs at DEBUG. The session reports the halt cleared once it is
//! past the point where it halted (see [`HaltPoint`]): the state turns `streaming` and an INFO
//! line says so.
//!
//! Two halts do not clear by themselves and say "restart": a Kafka producer that cannot be
//! created (a configuration error), and an owner epoch stored by another ZooKeeper ensemble.

use std::time::{Duration, Instant};

/// The longest wait between two attempts of a halted shard-partition.
pub(crate) const HALT_RETRY_MAX: Duration = Duration::from_secs(300);

/// The longest wait between two metadata lookups of a missing topic.
pub(crate) const PROBE_EVERY_MAX: Duration = Duration::from_secs(5);

/// A halt that keeps its reason logs its ERROR again at most this often.
pub(crate) const HALT_LOG_EVERY: Duration = Duration::from_secs(300);

/// Where a session halted, kept while its shard-partition retries. The next sessions send
/// that row alone and report the halt cleared once they are past the point: the row
/// acknowledged or skipped, rows published by the session deleted (or the prefix a refused
/// delete left deleted at last), or — for a halt without a row — an idle position confirmed,
/// or — for a halt while connecting — a session connected. A transaction without rows proves
/// nothing: a retry first replays transactions published before the halt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct HaltPoint {
    /// The row the halt named.
    pub row: Option<i64>,
    /// The topic the cluster said does not exist; probed between attempts.
    pub missing_topic: Option<String>,
    /// The halt came from connecting (a refused login, a missing grant on the checkpoint
    /// table, a slot of another database).
    pub at_connect: bool,
}

/// The retry interval and the ERROR's throttle of one shard-partition's halts. Pure: the
/// caller passes the time.
#[derive(Debug)]
pub(crate) struct HaltRetry {
    first: Duration,
    next: Duration,
    /// Attempts since the halt began.
    attempts: u32,
    /// The last ERROR logged: its reason and when.
    logged: Option<(String, Instant)>,
}

impl HaltRetry {
    /// `first`: the configured `halt_retry_ms`.
    pub(crate) fn new(first: Duration) -> Self {
        Self { first, next: first, attempts: 0, logged: None }
    }

    /// A session halted with `reason` at `now`: whether to log the ERROR, and how long to
    /// wait before the next attempt.
    pub(crate) fn halted(&mut self, reason: &str, now: Instant) -> (bool, Duration) {
        let log = match &self.logged {
            Some((last, at)) => last != reason || now.duration_since(*at) >= HALT_LOG_EVERY,
            None => true,
        };
        if log {
            self.logged = Some((reason.to_string(), now));
        }
        let wait = self.next;
        self.next = (self.next * 2).min(HALT_RETRY_MAX.max(self.first));
        self.attempts += 1;
        (log, wait)
    }

    /// How many times the stream halted since the halt began (1 at the first halt).
    pub(crate) fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The halt cleared: a later one waits the first interval again. The ERROR's throttle is
    /// kept, so a halt that clears and comes back with the same reason is not logged twice
    /// within [`HALT_LOG_EVERY`].
    pub(crate) fn cleared(&mut self) {
        self.next = self.first;
        self.attempts = 0;
    }

    /// How often a missing topic is looked up between attempts: every `halt_retry_ms`, at
    /// most [`PROBE_EVERY_MAX`] apart (a metadata request is cheap).
    pub(crate) fn probe_every(&self) -> Duration {
        self.first.min(PROBE_EVERY_MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_double_from_the_setting_up_to_five_minutes() {
        let start = Instant::now();
        let mut retry = HaltRetry::new(Duration::from_secs(30));
        let waits: Vec<u64> = (0..7).map(|i| retry.halted("r", start + Duration::from_secs(i)).1.as_secs()).collect();
        assert_eq!(waits, [30, 60, 120, 240, 300, 300, 300]);
        assert_eq!(retry.attempts(), 7);
        retry.cleared();
        assert_eq!(retry.halted("r", start).1, Duration::from_secs(30), "a new halt starts over");
        assert_eq!(retry.attempts(), 1);
        assert_eq!(retry.probe_every(), PROBE_EVERY_MAX, "a missing topic is looked up more often");
        assert_eq!(HaltRetry::new(Duration::from_millis(300)).probe_every(), Duration::from_millis(300));
        // A first interval above the maximum is kept, not shortened.
        let mut slow = HaltRetry::new(Duration::from_secs(400));
        assert_eq!((slow.halted("r", start).1.as_secs(), slow.halted("r", start).1.as_secs()), (400, 400));
    }

    #[test]
    fn the_error_is_logged_once_per_reason_and_then_every_five_minutes() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut retry = HaltRetry::new(Duration::from_millis(500));
        assert!(retry.halted("topic missing", at(0)).0, "the first halt is logged");
        assert!(!retry.halted("topic missing", at(1)).0, "a retry halting the same way is not");
        assert!(!retry.halted("topic missing", at(299)).0);
        assert!(retry.halted("topic missing", at(300)).0, "repeated after five minutes");
        assert!(retry.halted("grant missing", at(301)).0, "a new reason is logged at once");
        assert!(retry.halted("topic missing", at(302)).0, "and so is the old one coming back");
        retry.cleared();
        assert!(!retry.halted("topic missing", at(303)).0, "a clear does not reset the throttle");
    }
}
