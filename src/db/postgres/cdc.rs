//! The PostgreSQL CDC source: one slot's pgoutput stream turned into outbox records.
//!
//! # Positions
//!
//! A transaction's position is its commit *end* LSN: confirming it tells the server every
//! change before it was handled, so a restart resumes with the next transaction. Records are
//! stamped with the commit LSN (`outbox-lsn`), known from `Begin` before the first insert.
//!
//! # WAL-only messages
//!
//! Whatever the shard-partition's storage, the stream publishes both the table's inserts and
//! the transactional logical messages whose prefix is the table's name (written by
//! `<prefix>_emit`, see [`super::envelope`]), in commit order: switching storage loses
//! nothing in flight. A message's identity (`outbox-id`) is its LSN; it has nothing to delete.
//! With `storage = "wal"` a lost slot halts (see [`wal_position_lost`]): the catch-up can
//! only read the table, and the messages after the slot's position are gone.
//!
//! # Columns
//!
//! Columns are found by name in each Relation message ([`ColumnMap`]).
//!
//! # Rows identified by a uuid
//!
//! A mapped table whose id column is a `uuid` (Debezium's documented table) is read by key:
//! each row's uuid gets a surrogate id for the core ([`crate::row_keys`]), the finish deletes
//! by uuid, and the table is not swept (uuids have no order to probe by). Whether the table
//! is one is read from the catalog when a session starts.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use outbox_postgres::connect::PgTarget;
use outbox_postgres::stream::{Change, ReplicationStream, StreamError};
use outbox_postgres::{Lsn, cleanup, slot};
use tokio::sync::Mutex;
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use super::columns::ColumnMap;
use super::snapshot::Drained;
use super::{checkpoint, envelope, visibility};
use crate::config::Storage;
use crate::error::Error;
use crate::layout::Layout;
use crate::lease::OwnerLease;
use crate::names::StreamNames;
use crate::replay::ReplayFilter;
use crate::row_keys::RowKeys;
use crate::skip::SkipList;
use crate::source::{DELETE_CHUNK, Probe, Source, SourceEvent, within};
use crate::streamer::kind_labels;

