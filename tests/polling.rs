//! Polling mode, mode switches and catch-ups on PostgreSQL: real PostgreSQL, real Kafka, the
//! real binary, the least-privilege role.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio_postgres::types::ToSql;

use crate::support::pg::PgDb;
use crate::support::streamer::{pg_config, run_cli};
use crate::support::world::World;
use crate::support::{kafka, pg, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);
pub(crate) const POLLING: &str = "mode = \"polling\"";

async fn insert(w: &World<PgDb>, payloads: impl IntoIterator<Item = String>) {
    let sql = format!("INSERT INTO {} (topic, msg_key, payload) VALUES ($1, $2, $3)", w.table(0, 0));
    for p in payloads {
        w.db.admin.execute(&sql, &[&w.topic as &(dyn ToSql + Sync), &b"k".as_slice(), &p.as_bytes()]).await.unwrap();
    }
}

fn payloads(range: std::ops::Range<usize>) -> impl Iterator<Item = String> {
    range.map(|i| format!("p{i}"))
}

fn set_mode(w: &World<PgDb>, extra: &str) {
    pg_config(&w.dir, &w.db.streamer_url, &w.prefix, 1, 1, extra);
}

/// A row inserted by a transaction that stays open while 50 later rows commit and are
/// published: when it commits, polling still finds it (there is no id cursor to skip it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_publishes_a_row_whose_transaction_commits_late() {
    let w = World::postgres("pl").config(POLLING).build().await;
    let streamer = w.start("streamer.log");
    let mut slow = pg::connect(&w.db.admin_url).await;
    let tx = slow.transaction().await.unwrap();
    tx.execute(&format!("INSERT INTO {} (topic, payload) VALUES ($1, 'late')", w.table(0, 0)), &[&w.topic])
        .await
        .unwrap();
    insert(&w, payloads(0..50)).await;
    let early = kafka::read_at_least(&w.topic, 1, 50, ARRIVAL).await;
    assert!(early.iter().all(|r| r.payload_str() != "late"));
    assert!(!early[0].header("outbox-poll-batch").is_empty(), "polled records carry their batch");
    tx.commit().await.unwrap();
    let all = kafka::read_at_least(&w.topic, 1, 51, ARRIVAL).await;
    assert_eq!(all.len(), 51, "every row once");
    assert_eq!(all[50].payload_str(), "late", "the late row, after the rows that committed before it");
    w.wait_drained(&w.table(0, 0)).await;
    assert!(streamer.stop());
}

/// cdc → polling → cdc by config and restart, rows inserted while stopped each time: every
/// row arrives once; the return to cdc catches up first and `status` reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_between_cdc_and_polling_is_safe_both_ways() {
    let w = World::postgres("ps").build().await;
    insert(&w, payloads(0..10)).await;
    let cdc = w.start("cdc-1.log");
    kafka::read_at_least(&w.topic, 1, 10, ARRIVAL).await;
    assert!(cdc.stop());

    insert(&w, payloads(10..20)).await;
    set_mode(&w, POLLING);
    let polling = w.start("polling.log");
    kafka::read_at_least(&w.topic, 1, 20, ARRIVAL).await;
    w.wait_drained(&w.table(0, 0)).await;
    assert!(polling.stop());

    insert(&w, payloads(20..30)).await;
    set_mode(&w, "");
    let cdc = w.start("cdc-2.log");
    let log = cdc.wait_for_log("catch-up done", ARRIVAL).await;
    assert!(log.contains("rows=10"), "the catch-up sent the 10 rows left by polling:\n{log}");
    kafka::read_at_least(&w.topic, 1, 30, ARRIVAL).await;
    insert(&w, payloads(30..40)).await;
    let records = kafka::read_at_least(&w.topic, 1, 40, ARRIVAL).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(got, payloads(0..40).collect::<Vec<_>>(), "every row once, in order");
    assert!(records[35].header("outbox-lsn").contains('/'), "streaming again after the catch-up");

    let (ok, out, err) = run_cli(&w.config, &["status"]);
    assert!(ok, "status is healthy after the catch-up:\n{out}\n{err}");
    assert!(out.contains("(10 rows)"), "status names the last catch-up:\n{out}");
    assert!(cdc.stop());

    // As a monitoring probe: rows waiting beyond a threshold make status exit 1.
    insert(&w, payloads(40..43)).await;
    let (ok, out, _) = run_cli(&w.config, &["status", "--max-pending-rows", "2"]);
    assert!(!ok && out.contains("LAGGING"), "3 rows waiting exceed 2:\n{out}");
    let (ok, out, _) = run_cli(&w.config, &["status", "--max-pending-rows", "3", "--max-lag-bytes", "100000000"]);
    assert!(ok, "3 rows waiting do not exceed 3:\n{out}");
}

