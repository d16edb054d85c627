//! The OCI runtime spec of a container, put together from its parts.

use std::collections::{HashMap, HashSet};

use oci_spec::runtime::{
    LinuxBuilder, LinuxCapabilitiesBuilder, LinuxIdMapping, LinuxIdMappingBuilder, LinuxNamespace,
    LinuxNamespaceBuilder, LinuxNamespaceType, ProcessBuilder, RootBuilder, Spec, SpecBuilder,
    UserBuilder,
};

use super::capabilities::effective_capabilities;
use super::devices::container_devices;
use super::model::{ContainerSpec, NamespaceJoin, SpecOptions};
use super::mounts::{
    default_mounts, rootfs_propagation, DEFAULT_MASKED_PATHS, DEFAULT_READONLY_PATHS,
};
use super::oci_err;
use super::resources::{clamp_oom_score_adj, linux_resources};
use super::seccomp::seccomp_filter;
use super::user::{ResolvedUser, UserRequest};
use crate::error::RuntimeError;

fn namespace(typ: LinuxNamespaceType, join: &NamespaceJoin) -> Option<LinuxNamespace> {
    let b = LinuxNamespaceBuilder::default().typ(typ);
    let b = match join {
        NamespaceJoin::Host => return None,
        NamespaceJoin::New => b,
        NamespaceJoin::Path(p) => b.path(p.clone()),
    };
    b.build().ok()
}

/// Largest uid or gid the kernel and runc take (`int32`).
const MAX_ID: u32 = i32::MAX as u32;

/// Refuses, naming the field, what runc would refuse at start as an
/// `Internal`-looking failure: values an image (or a request) gives that no
/// process can run with.
fn check_process(user: &ResolvedUser, cwd: &str, env: &[String]) -> Result<(), RuntimeError> {
    let invalid = |field: &str, reason: String| {
        Err(RuntimeError::InvalidArgument {
            field: field.to_owned(),
            reason,
        })
    };
    if let Some(id) = [user.uid, user.gid]
        .iter()
        .chain(&user.additional_gids)
        .find(|id| **id > MAX_ID)
    {
        return invalid("user", format!("id {id} is past {MAX_ID}"));
    }
    if !cwd.starts_with('/') || cwd.contains('\0') {
        return invalid(
            "working_dir",
            format!("{cwd:?} (the request's, else the image's WorkingDir) is not an absolute path"),
        );
    }
    for kv in env {
        let key = kv.split_once('=').map_or(kv.as_str(), |(k, _)| k);
        if key.is_empty() || kv.contains('\0') {
            let shown: String = kv.chars().take(64).collect();
            return invalid(
                "envs",
                format!(
                    "{shown:?} (from the request or the image's Env) has an empty name or a NUL"
                ),
            );
        }
    }
    Ok(())
}

