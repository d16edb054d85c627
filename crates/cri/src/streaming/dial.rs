//! Connecting to a port inside a pod's network namespace.
//!
//! `setns` acts on the calling thread, so the socket is made on a fresh OS
//! thread that enters the namespace, connects, and exits; no async task
//! ever runs in another namespace. The connected socket stays in the pod's
//! namespace whatever thread uses it afterwards.
//!
//! This is the one `setns` outside the network crate (DESIGN.md wants it
//! there); it should move behind a network-crate function once that crate
//! exports one.

use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use nix::sched::{setns, CloneFlags};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

fn connect_local(port: u16) -> io::Result<TcpStream> {
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    match TcpStream::connect_timeout(&v4, CONNECT_TIMEOUT) {
        Ok(s) => Ok(s),
        Err(e4) => {
            let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
            TcpStream::connect_timeout(&v6, CONNECT_TIMEOUT).map_err(|_| e4)
        }
    }
}

fn dial_blocking(netns: Option<PathBuf>, port: u16) -> io::Result<TcpStream> {
    if let Some(ns) = netns {
        let f = File::open(&ns).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("open network namespace {}: {e}", ns.display()),
            )
        })?;
        setns(&f, CloneFlags::CLONE_NEWNET).map_err(|e| {
            io::Error::other(format!("enter network namespace {}: {e}", ns.display()))
        })?;
    }
    connect_local(port)
}

/// Connects to `localhost:port` in the namespace pinned at `netns` (the
/// host's own namespace when `None`).
pub(crate) async fn dial(netns: Option<PathBuf>, port: u16) -> io::Result<tokio::net::TcpStream> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("cubelet-pf-dial".to_owned())
        .spawn(move || {
            // The thread ends right after, so its namespace dies with it.
            let _ = tx.send(dial_blocking(netns, port));
        })?;
    let std_stream = rx
        .await
        .map_err(|_| io::Error::other("port-forward dial thread panicked"))??;
    std_stream.set_nonblocking(true)?;
    tokio::net::TcpStream::from_std(std_stream)
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
        let mut c = dial(None, port).await.unwrap();
        let mut buf = Vec::new();
        c.read_to_end(&mut buf).await.unwrap();
        assert_eq!(buf, b"hi");
        server.await.unwrap();
        let missing = dial(Some(PathBuf::from("/nonexistent/test-netns")), port).await;
        assert!(missing
            .unwrap_err()
            .to_string()
            .contains("/nonexistent/test-netns"));
    }
}
