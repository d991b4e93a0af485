//! The broker seam: what the streamer loop needs from wherever records go.
//!
//! # Contract
//!
//! * [`Sink::send`] hands one record over without waiting and returns the future of its
//!   acknowledgement, or says why it did not: no room now ([`Offer::Full`] — nothing was
//!   handed over; the loop awaits [`Sink::ready`] as one branch of its `select!`, beside
//!   acknowledgements, timers and shutdown, then offers the record again) or a refusal that is
//!   already the record's verdict ([`Offer::Refused`]).
//! * Records handed over in order to one destination (topic and partition) are acknowledged in
//!   that order or fail; a failure says what it means for the stream ([`Verdict`]). The sink
//!   owns the meaning of its errors: the loop never looks inside them.
//! * A verdict the error alone cannot give ([`Verdict::Unsure`]) is settled by
//!   [`Sink::recheck`], which may ask the broker.
//! * Exactly-once ([`Sink::transactional`]): records are sent between [`Sink::begin`] and
//!   [`Sink::commit`], which writes a progress record last and commits them all atomically, or
//!   [`Sink::abort`]; [`Sink::resume`] reads the last committed progress record before a
//!   session (see [`crate::progress`]). A sink that cannot returns `false` and is never asked.
//!
//! * [`Sink::reset`] is called as a session begins: a sink that refuses records after a failure
//!   (so that none is acknowledged after an earlier one failed) accepts them again.
//!
//! Kafka ([`kafka`]) and RabbitMQ ([`rabbitmq`]) implement it; nothing outside them names their
//! clients.
//!
//! # Choosing the broker
//!
//! [`Broker`], [`BrokerSettings`], [`broker_settings`], [`open`] and [`close`] are the one place
//! the rest of the streamer gets its sink from: `Broker` is an enum over the implementations
//! (each arm delegating to its [`Sink`]) and [`broker_settings`] the one `match` on the
//! shard-partition's `sink` setting.

use std::error::Error;
use std::fmt;
use std::future::Future;

use futures::future::Either;

use crate::config::{SinkKind, StreamSettings};
use crate::db::JobContext;
use crate::streamer::StreamLabels;

mod kafka;
mod rabbitmq;

/// A shard-partition's sink, whichever broker it publishes to.
#[derive(Debug)]
pub(crate) enum Broker {
    Kafka(kafka::KafkaBroker),
    Rabbit(rabbitmq::RabbitBroker),
}

/// What opening a shard-partition's [`Broker`] takes.
#[derive(Debug, Clone)]
pub(crate) enum BrokerSettings {
    Kafka(kafka::KafkaSettings),
    Rabbit(rabbitmq::RabbitSettings),
}

/// The broker settings of one shard-partition, by its `sink` setting.
pub(crate) fn broker_settings(ctx: &JobContext<'_>, s: &StreamSettings, labels: &StreamLabels) -> BrokerSettings {
    match (s.sink, ctx.rabbitmq) {
        (SinkKind::Rabbitmq, Some(base)) => BrokerSettings::Rabbit(rabbitmq::settings(base, s, labels)),
        // Validation requires [rabbitmq] for a RabbitMQ shard-partition.
        _ => BrokerSettings::Kafka(kafka::settings(ctx.kafka, s, labels, ctx.cluster)),
    }
}

/// Opens a shard-partition's sink; an error is definite (the halt's message and fix).
pub(crate) fn open(settings: &BrokerSettings) -> Result<Broker, crate::error::Error> {
    Ok(match settings {
        BrokerSettings::Kafka(s) => Broker::Kafka(kafka::open(s)?),
        BrokerSettings::Rabbit(s) => Broker::Rabbit(rabbitmq::open(s)?),
    })
}

/// Closes a sink, waiting briefly for what it still holds.
pub(crate) async fn close(broker: Broker) {
    match broker {
        Broker::Kafka(b) => kafka::close(b).await,
        Broker::Rabbit(b) => drop(b),
    }
}

impl Broker {
    /// Whether the sink retired itself and must be opened again (a Kafka producer whose
    /// transaction outlived its timeout).
    pub(crate) fn expired(&self) -> bool {
        match self {
            Broker::Kafka(b) => b.expired(),
            Broker::Rabbit(_) => false,
        }
    }
}

/// Delegates every call to the shard-partition's broker.
impl Sink for Broker {
    type Delivery = Either<kafka::KafkaDelivery, rabbitmq::RabbitDelivery>;

    fn name(&self) -> &'static str {
        match self {
            Broker::Kafka(b) => b.name(),
            Broker::Rabbit(b) => b.name(),
        }
    }

    fn send(&self, record: &Outgoing<'_>) -> Result<Self::Delivery, Offer> {
        match self {
            Broker::Kafka(b) => b.send(record).map(Either::Left),
            Broker::Rabbit(b) => b.send(record).map(Either::Right),
        }
    }

    async fn ready(&self) {
        match self {
            Broker::Kafka(b) => b.ready().await,
            Broker::Rabbit(b) => b.ready().await,
        }
    }

    async fn topic_ready(&self, topic: &str) -> Option<bool> {
        match self {
            Broker::Kafka(b) => b.topic_ready(topic).await,
            Broker::Rabbit(b) => b.topic_ready(topic).await,
        }
    }

    async fn recheck(&self, failure: Failure) -> Failure {
        match self {
            Broker::Kafka(b) => b.recheck(failure).await,
            Broker::Rabbit(b) => b.recheck(failure).await,
        }
    }

    fn reset(&self) {
        match self {
            Broker::Kafka(b) => b.reset(),
            Broker::Rabbit(b) => b.reset(),
        }
    }

    fn transactional(&self) -> bool {
        match self {
            Broker::Kafka(b) => b.transactional(),
            Broker::Rabbit(b) => b.transactional(),
        }
    }

    async fn resume(&self) -> Result<Option<Vec<u8>>, crate::error::Error> {
        match self {
            Broker::Kafka(b) => b.resume().await,
            Broker::Rabbit(b) => b.resume().await,
        }
    }

    fn begin(&self) -> Result<(), crate::error::Error> {
        match self {
            Broker::Kafka(b) => b.begin(),
            Broker::Rabbit(b) => b.begin(),
        }
    }

    async fn commit(&self, progress: Vec<u8>) -> Result<(), crate::error::Error> {
        match self {
            Broker::Kafka(b) => b.commit(progress).await,
            Broker::Rabbit(b) => b.commit(progress).await,
        }
    }

    async fn abort(&self) -> Result<(), crate::error::Error> {
        match self {
            Broker::Kafka(b) => b.abort().await,
            Broker::Rabbit(b) => b.abort().await,
        }
    }
}

