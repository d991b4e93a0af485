//! The database side of a bench run, for PostgreSQL or MariaDB: a fresh database and
//! least-privilege streamer login, log bytes written, the server's CPU, and the writers.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::Context;
use clap::ValueEnum;
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{self, Conn, TxOpts};
use outbox_postgres::connect::PgTarget;
use serde::Serialize;

use super::load::{Committed, WriterPlan};
use super::procstat;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum DbKind {
    Postgres,
    Mariadb,
}

/// A transaction left open for the whole run, the classic polling pathology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum HoldOpen {
    /// Holds a snapshot (REPEATABLE READ): dead rows cannot be cleaned up behind it.
    Reader,
    /// Inserted an outbox row and has not committed.
    Writer,
}

/// The open transaction of [`BenchDb::hold_open`].
pub(super) enum HeldTxn {
    Pg(tokio_postgres::Client),
    My(Conn),
}

impl HeldTxn {
    /// Commits it.
    pub(super) async fn finish(self) -> anyhow::Result<()> {
        match self {
            HeldTxn::Pg(c) => c.batch_execute("COMMIT").await?,
            HeldTxn::My(mut c) => {
                c.query_drop("COMMIT").await?;
                c.disconnect().await?;
            }
        }
        Ok(())
    }
}

/// The run's own database and streamer login, dropped afterwards. `Debug` shows no URL or
/// password.
#[derive(Clone)]
pub(super) struct BenchDb {
    pub kind: DbKind,
    root_url: String,
    name: String,
    pub admin_url: String,
    /// `scheme://user@host:port/database` of the streamer's login, without its password.
    streamer_url: String,
    /// The streamer login's password, kept out of files (see [`BenchDb::streamer_url_with`]).
    pub streamer_password: String,
}

/// Ids per table in a multi-table run.
const ID_RANGE: i64 = 1_000_000_000_000;
/// Rows per transaction of a backlog.
const BACKLOG_TXN_ROWS: usize = 10_000;

impl std::fmt::Debug for BenchDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BenchDb({:?} {})", self.kind, self.name)
    }
}

/// 32 hex digits from the standard library's randomly keyed hasher: unguessable, and safe in a
/// URL and in SQL quotes.
fn random_password() -> String {
    use std::hash::BuildHasher;
    let state = std::collections::hash_map::RandomState::new();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{:016x}{:016x}", state.hash_one(nanos), state.hash_one(std::process::id()))
}

fn split_url(url: &str) -> anyhow::Result<(&str, &str)> {
    let (base, _) = url.rsplit_once('/').context("the service URL ends with /database")?;
    let hostport = base.rsplit_once('@').map_or(base, |(_, h)| h);
    Ok((base, hostport))
}

impl BenchDb {
    pub(super) async fn create(kind: DbKind, root_url: &str, name: &str) -> anyhow::Result<Self> {
        let password = random_password();
        let (base, hostport) = split_url(root_url)?;
        let streamer_url = match kind {
            DbKind::Postgres => {
                let root =
                    PgTarget::from_url(root_url, None)?.connect().await.context("connecting as OUTBOX_PG_URL")?;
                // One statement per call: DROP and CREATE DATABASE refuse a transaction block.
                for sql in [
                    format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
                    format!("CREATE DATABASE {name}"),
                    format!("DROP ROLE IF EXISTS {name}_streamer"),
                    format!("CREATE ROLE {name}_streamer LOGIN REPLICATION PASSWORD '{password}'"),
                    format!("GRANT CONNECT ON DATABASE {name} TO {name}_streamer"),
                ] {
                    root.batch_execute(&sql).await?;
                }
                format!("postgres://{name}_streamer@{hostport}/{name}")
            }
            DbKind::Mariadb => {
                let mut root = my_connect(root_url).await.context("connecting as OUTBOX_MYSQL_URL")?;
                for sql in [
                    format!("DROP DATABASE IF EXISTS {name}"),
                    format!("CREATE DATABASE {name}"),
                    format!("DROP USER IF EXISTS '{name}_s'@'127.0.0.1'"),
                    format!("CREATE USER '{name}_s'@'127.0.0.1' IDENTIFIED BY '{password}'"),
                    format!("GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO '{name}_s'@'127.0.0.1'"),
                ] {
                    root.query_drop(sql).await?;
                }
                root.disconnect().await?;
                format!("mysql://{name}_s@{hostport}/{name}")
            }
        };
        Ok(Self {
            kind,
            root_url: root_url.into(),
            name: name.into(),
            admin_url: format!("{base}/{name}"),
            streamer_url,
            streamer_password: password,
        })
    }

