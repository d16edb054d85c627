//! Container transitions: create, start, stop, remove, and the calls that
//! read or change a live container (status refresh, exec, resources, logs).

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use cubelet_engine::spec::NamespaceMode;
use cubelet_runtime::container::{ContainerState as RtState, ExecOutput, TaskExit};
use cubelet_runtime::sandbox::anchor::SHIM_GROUP_ANNOTATION;
use cubelet_runtime::spec::{
    ContainerKind, ContainerNamespaces, ContainerSpec, PodNamespacePaths, Resources,
};
use cubelet_runtime::RuntimeError;
use cubelet_store::{ContainerRecord, ContainerState, SandboxState};
use tracing::{info, info_span, warn, Instrument};

use crate::error::{PodError, PodResult};
use crate::service::{blocking, new_id, pod_key, PodEventKind, PodService};
use crate::SHIM_ANSWER_TIMEOUT;

/// A container as the client asked for it. The service completes it with
/// what the pod and the image decide.
#[derive(Debug, Clone, Default)]
pub struct ContainerRequest {
    /// Container name (metadata), unique with `attempt` in its pod.
    pub name: String,
    /// Restart attempt (metadata).
    pub attempt: u32,
    /// Image reference or id, as requested.
    pub image: String,
    /// The image as the user wrote it (kubelet ≥ 1.29 sends it), shown in
    /// statuses when set.
    pub user_specified_image: String,
    /// Log file, relative to the pod's log directory.
    pub log_path: Option<PathBuf>,
    /// A PID namespace other than the pod's, and the target container for
    /// `Target`.
    pub pid: Option<(NamespaceMode, Option<String>)>,
    /// Everything else. The service sets `name`, `image_ref`, `image`,
    /// `sandbox_files`, `sysctls`, `cgroup_parent`, `namespaces`,
    /// `hostname`, `runtime_handler`, `log_path` and `kind` itself.
    pub spec: ContainerSpec,
}

/// What the runtime saw of a container's task: from a status call, or
/// from the stop that ended it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// The task has exited.
    exited: bool,
    /// Its exit code, once exited.
    exit_code: Option<i32>,
    /// When it exited.
    finished_at: Option<SystemTime>,
}

/// What ExecSync gives back.
pub type ExecResult = ExecOutput;

/// The exit code a shell gives a command that could not be started: 127
/// when it is not found, 126 when it cannot be executed; `None` for any
/// other failure.
fn exec_start_exit_code(e: &RuntimeError) -> Option<i32> {
    let RuntimeError::Containerd {
        op: "tasks.start",
        status: source,
    } = e
    else {
        return None;
    };
    let m = source.message();
    if !m.contains("exec failed") {
        return None;
    }
    if m.contains("executable file not found") || m.contains("no such file or directory") {
        Some(127)
    } else if m.contains("permission denied") || m.contains("exec format error") {
        Some(126)
    } else {
        None
    }
}

impl PodService {
    /// CreateContainer: records the container and creates it in the runtime.
    /// The pod's sandbox must be ready; the name (with its attempt) must be
    /// free in the pod. Holds the pod lock throughout, so a pod being
    /// stopped or removed never gains a container.
    pub async fn create_container(
        &self,
        sandbox_id: &str,
        req: ContainerRequest,
    ) -> PodResult<String> {
        self.create_container_checked(sandbox_id, req, |_| Ok::<(), PodError>(()))
            .await
    }

    /// [`PodService::create_container`], with `check` of the request against
    /// the pod's record as read under the pod lock (the caller's rules, e.g.
    /// the CRI edge's user-namespace checks): its error is returned as is,
    /// and nothing is created. The record is read twice, once to find the
    /// pod's lock and once under it.
    pub async fn create_container_checked<E>(
        &self,
        sandbox_id: &str,
        req: ContainerRequest,
        check: impl FnOnce(&cubelet_store::SandboxRecord) -> Result<(), E> + Send + 'static,
    ) -> Result<String, E>
    where
        E: From<PodError> + Send + 'static,
    {
        let sandbox = self.require_sandbox("pod_sandbox_id", sandbox_id)?;
        let this = self.clone();
        let span = info_span!("create_container", sandbox_id = %sandbox.id, container = %req.name);
        self.detached(
            "CreateContainer",
            async move { this.create_container_locked(sandbox, req, check).await }.instrument(span),
        )
        .await?
    }

