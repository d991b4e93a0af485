//! The one error type of a shard-partition's work: what failed, what kind of failure it is,
//! how an operator fixes it, and the cause.
//!
//! Sources, the streamer loop, the catch-up and the runner all return [`Error`]. Its
//! [`Kind`] is the only thing the runner looks at, through the pure [`crate::policy`] table;
//! the message is for the operator and is never parsed. A definite error reads
//! `"{what}; fix: {how}"`; the others read as their context alone. The cause (a server error,
//! a driver error) is kept as the [`std::error::Error::source`], not flattened into text.

use std::fmt;

use crate::dberror::{self, Channel, Classify};

/// What kind of failure an [`Error`] is; [`crate::policy::policy`] maps it to what the runner
/// does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Connection lost, server restarting, a timeout: reconnect with backoff and resume from the
    /// last stored position.
    Transient,
    /// Another session holds the stream's slot (the previous owner closing, a dead one being
    /// removed, or a second instance without coordination): retry with a growing interval.
    Busy,
    /// The stored position is gone (slot dropped or invalidated, binlog purged): the rows still
    /// in the table are sent by a polling catch-up, then streaming resumes from a new position.
    PositionLost,
    /// This instance may no longer own the shard-partition: a newer owner epoch is stored with
    /// the position, or the lease is lost. Nothing more is produced or written.
    Fenced,
    /// The stream cannot go on without an operator: the error says what and how to fix it.
    Definite,
}

/// A failure of a shard-partition's work. See the module docs.
///
/// `pub` only because the public [`crate::poll::PollTable`] names it; everything on it is
/// `pub(crate)`.
#[derive(Debug)]
pub struct Error {
    kind: Kind,
    /// What failed, naming the thing (a row, a slot, a table, a statement).
    context: String,
    /// What the operator does about it; set on definite errors.
    fix: Option<String>,
    /// Set by [`Self::connecting`]: the failure was opening a connection, before any
    /// statement ran, so `status` and `/readyz` can say "database unreachable".
    connecting: bool,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl Error {
    fn new(kind: Kind, context: impl Into<String>) -> Self {
        Self { kind, context: context.into(), fix: None, connecting: false, source: None }
    }

    /// See [`Kind::Transient`].
    pub(crate) fn transient(context: impl Into<String>) -> Self {
        Self::new(Kind::Transient, context)
    }

    /// See [`Kind::Busy`].
    pub(crate) fn busy(context: impl Into<String>) -> Self {
        Self::new(Kind::Busy, context)
    }

    /// See [`Kind::PositionLost`].
    pub(crate) fn position_lost(context: impl Into<String>) -> Self {
        Self::new(Kind::PositionLost, context)
    }

    /// See [`Kind::Fenced`].
    pub(crate) fn fenced(context: impl Into<String>) -> Self {
        Self::new(Kind::Fenced, context)
    }

    /// [`Kind::Fenced`] by the broker rather than by ZooKeeper or a stored epoch: a newer
    /// producer registered the shard-partition's transactional id. `fix` says what to do when
    /// no coordination explains it (a second instance runs the shard-partition).
    pub(crate) fn fenced_by_broker(context: impl Into<String>, fix: impl Into<String>) -> Self {
        Self { fix: Some(fix.into()), ..Self::new(Kind::Fenced, context) }
    }

    /// Whether this is [`Self::fenced_by_broker`].
    pub(crate) fn by_broker(&self) -> bool {
        self.kind == Kind::Fenced && self.fix.is_some()
    }

    /// See [`Kind::Definite`]: `context` says what is wrong, `fix` what to do about it.
    pub(crate) fn definite(context: impl Into<String>, fix: impl Into<String>) -> Self {
        Self { fix: Some(fix.into()), ..Self::new(Kind::Definite, context) }
    }

    /// A failed database call `what` (on an SQL session), classified by the server's code in
    /// [`crate::dberror`]: transient, busy, or definite with the server's message and the fix.
    /// The driver's error is kept as the source.
    pub(crate) fn from_db<E>(what: &str, error: E) -> Self
    where
        E: Classify + std::error::Error + Send + Sync + 'static,
    {
        dberror::classify(what, error, Channel::Sql)
    }

    /// Keeps `cause` as this error's source; the message does not change.
    pub(crate) fn with_source(mut self, cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        self.source = Some(cause.into());
        self
    }

    /// Marks the failure as one of opening a connection (refused, reset, timed out, the
    /// server starting up or shutting down), not of a statement run on an open one.
    pub(crate) fn connecting(mut self) -> Self {
        self.connecting = true;
        self
    }

    /// Whether [`Self::connecting`] marked this error.
    pub(crate) fn while_connecting(&self) -> bool {
        self.connecting
    }

    pub(crate) fn kind(&self) -> Kind {
        self.kind
    }

    /// What failed, without the fix.
    #[cfg(test)]
    pub(crate) fn context(&self) -> &str {
        &self.context
    }

    /// What the operator does about it (definite errors).
    #[cfg(test)]
    pub(crate) fn fix(&self) -> Option<&str> {
        self.fix.as_deref()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.fix {
            Some(fix) => write!(f, "{}; fix: {fix}", self.context),
            None => f.write_str(&self.context),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_definite_error_reads_what_then_the_fix_and_keeps_its_cause() {
        let cause = std::io::Error::other("connection reset");
        let e = Error::definite("row id=7: topic is NULL", "set a topic").with_source(cause);
        assert_eq!(e.to_string(), "row id=7: topic is NULL; fix: set a topic");
        assert_eq!(e.kind(), Kind::Definite);
        let source = std::error::Error::source(&e).expect("the cause is kept");
        assert_eq!(source.to_string(), "connection reset");
    }

    #[test]
    fn other_errors_read_as_their_context() {
        for e in [Error::transient("x"), Error::busy("x"), Error::position_lost("x"), Error::fenced("x")] {
            assert_eq!(e.to_string(), "x", "{:?}", e.kind());
            assert!(e.fix().is_none());
        }
    }
}
