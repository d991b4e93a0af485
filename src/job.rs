//! One shard-partition's job ([`StreamJob`]) and the task that runs it, whatever the database.
//!
//! A database builds a job from [`JobParts`]: how to connect its source (CDC or polling) under
//! an owner lease, and how it catches up ([`CatchUp`]). What the task does about a failure is
//! decided by the error's kind alone, in the table [`crate::policy::policy`]. The task retries
//! transient errors with backoff (resuming from the last confirmed position), and on a definite
//! error halts alone: one ERROR with the reason and the fix, while the other shard-partitions
//! keep streaming; the halted task retries slowly and resumes by itself once the cause is fixed
//! (see [`crate::halt`]). On shutdown it stops intake, drains acknowledgements, deletes and
//! confirms, then ends.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::gauge;
use tokio::sync::watch;
use tracing::Instrument;

use crate::catchup::{CatchUp, Drain};
use crate::config::{SourceConfig, StreamSettings};
use crate::dberror;
use crate::error::Error;
use crate::halt::{HALT_RETRY_MAX, HaltPoint, HaltRetry};
use crate::lease::OwnerLease;
use crate::metrics::{self as m, state};
use crate::names::{StreamNames, all_streams};
use crate::policy::{Action, Phase, policy};
use crate::poll::PollSettings;
use crate::sink::{self, Broker, BrokerSettings, Sink as _};
use crate::source::Source;
use crate::streamer::{StreamLabels, StreamMemory, run_session};

const BACKOFF_START: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A session that lasted this long resets the backoff.
const BACKOFF_RESET_AFTER: Duration = Duration::from_secs(60);
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
/// Connecting a session (SQL and replication or binlog) must finish within this.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

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
pub(crate) struct JobParts<F> {
    pub labels: StreamLabels,
    /// Names the objects in the fixes of classified database errors.
    pub scope: dberror::Scope,
    pub settings: StreamSettings,
    pub names: StreamNames,
    pub connect: F,
    pub catch_up: Arc<dyn CatchUp>,
    pub broker: BrokerSettings,
    pub message_timeout_ms: u64,
}

