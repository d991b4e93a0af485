//! ZooKeeper ownership: which instance streams which shard-partition.
//!
//! Every instance registers a member node, computes its quota from the member list
//! ([`assign`]) and takes free leases until it owns that many, or gives leases up when it owns
//! more. A lease is given up only after its shard-partition's task has stopped (drained,
//! deleted, checkpointed), and taken only when its lock node is gone, so a shard-partition is
//! never streamed by two instances that both believe they own it.
//!
//! The session is trusted only while ZooKeeper answers ([`crate::lease::SessionLease`]): a
//! probe every `session_timeout / 6` renews it; without answers the tasks stop producing after
//! `session_timeout / 2` and start again with the same lease if the session survives. When
//! the session expires, every task is aborted at once (its producer's queue is purged and its
//! database connections dropped), and the instance joins again with a new session.

pub(crate) mod assign;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::{counter, gauge};
use outbox_zookeeper::lease::{self, Lease};
use outbox_zookeeper::members::{self, Member, MemberView};
use outbox_zookeeper::paths::ClusterPaths;
use outbox_zookeeper::{SessionSettings, zk};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::CoordinationConfig;
use crate::job::StreamJob;
use crate::lease::{OwnerLease, SessionLease};
use crate::metrics as m;

/// How often an instance looks again for free leases and finished tasks even when the
/// member list did not change (a lease freed by a stopped task notifies nobody).
const REBALANCE_EVERY: Duration = Duration::from_millis(500);
/// How long a contender waits behind another one for a lease that looked free.
const ACQUIRE_WAIT: Duration = Duration::from_secs(1);
/// How long a released shard-partition's task gets to drain before it is aborted.
const RELEASE_WAIT: Duration = Duration::from_secs(45);

/// The ZooKeeper session settings of `config`: ensemble, session timeout, TLS.
pub(crate) fn session_settings(config: &CoordinationConfig) -> SessionSettings {
    let mut settings = SessionSettings::new(config.connect.clone());
    settings.session_timeout = Duration::from_millis(config.session_timeout_ms);
    settings.tls = config.tls.as_ref().and_then(|t| t.zookeeper());
    settings
}

/// Runs ownership until `stop` turns true; then stops every owned task and gives its lease up.
/// `metrics` (`host:port` of this instance's metrics endpoint) is published in the member
/// node, for `status`.
pub(crate) async fn run(
    config: &CoordinationConfig,
    jobs: Vec<StreamJob>,
    sources: BTreeMap<String, String>,
    metrics: Option<String>,
    mut stop: watch::Receiver<bool>,
) {
    let paths = ClusterPaths::new(&config.root, &config.cluster_name);
    let instance = config.instance_name();
    let view = MemberView {
        instance: instance.clone(),
        streams: Some(jobs.iter().map(|j| j.key.clone()).collect()),
        sources: Some(sources),
        metrics,
    };
    let settings = session_settings(config);
    let yield_after = config.yield_interval_s.map(Duration::from_secs);
    tracing::info!(%instance, cluster = %paths.base(), streams = jobs.len(), "joining the cluster through ZooKeeper");
    // Listed at zero from the start, so an alert on its increase has a series to compare with.
    counter!(m::ZK_SESSIONS_LOST).increment(0);
    let mut failing_since: Option<Instant> = None;
    // Grows while joining keeps failing (a missing chroot, a name taken), so a broken setup
    // does not open a ZooKeeper session (a quorum write) many times a second.
    let mut join_backoff = JOIN_BACKOFF_START;
    while !*stop.borrow() {
        let client = match outbox_zookeeper::connect(&settings).await {
            Ok(client) => client,
            Err(e) => {
                if failing_since.is_none() {
                    failing_since = Some(Instant::now());
                    tracing::error!(error = %e, "cannot reach ZooKeeper; this instance owns nothing until it can; retrying");
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.changed() => {}
                }
                continue;
            }
        };
        if failing_since.take().is_some() {
            tracing::info!("ZooKeeper reachable again");
        }
        let mut member = Membership {
            client,
            paths: &paths,
            instance: &instance,
            view: &view,
            jobs: &jobs,
            owned: BTreeMap::new(),
            yield_after,
            lost: mpsc::unbounded_channel(),
        };
        match member.run(&mut stop).await {
            Joined::Served => join_backoff = JOIN_BACKOFF_START,
            Joined::Refused => {
                tokio::select! {
                    _ = tokio::time::sleep(join_backoff) => {}
                    _ = stop.changed() => {}
                }
                join_backoff = (join_backoff * 2).min(JOIN_BACKOFF_MAX);
            }
        }
    }
}

