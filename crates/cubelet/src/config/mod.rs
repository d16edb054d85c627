//! The agent's configuration: `config.yaml` plus `config.d/*.yaml` drop-ins.
//!
//! Every key has a default, so an empty file is valid. The main file and then
//! the drop-ins (in name order, last wins) are merged key by key over the
//! serialised defaults, so a file may change one key of any default map (one
//! flow's `concurrent`, one handler's `binary`) and leave the rest as they
//! are. An unknown key is an error naming its full path. The keys are a
//! contract: add freely, rename none.
//!
//! The parts: the model ([`Config`] here, its sections in `sections`, sizes
//! in `bytesize`), `load` (files, drop-ins, the key-by-key merge), `validate`
//! (what the types alone cannot check) and `error`.

mod bytesize;
mod error;
mod load;
mod sections;
mod validate;

use std::path::PathBuf;

use cubelet_engine::WorkflowConfig;
use serde::{Deserialize, Serialize};

pub use self::bytesize::ByteSize;
pub use self::error::ConfigError;
pub use self::sections::{
    BridgeSection, CgroupDriver, CniSection, ContainerdConfig, CriConfig, EngineConfig, GcConfig,
    HandlerConfig, ImagesConfig, MetricsConfig, NetworkConfig, NetworkProvider, PoolsConfig,
    RuntimeConfig, SandboxMode, SandboxPoolConfig, ScratchSection, StorageConfig, StreamingConfig,
};

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
    /// Warm pools.
    pub pools: PoolsConfig,
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
            pools: PoolsConfig::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::time::Duration;

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
        assert_eq!(c.images.pull_progress_timeout, Duration::from_secs(300));
        assert_eq!(c.network.bridge.subnet.to_string(), "10.86.0.0/16");
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
  cgroup_driver: auto
  restrict_oom_score_adj: true
  tolerate_missing_hugetlb_controller: true
  sandbox: auto
network:
  provider: bridge
  bridge: { name: cubelet0, subnet: 10.86.0.0/16, mtu: 1500 }
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

    #[test]
    fn pull_progress_timeout_is_a_duration_and_zero_is_allowed() {
        let c = Config::from_yaml("images: { pull_progress_timeout: 3s }").unwrap();
        assert_eq!(c.images.pull_progress_timeout, Duration::from_secs(3));
        let c = Config::from_yaml("images: { pull_progress_timeout: 0s }").unwrap();
        assert_eq!(c.images.pull_progress_timeout, Duration::ZERO);
        let err = Config::from_yaml("images: { pull_progress_timeout: soon }").unwrap_err();
        assert!(err.to_string().contains("pull_progress_timeout"), "{err}");
        let err = Config::from_yaml("images: { pull_timeout: 3s }").unwrap_err();
        assert!(err.to_string().contains("pull_timeout"), "{err}");
    }
}
