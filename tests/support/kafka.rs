//! Fresh topics and a reader that returns every record of a topic.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::{env, unique};

pub(crate) fn brokers() -> String {
    env("OUTBOX_KAFKA_BROKERS")
}

/// Creates a topic with a unique name and `partitions` partitions; returns its name.
pub(crate) async fn fresh_topic(prefix: &str, partitions: i32) -> String {
    let name = unique(prefix).replace('_', "-");
    create_topic(&name, partitions).await;
    name
}

pub(crate) async fn create_topic(name: &str, partitions: i32) {
    create_topic_with(name, partitions, &[]).await;
}

/// Creates a topic with topic-level settings (for example `max.message.bytes`).
///
/// Test topics keep their records however old their timestamps: some tests publish records
/// with fixed timestamps from 2020 (`tests/tw_tkms.rs`), and under the broker's default
/// `retention.ms` (7 days) Kafka rolls the segment such a record starts at once and its
/// retention check (every 5 minutes) deletes it — a record gone from the topic that the
/// streamer delivered, which a test reading from the beginning would miss. `retention.ms`
/// in `config` overrides this.
pub(crate) async fn create_topic_with(name: &str, partitions: i32, config: &[(&str, &str)]) {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers()).create().expect("kafka admin client");
    let mut topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    if !config.iter().any(|(k, _)| *k == "retention.ms") {
        topic = topic.set("retention.ms", "-1");
    }
    for (k, v) in config {
        topic = topic.set(k, v);
    }
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
pub(crate) struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    pub headers: HashMap<String, String>,
    /// The record's timestamp, milliseconds.
    pub timestamp: Option<i64>,
}

impl Record {
    pub(crate) fn header(&self, name: &str) -> &str {
        self.headers.get(name).map(String::as_str).unwrap_or_else(|| panic!("record without header {name}: {self:?}"))
    }

    pub(crate) fn payload_str(&self) -> String {
        String::from_utf8_lossy(self.payload.as_deref().unwrap_or_default()).into_owned()
    }

    pub(crate) fn key_str(&self) -> String {
        String::from_utf8_lossy(self.key.as_deref().unwrap_or_default()).into_owned()
    }
}

/// Checks records whose payload is `<key>:<n>:<committed|rolled-back>`, where `n` counted
/// each key's transactions under a row lock (so `n` order is commit order): no rolled-back row
/// was published, and per key, in Kafka order, `n` runs 1, 2, 3, … without gap or repeat.
pub(crate) fn assert_commit_order_per_key(records: &[Record]) {
    let mut sorted = records.to_vec();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut per_key: HashMap<String, Vec<i32>> = HashMap::new();
    for r in &sorted {
        let payload = r.payload_str();
        assert!(!payload.ends_with("rolled-back"), "a rolled-back row was published: {payload}");
        let (key, rest) = payload.split_once(':').expect("payload is key:n:state");
        assert_eq!(key, r.key_str(), "the record is keyed by its row's key");
        let n = rest.split(':').next().and_then(|n| n.parse().ok()).expect("payload is key:n:state");
        per_key.entry(key.to_string()).or_default().push(n);
    }
    for (key, seq) in &per_key {
        let want: Vec<i32> = (1..=seq.len() as i32).collect();
        assert_eq!(seq, &want, "key {key}: Kafka order differs from commit order");
    }
}

/// After faults, records may repeat; counting each `outbox-id` once, at its first delivery,
/// checks that `expected` distinct rows arrived and that per key (in Kafka order) the first
/// deliveries keep their ids increasing, i.e. commit order.
pub(crate) fn assert_first_deliveries_in_order(records: &[Record], expected: usize) {
    let mut sorted = records.to_vec();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut first = std::collections::HashSet::new();
    let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
    for r in &sorted {
        let id: i64 = r.header("outbox-id").parse().expect("numeric outbox-id");
        if first.insert(id) {
            per_key.entry(r.key_str()).or_default().push(id);
        }
    }
    assert_eq!(first.len(), expected, "every row arrived");
    for (key, ids) in &per_key {
        assert!(ids.windows(2).all(|p| p[0] < p[1]), "key {key}: first deliveries out of order: {ids:?}");
    }
}

/// Reads `topic` from the beginning until at least `count` records arrived, then a little
/// longer (`settle`) to catch extra records (duplicates), or panics at the deadline.
pub(crate) async fn read_at_least(topic: &str, partitions: i32, count: usize, timeout: Duration) -> Vec<Record> {
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || read_blocking(&topic, partitions, count, timeout, Duration::from_millis(500)))
        .await
        .expect("reader thread")
}

/// Reads `topic` from the beginning until `expected` distinct rows arrived — a row is its
/// `outbox-shard`, `outbox-partition` and `outbox-id` headers — then a little longer for
/// duplicates. Where duplicates are possible, [`read_at_least`] could stop at `expected`
/// records with some rows still on their way.
pub(crate) async fn read_distinct(topic: &str, partitions: i32, expected: usize, timeout: Duration) -> Vec<Record> {
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::with_capacity(expected);
        let done = scan_as("read_committed", &topic, partitions, timeout, Duration::from_millis(500), |msg| {
            let record = record_of(msg);
            seen.insert((
                record.header("outbox-shard").to_string(),
                record.header("outbox-partition").to_string(),
                record.header("outbox-id").to_string(),
            ));
            out.push(record);
            seen.len() >= expected
        });
        assert!(done, "timed out after {timeout:?} reading {topic}: {} of {expected} distinct rows", seen.len());
        out
    })
    .await
    .expect("reader thread")
}