impl<S, F, Fut> JobParts<F>
where
    S: Source + 'static,
    F: Fn(OwnerLease) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<S, Error>> + Send + 'static,
{
    pub(crate) fn into_job(self) -> StreamJob {
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
                    parts.broker.clone(),
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
pub(crate) fn stream_plans(source: &SourceConfig) -> Vec<(StreamLabels, StreamSettings, StreamNames)> {
    all_streams(source.shards, source.partitions)
        .map(|id| {
            let settings = source.settings_for(id);
            let names = source.stream_names(id);
            let labels = StreamLabels {
                source: source.name.clone(),
                id,
                table: names.table.clone(),
                id_column: source.layout().id_column(),
                quote: if source.kind == crate::config::SourceKind::Postgres { '"' } else { '`' },
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

/// The polling settings of a shard-partition in polling mode.
pub(crate) fn poll_settings(settings: &StreamSettings, labels: &StreamLabels) -> PollSettings {
    PollSettings {
        batch: settings.poll_batch,
        interval: Duration::from_millis(settings.poll_interval_ms),
        full_rescan_every: crate::poll::FULL_RESCAN_EVERY,
        max_batch_bytes: settings.max_in_flight_bytes as usize,
        drain_upto: None,
        in_snapshot: false,
        rows_sent: Default::default(),
        metric_labels: labels.metric_labels(),
        quiet: None,
    }
}

async fn stream_task<S, F, Fut>(
    labels: StreamLabels,
    settings: StreamSettings,
    connect: F,
    catch_up: Arc<dyn CatchUp>,
    broker: BrokerSettings,
    message_timeout_ms: u64,
    mut stop: watch::Receiver<bool>,
) where
    S: Source,
    F: Fn() -> Fut,
    Fut: Future<Output = Result<S, Error>>,
{
    let metric_labels = [
        ("source", labels.source.clone()),
        ("shard", labels.id.shard.to_string()),
        ("partition", labels.id.partition.to_string()),
    ];
    m::init_stream(&metric_labels);
    let [a, b, c] = metric_labels.clone();
    gauge!(m::STREAM_SINK, &[a, b, c, ("sink", settings.sink.as_str().to_string())]).set(1.0);
    set_state(&labels, &metric_labels, state::STOPPED, None);
    let Some(mut producer) = open_producer(&broker, &labels, &metric_labels) else { return };
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
            Err(_) => Err(Error::transient(format!(
                "connecting took longer than {CONNECT_TIMEOUT:?}; the database link is presumed dead"
            ))
            .connecting()),
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
                        tracing::info!(sink = settings.sink.as_str(), "streaming");
                    }
                }
                run_session(&labels, &settings, source, &producer, message_timeout, &mut stop, &mut memory).await
            }
            Err(e) => Err(e),
        };
        // A halt cleared for good: the next one waits the first interval again. A session
        // that cleared it and halted again soon after keeps the grown interval, so a halt that
        // only seemed to clear cannot retry at the first interval for ever.
        let by_broker = result.as_ref().is_err_and(Error::by_broker);
        let unreachable = result.as_ref().is_err_and(Error::while_connecting);
        // Taken, so a failed connect after it does not count as getting through.
        let progressed = std::mem::take(&mut memory.progressed);
        let error = match result {
            Ok(()) => None,
            Err(e) => Some((policy(e.kind(), Phase::Streaming), e.to_string())),
        };
        let action = error.as_ref().map(|(action, _)| *action);
        if memory.halted.is_none() && (action != Some(Action::Halt) || started.elapsed() > BACKOFF_RESET_AFTER) {
            halts.cleared();
        }
        if action != Some(Action::RetryBusy) {
            busy = None;
        }
        let Some((action, msg)) = error else { break };
        if producer.expired() {
            // Its transaction outlived the timeout and the broker retired it: only a new
            // producer can register the transactional id again.
            tracing::warn!("opening a new Kafka producer: the last one's transaction outlived its timeout");
            let Some(fresh) = open_producer(&broker, &labels, &metric_labels) else { return };
            sink::close(std::mem::replace(&mut producer, fresh)).await;
        }
        match action {
            Action::Stop if by_broker => {
                fenced_by_broker(&labels, &metric_labels, &msg, &mut stop).await;
                return;
            }
            Action::Stop => {
                revoked(&labels, &metric_labels, &msg, &mut stop).await;
                return;
            }
            Action::RetryBusy => {
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
            Action::BackOff => {
                // A session that got through (a database restart ended it, say) is not part of
                // a run of failures: the next attempt comes soon.
                // (Each such session removed rows from the table or moved the position on: a
                // run of them ends, it cannot reconnect quickly for ever without progress.)
                if started.elapsed() > BACKOFF_RESET_AFTER || progressed {
                    backoff = BACKOFF_START;
                }
                metrics::counter!(m::ERRORS, "source" => labels.source.clone(), "shard" => labels.id.shard.to_string(), "partition" => labels.id.partition.to_string(), "kind" => "source").increment(1);
                // `status` and `/readyz` tell an unreachable database from a halt at a glance.
                let reason = if unreachable { format!("database unreachable: {msg}") } else { msg.clone() };
                set_state(&labels, &metric_labels, state::RETRYING, Some(&reason));
                tracing::warn!(error = %msg, retry_in_ms = backoff.as_millis() as u64, "stream interrupted; resuming from the last confirmed position");
                back_off(&mut backoff, &mut stop).await;
            }
            Action::CatchUp => {
                let reason = msg;
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
                    Err(e) => match policy(e.kind(), Phase::CatchingUp) {
                        Action::Halt => {
                            memory.halted = Some(memory.take_halt_point());
                            if !halted(&labels, &metric_labels, &e.to_string(), &mut halts, None, &producer, &mut stop)
                                .await
                            {
                                break;
                            }
                        }
                        Action::Stop => {
                            revoked(&labels, &metric_labels, &e.to_string(), &mut stop).await;
                            return;
                        }
                        Action::BackOff | Action::RetryBusy | Action::CatchUp => {
                            set_state(&labels, &metric_labels, state::RETRYING, Some(&e.to_string()));
                            tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "catch-up interrupted; it starts over");
                            back_off(&mut backoff, &mut stop).await;
                        }
                    },
                }
            }
            Action::Halt => {
                let point = HaltPoint { at_connect, ..memory.take_halt_point() };
                let probe = point.missing_topic.clone();
                memory.halted = Some(point);
                if !halted(&labels, &metric_labels, &msg, &mut halts, probe.as_deref(), &producer, &mut stop).await {
                    break;
                }
            }
        }
    }
    sink::close(producer).await;
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
        let fix = format!(
            "this instance runs without [coordination] but instances with ZooKeeper ownership wrote the checkpoint; stop them or add the same [coordination] here, or, if none runs any more, reset the epoch: UPDATE <prefix>_checkpoint SET owner_epoch = 0 WHERE stream = '{}'; then restart (this halt does not clear by itself)",
            labels.table
        );
        let msg = Error::definite(msg, fix).to_string();
        halt_for_good(labels, metric_labels, &msg, stop).await;
        return;
    }
    if labels.lease.check().is_ok() {
        // Fenced by a stored epoch while this instance holds the lease in ZooKeeper and its
        // session is trusted: no owner of this ensemble can have a newer epoch (leases are
        // granted in zxid order and this one is held), so the stored one comes from another
        // ensemble — ZooKeeper replaced, or restored from an older backup — or from a hand.
        // Retrying would be fenced for ever.
        let what = format!(
            "{msg}, although this instance holds the lease (epoch {}) in ZooKeeper now: the stored epoch was written under another ZooKeeper ensemble (replaced, or restored from an older backup) or by hand",
            labels.lease.db_epoch()
        );
        let fix = format!(
            "make sure no instance still runs against the old ensemble, then reset the epoch: UPDATE <prefix>_checkpoint SET owner_epoch = 0 WHERE stream = '{}', and restart (see docs/ownership.md; this halt does not clear by itself)",
            labels.table
        );
        let msg = Error::definite(what, fix).to_string();
        halt_for_good(labels, metric_labels, &msg, stop).await;
        return;
    }
    stopped(labels, metric_labels);
    gauge!(m::OWNER_EPOCH, "stream" => labels.key()).set(0.0);
    tracing::warn!(reason = %msg, "stopped: ownership can no longer be confirmed");
}

