//! `outbox-streamer run`: one task per shard-partition, each with its own slot and producer.
//!
//! A task retries transient errors with backoff (resuming from the last confirmed position),
//! and on a definite error halts alone: one ERROR with the reason and the fix, while the other
//! shard-partitions keep streaming; the halted task retries slowly and resumes by itself once
//! the cause is fixed (see [`crate::halt`]). SIGTERM or SIGINT stops intake, drains acknowledgements,
//! deletes and confirms, then the process exits 0.

use std::time::{Duration, Instant};

use anyhow::Context;
use metrics::gauge;
use outbox_kafka::{Producer, ProducerSettings};
use outbox_postgres::connect::PgTarget;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::catchup::{self, CatchUpReport, Drain};
use crate::config::{Config, KafkaConfig, Mode, SourceConfig, SourceKind, StreamSettings};
use crate::dberror::{self, Backend};
use crate::halt::{HALT_RETRY_MAX, HaltPoint, HaltRetry};
use crate::lease::OwnerLease;
use crate::metrics::{self as m, state};
use crate::mysql::MySource;
use crate::names::{StreamNames, all_streams, checkpoint_table};
use crate::poll::mysql::MyPollTable;
use crate::poll::postgres::PgPollTable;
use crate::poll::{PollSettings, PollSource};
use crate::postgres::PgSource;
use crate::source::{Source, SourceError};
use crate::streamer::{SessionError, StreamLabels, StreamMemory, run_session};
use outbox_mysql::mysql_async::{Conn as MyConn, Error as MyError, Opts as MyOpts, OptsBuilder, Row as MyRow};

const BACKOFF_START: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A session that lasted this long resets the backoff.
const BACKOFF_RESET_AFTER: Duration = Duration::from_secs(60);
/// MariaDB ends a session whose transaction sat idle this long (the executable comment runs
/// on MariaDB 10.3+ only; MySQL sees `SET @outbox_streamer = 1`). The streamer's own
/// transactions never idle; a paused owner's cleanup transaction would otherwise hold the
/// checkpoint row's lock, and with it the next owner, until the paused process resumed.
const IDLE_TXN_LIMIT: &str = "SET @outbox_streamer = 1 /*M!100300 , SESSION idle_transaction_timeout = 5 */";

/// How soon a session first retries a slot held by another session; the interval doubles up
/// to [`BUSY_RETRY_MAX`] (or [`BUSY_RETRY_MAX_OWNED`] under coordination).
const BUSY_RETRY: Duration = Duration::from_millis(250);
/// The longest wait between attempts on a held slot without coordination: a second instance
/// may hold it for good, and each attempt costs the server a walsender start.
const BUSY_RETRY_MAX: Duration = Duration::from_secs(10);
/// Under coordination the lease makes this instance the owner: the holder is the previous
/// owner closing (or a departed one being ended), so the slot is free again soon.
const BUSY_RETRY_MAX_OWNED: Duration = Duration::from_secs(2);
/// A held slot is reported at WARN at most this often: without coordination at once (another
/// instance may hold it), under coordination once it lasts this long.
const BUSY_WARN_EVERY: Duration = Duration::from_secs(30);
const LAG_POLL_INTERVAL: Duration = Duration::from_secs(5);
/// Connecting a session (SQL and replication or binlog) must finish within this.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) async fn run(mut config: Config) -> anyhow::Result<()> {
    // Listen before anything else: a stop that arrives while starting (a restart right after
    // a start) must end the process in order, not kill it.
    let stop_signal = StopSignal::listen();
    let instance = config.coordination.as_ref().map(|c| c.instance_name());
    if let Some(listen) = config.metrics.listen {
        let health = crate::health::HealthSettings {
            ready_when_halted: config.metrics.ready_when_halted,
            instance: instance.clone(),
        };
        m::serve(listen, health).await.with_context(|| format!("metrics.listen: cannot serve metrics on {listen}"))?;
        tracing::info!(%listen, "serving /metrics, /healthz, /readyz and /streams");
    }
    crate::same_database::refuse_shared_databases(&config).await?;
    if let Some(c) = &config.coordination {
        // A record queued inside librdkafka when the process was paused must not go out after
        // the pause: it times out instead, because a pause long enough to lose the lease is
        // longer than this (see `lease.rs`).
        let cap = c.session_timeout_ms / 2;
        if config.kafka.message_timeout_ms > cap {
            tracing::info!(
                configured_ms = config.kafka.message_timeout_ms,
                used_ms = cap,
                "kafka.message_timeout_ms is capped at half the ZooKeeper session timeout under coordination"
            );
            config.kafka.message_timeout_ms = cap;
        }
    }
    // The SASL password, if it comes from the environment or a file, is read once here.
    config.kafka.properties = config.kafka.producer_properties()?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut jobs = Vec::new();
    for source in &config.sources {
        match source.kind {
            SourceKind::Postgres => {
                jobs.extend(postgres_jobs(&config, source, instance.as_deref(), &stop_rx, &mut tasks)?)
            }
            SourceKind::Mysql => jobs.extend(mysql_jobs(&config, source, &stop_rx, &mut tasks)?),
        }
    }
    match &config.coordination {
        None => {
            for job in &jobs {
                let task = job.spawn(OwnerLease::embedded(), stop_rx.clone());
                tasks.spawn(async move {
                    let _ = task.await;
                });
            }
            tracing::info!(streams = jobs.len(), "outbox-streamer running; SIGTERM or SIGINT stops it after draining");
        }
        Some(c) => {
            let (c, stop, metrics) = (c.clone(), stop_rx.clone(), config.metrics.advertised_address());
            let sources =
                config.sources.iter().map(|s| (s.name.clone(), crate::coordination::fingerprint(s))).collect();
            tasks.spawn(async move { crate::coordination::run(&c, jobs, sources, metrics, stop).await });
            tracing::info!(
                "outbox-streamer running under ZooKeeper ownership; SIGTERM or SIGINT stops it after draining"
            );
        }
    }
    stop_signal.wait().await;
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

