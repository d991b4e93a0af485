//! Slot facts for `status`, metrics and start-up checks.

use pgwire_replication::Lsn;
use tokio_postgres::Client;

/// One slot as `pg_replication_slots` shows it.
///
/// Slot names are cluster-wide, but a logical slot decodes one database: a slot of the same
/// name created in another database is not this database's slot. It is never read, moved,
/// dropped or taken over from here; [`SlotState::other_database`] names its database so the
/// caller can refuse with the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotState {
    /// A slot of this name exists in the current database.
    pub exists: bool,
    /// The database of a slot of this name that belongs elsewhere (`""` for a physical slot).
    pub other_database: Option<String>,
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
            "SELECT database IS NOT DISTINCT FROM current_database(), coalesce(database, ''),
                    active_pid, confirmed_flush_lsn::text, wal_status,
                    (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let missing = SlotState {
        exists: false,
        other_database: None,
        active_pid: None,
        confirmed_flush: None,
        wal_status: None,
        lag_bytes: None,
    };
    Ok(match row {
        None => missing,
        Some(r) if !r.get::<_, bool>(0) => SlotState { other_database: Some(r.get(1)), ..missing },
        Some(r) => SlotState {
            exists: true,
            other_database: None,
            active_pid: r.get(2),
            confirmed_flush: r.get::<_, Option<String>>(3).and_then(|s| Lsn::parse(&s).ok()),
            wal_status: r.get(4),
            lag_bytes: r.get(5),
        },
    })
}

/// What [`lags`] runs (`$1` the slots' names), for its [`crate::prepared::Prepared`].
pub const LAGS: &str = "SELECT slot_name::text, (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint
     FROM pg_replication_slots
     WHERE slot_name::text = ANY($1::text[]) AND database IS NOT DISTINCT FROM current_database()";

/// For each of `slots` that is this database's, the bytes of WAL between its confirmed position
/// and the server's current one (`None` before its first confirmation), in one round trip.
/// `statement` holds [`LAGS`], prepared on `client`'s session at its first use.
pub async fn lags(
    client: &Client,
    statement: &mut crate::prepared::Prepared,
    slots: &[String],
) -> Result<Vec<(String, Option<i64>)>, tokio_postgres::Error> {
    let rows = client.query(&statement.on(client).await?, &[&slots]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Drops `slot` if it is this database's, invalidated (`wal_status = lost`) and not held.
/// Returns whether it was dropped; the conditions are checked in the same statement, so a slot
/// of another database, or one that became active meanwhile, is never touched.
pub async fn drop_lost(client: &Client, slot: &str) -> Result<bool, tokio_postgres::Error> {
    let n = client
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
             WHERE slot_name = $1 AND database = current_database() AND active_pid IS NULL AND wal_status = 'lost'",
            &[&slot],
        )
        .await?;
    Ok(n == 1)
}

/// Moves an inactive slot to `lsn` (never backwards). Used on shutdown, after the replication
/// session closed, so the last confirmed position is recorded at once.
pub async fn advance(client: &Client, slot: &str, lsn: Lsn) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)
             FROM pg_replication_slots
             WHERE slot_name = $1 AND database = current_database() AND confirmed_flush_lsn < $2::text::pg_lsn",
            &[&slot, &lsn.to_pg_string()],
        )
        .await?;
    Ok(())
}

/// Moves an inactive, valid slot to the server's current WAL position, so a slot nobody reads
/// (its shard-partition runs in polling mode) does not hold WAL. `statement` holds
/// [`ADVANCE_TO_CURRENT`], prepared on `client`'s session at its first use.
pub async fn advance_to_current(
    client: &Client,
    statement: &mut crate::prepared::Prepared,
    slot: &str,
) -> Result<(), tokio_postgres::Error> {
    client.execute(&statement.on(client).await?, &[&slot]).await?;
    Ok(())
}

/// What [`advance_to_current`] runs (`$1` the slot), for its [`crate::prepared::Prepared`].
pub const ADVANCE_TO_CURRENT: &str = "SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())
     FROM pg_replication_slots
     WHERE slot_name = $1 AND database = current_database() AND active_pid IS NULL
       AND wal_status IS DISTINCT FROM 'lost'";

/// The session holding a slot: its backend pid and `application_name` (empty when the
/// server does not show it to this role).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotHolder {
    pub pid: i32,
    pub application_name: String,
}

/// Who holds `slot` of this database now, if anyone.
pub async fn holder(client: &Client, slot: &str) -> Result<Option<SlotHolder>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT s.active_pid, coalesce(a.application_name, '')
             FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
             WHERE s.slot_name = $1 AND s.database = current_database() AND s.active_pid IS NOT NULL",
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
