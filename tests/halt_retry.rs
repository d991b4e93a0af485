//! A halt clears when its cause is fixed, without a restart: the stream stays halted (one
//! ERROR) while it retries with a growing interval, sends nothing after the row it halted at,
//! and resumes by itself once the topic is created or the grant given — every row once, in
//! order. `halt_retry_ms` keeps the retries short here.

use std::time::Duration;

use tokio_postgres::types::ToSql;

use crate::support::metrics::{free_addr, stream_state};
use crate::support::pg::PgDb;
use crate::support::streamer::Running;
use crate::support::world::World;
use crate::support::{kafka, unique, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);
const HALTED: f64 = 3.0;
const STREAMING: f64 = 1.0;

/// ERROR lines of a log (the text format's second field).
fn errors(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.split_whitespace().nth(1) == Some("ERROR")).collect()
}

fn payloads(records: &[kafka::Record]) -> Vec<String> {
    records.iter().map(kafka::Record::payload_str).collect()
}

/// Starts the streamer with its metrics on a free address.
fn start(w: &World<PgDb>, log: &str) -> (Running, std::net::SocketAddr) {
    let addr = free_addr();
    let running = Running::start_with_env(&w.config, &w.dir.join(log), &[("OUTBOX_METRICS_LISTEN", addr.to_string())]);
    (running, addr)
}

/// Waits until the streamer logged `n` retries of its halt that halted again, and checks
/// that the halt never seemed to clear meanwhile and that the waits between them grew.
async fn retried(streamer: &Running, n: usize) -> String {
    let log = wait_until(&format!("{n} retries of the halt"), ARRIVAL, || async {
        let log = streamer.log_text();
        (log.matches("still halted for the same reason").count() >= n).then_some(log)
    })
    .await;
    assert!(!log.contains("the cause of the halt is gone"), "a retry that halted again cleared the halt:\n{log}");
    let waits: Vec<f64> =
        log.lines().filter_map(|l| l.split("retry_in_s=").nth(1)?.split_whitespace().next()?.parse().ok()).collect();
    assert!(waits.windows(2).all(|w| w[1] > w[0]), "the retries must come less and less often: {waits:?}");
    log
}

async fn wait_state(addr: std::net::SocketAddr, want: f64) {
    wait_until(&format!("outbox_stream_state {want}"), ARRIVAL, || async {
        (stream_state(addr).await == Some(want)).then_some(())
    })
    .await;
}

/// A row naming a topic that does not exist (auto-creation is off) halts the stream; it stays
/// halted through several retries with one ERROR, and no row after the bad one is published.
/// Once the test creates the topic, the stream resumes by itself: the bad row and everything
/// after it arrive once each, in order, and the table drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_missing_topic_halt_clears_once_the_topic_exists() {
    let w = World::postgres("hm").config("halt_retry_ms = 300").build().await;
    let table = w.table(0, 0);
    let missing = unique("hm-later").replace('_', "-");
    let (streamer, addr) = start(&w, "streamer.log");
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, convert_to($2, 'UTF8')) RETURNING id");
    let row = async |topic: &str, payload: &str| -> i64 {
        w.db.admin.query_one(&insert, &[&topic as &(dyn ToSql + Sync), &payload]).await.unwrap().get(0)
    };
    row(&w.topic, "a").await;
    let bad = row(&missing, "m1").await;
    row(&missing, "m2").await;
    row(&w.topic, "b").await;
    // The rows after the bad one in one transaction, as an application would write them.
    w.db.admin
        .batch_execute(&format!(
            "BEGIN; INSERT INTO {table} (topic, payload) VALUES ('{topic}', 'c'), ('{missing}', 'm3'), ('{topic}', 'd'); COMMIT",
            topic = w.topic
        ))
        .await
        .unwrap();

    let log = streamer.wait_for_halt(ARRIVAL).await;
    let error = errors(&log).first().map(|l| l.to_string()).unwrap_or_default();
    assert!(error.contains(&format!("row id={bad}")) && error.contains("does not exist"), "{log}");
    assert!(error.contains("retries by itself"), "the ERROR says the halt clears by itself: {error}");
    wait_state(addr, HALTED).await;
    let log = retried(&streamer, 3).await;
    assert_eq!(errors(&log).len(), 1, "one ERROR however often the halt is retried:\n{log}");
    assert_eq!(stream_state(addr).await, Some(HALTED), "still halted while retrying");
    let before = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(payloads(&before), ["a"], "nothing after the bad row is published, however often retried");

    kafka::create_topic(&missing, 1).await;
    let later = kafka::read_at_least(&missing, 1, 3, ARRIVAL).await;
    assert_eq!(payloads(&later), ["m1", "m2", "m3"], "the bad row first, then the rest, once each");
    let records = kafka::read_at_least(&w.topic, 1, 4, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "b", "c", "d"], "once each, in order");
    wait_state(addr, STREAMING).await;
    w.wait_drained(&table).await;
    let log = streamer.log_text();
    assert!(log.contains("the cause of the halt is gone; streaming again"), "{log}");
    assert_eq!(errors(&log).len(), 1, "{log}");
    // It streams as before.
    row(&missing, "m4").await;
    assert_eq!(payloads(&kafka::read_at_least(&missing, 1, 4, ARRIVAL).await), ["m1", "m2", "m3", "m4"]);
    assert!(streamer.stop());
}

