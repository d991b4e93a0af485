//! One shard-partition's binlog session: connect, ask for everything after a position, hand
//! the decoded changes out.
//!
//! # Replication requests
//!
//! ```text
//!  MariaDB  SET @mariadb_slave_capability = 4, @slave_connect_state = '<gtid state>'
//!           COM_BINLOG_DUMP (empty file name)
//!  MySQL    COM_BINLOG_DUMP_GTID with the executed GTID set
//!  either   COM_BINLOG_DUMP <file> <offset>        (the file/offset fallback, no GTID stored)
//!  both     SET @master_heartbeat_period (and MySQL's @source_…): the server speaks that often
//! ```
//!
//! # Error handling
//!
//! A read that sees nothing for three heartbeat periods is a dead connection
//! ([`BinlogError::Timeout`]); a position the server no longer has is [`BinlogError::Purged`].
//! Every other error is the connection's; the caller reconnects.

use std::time::Duration;

use futures::StreamExt;
use mysql_async::prelude::Queryable;
use mysql_async::{BinlogStream, BinlogStreamRequest, Conn, Opts};

pub use crate::decode::{BinlogChange, Cell};
use crate::decode::{Decoder, Malformed};
pub use crate::gtid::{Flavor, Gtid, GtidSet, GtidState, Position, TxnId};
pub use crate::xa::Xid;

#[derive(Debug, thiserror::Error)]
pub enum BinlogError {
    #[error("binlog connection: {0}")]
    Connection(#[from] mysql_async::Error),
    #[error("no binlog event or heartbeat for {0:?}: the connection is presumed dead")]
    Timeout(Duration),
    #[error(
        "the stored binlog position {0} is not in the server's binlog (purged, or a promoted replica that did not log what it replicated)"
    )]
    Purged(String),
    #[error("malformed binlog event: {0}")]
    Malformed(String),
    #[error("the binlog stream ended")]
    Ended,
}

impl From<Malformed> for BinlogError {
    fn from(m: Malformed) -> Self {
        Self::Malformed(m.0)
    }
}

/// Where and what to read.
#[derive(Debug, Clone)]
pub struct BinlogTarget {
    pub opts: Opts,
    pub flavor: Flavor,
    /// Unique among the server's replicas; a second reader with the same id replaces the first.
    pub server_id: u32,
    pub database: String,
    pub table: String,
    pub heartbeat: Duration,
}

/// A started binlog session.
pub struct BinlogReader {
    stream: BinlogStream,
    target: BinlogTarget,
    decoder: Decoder,
    start: Position,
    /// When the server last sent anything: the dead-connection deadline counts from here, not
    /// from each call, because callers may cancel `next` and call it again.
    last_heard: tokio::time::Instant,
}

impl std::fmt::Debug for BinlogReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BinlogReader").field("position", &self.decoder.position().to_string()).finish()
    }
}

impl BinlogReader {
    /// Connects and asks for everything after `position`.
    pub async fn start(target: BinlogTarget, position: Position) -> Result<Self, BinlogError> {
        let mut conn = Conn::new(target.opts.clone()).await?;
        let nanos = target.heartbeat.as_nanos().min(u128::from(u64::MAX)) as u64;
        conn.query_drop(format!("SET @master_heartbeat_period = {nanos}, @source_heartbeat_period = {nanos}")).await?;
        if target.flavor == Flavor::MariaDb {
            conn.query_drop("SET @mariadb_slave_capability = 4").await?;
        }
        let mut request = BinlogStreamRequest::new(target.server_id);
        let sids;
        match &position {
            Position::MariaDb { state, .. } => {
                conn.exec_drop("SET @slave_connect_state = ?", (state.to_string(),)).await?;
                conn.query_drop("SET @slave_gtid_strict_mode = 0, @slave_gtid_ignore_duplicates = 0").await?;
            }
            Position::MySql { set, .. } => {
                sids = set.to_sids();
                request = request.with_gtid().with_gtid_set(sids.iter().cloned());
            }
            Position::File { file, offset } => {
                request = request.with_filename(file.as_bytes()).with_pos(*offset);
            }
        }
        let stream = conn.get_binlog_stream(request).await?;
        let decoder = Decoder::new(target.flavor, &target.database, &target.table, position.clone());
        Ok(Self { stream, target, decoder, start: position, last_heard: tokio::time::Instant::now() })
    }

    /// The next change; heartbeats and other tables' rows are consumed silently.
    /// Cancellation-safe: an event is consumed only in the poll that returns it.
    pub async fn next(&mut self) -> Result<BinlogChange, BinlogError> {
        let timeout = self.target.heartbeat * 3;
        loop {
            if let Some(change) = self.decoder.pop() {
                return Ok(change);
            }
            let event = match tokio::time::timeout_at(self.last_heard + timeout, self.stream.next()).await {
                Err(_) => return Err(BinlogError::Timeout(timeout)),
                Ok(None) => return Err(BinlogError::Ended),
                Ok(Some(Err(e))) => return Err(classify(e, &self.start)),
                Ok(Some(Ok(ev))) => ev,
            };
            self.last_heard = tokio::time::Instant::now();
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let stream = &self.stream;
            if let Some(change) = self.decoder.handle(&event, |id| stream.get_tme(id), now)? {
                return Ok(change);
            }
        }
    }

    /// The position after the last transaction read (prepared or committed).
    pub fn position(&self) -> &Position {
        self.decoder.position()
    }

    /// Seconds behind the server as of the last event read (0 when a heartbeat arrived, which
    /// the server sends only when the reader is caught up).
    pub fn lag_seconds(&self) -> f64 {
        self.decoder.lag_seconds()
    }

    /// Ends the session.
    pub async fn close(self) {
        let _ = self.stream.close().await;
    }
}

fn classify(e: mysql_async::Error, start: &Position) -> BinlogError {
    // ER_MASTER_FATAL_ERROR_READING_BINLOG (1236) covers every fatal binlog read; only its
    // message tells a purged position ("purged required binary logs", "could not find GTID
    // state", "Could not find first log file name in binary log index file") from the others.
    let purged = |m: &str| m.contains("GTID") || m.contains("purged") || m.contains("not find");
    match &e {
        mysql_async::Error::Server(s) if s.code == 1236 && purged(&s.message) => BinlogError::Purged(start.to_string()),
        _ => BinlogError::Connection(e),
    }
}
