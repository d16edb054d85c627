//! The container record: create (rootfs snapshot, user lookup, OCI spec,
//! containerd container), remove, status and resource updates.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::services::v1::container::Runtime as ContainerRuntimeInfo;
use containerd_client::services::v1::snapshots::{PrepareSnapshotRequest, RemoveSnapshotRequest};
use containerd_client::services::v1::CreateRequest as LeaseCreateRequest;
use containerd_client::services::v1::{
    Container, CreateContainerRequest, DeleteContainerRequest, UpdateTaskRequest,
};
use containerd_client::types::v1::Status as TaskStatus;
use prost_types::Any;
use tracing::{debug_span, Instrument};

use super::{
    json_any, lock_map, ts_to_system, unix_nanos, ContainerRuntime, ContainerState,
    ContainerStatus, KIND_LABEL, LABEL_EXIT, LABEL_HANDLER, LABEL_LOG, LABEL_NAME, LABEL_PREFIX,
    LABEL_STARTED, LABEL_STDIN, LABEL_STDIN_ONCE, LABEL_STOP_SIGNAL, LABEL_TTY, RESOURCES_TYPE_URL,
    SPEC_TYPE_URL,
};
use crate::error::{cd, cd_container, RuntimeError};

/// How long a create lease lives (its `containerd.io/gc.expire`).
const CREATE_LEASE_LIFE: Duration = Duration::from_secs(3600);
/// A create lease with less than this left is replaced, so the snapshots
/// prepared under it have their container record long before it expires.
const CREATE_LEASE_RENEW: Duration = Duration::from_secs(600);
/// A removal relies on a snapshot's create lease only with this much of the
/// lease left.
const LEASE_MARGIN: Duration = Duration::from_secs(60);

/// The directory (under the runtime's state directory) where a container's
/// rootfs is mounted for the moment of its user lookup.
pub const USER_LOOKUP_DIR: &str = "user-lookup";
/// Most of an image's `/etc/passwd` or `/etc/group` read; a larger file is
/// refused (InvalidArgument).
pub const USER_FILE_CAP: u64 = 4 * 1024 * 1024;
/// How long a user lookup (mount, two reads, unmount) may take.
pub const USER_LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
use crate::io as fifo_io;
use crate::spec::{
    build_oci_spec, linux_resources, resolve_user, user_needs_lookup, ContainerKind, ContainerSpec,
    ResolvedUser, Resources, SpecOptions, SupplementalGroupsPolicy, UserRequest,
};

impl ContainerRuntime {
    fn agent_oom_floor(&self) -> Result<Option<i32>, RuntimeError> {
        if !self.config.restrict_oom_score_adj {
            return Ok(None);
        }
        let path = "/proc/self/oom_score_adj";
        let text = std::fs::read_to_string(path).map_err(|source| RuntimeError::Io {
            op: "read",
            path: path.to_owned(),
            source,
        })?;
        Ok(text.trim().parse::<i32>().ok())
    }

    /// Creates container `id` (not started): rootfs snapshot from the image's
    /// chain id, OCI spec, containerd record. Removes what it made on failure.
    ///
    /// With `task_at_create` (the default) a pod's container (not an infra
    /// container nor a stats anchor, which start at once, nor one in a user
    /// namespace of its own, whose rootfs is idmapped at task creation)
    /// also gets its task now, not started (`prepare`):
    /// `runc create` runs here, so that StartContainer only starts it. Its
    /// state stays `Created` (a created task is reported as such), a stop
    /// or a removal before the start deletes the task unstarted, and a
    /// failure to make it is not the create's: the start makes it again
    /// and reports what fails.
    #[tracing::instrument(name = "runtime.create", level = "debug", skip_all)]
    pub async fn create(&self, id: &str, spec: &ContainerSpec) -> Result<(), RuntimeError> {
        // Decided before anything is built: a limit the node cannot enforce
        // is left out (or refused) here, never handed to runc.
        let fitted;
        let spec = match self.cgroups.fit(&spec.resources)? {
            Some(resources) => {
                fitted = ContainerSpec {
                    resources,
                    ..spec.clone()
                };
                &fitted
            }
            None => spec,
        };
        let (handler_name, handler) = self.handler(&spec.runtime_handler)?;
        let handler_name = handler_name.to_owned();
        let runtime_options = Self::runtime_options(handler, self.config.cgroup_driver);
        let runtime_type = handler.runtime_type.clone();
        // A parent the driver refuses fails before anything is made.
        self.config.cgroup_driver.check_parent(
            crate::cgroup::PARENT_FIELD,
            spec.cgroup_parent.as_deref().unwrap_or(""),
        )?;
        if spec.image.chain_id.is_empty() {
            return Err(RuntimeError::InvalidArgument {
                field: "image".to_owned(),
                reason: format!(
                    "image {:?} has no unpacked rootfs (empty chain id)",
                    spec.image_ref
                ),
            });
        }
        // The new snapshot is referenced by nothing until the container
        // record exists: a lease keeps containerd's GC off it meanwhile.
        // The lease is shared (see `lease_for_create`): a lost one is replaced
        // and the prepare tried once more.
        let mut snap = self.prepare_snapshot(id, spec, false).await;
        if matches!(&snap, Err(RuntimeError::Containerd { status: source, .. }) if source.code() == tonic::Code::NotFound)
        {
            snap = self.prepare_snapshot(id, spec, true).await;
        }
        let (snap, lease_expires) = snap?;
        lock_map(&self.leased).insert(id.to_owned(), lease_expires);
        let staged = self.stage_mounts(id, spec).await;
        let res = match &staged {
            Ok(staged) => {
                self.create_record(
                    id,
                    staged.as_ref().unwrap_or(spec),
                    &handler_name,
                    runtime_type,
                    runtime_options,
                    &snap.mounts,
                )
                .await
            }
            Err(_) => Ok(()),
        };
        if let Err(e) = staged.and(res) {
            let _ = self.unstage_mounts(id).await;
            let _ = self.remove_snapshot(id).await;
            lock_map(&self.leased).remove(id);
            return Err(e);
        }
        if self.config.task_at_create
            && spec.kind == ContainerKind::Container
            && spec.namespaces.user.is_none()
        {
            self.prepare(id).await;
        }
        Ok(())
    }

