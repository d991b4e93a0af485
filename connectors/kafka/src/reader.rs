//! A reader of every record of a topic from the beginning, for the benchmark's checker.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// What the checker needs of one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    /// The `outbox-id` header, if present and numeric.
    pub outbox_id: Option<i64>,
}

/// Reads all partitions of one topic from the beginning, without a consumer group commit.
pub struct TopicReader {
    consumer: BaseConsumer,
}

impl std::fmt::Debug for TopicReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TopicReader").finish_non_exhaustive()
    }
}

impl TopicReader {
    pub fn new(brokers: &str, topic: &str, partitions: i32, group: &str) -> Result<Self, KafkaError> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .set("fetch.wait.max.ms", "5")
            .create()?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(topic, p, Offset::Beginning)?;
        }
        consumer.assign(&tpl)?;
        Ok(Self { consumer })
    }

    /// The next record, or `None` when none arrived within `wait`. Blocking.
    pub fn poll(&self, wait: Duration) -> Result<Option<Seen>, KafkaError> {
        match self.consumer.poll(wait) {
            None => Ok(None),
            Some(Err(e)) => Err(e),
            Some(Ok(msg)) => {
                let outbox_id = msg
                    .headers()
                    .and_then(|h| h.iter().find(|h| h.key == "outbox-id").and_then(|h| h.value))
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok());
                Ok(Some(Seen {
                    partition: msg.partition(),
                    offset: msg.offset(),
                    key: msg.key().map(<[u8]>::to_vec),
                    outbox_id,
                }))
            }
        }
    }
}
