//! Topic administration for the benchmark, the tools and `setup` (which creates the progress
//! topic of exactly-once delivery); the streamer itself never creates or deletes topics.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

/// Creates `topic` with `partitions` partitions (replication factor 1 is for local servers
/// only); an existing topic is fine.
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32, replication: i32) -> Result<(), KafkaError> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new().set("bootstrap.servers", brokers).create()?;
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(replication));
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for result in admin.create_topics([&new], &opts).await? {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((_, code)) => return Err(KafkaError::AdminOp(code)),
        }
    }
    Ok(())
}

/// Creates the compacted `topic` exactly-once delivery keeps its progress records in: one
/// partition, the cluster's default replication, `cleanup.policy=compact`. `properties` are the
/// connection's (`security.*`, `ssl.*`, `sasl.*` are used). An existing topic is fine; the
/// answer says whether it was created.
pub async fn create_progress_topic(
    brokers: &str,
    properties: &std::collections::BTreeMap<String, String>,
    topic: &str,
) -> Result<bool, KafkaError> {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", brokers);
    for (k, v) in properties {
        if ["security.", "ssl.", "sasl."].iter().any(|p| k.starts_with(p)) {
            cfg.set(k, v);
        }
    }
    let admin: AdminClient<DefaultClientContext> = cfg.create()?;
    let new = NewTopic::new(topic, 1, TopicReplication::Fixed(-1))
        .set("cleanup.policy", "compact")
        .set("min.compaction.lag.ms", "0")
        .set("segment.ms", "3600000");
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    match admin.create_topics([&new], &opts).await?.pop() {
        Some(Ok(_)) => Ok(true),
        Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) | None => Ok(false),
        Some(Err((_, code))) => Err(KafkaError::AdminOp(code)),
    }
}

/// Deletes `topic`; a topic that does not exist is fine.
pub async fn delete_topic(brokers: &str, topic: &str) -> Result<(), KafkaError> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new().set("bootstrap.servers", brokers).create()?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for result in admin.delete_topics(&[topic], &opts).await? {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
            Err((_, code)) => return Err(KafkaError::AdminOp(code)),
        }
    }
    Ok(())
}
