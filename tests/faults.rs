//! Fault scenarios written once and run on both databases: each function here takes a built
//! [`World`] of either database; the `#[tokio::test]` wrappers that run it stay beside that
//! database's other tests (`postgres_faults.rs`, `mysql_cdc.rs`), under the names they had, so
//! `cargo test --test main postgres` and `… mysql` still select them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
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

    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let mut conn = w.db.connect().await;
        let (table, commits, stop) = (table.clone(), commits.clone(), stop.clone());
        tokio::spawn(async move {
            let mut samples = 0;
            let mut tick = tokio::time::interval(Duration::from_millis(30));
            while D::SLOT && !stop.load(Ordering::SeqCst) {
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
    assert!(!D::SLOT || samples > 10, "the invariant was sampled ({samples} samples)");

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
    eprintln!("{} kafka outage: 300 rows, {} records ({} duplicates)", D::NAME, records.len(), records.len() - 300);
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

/// One transaction of 1,000,000 rows passes through with bounded memory.
///
/// Run by `postgres_faults::a_million_row_transaction_passes_with_bounded_memory` and
/// `mysql_cdc::mariadb_a_million_row_transaction_passes_with_bounded_memory`.
pub(crate) async fn million_row_transaction<D: Database>(w: World<D>) {
    const ROWS: usize = 1_000_000;
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    w.db.insert_series(&table, &w.topic, ROWS).await;
    let partitions = w.kafka_partitions;
    let (records, distinct) = kafka::count_distinct_ids(&w.topic, partitions, ROWS, Duration::from_secs(900)).await;
    assert_eq!(distinct, ROWS, "every row of the transaction arrived");
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
