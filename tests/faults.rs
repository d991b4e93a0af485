//! Scenarios written once and run on both databases — faults, and the behaviour every fault
//! depends on (commit order under concurrent writers, a clean restart): each function here
//! takes a [`World`] of either database; the `#[tokio::test]` wrappers that run it stay beside
//! that database's other tests (`postgres_cdc.rs`, `postgres_faults.rs`, `mysql_cdc.rs`), under
//! the names they had, so `cargo test --test main postgres` and `… mysql` still select them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::database::{Database, Row};
use crate::support::world::{ARRIVAL, World, WorldBuilder};
use crate::support::{KafkaOutage, kafka, wait_until};

/// Rows written while the streamer is killed with SIGKILL three times, `rows_per_txn` rows in
/// each of `txns` transactions, one every `pace`. No row is lost; duplicates are counted and
/// bounded by what can be in flight at a kill. Where the database keeps the confirmed position
/// apart from the table (a PostgreSQL slot), it is sampled throughout: it must never pass the
/// commit of a row still in the table.
///
/// Run by `postgres_faults::sigkill_at_random_moments_loses_nothing`,
/// `mysql_cdc::mariadb_sigkill_at_random_moments_loses_nothing` and
/// `mysql_cdc::mariadb_polling_sigkill_at_random_moments_loses_nothing`.
pub(crate) async fn sigkill<D: Database>(w: World<D>, txns: usize, pace: Duration) {
    sigkill_with(w, txns, pace, false).await;
}

/// [`sigkill`] under `delivery = "exactly-once"` (the world's config sets it): a
/// `read_committed` reader sees every row exactly once; a `read_uncommitted` one sees the
/// aborted copies too (counted, to show the test can tell the difference).
///
/// Run by `postgres_faults::{,polling_}exactly_once_sigkill_at_random_moments_sends_each_row_once`
/// and `mysql_cdc::mariadb_{,polling_}exactly_once_sigkill_at_random_moments_sends_each_row_once`.
pub(crate) async fn sigkill_exactly_once<D: Database>(w: World<D>, txns: usize, pace: Duration) {
    sigkill_with(w, txns, pace, true).await;
}

