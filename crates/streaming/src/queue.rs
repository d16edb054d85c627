//! The queue of client input between a transport's reader and a session
//! core: ordered, bounded in bytes, with terminal resizes coalesced.
//!
//! The reader waits (and so stops reading the client: TCP backpressure)
//! while the queue holds [`Limits::max_queued_bytes`](crate::Limits) or
//! more; a single message larger than that is still let through when the
//! queue is empty, so a message never waits for ever. Each message also
//! counts a fixed overhead, so empty messages cannot pile up either. With
//! coalescing on (exec and attach, not port-forward where channel 4 is a
//! port's data), at most [`MAX_QUEUED_RESIZES`] resizes wait: an older one
//! is dropped for a newer one, since only the last size matters.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::channel::RESIZE;
use crate::session::In;

/// Resizes waiting at most; the oldest is dropped for a new one.
pub(crate) const MAX_QUEUED_RESIZES: usize = 4;
/// What a message costs besides its payload.
const OVERHEAD: usize = 64;

#[derive(Debug, Default)]
struct State {
    items: VecDeque<In>,
    bytes: usize,
    resizes: usize,
    sender_gone: bool,
    receiver_gone: bool,
}

#[derive(Debug)]
struct Shared {
    st: Mutex<State>,
    /// Wakes the receiver (an item or the sender's end).
    to_rx: Notify,
    /// Wakes the sender (room, or the receiver's end).
    to_tx: Notify,
    cap: usize,
    coalesce_resizes: bool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn is_resize(m: &In) -> bool {
    matches!(m, In::Data(RESIZE, _))
}

fn cost(m: &In) -> usize {
    match m {
        In::Data(_, d) => d.len() + OVERHEAD,
        In::End(_) => OVERHEAD,
    }
}

/// The sending half (the transport's reader).
#[derive(Debug)]
pub(crate) struct InTx {
    shared: Arc<Shared>,
}

/// The receiving half (the session core).
#[derive(Debug)]
pub(crate) struct InRx {
    shared: Arc<Shared>,
}

/// The receiver is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Closed;

/// A queue holding at most about `cap` bytes.
pub(crate) fn in_queue(cap: usize, coalesce_resizes: bool) -> (InTx, InRx) {
    let shared = Arc::new(Shared {
        st: Mutex::default(),
        to_rx: Notify::new(),
        to_tx: Notify::new(),
        cap: cap.max(1),
        coalesce_resizes,
    });
    (
        InTx {
            shared: Arc::clone(&shared),
        },
        InRx { shared },
    )
}

impl InTx {
    /// Queues `m`, waiting for room first.
    pub(crate) async fn send(&self, m: In) -> Result<(), Closed> {
        let sh = &*self.shared;
        if sh.coalesce_resizes && is_resize(&m) {
            let mut st = sh.lock();
            if st.receiver_gone {
                return Err(Closed);
            }
            if st.resizes >= MAX_QUEUED_RESIZES {
                if let Some(i) = st.items.iter().position(is_resize) {
                    if let Some(old) = st.items.remove(i) {
                        st.bytes -= cost(&old);
                        st.resizes -= 1;
                    }
                }
            }
            st.bytes += cost(&m);
            st.resizes += 1;
            st.items.push_back(m);
            drop(st);
            sh.to_rx.notify_one();
            return Ok(());
        }
        let c = cost(&m);
        loop {
            let room = sh.to_tx.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            {
                let mut st = sh.lock();
                if st.receiver_gone {
                    return Err(Closed);
                }
                if st.bytes == 0 || st.bytes + c <= sh.cap {
                    st.bytes += c;
                    st.items.push_back(m);
                    drop(st);
                    sh.to_rx.notify_one();
                    return Ok(());
                }
            }
            room.await;
        }
    }
}

impl Drop for InTx {
    fn drop(&mut self) {
        self.shared.lock().sender_gone = true;
        self.shared.to_rx.notify_waiters();
        self.shared.to_rx.notify_one();
    }
}

impl InRx {
    /// The next message; `None` once the queue is empty and the sender gone.
    pub(crate) async fn recv(&mut self) -> Option<In> {
        let sh = &*self.shared;
        loop {
            let more = sh.to_rx.notified();
            tokio::pin!(more);
            more.as_mut().enable();
            {
                let mut st = sh.lock();
                if let Some(m) = st.items.pop_front() {
                    st.bytes -= cost(&m);
                    if sh.coalesce_resizes && is_resize(&m) {
                        st.resizes -= 1;
                    }
                    drop(st);
                    sh.to_tx.notify_waiters();
                    return Some(m);
                }
                if st.sender_gone {
                    return None;
                }
            }
            more.await;
        }
    }

