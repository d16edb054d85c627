//! Containers and their tasks on containerd: create, start, stop, remove,
//! status, exec, resource updates and log reopening.
//!
//! A container is a containerd container record (OCI spec, runtime handler,
//! rootfs snapshot keyed by the container id) plus, once started, a task
//! whose stdout/stderr FIFOs are copied into the CRI log file. Everything is
//! derived from the container id, so every teardown is idempotent and works
//! after an agent restart ([`ContainerRuntime::reattach`] resumes logging).
//!
//! A task that a stop finds exited is *retired* on a task of its own, as
//! containerd's own CRI deletes a task when it exits: its exit is recorded on
//! the container record, then the task is deleted. Deleting a task (the shim
//! runs `runc delete` and exits) is most of what removing a stopped container
//! used to cost. StopContainer waits for the retirement
//! ([`ContainerRuntime::retired`]), as containerd's does; a pod's stop does
//! not, and whatever comes next for the container (removal, a repeated stop)
//! waits for one still running. Once retired, the container is known to have
//! no task, and containerd is not asked for it again.
//!
//! [`ContainerRuntime`] is one type; its methods live by what they touch:
//! the container record (create, remove, status, resource updates) in
//! `record`, the task and its log copying (start, stop, reattach) in
//! `task`, and processes run in the container in `exec`.

mod exec;
mod record;
mod task;

pub use exec::{
    truncation_marker, ExecOutput, EXEC_OUTPUT_BUDGET, EXEC_OUTPUT_FREE, MAX_EXEC_OUTPUT,
};
pub use record::{USER_FILE_CAP, USER_LOOKUP_DIR, USER_LOOKUP_TIMEOUT};

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::services::v1::{Container, GetContainerRequest, GetRequest};
use prost_types::Any;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use crate::cgroup::CgroupDriver;
use crate::client::Containerd;
use crate::error::{cd_container, RuntimeError};
use crate::io::logs::LogSink;
use crate::stats::cgroups::CgroupSupport;

/// Type URL of an OCI runtime spec in containerd.
pub const SPEC_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Spec";
/// Type URL of an OCI process spec (exec).
pub const PROCESS_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Process";
/// Type URL of OCI Linux resources (task update).
pub const RESOURCES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";
/// Type URL of runc shim options.
pub const RUNC_OPTIONS_TYPE_URL: &str = "containerd.runc.v1.Options";

/// Label prefix of Cubelet's own container labels.
pub const LABEL_PREFIX: &str = "io.cubelet.runtime/";
/// The label containerd's CRI plugin puts on its containers (`sandbox` or
/// `container`). The cAdvisor inside kubelet attributes network stats to a
/// pod only from a container labelled `sandbox` (its containerd handler's
/// `needNet`), so Cubelet writes it too; CRI clients never see it.
pub const KIND_LABEL: &str = "io.cri-containerd.kind";
const LABEL_NAME: &str = "io.cubelet.runtime/name";
const LABEL_LOG: &str = "io.cubelet.runtime/log-path";
const LABEL_HANDLER: &str = "io.cubelet.runtime/handler";
const LABEL_STOP_SIGNAL: &str = "io.cubelet.runtime/stop-signal";
const LABEL_STDIN: &str = "io.cubelet.runtime/stdin";
const LABEL_TTY: &str = "io.cubelet.runtime/tty";
const LABEL_STDIN_ONCE: &str = "io.cubelet.runtime/stdin-once";
const LABEL_STARTED: &str = "io.cubelet.runtime/started-at";
/// `<exit status> <exited at, unix ns>` of a retired task.
const LABEL_EXIT: &str = "io.cubelet.runtime/exit";

/// A runtime handler (RuntimeClass) backed by a containerd runtime.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandlerConfig {
    /// Containerd runtime type, e.g. `io.containerd.runc.v2`.
    pub runtime_type: String,
    /// OCI runtime binary (runc options `BinaryName`); `None` = the shim's default.
    pub binary: Option<PathBuf>,
    /// OCI runtime state root (runc options `Root`); `None` = the shim's default.
    pub root: Option<PathBuf>,
}