/// The slot dropped while the streamer is stopped: the next start creates a new slot first,
/// sends the rows still in the table by polling, then streams from the new slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_slot_is_caught_up_by_polling() {
    let w = World::postgres("pd").build().await;
    let first = w.start("first.log");
    insert(&w, payloads(0..5)).await;
    kafka::read_at_least(&w.topic, 1, 5, ARRIVAL).await;
    assert!(first.stop());
    insert(&w, payloads(5..25)).await;
    w.db.admin.execute("SELECT pg_drop_replication_slot($1)", &[&w.table(0, 0)]).await.unwrap();

    let second = w.start("second.log");
    let log = second.wait_for_log("catch-up done", ARRIVAL).await;
    assert!(log.contains("WARN") && log.contains("does not exist"), "{log}");
    insert(&w, payloads(25..30)).await;
    let records = kafka::read_at_least(&w.topic, 1, 30, ARRIVAL).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(got, payloads(0..30).collect::<Vec<_>>(), "no row lost, none twice");
    assert!(records[27].header("outbox-lsn").contains('/'), "the new slot streams");
    assert!(second.stop());
}

/// A transaction that commits after the catch-up's new position but before its drain reads
/// (while the catch-up waits for an earlier writer of the table): the drain sends it and the
/// stream, which starts at that position, skips it — sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_committing_while_the_catch_up_waits_is_sent_once() {
    let w = World::postgres("pw").build().await;
    let table = w.table(0, 0);
    let first = w.start("first.log");
    insert(&w, payloads(0..1)).await;
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert!(first.stop());
    insert(&w, payloads(1..200)).await;
    w.db.admin.execute("SELECT pg_drop_replication_slot($1)", &[&table]).await.unwrap();
    // A writer of the table without a transaction id: the catch-up waits for it, the new
    // slot does not.
    let writer = pg::connect(&w.db.admin_url).await;
    writer.batch_execute(&format!("BEGIN; LOCK TABLE {table} IN ROW EXCLUSIVE MODE")).await.unwrap();
    let second = w.start("second.log");
    // The catch-up took its position and checks whether the writer has ended (its last query,
    // as pg_stat_activity shows it).
    wait_until("the catch-up to wait for the writer", ARRIVAL, || async {
        let sql = "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() \
                   AND pid <> pg_backend_pid() AND query LIKE '%virtualtransaction = ANY%' LIMIT 1";
        w.db.admin.query_opt(sql, &[]).await.ok()?.map(|_| ())
    })
    .await;
    // Commits after the new position, before the drain's snapshot.
    let sql = format!("INSERT INTO {table} (topic, msg_key, payload) VALUES ($1, 'k', 'late')");
    w.db.admin.execute(&sql, &[&w.topic]).await.unwrap();
    writer.batch_execute("COMMIT").await.unwrap();
    second.wait_for_log("catch-up done", ARRIVAL).await;
    insert(&w, payloads(200..201)).await;
    let records = kafka::read_at_least(&w.topic, 1, 202, ARRIVAL).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    let mut want: Vec<String> = payloads(0..200).collect();
    want.extend(["late".to_string(), "p200".to_string()]);
    assert!(got == want, "no row twice (the drain sends the late row, the stream skips it): {:?}", &got[195..]);
    assert!(second.stop());
}

/// Restores `max_slot_wal_keep_size` even if the test fails half-way.
struct KeepSizeReset(String);

