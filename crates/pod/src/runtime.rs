//! What the pod service needs from the container runtime, as a trait: the
//! real one is containerd ([`Containerd`]); a fake stands beside it for the
//! unit tests of the lifecycle rules (`fake` feature).

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use cubelet_engine::spec::SandboxProcess;
use cubelet_runtime::cgroup::CgroupDriver;
use cubelet_runtime::container::{ContainerRuntime, ContainerStatus, ExecOutput, TaskExit};
use cubelet_runtime::image::ImageService;
use cubelet_runtime::sandbox::anchor::{AnchorOutcome, StatsAnchor};
use cubelet_runtime::spec::{ContainerSpec, Resources};
use cubelet_runtime::stats::{
    parse_net_dev, read_net_dev, CgroupLayout, CgroupStats, InterfaceStats, OpenFiles,
    SnapshotUsage,
};
use cubelet_runtime::types::ImageInfo;
use cubelet_runtime::RuntimeError;
use cubelet_store::SandboxRecord;
use futures::future::BoxFuture;

/// The container runtime surface of the pod lifecycle.
#[async_trait]
pub trait Runtime: Send + Sync + 'static {
    /// The image a reference or id names, if it is present.
    async fn image(&self, reference: &str) -> Result<Option<ImageInfo>, RuntimeError>;

    /// Creates a container (not started). On failure nothing is left.
    async fn create(&self, id: &str, spec: &ContainerSpec) -> Result<(), RuntimeError>;

    /// Starts a created container; returns its init process's host pid.
    async fn start(&self, id: &str) -> Result<u32, RuntimeError>;

    /// Stops a container's process, killing it after `timeout`. The exited
    /// task may be let go of in the background. Returns how the task
    /// exited, `None` when it had no task.
    async fn stop(&self, id: &str, timeout: Duration) -> Result<Option<TaskExit>, RuntimeError>;

    /// Waits until the runtime has let go of a stopped container's task (a
    /// deletion [`Runtime::stop`] left running in the background is over).
    async fn settle(&self, id: &str);

    /// A container's state as the runtime sees it.
    async fn status(&self, id: &str) -> Result<ContainerStatus, RuntimeError>;

    /// Removes a container and everything the runtime holds for it. Absent is Ok.
    async fn remove(&self, id: &str) -> Result<(), RuntimeError>;

    /// Runs a command in a running container and collects its output.
    async fn exec_sync(
        &self,
        id: &str,
        cmd: &[String],
        timeout: Option<Duration>,
    ) -> Result<ExecOutput, RuntimeError>;

    /// Changes a running container's limits.
    async fn update_resources(&self, id: &str, resources: &Resources) -> Result<(), RuntimeError>;

    /// Reopens a container's log file (after rotation).
    async fn reopen_log(&self, id: &str) -> Result<(), RuntimeError>;

    /// Picks a running container's output up again after a restart.
    async fn reattach(&self, id: &str) -> Result<(), RuntimeError>;

    /// Stops shims whose task the runtime does not know; returns how many.
    async fn reap_orphan_shims(&self) -> Result<usize, RuntimeError>;

    /// Kills the shim of task group `group` (a pod's sandbox id) when it
    /// answers nothing about any of `tasks` (the pod's), so that what
    /// waits on it returns; whether it killed one. The default: never.
    async fn unwedge_shim(&self, _group: &str, _tasks: &[String]) -> Result<bool, RuntimeError> {
        Ok(false)
    }

    /// Whether the pinned namespaces of a sandbox without an infra process
    /// are still there (its pin directory, every pin mounted).
    fn pins_alive(&self, process: &SandboxProcess) -> bool;

    /// Whether the kernel's OOM killer killed a process of container `id`
    /// (in its pod's `cgroup_parent`), as its memory cgroup counts: what an
    /// exit reports when the runtime's OOM event has not come.
    fn oom_killed(&self, id: &str, cgroup_parent: Option<&str>) -> bool;

    /// The node's cgroup driver: every cgroup directory of a container or
    /// pod is derived from it ([`CgroupDriver`]).
    fn cgroup_driver(&self) -> CgroupDriver;

    /// The directory of container `id`'s cgroup below the hierarchy root,
    /// in a pod with `cgroup_parent` (`/kubepods/pod1/<id>` with cgroupfs,
    /// `/kubepods.slice/kubepods-pod1.slice/cubelet-<id>.scope` with
    /// systemd).
    fn container_cgroup(&self, cgroup_parent: Option<&str>, id: &str) -> String {
        self.cgroup_driver().container_dir(cgroup_parent, id)
    }

    /// The directory of a pod's own cgroup (its `cgroup_parent`, made by
    /// kubelet) below the hierarchy root; `None` without one.
    fn pod_cgroup(&self, cgroup_parent: &str) -> Option<String> {
        self.cgroup_driver().parent_dir(cgroup_parent)
    }

    /// Checks a pod's `cgroup_parent` against the driver:
    /// `InvalidArgument` naming `config.linux.cgroup_parent` otherwise.
    fn check_cgroup_parent(&self, cgroup_parent: &str) -> Result<(), RuntimeError> {
        self.cgroup_driver()
            .check_parent(cubelet_runtime::cgroup::PARENT_FIELD, cgroup_parent)
    }

    /// The readings of the cgroup at `path`, a directory below the
    /// hierarchy root ([`Runtime::container_cgroup`],
    /// [`Runtime::pod_cgroup`]; empty when it is gone): with the process
    /// count if `processes`, through the files `files` keeps open if given.
    fn read_cgroup(&self, path: &str, processes: bool, files: Option<&OpenFiles>) -> CgroupStats;

    /// Usage of container `id`'s writable layer and when it was read.
    async fn writable_layer_usage(
        &self,
        id: &str,
    ) -> Result<(SnapshotUsage, SystemTime), RuntimeError>;

    /// Makes sure pod `sandbox` (without an infra process) has a running
    /// stats anchor (`cubelet_runtime::sandbox::anchor`); `None` when this
    /// runtime makes none (the default).
    /// `group` is the pod's shim group (its sandbox id), whose shim the
    /// anchor shares when the pod has one running.
    async fn ensure_stats_anchor(
        &self,
        _sandbox: &SandboxRecord,
        _group: Option<&str>,
    ) -> Result<Option<AnchorOutcome>, RuntimeError> {
        Ok(None)
    }

    /// Counts an anchor started (`true`) or one that failed.
    fn stats_anchor_observed(&self, _started: bool) {}

    /// Whether an exit of container `id`'s init process `pid` is that of a
    /// task made ahead of its start and deleted unstarted: no exit of the
    /// container's, which never ran.
    fn unstarted_exit(&self, _id: &str, _pid: u32) -> bool {
        false
    }

    /// How long after a container's start its pod's anchor is asked for.
    fn stats_anchor_delay(&self) -> Duration {
        Duration::ZERO
    }

    /// The interfaces of a pod's network namespace: read through its infra
    /// process `pid`, or, without one, inside the namespace pinned at
    /// `netns`.
    async fn pod_interfaces(
        &self,
        pid: Option<u32>,
        netns: Option<PathBuf>,
    ) -> io::Result<Vec<InterfaceStats>>;
}

