//! Glue between crates that must not know each other: the store as the
//! network's lease store, metrics as the CRI observer, the image service as
//! the sandbox step's pause image source, and readiness as CRI conditions.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use cubelet_engine::{BoxError, SandboxId};
use cubelet_metrics::{Metrics, Readiness};
use cubelet_network::LeaseStore;
use cubelet_store::{IpLease, Store, StoreError};

/// The redb store as the bridge provider's IPAM backend.
#[derive(Debug)]
pub(crate) struct StoreLeases(pub(crate) Arc<Store>);

impl LeaseStore for StoreLeases {
    fn add(&self, pool: &str, ip: IpAddr, sandbox: &SandboxId) -> Result<bool, BoxError> {
        let lease = IpLease {
            ip,
            sandbox_id: sandbox.clone(),
            pool: pool.to_owned(),
            allocated_at: SystemTime::now(),
        };
        match self.0.add_lease(&lease) {
            Ok(()) => Ok(true),
            Err(StoreError::AlreadyLeased { .. }) => Ok(false),
            Err(e) => Err(Box::new(e)),
        }
    }

    fn release_sandbox(&self, pool: &str, sandbox: &SandboxId) -> Result<Vec<IpAddr>, BoxError> {
        let mut freed = Vec::new();
        for lease in self.0.list_leases(pool)? {
            if &lease.sandbox_id == sandbox && self.0.release_lease(pool, lease.ip)? {
                freed.push(lease.ip);
            }
        }
        Ok(freed)
    }

    fn list(&self, pool: &str) -> Result<Vec<(IpAddr, SandboxId)>, BoxError> {
        Ok(self
            .0
            .list_leases(pool)?
            .into_iter()
            .map(|l| (l.ip, l.sandbox_id))
            .collect())
    }
}

/// CRI request metrics.
#[derive(Debug)]
pub(crate) struct CriMetrics(pub(crate) Metrics);

impl cubelet_cri::CriObserver for CriMetrics {
    fn request(&self, method: &'static str, code: tonic::Code, elapsed: Duration) {
        self.0.cri_request(method, &format!("{code:?}"), elapsed);
    }

    fn events_dropped(&self, n: u64) {
        self.0.events_dropped(n);
    }
}

/// CRI `Status` conditions from the agent's readiness.
#[derive(Debug)]
pub(crate) struct Conditions {
    pub(crate) readiness: Readiness,
    pub(crate) network: crate::network::PodNetwork,
}

impl cubelet_cri::NodeConditions for Conditions {
    fn runtime_ready(&self) -> (bool, String, String) {
        match self.readiness.reason() {
            None if self.readiness.is_ready() => (true, String::new(), String::new()),
            reason => (
                false,
                "CubeletNotReady".to_owned(),
                reason.unwrap_or_else(|| "starting".to_owned()),
            ),
        }
    }

    fn network_ready(&self) -> (bool, String, String) {
        self.network.ready()
    }
}

/// Port forwarding dials inside pod namespaces through the network crate,
/// the only crate that enters namespaces.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct NetnsDialer;

impl cubelet_cri::PodDialer for NetnsDialer {
    fn dial(
        &self,
        netns: Option<PathBuf>,
        port: u16,
    ) -> futures::future::BoxFuture<'static, std::io::Result<tokio::net::TcpStream>> {
        Box::pin(cubelet_network::connect_in_netns(netns, port))
    }
}
