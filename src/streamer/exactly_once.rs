//! Exactly-once delivery in the loop: records go in Kafka transactions that end with a progress
//! record ([`crate::progress`]); only what a committed transaction holds counts as acknowledged.
//!
//! * A Kafka transaction begins with the first record sent after the last one ended. It is
//!   closed once it is `transaction_interval_ms` old or holds `transaction_max_records`
//!   records: reading pauses at the next end of a source transaction (or, for a source
//!   transaction that outgrows it — `transaction_max_records` or [`SPLIT_AFTER`] — right away,
//!   with the rows so far named in `partial`), every record is acknowledged, and the commit
//!   writes the progress record last.
//! * Acknowledgements are held until the commit; then they reach the [`AckTracker`], so a row
//!   is deleted (and the position stored) only once a committed transaction holds its record.
//! * A failure aborts the transaction (the session ends; the next one starts from the last
//!   committed progress). A record the broker refused on its own is remembered: the next
//!   session dead-letters (or halts on) it without sending it in the new transaction.
//! * On a restart, the last committed progress record says which source transactions (and
//!   which first rows of one) are in Kafka: their rows are deleted, not sent again.
//! * A source whose positions mean nothing outside their session (polling:
//!   [`Source::before_reading`]) is tracked by rows instead: each progress record names the
//!   ids of the rows committed Kafka transactions hold and not yet deleted, and the next
//!   session deletes those before it reads. Once rows are deleted, the next record leaves them
//!   out: the next transaction's, or — when none began within `transaction_interval_ms` and at
//!   a clean end — one committed for it alone, so that an id used again later (an identity
//!   restarted lower) is not taken for a row already sent.
//! * Under progress by position (table storage), records name the same rows beside the
//!   position: rows the sweep published ([`crate::sweep`]), which no position covers (the next
//!   session's sweep finds them in the table again and deletes those the record names instead
//!   of sending them), and every other row not yet deleted, for a catch-up after the position
//!   was lost (the log the position was in is gone; the catch-up deletes the rows the record
//!   names before it drains). Past [`MAX_NAMED_RANGES`] ranges a record names none.
//!
//! [`AckTracker`]: crate::ack::AckTracker

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::time::Instant;

use metrics::counter;

use super::{Session, StreamLabels};
use crate::ack::TxnSeq;
use crate::config::StreamSettings;
use crate::error::Error;
use crate::metrics as m;
use crate::progress::{Partial, Progress};
use crate::sink::Sink;
use crate::source::Source;

/// A source transaction still open this long after its Kafka transaction began is split: the
/// broker aborts a transaction open longer than its timeout.
const SPLIT_AFTER: Duration = Duration::from_secs(5);

/// A Kafka transaction during which the loop waited for the source less than half the time
/// (a backlog, or Kafka holding the loop back) goes on past `transaction_interval_ms`, up to
/// this many intervals (at most [`STRETCH_CAP`]): reading pauses at every commit until all
/// records are acknowledged, and at full speed that pause is a share of each transaction's
/// time, while the records are late already. A stream that waits for changes keeps the
/// interval, and its latency.
const STRETCH: u32 = 5;
const STRETCH_CAP: Duration = Duration::from_millis(500);

/// The most id ranges a progress record by position names (about 40 bytes each).
const MAX_NAMED_RANGES: usize = 10_000;

