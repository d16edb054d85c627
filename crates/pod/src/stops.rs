//! Graceful stops in flight, so that a later, shorter stop is not queued
//! behind a longer one.
//!
//! A StopContainer holds the container's lock while it waits out its
//! timeout. Kubelet may stop a container with a long grace period and then,
//! when it gives up on the pod (a deletion with a shorter grace, a
//! StopPodSandbox, a RemoveContainer), stop it again with a shorter one.
//! containerd's CRI lets that second stop kill at its own deadline; here it
//! brings the kill of the stop in flight forward ([`Stops::hasten`]) before
//! it waits for the lock.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::watch;
use tokio::time::Instant;

/// The kill deadlines of the graceful stops in flight, by container id.
#[derive(Debug, Default)]
pub(crate) struct Stops {
    inflight: Mutex<HashMap<String, watch::Sender<Instant>>>,
}

impl Stops {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<Instant>>> {
        self.inflight.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Brings the kill of `id`'s graceful stop in flight forward to
    /// `deadline` when that is earlier. Returns whether one was in flight.
    pub(crate) fn hasten(&self, id: &str, deadline: Instant) -> bool {
        let map = self.map();
        let Some(tx) = map.get(id) else {
            return false;
        };
        tx.send_if_modified(|kill_at| {
            let earlier = deadline < *kill_at;
            if earlier {
                *kill_at = deadline;
            }
            earlier
        });
        true
    }

    /// Registers a graceful stop of `id` that kills at `deadline`. The
    /// receiver sees every earlier deadline a later stop asks for; dropping
    /// the guard unregisters the stop.
    pub(crate) fn begin<'a>(
        &'a self,
        id: &str,
        deadline: Instant,
    ) -> (StopGuard<'a>, watch::Receiver<Instant>) {
        let (tx, rx) = watch::channel(deadline);
        self.map().insert(id.to_owned(), tx);
        (
            StopGuard {
                stops: self,
                id: id.to_owned(),
            },
            rx,
        )
    }
}

/// Unregisters a graceful stop when dropped.
#[derive(Debug)]
pub(crate) struct StopGuard<'a> {
    stops: &'a Stops,
    id: String,
}

impl Drop for StopGuard<'_> {
    fn drop(&mut self) {
        self.stops.map().remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn only_an_earlier_deadline_reaches_the_stop_in_flight() {
        let stops = Stops::default();
        let now = Instant::now();
        assert!(!stops.hasten("c1", now), "no stop in flight");
        let (guard, mut rx) = stops.begin("c1", now + Duration::from_secs(500));
        assert!(stops.hasten("c1", now + Duration::from_secs(600)));
        assert!(
            !rx.has_changed().unwrap(),
            "a later deadline changes nothing"
        );
        assert!(stops.hasten("c1", now + Duration::from_secs(2)));
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), now + Duration::from_secs(2));
        assert!(!stops.hasten("c2", now), "another container's stop");
        drop(guard);
        assert!(!stops.hasten("c1", now), "unregistered with its guard");
    }
}
