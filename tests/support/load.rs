//! Load for the database fault tests (crash, restart, failover): a writer that inserts outbox
//! rows one transaction at a time, reconnecting through every outage, and the check of what
//! reached Kafka against what the database holds.
//!
//! Every transaction also inserts its payload into `<table>_ledger`, which nobody deletes
//! from: after the fault the ledger says which transactions committed, also those whose commit
//! answer the fault cut off (their outcome is otherwise unknown).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::{Interval, MissedTickBehavior};

use super::kafka::{self, Record};
use super::metrics::{sample, try_get, try_get_any};
use super::streamer::Running;
use super::wait_until;
use super::world::ARRIVAL;

/// Where the writer writes, as the admin user.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// `synchronous`: each commit waits for the synchronous standby (`synchronous_commit = on`).
    Postgres {
        url: String,
        synchronous: bool,
    },
    MariaDb {
        url: String,
    },
}

/// What the writer knows about its rows.
#[derive(Debug, Default)]
pub(crate) struct Written {
    /// Payloads whose commit succeeded.
    pub committed: Vec<String>,
    /// Payloads whose transaction failed mid-way: committed or not, only the ledger can tell.
    pub unknown: Vec<String>,
}

/// A running writer; [`Writer::finish`] stops it.
pub(crate) struct Writer {
    stop: Arc<AtomicBool>,
    task: JoinHandle<Written>,
}

/// One row per transaction, about this many a second: load, not a flood.
const PACE: Duration = Duration::from_millis(3);
/// How often a writer that lost its server tries to connect again.
const RECONNECT_EVERY: Duration = Duration::from_millis(50);

