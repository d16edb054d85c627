//! The configured pod network provider (`network.provider`): the built-in
//! bridge, standard CNI plugins, or `none` (loopback-only namespaces),
//! behind one type for wiring, GC and status.

use std::sync::Arc;

use anyhow::Result;
use cubelet_engine::{Collector, Flow};
use cubelet_network::{BridgeConfig, BridgeNetwork, CniConfig, CniNetwork, NoneNetwork, Readiness};
use cubelet_store::Store;

use crate::adapters::StoreLeases;
use crate::config::{Config, NetworkProvider};

/// Debian installs the standard plugins here rather than in `/opt/cni/bin`.
const DEBIAN_CNI_DIR: &str = "/usr/lib/cni";

/// The provider that runs the `network` step.
#[derive(Debug, Clone)]
pub(crate) enum PodNetwork {
    /// Built-in bridge over netlink.
    Bridge(Arc<BridgeNetwork>),
    /// CNI plugins.
    Cni(Arc<CniNetwork>),
    /// A namespace with only loopback per pod.
    None(Arc<NoneNetwork>),
}

impl PodNetwork {
    /// Builds the configured provider.
    pub(crate) fn build(config: &Config, store: &Arc<Store>) -> Result<Self> {
        Ok(match config.network.provider {
            NetworkProvider::Bridge => PodNetwork::Bridge(Arc::new(BridgeNetwork::new(
                BridgeConfig {
                    name: config.network.bridge.name.clone(),
                    subnet: config.network.bridge.subnet,
                    mtu: config.network.bridge.mtu,
                    state_dir: config.state_dir.clone(),
                },
                Arc::new(StoreLeases(Arc::clone(store))),
            )?)),
            NetworkProvider::Cni => {
                let mut bin_dirs = vec![config.network.cni.bin_dir.clone()];
                if config.network.cni.bin_dir.as_path() != std::path::Path::new(DEBIAN_CNI_DIR) {
                    bin_dirs.push(DEBIAN_CNI_DIR.into());
                }
                PodNetwork::Cni(Arc::new(CniNetwork::new(CniConfig {
                    bin_dirs,
                    conf_dir: config.network.cni.conf_dir.clone(),
                    state_dir: config.state_dir.clone(),
                    // Persistent: host-local leases survive a reboot, so DEL must too.
                    cache_dir: config.root_dir.join("cni"),
                })?))
            }
            NetworkProvider::None => {
                PodNetwork::None(Arc::new(NoneNetwork::new(config.state_dir.clone())?))
            }
        })
    }

    /// The provider as an engine step.
    pub(crate) fn flow(&self) -> Arc<dyn Flow> {
        match self {
            PodNetwork::Bridge(b) => Arc::clone(b) as Arc<dyn Flow>,
            PodNetwork::Cni(c) => Arc::clone(c) as Arc<dyn Flow>,
            PodNetwork::None(n) => Arc::clone(n) as Arc<dyn Flow>,
        }
    }

    /// The provider as a garbage collector.
    pub(crate) fn collector(&self) -> &dyn Collector {
        match self {
            PodNetwork::Bridge(b) => &**b,
            PodNetwork::Cni(c) => &**c,
            PodNetwork::None(n) => &**n,
        }
    }

    /// CRI `NetworkReady`: `(ready, reason, message)`.
    pub(crate) fn ready(&self) -> (bool, String, String) {
        match self {
            PodNetwork::Bridge(_) | PodNetwork::None(_) => (true, String::new(), String::new()),
            PodNetwork::Cni(c) => match c.ready() {
                Readiness::Ready => (true, String::new(), String::new()),
                Readiness::NotReady { reason, message } => (false, reason.to_owned(), message),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_none_builds_a_ready_network_step() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("cubelet.redb")).unwrap());
        let config = Config::from_yaml("network: { provider: none }").unwrap();
        let net = PodNetwork::build(&config, &store).unwrap();
        assert!(matches!(net, PodNetwork::None(_)), "{net:?}");
        assert_eq!(net.ready(), (true, String::new(), String::new()));
        let _step = net.flow();
    }
}
