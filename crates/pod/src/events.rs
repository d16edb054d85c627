//! The runtime's events (exits, OOM kills) applied to the records.

use std::time::SystemTime;

use cubelet_engine::SandboxId;
use cubelet_runtime::container::ContainerState as RtState;
use cubelet_runtime::events::{ContainerEvent, ContainerEventKind};
use cubelet_store::{ContainerState, SandboxState, StoreError};
use tracing::{info, warn};

use crate::service::{blocking, PodEventKind, PodService};

/// The reason of a container the kernel's OOM killer killed.
const OOM_KILLED: &str = "OOMKilled";
/// The exit status of a process killed by SIGKILL (128 + 9), as the
/// OOM killer kills.
const SIGKILL_EXIT: u32 = 137;

impl PodService {
    /// Applies a containerd event: a container's exit or OOM kill goes into
    /// its record; the exit of a pod's infra process makes the pod not ready.
    pub fn apply_event(&self, event: &ContainerEvent) {
        let store = self.store();
        // (sandbox, state before) of a container this exit stopped.
        let mut stopped = None;
        let result = match &event.kind {
            // A task made at the container's create and deleted before
            // its start: the container never ran, and stays created.
            ContainerEventKind::Exited { exec_id, pid, .. }
                if exec_id.is_empty() && self.runtime().unstarted_exit(&event.id, *pid) =>
            {
                return
            }
            ContainerEventKind::Exited {
                code, at, exec_id, ..
            } if exec_id.is_empty() => {
                let oom = *code == SIGKILL_EXIT && self.oom_killed(&event.id);
                blocking(|| {
                    store.update_container(&event.id, |c| {
                        if c.state != ContainerState::Exited {
                            stopped = Some((c.sandbox_id.clone(), c.state));
                        }
                        c.state = ContainerState::Exited;
                        c.exit_code = Some(i32::try_from(*code).unwrap_or(i32::MAX));
                        c.finished_at = Some(at.unwrap_or_else(SystemTime::now));
                        if oom {
                            c.reason.get_or_insert_with(|| OOM_KILLED.into());
                        }
                    })
                })
            }
            ContainerEventKind::Oom => blocking(|| {
                store.update_container(&event.id, |c| {
                    c.reason = Some(OOM_KILLED.into());
                })
            }),
            _ => return,
        };
        if let Some((sandbox_id, before)) = stopped {
            // The exit overtook StartContainer's own update: it did start.
            if before == ContainerState::Created {
                self.emit(&event.id, &sandbox_id, PodEventKind::Started);
            }
            self.emit(&event.id, &sandbox_id, PodEventKind::Stopped);
        }
        match result {
            Ok(_) => {}
            // Not a container: the infra process of a sandbox, or one removed.
            Err(StoreError::ContainerNotFound(_)) => self.infra_exited(event),
            Err(e) => {
                warn!(container_id = %event.id, error = %cubelet_engine::chain(&e), "apply event")
            }
        }
    }

    /// Whether a container that died of SIGKILL was killed by the kernel's
    /// OOM killer, as its memory cgroup counts. containerd's OOM event
    /// comes from the shim's watch on the cgroup, which a process killed
    /// right after its start can outrun; the cgroup still holds the count
    /// when the exit arrives (its task is not deleted yet).
    fn oom_killed(&self, id: &str) -> bool {
        let Ok(Some(c)) = self.store().get_container(id) else {
            return false;
        };
        if c.reason.is_some() {
            return false;
        }
        let parent = self
            .store()
            .get_sandbox(&c.sandbox_id)
            .ok()
            .flatten()
            .and_then(|s| s.spec.cgroup_parent);
        self.runtime().oom_killed(id, parent.as_deref())
    }

    /// Brings the records in line with the runtime after events may have
    /// been lost (the event stream was subscribed to again, or a receiver
    /// lagged): every container recorded as running whose task has exited
    /// gets the exit it missed, and every ready pod whose infra process has
    /// exited becomes not ready, as if the events had arrived. Returns how
    /// many exits it applied.
    pub async fn resync_exits(&self) -> usize {
        let mut applied = 0;
        let containers = match self.store().list_containers() {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %cubelet_engine::chain(&e), "resync: list containers");
                return 0;
            }
        };
        let sandboxes = match self.store().list_sandboxes() {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %cubelet_engine::chain(&e), "resync: list sandboxes");
                return 0;
            }
        };
        let running = containers
            .iter()
            .filter(|c| c.state == ContainerState::Running)
            .map(|c| c.id.clone());
        let infra = sandboxes
            .iter()
            .filter(|s| s.state == SandboxState::Ready)
            .filter(|s| s.process.as_ref().is_some_and(|p| !p.is_infraless()))
            .map(|s| s.id.as_str().to_owned());
        for id in running.chain(infra).collect::<Vec<_>>() {
            match self.runtime().status(&id).await {
                Ok(s) if s.state == RtState::Exited => {
                    let event = ContainerEvent {
                        id: id.clone(),
                        kind: ContainerEventKind::Exited {
                            code: s
                                .exit_code
                                .map_or(0, |c| u32::try_from(c).unwrap_or(u32::MAX)),
                            at: s.finished_at,
                            exec_id: String::new(),
                            pid: s.pid,
                        },
                    };
                    info!(container_id = %id, "resync: applying an exit the event stream missed");
                    self.apply_event(&event);
                    applied += 1;
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(container_id = %id, error = %cubelet_engine::chain(&e), "resync: status")
                }
            }
        }
        applied
    }

    /// The infra process of a sandbox exited: the pod is not ready (the
    /// exit of a stats anchor changes nothing).
    fn infra_exited(&self, event: &ContainerEvent) {
        let ContainerEventKind::Exited { exec_id, pid, .. } = &event.kind else {
            return;
        };
        let Some(id) = SandboxId::parse(&event.id).filter(|_| exec_id.is_empty()) else {
            return;
        };
        let result = blocking(|| {
            self.store().update_sandbox(&id, |r| {
                // A pod without an infra process does not live by a task:
                // the one with its id is its stats anchor, whose exit is
                // not the pod's.
                let infraless = r.process.as_ref().is_some_and(|p| p.is_infraless());
                // Nor is that of a process the pause container replaced (a
                // warm-pool shell's keeper, removed by the claim of a pod
                // that needs an infra process), when the pids tell.
                let other = match r.process.as_ref().and_then(|p| p.pid) {
                    Some(infra) => *pid != 0 && *pid != infra,
                    None => false,
                };
                if r.state == SandboxState::Ready && !infraless && !other {
                    r.state = SandboxState::NotReady;
                }
            })
        });
        match result {
            Ok(_) | Err(StoreError::SandboxNotFound(_)) => {}
            Err(e) => {
                warn!(sandbox_id = %id, error = %cubelet_engine::chain(&e), "apply infra exit")
            }
        }
    }
}
