//! The streamer loop of one shard-partition: read → publish → ordered acks → delete → checkpoint.
//!
//! ```text
//!  Source::next ──row──▶ Sink::send ──────future──▶ deliveries ──ack──▶ AckTracker
//!        ▲                                                                  │ complete prefix
//!        └──────────── Source::finish(ids, position): DELETE, then move slot ◀┘
//! ```
//!
//! The finish of an acknowledged prefix runs beside reading (one more `select!` branch): the
//! loop goes on reading and publishing while the database deletes. One finish runs at a time,
//! in order; the next prefix waits for it, so the stored position never passes an undeleted
//! row. While one runs, acknowledged rows gather for the next; past
//! [`READY_ROWS_PER_CLEANUP_ROWS`] times `cleanup_max_rows` of them, reading pauses.
//!
//! Records are produced without waiting for each other; acknowledgements are released in
//! order by [`AckTracker`]. A sink with no room ([`Offer::Full`]) is waited on as one branch
//! of the loop's `select!`: meanwhile acknowledgements, cleanup and shutdown are served, and
//! nothing more is read. One session runs until shutdown or an error: a transient error ends
//! the session after the records already sent have settled, and the caller starts a new one
//! from the last stored position (never past a gap); a definite error halts this
//! shard-partition with a message naming the row and the fix.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use metrics::{counter, gauge, histogram};
use tokio::sync::watch;

use crate::ack::{AckTracker, TxnSeq};
use crate::config::{BadRowPolicy, StreamSettings};
use crate::error::Error;
use crate::halt::HaltPoint;
use crate::lease::OwnerLease;
use crate::metrics as m;
use crate::names::StreamId;
use crate::record::OutboxRecord;
use crate::sink::{Failure, Sink, Verdict};
use crate::source::{Source, SourceEvent};
use crate::sweep::Sweep;
use bad_rows::DeadLetter;
use cleanup::{Cleaning, running};
use exactly_once::ExactlyOnce;
use handoff::{Body, InFlight, Pending};

/// The header naming the owner epoch under ZooKeeper coordination.
pub(crate) const OWNER_EPOCH_HEADER: &str = "outbox-owner-epoch";

/// How long a stopping session keeps reading to reach the commit of the transaction it is in.
const FINISH_OPEN_TXN: Duration = Duration::from_secs(2);

/// The cleanup timer's deadline while nothing waits to be deleted: it is reset as soon as a
/// prefix is ready, so an idle stream's loop has no timer ticks of its own. A lease that ends
/// meanwhile ends the session at once ([`OwnerLease::ended`](crate::lease::OwnerLease::ended)),
/// which frees the slot for the next owner.
const NOTHING_TO_CLEAN: Duration = Duration::from_secs(3600);

/// While a finish runs, reading pauses once this many times `cleanup_max_rows` acknowledged
/// rows wait for the next one: a database slower to delete than to insert slows the stream
/// instead of growing the list.
const READY_ROWS_PER_CLEANUP_ROWS: usize = 4;

/// Who this loop streams for: labels for logs, metrics and headers.
#[derive(Debug, Clone)]
pub(crate) struct StreamLabels {
    pub source: String,
    pub id: StreamId,
    pub table: String,
    /// The table's row identity column (see [`crate::layout::Layout::id_column`]).
    pub id_column: &'static str,
    /// How the database quotes an identifier in the statements a halt prints: `"` or `` ` ``.
    pub quote: char,
    /// Checked before every record and position write; its epoch is stamped on records.
    pub lease: OwnerLease,
}

impl StreamLabels {
    /// `<source>.<table>`: the name of the shard-partition's lease and of its `/readyz` line.
    pub(crate) fn key(&self) -> String {
        format!("{}.{}", self.source, self.table)
    }

    /// `name` quoted as an identifier of the stream's database, for printed statements.
    pub(crate) fn sql_name(&self, name: &str) -> String {
        let q = self.quote;
        format!("{q}{}{q}", name.replace(q, &format!("{q}{q}")))
    }

