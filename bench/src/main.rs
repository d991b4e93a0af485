//! `outbox-bench`: measured runs of the `outbox-streamer` binary against the running services.
//!
//! One run: a fresh database and least-privilege role, `outbox-streamer setup`, a fresh topic,
//! the streamer under test as a child process (`--mode cdc` or `--mode polling`) or none at
//! all (`--mode ceiling`, the database's own insert rate under the same load), writers at a
//! target rate for a duration, and a checking consumer. Reported: sustained messages/s,
//! latency from COMMIT returned to record consumed (one clock), streamer CPU seconds and peak
//! RSS, database CPU seconds per 1,000 messages, WAL bytes per message, and lost / duplicated /
//! out-of-commit-order counts. The process fails when a CDC run lost, duplicated or reordered
//! a record, or any run lost one.
//!
//! Reads `OUTBOX_PG_URL` or `OUTBOX_MYSQL_URL`, `OUTBOX_KAFKA_BROKERS` and
//! `OUTBOX_SERVICES_DIR` (for the database server's pid) as `scripts/services env` prints
//! them, and no configuration file: it writes the streamer's. With `--sink rabbitmq` the
//! streamer publishes to RabbitMQ (`OUTBOX_RABBITMQ_URL` or `--rabbitmq-url`) and the checker
//! consumes a queue bound to the run's exchange ([`rabbit`]).
//!
//! # What it knows of the streamer
//!
//! Only what an operator knows: the `outbox-streamer` binary (`--streamer-bin`, by default the
//! one beside this binary), its `setup` and `run` commands, the configuration file format
//! (docs/configuration.md) and two metric names (docs/metrics.md). It links none of the
//! streamer's code, so the production binary carries no load generator and no chart library,
//! and one bench binary can measure two builds of the streamer side by side.
//!
//! A run leaves nothing behind: its database, login and topic (or exchange and queue) are
//! dropped at the end, and its streamer config and log live in a private temporary directory
//! ([`private_dir`]) that is removed (a failed run, or one with `--keep-log`, keeps the log
//! there and says where). The config file holds no password: the streamer reads it (and a
//! RabbitMQ URL) from its environment.

// Only `outbox-kafka`'s queue_events.rs may use `unsafe` (the workspace denies it; this crate
// forbids it outright).
#![forbid(unsafe_code)]

mod api;
mod charts;
mod check;
mod db;
mod load;
mod neighbours;
mod payload;
mod private_dir;
mod procstat;
mod rabbit;
mod report;
mod run;
mod scenario;
mod tkms;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use serde::Serialize;

use db::{DbKind, HoldOpen};
use report::Report;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum BenchMode {
    /// The streamer in CDC mode (logical replication, binlog).
    Cdc,
    /// The streamer in polling mode (`SELECT … ORDER BY id LIMIT n` → publish → `DELETE`).
    Polling,
    /// No streamer: the database's own insert rate under the same load.
    Ceiling,
}

/// Where the messages live (the streamer's `storage` setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum BenchStorage {
    /// Rows of the outbox table (inserted by the writers, deleted by the streamer).
    #[default]
    Table,
    /// WAL-only messages: PostgreSQL logical messages written with `pg_logical_emit_message`,
    /// MariaDB rows inserted into a BLACKHOLE table (each identified by its GTID and place).
    Wal,
}

/// The streamer's `delivery` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum BenchDelivery {
    #[default]
    AtLeastOnce,
    /// Kafka transactions with a progress record; the checker reads `read_committed`
    /// (librdkafka's default), so latency includes the transaction interval.
    ExactlyOnce,
}

/// Where the streamer under test publishes (its `sink` setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum BenchSink {
    /// A 3-partition topic; the checker reads it with a Kafka consumer.
    #[default]
    Kafka,
    /// A durable fanout exchange named like the topic, with a durable queue bound to it that
    /// the checker consumes (`sink = "rabbitmq"` for every shard-partition).
    Rabbitmq,
}

