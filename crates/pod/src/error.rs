//! The pod service's error type. The CRI edge maps it to gRPC codes (in
//! `cubelet_cri::error`, the one place the project does that).

use cubelet_engine::EngineError;
use cubelet_runtime::RuntimeError;
use cubelet_store::StoreError;

/// Everything a pod lifecycle call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    /// A request value is missing or malformed.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// Field path as the client wrote it, e.g. `pod_sandbox_id`.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// No object with that id.
    #[error("{kind} {id:?} not found")]
    NotFound {
        /// Kind (`pod sandbox`, `container`, `image`).
        kind: &'static str,
        /// The id asked for.
        id: String,
    },
    /// The name is in use by another object.
    #[error("{kind} name {name:?} is already in use by {by}")]
    AlreadyExists {
        /// Kind.
        kind: &'static str,
        /// The name.
        name: String,
        /// Id of the object holding it.
        by: String,
    },
    /// The object is not in a state that allows the call.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The call ran past its deadline.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A per-pod bound is reached; a later call may succeed.
    #[error("{0}")]
    ResourceExhausted(String),
    /// A flow failed, was rejected or cancelled.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The container runtime failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The node's store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The task running the call died (a bug: it panicked).
    #[error("{what} task died: {reason}")]
    TaskDied {
        /// Which call.
        what: &'static str,
        /// The join error.
        reason: String,
    },
}

impl PodError {
    /// A missing or malformed field.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        PodError::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Result of a pod service call.
pub type PodResult<T> = Result<T, PodError>;
