//! The RabbitMQ side of a `--sink rabbitmq` run: the run's exchange and queue, and the
//! checker's consumer of that queue.
//!
//! The exchange is named like the Kafka topic of a Kafka run (the rows' `topic`, so the
//! streamer publishes to it with the row's `msg_key` as the routing key). It is a durable
//! **fanout** exchange, so every routing key the load uses (`w<writer>-k<n>`, `k<n>`, `b<n>`,
//! the warm-up rows' keys) reaches the one durable queue bound to it, and nothing comes back
//! unroutable. The checker consumes that queue with automatic acknowledgement: a delivery
//! counts when the consumer returns it, as a Kafka record counts when the consumer's poll
//! returns it. Exchange and queue are deleted at the end of the run.

use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use outbox_rabbitmq::lapin::options::{
    BasicConsumeOptions, BasicQosOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use outbox_rabbitmq::lapin::types::{AMQPValue, FieldTable};
use outbox_rabbitmq::lapin::{Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};

use crate::check::{Record, RecordSource};

/// The URL without its password, for messages.
pub(crate) fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return "(not a URL)".into() };
    let Some((userinfo, host)) = rest.rsplit_once('@') else { return url.into() };
    let user = userinfo.split(':').next().unwrap_or_default();
    format!("{scheme}://{user}:***@{host}")
}

/// The run's exchange and queue (both named `name`), declared by the bench's own connection.
pub(crate) struct RunQueue {
    connection: Connection,
    channel: Channel,
    pub name: String,
}

impl std::fmt::Debug for RunQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunQueue").field("name", &self.name).finish_non_exhaustive()
    }
}

async fn connect(url: &str, name: &str) -> anyhow::Result<Connection> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(url, properties).await.with_context(|| format!("connecting to RabbitMQ at {}", redacted(url)))
}

impl RunQueue {
    /// Declares a durable fanout exchange `name` and a durable queue `name` bound to it.
    pub(crate) async fn declare(url: &str, name: &str) -> anyhow::Result<Self> {
        let connection = connect(url, &format!("outbox-bench {name}")).await?;
        let channel = connection.create_channel().await?;
        let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
        channel
            .exchange_declare(name.into(), ExchangeKind::Fanout, durable, FieldTable::default())
            .await
            .with_context(|| format!("declaring the exchange {name}"))?;
        let durable = QueueDeclareOptions { durable: true, ..Default::default() };
        channel
            .queue_declare(name.into(), durable, FieldTable::default())
            .await
            .with_context(|| format!("declaring the queue {name}"))?;
        channel
            .queue_bind(name.into(), name.into(), "".into(), QueueBindOptions::default(), FieldTable::default())
            .await
            .with_context(|| format!("binding the queue {name} to its exchange"))?;
        Ok(Self { connection, channel, name: name.to_string() })
    }

    /// Deletes the queue and the exchange, and closes the connection.
    pub(crate) async fn delete(self) -> anyhow::Result<()> {
        let name = self.name.as_str();
        self.channel.queue_delete(name.into(), QueueDeleteOptions::default()).await?;
        self.channel.exchange_delete(name.into(), ExchangeDeleteOptions::default()).await?;
        let _ = self.connection.close(200, "bench run done".into()).await;
        Ok(())
    }
}

/// Messages the broker may push to the checker ahead of it (its deliveries are acknowledged
/// automatically, so this only bounds what one consumer holds in memory, not the rate).
const PREFETCH: u16 = 10_000;

/// The checker's consumer of the run's queue, made on the bench's runtime and polled on the
/// checker's thread (lapin reads the socket on its own I/O thread; the consumer is a channel).
pub(crate) struct QueueReader {
    _connection: Connection,
    consumer: Consumer,
    /// A runtime of the checker's thread for the timed waits, built there at the first poll.
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for QueueReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueReader").finish_non_exhaustive()
    }
}

impl QueueReader {
    pub(crate) async fn new(url: &str, queue: &str) -> anyhow::Result<Self> {
        let connection = connect(url, &format!("outbox-bench checker {queue}")).await?;
        let channel = connection.create_channel().await?;
        channel.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
        let no_ack = BasicConsumeOptions { no_ack: true, ..Default::default() };
        let consumer = channel
            .basic_consume(queue.into(), "outbox-bench-checker".into(), no_ack, FieldTable::default())
            .await
            .with_context(|| format!("consuming the queue {queue}"))?;
        Ok(Self { _connection: connection, consumer, runtime: None })
    }
}

impl RecordSource for QueueReader {
    fn poll(&mut self, wait: Duration) -> anyhow::Result<Option<Record>> {
        if self.runtime.is_none() {
            self.runtime = Some(tokio::runtime::Builder::new_current_thread().enable_time().build()?);
        }
        let runtime = self.runtime.as_ref().expect("built above");
        let next = runtime.block_on(async { tokio::time::timeout(wait, self.consumer.next()).await });
        let delivery = match next {
            Err(_) => return Ok(None),
            Ok(None) => anyhow::bail!("the broker cancelled the checker's consumer"),
            Ok(Some(delivery)) => delivery.context("the checker's consumer")?,
        };
        let outbox_id = delivery.properties.headers().as_ref().and_then(|h| match h.inner().get("outbox-id") {
            Some(AMQPValue::LongString(v)) => std::str::from_utf8(v.as_bytes()).ok()?.parse().ok(),
            _ => None,
        });
        // The routing key is the row's `msg_key` (every bench row has one).
        let key = delivery.routing_key.as_str();
        Ok(Some(Record { key: (!key.is_empty()).then(|| key.as_bytes().to_vec()), outbox_id }))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redacted_urls_show_no_password() {
        assert_eq!(super::redacted("amqp://outbox:s3cret@127.0.0.1:5672/%2f"), "amqp://outbox:***@127.0.0.1:5672/%2f");
        assert_eq!(super::redacted("amqp://127.0.0.1/%2f"), "amqp://127.0.0.1/%2f");
    }
}
