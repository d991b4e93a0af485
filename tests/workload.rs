//! A seeded, randomised workload of what real databases see — commits, rollbacks, insert and
//! delete in one transaction, insert and update in one transaction, large transactions, bad
//! rows, XA and statement-logged sessions (MariaDB), streamer restarts and kills — checked from
//! outside: every committed insert arrives (at least once), each key's first deliveries keep
//! commit order, nothing rolled back arrives, and bad rows end where their policy says.
//!
//! `OUTBOX_WORKLOAD_SEED` replays a run (every run prints its seed); `OUTBOX_WORKLOAD_OPS`
//! makes it longer (CI runs 150 operations; `docs/development.md` shows a long run).

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use tokio_postgres::types::ToSql;

use crate::support::kafka;
use crate::support::streamer::Running;
use crate::support::world::World;

const ARRIVAL: Duration = Duration::from_secs(300);
const KEYS: u64 = 6;

/// xorshift64*: reproducible from the seed, no dependency.
pub(crate) struct Rng(pub u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The run's seed and number of operations, from the environment or fresh.
pub(crate) fn settings() -> (u64, usize) {
    let seed = std::env::var("OUTBOX_WORKLOAD_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1
    });
    let ops = std::env::var("OUTBOX_WORKLOAD_OPS").ok().and_then(|s| s.parse().ok()).unwrap_or(150);
    (seed, ops)
}

/// What the run expects: payloads that must arrive (ordered per key by their `n`), must never
/// arrive, and must arrive on the dead-letter topic.
#[derive(Default)]
struct Expect {
    /// key → next `n`.
    next: BTreeMap<String, u64>,
    committed: HashSet<String>,
    rolled_back: HashSet<String>,
    dead_letter: HashSet<String>,
    /// Rows that arrive late by design (swept): not held to per-key order.
    unordered: HashSet<String>,
}

impl Expect {
    /// A payload for the next row of `key`: `<key>:<n>:<what>`.
    fn row(&mut self, key: &str, what: &str) -> String {
        let n = self.next.entry(key.to_string()).or_insert(1);
        let payload = format!("{key}:{n}:{what}");
        *n += 1;
        payload
    }

    /// A payload outside the per-key count (rolled back, dead-lettered, late).
    fn other(&mut self, key: &str, what: &str, i: usize) -> String {
        format!("{key}:x{i}:{what}")
    }

    fn check(&self, records: &[kafka::Record], dead: &[kafka::Record], seed: u64) {
        let mut sorted = records.to_vec();
        sorted.sort_by_key(|r| (r.partition, r.offset));
        let mut seen = HashSet::new();
        let mut per_key: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for r in &sorted {
            let payload = r.payload_str();
            assert!(!self.rolled_back.contains(&payload), "seed {seed}: a rolled-back row arrived: {payload}");
            assert!(!self.dead_letter.contains(&payload), "seed {seed}: a bad row reached the topic: {payload}");
            assert!(self.committed.contains(&payload), "seed {seed}: an unknown record arrived: {payload}");
            if !seen.insert(payload.clone()) || self.unordered.contains(&payload) {
                continue;
            }
            let mut parts = payload.splitn(3, ':');
            let (key, n) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
            assert_eq!(key, r.key_str(), "seed {seed}: the record is keyed by its row's key");
            per_key.entry(key.to_string()).or_default().push(n.parse().expect("n"));
        }
        let missing: Vec<&String> = self.committed.iter().filter(|p| !seen.contains(*p)).take(10).collect();
        assert!(missing.is_empty(), "seed {seed}: committed rows never arrived, e.g. {missing:?}");
        for (key, ns) in &per_key {
            assert!(
                ns.windows(2).all(|w| w[0] < w[1]),
                "seed {seed}: key {key}: first deliveries out of commit order: {ns:?}"
            );
        }
        let dead: HashSet<String> = dead.iter().map(kafka::Record::payload_str).collect();
        assert_eq!(dead, self.dead_letter, "seed {seed}: the dead-letter topic holds exactly the bad rows");
    }
}

