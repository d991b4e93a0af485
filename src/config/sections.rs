//! The sections of the file — `[kafka]`, `[metrics]`, `[coordination]`, `[[source]]` — as
//! typed settings, with their defaults and the limits on shards and partitions.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::stream::StreamOverrides;
use crate::names::StreamId;
use crate::secret::SecretUrl;
use crate::tls::TlsSettings;

pub(crate) const DEFAULT_SHARDS: u32 = 2;
pub(crate) const DEFAULT_PARTITIONS: u32 = 1;
/// A week: a long weekend's outage plus the time to notice it.
pub(crate) const DEFAULT_LOG_RETENTION_MIN_HOURS: u64 = 168;
pub(crate) const DEFAULT_TABLE_PREFIX: &str = "outbox";
pub(crate) const DEFAULT_BROKERS: &str = "127.0.0.1:9092";
pub(crate) const DEFAULT_MESSAGE_TIMEOUT_MS: u64 = 30_000;
pub(crate) const MAX_SHARDS: u32 = 1024;
pub(crate) const MAX_PARTITIONS: u32 = 1024;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Config {
    #[serde(default)]
    pub kafka: KafkaConfig,
    /// Needed when a shard-partition sets `sink = "rabbitmq"`.
    pub rabbitmq: Option<RabbitConfig>,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default, rename = "source")]
    pub sources: Vec<SourceConfig>,
    /// Absent: this one instance owns every shard-partition (no ZooKeeper needed).
    pub coordination: Option<CoordinationConfig>,
    /// The transactional message API (docs/api.md); absent: not served.
    pub api: Option<super::api::ApiConfig>,
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
    /// Exactly-once: the compacted topic of progress records (created by `setup`).
    #[serde(default = "default_progress_topic")]
    pub progress_topic: String,
    /// Exactly-once: transactional ids are `<prefix>.<cluster>.<source>.<shard>-<partition>`.
    #[serde(default = "default_transactional_id_prefix")]
    pub transactional_id_prefix: String,
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
            progress_topic: default_progress_topic(),
            transactional_id_prefix: default_transactional_id_prefix(),
        }
    }
}

fn default_progress_topic() -> String {
    "outbox-streamer-progress".into()
}

fn default_transactional_id_prefix() -> String {
    "outbox-streamer".into()
}

fn default_brokers() -> String {
    DEFAULT_BROKERS.into()
}
fn default_message_timeout_ms() -> u64 {
    DEFAULT_MESSAGE_TIMEOUT_MS
}

/// `[rabbitmq]`: the broker of the shard-partitions with `sink = "rabbitmq"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RabbitConfig {
    /// `amqp://user[:password]@host:port/vhost` (`%2f` is the default vhost `/`), or `amqps://`
    /// for TLS.
    pub url: SecretUrl,
    /// The password from this environment variable instead of the URL.
    pub password_env: Option<String>,
    /// The password from the first line of this file instead of the URL.
    pub password_file: Option<PathBuf>,
    /// `[rabbitmq.tls]` with an `amqps://` URL: the CA that signs the broker's certificate, and
    /// optionally a client certificate and key (PEM).
    pub tls: Option<TlsSettings>,
    /// The AMQP heartbeat asked for: a silent connection is declared dead after about twice this.
    #[serde(default = "default_rabbit_heartbeat_s")]
    pub heartbeat_s: u16,
    /// The largest AMQP frame asked for (the broker may lower it).
    #[serde(default = "default_rabbit_frame_max")]
    pub frame_max: u32,
    /// Messages of one shard-partition that may wait for their publisher confirm at once.
    #[serde(default = "default_rabbit_confirm_window")]
    pub confirm_window: usize,
    #[serde(default = "default_rabbit_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// A message not confirmed this long after it was published fails, and the session resends
    /// from the last confirmed one on a new connection.
    #[serde(default = "default_rabbit_confirm_timeout_ms")]
    pub confirm_timeout_ms: u64,
}

