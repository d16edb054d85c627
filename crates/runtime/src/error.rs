//! The runtime crate's error type.

use cubelet_engine::{StepError, StepErrorKind};
use cubelet_registry::RegistryError;

/// Errors of the containerd runtime.
///
/// Append new variants at the end; several modules share this enum.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// Could not connect to containerd.
    #[error("connect to containerd at {address}")]
    Connect {
        /// Socket path.
        address: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// A containerd call failed. The status is not the error's source: its
    /// message is already in this one's text, and a chain printed as
    /// `a: b` would repeat it (runc's errors twice, once quoted).
    #[error("containerd {op} failed: {message}", message = .status.message())]
    Containerd {
        /// Which call (e.g. `containers.create`).
        op: &'static str,
        /// gRPC status from containerd.
        status: tonic::Status,
    },
    /// An object does not exist.
    #[error("{kind} {id} not found")]
    NotFound {
        /// Kind of object (image, container, ...).
        kind: &'static str,
        /// Its id or reference.
        id: String,
    },
    /// An object already exists.
    #[error("{kind} {id} already exists")]
    AlreadyExists {
        /// Kind of object.
        kind: &'static str,
        /// Its id or reference.
        id: String,
    },
    /// A request value is not acceptable.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// Field name as the caller knows it.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// The object is not in a state that allows the operation.
    #[error("{0}")]
    FailedPrecondition(String),
    /// Local I/O failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// Path involved.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An operation did not finish in time.
    #[error("{op} of {id} timed out after {timeout:?}")]
    Timeout {
        /// What was being done (e.g. `exec`).
        op: &'static str,
        /// Container (or sandbox) id.
        id: String,
        /// The time allowed.
        timeout: std::time::Duration,
    },
    /// A JSON document (OCI spec, seccomp profile) could not be encoded or decoded.
    #[error("{what} json")]
    Json {
        /// Which document.
        what: &'static str,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// Downloaded or imported content does not match its digest.
    #[error("content {digest} does not match its digest (got {actual})")]
    DigestMismatch {
        /// Expected digest.
        digest: String,
        /// Digest of what was received.
        actual: String,
    },
    /// An image document is malformed or unusable on this node.
    #[error("image {reference}: {reason}")]
    ImageFormat {
        /// Image reference (or digest) concerned.
        reference: String,
        /// What is wrong.
        reason: String,
    },
    /// The registry client failed (HTTP, auth, TLS, hosts.toml, documents).
    /// Its bad-argument, not-found, digest and image-format errors become
    /// the variants of those names instead.
    #[error(transparent)]
    Registry(RegistryError),
    /// A pod namespace could not be made, pinned or removed.
    #[error("{op} {path}")]
    Namespace {
        /// What was being done.
        op: &'static str,
        /// Pin or directory involved.
        path: String,
        /// Why.
        #[source]
        source: nix::errno::Errno,
    },
    /// A ttrpc call to a shim got no usable answer: an error status, or a
    /// reply that is not one.
    #[error("ttrpc {method} on {socket}: {reason}")]
    Ttrpc {
        /// `service/method` called.
        method: String,
        /// The shim's socket.
        socket: String,
        /// What came back.
        reason: String,
    },
    /// The error of an operation this caller joined instead of repeating
    /// (an image pull of the same reference under way).
    #[error(transparent)]
    Shared(std::sync::Arc<RuntimeError>),
}

/// `map_err` adapter: [`RuntimeError::containerd`] for `op`.
pub(crate) fn cd(op: &'static str) -> impl FnOnce(tonic::Status) -> RuntimeError {
    move |s| RuntimeError::containerd(op, s)
}

/// `map_err` adapter: [`RuntimeError::about_container`] for `op` on `id`.
pub(crate) fn cd_container<'a>(
    op: &'static str,
    id: &'a str,
) -> impl FnOnce(tonic::Status) -> RuntimeError + 'a {
    move |s| RuntimeError::about_container(op, id, s)
}

