//! Streaming exec and attach: the runtime half of the CRI streaming server.
//!
//! [`ContainerRuntime::exec_stream`] starts a process in a running container
//! through containerd (`Tasks.Exec` with FIFOs, as `exec_sync` does) and
//! hands its stdin/stdout/stderr pipes to the caller instead of collecting
//! them; [`ExecProcess`] resizes its terminal (`Tasks.ResizePty`), waits for
//! its exit code, kills it and cleans up. For attach, the container's own
//! output is tapped from its log copier ([`ContainerRuntime::attach_output`]
//! subscribes to the broadcast every [`LogSink`](crate::io::logs::LogSink) carries) and its stdin is the
//! FIFO held open since start ([`ContainerRuntime::open_stdin`]).

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use containerd_client::services::v1::{
    CloseIoRequest, DeleteProcessRequest, ExecProcessRequest, GetContainerRequest, KillRequest,
    ResizePtyRequest, StartRequest, WaitRequest,
};
use nix::sys::signal::Signal;
use prost_types::Any;
use tokio::net::unix::pipe;
use tokio::sync::broadcast;

use crate::client::Containerd;
use crate::container::{ContainerRuntime, PROCESS_TYPE_URL};
use crate::error::{cd, cd_container, cd_process, RuntimeError};
#[cfg(test)]
use crate::io::logs::LogSink;
use crate::io::logs::Stream;
use crate::io::{self as fifo_io, Fifos};

/// How many output chunks an attach subscriber may fall behind before it
/// starts losing the oldest.
pub const TAP_CAPACITY: usize = 1024;

/// Container output as the process wrote it, for attach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputChunk {
    /// Which stream.
    pub stream: Stream,
    /// The bytes, as read from the stream: not split into lines, so a
    /// prompt without a newline reaches an attached client at once.
    pub data: Bytes,
}

/// The broadcast half of a [`LogSink`](crate::io::logs::LogSink): output is sent here as it is read,
/// before it is cut into log entries.
///
/// The channel exists only while someone is attached: a broadcast channel
/// allocates all [`TAP_CAPACITY`] slots up front (64 KiB), and a node holds
/// one sink per running container and infra container, nearly all of them
/// never attached to. The first subscriber makes it; the first send that
/// finds no subscriber left drops it.
#[derive(Debug, Default)]
pub struct OutputTap {
    tx: std::sync::Mutex<Option<broadcast::Sender<OutputChunk>>>,
}

impl OutputTap {
    fn sender(&self) -> std::sync::MutexGuard<'_, Option<broadcast::Sender<OutputChunk>>> {
        // The guarded value is only ever replaced whole: a panic while it
        // was held cannot have left it half-written.
        self.tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends output to the current subscribers (none is fine).
    pub fn send(&self, stream: Stream, data: &[u8]) {
        let mut tx = self.sender();
        let Some(sender) = tx.as_ref() else {
            return;
        };
        if sender.receiver_count() == 0 {
            *tx = None;
            return;
        }
        let _ = sender.send(OutputChunk {
            stream,
            data: Bytes::copy_from_slice(data),
        });
    }

    /// A new subscriber, seeing output read from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<OutputChunk> {
        self.sender()
            .get_or_insert_with(|| broadcast::channel(TAP_CAPACITY).0)
            .subscribe()
    }

    /// Whether the broadcast channel is allocated (someone subscribed and
    /// no send has found them all gone since).
    pub fn is_open(&self) -> bool {
        self.sender().is_some()
    }
}

/// What an exec process is started with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecStreamOptions {
    /// Keep a stdin pipe to the process.
    pub stdin: bool,
    /// Run it on a terminal (stdout and stderr merged).
    pub tty: bool,
}

