//! How many `ExecSync` processes run at once in one pod sandbox.
//!
//! All the containers of a pod share one runc shim, and containerd 1.6's
//! shim deadlocks when exits pile up while it starts an exec: its exit
//! channel (32 deep) fills while `Start` holds the lock its exit loop
//! needs, and the reaper that would end `Start` is stuck sending to that
//! channel. From then on the shim answers nothing: no exec, no `State`, no
//! `Kill`, so the pod can be neither probed nor stopped. 500 concurrent
//! `ExecSync` calls on one container did that here in seconds (100 did
//! not). At most [`MAX_EXECS_PER_POD`] run at once per pod; later calls
//! wait their turn (within their timeout), and past [`MAX_EXEC_WAITERS_PER_POD`]
//! waiting they fail with `ResourceExhausted`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cubelet_engine::SandboxId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::PodError;

/// `ExecSync` processes running at once in one pod sandbox. Kubelet runs
/// at most three exec probes per container at a time; a pod of five
/// probed containers stays below it.
pub const MAX_EXECS_PER_POD: usize = 16;

/// `ExecSync` calls waiting for a slot in one pod sandbox; the next one
/// fails with `ResourceExhausted` at once.
pub const MAX_EXEC_WAITERS_PER_POD: usize = 256;

/// One pod's slots and how many calls wait for one.
#[derive(Debug)]
struct PodSlots {
    running: Arc<Semaphore>,
    waiting: AtomicUsize,
}

/// The slots of every pod that runs or waits for an `ExecSync`.
#[derive(Debug)]
pub(crate) struct ExecGate {
    max: usize,
    max_waiters: usize,
    pods: Mutex<HashMap<SandboxId, Arc<PodSlots>>>,
}

impl Default for ExecGate {
    fn default() -> Self {
        Self::new(MAX_EXECS_PER_POD, MAX_EXEC_WAITERS_PER_POD)
    }
}

/// A running `ExecSync`'s slot; freed when dropped.
#[derive(Debug)]
pub(crate) struct ExecSlot<'a> {
    _permit: OwnedSemaphorePermit,
    gate: &'a ExecGate,
    sandbox: SandboxId,
}

/// Counts a waiter while it waits.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ExecGate {
    /// At most `max` running and `max_waiters` waiting per pod.
    pub(crate) fn new(max: usize, max_waiters: usize) -> Self {
        Self {
            max,
            max_waiters,
            pods: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Arc<PodSlots>>> {
        self.pods.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for an `ExecSync` in `sandbox`, waited for at most `limit`
    /// (`None`: as long as the caller waits).
    pub(crate) async fn acquire(
        &self,
        sandbox: &SandboxId,
        limit: Option<Duration>,
    ) -> Result<ExecSlot<'_>, PodError> {
        let slots = Arc::clone(self.lock().entry(sandbox.clone()).or_insert_with(|| {
            Arc::new(PodSlots {
                running: Arc::new(Semaphore::new(self.max)),
                waiting: AtomicUsize::new(0),
            })
        }));
        let permit = match Arc::clone(&slots.running).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if slots.waiting.fetch_add(1, Ordering::AcqRel) >= self.max_waiters {
                    slots.waiting.fetch_sub(1, Ordering::AcqRel);
                    drop(slots);
                    self.forget_idle(sandbox);
                    return Err(PodError::ResourceExhausted(format!(
                        "pod sandbox {sandbox} runs {} ExecSync processes and {} more wait: \
                         no more are queued",
                        self.max, self.max_waiters
                    )));
                }
                let _waiting = Waiting(&slots.waiting);
                let wait = Arc::clone(&slots.running).acquire_owned();
                let acquired = match limit {
                    Some(t) => tokio::time::timeout(t, wait).await.ok(),
                    None => Some(wait.await),
                };
                match acquired {
                    Some(Ok(p)) => p,
                    // The semaphore is never closed.
                    Some(Err(_)) | None => {
                        drop(_waiting);
                        drop(slots);
                        self.forget_idle(sandbox);
                        return Err(PodError::DeadlineExceeded(format!(
                            "waited {}s for one of the {} ExecSync slots of pod sandbox \
                             {sandbox}",
                            limit.map_or(0, |t| t.as_secs()),
                            self.max
                        )));
                    }
                }
            }
        };
        Ok(ExecSlot {
            _permit: permit,
            gate: self,
            sandbox: sandbox.clone(),
        })
    }

    /// Drops `sandbox`'s entry when nothing runs or waits there.
    fn forget_idle(&self, sandbox: &SandboxId) {
        let mut pods = self.lock();
        if let Some(slots) = pods.get(sandbox) {
            if Arc::strong_count(slots) == 1
                && slots.running.available_permits() == self.max
                && slots.waiting.load(Ordering::Acquire) == 0
            {
                pods.remove(sandbox);
            }
        }
    }

    /// Pods with an entry (running or waiting calls).
    #[cfg(test)]
    pub(crate) fn pods(&self) -> usize {
        self.lock().len()
    }
}

