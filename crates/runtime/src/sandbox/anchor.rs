//! The stats anchor of a pod without an infra process.
//!
//! A kubelet with its default stats provider takes a pod's network from
//! the cAdvisor inside it, which reads it only from a containerd container
//! whose id is the sandbox id, labelled `io.cri-containerd.kind=sandbox`
//! with the pod's labels, whose cgroup is named by that id, and whose task
//! has a pid in the pod's network namespace (`/proc/<pid>/net/dev`). A pod
//! whose namespaces are pinned ([`crate::sandbox::podns`]) has no such
//! container, so its `/stats/summary` entry has no `network`.
//!
//! The anchor is that container, made late and off every path a pod waits
//! on: the pause binary, with the sandbox id, joining the pod's pinned
//! network, IPC and UTS namespaces (in a PID namespace of its own), started
//! after the pod's first container has started. The pod never depends on
//! it: readiness is still its pins, nothing joins the anchor's namespaces,
//! and its exit is not the pod's. It joins the shim of a running container
//! of the pod ([`SHIM_GROUP_ANNOTATION`]), which then serves it until it is
//! removed, whatever becomes of that container. Before the container is
//! created a marker
//! file is written in the pod's pin directory ([`ANCHOR_MARKER`]), so
//! teardown (which reads that directory first) knows there is a containerd
//! container to remove too, also after a kill in the middle of making it.

use std::path::Path;
use std::sync::Arc;

use cubelet_engine::spec::{NamespaceMode, SandboxProcess};
use cubelet_engine::SandboxSpec;

use crate::container::{ContainerRuntime, ContainerState};
use crate::error::RuntimeError;
use crate::sandbox::{PauseImageSource, INFRA_OOM_SCORE_ADJ};
use crate::spec::{
    ContainerKind, ContainerNamespaces, ContainerSpec, PodNamespacePaths, Resources, SeccompProfile,
};
use crate::types::ImageInfo;

/// The file in a pod's pin directory that says a stats anchor was (or is
/// being) made for it.
pub const ANCHOR_MARKER: &str = "stats-anchor";

/// The OCI annotation by which containerd's runc shim (v2) starts a task in
/// the shim of another (`containerd-shim-runc-v2 start` reads it from the
/// new task's spec and answers the running shim's address), as containerd's
/// CRI runs a pod's containers in its sandbox's shim.
pub const SHIM_GROUP_ANNOTATION: &str = "io.containerd.runc.v2.group";

/// The label of a warm-pool shell's keeper ([`keeper_spec`]): a pause
/// container with the shell's id that holds the shell's shim until a pod's
/// stats anchor replaces it.
pub const KEEPER_LABEL: &str = "io.cubelet.sandbox/keeper";

/// Whether the pin directory `pins_dir` says its pod has (or may have) a
/// stats anchor (or, for a shell, a keeper).
pub fn marked(pins_dir: &Path) -> bool {
    pins_dir.join(ANCHOR_MARKER).exists()
}

/// What [`StatsAnchor::ensure`] found or did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnchorOutcome {
    /// The anchor was already running.
    Running,
    /// It was started now, with this host pid.
    Started(u32),
    /// The pod has an infra process (which is its own anchor) or its pins
    /// are gone (it is being torn down): nothing to do.
    NotNeeded,
}

/// Starts stats anchors: pause containers joining a pinned pod's
/// namespaces.
#[derive(Debug, Clone)]
pub struct StatsAnchor {
    runtime: Arc<ContainerRuntime>,
    pause: Arc<dyn PauseImageSource>,
}

impl StatsAnchor {
    /// Anchors run `pause`'s image on `runtime`.
    pub fn new(runtime: Arc<ContainerRuntime>, pause: Arc<dyn PauseImageSource>) -> Self {
        Self { runtime, pause }
    }

