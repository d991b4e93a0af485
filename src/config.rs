//! The TOML configuration, its defaults and its validation.
//!
//! ```toml
//! [kafka]
//! brokers = "127.0.0.1:9092"
//!
//! [[source]]
//! name = "app"
//! kind = "postgres"
//! url = "postgres://outbox_streamer@127.0.0.1:5432/app"
//! password_env = "OUTBOX_APP_PASSWORD"   # or password_file, or in the URL
//! shards = 2
//! partitions = 1
//!
//! [source.defaults]          # every shard-partition of this source
//! linger_ms = 5
//!
//! [[source.override]]        # one shard (or one shard-partition) differs
//! shard = 1
//! linger_ms = 0
//! ```
//!
//! String values may use `${VAR}` to read an environment variable (expanded after parsing, so a
//! value is never TOML); `OUTBOX_KAFKA_BROKERS` and `OUTBOX_METRICS_LISTEN` override their
//! settings outright.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::names::StreamId;
use crate::secret::SecretUrl;
use crate::tls::TlsSettings;

pub(crate) const DEFAULT_SHARDS: u32 = 2;
pub(crate) const DEFAULT_PARTITIONS: u32 = 1;
pub(crate) const DEFAULT_TABLE_PREFIX: &str = "outbox";
pub(crate) const DEFAULT_BROKERS: &str = "127.0.0.1:9092";
pub(crate) const DEFAULT_MESSAGE_TIMEOUT_MS: u64 = 30_000;
pub(crate) const DEFAULT_LINGER_MS: u64 = 5;
pub(crate) const DEFAULT_COMPRESSION: Compression = Compression::Lz4;
pub(crate) const DEFAULT_MAX_IN_FLIGHT_BYTES: u64 = 64 * 1024 * 1024;
pub(crate) const DEFAULT_CLEANUP_INTERVAL_MS: u64 = 20;
pub(crate) const DEFAULT_CLEANUP_MAX_ROWS: usize = 10_000;
pub(crate) const DEFAULT_STATUS_INTERVAL_MS: u64 = 1_000;
pub(crate) const DEFAULT_POLL_BATCH: u32 = 1024;
pub(crate) const DEFAULT_POLL_INTERVAL_MS: u64 = 25;
pub(crate) const DEFAULT_SWEEP_INTERVAL_MS: u64 = 30_000;
/// The first wait before a halted shard-partition tries again; it doubles up to 5 minutes.
pub(crate) const DEFAULT_HALT_RETRY_MS: u64 = 30_000;
pub(crate) const MAX_SHARDS: u32 = 1024;
pub(crate) const MAX_PARTITIONS: u32 = 1024;

/// An error in the configuration; names the setting and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The cause is the error's source, not part of its message: callers print the chain.
    #[error("cannot read config file {path}{hint}")]
    Read {
        path: PathBuf,
        /// What to do when the file is not there.
        hint: &'static str,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), message: message.into() }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Config {
    #[serde(default)]
    pub kafka: KafkaConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default, rename = "source")]
    pub sources: Vec<SourceConfig>,
    /// Absent: this one instance owns every shard-partition (no ZooKeeper needed).
    pub coordination: Option<CoordinationConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct KafkaConfig {
    #[serde(default = "default_brokers")]
    pub brokers: String,
    /// How long librdkafka retries one record before the streamer resends from its last
    /// confirmed position.
    #[serde(default = "default_message_timeout_ms")]
    pub message_timeout_ms: u64,
    /// Any other librdkafka producer property (security settings, batch sizes, …).
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// librdkafka's `sasl.password` from this environment variable instead of `properties`.
    pub sasl_password_env: Option<String>,
    /// librdkafka's `sasl.password` from the first line of this file instead of `properties`.
    pub sasl_password_file: Option<PathBuf>,
    /// `[kafka.tls]`: TLS to the brokers, translated into librdkafka's `ssl.*` properties.
    pub tls: Option<TlsSettings>,
}

impl KafkaConfig {
    /// `properties` with `sasl.password` filled from `sasl_password_env` or `sasl_password_file`
    /// and the `ssl.*` properties of `tls`.
    pub(crate) fn producer_properties(&self) -> Result<BTreeMap<String, String>, ConfigError> {
        let mut properties = self.properties.clone();
        if let Some(tls) = &self.tls {
            properties.extend(tls.kafka_properties(&self.properties));
        }
        let secret = match (&self.sasl_password_env, &self.sasl_password_file) {
            (Some(var), _) => {
                Some(std::env::var(var).map_err(|_| {
                    invalid("kafka.sasl_password_env", format!("environment variable {var} is not set"))
                })?)
            }
            (None, Some(path)) => Some(
                std::fs::read_to_string(path)
                    .map_err(|e| invalid("kafka.sasl_password_file", format!("cannot read {}: {e}", path.display())))?
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string(),
            ),
            (None, None) => None,
        };
        if let Some(secret) = secret {
            properties.insert("sasl.password".into(), secret);
        }
        Ok(properties)
    }
}

impl Default for KafkaConfig {
    fn default() -> Self {
        Self {
            brokers: default_brokers(),
            message_timeout_ms: DEFAULT_MESSAGE_TIMEOUT_MS,
            properties: BTreeMap::new(),
            sasl_password_env: None,
            sasl_password_file: None,
            tls: None,
        }
    }
}

