//! The log says what was committed: every committed insert is published unless this stream
//! already published it, whatever happened to the row in the table since — a `TRUNCATE`, an
//! application `DELETE`, an insert and delete in one transaction — and however fast.

use std::time::Duration;

use mysql_async::prelude::Queryable;

use crate::support::kafka;
use crate::support::world::World;

const ARRIVAL: Duration = Duration::from_secs(120);
const ROWS: usize = 2_000;

fn payloads(records: &[kafka::Record]) -> Vec<String> {
    records.iter().map(kafka::Record::payload_str).collect()
}

/// Rows committed before the start and truncated right after it are all published (before,
/// those the replay check reached after the TRUNCATE were taken as "already published").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_deleted_by_others_are_still_published() {
    let w = World::postgres("lt").build().await;
    let table = w.table(0, 0);
    w.db.admin
        .execute(
            &format!("INSERT INTO {table} (topic, payload) SELECT $1, convert_to('p' || i, 'UTF8') FROM generate_series(0, {}) i", ROWS - 1),
            &[&w.topic],
        )
        .await
        .unwrap();
    let streamer = w.start("streamer.log");
    w.db.admin.batch_execute(&format!("TRUNCATE {table}")).await.unwrap();
    // An insert and a delete in one transaction (the Debezium pattern), and an insert then an
    // update: the log holds the inserted values, and they are what is published.
    w.db.admin
        .batch_execute(&format!(
            "BEGIN;
             INSERT INTO {table} (topic, payload) VALUES ('{t}', 'inserted-and-deleted');
             DELETE FROM {table} WHERE payload = 'inserted-and-deleted';
             COMMIT;
             BEGIN;
             INSERT INTO {table} (topic, payload) VALUES ('{t}', 'as-inserted');
             UPDATE {table} SET payload = 'as-updated' WHERE payload = 'as-inserted';
             COMMIT;",
            t = w.topic
        ))
        .await
        .unwrap();
    let records = kafka::read_distinct(&w.topic, 1, ROWS + 2, ARRIVAL).await;
    let got = payloads(&records);
    let mut expected: Vec<String> = (0..ROWS).map(|i| format!("p{i}")).collect();
    expected.extend(["inserted-and-deleted".to_string(), "as-inserted".to_string()]);
    assert_eq!(got, expected, "every committed insert once, in commit order, with its inserted values");
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

/// A slot that replays from an older position (here rewound by hand; in life a crash before
/// the status update reached the server, or a server restart) sends nothing this stream had
/// already published: the published-up-to mark stored with each delete decides, not the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_rewound_slot_resends_nothing_already_published() {
    let w = World::postgres("lw").build().await;
    let table = w.table(0, 0);
    let slot = table.clone();
    let old = format!("{slot}_old");
    w.db.admin.query_one("SELECT pg_copy_logical_replication_slot($1, $2)", &[&slot, &old]).await.unwrap();
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, convert_to($2, 'UTF8'))");
    for i in 0..50 {
        w.db.admin.execute(&insert, &[&w.topic, &format!("p{i}")]).await.unwrap();
    }
    let first = w.start("first.log");
    kafka::read_at_least(&w.topic, 1, 50, ARRIVAL).await;
    w.wait_drained(&table).await;
    assert!(first.stop());
    // Rewind: the slot again stands before the 50 published transactions.
    w.db.admin.query_one("SELECT pg_drop_replication_slot($1)", &[&slot]).await.unwrap();
    w.db.admin.query_one("SELECT pg_copy_logical_replication_slot($1, $2)", &[&old, &slot]).await.unwrap();
    w.db.admin.query_one("SELECT pg_drop_replication_slot($1)", &[&old]).await.unwrap();
    w.db.admin.execute(&insert, &[&w.topic, &"p50"]).await.unwrap();
    let second = w.start("second.log");
    let records = kafka::read_at_least(&w.topic, 1, 51, ARRIVAL).await;
    assert_eq!(payloads(&records), (0..51).map(|i| format!("p{i}")).collect::<Vec<_>>(), "none twice");
    let log = second.wait_for_log("replay done", ARRIVAL).await;
    assert!(log.contains("skipped=50"), "{log}");
    assert!(second.stop());
}

