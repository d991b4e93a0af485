//! PostgreSQL CDC under faults: SIGKILL at random moments, bad rows under both policies.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_postgres::types::ToSql;

use crate::support::world::World;
use crate::support::{kafka, wait_until};

const ARRIVAL: Duration = Duration::from_secs(180);

fn lsn(text: &str) -> u64 {
    let (hi, lo) = text.split_once('/').expect("LSN is X/Y");
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

/// 50,000 rows in 250 transactions while the streamer is killed with SIGKILL three times.
/// No row is lost; duplicates are counted. Throughout, the slot's confirmed position is
/// sampled: it must never pass the commit of a row still in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_at_random_moments_loses_nothing() {
    const TXNS: usize = 250;
    const ROWS_PER_TXN: usize = 200;
    let total = TXNS * ROWS_PER_TXN;
    let w = World::postgres("ok").kafka_partitions(4).build().await;
    let table = w.table(0, 0);
    // (first id, last id, a WAL position at or after the transaction's commit end)
    let commits: Arc<Mutex<Vec<(i64, i64, u64)>>> = Arc::new(Mutex::new(Vec::new()));

    let writer = {
        let url = w.db.admin_url.clone();
        let (table, topic, commits) = (table.clone(), w.topic.clone(), commits.clone());
        tokio::spawn(async move {
            let mut client = crate::support::pg::connect(&url).await;
            let insert = format!(
                "INSERT INTO {table} (topic, msg_key, payload) SELECT $1, ('k' || (g % 50))::bytea, ('row-' || g)::bytea
                 FROM generate_series(1, {ROWS_PER_TXN}) g RETURNING id"
            );
            // Paced, so the kills land while rows are flowing: about 5 s of writing.
            let mut pace = tokio::time::interval(Duration::from_millis(20));
            for _ in 0..TXNS {
                pace.tick().await;
                let tx = client.transaction().await.unwrap();
                let ids: Vec<i64> = tx.query(&insert, &[&topic]).await.unwrap().iter().map(|r| r.get(0)).collect();
                tx.commit().await.unwrap();
                let after: String =
                    client.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).await.unwrap().get(0);
                commits.lock().unwrap().push((ids[0], *ids.last().unwrap(), lsn(&after)));
            }
        })
    };

    let sampler = {
        let url = w.db.admin_url.clone();
        let (table, commits) = (table.clone(), commits.clone());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let handle = tokio::spawn(async move {
            let client = crate::support::pg::connect(&url).await;
            let mut samples = 0;
            let mut tick = tokio::time::interval(Duration::from_millis(30));
            while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
                tick.tick().await;
                let Some(confirmed) = client
                    .query_one(
                        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                        &[&table],
                    )
                    .await
                    .unwrap()
                    .get::<_, Option<String>>(0)
                else {
                    continue;
                };
                let confirmed = lsn(&confirmed);
                let present: Vec<i64> = client
                    .query(&format!("SELECT id FROM {table}"), &[])
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                let known = commits.lock().unwrap().clone();
                for id in present {
                    if let Some(&(_, _, upper)) = known.iter().find(|(a, b, _)| *a <= id && id <= *b) {
                        assert!(
                            upper >= confirmed,
                            "slot confirmed {confirmed:X} past row {id} (committed before {upper:X}) still in the table"
                        );
                    }
                }
                samples += 1;
            }
            samples
        });
        (stop, handle)
    };

    let mut streamer = Some(w.start("run-0.log"));
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    // Commits counted before the rows left, so a commit in between can only make this smaller.
    let deleted = || async {
        let written = commits.lock().unwrap().len() * ROWS_PER_TXN;
        let left = w.db.count(&table).await as usize;
        written.saturating_sub(left)
    };
    for kill in 1..=3 {
        // Let this instance make progress of its own, then kill it at a seed-dependent moment.
        streamer.as_ref().unwrap().wait_for_log("streaming", ARRIVAL).await;
        let before = deleted().await;
        wait_until("progress by the current instance before the kill", ARRIVAL, || async {
            (deleted().await >= before + 2 * ROWS_PER_TXN).then_some(())
        })
        .await;
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let moment = tokio::time::Instant::now() + Duration::from_millis(seed % 200);
        let mut at = tokio::time::interval_at(moment, Duration::from_secs(1));
        at.tick().await;
        streamer.take().unwrap().kill();
        streamer = Some(w.start(&format!("run-{kill}.log")));
    }
    writer.await.unwrap();
    let records = kafka::read_distinct(&w.topic, 4, total, ARRIVAL).await;
    w.wait_drained(&table).await;
    let (stop, handle) = sampler;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let samples = handle.await.unwrap();
    assert!(samples > 10, "the invariant was sampled ({samples} samples)");

    let mut seen: HashMap<i64, usize> = HashMap::new();
    for r in &records {
        *seen.entry(r.header("outbox-id").parse().unwrap()).or_default() += 1;
    }
    let all: Vec<(i64, i64, u64)> = commits.lock().unwrap().clone();
    let mut lost = 0;
    for (first, last, _) in &all {
        for id in *first..=*last {
            if !seen.contains_key(&id) {
                lost += 1;
            }
        }
    }
    let duplicates: usize = seen.values().map(|n| n - 1).sum();
    eprintln!("sigkill test: {total} rows, 3 kills, {duplicates} duplicates, {samples} invariant samples");
    for kill in 0..=3 {
        let log = std::fs::read_to_string(w.dir.join(format!("run-{kill}.log"))).unwrap_or_default();
        assert!(kill == 3 || log.contains("streaming"), "instance {kill} was killed before it streamed:\n{log}");
    }
    assert_eq!(lost, 0, "rows lost");
    // Duplicates come only from rows acknowledged but not yet deleted at a kill: at most what
    // was in flight, bounded by the in-flight budget and the cleanup batch per kill.
    assert!(duplicates <= 3 * 20_000, "{duplicates} duplicates");
    let last = streamer.take().unwrap();
    assert!(last.stop());
}

