//! ZooKeeper ownership with several real `outbox-streamer` processes against real ZooKeeper,
//! PostgreSQL and Kafka: balance, failover after SIGKILL, fencing of an owner paused past its
//! session, a ZooKeeper restart, and a delayed, reset and cut link to ZooKeeper.
//!
//! Every test runs a writer that inserts, per table, payloads 1, 2, 3, … keyed by the table
//! (one writer per table, so id order is commit order), and checks at the end that every row
//! arrived, that per table the first deliveries keep that order, and that per table the
//! `outbox-owner-epoch` header never goes back in Kafka order: once a newer owner's record is
//! in Kafka, no older owner's record follows.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use outbox_zookeeper::lease::{self, Holder};
use outbox_zookeeper::paths::ClusterPaths;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::types::ToSql;

use crate::support::kafka::{self, Record};
use crate::support::pg::PgDb;
use crate::support::proxy::Proxy;
use crate::support::streamer::{Running, run_cli};
use crate::support::world::World;
use crate::support::{env, pg, services, unique, wait_until};

/// Short, so the tests fail over quickly; the services' ZooKeeper allows 1 s to 60 s.
const SESSION_MS: u64 = 3000;
/// Takeover must happen within the session timeout plus this margin.
const TAKEOVER_MARGIN: Duration = Duration::from_secs(10);
const SETTLE: Duration = Duration::from_secs(60);
const ARRIVAL: Duration = Duration::from_secs(120);

fn coordination(cluster: &str, connect: &str) -> String {
    format!(
        "\n[coordination]\nkind = \"zookeeper\"\nconnect = \"{connect}\"\ncluster_name = \"{cluster}\"\nsession_timeout_ms = {SESSION_MS}\n"
    )
}

/// A cluster of instances over one database's shard-partitions.
struct Cluster {
    w: World<PgDb>,
    paths: ClusterPaths,
    keys: Vec<String>,
    tables: Vec<String>,
    zk: outbox_zookeeper::zk::Client,
    instances: Vec<Option<Instance>>,
}

struct Instance {
    run: Running,
    metrics: SocketAddr,
}

impl Cluster {
    async fn new(name: &str, shards: u32, partitions: u32, exclusive: bool) -> Self {
        let cluster = unique(name);
        let extra = coordination(&cluster, &env("OUTBOX_ZK_CONNECT"));
        let w = if exclusive {
            World::postgres(name)
                .shards(shards)
                .partitions(partitions)
                .kafka_partitions(3)
                .config(&extra)
                .exclusive()
                .build()
                .await
        } else {
            World::postgres(name).shards(shards).partitions(partitions).kafka_partitions(3).config(&extra).build().await
        };
        let tables: Vec<String> =
            (0..shards).flat_map(|s| (0..partitions).map(move |p| (s, p))).map(|(s, p)| w.table(s, p)).collect();
        let keys = tables.iter().map(|t| format!("test.{t}")).collect();
        let zk = outbox_zookeeper::connect(&outbox_zookeeper::SessionSettings::new(env("OUTBOX_ZK_CONNECT")))
            .await
            .expect("ZooKeeper session for the test");
        let paths = ClusterPaths::new("/outbox-streamer", &cluster);
        Self { w, paths, keys, tables, zk, instances: Vec::new() }
    }

    /// Starts one more instance with `config` (the world's config by default); returns its index.
    fn start_with(&mut self, config: &Path) -> usize {
        let n = self.instances.len();
        let metrics = free_port();
        let run = Running::start_with_env(
            config,
            &self.w.dir.join(format!("instance-{n}.log")),
            &[("OUTBOX_METRICS_LISTEN", metrics.to_string())],
        );
        self.instances.push(Some(Instance { run, metrics }));
        n
    }

    fn start(&mut self) -> usize {
        let config = self.w.config.clone();
        self.start_with(&config)
    }

    fn instance(&self, n: usize) -> &Instance {
        self.instances[n].as_ref().expect("instance running")
    }

    /// The instance index holding a lease, by the pid in the default instance name.
    fn index_of(&self, holder: &Holder) -> Option<usize> {
        self.instances
            .iter()
            .position(|i| i.as_ref().is_some_and(|i| holder.instance.ends_with(&format!("-{}", i.run.pid()))))
    }

    /// Each lease's holder (instance index, epoch), or None.
    async fn owners(&self) -> Vec<Option<(usize, i64)>> {
        let mut out = Vec::new();
        for key in &self.keys {
            let holder = lease::holder(&self.zk, &self.paths, key).await.expect("reading a lease");
            out.push(holder.and_then(|h| Some((self.index_of(&h)?, h.epoch))));
        }
        out
    }

    /// Waits until every lease is held and instance `i` holds `want[i]` of them.
    async fn wait_for_counts(&self, want: &[usize], timeout: Duration) -> Vec<(usize, i64)> {
        let want = want.to_vec();
        self.wait_for(&format!("leases held as {want:?}"), timeout, move |counts| counts == want).await
    }

