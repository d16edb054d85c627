//! A minimal ttrpc client: one unary call over a unix socket.
//!
//! containerd's shims serve their task API over ttrpc, not gRPC. The only
//! call the agent makes to a shim directly is `containerd.task.v2.Task/Shutdown`
//! (to stop a shim containerd forgot, see [`crate::reclaim::shims`]), so this is a
//! client for exactly one request and its response, written from the
//! protocol:
//!
//! - every message is a 10-byte header (big-endian `u32` payload length,
//!   `u32` stream id, `u8` type: 1 request, 2 response, `u8` flags) and a
//!   protobuf payload of at most [`MAX_MESSAGE`] bytes;
//! - a client's streams have odd ids; one connection here carries one call,
//!   stream 1;
//! - a request is `Request{service=1, method=2, payload=3, timeout_nano=4,
//!   metadata=5}`, a response `Response{status=1 (google.rpc.Status),
//!   payload=2}`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::error::RuntimeError;

/// The largest message ttrpc accepts (its `messageLengthMax`).
pub const MAX_MESSAGE: usize = 4 << 20;

const HEADER_LEN: usize = 10;
const TYPE_REQUEST: u8 = 1;
const TYPE_RESPONSE: u8 = 2;
const STREAM_ID: u32 = 1;

/// The metadata key under which containerd's ttrpc clients send the
/// namespace.
pub const NAMESPACE_KEY: &str = "containerd-namespace-ttrpc";

/// A ttrpc request.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Request {
    /// Fully qualified service name, e.g. `containerd.task.v2.Task`.
    #[prost(string, tag = "1")]
    pub service: String,
    /// Method name, e.g. `Shutdown`.
    #[prost(string, tag = "2")]
    pub method: String,
    /// The encoded request message.
    #[prost(bytes = "vec", tag = "3")]
    pub payload: Vec<u8>,
    /// The caller's deadline, in nanoseconds from now (0: none).
    #[prost(int64, tag = "4")]
    pub timeout_nano: i64,
    /// Key/value metadata (the namespace among them).
    #[prost(message, repeated, tag = "5")]
    pub metadata: Vec<KeyValue>,
}

/// One metadata entry of a [`Request`].
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    /// Key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// Value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// A ttrpc response.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Response {
    /// The call's status; absent or code 0 is success.
    #[prost(message, optional, tag = "1")]
    pub status: Option<Status>,
    /// The encoded response message.
    #[prost(bytes = "vec", tag = "2")]
    pub payload: Vec<u8>,
}

/// `google.rpc.Status` (its `details` are not read).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Status {
    /// A `google.rpc.Code`; 0 is OK.
    #[prost(int32, tag = "1")]
    pub code: i32,
    /// The server's message.
    #[prost(string, tag = "2")]
    pub message: String,
}

/// `containerd.task.v2.ShutdownRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ShutdownRequest {
    /// The shim's task id.
    #[prost(string, tag = "1")]
    pub id: String,
    /// Shut down even if it still serves containers (the runc shim ignores it).
    #[prost(bool, tag = "2")]
    pub now: bool,
}

/// A ttrpc socket address as containerd writes it: `unix:///path`, a plain
/// path, or an abstract socket (`unix://@name`, `@name`, or a leading NUL).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SocketAddress {
    /// A socket file.
    Path(PathBuf),
    /// A socket in the abstract namespace (the name without its NUL).
    Abstract(String),
}

impl SocketAddress {
    /// Parses an address of a shim's `address` file or its start output.
    pub fn parse(address: &str) -> Option<SocketAddress> {
        let a = address.trim();
        let a = a.strip_prefix("unix://").unwrap_or(a);
        if let Some(name) = a.strip_prefix('@').or_else(|| a.strip_prefix('\0')) {
            return (!name.is_empty()).then(|| SocketAddress::Abstract(name.to_owned()));
        }
        a.starts_with('/')
            .then(|| SocketAddress::Path(PathBuf::from(a)))
    }

    /// For messages.
    pub fn display(&self) -> String {
        match self {
            SocketAddress::Path(p) => p.display().to_string(),
            SocketAddress::Abstract(n) => format!("@{n}"),
        }
    }

