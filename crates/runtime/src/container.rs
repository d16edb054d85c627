//! Containers and their tasks on containerd: create, start, stop, remove,
//! status, exec, resource updates and log reopening.
//!
//! A container is a containerd container record (OCI spec, runtime handler,
//! rootfs snapshot keyed by the container id) plus, once started, a task
//! whose stdout/stderr FIFOs are copied into the CRI log file. Everything is
//! derived from the container id, so every teardown is idempotent and works
//! after an agent restart ([`ContainerRuntime::reattach`] resumes logging).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::services::v1::container::Runtime as ContainerRuntimeInfo;
use containerd_client::services::v1::snapshots::{
    MountsRequest, PrepareSnapshotRequest, RemoveSnapshotRequest,
};
use containerd_client::services::v1::{
    Container, CreateContainerRequest, CreateTaskRequest, DeleteContainerRequest,
    DeleteProcessRequest, DeleteTaskRequest, ExecProcessRequest, GetContainerRequest, GetRequest,
    KillRequest, StartRequest, UpdateContainerRequest, UpdateTaskRequest, WaitRequest,
};
use containerd_client::services::v1::{
    CreateRequest as LeaseCreateRequest, DeleteRequest as LeaseDeleteRequest,
};
use containerd_client::types::v1::Status as TaskStatus;
use nix::sys::signal::Signal;
use prost_types::Any;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;
use tokio::task::JoinHandle;

use crate::cgroups::CgroupSupport;
use crate::client::Containerd;
use crate::error::{cd, cd_container, cd_process, RuntimeError};
use crate::io::{self as fifo_io, Fifos};
use crate::logs::{copy_stream, LogSink, Stream};
use crate::spec::{
    build_oci_spec, linux_resources, resolve_user, user_needs_lookup, ContainerSpec, Resources,
    SpecOptions, UserRequest,
};

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

/// Most output `exec_sync` keeps per stream (as containerd's CRI plugin).
pub const MAX_EXEC_OUTPUT: usize = 16 * 1024 * 1024;

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
}

