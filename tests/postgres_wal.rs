//! `storage = "wal"` on PostgreSQL: messages written by `<prefix>_emit` (or `<prefix>_enqueue`
//! routing to it) as transactional logical messages, never stored in a table. Commit order,
//! rollbacks, other prefixes, malformed envelopes under both bad-row policies, a lost slot
//! and switching storage with messages in flight — against the real servers.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::faults;
use crate::support::kafka;
use crate::support::pg::PgDb;
use crate::support::streamer::{run_cli, run_cli_code};
use crate::support::world::{ARRIVAL, World};

const WAL: &str = "storage = \"wal\"";

/// Emits one message through the enqueue function (which routes a `wal` shard-partition to
/// `<prefix>_emit`); returns the `outbox-id` it answers.
async fn enqueue(w: &World<PgDb>, payload: &str) -> i64 {
    let sql = format!("SELECT {}_enqueue($1, 'k'::bytea, convert_to($2, 'UTF8'))", w.prefix);
    w.db.admin.query_one(&sql, &[&w.topic, &payload]).await.unwrap().get(0)
}

fn payloads(records: &[kafka::Record]) -> Vec<String> {
    records.iter().map(kafka::Record::payload_str).collect()
}

/// Eight writers, each transaction emitting 1–4 messages under per-key row locks, every
/// eighth rolled back: every committed message arrives once, in commit order per key, none
/// rolled back; the identity is the LSN `outbox_emit` answered; the table stays empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wal_concurrent_writers_arrive_once_in_commit_order_and_rollbacks_never() {
    const KEYS: usize = 12;
    const WRITERS: u64 = 8;
    const TRANSACTIONS: usize = 40;
    let w = World::postgres("wc").partitions(2).kafka_partitions(3).config(WAL).build().await;
    w.db.admin
        .batch_execute(&format!(
            "CREATE TABLE key_seq (k text PRIMARY KEY, n bigint NOT NULL);
             INSERT INTO key_seq SELECT 'key-' || i, 0 FROM generate_series(0, {}) i",
            KEYS - 1
        ))
        .await
        .unwrap();
    let streamer = w.start("streamer.log");
    let committed = Arc::new(AtomicUsize::new(0));
    let ids = Arc::new(std::sync::Mutex::new(HashSet::new()));
    let mut writers = Vec::new();
    for writer in 0..WRITERS {
        let conn = crate::support::pg::connect(&w.db.admin_url).await;
        let (prefix, topic, committed, ids) = (w.prefix.clone(), w.topic.clone(), committed.clone(), ids.clone());
        writers.push(tokio::spawn(async move {
            let mut seed = writer * 7919 + 1;
            for txn_no in 0..TRANSACTIONS {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let mut keys: Vec<usize> =
                    (0..1 + (seed >> 33) % 4).map(|i| ((seed >> (8 * i)) as usize) % KEYS).collect();
                keys.sort_unstable();
                keys.dedup();
                let rollback = txn_no % 8 == 3;
                let state = if rollback { "rolled-back" } else { "committed" };
                conn.batch_execute("BEGIN").await.unwrap();
                let mut emitted = Vec::new();
                for k in &keys {
                    let key = format!("key-{k}");
                    let n: i64 = conn
                        .query_one("UPDATE key_seq SET n = n + 1 WHERE k = $1 RETURNING n", &[&key])
                        .await
                        .unwrap()
                        .get(0);
                    let id: i64 = conn
                        .query_one(
                            &format!("SELECT {prefix}_enqueue($1, convert_to($2, 'UTF8'), convert_to($3, 'UTF8'))"),
                            &[&topic, &key, &format!("{key}:{n}:{state}")],
                        )
                        .await
                        .unwrap()
                        .get(0);
                    emitted.push(id);
                }
                conn.batch_execute(if rollback { "ROLLBACK" } else { "COMMIT" }).await.unwrap();
                if !rollback {
                    committed.fetch_add(keys.len(), Ordering::SeqCst);
                    ids.lock().unwrap().extend(emitted);
                }
            }
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let expected = committed.load(Ordering::SeqCst);
    let records = kafka::read_at_least(&w.topic, w.kafka_partitions, expected, ARRIVAL).await;
    assert_eq!(records.len(), expected, "every committed message exactly once in a fault-free run");
    kafka::assert_commit_order_per_key(&records);
    let got: HashSet<i64> = records.iter().map(|r| r.header("outbox-id").parse().unwrap()).collect();
    assert_eq!(&got, &*ids.lock().unwrap(), "outbox-id is the LSN the emit function answered");
    for r in &records {
        assert!(r.header("outbox-lsn").contains('/'), "outbox-lsn is the commit LSN");
    }
    assert_eq!(w.count(&w.table(0, 0)).await + w.count(&w.table(0, 1)).await, 0, "nothing is stored");
    assert!(streamer.stop());
}

/// [`faults::restart_resumes`] with `storage = "wal"`: the enqueue function emits, the
/// explicit-partition row goes into the table (a table row of a `wal` shard-partition is still
/// published), and nothing is sent twice across a clean restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_restart_resumes_without_republishing_and_headers_are_complete() {
    let w = World::postgres("wr").shards(2).kafka_partitions(4).config(WAL).build().await;
    faults::restart_resumes(w, async |_| {}).await;
}

/// Messages of another prefix, and a non-transactional one with the stream's own prefix (sent
/// even when its transaction rolls back), are never published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_other_prefixes_and_untransactional_messages_are_not_published() {
    let w = World::postgres("wp").config(WAL).build().await;
    let streamer = w.start("streamer.log");
    let table = w.table(0, 0);
    w.db.admin
        .batch_execute(&format!(
            "BEGIN;
             SELECT pg_logical_emit_message(true, 'another-tool', 'hello');
             SELECT pg_logical_emit_message(true, '{table}_x', 'near miss');
             SELECT pg_logical_emit_message(false, '{table}', 'sent even if rolled back');
             ROLLBACK"
        ))
        .await
        .unwrap();
    enqueue(&w, "after").await;
    let records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(payloads(&records), ["after"]);
    streamer.wait_for_log("non-transactional logical message with this stream's prefix was ignored", ARRIVAL).await;
    assert!(streamer.stop());
}

/// A hand-written message with a malformed envelope halts its shard-partition naming the LSN
/// and the field; the fix it names (`skip --message`) works — a mistyped LSN is refused — and the
/// messages after it follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_malformed_envelope_halts_naming_its_lsn_and_skip_clears_it() {
    let w = World::postgres("wm").config(WAL).build().await;
    let table = w.table(0, 0);
    let first = w.start("first.log");
    enqueue(&w, "a").await;
    let lsn: String =
        w.db.admin
            .query_one(&format!("SELECT pg_logical_emit_message(true, '{table}', '\\x01ff'::bytea)::text"), &[])
            .await
            .unwrap()
            .get(0);
    enqueue(&w, "b").await;
    let line = first.wait_for_one_halt(ARRIVAL).await;
    assert!(line.contains("field topic") && line.contains("skip --stream test/0/0 --message"), "{line}");
    let named = line.split("message at LSN ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().to_string();
    assert_eq!(named, lsn, "the halt names the LSN pg_logical_emit_message answered");
    assert_eq!(kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await.len(), 1, "only what precedes it");
    assert!(first.stop());
    // A mistyped LSN names no waiting message: refused, and the skip list stays as it was.
    let (ok, out, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--message", "0/1"]);
    assert!(!ok && err.contains("no WAL-only message") && err.contains("nothing changed"), "{out}\n{err}");
    let (ok, out, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--message", &named]);
    assert!(ok && out.contains("will not be published"), "{out}\n{err}");
    let second = w.start("second.log");
    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "b"]);
    second.wait_for_log("skipped as `outbox-streamer skip` asked", ARRIVAL).await;
    assert!(second.stop());
}

/// Under `on_bad_row = "dead-letter"` a malformed envelope goes to the dead-letter topic
/// whole (its raw bytes as the payload, the reason naming the LSN) and the stream goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_malformed_envelope_is_dead_lettered_whole() {
    let dlq = kafka::fresh_topic("wd-dlq", 1).await;
    let w = World::postgres("wd")
        .config(WAL)
        .config(&format!("on_bad_row = \"dead-letter\"\ndead_letter_topic = \"{dlq}\""))
        .build()
        .await;
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    w.db.admin
        .batch_execute(&format!("SELECT pg_logical_emit_message(true, '{table}', '\\x02cafe'::bytea)"))
        .await
        .unwrap();
    enqueue(&w, "after").await;
    assert_eq!(payloads(&kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await), ["after"]);
    let dead = kafka::read_at_least(&dlq, 1, 1, ARRIVAL).await;
    assert_eq!(dead[0].payload.as_deref(), Some(&b"\x02\xca\xfe"[..]), "the raw envelope");
    let reason = dead[0].header("outbox-dead-letter-reason");
    assert!(reason.contains("message at LSN") && reason.contains("version 2"), "{reason}");
    assert!(streamer.stop());
}

