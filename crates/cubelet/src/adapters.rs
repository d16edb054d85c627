//! Glue between crates that must not know each other: the store as the
//! network's lease store, metrics as the CRI, warm-pool and image-pull observers, the image service as
//! the sandbox step's pause image source, readiness as CRI conditions, and
//! the containerd runtime plus the network crate's namespace dialing as the
//! streaming server's backend, and the network crate's namespace threads as
//! the pod network counters of sandboxes without an infra process.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use cubelet_engine::{BoxError, SandboxId};
use cubelet_metrics::{Metrics, Readiness};
use cubelet_network::LeaseStore;
use cubelet_runtime::container::ContainerRuntime;
use cubelet_runtime::io::exec_stream::{ExecProcess, ExecStreamOptions};
use cubelet_runtime::io::logs::Stream as LogStream;
use cubelet_runtime::RuntimeError;
use cubelet_store::{IpLease, Store, StoreError};
use cubelet_streaming::{
    AttachOutput, BackendError, ExecIo, ExecOptions, Lagged, OutputChunk, OutputStream, Reader,
    StreamBackend, TerminalSize, Writer,
};
use futures::future::BoxFuture;
use futures::StreamExt;
use tokio::sync::broadcast;

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
        // Buffered: the flow that takes it is journaled (see the method).
        match self.0.add_lease_buffered(&lease) {
            Ok(()) => Ok(true),
            Err(StoreError::AlreadyLeased { .. }) => Ok(false),
            Err(e) => Err(Box::new(e)),
        }
    }

    fn release_sandbox(&self, pool: &str, sandbox: &SandboxId) -> Result<Vec<IpAddr>, BoxError> {
        Ok(self.0.release_leases_in(pool, sandbox)?)
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

/// Warm-pool metrics (`cubelet_pool_*`).
#[derive(Debug)]
pub(crate) struct PoolMetrics(pub(crate) Metrics);

impl cubelet_pod::PoolObserver for PoolMetrics {
    fn claimed(&self, hit: bool) {
        self.0.pool_claim(hit);
    }

    fn ready(&self, n: usize) {
        self.0.set_pool_ready(n);
    }
}

/// Metrics as the pod service's stats-anchor observer.
#[derive(Debug)]
pub(crate) struct AnchorMetrics(pub(crate) Metrics);

impl cubelet_pod::AnchorObserver for AnchorMetrics {
    fn observed(&self, started: bool) {
        self.0.stats_anchor(started);
    }
}

/// Metrics as the image service's pull observer.
#[derive(Debug)]
pub(crate) struct PullMetrics(pub(crate) Metrics);

impl cubelet_runtime::image::PullObserver for PullMetrics {
    fn pull_started(&self) {
        self.0.pull_started();
    }

    fn pull_finished(&self, size: Option<u64>, elapsed: Duration) {
        self.0.pull_finished(size, elapsed);
    }
}

/// CRI `Status` conditions from the agent's readiness.
#[derive(Debug)]
pub(crate) struct Conditions {
    pub(crate) readiness: Readiness,
    pub(crate) network: crate::network::PodNetwork,
    /// The runtime handlers, whose binaries are checked on every `Status`
    /// (a `stat` each): one removed or never installed makes the runtime
    /// not ready, naming it.
    pub(crate) handlers: std::collections::BTreeMap<String, crate::config::HandlerConfig>,
}

impl cubelet_cri::NodeConditions for Conditions {
    fn runtime_ready(&self) -> (bool, String, String) {
        if let Some(message) = crate::check::missing_runtime_binary(&self.handlers) {
            return (false, "RuntimeBinaryMissing".to_owned(), message);
        }
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

/// The streaming server's backend: exec and attach on the containerd
/// runtime; port forwarding dials inside pod namespaces through the network
/// crate, the only crate that enters namespaces.
#[derive(Debug)]
pub(crate) struct RuntimeStreams(pub(crate) Arc<ContainerRuntime>);

fn boxed(e: RuntimeError) -> BackendError {
    Box::new(e)
}

impl StreamBackend for RuntimeStreams {
    fn exec<'a>(
        &'a self,
        container_id: &'a str,
        cmd: &'a [String],
        opts: ExecOptions,
    ) -> BoxFuture<'a, Result<ExecIo, BackendError>> {
        Box::pin(async move {
            let opts = ExecStreamOptions {
                stdin: opts.stdin,
                tty: opts.tty,
            };
            let es = self
                .0
                .exec_stream(container_id, cmd, &opts)
                .await
                .map_err(boxed)?;
            Ok(ExecIo {
                stdin: es.stdin.map(|w| Box::new(w) as Writer),
                stdout: Box::new(es.stdout),
                stderr: es.stderr.map(|r| Box::new(r) as Reader),
                process: Box::new(RuntimeExec(es.process)),
            })
        })
    }

    fn attach_output(&self, container_id: &str) -> Option<AttachOutput> {
        let rx = self.0.attach_output(container_id)?;
        Some(
            futures::stream::unfold(rx, |mut rx| async move {
                let item = match rx.recv().await {
                    Ok(c) => Ok(OutputChunk {
                        stream: match c.stream {
                            LogStream::Stdout => OutputStream::Stdout,
                            LogStream::Stderr => OutputStream::Stderr,
                        },
                        data: c.data,
                    }),
                    Err(broadcast::error::RecvError::Lagged(n)) => Err(Lagged(n)),
                    Err(broadcast::error::RecvError::Closed) => return None,
                };
                Some((item, rx))
            })
            .boxed(),
        )
    }

    fn open_stdin(&self, container_id: &str) -> Result<Option<Writer>, BackendError> {
        Ok(self
            .0
            .open_stdin(container_id)
            .map_err(boxed)?
            .map(|w| Box::new(w) as Writer))
    }

    fn attach_stdin_closed<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            self.0
                .attach_stdin_closed(container_id)
                .await
                .map_err(boxed)
        })
    }

    fn resize_container<'a>(
        &'a self,
        container_id: &'a str,
        size: TerminalSize,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            self.0
                .resize_container_pty(container_id, size.width, size.height)
                .await
                .map_err(boxed)
        })
    }

    fn wait_container<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<i32, BackendError>> {
        Box::pin(async move { self.0.wait_container(container_id).await.map_err(boxed) })
    }

    fn dial(
        &self,
        netns: Option<PathBuf>,
        port: u16,
    ) -> BoxFuture<'static, std::io::Result<tokio::net::TcpStream>> {
        Box::pin(cubelet_network::connect_in_netns(netns, port))
    }
}

/// One streaming exec process in containerd.
#[derive(Debug)]
struct RuntimeExec(ExecProcess);

impl cubelet_streaming::ExecProcess for RuntimeExec {
    fn wait(&self) -> BoxFuture<'_, Result<i32, BackendError>> {
        Box::pin(async move { self.0.wait().await.map_err(boxed) })
    }

    fn resize(&self, size: TerminalSize) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move { self.0.resize(size.width, size.height).await.map_err(boxed) })
    }

    fn close_stdin(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move { self.0.close_stdin().await.map_err(boxed) })
    }

    fn kill(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move { self.0.kill().await.map_err(boxed) })
    }

    fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(self.0.cleanup())
    }
}

/// Pod network counters of sandboxes without an infra process, read inside
/// their pinned namespaces by the network crate.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct NetnsCounters;

impl cubelet_pod::NetnsCounters for NetnsCounters {
    fn net_dev(&self, netns: PathBuf) -> BoxFuture<'static, std::io::Result<String>> {
        Box::pin(cubelet_network::net_dev_in_netns(netns))
    }
}
