//! What `teardown` finds of the objects `setup` created in one MySQL/MariaDB database, and how
//! it removes them.
//!
//! A shard-partition's table goes with its checkpoint row: `LOCK TABLES … WRITE` holds the
//! table (and the checkpoint table) from the moment its rows are counted until it is dropped,
//! so no row arrives in between. The table is dropped before its checkpoint row is deleted: a
//! failure in between leaves a row without a table, which the next teardown removes, never a
//! table whose position is gone. Table grants outlive `DROP TABLE` in MySQL and MariaDB (they
//! stay in `mysql.tables_priv` and would apply to a new table of the name), so they are revoked
//! once the table is gone. Every name is qualified with the source's database.

use mysql_async::Conn;
use mysql_async::prelude::Queryable;

use crate::setup::{ident, literal};

/// What teardown looks for in one database.
#[derive(Debug, Clone)]
pub struct TeardownPlan {
    pub database: String,
    /// Tables are `<table_prefix>_<shard>_<partition>`.
    pub table_prefix: String,
    /// The configured shard-partitions' tables.
    pub tables: Vec<String>,
    /// `<prefix>_checkpoint`.
    pub checkpoint_table: String,
    /// `<prefix>_enqueue`: a procedure or function of this name is removed.
    pub enqueue_routine: String,
    /// The streamer's login: its sessions mean a streamer runs.
    pub streamer_user: String,
}

/// What exists of one configured shard-partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableFound {
    pub table: String,
    /// Rows in the table now; `None` when there is no table.
    pub rows: Option<i64>,
    pub checkpoint_row: bool,
}

/// A table-level grant on one of the source's tables (`mysql.tables_priv`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableGrant {
    pub user: String,
    pub host: String,
    pub table: String,
    /// As the server lists them: `Select,Delete`.
    pub privileges: String,
}

impl TableGrant {
    /// `'user'@'host'`.
    pub fn grantee(&self) -> String {
        format!("{}@{}", literal(&self.user), literal(&self.host))
    }
}

/// A stored routine: `PROCEDURE` or `FUNCTION` and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routine {
    pub kind: String,
    pub name: String,
}

/// A session of the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub id: u64,
    pub host: String,
    pub command: String,
}

/// Everything teardown found in the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inventory {
    pub tables: Vec<TableFound>,
    pub checkpoint_table: bool,
    pub routines: Vec<Routine>,
    /// Sessions of the streamer's login, this one excluded. Empty when this login may not see
    /// other users' sessions (no PROCESS privilege).
    pub streamer_sessions: Vec<Session>,
    /// Table grants on the configured tables and the checkpoint table; `Err` holds why
    /// `mysql.tables_priv` could not be read.
    pub grants: Result<Vec<TableGrant>, String>,
    /// Tables named like the source's but outside its configured shard-partitions.
    pub strays: Vec<String>,
}

/// `` `database`.`name` ``.
fn qualified(plan: &TeardownPlan, name: &str) -> String {
    format!("{}.{}", ident(&plan.database), ident(name))
}

/// Reads what exists; changes nothing.
pub async fn inspect(conn: &mut Conn, plan: &TeardownPlan) -> Result<Inventory, mysql_async::Error> {
    let existing: Vec<String> =
        conn.exec("SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = ?", (&plan.database,)).await?;
    let has = |name: &str| existing.iter().any(|t| t == name);
    let checkpoint_table = has(&plan.checkpoint_table);
    let checkpoint_rows: Vec<String> = if checkpoint_table {
        conn.query(format!("SELECT stream FROM {}", qualified(plan, &plan.checkpoint_table))).await?
    } else {
        Vec::new()
    };
    let mut tables = Vec::with_capacity(plan.tables.len());
    for table in &plan.tables {
        let rows = if has(table) {
            conn.query_first::<i64, _>(format!("SELECT count(*) FROM {}", qualified(plan, table))).await?
        } else {
            None
        };
        tables.push(TableFound { table: table.clone(), rows, checkpoint_row: checkpoint_rows.contains(table) });
    }
    let pattern = format!("^{}_[0-9]+_[0-9]+$", plan.table_prefix);
    let strays: Vec<String> = conn
        .exec(
            "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = ? AND TABLE_NAME REGEXP ? ORDER BY 1",
            (&plan.database, &pattern),
        )
        .await?;
    let strays = strays.into_iter().filter(|t| !plan.tables.contains(t)).collect();
    let routines = conn
        .exec_map(
            "SELECT ROUTINE_TYPE, ROUTINE_NAME FROM information_schema.ROUTINES
             WHERE ROUTINE_SCHEMA = ? AND ROUTINE_NAME = ? ORDER BY 1",
            (&plan.database, &plan.enqueue_routine),
            |(kind, name)| Routine { kind, name },
        )
        .await?;
    let streamer_sessions = conn
        .exec_map(
            "SELECT ID, coalesce(HOST, ''), coalesce(COMMAND, '') FROM information_schema.PROCESSLIST
             WHERE USER = ? AND ID <> CONNECTION_ID() ORDER BY ID",
            (&plan.streamer_user,),
            |(id, host, command)| Session { id, host, command },
        )
        .await?;
    let grants = match conn
        .exec_map(
            "SELECT User, Host, Table_name, Table_priv FROM mysql.tables_priv WHERE Db = ? ORDER BY Table_name, User, Host",
            (&plan.database,),
            |(user, host, table, privileges)| TableGrant { user, host, table, privileges },
        )
        .await
    {
        Ok(all) => Ok(all
            .into_iter()
            .filter(|g: &TableGrant| plan.tables.contains(&g.table) || g.table == plan.checkpoint_table)
            .collect()),
        Err(mysql_async::Error::Server(e)) => Err(e.message),
        Err(e) => return Err(e),
    };
    Ok(Inventory { tables, checkpoint_table, routines, streamer_sessions, grants, strays })
}

