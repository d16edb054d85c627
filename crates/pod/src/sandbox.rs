//! Pod sandbox transitions: run (the `create` flow), stop (`destroy`),
//! remove (`cleanup`), and the GC's work list.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use cubelet_engine::{chain, EngineError, FlowContext, FlowKind, SandboxId, SandboxSpec};
use cubelet_runtime::RuntimeError;
use cubelet_store::{SandboxRecord, SandboxState};
use tracing::{info, info_span, warn, Instrument};

use crate::error::{PodError, PodResult};
use crate::service::{blocking, new_id, pod_key, PodEventKind, PodService};
use crate::SHIM_ANSWER_TIMEOUT;

impl PodService {
    /// RunPodSandbox: returns the id of the pod's ready sandbox, building it
    /// if there is none. A retry for the same pod (namespace, name, uid,
    /// attempt) joins the first call's sandbox; another uid under the same
    /// name is `AlreadyExists`. The engine admits the `create` flow before
    /// anything is recorded: a rejected call writes nothing.
    pub async fn run_sandbox(&self, spec: SandboxSpec) -> PodResult<SandboxId> {
        let this = self.clone();
        let span = info_span!("run_pod_sandbox", pod = %format!("{}/{}", spec.namespace, spec.name), pod_uid = %spec.uid);
        self.detached(
            "RunPodSandbox",
            async move { this.run_sandbox_locked(spec).await }.instrument(span),
        )
        .await
    }

    async fn run_sandbox_locked(&self, spec: SandboxSpec) -> PodResult<SandboxId> {
        // A parent the node's cgroup driver refuses fails here, before any
        // step, naming the field (runc would fail at the first container).
        if let Some(parent) = spec.cgroup_parent.as_deref() {
            self.runtime()
                .check_cgroup_parent(parent)
                .map_err(|e| match e {
                    RuntimeError::InvalidArgument { field, reason } => {
                        PodError::invalid(field, reason)
                    }
                    e => PodError::Runtime(e),
                })?;
        }
        let key = pod_key(&spec);
        let _pod = self.lock_pod(&key).await;
        let store = self.store();
        if let Some(rec) =
            store.find_sandbox_by_pod(&spec.namespace, &spec.name, &spec.uid, spec.attempt)?
        {
            if rec.state != SandboxState::NeedsCleanup {
                return Ok(rec.id);
            }
        }
        if let Some(other) =
            store.find_sandbox_by_name(&spec.namespace, &spec.name, spec.attempt)?
        {
            if other.spec.uid != spec.uid && other.state != SandboxState::NeedsCleanup {
                return Err(PodError::AlreadyExists {
                    kind: "pod sandbox",
                    name: format!("{}_{}_{}", spec.name, spec.namespace, spec.attempt),
                    by: other.id.to_string(),
                });
            }
        }

        let admission = self.engine().admit_waiting(FlowKind::Create).await?;
        // A ready shell that fits gives the pod its id and everything that
        // does not depend on the pod; otherwise the cold path.
        let shell = self.claim_shell(&spec);
        let id = match &shell {
            Some(shell) => shell.id.clone(),
            None => SandboxId::new_unchecked(new_id()?),
        };
        let spec = Arc::new(spec);
        // Recorded before anything is built, so a crash leaves a record that
        // reconciliation finds next to the journal's open flow. A claimed
        // shell's record becomes the sandbox's in the same write. Both are
        // buffered: the flow's first journal write makes them durable before
        // any step acts, except for a claim whose steps act only inside the
        // shell, where a crash before `Ready` may lose all three and leave
        // the shell's record, and the restart destroys the shell whole.
        let rec = SandboxRecord::new(id.clone(), (*spec).clone());
        let recorded = match &shell {
            Some(_) => blocking(|| store.claim_shell(&rec)),
            None => blocking(|| store.put_sandbox_buffered(&rec)),
        };
        if let Err(e) = recorded {
            if shell.is_some() {
                // Its record is still a shell's: destroy it, never reuse it.
                self.discard_shell(&id).await;
            }
            return Err(e.into());
        }
        // The `Ready` write below is durable and makes the flow's settling
        // write durable with it.
        let mut ctx = FlowContext::new(id.clone(), Arc::clone(&spec))
            .with_failover(true)
            .with_caller_commit(true)
            .with_cancel(self.deps().shutdown.child_token());
        if let Some(shell) = shell {
            ctx = ctx.with_shell(shell.outputs);
        }
        let ctx = Arc::new(ctx);
        match admission.run(Arc::clone(&ctx)).await {
            Ok(()) => {
                let out = ctx.outputs();
                blocking(|| {
                    store.update_sandbox(&id, |rec| {
                        rec.state = SandboxState::Ready;
                        rec.network = out.network;
                        rec.storage = out.storage;
                        rec.process = out.process;
                    })
                })?;
                info!(sandbox_id = %id, pod = %key, "pod sandbox ready");
                self.emit_all(
                    id.as_str(),
                    &id,
                    &[PodEventKind::Created, PodEventKind::Started],
                );
                Ok(id)
            }
            Err(err) => {
                self.after_failed_create(&id, &spec, &err).await;
                Err(err.into())
            }
        }
    }