/// A dropped slot of a `wal` shard-partition halts with the range of messages that may be lost
/// — never a silent new slot — and the fix it names (setup, then the stream resumes) works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_lost_slot_halts_and_never_skips_silently() {
    let w = World::postgres("wl").config(WAL).build().await;
    let table = w.table(0, 0);
    let first = w.start("first.log");
    enqueue(&w, "a").await;
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert!(first.stop());
    w.db.admin.execute("SELECT pg_drop_replication_slot($1)", &[&table]).await.unwrap();
    enqueue(&w, "lost").await;
    let second = w.start("second.log");
    let line = second.wait_for_one_halt(ARRIVAL).await;
    assert!(line.contains("does not exist") && line.contains("may be lost") && line.contains("after LSN "), "{line}");
    assert!(line.contains("outbox-streamer setup"), "{line}");
    let slots: i64 =
        w.db.admin
            .query_one("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", &[&table])
            .await
            .unwrap()
            .get(0);
    assert_eq!(slots, 0, "no slot was created behind the operator's back");
    assert!(second.stop());
    let (ok, out, err) = run_cli(&w.config, &["setup", "--admin-url", &w.db.admin_url]);
    assert!(ok && err.contains("is missing: it is created again now") && err.contains("may be lost"), "{out}\n{err}");
    let third = w.start("third.log");
    enqueue(&w, "b").await;
    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "b"], "the stream resumes from the new slot");
    assert!(third.stop());
}