impl RuntimeConfig {
    /// A config with one `runc` handler and the defaults of DESIGN.md.
    pub fn new(state_dir: PathBuf) -> Self {
        Self {
            state_dir,
            handlers: BTreeMap::from([("runc".to_owned(), HandlerConfig::default())]),
            default_handler: "runc".to_owned(),
            restrict_oom_score_adj: true,
            snapshotter: "overlayfs".to_owned(),
        }
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

/// Output of [`ContainerRuntime::exec_sync`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Standard output (capped at [`MAX_EXEC_OUTPUT`]).
    pub stdout: Vec<u8>,
    /// Standard error (capped at [`MAX_EXEC_OUTPUT`]).
    pub stderr: Vec<u8>,
    /// Exit code.
    pub exit_code: i32,
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
    live: Mutex<HashMap<String, Live>>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RuncOptions {
    #[prost(string, tag = "6")]
    binary_name: String,
    #[prost(string, tag = "7")]
    root: String,
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

fn ignore_not_found(r: Result<(), RuntimeError>) -> Result<(), RuntimeError> {
    match r {
        Err(e) if e.is_not_found() => Ok(()),
        other => other,
    }
}

fn parse_signal(name: &str) -> Signal {
    let upper = name.trim().to_ascii_uppercase();
    if upper.is_empty() {
        return Signal::SIGTERM;
    }
    if let Ok(n) = upper.parse::<i32>() {
        return Signal::try_from(n).unwrap_or(Signal::SIGTERM);
    }
    let full = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    full.parse::<Signal>().unwrap_or(Signal::SIGTERM)
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
            live: Mutex::new(HashMap::new()),
        }
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

    /// Resolves a handler name (empty = the default) to its name and config.
    pub fn handler(&self, name: &str) -> Result<(&str, &HandlerConfig), RuntimeError> {
        let name = if name.is_empty() {
            self.config.default_handler.as_str()
        } else {
            name
        };
        self.config
            .handlers
            .get_key_value(name)
            .map(|(k, v)| (k.as_str(), v))
            .ok_or_else(|| RuntimeError::InvalidArgument {
                field: "runtime_handler".to_owned(),
                reason: format!("no runtime handler {name:?} is configured"),
            })
    }

    fn runtime_options(handler: &HandlerConfig) -> Option<Any> {
        if handler.binary.is_none() && handler.root.is_none() {
            return None;
        }
        let opts = RuncOptions {
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

    fn lock_live(&self) -> std::sync::MutexGuard<'_, HashMap<String, Live>> {
        // A poisoned map only means a panic elsewhere while holding it; the
        // map itself is still consistent (every update is one insert/remove).
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn agent_oom_floor(&self) -> Result<Option<i32>, RuntimeError> {
        if !self.config.restrict_oom_score_adj {
            return Ok(None);
        }
        let path = "/proc/self/oom_score_adj";
        let text = std::fs::read_to_string(path).map_err(|source| RuntimeError::Io {
            op: "read",
            path: path.to_owned(),
            source,
        })?;
        Ok(text.trim().parse::<i32>().ok())
    }

    /// Creates container `id` (not started): rootfs snapshot from the image's
    /// chain id, OCI spec, containerd record. Removes what it made on failure.
    pub async fn create(&self, id: &str, spec: &ContainerSpec) -> Result<(), RuntimeError> {
        // Decided before anything is built: a limit the node cannot enforce
        // is left out (or refused) here, never handed to runc.
        let fitted;
        let spec = match self.cgroups.fit(&spec.resources)? {
            Some(resources) => {
                fitted = ContainerSpec {
                    resources,
                    ..spec.clone()
                };
                &fitted
            }
            None => spec,
        };
        let (handler_name, handler) = self.handler(&spec.runtime_handler)?;
        let handler_name = handler_name.to_owned();
        let runtime_options = Self::runtime_options(handler);
        let runtime_type = handler.runtime_type.clone();
        if spec.image.chain_id.is_empty() {
            return Err(RuntimeError::InvalidArgument {
                field: "image".to_owned(),
                reason: format!(
                    "image {:?} has no unpacked rootfs (empty chain id)",
                    spec.image_ref
                ),
            });
        }
        // The new snapshot is referenced by nothing until the container
        // record exists: a lease keeps containerd's GC off it meanwhile.
        let lease = self.create_lease(id).await?;
        let mut prepare = self.client.request(PrepareSnapshotRequest {
            snapshotter: self.config.snapshotter.clone(),
            key: id.to_owned(),
            parent: spec.image.chain_id.clone(),
            labels: HashMap::from([(LABEL_NAME.to_owned(), spec.name.clone())]),
        });
        if let Ok(v) = lease.parse() {
            prepare.metadata_mut().insert("containerd-lease", v);
        }
        let snap = self.client.snapshots().prepare(prepare).await.map_err(|s| {
            if s.code() == tonic::Code::AlreadyExists {
                RuntimeError::AlreadyExists {
                    kind: "container",
                    id: id.to_owned(),
                }
            } else {
                RuntimeError::containerd("snapshots.prepare", s)
            }
        });
        let snap = match snap {
            Ok(s) => s,
            Err(e) => {
                self.delete_lease(&lease).await;
                return Err(e);
            }
        };
        let res = self
            .create_record(
                id,
                spec,
                &handler_name,
                runtime_type,
                runtime_options,
                &snap.into_inner().mounts,
            )
            .await;
        self.delete_lease(&lease).await;
        if let Err(e) = res {
            let _ = self.remove_snapshot(id).await;
            return Err(e);
        }
        Ok(())
    }

    async fn create_lease(&self, id: &str) -> Result<String, RuntimeError> {
        let lease_id = format!("cubelet-create-{id}-{}", unix_nanos(SystemTime::now()));
        let expire = crate::logs::rfc3339_nano(SystemTime::now() + Duration::from_secs(3600));
        self.client
            .leases()
            .create(self.client.request(LeaseCreateRequest {
                id: lease_id.clone(),
                labels: HashMap::from([("containerd.io/gc.expire".to_owned(), expire)]),
            }))
            .await
            .map_err(cd("leases.create"))?;
        Ok(lease_id)
    }

    async fn delete_lease(&self, lease: &str) {
        let req = self.client.request(LeaseDeleteRequest {
            id: lease.to_owned(),
            sync: false,
        });
        if let Err(e) = self.client.leases().delete(req).await {
            // It expires by itself (gc.expire); nothing leaks for long.
            tracing::warn!(lease, error = %e, "deleting create lease failed");
        }
    }

    async fn create_record(
        &self,
        id: &str,
        spec: &ContainerSpec,
        handler_name: &str,
        runtime_type: String,
        runtime_options: Option<Any>,
        mounts: &[containerd_client::types::Mount],
    ) -> Result<(), RuntimeError> {
        let user_req = spec.effective_user()?;
        let user = if user_needs_lookup(&user_req) {
            let (passwd, group) = self.read_user_files(id, mounts).await?;
            Some(resolve_user(&user_req, &passwd, &group)?)
        } else if let UserRequest::Id {
            uid,
            gid: Some(gid),
        } = user_req
        {
            Some(crate::spec::ResolvedUser {
                uid,
                gid,
                additional_gids: Vec::new(),
            })
        } else {
            None
        };
        let opts = SpecOptions {
            min_oom_score_adj: self.agent_oom_floor()?,
            user,
        };
        let oci = build_oci_spec(id, spec, &opts)?;
        let mut labels: HashMap<String, String> = spec
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.insert(LABEL_NAME.to_owned(), spec.name.clone());
        labels.insert(LABEL_HANDLER.to_owned(), handler_name.to_owned());
        labels.insert(KIND_LABEL.to_owned(), spec.kind.as_str().to_owned());
        if let Some(p) = &spec.log_path {
            labels.insert(LABEL_LOG.to_owned(), p.display().to_string());
        }
        if !spec.image.config.stop_signal.is_empty() {
            labels.insert(
                LABEL_STOP_SIGNAL.to_owned(),
                spec.image.config.stop_signal.clone(),
            );
        }
        if spec.stdin {
            labels.insert(LABEL_STDIN.to_owned(), "true".to_owned());
        }
        if spec.tty {
            labels.insert(LABEL_TTY.to_owned(), "true".to_owned());
        }
        if spec.stdin && spec.stdin_once {
            labels.insert(LABEL_STDIN_ONCE.to_owned(), "true".to_owned());
        }
        let container = Container {
            id: id.to_owned(),
            labels,
            image: spec.image_ref.clone(),
            runtime: Some(ContainerRuntimeInfo {
                name: runtime_type,
                options: runtime_options,
            }),
            spec: Some(json_any(SPEC_TYPE_URL, "oci spec", &oci)?),
            snapshotter: self.config.snapshotter.clone(),
            snapshot_key: id.to_owned(),
            ..Default::default()
        };
        self.client
            .containers()
            .create(self.client.request(CreateContainerRequest {
                container: Some(container),
            }))
            .await
            .map_err(cd_container("containers.create", id))?;
        Ok(())
    }

    /// Mounts the prepared rootfs read-only for a moment to read
    /// `/etc/passwd` and `/etc/group`.
    async fn read_user_files(
        &self,
        id: &str,
        mounts: &[containerd_client::types::Mount],
    ) -> Result<(String, String), RuntimeError> {
        let target = self.config.state_dir.join("mnt").join(id);
        let mounts = mounts.to_vec();
        tokio::task::spawn_blocking(move || read_user_files_blocking(&target, &mounts))
            .await
            .map_err(|e| {
                RuntimeError::FailedPrecondition(format!("user lookup task failed: {e}"))
            })?
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

    /// Ends an attach session's input: for a container created with
    /// `stdin_once`, closes its stdin so the process reads end-of-file, as
    /// containerd's CRI does: the agent drops its own writer on the stdin
    /// FIFO, then asks the shim to close its writer (`Tasks.CloseIO`). Other
    /// containers keep their stdin open for the next attach.
    pub async fn attach_stdin_closed(&self, id: &str) -> Result<(), RuntimeError> {
        let container = self.get_container(id).await?;
        if container
            .labels
            .get(LABEL_STDIN_ONCE)
            .is_none_or(|v| v != "true")
        {
            return Ok(());
        }
        let keeper = self
            .lock_live()
            .get_mut(id)
            .and_then(|l| l.stdin_keeper.take());
        drop(keeper);
        self.client
            .tasks()
            .close_io(
                self.client
                    .request(containerd_client::services::v1::CloseIoRequest {
                        container_id: id.to_owned(),
                        exec_id: String::new(),
                        stdin: true,
                    }),
            )
            .await
            .map_err(|s| RuntimeError::containerd("tasks.close_io", s))?;
        Ok(())
    }

    /// Starts container `id`: FIFOs, log copier, task create and start.
    /// Returns the host pid of the container's init process.
    pub async fn start(&self, id: &str) -> Result<u32, RuntimeError> {
        let container = self.get_container(id).await?;
        let stdin = container
            .labels
            .get(LABEL_STDIN)
            .is_some_and(|v| v == "true");
        let tty = container.labels.get(LABEL_TTY).is_some_and(|v| v == "true");
        let log_path = container.labels.get(LABEL_LOG).map(PathBuf::from);
        let mounts = self
            .client
            .snapshots()
            .mounts(self.client.request(MountsRequest {
                snapshotter: container.snapshotter.clone(),
                key: container.snapshot_key.clone(),
            }))
            .await
            .map_err(cd("snapshots.mounts"))?
            .into_inner()
            .mounts;
        let fifos = Fifos::create(self.io_dir(id), stdin, tty)?;
        let sink = Arc::new(LogSink::open(log_path).await?);
        let keepers = fifos.keep_open()?;
        let (stdin_path, stdout_path, stderr_path) = fifos.wire();
        let options = container.runtime.as_ref().and_then(|r| r.options.clone());
        let created = self
            .client
            .tasks()
            .create(self.client.request(CreateTaskRequest {
                container_id: id.to_owned(),
                rootfs: mounts,
                stdin: stdin_path,
                stdout: stdout_path,
                stderr: stderr_path,
                terminal: tty,
                options,
                ..Default::default()
            }))
            .await
            .map_err(cd("tasks.create"));
        let created = match created {
            Ok(c) => c.into_inner(),
            Err(e) => {
                let _ = fifo_io::remove_dir(&fifos.dir);
                return Err(e);
            }
        };
        let readers = fifos.open_readers();
        let stdin_keeper = keepers.stdin;
        let readers = match readers {
            Ok(r) => r,
            Err(e) => {
                let _ = self.delete_task(id).await;
                return Err(e);
            }
        };
        let copiers = spawn_copiers(id, readers, &sink);
        self.lock_live().insert(
            id.to_owned(),
            Live {
                sink,
                copiers,
                stdin_keeper,
            },
        );
        // Taken before the start call so that it never follows the exit.
        let started_at = SystemTime::now();
        if let Err(e) = self
            .client
            .tasks()
            .start(self.client.request(StartRequest {
                container_id: id.to_owned(),
                exec_id: String::new(),
            }))
            .await
            .map_err(cd("tasks.start"))
        {
            let _ = self.delete_task(id).await;
            return Err(e);
        }
        // Record the start time with the container so status survives restarts.
        let mut labels = HashMap::new();
        labels.insert(LABEL_STARTED.to_owned(), unix_nanos(started_at).to_string());
        let update = Container {
            id: id.to_owned(),
            labels,
            ..Default::default()
        };
        self.client
            .containers()
            .update(self.client.request(UpdateContainerRequest {
                container: Some(update),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec![format!("labels.{LABEL_STARTED}")],
                }),
            }))
            .await
            .map_err(cd("containers.update"))?;
        Ok(created.pid)
    }

    /// Resumes log copying for a running container after an agent restart.
    /// Does nothing when the container has no running task or is already
    /// attached.
    pub async fn reattach(&self, id: &str) -> Result<(), RuntimeError> {
        if self.lock_live().contains_key(id) {
            return Ok(());
        }
        let container = self.get_container(id).await?;
        let Some(process) = self.get_task(id).await? else {
            return Ok(());
        };
        if process.status != TaskStatus::Running as i32 {
            return Ok(());
        }
        let tty = container.labels.get(LABEL_TTY).is_some_and(|v| v == "true");
        let fifos = Fifos::paths(self.io_dir(id), false, tty);
        let sink =
            Arc::new(LogSink::open(container.labels.get(LABEL_LOG).map(PathBuf::from)).await?);
        let readers = fifos.open_readers()?;
        let copiers = spawn_copiers(id, readers, &sink);
        self.lock_live().insert(
            id.to_owned(),
            Live {
                sink,
                copiers,
                stdin_keeper: None,
            },
        );
        Ok(())
    }

    /// Stops copying the container's output without touching its task (at
    /// agent shutdown; [`ContainerRuntime::reattach`] resumes it). Output
    /// written meanwhile waits in the FIFO.
    pub async fn detach(&self, id: &str) {
        let live = self.lock_live().remove(id);
        if let Some(live) = live {
            for h in live.copiers {
                h.abort();
                let _ = h.await;
            }
        }
    }

    /// The log sink of a container whose output this agent copies.
    pub(crate) fn log_sink(&self, id: &str) -> Option<Arc<LogSink>> {
        self.lock_live().get(id).map(|l| l.sink.clone())
    }

    /// Closes and reopens the container's log file (after kubelet rotated it).
    pub async fn reopen_log(&self, id: &str) -> Result<(), RuntimeError> {
        let sink = self.lock_live().get(id).map(|l| l.sink.clone());
        match sink {
            Some(s) => s.reopen().await,
            None => Err(RuntimeError::FailedPrecondition(format!(
                "container {id} is not running, its log cannot be reopened"
            ))),
        }
    }

    async fn get_task(
        &self,
        id: &str,
    ) -> Result<Option<containerd_client::types::v1::Process>, RuntimeError> {
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

    async fn kill(&self, id: &str, exec_id: &str, signal: Signal) -> Result<(), RuntimeError> {
        match self
            .client
            .tasks()
            .kill(self.client.request(KillRequest {
                container_id: id.to_owned(),
                exec_id: exec_id.to_owned(),
                signal: signal as u32,
                all: false,
            }))
            .await
        {
            Ok(_) => Ok(()),
            // Already gone, or already exited: nothing to signal.
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::NotFound | tonic::Code::FailedPrecondition
                ) =>
            {
                Ok(())
            }
            Err(s) => Err(RuntimeError::containerd("tasks.kill", s)),
        }
    }

    async fn wait(
        &self,
        id: &str,
        exec_id: &str,
    ) -> Result<(u32, Option<SystemTime>), RuntimeError> {
        let r = self
            .client
            .tasks()
            .wait(self.client.request(WaitRequest {
                container_id: id.to_owned(),
                exec_id: exec_id.to_owned(),
            }))
            .await
            .map_err(cd("tasks.wait"))?
            .into_inner();
        Ok((r.exit_status, ts_to_system(r.exited_at.as_ref())))
    }

    /// Stops the container: its stop signal (image `StopSignal`, else
    /// SIGTERM), up to `timeout` for it to exit, then SIGKILL. Idempotent:
    /// no task or an exited task is success.
    pub async fn stop(&self, id: &str, timeout: Duration) -> Result<(), RuntimeError> {
        let Some(process) = self.get_task(id).await? else {
            return Ok(());
        };
        if process.status == TaskStatus::Stopped as i32 {
            return Ok(());
        }
        if !timeout.is_zero() {
            let signal = match self.get_container(id).await {
                Ok(c) => c
                    .labels
                    .get(LABEL_STOP_SIGNAL)
                    .map_or(Signal::SIGTERM, |s| parse_signal(s)),
                Err(e) if e.is_not_found() => return Ok(()),
                Err(e) => return Err(e),
            };
            self.kill(id, "", signal).await?;
            // Wait on an exited (undeleted) task returns at once, so an exit
            // between the kill and the wait is not missed.
            match tokio::time::timeout(timeout, self.wait(id, "")).await {
                Ok(r) => return ignore_not_found(r.map(|_| ())),
                Err(_) => tracing::info!(container = id, ?timeout, "stop timeout passed, killing"),
            }
        }
        self.kill(id, "", Signal::SIGKILL).await?;
        ignore_not_found(self.wait(id, "").await.map(|_| ()))
    }

    /// Deletes the task (after killing it if it still runs) and stops log
    /// copying. Idempotent.
    pub async fn delete_task(&self, id: &str) -> Result<(), RuntimeError> {
        if let Some(p) = self.get_task(id).await? {
            if p.status != TaskStatus::Stopped as i32 && p.status != TaskStatus::Created as i32 {
                self.stop(id, Duration::ZERO).await?;
            }
            match self
                .client
                .tasks()
                .delete(self.client.request(DeleteTaskRequest {
                    container_id: id.to_owned(),
                }))
                .await
            {
                Ok(_) => {}
                Err(s) if s.code() == tonic::Code::NotFound => {}
                Err(s) => return Err(RuntimeError::containerd("tasks.delete", s)),
            }
        }
        let live = self.lock_live().remove(id);
        if let Some(live) = live {
            // The shim closed the FIFOs with the task; give the copiers a
            // moment to write what they still hold, then stop them.
            for mut h in live.copiers {
                if tokio::time::timeout(Duration::from_secs(2), &mut h)
                    .await
                    .is_err()
                {
                    h.abort();
                }
            }
        }
        Ok(())
    }

    /// Deletes the containerd container record (its task must be gone).
    /// Idempotent.
    pub async fn delete_container(&self, id: &str) -> Result<(), RuntimeError> {
        match self
            .client
            .containers()
            .delete(
                self.client
                    .request(DeleteContainerRequest { id: id.to_owned() }),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
            Err(s) => Err(RuntimeError::containerd("containers.delete", s)),
        }
    }

    /// Removes snapshot `id` of the agent's snapshotter. Idempotent.
    pub(crate) async fn remove_snapshot(&self, id: &str) -> Result<(), RuntimeError> {
        match self
            .client
            .snapshots()
            .remove(self.client.request(RemoveSnapshotRequest {
                snapshotter: self.config.snapshotter.clone(),
                key: id.to_owned(),
            }))
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
            Err(s) => Err(RuntimeError::containerd("snapshots.remove", s)),
        }
    }

    /// Removes everything of container `id`: task (killed if running),
    /// rootfs snapshot, container record, FIFOs. Idempotent.
    ///
    /// The snapshot goes before the record, as containerd's own client does
    /// (`WithSnapshotCleanup`): once the record is gone the snapshot is
    /// unreferenced, and if containerd's GC collects it first, the GC leaves
    /// the child link in the image's parent snapshot behind, which then
    /// refuses an explicit removal ("cannot remove snapshot with child").
    pub async fn remove(&self, id: &str) -> Result<(), RuntimeError> {
        self.delete_task(id).await?;
        self.remove_snapshot(id).await?;
        self.delete_container(id).await?;
        fifo_io::remove_dir(&self.io_dir(id))?;
        let mnt = self.config.state_dir.join("mnt").join(id);
        match std::fs::remove_dir(&mnt) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(RuntimeError::Io {
                op: "remove",
                path: mnt.display().to_string(),
                source,
            }),
        }
    }

    /// Reports the container's state, pid, exit code and times.
    pub async fn status(&self, id: &str) -> Result<ContainerStatus, RuntimeError> {
        let c = self.get_container(id).await?;
        let started_at = c
            .labels
            .get(LABEL_STARTED)
            .and_then(|v| v.parse::<u128>().ok())
            .map(|n| UNIX_EPOCH + Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX)));
        let task = self.get_task(id).await?;
        let (state, pid, exit_code, finished_at) = match &task {
            None if started_at.is_some() => (ContainerState::Exited, 0, None, None),
            None => (ContainerState::Created, 0, None, None),
            Some(p) => match TaskStatus::try_from(p.status).unwrap_or(TaskStatus::Unknown) {
                TaskStatus::Created => (ContainerState::Created, p.pid, None, None),
                TaskStatus::Running => (ContainerState::Running, p.pid, None, None),
                TaskStatus::Stopped => (
                    ContainerState::Exited,
                    p.pid,
                    Some(i32::try_from(p.exit_status).unwrap_or(i32::MAX)),
                    ts_to_system(p.exited_at.as_ref()),
                ),
                _ => (ContainerState::Unknown, p.pid, None, None),
            },
        };
        let labels = c
            .labels
            .iter()
            .filter(|(k, _)| !k.starts_with(LABEL_PREFIX) && k.as_str() != KIND_LABEL)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Ok(ContainerStatus {
            id: id.to_owned(),
            state,
            pid,
            exit_code,
            created_at: ts_to_system(c.created_at.as_ref()),
            started_at,
            finished_at,
            image_ref: c.image.clone(),
            log_path: c.labels.get(LABEL_LOG).map(PathBuf::from),
            runtime_handler: c.labels.get(LABEL_HANDLER).cloned().unwrap_or_default(),
            labels,
        })
    }

    /// Runs `cmd` in the running container and collects its output. On
    /// timeout the process is killed and [`RuntimeError::Timeout`] returned.
    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: &[String],
        timeout: Option<Duration>,
    ) -> Result<ExecOutput, RuntimeError> {
        if cmd.is_empty() {
            return Err(RuntimeError::InvalidArgument {
                field: "cmd".to_owned(),
                reason: "empty command".to_owned(),
            });
        }
        let container = self.get_container(id).await?;
        let any = container.spec.as_ref().ok_or_else(|| {
            RuntimeError::FailedPrecondition(format!("container {id} has no spec"))
        })?;
        let spec: oci_spec::runtime::Spec =
            serde_json::from_slice(&any.value).map_err(|source| RuntimeError::Json {
                what: "oci spec",
                source,
            })?;
        let mut process = spec.process().clone().ok_or_else(|| {
            RuntimeError::FailedPrecondition(format!("container {id} spec has no process"))
        })?;
        process.set_args(Some(cmd.to_vec()));
        process.set_terminal(Some(false));
        let exec_id = format!("exec-{}", unix_nanos(SystemTime::now()));
        let fifos = Fifos::create(self.io_dir(id).join(&exec_id), false, false)?;
        let result = self
            .exec_inner(id, &exec_id, &process, &fifos, timeout)
            .await;
        let _ = fifo_io::remove_dir(&fifos.dir);
        result
    }

    async fn exec_inner(
        &self,
        id: &str,
        exec_id: &str,
        process: &oci_spec::runtime::Process,
        fifos: &Fifos,
        timeout: Option<Duration>,
    ) -> Result<ExecOutput, RuntimeError> {
        let keepers = fifos.keep_open()?;
        let (_, stdout, stderr) = fifos.wire();
        self.client
            .tasks()
            .exec(self.client.request(ExecProcessRequest {
                container_id: id.to_owned(),
                stdin: String::new(),
                stdout,
                stderr,
                terminal: false,
                spec: Some(json_any(PROCESS_TYPE_URL, "process spec", process)?),
                exec_id: exec_id.to_owned(),
            }))
            .await
            .map_err(cd_process("tasks.exec", id))?;
        let res = self.exec_run(id, exec_id, fifos, keepers, timeout).await;
        let del = self
            .client
            .tasks()
            .delete_process(self.client.request(DeleteProcessRequest {
                container_id: id.to_owned(),
                exec_id: exec_id.to_owned(),
            }))
            .await;
        if let Err(s) = del {
            if s.code() != tonic::Code::NotFound {
                tracing::warn!(container = id, exec_id, error = %s, "deleting exec process failed");
            }
        }
        res
    }

    async fn exec_run(
        &self,
        id: &str,
        exec_id: &str,
        fifos: &Fifos,
        keepers: fifo_io::Keepers,
        timeout: Option<Duration>,
    ) -> Result<ExecOutput, RuntimeError> {
        self.client
            .tasks()
            .start(self.client.request(StartRequest {
                container_id: id.to_owned(),
                exec_id: exec_id.to_owned(),
            }))
            .await
            .map_err(cd("tasks.start"))?;
        // The shim opened its write ends when the process started.
        let readers = fifos.open_readers()?;
        drop(keepers);
        let out = tokio::spawn(read_capped(readers.stdout));
        let err = readers.stderr.map(|r| tokio::spawn(read_capped(r)));
        let waited = match timeout.filter(|t| !t.is_zero()) {
            Some(t) => match tokio::time::timeout(t, self.wait(id, exec_id)).await {
                Ok(r) => r,
                Err(_) => {
                    self.kill(id, exec_id, Signal::SIGKILL).await?;
                    let _ = self.wait(id, exec_id).await;
                    out.abort();
                    if let Some(e) = err {
                        e.abort();
                    }
                    return Err(RuntimeError::Timeout {
                        op: "exec",
                        id: id.to_owned(),
                        timeout: t,
                    });
                }
            },
            None => self.wait(id, exec_id).await,
        };
        let (code, _) = waited?;
        let stdout = collect(out).await;
        let stderr = match err {
            Some(e) => collect(e).await,
            None => Vec::new(),
        };
        Ok(ExecOutput {
            stdout,
            stderr,
            exit_code: i32::try_from(code).unwrap_or(i32::MAX),
        })
    }

    /// Updates the running task's cgroup limits.
    pub async fn update_resources(
        &self,
        id: &str,
        resources: &Resources,
    ) -> Result<(), RuntimeError> {
        let fitted = self.cgroups.fit(resources)?;
        let update = linux_resources(fitted.as_ref().unwrap_or(resources))?;
        // Record the new limits in the container's spec first, so a later
        // restart of the task (or an inspect) sees them: merged over the
        // limits it had, since an update carries only what changes (kubelet's
        // CPU manager sends just cpuset_cpus), and the device rules kept.
        let container = self.get_container(id).await?;
        let any = container.spec.as_ref().ok_or_else(|| {
            RuntimeError::FailedPrecondition(format!("container {id} has no spec"))
        })?;
        let mut spec: oci_spec::runtime::Spec =
            serde_json::from_slice(&any.value).map_err(|source| RuntimeError::Json {
                what: "oci spec",
                source,
            })?;
        let r = match spec.linux().as_ref().and_then(|l| l.resources().as_ref()) {
            Some(old) => merge_resources(old, &update)?,
            None => update,
        };
        if let Some(linux) = spec.linux_mut() {
            linux.set_resources(Some(r.clone()));
        }
        let update = Container {
            id: id.to_owned(),
            spec: Some(json_any(SPEC_TYPE_URL, "oci spec", &spec)?),
            ..Default::default()
        };
        self.client
            .containers()
            .update(self.client.request(UpdateContainerRequest {
                container: Some(update),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec!["spec".to_owned()],
                }),
            }))
            .await
            .map_err(cd("containers.update"))?;
        match self.get_task(id).await? {
            Some(p) if p.status == TaskStatus::Running as i32 => {}
            // Not running: the spec update is all there is to do.
            _ => return Ok(()),
        }
        self.client
            .tasks()
            .update(self.client.request(UpdateTaskRequest {
                container_id: id.to_owned(),
                resources: Some(json_any(RESOURCES_TYPE_URL, "linux resources", &r)?),
                annotations: HashMap::new(),
            }))
            .await
            .map_err(|s| {
                // A limit below what the container already uses is the
                // container's state, not a runtime failure.
                if s.message().contains("unable to set memory limit") {
                    RuntimeError::FailedPrecondition(format!(
                        "container {id}: {}",
                        s.message().trim()
                    ))
                } else {
                    RuntimeError::containerd("tasks.update", s)
                }
            })?;
        Ok(())
    }
}

