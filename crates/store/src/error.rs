//! The store's error type.

use std::net::IpAddr;
use std::path::PathBuf;

use cubelet_engine::{FlowId, SandboxId};

/// Errors of the node state store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The directory that should hold the database file could not be created.
    #[error("cannot create store directory {path}")]
    CreateDir {
        /// Directory that could not be created.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The database file could not be opened or created.
    #[error("cannot open store {path}")]
    Open {
        /// Database file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<redb::DatabaseError>,
    },
    /// The file was written by a build with another schema version.
    #[error(
        "store {path} has schema version {found}, this build supports version {expected}; \
         move the file away to start with an empty store, or run a matching cubelet"
    )]
    SchemaMismatch {
        /// Database file.
        path: PathBuf,
        /// Version recorded in the file.
        found: String,
        /// Version this build reads and writes.
        expected: u32,
    },
    /// A database operation failed.
    #[error("store {op} failed")]
    Database {
        /// What the store was doing.
        op: &'static str,
        /// Why.
        #[source]
        source: Box<redb::Error>,
    },
    /// A record could not be encoded.
    #[error("cannot encode {table} record {key}")]
    Encode {
        /// Table name.
        table: &'static str,
        /// Record key.
        key: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// A stored record could not be decoded.
    #[error("cannot decode {table} record {key}")]
    Decode {
        /// Table name.
        table: &'static str,
        /// Record key.
        key: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// A value in the `meta` table is not what the store wrote there.
    #[error("meta key {key} holds an invalid value {value:?}")]
    InvalidMeta {
        /// Meta key.
        key: &'static str,
        /// The value found.
        value: String,
    },
    /// The meta key is used by the store itself and cannot be set by callers.
    #[error("meta key {0} is reserved by the store")]
    ReservedMetaKey(String),
    /// No sandbox with this id.
    #[error("sandbox {0} not found")]
    SandboxNotFound(SandboxId),
    /// No container with this id.
    #[error("container {0} not found")]
    ContainerNotFound(String),
    /// No journalled flow with this id.
    #[error("no flow with id {0}")]
    FlowNotFound(FlowId),
    /// An update closure changed the key of the record it was given.
    #[error("update of {table} record {id} changed its id")]
    IdChanged {
        /// Table name.
        table: &'static str,
        /// The record's id before the update.
        id: String,
    },
    /// The address is already leased to another sandbox.
    #[error("address {ip} of pool {pool} is already leased to sandbox {holder}")]
    AlreadyLeased {
        /// Pool of the address.
        pool: String,
        /// The address.
        ip: IpAddr,
        /// Sandbox holding it.
        holder: SandboxId,
    },
    /// The database file could not be created with, or set to, mode 0600.
    #[error("cannot create store file {path} with mode 0600")]
    CreateFile {
        /// The database file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl StoreError {
    /// True when the error says a sandbox, container or flow does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            StoreError::SandboxNotFound(_)
                | StoreError::ContainerNotFound(_)
                | StoreError::FlowNotFound(_)
        )
    }

    pub(crate) fn db<E: Into<redb::Error>>(op: &'static str) -> impl FnOnce(E) -> StoreError {
        move |e| StoreError::Database {
            op,
            source: Box::new(e.into()),
        }
    }
}
