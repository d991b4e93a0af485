//! Polling mode and mode switches on MariaDB: real MariaDB, real Kafka, the real binary, the
//! least-privilege user (without PROCESS, so rescans start from the lowest id).

use std::time::Duration;

use mysql_async::prelude::Queryable;

use crate::polling::POLLING;
use crate::support::kafka;
use crate::support::mysql::MyDb;
use crate::support::streamer::source_config;
use crate::support::world::World;

const ARRIVAL: Duration = Duration::from_secs(120);

async fn insert(admin: &mut mysql_async::Conn, w: &World<MyDb>, range: std::ops::Range<usize>) {
    let sql = format!("INSERT INTO {} (topic, msg_key, payload) VALUES (?, 'k', ?)", w.table(0, 0));
    for i in range {
        admin.exec_drop(&sql, (&w.topic, format!("p{i}"))).await.unwrap();
    }
}

/// A row whose transaction stays open while 50 later rows commit and are published is still
/// published when it commits; meanwhile the cleanup never waits on the open transaction's lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_polling_publishes_a_row_whose_transaction_commits_late() {
    late_commit("ml", POLLING).await;
}

/// The same in CDC mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_cdc_publishes_a_row_whose_transaction_commits_late() {
    late_commit("mlc", "").await;
}

/// With `PROCESS` granted (as docs/polling.md recommends) the poller reads the table's
/// writers from INNODB_TRX, a cache InnoDB does not refresh while it is read more often than
/// every 100 ms — as the poller itself reads it. Before the fix the stale list lacked the open
/// writer, the low-water mark passed its row, and the row stayed in the table (5 of 5 runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_polling_with_process_publishes_a_row_whose_transaction_commits_late() {
    let grants = format!("{}, PROCESS", crate::support::mysql::STREAMER_GRANTS);
    let w = World::mysql("mlp").config(POLLING).grants(&grants).build().await;
    late_commit_in(w).await;
}

async fn late_commit(name: &str, extra: &str) {
    late_commit_in(World::mysql(name).config(extra).build().await).await;
}

async fn late_commit_in(w: World<MyDb>) {
    let streamer = w.start("streamer.log");
    // The stream reads (and, polling, reads INNODB_TRX every few ms) before the writer starts.
    streamer.wait_for_state("streaming", ARRIVAL).await;
    let mut admin = w.admin().await;
    let mut slow = w.admin().await;
    let mut tx = slow.start_transaction(mysql_async::TxOpts::default()).await.unwrap();
    tx.exec_drop(format!("INSERT INTO {} (topic, payload) VALUES (?, 'late')", w.table(0, 0)), (&w.topic,))
        .await
        .unwrap();
    insert(&mut admin, &w, 0..50).await;
    let early = kafka::read_at_least(&w.topic, 1, 50, ARRIVAL).await;
    assert!(early.iter().all(|r| r.payload_str() != "late"));
    crate::support::wait_until("the 50 rows to be deleted around the open transaction", ARRIVAL, || async {
        (w.count(&w.table(0, 0)).await == 0).then_some(())
    })
    .await;
    tx.commit().await.unwrap();
    let all = kafka::read_at_least(&w.topic, 1, 51, ARRIVAL).await;
    assert_eq!(all.len(), 51, "every row once");
    assert_eq!(all[50].payload_str(), "late");
    w.wait_drained(&w.table(0, 0)).await;
    assert!(streamer.stop());
}

/// cdc → polling → cdc by config and restart on MariaDB: every row once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_switching_between_cdc_and_polling_is_safe_both_ways() {
    let w = World::mysql("ms").build().await;
    let mut admin = w.admin().await;
    let set_mode = |extra: &str| source_config(&w.dir, "mysql", &w.streamer_url, &w.prefix, 1, 1, extra);
    insert(&mut admin, &w, 0..10).await;
    let cdc = w.start("cdc-1.log");
    kafka::read_at_least(&w.topic, 1, 10, ARRIVAL).await;
    assert!(cdc.stop());

    insert(&mut admin, &w, 10..20).await;
    set_mode(POLLING);
    let polling = w.start("polling.log");
    kafka::read_at_least(&w.topic, 1, 20, ARRIVAL).await;
    w.wait_drained(&w.table(0, 0)).await;
    assert!(polling.stop());

    insert(&mut admin, &w, 20..30).await;
    set_mode("");
    let cdc = w.start("cdc-2.log");
    let log = cdc.wait_for_log("catch-up done", ARRIVAL).await;
    assert!(log.contains("rows=10"), "{log}");
    insert(&mut admin, &w, 30..40).await;
    let records = kafka::read_at_least(&w.topic, 1, 40, ARRIVAL).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(got, (0..40).map(|i| format!("p{i}")).collect::<Vec<_>>(), "every row once, in order");
    assert_eq!(records[35].header("outbox-gtid").split('-').count(), 3, "streaming again after the catch-up");
    assert!(cdc.stop());
}