impl Writer {
    /// Creates `<table>_ledger` and starts inserting rows into `table` for `topic`: keys
    /// `k0`..`k4` in turn, payloads `k<i>:<n>` with `n` counting up.
    pub(crate) async fn start(target: Target, table: &str, topic: &str) -> Self {
        let ledger = format!("{table}_ledger");
        match &target {
            Target::Postgres { url, .. } => {
                let c = super::pg::connect(url).await;
                c.batch_execute(&format!("CREATE TABLE {ledger} (payload text PRIMARY KEY)")).await.unwrap();
            }
            Target::MariaDb { url } => {
                use mysql_async::prelude::Queryable;
                let mut c = mysql_async::Conn::new(mysql_async::Opts::from_url(url).unwrap()).await.unwrap();
                c.query_drop(format!("CREATE TABLE {ledger} (payload varchar(64) PRIMARY KEY) ENGINE=InnoDB"))
                    .await
                    .unwrap();
                c.disconnect().await.unwrap();
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(write(target, table.to_string(), ledger, topic.to_string(), stop.clone()));
        Self { stop, task }
    }

    /// Stops the writer and says what it wrote.
    pub(crate) async fn finish(self) -> Written {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the writer")
    }
}

/// A ticking interval that waits a full period after a late tick (no bursts).
fn pace(period: Duration) -> Interval {
    let mut i = tokio::time::interval(period);
    i.set_missed_tick_behavior(MissedTickBehavior::Delay);
    i
}

/// An open session of the writer.
enum Session {
    Postgres(tokio_postgres::Client),
    MariaDb(mysql_async::Conn),
}

async fn open(target: &Target) -> Option<Session> {
    match target {
        Target::Postgres { url, synchronous } => {
            let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.ok()?;
            tokio::spawn(conn);
            if *synchronous {
                c.batch_execute("SET synchronous_commit = on").await.ok()?;
            }
            Some(Session::Postgres(c))
        }
        Target::MariaDb { url } => {
            Some(Session::MariaDb(mysql_async::Conn::new(mysql_async::Opts::from_url(url).ok()?).await.ok()?))
        }
    }
}

async fn insert(session: &mut Session, table: &str, ledger: &str, topic: &str, key: &str, payload: &str) -> bool {
    match session {
        Session::Postgres(c) => {
            // One statement: the row and its ledger entry commit together.
            let sql = format!(
                "WITH l AS (INSERT INTO {ledger} (payload) VALUES ($3)) \
                 INSERT INTO {table} (topic, msg_key, payload) VALUES ($1, convert_to($2, 'UTF8'), convert_to($3, 'UTF8'))"
            );
            c.execute(&sql, &[&topic, &key, &payload]).await.is_ok()
        }
        Session::MariaDb(c) => {
            use mysql_async::prelude::Queryable;
            let Ok(mut tx) = c.start_transaction(mysql_async::TxOpts::default()).await else { return false };
            let row = format!("INSERT INTO {table} (topic, msg_key, payload) VALUES (?, ?, ?)");
            if tx.exec_drop(row, (topic, key.as_bytes(), payload.as_bytes())).await.is_err() {
                return false;
            }
            if tx.exec_drop(format!("INSERT INTO {ledger} (payload) VALUES (?)"), (payload,)).await.is_err() {
                return false;
            }
            tx.commit().await.is_ok()
        }
    }
}

async fn write(target: Target, table: String, ledger: String, topic: String, stop: Arc<AtomicBool>) -> Written {
    let mut written = Written::default();
    let mut session: Option<Session> = None;
    let (mut pace, mut retry) = (pace(PACE), pace(RECONNECT_EVERY));
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let Some(s) = &mut session else {
            retry.tick().await;
            session = open(&target).await;
            continue;
        };
        pace.tick().await;
        let key = format!("k{}", n % 5);
        let payload = format!("{key}:{n}");
        n += 1;
        if insert(s, &table, &ledger, &topic, &key, &payload).await {
            written.committed.push(payload);
        } else {
            written.unknown.push(payload);
            session = None;
        }
    }
    written
}

/// The ledger of `table` on the server `target` reaches now (waiting until it answers).
pub(crate) async fn ledger(target: &Target, table: &str) -> HashSet<String> {
    let sql = format!("SELECT payload FROM {table}_ledger");
    wait_until("the ledger to be readable", ARRIVAL, || async {
        match open(target).await? {
            Session::Postgres(c) => {
                let rows = c.query(&sql, &[]).await.ok()?;
                Some(rows.iter().map(|r| r.get::<_, String>(0)).collect())
            }
            Session::MariaDb(mut c) => {
                use mysql_async::prelude::Queryable;
                let rows: Vec<String> = c.query(&sql).await.ok()?;
                let _ = c.disconnect().await;
                Some(rows.into_iter().collect())
            }
        }
    })
    .await
}

/// Rows left in `table` on the server `target` reaches now, if it answers.
pub(crate) async fn rows_left(target: &Target, table: &str) -> Option<i64> {
    let sql = format!("SELECT count(*) FROM {table}");
    match open(target).await? {
        Session::Postgres(c) => Some(c.query_one(&sql, &[]).await.ok()?.get::<_, i64>(0)),
        Session::MariaDb(mut c) => {
            use mysql_async::prelude::Queryable;
            let n: Option<i64> = c.query_first(&sql).await.ok()?;
            let _ = c.disconnect().await;
            n
        }
    }
}

/// What a fault test's run came to (printed; docs/operations.md keeps the numbers).
#[derive(Debug)]
pub(crate) struct Outcome {
    /// Transactions the writer saw commit.
    pub committed: usize,
    /// Transactions whose outcome the fault cut off, and of those the ledger holds.
    pub unknown: usize,
    pub unknown_committed: usize,
    /// Acknowledged commits the database no longer holds (not ours to lose: asynchronous
    /// replication, or a durability setting off).
    pub lost_by_database: usize,
    pub records: usize,
    pub duplicates: usize,
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} rows committed, {} of unknown outcome ({} of them committed), {} acknowledged commits gone from the database, {} records ({} duplicates)",
            self.committed, self.unknown, self.unknown_committed, self.lost_by_database, self.records, self.duplicates
        )
    }
}

