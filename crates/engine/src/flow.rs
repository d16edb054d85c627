//! The [`Flow`] trait that providers implement, and the context a flow runs in.

use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::deferred::Task;
use crate::error::StepError;
use crate::spec::{NetworkStatus, SandboxId, SandboxProcess, SandboxSpec, StorageStatus};

/// The flows of the engine: the three every configuration defines, and
/// `prewarm`, which defaults to the `create` flow's stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlowKind {
    /// Builds a sandbox (RunPodSandbox).
    Create,
    /// Tears a sandbox down, keeping what `cleanup` removes (StopPodSandbox, rollback).
    Destroy,
    /// Removes everything left of a sandbox (RemovePodSandbox, GC).
    Cleanup,
    /// Builds a warm-pool shell, the pod-independent part of a sandbox,
    /// ahead of any pod (in the background; [`Flow::prewarm`]). A failure
    /// is rolled back by `cleanup`.
    Prewarm,
}

impl FlowKind {
    /// All flow kinds, in a stable order.
    pub const ALL: [FlowKind; 4] = [
        FlowKind::Create,
        FlowKind::Destroy,
        FlowKind::Cleanup,
        FlowKind::Prewarm,
    ];

    /// The flow's name in configuration and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            FlowKind::Create => "create",
            FlowKind::Destroy => "destroy",
            FlowKind::Cleanup => "cleanup",
            FlowKind::Prewarm => "prewarm",
        }
    }

    /// True for flows that tear down: every step runs even if another fails.
    pub fn is_teardown(self) -> bool {
        matches!(self, FlowKind::Destroy | FlowKind::Cleanup)
    }
}

impl fmt::Display for FlowKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FlowKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "create" => Ok(FlowKind::Create),
            "destroy" => Ok(FlowKind::Destroy),
            "cleanup" => Ok(FlowKind::Cleanup),
            "prewarm" => Ok(FlowKind::Prewarm),
            other => Err(format!(
                "unknown flow {other:?} (expected create, destroy, cleanup or prewarm)"
            )),
        }
    }
}

/// A pluggable step of the sandbox lifecycle (storage, network, sandbox runtime).
///
/// `destroy` and `cleanup` must be idempotent: tearing down what was never
/// created, or was already removed, succeeds. They may be called after a
/// restart with only the sandbox id and the stored spec, so providers derive
/// every name they create (paths, links, leases) from the sandbox id.
#[async_trait]
pub trait Flow: Send + Sync + 'static {
    /// Prepares the node once at startup (bridges, pools). Idempotent.
    async fn init(&self) -> Result<(), StepError> {
        Ok(())
    }

    /// Builds this provider's part of the sandbox and publishes its results
    /// into the context for later stages.
    async fn create(&self, ctx: &FlowContext) -> Result<(), StepError>;

    /// Stops this provider's part of the sandbox. Idempotent.
    async fn destroy(&self, ctx: &FlowContext) -> Result<(), StepError>;

    /// Removes everything this provider holds for the sandbox. Idempotent.
    async fn cleanup(&self, ctx: &FlowContext) -> Result<(), StepError>;

    /// Builds the pod-independent part of this provider's share of a
    /// sandbox ahead of any pod (a warm-pool shell), under the id the pod
    /// that claims it will have, and publishes it. The spec is a blank one.
    /// A later `create` of the same id runs with
    /// [`FlowContext::claimed`] set and what this published already in the
    /// context, and finishes only what depends on the pod. `cleanup`
    /// removes a shell that is never claimed. The default prepares nothing.
    async fn prewarm(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let _ = ctx;
        Ok(())
    }

    /// Whether `create` with this context, a claimed shell's
    /// ([`FlowContext::claimed`]), acts only on what the shell already
    /// holds under its id, so that the shell's `cleanup` (run with the
    /// shell's own blank spec) undoes all of it: nothing on the host
    /// beyond the shell (no host-port rule, no container), nothing named
    /// after the pod. When every step of a claimed `create` says so, the
    /// engine does not wait for the flow's first journal write to reach
    /// the disk ([`FlowStart::durable`]): a crash that loses it leaves
    /// the shell's durable record, and the restart destroys the shell
    /// whole. The default, `false`, is always safe.
    ///
    /// [`FlowStart::durable`]: crate::FlowStart::durable
    fn confined_to_shell(&self, ctx: &FlowContext) -> bool {
        let _ = ctx;
        false
    }
}