impl Default for HandlerConfig {
    fn default() -> Self {
        Self {
            runtime_type: "io.containerd.runc.v2".to_owned(),
            binary: None,
            root: None,
        }
    }
}

/// Configuration of the container runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// Volatile state (FIFOs under `io/`, temporary rootfs mounts under `mnt/`).
    pub state_dir: PathBuf,
    /// Handlers by name.
    pub handlers: BTreeMap<String, HandlerConfig>,
    /// Handler used when a request names none.
    pub default_handler: String,
    /// Raise `oom_score_adj` requests below the agent's own to it.
    pub restrict_oom_score_adj: bool,
    /// Snapshotter for container rootfs.
    pub snapshotter: String,
    /// Who manages container cgroups: how `linux.cgroupsPath` is written
    /// and whether runc's shim options ask for systemd
    /// (`SystemdCgroup`); see [`crate::cgroup`].
    pub cgroup_driver: CgroupDriver,
    /// Make a pod container's task (`runc create`) at its create, so that
    /// its start only starts it (`runtime.task_at_create`); see
    /// [`ContainerRuntime::create`].
    pub task_at_create: bool,
    /// The most bytes of log entries a second one container may write
    /// (`runtime.log_rate_limit`); `None` leaves logs unlimited. See
    /// [`crate::io::logs::LogSink::with_rate_limit`].
    pub log_rate_limit: Option<u64>,
}

impl RuntimeConfig {
    /// A config with one `runc` handler and the defaults of docs/DESIGN.md.
    pub fn new(state_dir: PathBuf) -> Self {
        Self {
            state_dir,
            handlers: BTreeMap::from([("runc".to_owned(), HandlerConfig::default())]),
            default_handler: "runc".to_owned(),
            restrict_oom_score_adj: true,
            snapshotter: "overlayfs".to_owned(),
            cgroup_driver: CgroupDriver::Cgroupfs,
            task_at_create: true,
            log_rate_limit: None,
        }
    }

    /// Resolves a handler name (empty = the default) to its name and
    /// config; an unknown one is `InvalidArgument` on `runtime_handler`,
    /// listing the configured ones.
    pub fn handler(&self, name: &str) -> Result<(&str, &HandlerConfig), RuntimeError> {
        let name = if name.is_empty() {
            self.default_handler.as_str()
        } else {
            name
        };
        self.handlers
            .get_key_value(name)
            .map(|(k, v)| (k.as_str(), v))
            .ok_or_else(|| {
                // Sorted: the map is ordered.
                let known: Vec<&str> = self.handlers.keys().map(String::as_str).collect();
                RuntimeError::InvalidArgument {
                    field: "runtime_handler".to_owned(),
                    reason: format!(
                        "unknown runtime handler {name:?} (configured: {})",
                        known.join(", ")
                    ),
                }
            })
    }
}

/// State of a container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ContainerState {
    /// Created, not started.
    Created,
    /// Running.
    Running,
    /// Exited.
    Exited,
    /// Containerd reports something else (paused, unknown).
    Unknown,
}

/// How a container's task exited, as [`ContainerRuntime::stop`] saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskExit {
    /// Exit code.
    pub code: i32,
    /// When it exited, if known.
    pub at: Option<SystemTime>,
}

/// What [`ContainerRuntime::status`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerStatus {
    /// Container id.
    pub id: String,
    /// State.
    pub state: ContainerState,
    /// Host pid of the init process (0 when none).
    pub pid: u32,
    /// Exit code, once exited.
    pub exit_code: Option<i32>,
    /// When the container record was created.
    pub created_at: Option<SystemTime>,
    /// When the task was started.
    pub started_at: Option<SystemTime>,
    /// When the task exited.
    pub finished_at: Option<SystemTime>,
    /// Image reference the container was created from.
    pub image_ref: String,
    /// CRI log path.
    pub log_path: Option<PathBuf>,
    /// Runtime handler name.
    pub runtime_handler: String,
    /// Labels given at creation (Cubelet's own labels removed).
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug)]
struct Live {
    sink: Arc<LogSink>,
    copiers: Vec<JoinHandle<()>>,
    /// The agent's writer on the stdin FIFO: keeps the container from
    /// reading end-of-file between attach sessions.
    stdin_keeper: Option<tokio::net::unix::pipe::Sender>,
}

