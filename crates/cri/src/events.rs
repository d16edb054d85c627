//! `GetContainerEvents`: container lifecycle events (created, started,
//! stopped, deleted) on a bounded broadcast channel with any number of
//! subscribers. Sending never waits: a subscriber that falls behind loses
//! the oldest events, counted through [`crate::CriObserver::events_dropped`].

use std::pin::Pin;
use std::sync::Arc;
use std::time::SystemTime;

use cubelet_engine::SandboxId;
use cubelet_store::{ContainerRecord, ContainerState};
use k8s_cri::v1 as cri;
use tokio::sync::broadcast;
use tonic::Status;
use tracing::{debug, warn};

use crate::convert::{self, nanos};
use crate::service::{Cri, CriObserver};

/// Events buffered per subscriber before the oldest are dropped.
pub(crate) const EVENT_BUFFER: usize = 1024;

/// The stream type of `GetContainerEvents`.
pub(crate) type EventStream =
    Pin<Box<dyn futures::Stream<Item = Result<cri::ContainerEventResponse, Status>> + Send>>;

/// The broadcast side of container events.
#[derive(Debug)]
pub(crate) struct EventHub {
    tx: broadcast::Sender<cri::ContainerEventResponse>,
    /// Ends every subscription when the server shuts down, so an open
    /// stream does not hold up the graceful drain.
    closed: tokio_util::sync::CancellationToken,
}

impl Default for EventHub {
    fn default() -> Self {
        Self {
            tx: broadcast::channel(EVENT_BUFFER).0,
            closed: tokio_util::sync::CancellationToken::new(),
        }
    }
}

fn state(s: ContainerState) -> cri::ContainerState {
    match s {
        ContainerState::Created => cri::ContainerState::ContainerCreated,
        ContainerState::Running => cri::ContainerState::ContainerRunning,
        ContainerState::Exited => cri::ContainerState::ContainerExited,
        ContainerState::Unknown => cri::ContainerState::ContainerUnknown,
    }
}

/// A stored container as the (non-verbose) status events carry.
fn status_of(c: &ContainerRecord) -> cri::ContainerStatus {
    let reason = match (c.state, c.exit_code, &c.reason) {
        (_, _, Some(r)) => r.clone(),
        (ContainerState::Exited, Some(0), None) => "Completed".to_owned(),
        (ContainerState::Exited, _, None) => "Error".to_owned(),
        _ => String::new(),
    };
    cri::ContainerStatus {
        id: c.id.clone(),
        metadata: Some(cri::ContainerMetadata {
            name: c.name.clone(),
            attempt: c.attempt,
        }),
        state: state(c.state) as i32,
        created_at: nanos(c.created_at),
        started_at: c.started_at.map_or(0, nanos),
        finished_at: c.finished_at.map_or(0, nanos),
        exit_code: c.exit_code.unwrap_or(0),
        image: Some(cri::ImageSpec {
            image: c.image.clone(),
            ..Default::default()
        }),
        image_ref: c.image_ref.clone(),
        image_id: c.image_ref.clone(),
        reason,
        message: c.message.clone().unwrap_or_default(),
        labels: c
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        annotations: c
            .annotations
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        log_path: c
            .log_path
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        ..Default::default()
    }
}

impl Cri {
    /// Publishes a lifecycle event of `container_id` (a container, or the
    /// sandbox itself) in pod `sandbox_id`, with the pod's current status
    /// and its containers' statuses. Never waits; a no-op without subscribers.
    pub(crate) fn emit(
        &self,
        container_id: &str,
        sandbox_id: &SandboxId,
        kind: cri::ContainerEventType,
    ) {
        let hub = &self.inner.events;
        if hub.tx.receiver_count() == 0 {
            return;
        }
        let store = &self.deps().store;
        let pod_sandbox_status = match store.get_sandbox(sandbox_id) {
            Ok(rec) => rec.as_ref().map(convert::pod_sandbox_status),
            Err(e) => {
                warn!(sandbox_id = %sandbox_id, error = %e, "event: read sandbox");
                None
            }
        };
        let containers_statuses = match store.list_containers_of(sandbox_id) {
            Ok(cs) => cs.iter().map(status_of).collect(),
            Err(e) => {
                warn!(sandbox_id = %sandbox_id, error = %e, "event: read containers");
                Vec::new()
            }
        };
        let event = cri::ContainerEventResponse {
            container_id: container_id.to_owned(),
            container_event_type: kind as i32,
            created_at: nanos(SystemTime::now()),
            pod_sandbox_status,
            containers_statuses,
        };
        debug!(container_id, event = ?kind, "container event");
        // Fails only when every subscriber left in the meantime.
        let _ = hub.tx.send(event);
    }

    /// Ends every `GetContainerEvents` stream (at shutdown).
    pub fn close_events(&self) {
        self.inner.events.closed.cancel();
    }

    /// A new subscription: every event from now on, until the client goes.
    pub(crate) fn container_events(&self) -> EventStream {
        let rx = self.inner.events.tx.subscribe();
        let observer: Arc<dyn CriObserver> = Arc::clone(&self.deps().observer);
        let closed = self.inner.events.closed.clone();
        Box::pin(futures::stream::unfold(
            (rx, observer, closed),
            |(mut rx, observer, closed)| async move {
                loop {
                    let next = tokio::select! {
                        () = closed.cancelled() => return None,
                        next = rx.recv() => next,
                    };
                    match next {
                        Ok(ev) => return Some((Ok(ev), (rx, observer, closed))),
                        Err(broadcast::error::RecvError::Lagged(n)) => {
                            warn!(dropped = n, "container event subscriber too slow");
                            observer.events_dropped(n);
                        }
                        Err(broadcast::error::RecvError::Closed) => return None,
                    }
                }
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lagging_receiver_counts_drops_and_sender_never_blocks() {
        let hub = EventHub::default();
        let mut rx = hub.tx.subscribe();
        for i in 0..(EVENT_BUFFER + 10) {
            hub.tx
                .send(cri::ContainerEventResponse {
                    container_id: i.to_string(),
                    ..Default::default()
                })
                .unwrap();
        }
        match rx.recv().await {
            Err(broadcast::error::RecvError::Lagged(n)) => assert_eq!(n, 10),
            other => panic!("expected lag, got {other:?}"),
        }
        assert_eq!(rx.recv().await.unwrap().container_id, "10");
    }

    #[test]
    fn status_reasons() {
        let mut c = ContainerRecord::new("c1", SandboxId::new_unchecked("s1"), "app", 0, "busybox");
        assert_eq!(
            status_of(&c).state,
            cri::ContainerState::ContainerCreated as i32
        );
        c.state = ContainerState::Exited;
        c.exit_code = Some(0);
        assert_eq!(status_of(&c).reason, "Completed");
        c.exit_code = Some(1);
        assert_eq!(status_of(&c).reason, "Error");
        c.reason = Some("OOMKilled".into());
        assert_eq!(status_of(&c).reason, "OOMKilled");
    }
}