    /// After a failed create: after a clean rollback, `cleanup` removes the
    /// files `destroy` keeps and the record goes; otherwise the record stays
    /// as `NeedsCleanup` for the GC.
    async fn after_failed_create(
        &self,
        id: &SandboxId,
        spec: &Arc<SandboxSpec>,
        err: &EngineError,
    ) {
        let store = self.store();
        if !err.rollback_failed() {
            let ctx = Arc::new(FlowContext::new(id.clone(), Arc::clone(spec)));
            match self.engine().run(FlowKind::Cleanup, ctx).await {
                Ok(()) => return self.forget(id),
                Err(e) => {
                    warn!(sandbox_id = %id, error = %chain(&e), "cleanup after failed create")
                }
            }
        }
        let message = chain(err);
        if let Err(e) = blocking(|| {
            store.update_sandbox(id, |rec| {
                rec.state = SandboxState::NeedsCleanup;
                rec.last_error = Some(message);
            })
        }) {
            warn!(sandbox_id = %id, error = %chain(&e), "mark sandbox for cleanup");
        }
    }

    /// Drops a sandbox's record and its journal entries.
    fn forget(&self, id: &SandboxId) {
        if let Err(e) = blocking(|| self.store().delete_sandbox(id)) {
            warn!(sandbox_id = %id, error = %chain(&e), "delete sandbox record");
        }
        if let Err(e) = blocking(|| self.engine().journal().forget(id)) {
            warn!(sandbox_id = %id, error = %chain(&e), "forget journal");
        }
    }

    /// StopPodSandbox: stops the pod's containers, then runs `destroy`. A
    /// sandbox that is gone is stopped (kubelet retries these).
    pub async fn stop_sandbox(&self, id: &str) -> PodResult<()> {
        let Some(rec) = self.find_sandbox("pod_sandbox_id", id)? else {
            return Ok(());
        };
        let this = self.clone();
        let span = info_span!("stop_pod_sandbox", sandbox_id = %rec.id);
        self.detached(
            "StopPodSandbox",
            async move {
                let sandbox = rec.id.clone();
                this.watching_shim(&sandbox, SHIM_ANSWER_TIMEOUT, || {
                    this.stop_sandbox_locked(rec.clone())
                })
                .await
            }
            .instrument(span),
        )
        .await
    }

    async fn stop_sandbox_locked(&self, rec: SandboxRecord) -> PodResult<()> {
        let _pod = self.lock_pod(&pod_key(&rec.spec)).await;
        let Some(rec) = self.store().get_sandbox(&rec.id)? else {
            return Ok(());
        };
        for c in self.store().list_containers_of(&rec.id)? {
            self.stop_container_in_pod(&c.id, Duration::ZERO).await?;
        }
        let ctx = Arc::new(FlowContext::new(rec.id.clone(), Arc::new(rec.spec.clone())));
        // Never beside a stats anchor being made (see `anchor`).
        let _anchor = self.lock_container(rec.id.as_str()).await;
        self.engine().run(FlowKind::Destroy, ctx).await?;
        blocking(|| {
            self.store().update_sandbox(&rec.id, |r| {
                if r.state != SandboxState::NeedsCleanup {
                    r.state = SandboxState::NotReady;
                }
                r.stopped_at.get_or_insert_with(SystemTime::now);
                r.process = None;
            })
        })?;
        self.emit(rec.id.as_str(), &rec.id, PodEventKind::Stopped);
        Ok(())
    }

