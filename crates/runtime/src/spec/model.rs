//! The container model: [`ContainerSpec`] and its parts, and the process
//! arguments, environment and working directory after image defaults.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::user::{parse_user, ResolvedUser, UserRequest};
use crate::error::RuntimeError;
use crate::types::ImageInfo;

/// `PATH` given to containers whose image sets none (as containerd does).
pub const DEFAULT_PATH_ENV: &str =
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Seccomp choice (CRI `SecurityProfile`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SeccompProfile {
    /// No filter.
    #[default]
    Unconfined,
    /// Cubelet's default: allow all but [`RUNTIME_DEFAULT_DENIED_SYSCALLS`](super::RUNTIME_DEFAULT_DENIED_SYSCALLS).
    RuntimeDefault,
    /// An OCI `LinuxSeccomp` JSON file on the node.
    Localhost(PathBuf),
}

/// Mount propagation of a bind mount.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Propagation {
    /// `rprivate`.
    #[default]
    Private,
    /// `rslave`.
    HostToContainer,
    /// `rshared`.
    Bidirectional,
}

/// A bind mount from the node into the container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountSpec {
    /// Path on the node.
    pub host_path: PathBuf,
    /// Path in the container.
    pub container_path: PathBuf,
    /// Read-only.
    pub readonly: bool,
    /// Propagation.
    pub propagation: Propagation,
    /// Read-only all the way down: every mount below `host_path` too (CRI
    /// `recursive_read_only`; needs `readonly` and private propagation).
    #[serde(default)]
    pub recursive_readonly: bool,
    /// Owners seen through the pod's user namespace (kubelet sends the
    /// pod's mappings as the mount's): an idmapped mount when the container
    /// has a user namespace, a plain bind otherwise.
    #[serde(default)]
    pub idmapped: bool,
}

/// A device node exposed to the container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSpec {
    /// Device on the node.
    pub host_path: PathBuf,
    /// Path in the container.
    pub container_path: PathBuf,
    /// cgroup permissions, `rwm` subset (empty means `rwm`).
    pub permissions: String,
}

/// What a containerd container is to the pod, as its
/// `io.cri-containerd.kind` label says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ContainerKind {
    /// A container of the pod.
    #[default]
    Container,
    /// The pod's infra (pause) container, which holds its network namespace.
    Sandbox,
}

impl ContainerKind {
    /// The label's value, as containerd's CRI plugin writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            ContainerKind::Container => "container",
            ContainerKind::Sandbox => "sandbox",
        }
    }
}

/// A hugepage limit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HugepageLimit {
    /// Page size as the kernel names it (`2MB`, `1GB`).
    pub page_size: String,
    /// Limit in bytes.
    pub limit: u64,
}

/// Resource limits (CRI `LinuxContainerResources`); zero/empty means unset.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    /// CPU shares.
    pub cpu_shares: u64,
    /// CFS quota in microseconds (0 = unset, -1 = unlimited).
    pub cpu_quota: i64,
    /// CFS period in microseconds.
    pub cpu_period: u64,
    /// CPU set.
    pub cpuset_cpus: String,
    /// Memory nodes.
    pub cpuset_mems: String,
    /// Memory limit in bytes.
    pub memory_limit: i64,
    /// Memory plus swap limit in bytes (0 = unset, -1 = unlimited).
    #[serde(default)]
    pub memory_swap_limit: i64,
    /// Hugepage limits.
    pub hugepages: Vec<HugepageLimit>,
    /// Requested `oom_score_adj` (before clamping).
    pub oom_score_adj: i32,
    /// cgroup v2 files to write (`memory.high`, ...), as CRI `unified`.
    #[serde(default)]
    pub unified: BTreeMap<String, String>,
}

/// How the container gets one namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum NamespaceJoin {
    /// A fresh namespace of its own.
    #[default]
    New,
    /// The node's namespace (no namespace entry in the spec).
    Host,
    /// Join the namespace at this path (`/proc/<pid>/ns/ipc`, a pinned netns).
    Path(PathBuf),
}

