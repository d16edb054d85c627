//! The `sandbox` flow provider: the pod's shared namespaces, with or
//! without an infra (pause) process.
//!
//! **With an infra process** `create` runs the pause process in the pod's
//! network namespace (published by the network step, or the node's for
//! host-network pods) with its own IPC/UTS/PID namespaces unless the pod
//! uses the node's, and publishes a [`SandboxProcess`] with its pid. The
//! container id is the sandbox id, so teardown needs nothing but the id.
//!
//! **Without one** (`runtime.sandbox: auto`, the default, for pods that do
//! not share a PID namespace nor have a user namespace of their own:
//! [`SandboxProvider::needs_infra`]) `create`
//! makes the pod's IPC and UTS namespaces on a thread of their own, sets the
//! hostname and pins them ([`crate::sandbox::podns`]); containers join those pins and
//! the network step's netns pin by path. This is most of RunPodSandbox's
//! cost saved: no container, no shim, no task.
//!
//! `destroy` and `cleanup` (both: remove everything; neither kind keeps
//! anything worth keeping) are idempotent and need only the id: a sandbox
//! that has a pin directory never had a pause container (the directory is
//! the first thing its create makes), so its teardown unmounts the pins and
//! touches no containerd object but its stats anchor's, if it has one
//! ([`anchor`]); any other sandbox's teardown kills and deletes the pause
//! task, its rootfs snapshot, container record and FIFOs.

pub mod anchor;
pub mod pause;
pub mod podns;

use std::sync::Arc;

use async_trait::async_trait;
use cubelet_engine::spec::{NamespaceMode, NetworkStatus, SandboxProcess};
use cubelet_engine::{Flow, FlowContext, SandboxSpec, StepError};

use crate::container::{ContainerRuntime, HandlerConfig};
use crate::error::RuntimeError;
use crate::sandbox::podns::{PinRequest, PodNamespaces};
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
/// [`crate::sandbox::pause::ensure_pause_image`]), or a configured registry image,
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
            .unwrap_or_else(crate::sandbox::pause::pause_image_ref)
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
                match self
                    .images
                    .status(&crate::sandbox::pause::pause_image_ref())
                    .await?
                {
                    Some(info) => Ok(info),
                    None => {
                        crate::sandbox::pause::ensure_pause_image(&self.images, &self.binary).await
                    }
                }
            }
        }
    }
}

/// How the `sandbox` step gives pods their shared namespaces
/// (`runtime.sandbox`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SandboxMode {
    /// No infra process unless the pod needs one (a pod-level PID
    /// namespace, or a runtime that is not runc's shim): IPC and UTS
    /// namespaces are pinned instead.
    #[default]
    Auto,
    /// A pause container for every pod.
    Pause,
}

/// The `sandbox` flow provider.
#[derive(Debug)]
pub struct SandboxProvider {
    runtime: Arc<ContainerRuntime>,
    pause: Arc<dyn PauseImageSource>,
    mode: SandboxMode,
    pins: Option<PodNamespaces>,
    /// Whether a warm-pool shell gets a keeper (and so a running shim):
    /// see [`SandboxProvider::with_shell_shims`].
    shell_shims: bool,
}

impl SandboxProvider {
    /// A provider running a pause container from `pause` on `runtime` for
    /// every pod (and knowing no pinned namespaces).
    pub fn new(runtime: Arc<ContainerRuntime>, pause: Arc<dyn PauseImageSource>) -> Self {
        Self {
            runtime,
            pause,
            mode: SandboxMode::Pause,
            pins: None,
            shell_shims: false,
        }
    }

    /// Pins namespaces of pods without an infra process under `pins` (its
    /// `init` prepares the directory), when `mode` lets a pod go without
    /// one. Teardown and the GC find pins there in either mode, so a
    /// sandbox made before a change of mode is still torn down whole.
    pub fn with_pinned_namespaces(mut self, pins: PodNamespaces, mode: SandboxMode) -> Self {
        self.pins = Some(pins);
        self.mode = mode;
        self
    }

    /// Gives every warm-pool shell with a network namespace a running runc
    /// shim, held by a *keeper* ([`anchor::keeper_spec`]): the pause binary
    /// as a containerd container with the shell's id, started in a shim
    /// grouped by that id ([`anchor::SHIM_GROUP_ANNOTATION`]). The pod that
    /// claims the shell runs its containers in that shim (they are grouped
    /// by their sandbox id), so its first StartContainer starts no shim;
    /// its stats anchor replaces the keeper. The keeper is made after the
    /// anchor marker is written in the shell's pin directory, so every
    /// teardown of the shell or of its pod (and the GC's, after a crash)
    /// removes it as it removes an anchor.
    pub fn with_shell_shims(mut self, on: bool) -> Self {
        self.shell_shims = on;
        self
    }