/// A NULL topic halts its own shard-partition with one error naming the row and column; the
/// other shard keeps streaming and the bad row stays in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_row_halts_only_its_shard_partition() {
    let w = World::postgres("oh").shards(2).build().await;
    let (t0, t1) = (w.table(0, 0), w.table(1, 0));
    w.db.admin.batch_execute(&format!("ALTER TABLE {t0} ALTER COLUMN topic DROP NOT NULL")).await.unwrap();
    let streamer = w.start("streamer.log");
    let insert = |table: &str| format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2) RETURNING id");
    w.db.admin.execute(&insert(&t0), &[&w.topic as &(dyn ToSql + Sync), &b"s0-before".as_slice()]).await.unwrap();
    let bad: i64 =
        w.db.admin
            .query_one(&format!("INSERT INTO {t0} (topic, payload) VALUES (NULL, 'bad') RETURNING id"), &[])
            .await
            .unwrap()
            .get(0);
    w.db.admin.execute(&insert(&t0), &[&w.topic as &(dyn ToSql + Sync), &b"s0-after".as_slice()]).await.unwrap();
    for i in 0..5 {
        w.db.admin
            .execute(&insert(&t1), &[&w.topic as &(dyn ToSql + Sync), &format!("s1-{i}").as_bytes()])
            .await
            .unwrap();
    }
    let records = kafka::read_at_least(&w.topic, 1, 6, ARRIVAL).await;
    let payloads: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert!(payloads.contains(&"s0-before".to_string()));
    assert!(!payloads.contains(&"s0-after".to_string()), "nothing after the bad row on its shard-partition");
    assert_eq!(payloads.iter().filter(|p| p.starts_with("s1-")).count(), 5, "the other shard keeps streaming");
    w.wait_drained(&t1).await;
    let log = streamer.wait_for_log("halted", ARRIVAL).await;
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert_eq!(errors.len(), 1, "one ERROR, not one per retry:\n{log}");
    assert!(errors[0].contains(&format!("row id={bad}")) && errors[0].contains("column topic"), "{}", errors[0]);
    assert_eq!(w.db.count(&t0).await, 2, "the bad row and the one after it stay in the table");
    assert!(streamer.stop());
}

/// Kafka stopped for longer than the delivery timeout while rows keep coming, then started:
/// nothing is lost and, counting each row's first delivery, per-key order holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_outage_longer_than_the_delivery_timeout_loses_nothing() {
    kafka_outage("ko", "").await;
}

/// The same outage in polling mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_kafka_outage_longer_than_the_delivery_timeout_loses_nothing() {
    kafka_outage("pko", "mode = \"polling\"").await;
}

