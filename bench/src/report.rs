//! What a run reports: the [`Report`] (its JSON is what `--json` and a suite write), its
//! Markdown row, and a suite's summary table and charts.

use std::path::Path;

use serde::Serialize;

use crate::{BenchDelivery, BenchMode, BenchSink, BenchStorage, DbKind, HoldOpen, charts, neighbours};

/// The results of one run.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub scenario: String,
    pub mode: BenchMode,
    /// Where the streamer published (absent in reports before 2026-12-07: `kafka`).
    #[serde(default)]
    pub sink: BenchSink,
    /// Where messages lived (absent in reports before 2026-12-05: `table`).
    #[serde(default)]
    pub storage: BenchStorage,
    /// The streamer's delivery (absent in reports before 2026-12-06: at-least-once).
    #[serde(default)]
    pub delivery: BenchDelivery,
    /// tw-tkms's layout and its compression (absent in reports before 2026-12-07: our own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tw_tkms: Option<crate::tkms::TkmsCompression>,
    pub db: DbKind,
    pub target_rate: u64,
    pub writers: usize,
    pub rows_per_txn: usize,
    pub payload_bytes: usize,
    /// The payload's shape (absent in reports before 2026-12-07: `repeated`).
    #[serde(default, skip_serializing_if = "crate::payload::PayloadShape::is_repeated")]
    pub payload_shape: crate::payload::PayloadShape,
    pub partitions: u32,
    pub hold_open: Option<HoldOpen>,
    pub shared_keys: bool,
    pub messages: usize,
    pub duration_s: f64,
    pub throughput_msgs_per_s: f64,
    pub latency_p50_ms: f64,
    pub latency_p95_ms: f64,
    pub latency_p99_ms: f64,
    pub latency_max_ms: f64,
    pub streamer_cpu_s: Option<f64>,
    pub streamer_peak_rss_mb: Option<f64>,
    pub db_cpu_s_per_1k: Option<f64>,
    /// Other databases active on the server during the run, whose work `db_cpu_s_per_1k`
    /// includes (see `bench/src/neighbours.rs`).
    pub db_cpu_shared_with: Vec<String>,
    /// WAL (PostgreSQL) or binlog (MariaDB) bytes per message.
    pub wal_bytes_per_msg: f64,
    pub lost: usize,
    pub duplicated: usize,
    pub out_of_order: usize,
    pub throughput_per_second: Vec<u64>,
    /// The streamer's own histogram (row created_at → Kafka ack): (upper bound s, cumulative count).
    pub streamer_latency_buckets: Vec<(String, u64)>,
    /// Polling: the mean duration of the oldest-rows query, and how many ran.
    pub poll_query_mean_ms: Option<f64>,
    pub poll_queries: Option<u64>,
    /// Rows of a backlog drain, and the seconds from starting the streamer to the last record.
    pub backlog: Option<usize>,
    pub drain_s: Option<f64>,
    /// Latency at every percent, 0 to 100 (for the distribution chart).
    pub latency_quantiles_ms: Vec<f64>,
    /// `--api`: the prepare + commit round trip of one message, p50 and p99 (absent in reports
    /// before 2026-12-07 and in runs without `--api`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_round_trip_ms: Option<(f64, f64)>,
}

/// Pairs of CDC and polling runs of the same database and load: (load label, cdc, polling).
pub(crate) fn pairs(runs: &[Report]) -> Vec<(String, &Report, &Report)> {
    let mut out = Vec::new();
    for cdc in runs.iter().filter(|r| charts::is_cdc(r)) {
        let same = |p: &&Report| {
            p.mode == BenchMode::Polling
                && p.db == cdc.db
                && p.target_rate == cdc.target_rate
                && p.payload_bytes == cdc.payload_bytes
                && p.partitions == cdc.partitions
                && p.backlog == cdc.backlog
        };
        if let Some(polling) = runs.iter().find(same) {
            let load = cdc.scenario.splitn(3, '-').nth(2).unwrap_or(&cdc.scenario).to_string();
            out.push((format!("{:?} {load}", cdc.db).to_lowercase(), cdc, polling));
        }
    }
    out
}

