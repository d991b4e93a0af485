//! PostgreSQL errors that retrying cannot fix halt once with the fix; a slot held by another
//! session is waited for with backoff; another database's slot is never used or touched.

use std::path::Path;
use std::time::Duration;

use tokio_postgres::types::ToSql;

use crate::support::streamer::{Running, pg_config, run_cli, scratch};
use crate::support::world::World;
use crate::support::{kafka, pg, unique};

const ARRIVAL: Duration = Duration::from_secs(120);
/// Long enough for a retry loop to show itself; a halted stream is long settled by then.
const HALT: Duration = Duration::from_secs(60);

/// Log lines at `level` (the text format's second field).
fn lines_at<'a>(log: &'a str, level: &str) -> Vec<&'a str> {
    log.lines().filter(|l| l.split_whitespace().nth(1) == Some(level)).collect()
}

/// The streamer role of a test database (the user of its URL).
fn role_of(db: &pg::PgDb) -> String {
    let rest = db.streamer_url.strip_prefix("postgres://").expect("a postgres:// URL");
    rest.split(':').next().expect("user:password@").to_string()
}

fn database_of(url: &str) -> String {
    url.rsplit('/').next().expect("a URL ending in /database").to_string()
}

async fn slot_database(admin: &tokio_postgres::Client, slot: &str) -> Option<(String, String)> {
    admin
        .query_opt(
            "SELECT database::text, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1)))
}

fn setup(config: &Path, admin_url: &str) -> (bool, String) {
    let (ok, out, err) = run_cli(config, &["setup", "--admin-url", admin_url]);
    (ok, format!("{out}{err}"))
}

/// Item 6: two databases of one cluster with the same prefix. The second's `setup` refuses
/// the first's slot with the fix; its `run` halts once with the fix and leaves the other
/// database's slot alone; with the suggested `slot_prefix` it streams, rows written before its
/// slot existed included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_database_never_uses_or_touches_the_first_ones_slot() {
    let _services = crate::support::shared_services().await;
    let (first, second) = (pg::fresh_db().await, pg::fresh_db().await);
    let prefix = unique("sp");
    let topic = kafka::fresh_topic("sp", 1).await;
    let slot = format!("{prefix}_0_0");
    let dir = scratch(&prefix);
    let (first_dir, second_dir) = (dir.join("first"), dir.join("second"));
    std::fs::create_dir_all(&first_dir).unwrap();
    std::fs::create_dir_all(&second_dir).unwrap();
    let first_config = pg_config(&first_dir, &first.streamer_url, &prefix, 1, 1, "");
    let second_config = pg_config(&second_dir, &second.streamer_url, &prefix, 1, 1, "");
    // The second database's tables exist (set up while the name was free, its slot dropped
    // since); then the first database takes the slot name.
    let (ok, out) = setup(&second_config, &second.admin_url);
    assert!(ok, "{out}");
    second.admin.execute("SELECT pg_drop_replication_slot($1)", &[&slot]).await.unwrap();
    let (ok, out) = setup(&first_config, &first.admin_url);
    assert!(ok, "{out}");
    let first_db = database_of(&first.admin_url);
    let second_db = database_of(&second.admin_url);
    let before = slot_database(&first.admin, &slot).await.expect("the first database's slot");
    assert_eq!(before.0, first_db);

    // setup: never "ready" on another database's slot.
    let (ok, out) = setup(&second_config, &second.admin_url);
    assert!(!ok, "setup must refuse another database's slot:\n{out}");
    assert!(out.contains(&format!("replication slot \"{slot}\" belongs to database \"{first_db}\"")), "{out}");
    let suggested = format!("{prefix}_{second_db}");
    assert!(out.contains(&format!("slot_prefix = \"{suggested}\"")), "the fix names the setting:\n{out}");

    // run: halts once with the fix, no retry loop, the other database's slot untouched.
    let table = format!("{prefix}_0_0");
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2)");
    second.admin.execute(&insert, &[&topic as &(dyn ToSql + Sync), &b"before-own-slot".as_slice()]).await.unwrap();
    let running = Running::start(&second_config, &second_dir.join("halted.log"));
    let error = running.wait_for_one_halt(HALT).await;
    assert!(error.contains(&format!("belongs to database \"{first_db}\"")), "{error}");
    assert!(error.contains(&format!("slot_prefix = \"{suggested}\"")), "{error}");
    assert!(running.stop(), "a halted streamer exits 0 on SIGTERM");
    // The catch-up, which replaces a lost slot by name, halts the same way.
    second.admin.batch_execute(&format!("UPDATE {prefix}_checkpoint SET catchup_pending = true")).await.unwrap();
    let running = Running::start(&second_config, &second_dir.join("catch-up-halted.log"));
    let error = running.wait_for_one_halt(HALT).await;
    assert!(error.contains(&format!("belongs to database \"{first_db}\"")), "{error}");
    assert!(running.log_text().contains("catching up by polling"), "the catch-up's check halted it");
    assert!(running.stop());
    assert_eq!(slot_database(&first.admin, &slot).await, Some(before), "the first database's slot is untouched");

    // The fix: the second database's own slots. The row written before its slot existed is
    // sent too (setup marks a catch-up for a table that already holds rows).
    let text = std::fs::read_to_string(&second_config).unwrap();
    let text = text.replace("partitions = 1\n", &format!("partitions = 1\nslot_prefix = \"{suggested}\"\n"));
    std::fs::write(&second_config, text).unwrap();
    let (ok, out) = setup(&second_config, &second.admin_url);
    assert!(ok, "{out}");
    let own = slot_database(&second.admin, &format!("{suggested}_0_0")).await.expect("the second database's own slot");
    assert_eq!(own.0, second_db);
    let running = Running::start(&second_config, &second_dir.join("fixed.log"));
    second.admin.execute(&insert, &[&topic as &(dyn ToSql + Sync), &b"after-own-slot".as_slice()]).await.unwrap();
    let records = kafka::read_at_least(&topic, 1, 2, ARRIVAL).await;
    let payloads: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(payloads, ["before-own-slot", "after-own-slot"]);
    assert!(running.stop());
    assert_eq!(slot_database(&first.admin, &slot).await.map(|s| s.0), Some(first_db));
}

