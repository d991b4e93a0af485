//! The source side of a shard-partition: what a database connector must provide.
//!
//! # Contract
//!
//! * [`Source::next`] yields the outbox rows of committed transactions in commit order,
//!   each transaction framed by `Begin` and `Commit`. It yields every row inserted by a
//!   committed transaction — whether or not the row is still in the table (a `TRUNCATE`, an
//!   application `DELETE`, an insert and delete in one transaction) — **except** rows of
//!   transactions this stream already published: after a restart the log replays from the
//!   stored position, and a source skips what its own published-up-to mark (stored in the same
//!   database transaction as the delete) says was sent. No existence check decides; timing
//!   cannot change what is published.
//! * [`Source::finish`] is called with the rows of a *complete prefix* of transactions — every
//!   record acknowledged by Kafka — and the position of the last one. It deletes the rows and
//!   stores the position (and the published-up-to mark) in one step where the database allows;
//!   [`Source::finished`] then moves the log position (slot, replay mark). The finish runs
//!   beside reading (pipelined), one at a time and in order, so the stored position never
//!   passes an undeleted row. Duplicates are possible only for rows acknowledged by Kafka
//!   whose delete had not committed.
//! * The table is the safety net: [`Source::probe`] and [`Source::existing`] let the loop's
//!   sweep find rows the log never carried (a statement-logged session, `sql_log_bin=0`, rows
//!   written before the slot existed) once the stream is past every commit that could hold
//!   them, and [`Source::current_rows`] reads them — and re-reads a row the log carries in a
//!   form that cannot be published, so "fix the row, then restart" works.
//! * [`Source::history`] names the database history the session reads. Row ids and positions
//!   are only meaningful within one history: a standby promoted after it lagged behind gives
//!   the ids of rows it never received to new rows, and its log positions restart below what
//!   the old primary reached. What a session remembers by id or position for the next (rows
//!   to finish, rows Kafka refused, an exactly-once progress record) is dropped when the next
//!   one reads another history — at the price of duplicates, never of a row deleted unsent.
//! * `next` must be cancellation-safe: the streamer polls it in a `select!`.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::dberror::Classify;
use crate::error::Error;
use crate::poll::PolledRow;

/// What a source reports, in commit order.
#[derive(Debug)]
pub(crate) enum SourceEvent<P> {
    /// A transaction starts; `label` is its position as stamped on records (commit LSN, GTID).
    Begin {
        label: String,
    },
    Row(PolledRow),
    Commit(P),
    /// Nothing of this stream is pending at the source up to `P`; confirming it keeps the
    /// server from retaining log written by other tables.
    Idle(P),
    /// A catch-up drain found nothing more to read: the session ends once everything in
    /// flight is acknowledged and deleted.
    Drained,
}

/// The sweep's look at the table: rows at or below an earlier highest id that are still
/// there, the highest id now, and a log position that every commit those reads saw is before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Probe<P> {
    pub candidates: Vec<i64>,
    pub max_id: Option<i64>,
    pub mark: P,
}

/// One shard-partition's change source. See the module docs for the contract.
pub(crate) trait Source: Send {
    /// The resume position: only commit positions are stored, so it is totally ordered.
    type Position: Clone + fmt::Display + Send + Sync + 'static;

    /// The header that carries [`SourceEvent::Begin`]'s label (`outbox-lsn`, `outbox-gtid`).
    const POSITION_HEADER: &'static str;

    /// Whether the loop sweeps the table for rows the log never carried. A source that reads
    /// the table itself (polling) has none to find.
    const SWEEPS: bool = true;

    /// Whether this session sweeps (see [`Self::SWEEPS`]); `false` also for a table whose rows
    /// have no order to probe by (identified by a uuid, see [`crate::row_keys`]).
    fn sweeps(&self) -> bool {
        Self::SWEEPS
    }

    /// The keys behind row ids when the table identifies rows by a key that is not an integer
    /// (see [`crate::row_keys`]): records carry the key as `outbox-id`, and halts name it.
    /// `None` for an integer id.
    fn row_keys(&self) -> Option<crate::row_keys::RowKeys> {
        None
    }

    fn next(&mut self) -> impl Future<Output = Result<Option<SourceEvent<Self::Position>>, Error>> + Send;