async fn kafka_outage(name: &str, extra: &str) {
    let w = World::postgres(name).kafka_partitions(3).config(extra).exclusive().build().await;
    let config =
        std::fs::read_to_string(&w.config).unwrap().replace("message_timeout_ms = 10000", "message_timeout_ms = 3000");
    std::fs::write(&w.config, config).unwrap();
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    let insert = format!("INSERT INTO {table} (topic, msg_key, payload) VALUES ($1, $2, $3)");
    let mut n = 0;
    let mut send = async |count: usize| {
        for _ in 0..count {
            let key = format!("k{}", n % 10);
            let payload = format!("{key}:{n}");
            w.db.admin
                .execute(&insert, &[&w.topic as &(dyn ToSql + Sync), &key.as_bytes(), &payload.as_bytes()])
                .await
                .unwrap();
            n += 1;
        }
    };
    send(100).await;
    kafka::read_at_least(&w.topic, 3, 100, ARRIVAL).await;

    let outage = crate::support::KafkaOutage::begin();
    send(200).await;
    wait_until("a delivery to time out and the session to restart", ARRIVAL, || async {
        streamer.log_text().contains("stream interrupted").then_some(())
    })
    .await;
    assert_eq!(w.db.count(&table).await, 200, "nothing is deleted while Kafka is away");
    drop(outage);

    let records = kafka::read_at_least(&w.topic, 3, 300, ARRIVAL).await;
    kafka::assert_first_deliveries_in_order(&records, 300);
    eprintln!("kafka outage: 300 rows, {} records ({} duplicates)", records.len(), records.len() - 300);
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

/// One transaction of 1,000,000 rows passes through with bounded memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_row_transaction_passes_with_bounded_memory() {
    const ROWS: usize = 1_000_000;
    let w = World::postgres("om").kafka_partitions(3).build().await;
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    w.db.admin
        .execute(
            &format!(
                "INSERT INTO {table} (topic, msg_key, payload)
                 SELECT $1, ('k' || (g % 1000))::bytea, convert_to(lpad(g::text, 200, 'x'), 'UTF8')
                 FROM generate_series(1, {ROWS}) g"
            ),
            &[&w.topic],
        )
        .await
        .unwrap();
    let (records, distinct) = kafka::count_distinct_ids(&w.topic, 3, ROWS, Duration::from_secs(900)).await;
    assert_eq!(distinct, ROWS, "every row of the transaction arrived");
    w.wait_drained(&table).await;
    let peak = streamer.peak_rss_bytes();
    eprintln!("million-row transaction: {records} records, streamer peak RSS {} MiB", peak / (1 << 20));
    // The in-flight budget is 64 MiB; librdkafka's buffers and the id list come on top.
    assert!(peak < 400 * (1 << 20), "peak RSS {} MiB", peak / (1 << 20));
    assert!(streamer.stop());
}

/// A row naming a topic that does not exist halts its shard-partition with an error that says
/// so (auto-creation is off), instead of retrying forever. The broker's first answer
/// (UNKNOWN_TOPIC_OR_PARTITION, also seen briefly while partitions move) is retried once; the
/// client's own "unknown topic" verdict is definite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_halts_with_an_error_that_names_it() {
    let w = World::postgres("ou").build().await;
    let t0 = w.table(0, 0);
    let streamer = w.start("streamer.log");
    let id: i64 =
        w.db.admin
            .query_one(
                &format!("INSERT INTO {t0} (topic, payload) VALUES ('no-such-topic-anywhere', 'x') RETURNING id"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
    let log = streamer.wait_for_log("halted", ARRIVAL).await;
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert_eq!(errors.len(), 1, "one ERROR:\n{log}");
    assert!(errors[0].contains(&format!("row id={id}")), "{}", errors[0]);
    assert!(errors[0].contains("does not exist"), "{}", errors[0]);
    assert_eq!(w.db.count(&t0).await, 1, "the row stays in the table");
    assert!(streamer.stop());
}

/// A payload above Kafka's maximum under the default policy halts with the row named and the
/// fix; the row and everything after it stay in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_payload_halts_with_the_row_named() {
    let w = World::postgres("oz").build().await;
    let t0 = w.table(0, 0);
    let streamer = w.start("streamer.log");
    let insert = format!("INSERT INTO {t0} (topic, payload) VALUES ($1, $2) RETURNING id");
    let row = async |payload: &[u8]| -> i64 {
        w.db.admin.query_one(&insert, &[&w.topic as &(dyn ToSql + Sync), &payload]).await.unwrap().get(0)
    };
    row(b"first").await;
    let big = row(&vec![b'x'; 2 * 1024 * 1024]).await;
    row(b"after").await;
    let log = streamer.wait_for_log("halted", ARRIVAL).await;
    let error = log.lines().find(|l| l.contains("ERROR")).expect("an ERROR line");
    assert!(error.contains(&format!("row id={big}")) && error.contains("message.max.bytes"), "{error}");
    let records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(records.iter().map(|r| r.payload_str()).collect::<Vec<_>>(), ["first"]);
    assert_eq!(w.db.count(&t0).await, 2, "the oversize row and the one after it stay");
    assert!(streamer.stop());
}

