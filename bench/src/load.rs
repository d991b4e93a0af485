//! The load generator: writer connections committing outbox rows at a target rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use outbox_postgres::connect::PgTarget;

/// One writer's shape.
#[derive(Debug, Clone)]
pub(super) struct WriterPlan {
    pub writer: usize,
    pub table: String,
    pub topic: String,
    pub rows_per_txn: usize,
    /// Every message's payload (see `payload.rs`).
    pub payload: Arc<[u8]>,
    /// Transactions per second for this writer; `None` for as fast as possible.
    pub txn_rate: Option<f64>,
    pub duration: Duration,
    /// Distinct keys per writer; each key belongs to one writer, so its ids follow commit order.
    pub keys: usize,
    /// Keys shared by all writers, each transaction taking its outbox ids *before* it locks
    /// its key's row in `bench_key_seq`: per key, commit order then differs from id order, and
    /// `bench_ledger` records each row's true position in its key's commit order.
    pub shared_keys: bool,
    /// Emit WAL-only messages (`pg_logical_emit_message` with the table's name as prefix)
    /// instead of inserting rows; their ids are their LSNs.
    pub wal: bool,
}

impl WriterPlan {
    /// The key of the `i`-th row of the `n`-th transaction.
    pub(super) fn key(&self, n: usize, i: usize) -> Vec<u8> {
        if self.shared_keys {
            format!("k{}", (n.wrapping_mul(2_654_435_761) + self.writer * 7 + i) % self.keys).into_bytes()
        } else {
            format!("w{}-k{}", self.writer, (n + i) % self.keys).into_bytes()
        }
    }
}

/// Tables of the shared-keys workload: per key a commit counter, per row its count.
pub(super) const LEDGER_DDL: [&str; 2] = [
    "CREATE TABLE bench_key_seq (k VARCHAR(64) PRIMARY KEY, n BIGINT NOT NULL)",
    "CREATE TABLE bench_ledger (id BIGINT PRIMARY KEY, n BIGINT NOT NULL)",
];

/// (outbox id, when its COMMIT returned).
pub(super) type Committed = Vec<(i64, Instant)>;

/// The pacing of one writer: a tick per transaction, or none for as fast as possible.
pub(super) fn ticker(plan: &WriterPlan) -> Option<tokio::time::Interval> {
    plan.txn_rate.map(|rate| {
        let mut t = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        t
    })
}

/// The envelopes of WAL-only messages, stamped with the time now (the latency metric's start).
pub(super) fn envelopes(topic: &str, keys: &[Vec<u8>], payloads: &[&[u8]]) -> Vec<Vec<u8>> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64);
    keys.iter()
        .zip(payloads)
        .map(|(key, payload)| {
            outbox_postgres::envelope::Envelope {
                topic: topic.as_bytes(),
                key: Some(key),
                payload: Some(payload),
                headers: None,
                kafka_partition: None,
                created_at_micros: now,
            }
            .encode()
        })
        .collect()
}

/// Runs one PostgreSQL writer; returns the ids it committed with their commit times.
pub(super) async fn run_writer(
    target: PgTarget,
    plan: WriterPlan,
    progress: Arc<AtomicUsize>,
) -> anyhow::Result<Committed> {
    let client = target.connect().await?;
    let insert = client
        .prepare(&if plan.wal {
            // $1 is the prefix (the table's name), $2 the envelopes; the ids are the LSNs.
            "SELECT (pg_logical_emit_message(true, $1, e) - '0/0'::pg_lsn)::bigint FROM unnest($2::bytea[]) AS u(e)"
                .to_string()
        } else {
            format!(
                "INSERT INTO {} (topic, msg_key, payload)
                 SELECT $1, k, p FROM unnest($2::bytea[], $3::bytea[]) AS u(k, p) RETURNING id",
                outbox_postgres::setup::ident(&plan.table)
            )
        })
        .await?;
    let ledger = if plan.shared_keys {
        Some(
            client
                .prepare(
                    "WITH u AS (UPDATE bench_key_seq SET n = n + 1 WHERE k = $1 RETURNING n)
                     INSERT INTO bench_ledger (id, n) SELECT $2, n FROM u",
                )
                .await?,
        )
    } else {
        None
    };
    let payload = plan.payload.clone();
    let mut committed = Vec::new();
    let mut ticker = ticker(&plan);
    let end = Instant::now() + plan.duration;
    let mut n = 0usize;
    while Instant::now() < end {
        if let Some(t) = ticker.as_mut() {
            t.tick().await;
        }
        let keys: Vec<Vec<u8>> = (0..plan.rows_per_txn).map(|i| plan.key(n, i)).collect();
        let payloads: Vec<&[u8]> = (0..plan.rows_per_txn).map(|_| &payload[..]).collect();
        n += plan.rows_per_txn;
        client.batch_execute("BEGIN").await?;
        let rows = if plan.wal {
            let envelopes = envelopes(&plan.topic, &keys, &payloads);
            client.query(&insert, &[&plan.table, &envelopes]).await?
        } else {
            client.query(&insert, &[&plan.topic, &keys, &payloads]).await?
        };
        if let Some(ledger) = &ledger {
            for (row, key) in rows.iter().zip(&keys) {
                let id: i64 = row.get(0);
                client.execute(ledger, &[&String::from_utf8_lossy(key).as_ref(), &id]).await?;
            }
        }
        client.batch_execute("COMMIT").await?;
        let at = Instant::now();
        committed.extend(rows.iter().map(|r| (r.get::<_, i64>(0), at)));
        progress.fetch_add(rows.len(), Ordering::Relaxed);
    }
    Ok(committed)
}
