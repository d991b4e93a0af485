//! `/healthz` and `/readyz` on the metrics address, against a real streamer.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio_postgres::types::ToSql;

use crate::support::streamer::Running;
use crate::support::world::World;
use crate::support::{kafka, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);

/// (status code, body) of `GET path`.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    try_get(addr, path).await.unwrap_or_else(|| panic!("no answer to GET {path} from {addr}"))
}

use crate::support::metrics::try_get_any as try_get;

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// Not ready while a shard-partition is halted (with the reason shown) unless
/// `ready_when_halted`, and never while one keeps retrying (here: its slot held by another
/// instance).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_tells_streaming_from_halted_and_retrying() {
    let w = World::postgres("hz").shards(2).build().await;
    let (t0, t1) = (w.table(0, 0), w.table(1, 0));
    w.db.admin.batch_execute(&format!("ALTER TABLE {t0} ALTER COLUMN topic DROP NOT NULL")).await.unwrap();
    let addr = free_addr();
    let first =
        Running::start_with_env(&w.config, &w.dir.join("first.log"), &[("OUTBOX_METRICS_LISTEN", addr.to_string())]);
    let bad: i64 =
        w.db.admin
            .query_one(&format!("INSERT INTO {t0} (topic, payload) VALUES (NULL, 'bad') RETURNING id"), &[])
            .await
            .unwrap()
            .get(0);
    let insert = format!("INSERT INTO {t1} (topic, payload) VALUES ($1, 'fine')");
    w.db.admin.execute(&insert, &[&w.topic as &(dyn ToSql + Sync)]).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    first.wait_for_state("halted", ARRIVAL).await;

    assert_eq!(get(addr, "/healthz").await, (200, "ok\n".to_string()));
    let both = || async {
        let (status, body) = get(addr, "/readyz").await;
        (body.contains(&format!("{t1}: streaming")) && body.contains(&format!("{t0}: halted")))
            .then_some((status, body))
    };
    let (status, body) = wait_until("/readyz to show both shard-partitions", ARRIVAL, both).await;
    assert_eq!(status, 503, "a halt is not ready:\n{body}");
    assert!(body.contains(&format!("row id={bad}")), "the halt's reason names the row:\n{body}");
    let (status, metrics) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(metrics.contains("outbox_stream_state"), "/metrics is the Prometheus text");
    assert!(first.stop());

    // With ready_when_halted the same halt (the row is still there) is ready.
    let text = std::fs::read_to_string(&w.config).unwrap() + "\n[metrics]\nready_when_halted = true\n";
    let lenient = w.dir.join("ready-when-halted.toml");
    std::fs::write(&lenient, text).unwrap();
    let first =
        Running::start_with_env(&lenient, &w.dir.join("lenient.log"), &[("OUTBOX_METRICS_LISTEN", addr.to_string())]);
    first.wait_for_state("halted", ARRIVAL).await;
    let (status, body) = wait_until("/readyz to show both shard-partitions again", ARRIVAL, both).await;
    assert_eq!(status, 200, "ready_when_halted: a halt with its reason is ready:\n{body}");

    // A second instance without coordination finds both slots held: it retries, not ready.
    let second_addr = free_addr();
    let second = Running::start_with_env(
        &lenient,
        &w.dir.join("second.log"),
        &[("OUTBOX_METRICS_LISTEN", second_addr.to_string())],
    );
    let body = wait_until("the second instance's /readyz to answer 503", ARRIVAL, || async {
        match tokio::net::TcpStream::connect(second_addr).await {
            Ok(_) => {
                let (status, body) = get(second_addr, "/readyz").await;
                (status == 503 && body.contains(&format!("{t1}: retrying"))).then_some(body)
            }
            Err(_) => None,
        }
    })
    .await;
    assert!(body.contains("in use by another session"), "the reason is shown:\n{body}");
    assert!(second.stop() && first.stop(), "both exit 0 on SIGTERM");
}

/// The streamer role's password appears nowhere: not in the debug log of a working streamer,
/// not in `status` (table or JSON), `/metrics` or `/readyz`, and not in the errors of a
/// connection refused for a wrong password or of an unparsable URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_appears_in_logs_status_metrics_or_errors() {
    let w = World::postgres("sec").build().await;
    let password =
        w.db.streamer_url.split(':').nth(2).and_then(|s| s.split('@').next()).expect("a password in the URL");
    assert!(password.len() >= 8, "a password distinctive enough to grep for: {password}");
    let table = w.table(0, 0);
    let addr = free_addr();
    let streamer =
        Running::start_with_env(&w.config, &w.dir.join("streamer.log"), &[("OUTBOX_METRICS_LISTEN", addr.to_string())]);
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, 'x')");
    w.db.admin.execute(&insert, &[&w.topic as &(dyn ToSql + Sync)]).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    let mut seen = vec![get(addr, "/metrics").await.1, get(addr, "/readyz").await.1];
    for args in [&["status"][..], &["status", "--json"][..]] {
        let (_, out, err) = crate::support::streamer::run_cli(&w.config, args);
        seen.extend([out, err]);
    }
    let log = streamer.log.clone();
    assert!(streamer.stop());
    seen.push(std::fs::read_to_string(log).unwrap());

    // The same config with a wrong password, then with a URL that cannot be parsed.
    let good = std::fs::read_to_string(&w.config).unwrap();
    let wrong = good.replace(password, &format!("{password}-wrong"));
    let broken = good.replace(&format!(":{password}@"), &format!(":{password}@@:x:"));
    for (name, text) in [("wrong-password.toml", wrong), ("broken-url.toml", broken)] {
        let path = w.dir.join(name);
        std::fs::write(&path, text).unwrap();
        let (ok, out, err) = crate::support::streamer::run_cli(&path, &["status"]);
        assert!(!ok, "{name}: status must fail");
        assert!(!err.is_empty(), "{name}: the failure is explained");
        seen.extend([out, err]);
        // `run` halts on a refused login (one ERROR) and stops at once on a URL it cannot parse.
        let failing = Running::start(&path, &w.dir.join(format!("{name}.log")));
        let log = wait_until(&format!("{name}: the failure in the log"), ARRIVAL, || async {
            let log = failing.log_text();
            (log.contains("WARN") || log.contains("ERROR") || log.contains("rror")).then_some(log)
        })
        .await;
        seen.push(log);
        drop(failing);
    }
    for (i, text) in seen.iter().enumerate() {
        assert!(!text.contains(password), "output #{i} shows the password:\n{text}");
    }
}

