//! The runtime-neutral description of a pod sandbox, and the typed results
//! that steps publish for later stages.
//!
//! These types are the contract between the CRI shim (which converts CRI
//! requests into a [`SandboxSpec`]) and the flow providers (which read it and
//! publish [`NetworkStatus`], [`StorageStatus`] and [`SandboxProcess`]). They
//! carry no wire types, so providers never need to know about CRI.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Identifier of a pod sandbox: 64 lowercase hex characters, like containerd's.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SandboxId(String);

impl SandboxId {
    /// Wraps an id without checking it. Use [`SandboxId::parse`] for input
    /// that comes from outside the process.
    pub fn new_unchecked(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// Parses an id: 1 to 64 characters of `[0-9a-z_-]`, not starting with `-`
    /// or `_`. Ids end up in file names, link names and mount points, so
    /// nothing that could walk a path or confuse a tool is accepted.
    pub fn parse(id: &str) -> Option<Self> {
        let ok = !id.is_empty()
            && id.len() <= 64
            && id
                .bytes()
                .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'-' || b == b'_')
            && !id.starts_with(['-', '_']);
        ok.then(|| Self(id.to_owned()))
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SandboxId({})", self.0)
    }
}

/// How a namespace of the sandbox is provided (CRI `NamespaceMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NamespaceMode {
    /// One namespace shared by every container of the pod.
    #[default]
    Pod,
    /// Each container gets its own namespace.
    Container,
    /// The node's (host's) namespace.
    Node,
    /// The namespace of another container (`target_id`).
    Target,
}

/// Namespace choices of a sandbox (CRI `NamespaceOption`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceOptions {
    /// Network namespace.
    pub network: NamespaceMode,
    /// PID namespace.
    pub pid: NamespaceMode,
    /// IPC namespace.
    pub ipc: NamespaceMode,
    /// Container whose namespace is joined when a mode is `Target`.
    pub target_id: Option<String>,
    /// The pod's own user namespace (CRI `NamespaceMode_POD`), with its
    /// mappings; `None` runs the pod in the node's user namespace.
    #[serde(default)]
    pub userns: Option<UserNamespace>,
}

/// One contiguous range of ids mapped into a user namespace (a line of
/// `/proc/<pid>/uid_map`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdMapping {
    /// First id inside the namespace.
    pub container_id: u32,
    /// First id on the node it maps to.
    pub host_id: u32,
    /// How many ids are mapped.
    pub length: u32,
}

impl IdMapping {
    /// The line the kernel takes in `uid_map`/`gid_map`.
    pub fn map_line(&self) -> String {
        format!("{} {} {}\n", self.container_id, self.host_id, self.length)
    }

    /// The node id that `id` inside the namespace maps to, if it is mapped.
    pub fn to_host(&self, id: u32) -> Option<u32> {
        let offset = id.checked_sub(self.container_id)?;
        (offset < self.length).then(|| self.host_id.checked_add(offset))?
    }
}

/// A pod-level user namespace: one uid and one gid mapping (kubelet sends
/// exactly one each, with container id 0 mapped).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserNamespace {
    /// The uid mapping.
    pub uids: IdMapping,
    /// The gid mapping.
    pub gids: IdMapping,
}

/// DNS configuration for the pod's `resolv.conf` (CRI `DNSConfig`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DnsConfig {
    /// Name servers.
    pub servers: Vec<String>,
    /// Search domains.
    pub searches: Vec<String>,
    /// Resolver options (`ndots:5`, ...).
    pub options: Vec<String>,
}

/// Transport protocol of a port mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// TCP.
    #[default]
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl Protocol {
    /// Lowercase protocol name, as used by nftables and CNI.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

/// A host port forwarded to a port of the pod (CRI `PortMapping`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PortMapping {
    /// Protocol.
    pub protocol: Protocol,
    /// Port inside the pod.
    pub container_port: u16,
    /// Port on the node.
    pub host_port: u16,
    /// Node address to bind; `None` means every address.
    pub host_ip: Option<IpAddr>,
}

/// Everything the flow providers need to know about a pod sandbox.
///
/// Built by the CRI shim from a validated `PodSandboxConfig`; stored with the
/// sandbox so that destroy and cleanup after a restart see the same input.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// Pod name (metadata).
    pub name: String,
    /// Pod namespace (metadata).
    pub namespace: String,
    /// Pod UID (metadata).
    pub uid: String,
    /// Attempt number (metadata).
    pub attempt: u32,
    /// Hostname for the pod; empty means the pod name.
    pub hostname: String,
    /// Absolute directory for container logs, if kubelet asked for one.
    pub log_directory: Option<PathBuf>,
    /// DNS settings; `None` means "use the node's resolv.conf".
    pub dns: Option<DnsConfig>,
    /// Host ports to forward into the pod.
    pub port_mappings: Vec<PortMapping>,
    /// Namespace options.
    pub namespaces: NamespaceOptions,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Annotations.
    pub annotations: BTreeMap<String, String>,
    /// Cgroup parent for the pod, as given by kubelet.
    pub cgroup_parent: Option<String>,
    /// Runtime handler (RuntimeClass) name; empty means the default.
    pub runtime_handler: String,
    /// Namespaced sysctls for the pod.
    pub sysctls: BTreeMap<String, String>,
    /// Whether the sandbox runs privileged.
    pub privileged: bool,
}

