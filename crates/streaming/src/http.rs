//! The HTTP/1.1 side: accept loop, routing by path and token, and the
//! upgrade to WebSocket or SPDY/3.1.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::channel::{self, PORT_FORWARD, SPDY_TUNNEL_PORT_FORWARD, V1, V4, V5};
use crate::dial::PodTarget;
use crate::limits::{Limits, SessionSlot};
use crate::session;
use crate::spdy_remote::{self, Command, PORT_FORWARD_PROTOCOL, REMOTE_COMMAND_PROTOCOLS};
use crate::{AttachRequest, ExecRequest, Pending, PortForwardRequest, Shared, StreamBackend};

type Body = Full<Bytes>;

/// Holds one of the `max_connections` slots: the HTTP connection and, after
/// an upgrade, its session share it.
type ConnSlot = Arc<OwnedSemaphorePermit>;

/// What a connection over `max_connections` is told before it is closed.
const TOO_MANY_CONNECTIONS: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
Content-Type: text/plain; charset=utf-8\r\n\
Retry-After: 1\r\n\
Connection: close\r\n\
Content-Length: 77\r\n\
\r\n\
too many streaming connections (streaming.max_connections): try again later\r\n";

/// Accepts connections until `shutdown` is cancelled.
pub(crate) async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    backend: Arc<dyn StreamBackend>,
    shutdown: CancellationToken,
) {
    tracing::info!(addr = %shared.addr, tls = shared.tls.is_some(), "streaming server listening");
    let slots = Arc::new(Semaphore::new(shared.limits.max_connections));
    loop {
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors, typically: let some close
                    // rather than spin.
                    tracing::warn!(error = %e, "streaming accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        keep_alive(&stream, peer);
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            // One non-blocking write and the socket is closed: a refused
            // client costs no task and no buffer.
            let _ = stream.try_write(TOO_MANY_CONNECTIONS);
            tracing::debug!(%peer, max = shared.limits.max_connections, "streaming connection refused: too many");
            continue;
        };
        let slot: ConnSlot = Arc::new(slot);
        let shared = Arc::clone(&shared);
        let backend = Arc::clone(&backend);
        tokio::spawn(
            async move {
                match shared.tls.clone() {
                    None => serve_connection(stream, peer, shared, backend, slot).await,
                    Some(acceptor) => {
                        match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream))
                            .await
                        {
                            Ok(Ok(tls)) => serve_connection(tls, peer, shared, backend, slot).await,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "streaming TLS handshake failed")
                            }
                            Err(_) => tracing::debug!(%peer, "streaming TLS handshake timed out"),
                        }
                    }
                }
            }
            .instrument(tracing::debug_span!("streaming_connection", %peer)),
        );
    }
}

/// TCP keep-alive of every accepted connection: probes after 15 s of
/// silence, every 15 s, 4 unanswered probes and the connection is reset.
/// A client whose host died or whose link was cut (no FIN, no RST ever
/// comes) then ends its silent session in about 75 s, where it would
/// otherwise hold its exec process, its session slot and its connection slot
/// until `stream_idle_timeout` (4 h). (Data sent and never acknowledged is
/// the kernel's retransmission limit's to end.)
/// containerd's streaming server (Go's `net/http`) probes on the same 15 s.
const KEEPALIVE: socket2::TcpKeepalive = socket2::TcpKeepalive::new()
    .with_time(std::time::Duration::from_secs(15))
    .with_interval(std::time::Duration::from_secs(15))
    .with_retries(4);

/// Turns TCP keep-alive on for `stream` (see [`KEEPALIVE`]).
fn keep_alive(stream: &tokio::net::TcpStream, peer: std::net::SocketAddr) {
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_keepalive(&KEEPALIVE) {
        tracing::debug!(%peer, error = %e, "streaming connection: no TCP keep-alive");
    }
}

