//! Sessions over an upgraded WebSocket: exec, attach and port-forward.
//!
//! Outgoing messages go through one writer task (so output pumps never
//! interleave partial frames); incoming messages are handled in order in
//! the session's own loop, so a resize sent before stdin data is applied
//! before that data reaches the process.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cubelet_runtime::container::ContainerRuntime;
use cubelet_runtime::exec_stream::{ExecStreamOptions, OutputChunk};
use cubelet_runtime::logs::Stream as LogStream;
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::channel::{self, CLOSE, ERROR, RESIZE, STDERR, STDIN, STDOUT};
use super::dial;
use super::Streams;

/// How long output may still flow after the process exited (a background
/// child holding the pipes must not keep the session open forever).
const DRAIN: Duration = Duration::from_secs(5);
/// Attach: quiet time after the container exited before the session ends.
const ATTACH_SETTLE: Duration = Duration::from_millis(200);

type Tx = mpsc::Sender<Message>;

/// Splits `ws` into a writer task fed by the returned sender, and the
/// incoming half. The writer sends a close frame once every sender is gone.
fn split<S>(
    ws: WebSocketStream<S>,
) -> (
    Tx,
    futures::stream::SplitStream<WebSocketStream<S>>,
    JoinHandle<()>,
)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sink, stream) = ws.split();
    let (tx, mut rx) = mpsc::channel::<Message>(64);
    let writer = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if sink.send(m).await.is_err() {
                return;
            }
        }
        let _ = sink.send(Message::Close(None)).await;
        let _ = sink.flush().await;
    });
    (tx, stream, writer)
}

async fn send(tx: &Tx, ch: u8, data: &[u8]) -> bool {
    tx.send(Message::Binary(channel::frame(ch, data)))
        .await
        .is_ok()
}

/// Copies a pipe into channel `ch` until end of file.
fn pump<R>(mut r: R, ch: u8, tx: Tx) -> JoinHandle<()>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if !send(&tx, ch, &buf[..n]).await {
                        return;
                    }
                }
            }
        }
    })
}

async fn finish(mut h: JoinHandle<()>) {
    if tokio::time::timeout(DRAIN, &mut h).await.is_err() {
        h.abort();
    }
}

/// What the client sent, decoded.
enum Incoming {
    Data(u8, Bytes),
    Gone,
    Ignore,
}

fn decode(m: Option<Result<Message, tokio_tungstenite::tungstenite::Error>>) -> Incoming {
    match m {
        None | Some(Err(_)) | Some(Ok(Message::Close(_))) => Incoming::Gone,
        Some(Ok(Message::Binary(b))) => match channel::parse(&b) {
            Some((ch, _)) => Incoming::Data(ch, b.slice(1..)),
            None => Incoming::Ignore,
        },
        Some(Ok(_)) => Incoming::Ignore,
    }
}