impl SandboxSpec {
    /// True when the pod uses the node's network namespace.
    pub fn host_network(&self) -> bool {
        self.namespaces.network == NamespaceMode::Node
    }

    /// The hostname to give the pod: the requested one, else the pod name.
    ///
    /// A pod name can be longer than a hostname may be (64 bytes): the
    /// fallback is cut to 63 and loses trailing `-`/`.`, as kubelet does.
    pub fn effective_hostname(&self) -> &str {
        if !self.hostname.is_empty() {
            return &self.hostname;
        }
        let mut end = self.name.len().min(63);
        while !self.name.is_char_boundary(end) {
            end -= 1;
        }
        self.name[..end].trim_end_matches(['-', '.'])
    }
}

/// Published by the network step: where the pod's network lives.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkStatus {
    /// Path of the pinned network namespace; `None` for host-network pods.
    pub netns_path: Option<PathBuf>,
    /// Addresses of the pod, primary first.
    pub ips: Vec<IpAddr>,
    /// Name of the pod's interface inside the namespace.
    pub interface: Option<String>,
    /// Path of the pinned user namespace that owns the network namespace,
    /// for pods with a user namespace of their own.
    #[serde(default)]
    pub userns_path: Option<PathBuf>,
}

/// Published by the storage step: the per-sandbox files and mounts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StorageStatus {
    /// The sandbox's own directory.
    pub sandbox_dir: PathBuf,
    /// File to mount at `/etc/hostname`.
    pub hostname_path: PathBuf,
    /// File to mount at `/etc/hosts`.
    pub hosts_path: PathBuf,
    /// File to mount at `/etc/resolv.conf`.
    pub resolv_conf_path: PathBuf,
    /// Directory to mount at `/dev/shm`; `None` when IPC is the node's.
    pub shm_path: Option<PathBuf>,
    /// Mounted scratch space, when the pod asked for one.
    pub scratch_path: Option<PathBuf>,
}

/// Published by the sandbox step: where the pod's shared namespaces are.
///
/// A sandbox either has an infra (pause) process, whose namespaces its
/// containers join by `/proc/<pid>/ns/*`, or none: then its IPC and UTS
/// namespaces are pinned by bind mounts under `pins_dir` (the network
/// namespace is the network step's pin) and containers join those paths.
/// Records written before sandboxes without an infra process existed carry
/// only `pid` and `runtime_handler`, and still read as infra sandboxes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxProcess {
    /// Host PID of the infra process; `None` for a sandbox without one.
    #[serde(default)]
    pub pid: Option<u32>,
    /// Runtime handler that runs the pod's containers.
    pub runtime_handler: String,
    /// The pinned IPC namespace of a sandbox without an infra process;
    /// `None` with an infra process or the node's IPC namespace.
    #[serde(default)]
    pub ipc_path: Option<PathBuf>,
    /// The pinned UTS namespace (with the pod's hostname set) of a sandbox
    /// without an infra process; `None` with an infra process or the
    /// node's network (and so UTS) namespace.
    #[serde(default)]
    pub uts_path: Option<PathBuf>,
    /// The directory holding the pins of a sandbox without an infra
    /// process; it exists from the start of its create to the end of its
    /// teardown, so it marks the sandbox's namespaces as alive even when
    /// the pod shares every namespace with the node.
    #[serde(default)]
    pub pins_dir: Option<PathBuf>,
}

impl SandboxProcess {
    /// True for a sandbox whose namespaces are pinned, with no infra process.
    pub fn is_infraless(&self) -> bool {
        self.pid.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_id_rejects_paths_and_junk() {
        assert!(SandboxId::parse("abc123").is_some());
        assert!(SandboxId::parse(&"a".repeat(64)).is_some());
        for bad in ["", "../x", "a/b", "A", "-x", "_x", "a b", &"a".repeat(65)] {
            assert!(SandboxId::parse(bad).is_none(), "{bad:?} accepted");
        }
    }

    #[test]
    fn id_mappings_translate_within_their_range() {
        let m = IdMapping {
            container_id: 0,
            host_id: 65536,
            length: 65536,
        };
        assert_eq!(m.map_line(), "0 65536 65536\n");
        assert_eq!(m.to_host(0), Some(65536));
        assert_eq!(m.to_host(65535), Some(131071));
        assert_eq!(m.to_host(65536), None);
        let shifted = IdMapping {
            container_id: 10,
            host_id: u32::MAX - 1,
            length: 5,
        };
        assert_eq!(shifted.to_host(9), None);
        assert_eq!(shifted.to_host(11), Some(u32::MAX));
        assert_eq!(shifted.to_host(12), None, "past u32::MAX");
    }

    #[test]
    fn effective_hostname_falls_back_to_name() {
        let mut s = SandboxSpec {
            name: "web".into(),
            ..Default::default()
        };
        assert_eq!(s.effective_hostname(), "web");
        s.hostname = "h".into();
        assert_eq!(s.effective_hostname(), "h");
        s.hostname.clear();
        s.name = format!("{}-{}", "a".repeat(62), "b".repeat(20));
        assert_eq!(s.effective_hostname(), "a".repeat(62));
    }
}
