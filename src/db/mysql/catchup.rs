//! MySQL/MariaDB catch-up: a new position from a consistent snapshot, stored with the pending
//! mark in one epoch-guarded update, then the drain.
//!
//! MariaDB writes a transaction to the binlog before InnoDB makes it visible, so the current
//! binlog position alone could name a transaction the drain cannot see yet. A snapshot taken
//! `WITH CONSISTENT SNAPSHOT` reports the binlog position it corresponds to
//! (`Binlog_snapshot_file`/`_position`): exactly the transactions before it are visible in
//! the snapshot. The reader keeps that snapshot open and drains inside it, so the drain sends
//! exactly what committed before the new position and the stream exactly what committed
//! after: no row twice (a transaction that took its id before the snapshot and committed
//! after it is the stream's alone), and commit order holds across the seam. An XA
//! transaction prepared before the position and still prepared at the snapshot is neither:
//! the stream then resumes before its prepare, with the snapshot's position as the replay
//! mark ([`super::xa_scan`]). MySQL reports no
//! snapshot position: its `gtid_executed` gains a GTID only after the engine commit, so
//! reading it before the highest id is enough there, and its drain reads committed rows as
//! polling does (unverified live: no MySQL server here).

use std::collections::BTreeSet;
use std::time::Instant;

use outbox_mysql::binlog::{Flavor, Position, Xid};
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{Conn, Error as MyError, Opts};
use outbox_mysql::setup::{current_position, ident};

use futures::future::BoxFuture;

use super::cdc::server_id_for;
use super::checkpoint::Checkpoint;
use super::poll::MyPollTable;
use super::xa_scan::{self, ScanTarget};
use crate::catchup::{CatchUp, CatchUpReport, Drain, report};
use crate::db::fenced;
use crate::error::Error;
use crate::layout::Layout;
use crate::names::StreamNames;

/// A position to resume from and the highest id that could have committed before it.
struct Snapshot {
    gtid: Option<String>,
    file: String,
    offset: u64,
    upto: Option<i64>,
    /// MariaDB: the XA transactions prepared around the snapshot ([`super::xa_scan`]).
    prepared: BTreeSet<Xid>,
}

/// Takes the new position on `conn`. MariaDB: `conn` stays inside the consistent snapshot
/// the position belongs to (`in_snapshot` is true), for the drain to read in.
async fn snapshot(conn: &mut Conn, table: &str, id_column: &str) -> Result<(Snapshot, bool), MyError> {
    let version: Option<String> = conn.query_first("SELECT @@version").await?;
    let max_sql = format!("SELECT MAX({}) FROM {}", ident(id_column), ident(table));
    match Flavor::from_version(&version.unwrap_or_default()) {
        Flavor::MariaDb => {
            let mut prepared = xa_scan::prepared(conn).await;
            conn.query_drop("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").await?;
            conn.query_drop("START TRANSACTION WITH CONSISTENT SNAPSHOT").await?;
            prepared.extend(xa_scan::prepared(conn).await);
            let status: Vec<(String, String)> = conn.query("SHOW STATUS LIKE 'binlog_snapshot_%'").await?;
            let upto: Option<Option<i64>> = conn.query_first(&max_sql).await?;
            let value = |name: &str| status.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone());
            let file = value("Binlog_snapshot_file").unwrap_or_default();
            let offset = value("Binlog_snapshot_position").and_then(|v| v.parse().ok()).unwrap_or(4);
            // A plain function call: it reads the binlog index, not the snapshot's tables.
            let gtid: Option<Option<String>> = conn.exec_first("SELECT BINLOG_GTID_POS(?, ?)", (&file, offset)).await?;
            Ok((Snapshot { gtid: gtid.flatten(), file, offset, upto: upto.flatten(), prepared }, true))
        }
        Flavor::MySql => {
            let position = current_position(conn, false).await?;
            let upto: Option<Option<i64>> = conn.query_first(&max_sql).await?;
            let gtid = (!position.gtid.trim().is_empty()).then_some(position.gtid);
            let (file, offset) = (position.file, position.offset);
            Ok((Snapshot { gtid, file, offset, upto: upto.flatten(), prepared: BTreeSet::new() }, false))
        }
    }
}