    async fn connect(&self) -> std::io::Result<UnixStream> {
        match self {
            SocketAddress::Path(p) => UnixStream::connect(p).await,
            SocketAddress::Abstract(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
                let std = std::os::unix::net::UnixStream::connect_addr(&addr)?;
                std.set_nonblocking(true)?;
                UnixStream::from_std(std)
            }
        }
    }
}

/// Calls `service/method` with `payload` on the ttrpc server at `address`,
/// with `namespace` in the metadata; the response payload. The whole call
/// (connect, write, read) gets `timeout`.
pub async fn call(
    address: &SocketAddress,
    namespace: &str,
    service: &str,
    method: &str,
    payload: Vec<u8>,
    timeout: Duration,
) -> Result<Vec<u8>, RuntimeError> {
    let what = format!("{service}/{method}");
    let request = Request {
        service: service.to_owned(),
        method: method.to_owned(),
        payload,
        timeout_nano: i64::try_from(timeout.as_nanos()).unwrap_or(i64::MAX),
        metadata: vec![KeyValue {
            key: NAMESPACE_KEY.to_owned(),
            value: namespace.to_owned(),
        }],
    };
    match tokio::time::timeout(timeout, exchange(address, &what, request)).await {
        Ok(r) => r,
        Err(_) => Err(RuntimeError::Timeout {
            op: "ttrpc call",
            id: format!("{what} on {}", address.display()),
            timeout,
        }),
    }
}

async fn exchange(
    address: &SocketAddress,
    what: &str,
    request: Request,
) -> Result<Vec<u8>, RuntimeError> {
    let io = |op: &'static str| {
        let path = address.display();
        move |source| RuntimeError::Io { op, path, source }
    };
    let fail = |reason: String| RuntimeError::Ttrpc {
        method: what.to_owned(),
        socket: address.display(),
        reason,
    };
    let mut stream = address.connect().await.map_err(io("connect to ttrpc"))?;
    let body = prost::Message::encode_to_vec(&request);
    if body.len() > MAX_MESSAGE {
        return Err(fail(format!(
            "request of {} bytes is too large",
            body.len()
        )));
    }
    let mut frame = Vec::with_capacity(HEADER_LEN + body.len());
    frame.extend_from_slice(&header(body.len() as u32, STREAM_ID, TYPE_REQUEST));
    frame.extend_from_slice(&body);
    stream
        .write_all(&frame)
        .await
        .map_err(io("write ttrpc request"))?;
    loop {
        let (stream_id, kind, body) = read_message(&mut stream)
            .await
            .map_err(io("read ttrpc response"))?
            .map_err(&fail)?;
        // Only stream 1 is ours; anything else on it is not an answer.
        if stream_id != STREAM_ID {
            continue;
        }
        if kind != TYPE_RESPONSE {
            return Err(fail(format!(
                "message of type {kind} instead of a response"
            )));
        }
        let response: Response = prost::Message::decode(body.as_slice())
            .map_err(|e| fail(format!("undecodable response: {e}")))?;
        return match response.status {
            Some(s) if s.code != 0 => Err(fail(format!("status {}: {}", s.code, s.message))),
            _ => Ok(response.payload),
        };
    }
}

/// The 10-byte header of a message.
pub fn header(length: u32, stream_id: u32, kind: u8) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&length.to_be_bytes());
    h[4..8].copy_from_slice(&stream_id.to_be_bytes());
    h[8] = kind;
    h
}

/// Reads one message: `(stream id, type, payload)`, or why it is not one.
async fn read_message<R: AsyncReadExt + Unpin>(
    r: &mut R,
) -> std::io::Result<Result<(u32, u8, Vec<u8>), String>> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h).await?;
    let length = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
    let stream_id = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
    if length > MAX_MESSAGE {
        return Ok(Err(format!("message of {length} bytes is too large")));
    }
    let mut body = vec![0u8; length];
    r.read_exact(&mut body).await?;
    Ok(Ok((stream_id, h[8], body)))
}

/// Asks the shim at `address` to shut itself down
/// (`containerd.task.v2.Task/Shutdown` for task `id`).
pub async fn shutdown_shim(
    address: &SocketAddress,
    namespace: &str,
    id: &str,
    timeout: Duration,
) -> Result<(), RuntimeError> {
    let payload = prost::Message::encode_to_vec(&ShutdownRequest {
        id: id.to_owned(),
        now: true,
    });
    call(
        address,
        namespace,
        "containerd.task.v2.Task",
        "Shutdown",
        payload,
        timeout,
    )
    .await
    .map(|_| ())
}

