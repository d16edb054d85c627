//! The container's task: start (FIFOs, log copiers), stop with the stop
//! signal, delete, log reattach after a restart and reopen after rotation.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use containerd_client::services::v1::snapshots::MountsRequest;
use containerd_client::services::v1::{
    Container, CreateTaskRequest, DeleteTaskRequest, KillRequest, StartRequest,
    UpdateContainerRequest, WaitRequest,
};
use containerd_client::types::v1::Status as TaskStatus;
use nix::sys::signal::Signal;
use tokio::task::JoinHandle;
use tracing::{debug_span, Instrument};

use super::{
    lock_map, ts_to_system, unix_nanos, ContainerRuntime, Live, Retiring, TaskExit, LABEL_EXIT,
    LABEL_LOG, LABEL_STARTED, LABEL_STDIN, LABEL_STDIN_ONCE, LABEL_STOP_SIGNAL, LABEL_TTY,
};
use crate::client::Containerd;
use crate::error::{cd, RuntimeError};
use crate::io::logs::{copy_stream, LogSink, Stream};
use crate::io::{self as fifo_io, Fifos};

impl ContainerRuntime {
    /// Ends an attach session's input: for a container created with
    /// `stdin_once`, closes its stdin so the process reads end-of-file, as
    /// containerd's CRI does: the agent drops its own writer on the stdin
    /// FIFO, then asks the shim to close its writer (`Tasks.CloseIO`). Other
    /// containers keep their stdin open for the next attach.
    pub async fn attach_stdin_closed(&self, id: &str) -> Result<(), RuntimeError> {
        let container = self.get_container(id).await?;
        if container
            .labels
            .get(LABEL_STDIN_ONCE)
            .is_none_or(|v| v != "true")
        {
            return Ok(());
        }
        let keeper = self
            .lock_live()
            .get_mut(id)
            .and_then(|l| l.stdin_keeper.take());
        drop(keeper);
        self.client
            .tasks()
            .close_io(
                self.client
                    .request(containerd_client::services::v1::CloseIoRequest {
                        container_id: id.to_owned(),
                        exec_id: String::new(),
                        stdin: true,
                    }),
            )
            .await
            .map_err(|s| RuntimeError::containerd("tasks.close_io", s))?;
        Ok(())
    }

    /// Starts container `id`: its task, made now (FIFOs, log copier, task
    /// create) unless [`ContainerRuntime::create`] made it ahead
    /// (`prepare`), then started. Returns the host pid
    /// of the container's init process.
    pub async fn start(&self, id: &str) -> Result<u32, RuntimeError> {
        let prepared = lock_map(&self.prepared).remove(id);
        let pid = match prepared {
            Some(pid) => pid,
            None => self.create_task(id, true).await?,
        };
        // Its exits are the container's from here on (those of a task
        // made before it and deleted unstarted are still not).
        {
            let mut unstarted = lock_map(&self.unstarted);
            if let Some(pids) = unstarted.get_mut(id) {
                pids.retain(|p| *p != pid);
                if pids.is_empty() {
                    unstarted.remove(id);
                }
            }
        }
        // Taken before the start call so that it never follows the exit.
        let started_at = SystemTime::now();
        if let Err(e) = self
            .client
            .tasks()
            .start(self.client.request(StartRequest {
                container_id: id.to_owned(),
                exec_id: String::new(),
            }))
            .instrument(debug_span!("tasks.start"))
            .await
            .map_err(cd("tasks.start"))
        {
            let _ = self.delete_task(id).await;
            return Err(e);
        }
        // Record the start time with the container so status survives restarts.
        let mut labels = HashMap::new();
        labels.insert(LABEL_STARTED.to_owned(), unix_nanos(started_at).to_string());
        let update = Container {
            id: id.to_owned(),
            labels,
            ..Default::default()
        };
        update_container(&self.client, update, format!("labels.{LABEL_STARTED}")).await?;
        Ok(pid)
    }