    /// Waits until every lease is held and the running instances hold them evenly (counts
    /// differ by at most one; which instance gets one more depends on who joined first).
    async fn wait_for_balance(&self, timeout: Duration) -> Vec<(usize, i64)> {
        let running: Vec<usize> = (0..self.instances.len()).filter(|i| self.instances[*i].is_some()).collect();
        self.wait_for(&format!("leases spread evenly over instances {running:?}"), timeout, move |counts| {
            let live: Vec<usize> = running.iter().map(|i| counts[*i]).collect();
            let stopped_own_nothing = (0..counts.len()).all(|i| running.contains(&i) || counts[i] == 0);
            stopped_own_nothing && live.iter().max().unwrap_or(&0) - live.iter().min().unwrap_or(&0) <= 1
        })
        .await
    }

    async fn wait_for(&self, what: &str, timeout: Duration, accept: impl Fn(Vec<usize>) -> bool) -> Vec<(usize, i64)> {
        wait_until(what, timeout, || async {
            let owners = self.owners().await;
            let held: Vec<(usize, i64)> = owners.iter().flatten().copied().collect();
            if held.len() != self.keys.len() {
                return None;
            }
            let counts: Vec<usize> =
                (0..self.instances.len()).map(|i| held.iter().filter(|(o, _)| *o == i).count()).collect();
            accept(counts).then_some(held)
        })
        .await
    }

    /// `status` (table and JSON, from any host) names each shard-partition's owner and epoch
    /// as ZooKeeper has them in `held`, and exits 0.
    fn status_shows(&self, held: &[(usize, i64)]) {
        let (ok, table, err) = run_cli(&self.w.config, &["status"]);
        assert!(ok, "status exits 0 when every shard-partition has an owner:\n{table}\n{err}");
        assert!(
            table.contains(&format!("{} live instance(s)", held.iter().map(|(o, _)| o).collect::<HashSet<_>>().len()))
        );
        let (ok, json, err) = run_cli(&self.w.config, &["status", "--json"]);
        assert!(ok, "status --json:\n{err}");
        let rows: Vec<serde_json::Value> = serde_json::from_str(&json).expect("status --json is a JSON array");
        assert_eq!(rows.len(), self.tables.len());
        for (i, (owner, epoch)) in held.iter().enumerate() {
            let pid = self.instance(*owner).run.pid();
            let row = &rows[i];
            assert!(row["owner"].as_str().is_some_and(|o| o.ends_with(&format!("-{pid}"))), "owner of row {i}: {row}");
            assert_eq!(row["owner_epoch"].as_i64(), Some(*epoch), "epoch of row {i}: {row}");
            let line = table.lines().find(|l| l.contains(&format!("-{pid} ")) && l.contains(&epoch.to_string()));
            assert!(line.is_some(), "the table shows owner -{pid} with epoch {epoch}:\n{table}");
        }
    }

    /// Stops the writer, checks every record (see [`check`]) and waits for every table to
    /// drain; returns the number of duplicates.
    async fn finish(&self, writer: Writer) -> usize {
        let sent = writer.finish().await;
        let records = read_all(&self.w.topic, &sent).await;
        let duplicates = check(&records, &sent);
        for table in &self.tables {
            self.w.wait_drained(table).await;
        }
        duplicates
    }

    /// Per instance, the epochs of the streams it reports as owned (`outbox_owner_epoch` > 0);
    /// an instance that does not answer within a second is left out.
    async fn reported(&self) -> Vec<(usize, String, i64)> {
        let mut out = Vec::new();
        for (n, instance) in self.instances.iter().enumerate() {
            let Some(instance) = instance else { continue };
            let Ok(Some(text)) = tokio::time::timeout(Duration::from_secs(1), scrape(instance.metrics)).await else {
                continue;
            };
            for line in text.lines().filter(|l| l.starts_with("outbox_owner_epoch{")) {
                let stream = line.split('"').nth(1).unwrap_or_default().to_string();
                let epoch = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) as i64;
                if epoch > 0 {
                    out.push((n, stream, epoch));
                }
            }
        }
        out
    }
}

/// Samples every instance's reported ownership until stopped; an overlap is two instances
/// reporting the same stream in two consecutive rounds (a single round reads the instances
/// one after another, so a handover between two reads is not an overlap).
fn overlap_sampler(cluster: Arc<tokio::sync::RwLock<Cluster>>, stop: Arc<AtomicBool>) -> JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let mut previous: HashSet<(usize, String, i64)> = HashSet::new();
        let mut overlaps = Vec::new();
        // A sampling period, not a wait for anything.
        let mut every = tokio::time::interval(Duration::from_millis(100));
        while !stop.load(Ordering::SeqCst) {
            every.tick().await;
            let now: HashSet<(usize, String, i64)> = cluster.read().await.reported().await.into_iter().collect();
            let both: Vec<&(usize, String, i64)> = now.intersection(&previous).collect();
            let mut by_stream: HashMap<&str, HashSet<usize>> = HashMap::new();
            for (n, stream, _) in &both {
                by_stream.entry(stream.as_str()).or_default().insert(*n);
            }
            for (stream, owners) in by_stream {
                if owners.len() > 1 {
                    overlaps.push(format!("{stream} owned by instances {owners:?} at once"));
                }
            }
            previous = now;
        }
        overlaps
    })
}

/// Inserts, round robin over `tables`, payloads `<table>:<n>` keyed by the table, until
/// stopped; returns how many rows each table got.
/// The rounds a [`Writer`] writes before it may stop.
const MIN_ROUNDS: u32 = 20;

struct Writer {
    stop: watch::Sender<bool>,
    task: JoinHandle<BTreeMap<String, u64>>,
}