/// Dropping a required column while streaming halts with an error naming the column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_required_column_halts_naming_it() {
    let w = World::postgres("ox").build().await;
    let t0 = w.table(0, 0);
    let streamer = w.start("streamer.log");
    w.db.admin.execute(&format!("INSERT INTO {t0} (topic, payload) VALUES ($1, 'before')"), &[&w.topic]).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    w.db.admin.batch_execute(&format!("ALTER TABLE {t0} DROP COLUMN headers")).await.unwrap();
    w.db.admin.execute(&format!("INSERT INTO {t0} (topic, payload) VALUES ($1, 'after')"), &[&w.topic]).await.unwrap();
    let log = streamer.wait_for_log("halted", ARRIVAL).await;
    let error = log.lines().find(|l| l.contains("ERROR")).expect("an ERROR line");
    assert!(error.contains("\\\"headers\\\"") || error.contains("\"headers\""), "{error}");
    assert_eq!(w.db.count(&t0).await, 1, "the row after the change stays in the table");
    assert!(streamer.stop());
}

/// With a heartbeat configured, a replication link that goes silent without closing (a dead
/// network path, through a TCP proxy) is noticed within three heartbeat intervals; once the
/// link is back the stream resumes and every row arrives once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_dead_replication_link_is_detected_with_a_heartbeat() {
    let w = World::postgres("pdl").build().await;
    let hostport = w.db.streamer_url.split('@').nth(1).unwrap().split('/').next().unwrap().to_string();
    let upstream = tokio::net::lookup_host(hostport.as_str()).await.unwrap().next().unwrap();
    let proxy = crate::support::proxy::Proxy::start(upstream).await;
    let via_proxy = w.db.streamer_url.replace(&hostport, &proxy.addr.to_string());
    crate::support::streamer::pg_config(&w.dir, &via_proxy, &w.prefix, 1, 1, "");
    let config = std::fs::read_to_string(&w.config).unwrap().replace(
        &format!("table_prefix = \"{}\"\n", w.prefix),
        &format!("table_prefix = \"{}\"\nheartbeat_interval_ms = 500\n", w.prefix),
    );
    std::fs::write(&w.config, config).unwrap();
    let streamer = w.start("streamer.log");
    let insert = format!("INSERT INTO {} (topic, payload) VALUES ($1, $2)", w.table(0, 0));
    for i in 0..5 {
        w.db.admin.execute(&insert, &[&w.topic, &format!("p{i}").as_bytes()]).await.unwrap();
    }
    kafka::read_at_least(&w.topic, 1, 5, ARRIVAL).await;
    proxy.freeze();
    for i in 5..10 {
        w.db.admin.execute(&insert, &[&w.topic, &format!("p{i}").as_bytes()]).await.unwrap();
    }
    let log = streamer.wait_for_log("presumed dead", ARRIVAL).await;
    assert!(log.contains("stream interrupted"), "{log}");
    proxy.thaw();
    kafka::expect_numbered_payloads(&w.topic, 10, ARRIVAL).await;
    w.wait_drained(&w.table(0, 0)).await;
    assert!(streamer.stop());
}

