//! The cleanup (delete the published rows, then advance the position) runs beside reading:
//! while one delete waits on the database, newer transactions are still read and published,
//! nothing is deleted out of order, and the position never passes a row still in the table.
//! Written once, run on both databases.

use std::collections::HashMap;

use crate::support::database::{Database, Row, lsn};
use crate::support::kafka;
use crate::support::wait_until;
use crate::support::world::{ARRIVAL, World, WorldBuilder};

/// Transactions committed while the first delete is held.
const LATER: usize = 5;

/// Row `B` is published and its delete is held at a gate (a trigger waiting for a lock this
/// test holds). Meanwhile five more transactions arrive: they are published although `B`'s
/// delete has not finished, no row is deleted, and — where the database keeps the position
/// apart from the table — a position report made after they were published does not pass
/// `B`. Then the gate opens: every row is deleted, each record was sent once, in commit order.
async fn held_delete_does_not_stop_reading<D: Database>(builder: WorldBuilder<D>) {
    let w = builder.build().await;
    let table = w.table(0, 0);
    let mut admin = w.db.connect().await;
    let mut gate = w.db.connect().await;
    D::gate_deletes(&mut admin, &table).await;
    let streamer = w.start("run.log");
    streamer.wait_for_state("streaming", ARRIVAL).await;

    // A first row goes through the open gate: the topic is known and the loop warmed up.
    D::insert(&mut admin, &table, &[Row::new(&w.topic, "row-A").key("k")]).await;
    w.wait_drained(&table).await;

    D::close_gate(&mut gate, &table).await;
    let before_b = D::log_end(&mut admin).await;
    let b = D::insert(&mut admin, &table, &[Row::new(&w.topic, "row-B").key("k")]).await[0];
    wait_until("the delete of row B to wait at the gate", ARRIVAL, || async {
        let mut c = w.db.connect().await;
        (D::waiting_at_gate(&mut c, &table).await > 0).then_some(())
    })
    .await;

    for n in 0..LATER {
        D::insert(&mut admin, &table, &[Row::new(&w.topic, format!("row-C{n}")).key("k")]).await;
    }
    let records = kafka::read_distinct(&w.topic, w.kafka_partitions, 2 + LATER, ARRIVAL).await;
    assert_eq!(
        D::waiting_at_gate(&mut admin, &table).await,
        1,
        "the delete is still held (and no second one started beside it)"
    );
    assert_eq!(w.count(&table).await, 1 + LATER as i64, "nothing was deleted past the held delete");

    if D::SLOT {
        let b_position = records
            .iter()
            .find(|r| r.header("outbox-id") == b.to_string())
            .map(|r| lsn(r.header(D::POSITION_HEADER)))
            .expect("row B was published");
        let published = D::server_time(&mut admin).await;
        wait_until("a position report made after the later rows were published", ARRIVAL, || async {
            let mut c = w.db.connect().await;
            D::last_report(&mut c, &table).await.filter(|t| *t > published)
        })
        .await;
        // B's own start may be confirmed: an idle report made while the server had read up to
        // B's commit record but not yet decoded it names that record's start, and the server
        // still decodes a transaction whose commit starts at the confirmed position (only one
        // before it is skipped). Past it, B would be lost to the log.
        let confirmed = D::confirmed_position(&mut admin, &table).await.unwrap_or(0);
        assert!(
            confirmed <= b_position,
            "confirmed {confirmed:X} reached row B ({b_position:X}) while B's delete was held (log before B: {before_b:X})"
        );
    }

    D::open_gate(&mut gate, &table).await;
    w.wait_drained(&table).await;
    let mut sent: HashMap<String, usize> = HashMap::new();
    for r in &records {
        *sent.entry(r.header("outbox-id").to_string()).or_default() += 1;
    }
    assert!(sent.values().all(|n| *n == 1), "each record sent once: {sent:?}");
    kafka::assert_first_deliveries_in_order(&records, 2 + LATER);
    let payloads: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    let want: Vec<String> =
        ["row-A".to_string(), "row-B".to_string()].into_iter().chain((0..LATER).map(|n| format!("row-C{n}"))).collect();
    assert_eq!(payloads, want, "commit order");
    assert!(streamer.stop(), "the streamer stopped cleanly");
}

#[tokio::test]
async fn postgres_held_delete_does_not_stop_reading() {
    held_delete_does_not_stop_reading(World::postgres("held_delete")).await;
}

#[tokio::test]
async fn mariadb_held_delete_does_not_stop_reading() {
    held_delete_does_not_stop_reading(World::mysql("held_delete")).await;
}
