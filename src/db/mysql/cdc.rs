//! The MySQL/MariaDB CDC source: one table's binlog rows turned into outbox records.
//!
//! # Positions
//!
//! The stored position is the GTID position after a transaction (a MariaDB GTID state or a
//! MySQL GTID set) plus its binlog file and offset, in `<prefix>_checkpoint`; with `gtid` NULL
//! the stream resumes by file and offset instead (see `outbox_mysql::gtid::Position`). For each
//! fully acknowledged prefix, ONE database transaction deletes the rows and stores the
//! position, guarded by the owner epoch: `UPDATE … WHERE stream = ? AND owner_epoch <= ?`
//! matching no row means another owner with a newer epoch took the stream, and this one stops.
//!
//! While an XA transaction that wrote this table is prepared, the stored position (`gtid`,
//! `binlog_file`, `binlog_pos`) stays before its prepare and `done_gtid` records how far the
//! stream really got ([`MyPosition`]); a restart reads from the stored position again and
//! skips every transaction `done_gtid` contains except XA prepares, whose rows it holds again
//! (see [`xa`]). Without a held XA transaction `done_gtid` is NULL and nothing is skipped.
//!
//! # Columns
//!
//! Values are matched by column name (`binlog_row_metadata=FULL`), so added columns are
//! ignored; a missing required column makes each row a bad row naming the column.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_mysql::binlog::{BinlogChange, BinlogError, BinlogReader, BinlogTarget, Cell, Flavor, Position, TxnId};
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{Conn, Error as MyError, IsolationLevel, Opts, OptsBuilder, TxOpts};
use outbox_mysql::setup::ident;
use tokio::sync::Mutex;

use super::checkpoint::{Checkpoint, SessionRow};
use super::xa::XaHolds;
use crate::config::Storage;
use crate::db::fenced;
use crate::error::Error;
use crate::layout::{Field, Layout};
use crate::metrics as m;
use crate::names::StreamNames;
use crate::poll::PolledRow;
use crate::record::{InvalidRow, OutboxRecord, RawRow};
use crate::replay::ReplayFilter;
use crate::row_keys::RowKeys;
use crate::skip::SkipList;
use crate::source::{DELETE_CHUNK, Probe, Source, SourceEvent, within};

/// An idle stream stores its position at most this often: every store is itself a binlog
/// transaction, which must not keep the stream busy.
const IDLE_STORE_INTERVAL: Duration = Duration::from_secs(5);

/// Where a MySQL/MariaDB stream stands: `done` is after the last transaction handled, and
/// `resume` is where a restart reads from — before the earliest prepared XA transaction still
/// holding rows of this table, or `done` itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MyPosition {
    pub resume: Position,
    pub done: Position,
}

impl fmt::Display for MyPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.resume == self.done {
            write!(f, "{}", self.done)
        } else {
            write!(f, "{} (resuming at {} while an XA transaction is prepared)", self.done, self.resume)
        }
    }
}

