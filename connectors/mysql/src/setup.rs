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
    /// `<prefix>`: tables are `<prefix>_<shard>_<partition>`, the procedure `<prefix>_enqueue`.
    pub prefix: String,
    pub shards: u32,
    pub partitions: u32,
    /// The streamer's accounts (`'user'@'host'`, quoted as GRANT takes them); granted SELECT,
    /// DELETE on the tables and write on the checkpoint.
    pub streamer_accounts: Vec<String>,
    /// The application's accounts or roles (quoted); granted INSERT on the tables and EXECUTE
    /// on the enqueue procedure.
    pub app_grantees: Vec<String>,
    /// The tables of shard-partitions with `storage = "wal"`: `ENGINE=BLACKHOLE`, so the
    /// server writes their rows to the binlog and stores nothing.
    pub wal_tables: Vec<String>,
    /// Whether the tables are outbox-streamer's own: created here, with the enqueue procedure
    /// and the application's grants. `false` for another outbox's tables (a drop-in layout):
    /// only the checkpoint table and the streamer's grants are made.
    pub owns_tables: bool,
}

impl SetupPlan {
    /// `<prefix>_enqueue`.
    pub fn enqueue_procedure(&self) -> String {
        format!("{}_enqueue", self.prefix)
    }
}

/// Quotes an identifier with backticks.
pub fn ident(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

/// Quotes a string literal.
pub fn literal(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "''"))
}

