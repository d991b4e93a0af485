//! `outbox-streamer status`: every shard-partition's streamer state (asked of the running
//! instances, [`streamer`]), and its mode, position, lag, pending rows and last catch-up (read
//! from the databases, [`crate::db::Database::status`]).
//!
//! The exit code ([`verdict::exit`]) is the worst problem found: 2 when a shard-partition is
//! halted; 1 when one is not running while rows wait, lags beyond `--max-lag-bytes` or
//! `--max-pending-rows`, or has a missing or invalidated slot, a missing checkpoint, an
//! unreadable table or a catch-up still pending; 3 when `status` itself fails.

mod streamer;
mod verdict;

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;

use anyhow::Context;
use serde::Serialize;

use crate::config::{Config, Mode, SourceConfig};
use crate::db::{self, PENDING_COUNT_CAP, SlotProblem, StreamStatus};
use crate::names::StreamId;
use streamer::{Observed, Seen};
use verdict::Problem;
pub(super) use verdict::{Limits, exit};

#[derive(Debug, Default, Serialize)]
struct Row {
    source: String,
    shard: u32,
    partition: u32,
    mode: &'static str,
    /// `table` or `wal`.
    storage: &'static str,
    /// `at-least-once` or `exactly-once`.
    delivery: &'static str,
    /// `kafka` or `rabbitmq`.
    sink: &'static str,
    /// Settings that could lose messages (see [`StreamStatus::warning`]).
    warning: Option<String>,
    /// What the streamer is doing, as its instance reports it.
    streamer: Observed,
    /// PostgreSQL: the slot's `wal_status`, `missing`, or `other-db:<database>` when the name is
    /// another database's slot; MySQL: `checkpoint` or `missing`.
    state: String,
    /// PostgreSQL: the slot's confirmed LSN; MySQL: the stored GTID position (or file:offset).
    position: Option<String>,
    slot: Option<String>,
    active_pid: Option<i32>,
    lag_bytes: Option<i64>,
    rows_pending: Option<i64>,
    /// WAL-only messages waiting (see [`StreamStatus::messages_pending`]).
    messages_pending: Option<i64>,
    catchup_pending: Option<bool>,
    last_catchup_at: Option<String>,
    last_catchup_rows: Option<i64>,
    /// Under ZooKeeper ownership: the instance holding the lease, and its epoch.
    owner: Option<String>,
    owner_epoch: Option<i64>,
    /// Beyond `--max-lag-bytes` or `--max-pending-rows`.
    lagging: bool,
    healthy: bool,
    /// Why it is not healthy.
    problems: Vec<Problem>,
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
            storage: source.settings_for(id).storage.as_str(),
            delivery: source.settings_for(id).delivery.as_str(),
            sink: source.settings_for(id).sink.as_str(),
            key: format!("{}.{}", source.name, source.stream_names(id).table),
            ..Self::default()
        }
    }

    /// Rows in the table plus the WAL-only messages counted in the slot.
    fn pending(&self) -> Option<i64> {
        Some(self.rows_pending? + self.messages_pending.unwrap_or(0))
    }

    /// [`Self::pending`] when nothing waiting is uncounted (a `wal` stream whose slot could
    /// not be peeked may hold messages).
    fn pending_known(&self) -> Option<i64> {
        if self.storage == "wal" && self.messages_pending.is_none() { None } else { self.pending() }
    }

    /// The `pending` column: `N+` at the count's cap, `N+?` when WAL-only messages could not
    /// be counted.
    fn pending_text(&self) -> String {
        let Some(n) = self.pending() else { return "-".to_string() };
        let capped = if n >= PENDING_COUNT_CAP { "+" } else { "" };
        let unknown = if self.pending_known().is_none() { "+?" } else { "" };
        format!("{n}{capped}{unknown}")
    }

    /// The row of what the database says about one shard-partition, with its problems.
    fn of(source: &SourceConfig, found: StreamStatus) -> Self {
        let mut row = Self::new(source, found.id);
        row.problems.extend(found.slot_problem.map(|p| match p {
            SlotProblem::OtherDatabase(db) => Problem::SlotOfOtherDatabase(db),
            SlotProblem::Missing => Problem::SlotMissing,
            SlotProblem::Lost => Problem::SlotLost,
        }));
        row.state = found.state;
        row.position = found.position;
        row.slot = found.slot;
        row.active_pid = found.active_pid;
        row.lag_bytes = found.lag_bytes;
        row.warning = found.warning;
        row.rows_pending = found.rows_pending;
        row.messages_pending = found.messages_pending;
        (row.catchup_pending, row.last_catchup_at, row.last_catchup_rows) =
            (found.catchup_pending, found.last_catchup_at, found.last_catchup_rows);
        row.problems.extend(table_problems(&row, found.checkpoint_found));
        row
    }

    /// `<source>/<shard>/<partition>`, as halts and `skip --stream` name it.
    fn stream(&self) -> String {
        format!("{}/{}/{}", self.source, self.shard, self.partition)
    }
}