/// `update` laid over `old`: every limit `update` sets replaces the old
/// one, the rest (device rules included) stays.
fn merge_resources(
    old: &oci_spec::runtime::LinuxResources,
    update: &oci_spec::runtime::LinuxResources,
) -> Result<oci_spec::runtime::LinuxResources, RuntimeError> {
    fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
        match (into, from) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (k, v) in b {
                    match a.get_mut(&k) {
                        Some(slot) => merge(slot, v),
                        None => {
                            a.insert(k, v);
                        }
                    }
                }
            }
            (slot, v) => *slot = v,
        }
    }
    let json = |source| RuntimeError::Json {
        what: "linux resources",
        source,
    };
    let mut merged = serde_json::to_value(old).map_err(json)?;
    merge(&mut merged, serde_json::to_value(update).map_err(json)?);
    serde_json::from_value(merged).map_err(json)
}

fn unix_nanos(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos()
}

fn spawn_copiers(id: &str, readers: fifo_io::Readers, sink: &Arc<LogSink>) -> Vec<JoinHandle<()>> {
    use tracing::Instrument;
    let span = tracing::info_span!("log_copier", container = id);
    let mut v = vec![tokio::spawn(
        copy_stream(readers.stdout, Stream::Stdout, sink.clone()).instrument(span.clone()),
    )];
    if let Some(e) = readers.stderr {
        v.push(tokio::spawn(
            copy_stream(e, Stream::Stderr, sink.clone()).instrument(span),
        ));
    }
    v
}

