//! The `sandbox` flow provider: the pod infra (pause) container.
//!
//! `create` runs the pause process in the pod's network namespace (published
//! by the network step, or the node's for host-network pods) with its own
//! IPC/UTS/PID namespaces unless the pod uses the node's, and publishes a
//! [`SandboxProcess`]. The container id is the sandbox id, so `destroy` and
//! `cleanup` (both: kill and delete the task, then the rootfs snapshot, the
//! container record and the FIFOs; the pause process keeps nothing worth
//! keeping) need nothing but the id and are idempotent.

use std::sync::Arc;

use async_trait::async_trait;
use cubelet_engine::spec::{NetworkStatus, SandboxProcess};
use cubelet_engine::{Flow, FlowContext, StepError};

use crate::container::ContainerRuntime;
use crate::error::RuntimeError;
use crate::spec::{ContainerKind, ContainerNamespaces, ContainerSpec, Resources, SeccompProfile};
use crate::types::ImageInfo;

/// `oom_score_adj` asked for the infra process (as containerd's CRI plugin);
/// raised to the agent's own score when `restrict_oom_score_adj` is on.
pub const INFRA_OOM_SCORE_ADJ: i32 = -998;

/// Where the pause image comes from (the binary wires in the image module).
#[async_trait]
pub trait PauseImageSource: Send + Sync + std::fmt::Debug + 'static {
    /// The reference of the pause image.
    fn reference(&self) -> String;
    /// The pause image, pulled or imported and unpacked.
    async fn pause_image(&self) -> Result<ImageInfo, RuntimeError>;
}

/// The pod infra image: the built-in `cubelet-pause` image, built from the
/// static pause binary and imported on first use (see
/// [`crate::pause::ensure_pause_image`]), or a configured registry image,
/// pulled on first use.
#[derive(Debug, Clone)]
pub struct PauseImage {
    images: crate::image::ImageService,
    /// Registry image; `None` means the built-in one.
    reference: Option<String>,
    binary: std::path::PathBuf,
}

impl PauseImage {
    /// The built-in image, imported through `images` from the
    /// `cubelet-pause` binary at `binary`.
    pub fn builtin(
        images: crate::image::ImageService,
        binary: impl Into<std::path::PathBuf>,
    ) -> Self {
        Self {
            images,
            reference: None,
            binary: binary.into(),
        }
    }

    /// `reference` pulled from its registry, or the built-in image when
    /// `reference` is empty (the `images.pause_image` setting).
    pub fn configured(
        images: crate::image::ImageService,
        reference: &str,
        binary: impl Into<std::path::PathBuf>,
    ) -> Self {
        Self {
            reference: Some(reference.to_owned()).filter(|r| !r.is_empty()),
            ..Self::builtin(images, binary)
        }
    }
}

#[async_trait]
impl PauseImageSource for PauseImage {
    fn reference(&self) -> String {
        self.reference
            .clone()
            .unwrap_or_else(crate::pause::pause_image_ref)
    }

    async fn pause_image(&self) -> Result<ImageInfo, RuntimeError> {
        match &self.reference {
            Some(r) => match self.images.status(r).await? {
                Some(info) => Ok(info),
                None => self.images.pull(r, None).await,
            },
            None => {
                // Imported once: later sandboxes find it without reading
                // (or needing) the binary again.
                match self.images.status(&crate::pause::pause_image_ref()).await? {
                    Some(info) => Ok(info),
                    None => crate::pause::ensure_pause_image(&self.images, &self.binary).await,
                }
            }
        }
    }
}

/// The `sandbox` flow provider.
#[derive(Debug)]
pub struct SandboxProvider {
    runtime: Arc<ContainerRuntime>,
    pause: Arc<dyn PauseImageSource>,
}

impl SandboxProvider {
    /// A provider running pause containers from `pause` on `runtime`.
    pub fn new(runtime: Arc<ContainerRuntime>, pause: Arc<dyn PauseImageSource>) -> Self {
        Self { runtime, pause }
    }

    /// The container spec of the infra container of `ctx`'s sandbox.
    pub fn infra_spec(&self, ctx: &FlowContext, image: ImageInfo) -> ContainerSpec {
        let spec = ctx.spec();
        let net = ctx.get::<NetworkStatus>().unwrap_or_default();
        let mut labels = spec.labels.clone();
        labels.insert("io.cubelet.sandbox/uid".to_owned(), spec.uid.clone());
        ContainerSpec {
            name: format!("{}_{}_infra", spec.namespace, spec.name),
            image_ref: self.pause.reference(),
            image,
            command: vec!["/pause".to_owned()],
            capabilities_drop: Vec::new(),
            privileged: spec.privileged,
            readonly_rootfs: true,
            no_new_privs: true,
            seccomp: if spec.privileged {
                SeccompProfile::Unconfined
            } else {
                SeccompProfile::RuntimeDefault
            },
            resources: Resources {
                oom_score_adj: INFRA_OOM_SCORE_ADJ,
                ..Default::default()
            },
            sysctls: spec.sysctls.clone(),
            kind: ContainerKind::Sandbox,
            labels,
            annotations: spec.annotations.clone(),
            cgroup_parent: spec.cgroup_parent.clone(),
            namespaces: ContainerNamespaces::for_infra(&spec.namespaces, net.netns_path.as_deref())
                .in_userns(&spec.namespaces, net.userns_path.as_deref()),
            hostname: spec.effective_hostname().to_owned(),
            runtime_handler: spec.runtime_handler.clone(),
            ..Default::default()
        }
    }
}

#[async_trait]
impl Flow for SandboxProvider {
    async fn create(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let id = ctx.sandbox_id().as_str();
        let (handler, _) = self.runtime.handler(&ctx.spec().runtime_handler)?;
        let handler = handler.to_owned();
        let image = self.pause.pause_image().await?;
        let spec = self.infra_spec(ctx, image);
        self.runtime.create(id, &spec).await?;
        let pid = match self.runtime.start(id).await {
            Ok(pid) => pid,
            Err(e) => {
                if let Err(undo) = self.runtime.remove(id).await {
                    tracing::warn!(sandbox = id, error = %undo, "removing the failed infra container failed");
                }
                return Err(e.into());
            }
        };
        ctx.publish(SandboxProcess {
            pid: Some(pid),
            runtime_handler: handler,
            ..Default::default()
        });
        Ok(())
    }

    /// The pause process has nothing to flush: `remove` kills it outright
    /// (`SIGKILL`) and takes its rootfs, record and FIFOs with it.
    async fn destroy(&self, ctx: &FlowContext) -> Result<(), StepError> {
        Ok(self.runtime.remove(ctx.sandbox_id().as_str()).await?)
    }

    async fn cleanup(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.destroy(ctx).await
    }
}
