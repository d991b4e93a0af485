//! Binlog events → outbox changes, for both dialects, without any I/O.
//!
//! # Transactions
//!
//! ```text
//!  MariaDB  GTID(0xa2) · TABLE_MAP · WRITE_ROWS_V1… · XID        (or a standalone statement)
//!  MySQL    GTID(0x21) · QUERY BEGIN · TABLE_MAP · WRITE_ROWS_V2… · XID   (or one DDL QUERY)
//!  MySQL    TRANSACTION_PAYLOAD (zstd) wrapping the same events — unpacked by mysql_async
//! ```
//!
//! A transaction's id is reported at its start ([`BinlogChange::Begin`]), each inserted row of
//! the stream's own table as [`BinlogChange::Insert`] with its values by column name, and its end
//! as [`BinlogChange::Commit`] with the position after it. Rows of other tables are skipped.
//!
//! An XA transaction ends twice (see [`crate::xa`]): its prepare ends with
//! [`BinlogChange::Prepared`] instead of a commit (its rows are reported, and must wait), and
//! its outcome is a transaction of its own that ends with [`BinlogChange::XaOutcome`].
//!
//! A row written by a statement-logged session (`binlog_format=STATEMENT` or `MIXED`) has no
//! row event: the statement is reported as [`BinlogChange::StatementWrite`] so the reader can
//! say so; the row itself is found in the table later (see the core's sweep).
//!
//! # Offsets
//!
//! The offset stored with a commit is where the next event starts: the commit event's `log_pos`,
//! or for events unpacked from a transaction payload (whose own `log_pos` is 0) the payload's.

use std::collections::VecDeque;

use mysql_async::Value;
use mysql_async::binlog::events::{Event, EventData, RowsEventData, TableMapEvent};
use mysql_async::binlog::value::BinlogValue;
use mysql_async::consts::ColumnType;

use crate::gtid::{Flavor, Position, TxnId, parse_mariadb_gtid};
use crate::xa::{self, XaStatement, Xid};

/// MariaDB's GTID event type (not decoded by mysql_common).
const MARIADB_GTID_EVENT: u8 = 0xa2;
/// MySQL's HEARTBEAT_LOG_EVENT_V2 (8.0.26+, not decoded by mysql_common).
const MYSQL_HEARTBEAT_V2: u8 = 0x29;
/// The XA_PREPARE event (both servers).
const XA_PREPARE_EVENT: u8 = 0x26;
/// MariaDB GTID flags: a single statement without XID; a commit id follows the flags; the
/// event opens an XA prepare (the XID follows).
const FL_STANDALONE: u8 = 0x01;
const FL_GROUP_COMMIT_ID: u8 = 0x02;
const FL_PREPARED_XA: u8 = 0x40;

/// A column value of an inserted row.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    Null,
    Bytes(Vec<u8>),
    Int(i64),
    /// A DATETIME/TIMESTAMP as microseconds since the Unix epoch (read as UTC).
    Micros(i64),
    /// Anything else, described for error messages.
    Other(String),
}

/// What the stream reports, in commit order.
#[derive(Debug, Clone, PartialEq)]
pub enum BinlogChange {
    Begin {
        txn: TxnId,
    },
    /// A row inserted into the stream's own table, its values by column name.
    Insert {
        values: Vec<(String, Cell)>,
    },
    /// The transaction ended; `position` is the one to store once it is handled.
    Commit {
        position: Position,
    },
    /// The open transaction is a branch of XA transaction `xid`: its rows that follow are
    /// committed only by a later outcome (or by a one-phase commit, which ends it as `Commit`).
    XaStart {
        xid: Xid,
    },
    /// The open transaction was prepared, not committed; `position` is after its prepare.
    Prepared {
        xid: Xid,
        position: Position,
    },
    /// The open transaction records the outcome of prepared XA transaction `xid`.
    XaOutcome {
        xid: Xid,
        committed: bool,
        position: Position,
    },
    /// A statement in the open transaction writes the stream's table without row events
    /// (statement-based logging); its rows are not in the binlog.
    StatementWrite,
}

/// The decoder could not make sense of an event; the stream cannot go on past it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub String);