    /// RemovePodSandbox (and the GC): removes the pod's containers, runs
    /// `cleanup` and forgets the sandbox; returns the ids of the containers
    /// it removed. On failure the record stays as `NeedsCleanup` for the
    /// GC. A sandbox that is gone is removed.
    pub async fn remove_sandbox(&self, id: &str) -> PodResult<Vec<String>> {
        let Some(rec) = self.find_sandbox("pod_sandbox_id", id)? else {
            return Ok(Vec::new());
        };
        let this = self.clone();
        let span = info_span!("remove_pod_sandbox", sandbox_id = %rec.id);
        self.detached(
            "RemovePodSandbox",
            async move { this.remove_sandbox_locked(rec).await }.instrument(span),
        )
        .await
    }

    async fn remove_sandbox_locked(&self, rec: SandboxRecord) -> PodResult<Vec<String>> {
        let _pod = self.lock_pod(&pod_key(&rec.spec)).await;
        let Some(rec) = self.store().get_sandbox(&rec.id)? else {
            return Ok(Vec::new());
        };
        let mut removed = Vec::new();
        for c in self.store().list_containers_of(&rec.id)? {
            self.remove_container_in_pod(&c.id).await?;
            removed.push(c.id);
        }
        // The removals RemoveContainer left running finish first: the pod
        // leaves nothing behind when this answers.
        self.settle_removals(&rec.id).await;
        let ctx = Arc::new(FlowContext::new(rec.id.clone(), Arc::new(rec.spec.clone())));
        let _anchor = self.lock_container(rec.id.as_str()).await;
        if let Err(e) = self.engine().run(FlowKind::Cleanup, ctx).await {
            if !matches!(e, EngineError::Rejected { .. }) {
                let message = chain(&e);
                blocking(|| {
                    self.store().update_sandbox(&rec.id, |r| {
                        r.state = SandboxState::NeedsCleanup;
                        r.cleanup_attempts += 1;
                        r.last_error = Some(message);
                    })
                })?;
            }
            return Err(e.into());
        }
        blocking(|| self.store().delete_sandbox(&rec.id))?;
        self.stats().forget(rec.id.as_str());
        self.emit(rec.id.as_str(), &rec.id, PodEventKind::Deleted);
        blocking(|| self.engine().journal().forget(&rec.id)).map_err(|source| {
            EngineError::Journal {
                flow: FlowKind::Cleanup,
                sandbox_id: rec.id.clone(),
                source,
            }
        })?;
        Ok(removed)
    }

    /// Records that a CRI client (kubelet) was just told about `ids`, in a
    /// ListPodSandbox or PodSandboxStatus answer: it still tracks them, so
    /// the GC leaves them stopped until it removes them.
    pub fn note_seen<'a>(&self, ids: impl IntoIterator<Item = &'a SandboxId>) {
        self.inner.sightings.saw(ids);
    }

    /// The GC's work list: sandboxes left `NeedsCleanup`, and stopped ones
    /// kubelet no longer lists: stopped longer than `ttl` and named in no
    /// ListPodSandbox or PodSandboxStatus answer for `ttl` (as containerd
    /// does: a stopped sandbox stays, with its logs, until kubelet removes
    /// it). Sightings are kept in memory, so after a restart every sandbox
    /// counts as seen at the start.
    pub fn gc_candidates(&self, ttl: Duration) -> PodResult<Vec<SandboxRecord>> {
        let now = SystemTime::now();
        let mono = std::time::Instant::now();
        let all = self.store().list_sandboxes()?;
        let sightings = &self.inner.sightings;
        {
            let ids: std::collections::HashSet<&SandboxId> = all.iter().map(|r| &r.id).collect();
            sightings.retain(|id| ids.contains(id));
        }
        Ok(all
            .into_iter()
            .filter(|r| match r.state {
                SandboxState::NeedsCleanup => true,
                SandboxState::NotReady => {
                    r.stopped_at
                        .and_then(|t| now.duration_since(t).ok())
                        .is_some_and(|age| age >= ttl)
                        && mono.saturating_duration_since(sightings.last_seen(&r.id)) >= ttl
                }
                _ => false,
            })
            .collect())
    }
}
