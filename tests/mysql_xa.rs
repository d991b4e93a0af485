//! MariaDB XA transactions: a prepared transaction is held until its outcome — published at
//! its `XA COMMIT`, dropped at its `XA ROLLBACK` — across restarts, and an XA transaction on
//! any other table never holds anything back.

use std::time::Duration;

use mysql_async::prelude::Queryable;

use crate::support::kafka;
use crate::support::world::World;

const ARRIVAL: Duration = Duration::from_secs(120);

fn payloads(records: &[kafka::Record]) -> Vec<String> {
    records.iter().map(kafka::Record::payload_str).collect()
}

async fn xa_insert(conn: &mut mysql_async::Conn, xid: &str, table: &str, topic: &str, payload: &str) {
    conn.query_drop(format!("XA START '{xid}'")).await.unwrap();
    conn.exec_drop(format!("INSERT INTO {table} (topic, payload) VALUES (?, ?)"), (topic, payload.as_bytes()))
        .await
        .unwrap();
    conn.query_drop(format!("XA END '{xid}'")).await.unwrap();
    conn.query_drop(format!("XA PREPARE '{xid}'")).await.unwrap();
}

/// Rolled-back XA rows never reach Kafka, committed ones arrive at their `XA COMMIT`'s place
/// in the commit order, and XA on another table (prepared, committed or rolled back) does not
/// stall the stream. Before the fix, the prepare was never ended: the rolled-back row was
/// published and the stream stalled for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_xa_outcomes_decide_and_other_xa_never_stalls() {
    let w = World::mysql("mx").build().await;
    let mut admin = w.admin().await;
    admin.query_drop("CREATE TABLE other (id INT PRIMARY KEY)").await.unwrap();
    let streamer = w.start("streamer.log");
    let insert = format!("INSERT INTO {} (topic, payload) VALUES (?, ?)", w.table(0, 0));
    admin.exec_drop(&insert, (&w.topic, b"a".as_slice())).await.unwrap();
    // Rolled back.
    xa_insert(&mut admin, "r1", &w.table(0, 0), &w.topic, "rolled-back").await;
    admin.query_drop("XA ROLLBACK 'r1'").await.unwrap();
    // XA on another table, committed and rolled back.
    for (xid, outcome) in [("o1", "COMMIT"), ("o2", "ROLLBACK")] {
        admin.query_drop(format!("XA START '{xid}'")).await.unwrap();
        admin.query_drop(format!("INSERT INTO other VALUES ({})", xid.len() + outcome.len())).await.unwrap();
        admin.query_drop(format!("XA END '{xid}'")).await.unwrap();
        admin.query_drop(format!("XA PREPARE '{xid}'")).await.unwrap();
        admin.query_drop(format!("XA {outcome} '{xid}'")).await.unwrap();
    }
    // Prepared, then an ordinary commit, then the XA commit.
    let mut xa = w.admin().await;
    xa_insert(&mut xa, "c1", &w.table(0, 0), &w.topic, "xa-committed").await;
    admin.exec_drop(&insert, (&w.topic, b"b".as_slice())).await.unwrap();
    let first = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(payloads(&first), ["a", "b"], "a prepared XA transaction holds back nothing after it");
    xa.query_drop("XA COMMIT 'c1'").await.unwrap();
    // One-phase XA commits like any transaction.
    xa.query_drop("XA START 'one'").await.unwrap();
    xa.exec_drop(&insert, (&w.topic, b"one-phase".as_slice())).await.unwrap();
    xa.query_drop("XA END 'one'").await.unwrap();
    xa.query_drop("XA COMMIT 'one' ONE PHASE").await.unwrap();
    admin.exec_drop(&insert, (&w.topic, b"c".as_slice())).await.unwrap();
    let records = kafka::read_at_least(&w.topic, 1, 5, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "b", "xa-committed", "one-phase", "c"]);
    w.wait_drained(&w.table(0, 0)).await;
    let log = streamer.log_text();
    assert!(log.contains("XA transaction rolled back"), "{log}");
    assert!(streamer.stop());
    xa.disconnect().await.unwrap();
    admin.disconnect().await.unwrap();
}

/// A restart between `XA PREPARE` and `XA COMMIT`: the stored position stays before the
/// prepare, the restart reads it again, publishes the rows at the commit and sends nothing
/// it had already published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_prepared_xa_transaction_survives_a_restart() {
    let w = World::mysql("mxr").build().await;
    let mut admin = w.admin().await;
    let insert = format!("INSERT INTO {} (topic, payload) VALUES (?, ?)", w.table(0, 0));
    let first = w.start("first.log");
    admin.exec_drop(&insert, (&w.topic, b"a".as_slice())).await.unwrap();
    let mut held = w.admin().await;
    let mut dropped = w.admin().await;
    xa_insert(&mut held, "keep", &w.table(0, 0), &w.topic, "held").await;
    xa_insert(&mut dropped, "drop", &w.table(0, 0), &w.topic, "never").await;
    admin.exec_drop(&insert, (&w.topic, b"b".as_slice())).await.unwrap();
    assert_eq!(payloads(&kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await), ["a", "b"]);
    // Row b is deleted and its position stored once the table holds only the XA rows (which
    // count(*) does not see until they commit).
    w.wait_drained(&w.table(0, 0)).await;
    assert!(first.stop());
    let (done,): (Option<String>,) = admin
        .exec_first(format!("SELECT done_gtid FROM {}_checkpoint WHERE stream = ?", w.prefix), (w.table(0, 0),))
        .await
        .unwrap()
        .unwrap();
    assert!(done.is_some(), "the stored position waits before the prepare while done_gtid moves on");
    admin.exec_drop(&insert, (&w.topic, b"c".as_slice())).await.unwrap();
    held.query_drop("XA COMMIT 'keep'").await.unwrap();
    dropped.query_drop("XA ROLLBACK 'drop'").await.unwrap();
    admin.exec_drop(&insert, (&w.topic, b"d".as_slice())).await.unwrap();
    let second = w.start("second.log");
    let records = kafka::read_at_least(&w.topic, 1, 5, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "b", "c", "held", "d"], "each once, the XA rows at their commit");
    w.wait_drained(&w.table(0, 0)).await;
    let (done,): (Option<String>,) = admin
        .exec_first(format!("SELECT done_gtid FROM {}_checkpoint WHERE stream = ?", w.prefix), (w.table(0, 0),))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done, None, "nothing held: the stored position is the stream's own again");
    assert!(second.stop());
    for c in [held, dropped, admin] {
        c.disconnect().await.unwrap();
    }
}
