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
    /// Another route or interface address on the node overlaps the bridge
    /// subnet (another runtime's pod network, a VPN, a LAN).
    #[error("bridge subnet {subnet} overlaps {other}")]
    SubnetOverlap {
        /// The configured bridge subnet.
        subnet: Ipv4Net,
        /// What overlaps it: `route 10.88.0.0/16 dev cni0` or
        /// `address 10.86.0.5/24 on eth1`.
        other: String,
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
    /// The CNI configuration directory holds no usable network config.
    #[error("no network config found in {}", conf_dir.display())]
    NoCniConfig {
        /// The directory searched.
        conf_dir: PathBuf,
    },
    /// A CNI network config file cannot be used.
    #[error("invalid cni config {}: {reason}", path.display())]
    CniConfig {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A CNI plugin binary named by the config is not installed.
    #[error("cni plugin {plugin} not found in {dirs}")]
    CniPluginNotFound {
        /// Plugin type.
        plugin: String,
        /// The directories searched, colon-separated.
        dirs: String,
    },
    /// A CNI plugin could not be run.
    #[error("running cni plugin {plugin} ({command}) failed")]
    CniExec {
        /// Plugin type.
        plugin: String,
        /// CNI command (`ADD`, `DEL`, `CHECK`, `VERSION`).
        command: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A CNI plugin reported an error.
    #[error("cni plugin {plugin} {command} failed{}: {msg}{}", code.map(|c| format!(" (code {c})")).unwrap_or_default(), if details.is_empty() { String::new() } else { format!(": {details}") })]
    CniPlugin {
        /// Plugin type.
        plugin: String,
        /// CNI command.
        command: &'static str,
        /// The CNI error code, when the plugin printed one.
        code: Option<u32>,
        /// The plugin's message (or its stderr when it printed no error object).
        msg: String,
        /// The plugin's details.
        details: String,
    },
    /// A CNI plugin printed output that is not a valid result.
    #[error("cni plugin {plugin} {command} returned an unusable result: {reason}")]
    CniOutput {
        /// Plugin type.
        plugin: String,
        /// CNI command.
        command: &'static str,
        /// What is wrong with it.
        reason: String,
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

impl From<cubelet_host::pins::PinError> for NetworkError {
    fn from(e: cubelet_host::pins::PinError) -> Self {
        match e {
            cubelet_host::pins::PinError::Io { op, path, source } => {
                NetworkError::Io { op, path, source }
            }
            cubelet_host::pins::PinError::Sys { op, path, source } => {
                NetworkError::nix(op, path, source)
            }
            cubelet_host::pins::PinError::Thread { what, source } => {
                NetworkError::Thread { what, source }
            }
        }
    }
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
            NetworkError::NftMissing
            | NetworkError::SubnetOverlap { .. }
            | NetworkError::NoCniConfig { .. }
            | NetworkError::CniPluginNotFound { .. } => StepErrorKind::FailedPrecondition,
            NetworkError::CniConfig { .. } => StepErrorKind::InvalidArgument,
            // CNI error codes 1 (incompatible version) and 7 (invalid
            // network config) say the node's setup is wrong, not the request.
            NetworkError::CniPlugin {
                code: Some(1 | 7), ..
            } => StepErrorKind::FailedPrecondition,
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
