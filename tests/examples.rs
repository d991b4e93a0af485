//! The Python, Java (and, for PostgreSQL, Rust) examples of `examples/`, run against the live services: each enqueues
//! one message inside its own business transaction, and the record arrives in Kafka with the
//! key and the `trace-id` header the program set.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::support::kafka::{self, Record};
use crate::support::pg::PgDb;
use crate::support::world::World;

const ARRIVAL: Duration = Duration::from_secs(120);

/// Runs `examples/<lang>/run <file>` with `env`; panics with its output if it fails.
async fn run_example(lang: &str, file: &str, env: Vec<(&'static str, String)>) -> String {
    run_example_with(lang, &[file], env).await
}

/// Runs `examples/<lang>/run <args…>` (the file, then its arguments) with `env`; panics with
/// its output if it fails.
async fn run_example_with(lang: &str, args: &[&str], env: Vec<(&'static str, String)>) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(lang).join("run");
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let out = Command::new(&script).args(&args).envs(env).output().expect("running the example");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{} {args:?} failed:\n{text}", script.display());
        text
    })
    .await
    .expect("example thread")
}

/// `scheme://user:password@host:port/db` → (user, password, host:port, db).
fn parts(url: &str) -> (String, String, String, String) {
    let rest = url.split_once("://").expect("scheme://").1;
    let (auth, hostdb) = rest.rsplit_once('@').expect("user:password@");
    let (user, password) = auth.split_once(':').expect("user:password");
    let (host, db) = hostdb.split_once('/').expect("host/db");
    (user.into(), password.into(), host.into(), db.into())
}

fn check(records: &[Record], key: &str, from: &str, trace_id_in: &str) {
    let r = records.iter().find(|r| r.key_str() == key).unwrap_or_else(|| panic!("no record keyed {key}"));
    assert!(r.payload_str().contains(&format!("\"from\": \"{from}\"")), "{}", r.payload_str());
    let trace = r.header("trace-id");
    assert!(
        !trace.is_empty() && trace_id_in.contains(&format!("(trace-id {trace})")),
        "the program's trace-id {trace} (it printed: {trace_id_in})"
    );
    assert!(r.header("outbox-id").parse::<i64>().is_ok());
}

/// Runs the Python and Java PostgreSQL programs calling `<prefix>_<function>`; returns what
/// each printed.
async fn python_and_java_into_postgres(w: &World<PgDb>, function: &str) -> (String, String) {
    let (user, password, host, db) = parts(&w.db.admin_url);
    let common = |key: &str| {
        vec![
            ("OUTBOX_EXAMPLE_TOPIC", w.topic.clone()),
            ("OUTBOX_EXAMPLE_PREFIX", w.prefix.clone()),
            ("OUTBOX_EXAMPLE_KEY", key.to_string()),
            ("OUTBOX_EXAMPLE_FUNCTION", function.to_string()),
        ]
    };
    let mut py = common("customer-py");
    py.push(("OUTBOX_EXAMPLE_URL", w.db.admin_url.clone()));
    let py_out = run_example("python", "enqueue_postgres.py", py).await;
    let mut java = common("customer-java");
    java.push(("OUTBOX_EXAMPLE_URL", format!("jdbc:postgresql://{host}/{db}?user={user}&password={password}")));
    let java_out = run_example("java", "EnqueuePostgres.java", java).await;
    (py_out, java_out)
}

