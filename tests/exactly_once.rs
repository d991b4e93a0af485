//! Exactly-once delivery at its narrowest moment: a Kafka transaction committed, the delete
//! of its rows not. Written once, run on both databases, in CDC and polling mode.

use std::collections::HashSet;

use crate::polling::POLLING;
use crate::postgres_faults::EXACTLY_ONCE;
use crate::support::database::{Database, Row};
use crate::support::kafka;
use crate::support::metrics::STREAM_0_0;
use crate::support::wait_until;
use crate::support::world::{ARRIVAL, World, WorldBuilder};

/// Rows of the one transaction in flight at the kill.
const ROWS: usize = 10;

/// The rows' delete is held at a gate after their Kafka transaction committed; the streamer is
/// killed there and its waiting delete rolled back, as a crash leaves it. The next instance
/// finds the rows in the table and in the last committed progress record: it deletes them
/// without sending them again (`outbox_replayed_rows_skipped_total` counts them), and a
/// `read_committed` reader sees each row once.
async fn committed_but_not_deleted_is_deleted_not_resent<D: Database>(builder: WorldBuilder<D>) {
    let w = builder.build().await;
    let table = w.table(0, 0);
    let mut admin = w.db.connect().await;
    let mut gate = w.db.connect().await;
    D::gate_deletes(&mut admin, &table).await;
    let streamer = w.start("run-0.log");
    streamer.wait_for_state("streaming", ARRIVAL).await;

    D::close_gate(&mut gate, &table).await;
    let rows: Vec<Row> = (0..ROWS).map(|n| Row::new(&w.topic, format!("row-{n}")).key(format!("k{}", n % 3))).collect();
    D::insert(&mut admin, &table, &rows).await;
    // Visible to a read_committed reader: the Kafka transaction committed.
    kafka::read_distinct(&w.topic, w.kafka_partitions, ROWS, ARRIVAL).await;
    w.kill_at_the_gate(streamer, &mut admin, &table).await;
    assert_eq!(w.count(&table).await, ROWS as i64, "the rows are in the table and in Kafka");
    D::open_gate(&mut gate, &table).await;

    let streamer = w.start("run-1.log");
    w.wait_drained(&table).await;
    streamer.wait_for_metric("outbox_replayed_rows_skipped_total", STREAM_0_0, ROWS as f64, ARRIVAL).await;
    // One more row: it arrives after the first ten, and nothing else does.
    D::insert(&mut admin, &table, &[Row::new(&w.topic, "after").key("k0")]).await;
    let records = kafka::read_distinct(&w.topic, w.kafka_partitions, ROWS + 1, ARRIVAL).await;
    w.wait_drained(&table).await;
    assert_eq!(records.len(), ROWS + 1, "each row once for a read_committed reader");
    kafka::assert_first_deliveries_in_order(&records, ROWS + 1);
    assert!(streamer.stop(), "the streamer stopped cleanly");
}

/// Polling names rows by id, and an id can be used again: a DBA empties the table and restarts
/// its identity. Once the streamer deleted the rows it sent, its progress record no longer
/// names them, so after a SIGKILL the new rows with the same ids are published, not taken for
/// the old ones and deleted unsent.
async fn ids_used_again_after_a_kill_are_published<D: Database>(builder: WorldBuilder<D>) {
    let w = builder.build().await;
    let table = w.table(0, 0);
    let mut admin = w.db.connect().await;
    let streamer = w.start("run-0.log");
    streamer.wait_for_state("streaming", ARRIVAL).await;
    let old: Vec<Row> = (0..ROWS).map(|n| Row::new(&w.topic, format!("old-{n}")).key("k")).collect();
    let old_ids = D::insert(&mut admin, &table, &old).await;
    w.wait_drained(&table).await;
    // The rows' transaction, then one committed for the progress record alone once they
    // were deleted.
    streamer.wait_for_metric("outbox_kafka_transaction_commits_total", STREAM_0_0, 2.0, ARRIVAL).await;
    // Each commit's duration is measured.
    streamer.wait_for_metric("outbox_kafka_transaction_commit_seconds_count", STREAM_0_0, 2.0, ARRIVAL).await;
    streamer.kill();

    D::truncate_restarting_ids(&mut admin, &table).await;
    let new: Vec<Row> = (0..ROWS).map(|n| Row::new(&w.topic, format!("new-{n}")).key("k")).collect();
    let new_ids = D::insert(&mut admin, &table, &new).await;
    assert_eq!(new_ids, old_ids, "the identity started again: the new rows have the old ids");

    let streamer = w.start("run-1.log");
    let want: Vec<String> =
        (0..ROWS).map(|n| format!("old-{n}")).chain((0..ROWS).map(|n| format!("new-{n}"))).collect();
    let expected: HashSet<String> = want.iter().cloned().collect();
    let records = kafka::read_until_payloads(&w.topic, w.kafka_partitions, &expected, ARRIVAL).await;
    w.wait_drained(&table).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(got, want, "every row once, the new ones after the old");
    assert!(streamer.stop(), "the streamer stopped cleanly");
}

