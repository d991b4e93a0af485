//! One slot's replication stream, decoded into the changes an outbox streamer acts on.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent};

use crate::pgoutput::{self, Message, Relation, Value};

/// A change in commit order. Between `Begin` and `Commit` come the inserts of exactly one
/// committed transaction (protocol 1 never streams a transaction in progress).
#[derive(Debug, Clone)]
pub enum Change {
    Begin {
        final_lsn: Lsn,
        xid: u32,
    },
    /// A (re)announced table shape; the stream has already replaced its cache entry.
    Relation(Arc<Relation>),
    Insert {
        relation: Arc<Relation>,
        values: Vec<Value>,
    },
    Commit {
        commit_lsn: Lsn,
        end_lsn: Lsn,
        commit_time_micros: i64,
    },
    /// The server's WAL end while nothing of ours is in this part of the WAL.
    KeepAlive {
        wal_end: Lsn,
    },
    /// A `pg_logical_emit_message` (our heartbeat, a WAL-only outbox message, or anyone's).
    /// A transactional one arrives inside its transaction's `Begin`/`Commit`, and only if
    /// the transaction committed; `lsn` is its own WAL position, unique and stable.
    Message {
        transactional: bool,
        lsn: Lsn,
        prefix: String,
        content: Bytes,
    },
    /// An update, delete or truncate reached us: the publication is not insert-only.
    Unexpected {
        tag: char,
    },
}

/// Why the stream ended.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("replication connection: {0}")]
    Wire(#[from] PgWireError),
    #[error(transparent)]
    Decode(#[from] pgoutput::DecodeError),
    #[error("insert for relation {0} arrived before its Relation message")]
    UnknownRelation(u32),
}

impl StreamError {
    /// True when another session holds the slot (SQLSTATE 55006): another owner is alive.
    pub fn slot_in_use(&self) -> bool {
        self.server_code().is_some_and(|(code, _)| code == "55006")
    }

    /// True when the slot does not exist (SQLSTATE 42704, which a dropped publication also
    /// raises: that one is not a lost position, and only the message tells them apart).
    pub fn slot_missing(&self) -> bool {
        self.server_code().is_some_and(|(code, message)| code == "42704" && !message.contains("publication"))
    }

    /// The server's SQLSTATE and message, when the server answered (see [`split_sqlstate`]).
    pub fn server_code(&self) -> Option<(&str, &str)> {
        self.server_text().and_then(split_sqlstate)
    }

    /// The server's error as pgwire-replication reports it (`message (SQLSTATE xxxxx)`).
    pub fn server_text(&self) -> Option<&str> {
        match self {
            StreamError::Wire(PgWireError::Server(m)) => Some(m),
            _ => None,
        }
    }

    /// Why the client gave up authenticating (no common method, a SCRAM failure).
    pub fn auth_text(&self) -> Option<&str> {
        match self {
            StreamError::Wire(PgWireError::Auth(m)) => Some(m),
            _ => None,
        }
    }

    /// True when the slot can no longer stream: invalidated (`max_slot_wal_keep_size`) or the
    /// WAL it needs already removed.
    pub fn slot_invalidated(&self) -> bool {
        matches!(self, StreamError::Wire(PgWireError::Server(m)) if m.contains("invalidated")
            || m.contains("has already been removed")
            || m.contains("can no longer get changes"))
    }
}

/// Splits pgwire-replication's text of a server error, `message (SQLSTATE xxxxx)`, into the
/// SQLSTATE and the message.
pub fn split_sqlstate(text: &str) -> Option<(&str, &str)> {
    let (message, code) = text.strip_suffix(')')?.rsplit_once(" (SQLSTATE ")?;
    (code.len() == 5).then_some((code, message))
}

/// A started replication session on one slot.
pub struct ReplicationStream {
    client: ReplicationClient,
    relations: HashMap<u32, Arc<Relation>>,
    /// The highest position handed to [`ReplicationStream::confirm`]. The client's own
    /// figure is the last one *sent* to the server (at most once per status interval), which
    /// would leave the newest confirmations out of the slot at close.
    confirmed: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for ReplicationStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationStream").field("relations", &self.relations.len()).finish()
    }
}

