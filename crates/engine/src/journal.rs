//! The [`Journal`] trait: durable records of flows and their steps, so that a
//! crash at any point leaves enough to finish or undo the flow on restart.
//!
//! Protocol, as the engine drives it (one journal write per stage boundary):
//! 1. [`Journal::begin_stage`] before any step acts: the flow's start and the
//!    `Started` events of its first stage — must be durable when it returns;
//! 2. between two stages, [`Journal::record`] without settling: the
//!    `Finished` events of the stage that ended and the `Started` events of
//!    the next (history; may be buffered);
//! 3. [`Journal::record`] settling the flow when it is settled: the last
//!    stage's `Finished` events and the final state — must be durable.
//!
//! [`Journal::begin`], [`Journal::step`] and [`Journal::finish`] are the same
//! writes one record at a time (recovery settles flows with `finish`); the
//! batched methods have default implementations in terms of them, so a
//! journal only overrides them to make each batch one write.
//!
//! A flow is *open* until finished with [`FlowState::Succeeded`] or
//! [`FlowState::Compensated`]: a crash leaves it `Running`, and a create that
//! failed without a successful rollback is left `Failed`. `Engine::recover`
//! settles every open flow.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::error::JournalError;
use crate::flow::FlowKind;
use crate::spec::{SandboxId, SandboxSpec};

/// Identifier the journal assigns to a flow run.
pub type FlowId = u64;

/// State of a journalled flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlowState {
    /// Started, not settled (or the agent died while it ran).
    Running,
    /// Finished successfully.
    Succeeded,
    /// Failed and not (fully) compensated: needs recovery.
    Failed,
    /// Failed, then compensated (rolled back) or settled by recovery.
    Compensated,
}

impl FlowState {
    /// True while the flow still needs recovery.
    pub fn is_open(self) -> bool {
        matches!(self, FlowState::Running | FlowState::Failed)
    }
}

/// One step's record inside a flow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Provider name.
    pub step: String,
    /// Stage index.
    pub stage: usize,
    /// When the step started.
    pub started_at: SystemTime,
    /// How long it ran, once finished.
    pub duration: Option<Duration>,
    /// Error message if it failed, once finished.
    pub error: Option<String>,
}

/// What the journal keeps of a flow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowRecord {
    /// Journal id.
    pub id: FlowId,
    /// Which flow.
    pub kind: FlowKind,
    /// Sandbox it ran for.
    pub sandbox_id: SandboxId,
    /// The spec it ran with, so recovery can replay teardown with it.
    pub spec: SandboxSpec,
    /// Flow this one compensates, for rollbacks and recovery runs.
    pub compensates: Option<FlowId>,
    /// When it started.
    pub started_at: SystemTime,
    /// When it was settled.
    pub finished_at: Option<SystemTime>,
    /// Current state.
    pub state: FlowState,
    /// Error summary when it failed.
    pub error: Option<String>,
    /// Steps in the order they started.
    pub steps: Vec<StepRecord>,
    /// How many runs this record stands for: 1, or more when it took the
    /// place of the failed runs of the same cleanup before it (see
    /// [`folds_into`]); `error` is then the last run's.
    #[serde(default = "first_attempt")]
    pub attempts: u32,
}

fn first_attempt() -> u32 {
    1
}

/// Whether a flow starting as `start` takes the place of `prev`, the
/// newest record of the same sandbox: both are plain `cleanup` runs (no
/// compensation) and `prev` failed. A cleanup the GC retries for ever then
/// keeps one record, with its attempt count and last error, instead of
/// adding one per retry. Nothing is lost for recovery: the new run redoes
/// the same idempotent teardown, and is open until it settles.
pub fn folds_into(start: &FlowStart<'_>, prev: &FlowRecord) -> bool {
    start.kind == FlowKind::Cleanup
        && start.compensates.is_none()
        && prev.kind == FlowKind::Cleanup
        && prev.compensates.is_none()
        && &prev.sandbox_id == start.sandbox_id
        && prev.finished_at.is_some()
        && prev.state != FlowState::Succeeded
        && prev.error.is_some()
}

