//! Connecting to a port inside a pod's network namespace.
//!
//! Entering a namespace is the network crate's business (docs/DESIGN.md:
//! the only crate that calls setns), so the streaming server gets a
//! [`PodDialer`] from the binary, which wires in
//! `cubelet_network::connect_in_netns`.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use futures::future::BoxFuture;

/// Opens TCP connections to `localhost:port` inside a pod's network namespace.
pub trait PodDialer: Send + Sync + fmt::Debug + 'static {
    /// Connects inside the namespace pinned at `netns` (the agent's own
    /// namespace when `None`).
    fn dial(
        &self,
        netns: Option<PathBuf>,
        port: u16,
    ) -> BoxFuture<'static, io::Result<tokio::net::TcpStream>>;
}

/// A dialer for the agent's own namespace only (tests, host-network pods);
/// refuses pod namespaces.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostDialer;

impl PodDialer for HostDialer {
    fn dial(
        &self,
        netns: Option<PathBuf>,
        port: u16,
    ) -> BoxFuture<'static, io::Result<tokio::net::TcpStream>> {
        Box::pin(async move {
            if let Some(ns) = netns {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("no dialer for pod network namespace {}", ns.display()),
                ));
            }
            tokio::net::TcpStream::connect(("127.0.0.1", port)).await
        })
    }
}

/// Where a port-forward session connects: a namespace and the dialer for it.
#[derive(Debug, Clone)]
pub(crate) struct PodTarget {
    pub(crate) netns: Option<PathBuf>,
    pub(crate) dialer: Arc<dyn PodDialer>,
}

impl PodTarget {
    /// Connects to `port` in the target namespace.
    pub(crate) async fn dial(&self, port: u16) -> io::Result<tokio::net::TcpStream> {
        self.dialer.dial(self.netns.clone(), port).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn dials_host_loopback_without_a_namespace() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            s.write_all(b"hi").await.unwrap();
        });
        let target = PodTarget {
            netns: None,
            dialer: Arc::new(HostDialer),
        };
        let mut c = target.dial(port).await.unwrap();
        let mut buf = Vec::new();
        c.read_to_end(&mut buf).await.unwrap();
        assert_eq!(buf, b"hi");
        server.await.unwrap();
        let missing = HostDialer
            .dial(Some(PathBuf::from("/nonexistent/test-netns")), port)
            .await;
        assert!(missing
            .unwrap_err()
            .to_string()
            .contains("/nonexistent/test-netns"));
    }
}
