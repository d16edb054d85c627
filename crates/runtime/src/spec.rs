//! The runtime-neutral description of a container ([`ContainerSpec`]) and
//! its translation into an OCI runtime spec.
//!
//! The CRI shim converts a CRI `ContainerConfig` into a [`ContainerSpec`];
//! [`build_oci_spec`] turns it into the `config.json` runc runs. Image
//! defaults (entrypoint/cmd, env, working dir, user) are applied here, after
//! the rules of CRI and Docker, so every caller gets the same behaviour.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    Arch, Capabilities, Capability, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder,
    LinuxDevice, LinuxDeviceBuilder, LinuxDeviceCgroup, LinuxDeviceCgroupBuilder, LinuxDeviceType,
    LinuxHugepageLimitBuilder, LinuxMemoryBuilder, LinuxNamespace, LinuxNamespaceBuilder,
    LinuxNamespaceType, LinuxResources, LinuxResourcesBuilder, LinuxSeccomp, LinuxSeccompAction,
    LinuxSeccompBuilder, LinuxSyscallBuilder, Mount, MountBuilder, ProcessBuilder, RootBuilder,
    Spec, SpecBuilder, UserBuilder,
};
use serde::{Deserialize, Serialize};

use crate::error::RuntimeError;
use crate::types::ImageInfo;

/// `PATH` given to containers whose image sets none (as containerd does).
pub const DEFAULT_PATH_ENV: &str =
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Docker's default capability set, granted unless dropped.
pub const DEFAULT_CAPABILITIES: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// Paths masked in unprivileged containers (containerd's defaults).
pub const DEFAULT_MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
];

/// Paths made read-only in unprivileged containers (containerd's defaults).
pub const DEFAULT_READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// Syscalls the `RuntimeDefault` seccomp profile refuses with `EPERM`.
///
/// Cubelet's RuntimeDefault is deliberately small: allow by default, deny the
/// syscalls that no ordinary container needs and that Docker's profile also
/// refuses without extra capabilities (kernel modules, kexec, reboot, swap,
/// accounting, clock changes, keyrings, mounts, new namespaces, BPF, perf).
/// It is not Docker's full allow-list profile; `ptrace` and NUMA calls are
/// left to capabilities.
pub const RUNTIME_DEFAULT_DENIED_SYSCALLS: &[&str] = &[
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "create_module",
    "delete_module",
    "finit_module",
    "get_kernel_syms",
    "init_module",
    "ioperm",
    "iopl",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "nfsservctl",
    "open_by_handle_at",
    "perf_event_open",
    "pivot_root",
    "query_module",
    "quotactl",
    "reboot",
    "request_key",
    "settimeofday",
    "stime",
    "swapoff",
    "swapon",
    "_sysctl",
    "sysfs",
    "umount",
    "umount2",
    "unshare",
    "uselib",
    "userfaultfd",
    "ustat",
    "vm86",
    "vm86old",
];

/// Who the container process runs as, as requested (before image defaults).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum UserRequest {
    /// Nothing requested: the image's `User`, else root.
    #[default]
    Image,
    /// A numeric uid, with an optional gid (else the passwd entry's, else 0).
    Id {
        /// User id.
        uid: u32,
        /// Group id.
        gid: Option<u32>,
    },
    /// A user name resolved from the image's `/etc/passwd`.
    Name {
        /// User name.
        name: String,
        /// Group id override.
        gid: Option<u32>,
    },
}

/// A resolved user.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedUser {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Additional group ids (from `/etc/group` and the request).
    pub additional_gids: Vec<u32>,
}