    /// `spec` with its recursive read-only mounts staged on the node (see
    /// [`crate::staged`]); `None` when it has none.
    async fn stage_mounts(
        &self,
        id: &str,
        spec: &ContainerSpec,
    ) -> Result<Option<ContainerSpec>, RuntimeError> {
        let userns = spec.namespaces.user.as_ref().and_then(|u| u.path.clone());
        if !spec
            .mounts
            .iter()
            .any(|m| crate::staged::needs_staging(m, userns.as_deref()))
        {
            return Ok(None);
        }
        let dir = self.staged_root().join(id);
        let mounts = spec.mounts.clone();
        let staged = crate::staged::on_thread(move || {
            crate::staged::stage_blocking(&dir, &mounts, userns.as_deref())
        })
        .await?;
        Ok(Some(ContainerSpec {
            mounts: staged,
            ..spec.clone()
        }))
    }

    /// The rootfs mounts of container `id`, idmapped into its pod's user
    /// namespace when it has one (see [`crate::staged::idmap_rootfs_blocking`]).
    pub(crate) async fn userns_rootfs(
        &self,
        id: &str,
        container: &containerd_client::services::v1::Container,
        mounts: Vec<containerd_client::types::Mount>,
    ) -> Result<Vec<containerd_client::types::Mount>, RuntimeError> {
        let Some(userns) = container
            .spec
            .as_ref()
            .and_then(|s| crate::staged::spec_userns(&s.value))
        else {
            return Ok(mounts);
        };
        let dir = self.staged_root().join(id);
        let staged = crate::staged::on_thread(move || {
            let r = crate::staged::idmap_rootfs_blocking(&dir, mounts, &userns);
            if r.is_err() {
                if let Err(e) = crate::staged::remove_blocking(&dir) {
                    tracing::warn!(dir = %dir.display(), error = %e, "removing half-made idmapped layers failed");
                }
            }
            r
        })
        .await?;
        Ok(staged)
    }

    /// Removes what [`Self::stage_mounts`] staged for container `id`;
    /// nothing staged is fine. Returns how many mounts were removed.
    pub(crate) async fn unstage_mounts(&self, id: &str) -> Result<usize, RuntimeError> {
        let dir = self.staged_root().join(id);
        if !dir.exists() {
            return Ok(0);
        }
        crate::staged::on_thread(move || crate::staged::remove_blocking(&dir)).await
    }

    /// Prepares `id`'s rootfs snapshot under the create lease (a new one
    /// when `renew`).
    async fn prepare_snapshot(
        &self,
        id: &str,
        spec: &ContainerSpec,
        renew: bool,
    ) -> Result<
        (
            containerd_client::services::v1::snapshots::PrepareSnapshotResponse,
            SystemTime,
        ),
        RuntimeError,
    > {
        let (lease, expires) = self.lease_for_create(renew).await?;
        let mut prepare = self.client.request(PrepareSnapshotRequest {
            snapshotter: self.config.snapshotter.clone(),
            key: id.to_owned(),
            parent: spec.image.chain_id.clone(),
            labels: {
                let mut labels = HashMap::from([(LABEL_NAME.to_owned(), spec.name.clone())]);
                crate::reclaim::owner::mark(&mut labels);
                labels
            },
        });
        if let Ok(v) = lease.parse() {
            prepare.metadata_mut().insert("containerd-lease", v);
        }
        self.client
            .snapshots()
            .prepare(prepare)
            .instrument(debug_span!("snapshots.prepare"))
            .await
            .map(|r| (r.into_inner(), expires))
            .map_err(|s| {
                if s.code() == tonic::Code::AlreadyExists {
                    RuntimeError::AlreadyExists {
                        kind: "container",
                        id: id.to_owned(),
                    }
                } else {
                    RuntimeError::containerd("snapshots.prepare", s)
                }
            })
    }

