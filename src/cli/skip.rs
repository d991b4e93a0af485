//! `outbox-streamer skip`: an operator's explicit decision not to publish something.
//!
//! * `--id N` — row N is not published: it is added to the shard-partition's skip list
//!   (`skip_ids` in its checkpoint row, read when a session starts) and deleted from the table.
//! * `--transaction LABEL` — rows of that transaction whose id cannot be read (logged while the
//!   `id` column was dropped or retyped) are not published; LABEL is the `outbox-lsn` /
//!   `outbox-gtid` the halt message names.
//! * `--backlog` — everything committed so far is discarded: the rows in the table are deleted
//!   and the stored position moves to the end of the log, in one step. A transaction that
//!   committed while this ran is either deleted and skipped, or kept and published; a row the
//!   position passed but the delete did not see is published by the sweep.
//!
//! Each is refused while the shard-partition is being streamed (the PostgreSQL slot is held,
//! or a MariaDB session holds the stream's named lock): stop it first, or let it halt.

use std::process::ExitCode;

use anyhow::{Context, bail};

use crate::config::{Config, SourceConfig};
use crate::names::StreamId;
pub(super) use crate::skip::What;

/// Parses `<source>/<shard>/<partition>` against the configuration.
fn stream<'c>(config: &'c Config, text: &str) -> anyhow::Result<(&'c SourceConfig, StreamId)> {
    let parts: Vec<&str> = text.split('/').collect();
    let [source, shard, partition] = parts[..] else {
        bail!("--stream {text:?}: expected <source>/<shard>/<partition>, for example app/0/0");
    };
    let Some(source) = config.sources.iter().find(|s| s.name == source) else {
        let names: Vec<&str> = config.sources.iter().map(|s| s.name.as_str()).collect();
        bail!("--stream {text:?}: no source named {source:?} in the configuration (sources: {})", names.join(", "));
    };
    let shard: u32 = shard.parse().with_context(|| format!("--stream {text:?}: shard {shard:?} is not a number"))?;
    let partition: u32 =
        partition.parse().with_context(|| format!("--stream {text:?}: partition {partition:?} is not a number"))?;
    if shard >= source.shards || partition >= source.partitions {
        bail!(
            "--stream {text:?}: source {:?} has shards 0..{} and partitions 0..{}",
            source.name,
            source.shards,
            source.partitions
        );
    }
    Ok((source, StreamId { shard, partition }))
}

pub(super) async fn skip(config: &Config, stream_text: &str, what: What) -> anyhow::Result<ExitCode> {
    let (source, id) = stream(config, stream_text)?;
    let message = crate::db::of(source.kind).skip(source, id, &what).await?;
    println!("{stream_text}: {message}");
    Ok(ExitCode::SUCCESS)
}
