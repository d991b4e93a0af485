//! Connection settings from a `postgres://` URL, for both the SQL and the replication session.

use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pgwire_replication::{Lsn, ReplicationConfig, TlsConfig};
use tokio_postgres::config::{Host, SslMode, TargetSessionAttrs};
use tokio_postgres::{Client, Config, NoTls};

use crate::tls::{PgTls, RustlsConnect, TlsError};

/// Where and as whom to connect. `Debug` never shows the password.
///
/// A URL may name several hosts, libpq style (`postgres://u@h1:5432,h2:5432/db`): they are
/// tried in order and the first that accepts writes is taken (`target_session_attrs=read-write`
/// is implied, whatever the URL says: the streamer deletes rows and its slot lives on the
/// primary). The replication session then goes to the host the last SQL session reached, so
/// after a failover both follow the promoted server.
#[derive(Clone)]
pub struct PgTarget {
    /// One per host of the URL, in the URL's order.
    hosts: Vec<Endpoint>,
    /// The index in `hosts` of the server the last SQL session reached (shared by clones).
    current: Arc<AtomicUsize>,
    user: String,
    password: String,
    database: String,
    /// The instance name under ZooKeeper coordination, shown in the replication session's
    /// `application_name` so another instance can tell whose session holds a slot.
    instance: Option<String>,
    /// TLS for both sessions; `None` connects in plaintext.
    tls: Option<(PgTls, RustlsConnect)>,
}