/// A started exec process and its pipes.
#[derive(Debug)]
pub struct ExecStream {
    /// Write end of its stdin (drop it to close stdin), when asked for.
    pub stdin: Option<pipe::Sender>,
    /// Its stdout (the terminal, with a TTY).
    pub stdout: pipe::Receiver,
    /// Its stderr; `None` with a TTY.
    pub stderr: Option<pipe::Receiver>,
    /// Control of the process.
    pub process: ExecProcess,
}

/// Control of one exec process: resize, wait, kill, clean up.
#[derive(Debug)]
pub struct ExecProcess {
    client: Containerd,
    container_id: String,
    exec_id: String,
    dir: PathBuf,
}

impl ExecProcess {
    /// The exec id in containerd.
    pub fn exec_id(&self) -> &str {
        &self.exec_id
    }

    /// Sets the process's terminal size (only meaningful with a TTY).
    pub async fn resize(&self, width: u32, height: u32) -> Result<(), RuntimeError> {
        resize_pty(
            &self.client,
            &self.container_id,
            &self.exec_id,
            width,
            height,
        )
        .await
    }

    /// Closes the process's stdin: the caller drops its writer first, then
    /// this asks the shim to close its own write end (`Tasks.CloseIO`), so
    /// the process reads end-of-file.
    pub async fn close_stdin(&self) -> Result<(), RuntimeError> {
        self.client
            .tasks()
            .close_io(self.client.request(CloseIoRequest {
                container_id: self.container_id.clone(),
                exec_id: self.exec_id.clone(),
                stdin: true,
            }))
            .await
            .map_err(cd("tasks.close_io"))?;
        Ok(())
    }

    /// Waits for the process to exit and returns its exit code.
    pub async fn wait(&self) -> Result<i32, RuntimeError> {
        wait_process(&self.client, &self.container_id, &self.exec_id).await
    }

    /// Sends SIGKILL (an exited or gone process is fine).
    pub async fn kill(&self) -> Result<(), RuntimeError> {
        match self
            .client
            .tasks()
            .kill(self.client.request(KillRequest {
                container_id: self.container_id.clone(),
                exec_id: self.exec_id.clone(),
                signal: Signal::SIGKILL as u32,
                all: false,
            }))
            .await
        {
            Ok(_) => Ok(()),
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::NotFound | tonic::Code::FailedPrecondition
                ) =>
            {
                Ok(())
            }
            Err(s) => Err(RuntimeError::containerd("tasks.kill", s)),
        }
    }

    /// Deletes the (exited) process from containerd and removes its FIFOs.
    /// Call after [`ExecProcess::wait`] returned, or after a kill.
    pub async fn cleanup(self) {
        let del = self
            .client
            .tasks()
            .delete_process(self.client.request(DeleteProcessRequest {
                container_id: self.container_id.clone(),
                exec_id: self.exec_id.clone(),
            }))
            .await;
        if let Err(s) = del {
            if s.code() != tonic::Code::NotFound {
                tracing::warn!(container = %self.container_id, exec_id = %self.exec_id, error = %s, "deleting exec process failed");
            }
        }
        if let Err(e) = fifo_io::remove_dir(&self.dir) {
            tracing::warn!(error = %e, "removing exec fifos failed");
        }
    }
}

async fn resize_pty(
    client: &Containerd,
    container_id: &str,
    exec_id: &str,
    width: u32,
    height: u32,
) -> Result<(), RuntimeError> {
    client
        .tasks()
        .resize_pty(client.request(ResizePtyRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
            width,
            height,
        }))
        .await
        .map_err(cd("tasks.resize_pty"))?;
    Ok(())
}

async fn wait_process(
    client: &Containerd,
    container_id: &str,
    exec_id: &str,
) -> Result<i32, RuntimeError> {
    let r = client
        .tasks()
        .wait(client.request(WaitRequest {
            container_id: container_id.to_owned(),
            exec_id: exec_id.to_owned(),
        }))
        .await
        .map_err(cd_process("tasks.wait", container_id))?
        .into_inner();
    Ok(i32::try_from(r.exit_status).unwrap_or(i32::MAX))
}