/// `metrics_address`: without coordination, the instance to ask instead of `[metrics] listen`.
pub(super) async fn status(
    config: &Config,
    json: bool,
    limits: Limits,
    metrics_address: Option<String>,
) -> anyhow::Result<ExitCode> {
    if metrics_address.is_some() && config.coordination.is_some() {
        anyhow::bail!(
            "--metrics-address is for instances without [coordination]; under ZooKeeper each owner publishes its own"
        );
    }
    let mut rows = Vec::new();
    for source in &config.sources {
        for found in db::of(source.kind).status(source).await? {
            rows.push(Row::of(source, found));
        }
    }
    let cluster = match &config.coordination {
        Some(c) => Some(owners(c, &mut rows).await?),
        None => {
            let address = metrics_address.or_else(|| config.metrics.listen.map(streamer::local_address));
            let asked = match &address {
                Some(a) => Some(streamer::ask(a).await),
                None => None,
            };
            for row in &mut rows {
                row.streamer = streamer::uncoordinated(&row.key, address.as_deref(), asked.as_ref(), row.active_pid);
            }
            None
        }
    };
    for row in &mut rows {
        row.streamer.settle(row.pending_known());
        let found = verdict::streamer_problems(row.streamer.state, row.pending(), row.lag_bytes, limits);
        row.problems.extend(found);
        row.lagging = row.problems.iter().any(Problem::is_lag);
        row.healthy = row.problems.is_empty();
    }
    let code = verdict::exit_code(rows.iter().flat_map(|r| &r.problems));
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        if let Some(line) = &cluster {
            println!("{line}");
        }
        print_table(&rows, config.coordination.is_some());
        print_reasons(&rows);
        if let Some(line) = api_line(config).await {
            println!("{line}");
        }
        print_verdict(&rows, code);
    }
    Ok(ExitCode::from(code))
}

/// With `[api]`: what the message table holds, as one line (or why it cannot be read).
async fn api_line(config: &Config) -> Option<String> {
    let api = config.api.as_ref()?;
    let source = config.sources.iter().find(|s| s.name == api.source)?;
    let read = async {
        let store = db::of(source.kind).message_store(source, api)?;
        store.summary().await
    };
    let n = |count: i64| {
        if count >= crate::api::store::SUMMARY_COUNT_CAP { format!("{count}+") } else { count.to_string() }
    };
    Some(match read.await {
        Ok(s) => format!(
            "message API (source {:?}): {} prepared{}{}; {} committed and {} rolled back in the last {} s",
            source.name,
            n(s.prepared),
            s.oldest_prepared_s
                .map(|age| format!(" (the oldest {age:.0} s ago, {} check-backs so far)", s.checks))
                .unwrap_or_default(),
            if s.given_up > 0 {
                format!(
                    ", {} given up by the check-back and waiting for an operator (GET /v1/messages/<id>)",
                    s.given_up
                )
            } else {
                String::new()
            },
            n(s.committed),
            n(s.rolled_back),
            api.keep_decisions_s
        ),
        Err(e) => {
            format!("message API (source {:?}): cannot read its table: {e:#}; has setup run with [api]?", source.name)
        }
    })
}

/// Fills each row's owner from ZooKeeper and asks each owner what its shard-partitions do.
/// Returns a line naming the cluster and its live instances.
async fn owners(c: &crate::config::CoordinationConfig, rows: &mut [Row]) -> anyhow::Result<String> {
    use outbox_zookeeper::paths::ClusterPaths;
    let settings = crate::coordination::session_settings(c);
    let client = outbox_zookeeper::connect(&settings).await.context("coordination.connect")?;
    let paths = ClusterPaths::new(&c.root, &c.cluster_name);
    let members = outbox_zookeeper::members::list(&client, &paths).await.context("reading the members")?;
    let names: Vec<&str> = members.iter().map(|m| m.instance.as_str()).collect();
    let addresses: BTreeMap<String, Option<String>> =
        members.iter().map(|m| (m.instance.clone(), m.view.metrics.clone())).collect();
    for row in rows.iter_mut() {
        let holder = outbox_zookeeper::lease::holder(&client, &paths, &row.key)
            .await
            .with_context(|| format!("reading the lease of {}", row.key))?;
        if let Some(h) = holder {
            (row.owner, row.owner_epoch) = (Some(h.instance), Some(h.epoch));
        }
    }
    drop(client);
    let wanted: BTreeSet<String> =
        rows.iter().filter_map(|r| addresses.get(r.owner.as_ref()?).cloned().flatten()).collect();
    let asked = streamer::ask_all(wanted).await;
    for row in rows.iter_mut() {
        row.streamer = streamer::coordinated(&row.key, row.owner.as_deref(), &addresses, &asked);
    }
    Ok(format!("cluster {}: {} live instance(s): {}", paths.base(), members.len(), names.join(", ")))
}