/// `map_err` adapter for calls on a container's processes (`tasks.exec`,
/// `tasks.wait`): only `NotFound` names the container; any other status,
/// `AlreadyExists` of an exec id included, stays a containerd error.
pub(crate) fn cd_process<'a>(
    op: &'static str,
    id: &'a str,
) -> impl FnOnce(tonic::Status) -> RuntimeError + 'a {
    move |s| {
        if s.code() == tonic::Code::NotFound {
            RuntimeError::about_container(op, id, s)
        } else {
            RuntimeError::containerd(op, s)
        }
    }
}

impl From<cubelet_host::pins::PinError> for RuntimeError {
    fn from(e: cubelet_host::pins::PinError) -> Self {
        match e {
            cubelet_host::pins::PinError::Io { op, path, source } => RuntimeError::Io {
                op,
                path: path.display().to_string(),
                source,
            },
            cubelet_host::pins::PinError::Sys { op, path, source } => RuntimeError::Namespace {
                op,
                path: path.display().to_string(),
                source,
            },
            cubelet_host::pins::PinError::Thread { what, source } => RuntimeError::Io {
                op: "namespace thread for",
                path: what,
                source,
            },
        }
    }
}

/// A closure turning an I/O error of `op` on `path` into
/// [`RuntimeError::Io`], for `map_err`.
pub(crate) fn io_err<'a>(
    op: &'static str,
    path: &'a std::path::Path,
) -> impl FnOnce(std::io::Error) -> RuntimeError + 'a {
    move |source| RuntimeError::Io {
        op,
        path: path.display().to_string(),
        source,
    }
}

impl RuntimeError {
    /// Wraps a containerd status as it is.
    pub fn containerd(op: &'static str, source: tonic::Status) -> Self {
        RuntimeError::Containerd { op, status: source }
    }

    /// Wraps a containerd status about container `id`: `NotFound` and
    /// `AlreadyExists` become the typed variants naming the container.
    pub fn about_container(op: &'static str, id: &str, source: tonic::Status) -> Self {
        match source.code() {
            tonic::Code::NotFound => RuntimeError::NotFound {
                kind: "container",
                id: id.to_owned(),
            },
            tonic::Code::AlreadyExists => RuntimeError::AlreadyExists {
                kind: "container",
                id: id.to_owned(),
            },
            _ => RuntimeError::containerd(op, source),
        }
    }

    /// True if containerd said the object does not exist.
    pub fn is_not_found(&self) -> bool {
        match self {
            RuntimeError::NotFound { .. } => true,
            RuntimeError::Containerd { status: source, .. } => {
                source.code() == tonic::Code::NotFound
            }
            RuntimeError::Shared(e) => e.is_not_found(),
            _ => false,
        }
    }

    /// The engine's error kind for this error.
    pub fn kind(&self) -> StepErrorKind {
        match self {
            RuntimeError::NotFound { .. } => StepErrorKind::NotFound,
            RuntimeError::AlreadyExists { .. } => StepErrorKind::AlreadyExists,
            RuntimeError::InvalidArgument { .. } => StepErrorKind::InvalidArgument,
            RuntimeError::FailedPrecondition(_) => StepErrorKind::FailedPrecondition,
            RuntimeError::Timeout { .. } => StepErrorKind::DeadlineExceeded,
            // An image whose documents or blobs are not what they claim
            // is unusable as it stands: the image's fault, not Cubelet's
            // (a tenant's crafted image must not read as an agent bug).
            RuntimeError::ImageFormat { .. } | RuntimeError::DigestMismatch { .. } => {
                StepErrorKind::FailedPrecondition
            }
            RuntimeError::Registry(e) => registry_kind(e),
            RuntimeError::Connect { .. } => StepErrorKind::Unavailable,
            RuntimeError::Containerd { op, status } if user_process_failed(op, status) => {
                StepErrorKind::FailedPrecondition
            }
            RuntimeError::Containerd { status: source, .. } => match source.code() {
                tonic::Code::NotFound => StepErrorKind::NotFound,
                tonic::Code::AlreadyExists => StepErrorKind::AlreadyExists,
                tonic::Code::InvalidArgument => StepErrorKind::InvalidArgument,
                tonic::Code::FailedPrecondition => StepErrorKind::FailedPrecondition,
                tonic::Code::DeadlineExceeded => StepErrorKind::DeadlineExceeded,
                tonic::Code::ResourceExhausted => StepErrorKind::ResourceExhausted,
                tonic::Code::Unavailable => StepErrorKind::Unavailable,
                _ => StepErrorKind::Internal,
            },
            RuntimeError::Shared(e) => e.kind(),
            _ => StepErrorKind::Internal,
        }
    }
}

