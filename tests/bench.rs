//! `outbox-streamer bench --quick` leaves nothing behind — no topic, no config or log in the
//! current or temporary directory — says that it ignores `--config`, and names the other
//! databases whose work its "DB CPU s/1k" includes.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::support::streamer::{bin, scratch};
use crate::support::{kafka, pg, shared_services, unique, wait_until};

/// Topics whose names start with `prefix`.
fn topics_starting_with(prefix: &str) -> Vec<String> {
    let consumer: BaseConsumer = ClientConfig::new().set("bootstrap.servers", kafka::brokers()).create().unwrap();
    let metadata = consumer.fetch_metadata(None, Duration::from_secs(10)).expect("Kafka metadata");
    metadata.topics().iter().map(|t| t.name().to_string()).filter(|t| t.starts_with(prefix)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_leaves_nothing_behind_and_names_other_active_databases() {
    let _services = shared_services().await;
    let cwd = scratch(&unique("bench-cwd"));
    // Another database at work for the whole run.
    let other = pg::fresh_db().await;
    let other_db = other.admin_url.rsplit('/').next().unwrap().to_string();
    other.admin.batch_execute("CREATE TABLE work (n int)").await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                other.admin.batch_execute("INSERT INTO work VALUES (1)").await.unwrap();
            }
        })
    };

    let child = Command::new(bin())
        .current_dir(&cwd)
        .args(["--config", "/nonexistent/outbox-streamer.toml", "bench", "--quick"])
        .env_remove("OUTBOX_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await.unwrap().unwrap();
    stop.store(true, Ordering::Relaxed);
    busy.await.unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "bench --quick failed:\n{stdout}\n{stderr}");
    assert!(stderr.contains("note: bench ignores --config and OUTBOX_CONFIG"), "{stderr}");
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
    wait_until("the bench topic to be deleted", Duration::from_secs(30), || async {
        topics_starting_with(&topic_prefix).is_empty().then_some(())
    })
    .await;
}