/// Reads `topic` until every payload of `ledger` arrived, and checks from outside: nothing
/// the ledger holds is missing, nothing arrived that was never inserted, and the first
/// delivery of each key's rows keeps their commit order.
pub(crate) async fn check(written: &Written, ledger: &HashSet<String>, topic: &str, partitions: i32) -> Outcome {
    let records: Vec<Record> = kafka::read_until_payloads(topic, partitions, ledger, ARRIVAL).await;
    let tried: HashSet<&String> = written.committed.iter().chain(&written.unknown).collect();
    let mut seen = HashSet::new();
    let mut last_per_key = HashMap::new();
    for r in &records {
        let payload = r.payload_str();
        assert!(tried.contains(&payload), "{payload} reached Kafka but was never inserted");
        if !seen.insert(payload.clone()) {
            continue;
        }
        let (key, n) = payload.split_once(':').expect("key:n");
        let n: u64 = n.parse().expect("n");
        if let Some(last) = last_per_key.insert(key.to_string(), n) {
            assert!(n > last, "{key}: {n} arrived after {last} (first deliveries out of commit order)");
        }
    }
    let mut missing: Vec<&String> = ledger.iter().filter(|p| !seen.contains(*p)).collect();
    missing.sort();
    assert!(
        missing.is_empty(),
        "{} committed rows missing from Kafka (first: {:?})",
        missing.len(),
        &missing[..missing.len().min(20)]
    );
    Outcome {
        committed: written.committed.len(),
        unknown: written.unknown.len(),
        unknown_committed: written.unknown.iter().filter(|p| ledger.contains(*p)).count(),
        lost_by_database: written.committed.iter().filter(|p| !ledger.contains(*p)).count(),
        records: records.len(),
        duplicates: records.len() - seen.len(),
    }
}

/// Records the streamer has published so far (0 before its endpoint answers).
pub(crate) async fn published(streamer: &Running) -> f64 {
    let text = try_get(streamer.metrics_addr(), "/metrics").await.unwrap_or_default();
    sample(&text, "outbox_published_records_total", &[]).unwrap_or(0.0)
}

/// Waits until `streamer` has published `more` records than now.
pub(crate) async fn wait_published_more(streamer: &Running, more: f64) {
    let at = published(streamer).await + more;
    streamer.wait_for_metric("outbox_published_records_total", &[], at, ARRIVAL).await;
}

/// Waits until `/readyz` says the database cannot be reached (503, and why).
pub(crate) async fn wait_unreachable(streamer: &Running) {
    wait_until("/readyz to name the unreachable database", ARRIVAL, || async {
        let (status, body) = try_get_any(streamer.metrics_addr(), "/readyz").await?;
        (status == 503 && body.contains("retrying (database unreachable: ")).then_some(())
    })
    .await;
}

/// Stops `writer` and checks the run against the ledger `target` reaches now ([`check`]):
/// no acknowledged commit gone from the database, and the table drains.
pub(crate) async fn finish_and_check(
    writer: Writer,
    target: &Target,
    table: &str,
    topic: &str,
    partitions: i32,
) -> Outcome {
    let outcome = finish_and_check_any_loss(writer, target, table, topic, partitions).await;
    assert_eq!(outcome.lost_by_database, 0, "acknowledged commits gone from the database: {outcome}");
    outcome
}

/// [`finish_and_check`] for a database that may itself lose acknowledged commits (an
/// asynchronous standby promoted): what it still holds must all reach Kafka.
pub(crate) async fn finish_and_check_any_loss(
    writer: Writer,
    target: &Target,
    table: &str,
    topic: &str,
    partitions: i32,
) -> Outcome {
    let written = writer.finish().await;
    let ledger = ledger(target, table).await;
    let outcome = check(&written, &ledger, topic, partitions).await;
    wait_until("the table to drain", ARRIVAL, || async { (rows_left(target, table).await == Some(0)).then_some(()) })
        .await;
    outcome
}