    /// Makes sure sandbox `id` (created from `spec`, its namespaces
    /// `process`, its netns pinned at `netns`) has a running anchor: one
    /// already running is kept; one that is not running is replaced. On
    /// failure nothing but the marker is left (teardown removes it).
    ///
    /// `group` names a running container of the pod whose shim the anchor
    /// joins (the runc shim's [`SHIM_GROUP_ANNOTATION`]), so it costs no
    /// shim of its own; without one (or with that shim gone) it gets one.
    pub async fn ensure(
        &self,
        id: &str,
        spec: &SandboxSpec,
        process: &SandboxProcess,
        netns: Option<&Path>,
        group: Option<&str>,
    ) -> Result<AnchorOutcome, RuntimeError> {
        let Some(pins_dir) = process.pins_dir.clone().filter(|_| process.is_infraless()) else {
            return Ok(AnchorOutcome::NotNeeded);
        };
        match self.runtime.status(id).await {
            // A shell's keeper holds the pod's shim but is no anchor (no
            // labels of the pod, not in its cgroup): replaced.
            Ok(s) if s.state == ContainerState::Running && !s.labels.contains_key(KEEPER_LABEL) => {
                return Ok(AnchorOutcome::Running)
            }
            Ok(_) => self.runtime.remove(id).await?,
            Err(RuntimeError::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
        // The marker first: a pod whose pins are gone is being torn down
        // (creating it fails then), and a teardown after this point, or
        // after a kill, finds it.
        if !cubelet_engine::blocking(|| write_marker(&pins_dir))? {
            return Ok(AnchorOutcome::NotNeeded);
        }
        let image = self.pause.pause_image().await?;
        let mut container = anchor_spec(spec, process, netns, self.pause.reference(), image)?;
        if let Some(group) = group {
            container
                .annotations
                .insert(SHIM_GROUP_ANNOTATION.to_owned(), group.to_owned());
        }
        self.runtime.create(id, &container).await?;
        match self.runtime.start(id).await {
            Ok(pid) => Ok(AnchorOutcome::Started(pid)),
            Err(e) => {
                if let Err(undo) = self.runtime.remove(id).await {
                    tracing::warn!(sandbox = id, error = %undo, "removing the failed stats anchor failed");
                }
                Err(e)
            }
        }
    }
}

/// Writes the marker in `pins_dir`; false when the directory is gone.
pub(crate) fn write_marker(pins_dir: &Path) -> Result<bool, RuntimeError> {
    let marker = pins_dir.join(ANCHOR_MARKER);
    match std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&marker)
    {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(RuntimeError::Io {
            op: "create",
            path: marker.display().to_string(),
            source,
        }),
    }
}

/// The anchor's container spec: the infra container's (image, command,
/// labels, `io.cri-containerd.kind=sandbox`, cgroup parent, OOM score,
/// read-only rootfs, no capabilities beyond the default), joining the
/// pod's pinned namespaces, in a PID namespace of its own (or the node's
/// when the pod uses it).
pub fn anchor_spec(
    spec: &SandboxSpec,
    process: &SandboxProcess,
    netns: Option<&Path>,
    image_ref: String,
    image: ImageInfo,
) -> Result<ContainerSpec, RuntimeError> {
    let mut options = spec.namespaces.clone();
    if options.pid != NamespaceMode::Node {
        options.pid = NamespaceMode::Container;
    }
    options.userns = None;
    let namespaces = ContainerNamespaces::for_pod_container(
        &options,
        &PodNamespacePaths::of_sandbox(process, netns),
        None,
    )?;
    let mut labels = spec.labels.clone();
    labels.insert("io.cubelet.sandbox/uid".to_owned(), spec.uid.clone());
    Ok(ContainerSpec {
        labels,
        annotations: spec.annotations.clone(),
        cgroup_parent: spec.cgroup_parent.clone(),
        hostname: spec.effective_hostname().to_owned(),
        runtime_handler: spec.runtime_handler.clone(),
        ..pause_spec(
            format!("{}_{}_stats", spec.namespace, spec.name),
            image_ref,
            image,
            namespaces,
        )
    })
}

/// What every pause-binary container of Cubelet's (a stats anchor, a
/// shell's keeper) has: `/pause` on a read-only rootfs with no new
/// privileges, the default seccomp profile and capabilities, the infra
/// container's OOM score, kind `sandbox`, in `namespaces`.
fn pause_spec(
    name: String,
    image_ref: String,
    image: ImageInfo,
    namespaces: ContainerNamespaces,
) -> ContainerSpec {
    ContainerSpec {
        name,
        image_ref,
        image,
        command: vec!["/pause".to_owned()],
        capabilities_drop: Vec::new(),
        privileged: false,
        readonly_rootfs: true,
        no_new_privs: true,
        seccomp: SeccompProfile::RuntimeDefault,
        resources: Resources {
            oom_score_adj: INFRA_OOM_SCORE_ADJ,
            ..Default::default()
        },
        kind: ContainerKind::Sandbox,
        namespaces,
        ..Default::default()
    }
}

/// The container spec of a warm-pool shell's keeper: the pause binary, with
/// the shell's id, in the shell's network namespace and its pinned IPC and
/// UTS namespaces, in a PID
/// namespace of its own, on the default handler, labelled
/// [`KEEPER_LABEL`] and nothing of a pod's (no pod has the shell yet), in
/// no pod's cgroup: the default parent (`/cubelet`, or `system.slice`
/// under systemd). Its task starts the runc shim the shell's pod will run
/// its containers in ([`SHIM_GROUP_ANNOTATION`], the shell's id).
pub fn keeper_spec(
    id: &str,
    process: &SandboxProcess,
    netns: &Path,
    image_ref: String,
    image: ImageInfo,
    hostname: &str,
) -> Result<ContainerSpec, RuntimeError> {
    let options = cubelet_engine::spec::NamespaceOptions {
        pid: NamespaceMode::Container,
        ..Default::default()
    };
    let namespaces = ContainerNamespaces::for_pod_container(
        &options,
        &PodNamespacePaths::of_sandbox(process, Some(netns)),
        None,
    )?;
    Ok(ContainerSpec {
        labels: [(KEEPER_LABEL.to_owned(), "true".to_owned())].into(),
        annotations: [(SHIM_GROUP_ANNOTATION.to_owned(), id.to_owned())].into(),
        cgroup_parent: None,
        hostname: hostname.to_owned(),
        ..pause_spec(format!("shell_{id}_keeper"), image_ref, image, namespaces)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::NamespaceJoin;
    use cubelet_engine::spec::NamespaceOptions;

    fn pinned() -> SandboxProcess {
        SandboxProcess {
            pid: None,
            runtime_handler: "runc".into(),
            ipc_path: Some("/state/podns/x/ipc".into()),
            uts_path: Some("/state/podns/x/uts".into()),
            pins_dir: Some("/state/podns/x".into()),
        }
    }

    #[test]
    fn the_anchor_joins_the_pins_and_is_labelled_as_the_sandbox() {
        let mut spec = SandboxSpec {
            name: "web".into(),
            namespace: "default".into(),
            uid: "u1".into(),
            namespaces: NamespaceOptions {
                pid: NamespaceMode::Container,
                ..Default::default()
            },
            cgroup_parent: Some("/kubepods/podu1".into()),
            ..Default::default()
        };
        spec.labels
            .insert("io.kubernetes.pod.name".into(), "web".into());
        let c = anchor_spec(
            &spec,
            &pinned(),
            Some(Path::new("/run/netns/x")),
            "cubelet.local/pause:1".into(),
            ImageInfo::default(),
        )
        .unwrap();
        assert_eq!(c.kind, ContainerKind::Sandbox);
        assert_eq!(c.labels["io.kubernetes.pod.name"], "web");
        assert_eq!(c.labels["io.cubelet.sandbox/uid"], "u1");
        assert_eq!(c.cgroup_parent.as_deref(), Some("/kubepods/podu1"));
        assert_eq!(
            c.namespaces.network,
            NamespaceJoin::Path("/run/netns/x".into())
        );
        assert_eq!(
            c.namespaces.ipc,
            NamespaceJoin::Path("/state/podns/x/ipc".into())
        );
        assert_eq!(
            c.namespaces.uts,
            NamespaceJoin::Path("/state/podns/x/uts".into())
        );
        assert_eq!(c.namespaces.pid, NamespaceJoin::New);
        assert!(c.namespaces.user.is_none());
        assert_eq!(c.command, vec!["/pause".to_owned()]);
    }

    #[test]
    fn a_host_network_pod_anchor_is_on_the_node_network() {
        let spec = SandboxSpec {
            namespaces: NamespaceOptions {
                pid: NamespaceMode::Node,
                network: NamespaceMode::Node,
                ipc: NamespaceMode::Node,
                ..Default::default()
            },
            ..Default::default()
        };
        let process = SandboxProcess {
            ipc_path: None,
            uts_path: None,
            ..pinned()
        };
        let c = anchor_spec(&spec, &process, None, String::new(), ImageInfo::default()).unwrap();
        assert_eq!(c.namespaces.network, NamespaceJoin::Host);
        assert_eq!(c.namespaces.ipc, NamespaceJoin::Host);
        assert_eq!(c.namespaces.uts, NamespaceJoin::Host);
        assert_eq!(c.namespaces.pid, NamespaceJoin::Host);
    }

    #[test]
    fn the_marker_is_not_written_once_the_pins_are_gone() {
        let dir = tempfile::tempdir().unwrap();
        let pins = dir.path().join("x");
        assert!(!write_marker(&pins).unwrap());
        std::fs::create_dir(&pins).unwrap();
        assert!(!marked(&pins));
        assert!(write_marker(&pins).unwrap());
        assert!(marked(&pins));
    }
}
