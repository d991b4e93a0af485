//! XA transactions between their prepare and their outcome.
//!
//! A prepared XA transaction is not committed: its rows must not be published, and must not
//! be lost either, because its `XA COMMIT` may come much later — after other transactions were
//! published and their position stored, or after a restart. So the rows of a prepared XA
//! transaction that wrote this stream's table are **held**, keyed by XID, until its outcome:
//! `XA COMMIT` publishes them at that point of the commit order, `XA ROLLBACK` drops them.
//!
//! To survive a restart without storing rows anywhere, the position a restart resumes from
//! stays *before* the earliest held prepare, while the position of the last handled
//! transaction (`done`) moves on. A restart reads from `resume` again: it holds the prepares
//! it meets again and skips every other transaction up to `done` (see [`super::cdc`]).
//! XA transactions that wrote nothing to this table are never held, so an XA transaction on
//! another table never holds anything back.

use outbox_mysql::binlog::{Position, Xid};

use crate::error::Error;
use crate::poll::PolledRow;

/// Rows a prepared XA transaction may hold in memory; beyond this the stream stops with the
/// XID, rather than let one transaction exhaust the process.
pub(super) const MAX_HELD_BYTES: usize = 512 * 1024 * 1024;

#[derive(Debug)]
struct Held {
    xid: Xid,
    /// The position before the prepare: a restart resumes here to read the rows again.
    before: Position,
    rows: Vec<PolledRow>,
}

/// The prepared XA transactions of one stream that hold rows, in prepare order.
#[derive(Debug, Default)]
pub(super) struct XaHolds {
    held: Vec<Held>,
    bytes: usize,
}

fn weight(row: &PolledRow) -> usize {
    match row {
        Ok(record) => record.weight(),
        Err(_) => 64,
    }
}

impl XaHolds {
    /// Holds the rows of XA transaction `xid`, prepared after `before`. Nothing is held for an
    /// XA transaction without rows of this table.
    pub(super) fn hold(&mut self, xid: Xid, before: Position, rows: Vec<PolledRow>) -> Result<(), Error> {
        if rows.is_empty() {
            return Ok(());
        }
        let bytes: usize = rows.iter().map(weight).sum();
        if self.bytes + bytes > MAX_HELD_BYTES {
            return Err(Error::definite(
                format!(
                    "prepared XA transactions hold more than {MAX_HELD_BYTES} bytes of outbox rows (XA {xid} adds {bytes})"
                ),
                format!("commit or roll back the prepared XA transactions (XA RECOVER lists them; XA COMMIT {xid})"),
            ));
        }
        self.bytes += bytes;
        // The same prepare read twice (a session that resumed before it) replaces itself.
        self.held.retain(|h| h.xid != xid);
        self.held.push(Held { xid, before, rows });
        Ok(())
    }

    /// The outcome of `xid` arrived: its held rows, if it held any.
    pub(super) fn release(&mut self, xid: &Xid) -> Vec<PolledRow> {
        match self.held.iter().position(|h| h.xid == *xid) {
            Some(at) => {
                let held = self.held.remove(at);
                self.bytes -= held.rows.iter().map(weight).sum::<usize>();
                held.rows
            }
            None => Vec::new(),
        }
    }

    /// Where a restart must read from once everything up to `done` is handled: before the
    /// earliest prepare still held, or `done` itself. The file form (no GTID to skip by) never
    /// resumes earlier: held rows are then found again by the sweep, once committed.
    pub(super) fn resume(&self, done: &Position) -> Position {
        match (self.held.first(), done) {
            (_, Position::File { .. }) | (None, _) => done.clone(),
            (Some(earliest), _) => earliest.before.clone(),
        }
    }

    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::OutboxRecord;
    use outbox_mysql::binlog::Flavor;

    fn pos(gtid: &str) -> Position {
        Position::from_stored(Flavor::MariaDb, Some(gtid), "b.000001", 4).unwrap()
    }

    fn row(id: i64) -> PolledRow {
        Ok(OutboxRecord {
            id,
            topic: "t".into(),
            key: None,
            payload: None,
            headers: Vec::new(),
            kafka_partition: None,
            created_at_micros: None,
            timestamp_ms: None,
            in_table: true,
        })
    }

    fn xid(name: &str) -> Xid {
        Xid { format_id: 1, gtrid: name.as_bytes().to_vec(), bqual: Vec::new() }
    }

    #[test]
    fn resume_stays_before_the_earliest_held_prepare() {
        let mut h = XaHolds::default();
        assert_eq!(h.resume(&pos("0-1-9")), pos("0-1-9"));
        h.hold(xid("empty"), pos("0-1-3"), Vec::new()).unwrap();
        assert_eq!(h.resume(&pos("0-1-9")), pos("0-1-9"), "an XA without rows of this table holds nothing");
        h.hold(xid("a"), pos("0-1-4"), vec![row(1)]).unwrap();
        h.hold(xid("b"), pos("0-1-6"), vec![row(2), row(3)]).unwrap();
        assert_eq!(h.resume(&pos("0-1-9")), pos("0-1-4"));
        assert_eq!(h.release(&xid("a")).len(), 1);
        assert_eq!(h.resume(&pos("0-1-9")), pos("0-1-6"));
        assert!(h.release(&xid("a")).is_empty(), "released once");
        assert_eq!(h.release(&xid("b")).len(), 2);
        assert!(h.is_empty());
        assert_eq!(h.resume(&pos("0-1-9")), pos("0-1-9"));
        let file = Position::from_stored(Flavor::MariaDb, None, "b.000002", 400).unwrap();
        h.hold(xid("c"), pos("0-1-7"), vec![row(4)]).unwrap();
        assert_eq!(h.resume(&file), file, "the file form cannot skip, so it never resumes earlier");
    }
}
