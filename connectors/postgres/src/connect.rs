//! Connection settings from a `postgres://` URL, for both the SQL and the replication session.

use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use pgwire_replication::{Lsn, ReplicationConfig, TlsConfig};
use tokio_postgres::config::{Host, SslMode};
use tokio_postgres::{Client, Config, NoTls};

use crate::tls::{PgTls, RustlsConnect, TlsError};

/// Where and as whom to connect. `Debug` never shows the password.
#[derive(Clone)]
pub struct PgTarget {
    config: Config,
    host: String,
    port: u16,
    user: String,
    password: String,
    database: String,
    /// The instance name under ZooKeeper coordination, shown in the replication session's
    /// `application_name` so another instance can tell whose session holds a slot.
    instance: Option<String>,
    /// TLS for both sessions; `None` connects in plaintext.
    tls: Option<(PgTls, RustlsConnect)>,
}

/// The `application_name` prefix of a coordinated instance's replication sessions.
pub const INSTANCE_APP_PREFIX: &str = "outbox-streamer@";

/// The instance named by a replication session's `application_name`, if it is one of ours.
pub fn instance_of(application_name: &str) -> Option<&str> {
    application_name.strip_prefix(INSTANCE_APP_PREFIX).filter(|i| !i.is_empty())
}

impl std::fmt::Debug for PgTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PgTarget({})", self.display())
    }
}

/// A URL that cannot be used; the message names what is missing.
#[derive(Debug, thiserror::Error)]
#[error("invalid PostgreSQL URL: {0}")]
pub struct UrlError(String);

impl PgTarget {
    /// Parses a libpq-style URL (`postgres://user:password@host:port/database`). The password
    /// may instead come from `password` (for example read from an environment variable).
    pub fn from_url(url: &str, password: Option<&str>) -> Result<Self, UrlError> {
        let mut config = Config::from_str(url).map_err(|e| UrlError(strip_secret(&e.to_string())))?;
        if let Some(pw) = password {
            config.password(pw);
        }
        let host = match config.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            Some(_) => return Err(UrlError("unix sockets are not supported; use a TCP host".into())),
            None => "localhost".into(),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let user = config.get_user().ok_or_else(|| UrlError("no user in the URL".into()))?.to_string();
        let password = config.get_password().map(|p| String::from_utf8_lossy(p).into_owned()).unwrap_or_default();
        let database = config.get_dbname().unwrap_or(&user).to_string();
        config.dbname(&database);
        config.connect_timeout(Duration::from_secs(10));
        config.application_name("outbox-streamer");
        Ok(Self { config, host, port, user, password, database, instance: None, tls: None })
    }

    /// Names this instance in its replication sessions (see [`instance_of`]).
    pub fn with_instance(mut self, instance: &str) -> Self {
        self.instance = Some(instance.into());
        self
    }

    /// Encrypts both sessions as `tls` says; reads its certificate files now, so a bad file
    /// is reported before anything connects. The server must accept TLS.
    pub fn with_tls(mut self, tls: PgTls) -> Result<Self, TlsError> {
        let connector = RustlsConnect::new(tls.client_config()?, tls.server_name.clone());
        self.config.ssl_mode(SslMode::Require);
        self.tls = Some((tls, connector));
        Ok(self)
    }

    pub fn user(&self) -> &str {
        &self.user
    }

    pub fn database(&self) -> &str {
        &self.database
    }

    /// `user@host:port/database`, safe to log.
    pub fn display(&self) -> String {
        format!("{}@{}:{}/{}", self.user, self.host, self.port, self.database)
    }

    /// A SQL session; its connection task runs on the current runtime until the client drops.
    pub async fn connect(&self) -> Result<Client, ConnectError> {
        let client = match &self.tls {
            Some((_, connector)) => {
                let (client, connection) = self.config.connect(connector.clone()).await.map_err(ConnectError)?;
                tokio::spawn(drive(connection));
                client
            }
            None => {
                let (client, connection) = self.config.connect(NoTls).await.map_err(ConnectError)?;
                tokio::spawn(drive(connection));
                client
            }
        };
        Ok(client)
    }

    /// The replication session settings for one slot and publication. `binary` asks pgoutput
    /// for values in each type's binary format (PostgreSQL 14+): no hex or date formatting on
    /// the server, about half the bytes for `bytea`.
    pub fn replication(
        &self,
        slot: &str,
        publication: &str,
        status_interval: Duration,
        binary: bool,
    ) -> ReplicationConfig {
        ReplicationConfig::new(&self.host, &self.user, &self.password, &self.database, slot, publication)
            .with_port(self.port)
            .with_binary(binary)
            .with_tls(match &self.tls {
                Some((tls, _)) => tls.replication(&self.host),
                None => TlsConfig::disabled(),
            })
            .with_start_lsn(Lsn::from_u64(0))
            .with_status_interval(status_interval)
            .with_wakeup_interval(status_interval)
            .with_application_name(match &self.instance {
                Some(instance) => format!("{INSTANCE_APP_PREFIX}{instance}"),
                None => format!("outbox-streamer {slot}"),
            })
    }
}

/// Runs a SQL session's connection until its client drops.
async fn drive<F: Future<Output = Result<(), tokio_postgres::Error>>>(connection: F) {
    if let Err(e) = connection.await {
        tracing::debug!(error = %e, "postgres connection closed");
    }
}

/// A failed connection, shown with the server's own message ("password authentication failed
/// for user …") where `tokio_postgres` alone would say "db error".
#[derive(Debug)]
pub struct ConnectError(pub tokio_postgres::Error);

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = match self.0.as_db_error() {
            Some(db) => format!("{}: {} (SQLSTATE {})", db.severity(), db.message(), db.code().code()),
            None => match std::error::Error::source(&self.0) {
                Some(cause) => format!("{}: {cause}", self.0),
                None => self.0.to_string(),
            },
        };
        f.write_str(&text)?;
        match connect_hint(&text) {
            Some(hint) => write!(f, " ({hint})"),
            None => Ok(()),
        }
    }
}

/// What to change for the failures whose message alone does not say it.
fn connect_hint(message: &str) -> Option<&'static str> {
    if let Some(hint) = crate::tls::certificate_hint(message) {
        Some(hint)
    } else if message.contains("no encryption") {
        Some("the server requires TLS for this login: add a [source.tls] table")
    } else {
        None
    }
}

/// The cause is already part of the message.
impl std::error::Error for ConnectError {}

/// Removes anything that looks like a password from a URL parse error.
fn strip_secret(msg: &str) -> String {
    if msg.contains("password") {
        "the URL could not be parsed (details withheld: they may contain the password)".into()
    } else {
        msg.into()
    }
}