    /// Makes container `id`'s task ahead of its start (`runc create`: the
    /// process waits, in the container's namespaces and cgroup, for the
    /// start): what [`ContainerRuntime::start`] would do first, so that
    /// StartContainer only starts it. A failure leaves nothing and is the
    /// start's to report: the start makes the task again and fails as it
    /// would have.
    #[tracing::instrument(name = "task.prepare", level = "debug", skip_all)]
    pub(crate) async fn prepare(&self, id: &str) {
        match self.create_task(id, false).await {
            Ok(pid) => {
                lock_map(&self.prepared).insert(id.to_owned(), pid);
            }
            Err(e) => {
                tracing::debug!(container_id = id, error = %e, "making the task ahead failed; the start makes it")
            }
        }
    }

    /// Whether an exit of `id`'s init process `pid` is that of a task made
    /// ahead (`prepare`) and deleted before it started
    /// (by a stop, a removal, or a start after a restart): no exit of the
    /// container's, which never ran.
    pub fn unstarted_exit(&self, id: &str, pid: u32) -> bool {
        lock_map(&self.unstarted)
            .get(id)
            .is_some_and(|pids| pids.contains(&pid))
    }

    /// Creates container `id`'s task (FIFOs, log copier, `tasks.create`),
    /// not started; returns its init process's pid. A task the container
    /// already has that never started (made ahead by a run killed before
    /// the start) is deleted and made again. `unstage`: a failure also
    /// removes the mounts staged for it at create (a start's failure ends
    /// the container; a task made ahead leaves them for the start).
    async fn create_task(&self, id: &str, unstage: bool) -> Result<u32, RuntimeError> {
        // As created by this process: no round trip to read back what it sent.
        let container = self.created_container(id).await?;
        let stdin = container
            .labels
            .get(LABEL_STDIN)
            .is_some_and(|v| v == "true");
        let tty = container.labels.get(LABEL_TTY).is_some_and(|v| v == "true");
        let log_path = container.labels.get(LABEL_LOG).map(PathBuf::from);
        let mounts = self
            .client
            .snapshots()
            .mounts(self.client.request(MountsRequest {
                snapshotter: container.snapshotter.clone(),
                key: container.snapshot_key.clone(),
            }))
            .await
            .map_err(cd("snapshots.mounts"))?
            .into_inner()
            .mounts;
        let mounts = self.userns_rootfs(id, &container, mounts).await?;
        let fifos = Fifos::create(self.io_dir(id), stdin, tty)?;
        let sink = Arc::new(
            LogSink::open(log_path)
                .await?
                .with_rate_limit(self.config.log_rate_limit),
        );
        let keepers = fifos.keep_open()?;
        let (stdin_path, stdout_path, stderr_path) = fifos.wire();
        let options = container.runtime.as_ref().and_then(|r| r.options.clone());
        // The shim containerd may be about to start is this agent's: the
        // ledger says so before it exists (a kill inside tasks.create),
        // and by its pid and start time once it does. A task that joins
        // its pod's running shim (the runc shim's group annotation) starts
        // none, and its shim is not recorded under its id.
        let ledger = self.shim_ledger();
        if let Err(e) = debug_span!("shim_ledger.intend")
            .in_scope(|| cubelet_engine::blocking(|| ledger.intend(id)))
        {
            tracing::warn!(container_id = id, error = %e, "recording the shim intent failed; an orphan shim of this task would not be reaped");
        }
        let request = CreateTaskRequest {
            container_id: id.to_owned(),
            rootfs: mounts,
            stdin: stdin_path,
            stdout: stdout_path,
            stderr: stderr_path,
            terminal: tty,
            options,
            ..Default::default()
        };
        let mut created = self.tasks_create(request.clone()).await;
        if matches!(&created, Err(RuntimeError::Containerd { status, .. }) if status.code() == tonic::Code::AlreadyExists)
        {
            // Made ahead by a run killed before the start: never started
            // (a container starts once), so deleted and made again.
            if let Ok(Some(p)) = self.get_task(id).await {
                if p.status == TaskStatus::Created as i32 {
                    lock_map(&self.unstarted)
                        .entry(id.to_owned())
                        .or_default()
                        .push(p.pid);
                    delete_task_of(&self.client, id).await?;
                    created = self.tasks_create(request).await;
                }
            }
        }
        let created = match created {
            Ok(c) => c,
            Err(e) => {
                let _ = fifo_io::remove_dir(&fifos.dir);
                if unstage {
                    let _ = self.unstage_mounts(id).await;
                }
                return Err(e);
            }
        };
        let namespace = self.client.namespace().to_owned();
        if let Err(e) = debug_span!("shim_ledger.record").in_scope(|| {
            cubelet_engine::blocking(|| ledger.record_task(id, &namespace, created.pid))
        }) {
            tracing::debug!(container_id = id, error = %e, "the shim of the task not recorded; its intent stays");
        }
        // The task's mount namespace holds its own copy of staged mounts:
        // the node's can go, so they keep no volume busy after the task.
        if let Err(e) = self.unstage_mounts(id).await {
            tracing::warn!(container_id = id, error = %e, "unmounting staged mounts failed; removal retries");
        }
        let readers = fifos.open_readers();
        let stdin_keeper = keepers.stdin;
        let readers = match readers {
            Ok(r) => r,
            Err(e) => {
                let _ = self.delete_task(id).await;
                return Err(e);
            }
        };
        let copiers = spawn_copiers(id, readers, &sink);
        self.lock_live().insert(
            id.to_owned(),
            Live {
                sink,
                copiers,
                stdin_keeper,
            },
        );
        // Until the start, an exit of this process is not the container's.
        lock_map(&self.unstarted)
            .entry(id.to_owned())
            .or_default()
            .push(created.pid);
        Ok(created.pid)
    }

