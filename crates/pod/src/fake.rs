//! An in-memory [`Runtime`] for unit tests of the lifecycle rules: it keeps
//! containers and tasks in a map, counts calls, and fails or slows down
//! the calls a test asks it to.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use cubelet_engine::spec::SandboxProcess;
use cubelet_runtime::container::{ContainerState, ContainerStatus, ExecOutput, TaskExit};
use cubelet_runtime::events::{ContainerEvent, ContainerEventKind};
use cubelet_runtime::spec::{ContainerSpec, Resources};
use cubelet_runtime::stats::{CgroupStats, InterfaceStats, OpenFiles, SnapshotUsage};
use cubelet_runtime::types::ImageInfo;
use cubelet_runtime::RuntimeError;

use crate::runtime::Runtime;

/// Builds the error a failing call returns.
type ErrorFn = Box<dyn Fn(&str) -> RuntimeError + Send + Sync>;

/// One container the fake holds.
#[derive(Debug, Clone)]
pub struct FakeContainer {
    /// What it was created with.
    pub spec: ContainerSpec,
    /// Its task's state.
    pub state: ContainerState,
    /// Host pid while running.
    pub pid: u32,
    /// Exit code once exited.
    pub exit_code: Option<i32>,
    /// When it exited.
    pub finished_at: Option<SystemTime>,
    /// Limits last set by an update.
    pub resources: Option<Resources>,
}

#[derive(Default)]
struct State {
    images: HashMap<String, ImageInfo>,
    containers: BTreeMap<String, FakeContainer>,
    /// Ids the fake reports as running infra processes (sandboxes).
    infra: BTreeMap<String, ContainerState>,
    calls: BTreeMap<&'static str, u32>,
    failures: HashMap<&'static str, Vec<ErrorFn>>,
    delays: HashMap<&'static str, Duration>,
    exec: Option<Result<ExecOutput, String>>,
    orphan_shims: usize,
    next_pid: u32,
    /// Pin directories the fake reports as alive.
    pins: std::collections::HashSet<std::path::PathBuf>,
    /// Containers whose memory cgroup counts an OOM kill.
    oom_killed: std::collections::HashSet<String>,
    /// Cgroup readings by path.
    cgroups: HashMap<String, CgroupStats>,
    /// The interfaces every pod's network namespace shows.
    interfaces: Vec<InterfaceStats>,
    /// The cgroup driver the fake names cgroups by (cgroupfs unless set).
    cgroup_driver: cubelet_runtime::cgroup::CgroupDriver,
    /// Sandboxes given a stats anchor, in order.
    anchors: Vec<String>,
    /// The shim group each `ensure_stats_anchor` call named, in order.
    anchor_groups: Vec<Option<String>>,
    /// Anchors counted by `stats_anchor_observed`: started, failed.
    anchor_counts: (u32, u32),
    /// `stats_anchor_delay`.
    anchor_delay: Duration,
    /// (container, pid) of tasks made ahead and deleted unstarted.
    unstarted: Vec<(String, u32)>,
    /// Containers that ignore their stop signal: a stop waits out its
    /// timeout (or another stop's kill) before it kills them.
    ignores_stop_signal: std::collections::HashSet<String>,
}

/// The fake runtime. Cheap to clone; clones share state.
#[derive(Clone, Default)]
pub struct FakeRuntime {
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for FakeRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeRuntime").finish_non_exhaustive()
    }
}

impl FakeRuntime {
    /// A runtime with no images.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The sandboxes given a stats anchor so far, in order (one entry per
    /// anchor started).
    pub fn anchors(&self) -> Vec<String> {
        self.lock().anchors.clone()
    }

    /// Sets what `stats_anchor_delay` answers (zero unless told).
    pub fn set_anchor_delay(&self, delay: Duration) {
        self.lock().anchor_delay = delay;
    }

    /// The container whose shim each `ensure_stats_anchor` call named.
    pub fn anchor_groups(&self) -> Vec<Option<String>> {
        self.lock().anchor_groups.clone()
    }

    /// Anchors counted as started and as failed.
    pub fn anchor_counts(&self) -> (u32, u32) {
        self.lock().anchor_counts
    }

    /// Makes `info` findable by `reference` and by its id.
    pub fn add_image(&self, reference: &str, info: ImageInfo) {
        let mut s = self.lock();
        s.images.insert(info.id.clone(), info.clone());
        s.images.insert(reference.to_owned(), info);
    }