/// Containers and tasks on containerd.
#[derive(Debug)]
pub struct ContainerRuntime {
    client: Containerd,
    config: RuntimeConfig,
    cgroups: Arc<CgroupSupport>,
    live: Arc<Mutex<HashMap<String, Live>>>,
    /// Tasks being retired in the background, by container id.
    retiring: Arc<Mutex<HashMap<String, Retiring>>>,
    /// Containers whose task a retirement deleted. A CRI container is never
    /// started twice, so they have no task for good and nothing asks
    /// containerd for one again; forgotten on removal, and not known after
    /// a restart (containerd is asked then).
    retired: Arc<Mutex<HashSet<String>>>,
    /// Writable-layer usage per container, refreshed in the background.
    usage: crate::stats::SnapshotUsageCache,
    /// The lease new rootfs snapshots are prepared under (id, expiry),
    /// shared by every create until it nears its expiry.
    create_lease: tokio::sync::Mutex<Option<(String, SystemTime)>>,
    /// Containers whose rootfs snapshot this process prepared under a
    /// create lease, with that lease's expiry: until then containerd's GC
    /// cannot collect the snapshot, whatever else references it.
    leased: Arc<Mutex<HashMap<String, SystemTime>>>,
    /// Containers whose rootfs is mounted for a user lookup right now
    /// (under [`USER_LOOKUP_DIR`]); the GC unmounts every other entry there.
    user_lookups: Arc<Mutex<HashSet<String>>>,
    /// Containers this process created and has not started, as it sent
    /// them to containerd: their start reads its labels (stdin, tty, log
    /// path), snapshot and spec from here instead of asking containerd
    /// again. Taken by the start, dropped by the deletion; after a restart
    /// containerd is asked.
    created: Arc<Mutex<HashMap<String, Container>>>,
    /// Containers whose task was made at their create and not started yet,
    /// with its init pid (see [`ContainerRuntime::start`]).
    prepared: Arc<Mutex<HashMap<String, u32>>>,
    /// Init pids of tasks that were made and not started, by container:
    /// their exits (a task made ahead and deleted unstarted is killed) are
    /// none of the container's ([`ContainerRuntime::unstarted_exit`]).
    /// Dropped on removal.
    unstarted: Arc<Mutex<HashMap<String, Vec<u32>>>>,
}

/// A task being retired: its exit (status, time), and a receiver that turns
/// true once the retirement is over.
#[derive(Debug, Clone)]
struct Retiring {
    exit: (u32, Option<SystemTime>),
    done: tokio::sync::watch::Receiver<bool>,
}

/// The fields of runc's shim options (`containerd.runc.v1.Options`,
/// containerd's `api/types/runc/options/oci.proto`) Cubelet sets.
#[derive(Clone, PartialEq, prost::Message)]
struct RuncOptions {
    #[prost(string, tag = "6")]
    binary_name: String,
    #[prost(string, tag = "7")]
    root: String,
    /// `SystemdCgroup`: runc's systemd cgroup manager, which reads
    /// `cgroupsPath` as `slice:prefix:name`.
    #[prost(bool, tag = "9")]
    systemd_cgroup: bool,
}

fn ts_to_system(ts: Option<&prost_types::Timestamp>) -> Option<SystemTime> {
    let ts = ts?;
    if ts.seconds <= 0 {
        return None;
    }
    Some(
        UNIX_EPOCH
            + Duration::new(
                u64::try_from(ts.seconds).ok()?,
                u32::try_from(ts.nanos).unwrap_or(0),
            ),
    )
}

fn json_any<T: Serialize>(type_url: &str, what: &'static str, v: &T) -> Result<Any, RuntimeError> {
    let value = serde_json::to_vec(v).map_err(|source| RuntimeError::Json { what, source })?;
    Ok(Any {
        type_url: type_url.to_owned(),
        value,
    })
}