/// A session's exactly-once state.
#[derive(Debug)]
pub(super) struct ExactlyOnce {
    interval: Duration,
    max_records: usize,
    /// The open Kafka transaction: when it began and how many records it holds.
    open: Option<(Instant, usize)>,
    /// How long the loop waited for the source while it was open.
    idle: Duration,
    /// Acknowledgements of the open transaction's records, released at its commit.
    held: Vec<TxnSeq>,
    /// What the last committed progress record said (read at the start, then written).
    committed: Progress,
    /// The source kind's position header: a progress record of another kind covers nothing.
    kind: &'static str,
    /// The database history the session reads; progress records carry it.
    history: String,
    /// Row events of the source transaction being read so far.
    rows_read: u64,
    /// How many of them, from its first, a committed Kafka transaction already holds.
    covered: u64,
    /// Reading pauses until the open Kafka transaction commits.
    pub(super) closing: bool,
    /// Progress by rows (see the module docs): the ids of the open transaction's records, and
    /// those committed transactions hold whose rows are not deleted yet. `None`: by position.
    by_rows: Option<ByRows>,
    /// Progress by position, table storage: the ids of the rows committed transactions hold
    /// and not yet deleted, named beside the position. A position says nothing to the sweep
    /// (rows the log never carried) nor to a catch-up (the log the position was in is gone).
    named: ByRows,
    /// Whether rows are named (table storage: WAL-only messages are no rows).
    name_rows: bool,
    /// Rows the last session's record named: the sweep finds them again and deletes them
    /// instead of sending them.
    named_in_kafka: BTreeSet<i64>,
}

/// Row ids for progress by rows.
#[derive(Debug, Default)]
struct ByRows {
    held: Vec<i64>,
    undeleted: BTreeSet<i64>,
    /// Since when the last committed record names rows deleted since.
    stale_since: Option<Instant>,
}

/// Starts a session's exactly-once state when the sink is transactional: registers the
/// shard-partition's producer, reads its last committed progress record and, for progress by
/// rows, deletes the rows that record names before anything is read (they are in Kafka).
pub(super) async fn start<S: Source, K: Sink>(
    labels: &StreamLabels,
    settings: &StreamSettings,
    source: &mut S,
    sink: &K,
    history: String,
) -> Result<Option<ExactlyOnce>, Error> {
    if !sink.transactional() {
        return Ok(None);
    }
    let resumed = match resume(sink, labels).await? {
        Some(p) if p.history.as_ref().is_some_and(|h| *h != history) => {
            tracing::warn!(
                written_in = p.history.as_deref().unwrap_or_default(),
                now = %history,
                "the last progress record was written in another history of the database (it failed over since): it covers nothing here, so records of rows this server still holds may repeat"
            );
            None
        }
        resumed => resumed,
    };
    let by_rows = source.before_reading();
    if let (Some(before), Some(progress)) = (&by_rows, &resumed)
        && !progress.ids.is_empty()
    {
        let ids: Vec<i64> = progress.id_list();
        let deleted = source.finish(ids.clone().into(), before.clone()).await?;
        source.finished(before.clone());
        tracing::info!(rows = ids.len(), deleted, "deleted the rows the last committed Kafka transaction holds");
        counter!(m::DELETED_ROWS, &labels.metric_labels()).increment(deleted);
        counter!(m::SKIPPED_REPLAYED_ROWS, &labels.metric_labels()).increment(deleted);
    }
    Ok(Some(ExactlyOnce::new(
        settings.transaction_interval_ms,
        settings.transaction_max_records,
        S::POSITION_HEADER,
        history,
        by_rows.is_some(),
        // A table read by key has surrogate ids, which mean nothing to another process (a
        // catch-up after the operator gave the table an integer id would delete by them).
        settings.storage == crate::config::Storage::Table && source.row_keys().is_none(),
        resumed,
    )))
}

/// Registers the sink for the shard-partition and reads its last committed progress record.
async fn resume<K: Sink>(sink: &K, labels: &StreamLabels) -> Result<Option<Progress>, Error> {
    let Some(value) = sink.resume().await? else { return Ok(None) };
    let key = format!("{}/{}", labels.source, labels.id);
    let progress = Progress::decode(&value, "the progress topic", &key)?;
    tracing::info!(
        mark = ?progress.mark,
        partial = ?progress.partial,
        row_ranges = progress.ids.len(),
        "resuming after the last committed Kafka transaction"
    );
    Ok(Some(progress))
}