    /// The next call to `op` (`create`, `start`, `stop`, `status`, `remove`,
    /// `exec_sync`, `update_resources`, `reopen_log`, `reattach`, `image`,
    /// `writable_layer_usage`)
    /// fails with the error `make` builds from the id.
    pub fn fail_next(
        &self,
        op: &'static str,
        make: impl Fn(&str) -> RuntimeError + Send + Sync + 'static,
    ) {
        self.lock()
            .failures
            .entry(op)
            .or_default()
            .push(Box::new(make));
    }

    /// Container `id` ignores its stop signal, as a process trapping
    /// SIGTERM does: a stop with a timeout kills it only when the timeout
    /// passes, unless another stop kills it first.
    pub fn ignore_stop_signal(&self, id: &str) {
        self.lock().ignores_stop_signal.insert(id.to_owned());
    }

    /// Every call to `op` waits `delay` first (to widen race windows).
    pub fn delay(&self, op: &'static str, delay: Duration) {
        self.lock().delays.insert(op, delay);
    }

    /// How many times `op` was called.
    pub fn calls(&self, op: &str) -> u32 {
        self.lock().calls.get(op).copied().unwrap_or(0)
    }

    /// A copy of one container.
    pub fn container(&self, id: &str) -> Option<FakeContainer> {
        self.lock().containers.get(id).cloned()
    }

    /// Ids of every container the fake holds.
    pub fn container_ids(&self) -> Vec<String> {
        self.lock().containers.keys().cloned().collect()
    }

    /// Reports `id` (a sandbox) as a running infra process.
    pub fn set_infra_running(&self, id: &str) {
        self.lock()
            .infra
            .insert(id.to_owned(), ContainerState::Running);
    }

    /// The task of `id` exits with `code`; returns the event containerd would send.
    pub fn exit(&self, id: &str, code: u32) -> ContainerEvent {
        let at = SystemTime::now();
        let mut s = self.lock();
        if let Some(c) = s.containers.get_mut(id) {
            c.state = ContainerState::Exited;
            c.exit_code = Some(i32::try_from(code).unwrap_or(i32::MAX));
            c.finished_at = Some(at);
        }
        if let Some(state) = s.infra.get_mut(id) {
            *state = ContainerState::Exited;
        }
        ContainerEvent {
            id: id.to_owned(),
            kind: ContainerEventKind::Exited {
                code,
                at: Some(at),
                exec_id: String::new(),
                pid: 0,
            },
        }
    }

    /// Says process `pid` of container `id` was a task made at its create
    /// and deleted unstarted ([`Runtime::unstarted_exit`]).
    pub fn set_unstarted(&self, id: &str, pid: u32) {
        self.lock().unstarted.push((id.to_owned(), pid));
    }

    /// The runtime forgets `id` altogether (as if containerd lost it).
    pub fn forget(&self, id: &str) {
        let mut s = self.lock();
        s.containers.remove(id);
        s.infra.remove(id);
    }

    /// What ExecSync returns next: output, or an error message
    /// (`tasks.start` failing with it).
    pub fn set_exec(&self, result: Result<ExecOutput, String>) {
        self.lock().exec = Some(result);
    }

    /// Reports the pins under `dir` (a sandbox without an infra process) as
    /// alive, or, with `alive` false, as gone.
    pub fn set_pins_alive(&self, dir: impl Into<std::path::PathBuf>, alive: bool) {
        let dir = dir.into();
        let mut s = self.lock();
        if alive {
            s.pins.insert(dir);
        } else {
            s.pins.remove(&dir);
        }
    }

    /// Makes container `id`'s memory cgroup count an OOM kill.
    pub fn set_oom_killed(&self, id: &str) {
        self.lock().oom_killed.insert(id.to_owned());
    }

    /// Names cgroups by `driver` from now on (cgroup directories, and the
    /// check of a pod's `cgroup_parent`).
    pub fn set_cgroup_driver(&self, driver: cubelet_runtime::cgroup::CgroupDriver) {
        self.lock().cgroup_driver = driver;
    }

    /// The cgroup at `path` reads `stats` from now on.
    pub fn set_cgroup(&self, path: &str, stats: CgroupStats) {
        self.lock().cgroups.insert(path.to_owned(), stats);
    }

    /// Every pod's network namespace shows `interfaces` from now on.
    pub fn set_interfaces(&self, interfaces: Vec<InterfaceStats>) {
        self.lock().interfaces = interfaces;
    }

    /// How many orphan shims the next reap finds.
    pub fn set_orphan_shims(&self, n: usize) {
        self.lock().orphan_shims = n;
    }