impl Drop for KeepSizeReset {
    fn drop(&mut self) {
        let url = self.0.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let c = pg::connect(&url).await;
                let _ = c.batch_execute("ALTER SYSTEM RESET max_slot_wal_keep_size").await;
                let _ = c.batch_execute("SELECT pg_reload_conf()").await;
            });
        })
        .join();
    }
}

/// The slot invalidated by `max_slot_wal_keep_size` while the streamer is stopped: the start
/// replaces it and catches up. Changes a server setting, so it runs alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidated_slot_is_caught_up_by_polling() {
    let w = World::postgres("pi").exclusive().build().await;
    let slot = w.table(0, 0);
    let first = w.start("first.log");
    insert(&w, payloads(0..3)).await;
    kafka::read_at_least(&w.topic, 1, 3, ARRIVAL).await;
    assert!(first.stop());
    insert(&w, payloads(3..23)).await;

    let reset = KeepSizeReset(w.db.admin_url.clone());
    w.db.admin.batch_execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'").await.unwrap();
    w.db.admin.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    w.db.admin.batch_execute("CREATE TABLE filler (x text)").await.unwrap();
    wait_until("the slot to be invalidated", ARRIVAL, || async {
        w.db.admin
            .batch_execute("INSERT INTO filler SELECT repeat('x', 500) FROM generate_series(1, 20000)")
            .await
            .unwrap();
        w.db.admin.batch_execute("SELECT pg_switch_wal()").await.unwrap();
        w.db.admin.batch_execute("CHECKPOINT").await.unwrap();
        let sql = "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1";
        let status: Option<String> = w.db.admin.query_one(sql, &[&slot]).await.unwrap().get(0);
        (status.as_deref() == Some("lost")).then_some(())
    })
    .await;
    drop(reset);

    let second = w.start("second.log");
    let log = second.wait_for_log("catch-up done", ARRIVAL).await;
    assert!(log.contains("invalidated"), "{log}");
    insert(&w, payloads(23..25)).await;
    let records = kafka::read_at_least(&w.topic, 1, 25, ARRIVAL).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(got, payloads(0..25).collect::<Vec<_>>(), "no row lost, none twice");
    assert!(second.stop());
}

/// Polling while the streamer is killed with SIGKILL twice under a steady flow: no row lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn polling_survives_sigkill_without_loss() {
    const TXNS: usize = 60;
    const ROWS: usize = 50;
    let w = World::postgres("pk").kafka_partitions(3).config(POLLING).build().await;
    let written = Arc::new(AtomicUsize::new(0));
    let writer = {
        let (url, table, topic, written) = (w.db.admin_url.clone(), w.table(0, 0), w.topic.clone(), written.clone());
        tokio::spawn(async move {
            let mut client = pg::connect(&url).await;
            let mut pace = tokio::time::interval(Duration::from_millis(50));
            for t in 0..TXNS {
                pace.tick().await;
                let tx = client.transaction().await.unwrap();
                let sql = format!(
                    "INSERT INTO {table} (topic, msg_key, payload)
                     SELECT $1, ('k' || (g % 10))::bytea, convert_to($2 || g, 'UTF8') FROM generate_series(1, {ROWS}) g"
                );
                tx.execute(&sql, &[&topic, &format!("t{t}-")]).await.unwrap();
                tx.commit().await.unwrap();
                written.fetch_add(ROWS, Ordering::SeqCst);
            }
        })
    };
    let mut streamer = Some(w.start("run-0.log"));
    for kill in 1..=2 {
        let target = kill * TXNS * ROWS / 3;
        wait_until("the writer to get ahead", ARRIVAL, || async {
            (written.load(Ordering::SeqCst) >= target).then_some(())
        })
        .await;
        streamer.take().unwrap().kill();
        streamer = Some(w.start(&format!("run-{kill}.log")));
    }
    writer.await.unwrap();
    let total = TXNS * ROWS;
    let (records, distinct) = kafka::count_distinct_ids(&w.topic, 3, total, ARRIVAL).await;
    assert_eq!(distinct, total, "no row lost across two SIGKILLs");
    eprintln!("polling sigkill: {total} rows, {records} records ({} duplicates)", records - total);
    w.wait_drained(&w.table(0, 0)).await;
    assert!(streamer.unwrap().stop());
}

