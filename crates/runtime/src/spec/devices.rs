//! Devices: those the pod asks for, the cgroup device rules of an
//! unprivileged container, and the host's devices for a privileged one.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    LinuxDevice, LinuxDeviceBuilder, LinuxDeviceCgroup, LinuxDeviceCgroupBuilder, LinuxDeviceType,
};

use super::model::ContainerSpec;
use super::oci_err;
use crate::error::RuntimeError;

/// Directories under `/dev` whose nodes are not devices a privileged
/// container should get (as containerd's host-device list).
const SKIPPED_DEV_DIRS: &[&str] = &["pts", "shm", "fd", "mqueue", ".lxc", ".lxd-mounts", ".udev"];

/// Every character and block device under `dir` (recursively, skipping
/// [`SKIPPED_DEV_DIRS`] and `/dev/console`), as OCI devices with the
/// host's mode and owner. Unreadable entries are skipped.
fn host_devices(dir: &Path) -> Vec<LinuxDevice> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(md) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let ft = md.file_type();
        if ft.is_dir() {
            let name = entry.file_name();
            if !SKIPPED_DEV_DIRS.iter().any(|s| name == *s) {
                out.extend(host_devices(&path));
            }
            continue;
        }
        let typ = if ft.is_char_device() {
            LinuxDeviceType::C
        } else if ft.is_block_device() {
            LinuxDeviceType::B
        } else {
            continue;
        };
        if path == Path::new("/dev/console") {
            continue;
        }
        let device = LinuxDeviceBuilder::default()
            .path(path)
            .typ(typ)
            .major(i64::try_from(nix::sys::stat::major(md.rdev())).unwrap_or(0))
            .minor(i64::try_from(nix::sys::stat::minor(md.rdev())).unwrap_or(0))
            .file_mode(md.mode() & 0o7777)
            .uid(md.uid())
            .gid(md.gid())
            .build();
        if let Ok(d) = device {
            out.push(d);
        }
    }
    out
}

fn device_rule(
    allow: bool,
    typ: Option<LinuxDeviceType>,
    major: Option<i64>,
    minor: Option<i64>,
    access: &str,
) -> Result<LinuxDeviceCgroup, RuntimeError> {
    let mut b = LinuxDeviceCgroupBuilder::default()
        .allow(allow)
        .access(access);
    if let Some(t) = typ {
        b = b.typ(t);
    }
    if let Some(m) = major {
        b = b.major(m);
    }
    if let Some(m) = minor {
        b = b.minor(m);
    }
    b.build().map_err(oci_err("devices"))
}

/// The container's devices and its cgroup device rules: everything allowed
/// for a privileged container, else the default rules of an unprivileged
/// one plus a rule per requested device; a privileged container also sees
/// the host's devices (its own requested ones win at the same path).
pub(super) fn container_devices(
    spec: &ContainerSpec,
) -> Result<(Vec<LinuxDevice>, Vec<LinuxDeviceCgroup>), RuntimeError> {
    let mut rules = if spec.privileged {
        vec![device_rule(true, None, None, None, "rwm")?]
    } else {
        let c = Some(LinuxDeviceType::C);
        vec![
            device_rule(false, None, None, None, "rwm")?,
            device_rule(true, c, None, None, "m")?,
            device_rule(true, Some(LinuxDeviceType::B), None, None, "m")?,
            device_rule(true, c, Some(1), Some(3), "rwm")?,
            device_rule(true, c, Some(1), Some(8), "rwm")?,
            device_rule(true, c, Some(1), Some(7), "rwm")?,
            device_rule(true, c, Some(5), Some(0), "rwm")?,
            device_rule(true, c, Some(1), Some(5), "rwm")?,
            device_rule(true, c, Some(1), Some(9), "rwm")?,
            device_rule(true, c, Some(5), Some(1), "rwm")?,
            device_rule(true, c, Some(136), None, "rwm")?,
            device_rule(true, c, Some(5), Some(2), "rwm")?,
            device_rule(true, c, Some(10), Some(200), "rwm")?,
        ]
    };
    let mut devices = Vec::new();
    for d in &spec.devices {
        let md = std::fs::metadata(&d.host_path).map_err(|source| RuntimeError::Io {
            op: "stat device",
            path: d.host_path.display().to_string(),
            source,
        })?;
        let typ = if md.file_type().is_char_device() {
            LinuxDeviceType::C
        } else if md.file_type().is_block_device() {
            LinuxDeviceType::B
        } else {
            return Err(RuntimeError::InvalidArgument {
                field: "devices.host_path".to_owned(),
                reason: format!("{} is not a device", d.host_path.display()),
            });
        };
        let major = i64::try_from(nix::sys::stat::major(md.rdev())).unwrap_or(0);
        let minor = i64::try_from(nix::sys::stat::minor(md.rdev())).unwrap_or(0);
        let perms = if d.permissions.is_empty() {
            "rwm"
        } else {
            d.permissions.as_str()
        };
        devices.push(
            LinuxDeviceBuilder::default()
                .path(d.container_path.clone())
                .typ(typ)
                .major(major)
                .minor(minor)
                .file_mode(md.mode() & 0o7777)
                .uid(md.uid())
                .gid(md.gid())
                .build()
                .map_err(oci_err("devices"))?,
        );
        if !spec.privileged {
            rules.push(device_rule(
                true,
                Some(typ),
                Some(major),
                Some(minor),
                perms,
            )?);
        }
    }

    if spec.privileged {
        // As containerd and CRI-O: a privileged container sees the host's
        // devices (its own requested ones win at the same path).
        let requested: Vec<PathBuf> = devices.iter().map(|d| d.path().clone()).collect();
        devices.extend(
            host_devices(Path::new("/dev"))
                .into_iter()
                .filter(|d| !requested.contains(d.path())),
        );
    }
    Ok((devices, rules))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::test_support::image;
    use crate::spec::{build_oci_spec, SpecOptions};

    #[test]
    fn privileged_gets_host_devices_and_nothing_masked() {
        let s = ContainerSpec {
            image: image(&[], &["x"], &[]),
            privileged: true,
            ..Default::default()
        };
        let oci = build_oci_spec("c", &s, &SpecOptions::default()).unwrap();
        let linux = oci.linux().as_ref().unwrap();
        assert_eq!(linux.masked_paths().as_deref(), Some(&[][..]));
        assert_eq!(linux.readonly_paths().as_deref(), Some(&[][..]));
        let devices = linux.devices().clone().unwrap_or_default();
        let paths: Vec<_> = devices.iter().map(|d| d.path().clone()).collect();
        assert!(paths.contains(&PathBuf::from("/dev/null")), "{paths:?}");
        assert!(
            !paths
                .iter()
                .any(|p| p.starts_with("/dev/pts") || p == Path::new("/dev/console")),
            "{paths:?}"
        );
        let unprivileged = ContainerSpec {
            privileged: false,
            ..s
        };
        let oci = build_oci_spec("c", &unprivileged, &SpecOptions::default()).unwrap();
        let linux = oci.linux().as_ref().unwrap();
        assert!(!linux.masked_paths().clone().unwrap_or_default().is_empty());
        assert!(linux.devices().clone().unwrap_or_default().is_empty());
    }
}
