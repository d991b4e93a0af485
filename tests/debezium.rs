//! `layout = "debezium"`: a Debezium outbox event router table read as it is — topic
//! `outbox.event.<aggregatetype>`, key `aggregateid`, value `payload`, the event id and type as
//! headers — with rows inserted the way Debezium's documentation shows, in
//! transactions of which some roll back, in CDC and polling mode. Rows are identified by an
//! integer `id` here; the event id (a uuid, Debezium's `id`) travels in its own column.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::polling::POLLING;
use crate::support::database::Database;
use crate::support::kafka;
use crate::support::world::{World, WorldBuilder};

const ARRIVAL: Duration = Duration::from_secs(120);
const ROWS: i64 = 60;

const MAPPING: &str = r#"layout = "debezium"
[source.columns]
header_columns = { id = "event_id", type = "type" }"#;

const PG_TABLE: &str = "CREATE TABLE {prefix}_0_0 (
    id bigserial PRIMARY KEY,
    event_id uuid NOT NULL DEFAULT gen_random_uuid(),
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    payload jsonb)";
const MY_TABLE: &str = "CREATE TABLE {prefix}_0_0 (
    id BIGINT AUTO_INCREMENT PRIMARY KEY,
    event_id CHAR(36) NOT NULL,
    aggregatetype VARCHAR(255) NOT NULL,
    aggregateid VARCHAR(255) NOT NULL,
    type VARCHAR(255) NOT NULL,
    payload JSON)";

/// The INSERT of the Debezium documentation (uuid event id, JSON payload `{"n": n}`).
fn insert<D: Database>(table: &str, aggregatetype: &str, aggregateid: &str, n: i64) -> String {
    if D::KIND == "postgres" {
        format!(
            "INSERT INTO {table} (aggregatetype, aggregateid, type, payload) \
             VALUES ('{aggregatetype}', '{aggregateid}', 'OrderCreated', jsonb_build_object('n', {n}))"
        )
    } else {
        format!(
            "INSERT INTO {table} (event_id, aggregatetype, aggregateid, type, payload) \
             VALUES (UUID(), '{aggregatetype}', '{aggregateid}', 'OrderCreated', JSON_OBJECT('n', {n}))"
        )
    }
}

/// The `n` of a record's JSON payload `{"n": n}`.
fn n_of(r: &kafka::Record) -> i64 {
    let value = r.payload_str();
    value
        .split("\"n\":")
        .nth(1)
        .and_then(|rest| rest.trim().trim_end_matches('}').trim().parse().ok())
        .unwrap_or_else(|| panic!("the payload is the row's JSON: {value}"))
}

