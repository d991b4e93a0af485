//! RabbitMQ as a [`Sink`]: the publisher of `outbox_rabbitmq`, one per shard-partition, and
//! how a record maps onto an AMQP message.
//!
//! | record | AMQP message |
//! |---|---|
//! | topic | the exchange (or, with `exchange` set for the shard-partition, the routing key) |
//! | key | the routing key (empty without one) |
//! | payload | the body |
//! | headers, then the streamer's (`outbox-id`, `outbox-shard`, …) | headers (long strings) |
//! | `<shard>-<partition>-<outbox-id>` | `message_id` (stable across resends: consumers deduplicate by it) |
//! | explicit partition | not used: an exchange has no partitions |
//!
//! Every message is persistent and `mandatory`; the publisher confirm is the acknowledgement.

use futures::FutureExt;
use futures::future::Map;
use outbox_rabbitmq::{Class, Confirm, Message, PublishError, Publisher, PublisherSettings};
use tokio::sync::oneshot::error::RecvError;

use super::{Failure, Offer, Outgoing, Sink, Verdict};
use crate::config::StreamSettings;
use crate::error::Error;
use crate::streamer::StreamLabels;

/// What opening a shard-partition's [`RabbitBroker`] takes.
#[derive(Debug, Clone)]
pub(crate) struct RabbitSettings {
    publisher: PublisherSettings,
    /// The fixed exchange of the shard-partition, if set.
    exchange: Option<String>,
}

/// The shard-partition's settings from the instance's `[rabbitmq]` (resolved once at start).
pub(crate) fn settings(base: &PublisherSettings, s: &StreamSettings, labels: &StreamLabels) -> RabbitSettings {
    let mut publisher = base.clone();
    publisher.connection_name =
        format!("outbox-streamer {} shard {} partition {}", labels.source, labels.id.shard, labels.id.partition);
    RabbitSettings { publisher, exchange: s.exchange.clone() }
}

/// A shard-partition's publisher.
#[derive(Debug)]
pub(crate) struct RabbitBroker {
    publisher: Publisher,
    exchange: Option<String>,
}

/// Starts the publisher (it connects at the first record).
pub(crate) fn open(settings: &RabbitSettings) -> Result<RabbitBroker, Error> {
    Ok(RabbitBroker { publisher: Publisher::new(settings.publisher.clone()), exchange: settings.exchange.clone() })
}

type Report = Result<Result<(), PublishError>, RecvError>;

/// A message's confirm as the loop awaits it.
pub(crate) type RabbitDelivery = Map<Confirm, fn(Report) -> Result<(), Failure>>;

fn settled(report: Report) -> Result<(), Failure> {
    match report {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(failure(e)),
        Err(_) => Err(failure(PublishError {
            class: Class::Transient,
            text: "the publisher's task ended".into(),
            exchange: None,
        })),
    }
}

fn failure(e: PublishError) -> Failure {
    let verdict = match e.class {
        Class::Transient | Class::Rejected => Verdict::Transient,
        Class::Unroutable | Class::AccessRefused => Verdict::Destination,
        Class::NoExchange => Verdict::MissingTopic,
        Class::Message | Class::Unrepresentable => Verdict::Record,
    };
    Failure { verdict, topic: e.exchange.clone(), fix: e.fix(), error: Box::new(e) }
}

fn not_transactional() -> Error {
    Error::definite(
        "a transaction call on a RabbitMQ shard-partition",
        "RabbitMQ shard-partitions deliver at least once; set delivery = \"at-least-once\"",
    )
}

impl Sink for RabbitBroker {
    type Delivery = RabbitDelivery;

    fn name(&self) -> &'static str {
        "RabbitMQ"
    }

    fn send(&self, r: &Outgoing<'_>) -> Result<Self::Delivery, Offer> {
        let key = match r.key.map(std::str::from_utf8).transpose() {
            Ok(key) => key.unwrap_or_default(),
            // AMQP routing keys are text: a key that is not UTF-8 would change on the way.
            Err(_) if self.exchange.is_none() => {
                return Err(Offer::Refused(failure(PublishError {
                    class: Class::Unrepresentable,
                    text: "the row's msg_key is not UTF-8 text, which a RabbitMQ routing key must be".into(),
                    exchange: None,
                })));
            }
            Err(_) => "",
        };
        let (exchange, routing_key) = match &self.exchange {
            Some(exchange) => (exchange.as_str(), r.topic),
            None => (r.topic, key),
        };
        let stamp = |name: &str| r.stamp.iter().find(|(n, _)| *n == name).map(|(_, v)| String::from_utf8_lossy(v));
        let message_id = format!(
            "{}-{}-{}",
            stamp("outbox-shard").unwrap_or_default(),
            stamp("outbox-partition").unwrap_or_default(),
            stamp("outbox-id").unwrap_or_default()
        );
        let headers: Vec<(&str, &[u8])> =
            r.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())).chain(r.stamp.iter().copied()).collect();
        let m = Message {
            exchange,
            routing_key,
            payload: r.payload.unwrap_or_default(),
            message_id: &message_id,
            headers: &headers,
            timestamp_s: r.timestamp_ms.and_then(|ms| u64::try_from(ms / 1000).ok()),
        };
        match self.publisher.send(&m) {
            Ok(confirm) => Ok(confirm.map(settled as fn(Report) -> Result<(), Failure>)),
            Err(outbox_rabbitmq::Offer::Full) => Err(Offer::Full),
            Err(outbox_rabbitmq::Offer::Refused(e)) => Err(Offer::Refused(failure(e))),
        }
    }

    async fn ready(&self) {
        self.publisher.room().await;
    }

    async fn topic_ready(&self, topic: &str) -> Option<bool> {
        let exchange = self.exchange.as_deref().unwrap_or(topic);
        self.publisher.exchange_exists(exchange).await
    }

    async fn recheck(&self, f: Failure) -> Failure {
        f
    }

    fn reset(&self) {
        self.publisher.reset();
    }

    fn transactional(&self) -> bool {
        false
    }

    async fn resume(&self) -> Result<Option<Vec<u8>>, Error> {
        Err(not_transactional())
    }

    fn begin(&self) -> Result<(), Error> {
        Err(not_transactional())
    }

    async fn commit(&self, _progress: Vec<u8>) -> Result<(), Error> {
        Err(not_transactional())
    }

    async fn abort(&self) -> Result<(), Error> {
        Err(not_transactional())
    }
}
