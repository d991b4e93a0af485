//! PostgreSQL CDC under faults: SIGKILL at random moments, bad rows under both policies.

use std::time::Duration;

use tokio_postgres::types::ToSql;

use crate::faults;
use crate::polling::POLLING;
use crate::support::world::World;
use crate::support::{kafka, wait_until};

const ARRIVAL: Duration = Duration::from_secs(180);

/// 50,000 rows in 250 transactions while the streamer is killed with SIGKILL three times;
/// the slot's confirmed position is sampled throughout ([`faults::sigkill`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_at_random_moments_loses_nothing() {
    let w = World::postgres("ok").kafka_partitions(4).build().await;
    faults::sigkill(w, 250, Duration::from_millis(20)).await;
}

/// [`faults::sigkill`] under exactly-once delivery: 0 lost and 0 duplicated for a
/// `read_committed` consumer ([`faults::sigkill_exactly_once`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_once_sigkill_at_random_moments_sends_each_row_once() {
    let w = World::postgres("eok").kafka_partitions(4).config(EXACTLY_ONCE).build().await;
    faults::sigkill_exactly_once(w, 250, Duration::from_millis(20)).await;
}

/// The same in polling mode: each progress record names the rows its Kafka transaction holds,
/// and a restarted session deletes those before it reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn polling_exactly_once_sigkill_at_random_moments_sends_each_row_once() {
    let config = format!("{POLLING}\n{EXACTLY_ONCE}");
    let w = World::postgres("epk").kafka_partitions(4).config(&config).build().await;
    faults::sigkill_exactly_once(w, 250, Duration::from_millis(20)).await;
}

/// [`faults::kafka_outage_exactly_once`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_kafka_outage_sends_each_row_once() {
    let w = World::postgres("eko").kafka_partitions(3).config(EXACTLY_ONCE).exclusive().build().await;
    faults::kafka_outage_exactly_once(w).await;
}

/// [`faults::million_row_transaction_exactly_once`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_a_million_row_transaction_arrives_once_with_bounded_memory() {
    let w = World::postgres("eom").kafka_partitions(3).config(EXACTLY_ONCE).build().await;
    faults::million_row_transaction_exactly_once(w).await;
}

/// The `[source.defaults]` line of an exactly-once world.
pub(crate) const EXACTLY_ONCE: &str = "delivery = \"exactly-once\"";

/// A NULL topic halts its own shard-partition with one error naming the row, the column and
/// the fix; the other shard keeps streaming ([`faults::bad_row_halts_its_shard_partition`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_row_halts_only_its_shard_partition() {
    faults::bad_row_halts_its_shard_partition(World::postgres("oh").shards(2).build().await).await;
}

/// [`faults::kafka_outage`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_outage_longer_than_the_delivery_timeout_loses_nothing() {
    faults::kafka_outage(World::postgres("ko").kafka_partitions(3).exclusive().build().await).await;
}

/// The same outage in polling mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_kafka_outage_longer_than_the_delivery_timeout_loses_nothing() {
    let w = World::postgres("pko").kafka_partitions(3).config(POLLING).exclusive().build().await;
    faults::kafka_outage(w).await;
}

/// [`faults::million_row_transaction`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_row_transaction_passes_with_bounded_memory() {
    faults::million_row_transaction(World::postgres("om").kafka_partitions(3).build().await).await;
}

/// [`faults::full_client_queue`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_client_queue_is_waited_on_and_loses_nothing() {
    faults::full_client_queue(World::postgres("oq").kafka_partitions(3)).await;
}

/// [`faults::dead_letter_whole`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rows_go_to_the_dead_letter_topic_whole() {
    faults::dead_letter_whole(World::postgres("od")).await;
}

