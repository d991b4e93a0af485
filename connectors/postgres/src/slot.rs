//! Slot facts for `status`, metrics and start-up checks.

use pgwire_replication::Lsn;
use tokio_postgres::Client;

/// One slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotState {
    pub exists: bool,
    pub active_pid: Option<i32>,
    pub confirmed_flush: Option<Lsn>,
    /// `wal_status`: reserved, extended, unreserved or lost.
    pub wal_status: Option<String>,
    /// Bytes of WAL between the slot's confirmed position and the server's current one.
    pub lag_bytes: Option<i64>,
}

pub async fn state(client: &Client, slot: &str) -> Result<SlotState, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT active_pid, confirmed_flush_lsn::text, wal_status,
                    (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(match row {
        None => SlotState { exists: false, active_pid: None, confirmed_flush: None, wal_status: None, lag_bytes: None },
        Some(r) => SlotState {
            exists: true,
            active_pid: r.get(0),
            confirmed_flush: r.get::<_, Option<String>>(1).and_then(|s| Lsn::parse(&s).ok()),
            wal_status: r.get(2),
            lag_bytes: r.get(3),
        },
    })
}

/// Moves an inactive slot to `lsn` (never backwards). Used on shutdown, after the replication
/// session closed, so the last confirmed position is recorded at once.
pub async fn advance(client: &Client, slot: &str, lsn: Lsn) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)
             FROM pg_replication_slots WHERE slot_name = $1 AND confirmed_flush_lsn < $2::text::pg_lsn",
            &[&slot, &lsn.to_pg_string()],
        )
        .await?;
    Ok(())
}

/// Moves an inactive, valid slot to the server's current WAL position, so a slot nobody reads
/// (its shard-partition runs in polling mode) does not hold WAL.
pub async fn advance_to_current(client: &Client, slot: &str) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())
             FROM pg_replication_slots
             WHERE slot_name = $1 AND active_pid IS NULL AND wal_status IS DISTINCT FROM 'lost'",
            &[&slot],
        )
        .await?;
    Ok(())
}

/// The session holding a slot: its backend pid and `application_name` (empty when the
/// server does not show it to this role).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotHolder {
    pub pid: i32,
    pub application_name: String,
}

/// Who holds `slot` now, if anyone.
pub async fn holder(client: &Client, slot: &str) -> Result<Option<SlotHolder>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT s.active_pid, coalesce(a.application_name, '')
             FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
             WHERE s.slot_name = $1 AND s.active_pid IS NOT NULL",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| SlotHolder { pid: r.get(0), application_name: r.get(1) }))
}

/// Ends the backend `pid` (the streamer's role may end its own role's sessions). Returns
/// whether the server signalled it.
pub async fn terminate(client: &Client, pid: i32) -> Result<bool, tokio_postgres::Error> {
    Ok(client.query_one("SELECT pg_terminate_backend($1)", &[&pid]).await?.get(0))
}