/// True when runc could not start the container's own process for a reason
/// the pod's spec or image gives (its command is not there or not
/// executable, its working directory cannot be entered): the workload's
/// fault, reported by containerd as `Unknown`.
fn user_process_failed(op: &str, status: &tonic::Status) -> bool {
    matches!(op, "tasks.create" | "tasks.start")
        && status.code() == tonic::Code::Unknown
        && [
            "unable to start container process: exec: ",
            "unable to start container process: chdir to cwd",
        ]
        .iter()
        .any(|m| status.message().contains(m))
}

/// The kind of a registry failure: the registry down or failing is
/// `Unavailable` (a retry may succeed); content that is not what its
/// descriptor says, a refusal, or the node's registry configuration is
/// `FailedPrecondition`; only a local I/O failure is `Internal`.
fn registry_kind(e: &RegistryError) -> StepErrorKind {
    match e {
        RegistryError::InvalidArgument { .. } => StepErrorKind::InvalidArgument,
        RegistryError::NotFound { .. } => StepErrorKind::NotFound,
        RegistryError::Stalled { .. } => StepErrorKind::DeadlineExceeded,
        RegistryError::Http { .. } | RegistryError::Unreachable { .. } => {
            StepErrorKind::Unavailable
        }
        RegistryError::Status { status, .. } if *status == 429 || *status >= 500 => {
            StepErrorKind::Unavailable
        }
        RegistryError::Status { .. }
        | RegistryError::Unauthorized { .. }
        | RegistryError::DigestMismatch { .. }
        | RegistryError::TooLarge { .. }
        | RegistryError::TooSmall { .. }
        | RegistryError::InvalidDigest { .. }
        | RegistryError::Json { .. }
        | RegistryError::ImageFormat { .. }
        | RegistryError::HostsConfig { .. }
        | RegistryError::TlsFile { .. }
        | RegistryError::TlsSetup(_)
        | RegistryError::Certificate { .. } => StepErrorKind::FailedPrecondition,
        RegistryError::Io { .. } => StepErrorKind::Internal,
    }
}

impl From<RegistryError> for RuntimeError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::InvalidArgument { field, reason } => {
                RuntimeError::InvalidArgument { field, reason }
            }
            RegistryError::NotFound { kind, id } => RuntimeError::NotFound { kind, id },
            RegistryError::DigestMismatch { digest, actual } => {
                RuntimeError::DigestMismatch { digest, actual }
            }
            RegistryError::ImageFormat { reference, reason } => {
                RuntimeError::ImageFormat { reference, reason }
            }
            other => RuntimeError::Registry(other),
        }
    }
}

