//! The database side of a bench run, for PostgreSQL or MariaDB: a fresh database and
//! least-privilege streamer login, log bytes written, the server's CPU, and the writers.

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
pub enum DbKind {
    Postgres,
    Mariadb,
}

/// The run's own database and streamer login, dropped afterwards.
#[derive(Debug, Clone)]
pub struct BenchDb {
    pub kind: DbKind,
    root_url: String,
    name: String,
    pub admin_url: String,
    pub streamer_url: String,
}

fn split_url(url: &str) -> anyhow::Result<(&str, &str)> {
    let (base, _) = url.rsplit_once('/').context("the service URL ends with /database")?;
    let hostport = base.rsplit_once('@').map_or(base, |(_, h)| h);
    Ok((base, hostport))
}

impl BenchDb {
    pub async fn create(kind: DbKind, root_url: &str, name: &str) -> anyhow::Result<Self> {
        let password = format!("{name}-{}", u64::from(std::process::id()) * 7919);
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
                format!("postgres://{name}_streamer:{password}@{hostport}/{name}")
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
                format!("mysql://{name}_s:{password}@{hostport}/{name}")
            }
        };
        Ok(Self {
            kind,
            root_url: root_url.into(),
            name: name.into(),
            admin_url: format!("{base}/{name}"),
            streamer_url,
        })
    }

    pub fn kind_str(&self) -> &'static str {
        match self.kind {
            DbKind::Postgres => "postgres",
            DbKind::Mariadb => "mysql",
        }
    }

    /// Bytes of WAL (PostgreSQL) or binlog (MariaDB) written so far by the server.
    pub async fn log_bytes(&self) -> anyhow::Result<i64> {
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
    pub fn server_cpu(&self, services_dir: &Path) -> Option<f64> {
        match self.kind {
            DbKind::Postgres => procstat::service_pid(services_dir, "postgres").and_then(procstat::server_cpu_seconds),
            DbKind::Mariadb => procstat::service_pid(services_dir, "mariadb").and_then(procstat::cpu_seconds),
        }
    }

    /// Commits one row (for the warm-up).
    pub async fn insert_one(&self, table: &str, topic: &str, key: &str) -> anyhow::Result<()> {
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

    /// Runs one writer of the plan.
    pub async fn run_writer(&self, plan: WriterPlan, progress: Arc<AtomicUsize>) -> anyhow::Result<Committed> {
        match self.kind {
            DbKind::Postgres => {
                super::load::run_writer(PgTarget::from_url(&self.admin_url, None)?, plan, progress).await
            }
            DbKind::Mariadb => run_mariadb_writer(&self.admin_url, plan, progress).await,
        }
    }

    pub async fn drop(&self) {
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

async fn my_connect(url: &str) -> anyhow::Result<Conn> {
    let opts = mysql_async::Opts::from_url(url).map_err(|_| anyhow::anyhow!("invalid MySQL URL"))?;
    Ok(Conn::new(opts).await?)
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
    let payload = vec![b'x'; plan.payload_bytes];
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
            params.push(format!("w{}-k{}", plan.writer, (n + i) % plan.keys).into_bytes().into());
            params.push(payload.clone().into());
        }
        n += plan.rows_per_txn;
        let mut tx = conn.start_transaction(TxOpts::default()).await?;
        tx.exec_drop(&insert, params).await?;
        let first = tx.last_insert_id().context("no LAST_INSERT_ID after INSERT")? as i64;
        tx.commit().await?;
        let at = Instant::now();
        committed.extend((0..plan.rows_per_txn as i64).map(|i| (first + i, at)));
        progress.fetch_add(plan.rows_per_txn, Ordering::Relaxed);
    }
    conn.disconnect().await?;
    Ok(committed)
}