/// Seccomp choice (CRI `SecurityProfile`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SeccompProfile {
    /// No filter.
    #[default]
    Unconfined,
    /// Cubelet's default: allow all but [`RUNTIME_DEFAULT_DENIED_SYSCALLS`].
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
        }
    }

    /// The namespaces of an application container of a pod whose infra
    /// process is `infra_pid`: network, IPC and UTS are the pod's (or the
    /// node's); PID is the pod's for `Pod`, its own for `Container`, the
    /// node's for `Node` and the target's (`target_pid`) for `Target`.
    pub fn for_pod_container(
        options: &cubelet_engine::spec::NamespaceOptions,
        infra_pid: u32,
        target_pid: Option<u32>,
    ) -> Self {
        use cubelet_engine::spec::NamespaceMode;
        let proc_ns =
            |pid: u32, ns: &str| NamespaceJoin::Path(format!("/proc/{pid}/ns/{ns}").into());
        let host_net = options.network == NamespaceMode::Node;
        Self {
            network: if host_net {
                NamespaceJoin::Host
            } else {
                proc_ns(infra_pid, "net")
            },
            ipc: if options.ipc == NamespaceMode::Node {
                NamespaceJoin::Host
            } else {
                proc_ns(infra_pid, "ipc")
            },
            uts: if host_net {
                NamespaceJoin::Host
            } else {
                proc_ns(infra_pid, "uts")
            },
            pid: match options.pid {
                NamespaceMode::Pod => proc_ns(infra_pid, "pid"),
                NamespaceMode::Container => NamespaceJoin::New,
                NamespaceMode::Node => NamespaceJoin::Host,
                NamespaceMode::Target => match target_pid {
                    Some(pid) => proc_ns(pid, "pid"),
                    None => NamespaceJoin::New,
                },
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
}

impl ContainerSpec {
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

/// Parses an image `User` string: `""`, `uid`, `name`, `uid:gid`, `name:gid`.
/// Group names are not supported (an error names them).
pub fn parse_user(user: &str) -> Result<UserRequest, RuntimeError> {
    if user.is_empty() {
        return Ok(UserRequest::Image);
    }
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let gid = match g {
        None => None,
        Some(g) => Some(
            g.parse::<u32>()
                .map_err(|_| RuntimeError::InvalidArgument {
                    field: "user".to_owned(),
                    reason: format!("group {g:?} in {user:?} is not numeric"),
                })?,
        ),
    };
    Ok(match u.parse::<u32>() {
        Ok(uid) => UserRequest::Id { uid, gid },
        Err(_) => UserRequest::Name {
            name: u.to_owned(),
            gid,
        },
    })
}

/// True when resolving `user` needs the image's `/etc/passwd`.
pub fn user_needs_lookup(user: &UserRequest) -> bool {
    matches!(
        user,
        UserRequest::Name { .. } | UserRequest::Id { gid: None, .. }
    )
}

/// Resolves a user against the contents of `/etc/passwd` and `/etc/group`
/// of the image rootfs (either may be empty when the file is missing).
pub fn resolve_user(
    user: &UserRequest,
    passwd: &str,
    group: &str,
) -> Result<ResolvedUser, RuntimeError> {
    // name:x:uid:gid:gecos:home:shell
    let entries: Vec<(&str, u32, u32)> = passwd
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 4 || l.starts_with('#') {
                return None;
            }
            Some((f[0], f[2].parse().ok()?, f[3].parse().ok()?))
        })
        .collect();
    let (name, uid, gid) = match user {
        UserRequest::Image => (Some("root"), 0, Some(0)),
        UserRequest::Id { uid, gid } => {
            let e = entries.iter().find(|e| e.1 == *uid);
            (e.map(|e| e.0), *uid, gid.or(e.map(|e| e.2)).or(Some(0)))
        }
        UserRequest::Name { name, gid } => {
            let e = entries.iter().find(|e| e.0 == name).ok_or_else(|| {
                RuntimeError::InvalidArgument {
                    field: "user".to_owned(),
                    reason: format!("no user {name:?} in the image's /etc/passwd"),
                }
            })?;
            (Some(e.0), e.1, gid.or(Some(e.2)))
        }
    };
    let gid = gid.unwrap_or(0);
    let mut additional = Vec::new();
    if let Some(name) = name {
        // name:x:gid:member,member
        for l in group.lines() {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 4 {
                continue;
            }
            let Ok(g) = f[2].parse::<u32>() else { continue };
            if f[3].split(',').any(|m| m == name) && g != gid && !additional.contains(&g) {
                additional.push(g);
            }
        }
    }
    Ok(ResolvedUser {
        uid,
        gid,
        additional_gids: additional,
    })
}

fn oci_err(what: &'static str) -> impl FnOnce(oci_spec::OciSpecError) -> RuntimeError {
    move |e| RuntimeError::InvalidArgument {
        field: what.to_owned(),
        reason: e.to_string(),
    }
}

fn parse_caps(names: &[String], field: &str) -> Result<Vec<Capability>, RuntimeError> {
    names
        .iter()
        .map(|n| {
            serde_json::from_value::<Capability>(serde_json::Value::String(n.clone())).map_err(
                |e| RuntimeError::InvalidArgument {
                    field: field.to_owned(),
                    reason: format!("{n:?}: {e}"),
                },
            )
        })
        .collect()
}

/// Every capability with its kernel number.
const CAPABILITY_BITS: [(&str, u32); 41] = [
    ("CHOWN", 0),
    ("DAC_OVERRIDE", 1),
    ("DAC_READ_SEARCH", 2),
    ("FOWNER", 3),
    ("FSETID", 4),
    ("KILL", 5),
    ("SETGID", 6),
    ("SETUID", 7),
    ("SETPCAP", 8),
    ("LINUX_IMMUTABLE", 9),
    ("NET_BIND_SERVICE", 10),
    ("NET_BROADCAST", 11),
    ("NET_ADMIN", 12),
    ("NET_RAW", 13),
    ("IPC_LOCK", 14),
    ("IPC_OWNER", 15),
    ("SYS_MODULE", 16),
    ("SYS_RAWIO", 17),
    ("SYS_CHROOT", 18),
    ("SYS_PTRACE", 19),
    ("SYS_PACCT", 20),
    ("SYS_ADMIN", 21),
    ("SYS_BOOT", 22),
    ("SYS_NICE", 23),
    ("SYS_RESOURCE", 24),
    ("SYS_TIME", 25),
    ("SYS_TTY_CONFIG", 26),
    ("MKNOD", 27),
    ("LEASE", 28),
    ("AUDIT_WRITE", 29),
    ("AUDIT_CONTROL", 30),
    ("SETFCAP", 31),
    ("MAC_OVERRIDE", 32),
    ("MAC_ADMIN", 33),
    ("SYSLOG", 34),
    ("WAKE_ALARM", 35),
    ("BLOCK_SUSPEND", 36),
    ("AUDIT_READ", 37),
    ("PERFMON", 38),
    ("BPF", 39),
    ("CHECKPOINT_RESTORE", 40),
];

/// The agent's own capability bounding set (`CapBnd` in /proc/self/status);
/// everything when it cannot be read.
fn bounding_set() -> u64 {
    static SET: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SET.get_or_init(|| {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| parse_cap_bnd(&s))
            .unwrap_or(u64::MAX)
    })
}

