//! `outbox-streamer status`: every shard-partition's mode, position, lag, pending rows and last
//! catch-up, read from the databases (so it works from any host).
//!
//! Exit code 1 when any shard-partition is unhealthy: a missing or invalidated slot, a missing
//! checkpoint, an unreadable table, or a catch-up still pending.

use std::process::ExitCode;

use anyhow::Context;
use outbox_mysql::mysql_async::Row as MyRow;
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_postgres::setup::ident;
use outbox_postgres::slot;
use serde::Serialize;

use crate::config::{Config, Mode, SourceConfig, SourceKind};
use crate::names::{StreamId, all_streams, checkpoint_table};

/// Pending rows are counted up to this many; more shows as this number and `+`.
const PENDING_COUNT_CAP: i64 = 1_000_000;

#[derive(Debug, Default, Serialize)]
struct Row {
    source: String,
    shard: u32,
    partition: u32,
    mode: &'static str,
    /// PostgreSQL: the slot's `wal_status`, `missing`, or `other-db:<database>` when the name is
    /// another database's slot; MySQL: `checkpoint` or `missing`.
    state: String,
    /// PostgreSQL: the slot's confirmed LSN; MySQL: the stored GTID position (or file:offset).
    position: Option<String>,
    slot: Option<String>,
    active_pid: Option<i32>,
    lag_bytes: Option<i64>,
    rows_pending: Option<i64>,
    catchup_pending: Option<bool>,
    last_catchup_at: Option<String>,
    last_catchup_rows: Option<i64>,
    /// Under ZooKeeper ownership: the instance holding the lease, and its epoch.
    owner: Option<String>,
    owner_epoch: Option<i64>,
    /// Beyond `--max-lag-bytes` or `--max-pending-rows`.
    lagging: bool,
    healthy: bool,
    /// The lease name, `<source>.<table>`.
    #[serde(skip)]
    key: String,
}

impl Row {
    fn new(source: &SourceConfig, id: StreamId) -> Self {
        Self {
            source: source.name.clone(),
            shard: id.shard,
            partition: id.partition,
            mode: match source.settings_for(id).mode {
                Mode::Cdc => "cdc",
                Mode::Polling => "polling",
            },
            key: format!("{}.{}", source.name, source.stream_names(id).table),
            ..Self::default()
        }
    }
}

/// Thresholds beyond which a shard-partition counts as lagging (unhealthy).
#[derive(Debug, Clone, Copy, Default)]
pub struct Limits {
    pub max_lag_bytes: Option<i64>,
    pub max_pending_rows: Option<i64>,
}

impl Limits {
    fn exceeded(&self, row: &Row) -> bool {
        let over = |value: Option<i64>, limit: Option<i64>| matches!((value, limit), (Some(v), Some(l)) if v > l);
        over(row.lag_bytes, self.max_lag_bytes) || over(row.rows_pending, self.max_pending_rows)
    }
}

