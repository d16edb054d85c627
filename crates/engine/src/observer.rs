//! The [`FlowObserver`] trait through which the engine reports what it does
//! (implemented by `cubelet-metrics`).

use std::time::Duration;

use crate::flow::FlowKind;

/// How a flow or step ended, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Succeeded.
    Ok,
    /// Failed.
    Error,
    /// Cancelled by the caller (or by a failing sibling, for steps).
    Cancelled,
}

impl Outcome {
    /// Label value: `ok`, `error` or `cancelled`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// Receives the engine's events. Every method must be cheap and must not block:
/// it is called on the flow's hot path.
pub trait FlowObserver: Send + Sync + 'static {
    /// A flow was admitted and started.
    fn flow_started(&self, _flow: FlowKind) {}
    /// A flow ended.
    fn flow_finished(&self, _flow: FlowKind, _outcome: Outcome, _elapsed: Duration) {}
    /// A step of a flow ended.
    fn step_finished(&self, _flow: FlowKind, _step: &str, _outcome: Outcome, _elapsed: Duration) {}
    /// A flow was rejected because its limit was reached.
    fn rejected(&self, _flow: FlowKind, _limit: usize) {}
    /// A request waited `waited` for a slot of a full flow, then was
    /// `admitted` or rejected. Requests admitted at once are not reported.
    fn admission_waited(&self, _flow: FlowKind, _waited: Duration, _admitted: bool) {}
    /// A rollback (failover destroy or recovery) ended for a flow.
    fn rollback(&self, _flow: FlowKind, _outcome: Outcome) {}
    /// A flow's limit was set (at startup and on every change).
    fn limit_changed(&self, _flow: FlowKind, _limit: usize) {}
}

/// An observer that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopObserver;

impl FlowObserver for NoopObserver {}
