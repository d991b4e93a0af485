//! The MariaDB binlog path end to end: real MariaDB, real Kafka, the real binary, the
//! least-privilege streamer user.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use mysql_async::TxOpts;
use mysql_async::prelude::Queryable;

use crate::faults;
use crate::polling::POLLING;
use crate::support::streamer::run_cli;
use crate::support::world::World;
use crate::support::{kafka, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_concurrent_writers_arrive_once_in_commit_order_per_key() {
    let w = World::mysql("mc").kafka_partitions(3).build().await;
    const KEYS: usize = 8;
    let mut admin = w.admin().await;
    admin.query_drop("CREATE TABLE key_seq (k VARCHAR(20) PRIMARY KEY, n INT NOT NULL) ENGINE=InnoDB").await.unwrap();
    for k in 0..KEYS {
        admin.exec_drop("INSERT INTO key_seq VALUES (?, 0)", (format!("key-{k}"),)).await.unwrap();
    }
    let streamer = w.start("streamer.log");
    let committed = Arc::new(AtomicUsize::new(0));
    let mut writers = Vec::new();
    for writer in 0..6u64 {
        let url = w.db.admin_url.clone();
        let (table, topic, committed) = (w.table(0, 0), w.topic.clone(), committed.clone());
        writers.push(tokio::spawn(async move {
            let mut conn = mysql_async::Conn::new(mysql_async::Opts::from_url(&url).unwrap()).await.unwrap();
            let mut seed = writer * 7919 + 3;
            for txn_no in 0..40 {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let mut keys: Vec<usize> =
                    (0..1 + (seed >> 33) % 3).map(|i| ((seed >> (8 * i)) as usize) % KEYS).collect();
                keys.sort_unstable();
                keys.dedup();
                let rollback = txn_no % 8 == 5;
                let mut tx = conn.start_transaction(TxOpts::default()).await.unwrap();
                for k in &keys {
                    let key = format!("key-{k}");
                    tx.exec_drop("UPDATE key_seq SET n = n + 1 WHERE k = ?", (&key,)).await.unwrap();
                    let n: Option<i32> = tx.exec_first("SELECT n FROM key_seq WHERE k = ?", (&key,)).await.unwrap();
                    let payload =
                        format!("{key}:{}:{}", n.unwrap(), if rollback { "rolled-back" } else { "committed" });
                    tx.exec_drop(
                        format!("INSERT INTO {table} (topic, msg_key, payload) VALUES (?, ?, ?)"),
                        (&topic, key.as_bytes(), payload.as_bytes()),
                    )
                    .await
                    .unwrap();
                }
                if rollback {
                    tx.rollback().await.unwrap();
                } else {
                    tx.commit().await.unwrap();
                    committed.fetch_add(keys.len(), Ordering::SeqCst);
                }
            }
            conn.disconnect().await.unwrap();
        }));
    }
    // A binlog rotation in the middle of the stream.
    admin.query_drop("FLUSH BINARY LOGS").await.unwrap();
    for wr in writers {
        wr.await.unwrap();
    }
    admin.query_drop("FLUSH BINARY LOGS").await.unwrap();
    admin.disconnect().await.unwrap();
    let expected = committed.load(Ordering::SeqCst);
    let records = kafka::read_at_least(&w.topic, 3, expected, ARRIVAL).await;
    assert_eq!(records.len(), expected, "every committed row exactly once in a fault-free run");
    for r in &records {
        assert!(r.header("outbox-gtid").split('-').count() == 3, "outbox-gtid is a MariaDB GTID");
    }
    kafka::assert_commit_order_per_key(&records);
    w.wait_drained(&w.table(0, 0)).await;
    assert!(streamer.stop(), "streamer exits 0 on SIGTERM");
}

/// A clean restart resumes after the stored GTID state: nothing is published twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_restart_resumes_from_the_stored_checkpoint() {
    restart_resumes("mr", false).await;
}

/// The file/offset fallback (checkpoint `gtid` NULL): the stream resumes at the stored file
/// offset, across a binlog rotation, and keeps storing file offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_restart_resumes_from_a_file_offset_checkpoint() {
    restart_resumes("mf", true).await;
}