/// How long teardown waits for a table's metadata lock (a transaction of the application or
/// the streamer) before it leaves the shard-partition, in seconds.
pub const LOCK_WAIT_TIMEOUT_S: u32 = 5;

/// What [`drop_table`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableDrop {
    /// The table (with `rows` rows; `None`: there was none) and its checkpoint row are gone.
    Dropped { rows: Option<i64>, checkpoint_row: bool },
    /// The table holds rows and `drop_pending` was not given; nothing changed.
    Pending(i64),
}

/// Drops one shard-partition's table and checkpoint row (see the module docs), unless the
/// table holds rows and `drop_pending` is false. Grants are revoked separately
/// ([`revoke`]), once the table is gone.
pub async fn drop_table(
    conn: &mut Conn,
    plan: &TeardownPlan,
    table: &str,
    checkpoint_table: bool,
    drop_pending: bool,
) -> Result<TableDrop, mysql_async::Error> {
    conn.query_drop(format!("SET SESSION lock_wait_timeout = {LOCK_WAIT_TIMEOUT_S}")).await?;
    let exists: Option<i64> = conn
        .exec_first(
            "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?",
            (&plan.database, table),
        )
        .await?;
    let mut locked = vec![format!("{} WRITE", qualified(plan, table))];
    if checkpoint_table {
        locked.push(format!("{} WRITE", qualified(plan, &plan.checkpoint_table)));
    }
    if exists.is_none() {
        locked.remove(0);
    }
    if !locked.is_empty() {
        conn.query_drop(format!("LOCK TABLES {}", locked.join(", "))).await?;
    }
    let result = drop_locked(conn, plan, table, exists.is_some(), checkpoint_table, drop_pending).await;
    if !locked.is_empty() {
        let unlocked = conn.query_drop("UNLOCK TABLES").await;
        if result.is_ok() {
            unlocked?;
        }
    }
    result
}

async fn drop_locked(
    conn: &mut Conn,
    plan: &TeardownPlan,
    table: &str,
    exists: bool,
    checkpoint_table: bool,
    drop_pending: bool,
) -> Result<TableDrop, mysql_async::Error> {
    let rows = if exists {
        let rows: i64 =
            conn.query_first(format!("SELECT count(*) FROM {}", qualified(plan, table))).await?.unwrap_or_default();
        if rows > 0 && !drop_pending {
            return Ok(TableDrop::Pending(rows));
        }
        conn.query_drop(format!("DROP TABLE {}", qualified(plan, table))).await?;
        Some(rows)
    } else {
        None
    };
    let checkpoint_row = if checkpoint_table {
        conn.exec_drop(format!("DELETE FROM {} WHERE stream = ?", qualified(plan, &plan.checkpoint_table)), (table,))
            .await?;
        conn.affected_rows() > 0
    } else {
        false
    };
    Ok(TableDrop::Dropped { rows, checkpoint_row })
}

/// Revokes a table grant (the table may be gone already).
pub async fn revoke(conn: &mut Conn, plan: &TeardownPlan, grant: &TableGrant) -> Result<(), mysql_async::Error> {
    let on = qualified(plan, &grant.table);
    let privileges: Vec<&str> = grant.privileges.split(',').filter(|p| !p.is_empty()).collect();
    if privileges.iter().any(|p| !p.eq_ignore_ascii_case("Grant")) {
        conn.query_drop(format!("REVOKE ALL PRIVILEGES ON {on} FROM {}", grant.grantee())).await?;
    }
    if privileges.iter().any(|p| p.eq_ignore_ascii_case("Grant")) {
        conn.query_drop(format!("REVOKE GRANT OPTION ON {on} FROM {}", grant.grantee())).await?;
    }
    Ok(())
}

/// Drops a stored routine of [`Inventory::routines`].
pub async fn drop_routine(conn: &mut Conn, plan: &TeardownPlan, routine: &Routine) -> Result<(), mysql_async::Error> {
    let kind = if routine.kind.eq_ignore_ascii_case("FUNCTION") { "FUNCTION" } else { "PROCEDURE" };
    conn.query_drop(format!("DROP {kind} {}", qualified(plan, &routine.name))).await
}

/// Drops the checkpoint table (every shard-partition's row with it).
pub async fn drop_checkpoint_table(conn: &mut Conn, plan: &TeardownPlan) -> Result<(), mysql_async::Error> {
    conn.query_drop(format!("DROP TABLE {}", qualified(plan, &plan.checkpoint_table))).await
}
