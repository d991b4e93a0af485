//! `storage = "wal"` on MariaDB: the shard-partition's table is a BLACKHOLE table, so an
//! application's `INSERT` goes to the binlog and nowhere else. Commit order, rollbacks, the
//! identity (GTID sequence and place), a statement-logged write, a purged position, and setup
//! refusing to discard rows — against the real servers.

use std::collections::HashSet;

use mysql_async::prelude::Queryable;

use crate::faults;
use crate::support::kafka;
use crate::support::streamer::run_cli;
use crate::support::world::{ARRIVAL, World};

const WAL: &str = "storage = \"wal\"";

fn payloads(records: &[kafka::Record]) -> Vec<String> {
    records.iter().map(kafka::Record::payload_str).collect()
}

/// [`faults::concurrent_writers`] into a BLACKHOLE table.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_wal_concurrent_writers_arrive_once_in_commit_order_per_key() {
    faults::concurrent_writers(World::mysql("yc").kafka_partitions(3).config(WAL).build().await).await;
}

/// [`faults::restart_resumes`] with `storage = "wal"`: nothing is sent twice across a clean
/// restart, and the headers are complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_wal_restart_resumes_without_republishing() {
    let w = World::mysql("yr").shards(2).kafka_partitions(4).config(WAL).build().await;
    faults::restart_resumes(w, async |_| {}).await;
}

/// [`faults::million_row_transaction`] into a BLACKHOLE table: one statement, a million
/// identities, bounded memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_wal_a_million_message_transaction_passes_with_bounded_memory() {
    faults::million_row_transaction(World::mysql("yb").config(WAL).build().await).await;
}

/// The table stores nothing; each message's `outbox-id` is unique although BLACKHOLE hands out
/// the same `id` to every statement, stable across a replay, and a rolled-back insert is never
/// sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_wal_messages_have_distinct_stable_identities_and_rollbacks_never_leave() {
    let w = World::mysql("yi").config(WAL).build().await;
    let table = w.table(0, 0);
    let mut db = w.admin().await;
    let engine: Option<String> =
        db.exec_first("SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_NAME = ?", (&table,)).await.unwrap();
    assert_eq!(engine.as_deref(), Some("BLACKHOLE"));
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES (?, ?)");
    let streamer = w.start("first.log");
    db.query_drop("BEGIN").await.unwrap();
    for p in ["a", "b"] {
        db.exec_drop(&insert, (&w.topic, p)).await.unwrap();
    }
    db.query_drop("COMMIT").await.unwrap();
    db.query_drop("BEGIN").await.unwrap();
    db.exec_drop(&insert, (&w.topic, "rolled-back")).await.unwrap();
    db.query_drop("ROLLBACK").await.unwrap();
    db.exec_drop(&insert, (&w.topic, "c")).await.unwrap();
    let records = kafka::read_at_least(&w.topic, 1, 3, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "b", "c"]);
    let ids: HashSet<&str> = records.iter().map(|r| r.header("outbox-id")).collect();
    assert_eq!(ids.len(), 3, "distinct identities: {records:?}");
    assert_eq!(w.count(&table).await, 0, "nothing is stored");
    assert!(streamer.stop());
    // A replay from an older position yields the same identities.
    let checkpoint = format!("{}_checkpoint", w.prefix);
    let first_gtid = records[0].header("outbox-gtid").to_string();
    let (domain, server, seq) = {
        let p: Vec<u64> = first_gtid.split('-').map(|n| n.parse().unwrap()).collect();
        (p[0], p[1], p[2])
    };
    db.exec_drop(
        format!("UPDATE {checkpoint} SET gtid = ?, done_gtid = NULL WHERE stream = ?"),
        (format!("{domain}-{server}-{}", seq - 1), &table),
    )
    .await
    .unwrap();
    let second = w.start("second.log");
    let again = kafka::read_at_least(&w.topic, 1, 6, ARRIVAL).await;
    let replayed: Vec<(&str, String)> = again[3..].iter().map(|r| (r.header("outbox-id"), r.payload_str())).collect();
    let first: Vec<(&str, String)> = again[..3].iter().map(|r| (r.header("outbox-id"), r.payload_str())).collect();
    assert_eq!(replayed, first, "the same messages with the same identities");
    assert!(second.stop());
    db.disconnect().await.unwrap();
}

