//! The streamer loop of one shard-partition: read → publish → ordered acks → delete → checkpoint.
//!
//! ```text
//!  Source::next ──row──▶ Producer::enqueue ──future──▶ deliveries ──ack──▶ AckTracker
//!        ▲                                                                  │ complete prefix
//!        └──────────── Source::finish(ids, position): DELETE, then move slot ◀┘
//! ```
//!
//! Records are produced without waiting for each other; acknowledgements are released in
//! order by [`AckTracker`]. One session runs until shutdown or an error: a transient error ends
//! the session after the records already sent have settled, and the caller starts a new one
//! from the last stored position (never past a gap); a definite error halts this
//! shard-partition with a message naming the row and the fix.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use metrics::{counter, gauge, histogram};
use outbox_kafka::classify::hint;
use outbox_kafka::{Class, KafkaError, Outgoing, Producer, classify};
use tokio::sync::watch;

use crate::ack::{AckTracker, TxnSeq};
use crate::config::{BadRowPolicy, StreamSettings};
use crate::lease::OwnerLease;
use crate::metrics as m;
use crate::names::StreamId;
use crate::record::{InvalidRow, OutboxRecord};
use crate::source::{Source, SourceError, SourceEvent};

/// The header naming the owner epoch under ZooKeeper coordination.
pub const OWNER_EPOCH_HEADER: &str = "outbox-owner-epoch";

/// How long a stopping session keeps reading to reach the commit of the transaction it is in.
const FINISH_OPEN_TXN: Duration = Duration::from_secs(2);

/// Rows buffered per existence check while replaying after a reconnect.
const VERIFY_CHUNK: usize = 1024;

/// Who this loop streams for: labels for logs, metrics and headers.
#[derive(Debug, Clone)]
pub struct StreamLabels {
    pub source: String,
    pub id: StreamId,
    pub table: String,
    /// Checked before every record and position write; its epoch is stamped on records.
    pub lease: OwnerLease,
}

impl StreamLabels {
    /// `<source>.<table>`: the name of the shard-partition's lease and of its `/readyz` line.
    pub fn key(&self) -> String {
        format!("{}.{}", self.source, self.table)
    }

    pub fn metric_labels(&self) -> [(&'static str, String); 3] {
        [
            ("source", self.source.clone()),
            ("shard", self.id.shard.to_string()),
            ("partition", self.id.partition.to_string()),
        ]
    }
}

/// How a session ended other than by shutdown.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("{0}")]
    Transient(String),
    /// Operator action needed; the message names the row or setting and the fix. The runner
    /// prefixes it with the shard-partition.
    #[error("{0}")]
    Halt(String),
    /// See [`SourceError::PositionLost`].
    #[error("{0}")]
    PositionLost(String),
    /// This instance may no longer own the shard-partition; nothing more is produced or
    /// written, and the task ends (ownership decides whether it starts again).
    #[error("{0}")]
    Revoked(String),
    /// See [`SourceError::Busy`].
    #[error("{0}")]
    Busy(String),
}

impl From<SourceError> for SessionError {
    fn from(e: SourceError) -> Self {
        match e {
            SourceError::Transient(m) => SessionError::Transient(m),
            d @ SourceError::Definite { .. } => SessionError::Halt(d.to_string()),
            SourceError::PositionLost(m) => SessionError::PositionLost(m),
            SourceError::Fenced(m) => SessionError::Revoked(m),
            SourceError::Busy(m) => SessionError::Busy(m),
        }
    }
}

type Delivery = Pin<Box<dyn Future<Output = Delivered> + Send>>;

struct Delivered {
    seq: TxnSeq,
    id: i64,
    weight: usize,
    created_at_micros: Option<i64>,
    dead_letter: bool,
    result: Result<(), KafkaError>,
    /// The record's topic when its delivery failed (see [`definite_unknown_topic`]).
    failed_topic: Option<String>,
    /// The record, kept only for a possible dead-letter copy.
    record: Option<Box<OutboxRecord>>,
}

