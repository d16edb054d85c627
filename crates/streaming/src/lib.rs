//! Cubelet's streaming server: exec, attach and port-forward over WebSocket
//! and SPDY/3.1.
//!
//! A caller (the CRI edge) registers an [`ExecRequest`], [`AttachRequest`]
//! or [`PortForwardRequest`] with [`StreamingServer::exec`] and friends; the
//! request is stored under a single-use random token that expires after the
//! idle timeout, and the caller gets back
//! `http(s)://<address>:<port>/<kind>/<token>` (https when the server has a
//! certificate, see [`TlsFiles`]). The client (kubelet, crictl, kubectl
//! through the API server) then connects to that URL on this server's own
//! TCP listener and upgrades to WebSocket with the Kubernetes channel
//! protocol (`v4.channel.k8s.io`, `v5.channel.k8s.io`, and for exec and
//! attach the first one, `channel.k8s.io`), or to SPDY/3.1
//! (`X-Stream-Protocol-Version: v4.channel.k8s.io` .. `channel.k8s.io`, or
//! `portforward.k8s.io`), which crictl and kubelet's proxy speak.
//!
//! This crate knows nothing of CRI, containerd or network namespaces: it
//! validates nothing about containers or pods (the caller did), and reaches
//! them only through the [`StreamBackend`] it is served with.

mod backend;
mod channel;
mod dial;
mod error;
#[cfg(test)]
mod fake;
mod http;
mod limits;
mod queue;
mod request;
mod session;
mod spdy;
mod spdy_remote;
mod spdy_session;
mod tls;
mod tokens;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use self::backend::{
    AttachOutput, BackendError, ExecIo, ExecOptions, ExecProcess, Lagged, OutputChunk,
    OutputStream, Reader, StreamBackend, TerminalSize, Writer,
};
pub use self::error::StreamingError;
use self::limits::SessionSlots;
pub use self::limits::{
    Limits, DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_IN_FLIGHT_URLS,
    DEFAULT_MAX_MESSAGE_SIZE, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_SESSIONS_PER_CONTAINER,
    DEFAULT_STREAM_IDLE_TIMEOUT,
};
pub use self::request::{AttachRequest, ExecRequest, PortForwardRequest, Streams};
pub use self::tls::TlsFiles;
use self::tokens::TokenStore;

/// Default idle timeout of a token (kubelet's streaming server: 4 minutes).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(4 * 60);

/// Where and how the streaming server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamingConfig {
    /// Listen address.
    pub address: IpAddr,
    /// Port; 0 picks a free one.
    pub port: u16,
    /// How long a returned URL stays usable.
    pub idle_timeout: Duration,
    /// Serve HTTPS with this certificate; `None` = plain HTTP.
    pub tls: Option<TlsFiles>,
    /// What a client may hold and make the server buffer.
    pub limits: Limits,
}

impl Default for StreamingConfig {
    fn default() -> Self {
        Self {
            address: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            tls: None,
            limits: Limits::default(),
        }
    }
}

/// A request waiting for its client to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Pending {
    /// Run a command in a container.
    Exec(ExecRequest),
    /// Attach to a container's own stdio.
    Attach(AttachRequest),
    /// Forward ports into a pod's network namespace.
    PortForward(PortForwardRequest),
}

impl Pending {
    fn path(&self) -> &'static str {
        match self {
            Pending::Exec(_) => "exec",
            Pending::Attach(_) => "attach",
            Pending::PortForward(_) => "portforward",
        }
    }

    /// The span a session of this request runs in (never the token).
    fn span(&self) -> tracing::Span {
        match self {
            Pending::Exec(r) => {
                tracing::info_span!("stream", kind = "exec", container_id = %r.container_id)
            }
            Pending::Attach(r) => {
                tracing::info_span!("stream", kind = "attach", container_id = %r.container_id)
            }
            Pending::PortForward(r) => {
                tracing::info_span!("stream", kind = "portforward", sandbox_id = %r.pod_sandbox_id)
            }
        }
    }
}

pub(crate) struct Shared {
    addr: SocketAddr,
    /// Present when serving HTTPS.
    tls: Option<tokio_rustls::TlsAcceptor>,
    tokens: TokenStore<Pending>,
    limits: Limits,
    sessions: Arc<SessionSlots>,
}