fn default_brokers() -> String {
    DEFAULT_BROKERS.into()
}
fn default_message_timeout_ms() -> u64 {
    DEFAULT_MESSAGE_TIMEOUT_MS
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MetricsConfig {
    /// Address of the Prometheus endpoint (`/metrics`); keep it on loopback or a private network.
    pub listen: Option<SocketAddr>,
    /// `/readyz` answers 200 while a shard-partition is halted (off: a halt is not ready).
    #[serde(default)]
    pub ready_when_halted: bool,
    /// `host:port` at which other hosts reach `listen`; published in ZooKeeper so that
    /// `status` can ask the owner of a shard-partition what it is doing.
    pub advertise: Option<String>,
}

impl MetricsConfig {
    /// Where `status` may ask this instance for its streams: `advertise`, else `listen` (this
    /// host's name in place of an unspecified address such as `0.0.0.0`).
    pub(crate) fn advertised_address(&self) -> Option<String> {
        if let Some(advertise) = &self.advertise {
            return Some(advertise.clone());
        }
        let listen = self.listen?;
        Some(if listen.ip().is_unspecified() {
            format!("{}:{}", hostname(), listen.port())
        } else {
            listen.to_string()
        })
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let Some(advertise) = &self.advertise else { return Ok(()) };
        if self.listen.is_none() {
            return Err(invalid(
                "metrics.advertise",
                "needs metrics.listen: it says where other hosts reach that address",
            ));
        }
        let valid = advertise.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty()
                && !host.contains(|c: char| c.is_whitespace() || c.is_control() || c == '/')
                && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
        if !valid {
            return Err(invalid(
                "metrics.advertise",
                "must be host:port, the address other hosts reach metrics.listen at (e.g. \"10.0.0.7:9187\" or \"streamer-1.internal:9187\")",
            ));
        }
        Ok(())
    }
}

/// This host's name (`/proc/sys/kernel/hostname`), or `host` when it cannot be read.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "host".into())
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CoordinationConfig {
    /// Required so a config names its coordinator; ZooKeeper is the only kind today.
    #[expect(dead_code, reason = "one kind exists; the field keeps configs explicit for the next")]
    pub kind: CoordinationKind,
    /// The ensemble: `host:port[,host:port…]`.
    pub connect: String,
    /// Instances with the same cluster name share the shard-partitions of their sources.
    #[serde(default = "default_cluster_name")]
    pub cluster_name: String,
    /// Parent of every cluster's nodes.
    #[serde(default = "default_root")]
    pub root: String,
    /// This instance's name in ZooKeeper, `status` and the PostgreSQL `application_name`;
    /// defaults to `<hostname>-<pid>`. Must differ between live instances.
    pub instance: Option<String>,
    /// The ZooKeeper session timeout. A dead instance's shard-partitions move after about
    /// this long; a live one stops producing after half of it without an answer from
    /// ZooKeeper.
    #[serde(default = "default_session_timeout_ms")]
    pub session_timeout_ms: u64,
    /// Give up each owned shard-partition after owning it this long, so ownership spreads
    /// over time (off by default).
    pub yield_interval_s: Option<u64>,
    /// `[coordination.tls]`: TLS to ZooKeeper's secure client port (plaintext when left out).
    pub tls: Option<TlsSettings>,
}

impl CoordinationConfig {
    /// The configured instance name, or `<hostname>-<pid>`.
    pub(crate) fn instance_name(&self) -> String {
        self.instance.clone().unwrap_or_else(|| format!("{}-{}", hostname(), std::process::id()))
    }
}

fn default_cluster_name() -> String {
    "default".into()
}

fn default_root() -> String {
    "/outbox-streamer".into()
}

pub(crate) const DEFAULT_SESSION_TIMEOUT_MS: u64 = 10_000;

fn default_session_timeout_ms() -> u64 {
    DEFAULT_SESSION_TIMEOUT_MS
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum CoordinationKind {
    Zookeeper,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum SourceKind {
    Postgres,
    Mysql,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SourceConfig {
    /// A short label for logs, metrics and `status`.
    pub name: String,
    pub kind: SourceKind,
    /// Connection URL of the streamer's own login (replication and its outbox tables only).
    pub url: SecretUrl,
    /// Read the password from this environment variable instead of the URL.
    pub password_env: Option<String>,
    /// Read the password from this file (first line) instead of the URL.
    pub password_file: Option<PathBuf>,
    #[serde(default = "default_table_prefix")]
    pub table_prefix: String,
    /// PostgreSQL: name the slots `<slot_prefix>_<shard>_<partition>` instead of after the
    /// tables. Slot names are cluster-wide: a second database of a cluster whose default slot
    /// names are taken by another database sets one (`setup` says so and suggests a value).
    pub slot_prefix: Option<String>,
    #[serde(default = "default_shards")]
    pub shards: u32,
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    #[serde(default)]
    pub defaults: StreamOverrides,
    #[serde(default, rename = "override")]
    pub overrides: Vec<StreamOverrides>,
    /// PostgreSQL: emit a `pg_logical_emit_message` heartbeat this often (off by default;
    /// idle slots are confirmed from the server's keepalives anyway).
    pub heartbeat_interval_ms: Option<u64>,
    /// `[source.tls]`: encryption to the database (plaintext when left out).
    pub tls: Option<TlsSettings>,
}

fn default_table_prefix() -> String {
    DEFAULT_TABLE_PREFIX.into()
}
fn default_shards() -> u32 {
    DEFAULT_SHARDS
}
fn default_partitions() -> u32 {
    DEFAULT_PARTITIONS
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Mode {
    /// Logical replication (PostgreSQL) or the binlog (MySQL/MariaDB).
    Cdc,
    /// `SELECT … ORDER BY id LIMIT n` → publish → `DELETE`.
    Polling,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Compression {
    None,
    Gzip,
    Snappy,
    Lz4,
    Zstd,
}

impl Compression {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Gzip => "gzip",
            Compression::Snappy => "snappy",
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
        }
    }
}

/// What happens to a row that can never become a Kafka record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum BadRowPolicy {
    /// Stop this shard-partition with an error naming the row; the others keep running.
    Halt,
    /// Publish the row to `dead_letter_topic` with the reason in headers, then go on.
    DeadLetter,
}

/// Settings of one shard-partition; in `defaults` or in an `override` that names a shard
/// (and optionally a partition). Unset fields inherit. Serialises to the keys it sets.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StreamOverrides {
    /// Only in `[[source.override]]`: the shard this applies to.
    pub shard: Option<u32>,
    /// Only in `[[source.override]]`: narrows it to one partition of that shard.
    pub partition: Option<u32>,
    pub mode: Option<Mode>,
    pub linger_ms: Option<u64>,
    pub compression: Option<Compression>,
    pub on_bad_row: Option<BadRowPolicy>,
    pub dead_letter_topic: Option<String>,
    pub max_in_flight_bytes: Option<u64>,
    pub cleanup_interval_ms: Option<u64>,
    pub cleanup_max_rows: Option<usize>,
    pub status_interval_ms: Option<u64>,
    pub poll_batch: Option<u32>,
    pub poll_interval_ms: Option<u64>,
    /// How often a CDC stream looks for rows the log never carried (see `docs/architecture.md`).
    pub sweep_interval_ms: Option<u64>,
    /// How soon a halted shard-partition first tries again (see `docs/operations.md`).
    pub halt_retry_ms: Option<u64>,
}

/// The resolved settings of one shard-partition; serialises with the keys of
/// [`StreamOverrides`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct StreamSettings {
    pub mode: Mode,
    pub linger_ms: u64,
    pub compression: Compression,
    pub on_bad_row: BadRowPolicy,
    pub dead_letter_topic: Option<String>,
    pub max_in_flight_bytes: u64,
    pub cleanup_interval_ms: u64,
    pub cleanup_max_rows: usize,
    pub status_interval_ms: u64,
    pub poll_batch: u32,
    pub poll_interval_ms: u64,
    pub sweep_interval_ms: u64,
    pub halt_retry_ms: u64,
}

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            mode: Mode::Cdc,
            linger_ms: DEFAULT_LINGER_MS,
            compression: DEFAULT_COMPRESSION,
            on_bad_row: BadRowPolicy::Halt,
            dead_letter_topic: None,
            max_in_flight_bytes: DEFAULT_MAX_IN_FLIGHT_BYTES,
            cleanup_interval_ms: DEFAULT_CLEANUP_INTERVAL_MS,
            cleanup_max_rows: DEFAULT_CLEANUP_MAX_ROWS,
            status_interval_ms: DEFAULT_STATUS_INTERVAL_MS,
            poll_batch: DEFAULT_POLL_BATCH,
            poll_interval_ms: DEFAULT_POLL_INTERVAL_MS,
            sweep_interval_ms: DEFAULT_SWEEP_INTERVAL_MS,
            halt_retry_ms: DEFAULT_HALT_RETRY_MS,
        }
    }
}