type StartFn = dyn Fn(OwnerLease, watch::Receiver<bool>) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync;

/// One shard-partition's work, started by whoever owns it: every shard-partition at once
/// without coordination, or the holder of its ZooKeeper lease.
pub(crate) struct StreamJob {
    /// `<source>.<table>`: the lease's name.
    pub key: String,
    start: Arc<StartFn>,
}

impl std::fmt::Debug for StreamJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamJob").field("key", &self.key).finish_non_exhaustive()
    }
}

impl StreamJob {
    /// Starts streaming under `lease` until `stop` turns true (or the lease is revoked).
    pub(crate) fn spawn(&self, lease: OwnerLease, stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        tokio::spawn((self.start)(lease, stop))
    }
}

/// Everything a shard-partition's task needs except its ownership.
struct JobParts<F> {
    labels: StreamLabels,
    /// Names the objects in the fixes of classified database errors.
    scope: dberror::Scope,
    settings: StreamSettings,
    names: StreamNames,
    connect: F,
    catch_up: CatchUpPlan,
    producer: ProducerSettings,
    message_timeout_ms: u64,
}

impl<S, F, Fut> JobParts<F>
where
    S: Source + 'static,
    F: Fn(OwnerLease) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<S, SourceError>> + Send + 'static,
{
    fn into_job(self) -> StreamJob {
        let key = self.labels.key();
        let parts = Arc::new(self);
        let start = move |lease: OwnerLease, stop: watch::Receiver<bool>| {
            let parts = parts.clone();
            let mut labels = parts.labels.clone();
            labels.lease = lease.clone();
            let span = span(&labels, &parts.names, lease.epoch());
            let scope = parts.scope.clone();
            let fut = async move {
                let connect = || (parts.connect)(lease.clone());
                stream_task(
                    labels,
                    parts.settings.clone(),
                    connect,
                    parts.catch_up.clone(),
                    parts.producer.clone(),
                    parts.message_timeout_ms,
                    stop,
                )
                .await
            };
            Box::pin(dberror::in_scope(scope, fut).instrument(span)) as Pin<Box<dyn Future<Output = ()> + Send>>
        };
        StreamJob { key, start: Arc::new(start) }
    }
}

/// Settings of every shard-partition of a source.
fn stream_plans(source: &SourceConfig) -> Vec<(StreamLabels, StreamSettings, StreamNames)> {
    all_streams(source.shards, source.partitions)
        .map(|id| {
            let settings = source.settings_for(id);
            let names = source.stream_names(id);
            let labels = StreamLabels {
                source: source.name.clone(),
                id,
                table: names.table.clone(),
                lease: OwnerLease::embedded(),
            };
            (labels, settings, names)
        })
        .collect()
}

fn span(labels: &StreamLabels, names: &StreamNames, epoch: Option<i64>) -> tracing::Span {
    match epoch {
        Some(epoch) => {
            tracing::info_span!("streamer", source = %labels.source, shard = labels.id.shard, partition = labels.id.partition, table = %names.table, epoch)
        }
        None => {
            tracing::info_span!("streamer", source = %labels.source, shard = labels.id.shard, partition = labels.id.partition, table = %names.table)
        }
    }
}

