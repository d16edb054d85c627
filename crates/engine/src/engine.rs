//! The [`Engine`]: runs flows of provider steps under per-flow limits, with
//! parallel stages, failover, a journal and recovery.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, error, info_span, warn, Instrument, Span};

use crate::collect::blocking;
use crate::config::{ConfigError, ValidFlow, WorkflowConfig};
use crate::deferred::{Deferred, Task};
use crate::error::{
    chain, EngineError, JournalError, Message, RollbackError, StepError, StepErrorKind, StepFailure,
};
use crate::flow::{Flow, FlowContext, FlowKind};
use crate::journal::{
    FlowId, FlowStart, FlowState, Journal, NoopJournal, Settle, StepEntry, StepEvent,
};
use crate::limiter::{Limiter, LimiterSnapshot, Permit};
use crate::observer::{FlowObserver, NoopObserver, Outcome};
use crate::spec::SandboxId;

/// Tunables of the engine that are not per flow.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// How long a rollback (or a recovery run) may take before it is abandoned
    /// and left for the garbage collector.
    pub rollback_timeout: Duration,
    /// Rollbacks that may run at once. They wait for a slot rather than being
    /// rejected, and do not count against the `destroy` limit, so user traffic
    /// can neither reject nor starve them.
    pub rollback_concurrency: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            rollback_timeout: Duration::from_secs(120),
            rollback_concurrency: 16,
        }
    }
}

/// Builds an [`Engine`] from named providers and a workflow configuration.
pub struct EngineBuilder {
    providers: BTreeMap<String, Arc<dyn Flow>>,
    journal: Arc<dyn Journal>,
    observer: Arc<dyn FlowObserver>,
    options: EngineOptions,
}

impl fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("providers", &self.providers.keys().collect::<Vec<_>>())
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Default for EngineBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl EngineBuilder {
    /// A builder with no providers, no journal and no observer.
    pub fn new() -> Self {
        Self {
            providers: BTreeMap::new(),
            journal: Arc::new(NoopJournal),
            observer: Arc::new(NoopObserver),
            options: EngineOptions::default(),
        }
    }

    /// Registers a provider under `name` (the name used in `flows.*.steps`).
    pub fn provider(mut self, name: impl Into<String>, flow: Arc<dyn Flow>) -> Self {
        self.providers.insert(name.into(), flow);
        self
    }

    /// Uses `journal` for durable flow records.
    pub fn journal(mut self, journal: Arc<dyn Journal>) -> Self {
        self.journal = journal;
        self
    }

    /// Reports events to `observer`.
    pub fn observer(mut self, observer: Arc<dyn FlowObserver>) -> Self {
        self.observer = observer;
        self
    }

    /// Sets engine options.
    pub fn options(mut self, options: EngineOptions) -> Self {
        self.options = options;
        self
    }

    /// Validates `config` against the registered providers and builds the engine.
    pub fn build(self, config: &WorkflowConfig) -> Result<Engine, ConfigError> {
        let valid = config.validate(self.providers.keys().map(String::as_str))?;
        let mut flows = HashMap::new();
        for ValidFlow {
            kind,
            concurrent,
            admission_wait,
            stages,
        } in valid
        {
            let stages = stages
                .into_iter()
                .map(|stage| {
                    stage
                        .into_iter()
                        .map(|name| {
                            // validate() checked every name is registered.
                            let flow = Arc::clone(&self.providers[&name]);
                            Step {
                                name: Arc::from(name.as_str()),
                                flow,
                            }
                        })
                        .collect()
                })
                .collect();
            self.observer.limit_changed(kind, concurrent);
            flows.insert(
                kind,
                FlowPlan {
                    stages,
                    limiter: Limiter::new(concurrent),
                    admission_wait,
                },
            );
        }
        Ok(Engine {
            inner: Arc::new(Inner {
                flows,
                providers: self.providers,
                journal: self.journal,
                observer: self.observer,
                rollback_slots: Semaphore::new(self.options.rollback_concurrency.max(1)),
                deferred: Deferred::default(),
                options: self.options,
            }),
        })
    }
}

#[derive(Clone)]
struct Step {
    name: Arc<str>,
    flow: Arc<dyn Flow>,
}