/// The command line of `outbox-bench`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "outbox-bench",
    version,
    about = "Measures the outbox-streamer binary's throughput and latency against the running services (`scripts/services env`)"
)]
pub(crate) struct BenchArgs {
    #[arg(long, value_enum, default_value_t = BenchMode::Cdc)]
    pub mode: BenchMode,
    /// Where messages live: `table` rows, or `wal` (CDC or ceiling only).
    #[arg(long, value_enum, default_value_t = BenchStorage::Table)]
    pub storage: BenchStorage,
    /// The tables are tw-tkms's (`layout = "tw-tkms"`) and the writers store every message as
    /// tw-tkms does, with this compression (at-least-once, table storage, one partition).
    #[arg(long, value_enum, value_name = "COMPRESSION")]
    pub tw_tkms: Option<tkms::TkmsCompression>,
    /// The streamer's `delivery`.
    #[arg(long, value_enum, default_value_t = BenchDelivery::AtLeastOnce)]
    pub delivery: BenchDelivery,
    /// Where the streamer publishes: `kafka`, or `rabbitmq` (every shard-partition with
    /// `sink = "rabbitmq"`; at-least-once only).
    #[arg(long, value_enum, default_value_t = BenchSink::Kafka)]
    pub sink: BenchSink,
    /// With `--sink rabbitmq`: the broker, `amqp://user:password@host:port/vhost` (default:
    /// `OUTBOX_RABBITMQ_URL`). The streamer gets it through its environment, never the file.
    #[arg(long, value_name = "URL")]
    pub rabbitmq_url: Option<String>,
    /// With `--sink rabbitmq`: the streamer's `rabbitmq.confirm_window` (default: the config
    /// default, 1,024).
    #[arg(long)]
    pub confirm_window: Option<u32>,
    /// The streamer's `transaction_interval_ms` under exactly-once (default: the config
    /// default, 20 ms).
    #[arg(long)]
    pub transaction_interval_ms: Option<u64>,
    /// The database under test.
    #[arg(long, value_enum, default_value_t = DbKind::Postgres)]
    pub db: DbKind,
    /// Target messages per second over all writers; 0 for as fast as possible.
    #[arg(long, default_value_t = 1000)]
    pub rate: u64,
    #[arg(long, default_value_t = 20)]
    pub duration_s: u64,
    /// Writer connections.
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// The writers are message API callers (docs/api.md): each prepares and commits one message
    /// per round trip over a kept-alive HTTP connection to the streamer's `[api]`; the report
    /// adds the round trip's p50 and p99. Table storage, the outbox-streamer layout.
    #[arg(long)]
    pub api: bool,
    #[arg(long, default_value_t = 1)]
    pub rows_per_txn: usize,
    #[arg(long, default_value_t = 200)]
    pub payload_bytes: usize,
    /// What the payload looks like: `repeated` (one byte, compresses to nothing) or `json`
    /// (an order event with the entropy of real JSON; see `payload.rs`).
    #[arg(long, value_enum, default_value_t = payload::PayloadShape::Repeated)]
    pub payload_shape: payload::PayloadShape,
    /// Shard-partitions (tables, slots) the writers spread over.
    #[arg(long, default_value_t = 1)]
    pub partitions: u32,
    /// The streamer's linger.ms.
    #[arg(long, default_value_t = 1)]
    pub linger_ms: u64,
    /// The streamer's `status_interval_ms` (default: the config default, 1 s; runs before
    /// 2026-12-04 used 100 ms).
    #[arg(long)]
    pub status_interval_ms: Option<u64>,
    /// The streamer's `cleanup_interval_ms` (default: the config default).
    #[arg(long)]
    pub cleanup_interval_ms: Option<u64>,
    /// The streamer's `poll_interval_ms` in polling mode (default: the config default, 25 ms).
    #[arg(long)]
    pub poll_interval_ms: Option<u64>,
    /// Keys shared by all writers, ids taken before the key is locked: measures deliveries out
    /// of each key's commit order (see `bench/src/load.rs`).
    #[arg(long)]
    pub shared_keys: bool,
    /// Keep a transaction open for the whole run (the classic polling pathology).
    #[arg(long, value_enum)]
    pub hold_open: Option<HoldOpen>,
    /// A named scenario (see `--list-scenarios`) sets database, mode, rate, payload,
    /// shard-partitions and backlog; any other name just labels a custom run.
    #[arg(long, default_value = "custom")]
    pub scenario: String,
    /// Runs every scenario of a suite (`pg`, `mariadb`, `all`) and writes a Markdown table,
    /// one JSON per run and SVG charts into `--out`.
    #[arg(long)]
    pub suite: Option<String>,
    /// Lists the named scenarios and suites.
    #[arg(long)]
    pub list_scenarios: bool,
    /// Backlog drain: insert this many rows with the streamer stopped, then time the drain.
    #[arg(long)]
    pub backlog: Option<usize>,
    /// With `--backlog`: mark the shard-partition's catch-up pending before the streamer
    /// starts, so the backlog drains as a catch-up (the path after a lost slot or binlog
    /// position, or a return from polling mode) instead of from the log. CDC mode only.
    #[arg(long, requires = "backlog")]
    pub catch_up: bool,
    /// Where a suite writes its results.
    #[arg(long, default_value = "target/bench/results")]
    pub out: PathBuf,
    /// Write the run's results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// A short run (3 s at 500 msg/s) to check the harness itself.
    #[arg(long)]
    pub quick: bool,
    /// Keep the streamer's log (in the run's private directory, without the config) also when
    /// the run succeeds, and print where it is.
    #[arg(long)]
    pub keep_log: bool,
    /// The loopback port the streamer under test serves its metrics on (another bench on the
    /// same machine needs another).
    #[arg(long, default_value_t = run::BENCH_METRICS_PORT)]
    pub metrics_port: u16,
    /// The `outbox-streamer` binary under test (default: the one beside this binary, where
    /// cargo builds both, e.g. `target/release/`).
    #[arg(long, value_name = "PATH")]
    pub streamer_bin: Option<PathBuf>,
}