/// How one session's membership ended.
enum Joined {
    /// It served until stopped or until the session was lost.
    Served,
    /// It could not join (registration failed, or the instance name is taken): try again later.
    Refused,
}

const JOIN_BACKOFF_START: Duration = Duration::from_secs(1);
const JOIN_BACKOFF_MAX: Duration = Duration::from_secs(30);

struct Owned {
    lease: Lease,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    /// Watches the lease node ([`guard_lease`]) for as long as this is owned.
    _guard: Guard,
    since: Instant,
}

/// A lease guard's task, stopped when the lease is no longer owned.
struct Guard(JoinHandle<()>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One ZooKeeper session's membership.
struct Membership<'a> {
    client: zk::Client,
    paths: &'a ClusterPaths,
    instance: &'a str,
    /// What this instance's member node says (its streams and sources).
    view: &'a MemberView,
    jobs: &'a [StreamJob],
    owned: BTreeMap<usize, Owned>,
    yield_after: Option<Duration>,
    /// Lease guards report a lease node gone here.
    lost: (mpsc::UnboundedSender<LeaseGone>, mpsc::UnboundedReceiver<LeaseGone>),
}

/// A lease node gone: (job index, epoch).
type LeaseGone = (usize, i64);

type Changed = Pin<Box<dyn Future<Output = zk::WatchedEvent> + Send>>;

