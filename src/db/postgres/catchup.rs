//! PostgreSQL catch-up: mark, make sure a slot exists, take a bound, wait out the table's
//! writers, drain inside one snapshot, then move the stream's position to the bound.
//!
//! The slot is created (a) before anything is read. Then the WAL insert position `L` is read,
//! and after it the transactions writing the table. A transaction whose commit is before `L`
//! is either visible already or, not yet visible, still holds its lock on the table (a
//! transaction releases its locks only after it became visible), so it is among those writers;
//! once they have all ended, every row committed before `L` is visible. The drain (b) then
//! reads inside one `REPEATABLE READ` snapshot `S` taken after that, with the WAL position `M`
//! read right after it: `S` holds every transaction committed before `L` and some committed
//! between `L` and `M`. After the drain, `L` becomes the published-up-to mark and the slot
//! moves to it; `S` and `M` are stored beside it. The stream (c) starts with the transactions
//! committed after `L` and skips those `S` saw committed (and so the drain sent), up to `M`:
//! nothing is sent twice — not even when the slot was older (a return from polling mode, whose
//! slot lags behind what polling sent) — and a transaction the drain could not see is the
//! stream's.

use std::time::{Duration, Instant};

use outbox_postgres::connect::PgTarget;
use outbox_postgres::setup::ident;
use outbox_postgres::slot;
use tokio_postgres::Client;

use futures::future::BoxFuture;

use super::poll::PgPollTable;
use crate::catchup::{CatchUp, CatchUpReport, Drain, report};
use crate::config::Storage;
use crate::dberror::{self, Channel};
use crate::error::Error;
use crate::layout::Layout;
use crate::names::StreamNames;
use crate::poll::{PollTable, Writers};

const WRITERS_CHECK: Duration = Duration::from_millis(50);
const WRITERS_LOG_EVERY: Duration = Duration::from_secs(10);

fn missing_checkpoint(checkpoint_table: &str, what: String) -> Error {
    Error::definite(
        what,
        format!(
            "run `outbox-streamer setup`: it creates {checkpoint_table}, where each shard-partition keeps its catch-up state"
        ),
    )
}

/// Whether a catch-up of `table` is pending (interrupted, or polling mode ran).
pub(crate) async fn pending(client: &Client, checkpoint_table: &str, table: &str) -> Result<bool, Error> {
    let sql = format!("SELECT catchup_pending FROM {} WHERE stream = $1", ident(checkpoint_table));
    match client.query_opt(&sql, &[&table]).await {
        Ok(Some(row)) => Ok(row.get(0)),
        Ok(None) => Err(missing_checkpoint(checkpoint_table, format!("{checkpoint_table} has no row for {table}"))),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
            Err(missing_checkpoint(checkpoint_table, format!("table {checkpoint_table} does not exist")))
        }
        Err(e) => Err(Error::from_db(&format!("reading {checkpoint_table}"), e)),
    }
}

/// Marks a catch-up of `table` as needed before it streams again, and claims the stream for
/// owner `epoch`: from then on the polling deletes of an older owner are refused (the fence
/// PostgreSQL polling has instead of a slot; see `PgPollTable::fenced_by`).
pub(crate) async fn mark_pending(
    client: &Client,
    checkpoint_table: &str,
    table: &str,
    epoch: i64,
) -> Result<(), Error> {
    let sql = format!(
        "UPDATE {} SET catchup_pending = true, catchup_started_at = now(), owner_epoch = $2, updated_at = now()
         WHERE stream = $1 AND owner_epoch <= $2",
        ident(checkpoint_table)
    );
    let n = client
        .execute(&sql, &[&table, &epoch])
        .await
        .map_err(|e| Error::from_db(&format!("updating {checkpoint_table}"), e))?;
    if n == 0 {
        // Either there is no row, or a newer owner claimed it.
        pending(client, checkpoint_table, table).await?;
        return Err(crate::db::fenced(table, epoch));
    }
    Ok(())
}

/// The catch-up of one shard-partition, handed to its job.
#[derive(Debug, Clone)]
pub(super) struct PgCatchUp {
    pub target: PgTarget,
    pub names: StreamNames,
    pub checkpoint: String,
    pub storage: Storage,
    pub layout: Layout,
}

impl CatchUp for PgCatchUp {
    fn run<'a>(
        &'a self,
        drain: &'a mut Drain<'_>,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<Option<CatchUpReport>, Error>> {
        let epoch = drain.labels.lease.db_epoch();
        Box::pin(run(self, epoch, drain, reason))
    }
}

