//! The table is the safety net: rows the log never carried — a statement-logged session,
//! `sql_log_bin=0`, rows written while the table was out of the publication — are found by the
//! sweep once the stream has passed every commit that could hold them, published, counted
//! and logged. Before the sweep they stayed in the table for ever, without a word.

use std::time::Duration;

use mysql_async::prelude::Queryable;

use crate::support::world::World;
use crate::support::{kafka, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);
pub(crate) const SWEEP: &str = "sweep_interval_ms = 300";

fn sorted_payloads(records: &[kafka::Record]) -> Vec<String> {
    let mut p: Vec<String> = records.iter().map(kafka::Record::payload_str).collect();
    p.sort();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_rows_the_binlog_never_carried_are_swept() {
    let w = World::mysql("msw").config(SWEEP).build().await;
    let mut admin = w.admin().await;
    let streamer = w.start("streamer.log");
    let insert = format!("INSERT INTO {} (topic, payload) VALUES (?, ?)", w.table(0, 0));
    admin.exec_drop(&insert, (&w.topic, b"a".as_slice())).await.unwrap();
    let mut statement = w.admin().await;
    statement.query_drop("SET SESSION binlog_format = 'STATEMENT'").await.unwrap();
    statement.exec_drop(&insert, (&w.topic, b"statement-logged".as_slice())).await.unwrap();
    let mut unlogged = w.admin().await;
    unlogged.query_drop("SET SESSION sql_log_bin = 0").await.unwrap();
    unlogged.exec_drop(&insert, (&w.topic, b"not-logged".as_slice())).await.unwrap();
    admin.exec_drop(&insert, (&w.topic, b"b".as_slice())).await.unwrap();
    let records = kafka::read_distinct(&w.topic, 1, 4, ARRIVAL).await;
    assert_eq!(records.len(), 4, "each once");
    assert_eq!(sorted_payloads(&records), ["a", "b", "not-logged", "statement-logged"]);
    w.wait_drained(&w.table(0, 0)).await;
    let log = streamer.log_text();
    assert!(log.contains("statement-logged write to the outbox table"), "{log}");
    assert!(log.contains("rows stayed in the table"), "{log}");
    assert!(streamer.stop());
    for c in [statement, unlogged, admin] {
        c.disconnect().await.unwrap();
    }
}

/// Rows written while the table was out of the publication never reach the slot; the sweep
/// sends them even though the stream is idle afterwards (its position moves by keepalives).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_the_slot_never_carried_are_swept() {
    let w = World::postgres("psw").config(SWEEP).build().await;
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, convert_to($2, 'UTF8'))");
    w.db.admin.execute(&insert, &[&w.topic, &"a"]).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    w.db.admin.batch_execute(&format!("ALTER PUBLICATION {table} DROP TABLE {table}")).await.unwrap();
    w.db.admin.execute(&insert, &[&w.topic, &"outside-the-publication"]).await.unwrap();
    w.db.admin.batch_execute(&format!("ALTER PUBLICATION {table} ADD TABLE {table}")).await.unwrap();
    let records = kafka::read_distinct(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(sorted_payloads(&records), ["a", "outside-the-publication"]);
    wait_until("the swept row to be deleted", ARRIVAL, || async { (w.db.count(&table).await == 0).then_some(()) })
        .await;
    let log = streamer.log_text();
    assert!(log.contains("rows stayed in the table"), "{log}");
    assert!(streamer.stop());
}

/// A row written outside the log while the streamer was stopped is swept by the next session
/// though no transaction comes after it (the session's idle position stands in for the last
/// transaction's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_idle_session_sweeps_too() {
    let w = World::postgres("pis").config(SWEEP).build().await;
    let table = w.table(0, 0);
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, convert_to($2, 'UTF8'))");
    let first = w.start("first.log");
    w.db.admin.execute(&insert, &[&w.topic, &"a"]).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert!(first.stop());
    w.db.admin.batch_execute(&format!("ALTER PUBLICATION {table} DROP TABLE {table}")).await.unwrap();
    w.db.admin.execute(&insert, &[&w.topic, &"outside-the-publication"]).await.unwrap();
    w.db.admin.batch_execute(&format!("ALTER PUBLICATION {table} ADD TABLE {table}")).await.unwrap();
    let second = w.start("second.log");
    let records = kafka::read_distinct(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(sorted_payloads(&records), ["a", "outside-the-publication"]);
    wait_until("the swept row to be deleted", ARRIVAL, || async { (w.db.count(&table).await == 0).then_some(()) })
        .await;
    assert!(second.stop());
}
