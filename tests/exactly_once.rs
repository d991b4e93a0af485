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
    wait_until("the delete of the published rows to wait at the gate", ARRIVAL, || async {
        let mut c = w.db.connect().await;
        (D::waiting_at_gate(&mut c, &table).await > 0).then_some(())
    })
    .await;

    streamer.kill();
    D::kill_waiting_at_gate(&mut admin, &table).await;
    wait_until("the killed instance's delete to roll back", ARRIVAL, || async {
        let mut c = w.db.connect().await;
        (D::waiting_at_gate(&mut c, &table).await == 0).then_some(())
    })
    .await;
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
