//! The schema objects of a MySQL/MariaDB source — one table per shard-partition and one
//! checkpoint table — as idempotent SQL, and the server and grant checks that say what to change.
//!
//! The checkpoint row of a shard-partition is created with the server's current binlog position
//! when it does not exist yet, so streaming starts exactly where setup left the (new, empty)
//! table. An existing checkpoint is never moved by setup.

use mysql_async::Conn;
use mysql_async::prelude::Queryable;

use crate::{BinlogSettings, check_binlog_settings};

/// What `setup` creates for one source.
#[derive(Debug, Clone)]
pub struct SetupPlan {
    pub database: String,
    /// `<prefix>_<shard>_<partition>` for every shard-partition.
    pub tables: Vec<String>,
    /// `<prefix>_checkpoint`.
    pub checkpoint_table: String,
    /// The streamer's login; granted SELECT, DELETE on the tables and write on the checkpoint.
    pub streamer_user: Option<String>,
}

/// Quotes an identifier with backticks.
pub fn ident(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

/// Quotes a string literal.
pub fn literal(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "''"))
}

/// The DDL and grants, in order. `'<host>'` in grants is filled in by [`apply`].
pub fn statements(plan: &SetupPlan) -> Vec<String> {
    let mut sql = Vec::new();
    for table in &plan.tables {
        sql.push(format!(
            "CREATE TABLE IF NOT EXISTS {} (\n\
             \x20   id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,\n\
             \x20   topic VARCHAR(249) NOT NULL,\n\
             \x20   msg_key VARBINARY(2048) NULL,\n\
             \x20   payload LONGBLOB NULL,\n\
             \x20   headers JSON NULL,\n\
             \x20   kafka_partition INT NULL,\n\
             \x20   created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)\n\
             ) ENGINE=InnoDB",
            ident(table)
        ));
    }
    sql.push(format!(
        "CREATE TABLE IF NOT EXISTS {} (\n\
         \x20   stream VARCHAR(128) NOT NULL PRIMARY KEY,\n\
         \x20   gtid TEXT NULL,\n\
         \x20   binlog_file VARCHAR(255) NULL,\n\
         \x20   binlog_pos BIGINT UNSIGNED NULL,\n\
         \x20   owner_epoch BIGINT NOT NULL DEFAULT 0,\n\
         \x20   catchup_pending TINYINT(1) NOT NULL DEFAULT 0,\n\
         \x20   catchup_started_at TIMESTAMP(6) NULL,\n\
         \x20   last_catchup_at TIMESTAMP(6) NULL,\n\
         \x20   last_catchup_rows BIGINT NULL,\n\
         \x20   updated_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6)\n\
         ) ENGINE=InnoDB",
        ident(&plan.checkpoint_table)
    ));
    if let Some(user) = &plan.streamer_user {
        for table in &plan.tables {
            sql.push(format!(
                "GRANT SELECT, DELETE ON {}.{} TO {}@'<host>'",
                ident(&plan.database),
                ident(table),
                literal(user)
            ));
        }
        sql.push(format!(
            "GRANT SELECT, INSERT, UPDATE ON {}.{} TO {}@'<host>'",
            ident(&plan.database),
            ident(&plan.checkpoint_table),
            literal(user)
        ));
    }
    sql
}

/// The server's current binlog position: GTID state and file/offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinlogPosition {
    /// MariaDB `@@gtid_binlog_pos` (`domain-server-seq,…`) or MySQL `@@gtid_executed`.
    pub gtid: String,
    pub file: String,
    pub offset: u64,
}

/// Reads the current binlog position.
pub async fn current_position(conn: &mut Conn, mariadb: bool) -> Result<BinlogPosition, mysql_async::Error> {
    let gtid: Option<String> = if mariadb {
        conn.query_first("SELECT @@gtid_binlog_pos").await?
    } else {
        conn.query_first("SELECT @@gtid_executed").await?
    };
    let (file, offset) = binlog_end(conn).await?;
    Ok(BinlogPosition { gtid: gtid.unwrap_or_default(), file, offset })
}

/// The current binlog file and the offset where the next event will be written.
pub async fn binlog_end(conn: &mut Conn) -> Result<(String, u64), mysql_async::Error> {
    // SHOW MASTER STATUS is gone in MySQL 8.4; SHOW BINARY LOG STATUS is its new name.
    let row: Option<mysql_async::Row> = match conn.query_first("SHOW MASTER STATUS").await {
        Ok(row) => row,
        Err(_) => conn.query_first("SHOW BINARY LOG STATUS").await?,
    };
    Ok(row
        .map(|mut r| (r.take::<String, _>(0).unwrap_or_default(), r.take::<u64, _>(1).unwrap_or(0)))
        .unwrap_or_default())
}

/// The host part of the streamer's account (`user@host`), looked up in `mysql.user`.
async fn streamer_hosts(conn: &mut Conn, user: &str) -> Result<Vec<String>, mysql_async::Error> {
    conn.exec("SELECT Host FROM mysql.user WHERE User = ?", (user,)).await
}