    /// The lease new snapshots are prepared under. One lease serves every
    /// create for most of its hour (it is replaced once less than
    /// [`CREATE_LEASE_RENEW`] is left, or when `renew`), so a create makes
    /// no lease calls of its own: the snapshot is safe from containerd's GC
    /// from its prepare on, and once the container record references it the
    /// lease is not needed. Nothing deletes the lease; containerd's GC does
    /// at its `gc.expire`, and the snapshots it still lists are kept by
    /// their containers or already removed with them. A snapshot prepared
    /// just before a crash is left protected until then, and the agent's GC
    /// removes it sooner (a rootfs snapshot without a container).
    #[tracing::instrument(name = "leases.create", level = "debug", skip_all)]
    async fn lease_for_create(&self, renew: bool) -> Result<(String, SystemTime), RuntimeError> {
        let mut current = self.create_lease.lock().await;
        let now = SystemTime::now();
        if let Some((id, expires)) = current.as_ref() {
            if !renew && *expires > now + CREATE_LEASE_RENEW {
                return Ok((id.clone(), *expires));
            }
        }
        let lease_id = format!("cubelet-create-{}", unix_nanos(now));
        let expires = now + CREATE_LEASE_LIFE;
        self.client
            .leases()
            .create(self.client.request(LeaseCreateRequest {
                id: lease_id.clone(),
                labels: HashMap::from([
                    (
                        "containerd.io/gc.expire".to_owned(),
                        crate::io::logs::rfc3339_nano(expires),
                    ),
                    (
                        crate::reclaim::owner::OWNER_LABEL.to_owned(),
                        crate::reclaim::owner::OWNER_VALUE.to_owned(),
                    ),
                ]),
            }))
            .await
            .map_err(cd("leases.create"))?;
        *current = Some((lease_id.clone(), expires));
        Ok((lease_id, expires))
    }

    async fn create_record(
        &self,
        id: &str,
        spec: &ContainerSpec,
        handler_name: &str,
        runtime_type: String,
        runtime_options: Option<Any>,
        mounts: &[containerd_client::types::Mount],
    ) -> Result<(), RuntimeError> {
        let user_req = spec.effective_user()?;
        let user = if user_needs_lookup(&user_req) {
            let (passwd, group) = self.read_user_files(id, mounts).await?;
            Some(resolve_user(&user_req, &passwd, &group)?)
        } else if let UserRequest::Id {
            uid,
            gid: Some(gid),
        } = user_req
        {
            Some(crate::spec::ResolvedUser {
                uid,
                gid,
                additional_gids: Vec::new(),
            })
        } else {
            None
        };
        let user = match spec.supplemental_groups_policy {
            SupplementalGroupsPolicy::Merge => user,
            // Only what the request names: the image's groups stay out.
            SupplementalGroupsPolicy::Strict => user.map(|u| crate::spec::ResolvedUser {
                additional_gids: Vec::new(),
                ..u
            }),
        };
        let opts = SpecOptions {
            min_oom_score_adj: self.agent_oom_floor()?,
            user,
            cgroup_driver: self.config.cgroup_driver,
        };
        let oci = debug_span!("build_oci_spec").in_scope(|| build_oci_spec(id, spec, &opts))?;
        let mut labels: HashMap<String, String> = spec
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.insert(LABEL_NAME.to_owned(), spec.name.clone());
        labels.insert(LABEL_HANDLER.to_owned(), handler_name.to_owned());
        labels.insert(KIND_LABEL.to_owned(), spec.kind.as_str().to_owned());
        if let Some(p) = &spec.log_path {
            labels.insert(LABEL_LOG.to_owned(), p.display().to_string());
        }
        if let Some(signal) = spec.effective_stop_signal() {
            labels.insert(LABEL_STOP_SIGNAL.to_owned(), signal.to_owned());
        }
        if spec.stdin {
            labels.insert(LABEL_STDIN.to_owned(), "true".to_owned());
        }
        if spec.tty {
            labels.insert(LABEL_TTY.to_owned(), "true".to_owned());
        }
        if spec.stdin && spec.stdin_once {
            labels.insert(LABEL_STDIN_ONCE.to_owned(), "true".to_owned());
        }
        // Last, so no label of the request can take it off.
        crate::reclaim::owner::mark(&mut labels);
        let container = Container {
            id: id.to_owned(),
            labels,
            image: spec.image_ref.clone(),
            runtime: Some(ContainerRuntimeInfo {
                name: runtime_type,
                options: runtime_options,
            }),
            spec: Some(json_any(SPEC_TYPE_URL, "oci spec", &oci)?),
            snapshotter: self.config.snapshotter.clone(),
            snapshot_key: id.to_owned(),
            ..Default::default()
        };
        self.client
            .containers()
            .create(self.client.request(CreateContainerRequest {
                container: Some(container.clone()),
            }))
            .instrument(debug_span!("containers.create"))
            .await
            .map_err(cd_container("containers.create", id))?;
        lock_map(&self.created).insert(id.to_owned(), container);
        Ok(())
    }