struct FlowPlan {
    stages: Vec<Vec<Step>>,
    limiter: Arc<Limiter>,
    /// Longest wait for a slot in [`Engine::admit_waiting`].
    admission_wait: Duration,
}

pub(crate) struct Inner {
    flows: HashMap<FlowKind, FlowPlan>,
    providers: BTreeMap<String, Arc<dyn Flow>>,
    pub(crate) journal: Arc<dyn Journal>,
    observer: Arc<dyn FlowObserver>,
    rollback_slots: Semaphore,
    /// Work of teardown flows that answered before it was done.
    deferred: Deferred,
    pub(crate) options: EngineOptions,
}

/// Runs sandbox flows. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Engine {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field(
                "providers",
                &self.inner.providers.keys().collect::<Vec<_>>(),
            )
            .field("limits", &self.limits())
            .finish_non_exhaustive()
    }
}

/// A flow that holds a slot of its limit, ready to run. Dropping it
/// unused gives the slot back.
pub struct Admission {
    inner: Arc<Inner>,
    kind: FlowKind,
    _permit: Permit,
}

impl fmt::Debug for Admission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admission")
            .field("flow", &self.kind)
            .finish_non_exhaustive()
    }
}

impl Admission {
    /// The admitted flow.
    pub fn kind(&self) -> FlowKind {
        self.kind
    }

    /// Runs the flow's stages in order and the steps of each stage in
    /// parallel, with failover for a `create` that asked for it.
    ///
    /// One cancellation model: the context's token. Cancelling it stops
    /// forward steps and the rollback still runs to its end. The caller
    /// (the pod service) drives every run to completion on a task of its
    /// own and serialises the flows of one sandbox under its pod lock; a
    /// run dropped half-way (the process killed) is what the journal and
    /// [`Engine::recover`] are for.
    pub async fn run(self, ctx: Arc<FlowContext>) -> Result<(), EngineError> {
        let kind = self.kind;
        let span = info_span!(
            "flow",
            flow = %kind,
            sandbox_id = %ctx.sandbox_id(),
            pod_uid = %ctx.spec().uid,
        );
        self.inner.run_admitted(kind, &ctx).instrument(span).await
    }
}

/// Result of running the stages of one flow.
struct StagesError {
    failures: Vec<StepFailure>,
    cancelled: bool,
}

impl Engine {
    /// Calls `init` on every registered provider, in name order.
    pub async fn init(&self) -> Result<(), EngineError> {
        for (name, flow) in &self.inner.providers {
            let span = info_span!("init", step = %name);
            flow.init()
                .instrument(span)
                .await
                .map_err(|error| EngineError::Init {
                    step: name.clone(),
                    source: StepFailure {
                        step: name.clone(),
                        error,
                    },
                })?;
        }
        Ok(())
    }

    /// Admits a flow: takes a slot of its limit without waiting, or returns
    /// [`EngineError::Rejected`] at once when the limit is reached, whatever
    /// the flow's `admission_wait` ([`Engine::admit_waiting`] honours it). Nothing
    /// else happens, so a caller admits first and records its intent only
    /// once admitted (a rejected request leaves no trace).
    pub fn admit(&self, kind: FlowKind) -> Result<Admission, EngineError> {
        let plan = self.inner.plan(kind)?;
        let Some(permit) = plan.limiter.try_acquire() else {
            let limit = plan.limiter.limit();
            self.inner.observer.rejected(kind, limit);
            return Err(EngineError::Rejected { flow: kind, limit });
        };
        Ok(Admission {
            inner: Arc::clone(&self.inner),
            kind,
            _permit: permit,
        })
    }