/// One record to hand over; borrowed from the outbox row and the session.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Outgoing<'a> {
    pub topic: &'a str,
    pub key: Option<&'a [u8]>,
    pub payload: Option<&'a [u8]>,
    /// An explicit partition of the topic, when the row named one.
    pub partition: Option<i32>,
    /// The row's own headers.
    pub headers: &'a [(String, Vec<u8>)],
    /// The streamer's headers, sent after the row's.
    pub stamp: &'a [(&'a str, &'a [u8])],
    /// The record's timestamp (milliseconds) when the row set one.
    pub timestamp_ms: Option<i64>,
}

/// Why [`Sink::send`] did not hand a record over.
#[derive(Debug)]
pub(crate) enum Offer {
    /// No room now: await [`Sink::ready`], then offer the record again.
    Full,
    /// The sink refused the record before sending it; this is its verdict.
    Refused(Failure),
}

/// What a failed record means for the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The broker, the network or the cluster is unhappy: the same record may go through later.
    Transient,
    /// This record can never be published as it is (too large, refused by validation). The
    /// broker may have refused the batch it travelled in, so only a refusal of the record sent
    /// alone is the record's own.
    Record,
    /// Its destination takes no record (not authorised, invalid name, no such partition).
    Destination,
    /// Its topic does not exist.
    MissingTopic,
    /// The error alone does not tell (a topic being created looks like a missing one):
    /// [`Sink::recheck`] decides.
    Unsure,
}

impl Verdict {
    /// Whether the record itself cannot be published as it is.
    pub(crate) fn is_definite(self) -> bool {
        matches!(self, Verdict::Record | Verdict::Destination | Verdict::MissingTopic)
    }
}

/// One record's failure: the sink's verdict, the error and what fixes it.
#[derive(Debug)]
pub(crate) struct Failure {
    pub verdict: Verdict,
    /// The record's topic, for a missing topic (what a halt waits for) and a recheck.
    pub topic: Option<String>,
    pub error: Box<dyn Error + Send + Sync>,
    /// What an operator does about a definite failure.
    pub fix: &'static str,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

/// Where the streamer loop sends records. See the module docs for the contract.
pub(crate) trait Sink: Send + Sync {
    /// The broker's name in messages ("Kafka refused it").
    fn name(&self) -> &'static str;

    /// Resolves when the record is acknowledged, or with its failure.
    type Delivery: Future<Output = Result<(), Failure>> + Send + Unpin + 'static;

    fn send(&self, record: &Outgoing<'_>) -> Result<Self::Delivery, Offer>;

    /// Resolves when there may be room for a record [`Sink::send`] called full (at once when
    /// room was freed since; a spurious wake-up only costs another offer).
    fn ready(&self) -> impl Future<Output = ()> + Send;

    /// Whether the broker shows `topic` ready to take records: `Some(false)` when it is missing
    /// or refused, `None` when the broker cannot say now. Asked before a session's first record
    /// to a topic, so a record bound to fail goes alone.
    fn topic_ready(&self, topic: &str) -> impl Future<Output = Option<bool>> + Send;

    /// Settles a [`Verdict::Unsure`] failure (any other comes back as it is).
    fn recheck(&self, failure: Failure) -> impl Future<Output = Failure> + Send;

    /// A session begins: see the module docs.
    fn reset(&self) {}

    /// Whether this sink delivers exactly once: records go in transactions with a progress
    /// record, and the calls below are used.
    fn transactional(&self) -> bool;

    /// Before a session: makes the sink the only one publishing for the shard-partition (an
    /// earlier owner is fenced and its open transaction aborted), then reads the last committed
    /// progress record's value.
    fn resume(&self) -> impl Future<Output = Result<Option<Vec<u8>>, crate::error::Error>> + Send;

    /// Opens a transaction; records sent until [`Sink::commit`] or [`Sink::abort`] belong to it.
    fn begin(&self) -> Result<(), crate::error::Error>;

    /// Writes `progress` as the transaction's last record and commits it, once every record of
    /// it is acknowledged. A fenced sink's error is [`Error::fenced`]; any other failure leaves
    /// the transaction to abort.
    fn commit(&self, progress: Vec<u8>) -> impl Future<Output = Result<(), crate::error::Error>> + Send;

    /// Aborts the open transaction: none of its records is ever seen by a `read_committed`
    /// consumer.
    fn abort(&self) -> impl Future<Output = Result<(), crate::error::Error>> + Send;
}