impl Writer {
    fn start(url: &str, tables: &[String], topic: &str) -> Self {
        let (stop, mut stopped) = watch::channel(false);
        let (url, tables, topic) = (url.to_string(), tables.to_vec(), topic.to_string());
        let task = tokio::spawn(async move {
            let client = pg::connect(&url).await;
            let mut sent: BTreeMap<String, u64> = tables.iter().map(|t| (t.clone(), 0)).collect();
            let mut pace = tokio::time::interval(Duration::from_millis(4));
            // A few rounds are written whatever happens: a test whose steps were quick (or a
            // connection that was slow under load) must still have rows to check.
            let mut rounds = 0u32;
            loop {
                let written_enough = rounds >= MIN_ROUNDS;
                if written_enough && *stopped.borrow() {
                    break;
                }
                tokio::select! {
                    _ = pace.tick() => {}
                    _ = stopped.changed(), if written_enough => break,
                }
                rounds += 1;
                for table in &tables {
                    let n = sent[table] + 1;
                    let payload = format!("{table}:{n}");
                    let inserted = client
                        .execute(
                            &format!("INSERT INTO {table} (topic, msg_key, payload) VALUES ($1, $2, $3)"),
                            &[&topic as &(dyn ToSql + Sync), &table.as_bytes(), &payload.as_bytes()],
                        )
                        .await;
                    inserted.expect("insert");
                    sent.insert(table.clone(), n);
                }
            }
            sent
        });
        Self { stop, task }
    }

    async fn finish(self) -> BTreeMap<String, u64> {
        let _ = self.stop.send(true);
        self.task.await.expect("writer")
    }
}

/// What the records say: per table, every payload 1..=sent arrived, first deliveries in
/// order, and the owner epoch never goes back. Returns the number of duplicates.
fn check(records: &[Record], sent: &BTreeMap<String, u64>) -> usize {
    let mut sorted = records.to_vec();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut seen: HashSet<(String, u64)> = HashSet::new();
    let mut last_first: HashMap<String, u64> = HashMap::new();
    let mut last_epoch: HashMap<String, i64> = HashMap::new();
    let mut duplicates = 0;
    for r in &sorted {
        let payload = r.payload_str();
        let (table, n) = payload.rsplit_once(':').expect("payload is table:n");
        let n: u64 = n.parse().expect("numeric n");
        let epoch: i64 = r.header("outbox-owner-epoch").parse().expect("numeric epoch");
        let last = last_epoch.entry(table.to_string()).or_insert(epoch);
        assert!(
            epoch >= *last,
            "{table}: a record of epoch {epoch} follows one of epoch {last} in Kafka (payload {n}, offset {})",
            r.offset
        );
        *last = epoch;
        if seen.insert((table.to_string(), n)) {
            let prev = last_first.insert(table.to_string(), n).unwrap_or(0);
            assert!(n > prev, "{table}: first delivery of {n} after {prev}: out of commit order");
        } else {
            duplicates += 1;
        }
    }
    for (table, count) in sent {
        let arrived = seen.iter().filter(|(t, _)| t == table).count() as u64;
        assert_eq!(arrived, *count, "{table}: every committed row arrived");
    }
    duplicates
}

async fn read_all(topic: &str, sent: &BTreeMap<String, u64>) -> Vec<Record> {
    kafka::read_distinct(topic, 3, sent.values().sum::<u64>() as usize, ARRIVAL).await
}

fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").expect("free port").local_addr().unwrap()
}

async fn scrape(addr: SocketAddr) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await.ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await.ok()?;
    Some(text)
}

fn config_with(config: &Path, from: &str, to: &str, name: &str) -> PathBuf {
    let text = std::fs::read_to_string(config).expect("config").replace(from, to);
    let path = config.with_file_name(name);
    std::fs::write(&path, text).expect("write config");
    path
}