impl ExactlyOnce {
    fn new(
        interval_ms: u64,
        max_records: usize,
        kind: &'static str,
        history: String,
        by_rows: bool,
        name_rows: bool,
        resumed: Option<Progress>,
    ) -> Self {
        let committed = match resumed {
            Some(p) if p.source == kind => p,
            Some(p) => {
                tracing::info!(
                    written_by = %p.source,
                    "the last progress record was written by another kind of session (a catch-up); it covers nothing here"
                );
                Progress::new(kind, None, None)
            }
            None => Progress::new(kind, None, None),
        };
        // By position, the ids a record names are rows in Kafka not known to be deleted.
        let named_in_kafka: BTreeSet<i64> =
            if by_rows || !name_rows { BTreeSet::new() } else { committed.id_list().into_iter().collect() };
        Self {
            interval: Duration::from_millis(interval_ms),
            max_records,
            open: None,
            idle: Duration::ZERO,
            held: Vec::new(),
            committed,
            kind,
            history,
            rows_read: 0,
            covered: 0,
            closing: false,
            by_rows: by_rows.then(ByRows::default),
            named: ByRows { undeleted: named_in_kafka.clone(), ..ByRows::default() },
            name_rows,
            named_in_kafka,
        }
    }

    /// When the loop must look again whether to close the open transaction. None while it
    /// closes: the acknowledgements it waits for wake the loop, not a timer already past.
    pub(super) fn due(&self, in_source_txn: bool) -> Option<Instant> {
        if self.closing {
            return None;
        }
        let Some((began, _)) = self.open else { return self.refresh_due() };
        if in_source_txn {
            return Some(began + SPLIT_AFTER);
        }
        // Whether to go on is decided once the interval is over, not before.
        Some(began + if began.elapsed() < self.interval { self.interval } else { self.length(began) })
    }

    /// How long the open transaction (begun at `began`) goes on: see [`STRETCH`].
    fn length(&self, began: Instant) -> Duration {
        if self.idle * 2 < began.elapsed() {
            self.interval.max((self.interval * STRETCH).min(STRETCH_CAP))
        } else {
            self.interval
        }
    }

    /// The loop waited `waited` for the source.
    pub(super) fn waited(&mut self, waited: Duration) {
        if self.open.is_some() {
            self.idle += waited;
        }
    }

    /// When a record leaving out deleted rows is due, if one is.
    fn refresh_due(&self) -> Option<Instant> {
        let stale = self.by_rows.as_ref().map_or(self.named.stale_since, |rows| rows.stale_since);
        Some(stale? + self.interval)
    }

    /// Whether the open transaction should close now.
    fn should_close(&self, in_source_txn: bool) -> bool {
        let Some((began, records)) = self.open else { return false };
        let age = began.elapsed();
        if in_source_txn {
            records >= self.max_records || age >= SPLIT_AFTER
        } else {
            records >= self.max_records || age >= self.length(began)
        }
    }

    /// Holds an acknowledgement of row `id`'s record until the commit.
    pub(super) fn hold(&mut self, seq: TxnSeq, id: i64) {
        self.held.push(seq);
        if let Some(rows) = &mut self.by_rows {
            rows.held.push(id);
        } else if self.name_rows {
            self.named.held.push(id);
        }
    }

    /// The sweep is about to publish row `id`: whether a committed Kafka transaction of the
    /// last session holds it already (then it is deleted, not sent).
    pub(super) fn in_kafka(&mut self, id: i64) -> bool {
        self.named_in_kafka.remove(&id)
    }

    /// Rows `ids` are deleted: progress records need not name them any more.
    pub(super) fn deleted(&mut self, ids: &[i64]) {
        let rows = self.by_rows.as_mut().unwrap_or(&mut self.named);
        if !rows.undeleted.is_empty() {
            let before = rows.undeleted.len();
            for id in ids {
                rows.undeleted.remove(id);
            }
            if rows.undeleted.len() < before {
                rows.stale_since.get_or_insert_with(Instant::now);
            }
        }
    }
}

