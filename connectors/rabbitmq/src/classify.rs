//! What a failed publish means for the stream.

use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::{Error, ErrorKind};

/// How a failure bears on the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The connection, the channel or the broker: the same message may go through later.
    Transient,
    /// The message was returned: no queue is bound to its exchange for its routing key.
    Unroutable,
    /// Its exchange does not exist.
    NoExchange,
    /// The login may not publish to its exchange.
    AccessRefused,
    /// The broker refuses the message itself (larger than the broker takes).
    Message,
}

/// A failed publish: its class and the broker's or the client's words.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{text}")]
pub struct PublishError {
    pub class: Class,
    pub text: String,
    /// The exchange of a [`Class::NoExchange`] failure.
    pub exchange: Option<String>,
}

impl PublishError {
    pub(crate) fn transient(text: impl Into<String>) -> Self {
        Self { class: Class::Transient, text: text.into(), exchange: None }
    }

    /// Names `exchange` in a [`Class::NoExchange`] failure.
    pub(crate) fn of_exchange(mut self, exchange: String) -> Self {
        if self.class == Class::NoExchange {
            self.exchange = Some(exchange);
        }
        self
    }

    /// What an operator does about it.
    pub fn fix(&self) -> &'static str {
        match self.class {
            Class::Transient => {
                "check that RabbitMQ is up and reachable; the stream resends from its last confirmed position"
            }
            Class::Unroutable => {
                "bind a queue to the exchange for this routing key (or give the exchange an alternate-exchange), or correct the row's topic/msg_key"
            }
            Class::NoExchange => "declare the exchange in RabbitMQ (durable), or correct the row's topic",
            Class::AccessRefused => "grant the streamer's RabbitMQ user write permission on the exchange in this vhost",
            Class::Message => "make the message smaller, or raise the broker's max_message_size",
        }
    }
}

/// The class of a client error: a channel closed by the broker for a reason about the
/// message's destination is definite, anything else transient.
pub fn classify(e: &Error) -> Class {
    match e.kind() {
        ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => Class::NoExchange,
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => Class::AccessRefused,
            AMQPErrorKind::Soft(AMQPSoftError::CONTENTTOOLARGE) => Class::Message,
            _ => Class::Transient,
        },
        _ => Class::Transient,
    }
}

impl From<&Error> for PublishError {
    fn from(e: &Error) -> Self {
        Self { class: classify(e), text: e.to_string(), exchange: None }
    }
}
