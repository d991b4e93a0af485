//! `layout = "debezium"`: a Debezium outbox event router table read as it is — topic
//! `outbox.event.<aggregatetype>`, key `aggregateid`, value `payload`, the event id and type as
//! headers — with rows inserted the way Debezium's documentation shows, in
//! transactions of which some roll back, in CDC and polling mode. The table is the one
//! Debezium documents (a uuid `id` primary key) plus the increasing integer column `seq` that
//! `setup` asks for (`id = "seq"` in the mapping); the inserts do not name it. The same table
//! read by its uuid alone is `debezium_uuid.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::polling::POLLING;
use crate::support::database::Database;
use crate::support::kafka;
use crate::support::streamer::run_cli;
use crate::support::world::{World, WorldBuilder};

pub(crate) const ARRIVAL: Duration = Duration::from_secs(120);
const ROWS: i64 = 60;

const MAPPING: &str = r#"layout = "debezium"
[source.columns]
id = "seq"
header_columns = { id = "id", type = "type" }"#;

/// Debezium's documented table on PostgreSQL, as a literal for `concat!`.
macro_rules! pg_documented_table {
    () => {
        "CREATE TABLE {prefix}_0_0 (
    id uuid NOT NULL PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    payload jsonb);"
    };
}

/// Debezium's documented table as it is (read by its uuid).
pub(crate) const PG_DOCUMENTED: &str = pg_documented_table!();

/// Debezium's documented table, then the column `setup` asks for.
const PG_TABLE: &str = concat!(
    pg_documented_table!(),
    "\n    ALTER TABLE {prefix}_0_0 ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY UNIQUE"
);
/// Debezium's documented table on MariaDB (its uuid in a `CHAR(36)`), as a literal.
macro_rules! my_documented_table {
    () => {
        "CREATE TABLE {prefix}_0_0 (
    id CHAR(36) NOT NULL PRIMARY KEY,
    aggregatetype VARCHAR(255) NOT NULL,
    aggregateid VARCHAR(255) NOT NULL,
    type VARCHAR(255) NOT NULL,
    payload JSON);"
    };
}

/// The same on MariaDB, read by its `CHAR(36)` uuid.
pub(crate) const MY_DOCUMENTED: &str = my_documented_table!();

const MY_TABLE: &str = concat!(
    my_documented_table!(),
    "\n    ALTER TABLE {prefix}_0_0 ADD COLUMN seq BIGINT NOT NULL AUTO_INCREMENT UNIQUE"
);

/// The INSERT of the Debezium documentation (uuid event id, JSON payload `{"n": n}`).
pub(crate) fn insert<D: Database>(table: &str, aggregatetype: &str, aggregateid: &str, n: i64) -> String {
    let (uuid, payload) = if D::KIND == "postgres" {
        ("gen_random_uuid()", format!("jsonb_build_object('n', {n})"))
    } else {
        ("UUID()", format!("JSON_OBJECT('n', {n})"))
    };
    format!(
        "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload) \
         VALUES ({uuid}, '{aggregatetype}', '{aggregateid}', 'OrderCreated', {payload})"
    )
}

/// `builder` creating `create`'s statements (`;`-separated) before setup.
pub(crate) fn with_table<D: Database>(builder: WorldBuilder<D>, create: &str) -> WorldBuilder<D> {
    create.split(';').map(str::trim).filter(|s| !s.is_empty()).fold(builder, |b, sql| b.before_setup(sql))
}

/// The `n` of a record's JSON payload `{"n": n}`.
pub(crate) fn n_of(r: &kafka::Record) -> i64 {
    let value = r.payload_str();
    value
        .split("\"n\":")
        .nth(1)
        .and_then(|rest| rest.trim().trim_end_matches('}').trim().parse().ok())
        .unwrap_or_else(|| panic!("the payload is the row's JSON: {value}"))
}

async fn debezium_rows_arrive<D: Database>(builder: WorldBuilder<D>, create: &str) {
    rows_arrive(builder, MAPPING, create).await;
}

