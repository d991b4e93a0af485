//! TLS settings of a source (`[source.tls]`) and of ZooKeeper (`[coordination.tls]`), their
//! validation, and their translation into each driver's options.
//!
//! ```toml
//! [source.tls]
//! mode = "verify-full"            # disable | require | verify-ca | verify-full (the default)
//! ca_file = "/etc/outbox-streamer/db-ca.pem"
//! cert_file = "/etc/outbox-streamer/client.pem"   # optional: client certificate …
//! key_file = "/etc/outbox-streamer/client.key"    # … and its key, both or neither
//! server_name = "db.internal"     # optional: the name to verify instead of the URL's host
//! ```
//!
//! The modes mean what libpq's `sslmode` means; a server that refuses TLS is an error in every
//! mode but `disable`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use outbox_mysql::mysql_async::{ClientIdentity, SslOpts};
use outbox_postgres::tls::{PgTls, TlsMode as PgTlsMode};
use outbox_zookeeper::ZkTls;
use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

/// How much of the server's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TlsMode {
    /// Plaintext.
    Disable,
    /// Encrypted; any certificate is accepted (protects against listening, not against a
    /// machine in the middle).
    Require,
    /// Encrypted; the certificate must be signed by `ca_file`.
    VerifyCa,
    /// Encrypted; signed by `ca_file` and naming the host (or `server_name`).
    #[default]
    VerifyFull,
}

/// One `tls` table; see the module docs. It holds file names only, no secret.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    #[serde(default)]
    pub mode: TlsMode,
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub server_name: Option<String>,
}

impl TlsSettings {
    /// Checks that the settings fit together and the files are readable; `field` is the
    /// table's name in errors (`source[0].tls`).
    pub fn validate(&self, field: &str) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid { field: format!("{field}.{key}"), message };
        if self.mode == TlsMode::Disable {
            return Ok(());
        }
        if matches!(self.mode, TlsMode::VerifyCa | TlsMode::VerifyFull) && self.ca_file.is_none() {
            return Err(invalid(
                "ca_file",
                "is required to verify the server: the PEM file of the CA that signed its certificate \
                 (or set mode = \"require\" to encrypt without verifying)"
                    .into(),
            ));
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            let missing = if self.cert_file.is_none() { "cert_file" } else { "key_file" };
            return Err(invalid(missing, "client certificate and key go together: set cert_file and key_file".into()));
        }
        for (key, path) in [("ca_file", &self.ca_file), ("cert_file", &self.cert_file), ("key_file", &self.key_file)] {
            if let Some(path) = path {
                readable(path).map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))?;
            }
        }
        if self.server_name.as_deref().is_some_and(|n| n.trim().is_empty()) {
            return Err(invalid("server_name", "must be a DNS name or an IP address, or left out".into()));
        }
        Ok(())
    }

    /// As [`Self::validate`], plus what the ZooKeeper client cannot do: it always verifies the
    /// server fully, against the host as written in `coordination.connect`.
    pub fn validate_for_zookeeper(&self, field: &str) -> Result<(), ConfigError> {
        self.validate(field)?;
        let invalid = |key: &str, message: &str| ConfigError::Invalid {
            field: format!("{field}.{key}"),
            message: message.into(),
        };
        if matches!(self.mode, TlsMode::Require | TlsMode::VerifyCa) {
            return Err(invalid(
                "mode",
                "ZooKeeper TLS always verifies the server: use \"verify-full\" (or \"disable\")",
            ));
        }
        if self.server_name.is_some() {
            return Err(invalid(
                "server_name",
                "is not supported for ZooKeeper: write the name the certificate lists in coordination.connect",
            ));
        }
        Ok(())
    }

    /// The ZooKeeper form, or `None` for plaintext.
    pub fn zookeeper(&self) -> Option<ZkTls> {
        match (self.mode, &self.ca_file) {
            (TlsMode::Disable, _) | (_, None) => None,
            (_, Some(ca)) => {
                Some(ZkTls { ca_file: ca.clone(), cert_file: self.cert_file.clone(), key_file: self.key_file.clone() })
            }
        }
    }

    /// As [`Self::validate`], plus conflicts with librdkafka `properties` given directly.
    pub fn validate_for_kafka(&self, field: &str, properties: &BTreeMap<String, String>) -> Result<(), ConfigError> {
        self.validate(field)?;
        let invalid = |key: &str, message: String| ConfigError::Invalid { field: format!("{field}.{key}"), message };
        if self.server_name.is_some() {
            return Err(invalid(
                "server_name",
                "is not supported for Kafka: list the brokers by the names their certificates carry".into(),
            ));
        }
        let ours = self.kafka_properties(&BTreeMap::new());
        if let Some(key) = properties.keys().find(|k| k.starts_with("ssl.") && ours.contains_key(*k)) {
            return Err(invalid("mode", format!("kafka.properties also sets {key:?}: set TLS in one place")));
        }
        Ok(())
    }

    /// librdkafka properties for these settings; `properties` are the user's own, whose SASL
    /// settings turn the protocol into `SASL_SSL`. Empty for `disable`.
    pub fn kafka_properties(&self, properties: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        if self.mode == TlsMode::Disable {
            return out;
        }
        let sasl = properties.contains_key("sasl.mechanism")
            || properties.contains_key("sasl.mechanisms")
            || properties.get("security.protocol").is_some_and(|p| p.to_ascii_uppercase().starts_with("SASL"));
        let mut set = |k: &str, v: &str| {
            out.insert(k.to_string(), v.to_string());
        };
        set("security.protocol", if sasl { "SASL_SSL" } else { "SSL" });
        match self.mode {
            TlsMode::Require => set("enable.ssl.certificate.verification", "false"),
            TlsMode::VerifyCa => set("ssl.endpoint.identification.algorithm", "none"),
            _ => set("ssl.endpoint.identification.algorithm", "https"),
        }
        let path = |p: &PathBuf| p.display().to_string();
        if let Some(ca) = &self.ca_file {
            set("ssl.ca.location", &path(ca));
        }
        if let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) {
            set("ssl.certificate.location", &path(cert));
            set("ssl.key.location", &path(key));
        }
        out
    }

    /// The PostgreSQL form, or `None` for plaintext.
    pub fn postgres(&self) -> Option<PgTls> {
        let mode = match self.mode {
            TlsMode::Disable => return None,
            TlsMode::Require => PgTlsMode::Require,
            TlsMode::VerifyCa => PgTlsMode::VerifyCa,
            TlsMode::VerifyFull => PgTlsMode::VerifyFull,
        };
        Some(PgTls {
            mode,
            ca_file: self.ca_file.clone(),
            cert_file: self.cert_file.clone(),
            key_file: self.key_file.clone(),
            server_name: self.server_name.clone(),
        })
    }

    /// The MySQL/MariaDB form, or `None` for plaintext. mysql_async requires TLS once these
    /// are set, so a server without TLS fails the connection. Needs
    /// [`install_crypto_provider`] to have run.
    pub fn mysql(&self) -> Option<SslOpts> {
        if self.mode == TlsMode::Disable {
            return None;
        }
        let mut opts = SslOpts::default()
            .with_danger_accept_invalid_certs(self.mode == TlsMode::Require)
            .with_danger_skip_domain_validation(self.mode != TlsMode::VerifyFull);
        if let Some(ca) = &self.ca_file {
            opts = opts.with_root_certs(vec![ca.clone().into()]).with_disable_built_in_roots(true);
        }
        if let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) {
            opts = opts.with_client_identity(Some(ClientIdentity::new(cert.clone().into(), key.clone().into())));
        }
        if let Some(name) = &self.server_name {
            opts = opts.with_danger_tls_hostname_override(Some(name.clone()));
        }
        Some(opts)
    }
}

