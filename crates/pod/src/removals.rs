//! Container removals that finish after RemoveContainer has answered.
//!
//! RemoveContainer forgets the container (its record goes) and answers;
//! what the runtime holds for it (the task, the rootfs snapshot, the
//! containerd record, the FIFOs) is removed on a task of its own, as
//! StopPodSandbox leaves the kernel's veth and netns deletion to the
//! engine's deferred work. Nothing can address the container once its record
//! is gone, so no call waits for that work except the ones that must:
//! RemovePodSandbox waits for its pod's removals before its `cleanup` flow
//! (the pod leaves nothing behind when it answers), and shutdown drains them
//! all ([`PodService::drain_removals`]).
//!
//! Crash safety: the runtime's objects outlive the record, never the other
//! way round, and an object of no record is what the garbage collector's
//! containerd collector reclaims. A crash before the removal finished leaves
//! objects of no record (the GC removes them) or, when the record's buffered
//! deletion had not reached the disk, the record too (reconciliation reads
//! the container's state from the runtime and the client removes it again).
//! The collector asks [`PodService::removing`] after it has read the store,
//! and a removal is registered before its record is deleted, so it never
//! races one in flight.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};

use cubelet_engine::SandboxId;
use tokio::sync::watch;
use tracing::Instrument;

use crate::service::PodService;

/// A container's pod and the flag its removal raises when done.
type Running = HashMap<String, (SandboxId, watch::Receiver<bool>)>;

/// The removals running in the background, by container id.
#[derive(Debug, Default, Clone)]
pub(crate) struct Removals {
    running: Arc<Mutex<Running>>,
}

/// A registered removal, whose work has not been handed over yet.
pub(crate) struct Pending {
    removals: Removals,
    container: String,
    done: watch::Sender<bool>,
}

impl Removals {
    fn lock(&self) -> std::sync::MutexGuard<'_, Running> {
        // Every update is one insert or remove: a poisoned map is intact.
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers the removal of `container` (of `sandbox`) before anything
    /// of it is deleted. A container's removals are serialised by its lock,
    /// so there is at most one entry per container.
    pub(crate) fn register(&self, container: &str, sandbox: &SandboxId) -> Pending {
        let (done, rx) = watch::channel(false);
        self.lock()
            .insert(container.to_owned(), (sandbox.clone(), rx));
        Pending {
            removals: self.clone(),
            container: container.to_owned(),
            done,
        }
    }

    fn waiters(&self, mut which: impl FnMut(&SandboxId) -> bool) -> Vec<watch::Receiver<bool>> {
        self.lock()
            .values()
            .filter(|(sandbox, _)| which(sandbox))
            .map(|(_, rx)| rx.clone())
            .collect()
    }
}

impl Pending {
    /// Runs `work` on a task of its own; the entry goes when it is done.
    pub(crate) fn spawn(self, work: impl Future<Output = ()> + Send + 'static) {
        tokio::spawn(
            async move {
                work.await;
                drop(self);
            }
            .in_current_span(),
        );
    }
}

impl Drop for Pending {
    /// Done, cut short, or never handed its work (the record's deletion
    /// failed): nothing runs for the container any more.
    fn drop(&mut self) {
        self.removals.lock().remove(&self.container);
        let _ = self.done.send(true);
    }
}

async fn wait_all(all: Vec<watch::Receiver<bool>>) {
    for mut rx in all {
        // An error means the task ended without saying so (the runtime shut
        // down): nothing runs any more either way.
        let _ = rx.wait_for(|done| *done).await;
    }
}

impl PodService {
    /// Ids of the containers whose runtime objects are being removed in the
    /// background (their records are gone already): not orphans.
    pub fn removing(&self) -> HashSet<String> {
        self.inner.removals.lock().keys().cloned().collect()
    }

    /// Waits until every background removal of `sandbox`'s containers is done.
    pub(crate) async fn settle_removals(&self, sandbox: &SandboxId) {
        wait_all(self.inner.removals.waiters(|s| s == sandbox)).await;
    }

    /// Waits until every background removal running now is done (shutdown).
    pub async fn drain_removals(&self) {
        wait_all(self.inner.removals.waiters(|_| true)).await;
    }
}