    /// The streamer's URL with `password` (a `${VAR}` reference, in a config file) after the
    /// user name.
    pub(super) fn streamer_url_with(&self, password: &str) -> String {
        match self.streamer_url.split_once('@') {
            Some((user, rest)) => format!("{user}:{password}@{rest}"),
            None => self.streamer_url.clone(),
        }
    }

    /// Transactions ended so far in each other database of a PostgreSQL server (committed or
    /// rolled back, from `pg_stat_database`); empty for MariaDB, which counts none per database.
    pub(super) async fn other_databases_transactions(&self) -> anyhow::Result<BTreeMap<String, i64>> {
        if self.kind != DbKind::Postgres {
            return Ok(BTreeMap::new());
        }
        let c = PgTarget::from_url(&self.admin_url, None)?.connect().await?;
        let rows = c
            .query(
                "SELECT datname::text, xact_commit + xact_rollback FROM pg_stat_database
                 WHERE datname IS NOT NULL AND datname <> $1",
                &[&self.name],
            )
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// The other databases of a MariaDB server with a session at work right now (not idle, not
    /// a binlog reader, not the run's streamer); empty for PostgreSQL (see [`Self::other_databases_transactions`]).
    pub(super) async fn other_databases_busy(&self) -> anyhow::Result<Vec<String>> {
        if self.kind != DbKind::Mariadb {
            return Ok(Vec::new());
        }
        let mut c = my_connect(&self.admin_url).await?;
        let busy: Vec<String> = c
            .exec(
                "SELECT DISTINCT coalesce(DB, '(no database)') FROM information_schema.PROCESSLIST
                 WHERE COMMAND NOT IN ('Sleep', 'Daemon', 'Binlog Dump', 'Binlog Dump GTID')
                   AND ID <> CONNECTION_ID() AND coalesce(DB, '') <> ? AND USER <> ?",
                (&self.name, format!("{}_s", self.name)),
            )
            .await?;
        c.disconnect().await?;
        Ok(busy)
    }

    pub(super) fn kind_str(&self) -> &'static str {
        match self.kind {
            DbKind::Postgres => "postgres",
            DbKind::Mariadb => "mysql",
        }
    }

    /// Bytes of WAL (PostgreSQL) or binlog (MariaDB) written so far by the server.
    pub(super) async fn log_bytes(&self) -> anyhow::Result<i64> {
        match self.kind {
            DbKind::Postgres => {
                let c = PgTarget::from_url(&self.admin_url, None)?.connect().await?;
                Ok(c.query_one("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint", &[]).await?.get(0))
            }
            DbKind::Mariadb => {
                let mut c = my_connect(&self.admin_url).await?;
                let logs: Vec<mysql_async::Row> = c.query("SHOW BINARY LOGS").await?;
                c.disconnect().await?;
                Ok(logs.iter().filter_map(|r| r.get::<i64, _>(1)).sum())
            }
        }
    }

    /// CPU seconds of the database server so far.
    pub(super) fn server_cpu(&self, services_dir: &Path) -> Option<f64> {
        match self.kind {
            DbKind::Postgres => procstat::service_pid(services_dir, "postgres").and_then(procstat::server_cpu_seconds),
            DbKind::Mariadb => procstat::service_pid(services_dir, "mariadb").and_then(procstat::cpu_seconds),
        }
    }

    /// Gives each table its own id range (table `i` starts at `i × 10¹²`), so an `outbox-id`
    /// names one row across the run's shard-partitions.
    pub(super) async fn separate_id_ranges(&self, tables: &[String]) -> anyhow::Result<()> {
        for (i, table) in tables.iter().enumerate().skip(1) {
            let start = i as i64 * ID_RANGE;
            match self.kind {
                DbKind::Postgres => {
                    let c = PgTarget::from_url(&self.admin_url, None)?.connect().await?;
                    let t = outbox_postgres::setup::ident(table);
                    c.batch_execute(&format!("ALTER TABLE {t} ALTER COLUMN id RESTART WITH {start}")).await?;
                }
                DbKind::Mariadb => {
                    let mut c = my_connect(&self.admin_url).await?;
                    let t = outbox_mysql::setup::ident(table);
                    c.query_drop(format!("ALTER TABLE {t} AUTO_INCREMENT = {start}")).await?;
                    c.disconnect().await?;
                }
            }
        }
        Ok(())
    }