#[tokio::test]
async fn postgres_polling_ids_used_again_after_a_kill_are_published() {
    let config = format!("{POLLING}\n{EXACTLY_ONCE}");
    ids_used_again_after_a_kill_are_published(World::postgres("eir").config(&config)).await;
}

#[tokio::test]
async fn mariadb_polling_ids_used_again_after_a_kill_are_published() {
    let config = format!("{POLLING}\n{EXACTLY_ONCE}");
    ids_used_again_after_a_kill_are_published(World::mysql("eir").config(&config)).await;
}

/// The streamer is paused (SIGSTOP, as a long GC pause or a stalled VM would) while rows flow,
/// for longer than a Kafka transaction's timeout (15 s here): the broker aborts the transaction
/// it had open and bumps the producer's epoch. A linger of 500 ms keeps a transaction open
/// nearly all the time (it cannot commit before its records are sent), so one is open at the
/// pause. Resumed, the streamer aborts its side too and sends the rows again in a new
/// transaction — it does not halt as if another instance had fenced it — and a
/// `read_committed` reader sees each row once, per key in commit order.
async fn paused_past_the_transaction_timeout_resends_once<D: Database>(builder: WorldBuilder<D>) {
    let w = builder.config(EXACTLY_ONCE).build().await;
    w.edit_config(|text| text.replace("linger_ms = 1\n", "linger_ms = 500\n"));
    let table = w.table(0, 0);
    let streamer = w.start("run.log");
    streamer.wait_for_state("streaming", ARRIVAL).await;

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let writer = {
        let (mut conn, table, topic) = (w.db.connect().await, table.clone(), w.topic.clone());
        tokio::spawn(async move {
            let mut pace = tokio::time::interval(std::time::Duration::from_millis(5));
            let mut n = 0;
            while !*stopped.borrow() {
                pace.tick().await;
                D::insert(&mut conn, &table, &[Row::new(&topic, format!("row-{n}")).key(format!("k{}", n % 5))]).await;
                n += 1;
            }
            n
        })
    };
    streamer.wait_for_metric("outbox_kafka_transaction_commits_total", STREAM_0_0, 2.0, ARRIVAL).await;
    streamer.freeze();
    let paused = tokio::time::Instant::now();
    // Past the transaction timeout (15 s) and the broker's look for expired ones (every second).
    let past = std::time::Duration::from_secs(18);
    wait_until("the pause to outlast the transaction timeout", past + ARRIVAL, || async {
        (paused.elapsed() >= past).then_some(())
    })
    .await;
    streamer.resume();
    streamer.wait_for_metric("outbox_kafka_transaction_aborts_total", STREAM_0_0, 1.0, ARRIVAL).await;
    let committed = streamer_commits(&streamer).await;
    streamer.wait_for_metric("outbox_kafka_transaction_commits_total", STREAM_0_0, committed + 2.0, ARRIVAL).await;
    let _ = stop.send(true);
    let total = writer.await.unwrap();

    let records = kafka::read_distinct(&w.topic, w.kafka_partitions, total, ARRIVAL).await;
    w.wait_drained(&table).await;
    assert_eq!(records.len(), total, "each row once for a read_committed reader");
    kafka::assert_first_deliveries_in_order(&records, total);
    assert!(streamer.stop(), "the streamer kept running and stopped cleanly");
}

/// The commits counted so far.
async fn streamer_commits(streamer: &crate::support::streamer::Running) -> f64 {
    let text = crate::support::metrics::try_get(streamer.metrics_addr(), "/metrics").await.unwrap_or_default();
    crate::support::metrics::sample(&text, "outbox_kafka_transaction_commits_total", STREAM_0_0).unwrap_or(0.0)
}

#[tokio::test]
async fn postgres_paused_past_the_transaction_timeout_resends_once() {
    paused_past_the_transaction_timeout_resends_once(World::postgres("ept")).await;
}

#[tokio::test]
async fn mariadb_paused_past_the_transaction_timeout_resends_once() {
    paused_past_the_transaction_timeout_resends_once(World::mysql("ept")).await;
}

#[tokio::test]
async fn postgres_committed_but_not_deleted_is_deleted_not_resent() {
    committed_but_not_deleted_is_deleted_not_resent(World::postgres("eod").config(EXACTLY_ONCE)).await;
}

#[tokio::test]
async fn mariadb_committed_but_not_deleted_is_deleted_not_resent() {
    committed_but_not_deleted_is_deleted_not_resent(World::mysql("eod").config(EXACTLY_ONCE)).await;
}

#[tokio::test]
async fn postgres_polling_committed_but_not_deleted_is_deleted_not_resent() {
    let config = format!("{POLLING}\n{EXACTLY_ONCE}");
    committed_but_not_deleted_is_deleted_not_resent(World::postgres("epd").config(&config)).await;
}

#[tokio::test]
async fn mariadb_polling_committed_but_not_deleted_is_deleted_not_resent() {
    let config = format!("{POLLING}\n{EXACTLY_ONCE}");
    committed_but_not_deleted_is_deleted_not_resent(World::mysql("epd").config(&config)).await;
}

