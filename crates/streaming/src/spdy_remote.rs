//! The Kubernetes remote-command and port-forward protocols over SPDY/3.1,
//! as kubelet's streaming server speaks them.
//!
//! Remote command: the client opens one stream per role, named by its
//! `streamtype` header (`error`, `stdin`, `stdout`, `stderr`, `resize`).
//! Once the expected set is open the session runs on the same exec/attach
//! core as the WebSocket path; stdout and stderr end with FIN, then the
//! error stream carries the status (a `metav1.Status` in v4, the failure
//! message alone before) and ends.
//!
//! Port forward: per forwarded connection the client opens an `error` and
//! a `data` stream sharing `port` and `requestid` headers; each pair is
//! dialled in the pod's network namespace and spliced both ways.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::channel::{self, ERROR, RESIZE, STDERR, STDIN, STDOUT};
use crate::dial::PodTarget;
use crate::limits::Limits;
use crate::queue::{in_queue, InTx};
use crate::session::{self, In, Out};
use crate::spdy::header;
use crate::spdy_session::{Conn, Event, Sender};
use crate::{StreamBackend, Streams};

/// Remote command subprotocols, preferred first.
pub(crate) const REMOTE_COMMAND_PROTOCOLS: &[&str] = &[
    "v4.channel.k8s.io",
    "v3.channel.k8s.io",
    "v2.channel.k8s.io",
    "channel.k8s.io",
];
/// The port-forward subprotocol.
pub(crate) const PORT_FORWARD_PROTOCOL: &str = "portforward.k8s.io";

/// How long the client has to open the streams of a remote command
/// (kubelet's default stream creation timeout).
const STREAM_CREATION_TIMEOUT: Duration = Duration::from_secs(30);
/// Events a client may send before its remote command's streams are open.
const MAX_EARLY_EVENTS: usize = 256;
/// Longest incomplete resize object kept (a real one is ~30 bytes).
const MAX_RESIZE_OBJECT: usize = 4096;
/// Forwarded connections (and half-opened ones) of one port-forward
/// session at once.
pub(crate) const MAX_PORT_FORWARDS: usize = 128;

/// Client data for a pod, holding its share of the connection's budget.
type Queued = (Bytes, OwnedSemaphorePermit);

/// What a remote command session runs.
#[derive(Debug)]
pub(crate) enum Command {
    /// Exec `cmd`.
    Exec {
        /// Container.
        container_id: String,
        /// Command line.
        cmd: Vec<String>,
    },
    /// Attach to the container's stdio.
    Attach {
        /// Container.
        container_id: String,
    },
}

fn role(kind: &str) -> Option<u8> {
    match kind {
        "error" => Some(ERROR),
        "stdin" => Some(STDIN),
        "stdout" => Some(STDOUT),
        "stderr" => Some(STDERR),
        "resize" => Some(RESIZE),
        _ => None,
    }
}

/// The roles a client must open for `streams` before the command starts
/// (resize is optional: it is used whenever it shows up).
fn expected(streams: Streams) -> Vec<u8> {
    let mut v = vec![ERROR];
    if streams.stdin {
        v.push(STDIN);
    }
    if streams.stdout {
        v.push(STDOUT);
    }
    if streams.stderr && !streams.tty {
        v.push(STDERR);
    }
    v
}

/// Splits a resize stream's bytes into whole JSON objects, keeping an
/// incomplete tail in `buf`.
fn resize_objects(buf: &mut BytesMut) -> Vec<Bytes> {
    let mut out = Vec::new();
    loop {
        let mut it =
            serde_json::Deserializer::from_slice(&buf[..]).into_iter::<serde_json::Value>();
        match it.next() {
            Some(Ok(_)) => {
                let end = it.byte_offset();
                out.push(buf.split_to(end).freeze());
            }
            Some(Err(e)) if e.is_eof() => return out,
            Some(Err(_)) => {
                // Not JSON: drop what we have rather than wedge.
                buf.clear();
                return out;
            }
            None => {
                buf.clear();
                return out;
            }
        }
    }
}

/// The error stream's payload for `protocol`: v4 sends the status as is;
/// older versions send only a failure's message.
pub(crate) fn error_payload(v4: bool, status: &[u8]) -> Option<Bytes> {
    if v4 {
        return Some(Bytes::copy_from_slice(status));
    }
    let v: serde_json::Value = serde_json::from_slice(status).ok()?;
    if v["status"] == "Success" {
        return None;
    }
    let msg = v["message"].as_str().unwrap_or("error");
    Some(Bytes::copy_from_slice(msg.as_bytes()))
}

