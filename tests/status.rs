//! `outbox-streamer status` against real streamers: the state each shard-partition's streamer
//! reports (asked at `[metrics] listen`, or of the lease holder under ZooKeeper) and the exit
//! codes — 0 healthy, 1 not running with rows waiting or beyond a limit, 2 halted.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tokio_postgres::types::ToSql;

use crate::support::pg::PgDb;
use crate::support::streamer::{Running, run_cli_code};
use crate::support::world::World;
use crate::support::{env, kafka, unique, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// `status --json <args>`: (exit code, rows).
fn status_json(config: &Path, args: &[&str]) -> (i32, Vec<Value>, String) {
    let (code, out, err) = run_cli_code(config, &[&["status", "--json"], args].concat());
    let rows = serde_json::from_str(&out).unwrap_or_else(|e| panic!("status --json is not JSON ({e}):\n{out}\n{err}"));
    (code, rows, out)
}

/// Waits until `status --json` exits `code` with the streamers in `states` (per row, in order).
async fn wait_for_status(config: &Path, code: i32, states: &[&str]) -> Vec<Value> {
    wait_until(&format!("status to exit {code} with streamers {states:?}"), ARRIVAL, || async {
        let (got, rows, _) = status_json(config, &[]);
        let seen: Vec<&str> = rows.iter().map(|r| r["streamer"]["state"].as_str().unwrap_or_default()).collect();
        (got == code && seen == states).then_some(rows.clone())
    })
    .await
}

async fn insert(w: &World<PgDb>, table: &str, topic: &str, payload: &str) -> i64 {
    let sql = format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2::text::bytea) RETURNING id");
    w.db.admin.query_one(&sql, &[&topic as &(dyn ToSql + Sync), &payload]).await.unwrap().get(0)
}

/// Stopped with rows waiting (1), streaming and caught up (0), halted on a bad row (2), and
/// stopped again with the bad row still in the table (1): each printed with the streamer's
/// state and, for the halt, its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_exit_codes_follow_what_the_streamer_does() {
    let addr = free_addr();
    let w = World::postgres("st").shards(2).config(&format!("\n[metrics]\nlisten = \"{addr}\"\n")).build().await;
    let (t0, t1) = (w.table(0, 0), w.table(1, 0));
    for i in 0..3 {
        insert(&w, &t0, &w.topic, &format!("early-{i}")).await;
    }

    // Nothing runs: 3 rows wait on test/0/0; test/1/0 waits for nothing and is fine.
    let (code, out, err) = run_cli_code(&w.config, &["status"]);
    assert_eq!(code, 1, "a stopped streamer with rows waiting is exit 1:\n{out}\n{err}");
    assert!(out.contains(&format!("test/0/0, test/1/0: not running: nothing answers at {addr}")), "{out}");
    assert!(out.trim_end().ends_with("exit 1: test/0/0: not running with 3 rows waiting"), "{out}");
    let (_, rows, json) = status_json(&w.config, &[]);
    assert_eq!(rows[0]["streamer"]["state"], "not-running", "{json}");
    assert_eq!((rows[0]["rows_pending"].as_i64(), rows[0]["healthy"].as_bool()), (Some(3), Some(false)), "{json}");
    let wal_status = rows[0]["state"].as_str().unwrap_or_default();
    assert!(["reserved", "extended"].contains(&wal_status), "the slot's wal_status, apart from the streamer: {json}");
    assert_eq!(
        (rows[1]["streamer"]["state"].as_str(), rows[1]["healthy"].as_bool()),
        (Some("not-running"), Some(true))
    );

    // Running: everything delivered, both caught up, exit 0.
    let streamer = w.start("streamer.log");
    kafka::read_at_least(&w.topic, 1, 3, ARRIVAL).await;
    w.wait_drained(&t0).await;
    let rows = wait_for_status(&w.config, 0, &["caught-up", "caught-up"]).await;
    let pid = format!("pid {}", streamer.pid());
    assert!(rows.iter().all(|r| r["streamer"]["instance"] == pid.as_str()), "reported by the streamer: {rows:?}");
    let (code, out, _) = run_cli_code(&w.config, &["status"]);
    assert!(code == 0 && out.trim_end().ends_with("healthy"), "{out}");

    // A row with an empty topic halts test/0/0 (on_bad_row = halt); test/1/0 streams on.
    let bad = insert(&w, &t0, "", "bad").await;
    insert(&w, &t1, &w.topic, "after").await;
    streamer.wait_for_one_halt(ARRIVAL).await;
    let rows = wait_for_status(&w.config, 2, &["halted", "caught-up"]).await;
    let reason = rows[0]["streamer"]["reason"].as_str().unwrap_or_default();
    assert!(reason.contains(&format!("row id={bad}")) && reason.contains("topic"), "the halt's reason: {rows:?}");
    assert_eq!(rows[0]["problems"][0], "halted");
    let (code, out, _) = run_cli_code(&w.config, &["status", "--max-pending-rows", "100000"]);
    assert_eq!(code, 2, "{out}");
    let line = out.lines().find(|l| l.starts_with("test ")).expect("a table row");
    assert!(line.contains(" halted ") && line.contains(&format!(" {wal_status} ")), "streamer and slot apart:\n{out}");
    assert!(out.contains("test/0/0: halted for ") && out.contains(&format!("row id={bad}")), "{out}");
    assert!(out.trim_end().ends_with("exit 2: test/0/0: halted"), "{out}");

    // Stopped: the halt was the process's; the bad row still waits, so not running is exit 1.
    assert!(streamer.stop());
    let (code, rows, json) = status_json(&w.config, &[]);
    assert_eq!(code, 1, "{json}");
    assert_eq!(rows[0]["problems"][0], "not running with 1 row waiting", "{json}");
}

