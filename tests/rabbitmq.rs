//! RabbitMQ as a shard-partition's destination, against the real RabbitMQ of
//! `scripts/services up` (`OUTBOX_RABBITMQ_URL`): commit order into a bound queue, the mapping
//! of a row onto an AMQP message, rows deleted only once confirmed, a Kafka shard beside it,
//! the halts a returned message or a missing exchange cause, each cleared by its fix, and an
//! owner paused past its ZooKeeper session publishing nothing after the new owner.

use std::time::Duration;

use futures::StreamExt;
use outbox_rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use outbox_rabbitmq::lapin::types::{AMQPValue, FieldTable};
use outbox_rabbitmq::lapin::{Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};

use crate::support::database::{Database, Row};
use crate::support::kafka;
use crate::support::world::{ARRIVAL, World};

const DEADLINE: Duration = Duration::from_secs(60);

fn rabbit_url() -> String {
    std::env::var("OUTBOX_RABBITMQ_URL").expect(
        "OUTBOX_RABBITMQ_URL is not set: run `eval \"$(scripts/services env)\"` (scripts/services up starts RabbitMQ)",
    )
}

/// Shard 1 goes to RabbitMQ, shard 0 to Kafka.
fn config() -> String {
    format!(
        "[[source.override]]\nshard = 1\nsink = \"rabbitmq\"\nhalt_retry_ms = 200\n\n[rabbitmq]\nurl = \"{}\"\n",
        rabbit_url()
    )
}

