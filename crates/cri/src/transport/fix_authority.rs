//! [`FixAuthority`]: the `:authority` repair as a connection wrapper, in
//! front of tonic (see the [module docs](super)).

use std::fmt;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

use super::rewriter::Rewriter;

/// How much is read from the socket at a time into the parse buffer.
const READ_CHUNK: usize = 16 * 1024;

/// One accepted connection whose client→server HTTP/2 header blocks get an
/// invalid `:authority` replaced (see the module docs). Writes go straight
/// to the inner stream.
pub struct FixAuthority<S> {
    inner: S,
    rewriter: Rewriter,
    /// Read from `inner`, not yet parsed.
    input: BytesMut,
    /// Parsed, not yet handed to the reader.
    output: BytesMut,
    /// `inner` reached end of file.
    eof: bool,
}

impl<S> fmt::Debug for FixAuthority<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FixAuthority")
            .field("rewriter", &self.rewriter)
            .field("buffered_in", &self.input.len())
            .field("buffered_out", &self.output.len())
            .field("eof", &self.eof)
            .finish_non_exhaustive()
    }
}

impl<S> FixAuthority<S> {
    /// Wraps an accepted connection (the server side of it).
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rewriter: Rewriter::new(),
            input: BytesMut::new(),
            output: BytesMut::new(),
            eof: false,
        }
    }

    /// Whether this connection's header blocks are being re-encoded (its
    /// client sent an invalid `:authority`).
    pub fn rewriting(&self) -> bool {
        self.rewriter.rewriting()
    }

    /// The wrapped connection.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FixAuthority<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output[..n]);
                this.output.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            this.rewriter.process(&mut this.input, &mut this.output);
            if !this.output.is_empty() {
                continue;
            }
            if this.input.is_empty() {
                if let Some(limit) = this.rewriter.direct_read_limit() {
                    // A forwarded payload: read it straight into the caller's
                    // buffer, no parse buffer in between.
                    let want = limit.min(buf.remaining());
                    let mut direct = ReadBuf::new(buf.initialize_unfilled_to(want));
                    ready!(Pin::new(&mut this.inner).poll_read(cx, &mut direct))?;
                    let n = direct.filled().len();
                    buf.advance(n);
                    if n == 0 {
                        this.eof = true;
                    }
                    this.rewriter.consumed_directly(n);
                    return Poll::Ready(Ok(()));
                }
            }
            this.input.reserve(READ_CHUNK);
            let n = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut this.inner),
                cx,
                &mut this.input
            ))?;
            if n == 0 {
                this.eof = true;
                this.rewriter.finish(&mut this.input, &mut this.output);
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FixAuthority<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: Connected> Connected for FixAuthority<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::test_util::*;
    use crate::transport::wire::FLAG_END_STREAM;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn wrapper_handles_partial_reads_and_small_buffers() {
        let reqs: Vec<Headers> = (0..3)
            .map(|i| grpc_request("/run/x.sock", &format!("/s/M{i}")))
            .collect();
        let mut input = client_stream(&reqs);
        // A large DATA frame that goes through the direct-read path.
        input.extend(frame(0x0, FLAG_END_STREAM, 7, &vec![7u8; 100_000]));
        let (expected, _) = run(&input, input.len());
        let (mut client, server) = tokio::io::duplex(13);
        let writer = tokio::spawn({
            let input = input.clone();
            async move {
                for piece in input.chunks(1000) {
                    client.write_all(piece).await.unwrap();
                }
                client.shutdown().await.unwrap();
                client
            }
        });
        let mut wrapped = FixAuthority::new(server);
        let mut got = Vec::new();
        let mut buf = [0u8; 11];
        loop {
            let n = wrapped.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert!(wrapped.rewriting());
        assert_eq!(got, expected);
        // Writes go to the peer untouched.
        let mut client = writer.await.unwrap();
        wrapped.write_all(b"server bytes").await.unwrap();
        let mut back = [0u8; 12];
        client.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"server bytes");
    }
}