/// Runs `cmd` in the container and streams it until it exits.
pub(super) async fn exec<S>(
    ws: WebSocketStream<S>,
    v5: bool,
    runtime: Arc<ContainerRuntime>,
    container_id: String,
    cmd: Vec<String>,
    streams: Streams,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (tx, mut incoming, writer) = split(ws);
    let opts = ExecStreamOptions {
        stdin: streams.stdin,
        tty: streams.tty,
    };
    let started = runtime.exec_stream(&container_id, &cmd, &opts).await;
    let es = match started {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(container = %container_id, error = %e, "streaming exec failed to start");
            send(
                &tx,
                ERROR,
                &channel::failure_status(&cubelet_engine::chain(&e)),
            )
            .await;
            drop(tx);
            let _ = writer.await;
            return;
        }
    };
    let mut stdin = es.stdin;
    let process = es.process;
    let mut pumps = Vec::new();
    if streams.stdout || streams.tty {
        pumps.push(pump(es.stdout, STDOUT, tx.clone()));
    } else {
        pumps.push(pump(es.stdout, u8::MAX, discard_tx()));
    }
    if let Some(err) = es.stderr {
        if streams.stderr {
            pumps.push(pump(err, STDERR, tx.clone()));
        } else {
            pumps.push(pump(err, u8::MAX, discard_tx()));
        }
    }
    let exit = {
        let wait = process.wait();
        tokio::pin!(wait);
        loop {
            tokio::select! {
                r = &mut wait => break Some(r),
                m = incoming.next() => match decode(m) {
                    Incoming::Gone => break None,
                    Incoming::Ignore => {}
                    Incoming::Data(STDIN, data) => {
                        if let Some(w) = stdin.as_mut() {
                            if w.write_all(&data).await.is_err() {
                                stdin = None;
                            }
                        }
                    }
                    Incoming::Data(RESIZE, data) => {
                        if let (true, Some(sz)) = (streams.tty, channel::parse_resize(&data)) {
                            if let Err(e) = process.resize(sz.width.into(), sz.height.into()).await {
                                tracing::debug!(error = %e, "exec resize failed");
                            }
                        }
                    }
                    Incoming::Data(CLOSE, data) if v5 => {
                        if data.first() == Some(&STDIN) && stdin.take().is_some() {
                            if let Err(e) = process.close_stdin().await {
                                tracing::debug!(error = %e, "exec stdin close failed");
                            }
                        }
                    }
                    Incoming::Data(..) => {}
                }
            }
        }
    };
    drop(stdin);
    match exit {
        Some(code) => {
            for p in pumps {
                finish(p).await;
            }
            let status = match code {
                Ok(c) => channel::exit_status(c),
                Err(e) => channel::failure_status(&cubelet_engine::chain(&e)),
            };
            send(&tx, ERROR, &status).await;
        }
        None => {
            // The client went away: nobody can read the output any more.
            tracing::debug!(container = %container_id, "exec client disconnected, killing the process");
            if let Err(e) = process.kill().await {
                tracing::warn!(error = %e, "killing exec process failed");
            }
            let _ = tokio::time::timeout(DRAIN, process.wait()).await;
            for p in pumps {
                p.abort();
            }
        }
    }
    process.cleanup().await;
    drop(tx);
    let _ = writer.await;
}

/// A sender whose messages go nowhere (for unrequested streams that must
/// still be drained so the process does not block on a full pipe).
fn discard_tx() -> Tx {
    let (tx, mut rx) = mpsc::channel::<Message>(8);
    tokio::spawn(async move { while rx.recv().await.is_some() {} });
    tx
}

fn chunk_channel(c: &OutputChunk, streams: Streams) -> Option<u8> {
    match c.stream {
        LogStream::Stdout if streams.stdout || streams.tty => Some(STDOUT),
        LogStream::Stderr if streams.tty && streams.stdout => Some(STDOUT),
        LogStream::Stderr if streams.stderr => Some(STDERR),
        _ => None,
    }
}

