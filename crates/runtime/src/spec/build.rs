//! The OCI runtime spec of a container, put together from its parts.

use std::collections::{HashMap, HashSet};

use oci_spec::runtime::{
    LinuxBuilder, LinuxCapabilitiesBuilder, LinuxNamespace, LinuxNamespaceBuilder,
    LinuxNamespaceType, ProcessBuilder, RootBuilder, Spec, SpecBuilder, UserBuilder,
};

use super::capabilities::effective_capabilities;
use super::devices::container_devices;
use super::model::{ContainerSpec, NamespaceJoin, SpecOptions};
use super::mounts::{
    default_mounts, rootfs_propagation, DEFAULT_MASKED_PATHS, DEFAULT_READONLY_PATHS,
};
use super::oci_err;
use super::resources::{cgroup_path, clamp_oom_score_adj, linux_resources};
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
        (None, UserRequest::Name { name, .. }) => {
            return Err(RuntimeError::InvalidArgument {
                field: "user".to_owned(),
                reason: format!("user {name:?} was not resolved against the image"),
            })
        }
    };
    let mut gids = user.additional_gids.clone();
    for g in &spec.supplemental_groups {
        if !gids.contains(g) {
            gids.push(*g);
        }
    }
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
        .env(spec.process_env())
        .cwd(spec.process_cwd())
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
        .cgroups_path(cgroup_path(spec.cgroup_parent.as_deref(), id))
        .devices(devices)
        .sysctl(spec.sysctls.clone().into_iter().collect::<HashMap<_, _>>());
    if let Some(p) = rootfs_propagation(&spec.mounts) {
        linux = linux.rootfs_propagation(p);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::test_support::image;
    use crate::spec::ContainerNamespaces;
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
        };
        let infra = ContainerNamespaces::for_infra(&host, None);
        assert_eq!(
            infra,
            ContainerNamespaces {
                network: NamespaceJoin::Host,
                ipc: NamespaceJoin::Host,
                uts: NamespaceJoin::Host,
                pid: NamespaceJoin::Host
            }
        );

        let c = ContainerNamespaces::for_pod_container(&pod, 42, None);
        assert_eq!(c.network, NamespaceJoin::Path("/proc/42/ns/net".into()));
        assert_eq!(c.pid, NamespaceJoin::Path("/proc/42/ns/pid".into()));
        let own_pid = NamespaceOptions {
            pid: NamespaceMode::Container,
            ..Default::default()
        };
        assert_eq!(
            ContainerNamespaces::for_pod_container(&own_pid, 42, None).pid,
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
}
