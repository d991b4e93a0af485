//! Idle polling tables are watched together (docs/polling.md, "Idle tables"): one statement per
//! interval asks every quiet table of a source whether it holds rows, instead of one read per
//! table. Real PostgreSQL and MariaDB, real Kafka, the real binary.

use std::net::SocketAddr;
use std::time::Duration;

use crate::polling::POLLING;
use crate::support::database::{Database, Row};
use crate::support::metrics::{sample, try_get};
use crate::support::mysql::MyDb;
use crate::support::pg::PgDb;
use crate::support::world::{ARRIVAL, World, WorldBuilder};
use crate::support::{kafka, wait_until};

const PARTITIONS: u32 = 4;
/// How long the watch may take to ask its first questions or to work again.
const SETTLE: Duration = Duration::from_secs(60);

/// The watch's successful statements, and the oldest-rows reads of all four tables.
async fn counts(addr: SocketAddr) -> Option<(f64, f64)> {
    let text = try_get(addr, "/metrics").await?;
    let probes = sample(&text, "outbox_poll_watch_probes_total", &[("source", "test"), ("outcome", "ok")])?;
    let mut reads = 0.0;
    for p in 0..PARTITIONS {
        let p = p.to_string();
        let labels = [("source", "test"), ("shard", "0"), ("partition", p.as_str())];
        reads += sample(&text, "outbox_poll_query_seconds_count", &labels).unwrap_or(0.0);
    }
    Some((probes, reads))
}

/// Waits until the watch has made `more` statements beyond `since` (its interval is
/// `poll_interval_ms`, 25 ms); returns the counts then.
async fn after_probes(addr: SocketAddr, since: f64, more: f64) -> (f64, f64) {
    wait_until("the quiet-table watch's statements", SETTLE, || async move {
        counts(addr).await.filter(|(probes, _)| *probes >= since + more)
    })
    .await
}