/// Turns events into changes for one table, tracking the position.
#[derive(Debug)]
pub struct Decoder {
    flavor: Flavor,
    database: String,
    table: String,
    position: Position,
    /// The open transaction and whether it is a single standalone statement.
    current: Option<(TxnId, bool)>,
    /// A change to hand out before the next event is read.
    queued: Option<BinlogChange>,
    file: String,
    /// The end of the last event read that carried an offset.
    offset: u64,
    first_rotate: bool,
    pending: VecDeque<Vec<(String, Cell)>>,
    lag_seconds: f64,
}

impl Decoder {
    pub fn new(flavor: Flavor, database: &str, table: &str, position: Position) -> Self {
        Self {
            flavor,
            database: database.into(),
            table: table.into(),
            file: position.file().to_string(),
            offset: position.offset(),
            position,
            current: None,
            queued: None,
            first_rotate: true,
            pending: VecDeque::new(),
            lag_seconds: 0.0,
        }
    }

    /// The next change not yet handed out: a queued one first, then rows of a multi-row event.
    pub fn pop(&mut self) -> Option<BinlogChange> {
        self.queued.take().or_else(|| self.pending.pop_front().map(|values| BinlogChange::Insert { values }))
    }

    /// The position after the last commit seen.
    pub fn position(&self) -> &Position {
        &self.position
    }

    /// Seconds behind the server as of the last event (0 after a heartbeat, which the server
    /// sends only when the reader is caught up).
    pub fn lag_seconds(&self) -> f64 {
        self.lag_seconds
    }