/// The program printed the `outbox-id` its record carries (the function's answer).
fn check_id(records: &[Record], key: &str, printed: &str) {
    let r = records.iter().find(|r| r.key_str() == key).unwrap_or_else(|| panic!("no record keyed {key}"));
    let said = format!("outbox message {} ", r.header("outbox-id"));
    assert!(printed.contains(&said), "the id the program got is the record's outbox-id: {printed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_and_java_examples_enqueue_into_postgres() {
    let w = World::postgres("ex").build().await;
    let streamer = w.start("streamer.log");
    let (py_out, java_out) = python_and_java_into_postgres(&w, "enqueue").await;
    // The Rust example is built with the tests (cargo builds examples for `cargo test`).
    let rust = std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().join("examples/enqueue_postgres");
    let rust_env = [
        ("OUTBOX_EXAMPLE_TOPIC", w.topic.clone()),
        ("OUTBOX_EXAMPLE_PREFIX", w.prefix.clone()),
        ("OUTBOX_EXAMPLE_KEY", "customer-rust".to_string()),
        ("OUTBOX_EXAMPLE_URL", w.db.admin_url.clone()),
    ];
    let out = Command::new(&rust).envs(rust_env).output().expect("running the Rust example");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rust_out = String::from_utf8_lossy(&out.stdout).into_owned();

    let records = kafka::read_at_least(&w.topic, 1, 3, ARRIVAL).await;
    assert_eq!(records.len(), 3);
    check(&records, "customer-py", "python", &py_out);
    check(&records, "customer-java", "java", &java_out);
    check(&records, "customer-rust", "rust", &rust_out);
    check_id(&records, "customer-py", &py_out);
    check_id(&records, "customer-java", &java_out);
    w.wait_drained(&w.table(0, 0)).await;
    assert!(streamer.stop());
}

/// With `storage = "wal"` and `OUTBOX_EXAMPLE_FUNCTION=emit`: each message arrives with the
/// `outbox-id` the emit function answered, and nothing is stored in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_and_java_examples_emit_wal_only_messages_into_postgres() {
    let w = World::postgres("ew").config("storage = \"wal\"").build().await;
    let streamer = w.start("streamer.log");
    let (py_out, java_out) = python_and_java_into_postgres(&w, "emit").await;
    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(records.len(), 2);
    for (key, from, out) in [("customer-py", "python", &py_out), ("customer-java", "java", &java_out)] {
        check(&records, key, from, out);
        check_id(&records, key, out);
    }
    assert_eq!(w.count(&w.table(0, 0)).await, 0, "nothing was stored");
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_and_java_examples_enqueue_into_mariadb() {
    let w = World::mysql("exm").build().await;
    let streamer = w.start("streamer.log");
    let (user, password, host, db) = parts(&w.db.admin_url);
    let common = |key: &str| {
        vec![
            ("OUTBOX_EXAMPLE_TOPIC", w.topic.clone()),
            ("OUTBOX_EXAMPLE_TABLE", w.table(0, 0)),
            ("OUTBOX_EXAMPLE_KEY", key.to_string()),
        ]
    };
    let mut py = common("customer-py");
    py.push(("OUTBOX_EXAMPLE_URL", w.db.admin_url.clone()));
    let py_out = run_example("python", "enqueue_mariadb.py", py).await;
    let mut java = common("customer-java");
    java.push(("OUTBOX_EXAMPLE_URL", format!("jdbc:mariadb://{host}/{db}?user={user}&password={password}")));
    let java_out = run_example("java", "EnqueueMariaDb.java", java).await;

    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(records.len(), 2);
    check(&records, "customer-py", "python", &py_out);
    check(&records, "customer-java", "java", &java_out);
    w.wait_drained(&w.table(0, 0)).await;
    assert!(streamer.stop());
}

/// The message API's example services (`api_orders.py`, `ApiOrders.java`), whose orders live in
/// SQLite: an order committed is published, one whose local work failed is rolled back and never
/// published, and one whose program exits between its local work and the commit call is
/// committed by the check-back, which the example's own endpoint answers from its SQLite table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_and_java_message_api_services_commit_roll_back_and_answer_the_check_back() {
    use crate::support::api;
    let listen = crate::support::metrics::free_addr();
    let (py_listen, java_listen) = (crate::support::metrics::free_addr(), crate::support::metrics::free_addr());
    let prefixes = [format!("http://{py_listen}/cb/"), format!("http://{java_listen}/cb/")];
    let prefixes: Vec<&str> = prefixes.iter().map(String::as_str).collect();
    let extra = "check_after_s = 1\ncheckback_retry_s = 1";
    let w =
        World::postgres("api_ex").shards(2).config(&api::config_checking_back(listen, extra, &prefixes)).build().await;
    let streamer =
        crate::support::streamer::Running::start_with_env(&w.config, &w.dir.join("streamer.log"), &api::env());
    api::wait_until_serving(listen).await;
    /// The examples' check-back endpoints, killed however the test ends.
    struct Endpoints(Vec<std::process::Child>);
    impl Drop for Endpoints {
        fn drop(&mut self) {
            for endpoint in &mut self.0 {
                let _ = endpoint.kill();
                let _ = endpoint.wait();
            }
        }
    }
    let mut endpoints = Endpoints(Vec::new());
    let mut printed = String::new();
    for (lang, file, endpoint, tag) in
        [("python", "api_orders.py", py_listen, "py"), ("java", "ApiOrders.java", java_listen, "java")]
    {
        let env = |order: &str| {
            vec![
                ("OUTBOX_API_URL", format!("http://{listen}")),
                ("OUTBOX_API_TOKEN", api::SVC_SECRET.to_string()),
                ("OUTBOX_EXAMPLE_TOPIC", w.topic.clone()),
                ("OUTBOX_EXAMPLE_DB", w.dir.join(format!("orders-{tag}.sqlite")).display().to_string()),
                ("OUTBOX_EXAMPLE_ORDER", format!("{tag}-{order}")),
                ("OUTBOX_EXAMPLE_CHECKBACK_URL", format!("http://{endpoint}/cb/check")),
                ("OUTBOX_EXAMPLE_LISTEN", endpoint.to_string()),
            ]
        };
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(lang).join("run");
        let log = std::fs::File::create(w.dir.join(format!("endpoint-{tag}.log"))).unwrap();
        endpoints.0.push(
            Command::new(&script)
                .args([file, "serve"])
                .envs(env("serve"))
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("starting the example's check-back endpoint"),
        );
        for mode in ["commit", "rollback", "crash"] {
            let mut env = env(mode);
            env.push(("OUTBOX_EXAMPLE_MODE", mode.to_string()));
            printed.push_str(&run_example_with(lang, &[file, mode], env).await);
        }
    }
    assert!(printed.contains("commit: 200 committed"), "{printed}");
    assert!(printed.contains("rollback: 200 rolled_back"), "{printed}");
    assert!(printed.contains("exiting before the commit call"), "{printed}");
    let records = kafka::read_at_least(&w.topic, 1, 4, ARRIVAL).await;
    let mut keys: Vec<String> = records.iter().map(|r| r.key_str()).collect();
    keys.sort();
    assert_eq!(keys, ["java-commit", "java-crash", "py-commit", "py-crash"], "the rolled-back orders never arrive");
    let crashed = records.iter().find(|r| r.key_str() == "py-crash").unwrap();
    assert_eq!(crashed.header("trace-id"), "py-py-crash");
    drop(endpoints);
    assert!(streamer.stop());
}
