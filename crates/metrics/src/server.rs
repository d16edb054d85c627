//! The admin HTTP server: `/metrics`, `/healthz` and `/readyz` on hyper 1.

use std::convert::Infallible;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE, RETRY_AFTER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::{Encoder, Registry, TextEncoder};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, info_span, warn, Instrument};

use crate::error::MetricsError;
use crate::readiness::Readiness;

/// `Content-Type` of `/metrics`: Prometheus text exposition format 0.0.4.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

const TEXT_CONTENT_TYPE: &str = "text/plain; charset=utf-8";

/// How long a client may take to send a request's headers. Bounds how long
/// a silent connection can hold up a graceful shutdown.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Most connections served at once. Prometheus, probes and an operator's
/// curl need a handful; a flood (the address may be the node's, reachable
/// from every pod, when it is scraped from off the node) is refused rather
/// than let grow the agent's descriptors and memory.
pub const MAX_CONNECTIONS: usize = 128;

/// What a connection over [`MAX_CONNECTIONS`] is told before it is closed.
const TOO_MANY_CONNECTIONS: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
Content-Type: text/plain; charset=utf-8\r\n\
Retry-After: 1\r\n\
Connection: close\r\n\
Content-Length: 45\r\n\
\r\n\
too many admin connections: try again later\r\n";

/// Pause after a failed `accept` (e.g. out of file descriptors) so the loop
/// does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The admin HTTP server, bound but not yet serving.
///
/// Routes (GET or HEAD; other methods get 405, unknown paths 404):
/// - `/metrics`: the registry in the Prometheus text format 0.0.4,
/// - `/healthz`: 200 `ok` while the process serves at all,
/// - `/readyz`: 200 `ready`, or 503 with the reason from [`Readiness`].
pub struct AdminServer {
    listener: std::net::TcpListener,
    local_addr: SocketAddr,
    shared: Arc<Shared>,
}

struct Shared {
    registry: Registry,
    readiness: Readiness,
    renders: std::sync::Mutex<RenderBucket>,
}

/// Most `/metrics` renders a second, after a burst of as many. A render
/// gathers and encodes every series (about 0.25 ms of CPU); a client asking
/// as fast as it can got over a core of the agent. Prometheus asks once per
/// scrape interval (seconds); a request past the rate is answered
/// `429 Too Many Requests` at the cost of a `/healthz`.
pub const MAX_RENDERS_PER_SECOND: f64 = 10.0;

/// A token bucket of [`MAX_RENDERS_PER_SECOND`].
#[derive(Debug)]
struct RenderBucket {
    tokens: f64,
    at: std::time::Instant,
}

impl RenderBucket {
    fn new() -> Self {
        Self {
            tokens: MAX_RENDERS_PER_SECOND,
            at: std::time::Instant::now(),
        }
    }

    /// Takes a render's token, if one has accrued.
    fn take(&mut self) -> bool {
        let now = std::time::Instant::now();
        let accrued = now.duration_since(self.at).as_secs_f64() * MAX_RENDERS_PER_SECOND;
        self.tokens = (self.tokens + accrued).min(MAX_RENDERS_PER_SECOND);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

impl fmt::Debug for AdminServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminServer")
            .field("local_addr", &self.local_addr)
            .field("readiness", &self.shared.readiness)
            .finish_non_exhaustive()
    }
}

impl AdminServer {
    /// Binds `addr` now, so that a bad address fails at startup and the real
    /// port of `:0` is known from [`AdminServer::local_addr`] before serving.
    /// Needs no async runtime; [`AdminServer::serve`] does.
    pub fn bind(
        addr: SocketAddr,
        registry: Registry,
        readiness: Readiness,
    ) -> Result<AdminServer, MetricsError> {
        let listener = std::net::TcpListener::bind(addr)
            .map_err(|source| MetricsError::Bind { addr, source })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| MetricsError::Bind { addr, source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| MetricsError::LocalAddr { addr, source })?;
        Ok(AdminServer {
            listener,
            local_addr,
            shared: Arc::new(Shared {
                registry,
                readiness,
                renders: std::sync::Mutex::new(RenderBucket::new()),
            }),
        })
    }

