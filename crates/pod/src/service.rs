//! The [`PodService`] object: what it is built from, its locks, its event
//! channel, and the lookups every call shares.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::SystemTime;

use cubelet_engine::{Engine, KeyedGuard, KeyedLocks, SandboxId};
use cubelet_store::{ContainerRecord, SandboxRecord, Store};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn, Instrument};

use crate::error::{PodError, PodResult};
use crate::pool::{NoopPoolObserver, Pool, PoolConfig, PoolObserver};
use crate::removals::Removals;
use crate::runtime::Runtime;

/// Events buffered per subscriber before the oldest are dropped.
pub const EVENT_BUFFER: usize = 1024;

/// What happened to a container (or to a pod's sandbox, whose "container"
/// id is the sandbox id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodEventKind {
    /// Created.
    Created,
    /// Started.
    Started,
    /// Stopped (exited).
    Stopped,
    /// Removed.
    Deleted,
}

/// A lifecycle event, with the pod and its containers as they were when it
/// happened (read only while someone listens).
#[derive(Debug, Clone)]
pub struct PodEvent {
    /// The container, or the sandbox id for the pod's own events.
    pub container_id: String,
    /// The pod.
    pub sandbox_id: SandboxId,
    /// What happened.
    pub kind: PodEventKind,
    /// When.
    pub at: SystemTime,
    /// The pod's record at that moment (`None` once removed); shared by
    /// every subscriber and by the events of one transition.
    pub sandbox: Option<Arc<SandboxRecord>>,
    /// The pod's containers at that moment, shared likewise.
    pub containers: Arc<[ContainerRecord]>,
}

/// What the pod service is built from.
pub struct PodDeps {
    /// The workflow engine (sandbox flows).
    pub engine: Engine,
    /// Node state.
    pub store: Arc<Store>,
    /// Containers, tasks and images.
    pub runtime: Arc<dyn Runtime>,
    /// Cancelled at shutdown: forward steps of flows in flight stop and roll back.
    pub shutdown: CancellationToken,
}

impl fmt::Debug for PodDeps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PodDeps")
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub(crate) deps: PodDeps,
    /// One lock per pod (namespace, name, attempt): every sandbox-level
    /// transition — run, stop, remove, creating a container in it — holds it.
    pub(crate) pod_locks: KeyedLocks<String>,
    /// One lock per container id: start, stop, remove.
    pub(crate) container_locks: KeyedLocks<String>,
    pub(crate) events: broadcast::Sender<PodEvent>,
    /// The warm pool of sandbox shells, when on.
    pub(crate) pool: Option<Arc<Pool>>,
    /// Container removals finishing in the background.
    pub(crate) removals: Removals,
    /// CPU samples and open cgroup files of the stats calls.
    pub(crate) stats: crate::stats::StatsState,
    /// When a CRI client (kubelet) last named each sandbox in a
    /// ListPodSandbox or PodSandboxStatus answer; see
    /// [`PodService::gc_candidates`].
    pub(crate) sightings: Sightings,
    /// Keeps stats anchors off busy moments ([`crate::anchor::AnchorGate`]).
    pub(crate) anchors: crate::anchor::AnchorGate,
    /// Graceful stops in flight, which a later, shorter stop hastens.
    pub(crate) stops: crate::stops::Stops,
    /// `ExecSync` processes running per pod sandbox, capped.
    pub(crate) execs: crate::exec_gate::ExecGate,
}

/// When a client last saw each sandbox, in memory: after a restart every
/// sandbox counts as seen at the start.
#[derive(Debug)]
pub(crate) struct Sightings {
    since: std::time::Instant,
    last: std::sync::Mutex<std::collections::HashMap<SandboxId, std::time::Instant>>,
}

impl Default for Sightings {
    fn default() -> Self {
        Self {
            since: std::time::Instant::now(),
            last: std::sync::Mutex::default(),
        }
    }
}

impl Sightings {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<SandboxId, std::time::Instant>> {
        // One insert or lookup per holder: consistent even after a panic.
        self.last.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that a client saw `ids` now.
    pub(crate) fn saw<'a>(&self, ids: impl IntoIterator<Item = &'a SandboxId>) {
        let now = std::time::Instant::now();
        let mut last = self.lock();
        for id in ids {
            last.insert(id.clone(), now);
        }
    }

