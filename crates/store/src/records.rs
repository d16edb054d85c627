//! The records the store keeps. Values are JSON, so fields can be added
//! later: every optional or later field carries `#[serde(default)]`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::SystemTime;

use cubelet_engine::spec::{NetworkStatus, SandboxProcess, StorageStatus};
use cubelet_engine::{SandboxId, SandboxSpec};
use serde::{Deserialize, Serialize};

/// Lifecycle state of a stored sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// The `create` flow is running (or was interrupted by a crash).
    Creating,
    /// Created and running.
    Ready,
    /// Stopped, or its infra process died.
    NotReady,
    /// Teardown failed or was interrupted; the cleanup loop must retry it.
    NeedsCleanup,
}

impl SandboxState {
    /// Lowercase name, for logs and the `cubelet_sandboxes{state}` metric.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Ready => "ready",
            SandboxState::NotReady => "not_ready",
            SandboxState::NeedsCleanup => "needs_cleanup",
        }
    }
}

/// A pod sandbox as the node remembers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// Sandbox id (the key).
    pub id: SandboxId,
    /// The spec it was created with.
    pub spec: SandboxSpec,
    /// Current state.
    pub state: SandboxState,
    /// When it was first recorded.
    pub created_at: SystemTime,
    /// When it was stopped.
    #[serde(default)]
    pub stopped_at: Option<SystemTime>,
    /// What the network step published.
    #[serde(default)]
    pub network: Option<NetworkStatus>,
    /// What the storage step published.
    #[serde(default)]
    pub storage: Option<StorageStatus>,
    /// What the sandbox step published.
    #[serde(default)]
    pub process: Option<SandboxProcess>,
    /// Cleanup attempts so far, for backoff.
    #[serde(default)]
    pub cleanup_attempts: u32,
    /// The last error seen for this sandbox.
    #[serde(default)]
    pub last_error: Option<String>,
}

impl SandboxRecord {
    /// A new record in state [`SandboxState::Creating`], created now.
    pub fn new(id: SandboxId, spec: SandboxSpec) -> Self {
        Self {
            id,
            spec,
            state: SandboxState::Creating,
            created_at: SystemTime::now(),
            stopped_at: None,
            network: None,
            storage: None,
            process: None,
            cleanup_attempts: 0,
            last_error: None,
        }
    }
}

/// A warm-pool shell: the pod-independent part of a sandbox (namespaces,
/// network, sandbox directory) made ahead of any pod by a `prewarm` flow,
/// under the sandbox id the pod that claims it will have. The record exists
/// from before the flow acts until the shell is claimed (a sandbox record
/// with the same id is written first) or destroyed, so the garbage
/// collector counts its objects as live, and a restart finds every shell
/// the last run left.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShellRecord {
    /// The shell's id: the sandbox id of the pod that claims it.
    pub id: SandboxId,
    /// When it was first recorded.
    pub created_at: SystemTime,
}

impl ShellRecord {
    /// A new record, created now.
    pub fn new(id: SandboxId) -> Self {
        Self {
            id,
            created_at: SystemTime::now(),
        }
    }
}

/// Lifecycle state of a stored container (CRI `ContainerState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContainerState {
    /// Created, not started.
    Created,
    /// Its task runs.
    Running,
    /// Its task exited.
    Exited,
    /// State could not be determined.
    Unknown,
}

/// A container as the node remembers it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContainerRecord {
    /// Container id (the key).
    pub id: String,
    /// Sandbox it belongs to.
    pub sandbox_id: SandboxId,
    /// Container name (metadata).
    pub name: String,
    /// Attempt number (metadata).
    pub attempt: u32,
    /// Current state.
    pub state: ContainerState,
    /// Image as requested.
    pub image: String,
    /// Resolved image reference (digest).
    #[serde(default)]
    pub image_ref: String,
    /// When it was created.
    pub created_at: SystemTime,
    /// When its task started.
    #[serde(default)]
    pub started_at: Option<SystemTime>,
    /// When its task exited.
    #[serde(default)]
    pub finished_at: Option<SystemTime>,
    /// Exit code once exited.
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// Short reason for the state (`Completed`, `OOMKilled`, ...).
    #[serde(default)]
    pub reason: Option<String>,
    /// Human readable message for the state.
    #[serde(default)]
    pub message: Option<String>,
    /// CRI log file.
    #[serde(default)]
    pub log_path: Option<PathBuf>,
    /// Labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Annotations.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// Host PID of its task while it runs.
    #[serde(default)]
    pub pid: Option<u32>,
    /// The container config, opaque to the store (owned by the CRI layer).
    #[serde(default)]
    pub config: serde_json::Value,
}

