//! Connecting to a port inside a pod's network namespace.
//!
//! Entering a namespace is the network crate's business (docs/DESIGN.md: the
//! only crate that calls setns), so the server dials through its
//! [`StreamBackend`], which the binary implements with
//! `cubelet_network::connect_in_netns`.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use crate::StreamBackend;

/// Where a port-forward session connects: a namespace and the backend that
/// dials in it.
#[derive(Debug, Clone)]
pub(crate) struct PodTarget {
    pub(crate) netns: Option<PathBuf>,
    pub(crate) backend: Arc<dyn StreamBackend>,
}

impl PodTarget {
    /// Connects to `port` in the target namespace.
    pub(crate) async fn dial(&self, port: u16) -> io::Result<tokio::net::TcpStream> {
        self.backend.dial(self.netns.clone(), port).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeBackend;
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
            backend: Arc::new(FakeBackend::default()),
        };
        let mut c = target.dial(port).await.unwrap();
        let mut buf = Vec::new();
        c.read_to_end(&mut buf).await.unwrap();
        assert_eq!(buf, b"hi");
        server.await.unwrap();
        let missing = PodTarget {
            netns: Some(PathBuf::from("/nonexistent/test-netns")),
            ..target
        }
        .dial(port)
        .await;
        assert!(missing
            .unwrap_err()
            .to_string()
            .contains("/nonexistent/test-netns"));
    }
}