/// Builds the OCI runtime spec for container `id`.
pub fn build_oci_spec(
    id: &str,
    spec: &ContainerSpec,
    opts: &SpecOptions,
) -> Result<Spec, RuntimeError> {
    let args = spec.process_args();
    if args.is_empty() {
        return Err(RuntimeError::InvalidArgument {
            field: "command".to_owned(),
            reason: "neither the request nor the image gives a command".to_owned(),
        });
    }
    let user = match (&opts.user, spec.effective_user()?) {
        (Some(u), _) => u.clone(),
        (None, UserRequest::Id { uid, gid }) => ResolvedUser {
            uid,
            gid: gid.unwrap_or(0),
            additional_gids: Vec::new(),
        },
        (None, UserRequest::Image) => ResolvedUser::default(),
        (None, UserRequest::Name { name: user, .. } | UserRequest::NamedGroup { user, .. }) => {
            return Err(RuntimeError::InvalidArgument {
                field: "user".to_owned(),
                reason: format!("user {user:?} was not resolved against the image"),
            })
        }
    };
    let (cwd, env) = (spec.process_cwd(), spec.process_env());
    check_process(&user, &cwd, &env)?;
    let gids = process_groups(&user, spec);
    let caps = effective_capabilities(spec)?;
    let capabilities = LinuxCapabilitiesBuilder::default()
        .bounding(caps.clone())
        .effective(caps.clone())
        .permitted(caps)
        .inheritable(HashSet::new())
        .ambient(HashSet::new())
        .build()
        .map_err(oci_err("capabilities"))?;
    let process = ProcessBuilder::default()
        .terminal(spec.tty)
        .user(
            UserBuilder::default()
                .uid(user.uid)
                .gid(user.gid)
                .additional_gids(gids)
                .build()
                .map_err(oci_err("user"))?,
        )
        .args(args)
        .env(env)
        .cwd(cwd)
        .capabilities(capabilities)
        .no_new_privileges(spec.no_new_privs && !spec.privileged)
        .oom_score_adj(clamp_oom_score_adj(
            spec.resources.oom_score_adj,
            opts.min_oom_score_adj,
        ));
    let process = process.build().map_err(oci_err("process"))?;

    let ns = &spec.namespaces;
    let mut namespaces: Vec<LinuxNamespace> = [
        (LinuxNamespaceType::Pid, &ns.pid),
        (LinuxNamespaceType::Ipc, &ns.ipc),
        (LinuxNamespaceType::Uts, &ns.uts),
        (LinuxNamespaceType::Network, &ns.network),
    ]
    .iter()
    .filter_map(|(t, j)| namespace(*t, j))
    .collect();
    if let Some(user) = &ns.user {
        let join = user
            .path
            .clone()
            .map_or(NamespaceJoin::New, NamespaceJoin::Path);
        namespaces.extend(namespace(LinuxNamespaceType::User, &join));
    }
    namespaces.push(
        namespace(LinuxNamespaceType::Mount, &NamespaceJoin::New).ok_or_else(|| {
            RuntimeError::InvalidArgument {
                field: "namespaces".into(),
                reason: "mount".into(),
            }
        })?,
    );

    let mut resources = linux_resources(&spec.resources)?;
    let (devices, rules) = container_devices(spec)?;
    resources.set_devices(Some(rules));
    let mut linux = LinuxBuilder::default()
        .namespaces(namespaces)
        .resources(resources)
        .cgroups_path(
            opts.cgroup_driver
                .cgroups_path(spec.cgroup_parent.as_deref(), id)?,
        )
        .devices(devices)
        .sysctl(spec.sysctls.clone().into_iter().collect::<HashMap<_, _>>());
    if let Some(p) = rootfs_propagation(&spec.mounts) {
        linux = linux.rootfs_propagation(p);
    }
    if let Some(user) = &ns.user {
        linux = linux
            .uid_mappings(vec![id_mapping(&user.mapping.uids)?])
            .gid_mappings(vec![id_mapping(&user.mapping.gids)?]);
    }
    if spec.privileged {
        // Nothing masked or read-only (the builder's defaults would be).
        linux = linux.masked_paths(Vec::new()).readonly_paths(Vec::new());
    } else {
        linux = linux
            .masked_paths(spec.masked_paths.clone().unwrap_or_else(|| {
                DEFAULT_MASKED_PATHS
                    .iter()
                    .map(|s| (*s).to_owned())
                    .collect()
            }))
            .readonly_paths(spec.readonly_paths.clone().unwrap_or_else(|| {
                DEFAULT_READONLY_PATHS
                    .iter()
                    .map(|s| (*s).to_owned())
                    .collect()
            }));
        if let Some(filter) = seccomp_filter(&spec.seccomp)? {
            linux = linux.seccomp(filter);
        }
    }
    let linux = linux.build().map_err(oci_err("linux"))?;

    let mut b = SpecBuilder::default()
        .version("1.0.2-dev")
        .process(process)
        .root(
            RootBuilder::default()
                .path("rootfs")
                .readonly(spec.readonly_rootfs)
                .build()
                .map_err(oci_err("root"))?,
        )
        .mounts(default_mounts(spec)?)
        .linux(linux)
        .annotations(
            spec.annotations
                .clone()
                .into_iter()
                .collect::<HashMap<_, _>>(),
        );
    if ns.uts == NamespaceJoin::New && !spec.hostname.is_empty() {
        b = b.hostname(spec.hostname.clone());
    }
    let mut oci = b.build().map_err(oci_err("spec"))?;
    if ns.uts != NamespaceJoin::New || spec.hostname.is_empty() {
        // The builder's default is a placeholder hostname; joining the
        // pod's (or node's) UTS namespace must not set one.
        oci.set_hostname(None);
    }
    Ok(oci)
}