fn exec_id_now() -> String {
    let n = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!("exec-stream-{n}")
}

impl ContainerRuntime {
    fn stream_io_dir(&self, id: &str) -> PathBuf {
        self.config().state_dir.join("io").join(id)
    }

    /// Starts `cmd` in running container `id` and returns its pipes. The
    /// caller must [`ExecProcess::wait`] (or kill) and then
    /// [`ExecProcess::cleanup`].
    pub async fn exec_stream(
        &self,
        id: &str,
        cmd: &[String],
        opts: &ExecStreamOptions,
    ) -> Result<ExecStream, RuntimeError> {
        if cmd.is_empty() {
            return Err(RuntimeError::InvalidArgument {
                field: "cmd".to_owned(),
                reason: "empty command".to_owned(),
            });
        }
        let client = self.client().clone();
        let container = client
            .containers()
            .get(client.request(GetContainerRequest { id: id.to_owned() }))
            .await
            .map_err(cd_container("containers.get", id))?
            .into_inner()
            .container
            .ok_or_else(|| RuntimeError::NotFound {
                kind: "container",
                id: id.to_owned(),
            })?;
        let any = container.spec.as_ref().ok_or_else(|| {
            RuntimeError::FailedPrecondition(format!("container {id} has no spec"))
        })?;
        let spec: oci_spec::runtime::Spec =
            serde_json::from_slice(&any.value).map_err(|source| RuntimeError::Json {
                what: "oci spec",
                source,
            })?;
        let mut process = spec.process().clone().ok_or_else(|| {
            RuntimeError::FailedPrecondition(format!("container {id} spec has no process"))
        })?;
        process.set_args(Some(cmd.to_vec()));
        process.set_terminal(Some(opts.tty));
        let process_any = Any {
            type_url: PROCESS_TYPE_URL.to_owned(),
            value: serde_json::to_vec(&process).map_err(|source| RuntimeError::Json {
                what: "process spec",
                source,
            })?,
        };
        let exec_id = exec_id_now();
        let fifos = Fifos::create(self.stream_io_dir(id).join(&exec_id), opts.stdin, opts.tty)?;
        let proc = ExecProcess {
            client: client.clone(),
            container_id: id.to_owned(),
            exec_id: exec_id.clone(),
            dir: fifos.dir.clone(),
        };
        match Self::exec_start(&client, id, &exec_id, process_any, &fifos, opts.tty).await {
            Ok((stdin, stdout, stderr)) => Ok(ExecStream {
                stdin,
                stdout,
                stderr,
                process: proc,
            }),
            Err(e) => {
                let _ = proc.kill().await;
                proc.cleanup().await;
                Err(e)
            }
        }
    }

    async fn exec_start(
        client: &Containerd,
        id: &str,
        exec_id: &str,
        spec: Any,
        fifos: &Fifos,
        tty: bool,
    ) -> Result<(Option<pipe::Sender>, pipe::Receiver, Option<pipe::Receiver>), RuntimeError> {
        let mut keepers = fifos.keep_open()?;
        let (stdin, stdout, stderr) = fifos.wire();
        client
            .tasks()
            .exec(client.request(ExecProcessRequest {
                container_id: id.to_owned(),
                stdin,
                stdout,
                stderr,
                terminal: tty,
                spec: Some(spec),
                exec_id: exec_id.to_owned(),
            }))
            .await
            .map_err(cd_process("tasks.exec", id))?;
        client
            .tasks()
            .start(client.request(StartRequest {
                container_id: id.to_owned(),
                exec_id: exec_id.to_owned(),
            }))
            .await
            .map_err(cd("tasks.start"))?;
        // The shim holds its ends now: open ours and drop the keepers, so our
        // readers see end-of-file when the shim closes its write ends. The
        // stdin keeper (read-write) becomes the caller's writer: dropping it
        // closes the process's stdin.
        let readers = fifos.open_readers()?;
        let stdin = keepers.stdin.take();
        drop(keepers);
        Ok((stdin, readers.stdout, readers.stderr))
    }

