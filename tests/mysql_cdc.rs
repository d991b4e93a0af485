//! The MariaDB binlog path end to end: real MariaDB, real Kafka, the real binary, the
//! least-privilege streamer user.

use std::time::Duration;

use mysql_async::prelude::Queryable;

use crate::faults;
use crate::polling::POLLING;
use crate::support::kafka;
use crate::support::mysql::MyDb;
use crate::support::streamer::run_cli;
use crate::support::world::World;

const ARRIVAL: Duration = Duration::from_secs(120);

/// [`faults::concurrent_writers`], with a MariaDB GTID in each record's `outbox-gtid`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_concurrent_writers_arrive_once_in_commit_order_per_key() {
    faults::concurrent_writers(World::mysql("mc").kafka_partitions(3).build().await).await;
}

/// A clean restart resumes after the stored GTID state: nothing is published twice
/// ([`faults::restart_resumes`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_restart_resumes_from_the_stored_checkpoint() {
    let w = World::mysql("mr").shards(2).kafka_partitions(4).build().await;
    faults::restart_resumes(w, async |w| {
        for (stream, gtid, _, _) in checkpoints(w).await {
            assert!(gtid.as_deref().is_some_and(|g| g.contains('-')), "{stream}: a stored GTID state: {gtid:?}");
        }
    })
    .await;
}

/// The file/offset fallback (checkpoint `gtid` NULL): the stream resumes at the stored file
/// offset, across a binlog rotation, and keeps storing file offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_restart_resumes_from_a_file_offset_checkpoint() {
    let w = World::mysql("mf").shards(2).kafka_partitions(4).build().await;
    let mut admin = w.admin().await;
    admin.query_drop(format!("UPDATE {}_checkpoint SET gtid = NULL", w.prefix)).await.unwrap();
    admin.disconnect().await.unwrap();
    faults::restart_resumes(w, async |w| {
        for (stream, gtid, file, offset) in checkpoints(w).await {
            assert_eq!(gtid, None, "{stream}: the file form stays the file form");
            assert!(file.contains('.') && offset > 4, "{stream}: a stored file offset: {file}:{offset}");
        }
    })
    .await;
}

/// Each stream's stored checkpoint: stream, GTID state, binlog file and offset.
async fn checkpoints(w: &World<MyDb>) -> Vec<(String, Option<String>, String, u64)> {
    let mut admin = w.admin().await;
    let sql = format!("SELECT stream, gtid, binlog_file, binlog_pos FROM {}_checkpoint", w.prefix);
    let rows: Vec<(String, Option<String>, String, u64)> = admin.query(sql).await.unwrap();
    admin.disconnect().await.unwrap();
    assert!(!rows.is_empty(), "the first run stored a checkpoint");
    rows
}

/// 20,000 rows in 100 paced transactions while the streamer is killed with SIGKILL three
/// times: nothing is lost (the delete and the checkpoint commit together, so a replay after a
/// kill re-sends only rows still in the table); duplicates are counted ([`faults::sigkill`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_sigkill_at_random_moments_loses_nothing() {
    let w = World::mysql("mk").kafka_partitions(3).build().await;
    faults::sigkill(w, 100, Duration::from_millis(40)).await;
}

/// [`faults::sigkill`] under exactly-once delivery: 0 lost and 0 duplicated for a
/// `read_committed` consumer ([`faults::sigkill_exactly_once`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_exactly_once_sigkill_at_random_moments_sends_each_row_once() {
    let w = World::mysql("mek").kafka_partitions(3).config(crate::postgres_faults::EXACTLY_ONCE).build().await;
    faults::sigkill_exactly_once(w, 100, Duration::from_millis(40)).await;
}

/// [`faults::kafka_outage_exactly_once`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_exactly_once_kafka_outage_sends_each_row_once() {
    let w =
        World::mysql("meo").kafka_partitions(3).config(crate::postgres_faults::EXACTLY_ONCE).exclusive().build().await;
    faults::kafka_outage_exactly_once(w).await;
}