/// Namespaces of the container process.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerNamespaces {
    /// Network.
    pub network: NamespaceJoin,
    /// IPC.
    pub ipc: NamespaceJoin,
    /// UTS.
    pub uts: NamespaceJoin,
    /// PID.
    pub pid: NamespaceJoin,
    /// The pod's user namespace; `None` is the node's.
    #[serde(default)]
    pub user: Option<UserNamespaceJoin>,
}

/// A user namespace a container runs in, with its mappings (runc 1.1 needs
/// them also to join one by path).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserNamespaceJoin {
    /// The namespace to join; `None` makes a new one.
    pub path: Option<PathBuf>,
    /// Its uid and gid mappings.
    pub mapping: cubelet_engine::spec::UserNamespace,
}

/// Which groups a container's process gets besides its primary one (CRI
/// `SupplementalGroupsPolicy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SupplementalGroupsPolicy {
    /// The groups the image's `/etc/group` gives the user, plus the
    /// requested supplemental groups.
    #[default]
    Merge,
    /// Only the requested supplemental groups (and the primary group).
    Strict,
}

impl ContainerNamespaces {
    /// The namespaces of the pod infra (pause) process itself: its own IPC,
    /// UTS and PID namespaces unless the pod uses the node's; the network
    /// namespace pinned by the network step, or the node's.
    pub fn for_infra(
        options: &cubelet_engine::spec::NamespaceOptions,
        netns_path: Option<&Path>,
    ) -> Self {
        use cubelet_engine::spec::NamespaceMode;
        let host_net = options.network == NamespaceMode::Node;
        Self {
            network: match (host_net, netns_path) {
                (true, _) | (false, None) => NamespaceJoin::Host,
                (false, Some(p)) => NamespaceJoin::Path(p.to_path_buf()),
            },
            ipc: if options.ipc == NamespaceMode::Node {
                NamespaceJoin::Host
            } else {
                NamespaceJoin::New
            },
            uts: if host_net {
                NamespaceJoin::Host
            } else {
                NamespaceJoin::New
            },
            pid: if options.pid == NamespaceMode::Node {
                NamespaceJoin::Host
            } else {
                NamespaceJoin::New
            },
            user: None,
        }
    }

    /// These namespaces in the pod's user namespace, when it has one:
    /// `userns_path` is the pin the network step made (a new namespace is
    /// made without one).
    pub fn in_userns(
        self,
        options: &cubelet_engine::spec::NamespaceOptions,
        userns_path: Option<&Path>,
    ) -> Self {
        Self {
            user: options.userns.map(|mapping| UserNamespaceJoin {
                path: userns_path.map(Path::to_path_buf),
                mapping,
            }),
            ..self
        }
    }

    /// The namespaces of an application container of a pod whose shared
    /// namespaces are at `pod`: network, IPC and UTS are the pod's (or the
    /// node's); PID is the pod's for `Pod`, its own for `Container`, the
    /// node's for `Node` and the target's (`target_pid`) for `Target`. A
    /// namespace the container must share that the pod does not have is
    /// `FailedPrecondition` (a pod-level PID namespace asked of a sandbox
    /// without an infra process, above all).
    pub fn for_pod_container(
        options: &cubelet_engine::spec::NamespaceOptions,
        pod: &PodNamespacePaths,
        target_pid: Option<u32>,
    ) -> Result<Self, RuntimeError> {
        use cubelet_engine::spec::NamespaceMode;
        let join = |path: &Option<PathBuf>, what: &str| match path {
            Some(p) => Ok(NamespaceJoin::Path(p.clone())),
            None => Err(RuntimeError::FailedPrecondition(format!(
                "the container shares the pod's {what} namespace, but the pod sandbox has none"
            ))),
        };
        let host_net = options.network == NamespaceMode::Node;
        Ok(Self {
            network: if host_net {
                NamespaceJoin::Host
            } else {
                join(&pod.network, "network")?
            },
            ipc: if options.ipc == NamespaceMode::Node {
                NamespaceJoin::Host
            } else {
                join(&pod.ipc, "IPC")?
            },
            uts: if host_net {
                NamespaceJoin::Host
            } else {
                join(&pod.uts, "UTS")?
            },
            user: match options.userns {
                None => None,
                Some(mapping) => Some(UserNamespaceJoin {
                    path: Some(pod.user.clone().ok_or_else(|| {
                        RuntimeError::FailedPrecondition(
                            "the pod has a user namespace, but its sandbox has none to join"
                                .to_owned(),
                        )
                    })?),
                    mapping,
                }),
            },
            pid: match options.pid {
                NamespaceMode::Pod => match &pod.pid {
                    Some(p) => NamespaceJoin::Path(p.clone()),
                    None => {
                        return Err(RuntimeError::FailedPrecondition(
                            "a pod-level PID namespace is asked for, but the pod sandbox was \
                             not created with one and has no infra process"
                                .to_owned(),
                        ))
                    }
                },
                NamespaceMode::Container => NamespaceJoin::New,
                NamespaceMode::Node => NamespaceJoin::Host,
                NamespaceMode::Target => match target_pid {
                    Some(pid) => NamespaceJoin::Path(format!("/proc/{pid}/ns/pid").into()),
                    None => NamespaceJoin::New,
                },
            },
        })
    }
}