    /// `text` as a string literal of the stream's database, for printed statements (MariaDB
    /// also reads a backslash as an escape).
    pub(crate) fn sql_literal(&self, text: &str) -> String {
        let text = if self.quote == '`' { text.replace('\\', "\\\\") } else { text.to_string() };
        format!("'{}'", text.replace('\'', "''"))
    }

    pub(crate) fn metric_labels(&self) -> [(&'static str, String); 3] {
        [
            ("source", self.source.clone()),
            ("shard", self.id.shard.to_string()),
            ("partition", self.id.partition.to_string()),
        ]
    }
}

/// What a delivery was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Row,
    /// A WAL-only message (`storage = "wal"`): a row with nothing to delete.
    Message,
    /// The dead-letter copy of a bad row; its acknowledgement completes the row.
    DeadLetter,
}

/// What a record handed to the sink was, for when its outcome comes.
struct Meta {
    seq: TxnSeq,
    id: i64,
    weight: usize,
    created_at_micros: Option<i64>,
    kind: Kind,
    /// Sent with nothing else in flight: a refusal is the record's own.
    alone: bool,
    /// The record's topic when the cluster did not show it ready before: an acknowledgement
    /// confirms it.
    confirms_topic: Option<String>,
    /// The record, kept only for a possible dead-letter copy.
    record: Option<Box<OutboxRecord>>,
}

/// A record's outcome.
struct Delivered {
    meta: Meta,
    result: Result<(), Failure>,
}

/// What a shard-partition's task remembers from one session to the next.
#[derive(Debug)]
pub(crate) struct StreamMemory<P> {
    /// A prefix Kafka acknowledged whose delete (and position) failed: the next session
    /// finishes it before it reads anything, so what was acknowledged is not sent again.
    unfinished: Option<(Vec<i64>, P)>,
    /// Rows Kafka refused while they travelled with others: until they are deleted, each is
    /// sent on its own, and only a refusal then makes it a bad row (a broker refuses a batch
    /// whole, and every record of it reports the error).
    pub suspects: HashSet<i64>,
    /// The batch-refusal warning was logged.
    warned_batch_refusal: bool,
    /// While the shard-partition retries a halt: where it halted (set by the runner). The
    /// session sends that row alone and clears this once it is past it ([`HaltPoint`]).
    pub halted: Option<HaltPoint>,
    /// Where the last session halted, when the halt named a row (see [`Self::take_halt_point`]).
    last_halt: Option<HaltPoint>,
    /// Topics the cluster's metadata showed ready (or that took a record): their records go
    /// out without waiting. Others are looked up once per session first.
    topics_ok: HashSet<String>,
    /// Exactly-once: rows Kafka refused on their own, with the refusal; their transaction
    /// was aborted, and the next session dead-letters them without sending them again.
    refused: std::collections::HashMap<i64, String>,
    /// The last session finished a prefix it had published (rows deleted, or with `wal`
    /// storage the position stored): it got through. The runner then retries a later failure
    /// soon again rather than after a grown backoff.
    pub progressed: bool,
    /// The database history the last session read ([`Source::history`]).
    history: Option<String>,
}

/// More distinct topics than this and [`StreamMemory::topics_ok`] starts over (each topic is
/// then looked up once more).
const TOPICS_REMEMBERED: usize = 10_000;

impl<P> Default for StreamMemory<P> {
    fn default() -> Self {
        Self {
            unfinished: None,
            suspects: HashSet::new(),
            warned_batch_refusal: false,
            halted: None,
            last_halt: None,
            topics_ok: HashSet::new(),
            refused: std::collections::HashMap::new(),
            progressed: false,
            history: None,
        }
    }
}

impl<P> StreamMemory<P> {
    /// Where the session that just halted stopped: its row and missing topic, when it named
    /// them (a database error does not).
    pub(crate) fn take_halt_point(&mut self) -> HaltPoint {
        self.last_halt.take().unwrap_or_default()
    }

    /// The session is past the point of the halt it retried: the shard-partition streams again.
    fn past_halt(&mut self, labels: &StreamLabels) {
        if self.halted.take().is_some() {
            crate::job::set_state(labels, &labels.metric_labels(), m::state::STREAMING, None);
            tracing::info!("the cause of the halt is gone; streaming again");
        }
    }