    /// Mounts the prepared rootfs read-only for a moment to read
    /// `/etc/passwd` and `/etc/group`, confined to it (see
    /// [`crate::safe_read`]), on a blocking thread under
    /// [`USER_LOOKUP_TIMEOUT`]. The mount is under [`USER_LOOKUP_DIR`],
    /// where the GC unmounts whatever a crash or a timeout left.
    #[tracing::instrument(name = "user_lookup", level = "debug", skip_all)]
    async fn read_user_files(
        &self,
        id: &str,
        mounts: &[containerd_client::types::Mount],
    ) -> Result<(String, String), RuntimeError> {
        let target = self.user_lookup_dir().join(id);
        let mounts = mounts.to_vec();
        lock_map(&self.user_lookups).insert(id.to_owned());
        let lookups = std::sync::Arc::clone(&self.user_lookups);
        let owner = id.to_owned();
        let task = tokio::task::spawn_blocking(move || {
            let out = read_user_files_blocking(&target, &mounts);
            lock_map(&lookups).remove(&owner);
            out
        });
        match tokio::time::timeout(USER_LOOKUP_TIMEOUT, task).await {
            Ok(joined) => joined.map_err(|e| {
                RuntimeError::FailedPrecondition(format!("user lookup task failed: {e}"))
            })?,
            Err(_) => Err(RuntimeError::Timeout {
                op: "reading the image's /etc/passwd and /etc/group",
                id: id.to_owned(),
                timeout: USER_LOOKUP_TIMEOUT,
            }),
        }
    }

    /// Where user lookups mount rootfs: `<state dir>/user-lookup/<id>`.
    pub fn user_lookup_dir(&self) -> PathBuf {
        self.config.state_dir.join(USER_LOOKUP_DIR)
    }

