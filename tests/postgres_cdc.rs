//! The PostgreSQL CDC path end to end: real PostgreSQL, real Kafka, the real binary.

use std::time::Duration;

use tokio_postgres::types::ToSql;

use crate::faults;
use crate::support::world::World;
use crate::support::{kafka, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);

/// [`faults::concurrent_writers`], with an LSN in each record's `outbox-lsn`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_arrive_once_in_commit_order_per_key() {
    faults::concurrent_writers(World::postgres("oc").kafka_partitions(3).build().await).await;
}

/// [`faults::restart_resumes`]; PostgreSQL's stored position is its slot, which the scenario's
/// "nothing published twice" checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_resumes_without_republishing_and_headers_are_complete() {
    let w = World::postgres("or").shards(2).kafka_partitions(4).build().await;
    faults::restart_resumes(w, async |_| {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_column_while_streaming_keeps_working() {
    let w = World::postgres("oa").build().await;
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2)");
    for i in 0..10 {
        w.db.admin
            .execute(&insert, &[&w.topic as &(dyn ToSql + Sync), &format!("before-{i}").as_bytes()])
            .await
            .unwrap();
    }
    kafka::read_at_least(&w.topic, 1, 10, ARRIVAL).await;
    w.db.admin.batch_execute(&format!("ALTER TABLE {table} ADD COLUMN note text DEFAULT 'n'")).await.unwrap();
    for i in 0..10 {
        w.db.admin
            .execute(&insert, &[&w.topic as &(dyn ToSql + Sync), &format!("after-{i}").as_bytes()])
            .await
            .unwrap();
    }
    let records = kafka::read_at_least(&w.topic, 1, 20, ARRIVAL).await;
    assert_eq!(records.len(), 20);
    assert_eq!(records.last().unwrap().payload_str(), "after-9");
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_outbox_does_not_retain_wal_written_by_other_tables() {
    let w = World::postgres("oi").build().await;
    // The optional heartbeat runs too, as the least-privilege role.
    let config = std::fs::read_to_string(&w.config)
        .unwrap()
        .replace("partitions = 1\n", "partitions = 1\nheartbeat_interval_ms = 200\n");
    std::fs::write(&w.config, config).unwrap();
    let slot = w.table(0, 0);
    let streamer = w.start("streamer.log");
    w.db.admin.execute(&format!("INSERT INTO {slot} (topic, payload) VALUES ($1, 'one')"), &[&w.topic]).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    // About 40 MB of WAL in a table outside the publication.
    w.db.admin
        .batch_execute("CREATE TABLE noise (id int, body text); INSERT INTO noise SELECT g, repeat('x', 400) FROM generate_series(1, 80000) g")
        .await
        .unwrap();
    let lag_query =
        "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1";
    let lag = wait_until("the slot to confirm past the other table's WAL", ARRIVAL, || async {
        let lag: i64 = w.db.admin.query_one(lag_query, &[&slot]).await.unwrap().get(0);
        (lag < 1024 * 1024).then_some(lag)
    })
    .await;
    assert!(lag < 1024 * 1024, "retained WAL {lag} bytes");
    // A throwaway slot in the same database sees the heartbeat messages the streamer writes.
    let probe = format!("{slot}_probe");
    w.db.admin.execute("SELECT pg_create_logical_replication_slot($1, 'test_decoding')", &[&probe]).await.unwrap();
    wait_until("heartbeat messages in the WAL", ARRIVAL, || async {
        let n: i64 = w.db.admin
            .query_one(
                "SELECT count(*) FROM pg_logical_slot_peek_changes($1, NULL, NULL) WHERE data LIKE '%outbox-streamer-heartbeat%'",
                &[&probe],
            )
            .await
            .unwrap()
            .get(0);
        (n >= 2).then_some(())
    })
    .await;
    w.db.admin.execute("SELECT pg_drop_replication_slot($1)", &[&probe]).await.unwrap();
    assert!(!streamer.log_text().contains("heartbeat failed"), "{}", streamer.log_text());
    assert!(streamer.stop());
}
