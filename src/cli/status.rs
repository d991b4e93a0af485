//! `outbox-streamer status`: every shard-partition's slot, position, lag and pending rows,
//! read from the databases (so it works from any host).

use std::process::ExitCode;

use anyhow::Context;
use outbox_postgres::connect::PgTarget;
use outbox_postgres::setup::ident;
use outbox_postgres::slot;
use serde::Serialize;

use crate::config::{Config, Mode, SourceKind};
use crate::names::{all_streams, stream_names};

/// Pending rows are counted up to this many; more shows as this number and `+`.
const PENDING_COUNT_CAP: i64 = 1_000_000;

#[derive(Debug, Serialize)]
struct Row {
    source: String,
    shard: u32,
    partition: u32,
    mode: &'static str,
    slot: String,
    slot_state: String,
    active_pid: Option<i32>,
    confirmed_lsn: Option<String>,
    lag_bytes: Option<i64>,
    rows_pending: Option<i64>,
    healthy: bool,
}

pub async fn status(config: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    for source in &config.sources {
        if source.kind != SourceKind::Postgres {
            continue;
        }
        let target = PgTarget::from_url(source.url.expose(), source.password()?.as_deref())?;
        let client = target.connect().await.with_context(|| format!("connecting to {}", target.display()))?;
        for id in all_streams(source.shards, source.partitions) {
            let names = stream_names(&source.table_prefix, id);
            let st = slot::state(&client, &names.slot).await?;
            let pending: Option<i64> = client
                .query_one(
                    &format!(
                        "SELECT count(*) FROM (SELECT 1 FROM {} LIMIT {PENDING_COUNT_CAP}) t",
                        ident(&names.table)
                    ),
                    &[],
                )
                .await
                .ok()
                .map(|r| r.get(0));
            let slot_state = if !st.exists {
                "missing".to_string()
            } else {
                st.wal_status.clone().unwrap_or_else(|| "unknown".into())
            };
            let healthy = st.exists && slot_state != "lost" && pending.is_some();
            rows.push(Row {
                source: source.name.clone(),
                shard: id.shard,
                partition: id.partition,
                mode: match source.settings_for(id).mode {
                    Mode::Cdc => "cdc",
                    Mode::Polling => "polling",
                },
                slot: names.slot,
                slot_state,
                active_pid: st.active_pid,
                confirmed_lsn: st.confirmed_flush.map(|l| l.to_string()),
                lag_bytes: st.lag_bytes,
                rows_pending: pending,
                healthy,
            });
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "{:<10} {:>5} {:>9} {:<7} {:<16} {:<9} {:>8} {:>14} {:>12} {:>9}",
            "source", "shard", "partition", "mode", "slot", "state", "pid", "confirmed", "lag_bytes", "pending"
        );
        for r in &rows {
            let dash = || "-".to_string();
            println!(
                "{:<10} {:>5} {:>9} {:<7} {:<16} {:<9} {:>8} {:>14} {:>12} {:>9}",
                r.source,
                r.shard,
                r.partition,
                r.mode,
                r.slot,
                r.slot_state,
                r.active_pid.map_or_else(dash, |p| p.to_string()),
                r.confirmed_lsn.clone().unwrap_or_else(dash),
                r.lag_bytes.map_or_else(dash, |l| l.to_string()),
                r.rows_pending.map_or_else(dash, |p| if p >= PENDING_COUNT_CAP {
                    format!("{p}+")
                } else {
                    p.to_string()
                }),
            );
        }
    }
    Ok(if rows.iter().all(|r| r.healthy) { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