/// The start of a flow, as given to [`Journal::begin`].
#[derive(Debug, Clone, Copy)]
pub struct FlowStart<'a> {
    /// Which flow.
    pub kind: FlowKind,
    /// Sandbox it runs for.
    pub sandbox_id: &'a SandboxId,
    /// The spec.
    pub spec: &'a SandboxSpec,
    /// Flow this one compensates.
    pub compensates: Option<FlowId>,
    /// Whether the write is durable on return. `false` lets it be buffered
    /// until the next durable write of any kind. The engine starts so only
    /// a claimed `create` whose every step acts inside the shell alone
    /// ([`Flow::confined_to_shell`]): a crash that loses the start leaves
    /// the shell's own durable record, and its teardown undoes the steps.
    ///
    /// [`Flow::confined_to_shell`]: crate::Flow::confined_to_shell
    pub durable: bool,
}

/// A step event given to [`Journal::step`].
#[derive(Debug, Clone, Copy)]
pub enum StepEvent<'a> {
    /// The step is about to act.
    Started {
        /// Stage index.
        stage: usize,
    },
    /// The step returned.
    Finished {
        /// How long it ran.
        duration: Duration,
        /// Error message, if it failed.
        error: Option<&'a str>,
    },
}

/// A step event of a batched write: the step and what happened to it.
#[derive(Debug, Clone, Copy)]
pub struct StepEntry<'a> {
    /// Provider name.
    pub step: &'a str,
    /// The event.
    pub event: StepEvent<'a>,
}

/// How [`Journal::record`] settles a flow.
#[derive(Debug, Clone, Copy)]
pub struct Settle<'a> {
    /// The final state.
    pub state: FlowState,
    /// Error summary, if the flow failed.
    pub error: Option<&'a str>,
    /// Whether the write is durable on return. `false` lets it be
    /// buffered until the next durable write of any kind, which whoever
    /// settles so must make (see [`FlowContext::with_caller_commit`]).
    ///
    /// [`FlowContext::with_caller_commit`]: crate::FlowContext::with_caller_commit
    pub durable: bool,
}

