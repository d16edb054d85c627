//! The runtime crate's error type.

use cubelet_engine::{StepError, StepErrorKind};

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
    /// A containerd call failed.
    #[error("containerd {op} failed: {status}", status = .source.message())]
    Containerd {
        /// Which call (e.g. `containers.create`).
        op: &'static str,
        /// gRPC status from containerd.
        #[source]
        source: tonic::Status,
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
    /// An HTTP exchange with a registry failed below the HTTP level.
    #[error("registry request {url}")]
    RegistryHttp {
        /// URL requested.
        url: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A registry answered with an unexpected HTTP status.
    #[error("registry {url} answered {status}: {body}")]
    RegistryStatus {
        /// URL requested.
        url: String,
        /// HTTP status code.
        status: u16,
        /// Start of the response body.
        body: String,
    },
    /// A registry refused access (bad or missing credentials).
    #[error("registry {url} denied access: {reason}")]
    Unauthorized {
        /// URL requested.
        url: String,
        /// What the registry or the token server said.
        reason: String,
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
    /// A registry host config file (`hosts.toml`) could not be parsed.
    #[error("registry host config {path}")]
    HostsConfig {
        /// Path of the file.
        path: String,
        /// Why.
        #[source]
        source: toml::de::Error,
    },
    /// A TLS file named by a registry host config (`ca`, `client`) is
    /// missing or unusable.
    #[error("registry tls {what} {path}")]
    RegistryTlsFile {
        /// Which file (`CA certificate`, `client certificate`, `client key`).
        what: &'static str,
        /// Path of the file.
        path: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A registry's TLS server certificate was not accepted.
    #[error(
        "registry {url}: server certificate not trusted (give its CA with `ca`, \
         or set `skip_verify`, in the registry's hosts.toml)"
    )]
    RegistryCertificate {
        /// URL requested.
        url: String,
        /// What rustls found wrong with the certificate.
        #[source]
        source: rustls::Error,
    },
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

impl RuntimeError {
    /// Wraps a containerd status as it is.
    pub fn containerd(op: &'static str, source: tonic::Status) -> Self {
        RuntimeError::Containerd { op, source }
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
            RuntimeError::Containerd { source, .. } => source.code() == tonic::Code::NotFound,
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
            RuntimeError::ImageFormat { .. } => StepErrorKind::FailedPrecondition,
            RuntimeError::Containerd { source, .. } => match source.code() {
                tonic::Code::NotFound => StepErrorKind::NotFound,
                tonic::Code::AlreadyExists => StepErrorKind::AlreadyExists,
                tonic::Code::InvalidArgument => StepErrorKind::InvalidArgument,
                tonic::Code::FailedPrecondition => StepErrorKind::FailedPrecondition,
                tonic::Code::DeadlineExceeded => StepErrorKind::DeadlineExceeded,
                tonic::Code::ResourceExhausted => StepErrorKind::ResourceExhausted,
                _ => StepErrorKind::Internal,
            },
            _ => StepErrorKind::Internal,
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
        assert_eq!(e.kind(), StepErrorKind::Internal);
    }
}