fn parse_cap_bnd(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

/// "All" capabilities for privileged containers and `add: [ALL]`: those the
/// agent itself may hold, as containerd does. A node (or a container the
/// agent runs in) with a reduced bounding set cannot grant the others, and
/// asking runc for them fails the container.
fn all_caps() -> Capabilities {
    all_caps_within(bounding_set())
}

fn all_caps_within(bounding: u64) -> Capabilities {
    let mut set = Capabilities::new();
    for (name, bit) in CAPABILITY_BITS {
        if bounding & (1u64 << bit) == 0 {
            continue;
        }
        if let Ok(c) = serde_json::from_value::<Capability>(serde_json::Value::String(name.into()))
        {
            set.insert(c);
        }
    }
    set
}

/// The capability set after defaults, add and drop (`ALL` accepted in both).
pub fn effective_capabilities(spec: &ContainerSpec) -> Result<Capabilities, RuntimeError> {
    if spec.privileged {
        return Ok(all_caps());
    }
    let is_all = |v: &[String]| v.iter().any(|c| c.eq_ignore_ascii_case("ALL"));
    let mut set: Capabilities = if is_all(&spec.capabilities_add) {
        all_caps()
    } else {
        let defaults: Vec<String> = DEFAULT_CAPABILITIES
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let mut s: Capabilities = parse_caps(&defaults, "capabilities")?.into_iter().collect();
        s.extend(parse_caps(
            &spec.capabilities_add,
            "capabilities.add_capabilities",
        )?);
        s
    };
    if is_all(&spec.capabilities_drop) {
        set.clear();
        // "drop ALL, add X" keeps X.
        if !is_all(&spec.capabilities_add) {
            set.extend(parse_caps(
                &spec.capabilities_add,
                "capabilities.add_capabilities",
            )?);
        }
    } else {
        for c in parse_caps(&spec.capabilities_drop, "capabilities.drop_capabilities")? {
            set.remove(&c);
        }
    }
    Ok(set)
}

fn mount(dest: &str, typ: &str, source: &str, options: &[&str]) -> Result<Mount, RuntimeError> {
    MountBuilder::default()
        .destination(dest)
        .typ(typ)
        .source(source)
        .options(options.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
        .build()
        .map_err(oci_err("mounts"))
}

fn default_mounts(spec: &ContainerSpec) -> Result<Vec<Mount>, RuntimeError> {
    let sys_ro = if spec.privileged { "rw" } else { "ro" };
    let mut m = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])?,
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?,
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
            ],
        )?,
        mount(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        )?,
        mount(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", sys_ro],
        )?,
        mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", sys_ro],
        )?,
    ];
    let dest_taken = |dest: &str| {
        spec.mounts
            .iter()
            .any(|u| u.container_path == Path::new(dest))
    };
    if let Some(files) = &spec.sandbox_files {
        let ro = if spec.readonly_rootfs { "ro" } else { "rw" };
        for (dest, src) in [
            ("/etc/hostname", &files.hostname_path),
            ("/etc/hosts", &files.hosts_path),
            ("/etc/resolv.conf", &files.resolv_conf_path),
        ] {
            if !src.as_os_str().is_empty() && !dest_taken(dest) {
                let src = src.to_string_lossy();
                m.push(mount(dest, "bind", &src, &["rbind", "rprivate", ro])?);
            }
        }
        if let Some(shm) = &files.shm_path {
            if !dest_taken("/dev/shm") {
                let src = shm.to_string_lossy();
                m.push(mount(
                    "/dev/shm",
                    "bind",
                    &src,
                    &["rbind", "rprivate", "rw"],
                )?);
            }
        }
    }
    if spec
        .sandbox_files
        .as_ref()
        .is_none_or(|f| f.shm_path.is_none())
        && !dest_taken("/dev/shm")
    {
        m.push(mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        )?);
    }
    // The user's mounts replace any default at the same destination.
    m.retain(|d| {
        !spec
            .mounts
            .iter()
            .any(|u| u.container_path == *d.destination())
    });
    for u in &spec.mounts {
        if !u.container_path.is_absolute() {
            return Err(RuntimeError::InvalidArgument {
                field: "mounts.container_path".to_owned(),
                reason: format!("{} is not absolute", u.container_path.display()),
            });
        }
        let prop = match u.propagation {
            Propagation::Private => "rprivate",
            Propagation::HostToContainer => "rslave",
            Propagation::Bidirectional => "rshared",
        };
        let ro = if u.readonly { "ro" } else { "rw" };
        let dest = u.container_path.to_string_lossy();
        let src = u.host_path.to_string_lossy();
        m.push(mount(&dest, "bind", &src, &["rbind", prop, ro])?);
    }
    Ok(m)
}

/// The root mount propagation the container's mounts need (as containerd):
/// `rshared` when any mount propagates both ways, `rslave` when any only
/// receives from the host. Without it runc makes the root `rslave`, so a
/// bidirectional mount could not propagate back to the host.
fn rootfs_propagation(mounts: &[MountSpec]) -> Option<&'static str> {
    if mounts
        .iter()
        .any(|m| m.propagation == Propagation::Bidirectional)
    {
        Some("rshared")
    } else if mounts
        .iter()
        .any(|m| m.propagation == Propagation::HostToContainer)
    {
        Some("rslave")
    } else {
        None
    }
}

/// Directories under `/dev` whose nodes are not devices a privileged
/// container should get (as containerd's host-device list).
const SKIPPED_DEV_DIRS: &[&str] = &["pts", "shm", "fd", "mqueue", ".lxc", ".lxd-mounts", ".udev"];

