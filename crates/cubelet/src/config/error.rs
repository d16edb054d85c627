//! Why a configuration cannot be used.

use std::path::PathBuf;

/// A configuration that cannot be used; the message names the file and key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A file could not be read.
    #[error("read {path}")]
    Read {
        /// File.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file is not valid YAML.
    #[error("{path}: {source}")]
    Yaml {
        /// File.
        path: PathBuf,
        /// Parser error.
        #[source]
        source: serde_norway::Error,
    },
    /// The merged document does not fit the schema.
    #[error("{key}: {message}")]
    Schema {
        /// Dotted path of the offending key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A value is out of range.
    #[error("{key}: {message}")]
    Invalid {
        /// Dotted key.
        key: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The workflow definitions are wrong.
    #[error(transparent)]
    Flows(#[from] cubelet_engine::ConfigError),
    /// The built-in defaults could not be turned into the YAML the files are
    /// merged over (a bug, not an operator's mistake).
    #[error("cannot serialise the default configuration")]
    Defaults {
        /// Serialiser error.
        #[source]
        source: serde_norway::Error,
    },
}