/// The same in polling mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_polling_sigkill_at_random_moments_loses_nothing() {
    let w = World::mysql("mpk").kafka_partitions(3).config(POLLING).build().await;
    faults::sigkill(w, 100, Duration::from_millis(40)).await;
}

/// The same under exactly-once delivery ([`faults::sigkill_exactly_once`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_polling_exactly_once_sigkill_at_random_moments_sends_each_row_once() {
    let config = format!("{POLLING}\n{}", crate::postgres_faults::EXACTLY_ONCE);
    let w = World::mysql("mpe").kafka_partitions(3).config(&config).build().await;
    faults::sigkill_exactly_once(w, 100, Duration::from_millis(40)).await;
}

/// A NULL topic halts its shard-partition with one error naming the row, the column and the
/// fix ([`faults::bad_row_halts_its_shard_partition`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_bad_row_halts_naming_it() {
    faults::bad_row_halts_its_shard_partition(World::mysql("mh").shards(2).build().await).await;
}

/// A stored position whose binlogs were purged while the streamer was stopped: the start
/// takes a new position first, sends the rows still in the table by polling, then streams
/// from the new position. Purging binlogs is server-wide, so this test runs alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_purged_position_is_caught_up_by_polling() {
    let w = World::mysql("mp").exclusive().build().await;
    let mut db = w.admin().await;
    let (config, topic) = (&w.config, &w.topic);
    let table = w.table(0, 0);
    // Move the stored position into a binlog file, then purge past it while stopped.
    let first = w.start("first.log");
    db.exec_drop(format!("INSERT INTO {table} (topic, payload) VALUES (?, 'one')"), (topic,)).await.unwrap();
    kafka::read_at_least(topic, 1, 1, ARRIVAL).await;
    assert!(first.stop());
    db.exec_drop(format!("INSERT INTO {table} (topic, payload) VALUES (?, 'two')"), (topic,)).await.unwrap();
    crate::support::mysql::purge_binlogs(&w.db.admin_url).await;
    let second = w.start("second.log");
    let log = second.wait_for_log("catch-up done", ARRIVAL).await;
    assert!(log.contains("WARN") && log.contains("purged") && log.contains("rows=1"), "{log}");
    db.exec_drop(format!("INSERT INTO {table} (topic, payload) VALUES (?, 'three')"), (topic,)).await.unwrap();
    let records = kafka::read_at_least(topic, 1, 3, ARRIVAL).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(got, ["one", "two", "three"], "no row lost, none twice");
    assert_eq!(records[2].header("outbox-gtid").split('-').count(), 3, "streaming from the new position");
    let (ok, out, err) = run_cli(config, &["status"]);
    assert!(ok && out.contains("(1 rows)"), "status names the catch-up:\n{out}\n{err}");
    assert!(second.stop());
    db.disconnect().await.unwrap();
}

/// Runs a streamer until it published one row (`one`) of table 0/0, then stops it: the stored
/// position is past a transaction. Answers an admin session and the insert statement
/// (`topic`, `payload`).
pub(crate) async fn one_published_then_stopped(w: &World<MyDb>) -> (mysql_async::Conn, String) {
    let insert = format!("INSERT INTO {} (topic, payload) VALUES (?, ?)", w.table(0, 0));
    let mut db = w.admin().await;
    let first = w.start("first.log");
    db.exec_drop(&insert, (&w.topic, "one")).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert!(first.stop());
    (db, insert)
}