/// A statement-logged insert into the BLACKHOLE table halts naming the transaction (the table
/// holds nothing to sweep); the fix it names — skip that transaction — works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_wal_a_statement_logged_write_halts_and_skip_clears_it() {
    let w = World::mysql("ys").config(WAL).build().await;
    let table = w.table(0, 0);
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES (?, ?)");
    let mut db = w.admin().await;
    let first = w.start("first.log");
    db.exec_drop(&insert, (&w.topic, "a")).await.unwrap();
    let mut statement = w.admin().await;
    statement.query_drop("SET SESSION binlog_format = 'STATEMENT'").await.unwrap();
    statement.exec_drop(&insert, (&w.topic, "statement-logged")).await.unwrap();
    db.exec_drop(&insert, (&w.topic, "b")).await.unwrap();
    let line = first.wait_for_one_halt(ARRIVAL).await;
    assert!(line.contains("binlog_format=STATEMENT") && line.contains("--transaction"), "{line}");
    let txn = line.split("--transaction ").nth(1).unwrap().split('`').next().unwrap().to_string();
    assert!(first.stop());
    let (ok, out, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--transaction", &txn]);
    assert!(ok, "{out}\n{err}");
    let second = w.start("second.log");
    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "b"]);
    assert!(second.stop());
    for c in [db, statement] {
        c.disconnect().await.unwrap();
    }
}

/// A stored position purged from the server halts a `wal` shard-partition (the table holds
/// nothing to catch up from) and never moves on by itself; `skip --backlog`, the fix it names,
/// resumes at the current position. Purging binlogs is server-wide, so this test runs alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_wal_a_purged_position_halts_and_never_skips_silently() {
    let w = World::mysql("yp").config(WAL).exclusive().build().await;
    let (mut db, insert) = crate::mysql_cdc::one_published_then_stopped(&w).await;
    db.exec_drop(&insert, (&w.topic, "lost")).await.unwrap();
    crate::support::mysql::purge_binlogs(&w.db.admin_url).await;
    let second = w.start("second.log");
    let line = second.wait_for_one_halt(ARRIVAL).await;
    assert!(line.contains("purged") && line.contains("may be lost") && line.contains("--backlog"), "{line}");
    assert!(second.stop());
    let (ok, out, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--backlog"]);
    assert!(ok, "{out}\n{err}");
    let third = w.start("third.log");
    db.exec_drop(&insert, (&w.topic, "after")).await.unwrap();
    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(payloads(&records), ["one", "after"], "the operator's decision, and nothing silently");
    assert!(third.stop());
    db.disconnect().await.unwrap();
}

