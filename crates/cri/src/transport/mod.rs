//! The CRI socket's connections, and the repair of the HTTP/2 `:authority`
//! of gRPC clients that send a socket path.
//!
//! Some Go gRPC clients (crictl/critest 1.26, older kubelets) dialling a unix
//! socket send the socket *path* as `:authority`, e.g.
//! `/run/cubelet/cubelet.sock`. The `h2` crate under tonic rejects that as a
//! malformed authority and resets every stream with `PROTOCOL_ERROR`
//! (hyperium/h2#487, hyperium/tonic#243, unfixed upstream). With
//! [`TransportOptions::rewrite_invalid_authority`] on (the default, config key
//! `cri.rewrite_invalid_authority`), [`incoming`] wraps each accepted
//! connection in [`FixAuthority`], in front of tonic, which edits only the
//! client→server byte stream:
//!
//! * it checks the 24-byte connection preface, then walks the frames;
//! * every frame except header blocks (`HEADERS` plus its `CONTINUATION`s) is
//!   forwarded untouched, payloads mostly read straight into tonic's buffer;
//! * every header block is HPACK-decoded with a decoder that mirrors the
//!   client's dynamic table. While every `:authority` seen on the connection
//!   is valid, the original frames are forwarded byte for byte (so the
//!   server's table stays the client's). From the first invalid one on, every
//!   block of the connection is re-encoded (the bad `:authority` replaced by
//!   `localhost`) using only the static table and literals *without
//!   indexing*: the server's dynamic table is then never touched again and
//!   cannot drift from what the re-encoded blocks need.
//!
//! Server→client bytes are not looked at. When the stream is not HTTP/2 the
//! way this module expects (wrong preface, HPACK or framing errors, a header
//! block over [`MAX_HEADER_BLOCK`]), the wrapper forwards everything it holds
//! and everything after it unchanged, so the server answers with its own
//! protocol error as it would without the wrapper; memory stays bounded.
//!
//! With the repair off, connections reach tonic as accepted, and such clients
//! get their streams reset.
//!
//! The parts: `wire` (frame layout, the HPACK encoder), `rewriter` (the
//! sans-IO state machine), `fix_authority` (the connection wrapper).

mod fix_authority;
mod rewriter;
#[cfg(test)]
mod test_util;
mod wire;

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, UdsConnectInfo};

pub use self::fix_authority::FixAuthority;
pub use self::rewriter::MAX_HEADER_BLOCK;

/// How the CRI socket treats its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransportOptions {
    /// Replace an invalid HTTP/2 `:authority` (a socket path, as some Go
    /// clients send) with `localhost` before tonic sees it, instead of
    /// letting h2 reset the client's streams.
    pub rewrite_invalid_authority: bool,
}

impl Default for TransportOptions {
    fn default() -> Self {
        Self {
            rewrite_invalid_authority: true,
        }
    }
}

/// One accepted CRI connection, with or without the `:authority` repair.
#[derive(Debug)]
pub enum Connection {
    /// As accepted.
    Plain(UnixStream),
    /// Through [`FixAuthority`] (boxed: its buffers and HPACK state are
    /// most of its size; one allocation per connection).
    Repaired(Box<FixAuthority<UnixStream>>),
}

impl Connection {
    /// Whether this connection's header blocks are being re-encoded (its
    /// client sent an invalid `:authority`).
    pub fn rewriting(&self) -> bool {
        match self {
            Connection::Plain(_) => false,
            Connection::Repaired(c) => c.rewriting(),
        }
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Connection::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Connection::Repaired(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Connection::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Connection::Repaired(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Connection::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Connection::Repaired(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Connection::Plain(s) => s.is_write_vectored(),
            Connection::Repaired(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Connection::Plain(s) => Pin::new(s).poll_flush(cx),
            Connection::Repaired(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Connection::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Connection::Repaired(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

impl Connected for Connection {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        match self {
            Connection::Plain(s) => s.connect_info(),
            Connection::Repaired(s) => s.connect_info(),
        }
    }
}

/// The connections accepted on `listener`, wrapped in [`FixAuthority`] when
/// `options` ask for the repair; pass to tonic's `serve_with_incoming*`.
pub fn incoming(
    listener: UnixListener,
    options: TransportOptions,
) -> impl Stream<Item = io::Result<Connection>> + Send + 'static {
    UnixListenerStream::new(listener).map(move |conn| {
        conn.map(|c| {
            if options.rewrite_invalid_authority {
                Connection::Repaired(Box::new(FixAuthority::new(c)))
            } else {
                Connection::Plain(c)
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::test_util::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Accepts one connection through `incoming`, sends it `input` from a
    /// client and returns what the server side reads and whether it was
    /// rewriting.
    async fn through(options: TransportOptions, input: Vec<u8>) -> (Vec<u8>, bool) {
        let dir = tempfile::Builder::new()
            .prefix("test-transport-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("t.sock");
        let mut conns = Box::pin(incoming(UnixListener::bind(&path).unwrap(), options));
        let mut client = UnixStream::connect(&path).await.unwrap();
        let mut server = conns.next().await.unwrap().unwrap();
        client.write_all(&input).await.unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        (got, server.rewriting())
    }

    #[test]
    fn the_repair_is_on_by_default() {
        assert!(TransportOptions::default().rewrite_invalid_authority);
    }

    #[tokio::test]
    async fn each_setting_reaches_the_accepted_connections() {
        let input = client_stream(&[grpc_request("/run/x.sock", "/s/M")]);
        let (repaired, rewriting) = through(TransportOptions::default(), input.clone()).await;
        assert!(rewriting);
        assert_eq!(repaired, run(&input, input.len()).0);
        let (plain, rewriting) = through(
            TransportOptions {
                rewrite_invalid_authority: false,
            },
            input.clone(),
        )
        .await;
        assert!(!rewriting);
        assert_eq!(plain, input, "with the repair off the bytes are untouched");
    }
}
