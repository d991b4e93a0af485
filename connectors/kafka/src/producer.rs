//! An idempotent producer that enqueues without waiting for each record.
//!
//! # Delivery reports and idle cost
//!
//! librdkafka hands delivery reports over only when its queue is polled. rdkafka's
//! `ThreadedProducer` (under `FutureProducer`) polls from a thread of its own in 100 ms
//! windows for as long as the producer lives, and spins without sleeping through the last
//! fraction of a millisecond of every window (the remaining time is rounded down to 0 ms):
//! measured here, about 0.5–1 % of a core per producer while nothing at all is produced — one
//! producer per shard-partition, so 16 idle shard-partitions cost 10 % of a core. This producer
//! polls only while records are in flight: its thread sleeps on a condition variable when
//! nothing is (but for a non-blocking look every [`IDLE_POLL`]), and [`Producer::try_send`]
//! wakes it.
//!
//! # A full queue
//!
//! [`Producer::try_send`] never waits: when librdkafka's local queue is full it says so
//! ([`Offer::Full`]) and the caller awaits [`Producer::room`], which resolves when a delivery
//! report frees a place — so the caller can keep serving acknowledgements, its own timers and
//! shutdown meanwhile instead of sleeping inside a call.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{DeliveryResult, Header, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _, ProducerContext};
use rdkafka::{ClientConfig, Statistics};
use tokio::sync::{Notify, oneshot};

/// The outcome of one record: acknowledged, or the error with the record as it was sent.
pub type DeliveryResultOwned = Result<(), (KafkaError, OwnedMessage)>;

/// Resolves when Kafka acknowledged the record or it failed; an `Err` means the producer was
/// dropped before a report came (nothing is known about the record).
pub type DeliveryFuture = oneshot::Receiver<DeliveryResultOwned>;

/// How long one poll of the delivery queue lasts while records are in flight; also the
/// longest a dropped producer waits for its polling thread.
const POLL_WINDOW: Duration = Duration::from_millis(100);

/// With nothing in flight, the queue is still served this often (without waiting), so client
/// error events do not pile up in a long quiet spell.
const IDLE_POLL: Duration = Duration::from_secs(1);

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
}

/// The topic of a record whose delivery failed.
pub fn topic_of(message: &OwnedMessage) -> String {
    message.topic().to_string()
}

/// Records handed to librdkafka whose report has not come yet, and whether the producer is
/// being dropped: what the polling thread sleeps on.
#[derive(Debug, Default)]
struct Activity {
    state: Mutex<ActivityState>,
    wake: Condvar,
    /// Notified at every report: a place in the local queue is free ([`Producer::room`]).
    room: Notify,
}

#[derive(Debug, Default)]
struct ActivityState {
    in_flight: usize,
    stop: bool,
}

impl Activity {
    fn lock(&self) -> MutexGuard<'_, ActivityState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A record is about to be handed over: the polling thread must run.
    fn begin(&self) {
        let mut s = self.lock();
        s.in_flight += 1;
        if s.in_flight == 1 {
            self.wake.notify_one();
        }
    }

    /// A record's report came, or it was never handed over.
    fn end(&self) {
        {
            let mut s = self.lock();
            s.in_flight = s.in_flight.saturating_sub(1);
        }
        self.room.notify_one();
    }

    fn stop(&self) {
        self.lock().stop = true;
        self.wake.notify_one();
    }

    /// Blocks until a record is in flight, the producer is dropped, or [`IDLE_POLL`] passed.
    fn wait_for_work(&self) -> Wake {
        let s = self.lock();
        let (s, _) = self
            .wake
            .wait_timeout_while(s, IDLE_POLL, |s| s.in_flight == 0 && !s.stop)
            .unwrap_or_else(|e| e.into_inner());
        if s.stop {
            Wake::Stop
        } else if s.in_flight > 0 {
            Wake::Work
        } else {
            Wake::Idle
        }
    }
}

/// Why the polling thread woke.
enum Wake {
    /// Records are in flight: poll for a window.
    Work,
    /// Nothing in flight for a while: serve what the client queued (an error event) and sleep
    /// again.
    Idle,
    Stop,
}

