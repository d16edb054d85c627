//! Warm pools: shells of pods made ahead of any pod, claimed by
//! RunPodSandbox.
//!
//! A **shell** is the pod-independent part of a sandbox — its network
//! namespace pinned, a veth pair on the bridge, an address leased, its
//! sandbox directory with `/dev/shm`, and (without an infra process) its
//! IPC and UTS namespaces pinned — built by the engine's `prewarm` flow
//! ([`cubelet_engine::Flow::prewarm`]) under a fresh sandbox id. A pod that
//! claims it *takes that id*: every name the providers derive from a
//! sandbox id (pins, veth, lease, directory) is already right, so status,
//! stats, port-forward, stop, remove, reconciliation and the GC treat the
//! pod exactly as a cold one. Nothing is renamed and no map is kept.
//!
//! - **Claim:** an O(1) pop under a mutex. The `create` flow then runs with
//!   the shell's outputs in its context ([`FlowContext::with_shell`]) and
//!   each step does only what depends on the pod (hostname in the pinned
//!   UTS namespace, hosts, resolv.conf, host ports, the records; sysctls
//!   and labels go with the containers as for any pod). A pod no shell
//!   fits (host network, a user namespace of its own, the node's IPC
//!   namespace), or an empty pool, takes the cold path.
//! - **One pod per shell, ever:** a claimed shell leaves the pool, and a
//!   removed pod's resources are destroyed as any pod's; nothing returns
//!   to the pool.
//! - **Refill and priority:** one task refills the pool after claims. The
//!   `prewarm` flow has its own limit (one at a time unless configured),
//!   so it never takes a permit of the `create` flow; and the task starts
//!   a shell only while no pod or container transition (RunPodSandbox,
//!   CreateContainer, StartContainer, the stops and removals) runs in this
//!   service. While at least half the pool is ready it also waits until
//!   none has run for [`QUIET`], so that a lone pod's start does not share
//!   the CPU and the store's durable writes with a shell made in the gaps
//!   between its calls. Below half ([`Pool::low`]) a burst of pods is
//!   emptying the pool, which never sees such a spell: the next shell
//!   starts in the first gap, so that the burst's later pods claim shells
//!   too instead of building their namespaces and links on the node their
//!   predecessors filled (the kernel's share of that grows with the pods
//!   on the bridge). A user create that arrives while a shell is being
//!   made runs beside it at once (nothing it needs is held by the prewarm
//!   beyond the short store and lease critical sections every flow
//!   shares), and the next shell waits until it is done.
//! - **Journal and reclaim:** a shell's record ([`ShellRecord`]) is durable
//!   before its flow acts, and the flow is journaled like any other: a
//!   crash mid-prewarm leaves an open `prewarm` flow, which recovery rolls
//!   back with `cleanup`. Ready shells are not adopted after a restart
//!   (nothing proves the kernel kept them whole): [`PodService::reconcile`]
//!   destroys every shell the last run left. Shutdown
//!   ([`PodService::close_pool`]) destroys the ready ones too, so a stopped
//!   agent leaves nothing behind. The GC counts shell records as live and
//!   reclaims a shell's objects once its record is gone.
//! - **A claim's one durable write:** a pod whose steps act only inside
//!   the shell (no host ports, no pause container, its log directory made
//!   already: `Flow::confined_to_shell`)
//!   makes a single durable write, its `Ready` record. The claim and the
//!   flow's journal writes before it are buffered, so a crash before it
//!   leaves the shell's record as it was, and the restart destroys that
//!   shell, with whatever the pod's steps did inside it, as any other.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cubelet_engine::spec::NamespaceMode;
use cubelet_engine::{
    chain, EngineError, FlowContext, FlowKind, SandboxId, SandboxOutputs, SandboxSpec,
};
use cubelet_store::ShellRecord;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tracing::{debug, info, info_span, warn, Instrument};

use crate::error::PodResult;
use crate::service::{blocking, new_id, PodService};

