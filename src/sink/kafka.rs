//! Kafka as a [`Sink`]: the producer of `outbox_kafka`, its settings per shard-partition, its
//! errors' verdicts, and its transactions under exactly-once delivery.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::Map;
use outbox_kafka::classify::{about_the_topic, hint};
use outbox_kafka::producer::{DeliveryFuture, DeliveryResultOwned, topic_of};
use outbox_kafka::progress::ReaderSettings;
use outbox_kafka::{Class, ErrorCode, KafkaError, Producer, ProducerSettings, TxnClass, TxnFailure, classify};
use tokio::sync::oneshot::error::RecvError;

use super::{Failure, Offer, Outgoing, Sink, Verdict};
use crate::config::{Delivery, KafkaConfig, StreamSettings};
use crate::error::Error;
use crate::streamer::StreamLabels;

/// The sink every shard-partition publishes through: one Kafka producer each, transactional
/// under exactly-once delivery.
#[derive(Debug)]
pub(crate) struct KafkaBroker {
    producer: Producer,
    exactly_once: Option<Transactions>,
}

/// What exactly-once adds to a shard-partition's producer.
#[derive(Debug)]
struct Transactions {
    /// The progress topic and the record's key (the transactional id).
    topic: String,
    key: String,
    reader: ReaderSettings,
    /// `init_transactions` succeeded: registered with the cluster, earlier owners fenced.
    registered: AtomicBool,
    /// An abort failed (the cluster unreachable): it is tried again before the next session.
    abort_pending: AtomicBool,
    /// When the open transaction began.
    began: Mutex<Option<Instant>>,
    /// The producer's `transaction.timeout.ms`: the broker aborts a transaction open longer.
    timeout: Duration,
    /// The producer died of its own transaction's timeout (see [`KafkaBroker::expired`]).
    expired: AtomicBool,
}

impl Transactions {
    /// The open transaction ended: how long it had been open.
    fn ended(&self) -> Option<Duration> {
        self.began.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take().map(|b| b.elapsed())
    }

    /// A failed commit or abort of a transaction open for `open`: a fatal error on one that
    /// outlived the timeout is the broker's abort of it, not a newer owner.
    fn failed(&self, e: TxnFailure, open: Option<Duration>) -> Error {
        match open {
            Some(open) if e.class == TxnClass::Fatal && open >= self.timeout => {
                self.expired.store(true, Ordering::Release);
                Error::transient(format!(
                    "the Kafka transaction stayed open {} s, past the producer's transaction.timeout.ms ({} s): the process was paused or starved (a freeze, a stalled VM, swapping); the broker aborted it and retired the producer ({e}); a new producer sends its records again from the last committed progress",
                    open.as_secs(),
                    self.timeout.as_secs()
                ))
            }
            _ => txn_error(e, &self.key),
        }
    }
}

/// What opening a shard-partition's [`KafkaBroker`] takes.
#[derive(Debug, Clone)]
pub(crate) struct KafkaSettings {
    producer: ProducerSettings,
    /// Under exactly-once: the progress topic.
    progress_topic: Option<String>,
}

/// The producer settings of one shard-partition: the `[kafka]` section with its stream's
/// overrides, a client id naming the shard-partition and, under exactly-once, its
/// transactional id (see [`crate::progress::transactional_id`]).
pub(crate) fn settings(kafka: &KafkaConfig, s: &StreamSettings, labels: &StreamLabels, cluster: &str) -> KafkaSettings {
    let exactly_once = s.delivery == Delivery::ExactlyOnce;
    KafkaSettings {
        producer: ProducerSettings {
            brokers: kafka.brokers.clone(),
            client_id: format!("outbox-streamer-{}-{}-{}", labels.source, labels.id.shard, labels.id.partition),
            compression: s.compression.as_str().into(),
            linger_ms: s.linger_ms,
            message_timeout_ms: kafka.message_timeout_ms,
            properties: kafka.properties.clone(),
            transactional_id: exactly_once.then(|| {
                crate::progress::transactional_id(&kafka.transactional_id_prefix, cluster, &labels.source, labels.id)
            }),
        },
        progress_topic: exactly_once.then(|| kafka.progress_topic.clone()),
    }
}

/// Opens a shard-partition's producer; an error is definite (the halt's message and fix), with
/// the producer's error as its source.
pub(crate) fn open(settings: &KafkaSettings) -> Result<KafkaBroker, Error> {
    let producer = Producer::new(&settings.producer).map_err(|e| {
        Error::definite(
            format!("cannot create the Kafka producer: {e}"),
            "correct the [kafka] settings, then restart (this halt does not clear by itself)",
        )
        .with_source(e)
    })?;
    let exactly_once = match (&settings.progress_topic, &settings.producer.transactional_id) {
        (Some(topic), Some(key)) => Some(Transactions {
            topic: topic.clone(),
            key: key.clone(),
            reader: ReaderSettings {
                brokers: settings.producer.brokers.clone(),
                properties: settings.producer.properties.clone(),
            },
            registered: AtomicBool::new(false),
            abort_pending: AtomicBool::new(false),
            began: Mutex::new(None),
            timeout: Duration::from_millis(outbox_kafka::transaction::timeout_ms(settings.producer.message_timeout_ms)),
            expired: AtomicBool::new(false),
        }),
        _ => None,
    };
    Ok(KafkaBroker { producer, exactly_once })
}

