//! CreateContainer's request converted into the pod service's
//! [`ContainerRequest`]: every field checked (naming it on error) before
//! anything is built.

use cubelet_cri_api::v1 as cri;
use cubelet_engine::spec::NamespaceMode;
use cubelet_pod::ContainerRequest;
use cubelet_runtime::spec::{
    ContainerSpec, DeviceSpec, MountSpec, Propagation, SeccompProfile, UserRequest,
};

use super::{clean_absolute, clean_relative, container_resources};
use crate::error::{CriError, CriResult};

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

/// Refuses an image volume (`Mount.image`, `Mount.image_sub_path`): Cubelet
/// does not mount images as volumes, and a mount it left out would start the
/// container without the volume. A sub path that escapes the image is
/// refused as malformed first.
fn image_volume(i: usize, m: &cri::Mount) -> CriResult<()> {
    let sub = &m.image_sub_path;
    if !sub.is_empty() {
        let field = format!("config.mounts[{i}].image_sub_path");
        if sub.starts_with('/') {
            return Err(CriError::invalid(
                field,
                "must be relative to the image's root",
            ));
        }
        if std::path::Path::new(sub)
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(CriError::invalid(field, "must not contain `..`"));
        }
        if sub.contains('\0') {
            return Err(CriError::invalid(field, "must not contain NUL"));
        }
    }
    let image = m.image.as_ref().map_or("", |s| s.image.as_str());
    if !image.is_empty() {
        return Err(CriError::Unimplemented(format!(
            "config.mounts[{i}].image: image volumes ({image}) are not supported by cubelet"
        )));
    }
    if !sub.is_empty() {
        return Err(CriError::invalid(
            format!("config.mounts[{i}].image_sub_path"),
            "set without config.mounts[].image (and image volumes are not supported by cubelet)",
        ));
    }
    Ok(())
}

/// The signal name the runtime stops the container with, from CRI's
/// `ContainerConfig.stop_signal`; `None` for the runtime default (the
/// image's signal, else SIGTERM). Aliases are sent as the signal they name.
/// Real-time signals are refused: the runtime's kill takes standard ones.
pub(crate) fn stop_signal(field: &str, value: i32) -> CriResult<Option<String>> {
    use cri::Signal;
    let signal = Signal::try_from(value)
        .map_err(|_| CriError::invalid(field, format!("unknown signal {value}")))?;
    let name = match signal {
        Signal::RuntimeDefault => return Ok(None),
        Signal::Sigcld => "SIGCHLD",
        Signal::Sigiot => "SIGABRT",
        Signal::Sigpoll => "SIGIO",
        s if (Signal::Sigrtmin as i32..=Signal::Sigrtmax as i32).contains(&(s as i32)) => {
            return Err(CriError::invalid(
                field,
                format!(
                    "{}: real-time stop signals are not supported",
                    s.as_str_name()
                ),
            ))
        }
        s => s.as_str_name(),
    };
    Ok(Some(name.to_owned()))
}

fn mounts(config: &cri::ContainerConfig) -> CriResult<Vec<MountSpec>> {
    let mut mounts = Vec::with_capacity(config.mounts.len());
    for (i, m) in config.mounts.iter().enumerate() {
        image_volume(i, m)?;
        let propagation = match cri::MountPropagation::try_from(m.propagation) {
            Ok(cri::MountPropagation::PropagationPrivate) => Propagation::Private,
            Ok(cri::MountPropagation::PropagationHostToContainer) => Propagation::HostToContainer,
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
            recursive_readonly: m.recursive_read_only,
            idmapped: !m.uid_mappings.is_empty() || !m.gid_mappings.is_empty(),
        });
    }
    Ok(mounts)
}

fn devices(config: &cri::ContainerConfig) -> CriResult<Vec<DeviceSpec>> {
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
    Ok(devices)
}

fn user(sc: Option<&cri::LinuxContainerSecurityContext>) -> CriResult<UserRequest> {
    Ok(match sc {
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
                    CriError::invalid("config.linux.security_context.run_as_user", "out of range")
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
    })
}

