//! `[api]`: the transactional message API (docs/api.md) — where it listens, which source's
//! database keeps its messages, its limits and its bearer tokens with what each may do.
//!
//! ```toml
//! [api]
//! listen = "127.0.0.1:8080"
//! source = "app"                 # a [[source]] with the outbox-streamer layout
//! [api.tls]                      # optional: serve HTTPS
//! cert_file = "/etc/outbox-streamer/api.pem"
//! key_file = "/etc/outbox-streamer/api.key"
//! [[api.token]]
//! name = "orders-service"
//! secret_env = "OUTBOX_API_TOKEN_ORDERS"
//! topics = ["orders", "orders.*"]
//! shards = [0]
//! ```

use std::path::PathBuf;

use serde::Deserialize;

use super::error::{ConfigError, invalid};

/// `[api]`; see the module docs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ApiConfig {
    pub listen: std::net::SocketAddr,
    /// The `[[source]]` (by name) whose database keeps the messages and whose outbox a commit
    /// writes to.
    pub source: String,
    pub tls: Option<ApiTls>,
    #[serde(default, rename = "token")]
    pub tokens: Vec<TokenConfig>,
    /// The largest request body taken, in bytes.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Messages one request may prepare.
    #[serde(default = "default_max_batch")]
    pub max_batch: usize,
    /// Connections open at once; one more is closed at once.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// A request's head must arrive within this long (an idle kept-alive connection is closed
    /// after it), and its whole exchange end within `request_timeout_ms`.
    #[serde(default = "default_header_timeout_ms")]
    pub header_timeout_ms: u64,
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Database sessions the API holds at most.
    #[serde(default = "default_db_connections")]
    pub db_connections: usize,
    /// Decided messages are answered by `GET` (and keep their idempotency key) this long.
    #[serde(default = "default_keep_decisions_s")]
    pub keep_decisions_s: u64,
    /// A message still prepared this long after it was prepared is checked back.
    #[serde(default = "default_check_after_s")]
    pub check_after_s: u64,
    /// Check-backs that decide nothing (answered unknown, not answered) before the message is
    /// given up: rolled back or left for an operator, by `after_max_checks`.
    #[serde(default = "default_max_checks")]
    pub max_checks: u32,
    #[serde(default)]
    pub after_max_checks: AfterMaxChecks,
    /// The wait before asking again, doubled after each fruitless check-back (at most an hour,
    /// or this when longer).
    #[serde(default = "default_checkback_retry_s")]
    pub checkback_retry_s: u64,
    /// How long one check-back call may take.
    #[serde(default = "default_checkback_timeout_ms")]
    pub checkback_timeout_ms: u64,
    /// Messages asked about in one call.
    #[serde(default = "default_checkback_batch")]
    pub checkback_batch: u32,
    /// The CA that signs `https://` check-back servers; the system's roots without it.
    pub checkback_ca_file: Option<PathBuf>,
}

/// What becomes of a message after `max_checks` fruitless check-backs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum AfterMaxChecks {
    /// It stays prepared, asked no more, for an operator to decide (with an ERROR naming it).
    #[default]
    Leave,
    /// It is rolled back (with an ERROR naming it).
    Rollback,
}

/// `[api.tls]`: the server's certificate chain and key (PEM), and optionally the CA whose
/// client certificates are demanded.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ApiTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub client_ca_file: Option<PathBuf>,
}

/// One `[[api.token]]`: a bearer token (kept out of the file) and what it may do.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TokenConfig {
    /// Who holds it: named in metrics and logs (the secret never is), and the owner of the
    /// messages it prepares — another token cannot see or decide them.
    pub name: String,
    pub secret_env: Option<String>,
    pub secret_file: Option<PathBuf>,
    /// Topics (or RabbitMQ exchanges) it may prepare to: a name, or a prefix ending in `*`.
    pub topics: Vec<String>,
    /// Shards it may prepare to; all of the source's when absent.
    pub shards: Option<Vec<u32>>,
    /// URL prefixes its messages' check-back URLs must start with; none may be given without.
    #[serde(default)]
    pub checkback_urls: Vec<String>,
}

