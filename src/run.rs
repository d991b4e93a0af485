//! `outbox-streamer run`: the supervisor and the wiring. It asks each source's database
//! ([`crate::db::Database`]) for one job per shard-partition and for its background tasks
//! (heartbeats, lag gauges), starts the jobs — all at once, or under ZooKeeper ownership through
//! [`crate::coordination`] — and on SIGTERM or SIGINT stops intake, waits until every task has
//! drained its acknowledgements, deleted and confirmed, then returns so the process exits 0.
//!
//! How one shard-partition's task retries, halts and catches up is in [`crate::job`]; nothing
//! here names a database.

use anyhow::Context;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::Config;
use crate::db::{self, JobContext};
use crate::lease::OwnerLease;
use crate::metrics as m;

/// Runs every shard-partition of `config` until SIGTERM or SIGINT (see the module docs).
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
    let cluster = config.coordination.as_ref().map_or("default", |c| c.cluster_name.as_str());
    let mut rabbitmq = config.rabbitmq.as_ref().map(crate::config::RabbitConfig::publisher).transpose()?;
    if let (Some(p), Some(c)) = (rabbitmq.as_mut(), &config.coordination) {
        // As for Kafka's queued records above: a message queued before a pause long enough to
        // lose the lease is not published after it.
        p.max_queued = p.max_queued.min(std::time::Duration::from_millis(c.session_timeout_ms / 2));
    }
    let ctx = JobContext { kafka: &config.kafka, rabbitmq: rabbitmq.as_ref(), instance: instance.as_deref(), cluster };
    for source in &config.sources {
        let database = db::of(source.kind);
        jobs.extend(database.jobs(source, &ctx)?);
        for task in database.background(source, &ctx, stop_rx.clone())? {
            tasks.spawn(task);
        }
    }
    // The message API serves from the first moment the streamers run: a commit's row waits in
    // the outbox for its shard-partition's streamer, whichever instance owns it.
    if let Some(api_tasks) = crate::api::start(&config, stop_rx.clone()).await? {
        for task in api_tasks {
            tasks.spawn(task);
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
