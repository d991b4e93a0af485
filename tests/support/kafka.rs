//! Fresh topics and a reader that returns every record of a topic.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::{env, unique};

pub fn brokers() -> String {
    env("OUTBOX_KAFKA_BROKERS")
}

/// Creates a topic with a unique name and `partitions` partitions; returns its name.
pub async fn fresh_topic(prefix: &str, partitions: i32) -> String {
    let name = unique(prefix).replace('_', "-");
    create_topic(&name, partitions).await;
    name
}

pub async fn create_topic(name: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers()).create().expect("kafka admin client");
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let results = admin
        .create_topics([&topic], &AdminOptions::new().operation_timeout(Some(Duration::from_secs(20))))
        .await
        .unwrap_or_else(|e| panic!("creating topic {name}: {e}; {}", super::HOW_TO_START));
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("creating topic {t}: {e}"));
    }
}

/// One consumed record.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    pub headers: HashMap<String, String>,
}

impl Record {
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map(String::as_str).unwrap_or_else(|| panic!("record without header {name}: {self:?}"))
    }

    pub fn payload_str(&self) -> String {
        String::from_utf8_lossy(self.payload.as_deref().unwrap_or_default()).into_owned()
    }

    pub fn key_str(&self) -> String {
        String::from_utf8_lossy(self.key.as_deref().unwrap_or_default()).into_owned()
    }
}

/// Reads `topic` from the beginning until at least `count` records arrived, then a little
/// longer (`settle`) to catch extra records (duplicates), or panics at the deadline.
pub async fn read_at_least(topic: &str, partitions: i32, count: usize, timeout: Duration) -> Vec<Record> {
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || read_blocking(&topic, partitions, count, timeout, Duration::from_millis(500)))
        .await
        .expect("reader thread")
}

fn read_blocking(topic: &str, partitions: i32, count: usize, timeout: Duration, settle: Duration) -> Vec<Record> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("test-reader"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("kafka consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning).expect("partition offset");
    }
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    let mut settle_until: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if let Some(until) = settle_until {
            if now >= until {
                return out;
            }
        } else if now >= deadline {
            panic!("timed out after {timeout:?}: {} of {count} records arrived in {topic}", out.len());
        }
        if let Some(msg) = consumer.poll(Duration::from_millis(100)) {
            let msg = msg.expect("kafka read");
            let mut headers = HashMap::new();
            if let Some(h) = msg.headers() {
                for i in 0..h.count() {
                    let hd = h.get(i);
                    headers
                        .insert(hd.key.to_string(), String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned());
                }
            }
            out.push(Record {
                partition: msg.partition(),
                offset: msg.offset(),
                key: msg.key().map(<[u8]>::to_vec),
                payload: msg.payload().map(<[u8]>::to_vec),
                headers,
            });
            if out.len() >= count && settle_until.is_none() {
                settle_until = Some(Instant::now() + settle);
            }
        }
    }
}