/// Kafka fenced the shard-partition's transactional producer: a newer producer took its
/// transactional id. Under coordination that is the next owner (this instance lost its lease,
/// perhaps while frozen): stop, as for a lost lease. Without it, a second instance runs the
/// shard-partition: halt, with the message's fix, until an operator restarts this one (the
/// fenced producer can never publish again).
async fn fenced_by_broker(
    labels: &StreamLabels,
    metric_labels: &[(&'static str, String); 3],
    msg: &str,
    stop: &mut watch::Receiver<bool>,
) {
    if labels.lease.epoch().is_none() {
        halt_for_good(labels, metric_labels, msg, stop).await;
        return;
    }
    stopped(labels, metric_labels);
    gauge!(m::OWNER_EPOCH, "stream" => labels.key()).set(0.0);
    tracing::warn!(reason = %msg, "stopped: Kafka fenced this owner's producer; a newer owner publishes now");
}

/// Opens the shard-partition's producer; one that cannot be created (its settings are wrong)
/// halts the shard-partition for good: `None`.
fn open_producer(
    settings: &BrokerSettings,
    labels: &StreamLabels,
    metric_labels: &[(&'static str, String); 3],
) -> Option<Broker> {
    match sink::open(settings) {
        Ok(p) => Some(p),
        Err(e) => {
            let reason = e.to_string();
            set_state(labels, metric_labels, state::HALTED, Some(&reason));
            tracing::error!("{reason}; this shard-partition is halted");
            None
        }
    }
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
    producer: &Broker,
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
}