    /// `tasks.create`, one more time when the pod's shim it was to join
    /// went away meanwhile (it exits once its last task is deleted, and a
    /// task that joins it in that moment finds it closing).
    async fn tasks_create(
        &self,
        request: CreateTaskRequest,
    ) -> Result<containerd_client::services::v1::CreateTaskResponse, RuntimeError> {
        let mut retried = false;
        loop {
            let result = self
                .client
                .tasks()
                .create(self.client.request(request.clone()))
                .instrument(debug_span!("tasks.create"))
                .await;
            match result {
                Ok(c) => return Ok(c.into_inner()),
                Err(s) if !retried && shim_went_away(&s) => {
                    tracing::debug!(container_id = %request.container_id, error = %s.message(), "the pod's shim went away; creating the task again");
                    retried = true;
                }
                Err(s) => return Err(RuntimeError::containerd("tasks.create", s)),
            }
        }
    }

    /// Resumes log copying for a running container after an agent restart.
    /// Does nothing when the container has no running task or is already
    /// attached.
    pub async fn reattach(&self, id: &str) -> Result<(), RuntimeError> {
        if self.lock_live().contains_key(id) {
            return Ok(());
        }
        let container = self.get_container(id).await?;
        let Some(process) = self.get_task(id).await? else {
            return Ok(());
        };
        if process.status != TaskStatus::Running as i32 {
            return Ok(());
        }
        let tty = container.labels.get(LABEL_TTY).is_some_and(|v| v == "true");
        let fifos = Fifos::paths(self.io_dir(id), false, tty);
        let sink = Arc::new(
            LogSink::open(container.labels.get(LABEL_LOG).map(PathBuf::from))
                .await?
                .with_rate_limit(self.config.log_rate_limit),
        );
        let readers = fifos.open_readers()?;
        let copiers = spawn_copiers(id, readers, &sink);
        self.lock_live().insert(
            id.to_owned(),
            Live {
                sink,
                copiers,
                stdin_keeper: None,
            },
        );
        Ok(())
    }

    /// Stops copying the container's output without touching its task (at
    /// agent shutdown; [`ContainerRuntime::reattach`] resumes it). Output
    /// written meanwhile waits in the FIFO.
    pub async fn detach(&self, id: &str) {
        let live = self.lock_live().remove(id);
        if let Some(live) = live {
            for h in live.copiers {
                h.abort();
                let _ = h.await;
            }
        }
    }

