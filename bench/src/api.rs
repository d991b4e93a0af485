//! `--api`: the writers are message API callers (docs/api.md). Each keeps one HTTP/1.1
//! connection open and, per message, prepares it and commits it: two round trips, timed
//! together (the "round trip" of the report), and the commit's return is the start of the
//! message's end-to-end latency, as a writer's COMMIT is otherwise. The commit answers the
//! record's `outbox-id`, which is how the checker's arrivals are matched.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

use crate::load::{Committed, WriterPlan, ticker};

/// The environment variable the streamer under test reads the bench token's secret from.
pub(crate) const SECRET_VAR: &str = "OUTBOX_BENCH_API_SECRET";

/// The `[api]` section of the run's config: `listen`, the source `bench`, one token for
/// every topic (its secret from [`SECRET_VAR`]), database sessions for every caller.
pub(crate) fn config(listen: SocketAddr, callers: usize) -> String {
    format!(
        "\n[api]\nlisten = \"{listen}\"\nsource = \"bench\"\ndb_connections = {}\nmax_batch = 10\n\n\
         [[api.token]]\nname = \"bench\"\nsecret_env = \"{SECRET_VAR}\"\ntopics = [\"*\"]\n",
        callers.max(2)
    )
}

/// A random secret for one run.
pub(crate) fn secret() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("bench-{nanos:x}-{:x}", std::process::id())
}

/// A free loopback address for `[api] listen`.
pub(crate) fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// Waits until the API at `addr` answers (any HTTP answer), for at most a minute.
pub(crate) async fn wait_serving(addr: SocketAddr, secret: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(mut caller) = Caller::connect(addr, secret).await
            && caller.call("GET", "/v1/messages/1", None).await.is_ok()
        {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the streamer's message API on {addr} did not answer within a minute"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One caller's kept-alive connection.
struct Caller {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    bearer: String,
}

impl Caller {
    async fn connect(addr: SocketAddr, secret: &str) -> anyhow::Result<Self> {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
        tokio::spawn(connection);
        Ok(Self { sender, bearer: format!("Bearer {secret}") })
    }

    /// One request; the answer's status and JSON.
    async fn call(
        &mut self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> anyhow::Result<(u16, serde_json::Value)> {
        self.sender.ready().await?;
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, "bench")
            .header(hyper::header::AUTHORIZATION, &self.bearer)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        let answer = self.sender.send_request(request).await?;
        let status = answer.status().as_u16();
        let bytes = answer.into_body().collect().await?.to_bytes();
        Ok((status, serde_json::from_slice(&bytes).unwrap_or_default()))
    }
}

/// Runs one caller: per message (pace: `plan.txn_rate`), prepare then commit. Returns the
/// outbox ids committed with when their commit returned; pushes each round trip's
/// milliseconds to `round_trips`.
pub(crate) async fn run_caller(
    addr: SocketAddr,
    secret: String,
    plan: WriterPlan,
    progress: Arc<AtomicUsize>,
    round_trips: Arc<Mutex<Vec<f64>>>,
) -> anyhow::Result<Committed> {
    let mut caller = Caller::connect(addr, &secret).await.context("connecting to the message API")?;
    let payload = base64::engine::general_purpose::STANDARD.encode(&plan.payload[..]);
    let mut ticker = ticker(&plan);
    let mut committed = Vec::new();
    let mut mine = Vec::new();
    let end = Instant::now() + plan.duration;
    let mut n = 0usize;
    while Instant::now() < end {
        if let Some(t) = ticker.as_mut() {
            t.tick().await;
        }
        let key = String::from_utf8_lossy(&plan.key(n, 0)).into_owned();
        n += 1;
        let body = serde_json::json!({"topic": plan.topic, "key": key, "payload_base64": payload});
        let started = Instant::now();
        let (status, prepared) = caller.call("POST", "/v1/messages", Some(serde_json::to_vec(&body)?)).await?;
        anyhow::ensure!(status == 201, "prepare answered {status}: {prepared}");
        let id = prepared["id"].as_str().context("prepare answered no id")?.to_string();
        let (status, done) = caller.call("POST", &format!("/v1/messages/{id}/commit"), None).await?;
        let at = Instant::now();
        anyhow::ensure!(status == 200, "commit answered {status}: {done}");
        let outbox_id: i64 =
            done["outbox_id"].as_str().and_then(|s| s.parse().ok()).context("commit answered no outbox_id")?;
        mine.push(at.duration_since(started).as_secs_f64() * 1000.0);
        committed.push((outbox_id, at));
        progress.fetch_add(1, Ordering::Relaxed);
    }
    round_trips.lock().unwrap_or_else(|e| e.into_inner()).extend(mine);
    Ok(committed)
}
