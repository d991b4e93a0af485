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
//! Kafka ([`kafka`]) is the first implementation; nothing outside it names the Kafka client.
//!
//! # Choosing the broker
//!
//! [`Broker`], [`BrokerSettings`], [`broker_settings`], [`open`] and [`close`] are the one place
//! the rest of the streamer gets its sink from. With a second broker, `Broker` becomes an enum
//! over the implementations (each arm delegating to its [`Sink`]) and `open` the one `match`
//! on the configured broker.

use std::error::Error;
use std::fmt;
use std::future::Future;

mod kafka;

pub(crate) use kafka::{Broker, BrokerSettings, broker_settings, close, open};

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
    const NAME: &'static str;

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
