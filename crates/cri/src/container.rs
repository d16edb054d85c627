//! Container calls: validated here, run by the runtime crate, recorded in the store.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use cubelet_engine::spec::NamespaceMode;
use cubelet_runtime::container::ContainerState as RtState;
use cubelet_runtime::events::{ContainerEvent, ContainerEventKind};
use cubelet_runtime::spec::{
    ContainerKind, ContainerNamespaces, ContainerSpec, DeviceSpec, MountSpec, Propagation,
    SeccompProfile, UserRequest,
};
use cubelet_store::{ContainerRecord, ContainerState, SandboxState};
use k8s_cri::v1 as cri;
use tracing::warn;

use crate::convert::{self, clean_absolute, clean_relative, nanos};
use crate::error::{CriError, CriResult};
use crate::sandbox::new_id;
use crate::service::Cri;

/// The exit code a shell gives a command that could not be started: 127
/// when it is not found, 126 when it cannot be executed; `None` for any
/// other failure.
fn exec_start_exit_code(e: &cubelet_runtime::RuntimeError) -> Option<i32> {
    let cubelet_runtime::RuntimeError::Containerd {
        op: "tasks.start",
        source,
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

fn seccomp(field: &str, p: Option<&cri::SecurityProfile>) -> CriResult<SeccompProfile> {
    let Some(p) = p else {
        return Ok(SeccompProfile::Unconfined);
    };
    match cri::security_profile::ProfileType::try_from(p.profile_type) {
        Ok(cri::security_profile::ProfileType::RuntimeDefault) => {
            Ok(SeccompProfile::RuntimeDefault)
        }
        Ok(cri::security_profile::ProfileType::Unconfined) => Ok(SeccompProfile::Unconfined),
        Ok(cri::security_profile::ProfileType::Localhost) => Ok(SeccompProfile::Localhost(
            clean_absolute(field, &p.localhost_ref)?,
        )),
        Err(_) => Err(CriError::invalid(
            field,
            format!("unknown profile type {}", p.profile_type),
        )),
    }
}

/// The deprecated `seccomp_profile_path` string, still sent by older
/// kubelets and cri-tools: `runtime/default`, `docker/default`,
/// `unconfined`, `localhost/<absolute path>`; empty means unconfined.
fn legacy_seccomp(field: &str, path: &str) -> CriResult<SeccompProfile> {
    match path {
        "" | "unconfined" => Ok(SeccompProfile::Unconfined),
        "runtime/default" | "docker/default" => Ok(SeccompProfile::RuntimeDefault),
        p => match p.strip_prefix("localhost/") {
            Some(file) => Ok(SeccompProfile::Localhost(clean_absolute(field, file)?)),
            None => Err(CriError::invalid(
                field,
                format!("{p:?}: expected runtime/default, unconfined or localhost/<path>"),
            )),
        },
    }
}

fn state(s: ContainerState) -> cri::ContainerState {
    match s {
        ContainerState::Created => cri::ContainerState::ContainerCreated,
        ContainerState::Running => cri::ContainerState::ContainerRunning,
        ContainerState::Exited => cri::ContainerState::ContainerExited,
        ContainerState::Unknown => cri::ContainerState::ContainerUnknown,
    }
}

fn hash(m: &BTreeMap<String, String>) -> std::collections::HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

impl Cri {
    pub(crate) fn find_container(
        &self,
        field: &str,
        id: &str,
    ) -> CriResult<Option<ContainerRecord>> {
        if id.is_empty() {
            return Err(CriError::invalid(field, "must not be empty"));
        }
        convert::sandbox_id(field, id)?;
        let store = &self.deps().store;
        if let Some(rec) = store.get_container(id)? {
            return Ok(Some(rec));
        }
        let mut m = store
            .list_containers()?
            .into_iter()
            .filter(|c| c.id.starts_with(id));
        match (m.next(), m.next()) {
            (Some(c), None) => Ok(Some(c)),
            (Some(_), Some(_)) => Err(CriError::invalid(field, format!("{id:?} is ambiguous"))),
            _ => Ok(None),
        }
    }

    pub(crate) fn require_container(&self, id: &str) -> CriResult<ContainerRecord> {
        self.find_container("container_id", id)?
            .ok_or_else(|| CriError::NotFound {
                kind: "container",
                id: id.to_owned(),
            })
    }

    pub(crate) async fn create_container_impl(
        &self,
        r: cri::CreateContainerRequest,
    ) -> CriResult<cri::CreateContainerResponse> {
        if let Some(config) = &r.config {
            crate::validate::container_config(config)?;
        }
        let sandbox = self
            .find_sandbox("pod_sandbox_id", &r.pod_sandbox_id)?
            .ok_or_else(|| CriError::NotFound {
                kind: "pod sandbox",
                id: r.pod_sandbox_id.clone(),
            })?;
        if sandbox.state != SandboxState::Ready {
            return Err(CriError::FailedPrecondition(format!(
                "pod sandbox {} is {}, not ready",
                sandbox.id,
                sandbox.state.as_str()
            )));
        }
        let config = r
            .config
            .as_ref()
            .ok_or_else(|| CriError::invalid("config", "missing"))?;
        let meta = config
            .metadata
            .as_ref()
            .ok_or_else(|| CriError::invalid("config.metadata", "missing"))?;
        if meta.name.is_empty() || meta.name.contains(['/', '\0']) {
            return Err(CriError::invalid(
                "config.metadata.name",
                format!("{:?} is not a valid name", meta.name),
            ));
        }
        let image_ref = config
            .image
            .as_ref()
            .map(|i| i.image.clone())
            .unwrap_or_default();
        if image_ref.is_empty() {
            return Err(CriError::invalid("config.image.image", "must not be empty"));
        }
        let log_path = if config.log_path.is_empty() {
            None
        } else {
            let rel = clean_relative("config.log_path", &config.log_path)?;
            let dir = sandbox.spec.log_directory.clone().ok_or_else(|| {
                CriError::invalid(
                    "config.log_path",
                    "set, but the pod sandbox has no log_directory",
                )
            })?;
            Some(dir.join(rel))
        };
        if !config.working_dir.is_empty() {
            clean_absolute("config.working_dir", &config.working_dir)?;
        }
        let mut mounts = Vec::with_capacity(config.mounts.len());
        for (i, m) in config.mounts.iter().enumerate() {
            let propagation = match cri::MountPropagation::try_from(m.propagation) {
                Ok(cri::MountPropagation::PropagationPrivate) => Propagation::Private,
                Ok(cri::MountPropagation::PropagationHostToContainer) => {
                    Propagation::HostToContainer
                }
                Ok(cri::MountPropagation::PropagationBidirectional) => Propagation::Bidirectional,
                Err(_) => {
                    return Err(CriError::invalid(
                        format!("config.mounts[{i}].propagation"),
                        "unknown value",
                    ))
                }
            };
            mounts.push(MountSpec {
                host_path: clean_absolute(&format!("config.mounts[{i}].host_path"), &m.host_path)?,
                container_path: clean_absolute(
                    &format!("config.mounts[{i}].container_path"),
                    &m.container_path,
                )?,
                readonly: m.readonly,
                propagation,
            });
        }
        let mut devices = Vec::with_capacity(config.devices.len());
        for (i, d) in config.devices.iter().enumerate() {
            devices.push(DeviceSpec {
                host_path: clean_absolute(&format!("config.devices[{i}].host_path"), &d.host_path)?,
                container_path: clean_absolute(
                    &format!("config.devices[{i}].container_path"),
                    &d.container_path,
                )?,
                permissions: d.permissions.clone(),
            });
        }
        let linux = config.linux.as_ref();
        let sc = linux.and_then(|l| l.security_context.as_ref());
        let user = match sc {
            Some(sc) if !sc.run_as_username.is_empty() => UserRequest::Name {
                name: sc.run_as_username.clone(),
                gid: sc
                    .run_as_group
                    .as_ref()
                    .and_then(|g| u32::try_from(g.value).ok()),
            },
            Some(sc) if sc.run_as_user.is_some() => UserRequest::Id {
                uid: sc
                    .run_as_user
                    .as_ref()
                    .and_then(|u| u32::try_from(u.value).ok())
                    .ok_or_else(|| {
                        CriError::invalid(
                            "config.linux.security_context.run_as_user",
                            "out of range",
                        )
                    })?,
                gid: sc
                    .run_as_group
                    .as_ref()
                    .and_then(|g| u32::try_from(g.value).ok()),
            },
            Some(sc) if sc.run_as_group.is_some() => {
                return Err(CriError::invalid(
                    "config.linux.security_context.run_as_group",
                    "set without run_as_user or run_as_username",
                ))
            }
            _ => UserRequest::Image,
        };
        let image = self
            .deps()
            .images
            .status(&image_ref)
            .await?
            .ok_or_else(|| CriError::NotFound {
                kind: "image",
                id: image_ref.clone(),
            })?;
        let infra_pid = sandbox.process.as_ref().map(|p| p.pid).ok_or_else(|| {
            CriError::FailedPrecondition(format!("pod sandbox {} has no infra process", sandbox.id))
        })?;
        let ns_opts = sc.and_then(|s| s.namespace_options.as_ref());
        let mut options = sandbox.spec.namespaces.clone();
        if let Some(o) = ns_opts {
            // A container may ask for its own PID namespace (or a target's).
            options.pid = match cri::NamespaceMode::try_from(o.pid) {
                Ok(cri::NamespaceMode::Container) => NamespaceMode::Container,
                Ok(cri::NamespaceMode::Node) => NamespaceMode::Node,
                Ok(cri::NamespaceMode::Target) => NamespaceMode::Target,
                _ => NamespaceMode::Pod,
            };
            options.target_id = Some(o.target_id.clone()).filter(|t| !t.is_empty());
        }
        let target_pid = match (&options.pid, &options.target_id) {
            (NamespaceMode::Target, Some(t)) => self.require_container(t)?.pid,
            _ => None,
        };
        let spec = ContainerSpec {
            name: meta.name.clone(),
            image_ref: image_ref.clone(),
            image,
            command: config.command.clone(),
            args: config.args.clone(),
            env: config
                .envs
                .iter()
                .map(|kv| (kv.key.clone(), kv.value.clone()))
                .collect(),
            working_dir: config.working_dir.clone(),
            user,
            supplemental_groups: sc
                .map(|s| {
                    s.supplemental_groups
                        .iter()
                        .filter_map(|g| u32::try_from(*g).ok())
                        .collect()
                })
                .unwrap_or_default(),
            capabilities_add: sc
                .and_then(|s| s.capabilities.as_ref())
                .map(|c| c.add_capabilities.clone())
                .unwrap_or_default(),
            capabilities_drop: sc
                .and_then(|s| s.capabilities.as_ref())
                .map(|c| c.drop_capabilities.clone())
                .unwrap_or_default(),
            privileged: sc.is_some_and(|s| s.privileged),
            readonly_rootfs: sc.is_some_and(|s| s.readonly_rootfs),
            no_new_privs: sc.is_some_and(|s| s.no_new_privs),
            masked_paths: sc.map(|s| s.masked_paths.clone()).filter(|p| !p.is_empty()),
            readonly_paths: sc
                .map(|s| s.readonly_paths.clone())
                .filter(|p| !p.is_empty()),
            seccomp: match sc.and_then(|s| s.seccomp.as_ref()) {
                Some(profile) => seccomp(
                    "config.linux.security_context.seccomp.localhost_ref",
                    Some(profile),
                )?,
                // Deprecated in CRI, still sent by older kubelets and cri-tools.
                #[allow(deprecated)]
                None => legacy_seccomp(
                    "config.linux.security_context.seccomp_profile_path",
                    sc.map_or("", |s| s.seccomp_profile_path.as_str()),
                )?,
            },
            devices,
            mounts,
            sandbox_files: sandbox.storage.clone(),
            resources: convert::container_resources(linux.and_then(|l| l.resources.as_ref())),
            sysctls: sandbox.spec.sysctls.clone(),
            tty: config.tty,
            stdin: config.stdin,
            stdin_once: config.stdin_once,
            kind: ContainerKind::Container,
            labels: config
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            annotations: config
                .annotations
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            log_path: log_path.clone(),
            cgroup_parent: sandbox.spec.cgroup_parent.clone(),
            namespaces: ContainerNamespaces::for_pod_container(&options, infra_pid, target_pid),
            hostname: sandbox.spec.effective_hostname().to_owned(),
            runtime_handler: sandbox.spec.runtime_handler.clone(),
        };

        let _sandbox_lock = self
            .inner
            .container_locks
            .lock(&sandbox.id.as_str().to_owned())
            .await;
        let store = &self.deps().store;
        if let Some(other) = store
            .list_containers_of(&sandbox.id)?
            .into_iter()
            .find(|c| c.name == meta.name && c.attempt == meta.attempt)
        {
            return Err(CriError::AlreadyExists {
                kind: "container",
                name: format!("{}_{}", meta.name, meta.attempt),
                by: other.id,
            });
        }
        let id = new_id()?;
        // The image a status shows: what the user wrote (kubelet ≥ 1.29
        // sends it); for a request by image id (kubelet creates by id) the
        // image's first tag, as containerd shows, since `sha256:…` in a
        // pod's status tells a user nothing; else the name requested.
        let by_id =
            image_ref.trim_start_matches("sha256:") == spec.image.id.trim_start_matches("sha256:");
        let shown = config
            .image
            .as_ref()
            .map(|i| i.user_specified_image.as_str())
            .filter(|u| !u.is_empty())
            .or_else(|| {
                by_id
                    .then(|| spec.image.repo_tags.first().map(String::as_str))
                    .flatten()
            })
            .unwrap_or(&image_ref);
        let mut rec =
            ContainerRecord::new(&id, sandbox.id.clone(), &meta.name, meta.attempt, shown);
        rec.image_ref = spec.image.id.clone();
        rec.log_path = log_path;
        rec.labels = spec.labels.clone();
        rec.annotations = spec.annotations.clone();
        rec.config = serde_json::json!({
            "mounts": spec.mounts,
            "image_repo_digest": spec.image.repo_digests.first(),
        });
        store.put_container(&rec)?;
        if let Err(e) = self.deps().runtime.create(&id, &spec).await {
            // The runtime removes what it made; drop the record too.
            store.delete_container(&id)?;
            return Err(e.into());
        }
        self.emit(
            &id,
            &sandbox.id,
            cri::ContainerEventType::ContainerCreatedEvent,
        );
        Ok(cri::CreateContainerResponse { container_id: id })
    }

    pub(crate) async fn start_container_impl(&self, id: &str) -> CriResult<()> {
        let rec = self.require_container(id)?;
        let _lock = self.inner.container_locks.lock(&rec.id).await;
        if rec.state != ContainerState::Created {
            return Err(CriError::FailedPrecondition(format!(
                "container {} is {:?}, not created",
                rec.id, rec.state
            )));
        }
        // Taken before the task starts: a short-lived process can exit (and
        // its exit event be applied) before `start` returns, and CRI needs
        // started_at <= finished_at.
        let start_time = SystemTime::now();
        match self.deps().runtime.start(&rec.id).await {
            Ok(pid) => {
                let mut started = false;
                self.deps().store.update_container(&rec.id, |c| {
                    // The exit event may already have landed for a short-lived process.
                    if c.state == ContainerState::Created {
                        c.state = ContainerState::Running;
                        started = true;
                    }
                    c.pid = Some(pid);
                    c.started_at.get_or_insert(start_time);
                })?;
                if started {
                    self.emit(
                        &rec.id,
                        &rec.sandbox_id,
                        cri::ContainerEventType::ContainerStartedEvent,
                    );
                }
                Ok(())
            }
            Err(e) => {
                let message = e.to_string();
                self.deps().store.update_container(&rec.id, |c| {
                    c.state = ContainerState::Exited;
                    c.exit_code = Some(128);
                    c.reason = Some("StartError".into());
                    c.message = Some(message);
                    c.finished_at = Some(SystemTime::now());
                })?;
                Err(e.into())
            }
        }
    }

    pub(crate) async fn stop_container_impl(&self, id: &str, timeout: i64) -> CriResult<()> {
        let Some(rec) = self.find_container("container_id", id)? else {
            return Ok(());
        };
        let _lock = self.inner.container_locks.lock(&rec.id).await;
        let timeout = Duration::from_secs(u64::try_from(timeout).unwrap_or(0));
        if rec.state == ContainerState::Running || rec.state == ContainerState::Unknown {
            match self.deps().runtime.stop(&rec.id, timeout).await {
                Ok(()) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.refresh_exit(&rec.id).await
    }

    /// Reads the task's exit from containerd into the record.
    async fn refresh_exit(&self, id: &str) -> CriResult<()> {
        let status = match self.deps().runtime.status(id).await {
            Ok(s) => Some(s),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e.into()),
        };
        let mut stopped = None;
        self.deps().store.update_container(id, |c| {
            let was_exited = c.state == ContainerState::Exited;
            if let Some(s) = &status {
                if s.state == RtState::Exited || c.state == ContainerState::Running {
                    if let Some(code) = s.exit_code {
                        c.exit_code = Some(code);
                    }
                    c.finished_at = s.finished_at.or(c.finished_at);
                }
                if s.state == RtState::Exited {
                    c.state = ContainerState::Exited;
                }
            } else if c.state == ContainerState::Running {
                c.state = ContainerState::Exited;
                c.finished_at.get_or_insert_with(SystemTime::now);
            }
            if !was_exited && c.state == ContainerState::Exited {
                stopped = Some(c.sandbox_id.clone());
            }
        })?;
        if let Some(sandbox_id) = stopped {
            self.emit(
                id,
                &sandbox_id,
                cri::ContainerEventType::ContainerStoppedEvent,
            );
        }
        Ok(())
    }

    pub(crate) async fn remove_container_impl(&self, id: &str) -> CriResult<()> {
        let Some(rec) = self.find_container("container_id", id)? else {
            return Ok(());
        };
        let _lock = self.inner.container_locks.lock(&rec.id).await;
        // Removing a running container forces it down, as containerd's CRI does.
        match self.deps().runtime.stop(&rec.id, Duration::ZERO).await {
            Ok(()) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => {
                warn!(container_id = %rec.id, error = %cubelet_engine::chain(&e), "stop before remove")
            }
        }
        self.deps().runtime.remove(&rec.id).await?;
        self.deps().store.delete_container(&rec.id)?;
        self.emit(
            &rec.id,
            &rec.sandbox_id,
            cri::ContainerEventType::ContainerDeletedEvent,
        );
        Ok(())
    }

    pub(crate) fn list_containers_impl(
        &self,
        r: cri::ListContainersRequest,
    ) -> CriResult<cri::ListContainersResponse> {
        let f = r.filter.unwrap_or_default();
        let containers = self
            .deps()
            .store
            .list_containers()?
            .into_iter()
            .filter(|c| f.id.is_empty() || c.id.starts_with(&f.id))
            .filter(|c| {
                f.pod_sandbox_id.is_empty() || c.sandbox_id.as_str().starts_with(&f.pod_sandbox_id)
            })
            .filter(|c| {
                f.state
                    .as_ref()
                    .is_none_or(|s| state(c.state) as i32 == s.state)
            })
            .filter(|c| convert::labels_match(&f.label_selector, &c.labels))
            .map(|c| cri::Container {
                id: c.id.clone(),
                pod_sandbox_id: c.sandbox_id.to_string(),
                metadata: Some(cri::ContainerMetadata {
                    name: c.name.clone(),
                    attempt: c.attempt,
                }),
                image: Some(cri::ImageSpec {
                    image: c.image.clone(),
                    ..Default::default()
                }),
                image_ref: c.image_ref.clone(),
                state: state(c.state) as i32,
                created_at: nanos(c.created_at),
                labels: hash(&c.labels),
                annotations: hash(&c.annotations),
                image_id: c.image_ref.clone(),
            })
            .collect();
        Ok(cri::ListContainersResponse { containers })
    }

    pub(crate) async fn container_status_impl(
        &self,
        r: cri::ContainerStatusRequest,
    ) -> CriResult<cri::ContainerStatusResponse> {
        let rec = self.require_container(&r.container_id)?;
        if rec.state == ContainerState::Running {
            self.refresh_exit(&rec.id).await?;
        }
        let c = self.require_container(&rec.id)?;
        let (reason, message) = match (c.state, c.exit_code, &c.reason) {
            (_, _, Some(reason)) => (reason.clone(), c.message.clone().unwrap_or_default()),
            (ContainerState::Exited, Some(0), None) => ("Completed".to_owned(), String::new()),
            (ContainerState::Exited, _, None) => ("Error".to_owned(), String::new()),
            _ => (String::new(), String::new()),
        };
        let mounts: Vec<MountSpec> = c
            .config
            .get("mounts")
            .and_then(|m| serde_json::from_value(m.clone()).ok())
            .unwrap_or_default();
        let mut info = std::collections::HashMap::new();
        if r.verbose {
            info.insert(
                "info".to_owned(),
                serde_json::json!({ "pid": c.pid, "sandboxID": c.sandbox_id.as_str(), "record": c })
                    .to_string(),
            );
        }
        Ok(cri::ContainerStatusResponse {
            status: Some(cri::ContainerStatus {
                id: c.id.clone(),
                metadata: Some(cri::ContainerMetadata {
                    name: c.name.clone(),
                    attempt: c.attempt,
                }),
                state: state(c.state) as i32,
                created_at: nanos(c.created_at),
                started_at: c.started_at.map_or(0, nanos),
                finished_at: c.finished_at.map_or(0, nanos),
                exit_code: c.exit_code.unwrap_or(0),
                image: Some(cri::ImageSpec {
                    image: c.image.clone(),
                    ..Default::default()
                }),
                image_ref: c
                    .config
                    .get("image_repo_digest")
                    .and_then(|v| v.as_str())
                    .map_or_else(|| c.image_ref.clone(), str::to_owned),
                reason,
                message,
                labels: hash(&c.labels),
                annotations: hash(&c.annotations),
                mounts: mounts
                    .iter()
                    .map(|m| cri::Mount {
                        container_path: m.container_path.display().to_string(),
                        host_path: m.host_path.display().to_string(),
                        readonly: m.readonly,
                        propagation: match m.propagation {
                            Propagation::Private => cri::MountPropagation::PropagationPrivate,
                            Propagation::HostToContainer => {
                                cri::MountPropagation::PropagationHostToContainer
                            }
                            Propagation::Bidirectional => {
                                cri::MountPropagation::PropagationBidirectional
                            }
                        } as i32,
                        ..Default::default()
                    })
                    .collect(),
                log_path: c
                    .log_path
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                resources: None,
                image_id: c.image_ref.clone(),
                user: None,
            }),
            info,
        })
    }

    pub(crate) async fn exec_sync_impl(
        &self,
        r: cri::ExecSyncRequest,
    ) -> CriResult<cri::ExecSyncResponse> {
        crate::validate::exec_cmd("cmd", &r.cmd)?;
        let rec = self.require_container(&r.container_id)?;
        if rec.state != ContainerState::Running {
            return Err(CriError::FailedPrecondition(format!(
                "container {} is not running",
                rec.id
            )));
        }
        let timeout = u64::try_from(r.timeout)
            .ok()
            .filter(|t| *t > 0)
            .map(Duration::from_secs);
        let out = match self
            .deps()
            .runtime
            .exec_sync(&rec.id, &r.cmd, timeout)
            .await
        {
            Ok(out) => out,
            Err(e) if matches!(e.kind(), cubelet_engine::StepErrorKind::DeadlineExceeded) => {
                return Err(CriError::DeadlineExceeded(format!(
                    "command {:?} timed out after {}s",
                    r.cmd, r.timeout
                )))
            }
            // A command that cannot be started ends as a shell's would, so
            // a probe fails with the reason instead of the call failing.
            Err(e) => match exec_start_exit_code(&e) {
                Some(exit_code) => {
                    return Ok(cri::ExecSyncResponse {
                        stdout: Vec::new(),
                        stderr: format!("{e}\n").into_bytes(),
                        exit_code,
                    })
                }
                None => return Err(e.into()),
            },
        };
        Ok(cri::ExecSyncResponse {
            stdout: out.stdout,
            stderr: out.stderr,
            exit_code: out.exit_code,
        })
    }

    pub(crate) async fn update_container_resources_impl(
        &self,
        r: cri::UpdateContainerResourcesRequest,
    ) -> CriResult<()> {
        if let Some(linux) = &r.linux {
            crate::validate::resources("linux", linux)?;
        }
        let rec = self.require_container(&r.container_id)?;
        let res = convert::container_resources(r.linux.as_ref());
        self.deps().runtime.update_resources(&rec.id, &res).await?;
        Ok(())
    }

    pub(crate) async fn reopen_container_log_impl(&self, id: &str) -> CriResult<()> {
        let rec = self.require_container(id)?;
        if rec.state != ContainerState::Running {
            return Err(CriError::FailedPrecondition(format!(
                "container {} is not running",
                rec.id
            )));
        }
        self.deps().runtime.reopen_log(&rec.id).await?;
        Ok(())
    }

    /// Applies a containerd event to the stored container state.
    pub fn apply_event(&self, event: &ContainerEvent) {
        let store = &self.deps().store;
        // (sandbox, state before) of a container this exit stopped.
        let mut stopped = None;
        let result = match &event.kind {
            ContainerEventKind::Exited {
                code, at, exec_id, ..
            } if exec_id.is_empty() => store.update_container(&event.id, |c| {
                if c.state != ContainerState::Exited {
                    stopped = Some((c.sandbox_id.clone(), c.state));
                }
                c.state = ContainerState::Exited;
                c.exit_code = Some(i32::try_from(*code).unwrap_or(i32::MAX));
                c.finished_at = Some(at.unwrap_or_else(SystemTime::now));
            }),
            ContainerEventKind::Oom => store.update_container(&event.id, |c| {
                c.reason = Some("OOMKilled".into());
            }),
            _ => return,
        };
        if let Some((sandbox_id, before)) = stopped {
            // The exit overtook StartContainer's own update: it did start.
            if before == ContainerState::Created {
                self.emit(
                    &event.id,
                    &sandbox_id,
                    cri::ContainerEventType::ContainerStartedEvent,
                );
            }
            self.emit(
                &event.id,
                &sandbox_id,
                cri::ContainerEventType::ContainerStoppedEvent,
            );
        }
        match result {
            Ok(_) => {}
            // Events for the infra container or for removed containers.
            Err(cubelet_store::StoreError::ContainerNotFound(_)) => {}
            Err(e) => {
                warn!(container_id = %event.id, error = %cubelet_engine::chain(&e), "apply event")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_seccomp_paths() {
        let f = "seccomp_profile_path";
        assert_eq!(legacy_seccomp(f, "").unwrap(), SeccompProfile::Unconfined);
        assert_eq!(
            legacy_seccomp(f, "unconfined").unwrap(),
            SeccompProfile::Unconfined
        );
        assert_eq!(
            legacy_seccomp(f, "docker/default").unwrap(),
            SeccompProfile::RuntimeDefault
        );
        assert_eq!(
            legacy_seccomp(f, "localhost//etc/p.json").unwrap(),
            SeccompProfile::Localhost("/etc/p.json".into())
        );
        let e = legacy_seccomp(f, "/etc/p.json").unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(legacy_seccomp(f, "localhost/relative.json").is_err());
    }
}