/// A replica `server_id` derived from the stream's database and table (FNV-1a), in a range
/// servers rarely use. Two readers of one stream share it, and the server keeps only the newer.
pub(crate) fn server_id_for(database: &str, table: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in database.bytes().chain([b'.']).chain(table.bytes()) {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    0x4000_0000 | (h & 0x3fff_ffff)
}

/// The transaction being read.
#[derive(Debug)]
struct OpenTxn {
    txn: TxnId,
    /// The position before it (after the previous transaction).
    before: Position,
    /// A restart replays it, and this stream already handled it.
    replayed: bool,
    /// It is a branch of an XA transaction: its rows wait for the outcome.
    xa: Option<(outbox_mysql::binlog::Xid, Vec<PolledRow>)>,
}

/// The named lock a session holds while it streams `table` (best effort: a second session of
/// the same stream goes on without it), so `outbox-streamer skip` can refuse to run meanwhile.
pub(crate) fn stream_lock(database: &str, table: &str) -> String {
    format!("outbox-streamer {:08x}", server_id_for(database, table))
}

/// One shard-partition's binlog session plus an SQL session for deletes and checkpoints.
#[derive(Debug)]
pub(crate) struct MySource {
    reader: BinlogReader,
    /// The SQL session: the finish running beside reading holds it while it deletes, and the
    /// sweep's and bad rows' reads wait for it.
    sql: Arc<Mutex<Conn>>,
    table: String,
    checkpoint: Checkpoint,
    epoch: i64,
    last_stored: Instant,
    metric_labels: [(&'static str, String); 3],
    /// Skips transactions the stored `done_gtid` contains: this stream handled them.
    replay: ReplayFilter<Position>,
    open: Option<OpenTxn>,
    /// Changes decided but not yet handed out (held rows released by an `XA COMMIT`).
    out: VecDeque<SourceEvent<MyPosition>>,
    holds: XaHolds,
    skips: SkipList,
    flavor: Flavor,
    /// The transaction whose rows are being handed out (the last `Begin`).
    current: Option<TxnId>,
    /// `wal`: the table is BLACKHOLE and its rows are WAL-only messages (see [`super::wal`]).
    storage: Storage,
    layout: Layout,
    /// The place of the next row in the open transaction (a message's identity).
    place: u64,
    /// The first and the last transaction with a WAL-only message whose position is not
    /// stored yet: a finish whose prefix covers the first stores it though it deletes nothing.
    unstored: Option<(TxnId, TxnId)>,
    /// `<source>/<shard>/<partition>`, for the fixes halts name.
    stream: String,
    /// Set when the table's id column is text (a uuid in `CHAR(36)`): rows are read by key
    /// (see [`super::keyed`]).
    keys: Option<RowKeys>,
    /// The ids of the finish running, forgotten by `keys` once it committed.
    finishing: Option<Arc<[i64]>>,
}

/// How a shard-partition's messages are stored: where (table rows or WAL-only), in which
/// table layout, and the job's keys should the table be read by key.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    pub storage: Storage,
    pub layout: Layout,
    pub keys: RowKeys,
}

impl MySource {
    /// Reads the stored position and starts the binlog after it.
    pub(crate) async fn connect(
        labels: &crate::streamer::StreamLabels,
        opts: &Opts,
        names: &StreamNames,
        checkpoint_table: &str,
        epoch: i64,
        heartbeat: Duration,
        stored: Stored,
    ) -> Result<Self, Error> {
        let Stored { storage, layout, keys } = stored;
        let stream = format!("{}/{}", labels.source, labels.id);
        let sql_opts: Opts = OptsBuilder::from_opts(opts.clone()).client_found_rows(true).into();
        let mut sql =
            Conn::new(sql_opts).await.map_err(|e| Error::from_db("connecting to MySQL/MariaDB", e).connecting())?;
        // Rows read back from the table (a bad row fixed since, a row the sweep finds) carry
        // `created_at` as this session shows a TIMESTAMP: in UTC, as the binlog logs it, so the
        // latency metric does not depend on the server's time zone.
        sql.query_drop("SET SESSION time_zone = '+00:00'")
            .await
            .map_err(|e| Error::from_db("setting up the session", e))?;
        let version: Option<String> =
            sql.query_first("SELECT @@version").await.map_err(|e| Error::from_db("reading the server version", e))?;
        let flavor = Flavor::from_version(&version.unwrap_or_default());
        let keys = match layout.mapping() {
            Some(_) if super::keyed::is_text(&mut sql, &names.table, layout.id_column()).await? => Some(keys),
            _ => None,
        };
        let database = opts.db_name().unwrap_or_default().to_string();
        let _: Option<Option<i64>> = sql
            .exec_first("SELECT GET_LOCK(?, 0)", (stream_lock(&database, &names.table),))
            .await
            .map_err(|e| Error::from_db("taking the stream's lock", e))?;
        let checkpoint = Checkpoint::new(checkpoint_table);
        let row: Option<SessionRow> =
            sql.exec_first(checkpoint.read_session(), (&names.table,)).await.map_err(|e| match e {
                MyError::Server(ref s) if s.code == 1054 || s.code == 1146 => Error::definite(
                    format!("cannot read {checkpoint_table}: {}", s.message),
                    "run `outbox-streamer setup`: it creates or updates the checkpoint table",
                ),
                e => Error::from_db(&format!("reading {checkpoint_table}"), e),
            })?;
        let Some((gtid, file, offset, stored_epoch, pending, done_gtid, skip_ids, skip_transactions)) = row else {
            return Err(Error::definite(
                format!("no checkpoint for {} in {checkpoint_table}", names.table),
                "run `outbox-streamer setup`",
            ));
        };
        if stored_epoch > epoch {
            return Err(fenced(&names.table, epoch));
        }
        if stored_epoch < epoch {
            // Claim the stream: from here on the previous owner's guarded writes match no row.
            sql.exec_drop(checkpoint.claim(), (epoch, &names.table, epoch))
                .await
                .map_err(|e| Error::from_db("claiming the checkpoint", e))?;
            if sql.affected_rows() == 0 {
                return Err(fenced(&names.table, epoch));
            }
        }
        if pending && storage == Storage::Wal {
            // A catch-up would move the position to the binlog's end past messages the table
            // never held: stream from the stored position instead (rows polling already sent
            // may come again, nothing is lost).
            sql.exec_drop(checkpoint.catchup_done(), (0i64, &names.table, epoch))
                .await
                .map_err(|e| Error::from_db(&format!("updating {checkpoint_table}"), e))?;
            tracing::warn!(table = %names.table, "a catch-up was pending; with storage = \"wal\" the stream resumes from its stored position instead");
        } else if pending {
            return Err(Error::position_lost(format!(
                "a catch-up of {} is pending (interrupted, or the stream ran in polling mode)",
                names.table
            )));
        }
        let unusable = |e: String| {
            Error::definite(
                format!("the checkpoint of {} in {checkpoint_table} is unusable: {e}", names.table),
                match flavor {
                    Flavor::MariaDb => format!(
                        "set {checkpoint_table}.gtid to a MariaDB GTID position such as 0-1-42 (SELECT BINLOG_GTID_POS(file, offset) converts a file offset), or set gtid to NULL with binlog_file and binlog_pos"
                    ),
                    Flavor::MySql => format!(
                        "set {checkpoint_table}.gtid to a MySQL GTID set such as <server_uuid>:1-42, or set gtid to NULL with binlog_file and binlog_pos"
                    ),
                },
            )
        };
        let position = Position::from_stored(
            flavor,
            gtid.as_deref(),
            file.as_deref().unwrap_or_default(),
            offset.unwrap_or_default(),
        )
        .map_err(unusable)?;
        let replay_until = done_gtid
            .as_deref()
            .map(|text| Position::from_stored(flavor, Some(text), position.file(), position.offset()))
            .transpose()
            .map_err(|e| unusable(format!("done_gtid: {e}")))?;
        let skips = SkipList::parse(skip_ids.as_deref(), skip_transactions.as_deref()).map_err(|e| {
            Error::definite(
                format!("{checkpoint_table} row {}: {e}", names.table),
                format!(
                    "correct or clear the column: UPDATE {checkpoint_table} SET skip_ids = NULL WHERE stream = '{}'",
                    names.table
                ),
            )
        })?;
        let target = BinlogTarget {
            opts: opts.clone(),
            flavor,
            server_id: server_id_for(&database, &names.table),
            database,
            table: names.table.clone(),
            heartbeat,
        };
        let reader = BinlogReader::start(target, position).await.map_err(|e| binlog_error(e, storage, &stream))?;
        Ok(Self {
            reader,
            sql: Arc::new(Mutex::new(sql)),
            table: names.table.clone(),
            checkpoint,
            epoch,
            last_stored: Instant::now(),
            metric_labels: labels.metric_labels(),
            replay: ReplayFilter::new(replay_until),
            open: None,
            out: VecDeque::new(),
            holds: XaHolds::default(),
            skips,
            flavor,
            current: None,
            storage,
            layout,
            place: 0,
            unstored: None,
            stream,
            keys,
            finishing: None,
        })
    }

    /// Held rows that will not be published (rolled back, or replayed): their keys are let go.
    fn unpublished(&self, rows: Vec<PolledRow>) {
        if let Some(keys) = &self.keys {
            keys.forget(&rows.iter().filter_map(row_id).collect::<Vec<_>>());
        }
    }

    fn position(&self, done: Position) -> MyPosition {
        MyPosition { resume: self.holds.resume(&done), done }
    }

    /// Turns one change of the binlog into what the session sees (queued in `out`).
    fn on_change(&mut self, change: BinlogChange) -> Result<(), Error> {
        match change {
            BinlogChange::Begin { txn } => {
                self.place = 0;
                let replayed = self.replay.begin(|done| done.contains(&txn));
                let before = self.reader.position().clone();
                self.open = Some(OpenTxn { txn, before, replayed, xa: None });
                if !replayed {
                    self.current = Some(txn);
                    self.out.push_back(SourceEvent::Begin { label: txn.to_string() });
                }
            }
            BinlogChange::XaStart { xid } => {
                if let Some(open) = self.open.as_mut() {
                    open.xa = Some((xid, Vec::new()));
                }
            }
            BinlogChange::Insert { values } => {
                let mut row = match &self.keys {
                    Some(keys) => {
                        let txn = self.open.as_ref().map_or_else(String::new, |o| o.txn.to_string());
                        keyed_record(&values, self.layout, keys, &txn)
                    }
                    None => record(&values, self.layout),
                };
                if let (Storage::Wal, Some(open)) = (self.storage, self.open.as_ref()) {
                    row = super::wal::message(row, &open.txn, self.place);
                    self.place += 1;
                    let first = self.unstored.take().map_or(open.txn, |(first, _)| first);
                    self.unstored = Some((first, open.txn));
                }
                match self.open.as_mut() {
                    Some(OpenTxn { xa: Some((_, rows)), .. }) => {
                        // Held until XA COMMIT: later transactions are numbered, published and
                        // finished before it (see `RowKeys`).
                        if let (Some(keys), Some(id)) = (&self.keys, row_id(&row)) {
                            keys.pin(id);
                        }
                        rows.push(row);
                    }
                    Some(OpenTxn { replayed: true, .. }) => {
                        self.replay.skip_row();
                        metrics::counter!(m::SKIPPED_REPLAYED_ROWS, &self.metric_labels).increment(1);
                    }
                    _ => self.out.push_back(SourceEvent::Row(row)),
                }
            }
            BinlogChange::StatementWrite => {
                metrics::counter!(m::STATEMENT_WRITES, &self.metric_labels).increment(1);
                if self.storage == Storage::Wal {
                    let txn = self.open.as_ref().map_or_else(String::new, |o| o.txn.to_string());
                    if !self.skips.skips_transaction(&txn) {
                        return Err(super::wal::statement_write(&self.table, &txn, &self.stream));
                    }
                    tracing::warn!(transaction = %txn, "a statement-logged write to the BLACKHOLE table skipped as `outbox-streamer skip` asked");
                    return Ok(());
                }
                if self.keys.is_some() {
                    // No sweep for a table read by key: the rows would never be published.
                    let txn = self.open.as_ref().map_or_else(String::new, |o| o.txn.to_string());
                    if !self.skips.skips_transaction(&txn) {
                        return Err(super::keyed::statement_write(
                            &self.table,
                            self.layout.id_column(),
                            &txn,
                            &self.stream,
                        ));
                    }
                    tracing::warn!(transaction = %txn, "a statement-logged write to the outbox table skipped as `outbox-streamer skip` asked");
                    return Ok(());
                }
                tracing::warn!(
                    transaction = %self.open.as_ref().map_or_else(String::new, |o| o.txn.to_string()),
                    table = %self.table,
                    "a statement-logged write to the outbox table (a session with binlog_format=STATEMENT or MIXED): its rows are not in the binlog; the sweep publishes them from the table, after rows committed later"
                );
            }
            BinlogChange::Commit { position } => {
                // A one-phase XA commit ends here with the rows it held.
                if let Some(open) = self.open.take() {
                    if open.replayed {
                        self.unpublished(open.xa.map(|(_, rows)| rows).unwrap_or_default());
                    } else {
                        if let Some((_, rows)) = open.xa {
                            self.out.extend(rows.into_iter().map(SourceEvent::Row));
                        }
                        let position = self.position(position);
                        self.out.push_back(SourceEvent::Commit(position));
                    }
                }
            }
            BinlogChange::Prepared { xid, position } => {
                let open = self.open.take();
                let replayed = open.as_ref().is_some_and(|o| o.replayed);
                if let Some(OpenTxn { before, xa, .. }) = open {
                    let rows = xa.map(|(_, rows)| rows).unwrap_or_default();
                    if !rows.is_empty() && !replayed {
                        tracing::info!(xid = %xid, rows = rows.len(), "XA transaction prepared; its rows wait for XA COMMIT");
                    }
                    self.holds.hold(xid, before, rows)?;
                }
                if !replayed {
                    // Nothing to publish: the prepare is an empty transaction to the session.
                    let position = self.position(position);
                    self.out.push_back(SourceEvent::Commit(position));
                }
            }
            BinlogChange::XaOutcome { xid, committed, position } => {
                let open = self.open.take();
                let rows = self.holds.release(&xid);
                if open.as_ref().is_some_and(|o| o.replayed) {
                    self.unpublished(rows);
                } else {
                    if committed {
                        self.out.extend(rows.into_iter().map(SourceEvent::Row));
                    } else if !rows.is_empty() {
                        tracing::info!(xid = %xid, rows = rows.len(), "XA transaction rolled back; its rows are not published");
                        self.unpublished(rows);
                    }
                    let position = self.position(position);
                    self.out.push_back(SourceEvent::Commit(position));
                }
            }
        }
        Ok(())
    }
}

fn binlog_error(e: BinlogError, storage: Storage, stream: &str) -> Error {
    match e {
        BinlogError::Purged(position) if storage == Storage::Wal => {
            super::wal::position_purged(&position.to_string(), stream)
        }
        BinlogError::Purged(position) => Error::position_lost(format!(
            "the stored binlog position {position} is not in the server's binlog (purged, or a promoted replica that did not log what it replicated)"
        )),
        BinlogError::Malformed(m) => Error::definite(
            format!("malformed binlog event: {m}"),
            "check binlog_format=ROW and log_bin_compress=OFF; report it with the server version",
        ),
        other => crate::dberror::classify("reading the binlog", other, crate::dberror::Channel::Replication),
    }
}

/// Builds the record of one inserted row from its values by name. A missing column makes
/// the row a bad row naming it (the table, where the operator restores it, decides then).
pub(crate) fn record(values: &[(String, Cell)], layout: Layout) -> Result<OutboxRecord, InvalidRow> {
    record_as(values, layout, None)
}

/// [`record`] of a table read by key (see [`super::keyed`]): the id column's text is the key,
/// and `keys` gives it its surrogate in transaction `txn`.
pub(crate) fn keyed_record(
    values: &[(String, Cell)],
    layout: Layout,
    keys: &RowKeys,
    txn: &str,
) -> Result<OutboxRecord, InvalidRow> {
    let id_column = layout.id_column();
    match values.iter().find(|(n, _)| n == id_column).map(|(_, c)| c) {
        Some(Cell::Bytes(b)) => {
            let key = String::from_utf8_lossy(b);
            record_as(values, layout, Some(keys.id_of(txn, &key))).map_err(|e| e.keyed(super::keyed::literal(&key)))
        }
        Some(Cell::Int(_)) => Err(InvalidRow::new(
            None,
            id_column,
            "changed type from text to integer while this session read the table; restart the streamer to read it as it is now",
        )),
        _ => record_as(values, layout, None),
    }
}

/// [`record`] with the row's `surrogate` id, or its id column's when `None`.
pub(super) fn record_as(
    values: &[(String, Cell)],
    layout: Layout,
    surrogate: Option<i64>,
) -> Result<OutboxRecord, InvalidRow> {
    let cell = |name: &str| values.iter().find(|(n, _)| n == name).map(|(_, c)| c);
    let missing = |id: Option<i64>, column: &'static str| {
        InvalidRow::new(id, column, "is not in the logged row (dropped or renamed, or binlog_row_metadata is not FULL)")
    };
    let id_column = layout.id_column();
    let id = match (surrogate, cell(id_column)) {
        (Some(id), _) => id,
        (None, Some(Cell::Int(i))) => *i,
        (None, Some(other)) => {
            return Err(InvalidRow::new(None, id_column, format!("is not an integer ({})", kind(other))));
        }
        (None, None) => return Err(missing(None, id_column)),
    };
    // The layout's column of `field`, and its cell (`None`: the layout has no such column).
    let of = |field: Field| layout.column(field).map(|column| (column, cell(column)));
    let bytes = |field: Field| match of(field) {
        None | Some((_, Some(Cell::Null))) => Ok(None),
        Some((_, Some(Cell::Bytes(b)))) => Ok(Some(b.clone())),
        Some((column, Some(other))) => {
            Err(InvalidRow::new(Some(id), column, format!("has an unexpected type ({})", kind(other))))
        }
        Some((column, None)) => Err(missing(Some(id), column)),
    };
    let kafka_partition = match of(Field::Partition) {
        None | Some((_, Some(Cell::Null))) => None,
        Some((_, Some(Cell::Int(p)))) => Some(*p),
        Some((column, Some(other))) => {
            return Err(InvalidRow::new(Some(id), column, format!("is not a partition number ({})", kind(other))));
        }
        Some((column, None)) => return Err(missing(Some(id), column)),
    };
    let raw = RawRow {
        topic: bytes(Field::Topic)?,
        key: bytes(Field::Key)?,
        payload: bytes(Field::Payload)?,
        headers: bytes(Field::Headers)?,
        kafka_partition,
        created_at_micros: match of(Field::CreatedAt) {
            Some((_, Some(Cell::Micros(m)))) => Some(*m),
            _ => None,
        },
        extra_headers: Vec::new(),
    };
    let mut raw = raw;
    for (name, column) in layout.header_columns() {
        match cell(column) {
            None => return Err(missing(Some(id), column)),
            Some(Cell::Null) => {}
            Some(Cell::Bytes(b)) => raw.extra_headers.push((name.to_string(), b.clone())),
            Some(Cell::Int(i)) => raw.extra_headers.push((name.to_string(), i.to_string().into_bytes())),
            Some(other) => {
                return Err(InvalidRow::new(Some(id), column, format!("cannot be a header ({})", kind(other))));
            }
        }
    }
    layout.record(id, raw)
}

/// A cell's kind for error messages (never its value, which is application data).
fn kind(cell: &Cell) -> &'static str {
    match cell {
        Cell::Null => "NULL",
        Cell::Bytes(_) => "bytes",
        Cell::Int(_) => "an integer",
        Cell::Micros(_) => "a date-time",
        Cell::Other(_) => "another type",
    }
}