    /// Admits a flow, waiting at most the flow's `admission_wait` for a
    /// slot when it is full, then returns [`EngineError::Rejected`]. Past
    /// the limit's worth of waiting callers a request is rejected at once
    /// (a flood cannot queue without bound). A wait, admitted or not, is
    /// reported to the observer ([`FlowObserver::admission_waited`]). As
    /// [`Engine::admit`], nothing else happens.
    pub async fn admit_waiting(&self, kind: FlowKind) -> Result<Admission, EngineError> {
        let plan = self.inner.plan(kind)?;
        let wait = plan.admission_wait;
        let waited = plan.limiter.acquire_within(wait).await;
        let permit = match waited {
            Ok((permit, waited)) => {
                if !waited.is_zero() {
                    self.inner.observer.admission_waited(kind, waited, true);
                }
                permit
            }
            Err(waited) => {
                if !waited.is_zero() {
                    self.inner.observer.admission_waited(kind, waited, false);
                }
                let limit = plan.limiter.limit();
                self.inner.observer.rejected(kind, limit);
                return Err(EngineError::Rejected { flow: kind, limit });
            }
        };
        Ok(Admission {
            inner: Arc::clone(&self.inner),
            kind,
            _permit: permit,
        })
    }

    /// Admits and runs a flow for `ctx`'s sandbox: [`Engine::admit_waiting`],
    /// then [`Admission::run`].
    pub async fn run(&self, kind: FlowKind, ctx: Arc<FlowContext>) -> Result<(), EngineError> {
        self.admit_waiting(kind).await?.run(ctx).await
    }

    /// Changes a flow's limit at run time; `0` means unlimited.
    pub fn set_limit(&self, kind: FlowKind, limit: usize) -> Result<(), EngineError> {
        let plan = self
            .inner
            .flows
            .get(&kind)
            .ok_or(EngineError::NotConfigured(kind))?;
        plan.limiter.set_limit(limit);
        self.inner.observer.limit_changed(kind, limit);
        Ok(())
    }

    /// Limit and counters of every flow.
    pub fn limits(&self) -> Vec<(FlowKind, LimiterSnapshot)> {
        FlowKind::ALL
            .iter()
            .filter_map(|k| self.inner.flows.get(k).map(|p| (*k, p.limiter.snapshot())))
            .collect()
    }

    /// Provider names of each stage of a flow.
    pub fn stages(&self, kind: FlowKind) -> Vec<Vec<String>> {
        self.inner.flows.get(&kind).map_or_else(Vec::new, |p| {
            p.stages
                .iter()
                .map(|s| s.iter().map(|st| st.name.to_string()).collect())
                .collect()
        })
    }

    /// The journal the engine writes to.
    pub fn journal(&self) -> &Arc<dyn Journal> {
        &self.inner.journal
    }

    /// Waits until the work that teardown flows deferred
    /// ([`FlowContext::defer`]) and left running after they answered is
    /// done, for a shutdown that leaves nothing half-deleted. Work that is
    /// never finished (the agent is killed) leaves its flow open for
    /// [`Engine::recover`].
    pub async fn drain(&self) {
        self.inner.deferred.drain().await;
    }

    /// How many sandboxes have deferred work running.
    pub fn deferred_running(&self) -> usize {
        self.inner.deferred.len()
    }
}

impl Inner {
    fn plan(&self, kind: FlowKind) -> Result<&FlowPlan, EngineError> {
        self.flows
            .get(&kind)
            .ok_or(EngineError::NotConfigured(kind))
    }

    /// Runs an admitted flow: journal, stages, failover. Waits first for
    /// work an earlier flow of the sandbox deferred, so that flows of one
    /// sandbox never overlap.
    async fn run_admitted(
        self: &Arc<Self>,
        kind: FlowKind,
        ctx: &Arc<FlowContext>,
    ) -> Result<(), EngineError> {
        self.deferred.settle(ctx.sandbox_id()).await;
        let started = Instant::now();
        self.observer.flow_started(kind);
        let result = self.run_journaled(kind, ctx).await;
        let outcome = match &result {
            Ok(()) => Outcome::Ok,
            Err(EngineError::Cancelled { .. }) => Outcome::Cancelled,
            Err(_) => Outcome::Error,
        };
        self.observer
            .flow_finished(kind, outcome, started.elapsed());
        result
    }