/// Switching `table` → `wal` → `table` with messages in flight (written while no streamer
/// runs) loses nothing: the stream reads both forms, in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_storage_with_messages_in_flight_loses_nothing() {
    let w = World::postgres("ws").build().await;
    let table = w.table(0, 0);
    let setup = |w: &World<PgDb>| {
        let (ok, out, err) = run_cli(&w.config, &["setup", "--admin-url", &w.db.admin_url]);
        assert!(ok, "{out}\n{err}");
        err
    };
    enqueue(&w, "row-1").await;
    assert_eq!(w.count(&table).await, 1, "table storage stores it");
    w.edit_config(|c| format!("{c}\n{WAL}\n"));
    let warnings = setup(&w);
    assert!(warnings.contains("can forge") && warnings.contains("REVOKE EXECUTE"), "{warnings}");
    let (_, out, err) = run_cli_code(&w.config, &["status"]);
    assert!(out.contains("cdc/wal"), "status shows the storage:\n{out}\n{err}");
    enqueue(&w, "message-1").await;
    assert_eq!(w.count(&table).await, 1, "wal storage emits it");
    // With no streamer holding the slot, status counts the message waiting in it beside the row.
    let (_, json, _) = run_cli_code(&w.config, &["status", "--json"]);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    assert_eq!((rows[0]["rows_pending"].as_i64(), rows[0]["messages_pending"].as_i64()), (Some(1), Some(1)), "{json}");
    let streamer = w.start("first.log");
    assert_eq!(payloads(&kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await), ["row-1", "message-1"]);
    w.wait_drained(&table).await;
    assert!(streamer.stop());
    enqueue(&w, "message-2").await;
    w.edit_config(|c| c.replace(WAL, ""));
    setup(&w);
    enqueue(&w, "row-2").await;
    let streamer = w.start("second.log");
    let records = kafka::read_at_least(&w.topic, 1, 4, ARRIVAL).await;
    assert_eq!(payloads(&records), ["row-1", "message-1", "message-2", "row-2"]);
    w.wait_drained(&table).await;
    // A table-storage shard-partition refuses the emit function: its stream may poll.
    let err =
        w.db.admin.query_one(&format!("SELECT {}_emit($1, NULL, NULL)", w.prefix), &[&w.topic]).await.unwrap_err();
    assert!(format!("{err:?}").contains("stores its messages in a table"), "{err:?}");
    assert!(streamer.stop());
}