    /// Unmounts and removes every user-lookup mount point no lookup of this
    /// process is using (what a crash or a timed-out lookup left), also in
    /// the directory older versions used (`mnt`). How many it removed.
    pub fn clean_user_lookup_mounts(&self) -> Result<usize, RuntimeError> {
        let mut removed = 0;
        for dir in [self.user_lookup_dir(), self.config.state_dir.join("mnt")] {
            let entries = match std::fs::read_dir(&dir) {
                Ok(rd) => rd,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(RuntimeError::Io {
                        op: "list",
                        path: dir.display().to_string(),
                        source,
                    })
                }
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if lock_map(&self.user_lookups).contains(&name) {
                    continue;
                }
                let path = entry.path();
                // Not a mount point (EINVAL) or already gone: fine.
                let _ = nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH);
                match std::fs::remove_dir(&path) {
                    Ok(()) => {
                        tracing::info!(path = %path.display(), "removed a leftover user-lookup mount point");
                        removed += 1;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "removing a leftover user-lookup mount point failed")
                    }
                }
            }
        }
        Ok(removed)
    }

    /// Deletes the containerd container record (its task must be gone).
    /// Idempotent.
    #[tracing::instrument(name = "containers.delete", level = "debug", skip_all)]
    pub async fn delete_container(&self, id: &str) -> Result<(), RuntimeError> {
        lock_map(&self.created).remove(id);
        match self
            .client
            .containers()
            .delete(
                self.client
                    .request(DeleteContainerRequest { id: id.to_owned() }),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
            Err(s) => Err(RuntimeError::containerd("containers.delete", s)),
        }
    }

    /// Removes snapshot `id` of the agent's snapshotter. Idempotent.
    #[tracing::instrument(name = "snapshots.remove", level = "debug", skip_all)]
    pub(crate) async fn remove_snapshot(&self, id: &str) -> Result<(), RuntimeError> {
        match self
            .client
            .snapshots()
            .remove(self.client.request(RemoveSnapshotRequest {
                snapshotter: self.config.snapshotter.clone(),
                key: id.to_owned(),
            }))
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
            Err(s) => Err(RuntimeError::containerd("snapshots.remove", s)),
        }
    }

    /// Removes everything of container `id`: task (killed if running),
    /// rootfs snapshot, container record, FIFOs. Idempotent.
    ///
    /// The snapshot goes before the record, as containerd's own client does
    /// (`WithSnapshotCleanup`): once the record is gone the snapshot is
    /// unreferenced, and if containerd's GC collects it first, the GC leaves
    /// the child link in the image's parent snapshot behind, which then
    /// refuses an explicit removal ("cannot remove snapshot with child").
    /// A container this process created, whose create lease still has a
    /// while to run, is the exception: the lease holds the snapshot, so the
    /// snapshot and the record are removed at the same time.
    #[tracing::instrument(name = "runtime.remove", level = "debug", skip_all)]
    pub async fn remove(&self, id: &str) -> Result<(), RuntimeError> {
        self.delete_task(id).await?;
        self.unstage_mounts(id).await?;
        let leased = lock_map(&self.leased).remove(id);
        if leased.is_some_and(|expires| expires > SystemTime::now() + LEASE_MARGIN) {
            // Its create lease keeps the snapshot from containerd's GC
            // whatever the order, so both go at once.
            let (snapshot, record) =
                tokio::join!(self.remove_snapshot(id), self.delete_container(id));
            snapshot.and(record)?;
        } else {
            self.remove_snapshot(id).await?;
            self.delete_container(id).await?;
        }
        self.usage_cache().forget(id);
        self.forget_retired(id);
        lock_map(&self.unstarted).remove(id);
        fifo_io::remove_dir(&self.io_dir(id))?;
        let mnt = self.user_lookup_dir().join(id);
        match std::fs::remove_dir(&mnt) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(RuntimeError::Io {
                op: "remove",
                path: mnt.display().to_string(),
                source,
            }),
        }
    }

    /// The identity container `id`'s process starts with, as its OCI spec
    /// says after image defaults: uid, primary gid and every group id of
    /// `additionalGids` (the primary one first). `None` for a container
    /// without a process spec.
    pub async fn process_user(&self, id: &str) -> Result<Option<ResolvedUser>, RuntimeError> {
        let c = self.get_container(id).await?;
        let Some(any) = c.spec else {
            return Ok(None);
        };
        let oci: oci_spec::runtime::Spec =
            serde_json::from_slice(&any.value).map_err(|e| RuntimeError::InvalidArgument {
                field: "spec".to_owned(),
                reason: format!("container {id}: {e}"),
            })?;
        Ok(oci.process().as_ref().map(|p| {
            let u = p.user();
            ResolvedUser {
                uid: u.uid(),
                gid: u.gid(),
                additional_gids: u.additional_gids().clone().unwrap_or_default(),
            }
        }))
    }

    /// Reports the container's state, pid, exit code and times.
    pub async fn status(&self, id: &str) -> Result<ContainerStatus, RuntimeError> {
        let c = self.get_container(id).await?;
        let started_at = c
            .labels
            .get(LABEL_STARTED)
            .and_then(|v| v.parse::<u128>().ok())
            .map(|n| UNIX_EPOCH + Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX)));
        // A task being retired has exited; asking containerd about it would
        // wait for its deletion to finish.
        let retiring = self.retiring_exit(id);
        let task = match retiring {
            Some(_) => None,
            None => self.get_task(id).await?,
        };
        let code = |status: u32| Some(i32::try_from(status).unwrap_or(i32::MAX));
        let (state, pid, exit_code, finished_at) = match (&task, retiring) {
            (_, Some((status, at))) => (ContainerState::Exited, 0, code(status), at),
            // Started and gone: retired by a stop, which recorded its exit.
            (None, None) if started_at.is_some() => {
                let (code, at) = recorded_exit(&c.labels);
                (ContainerState::Exited, 0, code, at)
            }
            (None, None) => (ContainerState::Created, 0, None, None),
            (Some(p), None) => {
                match TaskStatus::try_from(p.status).unwrap_or(TaskStatus::Unknown) {
                    TaskStatus::Created => (ContainerState::Created, p.pid, None, None),
                    TaskStatus::Running => (ContainerState::Running, p.pid, None, None),
                    TaskStatus::Stopped => (
                        ContainerState::Exited,
                        p.pid,
                        code(p.exit_status),
                        ts_to_system(p.exited_at.as_ref()),
                    ),
                    _ => (ContainerState::Unknown, p.pid, None, None),
                }
            }
        };
        let labels = c
            .labels
            .iter()
            .filter(|(k, _)| !k.starts_with(LABEL_PREFIX) && k.as_str() != KIND_LABEL)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Ok(ContainerStatus {
            id: id.to_owned(),
            state,
            pid,
            exit_code,
            created_at: ts_to_system(c.created_at.as_ref()),
            started_at,
            finished_at,
            image_ref: c.image.clone(),
            log_path: c.labels.get(LABEL_LOG).map(PathBuf::from),
            runtime_handler: c.labels.get(LABEL_HANDLER).cloned().unwrap_or_default(),
            labels,
        })
    }
    /// Updates the running task's cgroup limits.
    pub async fn update_resources(
        &self,
        id: &str,
        resources: &Resources,
    ) -> Result<(), RuntimeError> {
        let fitted = self.cgroups.fit(resources)?;
        let update = linux_resources(fitted.as_ref().unwrap_or(resources))?;
        // Record the new limits in the container's spec first, so a later
        // restart of the task (or an inspect) sees them: merged over the
        // limits it had, since an update carries only what changes (kubelet's
        // CPU manager sends just cpuset_cpus), and the device rules kept.
        let container = self.get_container(id).await?;
        let any = container.spec.as_ref().ok_or_else(|| {
            RuntimeError::FailedPrecondition(format!("container {id} has no spec"))
        })?;
        let mut spec: oci_spec::runtime::Spec =
            serde_json::from_slice(&any.value).map_err(|source| RuntimeError::Json {
                what: "oci spec",
                source,
            })?;
        let r = match spec.linux().as_ref().and_then(|l| l.resources().as_ref()) {
            Some(old) => merge_resources(old, &update)?,
            None => update,
        };
        if let Some(linux) = spec.linux_mut() {
            linux.set_resources(Some(r.clone()));
        }
        let update = Container {
            id: id.to_owned(),
            spec: Some(json_any(SPEC_TYPE_URL, "oci spec", &spec)?),
            ..Default::default()
        };
        super::task::update_container(&self.client, update, "spec".to_owned()).await?;
        match self.get_task(id).await? {
            // Running, or made at the create and not started yet (its
            // cgroup is there, and it starts with these limits).
            Some(p)
                if p.status == TaskStatus::Running as i32
                    || p.status == TaskStatus::Created as i32 => {}
            // No task: the spec update is all there is to do.
            _ => return Ok(()),
        }
        self.client
            .tasks()
            .update(self.client.request(UpdateTaskRequest {
                container_id: id.to_owned(),
                resources: Some(json_any(RESOURCES_TYPE_URL, "linux resources", &r)?),
                annotations: HashMap::new(),
            }))
            .await
            .map_err(|s| {
                // A limit below what the container already uses is the
                // container's state, not a runtime failure.
                if s.message().contains("unable to set memory limit") {
                    RuntimeError::FailedPrecondition(format!(
                        "container {id}: {}",
                        s.message().trim()
                    ))
                } else {
                    RuntimeError::containerd("tasks.update", s)
                }
            })?;
        Ok(())
    }
}