impl From<RuntimeError> for StepError {
    fn from(e: RuntimeError) -> Self {
        StepError::new(e.kind(), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// runc's error relayed by containerd was printed twice (in the
    /// message, then again as the quoted status); it is named once, also
    /// as a step error.
    #[test]
    fn a_runc_error_is_named_once() {
        let msg = "failed to create shim task: OCI runtime create failed: runc create failed: \
                   unable to start container process: exec: \"nope\": executable file not found \
                   in $PATH: unknown";
        let e = RuntimeError::containerd("tasks.create", tonic::Status::unknown(msg));
        let s = cubelet_engine::chain(&e);
        assert_eq!(s, format!("containerd tasks.create failed: {msg}"));
        assert_eq!(s.matches("runc create failed").count(), 1, "{s}");
        // A command the image lacks is the workload's fault, not the agent's.
        assert_eq!(e.kind(), StepErrorKind::FailedPrecondition);
        let step = StepError::from(e);
        let s = cubelet_engine::chain(&step);
        assert_eq!(s.matches("runc create failed").count(), 1, "{s}");
        let cwd = "failed to create shim task: OCI runtime create failed: runc create failed: \
                   unable to start container process: chdir to cwd (\"/nope\") set in config.json \
                   failed: no such file or directory: unknown";
        let e = RuntimeError::containerd("tasks.create", tonic::Status::unknown(cwd));
        assert_eq!(e.kind(), StepErrorKind::FailedPrecondition);
        // Other runc failures stay the agent's to explain.
        let other = "failed to create shim task: OCI runtime create failed: runc create failed: \
                     unable to apply cgroup configuration: unknown";
        let e = RuntimeError::containerd("tasks.create", tonic::Status::unknown(other));
        assert_eq!(e.kind(), StepErrorKind::Internal);
    }

    #[test]
    fn container_statuses_become_typed_errors() {
        let e =
            RuntimeError::about_container("containers.get", "c1", tonic::Status::not_found("x"));
        assert!(matches!(&e, RuntimeError::NotFound { kind: "container", id } if id == "c1"));
        assert_eq!(e.kind(), StepErrorKind::NotFound);
        let e = RuntimeError::about_container(
            "containers.create",
            "c1",
            tonic::Status::already_exists("x"),
        );
        assert!(matches!(e, RuntimeError::AlreadyExists { .. }));
        let e = RuntimeError::about_container("tasks.exec", "c1", tonic::Status::unavailable("x"));
        assert!(matches!(
            e,
            RuntimeError::Containerd {
                op: "tasks.exec",
                ..
            }
        ));
        // containerd down or restarting: a retry may succeed.
        assert_eq!(e.kind(), StepErrorKind::Unavailable);
        let e = RuntimeError::about_container("tasks.exec", "c1", tonic::Status::unknown("x"));
        assert_eq!(e.kind(), StepErrorKind::Internal);
    }

    #[test]
    fn registry_errors_keep_their_kind_and_message() {
        let e = RuntimeError::from(RegistryError::InvalidArgument {
            field: "image reference".to_owned(),
            reason: "\"Busybox\": invalid".to_owned(),
        });
        assert!(
            matches!(&e, RuntimeError::InvalidArgument { field, .. } if field == "image reference")
        );
        assert_eq!(e.kind(), StepErrorKind::InvalidArgument);
        let e = RuntimeError::from(RegistryError::NotFound {
            kind: "blob",
            id: "u".to_owned(),
        });
        assert!(e.is_not_found());
        assert_eq!(e.kind(), StepErrorKind::NotFound);
        let e = RuntimeError::from(RegistryError::ImageFormat {
            reference: "r".to_owned(),
            reason: "x".to_owned(),
        });
        assert_eq!(e.kind(), StepErrorKind::FailedPrecondition);
        let e = RuntimeError::from(RegistryError::DigestMismatch {
            digest: "a".to_owned(),
            actual: "b".to_owned(),
        });
        assert!(matches!(e, RuntimeError::DigestMismatch { .. }));
        // A crafted image is the image's fault, never Internal.
        assert_eq!(e.kind(), StepErrorKind::FailedPrecondition);
        let e = RuntimeError::from(RegistryError::TooSmall {
            digest: "a".to_owned(),
            url: "u".to_owned(),
            declared: 2,
            received: 1,
        });
        assert_eq!(e.kind(), StepErrorKind::FailedPrecondition);
        let e = RuntimeError::from(RegistryError::TlsSetup(rustls::Error::General("x".into())));
        assert_eq!(e.kind(), StepErrorKind::FailedPrecondition);
        assert_eq!(
            cubelet_engine::chain(&e),
            "registry TLS setup: unexpected error: x"
        );
        let e = RuntimeError::from(RegistryError::Status {
            url: "http://r/v2/".to_owned(),
            status: 500,
            body: "oops".to_owned(),
        });
        assert_eq!(e.kind(), StepErrorKind::Unavailable);
        assert_eq!(e.to_string(), "registry http://r/v2/ answered 500: oops");
        let e = RuntimeError::from(RegistryError::Status {
            url: "http://r/v2/".to_owned(),
            status: 403,
            body: "no".to_owned(),
        });
        assert_eq!(e.kind(), StepErrorKind::FailedPrecondition);
        let shared = RuntimeError::Shared(std::sync::Arc::new(e));
        assert_eq!(shared.kind(), StepErrorKind::FailedPrecondition);
    }
}
