//! Reconciliation after a restart: settle the flows a crash interrupted,
//! then bring the records in line with what the runtime still runs.

use cubelet_engine::{EngineError, FlowKind, SandboxId};
use cubelet_runtime::container::ContainerState as RtState;
use cubelet_store::{ContainerState, SandboxState};
use tracing::{info, warn};

use crate::error::PodResult;
use crate::service::{blocking, PodService};

/// What [`PodService::reconcile`] did.
#[derive(Debug, Default)]
pub struct ReconcileReport {
    /// Interrupted flows that recovery settled, with the teardown that ran.
    pub settled: Vec<(SandboxId, FlowKind)>,
    /// Sandboxes whose recovery failed; the GC retries them.
    pub failed: Vec<(SandboxId, EngineError)>,
    /// Sandboxes whose create never finished, now left to the GC.
    pub abandoned: usize,
    /// Ready sandboxes whose infra process (or, without one, whose pinned
    /// namespaces) are gone, now not ready.
    pub not_ready: usize,
    /// Running containers whose output was picked up again.
    pub reattached: usize,
    /// Containers the runtime no longer knows, now `Unknown`.
    pub lost: usize,
    /// Shims stopped because the runtime had no task for them.
    pub shims_reaped: usize,
    /// Warm-pool shells the last run left, destroyed (never adopted).
    pub shells_destroyed: usize,
}

impl PodService {
    /// Runs once at start, before the CRI socket is served.
    pub async fn reconcile(&self) -> PodResult<ReconcileReport> {
        let recovery = self.engine().recover().await?;
        let mut report = ReconcileReport {
            settled: recovery.settled,
            failed: recovery.failed,
            ..Default::default()
        };
        for (id, flow) in &report.settled {
            info!(sandbox_id = %id, flow = %flow, "recovered interrupted flow");
        }
        for (id, err) in &report.failed {
            warn!(sandbox_id = %id, error = %cubelet_engine::chain(err), "recovery failed; left for GC");
        }
        // Recovery rolled back the shells whose prewarm was interrupted;
        // the ready ones go too (the pool refills once serving starts).
        report.shells_destroyed = self.reclaim_shells().await?;
        if report.shells_destroyed > 0 {
            info!(
                shells = report.shells_destroyed,
                "destroyed the warm-pool shells of the last run"
            );
        }
        let store = self.store();
        for rec in store.list_sandboxes()? {
            match rec.state {
                // Its create never finished: recovery destroyed what it built;
                // the GC removes the rest. kubelet never learned its id.
                SandboxState::Creating => {
                    blocking(|| {
                        store.update_sandbox(&rec.id, |r| {
                            r.state = SandboxState::NeedsCleanup;
                            r.last_error = Some("agent restarted during create".into());
                        })
                    })?;
                    report.abandoned += 1;
                }
                SandboxState::Ready => {
                    // A sandbox without an infra process lives while its
                    // pinned namespaces do; one with lives while its task runs.
                    let alive = match rec.process.as_ref() {
                        Some(p) if p.is_infraless() => self.runtime().pins_alive(p),
                        _ => matches!(
                            self.runtime().status(rec.id.as_str()).await,
                            Ok(s) if s.state == RtState::Running
                        ),
                    };
                    if !alive {
                        warn!(sandbox_id = %rec.id, "infra process or pinned namespaces gone; sandbox not ready");
                        blocking(|| {
                            store.update_sandbox(&rec.id, |r| r.state = SandboxState::NotReady)
                        })?;
                        report.not_ready += 1;
                    }
                }
                SandboxState::NotReady | SandboxState::NeedsCleanup => {}
            }
        }
        for c in store.list_containers()? {
            match self.runtime().status(&c.id).await {
                Ok(s) if s.state == RtState::Running => {
                    // A stats anchor the last run did not finish (or lost)
                    // is made again, in the background.
                    self.anchor_later(&c.sandbox_id);
                    match self.runtime().reattach(&c.id).await {
                        Ok(()) => report.reattached += 1,
                        Err(e) => {
                            warn!(container_id = %c.id, error = %cubelet_engine::chain(&e), "reattach logs")
                        }
                    }
                }
                Ok(s) => {
                    blocking(|| {
                        store.update_container(&c.id, |r| {
                            if r.state == ContainerState::Running {
                                r.state = ContainerState::Exited;
                                r.exit_code = s.exit_code.or(r.exit_code);
                                // As containerd's CRI: when the exit was not
                                // seen, it is dated when this start noticed it.
                                r.finished_at = s
                                    .finished_at
                                    .or(r.finished_at)
                                    .or_else(|| Some(std::time::SystemTime::now()));
                            }
                        })
                    })?;
                }
                Err(e) if e.is_not_found() => {
                    blocking(|| {
                        store.update_container(&c.id, |r| {
                            if r.state != ContainerState::Exited {
                                r.state = ContainerState::Unknown;
                                // Gone with the node (a reboot): dated when
                                // noticed, as containerd's CRI does, never
                                // left at the epoch (kubelet showed "56y ago").
                                if r.started_at.is_some() {
                                    r.finished_at.get_or_insert_with(std::time::SystemTime::now);
                                }
                            }
                        })
                    })?;
                    report.lost += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
        // Shims of creates the restart rolled back, which containerd forgot
        // (the GC catches the ones still too young here).
        match self.runtime().reap_orphan_shims().await {
            Ok(n) => report.shims_reaped = n,
            Err(e) => warn!(error = %cubelet_engine::chain(&e), "reaping orphan shims"),
        }
        if report.shims_reaped > 0 {
            info!(
                shims = report.shims_reaped,
                "stopped shims containerd has no task for"
            );
        }
        Ok(report)
    }
}