/// A client that does not finish its TLS handshake by then is dropped.
const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Pause after a failed accept.
const ACCEPT_BACKOFF: std::time::Duration = std::time::Duration::from_millis(50);
/// Largest request head (and read buffer) of a connection.
const MAX_HEAD: usize = 64 * 1024;

/// Serves HTTP/1.1 with upgrades on one connection (plain or TLS).
async fn serve_connection<S>(
    io: S,
    peer: std::net::SocketAddr,
    shared: Arc<Shared>,
    backend: Arc<dyn StreamBackend>,
    slot: ConnSlot,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let header_read_timeout = shared.limits.header_read_timeout;
    let svc = hyper::service::service_fn(move |req| {
        let shared = Arc::clone(&shared);
        let backend = Arc::clone(&backend);
        let slot = Arc::clone(&slot);
        async move { Ok::<_, Infallible>(handle(req, &shared, backend, slot)) }
    });
    // hyper applies the header read timeout only with a timer.
    if let Err(e) = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .max_buf_size(MAX_HEAD)
        .serve_connection(TokioIo::new(io), svc)
        .with_upgrades()
        .await
    {
        tracing::debug!(%peer, error = %e, "streaming connection ended with an error");
    }
}

/// The WebSocket settings of a session: messages and frames capped at
/// `max_message_size`, small buffers.
fn ws_config(limits: &Limits) -> WebSocketConfig {
    let max = limits.max_message_size.max(1);
    WebSocketConfig::default()
        .read_buffer_size(16 * 1024)
        .write_buffer_size(16 * 1024)
        .max_write_buffer_size(16 * 1024 + 2 * max + 64 * 1024)
        .max_message_size(Some(max))
        .max_frame_size(Some(max))
}

/// What a session runs on: the container (exec, attach) or the sandbox
/// (port-forward).
fn session_key(p: &Pending) -> &str {
    match p {
        Pending::Exec(r) => &r.container_id,
        Pending::Attach(r) => &r.container_id,
        Pending::PortForward(r) => &r.pod_sandbox_id,
    }
}

/// Takes the token's request and a session slot of its container; the
/// refusal to answer otherwise.
fn take_session(
    shared: &Shared,
    kind: &str,
    token: &str,
) -> Result<(Pending, SessionSlot), Box<Response<Body>>> {
    // Single use: the token is gone from here on, whatever happens next.
    let pending = match shared.tokens.take(token) {
        Some(p) if p.path() == kind => p,
        _ => {
            return Err(Box::new(text(
                StatusCode::NOT_FOUND,
                "unknown or expired streaming token",
            )))
        }
    };
    let key = session_key(&pending);
    match shared.sessions.try_acquire(key) {
        Some(slot) => Ok((pending, slot)),
        None => {
            let what = if matches!(pending, Pending::PortForward(_)) {
                "pod sandbox"
            } else {
                "container"
            };
            let max = shared.limits.max_sessions_per_container;
            tracing::info!(
                key,
                max,
                "streaming session refused: too many on this {what}"
            );
            Err(Box::new(text(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "too many streaming sessions on {what} {key}: {max} are running \
                     (streaming.max_sessions_per_container)"
                ),
            )))
        }
    }
}

fn text(status: StatusCode, msg: impl Into<String>) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(msg.into() + "\n")));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn header_values(req: &Request<Incoming>, name: header::HeaderName) -> Vec<&str> {
    req.headers()
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect()
}

fn ports_from_query(query: Option<&str>) -> Result<Vec<u16>, String> {
    let mut ports = Vec::new();
    for pair in query.unwrap_or("").split('&') {
        let Some(v) = pair.strip_prefix("port=") else {
            continue;
        };
        for p in v.split(',').filter(|p| !p.is_empty()) {
            match p.parse::<u16>() {
                Ok(n) if n > 0 => ports.push(n),
                _ => return Err(format!("invalid port {p:?}")),
            }
        }
    }
    Ok(ports)
}