    /// Whether `spec`'s pod (run by `handler`) gets a pause container: in
    /// `pause` mode always; in `auto` mode when it shares one PID namespace
    /// (only a process can hold one: a PID namespace dies with its init),
    /// when it has a user namespace of its own (its IPC and UTS namespaces
    /// must be owned by that user namespace, and a thread of this
    /// multi-threaded agent cannot enter a user namespace: `setns` refuses,
    /// so it would take a child process, which is what the pause container
    /// is), or when its runtime is not runc's containerd shim (a VM runtime
    /// builds the pod around its sandbox container, and pinned host
    /// namespaces mean nothing inside a VM).
    pub fn needs_infra(&self, spec: &SandboxSpec, handler: &HandlerConfig) -> bool {
        self.pins.is_none() || infra_needed(self.mode, spec, handler)
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

/// Whether a claimed shell's pinned namespaces serve `spec`'s pod as they
/// are: both pinned, and the pod uses neither the node's network nor its
/// IPC namespace.
fn pins_fit(shell: &SandboxProcess, spec: &SandboxSpec) -> bool {
    shell.uts_path.is_some()
        && shell.ipc_path.is_some()
        && !spec.host_network()
        && spec.namespaces.ipc != NamespaceMode::Node
}

/// [`SandboxProvider::needs_infra`] of a provider that can pin namespaces.
fn infra_needed(mode: SandboxMode, spec: &SandboxSpec, handler: &HandlerConfig) -> bool {
    mode == SandboxMode::Pause
        || spec.namespaces.pid == NamespaceMode::Pod
        || spec.namespaces.userns.is_some()
        || !handler.runtime_type.starts_with("io.containerd.runc.")
}

impl SandboxProvider {
    /// `create` of a pod without an infra process: its IPC namespace unless
    /// it uses the node's, its UTS namespace (with the hostname) unless it
    /// uses the node's network, pinned.
    async fn create_pinned(
        &self,
        ctx: &FlowContext,
        pins: &PodNamespaces,
        runtime_handler: String,
    ) -> Result<(), StepError> {
        let spec = ctx.spec();
        let req = PinRequest {
            ipc: spec.namespaces.ipc != NamespaceMode::Node,
            hostname: (!spec.host_network()).then(|| spec.effective_hostname().to_owned()),
        };
        let pinned = pins.create(ctx.sandbox_id(), &req).await?;
        tracing::debug!(sandbox = %ctx.sandbox_id(), dir = %pinned.dir.display(), "pod namespaces pinned, no infra process");
        ctx.publish(SandboxProcess {
            pid: None,
            runtime_handler,
            ipc_path: pinned.ipc,
            uts_path: pinned.uts,
            pins_dir: Some(pinned.dir),
        });
        Ok(())
    }
}

#[async_trait]
impl Flow for SandboxProvider {
    async fn init(&self) -> Result<(), StepError> {
        if let Some(pins) = &self.pins {
            cubelet_engine::blocking(|| pins.prepare())?;
        }
        Ok(())
    }

    /// A claimed shell ([`FlowContext::claimed`]) has its IPC and UTS
    /// namespaces pinned already: a pod without an infra process gets its
    /// hostname set in them; a pod with one has them removed first (its
    /// pause process makes its own, and teardown reads a pin directory as
    /// "no pause container").
    async fn create(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let id = ctx.sandbox_id().as_str();
        let (handler, config) = self.runtime.handler(&ctx.spec().runtime_handler)?;
        let infra = self.needs_infra(ctx.spec(), config);
        let handler = handler.to_owned();
        let shell = ctx
            .get::<SandboxProcess>()
            .filter(|p| ctx.claimed() && p.pins_dir.is_some());
        if let (Some(shell), Some(pins)) = (shell, &self.pins) {
            let spec = ctx.spec();
            if !infra && pins_fit(&shell, spec) {
                pins.set_hostname(ctx.sandbox_id(), spec.effective_hostname())
                    .await?;
                ctx.publish(SandboxProcess {
                    runtime_handler: handler,
                    ..shell
                });
                return Ok(());
            }
            // The shell's keeper has the id the pause container takes.
            if let Some(dir) = &shell.pins_dir {
                let dir = dir.clone();
                if cubelet_engine::blocking(|| anchor::marked(&dir)) {
                    self.runtime.remove(id).await?;
                }
            }
            pins.remove(ctx.sandbox_id()).await?;
            ctx.take::<SandboxProcess>();
        }
        if let (false, Some(pins)) = (infra, &self.pins) {
            return self.create_pinned(ctx, pins, handler).await;
        }
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

    /// Pins go by unmounting them. The pause process has nothing to flush:
    /// `remove` kills it outright (`SIGKILL`) and takes its rootfs, record
    /// and FIFOs with it.
    ///
    /// A sandbox with pins and a stats anchor ([`anchor`]) loses the anchor
    /// container first (its marker is in the pin directory), then the pins.
    async fn destroy(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let id = ctx.sandbox_id();
        if let Some(pins) = &self.pins {
            let dir = pins.sandbox_dir(id);
            if cubelet_engine::blocking(|| anchor::marked(&dir)) {
                self.runtime.remove(id.as_str()).await?;
            }
            if pins.remove(id).await? {
                // Made without an infra process: there is no other container.
                return Ok(());
            }
        }
        Ok(self.runtime.remove(id.as_str()).await?)
    }

    async fn cleanup(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.destroy(ctx).await
    }

    /// A claimed shell's `create` only sets the pod's hostname in the
    /// shell's pinned UTS namespace when the pod goes without an infra
    /// process; one with a pause container is not confined.
    fn confined_to_shell(&self, ctx: &FlowContext) -> bool {
        let Ok((_, config)) = self.runtime.handler(&ctx.spec().runtime_handler) else {
            return false;
        };
        self.pins.is_some()
            && ctx.claimed()
            && !self.needs_infra(ctx.spec(), config)
            && ctx
                .get::<SandboxProcess>()
                .is_some_and(|p| p.pins_dir.is_some() && pins_fit(&p, ctx.spec()))
    }

    /// A shell's IPC and UTS namespaces, pinned, when pods may go without
    /// an infra process (`runtime.sandbox: auto`); in `pause` mode every
    /// pod's pause process makes its own, so a shell has none. The
    /// hostname is a placeholder until a pod claims the shell.
    async fn prewarm(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let Some(pins) = self
            .pins
            .as_ref()
            .filter(|_| self.mode == SandboxMode::Auto)
        else {
            return Ok(());
        };
        let req = PinRequest {
            ipc: true,
            hostname: Some(SHELL_HOSTNAME.to_owned()),
        };
        let pinned = pins.create(ctx.sandbox_id(), &req).await?;
        let process = SandboxProcess {
            pid: None,
            runtime_handler: String::new(),
            ipc_path: pinned.ipc,
            uts_path: pinned.uts,
            pins_dir: Some(pinned.dir),
        };
        ctx.publish(process.clone());
        let netns = ctx.get::<NetworkStatus>().and_then(|n| n.netns_path);
        if let (true, Some(netns)) = (self.shell_shims, netns) {
            self.start_keeper(ctx.sandbox_id().as_str(), &process, &netns)
                .await?;
        }
        Ok(())
    }
}

impl SandboxProvider {
    /// Starts shell `id`'s keeper (see [`SandboxProvider::with_shell_shims`]):
    /// the marker first, so that the shell's teardown (the prewarm's
    /// rollback on failure, a later destroy, the GC after a crash) removes
    /// whatever of it was made.
    async fn start_keeper(
        &self,
        id: &str,
        process: &SandboxProcess,
        netns: &std::path::Path,
    ) -> Result<(), StepError> {
        let Some(dir) = process.pins_dir.clone() else {
            return Ok(());
        };
        if !cubelet_engine::blocking(|| anchor::write_marker(&dir))? {
            return Ok(());
        }
        let image = self.pause.pause_image().await?;
        let spec = anchor::keeper_spec(
            id,
            process,
            netns,
            self.pause.reference(),
            image,
            SHELL_HOSTNAME,
        )?;
        self.runtime.create(id, &spec).await?;
        let pid = self.runtime.start(id).await?;
        tracing::debug!(sandbox = id, pid, "shell keeper started, its shim ready");
        Ok(())
    }
}

/// The hostname of a warm-pool shell's UTS namespace until a pod claims it.
pub const SHELL_HOSTNAME: &str = "cubelet-shell";

#[cfg(test)]
mod tests {
    use super::*;
    use cubelet_engine::spec::{NamespaceOptions, UserNamespace};

    #[test]
    fn only_pods_that_need_a_process_get_a_pause_container() {
        let runc = HandlerConfig::default();
        let own_pid = SandboxSpec {
            namespaces: NamespaceOptions {
                pid: NamespaceMode::Container,
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(!infra_needed(SandboxMode::Auto, &own_pid, &runc));
        let node_pid = SandboxSpec {
            namespaces: NamespaceOptions {
                pid: NamespaceMode::Node,
                network: NamespaceMode::Node,
                ipc: NamespaceMode::Node,
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(!infra_needed(SandboxMode::Auto, &node_pid, &runc));
        // A pod-level PID namespace (CRI's zero value) needs its init.
        assert!(infra_needed(
            SandboxMode::Auto,
            &SandboxSpec::default(),
            &runc
        ));
        // A user namespace of its own: the pause path.
        let mut userns = own_pid.clone();
        userns.namespaces.userns = Some(UserNamespace::default());
        assert!(infra_needed(SandboxMode::Auto, &userns, &runc));
        // Another runtime type: the pause path.
        let vm = HandlerConfig {
            runtime_type: "io.containerd.kata.v2".into(),
            ..Default::default()
        };
        assert!(infra_needed(SandboxMode::Auto, &own_pid, &vm));
        // Pause mode: always.
        assert!(infra_needed(SandboxMode::Pause, &own_pid, &runc));
    }
}