/// SIGKILL three times at seed-dependent moments while 200-message transactions are emitted:
/// nothing is lost, first deliveries keep commit order per key, and duplicates (messages
/// acknowledged but not yet confirmed at a kill) stay bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_sigkill_at_random_moments_loses_nothing() {
    wal_sigkill(World::postgres("wk").config(WAL).build().await, false).await;
}

/// The same under exactly-once delivery: a `read_committed` reader sees each message once (a
/// message's position says whether a committed Kafka transaction holds it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_exactly_once_sigkill_at_random_moments_sends_each_message_once() {
    let w = World::postgres("wek").config(WAL).config(crate::postgres_faults::EXACTLY_ONCE).build().await;
    wal_sigkill(w, true).await;
}

async fn wal_sigkill(w: World<PgDb>, exactly_once: bool) {
    const TXNS: usize = 60;
    const PER_TXN: i64 = 200;
    let emitted = Arc::new(std::sync::Mutex::new(Vec::new()));
    let writer = {
        let conn = crate::support::pg::connect(&w.db.admin_url).await;
        let sql = format!(
            "SELECT {}_emit($1, convert_to('k' || (i % 50), 'UTF8'), convert_to('m-' || i, 'UTF8'))
             FROM generate_series(1, {PER_TXN}) i",
            w.prefix
        );
        let (topic, emitted) = (w.topic.clone(), emitted.clone());
        tokio::spawn(async move {
            let mut pace = tokio::time::interval(std::time::Duration::from_millis(40));
            for _ in 0..TXNS {
                pace.tick().await;
                let rows = conn.query(&sql, &[&topic]).await.unwrap();
                emitted.lock().unwrap().extend(rows.iter().map(|r| r.get::<_, i64>(0)));
            }
        })
    };
    let streamer = w.kill_three_times(400.0).await;
    writer.await.unwrap();
    let emitted: HashSet<i64> = emitted.lock().unwrap().iter().copied().collect();
    let total = TXNS * PER_TXN as usize;
    assert_eq!(emitted.len(), total);
    let records = kafka::read_distinct(&w.topic, 1, total, ARRIVAL).await;
    let seen: HashSet<i64> = records.iter().map(|r| r.header("outbox-id").parse().unwrap()).collect();
    assert_eq!(seen, emitted, "every emitted message arrived, and no other");
    kafka::assert_first_deliveries_in_order(&records, total);
    let duplicates = records.len() - total;
    eprintln!("wal sigkill (exactly-once: {exactly_once}): {total} messages, 3 kills, {duplicates} duplicates");
    if exactly_once {
        assert_eq!(duplicates, 0, "a read_committed reader sees each message once");
    }
    assert!(duplicates <= 3 * 20_000, "{duplicates} duplicates");
    assert!(streamer.stop());
}

