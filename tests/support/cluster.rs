//! A cluster of real `outbox-streamer` instances under ZooKeeper ownership over one
//! PostgreSQL world, for the coordination tests (`tests/coordination_*.rs`): starting and
//! stopping instances, reading who holds each lease, waiting for a balance, and a writer whose
//! records are checked at the end.
//!
//! The [`Writer`] inserts, per table, payloads 1, 2, 3, … keyed by the table (one writer per
//! table, so id order is commit order); [`check`] makes sure that every row arrived, that per
//! table the first deliveries keep that order, and that per table the `outbox-owner-epoch`
//! header never goes back in Kafka order: once a newer owner's record is in Kafka, no older
//! owner's record follows.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_zookeeper::lease::{self, Holder};
use outbox_zookeeper::paths::ClusterPaths;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::types::ToSql;

use super::kafka::{self, Record};
use super::metrics::free_addr;
use super::pg::{self, PgDb};
use super::streamer::{Running, run_cli};
use super::world::{ARRIVAL, World};
use super::{env, unique, wait_until};

/// Short, so the tests fail over quickly; the services' ZooKeeper allows 1 s to 60 s.
pub(crate) const SESSION_MS: u64 = 3000;
/// Takeover must happen within the session timeout plus this margin.
pub(crate) const TAKEOVER_MARGIN: Duration = Duration::from_secs(10);
pub(crate) const SETTLE: Duration = Duration::from_secs(60);

pub(crate) fn coordination(cluster: &str, connect: &str) -> String {
    format!(
        "\n[coordination]\nkind = \"zookeeper\"\nconnect = \"{connect}\"\ncluster_name = \"{cluster}\"\nsession_timeout_ms = {SESSION_MS}\n"
    )
}

/// A cluster of instances over one database's shard-partitions.
pub(crate) struct Cluster {
    pub w: World<PgDb>,
    pub paths: ClusterPaths,
    /// Each shard-partition's lease key, `test.<table>`, in the order of `tables`.
    pub keys: Vec<String>,
    pub tables: Vec<String>,
    /// The test's own ZooKeeper session.
    pub zk: outbox_zookeeper::zk::Client,
    /// By index; `None` once stopped or killed.
    pub instances: Vec<Option<Instance>>,
}

/// One running instance of a [`Cluster`] and where its metrics endpoint answers.
pub(crate) struct Instance {
    pub run: Running,
    pub metrics: SocketAddr,
}

impl Cluster {
    pub(crate) async fn new(name: &str, shards: u32, partitions: u32, exclusive: bool) -> Self {
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
    pub(crate) fn start_with(&mut self, config: &Path) -> usize {
        let n = self.instances.len();
        let metrics = free_addr();
        let run = Running::start_with_env(
            config,
            &self.w.dir.join(format!("instance-{n}.log")),
            &[("OUTBOX_METRICS_LISTEN", metrics.to_string())],
        );
        self.instances.push(Some(Instance { run, metrics }));
        n
    }

    pub(crate) fn start(&mut self) -> usize {
        let config = self.w.config.clone();
        self.start_with(&config)
    }

    pub(crate) fn instance(&self, n: usize) -> &Instance {
        self.instances[n].as_ref().expect("instance running")
    }

    /// The instance index holding a lease, by the pid in the default instance name.
    fn index_of(&self, holder: &Holder) -> Option<usize> {
        self.instances
            .iter()
            .position(|i| i.as_ref().is_some_and(|i| holder.instance.ends_with(&format!("-{}", i.run.pid()))))
    }

    /// Each lease's holder (instance index, epoch), or None.
    pub(crate) async fn owners(&self) -> Vec<Option<(usize, i64)>> {
        let mut out = Vec::new();
        for key in &self.keys {
            let holder = lease::holder(&self.zk, &self.paths, key).await.expect("reading a lease");
            out.push(holder.and_then(|h| Some((self.index_of(&h)?, h.epoch))));
        }
        out
    }

    /// Waits until every lease is held and instance `i` holds `want[i]` of them.
    pub(crate) async fn wait_for_counts(&self, want: &[usize], timeout: Duration) -> Vec<(usize, i64)> {
        let want = want.to_vec();
        self.wait_for(&format!("leases held as {want:?}"), timeout, move |counts| counts == want).await
    }

    /// Waits until every lease is held and the running instances hold them evenly (counts
    /// differ by at most one; which instance gets one more depends on who joined first).
    pub(crate) async fn wait_for_balance(&self, timeout: Duration) -> Vec<(usize, i64)> {
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
    pub(crate) fn status_shows(&self, held: &[(usize, i64)]) {
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
    pub(crate) async fn finish(&self, writer: Writer) -> usize {
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
pub(crate) fn overlap_sampler(
    cluster: Arc<tokio::sync::RwLock<Cluster>>,
    stop: Arc<AtomicBool>,
) -> JoinHandle<Vec<String>> {
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

/// The rounds a [`Writer`] writes before it may stop.
const MIN_ROUNDS: u32 = 20;

/// Inserts, round robin over `tables`, payloads `<table>:<n>` keyed by the table, until
/// stopped; returns how many rows each table got.
pub(crate) struct Writer {
    stop: watch::Sender<bool>,
    task: JoinHandle<BTreeMap<String, u64>>,
}

impl Writer {
    pub(crate) fn start(url: &str, tables: &[String], topic: &str) -> Self {
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

    pub(crate) async fn finish(self) -> BTreeMap<String, u64> {
        let _ = self.stop.send(true);
        self.task.await.expect("writer")
    }
}

/// What the records say: per table, every payload 1..=sent arrived, first deliveries in
/// order, and the owner epoch never goes back. Returns the number of duplicates.
pub(crate) fn check(records: &[Record], sent: &BTreeMap<String, u64>) -> usize {
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

pub(crate) async fn read_all(topic: &str, sent: &BTreeMap<String, u64>) -> Vec<Record> {
    kafka::read_distinct(topic, 3, sent.values().sum::<u64>() as usize, ARRIVAL).await
}

/// The metrics endpoint's whole answer (status line and headers included).
pub(crate) async fn scrape(addr: SocketAddr) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await.ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await.ok()?;
    Some(text)
}

/// A copy of `config` named `name` beside it, with `from` replaced by `to`.
pub(crate) fn config_with(config: &Path, from: &str, to: &str, name: &str) -> PathBuf {
    let text = std::fs::read_to_string(config).expect("config").replace(from, to);
    let path = config.with_file_name(name);
    std::fs::write(&path, text).expect("write config");
    path
}

/// The world's configuration in polling mode.
pub(crate) fn polling_config(config: &Path) -> PathBuf {
    config_with(config, "status_interval_ms = 100", "status_interval_ms = 100\nmode = \"polling\"", "polling.toml")
}