async fn read_capped(mut r: tokio::net::unix::pipe::Receiver) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = MAX_EXEC_OUTPUT.saturating_sub(out.len());
                out.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
    out
}

async fn collect(mut h: JoinHandle<Vec<u8>>) -> Vec<u8> {
    // Output ends when the shim closes the FIFOs after the process exits; a
    // background child still holding them must not hang the call.
    match tokio::time::timeout(Duration::from_secs(5), &mut h).await {
        Ok(Ok(v)) => v,
        Ok(Err(_)) => Vec::new(),
        Err(_) => {
            h.abort();
            Vec::new()
        }
    }
}

fn read_user_files_blocking(
    target: &Path,
    mounts: &[containerd_client::types::Mount],
) -> Result<(String, String), RuntimeError> {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    let io = |op: &'static str, p: &Path| {
        let path = p.display().to_string();
        move |source: std::io::Error| RuntimeError::Io { op, path, source }
    };
    std::fs::create_dir_all(target).map_err(io("create", target))?;
    let [m] = mounts else {
        return Err(RuntimeError::FailedPrecondition(format!(
            "expected one rootfs mount, containerd returned {}",
            mounts.len()
        )));
    };
    let bind = m.r#type == "bind" || m.options.iter().any(|o| o == "bind" || o == "rbind");
    let data: Vec<&str> = m
        .options
        .iter()
        .map(String::as_str)
        .filter(|o| !matches!(*o, "rw" | "ro" | "bind" | "rbind"))
        .collect();
    let data = data.join(",");
    let res = if bind {
        mount(
            Some(m.source.as_str()),
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
    } else {
        mount(
            Some(m.source.as_str()),
            target,
            Some(m.r#type.as_str()),
            MsFlags::MS_RDONLY,
            Some(data.as_str()),
        )
    };
    res.map_err(|e| io("mount rootfs", target)(std::io::Error::from(e)))?;
    let read = |name: &str| std::fs::read_to_string(target.join(name)).unwrap_or_default();
    let out = (read("etc/passwd"), read("etc/group"));
    umount2(target, MntFlags::MNT_DETACH)
        .map_err(|e| io("unmount rootfs", target)(std::io::Error::from(e)))?;
    let _ = std::fs::remove_dir(target);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_parse_with_and_without_prefix() {
        assert_eq!(parse_signal("SIGQUIT"), Signal::SIGQUIT);
        assert_eq!(parse_signal("usr1"), Signal::SIGUSR1);
        assert_eq!(parse_signal("9"), Signal::SIGKILL);
        assert_eq!(parse_signal(""), Signal::SIGTERM);
        assert_eq!(parse_signal("bogus"), Signal::SIGTERM);
    }

    #[test]
    fn runc_options_encode_root_and_binary() {
        let any = ContainerRuntime::runtime_options(&HandlerConfig {
            runtime_type: "io.containerd.runc.v2".into(),
            binary: Some("/usr/sbin/runc".into()),
            root: Some("/run/x".into()),
        })
        .unwrap();
        assert_eq!(any.type_url, RUNC_OPTIONS_TYPE_URL);
        // field 6 (binary_name), length-delimited: tag byte 0x32; field 7: 0x3a.
        assert_eq!(any.value[0], 0x32);
        let decoded: RuncOptions = prost::Message::decode(any.value.as_slice()).unwrap();
        assert_eq!(decoded.root, "/run/x");
        assert!(ContainerRuntime::runtime_options(&HandlerConfig::default()).is_none());
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
