//! RabbitMQ as a shard-partition's destination, against the real RabbitMQ of
//! `scripts/services up` (`OUTBOX_RABBITMQ_URL`): commit order into a bound queue, the mapping
//! of a row onto an AMQP message, rows deleted only once confirmed, a Kafka shard beside it,
//! and the halts a returned message or a missing exchange cause, each cleared by its fix.

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
        halt.contains(&format!("id={}", ids[1])) && halt.contains("NO_ROUTE") && halt.contains("bind a queue"),
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

/// RabbitMQ is killed (SIGKILL) and started again while rows flow: the session ends on the
/// lost connection and resends from the last confirmed row, so a durable queue holds every
/// row, first deliveries in commit order (a resend may repeat rows, never reorder them).
/// Stopping a service is server-wide, so this test runs alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rabbitmq_killed_mid_stream_loses_nothing_and_keeps_order() {
    use crate::support::services;
    const N: usize = 6000;
    let w = World::postgres("rmk").shards(2).config(&config()).exclusive().build().await;
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
            // A steady load (not a synchronisation): rows keep coming across the kill.
            let mut pace = tokio::time::interval(Duration::from_millis(10));
            for batch in (0..N).collect::<Vec<_>>().chunks(10) {
                pace.tick().await;
                let rows: Vec<Row> = batch.iter().map(|i| Row::new(&topic, format!("r{i}")).key("k")).collect();
                crate::support::pg::PgDb::insert(&mut db, &table, &rows).await;
                written.fetch_add(rows.len(), std::sync::atomic::Ordering::Relaxed);
            }
        })
    };
    // Killed while records are in flight, started again while rows are still written.
    let stream = [("source", "test"), ("shard", "1"), ("partition", "0")];
    streamer.wait_for_metric("outbox_published_records_total", &stream, (N / 10) as f64, ARRIVAL).await;
    // Off the runtime's threads: the writer goes on meanwhile.
    tokio::task::spawn_blocking(|| {
        services(&["crash", "rabbitmq"]);
        services(&["up", "rabbitmq"]);
    })
    .await
    .unwrap();
    assert!(written.load(std::sync::atomic::Ordering::Relaxed) < N, "rows still being written after the restart");
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
    assert!(log.contains("RabbitMQ"), "the interruption is reported: {log}");
    eprintln!("rows {N}, duplicated {duplicates}");
    ch.queue_delete(queue.as_str().into(), Default::default()).await.unwrap();
    assert!(streamer.stop());
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