/// The world's configuration in polling mode.
fn polling_config(config: &Path) -> PathBuf {
    config_with(config, "status_interval_ms = 100", "status_interval_ms = 100\nmode = \"polling\"", "polling.toml")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_share_shard_partitions_evenly_as_they_join_and_leave() {
    let mut c = Cluster::new("zb", 3, 2, false).await;
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    for _ in 0..3 {
        c.start();
    }
    let held = c.wait_for_balance(SETTLE).await;
    c.status_shows(&held);
    let c = Arc::new(tokio::sync::RwLock::new(c));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = overlap_sampler(c.clone(), stop.clone());

    let fourth = c.write().await.start();
    assert_eq!(fourth, 3);
    c.read().await.wait_for_balance(SETTLE).await;

    // The third leaves (SIGTERM): its shard-partitions move to the others, evenly.
    let third = c.write().await.instances[2].take().expect("third instance");
    assert!(third.run.stop(), "a leaving instance exits 0 on SIGTERM");
    c.read().await.wait_for_balance(SETTLE).await;

    stop.store(true, Ordering::SeqCst);
    let overlaps = sampler.await.expect("sampler");
    assert!(overlaps.is_empty(), "two owners at once: {overlaps:?}");
    let c = Arc::into_inner(c).expect("sampler ended").into_inner();
    let duplicates = c.finish(writer).await;
    assert_eq!(duplicates, 0, "a graceful handover drains before it releases: no duplicates");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owner_is_replaced_within_the_session_timeout() {
    let mut c = Cluster::new("zk", 2, 2, false).await;
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    let a = c.start();
    c.wait_for_counts(&[4], SETTLE).await;
    let b = c.start();
    let held = c.wait_for_counts(&[2, 2], SETTLE).await;
    let b_before: Vec<i64> = held.iter().filter(|(o, _)| *o == b).map(|(_, e)| *e).collect();

    let killed_at = Instant::now();
    c.instances[a].take().expect("instance a").run.kill();
    let held = c.wait_for_counts(&[0, 4], Duration::from_millis(SESSION_MS) + TAKEOVER_MARGIN).await;
    let takeover = killed_at.elapsed();
    // The first record of each lease taken over: when streaming really resumed.
    let new_epochs: Vec<i64> = held.iter().map(|(_, e)| *e).filter(|e| !b_before.contains(e)).collect();
    assert_eq!(new_epochs.len(), 2, "two leases taken over");
    for epoch in &new_epochs {
        kafka::wait_for_header(&c.w.topic, 3, "outbox-owner-epoch", &epoch.to_string(), ARRIVAL).await;
    }
    let resumed = killed_at.elapsed();
    eprintln!(
        "failover after SIGKILL: leases taken over in {takeover:?}, records of the new owner in Kafka after {resumed:?}"
    );

    let duplicates = c.finish(writer).await;
    eprintln!("failover after SIGKILL: {duplicates} duplicate records");
    assert!(c.instances[b].take().expect("instance b").run.stop(), "survivor exits 0 on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_paused_past_its_session_never_publishes_after_the_new_owner() {
    let mut c = Cluster::new("zs", 1, 1, false).await;
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    let a = c.start();
    let held = c.wait_for_counts(&[1], SETTLE).await;
    let old_epoch = held[0].1;
    kafka::wait_for_header(&c.w.topic, 3, "outbox-owner-epoch", &old_epoch.to_string(), ARRIVAL).await;
    let b = c.start();
    c.wait_for_counts(&[1, 0], SETTLE).await;

    c.instance(a).run.freeze();
    let held = c.wait_for_counts(&[0, 1], Duration::from_millis(SESSION_MS) + TAKEOVER_MARGIN).await;
    let new_epoch = held[0].1;
    assert!(new_epoch > old_epoch, "a new lease has a larger epoch");
    // The new owner took the slot from the frozen one's backend and publishes.
    kafka::wait_for_header(&c.w.topic, 3, "outbox-owner-epoch", &new_epoch.to_string(), ARRIVAL).await;

    c.instance(a).run.resume();
    c.instance(a).run.wait_for_log("ZooKeeper session lost", SETTLE).await;
    // It joins again and owns nothing: the stream stays with the newer owner.
    c.wait_for_counts(&[0, 1], SETTLE).await;
    let log = c.instance(b).run.log_text();
    assert!(log.contains("terminating its backend"), "the new owner took the slot from the paused one:\n{log}");

    let duplicates = c.finish(writer).await;
    eprintln!("pause past the session: {duplicates} duplicate records");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_continues_across_a_zookeeper_restart() {
    let mut c = Cluster::new("zr", 1, 2, true).await;
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    let a = c.start();
    c.wait_for_counts(&[2], SETTLE).await;
    services(&["down", "zookeeper"]);
    services(&["up", "zookeeper"]);
    // The test's own session may have expired with the restart.
    c.zk = outbox_zookeeper::connect(&outbox_zookeeper::SessionSettings::new(env("OUTBOX_ZK_CONNECT")))
        .await
        .expect("ZooKeeper session after the restart");
    c.wait_for_counts(&[2], SETTLE).await;
    // Rows written during and after the restart must arrive too.
    c.finish(writer).await;
    assert!(c.instances[a].take().expect("instance").run.stop(), "exits 0 on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_reset_or_cut_zookeeper_link_never_makes_two_owners() {
    let mut c = Cluster::new("zl", 1, 2, false).await;
    let zk: SocketAddr = env("OUTBOX_ZK_CONNECT").parse().expect("OUTBOX_ZK_CONNECT is host:port");
    let proxy = Proxy::start(zk).await;
    let proxied = config_with(&c.w.config, &zk.to_string(), &proxy.addr.to_string(), "through-proxy.toml");
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    let a = c.start_with(&proxied);
    c.wait_for_counts(&[2], SETTLE).await;
    let _b = c.start();
    let before = c.wait_for_counts(&[1, 1], SETTLE).await;
    let c = Arc::new(tokio::sync::RwLock::new(c));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = overlap_sampler(c.clone(), stop.clone());

    // Delay: a silence shorter than the session keeps the lease. The link stays frozen until
    // the proxy held a message from one end (a ping comes at least every third of a session).
    proxy.freeze();
    wait_until("a message held by the frozen link", Duration::from_millis(SESSION_MS / 2), || async {
        (proxy.held_bytes() > 0).then_some(())
    })
    .await;
    proxy.thaw();
    // Reset: the connection drops; the client reconnects within the same session.
    proxy.reset();
    let after = c.read().await.wait_for_counts(&[1, 1], SETTLE).await;
    assert_eq!(before, after, "a short delay and a reset keep every lease where it was");

    // Cut: silence past the session timeout; the other instance takes over.
    proxy.freeze();
    c.read().await.wait_for_counts(&[0, 2], Duration::from_millis(SESSION_MS) + TAKEOVER_MARGIN).await;
    proxy.thaw();
    c.read().await.instance(a).run.wait_for_log("ZooKeeper session lost", SETTLE).await;
    c.read().await.wait_for_counts(&[1, 1], SETTLE).await;

    stop.store(true, Ordering::SeqCst);
    let overlaps = sampler.await.expect("sampler");
    assert!(overlaps.is_empty(), "two owners at once: {overlaps:?}");
    let c = Arc::into_inner(c).expect("sampler ended").into_inner();
    let duplicates = c.finish(writer).await;
    eprintln!("cut ZooKeeper link: {duplicates} duplicate records");
}

/// MariaDB has no single-reader slot: the epoch in the checkpoint row is the fence. An owner
/// paused past its session resumes to find a newer epoch stored and stops; no record of its
/// epoch follows the new owner's, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_an_owner_paused_past_its_session_is_fenced_by_the_stored_epoch() {
    use mysql_async::prelude::Queryable;
    let cluster = unique("zm");
    let w =
        World::mysql("zm").kafka_partitions(3).config(&coordination(&cluster, &env("OUTBOX_ZK_CONNECT"))).build().await;
    let table = w.table(0, 0);
    let zk = outbox_zookeeper::connect(&outbox_zookeeper::SessionSettings::new(env("OUTBOX_ZK_CONNECT")))
        .await
        .expect("ZooKeeper session for the test");
    let paths = ClusterPaths::new("/outbox-streamer", &cluster);
    let key = format!("test.{table}");
    let holder = || async { lease::holder(&zk, &paths, &key).await.expect("reading the lease") };
    let start = |n: usize| {
        Running::start_with_env(
            &w.config,
            &w.dir.join(format!("instance-{n}.log")),
            &[("OUTBOX_METRICS_LISTEN", free_port().to_string())],
        )
    };

    // The writer: payloads <table>:1, 2, 3, … in their own transactions.
    let (stop, mut stopped) = watch::channel(false);
    let (admin_url, insert_table, topic) = (w.db.admin_url.clone(), table.clone(), w.topic.clone());
    let writer = tokio::spawn(async move {
        let mut conn = mysql_async::Conn::new(mysql_async::Opts::from_url(&admin_url).unwrap()).await.unwrap();
        let insert = format!("INSERT INTO {insert_table} (topic, msg_key, payload) VALUES (?, ?, ?)");
        let mut n = 0u64;
        let mut pace = tokio::time::interval(Duration::from_millis(4));
        while !*stopped.borrow() {
            tokio::select! {
                _ = pace.tick() => {}
                _ = stopped.changed() => break,
            }
            n += 1;
            conn.exec_drop(&insert, (&topic, insert_table.as_bytes(), format!("{insert_table}:{n}").into_bytes()))
                .await
                .expect("insert");
        }
        BTreeMap::from([(insert_table, n)])
    });

    let a = start(0);
    let first = wait_until("the first instance to hold the lease", SETTLE, || async {
        holder().await.filter(|h| h.instance.ends_with(&format!("-{}", a.pid())))
    })
    .await;
    kafka::wait_for_header(&w.topic, 3, "outbox-owner-epoch", &first.epoch.to_string(), ARRIVAL).await;
    let b = start(1);
    a.freeze();
    let second = wait_until(
        "the second instance to take the lease",
        Duration::from_millis(SESSION_MS) + TAKEOVER_MARGIN,
        || async { holder().await.filter(|h| h.instance.ends_with(&format!("-{}", b.pid()))) },
    )
    .await;
    assert!(second.epoch > first.epoch, "a new lease has a larger epoch");
    kafka::wait_for_header(&w.topic, 3, "outbox-owner-epoch", &second.epoch.to_string(), ARRIVAL).await;
    let mut admin = w.admin().await;
    let stored: Option<i64> = admin
        .exec_first(format!("SELECT owner_epoch FROM {}_checkpoint WHERE stream = ?", w.prefix), (&table,))
        .await
        .unwrap();
    assert_eq!(stored, Some(second.epoch), "the new owner claimed the checkpoint with its epoch");

    a.resume();
    a.wait_for_log("ZooKeeper session lost", SETTLE).await;
    let _ = stop.send(true);
    let sent = writer.await.expect("writer");
    let records = read_all(&w.topic, &sent).await;
    let duplicates = check(&records, &sent);
    eprintln!("MariaDB pause past the session: {duplicates} duplicate records");
    w.wait_drained(&w.table(0, 0)).await;
    assert!(b.stop(), "the new owner exits 0 on SIGTERM");
}

/// With `yield_interval_s`, every lease is given up after that long and taken by another
/// instance: ownership moves again and again, and nothing is lost or reordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yielding_moves_leases_over_time_without_loss() {
    let mut c = Cluster::new("zy", 1, 2, false).await;
    let config = config_with(&c.w.config, "[coordination]", "[coordination]\nyield_interval_s = 1", "yielding.toml");
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    c.start_with(&config);
    c.start_with(&config);
    let epochs = std::sync::Mutex::new(HashSet::<i64>::new());
    wait_until("each lease to be granted three times", SETTLE, || async {
        let seen = c.owners().await.into_iter().flatten().map(|(_, e)| e);
        let mut epochs = epochs.lock().unwrap();
        epochs.extend(seen);
        (epochs.len() >= 3 * c.keys.len()).then_some(())
    })
    .await;
    let epochs = epochs.into_inner().unwrap();
    let duplicates = c.finish(writer).await;
    eprintln!("yielding: {} grants, {duplicates} duplicate records", epochs.len());
    // Each yield hands the lease to a member already queued for it (before, the yielded
    // lease sat free for seconds while every other member was at its quota).
    let logs: String = (0..2).map(|i| c.instance(i).run.log_text()).collect();
    assert!(logs.contains("yielding: handed over to the member waiting for the lease"), "{logs}");
    assert!(logs.contains("took over a lease yielded to this instance"), "{logs}");
}

/// An instance that does not own a stream never moves that stream's slot, even when its own
/// configuration says the stream polls: only the owner's polling session moves it. Before, the
/// lag poller of every instance advanced every slot its own config had in polling mode
/// whenever the slot was idle, and rows in between were never streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_moves_a_polling_streams_slot() {
    let mut c = Cluster::new("zs", 1, 1, false).await;
    // Someone else holds the lease (a member of another deployment, or one about to stream).
    let other = lease::acquire(&c.zk, &c.paths, &c.keys[0], "another-instance", Duration::from_secs(5))
        .await
        .expect("taking the lease by hand")
        .expect("the lease was free");
    let polling = polling_config(&c.w.config);
    let a = c.start_with(&polling);
    let metrics = c.instance(a).metrics;
    let table = c.tables[0].clone();
    let insert = format!(
        "INSERT INTO {table} (topic, payload) SELECT $1, convert_to('p' || i, 'UTF8') FROM generate_series(1, 200) i"
    );
    c.w.db.admin.execute(&insert, &[&c.w.topic]).await.unwrap();
    // The instance's lag poller runs every few seconds; once it reports the slot behind by
    // the rows just written, it has looked at the slot after they were written — and, not
    // owning the stream, left it where it was.
    let slot = table.clone();
    wait_until("the non-owner to report the slot behind the new rows", ARRIVAL, || async {
        let text = scrape(metrics).await?;
        let line = text
            .lines()
            .find(|l| l.starts_with("outbox_replication_lag_bytes") && l.contains(&format!("slot=\"{slot}\"")))?;
        let lag: f64 = line.rsplit(' ').next()?.parse().ok()?;
        (lag > 10_000.0).then_some(())
    })
    .await;
    let owners = c.owners().await;
    assert_eq!(owners, vec![None], "the lease stays with the other holder");
    other.release().await.unwrap();
    // Now the instance owns the stream and polls it: every row arrives.
    let records = kafka::read_distinct(&c.w.topic, 3, 200, ARRIVAL).await;
    assert_eq!(records.len(), 200);
}

/// An owner's lease node deleted by hand (an operator, a ZooKeeper restore) while its session
/// lives: the owner stops at once, the lease is granted again, and no record of the old epoch
/// lands after one of the new — in PostgreSQL polling too, which has no slot to fence it.
/// Before, the old owner never noticed and both published for as long as the test ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_lease_node_stops_its_owner_before_the_lease_is_granted_again() {
    let mut c = Cluster::new("zd", 1, 1, false).await;
    let polling = polling_config(&c.w.config);
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    c.start_with(&polling);
    c.start_with(&polling);
    let held = c.wait_for_balance(SETTLE).await;
    let (owner, epoch) = held[0];
    kafka::wait_for_header(&c.w.topic, 3, "outbox-owner-epoch", &epoch.to_string(), ARRIVAL).await;
    let dir = c.paths.lease(&c.keys[0]);
    let children = c.zk.list_children(&dir).await.expect("lease directory");
    let node = children.iter().find(|n| n.contains("lock-")).expect("the lock node");
    c.zk.delete(&format!("{dir}/{node}"), None).await.expect("deleting the lock node by hand");
    let (_, new_epoch) = wait_until("the lease to be granted again", SETTLE, || async {
        c.owners().await[0].filter(|(_, e)| *e != epoch)
    })
    .await;
    kafka::wait_for_header(&c.w.topic, 3, "outbox-owner-epoch", &new_epoch.to_string(), ARRIVAL).await;
    let duplicates = c.finish(writer).await;
    eprintln!("lease node deleted: {duplicates} duplicates");
    let log = c.instance(owner).run.log_text();
    assert!(log.contains("the lease node was deleted while this instance held it"), "{log}");
}

/// A member node deleted by hand while its session lives: the instance registers again and
/// keeps (and keeps serving) its leases. Before, rebalancing stopped for good: no task was
/// ever restarted, and a WARN repeated every 500 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_member_node_registers_again() {
    let mut c = Cluster::new("zm", 2, 1, false).await;
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    let n = c.start();
    c.wait_for_counts(&[2], SETTLE).await;
    let members = c.paths.members();
    let nodes = c.zk.list_children(&members).await.expect("members");
    assert_eq!(nodes.len(), 1);
    c.zk.delete(&format!("{members}/{}", nodes[0]), None).await.expect("deleting the member node by hand");
    wait_until("the instance to register again", SETTLE, || async {
        let now = c.zk.list_children(&members).await.ok()?;
        (now.len() == 1 && now[0] != nodes[0]).then_some(())
    })
    .await;
    c.instance(n).run.wait_for_log("registered again as a cluster member", SETTLE).await;
    c.wait_for_counts(&[2], SETTLE).await;
    c.finish(writer).await;
}