    /// Row `id` was acknowledged or skipped: past the halt if the halt named it.
    fn past_halted_row(&mut self, labels: &StreamLabels, id: Option<i64>) {
        if id.is_some() && self.halted.as_ref().is_some_and(|h| h.row == id) {
            self.past_halt(labels);
        }
    }

    fn is_halted_row(&self, id: i64) -> bool {
        self.halted.as_ref().is_some_and(|h| h.row == Some(id))
    }

    /// The session reads `history`. What is remembered by row id or position from another
    /// history means nothing in this one (see [`crate::source`]): a promoted standby that
    /// lagged can have given the ids of rows acknowledged but not deleted to new rows, which a
    /// delete by id would lose. So it is dropped; the rows this server still holds are sent
    /// again (duplicates, never a loss).
    fn enter_history(&mut self, labels: &StreamLabels, history: String) {
        if let Some(before) = self.history.as_deref()
            && before != history
        {
            let unfinished = self.unfinished.take().map_or(0, |(ids, _)| ids.len());
            tracing::warn!(
                before,
                now = %history,
                unfinished,
                refused = self.refused.len(),
                "the database is another history than the last session's (a failover or a restore): rows acknowledged but not deleted are not deleted by id here, as this server may have given their ids to other rows; those it holds are sent again"
            );
            counter!(m::HISTORY_CHANGES, &labels.metric_labels()).increment(1);
            self.suspects.clear();
            self.refused.clear();
        }
        self.history = Some(history);
    }
}

/// Runs one session until `shutdown` turns true (returns `Ok`) or an error ends it.
/// Whatever happens, records already handed to Kafka are awaited and the acknowledged prefix
/// is deleted and checkpointed before returning.
pub(crate) async fn run_session<S: Source, K: Sink>(
    labels: &StreamLabels,
    settings: &StreamSettings,
    mut source: S,
    sink: &K,
    message_timeout: Duration,
    shutdown: &mut watch::Receiver<bool>,
    memory: &mut StreamMemory<S::Position>,
) -> Result<(), Error> {
    memory.last_halt = None;
    memory.progressed = false;
    tracing::debug!(sink = sink.name(), transactional = sink.transactional(), "session starts");
    sink.reset();
    let history = match source.history().await {
        Ok(history) => history,
        Err(e) => {
            close(source).await;
            return Err(e);
        }
    };
    memory.enter_history(labels, history.clone());
    let eo = match exactly_once::start(labels, settings, &mut source, sink, history).await {
        Ok(eo) => eo,
        Err(e) => {
            close(source).await;
            return Err(e);
        }
    };
    if let Some((ids, upto)) = memory.unfinished.take() {
        let ids: Arc<[i64]> = ids.into();
        match source.finish(ids.clone(), upto.clone()).await {
            Ok(deleted) => {
                source.finished(upto);
                tracing::info!(
                    rows = ids.len(),
                    deleted,
                    "finished the acknowledged rows the last session could not delete"
                );
                counter!(m::DELETED_ROWS, &labels.metric_labels()).increment(deleted);
                memory.past_halt(labels);
            }
            Err(e) => {
                memory.unfinished = Some((ids.to_vec(), upto));
                close(source).await;
                return Err(e);
            }
        }
    }
    let mut s = Session {
        labels,
        settings,
        sink,
        memory,
        tracker: AckTracker::new(),
        cleaning: None,
        deliveries: FuturesUnordered::new(),
        waiting: VecDeque::new(),
        in_flight_bytes: 0,
        open: None,
        label: String::new(),
        last_position: None,
        done: None,
        sweep: Sweep::default(),
        metric_labels: labels.metric_labels(),
        position_header: S::POSITION_HEADER,
        stamp_values: StampValues {
            shard: labels.id.shard.to_string(),
            partition: labels.id.partition.to_string(),
            epoch: labels.lease.epoch().map(|e| e.to_string()),
        },
        hot: HotMetrics::new(&labels.metric_labels()),
        looked_up: HashSet::new(),
        eo,
        keys: source.row_keys(),
    };
    let result = s.main_loop(&mut source, shutdown).await;
    let drained = s.drain(&mut source, message_timeout, result.is_ok()).await;
    close(source).await;
    gauge!(m::IN_FLIGHT_RECORDS, &s.metric_labels).set(0.0);
    gauge!(m::IN_FLIGHT_BYTES, &s.metric_labels).set(0.0);
    result.and(drained)
}