async fn channel() -> (Connection, Channel) {
    let conn = Connection::connect(&rabbit_url(), ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    (conn, ch)
}

async fn declare_exchange(ch: &Channel, name: &str) {
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    ch.exchange_declare(name.into(), ExchangeKind::Direct, durable, FieldTable::default()).await.unwrap();
}

/// An exclusive queue bound to `exchange` with `routing_key`, consumed.
async fn bound_queue(ch: &Channel, exchange: &str, routing_key: &str) -> Consumer {
    let queue = format!("{exchange}-{routing_key}");
    let exclusive = QueueDeclareOptions { exclusive: true, ..Default::default() };
    ch.queue_declare(queue.as_str().into(), exclusive, FieldTable::default()).await.unwrap();
    ch.queue_bind(
        queue.as_str().into(),
        exchange.into(),
        routing_key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.basic_consume(queue.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap()
}

/// Reads `consumer` until `n` distinct bodies arrived (acknowledging each); answers them in
/// the order of their first delivery. A body longer than 100 bytes is named `big`.
async fn first_deliveries(consumer: &mut Consumer, n: usize, what: &str) -> Vec<String> {
    let mut firsts: Vec<String> = Vec::new();
    while firsts.len() < n {
        let d = tokio::time::timeout(DEADLINE, consumer.next())
            .await
            .unwrap_or_else(|_| panic!("{what}"))
            .unwrap()
            .unwrap();
        let name = if d.data.len() > 100 { "big".to_string() } else { String::from_utf8(d.data.clone()).unwrap() };
        if !firsts.contains(&name) {
            firsts.push(name);
        }
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    firsts
}

fn header(d: &outbox_rabbitmq::lapin::message::Delivery, name: &str) -> String {
    let headers = d.properties.headers().clone().unwrap_or_default();
    match headers.inner().get(name) {
        Some(AMQPValue::LongString(v)) => String::from_utf8_lossy(v.as_bytes()).into_owned(),
        other => panic!("header {name}: {other:?}"),
    }
}

/// Messages of a RabbitMQ shard-partition reach a queue bound to their exchange in commit
/// order, persistent, with the row's headers and the streamer's, and a message id naming the
/// shard, partition and row; the rows are deleted; the Kafka shard beside it streams on.
#[tokio::test]
async fn postgres_rows_reach_a_bound_queue_in_commit_order_with_their_headers() {
    let w = World::postgres("rmq").shards(2).config(&config()).build().await;
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &w.topic).await;
    let mut consumer = bound_queue(&ch, &w.topic, "k").await;
    let streamer = w.start("streamer.log");
    let mut db = w.db.connect().await;
    const N: usize = 200;
    for chunk in (0..N).collect::<Vec<_>>().chunks(20) {
        let rows: Vec<Row> =
            chunk.iter().map(|i| Row::new(&w.topic, format!("r{i}")).key("k").headers(r#"{"app":"h"}"#)).collect();
        crate::support::pg::PgDb::insert(&mut db, &w.table(1, 0), &rows).await;
    }
    crate::support::pg::PgDb::insert(&mut db, &w.table(0, 0), &[Row::new(&w.topic, "to-kafka").key("k")]).await;
    for i in 0..N {
        let d = tokio::time::timeout(DEADLINE, consumer.next()).await.expect("a message in time").unwrap().unwrap();
        assert_eq!(d.data, format!("r{i}").as_bytes(), "commit order");
        assert_eq!(d.properties.delivery_mode(), &Some(2), "persistent");
        let id = header(&d, "outbox-id");
        assert_eq!(d.properties.message_id().as_ref().map(|m| m.as_str().to_string()), Some(format!("1-0-{id}")));
        assert_eq!(header(&d, "app"), "h", "the row's own header");
        assert_eq!(header(&d, "outbox-shard"), "1");
        assert!(!header(&d, "outbox-lsn").is_empty());
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    w.wait_drained(&w.table(1, 0)).await;
    let kafka_records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(kafka_records.len(), 1, "only shard 0 goes to Kafka");
    assert_eq!(kafka_records[0].payload_str(), "to-kafka");
    assert!(streamer.log_text().contains("sink=\"rabbitmq\""), "the log names the sink");
    let sink = [("source", "test"), ("shard", "1"), ("partition", "0"), ("sink", "rabbitmq")];
    streamer.wait_for_metric("outbox_stream_sink_info", &sink, 1.0, ARRIVAL).await;
    let kafka_sink = [("source", "test"), ("shard", "0"), ("partition", "0"), ("sink", "kafka")];
    streamer.wait_for_metric("outbox_stream_sink_info", &kafka_sink, 1.0, ARRIVAL).await;
    let (_, out, _) = crate::support::streamer::run_cli(&w.config, &["status"]);
    assert!(out.lines().any(|l| l.contains("cdc/rmq") && l.split_whitespace().nth(1) == Some("1")), "status:\n{out}");
    assert!(streamer.stop());
}

/// A row no queue takes comes back (mandatory): the shard-partition halts naming the row and
/// the fix; binding a queue for its routing key is that fix, and the row then goes out, in
/// order. A row for a missing exchange halts until the exchange exists.
#[tokio::test]
async fn postgres_an_unroutable_row_halts_until_a_queue_is_bound_and_a_missing_exchange_until_declared() {
    let w = World::postgres("rmh").shards(2).config(&config()).build().await;
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &w.topic).await;
    let mut first = bound_queue(&ch, &w.topic, "k").await;
    let streamer = w.start("streamer.log");
    let mut db = w.db.connect().await;
    let table = w.table(1, 0);
    let rows =
        [Row::new(&w.topic, "a").key("k"), Row::new(&w.topic, "lost?").key("nobody"), Row::new(&w.topic, "b").key("k")];
    let ids = crate::support::pg::PgDb::insert(&mut db, &table, &rows).await;
    let log = streamer.wait_for_halt(ARRIVAL).await;
    let halt = log.lines().find(|l| l.contains("halted")).unwrap_or_default().to_string();
    assert!(
        halt.contains(&format!("id={}", ids[1])) && halt.contains("NO_ROUTE") && halt.contains("alternate-exchange"),
        "{halt}"
    );
    // The fix the error names.
    let mut second = bound_queue(&ch, &w.topic, "nobody").await;
    let d = tokio::time::timeout(DEADLINE, first.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(d.data, b"a");
    let d2 =
        tokio::time::timeout(DEADLINE, second.next()).await.expect("the returned row after the fix").unwrap().unwrap();
    assert_eq!(d2.data, b"lost?");
    let d3 = tokio::time::timeout(DEADLINE, first.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(d3.data, b"b", "the rest follows");
    w.wait_drained(&table).await;

    let missing = format!("{}-later", w.topic);
    crate::support::pg::PgDb::insert(&mut db, &table, &[Row::new(&missing, "waits").key("k")]).await;
    streamer.wait_for_log("exchange", ARRIVAL).await;
    streamer.wait_for_state("halted", ARRIVAL).await;
    declare_exchange(&ch, &missing).await;
    let mut third = bound_queue(&ch, &missing, "k").await;
    let d4 =
        tokio::time::timeout(DEADLINE, third.next()).await.expect("sent once the exchange exists").unwrap().unwrap();
    assert_eq!(d4.data, b"waits");
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

/// The RabbitMQ client logs a returned message whole; the streamer's log must not carry row
/// data (here: a payload and a header value that appear nowhere else).
#[tokio::test]
async fn postgres_a_returned_message_leaves_no_row_data_in_the_log() {
    let w = World::postgres("rml").shards(2).config(&config()).build().await;
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &w.topic).await;
    let streamer = w.start("streamer.log");
    let mut db = w.db.connect().await;
    let secret = Row::new(&w.topic, "payload-secret-4711").key("nobody").headers(r#"{"h":"header-secret-4712"}"#);
    crate::support::pg::PgDb::insert(&mut db, &w.table(1, 0), &[secret]).await;
    let log = streamer.wait_for_halt(ARRIVAL).await;
    assert!(log.contains("NO_ROUTE"), "{log}");
    assert!(!log.contains("4711") && !log.contains("4712"), "row data in the log:\n{log}");
    // The client's own dump of the message prints the bytes as numbers.
    assert!(!log.contains("BasicReturnMessage") && !log.contains("LongString"), "the message dumped:\n{log}");
    assert!(streamer.stop());
}

/// How RabbitMQ is interrupted while rows flow.
#[derive(Clone, Copy)]
enum Interruption {
    /// SIGKILL, then started again.
    Kill,
    /// SIGSTOP for longer than the confirm timeout, then SIGCONT: connected, silent.
    Freeze,
}

/// RabbitMQ is interrupted while rows flow: the session ends (the connection lost, or a
/// confirm overdue) and resends from the last confirmed row on a new connection, so a durable
/// queue holds every row, first deliveries in commit order (a resend may repeat rows, never
/// reorder them). Interrupting a service is server-wide, so these tests run alone.
async fn broker_interrupted_mid_stream(name: &str, how: Interruption) {
    use crate::support::services;
    const N: usize = 6000;
    let config = format!("{}confirm_timeout_ms = 1500\n", config());
    let w = World::postgres(name).shards(2).config(&config).exclusive().build().await;
    let queue = format!("{}-durable", w.topic);
    {
        let (conn, ch) = channel().await;
        declare_exchange(&ch, &w.topic).await;
        let durable = QueueDeclareOptions { durable: true, ..Default::default() };
        ch.queue_declare(queue.as_str().into(), durable, FieldTable::default()).await.unwrap();
        ch.queue_bind(
            queue.as_str().into(),
            w.topic.as_str().into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        conn.close(200, "declared".into()).await.unwrap();
    }
    let streamer = w.start("streamer.log");
    let table = w.table(1, 0);
    let written = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let writer = {
        let (mut db, table, topic, written) = (w.db.connect().await, table.clone(), w.topic.clone(), written.clone());
        tokio::spawn(async move {
            // A steady load (not a synchronisation): rows keep coming across the interruption.
            let mut pace = tokio::time::interval(Duration::from_millis(10));
            for batch in (0..N).collect::<Vec<_>>().chunks(10) {
                pace.tick().await;
                let rows: Vec<Row> = batch.iter().map(|i| Row::new(&topic, format!("r{i}")).key("k")).collect();
                crate::support::pg::PgDb::insert(&mut db, &table, &rows).await;
                written.fetch_add(rows.len(), std::sync::atomic::Ordering::Relaxed);
            }
        })
    };
    let stream = [("source", "test"), ("shard", "1"), ("partition", "0")];
    streamer.wait_for_metric("outbox_published_records_total", &stream, (N / 10) as f64, ARRIVAL).await;
    match how {
        // Off the runtime's threads: the writer goes on meanwhile.
        Interruption::Kill => {
            tokio::task::spawn_blocking(|| services(&["crash", "rabbitmq"])).await.unwrap();
            assert!(written.load(std::sync::atomic::Ordering::Relaxed) < N, "rows still written while it is down");
            tokio::task::spawn_blocking(|| services(&["up", "rabbitmq"])).await.unwrap();
        }
        Interruption::Freeze => {
            let dir = std::env::var("OUTBOX_SERVICES_DIR").expect("OUTBOX_SERVICES_DIR from scripts/services env");
            let pid = std::fs::read_to_string(format!("{dir}/rabbitmq/pid")).unwrap().trim().to_string();
            let signal =
                |sig: &str| assert!(std::process::Command::new("kill").args([sig, &pid]).status().unwrap().success());
            signal("-STOP");
            streamer.wait_for_log("did not confirm the message within", ARRIVAL).await;
            assert!(written.load(std::sync::atomic::Ordering::Relaxed) < N, "rows still written while it is frozen");
            signal("-CONT");
        }
    }
    writer.await.unwrap();
    w.wait_drained(&table).await;
    let (_conn, ch) = channel().await;
    let mut consumer = ch
        .basic_consume(queue.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let mut firsts: Vec<usize> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut duplicates = 0;
    while seen.len() < N {
        let d = tokio::time::timeout(DEADLINE, consumer.next())
            .await
            .unwrap_or_else(|_| panic!("only {} of {N} rows arrived", seen.len()))
            .unwrap()
            .unwrap();
        let i: usize = String::from_utf8_lossy(&d.data).trim_start_matches('r').parse().unwrap();
        if seen.insert(i) {
            firsts.push(i);
        } else {
            duplicates += 1;
        }
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert!(firsts.windows(2).all(|p| p[0] < p[1]), "first deliveries in commit order");
    let log = streamer.log_text();
    assert!(log.contains("stream interrupted"), "the interruption is reported: {log}");
    eprintln!("rows {N}, duplicated {duplicates}");
    ch.queue_delete(queue.as_str().into(), Default::default()).await.unwrap();
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rabbitmq_killed_mid_stream_loses_nothing_and_keeps_order() {
    broker_interrupted_mid_stream("rmk", Interruption::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rabbitmq_frozen_past_the_confirm_timeout_loses_nothing_and_keeps_order() {
    broker_interrupted_mid_stream("rmf", Interruption::Freeze).await;
}

/// With `on_bad_row = "dead-letter"`, a row that comes back goes to the dead-letter exchange
/// (here a fanout one) with the reason, and the rows after it go on.
#[tokio::test]
async fn postgres_an_unroutable_row_is_dead_lettered_to_an_exchange() {
    let w = World::postgres("rmd").shards(2).config(&config()).build().await;
    let dlq = format!("{}-dlq", w.topic);
    w.edit_config(|text| {
        text.replace(
            "sink = \"rabbitmq\"\n",
            &format!("sink = \"rabbitmq\"\non_bad_row = \"dead-letter\"\ndead_letter_topic = \"{dlq}\"\n"),
        )
    });
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &w.topic).await;
    let mut main = bound_queue(&ch, &w.topic, "k").await;
    let fanout = ExchangeDeclareOptions { durable: true, ..Default::default() };
    ch.exchange_declare(dlq.as_str().into(), ExchangeKind::Fanout, fanout, FieldTable::default()).await.unwrap();
    let mut dead = bound_queue(&ch, &dlq, "any").await;
    let streamer = w.start("streamer.log");
    let mut db = w.db.connect().await;
    let rows = [
        Row::new(&w.topic, "a").key("k"),
        Row::new(&w.topic, "no-queue").key("nobody"),
        Row::new(&w.topic, "b").key("k"),
    ];
    crate::support::pg::PgDb::insert(&mut db, &w.table(1, 0), &rows).await;
    let d = tokio::time::timeout(DEADLINE, dead.next()).await.expect("dead-lettered").unwrap().unwrap();
    assert_eq!(d.data, b"no-queue");
    let reason = header(&d, "outbox-dead-letter-reason");
    assert!(reason.contains("NO_ROUTE"), "{reason}");
    for want in ["a", "b"] {
        let m = tokio::time::timeout(DEADLINE, main.next()).await.unwrap().unwrap().unwrap();
        assert_eq!(m.data, want.as_bytes());
    }
    w.wait_drained(&w.table(1, 0)).await;
    assert!(streamer.stop());
}

/// Every shard-partition of the world to RabbitMQ.
fn config_all() -> String {
    format!("sink = \"rabbitmq\"\nhalt_retry_ms = 200\n\n[rabbitmq]\nurl = \"{}\"\n", rabbit_url())
}

/// Concurrent writers commit and roll back transactions while the streamer is SIGKILLed three
/// times at seeded moments; a durable queue bound to the exchange receives every committed row
/// (duplicates counted by `message_id`), each writer's rows first delivered in commit order,
/// and nothing rolled back.
async fn writers_rollbacks_and_kills<D: Database>(w: World<D>) {
    const WRITERS: usize = 3;
    // Each writer commits or rolls back at least this many transactions, and goes on until the
    // last kill is done, so every kill lands while rows are being written.
    const TXNS: usize = 40;
    let queue = format!("{}-all", w.topic);
    {
        let (conn, ch) = channel().await;
        let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
        ch.exchange_declare(w.topic.as_str().into(), ExchangeKind::Fanout, durable, FieldTable::default())
            .await
            .unwrap();
        let durable = QueueDeclareOptions { durable: true, ..Default::default() };
        ch.queue_declare(queue.as_str().into(), durable, FieldTable::default()).await.unwrap();
        ch.queue_bind(
            queue.as_str().into(),
            w.topic.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        conn.close(200, "declared".into()).await.unwrap();
    }
    let table = w.table(0, 0);
    let killed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for writer in 0..WRITERS {
        let mut conn = w.db.connect().await;
        let (table, topic, killed) = (table.clone(), w.topic.clone(), killed.clone());
        writers.push(tokio::spawn(async move {
            let mut rng = crate::workload::Rng(0x9e37_79b9_7f4a_7c15 ^ (writer as u64 + 1));
            // A steady load across the kills (not a synchronisation).
            let mut pace = tokio::time::interval(Duration::from_millis(30));
            let (mut committed, mut rolled_back, mut n) = (Vec::new(), Vec::new(), 0);
            let mut t = 0;
            while t < TXNS || !killed.load(std::sync::atomic::Ordering::SeqCst) {
                t += 1;
                pace.tick().await;
                let rollback = rng.below(5) == 0;
                D::execute(&mut conn, "BEGIN").await;
                let mut payloads = Vec::new();
                for _ in 0..=rng.below(4) {
                    let payload = if rollback {
                        format!("rb-w{writer}-{t}-{}", payloads.len())
                    } else {
                        format!("w{writer}-{n}")
                    };
                    if !rollback {
                        n += 1;
                    }
                    D::execute(
                        &mut conn,
                        &format!(
                            "INSERT INTO {table} (topic, msg_key, payload) VALUES ('{topic}', 'k{writer}', '{payload}')"
                        ),
                    )
                    .await;
                    payloads.push(payload);
                }
                D::execute(&mut conn, if rollback { "ROLLBACK" } else { "COMMIT" }).await;
                if rollback { rolled_back.extend(payloads) } else { committed.extend(payloads) }
            }
            (committed, rolled_back)
        }));
    }
    let stream = [("source", "test"), ("shard", "0"), ("partition", "0")];
    let mut streamer = w.start("run-0.log");
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for kill in 1..=3 {
        streamer.wait_for_metric("outbox_published_records_total", &stream, 10.0, ARRIVAL).await;
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut at = tokio::time::interval_at(
            tokio::time::Instant::now() + Duration::from_millis(seed % 150),
            Duration::from_secs(1),
        );
        at.tick().await;
        streamer.kill();
        streamer = w.start(&format!("run-{kill}.log"));
    }
    killed.store(true, std::sync::atomic::Ordering::SeqCst);
    let (mut committed, mut rolled_back) = (std::collections::HashSet::new(), std::collections::HashSet::new());
    for writer in writers {
        let (c, r) = writer.await.unwrap();
        committed.extend(c);
        rolled_back.extend(r);
    }
    w.wait_drained(&table).await;
    let (_conn, ch) = channel().await;
    let mut consumer = ch
        .basic_consume(queue.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let (mut seen, mut ids) = (std::collections::HashSet::new(), std::collections::HashMap::<String, usize>::new());
    let mut next = [0usize; WRITERS];
    while seen.len() < committed.len() {
        let d = tokio::time::timeout(DEADLINE, consumer.next())
            .await
            .unwrap_or_else(|_| panic!("{} of {} committed rows arrived", seen.len(), committed.len()))
            .unwrap()
            .unwrap();
        let payload = String::from_utf8(d.data.clone()).unwrap();
        assert!(!rolled_back.contains(&payload), "a rolled-back row arrived: {payload}");
        *ids.entry(d.properties.message_id().as_ref().unwrap().as_str().to_string()).or_default() += 1;
        if seen.insert(payload.clone()) {
            let (writer, n) = payload.trim_start_matches('w').split_once('-').unwrap();
            let (writer, n): (usize, usize) = (writer.parse().unwrap(), n.parse().unwrap());
            assert_eq!(n, next[writer], "writer {writer}'s rows first delivered in commit order");
            next[writer] += 1;
        }
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(seen, committed, "every committed row, nothing else");
    let duplicates: usize = ids.values().map(|n| n - 1).sum();
    eprintln!(
        "{} to RabbitMQ: {} rows, {} rolled back, 3 kills, {duplicates} duplicates",
        D::NAME,
        committed.len(),
        rolled_back.len()
    );
    ch.queue_delete(queue.as_str().into(), Default::default()).await.unwrap();
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_writers_rollbacks_and_kills_reach_rabbitmq_in_order() {
    writers_rollbacks_and_kills(World::postgres("rmw").config(&config_all()).build().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_writers_rollbacks_and_kills_reach_rabbitmq_in_order() {
    writers_rollbacks_and_kills(World::mysql("rmw").config(&config_all()).build().await).await;
}

/// With `on_bad_row = "dead-letter"`, a row for an exchange that does not exist is dead-lettered
/// (the broker closes the channel; the row went alone, so nothing else is held back) and the
/// rows after it go on.
#[tokio::test]
async fn postgres_a_row_for_a_missing_exchange_is_dead_lettered() {
    let w = World::postgres("rme").shards(2).config(&config()).build().await;
    let dlq = format!("{}-dlq", w.topic);
    w.edit_config(|text| {
        text.replace(
            "sink = \"rabbitmq\"\n",
            &format!("sink = \"rabbitmq\"\non_bad_row = \"dead-letter\"\ndead_letter_topic = \"{dlq}\"\n"),
        )
    });
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &w.topic).await;
    let mut main = bound_queue(&ch, &w.topic, "k").await;
    let fanout = ExchangeDeclareOptions { durable: true, ..Default::default() };
    ch.exchange_declare(dlq.as_str().into(), ExchangeKind::Fanout, fanout, FieldTable::default()).await.unwrap();
    let mut dead = bound_queue(&ch, &dlq, "any").await;
    let streamer = w.start("streamer.log");
    let mut db = w.db.connect().await;
    let missing = format!("{}-missing", w.topic);
    let rows =
        [Row::new(&w.topic, "a").key("k"), Row::new(&missing, "nowhere").key("k"), Row::new(&w.topic, "b").key("k")];
    crate::support::pg::PgDb::insert(&mut db, &w.table(1, 0), &rows).await;
    let d = tokio::time::timeout(DEADLINE, dead.next()).await.expect("dead-lettered").unwrap().unwrap();
    assert_eq!(d.data, b"nowhere");
    let reason = header(&d, "outbox-dead-letter-reason");
    assert!(reason.contains("NOT_FOUND"), "{reason}");
    for want in ["a", "b"] {
        let m = tokio::time::timeout(DEADLINE, main.next()).await.unwrap().unwrap().unwrap();
        assert_eq!(m.data, want.as_bytes());
    }
    w.wait_drained(&w.table(1, 0)).await;
    assert!(streamer.stop());
}

/// `amqps://` with `[rabbitmq.tls]`: rows go over TLS verified against the private CA; with a CA
/// that did not sign the broker's certificate the shard-partition retries with an error that
/// says so, and sends nothing.
#[tokio::test]
async fn postgres_rabbitmq_over_tls_verifies_the_broker() {
    let tls_url = std::env::var("OUTBOX_RABBITMQ_TLS_URL").expect("OUTBOX_RABBITMQ_TLS_URL from scripts/services env");
    let dir = std::env::var("OUTBOX_TLS_DIR").expect("OUTBOX_TLS_DIR from scripts/services env");
    let with_ca = |ca: &str| {
        format!(
            "[[source.override]]\nshard = 1\nsink = \"rabbitmq\"\nhalt_retry_ms = 200\n\n[rabbitmq]\nurl = \"{tls_url}\"\n[rabbitmq.tls]\nca_file = \"{dir}/{ca}\"\n"
        )
    };
    let w = World::postgres("rmt").shards(2).config(&with_ca("ca.pem")).build().await;
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &w.topic).await;
    let mut consumer = bound_queue(&ch, &w.topic, "k").await;
    let streamer = w.start("streamer.log");
    let mut db = w.db.connect().await;
    crate::support::pg::PgDb::insert(&mut db, &w.table(1, 0), &[Row::new(&w.topic, "over-tls").key("k")]).await;
    let d = tokio::time::timeout(DEADLINE, consumer.next()).await.expect("over TLS").unwrap().unwrap();
    assert_eq!(d.data, b"over-tls");
    w.wait_drained(&w.table(1, 0)).await;
    assert!(streamer.stop());

    w.edit_config(|text| text.replace(&format!("{dir}/ca.pem"), &format!("{dir}/other-ca.pem")));
    let streamer = w.start("wrong-ca.log");
    crate::support::pg::PgDb::insert(&mut db, &w.table(1, 0), &[Row::new(&w.topic, "never").key("k")]).await;
    let log = streamer.wait_for_log("cannot connect to RabbitMQ", ARRIVAL).await;
    assert!(log.to_lowercase().contains("certificate") || log.contains("UnknownIssuer"), "{log}");
    assert_eq!(w.count(&w.table(1, 0)).await, 1, "nothing sent, nothing deleted");
    assert!(!log.contains(tls_url.split('@').next().unwrap().rsplit(':').next().unwrap()), "no password in the log");
    assert!(streamer.stop());
}

/// With `exchange` set for the shard-partition, every row goes to that exchange and its topic
/// is the routing key (tables whose rows name only a routing key).
#[tokio::test]
async fn postgres_a_fixed_exchange_takes_the_topic_as_the_routing_key() {
    let w = World::postgres("rmx").shards(2).config(&config()).build().await;
    let fixed = format!("{}-fixed", w.topic);
    w.edit_config(|text| {
        text.replace("sink = \"rabbitmq\"\n", &format!("sink = \"rabbitmq\"\nexchange = \"{fixed}\"\n"))
    });
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &fixed).await;
    let mut eu = bound_queue(&ch, &fixed, "orders.eu").await;
    let mut us = bound_queue(&ch, &fixed, "orders.us").await;
    let streamer = w.start("streamer.log");
    let mut db = w.db.connect().await;
    let rows =
        [Row::new("orders.eu", "e1").key("c1"), Row::new("orders.us", "u1").key("c2"), Row::new("orders.eu", "e2")];
    crate::support::pg::PgDb::insert(&mut db, &w.table(1, 0), &rows).await;
    for (queue, want) in [(0, "e1"), (1, "u1"), (0, "e2")] {
        let consumer = if queue == 0 { &mut eu } else { &mut us };
        let d = tokio::time::timeout(DEADLINE, consumer.next()).await.unwrap().unwrap().unwrap();
        assert_eq!(d.data, want.as_bytes());
        assert_eq!(d.exchange.as_str(), fixed);
    }
    w.wait_drained(&w.table(1, 0)).await;
    assert!(streamer.stop());
}

fn rabbitmqctl(args: &[&str]) {
    let ok = std::process::Command::new("scripts/services")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg("rabbitmqctl")
        .args(args)
        .status()
        .expect("scripts/services rabbitmqctl")
        .success();
    assert!(ok, "rabbitmqctl {args:?}");
}

/// A row larger than the broker's `max_message_size` (the broker closes the channel with 406)
/// is a bad row: the halt names that row, not one that travelled with it, and raising the
/// limit clears it; every row then arrives once in order. Changing the broker's limit is
/// server-wide, so this test runs alone.
#[tokio::test]
async fn postgres_a_row_larger_than_the_broker_takes_halts_naming_it() {
    let w = World::postgres("rmb").shards(2).config(&config()).exclusive().build().await;
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &w.topic).await;
    let mut consumer = bound_queue(&ch, &w.topic, "k").await;
    rabbitmqctl(&["eval", "application:set_env(rabbit, max_message_size, 10000)."]);
    let streamer = w.start("streamer.log");
    let mut db = w.db.connect().await;
    let big = "x".repeat(20_000);
    let rows = [
        Row::new(&w.topic, "r0").key("k"),
        Row::new(&w.topic, big.as_str()).key("k"),
        Row::new(&w.topic, "r2").key("k"),
    ];
    let ids = crate::support::pg::PgDb::insert(&mut db, &w.table(1, 0), &rows).await;
    let log = streamer.wait_for_halt(ARRIVAL).await;
    let halt = log.lines().find(|l| l.contains(" halted: ")).unwrap_or_default().to_string();
    assert!(halt.contains(&format!("row id={}", ids[1])) && halt.contains("message size"), "{halt}");
    assert!(halt.contains("max_message_size"), "the fix: {halt}");
    rabbitmqctl(&["eval", "application:set_env(rabbit, max_message_size, 134217728)."]);
    let firsts = first_deliveries(&mut consumer, 3, "all rows once the limit is raised").await;
    assert_eq!(firsts, ["r0", "big", "r2"]);
    w.wait_drained(&w.table(1, 0)).await;
    assert!(streamer.stop());
}

/// A full queue that refuses publishes (`x-overflow = reject-publish`) makes RabbitMQ nack: the
/// stream retries, saying why, and once the queue has room every row arrives, in order.
#[tokio::test]
async fn postgres_a_full_queue_is_retried_with_the_reason_and_loses_nothing() {
    let w = World::postgres("rmfull").shards(2).config(&config()).build().await;
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &w.topic).await;
    let queue = format!("{}-bounded", w.topic);
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(2));
    args.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
    let exclusive = QueueDeclareOptions { exclusive: true, ..Default::default() };
    ch.queue_declare(queue.as_str().into(), exclusive, args).await.unwrap();
    ch.queue_bind(
        queue.as_str().into(),
        w.topic.as_str().into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let streamer = w.start("streamer.log");
    let mut db = w.db.connect().await;
    for i in 0..4 {
        crate::support::pg::PgDb::insert(&mut db, &w.table(1, 0), &[Row::new(&w.topic, format!("r{i}")).key("k")])
            .await;
    }
    let log = streamer.wait_for_log("reject-publish", ARRIVAL).await;
    assert!(log.contains("stream interrupted") && log.contains("nacked"), "{log}");
    let mut consumer = ch
        .basic_consume(queue.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let firsts = first_deliveries(&mut consumer, 4, "every row once there is room").await;
    assert_eq!(firsts, ["r0", "r1", "r2", "r3"]);
    w.wait_drained(&w.table(1, 0)).await;
    assert!(streamer.stop());
}

/// Restores the broker's memory watermark when dropped, also when a test fails.
struct MemoryAlarm;

impl MemoryAlarm {
    fn raise() -> Self {
        rabbitmqctl(&["set_vm_memory_high_watermark", "0.0000001"]);
        MemoryAlarm
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        rabbitmqctl(&["set_vm_memory_high_watermark", "0.4"]);
    }
}

/// Under a memory alarm RabbitMQ blocks publishers: a publish does not even complete. The
/// stream says so within the confirm timeout (instead of stalling without a word) and retries;
/// once the alarm clears every row arrives, in order. The alarm is server-wide, so this test
/// runs alone.
#[tokio::test]
async fn postgres_a_memory_alarm_is_reported_and_loses_nothing() {
    let config = format!("{}confirm_timeout_ms = 1000\n", config());
    let w = World::postgres("rmm").shards(2).config(&config).exclusive().build().await;
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &w.topic).await;
    let mut consumer = bound_queue(&ch, &w.topic, "k").await;
    let streamer = w.start("streamer.log");
    streamer.wait_for_state("streaming", ARRIVAL).await;
    let alarm = MemoryAlarm::raise();
    let mut db = w.db.connect().await;
    for i in 0..5 {
        crate::support::pg::PgDb::insert(&mut db, &w.table(1, 0), &[Row::new(&w.topic, format!("r{i}")).key("k")])
            .await;
    }
    streamer.wait_for_log("blocks publishers", ARRIVAL).await;
    drop(alarm);
    let firsts = first_deliveries(&mut consumer, 5, "every row once the alarm clears").await;
    assert_eq!(firsts, ["r0", "r1", "r2", "r3", "r4"]);
    w.wait_drained(&w.table(1, 0)).await;
    assert!(streamer.stop());
}

/// tw-tkms's table (`layout = "tw-tkms"`) to RabbitMQ: each stored message's topic names the
/// exchange and its key the routing key; its value, its headers in stored order and its
/// explicit timestamp (the AMQP `timestamp`, in seconds) arrive as the application stored
/// them, in commit order, and the rows are deleted.
#[tokio::test]
async fn postgres_tw_tkms_messages_reach_rabbitmq_as_stored() {
    use outbox_tw_tkms::{Compression, StoredMessage, encode};
    let w = World::postgres("rtk")
        .source_keys("layout = \"tw-tkms\"")
        .before_setup("CREATE TABLE {prefix}_0_0 (id BIGSERIAL PRIMARY KEY, message BYTEA NOT NULL)")
        .config(&config_all())
        .build()
        .await;
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &w.topic).await;
    let mut consumer = bound_queue(&ch, &w.topic, "k").await;
    let streamer = w.start("streamer.log");
    let table = format!("{}_0_0", w.prefix);
    const N: u64 = 30;
    let db = w.db.connect().await;
    for n in 0..N {
        let stored = StoredMessage {
            topic: w.topic.clone(),
            partition: None,
            key: Some("k".into()),
            timestamp_ms: Some(1_700_000_000_000 + n * 1000),
            value: format!("m{n}").into_bytes(),
            headers: vec![("h".into(), b"1".to_vec()), ("h".into(), b"2".to_vec())],
            insert_timestamp_ms: None,
        };
        let compression = if n % 2 == 0 { Compression::Gzip } else { Compression::Lz4 };
        let bytes = encode(&stored, compression);
        db.execute(&format!("INSERT INTO {table} (message) VALUES ($1)"), &[&bytes]).await.unwrap();
    }
    for n in 0..N {
        let d = tokio::time::timeout(DEADLINE, consumer.next()).await.expect("a message in time").unwrap().unwrap();
        assert_eq!(d.data, format!("m{n}").as_bytes(), "commit order");
        assert_eq!(d.properties.timestamp(), &Some(1_700_000_000 + n), "the stored timestamp, in seconds");
        let headers = d.properties.headers().clone().unwrap_or_default();
        let both: Vec<AMQPValue> = ["1", "2"].map(|v| AMQPValue::LongString(v.as_bytes().to_vec().into())).into();
        assert_eq!(headers.inner().get("h"), Some(&AMQPValue::FieldArray(both.into())), "a repeated header, in order");
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

/// The message API on a RabbitMQ shard-partition: a message prepared with an exchange and a
/// routing key reaches the queue bound to them once committed; a rolled-back one never does.
#[tokio::test]
async fn postgres_a_message_api_commit_reaches_a_rabbitmq_queue_by_exchange_and_routing_key() {
    use crate::support::api::{self, Client, OTHER_SECRET};
    let listen = crate::support::metrics::free_addr();
    let w = World::postgres("rmq_api").shards(2).config(&config()).config(&api::config(listen, "")).build().await;
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &w.topic).await;
    let mut consumer = bound_queue(&ch, &w.topic, "orders.eu").await;
    let streamer =
        crate::support::streamer::Running::start_with_env(&w.config, &w.dir.join("streamer.log"), &api::env());
    api::wait_until_serving(listen).await;
    let other = Client::new(listen, OTHER_SECRET);
    let message = |text: &str| {
        format!(r#"{{"exchange": "{}", "routing_key": "orders.eu", "payload": {text}, "shard": 1}}"#, w.topic)
    };
    let dropped = other.prepare(&message(r#"{"n": 1}"#)).await;
    let sent = other.prepare(&message(r#"{"n": 2}"#)).await;
    assert_eq!(other.decide(&dropped, "rollback").await.status, 200);
    assert_eq!(other.decide(&sent, "commit").await.status, 200);
    let d = tokio::time::timeout(DEADLINE, consumer.next()).await.expect("a message in time").unwrap().unwrap();
    assert_eq!(d.data, br#"{"n": 2}"#, "only the committed message, as written");
    assert_eq!(d.routing_key.as_str(), "orders.eu");
    assert_eq!(header(&d, "outbox-shard"), "1");
    d.ack(BasicAckOptions::default()).await.unwrap();
    w.wait_drained(&w.table(1, 0)).await;
    assert!(streamer.stop());
}

/// Under ZooKeeper ownership, the owner of a RabbitMQ shard-partition paused (SIGSTOP) past its
/// session while rows flow: the other instance takes the lease, takes the slot from the paused
/// one's backend and publishes; resumed, the paused one loses its session and publishes nothing
/// after the new owner. In the queue's order the `outbox-owner-epoch` header never goes back,
/// every row arrives, and first deliveries keep commit order (docs/rabbitmq.md "Under ZooKeeper
/// coordination", with `heartbeat_s` below half the session timeout as it advises).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_owner_paused_past_its_session_never_publishes_after_the_new_owner() {
    use crate::support::cluster::{Cluster, SESSION_MS, SETTLE, TAKEOVER_MARGIN, Writer};
    let mut c = Cluster::new("zr", 1, 1, false).await;
    let table = c.tables[0].clone();
    let config = c.w.config.with_file_name("rabbitmq.toml");
    let text = std::fs::read_to_string(&c.w.config).expect("config");
    let rabbit = format!(
        "[[source.override]]\nshard = 0\nsink = \"rabbitmq\"\n\n[rabbitmq]\nurl = \"{}\"\nheartbeat_s = 1\n",
        rabbit_url()
    );
    std::fs::write(&config, format!("{text}\n{rabbit}")).expect("write config");
    let (_conn, ch) = channel().await;
    declare_exchange(&ch, &c.w.topic).await;
    let queue = Arrivals::collect(bound_queue(&ch, &c.w.topic, &table).await);

    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    let a = c.start_with(&config);
    let old_epoch = c.wait_for_counts(&[1], SETTLE).await[0].1;
    queue.wait_for_epoch(old_epoch).await;
    let b = c.start_with(&config);
    c.wait_for_counts(&[1, 0], SETTLE).await;

    c.instance(a).run.freeze();
    let new_epoch = c.wait_for_counts(&[0, 1], Duration::from_millis(SESSION_MS) + TAKEOVER_MARGIN).await[0].1;
    assert!(new_epoch > old_epoch, "a new lease has a larger epoch");
    queue.wait_for_epoch(new_epoch).await;
    c.instance(a).run.resume();
    c.instance(a).run.wait_for_metric("outbox_zookeeper_sessions_lost_total", &[], 1.0, SETTLE).await;
    c.wait_for_counts(&[0, 1], SETTLE).await;
    let log = c.instance(b).run.log_text();
    assert!(log.contains("terminating its backend"), "the new owner took the slot from the paused one:\n{log}");

    let sent = writer.finish().await[&table];
    let arrived = queue.until_distinct(sent).await;
    let (mut last_epoch, mut last_first, mut duplicates) = (0i64, 0u64, 0);
    let mut firsts = std::collections::HashSet::new();
    for (i, (n, epoch)) in arrived.iter().enumerate() {
        assert!(*epoch >= last_epoch, "message {i} of the queue (row {n}) has epoch {epoch} after one of {last_epoch}");
        last_epoch = *epoch;
        if firsts.insert(*n) {
            assert!(*n > last_first, "first delivery of row {n} after row {last_first}: out of commit order");
            last_first = *n;
        } else {
            duplicates += 1;
        }
    }
    c.w.wait_drained(&table).await;
    eprintln!("RabbitMQ, owner paused past its session: {sent} rows, {duplicates} duplicates");
}

/// What a queue received, in its order: each message's row number (the payload is
/// `<table>:<n>`) and its `outbox-owner-epoch`; a task consumes and acknowledges meanwhile.
struct Arrivals {
    seen: std::sync::Arc<std::sync::Mutex<Vec<(u64, i64)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Arrivals {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Arrivals {
    fn collect(mut consumer: Consumer) -> Self {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let into = seen.clone();
        let task = tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let payload = String::from_utf8_lossy(&d.data).into_owned();
                let n = payload.rsplit_once(':').and_then(|(_, n)| n.parse().ok()).expect("payload <table>:<n>");
                let epoch = header(&d, "outbox-owner-epoch").parse().expect("numeric epoch");
                into.lock().unwrap().push((n, epoch));
                d.ack(BasicAckOptions::default()).await.expect("ack");
            }
        });
        Self { seen, task }
    }

    async fn wait_for_epoch(&self, epoch: i64) {
        crate::support::wait_until(&format!("a message of epoch {epoch} in the queue"), ARRIVAL, || async {
            self.seen.lock().unwrap().iter().any(|(_, e)| *e == epoch).then_some(())
        })
        .await
    }

    async fn until_distinct(&self, rows: u64) -> Vec<(u64, i64)> {
        crate::support::wait_until(&format!("all {rows} rows in the queue"), ARRIVAL, || async {
            let seen = self.seen.lock().unwrap();
            let distinct: std::collections::HashSet<u64> = seen.iter().map(|(n, _)| *n).collect();
            (distinct.len() as u64 >= rows).then(|| seen.clone())
        })
        .await
    }
}