/// The streamer role loses DELETE: the cleanup's refusal halts the stream once; the retries
/// resend nothing (the acknowledged rows are deleted first, before anything is read); after
/// the GRANT the stream resumes by itself and the table drains, each row published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_revoked_delete_grant_halt_clears_once_granted() {
    let w = World::postgres("hd").config("halt_retry_ms = 300").build().await;
    let table = w.table(0, 0);
    let role = w.db.streamer_url.trim_start_matches("postgres://").split(':').next().unwrap().to_string();
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2)");
    let (streamer, addr) = start(&w, "streamer.log");
    w.db.admin.execute(&insert, &[&w.topic as &(dyn ToSql + Sync), &b"p0".as_slice()]).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    w.wait_drained(&table).await;

    w.db.admin.batch_execute(&format!("REVOKE DELETE ON {table} FROM {role}")).await.unwrap();
    // One transaction: all four are published before the first delete is refused.
    let values: Vec<String> = (1..5).map(|i| format!("('{}', 'p{i}')", w.topic)).collect();
    w.db.admin
        .batch_execute(&format!("INSERT INTO {table} (topic, payload) VALUES {}", values.join(", ")))
        .await
        .unwrap();
    let error = streamer.wait_for_one_halt(ARRIVAL).await;
    assert!(error.contains("permission denied") && error.contains("GRANT SELECT, DELETE"), "{error}");
    assert!(error.contains("retries by itself"), "{error}");
    wait_state(addr, HALTED).await;
    let log = retried(&streamer, 3).await;
    assert_eq!(errors(&log).len(), 1, "{log}");
    let records = kafka::read_at_least(&w.topic, 1, 5, ARRIVAL).await;
    assert_eq!(payloads(&records), ["p0", "p1", "p2", "p3", "p4"], "the retries resend nothing");
    assert_eq!(w.db.count(&table).await, 4, "nothing deleted, so nothing lost");

    w.db.admin.batch_execute(&format!("GRANT DELETE ON {table} TO {role}")).await.unwrap();
    w.wait_drained(&table).await;
    wait_state(addr, STREAMING).await;
    w.db.admin.execute(&insert, &[&w.topic as &(dyn ToSql + Sync), &b"p5".as_slice()]).await.unwrap();
    let records = kafka::read_at_least(&w.topic, 1, 6, ARRIVAL).await;
    assert_eq!(payloads(&records), ["p0", "p1", "p2", "p3", "p4", "p5"], "each row once, in order");
    w.wait_drained(&table).await;
    assert_eq!(errors(&streamer.log_text()).len(), 1);
    assert!(streamer.stop());
}

/// `outbox-streamer skip --id` on a halted stream takes effect at the next retry, without a
/// restart: the skipped row is not published, the rows after it are, once each, in order.
/// (`skip` refuses during the moment a retry reads the slot; it is simply run again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_skip_on_a_halted_stream_takes_effect_without_a_restart() {
    let w = World::postgres("hs").config("halt_retry_ms = 300").build().await;
    let table = w.table(0, 0);
    let missing = unique("hs-never").replace('_', "-");
    let (streamer, addr) = start(&w, "streamer.log");
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, convert_to($2, 'UTF8')) RETURNING id");
    let row = async |topic: &str, payload: &str| -> i64 {
        w.db.admin.query_one(&insert, &[&topic as &(dyn ToSql + Sync), &payload]).await.unwrap().get(0)
    };
    row(&w.topic, "a").await;
    let bad = row(&missing, "never").await;
    row(&w.topic, "b").await;
    streamer.wait_for_state("halted", ARRIVAL).await;
    wait_state(addr, HALTED).await;

    let out = wait_until("skip to find the stream between retries", ARRIVAL, || async {
        let (ok, out, err) =
            crate::support::streamer::run_cli(&w.config, &["skip", "--stream", "test/0/0", "--id", &bad.to_string()]);
        assert!(ok || err.contains("the stream is running"), "{out}\n{err}");
        ok.then_some(out)
    })
    .await;
    assert!(out.contains(&format!("row id={bad} will not be published")), "{out}");
    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "b"]);
    wait_state(addr, STREAMING).await;
    w.wait_drained(&table).await;
    let log = streamer.log_text();
    assert!(log.contains("skipped as `outbox-streamer skip` asked"), "{log}");
    assert_eq!(errors(&log).len(), 1, "{log}");
    assert!(streamer.stop());
}

