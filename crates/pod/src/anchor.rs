//! Stats anchors of pods without an infra process, started in the
//! background once a pod has a running container (see
//! `cubelet_runtime::sandbox::anchor`).
//!
//! An anchor is never on a path a client waits on: StartContainer answers
//! before it is asked for, and its failure is logged and counted, never
//! the pod's. It is asked for a moment after the start
//! ([`Runtime::stats_anchor_delay`](crate::Runtime::stats_anchor_delay)):
//! the pod's next containers start without it competing for the node, and a
//! pod that is gone by then (a job, a benchmark, a `crictl` run) never gets
//! one, so its stop waits for nothing. Making one holds the sandbox's own key in the container
//! locks (a sandbox id is never a container id), which the pod's stop and
//! removal take around their teardown: a teardown never runs beside a
//! half-made anchor, and an anchor never starts after its pod's teardown
//! (it reads the record again under the lock and goes only for a ready
//! pod whose pins are there).
//!
//! Anchors are also kept off busy moments ([`AnchorGate`]): they are made
//! one at a time, and only once no container has started for the anchor
//! delay. A burst of pod starts (a Deployment scaled up, a node filling)
//! then pays for none of them while it runs; they follow it, at most
//! [`ANCHOR_MAX_DEFER`] late.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::time::Instant;

use cubelet_engine::SandboxId;
use cubelet_runtime::sandbox::anchor::AnchorOutcome;
use cubelet_runtime::RuntimeError;
use cubelet_store::SandboxState;
use tracing::{debug, info_span, warn, Instrument};

use crate::service::PodService;

/// How long making one anchor may take before it is given up (a later
/// container start, or the next restart, tries again; teardown removes
/// whatever it left).
pub const ANCHOR_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest an anchor waits for a quiet node after it was asked for;
/// past it, anchors are made one after the other however busy the node is.
pub(crate) const ANCHOR_MAX_DEFER: Duration = Duration::from_secs(60);

/// How often a waiting anchor looks again whether the node is quiet.
const ANCHOR_POLL: Duration = Duration::from_millis(100);

/// Container starts in flight and when the last one ended, and the one
/// turn at making an anchor.
#[derive(Debug)]
pub(crate) struct AnchorGate {
    starts: AtomicUsize,
    last_start: Mutex<Option<Instant>>,
    turn: Semaphore,
}

impl Default for AnchorGate {
    fn default() -> Self {
        Self {
            starts: AtomicUsize::new(0),
            last_start: Mutex::new(None),
            turn: Semaphore::new(1),
        }
    }
}

/// A container start in flight; dropping it records when it ended.
pub(crate) struct StartInFlight<'a>(&'a AnchorGate);

impl Drop for StartInFlight<'_> {
    fn drop(&mut self) {
        if let Ok(mut last) = self.0.last_start.lock() {
            *last = Some(Instant::now());
        }
        self.0.starts.fetch_sub(1, Ordering::AcqRel);
    }
}

impl AnchorGate {
    /// Counts a container start until the guard is dropped.
    pub(crate) fn start(&self) -> StartInFlight<'_> {
        self.starts.fetch_add(1, Ordering::AcqRel);
        StartInFlight(self)
    }

    /// No start in flight, and none ended within `quiet`.
    fn is_quiet(&self, quiet: Duration) -> bool {
        if self.starts.load(Ordering::Acquire) > 0 {
            return false;
        }
        match self.last_start.lock() {
            Ok(last) => last.is_none_or(|t| t.elapsed() >= quiet),
            Err(_) => true,
        }
    }

    /// Waits for the turn at making an anchor, then for a quiet node
    /// (`quiet` without a container start), giving up the wait for quiet
    /// at `requested + ANCHOR_MAX_DEFER`. `None` only if the gate is
    /// closed, which it never is.
    async fn turn(&self, quiet: Duration, requested: Instant) -> Option<SemaphorePermit<'_>> {
        let permit = self.turn.acquire().await.ok()?;
        let deadline = requested + ANCHOR_MAX_DEFER;
        let mut deferred = false;
        while !self.is_quiet(quiet) && Instant::now() < deadline {
            if !deferred {
                debug!("stats anchor waits for container starts to settle");
                deferred = true;
            }
            tokio::time::sleep(ANCHOR_POLL).await;
        }
        Some(permit)
    }
}

impl PodService {
    /// Starts, in the background, the stats anchor of pod `sandbox_id` if it
    /// has no infra process and the runtime makes anchors.
    pub(crate) fn anchor_later(&self, sandbox_id: &SandboxId) {
        let this = self.clone();
        let id = sandbox_id.clone();
        let span = info_span!("stats_anchor", sandbox_id = %id);
        let delay = this.runtime().stats_anchor_delay();
        let requested = Instant::now();
        tokio::spawn(
            async move {
                // Outside any lock: a pod stopped meanwhile is not waited for.
                tokio::time::sleep(delay).await;
                let Some(_turn) = this.inner.anchors.turn(delay, requested).await else {
                    return;
                };
                this.anchor(&id).await
            }
            .instrument(span),
        );
    }

    async fn anchor(&self, id: &SandboxId) {
        let _lock = self.lock_container(id.as_str()).await;
        let rec = match self.store().get_sandbox(id) {
            Ok(Some(rec)) => rec,
            Ok(None) => return,
            Err(e) => {
                warn!(error = %cubelet_engine::chain(&e), "stats anchor: read the sandbox");
                return;
            }
        };
        if rec.state != SandboxState::Ready
            || !rec.process.as_ref().is_some_and(|p| p.is_infraless())
        {
            return;
        }
        // The pod's shim (its containers are grouped by the sandbox id)
        // serves the anchor too.
        let outcome = tokio::time::timeout(
            ANCHOR_TIMEOUT,
            self.runtime().ensure_stats_anchor(&rec, Some(id.as_str())),
        )
        .await
        .unwrap_or_else(|_| {
            Err(RuntimeError::Timeout {
                op: "start the stats anchor",
                id: id.as_str().to_owned(),
                timeout: ANCHOR_TIMEOUT,
            })
        });
        match outcome {
            Ok(Some(AnchorOutcome::Started(pid))) => {
                debug!(pid, "stats anchor started");
                self.runtime().stats_anchor_observed(true);
            }
            Ok(_) => {}
            Err(e) => {
                warn!(error = %cubelet_engine::chain(&e), "stats anchor failed; kubelet's cAdvisor reports no network for this pod");
                self.runtime().stats_anchor_observed(false);
            }
        }
    }
}