/// librdkafka reports a missing topic either as its own `UnknownTopic` (definite) or, once the
/// broker answered, as the broker's `UnknownTopicOrPartition`, which is also what a topic being
/// created or a moving partition looks like. The cluster's metadata decides: a topic it does
/// not know is definite, anything else is retried.
async fn definite_unknown_topic(producer: &Producer, e: &KafkaError, topic: &str) -> bool {
    e.rdkafka_error_code() == Some(outbox_kafka::ErrorCode::UnknownTopicOrPartition)
        && producer.topic_missing(topic).await
}

/// Runs one session until `shutdown` turns true (returns `Ok`) or an error ends it.
/// Whatever happens, records already handed to Kafka are awaited and the acknowledged prefix
/// is deleted and checkpointed before returning.
pub async fn run_session<S: Source>(
    labels: &StreamLabels,
    settings: &StreamSettings,
    mut source: S,
    producer: &Producer,
    message_timeout: Duration,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), SessionError> {
    let mut s = Session {
        labels,
        settings,
        producer,
        tracker: AckTracker::new(),
        deliveries: FuturesUnordered::new(),
        in_flight_bytes: 0,
        open: None,
        label: String::new(),
        verifying: true,
        verify_buf: Vec::new(),
        verify_all_present: true,
        replay_skipped: 0,
        metric_labels: labels.metric_labels(),
        position_header: S::POSITION_HEADER,
    };
    let result = s.main_loop(&mut source, shutdown).await;
    let drained = s.drain(&mut source, message_timeout).await;
    // A dead link must not hold the shard-partition: closing gets a few seconds, then the
    // connections are simply dropped.
    if tokio::time::timeout(Duration::from_secs(5), source.close()).await.is_err() {
        tracing::warn!("closing the database sessions timed out; dropped them");
    }
    gauge!(m::IN_FLIGHT_RECORDS, &s.metric_labels).set(0.0);
    gauge!(m::IN_FLIGHT_BYTES, &s.metric_labels).set(0.0);
    result.and(drained)
}