pub async fn status(config: &Config, json: bool, limits: Limits) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    for source in &config.sources {
        match source.kind {
            SourceKind::Postgres => postgres_rows(source, &mut rows).await?,
            SourceKind::Mysql => mysql_rows(source, &mut rows).await?,
        }
    }
    for row in &mut rows {
        if limits.exceeded(row) {
            row.lagging = true;
            row.healthy = false;
        }
    }
    let cluster = match &config.coordination {
        Some(c) => Some(owners(c, &mut rows).await?),
        None => None,
    };
    if let (Some(line), false) = (&cluster, json) {
        println!("{line}");
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print_table(&rows, config.coordination.is_some());
    }
    Ok(if rows.iter().all(|r| r.healthy) { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Fills each row's owner from ZooKeeper; a shard-partition nobody owns is unhealthy.
/// Returns a line naming the cluster and its live instances.
async fn owners(c: &crate::config::CoordinationConfig, rows: &mut [Row]) -> anyhow::Result<String> {
    use outbox_zookeeper::paths::ClusterPaths;
    let settings = crate::coordination::session_settings(c);
    let client = outbox_zookeeper::connect(&settings).await.context("coordination.connect")?;
    let paths = ClusterPaths::new(&c.root, &c.cluster_name);
    let members = outbox_zookeeper::members::list(&client, &paths).await.context("reading the members")?;
    let names: Vec<&str> = members.iter().map(|m| m.instance.as_str()).collect();
    for row in rows.iter_mut() {
        let holder = outbox_zookeeper::lease::holder(&client, &paths, &row.key)
            .await
            .with_context(|| format!("reading the lease of {}", row.key))?;
        match holder {
            Some(h) => (row.owner, row.owner_epoch) = (Some(h.instance), Some(h.epoch)),
            None => row.healthy = false,
        }
    }
    Ok(format!("cluster {}: {} live instance(s): {}", paths.base(), members.len(), names.join(", ")))
}

fn count_sql(quoted_table: &str) -> String {
    format!("SELECT count(*) FROM (SELECT 1 FROM {quoted_table} LIMIT {PENDING_COUNT_CAP}) t")
}

async fn postgres_rows(source: &SourceConfig, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let target = crate::connect::pg_target(source, None)?;
    let client = target.connect().await.with_context(|| format!("connecting to {}", target.display()))?;
    let checkpoint = checkpoint_table(&source.table_prefix);
    for id in all_streams(source.shards, source.partitions) {
        let names = source.stream_names(id);
        let st = slot::state(&client, &names.slot).await?;
        let mut row = Row::new(source, id);
        row.rows_pending = client.query_one(&count_sql(&ident(&names.table)), &[]).await.ok().map(|r| r.get(0));
        let catchup = client
            .query_opt(
                &format!(
                    "SELECT catchup_pending, last_catchup_at::text, last_catchup_rows FROM {} WHERE stream = $1",
                    ident(&checkpoint)
                ),
                &[&names.table],
            )
            .await
            .ok()
            .flatten();
        if let Some(c) = &catchup {
            (row.catchup_pending, row.last_catchup_at, row.last_catchup_rows) = (c.get(0), c.get(1), c.get(2));
        }
        row.state = match (&st.other_database, st.exists) {
            (Some(db), _) => format!("other-db:{db}"),
            (None, true) => st.wal_status.clone().unwrap_or_else(|| "unknown".into()),
            (None, false) => "missing".into(),
        };
        row.healthy = st.exists
            && row.state != "lost"
            && row.rows_pending.is_some()
            && catchup.is_some()
            && (row.catchup_pending != Some(true) || row.mode == "polling");
        row.position = st.confirmed_flush.map(|l| l.to_string());
        row.slot = Some(names.slot);
        row.active_pid = st.active_pid;
        row.lag_bytes = st.lag_bytes;
        rows.push(row);
    }
    Ok(())
}

/// A MySQL checkpoint row: gtid, file, offset, catch-up pending, last catch-up time and rows.
type CheckpointRow = (Option<String>, Option<String>, Option<u64>, bool, Option<String>, Option<i64>);

async fn mysql_rows(source: &SourceConfig, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let opts = crate::connect::mysql_opts(source, None)?;
    let mut conn = crate::connect::mysql_connect(&opts).await.with_context(|| format!("source {:?}", source.name))?;
    let checkpoint = checkpoint_table(&source.table_prefix);
    // MySQL 8 adds an Encrypted column: take name and size by position.
    let logs: Vec<(String, u64)> = conn
        .query::<MyRow, _>("SHOW BINARY LOGS")
        .await
        .map(|rows| rows.iter().filter_map(|r| Some((r.get::<String, _>(0)?, r.get::<u64, _>(1)?))).collect())
        .unwrap_or_default();
    for id in all_streams(source.shards, source.partitions) {
        let names = source.stream_names(id);
        let mut row = Row::new(source, id);
        let quoted = outbox_mysql::setup::ident(&names.table);
        row.rows_pending = conn.query_first::<i64, _>(count_sql(&quoted)).await.ok().flatten();
        let stored: Option<CheckpointRow> = conn
            .exec_first(
                format!(
                    "SELECT gtid, binlog_file, binlog_pos, catchup_pending, CAST(last_catchup_at AS CHAR), last_catchup_rows
                     FROM {} WHERE stream = ?",
                    outbox_mysql::setup::ident(&checkpoint)
                ),
                (&names.table,),
            )
            .await
            .ok()
            .flatten();
        match stored {
            Some((gtid, file, offset, pending, last_at, last_rows)) => {
                row.state = "checkpoint".into();
                if let (Some(file), Some(offset), false) = (&file, offset, logs.is_empty()) {
                    row.lag_bytes = Some(crate::run::binlog_bytes_after(&logs, file, offset) as i64);
                }
                row.position = Some(match gtid {
                    Some(g) => g,
                    None => format!("{}:{}", file.unwrap_or_default(), offset.unwrap_or_default()),
                });
                (row.catchup_pending, row.last_catchup_at, row.last_catchup_rows) = (Some(pending), last_at, last_rows);
                row.healthy = row.rows_pending.is_some() && (!pending || row.mode == "polling");
            }
            None => row.state = "missing".into(),
        }
        rows.push(row);
    }
    let _ = conn.disconnect().await;
    Ok(())
}

/// The table; with `coordinated`, owner and epoch columns too.
fn print_table(rows: &[Row], coordinated: bool) {
    let owner_width = rows.iter().filter_map(|r| r.owner.as_ref().map(String::len)).max().unwrap_or(0).max(5);
    let owner_column = |r: Option<&Row>| -> String {
        if !coordinated {
            return String::new();
        }
        match r {
            None => format!("{:<owner_width$} {:>12} ", "owner", "epoch"),
            Some(r) => format!(
                "{:<owner_width$} {:>12} ",
                r.owner.as_deref().unwrap_or("NONE"),
                r.owner_epoch.map_or_else(|| "-".to_string(), |e| e.to_string())
            ),
        }
    };
    println!(
        "{:<10} {:>5} {:>9} {:<7} {:<10} {}{:>8} {:>12} {:>9}  {:<28} position",
        "source",
        "shard",
        "partition",
        "mode",
        "state",
        owner_column(None),
        "pid",
        "lag_bytes",
        "pending",
        "last catch-up"
    );
    let dash = || "-".to_string();
    for r in rows {
        let catchup = match (r.catchup_pending, &r.last_catchup_at) {
            (Some(true), _) if r.mode == "cdc" => "PENDING".to_string(),
            (_, Some(at)) => format!("{} ({} rows)", at.get(..19).unwrap_or(at), r.last_catchup_rows.unwrap_or(0)),
            _ => dash(),
        };
        println!(
            "{:<10} {:>5} {:>9} {:<7} {:<10} {}{:>8} {:>12} {:>9}  {:<28} {}",
            r.source,
            r.shard,
            r.partition,
            r.mode,
            if r.lagging { format!("{} LAGGING", r.state) } else { r.state.clone() },
            owner_column(Some(r)),
            r.active_pid.map_or_else(dash, |p| p.to_string()),
            r.lag_bytes.map_or_else(dash, |l| l.to_string()),
            r.rows_pending.map_or_else(dash, |p| if p >= PENDING_COUNT_CAP { format!("{p}+") } else { p.to_string() }),
            catchup,
            r.position.clone().unwrap_or_else(dash),
        );
    }
}