    /// Counts the call, sleeps its delay, and returns its injected failure.
    async fn enter(&self, op: &'static str, id: &str) -> Result<(), RuntimeError> {
        let delay = {
            let mut s = self.lock();
            *s.calls.entry(op).or_default() += 1;
            s.delays.get(op).copied()
        };
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        let mut s = self.lock();
        match s.failures.get_mut(op) {
            Some(queue) if !queue.is_empty() => Err(queue.remove(0)(id)),
            _ => Ok(()),
        }
    }
}

fn not_found(id: &str) -> RuntimeError {
    RuntimeError::NotFound {
        kind: "container",
        id: id.to_owned(),
    }
}

#[async_trait]
impl Runtime for FakeRuntime {
    async fn image(&self, reference: &str) -> Result<Option<ImageInfo>, RuntimeError> {
        self.enter("image", reference).await?;
        Ok(self.lock().images.get(reference).cloned())
    }

    async fn create(&self, id: &str, spec: &ContainerSpec) -> Result<(), RuntimeError> {
        self.enter("create", id).await?;
        let mut s = self.lock();
        if s.containers.contains_key(id) {
            return Err(RuntimeError::AlreadyExists {
                kind: "container",
                id: id.to_owned(),
            });
        }
        s.containers.insert(
            id.to_owned(),
            FakeContainer {
                spec: spec.clone(),
                state: ContainerState::Created,
                pid: 0,
                exit_code: None,
                finished_at: None,
                resources: None,
            },
        );
        Ok(())
    }

    /// Anchors a sandbox once: later calls find it running. Fails (and
    /// counts) as `ensure_stats_anchor` when told to.
    async fn ensure_stats_anchor(
        &self,
        sandbox: &cubelet_store::SandboxRecord,
        group: Option<&str>,
    ) -> Result<Option<cubelet_runtime::sandbox::anchor::AnchorOutcome>, RuntimeError> {
        use cubelet_runtime::sandbox::anchor::AnchorOutcome;
        let id = sandbox.id.as_str();
        self.enter("ensure_stats_anchor", id).await?;
        let mut s = self.lock();
        s.anchor_groups.push(group.map(str::to_owned));
        if s.anchors.iter().any(|a| a == id) {
            return Ok(Some(AnchorOutcome::Running));
        }
        s.anchors.push(id.to_owned());
        Ok(Some(AnchorOutcome::Started(1)))
    }

    fn stats_anchor_delay(&self) -> Duration {
        self.lock().anchor_delay
    }

    fn unstarted_exit(&self, id: &str, pid: u32) -> bool {
        self.lock()
            .unstarted
            .iter()
            .any(|(c, p)| c == id && *p == pid)
    }

    fn stats_anchor_observed(&self, started: bool) {
        let mut s = self.lock();
        if started {
            s.anchor_counts.0 += 1;
        } else {
            s.anchor_counts.1 += 1;
        }
    }

    async fn start(&self, id: &str) -> Result<u32, RuntimeError> {
        self.enter("start", id).await?;
        let mut s = self.lock();
        s.next_pid += 1;
        let pid = 1000 + s.next_pid;
        let c = s.containers.get_mut(id).ok_or_else(|| not_found(id))?;
        if c.state != ContainerState::Created {
            return Err(RuntimeError::FailedPrecondition(format!(
                "task {id} is {:?}, cannot start",
                c.state
            )));
        }
        c.state = ContainerState::Running;
        c.pid = pid;
        Ok(pid)
    }