/// A container's PID namespace when it asks for one other than the pod's.
fn pid_namespace(
    sc: Option<&cri::LinuxContainerSecurityContext>,
) -> Option<(NamespaceMode, Option<String>)> {
    let o = sc.and_then(|s| s.namespace_options.as_ref())?;
    let mode = match cri::NamespaceMode::try_from(o.pid) {
        Ok(cri::NamespaceMode::Container) => NamespaceMode::Container,
        Ok(cri::NamespaceMode::Node) => NamespaceMode::Node,
        Ok(cri::NamespaceMode::Target) => NamespaceMode::Target,
        _ => NamespaceMode::Pod,
    };
    Some((mode, Some(o.target_id.clone()).filter(|t| !t.is_empty())))
}

/// Converts CreateContainer's `config`.
pub fn container_request(config: Option<&cri::ContainerConfig>) -> CriResult<ContainerRequest> {
    if let Some(config) = config {
        crate::validate::container_config(config)?;
    }
    let config = config.ok_or_else(|| CriError::invalid("config", "missing"))?;
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
    let image = config
        .image
        .as_ref()
        .map(|i| i.image.clone())
        .unwrap_or_default();
    if image.is_empty() {
        return Err(CriError::invalid("config.image.image", "must not be empty"));
    }
    let log_path = if config.log_path.is_empty() {
        None
    } else {
        Some(clean_relative("config.log_path", &config.log_path)?)
    };
    if !config.working_dir.is_empty() {
        clean_absolute("config.working_dir", &config.working_dir)?;
    }
    let mounts = mounts(config)?;
    let devices = devices(config)?;
    let linux = config.linux.as_ref();
    let sc = linux.and_then(|l| l.security_context.as_ref());
    let seccomp = match sc.and_then(|s| s.seccomp.as_ref()) {
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
    };
    let spec = ContainerSpec {
        command: config.command.clone(),
        args: config.args.clone(),
        env: config
            .envs
            .iter()
            .map(|kv| (kv.key.clone(), kv.value.clone()))
            .collect(),
        working_dir: config.working_dir.clone(),
        user: user(sc)?,
        supplemental_groups_policy: super::supplemental_groups_policy(sc),
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
        seccomp,
        devices,
        mounts,
        resources: container_resources(linux.and_then(|l| l.resources.as_ref())),
        tty: config.tty,
        stdin: config.stdin,
        stdin_once: config.stdin_once,
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
        stop_signal: stop_signal("config.stop_signal", config.stop_signal)?,
        ..ContainerSpec::default()
    };
    Ok(ContainerRequest {
        name: meta.name.clone(),
        attempt: meta.attempt,
        image,
        user_specified_image: config
            .image
            .as_ref()
            .map(|i| i.user_specified_image.clone())
            .unwrap_or_default(),
        log_path,
        pid: pid_namespace(sc),
        spec,
    })
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

    fn config() -> cri::ContainerConfig {
        cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: "app".into(),
                attempt: 2,
            }),
            image: Some(cri::ImageSpec {
                image: "busybox".into(),
                user_specified_image: "docker.io/library/busybox:latest".into(),
                ..Default::default()
            }),
            log_path: "app/2.log".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_request_keeps_what_the_client_asked_for() {
        let mut c = config();
        c.linux = Some(cri::LinuxContainerConfig {
            security_context: Some(cri::LinuxContainerSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    pid: cri::NamespaceMode::Target as i32,
                    target_id: "abc".into(),
                    ..Default::default()
                }),
                run_as_user: Some(cri::Int64Value { value: 1000 }),
                ..Default::default()
            }),
            ..Default::default()
        });
        let r = container_request(Some(&c)).unwrap();
        assert_eq!((r.name.as_str(), r.attempt), ("app", 2));
        assert_eq!(r.image, "busybox");
        assert_eq!(r.user_specified_image, "docker.io/library/busybox:latest");
        assert_eq!(
            r.log_path.as_deref(),
            Some(std::path::Path::new("app/2.log"))
        );
        assert_eq!(r.pid, Some((NamespaceMode::Target, Some("abc".into()))));
        assert_eq!(
            r.spec.user,
            UserRequest::Id {
                uid: 1000,
                gid: None
            }
        );
    }

    /// A config as a 1.36 kubelet sends it, through the wire.
    fn decoded(c: &cri::ContainerConfig) -> cri::ContainerConfig {
        use prost::Message;
        cri::ContainerConfig::decode(c.encode_to_vec().as_slice()).unwrap()
    }

    #[test]
    fn stop_signal_is_passed_to_the_runtime() {
        let mut c = config();
        assert_eq!(
            container_request(Some(&decoded(&c)))
                .unwrap()
                .spec
                .stop_signal,
            None
        );
        c.stop_signal = cri::Signal::Sigusr1 as i32;
        let r = container_request(Some(&decoded(&c))).unwrap();
        assert_eq!(r.spec.stop_signal.as_deref(), Some("SIGUSR1"));
        // Aliases go as the signal they name.
        c.stop_signal = cri::Signal::Sigpoll as i32;
        let r = container_request(Some(&decoded(&c))).unwrap();
        assert_eq!(r.spec.stop_signal.as_deref(), Some("SIGIO"));
        for bad in [
            cri::Signal::Sigrtmin as i32,
            cri::Signal::Sigrtmax as i32,
            66,
            -1,
        ] {
            c.stop_signal = bad;
            match container_request(Some(&decoded(&c))) {
                Err(CriError::Pod(cubelet_pod::PodError::InvalidArgument { field, .. })) => {
                    assert_eq!(field, "config.stop_signal");
                }
                other => panic!("signal {bad}: expected InvalidArgument, got {other:?}"),
            }
        }
    }

    #[test]
    fn image_volumes_are_refused_naming_the_field() {
        let with_mount = |m: cri::Mount| {
            let mut c = config();
            c.mounts = vec![
                cri::Mount {
                    host_path: "/h".into(),
                    container_path: "/c".into(),
                    ..Default::default()
                },
                m,
            ];
            container_request(Some(&decoded(&c)))
        };
        let image = Some(cri::ImageSpec {
            image: "sha256:abc".into(),
            ..Default::default()
        });
        for (sub, want) in [("/etc", "relative"), ("a/../../etc", "`..`")] {
            match with_mount(cri::Mount {
                container_path: "/v".into(),
                image: image.clone(),
                image_sub_path: sub.into(),
                ..Default::default()
            }) {
                Err(CriError::Pod(cubelet_pod::PodError::InvalidArgument { field, reason })) => {
                    assert_eq!(field, "config.mounts[1].image_sub_path");
                    assert!(reason.contains(want), "{reason}");
                }
                other => panic!("{sub}: expected InvalidArgument, got {other:?}"),
            }
        }
        let e = with_mount(cri::Mount {
            container_path: "/v".into(),
            image: image.clone(),
            image_sub_path: "dir".into(),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unimplemented);
        assert!(e.to_string().contains("config.mounts[1].image"), "{e}");
        // A sub path without an image is not silently dropped either.
        match with_mount(cri::Mount {
            host_path: "/h".into(),
            container_path: "/v".into(),
            image_sub_path: "dir".into(),
            ..Default::default()
        }) {
            Err(CriError::Pod(cubelet_pod::PodError::InvalidArgument { field, .. })) => {
                assert_eq!(field, "config.mounts[1].image_sub_path");
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn bad_fields_are_named() {
        let field = |c: cri::ContainerConfig| match container_request(Some(&c)) {
            Err(CriError::Pod(cubelet_pod::PodError::InvalidArgument { field, .. })) => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        };
        let mut c = config();
        c.metadata = None;
        assert_eq!(field(c), "config.metadata");
        let mut c = config();
        c.image = None;
        assert_eq!(field(c), "config.image.image");
        let mut c = config();
        c.log_path = "../escape.log".into();
        assert_eq!(field(c), "config.log_path");
        let mut c = config();
        c.linux = Some(cri::LinuxContainerConfig {
            security_context: Some(cri::LinuxContainerSecurityContext {
                run_as_group: Some(cri::Int64Value { value: 1 }),
                ..Default::default()
            }),
            ..Default::default()
        });
        assert_eq!(field(c), "config.linux.security_context.run_as_group");
        assert!(matches!(
            container_request(None),
            Err(CriError::Pod(cubelet_pod::PodError::InvalidArgument { .. }))
        ));
    }
}