impl Drop for ExecSlot<'_> {
    fn drop(&mut self) {
        // The permit goes back after this body: count it as returned.
        let mut pods = self.gate.lock();
        if let Some(slots) = pods.get(&self.sandbox) {
            if Arc::strong_count(slots) == 1
                && slots.running.available_permits() + 1 == self.gate.max
                && slots.waiting.load(Ordering::Acquire) == 0
            {
                pods.remove(&self.sandbox);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(s: &str) -> SandboxId {
        SandboxId::new_unchecked(s)
    }

    #[tokio::test]
    async fn calls_past_the_cap_wait_for_a_slot_and_run_when_one_frees() {
        let gate = ExecGate::new(2, 8);
        let a = gate.acquire(&sid("p1"), None).await.unwrap();
        let _b = gate.acquire(&sid("p1"), None).await.unwrap();
        // Another pod has slots of its own.
        let _other = gate.acquire(&sid("p2"), None).await.unwrap();
        let third = gate
            .acquire(&sid("p1"), Some(Duration::from_millis(50)))
            .await;
        match third {
            Err(PodError::DeadlineExceeded(m)) => {
                assert!(m.contains("ExecSync slots of pod sandbox p1"), "{m}")
            }
            other => panic!("third call: {other:?}"),
        }
        let p1 = sid("p1");
        let waiter = gate.acquire(&p1, Some(Duration::from_secs(5)));
        let release = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(a);
        };
        let (got, ()) = tokio::join!(waiter, release);
        assert!(got.is_ok(), "the waiter gets the freed slot");
    }

    #[tokio::test]
    async fn waiters_past_their_cap_are_refused_at_once() {
        let gate = ExecGate::new(1, 1);
        let _running = gate.acquire(&sid("p"), None).await.unwrap();
        let p = sid("p");
        let first_waiter = gate.acquire(&p, Some(Duration::from_secs(5)));
        let second = async {
            tokio::task::yield_now().await;
            gate.acquire(&sid("p"), None).await
        };
        let (_, second) = tokio::join!(
            tokio::time::timeout(Duration::from_millis(100), first_waiter),
            second
        );
        match second {
            Err(PodError::ResourceExhausted(m)) => assert!(m.contains("no more are queued"), "{m}"),
            other => panic!("second waiter: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_pod_with_nothing_running_or_waiting_has_no_entry() {
        let gate = ExecGate::new(1, 4);
        let slot = gate.acquire(&sid("p"), None).await.unwrap();
        assert!(gate
            .acquire(&sid("p"), Some(Duration::from_millis(10)))
            .await
            .is_err());
        assert_eq!(gate.pods(), 1);
        drop(slot);
        assert_eq!(gate.pods(), 0, "entry dropped with the last slot");
    }
}
