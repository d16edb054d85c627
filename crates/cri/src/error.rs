//! The CRI shim's error type, and the one place errors become gRPC statuses.

use cubelet_engine::{chain, EngineError, StepErrorKind};
use cubelet_pod::PodError;
use cubelet_pod::StoreError;
use cubelet_runtime::RuntimeError;
use tonic::{Code, Status};

/// Everything a CRI call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CriError {
    /// A request field is missing or malformed.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// Field path as in the CRI message, e.g. `config.metadata.name`.
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
    /// The call is not supported.
    #[error("{0}")]
    Unimplemented(String),
    /// The call ran past its deadline.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A flow failed, was rejected or cancelled.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// containerd failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The node's store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Cubelet itself failed (a bug).
    #[error("{0}")]
    Internal(String),
}

impl From<PodError> for CriError {
    fn from(e: PodError) -> Self {
        match e {
            PodError::InvalidArgument { field, reason } => {
                CriError::InvalidArgument { field, reason }
            }
            PodError::NotFound { kind, id } => CriError::NotFound { kind, id },
            PodError::AlreadyExists { kind, name, by } => {
                CriError::AlreadyExists { kind, name, by }
            }
            PodError::FailedPrecondition(m) => CriError::FailedPrecondition(m),
            PodError::DeadlineExceeded(m) => CriError::DeadlineExceeded(m),
            PodError::Engine(e) => CriError::Engine(e),
            PodError::Runtime(e) => CriError::Runtime(e),
            PodError::Store(e) => CriError::Store(e),
            e @ PodError::TaskDied { .. } => CriError::Internal(e.to_string()),
        }
    }
}

impl CriError {
    /// A missing or malformed field.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        CriError::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The gRPC code for this error (the single mapping of the project).
    pub fn code(&self) -> Code {
        match self {
            CriError::InvalidArgument { .. } => Code::InvalidArgument,
            CriError::NotFound { .. } => Code::NotFound,
            CriError::AlreadyExists { .. } => Code::AlreadyExists,
            CriError::FailedPrecondition(_) => Code::FailedPrecondition,
            CriError::Unimplemented(_) => Code::Unimplemented,
            CriError::DeadlineExceeded(_) => Code::DeadlineExceeded,
            CriError::Engine(e) => match e {
                EngineError::Rejected { .. } => Code::ResourceExhausted,
                EngineError::Cancelled { .. } => Code::Cancelled,
                _ => e.step_kind().map_or(Code::Internal, step_code),
            },
            CriError::Runtime(e) => step_code(e.kind()),
            CriError::Store(_) | CriError::Internal(_) => Code::Internal,
        }
    }
}

fn step_code(kind: StepErrorKind) -> Code {
    match kind {
        StepErrorKind::InvalidArgument => Code::InvalidArgument,
        StepErrorKind::NotFound => Code::NotFound,
        StepErrorKind::AlreadyExists => Code::AlreadyExists,
        StepErrorKind::ResourceExhausted => Code::ResourceExhausted,
        StepErrorKind::FailedPrecondition => Code::FailedPrecondition,
        StepErrorKind::Cancelled => Code::Cancelled,
        StepErrorKind::DeadlineExceeded => Code::DeadlineExceeded,
        StepErrorKind::Internal => Code::Internal,
    }
}

/// Longest status message sent: it travels in an HTTP/2 header, and a
/// client refuses a header block past its limit (16 KiB in Go and h2) with
/// a protocol error instead of the status.
pub const MAX_MESSAGE: usize = 4096;

impl From<CriError> for Status {
    fn from(e: CriError) -> Self {
        // The message carries the whole cause chain, so `crictl` shows why.
        let mut message = chain(&e);
        if message.len() > MAX_MESSAGE {
            let mut end = MAX_MESSAGE;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            let cut = message.len() - end;
            message.truncate(end);
            message.push_str(&format!("… ({cut} bytes more)"));
        }
        Status::new(e.code(), message)
    }
}

/// Result of a CRI handler.
pub type CriResult<T> = Result<T, CriError>;

#[cfg(test)]
mod tests {
    use super::*;
    use cubelet_engine::{FlowKind, SandboxId, StepError, StepFailure};

    #[test]
    fn codes() {
        assert_eq!(
            CriError::invalid("config.metadata", "missing").code(),
            Code::InvalidArgument
        );
        let rejected = CriError::from(EngineError::Rejected {
            flow: FlowKind::Create,
            limit: 1,
        });
        assert_eq!(rejected.code(), Code::ResourceExhausted);
        let failed = CriError::from(EngineError::Failed {
            flow: FlowKind::Create,
            sandbox_id: SandboxId::new_unchecked("a"),
            failures: vec![StepFailure {
                step: "network".into(),
                error: StepError::new(StepErrorKind::ResourceExhausted, "no free address"),
            }],
            rollback: None,
        });
        assert_eq!(failed.code(), Code::ResourceExhausted);
        let status = Status::from(failed);
        assert!(
            status.message().contains("network: no free address"),
            "{}",
            status.message()
        );
    }
}
