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
//! # Offsets
//!
//! The offset stored with a commit is where the next event starts: the commit event's `log_pos`,
//! or for events unpacked from a transaction payload (whose own `log_pos` is 0) the payload's.

use std::collections::VecDeque;

use mysql_async::Value;
use mysql_async::binlog::events::{Event, EventData, RowsEventData, TableMapEvent};
use mysql_async::binlog::value::BinlogValue;

use crate::gtid::{Flavor, Position, TxnId, parse_mariadb_gtid};

/// MariaDB's GTID event type (not decoded by mysql_common).
const MARIADB_GTID_EVENT: u8 = 0xa2;
/// MySQL's HEARTBEAT_LOG_EVENT_V2 (8.0.26+, not decoded by mysql_common).
const MYSQL_HEARTBEAT_V2: u8 = 0x29;
/// MariaDB GTID flag: the transaction is a single statement without XID.
const FL_STANDALONE: u8 = 1;

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
    current: Option<(TxnId, bool)>,
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
            first_rotate: true,
            pending: VecDeque::new(),
            lag_seconds: 0.0,
        }
    }

    /// The next row of a multi-row event not yet handed out.
    pub fn pop_row(&mut self) -> Option<Vec<(String, Cell)>> {
        self.pending.pop_front()
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

    /// Handles one event; rows go to [`Self::pop_row`], a transaction boundary is returned.
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
                let (gtid, flags) = parse_mariadb_gtid(event.data(), header.server_id())
                    .ok_or_else(|| Malformed("short MariaDB GTID event".into()))?;
                let txn = TxnId::MariaDb(gtid);
                self.current = Some((txn, flags & FL_STANDALONE != 0));
                return Ok(Some(BinlogChange::Begin { txn }));
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
                    let names: Vec<String> = after.columns_ref().iter().map(|c| c.name_str().into_owned()).collect();
                    let values = names.into_iter().enumerate().map(|(i, name)| (name, cell(after.as_ref(i)))).collect();
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

/// `name.000123`: a dot followed by digits at the end.
fn is_binlog_name(name: &[u8]) -> bool {
    match name.iter().rposition(|&b| b == b'.') {
        Some(dot) => dot + 1 < name.len() && name[dot + 1..].iter().all(u8::is_ascii_digit),
        None => false,
    }
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
