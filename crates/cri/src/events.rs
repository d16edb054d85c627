//! `GetContainerEvents`: the pod service's lifecycle events (created,
//! started, stopped, deleted) as CRI events, to any number of subscribers.
//! The service never waits for a subscriber: one that falls behind loses
//! the oldest events, counted through [`crate::CriObserver::events_dropped`].

use std::pin::Pin;
use std::sync::Arc;

use cubelet_cri_api::v1 as cri;
use cubelet_pod::{PodEvent, PodEventKind};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tracing::warn;

use crate::convert::{self, nanos};
use crate::service::{Cri, CriObserver};

/// The stream type of `GetContainerEvents`.
pub(crate) type EventStream =
    Pin<Box<dyn futures::Stream<Item = Result<cri::ContainerEventResponse, Status>> + Send>>;

/// A lifecycle event in CRI terms.
fn to_cri(e: &PodEvent) -> cri::ContainerEventResponse {
    let kind = match e.kind {
        PodEventKind::Created => cri::ContainerEventType::ContainerCreatedEvent,
        PodEventKind::Started => cri::ContainerEventType::ContainerStartedEvent,
        PodEventKind::Stopped => cri::ContainerEventType::ContainerStoppedEvent,
        PodEventKind::Deleted => cri::ContainerEventType::ContainerDeletedEvent,
    };
    cri::ContainerEventResponse {
        container_id: e.container_id.clone(),
        container_event_type: kind as i32,
        created_at: nanos(e.at),
        pod_sandbox_status: e.sandbox.as_deref().map(convert::pod_sandbox_status),
        containers_statuses: e.containers.iter().map(convert::container_status).collect(),
    }
}

/// Streams `rx` as CRI events until the client goes or `closed` is cancelled.
pub(crate) fn stream(
    rx: broadcast::Receiver<PodEvent>,
    observer: Arc<dyn CriObserver>,
    closed: CancellationToken,
) -> EventStream {
    Box::pin(futures::stream::unfold(
        (rx, observer, closed),
        |(mut rx, observer, closed)| async move {
            loop {
                let next = tokio::select! {
                    () = closed.cancelled() => return None,
                    next = rx.recv() => next,
                };
                match next {
                    Ok(ev) => return Some((Ok(to_cri(&ev)), (rx, observer, closed))),
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

impl Cri {
    /// Ends every `GetContainerEvents` stream (at shutdown), so an open
    /// stream does not hold up the graceful drain.
    pub fn close_events(&self) {
        self.inner.events_closed.cancel();
    }

    /// A new subscription: every event from now on, until the client goes.
    pub(crate) fn container_events(&self) -> EventStream {
        stream(
            self.pods().subscribe(),
            Arc::clone(&self.deps().observer),
            self.inner.events_closed.clone(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::NoopCriObserver;
    use cubelet_engine::SandboxId;
    use futures::StreamExt;

    #[derive(Default)]
    struct Drops(std::sync::atomic::AtomicU64);

    impl CriObserver for Drops {
        fn request(&self, _m: &'static str, _c: tonic::Code, _e: std::time::Duration) {}
        fn events_dropped(&self, n: u64) {
            self.0.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn event(id: &str) -> PodEvent {
        PodEvent {
            container_id: id.to_owned(),
            sandbox_id: SandboxId::new_unchecked("s1"),
            kind: PodEventKind::Started,
            at: std::time::SystemTime::now(),
            sandbox: None,
            containers: Vec::new().into(),
        }
    }

    #[tokio::test]
    async fn a_lagging_subscriber_counts_its_drops_and_keeps_going() {
        let (tx, rx) = broadcast::channel(cubelet_pod::EVENT_BUFFER);
        let drops = Arc::new(Drops::default());
        let mut s = stream(rx, drops.clone(), CancellationToken::new());
        for i in 0..(cubelet_pod::EVENT_BUFFER + 10) {
            tx.send(event(&i.to_string())).unwrap();
        }
        let first = s.next().await.unwrap().unwrap();
        assert_eq!(first.container_id, "10");
        assert_eq!(
            first.container_event_type,
            cri::ContainerEventType::ContainerStartedEvent as i32
        );
        assert_eq!(drops.0.load(std::sync::atomic::Ordering::Relaxed), 10);
    }

    #[tokio::test]
    async fn closing_ends_the_stream() {
        let (_tx, rx) = broadcast::channel(4);
        let closed = CancellationToken::new();
        let mut s = stream(rx, Arc::new(NoopCriObserver), closed.clone());
        closed.cancel();
        assert!(s.next().await.is_none());
    }
}