async fn debezium_rows_arrive<D: Database>(builder: WorldBuilder<D>, create: &str) {
    let w = builder.source_keys(MAPPING).before_setup(create).build().await;
    let named = create.split_whitespace().nth(2).expect("CREATE TABLE <name>").to_string();
    let table = named.replace("{prefix}", &w.prefix);
    let topic = format!("outbox.event.{}", w.topic);
    kafka::create_topic(&topic, 1).await;
    let streamer = w.start("streamer.log");
    let mut conn = w.db.connect().await;
    let mut want = BTreeSet::new();
    for n in 0..ROWS {
        // Transactions of three rows; every fourth rolls back.
        if n % 3 == 0 {
            D::execute(&mut conn, "BEGIN").await;
        }
        D::execute(&mut conn, &insert::<D>(&table, &w.topic, &format!("order-{}", n % 5), n)).await;
        if n % 3 == 2 {
            let rolled_back = (n / 3) % 4 == 3;
            D::execute(&mut conn, if rolled_back { "ROLLBACK" } else { "COMMIT" }).await;
            if !rolled_back {
                want.extend(n - 2..=n);
            }
        }
    }
    let records = kafka::read_at_least(&topic, 1, want.len(), ARRIVAL).await;
    let mut seen = BTreeSet::new();
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in &records {
        let n = n_of(r);
        assert!(seen.insert(n), "row {n} arrived twice");
        assert_eq!(r.key_str(), format!("order-{}", n % 5), "key of {n}");
        assert_eq!(r.header("type"), "OrderCreated");
        assert_eq!(r.header("id").len(), 36, "the event id, a uuid: {:?}", r.headers);
        per_key.entry(r.key_str()).or_default().push(n);
    }
    assert_eq!(seen, want, "the committed rows, none rolled back");
    for (key, ns) in per_key {
        assert!(ns.windows(2).all(|p| p[0] < p[1]), "{key}: out of commit order: {ns:?}");
    }
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cdc_reads_a_debezium_outbox_table() {
    debezium_rows_arrive(World::postgres("dzp"), PG_TABLE).await;
}

/// `table` names the application's own table (here `<prefix>_outbox`) instead of
/// `<prefix>_0_0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_cdc_reads_a_debezium_table_by_its_own_name() {
    let builder = World::mysql("dzmt").source_keys("table = \"{prefix}_outbox\"");
    debezium_rows_arrive(builder, &MY_TABLE.replace("{prefix}_0_0", "{prefix}_outbox")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_polling_reads_a_debezium_outbox_table() {
    debezium_rows_arrive(World::postgres("dzpp").config(POLLING), PG_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_cdc_reads_a_debezium_outbox_table() {
    debezium_rows_arrive(World::mysql("dzm"), MY_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_polling_reads_a_debezium_outbox_table() {
    debezium_rows_arrive(World::mysql("dzmp").config(POLLING), MY_TABLE).await;
}

/// Two writers, each with its own keys, commit (and roll back) concurrently while the streamer
/// is SIGKILLed and started again: every committed row arrives (copies of the at-least-once
/// window allowed), none rolled back, and per key the first deliveries keep commit order.
async fn concurrent_writers_and_a_kill<D: Database>(builder: WorldBuilder<D>, create: &str) {
    let w = builder.source_keys(MAPPING).before_setup(create).build().await;
    let table = format!("{}_0_0", w.prefix);
    let topic = format!("outbox.event.{}", w.topic);
    kafka::create_topic(&topic, 1).await;
    let first = w.start("first.log");
    const PER_WRITER: i64 = 300;
    let mut writers = Vec::new();
    for writer in 0..2i64 {
        let (mut conn, table, aggregate) = (w.db.connect().await, table.clone(), w.topic.clone());
        writers.push(tokio::spawn(async move {
            let mut committed = Vec::new();
            for t in 0..PER_WRITER / 3 {
                D::execute(&mut conn, "BEGIN").await;
                let ns: Vec<i64> = (0..3).map(|i| writer * 100_000 + t * 3 + i).collect();
                for n in &ns {
                    D::execute(&mut conn, &insert::<D>(&table, &aggregate, &format!("w{writer}-{}", n % 4), *n)).await;
                }
                let rolled_back = t % 5 == 4;
                D::execute(&mut conn, if rolled_back { "ROLLBACK" } else { "COMMIT" }).await;
                if !rolled_back {
                    committed.extend(ns);
                }
            }
            committed
        }));
    }
    kafka::read_at_least(&topic, 1, 20, ARRIVAL).await;
    first.kill();
    let mut want = BTreeSet::new();
    for writer in writers {
        want.extend(writer.await.expect("writer"));
    }
    let second = w.start("second.log");
    let records = kafka::read_distinct(&topic, 1, want.len(), ARRIVAL).await;
    let mut firsts = BTreeSet::new();
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in &records {
        if firsts.insert(r.header("outbox-id").to_string()) {
            per_key.entry(r.key_str()).or_default().push(n_of(r));
        }
    }
    let seen: BTreeSet<i64> = per_key.values().flatten().copied().collect();
    assert_eq!(seen, want, "every committed row, none rolled back");
    for (key, ns) in per_key {
        assert!(ns.windows(2).all(|p| p[0] < p[1]), "{key}: first deliveries out of commit order: {ns:?}");
    }
    w.wait_drained(&table).await;
    assert!(second.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_concurrent_writers_and_a_kill_lose_no_debezium_row() {
    concurrent_writers_and_a_kill(World::postgres("dzpk"), PG_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_concurrent_writers_and_a_kill_lose_no_debezium_row() {
    concurrent_writers_and_a_kill(World::mysql("dzmk"), MY_TABLE).await;
}