    async fn run_journaled(
        self: &Arc<Self>,
        kind: FlowKind,
        ctx: &Arc<FlowContext>,
    ) -> Result<(), EngineError> {
        let sandbox_id = ctx.sandbox_id();
        if !kind.is_teardown() && ctx.cancel_token().is_cancelled() {
            return Err(EngineError::Cancelled {
                flow: kind,
                sandbox_id: sandbox_id.clone(),
                rollback: None,
            });
        }
        let plan = self.plan(kind)?;
        let start = FlowStart {
            kind,
            sandbox_id,
            spec: ctx.spec(),
            compensates: None,
            durable: !confined_claim(kind, &plan.stages, ctx),
        };
        let id = self
            .begin(start, &plan.stages)
            .map_err(|source| EngineError::Journal {
                flow: kind,
                sandbox_id: sandbox_id.clone(),
                source,
            })?;

        let mut finished = Vec::new();
        if kind.is_teardown() {
            ctx.allow_deferral();
        }
        let outcome = self
            .run_stages(
                kind,
                id,
                &plan.stages,
                ctx,
                ctx.cancel_token(),
                &mut finished,
            )
            .await;
        let deferred = ctx.take_deferred();
        let outcome = match outcome {
            // The steps are done and the sandbox is torn down as far as the
            // caller can tell: answer now, settle once the work is done. A
            // crash before that leaves the flow open, and recovery runs it
            // again (its steps are idempotent, the work part of them).
            Ok(()) if kind.is_teardown() && !deferred.is_empty() => {
                self.settle_after(kind, id, ctx.sandbox_id(), deferred, finished);
                return Ok(());
            }
            outcome => with_deferred(outcome, deferred).await,
        };
        let finish_error = match &outcome {
            // Buffered when the caller's own durable write follows.
            Ok(()) => self
                .settle(
                    id,
                    &mut finished,
                    FlowState::Succeeded,
                    None,
                    !ctx.caller_commits(),
                )
                .err(),
            Err(_) => None,
        };
        let failure = match (outcome, finish_error) {
            (Ok(()), None) => return Ok(()),
            // The sandbox exists but the journal cannot say so: undo it rather
            // than leave a record that recovery would read as interrupted.
            (Ok(()), Some(source)) => {
                error!(error = %chain(&source), "journal finish failed after success");
                StagesError {
                    failures: vec![StepFailure {
                        step: "journal".to_owned(),
                        error: StepError::internal(source),
                    }],
                    cancelled: false,
                }
            }
            (Err(e), _) => e,
        };

        // A failed create is undone by `destroy` (the pod service's `cleanup`
        // follows), a failed shell by `cleanup` at once: nobody else will.
        let undo = match kind {
            FlowKind::Create if ctx.failover() => Some(FlowKind::Destroy),
            FlowKind::Prewarm if ctx.failover() => Some(FlowKind::Cleanup),
            _ => None,
        };
        let rollback = if let Some(undo) = undo {
            let result = self
                .compensate(undo, Some(id), &Arc::new(ctx.for_rollback()))
                .await;
            let outcome = match &result {
                Ok(()) => Outcome::Ok,
                Err(_) => Outcome::Error,
            };
            self.observer.rollback(kind, outcome);
            Some(Box::new(result.err().unwrap_or(RollbackError::RolledBack)))
        } else {
            None
        };
        let state = match rollback.as_deref() {
            Some(RollbackError::RolledBack) => FlowState::Compensated,
            _ => FlowState::Failed,
        };
        let err = if failure.cancelled {
            EngineError::Cancelled {
                flow: kind,
                sandbox_id: sandbox_id.clone(),
                rollback,
            }
        } else {
            EngineError::Failed {
                flow: kind,
                sandbox_id: sandbox_id.clone(),
                failures: failure.failures,
                rollback,
            }
        };
        let summary = chain(&err);
        if let Err(e) = self.settle(id, &mut finished, state, Some(&summary), true) {
            error!(error = %chain(&e), "journal finish failed");
        }
        Err(err)
    }