/// Four idle polling tables: while the watch asks about them every interval, the tables are
/// hardly read themselves (each at most every few seconds, against four reads per interval
/// without it); a row committed into any of them is published; every session of the streamer's
/// login killed (the watch's connection among them) costs nothing, and the watch works again.
async fn idle_tables_are_watched_together<D: Database>(builder: WorldBuilder<D>) {
    let w = builder.partitions(PARTITIONS).config(POLLING).build().await;
    let streamer = w.start("streamer.log");
    let addr = streamer.metrics_addr();
    let (probes, reads) = after_probes(addr, 0.0, 5.0).await;
    let (probes_then, reads_then) = after_probes(addr, probes, 80.0).await;
    let (asked, read) = (probes_then - probes, reads_then - reads);
    assert!(
        read <= asked / 4.0,
        "{PARTITIONS} idle tables were read {read} times while the watch asked {asked} times (one by one, they are read {PARTITIONS} times per interval)"
    );

    let mut admin = w.db.connect().await;
    for (n, p) in (0..PARTITIONS).enumerate() {
        let row = Row::new(&w.topic, format!("first-{n}")).key(format!("k{p}"));
        D::insert(&mut admin, &w.table(0, p), &[row]).await;
    }
    let first = kafka::read_at_least(&w.topic, 1, PARTITIONS as usize, ARRIVAL).await;
    assert_eq!(first.len(), PARTITIONS as usize, "one row per quiet table, each once");

    let killed = D::kill_other_sessions(&mut admin).await;
    assert!(killed > PARTITIONS as usize, "the watch's session and the tables' sessions were killed: {killed}");
    let (probes, _) = counts(addr).await.expect("the metrics endpoint answers");
    after_probes(addr, probes, 20.0).await;
    for (n, p) in (0..PARTITIONS).enumerate() {
        let row = Row::new(&w.topic, format!("second-{n}")).key(format!("k{p}"));
        D::insert(&mut admin, &w.table(0, p), &[row]).await;
    }
    let all = kafka::read_at_least(&w.topic, 1, 2 * PARTITIONS as usize, ARRIVAL).await;
    let mut payloads: Vec<String> = all.iter().map(|r| r.payload_str().to_string()).collect();
    payloads.sort();
    let mut want: Vec<String> = (0..PARTITIONS).flat_map(|n| [format!("first-{n}"), format!("second-{n}")]).collect();
    want.sort();
    assert_eq!(payloads, want, "every row once, after the sessions were killed too");
    for p in 0..PARTITIONS {
        w.wait_drained(&w.table(0, p)).await;
    }
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_idle_polling_tables_are_watched_together() {
    idle_tables_are_watched_together(World::postgres("pq")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_idle_polling_tables_are_watched_together() {
    idle_tables_are_watched_together(World::mysql("mq")).await;
}

/// The watch's failed statements.
async fn failures(addr: SocketAddr) -> Option<f64> {
    let text = try_get(addr, "/metrics").await?;
    Some(sample(&text, "outbox_poll_watch_probes_total", &[("source", "test"), ("outcome", "failed")]).unwrap_or(0.0))
}

/// A table locked by DDL (`ACCESS EXCLUSIVE`, held open) while every table is quiet: the watch's
/// statement gives up on the lock at once instead of queueing behind it (where it would hold
/// its share lock on the other tables, and the application behind any DDL on those), the other
/// tables' rows are published meanwhile, and once the lock is gone the watch works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_locked_quiet_table_does_not_hold_up_the_watch() {
    let w = World::postgres("pk").partitions(3).config(POLLING).build().await;
    let streamer = w.start("streamer.log");
    let addr = streamer.metrics_addr();
    let (probes, _) = after_probes(addr, 0.0, 5.0).await;
    let mut locker = crate::support::pg::connect(&w.db.admin_url).await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute(&format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", w.table(0, 1))).await.unwrap();
    wait_until("the watch's statement to give up on the lock", SETTLE, || async move {
        failures(addr).await.filter(|failed| *failed >= 1.0)
    })
    .await;
    let waiting_watch = "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                          WHERE NOT l.granted AND a.datname = current_database()
                            AND a.query LIKE 'SELECT EXISTS (SELECT 1 FROM%'";
    wait_until("no statement of the watch waiting for a lock", SETTLE, || async {
        let n: i64 = w.db.admin.query_one(waiting_watch, &[]).await.unwrap().get(0);
        (n == 0).then_some(())
    })
    .await;
    let mut admin = w.db.connect().await;
    for p in [0, 2] {
        PgDb::insert(&mut admin, &w.table(0, p), &[Row::new(&w.topic, format!("beside-the-lock-{p}"))]).await;
    }
    let beside = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(beside.len(), 2, "the unlocked tables' rows, published while the lock is held");
    lock.rollback().await.unwrap();
    PgDb::insert(&mut admin, &w.table(0, 1), &[Row::new(&w.topic, "after-the-lock")]).await;
    let all = kafka::read_at_least(&w.topic, 1, 3, ARRIVAL).await;
    assert_eq!(all.len(), 3, "every row once");
    let (now, _) = counts(addr).await.expect("the metrics endpoint answers");
    after_probes(addr, now.max(probes), 20.0).await;
    assert!(streamer.stop());
}

/// The same on MariaDB: a quiet table under `LOCK TABLES … WRITE` fails the watch's statement
/// within its `lock_wait_timeout` instead of holding it; the other tables' rows are published
/// while the lock is held, and the watch works again after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_locked_quiet_table_does_not_hold_up_the_watch() {
    use mysql_async::prelude::Queryable;
    let w = World::mysql("mk").partitions(3).config(POLLING).build().await;
    let streamer = w.start("streamer.log");
    let addr = streamer.metrics_addr();
    let (probes, _) = after_probes(addr, 0.0, 5.0).await;
    let mut locker = w.db.connect().await;
    locker.query_drop(format!("LOCK TABLES {} WRITE", w.table(0, 1))).await.unwrap();
    wait_until("the watch's statement to give up on the lock", SETTLE, || async move {
        failures(addr).await.filter(|failed| *failed >= 1.0)
    })
    .await;
    let mut admin = w.db.connect().await;
    let waiting_watch = "SELECT COUNT(*) FROM information_schema.processlist
                          WHERE db = DATABASE() AND info LIKE 'SELECT EXISTS (SELECT 1 FROM%'
                            AND state LIKE 'Waiting for table%'";
    let db = &w.db;
    wait_until("no statement of the watch waiting for a lock", SETTLE, || async move {
        let n: Option<i64> = db.connect().await.query_first(waiting_watch).await.unwrap();
        (n == Some(0)).then_some(())
    })
    .await;
    for p in [0, 2] {
        MyDb::insert(&mut admin, &w.table(0, p), &[Row::new(&w.topic, format!("beside-the-lock-{p}"))]).await;
    }
    let beside = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(beside.len(), 2, "the unlocked tables' rows, published while the lock is held");
    locker.query_drop("UNLOCK TABLES").await.unwrap();
    MyDb::insert(&mut admin, &w.table(0, 1), &[Row::new(&w.topic, "after-the-lock")]).await;
    let all = kafka::read_at_least(&w.topic, 1, 3, ARRIVAL).await;
    assert_eq!(all.len(), 3, "every row once");
    let (now, _) = counts(addr).await.expect("the metrics endpoint answers");
    after_probes(addr, now.max(probes), 20.0).await;
    assert!(streamer.stop());
}