/// Reads `/proc/net/dev` as a pod's network namespace shows it, through
/// the namespace's pin: the pod network stats of a sandbox without an
/// infra process, which has no process to read `/proc/<pid>/net/dev` of.
/// Entering a namespace is the network crate's business (docs/DESIGN.md),
/// so the binary wires one in.
pub trait NetnsCounters: Send + Sync + fmt::Debug + 'static {
    /// The text of `/proc/net/dev` inside the namespace pinned at `netns`.
    fn net_dev(&self, netns: PathBuf) -> BoxFuture<'static, io::Result<String>>;
}

/// How long after a container's start [`Containerd`] asks for its pod's
/// stats anchor: a kubelet's cAdvisor looks at new cgroups on its own
/// housekeeping period (10 s) and its stats are scraped less often still,
/// so this is invisible to it; a pod gone before then gets none.
pub const DEFAULT_ANCHOR_DELAY: Duration = Duration::from_secs(2);

/// Counts stats anchors started and failed (a metric, in the binary).
pub trait AnchorObserver: Send + Sync + fmt::Debug + 'static {
    /// One anchor started (`true`) or failed to.
    fn observed(&self, started: bool);
}

/// The real runtime: containers and tasks in containerd, images in its
/// content store.
#[derive(Debug, Clone)]
pub struct Containerd {
    containers: Arc<ContainerRuntime>,
    images: Arc<ImageService>,
    netns_counters: Arc<dyn NetnsCounters>,
    anchor: Option<(StatsAnchor, Arc<dyn AnchorObserver>)>,
    anchor_delay: Duration,
    pod_ooms: Arc<PodOomCounts>,
}

