//! The sections of the configuration, one type per map, each with its
//! defaults.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use super::{ByteSize, ConfigError};

/// `cri:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CriConfig {
    /// Replace an invalid HTTP/2 `:authority` with `localhost` before the
    /// gRPC server sees it: some Go clients (crictl/critest 1.26, older
    /// kubelets) send the socket path there, and every one of their calls
    /// would otherwise be reset with `PROTOCOL_ERROR`.
    pub rewrite_invalid_authority: bool,
}

impl Default for CriConfig {
    fn default() -> Self {
        Self {
            rewrite_invalid_authority: true,
        }
    }
}

/// `containerd:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ContainerdConfig {
    /// containerd's gRPC socket.
    pub address: PathBuf,
    /// containerd namespace Cubelet keeps its objects in.
    pub namespace: String,
    /// containerd's root directory (its `root` setting), measured by
    /// CRI `ImageFsInfo`.
    pub root: PathBuf,
    /// How many times start-up tries containerd (connect and `Version`,
    /// 3 s each) before it gives up; each failed try is logged at WARN,
    /// waits grow from 100 ms to 2 s. Default 30 (about a minute).
    pub connect_attempts: u32,
}

impl Default for ContainerdConfig {
    fn default() -> Self {
        Self {
            address: "/run/containerd/containerd.sock".into(),
            namespace: "k8s.cubelet.io".into(),
            root: "/var/lib/containerd".into(),
            connect_attempts: 30,
        }
    }
}

/// `metrics:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Listen address of the admin HTTP server.
    pub address: SocketAddr,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            address: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9385),
        }
    }
}

/// `streaming:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamingConfig {
    /// Listen address.
    pub address: IpAddr,
    /// Port; 0 picks a free one.
    pub port: u16,
    /// How long an Exec/Attach/PortForward URL stays usable (kubelet: 4m).
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// PEM certificate chain: serve HTTPS (with `tls_key_file`).
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// How long a connection may take to send its request head (10s).
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Connections open at once, sessions included (2048); more get 503.
    pub max_connections: usize,
    /// Sessions at once on one container or pod sandbox (64); more get 429.
    pub max_sessions_per_container: usize,
    /// A session silent in both directions this long is ended (4h, as
    /// kubelet's streaming server).
    #[serde(with = "humantime_serde")]
    pub stream_idle_timeout: Duration,
    /// Exec/Attach/PortForward URLs handed out and not used yet (1000, as
    /// kubelet); more fail with `ResourceExhausted`.
    pub max_in_flight_urls: usize,
    /// Largest WebSocket message or frame, and SPDY DATA frame, a client
    /// may send (1Mi).
    pub max_message_size: ByteSize,
    /// Client input one stream may have queued for a process or port that
    /// does not read it (1Mi); the client is then not read from.
    pub max_queued_bytes: ByteSize,
}

impl Default for StreamingConfig {
    fn default() -> Self {
        let limits = cubelet_streaming::Limits::default();
        Self {
            address: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            idle_timeout: Duration::from_secs(4 * 60),
            tls_cert_file: None,
            tls_key_file: None,
            header_read_timeout: limits.header_read_timeout,
            max_connections: limits.max_connections,
            max_sessions_per_container: limits.max_sessions_per_container,
            stream_idle_timeout: limits.stream_idle_timeout,
            max_in_flight_urls: limits.max_in_flight_urls,
            max_message_size: ByteSize(limits.max_message_size as u64),
            max_queued_bytes: ByteSize(limits.max_queued_bytes as u64),
        }
    }
}