/// One shard-partition's logical replication session plus an SQL session for deletes.
#[derive(Debug)]
pub(crate) struct PgSource {
    stream: ReplicationStream,
    /// Shared with the finish running beside reading (tokio-postgres pipelines the two).
    sql: Arc<Client>,
    names: StreamNames,
    checkpoint_table: String,
    columns: Option<ColumnMap>,
    /// With a heartbeat configured the server speaks at least that often, so a replication
    /// link silent for this long is presumed dead. Without one, an idle server may rightly be
    /// silent for ever, and the server's `wal_sender_timeout` is the only deadline.
    silence_limit: Option<Duration>,
    /// Counted from the last message, not per call: `next` is cancelled and called again.
    last_heard: tokio::time::Instant,
    /// Transactions read and not yet confirmed: (xid, commit LSN). See [`visibility`].
    xids: std::collections::VecDeque<(u32, Lsn)>,
    /// The `final_lsn` of the last transaction begun (exactly-once's [`Source::begun_within`]).
    begun: Lsn,
    /// The finish's prepared deletes; one finish runs at a time.
    deleter: Arc<Mutex<cleanup::RowDeleter>>,
    /// Skips transactions whose commit starts below the published-up-to mark: this stream
    /// published and deleted them (the mark is stored with the delete).
    replay: ReplayFilter<Lsn>,
    /// The last catch-up's drain: transactions it sent, committed after its new position
    /// (the mark), are skipped too. Dropped once the stream is past them.
    drained: Option<Drained>,
    /// The transaction being read was sent by that drain.
    in_drained: bool,
    skips: SkipList,
    metric_labels: [(&'static str, String); 3],
    /// Whether a message with this stream's prefix outside a transaction was reported.
    warned_untransactional: bool,
    storage: Storage,
    layout: Layout,
    /// Set when the table's id column is a uuid (see the module docs).
    keys: Option<RowKeys>,
    /// The ids of the finish running, forgotten by `keys` once it committed.
    finishing: Option<Arc<[i64]>>,
}

/// How a shard-partition's CDC session runs, from its settings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CdcOptions {
    /// How often the position is reported to the server (`status_interval_ms`).
    pub status_interval: Duration,
    /// See [`PgSource::silence_limit`].
    pub silence_limit: Option<Duration>,
    pub storage: Storage,
    pub layout: Layout,
}

impl PgSource {
    /// Opens the SQL session and starts streaming from the slot's confirmed position.
    pub(crate) async fn connect(
        target: &PgTarget,
        names: &StreamNames,
        checkpoint_table: &str,
        options: CdcOptions,
        lease: &OwnerLease,
        metric_labels: [(&'static str, String); 3],
        keys: &RowKeys,
    ) -> Result<Self, Error> {
        let CdcOptions { status_interval, silence_limit, storage, layout } = options;
        let sql = target
            .connect()
            .await
            .map_err(|e| Error::from_db(&format!("connecting to {}", target.display()), e).connecting())?;
        let keys = match layout.mapping() {
            Some(_) if super::keyed::is_uuid(&sql, &names.table, layout.id_column()).await? => Some(keys.clone()),
            _ => None,
        };
        let stored = checkpoint::read(&sql, checkpoint_table, &names.table).await?;
        let state = slot::state(&sql, &names.slot)
            .await
            .map_err(|e| Error::from_db(&format!("reading slot {}", names.slot), e))?;
        // A lost slot of `wal` storage halts before a pending catch-up, which would create a
        // new slot; for `table` storage the catch-up is what replaces it.
        let lost = if state.other_database.is_some() {
            None
        } else if !state.exists {
            Some(format!("replication slot {:?} does not exist in {} (dropped?)", names.slot, target.display()))
        } else if state.wal_status.as_deref() == Some("lost") {
            Some(format!(
                "replication slot {:?} was invalidated (wal_status=lost): the WAL it needed is gone",
                names.slot
            ))
        } else {
            None
        };
        if let (Some(lost), Storage::Wal) = (&lost, storage) {
            return Err(wal_position_lost(&names.slot, lost, state.confirmed_flush.or(stored.published)));
        }
        if stored.catchup_pending {
            return Err(Error::position_lost(format!(
                "a catch-up of {} is pending (interrupted, or the stream ran in polling mode)",
                names.table
            )));
        }
        if let Some(database) = &state.other_database {
            return Err(crate::dberror::slot_elsewhere(&names.slot, database));
        }
        if let Some(lost) = lost {
            return Err(Error::position_lost(lost));
        }
        if state.active_pid.is_some() {
            take_slot_from_dead_owner(&sql, &names.slot, lease).await?;
        }
        // pgoutput's binary option exists from PostgreSQL 14 on.
        let binary = sql
            .query_one("SELECT current_setting('server_version_num')::int >= 140000", &[])
            .await
            .map_err(|e| Error::from_db("reading the server version", e))?
            .get::<_, bool>(0);
        // A mapped table's columns may be of any type: text format reads each as its text.
        let binary = binary && layout.mapping().is_none();
        let cfg = target.replication(&names.slot, &names.publication, status_interval, binary);
        let stream = ReplicationStream::start(cfg).await.map_err(|e| stream_error(&names.slot, storage, e))?;
        Ok(Self {
            stream,
            sql: Arc::new(sql),
            names: names.clone(),
            checkpoint_table: checkpoint_table.to_string(),
            columns: None,
            silence_limit,
            last_heard: tokio::time::Instant::now(),
            xids: std::collections::VecDeque::new(),
            begun: Lsn(0),
            deleter: Arc::new(Mutex::new(
                match keys {
                    Some(_) => cleanup::RowDeleter::by_uuid(&names.table, layout.id_column()),
                    None => cleanup::RowDeleter::new(&names.table, layout.id_column()),
                }
                .recording_in(checkpoint_table, &names.table),
            )),
            replay: ReplayFilter::new(stored.published),
            drained: stored.drained,
            in_drained: false,
            skips: stored.skips,
            metric_labels,
            warned_untransactional: false,
            storage,
            layout,
            keys,
            finishing: None,
        })
    }

    /// A logical message: one of this stream's, in a committed transaction, is a record;
    /// anything else (the heartbeat, another tool's prefix) is a point in the stream where,
    /// when nothing is in flight, everything before it has been handled.
    fn on_message(&mut self, transactional: bool, lsn: Lsn, prefix: &str, content: &[u8]) -> Option<SourceEvent<Lsn>> {
        if prefix != self.names.table {
            return Some(SourceEvent::Idle(lsn));
        }
        if !transactional {
            // Sent even if its transaction rolled back: never an outbox message.
            metrics::counter!(
                crate::metrics::SKIPPED_ROWS,
                &kind_labels(&self.metric_labels, "untransactional_message")
            )
            .increment(1);
            if !std::mem::replace(&mut self.warned_untransactional, true) {
                tracing::warn!(
                    prefix,
                    %lsn,
                    "a non-transactional logical message with this stream's prefix was ignored: it is sent even when its transaction rolls back, so it is never published; emit with pg_logical_emit_message(true, …) or {}_emit()",
                    self.names.table
                );
            }
            return Some(SourceEvent::Idle(lsn));
        }
        if self.replay.skip_row() {
            metrics::counter!(crate::metrics::SKIPPED_REPLAYED_ROWS, &self.metric_labels).increment(1);
            return None;
        }
        // LSNs stay far below 2^63 (8 EiB of WAL); the conversion cannot fail in practice.
        let id = i64::try_from(lsn.as_u64()).unwrap_or(i64::MAX);
        Some(SourceEvent::Row(envelope::decode(id, &lsn.to_string(), content)))
    }
}

/// A lost slot of a `wal` shard-partition: its messages after `since` are gone with the WAL
/// (the table holds none of them), so the stream halts until an operator decides — never a
/// silent new slot.
pub(super) fn wal_position_lost(slot: &str, what: &str, since: Option<Lsn>) -> Error {
    let since = since.map_or_else(
        || "after the last position this stream confirmed (unknown: the slot is gone)".to_string(),
        |lsn| format!("after LSN {lsn} (the slot's last confirmed position)"),
    );
    Error::definite(
        format!(
            "{what}; with storage = \"wal\" the messages committed {since} until a new slot exists could not be read and are not in any table: they may be lost"
        ),
        format!(
            "find out what was lost (the applications' logs, or `pg_waldump` on WAL still on disk), then create a new slot with `outbox-streamer setup` (drop an invalidated one first: SELECT pg_drop_replication_slot('{slot}')); the stream resumes from the new slot. To stop this from happening, keep max_slot_wal_keep_size = -1 for wal storage"
        ),
    )
}

/// What a finish needs, owned, so it runs beside reading.
struct Finish {
    sql: Arc<Client>,
    deleter: Arc<Mutex<cleanup::RowDeleter>>,
    table: String,
    checkpoint_table: String,
    keys: Option<RowKeys>,
}

impl Finish {
    /// Deletes `ids` and stores `upto` as the published-up-to mark; `covered` are the
    /// transactions up to `upto` (see [`visibility`]). A table read by key deletes by the
    /// rows' uuids.
    async fn run(self, ids: Arc<[i64]>, upto: Lsn, covered: Vec<u32>) -> Result<u64, Error> {
        match &self.keys {
            None => self.run_with(&ids, upto, covered).await,
            Some(keys) => {
                let keys: Vec<String> = crate::row_keys::keys_to_delete(keys, &ids, &self.table);
                self.run_with(&keys, upto, covered).await
            }
        }
    }

    async fn run_with<T: tokio_postgres::types::ToSql + Sync>(
        &self,
        ids: &[T],
        upto: Lsn,
        covered: Vec<u32>,
    ) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let mut deleter = self.deleter.lock().await;
        // The published-up-to mark is stored with the delete only when every row was
        // deleted: a row of a transaction committed but not yet visible is not, and a crash
        // before the second try must not leave it behind a mark.
        let (mut deleted, recorded) = self.delete(&mut deleter, ids, upto, true).await?;
        if !recorded {
            visibility::wait(&self.sql, &covered).await?;
            let (again, _) = self.delete(&mut deleter, ids, upto, false).await?;
            deleted += again;
            if (deleted as usize) < ids.len() {
                tracing::debug!(
                    published = ids.len(),
                    deleted,
                    "some published rows were already gone (deleted by someone else)"
                );
            }
        }
        Ok(deleted)
    }

    /// Deletes `ids` in chunks; the last one also stores `upto` as the published-up-to mark —
    /// with `require_all`, only if every row was deleted. Returns (deleted, mark stored).
    async fn delete<T: tokio_postgres::types::ToSql + Sync>(
        &self,
        deleter: &mut cleanup::RowDeleter,
        ids: &[T],
        upto: Lsn,
        require_all: bool,
    ) -> Result<(u64, bool), Error> {
        let what = format!("deleting published rows from {}", self.table);
        let (earlier, last) = ids.split_at(ids.len() - ids.len().min(DELETE_CHUNK));
        let mut deleted = 0;
        for chunk in earlier.chunks(DELETE_CHUNK) {
            deleted += within(&what, deleter.delete(&self.sql, chunk)).await?;
        }
        let record = !require_all || deleted as usize == earlier.len();
        let lsn = upto.to_pg_string();
        let (n, stored) = within(&what, deleter.delete_and_record(&self.sql, last, &lsn, record, require_all)).await?;
        if record && !stored && (!require_all || n as usize == last.len()) {
            return Err(Error::definite(
                format!("{} has no row for {}", self.checkpoint_table, self.table),
                "run `outbox-streamer setup`",
            ));
        }
        Ok((deleted + n, stored))
    }
}

/// The slot is held by another session. Under ZooKeeper ownership this instance holds the
/// lease; if the holder is an instance that is no longer a live member (killed, paused past
/// its session, cut off), its backend would keep the slot until `wal_sender_timeout`, so it
/// is terminated. A live member's session (a previous owner still closing) or a session that
/// is not a coordinated streamer's is never touched: the caller retries.
async fn take_slot_from_dead_owner(sql: &Client, slot_name: &str, lease: &OwnerLease) -> Result<(), Error> {
    let Some(me) = lease.instance() else { return Ok(()) };
    let holder = slot::holder(sql, slot_name).await.map_err(|e| Error::from_db("reading the slot holder", e))?;
    let Some(holder) = holder else { return Ok(()) };
    let Some(owner) = outbox_postgres::connect::instance_of(&holder.application_name) else {
        return Err(Error::busy(format!(
            "slot {slot_name:?} is held by backend {} ({:?}), which is not a coordinated outbox-streamer; it is left alone",
            holder.pid, holder.application_name
        )));
    };
    if owner == me || lease.is_live_member(owner) {
        return Err(Error::busy(format!(
            "slot {slot_name:?} is still held by live instance {owner:?} (backend {})",
            holder.pid
        )));
    }
    tracing::warn!(slot = %slot_name, pid = holder.pid, previous_owner = %owner, "the slot is held by an instance that is no longer a member; terminating its backend");
    slot::terminate(sql, holder.pid).await.map_err(|e| Error::from_db("terminating the stale slot holder", e))?;
    Err(Error::busy(format!("slot {slot_name:?}: terminated the backend of departed instance {owner:?}")))
}

fn stream_error(slot: &str, storage: Storage, e: StreamError) -> Error {
    let lost = |what: String| match storage {
        Storage::Wal => wal_position_lost(slot, &what, None),
        Storage::Table => Error::position_lost(what),
    };
    let error = if e.slot_in_use() {
        Error::busy(format!("slot {slot:?} is in use by another session (another streamer owns it?): {e}"))
    } else if e.slot_missing() {
        lost(format!("replication slot {slot:?} does not exist (dropped?)"))
    } else if e.slot_invalidated() {
        lost(format!("replication slot {slot:?} can no longer stream: {e}"))
    } else if let StreamError::Decode(_) | StreamError::UnknownRelation(_) = e {
        Error::definite(
            format!("slot {slot:?}: {e}"),
            "report this as a bug with the PostgreSQL version; restarting replays from the slot",
        )
    } else {
        return crate::dberror::classify(&format!("slot {slot:?}"), e, crate::dberror::Channel::Replication);
    };
    error.with_source(e)
}

impl Source for PgSource {
    type Position = Lsn;
    const POSITION_HEADER: &'static str = "outbox-lsn";

