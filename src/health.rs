//! The HTTP endpoint on `[metrics] listen`: `/metrics` (Prometheus text), `/healthz` (the
//! process answers), `/readyz` (every shard-partition this instance runs is streaming or
//! catching up; a halted one too with `ready_when_halted`) and `/streams` (the same states as
//! JSON, [`StreamsReport`], read by `outbox-streamer status`).
//!
//! Each shard-partition's task reports its state here as it changes ([`report`]); a task that
//! ends (shutdown, or its lease moved to another instance) leaves ([`leave`]). A state is a
//! value of the `outbox_stream_state` gauge too, set by the same call.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use crate::metrics::state;

/// Longest request head read; the endpoints take no body.
const MAX_REQUEST: usize = 8 * 1024;

#[derive(Debug, Clone, PartialEq)]
struct Entry {
    state: f64,
    reason: Option<String>,
    since: Instant,
}

fn streams() -> &'static Mutex<BTreeMap<String, Entry>> {
    static STREAMS: OnceLock<Mutex<BTreeMap<String, Entry>>> = OnceLock::new();
    STREAMS.get_or_init(Mutex::default)
}

/// Shard-partition `key` is now in `state` (a [`crate::metrics::state`] value); `reason`
/// for a halt or a retry. [`state::STOPPED`] is reported only by a task that is starting (a
/// task that ends leaves instead).
pub(crate) fn report(key: &str, state: f64, reason: Option<&str>) {
    let mut map = streams().lock().unwrap_or_else(|e| e.into_inner());
    let reason = reason.map(str::to_string);
    match map.get_mut(key) {
        // The same state again (a retry after a retry) keeps its start time, so `for_s` says
        // how long the shard-partition has been in it.
        Some(e) if e.state == state => e.reason = reason,
        _ => {
            map.insert(key.to_string(), Entry { state, reason, since: Instant::now() });
        }
    }
}

/// Shard-partition `key` is no longer run by this instance.
pub(crate) fn leave(key: &str) {
    streams().lock().unwrap_or_else(|e| e.into_inner()).remove(key);
}

/// What a shard-partition's task is doing, as `/streams` and `status` name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum StreamerState {
    /// The task runs and has not connected yet.
    Starting,
    Streaming,
    /// Sending the rows of a lost position by polling (see docs/polling.md).
    CatchingUp,
    /// Waiting to try again after a transient error.
    Retrying,
    /// Stopped until an operator acts; the reason says what to do.
    Halted,
}

impl StreamerState {
    fn of(value: f64) -> Self {
        match value {
            s if s == state::STREAMING => Self::Streaming,
            s if s == state::CATCHING_UP => Self::CatchingUp,
            s if s == state::HALTED => Self::Halted,
            s if s == state::RETRYING => Self::Retrying,
            _ => Self::Starting,
        }
    }

    /// The word used in `/readyz`, `/streams` and `status`.
    pub(crate) fn word(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Streaming => "streaming",
            Self::CatchingUp => "catching-up",
            Self::Retrying => "retrying",
            Self::Halted => "halted",
        }
    }
}

/// The body of `GET /streams`: what this instance runs and how each shard-partition is doing.
/// A shard-partition this instance does not run is absent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StreamsReport {
    /// The instance name under ZooKeeper ownership (`None` without coordination).
    pub instance: Option<String>,
    pub pid: u32,
    /// By `<source>.<table>`.
    pub streams: BTreeMap<String, StreamReport>,
}

/// One shard-partition in a [`StreamsReport`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StreamReport {
    pub state: StreamerState,
    /// Why it halted, retries or catches up (names row ids and columns, never values).
    pub reason: Option<String>,
    /// Seconds in this state.
    pub for_s: u64,
}

/// The states of every shard-partition this instance runs.
pub(crate) fn streams_report(instance: Option<&str>) -> StreamsReport {
    let map = streams().lock().unwrap_or_else(|e| e.into_inner());
    let streams = map
        .iter()
        .map(|(key, e)| {
            let report = StreamReport {
                state: StreamerState::of(e.state),
                reason: e.reason.clone(),
                for_s: e.since.elapsed().as_secs(),
            };
            (key.clone(), report)
        })
        .collect();
    StreamsReport { instance: instance.map(str::to_string), pid: std::process::id(), streams }
}

/// How the endpoint answers, from `[metrics]`.
#[derive(Debug, Clone, Default)]
pub(crate) struct HealthSettings {
    /// `[metrics] ready_when_halted`: `/readyz` answers 200 while a shard-partition is halted
    /// (with its reason), as it did before halts counted as not ready.
    pub ready_when_halted: bool,
    /// The instance name under ZooKeeper ownership, shown on `/streams`.
    pub instance: Option<String>,
}