/// How long the refill task waits before it looks again while user
/// calls keep the node busy (it is also woken when they finish).
const BUSY_RECHECK: Duration = Duration::from_millis(50);
/// How long no pod or container transition must have run before a shell is
/// started while the pool is not low ([`Pool::low`]). A pod's start is
/// several calls (RunPodSandbox, CreateContainer, StartContainer) with a
/// client round trip between them; a shell made in such a gap would
/// compete with the next call for the CPU and the store's durable writes.
pub(crate) const QUIET: Duration = Duration::from_millis(100);
/// First wait after a failed prewarm; doubled per failure in a row.
const FAILURE_BACKOFF: Duration = Duration::from_millis(500);
/// Longest wait after failed prewarms.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// Wait between attempts to admit a shell's `cleanup` while the flow's
/// limit is full.
const CLEANUP_RETRY: Duration = Duration::from_millis(20);
/// Attempts to admit a shell's `cleanup` before the shell is left to the
/// GC (its record deleted).
const CLEANUP_ATTEMPTS: u32 = 500;

/// Reports pool events (the binary's metrics: `cubelet_pool_hits_total`,
/// `cubelet_pool_misses_total`, `cubelet_pool_ready`).
pub trait PoolObserver: Send + Sync + 'static {
    /// One RunPodSandbox with the pool on: it claimed a shell (`hit`) or
    /// took the cold path.
    fn claimed(&self, hit: bool);
    /// Shells ready now.
    fn ready(&self, n: usize);
}

/// A [`PoolObserver`] that reports nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoopPoolObserver;

impl PoolObserver for NoopPoolObserver {
    fn claimed(&self, _hit: bool) {}
    fn ready(&self, _n: usize) {}
}

/// Configuration of the sandbox pool (`pools.sandbox`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Shells kept ready; `0` turns the pool off.
    pub size: usize,
}

/// A ready shell: its id (its pod's sandbox id to be) and what its
/// `prewarm` flow published.
#[derive(Debug, Clone)]
pub(crate) struct Shell {
    pub(crate) id: SandboxId,
    pub(crate) outputs: SandboxOutputs,
}

/// The pool's state, shared by the service and the refill task.
pub(crate) struct Pool {
    size: usize,
    ready: Mutex<VecDeque<Shell>>,
    observer: Arc<dyn PoolObserver>,
    /// Pod and container transitions running (RunPodSandbox, Stop…,
    /// Remove…, CreateContainer, StartContainer).
    busy: AtomicUsize,
    /// When the last of them ended.
    idle_since: Mutex<Instant>,
    /// Wakes the refill task: a claim, the last busy create finishing.
    wake: Notify,
    refiller: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("size", &self.size)
            .field("ready", &self.len())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every update is one push, pop or assignment: consistent even if a
    // holder panicked.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pool {
    pub(crate) fn new(config: PoolConfig, observer: Arc<dyn PoolObserver>) -> Self {
        observer.ready(0);
        Self {
            size: config.size,
            ready: Mutex::default(),
            observer,
            busy: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            wake: Notify::new(),
            refiller: Mutex::default(),
        }
    }

    fn len(&self) -> usize {
        lock(&self.ready).len()
    }

    /// Whether fewer than half the shells are ready: pods are claiming
    /// them faster than quiet spells come, and the refill stops waiting
    /// for one (see the module documentation).
    fn low(&self, ready: usize) -> bool {
        ready * 2 < self.size
    }

    fn push(&self, shell: Shell) {
        let n = {
            let mut ready = lock(&self.ready);
            ready.push_back(shell);
            ready.len()
        };
        self.observer.ready(n);
    }

    fn pop(&self) -> Option<Shell> {
        let (shell, n) = {
            let mut ready = lock(&self.ready);
            (ready.pop_front(), ready.len())
        };
        self.observer.ready(n);
        shell
    }

    fn take_all(&self) -> Vec<Shell> {
        let all: Vec<Shell> = lock(&self.ready).drain(..).collect();
        self.observer.ready(0);
        all
    }
}

/// Counts a pod or container transition as busy until dropped.
pub(crate) struct Busy(Option<Arc<crate::service::Inner>>);

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(pool) = self.0.as_ref().and_then(|i| i.pool.as_ref()) {
            *lock(&pool.idle_since) = Instant::now();
            if pool.busy.fetch_sub(1, Ordering::AcqRel) == 1 {
                pool.wake.notify_one();
            }
        }
    }
}