/// Where a pod's shared namespaces are, for its containers to join.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodNamespacePaths {
    /// Network namespace; `None` when the pod has none of its own.
    pub network: Option<PathBuf>,
    /// IPC namespace.
    pub ipc: Option<PathBuf>,
    /// UTS namespace.
    pub uts: Option<PathBuf>,
    /// PID namespace; only a pod with an infra process has one.
    pub pid: Option<PathBuf>,
    /// User namespace (of a pod that has one of its own); only a pod with
    /// an infra process has one to join.
    pub user: Option<PathBuf>,
}

impl PodNamespacePaths {
    /// The namespaces of the pod's infra process `pid`: `/proc/<pid>/ns/*`.
    pub fn of_infra(pid: u32) -> Self {
        let ns = |name: &str| Some(PathBuf::from(format!("/proc/{pid}/ns/{name}")));
        Self {
            network: ns("net"),
            ipc: ns("ipc"),
            uts: ns("uts"),
            pid: ns("pid"),
            user: ns("user"),
        }
    }

    /// The namespaces of a sandbox as its step published them: the infra
    /// process's, or the pins of a sandbox without one (with the network
    /// step's netns pin, `netns`).
    pub fn of_sandbox(
        process: &cubelet_engine::spec::SandboxProcess,
        netns: Option<&Path>,
    ) -> Self {
        match process.pid {
            Some(pid) => Self::of_infra(pid),
            None => Self {
                network: netns.map(Path::to_path_buf),
                ipc: process.ipc_path.clone(),
                uts: process.uts_path.clone(),
                pid: None,
                user: None,
            },
        }
    }
}

