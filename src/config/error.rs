//! [`ConfigError`]: what is wrong with the configuration, naming the setting and the fix.

use std::path::PathBuf;

/// An error in the configuration; names the setting and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The cause is the error's source, not part of its message: callers print the chain.
    #[error("cannot read config file {path}{hint}")]
    Read {
        path: PathBuf,
        /// What to do when the file is not there.
        hint: &'static str,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

pub(super) fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), message: message.into() }
}