/// Every character and block device under `dir` (recursively, skipping
/// [`SKIPPED_DEV_DIRS`] and `/dev/console`), as OCI devices with the
/// host's mode and owner. Unreadable entries are skipped.
fn host_devices(dir: &Path) -> Vec<LinuxDevice> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(md) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let ft = md.file_type();
        if ft.is_dir() {
            let name = entry.file_name();
            if !SKIPPED_DEV_DIRS.iter().any(|s| name == *s) {
                out.extend(host_devices(&path));
            }
            continue;
        }
        let typ = if ft.is_char_device() {
            LinuxDeviceType::C
        } else if ft.is_block_device() {
            LinuxDeviceType::B
        } else {
            continue;
        };
        if path == Path::new("/dev/console") {
            continue;
        }
        let device = LinuxDeviceBuilder::default()
            .path(path)
            .typ(typ)
            .major(i64::try_from(nix::sys::stat::major(md.rdev())).unwrap_or(0))
            .minor(i64::try_from(nix::sys::stat::minor(md.rdev())).unwrap_or(0))
            .file_mode(md.mode() & 0o7777)
            .uid(md.uid())
            .gid(md.gid())
            .build();
        if let Ok(d) = device {
            out.push(d);
        }
    }
    out
}

fn namespace(typ: LinuxNamespaceType, join: &NamespaceJoin) -> Option<LinuxNamespace> {
    let b = LinuxNamespaceBuilder::default().typ(typ);
    let b = match join {
        NamespaceJoin::Host => return None,
        NamespaceJoin::New => b,
        NamespaceJoin::Path(p) => b.path(p.clone()),
    };
    b.build().ok()
}

fn device_rule(
    allow: bool,
    typ: Option<LinuxDeviceType>,
    major: Option<i64>,
    minor: Option<i64>,
    access: &str,
) -> Result<LinuxDeviceCgroup, RuntimeError> {
    let mut b = LinuxDeviceCgroupBuilder::default()
        .allow(allow)
        .access(access);
    if let Some(t) = typ {
        b = b.typ(t);
    }
    if let Some(m) = major {
        b = b.major(m);
    }
    if let Some(m) = minor {
        b = b.minor(m);
    }
    b.build().map_err(oci_err("devices"))
}