/// Two instances configured with the same name: the younger refuses to join, loudly, and owns
/// nothing; the older owns everything. Before, both joined, and a frozen one was mistaken for
/// "me" when its slot had to be taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_instance_name_is_refused() {
    let mut c = Cluster::new("zn", 2, 1, false).await;
    let named = config_with(
        &c.w.config,
        "session_timeout_ms = 3000",
        "session_timeout_ms = 3000\ninstance = \"same-name\"",
        "named.toml",
    );
    let first = c.start_with(&named);
    c.instance(first).run.wait_for_log("registered as a cluster member", SETTLE).await;
    let second = c.start_with(&named);
    let log = c.instance(second).run.wait_for_log("has this instance name", SETTLE).await;
    assert!(log.contains("ERROR"), "{log}");
    let held = wait_until("the first instance to hold both leases", SETTLE, || async {
        let mut holders = Vec::new();
        for key in &c.keys {
            holders.push(lease::holder(&c.zk, &c.paths, key).await.ok()??);
        }
        Some(holders)
    })
    .await;
    assert!(held.iter().all(|h| h.instance == "same-name"));
    let members = c.zk.list_children(&c.paths.members()).await.expect("members");
    assert_eq!(members.len(), 1, "only one member with the name: {members:?}");
}

/// A connect string whose chroot does not exist: registration fails with a message naming the
/// path, and is retried with growing backoff. Before, about 150 sessions a second were opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_chroot_is_named_and_retried_with_backoff() {
    let mut c = Cluster::new("zc", 1, 1, false).await;
    let connect = env("OUTBOX_ZK_CONNECT");
    let missing = config_with(&c.w.config, &connect, &format!("{connect}/no-such-chroot"), "chroot.toml");
    let n = c.start_with(&missing);
    let run = &c.instance(n).run;
    let log = wait_until("three failed registrations", SETTLE, || async {
        let log = run.log_text();
        (log.matches("cannot register as a cluster member").count() >= 3).then_some(log)
    })
    .await;
    let failures: Vec<&str> = log.lines().filter(|l| l.contains("cannot register as a cluster member")).collect();
    assert!(failures[0].contains("/members") && failures[0].contains("chroot"), "{}", failures[0]);
    let at = |line: &str| -> f64 {
        let t = line.split_whitespace().next().unwrap_or_default();
        let time = t.split('T').nth(1).unwrap_or_default().trim_end_matches('Z');
        let mut parts = time.split(':').map(|p| p.parse::<f64>().unwrap_or(0.0));
        parts.next().unwrap_or(0.0) * 3600.0 + parts.next().unwrap_or(0.0) * 60.0 + parts.next().unwrap_or(0.0)
    };
    assert!(at(failures[2]) - at(failures[0]) >= 2.5, "backoff between attempts:\n{}", failures.join("\n"));
}

