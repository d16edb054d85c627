//! Pod sandbox calls: flows through the engine, state in the store.

use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use cubelet_engine::spec::{NetworkStatus, SandboxProcess, StorageStatus};
use cubelet_engine::{chain, EngineError, FlowContext, FlowKind, SandboxId};
use cubelet_store::{SandboxRecord, SandboxState};
use k8s_cri::v1 as cri;
use tracing::{info, warn};

use crate::convert;
use crate::error::{CriError, CriResult};
use crate::service::Cri;

/// A fresh 64-hex-character id, as containerd makes them.
pub(crate) fn new_id() -> CriResult<String> {
    let mut buf = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .map_err(|e| CriError::FailedPrecondition(format!("read /dev/urandom: {e}")))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

impl Cri {
    fn handler_name(&self, requested: &str) -> CriResult<String> {
        let runtime = &self.deps().runtime;
        let name = if requested.is_empty() {
            runtime.config().default_handler.clone()
        } else {
            requested.to_owned()
        };
        runtime.handler(&name).map_err(|_| {
            CriError::invalid(
                "runtime_handler",
                format!(
                    "unknown runtime handler {name:?} (configured: {})",
                    runtime
                        .config()
                        .handlers
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        })?;
        Ok(name)
    }

    pub(crate) async fn run_pod_sandbox_impl(
        &self,
        r: cri::RunPodSandboxRequest,
    ) -> CriResult<cri::RunPodSandboxResponse> {
        let handler = self.handler_name(&r.runtime_handler)?;
        let spec = convert::sandbox_spec(r.config.as_ref(), &handler)?;
        // The create runs on its own task: if kubelet gives up waiting, the
        // sandbox is still finished (or rolled back) and recorded, so the
        // retry kubelet sends next joins it instead of racing a half-built one.
        let this = self.clone();
        tokio::spawn(async move { this.create_sandbox(spec).await })
            .await
            .map_err(|e| CriError::FailedPrecondition(format!("sandbox create task died: {e}")))?
    }

    async fn create_sandbox(
        &self,
        spec: cubelet_engine::SandboxSpec,
    ) -> CriResult<cri::RunPodSandboxResponse> {
        let store = &self.deps().store;
        // A retry for the same pod waits here for the first call, then finds
        // its sandbox: it joins it rather than creating a second one.
        let key = format!(
            "{}/{}/{}/{}",
            spec.namespace, spec.name, spec.uid, spec.attempt
        );
        let _pod = self.inner.pod_locks.lock(&key).await;
        if let Some(rec) =
            store.find_sandbox_by_pod(&spec.namespace, &spec.name, &spec.uid, spec.attempt)?
        {
            if rec.state != SandboxState::NeedsCleanup {
                return Ok(cri::RunPodSandboxResponse {
                    pod_sandbox_id: rec.id.to_string(),
                });
            }
        }
        if let Some(other) =
            store.find_sandbox_by_name(&spec.namespace, &spec.name, spec.attempt)?
        {
            if other.spec.uid != spec.uid && other.state != SandboxState::NeedsCleanup {
                return Err(CriError::AlreadyExists {
                    kind: "pod sandbox",
                    name: format!("{}_{}_{}", spec.name, spec.namespace, spec.attempt),
                    by: other.id.to_string(),
                });
            }
        }

        let id = SandboxId::new_unchecked(new_id()?);
        let spec = Arc::new(spec);
        // Recorded before anything is built, so a crash leaves a record that
        // reconciliation finds next to the journal's open flow.
        store.put_sandbox(&SandboxRecord::new(id.clone(), (*spec).clone()))?;
        let ctx = Arc::new(FlowContext::new(id.clone(), Arc::clone(&spec)).with_failover(true));
        match self
            .deps()
            .engine
            .run(FlowKind::Create, Arc::clone(&ctx))
            .await
        {
            Ok(()) => {
                store.update_sandbox(&id, |rec| {
                    rec.state = SandboxState::Ready;
                    rec.network = ctx.get::<NetworkStatus>();
                    rec.storage = ctx.get::<StorageStatus>();
                    rec.process = ctx.get::<SandboxProcess>();
                })?;
                info!(sandbox_id = %id, pod = %key, "pod sandbox ready");
                self.emit(
                    id.as_str(),
                    &id,
                    cri::ContainerEventType::ContainerCreatedEvent,
                );
                self.emit(
                    id.as_str(),
                    &id,
                    cri::ContainerEventType::ContainerStartedEvent,
                );
                Ok(cri::RunPodSandboxResponse {
                    pod_sandbox_id: id.to_string(),
                })
            }
            Err(err) => {
                self.after_failed_create(&id, &spec, &err).await;
                Err(err.into())
            }
        }
    }

    /// After a failed create: nothing was built if it was rejected; after a
    /// clean rollback, `cleanup` removes the files `destroy` keeps and the
    /// record goes; otherwise the record stays as `NeedsCleanup` for the GC.
    async fn after_failed_create(
        &self,
        id: &SandboxId,
        spec: &Arc<cubelet_engine::SandboxSpec>,
        err: &EngineError,
    ) {
        let store = &self.deps().store;
        let forget = || {
            if let Err(e) = store.delete_sandbox(id) {
                warn!(sandbox_id = %id, error = %chain(&e), "delete sandbox record");
            }
            if let Err(e) = self.deps().engine.journal().forget(id) {
                warn!(sandbox_id = %id, error = %chain(&e), "forget journal");
            }
        };
        if matches!(err, EngineError::Rejected { .. }) {
            forget();
            return;
        }
        if !err.rollback_failed() {
            let ctx = Arc::new(FlowContext::new(id.clone(), Arc::clone(spec)));
            match self.deps().engine.run(FlowKind::Cleanup, ctx).await {
                Ok(()) => return forget(),
                Err(e) => {
                    warn!(sandbox_id = %id, error = %chain(&e), "cleanup after failed create")
                }
            }
        }
        let message = chain(err);
        if let Err(e) = store.update_sandbox(id, |rec| {
            rec.state = SandboxState::NeedsCleanup;
            rec.last_error = Some(message);
        }) {
            warn!(sandbox_id = %id, error = %chain(&e), "mark sandbox for cleanup");
        }
    }

    /// Looks a sandbox up by a full or unique-prefix id.
    pub(crate) fn find_sandbox(&self, field: &str, id: &str) -> CriResult<Option<SandboxRecord>> {
        let parsed = convert::sandbox_id(field, id)?;
        let store = &self.deps().store;
        if let Some(rec) = store.get_sandbox(&parsed)? {
            return Ok(Some(rec));
        }
        let mut matches = store
            .list_sandboxes()?
            .into_iter()
            .filter(|r| r.id.as_str().starts_with(id));
        match (matches.next(), matches.next()) {
            (Some(rec), None) => Ok(Some(rec)),
            (Some(_), Some(_)) => Err(CriError::invalid(field, format!("{id:?} is ambiguous"))),
            _ => Ok(None),
        }
    }

    fn require_sandbox(&self, field: &str, id: &str) -> CriResult<SandboxRecord> {
        self.find_sandbox(field, id)?
            .ok_or_else(|| CriError::NotFound {
                kind: "pod sandbox",
                id: id.to_owned(),
            })
    }

    pub(crate) async fn stop_pod_sandbox_impl(&self, id: &str) -> CriResult<()> {
        // Stopping a sandbox that is gone succeeds: kubelet retries these.
        let Some(rec) = self.find_sandbox("pod_sandbox_id", id)? else {
            return Ok(());
        };
        for c in self.deps().store.list_containers_of(&rec.id)? {
            self.stop_container_impl(&c.id, 0).await?;
        }
        let ctx = Arc::new(FlowContext::new(rec.id.clone(), Arc::new(rec.spec.clone())));
        self.deps().engine.run(FlowKind::Destroy, ctx).await?;
        self.deps().store.update_sandbox(&rec.id, |r| {
            if r.state != SandboxState::NeedsCleanup {
                r.state = SandboxState::NotReady;
            }
            r.stopped_at.get_or_insert_with(SystemTime::now);
            r.process = None;
        })?;
        self.emit(
            rec.id.as_str(),
            &rec.id,
            cri::ContainerEventType::ContainerStoppedEvent,
        );
        Ok(())
    }

    pub(crate) async fn remove_pod_sandbox_impl(&self, id: &str) -> CriResult<()> {
        let Some(rec) = self.find_sandbox("pod_sandbox_id", id)? else {
            return Ok(());
        };
        for c in self.deps().store.list_containers_of(&rec.id)? {
            self.remove_container_impl(&c.id).await?;
        }
        self.remove_sandbox_record(&rec).await
    }

    /// Runs `cleanup` for a sandbox and forgets it; on failure the record is
    /// kept as `NeedsCleanup` for the GC. Shared with the garbage collector.
    pub async fn remove_sandbox_record(&self, rec: &SandboxRecord) -> CriResult<()> {
        let ctx = Arc::new(FlowContext::new(rec.id.clone(), Arc::new(rec.spec.clone())));
        let store = &self.deps().store;
        if let Err(e) = self.deps().engine.run(FlowKind::Cleanup, ctx).await {
            if !matches!(e, EngineError::Rejected { .. }) {
                let message = chain(&e);
                store.update_sandbox(&rec.id, |r| {
                    r.state = SandboxState::NeedsCleanup;
                    r.cleanup_attempts += 1;
                    r.last_error = Some(message);
                })?;
            }
            return Err(e.into());
        }
        store.delete_sandbox(&rec.id)?;
        self.emit(
            rec.id.as_str(),
            &rec.id,
            cri::ContainerEventType::ContainerDeletedEvent,
        );
        self.deps()
            .engine
            .journal()
            .forget(&rec.id)
            .map_err(|source| EngineError::Journal {
                flow: FlowKind::Cleanup,
                sandbox_id: rec.id.clone(),
                source,
            })?;
        Ok(())
    }

    pub(crate) async fn pod_sandbox_status_impl(
        &self,
        r: cri::PodSandboxStatusRequest,
    ) -> CriResult<cri::PodSandboxStatusResponse> {
        let rec = self.require_sandbox("pod_sandbox_id", &r.pod_sandbox_id)?;
        let status = convert::pod_sandbox_status(&rec);
        let mut info = std::collections::HashMap::new();
        if r.verbose {
            let history = self
                .deps()
                .engine
                .journal()
                .sandbox_history(&rec.id)
                .unwrap_or_default();
            let verbose = serde_json::json!({
                "sandboxID": rec.id.as_str(),
                "state": rec.state.as_str(),
                "pid": rec.process.as_ref().map(|p| p.pid),
                "runtimeHandler": rec.spec.runtime_handler,
                "netnsPath": rec.network.as_ref().and_then(|n| n.netns_path.clone()),
                "sandboxDir": rec.storage.as_ref().map(|s| s.sandbox_dir.clone()),
                "lastError": rec.last_error,
                "cleanupAttempts": rec.cleanup_attempts,
                "config": rec.spec,
                "flows": history.iter().map(|f| serde_json::json!({
                    "flow": f.kind.as_str(),
                    "state": f.state,
                    "error": f.error,
                    "steps": f.steps.iter().map(|s| serde_json::json!({
                        "step": s.step,
                        "stage": s.stage,
                        "durationMs": s.duration.map(|d| d.as_secs_f64() * 1000.0),
                        "error": s.error,
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            });
            info.insert("info".to_owned(), verbose.to_string());
        }
        Ok(cri::PodSandboxStatusResponse {
            status: Some(status),
            info,
            containers_statuses: Vec::new(),
            timestamp: convert::nanos(SystemTime::now()),
        })
    }

    pub(crate) fn list_pod_sandbox_impl(
        &self,
        r: cri::ListPodSandboxRequest,
    ) -> CriResult<cri::ListPodSandboxResponse> {
        let filter = r.filter.unwrap_or_default();
        let items = self
            .deps()
            .store
            .list_sandboxes()?
            .iter()
            .filter(|rec| convert::sandbox_matches(&filter, rec))
            .map(convert::pod_sandbox)
            .collect();
        Ok(cri::ListPodSandboxResponse { items })
    }

    /// Sandboxes stopped longer than `ttl` that kubelet never removed, and
    /// those left `NeedsCleanup`: the GC's work list.
    pub fn gc_candidates(&self, ttl: Duration) -> CriResult<Vec<SandboxRecord>> {
        let now = SystemTime::now();
        Ok(self
            .deps()
            .store
            .list_sandboxes()?
            .into_iter()
            .filter(|r| match r.state {
                SandboxState::NeedsCleanup => true,
                SandboxState::NotReady => r
                    .stopped_at
                    .and_then(|t| now.duration_since(t).ok())
                    .is_some_and(|age| age >= ttl),
                _ => false,
            })
            .collect())
    }
}