/// Restarts or kills the streamer, and restarts a halted one (the operator's part: the bad
/// row was fixed in the table right after it was written).
async fn churn(streamer: &mut Option<Running>, start: &dyn Fn(usize) -> Running, runs: &mut usize, kill: bool) {
    let old = streamer.take().expect("a running streamer");
    if kill {
        old.kill();
    } else {
        // SIGTERM is handled from the start of `run`; before it, the process is only parsing
        // its configuration, and a signal would end it without a clean exit code.
        old.wait_for_log("outbox-streamer running", ARRIVAL).await;
        assert!(old.stop(), "clean exit on SIGTERM");
    }
    *runs += 1;
    *streamer = Some(start(*runs));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_randomised_workload() {
    postgres_workload("wl", false).await;
}

/// The same mix in polling mode, where explicit ids below the low-water mark and two-phase
/// transactions (writers without a backend) are what the poller must not skip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_polling_randomised_workload() {
    postgres_workload("wp", true).await;
}

/// A two-phase transaction prepared and not yet decided: its GID, (key, payload)s and when.
type PgPrepared = (String, Vec<String>, std::time::Instant);

/// The longest a two-phase transaction stays undecided (then it is committed), as a transaction
/// manager would: an older one holds up every other test's `setup` on this server (a new slot
/// waits for it) past `setup --prepared-wait`.
const PG_PREPARED_AT_MOST: Duration = Duration::from_secs(10);

/// The two-phase transactions a failing run leaves undecided are rolled back: one would make
/// every later logical slot of the server wait for it.
struct Undecided {
    url: String,
    gids: Vec<String>,
}

impl Drop for Undecided {
    fn drop(&mut self) {
        if self.gids.is_empty() {
            return;
        }
        let (url, gids) = (self.url.clone(), std::mem::take(&mut self.gids));
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(crate::support::pg::roll_back_prepared(&url, &gids));
        });
        let _ = cleanup.join();
    }
}