/// Waits (up to 5 s) for what the producer still holds to be acknowledged, then drops it,
/// which purges anything left.
pub(crate) async fn close(broker: KafkaBroker) {
    let _ = tokio::task::spawn_blocking(move || broker.producer.flush(Duration::from_secs(5))).await;
}

/// How long one transaction call may take before the session ends (transient) and the next
/// starts over from the last committed progress.
const TXN_CALL_TIMEOUT: Duration = Duration::from_secs(30);

impl KafkaBroker {
    /// Whether the producer died of its own transaction's timeout (the broker aborted a
    /// transaction left open past `transaction.timeout.ms`, which retires the producer): the
    /// shard-partition's task then opens a new one before the next session.
    pub(crate) fn expired(&self) -> bool {
        self.exactly_once.as_ref().is_some_and(|t| t.expired.load(Ordering::Acquire))
    }

    fn transactions(&self) -> Result<&Transactions, Error> {
        self.exactly_once.as_ref().ok_or_else(|| Error::transient("a transaction call on an at-least-once producer"))
    }
}

/// A failed transaction call as the loop sees it: a fenced (or otherwise dead) producer stops
/// the shard-partition as revoked; anything else ends the session, which aborts and starts
/// over from the last committed progress record.
fn txn_error(e: TxnFailure, key: &str) -> Error {
    match e.class {
        TxnClass::Fatal => {
            let why = if e.fenced() {
                format!(
                    "Kafka fenced the transactional producer {key}: a newer owner of this shard-partition registered the same transactional id ({e})"
                )
            } else {
                format!("the transactional producer {key} can no longer be used: {e}")
            };
            Error::fenced_by_broker(
                why,
                "make sure one instance runs each shard-partition (run them under [coordination], or give two deployments sharing this Kafka cluster different kafka.transactional_id_prefix values), then restart this one; nothing was sent twice",
            )
        }
        TxnClass::Abort | TxnClass::Retry => Error::transient(e.to_string()),
    }
}

type Report = Result<DeliveryResultOwned, RecvError>;

/// A record's acknowledgement as the loop awaits it.
pub(crate) type KafkaDelivery = Map<DeliveryFuture, fn(Report) -> Result<(), Failure>>;

impl Sink for KafkaBroker {
    type Delivery = KafkaDelivery;

