//! Where the message API keeps its messages: one table in the API source's database,
//! `<prefix>_api_message`, implemented once per database (`db/<database>/api.rs`).
//!
//! A message is a row from prepare until its decision is older than `keep_decisions_s`. One
//! table rather than a prepared table and a decisions table: a message's idempotency key must
//! stay unique over its whole life, prepared or decided, which two tables could only promise
//! with a lock taken by both paths. A decision clears the row's payload, key and headers, so a
//! decided row is small.
//!
//! # Contract
//!
//! * [`prepare`](MessageStore::prepare) stores a batch in one transaction: all or none. A
//!   message whose (token, idempotency key) exists already is not stored again: its id and
//!   current state are returned with `created: false`.
//! * [`decide`](MessageStore::decide) locks the message's row, and only while it is prepared
//!   turns it into its decision: on commit, in the same transaction, the message becomes a row
//!   of its shard-partition's outbox through `<prefix>_enqueue` (routed to its partition, or
//!   emitted to the WAL for `storage = "wal"`), so it is published by the normal path in commit
//!   order. Two deciders of one message are serialised by the row lock: exactly one decides,
//!   the other sees the decision ([`Decided::Already`] or [`Decided::Conflict`]).
//! * Every call names the token: a message prepared under another token is not found.
//! * [`due`](MessageStore::due), [`checked`](MessageStore::checked) and
//!   [`lead`](MessageStore::lead) serve the check-back ([`super::checkback`]).
//! * Errors are the database's (unreachable, a constraint) and mean "nothing changed": the
//!   caller may retry.

use futures::future::BoxFuture;
use serde::Serialize;

/// A message to prepare, validated ([`super::request`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NewMessage {
    /// The name of the token that prepares it: its owner.
    pub token: String,
    pub idempotency_key: Option<String>,
    pub shard: u32,
    pub topic: String,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    /// A JSON object of string values, as text.
    pub headers: Option<String>,
    pub business_key: Option<String>,
    pub checkback_url: Option<String>,
}

/// Where a message is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum State {
    Prepared,
    Committed,
    RolledBack,
}

impl State {
    /// The value stored in the `state` column (and answered in JSON).
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Prepared => "prepared",
            Self::Committed => "committed",
            Self::RolledBack => "rolled_back",
        }
    }

    /// Reads a stored `state`; an unknown value is an error naming it.
    pub(crate) fn parse(stored: &str) -> anyhow::Result<Self> {
        match stored {
            "prepared" => Ok(Self::Prepared),
            "committed" => Ok(Self::Committed),
            "rolled_back" => Ok(Self::RolledBack),
            other => anyhow::bail!("the message table holds an unknown state {other:?}"),
        }
    }
}

/// What the caller asks of a prepared message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    Commit,
    Rollback,
}

impl Decision {
    /// The state a message is in once this decision is taken.
    pub(crate) fn state(self) -> State {
        match self {
            Self::Commit => State::Committed,
            Self::Rollback => State::RolledBack,
        }
    }
}

/// One prepared (or found) message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Prepared {
    pub id: i64,
    pub state: State,
    /// False when the idempotency key named a message prepared earlier.
    pub created: bool,
}

/// The outcome of [`MessageStore::decide`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decided {
    /// This call took the decision; a commit names the outbox row it wrote (its `outbox-id`).
    Now { outbox_id: Option<i64> },
    /// The message was already in the decision's state (and, committed, in that row).
    Already { outbox_id: Option<i64> },
    /// The message was decided the other way: the state it is in.
    Conflict(State),
    /// No message of this id under this token.
    NotFound,
}

/// What `GET` answers about a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct MessageView {
    #[serde(serialize_with = "id_as_string")]
    pub id: i64,
    pub state: State,
    /// RFC 3339, UTC.
    pub prepared_at: String,
    pub decided_at: Option<String>,
    pub shard: u32,
    pub topic: String,
    pub business_key: Option<String>,
    /// Check-backs made so far.
    pub checks: i32,
}

/// Ids are answered as JSON strings: callers must not do arithmetic on them, and a JSON
/// number above 2^53 loses digits in JavaScript.
pub(crate) fn id_as_string<S: serde::Serializer>(id: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(id)
}

/// A prepared message whose check-back is due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DueMessage {
    pub id: i64,
    pub token: String,
    pub business_key: String,
    pub checkback_url: String,
    /// Check-backs made before this one.
    pub checks: i32,
}

/// What `status` shows of the message table. Counts stop at [`SUMMARY_COUNT_CAP`].
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Summary {
    pub prepared: i64,
    /// Prepared messages the check-back gave up on (left for an operator).
    pub given_up: i64,
    pub committed: i64,
    pub rolled_back: i64,
    /// Check-backs made of the messages still prepared.
    pub checks: i64,
    pub oldest_prepared_s: Option<f64>,
}

/// Each count of a [`Summary`] stops here (shown as this number and `+`).
pub(crate) const SUMMARY_COUNT_CAP: i64 = 1_000_000;

/// See the module docs.
pub(crate) trait MessageStore: Send + Sync {
    /// Stores `messages` as prepared, to be checked back `check_after_s` after now.
    fn prepare<'a>(
        &'a self,
        messages: &'a [NewMessage],
        check_after_s: u64,
    ) -> BoxFuture<'a, anyhow::Result<Vec<Prepared>>>;

    /// Takes `decision` on message `id` of `token`.
    fn decide<'a>(&'a self, token: &'a str, id: i64, decision: Decision) -> BoxFuture<'a, anyhow::Result<Decided>>;

    /// Message `id` of `token`, if there is one.
    fn get<'a>(&'a self, token: &'a str, id: i64) -> BoxFuture<'a, anyhow::Result<Option<MessageView>>>;

    /// Deletes up to `limit` messages decided more than `keep_s` seconds ago; returns how many.
    fn prune(&self, keep_s: u64, limit: u32) -> BoxFuture<'_, anyhow::Result<u64>>;

    /// Seconds since the oldest message still prepared was prepared (none: `None`).
    fn oldest_prepared_age(&self) -> BoxFuture<'_, anyhow::Result<Option<f64>>>;

    /// Up to `limit` prepared messages whose check-back is due, longest due first. Only
    /// messages prepared with a check-back URL ever are.
    fn due(&self, limit: u32) -> BoxFuture<'_, anyhow::Result<Vec<DueMessage>>>;

    /// Counts a check-back of message `id` that decided nothing; while it is still prepared,
    /// it is due again `retry_in_s` from now, or never (`None`: left for an operator).
    fn checked(&self, id: i64, retry_in_s: Option<u64>) -> BoxFuture<'_, anyhow::Result<()>>;

    /// What `status` shows: counts by state (each capped) and the oldest prepared message's age.
    fn summary(&self) -> BoxFuture<'_, anyhow::Result<Summary>>;

    /// Whether this instance runs the check-back: takes the database's lock of the message
    /// table when it is free, and keeps it on a session of its own while that lives. At most
    /// one instance holds it; another takes it over once the holder's session ends.
    fn lead(&self) -> BoxFuture<'_, anyhow::Result<bool>>;
}
