//! `outbox-streamer run`: one task per shard-partition, each with its own slot and producer.
//!
//! A task retries transient errors with backoff (resuming from the last confirmed position),
//! and on a definite error halts alone: one ERROR with the reason and the fix, while the other
//! shard-partitions keep streaming. SIGTERM or SIGINT stops intake, drains acknowledgements,
//! deletes and confirms, then the process exits 0.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use metrics::gauge;
use outbox_kafka::{Producer, ProducerSettings};
use outbox_postgres::connect::PgTarget;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument;

use std::future::Future;

use crate::config::{Config, KafkaConfig, Mode, SourceConfig, SourceKind, StreamSettings};
use crate::metrics::{self as m, state};
use crate::mysql::MySource;
use crate::names::{StreamNames, all_streams, checkpoint_table, stream_names};
use crate::postgres::PgSource;
use crate::source::{Source, SourceError};
use crate::streamer::{SessionError, StreamLabels, run_session};

const BACKOFF_START: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A session that lasted this long resets the backoff.
const BACKOFF_RESET_AFTER: Duration = Duration::from_secs(60);
const LAG_POLL_INTERVAL: Duration = Duration::from_secs(5);

pub async fn run(config: Config) -> anyhow::Result<()> {
    if let Some(listen) = config.metrics.listen {
        m::serve(listen).with_context(|| format!("metrics.listen: cannot serve metrics on {listen}"))?;
        tracing::info!(%listen, "serving Prometheus metrics");
    }
    if config.coordination.is_some() {
        bail!(
            "coordination: ZooKeeper ownership is not available yet (tracked as issue 6); remove [coordination] to let this instance own every shard-partition"
        );
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    for source in &config.sources {
        match source.kind {
            SourceKind::Postgres => spawn_postgres(&config, source, &stop_rx, &mut tasks)?,
            SourceKind::Mysql => spawn_mysql(&config, source, &stop_rx, &mut tasks)?,
        }
    }
    tracing::info!(tasks = tasks.len(), "outbox-streamer running; SIGTERM or SIGINT stops it after draining");
    wait_for_signal().await;
    tracing::info!("stopping: no new changes are read; draining acknowledgements");
    let _ = stop_tx.send(true);
    while let Some(res) = tasks.join_next().await {
        if let Err(e) = res {
            tracing::error!(error = %e, "a streamer task panicked");
        }
    }
    tracing::info!("stopped");
    Ok(())
}

/// Settings of every shard-partition of a source; polling is refused until it exists.
fn stream_plans(source: &SourceConfig) -> anyhow::Result<Vec<(StreamLabels, StreamSettings, StreamNames)>> {
    all_streams(source.shards, source.partitions)
        .map(|id| {
            let settings = source.settings_for(id);
            if settings.mode == Mode::Polling {
                bail!("source {:?} shard-partition {id}: mode = \"polling\" is not available yet (tracked as issue 5); use mode = \"cdc\"", source.name);
            }
            let names = stream_names(&source.table_prefix, id);
            let labels = StreamLabels { source: source.name.clone(), id, table: names.table.clone() };
            Ok((labels, settings, names))
        })
        .collect()
}

fn span(labels: &StreamLabels, names: &StreamNames) -> tracing::Span {
    tracing::info_span!("streamer", source = %labels.source, shard = labels.id.shard, partition = labels.id.partition, slot = %names.slot)
}

fn spawn_postgres(
    config: &Config,
    source: &SourceConfig,
    stop: &watch::Receiver<bool>,
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<()> {
    let target = PgTarget::from_url(source.url.expose(), source.password()?.as_deref())
        .with_context(|| format!("source {:?}: url", source.name))?;
    let mut slots = Vec::new();
    for (labels, settings, names) in stream_plans(source)? {
        slots.push(names.slot.clone());
        let producer = producer_settings(&config.kafka, &settings, &labels);
        let status_interval = Duration::from_millis(settings.status_interval_ms);
        let span = span(&labels, &names);
        let target = target.clone();
        let connect = move || {
            let (target, names) = (target.clone(), names.clone());
            async move { PgSource::connect(&target, &names, status_interval).await }
        };
        tasks.spawn(
            stream_task(labels, settings, connect, producer, config.kafka.message_timeout_ms, stop.clone())
                .instrument(span),
        );
    }
    if let Some(ms) = source.heartbeat_interval_ms {
        tasks.spawn(heartbeat(target.clone(), Duration::from_millis(ms), stop.clone()));
    }
    tasks.spawn(lag_poller(source.name.clone(), target, slots, stop.clone()));
    Ok(())
}

fn spawn_mysql(
    config: &Config,
    source: &SourceConfig,
    stop: &watch::Receiver<bool>,
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<()> {
    let opts = crate::cli::setup::mysql_opts(source.url.expose(), source.password()?.as_deref())
        .with_context(|| format!("source {:?}: url", source.name))?;
    let checkpoint = checkpoint_table(&source.table_prefix);
    for (labels, settings, names) in stream_plans(source)? {
        let producer = producer_settings(&config.kafka, &settings, &labels);
        let heartbeat = Duration::from_millis(settings.status_interval_ms.max(1000));
        let span = span(&labels, &names);
        let (opts, checkpoint, task_labels) = (opts.clone(), checkpoint.clone(), labels.clone());
        let connect = move || {
            let (opts, names, checkpoint, labels) =
                (opts.clone(), names.clone(), checkpoint.clone(), task_labels.clone());
            // Without coordination this instance owns every stream at epoch 0.
            async move { MySource::connect(&labels, &opts, &names, &checkpoint, 0, heartbeat).await }
        };
        tasks.spawn(
            stream_task(labels, settings, connect, producer, config.kafka.message_timeout_ms, stop.clone())
                .instrument(span),
        );
    }
    Ok(())
}

fn producer_settings(kafka: &KafkaConfig, s: &StreamSettings, labels: &StreamLabels) -> ProducerSettings {
    ProducerSettings {
        brokers: kafka.brokers.clone(),
        client_id: format!("outbox-streamer-{}-{}-{}", labels.source, labels.id.shard, labels.id.partition),
        compression: s.compression.as_str().into(),
        linger_ms: s.linger_ms,
        message_timeout_ms: kafka.message_timeout_ms,
        properties: kafka.properties.clone(),
    }
}

async fn stream_task<S, F, Fut>(
    labels: StreamLabels,
    settings: StreamSettings,
    connect: F,
    producer: ProducerSettings,
    message_timeout_ms: u64,
    mut stop: watch::Receiver<bool>,
) where
    S: Source,
    F: Fn() -> Fut,
    Fut: Future<Output = Result<S, SourceError>>,
{
    let metric_labels = [
        ("source", labels.source.clone()),
        ("shard", labels.id.shard.to_string()),
        ("partition", labels.id.partition.to_string()),
    ];
    let producer = match Producer::new(&producer) {
        Ok(p) => p,
        Err(e) => {
            gauge!(m::STREAM_STATE, &metric_labels).set(state::HALTED);
            tracing::error!(error = %e, "cannot create the Kafka producer; check [kafka] settings; this shard-partition is halted");
            return;
        }
    };
    let message_timeout = Duration::from_millis(message_timeout_ms);
    let mut backoff = BACKOFF_START;
    while !*stop.borrow() {
        let started = Instant::now();
        let result = match connect().await {
            Ok(source) => {
                gauge!(m::STREAM_STATE, &metric_labels).set(state::STREAMING);
                tracing::info!("streaming");
                run_session(&labels, &settings, source, &producer, message_timeout, &mut stop).await
            }
            Err(e) => Err(SessionError::from(e)),
        };
        match result {
            Ok(()) => break,
            Err(SessionError::Transient(msg)) => {
                if started.elapsed() > BACKOFF_RESET_AFTER {
                    backoff = BACKOFF_START;
                }
                metrics::counter!(m::ERRORS, "source" => labels.source.clone(), "shard" => labels.id.shard.to_string(), "partition" => labels.id.partition.to_string(), "kind" => "source").increment(1);
                gauge!(m::STREAM_STATE, &metric_labels).set(state::RETRYING);
                tracing::warn!(error = %msg, retry_in_ms = backoff.as_millis() as u64, "stream interrupted; resuming from the last confirmed position");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stop.changed() => {}
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
            Err(SessionError::Halt(msg)) => {
                gauge!(m::STREAM_STATE, &metric_labels).set(state::HALTED);
                tracing::error!("shard-partition {}/{} halted {msg}", labels.source, labels.id);
                while !*stop.borrow() {
                    if stop.changed().await.is_err() {
                        break;
                    }
                }
                break;
            }
        }
    }
    let _ = tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(5))).await;
    gauge!(m::STREAM_STATE, &metric_labels).set(state::STOPPED);
}

/// Publishes each slot's lag in bytes every few seconds.
async fn lag_poller(source: String, target: PgTarget, slots: Vec<String>, mut stop: watch::Receiver<bool>) {
    let mut client = None;
    loop {
        if client.is_none() {
            client = target.connect().await.ok();
        }
        if let Some(c) = &client {
            for name in &slots {
                match outbox_postgres::slot::state(c, name).await {
                    Ok(st) => {
                        if let Some(lag) = st.lag_bytes {
                            gauge!(m::REPLICATION_LAG_BYTES, "source" => source.clone(), "slot" => name.clone())
                                .set(lag as f64);
                        }
                    }
                    Err(_) => {
                        client = None;
                        break;
                    }
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(LAG_POLL_INTERVAL) => {}
            _ = stop.changed() => return,
        }
    }
}

/// The prefix of heartbeat messages in the WAL.
pub const HEARTBEAT_PREFIX: &str = "outbox-streamer-heartbeat";

/// Writes a non-transactional logical message every `interval`, so every slot of the database
/// sees a recent position even when the whole server is idle. Failures are logged once per
/// streak and retried; they never stop streaming.
async fn heartbeat(target: PgTarget, interval: Duration, mut stop: watch::Receiver<bool>) {
    let mut client = None;
    let mut failing = false;
    let mut tick = tokio::time::interval(interval);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if client.is_none() {
            client = target.connect().await.ok();
        }
        let result = match &client {
            Some(c) => c
                .execute("SELECT pg_logical_emit_message(false, $1, now()::text)", &[&HEARTBEAT_PREFIX])
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            None => Err(format!("cannot connect to {}", target.display())),
        };
        match result {
            Ok(()) if failing => {
                failing = false;
                tracing::info!("heartbeat restored");
            }
            Ok(()) => {}
            Err(e) => {
                client = None;
                if !failing {
                    failing = true;
                    tracing::warn!(error = %e, "heartbeat failed; retrying every interval");
                }
            }
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM; stop with SIGINT");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
