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
//!
//! # Files
//!
//! * `sections.rs` — the file's sections (`[kafka]`, `[metrics]`, `[coordination]`,
//!   `[[source]]`) as typed settings, with their defaults.
//! * `stream.rs` — the settings of one shard-partition: `[source.defaults]`,
//!   `[[source.override]]` and how they resolve.
//! * `load.rs` — reading the file: TOML, `${VAR}` expansion, environment overrides.
//! * `api.rs` — `[api]`, the message API's listener, limits and tokens.
//! * `secrets.rs` — passwords read from an environment variable or a file.
//! * `validate.rs` — the checks; each error names the setting and the fix.
//! * `error.rs` — [`ConfigError`].

mod api;
mod error;
mod load;
mod secrets;
mod sections;
mod stream;
mod validate;

pub(crate) use api::{AfterMaxChecks, ApiConfig};
pub(crate) use error::ConfigError;
pub(crate) use sections::{
    Config, CoordinationConfig, DEFAULT_TABLE_PREFIX, KafkaConfig, RabbitConfig, SourceConfig, SourceKind,
};
pub(crate) use stream::{BadRowPolicy, Delivery, Mode, SinkKind, Storage, StreamSettings};

#[cfg(test)]
mod tests;
