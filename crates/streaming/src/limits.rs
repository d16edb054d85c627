//! The bounds of the streaming server: what a client may hold (connections,
//! sessions, unused URLs), how long it may stay silent, and how much it may
//! make the server buffer. Each is a key of `streaming:` in the agent's
//! configuration (`docs/security-streaming.md`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// Default [`Limits::header_read_timeout`].
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`Limits::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 2048;
/// Default [`Limits::max_sessions_per_container`].
pub const DEFAULT_MAX_SESSIONS_PER_CONTAINER: usize = 64;
/// Default [`Limits::stream_idle_timeout`] (kubelet's streaming server: 4 h).
pub const DEFAULT_STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(4 * 3600);
/// Default [`Limits::max_in_flight_urls`] (kubelet's `maxInFlight`).
pub const DEFAULT_MAX_IN_FLIGHT_URLS: usize = 1000;
/// Default [`Limits::max_message_size`].
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 1 << 20;
/// Default [`Limits::max_queued_bytes`].
pub const DEFAULT_MAX_QUEUED_BYTES: usize = 1 << 20;

/// How much a client may hold and make the server buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// How long a connection may take to send a complete request head
    /// (also between requests of a kept-alive connection); then it is
    /// closed (HTTP 408 when hyper can still answer).
    pub header_read_timeout: Duration,
    /// Connections open at once, upgraded sessions included; the next one
    /// is answered `503 Service Unavailable` and closed.
    pub max_connections: usize,
    /// Sessions (exec, attach, port-forward) running at once on one
    /// container (port-forward: on one pod sandbox); the next URL used is
    /// answered `429 Too Many Requests`.
    pub max_sessions_per_container: usize,
    /// A session with no byte in either direction for this long is ended
    /// (the exec process is killed, as when the client leaves).
    pub stream_idle_timeout: Duration,
    /// URLs handed out and not used yet; the next `Exec`/`Attach`/
    /// `PortForward` call fails with `ResourceExhausted`.
    pub max_in_flight_urls: usize,
    /// Largest WebSocket message or frame and largest SPDY frame a client
    /// may send; a larger one ends the session (WebSocket close 1009, SPDY
    /// GOAWAY with a protocol error).
    pub max_message_size: usize,
    /// Bytes of client input one stream may have queued for a process (or a
    /// port) that does not read them; the client is then not read from
    /// until it drains (TCP backpressure). SPDY: also the data a client may
    /// send before it has opened all the streams of its session.
    pub max_queued_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_sessions_per_container: DEFAULT_MAX_SESSIONS_PER_CONTAINER,
            stream_idle_timeout: DEFAULT_STREAM_IDLE_TIMEOUT,
            max_in_flight_urls: DEFAULT_MAX_IN_FLIGHT_URLS,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            max_queued_bytes: DEFAULT_MAX_QUEUED_BYTES,
        }
    }
}

/// When a session last moved a byte, and whether it has been silent for
/// its idle timeout. Cheap to clone: every clone shares the clock.
#[derive(Debug, Clone)]
pub(crate) struct Idle {
    inner: Arc<IdleInner>,
}

#[derive(Debug)]
struct IdleInner {
    start: Instant,
    /// Milliseconds after `start` of the last activity.
    last: AtomicU64,
    timeout: Duration,
}

impl Idle {
    /// A clock that starts now.
    pub(crate) fn new(timeout: Duration) -> Self {
        Self {
            inner: Arc::new(IdleInner {
                start: Instant::now(),
                last: AtomicU64::new(0),
                timeout,
            }),
        }
    }

    /// The session moved a byte now.
    pub(crate) fn touch(&self) {
        let ms = u64::try_from(self.inner.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.inner.last.fetch_max(ms, Ordering::Relaxed);
    }

    /// The idle timeout, for messages.
    pub(crate) fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Resolves once the session has been silent for the idle timeout.
    pub(crate) async fn expired(&self) {
        loop {
            let last = Duration::from_millis(self.inner.last.load(Ordering::Relaxed));
            let deadline = self.inner.start + last + self.inner.timeout;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    }
}

/// Sessions running per container (or sandbox), capped.
#[derive(Debug)]
pub(crate) struct SessionSlots {
    max: usize,
    running: Mutex<HashMap<String, usize>>,
}

/// One running session of a container; its slot is freed when dropped.
#[derive(Debug)]
pub(crate) struct SessionSlot {
    slots: Arc<SessionSlots>,
    key: String,
}

impl SessionSlots {
    /// At most `max` sessions per key.
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            running: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for a session of `key`; `None` when `key` has `max` already.
    pub(crate) fn try_acquire(self: &Arc<Self>, key: &str) -> Option<SessionSlot> {
        let mut running = self.lock();
        let n = running.entry(key.to_owned()).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(SessionSlot {
            slots: Arc::clone(self),
            key: key.to_owned(),
        })
    }

    /// Sessions running on `key`.
    #[cfg(test)]
    pub(crate) fn running(&self, key: &str) -> usize {
        self.lock().get(key).copied().unwrap_or(0)
    }
}

impl Drop for SessionSlot {
    fn drop(&mut self) {
        let mut running = self.slots.lock();
        if let Some(n) = running.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                running.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_slots_cap_each_container_and_free_on_drop() {
        let slots = SessionSlots::new(2);
        let a = slots.try_acquire("c1").unwrap();
        let _b = slots.try_acquire("c1").unwrap();
        assert!(slots.try_acquire("c1").is_none(), "a third session of c1");
        let _other = slots.try_acquire("c2").unwrap();
        drop(a);
        assert_eq!(slots.running("c1"), 1);
        assert!(slots.try_acquire("c1").is_some());
    }

    #[tokio::test]
    async fn idle_expires_only_after_silence() {
        let idle = Idle::new(Duration::from_millis(300));
        let t0 = Instant::now();
        let toucher = idle.clone();
        let touching = tokio::spawn(async move {
            for _ in 0..4 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                toucher.touch();
            }
        });
        idle.expired().await;
        touching.await.unwrap();
        assert!(
            t0.elapsed() >= Duration::from_millis(700),
            "expired {:?} after start, while still touched",
            t0.elapsed()
        );
    }
}
