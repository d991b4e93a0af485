//! One test per service: the real server is there and configured as the streamer needs.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::support::{env, kafka, pg};

#[tokio::test]
async fn postgres_has_logical_wal() {
    let _services = crate::support::shared_services().await;
    let client = pg::connect(&env("OUTBOX_PG_URL")).await;
    let row = client.query_one("SHOW wal_level", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "logical");
    let slots: String = client.query_one("SHOW max_replication_slots", &[]).await.unwrap().get(0);
    assert!(slots.parse::<i32>().unwrap() >= 32, "max_replication_slots = {slots}");
    let commit_ts: String = client.query_one("SHOW track_commit_timestamp", &[]).await.unwrap().get(0);
    assert_eq!(commit_ts, "on");
}

#[tokio::test]
async fn mariadb_has_a_full_row_binlog() {
    use mysql_async::prelude::Queryable;
    let _services = crate::support::shared_services().await;
    let mut db = crate::support::mysql::fresh_db().await;
    let settings = outbox_mysql::check_binlog_settings(&mut db.conn).await.unwrap();
    assert!(settings.is_mariadb(), "expected MariaDB, got {}", settings.version);
    assert!(settings.log_bin);
    assert_eq!(settings.format, "ROW");
    assert_eq!(settings.row_image, "FULL");
    assert_eq!(settings.row_metadata, "FULL");
    assert!(settings.problems().is_empty(), "{:?}", settings.problems());
    // The fresh database is ours and empty.
    let current: Option<String> = db.conn.query_first("SELECT DATABASE()").await.unwrap();
    assert_eq!(current.as_deref(), Some(db.name.as_str()));
    let tables: Vec<String> = db.conn.query("SHOW TABLES").await.unwrap();
    assert!(tables.is_empty());
}

#[tokio::test]
async fn kafka_round_trips_a_record() {
    let _services = crate::support::shared_services().await;
    let topic = kafka::fresh_topic("smoke", 1).await;
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", kafka::brokers()).create().unwrap();
    producer
        .send(FutureRecord::to(&topic).key("k").payload("hello"), Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let records = kafka::read_at_least(&topic, 1, 1, Duration::from_secs(30)).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].key_str(), "k");
    assert_eq!(records[0].payload_str(), "hello");
}

#[tokio::test]
async fn zookeeper_creates_and_reads_an_ephemeral_node() {
    let _services = crate::support::shared_services().await;
    use outbox_zookeeper::zk;
    let client = outbox_zookeeper::connect(&outbox_zookeeper::SessionSettings::new(env("OUTBOX_ZK_CONNECT")))
        .await
        .unwrap_or_else(|e| panic!("{e}; {}", crate::support::HOW_TO_START));
    let path = format!("/{}", crate::support::unique("smoke"));
    let opts = zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all());
    client.create(&path, b"alive", &opts).await.unwrap();
    let (data, stat) = client.get_data(&path).await.unwrap();
    assert_eq!(data, b"alive");
    assert_eq!(stat.ephemeral_owner, client.session_id().0);
}

/// A delivery refused with the broker's `UnknownTopicOrPartition` is definite only if the
/// cluster's metadata does not know the topic; this is that lookup against the real broker.
#[tokio::test]
async fn kafka_metadata_tells_a_missing_topic_from_an_existing_one() {
    let _services = crate::support::shared_services().await;
    let producer = outbox_kafka::Producer::new(&outbox_kafka::ProducerSettings {
        brokers: kafka::brokers(),
        client_id: "smoke-metadata".into(),
        compression: "none".into(),
        linger_ms: 0,
        message_timeout_ms: 10_000,
        properties: Default::default(),
        transactional_id: None,
    })
    .unwrap();
    let existing = kafka::fresh_topic("smoke-meta", 1).await;
    assert!(!producer.topic_missing(&existing).await, "{existing} exists");
    let missing = crate::support::unique("never-created");
    assert!(producer.topic_missing(&missing).await, "{missing} does not exist");
}