    /// Under the pod lock: `Ok(Err(e))` when `check` refuses the request.
    async fn create_container_locked<E>(
        &self,
        sandbox: cubelet_store::SandboxRecord,
        req: ContainerRequest,
        check: impl FnOnce(&cubelet_store::SandboxRecord) -> Result<(), E>,
    ) -> PodResult<Result<String, E>> {
        let _pod = self.lock_pod(&pod_key(&sandbox.spec)).await;
        let sandbox = self
            .store()
            .get_sandbox(&sandbox.id)?
            .ok_or_else(|| PodError::NotFound {
                kind: "pod sandbox",
                id: sandbox.id.to_string(),
            })?;
        if let Err(e) = check(&sandbox) {
            return Ok(Err(e));
        }
        if sandbox.state != SandboxState::Ready {
            return Err(PodError::FailedPrecondition(format!(
                "pod sandbox {} is {}, not ready",
                sandbox.id,
                sandbox.state.as_str()
            )));
        }
        let log_path = match &req.log_path {
            None => None,
            Some(rel) => Some(
                sandbox
                    .spec
                    .log_directory
                    .as_ref()
                    .ok_or_else(|| {
                        PodError::invalid(
                            "config.log_path",
                            "set, but the pod sandbox has no log_directory",
                        )
                    })?
                    .join(rel),
            ),
        };
        let image = self
            .runtime()
            .image(&req.image)
            .await?
            .ok_or_else(|| PodError::NotFound {
                kind: "image",
                id: req.image.clone(),
            })?;
        let process = sandbox.process.as_ref().ok_or_else(|| {
            PodError::FailedPrecondition(format!(
                "pod sandbox {} has no namespaces to join",
                sandbox.id
            ))
        })?;
        let pod_namespaces = PodNamespacePaths::of_sandbox(
            process,
            sandbox
                .network
                .as_ref()
                .and_then(|n| n.netns_path.as_deref()),
        );
        let mut options = sandbox.spec.namespaces.clone();
        if let Some((mode, target)) = &req.pid {
            options.pid = *mode;
            options.target_id = target.clone();
        }
        let target_pid = match (&options.pid, &options.target_id) {
            (NamespaceMode::Target, Some(t)) => self.require_container(t)?.pid,
            _ => None,
        };
        let store = self.store();
        if let Some(other) = store
            .list_containers_of(&sandbox.id)?
            .into_iter()
            .find(|c| c.name == req.name && c.attempt == req.attempt)
        {
            return Err(PodError::AlreadyExists {
                kind: "container",
                name: format!("{}_{}", req.name, req.attempt),
                by: other.id,
            });
        }

        let mut spec = ContainerSpec {
            name: req.name.clone(),
            image_ref: req.image.clone(),
            image,
            sandbox_files: sandbox.storage.clone(),
            sysctls: sandbox.spec.sysctls.clone(),
            kind: ContainerKind::Container,
            log_path: log_path.clone(),
            cgroup_parent: sandbox.spec.cgroup_parent.clone(),
            namespaces: ContainerNamespaces::for_pod_container(
                &options,
                &pod_namespaces,
                target_pid,
            )?,
            hostname: sandbox.spec.effective_hostname().to_owned(),
            runtime_handler: sandbox.spec.runtime_handler.clone(),
            ..req.spec
        };
        // The pod's containers share one runc shim, as containerd's CRI
        // runs them in their sandbox's: the shim a pause container, a
        // warm-pool shell's keeper or the pod's first container started,
        // grouped by the sandbox id (other runtimes' shims ignore it).
        spec.annotations.insert(
            SHIM_GROUP_ANNOTATION.to_owned(),
            sandbox.id.as_str().to_owned(),
        );
        let id = new_id()?;
        // The image a status shows: what the user wrote; for a request by
        // image id (kubelet creates by id) the image's first tag, as
        // containerd shows, since `sha256:…` in a pod's status tells a user
        // nothing; else the name requested.
        let by_id =
            req.image.trim_start_matches("sha256:") == spec.image.id.trim_start_matches("sha256:");
        let shown = Some(req.user_specified_image.as_str())
            .filter(|u| !u.is_empty())
            .or_else(|| {
                by_id
                    .then(|| spec.image.repo_tags.first().map(String::as_str))
                    .flatten()
            })
            .unwrap_or(&req.image);
        let mut rec = ContainerRecord::new(&id, sandbox.id.clone(), &req.name, req.attempt, shown);
        rec.image_ref = spec.image.id.clone();
        rec.log_path = log_path;
        rec.labels = spec.labels.clone();
        rec.annotations = spec.annotations.clone();
        rec.config = serde_json::json!({
            "mounts": spec.mounts,
            "image_repo_digest": spec.image.repo_digests.first(),
            "stop_signal": spec.effective_stop_signal(),
        });
        blocking(|| store.put_container(&rec))?;
        if let Err(e) = self.runtime().create(&id, &spec).await {
            // The runtime removes what it made; drop the record too.
            blocking(|| store.delete_container(&id))?;
            return Err(e.into());
        }
        self.emit(&id, &sandbox.id, PodEventKind::Created);
        Ok(Ok(id))
    }