/// The checkpoint holds an owner epoch from another ZooKeeper ensemble (ZooKeeper replaced,
/// or restored from an older backup: its zxids are lower): the owner holding the lease now
/// halts once, saying what happened and how to reset it, instead of being fenced again every
/// half second for ever; the documented reset brings the stream back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_an_epoch_from_another_ensemble_halts_with_the_reset() {
    use mysql_async::prelude::Queryable;
    let cluster = unique("ze");
    let w = World::mysql("ze").config(&coordination(&cluster, &env("OUTBOX_ZK_CONNECT"))).build().await;
    let table = w.table(0, 0);
    let mut admin = w.admin().await;
    let checkpoint = format!("{}_checkpoint", w.prefix);
    admin
        .exec_drop(format!("UPDATE {checkpoint} SET owner_epoch = ? WHERE stream = ?"), (1i64 << 50, &table))
        .await
        .unwrap();
    let first = Running::start(&w.config, &w.dir.join("first.log"));
    let log = first.wait_for_halt(SETTLE).await;
    assert!(log.contains("another ZooKeeper ensemble") && log.contains("SET owner_epoch = 0"), "{log}");
    assert_eq!(log.matches("ERROR").count(), 1, "one ERROR, not a retry loop:\n{log}");
    assert!(first.stop());
    admin.exec_drop(format!("UPDATE {checkpoint} SET owner_epoch = 0 WHERE stream = ?"), (&table,)).await.unwrap();
    let second = Running::start(&w.config, &w.dir.join("second.log"));
    admin
        .exec_drop(format!("INSERT INTO {table} (topic, payload) VALUES (?, 'after the reset')"), (&w.topic,))
        .await
        .unwrap();
    let records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(records[0].payload_str(), "after the reset");
    assert!(second.stop());
    admin.disconnect().await.unwrap();
}