/// A row's id, when it could be read.
fn row_id(row: &PolledRow) -> Option<i64> {
    match row {
        Ok(record) => Some(record.id),
        Err(invalid) => invalid.id,
    }
}

/// `1,2,3` for an SQL `IN` list.
pub(crate) fn id_list(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
}

impl Source for MySource {
    type Position = MyPosition;
    const POSITION_HEADER: &'static str = "outbox-gtid";

    async fn next(&mut self) -> Result<Option<SourceEvent<MyPosition>>, Error> {
        loop {
            if let Some(event) = self.out.pop_front() {
                return Ok(Some(event));
            }
            // The only await: nothing is lost if this call is cancelled.
            let change = self.reader.next().await.map_err(|e| binlog_error(e, self.storage, &self.stream))?;
            metrics::gauge!(m::BINLOG_LAG_SECONDS, &self.metric_labels).set(self.reader.lag_seconds());
            self.on_change(change)?;
        }
    }

    fn finish(
        &mut self,
        ids: Arc<[i64]>,
        upto: MyPosition,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'static + use<> {
        // An idle stream stores its position only now and then.
        let messages = self.unstored.is_some_and(|(first, _)| upto.done.contains(&first));
        if messages {
            // What the prefix does not cover yet is stored by a later finish that covers `last`.
            self.unstored = self.unstored.filter(|(_, last)| !upto.done.contains(last)).map(|(_, last)| (last, last));
        }
        let store = !ids.is_empty() || messages || self.last_stored.elapsed() >= IDLE_STORE_INTERVAL;
        if store {
            self.last_stored = Instant::now();
        }
        let sql = self.sql.clone();
        let (table, statement, epoch) = (self.table.clone(), self.checkpoint.store(), self.epoch);
        let id_column = self.layout.id_column();
        self.finishing = self.keys.is_some().then(|| ids.clone());
        let keys = self.keys.as_ref().map(|k| crate::row_keys::keys_to_delete(k, &ids, &self.table));
        async move {
            if !store {
                return Ok(0);
            }
            let mut conn = sql.lock().await;
            // READ COMMITTED: InnoDB then locks only the rows deleted, no gaps, so the cleanup
            // can never deadlock with the application's inserts into the same table (under the
            // default REPEATABLE READ it can, and InnoDB may pick the application's transaction
            // as victim).
            let mut opts = TxOpts::default();
            opts.with_isolation_level(IsolationLevel::ReadCommitted);
            let mut tx = within("starting the cleanup transaction", conn.start_transaction(opts)).await?;
            let mut deleted = 0;
            match &keys {
                None => {
                    for chunk in ids.chunks(DELETE_CHUNK) {
                        let delete = outbox_mysql::cleanup::delete_by_ids(&table, id_column, chunk);
                        within("deleting published rows", tx.query_drop(delete)).await?;
                        deleted += tx.affected_rows();
                    }
                }
                Some(keys) => {
                    for chunk in keys.chunks(DELETE_CHUNK) {
                        let delete = super::keyed::delete_sql(&table, id_column, chunk.len());
                        within("deleting published rows", tx.exec_drop(delete, chunk.to_vec())).await?;
                        deleted += tx.affected_rows();
                    }
                }
            }
            let resume = &upto.resume;
            let done_gtid = if upto.resume == upto.done { None } else { upto.done.gtid_text() };
            let params = (resume.gtid_text(), resume.file(), resume.offset(), done_gtid, epoch, &table, epoch);
            within("storing the position", tx.exec_drop(statement, params)).await?;
            if tx.affected_rows() == 0 {
                let _ = tx.rollback().await;
                return Err(fenced(&table, epoch));
            }
            within("committing delete and position", tx.commit()).await?;
            Ok(deleted)
        }
    }

