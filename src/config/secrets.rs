//! Passwords kept out of the file: the database password and Kafka's SASL password, read from an
//! environment variable or the first line of a file when a connection needs them.

use std::collections::BTreeMap;

use super::error::{ConfigError, invalid};
use super::sections::{KafkaConfig, RabbitConfig, SourceConfig};

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

impl RabbitConfig {
    /// The URL the client connects with: the password from `password_env` or `password_file`
    /// put in (percent-encoded), and the heartbeat and frame size as its query. Never log it.
    pub(crate) fn connection_uri(&self) -> Result<String, ConfigError> {
        let url = self.url.expose();
        let password = self.password()?;
        let url = match password {
            None => url.to_string(),
            Some(password) => with_password(url, &password).ok_or_else(|| {
                invalid("rabbitmq.url", "needs a user name (amqp://user@host/vhost) when the password comes from password_env or password_file")
            })?,
        };
        Ok(format!("{url}?heartbeat={}&frame_max={}", self.heartbeat_s, self.frame_max))
    }
}

impl RabbitConfig {
    /// What every RabbitMQ shard-partition's publisher starts from: the connection URL, the CA
    /// and client certificate read from their files.
    pub(crate) fn publisher(&self) -> Result<outbox_rabbitmq::PublisherSettings, ConfigError> {
        let read = |field: &str, path: &std::path::Path| {
            std::fs::read(path)
                .map_err(|e| invalid(format!("rabbitmq.tls.{field}"), format!("cannot read {}: {e}", path.display())))
        };
        let tls = self.tls.as_ref();
        let ca_pem = match tls.and_then(|t| t.ca_file.as_deref()) {
            Some(path) => Some(String::from_utf8_lossy(&read("ca_file", path)?).into_owned()),
            None => None,
        };
        let identity = match tls.map(|t| (&t.cert_file, &t.key_file)) {
            Some((Some(cert), Some(key))) => Some((read("cert_file", cert)?, read("key_file", key)?)),
            _ => None,
        };
        Ok(outbox_rabbitmq::PublisherSettings {
            uri: self.connection_uri()?,
            ca_pem,
            identity,
            confirm_window: self.confirm_window,
            confirm_timeout: std::time::Duration::from_millis(self.confirm_timeout_ms),
            max_queued: std::time::Duration::from_millis(self.confirm_timeout_ms),
            connect_timeout: std::time::Duration::from_millis(self.connect_timeout_ms),
            connection_name: "outbox-streamer".into(),
        })
    }
}

impl RabbitConfig {
    /// The password from `password_env` or `password_file`, if either is set.
    pub(crate) fn password(&self) -> Result<Option<String>, ConfigError> {
        if let Some(var) = &self.password_env {
            return std::env::var(var)
                .map(Some)
                .map_err(|_| invalid("rabbitmq.password_env", format!("environment variable {var} is not set")));
        }
        if let Some(path) = &self.password_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| invalid("rabbitmq.password_file", format!("cannot read {}: {e}", path.display())))?;
            return Ok(Some(text.lines().next().unwrap_or_default().to_string()));
        }
        Ok(None)
    }
}

/// `url` with `password` as its user's password (replacing one written there).
fn with_password(url: &str, password: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let (userinfo, host) = rest.split_once('@')?;
    let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
    if user.is_empty() {
        return None;
    }
    let encoded: String = password
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    Some(format!("{scheme}://{user}:{encoded}@{host}"))
}

#[cfg(test)]
mod rabbit_tests {
    use super::with_password;

    #[test]
    fn a_password_from_elsewhere_is_percent_encoded_into_the_url() {
        assert_eq!(with_password("amqp://u@h:5672/%2f", "p@ss:w/rd").unwrap(), "amqp://u:p%40ss%3Aw%2Frd@h:5672/%2f");
        assert_eq!(with_password("amqps://u:old@h/v", "new").unwrap(), "amqps://u:new@h/v");
        assert!(with_password("amqp://h:5672/%2f", "p").is_none(), "no user");
    }
}