/// The same rule on MariaDB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_rows_deleted_by_others_are_still_published() {
    let w = World::mysql("mlt").build().await;
    let mut admin = w.admin().await;
    let table = w.table(0, 0);
    admin
        .exec_drop(
            format!("INSERT INTO {table} (topic, payload) SELECT ?, CONCAT('p', seq) FROM seq_0_to_{}", ROWS - 1),
            (&w.topic,),
        )
        .await
        .unwrap();
    let streamer = w.start("streamer.log");
    admin.query_drop(format!("TRUNCATE {table}")).await.unwrap();
    admin
        .query_drop(format!(
            "BEGIN;
             INSERT INTO {table} (topic, payload) VALUES ('{t}', 'inserted-and-deleted');
             DELETE FROM {table} WHERE payload = 'inserted-and-deleted';
             COMMIT;
             BEGIN;
             INSERT INTO {table} (topic, payload) VALUES ('{t}', 'as-inserted');
             UPDATE {table} SET payload = 'as-updated' WHERE payload = 'as-inserted';
             COMMIT;",
            t = w.topic
        ))
        .await
        .unwrap();
    // TRUNCATE resets MariaDB's AUTO_INCREMENT: the two rows after it reuse ids 1 and 2, so
    // records are counted, not rows by id (see docs/operations.md on TRUNCATE).
    let records = kafka::read_at_least(&w.topic, 1, ROWS + 2, ARRIVAL).await;
    let mut expected: Vec<String> = (0..ROWS).map(|i| format!("p{i}")).collect();
    expected.extend(["inserted-and-deleted".to_string(), "as-inserted".to_string()]);
    assert_eq!(payloads(&records), expected);
    w.wait_drained(&w.table(0, 0)).await;
    assert!(streamer.stop());
    admin.disconnect().await.unwrap();
}

/// A delete that fails after Kafka acknowledged its rows (here: the row is locked, and the
/// streamer's database session is cut while it waits) does not publish the rows again: the
/// next session finishes the acknowledged prefix before it reads anything. Before, every
/// failed cleanup re-sent what was pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failed_delete_does_not_publish_again() {
    let w = World::postgres("lf").config("cleanup_interval_ms = 3000").build().await;
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, convert_to($2, 'UTF8')) RETURNING id");
    let id: i64 = w.db.admin.query_one(&insert, &[&w.topic, &"locked"]).await.unwrap().get(0);
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    // Hold the row's lock before the (slow) cleanup comes; then cut the session it waits in.
    let locker = crate::support::pg::connect(&w.db.admin_url).await;
    locker.batch_execute("BEGIN").await.unwrap();
    locker.execute(&format!("SELECT 1 FROM {table} WHERE id = $1 FOR UPDATE"), &[&id]).await.unwrap();
    let role = w.db.streamer_url.split("//").nth(1).and_then(|u| u.split(':').next()).unwrap().to_string();
    let pid: i32 = crate::support::wait_until("the cleanup to wait for the row lock", ARRIVAL, || async {
        let row =
            w.db.admin
                .query_opt("SELECT pid FROM pg_stat_activity WHERE usename = $1 AND wait_event_type = 'Lock'", &[&role])
                .await
                .unwrap();
        row.map(|r| r.get::<_, i32>(0))
    })
    .await;
    w.db.admin.execute("SELECT pg_terminate_backend($1)", &[&pid]).await.unwrap();
    streamer.wait_for_metric("outbox_errors_total", &[("kind", "source")], 1.0, ARRIVAL).await;
    locker.batch_execute("COMMIT").await.unwrap();
    w.wait_drained(&table).await;
    w.db.admin.query_one(&insert, &[&w.topic, &"after"]).await.unwrap();
    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(payloads(&records), ["locked", "after"], "the acknowledged row is not published again");
    streamer.wait_for_log("finished the acknowledged rows the last session could not delete", ARRIVAL).await;
    assert!(streamer.stop());
}