/// One transaction emitting 1,000,000 messages passes with bounded memory: the walsender
/// spills it to disk and the streamer holds at most its in-flight budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_million_message_transaction_passes_with_bounded_memory() {
    const MESSAGES: usize = 1_000_000;
    let w = World::postgres("wb").config(WAL).build().await;
    let streamer = w.start("streamer.log");
    w.db.admin
        .execute(
            &format!(
                "SELECT count({}_emit($1, convert_to('k' || (i % 100), 'UTF8'), convert_to('m-' || i, 'UTF8')))
                 FROM generate_series(1, {MESSAGES}) i",
                w.prefix
            ),
            &[&w.topic],
        )
        .await
        .unwrap();
    let (records, distinct) =
        kafka::count_distinct_ids(&w.topic, 1, MESSAGES, std::time::Duration::from_secs(900)).await;
    assert_eq!(distinct, MESSAGES, "every message of the transaction arrived");
    let peak = streamer.peak_rss_bytes();
    eprintln!("wal million-message transaction: {records} records, streamer peak RSS {} MiB", peak / (1 << 20));
    assert!(peak < 400 * (1 << 20), "peak RSS {} MiB", peak / (1 << 20));
    assert!(streamer.stop());
}

/// Kafka stopped past the delivery timeout while messages keep coming: the slot never moves
/// past an unsent message, and once Kafka is back every message arrives, first deliveries in
/// commit order per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_kafka_outage_longer_than_the_delivery_timeout_loses_nothing() {
    let w = World::postgres("wo").kafka_partitions(3).config(WAL).exclusive().build().await;
    w.edit_config(|c| c.replace("message_timeout_ms = 10000", "message_timeout_ms = 3000"));
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    let sql = format!("SELECT {}_enqueue($1, convert_to($2, 'UTF8'), convert_to($3, 'UTF8'))", w.prefix);
    let mut n = 0;
    let mut send = async |count: usize| {
        let mut ids = Vec::new();
        for _ in 0..count {
            let key = format!("k{}", n % 10);
            ids.push(
                w.db.admin.query_one(&sql, &[&w.topic, &key, &format!("{key}:{n}")]).await.unwrap().get::<_, i64>(0),
            );
            n += 1;
        }
        ids
    };
    send(100).await;
    kafka::read_at_least(&w.topic, 3, 100, ARRIVAL).await;
    let outage = crate::support::KafkaOutage::begin();
    let during = send(200).await;
    streamer.wait_for_metric("outbox_errors_total", &[("kind", "source")], 1.0, ARRIVAL).await;
    let confirmed: i64 =
        w.db.admin
            .query_one(
                "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                &[&table],
            )
            .await
            .unwrap()
            .get(0);
    assert!(confirmed < during[0], "the slot passed an unsent message ({confirmed} ≥ {})", during[0]);
    drop(outage);
    let records = kafka::read_distinct(&w.topic, 3, 300, ARRIVAL).await;
    kafka::assert_first_deliveries_in_order(&records, 300);
    eprintln!("wal kafka outage: 300 messages, {} records ({} duplicates)", records.len(), records.len() - 300);
    assert!(streamer.stop());
}