impl ReplicationStream {
    /// Connects and starts streaming from the slot's confirmed position.
    pub async fn start(cfg: ReplicationConfig) -> Result<Self, StreamError> {
        let mut client = ReplicationClient::connect(cfg).await?;
        client.wait_started().await?;
        Ok(Self { client, relations: HashMap::new(), confirmed: std::sync::atomic::AtomicU64::new(0) })
    }

    /// The next change; `Ok(None)` when the server ended the stream.
    pub async fn next(&mut self) -> Result<Option<Change>, StreamError> {
        loop {
            let Some(event) = self.client.recv().await? else { return Ok(None) };
            let change = match event {
                ReplicationEvent::Begin { final_lsn, xid, .. } => Change::Begin { final_lsn, xid },
                ReplicationEvent::Commit { lsn, end_lsn, commit_time_micros } => {
                    Change::Commit { commit_lsn: lsn, end_lsn, commit_time_micros }
                }
                ReplicationEvent::KeepAlive { wal_end, .. } => Change::KeepAlive { wal_end },
                ReplicationEvent::Message { transactional, lsn, prefix, content } => {
                    Change::Message { transactional, lsn, prefix, content }
                }
                ReplicationEvent::StoppedAt { .. } => return Ok(None),
                ReplicationEvent::XLogData { data, .. } => match pgoutput::decode(data)? {
                    Message::Relation(rel) => {
                        let rel = Arc::new(rel);
                        self.relations.insert(rel.id, rel.clone());
                        Change::Relation(rel)
                    }
                    Message::Insert { relation_id, values } => {
                        let relation = self
                            .relations
                            .get(&relation_id)
                            .cloned()
                            .ok_or(StreamError::UnknownRelation(relation_id))?;
                        Change::Insert { relation, values }
                    }
                    Message::OtherChange { tag } => Change::Unexpected { tag: tag as char },
                    Message::Ignored { .. } => continue,
                },
            };
            return Ok(Some(change));
        }
    }

    /// Lets the slot forget everything up to `lsn`: call only once every row before it is
    /// published and deleted. Monotonic; reported to the server within the status interval.
    pub fn confirm(&self, lsn: Lsn) {
        self.confirmed.fetch_max(lsn.as_u64(), std::sync::atomic::Ordering::Relaxed);
        self.client.update_applied_lsn(lsn);
    }

    /// The highest position handed to [`confirm`](Self::confirm), sent to the server or not.
    pub fn confirmed(&self) -> Lsn {
        Lsn::from_u64(self.confirmed.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Ends the session cleanly (CopyDone) and waits for the connection to close.
    pub async fn shutdown(mut self) {
        if let Err(e) = self.client.shutdown().await {
            tracing::debug!(error = %e, "replication session ended with an error during shutdown");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(text: &str) -> StreamError {
        StreamError::Wire(PgWireError::Server(text.into()))
    }

    #[test]
    fn the_slot_states_are_read_from_the_sqlstate() {
        assert!(server("replication slot \"s\" is active for PID 7 (SQLSTATE 55006)").slot_in_use());
        assert!(!server("replication slot \"s\" is active for PID 7").slot_in_use(), "no code, no verdict");
        assert!(server("replication slot \"s\" does not exist (SQLSTATE 42704)").slot_missing());
        assert!(!server("publication \"p\" does not exist (SQLSTATE 42704)").slot_missing());
        assert_eq!(split_sqlstate("x (y) (SQLSTATE 08006)"), Some(("08006", "x (y)")));
        assert_eq!(split_sqlstate("unknown server error"), None);
    }
}