    async fn next(&mut self) -> Result<Option<SourceEvent<Lsn>>, Error> {
        loop {
            let next = self.stream.next();
            let received = match self.silence_limit {
                Some(limit) => match tokio::time::timeout_at(self.last_heard + limit, next).await {
                    Ok(r) => r,
                    Err(_) => {
                        return Err(Error::transient(format!(
                            "slot {:?}: nothing heard for {limit:?} although a heartbeat is configured; the connection is presumed dead",
                            self.names.slot
                        )));
                    }
                },
                None => next.await,
            };
            self.last_heard = tokio::time::Instant::now();
            let change = match received {
                Ok(Some(c)) => c,
                Ok(None) => return Ok(None),
                Err(e) => return Err(stream_error(&self.names.slot, self.storage, e)),
            };
            let event = match change {
                Change::Begin { final_lsn, xid } => {
                    self.begun = final_lsn;
                    self.xids.push_back((xid, final_lsn));
                    self.replay.begin(|published| final_lsn < *published);
                    self.in_drained = self.drained.as_ref().is_some_and(|d| d.covers(final_lsn, xid));
                    if self.drained.as_ref().is_some_and(|d| final_lsn >= d.upto) {
                        self.drained = None;
                    }
                    SourceEvent::Begin { label: final_lsn.to_string() }
                }
                Change::Relation(rel) => {
                    if rel.name == self.names.table {
                        let map = ColumnMap::new(&rel, self.layout).keyed(self.keys.clone());
                        for problem in map.problems() {
                            tracing::warn!(
                                table = %self.names.table,
                                "{problem}: rows logged this way cannot be published as logged; each one is checked against the table"
                            );
                        }
                        self.columns = Some(map);
                    }
                    continue;
                }
                Change::Insert { relation, values } => {
                    let map = match &self.columns {
                        Some(m) if m.relation_id == relation.id => m,
                        _ => {
                            tracing::warn!(table = %relation.name, "insert into a table outside this stream's publication; ignored");
                            continue;
                        }
                    };
                    if self.replay.skip_row() || self.in_drained {
                        metrics::counter!(crate::metrics::SKIPPED_REPLAYED_ROWS, &self.metric_labels).increment(1);
                        continue;
                    }
                    SourceEvent::Row(map.record(&values, self.begun))
                }
                Change::Commit { end_lsn, .. } => SourceEvent::Commit(end_lsn),
                Change::KeepAlive { wal_end } => SourceEvent::Idle(wal_end),
                Change::Message { transactional, lsn, prefix, content } => {
                    match self.on_message(transactional, lsn, &prefix, &content) {
                        Some(event) => event,
                        None => continue,
                    }
                }
                Change::Unexpected { tag } => {
                    tracing::warn!(
                        %tag,
                        publication = %self.names.publication,
                        "an update, delete or truncate reached the stream; the publication should be publish = 'insert'"
                    );
                    continue;
                }
            };
            return Ok(Some(event));
        }
    }

