//! `layout = "tw-tkms"`: tw-tkms's `outgoing_message_<shard>_<partition>` tables read as they
//! are. Every message is written by an independent writer with the Java libraries tw-tkms
//! stores with (`tests/tw-tkms-writer`: protobuf-java, snappy-java, zstd-jni, lz4-java,
//! java.util.zip), every compression type, in transactions of which some roll back; each must
//! arrive with its topic, key, partition, timestamp, headers and value, once, in commit order.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::polling::POLLING;
use crate::support::database::Database;
use crate::support::kafka::{self, Record};
use crate::support::streamer::run_cli;
use crate::support::world::{World, WorldBuilder};

const ARRIVAL: Duration = Duration::from_secs(120);
const COMPRESSIONS: [&str; 6] = ["none", "snappy_framed", "snappy", "zstd", "lz4", "gzip"];
/// The writer's transactions hold this many messages; every `ROLLBACK_EVERY`th rolls back.
const PER_TX: u64 = 3;
const ROLLBACK_EVERY: u64 = 4;

/// `scheme://user:password@host:port/db` → the JDBC URL of the same login.
fn jdbc_url(admin_url: &str) -> String {
    let (scheme, rest) = admin_url.split_once("://").expect("scheme://");
    let (auth, hostdb) = rest.rsplit_once('@').expect("user:password@");
    let (user, password) = auth.split_once(':').expect("user:password");
    let driver = if scheme.starts_with("postgres") { "postgresql" } else { "mariadb" };
    format!("jdbc:{driver}://{hostdb}?user={user}&password={password}")
}

/// Writes messages `first..first + count` with tw-tkms's Java libraries into `table`.
fn write_blocking(admin_url: &str, table: &str, first: u64, count: u64, topic: &str) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tw-tkms-writer/run");
    let args = [
        jdbc_url(admin_url),
        table.to_string(),
        first.to_string(),
        count.to_string(),
        PER_TX.to_string(),
        "all".to_string(),
        topic.to_string(),
        ROLLBACK_EVERY.to_string(),
    ];
    let out = Command::new(&script).args(&args).output().expect("running the tw-tkms writer");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the tw-tkms writer failed:\n{text}");
    text
}

async fn write(admin_url: &str, table: &str, first: u64, count: u64, topic: &str) {
    let (url, table, topic) = (admin_url.to_string(), table.to_string(), topic.to_string());
    tokio::task::spawn_blocking(move || write_blocking(&url, &table, first, count, &topic)).await.expect("writer");
}

/// The message numbers the writer commits (its transactions each hold `PER_TX` of them).
fn committed(first: u64, count: u64) -> BTreeSet<u64> {
    (first..first + count).filter(|n| ((n - first) / PER_TX) % ROLLBACK_EVERY != ROLLBACK_EVERY - 1).collect()
}