/// Right after start, with no traffic yet, `/metrics` lists every shard-partition's counters
/// at 0 (errors once per kind), so dashboards and `rate()` alerts work before the first message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_list_every_shard_partition_at_zero_before_any_message() {
    let w = World::postgres("mz").shards(2).partitions(2).build().await;
    let addr = free_addr();
    let streamer =
        Running::start_with_env(&w.config, &w.dir.join("streamer.log"), &[("OUTBOX_METRICS_LISTEN", addr.to_string())]);
    let mut expected = Vec::new();
    for (shard, partition) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        let labels = format!("source=\"test\",shard=\"{shard}\",partition=\"{partition}\"");
        for name in [
            "outbox_published_records_total",
            "outbox_deleted_rows_total",
            "outbox_dead_lettered_records_total",
            "outbox_catchups_total",
            "outbox_in_flight_records",
        ] {
            expected.push(format!("{name}{{{labels}}} 0"));
        }
        for kind in ["source", "kafka_transient", "kafka_definite", "bad_row"] {
            expected.push(format!("outbox_errors_total{{{labels},kind=\"{kind}\"}} 0"));
        }
    }
    let body = wait_until("every shard-partition's series at 0 on /metrics", ARRIVAL, || async {
        let (_, body) = try_get(addr, "/metrics").await?;
        expected.iter().all(|line| body.lines().any(|l| l == line)).then_some(body)
    })
    .await;
    assert!(body.contains("outbox_stream_state{"), "{body}");
    assert!(streamer.stop());
}

/// Clients that connect and say nothing cannot exhaust the process's file descriptors or
/// its CPU: beyond 64 connections the longest-waiting ones are closed at once, a scrape is
/// still answered promptly, silent connections are closed after the 5 s head deadline, and
/// the streamer keeps streaming. The streamer runs with fewer file descriptors than the
/// test opens connections, so an unbounded listener runs out and `accept` fails (EMFILE).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_bounded_in_number_and_time() {
    const SILENT: usize = 300;
    const CAP: usize = 64;
    let w = World::postgres("hf").build().await;
    let table = w.table(0, 0);
    let addr = free_addr();
    let env = [("OUTBOX_METRICS_LISTEN", addr.to_string())];
    let streamer = Running::start_with_nofile(&w.config, &w.dir.join("streamer.log"), &env, 256);
    streamer.wait_for_state("streaming", ARRIVAL).await;
    wait_until("/healthz to answer", ARRIVAL, || async { try_get(addr, "/healthz").await }).await;

    let (cpu_before, started) = (streamer.cpu_time(), Instant::now());
    let mut silent = Vec::new();
    for _ in 0..SILENT {
        silent.push(tokio::net::TcpStream::connect(addr).await.expect("the kernel queues the connection"));
    }
    wait_until(&format!("at most {CAP} silent connections left open"), Duration::from_secs(5), || {
        let open = still_open(&mut silent);
        async move { (open <= CAP).then_some(()) }
    })
    .await;
    let asked = Instant::now();
    let (status, body) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(body.contains("outbox_stream_state"));
    assert!(asked.elapsed() < Duration::from_secs(2), "a scrape waited {:?}", asked.elapsed());
    wait_until("every silent connection closed after the head deadline", Duration::from_secs(20), || {
        let open = still_open(&mut silent);
        async move { (open == 0).then_some(()) }
    })
    .await;
    let (cpu, wall) = (streamer.cpu_time() - cpu_before, started.elapsed());
    assert!(cpu < wall / 2, "the streamer spun: {cpu:?} of CPU in {wall:?}");

    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, 'after the flood')");
    w.db.admin.execute(&insert, &[&w.topic as &(dyn ToSql + Sync)]).await.unwrap();
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    w.wait_drained(&table).await;
    assert!(!streamer.log_text().contains("ERROR"), "{}", streamer.log_text());
    assert!(streamer.stop());
}

/// Drops the connections the server has closed; returns how many are still open.
fn still_open(conns: &mut Vec<tokio::net::TcpStream>) -> usize {
    conns.retain(|c| matches!(c.try_read(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock));
    conns.len()
}
