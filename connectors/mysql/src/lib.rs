//! MySQL/MariaDB for outbox-streamer: positions ([`gtid`]), event decoding ([`decode`]), the
//! binlog session ([`binlog`]), schema and checks ([`setup`]) and their removal ([`teardown`]).
//!
//! # Server settings
//!
//! Row events carry every column and its name only with `binlog_format=ROW`,
//! `binlog_row_image=FULL` and `binlog_row_metadata=FULL`; MariaDB's compressed binlog events
//! are not decoded, so `log_bin_compress` must be off (MySQL's zstd transaction payloads are).
//! [`check_binlog_settings`] reads them and says what to change.

// Only `outbox-kafka`'s queue_events.rs may use `unsafe` (the workspace denies it; this crate
// forbids it outright).
#![forbid(unsafe_code)]

pub mod binlog;
pub mod cleanup;
pub mod decode;
pub mod gtid;
pub mod privileges;
pub mod setup;
pub mod teardown;
pub mod xa;

pub use mysql_async;

use mysql_async::prelude::Queryable;

/// The binlog-related settings of a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinlogSettings {
    pub version: String,
    pub log_bin: bool,
    pub format: String,
    pub row_image: String,
    pub row_metadata: String,
    pub compress: bool,
}

impl BinlogSettings {
    pub fn is_mariadb(&self) -> bool {
        self.version.to_ascii_lowercase().contains("mariadb")
    }

    /// What is wrong, each with the setting to change; empty when streaming can work.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.log_bin {
            out.push(
                "the binlog is off; start the server with log_bin (e.g. --log-bin=mysql-bin) and a server_id".into(),
            );
        }
        if self.format != "ROW" {
            out.push(format!("binlog_format is {}; set binlog_format=ROW", self.format));
        }
        if self.row_image != "FULL" {
            out.push(format!("binlog_row_image is {}; set binlog_row_image=FULL", self.row_image));
        }
        if self.row_metadata != "FULL" {
            out.push(format!(
                "binlog_row_metadata is {}; set binlog_row_metadata=FULL so row events name their columns",
                self.row_metadata
            ));
        }
        if self.compress {
            out.push("log_bin_compress is ON; set log_bin_compress=OFF (compressed row events are not decoded)".into());
        }
        out
    }
}

/// Reads the binlog settings of the server behind `conn`.
pub async fn check_binlog_settings(conn: &mut mysql_async::Conn) -> Result<BinlogSettings, mysql_async::Error> {
    let (version, log_bin, format, row_image): (String, i64, String, String) =
        conn.query_first("SELECT @@version, @@log_bin, @@binlog_format, @@binlog_row_image").await?.unwrap_or_default();
    let row_metadata: String = conn
        .query_first::<String, _>("SELECT @@binlog_row_metadata")
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| "MINIMAL".into());
    let compress: bool = if version.to_ascii_lowercase().contains("mariadb") {
        conn.query_first::<i64, _>("SELECT @@log_bin_compress").await?.unwrap_or(0) != 0
    } else {
        false
    };
    Ok(BinlogSettings { version, log_bin: log_bin != 0, format, row_image, row_metadata, compress })
}
