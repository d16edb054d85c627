//! What the streaming server needs from the containers it streams: the
//! [`StreamBackend`] trait, implemented by the binary over the real runtime
//! (and by a fake in this crate's tests).
//!
//! The surface is exactly what the sessions use: start a process with pipes
//! and control it ([`ExecProcess`]), tap a running container's output and
//! open its stdin (attach), resize its terminal, wait for it, tell it that an
//! attach's input ended, and dial a port inside a pod's network namespace.
//! Errors are opaque ([`BackendError`]); the sessions only report them to the
//! client, with their cause chain.

use std::fmt;
use std::io;
use std::path::PathBuf;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use tokio::io::{AsyncRead, AsyncWrite};

/// An error of the backend, shown to the client with its cause chain.
pub type BackendError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A pipe into a process (its stdin); dropping it closes the pipe.
pub type Writer = Box<dyn AsyncWrite + Send + Unpin + 'static>;

/// A pipe out of a process (its stdout or stderr).
pub type Reader = Box<dyn AsyncRead + Send + Unpin + 'static>;

/// How an exec process is started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecOptions {
    /// Keep a stdin pipe to the process.
    pub stdin: bool,
    /// Run it on a terminal (stdout and stderr merged).
    pub tty: bool,
}

/// A terminal size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TerminalSize {
    /// Columns.
    pub width: u32,
    /// Rows.
    pub height: u32,
}

/// A started exec process: its pipes and its control.
pub struct ExecIo {
    /// Write end of its stdin, when asked for.
    pub stdin: Option<Writer>,
    /// Its stdout (the terminal, with a TTY).
    pub stdout: Reader,
    /// Its stderr; `None` with a TTY.
    pub stderr: Option<Reader>,
    /// Control of the process.
    pub process: Box<dyn ExecProcess>,
}

impl fmt::Debug for ExecIo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecIo")
            .field("stdin", &self.stdin.is_some())
            .field("stderr", &self.stderr.is_some())
            .field("process", &self.process)
            .finish_non_exhaustive()
    }
}

/// Control of one exec process.
pub trait ExecProcess: Send + Sync + fmt::Debug {
    /// Waits for the process to exit and returns its exit code.
    fn wait(&self) -> BoxFuture<'_, Result<i32, BackendError>>;
    /// Sets the process's terminal size (only meaningful with a TTY).
    fn resize(&self, size: TerminalSize) -> BoxFuture<'_, Result<(), BackendError>>;
    /// Closes the process's stdin after the caller dropped its writer, so
    /// the process reads end-of-file.
    fn close_stdin(&self) -> BoxFuture<'_, Result<(), BackendError>>;
    /// Kills the process (an exited or gone process is fine).
    fn kill(&self) -> BoxFuture<'_, Result<(), BackendError>>;
    /// Removes what is left of the exited (or killed) process; logs its own
    /// failures.
    fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()>;
}

/// Which of a container's streams a chunk of output came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputStream {
    /// Standard output (the terminal, with a TTY).
    Stdout,
    /// Standard error.
    Stderr,
}

/// Container output as the process wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputChunk {
    /// Which stream.
    pub stream: OutputStream,
    /// The bytes as read, not split into lines.
    pub data: Bytes,
}

/// An attach subscriber fell behind and lost this many chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lagged(pub u64);

/// A running container's output from the moment of subscribing: chunks,
/// [`Lagged`] when the subscriber lost some, and the end when the
/// container's output is closed.
pub type AttachOutput = BoxStream<'static, Result<OutputChunk, Lagged>>;

/// What the streaming server needs from containers and pods.
pub trait StreamBackend: Send + Sync + fmt::Debug + 'static {
    /// Starts `cmd` in running container `container_id` and returns its
    /// pipes. The server waits for (or kills) the process and then calls
    /// [`ExecProcess::cleanup`].
    fn exec<'a>(
        &'a self,
        container_id: &'a str,
        cmd: &'a [String],
        opts: ExecOptions,
    ) -> BoxFuture<'a, Result<ExecIo, BackendError>>;

    /// Subscribes to container `container_id`'s output; `None` when the
    /// container is not running.
    fn attach_output(&self, container_id: &str) -> Option<AttachOutput>;

    /// Opens a writer on container `container_id`'s own stdin; `None` when
    /// it was created without stdin.
    fn open_stdin(&self, container_id: &str) -> Result<Option<Writer>, BackendError>;

    /// An attach session's input ended (its writer is already dropped): a
    /// `stdin_once` container's stdin is closed too.
    fn attach_stdin_closed<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>>;

    /// Sets container `container_id`'s own terminal size.
    fn resize_container<'a>(
        &'a self,
        container_id: &'a str,
        size: TerminalSize,
    ) -> BoxFuture<'a, Result<(), BackendError>>;

    /// Waits for container `container_id` to exit and returns its exit code.
    fn wait_container<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<i32, BackendError>>;

    /// Opens a TCP connection to `localhost:port` inside the network
    /// namespace pinned at `netns` (the agent's own namespace when `None`,
    /// a host-network pod).
    fn dial(
        &self,
        netns: Option<PathBuf>,
        port: u16,
    ) -> BoxFuture<'static, io::Result<tokio::net::TcpStream>>;
}

/// `err` and its causes, `": "`-separated, a cause left out when the message
/// before already ends with it.
pub(crate) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let s = e.to_string();
        if !out.ends_with(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] io::Error);

    #[test]
    fn chain_names_every_cause_once() {
        let e: BackendError = Box::new(Outer(io::Error::other("inner")));
        assert_eq!(chain(&*e), "outer: inner");
        let e: BackendError = "inner".into();
        assert_eq!(chain(&*e), "inner");
    }
}