/// Item 7: a streamer role without DELETE. Each row is published once, the cleanup's
/// permission error halts the shard-partition once with the server's message and the exact
/// GRANT; after the GRANT and a restart the rows are deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_delete_grant_halts_once_without_republishing() {
    let w = World::postgres("nd").build().await;
    let table = w.table(0, 0);
    let role = role_of(&w.db);
    w.db.admin.batch_execute(&format!("REVOKE DELETE ON {table} FROM {role}")).await.unwrap();
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2)");
    for i in 0..5 {
        w.db.admin.execute(&insert, &[&w.topic as &(dyn ToSql + Sync), &format!("p{i}").as_bytes()]).await.unwrap();
    }
    let streamer = w.start("no-delete.log");
    let error = streamer.wait_for_one_halt(HALT).await;
    assert!(error.contains(&format!("permission denied for table {table} (SQLSTATE 42501)")), "{error}");
    assert!(error.contains(&format!("GRANT SELECT, DELETE ON \"{table}\" TO \"{role}\"")), "{error}");
    let records = kafka::read_at_least(&w.topic, 1, 5, ARRIVAL).await;
    assert_eq!(records.len(), 5, "each row published once, not once per retry");
    assert_eq!(w.db.count(&table).await, 5, "nothing deleted, so nothing is lost");
    assert!(streamer.stop());

    w.db.admin.batch_execute(&format!("GRANT DELETE ON {table} TO {role}")).await.unwrap();
    let streamer = w.start("granted.log");
    w.wait_drained(&table).await;
    assert!(streamer.stop());
    let (records, distinct) = kafka::count_distinct_ids(&w.topic, 1, 5, ARRIVAL).await;
    assert_eq!(distinct, 5);
    assert!(records <= 10, "at most one resend, of the rows never deleted: {records}");
}

/// Item 7: a wrong password (28P01) halts once and names where the password comes from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_password_halts_once_naming_password_env() {
    let w = World::postgres("pw").build().await;
    let var = unique("OUTBOX_TEST_PW").to_uppercase();
    let text = std::fs::read_to_string(&w.config).unwrap();
    let (user_and_password, host) = w.db.streamer_url.split_once('@').expect("user:password@host");
    let (user, _) = user_and_password.rsplit_once(':').expect("user:password");
    let without_password = format!("{user}@{host}");
    let text = text
        .replace(&w.db.streamer_url, &without_password)
        .replace("partitions = 1\n", &format!("partitions = 1\npassword_env = \"{var}\"\n"));
    std::fs::write(&w.config, text).unwrap();
    let streamer = Running::start_with_env(&w.config, &w.dir.join("wrong-password.log"), &[(&var, "wrong".into())]);
    let error = streamer.wait_for_one_halt(HALT).await;
    assert!(error.contains("password authentication failed"), "the server's message: {error}");
    assert!(error.contains("(SQLSTATE 28P01)"), "{error}");
    assert!(error.contains(&format!("password_env = \"{var}\"")), "the fix names the setting: {error}");
    assert!(streamer.stop());
}

/// Item 7: a second instance without coordination finds the slot held (55006). It retries
/// less and less often, says once at WARN that another instance may hold the slot, and logs
/// no ERROR.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_slot_is_retried_with_backoff_and_reported_once() {
    let w = World::postgres("bs").build().await;
    let table = w.table(0, 0);
    let first = w.start("first.log");
    w.db.admin.execute(&format!("INSERT INTO {table} (topic, payload) VALUES ($1, 'x')"), &[&w.topic]).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    let second = w.start("second.log");
    second.wait_for_log("another instance may hold", ARRIVAL).await;
    // Six attempts, then the gaps between them: they must grow (backoff), not repeat.
    let log = crate::support::wait_until("six attempts at the held slot", ARRIVAL, || async {
        let log = second.log_text();
        (log.lines().filter(|l| l.contains("in use by another session")).count() >= 6).then_some(log)
    })
    .await;
    let warnings: Vec<&str> =
        lines_at(&log, "WARN").into_iter().filter(|l| l.contains("another instance may hold")).collect();
    assert_eq!(warnings.len(), 1, "one WARN for six attempts:\n{log}");
    assert!(warnings[0].contains("in use by another session"), "{}", warnings[0]);
    assert!(lines_at(&log, "ERROR").is_empty(), "no ERROR for a held slot:\n{log}");
    let seconds = |line: &str| -> f64 {
        let time = line.split_whitespace().next().and_then(|t| t.split('T').nth(1)).unwrap_or_default();
        let mut parts = time.trim_end_matches('Z').split(':').map(|p| p.parse::<f64>().unwrap_or(0.0));
        parts.next().unwrap_or(0.0) * 3600.0 + parts.next().unwrap_or(0.0) * 60.0 + parts.next().unwrap_or(0.0)
    };
    let at: Vec<f64> = log.lines().filter(|l| l.contains("in use by another session")).map(seconds).collect();
    let (first_gap, last_gap) = (at[1] - at[0], at[5] - at[4]);
    assert!(last_gap >= 2.0 * first_gap && last_gap >= 1.0, "attempts at {at:?}: no backoff?\n{log}");
    assert!(second.stop() && first.stop());
}