/// A stream that cannot deliver (Kafka unreachable) keeps running and retrying, which is no
/// problem by itself; the limits say when its rows wait too long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_limits_catch_a_running_stream_that_delivers_nothing() {
    let addr = free_addr();
    let w = World::postgres("stlag").config(&format!("\n[metrics]\nlisten = \"{addr}\"\n")).build().await;
    let (config, table) = (&w.config, w.table(0, 0));
    // Port 1 (tcpmux) listens nowhere, and unlike a port just freed no other test can take it.
    // (OUTBOX_KAFKA_BROKERS overrides the config's brokers, so it is what must change.)
    let nowhere = [("OUTBOX_KAFKA_BROKERS", "127.0.0.1:1".to_string())];
    let streamer = Running::start_with_env(config, &w.dir.join("no-kafka.log"), &nowhere);
    for i in 0..3 {
        insert(&w, &table, &w.topic, &format!("stuck-{i}")).await;
    }
    wait_until("the stream to be running with 3 rows waiting", ARRIVAL, || async {
        let (code, rows, _) = status_json(config, &[]);
        let state = rows[0]["streamer"]["state"].as_str().unwrap_or_default();
        (code == 0 && ["streaming", "retrying"].contains(&state) && rows[0]["rows_pending"] == 3).then_some(())
    })
    .await;

    let (code, out, _) = run_cli_code(config, &["status", "--max-pending-rows", "2"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains(" LAGGING"), "{out}");
    assert!(out.contains("test/0/0: 3 rows waiting, more than --max-pending-rows 2"), "{out}");
    let (code, out, _) = run_cli_code(config, &["status", "--max-pending-rows", "3"]);
    assert_eq!(code, 0, "3 rows do not exceed 3:\n{out}");
    let (code, rows, json) = status_json(config, &["--max-lag-bytes", "0"]);
    assert_eq!(code, 1, "undelivered rows hold the slot back: {json}");
    assert!(rows[0]["lagging"].as_bool().unwrap() && rows[0]["lag_bytes"].as_i64() > Some(0), "{json}");

    // The retry is shown with its reason (records time out after message_timeout_ms).
    let out = wait_until("status to show the retry", ARRIVAL, || async {
        let (code, out, _) = run_cli_code(config, &["status"]);
        (code == 0 && out.contains("test/0/0: retrying for ")).then_some(out)
    })
    .await;
    let reason = out.lines().find(|l| l.starts_with("test/0/0: retrying")).unwrap();
    assert!(reason.len() > "test/0/0: retrying for 0 s: ".len(), "a reason is given: {reason}");
    assert!(streamer.stop());
}