/// Converts [`Resources`] to OCI `LinuxResources`, with the device rules of
/// an unprivileged container when `devices` is given.
pub fn linux_resources(r: &Resources) -> Result<LinuxResources, RuntimeError> {
    let mut cpu = LinuxCpuBuilder::default();
    if r.cpu_shares > 0 {
        cpu = cpu.shares(r.cpu_shares);
    }
    if r.cpu_quota != 0 {
        cpu = cpu.quota(r.cpu_quota);
    }
    if r.cpu_period > 0 {
        cpu = cpu.period(r.cpu_period);
    }
    if !r.cpuset_cpus.is_empty() {
        cpu = cpu.cpus(r.cpuset_cpus.clone());
    }
    if !r.cpuset_mems.is_empty() {
        cpu = cpu.mems(r.cpuset_mems.clone());
    }
    let mut mem = LinuxMemoryBuilder::default();
    if r.memory_limit > 0 {
        mem = mem.limit(r.memory_limit);
    }
    if r.memory_swap_limit != 0 {
        mem = mem.swap(r.memory_swap_limit);
    }
    let hugepages = r
        .hugepages
        .iter()
        .map(|h| {
            LinuxHugepageLimitBuilder::default()
                .page_size(h.page_size.clone())
                .limit(i64::try_from(h.limit).unwrap_or(i64::MAX))
                .build()
                .map_err(oci_err("resources.hugepage_limits"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut b = LinuxResourcesBuilder::default()
        .cpu(cpu.build().map_err(oci_err("resources.cpu"))?)
        .memory(mem.build().map_err(oci_err("resources.memory"))?);
    if !hugepages.is_empty() {
        b = b.hugepage_limits(hugepages);
    }
    if !r.unified.is_empty() {
        b = b.unified(
            r.unified
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<HashMap<_, _>>(),
        );
    }
    b.build().map_err(oci_err("resources"))
}

/// The `oom_score_adj` the container gets: the request, raised to the floor.
pub fn clamp_oom_score_adj(requested: i32, floor: Option<i32>) -> i32 {
    match floor {
        Some(f) if requested < f => f,
        _ => requested,
    }
}

/// The `RuntimeDefault` seccomp filter.
pub fn runtime_default_seccomp() -> Result<LinuxSeccomp, RuntimeError> {
    let deny = LinuxSyscallBuilder::default()
        .names(
            RUNTIME_DEFAULT_DENIED_SYSCALLS
                .iter()
                .map(|s| (*s).to_owned())
                .collect::<Vec<_>>(),
        )
        .action(LinuxSeccompAction::ScmpActErrno)
        .errno_ret(1u32)
        .build()
        .map_err(oci_err("seccomp"))?;
    LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActAllow)
        // Without the compat ABIs the deny list could be bypassed through them.
        .architectures(vec![
            Arch::ScmpArchX86_64,
            Arch::ScmpArchX86,
            Arch::ScmpArchX32,
        ])
        .syscalls(vec![deny])
        .build()
        .map_err(oci_err("seccomp"))
}

/// The cgroupfs path of a container: `<cgroup_parent>/<id>`.
pub fn cgroup_path(cgroup_parent: Option<&str>, id: &str) -> String {
    let parent = cgroup_parent
        .filter(|p| !p.is_empty())
        .unwrap_or("/cubelet");
    let parent = parent.trim_end_matches('/');
    if parent.starts_with('/') {
        format!("{parent}/{id}")
    } else {
        format!("/{parent}/{id}")
    }
}

/// Builds the OCI runtime spec for container `id`.
pub fn build_oci_spec(
    id: &str,
    spec: &ContainerSpec,
    opts: &SpecOptions,
) -> Result<Spec, RuntimeError> {
    let args = spec.process_args();
    if args.is_empty() {
        return Err(RuntimeError::InvalidArgument {
            field: "command".to_owned(),
            reason: "neither the request nor the image gives a command".to_owned(),
        });
    }
    let user = match (&opts.user, spec.effective_user()?) {
        (Some(u), _) => u.clone(),
        (None, UserRequest::Id { uid, gid }) => ResolvedUser {
            uid,
            gid: gid.unwrap_or(0),
            additional_gids: Vec::new(),
        },
        (None, UserRequest::Image) => ResolvedUser::default(),
        (None, UserRequest::Name { name, .. }) => {
            return Err(RuntimeError::InvalidArgument {
                field: "user".to_owned(),
                reason: format!("user {name:?} was not resolved against the image"),
            })
        }
    };
    let mut gids = user.additional_gids.clone();
    for g in &spec.supplemental_groups {
        if !gids.contains(g) {
            gids.push(*g);
        }
    }
    let caps = effective_capabilities(spec)?;
    let capabilities = LinuxCapabilitiesBuilder::default()
        .bounding(caps.clone())
        .effective(caps.clone())
        .permitted(caps)
        .inheritable(HashSet::new())
        .ambient(HashSet::new())
        .build()
        .map_err(oci_err("capabilities"))?;
    let process = ProcessBuilder::default()
        .terminal(spec.tty)
        .user(
            UserBuilder::default()
                .uid(user.uid)
                .gid(user.gid)
                .additional_gids(gids)
                .build()
                .map_err(oci_err("user"))?,
        )
        .args(args)
        .env(spec.process_env())
        .cwd(spec.process_cwd())
        .capabilities(capabilities)
        .no_new_privileges(spec.no_new_privs && !spec.privileged)
        .oom_score_adj(clamp_oom_score_adj(
            spec.resources.oom_score_adj,
            opts.min_oom_score_adj,
        ));
    let process = process.build().map_err(oci_err("process"))?;

    let ns = &spec.namespaces;
    let mut namespaces: Vec<LinuxNamespace> = [
        (LinuxNamespaceType::Pid, &ns.pid),
        (LinuxNamespaceType::Ipc, &ns.ipc),
        (LinuxNamespaceType::Uts, &ns.uts),
        (LinuxNamespaceType::Network, &ns.network),
    ]
    .iter()
    .filter_map(|(t, j)| namespace(*t, j))
    .collect();
    namespaces.push(
        namespace(LinuxNamespaceType::Mount, &NamespaceJoin::New).ok_or_else(|| {
            RuntimeError::InvalidArgument {
                field: "namespaces".into(),
                reason: "mount".into(),
            }
        })?,
    );

    let mut resources = linux_resources(&spec.resources)?;
    let mut rules = if spec.privileged {
        vec![device_rule(true, None, None, None, "rwm")?]
    } else {
        let c = Some(LinuxDeviceType::C);
        vec![
            device_rule(false, None, None, None, "rwm")?,
            device_rule(true, c, None, None, "m")?,
            device_rule(true, Some(LinuxDeviceType::B), None, None, "m")?,
            device_rule(true, c, Some(1), Some(3), "rwm")?,
            device_rule(true, c, Some(1), Some(8), "rwm")?,
            device_rule(true, c, Some(1), Some(7), "rwm")?,
            device_rule(true, c, Some(5), Some(0), "rwm")?,
            device_rule(true, c, Some(1), Some(5), "rwm")?,
            device_rule(true, c, Some(1), Some(9), "rwm")?,
            device_rule(true, c, Some(5), Some(1), "rwm")?,
            device_rule(true, c, Some(136), None, "rwm")?,
            device_rule(true, c, Some(5), Some(2), "rwm")?,
            device_rule(true, c, Some(10), Some(200), "rwm")?,
        ]
    };
    let mut devices = Vec::new();
    for d in &spec.devices {
        let md = std::fs::metadata(&d.host_path).map_err(|source| RuntimeError::Io {
            op: "stat device",
            path: d.host_path.display().to_string(),
            source,
        })?;
        let typ = if md.file_type().is_char_device() {
            LinuxDeviceType::C
        } else if md.file_type().is_block_device() {
            LinuxDeviceType::B
        } else {
            return Err(RuntimeError::InvalidArgument {
                field: "devices.host_path".to_owned(),
                reason: format!("{} is not a device", d.host_path.display()),
            });
        };
        let major = i64::try_from(nix::sys::stat::major(md.rdev())).unwrap_or(0);
        let minor = i64::try_from(nix::sys::stat::minor(md.rdev())).unwrap_or(0);
        let perms = if d.permissions.is_empty() {
            "rwm"
        } else {
            d.permissions.as_str()
        };
        devices.push(
            LinuxDeviceBuilder::default()
                .path(d.container_path.clone())
                .typ(typ)
                .major(major)
                .minor(minor)
                .file_mode(md.mode() & 0o7777)
                .uid(md.uid())
                .gid(md.gid())
                .build()
                .map_err(oci_err("devices"))?,
        );
        if !spec.privileged {
            rules.push(device_rule(
                true,
                Some(typ),
                Some(major),
                Some(minor),
                perms,
            )?);
        }
    }
    resources.set_devices(Some(rules));

    if spec.privileged {
        // As containerd and CRI-O: a privileged container sees the host's
        // devices (its own requested ones win at the same path).
        let requested: Vec<PathBuf> = devices.iter().map(|d| d.path().clone()).collect();
        devices.extend(
            host_devices(Path::new("/dev"))
                .into_iter()
                .filter(|d| !requested.contains(d.path())),
        );
    }
    let mut linux = LinuxBuilder::default()
        .namespaces(namespaces)
        .resources(resources)
        .cgroups_path(cgroup_path(spec.cgroup_parent.as_deref(), id))
        .devices(devices)
        .sysctl(spec.sysctls.clone().into_iter().collect::<HashMap<_, _>>());
    if let Some(p) = rootfs_propagation(&spec.mounts) {
        linux = linux.rootfs_propagation(p);
    }
    if spec.privileged {
        // Nothing masked or read-only (the builder's defaults would be).
        linux = linux.masked_paths(Vec::new()).readonly_paths(Vec::new());
    } else {
        linux = linux
            .masked_paths(spec.masked_paths.clone().unwrap_or_else(|| {
                DEFAULT_MASKED_PATHS
                    .iter()
                    .map(|s| (*s).to_owned())
                    .collect()
            }))
            .readonly_paths(spec.readonly_paths.clone().unwrap_or_else(|| {
                DEFAULT_READONLY_PATHS
                    .iter()
                    .map(|s| (*s).to_owned())
                    .collect()
            }));
        match &spec.seccomp {
            SeccompProfile::Unconfined => {}
            SeccompProfile::RuntimeDefault => linux = linux.seccomp(runtime_default_seccomp()?),
            SeccompProfile::Localhost(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| RuntimeError::Io {
                    op: "read seccomp profile",
                    path: path.display().to_string(),
                    source,
                })?;
                let profile: LinuxSeccomp =
                    serde_json::from_str(&text).map_err(|e| RuntimeError::InvalidArgument {
                        field: "seccomp.localhost_ref".to_owned(),
                        reason: format!("{}: {e}", path.display()),
                    })?;
                linux = linux.seccomp(profile);
            }
        }
    }
    let linux = linux.build().map_err(oci_err("linux"))?;

    let mut b = SpecBuilder::default()
        .version("1.0.2-dev")
        .process(process)
        .root(
            RootBuilder::default()
                .path("rootfs")
                .readonly(spec.readonly_rootfs)
                .build()
                .map_err(oci_err("root"))?,
        )
        .mounts(default_mounts(spec)?)
        .linux(linux)
        .annotations(
            spec.annotations
                .clone()
                .into_iter()
                .collect::<HashMap<_, _>>(),
        );
    if ns.uts == NamespaceJoin::New && !spec.hostname.is_empty() {
        b = b.hostname(spec.hostname.clone());
    }
    let mut oci = b.build().map_err(oci_err("spec"))?;
    if ns.uts != NamespaceJoin::New || spec.hostname.is_empty() {
        // The builder's default is a placeholder hostname; joining the
        // pod's (or node's) UTS namespace must not set one.
        oci.set_hostname(None);
    }
    Ok(oci)
}

#[cfg(test)]
mod tests {
    #[test]
    fn all_caps_stay_within_the_bounding_set() {
        let status = "Name:\tx\nCapBnd:\t000001fffeffffff\nCapAmb:\t0\n";
        let bnd = parse_cap_bnd(status).unwrap();
        let caps = all_caps_within(bnd);
        assert!(!caps.contains(&Capability::SysResource));
        assert!(caps.contains(&Capability::SysAdmin));
        assert_eq!(caps.len(), 40);
        assert_eq!(all_caps_within(u64::MAX).len(), 41);
    }

    use super::*;
    use crate::types::ImageConfig;

    fn image(entrypoint: &[&str], cmd: &[&str], env: &[&str]) -> ImageInfo {
        ImageInfo {
            config: ImageConfig {
                entrypoint: entrypoint.iter().map(|s| s.to_string()).collect(),
                cmd: cmd.iter().map(|s| s.to_string()).collect(),
                env: env.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
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
    fn empty_command_is_rejected() {
        let s = ContainerSpec::default();
        let e = build_oci_spec("c", &s, &SpecOptions::default()).unwrap_err();
        assert!(matches!(e, RuntimeError::InvalidArgument { .. }), "{e}");
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
        s.image.config.env.push("PATH=/bin".into());
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

    const PASSWD: &str =
        "root:x:0:0:root:/root:/bin/sh\n# comment\nwww:x:33:34:www:/var/www:/bin/false\nbad line\n";
    const GROUP: &str =
        "root:x:0:\nwww:x:34:\naudio:x:29:www,other\nvideo:x:44:other\nstaff:x:50:www\n";

    #[test]
    fn user_resolution_from_passwd_and_group() {
        let u = resolve_user(&parse_user("www").unwrap(), PASSWD, GROUP).unwrap();
        assert_eq!(
            u,
            ResolvedUser {
                uid: 33,
                gid: 34,
                additional_gids: vec![29, 50]
            }
        );
        let u = resolve_user(&parse_user("33").unwrap(), PASSWD, GROUP).unwrap();
        assert_eq!(u.gid, 34);
        let u = resolve_user(&parse_user("33:7").unwrap(), PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid), (33, 7));
        let u = resolve_user(&parse_user("1234").unwrap(), PASSWD, GROUP).unwrap();
        assert_eq!(
            u,
            ResolvedUser {
                uid: 1234,
                gid: 0,
                additional_gids: vec![]
            }
        );
        assert!(resolve_user(&parse_user("nobody").unwrap(), PASSWD, GROUP).is_err());
        assert!(parse_user("www:staff").is_err());
        assert!(user_needs_lookup(&parse_user("www").unwrap()));
        assert!(!user_needs_lookup(&parse_user("1:2").unwrap()));
    }

    #[test]
    fn oom_score_adj_is_clamped_to_the_agent_floor() {
        assert_eq!(clamp_oom_score_adj(-999, Some(-500)), -500);
        assert_eq!(clamp_oom_score_adj(100, Some(-500)), 100);
        assert_eq!(clamp_oom_score_adj(-999, None), -999);
        let s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            resources: Resources {
                oom_score_adj: -998,
                ..Default::default()
            },
            ..Default::default()
        };
        let opts = SpecOptions {
            min_oom_score_adj: Some(0),
            ..Default::default()
        };
        let oci = build_oci_spec("c", &s, &opts).unwrap();
        assert_eq!(oci.process().as_ref().unwrap().oom_score_adj(), Some(0));
    }

    #[test]
    fn namespaces_for_pod_and_host() {
        use cubelet_engine::spec::{NamespaceMode, NamespaceOptions};
        let pod = NamespaceOptions::default();
        let infra = ContainerNamespaces::for_infra(&pod, Some(Path::new("/run/netns/x")));
        assert_eq!(infra.network, NamespaceJoin::Path("/run/netns/x".into()));
        assert_eq!(
            (infra.ipc.clone(), infra.uts.clone(), infra.pid.clone()),
            (NamespaceJoin::New, NamespaceJoin::New, NamespaceJoin::New)
        );
        let host = NamespaceOptions {
            network: NamespaceMode::Node,
            pid: NamespaceMode::Node,
            ipc: NamespaceMode::Node,
            target_id: None,
        };
        let infra = ContainerNamespaces::for_infra(&host, None);
        assert_eq!(
            infra,
            ContainerNamespaces {
                network: NamespaceJoin::Host,
                ipc: NamespaceJoin::Host,
                uts: NamespaceJoin::Host,
                pid: NamespaceJoin::Host
            }
        );

        let c = ContainerNamespaces::for_pod_container(&pod, 42, None);
        assert_eq!(c.network, NamespaceJoin::Path("/proc/42/ns/net".into()));
        assert_eq!(c.pid, NamespaceJoin::Path("/proc/42/ns/pid".into()));
        let own_pid = NamespaceOptions {
            pid: NamespaceMode::Container,
            ..Default::default()
        };
        assert_eq!(
            ContainerNamespaces::for_pod_container(&own_pid, 42, None).pid,
            NamespaceJoin::New
        );

        let s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            namespaces: c,
            hostname: "h".into(),
            ..Default::default()
        };
        let oci = build_oci_spec("c", &s, &SpecOptions::default()).unwrap();
        let nss = oci.linux().as_ref().unwrap().namespaces().clone().unwrap();
        let net = nss
            .iter()
            .find(|n| n.typ() == LinuxNamespaceType::Network)
            .unwrap();
        assert_eq!(net.path().as_deref(), Some(Path::new("/proc/42/ns/net")));
        assert!(nss
            .iter()
            .any(|n| n.typ() == LinuxNamespaceType::Mount && n.path().is_none()));
        // Hostname only with a new UTS namespace.
        assert_eq!(oci.hostname(), &None);
        let s2 = ContainerSpec {
            namespaces: ContainerNamespaces::default(),
            ..s
        };
        let oci = build_oci_spec("c", &s2, &SpecOptions::default()).unwrap();
        assert_eq!(oci.hostname().as_deref(), Some("h"));
        assert_eq!(
            oci.linux().as_ref().unwrap().cgroups_path().as_deref(),
            Some(Path::new("/cubelet/c"))
        );
    }

    #[test]
    fn root_propagation_follows_the_mounts() {
        let bind = |propagation| MountSpec {
            host_path: "/data".into(),
            container_path: "/data".into(),
            readonly: false,
            propagation,
        };
        let root = |mounts: Vec<MountSpec>| {
            let s = ContainerSpec {
                image: image(&[], &["x"], &[]),
                mounts,
                ..Default::default()
            };
            let oci = build_oci_spec("c", &s, &SpecOptions::default()).unwrap();
            oci.linux().as_ref().unwrap().rootfs_propagation().clone()
        };
        assert_eq!(root(vec![]), None);
        assert_eq!(root(vec![bind(Propagation::Private)]), None);
        assert_eq!(
            root(vec![bind(Propagation::HostToContainer)]).as_deref(),
            Some("rslave")
        );
        assert_eq!(
            root(vec![
                bind(Propagation::HostToContainer),
                bind(Propagation::Bidirectional)
            ])
            .as_deref(),
            Some("rshared")
        );
    }

    #[test]
    fn privileged_gets_host_devices_and_nothing_masked() {
        let s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            privileged: true,
            ..Default::default()
        };
        let oci = build_oci_spec("c", &s, &SpecOptions::default()).unwrap();
        let linux = oci.linux().as_ref().unwrap();
        assert_eq!(linux.masked_paths().as_deref(), Some(&[][..]));
        assert_eq!(linux.readonly_paths().as_deref(), Some(&[][..]));
        let devices = linux.devices().clone().unwrap_or_default();
        let paths: Vec<_> = devices.iter().map(|d| d.path().clone()).collect();
        assert!(paths.contains(&PathBuf::from("/dev/null")), "{paths:?}");
        assert!(
            !paths
                .iter()
                .any(|p| p.starts_with("/dev/pts") || p == Path::new("/dev/console")),
            "{paths:?}"
        );
        let unprivileged = ContainerSpec {
            privileged: false,
            ..s
        };
        let oci = build_oci_spec("c", &unprivileged, &SpecOptions::default()).unwrap();
        let linux = oci.linux().as_ref().unwrap();
        assert!(!linux.masked_paths().clone().unwrap_or_default().is_empty());
        assert!(linux.devices().clone().unwrap_or_default().is_empty());
    }

    #[test]
    fn mounts_defaults_sandbox_files_and_user_binds() {
        let s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            sandbox_files: Some(cubelet_engine::spec::StorageStatus {
                hostname_path: "/sb/hostname".into(),
                hosts_path: "/sb/hosts".into(),
                resolv_conf_path: "/sb/resolv.conf".into(),
                shm_path: Some("/sb/shm".into()),
                ..Default::default()
            }),
            mounts: vec![
                MountSpec {
                    host_path: "/data".into(),
                    container_path: "/data".into(),
                    readonly: true,
                    propagation: Propagation::HostToContainer,
                },
                MountSpec {
                    host_path: "/my/hosts".into(),
                    container_path: "/etc/hosts".into(),
                    readonly: false,
                    propagation: Propagation::Bidirectional,
                },
            ],
            cgroup_parent: Some("kubepods/pod1".into()),
            ..Default::default()
        };
        let oci = build_oci_spec("c", &s, &SpecOptions::default()).unwrap();
        let mounts = oci.mounts().clone().unwrap();
        let find = |d: &str| {
            mounts
                .iter()
                .filter(|m| m.destination() == Path::new(d))
                .collect::<Vec<_>>()
        };
        for d in [
            "/proc",
            "/dev",
            "/dev/pts",
            "/dev/mqueue",
            "/sys",
            "/sys/fs/cgroup",
            "/etc/hostname",
            "/etc/resolv.conf",
        ] {
            assert_eq!(find(d).len(), 1, "{d}");
        }
        assert!(find("/sys")[0]
            .options()
            .as_ref()
            .unwrap()
            .contains(&"ro".to_string()));
        assert_eq!(
            find("/dev/shm")[0].source().as_deref(),
            Some(Path::new("/sb/shm"))
        );
        let hosts = find("/etc/hosts");
        assert_eq!(hosts.len(), 1);
        assert_eq!(hosts[0].source().as_deref(), Some(Path::new("/my/hosts")));
        assert!(hosts[0]
            .options()
            .as_ref()
            .unwrap()
            .contains(&"rshared".to_string()));
        let data = find("/data")[0].options().clone().unwrap();
        assert!(data.contains(&"ro".to_string()) && data.contains(&"rslave".to_string()));
        let linux = oci.linux().as_ref().unwrap();
        assert_eq!(
            linux.cgroups_path().as_deref(),
            Some(Path::new("/kubepods/pod1/c"))
        );
        assert_eq!(
            linux.masked_paths().as_ref().unwrap().len(),
            DEFAULT_MASKED_PATHS.len()
        );
    }

    #[test]
    fn capabilities_add_drop_and_privileged() {
        let mut s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            capabilities_add: strs(&["NET_ADMIN"]),
            capabilities_drop: strs(&["CAP_KILL"]),
            ..Default::default()
        };
        let caps = effective_capabilities(&s).unwrap();
        assert!(caps.contains(&Capability::NetAdmin));
        assert!(!caps.contains(&Capability::Kill));
        assert!(caps.contains(&Capability::Chown));
        s.capabilities_drop = strs(&["ALL"]);
        assert_eq!(
            effective_capabilities(&s).unwrap(),
            [Capability::NetAdmin].into_iter().collect()
        );
        s.capabilities_add = strs(&["NOT_A_CAP"]);
        assert!(effective_capabilities(&s).is_err());
        s.privileged = true;
        assert!(effective_capabilities(&s)
            .unwrap()
            .contains(&Capability::SysAdmin));
    }

    #[test]
    fn seccomp_runtime_default_denies_and_resources_convert() {
        let sc = runtime_default_seccomp().unwrap();
        assert_eq!(sc.default_action(), LinuxSeccompAction::ScmpActAllow);
        let json = serde_json::to_string(&sc).unwrap();
        assert!(json.contains("kexec_load"), "{json}");
        let r = linux_resources(&Resources {
            cpu_shares: 512,
            cpu_quota: 50_000,
            cpu_period: 100_000,
            memory_limit: 64 << 20,
            hugepages: vec![HugepageLimit {
                page_size: "2MB".into(),
                limit: 1 << 21,
            }],
            ..Default::default()
        })
        .unwrap();
        assert_eq!(r.cpu().as_ref().unwrap().shares(), Some(512));
        assert_eq!(r.memory().as_ref().unwrap().limit(), Some(64 << 20));
        assert_eq!(r.hugepage_limits().as_ref().unwrap().len(), 1);
    }
}
