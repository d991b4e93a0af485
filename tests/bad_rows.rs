//! Rows that cannot be published as the log holds them. The fix a halt suggests must work:
//! a row fixed in the table is published with its current values after a restart, a row
//! deleted from it is skipped, a restored column clears the halt, `outbox-streamer skip`
//! discards what the operator says. Under `dead-letter`, a record is judged bad only when it
//! fails alone, and its dead-letter copy carries the whole row.

use std::collections::BTreeSet;
use std::time::Duration;

use mysql_async::prelude::Queryable;
use tokio_postgres::types::ToSql;

use crate::support::kafka;
use crate::support::pg::PgDb;
use crate::support::streamer::run_cli;
use crate::support::world::World;

const ARRIVAL: Duration = Duration::from_secs(120);

fn payloads(records: &[kafka::Record]) -> Vec<String> {
    records.iter().map(kafka::Record::payload_str).collect()
}

async fn insert(w: &World<PgDb>, topic: Option<&str>, payload: &str) -> i64 {
    let sql =
        format!("INSERT INTO {} (topic, payload) VALUES ($1, convert_to($2, 'UTF8')) RETURNING id", w.table(0, 0));
    w.db.admin.query_one(&sql, &[&topic as &(dyn ToSql + Sync), &payload]).await.unwrap().get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_halted_row_fixed_or_deleted_in_the_table_clears_the_halt() {
    let w = World::postgres("bh").build().await;
    let table = w.table(0, 0);
    w.db.admin.batch_execute(&format!("ALTER TABLE {table} ALTER COLUMN topic DROP NOT NULL")).await.unwrap();
    let first = w.start("first.log");
    insert(&w, Some(&w.topic), "a").await;
    let bad = insert(&w, None, "broken").await;
    insert(&w, Some(&w.topic), "b").await;
    let log = first.wait_for_halt(ARRIVAL).await;
    assert!(log.contains(&format!("row id={bad}")) && log.contains(&format!("WHERE \"id\" = {bad}")), "{log}");
    assert!(first.stop());
    // The fix the halt names: correct the row, restart.
    w.db.admin
        .execute(&format!("UPDATE {table} SET topic = $1, payload = 'fixed' WHERE id = $2"), &[&w.topic, &bad])
        .await
        .unwrap();
    let second = w.start("second.log");
    let records = kafka::read_at_least(&w.topic, 1, 3, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "fixed", "b"], "the row's current values, in its place");
    w.wait_drained(&table).await;
    // The other fix: delete the row, restart.
    let bad = insert(&w, None, "broken again").await;
    insert(&w, Some(&w.topic), "c").await;
    let reason = second.wait_for_state("halted", ARRIVAL).await.unwrap_or_default();
    assert!(reason.contains(&format!("row id={bad} of")), "{reason}");
    assert!(second.stop());
    w.db.admin.execute(&format!("DELETE FROM {table} WHERE id = $1"), &[&bad]).await.unwrap();
    let third = w.start("third.log");
    let records = kafka::read_at_least(&w.topic, 1, 4, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "fixed", "b", "c"]);
    let log = third.wait_for_log("no longer in the table; skipped", ARRIVAL).await;
    assert!(!log.contains("ERROR"), "{log}");
    w.wait_drained(&table).await;
    assert!(third.stop());
}

/// A dropped column halts naming it; restoring it, as the message says, clears the halt: the
/// rows logged meanwhile are read from the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_restored_column_clears_the_halt() {
    let w = World::postgres("bc").build().await;
    let table = w.table(0, 0);
    let first = w.start("first.log");
    insert(&w, Some(&w.topic), "a").await;
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    w.db.admin.batch_execute(&format!("ALTER TABLE {table} DROP COLUMN payload")).await.unwrap();
    let orphan: i64 =
        w.db.admin
            .query_one(&format!("INSERT INTO {table} (topic) VALUES ($1) RETURNING id"), &[&w.topic])
            .await
            .unwrap()
            .get(0);
    let log = first.wait_for_halt(ARRIVAL).await;
    assert!(log.contains("payload") && log.contains("restore the column"), "{log}");
    assert!(first.stop());
    w.db.admin.batch_execute(&format!("ALTER TABLE {table} ADD COLUMN payload bytea")).await.unwrap();
    let second = w.start("second.log");
    insert(&w, Some(&w.topic), "b").await;
    let records = kafka::read_at_least(&w.topic, 1, 3, ARRIVAL).await;
    assert_eq!(records[1].header("outbox-id"), orphan.to_string());
    assert_eq!(records[1].payload, None, "the restored column's value");
    assert_eq!(records[2].payload_str(), "b");
    w.wait_drained(&table).await;
    assert!(second.stop());
}