    /// Runs `deferred` on a task of its own and then settles flow `id`:
    /// succeeded if all of it succeeded, failed (open, for recovery) if not.
    fn settle_after(
        self: &Arc<Self>,
        kind: FlowKind,
        id: FlowId,
        sandbox_id: &SandboxId,
        deferred: Vec<Task>,
        mut finished: Vec<Finished>,
    ) {
        let inner = Arc::clone(self);
        let sandbox = sandbox_id.clone();
        let work = async move {
            let started = Instant::now();
            let failures = run_deferred(deferred).await;
            let (state, summary) = if failures.is_empty() {
                debug!(elapsed = ?started.elapsed(), "deferred work done");
                (FlowState::Succeeded, None)
            } else {
                let err = EngineError::Failed {
                    flow: kind,
                    sandbox_id: sandbox.clone(),
                    failures,
                    rollback: None,
                };
                warn!(error = %chain(&err), "deferred work failed; the flow is left for recovery");
                (FlowState::Failed, Some(chain(&err)))
            };
            if let Err(e) = inner.settle(id, &mut finished, state, summary.as_deref(), true) {
                error!(error = %chain(&e), "journal finish failed after deferred work");
            }
        };
        self.deferred
            .spawn(sandbox_id.clone(), work.instrument(Span::current()));
    }

    // Crash safety of the journal writes.
    //
    // A flow makes one journal write per stage boundary: `begin` folded with
    // the `Started` events of the first stage (durable), then between two
    // stages the `Finished` events of the one that ended with the `Started`
    // events of the next (buffered), and at the end the last stage's
    // `Finished` events folded with `finish` (durable). A flow of n stages
    // makes n + 1 writes, two of them durable, where it used to make
    // 2 + 2 × steps (two durable).
    //
    // What recovery needs to see is that a step which may have acted was
    // known as started before it acted, so that its effects are undone. It
    // gets that at flow granularity: the durable first write returns before
    // any step of any stage acts, and from then on the flow is open (its
    // record is `Running`) until the durable last write settles it. Recovery
    // (`Engine::recover`) never reads step events: it runs the whole
    // teardown flow, whose steps are idempotent, with the spec the first
    // write carries, so every step that may have acted — started, finished,
    // or never reached — is undone the same way. The buffered writes in
    // between are therefore history (which step ran, how long, what failed):
    // a crash can lose them, never the open flow. They become durable with
    // the next durable commit of the store (this flow's settling write,
    // another flow's first write, a sandbox record), and redb reopens at the
    // last durable commit, so a crash never leaves a torn record.
    //
    // The settling write must be durable before the caller is told the
    // outcome: a create reported as succeeded whose `finish` were lost would
    // be torn down by recovery. A caller that makes a durable write of its
    // own after a success, before it tells anyone
    // (`FlowContext::with_caller_commit`: the pod service's `Ready` record),
    // has a successful settle buffered instead, and its write makes both
    // durable; a crash between the two leaves the flow open, and recovery
    // undoes a create nobody was told of. Failures settle durably. The
    // settling write is folded with the last stage's events because nothing
    // acts between the two. `begin` cannot be folded with
    // anything earlier (nothing is written before a flow is admitted), and
    // the first write cannot in general be buffered: a flow whose steps
    // acted but whose start was lost would leave their effects to the
    // garbage collector alone.
    //
    // The exception is a claimed `create` whose every step acts only inside
    // the shell (`Flow::confined_to_shell`: a pod without host ports or a
    // pause container, whose steps write its files into the shell's
    // directory and its hostname into the shell's pinned UTS namespace).
    // The shell's record is durable, and the pod service turns it into the
    // sandbox's with a buffered write just before the flow starts. A crash
    // before the next durable commit loses the claim and the start
    // together and reopens the store with the shell as it was recorded;
    // the restart destroys every recorded shell whole (its `cleanup`),
    // which undoes whatever the steps did inside it. A crash after another
    // flow's durable commit finds what was buffered before that commit:
    // the sandbox record, still `Creating` (reconciliation marks it for
    // cleanup and the GC's `cleanup` removes the sandbox by id), and, if
    // the commit came after the start, the flow, open (recovery undoes it
    // first) unless the commit came after its buffered settle too. Either
    // way nobody was told of the pod, whose `Ready` write is durable. Such
    // a create makes one durable write instead of two.