/// Creates the tables, seeds missing checkpoints with the current position, grants.
pub async fn apply(conn: &mut Conn, plan: &SetupPlan, mariadb: bool) -> Result<(), mysql_async::Error> {
    let hosts = match &plan.streamer_user {
        Some(user) => streamer_hosts(conn, user).await?,
        None => Vec::new(),
    };
    for stmt in statements(plan) {
        if stmt.contains("'<host>'") {
            for host in &hosts {
                conn.query_drop(stmt.replace("'<host>'", &literal(host))).await?;
            }
        } else {
            conn.query_drop(stmt).await?;
        }
    }
    add_missing_columns(conn, plan).await?;
    let position = current_position(conn, mariadb).await?;
    for table in &plan.tables {
        conn.exec_drop(
            format!(
                "INSERT IGNORE INTO {} (stream, gtid, binlog_file, binlog_pos) VALUES (?, ?, ?, ?)",
                ident(&plan.checkpoint_table)
            ),
            (table, &position.gtid, &position.file, position.offset),
        )
        .await?;
    }
    Ok(())
}

/// Columns added to the checkpoint table after its first version, with their definitions.
const LATER_COLUMNS: [(&str, &str); 7] = [
    ("catchup_pending", "TINYINT(1) NOT NULL DEFAULT 0"),
    ("catchup_started_at", "TIMESTAMP(6) NULL"),
    ("last_catchup_at", "TIMESTAMP(6) NULL"),
    ("last_catchup_rows", "BIGINT NULL"),
    // How far the stream got while its stored position waits before a prepared XA transaction.
    ("done_gtid", "TEXT NULL"),
    // The operator's skip lists (`outbox-streamer skip`).
    ("skip_ids", "TEXT NULL"),
    ("skip_transactions", "TEXT NULL"),
];

/// Brings a checkpoint table created by an older version up to date (MySQL has no
/// `ADD COLUMN IF NOT EXISTS`, so the columns are looked up first).
async fn add_missing_columns(conn: &mut Conn, plan: &SetupPlan) -> Result<(), mysql_async::Error> {
    let present: Vec<String> = conn
        .exec(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?",
            (&plan.database, &plan.checkpoint_table),
        )
        .await?;
    for (name, definition) in LATER_COLUMNS {
        if !present.iter().any(|p| p.eq_ignore_ascii_case(name)) {
            conn.query_drop(format!(
                "ALTER TABLE {}.{} ADD COLUMN {name} {definition}",
                ident(&plan.database),
                ident(&plan.checkpoint_table)
            ))
            .await?;
        }
    }
    Ok(())
}

/// One failed check: what is wrong and what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckFailure {
    pub what: String,
    pub fix: String,
}

impl std::fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}; fix: {}", self.what, self.fix)
    }
}

/// Checks the binlog settings, GTID availability and the streamer's global grants.
pub async fn check_server(
    conn: &mut Conn,
    plan: &SetupPlan,
) -> Result<(BinlogSettings, Vec<CheckFailure>), mysql_async::Error> {
    let settings = check_binlog_settings(conn).await?;
    let mut failures: Vec<CheckFailure> = settings
        .problems()
        .into_iter()
        .map(|p| {
            let (what, fix) = p.split_once("; ").unwrap_or((&p, "see docs/configure-mysql.md"));
            CheckFailure { what: what.to_string(), fix: fix.to_string() }
        })
        .collect();
    if !settings.is_mariadb() {
        let mode: Option<String> = conn.query_first("SELECT @@gtid_mode").await?;
        if mode.as_deref() != Some("ON") {
            failures.push(CheckFailure {
                what: format!("gtid_mode is {}", mode.unwrap_or_else(|| "unknown".into())),
                fix: "set gtid_mode=ON and enforce_gtid_consistency=ON".into(),
            });
        }
    }
    if let Some(user) = &plan.streamer_user {
        let hosts = streamer_hosts(conn, user).await?;
        if hosts.is_empty() {
            failures.push(CheckFailure {
                what: format!("the streamer user {user:?} does not exist"),
                fix: format!(
                    "CREATE USER {}@'%' IDENTIFIED BY '…'; GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO {}@'%' (see docs/configure-mysql.md)",
                    literal(user),
                    literal(user)
                ),
            });
        }
        for host in hosts {
            let grantee = format!("'{user}'@'{host}'");
            let privileges: Vec<String> = conn
                .exec("SELECT PRIVILEGE_TYPE FROM information_schema.USER_PRIVILEGES WHERE GRANTEE = ?", (&grantee,))
                .await?;
            let has = |p: &str| privileges.iter().any(|x| x == p || x == "ALL PRIVILEGES");
            let client = has("REPLICATION CLIENT") || has("BINLOG MONITOR");
            if !has("REPLICATION SLAVE") || !client {
                failures.push(CheckFailure {
                    what: format!(
                        "{grantee} lacks REPLICATION SLAVE or REPLICATION CLIENT (it has: {})",
                        privileges.join(", ")
                    ),
                    fix: format!("GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO {grantee}"),
                });
            }
        }
    }
    Ok((settings, failures))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_sql() {
        let plan = SetupPlan {
            database: "app".into(),
            tables: vec!["outbox_0_0".into()],
            checkpoint_table: "outbox_checkpoint".into(),
            streamer_user: Some("streamer".into()),
        };
        let sql = statements(&plan).join(";\n");
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS `outbox_0_0`"));
        assert!(sql.contains("ENGINE=InnoDB"));
        assert!(sql.contains("GRANT SELECT, DELETE ON `app`.`outbox_0_0` TO 'streamer'@'<host>'"));
        assert!(sql.contains("GRANT SELECT, INSERT, UPDATE ON `app`.`outbox_checkpoint`"));
        assert_eq!(ident("a`b"), "`a``b`");
        assert_eq!(literal("it's"), "'it''s'");
    }
}
