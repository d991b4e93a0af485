//! `layout = "debezium"`: a Debezium outbox event router table read as it is — topic
//! `outbox.event.<aggregatetype>`, key `aggregateid`, value `payload`, the event id and type as
//! headers — with rows inserted the way Debezium's documentation shows, by concurrent-free
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

async fn debezium_rows_arrive<D: Database>(builder: WorldBuilder<D>, create: &str) {
    let w = builder.source_keys(MAPPING).before_setup(create).build().await;
    let named = create.split_whitespace().nth(2).expect("CREATE TABLE <name>").to_string();
    let table = named.replace("{prefix}", &w.prefix);
    let topic = format!("outbox.event.{}", w.topic);
    kafka::create_topic(&topic, 1).await;
    let streamer = w.start("streamer.log");
    let mut conn = w.db.connect().await;
    let postgres = D::KIND == "postgres";
    let mut want = BTreeSet::new();
    for n in 0..ROWS {
        // Transactions of three rows; every fourth rolls back.
        if n % 3 == 0 {
            D::execute(&mut conn, "BEGIN").await;
        }
        let insert = if postgres {
            format!(
                "INSERT INTO {table} (aggregatetype, aggregateid, type, payload) \
                 VALUES ('{}', 'order-{}', 'OrderCreated', jsonb_build_object('n', {n}))",
                w.topic,
                n % 5
            )
        } else {
            format!(
                "INSERT INTO {table} (event_id, aggregatetype, aggregateid, type, payload) \
                 VALUES (UUID(), '{}', 'order-{}', 'OrderCreated', JSON_OBJECT('n', {n}))",
                w.topic,
                n % 5
            )
        };
        D::execute(&mut conn, &insert).await;
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
        let value = r.payload_str();
        let n: i64 = value
            .split("\"n\":")
            .nth(1)
            .and_then(|rest| rest.trim().trim_end_matches('}').trim().parse().ok())
            .unwrap_or_else(|| panic!("the payload is the row's JSON: {value}"));
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