/// Durable flow records. Implemented by `cubelet-store` on redb; the engine
/// only sees this trait.
pub trait Journal: Send + Sync + 'static {
    /// Records that a flow starts. Durable on return unless
    /// [`FlowStart::durable`] is false.
    fn begin(&self, start: FlowStart<'_>) -> Result<FlowId, JournalError>;
    /// Records a step event.
    fn step(&self, id: FlowId, step: &str, event: StepEvent<'_>) -> Result<(), JournalError>;
    /// Settles a flow. Durable on return.
    fn finish(&self, id: FlowId, state: FlowState, error: Option<&str>)
        -> Result<(), JournalError>;

    /// Records that a flow starts together with `started` (the `Started`
    /// events of its first stage), as one write that is durable on return
    /// unless [`FlowStart::durable`] is false.
    /// The default calls [`Journal::begin`], then [`Journal::step`] for each
    /// event.
    fn begin_stage(
        &self,
        start: FlowStart<'_>,
        started: &[StepEntry<'_>],
    ) -> Result<FlowId, JournalError> {
        let id = self.begin(start)?;
        for e in started {
            self.step(id, e.step, e.event)?;
        }
        Ok(id)
    }

    /// Records `events` in order and then, with `settle`, settles the flow,
    /// as one write. A write that settles is durable on return (as
    /// [`Journal::finish`]) unless [`Settle::durable`] is false; one that
    /// does not settle, or settles so, may be buffered (as
    /// [`Journal::step`]). The default calls [`Journal::step`] for each
    /// event, then [`Journal::finish`].
    fn record(
        &self,
        id: FlowId,
        events: &[StepEntry<'_>],
        settle: Option<Settle<'_>>,
    ) -> Result<(), JournalError> {
        for e in events {
            self.step(id, e.step, e.event)?;
        }
        match settle {
            Some(s) => self.finish(id, s.state, s.error),
            None => Ok(()),
        }
    }

    /// Every open flow (`Running` or `Failed`), oldest first.
    fn open_flows(&self) -> Result<Vec<FlowRecord>, JournalError>;
    /// Every flow recorded for a sandbox, oldest first.
    fn sandbox_history(&self, sandbox_id: &SandboxId) -> Result<Vec<FlowRecord>, JournalError>;
    /// Forgets every record of a sandbox (after it has been removed).
    fn forget(&self, sandbox_id: &SandboxId) -> Result<usize, JournalError>;
}

/// A journal that keeps nothing (benchmarks, tools).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopJournal;

impl Journal for NoopJournal {
    fn begin(&self, _start: FlowStart<'_>) -> Result<FlowId, JournalError> {
        Ok(0)
    }
    fn step(&self, _id: FlowId, _step: &str, _event: StepEvent<'_>) -> Result<(), JournalError> {
        Ok(())
    }
    fn finish(&self, _id: FlowId, _s: FlowState, _e: Option<&str>) -> Result<(), JournalError> {
        Ok(())
    }
    fn open_flows(&self) -> Result<Vec<FlowRecord>, JournalError> {
        Ok(Vec::new())
    }
    fn sandbox_history(&self, _sandbox_id: &SandboxId) -> Result<Vec<FlowRecord>, JournalError> {
        Ok(Vec::new())
    }
    fn forget(&self, _sandbox_id: &SandboxId) -> Result<usize, JournalError> {
        Ok(0)
    }
}

/// An in-memory journal with the same semantics as the durable one, for tests.
#[derive(Debug, Default)]
pub struct MemJournal {
    records: Mutex<Vec<FlowRecord>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl MemJournal {
    /// An empty journal.
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy of every record.
    pub fn records(&self) -> Vec<FlowRecord> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<FlowRecord>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn unknown_flow(op: &'static str, id: FlowId) -> JournalError {
    JournalError {
        op,
        source: format!("no flow with id {id}").into(),
    }
}

impl Journal for MemJournal {
    fn begin(&self, start: FlowStart<'_>) -> Result<FlowId, JournalError> {
        let mut recs = self.lock();
        // Ids are never reused, even after `forget`, as in the durable journal.
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        let mut attempts = 1;
        let newest = recs.iter().rposition(|r| &r.sandbox_id == start.sandbox_id);
        if let Some(i) = newest.filter(|&i| folds_into(&start, &recs[i])) {
            attempts = recs.remove(i).attempts.saturating_add(1);
        }
        recs.push(FlowRecord {
            id,
            kind: start.kind,
            sandbox_id: start.sandbox_id.clone(),
            spec: start.spec.clone(),
            compensates: start.compensates,
            started_at: SystemTime::now(),
            finished_at: None,
            state: FlowState::Running,
            error: None,
            steps: Vec::new(),
            attempts,
        });
        Ok(id)
    }

    fn step(&self, id: FlowId, step: &str, event: StepEvent<'_>) -> Result<(), JournalError> {
        let mut recs = self.lock();
        let rec = recs
            .iter_mut()
            .find(|r| r.id == id)
            .ok_or_else(|| unknown_flow("step", id))?;
        match event {
            StepEvent::Started { stage } => rec.steps.push(StepRecord {
                step: step.to_owned(),
                stage,
                started_at: SystemTime::now(),
                duration: None,
                error: None,
            }),
            StepEvent::Finished { duration, error } => {
                if let Some(s) = rec.steps.iter_mut().rev().find(|s| s.step == step) {
                    s.duration = Some(duration);
                    s.error = error.map(str::to_owned);
                }
            }
        }
        Ok(())
    }

    fn finish(
        &self,
        id: FlowId,
        state: FlowState,
        error: Option<&str>,
    ) -> Result<(), JournalError> {
        let mut recs = self.lock();
        let rec = recs
            .iter_mut()
            .find(|r| r.id == id)
            .ok_or_else(|| unknown_flow("finish", id))?;
        rec.state = state;
        rec.error = error.map(str::to_owned);
        rec.finished_at = Some(SystemTime::now());
        Ok(())
    }

    fn open_flows(&self) -> Result<Vec<FlowRecord>, JournalError> {
        Ok(self
            .lock()
            .iter()
            .filter(|r| r.state.is_open())
            .cloned()
            .collect())
    }

    fn sandbox_history(&self, sandbox_id: &SandboxId) -> Result<Vec<FlowRecord>, JournalError> {
        Ok(self
            .lock()
            .iter()
            .filter(|r| &r.sandbox_id == sandbox_id)
            .cloned()
            .collect())
    }

    fn forget(&self, sandbox_id: &SandboxId) -> Result<usize, JournalError> {
        let mut recs = self.lock();
        let before = recs.len();
        recs.retain(|r| &r.sandbox_id != sandbox_id);
        Ok(before - recs.len())
    }
}