    fn finished(&mut self, upto: MyPosition) {
        // A prefix a failed session left is finished before anything is read: the reader
        // started before `upto` and must skip what it covers (a no-op once it read past it).
        self.replay.finished(upto.done);
        if let (Some(keys), Some(ids)) = (&self.keys, self.finishing.take()) {
            keys.finished(&ids);
        }
    }

    fn confirm_idle(&mut self, _position: MyPosition) {
        // The binlog is kept by the server's own retention, not by readers: nothing to confirm.
    }

    async fn close(self) {
        self.reader.close().await;
        if let Ok(sql) = Arc::try_unwrap(self.sql) {
            let _ = sql.into_inner().disconnect().await;
        }
    }

    async fn history(&mut self) -> Result<String, Error> {
        super::connect::history(&mut *self.sql.lock().await).await
    }

    async fn current_rows(&mut self, ids: &[i64]) -> Result<Vec<PolledRow>, Error> {
        // A locking read waits for the inserting transaction, which the binlog may show before
        // InnoDB has made it visible.
        let mut conn = self.sql.lock().await;
        match &self.keys {
            None => super::poll::rows_by_id(&mut conn, &self.table, ids, true, self.layout).await,
            Some(keys) => {
                let known = keys.keys_of(ids);
                if known.len() < ids.len() {
                    return Err(crate::row_keys::unknown(ids.len() - known.len()));
                }
                super::keyed::rows_by_key(&mut conn, &self.table, &known, self.layout).await
            }
        }
    }