impl ContainerRuntime {
    /// A runtime over `client` with `config`, fitting container resources
    /// to this host's cgroups (detected; hugetlb limits without the
    /// controller tolerated).
    pub fn new(client: Containerd, config: RuntimeConfig) -> Self {
        let cgroups = CgroupSupport::detect(true).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cgroup controllers not detected; container resources go to the runtime as requested");
            CgroupSupport::permissive()
        });
        Self::with_cgroups(client, config, Arc::new(cgroups))
    }

    /// A runtime fitting container resources to `cgroups`.
    pub fn with_cgroups(
        client: Containerd,
        config: RuntimeConfig,
        cgroups: Arc<CgroupSupport>,
    ) -> Self {
        Self {
            client,
            config,
            cgroups,
            live: Arc::default(),
            retiring: Arc::default(),
            retired: Arc::default(),
            create_lease: tokio::sync::Mutex::default(),
            leased: Arc::default(),
            usage: crate::stats::SnapshotUsageCache::default(),
            user_lookups: Arc::default(),
            created: Arc::default(),
            prepared: Arc::default(),
            unstarted: Arc::default(),
        }
    }

    /// The cache of writable-layer usage (see [`crate::stats`]).
    pub(crate) fn usage_cache(&self) -> &crate::stats::SnapshotUsageCache {
        &self.usage
    }

    /// What the host's cgroups can enforce.
    pub fn cgroups(&self) -> &CgroupSupport {
        &self.cgroups
    }

    /// The containerd connection.
    pub fn client(&self) -> &Containerd {
        &self.client
    }

    /// The configuration.
    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    /// Resolves a handler name (empty = the default) to its name and config
    /// ([`RuntimeConfig::handler`]).
    pub fn handler(&self, name: &str) -> Result<(&str, &HandlerConfig), RuntimeError> {
        self.config.handler(name)
    }

    /// The shim options of a container on `handler`: runc's binary and
    /// root when configured, and `SystemdCgroup` under the systemd driver.
    /// Only runc's shims (`io.containerd.runc.*`) take runc's options; a
    /// handler of another runtime type with neither binary nor root gets
    /// none.
    fn runtime_options(handler: &HandlerConfig, driver: CgroupDriver) -> Option<Any> {
        let systemd_cgroup = driver == CgroupDriver::Systemd
            && handler.runtime_type.starts_with("io.containerd.runc.");
        if handler.binary.is_none() && handler.root.is_none() && !systemd_cgroup {
            return None;
        }
        let opts = RuncOptions {
            systemd_cgroup,
            binary_name: handler
                .binary
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            root: handler
                .root
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        };
        Some(Any {
            type_url: RUNC_OPTIONS_TYPE_URL.to_owned(),
            value: prost::Message::encode_to_vec(&opts),
        })
    }

    fn io_dir(&self, id: &str) -> PathBuf {
        self.config.state_dir.join("io").join(id)
    }

    /// Where recursive read-only mounts are staged, one directory per
    /// container (see [`crate::staged`]).
    pub(crate) fn staged_root(&self) -> PathBuf {
        self.config.state_dir.join(crate::staged::DIR)
    }

    fn lock_live(&self) -> std::sync::MutexGuard<'_, HashMap<String, Live>> {
        // A poisoned map only means a panic elsewhere while holding it; the
        // map itself is still consistent (every update is one insert/remove).
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Container `id` as this process created it, if it has not been
    /// started (see `created`), else as containerd holds it.
    async fn created_container(&self, id: &str) -> Result<Container, RuntimeError> {
        let created = lock_map(&self.created).remove(id);
        match created {
            Some(c) => Ok(c),
            None => self.get_container(id).await,
        }
    }

    async fn get_container(&self, id: &str) -> Result<Container, RuntimeError> {
        let resp = self
            .client
            .containers()
            .get(
                self.client
                    .request(GetContainerRequest { id: id.to_owned() }),
            )
            .await
            .map_err(cd_container("containers.get", id))?;
        resp.into_inner()
            .container
            .ok_or_else(|| RuntimeError::NotFound {
                kind: "container",
                id: id.to_owned(),
            })
    }

    /// The task of container `id` as containerd has it; `None` when there
    /// is none (or this process retired it).
    pub(crate) async fn get_task(
        &self,
        id: &str,
    ) -> Result<Option<containerd_client::types::v1::Process>, RuntimeError> {
        if self.is_retired(id) {
            return Ok(None);
        }
        match self
            .client
            .tasks()
            .get(self.client.request(GetRequest {
                container_id: id.to_owned(),
                exec_id: String::new(),
            }))
            .await
        {
            Ok(r) => Ok(r.into_inner().process),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(RuntimeError::containerd("tasks.get", s)),
        }
    }
}

