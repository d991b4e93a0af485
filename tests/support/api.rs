//! The message API as a caller sees it: a config section with two tokens, a plain HTTP/1.1
//! client (one request per connection), and raw sockets for what a well-behaved client would
//! never send.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The secret of token `svc` (topics `api-*`, every shard, check-backs to 127.0.0.1:1/cb/).
pub(crate) const SVC_SECRET: &str = "svc-secret-0123456789abcdef";
/// The secret of token `other` (every topic, shard 1 only).
pub(crate) const OTHER_SECRET: &str = "other-secret-0123456789abcdef";

/// `[api]` on `listen` for source `test`, with tokens `svc` and `other`; `extra` adds lines to
/// `[api]` (limits).
pub(crate) fn config(listen: SocketAddr, extra: &str) -> String {
    config_checking_back(listen, extra, &["http://127.0.0.1:1/cb/"])
}

/// [`config`] with `svc`'s check-back URLs under `prefixes`.
pub(crate) fn config_checking_back(listen: SocketAddr, extra: &str, prefixes: &[&str]) -> String {
    let prefix = prefixes.join("\", \"");
    format!(
        r#"
[api]
listen = "{listen}"
source = "test"
{extra}

[[api.token]]
name = "svc"
secret_env = "TEST_API_SVC"
topics = ["api-*"]
checkback_urls = ["{prefix}"]

[[api.token]]
name = "other"
secret_env = "TEST_API_OTHER"
topics = ["*"]
shards = [1]
"#
    )
}

/// The environment a streamer serving [`config`] needs.
pub(crate) fn env() -> Vec<(&'static str, String)> {
    vec![("TEST_API_SVC", SVC_SECRET.to_string()), ("TEST_API_OTHER", OTHER_SECRET.to_string())]
}

/// An answer: its status and its JSON body (`Null` when the body is not JSON).
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub status: u16,
    pub body: serde_json::Value,
}

impl Answer {
    /// The `id` of a prepare's answer.
    pub(crate) fn id(&self) -> String {
        self.body["id"].as_str().unwrap_or_else(|| panic!("an answer without an id: {self:?}")).to_string()
    }

    /// The `error` of a refusal.
    pub(crate) fn error(&self) -> &str {
        self.body["error"].as_str().unwrap_or_else(|| panic!("an answer without an error: {self:?}"))
    }
}

/// A caller of the API at `addr` with `secret`.
#[derive(Debug, Clone)]
pub(crate) struct Client {
    pub addr: SocketAddr,
    pub secret: Option<String>,
}

impl Client {
    pub(crate) fn new(addr: SocketAddr, secret: &str) -> Self {
        Self { addr, secret: Some(secret.to_string()) }
    }

    pub(crate) async fn post(&self, path: &str, body: &str) -> Answer {
        self.call("POST", path, Some(body)).await
    }

    pub(crate) async fn get(&self, path: &str) -> Answer {
        self.call("GET", path, None).await
    }

    /// Prepares one message and returns its id, checking the answer is 201.
    pub(crate) async fn prepare(&self, body: &str) -> String {
        let a = self.post("/v1/messages", body).await;
        assert_eq!(a.status, 201, "prepare {body}: {a:?}");
        a.id()
    }

    /// Commits or rolls back (`action`) message `id`.
    pub(crate) async fn decide(&self, id: &str, action: &str) -> Answer {
        self.post(&format!("/v1/messages/{id}/{action}"), "").await
    }

    pub(crate) async fn call(&self, method: &str, path: &str, body: Option<&str>) -> Answer {
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
        if let Some(secret) = &self.secret {
            head.push_str(&format!("Authorization: Bearer {secret}\r\n"));
        }
        let body = body.unwrap_or("");
        head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len()));
        let text = raw(self.addr, format!("{head}{body}").as_bytes()).await;
        parse(&text)
    }
}

/// Sends `bytes` on a new connection and returns everything the server answers until it
/// closes the connection (or 30 s pass).
pub(crate) async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    try_raw(addr, bytes).await.unwrap_or_else(|e| panic!("a request to the API at {addr}: {e}"))
}

/// [`raw`], an error when the server resets the connection (as it may when it closes a
/// connection whose request it did not read to the end).
pub(crate) async fn try_raw(addr: SocketAddr, bytes: &[u8]) -> std::io::Result<String> {
    exchange(tokio::net::TcpStream::connect(addr).await?, bytes).await
}

/// Writes `bytes` on `conn` and reads until the server closes it (or 30 s pass).
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(mut conn: S, bytes: &[u8]) -> std::io::Result<String> {
    conn.write_all(bytes).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), conn.read_to_end(&mut answer))
        .await
        .map_err(|_| std::io::Error::other("no answer or close within 30 s"))??;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// The status and JSON body of a raw HTTP answer.