impl StreamSettings {
    fn apply(&mut self, o: &StreamOverrides) {
        if let Some(v) = o.mode {
            self.mode = v;
        }
        if let Some(v) = o.linger_ms {
            self.linger_ms = v;
        }
        if let Some(v) = o.compression {
            self.compression = v;
        }
        if let Some(v) = o.on_bad_row {
            self.on_bad_row = v;
        }
        if let Some(v) = &o.dead_letter_topic {
            self.dead_letter_topic = Some(v.clone());
        }
        if let Some(v) = o.max_in_flight_bytes {
            self.max_in_flight_bytes = v;
        }
        if let Some(v) = o.cleanup_interval_ms {
            self.cleanup_interval_ms = v;
        }
        if let Some(v) = o.cleanup_max_rows {
            self.cleanup_max_rows = v;
        }
        if let Some(v) = o.status_interval_ms {
            self.status_interval_ms = v;
        }
        if let Some(v) = o.poll_batch {
            self.poll_batch = v;
        }
        if let Some(v) = o.poll_interval_ms {
            self.poll_interval_ms = v;
        }
        if let Some(v) = o.sweep_interval_ms {
            self.sweep_interval_ms = v;
        }
        if let Some(v) = o.halt_retry_ms {
            self.halt_retry_ms = v;
        }
    }
}

impl SourceConfig {
    /// The names of shard-partition `id`'s table, publication and slot (see `names.rs`).
    pub(crate) fn stream_names(&self, id: StreamId) -> crate::names::StreamNames {
        crate::names::stream_names(&self.table_prefix, self.slot_prefix.as_deref(), id)
    }

    /// The settings of one shard-partition: defaults, then shard overrides, then
    /// shard-partition overrides.
    pub(crate) fn settings_for(&self, id: StreamId) -> StreamSettings {
        let mut s = StreamSettings::default();
        for (_, layer) in self.layers_for(id) {
            s.apply(layer);
        }
        s
    }

