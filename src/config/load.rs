//! Reading the configuration: the TOML file, `${VAR}` expansion inside string values, the
//! `OUTBOX_KAFKA_BROKERS` and `OUTBOX_METRICS_LISTEN` overrides, then validation. Errors say
//! where, never quoting the file or an expanded value (either may be a password).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::error::{ConfigError, invalid};
use super::sections::Config;
use crate::layout::LayoutKind;

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
        for source in &mut config.sources {
            if source.table_prefix.is_empty() {
                source.table_prefix = source.layout.default_table_prefix().to_string();
            }
            let mapping = match source.layout {
                LayoutKind::Debezium => Some(source.columns.clone().unwrap_or_default().with_debezium_defaults()),
                LayoutKind::Columns => source.columns.clone(),
                _ => None,
            };
            // A config is read once per process; its mapping lives as long (Layout is Copy).
            source.mapping = mapping.map(|m| &*Box::leak(Box::new(m)));
        }
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