    async fn existing(&mut self, ids: &[i64]) -> Result<Vec<i64>, Error> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(keys) = &self.keys {
            let known = keys.keys_of(ids);
            let mut conn = self.sql.lock().await;
            return super::keyed::existing(&mut conn, &self.table, self.layout.id_column(), &known).await;
        }
        let sql = super::poll::existing_sql(&self.table, self.layout, ids);
        within("checking rows", self.sql.lock().await.query(sql)).await
    }

    async fn probe(&mut self, below: Option<i64>, limit: usize) -> Result<Probe<MyPosition>, Error> {
        let mut conn = self.sql.lock().await;
        let id = ident(self.layout.id_column());
        let candidates: Vec<i64> = match below {
            Some(below) => {
                let sql = format!(
                    "SELECT {id} FROM {}{} WHERE {id} <= ? ORDER BY {id} LIMIT ?",
                    ident(&self.table),
                    super::poll::id_index(self.layout)
                );
                within("sweeping the table", conn.exec(sql, (below, limit as u64))).await?
            }
            None => Vec::new(),
        };
        let max: Option<Option<i64>> =
            within("sweeping the table", conn.query_first(format!("SELECT MAX({id}) FROM {}", ident(&self.table))))
                .await?;
        // Read after the rows: a transaction is written to the binlog before InnoDB makes it
        // visible, so every commit the reads saw ends at or before this offset.
        let (file, offset) = within("reading the binlog position", outbox_mysql::setup::binlog_end(&mut conn)).await?;
        let mark = Position::File { file, offset };
        Ok(Probe { candidates, max_id: max.flatten(), mark: MyPosition { resume: mark.clone(), done: mark } })
    }

    /// The GTID state (or set) after the position's transactions; the file form as
    /// `file:<name>:<offset>`.
    fn progress_mark(position: &MyPosition) -> Option<String> {
        let done = &position.done;
        Some(match done.gtid_text() {
            Some(gtid) => format!("gtid:{gtid}"),
            None => format!("file:{}:{}", done.file(), done.offset()),
        })
    }

    fn begun_within(&self, mark: &str) -> Result<bool, Error> {
        let unreadable = |why: String| crate::progress::unreadable(mark, &why);
        let position = if let Some(gtid) = mark.strip_prefix("gtid:") {
            Position::from_stored(self.flavor, Some(gtid), "", 0).map_err(unreadable)?
        } else if let Some((file, offset)) = mark.strip_prefix("file:").and_then(|f| f.rsplit_once(':')) {
            let offset = offset.parse().map_err(|_| unreadable("the offset is not a number".into()))?;
            Position::from_stored(self.flavor, None, file, offset).map_err(unreadable)?
        } else {
            return Err(unreadable("it is neither gtid:<state> nor file:<name>:<offset>".into()));
        };
        if let (Position::File { .. }, Some(open)) = (&position, &self.open) {
            // Without GTIDs: the transaction starts before the end of the last one in Kafka.
            return Ok(position.at_or_after(&open.before) && position != open.before);
        }
        Ok(self.current.as_ref().is_some_and(|txn| position.contains(txn)))
    }

    fn reached(done: &MyPosition, mark: &MyPosition) -> bool {
        done.done.at_or_after(&mark.done)
    }

    fn sweeps(&self) -> bool {
        self.keys.is_none()
    }

    fn row_keys(&self) -> Option<RowKeys> {
        self.keys.clone()
    }

    fn skips(&self, id: Option<i64>, message: bool, label: &str) -> bool {
        match id {
            None => self.skips.skips_transaction(label),
            Some(id) if message => self.skips.skips_message(id),
            Some(id) => {
                // A row read by key is skipped by its key (`skip --id <key>`), never by its
                // surrogate.
                let bound = match &self.keys {
                    Some(keys) => keys.key_of(id).and_then(|key| self.skips.bound_of_key(&key).map(str::to_string)),
                    None => self.skips.bound_of(id).map(str::to_string),
                };
                let (Some(bound), Some(txn)) = (bound, self.current.as_ref()) else {
                    return false;
                };
                Position::from_stored(self.flavor, Some(&bound), "", 4).is_ok_and(|bound| bound.contains(txn))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(topic: Cell) -> Vec<(String, Cell)> {
        vec![
            ("id".into(), Cell::Int(3)),
            ("topic".into(), topic),
            ("msg_key".into(), Cell::Bytes(b"k".to_vec())),
            ("payload".into(), Cell::Null),
            ("headers".into(), Cell::Bytes(br#"{"a":"b"}"#.to_vec())),
            ("kafka_partition".into(), Cell::Null),
            ("created_at".into(), Cell::Micros(5)),
            ("extra".into(), Cell::Int(1)),
        ]
    }

    #[test]
    fn maps_by_name() {
        let r = record(&row(Cell::Bytes(b"orders".to_vec())), Layout::OutboxStreamer).unwrap();
        assert_eq!((r.id, r.topic.as_str(), r.key.as_deref()), (3, "orders", Some(&b"k"[..])));
        assert_eq!(r.payload, None);
        assert_eq!(r.headers, vec![("a".into(), b"b".to_vec())]);
        assert_eq!(r.created_at_micros, Some(5));
    }

    #[test]
    fn null_topic_and_a_missing_column_are_bad_rows() {
        let e = record(&row(Cell::Null), Layout::OutboxStreamer).unwrap_err();
        assert_eq!((e.id, e.column), (Some(3), "topic"));
        let mut r = row(Cell::Bytes(b"t".to_vec()));
        r.retain(|(n, _)| n != "payload");
        let e = record(&r, Layout::OutboxStreamer).unwrap_err();
        assert_eq!((e.id, e.column), (Some(3), "payload"));
    }

    #[test]
    fn a_text_id_is_a_key_given_a_surrogate_and_named_in_errors() {
        let keys = RowKeys::default();
        let mut r = row(Cell::Bytes(b"orders".to_vec()));
        r[0].1 = Cell::Bytes(b"0f8e-it's".to_vec());
        let first = keyed_record(&r, Layout::OutboxStreamer, &keys, "0-1-1").unwrap();
        assert_eq!(
            keyed_record(&r, Layout::OutboxStreamer, &keys, "0-1-1").unwrap().id,
            first.id,
            "the same key, the same id"
        );
        assert_eq!(keys.key_of(first.id).as_deref(), Some("0f8e-it's"));
        r[1].1 = Cell::Null;
        let e = keyed_record(&r, Layout::OutboxStreamer, &keys, "0-1-1").unwrap_err();
        assert_eq!((e.id, e.column), (Some(first.id), "topic"));
        assert!(e.to_string().starts_with("row id='0f8e-it''s' column topic"), "{e}");
        r[0].1 = Cell::Int(4);
        assert!(keyed_record(&r, Layout::OutboxStreamer, &keys, "0-1-1").unwrap_err().reason.contains("changed type"));
    }

    #[test]
    fn server_ids_are_stable_and_spread() {
        assert_eq!(server_id_for("app", "outbox_0_0"), server_id_for("app", "outbox_0_0"));
        assert_ne!(server_id_for("app", "outbox_0_0"), server_id_for("app", "outbox_0_1"));
        assert!(server_id_for("a", "b") >= 0x4000_0000);
    }
}
