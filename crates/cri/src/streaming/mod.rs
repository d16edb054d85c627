//! The streaming server: exec, attach and port-forward over WebSocket and
//! SPDY/3.1.
//!
//! CRI `Exec`, `Attach` and `PortForward` only validate the request, store
//! it under a single-use random token that expires after the idle timeout,
//! and return `http(s)://<address>:<port>/<kind>/<token>` (https when the
//! server has a certificate, see [`TlsFiles`]). The client (kubelet,
//! crictl, kubectl through the API server) then connects to that URL on this
//! server's own TCP listener and upgrades to WebSocket with the Kubernetes
//! channel protocol (`v4.channel.k8s.io`, `v5.channel.k8s.io`), or to
//! SPDY/3.1 (`X-Stream-Protocol-Version: v4.channel.k8s.io` .. `channel.k8s.io`,
//! or `portforward.k8s.io`), which crictl and kubelet's proxy speak.

mod channel;
mod cri;
mod dial;
mod http;
mod session;
mod spdy;
mod spdy_remote;
mod spdy_session;
mod tls;
mod tokens;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cubelet_runtime::container::ContainerRuntime;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use self::dial::{HostDialer, PodDialer};
pub use self::tls::TlsFiles;
use self::tokens::TokenStore;

/// Default idle timeout of a token (kubelet's streaming server: 4 minutes).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(4 * 60);

/// Where and how the streaming server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamingConfig {
    /// Listen address.
    pub address: IpAddr,
    /// Port; 0 picks a free one.
    pub port: u16,
    /// How long a returned URL stays usable.
    pub idle_timeout: Duration,
    /// Serve HTTPS with this certificate; `None` = plain HTTP.
    pub tls: Option<TlsFiles>,
}

impl Default for StreamingConfig {
    fn default() -> Self {
        Self {
            address: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            tls: None,
        }
    }
}

/// A request waiting for its client to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Pending {
    /// Run a command in a container.
    Exec {
        container_id: String,
        cmd: Vec<String>,
        streams: Streams,
    },
    /// Attach to a container's own stdio.
    Attach {
        container_id: String,
        streams: Streams,
    },
    /// Forward ports into a sandbox's network namespace.
    PortForward {
        sandbox_id: String,
        /// `None` for a host-network sandbox.
        netns: Option<PathBuf>,
        /// Ports named in the CRI request (used when the URL names none).
        ports: Vec<u16>,
    },
}

impl Pending {
    fn path(&self) -> &'static str {
        match self {
            Pending::Exec { .. } => "exec",
            Pending::Attach { .. } => "attach",
            Pending::PortForward { .. } => "portforward",
        }
    }
}

/// Which stdio streams a remote command uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Streams {
    pub(crate) stdin: bool,
    pub(crate) stdout: bool,
    pub(crate) stderr: bool,
    pub(crate) tty: bool,
}

pub(crate) struct Shared {
    addr: SocketAddr,
    /// Present when serving HTTPS.
    tls: Option<tokio_rustls::TlsAcceptor>,
    tokens: TokenStore<Pending>,
    /// Connects port-forward sessions inside pod namespaces.
    pub(crate) dialer: Arc<dyn PodDialer>,
}

/// Handle of the streaming server: cheap to clone; the CRI shim stores
/// requests through it, the binary runs it with [`StreamingServer::serve`].
#[derive(Clone)]
pub struct StreamingServer {
    shared: Arc<Shared>,
    listener: Arc<std::sync::Mutex<Option<TcpListener>>>,
}

impl std::fmt::Debug for StreamingServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingServer")
            .field("addr", &self.shared.addr)
            .finish_non_exhaustive()
    }
}

impl StreamingServer {
    /// Loads the TLS certificate if any and binds the listener (port 0 = a
    /// free port). Serving starts with [`StreamingServer::serve`].
    pub async fn bind(
        config: &StreamingConfig,
        dialer: Arc<dyn PodDialer>,
    ) -> std::io::Result<Self> {
        let tls = config.tls.as_ref().map(tls::acceptor).transpose()?;
        let listener = TcpListener::bind(SocketAddr::new(config.address, config.port)).await?;
        let addr = listener.local_addr()?;
        Ok(Self {
            shared: Arc::new(Shared {
                addr,
                tls,
                tokens: TokenStore::new(config.idle_timeout),
                dialer,
            }),
            listener: Arc::new(std::sync::Mutex::new(Some(listener))),
        })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// Stores `req` and returns the URL its client must use.
    pub(crate) fn register(&self, req: Pending) -> std::io::Result<String> {
        let kind = req.path();
        let token = self.shared.tokens.insert(req)?;
        let scheme = if self.shared.tls.is_some() {
            "https"
        } else {
            "http"
        };
        Ok(format!("{scheme}://{}/{kind}/{token}", self.shared.addr))
    }

    /// Serves connections until `shutdown` is cancelled, running sessions on
    /// `runtime`. Sessions in progress finish on their own. Serving twice is
    /// an error.
    pub async fn serve(
        &self,
        runtime: Arc<ContainerRuntime>,
        shutdown: CancellationToken,
    ) -> std::io::Result<()> {
        let listener = self
            .listener
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| std::io::Error::other("the streaming server is already serving"))?;
        http::serve(listener, Arc::clone(&self.shared), runtime, shutdown).await
    }
}