/// Whether a shell fits `spec`'s pod: on the pod network, in the node's
/// user namespace, with an IPC namespace of its own (a shell has one, and
/// its `/dev/shm`). Pods with or without an infra process both fit: the
/// sandbox step drops the shell's IPC/UTS pins for a pod with one.
pub(crate) fn fits(spec: &SandboxSpec) -> bool {
    !spec.host_network()
        && spec.namespaces.userns.is_none()
        && spec.namespaces.ipc != NamespaceMode::Node
}

impl PodService {
    /// Whether the warm pool is on.
    pub fn pool_enabled(&self) -> bool {
        self.inner.pool.is_some()
    }

    /// Shells ready to be claimed now.
    pub fn pool_ready(&self) -> usize {
        self.inner.pool.as_ref().map_or(0, |p| p.len())
    }

    /// Marks a pod or container transition busy (the refill task waits)
    /// until the guard drops.
    pub(crate) fn busy(&self) -> Busy {
        match &self.inner.pool {
            Some(pool) => {
                pool.busy.fetch_add(1, Ordering::AcqRel);
                Busy(Some(Arc::clone(&self.inner)))
            }
            None => Busy(None),
        }
    }

    /// Claims a ready shell for `spec`'s pod if one fits, counting the hit
    /// or miss and waking the refill task. O(1).
    pub(crate) fn claim_shell(&self, spec: &SandboxSpec) -> Option<Shell> {
        let pool = self.inner.pool.as_ref()?;
        let shell = if fits(spec) { pool.pop() } else { None };
        pool.observer.claimed(shell.is_some());
        pool.wake.notify_one();
        shell
    }

    /// Starts the refill task (once reconciliation is done: a shell made
    /// before it would be destroyed by it). A no-op with the pool off or
    /// already started.
    pub fn start_pool(&self) {
        let Some(pool) = &self.inner.pool else {
            return;
        };
        let mut refiller = lock(&pool.refiller);
        if refiller.is_some() {
            return;
        }
        let this = self.clone();
        let span = info_span!("pool", size = pool.size);
        *refiller = Some(tokio::spawn(
            async move { this.refill().await }.instrument(span),
        ));
    }

    /// At shutdown, after the service's shutdown token is cancelled: waits
    /// for the refill task (a shell being made is rolled back) and destroys
    /// every ready shell. Returns how many were destroyed.
    pub async fn close_pool(&self) -> usize {
        let Some(pool) = &self.inner.pool else {
            return 0;
        };
        let task = lock(&pool.refiller).take();
        if let Some(task) = task {
            pool.wake.notify_one();
            if let Err(e) = task.await {
                warn!(error = %e, "pool refill task ended abnormally");
            }
        }
        let shells = pool.take_all();
        let n = shells.len();
        for shell in shells {
            self.discard_shell(&shell.id).await;
        }
        if n > 0 {
            info!(shells = n, "ready shells destroyed at shutdown");
        }
        n
    }

    /// Destroys every shell a previous run left (ready or half-made; their
    /// open `prewarm` flows were rolled back by recovery already). A shell
    /// whose id has a sandbox record was claimed: only its record goes.
    pub(crate) async fn reclaim_shells(&self) -> PodResult<usize> {
        let store = self.store();
        let mut destroyed = 0;
        for shell in store.list_shells()? {
            if store.get_sandbox(&shell.id)?.is_some() {
                blocking(|| store.delete_shell(&shell.id))?;
                continue;
            }
            self.discard_shell(&shell.id).await;
            destroyed += 1;
        }
        Ok(destroyed)
    }