    /// Inserts `rows` rows into `table` in transactions of [`BACKLOG_TXN_ROWS`], keys spread
    /// over 16 values; returns their ids with the time the last transaction committed.
    pub(super) async fn insert_backlog(
        &self,
        table: &str,
        topic: &str,
        rows: usize,
        payload: &[u8],
        wal: bool,
        progress: &AtomicUsize,
    ) -> anyhow::Result<Committed> {
        let mut ids = Vec::with_capacity(rows);
        let mut left = rows;
        match self.kind {
            DbKind::Postgres if wal => {
                let c = PgTarget::from_url(&self.admin_url, None)?.connect().await?;
                let sql = "SELECT (pg_logical_emit_message(true, $1, e) - '0/0'::pg_lsn)::bigint FROM unnest($2::bytea[]) AS u(e)";
                while left > 0 {
                    let n = left.min(BACKLOG_TXN_ROWS);
                    let keys: Vec<Vec<u8>> = (0..n).map(|g| format!("b{}", g % 16).into_bytes()).collect();
                    let payloads: Vec<&[u8]> = (0..n).map(|_| payload).collect();
                    let envelopes = super::load::envelopes(topic, &keys, &payloads);
                    let rows = c.query(sql, &[&table, &envelopes]).await?;
                    ids.extend(rows.iter().map(|r| r.get::<_, i64>(0)));
                    left -= n;
                    progress.fetch_add(n, Ordering::Relaxed);
                }
            }
            DbKind::Postgres => {
                let c = PgTarget::from_url(&self.admin_url, None)?.connect().await?;
                let sql = format!(
                    "INSERT INTO {} (topic, msg_key, payload)
                     SELECT $1, convert_to('b' || (g % 16), 'UTF8'), $2::bytea
                     FROM generate_series(1, $3) g RETURNING id",
                    outbox_postgres::setup::ident(table)
                );
                while left > 0 {
                    let n = left.min(BACKLOG_TXN_ROWS);
                    let rows = c.query(&sql, &[&topic, &payload, &(n as i32)]).await?;
                    ids.extend(rows.iter().map(|r| r.get::<_, i64>(0)));
                    left -= n;
                    progress.fetch_add(n, Ordering::Relaxed);
                }
            }
            DbKind::Mariadb => {
                let mut c = my_connect(&self.admin_url).await?;
                let t = outbox_mysql::setup::ident(table);
                while left > 0 {
                    let n = left.min(BACKLOG_TXN_ROWS);
                    let mut tx = c.start_transaction(TxOpts::default()).await?;
                    // The Sequence engine's seq_1_to_<n>; ids of one statement are consecutive.
                    tx.exec_drop(
                        format!(
                            "INSERT INTO {t} (topic, msg_key, payload)
                             SELECT ?, CONCAT('b', seq % 16), ? FROM seq_1_to_{n}"
                        ),
                        (topic, payload),
                    )
                    .await?;
                    let first = tx.last_insert_id();
                    tx.commit().await?;
                    let first = match wal {
                        true => wal_first_id(&mut c).await?,
                        false => first.context("no LAST_INSERT_ID after INSERT")? as i64,
                    };
                    ids.extend(first..first + n as i64);
                    left -= n;
                    progress.fetch_add(n, Ordering::Relaxed);
                }
                c.disconnect().await?;
            }
        }
        let at = Instant::now();
        Ok(ids.into_iter().map(|id| (id, at)).collect())
    }

    /// Commits one row (for the warm-up).
    /// Marks `table`'s catch-up pending in `checkpoint`, as a return from polling mode does:
    /// the streamer's next start drains the table by polling before it streams.
    pub(super) async fn mark_catch_up_pending(&self, checkpoint: &str, table: &str) -> anyhow::Result<()> {
        match self.kind {
            DbKind::Postgres => {
                let c = PgTarget::from_url(&self.admin_url, None)?.connect().await?;
                let sql = format!(
                    "UPDATE {} SET catchup_pending = true WHERE stream = $1",
                    outbox_postgres::setup::ident(checkpoint)
                );
                anyhow::ensure!(c.execute(&sql, &[&table]).await? == 1, "{checkpoint} has no row for {table}");
            }
            DbKind::Mariadb => {
                let mut c = my_connect(&self.admin_url).await?;
                let sql = format!(
                    "UPDATE {} SET catchup_pending = 1 WHERE stream = ?",
                    outbox_mysql::setup::ident(checkpoint)
                );
                c.exec_drop(sql, (table,)).await?;
                anyhow::ensure!(c.affected_rows() == 1, "{checkpoint} has no row for {table}");
                c.disconnect().await?;
            }
        }
        Ok(())
    }