/// Serves one remote command (exec or attach) on a SPDY connection.
pub(crate) async fn remote_command<S>(
    io: S,
    protocol: &str,
    backend: Arc<dyn StreamBackend>,
    command: Command,
    streams: Streams,
    limits: Limits,
) where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let v4 = protocol == REMOTE_COMMAND_PROTOCOLS[0];
    let mut conn = Conn::start(io, &limits);
    // Stream id by role, role by stream id; events for the opened streams
    // that arrive before the set is complete wait in `early`.
    let mut ids: HashMap<u8, u32> = HashMap::new();
    let mut early = VecDeque::new();
    let mut early_bytes = 0usize;
    let want = expected(streams);
    let deadline = tokio::time::sleep(STREAM_CREATION_TIMEOUT);
    tokio::pin!(deadline);
    while !want.iter().all(|r| ids.contains_key(r)) {
        tokio::select! {
            () = &mut deadline => {
                tracing::info!("spdy remote command: timed out waiting for the client's streams");
                conn.shutdown().await;
                return;
            }
            ev = conn.events.recv() => match ev {
                None => {
                    conn.shutdown().await;
                    return;
                }
                Some(Event::Open { id, headers }) => {
                    match header(&headers, "streamtype").and_then(role) {
                        Some(r) => {
                            ids.insert(r, id);
                        }
                        None => tracing::debug!(id, "spdy: stream of unknown type"),
                    }
                }
                Some(ev) => {
                    if let Event::Data { data, .. } = &ev {
                        early_bytes += data.len();
                    }
                    if early_bytes > limits.max_queued_bytes || early.len() >= MAX_EARLY_EVENTS {
                        tracing::info!(
                            bytes = early_bytes,
                            events = early.len(),
                            max_bytes = limits.max_queued_bytes,
                            "spdy remote command: too much sent before the session's streams \
                             were open (streaming.max_queued_bytes): ending it"
                        );
                        conn.shutdown().await;
                        return;
                    }
                    early.push_back(ev);
                }
            }
        }
    }
    let roles: HashMap<u32, u8> = ids.iter().map(|(r, id)| (*id, *r)).collect();
    let (tx, out_rx) = mpsc::channel::<Out>(64);
    let (in_tx, rx) = in_queue(limits.max_queued_bytes, true);
    let writer = tokio::spawn(write_roles(conn.out.clone(), out_rx, ids, v4).in_current_span());
    let events = std::mem::replace(&mut conn.events, mpsc::channel(1).1);
    let reader =
        tokio::spawn(read_roles(events, early, roles, in_tx, conn.out.clone()).in_current_span());
    match command {
        Command::Exec { container_id, cmd } => {
            session::exec_core(tx, rx, backend, container_id, cmd, streams).await;
        }
        Command::Attach { container_id } => {
            session::attach_core(tx, rx, backend, container_id, streams).await;
        }
    }
    let _ = writer.await;
    reader.abort();
    conn.shutdown().await;
}

/// Sends the core's output on the streams of each role; FINs every
/// server-written stream at the end.
async fn write_roles(out: Sender, mut rx: mpsc::Receiver<Out>, ids: HashMap<u8, u32>, v4: bool) {
    let mut ended: Vec<u8> = Vec::new();
    while let Some(m) = rx.recv().await {
        match m {
            Out::Data(ch, data) => {
                let Some(&id) = ids.get(&ch) else { continue };
                if ended.contains(&ch) {
                    continue;
                }
                let payload = if ch == ERROR {
                    match error_payload(v4, &data) {
                        Some(p) => p,
                        None => continue,
                    }
                } else {
                    data
                };
                if !out.data(id, payload).await {
                    return;
                }
            }
            Out::End(ch) => {
                if let Some(&id) = ids.get(&ch) {
                    if !ended.contains(&ch) {
                        ended.push(ch);
                        out.fin(id).await;
                    }
                }
            }
        }
    }
    for ch in [STDOUT, STDERR, ERROR] {
        if let (Some(&id), false) = (ids.get(&ch), ended.contains(&ch)) {
            out.fin(id).await;
        }
    }
}