    /// When a client last saw `id` (the start of this process at the
    /// earliest).
    pub(crate) fn last_seen(&self, id: &SandboxId) -> std::time::Instant {
        self.lock()
            .get(id)
            .copied()
            .map_or(self.since, |t| t.max(self.since))
    }

    /// Forgets every sandbox `keep` refuses.
    pub(crate) fn retain(&self, mut keep: impl FnMut(&SandboxId) -> bool) {
        self.lock().retain(|id, _| keep(id));
    }
}

/// Owns every pod and container state transition: RunPodSandbox through
/// RemoveContainer, containerd's exit events, reconciliation after a
/// restart and the GC's work list. Cheap to clone.
///
/// Rules every call follows:
/// - **Admission before persistence:** a sandbox flow is admitted by the
///   engine before anything is recorded, so a rejected call writes nothing.
/// - **Locks, then checks:** a call takes its pod lock (always before any
///   container lock) or container lock, then reads the record again and
///   checks the state it needs; nothing decided before the lock counts.
/// - **One cancellation model:** a mutating call runs on a task of its own
///   and to its end even if the client gives up (a retry then finds the
///   result); only shutdown cancels, through the flows' token.
#[derive(Clone)]
pub struct PodService {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for PodService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PodService").finish_non_exhaustive()
    }
}

/// The pod lock's key of a pod.
pub(crate) fn pod_key(spec: &cubelet_engine::SandboxSpec) -> String {
    format!("{}/{}/{}", spec.namespace, spec.name, spec.attempt)
}