    /// What sets shard-partition `id`'s settings over the built-in defaults, in the order it
    /// applies, each named as in the file: `defaults`, then `override[i] (shard S)` for the
    /// shard's overrides, then `override[i] (shard S, partition P)` for the shard-partition's.
    pub(crate) fn layers_for(&self, id: StreamId) -> Vec<(String, &StreamOverrides)> {
        let mut layers = vec![("defaults".to_string(), &self.defaults)];
        for partition in [None, Some(id.partition)] {
            for (i, o) in self.overrides.iter().enumerate() {
                if o.shard == Some(id.shard) && o.partition == partition {
                    let scope = match partition {
                        None => format!("shard {}", id.shard),
                        Some(p) => format!("shard {}, partition {p}", id.shard),
                    };
                    layers.push((format!("override[{i}] ({scope})"), o));
                }
            }
        }
        layers
    }

    /// The password from `password_env` or `password_file`, if either is set.
    pub(crate) fn password(&self) -> Result<Option<String>, ConfigError> {
        let field = |f: &str| format!("source[{}].{f}", self.name);
        if let Some(var) = &self.password_env {
            return std::env::var(var)
                .map(Some)
                .map_err(|_| invalid(field("password_env"), format!("environment variable {var} is not set")));
        }
        if let Some(path) = &self.password_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| invalid(field("password_file"), format!("cannot read {}: {e}", path.display())))?;
            return Ok(Some(text.lines().next().unwrap_or_default().to_string()));
        }
        Ok(None)
    }
}