/// What the steps of a `create` flow produce, for later stages and for the
/// caller that records the sandbox: one typed slot per provider kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxOutputs {
    /// Published by the network step.
    pub network: Option<NetworkStatus>,
    /// Published by the storage step.
    pub storage: Option<StorageStatus>,
    /// Published by the sandbox step.
    pub process: Option<SandboxProcess>,
}

/// A value a step can publish: it names its slot in [`SandboxOutputs`].
pub trait SandboxOutput: Clone + Send + Sync + 'static {
    /// The slot this type lives in.
    fn slot(outputs: &mut SandboxOutputs) -> &mut Option<Self>;
}

impl SandboxOutput for NetworkStatus {
    fn slot(outputs: &mut SandboxOutputs) -> &mut Option<Self> {
        &mut outputs.network
    }
}

impl SandboxOutput for StorageStatus {
    fn slot(outputs: &mut SandboxOutputs) -> &mut Option<Self> {
        &mut outputs.storage
    }
}

impl SandboxOutput for SandboxProcess {
    fn slot(outputs: &mut SandboxOutputs) -> &mut Option<Self> {
        &mut outputs.process
    }
}

/// What a flow runs with: the sandbox, its spec, a cancellation token and a
/// typed place where steps publish results for later stages.
pub struct FlowContext {
    sandbox_id: SandboxId,
    spec: Arc<SandboxSpec>,
    cancel: CancellationToken,
    failover: bool,
    claimed: bool,
    caller_commits: bool,
    outputs: Arc<Mutex<SandboxOutputs>>,
    /// Set by the engine for the teardown flows it runs for a caller.
    deferrable: AtomicBool,
    deferred: Mutex<Vec<Task>>,
}

