//! ZooKeeper for outbox-streamer: sessions, membership, and one lease per shard-partition
//! with a fencing epoch.
//!
//! # Layout under the root (default `/outbox-streamer/<cluster>`)
//! * `members/member-<seq>`: one ephemeral-sequential node per live instance; its data is the
//!   instance name. The sequence orders members (oldest first) for the assignment.
//! * `leases/<stream>/_c_<uuid>-lock-<seq>`: an Apache Curator `InterProcessMutex`-compatible
//!   lock per shard-partition; the holder is the lowest sequence, its data is the holder's
//!   instance name, and its creation zxid (`czxid`) is the owner epoch. Curator tooling and
//!   `zkCli.sh ls` read it as they read any Curator lock.
//!
//! # Sessions
//! [`connect`] opens a session with an explicit session and connection timeout. The client
//! reconnects within a session by itself; `Expired` is terminal and needs a new session.

// Only `outbox-kafka`'s queue_events.rs may use `unsafe` (the workspace denies it; this crate
// forbids it outright).
#![forbid(unsafe_code)]

pub mod lease;
pub mod members;
pub mod paths;
pub mod teardown;

pub use zookeeper_client as zk;

use std::path::PathBuf;
use std::time::Duration;

/// Settings of one ZooKeeper session.
#[derive(Debug, Clone)]
pub struct SessionSettings {
    /// `host:port[,host:port…][/chroot]`.
    pub connect: String,
    pub session_timeout: Duration,
    pub connection_timeout: Duration,
    /// TLS to every server of the ensemble (their secure client port), or plaintext.
    pub tls: Option<ZkTls>,
}

/// TLS to ZooKeeper: the server's certificate must be signed by `ca_file` and name the host
/// as written in the connect string. A client certificate is optional (PEM files).
#[derive(Debug, Clone)]
pub struct ZkTls {
    pub ca_file: PathBuf,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

impl ZkTls {
    fn options(&self) -> Result<zk::TlsOptions, String> {
        let read =
            |path: &PathBuf| std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()));
        let mut options = zk::TlsOptions::new()
            .with_pem_ca(&read(&self.ca_file)?)
            .map_err(|e| format!("CA file {}: {e}", self.ca_file.display()))?;
        if let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) {
            options = options
                .with_pem_identity(&read(cert)?, &read(key)?)
                .map_err(|e| format!("client certificate {} and key {}: {e}", cert.display(), key.display()))?;
        }
        Ok(options)
    }
}

impl SessionSettings {
    pub fn new(connect: impl Into<String>) -> Self {
        Self {
            connect: connect.into(),
            session_timeout: Duration::from_secs(10),
            connection_timeout: Duration::from_secs(5),
            tls: None,
        }
    }
}

/// Why a session could not be opened; names the ensemble.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot open a ZooKeeper session with {connect}: {cause}{hint}")]
    Session {
        connect: String,
        /// Shown in the message, so not also offered as the error's source.
        cause: zk::Error,
        /// What to check, when the message alone does not say it.
        hint: &'static str,
    },
    #[error("coordination.tls: {0}")]
    Tls(String),
}

/// Opens a session.
pub async fn connect(settings: &SessionSettings) -> Result<zk::Client, ConnectError> {
    let connector = zk::Client::connector()
        .with_session_timeout(settings.session_timeout)
        .with_connection_timeout(settings.connection_timeout);
    let connected = match &settings.tls {
        // zookeeper-client builds its rustls config on the process's default crypto provider,
        // which the binary installs at start.
        Some(tls) => {
            connector.with_tls(tls.options().map_err(ConnectError::Tls)?).secure_connect(&settings.connect).await
        }
        None => connector.connect(&settings.connect).await,
    };
    connected.map_err(|cause| ConnectError::Session {
        connect: settings.connect.clone(),
        cause,
        hint: match settings.tls {
            // A failed handshake is retried until the timeout; the client does not say why.
            Some(_) => {
                " (with TLS: check that connect names the servers' secure client port, \
                        that coordination.tls.ca_file signed their certificates, that the certificates name \
                        the hosts as written in connect, and that cert_file/key_file are set if the servers \
                        demand a client certificate)"
            }
            None => "",
        },
    })
}

/// Persistent nodes open to everyone: the tree holds names and epochs, no secrets.
pub(crate) fn directory_options() -> zk::CreateOptions<'static> {
    zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all())
}
