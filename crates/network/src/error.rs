//! The crate's error type and its mapping onto the engine's step errors.

use std::io;
use std::net::IpAddr;
use std::path::PathBuf;

use cubelet_engine::{BoxError, SandboxId, StepError, StepErrorKind};
use ipnet::Ipv4Net;

use crate::SubStep;

/// Everything that can go wrong in the network provider.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// The configuration cannot work (subnet too small, bad bridge name, ...).
    #[error("invalid network config: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },
    /// Every address of the pool is leased.
    #[error("no free address left in pool {pool} ({subnet})")]
    PoolExhausted {
        /// Pool name.
        pool: String,
        /// Its subnet.
        subnet: Ipv4Net,
    },
    /// The lease store failed.
    #[error("lease store {op} failed for pool {pool}")]
    LeaseStore {
        /// What was being done (`add`, `release`, `list`).
        op: &'static str,
        /// Pool name.
        pool: String,
        /// The store's error.
        #[source]
        source: BoxError,
    },
    /// A netlink request failed.
    #[error("netlink {op} {target} failed")]
    Netlink {
        /// What was being done (`add link`, `set address`, ...).
        op: &'static str,
        /// Link, address or route it was done to.
        target: String,
        /// The netlink error.
        #[source]
        source: rtnetlink::Error,
    },
    /// A link the provider needs does not exist.
    #[error("link {name} not found")]
    LinkNotFound {
        /// Link name.
        name: String,
    },
    /// A file system or namespace operation failed.
    #[error("{op} {path} failed")]
    Io {
        /// What was being done.
        op: &'static str,
        /// Path it was done to.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The `nft` binary is not installed.
    #[error("nft binary not found in PATH (install nftables)")]
    NftMissing,
    /// An `nft` invocation failed.
    #[error("nft {op} failed ({status}): {stderr}")]
    Nft {
        /// What was being done.
        op: &'static str,
        /// Exit status.
        status: String,
        /// What nft printed on stderr.
        stderr: String,
    },
    /// A host port is already forwarded to another sandbox.
    #[error("host port {protocol}/{host_port} is already mapped by sandbox {owner}")]
    PortConflict {
        /// Protocol name.
        protocol: &'static str,
        /// Host port.
        host_port: u16,
        /// Sandbox that holds it.
        owner: String,
    },
    /// A port mapping the provider cannot express.
    #[error("unsupported port mapping to host address {host_ip}")]
    UnsupportedPortMapping {
        /// The requested host address.
        host_ip: IpAddr,
    },
    /// A helper thread could not be started or died.
    #[error("namespace helper thread for {what} failed")]
    Thread {
        /// What the thread was for.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A failure injected by the test hook after a sub-step.
    #[error("injected failure after {step:?} for sandbox {sandbox}")]
    Injected {
        /// Sub-step after which the failure was injected.
        step: SubStep,
        /// Sandbox.
        sandbox: SandboxId,
    },
    /// The caller gave up; the partial work was rolled back.
    #[error("network setup for sandbox {sandbox} cancelled{}", after.map(|s| format!(" after {s:?}")).unwrap_or_default())]
    Cancelled {
        /// Sandbox.
        sandbox: SandboxId,
        /// Last sub-step that completed, if any.
        after: Option<SubStep>,
    },
    /// Creating failed and undoing the partial work failed too.
    #[error("{error}; rollback also failed: {rollback}")]
    RollbackFailed {
        /// The original failure.
        #[source]
        error: Box<NetworkError>,
        /// Why the rollback failed.
        rollback: Box<NetworkError>,
    },
}

impl NetworkError {
    /// The engine error kind for this failure.
    pub fn kind(&self) -> StepErrorKind {
        match self {
            NetworkError::InvalidConfig { .. } | NetworkError::UnsupportedPortMapping { .. } => {
                StepErrorKind::InvalidArgument
            }
            NetworkError::PoolExhausted { .. } => StepErrorKind::ResourceExhausted,
            NetworkError::PortConflict { .. } => StepErrorKind::AlreadyExists,
            NetworkError::NftMissing => StepErrorKind::FailedPrecondition,
            NetworkError::Cancelled { .. } => StepErrorKind::Cancelled,
            NetworkError::LinkNotFound { .. } => StepErrorKind::NotFound,
            NetworkError::RollbackFailed { error, .. } => error.kind(),
            _ => StepErrorKind::Internal,
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        NetworkError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn nix(op: &'static str, path: impl Into<PathBuf>, errno: nix::Error) -> Self {
        NetworkError::Io {
            op,
            path: path.into(),
            source: io::Error::from(errno),
        }
    }

    pub(crate) fn netlink(
        op: &'static str,
        target: impl Into<String>,
        e: rtnetlink::Error,
    ) -> Self {
        NetworkError::Netlink {
            op,
            target: target.into(),
            source: e,
        }
    }
}

impl From<NetworkError> for StepError {
    fn from(e: NetworkError) -> Self {
        StepError::new(e.kind(), e)
    }
}

/// The errno of a netlink error answer, if it is one.
pub(crate) fn netlink_errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(msg) => msg.code.map(|c| -c.get()),
        _ => None,
    }
}
