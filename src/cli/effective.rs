//! `outbox-streamer config`: checks the file, and with `--effective` prints every setting as it
//! applies — each shard-partition's settings after the built-in defaults, `[source.defaults]`
//! and the overrides that match it, with what set each one — as TOML or JSON.
//!
//! Secrets never print: URLs show `***` for a password, SASL and other secret librdkafka
//! properties show `***`, passwords read from the environment or a file are named by where they
//! come from. As a last guard, any password the config leads to (from `password_env`,
//! `password_file`, the SASL settings) is masked wherever it would appear in the output.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::config::{Config, SourceConfig, SourceKind, StreamSettings};
use crate::names::all_streams;
use crate::secret::redact_url;
use crate::tls::TlsSettings;

/// What replaces a secret.
const MASK: &str = "***";

/// Secrets shorter than this are not searched for in the output (a two-letter password would
/// mask ordinary words; such a password is not one).
const MIN_MASKED_LEN: usize = 4;

#[derive(Debug, Serialize)]
struct Effective {
    kafka: KafkaView,
    #[serde(skip_serializing_if = "Option::is_none")]
    rabbitmq: Option<RabbitView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    metrics: Option<MetricsView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    coordination: Option<CoordinationView>,
    source: Vec<SourceView>,
}

#[derive(Debug, Serialize)]
struct KafkaView {
    brokers: String,
    message_timeout_ms: u64,
    /// Where `sasl.password` comes from, if anywhere.
    #[serde(skip_serializing_if = "Option::is_none")]
    sasl_password: Option<String>,
    properties: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls: Option<TlsSettings>,
}

#[derive(Debug, Serialize)]
struct RabbitView {
    /// With `***` for a password written in it.
    url: String,
    /// Where the password comes from, if not the URL.
    #[serde(skip_serializing_if = "Option::is_none")]
    password: Option<String>,
    heartbeat_s: u16,
    frame_max: u32,
    confirm_window: usize,
    confirm_timeout_ms: u64,
    connect_timeout_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls: Option<TlsSettings>,
}

#[derive(Debug, Serialize)]
struct MetricsView {
    listen: String,
}

#[derive(Debug, Serialize)]
struct CoordinationView {
    kind: &'static str,
    connect: String,
    cluster_name: String,
    root: String,
    /// The configured name, or how the default is made.
    instance: String,
    session_timeout_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    yield_interval_s: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls: Option<TlsSettings>,
}

#[derive(Debug, Serialize)]
struct SourceView {
    name: String,
    kind: &'static str,
    /// With any password masked.
    url: String,
    /// Where the password comes from.
    password: String,
    layout: &'static str,
    table_prefix: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    slot_prefix: Option<String>,
    shards: u32,
    partitions: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    heartbeat_interval_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls: Option<TlsSettings>,
    stream: Vec<StreamView>,
}

#[derive(Debug, Serialize)]
struct StreamView {
    shard: u32,
    partition: u32,
    table: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    publication: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    slot: Option<String>,
    #[serde(flatten)]
    settings: StreamSettings,
    /// Each setting that is not the built-in default, and the part of the file that set it.
    set_by: BTreeMap<String, String>,
}

/// `config`: the file is valid (it was loaded); says what it holds.
pub(super) fn check(config: &Config, path: &Path) {
    let streams: u32 = config.sources.iter().map(|s| s.shards * s.partitions).sum();
    let coordination = match &config.coordination {
        Some(c) => format!(", shared by the instances of ZooKeeper cluster {:?}", c.cluster_name),
        None => String::new(),
    };
    println!(
        "{}: valid; {} source(s), {streams} shard-partition(s){coordination} (--effective shows every setting)",
        path.display(),
        config.sources.len()
    );
}

/// `config --effective`: every setting, as TOML or JSON, secrets masked.
pub(super) fn effective(config: &Config, path: &Path, json: bool) -> anyhow::Result<()> {
    let view = view(config);
    let text = if json {
        serde_json::to_string_pretty(&view)?
    } else {
        format!(
            "# outbox-streamer config --effective: {}\n\
             # Every shard-partition's settings after built-in defaults, [source.defaults] and its\n\
             # overrides; set_by names what set each one that is not a built-in default.\n\
             # Secrets are masked ({MASK}).\n\n{}",
            path.display(),
            toml::to_string_pretty(&view)?
        )
    };
    println!("{}", mask_secrets(&text, &known_secrets(config)));
    Ok(())
}

