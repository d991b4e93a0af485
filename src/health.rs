//! The HTTP endpoint on `[metrics] listen`: `/metrics` (Prometheus text), `/healthz` (the
//! process answers) and `/readyz` (every shard-partition this instance runs is streaming,
//! catching up, or deliberately halted with a reason).
//!
//! Each shard-partition's task reports its state here as it changes ([`report`]); a task that
//! ends (shutdown, or its lease moved to another instance) leaves ([`leave`]). A state is a
//! value of the `outbox_stream_state` gauge too, set by the same call.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};

use metrics_exporter_prometheus::PrometheusHandle;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

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
pub async fn serve(listen: SocketAddr, metrics: PrometheusHandle) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else { continue };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let line = String::from_utf8_lossy(&head);
                let path = line.split_whitespace().nth(1).unwrap_or("/");
                let (status, body) = respond(path.split('?').next().unwrap_or(path), &metrics);
                let response = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(response.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    Ok(())
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
