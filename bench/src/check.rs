//! The checking consumer and the statistics of one run.
//!
//! Latency is measured on one clock (this process's monotonic clock): from the moment the
//! writer's `COMMIT` returned to the moment the checker's consumer returned the record. The
//! consumer is a Kafka topic's ([`TopicReader`]) or a RabbitMQ queue's
//! ([`crate::rabbit::QueueReader`]); the checks are the same.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use outbox_kafka::reader::TopicReader;

/// One record as the checker needs it: its key (the Kafka key, or the AMQP routing key, both
/// the row's `msg_key`) and its `outbox-id` header.
#[derive(Debug)]
pub(super) struct Record {
    pub key: Option<Vec<u8>>,
    pub outbox_id: Option<i64>,
}

/// Where the checker reads records from.
pub(super) trait RecordSource: Send + 'static {
    /// The next record, or `None` when none came within `wait`.
    fn poll(&mut self, wait: Duration) -> anyhow::Result<Option<Record>>;
}

impl RecordSource for TopicReader {
    fn poll(&mut self, wait: Duration) -> anyhow::Result<Option<Record>> {
        Ok(TopicReader::poll(self, wait)?.map(|rec| Record { key: rec.key, outbox_id: rec.outbox_id }))
    }
}

/// What the checker saw, per outbox id: the first arrival and how many copies.
#[derive(Debug, Default)]
pub(super) struct Seen {
    pub first_arrival: HashMap<i64, Instant>,
    pub copies: HashMap<i64, u32>,
    /// Records whose id is lower than an earlier record of the same key (commit order broken).
    pub out_of_order: usize,
    /// Arrivals per second since the checker started.
    pub per_second: Vec<u64>,
    /// First arrivals in order: (key, id).
    pub arrivals: Vec<(Vec<u8>, i64)>,
}

/// First arrivals whose position in their key's commit order (`ledger`: id → n) is lower
/// than that of a record of the same key that arrived before them.
pub(super) fn out_of_commit_order(arrivals: &[(Vec<u8>, i64)], ledger: &HashMap<i64, i64>) -> usize {
    let mut last: HashMap<&[u8], i64> = HashMap::new();
    let mut late = 0;
    for (key, id) in arrivals {
        let Some(&n) = ledger.get(id) else { continue };
        let seen = last.entry(key.as_slice()).or_insert(i64::MIN);
        if n < *seen {
            late += 1;
        }
        *seen = (*seen).max(n);
    }
    late
}

/// Runs the checker on a thread until `stop`; `consumed` counts distinct ids live.
pub(super) fn spawn_checker(
    mut reader: impl RecordSource,
    stop: Arc<AtomicBool>,
    consumed: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<anyhow::Result<Seen>> {
    std::thread::spawn(move || {
        let started = Instant::now();
        let mut seen = Seen::default();
        let mut last_per_key: HashMap<Vec<u8>, i64> = HashMap::new();
        while !stop.load(Ordering::Relaxed) {
            let Some(rec) = reader.poll(Duration::from_millis(50))? else { continue };
            let now = Instant::now();
            let Some(id) = rec.outbox_id else { continue };
            let second = now.duration_since(started).as_secs() as usize;
            if seen.per_second.len() <= second {
                seen.per_second.resize(second + 1, 0);
            }
            seen.per_second[second] += 1;
            let copies = seen.copies.entry(id).or_insert(0);
            *copies += 1;
            if *copies == 1 {
                seen.first_arrival.insert(id, now);
                consumed.fetch_add(1, Ordering::Relaxed);
                if let Some(key) = rec.key {
                    let last = last_per_key.entry(key.clone()).or_insert(i64::MIN);
                    if id < *last {
                        seen.out_of_order += 1;
                    }
                    *last = (*last).max(id);
                    seen.arrivals.push((key, id));
                }
            }
        }
        Ok(seen)
    })
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub(super) struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

/// The latency at every `1/steps` quantile, 0 to 1 inclusive (`steps + 1` values).
pub(super) fn quantiles(ms: &[f64], steps: usize) -> Vec<f64> {
    if ms.is_empty() {
        return Vec::new();
    }
    let mut sorted = ms.to_vec();
    sorted.sort_by(f64::total_cmp);
    (0..=steps).map(|k| sorted[((sorted.len() - 1) as f64 * k as f64 / steps as f64).round() as usize]).collect()
}

pub(super) fn percentiles(mut ms: Vec<f64>) -> Percentiles {
    if ms.is_empty() {
        return Percentiles::default();
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 - 1.0) * q).round() as usize];
    Percentiles { p50: at(0.50), p95: at(0.95), p99: at(0.99), max: *ms.last().expect("non-empty") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_order_per_key_from_the_ledger() {
        let ledger: HashMap<i64, i64> = [(1, 2), (2, 1), (3, 1)].into();
        let arrivals = vec![(b"a".to_vec(), 1), (b"a".to_vec(), 2), (b"b".to_vec(), 3)];
        assert_eq!(out_of_commit_order(&arrivals, &ledger), 1, "id 2 committed first on key a but arrived second");
    }

    #[test]
    fn percentile_positions() {
        let p = percentiles((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p95, p.p99, p.max), (51.0, 95.0, 99.0, 100.0));
        assert_eq!(percentiles(vec![]).max, 0.0);
    }
}
