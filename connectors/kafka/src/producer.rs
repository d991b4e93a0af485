//! An idempotent producer that enqueues without waiting for each record.
//!
//! # Delivery reports without a thread
//!
//! librdkafka hands delivery reports over only when its main queue is polled. rdkafka's
//! `ThreadedProducer` polls from a thread of its own in 100 ms windows and spins through the
//! last fraction of a millisecond of every window (its deadline is rounded down to whole
//! milliseconds): measured here, about 1 % of a core per producer with traffic, plus a thread
//! hand-over for every report. This producer asks librdkafka to call back when its main queue
//! goes from empty to non-empty (`rd_kafka_queue_cb_event_enable`); the callback only wakes a
//! task on the runtime, which serves the queue without blocking until it is empty (and once at
//! the start: what librdkafka queued while the client was created came before the callback).
//! Nothing runs while nothing happens, but for a look every [`SAFETY_POLL`].
//!
//! The task lives on the runtime that created the producer. If that runtime ends first, the
//! producer refuses new records ([`Offer::Refused`] with `KafkaError::Canceled`) rather than
//! accept records whose reports nobody would serve.
//!
//! # A full queue
//!
//! [`Producer::try_send`] never waits: when librdkafka's local queue is full it says so
//! ([`Offer::Full`]) and the caller awaits [`Producer::room`], which resolves when a delivery
//! report frees a place — so the caller can keep serving acknowledgements, its own timers and
//! shutdown meanwhile instead of sleeping inside a call.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{DeliveryResult, Header, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _, ProducerContext, PurgeConfig};
use rdkafka::{ClientConfig, Statistics};
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;

use crate::queue_events::MainQueue;

/// The outcome of one record: acknowledged, or the error with the record as it was sent.
pub type DeliveryResultOwned = Result<(), (KafkaError, OwnedMessage)>;

/// Resolves when Kafka acknowledged the record or it failed; an `Err` means the producer was
/// dropped before a report came (nothing is known about the record).
pub type DeliveryFuture = oneshot::Receiver<DeliveryResultOwned>;

/// The longest [`Producer::room`] waits for a report before the caller offers its record again.
const ROOM_WAIT: Duration = Duration::from_millis(100);

/// The queue is also served this often without a wake-up: a safety net only (librdkafka calls
/// back whenever the queue goes from empty to non-empty), cheap enough to keep.
const SAFETY_POLL: Duration = Duration::from_secs(1);

/// Producer settings the streamer exposes; `properties` passes any other librdkafka setting.
#[derive(Debug, Clone)]
pub struct ProducerSettings {
    pub brokers: String,
    pub client_id: String,
    /// none, gzip, snappy, lz4 or zstd.
    pub compression: String,
    pub linger_ms: u64,
    /// librdkafka's `message.timeout.ms`: how long it retries one record before failing it.
    pub message_timeout_ms: u64,
    /// Extra librdkafka properties; the [`RESERVED_PROPERTIES`] are set after them.
    pub properties: BTreeMap<String, String>,
    /// Makes the producer transactional (see [`crate::transaction`]): records are sent only
    /// between [`Producer::begin_transaction`] and [`Producer::commit_transaction`].
    pub transactional_id: Option<String>,
}

/// One record to publish; borrowed from the outbox row.
#[derive(Debug)]
pub struct Outgoing<'a> {
    pub topic: &'a str,
    pub key: Option<&'a [u8]>,
    pub payload: Option<&'a [u8]>,
    pub partition: Option<i32>,
    pub headers: &'a [(String, Vec<u8>)],
    /// Headers sent after `headers` (the streamer's own), borrowed so that none is copied
    /// before librdkafka copies them all.
    pub stamp: &'a [(&'a str, &'a [u8])],
    /// The record's timestamp in milliseconds; `None`: the producer's clock.
    pub timestamp_ms: Option<i64>,
}

/// The topic of a record whose delivery failed.
pub fn topic_of(message: &OwnedMessage) -> String {
    message.topic().to_string()
}

/// The client and its queue handle, in drop order: the handle goes first.
struct Client {
    queue: MainQueue,
    producer: BaseProducer<LogContext>,
}