impl Config {
    /// Reads, expands `${VAR}`, applies environment overrides and validates.
    pub(crate) fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            hint: match source.kind() {
                std::io::ErrorKind::NotFound => " (give its path with --config FILE or OUTBOX_CONFIG)",
                _ => "",
            },
            source,
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: path.into(), message },
            other => other,
        })
    }

    pub(crate) fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Self::from_toml_with(text, &|name| std::env::var(name).ok())
    }

    /// [`Config::from_toml`] with `env` in place of the process environment.
    ///
    /// The file is parsed first; `${VAR}` references are then replaced inside string values
    /// only, so a value can neither break the file's syntax nor add keys. Errors say where
    /// (line and column, a setting's name) but never quote the file's text or a value read
    /// from the environment: either may be a password.
    pub(crate) fn from_toml_with(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let table: toml::Table = text.parse().map_err(|e| parse_error(text, &e))?;
        let mut expanded = table.clone();
        let mut replaced = Vec::new();
        for (key, value) in expanded.iter_mut() {
            expand_value(key, value, env, &mut replaced)?;
        }
        let mut config = match Config::deserialize(toml::Value::Table(expanded)) {
            Ok(config) => config,
            // Report the mistake as the file has it, where it is: the unexpanded text fails
            // the same way unless an expanded value caused it.
            Err(e) => match toml::from_str::<Config>(text) {
                Err(located) => return Err(parse_error(text, &located)),
                Ok(_) => {
                    let mut message = e.message().to_string();
                    replaced.sort_by_key(|(value, _): &(String, String)| std::cmp::Reverse(value.len()));
                    for (value, reference) in &replaced {
                        let escaped = format!("{value:?}");
                        message = message.replace(&escaped[1..escaped.len() - 1], reference).replace(value, reference);
                    }
                    return Err(ConfigError::Parse {
                        path: PathBuf::new(),
                        message: format!("{message} (in a value read from the environment)"),
                    });
                }
            },
        };
        if let Some(brokers) = env("OUTBOX_KAFKA_BROKERS") {
            config.kafka.brokers = brokers;
        }
        if let Some(listen) = env("OUTBOX_METRICS_LISTEN") {
            config.metrics.listen = Some(
                listen
                    .parse()
                    .map_err(|_| invalid("OUTBOX_METRICS_LISTEN", "must be an address such as 127.0.0.1:9187"))?,
            );
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks every setting; the error names the first bad field.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let brokers: Vec<&str> = self.kafka.brokers.split(',').map(str::trim).collect();
        if brokers.iter().any(|b| b.is_empty() || b.contains(|c: char| c.is_whitespace() || c.is_control())) {
            return Err(invalid(
                "kafka.brokers",
                "must list host:port entries separated by commas, none of them empty or with spaces (e.g. \"kafka-1:9092,kafka-2:9092\")",
            ));
        }
        if self.kafka.message_timeout_ms < 1000 {
            return Err(invalid("kafka.message_timeout_ms", "must be at least 1000"));
        }
        for key in self.kafka.properties.keys() {
            let field = format!("kafka.properties.{key:?}");
            match outbox_kafka::producer::reserved_property(key) {
                Some("message.timeout.ms") => {
                    return Err(invalid(
                        field,
                        "is set from kafka.message_timeout_ms, which outbox-streamer caps under [coordination] so a queued record cannot outlive the lease; remove it and set kafka.message_timeout_ms instead",
                    ));
                }
                Some(canonical) => {
                    let alias =
                        if canonical == key { String::new() } else { format!(" (librdkafka's alias of {canonical})") };
                    return Err(invalid(
                        field,
                        format!("is fixed by outbox-streamer for ordering and idempotence{alias}; remove it"),
                    ));
                }
                None => {}
            }
        }
        let password_sources = [
            self.kafka.properties.contains_key("sasl.password"),
            self.kafka.sasl_password_env.is_some(),
            self.kafka.sasl_password_file.is_some(),
        ];
        if let Some(tls) = &self.kafka.tls {
            tls.validate_for_kafka("kafka.tls", &self.kafka.properties)?;
        }
        if password_sources.iter().filter(|set| **set).count() > 1 {
            return Err(invalid(
                "kafka.sasl_password_env",
                "give the SASL password once: properties.\"sasl.password\", sasl_password_env or sasl_password_file",
            ));
        }
        self.metrics.validate()?;
        if self.sources.is_empty() {
            return Err(invalid("source", "at least one [[source]] is needed"));
        }
        if let Some(c) = &self.coordination {
            if c.connect.trim().is_empty() {
                return Err(invalid(
                    "coordination.connect",
                    "must list the ZooKeeper ensemble as host:port[,host:port…]",
                ));
            }
            if !c.root.starts_with('/') || c.root.len() < 2 {
                return Err(invalid(
                    "coordination.root",
                    "must be an absolute ZooKeeper path such as /outbox-streamer",
                ));
            }
            if c.cluster_name.is_empty() || c.cluster_name.contains('/') {
                return Err(invalid("coordination.cluster_name", "must be non-empty and without '/'"));
            }
            if !(2_000..=600_000).contains(&c.session_timeout_ms) {
                return Err(invalid(
                    "coordination.session_timeout_ms",
                    "must be between 2000 and 600000 (ZooKeeper negotiates it within 2 and 20 tick times)",
                ));
            }
            let bad_instance = |i: &str| {
                i.is_empty()
                    || i.chars().count() > 40
                    || i.contains(|c: char| c == '/' || c.is_whitespace() || c.is_control())
            };
            if c.instance.as_deref().is_some_and(bad_instance) {
                return Err(invalid(
                    "coordination.instance",
                    "must be 1 to 40 characters without '/', spaces, tabs or other control characters (it goes into node data and application_name); use e.g. the host name",
                ));
            }
            if c.yield_interval_s == Some(0) {
                return Err(invalid("coordination.yield_interval_s", "must be at least 1, or left out to never yield"));
            }
            if let Some(tls) = &c.tls {
                tls.validate_for_zookeeper("coordination.tls")?;
            }
        }
        let mut names = HashSet::new();
        let mut prefixes = HashSet::new();
        for (i, s) in self.sources.iter().enumerate() {
            let f = |field: &str| format!("source[{i}].{field}");
            if s.name.is_empty() || !s.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
                return Err(invalid(f("name"), "must be non-empty letters, digits, '_' or '-'"));
            }
            if !names.insert(s.name.clone()) {
                return Err(invalid(f("name"), format!("{:?} is used by two sources", s.name)));
            }
            if !prefixes.insert((s.url.redacted(), s.table_prefix.clone())) {
                return Err(invalid(f("table_prefix"), "two sources use the same database and prefix"));
            }
            if s.url.expose().trim().is_empty() {
                return Err(invalid(f("url"), "must be a connection URL"));
            }
            if !crate::names::valid_prefix(&s.table_prefix) {
                return Err(invalid(f("table_prefix"), "must be lowercase letters, digits and '_', at most 40"));
            }
            if let Some(slot_prefix) = &s.slot_prefix {
                if s.kind != SourceKind::Postgres {
                    return Err(invalid(f("slot_prefix"), "only PostgreSQL sources have replication slots"));
                }
                if !crate::names::valid_prefix(slot_prefix) {
                    return Err(invalid(f("slot_prefix"), "must be lowercase letters, digits and '_', at most 40"));
                }
            }
            if s.shards == 0 || s.shards > MAX_SHARDS {
                return Err(invalid(f("shards"), format!("must be between 1 and {MAX_SHARDS}")));
            }
            if s.partitions == 0 || s.partitions > MAX_PARTITIONS {
                return Err(invalid(f("partitions"), format!("must be between 1 and {MAX_PARTITIONS}")));
            }
            if s.heartbeat_interval_ms.is_some_and(|v| !(100..=3_600_000).contains(&v)) {
                return Err(invalid(f("heartbeat_interval_ms"), "must be between 100 and 3600000"));
            }
            if s.password_env.is_some() && s.password_file.is_some() {
                return Err(invalid(f("password_env"), "set password_env or password_file, not both"));
            }
            if let Some(tls) = &s.tls {
                tls.validate(&f("tls"))?;
            }
            if s.defaults.shard.is_some() || s.defaults.partition.is_some() {
                return Err(invalid(f("defaults"), "shard and partition belong in [[source.override]]"));
            }
            check_overrides(&f("defaults"), &s.defaults)?;
            for (j, o) in s.overrides.iter().enumerate() {
                let of = f(&format!("override[{j}]"));
                match o.shard {
                    None => return Err(invalid(format!("{of}.shard"), "is required in an override")),
                    Some(shard) if shard >= s.shards => {
                        return Err(invalid(format!("{of}.shard"), format!("must be below shards = {}", s.shards)));
                    }
                    _ => {}
                }
                if o.partition.is_some_and(|p| p >= s.partitions) {
                    return Err(invalid(
                        format!("{of}.partition"),
                        format!("must be below partitions = {}", s.partitions),
                    ));
                }
                check_overrides(&of, o)?;
            }
            for id in crate::names::all_streams(s.shards, s.partitions) {
                let st = s.settings_for(id);
                if st.on_bad_row == BadRowPolicy::DeadLetter && st.dead_letter_topic.is_none() {
                    return Err(invalid(
                        f("defaults.dead_letter_topic"),
                        format!(
                            "shard-partition {id} uses on_bad_row = \"dead-letter\" but names no dead_letter_topic"
                        ),
                    ));
                }
            }
        }
        if let Some(c) = &self.coordination
            && c.connect.trim().is_empty()
        {
            return Err(invalid("coordination.connect", "must list ZooKeeper host:port pairs"));
        }
        Ok(())
    }
}