/// What a database administrator's transactions do to WAL-only messages: a message emitted in a
/// subtransaction rolled back to its savepoint is not sent, the rest of the transaction is; a
/// prepared transaction's message leaves at COMMIT PREPARED and never after ROLLBACK PREPARED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_savepoints_and_prepared_transactions_decide_what_is_sent() {
    let w = World::postgres("wt").kafka_partitions(3).config(WAL).build().await;
    let streamer = w.start("streamer.log");
    let emit = |payload: &str| format!("SELECT {}_enqueue('{}', 'k'::bytea, '{payload}'::bytea)", w.prefix, w.topic);
    let gid = |name: &str| format!("{}_{name}", w.prefix);
    w.db.admin
        .batch_execute(&format!(
            "BEGIN; {}; SAVEPOINT s; {}; ROLLBACK TO SAVEPOINT s; {}; COMMIT;
             BEGIN; {}; PREPARE TRANSACTION '{}';
             BEGIN; {}; PREPARE TRANSACTION '{}';",
            emit("kept-1"),
            emit("rolled-back-to-savepoint"),
            emit("kept-2"),
            emit("prepared-then-committed"),
            gid("commit"),
            emit("prepared-then-rolled-back"),
            gid("rollback"),
        ))
        .await
        .unwrap();
    w.db.admin.batch_execute(&format!("ROLLBACK PREPARED '{}'", gid("rollback"))).await.unwrap();
    w.db.admin.batch_execute(&format!("COMMIT PREPARED '{}'", gid("commit"))).await.unwrap();
    // The emit function's explicit Kafka partition and headers travel in the envelope.
    let pinned =
        format!("SELECT {}_emit('{}', 'k'::bytea, 'last'::bytea, '{{\"h\": \"v\"}}', 0, 2)", w.prefix, w.topic);
    w.db.admin.batch_execute(&pinned).await.unwrap();
    let mut records = kafka::read_at_least(&w.topic, 3, 4, ARRIVAL).await;
    let last = records.iter().position(|r| r.payload_str() == "last").unwrap();
    let last = records.remove(last);
    assert_eq!((last.partition, last.header("h")), (2, "v"), "kafka_partition and headers honoured");
    records.sort_by_key(|r| r.offset);
    assert_eq!(payloads(&records), ["kept-1", "kept-2", "prepared-then-committed"]);
    assert!(streamer.stop());
}

/// `setup --restrict-emit`: afterwards only the streamer and the application roles may call
/// `pg_logical_emit_message` in the database — another login cannot forge a message — the
/// application still enqueues, and setup no longer warns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_restrict_emit_leaves_emitting_to_the_streamer_and_the_applications() {
    let w = World::postgres("we").config(WAL).build().await;
    let (app, other) = (format!("{}_app", w.prefix), format!("{}_other", w.prefix));
    let password = format!("pw-{}", w.prefix);
    w.db.admin
        .batch_execute(&format!(
            "CREATE ROLE {app} LOGIN PASSWORD '{password}'; CREATE ROLE {other} LOGIN PASSWORD '{password}';
             GRANT CONNECT ON DATABASE {db} TO {app}, {other}",
            db = w.db.admin_url.rsplit('/').next().unwrap()
        ))
        .await
        .unwrap();
    let args = ["setup", "--admin-url", &w.db.admin_url, "--app-role", &app, "--restrict-emit"];
    let (ok, out, err) = run_cli(&w.config, &args);
    assert!(ok && out.contains("may call pg_logical_emit_message now"), "{out}\n{err}");
    assert!(!err.contains("can forge"), "no forgery warning once restricted:\n{err}");
    let host_and_db = w.db.admin_url.rsplit_once('@').unwrap().1;
    let login = |role: &str| format!("postgres://{role}:{password}@{host_and_db}");
    let streamer = w.start("streamer.log");
    let app_conn = crate::support::pg::connect(&login(&app)).await;
    app_conn
        .execute(&format!("SELECT {}_enqueue($1, 'k'::bytea, 'from-app'::bytea)", w.prefix), &[&w.topic])
        .await
        .unwrap();
    let other_conn = crate::support::pg::connect(&login(&other)).await;
    let forged = other_conn
        .execute(&format!("SELECT pg_logical_emit_message(true, '{}', '\\x01'::bytea)", w.table(0, 0)), &[])
        .await
        .unwrap_err();
    assert_eq!(forged.code(), Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE), "{forged}");
    // Every overload stays callable by the streamer (its heartbeat) and the application.
    let streamer_role = w.streamer_url.split("://").nth(1).unwrap().split(':').next().unwrap().to_string();
    for role in [&streamer_role, &app] {
        let may: bool =
            w.db.admin
                .query_one(
                    "SELECT bool_and(has_function_privilege($1, p.oid, 'EXECUTE')) FROM pg_proc p
                 WHERE p.proname = 'pg_logical_emit_message'",
                    &[role],
                )
                .await
                .unwrap()
                .get(0);
        assert!(may, "{role} may call every overload");
    }
    assert_eq!(payloads(&kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await), ["from-app"]);
    assert!(streamer.stop());
    drop((app_conn, other_conn));
    w.db.admin.batch_execute(&format!("DROP OWNED BY {app}, {other}; DROP ROLE {app}, {other}")).await.unwrap();
}