    /// The log sink of a container whose output this agent copies.
    pub(crate) fn log_sink(&self, id: &str) -> Option<Arc<LogSink>> {
        self.lock_live().get(id).map(|l| l.sink.clone())
    }

    /// Closes and reopens the container's log file (after kubelet rotated it).
    pub async fn reopen_log(&self, id: &str) -> Result<(), RuntimeError> {
        let sink = self.lock_live().get(id).map(|l| l.sink.clone());
        match sink {
            Some(s) => s.reopen().await,
            None => Err(RuntimeError::FailedPrecondition(format!(
                "container {id} is not running, its log cannot be reopened"
            ))),
        }
    }

    pub(super) async fn kill(
        &self,
        id: &str,
        exec_id: &str,
        signal: Signal,
    ) -> Result<(), RuntimeError> {
        match self
            .client
            .tasks()
            .kill(self.client.request(KillRequest {
                container_id: id.to_owned(),
                exec_id: exec_id.to_owned(),
                signal: signal as u32,
                all: false,
            }))
            .await
        {
            Ok(_) => Ok(()),
            // Already gone, or already exited: nothing to signal.
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::NotFound | tonic::Code::FailedPrecondition
                ) =>
            {
                Ok(())
            }
            Err(s) => Err(RuntimeError::containerd("tasks.kill", s)),
        }
    }

    pub(super) async fn wait(
        &self,
        id: &str,
        exec_id: &str,
    ) -> Result<(u32, Option<SystemTime>), RuntimeError> {
        let r = self
            .client
            .tasks()
            .wait(self.client.request(WaitRequest {
                container_id: id.to_owned(),
                exec_id: exec_id.to_owned(),
            }))
            .await
            .map_err(cd("tasks.wait"))?
            .into_inner();
        Ok((r.exit_status, ts_to_system(r.exited_at.as_ref())))
    }

    /// Stops the container: its stop signal (image `StopSignal`, else
    /// SIGTERM), up to `timeout` for it to exit, then SIGKILL. Idempotent:
    /// no task or an exited task is success. The exited task is then
    /// retired (see the module documentation); [`ContainerRuntime::status`]
    /// reports its exit meanwhile and after. Returns the exit of the task
    /// it stopped (or found exited), `None` when there was no task: the
    /// caller needs no [`ContainerRuntime::status`] to learn it.
    #[tracing::instrument(name = "runtime.stop", level = "debug", skip_all)]
    pub async fn stop(
        &self,
        id: &str,
        timeout: Duration,
    ) -> Result<Option<TaskExit>, RuntimeError> {
        self.retired(id).await;
        let Some(exit) = self.halt(id, timeout).await? else {
            return Ok(None);
        };
        self.retire(id, exit);
        let (status, at) = exit;
        Ok(Some(TaskExit {
            code: i32::try_from(status).unwrap_or(i32::MAX),
            at,
        }))
    }

    /// [`ContainerRuntime::stop`] without the retirement: returns the exit
    /// (status, time) of the task once it has exited, `None` when there is
    /// no task.
    async fn halt(
        &self,
        id: &str,
        timeout: Duration,
    ) -> Result<Option<(u32, Option<SystemTime>)>, RuntimeError> {
        let Some(process) = self.get_task(id).await? else {
            return Ok(None);
        };
        if process.status == TaskStatus::Created as i32 {
            // Made ahead and never started (by this run or one before it):
            // nothing ran, and its process's end is no exit. Deleted, so no
            // process of it is left in the pod; a later start makes it
            // again.
            lock_map(&self.unstarted)
                .entry(id.to_owned())
                .or_default()
                .push(process.pid);
            lock_map(&self.prepared).remove(id);
            delete_task_of(&self.client, id).await?;
            let live = self.lock_live().remove(id);
            drain_copiers(live).await;
            return Ok(None);
        }
        if process.status == TaskStatus::Stopped as i32 {
            return Ok(Some((
                process.exit_status,
                ts_to_system(process.exited_at.as_ref()),
            )));
        }
        if !timeout.is_zero() {
            let signal = match self.get_container(id).await {
                Ok(c) => c
                    .labels
                    .get(LABEL_STOP_SIGNAL)
                    .map_or(Signal::SIGTERM, |s| parse_signal(s)),
                Err(e) if e.is_not_found() => return Ok(None),
                Err(e) => return Err(e),
            };
            self.kill(id, "", signal).await?;
            // Wait on an exited (undeleted) task returns at once, so an exit
            // between the kill and the wait is not missed.
            match tokio::time::timeout(timeout, self.wait(id, "")).await {
                Ok(r) => return not_found_is_none(r),
                Err(_) => tracing::info!(container = id, ?timeout, "stop timeout passed, killing"),
            }
        }
        self.kill(id, "", Signal::SIGKILL).await?;
        not_found_is_none(self.wait(id, "").await)
    }

    /// Retires the exited task of `id` on a task of its own: records its
    /// exit on the container record (so that [`ContainerRuntime::status`]
    /// reports it once the task is gone, after a restart too), then deletes
    /// the task. Until then `status` reports the exit from memory. A task
    /// whose exit cannot be recorded is left for
    /// [`ContainerRuntime::delete_task`] (its status would be lost with
    /// it), and so is one whose deletion fails.
    fn retire(&self, id: &str, exit: (u32, Option<SystemTime>)) {
        let (done, rx) = tokio::sync::watch::channel(false);
        {
            let mut retiring = lock_map(&self.retiring);
            if retiring.contains_key(id) {
                return;
            }
            retiring.insert(id.to_owned(), Retiring { exit, done: rx });
        }
        let client = self.client.clone();
        let live = Arc::clone(&self.live);
        let retiring = Arc::clone(&self.retiring);
        let gone = Arc::clone(&self.retired);
        let span = debug_span!("retire_task", container = %id);
        let id = id.to_owned();
        let work = async move {
            let retired = match record_exit(&client, &id, exit).await {
                Ok(()) => delete_task_of(&client, &id).await,
                Err(e) => Err(e),
            };
            match retired {
                Ok(()) => {
                    lock_map(&gone).insert(id.clone());
                    let l = lock_map(&live).remove(&id);
                    drain_copiers(l).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "retiring the exited task failed; removal deletes it")
                }
            }
            lock_map(&retiring).remove(&id);
            let _ = done.send(true);
        };
        tokio::spawn(work.instrument(span));
    }

    /// The exit of `id`'s task while it is being retired.
    pub(super) fn retiring_exit(&self, id: &str) -> Option<(u32, Option<SystemTime>)> {
        lock_map(&self.retiring).get(id).map(|r| r.exit)
    }

    /// True once a retirement deleted `id`'s task: it has none.
    pub(super) fn is_retired(&self, id: &str) -> bool {
        lock_map(&self.retired).contains(id)
    }

    /// Forgets that `id`'s task was retired (the container is removed).
    pub(super) fn forget_retired(&self, id: &str) {
        lock_map(&self.retired).remove(id);
    }

    /// Waits until a retirement of `id`'s task, if one runs, is over.
    pub async fn retired(&self, id: &str) {
        let rx = lock_map(&self.retiring).get(id).map(|r| r.done.clone());
        if let Some(mut rx) = rx {
            // An error means the retirement ended without saying so (the
            // runtime shut down): it runs no more either way.
            let _ = rx.wait_for(|done| *done).await;
        }
    }

    /// Deletes the task (after killing it if it still runs) and stops log
    /// copying. Idempotent; waits for a retirement of the task first.
    #[tracing::instrument(name = "task.delete", level = "debug", skip_all)]
    pub async fn delete_task(&self, id: &str) -> Result<(), RuntimeError> {
        self.retired(id).await;
        lock_map(&self.prepared).remove(id);
        if let Some(p) = self.get_task(id).await? {
            if p.status != TaskStatus::Stopped as i32 && p.status != TaskStatus::Created as i32 {
                self.halt(id, Duration::ZERO).await?;
            }
            delete_task_of(&self.client, id).await?;
        }
        let live = self.lock_live().remove(id);
        drain_copiers(live).await;
        Ok(())
    }
}

