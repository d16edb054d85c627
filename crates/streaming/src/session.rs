//! Exec, attach and port-forward sessions.
//!
//! The exec and attach cores are transport-neutral: they speak in
//! channel-numbered [`Out`] messages and read [`In`] messages, and each
//! transport (WebSocket here, SPDY in `spdy_remote`) adapts its own
//! framing to them. Outgoing messages go through one writer (so output
//! pumps never interleave partial frames); incoming messages are handled in
//! order in the session's own loop, so a resize sent before stdin data is
//! applied before that data reaches the process.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;
use tracing::Instrument;

use crate::backend::{chain, Lagged};
use crate::channel::{self, CLOSE, ERROR, RESIZE, STDERR, STDIN, STDOUT};
use crate::dial::PodTarget;
use crate::limits::{Idle, Limits};
use crate::queue::{in_queue, InRx};
use crate::{ExecOptions, OutputChunk, OutputStream, StreamBackend, Streams, TerminalSize};

/// How long output may still flow after the process exited (a background
/// child holding the pipes must not keep the session open forever).
const DRAIN: Duration = Duration::from_secs(5);
/// Attach: quiet time after the container exited before the session ends.
const ATTACH_SETTLE: Duration = Duration::from_millis(200);

/// A message from a session to its client.
#[derive(Debug)]
pub(crate) enum Out {
    /// Bytes on a channel.
    Data(u8, Bytes),
    /// Nothing more will be sent on this channel.
    End(u8),
}

/// A message from the client; the channel closing means it is gone.
#[derive(Debug)]
pub(crate) enum In {
    /// Bytes on a channel (stdin, or one resize object).
    Data(u8, Bytes),
    /// The client closed this channel (stdin: end of input).
    End(u8),
}

pub(crate) type Tx = mpsc::Sender<Out>;
pub(crate) type Rx = InRx;

/// How a transport's reader ended a session on its own: the close frame
/// the writer sends instead of a normal closure.
type CloseReason = Arc<std::sync::Mutex<Option<CloseFrame>>>;

/// Adapts `ws` to the neutral messages: a writer task fed by the returned
/// sender (it sends a close frame once every sender is gone) and a reader
/// task feeding the returned receiver (v5 close messages become
/// [`In::End`]). The reader ends the session (the receiver reports the
/// sender gone) when the client leaves, sends a message over
/// `max_message_size`, or moves no byte for the idle timeout; the close
/// frame then says why. With `legacy` (`channel.k8s.io`) the error channel
/// carries only a failure's message, and nothing on success.
fn ws_adapt<S>(
    ws: WebSocketStream<S>,
    v5: bool,
    legacy: bool,
    limits: Limits,
    coalesce_resizes: bool,
) -> (Tx, Rx, JoinHandle<()>, JoinHandle<()>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sink, mut stream) = ws.split();
    let idle = Idle::new(limits.stream_idle_timeout);
    let reason: CloseReason = Arc::default();
    let (tx, mut rx) = mpsc::channel::<Out>(64);
    let writer = {
        let (idle, reason) = (idle.clone(), Arc::clone(&reason));
        tokio::spawn(
            async move {
                while let Some(m) = rx.recv().await {
                    if let Out::Data(ch, mut data) = m {
                        if legacy && ch == ERROR {
                            match crate::spdy_remote::error_payload(false, &data) {
                                Some(d) => data = d,
                                None => continue,
                            }
                        }
                        // A client that reads nothing holds this send only
                        // until it has been idle for the timeout.
                        let sent = tokio::select! {
                            biased;
                            r = sink.send(Message::Binary(channel::frame(ch, &data))) => r.is_ok(),
                            () = idle.expired() => false,
                        };
                        if !sent {
                            return;
                        }
                        idle.touch();
                    }
                }
                let close = reason
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take()
                    .map_or_else(normal_close, |f| Message::Close(Some(f)));
                let _ = sink.send(close).await;
                let _ = sink.flush().await;
            }
            .in_current_span(),
        )
    };
    let (in_tx, in_rx) = in_queue(limits.max_queued_bytes, coalesce_resizes);
    let reader = tokio::spawn(
        async move {
            // The client's next message, read while the session was still
            // busy with the one before (so a departure is seen at once).
            let mut peeked = None;
            let why = loop {
                let next = match peeked.take() {
                    Some(n) => n,
                    None => tokio::select! {
                        m = stream.next() => m,
                        () = idle.expired() => break Some(idle_close(idle.timeout())),
                    },
                };
                idle.touch();
                let m = match next {
                    None | Some(Ok(Message::Close(_))) => break None,
                    Some(Err(WsError::Capacity(e))) => {
                        tracing::info!(error = %e, "streaming client sent a message over the limit");
                        break Some(CloseFrame {
                            code: CloseCode::Size,
                            reason: format!(
                                "{e} (streaming.max_message_size is {} bytes)",
                                limits.max_message_size
                            )
                            .into(),
                        });
                    }
                    Some(Err(_)) => break None,
                    Some(Ok(Message::Binary(b))) => match channel::parse(&b) {
                        Some((CLOSE, rest)) if v5 => match rest.first() {
                            Some(&ch) => In::End(ch),
                            None => continue,
                        },
                        Some((ch, _)) => In::Data(ch, b.slice(1..)),
                        None => continue,
                    },
                    Some(Ok(_)) => continue,
                };
                let send = in_tx.send(m);
                tokio::pin!(send);
                let ended = loop {
                    tokio::select! {
                        r = &mut send => break r.is_err().then_some(None),
                        n = stream.next(), if peeked.is_none() => {
                            let last = matches!(n, None | Some(Err(_)) | Some(Ok(Message::Close(_))));
                            peeked = Some(n);
                            if last {
                                // Handled (and reported) by the outer loop.
                                break None;
                            }
                        }
                        () = idle.expired() => break Some(Some(idle_close(idle.timeout()))),
                    }
                };
                if let Some(why) = ended {
                    break why;
                }
            };
            if let Some(f) = why {
                *reason.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
            }
        }
        .in_current_span(),
    );
    (tx, in_rx, writer, reader)
}

