//! The checking consumer and the statistics of one run.
//!
//! Latency is measured on one clock (this process's monotonic clock): from the moment the
//! writer's `COMMIT` returned to the moment the checker's consumer returned the record.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use outbox_kafka::reader::TopicReader;

/// What the checker saw, per outbox id: the first arrival and how many copies.
#[derive(Debug, Default)]
pub struct Seen {
    pub first_arrival: HashMap<i64, Instant>,
    pub copies: HashMap<i64, u32>,
    /// Records whose id is lower than an earlier record of the same key (commit order broken).
    pub out_of_order: usize,
    /// Arrivals per second since the checker started.
    pub per_second: Vec<u64>,
}

/// Runs the checker on a thread until `stop`; `consumed` counts distinct ids live.
pub fn spawn_checker(
    reader: TopicReader,
    stop: Arc<AtomicBool>,
    consumed: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<Result<Seen, outbox_kafka::KafkaError>> {
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
                    let last = last_per_key.entry(key).or_insert(i64::MIN);
                    if id < *last {
                        seen.out_of_order += 1;
                    }
                    *last = (*last).max(id);
                }
            }
        }
        Ok(seen)
    })
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

pub fn percentiles(mut ms: Vec<f64>) -> Percentiles {
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
    fn percentile_positions() {
        let p = percentiles((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p95, p.p99, p.max), (51.0, 95.0, 99.0, 100.0));
        assert_eq!(percentiles(vec![]).max, 0.0);
    }
}
