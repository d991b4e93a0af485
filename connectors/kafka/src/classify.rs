//! Which Kafka errors are transient (retry with backoff, resend from the last confirmed
//! position) and which are definite for the record (apply the bad-row policy).

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// The two outcomes that matter to the streamer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The broker, network or cluster is unhappy; the same record may go through later.
    Transient,
    /// This record can never be published as it is; retrying would stall the stream forever.
    Definite,
}

/// Classifies an error returned for one record, on enqueue or on delivery.
pub fn classify(err: &KafkaError) -> Class {
    match err.rdkafka_error_code() {
        Some(code) if definite(code) => Class::Definite,
        _ => Class::Transient,
    }
}

fn definite(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::MessageSizeTooLarge          // larger than message.max.bytes (client or broker)
            | C::InvalidMessageSize
            | C::UnknownTopic           // the topic does not exist (auto-creation is off)
            | C::UnknownPartition       // an explicit kafka_partition beyond the topic's count
            | C::InvalidTopic           // a topic name Kafka refuses
            | C::TopicAuthorizationFailed
            | C::InvalidRecord          // refused by the broker's record validation
            | C::PolicyViolation
    )
}

/// Whether a definite error is about the record's topic (or partition) as a whole, so the
/// record is known to be undeliverable without sending it again on its own. The other
/// definite errors (too large, refused by validation) can also come from the batch a record
/// travelled in: the broker refuses a whole batch, and every record of it reports the error.
pub fn about_the_topic(err: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        err.rdkafka_error_code(),
        Some(C::UnknownTopic | C::UnknownPartition | C::InvalidTopic | C::TopicAuthorizationFailed)
    )
}

/// A short operator-facing hint for a definite error.
pub fn hint(err: &KafkaError) -> &'static str {
    use RDKafkaErrorCode as C;
    match err.rdkafka_error_code() {
        Some(C::MessageSizeTooLarge | C::InvalidMessageSize) => {
            "the record is larger than message.max.bytes; shrink the payload, raise the topic's max.message.bytes and the producer's message.max.bytes, or use on_bad_row = \"dead-letter\""
        }
        Some(C::UnknownTopic | C::InvalidTopic) => {
            "the topic does not exist or is not a valid name; create it (auto-creation is off; the stream then resumes by itself), or discard the row with `outbox-streamer skip --id` (a CDC stream sends the record as logged: changing the row in the table does not change it)"
        }
        Some(C::UnknownPartition) => {
            "kafka_partition is beyond the topic's partition count; fix the row or add partitions"
        }
        Some(C::TopicAuthorizationFailed) => {
            "the streamer's Kafka principal may not write this topic; grant WRITE on it"
        }
        _ => "see the Kafka error above",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let e = |c| KafkaError::MessageProduction(c);
        assert_eq!(classify(&e(RDKafkaErrorCode::MessageSizeTooLarge)), Class::Definite);
        assert_eq!(classify(&e(RDKafkaErrorCode::UnknownTopic)), Class::Definite);
        assert_eq!(classify(&e(RDKafkaErrorCode::TopicAuthorizationFailed)), Class::Definite);
        assert_eq!(classify(&e(RDKafkaErrorCode::MessageTimedOut)), Class::Transient);
        assert_eq!(classify(&e(RDKafkaErrorCode::QueueFull)), Class::Transient);
        assert_eq!(classify(&e(RDKafkaErrorCode::NotLeaderForPartition)), Class::Transient);
        assert_eq!(classify(&KafkaError::Canceled), Class::Transient);
        assert!(about_the_topic(&e(RDKafkaErrorCode::UnknownTopic)));
        assert!(!about_the_topic(&e(RDKafkaErrorCode::MessageSizeTooLarge)));
    }
}
