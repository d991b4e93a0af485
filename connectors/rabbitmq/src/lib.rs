//! RabbitMQ publishing for outbox-streamer, through lapin (AMQP 0-9-1, rustls).
//!
//! * [`publisher`] publishes on one channel in confirm mode, every message `mandatory` and
//!   persistent, without waiting for each confirm; at most `confirm_window` messages wait for
//!   theirs (a full window is reported, never waited on inside a call). Confirms are released
//!   in publish order.
//! * [`classify`] says what a failure means: a returned (unroutable) message, a missing
//!   exchange, a refused access, or a connection or channel lost (worth another try).

pub mod classify;
pub mod publisher;

pub use classify::{Class, PublishError};
pub use lapin;
pub use publisher::{Confirm, Message, Offer, Publisher, PublisherSettings};
