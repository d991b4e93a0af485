//! Catch-up: what happens when a stream's position is lost, and when it returns from polling.
//!
//! ```text
//!  (a) take a new position FIRST   PostgreSQL: create the slot (drop an invalidated one)
//!                                  MySQL/MariaDB: the binlog position of a consistent snapshot,
//!                                  stored in the checkpoint with catchup_pending = 1
//!  (b) drain by polling            every row still in the table up to the highest id that
//!                                  could have committed before (a)
//!  (c) stream from (a)             every transaction committed after (a)
//! ```
//!
//! `catchup_pending` in the checkpoint table is set before (a) and cleared after (b), so a
//! crash anywhere in between repeats the catch-up; nothing committed before (a) can be missed.
//! A transaction that commits after (a) while (b) runs can be sent by both (b) and (c) (a
//! duplicate: the log, not the table, decides what (c) publishes), and relative to the
//! transactions (c) sends it may arrive out of commit order: the catch-up is an incident
//! path, and `docs/polling.md` names this window.

//!
//! This module holds what every database shares: the [`CatchUp`] contract and the polling
//! [`Drain`]. Each database's steps (a) and the `catchup_pending` flag are in its folder
//! (`db/postgres/catchup.rs`, `db/mysql/catchup.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::sync::watch;

use crate::config::StreamSettings;
use crate::error::Error;
use crate::metrics as m;
use crate::poll::{PollPosition, PollSettings, PollSource, PollTable};
use crate::sink::Broker;
use crate::streamer::{StreamLabels, StreamMemory, run_session};

/// How one shard-partition catches up when its position is lost; each database implements it
/// in its folder and hands it to the shard-partition's job.
pub(crate) trait CatchUp: Send + Sync + 'static {
    /// Runs (a), (b) and clears `catchup_pending` (see the module docs), publishing through
    /// `drain`; the next session then streams from the new position (c). `Ok(None)`: the process
    /// is stopping and the catch-up did not finish (the next start repeats it). An error leaves
    /// `catchup_pending` set, so a later attempt starts over.
    fn run<'a>(
        &'a self,
        drain: &'a mut Drain<'_>,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<Option<CatchUpReport>, Error>>;
}

/// What a finished catch-up did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CatchUpReport {
    /// Rows published by polling and deleted.
    pub rows: u64,
    pub elapsed: Duration,
}

/// How a catch-up publishes: the stream's own producer and settings.
#[derive(Debug)]
pub(crate) struct Drain<'a> {
    pub labels: &'a StreamLabels,
    pub settings: &'a StreamSettings,
    pub producer: &'a Broker,
    pub message_timeout: Duration,
    pub stop: &'a mut watch::Receiver<bool>,
    /// Kept by the task from one catch-up attempt to the next: the rows an attempt published
    /// but could not delete are deleted first by the next, not sent again.
    pub memory: &'a mut StreamMemory<PollPosition>,
}

impl Drain<'_> {
    /// Publishes and deletes every row with `id <= upto` by polling; returns how many.
    /// `in_snapshot`: every read of `reader` sees one snapshot ([`PollSettings::in_snapshot`]).
    /// `Ok(None)` means the process is stopping and the drain did not finish.
    pub(crate) async fn run<T: PollTable>(
        &mut self,
        reader: T,
        cleaner: T,
        upto: i64,
        in_snapshot: bool,
    ) -> Result<Option<u64>, Error> {
        let rows_sent = Arc::new(AtomicU64::new(0));
        let settings = PollSettings {
            batch: self.settings.poll_batch,
            interval: Duration::from_millis(self.settings.poll_interval_ms),
            full_rescan_every: crate::poll::FULL_RESCAN_EVERY,
            max_batch_bytes: self.settings.max_in_flight_bytes as usize,
            drain_upto: Some(upto),
            in_snapshot,
            rows_sent: rows_sent.clone(),
            metric_labels: self.labels.metric_labels(),
            quiet: None,
        };
        let source = PollSource::new(reader, cleaner, settings);
        run_session(self.labels, self.settings, source, self.producer, self.message_timeout, self.stop, self.memory)
            .await?;
        if *self.stop.borrow() {
            return Ok(None);
        }
        Ok(Some(rows_sent.load(Ordering::Relaxed)))
    }
}

/// Logs and counts a finished catch-up.
pub(crate) fn report(labels: &StreamLabels, started: Instant, rows: u64) -> CatchUpReport {
    let report = CatchUpReport { rows, elapsed: started.elapsed() };
    let metric_labels = labels.metric_labels();
    metrics::counter!(m::CATCHUPS, &metric_labels).increment(1);
    metrics::counter!(m::CATCHUP_ROWS, &metric_labels).increment(rows);
    tracing::warn!(
        rows,
        elapsed_ms = report.elapsed.as_millis() as u64,
        "catch-up done: rows still in the table were sent by polling; streaming resumes from the new position"
    );
    report
}
