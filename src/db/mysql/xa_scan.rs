//! Where a MariaDB catch-up must resume so that XA transactions prepared before its snapshot
//! are not missed.
//!
//! A catch-up drains what its consistent snapshot sees and streams what the binlog holds
//! after the snapshot's position. An XA transaction prepared before that position and still
//! prepared at the snapshot falls between the two: the snapshot cannot see its rows (they are
//! not committed) and its rows are in its prepare, before the position. So, when `XA RECOVER`
//! lists prepared transactions, the catch-up looks for their prepares in the binlog, newest
//! file first, and the stream resumes before the earliest one that wrote this table, with the
//! snapshot's position as the replay mark: it skips every transaction the drain handled and
//! holds the prepares it meets again, as a restart does ([`super::xa`]).
//!
//! A prepare that is not in the binlog any more (purged while it waited) cannot be read again;
//! its rows reach Kafka through the sweep once committed, after rows committed later, and the
//! catch-up says so with the XIDs. The prepares are looked for in at most
//! [`MAX_FILES_SCANNED`] files.
//!
//! `XA RECOVER` is read before and after the snapshot is taken, and the union is looked for:
//! a transaction prepared before the snapshot and still prepared at it is in one of the two
//! unless it was prepared in the instant between the first read and the snapshot and
//! committed in the instant between the snapshot and the second (then the sweep sends it).

use std::collections::BTreeSet;
use std::time::Duration;

use outbox_mysql::binlog::{BinlogChange, BinlogReader, BinlogTarget, Flavor, Position, Xid};
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{Conn, Opts, Row};

/// Binlog files read back at most, newest first.
pub(super) const MAX_FILES_SCANNED: usize = 32;

/// The dead-connection limit of the scan's reader is three of these.
const HEARTBEAT: Duration = Duration::from_secs(2);

/// An `XA RECOVER` row: formatID, gtrid_length, bqual_length, data.
type RecoverRow = (u32, usize, usize, Vec<u8>);

/// The prepared XA transactions the server lists (`XA RECOVER`), any table's; none, with a
/// warning, when the login may not list them.
pub(super) async fn prepared(conn: &mut Conn) -> BTreeSet<Xid> {
    match conn.query::<RecoverRow, _>("XA RECOVER").await {
        Ok(rows) => rows.into_iter().filter_map(|(format_id, g, b, data)| xid(format_id, g, b, &data)).collect(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot list prepared XA transactions (XA RECOVER): if one prepared before the catch-up's snapshot wrote this table, the sweep publishes its rows once it commits, after rows committed later");
            BTreeSet::new()
        }
    }
}

/// An XID from an `XA RECOVER` row: `data` is the global transaction id then the branch
/// qualifier.
fn xid(format_id: u32, gtrid_length: usize, bqual_length: usize, data: &[u8]) -> Option<Xid> {
    let gtrid = data.get(..gtrid_length)?.to_vec();
    let bqual = data.get(gtrid_length..gtrid_length + bqual_length)?.to_vec();
    Some(Xid { format_id, gtrid, bqual })
}

/// What the scan found.
#[derive(Debug, Default)]
pub(super) struct Found {
    /// Before the earliest prepare of `pending` that wrote this table.
    pub resume: Option<Position>,
    /// XIDs of `pending` whose prepare was not found in the binlog.
    pub missing: BTreeSet<Xid>,
}

/// The table the scan decodes and how to reach the server's binlog.
pub(super) struct ScanTarget<'a> {
    pub opts: &'a Opts,
    pub database: &'a str,
    pub table: &'a str,
    pub server_id: u32,
}

/// Looks for the prepares of `pending` before `snapshot` (a MariaDB GTID position with its
/// file and offset), newest binlog file first; stops once every one was found or no older file
/// is left. `conn` answers the binlog index (`SHOW BINARY LOGS`, `BINLOG_GTID_POS`).
pub(super) async fn find_prepares(
    conn: &mut Conn,
    target: &ScanTarget<'_>,
    snapshot: &Position,
    mut pending: BTreeSet<Xid>,
) -> Result<Found, String> {
    let files: Vec<String> = conn
        .query_map("SHOW BINARY LOGS", |row: Row| row.get::<String, _>(0).unwrap_or_default())
        .await
        .map_err(|e| format!("SHOW BINARY LOGS: {e}"))?;
    let Some(last) = files.iter().position(|f| f == snapshot.file()) else {
        return Err(format!("binlog file {} is not in SHOW BINARY LOGS", snapshot.file()));
    };
    let mut resume: Option<Position> = None;
    let mut bound = snapshot.clone();
    for file in files[..=last].iter().rev().take(MAX_FILES_SCANNED) {
        if pending.is_empty() {
            break;
        }
        let start = gtid_at(conn, file, 4).await?;
        if start.gtid_text() != bound.gtid_text() {
            let found = scan_file(target, &start, &bound, &mut pending).await?;
            for (xid, _) in &found {
                tracing::info!(xid = %xid, file = %file, "found the prepare of an XA transaction pending at the catch-up's snapshot");
            }
            // Files are read newest first: an earlier file's prepare comes before any found so far.
            if let Some((_, before)) = found.into_iter().next() {
                resume = Some(before);
            }
        }
        bound = start;
    }
    Ok(Found { resume, missing: pending })
}