/// Members whose configurations differ — a rolling change of `shards`, half the instances
/// restarted — balance over the union of what they serve: no shard-partition that some member
/// serves is left without an owner. Before, each computed its quota from its own list, and a
/// shard stayed unowned while both ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_different_shards_leave_no_shard_partition_unowned() {
    let mut c = Cluster::new("zu", 3, 1, false).await;
    let two = config_with(&c.w.config, "shards = 3", "shards = 2", "two-shards.toml");
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    c.start_with(&two);
    c.start();
    let held = wait_until("every shard-partition to have an owner", SETTLE, || async {
        let owners = c.owners().await;
        owners.iter().all(Option::is_some).then_some(owners)
    })
    .await;
    assert_eq!(held[2].map(|(o, _)| o), Some(1), "only the instance with 3 shards serves shard 2");
    c.finish(writer).await;
}

/// Two deployments with different sources under one cluster name: the younger refuses to join,
/// loudly, instead of splitting the work so that some shard-partitions stay unowned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_deployment_under_the_same_cluster_name_is_refused() {
    let mut c = Cluster::new("zx", 1, 1, false).await;
    let first = c.start();
    c.wait_for_counts(&[1], SETTLE).await;
    let other = config_with(&c.w.config, "name = \"test\"", "name = \"billing\"", "other.toml");
    let second = c.start_with(&other);
    let log = c.instance(second).run.wait_for_log("another deployment shares this cluster", SETTLE).await;
    assert!(log.contains("ERROR") && log.contains("cluster_name"), "{log}");
    let members = c.zk.list_children(&c.paths.members()).await.expect("members");
    assert_eq!(members.len(), 1, "the other deployment's instance is not a member");
    let _ = first;
}