    /// Sets the terminal size of container `id`'s own process (attach).
    pub async fn resize_container_pty(
        &self,
        id: &str,
        width: u32,
        height: u32,
    ) -> Result<(), RuntimeError> {
        resize_pty(self.client(), id, "", width, height).await
    }

    /// Waits for container `id`'s task to exit and returns its exit code.
    pub async fn wait_container(&self, id: &str) -> Result<i32, RuntimeError> {
        wait_process(self.client(), id, "").await
    }

    /// Subscribes to container `id`'s output as its log copier writes it;
    /// `None` when this agent is not copying its output (not running).
    pub fn attach_output(&self, id: &str) -> Option<broadcast::Receiver<OutputChunk>> {
        self.log_sink(id).map(|s| s.tap().subscribe())
    }

    /// Opens a writer on container `id`'s stdin FIFO (held open by the agent
    /// since start). `None` when the container was created without stdin.
    pub fn open_stdin(&self, id: &str) -> Result<Option<pipe::Sender>, RuntimeError> {
        let path = self.stream_io_dir(id).join("stdin");
        if !path.exists() {
            return Ok(None);
        }
        pipe::OpenOptions::new()
            .open_sender(&path)
            .map(Some)
            .map_err(|source| RuntimeError::Io {
                op: "open stdin fifo",
                path: path.display().to_string(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tap_sees_output_as_written_and_the_log_sees_lines() {
        use tokio::io::AsyncWriteExt;
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("c.log");
        let sink = std::sync::Arc::new(LogSink::open(Some(log.clone())).await.unwrap());
        // Nobody listens yet: nothing is kept, and no channel is allocated.
        crate::io::logs::copy_stream(&b"early\n"[..], Stream::Stdout, sink.clone()).await;
        assert!(!sink.tap().is_open());
        let mut rx = sink.tap().subscribe();
        assert!(sink.tap().is_open());
        // A prompt without a newline, then a line ended by CRLF.
        let (mut w, r) = tokio::io::duplex(64);
        let copier = tokio::spawn(crate::io::logs::copy_stream(
            r,
            Stream::Stderr,
            sink.clone(),
        ));
        w.write_all(b"hello").await.unwrap();
        let a = rx.recv().await.unwrap();
        assert_eq!(
            (a.stream, a.data),
            (Stream::Stderr, Bytes::from_static(b"hello"))
        );
        w.write_all(b" world\r\nnext").await.unwrap();
        drop(w);
        copier.await.unwrap();
        let b = rx.recv().await.unwrap();
        assert_eq!(b.data, Bytes::from_static(b" world\r\nnext"));
        assert!(rx.try_recv().is_err());
        // The last subscriber gone, the next output frees the channel; a
        // new subscriber gets a fresh one and sees only what follows.
        drop(rx);
        sink.tap().send(Stream::Stdout, b"unseen");
        assert!(!sink.tap().is_open());
        let mut again = sink.tap().subscribe();
        sink.tap().send(Stream::Stdout, b"seen");
        assert_eq!(again.try_recv().unwrap().data, Bytes::from_static(b"seen"));
        assert!(again.try_recv().is_err());
        let text = std::fs::read_to_string(&log).unwrap();
        let entries: Vec<_> = text
            .lines()
            .filter_map(crate::io::logs::parse_entry)
            .map(|(_, stream, partial, text)| (stream.to_owned(), partial, text.to_owned()))
            .collect();
        assert_eq!(
            entries,
            [
                ("stdout".to_owned(), false, "early".to_owned()),
                ("stderr".to_owned(), false, "hello world".to_owned()),
                ("stderr".to_owned(), true, "next".to_owned()),
            ]
        );
    }
}