pub(crate) fn parse(text: &str) -> Answer {
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
    Answer { status, body: serde_json::from_str(body).unwrap_or(serde_json::Value::Null) }
}

/// Waits until the API at `addr` answers (a GET of an unknown message: 404).
pub(crate) async fn wait_until_serving(addr: SocketAddr) {
    super::wait_until(&format!("the message API to answer on {addr}"), super::world::ARRIVAL, || async {
        let _ = tokio::net::TcpStream::connect(addr).await.ok()?;
        let a = Client::new(addr, SVC_SECRET).get("/v1/messages/999999999").await;
        (a.status == 404).then_some(())
    })
    .await
}

/// A TLS client of the services' CA at `ca`, presenting the certificate `client` (a
/// `(cert, key)` pair of PEM files) when given.
pub(crate) fn tls_connector(ca: &str, client: Option<(&str, &str)>) -> tokio_rustls::TlsConnector {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert).unwrap().map(Result::unwrap).collect();
            builder.with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(key).unwrap()).unwrap()
        }
    };
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
}

/// [`try_raw`] over TLS to 127.0.0.1 (the name the services' server certificate carries).
pub(crate) async fn try_tls(
    addr: SocketAddr,
    connector: &tokio_rustls::TlsConnector,
    bytes: &[u8],
) -> std::io::Result<String> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    exchange(connector.connect(name, tcp).await?, bytes).await
}

/// A request as bytes: `method path` with the `svc` token and `body`, closing afterwards.
pub(crate) fn request_bytes(method: &str, path: &str, body: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: Bearer {SVC_SECRET}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A service's check-back endpoint: answers each message by its business key's first word —
/// `commit` and `rollback` as said, `later` unknown the first time and commit after, `never`
/// unknown always, `silent` left out of the answer — and records every question.
pub(crate) struct Caller {
    pub addr: SocketAddr,
    /// Per question: the Authorization header and the ids asked about.
    pub asked: std::sync::Arc<Asked>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Caller {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Caller {
    pub(crate) async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = asked.clone();
        let task = tokio::spawn(async move {
            let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
            loop {
                let Ok((conn, _)) = listener.accept().await else { continue };
                let (record, seen) = (record.clone(), seen.clone());
                tokio::spawn(async move {
                    let _ = answer(conn, &record, &seen).await;
                });
            }
        });
        Self { addr, asked, task }
    }

    /// The URL the messages name.
    pub(crate) fn url(&self) -> String {
        format!("http://{}/cb/check", self.addr)
    }

    /// The prefix `svc` is granted.
    pub(crate) fn prefix(&self) -> String {
        format!("http://{}/cb/", self.addr)
    }

    /// Every id asked about, with repeats.
    pub(crate) fn ids_asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().iter().flat_map(|(_, ids)| ids.clone()).collect()
    }
}

type Asked = std::sync::Mutex<Vec<(String, Vec<String>)>>;

async fn answer(
    mut conn: tokio::net::TcpStream,
    record: &Asked,
    seen: &std::sync::Mutex<std::collections::HashSet<String>>,
) -> std::io::Result<()> {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    let (head, mut body) = loop {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        data.extend_from_slice(&buf[..n]);
        if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break (String::from_utf8_lossy(&data[..end]).into_owned(), data[end + 4..].to_vec());
        }
    };
    let header = |name: &str| {
        head.lines().find_map(|l| {
            l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim().to_string())
        })
    };
    let length: usize = header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    while body.len() < length {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&buf[..n]);
    }
    let question: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let mut ids = Vec::new();
    let mut decisions = Vec::new();
    for m in question["messages"].as_array().cloned().unwrap_or_default() {
        let id = m["id"].as_str().unwrap_or_default().to_string();
        let key = m["business_key"].as_str().unwrap_or_default();
        ids.push(id.clone());
        let first = seen.lock().unwrap().insert(id.clone());
        let decision = match key.split('-').next().unwrap_or_default() {
            "commit" => "commit",
            "rollback" => "rollback",
            "later" if first => "unknown",
            "later" => "commit",
            "silent" => continue,
            _ => "unknown",
        };
        decisions.push(serde_json::json!({"id": id, "decision": decision}));
    }
    record.lock().unwrap().push((header("authorization").unwrap_or_default(), ids));
    let text = serde_json::json!({ "decisions": decisions }).to_string();
    let response = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
    conn.write_all(response.as_bytes()).await?;
    conn.shutdown().await
}