/// From an adversarial review: a `wal` shard-partition switched to polling must not let the
/// polling stream move its slot past messages it cannot read — it halts while the functions
/// still emit (setup not rerun) and while messages wait in the slot; `teardown` keeps a slot
/// holding messages unless told; a message Kafka refuses names `skip --message`, which works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_messages_in_the_slot_are_never_dropped_by_polling_or_teardown() {
    let w = World::postgres("wg").config(WAL).build().await;
    let table = w.table(0, 0);
    enqueue(&w, "pending").await;
    // Polling in the config, setup not rerun: the functions still emit.
    w.edit_config(|c| c.replace(WAL, "mode = \"polling\""));
    let first = w.start("first.log");
    let line = first.wait_for_one_halt(ARRIVAL).await;
    assert!(line.contains("write WAL-only messages") && line.contains("run `outbox-streamer setup`"), "{line}");
    assert!(first.stop());
    let (ok, out, err) = run_cli(&w.config, &["setup", "--admin-url", &w.db.admin_url]);
    assert!(ok, "{out}\n{err}");
    let second = w.start("second.log");
    let line = second.wait_for_one_halt(ARRIVAL).await;
    assert!(line.contains("1 WAL-only message(s)") && line.contains("mode = \"cdc\""), "{line}");
    assert!(second.stop());
    // teardown keeps the slot holding it.
    let (_, out, err) = run_cli(&w.config, &["teardown", "--admin-url", &w.db.admin_url]);
    assert!(out.contains(&format!("would leave table \"{table}\" (1 row never published)")), "{out}\n{err}");
    // The fix the halt names: CDC (table storage reads messages too) publishes it.
    w.edit_config(|c| c.replace("mode = \"polling\"", ""));
    let third = w.start("third.log");
    assert_eq!(payloads(&kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await), ["pending"]);
    assert!(third.stop());
    w.edit_config(|c| format!("{c}\nmode = \"polling\"\n"));
    let fourth = w.start("fourth.log");
    fourth.wait_for_state("streaming", ARRIVAL).await;
    assert!(fourth.stop());
}

/// A WAL-only message Kafka refuses (an unknown topic) halts naming `skip --message` with its
/// outbox-id, and that command clears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_message_kafka_refuses_is_skipped_by_its_outbox_id() {
    let w = World::postgres("wq").config(WAL).build().await;
    let first = w.start("first.log");
    let missing = format!("{}-missing", w.topic);
    let sql = format!("SELECT {}_enqueue($1, 'k'::bytea, 'refused'::bytea)", w.prefix);
    w.db.admin.execute(&sql, &[&missing]).await.unwrap();
    enqueue(&w, "after").await;
    let line = first.wait_for_halt(ARRIVAL).await;
    let id = line.split("--message ").nth(1).and_then(|r| r.split('`').next()).unwrap().to_string();
    assert!(line.contains("not --id"), "{line}");
    assert!(first.stop());
    let (ok, out, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--message", &id]);
    assert!(ok && out.contains("will not be published"), "{out}\n{err}");
    let second = w.start("second.log");
    assert_eq!(payloads(&kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await), ["after"]);
    assert!(second.stop());
}