impl Membership<'_> {
    async fn run(&mut self, stop: &mut watch::Receiver<bool>) -> Joined {
        let session = SessionLease::new(self.instance, self.client.session_timeout());
        let sent = Instant::now();
        let Some(mut node) = self.register().await else { return Joined::Refused };
        session.renew(sent);
        tracing::info!(member = %node, session_timeout_ms = self.client.session_timeout().as_millis() as u64, "registered as a cluster member");
        let renewer = tokio::spawn(renew(self.client.clone(), self.paths.members(), session.clone()));
        let mut states = self.client.state_watcher();
        let mut changed: Option<Changed> = None;
        let mut tick = tokio::time::interval(REBALANCE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut handoffs = Handoffs::default();
        loop {
            let listed = match changed {
                Some(_) => bounded(members::list(&self.client, self.paths)).await.map(|m| (m, None)),
                None => bounded(members::watch(&self.client, self.paths)).await.map(|(m, w)| (m, Some(w))),
            };
            match listed {
                Ok((list, watcher)) => {
                    if let Some(w) = watcher {
                        changed = Some(Box::pin(w.changed()));
                    }
                    if session.is_valid() && !list.iter().any(|m| m.node == node) {
                        // The member node was deleted by hand while the session lives: the
                        // leases are still this instance's; it only has to be a member again.
                        tracing::warn!(member = %node, "this instance's member node was deleted; registering again");
                        match self.register().await {
                            Some(again) => {
                                tracing::info!(member = %again, "registered again as a cluster member");
                                node = again;
                            }
                            None => {
                                session.revoke();
                                self.abort_all();
                                break;
                            }
                        }
                        continue;
                    }
                    if session.is_valid() {
                        self.rebalance(&list, &node, &session, &mut handoffs).await;
                    } else {
                        // The tasks stop producing on their own; report them as not owned.
                        for index in self.owned.keys() {
                            gauge!(m::OWNER_EPOCH, "stream" => self.jobs[*index].key.clone()).set(0.0);
                        }
                    }
                }
                Err(e) => tracing::debug!(error = %e, "cannot list members; trying again"),
            }
            tokio::select! {
                _ = stop.changed() => {
                    // Leave first, so the others count without this instance and take each
                    // lease as soon as it is given up.
                    let member = format!("{}/{node}", self.paths.members());
                    if let Err(e) = bounded(self.client.delete(&member, None)).await {
                        tracing::debug!(error = %e, "cannot delete the member node; it goes with the session");
                    }
                    self.release_all("released").await;
                    break;
                }
                state = states.changed() => match state {
                    zk::SessionState::Expired | zk::SessionState::Closed | zk::SessionState::AuthFailed => {
                        session.revoke();
                        tracing::error!(?state, owned = self.owned.len(), "ZooKeeper session lost: every owned shard-partition stops at once; joining again with a new session");
                        counter!(m::ZK_SESSIONS_LOST).increment(1);
                        self.abort_all();
                        break;
                    }
                    zk::SessionState::Disconnected => tracing::warn!("disconnected from ZooKeeper; owned shard-partitions stop producing if it lasts longer than half the session timeout"),
                    other => tracing::info!(state = ?other, "ZooKeeper connection state"),
                },
                _ = async { changed.as_mut().expect("set above").await }, if changed.is_some() => changed = None,
                Some((index, epoch)) = self.lost.1.recv() => self.lease_gone(index, epoch),
                // A lease offered to this instance was granted: start it now, not at the tick.
                _ = handoffs.granted.notified() => {}
                _ = tick.tick() => {}
            }
        }
        renewer.abort();
        gauge!(m::OWNED_STREAMS).set(0.0);
        Joined::Served
    }

    /// Registers this instance's member node, unless a live member already has its name.
    async fn register(&self) -> Option<String> {
        let node = match bounded(members::register(&self.client, self.paths, self.view)).await {
            Ok(node) => node,
            Err(e) => {
                let hint = if e == zk::Error::NoNode {
                    " (a chroot in coordination.connect that does not exist? create it, or leave the chroot out)"
                } else {
                    ""
                };
                tracing::error!(error = %e, path = %self.paths.members(), "cannot register as a cluster member{hint}; trying again with backoff");
                return None;
            }
        };
        let list = match bounded(members::list(&self.client, self.paths)).await {
            Ok(list) => list,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the cluster members after registering; trying again with backoff");
                return None;
            }
        };
        let mine = list.iter().find(|m| m.node == node).map_or(i64::MAX, |m| m.seq);
        if let Some(other) = list.iter().find(|m| m.instance == self.instance && m.node != node && m.seq < mine) {
            tracing::error!(
                instance = %self.instance,
                registered_as = %other.node,
                "another live instance of the cluster has this instance name: names must be unique (set coordination.instance to another name, or leave it out for <hostname>-<pid>); this instance owns nothing and tries again"
            );
            let member = format!("{}/{node}", self.paths.members());
            let _ = bounded(self.client.delete(&member, None)).await;
            return None;
        }
        if let Some(other) = list.iter().find(|m| m.seq < mine && another_deployment(self.view, &m.view)) {
            tracing::error!(
                cluster = %self.paths.base(),
                other_member = %other.instance,
                other_sources = ?other.view.sources.as_ref().map(|s| s.keys().collect::<Vec<_>>()),
                sources = ?self.view.sources.as_ref().map(|s| s.keys().collect::<Vec<_>>()),
                "another deployment shares this cluster: a member serves none of this instance's sources; give each deployment its own coordination.cluster_name. This instance owns nothing and tries again"
            );
            let member = format!("{}/{node}", self.paths.members());
            let _ = bounded(self.client.delete(&member, None)).await;
            return None;
        }
        for m in &list {
            for (name, fingerprint) in self.view.sources.iter().flatten() {
                if let Some(theirs) = m.view.sources.as_ref().and_then(|s| s.get(name))
                    && theirs != fingerprint
                {
                    tracing::warn!(source = %name, member = %m.instance, "another member configures this source with another database address; if it is not the same database under another name, the two deployments need their own cluster_name");
                }
            }
        }
        Some(node)
    }

    /// Reaps stopped tasks, then gives up or takes leases to reach this member's quota.
    async fn rebalance(&mut self, list: &[Member], node: &str, session: &Arc<SessionLease>, handoffs: &mut Handoffs) {
        session.set_live_members(list.iter().map(|m| m.instance.clone()));
        let Some(rank) = list.iter().position(|m| m.node == node) else {
            // Deleted by hand while the session lives: register again (below, by the caller).
            return;
        };
        self.restart_stopped(session).await;
        self.take_offers(handoffs, session).await;
        let (quota, mut order) = self.share(list, rank);
        let planned: BTreeSet<usize> = order.iter().take(quota).copied().collect();
        // What was just handed to this instance is preferred for a while, so that being over
        // its share gives up something else (which the yielding instance then takes).
        handoffs.taken.retain(|_, at| at.elapsed() < TAKEN_PREFERRED_FOR);
        order.sort_by_key(|i| !handoffs.taken.contains_key(i));
        // Give up the least preferred first.
        while self.owned.len() > quota {
            let Some(&index) = order.iter().rev().find(|i| self.owned.contains_key(i)) else { break };
            self.release(index, "released").await;
        }
        // At quota with a stream planned for another member while one planned for this one has
        // no owner (perhaps this member is the only one that serves it: a rolling change of
        // `shards`): give the other's back, so the counts can never leave a stream unowned.
        let mut given_back = BTreeSet::new();
        if self.owned.len() >= quota {
            for &index in &planned {
                if self.owned.contains_key(&index) || handoffs.accepting.contains_key(&index) {
                    continue;
                }
                if !matches!(bounded(lease::is_free(&self.client, self.paths, &self.jobs[index].key)).await, Ok(true)) {
                    handoffs.unowned_since.remove(&index);
                    continue;
                }
                if handoffs.unowned_since.entry(index).or_insert_with(Instant::now).elapsed() < GIVE_BACK_AFTER {
                    continue;
                }
                handoffs.unowned_since.remove(&index);
                let Some(&other) = order.iter().rev().find(|i| self.owned.contains_key(i) && !planned.contains(i))
                else {
                    break;
                };
                tracing::info!(stream = %self.jobs[other].key, planned = %self.jobs[index].key, "giving back a lease planned for another member to take an unowned one planned for this one");
                self.release(other, "released").await;
                given_back.insert(other);
            }
        } else {
            handoffs.unowned_since.clear();
        }
        if let Some(after) = self.yield_after
            && list.len() > 1
        {
            self.hand_over(list, rank, after, handoffs).await;
        }
        for index in order {
            if self.owned.len() >= quota {
                break;
            }
            if self.owned.contains_key(&index) || handoffs.accepting.contains_key(&index) || given_back.contains(&index)
            {
                continue;
            }
            let key = &self.jobs[index].key;
            match bounded(lease::is_free(&self.client, self.paths, key)).await {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    tracing::debug!(stream = %key, error = %e, "cannot read the lease");
                    return;
                }
            }
            match bounded(lease::acquire(&self.client, self.paths, key, self.instance, ACQUIRE_WAIT)).await {
                Ok(Some(lease)) => self.start(index, lease, session),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(stream = %key, error = %e, "cannot take the lease");
                    return;
                }
            }
        }
        gauge!(m::OWNED_STREAMS).set(self.owned.len() as f64);
    }

    /// Yielding without a gap: a lease owned for `after` is offered to the next member that
    /// serves it; this instance keeps streaming until that member queues for the lease, then
    /// gives it up, and the queued member gets it the moment its lock node is deleted. An
    /// offer nobody takes within [`OFFER_TIMEOUT`] is withdrawn and the lease kept.
    async fn hand_over(&mut self, list: &[Member], rank: usize, after: Duration, handoffs: &mut Handoffs) {
        let due: Vec<usize> = self
            .owned
            .iter()
            .filter(|(i, o)| o.since.elapsed() >= after && !handoffs.offered.contains_key(i))
            .map(|(i, _)| *i)
            .collect();
        for index in due {
            let key = &self.jobs[index].key;
            let successor = (1..list.len())
                .map(|step| &list[(rank + step) % list.len()])
                .find(|m| m.view.streams.as_ref().is_none_or(|s| s.contains(key)));
            let Some(successor) = successor else { continue };
            match bounded(lease::offer(&self.client, self.paths, key, &successor.instance)).await {
                Ok(()) => {
                    handoffs.offered.insert(index, (successor.instance.clone(), Instant::now()));
                }
                Err(e) => tracing::debug!(stream = %key, error = %e, "cannot offer the lease"),
            }
        }
        let offered: Vec<(usize, String, Instant)> =
            handoffs.offered.iter().map(|(i, (s, at))| (*i, s.clone(), *at)).collect();
        for (index, successor, at) in offered {
            let key = self.jobs[index].key.clone();
            if !self.owned.contains_key(&index) {
                handoffs.offered.remove(&index);
                continue;
            }
            match bounded(lease::contenders(&self.client, self.paths, &key)).await {
                Ok(n) if n >= 2 => {
                    handoffs.offered.remove(&index);
                    tracing::info!(stream = %key, %successor, "yielding: handed over to the member waiting for the lease");
                    self.release(index, "yielded").await;
                }
                _ if at.elapsed() >= OFFER_TIMEOUT => {
                    handoffs.offered.remove(&index);
                    let _ = bounded(lease::withdraw(&self.client, self.paths, &successor, &key)).await;
                    if let Some(owned) = self.owned.get_mut(&index) {
                        owned.since = Instant::now();
                    }
                    tracing::info!(stream = %key, %successor, "yielding: nobody took the offered lease; keeping it");
                }
                _ => {}
            }
        }
    }

    /// Queues for every lease offered to this instance (in the background, so a yielding
    /// owner that gives it up is followed at once), and starts the ones that were granted.
    async fn take_offers(&mut self, handoffs: &mut Handoffs, session: &Arc<SessionLease>) {
        let finished: Vec<usize> =
            handoffs.accepting.iter().filter(|(_, t)| t.is_finished()).map(|(i, _)| *i).collect();
        for index in finished {
            let task = handoffs.accepting.remove(&index).expect("listed above");
            let key = self.jobs[index].key.clone();
            let _ = bounded(lease::withdraw(&self.client, self.paths, self.instance, &key)).await;
            if let Ok(Ok(Some(lease))) = task.await {
                tracing::info!(stream = %key, "took over a lease yielded to this instance");
                handoffs.taken.insert(index, Instant::now());
                self.start(index, lease, session);
            }
        }
        let Ok(offered) = bounded(lease::offers(&self.client, self.paths, self.instance)).await else { return };
        for key in offered {
            let Some(index) = self.jobs.iter().position(|j| j.key == key) else { continue };
            if self.owned.contains_key(&index) || handoffs.accepting.contains_key(&index) {
                continue;
            }
            let (client, paths, instance) = (self.client.clone(), self.paths.clone(), self.instance.to_string());
            let granted = handoffs.granted.clone();
            handoffs.accepting.insert(
                index,
                tokio::spawn(async move {
                    let result = lease::acquire(&client, &paths, &key, &instance, OFFER_TIMEOUT).await;
                    granted.notify_one();
                    result
                }),
            );
        }
    }

    /// This member's share of the work: how many shard-partitions it should own and the order
    /// in which it prefers its own (its planned ones first). The plan is over the union of
    /// what the members serve ([`assign::plan`]), so members whose configurations differ (a
    /// rolling change of `shards`) never leave a shard-partition that one of them serves
    /// without an owner. An older member whose node lists nothing is taken to serve what this
    /// one does.
    fn share(&self, list: &[Member], rank: usize) -> (usize, Vec<usize>) {
        let mine: Vec<String> = self.jobs.iter().map(|j| j.key.clone()).collect();
        let serves: Vec<&[String]> =
            list.iter().map(|m| m.view.streams.as_deref().unwrap_or(mine.as_slice())).collect();
        let union: Vec<&String> = serves.iter().flat_map(|s| s.iter()).collect::<BTreeSet<_>>().into_iter().collect();
        let index_of = |key: &String| union.binary_search(&key).ok();
        let sets: Vec<Vec<usize>> = serves.iter().map(|s| s.iter().filter_map(index_of).collect()).collect();
        let targets = &assign::plan(union.len(), &sets)[rank];
        let job_of: BTreeMap<&String, usize> = self.jobs.iter().enumerate().map(|(i, j)| (&j.key, i)).collect();
        let mut order: Vec<usize> = targets.iter().filter_map(|&u| job_of.get(union[u]).copied()).collect();
        for index in assign::preference(self.jobs.len(), list.len(), rank) {
            if !order.contains(&index) {
                order.push(index);
            }
        }
        (targets.len(), order)
    }

    fn start(&mut self, index: usize, lease: Lease, session: &Arc<SessionLease>) {
        let job = &self.jobs[index];
        tracing::info!(stream = %job.key, epoch = lease.epoch, "lease acquired; streaming");
        counter!(m::LEASE_CHANGES, "event" => "acquired").increment(1);
        gauge!(m::OWNER_EPOCH, "stream" => job.key.clone()).set(lease.epoch as f64);
        self.spawn(index, lease, session, Instant::now());
    }

    /// Starts the task of `index` under `lease`, with the guard that watches its node.
    fn spawn(&mut self, index: usize, lease: Lease, session: &Arc<SessionLease>, since: Instant) {
        let owner = OwnerLease::held(lease.epoch, session.clone());
        let guard = Guard(tokio::spawn(guard_lease(
            self.client.clone(),
            lease.path().to_string(),
            lease.epoch,
            owner.clone(),
            index,
            self.lost.0.clone(),
        )));
        let (stop, stop_rx) = watch::channel(false);
        let task = self.jobs[index].spawn(owner, stop_rx);
        self.owned.insert(index, Owned { lease, stop, task, _guard: guard, since });
    }

    /// A guard saw the lease node of `index` gone while the session lives: the lease may be
    /// granted again at once, so the task stops at once (it already refuses to produce).
    fn lease_gone(&mut self, index: usize, epoch: i64) {
        if self.owned.get(&index).is_none_or(|o| o.lease.epoch != epoch) {
            return;
        }
        let owned = self.owned.remove(&index).expect("checked above");
        owned.task.abort();
        let key = &self.jobs[index].key;
        tracing::error!(stream = %key, epoch, "the lease node was deleted while this instance held it (by hand, or a ZooKeeper restore): the shard-partition stopped at once; ownership is decided again");
        counter!(m::LEASE_CHANGES, "event" => "lost").increment(1);
        gauge!(m::OWNER_EPOCH, "stream" => key.clone()).set(0.0);
    }

    /// A task that ended by itself stopped because the session could not be confirmed: start
    /// it again if the lease survived, else forget the lease.
    async fn restart_stopped(&mut self, session: &Arc<SessionLease>) {
        let finished: Vec<usize> = self.owned.iter().filter(|(_, o)| o.task.is_finished()).map(|(i, _)| *i).collect();
        for index in finished {
            let owned = self.owned.remove(&index).expect("listed above");
            match bounded(owned.lease.still_held()).await {
                Ok(true) => {
                    tracing::info!(stream = %self.jobs[index].key, epoch = owned.lease.epoch, "the lease survived; streaming again");
                    gauge!(m::OWNER_EPOCH, "stream" => self.jobs[index].key.clone()).set(owned.lease.epoch as f64);
                    let Owned { lease, since, .. } = owned;
                    self.spawn(index, lease, session, since);
                }
                _ => {
                    tracing::warn!(stream = %self.jobs[index].key, "the lease is gone; another instance may take the shard-partition");
                    counter!(m::LEASE_CHANGES, "event" => "lost").increment(1);
                    gauge!(m::OWNER_EPOCH, "stream" => self.jobs[index].key.clone()).set(0.0);
                }
            }
        }
    }

    /// Stops the task (it drains, deletes and checkpoints), then deletes the lock node.
    async fn release(&mut self, index: usize, event: &'static str) {
        let Some(owned) = self.owned.remove(&index) else { return };
        let key = &self.jobs[index].key;
        let _ = owned.stop.send(true);
        let mut task = owned.task;
        if tokio::time::timeout(RELEASE_WAIT, &mut task).await.is_err() {
            tracing::warn!(stream = %key, "the task did not stop within {RELEASE_WAIT:?}; aborted");
            task.abort();
            let _ = task.await;
        }
        gauge!(m::OWNER_EPOCH, "stream" => key.clone()).set(0.0);
        if let Err(e) = bounded(owned.lease.release()).await {
            tracing::warn!(stream = %key, error = %e, "cannot delete the lease node; it goes with the session");
        }
        tracing::info!(stream = %key, %event, "lease given up");
        counter!(m::LEASE_CHANGES, "event" => event).increment(1);
    }

    async fn release_all(&mut self, event: &'static str) {
        for o in self.owned.values() {
            let _ = o.stop.send(true);
        }
        let indexes: Vec<usize> = self.owned.keys().copied().collect();
        for index in indexes {
            self.release(index, event).await;
        }
    }

    /// The session is gone: no task may produce or write another thing.
    fn abort_all(&mut self) {
        for (index, owned) in std::mem::take(&mut self.owned) {
            owned.task.abort();
            counter!(m::LEASE_CHANGES, "event" => "lost").increment(1);
            gauge!(m::OWNER_EPOCH, "stream" => self.jobs[index].key.clone()).set(0.0);
        }
    }
}

