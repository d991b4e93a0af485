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

pub mod lease;
pub mod members;
pub mod paths;

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

/// Persistent nodes open to everyone: the tree holds names and epochs, no secrets.
pub(crate) fn directory_options() -> zk::CreateOptions<'static> {
    zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all())
}