/// The exit a retired task left in the container's labels (see
/// `ContainerRuntime::stop`): status and time, each if known.
fn recorded_exit(labels: &HashMap<String, String>) -> (Option<i32>, Option<SystemTime>) {
    let Some(value) = labels.get(LABEL_EXIT) else {
        return (None, None);
    };
    let mut parts = value.split_whitespace();
    let code = parts
        .next()
        .and_then(|c| c.parse::<u32>().ok())
        .map(|c| i32::try_from(c).unwrap_or(i32::MAX));
    let at = parts
        .next()
        .and_then(|n| n.parse::<u64>().ok())
        .filter(|n| *n > 0)
        .map(|n| UNIX_EPOCH + Duration::from_nanos(n));
    (code, at)
}

/// `update` laid over `old`: every limit `update` sets replaces the old
/// one, the rest (device rules included) stays.
fn merge_resources(
    old: &oci_spec::runtime::LinuxResources,
    update: &oci_spec::runtime::LinuxResources,
) -> Result<oci_spec::runtime::LinuxResources, RuntimeError> {
    fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
        match (into, from) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (k, v) in b {
                    match a.get_mut(&k) {
                        Some(slot) => merge(slot, v),
                        None => {
                            a.insert(k, v);
                        }
                    }
                }
            }
            (slot, v) => *slot = v,
        }
    }
    let json = |source| RuntimeError::Json {
        what: "linux resources",
        source,
    };
    let mut merged = serde_json::to_value(old).map_err(json)?;
    merge(&mut merged, serde_json::to_value(update).map_err(json)?);
    serde_json::from_value(merged).map_err(json)
}