/// Which database a source streams, as member nodes show it: kind, host, port, database and
/// table prefix — never the login or the password.
pub(crate) fn fingerprint(source: &crate::config::SourceConfig) -> String {
    let url = source.url.redacted();
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let database = path.split(['?', '#']).next().unwrap_or_default();
    format!("{:?} {host}/{database} {}", source.kind, source.table_prefix)
}

/// Whether `theirs` belongs to another deployment: it serves none of the sources of `mine`
/// (both views name their sources; an older member's does not, and is taken to be ours).
fn another_deployment(mine: &MemberView, theirs: &MemberView) -> bool {
    match (&mine.sources, &theirs.sources) {
        (Some(a), Some(b)) => !b.is_empty() && !a.keys().any(|name| b.contains_key(name)),
        _ => false,
    }
}

/// Watches the node of a held lease. When it is gone, or is another node now, while the
/// session lives (an operator deleted it, a ZooKeeper restore lost it), marks the lease lost —
/// the task refuses to produce from its next record on — and tells the coordinator, which
/// stops the task. A broken session ends the guard: the session lease covers that case.
async fn guard_lease(
    client: zk::Client,
    path: String,
    epoch: i64,
    owner: OwnerLease,
    index: usize,
    lost: mpsc::UnboundedSender<LeaseGone>,
) {
    loop {
        match client.check_and_watch_stat(&path).await {
            Ok((Some(stat), watcher)) if stat.czxid == epoch => {
                let event = watcher.changed().await;
                if event.event_type == zk::EventType::Session
                    && matches!(
                        event.session_state,
                        zk::SessionState::Expired | zk::SessionState::Closed | zk::SessionState::AuthFailed
                    )
                {
                    return;
                }
            }
            Ok(_) => {
                owner.mark_lost();
                let _ = lost.send((index, epoch));
                return;
            }
            Err(zk::Error::SessionExpired | zk::Error::ClientClosed | zk::Error::AuthFailed) => return,
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Leases moving by yield: offered by this instance, being taken by it, and just taken.
#[derive(Default)]
struct Handoffs {
    /// Offered to another member: (its instance name, since when).
    offered: BTreeMap<usize, (String, Instant)>,
    /// Offered to this instance, queued for in the background.
    accepting: BTreeMap<usize, JoinHandle<Result<Option<Lease>, zk::Error>>>,
    /// Taken over recently (preferred, see [`TAKEN_PREFERRED_FOR`]).
    taken: BTreeMap<usize, Instant>,
    /// Planned for this member and seen without an owner, since when (see [`GIVE_BACK_AFTER`]).
    unowned_since: BTreeMap<usize, Instant>,
    /// Woken when a lease queued for in `accepting` is granted (or the wait ends).
    granted: Arc<tokio::sync::Notify>,
}

impl Drop for Handoffs {
    fn drop(&mut self) {
        for task in self.accepting.values() {
            task.abort();
        }
    }
}

/// How long an offered lease waits for its successor to queue before it is kept.
const OFFER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a lease taken over by yield is preferred to this instance's others.
const TAKEN_PREFERRED_FOR: Duration = Duration::from_secs(10);

/// How long a stream planned for this member must stay without an owner before it gives back
/// another's to take it: a lease is free for a moment during every handover, and giving back
/// then would only move leases around.
const GIVE_BACK_AFTER: Duration = Duration::from_secs(2);

/// The longest one ZooKeeper call of the coordinator may take: while ZooKeeper is away, calls
/// wait for the connection, and the coordinator must still answer a shutdown.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs a ZooKeeper call under [`CALL_TIMEOUT`]; a timeout reads as `ConnectionLoss`.
async fn bounded<T>(call: impl Future<Output = Result<T, zk::Error>>) -> Result<T, zk::Error> {
    tokio::time::timeout(CALL_TIMEOUT, call).await.unwrap_or(Err(zk::Error::ConnectionLoss))
}

/// Probes ZooKeeper (a read of `path`) every `session_timeout / 6`; each answer renews the
/// session's trust: an answer within the session proves the session was alive when sent.
async fn renew(client: zk::Client, path: String, session: Arc<SessionLease>) {
    let every = client.session_timeout() / 6;
    loop {
        let sent = Instant::now();
        if let Ok(Ok(_)) = tokio::time::timeout(every * 2, client.check_stat(&path)).await {
            session.renew(sent);
        }
        tokio::time::sleep(every.saturating_sub(sent.elapsed())).await;
    }
}