/// The groups of the container's process: the primary group first (as
/// containerd puts it in `additionalGids`, so `id -G` lists it whatever the
/// image says), the image's groups for the user (already left out under
/// [`SupplementalGroupsPolicy::Strict`](super::model::SupplementalGroupsPolicy::Strict)), then the requested ones; no
/// duplicates.
pub fn process_groups(user: &ResolvedUser, spec: &ContainerSpec) -> Vec<u32> {
    let mut gids = vec![user.gid];
    for g in user.additional_gids.iter().chain(&spec.supplemental_groups) {
        if !gids.contains(g) {
            gids.push(*g);
        }
    }
    gids
}

fn id_mapping(m: &cubelet_engine::spec::IdMapping) -> Result<LinuxIdMapping, RuntimeError> {
    LinuxIdMappingBuilder::default()
        .container_id(m.container_id)
        .host_id(m.host_id)
        .size(m.length)
        .build()
        .map_err(oci_err("user namespace mappings"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What runc would refuse at start (found with crafted images) is
    /// refused at create, naming the field.
    #[test]
    fn an_image_config_no_process_can_run_with_is_refused_naming_the_field() {
        let refused = |s: &ContainerSpec, opts: &SpecOptions| match build_oci_spec("c", s, opts) {
            Err(RuntimeError::InvalidArgument { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let base = ContainerSpec {
            image: image(&[], &["x"], &[]),
            ..Default::default()
        };
        let mut s = base.clone();
        std::sync::Arc::make_mut(&mut s.image.config).working_dir = "../../../etc".into();
        assert_eq!(refused(&s, &SpecOptions::default()), "working_dir");
        for env in ["=novalue", "A=b\0c"] {
            let s = ContainerSpec {
                image: image(&[], &["x"], &[env]),
                ..base.clone()
            };
            assert_eq!(refused(&s, &SpecOptions::default()), "envs", "{env:?}");
        }
        let s = ContainerSpec {
            user: crate::spec::UserRequest::Id {
                uid: 4_294_967_295,
                gid: Some(0),
            },
            ..base.clone()
        };
        assert_eq!(refused(&s, &SpecOptions::default()), "user");
        // The largest id runc takes, an absolute WorkingDir and a plain
        // Env are fine.
        let mut s = ContainerSpec {
            image: image(&[], &["x"], &["A=", "B=c=d"]),
            user: crate::spec::UserRequest::Id {
                uid: 2_147_483_647,
                gid: Some(2_147_483_647),
            },
            ..base
        };
        std::sync::Arc::make_mut(&mut s.image.config).working_dir = "/srv".into();
        assert!(build_oci_spec("c", &s, &SpecOptions::default()).is_ok());
    }
    use crate::spec::test_support::image;
    use crate::spec::{ContainerNamespaces, PodNamespacePaths};
    use cubelet_engine::spec::SandboxProcess;
    use std::path::Path;

    #[test]
    fn empty_command_is_rejected() {
        let s = ContainerSpec::default();
        let e = build_oci_spec("c", &s, &SpecOptions::default()).unwrap_err();
        assert!(matches!(e, RuntimeError::InvalidArgument { .. }), "{e}");
    }

    #[test]
    fn namespaces_for_pod_and_host() {
        use cubelet_engine::spec::{NamespaceMode, NamespaceOptions};
        let pod = NamespaceOptions::default();
        let infra = ContainerNamespaces::for_infra(&pod, Some(Path::new("/run/netns/x")));
        assert_eq!(infra.network, NamespaceJoin::Path("/run/netns/x".into()));
        assert_eq!(
            (infra.ipc.clone(), infra.uts.clone(), infra.pid.clone()),
            (NamespaceJoin::New, NamespaceJoin::New, NamespaceJoin::New)
        );
        let host = NamespaceOptions {
            network: NamespaceMode::Node,
            pid: NamespaceMode::Node,
            ipc: NamespaceMode::Node,
            target_id: None,
            userns: None,
        };
        let infra = ContainerNamespaces::for_infra(&host, None);
        assert_eq!(
            infra,
            ContainerNamespaces {
                network: NamespaceJoin::Host,
                ipc: NamespaceJoin::Host,
                uts: NamespaceJoin::Host,
                pid: NamespaceJoin::Host,
                user: None,
            }
        );

        let infra = PodNamespacePaths::of_infra(42);
        let c = ContainerNamespaces::for_pod_container(&pod, &infra, None).unwrap();
        assert_eq!(c.network, NamespaceJoin::Path("/proc/42/ns/net".into()));
        assert_eq!(c.pid, NamespaceJoin::Path("/proc/42/ns/pid".into()));
        let own_pid = NamespaceOptions {
            pid: NamespaceMode::Container,
            ..Default::default()
        };
        assert_eq!(
            ContainerNamespaces::for_pod_container(&own_pid, &infra, None)
                .unwrap()
                .pid,
            NamespaceJoin::New
        );

        let s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            namespaces: c,
            hostname: "h".into(),
            ..Default::default()
        };
        let oci = build_oci_spec("c", &s, &SpecOptions::default()).unwrap();
        let nss = oci.linux().as_ref().unwrap().namespaces().clone().unwrap();
        let net = nss
            .iter()
            .find(|n| n.typ() == LinuxNamespaceType::Network)
            .unwrap();
        assert_eq!(net.path().as_deref(), Some(Path::new("/proc/42/ns/net")));
        assert!(nss
            .iter()
            .any(|n| n.typ() == LinuxNamespaceType::Mount && n.path().is_none()));
        // Hostname only with a new UTS namespace.
        assert_eq!(oci.hostname(), &None);
        let s2 = ContainerSpec {
            namespaces: ContainerNamespaces::default(),
            ..s
        };
        let oci = build_oci_spec("c", &s2, &SpecOptions::default()).unwrap();
        assert_eq!(oci.hostname().as_deref(), Some("h"));
        assert_eq!(
            oci.linux().as_ref().unwrap().cgroups_path().as_deref(),
            Some(Path::new("/cubelet/c"))
        );
    }

    #[test]
    fn the_systemd_driver_writes_runcs_slice_prefix_name() {
        use crate::cgroup::CgroupDriver;
        let opts = SpecOptions {
            cgroup_driver: CgroupDriver::Systemd,
            ..Default::default()
        };
        let mut s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            cgroup_parent: Some(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice".into(),
            ),
            ..Default::default()
        };
        let oci = build_oci_spec("c", &s, &opts).unwrap();
        assert_eq!(
            oci.linux().as_ref().unwrap().cgroups_path().as_deref(),
            Some(Path::new("kubepods-burstable-pod1.slice:cubelet:c"))
        );
        s.cgroup_parent = Some("/kubepods/burstable/pod1".into());
        match build_oci_spec("c", &s, &opts).unwrap_err() {
            RuntimeError::InvalidArgument { field, .. } => {
                assert_eq!(field, "config.linux.cgroup_parent")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_pod_user_namespace_is_joined_with_its_mappings() {
        use cubelet_engine::spec::{IdMapping, NamespaceOptions, UserNamespace};
        let map = IdMapping {
            container_id: 0,
            host_id: 1000,
            length: 100_000,
        };
        let pod = NamespaceOptions {
            userns: Some(UserNamespace {
                uids: map,
                gids: IdMapping {
                    host_id: 2000,
                    ..map
                },
            }),
            ..Default::default()
        };
        let infra = ContainerNamespaces::for_infra(&pod, Some(Path::new("/run/x/netns/p")))
            .in_userns(&pod, Some(Path::new("/run/x/userns/p")));
        let app =
            ContainerNamespaces::for_pod_container(&pod, &PodNamespacePaths::of_infra(42), None)
                .unwrap();
        for (ns, path) in [(infra, "/run/x/userns/p"), (app, "/proc/42/ns/user")] {
            let s = ContainerSpec {
                image: image(&[], &["x"], &[]),
                namespaces: ns,
                ..Default::default()
            };
            let oci = build_oci_spec("c", &s, &SpecOptions::default()).unwrap();
            let linux = oci.linux().as_ref().unwrap();
            let user = linux
                .namespaces()
                .as_ref()
                .unwrap()
                .iter()
                .find(|n| n.typ() == LinuxNamespaceType::User)
                .expect("a user namespace");
            assert_eq!(user.path().as_deref(), Some(Path::new(path)));
            let uids = linux.uid_mappings().as_ref().unwrap();
            assert_eq!(
                (uids[0].container_id(), uids[0].host_id(), uids[0].size()),
                (0, 1000, 100_000)
            );
            assert_eq!(linux.gid_mappings().as_ref().unwrap()[0].host_id(), 2000);
        }
        // Without one, no user namespace and no mappings.
        let s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            namespaces: ContainerNamespaces::for_pod_container(
                &NamespaceOptions::default(),
                &PodNamespacePaths::of_infra(42),
                None,
            )
            .unwrap(),
            ..Default::default()
        };
        let oci = build_oci_spec("c", &s, &SpecOptions::default()).unwrap();
        let linux = oci.linux().as_ref().unwrap();
        assert!(!linux
            .namespaces()
            .as_ref()
            .unwrap()
            .iter()
            .any(|n| n.typ() == LinuxNamespaceType::User));
        assert!(linux.uid_mappings().is_none());
    }

    #[test]
    fn process_groups_put_the_primary_group_first_then_image_then_requested() {
        let user = ResolvedUser {
            uid: 1000,
            gid: 1000,
            additional_gids: vec![50000, 1000],
        };
        let spec = ContainerSpec {
            supplemental_groups: vec![1234, 50000],
            ..Default::default()
        };
        assert_eq!(process_groups(&user, &spec), vec![1000, 50000, 1234]);
        let root = ResolvedUser::default();
        assert_eq!(process_groups(&root, &ContainerSpec::default()), vec![0]);
        let s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            supplemental_groups: vec![7],
            ..Default::default()
        };
        let opts = SpecOptions {
            user: Some(user),
            ..Default::default()
        };
        let oci = build_oci_spec("c", &s, &opts).unwrap();
        let u = oci.process().as_ref().unwrap().user();
        assert_eq!(u.additional_gids().as_deref(), Some(&[1000, 50000, 7][..]));
    }

    #[test]
    fn containers_of_a_sandbox_without_infra_join_its_pins() {
        use cubelet_engine::spec::{NamespaceMode, NamespaceOptions};
        let process = SandboxProcess {
            pid: None,
            runtime_handler: "runc".into(),
            ipc_path: Some("/run/podns/a/ipc".into()),
            uts_path: Some("/run/podns/a/uts".into()),
            pins_dir: Some("/run/podns/a".into()),
        };
        let pod = PodNamespacePaths::of_sandbox(&process, Some(Path::new("/run/netns/a")));
        let own_pid = NamespaceOptions {
            pid: NamespaceMode::Container,
            ..Default::default()
        };
        let c = ContainerNamespaces::for_pod_container(&own_pid, &pod, None).unwrap();
        assert_eq!(
            c,
            ContainerNamespaces {
                network: NamespaceJoin::Path("/run/netns/a".into()),
                ipc: NamespaceJoin::Path("/run/podns/a/ipc".into()),
                uts: NamespaceJoin::Path("/run/podns/a/uts".into()),
                pid: NamespaceJoin::New,
                user: None,
            }
        );
        // A target's PID namespace, or the node's, needs no infra process.
        let target = NamespaceOptions {
            pid: NamespaceMode::Target,
            ..own_pid.clone()
        };
        assert_eq!(
            ContainerNamespaces::for_pod_container(&target, &pod, Some(7))
                .unwrap()
                .pid,
            NamespaceJoin::Path("/proc/7/ns/pid".into())
        );
        // The pod's PID namespace does: there is none to join.
        let e = ContainerNamespaces::for_pod_container(&NamespaceOptions::default(), &pod, None)
            .unwrap_err();
        assert!(matches!(e, RuntimeError::FailedPrecondition(_)), "{e}");
        // Host network and IPC: nothing of the pod's is joined for them.
        let host = NamespaceOptions {
            network: NamespaceMode::Node,
            ipc: NamespaceMode::Node,
            pid: NamespaceMode::Container,
            ..Default::default()
        };
        let bare = PodNamespacePaths::of_sandbox(
            &SandboxProcess {
                ipc_path: None,
                uts_path: None,
                ..process.clone()
            },
            None,
        );
        let c = ContainerNamespaces::for_pod_container(&host, &bare, None).unwrap();
        assert_eq!(
            (c.network, c.ipc, c.uts),
            (
                NamespaceJoin::Host,
                NamespaceJoin::Host,
                NamespaceJoin::Host
            )
        );
        // A pod network namespace that is missing is refused, not guessed.
        let e = ContainerNamespaces::for_pod_container(&own_pid, &bare, None).unwrap_err();
        assert!(e.to_string().contains("network"), "{e}");
        // So is a pod user namespace: only an infra process holds one.
        let userns = NamespaceOptions {
            userns: Some(Default::default()),
            ..own_pid.clone()
        };
        let e = ContainerNamespaces::for_pod_container(&userns, &pod, None).unwrap_err();
        assert!(e.to_string().contains("user namespace"), "{e}");
    }
}