impl<P: Clone + std::fmt::Display + Send + Sync + 'static, K: Sink> Session<'_, P, K> {
    /// Opens a Kafka transaction for the record about to be sent, unless one is open.
    pub(super) fn begin_kafka_txn(&mut self) -> Result<(), Error> {
        let Some(eo) = &mut self.eo else { return Ok(()) };
        if eo.open.is_none() {
            self.sink.begin()?;
            eo.open = Some((Instant::now(), 0));
            eo.idle = Duration::ZERO;
        }
        Ok(())
    }

    /// Counts a record handed to the open transaction.
    pub(super) fn counted(&mut self) {
        if let Some(eo) = &mut self.eo
            && let Some((_, records)) = &mut eo.open
        {
            *records += 1;
        }
    }

    /// A source transaction begins: how much of it a committed Kafka transaction holds.
    pub(super) fn eo_begin<S: Source<Position = P>>(&mut self, source: &S, label: &str) -> Result<(), Error> {
        let Some(eo) = &mut self.eo else { return Ok(()) };
        eo.rows_read = 0;
        eo.covered = 0;
        if let Some(mark) = &eo.committed.mark
            && source.begun_within(mark)?
        {
            eo.covered = u64::MAX;
        } else if let Some(partial) = &eo.committed.partial
            && partial.transaction == label
        {
            eo.covered = partial.rows;
        }
        Ok(())
    }

    /// A row event of the source transaction: whether a committed Kafka transaction holds it.
    pub(super) fn eo_row_covered(&mut self) -> bool {
        let Some(eo) = &mut self.eo else { return false };
        eo.rows_read += 1;
        eo.rows_read <= eo.covered
    }

    /// The source transaction committed.
    pub(super) fn eo_commit(&mut self) {
        if let Some(eo) = &mut self.eo {
            eo.rows_read = 0;
            eo.covered = 0;
        }
    }

    /// Marks the open Kafka transaction for closing when it is due; commits it once nothing
    /// it holds is unsettled. Called at the top of every loop turn.
    pub(super) async fn eo_turn<S: Source<Position = P>>(&mut self) -> Result<(), Error> {
        let in_source_txn = self.open.is_some();
        let Some(eo) = &mut self.eo else { return Ok(()) };
        if !eo.closing && eo.should_close(in_source_txn) {
            eo.closing = true;
        }
        if eo.closing && self.deliveries.is_empty() && self.waiting.is_empty() {
            self.commit_kafka_txn::<S>().await?;
        } else if eo.open.is_none() && eo.refresh_due().is_some_and(|due| due <= Instant::now()) {
            self.refresh_progress::<S>().await?;
        }
        Ok(())
    }

    /// Commits a Kafka transaction holding only a progress record that leaves out the rows
    /// deleted since the last one (progress by rows; nothing else is open).
    async fn refresh_progress<S: Source<Position = P>>(&mut self) -> Result<(), Error> {
        self.begin_kafka_txn()?;
        self.commit_kafka_txn::<S>().await
    }

    /// Commits the open Kafka transaction with its progress record, then releases the
    /// acknowledgements it held. Every record of it must be settled.
    pub(super) async fn commit_kafka_txn<S: Source<Position = P>>(&mut self) -> Result<(), Error> {
        let in_source_txn = self.open.is_some();
        let mark = self.last_position.as_ref().and_then(S::progress_mark);
        let Some(eo) = &mut self.eo else { return Ok(()) };
        eo.closing = false;
        if eo.open.is_none() {
            return Ok(());
        }
        self.labels.lease.check().map_err(Error::fenced)?;
        let progress = match &mut eo.by_rows {
            // Positions mean nothing to the next session: the rows say it all.
            Some(rows) => {
                rows.undeleted.extend(rows.held.drain(..));
                rows.stale_since = None;
                Progress::new(eo.kind, None, None).with_ids(&rows.undeleted).in_history(&eo.history)
            }
            None => {
                let mark = mark.or_else(|| eo.committed.mark.clone());
                let partial = in_source_txn.then(|| Partial { transaction: self.label.clone(), rows: eo.rows_read });
                let named = &mut eo.named;
                named.undeleted.extend(named.held.drain(..));
                named.stale_since = None;
                let progress = Progress::new(eo.kind, mark, partial).with_ids(&named.undeleted);
                // Ids scattered by other writers' transactions could make a record too large for
                // Kafka: past this many ranges the record names none (a catch-up then sends those
                // rows again, as at-least-once would).
                let progress =
                    if progress.ids.len() > MAX_NAMED_RANGES { progress.with_ids(&BTreeSet::new()) } else { progress };
                progress.in_history(&eo.history)
            }
        };
        let started = std::time::Instant::now();
        self.sink.commit(progress.encode()).await?;
        self.hot.kafka_commit_seconds.record(started.elapsed().as_secs_f64());
        eo.open = None;
        eo.committed = progress;
        // What the transaction holds now counts as covered, should the source transaction
        // be read again in this session (it is not; the next session reads the record).
        for seq in std::mem::take(&mut eo.held) {
            self.tracker.acked(seq);
        }
        self.hot.kafka_commits.increment(1);
        Ok(())
    }

