//! Work a teardown step leaves to finish after its flow has answered
//! ([`crate::FlowContext::defer`]), and the engine's list of that work per
//! sandbox ([`Deferred`]).
//!
//! The kernel deletes a veth pair and its network namespace slowly (an RCU
//! grace period or two, tens of milliseconds); a StopPodSandbox need not wait
//! for it once the pod is cut off from the network. A step of a teardown
//! flow the engine runs for a caller hands such work to the engine through
//! its context; what the engine does with it is in `Inner::run_journaled`:
//! if every step succeeded the flow answers its caller at once and stays
//! open in the journal until the work is done, so a crash in between leaves
//! an open flow that recovery runs again (and the garbage collector reclaims
//! orphans either way); if a step failed, the flow runs the work before it
//! settles. The next flow of the same sandbox starts only once the work is
//! done, and [`crate::Engine::drain`] waits for all of it at shutdown.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::error::StepError;
use crate::spec::SandboxId;

/// Deferred work: a future that finishes what a step began.
pub(crate) type Work = Pin<Box<dyn Future<Output = Result<(), StepError>> + Send + 'static>>;

/// Work a step deferred, with what it does (for logs and the journal).
pub(crate) struct Task {
    pub(crate) what: &'static str,
    pub(crate) work: Work,
}

/// The deferred work running in the background, one entry per sandbox.
#[derive(Debug, Default, Clone)]
pub(crate) struct Deferred {
    running: Arc<Mutex<Running>>,
}

#[derive(Debug, Default)]
struct Running {
    next: u64,
    by_sandbox: HashMap<SandboxId, (u64, watch::Receiver<bool>)>,
}

impl Deferred {
    fn lock(&self) -> std::sync::MutexGuard<'_, Running> {
        // Every update is one insert or remove: a poisoned map is intact.
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `work` for `sandbox` on a task of its own. The caller has
    /// waited for the sandbox's earlier work ([`Deferred::settle`]), so
    /// there is at most one entry per sandbox.
    pub(crate) fn spawn(
        &self,
        sandbox: SandboxId,
        work: impl Future<Output = ()> + Send + 'static,
    ) {
        let (done, rx) = watch::channel(false);
        let generation = {
            let mut running = self.lock();
            running.next += 1;
            let generation = running.next;
            running.by_sandbox.insert(sandbox.clone(), (generation, rx));
            generation
        };
        let this = self.clone();
        tokio::spawn(async move {
            work.await;
            let mut running = this.lock();
            if running
                .by_sandbox
                .get(&sandbox)
                .is_some_and(|(g, _)| *g == generation)
            {
                running.by_sandbox.remove(&sandbox);
            }
            drop(running);
            let _ = done.send(true);
        });
    }

    /// Waits until the deferred work of `sandbox`, if any, is done.
    pub(crate) async fn settle(&self, sandbox: &SandboxId) {
        let rx = self
            .lock()
            .by_sandbox
            .get(sandbox)
            .map(|(_, rx)| rx.clone());
        if let Some(rx) = rx {
            wait(rx).await;
        }
    }

    /// Waits until every deferred work running now is done.
    pub(crate) async fn drain(&self) {
        let all: Vec<_> = self
            .lock()
            .by_sandbox
            .values()
            .map(|(_, rx)| rx.clone())
            .collect();
        for rx in all {
            wait(rx).await;
        }
    }

    /// How many sandboxes have deferred work running.
    pub(crate) fn len(&self) -> usize {
        self.lock().by_sandbox.len()
    }
}

async fn wait(mut rx: watch::Receiver<bool>) {
    // An error means the task ended without saying so (the runtime shut
    // down): nothing runs any more either way.
    let _ = rx.wait_for(|done| *done).await;
}