/// Whether every shard-partition is streaming or catching up (or halted, with
/// `ready_when_halted`), and one line per shard-partition saying what it does.
pub(crate) fn readiness(ready_when_halted: bool) -> (bool, String) {
    let report = streams_report(None);
    let mut ready = true;
    let mut body = String::new();
    for (key, e) in &report.streams {
        ready &= match e.state {
            StreamerState::Streaming | StreamerState::CatchingUp => true,
            StreamerState::Halted => ready_when_halted,
            StreamerState::Starting | StreamerState::Retrying => false,
        };
        body.push_str(&format!("{key}: {}", e.state.word()));
        if let Some(reason) = &e.reason {
            body.push_str(&format!(" ({reason})"));
        }
        body.push('\n');
    }
    if report.streams.is_empty() {
        body.push_str("no shard-partition is run by this instance\n");
    }
    (ready, body)
}

/// Serves the endpoints on `listen` until the process ends.
///
/// The endpoint has no authentication, so it is bounded against clients that connect and say
/// nothing: at most [`MAX_CONNECTIONS`] at once (a new one beyond that closes the one that
/// has waited longest for its request; when none is waiting, the new one is closed), a
/// request head must arrive within [`HEAD_DEADLINE`] and the whole exchange end within
/// [`EXCHANGE_DEADLINE`]. A failing `accept` (out of file descriptors) backs off instead of
/// spinning, with a warning at most once per [`ACCEPT_WARN_EVERY`].
pub(crate) async fn serve(
    listen: SocketAddr,
    metrics: PrometheusHandle,
    settings: HealthSettings,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    let settings = Arc::new(settings);
    tokio::spawn(async move {
        let admission = Arc::new(Mutex::new(Admission::default()));
        let mut backoff = ACCEPT_BACKOFF_START;
        let mut last_warning: Option<Instant> = None;
        let mut failures_since_warning = 0u64;
        loop {
            let conn = match listener.accept().await {
                Ok((conn, _)) => {
                    backoff = ACCEPT_BACKOFF_START;
                    conn
                }
                Err(e) => {
                    failures_since_warning += 1;
                    if last_warning.is_none_or(|at| at.elapsed() >= ACCEPT_WARN_EVERY) {
                        tracing::warn!(
                            error = %e,
                            failures = failures_since_warning,
                            retry_in_ms = backoff.as_millis() as u64,
                            "the metrics listener cannot accept connections (out of file descriptors? see LimitNOFILE); backing off"
                        );
                        last_warning = Some(Instant::now());
                        failures_since_warning = 0;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                    continue;
                }
            };
            let Some(ticket) = Admission::admit(&admission) else { continue };
            let (metrics, settings) = (metrics.clone(), settings.clone());
            tokio::spawn(async move {
                let _ = tokio::time::timeout(EXCHANGE_DEADLINE, exchange(conn, &ticket, &metrics, &settings)).await;
            });
        }
    });
    Ok(())
}

/// At most this many connections are open at once.
pub(crate) const MAX_CONNECTIONS: usize = 64;
/// A connection that has not sent its request head by then is closed.
pub(crate) const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// A connection is closed this long after it was accepted, answered or not.
pub(crate) const EXCHANGE_DEADLINE: Duration = Duration::from_secs(10);
const ACCEPT_BACKOFF_START: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(60);

/// The open connections: how many, and which still wait for their request head (oldest
/// first), so that a new one can shed the longest-waiting one.
#[derive(Debug, Default)]
struct Admission {
    open: usize,
    next_id: u64,
    waiting: BTreeMap<u64, Arc<Shed>>,
}

/// How a waiting connection is told to close, and whether it was.
#[derive(Debug, Default)]
struct Shed {
    notify: Notify,
    /// Set (under the [`Admission`] lock) when the connection's place was given to another.
    done: AtomicBool,
}

/// One admitted connection; dropping it gives its place back.
#[derive(Debug)]
struct Ticket {
    id: u64,
    shed: Arc<Shed>,
    admission: Arc<Mutex<Admission>>,
}

impl Admission {
    /// A place for a new connection, shedding the one that has waited longest for its
    /// request head when all are taken; `None` (close the new one) when none is waiting.
    fn admit(this: &Arc<Mutex<Admission>>) -> Option<Ticket> {
        let mut a = this.lock().unwrap_or_else(|e| e.into_inner());
        if a.open >= MAX_CONNECTIONS {
            let (_, oldest) = a.waiting.pop_first()?;
            oldest.done.store(true, Ordering::Relaxed);
            oldest.notify.notify_one();
            a.open -= 1;
        }
        a.open += 1;
        a.next_id += 1;
        let (id, shed) = (a.next_id, Arc::new(Shed::default()));
        a.waiting.insert(id, shed.clone());
        Some(Ticket { id, shed, admission: this.clone() })
    }
}

impl Ticket {
    /// The request head has arrived: the connection can no longer be shed. False if it was
    /// shed meanwhile.
    fn head_read(&self) -> bool {
        let mut a = self.admission.lock().unwrap_or_else(|e| e.into_inner());
        a.waiting.remove(&self.id).is_some()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut a = self.admission.lock().unwrap_or_else(|e| e.into_inner());
        // A shed connection gave its place back when it was shed.
        if !self.shed.done.load(Ordering::Relaxed) {
            a.waiting.remove(&self.id);
            a.open -= 1;
        }
    }
}

/// Reads one request head (until a blank line, [`MAX_REQUEST`] or the end) and answers it.
async fn exchange(mut conn: TcpStream, ticket: &Ticket, metrics: &PrometheusHandle, settings: &HealthSettings) {
    let read_head = async {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        head
    };
    let head = tokio::select! {
        _ = ticket.shed.notify.notified() => return,
        head = tokio::time::timeout(HEAD_DEADLINE, read_head) => match head {
            Ok(head) => head,
            Err(_) => return,
        },
    };
    if !ticket.head_read() {
        return;
    }
    let line = String::from_utf8_lossy(&head);
    let path = line.split_whitespace().nth(1).unwrap_or("/");
    let (status, content_type, body) = respond(path.split('?').next().unwrap_or(path), metrics, settings);
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = conn.write_all(response.as_bytes()).await;
    let _ = conn.shutdown().await;
}

/// (status line, content type, body) of `GET path`.
fn respond(path: &str, metrics: &PrometheusHandle, settings: &HealthSettings) -> (&'static str, &'static str, String) {
    const TEXT: &str = "text/plain; charset=utf-8";
    match path {
        "/metrics" | "/" => ("200 OK", TEXT, metrics.render()),
        "/healthz" => ("200 OK", TEXT, "ok\n".into()),
        "/readyz" => match readiness(settings.ready_when_halted) {
            (true, body) => ("200 OK", TEXT, body),
            (false, body) => ("503 Service Unavailable", TEXT, body),
        },
        "/streams" => {
            let report = streams_report(settings.instance.as_deref());
            let body = serde_json::to_string(&report).expect("a streams report serialises");
            ("200 OK", "application/json", body + "\n")
        }
        _ => ("404 Not Found", TEXT, "try /metrics, /healthz, /readyz or /streams\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past the cap, a new connection takes the place of the one that has waited longest for
    /// its request; when every place is answering, the new one is refused.
    #[test]
    fn admission_sheds_the_longest_waiting_connection() {
        let admission = Arc::new(Mutex::new(Admission::default()));
        let mut tickets: Vec<Ticket> = (0..MAX_CONNECTIONS).map(|_| Admission::admit(&admission).unwrap()).collect();
        let newest = Admission::admit(&admission).expect("a waiting connection is shed for it");
        assert!(tickets[0].shed.done.load(Ordering::Relaxed) && !tickets[1].shed.done.load(Ordering::Relaxed));
        assert!(!tickets[0].head_read(), "a shed connection is not answered");
        assert_eq!(admission.lock().unwrap().open, MAX_CONNECTIONS);
        tickets.remove(0);
        assert_eq!(admission.lock().unwrap().open, MAX_CONNECTIONS, "dropping a shed ticket frees nothing twice");
        for t in &tickets {
            assert!(t.head_read());
        }
        assert!(newest.head_read());
        assert!(Admission::admit(&admission).is_none(), "all places answering: the new one is closed");
        drop(tickets);
        assert_eq!(admission.lock().unwrap().open, 1);
        drop(newest);
        assert_eq!(admission.lock().unwrap().open, 0);
    }

    /// Ready while every stream flows; a halt is not ready unless `ready_when_halted`; a
    /// retry or a start never is. (One test: the states are process-wide.)
    #[test]
    fn readiness_and_the_streams_report_follow_the_states() {
        report("t.a", state::STREAMING, None);
        report("t.b", state::HALTED, Some("row id=7: topic is NULL"));
        let (ready, body) = readiness(false);
        assert!(!ready, "a halt is not ready by default:\n{body}");
        assert!(body.contains("t.b: halted (row id=7: topic is NULL)"));
        assert!(readiness(true).0, "ready_when_halted keeps the earlier behaviour");
        report("t.a", state::RETRYING, Some("Kafka unreachable"));
        assert!(!readiness(true).0);

        let streams = streams_report(Some("one"));
        assert_eq!(streams.instance.as_deref(), Some("one"));
        assert_eq!(streams.streams["t.a"].state, StreamerState::Retrying);
        assert_eq!(streams.streams["t.b"].reason.as_deref(), Some("row id=7: topic is NULL"));
        let json = serde_json::to_string(&streams).unwrap();
        assert!(json.contains(r#""state":"halted""#), "{json}");
        assert_eq!(serde_json::from_str::<StreamsReport>(&json).unwrap(), streams);

        leave("t.a");
        report("t.b", state::STOPPED, None);
        assert_eq!(streams_report(None).streams["t.b"].state, StreamerState::Starting);
        assert!(!readiness(true).0, "a starting stream is not ready yet");
        report("t.b", state::STREAMING, None);
        assert!(readiness(false).0);
        leave("t.b");
        assert!(readiness(false).0, "running nothing is ready");
    }
}