/// Feeds the client's stdin and resize streams to the core; a late
/// resize stream is picked up when it opens.
async fn read_roles(
    mut events: mpsc::Receiver<Event>,
    mut early: VecDeque<Event>,
    mut roles: HashMap<u32, u8>,
    tx: InTx,
    conn: Sender,
) {
    let mut resize = BytesMut::new();
    loop {
        let ev = match early.pop_front() {
            Some(ev) => ev,
            None => match events.recv().await {
                Some(ev) => ev,
                None => return,
            },
        };
        let msgs = match ev {
            Event::Open { id, headers } => {
                if let Some(r) = header(&headers, "streamtype").and_then(role) {
                    roles.insert(id, r);
                }
                continue;
            }
            Event::Data { id, data } => match roles.get(&id) {
                Some(&STDIN) => vec![In::Data(STDIN, data)],
                Some(&RESIZE) => {
                    resize.extend_from_slice(&data);
                    let objs = resize_objects(&mut resize);
                    if resize.len() > MAX_RESIZE_OBJECT {
                        tracing::debug!(
                            bytes = resize.len(),
                            "spdy: resize object too long, dropped"
                        );
                        resize.clear();
                    }
                    // Only the newest size matters.
                    objs.into_iter()
                        .last()
                        .map(|o| In::Data(RESIZE, o))
                        .into_iter()
                        .collect()
                }
                _ => continue,
            },
            Event::Fin { id } => match roles.get(&id) {
                Some(&STDIN) => vec![In::End(STDIN)],
                _ => continue,
            },
        };
        for m in msgs {
            // The core may be stuck on a process that reads nothing: the
            // client's departure must still end the session.
            tokio::select! {
                r = tx.send(m) => if r.is_err() { return },
                () = conn.closed() => return,
            }
        }
    }
}

#[derive(Debug, Default)]
struct Pair {
    error: Option<u32>,
    data: Option<u32>,
    port: Option<u16>,
}

/// Serves port forwarding into `netns` on a SPDY connection until the
/// client leaves.
pub(crate) async fn port_forward<S>(io: S, sandbox_id: String, target: PodTarget, limits: Limits)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let mut conn = Conn::start(io, &limits);
    let mut pairs: HashMap<String, Pair> = HashMap::new();
    // Client data stream id -> the pair task's input.
    let mut inputs: HashMap<u32, mpsc::Sender<Option<Queued>>> = HashMap::new();
    // Bytes on their way to the pod, over all the connection's pairs.
    let budget = Arc::new(Semaphore::new(limits.max_queued_bytes.max(1)));
    let mut tasks: Vec<JoinHandle<()>> = Vec::new();
    while let Some(ev) = conn.events.recv().await {
        match ev {
            Event::Open { id, headers } => {
                let kind = header(&headers, "streamtype").unwrap_or("");
                // Old clients name no request: the data stream follows
                // its error stream (ids step by 2).
                let request = match header(&headers, "requestid") {
                    Some(r) => r.to_owned(),
                    None if kind == "data" => id.saturating_sub(2).to_string(),
                    None => id.to_string(),
                };
                let port = header(&headers, "port").and_then(|p| p.parse::<u16>().ok());
                if !pairs.contains_key(&request) && pairs.len() >= MAX_PORT_FORWARDS {
                    tracing::debug!(
                        id,
                        "port-forward: too many half-opened requests, ignoring one"
                    );
                    continue;
                }
                let pair = pairs.entry(request.clone()).or_default();
                match kind {
                    "error" => pair.error = Some(id),
                    "data" => pair.data = Some(id),
                    other => {
                        tracing::debug!(id, kind = other, "port-forward: stream of unknown type");
                        continue;
                    }
                }
                if pair.port.is_none() {
                    pair.port = port;
                }
                if let (Some(error), Some(data)) = (pair.error, pair.data) {
                    let port = pair.port;
                    pairs.remove(&request);
                    tasks.retain(|t| !t.is_finished());
                    if tasks.len() >= MAX_PORT_FORWARDS {
                        let msg = format!(
                            "too many forwarded connections on this port-forward session \
                             ({MAX_PORT_FORWARDS} at once)"
                        );
                        tracing::info!("{msg}");
                        conn.out.data(error, Bytes::from(msg.into_bytes())).await;
                        conn.out.fin(data).await;
                        conn.out.fin(error).await;
                        continue;
                    }
                    let (in_tx, in_rx) = mpsc::channel(16);
                    inputs.insert(data, in_tx);
                    tasks.push(tokio::spawn(
                        forward_pair(
                            conn.out.clone(),
                            error,
                            data,
                            port,
                            sandbox_id.clone(),
                            target.clone(),
                            in_rx,
                        )
                        .in_current_span(),
                    ));
                }
            }
            Event::Data { id, data } => {
                if let Some(tx) = inputs.get(&id) {
                    // Wait for the pods to take what is queued first.
                    let n = u32::try_from(data.len().clamp(1, limits.max_queued_bytes.max(1)))
                        .unwrap_or(u32::MAX);
                    // A pod that does not read must not keep a departed
                    // client's session.
                    let permit = tokio::select! {
                        p = Arc::clone(&budget).acquire_many_owned(n) => p.ok(),
                        () = conn.out.closed() => None,
                    };
                    let Some(permit) = permit else { break };
                    let sent = tokio::select! {
                        r = tx.send(Some((data, permit))) => r.is_ok(),
                        () = conn.out.closed() => break,
                    };
                    if !sent {
                        inputs.remove(&id);
                    }
                }
            }
            Event::Fin { id } => {
                if let Some(tx) = inputs.remove(&id) {
                    let _ = tx.send(None).await;
                }
            }
        }
    }
    drop(inputs);
    for t in tasks {
        t.abort();
        let _ = t.await;
    }
    conn.shutdown().await;
}