/// Records the exit of `id`'s task in a label of its container.
async fn record_exit(
    client: &Containerd,
    id: &str,
    (status, at): (u32, Option<SystemTime>),
) -> Result<(), RuntimeError> {
    let value = format!("{status} {}", at.map_or(0, unix_nanos));
    let update = Container {
        id: id.to_owned(),
        labels: HashMap::from([(LABEL_EXIT.to_owned(), value)]),
        ..Default::default()
    };
    update_container(client, update, format!("labels.{LABEL_EXIT}")).await
}

/// Writes the one field `path` of `update` to its containerd container.
pub(super) async fn update_container(
    client: &Containerd,
    update: Container,
    path: String,
) -> Result<(), RuntimeError> {
    client
        .containers()
        .update(client.request(UpdateContainerRequest {
            container: Some(update),
            update_mask: Some(prost_types::FieldMask { paths: vec![path] }),
        }))
        .instrument(debug_span!("containers.update"))
        .await
        .map_err(cd("containers.update"))?;
    Ok(())
}

/// Deletes the task of `id` in containerd. Absent is fine.
async fn delete_task_of(client: &Containerd, id: &str) -> Result<(), RuntimeError> {
    match client
        .tasks()
        .delete(client.request(DeleteTaskRequest {
            container_id: id.to_owned(),
        }))
        .instrument(debug_span!("tasks.delete"))
        .await
    {
        Ok(_) => Ok(()),
        Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
        Err(s) => Err(RuntimeError::containerd("tasks.delete", s)),
    }
}