/// Makes ring the process's default rustls crypto provider, for the libraries that build
/// their TLS configs on the default (mysql_async, zookeeper-client): both rustls backends are
/// compiled in through dependencies, and with two and no default those would panic. Called
/// once at start; idempotent.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn readable(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(path).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(toml_text: &str) -> TlsSettings {
        toml::from_str(toml_text).unwrap()
    }

    #[test]
    fn verify_full_is_the_default_and_needs_a_ca() {
        let s = settings("");
        assert_eq!(s.mode, TlsMode::VerifyFull);
        let err = s.validate("source[0].tls").unwrap_err().to_string();
        assert!(err.starts_with("source[0].tls.ca_file:"), "{err}");
        assert!(err.contains("mode = \"require\""), "{err}");
    }

    #[test]
    fn a_key_without_a_certificate_is_named() {
        let err = settings("mode = \"require\"\nkey_file = \"/etc/hosts\"").validate("t").unwrap_err().to_string();
        assert!(err.starts_with("t.cert_file:"), "{err}");
    }

    #[test]
    fn an_unreadable_file_is_named_with_its_path() {
        let err = settings("ca_file = \"/nonexistent/ca.pem\"").validate("t").unwrap_err().to_string();
        assert!(err.starts_with("t.ca_file: cannot read /nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn disable_maps_to_plaintext_everywhere() {
        let s = settings("mode = \"disable\"");
        s.validate("t").unwrap();
        assert!(s.postgres().is_none());
        assert!(s.mysql().is_none());
    }

    #[test]
    fn zookeeper_refuses_what_its_client_cannot_do() {
        let err = settings("mode = \"verify-ca\"\nca_file = \"/etc/hosts\"")
            .validate_for_zookeeper("coordination.tls")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("coordination.tls.mode:"), "{err}");
        let ok = settings("ca_file = \"/etc/hosts\"");
        ok.validate_for_zookeeper("coordination.tls").unwrap();
        assert!(ok.zookeeper().is_some());
    }

    #[test]
    fn kafka_gets_ssl_properties_and_keeps_sasl() {
        let s = settings("ca_file = \"/etc/hosts\"\ncert_file = \"/etc/hosts\"\nkey_file = \"/etc/hosts\"");
        let plain = s.kafka_properties(&BTreeMap::new());
        assert_eq!(plain["security.protocol"], "SSL");
        assert_eq!(plain["ssl.endpoint.identification.algorithm"], "https");
        assert_eq!(plain["ssl.ca.location"], "/etc/hosts");
        assert_eq!(plain["ssl.key.location"], "/etc/hosts");
        let sasl = BTreeMap::from([("sasl.mechanism".to_string(), "SCRAM-SHA-256".to_string())]);
        assert_eq!(s.kafka_properties(&sasl)["security.protocol"], "SASL_SSL");
        let twice = BTreeMap::from([("ssl.ca.location".to_string(), "/x".to_string())]);
        let err = s.validate_for_kafka("kafka.tls", &twice).unwrap_err().to_string();
        assert!(err.contains("ssl.ca.location"), "{err}");
    }

    #[test]
    fn an_unknown_mode_is_refused() {
        assert!(toml::from_str::<TlsSettings>("mode = \"prefer\"").is_err());
    }
}