    /// Keeps the pool full until shutdown.
    async fn refill(self) {
        let Some(pool) = self.inner.pool.clone() else {
            return;
        };
        let shutdown = self.deps().shutdown.clone();
        let mut failures = 0u32;
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            let ready = pool.len();
            let full = ready >= pool.size;
            let busy = pool.busy.load(Ordering::Acquire) > 0;
            let quiet_in = if pool.low(ready) {
                Duration::ZERO
            } else {
                QUIET.saturating_sub(lock(&pool.idle_since).elapsed())
            };
            if full || busy || !quiet_in.is_zero() {
                let recheck = if full {
                    MAX_BACKOFF
                } else if busy {
                    BUSY_RECHECK
                } else {
                    quiet_in
                };
                tokio::select! {
                    () = pool.wake.notified() => {}
                    () = tokio::time::sleep(recheck) => {}
                    () = shutdown.cancelled() => return,
                }
                continue;
            }
            let wait = match self.prewarm_one().await {
                Ok(true) => {
                    failures = 0;
                    continue;
                }
                // The limit is full (an operator lowered it to 0 or other
                // prewarms run): look again later.
                Ok(false) => BUSY_RECHECK,
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let wait = FAILURE_BACKOFF
                        .saturating_mul(1u32 << failures.min(8))
                        .min(MAX_BACKOFF);
                    if !shutdown.is_cancelled() {
                        warn!(error = %chain(&e), retry_in = ?wait, "prewarm failed");
                    }
                    wait
                }
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    /// Makes one shell and puts it in the pool. `Ok(false)` when the
    /// `prewarm` limit is full.
    async fn prewarm_one(&self) -> PodResult<bool> {
        let Some(pool) = self.inner.pool.as_ref() else {
            return Ok(false);
        };
        let admission = match self.engine().admit(FlowKind::Prewarm) {
            Ok(a) => a,
            Err(EngineError::Rejected { .. }) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        let id = SandboxId::new_unchecked(new_id()?);
        let store = self.store();
        // Durable before the flow acts, so the GC never takes the shell's
        // objects for orphans and a restart finds it.
        blocking(|| store.put_shell(&ShellRecord::new(id.clone())))?;
        let ctx = Arc::new(
            FlowContext::new(id.clone(), Arc::new(SandboxSpec::default()))
                .with_failover(true)
                .with_cancel(self.deps().shutdown.child_token()),
        );
        let span = info_span!("prewarm", sandbox_id = %id);
        match admission.run(Arc::clone(&ctx)).instrument(span).await {
            Ok(()) => {
                debug!(sandbox_id = %id, "shell ready");
                pool.push(Shell {
                    id,
                    outputs: ctx.outputs(),
                });
                Ok(true)
            }
            Err(err) => {
                // Rolled back by `cleanup` (failover); if that failed too,
                // the record goes anyway so the GC reclaims what is left.
                if let Err(e) = blocking(|| store.delete_shell(&id)) {
                    warn!(sandbox_id = %id, error = %chain(&e), "delete shell record");
                }
                if !err.rollback_failed() {
                    if let Err(e) = blocking(|| self.engine().journal().forget(&id)) {
                        warn!(sandbox_id = %id, error = %chain(&e), "forget journal");
                    }
                }
                Err(err.into())
            }
        }
    }

    /// Destroys an unclaimed shell (the `cleanup` flow), then its record
    /// and journal entries. On failure the record still goes, so the GC
    /// reclaims what is left.
    pub(crate) async fn discard_shell(&self, id: &SandboxId) {
        let spec = Arc::new(SandboxSpec::default());
        let mut attempts = 0;
        let result = loop {
            let ctx = Arc::new(FlowContext::new(id.clone(), Arc::clone(&spec)));
            match self.engine().run(FlowKind::Cleanup, ctx).await {
                Err(EngineError::Rejected { .. }) if attempts < CLEANUP_ATTEMPTS => {
                    attempts += 1;
                    tokio::time::sleep(CLEANUP_RETRY).await;
                }
                other => break other,
            }
        };
        let store = self.store();
        if let Err(e) = blocking(|| store.delete_shell(id)) {
            warn!(sandbox_id = %id, error = %chain(&e), "delete shell record");
        }
        match result {
            Ok(()) => {
                if let Err(e) = blocking(|| self.engine().journal().forget(id)) {
                    warn!(sandbox_id = %id, error = %chain(&e), "forget journal");
                }
            }
            Err(e) => {
                warn!(sandbox_id = %id, error = %chain(&e), "destroying a shell failed; left to the GC")
            }
        }
    }
}