/// PostgreSQL flushes a commit record before the transaction becomes visible to other
/// sessions, and the walsender may send the transaction in between. A synchronous standby
/// that never answers holds a committing transaction exactly there (committed in the WAL,
/// invisible to queries) for as long as the test likes. The streamer publishes the row; its
/// first DELETE finds nothing, and it must wait for the transaction to become visible and
/// delete the row then, not confirm the position with the row left in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_sent_before_its_commit_is_visible_is_still_deleted() {
    let w = World::postgres("vis").kafka_partitions(3).exclusive().build().await;
    let table = w.table(0, 0);
    let root = crate::support::pg::connect(&crate::support::env("OUTBOX_PG_URL")).await;
    let db: String = w.db.admin.query_one("SELECT current_database()", &[]).await.unwrap().get(0);
    // Every session of this database commits locally, except the writer below.
    root.batch_execute(&format!("ALTER DATABASE {db} SET synchronous_commit = local")).await.unwrap();
    w.db.admin.batch_execute("SET synchronous_commit = local").await.unwrap();
    let _standby = NeverAnsweringStandby::begin(&root).await;
    let streamer = w.start("streamer.log");
    // A first row ends the session's replay check, so the held row below meets the delete.
    let warm_up = format!("INSERT INTO {table} (topic, msg_key, payload) VALUES ($1, 'k', 'warm-up')");
    w.db.admin.execute(&warm_up, &[&w.topic]).await.unwrap();
    kafka::read_at_least(&w.topic, 3, 1, ARRIVAL).await;
    w.wait_drained(&table).await;

    let writer = crate::support::pg::connect(&w.db.admin_url).await;
    writer.batch_execute("SET synchronous_commit = on").await.unwrap();
    let writer_pid: i32 = writer.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    let insert = format!("INSERT INTO {table} (topic, msg_key, payload) VALUES ($1, 'k', 'held')");
    let topic = w.topic.clone();
    let committing = tokio::spawn(async move { writer.execute(&insert, &[&topic]).await });

    let records = kafka::read_at_least(&w.topic, 3, 2, ARRIVAL).await;
    assert_eq!(records[1].payload_str(), "held", "the row is published while its commit is still invisible");
    wait_until("the streamer to wait for the transaction to become visible", ARRIVAL, || async {
        let waiting: bool = root
            .query_one(
                "SELECT count(*) > 0 FROM pg_stat_activity
                 WHERE datname = $1 AND usename = $2 AND query LIKE '%transactionid::text = ANY%'",
                &[&db, &format!("{db}_streamer")],
            )
            .await
            .unwrap()
            .get(0);
        waiting.then_some(())
    })
    .await;
    assert_eq!(w.db.count(&table).await, 0, "the writer's row is not visible yet");
    // Give up waiting for the standby: the transaction becomes visible.
    root.execute("SELECT pg_cancel_backend($1)", &[&writer_pid]).await.unwrap();
    committing.await.unwrap().expect("the insert committed locally");
    // The streamer, waiting for exactly this, may delete the row before we could count it.
    w.wait_drained(&table).await;
    let records = kafka::read_at_least(&w.topic, 3, 2, ARRIVAL).await;
    assert_eq!(records.len(), 2, "each row once");
    assert!(streamer.stop());
}

/// Makes every commit that asks for synchronous replication wait for a standby that does not
/// exist; undone on drop, even when the test fails.
struct NeverAnsweringStandby;

impl NeverAnsweringStandby {
    async fn begin(root: &tokio_postgres::Client) -> Self {
        root.batch_execute("ALTER SYSTEM SET synchronous_standby_names = 'nobody'").await.unwrap();
        root.batch_execute("SELECT pg_reload_conf()").await.unwrap();
        Self
    }
}

impl Drop for NeverAnsweringStandby {
    fn drop(&mut self) {
        std::thread::spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let root = crate::support::pg::connect(&crate::support::env("OUTBOX_PG_URL")).await;
                root.batch_execute("ALTER SYSTEM RESET synchronous_standby_names")
                    .await
                    .expect("resetting synchronous_standby_names");
                root.batch_execute("SELECT pg_reload_conf()").await.expect("reloading the configuration");
            })
        })
        .join()
        .expect("reset thread");
    }
}

/// Large rows with a small in-flight budget: 60 rows of 800 kB, `max_in_flight_bytes` = 2 MB.
/// The budget bounds what is produced and not yet acknowledged; polling also lowers its rows
/// per read to what the budget holds (before, it read 60 rows — 48 MB — at once). The peak is
/// printed for docs/benchmarks.md and checked only against a generous bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_rows_stay_within_the_in_flight_budget() {
    for (name, mode) in [("lr", ""), ("lrp", "mode = \"polling\"")] {
        let extra = format!("max_in_flight_bytes = 2000000\n{mode}");
        let w = World::postgres(name).config(&extra).build().await;
        let table = w.table(0, 0);
        // Incompressible, so neither lz4 nor the database can shrink it.
        w.db.admin
            .execute(
                &format!(
                    "INSERT INTO {table} (topic, payload)
                     SELECT $1, (SELECT string_agg(md5(i::text || '-' || j::text), '')::bytea FROM generate_series(1, 25000) j)
                     FROM generate_series(1, 60) i"
                ),
                &[&w.topic as &(dyn ToSql + Sync)],
            )
            .await
            .unwrap();
        let streamer = w.start("streamer.log");
        let (records, distinct) = kafka::count_distinct_ids(&w.topic, 1, 60, ARRIVAL).await;
        w.wait_drained(&table).await;
        let peak = streamer.peak_rss_bytes();
        eprintln!(
            "large rows ({}): 60 x 800 kB, budget 2 MB: {records} records, peak RSS {} MiB",
            if mode.is_empty() { "cdc" } else { "polling" },
            peak / (1 << 20)
        );
        assert_eq!(distinct, 60);
        assert!(peak < 200 * (1 << 20), "peak RSS {} MiB", peak / (1 << 20));
        assert!(streamer.stop());
    }
}