    /// StartContainer: a created container starts once; any other state is
    /// `FailedPrecondition`, checked under the container's lock.
    pub async fn start_container(&self, id: &str) -> PodResult<()> {
        let rec = self.require_container(id)?;
        let this = self.clone();
        let span = info_span!("start_container", container_id = %rec.id);
        self.detached(
            "StartContainer",
            async move { this.start_container_locked(rec.id).await }.instrument(span),
        )
        .await
    }

    async fn start_container_locked(&self, id: String) -> PodResult<()> {
        // Stats anchors wait while starts are in flight.
        let _busy = self.inner.anchors.start();
        let _lock = self.lock_container(&id).await;
        let rec = self
            .store()
            .get_container(&id)?
            .ok_or_else(|| PodError::NotFound {
                kind: "container",
                id: id.clone(),
            })?;
        if rec.state != ContainerState::Created {
            return Err(PodError::FailedPrecondition(format!(
                "container {} is {:?}, not created",
                rec.id, rec.state
            )));
        }
        // Taken before the task starts: a short-lived process can exit (and
        // its exit event be applied) before `start` returns, and CRI needs
        // started_at <= finished_at.
        let start_time = SystemTime::now();
        match self.runtime().start(&rec.id).await {
            Ok(pid) => {
                let mut started = false;
                blocking(|| {
                    self.store().update_container(&rec.id, |c| {
                        // The exit event may already have landed for a short-lived process.
                        if c.state == ContainerState::Created {
                            c.state = ContainerState::Running;
                            started = true;
                        }
                        c.pid = Some(pid);
                        c.started_at.get_or_insert(start_time);
                    })
                })?;
                if started {
                    self.emit(&rec.id, &rec.sandbox_id, PodEventKind::Started);
                }
                // Off this call's path: StartContainer answers first.
                self.anchor_later(&rec.sandbox_id);
                Ok(())
            }
            Err(e) => {
                let message = e.to_string();
                blocking(|| {
                    self.store().update_container(&rec.id, |c| {
                        c.state = ContainerState::Exited;
                        c.exit_code = Some(128);
                        c.reason = Some("StartError".into());
                        c.message = Some(message);
                        c.finished_at = Some(SystemTime::now());
                    })
                })?;
                Err(e.into())
            }
        }
    }

    /// StopContainer: signals a running container, kills it after `timeout`
    /// and records its exit. Gone or already stopped is Ok.
    ///
    /// It answers once the runtime has let go of the exited task, as
    /// containerd's CRI deletes a task in its exit handler before its
    /// StopContainer returns: the shim's exit is paid for here, and the
    /// RemoveContainer a kubelet sends next has only the container's record
    /// and snapshot left. A pod's stop (StopPodSandbox) does not wait.
    pub async fn stop_container(&self, id: &str, timeout: Duration) -> PodResult<()> {
        let Some(rec) = self.find_container("container_id", id)? else {
            return Ok(());
        };
        let this = self.clone();
        let span = info_span!("stop_container", container_id = %rec.id);
        self.detached(
            "StopContainer",
            async move {
                let after = timeout.saturating_add(SHIM_ANSWER_TIMEOUT);
                this.watching_shim(&rec.sandbox_id, after, || async {
                    this.stop_container_in_pod(&rec.id, timeout).await?;
                    this.runtime().settle(&rec.id).await;
                    Ok(())
                })
                .await
            }
            .instrument(span),
        )
        .await
    }