/// Switching a shard-partition whose table still holds rows to `wal` is refused (BLACKHOLE
/// would discard them); once they are published it converts the table, and back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_switching_storage_never_discards_rows() {
    let w = World::mysql("yw").build().await;
    let table = w.table(0, 0);
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES (?, ?)");
    let mut db = w.admin().await;
    db.exec_drop(&insert, (&w.topic, "row-1")).await.unwrap();
    w.edit_config(|c| format!("{c}\n{WAL}\n"));
    let setup = || run_cli(&w.config, &["setup", "--admin-url", &w.db.admin_url]);
    let (ok, out, err) = setup();
    assert!(!ok && err.contains("holds 1 row(s)") && err.contains("storage = \"table\""), "{out}\n{err}");
    assert_eq!(w.count(&table).await, 1, "nothing was discarded");
    w.edit_config(|c| c.replace(WAL, ""));
    let streamer = w.start("first.log");
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    w.wait_drained(&table).await;
    assert!(streamer.stop());
    w.edit_config(|c| format!("{c}\n{WAL}\n"));
    let (ok, out, err) = setup();
    assert!(ok, "{out}\n{err}");
    // The test server expires binlogs after a day, below the default margin of a week.
    assert!(err.contains("binlog_expire_logs_seconds = 86400") && err.contains("log_retention_min_hours"), "{err}");
    let (_, status, _) = crate::support::streamer::run_cli_code(&w.config, &["status"]);
    assert!(status.contains("cdc/wal") && status.contains("warning: binlog_expire_logs_seconds"), "{status}");
    db.exec_drop(&insert, (&w.topic, "message-1")).await.unwrap();
    assert_eq!(w.count(&table).await, 0, "a BLACKHOLE table now");
    let streamer = w.start("second.log");
    assert_eq!(payloads(&kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await), ["row-1", "message-1"]);
    assert!(streamer.stop());
    db.disconnect().await.unwrap();
}

/// SIGKILL three times at seed-dependent moments while 200-row transactions go into the
/// BLACKHOLE table: nothing is lost, first deliveries keep commit order per key (the identity
/// grows with the GTID), and duplicates stay bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_wal_sigkill_at_random_moments_loses_nothing() {
    wal_sigkill(World::mysql("yk").config(WAL).build().await, false).await;
}

/// The same under exactly-once delivery: a `read_committed` reader sees each message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_wal_exactly_once_sigkill_at_random_moments_sends_each_message_once() {
    let w = World::mysql("yek").config(WAL).config(crate::postgres_faults::EXACTLY_ONCE).build().await;
    wal_sigkill(w, true).await;
}

async fn wal_sigkill(w: World<crate::support::mysql::MyDb>, exactly_once: bool) {
    const TXNS: usize = 40;
    const PER_TXN: usize = 200;
    let table = w.table(0, 0);
    let writer = {
        let mut db = w.admin().await;
        let topic = w.topic.clone();
        let insert = format!("INSERT INTO {table} (topic, msg_key, payload) VALUES (?, ?, ?)");
        tokio::spawn(async move {
            let mut pace = tokio::time::interval(std::time::Duration::from_millis(40));
            for t in 0..TXNS {
                pace.tick().await;
                let mut tx = db.start_transaction(mysql_async::TxOpts::default()).await.unwrap();
                let rows = (0..PER_TXN).map(|r| (&topic, format!("k{}", r % 50), format!("m-{t}-{r}")));
                tx.exec_batch(&insert, rows).await.unwrap();
                tx.commit().await.unwrap();
            }
            db.disconnect().await.unwrap();
        })
    };
    let streamer = w.kill_three_times(400.0).await;
    writer.await.unwrap();
    let total = TXNS * PER_TXN;
    let records = kafka::read_distinct(&w.topic, 1, total, ARRIVAL).await;
    let seen: HashSet<String> = records.iter().map(kafka::Record::payload_str).collect();
    let want: HashSet<String> = (0..TXNS).flat_map(|t| (0..PER_TXN).map(move |r| format!("m-{t}-{r}"))).collect();
    assert_eq!(seen, want, "every committed message arrived, and no other");
    kafka::assert_first_deliveries_in_order(&records, total);
    let duplicates = records.len() - total;
    eprintln!("mariadb wal sigkill (exactly-once: {exactly_once}): {total} messages, 3 kills, {duplicates} duplicates");
    if exactly_once {
        assert_eq!(duplicates, 0, "a read_committed reader sees each message once");
    }
    assert!(duplicates <= 3 * 20_000, "{duplicates} duplicates");
    assert!(streamer.stop());
}

