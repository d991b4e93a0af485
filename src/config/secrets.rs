//! Passwords kept out of the file: the database password and Kafka's SASL password, read from an
//! environment variable or the first line of a file when a connection needs them.

use std::collections::BTreeMap;

use super::error::{ConfigError, invalid};
use super::sections::{KafkaConfig, SourceConfig};

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

impl SourceConfig {
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
