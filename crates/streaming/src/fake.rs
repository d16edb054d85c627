//! A [`StreamBackend`] for tests: a few built-in "commands" on in-memory
//! pipes, no containers to attach to, and dialing on the host's loopback
//! only (a pod namespace is refused, naming it).
//!
//! Commands: `echo ARGS..` prints its arguments, `cat` copies stdin to
//! stdout until end of input, `exit N` exits with `N`, `sink` reads nothing
//! and runs until killed, `tick` reads nothing either and prints a line
//! every 20 ms until killed, whether or not anyone reads it; anything else
//! fails to start.

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use futures::future::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::{
    AttachOutput, BackendError, ExecIo, ExecOptions, ExecProcess, StreamBackend, TerminalSize,
    Writer,
};

/// The fake backend; counts cleaned-up processes.
#[derive(Debug, Default)]
pub(crate) struct FakeBackend {
    pub(crate) cleaned_up: Arc<AtomicUsize>,
}

#[derive(Debug)]
struct FakeProcess {
    exit: watch::Receiver<Option<i32>>,
    kill: watch::Sender<Option<i32>>,
    cleaned_up: Arc<AtomicUsize>,
}

/// Records the first exit code only (a kill after the exit changes nothing).
fn set_once(slot: &mut Option<i32>, code: i32) -> bool {
    if slot.is_some() {
        return false;
    }
    *slot = Some(code);
    true
}

impl ExecProcess for FakeProcess {
    fn wait(&self) -> BoxFuture<'_, Result<i32, BackendError>> {
        let mut exit = self.exit.clone();
        Box::pin(async move {
            let code = exit.wait_for(Option::is_some).await?;
            Ok(code.unwrap_or(-1))
        })
    }

    fn resize(&self, _size: TerminalSize) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    fn close_stdin(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    fn kill(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        self.kill.send_if_modified(|c| set_once(c, 137));
        Box::pin(async { Ok(()) })
    }

    fn cleanup(self: Box<Self>) -> BoxFuture<'static, ()> {
        self.cleaned_up.fetch_add(1, Ordering::SeqCst);
        Box::pin(async {})
    }
}

impl StreamBackend for FakeBackend {
    fn exec<'a>(
        &'a self,
        _container_id: &'a str,
        cmd: &'a [String],
        opts: ExecOptions,
    ) -> BoxFuture<'a, Result<ExecIo, BackendError>> {
        Box::pin(async move {
            let args: Vec<String> = cmd.get(1..).unwrap_or_default().to_vec();
            let code = match cmd.first().map(String::as_str) {
                Some("echo" | "cat" | "sink" | "tick") => 0,
                Some("exit") => args.first().and_then(|a| a.parse().ok()).unwrap_or(1),
                other => return Err(format!("{other:?}: command not found").into()),
            };
            let cat = cmd[0] == "cat";
            let sink = cmd[0] == "sink";
            let tick = cmd[0] == "tick";
            let (stdin_w, mut stdin_r) = tokio::io::duplex(4096);
            let (mut stdout_w, stdout_r) = tokio::io::duplex(4096);
            let (tx, rx) = watch::channel(None);
            let kill = tx.clone();
            tokio::spawn(async move {
                if tick {
                    // Holds stdin unread; prints until killed.
                    let mut exit = tx.subscribe();
                    loop {
                        tokio::select! {
                            _ = async { exit.wait_for(Option::is_some).await.map(|_| ()) } => break,
                            () = tokio::time::sleep(std::time::Duration::from_millis(20)) => {
                                // As a process whose output pipe has another
                                // holder: nobody reading is no reason to stop.
                                let _ = stdout_w.write_all(b"tick\n").await;
                            }
                        }
                    }
                    drop((stdin_r, stdout_w));
                    return;
                }
                if sink {
                    // Holds stdin unread until killed.
                    let mut exit = tx.subscribe();
                    let _ = exit.wait_for(Option::is_some).await;
                    drop((stdin_r, stdout_w));
                    return;
                }
                if cat {
                    let _ = tokio::io::copy(&mut stdin_r, &mut stdout_w).await;
                } else if !args.is_empty() {
                    let _ = stdout_w.write_all((args.join(" ") + "\n").as_bytes()).await;
                }
                drop(stdout_w);
                // Read what is left so the client's writes never block.
                let mut sink = Vec::new();
                let _ = stdin_r.read_to_end(&mut sink).await;
                tx.send_if_modified(|c| set_once(c, code));
            });
            let (_, stderr_r) = tokio::io::duplex(16);
            Ok(ExecIo {
                stdin: opts.stdin.then(|| Box::new(stdin_w) as Writer),
                stdout: Box::new(stdout_r),
                stderr: (!opts.tty).then(|| Box::new(stderr_r) as crate::Reader),
                process: Box::new(FakeProcess {
                    exit: rx,
                    kill,
                    cleaned_up: Arc::clone(&self.cleaned_up),
                }),
            })
        })
    }

    fn attach_output(&self, _container_id: &str) -> Option<AttachOutput> {
        None
    }

    fn open_stdin(&self, _container_id: &str) -> Result<Option<Writer>, BackendError> {
        Ok(None)
    }

    fn attach_stdin_closed<'a>(
        &'a self,
        _container_id: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    fn resize_container<'a>(
        &'a self,
        _container_id: &'a str,
        _size: TerminalSize,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    fn wait_container<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<i32, BackendError>> {
        Box::pin(async move { Err(format!("container {container_id} not found").into()) })
    }

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
