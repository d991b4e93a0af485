//! A PostgreSQL shard-partition's row in `<prefix>_checkpoint`: whether a catch-up is pending,
//! the published-up-to mark, and the operator's skip lists.
//!
//! The slot holds the stream's position; this row holds what the slot cannot: the commit LSN
//! below which every transaction was published **and deleted** by this stream. The mark is
//! written by the same statement as the delete (see `outbox_postgres::cleanup`), so it never
//! claims a row that is still in the table, and a slot that replays from an older position
//! (its status update lost in a crash, or a server that restarted) skips exactly those.

use outbox_postgres::Lsn;
use outbox_postgres::setup::ident;
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use super::snapshot::{Drained, PgSnapshot};
use crate::error::Error;
use crate::skip::SkipList;

/// What a session needs from the checkpoint row.
#[derive(Debug)]
pub(super) struct Stored {
    pub catchup_pending: bool,
    pub published: Option<Lsn>,
    pub skips: SkipList,
    /// What the last catch-up drained beyond `published` (see `super::snapshot`).
    pub drained: Option<Drained>,
}

fn run_setup(message: String) -> Error {
    Error::definite(
        message,
        "run `outbox-streamer setup`: it creates the checkpoint table and adds the columns this version needs",
    )
}

/// Reads the row of `table`.
pub(super) async fn read(client: &Client, checkpoint_table: &str, table: &str) -> Result<Stored, Error> {
    let sql = format!(
        "SELECT catchup_pending, published_lsn::text, skip_ids, skip_transactions, catchup_snapshot,
                catchup_snapshot_lsn::text
         FROM {} WHERE stream = $1",
        ident(checkpoint_table)
    );
    let row = match client.query_opt(&sql, &[&table]).await {
        Ok(Some(row)) => row,
        Ok(None) => return Err(run_setup(format!("{checkpoint_table} has no row for {table}"))),
        Err(e) if matches!(e.code(), Some(c) if *c == SqlState::UNDEFINED_TABLE || *c == SqlState::UNDEFINED_COLUMN) => {
            return Err(run_setup(format!(
                "cannot read {checkpoint_table}: {}",
                e.as_db_error().map_or_else(|| e.to_string(), |d| d.message().to_string())
            )));
        }
        Err(e) => return Err(Error::from_db(&format!("reading {checkpoint_table}"), e)),
    };
    let published = row
        .get::<_, Option<String>>(1)
        .map(|text| Lsn::parse(&text))
        .transpose()
        .map_err(|e| Error::transient(format!("reading {checkpoint_table}.published_lsn: {e}")))?;
    let skips = SkipList::parse(row.get(2), row.get(3)).map_err(|e| {
        Error::definite(
            format!("{checkpoint_table} row {table}: {e}"),
            format!(
                "correct or clear the column: UPDATE {checkpoint_table} SET skip_ids = NULL WHERE stream = '{table}'"
            ),
        )
    })?;
    let drained = match (row.get::<_, Option<String>>(4), row.get::<_, Option<String>>(5)) {
        (Some(snapshot), Some(upto)) => {
            let unreadable = |e: String| Error::transient(format!("reading {checkpoint_table}.catchup_snapshot: {e}"));
            let snapshot = PgSnapshot::parse(&snapshot).map_err(unreadable)?;
            let upto = Lsn::parse(&upto).map_err(|e| unreadable(e.to_string()))?;
            Some(Drained { snapshot, upto })
        }
        _ => None,
    };
    Ok(Stored { catchup_pending: row.get(0), published, skips, drained })
}