/// The jobs of a PostgreSQL source; its heartbeat and lag poller run on `tasks` whoever owns
/// the shard-partitions.
fn postgres_jobs(
    config: &Config,
    source: &SourceConfig,
    instance: Option<&str>,
    stop: &watch::Receiver<bool>,
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<Vec<StreamJob>> {
    let mut target = crate::connect::pg_target(source, None)?;
    if let Some(instance) = instance {
        target = target.with_instance(instance);
    }
    let checkpoint = checkpoint_table(&source.table_prefix);
    let mut jobs = Vec::new();
    let mut slots = Vec::new();
    let mut polled_slots = Vec::new();
    for (labels, settings, names) in stream_plans(source) {
        let scope =
            dberror::Scope::of_stream(source, Backend::Postgres, target.user(), target.database(), &names.table);
        let producer = producer_settings(&config.kafka, &settings, &labels);
        let catch_up = CatchUpPlan::Postgres {
            target: Box::new(target.clone()),
            names: names.clone(),
            checkpoint: checkpoint.clone(),
        };
        let message_timeout_ms = config.kafka.message_timeout_ms;
        if settings.mode == Mode::Polling {
            polled_slots.push(names.slot.clone());
            let (target, checkpoint, poll) = (target.clone(), checkpoint.clone(), poll_settings(&settings, &labels));
            let (table, slot) = (names.table.clone(), names.slot.clone());
            let connect = move |lease: OwnerLease| {
                let (target, table, checkpoint, poll, slot) =
                    (target.clone(), table.clone(), checkpoint.clone(), poll.clone(), slot.clone());
                async move {
                    // Streaming from the slot again later must first send what polling left.
                    let client = target
                        .connect()
                        .await
                        .map_err(|e| SourceError::from_db(&format!("connecting to {}", target.display()), &e))?;
                    let epoch = lease.db_epoch();
                    catchup::postgres::mark_pending(&client, &checkpoint, &table, epoch).await?;
                    let reader = PgPollTable::connect(&target, &table).await?.moving_slot(&slot);
                    let cleaner = PgPollTable::connect(&target, &table).await?.fenced_by(&checkpoint, epoch);
                    Ok(PollSource::new(reader, cleaner, poll))
                }
            };
            jobs.push(
                JobParts { labels, scope, settings, names, connect, catch_up, producer, message_timeout_ms }.into_job(),
            );
        } else {
            slots.push(names.slot.clone());
            let status_interval = Duration::from_millis(settings.status_interval_ms);
            let silence_limit =
                source.heartbeat_interval_ms.map(|ms| Duration::from_millis(ms * 3).max(status_interval * 3));
            let (target, checkpoint, stream_names) = (target.clone(), checkpoint.clone(), names.clone());
            let metric_labels = labels.metric_labels();
            let connect = move |lease: OwnerLease| {
                let (target, names, checkpoint) = (target.clone(), stream_names.clone(), checkpoint.clone());
                let metric_labels = metric_labels.clone();
                async move {
                    PgSource::connect(
                        &target,
                        &names,
                        &checkpoint,
                        status_interval,
                        silence_limit,
                        &lease,
                        metric_labels,
                    )
                    .await
                }
            };
            jobs.push(
                JobParts { labels, scope, settings, names, connect, catch_up, producer, message_timeout_ms }.into_job(),
            );
        }
    }
    if let Some(ms) = source.heartbeat_interval_ms {
        tasks.spawn(heartbeat(target.clone(), Duration::from_millis(ms), stop.clone()));
    }
    slots.extend(polled_slots);
    tasks.spawn(lag_poller(source.name.clone(), target, slots, stop.clone()));
    Ok(jobs)
}

/// The jobs of a MySQL/MariaDB source; its lag poller runs on `tasks`.
fn mysql_jobs(
    config: &Config,
    source: &SourceConfig,
    stop: &watch::Receiver<bool>,
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<Vec<StreamJob>> {
    let opts = crate::connect::mysql_opts(source, None)?;
    let opts: MyOpts = OptsBuilder::from_opts(opts).init(vec![IDLE_TXN_LIMIT]).into();
    let checkpoint = checkpoint_table(&source.table_prefix);
    tasks.spawn(binlog_lag_poller(source.name.clone(), opts.clone(), checkpoint.clone(), stop.clone()));
    let mut jobs = Vec::new();
    let (login, database) =
        (opts.user().unwrap_or_default().to_string(), opts.db_name().unwrap_or_default().to_string());
    for (labels, settings, names) in stream_plans(source) {
        let scope = dberror::Scope::of_stream(source, Backend::MySql, &login, &database, &names.table);
        let producer = producer_settings(&config.kafka, &settings, &labels);
        let catch_up = CatchUpPlan::Mysql { opts: opts.clone(), names: names.clone(), checkpoint: checkpoint.clone() };
        let message_timeout_ms = config.kafka.message_timeout_ms;
        if settings.mode == Mode::Polling {
            let (opts, checkpoint, poll) = (opts.clone(), checkpoint.clone(), poll_settings(&settings, &labels));
            let table = names.table.clone();
            let connect = move |lease: OwnerLease| {
                let (opts, table, checkpoint, poll) = (opts.clone(), table.clone(), checkpoint.clone(), poll.clone());
                async move {
                    let mut reader = MyPollTable::connect(&opts, &table).await?;
                    catchup::mysql::mark_pending(reader.conn(), &checkpoint, &table, lease.db_epoch()).await?;
                    let cleaner = MyPollTable::connect(&opts, &table).await?.fenced_by(&checkpoint, lease.db_epoch());
                    Ok(PollSource::new(reader, cleaner, poll))
                }
            };
            jobs.push(
                JobParts { labels, scope, settings, names, connect, catch_up, producer, message_timeout_ms }.into_job(),
            );
        } else {
            let heartbeat = Duration::from_millis(settings.status_interval_ms.max(1000));
            let (opts, checkpoint, task_labels, stream_names) =
                (opts.clone(), checkpoint.clone(), labels.clone(), names.clone());
            let connect = move |lease: OwnerLease| {
                let (opts, names, checkpoint, labels) =
                    (opts.clone(), stream_names.clone(), checkpoint.clone(), task_labels.clone());
                async move { MySource::connect(&labels, &opts, &names, &checkpoint, lease.db_epoch(), heartbeat).await }
            };
            jobs.push(
                JobParts { labels, scope, settings, names, connect, catch_up, producer, message_timeout_ms }.into_job(),
            );
        }
    }
    Ok(jobs)
}

fn poll_settings(settings: &StreamSettings, labels: &StreamLabels) -> PollSettings {
    PollSettings {
        batch: settings.poll_batch,
        interval: Duration::from_millis(settings.poll_interval_ms),
        full_rescan_every: crate::poll::FULL_RESCAN_EVERY,
        max_batch_bytes: settings.max_in_flight_bytes as usize,
        drain_upto: None,
        rows_sent: Default::default(),
        metric_labels: labels.metric_labels(),
    }
}

/// How a shard-partition catches up when its position is lost.
#[derive(Debug, Clone)]
enum CatchUpPlan {
    Postgres { target: Box<PgTarget>, names: StreamNames, checkpoint: String },
    Mysql { opts: MyOpts, names: StreamNames, checkpoint: String },
}

impl CatchUpPlan {
    async fn run(&self, drain: &mut Drain<'_>, reason: &str) -> Result<Option<CatchUpReport>, SessionError> {
        let epoch = drain.labels.lease.db_epoch();
        match self {
            CatchUpPlan::Postgres { target, names, checkpoint } => {
                catchup::postgres::run(target, names, checkpoint, epoch, drain, reason).await
            }
            CatchUpPlan::Mysql { opts, names, checkpoint } => {
                catchup::mysql::run(opts, names, checkpoint, epoch, drain, reason).await
            }
        }
    }
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
    catch_up: CatchUpPlan,
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
    m::init_stream(&metric_labels);
    set_state(&labels, &metric_labels, state::STOPPED, None);
    let producer = match Producer::new(&producer) {
        Ok(p) => p,
        Err(e) => {
            let reason = format!(
                "cannot create the Kafka producer: {e}; fix: correct the [kafka] settings, then restart (this halt does not clear by itself)"
            );
            set_state(&labels, &metric_labels, state::HALTED, Some(&reason));
            tracing::error!("{reason}; this shard-partition is halted");
            return;
        }
    };
    let message_timeout = Duration::from_millis(message_timeout_ms);
    let mut memory = StreamMemory::default();
    let mut backoff = BACKOFF_START;
    let mut busy: Option<BusyWait> = None;
    let mut halts = HaltRetry::new(Duration::from_millis(settings.halt_retry_ms));
    let mut catch_up_memory = StreamMemory::default();
    while !*stop.borrow() {
        let started = Instant::now();
        if let Err(msg) = labels.lease.check() {
            revoked(&labels, &metric_labels, &msg, &mut stop).await;
            // Dropping the producer purges whatever it still queues.
            return;
        }
        let connected = match tokio::time::timeout(CONNECT_TIMEOUT, connect()).await {
            Ok(result) => result,
            Err(_) => Err(SourceError::Transient(format!(
                "connecting took longer than {CONNECT_TIMEOUT:?}; the database link is presumed dead"
            ))),
        };
        let at_connect = connected.is_err();
        let result = match connected {
            Ok(source) => {
                if memory.halted.as_ref().is_some_and(|h| h.at_connect) {
                    memory.halted = None;
                    tracing::info!("the cause of the halt is gone; streaming again");
                }
                match &memory.halted {
                    // Retrying a halt: still halted until the session is past its point.
                    Some(point) => tracing::debug!(
                        attempt = halts.attempts(),
                        row = point.row,
                        "retrying the halted shard-partition"
                    ),
                    None => {
                        set_state(&labels, &metric_labels, state::STREAMING, None);
                        tracing::info!("streaming");
                    }
                }
                run_session(&labels, &settings, source, &producer, message_timeout, &mut stop, &mut memory).await
            }
            Err(e) => Err(SessionError::from(e)),
        };
        // A halt cleared for good: the next one waits the first interval again. A session
        // that cleared it and halted again soon after keeps the grown interval, so a halt that
        // only seemed to clear cannot retry at the first interval for ever.
        if memory.halted.is_none()
            && (!matches!(result, Err(SessionError::Halt(_))) || started.elapsed() > BACKOFF_RESET_AFTER)
        {
            halts.cleared();
        }
        if !matches!(result, Err(SessionError::Busy(_))) {
            busy = None;
        }
        match result {
            Ok(()) => break,
            Err(SessionError::Revoked(msg)) => {
                revoked(&labels, &metric_labels, &msg, &mut stop).await;
                return;
            }
            Err(SessionError::Busy(msg)) => {
                // Another session holds the slot: the previous owner still closing (soon free),
                // or a second instance without coordination (held for good). Retry soon, then
                // less and less often; say so at most every BUSY_WARN_EVERY.
                set_state(&labels, &metric_labels, state::RETRYING, Some(&msg));
                let now = Instant::now();
                let coordinated = labels.lease.epoch().is_some();
                let waiting = busy.get_or_insert_with(|| BusyWait::new(now, coordinated));
                let (warn, mut wait) = waiting.attempt(now);
                let waited_s = now.duration_since(waiting.since).as_secs();
                let retry_in_ms = wait.as_millis() as u64;
                if warn && coordinated {
                    tracing::warn!(error = %msg, waited_s, retry_in_ms, "still waiting for the previous owner to let go of the slot");
                } else if warn {
                    tracing::warn!(
                        error = %msg,
                        waited_s,
                        retry_in_ms,
                        "the slot is in use by another session; another instance may hold it (a second streamer without [coordination]?) — retrying with backoff"
                    );
                } else {
                    tracing::debug!(error = %msg, retry_in_ms = wait.as_millis() as u64, "waiting for the slot");
                }
                back_off(&mut wait, &mut stop).await;
            }
            Err(SessionError::Transient(msg)) => {
                if started.elapsed() > BACKOFF_RESET_AFTER {
                    backoff = BACKOFF_START;
                }
                metrics::counter!(m::ERRORS, "source" => labels.source.clone(), "shard" => labels.id.shard.to_string(), "partition" => labels.id.partition.to_string(), "kind" => "source").increment(1);
                set_state(&labels, &metric_labels, state::RETRYING, Some(&msg));
                tracing::warn!(error = %msg, retry_in_ms = backoff.as_millis() as u64, "stream interrupted; resuming from the last confirmed position");
                back_off(&mut backoff, &mut stop).await;
            }
            Err(SessionError::PositionLost(reason)) => {
                // Retrying a halted catch-up: still halted until it gets through.
                if memory.halted.is_none() {
                    set_state(&labels, &metric_labels, state::CATCHING_UP, Some(&reason));
                }
                let mut drain = Drain {
                    labels: &labels,
                    settings: &settings,
                    producer: &producer,
                    message_timeout,
                    stop: &mut stop,
                    memory: &mut catch_up_memory,
                };
                match catch_up.run(&mut drain, &reason).await {
                    Ok(Some(_)) => {
                        // The catch-up published every row of the table, the halted one too.
                        catch_up_memory = StreamMemory::default();
                        if memory.halted.take().is_some() {
                            tracing::info!("the cause of the halt is gone; streaming again");
                        }
                        halts.cleared();
                        backoff = BACKOFF_START;
                    }
                    Ok(None) => break,
                    Err(SessionError::Halt(msg)) => {
                        memory.halted = Some(memory.take_halt_point());
                        if !halted(&labels, &metric_labels, &msg, &mut halts, None, &producer, &mut stop).await {
                            break;
                        }
                    }
                    Err(SessionError::Revoked(msg)) => {
                        revoked(&labels, &metric_labels, &msg, &mut stop).await;
                        return;
                    }
                    Err(e) => {
                        set_state(&labels, &metric_labels, state::RETRYING, Some(&e.to_string()));
                        tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "catch-up interrupted; it starts over");
                        back_off(&mut backoff, &mut stop).await;
                    }
                }
            }
            Err(SessionError::Halt(msg)) => {
                let point = HaltPoint { at_connect, ..memory.take_halt_point() };
                let probe = point.missing_topic.clone();
                memory.halted = Some(point);
                if !halted(&labels, &metric_labels, &msg, &mut halts, probe.as_deref(), &producer, &mut stop).await {
                    break;
                }
            }
        }
    }
    let _ = tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(5))).await;
    stopped(&labels, &metric_labels);
}