/// Locks a map whose every update is one insert or remove (so a poisoned
/// lock still holds it intact).
fn lock_map<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn unix_nanos(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handler_resolves_once_to_its_name_and_config() {
        let mut config = RuntimeConfig::new("/run/x".into());
        config
            .handlers
            .insert("kata".to_owned(), HandlerConfig::default());
        assert_eq!(config.handler("").unwrap().0, "runc");
        assert_eq!(config.handler("kata").unwrap().0, "kata");
        match config.handler("gvisor").unwrap_err() {
            RuntimeError::InvalidArgument { field, reason } => {
                assert_eq!(field, "runtime_handler");
                assert!(
                    reason.contains("\"gvisor\" (configured: kata, runc)"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn runc_options_encode_root_and_binary() {
        let any = ContainerRuntime::runtime_options(
            &HandlerConfig {
                runtime_type: "io.containerd.runc.v2".into(),
                binary: Some("/usr/sbin/runc".into()),
                root: Some("/run/x".into()),
            },
            CgroupDriver::Cgroupfs,
        )
        .unwrap();
        assert_eq!(any.type_url, RUNC_OPTIONS_TYPE_URL);
        // field 6 (binary_name), length-delimited: tag byte 0x32; field 7: 0x3a.
        assert_eq!(any.value[0], 0x32);
        let decoded: RuncOptions = prost::Message::decode(any.value.as_slice()).unwrap();
        assert_eq!(decoded.root, "/run/x");
        assert!(!decoded.systemd_cgroup);
        assert!(ContainerRuntime::runtime_options(
            &HandlerConfig::default(),
            CgroupDriver::Cgroupfs
        )
        .is_none());
    }

    #[test]
    fn the_systemd_driver_sets_systemd_cgroup_in_runcs_options() {
        let any =
            ContainerRuntime::runtime_options(&HandlerConfig::default(), CgroupDriver::Systemd)
                .unwrap();
        assert_eq!(any.type_url, RUNC_OPTIONS_TYPE_URL);
        // Field 9, varint: tag byte 0x48, then 1 (containerd's
        // `SystemdCgroup = true`, and nothing else set).
        assert_eq!(any.value, [0x48, 0x01]);
        let with_root = ContainerRuntime::runtime_options(
            &HandlerConfig {
                root: Some("/run/r".into()),
                ..HandlerConfig::default()
            },
            CgroupDriver::Systemd,
        )
        .unwrap();
        let decoded: RuncOptions = prost::Message::decode(with_root.value.as_slice()).unwrap();
        assert!(decoded.systemd_cgroup);
        assert_eq!(decoded.root, "/run/r");
        // Another runtime's shim does not read runc's options.
        let kata = HandlerConfig {
            runtime_type: "io.containerd.kata.v2".into(),
            ..HandlerConfig::default()
        };
        assert!(ContainerRuntime::runtime_options(&kata, CgroupDriver::Systemd).is_none());
    }

    #[test]
    fn timestamps_convert() {
        let ts = prost_types::Timestamp {
            seconds: 10,
            nanos: 5,
        };
        assert_eq!(
            ts_to_system(Some(&ts)),
            Some(UNIX_EPOCH + Duration::new(10, 5))
        );
        assert_eq!(ts_to_system(Some(&prost_types::Timestamp::default())), None);
    }
}