/// Whether a socket file exists at `path` that nobody listens on any more
/// (what a shim that exited without removing it leaves).
pub fn is_stale_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    let is_socket = std::fs::symlink_metadata(path)
        .map(|m| m.file_type().is_socket())
        .unwrap_or(false);
    is_socket
        && matches!(
            std::os::unix::net::UnixStream::connect(path),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A ttrpc server for one connection: reads one request, hands it to
    /// `answer`, writes what `answer` returns (frames, raw) back.
    async fn fake_server(
        listener: UnixListener,
        answer: impl FnOnce(u32, u8, Request) -> Vec<u8> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let (stream_id, kind, body) = read_message(&mut conn).await.unwrap().unwrap();
            let request: Request = prost::Message::decode(body.as_slice()).unwrap();
            let reply = answer(stream_id, kind, request);
            conn.write_all(&reply).await.unwrap();
            // Hold the connection open until the client is done with it.
            let mut rest = Vec::new();
            let _ = conn.read_to_end(&mut rest).await;
        })
    }

    fn response_frame(stream_id: u32, response: &Response) -> Vec<u8> {
        let body = prost::Message::encode_to_vec(response);
        let mut f = header(body.len() as u32, stream_id, TYPE_RESPONSE).to_vec();
        f.extend_from_slice(&body);
        f
    }

    /// Calls method `M` of service `svc` with an empty request, as each
    /// test's client.
    async fn call_m(path: PathBuf, timeout: Duration) -> Result<Vec<u8>, RuntimeError> {
        call(
            &SocketAddress::Path(path),
            "ns",
            "svc",
            "M",
            Vec::new(),
            timeout,
        )
        .await
    }

    fn socket() -> (tempfile::TempDir, PathBuf, UnixListener) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shim.sock");
        let listener = UnixListener::bind(&path).unwrap();
        (dir, path, listener)
    }

    #[test]
    fn addresses() {
        assert_eq!(
            SocketAddress::parse("unix:///run/containerd/s/abc\n"),
            Some(SocketAddress::Path("/run/containerd/s/abc".into()))
        );
        assert_eq!(
            SocketAddress::parse("/run/x.sock"),
            Some(SocketAddress::Path("/run/x.sock".into()))
        );
        assert_eq!(
            SocketAddress::parse("unix://@/containerd-shim/k8s/abc/shim.sock"),
            Some(SocketAddress::Abstract(
                "/containerd-shim/k8s/abc/shim.sock".into()
            ))
        );
        assert_eq!(
            SocketAddress::parse("\0x"),
            Some(SocketAddress::Abstract("x".into()))
        );
        assert_eq!(SocketAddress::parse("unix://"), None);
        assert_eq!(SocketAddress::parse("relative/path"), None);
        assert_eq!(SocketAddress::parse("@"), None);
    }

    #[test]
    fn header_layout() {
        assert_eq!(
            header(0x0102_0304, 5, TYPE_REQUEST),
            [1, 2, 3, 4, 0, 0, 0, 5, 1, 0]
        );
    }

    #[tokio::test]
    async fn shutdown_sends_the_task_api_request_and_accepts_ok() {
        let (_dir, path, listener) = socket();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let server = fake_server(listener, move |stream_id, kind, request| {
            let _ = tx.send((stream_id, kind, request));
            response_frame(
                stream_id,
                &Response {
                    status: None,
                    payload: Vec::new(),
                },
            )
        })
        .await;
        let address = SocketAddress::Path(path);
        shutdown_shim(&address, "k8s.test", "abc", Duration::from_secs(30))
            .await
            .unwrap();
        let (stream_id, kind, request) = rx.await.unwrap();
        assert_eq!((stream_id, kind), (1, TYPE_REQUEST));
        assert_eq!(request.service, "containerd.task.v2.Task");
        assert_eq!(request.method, "Shutdown");
        assert!(request.timeout_nano > 0);
        assert_eq!(
            request.metadata,
            vec![KeyValue {
                key: NAMESPACE_KEY.into(),
                value: "k8s.test".into()
            }]
        );
        let sent: ShutdownRequest = prost::Message::decode(request.payload.as_slice()).unwrap();
        assert_eq!(
            sent,
            ShutdownRequest {
                id: "abc".into(),
                now: true
            }
        );
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_response_on_another_stream_is_skipped() {
        let (_dir, path, listener) = socket();
        let server = fake_server(listener, |stream_id, _, _| {
            let mut frames = response_frame(
                stream_id + 2,
                &Response {
                    status: Some(Status {
                        code: 13,
                        message: "not yours".into(),
                    }),
                    payload: Vec::new(),
                },
            );
            frames.extend(response_frame(
                stream_id,
                &Response {
                    status: Some(Status {
                        code: 0,
                        message: String::new(),
                    }),
                    payload: b"ok".to_vec(),
                },
            ));
            frames
        })
        .await;
        let got = call_m(path, Duration::from_secs(30)).await.unwrap();
        assert_eq!(got, b"ok");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn an_error_status_is_an_error_naming_the_method() {
        let (_dir, path, listener) = socket();
        let server = fake_server(listener, |stream_id, _, _| {
            response_frame(
                stream_id,
                &Response {
                    status: Some(Status {
                        code: 5,
                        message: "container not created".into(),
                    }),
                    payload: Vec::new(),
                },
            )
        })
        .await;
        let err = shutdown_shim(
            &SocketAddress::Path(path),
            "ns",
            "abc",
            Duration::from_secs(30),
        )
        .await
        .unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, RuntimeError::Ttrpc { .. }), "{text}");
        assert!(text.contains("containerd.task.v2.Task/Shutdown"), "{text}");
        assert!(text.contains("container not created"), "{text}");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_request_message_back_is_not_an_answer() {
        let (_dir, path, listener) = socket();
        let server = fake_server(listener, |stream_id, _, _| {
            let mut f = header(0, stream_id, TYPE_REQUEST).to_vec();
            f.extend_from_slice(&[]);
            f
        })
        .await;
        let err = call_m(path, Duration::from_secs(30)).await.unwrap_err();
        assert!(matches!(err, RuntimeError::Ttrpc { .. }), "{err}");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn an_oversized_reply_is_refused_without_reading_it() {
        let (_dir, path, listener) = socket();
        let server = fake_server(listener, |stream_id, _, _| {
            header(MAX_MESSAGE as u32 + 1, stream_id, TYPE_RESPONSE).to_vec()
        })
        .await;
        let err = call_m(path, Duration::from_secs(30)).await.unwrap_err();
        assert!(err.to_string().contains("too large"), "{err}");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_server_that_never_answers_times_out() {
        let (_dir, path, listener) = socket();
        // Accepts, reads the request, answers nothing until the client leaves.
        let server = fake_server(listener, |_, _, _| Vec::new()).await;
        let err = call_m(path, Duration::from_millis(200)).await.unwrap_err();
        assert!(matches!(err, RuntimeError::Timeout { .. }), "{err}");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_missing_socket_is_an_io_error_and_not_stale() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gone.sock");
        let err = shutdown_shim(
            &SocketAddress::Path(path.clone()),
            "ns",
            "abc",
            Duration::from_secs(30),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, RuntimeError::Io { .. }), "{err}");
        assert!(!is_stale_socket(&path));
    }

    #[tokio::test]
    async fn a_socket_nobody_listens_on_is_stale() {
        let (_dir, path, listener) = socket();
        assert!(!is_stale_socket(&path), "a listened socket is not stale");
        drop(listener);
        assert!(is_stale_socket(&path));
    }

    #[tokio::test]
    async fn an_abstract_socket_is_reached() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("cubelet-ttrpc-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let std = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        std.set_nonblocking(true).unwrap();
        let listener = UnixListener::from_std(std).unwrap();
        let server = fake_server(listener, |stream_id, _, _| {
            response_frame(
                stream_id,
                &Response {
                    status: None,
                    payload: b"hi".to_vec(),
                },
            )
        })
        .await;
        let got = call(
            &SocketAddress::Abstract(name),
            "ns",
            "svc",
            "M",
            Vec::new(),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        assert_eq!(got, b"hi");
        server.await.unwrap();
    }
}