impl StreamingConfig {
    /// The streaming server's limits; an error naming the key of a value
    /// out of range.
    pub fn limits(&self) -> Result<cubelet_streaming::Limits, ConfigError> {
        let positive = |key: &'static str, n: usize| {
            if n == 0 {
                Err(ConfigError::Invalid {
                    key,
                    message: "must be at least 1".into(),
                })
            } else {
                Ok(n)
            }
        };
        let nonzero = |key: &'static str, d: Duration| {
            if d.is_zero() {
                Err(ConfigError::Invalid {
                    key,
                    message: "must not be zero".into(),
                })
            } else {
                Ok(d)
            }
        };
        let size = |key: &'static str, b: ByteSize, min: u64| {
            if b.0 < min || b.0 > 1 << 30 {
                Err(ConfigError::Invalid {
                    key,
                    message: format!("{b} is out of range ({min} bytes to 1Gi)"),
                })
            } else {
                Ok(usize::try_from(b.0).unwrap_or(usize::MAX))
            }
        };
        Ok(cubelet_streaming::Limits {
            header_read_timeout: nonzero(
                "streaming.header_read_timeout",
                self.header_read_timeout,
            )?,
            max_connections: positive("streaming.max_connections", self.max_connections)?,
            max_sessions_per_container: positive(
                "streaming.max_sessions_per_container",
                self.max_sessions_per_container,
            )?,
            stream_idle_timeout: nonzero(
                "streaming.stream_idle_timeout",
                self.stream_idle_timeout,
            )?,
            max_in_flight_urls: positive("streaming.max_in_flight_urls", self.max_in_flight_urls)?,
            // A client's writes come in 32 KiB pieces (Go's io.Copy).
            max_message_size: size(
                "streaming.max_message_size",
                self.max_message_size,
                64 << 10,
            )?,
            max_queued_bytes: size(
                "streaming.max_queued_bytes",
                self.max_queued_bytes,
                64 << 10,
            )?,
        })
    }

    /// The TLS files, when both are set; an error naming the missing key
    /// when only one is.
    pub fn tls(&self) -> Result<Option<cubelet_streaming::TlsFiles>, ConfigError> {
        match (&self.tls_cert_file, &self.tls_key_file) {
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => Ok(Some(cubelet_streaming::TlsFiles {
                cert_file: cert.clone(),
                key_file: key.clone(),
            })),
            (Some(_), None) => Err(ConfigError::Invalid {
                key: "streaming.tls_key_file",
                message: "required with streaming.tls_cert_file".into(),
            }),
            (None, Some(_)) => Err(ConfigError::Invalid {
                key: "streaming.tls_cert_file",
                message: "required with streaming.tls_key_file".into(),
            }),
        }
    }
}

/// `images:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImagesConfig {
    /// Pod infra image; empty means the built-in cubelet-pause image.
    pub pause_image: String,
    /// Path of the static `cubelet-pause` binary the built-in image is made
    /// from; empty means `cubelet-pause` beside the `cubelet` executable.
    pub pause_binary: PathBuf,
    /// Registry host configuration, `<host>/hosts.toml` as containerd's.
    pub registry_config_dir: PathBuf,
    /// A pull fails when a registry sends nothing (no headers, no body
    /// bytes) for this long; containerd's `image_pull_progress_timeout`.
    /// `0s` disables it. Default 5m.
    #[serde(with = "humantime_serde")]
    pub pull_progress_timeout: Duration,
    /// Layers of one pull downloaded at once; containerd's
    /// `max_concurrent_downloads`. Default 3; 0 counts as 1.
    pub max_concurrent_downloads: usize,
    /// Layers are staged under `<root_dir>/ingest` and hard-linked into
    /// containerd's content directory (`<containerd.root>/
    /// io.containerd.content.v1.content`), then committed without sending
    /// their data; off, or where that directory is missing or on another
    /// file system, they stream through containerd's content API.
    /// Default true (docs/performance.md, "image pulls").
    pub direct_content_write: bool,
}

impl Default for ImagesConfig {
    fn default() -> Self {
        Self {
            pause_image: String::new(),
            pause_binary: PathBuf::new(),
            registry_config_dir: "/etc/cubelet/certs.d".into(),
            pull_progress_timeout: Duration::from_secs(5 * 60),
            max_concurrent_downloads: 3,
            direct_content_write: true,
        }
    }
}

/// `runtime.cgroup_driver`: who manages container cgroups (it must match
/// kubelet's `cgroupDriver`; see docs/cgroups.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupDriver {
    /// Paths under the cgroup filesystem.
    Cgroupfs,
    /// systemd slices and scopes (runc's systemd manager).
    Systemd,
    /// systemd when systemd is the init system and the hierarchy is
    /// cgroup v2, else cgroupfs (decided once at start).
    Auto,
}

impl CgroupDriver {
    /// Name as written in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            CgroupDriver::Cgroupfs => "cgroupfs",
            CgroupDriver::Systemd => "systemd",
            CgroupDriver::Auto => "auto",
        }
    }
}