/// The randomised workload of ownership, seeded like `tests/workload.rs`: instances join with
/// different configurations (fewer shards, polling mode), leave, are killed, and lose their
/// lease or member node to an operator's hand, and ZooKeeper restarts once, while a writer
/// commits. After every step each
/// shard-partition gets a live owner again; at the end every row arrived, each table's first
/// deliveries kept commit order, and no record of an older owner follows a newer one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomised_ownership_workload() {
    let (seed, ops) = crate::workload::settings();
    let steps = (ops / 15).max(6);
    eprintln!("ownership workload: OUTBOX_WORKLOAD_SEED={seed} OUTBOX_WORKLOAD_OPS={ops} ({steps} steps)");
    let mut rng = crate::workload::Rng(seed);
    // Exclusive: one step restarts ZooKeeper under every other test's feet.
    let mut c = Cluster::new("zw", 3, 1, true).await;
    let two = config_with(&c.w.config, "shards = 3", "shards = 2", "two-shards.toml");
    let polling = polling_config(&c.w.config);
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    // Per instance: whether it serves every shard (the two-shard one does not serve shard 2).
    let mut serves_all = vec![true];
    // ZooKeeper restarts once per run, at a step the seed chooses.
    let restart_at = rng.below(steps as u64) as usize;
    c.start();
    for step in 0..steps {
        let running: Vec<usize> = (0..c.instances.len()).filter(|i| c.instances[*i].is_some()).collect();
        let pick = running[rng.below(running.len() as u64) as usize];
        let what = match if step == restart_at { 7 } else { rng.below(7) } {
            0 | 1 if running.len() < 4 => {
                let (config, all) = match rng.below(3) {
                    0 => (c.w.config.clone(), true),
                    1 => (two.clone(), false),
                    _ => (polling.clone(), true),
                };
                let n = c.start_with(&config);
                serves_all.push(all);
                format!("instance {n} joins with {}", config.display())
            }
            2 if running.len() > 1 => {
                let gone = c.instances[pick].take().expect("running");
                // Before `run` starts, the process only parses its configuration: a signal then
                // ends it without a clean exit code.
                gone.run.wait_for_log("outbox-streamer running", SETTLE).await;
                assert!(gone.run.stop(), "instance {pick} exits 0 on SIGTERM");
                format!("instance {pick} leaves")
            }
            3 if running.len() > 1 => {
                c.instances[pick].take().expect("running").run.kill();
                format!("instance {pick} is killed")
            }
            4 => {
                let dir = c.paths.lease(&c.keys[rng.below(c.keys.len() as u64) as usize]);
                let children = c.zk.list_children(&dir).await.unwrap_or_default();
                match children.iter().find(|n| n.contains("lock-")) {
                    Some(node) => {
                        let _ = c.zk.delete(&format!("{dir}/{node}"), None).await;
                        format!("lease node {dir}/{node} deleted")
                    }
                    None => "no lease node to delete".to_string(),
                }
            }
            5 => {
                let members = c.paths.members();
                let nodes = c.zk.list_children(&members).await.unwrap_or_default();
                match nodes.get(rng.below(nodes.len().max(1) as u64) as usize) {
                    Some(node) => {
                        let _ = c.zk.delete(&format!("{members}/{node}"), None).await;
                        format!("member node {node} deleted")
                    }
                    None => "no member node to delete".to_string(),
                }
            }
            7 => {
                services(&["down", "zookeeper"]);
                services(&["up", "zookeeper"]);
                // The test's own session may have expired with the restart.
                c.zk = outbox_zookeeper::connect(&outbox_zookeeper::SessionSettings::new(env("OUTBOX_ZK_CONNECT")))
                    .await
                    .expect("ZooKeeper session after the restart");
                "ZooKeeper restarts".to_string()
            }
            _ => "writes only".to_string(),
        };
        // Some running member must serve every shard, or shard 2 rightly has no owner.
        if !(0..c.instances.len()).any(|i| c.instances[i].is_some() && serves_all[i]) {
            c.start();
            serves_all.push(true);
        }
        eprintln!("ownership workload step {step}: {what}");
        wait_until(&format!("every shard-partition owned after step {step} ({what})"), SETTLE, || async {
            c.owners().await.iter().all(Option::is_some).then_some(())
        })
        .await;
    }
    c.finish(writer).await;
    for instance in c.instances.iter_mut().filter_map(Option::take) {
        instance.run.wait_for_log("outbox-streamer running", SETTLE).await;
        assert!(instance.run.stop(), "every remaining instance exits 0 on SIGTERM");
    }
}