    fn finish(
        &mut self,
        ids: Arc<[i64]>,
        upto: Lsn,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'static + use<> {
        let covered: Vec<u32> = self.xids.iter().take_while(|(_, lsn)| *lsn < upto).map(|(x, _)| *x).collect();
        self.finishing = self.keys.is_some().then(|| ids.clone());
        let finish = Finish {
            sql: self.sql.clone(),
            deleter: self.deleter.clone(),
            table: self.names.table.clone(),
            checkpoint_table: self.checkpoint_table.clone(),
            keys: self.keys.clone(),
        };
        finish.run(ids, upto, covered)
    }

    fn finished(&mut self, upto: Lsn) {
        self.xids.retain(|(_, lsn)| *lsn >= upto);
        self.replay.finished(upto);
        if let (Some(keys), Some(ids)) = (&self.keys, self.finishing.take()) {
            keys.finished(&ids);
        }
        // Only now, with the delete committed, may the slot forget these transactions.
        self.stream.confirm(upto);
    }

    fn confirm_idle(&mut self, position: Lsn) {
        self.xids.retain(|(_, lsn)| *lsn >= position);
        self.stream.confirm(position);
    }

    async fn history(&mut self) -> Result<String, Error> {
        super::connect::history(&self.sql).await
    }

    async fn close(self) {
        let confirmed = self.stream.confirmed();
        self.stream.shutdown().await;
        if confirmed.as_u64() == 0 {
            return;
        }
        if self.storage == Storage::Wal {
            // No delete stores a published-up-to mark for WAL-only messages: store the
            // confirmed position once per session, so a replay skips what was finished and a
            // lost slot's halt can name where the messages that may be lost begin.
            let sql = format!(
                "UPDATE {} SET published_lsn = greatest(published_lsn, $2::text::pg_lsn), updated_at = now() WHERE stream = $1",
                outbox_postgres::setup::ident(&self.checkpoint_table)
            );
            if let Err(e) = self.sql.execute(&sql, &[&self.names.table, &confirmed.to_pg_string()]).await {
                tracing::debug!(error = %e, "could not store the confirmed position in the checkpoint on close");
            }
        }
        // The replication protocol has no final status on CopyDone; record the position now
        // so a restart does not replay what was already confirmed. The walsender may hold the
        // slot for a moment after the session closed.
        for _ in 0..50 {
            match slot::advance(&self.sql, &self.names.slot, confirmed).await {
                Ok(()) => return,
                // The walsender still holds the slot (55006, "is active for PID").
                Err(e) if e.code() == Some(&SqlState::OBJECT_IN_USE) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "could not advance the slot on close; the server replays from its last status");
                    return;
                }
            }
        }
    }

