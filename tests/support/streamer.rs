//! The real `outbox-streamer` binary as a child process.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The binary under test.
pub(crate) fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_outbox-streamer")
}

/// A scratch directory for one test (config and logs), kept after the run for inspection.
pub(crate) fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Runs `outbox-streamer <args>` to completion; returns (success, stdout, stderr).
pub(crate) fn run_cli(config: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin()).arg("--config").arg(config).args(args).output().expect("running outbox-streamer");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `outbox-streamer <args>` to completion; returns (exit code, stdout, stderr).
pub(crate) fn run_cli_code(config: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin()).arg("--config").arg(config).args(args).output().expect("running outbox-streamer");
    (
        out.status.code().expect("exited, not killed by a signal"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A running `outbox-streamer run`, its stderr logged to a file.
pub(crate) struct Running {
    child: Child,
    pub log: PathBuf,
    /// Where its `/metrics`, `/readyz` and `/streams` answer, when it serves them
    /// (`OUTBOX_METRICS_LISTEN` in its environment, or `[metrics] listen` in its config).
    pub metrics: Option<SocketAddr>,
}

impl Running {
    pub(crate) fn start(config: &Path, log: &Path) -> Self {
        Self::start_with_env(config, log, &[])
    }

    /// Starts with extra environment variables (for example `OUTBOX_METRICS_LISTEN`).
    pub(crate) fn start_with_env(config: &Path, log: &Path, env: &[(&str, String)]) -> Self {
        Self::spawn(Command::new(bin()), config, log, env)
    }

    /// Starts with at most `nofile` open file descriptors (`prlimit` execs the binary, so the
    /// child is the streamer itself).
    pub(crate) fn start_with_nofile(config: &Path, log: &Path, env: &[(&str, String)], nofile: u64) -> Self {
        let mut command = Command::new("prlimit");
        command.arg(format!("--nofile={nofile}:{nofile}")).arg("--").arg(bin());
        Self::spawn(command, config, log, env)
    }

    /// Every streamer serves its metrics endpoint, so a test can wait on `/readyz`, `/streams`
    /// and the state metric: where `env` and the config name no address, on a free port.
    fn spawn(mut command: Command, config: &Path, log: &Path, env: &[(&str, String)]) -> Self {
        super::failure::remember_panics();
        let named = env.iter().find(|(k, _)| *k == "OUTBOX_METRICS_LISTEN").map(|(_, v)| v.clone());
        let free = match named.is_none() && !has_metrics_table(config) {
            true => Some(super::metrics::free_addr().to_string()),
            false => None,
        };
        let metrics = named.clone().or(free.clone()).or_else(|| metrics_listen(config));
        let file = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("log file");
        let child = command
            .arg("--config")
            .arg(config)
            .arg("run")
            .env(
                "RUST_LOG",
                std::env::var("OUTBOX_TEST_RUST_LOG").unwrap_or_else(|_| "info,outbox_streamer=debug".into()),
            )
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .envs(free.iter().map(|addr| ("OUTBOX_METRICS_LISTEN", addr.as_str())))
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("starting outbox-streamer run");
        // An address a test made invalid on purpose is no endpoint to wait on.
        let metrics = metrics.and_then(|addr| addr.parse().ok());
        Self { child, log: log.to_path_buf(), metrics }
    }

    /// Peak resident memory of the process so far (VmHWM), in bytes.
    pub(crate) fn peak_rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("proc status");
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM line");
        line.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()).expect("VmHWM in kB") * 1024
    }

    /// CPU time (user and system) the process has used so far.
    pub(crate) fn cpu_time(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).expect("proc stat");
        // Fields after the command name, which is in parentheses: utime and stime are the
        // 12th and 13th, in clock ticks (100 a second on Linux).
        let fields: Vec<&str> = stat.rsplit_once(')').expect("(comm)").1.split_whitespace().collect();
        let ticks: u64 = fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
        Duration::from_millis(ticks * 10)
    }

    pub(crate) fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log contains `needle`; returns the whole log.
    pub(crate) async fn wait_for_log(&self, needle: &str, timeout: Duration) -> String {
        super::wait_until(&format!("{needle:?} in {}", self.log.display()), timeout, || async {
            let log = self.log_text();
            log.contains(needle).then_some(log)
        })
        .await
    }

    /// Waits until `/streams` shows a shard-partition in `state` (`streaming`, `retrying`,
    /// `halted`, `catching-up`); returns its reason. Needs the metrics endpoint.
    pub(crate) async fn wait_for_state(&self, state: &str, timeout: Duration) -> Option<String> {
        let what = format!("a shard-partition {state} on /streams of {}", self.log.display());
        super::wait_until(&what, timeout, || async {
            let streams = self.streams().await?;
            let found = streams.values().find(|s| s["state"] == state)?;
            Some(found["reason"].as_str().map(str::to_string))
        })
        .await
    }

    /// Waits until `/streams` shows each named shard-partition (`<source>.<table>`) in the
    /// state paired with it, all at one look. Needs the metrics endpoint.
    pub(crate) async fn wait_for_streams(&self, want: &[(&str, &str)], timeout: Duration) {
        let what = format!("{want:?} on /streams of {}", self.log.display());
        super::wait_until(&what, timeout, || async {
            let streams = self.streams().await?;
            want.iter().all(|(name, state)| streams.get(*name).is_some_and(|s| s["state"] == *state)).then_some(())
        })
        .await
    }

    /// `/streams` now, by shard-partition; `None` while the endpoint does not answer.
    async fn streams(&self) -> Option<serde_json::Map<String, serde_json::Value>> {
        let addr = self.metrics.unwrap_or_else(|| panic!("{} serves no metrics endpoint", self.log.display()));
        let body = super::metrics::try_get(addr, "/streams").await?;
        let mut report: serde_json::Value = serde_json::from_str(&body).expect("/streams is JSON");
        let serde_json::Value::Object(streams) = report["streams"].take() else {
            panic!("/streams has streams: {body}");
        };
        Some(streams)
    }

    /// Waits until the sample of metric `name` with `labels` on `/metrics` reaches `at_least`
    /// (a counter, which, unlike a state, cannot be missed between two looks).
    /// The address of its metrics endpoint.
    pub(crate) fn metrics_addr(&self) -> SocketAddr {
        self.metrics.unwrap_or_else(|| panic!("{} serves no metrics endpoint", self.log.display()))
    }

    pub(crate) async fn wait_for_metric(&self, name: &str, labels: &[(&str, &str)], at_least: f64, timeout: Duration) {
        let addr = self.metrics.unwrap_or_else(|| panic!("{} serves no metrics endpoint", self.log.display()));
        let what = format!("{name}{labels:?} >= {at_least} on /metrics of {}", self.log.display());
        super::wait_until(&what, timeout, || async {
            let text = super::metrics::try_get(addr, "/metrics").await?;
            (super::metrics::sample(&text, name, labels)? >= at_least).then_some(())
        })
        .await
    }

    /// Waits until `/streams` shows a shard-partition halted, then for its ERROR line, which
    /// is logged just after the state changes; returns the whole log. The state is the
    /// condition; the log is read because the tests check what the ERROR line says.
    pub(crate) async fn wait_for_halt(&self, timeout: Duration) -> String {
        self.wait_for_state("halted", timeout).await;
        self.wait_for_log("halted", timeout).await
    }

    /// Waits until a shard-partition halts and checks it halted at once and once: exactly one
    /// ERROR line and no retry as transient before it. Returns that line.
    pub(crate) async fn wait_for_one_halt(&self, timeout: Duration) -> String {
        let log = self.wait_for_halt(timeout).await;
        let errors: Vec<&str> = log.lines().filter(|l| l.split_whitespace().nth(1) == Some("ERROR")).collect();
        assert_eq!(errors.len(), 1, "one ERROR:\n{log}");
        assert!(!log.contains("stream interrupted"), "retried as transient before halting:\n{log}");
        errors[0].to_string()
    }

    /// SIGTERM, then waits (with a deadline) for a clean exit; returns whether it exited 0.
    pub(crate) fn stop(mut self) -> bool {
        signal(self.child.id(), "TERM");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status.success();
            }
            assert!(
                Instant::now() < deadline,
                "streamer did not stop within 60s of SIGTERM; log {}",
                self.log.display()
            );
            std::thread::yield_now();
            std::thread::park_timeout(Duration::from_millis(50));
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGSTOP: the process freezes with every connection open.
    pub(crate) fn freeze(&self) {
        signal(self.child.id(), "STOP");
    }

    /// SIGCONT after [`Running::freeze`].
    pub(crate) fn resume(&self) {
        signal(self.child.id(), "CONT");
    }

    /// SIGKILL: no draining, no cleanup.
    pub(crate) fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Running {
    /// Kills the child; if the test is failing, prints the end of its log so a CI failure
    /// explains itself without the scratch directory.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = self.log_text();
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
            eprintln!("---- last {} lines of {} ----\n{}", tail.len(), self.log.display(), tail.join("\n"));
            if let Some(failure) = super::failure::last_panic() {
                eprintln!("---- the test failed at {failure}");
            }
        }
    }
}

