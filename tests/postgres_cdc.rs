//! The PostgreSQL CDC path end to end: real PostgreSQL, real Kafka, the real binary.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::types::ToSql;

use crate::support::world::World;
use crate::support::{kafka, pg, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_arrive_once_in_commit_order_per_key() {
    let w = World::postgres("oc").kafka_partitions(3).build().await;
    let table = w.table(0, 0);
    const KEYS: usize = 12;
    w.db.admin.batch_execute("CREATE TABLE key_seq (k text PRIMARY KEY, n int NOT NULL)").await.unwrap();
    for k in 0..KEYS {
        w.db.admin.execute("INSERT INTO key_seq VALUES ($1, 0)", &[&format!("key-{k}")]).await.unwrap();
    }
    let streamer = w.start("streamer.log");

    // Each transaction bumps a per-key counter under its row lock, so per key the counter
    // order IS the commit order; 1 in 8 transactions rolls back.
    let committed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut writers = Vec::new();
    for writer in 0..8u64 {
        let url = w.db.admin_url.clone();
        let table = table.clone();
        let topic = w.topic.clone();
        let committed = committed.clone();
        writers.push(tokio::spawn(async move {
            let mut client = pg::connect(&url).await;
            let mut seed = writer * 7919 + 1;
            for txn_no in 0..60 {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let rows = 1 + (seed >> 33) % 4;
                let mut keys: Vec<usize> = (0..rows).map(|i| ((seed >> (8 * i)) as usize) % KEYS).collect();
                keys.sort_unstable();
                keys.dedup();
                let rollback = txn_no % 8 == 3;
                let tx = client.transaction().await.unwrap();
                for k in &keys {
                    let key = format!("key-{k}");
                    let n: i32 = tx
                        .query_one("UPDATE key_seq SET n = n + 1 WHERE k = $1 RETURNING n", &[&key])
                        .await
                        .unwrap()
                        .get(0);
                    let payload = format!("{key}:{n}:{}", if rollback { "rolled-back" } else { "committed" });
                    tx.execute(
                        &format!("INSERT INTO {table} (topic, msg_key, payload) VALUES ($1, $2, $3)"),
                        &[&topic as &(dyn ToSql + Sync), &key.as_bytes(), &payload.as_bytes()],
                    )
                    .await
                    .unwrap();
                }
                if rollback {
                    tx.rollback().await.unwrap();
                } else {
                    tx.commit().await.unwrap();
                    committed.fetch_add(keys.len(), std::sync::atomic::Ordering::SeqCst);
                }
            }
        }));
    }
    for wr in writers {
        wr.await.unwrap();
    }
    let expected = committed.load(std::sync::atomic::Ordering::SeqCst);
    let records = kafka::read_at_least(&w.topic, 3, expected, ARRIVAL).await;
    assert_eq!(records.len(), expected, "every committed row exactly once in a fault-free run");

    kafka::assert_commit_order_per_key(&records);
    w.wait_drained(&table).await;
    assert!(streamer.stop(), "streamer exits 0 on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_resumes_without_republishing_and_headers_are_complete() {
    let w = World::postgres("or").shards(2).kafka_partitions(4).build().await;
    let enqueue = format!("SELECT {}_enqueue($1, $2, $3, $4::text::jsonb, $5)", w.prefix);
    let send = |i: i32, shard: i32| {
        let enqueue = enqueue.clone();
        let topic = w.topic.clone();
        let client = &w.db.admin;
        async move {
            let key = format!("k{i}");
            let headers = format!(r#"{{"trace-id":"t{i}"}}"#);
            client
                .execute(
                    &enqueue,
                    &[&topic as &(dyn ToSql + Sync), &key.as_bytes(), &format!("p{i}").as_bytes(), &headers, &shard],
                )
                .await
                .unwrap();
        }
    };
    for i in 0..50 {
        send(i, i % 2).await;
    }
    // An explicit partition is honoured.
    w.db.admin
        .execute(
            &format!(
                "INSERT INTO {} (topic, msg_key, payload, kafka_partition) VALUES ($1, 'x', 'explicit', 3)",
                w.table(0, 0)
            ),
            &[&w.topic],
        )
        .await
        .unwrap();
    let first = w.start("first.log");
    let records = kafka::read_at_least(&w.topic, 4, 51, ARRIVAL).await;
    assert_eq!(records.len(), 51);
    w.wait_drained(&w.table(0, 0)).await;
    w.wait_drained(&w.table(1, 0)).await;
    assert!(first.stop(), "clean exit on SIGTERM");

    for i in 50..100 {
        send(i, i % 2).await;
    }
    let second = w.start("second.log");
    let records = kafka::read_at_least(&w.topic, 4, 101, ARRIVAL).await;
    assert_eq!(records.len(), 101, "no row published twice across a clean restart");
    for r in &records {
        let id = r.header("outbox-id");
        assert!(id.parse::<i64>().is_ok());
        assert!(r.header("outbox-lsn").contains('/'), "outbox-lsn is an LSN");
        let shard = r.header("outbox-shard");
        assert!(shard == "0" || shard == "1");
        assert_eq!(r.header("outbox-partition"), "0");
        if r.payload_str() == "explicit" {
            assert_eq!(r.partition, 3, "kafka_partition column honoured");
        } else {
            let i = r.payload_str()[1..].to_string();
            assert_eq!(r.header("trace-id"), format!("t{i}"));
            assert_eq!(shard, (i.parse::<i32>().unwrap() % 2).to_string(), "enqueue routed to the asked shard");
        }
    }
    assert!(second.stop());
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
