//! The table is the safety net: rows the log never carried — a statement-logged session,
//! `sql_log_bin=0`, rows written while the table was out of the publication — are found by the
//! sweep once the stream has passed every commit that could hold them, published, counted
//! and logged. Before the sweep they stayed in the table for ever, without a word.

use std::time::Duration;

use mysql_async::prelude::Queryable;

use crate::postgres_faults::EXACTLY_ONCE;
use crate::support::database::Database;
use crate::support::metrics::STREAM_0_0;
use crate::support::pg::PgDb;
use crate::support::world::World;
use crate::support::{kafka, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);
const SWEEP: &str = "sweep_interval_ms = 300";

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

/// Under exactly-once, a swept row whose Kafka transaction committed while its delete did not
/// (a SIGKILL between the two) is deleted by the next instance, not sent again: the last
/// progress record names it, and the sweep that finds it again takes it for sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_swept_row_sent_before_a_kill_is_not_sent_again_under_exactly_once() {
    let w = World::postgres("pse").config(&format!("{SWEEP}\n{EXACTLY_ONCE}")).build().await;
    let table = w.table(0, 0);
    let (mut admin, mut gate) = (w.db.connect().await, w.db.connect().await);
    PgDb::gate_deletes(&mut admin, &table).await;
    let streamer = w.start("run-0.log");
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, convert_to($2, 'UTF8'))");
    admin.execute(&insert, &[&w.topic, &"a"]).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    w.wait_drained(&table).await;

    PgDb::close_gate(&mut gate, &table).await;
    admin.batch_execute(&format!("ALTER PUBLICATION {table} DROP TABLE {table}")).await.unwrap();
    admin.execute(&insert, &[&w.topic, &"outside-the-publication"]).await.unwrap();
    admin.batch_execute(&format!("ALTER PUBLICATION {table} ADD TABLE {table}")).await.unwrap();
    kafka::read_distinct(&w.topic, 1, 2, ARRIVAL).await;
    w.kill_at_the_gate(streamer, &mut admin, &table).await;
    assert_eq!(w.db.count(&table).await, 1, "the swept row is in the table and in Kafka");
    PgDb::open_gate(&mut gate, &table).await;

    let streamer = w.start("run-1.log");
    w.wait_drained(&table).await;
    streamer.wait_for_metric("outbox_replayed_rows_skipped_total", STREAM_0_0, 1.0, ARRIVAL).await;
    admin.execute(&insert, &[&w.topic, &"b"]).await.unwrap();
    let records = kafka::read_distinct(&w.topic, 1, 3, ARRIVAL).await;
    assert_eq!(records.len(), 3, "each row once for a read_committed reader");
    assert_eq!(sorted_payloads(&records), ["a", "b", "outside-the-publication"]);
    assert!(streamer.stop());
}