    /// Ends the session's Kafka transaction: commits what it holds when the session ended
    /// cleanly and every record was acknowledged, aborts it otherwise.
    pub(super) async fn eo_end<S: Source<Position = P>>(&mut self, clean: bool) -> Result<(), Error> {
        let Some(eo) = &self.eo else { return Ok(()) };
        if eo.open.is_none() {
            return Ok(());
        }
        if clean && self.deliveries.is_empty() && self.waiting.is_empty() {
            match self.commit_kafka_txn::<S>().await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    self.eo_abort().await;
                    return Err(e);
                }
            }
        }
        self.eo_abort().await;
        Ok(())
    }

    /// After a clean end's last delete: leaves no progress record naming deleted rows behind.
    pub(super) async fn eo_tidy<S: Source<Position = P>>(&mut self) -> Result<(), Error> {
        let Some(eo) = &self.eo else { return Ok(()) };
        if eo.open.is_some() || eo.refresh_due().is_none() {
            return Ok(());
        }
        let refreshed = self.refresh_progress::<S>().await;
        if refreshed.is_err() {
            self.eo_abort().await;
        }
        refreshed
    }

    /// Aborts the open Kafka transaction, dropping its held acknowledgements (its rows are
    /// sent again by the next session). A failure to abort is left to the broker, which
    /// aborts the transaction when the next session registers the transactional id.
    pub(super) async fn eo_abort(&mut self) {
        let Some(eo) = &mut self.eo else { return };
        eo.held.clear();
        if let Some(rows) = &mut eo.by_rows {
            rows.held.clear();
        }
        eo.closing = false;
        if eo.open.take().is_some() {
            if let Err(e) = self.sink.abort().await {
                tracing::warn!(error = %e, "aborting the Kafka transaction failed; the next session's registration aborts it");
            }
            self.hot.kafka_aborts.increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_busy_stream_stretches_its_transactions_a_waiting_one_keeps_the_interval() {
        let interval = Duration::from_millis(20);
        let mut eo = ExactlyOnce::new(20, 10_000, "outbox-lsn", "history".into(), false, true, None);
        let began = Instant::now();
        eo.open = Some((began, 1));
        assert_eq!(eo.due(false), Some(began + interval), "decided once the interval is over");
        tokio::time::advance(interval).await;
        eo.waited(Duration::from_millis(2));
        assert!(!eo.should_close(false), "the loop hardly waited for the source: it goes on");
        assert_eq!(eo.due(false), Some(began + interval * STRETCH));
        tokio::time::advance(interval * (STRETCH - 1)).await;
        assert!(eo.should_close(false));

        let began = Instant::now();
        eo.open = Some((began, 1));
        eo.idle = Duration::ZERO;
        tokio::time::advance(interval).await;
        eo.waited(Duration::from_millis(15));
        assert!(eo.should_close(false), "a stream that waits for changes keeps the interval");
        assert_eq!(eo.due(true), Some(began + SPLIT_AFTER), "inside a source transaction: split only when long");
        eo.closing = true;
        assert_eq!(eo.due(false), None, "a closing transaction waits for its acknowledgements, not a timer");
    }
}