/// `skip --id` discards a halted row; `skip --backlog` discards everything committed so far;
/// both are refused while the stream runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_skip_discards_a_row_and_a_backlog_but_never_while_streaming() {
    let w = World::postgres("bs").build().await;
    let table = w.table(0, 0);
    w.db.admin.batch_execute(&format!("ALTER TABLE {table} ALTER COLUMN topic DROP NOT NULL")).await.unwrap();
    let first = w.start("first.log");
    insert(&w, Some(&w.topic), "a").await;
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    let (ok, _, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--id", "1"]);
    assert!(!ok && err.contains("the stream is running"), "{err}");
    let bad = insert(&w, None, "poison").await;
    insert(&w, Some(&w.topic), "b").await;
    first.wait_for_state("halted", ARRIVAL).await;
    let (ok, out, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--id", &bad.to_string()]);
    assert!(ok && out.contains("deleted from the table"), "{out}\n{err}");
    assert!(first.stop());
    let second = w.start("second.log");
    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "b"]);
    second.wait_for_log("skipped as `outbox-streamer skip` asked", ARRIVAL).await;
    w.wait_drained(&table).await;
    assert!(second.stop());
    for i in 0..10 {
        insert(&w, Some(&w.topic), &format!("old-{i}")).await;
    }
    let (ok, out, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--backlog"]);
    assert!(ok && out.contains("10 rows discarded"), "{out}\n{err}");
    insert(&w, Some(&w.topic), "new").await;
    let third = w.start("third.log");
    let records = kafka::read_at_least(&w.topic, 1, 3, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "b", "new"], "the discarded backlog is not published");
    w.wait_drained(&table).await;
    assert!(third.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_skip_discards_a_halted_row_but_never_while_streaming() {
    let w = World::mysql("mbs").build().await;
    let mut admin = w.admin().await;
    admin.query_drop(format!("ALTER TABLE {} MODIFY topic VARCHAR(249) NULL", w.table(0, 0))).await.unwrap();
    let insert = format!("INSERT INTO {} (topic, payload) VALUES (?, ?)", w.table(0, 0));
    let first = w.start("first.log");
    admin.exec_drop(&insert, (&w.topic, b"a".as_slice())).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    let (ok, _, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--id", "1"]);
    assert!(!ok && err.contains("the stream is running"), "{err}");
    admin.exec_drop(&insert, (None::<String>, b"poison".as_slice())).await.unwrap();
    let bad: Option<i64> = admin.query_first("SELECT LAST_INSERT_ID()").await.unwrap();
    admin.exec_drop(&insert, (&w.topic, b"b".as_slice())).await.unwrap();
    first.wait_for_state("halted", ARRIVAL).await;
    let (ok, out, err) = run_cli(&w.config, &["skip", "--stream", "test/0/0", "--id", &bad.unwrap().to_string()]);
    assert!(ok && out.contains("deleted from the table"), "{out}\n{err}");
    assert!(first.stop());
    let second = w.start("second.log");
    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(payloads(&records), ["a", "b"]);
    w.wait_drained(&w.table(0, 0)).await;
    assert!(second.stop());
    admin.disconnect().await.unwrap();
}

/// A broker refuses a whole batch when it exceeds the topic's `max.message.bytes`, and every
/// record of it reports "too large". Each is sent again alone: the good ones are published,
/// only a row too large on its own is dead-lettered — whole, payload included. Before, every
/// record of the batch was dead-lettered without its payload and deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_batches_are_resent_alone_and_bad_rows_dead_lettered_whole() {
    refused_batches("bb", false).await;
}

/// The same under exactly-once delivery: each refusal aborts its Kafka transaction, the next
/// session sends the rows alone and the dead-letter copy in a clean one; a `read_committed`
/// reader sees every good row once and the copy once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_refused_rows_are_dead_lettered_in_a_clean_transaction() {
    refused_batches("eb", true).await;
}

async fn refused_batches(name: &str, exactly_once: bool) {
    let topic = crate::support::unique(name).replace('_', "-");
    kafka::create_topic_with(&topic, 1, &[("max.message.bytes", "20000")]).await;
    let dlq = crate::support::unique("bbdlq").replace('_', "-");
    kafka::create_topic_with(&dlq, 1, &[("max.message.bytes", "200000")]).await;
    let mut extra = format!("on_bad_row = \"dead-letter\"\ndead_letter_topic = \"{dlq}\"\ncompression = \"none\"");
    if exactly_once {
        extra = format!("{extra}\n{}", crate::postgres_faults::EXACTLY_ONCE);
    }
    let w = World::postgres(name).config(&extra).build().await;
    let table = w.table(0, 0);
    let streamer = w.start("streamer.log");
    // 30 rows of 4 kB, one transaction: together far above 20 kB, each one well below.
    w.db.admin
        .execute(
            &format!(
                "INSERT INTO {table} (topic, payload)
                 SELECT $1, convert_to('r' || lpad(i::text, 2, '0') || ':' || repeat('x', 4000), 'UTF8')
                 FROM generate_series(0, 29) i"
            ),
            &[&topic],
        )
        .await
        .unwrap();
    let big = format!("big:{}", "y".repeat(50_000));
    insert_to(&w, &topic, &big).await;
    insert_to(&w, &topic, "after").await;
    let records = kafka::read_distinct(&topic, 1, 31, ARRIVAL).await;
    let got: BTreeSet<String> =
        records.iter().map(|r| r.payload_str().split(':').next().unwrap_or_default().to_string()).collect();
    let mut expected: BTreeSet<String> = (0..30).map(|i| format!("r{i:02}")).collect();
    expected.insert("after".into());
    assert_eq!(got, expected, "every row of the refused batch is published; only the big one is not");
    if exactly_once {
        assert_eq!(records.len(), 31, "each row once for a read_committed reader");
    }
    let dead = kafka::read_at_least(&dlq, 1, 1, ARRIVAL).await;
    assert_eq!(dead.len(), 1, "only the row too large alone is dead-lettered");
    assert_eq!(dead[0].payload_str(), big, "with its payload");
    assert_eq!(dead[0].header("outbox-original-topic"), topic);
    w.wait_drained(&table).await;
    let log = streamer.log_text();
    assert!(log.contains("accepted alone a row it had refused in a batch"), "{log}");
    assert!(streamer.stop());
}

async fn insert_to(w: &World<PgDb>, topic: &str, payload: &str) {
    let sql = format!("INSERT INTO {} (topic, payload) VALUES ($1, convert_to($2, 'UTF8'))", w.table(0, 0));
    w.db.admin.execute(&sql, &[&topic, &payload]).await.unwrap();
}
