//! Debezium's documented PostgreSQL table read as it is, by its uuid `id` alone — no column
//! added: CDC only, each row deleted by its uuid once published, the uuid as `outbox-id`. What
//! such a table cannot have (polling, a catch-up, rows written before its slot) is refused by
//! `setup` or halts naming the fix, and the fix works.

use std::collections::BTreeSet;

use crate::debezium::{ARRIVAL, PG_DOCUMENTED, concurrent_writers_and_a_kill, insert, n_of, rows_arrive, with_table};
use crate::polling::POLLING;
use crate::support::database::Database;
use crate::support::kafka;
use crate::support::pg::PgDb;
use crate::support::streamer::run_cli;
use crate::support::world::World;

/// The event router's defaults, the uuid `id` as the row identity (no `id` mapping).
const BY_UUID: &str = r#"layout = "debezium"
[source.columns]
header_columns = { id = "id", type = "type" }"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cdc_reads_a_debezium_table_by_its_uuid_alone() {
    rows_arrive(World::postgres("dzu"), BY_UUID, PG_DOCUMENTED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_concurrent_writers_and_a_kill_lose_no_row_of_a_uuid_table() {
    concurrent_writers_and_a_kill(World::postgres("dzuk"), BY_UUID, PG_DOCUMENTED).await;
}

/// A row that cannot be sent halts naming its uuid and the DELETE that discards it; `skip
/// --id` is refused for such a table, saying so; the DELETE, run as printed, lets the row after
/// it through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_bad_row_of_a_uuid_table_is_named_by_its_uuid_and_the_printed_delete_works() {
    let w = with_table(World::postgres("dzub").source_keys(BY_UUID), PG_DOCUMENTED).build().await;
    let table = format!("{}_0_0", w.prefix);
    let topic = format!("outbox.event.{}", w.prefix);
    kafka::create_topic(&topic, 1).await;
    let first = w.start("first.log");
    let mut conn = w.db.connect().await;
    PgDb::execute(&mut conn, &insert::<PgDb>(&table, &w.prefix, "order-0", 0)).await;
    PgDb::execute(&mut conn, &insert::<PgDb>(&table, &"x".repeat(240), "order-0", 100)).await;
    PgDb::execute(&mut conn, &insert::<PgDb>(&table, &w.prefix, "order-0", 1)).await;
    let bad: String =
        w.db.admin
            .query_one(&format!("SELECT id::text FROM {table} WHERE payload->>'n' = '100'"), &[])
            .await
            .unwrap()
            .get(0);
    let log = first.wait_for_halt(ARRIVAL).await;
    assert!(log.contains(&format!("at row id='{bad}' of {table}")), "the halt names the row by its uuid: {log}");
    let delete = format!("DELETE FROM {table} WHERE id = '{bad}'");
    assert!(log.contains(&delete), "the halt prints the DELETE that discards it: {log}");
    let (ok, out, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--id", "1"]);
    assert!(!ok && err.contains("identified by the uuid id alone"), "skip --id refused:\n{out}\n{err}");
    assert!(first.stop());
    PgDb::execute(&mut conn, &delete).await;
    let second = w.start("second.log");
    let records = kafka::read_at_least(&topic, 1, 2, ARRIVAL).await;
    assert_eq!(records.iter().map(n_of).collect::<Vec<_>>(), [0, 1], "the rows around the deleted one");
    w.wait_drained(&table).await;
    assert!(second.stop());
}

/// `setup` accepts the documented table for CDC, but refuses one that holds rows before its
/// slot exists (the log never carries them; nothing orders them for a catch-up) and polling
/// of such a table — each with the statement that fixes it, which works as printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_setup_refuses_what_a_uuid_table_cannot_do_and_the_fixes_work() {
    let w = with_table(World::postgres("dzus").source_keys(BY_UUID), PG_DOCUMENTED).build().await;
    let held = format!("{}_1_0", w.prefix);
    let mut admin = w.db.connect().await;
    PgDb::execute(&mut admin, &PG_DOCUMENTED.replace("{prefix}_0_0", &held)).await;
    PgDb::execute(&mut admin, &insert::<PgDb>(&held, &w.prefix, "order-0", 0)).await;
    w.edit_config(|c| c.replace("shards = 1", "shards = 2"));
    let (ok, out, err) = run_cli(&w.config, &["setup", "--admin-url", w.db.admin_url()]);
    assert!(!ok, "setup must refuse:\n{out}\n{err}");
    assert!(err.contains(&format!("table {held} holds rows and its replication slot")), "{err}");
    let line = err.lines().find(|l| l.contains("DELETE FROM")).unwrap_or_else(|| panic!("{err}"));
    let delete = line[line.find("DELETE FROM").unwrap()..].split(';').next().unwrap().to_string();
    PgDb::execute(&mut admin, &delete).await;
    let (ok, out, err) = run_cli(&w.config, &["setup", "--admin-url", w.db.admin_url()]);
    assert!(ok, "setup after {delete}:\n{out}\n{err}");

    w.edit_config(|c| c.replace("[source.defaults]\n", &format!("[source.defaults]\n{POLLING}\n")));
    let (ok, out, err) = run_cli(&w.config, &["setup", "--admin-url", w.db.admin_url()]);
    assert!(!ok, "setup must refuse polling:\n{out}\n{err}");
    assert!(err.contains(&format!("{}.id has type uuid", w.prefix)) || err.contains("id has type uuid"), "{err}");
    assert!(err.contains("ADD COLUMN \"seq\" bigint GENERATED ALWAYS AS IDENTITY UNIQUE"), "{err}");
    // Started anyway (setup was not run again), polling halts naming the same fix.
    let streamer = w.start("polling.log");
    let log = streamer.wait_for_halt(ARRIVAL).await;
    assert!(log.contains("cannot poll") && log.contains("ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY"), "{log}");
    assert!(streamer.stop());
}

