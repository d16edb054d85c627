//! [`Engine::recover`]: settling, after a restart, the flows a crash left open.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use tracing::{info_span, warn, Instrument};

use crate::engine::Engine;
use crate::error::{
    chain, EngineError, Message, RollbackError, StepError, StepErrorKind, StepFailure,
};
use crate::flow::{FlowContext, FlowKind};
use crate::journal::FlowState;
use crate::spec::SandboxId;

/// What [`Engine::recover`] did.
#[derive(Debug, Default)]
pub struct RecoveryReport {
    /// Sandboxes whose open flows were settled, with the teardown that ran.
    pub settled: Vec<(SandboxId, FlowKind)>,
    /// Sandboxes whose teardown failed again; their flows stay open.
    pub failed: Vec<(SandboxId, EngineError)>,
}

impl Engine {
    /// Settles every open flow in the journal: for an interrupted or failed
    /// `create` or `destroy` the `destroy` flow runs again, for a `cleanup`
    /// or a `prewarm` (a half-made shell, which no pod owns) the `cleanup`
    /// flow. One teardown per sandbox, bounded by the rollback
    /// budget; on success every open flow of the sandbox is marked
    /// compensated.
    pub async fn recover(&self) -> Result<RecoveryReport, EngineError> {
        let open = self
            .inner
            .journal
            .open_flows()
            .map_err(|source| EngineError::Journal {
                flow: FlowKind::Destroy,
                sandbox_id: SandboxId::new_unchecked("*"),
                source,
            })?;
        let mut by_sandbox: BTreeMap<SandboxId, Vec<crate::journal::FlowRecord>> = BTreeMap::new();
        for rec in open {
            by_sandbox
                .entry(rec.sandbox_id.clone())
                .or_default()
                .push(rec);
        }
        let inner = &self.inner;
        let results = futures::stream::iter(by_sandbox)
            .map(|(id, recs)| async move {
                let teardown = if recs
                    .iter()
                    .any(|r| matches!(r.kind, FlowKind::Cleanup | FlowKind::Prewarm))
                {
                    FlowKind::Cleanup
                } else {
                    FlowKind::Destroy
                };
                // The newest record carries the most recent spec.
                let spec = recs.last().map(|r| r.spec.clone()).unwrap_or_default();
                let ctx = FlowContext::new(id.clone(), Arc::new(spec));
                let span = info_span!("recover", sandbox_id = %id, flow = %teardown);
                let result = inner
                    .compensate(teardown, recs.last().map(|r| r.id), &Arc::new(ctx))
                    .instrument(span)
                    .await;
                (id, teardown, recs, result)
            })
            .buffer_unordered(inner.options.rollback_concurrency.max(1))
            .collect::<Vec<_>>()
            .await;

        let mut report = RecoveryReport::default();
        for (id, teardown, recs, result) in results {
            match result {
                Ok(()) => {
                    for rec in &recs {
                        if let Err(e) = inner.journal.finish(
                            rec.id,
                            FlowState::Compensated,
                            Some("settled by recovery"),
                        ) {
                            warn!(sandbox_id = %id, error = %chain(&e), "journal finish failed");
                        }
                    }
                    report.settled.push((id, teardown));
                }
                Err(failure) => {
                    let err = match failure {
                        RollbackError::Failed(failures) => EngineError::Failed {
                            flow: teardown,
                            sandbox_id: id.clone(),
                            failures,
                            rollback: None,
                        },
                        other => EngineError::Failed {
                            flow: teardown,
                            sandbox_id: id.clone(),
                            failures: vec![StepFailure {
                                step: "recover".to_owned(),
                                error: StepError::new(
                                    StepErrorKind::DeadlineExceeded,
                                    Message(other.to_string()),
                                ),
                            }],
                            rollback: None,
                        },
                    };
                    report.failed.push((id, err));
                }
            }
        }
        Ok(report)
    }
}