fn check_overrides(field: &str, o: &StreamOverrides) -> Result<(), ConfigError> {
    if o.linger_ms.is_some_and(|v| v > 60_000) {
        return Err(invalid(format!("{field}.linger_ms"), "must be at most 60000"));
    }
    if o.max_in_flight_bytes == Some(0) {
        return Err(invalid(format!("{field}.max_in_flight_bytes"), "must be greater than 0"));
    }
    if o.cleanup_interval_ms == Some(0) {
        return Err(invalid(format!("{field}.cleanup_interval_ms"), "must be greater than 0"));
    }
    if o.cleanup_max_rows == Some(0) {
        return Err(invalid(format!("{field}.cleanup_max_rows"), "must be greater than 0"));
    }
    if o.status_interval_ms.is_some_and(|v| !(10..=60_000).contains(&v)) {
        return Err(invalid(format!("{field}.status_interval_ms"), "must be between 10 and 60000"));
    }
    if o.poll_batch.is_some_and(|v| v == 0 || v > 100_000) {
        return Err(invalid(format!("{field}.poll_batch"), "must be between 1 and 100000"));
    }
    if o.poll_interval_ms.is_some_and(|v| !(1..=60_000).contains(&v)) {
        return Err(invalid(format!("{field}.poll_interval_ms"), "must be between 1 and 60000"));
    }
    if o.sweep_interval_ms.is_some_and(|v| !(100..=3_600_000).contains(&v)) {
        return Err(invalid(format!("{field}.sweep_interval_ms"), "must be between 100 and 3600000"));
    }
    if o.halt_retry_ms.is_some_and(|v| !(100..=300_000).contains(&v)) {
        return Err(invalid(format!("{field}.halt_retry_ms"), "must be between 100 and 300000"));
    }
    if o.dead_letter_topic.as_deref().is_some_and(|t| !is_kafka_topic_name(t)) {
        return Err(invalid(
            format!("{field}.dead_letter_topic"),
            "must be a Kafka topic name: 1 to 249 characters of [a-zA-Z0-9._-], not \".\" or \"..\"",
        ));
    }
    Ok(())
}

/// Whether the broker accepts `name` as a topic name.
fn is_kafka_topic_name(name: &str) -> bool {
    (1..=249).contains(&name.len())
        && name != "."
        && name != ".."
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// A TOML error as `line L, column C: message`, without the snippet of the file that toml
/// prints (the line may hold a password).
fn parse_error(text: &str, e: &toml::de::Error) -> ConfigError {
    let message = match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!("line {line}, column {column}: {}", e.message().trim_end())
        }
        None => e.message().trim_end().to_string(),
    };
    ConfigError::Parse { path: PathBuf::new(), message }
}