/// Handle of the streaming server: cheap to clone; the CRI edge registers
/// requests through it, the binary runs it with [`StreamingServer::serve`].
#[derive(Clone)]
pub struct StreamingServer {
    shared: Arc<Shared>,
    listener: Arc<std::sync::Mutex<Option<TcpListener>>>,
}

impl std::fmt::Debug for StreamingServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingServer")
            .field("addr", &self.shared.addr)
            .finish_non_exhaustive()
    }
}

impl StreamingServer {
    /// Loads the TLS certificate if any and binds the listener (port 0 = a
    /// free port). Serving starts with [`StreamingServer::serve`].
    pub async fn bind(config: &StreamingConfig) -> Result<Self, StreamingError> {
        let tls = config.tls.as_ref().map(tls::acceptor).transpose()?;
        let addr = SocketAddr::new(config.address, config.port);
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| StreamingError::Bind { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| StreamingError::Bind { addr, source })?;
        Ok(Self {
            shared: Arc::new(Shared {
                addr,
                tls,
                tokens: TokenStore::new(config.idle_timeout, config.limits.max_in_flight_urls),
                limits: config.limits,
                sessions: SessionSlots::new(config.limits.max_sessions_per_container),
            }),
            listener: Arc::new(std::sync::Mutex::new(Some(listener))),
        })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// Stores an exec request and returns the URL its client must use.
    pub fn exec(&self, req: ExecRequest) -> Result<String, StreamingError> {
        self.register(Pending::Exec(req))
    }

    /// Stores an attach request and returns the URL its client must use.
    pub fn attach(&self, req: AttachRequest) -> Result<String, StreamingError> {
        self.register(Pending::Attach(req))
    }

    /// Stores a port-forward request and returns the URL its client must
    /// use.
    pub fn port_forward(&self, req: PortForwardRequest) -> Result<String, StreamingError> {
        self.register(Pending::PortForward(req))
    }

    /// Stores `req` and returns the URL its client must use.
    fn register(&self, req: Pending) -> Result<String, StreamingError> {
        let kind = req.path();
        let token = self.shared.tokens.insert(req)?;
        let scheme = if self.shared.tls.is_some() {
            "https"
        } else {
            "http"
        };
        Ok(format!("{scheme}://{}/{kind}/{token}", self.shared.addr))
    }

    /// Serves connections until `shutdown` is cancelled, running sessions on
    /// `backend`. Sessions in progress finish on their own. Serving twice is
    /// an error.
    pub async fn serve(
        &self,
        backend: Arc<dyn StreamBackend>,
        shutdown: CancellationToken,
    ) -> Result<(), StreamingError> {
        let listener = self
            .listener
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or(StreamingError::AlreadyServing)?;
        http::serve(listener, Arc::clone(&self.shared), backend, shutdown).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeBackend;
    use futures::{SinkExt, StreamExt};
    use std::sync::atomic::Ordering;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
    use tokio_tungstenite::tungstenite::protocol::CloseFrame;
    use tokio_tungstenite::tungstenite::Message;

    type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

    async fn served() -> (StreamingServer, Arc<FakeBackend>, CancellationToken) {
        served_with(Limits::default()).await
    }

    async fn served_with(limits: Limits) -> (StreamingServer, Arc<FakeBackend>, CancellationToken) {
        let server = StreamingServer::bind(&StreamingConfig {
            limits,
            ..StreamingConfig::default()
        })
        .await
        .unwrap();
        let backend = Arc::new(FakeBackend::default());
        let stop = CancellationToken::new();
        let s = server.clone();
        let (b, c) = (Arc::clone(&backend) as Arc<dyn StreamBackend>, stop.clone());
        tokio::spawn(async move { s.serve(b, c).await.unwrap() });
        (server, backend, stop)
    }

    async fn connect(
        url: &str,
        protocol: &str,
    ) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
        let url = url.replacen("http://", "ws://", 1);
        let mut req = url.as_str().into_client_request().unwrap();
        req.headers_mut()
            .insert("Sec-WebSocket-Protocol", protocol.parse().unwrap());
        let addr = req.uri().authority().unwrap().as_str().to_owned();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        Ok(tokio_tungstenite::client_async(req, tcp).await?.0)
    }

    /// Every channel message until the server closes: (channel, payload).
    async fn drain(ws: &mut Ws) -> Vec<(u8, Vec<u8>)> {
        let mut out = Vec::new();
        while let Some(m) = ws.next().await {
            match m.unwrap() {
                Message::Binary(b) => out.push((b[0], b[1..].to_vec())),
                Message::Close(_) => break,
                _ => {}
            }
        }
        out
    }

    fn on(msgs: &[(u8, Vec<u8>)], ch: u8) -> Vec<u8> {
        msgs.iter()
            .filter(|(c, _)| *c == ch)
            .flat_map(|(_, d)| d.clone())
            .collect()
    }

    fn exec(cmd: &[&str], stdin: bool) -> ExecRequest {
        ExecRequest {
            container_id: "c1".into(),
            cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
            streams: Streams {
                stdin,
                stdout: true,
                stderr: true,
                tty: false,
            },
        }
    }

    #[tokio::test]
    async fn exec_over_websocket_runs_on_the_backend_once_per_token() {
        let (server, backend, stop) = served().await;
        let url = server.exec(exec(&["echo", "hello"], false)).unwrap();
        assert!(url.starts_with(&format!("http://{}/exec/", server.local_addr())));
        let mut ws = connect(&url, channel::V5).await.unwrap();
        let msgs = drain(&mut ws).await;
        assert_eq!(on(&msgs, channel::STDOUT), b"hello\n");
        let status: serde_json::Value = serde_json::from_slice(&on(&msgs, channel::ERROR)).unwrap();
        assert_eq!(status["status"], "Success");
        assert_eq!(backend.cleaned_up.load(Ordering::SeqCst), 1);
        // Single use: the same URL is refused now.
        assert!(connect(&url, channel::V5).await.is_err());
        stop.cancel();
    }

    #[tokio::test]
    async fn exec_reports_exit_codes_and_start_failures() {
        let (server, _backend, stop) = served().await;
        let url = server.exec(exec(&["exit", "3"], false)).unwrap();
        let msgs = drain(&mut connect(&url, channel::V4).await.unwrap()).await;
        let status: serde_json::Value = serde_json::from_slice(&on(&msgs, channel::ERROR)).unwrap();
        assert_eq!(status["reason"], "NonZeroExitCode");
        assert_eq!(status["details"]["causes"][0]["message"], "3");
        let url = server.exec(exec(&["nope"], false)).unwrap();
        let msgs = drain(&mut connect(&url, channel::V4).await.unwrap()).await;
        let status: serde_json::Value = serde_json::from_slice(&on(&msgs, channel::ERROR)).unwrap();
        assert!(
            status["message"]
                .as_str()
                .unwrap()
                .contains("command not found"),
            "{status}"
        );
        stop.cancel();
    }

    /// `channel.k8s.io` (what Kubernetes' node e2e suite asks for): the
    /// output as v4, nothing on the error channel after a success, and only
    /// the message after a failure.
    #[tokio::test]
    async fn exec_over_the_first_channel_protocol_sends_no_success_status() {
        let (server, _backend, stop) = served().await;
        let url = server.exec(exec(&["echo", "hello"], false)).unwrap();
        let msgs = drain(&mut connect(&url, channel::V1).await.unwrap()).await;
        assert_eq!(on(&msgs, channel::STDOUT), b"hello\n");
        assert!(on(&msgs, channel::ERROR).is_empty(), "{msgs:?}");
        let url = server.exec(exec(&["exit", "3"], false)).unwrap();
        let msgs = drain(&mut connect(&url, channel::V1).await.unwrap()).await;
        assert_eq!(
            on(&msgs, channel::ERROR),
            b"command terminated with non-zero exit code: exit status 3"
        );
        stop.cancel();
    }

    #[tokio::test]
    async fn exec_stdin_ends_with_a_v5_close() {
        let (server, _backend, stop) = served().await;
        let url = server.exec(exec(&["cat"], true)).unwrap();
        let mut ws = connect(&url, channel::V5).await.unwrap();
        ws.send(Message::Binary(channel::frame(channel::STDIN, b"ping\n")))
            .await
            .unwrap();
        ws.send(Message::Binary(channel::frame(
            channel::CLOSE,
            &[channel::STDIN],
        )))
        .await
        .unwrap();
        let msgs = drain(&mut ws).await;
        assert_eq!(on(&msgs, channel::STDOUT), b"ping\n");
        stop.cancel();
    }

    #[tokio::test]
    async fn attach_to_a_container_that_is_not_running_fails_on_the_error_channel() {
        let (server, _backend, stop) = served().await;
        let url = server
            .attach(AttachRequest {
                container_id: "gone".into(),
                streams: Streams {
                    stdout: true,
                    ..Streams::default()
                },
            })
            .unwrap();
        let msgs = drain(&mut connect(&url, channel::V5).await.unwrap()).await;
        let status: serde_json::Value = serde_json::from_slice(&on(&msgs, channel::ERROR)).unwrap();
        assert_eq!(status["message"], "container gone is not running");
        stop.cancel();
    }

    #[tokio::test]
    async fn port_forward_over_websocket_dials_through_the_backend() {
        let (server, _backend, stop) = served().await;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf).await.unwrap();
            s.write_all(&[b"re: ", &buf[..]].concat()).await.unwrap();
        });
        let url = server
            .port_forward(PortForwardRequest {
                pod_sandbox_id: "p1".into(),
                netns: None,
                ports: vec![port],
            })
            .unwrap();
        let mut ws = connect(&url, channel::V4).await.unwrap();
        let mut got = Vec::new();
        // Both channels first carry the port.
        for _ in 0..2 {
            match ws.next().await.unwrap().unwrap() {
                Message::Binary(b) => got.push(b.to_vec()),
                m => panic!("unexpected {m:?}"),
            }
        }
        let le = port.to_le_bytes();
        assert_eq!(got, vec![vec![0, le[0], le[1]], vec![1, le[0], le[1]]]);
        ws.send(Message::Binary(channel::frame(0, b"ping")))
            .await
            .unwrap();
        let mut data = Vec::new();
        while data.len() < 8 {
            match ws.next().await.unwrap().unwrap() {
                Message::Binary(b) if b[0] == 0 => data.extend_from_slice(&b[1..]),
                _ => {}
            }
        }
        assert_eq!(data, b"re: ping");
        stop.cancel();
    }

    #[tokio::test]
    async fn serving_twice_is_an_error() {
        let server = StreamingServer::bind(&StreamingConfig::default())
            .await
            .unwrap();
        let backend: Arc<dyn StreamBackend> = Arc::new(FakeBackend::default());
        let stop = CancellationToken::new();
        tokio::select! {
            biased;
            r = server.serve(Arc::clone(&backend), stop.clone()) => panic!("the first serve ended: {r:?}"),
            r = async {
                tokio::task::yield_now().await;
                server.serve(Arc::clone(&backend), stop.clone()).await
            } => assert!(matches!(r, Err(StreamingError::AlreadyServing)), "{r:?}"),
        }
    }

    /// Everything the server sends on `tcp` until it closes it (none after
    /// `limit`: an error).
    async fn read_to_close(tcp: &mut tokio::net::TcpStream, limit: Duration) -> Result<String, ()> {
        use tokio::io::AsyncReadExt;
        let mut got = Vec::new();
        match tokio::time::timeout(limit, tcp.read_to_end(&mut got)).await {
            Ok(_) => Ok(String::from_utf8_lossy(&got).into_owned()),
            Err(_) => Err(()),
        }
    }

    const SHORT: Duration = Duration::from_millis(300);
    /// Far longer than any limit the tests set: only a missing limit waits
    /// this long.
    const PATIENCE: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn a_silent_or_partial_request_head_is_closed_after_the_header_timeout() {
        use tokio::io::AsyncWriteExt;
        let (server, _backend, stop) = served_with(Limits {
            header_read_timeout: SHORT,
            ..Limits::default()
        })
        .await;
        let mut silent = tokio::net::TcpStream::connect(server.local_addr())
            .await
            .unwrap();
        let mut partial = tokio::net::TcpStream::connect(server.local_addr())
            .await
            .unwrap();
        partial
            .write_all(b"GET /exec/x HTTP/1.1\r\nHost: a\r\n")
            .await
            .unwrap();
        assert!(
            read_to_close(&mut silent, PATIENCE).await.is_ok(),
            "silent connection kept"
        );
        let answer = read_to_close(&mut partial, PATIENCE).await;
        assert!(answer.is_ok(), "partial head kept");
        stop.cancel();
    }

    #[tokio::test]
    async fn connections_over_the_cap_are_answered_503_and_closed() {
        let (server, _backend, stop) = served_with(Limits {
            max_connections: 2,
            ..Limits::default()
        })
        .await;
        let _a = tokio::net::TcpStream::connect(server.local_addr())
            .await
            .unwrap();
        let _b = tokio::net::TcpStream::connect(server.local_addr())
            .await
            .unwrap();
        let mut c = tokio::net::TcpStream::connect(server.local_addr())
            .await
            .unwrap();
        let answer = read_to_close(&mut c, PATIENCE)
            .await
            .expect("a third connection was kept");
        assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
        assert!(answer.contains("streaming.max_connections"), "{answer}");
        // The answer is well-formed: its length is what it says.
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(
            head.contains(&format!("Content-Length: {}", body.len())),
            "{answer}"
        );
        // A slot frees when a connection closes.
        drop(_a);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let url = server.exec(exec(&["echo", "again"], false)).unwrap();
        let msgs = drain(&mut connect(&url, channel::V5).await.unwrap()).await;
        assert_eq!(on(&msgs, channel::STDOUT), b"again\n");
        stop.cancel();
    }

    #[tokio::test]
    async fn accepted_connections_probe_a_silent_peer() {
        // The kernel's view of the server's end of a connection: a client
        // that vanishes without a FIN is found by keep-alive probes.
        let Ok(ss) = std::process::Command::new("ss").arg("-V").output() else {
            println!("SKIP: no ss (iproute2) to read the socket's timers");
            return;
        };
        assert!(ss.status.success());
        let (server, _backend, stop) = served().await;
        let port = server.local_addr().port();
        let _client = tokio::net::TcpStream::connect(server.local_addr())
            .await
            .unwrap();
        let mut timers = String::new();
        for _ in 0..50 {
            let out = std::process::Command::new("ss")
                .args(["-tnoH", "state", "established"])
                .arg(format!("( sport = :{port} )"))
                .output()
                .unwrap();
            timers = String::from_utf8_lossy(&out.stdout).into_owned();
            if timers.contains("keepalive") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // `timer:(keepalive,14sec,0)`: the first probe within 15 s.
        let secs: u64 = timers
            .split("timer:(keepalive,")
            .nth(1)
            .and_then(|t| t.split("sec").next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("no keep-alive timer on the server's end: {timers:?}"));
        assert!(secs <= 15, "{timers}");
        stop.cancel();
    }

    #[tokio::test]
    async fn sessions_over_the_per_container_cap_are_answered_429() {
        let (server, _backend, stop) = served_with(Limits {
            max_sessions_per_container: 1,
            ..Limits::default()
        })
        .await;
        // A session that runs until its stdin ends.
        let url = server.exec(exec(&["cat"], true)).unwrap();
        let mut first = connect(&url, channel::V5).await.unwrap();
        let url = server.exec(exec(&["echo", "x"], false)).unwrap();
        match connect(&url, channel::V5).await {
            Err(tokio_tungstenite::tungstenite::Error::Http(r)) => {
                assert_eq!(r.status(), 429);
                let body =
                    String::from_utf8_lossy(r.body().as_deref().unwrap_or_default()).into_owned();
                assert!(
                    body.contains("streaming.max_sessions_per_container"),
                    "{body}"
                );
            }
            other => panic!("a second session of c1: {other:?}"),
        }
        let mut other = exec(&["echo", "y"], false);
        other.container_id = "c2".into();
        let msgs = drain(
            &mut connect(&server.exec(other).unwrap(), channel::V5)
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(
            on(&msgs, channel::STDOUT),
            b"y\n",
            "another container is served"
        );
        first
            .send(Message::Binary(channel::frame(
                channel::CLOSE,
                &[channel::STDIN],
            )))
            .await
            .unwrap();
        drain(&mut first).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let url = server.exec(exec(&["echo", "z"], false)).unwrap();
        let msgs = drain(&mut connect(&url, channel::V5).await.unwrap()).await;
        assert_eq!(on(&msgs, channel::STDOUT), b"z\n", "the slot is free again");
        stop.cancel();
    }

    #[tokio::test]
    async fn unused_urls_are_capped() {
        let (server, _backend, stop) = served_with(Limits {
            max_in_flight_urls: 2,
            ..Limits::default()
        })
        .await;
        let first = server.exec(exec(&["echo", "1"], false)).unwrap();
        server.exec(exec(&["echo", "2"], false)).unwrap();
        let e = server.exec(exec(&["echo", "3"], false)).unwrap_err();
        assert!(
            matches!(e, StreamingError::TooManyInFlight { max: 2 }),
            "{e}"
        );
        drain(&mut connect(&first, channel::V5).await.unwrap()).await;
        server.exec(exec(&["echo", "4"], false)).unwrap();
        stop.cancel();
    }

    /// The close frame the server ends with (`None`: no close frame).
    async fn close_frame(ws: &mut Ws) -> Option<CloseFrame> {
        while let Some(Ok(m)) = ws.next().await {
            if let Message::Close(f) = m {
                return f;
            }
        }
        None
    }

    #[tokio::test]
    async fn a_websocket_message_over_the_limit_ends_the_session_with_1009() {
        let (server, backend, stop) = served_with(Limits {
            max_message_size: 64 * 1024,
            ..Limits::default()
        })
        .await;
        let url = server.exec(exec(&["cat"], true)).unwrap();
        let mut ws = connect(&url, channel::V5).await.unwrap();
        let big = vec![b'x'; 128 * 1024];
        let _ = ws
            .send(Message::Binary(channel::frame(channel::STDIN, &big)))
            .await;
        let f = tokio::time::timeout(PATIENCE, close_frame(&mut ws))
            .await
            .expect("the session went on")
            .expect("no close frame");
        assert_eq!(f.code, CloseCode::Size, "{f:?}");
        assert!(f.reason.contains("streaming.max_message_size"), "{f:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            backend.cleaned_up.load(Ordering::SeqCst),
            1,
            "process cleaned up"
        );
        stop.cancel();
    }

    #[tokio::test]
    async fn an_idle_session_is_closed_with_a_reason_and_its_process_killed() {
        let (server, backend, stop) = served_with(Limits {
            stream_idle_timeout: SHORT,
            ..Limits::default()
        })
        .await;
        let url = server.exec(exec(&["cat"], true)).unwrap();
        let mut ws = connect(&url, channel::V5).await.unwrap();
        let f = tokio::time::timeout(PATIENCE, close_frame(&mut ws))
            .await
            .expect("an idle session was kept")
            .expect("no close frame");
        assert_eq!(f.code, CloseCode::Policy, "{f:?}");
        assert!(f.reason.contains("streaming.stream_idle_timeout"), "{f:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(backend.cleaned_up.load(Ordering::SeqCst), 1);
        stop.cancel();
    }

    /// Execs `cmd` with stdin under `limits`, floods its stdin with more
    /// than the queue, the pipe and the socket buffers hold (the sends stop
    /// once the server stops reading, or after half a second), leaves, and
    /// asserts the session's process is cleaned up within [`PATIENCE`].
    async fn flood_leave_and_expect_cleanup(cmd: &str, limits: Limits) {
        let (server, backend, stop) = served_with(limits).await;
        let url = server.exec(exec(&[cmd], true)).unwrap();
        let mut ws = connect(&url, channel::V5).await.unwrap();
        let chunk = channel::frame(channel::STDIN, &vec![b'x'; 32 * 1024]);
        let flood = async {
            loop {
                if ws.send(Message::Binary(chunk.clone())).await.is_err() {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_millis(500), flood).await;
        drop(ws);
        let cleaned = async {
            while backend.cleaned_up.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        assert!(
            tokio::time::timeout(PATIENCE, cleaned).await.is_ok(),
            "the session outlived its client"
        );
        stop.cancel();
    }

    /// The data a departed client sent sits in the socket before its FIN,
    /// and a session blocked on a process that reads nothing cannot see
    /// past it: the idle timeout ends it, with the process stuck in a
    /// stdin write (before the bounds it hung until the process exited).
    #[tokio::test]
    async fn a_flooded_exec_whose_process_reads_nothing_ends_once_idle() {
        let limits = Limits {
            max_queued_bytes: 64 * 1024,
            stream_idle_timeout: Duration::from_secs(1),
            ..Limits::default()
        };
        flood_leave_and_expect_cleanup("sink", limits).await;
    }

    /// As above, but the process keeps printing, so the session never goes
    /// idle: the writer's failed send to the departed client ends it (it
    /// lived until the container stopped, holding its pipes and buffers).
    #[tokio::test]
    async fn a_flooded_exec_that_keeps_printing_ends_when_its_client_leaves() {
        let limits = Limits {
            max_queued_bytes: 64 * 1024,
            ..Limits::default()
        };
        flood_leave_and_expect_cleanup("tick", limits).await;
    }
}