/// The suite's Markdown summary (every run, then the ratios) and its charts.
pub(crate) fn write_suite(suite: &str, reports: &[Report], out: &Path) -> anyhow::Result<()> {
    let mut md = format!("# Benchmark suite `{suite}`\n\n");
    md.push_str(&markdown_header());
    for r in reports {
        md.push_str(&markdown_row(r));
    }
    for r in reports.iter().filter(|r| !r.db_cpu_shared_with.is_empty()) {
        md.push_str(&format!("\n\\* {}: {}\n", r.scenario, neighbours::note(&r.db_cpu_shared_with)));
    }
    md.push_str("\n| load | CDC/polling msgs/s | CDC/polling p99 | CDC/polling DB CPU per msg | CDC/ceiling msgs/s |\n|---|---|---|---|---|\n");
    for (load, cdc, polling) in pairs(reports) {
        let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.2}", a / b) } else { "-".into() };
        // Only a run as fast as possible compares with the database's own maximum.
        let ceiling = reports
            .iter()
            .find(|r| r.mode == BenchMode::Ceiling && r.db == cdc.db)
            .filter(|_| cdc.target_rate == 0 && cdc.backlog.is_none() && cdc.partitions == 1)
            .map_or_else(|| "-".into(), |c| ratio(cdc.throughput_msgs_per_s, c.throughput_msgs_per_s));
        md.push_str(&format!(
            "| {load} | {} | {} | {} | {ceiling} |\n",
            ratio(cdc.throughput_msgs_per_s, polling.throughput_msgs_per_s),
            ratio(cdc.latency_p99_ms, polling.latency_p99_ms),
            ratio(cdc.db_cpu_s_per_1k.unwrap_or(0.0), polling.db_cpu_s_per_1k.unwrap_or(0.0)),
        ));
    }
    md.push_str("\nCharts: `latency.svg`, `throughput.svg`, `cdc-vs-polling.svg`.\n");
    std::fs::write(out.join("README.md"), md)?;
    charts::latency(reports, &out.join("latency.svg"))?;
    charts::throughput(reports, &out.join("throughput.svg"))?;
    charts::comparison(reports, &out.join("cdc-vs-polling.svg"))?;
    eprintln!("results: {}", out.join("README.md").display());
    Ok(())
}

pub(crate) fn print_markdown(r: &Report) {
    print!("{}{}", markdown_header(), markdown_row(r));
    if let Some((p50, p99)) = r.api_round_trip_ms {
        println!("\nmessage API: prepare + commit round trip p50 {p50:.2} ms, p99 {p99:.2} ms ({} callers)", r.writers);
    }
    if !r.db_cpu_shared_with.is_empty() {
        println!("\n\\* {}", neighbours::note(&r.db_cpu_shared_with));
    }
}

fn markdown_header() -> String {
    "| scenario | db | mode | target/s | msgs | msgs/s | p50 ms | p95 ms | p99 ms | max ms | streamer CPU s | RSS MB | DB CPU s/1k | WAL B/msg | poll query ms | lost | dup | ooo |\n\
     |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        .into()
}

fn markdown_row(r: &Report) -> String {
    let opt = |v: Option<f64>, digits: usize| v.map_or_else(|| "-".into(), |x| format!("{x:.digits$}"));
    let target = match (r.backlog, r.target_rate) {
        (Some(rows), _) => format!("backlog {rows}"),
        (None, 0) => "max".into(),
        (None, rate) => rate.to_string(),
    };
    let latency = |ms: f64| if r.backlog.is_some() { "-".into() } else { format!("{ms:.1}") };
    format!(
        "| {} | {:?} | {:?}{}{} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {} | {} | {} | {} |\n",
        r.scenario,
        r.db,
        r.mode,
        match (r.storage, r.delivery) {
            (BenchStorage::Wal, BenchDelivery::ExactlyOnce) => " (wal, eo)",
            (BenchStorage::Wal, _) => " (wal)",
            (_, BenchDelivery::ExactlyOnce) => " (eo)",
            _ => "",
        },
        // A Kafka run's cell reads as before.
        match r.tw_tkms {
            Some(c) => format!(" (tw-tkms {})", c.as_str()),
            None => String::new(),
        } + if r.payload_shape.is_repeated() { "" } else { " (json)" }
            + match (r.sink, r.mode) {
                (BenchSink::Rabbitmq, BenchMode::Cdc | BenchMode::Polling) => " → RabbitMQ",
                _ => "",
            }
            + if r.api_round_trip_ms.is_some() { " (api)" } else { "" },
        target,
        r.messages,
        r.throughput_msgs_per_s,
        latency(r.latency_p50_ms),
        latency(r.latency_p95_ms),
        latency(r.latency_p99_ms),
        latency(r.latency_max_ms),
        opt(r.streamer_cpu_s, 2),
        opt(r.streamer_peak_rss_mb, 0),
        opt(r.db_cpu_s_per_1k, 3) + if r.db_cpu_shared_with.is_empty() { "" } else { " \\*" },
        r.wal_bytes_per_msg,
        opt(r.poll_query_mean_ms, 2),
        r.lost,
        r.duplicated,
        r.out_of_order
    )
}