/// After the task is deleted: the shim closed the FIFOs with it, so give
/// the copiers a moment to write what they still hold, then stop them.
async fn drain_copiers(live: Option<Live>) {
    if let Some(live) = live {
        async {
            for mut h in live.copiers {
                if tokio::time::timeout(Duration::from_secs(2), &mut h)
                    .await
                    .is_err()
                {
                    h.abort();
                }
            }
        }
        .instrument(debug_span!("log_copiers.drain"))
        .await;
    }
}

/// Whether `tasks.create` failed because the shim the task was to join
/// (its pod's, by the runc shim's group annotation) was closing: its
/// connection closed or refused, which a second attempt, starting a new
/// shim, does not meet.
fn shim_went_away(status: &tonic::Status) -> bool {
    let m = status.message();
    status.code() == tonic::Code::Unavailable
        || m.contains("ttrpc: closed")
        || m.contains("connection refused")
        || m.contains("shim has exited")
}

/// A wait's exit, or `None` when the task is gone.
fn not_found_is_none(
    r: Result<(u32, Option<SystemTime>), RuntimeError>,
) -> Result<Option<(u32, Option<SystemTime>)>, RuntimeError> {
    match r {
        Ok(exit) => Ok(Some(exit)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

fn parse_signal(name: &str) -> Signal {
    let upper = name.trim().to_ascii_uppercase();
    if upper.is_empty() {
        return Signal::SIGTERM;
    }
    if let Ok(n) = upper.parse::<i32>() {
        return Signal::try_from(n).unwrap_or(Signal::SIGTERM);
    }
    let full = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    full.parse::<Signal>().unwrap_or(Signal::SIGTERM)
}

fn spawn_copiers(id: &str, readers: fifo_io::Readers, sink: &Arc<LogSink>) -> Vec<JoinHandle<()>> {
    let span = tracing::info_span!("log_copier", container = id);
    let mut v = vec![tokio::spawn(
        copy_stream(readers.stdout, Stream::Stdout, sink.clone()).instrument(span.clone()),
    )];
    if let Some(e) = readers.stderr {
        v.push(tokio::spawn(
            copy_stream(e, Stream::Stderr, sink.clone()).instrument(span),
        ));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_parse_with_and_without_prefix() {
        assert_eq!(parse_signal("SIGQUIT"), Signal::SIGQUIT);
        assert_eq!(parse_signal("usr1"), Signal::SIGUSR1);
        assert_eq!(parse_signal("9"), Signal::SIGKILL);
        assert_eq!(parse_signal(""), Signal::SIGTERM);
        assert_eq!(parse_signal("bogus"), Signal::SIGTERM);
    }
}
