//! The check-back's HTTP client: one `POST` of JSON per call to an `http://` or `https://`
//! URL (verified against `checkback_ca_file`, or the system's roots), on a connection of its
//! own, within a deadline, reading at most [`MAX_ANSWER`] bytes of the answer.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

/// The largest answer read.
const MAX_ANSWER: usize = 1024 * 1024;

/// A URL split into what a request needs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    tls: bool,
    host: String,
    port: u16,
    /// The path and query, `/` at least.
    path: String,
}

/// Splits `http(s)://host[:port]/path`; IPv6 hosts in brackets.
fn target(url: &str) -> anyhow::Result<Target> {
    let (tls, rest) = match (url.strip_prefix("https://"), url.strip_prefix("http://")) {
        (Some(rest), _) => (true, rest),
        (None, Some(rest)) => (false, rest),
        _ => anyhow::bail!("not an http:// or https:// URL"),
    };
    let (authority, path) = rest.find('/').map_or((rest, "/"), |i| (&rest[..i], &rest[i..]));
    anyhow::ensure!(!authority.contains('@'), "a URL with a user name is not taken");
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => {
            let (host, after) = v6.split_once(']').context("an IPv6 host without its ]")?;
            (host, after.strip_prefix(':'))
        }
        None => match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        },
    };
    anyhow::ensure!(!host.is_empty(), "no host");
    let port = match port {
        Some(p) => p.parse().with_context(|| format!("port {p:?}"))?,
        None if tls => 443,
        None => 80,
    };
    Ok(Target { tls, host: host.to_string(), port, path: path.to_string() })
}

/// See the module docs.
#[derive(Clone)]
pub(super) struct Client {
    tls: tokio_rustls::TlsConnector,
    timeout: Duration,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

impl Client {
    /// A client trusting `ca_file`, or the system's roots without one.
    pub(super) fn new(ca_file: Option<&std::path::Path>, timeout: Duration) -> anyhow::Result<Self> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        match ca_file {
            Some(path) => {
                for cert in CertificateDer::pem_file_iter(path)
                    .with_context(|| format!("api.checkback_ca_file: cannot read {}", path.display()))?
                {
                    roots.add(cert.with_context(|| format!("api.checkback_ca_file: {}", path.display()))?)?;
                }
            }
            None => {
                for cert in rustls_native_certs::load_native_certs().certs {
                    let _ = roots.add(cert);
                }
            }
        }
        let config = rustls::ClientConfig::builder_with_provider(outbox_postgres::tls::provider())
            .with_safe_default_protocol_versions()
            .context("check-back TLS")?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self { tls: tokio_rustls::TlsConnector::from(Arc::new(config)), timeout })
    }

    /// POSTs `body` (JSON) to `url` with `Authorization: Bearer <bearer>`; returns the answer's
    /// status and body. Every failure (connect, TLS, HTTP, the deadline) is an error naming
    /// the URL's host, never the bearer.
    pub(super) async fn post(&self, url: &str, bearer: &str, body: Vec<u8>) -> anyhow::Result<(u16, Bytes)> {
        let t = target(url)?;
        let place = format!("{}:{}", t.host, t.port);
        tokio::time::timeout(self.timeout, self.exchange(&t, bearer, body))
            .await
            .map_err(|_| anyhow::anyhow!("no answer from {place} within api.checkback_timeout_ms"))?
            .with_context(|| format!("check-back to {place}"))
    }

    async fn exchange(&self, t: &Target, bearer: &str, body: Vec<u8>) -> anyhow::Result<(u16, Bytes)> {
        let tcp = tokio::net::TcpStream::connect((t.host.as_str(), t.port)).await?;
        let _ = tcp.set_nodelay(true);
        if t.tls {
            let name = rustls::pki_types::ServerName::try_from(t.host.clone()).context("the URL's host")?;
            let stream = self.tls.connect(name, tcp).await?;
            send(stream, t, bearer, body).await
        } else {
            send(tcp, t, bearer, body).await
        }
    }
}

async fn send<S>(stream: S, t: &Target, bearer: &str, body: Vec<u8>) -> anyhow::Result<(u16, Bytes)>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let host = if t.host.contains(':') { format!("[{}]:{}", t.host, t.port) } else { format!("{}:{}", t.host, t.port) };
    let request = hyper::Request::post(t.path.as_str())
        .header(hyper::header::HOST, host)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(hyper::header::AUTHORIZATION, format!("Bearer {bearer}"))
        .header(hyper::header::USER_AGENT, "outbox-streamer check-back")
        .body(Full::new(Bytes::from(body)))?;
    let response = sender.send_request(request).await?;
    let status = response.status().as_u16();
    let answer = Limited::new(response.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("reading the answer (at most {MAX_ANSWER} bytes): {e}"))?
        .to_bytes();
    Ok((status, answer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_host_port_and_path() {
        let t = target("https://orders.internal/outbox/check?x=1").unwrap();
        assert_eq!(
            (t.tls, t.host.as_str(), t.port, t.path.as_str()),
            (true, "orders.internal", 443, "/outbox/check?x=1")
        );
        let t = target("http://127.0.0.1:9000").unwrap();
        assert_eq!((t.tls, t.host.as_str(), t.port, t.path.as_str()), (false, "127.0.0.1", 9000, "/"));
        let t = target("http://[::1]:8080/cb").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 8080));
        for bad in ["ftp://x/", "http://", "http://u:p@h/", "http://h:notaport/", "http://[::1/"] {
            assert!(target(bad).is_err(), "{bad}");
        }
    }
}