async fn restart_resumes(name: &str, file_form: bool) {
    let w = World::mysql(name).build().await;
    let mut admin = w.admin().await;
    if file_form {
        admin.query_drop(format!("UPDATE {}_checkpoint SET gtid = NULL", w.prefix)).await.unwrap();
    }
    let insert = format!("INSERT INTO {} (topic, msg_key, payload, headers) VALUES (?, ?, ?, ?)", w.table(0, 0));
    for i in 0..30 {
        admin
            .exec_drop(
                &insert,
                (&w.topic, format!("k{}", i % 3).as_bytes(), format!("p{i}").as_bytes(), format!(r#"{{"n":"{i}"}}"#)),
            )
            .await
            .unwrap();
    }
    let first = w.start("first.log");
    kafka::read_at_least(&w.topic, 1, 30, ARRIVAL).await;
    w.wait_drained(&w.table(0, 0)).await;
    assert!(first.stop());
    let (gtid, file, offset): (Option<String>, String, u64) = admin
        .query_first(format!("SELECT gtid, binlog_file, binlog_pos FROM {}_checkpoint", w.prefix))
        .await
        .unwrap()
        .unwrap();
    if file_form {
        assert_eq!(gtid, None, "the file form stays the file form");
        assert!(file.contains('.') && offset > 4, "a stored file offset: {file}:{offset}");
    } else {
        assert!(gtid.as_deref().is_some_and(|g| g.contains('-')), "a stored GTID state: {gtid:?}");
    }
    // The second run starts in a binlog file the first never saw.
    admin.query_drop("FLUSH BINARY LOGS").await.unwrap();

    for i in 30..60 {
        admin
            .exec_drop(
                &insert,
                (&w.topic, format!("k{}", i % 3).as_bytes(), format!("p{i}").as_bytes(), format!(r#"{{"n":"{i}"}}"#)),
            )
            .await
            .unwrap();
    }
    let second = w.start("second.log");
    let records = kafka::read_at_least(&w.topic, 1, 60, ARRIVAL).await;
    assert_eq!(records.len(), 60, "no row published twice across a clean restart");
    let payloads: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    let want: Vec<String> = (0..60).map(|i| format!("p{i}")).collect();
    assert_eq!(payloads, want, "commit order");
    assert_eq!(records[7].header("n"), "7", "row headers become Kafka headers");
    w.wait_drained(&w.table(0, 0)).await;
    assert!(second.stop());
    admin.disconnect().await.unwrap();
}

/// 20,000 rows in 100 paced transactions while the streamer is killed with SIGKILL three
/// times: nothing is lost (the delete and the checkpoint commit together, so a replay after a
/// kill re-sends only rows still in the table); duplicates are counted ([`faults::sigkill`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_sigkill_at_random_moments_loses_nothing() {
    let w = World::mysql("mk").kafka_partitions(3).build().await;
    faults::sigkill(w, 100, Duration::from_millis(40)).await;
}

/// The same in polling mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_polling_sigkill_at_random_moments_loses_nothing() {
    let w = World::mysql("mpk").kafka_partitions(3).config(POLLING).build().await;
    faults::sigkill(w, 100, Duration::from_millis(40)).await;
}

/// A NULL topic halts the shard-partition with one error naming the row and column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_bad_row_halts_naming_it() {
    let w = World::mysql("mh").build().await;
    let mut admin = w.admin().await;
    admin.query_drop(format!("ALTER TABLE {} MODIFY topic VARCHAR(249) NULL", w.table(0, 0))).await.unwrap();
    let streamer = w.start("streamer.log");
    admin
        .exec_drop(format!("INSERT INTO {} (topic, payload) VALUES (?, 'ok')", w.table(0, 0)), (&w.topic,))
        .await
        .unwrap();
    admin.query_drop(format!("INSERT INTO {} (topic, payload) VALUES (NULL, 'bad')", w.table(0, 0))).await.unwrap();
    let bad: Option<i64> = admin.query_first("SELECT LAST_INSERT_ID()").await.unwrap();
    let log = streamer.wait_for_halt(ARRIVAL).await;
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert_eq!(errors.len(), 1, "{log}");
    assert!(
        errors[0].contains(&format!("row id={}", bad.unwrap())) && errors[0].contains("column topic"),
        "{}",
        errors[0]
    );
    let records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(records.iter().map(|r| r.payload_str()).collect::<Vec<_>>(), ["ok"]);
    assert_eq!(w.count(&w.table(0, 0)).await, 1, "the bad row stays in the table");
    assert!(streamer.stop());
    admin.disconnect().await.unwrap();
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
    db.query_drop("FLUSH BINARY LOGS").await.unwrap();
    let current: mysql_async::Row = db.query_first("SHOW MASTER STATUS").await.unwrap().unwrap();
    let file: String = current.get(0).unwrap();
    // The server keeps a file a replica connection still reads (the stopped instance's dump
    // thread may linger a moment), so purge until only the current file is left.
    let admin_url = w.db.admin_url.clone();
    wait_until("older binlogs to be purged", ARRIVAL, || async {
        let mut c = mysql_async::Conn::new(mysql_async::Opts::from_url(&admin_url).unwrap()).await.unwrap();
        c.query_drop(format!("PURGE BINARY LOGS TO '{file}'")).await.unwrap();
        let logs: Vec<mysql_async::Row> = c.query("SHOW BINARY LOGS").await.unwrap();
        c.disconnect().await.unwrap();
        (logs.len() == 1).then_some(())
    })
    .await;
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