/// A fresh 64-hex-character id, as containerd makes them.
pub(crate) fn new_id() -> PodResult<String> {
    let mut buf = [0u8; 32];
    getrandom::fill(&mut buf)
        .map_err(|e| PodError::FailedPrecondition(format!("no randomness for an id: {e}")))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

pub(crate) use cubelet_engine::blocking;

impl PodService {
    /// Builds the service, without a warm pool.
    pub fn new(deps: PodDeps) -> Self {
        Self::with_pool(deps, PoolConfig { size: 0 }, Arc::new(NoopPoolObserver))
    }

    /// Builds the service with a warm pool of `pool.size` sandbox shells
    /// (none for `0`), reporting to `observer`. The pool fills once
    /// [`PodService::start_pool`] is called.
    pub fn with_pool(deps: PodDeps, pool: PoolConfig, observer: Arc<dyn PoolObserver>) -> Self {
        let pool = (pool.size > 0).then(|| Arc::new(Pool::new(pool, observer)));
        Self {
            inner: Arc::new(Inner {
                deps,
                pod_locks: KeyedLocks::default(),
                container_locks: KeyedLocks::default(),
                events: broadcast::channel(EVENT_BUFFER).0,
                pool,
                removals: Removals::default(),
                stats: crate::stats::StatsState::default(),
                sightings: Sightings::default(),
                anchors: crate::anchor::AnchorGate::default(),
                stops: crate::stops::Stops::default(),
                execs: crate::exec_gate::ExecGate::default(),
            }),
        }
    }

    pub(crate) fn deps(&self) -> &PodDeps {
        &self.inner.deps
    }

    pub(crate) fn store(&self) -> &Store {
        &self.inner.deps.store
    }

    pub(crate) fn runtime(&self) -> &dyn Runtime {
        &*self.inner.deps.runtime
    }

    /// The engine the sandbox flows run on.
    pub fn engine(&self) -> &Engine {
        &self.inner.deps.engine
    }

    /// Every lifecycle event from now on. A subscriber that falls behind
    /// loses the oldest ([`broadcast::error::RecvError::Lagged`]).
    pub fn subscribe(&self) -> broadcast::Receiver<PodEvent> {
        self.inner.events.subscribe()
    }

    /// Runs `work` on a task of its own and waits for it: the client giving
    /// up (this future dropped) does not stop it. The pool's refill waits
    /// while it runs and for a quiet spell after (see `pool`): every pod and
    /// container transition goes through here.
    pub(crate) async fn detached<T, F>(&self, what: &'static str, work: F) -> PodResult<T>
    where
        T: Send + 'static,
        F: Future<Output = PodResult<T>> + Send + 'static,
    {
        let busy = self.busy();
        let work = async move {
            let _busy = busy;
            work.await
        };
        tokio::spawn(work.in_current_span())
            .await
            .map_err(|e| PodError::TaskDied {
                what,
                reason: e.to_string(),
            })?
    }

    /// Runs `work()`, a stop in pod `sandbox`; if it has not ended after
    /// `after`, asks the runtime to kill the pod's shim should it answer
    /// nothing (containerd 1.6's deadlocks for good, and then no stop of
    /// the pod would ever return), and goes on waiting for it: the dead
    /// shim's cleanup lets it end. If it then fails (the calls that waited
    /// on the shim fail as it dies), it runs once more, as a retry would.
    pub(crate) async fn watching_shim<T, F, Fut>(
        &self,
        sandbox: &SandboxId,
        after: std::time::Duration,
        work: F,
    ) -> PodResult<T>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = PodResult<T>>,
    {
        let mut first = std::pin::pin!(work());
        tokio::select! {
            r = &mut first => return r,
            () = tokio::time::sleep(after) => {}
        }
        let mut tasks = vec![sandbox.as_str().to_owned()];
        match self.store().list_containers_of(sandbox) {
            Ok(cs) => tasks.extend(cs.into_iter().map(|c| c.id)),
            Err(e) => warn!(error = %e, "listing the pod's containers for its shim check"),
        }
        let killed = match self.runtime().unwedge_shim(sandbox.as_str(), &tasks).await {
            Ok(true) => {
                warn!(
                    sandbox_id = %sandbox,
                    waited = ?after,
                    "the pod's shim answered nothing to a stop: killed it"
                );
                true
            }
            Ok(false) => {
                debug!(sandbox_id = %sandbox, "a slow stop; the pod's shim answers");
                false
            }
            Err(e) => {
                warn!(sandbox_id = %sandbox, error = %e, "checking the pod's shim failed");
                false
            }
        };
        match first.await {
            Err(e) if killed => {
                debug!(error = %e, "the stop failed as the shim died; stopping again");
                work().await
            }
            r => r,
        }
    }

    pub(crate) async fn lock_pod(&self, key: &str) -> KeyedGuard<'_, String> {
        self.inner.pod_locks.lock(&key.to_owned()).await
    }

    pub(crate) async fn lock_container(&self, id: &str) -> KeyedGuard<'_, String> {
        self.inner.container_locks.lock(&id.to_owned()).await
    }

    /// Publishes a lifecycle event; never waits, a no-op without listeners.
    pub(crate) fn emit(&self, container_id: &str, sandbox_id: &SandboxId, kind: PodEventKind) {
        self.emit_all(container_id, sandbox_id, &[kind]);
    }

    /// Publishes the events `kinds` of one transition, in order, with the
    /// pod as the store holds it, read once for all of them (not at all for
    /// a removed pod, which has neither record nor containers left). Never
    /// waits; a no-op without listeners.
    pub(crate) fn emit_all(
        &self,
        container_id: &str,
        sandbox_id: &SandboxId,
        kinds: &[PodEventKind],
    ) {
        let tx = &self.inner.events;
        if tx.receiver_count() == 0 || kinds.is_empty() {
            return;
        }
        let pod_removed =
            container_id == sandbox_id.as_str() && kinds.contains(&PodEventKind::Deleted);
        let (sandbox, containers) = if pod_removed {
            (None, Arc::from(Vec::new()))
        } else {
            let sandbox = self.store().get_sandbox(sandbox_id).unwrap_or_else(|e| {
                warn!(sandbox_id = %sandbox_id, error = %e, "event: read sandbox");
                None
            });
            let containers = self
                .store()
                .list_containers_of(sandbox_id)
                .unwrap_or_else(|e| {
                    warn!(sandbox_id = %sandbox_id, error = %e, "event: read containers");
                    Vec::new()
                });
            (sandbox.map(Arc::new), Arc::from(containers))
        };
        let at = SystemTime::now();
        for &kind in kinds {
            debug!(container_id, event = ?kind, "container event");
            // Fails only when every subscriber left in the meantime.
            let _ = tx.send(PodEvent {
                container_id: container_id.to_owned(),
                sandbox_id: sandbox_id.clone(),
                kind,
                at,
                sandbox: sandbox.clone(),
                containers: Arc::clone(&containers),
            });
        }
    }

    /// Parses a sandbox or container id from a request field.
    pub fn parse_id(field: &str, id: &str) -> PodResult<SandboxId> {
        if id.is_empty() {
            return Err(PodError::invalid(field, "must not be empty"));
        }
        SandboxId::parse(id).ok_or_else(|| {
            PodError::invalid(
                field,
                format!("{id:?} is not a valid id (1-64 of [0-9a-z_-])"),
            )
        })
    }

    /// Looks a sandbox up by a full or unique-prefix id (`field` names the
    /// request field in errors).
    pub fn find_sandbox(&self, field: &str, id: &str) -> PodResult<Option<SandboxRecord>> {
        let parsed = Self::parse_id(field, id)?;
        if let Some(rec) = self.store().get_sandbox(&parsed)? {
            return Ok(Some(rec));
        }
        let mut matches = self
            .store()
            .list_sandboxes()?
            .into_iter()
            .filter(|r| r.id.as_str().starts_with(id));
        match (matches.next(), matches.next()) {
            (Some(rec), None) => Ok(Some(rec)),
            (Some(_), Some(_)) => Err(PodError::invalid(field, format!("{id:?} is ambiguous"))),
            _ => Ok(None),
        }
    }

    /// [`PodService::find_sandbox`], with absence an error.
    pub fn require_sandbox(&self, field: &str, id: &str) -> PodResult<SandboxRecord> {
        self.find_sandbox(field, id)?
            .ok_or_else(|| PodError::NotFound {
                kind: "pod sandbox",
                id: id.to_owned(),
            })
    }

    /// Looks a container up by a full or unique-prefix id.
    pub fn find_container(&self, field: &str, id: &str) -> PodResult<Option<ContainerRecord>> {
        Self::parse_id(field, id)?;
        if let Some(rec) = self.store().get_container(id)? {
            return Ok(Some(rec));
        }
        let mut m = self
            .store()
            .list_containers()?
            .into_iter()
            .filter(|c| c.id.starts_with(id));
        match (m.next(), m.next()) {
            (Some(c), None) => Ok(Some(c)),
            (Some(_), Some(_)) => Err(PodError::invalid(field, format!("{id:?} is ambiguous"))),
            _ => Ok(None),
        }
    }

    /// [`PodService::find_container`] of `container_id`, with absence an error.
    pub fn require_container(&self, id: &str) -> PodResult<ContainerRecord> {
        self.find_container("container_id", id)?
            .ok_or_else(|| PodError::NotFound {
                kind: "container",
                id: id.to_owned(),
            })
    }

    /// Every sandbox record.
    pub fn list_sandboxes(&self) -> PodResult<Vec<Arc<SandboxRecord>>> {
        Ok(self.store().list_sandboxes_shared()?)
    }

    /// Every container record.
    pub fn list_containers(&self) -> PodResult<Vec<Arc<ContainerRecord>>> {
        Ok(self.store().list_containers_shared()?)
    }

    /// The containers of one sandbox.
    pub fn containers_of(&self, sandbox_id: &SandboxId) -> PodResult<Vec<ContainerRecord>> {
        Ok(self.store().list_containers_of(sandbox_id)?)
    }

    /// A container record by its exact id.
    pub fn container(&self, id: &str) -> PodResult<Option<ContainerRecord>> {
        Ok(self.store().get_container(id)?)
    }

    /// A sandbox record by its exact id.
    pub fn sandbox(&self, id: &SandboxId) -> PodResult<Option<SandboxRecord>> {
        Ok(self.store().get_sandbox(id)?)
    }

    /// The flows the journal holds for a sandbox, oldest first.
    pub fn history(&self, id: &SandboxId) -> Vec<cubelet_engine::FlowRecord> {
        self.engine()
            .journal()
            .sandbox_history(id)
            .unwrap_or_default()
    }
}