    /// Handles one event; rows go to [`Self::pop`], a transaction boundary is returned.
    /// `tme` looks up the table map a rows event refers to.
    pub fn handle<'t>(
        &mut self,
        event: &Event,
        tme: impl Fn(u64) -> Option<&'t TableMapEvent<'static>>,
        now_secs: u64,
    ) -> Result<Option<BinlogChange>, Malformed> {
        let header = event.header();
        if header.timestamp() > 0 {
            self.lag_seconds = now_secs.saturating_sub(u64::from(header.timestamp())) as f64;
        }
        if header.log_pos() > 0 {
            self.offset = u64::from(header.log_pos());
        }
        match header.event_type_raw() {
            MARIADB_GTID_EVENT => {
                let data = event.data();
                let (gtid, flags) = parse_mariadb_gtid(data, header.server_id())
                    .ok_or_else(|| Malformed("short MariaDB GTID event".into()))?;
                let txn = TxnId::MariaDb(gtid);
                self.current = Some((txn, flags & FL_STANDALONE != 0));
                if flags & FL_PREPARED_XA != 0 {
                    let at = if flags & FL_GROUP_COMMIT_ID != 0 { 21 } else { 13 };
                    let xid = data
                        .get(at..)
                        .and_then(Xid::from_gtid_event)
                        .ok_or_else(|| Malformed(format!("GTID event {gtid} of an XA prepare without its XID")))?;
                    self.queued = Some(BinlogChange::XaStart { xid });
                }
                // An outcome (flag 0x80, COMPLETED_XA) names its XID again in the statement that
                // follows, which also says whether it commits: that statement is what is read.
                return Ok(Some(BinlogChange::Begin { txn }));
            }
            XA_PREPARE_EVENT => {
                let xid = Xid::from_prepare_event(event.data())
                    .ok_or_else(|| Malformed("XA_PREPARE event without a readable XID".into()))?;
                let txn = self.current.take().map(|(t, _)| t);
                self.position.advance(txn, &self.file, self.offset);
                return Ok(Some(BinlogChange::Prepared { xid, position: self.position.clone() }));
            }
            MYSQL_HEARTBEAT_V2 => {
                self.lag_seconds = 0.0;
                return Ok(None);
            }
            _ => {}
        }
        let data = event.read_data().map_err(|e| Malformed(e.to_string()))?;
        match data {
            Some(EventData::GtidEvent(g)) => {
                if g.tag().is_some() {
                    return Err(Malformed(
                        "tagged GTID (MySQL 8.4 gtid tags) seen; this version supports untagged GTIDs only".into(),
                    ));
                }
                let txn = TxnId::MySql { sid: g.sid(), gno: g.gno() };
                self.current = Some((txn, false));
                Ok(Some(BinlogChange::Begin { txn }))
            }
            Some(EventData::AnonymousGtidEvent(_)) => {
                self.current = Some((TxnId::Anonymous, false));
                Ok(Some(BinlogChange::Begin { txn: TxnId::Anonymous }))
            }
            Some(EventData::RotateEvent(rotate)) => {
                let name = rotate.name_raw();
                // MariaDB's first (fake) rotate carries the 4 checksum bytes at the end of the
                // name (mysql_async#189); binlog names end in ".<digits>".
                let name = if self.first_rotate
                    && !is_binlog_name(name)
                    && name.len() > 4
                    && is_binlog_name(&name[..name.len() - 4])
                {
                    &name[..name.len() - 4]
                } else {
                    name
                };
                self.first_rotate = false;
                self.file = String::from_utf8_lossy(name).into_owned();
                self.offset = rotate.position();
                Ok(None)
            }
            Some(EventData::RowsEvent(rows)) => {
                if !matches!(rows, RowsEventData::WriteRowsEventV1(_) | RowsEventData::WriteRowsEvent(_)) {
                    return Ok(None);
                }
                let Some(tme) = tme(rows.table_id()) else {
                    return Err(Malformed("rows event without a preceding table map".into()));
                };
                if tme.database_name() != self.database || tme.table_name() != self.table {
                    return Ok(None);
                }
                for row in rows.rows(tme) {
                    let (_, after) = row.map_err(|e| Malformed(e.to_string()))?;
                    let Some(after) = after else { continue };
                    let columns: Vec<(String, ColumnType)> =
                        after.columns_ref().iter().map(|c| (c.name_str().into_owned(), c.column_type())).collect();
                    let values = columns
                        .into_iter()
                        .enumerate()
                        .map(|(i, (name, kind))| (name, logged_cell(kind, after.as_ref(i))))
                        .collect();
                    self.pending.push_back(values);
                }
                Ok(None)
            }
            Some(EventData::XidEvent(_)) => Ok(Some(self.commit())),
            Some(EventData::HeartbeatEvent) => {
                self.lag_seconds = 0.0;
                Ok(None)
            }
            Some(EventData::QueryEvent(q)) => {
                let query = q.query();
                match xa::statement(&query) {
                    Some(XaStatement::Start(xid)) => return Ok(Some(BinlogChange::XaStart { xid })),
                    Some(XaStatement::End) => return Ok(None),
                    Some(XaStatement::Outcome { xid, committed }) => {
                        let txn = self.current.take().map(|(t, _)| t);
                        self.position.advance(txn, &self.file, self.offset);
                        return Ok(Some(BinlogChange::XaOutcome { xid, committed, position: self.position.clone() }));
                    }
                    Some(XaStatement::OnePhaseCommit) => return Ok(Some(self.commit())),
                    None => {}
                }
                let writes_table = q.schema() == self.database.as_str() && writes_table(&query, &self.table);
                let ends = match self.flavor {
                    Flavor::MariaDb => {
                        self.current.is_some_and(|(_, standalone)| standalone) || query.eq_ignore_ascii_case("COMMIT")
                    }
                    // MySQL: BEGIN opens a transaction, savepoints live inside one; any other
                    // statement after a GTID is the transaction (DDL) or its COMMIT.
                    Flavor::MySql => {
                        let q = query.trim_start().to_ascii_uppercase();
                        self.current.is_some()
                            && !(q == "BEGIN" || q.starts_with("SAVEPOINT") || q.starts_with("ROLLBACK TO"))
                    }
                };
                if writes_table {
                    if ends {
                        self.queued = Some(self.commit());
                    }
                    return Ok(Some(BinlogChange::StatementWrite));
                }
                Ok(ends.then(|| self.commit()))
            }
            _ => Ok(None),
        }
    }

    fn commit(&mut self) -> BinlogChange {
        let txn = self.current.take().map(|(t, _)| t);
        self.position.advance(txn, &self.file, self.offset);
        BinlogChange::Commit { position: self.position.clone() }
    }
}

