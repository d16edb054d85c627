//! The storage crate's error type and its mapping to engine step errors.

use std::io;
use std::path::PathBuf;

use cubelet_engine::{StepError, StepErrorKind};

/// Errors of the storage provider.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// A request field is not acceptable (`log_directory`, `hostname`, `dns`).
    #[error("invalid {field} {value:?}: {reason}")]
    InvalidArgument {
        /// Name of the offending request field.
        field: &'static str,
        /// The value that was refused.
        value: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The provider's configuration cannot work.
    #[error("invalid storage configuration: {0}")]
    Config(String),
    /// A path the provider was about to touch is not where it must be
    /// (outside the root, a symlink, a foreign mount).
    #[error("refusing to touch {path:?}: {reason}")]
    UnsafePath {
        /// The path that was refused.
        path: PathBuf,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A filesystem operation failed.
    #[error("{op} {path:?} failed")]
    Io {
        /// What was being done (`create directory`, `write`, ...).
        op: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Mounting failed.
    #[error("mount {fstype} at {target:?} failed")]
    Mount {
        /// Filesystem type.
        fstype: &'static str,
        /// Mount point.
        target: PathBuf,
        /// The underlying error.
        #[source]
        source: nix::Error,
    },
    /// Unmounting failed.
    #[error("unmount {target:?} failed")]
    Unmount {
        /// Mount point.
        target: PathBuf,
        /// The underlying error.
        #[source]
        source: nix::Error,
    },
    /// An external tool (mkfs.ext4, mount) could not be run or failed.
    #[error("{program} on {path:?} failed: {detail}")]
    Command {
        /// The program.
        program: &'static str,
        /// The file or directory it worked on.
        path: PathBuf,
        /// Exit status and the tail of its stderr, or the spawn error.
        detail: String,
    },
}

impl StorageError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        StorageError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// The engine's kind for this error, which the CRI layer maps to a status code.
    pub fn kind(&self) -> StepErrorKind {
        match self {
            StorageError::InvalidArgument { .. } => StepErrorKind::InvalidArgument,
            StorageError::Config(_) | StorageError::UnsafePath { .. } => {
                StepErrorKind::FailedPrecondition
            }
            StorageError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound => {
                StepErrorKind::NotFound
            }
            _ => StepErrorKind::Internal,
        }
    }
}

impl From<StorageError> for StepError {
    fn from(err: StorageError) -> Self {
        StepError::new(err.kind(), err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_argument_maps_and_names_field() {
        let err = StorageError::InvalidArgument {
            field: "log_directory",
            value: "a/b".into(),
            reason: "must be absolute",
        };
        assert!(err.to_string().contains("log_directory"));
        let step: StepError = err.into();
        assert_eq!(step.kind(), StepErrorKind::InvalidArgument);
        assert!(step.to_string().contains("log_directory"));
    }

    #[test]
    fn unsafe_path_is_failed_precondition() {
        let err = StorageError::UnsafePath {
            path: "/x".into(),
            reason: "symlink",
        };
        assert_eq!(
            StepError::from(err).kind(),
            StepErrorKind::FailedPrecondition
        );
    }
}
