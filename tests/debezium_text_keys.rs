//! MariaDB tables read by a text key (`CHAR(36)` uuids, any `VARCHAR`): XA transactions, keys
//! that need escaping, and key types that are neither text nor integer. Each test began as a
//! review's reproduction of a bug, since fixed.

use mysql_async::prelude::Queryable;

use crate::debezium::{ARRIVAL, MY_DOCUMENTED, insert, n_of, with_table};
use crate::support::database::Database;
use crate::support::kafka;
use crate::support::mysql::MyDb as D;
use crate::support::streamer::run_cli;
use crate::support::world::World;

const BY_UUID: &str = r#"layout = "debezium"
[source.columns]
header_columns = { id = "id", type = "type" }"#;

/// A MariaDB world whose table, created by `create`, is read by its text key: the world, the
/// table and its topic (created).
async fn keyed_world(name: &str, create: &str) -> (World<D>, String, String) {
    let w = with_table(World::mysql(name).source_keys(BY_UUID), create).build().await;
    let (table, topic) = (format!("{}_0_0", w.prefix), format!("outbox.event.{}", w.prefix));
    kafka::create_topic(&topic, 1).await;
    (w, table, topic)
}

/// `insert` with a fixed key instead of UUID().
fn insert_key(table: &str, key: &str, aggregatetype: &str, n: i64) -> String {
    insert::<D>(table, aggregatetype, "order-0", n).replace("UUID()", &format!("'{key}'"))
}

async fn xa_prepare(conn: &mut mysql_async::Conn, xid: &str, sql: &str) {
    conn.query_drop(format!("XA START '{xid}'")).await.unwrap();
    conn.query_drop(sql).await.unwrap();
    conn.query_drop(format!("XA END '{xid}'")).await.unwrap();
    conn.query_drop(format!("XA PREPARE '{xid}'")).await.unwrap();
}

/// An XA transaction inserts a keyed row and prepares; an ordinary transaction commits after
/// it and is published and deleted; then XA COMMIT. The XA row is published at its commit with
/// its uuid as outbox-id, and deleted: its key is pinned while it is held (before, the ordinary
/// transaction's finish forgot it, and the row went out as a number and stayed in the table).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_keyed_xa_row_committed_after_a_later_transaction_is_deleted() {
    let (w, table, topic) = keyed_world("rkxa", MY_DOCUMENTED).await;
    let mut conn = w.admin().await;
    let mut xa = w.admin().await;
    let streamer = w.start("s.log");
    D::execute(&mut conn, &insert::<D>(&table, &w.prefix, "order-0", 0)).await;
    let xa_key = "aaaaaaaa-0000-4000-8000-000000000001";
    xa_prepare(&mut xa, "kx", &insert_key(&table, xa_key, &w.prefix, 1)).await;
    D::execute(&mut conn, &insert::<D>(&table, &w.prefix, "order-0", 2)).await;
    let records = kafka::read_at_least(&topic, 1, 2, ARRIVAL).await;
    assert_eq!(records.iter().map(n_of).collect::<Vec<_>>(), [0, 2]);
    w.wait_drained(&table).await; // the prepared row is not visible to COUNT(*)
    xa.query_drop("XA COMMIT 'kx'").await.unwrap();
    let last = "bbbbbbbb-0000-4000-8000-000000000003";
    D::execute(&mut conn, &insert_key(&table, last, &w.prefix, 3)).await;
    let records = kafka::read_at_least(&topic, 1, 4, ARRIVAL).await;
    assert_eq!(records.iter().map(n_of).collect::<Vec<_>>(), [0, 2, 1, 3], "the XA row at its commit");
    let xa_id = records[2].header("outbox-id").to_string();
    // Finishes cover prefixes in order: once row 3 is deleted, the XA row's delete committed too.
    let gone = format!("SELECT COUNT(*) FROM {table} WHERE id = '{last}'");
    crate::support::wait_until("row 3 deleted", ARRIVAL, || {
        let (db, gone) = (&w.db, gone.clone());
        async move {
            let mut c = db.connect().await;
            let n = D::query_number(&mut c, &gone).await;
            c.disconnect().await.unwrap();
            (n == 0).then_some(())
        }
    })
    .await;
    let left = D::query_number(&mut conn, &format!("SELECT COUNT(*) FROM {table} WHERE id = '{xa_key}'")).await;
    assert!(streamer.stop());
    assert_eq!(xa_id, xa_key, "the XA row's outbox-id is its uuid (not its surrogate)");
    assert_eq!(left, 0, "the published XA row was deleted from the table");
}

/// As above, but the XA row cannot be published (an aggregatetype too long for a topic name):
/// with on_bad_row = "halt" the stream halts naming it by its uuid (before, its key was
/// forgotten, and the row was taken for deleted and skipped — lost, though still in the table).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_keyed_bad_xa_row_committed_after_a_later_transaction_halts() {
    let (w, table, topic) = keyed_world("rkxb", MY_DOCUMENTED).await;
    let mut conn = w.admin().await;
    let mut xa = w.admin().await;
    let streamer = w.start("s.log");
    let xa_key = "aaaaaaaa-0000-4000-8000-000000000001";
    xa_prepare(&mut xa, "kb", &insert_key(&table, xa_key, &"x".repeat(240), 100)).await;
    D::execute(&mut conn, &insert::<D>(&table, &w.prefix, "order-0", 0)).await;
    kafka::read_at_least(&topic, 1, 1, ARRIVAL).await;
    w.wait_drained(&table).await;
    xa.query_drop("XA COMMIT 'kb'").await.unwrap();
    D::execute(&mut conn, &insert::<D>(&table, &w.prefix, "order-0", 1)).await;
    let log = crate::support::wait_until("a halt or a skip", ARRIVAL, || async {
        let log = streamer.log_text();
        (log.contains("halted") || log.contains("no longer in the table")).then_some(log)
    })
    .await;
    let left = D::query_number(&mut conn, &format!("SELECT COUNT(*) FROM {table} WHERE id = '{xa_key}'")).await;
    streamer.stop();
    assert!(!log.contains("no longer in the table"), "the bad XA row (still in the table: {left}) was skipped:\n{log}");
    assert!(log.contains(&format!("at row id='{xa_key}'")), "{log}");
}