/// A catch-up whose deletes are refused halts like a streaming session, and its retries resend
/// nothing either: the rows Kafka acknowledged are deleted first when the next attempt starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_catch_up_halted_on_a_refused_delete_resends_nothing_when_retried() {
    let w = World::postgres("hc").config("halt_retry_ms = 300\npoll_batch = 10").build().await;
    let table = w.table(0, 0);
    let role = w.db.streamer_url.trim_start_matches("postgres://").split(':').next().unwrap().to_string();
    w.db.admin.batch_execute(&format!("REVOKE DELETE ON {table} FROM {role}")).await.unwrap();
    let values: Vec<String> = (0..40).map(|i| format!("('{}', 'p{i:02}')", w.topic)).collect();
    w.db.admin
        .batch_execute(&format!("INSERT INTO {table} (topic, payload) VALUES {}", values.join(", ")))
        .await
        .unwrap();
    w.db.admin.batch_execute(&format!("UPDATE {}_checkpoint SET catchup_pending = true", w.prefix)).await.unwrap();
    let (streamer, addr) = start(&w, "streamer.log");
    streamer.wait_for_log("catching up by polling", ARRIVAL).await;
    streamer.wait_for_state("halted", ARRIVAL).await;
    wait_state(addr, HALTED).await;
    let log = retried(&streamer, 3).await;
    assert_eq!(errors(&log).len(), 1, "{log}");
    let (records, distinct) = kafka::count_distinct_ids(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(records, distinct, "the retries resend nothing: {records} records of {distinct} rows");

    w.db.admin.batch_execute(&format!("GRANT DELETE ON {table} TO {role}")).await.unwrap();
    w.wait_drained(&table).await;
    wait_state(addr, STREAMING).await;
    let records = kafka::read_at_least(&w.topic, 1, 40, ARRIVAL).await;
    let want: Vec<String> = (0..40).map(|i| format!("p{i:02}")).collect();
    assert_eq!(payloads(&records), want, "each row once, in order");
    assert!(streamer.stop());
}

/// Between two attempts, a missing topic is looked up every few seconds: with a minute
/// between attempts, creating the topic resumes the stream long before the next attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_missing_topic_is_looked_up_between_attempts() {
    let w = World::postgres("hp").config("halt_retry_ms = 60000").build().await;
    let table = w.table(0, 0);
    let missing = unique("hp-later").replace('_', "-");
    let (streamer, addr) = start(&w, "streamer.log");
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, convert_to($2, 'UTF8'))");
    w.db.admin.execute(&insert, &[&missing as &(dyn ToSql + Sync), &"m1"]).await.unwrap();
    w.db.admin.execute(&insert, &[&w.topic as &(dyn ToSql + Sync), &"after"]).await.unwrap();
    streamer.wait_for_state("halted", ARRIVAL).await;
    wait_state(addr, HALTED).await;
    let created = std::time::Instant::now();
    kafka::create_topic(&missing, 1).await;
    assert_eq!(payloads(&kafka::read_at_least(&missing, 1, 1, ARRIVAL).await), ["m1"]);
    assert_eq!(payloads(&kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await), ["after"]);
    assert!(created.elapsed() < Duration::from_secs(45), "resumed {:?} after the topic was created", created.elapsed());
    let log = streamer.log_text();
    assert!(log.contains("the missing topic exists now; retrying"), "{log}");
    assert!(!log.contains("retry_in_s="), "no attempt was due yet:\n{log}");
    wait_state(addr, STREAMING).await;
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

/// A halt while connecting (the streamer role may not read its checkpoint table) clears as
/// soon as a retry connects: the grant given back, the stream turns streaming by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_halt_while_connecting_clears_once_a_retry_connects() {
    let w = World::postgres("hk").config("halt_retry_ms = 300").build().await;
    let table = w.table(0, 0);
    let checkpoint = format!("{}_checkpoint", w.prefix);
    let role = w.db.streamer_url.trim_start_matches("postgres://").split(':').next().unwrap().to_string();
    w.db.admin.batch_execute(&format!("REVOKE SELECT ON {checkpoint} FROM {role}")).await.unwrap();
    let (streamer, addr) = start(&w, "streamer.log");
    let error = streamer.wait_for_one_halt(ARRIVAL).await;
    assert!(error.contains("permission denied") && error.contains(&checkpoint), "{error}");
    wait_state(addr, HALTED).await;
    retried(&streamer, 2).await;

    w.db.admin.batch_execute(&format!("GRANT SELECT ON {checkpoint} TO {role}")).await.unwrap();
    wait_state(addr, STREAMING).await;
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, 'x')");
    w.db.admin.execute(&insert, &[&w.topic as &(dyn ToSql + Sync)]).await.unwrap();
    assert_eq!(payloads(&kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await), ["x"]);
    w.wait_drained(&table).await;
    assert_eq!(errors(&streamer.log_text()).len(), 1);
    assert!(streamer.stop());
}