    async fn current_rows(&mut self, ids: &[i64]) -> Result<Vec<crate::poll::PolledRow>, Error> {
        // A row of the transaction being read may not be visible yet (see `visibility`).
        if let Some(&(xid, _)) = self.xids.back() {
            visibility::wait(&self.sql, &[xid]).await?;
        }
        match &self.keys {
            None => super::poll::rows_by_id(&self.sql, &self.names.table, ids, self.layout).await,
            Some(keys) => {
                let known = keys.keys_of(ids);
                if known.len() < ids.len() {
                    return Err(crate::row_keys::unknown(ids.len() - known.len()));
                }
                super::keyed::rows_by_key(&self.sql, &self.names.table, &known, self.layout).await
            }
        }
    }

    async fn existing(&mut self, ids: &[i64]) -> Result<Vec<i64>, Error> {
        let (table, column) = (&self.names.table, self.layout.id_column());
        let Some(keys) = &self.keys else {
            return within("checking rows", cleanup::existing_ids(&self.sql, table, column, ids)).await;
        };
        let known = keys.keys_of(ids);
        let texts: Vec<String> = known.iter().map(|(_, k)| k.clone()).collect();
        let found = within("checking rows", cleanup::existing_uuids(&self.sql, table, column, &texts)).await?;
        let found: std::collections::HashSet<String> = found.into_iter().collect();
        let mut ids: Vec<i64> = known.into_iter().filter(|(_, k)| found.contains(k)).map(|(id, _)| id).collect();
        ids.sort_unstable();
        Ok(ids)
    }