/// `runtime.handlers.<name>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandlerConfig {
    /// containerd runtime type, e.g. `io.containerd.runc.v2`.
    pub runtime_type: String,
    /// OCI runtime binary the shim runs.
    #[serde(default)]
    pub binary: Option<PathBuf>,
    /// Runtime state root (runc `--root`).
    #[serde(default)]
    pub root: Option<PathBuf>,
}

/// `runtime:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Handler used when a pod names none.
    pub default_handler: String,
    /// Handlers by RuntimeClass handler name.
    pub handlers: BTreeMap<String, HandlerConfig>,
    /// Cgroup driver (`auto` by default: see [`CgroupDriver::Auto`]).
    pub cgroup_driver: CgroupDriver,
    /// Never give a container an `oom_score_adj` below the agent's own (a
    /// process without CAP_SYS_RESOURCE cannot lower it); as containerd's option.
    pub restrict_oom_score_adj: bool,
    /// Leave hugepage limits out of container specs when the node has no
    /// hugetlb controller where containers are placed (kubelet sends a zero
    /// limit per page size); when false a non-zero limit is refused. As
    /// containerd's option of the same name.
    pub tolerate_missing_hugetlb_controller: bool,
    /// Whether pods get an infra (pause) process.
    pub sandbox: SandboxMode,
    /// Give a pod without an infra process a stats anchor (a pause
    /// container with the sandbox id, in the pod's namespaces, started in
    /// the background after its first container) so a kubelet's cAdvisor
    /// reports its network (docs/infraless.md). Off for a kubelet that
    /// takes pod stats from the CRI (`PodAndContainerStatsFromCRI`).
    pub stats_anchor: bool,
    /// Make a pod container's task (`runc create`) in CreateContainer, so
    /// that StartContainer only starts it (docs/warm-pools.md, "Pre-started
    /// shims"). The container stays `CREATED` until started; stopping or
    /// removing it first deletes the task unstarted.
    pub task_at_create: bool,
    /// The most bytes of CRI log entries one container may write a second,
    /// after a burst of a second's worth (`0`: no limit). Past it the agent
    /// stops reading the container's output for a while and its writes
    /// block, so one container printing as fast as it can neither holds
    /// the agent's CPU nor fills the disk faster than this
    /// (docs/security-runtime.md).
    pub log_rate_limit: ByteSize,
}

impl RuntimeConfig {
    /// Least non-zero `log_rate_limit`: one entry of the longest line (16
    /// KiB) a second, and then some.
    pub const MIN_LOG_RATE: u64 = 64 << 10;

    /// `log_rate_limit` in bytes a second (`None`: no limit); an error
    /// naming the key when it is below [`Self::MIN_LOG_RATE`].
    pub fn log_rate(&self) -> Result<Option<u64>, ConfigError> {
        match self.log_rate_limit.0 {
            0 => Ok(None),
            r if r < Self::MIN_LOG_RATE => Err(ConfigError::Invalid {
                key: "runtime.log_rate_limit",
                message: format!("{} is below 64Ki (0 for no limit)", self.log_rate_limit),
            }),
            r => Ok(Some(r)),
        }
    }
}

/// `runtime.sandbox`: how pods get their shared namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxMode {
    /// No infra process unless the pod shares one PID namespace, has a user
    /// namespace of its own, or its handler is not runc's shim: its IPC and
    /// UTS namespaces are pinned under the state dir and containers join
    /// them by path.
    Auto,
    /// A pause container for every pod.
    Pause,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        let mut handlers = BTreeMap::new();
        handlers.insert(
            "runc".to_owned(),
            HandlerConfig {
                runtime_type: "io.containerd.runc.v2".into(),
                binary: Some("/usr/sbin/runc".into()),
                root: None,
            },
        );
        Self {
            default_handler: "runc".into(),
            handlers,
            cgroup_driver: CgroupDriver::Auto,
            restrict_oom_score_adj: true,
            tolerate_missing_hugetlb_controller: true,
            sandbox: SandboxMode::Auto,
            stats_anchor: true,
            task_at_create: true,
            log_rate_limit: ByteSize(32 << 20),
        }
    }
}

/// Network provider choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkProvider {
    /// Built-in bridge over netlink.
    Bridge,
    /// Standard CNI plugins.
    Cni,
    /// Loopback-only namespaces.
    None,
}