    async fn stop(&self, id: &str, timeout: Duration) -> Result<Option<TaskExit>, RuntimeError> {
        self.enter("stop", id).await?;
        if !timeout.is_zero() && self.lock().ignores_stop_signal.contains(id) {
            // The signal changes nothing: wait for the timeout or for an
            // exit another call caused.
            let kill_at = tokio::time::Instant::now() + timeout;
            while tokio::time::Instant::now() < kill_at {
                let running = self
                    .lock()
                    .containers
                    .get(id)
                    .is_some_and(|c| c.state == ContainerState::Running);
                if !running {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let mut s = self.lock();
        let c = s.containers.get_mut(id).ok_or_else(|| not_found(id))?;
        if c.state == ContainerState::Running {
            c.state = ContainerState::Exited;
            c.exit_code = Some(137);
            c.finished_at = Some(SystemTime::now());
        }
        // A task that never started is none to report.
        Ok((c.state == ContainerState::Exited).then(|| TaskExit {
            code: c.exit_code.unwrap_or_default(),
            at: c.finished_at,
        }))
    }

    async fn settle(&self, id: &str) {
        // Counted (and delayed if asked); a failure queued for it is dropped,
        // as the call cannot fail.
        let _ = self.enter("settle", id).await;
    }

    async fn status(&self, id: &str) -> Result<ContainerStatus, RuntimeError> {
        self.enter("status", id).await?;
        let s = self.lock();
        if let Some(state) = s.infra.get(id) {
            return Ok(ContainerStatus {
                id: id.to_owned(),
                state: *state,
                pid: 1,
                exit_code: None,
                created_at: None,
                started_at: None,
                finished_at: None,
                image_ref: String::new(),
                log_path: None,
                runtime_handler: "runc".to_owned(),
                labels: BTreeMap::new(),
            });
        }
        let c = s.containers.get(id).ok_or_else(|| not_found(id))?;
        Ok(ContainerStatus {
            id: id.to_owned(),
            state: c.state,
            pid: c.pid,
            exit_code: c.exit_code,
            created_at: None,
            started_at: None,
            finished_at: c.finished_at,
            image_ref: c.spec.image_ref.clone(),
            log_path: c.spec.log_path.clone(),
            runtime_handler: c.spec.runtime_handler.clone(),
            labels: c.spec.labels.clone(),
        })
    }

    async fn remove(&self, id: &str) -> Result<(), RuntimeError> {
        self.enter("remove", id).await?;
        self.lock().containers.remove(id);
        Ok(())
    }

    async fn exec_sync(
        &self,
        id: &str,
        cmd: &[String],
        timeout: Option<Duration>,
    ) -> Result<ExecOutput, RuntimeError> {
        self.enter("exec_sync", id).await?;
        let exec = self.lock().exec.take();
        match exec {
            Some(Ok(out)) => Ok(out),
            Some(Err(message)) => Err(RuntimeError::Containerd {
                op: "tasks.start",
                status: tonic::Status::unknown(message),
            }),
            None if cmd.first().is_some_and(|c| c == "sleep") => Err(RuntimeError::Timeout {
                op: "exec",
                id: id.to_owned(),
                timeout: timeout.unwrap_or_default(),
            }),
            None => Ok(ExecOutput {
                stdout: cmd.join(" ").into_bytes(),
                stderr: Vec::new(),
                exit_code: 0,
            }),
        }
    }

    async fn update_resources(&self, id: &str, resources: &Resources) -> Result<(), RuntimeError> {
        self.enter("update_resources", id).await?;
        let mut s = self.lock();
        let c = s.containers.get_mut(id).ok_or_else(|| not_found(id))?;
        c.resources = Some(resources.clone());
        Ok(())
    }

    async fn reopen_log(&self, id: &str) -> Result<(), RuntimeError> {
        self.enter("reopen_log", id).await
    }

    async fn reattach(&self, id: &str) -> Result<(), RuntimeError> {
        self.enter("reattach", id).await
    }

    async fn reap_orphan_shims(&self) -> Result<usize, RuntimeError> {
        self.enter("reap_orphan_shims", "").await?;
        Ok(std::mem::take(&mut self.lock().orphan_shims))
    }

    fn pins_alive(&self, process: &SandboxProcess) -> bool {
        process.is_infraless()
            && process
                .pins_dir
                .as_ref()
                .is_some_and(|d| self.lock().pins.contains(d))
    }

    fn oom_killed(&self, id: &str, _cgroup_parent: Option<&str>) -> bool {
        self.lock().oom_killed.contains(id)
    }

    fn cgroup_driver(&self) -> cubelet_runtime::cgroup::CgroupDriver {
        self.lock().cgroup_driver
    }

    fn read_cgroup(&self, path: &str, processes: bool, _files: Option<&OpenFiles>) -> CgroupStats {
        let mut stats = self.lock().cgroups.get(path).copied().unwrap_or_default();
        if !processes {
            stats.processes = None;
        }
        stats
    }

    async fn writable_layer_usage(
        &self,
        id: &str,
    ) -> Result<(SnapshotUsage, SystemTime), RuntimeError> {
        self.enter("writable_layer_usage", id).await?;
        if !self.lock().containers.contains_key(id) {
            return Err(not_found(id));
        }
        Ok((
            SnapshotUsage {
                bytes: 4096,
                inodes: 1,
            },
            SystemTime::now(),
        ))
    }

    async fn pod_interfaces(
        &self,
        _pid: Option<u32>,
        _netns: Option<std::path::PathBuf>,
    ) -> std::io::Result<Vec<InterfaceStats>> {
        Ok(self.lock().interfaces.clone())
    }
}
