//! Kafka publishing for outbox-streamer, through rdkafka (librdkafka built from source).
//!
//! * [`producer`] builds an idempotent producer (`enable.idempotence=true`, `acks=all`,
//!   at most 5 requests in flight, `murmur2_random` so a key lands where the Java client puts
//!   it) and hands records over without waiting for each one; a full local queue is reported
//!   (never dropped) and a delivery report says when there is room again.
//! * [`transaction`] runs Kafka transactions on a producer with a transactional id, and
//!   [`progress`] reads the last committed progress record of a key (exactly-once delivery).
//! * [`classify`] is the one table that says which Kafka errors are worth retrying and which
//!   are definite for the record (too large, unknown or unauthorised topic, bad partition).

pub mod admin;
pub mod classify;
pub mod producer;
pub mod progress;
mod queue_events;
pub mod reader;
pub mod transaction;

pub use classify::{Class, classify};
pub use producer::{Offer, Outgoing, Producer, ProducerSettings};
pub use rdkafka::error::{KafkaError, RDKafkaErrorCode as ErrorCode};
pub use rdkafka::producer::DeliveryFuture;
pub use transaction::{TxnClass, TxnFailure};