/// Connects the client to the container's own stdio until it exits or the
/// client leaves (the container keeps running then).
pub(super) async fn attach<S>(
    ws: WebSocketStream<S>,
    v5: bool,
    runtime: Arc<ContainerRuntime>,
    container_id: String,
    streams: Streams,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (tx, mut incoming, writer) = split(ws);
    let Some(mut output) = runtime.attach_output(&container_id) else {
        let msg = format!("container {container_id} is not running");
        send(&tx, ERROR, &channel::failure_status(&msg)).await;
        drop(tx);
        let _ = writer.await;
        return;
    };
    let mut stdin = if streams.stdin {
        match runtime.open_stdin(&container_id) {
            Ok(s) => s,
            Err(e) => {
                tracing::info!(container = %container_id, error = %e, "attach: stdin unavailable");
                None
            }
        }
    } else {
        None
    };
    let exited = {
        let wait = runtime.wait_container(&container_id);
        tokio::pin!(wait);
        loop {
            tokio::select! {
                r = &mut wait => break Some(r),
                c = output.recv() => match c {
                    Ok(c) => {
                        if let Some(ch) = chunk_channel(&c, streams) {
                            send(&tx, ch, &c.to_wire()).await;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::debug!(container = %container_id, lost = n, "attach fell behind");
                    }
                    Err(broadcast::error::RecvError::Closed) => break Some(Ok(0)),
                },
                m = incoming.next() => match decode(m) {
                    Incoming::Gone => break None,
                    Incoming::Ignore => {}
                    Incoming::Data(STDIN, data) => {
                        if let Some(w) = stdin.as_mut() {
                            if w.write_all(&data).await.is_err() {
                                stdin = None;
                            }
                        }
                    }
                    Incoming::Data(RESIZE, data) => {
                        if let (true, Some(sz)) = (streams.tty, channel::parse_resize(&data)) {
                            if let Err(e) = runtime
                                .resize_container_pty(&container_id, sz.width.into(), sz.height.into())
                                .await
                            {
                                tracing::debug!(error = %e, "attach resize failed");
                            }
                        }
                    }
                    Incoming::Data(CLOSE, data) if v5 => {
                        if data.first() == Some(&STDIN) {
                            stdin = None;
                        }
                    }
                    Incoming::Data(..) => {}
                }
            }
        }
    };
    drop(stdin);
    if exited.is_some() {
        // The copier may still hold the last lines: forward until quiet.
        while let Ok(Ok(c)) = tokio::time::timeout(ATTACH_SETTLE, output.recv()).await {
            if let Some(ch) = chunk_channel(&c, streams) {
                send(&tx, ch, &c.to_wire()).await;
            }
        }
        send(&tx, ERROR, &channel::exit_status(0)).await;
    }
    drop(tx);
    let _ = writer.await;
}

/// Forwards each of `ports` to the same port on the sandbox's loopback:
/// channel `2i` carries the data of port `i`, `2i+1` its errors; each
/// channel first carries the port number (little-endian u16).
pub(super) async fn port_forward<S>(
    ws: WebSocketStream<S>,
    sandbox_id: String,
    netns: Option<PathBuf>,
    ports: Vec<u16>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (tx, mut incoming, writer) = split(ws);
    if ports.is_empty() || ports.len() > 127 {
        tracing::info!(sandbox = %sandbox_id, "port-forward without ports (or too many)");
        drop(tx);
        let _ = writer.await;
        return;
    }
    let mut writers: Vec<Option<tokio::net::tcp::OwnedWriteHalf>> = Vec::new();
    let mut pumps = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let data_ch = u8::try_from(2 * i).unwrap_or(u8::MAX);
        let le = port.to_le_bytes();
        send(&tx, data_ch, &le).await;
        send(&tx, data_ch + 1, &le).await;
        match dial::dial(netns.clone(), *port).await {
            Ok(stream) => {
                let (r, w) = stream.into_split();
                pumps.push(pump(r, data_ch, tx.clone()));
                writers.push(Some(w));
            }
            Err(e) => {
                let msg = format!("error forwarding port {port} to pod {sandbox_id}: {e}");
                tracing::info!("{msg}");
                send(&tx, data_ch + 1, msg.as_bytes()).await;
                writers.push(None);
            }
        }
    }
    loop {
        match decode(incoming.next().await) {
            Incoming::Gone => break,
            Incoming::Ignore => {}
            Incoming::Data(ch, data) => {
                let i = usize::from(ch / 2);
                if ch % 2 != 0 {
                    continue;
                }
                if let Some(slot) = writers.get_mut(i) {
                    if let Some(w) = slot.as_mut() {
                        if w.write_all(&data).await.is_err() {
                            *slot = None;
                        }
                    }
                }
            }
        }
    }
    drop(writers);
    for p in pumps {
        p.abort();
    }
    drop(tx);
    let _ = writer.await;
}