/// The slot is dropped while the streamer is stopped and rows keep coming: the next run cannot
/// catch up a table nothing orders, so it halts naming the column that would order it. Added
/// as printed (and named in the config), the catch-up sends those rows, and streaming goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_lost_slot_of_a_uuid_table_halts_and_the_printed_fix_sends_every_row() {
    let w = with_table(World::postgres("dzul").source_keys(BY_UUID), PG_DOCUMENTED).build().await;
    let table = format!("{}_0_0", w.prefix);
    let topic = format!("outbox.event.{}", w.prefix);
    kafka::create_topic(&topic, 1).await;
    let mut conn = w.db.connect().await;
    let first = w.start("first.log");
    for n in 0..3 {
        PgDb::execute(&mut conn, &insert::<PgDb>(&table, &w.prefix, "order-0", n)).await;
    }
    kafka::read_at_least(&topic, 1, 3, ARRIVAL).await;
    w.wait_drained(&table).await;
    assert!(first.stop());
    let slot: String = w
        .db
        .admin
        .query_one("SELECT slot_name::text FROM pg_replication_slots WHERE slot_name LIKE $1", &[&format!("%{table}%")])
        .await
        .unwrap()
        .get(0);
    PgDb::execute(&mut conn, &format!("SELECT pg_drop_replication_slot('{slot}')")).await;
    for n in 3..6 {
        PgDb::execute(&mut conn, &insert::<PgDb>(&table, &w.prefix, "order-0", n)).await;
    }
    let second = w.start("second.log");
    let log = second.wait_for_halt(ARRIVAL).await;
    assert!(log.contains("cannot catch up") && log.contains("identified by the uuid id alone"), "{log}");
    let start = log.find("ALTER TABLE").unwrap_or_else(|| panic!("{log}"));
    let alter = log[start..].split(" and set").next().unwrap().trim_end_matches(')').to_string();
    assert!(second.stop());
    PgDb::execute(&mut conn, &alter).await;
    w.edit_config(|c| c.replace("[source.columns]\n", "[source.columns]\nid = \"seq\"\n"));
    let third = w.start("third.log");
    PgDb::execute(&mut conn, &insert::<PgDb>(&table, &w.prefix, "order-0", 6)).await;
    let records = kafka::read_at_least(&topic, 1, 7, ARRIVAL).await;
    let ns: BTreeSet<i64> = records.iter().map(n_of).collect();
    assert_eq!(ns, (0..7).collect(), "the rows of the lost slot's time, then the new one");
    w.wait_drained(&table).await;
    assert!(third.stop());
}

/// Exactly-once from a table read by its uuid: rows keep coming while the streamer is SIGKILLed
/// twice, and a `read_committed` reader sees each row once — the rows a committed Kafka
/// transaction holds are deleted by their uuids in the next process, not sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_exactly_once_from_a_uuid_table_sends_each_row_once_across_kills() {
    let builder = World::postgres("dzue").source_keys(BY_UUID).config(crate::postgres_faults::EXACTLY_ONCE);
    let w = with_table(builder, PG_DOCUMENTED).build().await;
    let table = format!("{}_0_0", w.prefix);
    let topic = format!("outbox.event.{}", w.prefix);
    kafka::create_topic(&topic, 1).await;
    let killed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (mut conn, table, prefix, killed) = (w.db.connect().await, table.clone(), w.prefix.clone(), killed.clone());
        tokio::spawn(async move {
            // A steady load until both kills are done (not a synchronisation).
            let mut pace = tokio::time::interval(std::time::Duration::from_millis(10));
            let mut n = 0;
            while n < 200 || !killed.load(std::sync::atomic::Ordering::SeqCst) {
                pace.tick().await;
                PgDb::execute(&mut conn, "BEGIN").await;
                for _ in 0..3 {
                    PgDb::execute(&mut conn, &insert::<PgDb>(&table, &prefix, &format!("order-{}", n % 4), n)).await;
                    n += 1;
                }
                PgDb::execute(&mut conn, "COMMIT").await;
            }
            n
        })
    };
    let mut streamer = w.start("run-0.log");
    for kill in 1..=2 {
        streamer.wait_for_metric("outbox_published_records_total", &[], 20.0, ARRIVAL).await;
        streamer.kill();
        streamer = w.start(&format!("run-{kill}.log"));
    }
    killed.store(true, std::sync::atomic::Ordering::SeqCst);
    let total = writer.await.unwrap() as usize;
    let records = kafka::read_distinct(&topic, 1, total, ARRIVAL).await;
    let ns: BTreeSet<i64> = records.iter().map(n_of).collect();
    assert_eq!(ns.len(), total, "every row");
    assert_eq!(records.len(), total, "each row once for a read_committed reader");
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}