fn read_user_files_blocking(
    target: &Path,
    mounts: &[containerd_client::types::Mount],
) -> Result<(String, String), RuntimeError> {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    let io = |op: &'static str, p: &Path| {
        let path = p.display().to_string();
        move |source: std::io::Error| RuntimeError::Io { op, path, source }
    };
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(target)
            .map_err(io("create", target))?;
    }
    let [m] = mounts else {
        return Err(RuntimeError::FailedPrecondition(format!(
            "expected one rootfs mount, containerd returned {}",
            mounts.len()
        )));
    };
    let bind = m.r#type == "bind" || m.options.iter().any(|o| o == "bind" || o == "rbind");
    let data: Vec<&str> = m
        .options
        .iter()
        .map(String::as_str)
        .filter(|o| !matches!(*o, "rw" | "ro" | "bind" | "rbind"))
        .collect();
    let data = data.join(",");
    // Held until the mount is made: the short names of long lowerdirs.
    let (data, _layer_fds) = shorten_lowerdirs(&data)?;
    let res = if bind {
        mount(
            Some(m.source.as_str()),
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
    } else {
        mount(
            Some(m.source.as_str()),
            target,
            Some(m.r#type.as_str()),
            MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            Some(data.as_str()),
        )
    };
    res.map_err(|e| io("mount rootfs", target)(std::io::Error::from(e)))?;
    let out = read_user_files_in(target);
    let unmounted = umount2(target, MntFlags::MNT_DETACH)
        .map_err(|e| io("unmount rootfs", target)(std::io::Error::from(e)));
    let _ = std::fs::remove_dir(target);
    let out = out?;
    unmounted?;
    Ok(out)
}

/// Longest mount(2) data the kernel takes whole: it copies one page, so a
/// longer string is cut and names a directory that does not exist.
const MOUNT_DATA_MAX: usize = 4095;

/// `data` (overlay mount options) as mount(2) takes it: when longer than a
/// page (about 44 layers under containerd's usual root), each `lowerdir`
/// is named by an `O_PATH` descriptor of this process (`/proc/self/fd/N`,
/// about 19 bytes a layer), as containerd shortens them by a working
/// directory; the descriptors are returned to be held until the mount is
/// made. Still too long (over about 200 layers) is FailedPrecondition.
fn shorten_lowerdirs(data: &str) -> Result<(String, Vec<rustix::fd::OwnedFd>), RuntimeError> {
    use rustix::fd::AsRawFd as _;
    use rustix::fs::{openat, Mode, OFlags, CWD};
    if data.len() <= MOUNT_DATA_MAX {
        return Ok((data.to_owned(), Vec::new()));
    }
    let mut fds = Vec::new();
    let mut options = Vec::new();
    for o in data.split(',') {
        let Some(dirs) = o.strip_prefix("lowerdir=") else {
            options.push(o.to_owned());
            continue;
        };
        let mut short = Vec::new();
        for dir in dirs.split(':') {
            let fd = openat(
                CWD,
                dir,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| RuntimeError::Io {
                op: "open layer",
                path: dir.to_owned(),
                source: e.into(),
            })?;
            short.push(format!("/proc/self/fd/{}", fd.as_raw_fd()));
            fds.push(fd);
        }
        options.push(format!("lowerdir={}", short.join(":")));
    }
    let out = options.join(",");
    if out.len() > MOUNT_DATA_MAX {
        return Err(RuntimeError::FailedPrecondition(format!(
            "the image's {} layers make overlay mount options of {} bytes even shortened, \
             past the kernel's {MOUNT_DATA_MAX}",
            fds.len(),
            out.len()
        )));
    }
    Ok((out, fds))
}

/// The `/etc/passwd` and `/etc/group` of the rootfs at `root`, each resolved
/// inside it, a regular file of at most [`USER_FILE_CAP`] bytes; a missing
/// one reads as empty. Anything else is the image's fault: InvalidArgument.
fn read_user_files_in(root: &Path) -> Result<(String, String), RuntimeError> {
    use crate::safe_read::{read_in_root, SafeReadError};
    let read = |name: &str| match read_in_root(root, name, USER_FILE_CAP) {
        Ok(bytes) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
        Err(SafeReadError::NotFound { .. }) => Ok(String::new()),
        Err(e) => Err(RuntimeError::InvalidArgument {
            field: format!("image {name}"),
            reason: cubelet_engine::chain(&e),
        }),
    };
    Ok((read("/etc/passwd")?, read("/etc/group")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 60 layers under a long root: their lowerdir option is past a page,
    /// which mount(2) cuts (the mount fails); shortened, the overlay
    /// mounts and shows the top layer's file over the bottom's.
    #[test]
    fn lowerdirs_past_a_page_are_shortened_and_mount() {
        if !cubelet_testkit::is_root("lowerdirs_past_a_page_are_shortened_and_mount") {
            return;
        }
        cubelet_testkit::on_private_thread(cubelet_testkit::Namespaces::Mount, || {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("x".repeat(60));
            let layers: Vec<PathBuf> = (0..60)
                .map(|i| root.join(format!("snapshots/{i}/fs")))
                .collect();
            for (i, l) in layers.iter().enumerate() {
                std::fs::create_dir_all(l.join("etc")).unwrap();
                std::fs::write(l.join("etc/passwd"), format!("layer {i}\n")).unwrap();
            }
            std::fs::write(layers[0].join("bottom"), "b").unwrap();
            let top_first: Vec<String> = layers
                .iter()
                .rev()
                .map(|l| l.display().to_string())
                .collect();
            let data = format!("lowerdir={}", top_first.join(":"));
            assert!(data.len() > MOUNT_DATA_MAX, "{} bytes", data.len());
            let target = dir.path().join("mnt");
            std::fs::create_dir(&target).unwrap();
            let mount = |data: &str| {
                nix::mount::mount(
                    Some("overlay"),
                    &target,
                    Some("overlay"),
                    nix::mount::MsFlags::MS_RDONLY,
                    Some(data),
                )
            };
            assert!(mount(&data).is_err(), "the kernel took the whole string");
            let (short, fds) = shorten_lowerdirs(&data).unwrap();
            assert_eq!(fds.len(), 60);
            assert!(short.len() <= MOUNT_DATA_MAX, "{} bytes", short.len());
            mount(&short).unwrap();
            drop(fds);
            let passwd = std::fs::read_to_string(target.join("etc/passwd")).unwrap();
            assert_eq!(passwd, "layer 59\n");
            assert_eq!(std::fs::read_to_string(target.join("bottom")).unwrap(), "b");
            nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH).unwrap();
            // Short enough already: unchanged.
            let (same, none) = shorten_lowerdirs("lowerdir=/a:/b").unwrap();
            assert_eq!((same.as_str(), none.len()), ("lowerdir=/a:/b", 0));
        });
    }

    #[test]
    fn a_recorded_exit_reads_back() {
        let labels = |v: &str| HashMap::from([(LABEL_EXIT.to_owned(), v.to_owned())]);
        assert_eq!(
            recorded_exit(&labels("137 1500000000")),
            (Some(137), Some(UNIX_EPOCH + Duration::from_millis(1500)))
        );
        assert_eq!(recorded_exit(&labels("7 0")), (Some(7), None));
        assert_eq!(recorded_exit(&labels("junk")), (None, None));
        assert_eq!(recorded_exit(&HashMap::new()), (None, None));
    }

    /// The attacks of issue 30 on the user lookup, each an image rootfs:
    /// `/etc/passwd` a symlink to `/dev/zero` (the old code read without
    /// end), a FIFO (it blocked for ever), `/etc -> /etc` (it read the
    /// host's files); each answers at once, with InvalidArgument or the
    /// image's own (here: no) content, never the host's.
    #[test]
    fn the_user_lookup_stays_in_the_rootfs_and_reads_only_regular_files() {
        let run = |root: &Path| {
            let root = root.to_owned();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(read_user_files_in(&root));
            });
            rx.recv_timeout(Duration::from_secs(10))
                .expect("the user lookup answers within 10 s")
        };
        let zero = tempfile::tempdir().unwrap();
        std::fs::create_dir(zero.path().join("etc")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", zero.path().join("etc/passwd")).unwrap();
        // /dev/zero of the image (absent): no passwd, never the host's zero.
        assert_eq!(run(zero.path()).unwrap(), (String::new(), String::new()));
        std::fs::create_dir(zero.path().join("dev")).unwrap();
        // A device node of the image itself (root may make one) is refused
        // by its type, or by the open where the mount is nodev.
        let made = nix::sys::stat::mknod(
            &zero.path().join("dev/zero"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(1, 5),
        );
        assert!(
            made.is_err()
                || matches!(
                    run(zero.path()),
                    Err(RuntimeError::InvalidArgument { field, .. }) if field == "image /etc/passwd"
                )
        );

        let fifo = tempfile::tempdir().unwrap();
        std::fs::create_dir(fifo.path().join("etc")).unwrap();
        std::fs::write(
            fifo.path().join("etc/passwd"),
            "app:x:1000:1000::/:/bin/sh\n",
        )
        .unwrap();
        nix::unistd::mkfifo(
            &fifo.path().join("etc/group"),
            nix::sys::stat::Mode::S_IRWXU,
        )
        .unwrap();
        let err = run(fifo.path()).unwrap_err();
        assert!(
            matches!(&err, RuntimeError::InvalidArgument { field, reason } if field == "image /etc/group" && reason.contains("fifo")),
            "{err}"
        );

        let host = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc", host.path().join("etc")).unwrap();
        let got = run(host.path());
        assert!(
            matches!(&got, Err(RuntimeError::InvalidArgument { .. })),
            "the host's /etc is never read: {got:?}"
        );

        let big = tempfile::tempdir().unwrap();
        std::fs::create_dir(big.path().join("etc")).unwrap();
        let f = std::fs::File::create(big.path().join("etc/passwd")).unwrap();
        f.set_len(USER_FILE_CAP + 1).unwrap();
        assert!(matches!(
            run(big.path()),
            Err(RuntimeError::InvalidArgument { .. })
        ));

        let good = tempfile::tempdir().unwrap();
        std::fs::create_dir(good.path().join("etc")).unwrap();
        std::fs::write(
            good.path().join("etc/passwd"),
            "app:x:1000:1000::/:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(good.path().join("etc/group"), "app:x:1000:\n").unwrap();
        assert_eq!(
            run(good.path()).unwrap(),
            (
                "app:x:1000:1000::/:/bin/sh\n".to_owned(),
                "app:x:1000:\n".to_owned()
            )
        );
    }
}
