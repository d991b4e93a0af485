//! TLS for both PostgreSQL sessions: the SQL session (tokio-postgres, through the rustls
//! connector below) and the replication session (pgwire-replication's own rustls upgrade).
//!
//! Modes follow libpq's `sslmode`: `require` encrypts without checking the certificate,
//! `verify-ca` checks the chain against `ca_file`, `verify-full` also checks that the
//! certificate names the host (a DNS name or an IP address in its subjectAltName).
//! A server that refuses TLS is an error in every mode: there is no silent plaintext fallback.
//!
//! Certificate files are read once, when the target is built, so a missing or unreadable file
//! is reported at start with the setting that names it.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_rustls::TlsConnector;

/// How much of the server's certificate is checked; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    Require,
    VerifyCa,
    VerifyFull,
}

/// TLS settings of one PostgreSQL target. Paths are PEM files.
#[derive(Debug, Clone)]
pub struct PgTls {
    pub mode: TlsMode,
    /// The CA certificates that sign the server's certificate (required to verify).
    pub ca_file: Option<PathBuf>,
    /// A client certificate chain and its key, for `cert` authentication (both or neither).
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// The name to verify instead of the URL's host (for example when connecting by IP).
    pub server_name: Option<String>,
}

/// A TLS setting that cannot be used; names the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("TLS: {0}")]
pub struct TlsError(String);

/// The crypto provider of this connector's TLS sessions (ring; both rustls backends are
/// compiled in through dependencies, so the choice is made explicitly).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl PgTls {
    /// The rustls client config for these settings; reads and checks every file.
    pub fn client_config(&self) -> Result<ClientConfig, TlsError> {
        let provider = provider();
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError(format!("no usable protocol version: {e}")))?;
        let verifier: Arc<dyn ServerCertVerifier> = match (self.mode, &self.ca_file) {
            (TlsMode::Require, _) => Arc::new(AnyCertificate(provider.clone())),
            (mode, Some(ca)) => {
                let roots = Arc::new(root_store(ca)?);
                let chain = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                    .build()
                    .map_err(|e| TlsError(format!("CA file {}: {e}", ca.display())))?;
                if mode == TlsMode::VerifyCa { Arc::new(ChainOnly(chain)) } else { chain }
            }
            (_, None) => {
                return Err(TlsError(
                    "verify-ca and verify-full need ca_file: the CA that signed the server's certificate".into(),
                ));
            }
        };
        let builder = builder.dangerous().with_custom_certificate_verifier(verifier);
        match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => builder
                .with_client_auth_cert(cert_chain(cert)?, private_key(key)?)
                .map_err(|e| TlsError(format!("client certificate {} and key {}: {e}", cert.display(), key.display()))),
            (None, None) => Ok(builder.with_no_client_auth()),
            _ => Err(TlsError("cert_file and key_file go together: set both or neither".into())),
        }
    }

    /// The same settings for the replication session.
    pub fn replication(&self, host: &str) -> pgwire_replication::TlsConfig {
        use pgwire_replication::TlsConfig;
        let tls = match self.mode {
            TlsMode::Require => TlsConfig::require(),
            TlsMode::VerifyCa => TlsConfig::verify_ca(self.ca_file.clone()),
            TlsMode::VerifyFull => TlsConfig::verify_full(self.ca_file.clone()),
        };
        // pgwire-replication refuses verify-full to an IP unless the name is given outright;
        // rustls checks an IP against the certificate's IP subjectAltNames.
        let tls = tls.with_sni_hostname(self.server_name.as_deref().unwrap_or(host));
        match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => tls.with_client_cert(cert.clone(), key.clone()),
            _ => tls,
        }
    }
}

/// What to change when a handshake failed on the server's certificate (`message` is the
/// failure as rustls words it), for any driver that uses rustls.
pub fn certificate_hint(message: &str) -> Option<&'static str> {
    if message.contains("UnknownIssuer") {
        Some("the server's certificate is not signed by the CA in tls.ca_file")
    } else if message.contains("NotValidForName") {
        Some("the server's certificate does not name this host: connect by a name it lists, or set tls.server_name")
    } else if message.contains("Expired") {
        Some("the server's certificate has expired")
    } else {
        None
    }
}

fn root_store(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(cert_chain(path)?);
    if added == 0 {
        return Err(TlsError(format!("CA file {} holds no usable certificate", path.display())));
    }
    Ok(roots)
}

fn cert_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError(format!("cannot read certificates from {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(TlsError(format!("{} holds no PEM certificate", path.display())));
    }
    Ok(certs)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        TlsError(format!("cannot read a private key (PKCS#8, PKCS#1 or SEC1 PEM) from {}: {e}", path.display()))
    })
}

/// `require`: encryption without authentication of the server, as libpq's `sslmode=require`.
/// Handshake signatures are still checked, so the session key belongs to whoever sent the
/// certificate.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to the CA; the name in the certificate is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// tokio-postgres's TLS hook backed by rustls.
#[derive(Debug, Clone)]
pub struct RustlsConnect {
    config: Arc<ClientConfig>,
    server_name: Option<String>,
}

impl RustlsConnect {
    pub fn new(config: ClientConfig, server_name: Option<String>) -> Self {
        Self { config: Arc::new(config), server_name }
    }
}

impl<S> MakeTlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsHandshake;
    type Error = TlsError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsHandshake, TlsError> {
        let name = self.server_name.as_deref().unwrap_or(domain);
        let server_name = ServerName::try_from(name.to_string())
            .map_err(|_| TlsError(format!("{name:?} is neither a DNS name nor an IP address; set tls.server_name")))?;
        Ok(RustlsHandshake { connector: TlsConnector::from(self.config.clone()), server_name })
    }
}

/// One pending handshake.
pub struct RustlsHandshake {
    connector: TlsConnector,
    server_name: ServerName<'static>,
}

impl std::fmt::Debug for RustlsHandshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RustlsHandshake({:?})", self.server_name)
    }
}

impl<S> TlsConnect<S> for RustlsHandshake
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move { Ok(RustlsStream(self.connector.connect(self.server_name, stream).await?)) })
    }
}

/// An encrypted SQL session's stream.
pub struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S> std::fmt::Debug for RustlsStream<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RustlsStream")
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for RustlsStream<S> {
    /// No channel binding: SCRAM runs without `-PLUS`, as over a plain connection.
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifying_without_a_ca_file_says_to_set_one() {
        let tls =
            PgTls { mode: TlsMode::VerifyFull, ca_file: None, cert_file: None, key_file: None, server_name: None };
        let err = tls.client_config().unwrap_err().to_string();
        assert!(err.contains("ca_file"), "{err}");
    }

    #[test]
    fn a_missing_ca_file_is_named() {
        let tls = PgTls {
            mode: TlsMode::VerifyCa,
            ca_file: Some("/nonexistent/ca.pem".into()),
            cert_file: None,
            key_file: None,
            server_name: None,
        };
        let err = tls.client_config().unwrap_err().to_string();
        assert!(err.contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn a_certificate_without_its_key_is_refused() {
        let tls = PgTls {
            mode: TlsMode::Require,
            ca_file: None,
            cert_file: Some("/tmp/c.pem".into()),
            key_file: None,
            server_name: None,
        };
        let err = tls.client_config().unwrap_err().to_string();
        assert!(err.contains("cert_file and key_file"), "{err}");
    }
}