fn view(config: &Config) -> Effective {
    let k = &config.kafka;
    let sasl_password = match (&k.sasl_password_env, &k.sasl_password_file) {
        (Some(var), _) => Some(format!("from environment variable {var}")),
        (None, Some(path)) => Some(format!("from file {}", path.display())),
        (None, None) => k.properties.contains_key("sasl.password").then(|| "in properties (masked)".to_string()),
    };
    let properties = k
        .properties
        .iter()
        .map(|(key, value)| {
            let shown = if is_secret_property(key) { MASK.to_string() } else { redact_url(value) };
            (key.clone(), shown)
        })
        .collect();
    Effective {
        kafka: KafkaView {
            brokers: k.brokers.clone(),
            message_timeout_ms: k.message_timeout_ms,
            sasl_password,
            properties,
            tls: k.tls.clone(),
        },
        rabbitmq: config.rabbitmq.as_ref().map(|r| RabbitView {
            url: r.url.redacted(),
            password: match (&r.password_env, &r.password_file) {
                (Some(var), _) => Some(format!("from environment variable {var}")),
                (None, Some(path)) => Some(format!("from file {}", path.display())),
                (None, None) => None,
            },
            heartbeat_s: r.heartbeat_s,
            frame_max: r.frame_max,
            confirm_window: r.confirm_window,
            confirm_timeout_ms: r.confirm_timeout_ms,
            connect_timeout_ms: r.connect_timeout_ms,
            tls: r.tls.clone(),
        }),
        metrics: config.metrics.listen.map(|listen| MetricsView { listen: listen.to_string() }),
        coordination: config.coordination.as_ref().map(|c| CoordinationView {
            kind: "zookeeper",
            connect: c.connect.clone(),
            cluster_name: c.cluster_name.clone(),
            root: c.root.clone(),
            instance: c.instance.clone().unwrap_or_else(|| "<hostname>-<pid> (the default)".into()),
            session_timeout_ms: c.session_timeout_ms,
            yield_interval_s: c.yield_interval_s,
            tls: c.tls.clone(),
        }),
        source: config.sources.iter().map(source_view).collect(),
    }
}

fn source_view(s: &SourceConfig) -> SourceView {
    let password = match (&s.password_env, &s.password_file) {
        (Some(var), _) => format!("from environment variable {var}"),
        (None, Some(path)) => format!("from file {}", path.display()),
        (None, None) if s.url.redacted() != s.url.expose() => "in the url (masked)".into(),
        (None, None) => "none".into(),
    };
    let postgres = s.kind == SourceKind::Postgres;
    SourceView {
        name: s.name.clone(),
        kind: if postgres { "postgres" } else { "mysql" },
        url: s.url.redacted(),
        password,
        layout: s.layout.as_str(),
        table_prefix: s.table_prefix.clone(),
        slot_prefix: s.slot_prefix.clone(),
        shards: s.shards,
        partitions: s.partitions,
        heartbeat_interval_ms: s.heartbeat_interval_ms,
        tls: s.tls.clone(),
        stream: all_streams(s.shards, s.partitions)
            .map(|id| {
                let names = s.stream_names(id);
                StreamView {
                    shard: id.shard,
                    partition: id.partition,
                    table: names.table,
                    publication: postgres.then_some(names.publication),
                    slot: postgres.then_some(names.slot),
                    settings: s.settings_for(id),
                    set_by: set_by(s, id),
                }
            })
            .collect(),
    }
}

/// Each setting a layer of the file sets for `id`, with the last layer that sets it.
fn set_by(s: &SourceConfig, id: crate::names::StreamId) -> BTreeMap<String, String> {
    let mut set_by = BTreeMap::new();
    for (name, layer) in s.layers_for(id) {
        let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(layer) else { continue };
        for (key, value) in fields {
            if !value.is_null() && key != "shard" && key != "partition" {
                set_by.insert(key, name.clone());
            }
        }
    }
    set_by
}

/// librdkafka properties whose values are secrets (passwords, private keys, client secrets,
/// OAuth and JAAS settings that may embed either).
fn is_secret_property(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["password", "secret", "oauthbearer.config", "jaas", "ssl.key.pem", "ssl_key", "token"]
        .iter()
        .any(|word| key.contains(word))
}

/// The passwords the config leads to and can be read now: each source's from
/// `password_env`/`password_file`, and Kafka's SASL password.
fn known_secrets(config: &Config) -> Vec<String> {
    let mut secrets: Vec<String> = config.sources.iter().filter_map(|s| s.password().ok().flatten()).collect();
    if let Some(Ok(Some(password))) = config.rabbitmq.as_ref().map(|r| r.password()) {
        secrets.push(password);
    }
    if let Ok(properties) = config.kafka.producer_properties() {
        secrets.extend(properties.into_iter().filter(|(k, _)| is_secret_property(k)).map(|(_, v)| v));
    }
    secrets
}

/// `text` with every occurrence of a secret (of at least [`MIN_MASKED_LEN`] characters)
/// replaced by [`MASK`], longest first.
fn mask_secrets(text: &str, secrets: &[String]) -> String {
    let mut secrets: Vec<&String> = secrets.iter().filter(|s| s.chars().count() >= MIN_MASKED_LEN).collect();
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let mut out = text.to_string();
    for secret in secrets {
        out = out.replace(secret.as_str(), MASK);
        // JSON escapes quotes and backslashes: mask the escaped form too.
        let escaped = serde_json::to_string(secret).unwrap_or_default();
        out = out.replace(escaped.trim_matches('"'), MASK);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_masked_wherever_they_appear() {
        let text = "a = \"s3cret\"\nb = \"x-s3cret-y\"\nc = \"q\\\"uote\"";
        let out = mask_secrets(text, &["s3cret".into(), "q\"uote".into(), "ab".into()]);
        assert_eq!(out, "a = \"***\"\nb = \"x-***-y\"\nc = \"***\"");
    }

    #[test]
    fn secret_properties_are_recognised() {
        for key in ["sasl.password", "ssl.key.password", "ssl.keystore.password", "sasl.oauthbearer.client.secret"] {
            assert!(is_secret_property(key), "{key}");
        }
        for key in ["sasl.username", "security.protocol", "ssl.ca.location", "batch.size"] {
            assert!(!is_secret_property(key), "{key}");
        }
    }
}