/// The GTID position at `offset` of binlog `file`.
async fn gtid_at(conn: &mut Conn, file: &str, offset: u64) -> Result<Position, String> {
    let gtid: Option<Option<String>> = conn
        .exec_first("SELECT BINLOG_GTID_POS(?, ?)", (file, offset))
        .await
        .map_err(|e| format!("BINLOG_GTID_POS({file}, {offset}): {e}"))?;
    let gtid = gtid.flatten().ok_or_else(|| format!("BINLOG_GTID_POS({file}, {offset}) is NULL"))?;
    Position::from_stored(Flavor::MariaDb, Some(&gtid), file, offset)
}

/// Reads from `start` (the beginning of a file) up to `bound` (the beginning of the next file,
/// or the snapshot); answers the prepares of `pending` that wrote this table, earliest first,
/// each with the position before it, and removes from `pending` every prepare of it met (with
/// rows or without).
async fn scan_file(
    target: &ScanTarget<'_>,
    start: &Position,
    bound: &Position,
    pending: &mut BTreeSet<Xid>,
) -> Result<Vec<(Xid, Position)>, String> {
    let binlog = BinlogTarget {
        opts: target.opts.clone(),
        flavor: Flavor::MariaDb,
        server_id: target.server_id,
        database: target.database.to_string(),
        table: target.table.to_string(),
        heartbeat: HEARTBEAT,
    };
    let mut reader =
        BinlogReader::start(binlog, start.clone()).await.map_err(|e| format!("reading {}: {e}", start.file()))?;
    let mut found: Vec<(Xid, Position)> = Vec::new();
    let mut met: BTreeSet<Xid> = BTreeSet::new();
    let mut before = start.clone();
    let mut rows = false;
    let result = loop {
        let change = match reader.next().await {
            Ok(change) => change,
            Err(e) => break Err(format!("reading {}: {e}", start.file())),
        };
        let end = match change {
            BinlogChange::Begin { .. } => {
                before = reader.position().clone();
                rows = false;
                continue;
            }
            BinlogChange::Insert { .. } => {
                rows = true;
                continue;
            }
            BinlogChange::Prepared { xid, position } => {
                if past(&position, bound, start.file()) {
                    break Ok(());
                }
                if pending.contains(&xid) {
                    met.insert(xid.clone());
                    // An XID used again: the last prepare before the bound is the pending one.
                    found.retain(|(x, _)| *x != xid);
                    if rows {
                        found.push((xid, before.clone()));
                    }
                }
                position
            }
            BinlogChange::Commit { position } | BinlogChange::XaOutcome { position, .. } => position,
            BinlogChange::XaStart { .. } | BinlogChange::StatementWrite => continue,
        };
        if past(&end, bound, start.file()) || end.gtid_text() == bound.gtid_text() {
            break Ok(());
        }
    };
    reader.close().await;
    result?;
    for xid in &met {
        pending.remove(xid);
    }
    Ok(found)
}

/// `position`, read while scanning `file`, lies beyond `bound` (a later offset of `file`, or
/// the start of the next file).
fn past(position: &Position, bound: &Position, file: &str) -> bool {
    let in_bound_file = position.file() == bound.file();
    in_bound_file && position.offset() > bound.offset() || !in_bound_file && position.file() != file
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(gtid: &str, file: &str, offset: u64) -> Position {
        Position::from_stored(Flavor::MariaDb, Some(gtid), file, offset).unwrap()
    }

    #[test]
    fn an_xa_recover_row_splits_into_its_parts() {
        let x = xid(1, 2, 1, b"abq").unwrap();
        assert_eq!((x.format_id, x.gtrid.as_slice(), x.bqual.as_slice()), (1, b"ab".as_slice(), b"q".as_slice()));
        assert!(xid(1, 3, 1, b"ab").is_none(), "lengths beyond the data");
    }

    #[test]
    fn a_position_past_the_bound() {
        let snap = at("0-1-9", "b.000002", 500);
        assert!(!past(&at("0-1-8", "b.000002", 400), &snap, "b.000002"));
        assert!(!past(&at("0-1-9", "b.000002", 500), &snap, "b.000002"));
        assert!(past(&at("0-1-10", "b.000002", 600), &snap, "b.000002"));
        assert!(past(&at("0-1-10", "b.000003", 300), &snap, "b.000002"), "a later file");
        // The start of the next file as the bound: anything still in the scanned file is before.
        let next = at("0-1-9", "b.000003", 4);
        assert!(!past(&at("0-1-8", "b.000002", 900), &next, "b.000002"));
        assert!(past(&at("0-1-10", "b.000003", 300), &next, "b.000002"));
    }
}