struct Session<'a, P, K: Sink> {
    labels: &'a StreamLabels,
    settings: &'a StreamSettings,
    sink: &'a K,
    memory: &'a mut StreamMemory<P>,
    tracker: AckTracker<P>,
    /// The finish running beside reading, if any.
    cleaning: Option<Cleaning<P>>,
    deliveries: FuturesUnordered<InFlight<K::Delivery>>,
    /// Records the sink had no room for, in order; nothing is read while any waits.
    waiting: VecDeque<Pending>,
    /// Bytes of the records handed over or waiting, not yet settled.
    in_flight_bytes: usize,
    /// The transaction being read, if any.
    open: Option<TxnSeq>,
    /// Its position label for the header.
    label: String,
    /// The position of the last transaction handed to the tracker.
    last_position: Option<P>,
    /// Everything up to here is deleted and stored (or confirmed idle).
    done: Option<P>,
    sweep: Sweep<P>,
    metric_labels: [(&'static str, String); 3],
    /// `outbox-lsn` or `outbox-gtid`.
    position_header: &'static str,
    stamp_values: StampValues,
    hot: HotMetrics,
    /// Topics whose metadata this session asked for (once each).
    looked_up: HashSet<String>,
    /// Under `delivery = "exactly-once"`: the Kafka transaction and the progress it builds on.
    eo: Option<ExactlyOnce>,
    /// The keys behind row ids, for a table identified by a key (see [`Source::row_keys`]).
    keys: Option<crate::row_keys::RowKeys>,
}

/// Header values that stay the same for a whole session, formatted once.
struct StampValues {
    shard: String,
    partition: String,
    /// The owner epoch under ZooKeeper coordination (fixed for the task's lease).
    epoch: Option<String>,
}

/// The metrics touched for every record, registered once per session: each `counter!` with
/// labels otherwise clones the labels and looks the series up again.
struct HotMetrics {
    published: metrics::Counter,
    dead_lettered: metrics::Counter,
    latency: metrics::Histogram,
    in_flight_records: metrics::Gauge,
    in_flight_bytes: metrics::Gauge,
    full_waits: metrics::Counter,
    kafka_commits: metrics::Counter,
    kafka_aborts: metrics::Counter,
    kafka_commit_seconds: metrics::Histogram,
    replayed: metrics::Counter,
}

impl HotMetrics {
    fn new(labels: &[(&'static str, String); 3]) -> Self {
        Self {
            published: counter!(m::PUBLISHED_RECORDS, labels),
            dead_lettered: counter!(m::DEAD_LETTERED_RECORDS, labels),
            latency: histogram!(m::END_TO_END_LATENCY, labels),
            in_flight_records: gauge!(m::IN_FLIGHT_RECORDS, labels),
            in_flight_bytes: gauge!(m::IN_FLIGHT_BYTES, labels),
            full_waits: counter!(m::SINK_FULL_WAITS, labels),
            kafka_commits: counter!(m::KAFKA_TXN_COMMITS, labels),
            kafka_aborts: counter!(m::KAFKA_TXN_ABORTS, labels),
            kafka_commit_seconds: histogram!(m::KAFKA_TXN_COMMIT_SECONDS, labels),
            replayed: counter!(m::SKIPPED_REPLAYED_ROWS, labels),
        }
    }
}

impl<P: Clone + std::fmt::Display + Send + Sync + 'static, K: Sink> Session<'_, P, K> {
    async fn main_loop<S: Source<Position = P>>(
        &mut self,
        source: &mut S,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Error> {
        let cleanup_every = Duration::from_millis(self.settings.cleanup_interval_ms);
        let mut last_cleanup = tokio::time::Instant::now();
        let cleanup = tokio::time::sleep_until(last_cleanup + NOTHING_TO_CLEAN);
        tokio::pin!(cleanup);
        let lease = self.labels.lease.clone();
        let lease_ended = lease.ended();
        tokio::pin!(lease_ended);
        let sweep_every = Duration::from_millis(self.settings.sweep_interval_ms);
        let mut sweep = tokio::time::interval_at(tokio::time::Instant::now() + sweep_every, sweep_every);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let budget = self.settings.max_in_flight_bytes as usize;
        // After a shutdown request, a transaction already being read is read to its commit
        // (for a short while), so its rows can be deleted rather than sent again by the next
        // owner.
        let mut finish_by: Option<tokio::time::Instant> = None;
        // Nanoseconds the loop waited for the source since the last turn (exactly-once sizes
        // its transactions by it).
        let waited_for_source = std::sync::atomic::AtomicU64::new(0);
        let sweeps = source.sweeps();
        loop {
            let waited = waited_for_source.swap(0, std::sync::atomic::Ordering::Relaxed);
            if let Some(eo) = &mut self.eo {
                eo.waited(Duration::from_nanos(waited));
            }
            if *shutdown.borrow() {
                let deadline = *finish_by.get_or_insert_with(|| tokio::time::Instant::now() + FINISH_OPEN_TXN);
                if self.open.is_none() || tokio::time::Instant::now() >= deadline {
                    return Ok(());
                }
            }
            self.eo_turn::<S>().await?;
            let txn_due = self.eo.as_ref().and_then(|eo| eo.due(self.open.is_some()));
            // The cleanup timer runs only while a prefix waits to be deleted.
            let due = last_cleanup + if self.tracker.has_ready() { cleanup_every } else { NOTHING_TO_CLEAN };
            if cleanup.deadline() != due {
                cleanup.as_mut().reset(due);
            }
            // Priorities: 1 shutdown, 2 acknowledgements, 3 a finish that ended, 4 room in the
            // sink for waiting records, 5 the next cleanup, 6 the sweep (between transactions
            // only), 7 new changes.
            let sink = self.sink;
            let cleaning_runs = self.cleaning.is_some();
            let ready_limit = self.settings.cleanup_max_rows.saturating_mul(READY_ROWS_PER_CLEANUP_ROWS);
            let may_read = self.in_flight_bytes < budget
                && self.waiting.is_empty()
                && !self.eo.as_ref().is_some_and(|eo| eo.closing)
                && !(cleaning_runs && self.tracker.ready_rows() >= ready_limit);
            let cleaning = &mut self.cleaning;
            tokio::select! {
                biased;
                changed = shutdown.changed(), if finish_by.is_none() => {
                    if changed.is_err() {
                        // Nobody can stop this session any more in order: stop now.
                        return Ok(());
                    }
                    continue;
                }
                _ = tokio::time::sleep_until(finish_by.unwrap_or_else(tokio::time::Instant::now)), if finish_by.is_some() => continue,
                _ = &mut lease_ended => {
                    self.labels.lease.check().map_err(Error::fenced)?;
                    // Trusted again (a late answer renewed the session): keep watching.
                    lease_ended.set(lease.ended());
                }
                Some(d) = self.deliveries.next(), if !self.deliveries.is_empty() => {
                    self.settle_one(d).await?;
                }
                result = running(cleaning), if cleaning_runs => {
                    self.cleaned(source, result)?;
                }
                _ = sink.ready(), if !self.waiting.is_empty() => {
                    self.flush_waiting().await?;
                }
                _ = &mut cleanup, if !cleaning_runs => {
                    last_cleanup = tokio::time::Instant::now();
                    self.start_cleanup(source)?;
                }
                _ = tokio::time::sleep_until(txn_due.unwrap_or_else(tokio::time::Instant::now)), if txn_due.is_some() => {}
                _ = sweep.tick(), if sweeps && self.open.is_none() && finish_by.is_none() => {
                    self.sweep(source).await?;
                }
                event = waited::Waited::new(source.next(), &waited_for_source), if may_read => {
                    match event? {
                        Some(SourceEvent::Drained) => return Ok(()),
                        Some(event) => self.on_event(source, event).await?,
                        None => return Err(Error::transient("the server ended the stream")),
                    }
                }
            }
            if self.tracker.ready_rows() >= self.settings.cleanup_max_rows {
                self.start_cleanup(source)?;
            }
        }
    }

    async fn on_event<S: Source<Position = P>>(&mut self, source: &mut S, event: SourceEvent<P>) -> Result<(), Error> {
        match event {
            SourceEvent::Begin { label } => {
                self.open = Some(self.tracker.begin());
                self.eo_begin(source, &label)?;
                self.label = label;
            }
            SourceEvent::Row(row) => {
                let seq = self.open.ok_or_else(|| Error::transient("a row arrived outside a transaction"))?;
                let (id, message) = match &row {
                    Ok(record) => (Some(record.id), !record.in_table),
                    Err(invalid) => (invalid.id, invalid.message_at.is_some()),
                };
                if self.eo_row_covered() {
                    // In Kafka already (a committed transaction's progress record says so):
                    // deleted with its transaction, not sent again.
                    self.tracker.sent(seq, id.filter(|_| !message));
                    self.tracker.acked(seq);
                    self.hot.replayed.increment(1);
                    return Ok(());
                }
                if source.skips(id, message, &self.label) {
                    counter!(m::SKIPPED_ROWS, &kind_labels(&self.metric_labels, "operator")).increment(1);
                    tracing::warn!(
                        row_id = id,
                        transaction = %self.label,
                        "row skipped as `outbox-streamer skip` asked; it is not published"
                    );
                    self.tracker.skipped(seq);
                    self.memory.past_halted_row(self.labels, id);
                    return Ok(());
                }
                match row {
                    Ok(record) => self.publish(seq, record).await?,
                    Err(invalid) => self.on_invalid_row(source, seq, invalid).await?,
                }
            }
            SourceEvent::Commit(position) => {
                let seq = self.open.take().ok_or_else(|| Error::transient("a commit without a begin"))?;
                self.eo_commit();
                self.last_position = Some(position.clone());
                self.tracker.commit(seq, position);
            }
            SourceEvent::Idle(position) => {
                // Not while a finish runs: the position would pass rows not yet deleted.
                if self.tracker.is_idle()
                    && self.open.is_none()
                    && self.deliveries.is_empty()
                    && self.cleaning.is_none()
                {
                    source.confirm_idle(position.clone());
                    self.done = Some(position);
                    // Nothing is pending up to here: a halt that named no row is behind.
                    if self.memory.halted.as_ref().is_some_and(|h| h.row.is_none()) {
                        self.memory.past_halt(self.labels);
                    }
                }
            }
            SourceEvent::Drained => {}
        }
        Ok(())
    }

    /// Hands a record to the sink. Some records go alone — everything in flight settles first,
    /// then the record is sent and its verdict awaited before anything else: one the sink
    /// refused earlier while it travelled with others (a suspect), the row a halt being retried
    /// named, and the first record to a topic the broker does not show ready (a missing topic
    /// then halts the stream with nothing after the row sent).
    async fn publish(&mut self, seq: TxnSeq, record: OutboxRecord) -> Result<(), Error> {
        self.labels.lease.check().map_err(Error::fenced)?;
        // Kept until the row is deleted: the transaction carrying the copy may abort too.
        if let Some(reason) = self.memory.refused.get(&record.id).cloned() {
            self.tracker.sent(seq, record.in_table.then_some(record.id));
            return self.dead_letter(DeadLetter::of(seq, reason, record)).await;
        }
        let suspect = self.memory.suspects.contains(&record.id);
        let unconfirmed_topic = self.topic_unconfirmed(&record.topic).await;
        let alone = suspect || self.memory.is_halted_row(record.id) || unconfirmed_topic;
        // Only a record nothing else is sent with until its verdict travels alone: records
        // sent after one can still join its batch.
        if alone {
            self.settle_all().await?;
        }
        let weight = record.weight();
        let meta = Meta {
            seq,
            id: record.id,
            weight,
            created_at_micros: record.created_at_micros,
            kind: if record.in_table { Kind::Row } else { Kind::Message },
            alone,
            confirms_topic: unconfirmed_topic.then(|| record.topic.clone()),
            record: None,
        };
        self.tracker.sent(seq, record.in_table.then_some(record.id));
        self.in_flight_bytes += weight;
        if let Some(refused) = self.offer(Pending { meta, body: Body::Row(record), label: None })? {
            return self.settle_one(refused).await;
        }
        self.update_gauges();
        if alone {
            self.settle_all().await?;
        }
        Ok(())
    }

    /// Handles one settled delivery, and the dead-letter copy it may call for.
    async fn settle_one(&mut self, d: Delivered) -> Result<(), Error> {
        if let Some(copy) = self.on_delivery(d).await? {
            self.dead_letter(copy).await?;
        }
        Ok(())
    }

    async fn on_delivery(&mut self, d: Delivered) -> Result<Option<DeadLetter>, Error> {
        let Delivered { meta: d, result } = d;
        self.in_flight_bytes -= d.weight;
        self.update_gauges();
        let failure = match result {
            Ok(()) => {
                match &mut self.eo {
                    Some(eo) => eo.hold(d.seq, d.id),
                    None => self.tracker.acked(d.seq),
                }
                if let Some(topic) = d.confirms_topic {
                    self.confirm_topic(topic);
                }
                self.memory.past_halted_row(self.labels, Some(d.id));
                if d.kind == Kind::DeadLetter {
                    self.hot.dead_lettered.increment(1);
                } else {
                    self.hot.published.increment(1);
                }
                if d.alone && self.memory.suspects.contains(&d.id) && !self.memory.warned_batch_refusal {
                    self.memory.warned_batch_refusal = true;
                    tracing::warn!(
                        row_id = d.id,
                        "Kafka accepted alone a row it had refused in a batch: the topic's (or broker's) max.message.bytes is below the producer's batch size; set kafka.properties.\"batch.size\" at or below it"
                    );
                }
                if let Some(created) = d.created_at_micros {
                    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |t| t.as_micros() as i64);
                    // A forged WAL-only envelope may carry any created_at: never overflow.
                    self.hot.latency.record(now.saturating_sub(created).max(0) as f64 / 1e6);
                }
                return Ok(None);
            }
            Err(f) if f.verdict == Verdict::Unsure => self.sink.recheck(f).await,
            Err(f) => f,
        };
        if !failure.verdict.is_definite() {
            counter!(m::ERRORS, &kind_labels(&self.metric_labels, "kafka_transient")).increment(1);
            return Err(Error::transient(format!(
                "delivery of row id={} failed: {failure}; resending from the last confirmed position",
                d.id
            )));
        }
        if d.kind == Kind::DeadLetter {
            return Err(self.halt(
                Some(d.id),
                &format!("its dead-letter record was refused too: {failure}; the row stays in the table"),
                "make sure the dead-letter topic exists and accepts records this large (max.message.bytes), then restart",
            ));
        }
        // A refusal of the record's own (too large, invalid) may be its batch's.
        if !d.alone && failure.verdict == Verdict::Record {
            self.memory.suspects.insert(d.id);
            return Err(Error::transient(format!(
                "{} refused row id={} ({failure}) in a batch; it is sent again on its own to tell a bad record from a refused batch",
                self.sink.name(),
                d.id
            )));
        }
        counter!(m::ERRORS, &kind_labels(&self.metric_labels, "kafka_definite")).increment(1);
        self.memory.suspects.remove(&d.id);
        let reason = format!("{} refused it: {failure}", self.sink.name());
        if self.eo.is_some() && self.settings.on_bad_row == BadRowPolicy::DeadLetter {
            // The refusal spoiled the Kafka transaction: it is aborted, and the next session
            // sends the dead-letter copy in its place.
            self.memory.refused.insert(d.id, reason);
            return Err(Error::transient(format!(
                "{} refused row id={} on its own; the Kafka transaction is aborted and the row goes to the dead-letter topic in the next one",
                self.sink.name(),
                d.id
            )));
        }
        match (self.settings.on_bad_row, d.record) {
            (BadRowPolicy::DeadLetter, Some(record)) => Ok(Some(DeadLetter::of(d.seq, reason, *record))),
            _ => {
                let halt = if d.kind == Kind::Message {
                    let place = format!("at the WAL-only message outbox-id={} of {}: ", d.id, self.labels.table);
                    // It is in no table: `skip --message` discards it, not `--id`.
                    let fix = format!(
                        "{}; this WAL-only message is discarded with `outbox-streamer skip --stream {}/{} --message {}` (not --id)",
                        failure.fix, self.labels.source, self.labels.id, d.id
                    );
                    self.halt_at(Some(d.id), &place, &reason, &fix)
                } else {
                    self.halt(Some(d.id), &reason, failure.fix)
                };
                if failure.verdict == Verdict::MissingTopic
                    && let Some(topic) = failure.topic
                {
                    self.memory.topics_ok.remove(&topic);
                    if let Some(point) = &mut self.memory.last_halt {
                        point.missing_topic = Some(topic);
                    }
                }
                Err(halt)
            }
        }
    }

    /// Whether the cluster has not shown `topic` ready yet: looked up once per session until
    /// it does (or a record to it is acknowledged). A metadata lookup that fails counts as
    /// ready: Kafka unreachable ends the session anyway, and a record's own error still halts.
    async fn topic_unconfirmed(&mut self, topic: &str) -> bool {
        if self.memory.topics_ok.contains(topic) || !self.looked_up.insert(topic.to_string()) {
            return false;
        }
        match self.sink.topic_ready(topic).await {
            Some(true) => {
                self.confirm_topic(topic.to_string());
                false
            }
            Some(false) => true,
            None => false,
        }
    }

    fn confirm_topic(&mut self, topic: String) {
        if self.memory.topics_ok.len() >= TOPICS_REMEMBERED {
            self.memory.topics_ok.clear();
        }
        self.memory.topics_ok.insert(topic);
    }

    /// After the main loop: wait for records already handed to Kafka (bounded by the message
    /// timeout), then delete and checkpoint the acknowledged prefix.
    async fn drain<S: Source<Position = P>>(
        &mut self,
        source: &mut S,
        message_timeout: Duration,
        clean: bool,
    ) -> Result<(), Error> {
        let deadline = Instant::now() + message_timeout + Duration::from_secs(5);
        let mut first_error = None;
        while !self.deliveries.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.deliveries.next()).await {
                Ok(Some(d)) => {
                    if let Err(e) = self.on_delivery_draining(d).await {
                        first_error.get_or_insert(e);
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    tracing::warn!(
                        pending = self.deliveries.len(),
                        "records still unacknowledged at the drain deadline; they will be resent"
                    );
                    break;
                }
            }
        }
        let ended = self.eo_end::<S>(clean && first_error.is_none()).await;
        let mut cleaned = self.cleanup_now(source).await.and(ended);
        if cleaned.is_ok() && clean && first_error.is_none() {
            cleaned = self.eo_tidy::<S>().await;
        }
        match first_error {
            Some(e) => Err(e),
            None => cleaned,
        }
    }

    async fn on_delivery_draining(&mut self, d: Delivered) -> Result<(), Error> {
        let Err(failure) = &d.result else {
            return self.on_delivery(d).await.map(|_| ());
        };
        // A failure while draining only ends intake; its row stays in the table and is resent
        // (alone, if the sink refused it in a batch).
        let meta = &d.meta;
        self.in_flight_bytes -= meta.weight;
        if meta.kind != Kind::DeadLetter && failure.verdict.is_definite() && !meta.alone {
            self.memory.suspects.insert(meta.id);
        }
        Err(Error::transient(format!("delivery of row id={} failed while draining", meta.id)))
    }

    fn update_gauges(&self) {
        self.hot.in_flight_records.set(self.deliveries.len() as f64);
        self.hot.in_flight_bytes.set(self.in_flight_bytes as f64);
    }
}

/// Ends a session's database sessions. A dead link must not hold the shard-partition:
/// closing gets a few seconds, then the connections are simply dropped.
async fn close<S: Source>(source: S) {
    if tokio::time::timeout(Duration::from_secs(5), source.close()).await.is_err() {
        tracing::warn!("closing the database sessions timed out; dropped them");
    }
}

pub(crate) fn kind_labels(base: &[(&'static str, String); 3], kind: &'static str) -> [(&'static str, String); 4] {
    let [a, b, c] = base.clone();
    [a, b, c, ("kind", kind.to_string())]
}

mod bad_rows;
mod cleanup;
mod exactly_once;
mod handoff;
mod stranded;
#[cfg(test)]
mod tests;
mod waited;