async fn postgres_workload(name: &str, polling: bool) {
    let (seed, ops) = settings();
    eprintln!("postgres workload {name}: OUTBOX_WORKLOAD_SEED={seed} OUTBOX_WORKLOAD_OPS={ops}");
    let mut rng = Rng(seed);
    let extra = if polling { "sweep_interval_ms = 500\nmode = \"polling\"" } else { "sweep_interval_ms = 500" };
    let w = World::postgres(name).kafka_partitions(3).config(extra).build().await;
    let table = w.table(0, 0);
    w.db.admin.batch_execute(&format!("ALTER TABLE {table} ALTER COLUMN topic DROP NOT NULL")).await.unwrap();
    let start = |run: usize| w.start(&format!("run-{run}.log"));
    let mut runs = 0;
    let mut streamer = Some(start(runs));
    let mut expect = Expect::default();
    let insert = format!(
        "INSERT INTO {table} (topic, msg_key, payload) VALUES ($1, convert_to($2, 'UTF8'), convert_to($3, 'UTF8'))"
    );
    let returning = format!("{insert} RETURNING id");
    let db = &w.db.admin;
    let topic = w.topic.as_str();
    let mut prepared: Vec<PgPrepared> = Vec::new();
    let mut undecided = Undecided { url: w.db.admin_url.clone(), gids: Vec::new() };
    for i in 0..ops {
        while let Some(at) = prepared.iter().position(|(_, _, when)| when.elapsed() > PG_PREPARED_AT_MOST) {
            let (gid, rows, _) = prepared.swap_remove(at);
            undecided.gids.retain(|g| *g != gid);
            db.batch_execute(&format!("COMMIT PREPARED '{gid}'")).await.unwrap();
            expect.committed.extend(rows);
        }
        let key = format!("k{}", rng.below(KEYS));
        match rng.below(100) {
            0..=39 => {
                db.batch_execute("BEGIN").await.unwrap();
                for _ in 0..=rng.below(4) {
                    let p = expect.row(&key, "committed");
                    db.execute(&insert, &[&topic as &(dyn ToSql + Sync), &key, &p]).await.unwrap();
                    expect.committed.insert(p);
                }
                db.batch_execute("COMMIT").await.unwrap();
            }
            40..=54 => {
                db.batch_execute("BEGIN").await.unwrap();
                for j in 0..=rng.below(3) as usize {
                    let p = expect.other(&key, "rolled-back", i * 10 + j);
                    db.execute(&insert, &[&topic as &(dyn ToSql + Sync), &key, &p]).await.unwrap();
                    expect.rolled_back.insert(p);
                }
                db.batch_execute("ROLLBACK").await.unwrap();
            }
            55..=60 => {
                // Insert and delete in one transaction: committed, so CDC publishes it; polling
                // never sees the row.
                let p = if polling {
                    expect.other(&key, "inserted-and-deleted", i)
                } else {
                    expect.row(&key, "inserted-and-deleted")
                };
                db.batch_execute("BEGIN").await.unwrap();
                let id: i64 =
                    db.query_one(&returning, &[&topic as &(dyn ToSql + Sync), &key, &p]).await.unwrap().get(0);
                db.execute(&format!("DELETE FROM {table} WHERE id = $1"), &[&id]).await.unwrap();
                db.batch_execute("COMMIT").await.unwrap();
                if polling {
                    expect.rolled_back.insert(p);
                } else {
                    expect.committed.insert(p);
                }
            }
            61..=64 => {
                // Insert then update: CDC publishes the inserted values, polling the table's.
                let p = expect.row(&key, "as-inserted");
                db.batch_execute("BEGIN").await.unwrap();
                let id: i64 =
                    db.query_one(&returning, &[&topic as &(dyn ToSql + Sync), &key, &p]).await.unwrap().get(0);
                db.execute(
                    &format!("UPDATE {table} SET payload = payload || convert_to(':updated', 'UTF8') WHERE id = $1"),
                    &[&id],
                )
                .await
                .unwrap();
                db.batch_execute("COMMIT").await.unwrap();
                expect.committed.insert(if polling { format!("{p}:updated") } else { p });
            }
            65..=67 => {
                // An explicit id far below the identity's (zero and negative included): below
                // polling's low-water mark, so found by its rescan from the lowest id, after
                // later rows.
                let p = expect.other(&key, "explicit-id", i);
                db.execute(
                    &format!(
                        "INSERT INTO {table} (id, topic, msg_key, payload) OVERRIDING SYSTEM VALUE
                         VALUES ($1, $2, convert_to($3, 'UTF8'), convert_to($4, 'UTF8'))"
                    ),
                    &[&(-(i as i64)), &topic as &(dyn ToSql + Sync), &key, &p],
                )
                .await
                .unwrap();
                expect.committed.insert(p.clone());
                expect.unordered.insert(p);
            }
            68..=70 if prepared.len() < 4 => {
                // A two-phase transaction: prepared now, decided later (from another session).
                // Its rows take their place in the order at its commit: a key of its own.
                let gid = format!("{table}_{i}");
                db.batch_execute("BEGIN").await.unwrap();
                let mut rows = Vec::new();
                for j in 0..=rng.below(2) {
                    let p = format!("{gid}:{}:2pc", j + 1);
                    db.execute(&insert, &[&topic as &(dyn ToSql + Sync), &gid, &p]).await.unwrap();
                    rows.push(p);
                }
                undecided.gids.push(gid.clone());
                db.batch_execute(&format!("PREPARE TRANSACTION '{gid}'")).await.unwrap();
                prepared.push((gid, rows, std::time::Instant::now()));
            }
            68..=72 if !prepared.is_empty() => {
                let at = rng.below(prepared.len() as u64) as usize;
                let (gid, rows, _) = prepared.swap_remove(at);
                undecided.gids.retain(|g| *g != gid);
                let commit = rng.below(2) == 0;
                db.batch_execute(&format!("{} PREPARED '{gid}'", if commit { "COMMIT" } else { "ROLLBACK" }))
                    .await
                    .unwrap();
                if commit {
                    expect.committed.extend(rows);
                } else {
                    expect.rolled_back.extend(rows);
                }
            }
            68..=72 => {}
            73..=76 => {
                // A large transaction of one key.
                let big = format!("big{i}");
                let first = *expect.next.get(&big).unwrap_or(&1);
                let n = 500 + rng.below(1500);
                db.execute(
                    &format!(
                        "INSERT INTO {table} (topic, msg_key, payload)
                         SELECT $1, convert_to($2, 'UTF8'), convert_to($2 || ':' || i || ':committed', 'UTF8')
                         FROM generate_series($3::bigint, $4::bigint) i"
                    ),
                    &[&topic as &(dyn ToSql + Sync), &big, &(first as i64), &((first + n - 1) as i64)],
                )
                .await
                .unwrap();
                for _ in 0..n {
                    let p = expect.row(&big, "committed");
                    expect.committed.insert(p);
                }
            }
            77..=84 => {
                // A bad row (NULL topic), fixed in the table by the next statement: it is
                // published with its current values, in its place, whether the streamer saw
                // it before or after the fix (halting and being restarted in between).
                let p = expect.row(&key, "fixed");
                let id: i64 = db
                    .query_one(
                        &format!(
                            "INSERT INTO {table} (topic, msg_key, payload) VALUES (NULL, convert_to($1, 'UTF8'), convert_to($2, 'UTF8')) RETURNING id"
                        ),
                        &[&key, &p],
                    )
                    .await
                    .unwrap()
                    .get(0);
                db.execute(&format!("UPDATE {table} SET topic = $1 WHERE id = $2"), &[&topic, &id]).await.unwrap();
                expect.committed.insert(p);
            }
            85..=92 => {
                if streamer.as_ref().is_some_and(|s| s.log_text().contains("halted")) {
                    churn(&mut streamer, &start, &mut runs, false).await;
                }
            }
            93..=96 => churn(&mut streamer, &start, &mut runs, false).await,
            _ => churn(&mut streamer, &start, &mut runs, true).await,
        }
    }
    for (gid, rows, _) in prepared {
        db.batch_execute(&format!("COMMIT PREPARED '{gid}'")).await.unwrap();
        expect.committed.extend(rows);
    }
    undecided.gids.clear();
    // The operator's last look: a halted stream is restarted once the row is fixed.
    if streamer.as_ref().is_some_and(|s| s.log_text().contains("halted")) {
        churn(&mut streamer, &start, &mut runs, false).await;
    }
    let records = kafka::read_until_payloads(&w.topic, 3, &expect.committed, ARRIVAL).await;
    expect.check(&records, &[], seed);
    w.wait_drained(&table).await;
    assert!(streamer.take().unwrap().stop());
}