/// A row the binlog never carried (a statement-logged session) is published by the sweep, in a
/// Kafka transaction whose progress record names it (no position covers it); the streamer is
/// killed before its delete. The next instance's sweep finds it in the table and in that
/// record: it deletes it without sending it again. Before, it was sent twice.
#[tokio::test]
async fn mariadb_a_swept_row_committed_but_not_deleted_is_deleted_not_resent() {
    use crate::support::mysql::MyDb;
    use mysql_async::prelude::Queryable;
    let config = format!("{EXACTLY_ONCE}\nsweep_interval_ms = 300");
    let w = World::mysql("esw").config(&config).build().await;
    let table = w.table(0, 0);
    let mut admin = w.db.connect().await;
    let mut gate = w.db.connect().await;
    MyDb::gate_deletes(&mut admin, &table).await;
    let streamer = w.start("run-0.log");
    streamer.wait_for_state("streaming", ARRIVAL).await;
    MyDb::close_gate(&mut gate, &table).await;
    let mut statement = w.db.connect().await;
    statement.query_drop("SET SESSION binlog_format = 'STATEMENT'").await.unwrap();
    MyDb::insert(&mut statement, &table, &[Row::new(&w.topic, "statement-logged").key("k0")]).await;
    kafka::read_distinct(&w.topic, w.kafka_partitions, 1, ARRIVAL).await;
    w.kill_at_the_gate(streamer, &mut admin, &table).await;
    assert_eq!(w.count(&table).await, 1, "the row is in the table and in Kafka");
    MyDb::open_gate(&mut gate, &table).await;

    let streamer = w.start("run-1.log");
    w.wait_drained(&table).await;
    MyDb::insert(&mut admin, &table, &[Row::new(&w.topic, "after").key("k0")]).await;
    let records = kafka::read_distinct(&w.topic, w.kafka_partitions, 2, ARRIVAL).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(got, ["statement-logged", "after"], "each row once for a read_committed reader");
    streamer.wait_for_metric("outbox_replayed_rows_skipped_total", STREAM_0_0, 1.0, ARRIVAL).await;
    assert!(streamer.stop(), "the streamer stopped cleanly");
}

/// How a test makes the stream's position lost while the streamer is down.
pub(crate) async fn lose_position<D: Database>(w: &World<D>, table: &str) {
    if D::SLOT {
        let mut admin = w.db.connect().await;
        D::execute(&mut admin, &format!("SELECT pg_drop_replication_slot('{table}')")).await;
    } else {
        crate::support::mysql::purge_binlogs(w.db.admin_url()).await;
    }
}

/// A CDC stream's Kafka transaction committed, the delete of its rows did not (the streamer is
/// killed at the gate), and then the position is lost (the slot dropped, the binlog purged).
/// The restart catches up by polling; its drain would find the rows in the table, but the last
/// progress record names them beside its position: they are deleted, not sent again. Before,
/// the catch-up sent them a second time.
async fn committed_then_position_lost_is_deleted_not_resent<D: Database>(builder: WorldBuilder<D>) {
    let w = builder.build().await;
    let table = w.table(0, 0);
    let mut admin = w.db.connect().await;
    let mut gate = w.db.connect().await;
    D::gate_deletes(&mut admin, &table).await;
    let streamer = w.start("run-0.log");
    streamer.wait_for_state("streaming", ARRIVAL).await;
    D::close_gate(&mut gate, &table).await;
    let rows: Vec<Row> = (0..ROWS).map(|n| Row::new(&w.topic, format!("row-{n}")).key("k0")).collect();
    D::insert(&mut admin, &table, &rows).await;
    kafka::read_distinct(&w.topic, w.kafka_partitions, ROWS, ARRIVAL).await;
    w.kill_at_the_gate(streamer, &mut admin, &table).await;
    D::open_gate(&mut gate, &table).await;
    lose_position(&w, &table).await;

    let streamer = w.start("run-1.log");
    streamer.wait_for_log("catch-up done", ARRIVAL).await;
    w.wait_drained(&table).await;
    D::insert(&mut admin, &table, &[Row::new(&w.topic, "after").key("k0")]).await;
    let records = kafka::read_distinct(&w.topic, w.kafka_partitions, ROWS + 1, ARRIVAL).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(records.len(), ROWS + 1, "each row once for a read_committed reader: {got:?}");
    assert_eq!(got.last().map(String::as_str), Some("after"));
    assert!(streamer.stop(), "the streamer stopped cleanly");
}

#[tokio::test]
async fn postgres_committed_then_position_lost_is_deleted_not_resent() {
    committed_then_position_lost_is_deleted_not_resent(World::postgres("epl").config(EXACTLY_ONCE)).await;
}

/// Purging binlogs is server-wide, so this test runs alone.
#[tokio::test]
async fn mariadb_committed_then_position_lost_is_deleted_not_resent() {
    committed_then_position_lost_is_deleted_not_resent(World::mysql("epl").config(EXACTLY_ONCE).exclusive()).await;
}