async fn sigkill_with<D: Database>(w: World<D>, txns: usize, pace: Duration, exactly_once: bool) {
    const ROWS_PER_TXN: usize = 200;
    let total = txns * ROWS_PER_TXN;
    let table = w.table(0, 0);
    // (first id, last id, a log position at or after the transaction's commit)
    let commits: Arc<Mutex<Vec<(i64, i64, u64)>>> = Arc::new(Mutex::new(Vec::new()));

    let writer = {
        let mut conn = w.db.connect().await;
        let (table, topic, commits) = (table.clone(), w.topic.clone(), commits.clone());
        tokio::spawn(async move {
            // Paced, so the kills land while rows are flowing.
            let mut pace = tokio::time::interval(pace);
            for t in 0..txns {
                pace.tick().await;
                let rows: Vec<Row> = (0..ROWS_PER_TXN)
                    .map(|r| Row::new(&topic, format!("row-{t}-{r}")).key(format!("k{}", r % 50)))
                    .collect();
                let ids = D::insert(&mut conn, &table, &rows).await;
                let after = D::log_end(&mut conn).await;
                commits.lock().unwrap().push((ids[0], *ids.last().unwrap(), after));
            }
        })
    };

    // Polling keeps no position apart from the table: nothing to sample.
    let slot = D::SLOT && !std::fs::read_to_string(&w.config).unwrap().contains(crate::polling::POLLING);
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let mut conn = w.db.connect().await;
        let (table, commits, stop) = (table.clone(), commits.clone(), stop.clone());
        tokio::spawn(async move {
            let mut samples = 0;
            let mut tick = tokio::time::interval(Duration::from_millis(30));
            while slot && !stop.load(Ordering::SeqCst) {
                tick.tick().await;
                let Some(confirmed) = D::confirmed_position(&mut conn, &table).await else {
                    continue;
                };
                let present = D::ids(&mut conn, &table).await;
                let known = commits.lock().unwrap().clone();
                for id in present {
                    if let Some(&(_, _, upper)) = known.iter().find(|(a, b, _)| *a <= id && id <= *b) {
                        assert!(
                            upper >= confirmed,
                            "confirmed {confirmed:X} past row {id} (committed before {upper:X}) still in the table"
                        );
                    }
                }
                samples += 1;
            }
            samples
        })
    };

    let mut streamer = Some(w.start("run-0.log"));
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    // Commits counted before the rows left, so a commit in between can only make this smaller.
    let deleted = || async {
        let written = commits.lock().unwrap().len() * ROWS_PER_TXN;
        let left = w.count(&table).await as usize;
        written.saturating_sub(left)
    };
    for kill in 1..=3 {
        // Let this instance make progress of its own, then kill it at a seed-dependent moment.
        streamer.as_ref().unwrap().wait_for_state("streaming", ARRIVAL).await;
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
    let partitions = w.kafka_partitions;
    let records = kafka::read_distinct(&w.topic, partitions, total, ARRIVAL).await;
    w.wait_drained(&table).await;
    stop.store(true, Ordering::SeqCst);
    let samples = sampler.await.unwrap();
    assert!(!slot || samples > 10, "the invariant was sampled ({samples} samples)");

    let mut seen: HashMap<i64, usize> = HashMap::new();
    for r in &records {
        *seen.entry(r.header("outbox-id").parse().unwrap()).or_default() += 1;
    }
    let all: Vec<(i64, i64, u64)> = commits.lock().unwrap().clone();
    let lost = all.iter().flat_map(|(first, last, _)| *first..=*last).filter(|id| !seen.contains_key(id)).count();
    let duplicates: usize = seen.values().map(|n| n - 1).sum();
    eprintln!("{} sigkill: {total} rows, 3 kills, {duplicates} duplicates, {samples} invariant samples", D::NAME);
    for kill in 0..=3 {
        let log = std::fs::read_to_string(w.dir.join(format!("run-{kill}.log"))).unwrap_or_default();
        assert!(kill == 3 || log.contains("streaming"), "instance {kill} was killed before it streamed:\n{log}");
    }
    assert_eq!(lost, 0, "rows lost");
    assert_eq!(seen.len(), total, "every row arrived, and no other");
    if exactly_once {
        assert_eq!(duplicates, 0, "a read_committed consumer sees each row once");
        kafka::assert_first_deliveries_in_order(&records, total);
        let uncommitted = kafka::count_uncommitted(&w.topic, partitions, total, ARRIVAL).await;
        eprintln!(
            "{} exactly-once sigkill: {} records read_uncommitted, {} of them aborted copies",
            D::NAME,
            uncommitted,
            uncommitted - total
        );
    }
    // Duplicates come only from rows acknowledged but not yet deleted at a kill: at most what
    // was in flight, bounded by the in-flight budget and the cleanup batch per kill.
    assert!(duplicates <= 3 * 20_000, "{duplicates} duplicates");
    assert!(streamer.take().unwrap().stop());
}

/// Kafka stopped for longer than the delivery timeout while rows keep coming, then started:
/// nothing is deleted meanwhile, nothing is lost and, counting each row's first delivery,
/// per-key order holds. The world must hold the services exclusively.
///
/// Run by `postgres_faults::{,polling_}kafka_outage_longer_than_the_delivery_timeout_loses_nothing`
/// and `mysql_cdc::mariadb_{,polling_}kafka_outage_longer_than_the_delivery_timeout_loses_nothing`.
pub(crate) async fn kafka_outage<D: Database>(w: World<D>) {
    kafka_outage_with(w, false).await;
}

