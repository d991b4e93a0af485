//! The streamer's metrics endpoint, read as Prometheus text.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A free loopback address for `OUTBOX_METRICS_LISTEN`.
pub(crate) fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// (status code, body) of `GET path`, or `None` while nothing answers.
pub(crate) async fn try_get_any(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut conn = tokio::net::TcpStream::connect(addr).await.ok()?;
    conn.write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes()).await.ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).await.ok()?;
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok())?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Some((status, body))
}

/// The body of `GET path` when it answers 200, or `None` while nothing answers.
pub(crate) async fn try_get(addr: SocketAddr, path: &str) -> Option<String> {
    let (status, body) = try_get_any(addr, path).await?;
    (status == 200).then_some(body)
}

/// The value of the sample `name` whose labels include every one of `labels`, in the
/// Prometheus text `text` (`name{a="1",b="2"} 3`).
pub(crate) fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
        if metric != name {
            return None;
        }
        let all = labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        all.then(|| value.parse().ok()).flatten()
    })
}

/// The labels of the only shard-partition of source `test` (shard 0, partition 0).
pub(crate) const STREAM_0_0: &[(&str, &str)] = &[("source", "test"), ("shard", "0"), ("partition", "0")];

/// `outbox_stream_state` of shard-partition 0/0 of source `test`, once the endpoint answers.
pub(crate) async fn stream_state(addr: SocketAddr) -> Option<f64> {
    sample(&try_get(addr, "/metrics").await?, "outbox_stream_state", STREAM_0_0)
}

/// The cumulative count of histogram `name`'s bucket `le` (compared as a number, however the
/// exporter writes it) among the samples with `labels`.
pub(crate) fn bucket(text: &str, name: &str, labels: &[(&str, &str)], le: f64) -> Option<f64> {
    let bucket = format!("{name}_bucket");
    text.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{')?;
        if metric != bucket || !labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))) {
            return None;
        }
        let bound = rest.split("le=\"").nth(1)?.split('"').next()?;
        (bound.parse::<f64>().ok()? == le).then(|| value.parse().ok()).flatten()
    })
}