    /// The flow's first journal write: its start and the `Started` events of
    /// its first stage, durable on return unless `start` says otherwise.
    fn begin(&self, start: FlowStart<'_>, stages: &[Vec<Step>]) -> Result<FlowId, JournalError> {
        let first = stages.first().map_or(&[][..], Vec::as_slice);
        let started: Vec<StepEntry<'_>> = first
            .iter()
            .map(|step| StepEntry {
                step: &step.name,
                event: StepEvent::Started { stage: 0 },
            })
            .collect();
        blocking(|| self.journal.begin_stage(start, &started))
    }

    /// The flow's last journal write: the `Finished` events not yet written
    /// and the final state; durable on return if `durable`, else buffered
    /// until the store's next durable commit.
    fn settle(
        &self,
        id: FlowId,
        finished: &mut Vec<Finished>,
        state: FlowState,
        error: Option<&str>,
        durable: bool,
    ) -> Result<(), JournalError> {
        let events: Vec<StepEntry<'_>> = finished.iter().map(Finished::entry).collect();
        let settle = Settle {
            state,
            error,
            durable,
        };
        let result = blocking(|| self.journal.record(id, &events, Some(settle)));
        drop(events);
        finished.clear();
        result
    }

    /// The write between two stages: the `Finished` events of the stage
    /// that ended and the `Started` events of stage `index`, buffered. A
    /// failure loses history only, so it is logged.
    fn record_boundary(
        &self,
        id: FlowId,
        finished: &mut Vec<Finished>,
        index: usize,
        stage: &[Step],
    ) {
        let mut events: Vec<StepEntry<'_>> = finished.iter().map(Finished::entry).collect();
        events.extend(stage.iter().map(|step| StepEntry {
            step: &step.name,
            event: StepEvent::Started { stage: index },
        }));
        if let Err(e) = blocking(|| self.journal.record(id, &events, None)) {
            warn!(stage = index, error = %chain(&e), "journal step records failed");
        }
        drop(events);
        finished.clear();
    }

    /// Runs a teardown flow as compensation for flow `compensates`: waits for
    /// a rollback slot (never rejected), ignores the caller's cancellation,
    /// and gives up after the rollback timeout.
    pub(crate) async fn compensate(
        self: &Arc<Self>,
        teardown: FlowKind,
        compensates: Option<FlowId>,
        ctx: &Arc<FlowContext>,
    ) -> Result<(), RollbackError> {
        // The semaphore is never closed, so acquire cannot fail; if it ever
        // did, running without a slot is safer than skipping compensation.
        let _slot = self.rollback_slots.acquire().await.ok();
        let plan = match self.plan(teardown) {
            Ok(plan) => plan,
            Err(e) => {
                return Err(RollbackError::Failed(vec![StepFailure {
                    step: "engine".to_owned(),
                    error: StepError::internal(e),
                }]))
            }
        };
        let start = FlowStart {
            kind: teardown,
            sandbox_id: ctx.sandbox_id(),
            spec: ctx.spec(),
            compensates,
            durable: true,
        };
        let id = match self.begin(start, &plan.stages) {
            Ok(id) => id,
            Err(e) => {
                // Compensation must still run; history is what is lost.
                warn!(error = %chain(&e), "journal begin failed for rollback");
                0
            }
        };
        let started = Instant::now();
        self.observer.flow_started(teardown);
        let never = CancellationToken::new();
        let timeout = self.options.rollback_timeout;
        let mut finished = Vec::new();
        // Steps run their deferred work themselves here: the context does
        // not allow deferral.
        let result = tokio::time::timeout(
            timeout,
            self.run_stages(teardown, id, &plan.stages, ctx, &never, &mut finished),
        )
        .await;
        let (state, result) = match result {
            Ok(Ok(())) => (FlowState::Succeeded, Ok(())),
            Ok(Err(e)) => (FlowState::Failed, Err(RollbackError::Failed(e.failures))),
            Err(_) => (FlowState::Failed, Err(RollbackError::TimedOut(timeout))),
        };
        let outcome = if result.is_ok() {
            Outcome::Ok
        } else {
            Outcome::Error
        };
        self.observer
            .flow_finished(teardown, outcome, started.elapsed());
        let msg = result.as_ref().err().map(ToString::to_string);
        if let Err(e) = self.settle(id, &mut finished, state, msg.as_deref(), true) {
            warn!(error = %chain(&e), "journal finish failed for rollback");
        }
        result
    }