/// A row naming a topic that does not exist halts its shard-partition with an error that says
/// so (auto-creation is off), instead of retrying forever. The broker's first answer
/// (UNKNOWN_TOPIC_OR_PARTITION, also seen briefly while partitions move) is retried once; the
/// client's own "unknown topic" verdict is definite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_halts_with_an_error_that_names_it() {
    let w = World::postgres("ou").build().await;
    let t0 = w.table(0, 0);
    let streamer = w.start("streamer.log");
    let id: i64 =
        w.db.admin
            .query_one(
                &format!("INSERT INTO {t0} (topic, payload) VALUES ('no-such-topic-anywhere', 'x') RETURNING id"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
    let log = streamer.wait_for_halt(ARRIVAL).await;
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert_eq!(errors.len(), 1, "one ERROR:\n{log}");
    assert!(errors[0].contains(&format!("row id={id}")), "{}", errors[0]);
    assert!(errors[0].contains("does not exist"), "{}", errors[0]);
    assert_eq!(w.db.count(&t0).await, 1, "the row stays in the table");
    assert!(streamer.stop());
}

/// A payload above Kafka's maximum under the default policy halts with the row named and the
/// fix; the row and everything after it stay in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_payload_halts_with_the_row_named() {
    let w = World::postgres("oz").build().await;
    let t0 = w.table(0, 0);
    let streamer = w.start("streamer.log");
    let insert = format!("INSERT INTO {t0} (topic, payload) VALUES ($1, $2) RETURNING id");
    let row = async |payload: &[u8]| -> i64 {
        w.db.admin.query_one(&insert, &[&w.topic as &(dyn ToSql + Sync), &payload]).await.unwrap().get(0)
    };
    row(b"first").await;
    let big = row(&vec![b'x'; 2 * 1024 * 1024]).await;
    row(b"after").await;
    let log = streamer.wait_for_halt(ARRIVAL).await;
    let error = log.lines().find(|l| l.contains("ERROR")).expect("an ERROR line");
    assert!(error.contains(&format!("row id={big}")) && error.contains("message.max.bytes"), "{error}");
    let records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(records.iter().map(|r| r.payload_str()).collect::<Vec<_>>(), ["first"]);
    assert_eq!(w.db.count(&t0).await, 2, "the oversize row and the one after it stay");
    assert!(streamer.stop());
}

/// Dropping a required column while streaming halts with an error naming the column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_required_column_halts_naming_it() {
    let w = World::postgres("ox").build().await;
    let t0 = w.table(0, 0);
    let streamer = w.start("streamer.log");
    w.db.admin.execute(&format!("INSERT INTO {t0} (topic, payload) VALUES ($1, 'before')"), &[&w.topic]).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    w.db.admin.batch_execute(&format!("ALTER TABLE {t0} DROP COLUMN headers")).await.unwrap();
    w.db.admin.execute(&format!("INSERT INTO {t0} (topic, payload) VALUES ($1, 'after')"), &[&w.topic]).await.unwrap();
    let log = streamer.wait_for_halt(ARRIVAL).await;
    let error = log.lines().find(|l| l.contains("ERROR")).expect("an ERROR line");
    assert!(error.contains("\\\"headers\\\"") || error.contains("\"headers\""), "{error}");
    assert_eq!(w.db.count(&t0).await, 1, "the row after the change stays in the table");
    assert!(streamer.stop());
}

/// With a heartbeat configured, a replication link that goes silent without closing is
/// noticed within three heartbeat intervals ([`faults::silent_dead_link`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_dead_replication_link_is_detected_with_a_heartbeat() {
    let w = World::postgres("pdl").build().await;
    let prefix = format!("table_prefix = \"{}\"\n", w.prefix);
    w.edit_config(|c| c.replace(&prefix, &format!("{prefix}heartbeat_interval_ms = 500\n")));
    faults::silent_dead_link(w).await;
}