/// Access to the librdkafka client behind a [`Producer`], shareable with a blocking thread.
pub(crate) trait AsBase: Send + Sync {
    fn producer(&self) -> &BaseProducer<LogContext>;
}

impl AsBase for Client {
    fn producer(&self) -> &BaseProducer<LogContext> {
        &self.producer
    }
}

/// Serves the main queue whenever librdkafka says it has events, until the producer is gone.
/// One event at a time, letting other tasks run in between: a delivery report event carries a
/// whole produce request's records (up to `batch.num.messages`).
/// `_alive` is cleared however the task ends (the producer dropped, the runtime shut down, even
/// before the task first ran): new records are refused from then on.
async fn serve_reports(client: Weak<Client>, wake: Arc<Notify>, _alive: AliveFlag) {
    loop {
        loop {
            let Some(client) = client.upgrade() else { return };
            let more = client.queue.len() > 0;
            if more {
                // A zero timeout never blocks.
                client.producer.poll(Duration::ZERO);
            }
            release(client);
            if !more {
                break;
            }
            tokio::task::yield_now().await;
        }
        let _ = tokio::time::timeout(SAFETY_POLL, wake.notified()).await;
    }
}

/// Set while the task serving reports exists; cleared when it is dropped.
struct AliveFlag(Arc<AtomicBool>);

impl Drop for AliveFlag {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Lets go of the task's reference to the client. When the producer was dropped meanwhile, this
/// is the last one, and destroying a client waits for librdkafka's threads: that happens on a
/// blocking thread, never on a runtime worker.
fn release(client: Arc<Client>) {
    if let Ok(last) = Arc::try_unwrap(client) {
        drop(tokio::task::spawn_blocking(move || drop(last)));
    }
}

/// Routes librdkafka's own log lines and client errors to tracing, and each delivery report to
/// the future of its record. Log lines and client errors are connection trouble that
/// librdkafka retries by itself, so WARN at most: a record that cannot be delivered reaches the
/// streamer as a delivery error, which decides what is worth an ERROR.
#[derive(Debug, Clone)]
pub struct LogContext {
    /// Notified at every report: a place in the local queue is free ([`Producer::room`]).
    room: Arc<Notify>,
}

impl ProducerContext for LogContext {
    type DeliveryOpaque = Box<oneshot::Sender<DeliveryResultOwned>>;

    fn delivery(&self, result: &DeliveryResult<'_>, reply: Self::DeliveryOpaque) {
        let owned = match result {
            Ok(_) => Ok(()),
            Err((e, message)) => Err((e.clone(), message.detach())),
        };
        // The receiver may be gone (its session ended); nothing waits for this report then.
        let _ = reply.send(owned);
        self.room.notify_one();
    }
}

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error
            | RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", facility, "{message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", facility, "{message}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", facility, "{message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(target: "librdkafka", error = %error, "kafka client: {reason}");
    }

    fn stats(&self, _statistics: Statistics) {}
}

/// Why [`Producer::try_send`] did not hand a record to the client.
#[derive(Debug)]
pub enum Offer {
    /// The local queue is full: await [`Producer::room`], then offer the record again.
    Full,
    /// The client refused it (for example larger than `message.max.bytes`) or is dead.
    Refused(KafkaError),
}

/// The producer of one shard-partition.
pub struct Producer {
    client: Arc<Client>,
    room: Arc<Notify>,
    reports: JoinHandle<()>,
    /// Cleared when the task serving reports ends.
    alive: Arc<AtomicBool>,
}

impl Drop for Producer {
    /// Purges what the client still holds — queued and in flight, their futures resolve with a
    /// purge error — before anything else: records of a session that lost its right to publish
    /// are never sent later, whichever thread lets go of the client last. Then stops the task
    /// serving reports.
    fn drop(&mut self) {
        self.client.producer.purge(PurgeConfig::default().queue().inflight());
        self.reports.abort();
    }
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer").finish_non_exhaustive()
    }
}