impl fmt::Debug for FlowContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FlowContext")
            .field("sandbox_id", &self.sandbox_id)
            .field("failover", &self.failover)
            .field("cancelled", &self.cancel.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl FlowContext {
    /// A context for `sandbox_id` with the given spec; failover off, a fresh token.
    pub fn new(sandbox_id: SandboxId, spec: Arc<SandboxSpec>) -> Self {
        Self {
            sandbox_id,
            spec,
            cancel: CancellationToken::new(),
            failover: false,
            claimed: false,
            caller_commits: false,
            outputs: Arc::default(),
            deferrable: AtomicBool::new(false),
            deferred: Mutex::default(),
        }
    }

    /// Asks the engine to run `destroy` for this sandbox if `create` fails.
    pub fn with_failover(mut self, failover: bool) -> Self {
        self.failover = failover;
        self
    }

    /// Tells the engine that the caller makes a durable store write of its
    /// own as soon as this flow succeeds (the pod service's `Ready` record
    /// of a new sandbox), so the journal write that settles a success is
    /// buffered and that write makes it durable: one disk flush less on
    /// the caller's path. A crash between the two leaves the flow open,
    /// and recovery undoes what nobody was told exists. A flow that fails
    /// is settled durably all the same.
    pub fn with_caller_commit(mut self, caller_commits: bool) -> Self {
        self.caller_commits = caller_commits;
        self
    }

    /// Whether the caller makes a durable write after a success
    /// ([`FlowContext::with_caller_commit`]).
    pub fn caller_commits(&self) -> bool {
        self.caller_commits
    }

    /// Marks a `create` that finishes a warm-pool shell made under this id
    /// by a `prewarm` flow, with `shell`, what that flow published, in the
    /// context: steps find their pod-independent part ready and do only
    /// what depends on the pod ([`Flow::prewarm`]).
    pub fn with_shell(mut self, shell: SandboxOutputs) -> Self {
        self.claimed = true;
        *self.lock() = shell;
        self
    }

    /// Whether this `create` finishes a claimed shell
    /// ([`FlowContext::with_shell`]).
    pub fn claimed(&self) -> bool {
        self.claimed
    }

    /// Uses the caller's cancellation token.
    pub fn with_cancel(mut self, cancel: CancellationToken) -> Self {
        self.cancel = cancel;
        self
    }

    /// The sandbox the flow runs for.
    pub fn sandbox_id(&self) -> &SandboxId {
        &self.sandbox_id
    }

    /// The sandbox's spec.
    pub fn spec(&self) -> &SandboxSpec {
        &self.spec
    }

    /// A shared handle on the spec.
    pub fn spec_arc(&self) -> Arc<SandboxSpec> {
        Arc::clone(&self.spec)
    }

    /// The token that is cancelled when the caller gives up.
    pub fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Whether failover (rollback on create failure) was requested.
    pub fn failover(&self) -> bool {
        self.failover
    }

    /// Publishes a result for later stages (and for the caller), replacing
    /// any earlier value of the same type.
    pub fn publish<T: SandboxOutput>(&self, value: T) {
        *T::slot(&mut self.lock()) = Some(value);
    }

    /// Reads a published result.
    pub fn get<T: SandboxOutput>(&self) -> Option<T> {
        T::slot(&mut self.lock()).clone()
    }

    /// Removes and returns a published result.
    pub fn take<T: SandboxOutput>(&self) -> Option<T> {
        T::slot(&mut self.lock()).take()
    }

    /// Everything published so far.
    pub fn outputs(&self) -> SandboxOutputs {
        self.lock().clone()
    }

    /// A context for compensating this one: same sandbox, spec and published
    /// results, but a fresh token (compensation runs even when the caller
    /// gave up).
    pub(crate) fn for_rollback(&self) -> FlowContext {
        FlowContext {
            sandbox_id: self.sandbox_id.clone(),
            spec: Arc::clone(&self.spec),
            cancel: CancellationToken::new(),
            failover: false,
            claimed: self.claimed,
            caller_commits: false,
            outputs: Arc::clone(&self.outputs),
            deferrable: AtomicBool::new(false),
            deferred: Mutex::default(),
        }
    }

    /// Finishes `work`, which completes what the calling step began but
    /// which the flow's caller need not wait for (the kernel's slow deletion
    /// of an interface already cut off, say): now, or later if the flow
    /// lets the engine finish it. `what` says what it does, for logs and
    /// the journal.
    ///
    /// Only the teardown flows (`destroy`, `cleanup`) the engine runs for a
    /// caller let it: the work is kept, and if every step of the flow
    /// succeeds the flow answers its caller without waiting for it and
    /// stays open in the journal until it is done. If the agent dies first,
    /// recovery runs the flow again, so the work must be part of what the
    /// step's idempotent teardown does anyway. If a step fails, the flow
    /// runs the work before it settles. The next flow of the same sandbox
    /// starts only once the work is done. Anywhere else (a `create`, a
    /// rollback, a recovery run, a step called without an engine) the work
    /// runs here, and its error is the step's.
    pub async fn defer(
        &self,
        what: &'static str,
        work: impl Future<Output = Result<(), StepError>> + Send + 'static,
    ) -> Result<(), StepError> {
        if !self.deferrable.load(Ordering::Acquire) {
            return work.await;
        }
        let task = Task {
            what,
            work: Box::pin(work),
        };
        self.deferred
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(task);
        Ok(())
    }

    /// Lets steps leave work to the engine ([`FlowContext::defer`]).
    pub(crate) fn allow_deferral(&self) {
        self.deferrable.store(true, Ordering::Release);
    }

    /// Takes the work deferred so far.
    pub(crate) fn take_deferred(&self) -> Vec<Task> {
        std::mem::take(&mut *self.deferred.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SandboxOutputs> {
        // Nothing panics while holding this lock (it only moves values in
        // and out of their slots), so a poisoned lock still holds them intact.
        self.outputs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_typed() {
        let ctx = FlowContext::new(SandboxId::new_unchecked("a"), Arc::default());
        let process = SandboxProcess {
            pid: Some(5),
            runtime_handler: "runc".into(),
            ..Default::default()
        };
        ctx.publish(process.clone());
        ctx.publish(NetworkStatus::default());
        assert_eq!(ctx.get::<SandboxProcess>(), Some(process.clone()));
        assert_eq!(ctx.get::<NetworkStatus>(), Some(NetworkStatus::default()));
        assert_eq!(ctx.get::<StorageStatus>(), None);
        assert_eq!(ctx.outputs().process, Some(process.clone()));
        assert_eq!(ctx.take::<SandboxProcess>(), Some(process));
        assert_eq!(ctx.get::<SandboxProcess>(), None);
    }

    #[test]
    fn flow_kind_round_trips() {
        for k in FlowKind::ALL {
            assert_eq!(k.as_str().parse::<FlowKind>().unwrap(), k);
        }
        assert!("gc".parse::<FlowKind>().unwrap_err().contains("gc"));
    }
}
