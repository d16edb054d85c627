//! Cubelet's workflow engine.
//!
//! Sandbox lifecycle calls become *flows* (`create`, `destroy`, `cleanup`) of
//! pluggable *steps*: providers implementing [`Flow`], named in a
//! [`WorkflowConfig`] as ordered stages whose steps run in parallel. The
//! [`Engine`] admits flows under per-flow limits (an excess request waits at
//! most the flow's `admission_wait` for a slot, then is
//! [`EngineError::Rejected`], before the caller records anything), runs them with a span per flow and per step, rolls a failed
//! `create` back by running `destroy` (failover),
//! records every flow in a [`Journal`] so [`Engine::recover`] can settle
//! whatever a crash interrupted, and reports to a [`FlowObserver`].
//!
//! This crate owns the model only. It does no I/O of its own and knows
//! nothing of CRI, containerd, netlink or the database: providers, the store
//! and the metrics exporter plug in through the traits defined here.

mod collect;
mod config;
mod deferred;
mod engine;
mod error;
mod flow;
mod journal;
mod keyed;
mod limiter;
mod live;
mod observer;
mod recovery;
pub mod spec;

#[cfg(any(test, feature = "fake"))]
pub mod fake;

pub use collect::{blocking, Collector, GcReport};
pub use config::{ConfigError, FlowConfig, ValidFlow, WorkflowConfig};
pub use engine::{Admission, Engine, EngineBuilder, EngineOptions};
pub use error::{
    chain, BoxError, EngineError, JournalError, Message, RollbackError, StepError, StepErrorKind,
    StepFailure,
};
pub use flow::{Flow, FlowContext, FlowKind, SandboxOutput, SandboxOutputs};
pub use journal::{
    folds_into, FlowId, FlowRecord, FlowStart, FlowState, Journal, MemJournal, NoopJournal, Settle,
    StepEntry, StepEvent, StepRecord,
};
pub use keyed::{KeyedGuard, KeyedLocks};
pub use limiter::{Limiter, LimiterSnapshot, Permit, WaitOutcome};
pub use live::LiveSandboxes;
pub use observer::{FlowObserver, NoopObserver, Outcome};
pub use recovery::RecoveryReport;
pub use spec::{SandboxId, SandboxSpec};

#[cfg(test)]
mod tests;