/// Settings fixed for correctness: order and no duplicates within one producer session.
const FIXED: &[(&str, &str)] = &[
    ("enable.idempotence", "true"),
    ("acks", "all"),
    ("max.in.flight.requests.per.connection", "5"),
    ("partitioner", "murmur2_random"),
];

/// Every librdkafka property name (aliases included, from librdkafka's CONFIGURATION.md) that
/// the producer sets itself and extra `properties` must not change, with the name it is an
/// alias of: the [`FIXED`] ones, and `message.timeout.ms`, which the streamer bounds (under
/// ZooKeeper ownership by the session timeout, so a queued record cannot outlive the lease).
pub const RESERVED_PROPERTIES: &[(&str, &str)] = &[
    ("enable.idempotence", "enable.idempotence"),
    ("acks", "acks"),
    ("request.required.acks", "acks"),
    ("max.in.flight.requests.per.connection", "max.in.flight.requests.per.connection"),
    ("max.in.flight", "max.in.flight.requests.per.connection"),
    ("partitioner", "partitioner"),
    ("message.timeout.ms", "message.timeout.ms"),
    ("delivery.timeout.ms", "message.timeout.ms"),
    ("transactional.id", "transactional.id"),
    ("transaction.timeout.ms", "transaction.timeout.ms"),
];

/// The property `key` stands for when the producer reserves it (see [`RESERVED_PROPERTIES`]).
pub fn reserved_property(key: &str) -> Option<&'static str> {
    let key = key.trim().to_ascii_lowercase();
    RESERVED_PROPERTIES.iter().find(|(name, _)| *name == key).map(|(_, canonical)| *canonical)
}