pub(crate) const DEFAULT_RABBIT_HEARTBEAT_S: u16 = 10;
pub(crate) const DEFAULT_RABBIT_FRAME_MAX: u32 = 131_072;
pub(crate) const DEFAULT_RABBIT_CONFIRM_WINDOW: usize = 1024;
pub(crate) const DEFAULT_RABBIT_CONNECT_TIMEOUT_MS: u64 = 10_000;
pub(crate) const DEFAULT_RABBIT_CONFIRM_TIMEOUT_MS: u64 = 30_000;

fn default_rabbit_heartbeat_s() -> u16 {
    DEFAULT_RABBIT_HEARTBEAT_S
}
fn default_rabbit_frame_max() -> u32 {
    DEFAULT_RABBIT_FRAME_MAX
}
fn default_rabbit_confirm_window() -> usize {
    DEFAULT_RABBIT_CONFIRM_WINDOW
}
fn default_rabbit_connect_timeout_ms() -> u64 {
    DEFAULT_RABBIT_CONNECT_TIMEOUT_MS
}
fn default_rabbit_confirm_timeout_ms() -> u64 {
    DEFAULT_RABBIT_CONFIRM_TIMEOUT_MS
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
}

/// This host's name (`/proc/sys/kernel/hostname`), or `host` when it cannot be read.
pub(super) fn hostname() -> String {
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
    /// How the tables hold messages: `outbox-streamer` (ours, the default) or `tw-tkms`
    /// (its `outgoing_message_<shard>_<partition>` tables, read as they are; see
    /// `docs/drop-in.md`).
    #[serde(default)]
    pub layout: crate::layout::LayoutKind,
    /// `[source.columns]`: the column mapping of `layout = "columns"` or `"debezium"`.
    pub columns: Option<crate::layout::Mapping>,
    /// The resolved mapping (with a preset's defaults), made when the file is read; it lives
    /// as long as the process (see [`crate::layout::Layout`]).
    #[serde(skip)]
    pub mapping: Option<&'static crate::layout::Mapping>,
    /// Tables are `<table_prefix>_<shard>_<partition>`. Unset: the layout's (`outbox`, or
    /// `outgoing_message` for tw-tkms), filled in when the file is read.
    #[serde(default)]
    pub table_prefix: String,
    /// Another outbox's one table, by its own name (e.g. Debezium's `outbox`), instead of
    /// `<table_prefix>_0_0`: only for a source of one shard and one partition whose `layout`
    /// is not ours. Publication and slot keep `<table_prefix>_0_0`.
    pub table: Option<String>,
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
    /// MariaDB/MySQL with `storage = "wal"`: `setup` and `status` warn when the server expires
    /// binlogs sooner than this (a purged position loses WAL-only messages).
    #[serde(default = "default_log_retention_min_hours")]
    pub log_retention_min_hours: u64,
    /// `[source.tls]`: encryption to the database (plaintext when left out).
    pub tls: Option<TlsSettings>,
}

fn default_log_retention_min_hours() -> u64 {
    DEFAULT_LOG_RETENTION_MIN_HOURS
}
fn default_shards() -> u32 {
    DEFAULT_SHARDS
}
fn default_partitions() -> u32 {
    DEFAULT_PARTITIONS
}

impl SourceConfig {
    /// How this source's tables hold messages.
    pub(crate) fn layout(&self) -> crate::layout::Layout {
        use crate::layout::{Layout, LayoutKind};
        match (self.layout, self.mapping) {
            (LayoutKind::OutboxStreamer, _) => Layout::OutboxStreamer,
            (LayoutKind::TwTkms, _) => Layout::TwTkms,
            (LayoutKind::Debezium | LayoutKind::Columns, Some(m)) => Layout::Columns(m),
            // Not reachable for a loaded config: loading resolves the mapping.
            (LayoutKind::Debezium | LayoutKind::Columns, None) => Layout::OutboxStreamer,
        }
    }

    /// The names of shard-partition `id`'s table, publication and slot (see `names.rs`).
    pub(crate) fn stream_names(&self, id: StreamId) -> crate::names::StreamNames {
        let mut names = crate::names::stream_names(&self.table_prefix, self.slot_prefix.as_deref(), id);
        if let Some(table) = &self.table {
            names.table = table.clone();
        }
        names
    }
}
