//! `outbox_end_to_end_latency_seconds`: one sample per published record, in seconds from the
//! row's `created_at` (the database clock) to Kafka's acknowledgement.

use std::time::Duration;

use mysql_async::prelude::Queryable;

use crate::support::metrics::{STREAM_0_0, bucket, free_addr, sample, try_get};
use crate::support::streamer::Running;
use crate::support::world::World;
use crate::support::{kafka, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);
const LATENCY: &str = "outbox_end_to_end_latency_seconds";

/// MariaDB logs a `TIMESTAMP(6)` as seconds since the epoch, which the decoder used to hand
/// over as text: the metric never appeared. Now every record has a sample, in seconds, and
/// writers in time zones other than the server's do not skew it: rows are written from
/// sessions at +05:00 and -08:00, some with `created_at` set 2 s in the past by the writer's
/// own clock, and one row (bad at first, fixed in the table while the stream is halted) is
/// read back from the table by the streamer's SQL session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_latency_has_a_sample_per_record_in_seconds_whatever_the_writers_time_zone() {
    let w = World::mysql("ml").config("halt_retry_ms = 300").build().await;
    let table = w.table(0, 0);
    let mut admin = w.admin().await;
    admin.query_drop(format!("ALTER TABLE {table} MODIFY topic VARCHAR(249) NULL")).await.unwrap();
    let addr = free_addr();
    let streamer =
        Running::start_with_env(&w.config, &w.dir.join("streamer.log"), &[("OUTBOX_METRICS_LISTEN", addr.to_string())]);
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES (?, ?)");
    let aged = format!("INSERT INTO {table} (topic, payload, created_at) VALUES (?, ?, NOW(6) - INTERVAL 2 SECOND)");
    let (mut east, mut west) = (w.admin().await, w.admin().await);
    east.query_drop("SET time_zone = '+05:00'").await.unwrap();
    west.query_drop("SET time_zone = '-08:00'").await.unwrap();
    for i in 0..10 {
        east.exec_drop(&insert, (&w.topic, format!("east-{i}"))).await.unwrap();
    }
    let mut tx = west.start_transaction(mysql_async::TxOpts::default()).await.unwrap();
    for i in 0..10 {
        tx.exec_drop(&insert, (&w.topic, format!("west-{i}"))).await.unwrap();
    }
    tx.commit().await.unwrap();
    for i in 0..5 {
        east.exec_drop(&aged, (&w.topic, format!("east-aged-{i}"))).await.unwrap();
        west.exec_drop(&aged, (&w.topic, format!("west-aged-{i}"))).await.unwrap();
    }
    const AGED: f64 = 10.0;
    west.exec_drop(&insert, (None::<String>, "bad at first")).await.unwrap();
    let bad: Option<i64> = west.query_first("SELECT LAST_INSERT_ID()").await.unwrap();
    streamer.wait_for_state("halted", ARRIVAL).await;
    admin.exec_drop(format!("UPDATE {table} SET topic = ? WHERE id = ?"), (&w.topic, bad)).await.unwrap();

    const RECORDS: usize = 31;
    let records = kafka::read_at_least(&w.topic, 1, RECORDS, ARRIVAL).await;
    assert_eq!(records.len(), RECORDS, "every row once");
    w.wait_drained(&w.table(0, 0)).await;
    // Histograms reach /metrics at the exporter's next upkeep (every 5 s).
    let text = wait_until("a latency sample per record on /metrics", ARRIVAL, || async {
        let text = try_get(addr, "/metrics").await?;
        (sample(&text, &format!("{LATENCY}_count"), STREAM_0_0)? == RECORDS as f64).then_some(text)
    })
    .await;
    let sum = sample(&text, &format!("{LATENCY}_sum"), STREAM_0_0).unwrap();
    let within = |le: f64| bucket(&text, LATENCY, STREAM_0_0, le).unwrap_or_else(|| panic!("bucket {le}:\n{text}"));
    // Microseconds taken for seconds, or a time zone's hours, land far above 30 s; a clock
    // behind by hours is cut to 0 and would put the aged rows below 1 s.
    assert_eq!(within(30.0), RECORDS as f64, "every sample below 30 s (sum {sum})");
    assert!(within(1.0) <= RECORDS as f64 - AGED, "the aged rows took over 2 s:\n{text}");
    assert!(sum >= 2.0 * AGED && sum < 30.0 * RECORDS as f64, "sum {sum}");
    assert!(streamer.stop());
    for conn in [admin, east, west] {
        conn.disconnect().await.unwrap();
    }
}