/// The problems of a row's table and checkpoint: unreadable, no checkpoint row, or a catch-up
/// owed before CDC can stream (polling mode owes none).
fn table_problems(row: &Row, checkpoint_found: bool) -> Vec<Problem> {
    let mut problems = Vec::new();
    if row.rows_pending.is_none() {
        problems.push(Problem::TableUnreadable);
    }
    if !checkpoint_found {
        problems.push(Problem::CheckpointMissing);
    }
    if row.catchup_pending == Some(true) && row.mode == "cdc" {
        problems.push(Problem::CatchUpPending);
    }
    problems
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
        "{:<10} {:>5} {:>9} {:<7} {:<19} {}{:<10} {:>8} {:>12} {:>9}  {:<28} position",
        "source",
        "shard",
        "partition",
        "mode",
        "streamer",
        owner_column(None),
        "db_state",
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
        let word = r.streamer.state.word();
        println!(
            "{:<10} {:>5} {:>9} {:<7} {:<19} {}{:<10} {:>8} {:>12} {:>9}  {:<28} {}",
            r.source,
            r.shard,
            r.partition,
            mode_text(r),
            if r.lagging { format!("{word} LAGGING") } else { word.to_string() },
            owner_column(Some(r)),
            r.state,
            r.active_pid.map_or_else(dash, |p| p.to_string()),
            r.lag_bytes.map_or_else(dash, |l| l.to_string()),
            r.pending_text(),
            catchup,
            r.position.clone().unwrap_or_else(dash),
        );
    }
}

/// The mode column: `cdc`, with `/wal` for WAL-only storage, `/eo` for exactly-once and
/// `/rmq` for a shard-partition that publishes to RabbitMQ.
fn mode_text(r: &Row) -> String {
    let mut text = r.mode.to_string();
    if r.storage == "wal" {
        text.push_str("/wal");
    }
    if r.delivery == "exactly-once" {
        text.push_str("/eo");
    }
    if r.sink == "rabbitmq" {
        text.push_str("/rmq");
    }
    text
}

/// One line per reason under the table: per shard-partition for a halt, a retry or a
/// catch-up (with how long it lasts); once for shard-partitions sharing the reason they are
/// starting, not running or unknown (one unreachable instance, one missing setting).
fn print_reasons(rows: &[Row]) {
    let mut shared: BTreeMap<(&str, &str), Vec<String>> = BTreeMap::new();
    let mut lines = Vec::new();
    for r in rows {
        let Some(reason) = &r.streamer.reason else { continue };
        let word = r.streamer.state.word();
        match r.streamer.state {
            Seen::Halted | Seen::Retrying | Seen::CatchingUp => {
                let since = r.streamer.for_s.map(|s| format!(" for {s} s")).unwrap_or_default();
                let at = r.streamer.instance.as_ref().map(|i| format!(" on {i}")).unwrap_or_default();
                lines.push(format!("{}: {word}{since}{at}: {reason}", r.stream()));
            }
            _ => shared.entry((word, reason.as_str())).or_default().push(r.stream()),
        }
    }
    for ((word, reason), streams) in shared {
        lines.push(format!("{}: {word}: {reason}", streams.join(", ")));
    }
    let mut warned: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for r in rows {
        if let Some(w) = &r.warning {
            warned.entry(w.as_str()).or_default().push(r.stream());
        }
    }
    for (warning, streams) in warned {
        lines.push(format!("{}: warning: {warning}", streams.join(", ")));
    }
    if !lines.is_empty() {
        println!();
        for line in lines {
            println!("{line}");
        }
    }
}

/// The last line: healthy, or the exit code and every problem. Shard-partitions whose
/// streamer could not be asked are counted, so "healthy" is never said of what was not seen.
fn print_verdict(rows: &[Row], code: u8) {
    let problems: Vec<String> =
        rows.iter().flat_map(|r| r.problems.iter().map(move |p| format!("{}: {p}", r.stream()))).collect();
    let unseen = match rows.iter().filter(|r| r.streamer.state == Seen::Unknown).count() {
        0 => String::new(),
        n => format!(" (the streamer's state of {n} of {} shard-partitions is unknown)", rows.len()),
    };
    println!();
    if problems.is_empty() {
        println!("healthy{unseen}");
    } else {
        println!("exit {code}: {}{unseen}", problems.join("; "));
    }
}