    pub(super) async fn insert_one(&self, table: &str, topic: &str, key: &str) -> anyhow::Result<()> {
        match self.kind {
            DbKind::Postgres => {
                let c = PgTarget::from_url(&self.admin_url, None)?.connect().await?;
                let sql = format!(
                    "INSERT INTO {} (topic, msg_key, payload) VALUES ($1, $2, 'warm-up')",
                    outbox_postgres::setup::ident(table)
                );
                c.execute(&sql, &[&topic, &key.as_bytes()]).await?;
            }
            DbKind::Mariadb => {
                let mut c = my_connect(&self.admin_url).await?;
                let sql = format!(
                    "INSERT INTO {} (topic, msg_key, payload) VALUES (?, ?, 'warm-up')",
                    outbox_mysql::setup::ident(table)
                );
                c.exec_drop(sql, (topic, key.as_bytes())).await?;
                c.disconnect().await?;
            }
        }
        Ok(())
    }

    /// Opens a transaction that stays open until [`HeldTxn::finish`]: a reader holding a
    /// snapshot, or a writer that inserted one outbox row into `table`.
    pub(super) async fn hold_open(&self, kind: HoldOpen, table: &str, topic: &str) -> anyhow::Result<HeldTxn> {
        match self.kind {
            DbKind::Postgres => {
                let c = PgTarget::from_url(&self.admin_url, None)?.connect().await?;
                let t = outbox_postgres::setup::ident(table);
                c.batch_execute(&match kind {
                    HoldOpen::Reader => format!("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM {t}"),
                    HoldOpen::Writer => {
                        format!("BEGIN; INSERT INTO {t} (topic, payload) VALUES ('{topic}', 'held-open')")
                    }
                })
                .await?;
                Ok(HeldTxn::Pg(c))
            }
            DbKind::Mariadb => {
                let mut c = my_connect(&self.admin_url).await?;
                let t = outbox_mysql::setup::ident(table);
                match kind {
                    HoldOpen::Reader => {
                        c.query_drop("START TRANSACTION WITH CONSISTENT SNAPSHOT").await?;
                        c.query_drop(format!("SELECT count(*) FROM {t}")).await?;
                    }
                    HoldOpen::Writer => {
                        c.query_drop("START TRANSACTION").await?;
                        c.exec_drop(format!("INSERT INTO {t} (topic, payload) VALUES (?, 'held-open')"), (topic,))
                            .await?;
                    }
                }
                Ok(HeldTxn::My(c))
            }
        }
    }

    /// Creates the shared-keys tables with `keys` counters at 0.
    pub(super) async fn create_ledger(&self, keys: usize) -> anyhow::Result<()> {
        let fill = (0..keys).map(|k| format!("('k{k}', 0)")).collect::<Vec<_>>().join(",");
        let insert = format!("INSERT INTO bench_key_seq (k, n) VALUES {fill}");
        match self.kind {
            DbKind::Postgres => {
                let c = PgTarget::from_url(&self.admin_url, None)?.connect().await?;
                for sql in super::load::LEDGER_DDL {
                    c.batch_execute(sql).await?;
                }
                c.batch_execute(&insert).await?;
            }
            DbKind::Mariadb => {
                let mut c = my_connect(&self.admin_url).await?;
                for sql in super::load::LEDGER_DDL {
                    c.query_drop(sql).await?;
                }
                c.query_drop(insert).await?;
                c.disconnect().await?;
            }
        }
        Ok(())
    }

    /// Each row's position in its key's commit order (shared-keys workload).
    pub(super) async fn ledger(&self) -> anyhow::Result<std::collections::HashMap<i64, i64>> {
        Ok(match self.kind {
            DbKind::Postgres => {
                let c = PgTarget::from_url(&self.admin_url, None)?.connect().await?;
                c.query("SELECT id, n FROM bench_ledger", &[]).await?.iter().map(|r| (r.get(0), r.get(1))).collect()
            }
            DbKind::Mariadb => {
                let mut c = my_connect(&self.admin_url).await?;
                let rows: Vec<(i64, i64)> = c.query("SELECT id, n FROM bench_ledger").await?;
                c.disconnect().await?;
                rows.into_iter().collect()
            }
        })
    }

    /// Runs one writer of the plan.
    pub(super) async fn run_writer(&self, plan: WriterPlan, progress: Arc<AtomicUsize>) -> anyhow::Result<Committed> {
        match self.kind {
            DbKind::Postgres => {
                super::load::run_writer(PgTarget::from_url(&self.admin_url, None)?, plan, progress).await
            }
            DbKind::Mariadb => run_mariadb_writer(&self.admin_url, plan, progress).await,
        }
    }