    /// Runs the stages of a flow. Create flows stop at the first failing stage
    /// (its siblings are cancelled); teardown flows run every step and report
    /// every failure.
    ///
    /// The first stage's `Started` events were written with the flow's
    /// start; each later stage's are written, with the previous stage's
    /// `Finished` events, just before it runs. The `Finished` events of the
    /// stage run last are left in `finished` for the settling write.
    async fn run_stages(
        self: &Arc<Self>,
        kind: FlowKind,
        id: FlowId,
        stages: &[Vec<Step>],
        ctx: &Arc<FlowContext>,
        cancel: &CancellationToken,
        finished: &mut Vec<Finished>,
    ) -> Result<(), StagesError> {
        let teardown = kind.is_teardown();
        let mut failures = Vec::new();
        for (index, stage) in stages.iter().enumerate() {
            if !teardown && cancel.is_cancelled() {
                if index == 0 {
                    // Recorded as started with the flow; they never ran.
                    finished.extend(stage.iter().map(|step| Finished {
                        step: Arc::clone(&step.name),
                        duration: Duration::ZERO,
                        error: Some("cancelled before it started".to_owned()),
                    }));
                }
                return Err(StagesError {
                    failures,
                    cancelled: true,
                });
            }
            if index > 0 {
                self.record_boundary(id, finished, index, stage);
            }
            let failed_before = failures.len();
            if let [step] = stage.as_slice() {
                let (result, record) = self.run_step(kind, index, step, ctx, cancel).await;
                finished.push(record);
                if let Err(f) = result {
                    failures.push(f);
                }
            } else {
                // Only a parallel forward stage needs its own token, so that a
                // failure can cancel the siblings without cancelling the caller.
                let stage_cancel = if teardown {
                    cancel.clone()
                } else {
                    cancel.child_token()
                };
                // Each step on a task of its own, so that one doing
                // synchronous work (a mount, a durable write) does not hold
                // up its siblings: in one task they would only take turns.
                let mut running: FuturesUnordered<_> = stage
                    .iter()
                    .map(|step| {
                        let (inner, step, ctx) = (Arc::clone(self), step.clone(), Arc::clone(ctx));
                        let cancel = stage_cancel.clone();
                        let name = Arc::clone(&step.name);
                        let task = tokio::spawn(
                            async move { inner.run_step(kind, index, &step, &ctx, &cancel).await }
                                .instrument(Span::current()),
                        );
                        AbortOnDropHandle::new(task)
                            .map(move |joined| joined.unwrap_or_else(|e| lost_step(&name, &e)))
                    })
                    .collect();
                while let Some((result, record)) = running.next().await {
                    finished.push(record);
                    if let Err(f) = result {
                        if !teardown {
                            // First failure cancels its siblings; they still
                            // finish (and are recorded) as cancelled.
                            stage_cancel.cancel();
                        }
                        failures.push(f);
                    }
                }
            }
            if !teardown && failures.len() > failed_before {
                // Siblings cancelled by a failure are not failures of their own.
                let cancelled = cancel.is_cancelled();
                failures.retain(|f| f.error.kind() != StepErrorKind::Cancelled || cancelled);
                return Err(StagesError {
                    failures,
                    cancelled,
                });
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(StagesError {
                failures,
                cancelled: false,
            })
        }
    }

    /// Runs one step with metrics, a span, panic capture and (for forward
    /// flows) cancellation; returns its result and its `Finished` event for
    /// the journal (its `Started` event is written with its stage's).
    async fn run_step(
        &self,
        kind: FlowKind,
        stage: usize,
        step: &Step,
        ctx: &FlowContext,
        cancel: &CancellationToken,
    ) -> (Result<(), StepFailure>, Finished) {
        let name: &str = &step.name;
        let started = Instant::now();
        let call = match kind {
            FlowKind::Create => step.flow.create(ctx),
            FlowKind::Destroy => step.flow.destroy(ctx),
            FlowKind::Cleanup => step.flow.cleanup(ctx),
            FlowKind::Prewarm => step.flow.prewarm(ctx),
        };
        let span = info_span!("step", step = name, stage);
        let guarded = AssertUnwindSafe(call.instrument(span)).catch_unwind();
        let result = if kind.is_teardown() {
            guarded.await
        } else {
            tokio::select! {
                r = guarded => r,
                () = cancel.cancelled() => Ok(Err(StepError::new(
                    StepErrorKind::Cancelled,
                    Message("cancelled".to_owned()),
                ))),
            }
        };
        let result = result.unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown payload".to_owned());
            Err(StepError::internal(Message(format!(
                "step panicked: {what}"
            ))))
        });
        let elapsed = started.elapsed();
        let outcome = match &result {
            Ok(()) => Outcome::Ok,
            Err(e) if e.kind() == StepErrorKind::Cancelled => Outcome::Cancelled,
            Err(_) => Outcome::Error,
        };
        self.observer.step_finished(kind, name, outcome, elapsed);
        let message = result.as_ref().err().map(|e| chain(e));
        if let Some(msg) = &message {
            debug!(step = name, error = %msg, "step failed");
        }
        let record = Finished {
            step: Arc::clone(&step.name),
            duration: elapsed,
            error: message,
        };
        let result = result.map_err(|error| StepFailure {
            step: name.to_owned(),
            error,
        });
        (result, record)
    }
}