/// Routes librdkafka's own log lines and client errors to tracing, and each delivery report to
/// the future of its record. Log lines and client errors are connection trouble that
/// librdkafka retries by itself, so WARN at most: a record that cannot be delivered reaches the
/// streamer as a delivery error, which decides what is worth an ERROR.
#[derive(Debug, Clone)]
pub struct LogContext {
    activity: Arc<Activity>,
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
        self.activity.end();
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
    inner: Arc<BaseProducer<LogContext>>,
    activity: Arc<Activity>,
    poller: Option<JoinHandle<()>>,
}

impl Drop for Producer {
    /// Stops the polling thread, then the client purges what it still queues (rdkafka's
    /// `BaseProducer` does, when the last reference goes): records of a session that lost its
    /// right to publish are never sent later.
    fn drop(&mut self) {
        self.activity.stop();
        if let Some(poller) = self.poller.take() {
            let _ = poller.join();
        }
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
        for (k, v) in &settings.properties {
            cfg.set(k, v);
        }
        // Reserved properties are refused by the config; set them last all the same.
        cfg.set("message.timeout.ms", settings.message_timeout_ms.to_string());
        for (k, v) in FIXED {
            cfg.set(*k, *v);
        }
        let activity = Arc::new(Activity::default());
        let inner: Arc<BaseProducer<LogContext>> =
            Arc::new(cfg.create_with_context(LogContext { activity: activity.clone() })?);
        let poller = {
            let (inner, activity) = (inner.clone(), activity.clone());
            std::thread::Builder::new()
                .name("kafka-deliveries".into())
                .spawn(move || {
                    loop {
                        match activity.wait_for_work() {
                            Wake::Work => inner.poll(POLL_WINDOW),
                            Wake::Idle => inner.poll(Duration::ZERO),
                            Wake::Stop => break,
                        }
                    }
                })
                .map_err(|e| KafkaError::ClientCreation(format!("cannot start the delivery-report thread: {e}")))?
        };
        Ok(Self { inner, activity, poller: Some(poller) })
    }

    /// Hands one record to the client and returns the future of its acknowledgement, or says
    /// why it did not: a full local queue ([`Offer::Full`]; nothing was handed over, offer it
    /// again after [`Self::room`]) or a refusal. Never waits.
    pub fn try_send(&self, rec: &Outgoing<'_>) -> Result<DeliveryFuture, Offer> {
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
        // Counted before the hand-over, so a report that comes at once finds it counted.
        self.activity.begin();
        match self.inner.send(record) {
            Ok(()) => Ok(delivered),
            Err((e, _)) => {
                self.activity.end();
                match e {
                    KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull) => Err(Offer::Full),
                    e => Err(Offer::Refused(e)),
                }
            }
        }
    }

    /// Resolves when a delivery report may have freed a place in the local queue (one that
    /// came since the last call counts), or after [`POLL_WINDOW`] at the latest.
    pub async fn room(&self) {
        let _ = tokio::time::timeout(POLL_WINDOW, self.activity.room.notified()).await;
    }

    /// Waits up to `timeout` for everything enqueued to be acknowledged or failed.
    pub fn flush(&self, timeout: Duration) -> Result<(), KafkaError> {
        self.inner.flush(timeout)
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
        let (producer, topic) = (Arc::clone(&self.inner), topic.to_string());
        let lookup = tokio::task::spawn_blocking(move || {
            let metadata = producer.client().fetch_metadata(Some(&topic), Duration::from_secs(5)).ok()?;
            let entry = metadata.topics().iter().find(|t| t.name() == topic).map(|t| t.error());
            Some(match entry {
                None => Some(RDKafkaErrorCode::UnknownTopic),
                Some(error) => error.map(RDKafkaErrorCode::from),
            })
        });
        lookup.await.ok().flatten()
    }

    /// Records enqueued and not yet acknowledged or failed.
    pub fn in_flight(&self) -> i32 {
        self.inner.in_flight_count()
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
        };
        let producer = Producer::new(&settings).unwrap();
        let rec = Outgoing { topic: "t", key: None, payload: Some(b"p"), partition: Some(0), headers: &[], stamp: &[] };
        let first = producer.try_send(&rec).expect("room for one");
        assert!(matches!(producer.try_send(&rec), Err(Offer::Full)));
        // Our own count (librdkafka's also holds the client's error events here).
        assert_eq!(producer.activity.lock().in_flight, 1, "the refused record was never handed over");
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
}
