//! The container's mounts: the default filesystems, the sandbox's files
//! (`/etc/hostname`, `/etc/hosts`, `/etc/resolv.conf`, `/dev/shm`), the
//! pod's bind mounts with their propagation, and the paths masked or made
//! read-only.

use std::path::Path;

use oci_spec::runtime::{Mount, MountBuilder};

use super::model::{ContainerSpec, MountSpec, Propagation};
use super::oci_err;
use crate::error::RuntimeError;

/// Paths masked in unprivileged containers (containerd's defaults).
pub const DEFAULT_MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
];

/// Paths made read-only in unprivileged containers (containerd's defaults).
pub const DEFAULT_READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

fn mount(dest: &str, typ: &str, source: &str, options: &[&str]) -> Result<Mount, RuntimeError> {
    MountBuilder::default()
        .destination(dest)
        .typ(typ)
        .source(source)
        .options(options.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
        .build()
        .map_err(oci_err("mounts"))
}

pub(super) fn default_mounts(spec: &ContainerSpec) -> Result<Vec<Mount>, RuntimeError> {
    let sys_ro = if spec.privileged { "rw" } else { "ro" };
    let mut m = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])?,
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?,
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
            ],
        )?,
        mount(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        )?,
        mount(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", sys_ro],
        )?,
        mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", sys_ro],
        )?,
    ];
    let dest_taken = |dest: &str| {
        spec.mounts
            .iter()
            .any(|u| u.container_path == Path::new(dest))
    };
    if let Some(files) = &spec.sandbox_files {
        let ro = if spec.readonly_rootfs { "ro" } else { "rw" };
        for (dest, src) in [
            ("/etc/hostname", &files.hostname_path),
            ("/etc/hosts", &files.hosts_path),
            ("/etc/resolv.conf", &files.resolv_conf_path),
        ] {
            if !src.as_os_str().is_empty() && !dest_taken(dest) {
                let src = src.to_string_lossy();
                m.push(mount(dest, "bind", &src, &["rbind", "rprivate", ro])?);
            }
        }
        if let Some(shm) = &files.shm_path {
            if !dest_taken("/dev/shm") {
                let src = shm.to_string_lossy();
                m.push(mount(
                    "/dev/shm",
                    "bind",
                    &src,
                    &["rbind", "rprivate", "rw"],
                )?);
            }
        }
    }
    if spec
        .sandbox_files
        .as_ref()
        .is_none_or(|f| f.shm_path.is_none())
        && !dest_taken("/dev/shm")
    {
        m.push(mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        )?);
    }
    // The user's mounts replace any default at the same destination.
    m.retain(|d| {
        !spec
            .mounts
            .iter()
            .any(|u| u.container_path == *d.destination())
    });
    for u in &spec.mounts {
        if !u.container_path.is_absolute() {
            return Err(RuntimeError::InvalidArgument {
                field: "mounts.container_path".to_owned(),
                reason: format!("{} is not absolute", u.container_path.display()),
            });
        }
        let prop = match u.propagation {
            Propagation::Private => "rprivate",
            Propagation::HostToContainer => "rslave",
            Propagation::Bidirectional => "rshared",
        };
        let ro = if u.readonly { "ro" } else { "rw" };
        let dest = u.container_path.to_string_lossy();
        let src = u.host_path.to_string_lossy();
        m.push(mount(&dest, "bind", &src, &["rbind", prop, ro])?);
    }
    Ok(m)
}

