//! `outbox-bench --quick` against the real services, with the `outbox-streamer` binary beside
//! it (`cargo test --workspace` builds both): it passes, leaves nothing behind — no topic, no
//! config or log in the current or temporary directory — is not confused by an `OUTBOX_CONFIG`
//! in its environment, and names the other databases whose work its "DB CPU s/1k" includes.
//!
//! Start the services with `scripts/services up && eval "$(scripts/services env)"`, or run
//! everything with `scripts/test`. A missing service fails the test with that instruction.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use tokio_postgres::{Client, NoTls};

const HOW_TO_START: &str = "start the services with `scripts/services up && eval \"$(scripts/services env)\"`, or run every test with `scripts/test`";

fn service(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: {HOW_TO_START}"))
}

async fn postgres(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url}: {e}; {HOW_TO_START}"));
    tokio::spawn(connection);
    client
}

/// Topics whose names start with `prefix`.
fn topics_starting_with(prefix: &str) -> Vec<String> {
    let consumer: BaseConsumer =
        ClientConfig::new().set("bootstrap.servers", service("OUTBOX_KAFKA_BROKERS")).create().unwrap();
    let metadata = consumer.fetch_metadata(None, Duration::from_secs(10)).expect("Kafka metadata");
    metadata.topics().iter().map(|t| t.name().to_string()).filter(|t| t.starts_with(prefix)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_run_passes_leaves_nothing_behind_and_names_other_active_databases() {
    let root_url = service("OUTBOX_PG_URL");
    let root = postgres(&root_url).await;
    // Another database at work for the whole run.
    let other_db = format!("bench_test_other_{}", std::process::id());
    // One statement per call: CREATE DATABASE refuses a transaction block.
    root.batch_execute(&format!("DROP DATABASE IF EXISTS {other_db}")).await.unwrap();
    root.batch_execute(&format!("CREATE DATABASE {other_db}")).await.unwrap();
    let (base, _) = root_url.rsplit_once('/').expect("OUTBOX_PG_URL ends with /database");
    let other = postgres(&format!("{base}/{other_db}")).await;
    other.batch_execute("CREATE TABLE work (n int)").await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                other.batch_execute("INSERT INTO work VALUES (1)").await.unwrap();
            }
        })
    };

    let cwd = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("bench-cwd-{}", std::process::id()));
    std::fs::create_dir_all(&cwd).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_outbox-bench"))
        .current_dir(&cwd)
        .arg("--quick")
        .env("OUTBOX_CONFIG", "/nonexistent/outbox-streamer.toml")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await.unwrap().unwrap();
    stop.store(true, Ordering::Relaxed);
    busy.await.unwrap();
    root.batch_execute(&format!("DROP DATABASE {other_db} WITH (FORCE)")).await.unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "outbox-bench --quick failed:\n{stdout}\n{stderr}");
    assert!(stderr.contains("streamer under test: "), "{stderr}");
    assert!(stdout.contains("other databases were active during the run ("), "{stdout}");
    assert!(stdout.contains(&format!("{other_db} (")), "the busy database is named:\n{stdout}");

    let left: Vec<_> = std::fs::read_dir(&cwd).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "nothing is written to the current directory: {left:?}");
    let private = format!("outbox-bench-{pid}-");
    let temp: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&private))
        .map(|e| e.path())
        .collect();
    assert!(temp.is_empty(), "the private directory is removed: {temp:?}");
    let topic_prefix = format!("bench{pid}-");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !topics_starting_with(&topic_prefix).is_empty() {
        assert!(Instant::now() < deadline, "the bench topic {topic_prefix}… is still there after 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