    /// Stops one container under its lock (callers may hold its pod's lock).
    /// A graceful stop already in flight, which holds the lock for up to its
    /// own timeout, is made to kill by this one's deadline if that is
    /// earlier, as containerd's CRI lets the shorter stop win.
    pub(crate) async fn stop_container_in_pod(&self, id: &str, timeout: Duration) -> PodResult<()> {
        self.inner
            .stops
            .hasten(id, tokio::time::Instant::now() + timeout);
        let _lock = self.lock_container(id).await;
        let Some(rec) = self.store().get_container(id)? else {
            return Ok(());
        };
        // A created container's task, made at its create, goes unstarted
        // (the runtime reports no exit for it): nothing of it is left in
        // the pod, and a later start makes it again.
        if rec.state == ContainerState::Created {
            match self.runtime().stop(&rec.id, Duration::ZERO).await {
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
        }
        if rec.state == ContainerState::Running || rec.state == ContainerState::Unknown {
            match self.graceful_stop(&rec.id, timeout).await {
                // The stop saw the exit: no status call needed to learn it.
                Ok(Some(exit)) => {
                    return self
                        .record_exit(
                            &rec.id,
                            Some(Seen {
                                exited: true,
                                exit_code: Some(exit.code),
                                finished_at: exit.at,
                            }),
                        )
                        .await
                }
                Ok(None) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.refresh_exit(&rec.id).await
    }

    /// The runtime's stop of `id` with `timeout`, killed early when a later
    /// stop asks for an earlier deadline (see [`crate::stops`]).
    async fn graceful_stop(
        &self,
        id: &str,
        timeout: Duration,
    ) -> Result<Option<TaskExit>, RuntimeError> {
        if timeout.is_zero() {
            return self.runtime().stop(id, timeout).await;
        }
        let own_deadline = tokio::time::Instant::now() + timeout;
        let (_registered, mut hastened) = self.inner.stops.begin(id, own_deadline);
        let stop = self.runtime().stop(id, timeout);
        tokio::pin!(stop);
        let mut open = true;
        loop {
            let kill_at = *hastened.borrow_and_update();
            // The runtime kills at its own deadline; only an earlier one is
            // ours to act on.
            let early = async {
                if kill_at < own_deadline {
                    tokio::time::sleep_until(kill_at).await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                r = &mut stop => return r,
                changed = hastened.changed(), if open => open = changed.is_ok(),
                () = early => {
                    info!(container_id = %id, "a later stop's shorter timeout passed; killing");
                    // The stop in flight is dropped: the kill ends its wait
                    // anyway, and this call retires the task as it would.
                    return self.runtime().stop(id, Duration::ZERO).await;
                }
            }
        }
    }

    /// Reads the task's exit from the runtime into the record.
    async fn refresh_exit(&self, id: &str) -> PodResult<()> {
        let seen = match self.runtime().status(id).await {
            Ok(s) => Some(Seen {
                exited: s.state == RtState::Exited,
                exit_code: s.exit_code,
                finished_at: s.finished_at,
            }),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e.into()),
        };
        self.record_exit(id, seen).await
    }

    /// Records what the runtime saw of a container's task (`None`: the
    /// runtime has no such container) and emits `Stopped` for an exit.
    async fn record_exit(&self, id: &str, seen: Option<Seen>) -> PodResult<()> {
        let mut stopped = None;
        let updated = blocking(|| {
            self.store().update_container(id, |c| {
                let was_exited = c.state == ContainerState::Exited;
                if let Some(s) = &seen {
                    if s.exited || c.state == ContainerState::Running {
                        if let Some(code) = s.exit_code {
                            c.exit_code = Some(code);
                        }
                        c.finished_at = s.finished_at.or(c.finished_at);
                    }
                    if s.exited {
                        c.state = ContainerState::Exited;
                    }
                } else if c.state == ContainerState::Running {
                    c.state = ContainerState::Exited;
                    c.finished_at.get_or_insert_with(SystemTime::now);
                }
                if !was_exited && c.state == ContainerState::Exited {
                    stopped = Some(c.sandbox_id.clone());
                }
            })
        });
        match updated {
            Ok(_) => {}
            // Removed meanwhile: nothing to refresh.
            Err(cubelet_store::StoreError::ContainerNotFound(_)) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        if let Some(sandbox_id) = stopped {
            self.emit(id, &sandbox_id, PodEventKind::Stopped);
        }
        Ok(())
    }

    /// RemoveContainer: forgets the container and answers; a running one is
    /// forced down and the runtime's objects are removed in the background
    /// (see `removals`). Returns the full id of the container `id` named;
    /// gone is Ok (`None`).
    pub async fn remove_container(&self, id: &str) -> PodResult<Option<String>> {
        let Some(rec) = self.find_container("container_id", id)? else {
            return Ok(None);
        };
        let this = self.clone();
        let span = info_span!("remove_container", container_id = %rec.id);
        let id = rec.id.clone();
        self.detached(
            "RemoveContainer",
            async move { this.forget_container(&rec.id).await }.instrument(span),
        )
        .await?;
        Ok(Some(id))
    }

    /// Deletes one container's record under its lock and hands the
    /// runtime's part of the removal to a task of its own.
    async fn forget_container(&self, id: &str) -> PodResult<()> {
        // A removal forces the container down: a graceful stop in flight
        // kills now rather than holding the removal up.
        self.inner.stops.hasten(id, tokio::time::Instant::now());
        let _lock = self.lock_container(id).await;
        let Some(rec) = self.store().get_container(id)? else {
            return Ok(());
        };
        // Registered first: the GC's containerd collector, which reads the
        // store before it asks, never takes the objects for orphans.
        let pending = self.inner.removals.register(&rec.id, &rec.sandbox_id);
        // Buffered: a crash before it reaches the disk brings the record
        // back with its objects, which reconciliation reads again.
        blocking(|| self.store().delete_container_buffered(&rec.id))?;
        self.stats().forget(&rec.id);
        self.emit(&rec.id, &rec.sandbox_id, PodEventKind::Deleted);
        let this = self.clone();
        // The pool's refill waits for this work as for the call itself.
        let busy = self.busy();
        pending.spawn(async move {
            let _busy = busy;
            if let Err(e) = this.remove_from_runtime(&rec.id).await {
                warn!(container_id = %rec.id, error = %cubelet_engine::chain(&e), "remove container from the runtime; left to the GC");
            }
        });
        Ok(())
    }

    /// Removes one container under its lock (callers may hold its pod's
    /// lock), runtime first: a failure leaves the record for a retry.
    pub(crate) async fn remove_container_in_pod(&self, id: &str) -> PodResult<()> {
        self.inner.stops.hasten(id, tokio::time::Instant::now());
        let _lock = self.lock_container(id).await;
        let Some(rec) = self.store().get_container(id)? else {
            return Ok(());
        };
        self.remove_from_runtime(&rec.id).await?;
        // Buffered: nothing of the container is left to lose (see the
        // store's `delete_container_buffered`).
        blocking(|| self.store().delete_container_buffered(&rec.id))?;
        self.stats().forget(&rec.id);
        self.emit(&rec.id, &rec.sandbox_id, PodEventKind::Deleted);
        Ok(())
    }

    /// Removes everything the runtime holds for a container, forcing a
    /// running one down first, as containerd's CRI does.
    async fn remove_from_runtime(&self, id: &str) -> Result<(), RuntimeError> {
        match self.runtime().stop(id, Duration::ZERO).await {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => {
                warn!(container_id = %id, error = %cubelet_engine::chain(&e), "stop before remove")
            }
        }
        self.runtime().remove(id).await
    }

    /// ContainerStatus: the record, with a running container's exit read
    /// from the runtime first (an exit event may not have arrived yet).
    pub async fn container_status(&self, id: &str) -> PodResult<ContainerRecord> {
        let rec = self.require_container(id)?;
        if rec.state == ContainerState::Running {
            self.refresh_exit(&rec.id).await?;
        }
        self.require_container(&rec.id)
    }

    fn running(&self, id: &str) -> PodResult<ContainerRecord> {
        let rec = self.require_container(id)?;
        if rec.state != ContainerState::Running {
            return Err(PodError::FailedPrecondition(format!(
                "container {} is not running",
                rec.id
            )));
        }
        Ok(rec)
    }

    /// ExecSync: runs `cmd` in a running container. A command that cannot
    /// be started ends as a shell's would (127 not found, 126 not
    /// executable), so a probe fails with the reason instead of the call.
    /// At most [`crate::MAX_EXECS_PER_POD`] run at once in a pod (they
    /// share its shim); the others wait within `timeout` (see
    /// [`crate::exec_gate`]).
    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: &[String],
        timeout: Option<Duration>,
    ) -> PodResult<ExecResult> {
        let rec = self.running(id)?;
        let waited = std::time::Instant::now();
        let _slot = self.inner.execs.acquire(&rec.sandbox_id, timeout).await?;
        // The command's own time is what the wait left of the timeout.
        let left = timeout.map(|t| {
            t.saturating_sub(waited.elapsed())
                .max(Duration::from_millis(1))
        });
        match self.runtime().exec_sync(&rec.id, cmd, left).await {
            Ok(out) => Ok(out),
            Err(e) if matches!(e.kind(), cubelet_engine::StepErrorKind::DeadlineExceeded) => {
                Err(PodError::DeadlineExceeded(format!(
                    "command {cmd:?} timed out after {}s",
                    timeout.map_or(0, |t| t.as_secs())
                )))
            }
            Err(e) => match exec_start_exit_code(&e) {
                Some(exit_code) => Ok(ExecOutput {
                    stdout: Vec::new(),
                    stderr: format!("{e}\n").into_bytes(),
                    exit_code,
                }),
                None => Err(e.into()),
            },
        }
    }

    /// UpdateContainerResources.
    pub async fn update_resources(&self, id: &str, resources: &Resources) -> PodResult<()> {
        let rec = self.require_container(id)?;
        self.runtime().update_resources(&rec.id, resources).await?;
        Ok(())
    }

    /// ReopenContainerLog: only a running container has a log to reopen.
    pub async fn reopen_log(&self, id: &str) -> PodResult<()> {
        let rec = self.running(id)?;
        self.runtime().reopen_log(&rec.id).await?;
        Ok(())
    }

    /// The id of a running container, for streaming (exec, attach).
    pub fn running_container(&self, id: &str) -> PodResult<String> {
        Ok(self.running(id)?.id)
    }

    /// The record of a ready pod sandbox, for streaming (port forward).
    pub fn ready_sandbox(&self, id: &str) -> PodResult<cubelet_store::SandboxRecord> {
        let rec = self.require_sandbox("pod_sandbox_id", id)?;
        if rec.state != SandboxState::Ready {
            return Err(PodError::FailedPrecondition(format!(
                "pod sandbox {} is not ready",
                rec.id
            )));
        }
        Ok(rec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start_error(message: &str) -> RuntimeError {
        RuntimeError::Containerd {
            op: "tasks.start",
            status: tonic_status(message),
        }
    }

    fn tonic_status(message: &str) -> tonic::Status {
        tonic::Status::unknown(message.to_owned())
    }

    #[test]
    fn exec_start_failures_end_as_a_shell_would() {
        let not_found = start_error(
            "OCI runtime exec failed: exec: \"nope\": executable file not found in $PATH",
        );
        assert_eq!(exec_start_exit_code(&not_found), Some(127));
        let denied =
            start_error("OCI runtime exec failed: exec: \"/etc/passwd\": permission denied");
        assert_eq!(exec_start_exit_code(&denied), Some(126));
        assert_eq!(
            exec_start_exit_code(&start_error("exec failed: weird")),
            None
        );
        assert_eq!(exec_start_exit_code(&start_error("unrelated")), None);
        let other = RuntimeError::FailedPrecondition("x".into());
        assert_eq!(exec_start_exit_code(&other), None);
    }
}