/// One forwarded connection: dial, splice, report failures on the error
/// stream, FIN both streams at the end.
async fn forward_pair(
    out: Sender,
    error: u32,
    data: u32,
    port: Option<u16>,
    sandbox_id: String,
    target: PodTarget,
    mut input: mpsc::Receiver<Option<Queued>>,
) {
    let result = match port.filter(|p| *p > 0) {
        None => Err("missing or invalid port header".to_owned()),
        Some(port) => match target.dial(port).await {
            Err(e) => Err(format!(
                "error forwarding port {port} to pod {sandbox_id}: {e}"
            )),
            Ok(stream) => {
                let (mut r, mut w) = stream.into_split();
                let upstream = async {
                    while let Some(Some((b, _permit))) = input.recv().await {
                        if w.write_all(&b).await.is_err() {
                            return;
                        }
                    }
                    let _ = w.shutdown().await;
                    // Keep the write half until the pod side is done.
                    std::future::pending::<()>().await;
                };
                let downstream = async {
                    let mut buf = vec![0u8; 32 * 1024];
                    loop {
                        match r.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if !out.data(data, Bytes::copy_from_slice(&buf[..n])).await {
                                    return;
                                }
                            }
                        }
                    }
                };
                tokio::select! {
                    () = upstream => {}
                    () = downstream => {}
                }
                Ok(())
            }
        },
    };
    if let Err(msg) = result {
        tracing::info!("{msg}");
        out.data(error, Bytes::from(msg.into_bytes())).await;
    }
    out.fin(data).await;
    out.fin(error).await;
}