impl ContainerRecord {
    /// A new record in state [`ContainerState::Created`], created now, with
    /// every optional field empty.
    pub fn new(
        id: impl Into<String>,
        sandbox_id: SandboxId,
        name: impl Into<String>,
        attempt: u32,
        image: impl Into<String>,
    ) -> Self {
        Self {
            id: id.into(),
            sandbox_id,
            name: name.into(),
            attempt,
            state: ContainerState::Created,
            image: image.into(),
            image_ref: String::new(),
            created_at: SystemTime::now(),
            started_at: None,
            finished_at: None,
            exit_code: None,
            reason: None,
            message: None,
            log_path: None,
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            pid: None,
            config: serde_json::Value::Null,
        }
    }
}

/// An address of an IPAM pool held by a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpLease {
    /// The address.
    pub ip: IpAddr,
    /// Sandbox holding it.
    pub sandbox_id: SandboxId,
    /// Pool (network) it comes from.
    pub pool: String,
    /// When it was leased.
    pub allocated_at: SystemTime,
}

impl IpLease {
    /// The table key: `pool/ip`.
    pub(crate) fn key(pool: &str, ip: IpAddr) -> String {
        format!("{pool}/{ip}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_sandbox_json_without_optional_fields_decodes() {
        let json = serde_json::json!({
            "id": "abc",
            "spec": SandboxSpec::default(),
            "state": "ready",
            "created_at": { "secs_since_epoch": 1, "nanos_since_epoch": 0 },
        });
        let rec: SandboxRecord = serde_json::from_value(json).unwrap();
        assert_eq!(rec.state, SandboxState::Ready);
        assert_eq!(rec.cleanup_attempts, 0);
        assert!(rec.network.is_none() && rec.last_error.is_none());
    }

    #[test]
    fn old_sandbox_process_json_reads_as_an_infra_process() {
        let json = serde_json::json!({
            "id": "abc",
            "spec": SandboxSpec::default(),
            "state": "ready",
            "created_at": { "secs_since_epoch": 1, "nanos_since_epoch": 0 },
            "process": { "pid": 42, "runtime_handler": "runc" },
        });
        let rec: SandboxRecord = serde_json::from_value(json).unwrap();
        let p = rec.process.unwrap();
        assert_eq!((p.pid, p.runtime_handler.as_str()), (Some(42), "runc"));
        assert!(!p.is_infraless());
        assert_eq!((p.ipc_path, p.uts_path, p.pins_dir), (None, None, None));
    }

    #[test]
    fn pinned_sandbox_process_round_trips() {
        let p = SandboxProcess {
            pid: None,
            runtime_handler: "runc".into(),
            ipc_path: Some("/run/cubelet/podns/a/ipc".into()),
            uts_path: None,
            pins_dir: Some("/run/cubelet/podns/a".into()),
        };
        let back: SandboxProcess =
            serde_json::from_value(serde_json::to_value(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert!(back.is_infraless());
    }

    #[test]
    fn old_container_json_without_optional_fields_decodes() {
        let json = serde_json::json!({
            "id": "c1",
            "sandbox_id": "abc",
            "name": "app",
            "attempt": 0,
            "state": "running",
            "image": "busybox",
            "created_at": { "secs_since_epoch": 1, "nanos_since_epoch": 0 },
        });
        let rec: ContainerRecord = serde_json::from_value(json).unwrap();
        assert_eq!(rec.state, ContainerState::Running);
        assert_eq!(rec.config, serde_json::Value::Null);
        assert!(rec.labels.is_empty() && rec.pid.is_none());
    }
}