impl Producer {
    pub fn new(settings: &ProducerSettings) -> Result<Self, KafkaError> {
        let mut cfg = ClientConfig::new();
        cfg.set("bootstrap.servers", &settings.brokers)
            .set("client.id", &settings.client_id)
            .set("compression.type", &settings.compression)
            .set("linger.ms", settings.linger_ms.to_string())
            .set("message.timeout.ms", settings.message_timeout_ms.to_string())
            .set("queue.buffering.max.messages", "200000")
            // A topic that does not exist (auto-creation is off) must fail as "unknown topic",
            // a definite error, well before the message timeout turns it into a transient one.
            .set("topic.metadata.propagation.max.ms", (settings.message_timeout_ms / 3).clamp(1000, 5000).to_string())
            .set("socket.keepalive.enable", "true");
        if settings.transactional_id.is_some() {
            // A transaction's first record to a partition waits for the partition to join it,
            // which the coordinator refuses (CONCURRENT_TRANSACTIONS) until the last commit's
            // markers are written; librdkafka asks again after this backoff, 100 ms by default.
            // Measured in docs/benchmarks.md; `properties` may still set it.
            cfg.set("retry.backoff.ms", "5");
        }
        for (k, v) in &settings.properties {
            cfg.set(k, v);
        }
        // Reserved properties are refused by the config; set them last all the same.
        cfg.set("message.timeout.ms", settings.message_timeout_ms.to_string());
        for (k, v) in FIXED {
            cfg.set(*k, *v);
        }
        if let Some(id) = &settings.transactional_id {
            // A transaction may not outlive its records' own timeout by much: the broker aborts
            // one that stays open longer (a frozen owner's), and librdkafka requires
            // message.timeout.ms <= transaction.timeout.ms.
            cfg.set("transactional.id", id)
                .set("transaction.timeout.ms", crate::transaction::timeout_ms(settings.message_timeout_ms).to_string());
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            KafkaError::ClientCreation(
                "the producer serves its reports on a tokio runtime; create it inside one".into(),
            )
        })?;
        let room = Arc::new(Notify::new());
        let producer: BaseProducer<LogContext> = cfg.create_with_context(LogContext { room: room.clone() })?;
        let wake = Arc::new(Notify::new());
        let queue = MainQueue::open(producer.client().native_ptr(), wake.clone())
            .ok_or_else(|| KafkaError::ClientCreation("librdkafka returned no main queue".into()))?;
        let client = Arc::new(Client { queue, producer });
        let alive = Arc::new(AtomicBool::new(true));
        let reports = runtime.spawn(serve_reports(Arc::downgrade(&client), wake, AliveFlag(alive.clone())));
        Ok(Self { client, room, reports, alive })
    }

    /// Hands one record to the client and returns the future of its acknowledgement, or says
    /// why it did not: a full local queue ([`Offer::Full`]; nothing was handed over, offer it
    /// again after [`Self::room`]) or a refusal. Never waits.
    pub fn try_send(&self, rec: &Outgoing<'_>) -> Result<DeliveryFuture, Offer> {
        if !self.alive.load(Ordering::Acquire) {
            return Err(Offer::Refused(KafkaError::Canceled));
        }
        let mut headers = OwnedHeaders::new_with_capacity(rec.headers.len() + rec.stamp.len());
        for (k, v) in rec.headers {
            headers = headers.insert(Header { key: k, value: Some(v.as_slice()) });
        }
        for (k, v) in rec.stamp {
            headers = headers.insert(Header { key: k, value: Some(*v) });
        }
        let (reply, delivered) = oneshot::channel();
        let mut record: BaseRecord<'_, [u8], [u8], Box<oneshot::Sender<DeliveryResultOwned>>> =
            BaseRecord::with_opaque_to(rec.topic, Box::new(reply)).headers(headers);
        if let Some(key) = rec.key {
            record = record.key(key);
        }
        if let Some(payload) = rec.payload {
            record = record.payload(payload);
        }
        if let Some(p) = rec.partition {
            record = record.partition(p);
        }
        if let Some(t) = rec.timestamp_ms {
            record = record.timestamp(t);
        }
        match self.client.producer.send(record) {
            Ok(()) => Ok(delivered),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => Err(Offer::Full),
            Err((e, _)) => Err(Offer::Refused(e)),
        }
    }

    /// Resolves when a delivery report may have freed a place in the local queue (one that
    /// came since the last call counts), or after [`ROOM_WAIT`] at the latest.
    pub async fn room(&self) {
        let _ = tokio::time::timeout(ROOM_WAIT, self.room.notified()).await;
    }

    /// Waits until every record handed over has been reported (librdkafka counts none in
    /// flight), or `timeout`. Never blocks the thread: each look is a flush with no wait.
    pub(crate) async fn reported(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.client.producer.flush(Duration::ZERO).is_err() && tokio::time::Instant::now() < deadline {
            // A report wakes `room` a moment before librdkafka counts its record out: look
            // again soon even without another wake-up.
            let _ = tokio::time::timeout(Duration::from_millis(1), self.room.notified()).await;
        }
    }

    /// The client itself, for the transaction calls of [`crate::transaction`].
    pub(crate) fn base(&self) -> Arc<dyn AsBase> {
        self.client.clone()
    }

    /// Waits up to `timeout` for everything enqueued to be acknowledged or failed.
    pub fn flush(&self, timeout: Duration) -> Result<(), KafkaError> {
        self.client.producer.flush(timeout)
    }

    /// Whether the cluster says `topic` does not exist. A broker's `UnknownTopicOrPartition`
    /// is also what a topic being created or a partition moving looks like, so a delivery that
    /// failed with it asks the cluster's metadata before calling the record undeliverable.
    /// `false` when the metadata cannot be read (the caller then retries).
    pub async fn topic_missing(&self, topic: &str) -> bool {
        matches!(self.topic_error(topic).await, Some(Some(e)) if e == RDKafkaErrorCode::UnknownTopicOrPartition || e == RDKafkaErrorCode::UnknownTopic)
    }

    /// Whether the cluster's metadata shows `topic` with no error: `Some(false)` when it is
    /// missing or refused (not authorised, no leader yet), `None` when the metadata cannot be
    /// read. Asked before the first record to a topic, so that a record bound to fail is sent
    /// alone and nothing after it goes out before its verdict.
    pub async fn topic_ready(&self, topic: &str) -> Option<bool> {
        self.topic_error(topic).await.map(|error| error.is_none())
    }

    /// The error the cluster's metadata reports for `topic` (`Some(None)`: none; a topic the
    /// answer leaves out is unknown), or `None` when the metadata cannot be read within 5 s.
    async fn topic_error(&self, topic: &str) -> Option<Option<RDKafkaErrorCode>> {
        let (client, topic) = (Arc::clone(&self.client), topic.to_string());
        let lookup = tokio::task::spawn_blocking(move || {
            let metadata = client.producer.client().fetch_metadata(Some(&topic), Duration::from_secs(5)).ok()?;
            let entry = metadata.topics().iter().find(|t| t.name() == topic).map(|t| t.error());
            Some(match entry {
                None => Some(RDKafkaErrorCode::UnknownTopic),
                Some(error) => error.map(RDKafkaErrorCode::from),
            })
        });
        lookup.await.ok().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full local queue is reported at once, with nothing handed over, and a report frees
    /// room (no broker is needed: a queue of one record fills at once, and a record that
    /// cannot reach a broker fails after its message timeout).
    #[tokio::test]
    async fn a_full_queue_is_reported_and_a_report_makes_room() {
        let settings = ProducerSettings {
            brokers: "127.0.0.1:1".into(),
            client_id: "test".into(),
            compression: "none".into(),
            linger_ms: 0,
            message_timeout_ms: 1_000,
            properties: [("queue.buffering.max.messages".to_string(), "1".to_string())].into(),
            transactional_id: None,
        };
        let producer = Producer::new(&settings).unwrap();
        let rec = Outgoing {
            topic: "t",
            key: None,
            payload: Some(b"p"),
            partition: Some(0),
            headers: &[],
            stamp: &[],
            timestamp_ms: None,
        };
        let first = producer.try_send(&rec).expect("room for one");
        assert!(matches!(producer.try_send(&rec), Err(Offer::Full)));
        // Still full: the refused record was never handed over. (librdkafka's out-queue length
        // would count the connection-refused events waiting to be served as well, which vary
        // with the machine's load.)
        assert!(matches!(producer.try_send(&rec), Err(Offer::Full)), "the refused record was never handed over");
        let report = first.await.expect("a report comes");
        assert!(report.is_err(), "no broker: the record times out");
        // The report wakes `room` from inside librdkafka's callback, a moment before the client
        // counts the record out of its queue: an offer right then may still find it full, and
        // the next `room` (a report or the poll window) tries again.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            producer.room().await;
            match producer.try_send(&rec) {
                Ok(_) => break,
                Err(Offer::Full) if std::time::Instant::now() < deadline => continue,
                Err(e) => panic!("the report freed no place within 5 s: {e:?}"),
            }
        }
    }

    fn unreachable(message_timeout_ms: u64) -> ProducerSettings {
        ProducerSettings {
            brokers: "127.0.0.1:1".into(),
            client_id: "test".into(),
            compression: "none".into(),
            linger_ms: 0,
            message_timeout_ms,
            properties: BTreeMap::new(),
            transactional_id: None,
        }
    }

    const RECORD: Outgoing<'static> = Outgoing {
        topic: "t",
        key: None,
        payload: Some(b"p"),
        partition: Some(0),
        headers: &[],
        stamp: &[],
        timestamp_ms: None,
    };

    /// Dropping the producer purges what it holds: every record's future resolves at once,
    /// none waits for its message timeout (and none is sent later).
    #[tokio::test]
    async fn dropping_the_producer_resolves_every_record_at_once() {
        let producer = Producer::new(&unreachable(60_000)).unwrap();
        let futures: Vec<DeliveryFuture> = (0..100).map(|_| producer.try_send(&RECORD).expect("room")).collect();
        drop(producer);
        for f in futures {
            let report =
                tokio::time::timeout(Duration::from_secs(5), f).await.expect("resolved long before the timeout");
            assert!(!matches!(report, Ok(Ok(()))), "a purged record is not reported delivered");
        }
    }

    /// A producer whose runtime ended has nobody to serve its reports: it refuses records.
    #[test]
    fn a_producer_outliving_its_runtime_refuses_records() {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let producer = runtime.block_on(async { Producer::new(&unreachable(1_000)).unwrap() });
        drop(runtime);
        assert!(matches!(producer.try_send(&RECORD), Err(Offer::Refused(KafkaError::Canceled))));
    }
}