/// Reads `topic` from the beginning until every payload in `expected` arrived, then a little
/// longer for duplicates and strays; returns every record read.
pub(crate) async fn read_until_payloads(
    topic: &str,
    partitions: i32,
    expected: &std::collections::HashSet<String>,
    timeout: Duration,
) -> Vec<Record> {
    let (topic, mut missing) = (topic.to_string(), expected.clone());
    tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        let done = scan_as("read_committed", &topic, partitions, timeout, Duration::from_secs(1), |msg| {
            let record = record_of(msg);
            missing.remove(&record.payload_str());
            out.push(record);
            missing.is_empty()
        });
        if !done {
            let mut first: Vec<&String> = missing.iter().collect();
            first.sort();
            first.truncate(20);
            panic!(
                "timed out after {timeout:?} reading {topic}: {} records so far, {} expected payloads missing (first: {first:?})",
                out.len(),
                missing.len()
            );
        }
        out
    })
    .await
    .expect("reader thread")
}

/// Counts records and distinct `outbox-id` headers until `expected` distinct ids arrived,
/// keeping no records in memory (for runs of a million records). Returns (records, distinct).
pub(crate) async fn count_distinct_ids(
    topic: &str,
    partitions: i32,
    expected: usize,
    timeout: Duration,
) -> (usize, usize) {
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let mut seen = std::collections::HashSet::with_capacity(expected);
        let mut records = 0;
        scan(&topic, partitions, timeout, Duration::from_millis(500), |msg| {
            records += 1;
            let id = msg
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == "outbox-id").and_then(|h| h.value))
                .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                .expect("record with an outbox-id header");
            seen.insert(id);
            seen.len() >= expected
        });
        (records, seen.len())
    })
    .await
    .expect("reader thread")
}

fn read_blocking(topic: &str, partitions: i32, count: usize, timeout: Duration, settle: Duration) -> Vec<Record> {
    let mut out = Vec::new();
    scan(topic, partitions, timeout, settle, |msg| {
        out.push(record_of(msg));
        out.len() >= count
    });
    out
}

fn record_of(msg: &rdkafka::message::BorrowedMessage<'_>) -> Record {
    let mut headers = HashMap::new();
    if let Some(h) = msg.headers() {
        for i in 0..h.count() {
            let hd = h.get(i);
            headers.insert(hd.key.to_string(), String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned());
        }
    }
    Record {
        partition: msg.partition(),
        offset: msg.offset(),
        key: msg.key().map(<[u8]>::to_vec),
        payload: msg.payload().map(<[u8]>::to_vec),
        headers,
        timestamp: msg.timestamp().to_millis(),
    }
}

/// Reads `topic` from the beginning, handing each record to `on_record` until it returns
/// true, then keeps reading for `settle` (to catch extras); panics at the deadline.
fn scan(
    topic: &str,
    partitions: i32,
    timeout: Duration,
    settle: Duration,
    on_record: impl FnMut(&rdkafka::message::BorrowedMessage<'_>) -> bool,
) {
    if !scan_as("read_committed", topic, partitions, timeout, settle, on_record) {
        panic!("timed out after {timeout:?} reading {topic}");
    }
}

/// Counts every record of `topic` (all partitions) with `read_uncommitted`: aborted records
/// of Kafka transactions too. Reads until `at_least` arrived, then a little longer.
pub(crate) async fn count_uncommitted(topic: &str, partitions: i32, at_least: usize, timeout: Duration) -> usize {
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let mut n = 0;
        let done = scan_as("read_uncommitted", &topic, partitions, timeout, Duration::from_secs(1), |_| {
            n += 1;
            n >= at_least
        });
        assert!(done, "timed out after {timeout:?} reading {topic}: {n} records so far");
        n
    })
    .await
    .expect("reader thread")
}

/// [`scan`] with the consumer's `isolation.level` (librdkafka's default, and the other
/// readers', is `read_committed`); false at the deadline, for the caller to say what is
/// missing.
fn scan_as(
    isolation: &str,
    topic: &str,
    partitions: i32,
    timeout: Duration,
    settle: Duration,
    mut on_record: impl FnMut(&rdkafka::message::BorrowedMessage<'_>) -> bool,
) -> bool {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("isolation.level", isolation)
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
    let mut settle_until: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if let Some(until) = settle_until {
            if now >= until {
                return true;
            }
        } else if now >= deadline {
            return false;
        }
        if let Some(msg) = consumer.poll(Duration::from_millis(100)) {
            let msg = msg.expect("kafka read");
            if on_record(&msg) && settle_until.is_none() {
                settle_until = Some(Instant::now() + settle);
            }
        }
    }
}

/// Reads a one-partition topic until `n` records arrived and asserts their payloads are
/// `p0`, `p1`, … `p{n-1}`: every row once, in order.
pub(crate) async fn expect_numbered_payloads(topic: &str, n: usize, timeout: Duration) -> Vec<Record> {
    let records = read_at_least(topic, 1, n, timeout).await;
    let got: Vec<String> = records.iter().map(Record::payload_str).collect();
    assert_eq!(got, (0..n).map(|i| format!("p{i}")).collect::<Vec<_>>(), "every row once, in order");
    records
}

/// Reads `topic` from the beginning until a record whose header `name` equals `value`
/// arrives; panics at the deadline.
pub(crate) async fn wait_for_header(topic: &str, partitions: i32, name: &str, value: &str, timeout: Duration) {
    let (topic, name, value) = (topic.to_string(), name.to_string(), value.to_string());
    tokio::task::spawn_blocking(move || {
        scan(&topic, partitions, timeout, Duration::ZERO, |msg| {
            msg.headers().is_some_and(|h| h.iter().any(|h| h.key == name && h.value == Some(value.as_bytes())))
        })
    })
    .await
    .expect("reader thread")
}