/// Everything needed to create a container, free of CRI and containerd types.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerSpec {
    /// Container name (metadata), for labels and logs.
    pub name: String,
    /// Image reference as requested.
    pub image_ref: String,
    /// The image: chain id (rootfs parent) and config (defaults).
    pub image: ImageInfo,
    /// CRI `command` (overrides the image entrypoint when non-empty).
    pub command: Vec<String>,
    /// CRI `args` (overrides the image cmd when non-empty).
    pub args: Vec<String>,
    /// Environment from the request; wins over the image's.
    pub env: Vec<(String, String)>,
    /// Working directory; empty means the image's, else `/`.
    pub working_dir: String,
    /// Requested user.
    pub user: UserRequest,
    /// Supplemental groups to add.
    pub supplemental_groups: Vec<u32>,
    /// Whether the image's groups for the user are added too.
    #[serde(default)]
    pub supplemental_groups_policy: SupplementalGroupsPolicy,
    /// Capabilities to add (`CAP_X` or `X`, or `ALL`).
    pub capabilities_add: Vec<String>,
    /// Capabilities to drop (`CAP_X` or `X`, or `ALL`).
    pub capabilities_drop: Vec<String>,
    /// Privileged container.
    pub privileged: bool,
    /// Read-only root filesystem.
    pub readonly_rootfs: bool,
    /// Set `no_new_privileges`.
    pub no_new_privs: bool,
    /// Masked paths; `None` means the defaults.
    pub masked_paths: Option<Vec<String>>,
    /// Read-only paths; `None` means the defaults.
    pub readonly_paths: Option<Vec<String>>,
    /// Seccomp.
    pub seccomp: SeccompProfile,
    /// Devices.
    pub devices: Vec<DeviceSpec>,
    /// Bind mounts requested by the pod.
    pub mounts: Vec<MountSpec>,
    /// The sandbox's `/etc/hostname`, `/etc/hosts`, `/etc/resolv.conf`, `/dev/shm`.
    pub sandbox_files: Option<cubelet_engine::spec::StorageStatus>,
    /// Resources.
    pub resources: Resources,
    /// Namespaced sysctls.
    pub sysctls: BTreeMap<String, String>,
    /// Allocate a terminal.
    pub tty: bool,
    /// Keep stdin open.
    pub stdin: bool,
    /// Signal that stops the container (`SIGUSR1`, ...), from CRI's
    /// `ContainerConfig.stop_signal`; `None` means the image's, else SIGTERM.
    #[serde(default)]
    pub stop_signal: Option<String>,
    /// Close stdin after the first attach ends.
    pub stdin_once: bool,
    /// The pod's infra container or one of its containers.
    #[serde(default)]
    pub kind: ContainerKind,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Annotations (copied into the OCI spec).
    pub annotations: BTreeMap<String, String>,
    /// CRI log file; `None` discards output.
    pub log_path: Option<PathBuf>,
    /// Cgroup parent (cgroupfs path); `None` uses `/cubelet`.
    pub cgroup_parent: Option<String>,
    /// Namespaces to join.
    pub namespaces: ContainerNamespaces,
    /// Hostname (only applied with a new UTS namespace).
    pub hostname: String,
    /// Runtime handler name; empty means the configured default.
    pub runtime_handler: String,
}

/// Values that come from the node rather than from the request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecOptions {
    /// When set, requested `oom_score_adj` values below it are raised to it
    /// (the agent's own score: without `CAP_SYS_RESOURCE` a lower one fails).
    pub min_oom_score_adj: Option<i32>,
    /// Resolved user; `None` means root unless the request gave ids.
    pub user: Option<ResolvedUser>,
    /// How `linux.cgroupsPath` is written ([`crate::cgroup`]).
    pub cgroup_driver: crate::cgroup::CgroupDriver,
}

impl ContainerSpec {
    /// The signal the container is stopped with: the requested one, else
    /// the image's; `None` when neither names one (SIGTERM is then sent).
    pub fn effective_stop_signal(&self) -> Option<&str> {
        let named = |s: &&str| !s.is_empty();
        self.stop_signal
            .as_deref()
            .filter(named)
            .or_else(|| Some(self.image.config.stop_signal.as_str()).filter(named))
    }

    /// The process arguments after CRI/Docker defaulting: `command` replaces
    /// the image entrypoint, and then the image cmd is ignored; `args`
    /// replace the image cmd.
    pub fn process_args(&self) -> Vec<String> {
        let cfg = &self.image.config;
        let (entrypoint, cmd) = if !self.command.is_empty() {
            (self.command.clone(), self.args.clone())
        } else if !self.args.is_empty() {
            (cfg.entrypoint.clone(), self.args.clone())
        } else {
            (cfg.entrypoint.clone(), cfg.cmd.clone())
        };
        entrypoint.into_iter().chain(cmd).collect()
    }

