//! Client deadlines answered with `DEADLINE_EXCEEDED`.
//!
//! A gRPC client sends its deadline as the `grpc-timeout` header. tonic's
//! server enforces it, but answers an expired call with `CANCELLED`
//! ("Timeout expired"), while CRI clients expect `DEADLINE_EXCEEDED`
//! (critest's "public image should timeout if requested"; kubelet maps it to
//! a probe timeout). [`DeadlineLayer`] sits inside tonic's timeout and applies
//! the same deadline, fixed when the call is made: tonic makes its own timer
//! only after the inner `call` returns, so ours is never later, and tonic
//! polls the inner call before its timer, so this answer wins even when both
//! fire on the same tick. (A deadline fixed at the first poll instead could
//! fall one timer tick after tonic's on a slow machine, and the client got
//! `CANCELLED`.)

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::Status;

/// Wraps the CRI services with [`Deadline`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DeadlineLayer;

impl<S> tower::Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline { inner }
    }
}

/// Answers a call still running at its client's deadline with
/// `DEADLINE_EXCEEDED`; the call's future is dropped, as tonic would.
#[derive(Debug, Clone)]
pub(crate) struct Deadline<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for Deadline<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let timeout = grpc_timeout(req.headers());
        // Fixed now, before tonic starts its own timer (see the module docs).
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        let method = req.uri().path().to_owned();
        let call = self.inner.call(req);
        Box::pin(async move {
            let (Some(timeout), Some(deadline)) = (timeout, deadline) else {
                return call.await;
            };
            match tokio::time::timeout_at(deadline, call).await {
                Ok(response) => response,
                Err(_) => {
                    tracing::debug!(method, ?timeout, "client deadline passed");
                    Ok(Status::deadline_exceeded(format!(
                        "{method}: the client's deadline ({timeout:?}) passed"
                    ))
                    .into_http())
                }
            }
        })
    }
}

/// The `grpc-timeout` header: an integer of at most 8 digits and a unit
/// (`H`, `M`, `S`, `m`, `u`, `n`).
fn grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    let v = headers.get("grpc-timeout")?.to_str().ok()?;
    let split = v.len().checked_sub(1)?;
    let (digits, unit) = (v.get(..split)?, v.get(split..)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer, Service, ServiceExt};

    fn headers(timeout: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert("grpc-timeout", timeout.parse().unwrap());
        h
    }

    #[test]
    fn grpc_timeout_units() {
        assert_eq!(
            grpc_timeout(&headers("1999m")),
            Some(Duration::from_millis(1999))
        );
        assert_eq!(grpc_timeout(&headers("2S")), Some(Duration::from_secs(2)));
        assert_eq!(
            grpc_timeout(&headers("1H")),
            Some(Duration::from_secs(3600))
        );
        assert_eq!(grpc_timeout(&headers("5u")), Some(Duration::from_micros(5)));
        assert_eq!(grpc_timeout(&headers("S")), None);
        assert_eq!(grpc_timeout(&headers("123456789S")), None);
        assert_eq!(grpc_timeout(&headers("10x")), None);
        assert_eq!(grpc_timeout(&http::HeaderMap::new()), None);
    }

    fn request(timeout: Option<&str>) -> http::Request<()> {
        let mut b = http::Request::builder().uri("/runtime.v1.ImageService/PullImage");
        if let Some(t) = timeout {
            b = b.header("grpc-timeout", t);
        }
        b.body(()).unwrap()
    }

    fn grpc_status(r: &http::Response<tonic::body::Body>) -> Option<String> {
        r.headers()
            .get("grpc-status")
            .map(|v| v.to_str().unwrap().to_owned())
    }

    #[tokio::test]
    async fn a_call_past_its_deadline_is_deadline_exceeded() {
        let slow = tower::service_fn(|_req: http::Request<()>| async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok::<_, std::convert::Infallible>(http::Response::new(tonic::body::Body::empty()))
        });
        let mut svc = DeadlineLayer.layer(slow);
        let started = std::time::Instant::now();
        let r = svc
            .ready()
            .await
            .unwrap()
            .call(request(Some("50m")))
            .await
            .unwrap();
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(
            grpc_status(&r).as_deref(),
            Some((tonic::Code::DeadlineExceeded as i32).to_string().as_str())
        );
    }

    /// The deadline runs from the call, not from the first poll: a future
    /// first polled after its deadline answers at once (tonic's timer, made
    /// between the two, would otherwise fire first).
    #[tokio::test(start_paused = true)]
    async fn the_deadline_is_fixed_when_the_call_is_made() {
        let never = tower::service_fn(|_req: http::Request<()>| {
            std::future::pending::<
                Result<http::Response<tonic::body::Body>, std::convert::Infallible>,
            >()
        });
        let mut svc = DeadlineLayer.layer(never);
        let call = svc.ready().await.unwrap().call(request(Some("500m")));
        tokio::time::advance(Duration::from_millis(500)).await;
        let mut call = std::pin::pin!(call);
        let polled = futures::poll!(call.as_mut());
        let Poll::Ready(Ok(r)) = polled else {
            panic!("a call polled first after its deadline is still pending");
        };
        assert_eq!(
            grpc_status(&r).as_deref(),
            Some((tonic::Code::DeadlineExceeded as i32).to_string().as_str())
        );
    }

    #[tokio::test]
    async fn calls_in_time_or_without_a_deadline_pass_through() {
        let fast = tower::service_fn(|_req: http::Request<()>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(tonic::body::Body::empty()))
        });
        let mut svc = DeadlineLayer.layer(fast);
        for t in [Some("1S"), None] {
            let r = svc.ready().await.unwrap().call(request(t)).await.unwrap();
            assert_eq!(grpc_status(&r), None);
        }
    }
}