/// The close frame of a session ended for silence.
fn idle_close(timeout: Duration) -> CloseFrame {
    tracing::info!(?timeout, "streaming session idle: ending it");
    CloseFrame {
        code: CloseCode::Policy,
        reason: format!(
            "no data in either direction for {}s (streaming.stream_idle_timeout)",
            timeout.as_secs()
        )
        .into(),
    }
}

/// A normal-closure close frame: client-go's WebSocket clients treat any
/// other close (even "no status") as a failed stream.
fn normal_close() -> Message {
    Message::Close(Some(CloseFrame {
        code: CloseCode::Normal,
        reason: "".into(),
    }))
}

/// Turns `ws` into a byte stream: the payloads of binary messages in, one
/// binary message per write out. This is the tunnel newer clients use for
/// SPDY port-forward over WebSocket (`SPDY/3.1+portforward.k8s.io`).
pub(crate) fn ws_byte_stream<S>(ws: WebSocketStream<S>) -> tokio::io::DuplexStream
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let (mut from_session, mut to_session) = tokio::io::split(theirs);
    let (mut sink, mut stream) = ws.split();
    let inbound = tokio::spawn(
        async move {
            while let Some(Ok(m)) = stream.next().await {
                match m {
                    Message::Binary(b) if to_session.write_all(&b).await.is_err() => return,
                    Message::Close(_) => break,
                    _ => {}
                }
            }
            let _ = to_session.shutdown().await;
        }
        .in_current_span(),
    );
    tokio::spawn(
        async move {
            let mut buf = vec![0u8; 32 * 1024];
            loop {
                match from_session.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let msg = Message::Binary(Bytes::copy_from_slice(&buf[..n]));
                        if sink.send(msg).await.is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = sink.send(normal_close()).await;
            let _ = sink.flush().await;
            // The session is over: stop waiting for the client.
            inbound.abort();
        }
        .in_current_span(),
    );
    ours
}

/// Runs a neutral session core over `ws`.
async fn over_ws<S, F, Fut>(
    ws: WebSocketStream<S>,
    v5: bool,
    legacy: bool,
    limits: Limits,
    coalesce_resizes: bool,
    core: F,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: FnOnce(Tx, Rx) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let (tx, rx, writer, reader) = ws_adapt(ws, v5, legacy, limits, coalesce_resizes);
    core(tx, rx).await;
    reader.abort();
    let _ = writer.await;
}

async fn send(tx: &Tx, ch: u8, data: &[u8]) -> bool {
    tx.send(Out::Data(ch, Bytes::copy_from_slice(data)))
        .await
        .is_ok()
}

/// Sends the final status on the error channel after ending the output
/// channels (SPDY clients wait for stdout/stderr to end before they read
/// the status).
async fn finish_with(tx: &Tx, status: &[u8]) {
    let _ = tx.send(Out::End(STDOUT)).await;
    let _ = tx.send(Out::End(STDERR)).await;
    send(tx, ERROR, status).await;
    let _ = tx.send(Out::End(ERROR)).await;
}

/// Copies a pipe into channel `ch` until end of file.
fn pump<R>(mut r: R, ch: u8, tx: Tx) -> JoinHandle<()>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(
        async move {
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
        }
        .in_current_span(),
    )
}

async fn finish(mut h: JoinHandle<()>) {
    if tokio::time::timeout(DRAIN, &mut h).await.is_err() {
        h.abort();
    }
}

