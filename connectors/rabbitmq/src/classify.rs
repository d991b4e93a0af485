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
    /// The broker refuses the message itself (larger than its `max_message_size`).
    Message,
    /// AMQP cannot carry the message as the row gives it: a routing key or a header name longer
    /// than 255 bytes.
    Unrepresentable,
    /// The broker nacked it: a queue it routes to is full and refuses publishes
    /// (`x-overflow = reject-publish`), or the broker failed to store it. Worth another try.
    Rejected,
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
    /// Whether the same message may go through later (the caller resends it).
    pub fn is_transient(&self) -> bool {
        matches!(self.class, Class::Transient | Class::Rejected)
    }

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
                "give the exchange an alternate-exchange (or bind a new queue for this routing key), or correct the row's topic/msg_key; binding a queue that already received later rows puts this row after them"
            }
            Class::NoExchange => "declare the exchange in RabbitMQ (durable), or correct the row's topic",
            Class::AccessRefused => "grant the streamer's RabbitMQ user write permission on the exchange in this vhost",
            Class::Message => "make the message smaller, or raise the broker's max_message_size",
            Class::Unrepresentable => {
                "shorten the row's msg_key (the routing key; the topic with a fixed exchange) or header names to at most 255 bytes"
            }
            Class::Rejected => {
                "a queue bound to the exchange is full and refuses publishes (x-max-length with x-overflow = reject-publish): let its consumers catch up or raise its limit; the stream retries"
            }
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
            // RabbitMQ closes the channel with 406 for a body above max_message_size.
            AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
                if amqp.get_message().as_str().contains("message size") =>
            {
                Class::Message
            }
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