    pub(super) async fn drop(&self) {
        let name = &self.name;
        match self.kind {
            DbKind::Postgres => {
                let Ok(target) = PgTarget::from_url(&self.root_url, None) else { return };
                let Ok(root) = target.connect().await else { return };
                for sql in [
                    format!(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '{name}' AND NOT active"
                    ),
                    format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
                    format!("DROP ROLE IF EXISTS {name}_streamer"),
                ] {
                    if let Err(e) = root.batch_execute(&sql).await {
                        tracing::warn!(error = %e, "bench cleanup: {sql}");
                    }
                }
            }
            DbKind::Mariadb => {
                let Ok(mut root) = my_connect(&self.root_url).await else { return };
                for sql in
                    [format!("DROP DATABASE IF EXISTS {name}"), format!("DROP USER IF EXISTS '{name}_s'@'127.0.0.1'")]
                {
                    if let Err(e) = root.query_drop(&sql).await {
                        tracing::warn!(error = %e, "bench cleanup: {sql}");
                    }
                }
                let _ = root.disconnect().await;
            }
        }
    }
}

pub(super) async fn my_connect(url: &str) -> anyhow::Result<Conn> {
    let opts = mysql_async::Opts::from_url(url).map_err(|_| anyhow::anyhow!("invalid MySQL URL"))?;
    Ok(Conn::new(opts).await?)
}

/// The `outbox-id` of the first row the connection's last transaction wrote into a BLACKHOLE
/// (`storage = "wal"`) table: its GTID sequence number × 2^24, the row's place added per row
/// (the streamer's identity of a WAL-only message; `id` means nothing in such a table).
async fn wal_first_id(conn: &mut Conn) -> anyhow::Result<i64> {
    let gtid: String = conn.query_first("SELECT @@last_gtid").await?.context("no @@last_gtid after COMMIT")?;
    let seq: i64 = gtid
        .rsplit('-')
        .next()
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("unexpected @@last_gtid {gtid:?}"))?;
    Ok(seq << 24)
}

/// A MariaDB writer: multi-row INSERTs, one transaction each. Ids of one statement are
/// consecutive from LAST_INSERT_ID() (innodb_autoinc_lock_mode 1, MariaDB's default).
async fn run_mariadb_writer(
    admin_url: &str,
    plan: WriterPlan,
    progress: Arc<AtomicUsize>,
) -> anyhow::Result<Committed> {
    let mut conn = my_connect(admin_url).await?;
    let values = vec!["(?, ?, ?)"; plan.rows_per_txn].join(",");
    let insert =
        format!("INSERT INTO {} (topic, msg_key, payload) VALUES {values}", outbox_mysql::setup::ident(&plan.table));
    let payload = plan.payload.clone();
    let mut committed = Vec::new();
    let mut ticker = super::load::ticker(&plan);
    let end = Instant::now() + plan.duration;
    let mut n = 0usize;
    while Instant::now() < end {
        if let Some(t) = ticker.as_mut() {
            t.tick().await;
        }
        let mut params: Vec<mysql_async::Value> = Vec::with_capacity(plan.rows_per_txn * 3);
        for i in 0..plan.rows_per_txn {
            params.push(plan.topic.clone().into());
            params.push(plan.key(n, i).into());
            params.push(payload.clone().into());
        }
        let keys: Vec<Vec<u8>> = (0..plan.rows_per_txn).map(|i| plan.key(n, i)).collect();
        n += plan.rows_per_txn;
        let mut tx = conn.start_transaction(TxOpts::default()).await?;
        tx.exec_drop(&insert, params).await?;
        let first = match plan.wal {
            true => 0,
            false => tx.last_insert_id().context("no LAST_INSERT_ID after INSERT")? as i64,
        };
        if plan.shared_keys {
            for (i, key) in keys.iter().enumerate() {
                tx.exec_drop("UPDATE bench_key_seq SET n = LAST_INSERT_ID(n + 1) WHERE k = ?", (key,)).await?;
                tx.exec_drop("INSERT INTO bench_ledger (id, n) VALUES (?, LAST_INSERT_ID())", (first + i as i64,))
                    .await?;
            }
        }
        tx.commit().await?;
        let at = Instant::now();
        let first = if plan.wal { wal_first_id(&mut conn).await? } else { first };
        committed.extend((0..plan.rows_per_txn as i64).map(|i| (first + i, at)));
        progress.fetch_add(plan.rows_per_txn, Ordering::Relaxed);
    }
    conn.disconnect().await?;
    Ok(committed)
}
