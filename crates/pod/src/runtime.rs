//! What the pod service needs from the container runtime, as a trait: the
//! real one is containerd ([`Containerd`]); a fake stands beside it for the
//! unit tests of the lifecycle rules (`fake` feature).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use cubelet_engine::spec::SandboxProcess;
use cubelet_runtime::container::{ContainerRuntime, ContainerStatus, ExecOutput};
use cubelet_runtime::image::ImageService;
use cubelet_runtime::spec::{ContainerSpec, Resources};
use cubelet_runtime::types::ImageInfo;
use cubelet_runtime::RuntimeError;

/// The container runtime surface of the pod lifecycle.
#[async_trait]
pub trait Runtime: Send + Sync + 'static {
    /// The handler used when a pod names none.
    fn default_handler(&self) -> String;

    /// Every configured runtime handler.
    fn handlers(&self) -> Vec<String>;

    /// The image a reference or id names, if it is present.
    async fn image(&self, reference: &str) -> Result<Option<ImageInfo>, RuntimeError>;

    /// Creates a container (not started). On failure nothing is left.
    async fn create(&self, id: &str, spec: &ContainerSpec) -> Result<(), RuntimeError>;

    /// Starts a created container; returns its init process's host pid.
    async fn start(&self, id: &str) -> Result<u32, RuntimeError>;

    /// Stops a container's process, killing it after `timeout`. The exited
    /// task may be let go of in the background.
    async fn stop(&self, id: &str, timeout: Duration) -> Result<(), RuntimeError>;

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

    /// Whether the pinned namespaces of a sandbox without an infra process
    /// are still there (its pin directory, every pin mounted).
    fn pins_alive(&self, process: &SandboxProcess) -> bool;

    /// Whether the kernel's OOM killer killed a process of container `id`
    /// (in its pod's `cgroup_parent`), as its memory cgroup counts: what an
    /// exit reports when the runtime's OOM event has not come.
    fn oom_killed(&self, id: &str, cgroup_parent: Option<&str>) -> bool;
}

/// The real runtime: containers and tasks in containerd, images in its
/// content store.
#[derive(Debug, Clone)]
pub struct Containerd {
    containers: Arc<ContainerRuntime>,
    images: Arc<ImageService>,
}

impl Containerd {
    /// Wraps containerd's container runtime and image service.
    pub fn new(containers: Arc<ContainerRuntime>, images: Arc<ImageService>) -> Self {
        Self { containers, images }
    }
}

#[async_trait]
impl Runtime for Containerd {
    fn default_handler(&self) -> String {
        self.containers.config().default_handler.clone()
    }

    fn handlers(&self) -> Vec<String> {
        self.containers.config().handlers.keys().cloned().collect()
    }

    async fn image(&self, reference: &str) -> Result<Option<ImageInfo>, RuntimeError> {
        self.images.status(reference).await
    }

    async fn create(&self, id: &str, spec: &ContainerSpec) -> Result<(), RuntimeError> {
        self.containers.create(id, spec).await
    }

    async fn start(&self, id: &str) -> Result<u32, RuntimeError> {
        self.containers.start(id).await
    }

    async fn stop(&self, id: &str, timeout: Duration) -> Result<(), RuntimeError> {
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

    fn pins_alive(&self, process: &SandboxProcess) -> bool {
        cubelet_runtime::podns::pins_alive(process)
    }

    fn oom_killed(&self, id: &str, cgroup_parent: Option<&str>) -> bool {
        cubelet_runtime::stats::CgroupLayout::node()
            .oom_kills(&cubelet_runtime::spec::cgroup_path(cgroup_parent, id))
            .is_some_and(|n| n > 0)
    }
}