/// Runs the whole catch-up of one shard-partition. `Ok(None)`: the process is stopping and
/// the catch-up stays pending.
pub(crate) async fn run(
    of: &PgCatchUp,
    epoch: i64,
    drain: &mut Drain<'_>,
    reason: &str,
) -> Result<Option<CatchUpReport>, Error> {
    let PgCatchUp { target, names, checkpoint, storage, layout } = of;
    let (checkpoint_table, storage, layout) = (checkpoint.as_str(), *storage, *layout);
    let started = Instant::now();
    tracing::warn!(reason, table = %names.table, "catching up by polling before streaming resumes");
    let client = target
        .connect()
        .await
        .map_err(|e| Error::from_db(&format!("connecting to {}", target.display()), e).connecting())?;
    if layout.mapping().is_some() && super::keyed::is_uuid(&client, &names.table, layout.id_column()).await? {
        return Err(super::keyed::no_order(&names.table, layout.id_column(), "cannot catch up"));
    }
    mark_pending(&client, checkpoint_table, &names.table, epoch).await?;
    ensure_slot(&client, &names.slot, storage).await?;
    let mut reader = PgPollTable::connect(target, &names.table, layout).await?;
    let cleaner = PgPollTable::connect(target, &names.table, layout).await?;
    let bound: String = client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .map_err(|e| Error::from_db("reading the WAL position", e))?
        .get(0);
    let bound =
        outbox_postgres::Lsn::parse(&bound).map_err(|e| Error::transient(format!("reading the WAL position: {e}")))?;
    let writers = match reader.writers().await? {
        Writers::Known(writers) => writers,
        Writers::Hidden | Writers::Unknown => Vec::new(),
    };
    let waiting_since = Instant::now();
    let mut logged = Instant::now();
    while reader.any_running(&writers).await? {
        if logged.elapsed() >= WRITERS_LOG_EVERY {
            logged = Instant::now();
            tracing::warn!(
                waited_s = waiting_since.elapsed().as_secs(),
                "catch-up waits for transactions that were writing to {} when it started",
                names.table
            );
        }
        tokio::select! {
            _ = tokio::time::sleep(WRITERS_CHECK) => {}
            _ = drain.stop.changed() => return Ok(None),
        }
    }
    let (snapshot, snapshot_lsn) = reader.enter_snapshot().await?;
    let rows = match reader.max_id().await? {
        None => 0,
        Some(upto) => match drain.run(reader, cleaner, upto, true).await? {
            Some(rows) => rows,
            None => return Ok(None),
        },
    };
    // Every row committed before the bound was sent by the drain (or deleted by someone else
    // before it could be, which in a catch-up only the table can tell). With `wal` storage
    // the slot also holds messages the drain cannot send: it stays, and the stream replays
    // the rows too (duplicates, never a loss).
    let (bound, drained) = match storage {
        Storage::Table => {
            slot::advance(&client, &names.slot, bound)
                .await
                .map_err(|e| Error::from_db(&format!("moving slot {} to {bound}", names.slot), e))?;
            (Some(bound.to_pg_string()), Some((snapshot, snapshot_lsn.to_pg_string())))
        }
        Storage::Wal => (None, None),
    };
    let (snapshot, snapshot_lsn) = drained.unzip();
    let sql = format!(
        "UPDATE {} SET catchup_pending = false, last_catchup_at = now(), last_catchup_rows = $2,
                published_lsn = greatest(published_lsn, $3::text::pg_lsn), catchup_snapshot = $4,
                catchup_snapshot_lsn = $5::text::pg_lsn, updated_at = now()
         WHERE stream = $1",
        ident(checkpoint_table)
    );
    client
        .execute(&sql, &[&names.table, &(rows as i64), &bound, &snapshot, &snapshot_lsn])
        .await
        .map_err(|e| Error::from_db(&format!("updating {checkpoint_table}"), e))?;
    Ok(Some(report(drain.labels, started, rows)))
}

/// Makes sure a usable slot exists: creates a missing one, replaces an invalidated one. Slot
/// names are cluster-wide: only this database's slot is ever dropped, and a slot of the name
/// that belongs to another database halts the shard-partition with the fix instead.
async fn ensure_slot(client: &Client, name: &str, storage: Storage) -> Result<(), Error> {
    let state = slot::state(client, name).await.map_err(|e| Error::from_db(&format!("reading slot {name}"), e))?;
    if storage == Storage::Wal
        && (!state.exists || state.wal_status.as_deref() == Some("lost"))
        && state.other_database.is_none()
    {
        return Err(super::cdc::wal_position_lost(
            name,
            &format!("replication slot {name:?} is missing or invalidated"),
            state.confirmed_flush,
        ));
    }
    if let Some(database) = &state.other_database {
        return Err(dberror::slot_elsewhere(name, database));
    }
    if state.exists && state.wal_status.as_deref() != Some("lost") {
        return Ok(());
    }
    if state.exists {
        if state.active_pid.is_some() {
            return Err(Error::transient(format!(
                "slot {name:?} is invalidated but still held by PID {:?}; waiting for it to let go",
                state.active_pid
            )));
        }
        // The statement itself checks database, holder and wal_status again.
        let dropped = slot::drop_lost(client, name).await.map_err(|e| {
            dberror::classify(&format!("dropping the invalidated slot {name}"), e, Channel::Replication)
        })?;
        if !dropped {
            return Err(Error::transient(format!("slot {name:?} changed while being replaced; checking again")));
        }
        tracing::warn!(slot = name, "dropped the invalidated slot");
    }
    match client.execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", &[&name]).await {
        Ok(_) => {
            tracing::warn!(slot = name, "created a new slot; the stream resumes from it after the catch-up");
            Ok(())
        }
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) => {
            // Created meanwhile: by this database's streamer, or by another database's.
            let state =
                slot::state(client, name).await.map_err(|e| Error::from_db(&format!("reading slot {name}"), e))?;
            match &state.other_database {
                Some(database) => Err(dberror::slot_elsewhere(name, database)),
                None => Ok(()),
            }
        }
        Err(e) => Err(dberror::classify(&format!("creating slot {name}"), e, Channel::Replication)),
    }
}
