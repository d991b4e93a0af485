//! The settings of one shard-partition: `[source.defaults]` and `[[source.override]]` (by shard,
//! or by shard-partition) as [`StreamOverrides`], resolved layer by layer over the built-in
//! defaults into [`StreamSettings`].

use serde::{Deserialize, Serialize};

use super::sections::SourceConfig;
use crate::names::StreamId;

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
pub(crate) const DEFAULT_TRANSACTION_INTERVAL_MS: u64 = 20;
pub(crate) const DEFAULT_TRANSACTION_MAX_RECORDS: usize = 10_000;
pub(crate) const DEFAULT_HALT_RETRY_MS: u64 = 30_000;

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

/// Where the application's messages for a shard-partition live until they are published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Storage {
    /// Rows of `<prefix>_<shard>_<partition>`, deleted once published; survives a lost
    /// replication position (the catch-up reads the table).
    #[default]
    Table,
    /// WAL-only messages (PostgreSQL: logical messages from `<prefix>_emit`; MariaDB/MySQL: a
    /// BLACKHOLE table): nothing is stored or deleted, so the database does less per message,
    /// but a lost position loses them.
    Wal,
}

impl Storage {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Storage::Table => "table",
            Storage::Wal => "wal",
        }
    }
}

/// What a consumer of a shard-partition's records may see after a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Delivery {
    /// Records acknowledged by Kafka whose rows were not deleted yet are sent again after a
    /// crash; consumers deduplicate by `outbox-id`.
    #[default]
    AtLeastOnce,
    /// Records go in Kafka transactions with a progress record (see `docs/exactly-once.md`): a
    /// `read_committed` consumer sees each message once, whatever is killed when.
    ExactlyOnce,
}

impl Delivery {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Delivery::AtLeastOnce => "at-least-once",
            Delivery::ExactlyOnce => "exactly-once",
        }
    }
}

/// Where a shard-partition's records go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum SinkKind {
    #[default]
    Kafka,
    /// `[rabbitmq]`: the row's topic is the exchange, its key the routing key.
    Rabbitmq,
}

impl SinkKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SinkKind::Kafka => "kafka",
            SinkKind::Rabbitmq => "rabbitmq",
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
    /// Where messages live: `table` (the default) or `wal` (see `docs/architecture.md`).
    pub storage: Option<Storage>,
    /// `at-least-once` (the default) or `exactly-once` (Kafka transactions).
    pub delivery: Option<Delivery>,
    /// `kafka` (the default) or `rabbitmq`.
    pub sink: Option<SinkKind>,
    /// RabbitMQ: publish every record to this exchange, with the row's topic as the routing key
    /// (for tables whose rows name only a routing key). Unset: the topic is the exchange and the
    /// key the routing key.
    pub exchange: Option<String>,
    /// Exactly-once: a Kafka transaction commits once it is this old (at the next end of a
    /// source transaction).
    pub transaction_interval_ms: Option<u64>,
    /// Exactly-once: … or holds this many records (a larger source transaction is split).
    pub transaction_max_records: Option<usize>,
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
    pub storage: Storage,
    pub delivery: Delivery,
    pub sink: SinkKind,
    pub exchange: Option<String>,
    pub transaction_interval_ms: u64,
    pub transaction_max_records: usize,
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
            storage: Storage::Table,
            delivery: Delivery::AtLeastOnce,
            sink: SinkKind::Kafka,
            exchange: None,
            transaction_interval_ms: DEFAULT_TRANSACTION_INTERVAL_MS,
            transaction_max_records: DEFAULT_TRANSACTION_MAX_RECORDS,
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
        if let Some(v) = o.storage {
            self.storage = v;
        }
        if let Some(v) = o.delivery {
            self.delivery = v;
        }
        if let Some(v) = o.sink {
            self.sink = v;
        }
        if let Some(v) = &o.exchange {
            self.exchange = Some(v.clone());
        }
        if let Some(v) = o.transaction_interval_ms {
            self.transaction_interval_ms = v;
        }
        if let Some(v) = o.transaction_max_records {
            self.transaction_max_records = v;
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
}