    /// Deletes `ids`, then stores `upto`; the future answers the number of rows deleted. It
    /// owns what it needs (a shared SQL session, the statements), so it runs while the loop
    /// goes on reading: the loop starts one finish at a time, in order, and calls
    /// [`Source::finished`] once it succeeded, before starting the next. Other calls
    /// (`current_rows`, `existing`, `probe`) may run meanwhile; a source whose SQL session
    /// cannot serve two at once serialises them. Called again with the same prefix in the
    /// next session when it failed (see [`crate::streamer::StreamMemory`]), before anything is
    /// read: later reads must then skip what `upto` covers.
    fn finish(
        &mut self,
        ids: Arc<[i64]>,
        upto: Self::Position,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'static + use<Self>;

    /// A finish up to `upto` committed: the log position (slot, replay mark) may move past it.
    fn finished(&mut self, upto: Self::Position);

    /// Stores an idle position (see [`SourceEvent::Idle`]); nothing is in flight.
    fn confirm_idle(&mut self, position: Self::Position);

    /// Ends the session, recording the last stored position with the server if it can.
    fn close(self) -> impl Future<Output = ()> + Send;

    /// Which history of the database this session reads (see the module docs): the same text
    /// for the same server before and after a crash or restart, another after a failover
    /// (PostgreSQL: system identifier and timeline; MySQL/MariaDB: `server_id`). Asked once
    /// per session, before anything is read.
    fn history(&mut self) -> impl Future<Output = Result<String, Error>> + Send;

    /// The rows `ids` as the table holds them now, read once the transaction being read is
    /// visible to queries; an id missing from the answer is not in the table.
    fn current_rows(&mut self, ids: &[i64]) -> impl Future<Output = Result<Vec<PolledRow>, Error>> + Send;

    /// Which of `ids` are still in the table, ascending.
    fn existing(&mut self, ids: &[i64]) -> impl Future<Output = Result<Vec<i64>, Error>> + Send;

    /// The sweep's probe (see [`Probe`]): up to `limit` ids at or below `below` (none when
    /// `below` is `None`), then the highest id, then the log's end.
    fn probe(
        &mut self,
        below: Option<i64>,
        limit: usize,
    ) -> impl Future<Output = Result<Probe<Self::Position>, Error>> + Send;

    /// Whether a session that handled everything up to `done` has passed `mark` (both taken
    /// in this session).
    fn reached(done: &Self::Position, mark: &Self::Position) -> bool;

    /// Exactly-once: `position` as a progress record stores it (a text [`Source::begun_within`]
    /// reads back in a later session, on another instance, after a restart). `None` when this
    /// source's positions mean nothing outside their session (polling's batch numbers).
    fn progress_mark(_position: &Self::Position) -> Option<String> {
        None
    }

    /// Exactly-once by rows, for a source whose positions mean nothing outside their session
    /// ([`Source::progress_mark`] is `None`: polling, a catch-up's drain): the position a
    /// finish stores before anything is read. With it, progress records name the ids of the
    /// rows committed Kafka transactions hold, and a session first finishes (deletes) those
    /// an earlier one left. `None` (the default): progress is by position.
    fn before_reading(&self) -> Option<Self::Position> {
        None
    }

    /// Exactly-once: whether the transaction of the last [`SourceEvent::Begin`] that
    /// [`Source::next`] returned is at or before `mark` (from [`Source::progress_mark`]), so
    /// that its records are already in Kafka. Called right after that `Begin`. A mark this
    /// source cannot read is a definite error (its progress record is not this stream's).
    fn begun_within(&self, _mark: &str) -> Result<bool, Error> {
        Ok(false)
    }

    /// Whether an operator said to skip row `id` (or, when its id cannot be read, the rows of
    /// the transaction being read, labelled `label`) with `outbox-streamer skip`. A row id
    /// is skipped only in a transaction that committed before the command ran. With
    /// `message`, `id` is a WAL-only message's identity (its log position), skipped wherever
    /// it appears: it is never reused.
    fn skips(&self, id: Option<i64>, message: bool, label: &str) -> bool;
}

/// The longest one database statement may take before its connection is presumed dead (a
/// silent network path never errors by itself). Large deletes are split into
/// [`DELETE_CHUNK`]-row statements so no healthy statement comes near it.
pub(crate) const STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Rows deleted per statement.
pub(crate) const DELETE_CHUNK: usize = 10_000;

/// Runs one database call under [`STATEMENT_TIMEOUT`]. A timeout is transient (the session
/// restarts from the last stored position); an error is classified ([`Error::from_db`]):
/// a missing grant, say, halts once instead of resending rows with every retry.
pub(crate) async fn within<T, E: Classify + std::error::Error + Send + Sync + 'static>(
    what: &str,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, Error> {
    match tokio::time::timeout(STATEMENT_TIMEOUT, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::from_db(what, e)),
        Err(_) => Err(Error::transient(format!(
            "{what}: no answer within {STATEMENT_TIMEOUT:?}; the connection is presumed dead"
        ))),
    }
}