pub(crate) async fn rows_arrive<D: Database>(builder: WorldBuilder<D>, mapping: &str, create: &str) {
    let w = with_table(builder.source_keys(mapping), create).build().await;
    let named = create.split_whitespace().nth(2).expect("CREATE TABLE <name>").to_string();
    let table = named.replace("{prefix}", &w.prefix);
    let topic = format!("outbox.event.{}", w.topic);
    kafka::create_topic(&topic, 1).await;
    let streamer = w.start("streamer.log");
    let mut conn = w.db.connect().await;
    let mut want = BTreeSet::new();
    for n in 0..ROWS {
        // Transactions of three rows; every fourth rolls back.
        if n % 3 == 0 {
            D::execute(&mut conn, "BEGIN").await;
        }
        D::execute(&mut conn, &insert::<D>(&table, &w.topic, &format!("order-{}", n % 5), n)).await;
        if n % 3 == 2 {
            let rolled_back = (n / 3) % 4 == 3;
            D::execute(&mut conn, if rolled_back { "ROLLBACK" } else { "COMMIT" }).await;
            if !rolled_back {
                want.extend(n - 2..=n);
            }
        }
    }
    let records = kafka::read_at_least(&topic, 1, want.len(), ARRIVAL).await;
    let mut seen = BTreeSet::new();
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in &records {
        let n = n_of(r);
        assert!(seen.insert(n), "row {n} arrived twice");
        assert_eq!(r.key_str(), format!("order-{}", n % 5), "key of {n}");
        assert_eq!(r.header("type"), "OrderCreated");
        assert_eq!(r.header("id").len(), 36, "the event id, a uuid: {:?}", r.headers);
        per_key.entry(r.key_str()).or_default().push(n);
    }
    assert_eq!(seen, want, "the committed rows, none rolled back");
    for (key, ns) in per_key {
        assert!(ns.windows(2).all(|p| p[0] < p[1]), "{key}: out of commit order: {ns:?}");
    }
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cdc_reads_a_debezium_outbox_table() {
    debezium_rows_arrive(World::postgres("dzp"), PG_TABLE).await;
}

/// `table` names the application's own table (here `<prefix>_outbox`) instead of
/// `<prefix>_0_0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_cdc_reads_a_debezium_table_by_its_own_name() {
    let builder = World::mysql("dzmt").source_keys("table = \"{prefix}_outbox\"");
    debezium_rows_arrive(builder, &MY_TABLE.replace("{prefix}_0_0", "{prefix}_outbox")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_polling_reads_a_debezium_outbox_table() {
    debezium_rows_arrive(World::postgres("dzpp").config(POLLING), PG_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_cdc_reads_a_debezium_outbox_table() {
    debezium_rows_arrive(World::mysql("dzm"), MY_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_polling_reads_a_debezium_outbox_table() {
    debezium_rows_arrive(World::mysql("dzmp").config(POLLING), MY_TABLE).await;
}

/// Two writers, each with its own keys, commit (and roll back) concurrently while the streamer
/// is SIGKILLed and started again: every committed row arrives (copies of the at-least-once
/// window allowed), none rolled back, and per key the first deliveries keep commit order.
pub(crate) async fn concurrent_writers_and_a_kill<D: Database>(builder: WorldBuilder<D>, mapping: &str, create: &str) {
    let w = with_table(builder.source_keys(mapping), create).build().await;
    let table = format!("{}_0_0", w.prefix);
    let topic = format!("outbox.event.{}", w.topic);
    kafka::create_topic(&topic, 1).await;
    let first = w.start("first.log");
    const PER_WRITER: i64 = 300;
    let mut writers = Vec::new();
    for writer in 0..2i64 {
        let (mut conn, table, aggregate) = (w.db.connect().await, table.clone(), w.topic.clone());
        writers.push(tokio::spawn(async move {
            let mut committed = Vec::new();
            for t in 0..PER_WRITER / 3 {
                D::execute(&mut conn, "BEGIN").await;
                let ns: Vec<i64> = (0..3).map(|i| writer * 100_000 + t * 3 + i).collect();
                for n in &ns {
                    D::execute(&mut conn, &insert::<D>(&table, &aggregate, &format!("w{writer}-{}", n % 4), *n)).await;
                }
                let rolled_back = t % 5 == 4;
                D::execute(&mut conn, if rolled_back { "ROLLBACK" } else { "COMMIT" }).await;
                if !rolled_back {
                    committed.extend(ns);
                }
            }
            committed
        }));
    }
    kafka::read_at_least(&topic, 1, 20, ARRIVAL).await;
    first.kill();
    let mut want = BTreeSet::new();
    for writer in writers {
        want.extend(writer.await.expect("writer"));
    }
    let second = w.start("second.log");
    let records = kafka::read_distinct(&topic, 1, want.len(), ARRIVAL).await;
    let mut firsts = BTreeSet::new();
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let by_uuid = !mapping.contains("id = \"seq\"");
    for r in &records {
        if by_uuid {
            assert_eq!(r.header("outbox-id"), r.header("id"), "a table read by its uuid: the uuid is the outbox-id");
        }
        if firsts.insert(r.header("outbox-id").to_string()) {
            per_key.entry(r.key_str()).or_default().push(n_of(r));
        }
    }
    let seen: BTreeSet<i64> = per_key.values().flatten().copied().collect();
    assert_eq!(seen, want, "every committed row, none rolled back");
    for (key, ns) in per_key {
        assert!(ns.windows(2).all(|p| p[0] < p[1]), "{key}: first deliveries out of commit order: {ns:?}");
    }
    w.wait_drained(&table).await;
    assert!(second.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_concurrent_writers_and_a_kill_lose_no_debezium_row() {
    concurrent_writers_and_a_kill(World::postgres("dzpk"), MAPPING, PG_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_concurrent_writers_and_a_kill_lose_no_debezium_row() {
    concurrent_writers_and_a_kill(World::mysql("dzmk"), MAPPING, MY_TABLE).await;
}

/// `setup` checks a table it does not own: one as Debezium documents it (uuid `id`, no `seq`),
/// one whose `seq` has no unique index and one whose `seq` the application picks are each
/// named with the statements that fix it, and nothing is created; run as printed, those
/// statements let setup complete, and every table's rows arrive.
async fn setup_names_what_a_debezium_table_lacks<D: Database>(builder: WorldBuilder<D>, create: &str) {
    let w = with_table(builder.source_keys(MAPPING), create).build().await;
    let tables = [1, 2, 3].map(|shard| format!("{}_{shard}_0", w.prefix));
    let [bare, loose, chosen] = &tables;
    let mut admin = w.db.connect().await;
    let documented = create.split(';').next().expect("the CREATE TABLE");
    for table in &tables {
        D::execute(&mut admin, &documented.replace("{prefix}_0_0", table)).await;
    }
    let (no_unique, not_numbered) = if D::KIND == "postgres" {
        ("ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY", "ADD COLUMN seq bigint NOT NULL DEFAULT 0 UNIQUE")
    } else {
        (
            "ADD COLUMN seq BIGINT NOT NULL AUTO_INCREMENT, ADD KEY (seq)",
            "ADD COLUMN seq BIGINT NOT NULL DEFAULT 0 UNIQUE",
        )
    };
    D::execute(&mut admin, &format!("ALTER TABLE {loose} {no_unique}")).await;
    D::execute(&mut admin, &format!("ALTER TABLE {chosen} {not_numbered}")).await;
    w.edit_config(|c| c.replace("shards = 1", "shards = 4"));
    let (ok, out, err) = run_cli(&w.config, &["setup", "--admin-url", w.db.admin_url()]);
    assert!(!ok, "setup must refuse:\n{out}\n{err}");
    assert!(err.contains(&format!("table {bare} has no column seq")), "{err}");
    assert!(err.contains(&format!("column {loose}.seq, which identifies rows, has no unique index")), "{err}");
    assert!(err.contains(&format!("column {chosen}.seq, which orders rows, is not numbered by the database")), "{err}");
    // Each fix runs from its first statement to the end of its line.
    let fix = |start: &str, table: &String| {
        let line = err.lines().find(|l| l.contains(table) && l.contains(start)).unwrap_or_else(|| panic!("{err}"));
        line[line.find(start).unwrap()..].to_string()
    };
    let fixes = [fix("ALTER TABLE", bare), fix("CREATE UNIQUE INDEX", loose), fix("ALTER TABLE", chosen)];
    for statements in &fixes {
        D::execute(&mut admin, statements).await;
    }
    let (ok, out, err) = run_cli(&w.config, &["setup", "--admin-url", w.db.admin_url()]);
    assert!(ok, "setup after {fixes:?}:\n{out}\n{err}");
    let topic = format!("outbox.event.{}", w.topic);
    kafka::create_topic(&topic, 1).await;
    let streamer = w.start("streamer.log");
    for (n, table) in tables.iter().enumerate() {
        D::execute(&mut admin, &insert::<D>(table, &w.topic, "order-1", n as i64)).await;
    }
    let records = kafka::read_at_least(&topic, 1, 3, ARRIVAL).await;
    let ns: BTreeSet<i64> = records.iter().map(n_of).collect();
    assert_eq!(ns, BTreeSet::from([0, 1, 2]), "a row of each fixed table");
    for table in &tables {
        w.wait_drained(table).await;
    }
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_setup_names_what_a_debezium_table_lacks_and_the_fix_works() {
    setup_names_what_a_debezium_table_lacks(World::postgres("dzps"), PG_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_setup_names_what_a_debezium_table_lacks_and_the_fix_works() {
    setup_names_what_a_debezium_table_lacks(World::mysql("dzms"), MY_TABLE).await;
}

/// Rows left in the table before `setup` (a switch from Debezium) are caught up in `seq` order;
/// a row that cannot be sent (its topic would pass Kafka's 249 characters) halts naming its
/// `seq` and `outbox-streamer skip --id`, which, run as printed, discards it: the row after it
/// follows.
async fn a_backlog_then_a_bad_row_skipped_as_printed<D: Database>(builder: WorldBuilder<D>, create: &str) {
    let backlog = (0..10).map(|n| insert::<D>("{prefix}_0_0", "{prefix}", &format!("order-{}", n % 3), n));
    let w = backlog.fold(with_table(builder.source_keys(MAPPING), create), |b, sql| b.before_setup(&sql)).build().await;
    let table = format!("{}_0_0", w.prefix);
    let topic = format!("outbox.event.{}", w.prefix);
    kafka::create_topic(&topic, 1).await;
    let first = w.start("first.log");
    let records = kafka::read_at_least(&topic, 1, 10, ARRIVAL).await;
    assert_eq!(records.iter().map(n_of).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>(), "the backlog in seq order");
    let mut conn = w.db.connect().await;
    D::execute(&mut conn, &insert::<D>(&table, &"x".repeat(240), "order-0", 100)).await;
    D::execute(&mut conn, &insert::<D>(&table, &w.prefix, "order-0", 10)).await;
    let log = first.wait_for_halt(ARRIVAL).await;
    let quoted = if D::KIND == "postgres" {
        format!("\"{table}\" SET … WHERE \"seq\" = ")
    } else {
        format!("`{table}` SET … WHERE `seq` = ")
    };
    assert!(log.contains(&format!("UPDATE {quoted}")), "the halt names the row by seq: {log}");
    let command = log.split("`outbox-streamer ").nth(1).and_then(|c| c.split('`').next()).expect("a skip command");
    let args: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(args[..2], ["skip", "--stream"], "{log}");
    let (ok, out, err) = run_cli(&w.config, &args);
    assert!(ok && out.contains("deleted from the table"), "{command}:\n{out}\n{err}");
    assert!(first.stop());
    let second = w.start("second.log");
    let records = kafka::read_at_least(&topic, 1, 11, ARRIVAL).await;
    assert_eq!(n_of(&records[10]), 10, "the row after the skipped one");
    w.wait_drained(&table).await;
    assert!(second.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_debezium_backlog_then_a_bad_row_skipped_as_printed() {
    a_backlog_then_a_bad_row_skipped_as_printed(World::postgres("dzpb"), PG_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_debezium_backlog_then_a_bad_row_skipped_as_printed() {
    a_backlog_then_a_bad_row_skipped_as_printed(World::mysql("dzmb"), MY_TABLE).await;
}

/// The sweep finds rows the log never carried by `seq` (PostgreSQL: written while the table was
/// out of the publication; MariaDB: a session with `sql_log_bin = 0`) and sends them.
async fn rows_outside_the_log_are_swept<D: Database>(builder: WorldBuilder<D>, create: &str) {
    let w = with_table(builder.source_keys(MAPPING).config("sweep_interval_ms = 300"), create).build().await;
    let table = format!("{}_0_0", w.prefix);
    let topic = format!("outbox.event.{}", w.topic);
    kafka::create_topic(&topic, 1).await;
    let streamer = w.start("streamer.log");
    let mut conn = w.db.connect().await;
    D::execute(&mut conn, &insert::<D>(&table, &w.topic, "order-1", 0)).await;
    kafka::read_at_least(&topic, 1, 1, ARRIVAL).await;
    if D::KIND == "postgres" {
        D::execute(&mut conn, &format!("ALTER PUBLICATION {table} DROP TABLE {table}")).await;
        D::execute(&mut conn, &insert::<D>(&table, &w.topic, "order-1", 1)).await;
        D::execute(&mut conn, &format!("ALTER PUBLICATION {table} ADD TABLE {table}")).await;
    } else {
        let mut unlogged = w.db.connect().await;
        D::execute(&mut unlogged, "SET SESSION sql_log_bin = 0").await;
        D::execute(&mut unlogged, &insert::<D>(&table, &w.topic, "order-1", 1)).await;
    }
    D::execute(&mut conn, &insert::<D>(&table, &w.topic, "order-1", 2)).await;
    let records = kafka::read_distinct(&topic, 1, 3, ARRIVAL).await;
    assert_eq!(records.iter().map(n_of).collect::<BTreeSet<_>>(), BTreeSet::from([0, 1, 2]));
    w.wait_drained(&table).await;
    let log = streamer.log_text();
    assert!(log.contains("rows stayed in the table"), "{log}");
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_debezium_rows_the_slot_never_carried_are_swept() {
    rows_outside_the_log_are_swept(World::postgres("dzpw"), PG_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_debezium_rows_the_binlog_never_carried_are_swept() {
    rows_outside_the_log_are_swept(World::mysql("dzmw"), MY_TABLE).await;
}

/// Applications written for Debezium may delete their outbox row in the transaction that
/// inserted it (the log carries it anyway): CDC still sends each such row, once, in commit order
/// with the rows kept.
async fn rows_deleted_in_their_own_transaction_are_sent<D: Database>(builder: WorldBuilder<D>, create: &str) {
    let w = with_table(builder.source_keys(MAPPING), create).build().await;
    let table = format!("{}_0_0", w.prefix);
    let topic = format!("outbox.event.{}", w.topic);
    kafka::create_topic(&topic, 1).await;
    let streamer = w.start("streamer.log");
    let mut conn = w.db.connect().await;
    for n in 0..6 {
        D::execute(&mut conn, "BEGIN").await;
        D::execute(&mut conn, &insert::<D>(&table, &w.topic, "order-1", n)).await;
        if n % 2 == 0 {
            D::execute(&mut conn, &format!("DELETE FROM {table} WHERE aggregateid = 'order-1'")).await;
        }
        D::execute(&mut conn, "COMMIT").await;
    }
    let records = kafka::read_at_least(&topic, 1, 6, ARRIVAL).await;
    assert_eq!(records.iter().map(n_of).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>(), "each once, in order");
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_debezium_rows_deleted_in_their_own_transaction_are_sent() {
    rows_deleted_in_their_own_transaction_are_sent(World::postgres("dzpd"), PG_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_debezium_rows_deleted_in_their_own_transaction_are_sent() {
    rows_deleted_in_their_own_transaction_are_sent(World::mysql("dzmd"), MY_TABLE).await;
}

/// An identity column of type `integer` whose name needs quoting (`"Seq"`): every statement
/// binds ids as int8 and quotes the name, in CDC and polling.
const PG_INT4_TABLE: &str = concat!(
    pg_documented_table!(),
    "\n    ALTER TABLE {prefix}_0_0 ADD COLUMN \"Seq\" integer GENERATED ALWAYS AS IDENTITY UNIQUE"
);

const INT4_MAPPING: &str = r#"layout = "debezium"
[source.columns]
id = "Seq"
header_columns = { id = "id", type = "type" }"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cdc_reads_a_debezium_table_with_an_integer_mixed_case_identity() {
    rows_arrive(World::postgres("dzpi"), INT4_MAPPING, PG_INT4_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_polling_reads_a_debezium_table_with_an_integer_mixed_case_identity() {
    rows_arrive(World::postgres("dzpip").config(POLLING), INT4_MAPPING, PG_INT4_TABLE).await;
}