/// Waiting for a slot another session holds: how long until the next attempt, and whether
/// this attempt is worth a warning.
#[derive(Debug, Clone, Copy)]
struct BusyWait {
    since: Instant,
    /// The last WARN; under coordination the streak starts as if one had just been logged.
    warned: Option<Instant>,
    next: Duration,
    max: Duration,
}

impl BusyWait {
    fn new(now: Instant, coordinated: bool) -> Self {
        if coordinated {
            Self { since: now, warned: Some(now), next: BUSY_RETRY, max: BUSY_RETRY_MAX_OWNED }
        } else {
            Self { since: now, warned: None, next: BUSY_RETRY, max: BUSY_RETRY_MAX }
        }
    }

    /// One more attempt found the slot held at `now`: (warn now?, wait before the next one).
    fn attempt(&mut self, now: Instant) -> (bool, Duration) {
        let warn = self.warned.is_none_or(|at| now.duration_since(at) >= BUSY_WARN_EVERY);
        if warn {
            self.warned = Some(now);
        }
        let wait = self.next;
        self.next = (self.next * 2).min(self.max);
        (warn, wait)
    }
}

/// Sets the shard-partition's state gauge and what `/readyz` reports.
pub(crate) fn set_state(
    labels: &StreamLabels,
    metric_labels: &[(&'static str, String); 3],
    value: f64,
    reason: Option<&str>,
) {
    gauge!(m::STREAM_STATE, metric_labels).set(value);
    crate::health::report(&labels.key(), value, reason);
}

/// The task ends: this instance no longer runs the shard-partition.
fn stopped(labels: &StreamLabels, metric_labels: &[(&'static str, String); 3]) {
    gauge!(m::STREAM_STATE, metric_labels).set(state::STOPPED);
    crate::health::leave(&labels.key());
}

/// The stream may belong to another instance now. Under coordination the task ends (the
/// coordinator starts it again if the lease survives); without coordination a newer epoch
/// in the checkpoint means a coordinated instance owned it, which needs an operator.
async fn revoked(
    labels: &StreamLabels,
    metric_labels: &[(&'static str, String); 3],
    msg: &str,
    stop: &mut watch::Receiver<bool>,
) {
    if labels.lease.epoch().is_none() {
        let msg = format!(
            "{msg}; fix: this instance runs without [coordination] but instances with ZooKeeper ownership wrote the checkpoint; stop them or add the same [coordination] here, or, if none runs any more, reset the epoch: UPDATE <prefix>_checkpoint SET owner_epoch = 0 WHERE stream = '{}'; then restart (this halt does not clear by itself)",
            labels.table
        );
        halt_for_good(labels, metric_labels, &msg, stop).await;
        return;
    }
    if labels.lease.check().is_ok() {
        // Fenced by a stored epoch while this instance holds the lease in ZooKeeper and its
        // session is trusted: no owner of this ensemble can have a newer epoch (leases are
        // granted in zxid order and this one is held), so the stored one comes from another
        // ensemble — ZooKeeper replaced, or restored from an older backup — or from a hand.
        // Retrying would be fenced for ever.
        let msg = format!(
            "{msg}, although this instance holds the lease (epoch {}) in ZooKeeper now: the stored epoch was written under another ZooKeeper ensemble (replaced, or restored from an older backup) or by hand; fix: make sure no instance still runs against the old ensemble, then reset the epoch: UPDATE <prefix>_checkpoint SET owner_epoch = 0 WHERE stream = '{}', and restart (see docs/ownership.md; this halt does not clear by itself)",
            labels.lease.db_epoch(),
            labels.table
        );
        halt_for_good(labels, metric_labels, &msg, stop).await;
        return;
    }
    stopped(labels, metric_labels);
    gauge!(m::OWNER_EPOCH, "stream" => labels.key()).set(0.0);
    tracing::warn!(reason = %msg, "stopped: ownership can no longer be confirmed");
}

/// Sleeps `backoff` (or until shutdown), then doubles it up to the maximum.
async fn back_off(backoff: &mut Duration, stop: &mut watch::Receiver<bool>) {
    tokio::select! {
        _ = tokio::time::sleep(*backoff) => {}
        _ = stop.changed() => {}
    }
    *backoff = (*backoff * 2).min(BACKOFF_MAX);
}

/// A session halted (see [`crate::halt`]): the state says so with the reason, the ERROR is
/// logged unless this reason was logged recently, and the task waits before its next attempt —
/// or, for a missing topic, until the cluster's metadata shows it ready. Returns `false` when the
/// process stops meanwhile.
#[allow(clippy::too_many_arguments)]
async fn halted(
    labels: &StreamLabels,
    metric_labels: &[(&'static str, String); 3],
    msg: &str,
    retry: &mut HaltRetry,
    missing_topic: Option<&str>,
    producer: &Producer,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    set_state(labels, metric_labels, state::HALTED, Some(msg));
    let (log, wait) = retry.halted(msg, Instant::now());
    let retry_in_s = wait.as_secs_f64();
    if log {
        tracing::error!(
            "shard-partition {}/{} halted: {msg}; it retries by itself in {retry_in_s:.1} s, then less and less often (up to every {} min), so a fix in the database, the table or Kafka takes effect without a restart (a fix in the configuration file needs one); rows after this point wait",
            labels.source,
            labels.id,
            HALT_RETRY_MAX.as_secs() / 60
        );
    } else {
        tracing::debug!(error = %msg, attempt = retry.attempts(), retry_in_s, "still halted for the same reason");
    }
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let next_probe = match missing_topic {
            Some(_) => (tokio::time::Instant::now() + retry.probe_every()).min(deadline),
            None => deadline,
        };
        tokio::select! {
            _ = tokio::time::sleep_until(next_probe) => {}
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    return false;
                }
                continue;
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return true;
        }
        if let Some(topic) = missing_topic
            && producer.topic_ready(topic).await == Some(true)
        {
            // The topic's name is row data: not logged.
            tracing::info!("the missing topic exists now; retrying");
            return true;
        }
    }
}

/// Logs the one ERROR of a halted shard-partition that cannot clear by itself and waits for
/// shutdown.
async fn halt_for_good(
    labels: &StreamLabels,
    metric_labels: &[(&'static str, String); 3],
    msg: &str,
    stop: &mut watch::Receiver<bool>,
) {
    set_state(labels, metric_labels, state::HALTED, Some(msg));
    tracing::error!("shard-partition {}/{} halted: {msg}", labels.source, labels.id);
    while !*stop.borrow() {
        if stop.changed().await.is_err() {
            break;
        }
    }
}

/// Publishes each MySQL/MariaDB stream's lag in bytes every few seconds: the binlog written
/// after its stored checkpoint position (`SHOW BINARY LOGS`, which REPLICATION CLIENT allows).
async fn binlog_lag_poller(source: String, opts: MyOpts, checkpoint: String, mut stop: watch::Receiver<bool>) {
    use outbox_mysql::mysql_async::prelude::Queryable;
    let mut conn: Option<MyConn> = None;
    loop {
        if conn.is_none() {
            conn = MyConn::new(opts.clone()).await.ok();
        }
        if let Some(c) = conn.as_mut() {
            let sql =
                format!("SELECT stream, binlog_file, binlog_pos FROM {}", outbox_mysql::setup::ident(&checkpoint));
            let polled = async {
                // MySQL 8 adds an Encrypted column: take the first two by position.
                let rows: Vec<MyRow> = c.query("SHOW BINARY LOGS").await?;
                let logs: Vec<(String, u64)> =
                    rows.iter().filter_map(|r| Some((r.get::<String, _>(0)?, r.get::<u64, _>(1)?))).collect();
                let stored: Vec<(String, Option<String>, Option<u64>)> = c.query(sql).await?;
                Ok::<_, MyError>((logs, stored))
            };
            match tokio::time::timeout(Duration::from_secs(10), polled).await {
                Ok(Ok((logs, stored))) => {
                    for (stream, file, offset) in stored {
                        let (Some(file), Some(offset)) = (file, offset) else { continue };
                        gauge!(m::BINLOG_LAG_BYTES, "source" => source.clone(), "table" => stream)
                            .set(binlog_bytes_after(&logs, &file, offset) as f64);
                    }
                }
                _ => conn = None,
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(LAG_POLL_INTERVAL) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Bytes in `logs` (name, size, in order) after `offset` in `file`.
pub(crate) fn binlog_bytes_after(logs: &[(String, u64)], file: &str, offset: u64) -> u64 {
    let Some(at) = logs.iter().position(|(name, _)| name == file) else { return 0 };
    logs[at].1.saturating_sub(offset) + logs[at + 1..].iter().map(|(_, size)| size).sum::<u64>()
}

/// Publishes each slot's lag in bytes every few seconds. (The slot of a shard-partition in
/// polling mode is moved along by its own polling session, that is by its owner only.)
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
pub(crate) const HEARTBEAT_PREFIX: &str = "outbox-streamer-heartbeat";

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

/// SIGTERM and SIGINT, listened for from the start of `run`; one that arrived early is kept.
struct StopSignal {
    term: Option<tokio::signal::unix::Signal>,
    int: Option<tokio::signal::unix::Signal>,
}

impl StopSignal {
    fn listen() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        let listen = |kind: SignalKind, name: &str| match signal(kind) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for {name}");
                None
            }
        };
        Self { term: listen(SignalKind::terminate(), "SIGTERM"), int: listen(SignalKind::interrupt(), "SIGINT") }
    }

    async fn wait(mut self) {
        async fn recv(s: &mut Option<tokio::signal::unix::Signal>) {
            match s {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            _ = recv(&mut self.term) => {}
            _ = recv(&mut self.int) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{BUSY_RETRY, BUSY_RETRY_MAX, BUSY_RETRY_MAX_OWNED, BusyWait};

    /// (waits, warnings) of a slot held for `for_s` seconds.
    fn held_for(for_s: u64, coordinated: bool) -> (Vec<Duration>, usize) {
        let start = Instant::now();
        let mut busy = BusyWait::new(start, coordinated);
        let (mut now, mut warnings, mut waits) = (start, 0, Vec::new());
        while now < start + Duration::from_secs(for_s) {
            let (warn, wait) = busy.attempt(now);
            warnings += usize::from(warn);
            waits.push(wait);
            now += wait;
        }
        (waits, warnings)
    }

    #[test]
    fn a_held_slot_is_retried_less_and_less_often_and_reported_once_per_30_s() {
        let (waits, warnings) = held_for(95, false);
        assert_eq!(waits[0], BUSY_RETRY, "the previous owner closing is waited for briefly");
        assert!(waits.windows(2).all(|w| w[1] >= w[0]), "the interval never shrinks: {waits:?}");
        assert_eq!(*waits.last().unwrap(), BUSY_RETRY_MAX);
        assert!(waits.len() < 20, "attempts in 95 s: {}", waits.len());
        // WARN at 0 s, then at the first attempts 30 s after the last WARN: 35.75 s, 65.75 s.
        assert_eq!(warnings, 3, "one WARN at once, then at most one per 30 s");
    }

    #[test]
    fn under_coordination_a_held_slot_is_the_previous_owner_closing() {
        let (waits, warnings) = held_for(5, true);
        assert_eq!(warnings, 0, "a handover is no warning");
        assert_eq!(*waits.last().unwrap(), BUSY_RETRY_MAX_OWNED, "retried often: {waits:?}");
        let (_, warnings) = held_for(35, true);
        assert_eq!(warnings, 1, "a handover lasting 30 s is");
    }

    #[test]
    fn binlog_bytes_after_a_position() {
        let logs = vec![("b.1".to_string(), 1000), ("b.2".to_string(), 500), ("b.3".to_string(), 200)];
        assert_eq!(super::binlog_bytes_after(&logs, "b.2", 100), 600);
        assert_eq!(super::binlog_bytes_after(&logs, "b.3", 200), 0);
        assert_eq!(super::binlog_bytes_after(&logs, "gone.9", 4), 0);
    }
}