struct Session<'a> {
    labels: &'a StreamLabels,
    settings: &'a StreamSettings,
    producer: &'a Producer,
    tracker: AckTracker<PositionBox>,
    deliveries: FuturesUnordered<Delivery>,
    in_flight_bytes: usize,
    /// The transaction being read, if any.
    open: Option<TxnSeq>,
    /// Its position label for the header.
    label: String,
    /// True until the first replayed transaction whose rows are all still in the table.
    verifying: bool,
    verify_buf: Vec<OutboxRecord>,
    verify_all_present: bool,
    /// Replayed rows not sent again in this session, logged once when replay ends.
    replay_skipped: usize,
    metric_labels: [(&'static str, String); 3],
    /// `outbox-lsn` or `outbox-gtid`.
    position_header: &'static str,
}

/// Positions are stored type-erased in the tracker so `Session` need not be generic.
type PositionBox = Box<dyn std::any::Any + Send>;

impl Session<'_> {
    async fn main_loop<S: Source>(
        &mut self,
        source: &mut S,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), SessionError> {
        let mut cleanup = tokio::time::interval(Duration::from_millis(self.settings.cleanup_interval_ms));
        cleanup.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let budget = self.settings.max_in_flight_bytes as usize;
        // After a shutdown request, a transaction already being read is read to its commit
        // (for a short while), so its rows can be deleted rather than sent again by the next
        // owner.
        let mut finish_by: Option<tokio::time::Instant> = None;
        loop {
            if *shutdown.borrow() {
                let deadline = *finish_by.get_or_insert_with(|| tokio::time::Instant::now() + FINISH_OPEN_TXN);
                if self.open.is_none() || tokio::time::Instant::now() >= deadline {
                    return Ok(());
                }
            }
            // Priorities: 1 shutdown, 2 Kafka acknowledgements, 3 cleanup, 4 new changes.
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
                Some(d) = self.deliveries.next(), if !self.deliveries.is_empty() => {
                    self.on_delivery(d).await?;
                }
                _ = cleanup.tick() => {
                    self.cleanup(source).await?;
                }
                event = source.next(), if self.in_flight_bytes < budget => {
                    match event? {
                        Some(SourceEvent::Drained) => return Ok(()),
                        Some(event) => self.on_event(source, event).await?,
                        None => return Err(SessionError::Transient("the server ended the stream".into())),
                    }
                }
            }
            if self.tracker.ready_rows() >= self.settings.cleanup_max_rows {
                self.cleanup(source).await?;
            }
        }
    }

    async fn on_event<S: Source>(
        &mut self,
        source: &mut S,
        event: SourceEvent<S::Position>,
    ) -> Result<(), SessionError> {
        match event {
            SourceEvent::Begin { label } => {
                self.open = Some(self.tracker.begin());
                self.label = label;
                self.verify_all_present = true;
            }
            SourceEvent::Row(row) => {
                let seq =
                    self.open.ok_or_else(|| SessionError::Transient("a row arrived outside a transaction".into()))?;
                match row {
                    Ok(record) if self.verifying => {
                        self.verify_buf.push(record);
                        if self.verify_buf.len() >= VERIFY_CHUNK {
                            self.flush_verified(source, seq).await?;
                        }
                    }
                    Ok(record) => self.publish(seq, record, false).await?,
                    Err(invalid) => {
                        // Rows before it (buffered while replaying) go first: order within the
                        // transaction holds for bad rows too.
                        if self.verifying {
                            self.flush_verified(source, seq).await?;
                        }
                        self.on_invalid_row(seq, invalid).await?
                    }
                }
            }
            SourceEvent::Commit(position) => {
                let seq = self.open.take().ok_or_else(|| SessionError::Transient("a commit without a begin".into()))?;
                if self.verifying {
                    self.flush_verified(source, seq).await?;
                    if self.verify_all_present {
                        self.verifying = false;
                        if self.replay_skipped > 0 {
                            tracing::info!(
                                skipped = self.replay_skipped,
                                "replay after reconnect done: rows already published and deleted were not sent again"
                            );
                        }
                    }
                }
                self.tracker.commit(seq, Box::new(position));
            }
            SourceEvent::Idle(position) => {
                if self.tracker.is_idle() && self.open.is_none() && self.deliveries.is_empty() {
                    source.confirm_idle(position);
                }
            }
            SourceEvent::Drained => {}
        }
        Ok(())
    }

    /// Publishes the buffered replayed rows that are still in the table; the others were
    /// published and deleted before the restart.
    async fn flush_verified<S: Source>(&mut self, source: &mut S, seq: TxnSeq) -> Result<(), SessionError> {
        if self.verify_buf.is_empty() {
            return Ok(());
        }
        let rows = std::mem::take(&mut self.verify_buf);
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        let existing = source.existing(&ids).await?;
        let skipped = rows.len() - existing.len();
        if skipped > 0 {
            self.verify_all_present = false;
            counter!(m::SKIPPED_REPLAYED_ROWS, &self.metric_labels).increment(skipped as u64);
            self.replay_skipped += skipped;
        }
        for record in rows {
            if existing.binary_search(&record.id).is_ok() {
                self.publish(seq, record, false).await?;
            } else {
                self.tracker.skipped(seq);
            }
        }
        Ok(())
    }

    async fn publish(&mut self, seq: TxnSeq, record: OutboxRecord, dead_letter: bool) -> Result<(), SessionError> {
        self.labels.lease.check().map_err(SessionError::Revoked)?;
        let mut headers = record.headers.clone();
        headers.push(("outbox-id".into(), record.id.to_string().into_bytes()));
        headers.push(("outbox-shard".into(), self.labels.id.shard.to_string().into_bytes()));
        headers.push(("outbox-partition".into(), self.labels.id.partition.to_string().into_bytes()));
        headers.push((self.position_header.into(), self.label.clone().into_bytes()));
        if let Some(epoch) = self.labels.lease.epoch() {
            headers.push((OWNER_EPOCH_HEADER.into(), epoch.to_string().into_bytes()));
        }
        let out = Outgoing {
            topic: &record.topic,
            key: record.key.as_deref(),
            payload: record.payload.as_deref(),
            partition: record.kafka_partition,
            headers: &headers,
        };
        let weight = record.weight();
        let id = record.id;
        let created_at_micros = record.created_at_micros;
        match self.producer.enqueue(&out).await {
            Ok(fut) => {
                if !dead_letter {
                    self.tracker.sent(seq, id);
                }
                let keep =
                    (self.settings.on_bad_row == BadRowPolicy::DeadLetter && !dead_letter).then(|| Box::new(record));
                self.in_flight_bytes += weight;
                self.deliveries.push(Box::pin(async move {
                    let (result, failed_topic) = match fut.await {
                        Ok(Ok(_)) => (Ok(()), None),
                        Ok(Err((e, message))) => (Err(e), Some(outbox_kafka::producer::topic_of(&message))),
                        Err(_) => (Err(KafkaError::Canceled), None),
                    };
                    Delivered { seq, id, weight, created_at_micros, dead_letter, result, failed_topic, record: keep }
                }));
                self.update_gauges();
                Ok(())
            }
            Err(e) => {
                // Refused before it was queued (for example larger than message.max.bytes).
                if !dead_letter {
                    self.tracker.sent(seq, id);
                }
                self.in_flight_bytes += weight;
                let d = Delivered {
                    seq,
                    id,
                    weight,
                    created_at_micros,
                    dead_letter,
                    result: Err(e),
                    failed_topic: Some(record.topic.clone()),
                    record: Some(Box::new(record)),
                };
                Box::pin(self.on_delivery(d)).await
            }
        }
    }

    async fn on_delivery(&mut self, mut d: Delivered) -> Result<(), SessionError> {
        self.in_flight_bytes -= d.weight;
        self.update_gauges();
        if let (Err(e), Some(topic)) = (&d.result, &d.failed_topic)
            && definite_unknown_topic(self.producer, e, topic).await
        {
            d.result = Err(KafkaError::MessageProduction(outbox_kafka::ErrorCode::UnknownTopic));
        }
        match d.result {
            Ok(()) => {
                self.tracker.acked(d.seq);
                if d.dead_letter {
                    counter!(m::DEAD_LETTERED_RECORDS, &self.metric_labels).increment(1);
                } else {
                    counter!(m::PUBLISHED_RECORDS, &self.metric_labels).increment(1);
                }
                if let Some(created) = d.created_at_micros {
                    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |t| t.as_micros() as i64);
                    histogram!(m::END_TO_END_LATENCY, &self.metric_labels).record((now - created).max(0) as f64 / 1e6);
                }
                Ok(())
            }
            Err(e) if classify(&e) == Class::Definite && !d.dead_letter => {
                counter!(m::ERRORS, &kind_labels(&self.metric_labels, "kafka_definite")).increment(1);
                let reason = format!("Kafka refused it: {e}");
                match (self.settings.on_bad_row, d.record) {
                    (BadRowPolicy::DeadLetter, Some(record)) => {
                        let size_error = matches!(
                            e.rdkafka_error_code(),
                            Some(
                                outbox_kafka::ErrorCode::MessageSizeTooLarge
                                    | outbox_kafka::ErrorCode::InvalidMessageSize
                            )
                        );
                        self.dead_letter(d.seq, *record, &reason, size_error).await
                    }
                    _ => Err(self.halt(Some(d.id), &reason, hint(&e))),
                }
            }
            Err(e) if classify(&e) == Class::Definite => Err(self.halt(
                Some(d.id),
                &format!("its dead-letter record was refused too: {e}"),
                "check the dead-letter topic exists and accepts records",
            )),
            Err(e) => {
                counter!(m::ERRORS, &kind_labels(&self.metric_labels, "kafka_transient")).increment(1);
                Err(SessionError::Transient(format!(
                    "delivery of row id={} failed: {e}; resending from the last confirmed position",
                    d.id
                )))
            }
        }
    }

    async fn on_invalid_row(&mut self, seq: TxnSeq, invalid: InvalidRow) -> Result<(), SessionError> {
        counter!(m::ERRORS, &kind_labels(&self.metric_labels, "bad_row")).increment(1);
        let Some(id) = invalid.id else {
            return Err(self.halt(None, &invalid.to_string(), "the row has no usable id; inspect the table"));
        };
        match self.settings.on_bad_row {
            BadRowPolicy::Halt => Err(self.halt(
                Some(id),
                &invalid.to_string(),
                "fix or delete the row, then restart; or set on_bad_row = \"dead-letter\"",
            )),
            BadRowPolicy::DeadLetter => {
                self.tracker.sent(seq, id);
                let record = OutboxRecord {
                    id,
                    topic: String::new(),
                    key: None,
                    payload: None,
                    headers: Vec::new(),
                    kafka_partition: None,
                    created_at_micros: None,
                };
                self.dead_letter(seq, record, &invalid.to_string(), false).await
            }
        }
    }

    /// Sends a bad row to the dead-letter topic; its acknowledgement completes the row.
    async fn dead_letter(
        &mut self,
        seq: TxnSeq,
        record: OutboxRecord,
        reason: &str,
        drop_payload: bool,
    ) -> Result<(), SessionError> {
        let topic = self.settings.dead_letter_topic.clone().expect("validated: dead-letter policy names a topic");
        tracing::warn!(row_id = record.id, reason, dead_letter_topic = %topic, "bad row sent to the dead-letter topic");
        let mut headers = record.headers.clone();
        headers.push(("outbox-dead-letter-reason".into(), reason.as_bytes().to_vec()));
        headers.push(("outbox-original-topic".into(), record.topic.clone().into_bytes()));
        let payload = if drop_payload {
            let size = record.payload.as_ref().map_or(0, Vec::len);
            headers.push(("outbox-dead-letter-payload-bytes".into(), size.to_string().into_bytes()));
            None
        } else {
            record.payload
        };
        let dl = OutboxRecord { topic, headers, payload, kafka_partition: None, ..record };
        // The row already counts as sent in the tracker; the dead-letter ack settles it.
        Box::pin(self.publish(seq, dl, true)).await
    }

    fn halt(&self, id: Option<i64>, reason: &str, fix: &str) -> SessionError {
        let row = id.map_or_else(String::new, |id| format!("at row id={id} of {}: ", self.labels.table));
        SessionError::Halt(format!("{row}{reason}; fix: {fix}"))
    }

    async fn cleanup<S: Source>(&mut self, source: &mut S) -> Result<(), SessionError> {
        self.labels.lease.check().map_err(SessionError::Revoked)?;
        if !self.tracker.has_ready() {
            return Ok(());
        }
        let Some((ids, position)) = self.tracker.take_ready() else { return Ok(()) };
        let position = *position.downcast::<S::Position>().expect("positions come from this source");
        let deleted = source.finish(ids, position).await?;
        counter!(m::DELETED_ROWS, &self.metric_labels).increment(deleted);
        Ok(())
    }

    /// After the main loop: wait for records already handed to Kafka (bounded by the message
    /// timeout), then delete and checkpoint the acknowledged prefix.
    async fn drain<S: Source>(&mut self, source: &mut S, message_timeout: Duration) -> Result<(), SessionError> {
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
        let cleaned = self.cleanup(source).await;
        match first_error {
            Some(e) => Err(e),
            None => cleaned,
        }
    }

    async fn on_delivery_draining(&mut self, d: Delivered) -> Result<(), SessionError> {
        if d.result.is_ok() {
            return self.on_delivery(d).await;
        }
        // A failure while draining only ends intake; its row stays in the table and is resent.
        self.in_flight_bytes -= d.weight;
        Err(SessionError::Transient(format!("delivery of row id={} failed while draining", d.id)))
    }

    fn update_gauges(&self) {
        gauge!(m::IN_FLIGHT_RECORDS, &self.metric_labels).set(self.deliveries.len() as f64);
        gauge!(m::IN_FLIGHT_BYTES, &self.metric_labels).set(self.in_flight_bytes as f64);
    }
}

fn kind_labels(base: &[(&'static str, String); 3], kind: &'static str) -> [(&'static str, String); 4] {
    let [a, b, c] = base.clone();
    [a, b, c, ("kind", kind.to_string())]
}
