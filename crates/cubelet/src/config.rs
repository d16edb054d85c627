//! The agent's configuration: `config.yaml` plus `config.d/*.yaml` drop-ins.
//!
//! Every key has a default, so an empty file is valid. The main file and then
//! the drop-ins (in name order, last wins) are merged key by key over the
//! serialised defaults, so a file may change one key of any default map (one
//! flow's `concurrent`, one handler's `binary`) and leave the rest as they
//! are. An unknown key is an error naming its full path. The keys are a
//! contract: add freely, rename none.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use cubelet_engine::WorkflowConfig;
use ipnet::Ipv4Net;
use serde::{Deserialize, Deserializer, Serialize};
use serde_norway::Value;

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// CRI socket path.
    pub socket: PathBuf,
    /// Persistent state: the store, sandbox directories.
    pub root_dir: PathBuf,
    /// Volatile state: netns pins, FIFOs, the admin socket.
    pub state_dir: PathBuf,
    /// The CRI socket's transport.
    pub cri: CriConfig,
    /// containerd connection.
    pub containerd: ContainerdConfig,
    /// Admin HTTP endpoint (/metrics, /healthz, /readyz).
    pub metrics: MetricsConfig,
    /// Streaming server (exec, attach, port-forward).
    pub streaming: StreamingConfig,
    /// Images and registries.
    pub images: ImagesConfig,
    /// Runtime handlers and cgroups.
    pub runtime: RuntimeConfig,
    /// Pod networking.
    pub network: NetworkConfig,
    /// Per-pod storage.
    pub storage: StorageConfig,
    /// Workflow definitions.
    pub flows: WorkflowConfig,
    /// Engine tunables that are not per flow.
    pub engine: EngineConfig,
    /// Garbage collector.
    pub gc: GcConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            socket: "/run/cubelet/cubelet.sock".into(),
            root_dir: "/var/lib/cubelet".into(),
            state_dir: "/run/cubelet".into(),
            cri: CriConfig::default(),
            containerd: ContainerdConfig::default(),
            metrics: MetricsConfig::default(),
            streaming: StreamingConfig::default(),
            images: ImagesConfig::default(),
            runtime: RuntimeConfig::default(),
            network: NetworkConfig::default(),
            storage: StorageConfig::default(),
            flows: WorkflowConfig::default(),
            engine: EngineConfig::default(),
            gc: GcConfig::default(),
        }
    }
}

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
}