fn handle(
    req: Request<Incoming>,
    shared: &Shared,
    backend: Arc<dyn StreamBackend>,
    conn: ConnSlot,
) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let (kind, token) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if !matches!(kind, "exec" | "attach" | "portforward") || token.is_empty() || token.contains('/')
    {
        return text(StatusCode::NOT_FOUND, "not found");
    }
    if req.method() != Method::GET && req.method() != Method::POST {
        return text(StatusCode::METHOD_NOT_ALLOWED, "use GET with an upgrade");
    }
    let upgrade = header_values(&req, header::UPGRADE)
        .join(",")
        .to_ascii_lowercase();
    if upgrade.contains("spdy") {
        return spdy_upgrade(req, kind, token, &upgrade, shared, backend, conn);
    }
    if !upgrade.contains("websocket") {
        return text(
            StatusCode::BAD_REQUEST,
            "an upgrade to websocket is required (v5.channel.k8s.io / v4.channel.k8s.io)",
        );
    }
    let Some(key) = req.headers().get(header::SEC_WEBSOCKET_KEY).cloned() else {
        return text(StatusCode::BAD_REQUEST, "missing Sec-WebSocket-Key");
    };
    let offers = header_values(&req, header::SEC_WEBSOCKET_PROTOCOL);
    let supported: &[&str] = if kind == "portforward" {
        &[SPDY_TUNNEL_PORT_FORWARD, V4, PORT_FORWARD]
    } else {
        &[V5, V4, V1]
    };
    let Some(proto) = channel::negotiate(&offers, supported) else {
        return text(
            StatusCode::BAD_REQUEST,
            format!("none of the offered subprotocols {offers:?} is supported (want one of {supported:?})"),
        );
    };
    let ports = match ports_from_query(req.uri().query()) {
        Ok(p) => p,
        Err(e) => return text(StatusCode::BAD_REQUEST, e),
    };
    let (pending, session) = match take_session(shared, kind, token) {
        Ok(s) => s,
        Err(refusal) => return *refusal,
    };
    let v5 = proto == V5;
    let legacy = proto == V1;
    let tunnel = proto == SPDY_TUNNEL_PORT_FORWARD;
    let accept = derive_accept_key(key.as_bytes());
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    if let Ok(v) = HeaderValue::from_str(&accept) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    if !proto.is_empty() {
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static(proto_static(proto)),
        );
    }
    let span = pending.span();
    let limits = shared.limits;
    tokio::spawn(
        async move {
            // Held until the session ends.
            let _held = (conn, session);
            let upgraded = match hyper::upgrade::on(req).await {
                Ok(u) => u,
                Err(e) => {
                    tracing::warn!(error = %e, "streaming upgrade failed");
                    return;
                }
            };
            let ws = WebSocketStream::from_raw_socket(
                TokioIo::new(upgraded),
                Role::Server,
                Some(ws_config(&limits)),
            )
            .await;
            match pending {
                Pending::Exec(ExecRequest {
                    container_id,
                    cmd,
                    streams,
                }) => {
                    session::exec(ws, v5, legacy, backend, container_id, cmd, streams, limits).await
                }
                Pending::Attach(AttachRequest {
                    container_id,
                    streams,
                }) => session::attach(ws, v5, legacy, backend, container_id, streams, limits).await,
                Pending::PortForward(PortForwardRequest {
                    pod_sandbox_id: sandbox_id,
                    netns,
                    ports: req_ports,
                }) => {
                    let target = PodTarget { netns, backend };
                    if tunnel {
                        // The ports come in the SPDY streams' headers.
                        let io = session::ws_byte_stream(ws);
                        spdy_remote::port_forward(io, sandbox_id, target, limits).await;
                    } else {
                        let ports = if ports.is_empty() { req_ports } else { ports };
                        session::port_forward(ws, sandbox_id, target, ports, limits).await;
                    }
                }
            }
        }
        .instrument(span),
    );
    resp
}