/// The OOM kills each pod cgroup had counted when last looked at, for
/// containers whose own cgroup is gone by the time their exit is seen:
/// under the systemd driver a container's scope is removed as soon as its
/// last process dies, and on cgroup v2 its pod's `memory.events` counts the
/// kills of every cgroup below it.
#[derive(Debug, Default)]
struct PodOomCounts(std::sync::Mutex<std::collections::HashMap<String, u64>>);

/// Pod cgroups remembered at most; past it the oldest knowledge is dropped
/// (a pod then counts from zero, as after a restart).
const POD_OOM_COUNTS_MAX: usize = 4096;

impl PodOomCounts {
    /// Whether `pod_dir`'s count grew since it was last seen (from zero when
    /// never seen), remembering `now`.
    fn grew(&self, pod_dir: &str, now: u64) -> bool {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() >= POD_OOM_COUNTS_MAX && !seen.contains_key(pod_dir) {
            seen.clear();
        }
        let before = seen.insert(pod_dir.to_owned(), now).unwrap_or(0);
        now > before
    }
}

impl Containerd {
    /// Wraps containerd's container runtime and image service; the network
    /// counters of pods without an infra process are read by
    /// `netns_counters`.
    pub fn new(
        containers: Arc<ContainerRuntime>,
        images: Arc<ImageService>,
        netns_counters: Arc<dyn NetnsCounters>,
    ) -> Self {
        Self {
            containers,
            images,
            netns_counters,
            anchor: None,
            anchor_delay: DEFAULT_ANCHOR_DELAY,
            pod_ooms: Arc::default(),
        }
    }

    /// Asks for a pod's stats anchor `delay` after a container's start
    /// ([`DEFAULT_ANCHOR_DELAY`] unless told).
    pub fn with_stats_anchor_delay(mut self, delay: Duration) -> Self {
        self.anchor_delay = delay;
        self
    }

    /// Gives pods without an infra process a stats anchor made by `anchor`
    /// (`runtime.stats_anchor`), counted by `observer`.
    pub fn with_stats_anchor(
        mut self,
        anchor: StatsAnchor,
        observer: Arc<dyn AnchorObserver>,
    ) -> Self {
        self.anchor = Some((anchor, observer));
        self
    }
}

#[async_trait]
impl Runtime for Containerd {
    async fn image(&self, reference: &str) -> Result<Option<ImageInfo>, RuntimeError> {
        self.images.status(reference).await
    }

    async fn create(&self, id: &str, spec: &ContainerSpec) -> Result<(), RuntimeError> {
        self.containers.create(id, spec).await
    }

    async fn start(&self, id: &str) -> Result<u32, RuntimeError> {
        self.containers.start(id).await
    }

    async fn stop(&self, id: &str, timeout: Duration) -> Result<Option<TaskExit>, RuntimeError> {
        self.containers.stop(id, timeout).await
    }

    async fn settle(&self, id: &str) {
        self.containers.retired(id).await
    }

    async fn status(&self, id: &str) -> Result<ContainerStatus, RuntimeError> {
        self.containers.status(id).await
    }

    async fn remove(&self, id: &str) -> Result<(), RuntimeError> {
        self.containers.remove(id).await
    }

    async fn exec_sync(
        &self,
        id: &str,
        cmd: &[String],
        timeout: Option<Duration>,
    ) -> Result<ExecOutput, RuntimeError> {
        self.containers.exec_sync(id, cmd, timeout).await
    }

    async fn update_resources(&self, id: &str, resources: &Resources) -> Result<(), RuntimeError> {
        self.containers.update_resources(id, resources).await
    }

    async fn reopen_log(&self, id: &str) -> Result<(), RuntimeError> {
        self.containers.reopen_log(id).await
    }

