//! A RabbitMQ consumer for a shard-partition with `sink = "rabbitmq"`: declares a durable direct
//! exchange and a queue bound to it for one routing key, then prints the messages it gets
//! (routing key, `message_id`, headers, body) and acknowledges them.
//!
//! ```sh
//! # before the streamer publishes: declare the exchange and the queue
//! OUTBOX_EXAMPLE_AMQP_URL=amqp://user:pw@127.0.0.1:5672/%2f cargo run --example rabbitmq_queue -- declare orders orders-eu eu
//! # then read up to 3 messages (waiting at most 60 s)
//! OUTBOX_EXAMPLE_AMQP_URL=… cargo run --example rabbitmq_queue -- read orders-eu 3
//! ```

use std::time::Duration;

use futures::StreamExt;
use outbox_rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use outbox_rabbitmq::lapin::types::{AMQPValue, FieldTable};
use outbox_rabbitmq::lapin::{Connection, ConnectionProperties, ExchangeKind};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("OUTBOX_EXAMPLE_AMQP_URL").map_err(|_| "set OUTBOX_EXAMPLE_AMQP_URL to an amqp:// URL")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["declare", exchange, queue, routing_key] => {
            let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
            ch.exchange_declare(exchange.into(), ExchangeKind::Direct, durable, FieldTable::default()).await?;
            let durable = QueueDeclareOptions { durable: true, ..Default::default() };
            ch.queue_declare(queue.into(), durable, FieldTable::default()).await?;
            ch.queue_bind(
                queue.into(),
                exchange.into(),
                routing_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
            println!("exchange {exchange} -> queue {queue} for routing key {routing_key}");
        }
        ["read", queue, count] => {
            let count: usize = count.parse()?;
            let mut consumer = ch
                .basic_consume(queue.into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
                .await?;
            for _ in 0..count {
                let Ok(Some(delivery)) = tokio::time::timeout(Duration::from_secs(60), consumer.next()).await else {
                    return Err(format!("no message on {queue} within 60 s").into());
                };
                let d = delivery?;
                let headers: Vec<String> = d
                    .properties
                    .headers()
                    .as_ref()
                    .map(|h| {
                        h.inner()
                            .iter()
                            .map(|(k, v)| match v {
                                AMQPValue::LongString(s) => format!("{k}:{}", String::from_utf8_lossy(s.as_bytes())),
                                other => format!("{k}:{other:?}"),
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let id = d.properties.message_id().as_ref().map_or("", |m| m.as_str()).to_string();
                println!(
                    "{} | message_id {id} | {} | {}",
                    d.routing_key.as_str(),
                    headers.join(", "),
                    String::from_utf8_lossy(&d.data)
                );
                d.ack(BasicAckOptions::default()).await?;
            }
        }
        _ => return Err("usage: rabbitmq_queue declare <exchange> <queue> <routing key> | read <queue> <count>".into()),
    }
    conn.close(200, "done".into()).await?;
    Ok(())
}