/// One host of the URL with the settings to reach it alone.
#[derive(Clone)]
struct Endpoint {
    config: Config,
    host: String,
    port: u16,
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
        let user = config.get_user().ok_or_else(|| UrlError("no user in the URL".into()))?.to_string();
        let password = config.get_password().map(|p| String::from_utf8_lossy(p).into_owned()).unwrap_or_default();
        let database = config.get_dbname().unwrap_or(&user).to_string();
        config.dbname(&database);
        config.connect_timeout(Duration::from_secs(10));
        config.application_name("outbox-streamer");
        let names = match config.get_hosts() {
            [] => vec![Host::Tcp("localhost".into())],
            hosts => hosts.to_vec(),
        };
        let ports = config.get_ports();
        if ports.len() > 1 && ports.len() != names.len() {
            return Err(UrlError(format!(
                "{} hosts but {} ports; give one port, or one per host",
                names.len(),
                ports.len()
            )));
        }
        if !config.get_hostaddrs().is_empty() {
            return Err(UrlError("hostaddr is not supported; name the hosts by address instead".into()));
        }
        let several = names.len() > 1;
        let mut hosts = Vec::with_capacity(names.len());
        for (i, name) in names.into_iter().enumerate() {
            let Host::Tcp(host) = name else {
                return Err(UrlError("unix sockets are not supported; use a TCP host".into()));
            };
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            let mut alone = alone(&config, &host, port);
            if several {
                alone.target_session_attrs(TargetSessionAttrs::ReadWrite);
            }
            hosts.push(Endpoint { config: alone, host, port });
        }
        Ok(Self { hosts, current: Arc::default(), user, password, database, instance: None, tls: None })
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
        for endpoint in &mut self.hosts {
            endpoint.config.ssl_mode(SslMode::Require);
        }
        self.tls = Some((tls, connector));
        Ok(self)
    }

    pub fn user(&self) -> &str {
        &self.user
    }

    pub fn database(&self) -> &str {
        &self.database
    }

    /// `user@host:port/database` (every host, comma-separated), safe to log.
    pub fn display(&self) -> String {
        let hosts: Vec<String> = self.hosts.iter().map(|e| format!("{}:{}", e.host, e.port)).collect();
        format!("{}@{}/{}", self.user, hosts.join(","), self.database)
    }

    /// The server the last SQL session reached, `host:port`.
    pub fn reached(&self) -> String {
        let e = self.endpoint();
        format!("{}:{}", e.host, e.port)
    }

    fn endpoint(&self) -> &Endpoint {
        &self.hosts[self.current.load(Ordering::Relaxed).min(self.hosts.len() - 1)]
    }

    /// A SQL session; its connection task runs on the current runtime until the client drops.
    /// With several hosts, the first that accepts writes, in the URL's order; the error of
    /// the last one tried when none does.
    pub async fn connect(&self) -> Result<Client, ConnectError> {
        let mut last: Option<ConnectError> = None;
        let mut failed = Vec::new();
        for (i, endpoint) in self.hosts.iter().enumerate() {
            match self.connect_to(endpoint).await {
                Ok(client) => {
                    if self.current.swap(i, Ordering::Relaxed) != i && self.hosts.len() > 1 {
                        tracing::info!(server = %format!("{}:{}", endpoint.host, endpoint.port), "connected to another host of the URL: it is the one accepting writes now");
                    }
                    return Ok(client);
                }
                Err(e) => {
                    if let Some(before) = last.replace(e) {
                        failed.push(format!("{}: {before}", before.host.as_deref().unwrap_or("?")));
                    }
                }
            }
        }
        let mut error = last.expect("a URL names at least one host");
        error.others = failed;
        Err(error)
    }

    async fn connect_to(&self, endpoint: &Endpoint) -> Result<Client, ConnectError> {
        let client = match &self.tls {
            Some((_, connector)) => {
                let (client, connection) =
                    endpoint.config.connect(connector.clone()).await.map_err(|e| ConnectError::at(endpoint, e))?;
                tokio::spawn(drive(connection));
                client
            }
            None => {
                let (client, connection) =
                    endpoint.config.connect(NoTls).await.map_err(|e| ConnectError::at(endpoint, e))?;
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
        let Endpoint { host, port, .. } = self.endpoint();
        ReplicationConfig::new(host, &self.user, &self.password, &self.database, slot, publication)
            .with_port(*port)
            .with_binary(binary)
            .with_tls(match &self.tls {
                Some((tls, _)) => tls.replication(host),
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

/// `config`'s login and session settings, for `host:port` alone.
fn alone(config: &Config, host: &str, port: u16) -> Config {
    let mut c = Config::new();
    c.host(host).port(port);
    if let Some(user) = config.get_user() {
        c.user(user);
    }
    if let Some(password) = config.get_password() {
        c.password(password);
    }
    if let Some(dbname) = config.get_dbname() {
        c.dbname(dbname);
    }
    if let Some(options) = config.get_options() {
        c.options(options);
    }
    if let Some(name) = config.get_application_name() {
        c.application_name(name);
    }
    if let Some(timeout) = config.get_connect_timeout() {
        c.connect_timeout(*timeout);
    }
    if let Some(timeout) = config.get_tcp_user_timeout() {
        c.tcp_user_timeout(*timeout);
    }
    c.keepalives(config.get_keepalives()).keepalives_idle(config.get_keepalives_idle());
    if let Some(interval) = config.get_keepalives_interval() {
        c.keepalives_interval(interval);
    }
    if let Some(retries) = config.get_keepalives_retries() {
        c.keepalives_retries(retries);
    }
    c.ssl_mode(config.get_ssl_mode())
        .ssl_negotiation(config.get_ssl_negotiation())
        .channel_binding(config.get_channel_binding())
        .target_session_attrs(config.get_target_session_attrs());
    c
}

/// Runs a SQL session's connection until its client drops.
async fn drive<F: Future<Output = Result<(), tokio_postgres::Error>>>(connection: F) {
    if let Err(e) = connection.await {
        tracing::debug!(error = %e, "postgres connection closed");
    }
}

/// A failed connection, shown with the server's own message ("password authentication failed
/// for user …") where `tokio_postgres` alone would say "db error". With several hosts in the
/// URL it is the last host's error, and the message names what each host said.
#[derive(Debug)]
pub struct ConnectError {
    /// The last host's error (its SQLSTATE classifies the failure).
    pub error: tokio_postgres::Error,
    /// `host:port`, when the URL names several hosts.
    host: Option<String>,
    /// What the hosts tried before it said, in the URL's order.
    others: Vec<String>,
}

impl ConnectError {
    fn at(endpoint: &Endpoint, error: tokio_postgres::Error) -> Self {
        ConnectError { error, host: Some(format!("{}:{}", endpoint.host, endpoint.port)), others: Vec::new() }
    }
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.others.is_empty() {
            f.write_str("no host of the URL accepts writes: ")?;
            for other in &self.others {
                write!(f, "{other}; ")?;
            }
        }
        if let (Some(host), false) = (&self.host, self.others.is_empty()) {
            write!(f, "{host}: ")?;
        }
        let text = match self.error.as_db_error() {
            Some(db) => format!("{}: {} (SQLSTATE {})", db.severity(), db.message(), db.code().code()),
            None => match std::error::Error::source(&self.error) {
                Some(cause) => format!("{}: {cause}", self.error),
                None => self.error.to_string(),
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
    } else if message.contains("does not allow writes") {
        Some("a standby in recovery: the streamer needs the primary; name it in the URL, or promote this server")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_hosts_are_kept_in_order_with_their_ports_and_must_accept_writes() {
        let t = PgTarget::from_url("postgres://u:secret@a:5433,b:5434/db", None).unwrap();
        assert_eq!(t.display(), "u@a:5433,b:5434/db");
        assert!(!format!("{t:?}").contains("secret"));
        assert_eq!(t.reached(), "a:5433", "the first host until a session reached another");
        assert!(t.hosts.iter().all(|e| e.config.get_target_session_attrs() == TargetSessionAttrs::ReadWrite));
        assert!(t.hosts.iter().all(|e| e.config.get_hosts().len() == 1 && e.config.get_dbname() == Some("db")));
        t.current.store(1, Ordering::Relaxed);
        assert_eq!(t.clone().reached(), "b:5434", "clones share where the last session went");
        let r = t.replication("slot", "pub", Duration::from_secs(1), true);
        assert_eq!((r.host.as_str(), r.port), ("b", 5434));
    }

    #[test]
    fn one_port_serves_every_host_and_a_mismatch_is_refused() {
        let t = PgTarget::from_url("host=a,b port=6000 user=u dbname=db", None).unwrap();
        assert_eq!(t.display(), "u@a:6000,b:6000/db");
        let t = PgTarget::from_url("postgres://u@a,b:6000/db", None).unwrap();
        assert_eq!(t.display(), "u@a:5432,b:6000/db", "in a URL, a host without a port has the default one");
        let one = PgTarget::from_url("postgres://u@a/db", None).unwrap();
        assert_eq!(
            one.hosts[0].config.get_target_session_attrs(),
            TargetSessionAttrs::Any,
            "one host: as the URL says"
        );
        let e = PgTarget::from_url("host=a,b,c port=1,2 user=u", None).unwrap_err();
        assert!(e.to_string().contains("3 hosts but 2 ports"), "{e}");
    }

    /// Two ports nothing listens on: the error names each host and what it said, in order.
    #[tokio::test]
    async fn when_no_host_answers_the_error_names_each_one() {
        let closed = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (a, b) = (closed(), closed());
        let t = PgTarget::from_url(&format!("postgres://u:secret@127.0.0.1:{a},127.0.0.1:{b}/db"), None).unwrap();
        let text = t.connect().await.expect_err("nothing listens").to_string();
        let first = text.find(&format!("127.0.0.1:{a}: ")).expect(&text);
        let second = text.find(&format!("127.0.0.1:{b}: ")).expect(&text);
        assert!(text.starts_with("no host of the URL accepts writes: ") && first < second, "{text}");
        assert!(!text.contains("secret"), "{text}");
    }
}