/// The DDL, the enqueue procedure and the grants, in order. `mariadb` replaces the procedure
/// in one statement; MySQL has no `CREATE OR REPLACE PROCEDURE`, so it is dropped first.
pub fn statements(plan: &SetupPlan, mariadb: bool) -> Vec<String> {
    let mut sql = Vec::new();
    for table in plan.tables.iter().filter(|_| plan.owns_tables) {
        sql.push(format!(
            "CREATE TABLE IF NOT EXISTS {} (\n\
             \x20   id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,\n\
             \x20   topic VARCHAR(249) NOT NULL,\n\
             \x20   msg_key VARBINARY(2048) NULL,\n\
             \x20   payload LONGBLOB NULL,\n\
             \x20   headers JSON NULL,\n\
             \x20   kafka_partition INT NULL,\n\
             \x20   created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)\n\
             ) ENGINE={}",
            ident(table),
            engine(plan, table)
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
    if plan.owns_tables {
        sql.extend(enqueue_procedure(plan, mariadb));
    }
    let db = ident(&plan.database);
    for account in &plan.streamer_accounts {
        for table in &plan.tables {
            sql.push(format!("GRANT SELECT, DELETE ON {db}.{} TO {account}", ident(table)));
        }
        sql.push(format!("GRANT SELECT, INSERT, UPDATE ON {db}.{} TO {account}", ident(&plan.checkpoint_table)));
    }
    for grantee in plan.app_grantees.iter().filter(|_| plan.owns_tables) {
        for table in &plan.tables {
            sql.push(format!("GRANT INSERT ON {db}.{} TO {grantee}", ident(table)));
        }
        sql.push(format!("GRANT EXECUTE ON PROCEDURE {db}.{} TO {grantee}", ident(&plan.enqueue_procedure())));
    }
    sql
}

/// The engine `table` must have: `BLACKHOLE` for `storage = "wal"`, else `InnoDB`.
fn engine(plan: &SetupPlan, table: &str) -> &'static str {
    if plan.wal_tables.iter().any(|t| t == table) { "BLACKHOLE" } else { "InnoDB" }
}

/// What switching storage needs done to existing tables and the server.
#[derive(Debug, Default)]
pub struct StorageChanges {
    /// The BLACKHOLE engine is not loaded: `INSTALL SONAME 'ha_blackhole'` first.
    pub install_blackhole: bool,
    /// `ALTER TABLE … ENGINE=…` for existing tables whose storage changed (empty ones only).
    pub alters: Vec<String>,
}

/// Compares the existing tables' engines with the plan. A table that holds rows is never
/// converted to BLACKHOLE (its rows would be discarded): a failure says to drain it first.
pub async fn storage_changes(
    conn: &mut Conn,
    plan: &SetupPlan,
) -> Result<(StorageChanges, Vec<CheckFailure>), mysql_async::Error> {
    let mut changes = StorageChanges::default();
    let mut failures = Vec::new();
    if !plan.wal_tables.is_empty() {
        let support: Option<String> =
            conn.query_first("SELECT SUPPORT FROM information_schema.ENGINES WHERE ENGINE = 'BLACKHOLE'").await?;
        changes.install_blackhole = !matches!(support.as_deref(), Some("YES" | "DEFAULT"));
    }
    let existing: Vec<(String, Option<String>)> = conn
        .exec("SELECT TABLE_NAME, ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = ?", (&plan.database,))
        .await?;
    for (table, found) in existing {
        if !plan.tables.contains(&table) {
            continue;
        }
        let wanted = engine(plan, &table);
        if found.as_deref().is_some_and(|f| f.eq_ignore_ascii_case(wanted)) {
            continue;
        }
        if wanted == "BLACKHOLE" {
            let rows: Option<i64> = conn.query_first(format!("SELECT COUNT(*) FROM {}", ident(&table))).await?;
            if let Some(n) = rows.filter(|n| *n > 0) {
                failures.push(CheckFailure {
                    what: format!(
                        "table {table} holds {n} row(s) not yet published; storage = \"wal\" makes it a BLACKHOLE table, which would discard them"
                    ),
                    fix: "keep storage = \"table\" for it until the streamer has published them (status shows 0 pending), then run setup again".into(),
                });
                continue;
            }
        }
        changes.alters.push(format!("ALTER TABLE {} ENGINE={wanted}", ident(&table)));
    }
    Ok((changes, failures))
}

/// Installs the BLACKHOLE engine (`StorageChanges::install_blackhole`). `Ok(None)`: it is
/// usable now; `Ok(Some(why))`: the server took the statement but the engine is still not
/// usable (a plugin uninstalled while in use stays `DELETED` until the server restarts).
pub async fn install_blackhole(conn: &mut Conn, mariadb: bool) -> Result<Option<String>, mysql_async::Error> {
    let install =
        if mariadb { "INSTALL SONAME 'ha_blackhole'" } else { "INSTALL PLUGIN BLACKHOLE SONAME 'ha_blackhole.so'" };
    // Another setup may have installed it meanwhile ("already installed"): the check decides.
    let installed = conn.query_drop(install).await;
    let support: Option<String> =
        conn.query_first("SELECT SUPPORT FROM information_schema.ENGINES WHERE ENGINE = 'BLACKHOLE'").await?;
    if matches!(support.as_deref(), Some("YES" | "DEFAULT")) {
        return Ok(None);
    }
    installed?;
    let status: Option<String> = conn
        .query_first("SELECT PLUGIN_STATUS FROM information_schema.PLUGINS WHERE PLUGIN_NAME = 'BLACKHOLE'")
        .await?;
    Ok(Some(format!(
        "the BLACKHOLE plugin is {} after INSTALL SONAME 'ha_blackhole'",
        status.unwrap_or_else(|| "missing".into())
    )))
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
        // A syntax error: a server that knows only the new name. Any other error (a missing
        // privilege) is the answer.
        Err(mysql_async::Error::Server(e)) if e.code == 1064 => conn.query_first("SHOW BINARY LOG STATUS").await?,
        Err(e) => return Err(e),
    };
    Ok(row
        .map(|mut r| (r.take::<String, _>(0).unwrap_or_default(), r.take::<u64, _>(1).unwrap_or(0)))
        .unwrap_or_default())
}

/// `<prefix>_enqueue(topic, key, payload, headers, shard)`: inserts into the partition table
/// of the key, routed exactly like PostgreSQL's `outbox_enqueue` — partition
/// `abs(first 4 bytes of md5(key) as a signed big-endian int) % partitions`, 0 for a NULL key —
/// and returns the new row's id as a one-row result (`id`). It runs with the caller's rights
/// (`SQL SECURITY INVOKER`): the caller needs INSERT on the tables, as `--app-role` grants.
pub fn enqueue_procedure(plan: &SetupPlan, mariadb: bool) -> Vec<String> {
    let name = ident(&plan.enqueue_procedure());
    let create = if mariadb { "CREATE OR REPLACE PROCEDURE" } else { "CREATE PROCEDURE" };
    let mut sql = Vec::new();
    if !mariadb {
        sql.push(format!("DROP PROCEDURE IF EXISTS {name}"));
    }
    sql.push(format!(
        "{create} {name}(\n\
         \x20   IN p_topic VARCHAR(249), IN p_key VARBINARY(2048), IN p_payload LONGBLOB,\n\
         \x20   IN p_headers JSON, IN p_shard INT)\n\
         SQL SECURITY INVOKER MODIFIES SQL DATA\n\
         BEGIN\n\
         \x20   DECLARE part INT DEFAULT 0;\n\
         \x20   DECLARE h BIGINT;\n\
         \x20   DECLARE msg VARCHAR(255);\n\
         \x20   IF p_shard IS NULL OR p_shard < 0 OR p_shard >= {shards} THEN\n\
         \x20       SET msg = CONCAT('outbox shard ', COALESCE(p_shard, 'NULL'), ' does not exist: shards are 0..{last_shard}; pass a shard below {shards}, or raise shards in the config and rerun outbox-streamer setup');\n\
         \x20       SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = msg;\n\
         \x20   END IF;\n\
         \x20   IF p_key IS NOT NULL AND {partitions} > 1 THEN\n\
         \x20       SET h = CONV(SUBSTR(MD5(p_key), 1, 8), 16, 10);\n\
         \x20       IF h >= 2147483648 THEN SET h = h - 4294967296; END IF;\n\
         \x20       SET part = ABS(h) % {partitions};\n\
         \x20   END IF;\n\
         \x20   SET @outbox_enqueue_sql = CONCAT('INSERT INTO `{prefix}_', p_shard, '_', part,\n\
         \x20       '` (topic, msg_key, payload, headers) VALUES (?, ?, ?, ?)');\n\
         \x20   SET @outbox_topic = p_topic, @outbox_key = p_key, @outbox_payload = p_payload, @outbox_headers = p_headers;\n\
         \x20   PREPARE outbox_enqueue_stmt FROM @outbox_enqueue_sql;\n\
         \x20   EXECUTE outbox_enqueue_stmt USING @outbox_topic, @outbox_key, @outbox_payload, @outbox_headers;\n\
         \x20   DEALLOCATE PREPARE outbox_enqueue_stmt;\n\
         \x20   SET @outbox_topic = NULL, @outbox_key = NULL, @outbox_payload = NULL, @outbox_headers = NULL, @outbox_enqueue_sql = NULL;\n\
         \x20   SELECT LAST_INSERT_ID() AS id;\n\
         END",
        shards = plan.shards,
        last_shard = plan.shards.saturating_sub(1),
        partitions = plan.partitions,
        prefix = plan.prefix,
    ));
    sql
}

/// Creates the tables and the procedure, grants, and seeds missing checkpoints with the
/// current position.
pub async fn apply(
    conn: &mut Conn,
    plan: &SetupPlan,
    mariadb: bool,
    changes: &StorageChanges,
) -> Result<(), mysql_async::Error> {
    for stmt in statements(plan, mariadb) {
        conn.query_drop(stmt).await?;
    }
    for alter in &changes.alters {
        conn.query_drop(alter).await?;
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
        // Rows already in the table (another outbox's backlog) were logged before that
        // position and never come through the binlog: `run` sends them by a catch-up first.
        if conn.affected_rows() == 1 {
            conn.exec_drop(
                format!(
                    "UPDATE {} SET catchup_pending = 1, catchup_started_at = NOW(6) \
                     WHERE stream = ? AND EXISTS (SELECT 1 FROM {})",
                    ident(&plan.checkpoint_table),
                    ident(table)
                ),
                (table,),
            )
            .await?;
        }
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

/// Checks the binlog settings and GTID availability (the logins: [`crate::privileges`]).
pub async fn check_server(conn: &mut Conn) -> Result<(BinlogSettings, Vec<CheckFailure>), mysql_async::Error> {
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
            prefix: "outbox".into(),
            shards: 1,
            partitions: 4,
            streamer_accounts: vec!["'streamer'@'%'".into()],
            app_grantees: vec!["'orders_app'".into()],
            wal_tables: Vec::new(),
            owns_tables: true,
        };
        let sql = statements(&plan, true).join(";\n");
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS `outbox_0_0`"));
        assert!(sql.contains("ENGINE=InnoDB"));
        let wal = SetupPlan { wal_tables: vec!["outbox_0_0".into()], ..plan.clone() };
        assert!(statements(&wal, true)[0].ends_with("ENGINE=BLACKHOLE"), "storage = \"wal\"");
        assert!(sql.contains("GRANT SELECT, DELETE ON `app`.`outbox_0_0` TO 'streamer'@'%'"));
        let theirs = statements(&SetupPlan { owns_tables: false, ..plan.clone() }, true).join(";\n");
        assert!(!theirs.contains("`outbox_0_0` (") && !theirs.contains("PROCEDURE") && !theirs.contains("orders_app"));
        assert!(theirs.contains("GRANT SELECT, DELETE ON `app`.`outbox_0_0` TO 'streamer'@'%'"));
        assert!(sql.contains("GRANT INSERT ON `app`.`outbox_0_0` TO 'orders_app'"));
        assert!(sql.contains("GRANT EXECUTE ON PROCEDURE `app`.`outbox_enqueue` TO 'orders_app'"));
        assert!(sql.contains("CREATE OR REPLACE PROCEDURE `outbox_enqueue`"));
        assert!(statements(&plan, false).iter().any(|s| s == "DROP PROCEDURE IF EXISTS `outbox_enqueue`"));
        assert!(sql.contains("GRANT SELECT, INSERT, UPDATE ON `app`.`outbox_checkpoint`"));
        assert_eq!(ident("a`b"), "`a``b`");
        assert_eq!(literal("it's"), "'it''s'");
    }
}