/// [`kafka_outage`] under exactly-once delivery (the world's config sets it): a
/// `read_committed` reader sees each row once, in order.
///
/// Run by `postgres_faults::exactly_once_kafka_outage_sends_each_row_once` and
/// `mysql_cdc::mariadb_exactly_once_kafka_outage_sends_each_row_once`.
pub(crate) async fn kafka_outage_exactly_once<D: Database>(w: World<D>) {
    kafka_outage_with(w, true).await;
}

async fn kafka_outage_with<D: Database>(w: World<D>, exactly_once: bool) {
    w.edit_config(|c| c.replace("message_timeout_ms = 10000", "message_timeout_ms = 3000"));
    let table = w.table(0, 0);
    let partitions = w.kafka_partitions;
    let streamer = w.start("streamer.log");
    let mut conn = w.db.connect().await;
    let mut n = 0;
    let mut send = async |count: usize| {
        for _ in 0..count {
            let key = format!("k{}", n % 10);
            let row = Row::new(&w.topic, format!("{key}:{n}")).key(key);
            D::insert(&mut conn, &table, &[row]).await;
            n += 1;
        }
    };
    send(100).await;
    kafka::read_at_least(&w.topic, partitions, 100, ARRIVAL).await;

    let outage = KafkaOutage::begin();
    send(200).await;
    // A delivery timed out and the session restarts (logged as "stream interrupted").
    streamer.wait_for_metric("outbox_errors_total", &[("kind", "source")], 1.0, ARRIVAL).await;
    assert_eq!(w.count(&table).await, 200, "nothing is deleted while Kafka is away");
    drop(outage);

    let records = kafka::read_at_least(&w.topic, partitions, 300, ARRIVAL).await;
    kafka::assert_first_deliveries_in_order(&records, 300);
    if exactly_once {
        assert_eq!(records.len(), 300, "a read_committed reader sees each row once");
    }
    eprintln!("{} kafka outage: 300 rows, {} records ({} duplicates)", D::NAME, records.len(), records.len() - 300);
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

/// One transaction of 1,000,000 rows passes through with bounded memory.
///
/// Run by `postgres_faults::a_million_row_transaction_passes_with_bounded_memory` and
/// `mysql_cdc::mariadb_a_million_row_transaction_passes_with_bounded_memory`.
pub(crate) async fn million_row_transaction<D: Database>(w: World<D>) {
    million_rows(w, false).await;
}

/// [`million_row_transaction`] under exactly-once delivery (the world's config sets it): the
/// transaction is split across Kafka transactions, and each row arrives once.
///
/// Run by `postgres_faults::exactly_once_a_million_row_transaction_arrives_once_with_bounded_memory`.
pub(crate) async fn million_row_transaction_exactly_once<D: Database>(w: World<D>) {
    million_rows(w, true).await;
}

async fn million_rows<D: Database>(w: World<D>, exactly_once: bool) {
    const ROWS: usize = 1_000_000;
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    w.db.insert_series(&table, &w.topic, ROWS).await;
    let partitions = w.kafka_partitions;
    let (records, distinct) = kafka::count_distinct_ids(&w.topic, partitions, ROWS, Duration::from_secs(900)).await;
    assert_eq!(distinct, ROWS, "every row of the transaction arrived");
    if exactly_once {
        assert_eq!(records, ROWS, "each row once");
    }
    w.wait_drained(&table).await;
    let peak = streamer.peak_rss_bytes();
    eprintln!("{} million-row transaction: {records} records, streamer peak RSS {} MiB", D::NAME, peak / (1 << 20));
    // The in-flight budget is 64 MiB; librdkafka's buffers and the id list come on top.
    assert!(peak < 400 * (1 << 20), "peak RSS {} MiB", peak / (1 << 20));
    assert!(streamer.stop());
}

/// Under `on_bad_row = "dead-letter"`, a bad row's dead-letter record carries the row's raw
/// key and payload, its original topic and raw headers, and the reason; a row carrying one of
/// the streamer's own header names is a bad row. Good rows around them are published.
///
/// Run by `postgres_faults::bad_rows_go_to_the_dead_letter_topic_whole` and
/// `mysql_cdc::mariadb_bad_rows_go_to_the_dead_letter_topic_whole`.
pub(crate) async fn dead_letter_whole<D: Database>(world: WorldBuilder<D>) {
    let dlq = &kafka::fresh_topic("dlq", 1).await;
    let w = world.config(&format!("on_bad_row = \"dead-letter\"\ndead_letter_topic = \"{dlq}\"")).build().await;
    let table = w.table(0, 0);
    w.db.allow_null_topic(&table).await;
    let streamer = w.start("streamer.log");
    let mut conn = w.db.connect().await;
    let row = |payload: &str, headers: &str| Row::new(&w.topic, payload).key("the-key").headers(headers);
    for r in [
        row("first", "{}"),
        row("no topic", "{}").without_topic(),
        row("number header", r#"{"a": 1}"#),
        row("forged", r#"{"outbox-id": "1"}"#),
        row("last", "{}"),
    ] {
        D::insert(&mut conn, &table, &[r]).await;
    }
    let good = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(good.iter().map(|r| r.payload_str()).collect::<Vec<_>>(), ["first", "last"]);
    let dead = kafka::read_at_least(dlq, 1, 3, ARRIVAL).await;
    assert_eq!(dead.iter().map(|r| r.payload_str()).collect::<Vec<_>>(), ["no topic", "number header", "forged"]);
    for d in &dead {
        assert_eq!(d.key_str(), "the-key", "the raw key: {d:?}");
    }
    assert!(dead[0].header("outbox-dead-letter-reason").contains("column topic"), "{:?}", dead[0].headers);
    assert!(!dead[0].headers.contains_key("outbox-original-topic"), "a NULL topic has none");
    assert_eq!(dead[1].header("outbox-original-topic"), w.topic);
    assert_eq!(dead[1].header("outbox-original-headers"), r#"{"a": 1}"#);
    assert!(dead[2].header("outbox-dead-letter-reason").contains("reserved"), "{:?}", dead[2].headers);
    assert_ne!(dead[2].header("outbox-id"), "1", "the forged header is not passed on as ours");
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

/// The link to the database goes silent (no FIN, no RST — a dead network path, through a TCP
/// proxy): the streamer notices within three heartbeat periods (the world's config sets the
/// heartbeat where the database needs one), reconnects once the link is back, and every row
/// arrives once, in order.
///
/// Run by `postgres_faults::a_silent_dead_replication_link_is_detected_with_a_heartbeat` and
/// `mysql_cdc::mariadb_a_silent_dead_connection_is_detected_and_recovered`.
pub(crate) async fn silent_dead_link<D: Database>(w: World<D>) {
    let hostport = w.streamer_url.split('@').nth(1).unwrap().split('/').next().unwrap().to_string();
    let upstream = tokio::net::lookup_host(hostport.as_str()).await.unwrap().next().unwrap();
    let proxy = crate::support::proxy::Proxy::start(upstream).await;
    let via_proxy = w.streamer_url.replace(&hostport, &proxy.addr.to_string());
    w.edit_config(|c| c.replace(&w.streamer_url, &via_proxy));
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    let mut conn = w.db.connect().await;
    for i in 0..5 {
        D::insert(&mut conn, &table, &[Row::new(&w.topic, format!("p{i}"))]).await;
    }
    kafka::read_at_least(&w.topic, 1, 5, ARRIVAL).await;
    proxy.freeze();
    for i in 5..10 {
        D::insert(&mut conn, &table, &[Row::new(&w.topic, format!("p{i}"))]).await;
    }
    let log = streamer.wait_for_log("presumed dead", ARRIVAL).await;
    assert!(log.contains("stream interrupted"), "{log}");
    proxy.thaw();
    kafka::expect_numbered_payloads(&w.topic, 10, ARRIVAL).await;
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

/// librdkafka's local queue held to 10 records and a backlog of 20,000 rows written by one
/// statement: the streamer finds the queue full again and again (counted in
/// `outbox_sink_full_waits_total`) and waits for the next delivery report each time, never
/// dropping or reordering a record; every row arrives once, in order per key, and is deleted.
///
/// Run by `postgres_faults::a_full_client_queue_is_waited_on_and_loses_nothing` and
/// `mysql_cdc::mariadb_a_full_client_queue_is_waited_on_and_loses_nothing`.
pub(crate) async fn full_client_queue<D: Database>(world: WorldBuilder<D>) {
    const ROWS: usize = 20_000;
    let w = world.config("[kafka.properties]\n\"queue.buffering.max.messages\" = \"10\"").build().await;
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    w.db.insert_series(&table, &w.topic, ROWS).await;
    let records = kafka::read_distinct(&w.topic, w.kafka_partitions, ROWS, ARRIVAL).await;
    kafka::assert_first_deliveries_in_order(&records, ROWS);
    assert_eq!(records.len(), ROWS, "no row was sent twice");
    streamer.wait_for_metric("outbox_sink_full_waits_total", &[], 1.0, ARRIVAL).await;
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

/// Writers on their own connections commit transactions of one to four rows, each row keyed
/// by a key whose counter the transaction increments under the counter's row lock (so per key
/// the counter's order is the commit order); one transaction in eight rolls back, and the
/// log moves to a new file while they write and again after. Every committed row arrives
/// exactly once, with the database's log position in its header, and per key in commit order;
/// no rolled-back row arrives. Needs a world of three Kafka partitions.
///
/// Run by `postgres_cdc::concurrent_writers_arrive_once_in_commit_order_per_key` and
/// `mysql_cdc::mariadb_concurrent_writers_arrive_once_in_commit_order_per_key`.
pub(crate) async fn concurrent_writers<D: Database>(w: World<D>) {
    const KEYS: usize = 12;
    const WRITERS: u64 = 8;
    const TRANSACTIONS: usize = 60;
    let table = w.table(0, 0);
    let mut admin = w.db.connect().await;
    D::execute(&mut admin, "CREATE TABLE key_seq (k VARCHAR(20) PRIMARY KEY, n BIGINT NOT NULL)").await;
    let keys: Vec<String> = (0..KEYS).map(|k| format!("('key-{k}', 0)")).collect();
    D::execute(&mut admin, &format!("INSERT INTO key_seq VALUES {}", keys.join(", "))).await;
    let streamer = w.start("streamer.log");

    let committed = Arc::new(AtomicUsize::new(0));
    let mut writers = Vec::new();
    for writer in 0..WRITERS {
        let mut conn = w.db.connect().await;
        let (table, topic, committed) = (table.clone(), w.topic.clone(), committed.clone());
        writers.push(tokio::spawn(async move {
            let mut seed = writer * 7919 + 1;
            for txn_no in 0..TRANSACTIONS {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let rows = 1 + (seed >> 33) % 4;
                let mut keys: Vec<usize> = (0..rows).map(|i| ((seed >> (8 * i)) as usize) % KEYS).collect();
                // Locked in one order by every writer: no deadlock.
                keys.sort_unstable();
                keys.dedup();
                let rollback = txn_no % 8 == 3;
                let state = if rollback { "rolled-back" } else { "committed" };
                D::execute(&mut conn, "BEGIN").await;
                for k in &keys {
                    let key = format!("key-{k}");
                    D::execute(&mut conn, &format!("UPDATE key_seq SET n = n + 1 WHERE k = '{key}'")).await;
                    let n = D::query_number(&mut conn, &format!("SELECT n FROM key_seq WHERE k = '{key}'")).await;
                    D::execute(
                        &mut conn,
                        &format!(
                            "INSERT INTO {table} (topic, msg_key, payload) VALUES ('{topic}', '{key}', '{key}:{n}:{state}')"
                        ),
                    )
                    .await;
                }
                D::execute(&mut conn, if rollback { "ROLLBACK" } else { "COMMIT" }).await;
                if !rollback {
                    committed.fetch_add(keys.len(), Ordering::SeqCst);
                }
            }
        }));
    }
    // A new log file in the middle of the stream.
    D::execute(&mut admin, D::NEW_LOG_FILE).await;
    for writer in writers {
        writer.await.unwrap();
    }
    D::execute(&mut admin, D::NEW_LOG_FILE).await;
    let expected = committed.load(Ordering::SeqCst);
    let records = kafka::read_at_least(&w.topic, w.kafka_partitions, expected, ARRIVAL).await;
    assert_eq!(records.len(), expected, "every committed row exactly once in a fault-free run");
    for r in &records {
        let position = r.header(D::POSITION_HEADER);
        assert!(D::is_position(position), "{} is a {} log position: {position}", D::POSITION_HEADER, D::NAME);
    }
    kafka::assert_commit_order_per_key(&records);
    w.wait_drained(&table).await;
    assert!(streamer.stop(), "streamer exits 0 on SIGTERM");
}

/// A clean restart resumes where the first run stopped: nothing is published twice, even
/// with the second run starting in a log file the first never saw, and every record's headers
/// are complete. Rows are written through the enqueue routine to two shards (each shard's rows
/// under one key, so they share a Kafka partition and show their order), plus one row with an
/// explicit `kafka_partition`. `between_runs` checks what the first run stored while no
/// streamer runs. Needs a world of two shards and four Kafka partitions.
///
/// Run by `postgres_cdc::restart_resumes_without_republishing_and_headers_are_complete`,
/// `mysql_cdc::mariadb_restart_resumes_from_the_stored_checkpoint` and
/// `mysql_cdc::mariadb_restart_resumes_from_a_file_offset_checkpoint`.
pub(crate) async fn restart_resumes<D: Database>(w: World<D>, between_runs: impl AsyncFnOnce(&World<D>)) {
    const ROWS: i32 = 50;
    const EXPLICIT: i32 = 3;
    let partitions = w.kafka_partitions;
    let mut conn = w.db.connect().await;
    let mut send = async |rows: std::ops::Range<i32>| {
        for i in rows {
            let shard = i % 2;
            let row = Row::new(&w.topic, format!("p{i}"))
                .key(format!("shard-{shard}"))
                .headers(&format!(r#"{{"trace-id":"t{i}"}}"#));
            D::enqueue(&mut conn, &w.prefix, &row, shard).await;
        }
    };
    send(0..ROWS).await;
    let explicit = Row::new(&w.topic, "explicit").key("x").kafka_partition(EXPLICIT);
    D::insert(&mut w.db.connect().await, &w.table(0, 0), &[explicit]).await;
    let first = w.start("first.log");
    let records = kafka::read_at_least(&w.topic, partitions, ROWS as usize + 1, ARRIVAL).await;
    assert_eq!(records.len(), ROWS as usize + 1);
    w.wait_drained(&w.table(0, 0)).await;
    w.wait_drained(&w.table(1, 0)).await;
    assert!(first.stop(), "clean exit on SIGTERM");
    between_runs(&w).await;
    // The second run starts in a log file the first never saw.
    D::execute(&mut w.db.connect().await, D::NEW_LOG_FILE).await;

    send(ROWS..2 * ROWS).await;
    let second = w.start("second.log");
    let total = 2 * ROWS as usize + 1;
    let records = kafka::read_at_least(&w.topic, partitions, total, ARRIVAL).await;
    assert_eq!(records.len(), total, "no row published twice across a clean restart");
    let mut by_shard: HashMap<String, Vec<(i32, i64, String)>> = HashMap::new();
    for r in &records {
        assert!(r.header("outbox-id").parse::<i64>().is_ok());
        let position = r.header(D::POSITION_HEADER);
        assert!(D::is_position(position), "{} is a {} log position: {position}", D::POSITION_HEADER, D::NAME);
        let shard = r.header("outbox-shard");
        assert!(shard == "0" || shard == "1");
        assert_eq!(r.header("outbox-partition"), "0");
        if r.payload_str() == "explicit" {
            assert_eq!(r.partition, EXPLICIT, "kafka_partition column honoured");
        } else {
            let i: i32 = r.payload_str()[1..].parse().unwrap();
            assert_eq!(r.header("trace-id"), format!("t{i}"), "row headers become Kafka headers");
            assert_eq!(shard, (i % 2).to_string(), "enqueue routed to the asked shard");
            by_shard.entry(shard.to_string()).or_default().push((r.partition, r.offset, r.payload_str()));
        }
    }
    for (shard, mut got) in by_shard {
        got.sort();
        let payloads: Vec<String> = got.into_iter().map(|(_, _, p)| p).collect();
        let s: i32 = shard.parse().unwrap();
        let want: Vec<String> = (0..2 * ROWS).filter(|i| i % 2 == s).map(|i| format!("p{i}")).collect();
        assert_eq!(payloads, want, "shard {shard}: commit order");
    }
    w.wait_drained(&w.table(0, 0)).await;
    w.wait_drained(&w.table(1, 0)).await;
    assert!(second.stop());
}

/// A NULL topic halts its own shard-partition — `/streams` shows it halted and the other
/// streaming — with one ERROR (not one per retry) that names the row, the column and the fix;
/// the other shard keeps streaming, and the bad row and the row after it stay in the table.
/// Needs a world of two shards.
///
/// Run by `postgres_faults::a_bad_row_halts_only_its_shard_partition` and
/// `mysql_cdc::mariadb_a_bad_row_halts_naming_it`.
pub(crate) async fn bad_row_halts_its_shard_partition<D: Database>(w: World<D>) {
    let (t0, t1) = (w.table(0, 0), w.table(1, 0));
    w.db.allow_null_topic(&t0).await;
    let streamer = w.start("streamer.log");
    let mut conn = w.db.connect().await;
    let row = |payload: &str| Row::new(&w.topic, payload);
    D::insert(&mut conn, &t0, &[row("s0-before")]).await;
    let bad = D::insert(&mut conn, &t0, &[row("bad").without_topic()]).await[0];
    D::insert(&mut conn, &t0, &[row("s0-after")]).await;
    for i in 0..5 {
        D::insert(&mut conn, &t1, &[row(&format!("s1-{i}"))]).await;
    }
    let records = kafka::read_at_least(&w.topic, w.kafka_partitions, 6, ARRIVAL).await;
    let payloads: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    let shard_0: Vec<&String> = payloads.iter().filter(|p| p.starts_with("s0-")).collect();
    assert_eq!(shard_0, ["s0-before"], "nothing after the bad row on its shard-partition");
    assert_eq!(payloads.iter().filter(|p| p.starts_with("s1-")).count(), 5, "the other shard keeps streaming");
    w.wait_drained(&t1).await;
    let log = streamer.wait_for_halt(ARRIVAL).await;
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert_eq!(errors.len(), 1, "one ERROR, not one per retry:\n{log}");
    assert!(errors[0].contains(&format!("row id={bad}")) && errors[0].contains("column topic"), "{}", errors[0]);
    assert!(
        errors[0].contains(&format!("WHERE {q}id{q} = {bad}", q = if D::KIND == "postgres" { '"' } else { '`' }))
            && errors[0].contains(&format!("--id {bad}")),
        "the error names the fix: {}",
        errors[0]
    );
    let (s0, s1) = (format!("test.{t0}"), format!("test.{t1}"));
    streamer.wait_for_streams(&[(&s0, "halted"), (&s1, "streaming")], ARRIVAL).await;
    assert_eq!(w.count(&t0).await, 2, "the bad row and the one after it stay in the table");
    assert!(streamer.stop());
}