fn default_max_body_bytes() -> usize {
    1024 * 1024
}
fn default_max_batch() -> usize {
    500
}
fn default_max_connections() -> usize {
    256
}
fn default_header_timeout_ms() -> u64 {
    10_000
}
fn default_request_timeout_ms() -> u64 {
    30_000
}
fn default_db_connections() -> usize {
    8
}
fn default_keep_decisions_s() -> u64 {
    7 * 24 * 3600
}
fn default_check_after_s() -> u64 {
    180
}
fn default_max_checks() -> u32 {
    10
}
fn default_checkback_retry_s() -> u64 {
    60
}
fn default_checkback_timeout_ms() -> u64 {
    10_000
}
fn default_checkback_batch() -> u32 {
    100
}

/// Secrets shorter than this are refused: a bearer token must not be guessable.
const MIN_SECRET_LEN: usize = 16;

impl ApiConfig {
    /// Checks every setting (not the secrets, read by [`TokenConfig::secret`] when serving).
    pub(super) fn validate(&self, sources: &[super::SourceConfig]) -> Result<(), ConfigError> {
        let Some(source) = sources.iter().find(|s| s.name == self.source) else {
            return Err(invalid(
                "api.source",
                format!(
                    "names no [[source]] ({:?}); set it to the name of the source whose database keeps the API's messages",
                    self.source
                ),
            ));
        };
        if !source.layout().owns_tables() {
            return Err(invalid(
                "api.source",
                format!(
                    "source {:?} has layout {:?}; the API writes committed messages through outbox_enqueue, which only the outbox-streamer layout has: name a source with it",
                    source.name,
                    source.layout().as_str()
                ),
            ));
        }
        let ranges: [(&str, u64, u64, u64); 12] = [
            ("max_checks", u64::from(self.max_checks), 1, 1000),
            ("checkback_retry_s", self.checkback_retry_s, 1, 86_400),
            ("checkback_timeout_ms", self.checkback_timeout_ms, 100, 600_000),
            ("checkback_batch", u64::from(self.checkback_batch), 1, 1000),
            ("max_body_bytes", self.max_body_bytes as u64, 1024, 64 * 1024 * 1024),
            ("max_batch", self.max_batch as u64, 1, 10_000),
            ("max_connections", self.max_connections as u64, 1, 100_000),
            ("header_timeout_ms", self.header_timeout_ms, 100, 600_000),
            ("request_timeout_ms", self.request_timeout_ms, 100, 600_000),
            ("db_connections", self.db_connections as u64, 1, 1000),
            ("keep_decisions_s", self.keep_decisions_s, 60, 366 * 24 * 3600),
            ("check_after_s", self.check_after_s, 1, 7 * 24 * 3600),
        ];
        for (key, value, low, high) in ranges {
            if !(low..=high).contains(&value) {
                return Err(invalid(format!("api.{key}"), format!("must be {low} to {high}, not {value}")));
            }
        }
        if self.tokens.is_empty() {
            return Err(invalid(
                "api.token",
                "at least one [[api.token]] is needed: every request authenticates with a bearer token",
            ));
        }
        let mut names = std::collections::HashSet::new();
        for (i, t) in self.tokens.iter().enumerate() {
            let f = |key: &str| format!("api.token[{i}].{key}");
            let name_ok = !t.name.is_empty()
                && t.name.len() <= 64
                && t.name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
            if !name_ok {
                return Err(invalid(f("name"), "must be 1 to 64 characters of [a-zA-Z0-9._-]"));
            }
            if !names.insert(t.name.as_str()) {
                return Err(invalid(f("name"), format!("{:?} names two tokens", t.name)));
            }
            if t.secret_env.is_some() == t.secret_file.is_some() {
                return Err(invalid(
                    f("secret_env"),
                    "set exactly one of secret_env and secret_file: the token's secret is kept out of the file",
                ));
            }
            if t.topics.is_empty() || t.topics.iter().any(|p| !valid_topic_pattern(p)) {
                return Err(invalid(
                    f("topics"),
                    "must list topic names or prefixes ending in * (\"orders\", \"orders.*\"), none empty; \"*\" alone grants every topic",
                ));
            }
            if let Some(shards) = &t.shards
                && let Some(bad) = shards.iter().find(|&&s| s >= source.shards)
            {
                return Err(invalid(
                    f("shards"),
                    format!("shard {bad} does not exist: source {:?} has shards 0..{}", source.name, source.shards - 1),
                ));
            }
            if let Some(bad) = t.checkback_urls.iter().find(|u| !valid_checkback_prefix(u)) {
                return Err(invalid(
                    f("checkback_urls"),
                    format!(
                        "{bad:?} must be an http:// or https:// URL prefix naming a host and ending in / (\"https://orders.internal/outbox/\")"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// A topic name or a prefix ending in `*`.
fn valid_topic_pattern(pattern: &str) -> bool {
    let name = pattern.strip_suffix('*').unwrap_or(pattern);
    (pattern == "*" || !name.is_empty())
        && name.len() <= 249
        && !name.contains('*')
        && !name.contains(|c: char| c.is_whitespace() || c.is_control())
}

/// `http(s)://host[:port]/…/`: a prefix that cannot be extended into another host.
fn valid_checkback_prefix(prefix: &str) -> bool {
    let Some(rest) = prefix.strip_prefix("https://").or_else(|| prefix.strip_prefix("http://")) else { return false };
    let Some((host, _)) = rest.split_once('/') else { return false };
    !host.is_empty() && !host.contains('@') && prefix.ends_with('/') && !prefix.contains(char::is_whitespace)
}

impl TokenConfig {
    /// The token's secret, from its environment variable or the first line of its file.
    pub(crate) fn secret(&self, index: usize) -> Result<String, ConfigError> {
        let f = |key: &str| format!("api.token[{index}].{key}");
        let (secret, field) = match (&self.secret_env, &self.secret_file) {
            (Some(var), _) => (
                std::env::var(var)
                    .map_err(|_| invalid(f("secret_env"), format!("environment variable {var} is not set")))?,
                f("secret_env"),
            ),
            (None, Some(path)) => (
                std::fs::read_to_string(path)
                    .map_err(|e| invalid(f("secret_file"), format!("cannot read {}: {e}", path.display())))?
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string(),
                f("secret_file"),
            ),
            (None, None) => return Err(invalid(f("secret_env"), "set secret_env or secret_file")),
        };
        let secret = secret.trim().to_string();
        if secret.len() < MIN_SECRET_LEN || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid(
                field,
                format!(
                    "the secret must be at least {MIN_SECRET_LEN} printable ASCII characters without spaces (e.g. from `openssl rand -hex 32`)"
                ),
            ));
        }
        Ok(secret)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns_are_names_or_prefixes() {
        for ok in ["orders", "orders.*", "*", "a"] {
            assert!(valid_topic_pattern(ok), "{ok}");
        }
        for bad in ["", "or*ders", "**", "a b", "orders.**"] {
            assert!(!valid_topic_pattern(bad), "{bad}");
        }
    }

    #[test]
    fn checkback_prefixes_end_in_a_path() {
        assert!(valid_checkback_prefix("https://orders.internal/outbox/"));
        assert!(valid_checkback_prefix("http://127.0.0.1:9000/"));
        for bad in ["https://orders.internal", "ftp://x/", "https:///", "https://u@evil/", "https://a/ b/"] {
            assert!(!valid_checkback_prefix(bad), "{bad}");
        }
    }
}