    async fn reattach(&self, id: &str) -> Result<(), RuntimeError> {
        self.containers.reattach(id).await
    }

    async fn reap_orphan_shims(&self) -> Result<usize, RuntimeError> {
        self.containers.reap_orphan_shims().await
    }

    async fn unwedge_shim(&self, group: &str, tasks: &[String]) -> Result<bool, RuntimeError> {
        self.containers.unwedge_shim(group, tasks).await
    }

    fn pins_alive(&self, process: &SandboxProcess) -> bool {
        cubelet_runtime::sandbox::podns::pins_alive(process)
    }

    fn oom_killed(&self, id: &str, cgroup_parent: Option<&str>) -> bool {
        let layout = CgroupLayout::node();
        if let Some(n) = layout.oom_kills(&self.container_cgroup(cgroup_parent, id)) {
            return n > 0;
        }
        // The container's cgroup is gone: systemd removes a scope with its
        // last process. On v2 the pod's cgroup counts its containers' kills.
        if !matches!(layout, CgroupLayout::V2 { .. }) {
            return false;
        }
        let Some(pod_dir) = cgroup_parent.and_then(|p| self.pod_cgroup(p)) else {
            return false;
        };
        layout
            .oom_kills(&pod_dir)
            .is_some_and(|now| self.pod_ooms.grew(&pod_dir, now))
    }

    fn cgroup_driver(&self) -> CgroupDriver {
        self.containers.config().cgroup_driver
    }

    fn read_cgroup(&self, path: &str, processes: bool, files: Option<&OpenFiles>) -> CgroupStats {
        let layout = CgroupLayout::node();
        match (files, processes) {
            (Some(files), _) => layout.read_with(path, processes, files),
            (None, true) => layout.read(path),
            (None, false) => layout.read_usage(path),
        }
    }

    async fn writable_layer_usage(
        &self,
        id: &str,
    ) -> Result<(SnapshotUsage, SystemTime), RuntimeError> {
        self.containers.writable_layer_usage(id).await
    }

    async fn ensure_stats_anchor(
        &self,
        sandbox: &SandboxRecord,
        group: Option<&str>,
    ) -> Result<Option<AnchorOutcome>, RuntimeError> {
        let (Some((anchor, _)), Some(process)) = (&self.anchor, &sandbox.process) else {
            return Ok(None);
        };
        let netns = sandbox
            .network
            .as_ref()
            .and_then(|n| n.netns_path.as_deref());
        anchor
            .ensure(sandbox.id.as_str(), &sandbox.spec, process, netns, group)
            .await
            .map(Some)
    }

    fn unstarted_exit(&self, id: &str, pid: u32) -> bool {
        self.containers.unstarted_exit(id, pid)
    }

    fn stats_anchor_observed(&self, started: bool) {
        if let Some((_, observer)) = &self.anchor {
            observer.observed(started);
        }
    }

    fn stats_anchor_delay(&self) -> Duration {
        self.anchor_delay
    }

    async fn pod_interfaces(
        &self,
        pid: Option<u32>,
        netns: Option<PathBuf>,
    ) -> io::Result<Vec<InterfaceStats>> {
        match (pid, netns) {
            (Some(pid), _) => read_net_dev(pid).map_err(io::Error::other),
            (None, Some(netns)) => Ok(parse_net_dev(&self.netns_counters.net_dev(netns).await?)),
            (None, None) => Ok(Vec::new()),
        }
    }
}

#[cfg(test)]
mod oom_count_tests {
    use super::PodOomCounts;

    #[test]
    fn a_pod_counts_an_oom_once_and_a_later_kill_is_not_one() {
        let counts = PodOomCounts::default();
        assert!(!counts.grew("/kubepods.slice/p.slice", 0), "no kill yet");
        assert!(counts.grew("/kubepods.slice/p.slice", 1), "the first kill");
        assert!(
            !counts.grew("/kubepods.slice/p.slice", 1),
            "a SIGKILL after it is no OOM"
        );
        assert!(counts.grew("/kubepods.slice/p.slice", 2), "a second kill");
        assert!(counts.grew("/kubepods.slice/q.slice", 1), "pods apart");
    }
}