/// Checks one record against what the writer stored for its message number (see
/// `TkmsWriter.build`), and returns that number.
fn check(r: &Record, topic_partitions: i32) -> u64 {
    let value = r.payload_str();
    let n: u64 = value
        .strip_prefix("payload-")
        .and_then(|rest| rest.split('-').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a writer's value: {value:.40}"));
    assert_eq!(value, format!("payload-{n}-{}", "abcdefgh".repeat(20 + (n % 40) as usize)), "value of {n}");
    let key = (!n.is_multiple_of(11)).then(|| format!("k{}", n % 7));
    assert_eq!(r.key.as_deref(), key.as_ref().map(String::as_bytes), "key of {n}");
    if n.is_multiple_of(3) {
        assert_eq!(r.partition, (n % 2) as i32 % topic_partitions, "explicit partition of {n}");
    }
    if n.is_multiple_of(2) {
        assert_eq!(r.timestamp, Some(1_600_000_000_000 + n as i64), "timestamp of {n}");
    } else {
        assert!(r.timestamp.is_some_and(|t| t > 1_700_000_000_000), "the producer's clock for {n}");
    }
    if !n.is_multiple_of(5) {
        assert_eq!(r.header("n"), n.to_string(), "header n of {n}");
        assert_eq!(r.header("compression"), COMPRESSIONS[(n % 6) as usize], "header compression of {n}");
    } else {
        assert!(!r.headers.contains_key("n"), "no headers stored for {n}");
    }
    assert!(r.header("outbox-id").parse::<i64>().is_ok());
    n
}

/// Every committed message arrived once, none rolled back, and per key and partition in the
/// order they were committed (the writer commits them in number order). Messages without a key
/// have no order to keep: the producer spreads them over the partitions, and after a kill a
/// resent copy may land in another partition than the first.
fn check_all(records: &[Record], want: &BTreeSet<u64>, topic_partitions: i32) {
    let mut sorted = records.to_vec();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut seen = BTreeSet::new();
    let mut per_key: HashMap<(i32, Vec<u8>), Vec<u64>> = HashMap::new();
    for r in &sorted {
        let n = check(r, topic_partitions);
        assert!(seen.insert(n), "message {n} arrived twice");
        if let Some(key) = &r.key {
            per_key.entry((r.partition, key.clone())).or_default().push(n);
        }
    }
    assert_eq!(&seen, want, "exactly the committed messages arrived");
    for (key, ns) in per_key {
        assert!(ns.windows(2).all(|w| w[0] < w[1]), "{key:?}: out of commit order: {ns:?}");
    }
}

/// A world with tw-tkms's table (as its documentation creates it) and `layout = "tw-tkms"`.
fn tw_tkms<D: Database>(builder: WorldBuilder<D>, create: &str) -> WorldBuilder<D> {
    builder.kafka_partitions(2).source_keys("layout = \"tw-tkms\"").before_setup(create)
}

const PG_TABLE: &str = "CREATE TABLE {prefix}_0_0 (id BIGSERIAL PRIMARY KEY, message BYTEA NOT NULL)";
const MY_TABLE: &str =
    "CREATE TABLE {prefix}_0_0 (id BIGINT AUTO_INCREMENT PRIMARY KEY, message MEDIUMBLOB NOT NULL) ENGINE=InnoDB";

async fn every_compression_arrives<D: Database>(w: World<D>) {
    let table = format!("{}_0_0", w.prefix);
    let streamer = w.start("streamer.log");
    write(w.db.admin_url(), &table, 1, 96, &w.topic).await;
    let want = committed(1, 96);
    let records = kafka::read_at_least(&w.topic, 2, want.len(), ARRIVAL).await;
    check_all(&records, &want, 2);
    w.wait_drained(&table).await;
    // A message that cannot be decoded halts the shard-partition naming its row and column.
    let mut admin = w.db.connect().await;
    D::execute(&mut admin, &format!("INSERT INTO {table} (message) VALUES ({})", corrupt::<D>())).await;
    let bad_id = D::query_number(&mut admin, &format!("SELECT max(id) FROM {table}")).await;
    let log = streamer.wait_for_halt(ARRIVAL).await;
    assert!(log.contains(&format!("row id={bad_id} column message")), "{log}");
    assert!(log.contains("does not decompress as gzip"), "{log}");
    assert!(streamer.stop());
}

/// A stored message whose header says gzip and whose body is not.
fn corrupt<D: Database>() -> &'static str {
    if D::KIND == "postgres" { "'\\x000005deadbeef'::bytea" } else { "X'000005DEADBEEF'" }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cdc_reads_tw_tkms_messages_of_every_compression() {
    every_compression_arrives(tw_tkms(World::postgres("tkp"), PG_TABLE).build().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_polling_reads_tw_tkms_messages_of_every_compression() {
    every_compression_arrives(tw_tkms(World::postgres("tkpp"), PG_TABLE).config(POLLING).build().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_cdc_reads_tw_tkms_messages_of_every_compression() {
    every_compression_arrives(tw_tkms(World::mysql("tkm"), MY_TABLE).build().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_polling_reads_tw_tkms_messages_of_every_compression() {
    every_compression_arrives(tw_tkms(World::mysql("tkmp"), MY_TABLE).config(POLLING).build().await).await;
}

/// The migration of docs/drop-in.md: tw-tkms's proxy stopped with a backlog in its table,
/// `setup` run, the streamer started: the backlog and what comes after all arrive, once.
async fn backlog_left_by_the_proxy_is_delivered<D: Database>(builder: WorldBuilder<D>, create: &str) {
    let w = tw_tkms(builder, create)
        .program_before_setup(|url, prefix, topic| {
            write_blocking(&url, &format!("{prefix}_0_0"), 1, 60, &topic);
        })
        .build()
        .await;
    let table = format!("{}_0_0", w.prefix);
    let streamer = w.start("streamer.log");
    write(w.db.admin_url(), &table, 61, 30, &w.topic).await;
    let want = committed(1, 60).into_iter().chain(committed(61, 30)).collect::<BTreeSet<_>>();
    let records = kafka::read_at_least(&w.topic, 2, want.len(), ARRIVAL).await;
    check_all(&records, &want, 2);
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_backlog_left_by_tw_tkms_is_delivered_after_the_switch() {
    backlog_left_by_the_proxy_is_delivered(World::postgres("tkpb"), PG_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_backlog_left_by_tw_tkms_is_delivered_after_the_switch() {
    backlog_left_by_the_proxy_is_delivered(World::mysql("tkmb"), MY_TABLE).await;
}

/// With `on_bad_row = "dead-letter"`, a message that cannot be decoded goes to the dead-letter
/// topic as it is stored (bytes unchanged, the reason naming the row and column) and the
/// messages around it are published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_corrupt_tw_tkms_message_is_dead_lettered_as_stored() {
    let dlq = kafka::fresh_topic("tkdlq", 1).await;
    let w = tw_tkms(World::postgres("tkpd"), PG_TABLE)
        .config(&format!("on_bad_row = \"dead-letter\"\ndead_letter_topic = \"{dlq}\""))
        .build()
        .await;
    let table = format!("{}_0_0", w.prefix);
    let streamer = w.start("streamer.log");
    write(w.db.admin_url(), &table, 1, 12, &w.topic).await;
    w.db.admin
        .batch_execute(&format!("INSERT INTO {table} (message) VALUES ('\\x000005deadbeef'::bytea)"))
        .await
        .unwrap();
    write(w.db.admin_url(), &table, 13, 12, &w.topic).await;
    let want: BTreeSet<u64> = committed(1, 12).into_iter().chain(committed(13, 12)).collect();
    let records = kafka::read_at_least(&w.topic, 2, want.len(), ARRIVAL).await;
    check_all(&records, &want, 2);
    let dead = kafka::read_at_least(&dlq, 1, 1, ARRIVAL).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].payload.as_deref(), Some(&b"\x00\x00\x05\xde\xad\xbe\xef"[..]), "the stored bytes, unchanged");
    let reason = dead[0].header("outbox-dead-letter-reason");
    assert!(reason.contains("column message") && reason.contains("gzip"), "{reason}");
    w.wait_drained(&table).await;
    assert!(streamer.stop());
}

/// Writes messages `1..=count` while a first streamer publishes, kills it once some arrived,
/// starts a second and returns every record once `count`'s committed messages all arrived
/// (by distinct `outbox-id`).
async fn kill_while_writing<D: Database>(w: &World<D>, count: u64) -> Vec<Record> {
    let table = format!("{}_0_0", w.prefix);
    let first = w.start("first.log");
    let writer = {
        let (url, table, topic) = (w.db.admin_url().to_string(), table.clone(), w.topic.clone());
        tokio::task::spawn_blocking(move || write_blocking(&url, &table, 1, count, &topic))
    };
    kafka::read_at_least(&w.topic, 2, 30, ARRIVAL).await;
    first.kill();
    writer.await.expect("writer");
    let second = w.start("second.log");
    let records = kafka::read_distinct(&w.topic, 2, committed(1, count).len(), ARRIVAL).await;
    w.wait_drained(&table).await;
    assert!(second.stop());
    records
}

/// SIGKILL while a tw-tkms writer writes: every committed message arrives (duplicates of the
/// at-least-once window allowed), none rolled back, first deliveries in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_killed_streamer_loses_no_tw_tkms_message() {
    let w = tw_tkms(World::mysql("tkmk"), MY_TABLE).build().await;
    let mut records = kill_while_writing(&w, 3000).await;
    records.sort_by_key(|r| (r.partition, r.offset));
    let mut ids = BTreeSet::new();
    records.retain(|r| ids.insert(r.header("outbox-id").to_string()));
    check_all(&records, &committed(1, 3000), 2);
}

/// `delivery = "exactly-once"` on a tw-tkms table: a streamer killed while the writer writes
/// leaves no message twice for a `read_committed` consumer, and none lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_exactly_once_from_a_tw_tkms_table_survives_a_kill() {
    let w = tw_tkms(World::postgres("tkpe"), PG_TABLE).config(crate::postgres_faults::EXACTLY_ONCE).build().await;
    let records = kill_while_writing(&w, 600).await;
    check_all(&records, &committed(1, 600), 2);
}

/// `setup` never creates a tw-tkms table unless asked: a missing one is named with the
/// statement tw-tkms documents, nothing is created, and `--create-tables` creates it.
async fn setup_checks_the_tables<D: Database>(builder: WorldBuilder<D>, create: &str) {
    let w = tw_tkms(builder, create).build().await;
    w.edit_config(|c| c.replace("shards = 1", "shards = 2"));
    let missing = format!("{}_1_0", w.prefix);
    let (ok, out, err) = run_cli(&w.config, &["setup", "--admin-url", w.db.admin_url()]);
    assert!(!ok, "setup must refuse a missing table:\n{out}\n{err}");
    assert!(err.contains(&format!("table {missing} (layout = \"tw-tkms\") does not exist")), "{err}");
    assert!(err.contains("CREATE TABLE") && err.contains("--create-tables"), "{err}");
    let mut admin = w.db.connect().await;
    let exists = format!(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = '{missing}' AND table_schema = {}",
        if D::KIND == "postgres" { "current_schema()" } else { "DATABASE()" }
    );
    assert_eq!(D::query_number(&mut admin, &exists).await, 0, "nothing was created");
    let (ok, out, err) = run_cli(&w.config, &["setup", "--create-tables", "--admin-url", w.db.admin_url()]);
    assert!(ok, "setup --create-tables:\n{out}\n{err}");
    assert_eq!(D::query_number(&mut admin, &exists).await, 1, "--create-tables created it");
    let streamer = w.start("streamer.log");
    write(w.db.admin_url(), &missing, 1, 12, &w.topic).await;
    let records = kafka::read_at_least(&w.topic, 2, committed(1, 12).len(), ARRIVAL).await;
    check_all(&records, &committed(1, 12), 2);
    let (ok, out, _) = run_cli(&w.config, &["teardown", "--admin-url", w.db.admin_url()]);
    assert!(!ok && out.contains("teardown never drops them"), "teardown refuses a tw-tkms source:\n{out}");
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_setup_checks_tw_tkms_tables_and_creates_them_only_when_asked() {
    setup_checks_the_tables(World::postgres("tkps"), PG_TABLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_setup_checks_tw_tkms_tables_and_creates_them_only_when_asked() {
    setup_checks_the_tables(World::mysql("tkms"), MY_TABLE).await;
}
