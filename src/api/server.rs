//! The API's listener: HTTP/1.1, over TLS when `[api.tls]` is set, bounded against clients that
//! connect and stall — at most `max_connections` open (one more is closed at once), a TLS
//! handshake and every request head (the first, and the next on a kept-alive connection)
//! within `header_timeout_ms`, request heads of at most [`MAX_HEAD`] bytes, bodies of at most
//! `max_body_bytes`, and each request answered or abandoned within `request_timeout_ms`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

use super::routes::{Api, handle};
use crate::config::ApiConfig;

/// Longest request head (request line and headers); a longer one is answered 431.
const MAX_HEAD: usize = 16 * 1024;
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The TLS acceptor of `[api.tls]`, its files read.
pub(super) fn tls_acceptor(config: &ApiConfig) -> anyhow::Result<Option<tokio_rustls::TlsAcceptor>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let Some(tls) = &config.tls else { return Ok(None) };
    let certs = CertificateDer::pem_file_iter(&tls.cert_file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            anyhow::anyhow!(
                "api.tls.cert_file: cannot read a PEM certificate chain from {}: {e}",
                tls.cert_file.display()
            )
        })?;
    if certs.is_empty() {
        anyhow::bail!("api.tls.cert_file: {} holds no certificate", tls.cert_file.display());
    }
    let key = PrivateKeyDer::from_pem_file(&tls.key_file).map_err(|e| {
        anyhow::anyhow!("api.tls.key_file: cannot read a PEM private key from {}: {e}", tls.key_file.display())
    })?;
    let provider = outbox_postgres::tls::provider();
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("api.tls")?;
    let builder = match &tls.client_ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            let cas = CertificateDer::pem_file_iter(ca)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| anyhow::anyhow!("api.tls.client_ca_file: cannot read {}: {e}", ca.display()))?;
            for cert in cas {
                roots.add(cert).with_context(|| format!("api.tls.client_ca_file: {}", ca.display()))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .context("api.tls.client_ca_file")?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config =
        builder.with_single_cert(certs, key).context("api.tls: the certificate and the key do not go together")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))))
}

/// Accepts connections on `listener` until `stop` turns true.
pub(super) async fn serve(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    api: Arc<Api>,
    mut stop: watch::Receiver<bool>,
) {
    let settings = api.settings();
    let places = Arc::new(Semaphore::new(settings.max_connections));
    let header_timeout = Duration::from_millis(settings.header_timeout_ms);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "the API listener cannot accept a connection (out of file descriptors?); retrying");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Ok(place) = places.clone().try_acquire_owned() else {
            metrics::counter!(crate::metrics::API_CONNECTIONS_REFUSED).increment(1);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (api, tls) = (api.clone(), tls.clone());
        tokio::spawn(async move {
            let _place = place;
            match tls {
                None => connection(stream, api, header_timeout).await,
                // A failed or stalled handshake has nothing to answer.
                Some(acceptor) => {
                    if let Ok(Ok(stream)) = tokio::time::timeout(header_timeout, acceptor.accept(stream)).await {
                        connection(stream, api, header_timeout).await;
                    }
                }
            }
        });
    }
}

/// Serves one connection's requests.
async fn connection<S>(stream: S, api: Arc<Api>, header_timeout: Duration)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |request: hyper::Request<Incoming>| {
        let api = api.clone();
        async move { Ok::<_, Infallible>(handle(&api, request).await) }
    });
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(header_timeout).max_buf_size(MAX_HEAD);
    let _ = http.serve_connection(TokioIo::new(stream), service).await;
}