/// Runs `cmd` in the container and streams it over `ws` until it exits.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn exec<S>(
    ws: WebSocketStream<S>,
    v5: bool,
    legacy: bool,
    backend: Arc<dyn StreamBackend>,
    container_id: String,
    cmd: Vec<String>,
    streams: Streams,
    limits: Limits,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    over_ws(ws, v5, legacy, limits, true, |tx, rx| {
        exec_core(tx, rx, backend, container_id, cmd, streams)
    })
    .await;
}

/// Runs `cmd` in the container: output goes to `tx`, input comes from
/// `rx`; ends with the status on the error channel (or kills the process
/// when the client goes away).
pub(crate) async fn exec_core(
    tx: Tx,
    mut incoming: Rx,
    backend: Arc<dyn StreamBackend>,
    container_id: String,
    cmd: Vec<String>,
    streams: Streams,
) {
    let opts = ExecOptions {
        stdin: streams.stdin,
        tty: streams.tty,
    };
    let started = backend.exec(&container_id, &cmd, opts).await;
    let es = match started {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(container = %container_id, error = %e, "streaming exec failed to start");
            finish_with(&tx, &channel::failure_status(&chain(&*e))).await;
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
                // The writer gave up: the client is gone (its reader may
                // not notice while a process that reads nothing holds
                // its input back).
                () = tx.closed() => break None,
                m = incoming.recv() => match m {
                    None => break None,
                    Some(In::Data(STDIN, data)) => {
                        if let Some(w) = stdin.as_mut() {
                            // A process that does not read blocks this
                            // write (and so the client): it must still
                            // exit, and the client still leave.
                            tokio::select! {
                                r = w.write_all(&data) => if r.is_err() { stdin = None },
                                r = &mut wait => break Some(r),
                                () = incoming.closed() => break None,
                                () = tx.closed() => break None,
                            }
                        }
                    }
                    Some(In::Data(RESIZE, data)) => {
                        if let (true, Some(sz)) = (streams.tty, channel::parse_resize(&data)) {
                            if let Err(e) = process.resize(term_size(sz)).await {
                                tracing::debug!(error = %e, "exec resize failed");
                            }
                        }
                    }
                    Some(In::End(STDIN)) => {
                        if stdin.take().is_some() {
                            if let Err(e) = process.close_stdin().await {
                                tracing::debug!(error = %e, "exec stdin close failed");
                            }
                        }
                    }
                    Some(_) => {}
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
                Err(e) => channel::failure_status(&chain(&*e)),
            };
            finish_with(&tx, &status).await;
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
}

/// A sender whose messages go nowhere (for unrequested streams that must
/// still be drained so the process does not block on a full pipe).
fn discard_tx() -> Tx {
    let (tx, mut rx) = mpsc::channel::<Out>(8);
    tokio::spawn(async move { while rx.recv().await.is_some() {} }.in_current_span());
    tx
}

fn chunk_channel(c: &OutputChunk, streams: Streams) -> Option<u8> {
    match c.stream {
        OutputStream::Stdout if streams.stdout || streams.tty => Some(STDOUT),
        OutputStream::Stderr if streams.tty && streams.stdout => Some(STDOUT),
        OutputStream::Stderr if streams.stderr => Some(STDERR),
        _ => None,
    }
}

/// A resize message's size as the backend takes it.
fn term_size(sz: channel::TermSize) -> TerminalSize {
    TerminalSize {
        width: sz.width.into(),
        height: sz.height.into(),
    }
}

/// Connects a WebSocket client to the container's own stdio.
pub(crate) async fn attach<S>(
    ws: WebSocketStream<S>,
    v5: bool,
    legacy: bool,
    backend: Arc<dyn StreamBackend>,
    container_id: String,
    streams: Streams,
    limits: Limits,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    over_ws(ws, v5, legacy, limits, true, |tx, rx| {
        attach_core(tx, rx, backend, container_id, streams)
    })
    .await;
}

/// Connects the client to the container's own stdio until it exits or the
/// client leaves (the container keeps running then).
pub(crate) async fn attach_core(
    tx: Tx,
    mut incoming: Rx,
    backend: Arc<dyn StreamBackend>,
    container_id: String,
    streams: Streams,
) {
    let Some(mut output) = backend.attach_output(&container_id) else {
        let msg = format!("container {container_id} is not running");
        finish_with(&tx, &channel::failure_status(&msg)).await;
        return;
    };
    let mut stdin = if streams.stdin {
        match backend.open_stdin(&container_id) {
            Ok(s) => s,
            Err(e) => {
                tracing::info!(container = %container_id, error = %e, "attach: stdin unavailable");
                None
            }
        }
    } else {
        None
    };
    // Whether this session still feeds the container's stdin.
    let mut input_open = stdin.is_some();
    let exited = {
        let wait = backend.wait_container(&container_id);
        tokio::pin!(wait);
        loop {
            tokio::select! {
                r = &mut wait => break Some(r),
                () = tx.closed() => {
                    if input_open {
                        stdin = None;
                        end_input(&*backend, &container_id).await;
                    }
                    break None;
                }
                c = output.next() => match c {
                    Some(Ok(c)) => {
                        if let Some(ch) = chunk_channel(&c, streams) {
                            send(&tx, ch, &c.data).await;
                        }
                    }
                    Some(Err(Lagged(n))) => {
                        tracing::debug!(container = %container_id, lost = n, "attach fell behind");
                    }
                    None => break Some(Ok(0)),
                },
                m = incoming.recv() => match m {
                    None => {
                        // The client left: for stdin_once that ends the
                        // container's input as a half-close would.
                        if input_open {
                            stdin = None;
                            end_input(&*backend, &container_id).await;
                        }
                        break None;
                    }
                    Some(In::Data(STDIN, data)) => {
                        if let Some(w) = stdin.as_mut() {
                            tokio::select! {
                                r = w.write_all(&data) => if r.is_err() { stdin = None },
                                r = &mut wait => break Some(r),
                                () = async { tokio::select! {
                                    () = incoming.closed() => {},
                                    () = tx.closed() => {},
                                } } => {
                                    if input_open {
                                        stdin = None;
                                        end_input(&*backend, &container_id).await;
                                    }
                                    break None;
                                }
                            }
                        }
                    }
                    Some(In::Data(RESIZE, data)) => {
                        if let (true, Some(sz)) = (streams.tty, channel::parse_resize(&data)) {
                            if let Err(e) = backend
                                .resize_container(&container_id, term_size(sz))
                                .await
                            {
                                tracing::debug!(error = %e, "attach resize failed");
                            }
                        }
                    }
                    Some(In::End(STDIN)) if input_open => {
                        input_open = false;
                        stdin = None;
                        end_input(&*backend, &container_id).await;
                    }
                    Some(_) => {}
                }
            }
        }
    };
    drop(stdin);
    if exited.is_some() {
        // The copier may still hold the last lines: forward until quiet.
        while let Ok(Some(Ok(c))) = tokio::time::timeout(ATTACH_SETTLE, output.next()).await {
            if let Some(ch) = chunk_channel(&c, streams) {
                send(&tx, ch, &c.data).await;
            }
        }
        finish_with(&tx, &channel::exit_status(0)).await;
    }
}

/// Ends an attach session's input: the session's own writer is already
/// gone; a `stdin_once` container's stdin is closed too.
async fn end_input(backend: &dyn StreamBackend, container_id: &str) {
    if let Err(e) = backend.attach_stdin_closed(container_id).await {
        tracing::debug!(container = %container_id, error = %e, "attach stdin close failed");
    }
}

/// Forwards each of `ports` to the same port on the sandbox's loopback:
/// channel `2i` carries the data of port `i`, `2i+1` its errors; each
/// channel first carries the port number (little-endian u16).
pub(crate) async fn port_forward<S>(
    ws: WebSocketStream<S>,
    sandbox_id: String,
    target: PodTarget,
    ports: Vec<u16>,
    limits: Limits,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    over_ws(ws, false, false, limits, false, |tx, rx| {
        port_forward_ws(tx, rx, sandbox_id, target, ports)
    })
    .await;
}

async fn port_forward_ws(
    tx: Tx,
    mut incoming: Rx,
    sandbox_id: String,
    target: PodTarget,
    ports: Vec<u16>,
) {
    if ports.is_empty() || ports.len() > 127 {
        tracing::info!(sandbox = %sandbox_id, "port-forward without ports (or too many)");
        return;
    }
    let mut writers: Vec<Option<tokio::net::tcp::OwnedWriteHalf>> = Vec::new();
    let mut pumps = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let data_ch = u8::try_from(2 * i).unwrap_or(u8::MAX);
        let le = port.to_le_bytes();
        send(&tx, data_ch, &le).await;
        send(&tx, data_ch + 1, &le).await;
        match target.dial(*port).await {
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
    'session: while let Some(m) = incoming.recv().await {
        let In::Data(ch, data) = m else { continue };
        let i = usize::from(ch / 2);
        if ch % 2 != 0 {
            continue;
        }
        if let Some(slot) = writers.get_mut(i) {
            if let Some(w) = slot.as_mut() {
                // A pod that does not read must not keep a departed
                // client's session.
                tokio::select! {
                    r = w.write_all(&data) => if r.is_err() { *slot = None },
                    () = incoming.closed() => break 'session,
                }
            }
        }
    }
    drop(writers);
    for p in pumps {
        p.abort();
    }
}