/// Where the stream resumes when an XA transaction prepared before the snapshot may hold rows
/// of this table (see [`super::xa_scan`]): before the earliest such prepare still in the
/// binlog; `None` for the snapshot's own position. Prepares it cannot find are logged.
async fn behind_prepares(conn: &mut Conn, opts: &Opts, names: &StreamNames, snap: &Snapshot) -> Option<Position> {
    let gtid = snap.gtid.as_deref()?;
    if snap.prepared.is_empty() {
        return None;
    }
    let at = Position::from_stored(Flavor::MariaDb, Some(gtid), &snap.file, snap.offset).ok()?;
    let database = opts.db_name().unwrap_or_default().to_string();
    let target = ScanTarget {
        opts,
        database: &database,
        table: &names.table,
        server_id: server_id_for(&database, &names.table) ^ SCAN_SERVER_ID_BIT,
    };
    let listed = snap.prepared.len();
    match xa_scan::find_prepares(conn, &target, &at, snap.prepared.clone()).await {
        Ok(found) => {
            if !found.missing.is_empty() {
                let xids: Vec<String> = found.missing.iter().map(ToString::to_string).collect();
                tracing::warn!(
                    xids = %xids.join(" "),
                    "XA transactions prepared before the catch-up's snapshot whose prepares are not in the binlog any more (purged, or older than the files read): if they wrote this table, the sweep publishes their rows once they commit, after rows committed later"
                );
            }
            if found.resume.is_some() {
                tracing::warn!(
                    listed,
                    "XA transactions prepared before the catch-up's snapshot wrote this table: the stream resumes before the earliest prepare and skips what the drain sends"
                );
            }
            found.resume
        }
        Err(e) => {
            tracing::warn!(error = %e, listed, "could not look for the prepares of the XA transactions pending at the catch-up's snapshot: if they wrote this table, the sweep publishes their rows once they commit, after rows committed later");
            None
        }
    }
}

/// Told apart from the stream's own binlog reader, which is not running during a catch-up.
const SCAN_SERVER_ID_BIT: u32 = 0x2000_0000;

/// Marks a catch-up of `table` as needed before it streams again (polling mode does this).
pub(crate) async fn mark_pending(
    conn: &mut Conn,
    checkpoint_table: &str,
    table: &str,
    epoch: i64,
) -> Result<(), Error> {
    conn.exec_drop(Checkpoint::new(checkpoint_table).mark_catchup_pending(), (table, epoch))
        .await
        .map_err(|e| Error::from_db(&format!("updating {checkpoint_table}"), e))?;
    if conn.affected_rows() == 0 {
        return Err(fenced(table, epoch));
    }
    Ok(())
}

/// The catch-up of one shard-partition, handed to its job.
#[derive(Debug, Clone)]
pub(super) struct MyCatchUp {
    pub opts: Opts,
    pub names: StreamNames,
    pub checkpoint: String,
    pub layout: Layout,
}

impl CatchUp for MyCatchUp {
    fn run<'a>(
        &'a self,
        drain: &'a mut Drain<'_>,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<Option<CatchUpReport>, Error>> {
        let epoch = drain.labels.lease.db_epoch();
        Box::pin(run(&self.opts, &self.names, &self.checkpoint, self.layout, epoch, drain, reason))
    }
}

/// Runs the whole catch-up of one shard-partition. `Ok(None)`: the process is stopping and
/// the catch-up stays pending.
pub(crate) async fn run(
    opts: &Opts,
    names: &StreamNames,
    checkpoint_table: &str,
    layout: Layout,
    epoch: i64,
    drain: &mut Drain<'_>,
    reason: &str,
) -> Result<Option<CatchUpReport>, Error> {
    let started = Instant::now();
    tracing::warn!(reason, table = %names.table, "catching up by polling before streaming resumes");
    let mut reader = MyPollTable::connect(opts, &names.table, layout).await?;
    let mut cleaner = MyPollTable::connect(opts, &names.table, layout).await?;
    let (snap, in_snapshot) = snapshot(reader.conn(), &names.table, layout.id_column())
        .await
        .map_err(|e| Error::from_db("taking the new position", e))?;
    // Not on the reader: its snapshot transaction stays open for the drain.
    let conn = cleaner.conn();
    let resume = behind_prepares(conn, opts, names, &snap).await;
    let (gtid, file, offset, done) = match &resume {
        Some(at) => (at.gtid_text(), at.file().to_string(), at.offset(), snap.gtid.clone()),
        None => (snap.gtid.clone(), snap.file.clone(), snap.offset, None),
    };
    let checkpoint = Checkpoint::new(checkpoint_table);
    conn.exec_drop(checkpoint.restart_at(), (&gtid, &file, offset, &done, &names.table, epoch))
        .await
        .map_err(|e| Error::from_db(&format!("storing the new position in {checkpoint_table}"), e))?;
    if conn.affected_rows() == 0 {
        return Err(fenced(&names.table, epoch));
    }
    tracing::warn!(
        gtid = gtid.as_deref().unwrap_or("(none: file and offset)"),
        file = %file,
        offset,
        replayed_until = done.as_deref().unwrap_or("(none)"),
        "stored the new position; the stream resumes from it after the catch-up"
    );
    let rows = match snap.upto {
        None => 0,
        Some(upto) => match drain.run(reader, cleaner, upto, in_snapshot).await? {
            Some(rows) => rows,
            None => return Ok(None),
        },
    };
    let mut conn =
        Conn::new(opts.clone()).await.map_err(|e| Error::from_db("connecting to MySQL/MariaDB", e).connecting())?;
    conn.exec_drop(checkpoint.catchup_done(), (rows, &names.table, epoch))
        .await
        .map_err(|e| Error::from_db(&format!("updating {checkpoint_table}"), e))?;
    let _ = conn.disconnect().await;
    Ok(Some(report(drain.labels, started, rows)))
}