/// Debezium's table with a VARCHAR key (any text the application chose).
const MY_VARCHAR_KEY: &str = "CREATE TABLE {prefix}_0_0 (
    id VARCHAR(64) NOT NULL PRIMARY KEY,
    aggregatetype VARCHAR(255) NOT NULL,
    aggregateid VARCHAR(255) NOT NULL,
    type VARCHAR(255) NOT NULL,
    payload JSON)";

/// A bad row whose text key holds a backslash (`ord\7`): the DELETE the halt prints escapes it
/// as MariaDB reads literals, and deletes the row as printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_the_printed_delete_works_for_a_key_with_a_backslash() {
    let (w, table, _) = keyed_world("rkbs", MY_VARCHAR_KEY).await;
    let mut conn = w.admin().await;
    let streamer = w.start("s.log");
    D::execute(&mut conn, &insert_key(&table, r"ord\\7", &"x".repeat(240), 100)).await;
    assert_eq!(D::query_number(&mut conn, &format!(r"SELECT COUNT(*) FROM {table} WHERE id = 'ord\\7'")).await, 1);
    let log = streamer.wait_for_halt(ARRIVAL).await;
    assert!(streamer.stop());
    let start = log.find("(DELETE FROM").unwrap_or_else(|| panic!("{log}")) + 1;
    let delete = log[start..].split("), then").next().unwrap().to_string();
    conn.query_drop(&delete).await.unwrap();
    let left = D::query_number(&mut conn, &format!("SELECT COUNT(*) FROM {table}")).await;
    assert_eq!(left, 0, "the printed {delete} deletes the row");
}

/// A bad row whose text key holds a quote (`it's-1`), which `skip --id` cannot take: the halt
/// prints no `skip` for it, and the DELETE it prints works as printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_key_with_a_quote_gets_a_working_delete_and_no_skip() {
    let (w, table, _) = keyed_world("rkqt", MY_VARCHAR_KEY).await;
    let mut conn = w.admin().await;
    let streamer = w.start("s.log");
    D::execute(&mut conn, &insert_key(&table, "it''s-1", &"x".repeat(240), 100)).await;
    let log = streamer.wait_for_halt(ARRIVAL).await;
    assert!(streamer.stop());
    assert!(!log.contains("skip --stream"), "no skip it could not take: {log}");
    let start = log.find("(DELETE FROM").unwrap_or_else(|| panic!("{log}")) + 1;
    let delete = log[start..].split("), then").next().unwrap().to_string();
    conn.query_drop(&delete).await.unwrap();
    assert_eq!(D::query_number(&mut conn, &format!("SELECT COUNT(*) FROM {table}")).await, 0, "{delete}");
}

/// MariaDB's native UUID type (10.7+) is not read as a key: setup refuses it, and prints no
/// `MODIFY id BIGINT …` (which would fail, or turn the event id into a number).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_native_uuid_type_setup_prints_no_harmful_fix() {
    let w = with_table(World::mysql("rknu").source_keys(BY_UUID), MY_DOCUMENTED).build().await;
    let mut admin = w.admin().await;
    let held = format!("{}_1_0", w.prefix);
    let create = MY_DOCUMENTED.replace("{prefix}_0_0", &held).replace("CHAR(36)", "UUID");
    D::execute(&mut admin, create.trim_end_matches(';')).await;
    w.edit_config(|c| c.replace("shards = 1", "shards = 2"));
    let (ok, out, err) = run_cli(&w.config, &["setup", "--admin-url", w.db.admin_url()]);
    assert!(!ok, "{out}\n{err}");
    assert!(!err.contains("MODIFY `id` BIGINT"), "a uuid column is not to be turned into a BIGINT:\n{err}");
}

/// The id column changed to MariaDB's native UUID type while the stream has a checkpoint: the
/// session halts naming the type and the fix (CHAR(36), or `seq`), not with fixes that do not
/// apply (`skip --transaction` would lose the row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_native_uuid_type_mid_stream_halts_naming_the_type() {
    let (w, table, _) = keyed_world("rknm", MY_DOCUMENTED).await;
    let mut admin = w.admin().await;
    D::execute(&mut admin, &format!("ALTER TABLE {table} MODIFY id UUID NOT NULL")).await;
    let streamer = w.start("s.log");
    D::execute(&mut admin, &insert::<D>(&table, &w.prefix, "order-0", 7)).await;
    let log = streamer.wait_for_halt(ARRIVAL).await;
    streamer.stop();
    assert!(!log.contains("if id was just added"), "{log}");
    assert!(log.to_lowercase().contains("uuid"), "the halt names the column's type:\n{log}");
}