/// An XA transaction prepared and not yet decided: its connection, XID and (key, payload)s.
type Prepared = (mysql_async::Conn, String, Vec<(String, String)>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_randomised_workload() {
    mariadb_workload("mwl", false, crate::support::mysql::STREAMER_GRANTS).await;
}

/// The same mix in polling mode, with `PROCESS` granted: the poller reads the table's writers
/// from INNODB_TRX (a cache that goes stale under frequent reads), and prepared XA
/// transactions hold the low-water mark below their rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_polling_randomised_workload_with_process() {
    let grants = format!("{}, PROCESS", crate::support::mysql::STREAMER_GRANTS);
    mariadb_workload("mwp", true, &grants).await;
}

async fn mariadb_workload(name: &str, polling: bool, grants: &str) {
    let mode = if polling { "mode = \"polling\"" } else { "" };
    let (seed, ops) = settings();
    eprintln!("mariadb workload {name}: OUTBOX_WORKLOAD_SEED={seed} OUTBOX_WORKLOAD_OPS={ops}");
    let mut rng = Rng(seed);
    let dlq = kafka::fresh_topic(&format!("{name}dlq"), 1).await;
    let extra = format!("sweep_interval_ms = 500\non_bad_row = \"dead-letter\"\ndead_letter_topic = \"{dlq}\"\n{mode}");
    let w = World::mysql(name).kafka_partitions(3).config(&extra).grants(grants).build().await;
    let table = w.table(0, 0);
    let mut db = w.admin().await;
    db.query_drop(format!("ALTER TABLE {table} MODIFY topic VARCHAR(249) NULL")).await.unwrap();
    let mut statement = w.admin().await;
    statement.query_drop("SET SESSION binlog_format = 'STATEMENT'").await.unwrap();
    let start = |run: usize| w.start(&format!("run-{run}.log"));
    let mut runs = 0;
    let mut streamer = Some(start(runs));
    let mut expect = Expect::default();
    let insert = format!("INSERT INTO {table} (topic, msg_key, payload) VALUES (?, ?, ?)");
    let topic = w.topic.clone();
    let mut prepared: Vec<Prepared> = Vec::new();
    for i in 0..ops {
        let key = format!("k{}", rng.below(KEYS));
        match rng.below(100) {
            0..=34 => {
                db.query_drop("BEGIN").await.unwrap();
                for _ in 0..=rng.below(4) {
                    let p = expect.row(&key, "committed");
                    db.exec_drop(&insert, (&topic, &key, &p)).await.unwrap();
                    expect.committed.insert(p);
                }
                db.query_drop("COMMIT").await.unwrap();
            }
            35..=46 => {
                db.query_drop("BEGIN").await.unwrap();
                let p = expect.other(&key, "rolled-back", i);
                db.exec_drop(&insert, (&topic, &key, &p)).await.unwrap();
                expect.rolled_back.insert(p);
                db.query_drop("ROLLBACK").await.unwrap();
            }
            47..=53 => {
                // CDC publishes the committed insert; polling never sees the row.
                let p = if polling {
                    expect.other(&key, "inserted-and-deleted", i)
                } else {
                    expect.row(&key, "inserted-and-deleted")
                };
                db.query_drop("BEGIN").await.unwrap();
                db.exec_drop(&insert, (&topic, &key, &p)).await.unwrap();
                db.query_drop(format!("DELETE FROM {table} WHERE id = LAST_INSERT_ID()")).await.unwrap();
                db.query_drop("COMMIT").await.unwrap();
                if polling {
                    expect.rolled_back.insert(p);
                } else {
                    expect.committed.insert(p);
                }
            }
            54..=58 => {
                // CDC publishes the row as inserted; polling as the table holds it.
                let p = expect.row(&key, "as-inserted");
                db.query_drop("BEGIN").await.unwrap();
                db.exec_drop(&insert, (&topic, &key, &p)).await.unwrap();
                db.query_drop(format!(
                    "UPDATE {table} SET payload = CONCAT(payload, ':updated') WHERE id = LAST_INSERT_ID()"
                ))
                .await
                .unwrap();
                db.query_drop("COMMIT").await.unwrap();
                expect.committed.insert(if polling { format!("{p}:updated") } else { p });
            }
            59..=68 => {
                // XA: prepare now (on its own connection), decide later. Rows of an XA
                // transaction take their place in the order at its commit, so each uses a key
                // of its own.
                let xid = format!("{name}xa{i}");
                let mut conn = w.admin().await;
                conn.query_drop(format!("XA START '{xid}'")).await.unwrap();
                let mut rows = Vec::new();
                for j in 0..=rng.below(2) {
                    let p = format!("{xid}:{}:xa", j + 1);
                    conn.exec_drop(&insert, (&topic, &xid, &p)).await.unwrap();
                    rows.push((xid.clone(), p));
                }
                conn.query_drop(format!("XA END '{xid}'")).await.unwrap();
                conn.query_drop(format!("XA PREPARE '{xid}'")).await.unwrap();
                prepared.push((conn, xid, rows));
            }
            69..=76 if !prepared.is_empty() => {
                let at = rng.below(prepared.len() as u64) as usize;
                let (mut conn, xid, rows) = prepared.swap_remove(at);
                let commit = rng.below(2) == 0;
                conn.query_drop(format!("XA {} '{xid}'", if commit { "COMMIT" } else { "ROLLBACK" })).await.unwrap();
                for (_, p) in rows {
                    if commit {
                        expect.committed.insert(p);
                    } else {
                        expect.rolled_back.insert(p);
                    }
                }
                conn.disconnect().await.unwrap();
            }
            77..=80 => {
                // A statement-logged insert: not in the binlog as a row; the sweep sends it.
                let p = expect.other(&key, "statement-logged", i);
                statement.exec_drop(&insert, (&topic, &key, &p)).await.unwrap();
                expect.committed.insert(p.clone());
                expect.unordered.insert(p);
            }
            81..=84 => {
                let n = 500 + rng.below(1500);
                let big = format!("big{i}");
                db.exec_drop(
                    format!(
                        "INSERT INTO {table} (topic, msg_key, payload)
                         SELECT ?, ?, CONCAT(?, ':', seq, ':committed') FROM seq_1_to_{n}"
                    ),
                    (&topic, &big, &big),
                )
                .await
                .unwrap();
                for _ in 0..n {
                    let p = expect.row(&big, "committed");
                    expect.committed.insert(p);
                }
            }
            85..=90 => {
                // A bad row under `dead-letter`: it goes to the dead-letter topic whole.
                let p = expect.other(&key, "dead-letter", i);
                db.exec_drop(&insert, (None::<String>, &key, &p)).await.unwrap();
                expect.dead_letter.insert(p);
            }
            91..=96 => churn(&mut streamer, &start, &mut runs, false).await,
            _ => churn(&mut streamer, &start, &mut runs, true).await,
        }
    }
    for (mut conn, xid, rows) in prepared {
        conn.query_drop(format!("XA COMMIT '{xid}'")).await.unwrap();
        expect.committed.extend(rows.into_iter().map(|(_, p)| p));
        conn.disconnect().await.unwrap();
    }
    let records = kafka::read_until_payloads(&w.topic, 3, &expect.committed, ARRIVAL).await;
    let dead = if expect.dead_letter.is_empty() {
        Vec::new()
    } else {
        kafka::read_until_payloads(&dlq, 1, &expect.dead_letter, ARRIVAL).await
    };
    expect.check(&records, &dead, seed);
    w.wait_drained(&w.table(0, 0)).await;
    assert!(streamer.take().unwrap().stop());
    statement.disconnect().await.unwrap();
    db.disconnect().await.unwrap();
}