/// Kafka stopped past the delivery timeout while messages keep going into the BLACKHOLE table:
/// the stored checkpoint never passes an unsent message (nothing else holds them), and once
/// Kafka is back every message arrives, first deliveries in commit order per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_wal_kafka_outage_longer_than_the_delivery_timeout_loses_nothing() {
    let w = World::mysql("yo").kafka_partitions(3).config(WAL).exclusive().build().await;
    w.edit_config(|c| c.replace("message_timeout_ms = 10000", "message_timeout_ms = 3000"));
    let table = w.table(0, 0);
    let insert = format!("INSERT INTO {table} (topic, msg_key, payload) VALUES (?, ?, ?)");
    let streamer = w.start("streamer.log");
    let mut db = w.admin().await;
    let mut n = 0;
    // Each insert commits alone; answers its transaction's GTID sequence number.
    let mut send = async |count: usize| {
        let mut seqs = Vec::new();
        for _ in 0..count {
            let key = format!("k{}", n % 10);
            db.exec_drop(&insert, (&w.topic, &key, format!("{key}:{n}"))).await.unwrap();
            let gtid: String = db.query_first("SELECT @@last_gtid").await.unwrap().unwrap();
            seqs.push(gtid_seq(&gtid));
            n += 1;
        }
        seqs
    };
    send(100).await;
    kafka::read_at_least(&w.topic, 3, 100, ARRIVAL).await;
    let outage = crate::support::KafkaOutage::begin();
    let during = send(200).await;
    streamer.wait_for_metric("outbox_errors_total", &[("kind", "source")], 1.0, ARRIVAL).await;
    let mut admin = w.admin().await;
    let stored: Option<String> = admin
        .exec_first(format!("SELECT gtid FROM {}_checkpoint WHERE stream = ?", w.prefix), (&table,))
        .await
        .unwrap()
        .flatten();
    let stored = stored.map_or(0, |g| g.split(',').map(|one| gtid_seq(one.trim())).max().unwrap_or(0));
    assert!(stored < during[0], "the checkpoint passed an unsent message ({stored} ≥ {})", during[0]);
    drop(outage);
    let records = kafka::read_distinct(&w.topic, 3, 300, ARRIVAL).await;
    kafka::assert_first_deliveries_in_order(&records, 300);
    eprintln!("mariadb wal kafka outage: 300 messages, {} records ({} duplicates)", records.len(), records.len() - 300);
    assert!(streamer.stop());
    admin.disconnect().await.unwrap();
}

/// The sequence number of a MariaDB GTID `domain-server-seq`.
fn gtid_seq(gtid: &str) -> u64 {
    gtid.rsplit('-').next().and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("GTID {gtid:?}"))
}

/// A WAL-only message Kafka refuses (an unknown topic) halts naming `skip --message` with its
/// outbox-id; a mistyped outbox-id is refused, and the named one clears the halt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_wal_a_message_kafka_refuses_is_skipped_by_its_outbox_id() {
    let w = World::mysql("yq").config(WAL).build().await;
    let table = w.table(0, 0);
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES (?, ?)");
    let mut db = w.admin().await;
    let first = w.start("first.log");
    db.exec_drop(&insert, (format!("{}-missing", w.topic), "refused")).await.unwrap();
    db.exec_drop(&insert, (&w.topic, "after")).await.unwrap();
    let line = first.wait_for_halt(ARRIVAL).await;
    let id = line.split("--message ").nth(1).and_then(|r| r.split('`').next()).unwrap().to_string();
    assert!(line.contains("not --id"), "{line}");
    assert!(first.stop());
    let typo = format!("{}", (id.parse::<i64>().unwrap() >> 24 | 1 << 30) << 24);
    let (ok, out, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--message", &typo]);
    assert!(!ok && err.contains("nothing changed"), "{out}\n{err}");
    let (ok, out, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--message", &id]);
    assert!(ok && out.contains("will not be published"), "{out}\n{err}");
    let second = w.start("second.log");
    assert_eq!(payloads(&kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await), ["after"]);
    assert!(second.stop());
    db.disconnect().await.unwrap();
}