    /// Resolves once the sender is gone (the client left, or its session
    /// was ended), whatever is still queued.
    pub(crate) async fn closed(&self) {
        let sh = &*self.shared;
        loop {
            let more = sh.to_rx.notified();
            tokio::pin!(more);
            more.as_mut().enable();
            if sh.lock().sender_gone {
                return;
            }
            more.await;
        }
    }

    /// Bytes queued (payload and overhead).
    #[cfg(test)]
    pub(crate) fn queued_bytes(&self) -> usize {
        self.shared.lock().bytes
    }
}

impl Drop for InRx {
    fn drop(&mut self) {
        self.shared.lock().receiver_gone = true;
        self.shared.to_tx.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::STDIN;
    use bytes::Bytes;
    use std::time::Duration;

    fn data(n: usize) -> In {
        In::Data(STDIN, Bytes::from(vec![b'x'; n]))
    }

    #[tokio::test]
    async fn a_full_queue_makes_the_sender_wait() {
        let (tx, mut rx) = in_queue(4096, true);
        tx.send(data(2000)).await.unwrap();
        tx.send(data(1900)).await.unwrap();
        let third = tokio::time::timeout(Duration::from_millis(200), tx.send(data(1000))).await;
        assert!(third.is_err(), "a third message was queued past the cap");
        assert!(rx.queued_bytes() <= 4096, "{}", rx.queued_bytes());
        assert!(matches!(rx.recv().await, Some(In::Data(STDIN, d)) if d.len() == 2000));
        tx.send(data(1000)).await.unwrap();
        drop(tx);
        assert!(matches!(rx.recv().await, Some(In::Data(_, d)) if d.len() == 1900));
        assert!(matches!(rx.recv().await, Some(In::Data(_, d)) if d.len() == 1000));
        assert!(rx.recv().await.is_none());
    }

    #[tokio::test]
    async fn one_oversized_message_passes_an_empty_queue() {
        let (tx, mut rx) = in_queue(100, false);
        tx.send(data(1000)).await.unwrap();
        assert!(matches!(rx.recv().await, Some(In::Data(_, d)) if d.len() == 1000));
    }

    #[tokio::test]
    async fn resizes_are_coalesced_keeping_the_newest_and_the_order() {
        let (tx, mut rx) = in_queue(1 << 20, true);
        tx.send(data(1)).await.unwrap();
        for w in 0..100u16 {
            let obj = format!(r#"{{"Width":{w},"Height":1}}"#);
            tx.send(In::Data(RESIZE, Bytes::from(obj))).await.unwrap();
        }
        tx.send(In::End(STDIN)).await.unwrap();
        drop(tx);
        let mut got = Vec::new();
        while let Some(m) = rx.recv().await {
            got.push(m);
        }
        assert_eq!(got.len(), 2 + MAX_QUEUED_RESIZES, "{got:?}");
        assert!(matches!(got[0], In::Data(STDIN, _)));
        let last = &got[MAX_QUEUED_RESIZES];
        assert!(
            matches!(last, In::Data(RESIZE, d) if &d[..] == br#"{"Width":99,"Height":1}"#),
            "{last:?}"
        );
        assert!(matches!(got[MAX_QUEUED_RESIZES + 1], In::End(STDIN)));
    }

    #[tokio::test]
    async fn without_coalescing_channel_four_is_data() {
        let (tx, mut rx) = in_queue(1 << 20, false);
        for _ in 0..10 {
            tx.send(In::Data(RESIZE, Bytes::from_static(b"port data")))
                .await
                .unwrap();
        }
        drop(tx);
        let mut n = 0;
        while rx.recv().await.is_some() {
            n += 1;
        }
        assert_eq!(n, 10);
    }

    #[tokio::test]
    async fn closed_resolves_when_the_sender_goes_and_sends_fail_without_receiver() {
        let (tx, rx) = in_queue(10, false);
        tx.send(data(50)).await.unwrap();
        let waiting = tokio::spawn(async move {
            rx.closed().await;
            rx
        });
        drop(tx);
        let rx = waiting.await.unwrap();
        let (tx2, rx2) = in_queue(10, false);
        drop(rx2);
        assert_eq!(tx2.send(data(1)).await, Err(Closed));
        drop(rx);
    }
}
