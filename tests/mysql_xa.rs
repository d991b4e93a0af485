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

/// A catch-up while an XA transaction that wrote the table is prepared (here: a stream back
/// from polling, so a catch-up is pending): its consistent snapshot cannot see the prepared
/// rows and its position lies after the prepare, so the stream resumes before the prepare with
/// the snapshot as the replay mark and publishes the rows at the `XA COMMIT`, in commit order.
/// Before, the stream started after the prepare and the sweep sent the rows intervals later,
/// after rows committed after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_catch_up_keeps_an_xa_transaction_prepared_before_it() {
    let w = World::mysql("mxc").build().await;
    let (mut admin, insert) = crate::mysql_cdc::one_published_then_stopped(&w).await;
    let mut held = w.admin().await;
    // Prepared XA transactions outlive their session: a unique XID per run.
    let xid = format!("{}-held", w.prefix);
    xa_insert(&mut held, &xid, &w.table(0, 0), &w.topic, "held").await;
    // The prepare is then in an older binlog file than the snapshot's.
    admin.query_drop("FLUSH BINARY LOGS").await.unwrap();
    admin.exec_drop(&insert, (&w.topic, "b")).await.unwrap();
    admin
        .exec_drop(format!("UPDATE {}_checkpoint SET catchup_pending = 1 WHERE stream = ?", w.prefix), (w.table(0, 0),))
        .await
        .unwrap();
    let second = w.start("second.log");
    let log = second.wait_for_log("catch-up done", ARRIVAL).await;
    assert!(log.contains("found the prepare of an XA transaction"), "{log}");
    assert!(log.contains("rows=1"), "the drain sent b only: {log}");
    admin.exec_drop(&insert, (&w.topic, "c")).await.unwrap();
    held.query_drop(format!("XA COMMIT '{xid}'")).await.unwrap();
    admin.exec_drop(&insert, (&w.topic, "d")).await.unwrap();
    let records = kafka::read_at_least(&w.topic, 1, 5, ARRIVAL).await;
    assert_eq!(payloads(&records), ["one", "b", "c", "held", "d"], "each once, the XA rows at their commit");
    w.wait_drained(&w.table(0, 0)).await;
    assert!(second.stop());
    held.disconnect().await.unwrap();
    admin.disconnect().await.unwrap();
}

/// The same, after the binlog holding the prepare was purged (the server purges it although
/// the transaction is still prepared): the prepare cannot be read again, the catch-up names
/// the XID in a warning, and the sweep publishes the rows once they commit — once, later than
/// their commit. Purging binlogs is server-wide, so this test runs alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_catch_up_after_the_prepare_was_purged_names_it_and_the_sweep_sends_it() {
    let w = World::mysql("mxp").config("sweep_interval_ms = 300").exclusive().build().await;
    let (mut admin, insert) = crate::mysql_cdc::one_published_then_stopped(&w).await;
    let mut held = w.admin().await;
    let xid = format!("{}-purged", w.prefix);
    xa_insert(&mut held, &xid, &w.table(0, 0), &w.topic, "held").await;
    admin.exec_drop(&insert, (&w.topic, "b")).await.unwrap();
    crate::support::mysql::purge_binlogs(&w.db.admin_url).await;
    let second = w.start("second.log");
    let log = second.wait_for_log("catch-up done", ARRIVAL).await;
    // Named as `XA COMMIT` and `XA RECOVER FORMAT='SQL'` take it.
    let named: String = xid.bytes().map(|b| format!("{b:02x}")).collect();
    assert!(log.contains("prepares are not in the binlog any more") && log.contains(&named), "{log}");
    held.query_drop(format!("XA COMMIT '{xid}'")).await.unwrap();
    admin.exec_drop(&insert, (&w.topic, "c")).await.unwrap();
    let records = kafka::read_distinct(&w.topic, 1, 4, ARRIVAL).await;
    let mut got = payloads(&records);
    got.sort();
    assert_eq!(got, ["b", "c", "held", "one"], "each once");
    w.wait_drained(&w.table(0, 0)).await;
    assert!(second.stop());
    held.disconnect().await.unwrap();
    admin.disconnect().await.unwrap();
}