/// Under ZooKeeper, status asks each lease holder at the metrics address its member node
/// publishes: it names the owner and what it does, halts included, and stays quiet about the
/// ZooKeeper client's sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_under_zookeeper_asks_the_owner() {
    let cluster = unique("stzk");
    let coordination = format!(
        "\n[coordination]\nkind = \"zookeeper\"\nconnect = \"{}\"\ncluster_name = \"{cluster}\"\ninstance = \"status-one\"\nsession_timeout_ms = 3000\n",
        env("OUTBOX_ZK_CONNECT")
    );
    let w = World::postgres("stzk").shards(2).config(&coordination).build().await;
    let (t0, t1) = (w.table(0, 0), w.table(1, 0));
    let addr = free_addr();
    let streamer =
        Running::start_with_env(&w.config, &w.dir.join("owner.log"), &[("OUTBOX_METRICS_LISTEN", addr.to_string())]);
    insert(&w, &t0, &w.topic, "one").await;
    insert(&w, &t1, &w.topic, "two").await;
    kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    w.wait_drained(&t0).await;
    w.wait_drained(&t1).await;

    let rows = wait_for_status(&w.config, 0, &["caught-up", "caught-up"]).await;
    for row in &rows {
        assert_eq!(row["owner"], "status-one", "{row}");
        assert_eq!(row["streamer"]["instance"], "status-one", "{row}");
        assert_eq!(row["streamer"]["address"], addr.to_string().as_str(), "asked where it published: {row}");
    }
    let (code, out, err) = run_cli_code(&w.config, &["status"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.starts_with(&format!("cluster /outbox-streamer/{cluster}: 1 live instance(s): status-one")), "{out}");
    assert!(err.is_empty(), "nothing on stderr, no ZooKeeper session lines:\n{err}");

    let bad = insert(&w, &t0, "", "bad").await;
    streamer.wait_for_one_halt(ARRIVAL).await;
    wait_for_status(&w.config, 2, &["halted", "caught-up"]).await;
    let (code, out, err) = run_cli_code(&w.config, &["status"]);
    assert_eq!(code, 2, "{out}\n{err}");
    let line = out.lines().find(|l| l.starts_with("test ") && l.contains(" halted ")).expect("the halted row");
    assert!(line.contains("status-one"), "the owner is named:\n{out}");
    let reason = out.lines().find(|l| l.starts_with("test/0/0: halted for ")).expect("the halt's reason line");
    assert!(reason.contains(" on status-one: ") && reason.contains(&format!("row id={bad}")), "{out}");

    // The owner leaves: nobody holds test/0/0, whose bad row still waits.
    assert!(streamer.stop());
    let (code, rows, json) = status_json(&w.config, &[]);
    assert_eq!(code, 1, "{json}");
    assert_eq!(rows[0]["streamer"]["state"], "not-running", "{json}");
    assert_eq!(rows[0]["streamer"]["reason"], "no instance holds its lease", "{json}");
    assert_eq!(rows[1]["healthy"], true, "nothing waits on test/1/0: {json}");
}

/// The same on MariaDB: caught up while the streamer runs (0), not running with a row waiting
/// once it stopped (1); the checkpoint stays `checkpoint` either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_on_mariadb_tells_a_running_from_a_stopped_streamer() {
    use mysql_async::prelude::Queryable;
    let addr = free_addr();
    let w = World::mysql("stmy").config(&format!("\n[metrics]\nlisten = \"{addr}\"\n")).build().await;
    let insert = format!("INSERT INTO {} (topic, payload) VALUES (?, 'x')", w.table(0, 0));
    let mut admin = w.admin().await;
    let streamer = w.start("streamer.log");
    admin.exec_drop(&insert, (&w.topic,)).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    w.wait_drained(&w.table(0, 0)).await;
    let rows = wait_for_status(&w.config, 0, &["caught-up"]).await;
    assert_eq!(rows[0]["state"], "checkpoint", "{rows:?}");

    assert!(streamer.stop());
    admin.exec_drop(&insert, (&w.topic,)).await.unwrap();
    let (code, out, err) = run_cli_code(&w.config, &["status"]);
    assert_eq!(code, 1, "{out}\n{err}");
    let line = out.lines().find(|l| l.starts_with("test ")).expect("a table row");
    assert!(line.contains(" not running ") && line.contains(" checkpoint "), "{out}");
    assert!(out.trim_end().ends_with("exit 1: test/0/0: not running with 1 row waiting"), "{out}");
    admin.disconnect().await.unwrap();
}
