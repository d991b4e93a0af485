//! Test support: service settings from the environment, a fresh database and role per test,
//! fresh Kafka topics, a Kafka reader, the streamer as a real child process, and waits on
//! conditions with deadlines (never sleeps as synchronisation).

pub(crate) mod api;
pub(crate) mod cluster;
pub(crate) mod database;
pub(crate) mod failure;
pub(crate) mod kafka;
pub(crate) mod load;
pub(crate) mod metrics;
pub(crate) mod mysql;
pub(crate) mod pg;
pub(crate) mod proxy;
pub(crate) mod streamer;
pub(crate) mod world;

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How to get the services the tests need.
pub(crate) const HOW_TO_START: &str = "start the services with `scripts/services up && eval \"$(scripts/services env)\"`, or run every test with `scripts/test`";

/// Tests share the services; a test that stops one (Kafka outage) takes them exclusively.
static SERVICES: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Held by every test that uses the services.
pub(crate) async fn shared_services() -> tokio::sync::RwLockReadGuard<'static, ()> {
    SERVICES.read().await
}

/// Held by a test that stops or restarts a service; no other test runs meanwhile.
pub(crate) async fn exclusive_services() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    SERVICES.write().await
}

/// Runs `scripts/services <args>` (for example `down kafka`) and panics if it fails.
pub(crate) fn services(args: &[&str]) {
    services_with(args, &[]);
}

/// [`services`] with extra environment variables for the script (such as
/// `OUTBOX_MYSQL_REPLICA_LOG_UPDATES`).
pub(crate) fn services_with(args: &[&str], vars: &[(&str, &str)]) {
    if let Err(e) = try_services(args, vars) {
        panic!("{e}");
    }
}

/// [`services_with`], saying what failed instead of panicking.
fn try_services(args: &[&str], vars: &[(&str, &str)]) -> Result<(), String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/services");
    let out = std::process::Command::new(script)
        .args(args)
        .envs(vars.iter().copied())
        .output()
        .map_err(|e| format!("running scripts/services: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "scripts/services {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// Runs `work` on a thread of its own while holding the services shared: cleanup that a
/// `Drop` starts and nobody waits for. The test process may end before it does; the next
/// process sweeps up what is left.
pub(crate) fn in_the_background(work: impl Future<Output = ()> + Send + 'static) {
    std::thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        runtime.block_on(async move {
            let _hold = shared_services().await;
            work.await
        });
    });
}

/// Makes up to `attempts` of `attempt`, one per `every` (the first at once), until one returns
/// true; returns whether one did. For best-effort cleanup that a lingering session or a
/// restarting server may refuse for a moment — a retry schedule, never a test's wait.
pub(crate) async fn retry_paced<F, Fut>(attempts: u32, every: Duration, mut attempt: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let mut pace = tokio::time::interval(every);
    for _ in 0..attempts {
        pace.tick().await;
        if attempt().await {
            return true;
        }
    }
    false
}

/// Stops Kafka now and starts it again when dropped, so a failing assertion in between
/// still leaves Kafka running for the tests after it. Hold the services exclusively.
pub(crate) struct KafkaOutage;

impl KafkaOutage {
    pub(crate) fn begin() -> Self {
        services(&["down", "kafka"]);
        Self
    }
}

impl Drop for KafkaOutage {
    fn drop(&mut self) {
        services(&["up", "kafka"]);
    }
}

/// Runs `scripts/services` commands when dropped, whether the test passed or failed, so a
/// test that crashes, stops or promotes a server leaves the services as the next test expects.
pub(crate) struct RestoreServices(Vec<Vec<&'static str>>);

impl RestoreServices {
    pub(crate) fn new(commands: &[&[&'static str]]) -> Self {
        Self(commands.iter().map(|c| c.to_vec()).collect())
    }
}

impl Drop for RestoreServices {
    fn drop(&mut self) {
        for command in &self.0 {
            match try_services(command, &[]) {
                Ok(()) => {}
                // A second panic would abort the process and hide the first one.
                Err(e) if std::thread::panicking() => eprintln!("restoring the services after a failure: {e}"),
                Err(e) => panic!("{e}"),
            }
        }
    }
}

/// A service setting; panics with how to start the services when it is missing.
pub(crate) fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: {HOW_TO_START}"))
}

/// A name unique to this test process and call: `<prefix>_<pid>_<n>`.
pub(crate) fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}_{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Polls `check` until it returns `Some`, or panics with `what` after `timeout`.
pub(crate) async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    let mut poll = tokio::time::interval(Duration::from_millis(50));
    loop {
        poll.tick().await;
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
    }
}