/// The root mount propagation the container's mounts need (as containerd):
/// `rshared` when any mount propagates both ways, `rslave` when any only
/// receives from the host. Without it runc makes the root `rslave`, so a
/// bidirectional mount could not propagate back to the host.
pub(super) fn rootfs_propagation(mounts: &[MountSpec]) -> Option<&'static str> {
    if mounts
        .iter()
        .any(|m| m.propagation == Propagation::Bidirectional)
    {
        Some("rshared")
    } else if mounts
        .iter()
        .any(|m| m.propagation == Propagation::HostToContainer)
    {
        Some("rslave")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::test_support::image;
    use crate::spec::{build_oci_spec, SpecOptions};

    #[test]
    fn root_propagation_follows_the_mounts() {
        let bind = |propagation| MountSpec {
            host_path: "/data".into(),
            container_path: "/data".into(),
            readonly: false,
            propagation,
            recursive_readonly: false,
            idmapped: false,
        };
        let root = |mounts: Vec<MountSpec>| {
            let s = ContainerSpec {
                image: image(&[], &["x"], &[]),
                mounts,
                ..Default::default()
            };
            let oci = build_oci_spec("c", &s, &SpecOptions::default()).unwrap();
            oci.linux().as_ref().unwrap().rootfs_propagation().clone()
        };
        assert_eq!(root(vec![]), None);
        assert_eq!(root(vec![bind(Propagation::Private)]), None);
        assert_eq!(
            root(vec![bind(Propagation::HostToContainer)]).as_deref(),
            Some("rslave")
        );
        assert_eq!(
            root(vec![
                bind(Propagation::HostToContainer),
                bind(Propagation::Bidirectional)
            ])
            .as_deref(),
            Some("rshared")
        );
    }

    #[test]
    fn mounts_defaults_sandbox_files_and_user_binds() {
        let s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            sandbox_files: Some(cubelet_engine::spec::StorageStatus {
                hostname_path: "/sb/hostname".into(),
                hosts_path: "/sb/hosts".into(),
                resolv_conf_path: "/sb/resolv.conf".into(),
                shm_path: Some("/sb/shm".into()),
                ..Default::default()
            }),
            mounts: vec![
                MountSpec {
                    host_path: "/data".into(),
                    container_path: "/data".into(),
                    readonly: true,
                    propagation: Propagation::HostToContainer,
                    recursive_readonly: false,
                    idmapped: false,
                },
                MountSpec {
                    host_path: "/my/hosts".into(),
                    container_path: "/etc/hosts".into(),
                    readonly: false,
                    propagation: Propagation::Bidirectional,
                    recursive_readonly: false,
                    idmapped: false,
                },
            ],
            cgroup_parent: Some("kubepods/pod1".into()),
            ..Default::default()
        };
        let oci = build_oci_spec("c", &s, &SpecOptions::default()).unwrap();
        let mounts = oci.mounts().clone().unwrap();
        let find = |d: &str| {
            mounts
                .iter()
                .filter(|m| m.destination() == Path::new(d))
                .collect::<Vec<_>>()
        };
        for d in [
            "/proc",
            "/dev",
            "/dev/pts",
            "/dev/mqueue",
            "/sys",
            "/sys/fs/cgroup",
            "/etc/hostname",
            "/etc/resolv.conf",
        ] {
            assert_eq!(find(d).len(), 1, "{d}");
        }
        assert!(find("/sys")[0]
            .options()
            .as_ref()
            .unwrap()
            .contains(&"ro".to_string()));
        assert_eq!(
            find("/dev/shm")[0].source().as_deref(),
            Some(Path::new("/sb/shm"))
        );
        let hosts = find("/etc/hosts");
        assert_eq!(hosts.len(), 1);
        assert_eq!(hosts[0].source().as_deref(), Some(Path::new("/my/hosts")));
        assert!(hosts[0]
            .options()
            .as_ref()
            .unwrap()
            .contains(&"rshared".to_string()));
        let data = find("/data")[0].options().clone().unwrap();
        assert!(data.contains(&"ro".to_string()) && data.contains(&"rslave".to_string()));
        let linux = oci.linux().as_ref().unwrap();
        assert_eq!(
            linux.cgroups_path().as_deref(),
            Some(Path::new("/kubepods/pod1/c"))
        );
        assert_eq!(
            linux.masked_paths().as_ref().unwrap().len(),
            DEFAULT_MASKED_PATHS.len()
        );
    }
}
