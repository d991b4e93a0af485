//! The progress topic: a compacted topic holding, per key, the value of the last committed
//! transaction's progress record.
//!
//! [`last_committed`] reads it with `isolation.level=read_committed`, so a progress record of
//! an aborted (or still open) transaction is never the answer; a record with no value (a
//! tombstone) clears its key.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// Settings of the progress topic's reader: the brokers and the connection's security
/// properties (`security.*`, `ssl.*`, `sasl.*` of the producer's; others are producer-only).
#[derive(Debug, Clone)]
pub struct ReaderSettings {
    pub brokers: String,
    pub properties: BTreeMap<String, String>,
}

/// The reader's client context: the end of a partition is what it waits for, not an error.
struct Quiet;

impl rdkafka::client::ClientContext for Quiet {
    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() != Some(RDKafkaErrorCode::PartitionEOF) {
            tracing::warn!(target: "librdkafka", error = %error, "progress reader: {reason}");
        }
    }
}

impl rdkafka::consumer::ConsumerContext for Quiet {}

/// The value of `key`'s last committed record in `topic`, or `None` when there is none.
/// Blocking; reads every partition from its start to its last stable offset within `timeout`.
/// A missing topic is `UnknownTopic`.
pub fn last_committed(
    settings: &ReaderSettings,
    topic: &str,
    key: &[u8],
    timeout: Duration,
) -> Result<Option<Vec<u8>>, KafkaError> {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", &settings.brokers);
    for (k, v) in &settings.properties {
        if ["security.", "ssl.", "sasl."].iter().any(|p| k.starts_with(p)) {
            cfg.set(k, v);
        }
    }
    cfg.set("group.id", "outbox-streamer-progress-reader")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("isolation.level", "read_committed")
        .set("fetch.wait.max.ms", "10");
    let consumer: BaseConsumer<Quiet> = cfg.create_with_context(Quiet)?;
    let deadline = Instant::now() + timeout;
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    let partitions: Vec<i32> = match metadata.topics().iter().find(|t| t.name() == topic) {
        Some(t) if t.error().is_none() && !t.partitions().is_empty() => t.partitions().iter().map(|p| p.id()).collect(),
        _ => return Err(KafkaError::MetadataFetch(RDKafkaErrorCode::UnknownTopic)),
    };
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        tpl.add_partition_offset(topic, *p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut open: HashSet<i32> = partitions.into_iter().collect();
    let mut last = None;
    while !open.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(KafkaError::MetadataFetch(RDKafkaErrorCode::OperationTimedOut));
        }
        match consumer.poll(left.min(Duration::from_millis(200))) {
            None => {}
            Some(Err(KafkaError::PartitionEOF(p))) => {
                open.remove(&p);
            }
            Some(Err(e)) => return Err(e),
            Some(Ok(m)) if m.key() == Some(key) => last = m.payload().map(<[u8]>::to_vec),
            Some(Ok(_)) => {}
        }
    }
    Ok(last)
}