/// Runs what the flags ask for: the scenario list, a suite, or one run. Returns the reports
/// of the runs made.
async fn bench_command(args: BenchArgs) -> anyhow::Result<Vec<Report>> {
    if args.list_scenarios {
        for s in scenario::all() {
            let load = if s.backlog.is_some() {
                format!("backlog of {} rows", s.backlog.unwrap_or_default())
            } else if s.rate == 0 {
                "as fast as possible".into()
            } else {
                format!("{} msg/s", s.rate)
            };
            println!(
                "{:<26} {:?} {:?}, {load}, {} B payload, {} shard-partition(s)",
                s.name, s.db, s.mode, s.payload_bytes, s.partitions
            );
        }
        println!("\nsuites: pg, mariadb, all (every scenario of that database, in this order)");
        return Ok(Vec::new());
    }
    let streamer = streamer_bin(args.streamer_bin.clone())?;
    eprintln!("streamer under test: {}", streamer.display());
    let Some(suite) = args.suite.clone() else {
        let mut args = args;
        if let Some(preset) = scenario::find(&args.scenario) {
            if preset.backlog.is_none() && args.backlog.is_some() {
                anyhow::bail!(
                    "--backlog with --scenario {}, which is not a backlog drain: name a *-backlog scenario, or another name (a name that is no preset keeps every flag)",
                    preset.name
                );
            }
            preset.apply(&mut args);
        }
        return Ok(vec![run::bench(args, &streamer).await?]);
    };
    let scenarios = scenario::suite(&suite)
        .ok_or_else(|| anyhow::anyhow!("--suite {suite:?}: unknown; use pg, mariadb or all (--list-scenarios)"))?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let mut reports = Vec::new();
    for (i, s) in scenarios.iter().enumerate() {
        eprintln!("==> [{}/{}] {}", i + 1, scenarios.len(), s.name);
        let mut run_args = args.clone();
        s.apply(&mut run_args);
        run_args.suite = None;
        run_args.json = Some(args.out.join(format!("{}.json", s.name)));
        reports.push(run::bench(run_args, &streamer).await?);
    }
    report::write_suite(&suite, &reports, &args.out)?;
    Ok(reports)
}

#[tokio::main]
async fn main() -> ExitCode {
    init_logging();
    match bench_command(BenchArgs::parse()).await {
        Ok(reports) => verdict(&reports),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Failure when a fault-free CDC run lost, duplicated or reordered a record, or any run lost
/// one (polling may deliver out of commit order; `docs/polling.md`).
fn verdict(reports: &[Report]) -> ExitCode {
    let mut failed = false;
    for report in reports {
        let broken = report.lost + report.duplicated + report.out_of_order;
        if report.mode == BenchMode::Cdc && broken > 0 {
            eprintln!(
                "error: {}: a fault-free CDC run must lose, duplicate and reorder nothing: lost {}, duplicated {}, out of order {}",
                report.scenario, report.lost, report.duplicated, report.out_of_order
            );
            failed = true;
        }
        if report.lost > 0 {
            eprintln!("error: {}: {} rows lost", report.scenario, report.lost);
            failed = true;
        }
    }
    if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}

/// The `outbox-streamer` binary under test: `--streamer-bin`, or the one beside this binary.
fn streamer_bin(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let path = match given {
        Some(path) => path,
        None => std::env::current_exe().context("locating the outbox-bench binary")?.with_file_name("outbox-streamer"),
    };
    if !path.is_file() {
        bail!(
            "{}: no outbox-streamer binary there; build it beside this one (`cargo build --bin outbox-streamer`, with --release for a release bench) or name it with --streamer-bin",
            path.display()
        );
    }
    Ok(path)
}

/// Logs on stderr (`RUST_LOG` filters, default `info`), as the streamer's own commands do.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,rdkafka=warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{BenchArgs, BenchSink};

    #[test]
    fn the_sink_is_kafka_unless_named() {
        let parse = |args: &[&str]| BenchArgs::try_parse_from([&["outbox-bench"], args].concat()).map(|a| a.sink);
        assert_eq!(parse(&[]).unwrap(), BenchSink::Kafka);
        assert_eq!(parse(&["--sink", "rabbitmq"]).unwrap(), BenchSink::Rabbitmq);
        assert!(parse(&["--sink", "nats"]).is_err());
    }
}
