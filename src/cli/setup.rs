//! `outbox-streamer setup`: creates what every shard-partition needs, after checking the server;
//! each database's checks and objects are in its folder ([`crate::db::Database::setup`]).

use std::process::ExitCode;

use crate::config::{Config, Delivery};
use crate::db::{self, SetupRequest};

/// Runs `setup` for every source: checks first, then creates.
pub(crate) async fn setup(config: &Config, how: &SetupRequest<'_>) -> anyhow::Result<ExitCode> {
    if !how.dry_run {
        crate::same_database::refuse_shared_databases(config).await?;
    }
    let how = SetupRequest { api: config.api.as_ref(), ..*how };
    let mut ok = true;
    for source in &config.sources {
        ok &= db::of(source.kind).setup(source, &how).await?;
    }
    ok &= progress_topic(config, how.dry_run).await?;
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Under exactly-once delivery (any shard-partition), creates the compacted progress topic if
/// it is missing. A principal without the right to create topics gets the command to ask for.
async fn progress_topic(config: &Config, dry_run: bool) -> anyhow::Result<bool> {
    let exactly_once = config.sources.iter().any(|s| {
        crate::names::all_streams(s.shards, s.partitions).any(|id| s.settings_for(id).delivery == Delivery::ExactlyOnce)
    });
    if !exactly_once {
        return Ok(true);
    }
    let topic = &config.kafka.progress_topic;
    if dry_run {
        println!("-- Kafka: create the compacted topic {topic} (1 partition, cleanup.policy=compact) unless it exists");
        return Ok(true);
    }
    let properties = config.kafka.producer_properties()?;
    match outbox_kafka::admin::create_progress_topic(&config.kafka.brokers, &properties, topic).await {
        Ok(true) => println!("created the Kafka progress topic {topic} (compacted)"),
        Ok(false) => println!("the Kafka progress topic {topic} exists"),
        Err(e) => {
            eprintln!(
                "cannot create the Kafka progress topic {topic}: {e}; exactly-once shard-partitions halt until it exists. Fix: ask a Kafka administrator to run kafka-topics.sh --create --topic {topic} --partitions 1 --config cleanup.policy=compact, and to grant the streamer's principal WRITE and READ on it (see docs/exactly-once.md)"
            );
            return Ok(false);
        }
    }
    Ok(true)
}
