//! ZooKeeper for outbox-streamer: sessions now; membership, per-shard-partition leases and
//! fencing epochs (Curator-compatible lock recipe) as ownership lands.
//!
//! # Sessions
//!
//! [`connect`] opens a session with an explicit session and connection timeout. The client
//! reconnects within a session by itself; `Expired` is terminal and needs a new session.

pub use zookeeper_client as zk;

use std::time::Duration;

/// Settings of one ZooKeeper session.
#[derive(Debug, Clone)]
pub struct SessionSettings {
    /// `host:port[,host:port…][/chroot]`.
    pub connect: String,
    pub session_timeout: Duration,
    pub connection_timeout: Duration,
}

impl SessionSettings {
    pub fn new(connect: impl Into<String>) -> Self {
        Self {
            connect: connect.into(),
            session_timeout: Duration::from_secs(10),
            connection_timeout: Duration::from_secs(5),
        }
    }
}

/// Why a session could not be opened; names the ensemble.
#[derive(Debug, thiserror::Error)]
#[error("cannot open a ZooKeeper session with {connect}: {source}")]
pub struct ConnectError {
    pub connect: String,
    #[source]
    pub source: zk::Error,
}

/// Opens a session.
pub async fn connect(settings: &SessionSettings) -> Result<zk::Client, ConnectError> {
    zk::Client::connector()
        .with_session_timeout(settings.session_timeout)
        .with_connection_timeout(settings.connection_timeout)
        .connect(&settings.connect)
        .await
        .map_err(|source| ConnectError { connect: settings.connect.clone(), source })
}