    fn sweeps(&self) -> bool {
        self.keys.is_none()
    }

    fn row_keys(&self) -> Option<RowKeys> {
        self.keys.clone()
    }

    async fn probe(&mut self, below: Option<i64>, limit: usize) -> Result<Probe<Lsn>, Error> {
        // One statement, one snapshot: the WAL insert position is read after the snapshot was
        // taken, so every commit the reads saw is before it.
        let sql = format!(
            "SELECT ARRAY(SELECT {id}::int8 FROM {t} WHERE {id} <= $1::int8 ORDER BY {id} LIMIT $2),
                    (SELECT max({id})::int8 FROM {t}), pg_current_wal_insert_lsn()::text",
            t = outbox_postgres::setup::ident(&self.names.table),
            id = outbox_postgres::setup::ident(self.layout.id_column())
        );
        let below = below.unwrap_or(i64::MIN);
        let row = within("sweeping the table", self.sql.query_one(&sql, &[&below, &(limit as i64)])).await?;
        let mark: String = row.get(2);
        let mark = Lsn::parse(&mark).map_err(|e| Error::transient(format!("reading the WAL position: {e}")))?;
        Ok(Probe { candidates: row.get(0), max_id: row.get(1), mark })
    }

    fn progress_mark(position: &Lsn) -> Option<String> {
        Some(position.to_string())
    }

    /// A transaction's commit record starts at its `final_lsn` and ends at its `end_lsn`, the
    /// position stored for it; every later transaction's starts at or after that end.
    fn begun_within(&self, mark: &str) -> Result<bool, Error> {
        let mark = Lsn::parse(mark).map_err(|e| crate::progress::unreadable(mark, &e.to_string()))?;
        Ok(self.begun < mark)
    }

    fn reached(done: &Lsn, mark: &Lsn) -> bool {
        done >= mark
    }

    fn skips(&self, id: Option<i64>, message: bool, label: &str) -> bool {
        match id {
            None => self.skips.skips_transaction(label),
            Some(id) if message => self.skips.skips_message(id),
            Some(id) => {
                // A row read by key is skipped by its key (`skip --id <uuid>`), never by its
                // surrogate.
                let bound = match &self.keys {
                    Some(keys) => keys.key_of(id).and_then(|key| self.skips.bound_of_key(&key).map(str::to_string)),
                    None => self.skips.bound_of(id).map(str::to_string),
                };
                let (Some(bound), Some(&(_, commit))) = (bound, self.xids.back()) else {
                    return false;
                };
                Lsn::parse(&bound).is_ok_and(|bound| commit < bound)
            }
        }
    }
}