/// The oldest-rows query plans as a primary-key index scan even when the table's statistics
/// were taken while it was empty and 100,000 rows have arrived since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oldest_rows_query_stays_an_index_scan_with_stale_statistics() {
    use outbox_streamer::poll::postgres::{PLANNER_SETTINGS, oldest_sql};
    let w = World::postgres("pp").config(POLLING).build().await;
    let table = w.table(0, 0);
    w.db.admin.batch_execute(&format!("ANALYZE {table}")).await.unwrap();
    w.db.admin
        .execute(
            &format!("INSERT INTO {table} (topic, payload) SELECT $1, 'x' FROM generate_series(1, 100000)"),
            &[&w.topic],
        )
        .await
        .unwrap();
    let streamer = pg::connect(&w.db.streamer_url).await;
    streamer.batch_execute(PLANNER_SETTINGS).await.unwrap();
    let query = oldest_sql(&table).replace("$1", "0").replace("$2", "9223372036854775807").replace("$3", "1024");
    let plan: Vec<String> =
        streamer.query(&format!("EXPLAIN {query}"), &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    let plan = plan.join("\n");
    assert!(plan.contains(&format!("Index Scan using {table}_pkey")), "{plan}");
    assert!(!plan.contains("Seq Scan") && !plan.contains("Sort"), "{plan}");
}

/// Rows whose ids land below the polling low-water mark without ever being seen as a writer —
/// an explicit id, an identity restarted lower — are published by the periodic rescan from the
/// lowest id and counted. Before, they stayed in the table until a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_publishes_rows_whose_ids_land_below_the_low_water_mark() {
    let w = World::postgres("pbm").config(POLLING).build().await;
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    insert(&w, payloads(0..20)).await;
    kafka::read_at_least(&w.topic, 1, 20, ARRIVAL).await;
    w.wait_drained(&table).await;
    // A few more rescans move the mark above id 20.
    insert(&w, payloads(20..25)).await;
    kafka::read_at_least(&w.topic, 1, 25, ARRIVAL).await;
    w.wait_drained(&table).await;
    w.db.admin
        .execute(
            &format!("INSERT INTO {table} (id, topic, payload) OVERRIDING SYSTEM VALUE VALUES (3, $1, 'explicit')"),
            &[&w.topic],
        )
        .await
        .unwrap();
    w.db.admin.batch_execute(&format!("ALTER TABLE {table} ALTER COLUMN id RESTART WITH 5")).await.unwrap();
    insert(&w, ["restarted".to_string()]).await;
    let records = kafka::read_at_least(&w.topic, 1, 27, ARRIVAL).await;
    let mut got: Vec<String> = records[25..].iter().map(|r| r.payload_str()).collect();
    got.sort();
    assert_eq!(got, ["explicit", "restarted"]);
    w.wait_drained(&table).await;
    let log = streamer.log_text();
    assert!(log.contains("rows appeared below the polling low-water mark"), "{log}");
    assert!(streamer.stop());
}

/// PostgreSQL polling has a database fence like MariaDB's checkpoint: once a newer owner
/// epoch is stored for the stream, an older owner's next delete is refused and it stops —
/// here without coordination, so it halts and says how to reset the epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_stops_at_a_newer_owner_epoch() {
    let w = World::postgres("pfe").config(POLLING).build().await;
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    insert(&w, payloads(0..5)).await;
    kafka::read_at_least(&w.topic, 1, 5, ARRIVAL).await;
    w.wait_drained(&table).await;
    w.db.admin
        .execute(&format!("UPDATE {}_checkpoint SET owner_epoch = 5 WHERE stream = $1", w.prefix), &[&table])
        .await
        .unwrap();
    insert(&w, payloads(5..6)).await;
    let log = streamer.wait_for_halt(ARRIVAL).await;
    assert!(log.contains("newer owner epoch") && log.contains("SET owner_epoch = 0"), "{log}");
    assert_eq!(w.db.count(&table).await, 1, "the fenced delete left the row");
    assert!(streamer.stop());
}