    /// The address actually bound (with the kernel's port when asked for 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until `shutdown` is cancelled, then stops accepting, lets the
    /// requests in flight finish (idle keep-alive connections are closed)
    /// and returns once every connection is done. Must run inside a tokio
    /// runtime. A caller wanting a hard deadline on the drain wraps this in
    /// `tokio::time::timeout`.
    pub fn serve(
        self,
        shutdown: CancellationToken,
    ) -> impl std::future::Future<Output = Result<(), MetricsError>> + Send + 'static {
        let AdminServer {
            listener,
            local_addr,
            shared,
        } = self;
        async move {
            let listener =
                TcpListener::from_std(listener).map_err(|source| MetricsError::Listen {
                    addr: local_addr,
                    source,
                })?;
            info!(address = %local_addr, "admin server listening");
            let connections = TaskTracker::new();
            loop {
                let accepted = tokio::select! {
                    biased;
                    () = shutdown.cancelled() => break,
                    accepted = listener.accept() => accepted,
                };
                match accepted {
                    Ok((stream, peer)) if connections.len() >= MAX_CONNECTIONS => {
                        // One non-blocking write and the socket is closed:
                        // a refused client costs no task and no buffer.
                        let _ = stream.try_write(TOO_MANY_CONNECTIONS);
                        debug!(%peer, max = MAX_CONNECTIONS, "admin connection refused: too many");
                    }
                    Ok((stream, peer)) => {
                        let span = info_span!("admin_connection", peer = %peer);
                        connections.spawn(
                            serve_connection(stream, Arc::clone(&shared), shutdown.clone())
                                .instrument(span),
                        );
                    }
                    Err(error) => {
                        // Per-connection errors (reset before accept) and
                        // resource exhaustion are both transient here.
                        warn!(%error, "admin server accept failed");
                        tokio::select! {
                            () = shutdown.cancelled() => break,
                            () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                        }
                    }
                }
            }
            drop(listener);
            connections.close();
            debug!(
                open = connections.len(),
                "admin server draining connections"
            );
            connections.wait().await;
            info!(address = %local_addr, "admin server stopped");
            Ok(())
        }
    }
}

async fn serve_connection(stream: TcpStream, shared: Arc<Shared>, shutdown: CancellationToken) {
    let service = service_fn(move |req: Request<Incoming>| {
        let response = route(&shared, &req);
        async move { Ok::<_, Infallible>(response) }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(error) = result {
        debug!(%error, "admin connection ended with an error");
    }
}

#[derive(Debug, Clone, Copy)]
enum Route {
    Metrics,
    Healthz,
    Readyz,
}

fn route(shared: &Shared, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let route = match req.uri().path() {
        "/metrics" => Route::Metrics,
        "/healthz" => Route::Healthz,
        "/readyz" => Route::Readyz,
        _ => return text(StatusCode::NOT_FOUND, "not found"),
    };
    // HEAD is answered like GET; hyper sends the headers only.
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    match route {
        Route::Metrics => {
            let allowed = shared
                .renders
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if allowed {
                metrics(&shared.registry)
            } else {
                let mut response = text(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too many /metrics requests: at most 10 a second\n",
                );
                response
                    .headers_mut()
                    .insert(RETRY_AFTER, HeaderValue::from_static("1"));
                response
            }
        }
        Route::Healthz => text(StatusCode::OK, "ok"),
        Route::Readyz => match shared.readiness.reason() {
            None => text(StatusCode::OK, "ready"),
            Some(reason) => text(StatusCode::SERVICE_UNAVAILABLE, reason),
        },
    }
}

fn metrics(registry: &Registry) -> Response<Full<Bytes>> {
    let families = registry.gather();
    let mut body = Vec::with_capacity(16 * 1024);
    if let Err(error) = TextEncoder::new().encode(&families, &mut body) {
        warn!(%error, "cannot encode metrics");
        return text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {error}"),
        );
    }
    let mut response = Response::new(Full::new(Bytes::from(body)));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(METRICS_CONTENT_TYPE));
    response
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(TEXT_CONTENT_TYPE));
    response
}
