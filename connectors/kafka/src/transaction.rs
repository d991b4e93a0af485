//! Kafka transactions on a [`Producer`] made with a `transactional_id`.
//!
//! # Contract
//!
//! * [`Producer::init_transactions`] once per producer, before anything else: it registers the
//!   transactional id with the cluster, which aborts whatever an earlier producer with the
//!   same id left open and fences that producer (its next call fails with a fatal error).
//! * Then, for every transaction: [`Producer::begin_transaction`], records through
//!   [`Producer::try_send`], [`Producer::commit_transaction`] (every record acknowledged, then
//!   the commit) or [`Producer::abort_transaction`].
//! * A failed call says what it means ([`TxnFailure`]): [`TxnClass::Fatal`] — the producer is
//!   unusable, the id was fenced by a newer producer, never retry with it; [`TxnClass::Abort`]
//!   — abort, then start again from the last committed transaction; [`TxnClass::Retry`] —
//!   the same call may be retried (the cluster was unreachable).
//!
//! The calls block inside librdkafka, so they run on a blocking thread; delivery reports are
//! served meanwhile by the producer's own task.

use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::Producer as _;

use crate::producer::Producer;

/// How long the broker lets a transaction stay open, for records that time out after
/// `message_timeout_ms`: librdkafka requires it to be at least that, and a frozen owner's
/// open transaction is aborted by the broker after it.
pub fn timeout_ms(message_timeout_ms: u64) -> u64 {
    message_timeout_ms.max(10_000) + 5_000
}

/// What a failed transaction call means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnClass {
    /// The producer can no longer be used: fenced by a newer one with its id, or its epoch is
    /// no longer valid. Never retry under this id.
    Fatal,
    /// The transaction must be aborted; the records go again in a new one.
    Abort,
    /// The call may be retried.
    Retry,
}

/// A failed transaction call: the error and its [`TxnClass`].
#[derive(Debug, thiserror::Error)]
#[error("{what}: {error}")]
pub struct TxnFailure {
    pub what: &'static str,
    pub class: TxnClass,
    #[source]
    pub error: KafkaError,
}

impl TxnFailure {
    fn new(what: &'static str, error: KafkaError) -> Self {
        Self { what, class: class_of(&error), error }
    }

    /// Whether the cluster fenced this producer (a newer one took its transactional id).
    pub fn fenced(&self) -> bool {
        matches!(
            self.error.rdkafka_error_code(),
            Some(RDKafkaErrorCode::ProducerFenced | RDKafkaErrorCode::InvalidProducerEpoch | RDKafkaErrorCode::Fenced)
        )
    }
}

fn class_of(error: &KafkaError) -> TxnClass {
    if let KafkaError::Transaction(e) = error {
        if e.is_fatal() {
            return TxnClass::Fatal;
        }
        if e.txn_requires_abort() {
            return TxnClass::Abort;
        }
        if e.is_retriable() {
            return TxnClass::Retry;
        }
    }
    match error.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch
            | RDKafkaErrorCode::Fenced
            | RDKafkaErrorCode::TransactionalIdAuthorizationFailed
            | RDKafkaErrorCode::Fatal,
        ) => TxnClass::Fatal,
        Some(
            RDKafkaErrorCode::OperationTimedOut
            | RDKafkaErrorCode::RequestTimedOut
            | RDKafkaErrorCode::BrokerTransportFailure,
        ) => TxnClass::Retry,
        _ => TxnClass::Abort,
    }
}

impl Producer {
    /// Registers the transactional id (see the module docs); waits up to `timeout`.
    pub async fn init_transactions(&self, timeout: Duration) -> Result<(), TxnFailure> {
        self.blocking("registering the transactional id", move |p| p.init_transactions(timeout)).await
    }

    /// Starts a transaction (a local step: the cluster hears of it with the first record).
    pub fn begin_transaction(&self) -> Result<(), TxnFailure> {
        self.base().producer().begin_transaction().map_err(|e| TxnFailure::new("beginning a Kafka transaction", e))
    }

    /// Waits for every record of the transaction, then commits it; up to `timeout`.
    ///
    /// rdkafka's commit first flushes, and a flush that finds a record in flight polls the
    /// queue in 100 ms windows that always run to their end (this producer's own task serves
    /// the queue): every commit took 100 ms more. So the records' reports are awaited here,
    /// and the flush inside the commit finds nothing left.
    pub async fn commit_transaction(&self, timeout: Duration) -> Result<(), TxnFailure> {
        self.reported(timeout).await;
        self.blocking("committing the Kafka transaction", move |p| p.commit_transaction(timeout)).await
    }

    /// Aborts the open transaction: its records are purged or marked aborted (a
    /// `read_committed` consumer never sees them); up to `timeout`.
    pub async fn abort_transaction(&self, timeout: Duration) -> Result<(), TxnFailure> {
        self.blocking("aborting the Kafka transaction", move |p| p.abort_transaction(timeout)).await
    }

    async fn blocking(
        &self,
        what: &'static str,
        call: impl FnOnce(&rdkafka::producer::BaseProducer<crate::producer::LogContext>) -> Result<(), KafkaError>
        + Send
        + 'static,
    ) -> Result<(), TxnFailure> {
        let base = self.base();
        match tokio::task::spawn_blocking(move || call(base.producer())).await {
            Ok(result) => result.map_err(|e| TxnFailure::new(what, e)),
            Err(_) => Err(TxnFailure { what, class: TxnClass::Abort, error: KafkaError::Canceled }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_errors_are_classified_by_code() {
        let e = |c| KafkaError::MessageProduction(c);
        assert_eq!(class_of(&e(RDKafkaErrorCode::ProducerFenced)), TxnClass::Fatal);
        assert_eq!(class_of(&e(RDKafkaErrorCode::InvalidProducerEpoch)), TxnClass::Fatal);
        assert_eq!(class_of(&e(RDKafkaErrorCode::OperationTimedOut)), TxnClass::Retry);
        assert_eq!(class_of(&e(RDKafkaErrorCode::MessageSizeTooLarge)), TxnClass::Abort);
        assert_eq!(class_of(&KafkaError::Canceled), TxnClass::Abort);
    }

    #[test]
    fn a_transaction_outlives_its_records() {
        assert!(timeout_ms(30_000) > 30_000);
        assert!(timeout_ms(1_000) >= 10_000);
    }
}
