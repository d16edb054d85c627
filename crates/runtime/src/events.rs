//! Container exit and OOM events from containerd, as runtime-neutral
//! [`ContainerEvent`]s on a broadcast channel.
//!
//! [`EventMonitor::spawn`] subscribes to containerd's event stream filtered
//! to `/tasks/exit` and `/tasks/oom` in Cubelet's namespace, and resubscribes
//! with exponential backoff whenever the stream ends or fails. Events sent
//! while no subscription stood are lost: after every resubscription the
//! monitor sends [`ContainerEventKind::Reconnected`], on which a receiver
//! compares what runs with what it recorded (the pod service's
//! `resync_exits`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::events::{TaskExit, TaskOom};
use containerd_client::services::v1::SubscribeRequest;
use futures::StreamExt;
use prost::Message;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::client::Containerd;

/// What happened to a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContainerEventKind {
    /// A process exited. `exec_id` is empty for the container's init process.
    Exited {
        /// Exit code.
        code: u32,
        /// When.
        at: Option<SystemTime>,
        /// Exec id, empty for the init process.
        exec_id: String,
        /// Host pid of the process.
        pid: u32,
    },
    /// The container hit its memory limit.
    Oom,
    /// The event stream was subscribed to again after it broke (the event's
    /// id is empty): exits in between may have been missed, so a receiver
    /// asks the runtime for the state of what it believes runs.
    Reconnected,
}

impl ContainerEvent {
    /// The event sent after a resubscription.
    pub fn reconnected() -> Self {
        Self {
            id: String::new(),
            kind: ContainerEventKind::Reconnected,
        }
    }
}

/// An event about one container (or sandbox infra container).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerEvent {
    /// Container id.
    pub id: String,
    /// What happened.
    pub kind: ContainerEventKind,
}

const TOPIC_EXIT: &str = "/tasks/exit";
const TOPIC_OOM: &str = "/tasks/oom";

/// Decodes a containerd event (`topic`, payload) into a [`ContainerEvent`];
/// `None` for other topics or undecodable payloads.
pub fn decode_event(topic: &str, event: &prost_types::Any) -> Option<ContainerEvent> {
    match topic {
        TOPIC_EXIT => {
            let e = TaskExit::decode(event.value.as_slice()).ok()?;
            let at = e.exited_at.as_ref().and_then(|t| {
                Some(
                    UNIX_EPOCH
                        + Duration::new(
                            u64::try_from(t.seconds).ok()?,
                            u32::try_from(t.nanos).ok()?,
                        ),
                )
            });
            // containerd sets `id` to the container id for the init process.
            let exec_id = if e.id == e.container_id {
                String::new()
            } else {
                e.id
            };
            Some(ContainerEvent {
                id: e.container_id,
                kind: ContainerEventKind::Exited {
                    code: e.exit_status,
                    at,
                    exec_id,
                    pid: e.pid,
                },
            })
        }
        TOPIC_OOM => {
            let e = TaskOom::decode(event.value.as_slice()).ok()?;
            Some(ContainerEvent {
                id: e.container_id,
                kind: ContainerEventKind::Oom,
            })
        }
        _ => None,
    }
}

/// The subscription filters for `namespace`.
pub fn filters(namespace: &str) -> Vec<String> {
    [TOPIC_EXIT, TOPIC_OOM]
        .iter()
        .map(|t| format!("topic==\"{t}\",namespace==\"{namespace}\""))
        .collect()
}

/// A running event subscription; stops when dropped.
#[derive(Debug)]
pub struct EventMonitor {
    sender: broadcast::Sender<ContainerEvent>,
    task: JoinHandle<()>,
}

impl EventMonitor {
    /// Starts the subscription loop. `capacity` bounds the broadcast buffer;
    /// slow receivers see `Lagged` and should resync with `status`.
    pub fn spawn(client: Containerd, capacity: usize) -> Self {
        let (sender, _) = broadcast::channel(capacity.max(1));
        let tx = sender.clone();
        let span = tracing::info_span!("container_events", namespace = client.namespace());
        let task = tokio::spawn(run(client, tx).instrument(span));
        Self { sender, task }
    }

    /// A new receiver of events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<ContainerEvent> {
        self.sender.subscribe()
    }
}

impl Drop for EventMonitor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(client: Containerd, tx: broadcast::Sender<ContainerEvent>) {
    let min = Duration::from_millis(100);
    let max = Duration::from_secs(5);
    let mut backoff = min;
    let mut subscribed_before = false;
    loop {
        let req = client.request(SubscribeRequest {
            filters: filters(client.namespace()),
        });
        match client.events().subscribe(req).await {
            Ok(resp) => {
                let mut stream = resp.into_inner();
                if std::mem::replace(&mut subscribed_before, true) {
                    // Subscribed again: what exited meanwhile sent no event
                    // this process saw.
                    tracing::info!("event stream resubscribed; asking for a resync");
                    let _ = tx.send(ContainerEvent::reconnected());
                }
                while let Some(item) = stream.next().await {
                    match item {
                        Ok(env) => {
                            backoff = min;
                            if env.namespace != client.namespace() {
                                continue;
                            }
                            if let Some(ev) =
                                env.event.as_ref().and_then(|a| decode_event(&env.topic, a))
                            {
                                // No receivers is fine: nobody is listening yet.
                                let _ = tx.send(ev);
                            }
                        }
                        Err(status) => {
                            tracing::warn!(error = %status, "event stream failed");
                            break;
                        }
                    }
                }
                tracing::info!("event stream ended, resubscribing");
            }
            Err(status) => {
                tracing::warn!(error = %status, ?backoff, "subscribing to events failed")
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_exit_and_oom() {
        let exit = TaskExit {
            container_id: "c1".into(),
            id: "c1".into(),
            pid: 7,
            exit_status: 3,
            exited_at: Some(prost_types::Timestamp {
                seconds: 5,
                nanos: 0,
            }),
        };
        let any = prost_types::Any {
            type_url: "containerd.events.TaskExit".into(),
            value: exit.encode_to_vec(),
        };
        let ev = decode_event(TOPIC_EXIT, &any).unwrap();
        assert_eq!(ev.id, "c1");
        assert_eq!(
            ev.kind,
            ContainerEventKind::Exited {
                code: 3,
                at: Some(UNIX_EPOCH + Duration::from_secs(5)),
                exec_id: String::new(),
                pid: 7
            }
        );
        let oom = TaskOom {
            container_id: "c2".into(),
        };
        let any = prost_types::Any {
            type_url: String::new(),
            value: oom.encode_to_vec(),
        };
        assert_eq!(
            decode_event(TOPIC_OOM, &any).unwrap(),
            ContainerEvent {
                id: "c2".into(),
                kind: ContainerEventKind::Oom
            }
        );
        assert!(decode_event("/tasks/start", &any).is_none());
        assert_eq!(filters("ns")[0], "topic==\"/tasks/exit\",namespace==\"ns\"");
    }
}