/// PostgreSQL flushes a commit record before the transaction becomes visible to other
/// sessions, and the walsender may send the transaction in between. A synchronous standby
/// that never answers holds a committing transaction exactly there (committed in the WAL,
/// invisible to queries) for as long as the test likes. The streamer publishes the row; its
/// first DELETE finds nothing, and it must wait for the transaction to become visible and
/// delete the row then, not confirm the position with the row left in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_sent_before_its_commit_is_visible_is_still_deleted() {
    let w = World::postgres("vis").kafka_partitions(3).exclusive().build().await;
    let table = w.table(0, 0);
    let root = crate::support::pg::connect(&crate::support::env("OUTBOX_PG_URL")).await;
    let db: String = w.db.admin.query_one("SELECT current_database()", &[]).await.unwrap().get(0);
    // Every session of this database commits locally, except the writer below.
    root.batch_execute(&format!("ALTER DATABASE {db} SET synchronous_commit = local")).await.unwrap();
    w.db.admin.batch_execute("SET synchronous_commit = local").await.unwrap();
    let _standby = NeverAnsweringStandby::begin(&root).await;
    let streamer = w.start("streamer.log");
    // A first row ends the session's replay check, so the held row below meets the delete.
    let warm_up = format!("INSERT INTO {table} (topic, msg_key, payload) VALUES ($1, 'k', 'warm-up')");
    w.db.admin.execute(&warm_up, &[&w.topic]).await.unwrap();
    kafka::read_at_least(&w.topic, 3, 1, ARRIVAL).await;
    w.wait_drained(&table).await;

    let writer = crate::support::pg::connect(&w.db.admin_url).await;
    writer.batch_execute("SET synchronous_commit = on").await.unwrap();
    let writer_pid: i32 = writer.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    let insert = format!("INSERT INTO {table} (topic, msg_key, payload) VALUES ($1, 'k', 'held')");
    let topic = w.topic.clone();
    let committing = tokio::spawn(async move { writer.execute(&insert, &[&topic]).await });

    let records = kafka::read_at_least(&w.topic, 3, 2, ARRIVAL).await;
    assert_eq!(records[1].payload_str(), "held", "the row is published while its commit is still invisible");
    wait_until("the streamer to wait for the transaction to become visible", ARRIVAL, || async {
        let waiting: bool = root
            .query_one(
                "SELECT count(*) > 0 FROM pg_stat_activity
                 WHERE datname = $1 AND usename = $2 AND query LIKE '%transactionid::text = ANY%'",
                &[&db, &format!("{db}_streamer")],
            )
            .await
            .unwrap()
            .get(0);
        waiting.then_some(())
    })
    .await;
    assert_eq!(w.db.count(&table).await, 0, "the writer's row is not visible yet");
    // Give up waiting for the standby: the transaction becomes visible.
    root.execute("SELECT pg_cancel_backend($1)", &[&writer_pid]).await.unwrap();
    committing.await.unwrap().expect("the insert committed locally");
    // The streamer, waiting for exactly this, may delete the row before we could count it.
    w.wait_drained(&table).await;
    let records = kafka::read_at_least(&w.topic, 3, 2, ARRIVAL).await;
    assert_eq!(records.len(), 2, "each row once");
    assert!(streamer.stop());
}

/// Makes every commit that asks for synchronous replication wait for a standby that does not
/// exist; undone on drop, even when the test fails.
struct NeverAnsweringStandby;

impl NeverAnsweringStandby {
    async fn begin(root: &tokio_postgres::Client) -> Self {
        root.batch_execute("ALTER SYSTEM SET synchronous_standby_names = 'nobody'").await.unwrap();
        root.batch_execute("SELECT pg_reload_conf()").await.unwrap();
        Self
    }
}

impl Drop for NeverAnsweringStandby {
    fn drop(&mut self) {
        std::thread::spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let root = crate::support::pg::connect(&crate::support::env("OUTBOX_PG_URL")).await;
                root.batch_execute("ALTER SYSTEM RESET synchronous_standby_names")
                    .await
                    .expect("resetting synchronous_standby_names");
                root.batch_execute("SELECT pg_reload_conf()").await.expect("reloading the configuration");
            })
        })
        .join()
        .expect("reset thread");
    }
}

/// Large rows with a small in-flight budget: 60 rows of 800 kB, `max_in_flight_bytes` = 2 MB.
/// The budget bounds what is produced and not yet acknowledged; polling also lowers its rows
/// per read to what the budget holds (before, it read 60 rows — 48 MB — at once). The peak is
/// printed for docs/benchmarks.md and checked only against a generous bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_rows_stay_within_the_in_flight_budget() {
    for (name, mode) in [("lr", ""), ("lrp", "mode = \"polling\"")] {
        let extra = format!("max_in_flight_bytes = 2000000\n{mode}");
        let w = World::postgres(name).config(&extra).build().await;
        let table = w.table(0, 0);
        // Incompressible, so neither lz4 nor the database can shrink it.
        w.db.admin
            .execute(
                &format!(
                    "INSERT INTO {table} (topic, payload)
                     SELECT $1, (SELECT string_agg(md5(i::text || '-' || j::text), '')::bytea FROM generate_series(1, 25000) j)
                     FROM generate_series(1, 60) i"
                ),
                &[&w.topic as &(dyn ToSql + Sync)],
            )
            .await
            .unwrap();
        let streamer = w.start("streamer.log");
        let (records, distinct) = kafka::count_distinct_ids(&w.topic, 1, 60, ARRIVAL).await;
        w.wait_drained(&table).await;
        let peak = streamer.peak_rss_bytes();
        eprintln!(
            "large rows ({}): 60 x 800 kB, budget 2 MB: {records} records, peak RSS {} MiB",
            if mode.is_empty() { "cdc" } else { "polling" },
            peak / (1 << 20)
        );
        assert_eq!(distinct, 60);
        assert!(peak < 200 * (1 << 20), "peak RSS {} MiB", peak / (1 << 20));
        assert!(streamer.stop());
    }
}
