//! The HTTP endpoint on `[metrics] listen`: `/metrics` (Prometheus text), `/healthz` (the
//! process answers) and `/readyz` (every shard-partition this instance runs is streaming,
//! catching up, or deliberately halted with a reason).
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
}

fn streams() -> &'static Mutex<BTreeMap<String, Entry>> {
    static STREAMS: OnceLock<Mutex<BTreeMap<String, Entry>>> = OnceLock::new();
    STREAMS.get_or_init(Mutex::default)
}

/// Shard-partition `key` is now in `state` (a [`crate::metrics::state`] value); `reason`
/// for a halt or a retry.
pub fn report(key: &str, state: f64, reason: Option<&str>) {
    let mut map = streams().lock().unwrap_or_else(|e| e.into_inner());
    map.insert(key.to_string(), Entry { state, reason: reason.map(str::to_string) });
}

/// Shard-partition `key` is no longer run by this instance.
pub fn leave(key: &str) {
    streams().lock().unwrap_or_else(|e| e.into_inner()).remove(key);
}

/// Whether every shard-partition is streaming, catching up or halted on purpose, and one line
/// per shard-partition saying what it does.
pub fn readiness() -> (bool, String) {
    let map = streams().lock().unwrap_or_else(|e| e.into_inner());
    let mut ready = true;
    let mut body = String::new();
    for (key, e) in map.iter() {
        let (word, ok) = match e.state {
            s if s == state::STREAMING => ("streaming", true),
            s if s == state::CATCHING_UP => ("catching up", true),
            s if s == state::HALTED => ("halted", true),
            s if s == state::RETRYING => ("retrying", false),
            _ => ("stopped", false),
        };
        ready &= ok;
        body.push_str(&format!("{key}: {word}"));
        if let Some(reason) = &e.reason {
            body.push_str(&format!(" ({reason})"));
        }
        body.push('\n');
    }
    if map.is_empty() {
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
pub async fn serve(listen: SocketAddr, metrics: PrometheusHandle) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
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
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(EXCHANGE_DEADLINE, exchange(conn, &ticket, &metrics)).await;
            });
        }
    });
    Ok(())
}

/// At most this many connections are open at once.
pub const MAX_CONNECTIONS: usize = 64;
/// A connection that has not sent its request head by then is closed.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// A connection is closed this long after it was accepted, answered or not.
pub const EXCHANGE_DEADLINE: Duration = Duration::from_secs(10);
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
async fn exchange(mut conn: TcpStream, ticket: &Ticket, metrics: &PrometheusHandle) {
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
    let (status, body) = respond(path.split('?').next().unwrap_or(path), metrics);
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = conn.write_all(response.as_bytes()).await;
    let _ = conn.shutdown().await;
}

fn respond(path: &str, metrics: &PrometheusHandle) -> (&'static str, String) {
    match path {
        "/metrics" | "/" => ("200 OK", metrics.render()),
        "/healthz" => ("200 OK", "ok\n".into()),
        "/readyz" => match readiness() {
            (true, body) => ("200 OK", body),
            (false, body) => ("503 Service Unavailable", body),
        },
        _ => ("404 Not Found", "try /metrics, /healthz or /readyz\n".into()),
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

    #[test]
    fn ready_only_when_no_stream_is_retrying() {
        report("t.a", state::STREAMING, None);
        report("t.b", state::HALTED, Some("row id=7: topic is NULL"));
        let (ready, body) = readiness();
        assert!(ready, "{body}");
        assert!(body.contains("t.b: halted (row id=7: topic is NULL)"));
        report("t.a", state::RETRYING, Some("Kafka unreachable"));
        assert!(!readiness().0);
        leave("t.a");
        assert!(readiness().0);
        leave("t.b");
    }
}
