//! The CRI shim's error type, and the one place errors become gRPC statuses.

use cubelet_engine::{chain, EngineError, StepErrorKind};
use cubelet_pod::PodError;
use cubelet_pod::StoreError;
use cubelet_runtime::RuntimeError;
use tonic::{Code, Status};

/// Everything a CRI call can fail with.
///
/// The kinds a client can be told about (bad input, a missing object, a
/// name in use, a state that forbids the call, a deadline, a failed flow,
/// runtime or store) are the pod service's: the CRI layer's own refusals
/// are built as [`PodError`]s too, so both are mapped to gRPC codes once,
/// in [`CriError::code`].
#[derive(Debug, thiserror::Error)]
pub enum CriError {
    /// A pod lifecycle failure, or a refusal of the CRI layer of one of its
    /// kinds.
    #[error(transparent)]
    Pod(#[from] PodError),
    /// The call is not supported.
    #[error("{0}")]
    Unimplemented(String),
    /// A limit of the node is reached (e.g. too many unused streaming URLs).
    #[error("{0}")]
    ResourceExhausted(String),
    /// Cubelet itself failed (a bug).
    #[error("{0}")]
    Internal(String),
}

impl From<EngineError> for CriError {
    fn from(e: EngineError) -> Self {
        CriError::Pod(e.into())
    }
}

impl From<RuntimeError> for CriError {
    fn from(e: RuntimeError) -> Self {
        CriError::Pod(e.into())
    }
}

impl From<StoreError> for CriError {
    fn from(e: StoreError) -> Self {
        CriError::Pod(e.into())
    }
}

impl CriError {
    /// A missing or malformed field (`field` as in the CRI message, e.g.
    /// `config.metadata.name`).
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        CriError::Pod(PodError::invalid(field, reason))
    }

    /// No `kind` with id `id`.
    pub fn not_found(kind: &'static str, id: impl Into<String>) -> Self {
        CriError::Pod(PodError::NotFound {
            kind,
            id: id.into(),
        })
    }

    /// The object is not in a state that allows the call.
    pub fn precondition(why: impl Into<String>) -> Self {
        CriError::Pod(PodError::FailedPrecondition(why.into()))
    }

    /// A limit of the node is reached.
    pub fn resource_exhausted(why: impl Into<String>) -> Self {
        CriError::ResourceExhausted(why.into())
    }

    /// The field a request was refused for, when it was bad input.
    pub fn invalid_field(&self) -> Option<&str> {
        match self {
            CriError::Pod(PodError::InvalidArgument { field, .. }) => Some(field),
            _ => None,
        }
    }

    /// The gRPC code for this error (the single mapping of the project).
    pub fn code(&self) -> Code {
        match self {
            CriError::Pod(e) => match e {
                PodError::InvalidArgument { .. } => Code::InvalidArgument,
                PodError::NotFound { .. } => Code::NotFound,
                PodError::AlreadyExists { .. } => Code::AlreadyExists,
                PodError::FailedPrecondition(_) => Code::FailedPrecondition,
                PodError::DeadlineExceeded(_) => Code::DeadlineExceeded,
                PodError::ResourceExhausted(_) => Code::ResourceExhausted,
                PodError::Engine(e) => match e {
                    EngineError::Rejected { .. } => Code::ResourceExhausted,
                    EngineError::Cancelled { .. } => Code::Cancelled,
                    _ => e.step_kind().map_or(Code::Internal, step_code),
                },
                PodError::Runtime(e) => step_code(e.kind()),
                PodError::Store(_) | PodError::TaskDied { .. } => Code::Internal,
            },
            CriError::Unimplemented(_) => Code::Unimplemented,
            CriError::ResourceExhausted(_) => Code::ResourceExhausted,
            CriError::Internal(_) => Code::Internal,
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
        StepErrorKind::Unavailable => Code::Unavailable,
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
        let down = CriError::from(RuntimeError::containerd(
            "tasks.create",
            tonic::Status::unavailable("transport is closing"),
        ));
        assert_eq!(down.code(), Code::Unavailable);
        let status = Status::from(failed);
        assert!(
            status.message().contains("network: no free address"),
            "{}",
            status.message()
        );
    }
}