    fn name(&self) -> &'static str {
        "Kafka"
    }

    fn send(&self, r: &Outgoing<'_>) -> Result<Self::Delivery, Offer> {
        let out = outbox_kafka::Outgoing {
            topic: r.topic,
            key: r.key,
            payload: r.payload,
            partition: r.partition,
            headers: r.headers,
            stamp: r.stamp,
            timestamp_ms: r.timestamp_ms,
        };
        match self.producer.try_send(&out) {
            Ok(delivery) => Ok(delivery.map(settled as fn(Report) -> Result<(), Failure>)),
            Err(outbox_kafka::Offer::Full) => Err(Offer::Full),
            // The topic names what a halt on an unknown topic waits for.
            Err(outbox_kafka::Offer::Refused(e)) => Err(Offer::Refused(failure(e, Some(r.topic.to_string())))),
        }
    }

    async fn ready(&self) {
        self.producer.room().await;
    }

    async fn topic_ready(&self, topic: &str) -> Option<bool> {
        self.producer.topic_ready(topic).await
    }

    /// librdkafka reports a missing topic either as its own `UnknownTopic` (definite) or, once
    /// the broker answered, as the broker's `UnknownTopicOrPartition`, which is also what a topic
    /// being created or a moving partition looks like. The cluster's metadata decides: a topic
    /// it does not know is missing, anything else is retried.
    async fn recheck(&self, mut f: Failure) -> Failure {
        if f.verdict == Verdict::Unsure {
            let missing = match &f.topic {
                Some(topic) => self.producer.topic_missing(topic).await,
                None => false,
            };
            if missing {
                let e = KafkaError::MessageProduction(ErrorCode::UnknownTopic);
                f.fix = hint(&e);
                f.error = Box::new(e);
                f.verdict = Verdict::MissingTopic;
            } else {
                f.verdict = Verdict::Transient;
            }
        }
        f
    }

    fn transactional(&self) -> bool {
        self.exactly_once.is_some()
    }

    /// Registers the transactional id once per producer (fencing any earlier owner and
    /// aborting what it left open), then reads the last committed progress record.
    async fn resume(&self) -> Result<Option<Vec<u8>>, Error> {
        let t = self.transactions()?;
        if !t.registered.load(Ordering::Acquire) {
            self.producer.init_transactions(TXN_CALL_TIMEOUT).await.map_err(|e| txn_error(e, &t.key))?;
            t.registered.store(true, Ordering::Release);
        }
        if t.abort_pending.load(Ordering::Acquire) {
            self.producer.abort_transaction(TXN_CALL_TIMEOUT).await.map_err(|e| txn_error(e, &t.key))?;
            t.abort_pending.store(false, Ordering::Release);
        }
        let (reader, topic, key) = (t.reader.clone(), t.topic.clone(), t.key.clone());
        let read = tokio::task::spawn_blocking(move || {
            outbox_kafka::progress::last_committed(&reader, &topic, key.as_bytes(), TXN_CALL_TIMEOUT)
        })
        .await
        .map_err(|e| Error::transient(format!("reading the progress topic: {e}")))?;
        read.map_err(|e| match e.rdkafka_error_code() {
            Some(ErrorCode::UnknownTopic | ErrorCode::UnknownTopicOrPartition) => Error::definite(
                format!("the progress topic {} does not exist", t.topic),
                format!(
                    "run `outbox-streamer setup` (it creates it), or create it compacted: kafka-topics.sh --create --topic {} --partitions 1 --config cleanup.policy=compact; the stream then resumes by itself",
                    t.topic
                ),
            ),
            Some(ErrorCode::TopicAuthorizationFailed | ErrorCode::GroupAuthorizationFailed) => Error::definite(
                format!("reading the progress topic {}: {e}", t.topic),
                "grant the streamer's principal READ on the progress topic and on the group outbox-streamer-progress-reader (see docs/configuration.md)",
            ),
            _ => Error::transient(format!("reading the progress topic {}: {e}", t.topic)),
        })
    }

    fn begin(&self) -> Result<(), Error> {
        let t = self.transactions()?;
        self.producer.begin_transaction().map_err(|e| txn_error(e, &t.key))?;
        *t.began.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
        Ok(())
    }

    /// Sends the progress record last in the open transaction, then commits it.
    async fn commit(&self, progress: Vec<u8>) -> Result<(), Error> {
        let t = self.transactions()?;
        let record = outbox_kafka::Outgoing {
            topic: &t.topic,
            key: Some(t.key.as_bytes()),
            payload: Some(&progress),
            partition: None,
            headers: &[],
            stamp: &[],
            timestamp_ms: None,
        };
        // The record's own report is not awaited: the commit fails if it failed.
        let mut offered = self.producer.try_send(&record);
        while let Err(outbox_kafka::Offer::Full) = offered {
            self.producer.room().await;
            offered = self.producer.try_send(&record);
        }
        if let Err(outbox_kafka::Offer::Refused(e)) = offered {
            return Err(Error::transient(format!("the progress record was refused: {e}")));
        }
        let committed = self.producer.commit_transaction(TXN_CALL_TIMEOUT).await;
        let open = t.ended();
        committed.map_err(|e| t.failed(e, open))
    }

    /// A failed abort is tried again by the next [`Sink::resume`].
    async fn abort(&self) -> Result<(), Error> {
        let t = self.transactions()?;
        let aborted = self.producer.abort_transaction(TXN_CALL_TIMEOUT).await;
        let open = t.ended();
        t.abort_pending.store(aborted.is_err(), Ordering::Release);
        aborted.map_err(|e| t.failed(e, open))
    }
}

/// A delivery report as the loop sees it.
fn settled(report: Report) -> Result<(), Failure> {
    match report {
        Ok(Ok(())) => Ok(()),
        Ok(Err((e, message))) => Err(failure(e, Some(topic_of(&message)))),
        // The producer went away before the report: nothing is known about the record.
        Err(_) => Err(failure(KafkaError::Canceled, None)),
    }
}

fn failure(e: KafkaError, topic: Option<String>) -> Failure {
    let verdict = match e.rdkafka_error_code() {
        Some(ErrorCode::UnknownTopic) => Verdict::MissingTopic,
        Some(ErrorCode::UnknownTopicOrPartition) => Verdict::Unsure,
        _ if classify(&e) == Class::Transient => Verdict::Transient,
        _ if about_the_topic(&e) => Verdict::Destination,
        _ => Verdict::Record,
    };
    Failure { verdict, topic, fix: hint(&e), error: Box::new(e) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let v = |c| failure(KafkaError::MessageProduction(c), None).verdict;
        assert_eq!(v(ErrorCode::MessageSizeTooLarge), Verdict::Record);
        assert_eq!(v(ErrorCode::InvalidRecord), Verdict::Record);
        assert_eq!(v(ErrorCode::UnknownTopic), Verdict::MissingTopic);
        assert_eq!(v(ErrorCode::UnknownTopicOrPartition), Verdict::Unsure);
        assert_eq!(v(ErrorCode::TopicAuthorizationFailed), Verdict::Destination);
        assert_eq!(v(ErrorCode::UnknownPartition), Verdict::Destination);
        assert_eq!(v(ErrorCode::MessageTimedOut), Verdict::Transient);
        assert_eq!(v(ErrorCode::NotLeaderForPartition), Verdict::Transient);
        assert_eq!(failure(KafkaError::Canceled, None).verdict, Verdict::Transient);
    }
}