/// A transaction that took its id before the catch-up's snapshot and commits while the drain
/// runs is sent once — by the stream, after every drained row (commit order) — because the
/// drain reads inside the snapshot the new position was taken from. Purging binlogs is
/// server-wide, so this test runs alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_catch_up_sends_a_transaction_committing_during_its_drain_once_in_order() {
    const BACKLOG: usize = 20_000;
    let w = World::mysql("mq").exclusive().build().await;
    let table = w.table(0, 0);
    let (mut db, insert) = one_published_then_stopped(&w).await;
    // Takes its id now, commits later.
    let mut late = w.admin().await;
    late.query_drop("START TRANSACTION").await.unwrap();
    late.exec_drop(&insert, (&w.topic, "late")).await.unwrap();
    let rows: Vec<String> = (0..BACKLOG).map(|i| format!("({:?}, 'b{i}')", w.topic)).collect();
    for chunk in rows.chunks(1000) {
        db.query_drop(format!("INSERT INTO {table} (topic, payload) VALUES {}", chunk.join(","))).await.unwrap();
    }
    crate::support::mysql::purge_binlogs(&w.db.admin_url).await;
    let second = w.start("second.log");
    // The snapshot is taken and the position stored: commit while the drain runs.
    second.wait_for_log("stored the new position", ARRIVAL).await;
    late.query_drop("COMMIT").await.unwrap();
    second.wait_for_log("catch-up done", ARRIVAL).await;
    db.exec_drop(&insert, (&w.topic, "after")).await.unwrap();
    let records = kafka::read_at_least(&w.topic, 1, BACKLOG + 3, ARRIVAL).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(got.len(), BACKLOG + 3, "no row twice: {:?}", &got[got.len().saturating_sub(5)..]);
    assert_eq!(got[0], "one");
    assert!(got[1..=BACKLOG].iter().enumerate().all(|(i, p)| *p == format!("b{i}")), "the drain, in id order");
    assert_eq!(got[BACKLOG + 1..], ["late", "after"], "the late commit streamed, in commit order");
    assert!(second.stop());
    late.disconnect().await.unwrap();
    db.disconnect().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_add_column_while_streaming_keeps_working() {
    let w = World::mysql("ma").build().await;
    let mut admin = w.admin().await;
    let streamer = w.start("streamer.log");
    let insert = format!("INSERT INTO {} (topic, payload) VALUES (?, ?)", w.table(0, 0));
    for i in 0..5 {
        admin.exec_drop(&insert, (&w.topic, format!("before-{i}").as_bytes())).await.unwrap();
    }
    kafka::read_at_least(&w.topic, 1, 5, ARRIVAL).await;
    admin
        .query_drop(format!("ALTER TABLE {} ADD COLUMN note VARCHAR(20) DEFAULT 'n' FIRST", w.table(0, 0)))
        .await
        .unwrap();
    for i in 0..5 {
        admin.exec_drop(&insert, (&w.topic, format!("after-{i}").as_bytes())).await.unwrap();
    }
    let records = kafka::read_at_least(&w.topic, 1, 10, ARRIVAL).await;
    assert_eq!(records.len(), 10);
    assert_eq!(records.last().unwrap().payload_str(), "after-4", "columns are matched by name, not position");
    w.wait_drained(&w.table(0, 0)).await;
    assert!(streamer.stop());
    admin.disconnect().await.unwrap();
}

/// [`faults::dead_letter_whole`]. Before, the dead-letter record of an invalid row had no key
/// and no payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_bad_rows_go_to_the_dead_letter_topic_whole() {
    faults::dead_letter_whole(World::mysql("md")).await;
}

/// [`faults::full_client_queue`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_full_client_queue_is_waited_on_and_loses_nothing() {
    faults::full_client_queue(World::mysql("mq").kafka_partitions(3)).await;
}

/// [`faults::million_row_transaction`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_million_row_transaction_passes_with_bounded_memory() {
    faults::million_row_transaction(World::mysql("mm").kafka_partitions(3).build().await).await;
}

/// [`faults::kafka_outage`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_kafka_outage_longer_than_the_delivery_timeout_loses_nothing() {
    faults::kafka_outage(World::mysql("mo").kafka_partitions(3).exclusive().build().await).await;
}

/// The same outage in polling mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_polling_kafka_outage_longer_than_the_delivery_timeout_loses_nothing() {
    faults::kafka_outage(World::mysql("mpo").kafka_partitions(3).config(POLLING).exclusive().build().await).await;
}

/// The link to MariaDB goes silent: the binlog heartbeat notices ([`faults::silent_dead_link`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_silent_dead_connection_is_detected_and_recovered() {
    faults::silent_dead_link(World::mysql("mdl").build().await).await;
}