/// `network.bridge:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BridgeSection {
    /// Bridge device name.
    pub name: String,
    /// Pod subnet.
    pub subnet: Ipv4Net,
    /// MTU of pod interfaces.
    pub mtu: u32,
}

impl Default for BridgeSection {
    fn default() -> Self {
        Self {
            name: "cubelet0".into(),
            subnet: Ipv4Net::new_assert(Ipv4Addr::new(10, 86, 0, 0), 16),
            mtu: 1500,
        }
    }
}

/// `network.cni:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CniSection {
    /// Plugin binaries.
    pub bin_dir: PathBuf,
    /// Network configuration lists.
    pub conf_dir: PathBuf,
}

impl Default for CniSection {
    fn default() -> Self {
        Self {
            bin_dir: "/opt/cni/bin".into(),
            conf_dir: "/etc/cni/net.d".into(),
        }
    }
}

/// `network:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkConfig {
    /// Which provider runs the `network` step.
    pub provider: NetworkProvider,
    /// Bridge provider settings.
    pub bridge: BridgeSection,
    /// CNI provider settings.
    pub cni: CniSection,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            provider: NetworkProvider::Bridge,
            bridge: BridgeSection::default(),
            cni: CniSection::default(),
        }
    }
}

/// `storage.scratch:` — optional size-limited per-pod scratch space.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScratchSection {
    /// Whether pods get a scratch filesystem.
    pub enabled: bool,
    /// Pre-formatted images kept ready.
    pub pool_size: usize,
    /// Size of each image.
    pub size: ByteSize,
}

impl Default for ScratchSection {
    fn default() -> Self {
        Self {
            enabled: false,
            pool_size: 4,
            size: ByteSize(256 << 20),
        }
    }
}

/// `storage:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    /// Size of each pod's `/dev/shm`.
    pub shm_size: ByteSize,
    /// Scratch space.
    pub scratch: ScratchSection,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            shm_size: ByteSize(64 << 20),
            scratch: ScratchSection::default(),
        }
    }
}

/// `engine:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// How long a rollback may run before it is left to the GC.
    #[serde(with = "humantime_serde")]
    pub rollback_timeout: Duration,
    /// Rollbacks running at once (they queue, never rejected).
    pub rollback_concurrency: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            rollback_timeout: Duration::from_secs(120),
            rollback_concurrency: 16,
        }
    }
}

/// `gc:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GcConfig {
    /// Time between passes.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// A stopped sandbox is removed when it has been stopped this long and
    /// no CRI client (kubelet) has named it in a ListPodSandbox or
    /// PodSandboxStatus answer for this long either: kubelet no longer
    /// tracks it. One kubelet still lists stays until kubelet removes it.
    #[serde(with = "humantime_serde")]
    pub dead_sandbox_ttl: Duration,
    /// Items reclaimed at once.
    pub concurrency: usize,
}

impl Default for GcConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(60),
            dead_sandbox_ttl: Duration::from_secs(3600),
            concurrency: 4,
        }
    }
}

/// `pools:`: warm pools of resources made ahead of the pods that use them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolsConfig {
    /// Shells of pod sandboxes that RunPodSandbox claims.
    pub sandbox: SandboxPoolConfig,
}

/// `pools.sandbox:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxPoolConfig {
    /// Shells kept ready (pinned namespaces, veth on the bridge, an
    /// address, the sandbox directory with its shm); `0` turns the pool off.
    pub size: usize,
    /// Give each shell (with the bridge provider, in `runtime.sandbox:
    /// auto`) a running runc shim, held by a keeper (the pause binary in
    /// the shell's namespaces, in no pod's cgroup), which the claiming
    /// pod's containers join (docs/warm-pools.md). Off by default: with
    /// containerd 1.6 a task that joins a running shim still runs the shim
    /// binary's `start`, and it measured no faster.
    pub shim: bool,
}