/// Whether the config at `path` has a `[metrics]` table (its `listen` may be missing on
/// purpose, or wrong: a test of that must not be given an address from outside).
fn has_metrics_table(path: &Path) -> bool {
    std::fs::read_to_string(path).is_ok_and(|text| text.contains("[metrics]"))
}

/// `listen` of the `[metrics]` table of the config at `path`, if it has one.
fn metrics_listen(path: &Path) -> Option<String> {
    let config: toml::Table = std::fs::read_to_string(path).ok()?.parse().ok()?;
    config.get("metrics")?.get("listen")?.as_str().map(str::to_string)
}

/// How much of a streamer's log a failing test prints.
const LOG_TAIL_LINES: usize = 60;

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status().expect("kill").success();
    assert!(ok, "kill -{sig} {pid} failed");
}

/// A config for one PostgreSQL source.
pub(crate) fn pg_config(
    dir: &Path,
    streamer_url: &str,
    prefix: &str,
    shards: u32,
    partitions: u32,
    extra: &str,
) -> PathBuf {
    source_config(dir, "postgres", streamer_url, prefix, shards, partitions, extra)
}

/// A config for one source of `kind` (`postgres` or `mysql`).
pub(crate) fn source_config(
    dir: &Path,
    kind: &str,
    streamer_url: &str,
    prefix: &str,
    shards: u32,
    partitions: u32,
    extra: &str,
) -> PathBuf {
    source_config_with(dir, kind, streamer_url, prefix, (shards, partitions), "", extra)
}

/// [`source_config`] with `source_keys` added to the `[[source]]` table (e.g. `layout = …`).
pub(crate) fn source_config_with(
    dir: &Path,
    kind: &str,
    streamer_url: &str,
    prefix: &str,
    (shards, partitions): (u32, u32),
    source_keys: &str,
    extra: &str,
) -> PathBuf {
    let path = dir.join("outbox-streamer.toml");
    let text = format!(
        r#"[kafka]
brokers = "{brokers}"
message_timeout_ms = 10000
transactional_id_prefix = "{prefix}"

[[source]]
name = "test"
kind = "{kind}"
url = "{streamer_url}"
table_prefix = "{prefix}"
shards = {shards}
partitions = {partitions}
{source_keys}

[source.defaults]
linger_ms = 1
status_interval_ms = 100
{extra}
"#,
        brokers = super::kafka::brokers()
    );
    std::fs::write(&path, text).expect("write config");
    path
}