impl Default for ContainerdConfig {
    fn default() -> Self {
        Self {
            address: "/run/containerd/containerd.sock".into(),
            namespace: "k8s.cubelet.io".into(),
            root: "/var/lib/containerd".into(),
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
}

impl Default for StreamingConfig {
    fn default() -> Self {
        Self {
            address: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            idle_timeout: Duration::from_secs(4 * 60),
            tls_cert_file: None,
            tls_key_file: None,
        }
    }
}

impl StreamingConfig {
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
}

impl Default for ImagesConfig {
    fn default() -> Self {
        Self {
            pause_image: String::new(),
            pause_binary: PathBuf::new(),
            registry_config_dir: "/etc/cubelet/certs.d".into(),
        }
    }
}

/// Cgroup driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupDriver {
    /// Paths under the cgroup filesystem.
    Cgroupfs,
    /// systemd slices.
    Systemd,
}

impl CgroupDriver {
    /// Name as CRI `RuntimeConfig` reports it.
    pub fn as_str(self) -> &'static str {
        match self {
            CgroupDriver::Cgroupfs => "cgroupfs",
            CgroupDriver::Systemd => "systemd",
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
    /// Cgroup driver.
    pub cgroup_driver: CgroupDriver,
    /// Never give a container an `oom_score_adj` below the agent's own (a
    /// process without CAP_SYS_RESOURCE cannot lower it); as containerd's option.
    pub restrict_oom_score_adj: bool,
    /// Leave hugepage limits out of container specs when the node has no
    /// hugetlb controller where containers are placed (kubelet sends a zero
    /// limit per page size); when false a non-zero limit is refused. As
    /// containerd's option of the same name.
    pub tolerate_missing_hugetlb_controller: bool,
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
            cgroup_driver: CgroupDriver::Cgroupfs,
            restrict_oom_score_adj: true,
            tolerate_missing_hugetlb_controller: true,
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
            subnet: Ipv4Net::new_assert(Ipv4Addr::new(10, 88, 0, 0), 16),
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

/// A byte size written as `64Mi`, `1Gi`, `512K`, or a plain number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses `64Mi`, `1G`, `4096`, ...
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let n: u64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a size (e.g. 64Mi)"))?;
        let mult: u64 = match unit {
            "" => 1,
            "K" | "k" => 1000,
            "M" => 1000_u64.pow(2),
            "G" => 1000_u64.pow(3),
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            _ => {
                return Err(format!(
                    "{s:?}: unknown unit {unit:?} (use Ki, Mi, Gi, K, M, G)"
                ))
            }
        };
        n.checked_mul(mult)
            .map(ByteSize)
            .ok_or_else(|| format!("{s:?} is too large"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0;
        for (unit, size) in [("Gi", 1u64 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)] {
            if n >= size && n % size == 0 {
                return write!(f, "{}{unit}", n / size);
            }
        }
        write!(f, "{n}")
    }
}

impl Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(ByteSize(n)),
            Raw::S(s) => ByteSize::parse(&s).map_err(serde::de::Error::custom),
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
    /// Stopped sandboxes older than this are removed if kubelet never did.
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

/// A configuration that cannot be used; the message names the file and key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A file could not be read.
    #[error("read {path}")]
    Read {
        /// File.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file is not valid YAML.
    #[error("{path}: {source}")]
    Yaml {
        /// File.
        path: PathBuf,
        /// Parser error.
        #[source]
        source: serde_norway::Error,
    },
    /// The merged document does not fit the schema.
    #[error("{key}: {message}")]
    Schema {
        /// Dotted path of the offending key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A value is out of range.
    #[error("{key}: {message}")]
    Invalid {
        /// Dotted key.
        key: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The workflow definitions are wrong.
    #[error(transparent)]
    Flows(#[from] cubelet_engine::ConfigError),
    /// The built-in defaults could not be turned into the YAML the files are
    /// merged over (a bug, not an operator's mistake).
    #[error("cannot serialise the default configuration")]
    Defaults {
        /// Serialiser error.
        #[source]
        source: serde_norway::Error,
    },
}

impl Config {
    /// Loads `file` (which must exist) and the drop-ins of `dir` (if it exists).
    ///
    /// The main file and then each drop-in are merged key by key over the
    /// defaults, so any file may set a single key of a default map.
    pub fn load(file: &Path, dir: Option<&Path>) -> Result<Config, ConfigError> {
        let mut merged = defaults()?;
        merge(&mut merged, read_yaml(file)?);
        let dir = dir.map(Path::to_path_buf).unwrap_or_else(|| {
            file.parent()
                .unwrap_or_else(|| Path::new("."))
                .join("config.d")
        });
        for path in drop_ins(&dir)? {
            let layer = read_yaml(&path)?;
            merge(&mut merged, layer);
        }
        Self::from_value(merged)
    }

    /// Parses one YAML document (no drop-ins), merged key by key over the
    /// defaults as [`Config::load`] does.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        let value: Value = serde_norway::from_str(text).map_err(|source| ConfigError::Yaml {
            path: "<inline>".into(),
            source,
        })?;
        let mut merged = defaults()?;
        merge(&mut merged, value);
        Self::from_value(merged)
    }

    /// Deserialises the merged document and validates it.
    fn from_value(value: Value) -> Result<Config, ConfigError> {
        let config: Config = serde_path_to_error::deserialize(value).map_err(|e| {
            let key = e.path().to_string();
            ConfigError::Schema {
                key: if key == "." { "config".to_owned() } else { key },
                message: e.into_inner().to_string(),
            }
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks values that the types alone cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let abs = |key: &'static str, p: &Path| {
            if p.is_absolute() {
                Ok(())
            } else {
                Err(ConfigError::Invalid {
                    key,
                    message: format!("{} is not absolute", p.display()),
                })
            }
        };
        abs("socket", &self.socket)?;
        abs("root_dir", &self.root_dir)?;
        abs("state_dir", &self.state_dir)?;
        abs("containerd.address", &self.containerd.address)?;
        self.streaming.tls()?;
        if self.containerd.namespace.is_empty() {
            return Err(ConfigError::Invalid {
                key: "containerd.namespace",
                message: "must not be empty".into(),
            });
        }
        if !self
            .runtime
            .handlers
            .contains_key(&self.runtime.default_handler)
        {
            return Err(ConfigError::Invalid {
                key: "runtime.default_handler",
                message: format!(
                    "{:?} is not in runtime.handlers (have: {})",
                    self.runtime.default_handler,
                    self.runtime
                        .handlers
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        if self.network.bridge.subnet.prefix_len() > 30 {
            return Err(ConfigError::Invalid {
                key: "network.bridge.subnet",
                message: format!(
                    "{} leaves no room for pods (use /30 or wider)",
                    self.network.bridge.subnet
                ),
            });
        }
        if !(68..=65535).contains(&self.network.bridge.mtu) {
            return Err(ConfigError::Invalid {
                key: "network.bridge.mtu",
                message: format!("{} is outside 68..=65535", self.network.bridge.mtu),
            });
        }
        if self.gc.interval.is_zero() {
            return Err(ConfigError::Invalid {
                key: "gc.interval",
                message: "must be > 0".into(),
            });
        }
        if self.storage.shm_size.0 == 0 {
            return Err(ConfigError::Invalid {
                key: "storage.shm_size",
                message: "must be > 0".into(),
            });
        }
        Ok(())
    }
}

/// [`Config::default`] as a YAML value: the base every file is merged over.
fn defaults() -> Result<Value, ConfigError> {
    serde_norway::to_value(Config::default()).map_err(|source| ConfigError::Defaults { source })
}

fn read_yaml(path: &Path) -> Result<Value, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let value: Value = serde_norway::from_str(&text).map_err(|source| ConfigError::Yaml {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(if value.is_null() {
        Value::Mapping(Default::default())
    } else {
        value
    })
}

fn drop_ins(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(ConfigError::Read {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| ConfigError::Read {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "yaml") && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Merges `layer` into `base`: maps key by key (recursively), anything else
/// replaced. A null over a map (an empty section such as `gc:`) changes
/// nothing; a null over anything else replaces it (`binary: null` unsets an
/// optional key).
fn merge(base: &mut Value, layer: Value) {
    match (base, layer) {
        (Value::Mapping(_), Value::Null) => {}
        (Value::Mapping(b), Value::Mapping(l)) => {
            for (k, v) in l {
                match b.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (base, layer) => *base = layer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_the_documented_defaults() {
        let c = Config::from_yaml("").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.socket, Path::new("/run/cubelet/cubelet.sock"));
        assert!(c.cri.rewrite_invalid_authority);
        assert_eq!(c.containerd.namespace, "k8s.cubelet.io");
        assert_eq!(c.metrics.address.to_string(), "127.0.0.1:9385");
        assert_eq!(c.storage.shm_size, ByteSize(64 << 20));
        assert_eq!(c.gc.dead_sandbox_ttl, Duration::from_secs(3600));
        assert_eq!(c.network.bridge.subnet.to_string(), "10.88.0.0/16");
        assert_eq!(c.flows, WorkflowConfig::default());
    }

    #[test]
    fn the_design_example_parses() {
        let c = Config::from_yaml(
            r#"
socket: /run/cubelet/cubelet.sock
root_dir: /var/lib/cubelet
state_dir: /run/cubelet
containerd: { address: /run/containerd/containerd.sock, namespace: k8s.cubelet.io }
metrics: { address: "127.0.0.1:9385" }
streaming: { address: 127.0.0.1, port: 0 }
images: { pause_image: "", registry_config_dir: /etc/cubelet/certs.d }
runtime:
  default_handler: runc
  handlers:
    runc: { runtime_type: io.containerd.runc.v2, binary: /usr/sbin/runc }
  cgroup_driver: cgroupfs
  restrict_oom_score_adj: true
  tolerate_missing_hugetlb_controller: true
network:
  provider: bridge
  bridge: { name: cubelet0, subnet: 10.88.0.0/16, mtu: 1500 }
  cni: { bin_dir: /opt/cni/bin, conf_dir: /etc/cni/net.d }
storage: { shm_size: 64Mi }
flows:
  create:  { concurrent: 16, steps: [[storage, network], [sandbox]] }
  destroy: { concurrent: 32, steps: [[sandbox], [network, storage]] }
  cleanup: { concurrent: 4,  steps: [[sandbox], [network, storage]] }
gc: { interval: 60s, dead_sandbox_ttl: 1h }
"#,
        )
        .unwrap();
        assert_eq!(c, Config::default());
    }

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
    fn unknown_keys_are_named_with_their_path() {
        let e = Config::from_yaml("network: { bridge: { nmae: x } }")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("network.bridge"), "{e}");
        assert!(e.contains("nmae"), "{e}");
        let e = Config::from_yaml("sockett: /x").unwrap_err().to_string();
        assert!(e.contains("sockett"), "{e}");
    }

    #[test]
    fn bad_values_name_the_key() {
        let e = Config::from_yaml("gc: { interval: soon }")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("gc.interval"), "{e}");
        let e = Config::from_yaml("storage: { shm_size: 64Qi }")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("storage.shm_size") && e.contains("Qi"), "{e}");
        let e = Config::from_yaml("runtime: { default_handler: kata }")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("runtime.default_handler") && e.contains("kata"),
            "{e}"
        );
        let e = Config::from_yaml("socket: relative.sock")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("socket:"), "{e}");
        let e = Config::from_yaml("network: { provider: flannel }")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("network.provider"), "{e}");
    }

    #[test]
    fn drop_ins_merge_key_by_key_last_wins() {
        let dir = tempfile::tempdir().unwrap();
        let main = dir.path().join("config.yaml");
        std::fs::write(&main, "gc: { interval: 10s }\nflows: { create: { concurrent: 8, steps: [[storage, network], [sandbox]] } }\n").unwrap();
        let d = dir.path().join("config.d");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(
            d.join("20-b.yaml"),
            "flows: { create: { concurrent: 2 } }\n",
        )
        .unwrap();
        std::fs::write(
            d.join("10-a.yaml"),
            "flows: { create: { concurrent: 4 } }\ngc: { dead_sandbox_ttl: 5m }\n",
        )
        .unwrap();
        std::fs::write(d.join("ignored.txt"), "not: yaml: at all").unwrap();
        let c = Config::load(&main, None).unwrap();
        assert_eq!(c.flows.flows["create"].concurrent, 2);
        assert_eq!(
            c.flows.flows["create"].steps.len(),
            2,
            "steps kept from the main file"
        );
        assert_eq!(c.gc.interval, Duration::from_secs(10));
        assert_eq!(c.gc.dead_sandbox_ttl, Duration::from_secs(300));
    }

    #[test]
    fn default_config_round_trips() {
        let value = serde_norway::to_value(Config::default()).unwrap();
        let back: Config = serde_norway::from_value(value.clone()).unwrap();
        assert_eq!(back, Config::default());
        let text = serde_norway::to_string(&Config::default()).unwrap();
        assert_eq!(Config::from_yaml(&text).unwrap(), Config::default());
        // Through the loader too: the serialised defaults as the main file.
        let dir = tempfile::tempdir().unwrap();
        let main = dir.path().join("config.yaml");
        std::fs::write(&main, &text).unwrap();
        assert_eq!(Config::load(&main, None).unwrap(), Config::default());
        Config::default()
            .flows
            .validate(crate::PROVIDERS.iter().copied())
            .unwrap();
    }

    type Change = fn(&mut Config);

    /// One key of each default map, the YAML that sets it alone and what
    /// it must change in `Config::default()`.
    fn one_key_cases() -> Vec<(&'static str, &'static str, Change)> {
        vec![
            ("socket", "/run/other/cubelet.sock", |c| {
                c.socket = "/run/other/cubelet.sock".into()
            }),
            ("cri.rewrite_invalid_authority", "false", |c| {
                c.cri.rewrite_invalid_authority = false
            }),
            ("containerd.namespace", "other.ns", |c| {
                c.containerd.namespace = "other.ns".into()
            }),
            ("metrics.address", "0.0.0.0:9999", |c| {
                c.metrics.address = "0.0.0.0:9999".parse().unwrap()
            }),
            ("streaming.port", "10010", |c| c.streaming.port = 10010),
            ("streaming.idle_timeout", "90s", |c| {
                c.streaming.idle_timeout = Duration::from_secs(90)
            }),
            ("images.pause_image", "registry.k8s.io/pause:3.9", |c| {
                c.images.pause_image = "registry.k8s.io/pause:3.9".into()
            }),
            ("runtime.cgroup_driver", "systemd", |c| {
                c.runtime.cgroup_driver = CgroupDriver::Systemd
            }),
            ("runtime.handlers.runc.binary", "/usr/local/bin/runc", |c| {
                c.runtime.handlers.get_mut("runc").unwrap().binary =
                    Some("/usr/local/bin/runc".into())
            }),
            ("runtime.handlers.runc.binary", "null", |c| {
                c.runtime.handlers.get_mut("runc").unwrap().binary = None
            }),
            (
                "runtime.handlers.kata",
                "{ runtime_type: io.containerd.kata.v2 }",
                |c| {
                    c.runtime.handlers.insert(
                        "kata".into(),
                        HandlerConfig {
                            runtime_type: "io.containerd.kata.v2".into(),
                            binary: None,
                            root: None,
                        },
                    );
                },
            ),
            ("network.provider", "cni", |c| {
                c.network.provider = NetworkProvider::Cni
            }),
            ("network.bridge.mtu", "9000", |c| {
                c.network.bridge.mtu = 9000
            }),
            ("network.cni.conf_dir", "/etc/cni/other.d", |c| {
                c.network.cni.conf_dir = "/etc/cni/other.d".into()
            }),
            ("storage.shm_size", "128Mi", |c| {
                c.storage.shm_size = ByteSize(128 << 20)
            }),
            ("storage.scratch.pool_size", "8", |c| {
                c.storage.scratch.pool_size = 8
            }),
            ("storage.scratch.size", "1Gi", |c| {
                c.storage.scratch.size = ByteSize(1 << 30)
            }),
            ("flows.create.concurrent", "2", |c| {
                c.flows.flows.get_mut("create").unwrap().concurrent = 2
            }),
            (
                "flows.create",
                "{ steps: [[storage], [network], [sandbox]] }",
                |c| {
                    c.flows.flows.get_mut("create").unwrap().steps = vec![
                        vec!["storage".into()],
                        vec!["network".into()],
                        vec!["sandbox".into()],
                    ]
                },
            ),
            ("flows.destroy.concurrent", "3", |c| {
                c.flows.flows.get_mut("destroy").unwrap().concurrent = 3
            }),
            ("flows.cleanup.concurrent", "1", |c| {
                c.flows.flows.get_mut("cleanup").unwrap().concurrent = 1
            }),
            ("engine.rollback_timeout", "30s", |c| {
                c.engine.rollback_timeout = Duration::from_secs(30)
            }),
            ("gc.interval", "5s", |c| {
                c.gc.interval = Duration::from_secs(5)
            }),
        ]
    }

    /// `a.b.c` and `v` as the YAML document `{a: {b: {c: v}}}`.
    fn nested(path: &str, value: &str) -> String {
        let mut v: Value = serde_norway::from_str(value).unwrap();
        for key in path.rsplit('.') {
            let mut m = serde_norway::Mapping::new();
            m.insert(Value::String(key.to_owned()), v);
            v = Value::Mapping(m);
        }
        serde_norway::to_string(&v).unwrap()
    }

    fn expected(change: Change) -> Config {
        let mut c = Config::default();
        change(&mut c);
        assert_ne!(c, Config::default(), "the case changes nothing");
        c
    }

    fn map_paths(prefix: &str, value: &Value, out: &mut Vec<String>) {
        if let Value::Mapping(m) = value {
            out.push(prefix.to_owned());
            for (k, v) in m {
                let k = k.as_str().unwrap();
                let path = if prefix.is_empty() {
                    k.to_owned()
                } else {
                    format!("{prefix}.{k}")
                };
                map_paths(&path, v, out);
            }
        }
    }

    #[test]
    fn the_one_key_cases_cover_every_default_map() {
        let mut maps = Vec::new();
        map_paths(
            "",
            &serde_norway::to_value(Config::default()).unwrap(),
            &mut maps,
        );
        assert!(maps.len() > 15, "{maps:?}");
        let cases = one_key_cases();
        for map in maps {
            let covered = cases.iter().any(|(path, _, _)| {
                let parent = path.rsplit_once('.').map_or("", |(p, _)| p);
                parent == map
            });
            assert!(covered, "no one-key case sets a key directly in `{map}`");
        }
    }

    #[test]
    fn a_drop_in_changes_one_key_of_any_default_map_alone() {
        for (path, value, change) in one_key_cases() {
            let dir = tempfile::tempdir().unwrap();
            let main = dir.path().join("config.yaml");
            std::fs::write(&main, "").unwrap();
            let d = dir.path().join("config.d");
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("50-one.yaml"), nested(path, value)).unwrap();
            let c = Config::load(&main, None)
                .unwrap_or_else(|e| panic!("drop-in {path}: {value}: {e}"));
            assert_eq!(c, expected(change), "drop-in {path}: {value}");
            c.flows
                .validate(crate::PROVIDERS.iter().copied())
                .unwrap_or_else(|e| panic!("drop-in {path}: {value}: {e}"));
        }
    }

    #[test]
    fn the_main_file_changes_one_key_of_any_default_map_alone() {
        for (path, value, change) in one_key_cases() {
            let dir = tempfile::tempdir().unwrap();
            let main = dir.path().join("config.yaml");
            std::fs::write(&main, nested(path, value)).unwrap();
            let c = Config::load(&main, None)
                .unwrap_or_else(|e| panic!("main file {path}: {value}: {e}"));
            assert_eq!(c, expected(change), "main file {path}: {value}");
            let inline = Config::from_yaml(&nested(path, value))
                .unwrap_or_else(|e| panic!("inline {path}: {value}: {e}"));
            assert_eq!(inline, c, "inline {path}: {value}");
        }
    }

    #[test]
    fn one_flow_key_alone_as_the_issue_wrote_it() {
        let c = Config::from_yaml("flows: { create: { concurrent: 2 } }").unwrap();
        assert_eq!(c.flows.flows["create"].concurrent, 2);
        assert_eq!(
            c.flows.flows["create"].steps,
            WorkflowConfig::default().flows["create"].steps
        );
        assert_eq!(
            c.flows.flows["destroy"],
            WorkflowConfig::default().flows["destroy"]
        );
        c.flows.validate(crate::PROVIDERS.iter().copied()).unwrap();
    }

    #[test]
    fn an_empty_section_keeps_its_defaults() {
        for text in [
            "gc:",
            "flows:",
            "runtime: { handlers: }",
            "flows: { create: }",
        ] {
            assert_eq!(
                Config::from_yaml(text).unwrap(),
                Config::default(),
                "{text}"
            );
        }
    }

    #[test]
    fn unknown_keys_in_drop_ins_are_named_with_their_path() {
        let dir = tempfile::tempdir().unwrap();
        let main = dir.path().join("config.yaml");
        std::fs::write(&main, "").unwrap();
        let d = dir.path().join("config.d");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("10-x.yaml"), "flows: { create: { concurent: 2 } }").unwrap();
        let e = Config::load(&main, None).unwrap_err().to_string();
        assert!(e.starts_with("flows.create"), "{e}");
        assert!(e.contains("concurent"), "{e}");
    }

    #[test]
    fn missing_file_is_an_error_naming_it() {
        let e = Config::load(Path::new("/nonexistent/cubelet.yaml"), None).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cubelet.yaml"), "{e}");
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(ByteSize::parse("64Mi").unwrap(), ByteSize(64 << 20));
        assert_eq!(ByteSize::parse("1G").unwrap(), ByteSize(1_000_000_000));
        assert_eq!(ByteSize::parse("4096").unwrap(), ByteSize(4096));
        assert!(ByteSize::parse("x").is_err());
        assert_eq!(ByteSize(64 << 20).to_string(), "64Mi");
    }
}