impl Default for SandboxPoolConfig {
    fn default() -> Self {
        Self {
            size: 4,
            shim: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use std::path::Path;

    #[test]
    fn streaming_tls_needs_both_files() {
        let c =
            Config::from_yaml("streaming: { tls_cert_file: /etc/c.pem, tls_key_file: /etc/k.pem }")
                .unwrap();
        let tls = c.streaming.tls().unwrap().unwrap();
        assert_eq!(tls.cert_file, Path::new("/etc/c.pem"));
        assert_eq!(tls.key_file, Path::new("/etc/k.pem"));
        let e = Config::from_yaml("streaming: { tls_cert_file: /etc/c.pem }")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("streaming.tls_key_file"), "{e}");
        assert_eq!(Config::default().streaming.tls().unwrap(), None);
    }

    #[test]
    fn streaming_limits_default_to_the_servers_and_are_range_checked() {
        let d = Config::default().streaming.limits().unwrap();
        assert_eq!(d, cubelet_streaming::Limits::default());
        let c = Config::from_yaml(
            "streaming: { max_connections: 10, header_read_timeout: 3s, \
             stream_idle_timeout: 1h, max_message_size: 256Ki, max_queued_bytes: 2Mi, \
             max_sessions_per_container: 2, max_in_flight_urls: 5 }",
        )
        .unwrap();
        let l = c.streaming.limits().unwrap();
        assert_eq!(l.max_connections, 10);
        assert_eq!(l.header_read_timeout, std::time::Duration::from_secs(3));
        assert_eq!(l.stream_idle_timeout, std::time::Duration::from_secs(3600));
        assert_eq!(l.max_message_size, 256 << 10);
        assert_eq!(l.max_queued_bytes, 2 << 20);
        assert_eq!(l.max_sessions_per_container, 2);
        assert_eq!(l.max_in_flight_urls, 5);
        for (yaml, key) in [
            (
                "streaming: { max_connections: 0 }",
                "streaming.max_connections",
            ),
            (
                "streaming: { max_message_size: 1Ki }",
                "streaming.max_message_size",
            ),
            (
                "streaming: { max_queued_bytes: 2Gi }",
                "streaming.max_queued_bytes",
            ),
            (
                "streaming: { header_read_timeout: 0s }",
                "streaming.header_read_timeout",
            ),
        ] {
            let e = Config::from_yaml(yaml)
                .and_then(|c| c.validate())
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(key), "{yaml}: {e}");
        }
    }

    #[test]
    fn container_logs_are_held_to_32mi_a_second_unless_told_otherwise() {
        assert_eq!(
            Config::default().runtime.log_rate().unwrap(),
            Some(32 << 20)
        );
        let off = Config::from_yaml("runtime: { log_rate_limit: 0 }").unwrap();
        assert_eq!(off.runtime.log_rate().unwrap(), None);
        let e = Config::from_yaml("runtime: { log_rate_limit: 1Ki }")
            .and_then(|c| c.validate())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("runtime.log_rate_limit"), "{e}");
    }

    #[test]
    fn the_sandbox_pool_holds_four_shells_unless_told_otherwise() {
        assert_eq!(Config::default().pools.sandbox.size, 4);
        let c = Config::from_yaml("pools: { sandbox: { size: 0 } }").unwrap();
        assert_eq!(c.pools.sandbox.size, 0);
        let e = Config::from_yaml("pools: { sandbox: { count: 2 } }")
            .unwrap_err()
            .to_string();
        assert!(e.contains("pools.sandbox"), "{e}");
    }

    #[test]
    fn tasks_at_create_are_on_and_shell_shims_off_unless_configured() {
        let c = Config::default();
        assert!(!c.pools.sandbox.shim);
        assert!(c.runtime.task_at_create);
        let c = Config::from_yaml(
            "pools: { sandbox: { shim: true } }\nruntime: { task_at_create: false }",
        )
        .unwrap();
        assert!(c.pools.sandbox.shim);
        assert_eq!(c.pools.sandbox.size, 4);
        assert!(!c.runtime.task_at_create);
    }

    #[test]
    fn stats_anchors_are_on_unless_turned_off() {
        assert!(Config::default().runtime.stats_anchor);
        let c = Config::from_yaml("runtime: { stats_anchor: false }").unwrap();
        assert!(!c.runtime.stats_anchor);
    }

    #[test]
    fn the_sandbox_mode_is_auto_unless_pause_is_asked_for() {
        use super::SandboxMode;
        assert_eq!(Config::default().runtime.sandbox, SandboxMode::Auto);
        let c = Config::from_yaml("runtime: { sandbox: pause }").unwrap();
        assert_eq!(c.runtime.sandbox, SandboxMode::Pause);
        assert_eq!(c.runtime.default_handler, "runc", "the rest kept");
        let e = Config::from_yaml("runtime: { sandbox: none }")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("runtime.sandbox"), "{e}");
    }
}