/// Whether `ctx` is a claimed `create` whose every step acts only inside
/// the shell ([`Flow::confined_to_shell`]), so that its first journal write
/// may be buffered (see "Crash safety of the journal writes" above).
fn confined_claim(kind: FlowKind, stages: &[Vec<Step>], ctx: &FlowContext) -> bool {
    kind == FlowKind::Create
        && ctx.claimed()
        && stages
            .iter()
            .flatten()
            .all(|step| step.flow.confined_to_shell(ctx))
}

/// Runs the work the steps of a failed teardown deferred, all at once, and
/// adds its failures to `outcome`.
async fn with_deferred(
    outcome: Result<(), StagesError>,
    deferred: Vec<Task>,
) -> Result<(), StagesError> {
    if deferred.is_empty() {
        return outcome;
    }
    let failures = run_deferred(deferred).await;
    match outcome {
        Ok(()) if failures.is_empty() => Ok(()),
        Ok(()) => Err(StagesError {
            failures,
            cancelled: false,
        }),
        Err(mut e) => {
            e.failures.extend(failures);
            Err(e)
        }
    }
}

/// Runs deferred work concurrently; returns the failures, each named for
/// what the work does. A panic is a failure, as in a step.
async fn run_deferred(deferred: Vec<Task>) -> Vec<StepFailure> {
    let results = futures::future::join_all(deferred.into_iter().map(|task| async move {
        let result = AssertUnwindSafe(task.work)
            .catch_unwind()
            .await
            .unwrap_or_else(|_| {
                Err(StepError::internal(Message(format!(
                    "deferred work panicked: {}",
                    task.what
                ))))
            });
        (task.what, result)
    }))
    .await;
    results
        .into_iter()
        .filter_map(|(what, result)| {
            result.err().map(|error| StepFailure {
                step: what.to_owned(),
                error,
            })
        })
        .collect()
}

/// The result of a step whose task ended without one: it was cancelled
/// (the runtime shutting down); a panic is caught inside the task.
fn lost_step(name: &Arc<str>, e: &tokio::task::JoinError) -> (Result<(), StepFailure>, Finished) {
    let error = StepError::internal(Message(format!("step task ended: {e}")));
    let record = Finished {
        step: Arc::clone(name),
        duration: Duration::ZERO,
        error: Some(chain(&error)),
    };
    let failure = StepFailure {
        step: name.to_string(),
        error,
    };
    (Err(failure), record)
}

/// A step's `Finished` event, held until its flow's next journal write.
pub(crate) struct Finished {
    step: Arc<str>,
    duration: Duration,
    error: Option<String>,
}

impl Finished {
    fn entry(&self) -> StepEntry<'_> {
        StepEntry {
            step: &self.step,
            event: StepEvent::Finished {
                duration: self.duration,
                error: self.error.as_deref(),
            },
        }
    }
}