/// `X-Stream-Protocol-Version`: the SPDY subprotocol header.
const STREAM_PROTOCOL: &str = "x-stream-protocol-version";

/// Answers a SPDY/3.1 upgrade: negotiates the subprotocol, takes the token,
/// switches protocols and runs the session on the upgraded connection.
fn spdy_upgrade(
    req: Request<Incoming>,
    kind: &str,
    token: &str,
    upgrade: &str,
    shared: &Shared,
    backend: Arc<dyn StreamBackend>,
    conn: ConnSlot,
) -> Response<Body> {
    if !upgrade.split(',').any(|u| u.trim() == "spdy/3.1") {
        return text(
            StatusCode::BAD_REQUEST,
            format!("unsupported upgrade {upgrade:?}: cubelet speaks SPDY/3.1 and websocket"),
        );
    }
    let offers: Vec<&str> = req
        .headers()
        .get_all(STREAM_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let supported: &[&str] = if kind == "portforward" {
        &[PORT_FORWARD_PROTOCOL]
    } else {
        REMOTE_COMMAND_PROTOCOLS
    };
    let Some(proto) = spdy_remote::negotiate(&offers, supported) else {
        return text(
            StatusCode::BAD_REQUEST,
            format!(
                "unable to negotiate protocol: client supports {offers:?}, server supports {supported:?}"
            ),
        );
    };
    // No offer: the oldest protocol, unnamed (as kubelet does).
    let proto = if proto.is_empty() && kind != "portforward" {
        "channel.k8s.io"
    } else {
        proto
    };
    let (pending, session) = match take_session(shared, kind, token) {
        Ok(s) => s,
        Err(refusal) => return *refusal,
    };
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    if let (false, Ok(v)) = (offers.is_empty(), HeaderValue::from_str(proto)) {
        h.insert(STREAM_PROTOCOL, v);
    }
    let proto = proto.to_owned();
    let span = pending.span();
    let limits = shared.limits;
    tokio::spawn(
        async move {
            // Held until the session ends.
            let _held = (conn, session);
            let upgraded = match hyper::upgrade::on(req).await {
                Ok(u) => TokioIo::new(u),
                Err(e) => {
                    tracing::warn!(error = %e, "streaming upgrade failed");
                    return;
                }
            };
            match pending {
                Pending::Exec(ExecRequest {
                    container_id,
                    cmd,
                    streams,
                }) => {
                    let c = Command::Exec { container_id, cmd };
                    spdy_remote::remote_command(upgraded, &proto, backend, c, streams, limits)
                        .await;
                }
                Pending::Attach(AttachRequest {
                    container_id,
                    streams,
                }) => {
                    let c = Command::Attach { container_id };
                    spdy_remote::remote_command(upgraded, &proto, backend, c, streams, limits)
                        .await;
                }
                Pending::PortForward(PortForwardRequest {
                    pod_sandbox_id: sandbox_id,
                    netns,
                    ..
                }) => {
                    let target = PodTarget { netns, backend };
                    spdy_remote::port_forward(upgraded, sandbox_id, target, limits).await
                }
            }
        }
        .instrument(span),
    );
    resp
}

fn proto_static(p: &str) -> &'static str {
    match p {
        V5 => V5,
        V1 => V1,
        PORT_FORWARD => PORT_FORWARD,
        SPDY_TUNNEL_PORT_FORWARD => SPDY_TUNNEL_PORT_FORWARD,
        _ => V4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_parse_from_query() {
        assert_eq!(
            ports_from_query(Some("port=80&port=8080,9090")),
            Ok(vec![80, 8080, 9090])
        );
        assert_eq!(ports_from_query(None), Ok(vec![]));
        assert!(ports_from_query(Some("port=0")).is_err());
        assert!(ports_from_query(Some("port=http")).is_err());
    }
}
