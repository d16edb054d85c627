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

use std::time::Duration;

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

impl PodService {
    /// Starts, in the background, the stats anchor of pod `sandbox_id` if it
    /// has no infra process and the runtime makes anchors.
    pub(crate) fn anchor_later(&self, sandbox_id: &SandboxId) {
        let this = self.clone();
        let id = sandbox_id.clone();
        let span = info_span!("stats_anchor", sandbox_id = %id);
        let delay = this.runtime().stats_anchor_delay();
        tokio::spawn(
            async move {
                // Outside any lock: a pod stopped meanwhile is not waited for.
                tokio::time::sleep(delay).await;
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