/// Whether a logged statement inserts into `table` (`INSERT`, `REPLACE` or `LOAD DATA` naming
/// it as a whole word, optionally quoted or qualified).
fn writes_table(query: &str, table: &str) -> bool {
    let q = query.trim_start().to_ascii_lowercase();
    if !(q.starts_with("insert") || q.starts_with("replace") || q.starts_with("load")) {
        return false;
    }
    let table = table.to_ascii_lowercase();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '$';
    q.match_indices(&table).any(|(at, _)| {
        let before = q[..at].chars().next_back();
        let after = q[at + table.len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(ident)
    })
}

/// `name.000123`: a dot followed by digits at the end.
fn is_binlog_name(name: &[u8]) -> bool {
    match name.iter().rposition(|&b| b == b'.') {
        Some(dot) => dot + 1 < name.len() && name[dot + 1..].iter().all(u8::is_ascii_digit),
        None => false,
    }
}

/// A logged column value of type `kind` as a [`Cell`]. A `TIMESTAMP` is logged as seconds
/// since the Unix epoch (UTC, whatever the session's or server's time zone), which the
/// binlog decoder hands over as text (`"1700000000.123456"`) or, in the pre-5.6 format, as an
/// integer: it becomes [`Cell::Micros`] like a `DATETIME`.
fn logged_cell(kind: ColumnType, value: Option<&BinlogValue<'_>>) -> Cell {
    match (kind, value) {
        (ColumnType::MYSQL_TYPE_TIMESTAMP2 | ColumnType::MYSQL_TYPE_TIMESTAMP, Some(BinlogValue::Value(v))) => {
            match v {
                Value::Bytes(text) => timestamp_micros(text).map_or_else(|| cell_of(v), Cell::Micros),
                Value::Int(0) => Cell::Null,
                Value::Int(seconds) => Cell::Micros(seconds * 1_000_000),
                _ => cell_of(v),
            }
        }
        _ => cell(value),
    }
}

/// `<seconds>[.<microseconds>]` of a logged `TIMESTAMP` as microseconds since the epoch.
/// The decoder reads the 32 unsigned bits of the seconds as a signed number, so a time after
/// 2038 (MariaDB 11.5+ allows up to 2106) arrives negative and is corrected. The zero
/// timestamp (`0000-00-00 00:00:00`, logged as 0) is no time at all: `None`.
pub(crate) fn timestamp_micros(text: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(text).ok()?;
    let (seconds, fraction) = text.split_once('.').unwrap_or((text, "0"));
    let mut seconds: i64 = seconds.parse().ok()?;
    if seconds < 0 {
        seconds += 1 << 32;
    }
    if !(fraction.len() <= 6 && fraction.bytes().all(|b| b.is_ascii_digit())) {
        return None;
    }
    let micros: i64 = format!("{fraction:0<6}").parse().ok()?;
    (seconds != 0 || micros != 0).then_some(seconds * 1_000_000 + micros)
}

fn cell(value: Option<&BinlogValue<'_>>) -> Cell {
    match value {
        None => Cell::Null,
        Some(BinlogValue::Value(v)) => cell_of(v),
        Some(BinlogValue::Jsonb(j)) => match serde_json_text(j) {
            Some(text) => Cell::Bytes(text.into_bytes()),
            None => Cell::Other(format!("{j:?}")),
        },
        Some(other) => Cell::Other(format!("{other:?}")),
    }
}

/// A column value as a [`Cell`] (also for rows read with SQL, in a UTC session).
pub fn cell_of(value: &Value) -> Cell {
    match value {
        Value::NULL => Cell::Null,
        Value::Bytes(b) => Cell::Bytes(b.clone()),
        Value::Int(i) => Cell::Int(*i),
        Value::UInt(u) => i64::try_from(*u).map_or_else(|_| Cell::Other(format!("unsigned {u}")), Cell::Int),
        Value::Date(y, mo, d, h, mi, s, us) => Cell::Micros(micros_from_parts(*y, *mo, *d, *h, *mi, *s, *us)),
        other => Cell::Other(format!("{other:?}")),
    }
}

/// MySQL logs a JSON column in its binary form; the outbox wants the JSON text.
fn serde_json_text(value: &mysql_async::binlog::jsonb::Value<'_>) -> Option<String> {
    let json: serde_json::Value = value.clone().try_into().ok()?;
    Some(json.to_string())
}

fn micros_from_parts(y: u16, mo: u8, d: u8, h: u8, mi: u8, s: u8, us: u32) -> i64 {
    let (y, mo, d) = (i64::from(y), i64::from(mo), i64::from(d));
    let yy = if mo <= 2 { y - 1 } else { y };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let doy = (153 * ((mo + 9) % 12) + 2) / 5 + d - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    ((days * 86_400 + i64::from(h) * 3600 + i64::from(mi) * 60 + i64::from(s)) * 1_000_000) + i64::from(us)
}

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