/// Replaces `${VAR}` in every string inside `value` (at `path`, for errors) with the
/// variable's value; records each changed string as (expanded, as written).
fn expand_value(
    path: &str,
    value: &mut toml::Value,
    env: &dyn Fn(&str) -> Option<String>,
    replaced: &mut Vec<(String, String)>,
) -> Result<(), ConfigError> {
    match value {
        toml::Value::String(s) if s.contains("${") => {
            let expanded = expand_string(path, s, env)?;
            replaced.push((expanded.clone(), std::mem::replace(s, expanded)));
        }
        toml::Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                expand_value(&format!("{path}[{i}]"), item, env, replaced)?;
            }
        }
        toml::Value::Table(table) => {
            for (key, item) in table.iter_mut() {
                expand_value(&format!("{path}.{key}"), item, env, replaced)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// `text` with each `${VAR}` replaced by the variable's value; an unset variable is an error
/// naming it and the setting (never a value).
fn expand_string(path: &str, text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| invalid(path, "has a ${ without its closing }"))?;
        let var = &after[..end];
        let value = env(var).ok_or_else(|| {
            invalid(path, format!("refers to ${{{var}}}, but the environment variable {var} is not set"))
        })?;
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        [[source]]
        name = "app"
        kind = "postgres"
        url = "postgres://u:pw@localhost/app"
    "#;

    #[test]
    fn defaults() {
        let c = Config::from_toml(MINIMAL).unwrap();
        let s = &c.sources[0];
        assert_eq!((s.shards, s.partitions), (DEFAULT_SHARDS, DEFAULT_PARTITIONS));
        assert_eq!(s.settings_for(StreamId { shard: 0, partition: 0 }), StreamSettings::default());
        assert!(c.coordination.is_none());
    }

    #[test]
    fn overrides_apply_shard_then_partition() {
        let c = Config::from_toml(&format!(
            "{MINIMAL}
            partitions = 2
            [source.defaults]
            linger_ms = 10
            [[source.override]]
            shard = 1
            linger_ms = 0
            compression = \"zstd\"
            [[source.override]]
            shard = 1
            partition = 1
            compression = \"none\"
            "
        ))
        .unwrap();
        let s = &c.sources[0];
        assert_eq!(s.settings_for(StreamId { shard: 0, partition: 0 }).linger_ms, 10);
        let a = s.settings_for(StreamId { shard: 1, partition: 0 });
        assert_eq!((a.linger_ms, a.compression), (0, Compression::Zstd));
        let b = s.settings_for(StreamId { shard: 1, partition: 1 });
        assert_eq!((b.linger_ms, b.compression), (0, Compression::None));
        let names = |shard, partition| -> Vec<String> {
            s.layers_for(StreamId { shard, partition }).into_iter().map(|(name, _)| name).collect()
        };
        assert_eq!(names(0, 0), ["defaults"]);
        assert_eq!(names(1, 0), ["defaults", "override[0] (shard 1)"]);
        assert_eq!(names(1, 1), ["defaults", "override[0] (shard 1)", "override[1] (shard 1, partition 1)"]);
    }

    #[test]
    fn a_slot_prefix_renames_the_slots_only() {
        let c = Config::from_toml(&format!("{MINIMAL}slot_prefix = \"outbox_billing\"")).unwrap();
        let names = c.sources[0].stream_names(StreamId { shard: 1, partition: 0 });
        assert_eq!((names.table.as_str(), names.slot.as_str()), ("outbox_1_0", "outbox_billing_1_0"));
        let err = Config::from_toml(&format!("{MINIMAL}slot_prefix = \"Billing\"")).unwrap_err().to_string();
        assert!(err.starts_with("source[0].slot_prefix:"), "{err}");
        let mysql = MINIMAL.replace("postgres", "mysql");
        let err = Config::from_toml(&format!("{mysql}slot_prefix = \"x\"")).unwrap_err().to_string();
        assert!(err.contains("only PostgreSQL sources"), "{err}");
    }

    #[test]
    fn errors_name_the_field() {
        let err = |extra: &str| Config::from_toml(&format!("{MINIMAL}{extra}")).unwrap_err().to_string();
        assert!(err("shards = 0").starts_with("source[0].shards:"));
        assert!(err("[[source.override]]\nshard = 5").contains("source[0].override[0].shard"));
        assert!(err("[source.defaults]\non_bad_row = \"dead-letter\"").contains("dead_letter_topic"));
        assert!(err("bogus = 1").contains("unknown field"));
        assert!(err("[source.defaults]\nmax_in_flight_bytes = 0").contains("max_in_flight_bytes"));
        assert!(err("[source.defaults]\nhalt_retry_ms = 50").contains("defaults.halt_retry_ms: must be between 100"));
        let e =
            Config::from_toml("[kafka.properties]\nacks = \"1\"\n[[source]]\nname=\"a\"\nkind=\"postgres\"\nurl=\"x\"")
                .unwrap_err();
        assert!(e.to_string().contains("kafka.properties.\"acks\""), "{e}");
    }

    /// Values that look set but name nothing usable are refused with the field and the fix.
    #[test]
    fn blank_brokers_topics_and_instance_names_are_refused() {
        // Not the process environment: OUTBOX_KAFKA_BROKERS would replace the brokers tested.
        let err = |text: String| with_env(&text, &[]).unwrap_err().to_string();
        let quote = |s: &str| toml::Value::String(s.into()).to_string();
        for brokers in [" , ", "", "a:9092,,b:9092", "a:9092, \t"] {
            let e = err(format!("[kafka]\nbrokers = {}\n{MINIMAL}", quote(brokers)));
            assert!(e.starts_with("kafka.brokers:") && e.contains("host:port"), "{brokers:?}: {e}");
        }
        for topic in ["   ", "dead letters", "dlq/x", "..", "é", &"t".repeat(250)] {
            let e = err(format!(
                "{MINIMAL}\n[source.defaults]\non_bad_row = \"dead-letter\"\ndead_letter_topic = {}",
                quote(topic)
            ));
            assert!(e.contains("defaults.dead_letter_topic") && e.contains("[a-zA-Z0-9._-]"), "{topic:?}: {e}");
        }
        let ok =
            format!("{MINIMAL}\n[source.defaults]\non_bad_row = \"dead-letter\"\ndead_letter_topic = \"app.dlq_1-x\"");
        assert!(with_env(&ok, &[]).is_ok());
        for instance in ["a\tb", "a b", "a\nb", "a\u{0}b", "a\u{a0}b"] {
            let e = err(format!(
                "[coordination]\nkind = \"zookeeper\"\nconnect = \"zk:2181\"\ninstance = {}\n{MINIMAL}",
                quote(instance)
            ));
            assert!(e.starts_with("coordination.instance:"), "{instance:?}: {e}");
        }
    }

    /// The address published for `status`: `advertise`, else `listen` with this host's name for
    /// an unspecified address; a malformed or orphaned `advertise` names the field.
    #[test]
    fn the_metrics_address_published_for_status() {
        let load = |metrics: &str| with_env(&format!("[metrics]\n{metrics}\n{MINIMAL}"), &[]);
        let c = load("listen = \"127.0.0.1:9187\"").unwrap();
        assert_eq!(c.metrics.advertised_address().as_deref(), Some("127.0.0.1:9187"));
        assert!(!c.metrics.ready_when_halted, "a halt is not ready by default");
        let c = load("listen = \"0.0.0.0:9187\"\nready_when_halted = true").unwrap();
        assert_eq!(c.metrics.advertised_address(), Some(format!("{}:9187", hostname())));
        assert!(c.metrics.ready_when_halted);
        let c = load("listen = \"0.0.0.0:9187\"\nadvertise = \"10.0.0.7:9187\"").unwrap();
        assert_eq!(c.metrics.advertised_address().as_deref(), Some("10.0.0.7:9187"));
        assert_eq!(load("").unwrap().metrics.advertised_address(), None);
        for bad in ["10.0.0.7", "h:0", ":9187", "a b:1", "h:port"] {
            let e = load(&format!("listen = \"0.0.0.0:9187\"\nadvertise = \"{bad}\"")).unwrap_err().to_string();
            assert!(e.starts_with("metrics.advertise:") && e.contains("host:port"), "{bad:?}: {e}");
        }
        let e = load("advertise = \"h:1\"").unwrap_err().to_string();
        assert!(e.starts_with("metrics.advertise:") && e.contains("metrics.listen"), "{e}");
    }

    /// The properties the producer fixes, and the message timeout it bounds, are refused under
    /// every librdkafka name.
    #[test]
    fn reserved_kafka_properties_are_refused_under_their_aliases() {
        let with_property = |key: &str| {
            Config::from_toml(&format!("[kafka.properties]\n{key:?} = \"1\"\n{MINIMAL}")).map_err(|e| e.to_string())
        };
        for key in ["message.timeout.ms", "delivery.timeout.ms", "Delivery.Timeout.Ms"] {
            let e = with_property(key).unwrap_err();
            assert!(e.contains(key) && e.contains("kafka.message_timeout_ms"), "{e}");
        }
        for (key, canonical) in [
            ("acks", "acks"),
            ("request.required.acks", "acks"),
            ("max.in.flight", "max.in.flight.requests.per.connection"),
            ("max.in.flight.requests.per.connection", "max.in.flight.requests.per.connection"),
            ("enable.idempotence", "enable.idempotence"),
            ("partitioner", "partitioner"),
        ] {
            let e = with_property(key).unwrap_err();
            assert!(e.contains(&format!("{key:?}")) && e.contains("fixed"), "{e}");
            assert_eq!(e.contains("alias"), key != canonical, "{e}");
        }
        assert!(with_property("batch.size").is_ok());
    }

    #[test]
    fn debug_never_shows_the_password() {
        let c = Config::from_toml(MINIMAL).unwrap();
        assert!(!format!("{c:?}").contains("pw@"));
    }

    /// `${VAR}` references in `text` read from `vars` only.
    fn with_env(text: &str, vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_toml_with(text, &|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    /// [`MINIMAL`] with the password from `${PW}`.
    fn from_env() -> String {
        MINIMAL.replace(":pw@", ":${PW}@")
    }

    #[test]
    fn env_expansion_names_an_unset_variable_and_where_it_is_used() {
        let e = with_env(&from_env(), &[]).unwrap_err().to_string();
        assert!(e.contains("${PW}") && e.contains("source[0].url"), "{e}");
        let c = with_env(&from_env(), &[("PW", "plain")]).unwrap();
        assert_eq!(c.sources[0].url.expose(), "postgres://u:plain@localhost/app");
        assert!(with_env("no = \"vars\"", &[]).unwrap_err().to_string().contains("unknown field"));
    }

    /// An environment value is a string's content, whatever it holds: quotes and backslashes
    /// do not break the file, and nothing in it becomes a key.
    #[test]
    fn env_values_are_string_contents_never_toml() {
        for pw in [r#"a"b"#, r"a\b", "a\"\nshards = 9\n#", "a'b\n[[source]]"] {
            let c = with_env(&from_env(), &[("PW", pw)]).unwrap_or_else(|e| panic!("{pw:?}: {e}"));
            assert_eq!(c.sources.len(), 1, "{pw:?}");
            assert_eq!(c.sources[0].shards, DEFAULT_SHARDS, "{pw:?} injected a key");
            assert_eq!(c.sources[0].url.expose(), format!("postgres://u:{pw}@localhost/app"));
        }
        // Only string values expand: a reference cannot stand for a number or a table.
        assert!(with_env(&format!("{MINIMAL}shards = ${{N}}"), &[("N", "3")]).is_err());
        let c = with_env("[[source]]\nname = \"app\"\nkind = \"${KIND}\"\nurl = \"x\"", &[("KIND", "mysql")]).unwrap();
        assert_eq!(c.sources[0].kind, SourceKind::Mysql);
    }

    /// No error about the file shows a secret: neither an expanded value nor the text of the
    /// line it is on.
    #[test]
    fn config_errors_never_show_secret_values() {
        let secret = "s3cret-value";
        let cases: Vec<(String, Vec<(&str, &str)>)> = vec![
            // A syntax error on the line of a literal password.
            (format!("[[source]]\nname = \"a\"\nkind = \"postgres\"\nurl = \"postgres://u:{secret}@h/db\" x"), vec![]),
            // An expanded value of the wrong kind.
            (format!("{MINIMAL}\n[source.defaults]\nmode = \"${{S}}\""), vec![("S", secret)]),
            (format!("{}\n[metrics]\nlisten = \"${{S}}\"", from_env()), vec![("PW", "x"), ("S", secret)]),
            (format!("{}\nbogus = \"${{S}}\"", from_env()), vec![("PW", secret), ("S", secret)]),
        ];
        for (text, vars) in cases {
            let e = with_env(&text, &vars).unwrap_err().to_string();
            assert!(!e.contains(secret), "the error shows the secret: {e}");
            assert!(e.contains("line "), "the error says where: {e}");
        }
    }
}