/// Picks our preferred protocol among the client's
/// `X-Stream-Protocol-Version` offers (several headers, or comma
/// separated); `Some("")` when it offered none.
pub(crate) fn negotiate<'a>(offers: &[&str], supported: &[&'a str]) -> Option<&'a str> {
    channel::negotiate(offers, supported)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_streams_follow_the_request() {
        let s = Streams {
            stdin: true,
            stdout: true,
            stderr: false,
            tty: true,
        };
        assert_eq!(expected(s), vec![ERROR, STDIN, STDOUT]);
        let s = Streams {
            stdin: false,
            stdout: true,
            stderr: true,
            tty: false,
        };
        assert_eq!(expected(s), vec![ERROR, STDOUT, STDERR]);
        assert_eq!(role("resize"), Some(RESIZE));
        assert_eq!(role("bogus"), None);
    }

    #[test]
    fn resize_stream_splits_into_objects() {
        let mut b = BytesMut::from(&br#"{"Width":80,"Height":24}{"Width":100,"#[..]);
        let objs = resize_objects(&mut b);
        assert_eq!(objs.len(), 1);
        let sz = channel::parse_resize(&objs[0]).unwrap();
        assert_eq!((sz.width, sz.height), (80, 24));
        b.extend_from_slice(br#""Height":40}"#);
        let objs = resize_objects(&mut b);
        assert_eq!(channel::parse_resize(&objs[0]).map(|s| s.width), Some(100));
        assert!(b.is_empty());
        let mut junk = BytesMut::from(&b"nope"[..]);
        assert!(resize_objects(&mut junk).is_empty());
        assert!(junk.is_empty());
    }

    #[test]
    fn error_payload_by_version() {
        let ok = channel::exit_status(0);
        let bad = channel::exit_status(3);
        assert_eq!(error_payload(true, &ok).as_deref(), Some(&ok[..]));
        assert_eq!(error_payload(false, &ok), None);
        let old = error_payload(false, &bad).unwrap();
        assert!(String::from_utf8_lossy(&old).contains("exit code"));
    }

    #[test]
    fn protocol_negotiation() {
        assert_eq!(
            negotiate(
                &["v4.channel.k8s.io", "v3.channel.k8s.io"],
                REMOTE_COMMAND_PROTOCOLS
            ),
            Some("v4.channel.k8s.io")
        );
        assert_eq!(
            negotiate(&["v2.channel.k8s.io"], REMOTE_COMMAND_PROTOCOLS),
            Some("v2.channel.k8s.io")
        );
        assert_eq!(
            negotiate(&["v9.channel.k8s.io"], REMOTE_COMMAND_PROTOCOLS),
            None
        );
        assert_eq!(
            negotiate(&["portforward.k8s.io"], &[PORT_FORWARD_PROTOCOL]),
            Some(PORT_FORWARD_PROTOCOL)
        );
    }

    use crate::fake::FakeBackend;
    use crate::spdy::{Frame, HeaderCodec};

    async fn send_frame(io: &mut tokio::io::DuplexStream, f: Frame) {
        let mut b = BytesMut::new();
        f.encode(&mut b);
        let _ = io.write_all(&b).await;
    }

    async fn open(io: &mut tokio::io::DuplexStream, codec: &mut HeaderCodec, id: u32, kind: &str) {
        let block = codec.encode(&[("streamtype", kind.as_bytes())]).unwrap();
        send_frame(
            io,
            Frame::SynStream {
                stream_id: id,
                associated_to: 0,
                priority: 0,
                flags: 0,
                block,
            },
        )
        .await;
    }

    #[tokio::test]
    async fn data_sent_before_the_streams_are_open_is_capped() {
        let (mut a, b) = tokio::io::duplex(1 << 20);
        let limits = Limits {
            max_queued_bytes: 64 * 1024,
            ..Limits::default()
        };
        let streams = Streams {
            stdin: true,
            stdout: true,
            stderr: false,
            tty: false,
        };
        let session = tokio::spawn(remote_command(
            b,
            REMOTE_COMMAND_PROTOCOLS[0],
            Arc::new(FakeBackend::default()),
            Command::Exec {
                container_id: "c1".into(),
                cmd: vec!["cat".into()],
            },
            streams,
            limits,
        ));
        let mut codec = HeaderCodec::new();
        open(&mut a, &mut codec, 1, "error").await;
        open(&mut a, &mut codec, 3, "stdin").await;
        // stdout never opens; stdin floods.
        let flood = async {
            for _ in 0..64 {
                send_frame(
                    &mut a,
                    Frame::Data {
                        stream_id: 3,
                        fin: false,
                        data: Bytes::from(vec![b'x'; 16 * 1024]),
                    },
                )
                .await;
            }
            let mut sink = Vec::new();
            let _ = a.read_to_end(&mut sink).await;
        };
        tokio::time::timeout(Duration::from_secs(5), flood)
            .await
            .expect("the session kept buffering before its streams were open");
        tokio::time::timeout(Duration::from_secs(5), session)
            .await
            .expect("the session went on")
            .unwrap();
    }

    #[tokio::test]
    async fn an_endless_resize_object_is_dropped_and_later_ones_still_apply() {
        let (ev_tx, events) = mpsc::channel(16);
        let (in_tx, mut in_rx) = in_queue(1 << 20, true);
        let (a, b) = tokio::io::duplex(1 << 16);
        let conn = Conn::start(b, &Limits::default());
        let roles: HashMap<u32, u8> = [(5, RESIZE)].into_iter().collect();
        let reader = tokio::spawn(read_roles(
            events,
            VecDeque::new(),
            roles,
            in_tx,
            conn.out.clone(),
        ));
        // A valid prefix that never ends (whitespace), then its end: the
        // object is over the limit, so its tail is junk, not a size.
        let mut junk = br#"{"Width":"#.to_vec();
        junk.extend(std::iter::repeat_n(b' ', 3 * MAX_RESIZE_OBJECT));
        ev_tx
            .send(Event::Data {
                id: 5,
                data: Bytes::from(junk),
            })
            .await
            .unwrap();
        for obj in [r#"1,"Height":2}"#, r#"{"Width":120,"Height":40}"#] {
            ev_tx
                .send(Event::Data {
                    id: 5,
                    data: Bytes::from(obj),
                })
                .await
                .unwrap();
        }
        drop(ev_tx);
        let mut sizes = Vec::new();
        while let Some(m) = in_rx.recv().await {
            if let In::Data(RESIZE, d) = m {
                sizes.push(channel::parse_resize(&d).map(|s| s.width));
            }
        }
        reader.await.unwrap();
        // (A bare `1` may pass as a value; it is no size.)
        let sizes: Vec<u16> = sizes.into_iter().flatten().collect();
        assert_eq!(sizes, vec![120]);
        drop((a, conn));
    }
}
