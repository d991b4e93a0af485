//! The source side of a shard-partition: what a database connector must provide.
//!
//! # Contract
//!
//! * [`Source::next`] yields the outbox rows of committed transactions in commit order,
//!   each transaction framed by `Begin` and `Commit`.
//! * [`Source::finish`] is called with the rows of a *complete prefix* of transactions — every
//!   record acknowledged by Kafka — and the position of the last one. It deletes the rows and
//!   only then moves the stored position (slot or checkpoint) to that position. After a crash
//!   the source resumes at the last stored position; rows replayed from there that are no
//!   longer in the table are filtered with [`Source::existing`], so duplicates are possible
//!   only for rows acknowledged by Kafka whose delete had not committed.
//! * `next` must be cancellation-safe: the streamer polls it in a `select!`.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::dberror::{self, Channel, Classify};
use crate::record::{InvalidRow, OutboxRecord};

/// What a source reports, in commit order.
#[derive(Debug)]
pub enum SourceEvent<P> {
    /// A transaction starts; `label` is its position as stamped on records (commit LSN, GTID).
    Begin {
        label: String,
    },
    Row(Result<OutboxRecord, InvalidRow>),
    Commit(P),
    /// Nothing of this stream is pending at the source up to `P`; confirming it keeps the
    /// server from retaining log written by other tables.
    Idle(P),
    /// A catch-up drain found nothing more to read: the session ends once everything in
    /// flight is acknowledged and deleted.
    Drained,
}

/// Why a source stopped.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// Connection lost, server restarting: reconnect with backoff.
    #[error("{0}")]
    Transient(String),
    /// The stream cannot go on without an operator: the message says what and how to fix it.
    #[error("{message}; fix: {fix}")]
    Definite { message: String, fix: String },
    /// The stored position is gone (slot dropped or invalidated, binlog purged): the rows still
    /// in the table are sent by a polling catch-up, then streaming resumes from a new position.
    #[error("{0}")]
    PositionLost(String),
    /// A newer owner epoch is stored with the position: another instance owns the stream.
    #[error("{0}")]
    Fenced(String),
    /// Another session holds the stream's slot (the previous owner closing, a dead one being
    /// removed, or a second instance without coordination): retry with a growing interval.
    #[error("{0}")]
    Busy(String),
}

impl SourceError {
    /// A failed database call `what` (on an SQL session), classified by the server's code in
    /// [`crate::dberror`]: transient, busy, or definite with the server's message and the fix.
    pub fn from_db<E: Classify>(what: &str, error: &E) -> Self {
        dberror::source_error(what, error, Channel::Sql)
    }
}

/// One shard-partition's change source. See the module docs for the contract.
pub trait Source: Send {
    /// The resume position: only commit positions are stored, so it is totally ordered.
    type Position: Clone + fmt::Display + Send + Sync + 'static;

    /// The header that carries [`SourceEvent::Begin`]'s label (`outbox-lsn`, `outbox-gtid`).
    const POSITION_HEADER: &'static str;

    fn next(&mut self) -> impl Future<Output = Result<Option<SourceEvent<Self::Position>>, SourceError>> + Send;

    /// Which of `ids` are still in the table.
    fn existing(&mut self, ids: &[i64]) -> impl Future<Output = Result<Vec<i64>, SourceError>> + Send;

    /// Deletes `ids`, then stores `upto`. Returns the number of rows deleted.
    fn finish(&mut self, ids: Vec<i64>, upto: Self::Position) -> impl Future<Output = Result<u64, SourceError>> + Send;

    /// Stores an idle position (see [`SourceEvent::Idle`]); nothing is in flight.
    fn confirm_idle(&mut self, position: Self::Position);

    /// Ends the session, recording the last stored position with the server if it can.
    fn close(self) -> impl Future<Output = ()> + Send;
}

/// The longest one database statement may take before its connection is presumed dead (a
/// silent network path never errors by itself). Large deletes are split into
/// [`DELETE_CHUNK`]-row statements so no healthy statement comes near it.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Rows deleted per statement.
pub const DELETE_CHUNK: usize = 10_000;

/// Runs one database call under [`STATEMENT_TIMEOUT`]. A timeout is transient (the session
/// restarts from the last stored position); an error is classified ([`SourceError::from_db`]):
/// a missing grant, say, halts once instead of resending rows with every retry.
pub async fn within<T, E: Classify>(what: &str, call: impl Future<Output = Result<T, E>>) -> Result<T, SourceError> {
    match tokio::time::timeout(STATEMENT_TIMEOUT, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(SourceError::from_db(what, &e)),
        Err(_) => Err(SourceError::Transient(format!(
            "{what}: no answer within {STATEMENT_TIMEOUT:?}; the connection is presumed dead"
        ))),
    }
}