    /// The environment: `HOSTNAME` (the pod's hostname, or the node's for
    /// a container in the node's UTS namespace, as containerd gives it),
    /// overlaid by the image env, overlaid by the request, keys kept in
    /// first-seen order; `PATH` defaulted when none sets it.
    pub fn process_env(&self) -> Vec<String> {
        let mut order: Vec<String> = Vec::new();
        let mut values: HashMap<String, String> = HashMap::new();
        let hostname = match self.namespaces.uts {
            NamespaceJoin::Host => std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_default(),
            _ => self.hostname.clone(),
        };
        let hostname = (!hostname.is_empty()).then(|| ("HOSTNAME".to_owned(), hostname));
        let image = self
            .image
            .config
            .env
            .iter()
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) => (k.to_owned(), v.to_owned()),
                None => (kv.clone(), String::new()),
            });
        for (k, v) in hostname
            .into_iter()
            .chain(image)
            .chain(self.env.iter().cloned())
        {
            if !values.contains_key(&k) {
                order.push(k.clone());
            }
            values.insert(k, v);
        }
        if !values.contains_key("PATH") {
            order.insert(0, "PATH".to_owned());
            values.insert(
                "PATH".to_owned(),
                DEFAULT_PATH_ENV["PATH=".len()..].to_owned(),
            );
        }
        order
            .into_iter()
            .map(|k| format!("{k}={}", values.get(&k).map_or("", String::as_str)))
            .collect()
    }

    /// The working directory: the request's, else the image's, else `/`.
    pub fn process_cwd(&self) -> String {
        if !self.working_dir.is_empty() {
            self.working_dir.clone()
        } else if !self.image.config.working_dir.is_empty() {
            self.image.config.working_dir.clone()
        } else {
            "/".to_owned()
        }
    }

    /// The user to resolve: the request's, else the image's `User`.
    pub fn effective_user(&self) -> Result<UserRequest, RuntimeError> {
        match &self.user {
            UserRequest::Image => parse_user(&self.image.config.user),
            other => Ok(other.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::test_support::{image, strs};

    #[test]
    fn requested_stop_signal_wins_over_the_image_s() {
        let mut s = ContainerSpec::default();
        assert_eq!(s.effective_stop_signal(), None);
        std::sync::Arc::make_mut(&mut s.image.config).stop_signal = "SIGQUIT".into();
        assert_eq!(s.effective_stop_signal(), Some("SIGQUIT"));
        s.stop_signal = Some("SIGUSR1".into());
        assert_eq!(s.effective_stop_signal(), Some("SIGUSR1"));
    }

    #[test]
    fn args_follow_cri_defaulting() {
        let mut s = ContainerSpec {
            image: image(&["/ep"], &["c1", "c2"], &[]),
            ..Default::default()
        };
        assert_eq!(s.process_args(), strs(&["/ep", "c1", "c2"]));
        s.args = strs(&["a"]);
        assert_eq!(s.process_args(), strs(&["/ep", "a"]));
        s.command = strs(&["/cmd"]);
        assert_eq!(s.process_args(), strs(&["/cmd", "a"]));
        s.args.clear();
        // A command replaces the entrypoint and drops the image cmd.
        assert_eq!(s.process_args(), strs(&["/cmd"]));
    }

    #[test]
    fn env_request_wins_and_path_defaults() {
        let mut s = ContainerSpec {
            image: image(&[], &["x"], &["A=1", "B=2"]),
            env: vec![("B".into(), "3".into()), ("C".into(), "4".into())],
            ..Default::default()
        };
        assert_eq!(
            s.process_env(),
            strs(&[DEFAULT_PATH_ENV, "A=1", "B=3", "C=4"])
        );
        std::sync::Arc::make_mut(&mut s.image.config)
            .env
            .push("PATH=/bin".into());
        assert_eq!(s.process_env(), strs(&["A=1", "B=3", "PATH=/bin", "C=4"]));
    }

    #[test]
    fn hostname_env_is_the_pods_and_yields_to_image_and_request() {
        let mut s = ContainerSpec {
            image: image(&[], &["x"], &["PATH=/bin"]),
            hostname: "web-0".into(),
            ..Default::default()
        };
        assert_eq!(s.process_env(), strs(&["HOSTNAME=web-0", "PATH=/bin"]));
        s.env = vec![("HOSTNAME".into(), "mine".into())];
        assert_eq!(s.process_env(), strs(&["HOSTNAME=mine", "PATH=/bin"]));
        s.env.clear();
        s.namespaces.uts = NamespaceJoin::Host;
        let node = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        assert_eq!(
            s.process_env(),
            strs(&[&format!("HOSTNAME={}", node.trim()), "PATH=/bin"])
        );
    }
}
