//! Kafka as a [`Sink`]: the producer of `outbox_kafka`, its settings per shard-partition, and
//! its errors' verdicts.

use std::time::Duration;

use futures::FutureExt;
use futures::future::Map;
use outbox_kafka::classify::{about_the_topic, hint};
use outbox_kafka::producer::{DeliveryFuture, DeliveryResultOwned, topic_of};
use outbox_kafka::{Class, ErrorCode, KafkaError, Producer, ProducerSettings, classify};
use tokio::sync::oneshot::error::RecvError;

use super::{Failure, Offer, Outgoing, Sink, Verdict};
use crate::config::{KafkaConfig, StreamSettings};
use crate::error::Error;
use crate::streamer::StreamLabels;

/// The sink every shard-partition publishes through: one Kafka producer each.
pub(crate) type Broker = Producer;

/// What opening a shard-partition's [`Broker`] takes.
pub(crate) type BrokerSettings = ProducerSettings;

/// The producer settings of one shard-partition: the `[kafka]` section with its stream's
/// overrides, and a client id naming the shard-partition.
pub(crate) fn broker_settings(kafka: &KafkaConfig, s: &StreamSettings, labels: &StreamLabels) -> BrokerSettings {
    ProducerSettings {
        brokers: kafka.brokers.clone(),
        client_id: format!("outbox-streamer-{}-{}-{}", labels.source, labels.id.shard, labels.id.partition),
        compression: s.compression.as_str().into(),
        linger_ms: s.linger_ms,
        message_timeout_ms: kafka.message_timeout_ms,
        properties: kafka.properties.clone(),
    }
}

/// Opens a shard-partition's producer; an error is definite (the halt's message and fix), with
/// the producer's error as its source.
pub(crate) fn open(settings: &BrokerSettings) -> Result<Broker, Error> {
    Producer::new(settings).map_err(|e| {
        Error::definite(
            format!("cannot create the Kafka producer: {e}"),
            "correct the [kafka] settings, then restart (this halt does not clear by itself)",
        )
        .with_source(e)
    })
}

/// Waits (up to 5 s) for what the producer still holds to be acknowledged, then drops it,
/// which purges anything left.
pub(crate) async fn close(broker: Broker) {
    let _ = tokio::task::spawn_blocking(move || broker.flush(Duration::from_secs(5))).await;
}

type Report = Result<DeliveryResultOwned, RecvError>;

impl Sink for Producer {
    const NAME: &'static str = "Kafka";
    // Exactly-once (transactional producers) is not built yet.
    const TRANSACTIONAL: bool = false;
    type Delivery = Map<DeliveryFuture, fn(Report) -> Result<(), Failure>>;

    fn send(&self, r: &Outgoing<'_>) -> Result<Self::Delivery, Offer> {
        let out = outbox_kafka::Outgoing {
            topic: r.topic,
            key: r.key,
            payload: r.payload,
            partition: r.partition,
            headers: r.headers,
            stamp: r.stamp,
        };
        match self.try_send(&out) {
            Ok(delivery) => Ok(delivery.map(settled as fn(Report) -> Result<(), Failure>)),
            Err(outbox_kafka::Offer::Full) => Err(Offer::Full),
            // The topic names what a halt on an unknown topic waits for.
            Err(outbox_kafka::Offer::Refused(e)) => Err(Offer::Refused(failure(e, Some(r.topic.to_string())))),
        }
    }

    async fn ready(&self) {
        self.room().await;
    }

    async fn topic_ready(&self, topic: &str) -> Option<bool> {
        Producer::topic_ready(self, topic).await
    }

    /// librdkafka reports a missing topic either as its own `UnknownTopic` (definite) or, once
    /// the broker answered, as the broker's `UnknownTopicOrPartition`, which is also what a topic
    /// being created or a moving partition looks like. The cluster's metadata decides: a topic
    /// it does not know is missing, anything else is retried.
    async fn recheck(&self, mut f: Failure) -> Failure {
        if f.verdict == Verdict::Unsure {
            let missing = match &f.topic {
                Some(topic) => self.topic_missing(topic).await,
                None => false,
            };
            if missing {
                let e = KafkaError::MessageProduction(ErrorCode::UnknownTopic);
                f.fix = hint(&e);
                f.error = Box::new(e);
                f.verdict = Verdict::MissingTopic;
            } else {
                f.verdict = Verdict::Transient;
            }
        }
        f
    }
}

/// A delivery report as the loop sees it.
fn settled(report: Report) -> Result<(), Failure> {
    match report {
        Ok(Ok(())) => Ok(()),
        Ok(Err((e, message))) => Err(failure(e, Some(topic_of(&message)))),
        // The producer went away before the report: nothing is known about the record.
        Err(_) => Err(failure(KafkaError::Canceled, None)),
    }
}

fn failure(e: KafkaError, topic: Option<String>) -> Failure {
    let verdict = match e.rdkafka_error_code() {
        Some(ErrorCode::UnknownTopic) => Verdict::MissingTopic,
        Some(ErrorCode::UnknownTopicOrPartition) => Verdict::Unsure,
        _ if classify(&e) == Class::Transient => Verdict::Transient,
        _ if about_the_topic(&e) => Verdict::Destination,
        _ => Verdict::Record,
    };
    Failure { verdict, topic, fix: hint(&e), error: Box::new(e) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let v = |c| failure(KafkaError::MessageProduction(c), None).verdict;
        assert_eq!(v(ErrorCode::MessageSizeTooLarge), Verdict::Record);
        assert_eq!(v(ErrorCode::InvalidRecord), Verdict::Record);
        assert_eq!(v(ErrorCode::UnknownTopic), Verdict::MissingTopic);
        assert_eq!(v(ErrorCode::UnknownTopicOrPartition), Verdict::Unsure);
        assert_eq!(v(ErrorCode::TopicAuthorizationFailed), Verdict::Destination);
        assert_eq!(v(ErrorCode::UnknownPartition), Verdict::Destination);
        assert_eq!(v(ErrorCode::MessageTimedOut), Verdict::Transient);
        assert_eq!(v(ErrorCode::NotLeaderForPartition), Verdict::Transient);
        assert_eq!(failure(KafkaError::Canceled, None).verdict, Verdict::Transient);
    }
}
