//! Where a container's cgroup is: the cgroup driver, the names it gives,
//! and which cgroup hierarchy the node has.
//!
//! Every path of a container's or pod's cgroup is derived here, from the
//! driver and the pod's `cgroup_parent`, so the OCI spec, the stats, the
//! OOM check and the resource update always agree:
//!
//! | driver | `cgroup_parent` (kubelet) | OCI `cgroupsPath` | directory below the hierarchy root |
//! |---|---|---|---|
//! | cgroupfs | `/kubepods/burstable/pod<uid>` | `/kubepods/burstable/pod<uid>/<id>` | the same |
//! | systemd | `kubepods-burstable-pod<uid>.slice` or kubelet's expansion `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice` | `kubepods-burstable-pod<uid>.slice:cubelet:<id>` | `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cubelet-<id>.scope` |
//!
//! Under systemd runc asks systemd for a transient scope unit
//! `cubelet-<id>.scope` in the pod's slice (containerd's CRI does the same
//! with the prefix `cri-containerd`); systemd nests a slice by the dashes
//! of its name (`a-b.slice` lives in `a.slice`). An empty `cgroup_parent`
//! puts containers in `/cubelet` (cgroupfs) or `system.slice` (systemd, as
//! containerd does).
//!
//! The hierarchy ([`detect_version`]) is told by the file system type of
//! the cgroup root: `cgroup2` there is the unified (v2) layout; a tmpfs
//! with a `cgroup2` mount at `unified` is hybrid (runc uses the v1
//! controllers); anything else is v1. The root is a parameter everywhere,
//! so tests run on fixture trees shaped like `/sys/fs/cgroup`.

use std::path::Path;

use serde::Serialize;

use crate::error::RuntimeError;
pub use crate::stats::cgroups::CgroupVersion;

/// The prefix of the scopes runc makes for Cubelet's containers under the
/// systemd driver (`cubelet-<id>.scope`; containerd's CRI uses
/// `cri-containerd`).
pub const SCOPE_PREFIX: &str = "cubelet";
/// The parent of containers whose pod has no `cgroup_parent`, cgroupfs.
pub const DEFAULT_CGROUPFS_PARENT: &str = "/cubelet";
/// The slice of containers whose pod has no `cgroup_parent`, systemd (as
/// containerd's CRI).
pub const DEFAULT_SLICE: &str = "system.slice";
/// Where the node's cgroup hierarchy is mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// What exists when systemd is the init system (`sd_booted(3)`).
pub const SYSTEMD_RUN_DIR: &str = "/run/systemd/system";
/// The field kubelet's cgroup parent comes in (CRI `PodSandboxConfig`).
pub const PARENT_FIELD: &str = "config.linux.cgroup_parent";

/// The longest unit name systemd accepts (`UNIT_NAME_MAX` less the NUL).
const UNIT_NAME_MAX: usize = 255;
const SLICE_SUFFIX: &str = ".slice";

/// Who manages the cgroups of containers (runc's cgroup manager).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupDriver {
    /// runc writes the cgroup file system itself, at paths.
    #[default]
    Cgroupfs,
    /// runc asks systemd for a scope unit in the pod's slice.
    Systemd,
}

impl CgroupDriver {
    /// The driver's name as kubelet's `cgroupDriver` and CRI name it.
    pub fn as_str(self) -> &'static str {
        match self {
            CgroupDriver::Cgroupfs => "cgroupfs",
            CgroupDriver::Systemd => "systemd",
        }
    }

    /// Checks a pod's `cgroup_parent` (empty = none) for this driver;
    /// `InvalidArgument` on `field` otherwise. Under systemd the parent is
    /// a slice name (`kubepods-burstable-pod<uid>.slice`) or kubelet's
    /// expansion of one; a cgroupfs path, a traversal or a name systemd
    /// would refuse is refused here, not by runc at container start.
    pub fn check_parent(self, field: &str, parent: &str) -> Result<(), RuntimeError> {
        match self {
            CgroupDriver::Cgroupfs => {
                if parent.split('/').any(|c| c == "..") || parent.contains('\0') {
                    return Err(invalid(
                        field,
                        format!("{parent:?} must not contain '..' or NUL"),
                    ));
                }
                Ok(())
            }
            CgroupDriver::Systemd => systemd_slice(parent)
                .map(|_| ())
                .map_err(|reason| invalid(field, reason)),
        }
    }

    /// The OCI `linux.cgroupsPath` of container `id` in a pod with
    /// `parent`: a path for cgroupfs, runc's `slice:prefix:name` for
    /// systemd. An invalid parent is `InvalidArgument` on
    /// [`PARENT_FIELD`] ([`CgroupDriver::check_parent`]).
    pub fn cgroups_path(self, parent: Option<&str>, id: &str) -> Result<String, RuntimeError> {
        let parent = parent.unwrap_or("");
        self.check_parent(PARENT_FIELD, parent)?;
        Ok(match self {
            CgroupDriver::Cgroupfs => cgroupfs_dir(parent, id),
            CgroupDriver::Systemd => {
                let slice = systemd_slice(parent)
                    .map_err(|reason| invalid(PARENT_FIELD, reason))?
                    .unwrap_or(DEFAULT_SLICE);
                format!("{slice}:{SCOPE_PREFIX}:{id}")
            }
        })
    }

    /// The directory of container `id`'s cgroup below the hierarchy root
    /// (below each v1 controller's mount), with a leading `/`: what stats,
    /// the OOM check and the leak audits read. A parent the driver refuses
    /// yields the directory of the default parent, which holds no such
    /// container (the container could not have been created).
    pub fn container_dir(self, parent: Option<&str>, id: &str) -> String {
        let parent = parent.unwrap_or("");
        match self {
            CgroupDriver::Cgroupfs => cgroupfs_dir(parent, id),
            CgroupDriver::Systemd => {
                let slice = systemd_slice(parent)
                    .ok()
                    .flatten()
                    .unwrap_or(DEFAULT_SLICE);
                let dir = expand_slice(slice).unwrap_or_default();
                format!("{dir}/{SCOPE_PREFIX}-{id}.scope")
            }
        }
    }

    /// The directory of a pod's own cgroup (its `cgroup_parent`, made by
    /// kubelet) below the hierarchy root; `None` without a parent or with
    /// one the driver refuses.
    pub fn parent_dir(self, parent: &str) -> Option<String> {
        if parent.is_empty() || self.check_parent(PARENT_FIELD, parent).is_err() {
            return None;
        }
        match self {
            CgroupDriver::Cgroupfs => {
                let p = parent.trim_end_matches('/');
                if p.is_empty() {
                    return None;
                }
                Some(if p.starts_with('/') {
                    p.to_owned()
                } else {
                    format!("/{p}")
                })
            }
            CgroupDriver::Systemd => expand_slice(systemd_slice(parent).ok()??).ok(),
        }
    }
}

/// The container id a container's cgroup directory name carries, under
/// either driver (`<id>` or `cubelet-<id>.scope`).
pub fn container_id_of_dir(name: &str) -> &str {
    name.strip_prefix(SCOPE_PREFIX)
        .and_then(|n| n.strip_prefix('-'))
        .and_then(|n| n.strip_suffix(".scope"))
        .unwrap_or(name)
}

/// The driver `runtime.cgroup_driver: auto` picks: systemd when systemd is
/// the init system and the hierarchy is unified (v2), as kubelet's own
/// default on such nodes is; cgroupfs otherwise.
pub fn auto_driver(systemd_booted: bool, version: CgroupVersion) -> CgroupDriver {
    if systemd_booted && version == CgroupVersion::V2 {
        CgroupDriver::Systemd
    } else {
        CgroupDriver::Cgroupfs
    }
}

/// Whether systemd is the init system: `run_dir` (normally
/// [`SYSTEMD_RUN_DIR`]) is a directory, as `sd_booted(3)` tests.
pub fn systemd_booted(run_dir: &Path) -> bool {
    run_dir.is_dir()
}

/// The cgroup layout of the hierarchy mounted at `root` (normally
/// [`CGROUP_ROOT`]): `cgroup2` at `root` is [`CgroupVersion::V2`];
/// `cgroup2` at `root/unified` is [`CgroupVersion::Hybrid`]; else
/// [`CgroupVersion::V1`]. Fails only when `root` cannot be examined.
pub fn detect_version(root: &Path) -> Result<CgroupVersion, RuntimeError> {
    use nix::sys::statfs::{statfs, CGROUP2_SUPER_MAGIC};
    let is_cgroup2 = |p: &Path| {
        statfs(p)
            .map(|s| s.filesystem_type() == CGROUP2_SUPER_MAGIC)
            .map_err(|e| RuntimeError::Io {
                op: "statfs",
                path: p.display().to_string(),
                source: e.into(),
            })
    };
    if is_cgroup2(root)? {
        return Ok(CgroupVersion::V2);
    }
    let unified = root.join("unified");
    if unified.is_dir() && is_cgroup2(&unified)? {
        return Ok(CgroupVersion::Hybrid);
    }
    Ok(CgroupVersion::V1)
}

/// systemd's path of `slice` below the hierarchy root (runc's
/// `ExpandSlice`): `a-b-c.slice` → `/a.slice/a-b.slice/a-b-c.slice`.
/// Refuses what systemd refuses: no `.slice` suffix, a `/`, an empty
/// dash-separated part (`a--b.slice`, `-a.slice`), characters outside
/// `[A-Za-z0-9_.-]` (a `:` would split runc's `slice:prefix:name`) and
/// names over 255 bytes. The root slice `-.slice`
/// is refused too: containers belong in a slice of their pod, not in the
/// root cgroup.
pub fn expand_slice(slice: &str) -> Result<String, String> {
    let Some(name) = slice.strip_suffix(SLICE_SUFFIX) else {
        return Err(format!(
            "{slice:?} is not a systemd slice (no .slice suffix)"
        ));
    };
    if slice.len() > UNIT_NAME_MAX {
        return Err(format!(
            "slice name is {} bytes long; systemd allows {UNIT_NAME_MAX}",
            slice.len()
        ));
    }
    if name == "-" {
        return Err("the root slice \"-.slice\" cannot hold containers".to_owned());
    }
    if name.is_empty() || slice.contains('/') {
        return Err(format!("{slice:?} is not a systemd slice name"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return Err(format!(
            "{slice:?} has {c:?}, which a systemd slice name cannot have"
        ));
    }
    let mut path = String::new();
    let mut prefix = String::new();
    for part in name.split('-') {
        if part.is_empty() {
            return Err(format!(
                "{slice:?} has an empty dash-separated part, which systemd refuses"
            ));
        }
        path.push('/');
        path.push_str(&prefix);
        path.push_str(part);
        path.push_str(SLICE_SUFFIX);
        prefix.push_str(part);
        prefix.push('-');
    }
    Ok(path)
}

/// The slice a systemd-driver `cgroup_parent` names: `None` for none
/// (empty or `/`), the slice for a slice name, and for kubelet's form (the
/// slice's expansion, [`expand_slice`]) its last part, when the path is
/// exactly that expansion: anything else would be placed where the path
/// does not say.
fn systemd_slice(parent: &str) -> Result<Option<&str>, String> {
    if parent.is_empty() || parent == "/" {
        return Ok(None);
    }
    if parent.chars().any(|c| c.is_control()) {
        return Err(format!("{parent:?} contains a control character"));
    }
    if !parent.contains('/') {
        expand_slice(parent)?;
        return Ok(Some(parent));
    }
    let leaf = parent.rsplit('/').next().unwrap_or("");
    let expanded = expand_slice(leaf).map_err(|e| {
        format!(
            "{parent:?} is not a systemd slice or a slice's path \
             (runtime.cgroup_driver is systemd; kubelet's cgroupDriver must be too): {e}"
        )
    })?;
    if parent.trim_start_matches('/') != expanded.trim_start_matches('/') {
        return Err(format!(
            "{parent:?} is not where systemd puts {leaf:?} ({expanded:?})"
        ));
    }
    Ok(Some(leaf))
}

/// `<parent>/<id>` with one leading `/`; an empty parent is
/// [`DEFAULT_CGROUPFS_PARENT`].
fn cgroupfs_dir(parent: &str, id: &str) -> String {
    let parent = if parent.is_empty() {
        DEFAULT_CGROUPFS_PARENT
    } else {
        parent
    };
    let parent = parent.trim_end_matches('/');
    if parent.starts_with('/') || parent.is_empty() {
        format!("{parent}/{id}")
    } else {
        format!("/{parent}/{id}")
    }
}

fn invalid(field: &str, reason: String) -> RuntimeError {
    RuntimeError::InvalidArgument {
        field: field.to_owned(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CgroupDriver::{Cgroupfs, Systemd};

    #[test]
    fn slices_expand_by_their_dashes() {
        for (slice, want) in [
            ("kubepods.slice", "/kubepods.slice"),
            (
                "kubepods-burstable.slice",
                "/kubepods.slice/kubepods-burstable.slice",
            ),
            (
                "kubepods-burstable-pod1.slice",
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice",
            ),
            (
                "kubepods-pod0c2a_11d2.slice",
                "/kubepods.slice/kubepods-pod0c2a_11d2.slice",
            ),
            ("system.slice", "/system.slice"),
            ("a.b-c.slice", "/a.b.slice/a.b-c.slice"),
        ] {
            assert_eq!(expand_slice(slice).as_deref(), Ok(want), "{slice}");
        }
    }

    #[test]
    fn slices_systemd_refuses_are_refused() {
        for bad in [
            "",
            ".slice",
            "-.slice",
            "kubepods",
            "kubepods.scope",
            "-kubepods.slice",
            "kubepods-.slice",
            "kubepods--pod.slice",
            "../kubepods.slice",
            "kube/pods.slice",
            "kube pods.slice",
            "kube\npods.slice",
            "kübe.slice",
            "a\\x2d.slice",
            "a:b.slice",
        ] {
            assert!(expand_slice(bad).is_err(), "{bad:?} accepted");
        }
        let long = format!("{}.slice", "a".repeat(250));
        assert!(expand_slice(&long).is_err());
        let fits = format!("{}.slice", "a".repeat(249));
        assert!(expand_slice(&fits).is_ok());
    }

    #[test]
    fn the_systemd_driver_maps_kubelets_parents_to_runc_and_the_file_system() {
        let id = "0123abcd";
        let scope = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cubelet-0123abcd.scope";
        for parent in [
            "kubepods-burstable-pod1.slice",
            // What kubelet v1.28 sends: ToSystemd() expands the slice.
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice",
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice",
        ] {
            assert_eq!(
                Systemd.cgroups_path(Some(parent), id).unwrap(),
                "kubepods-burstable-pod1.slice:cubelet:0123abcd",
                "{parent}"
            );
            assert_eq!(Systemd.container_dir(Some(parent), id), scope, "{parent}");
            assert_eq!(
                Systemd.parent_dir(parent).as_deref(),
                Some("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice")
            );
        }
        // Guaranteed pods sit right under kubepods.slice.
        assert_eq!(
            Systemd.container_dir(Some("kubepods-pod2.slice"), id),
            "/kubepods.slice/kubepods-pod2.slice/cubelet-0123abcd.scope"
        );
        for none in [None, Some(""), Some("/")] {
            assert_eq!(
                Systemd.cgroups_path(none, id).unwrap(),
                "system.slice:cubelet:0123abcd"
            );
            assert_eq!(
                Systemd.container_dir(none, id),
                "/system.slice/cubelet-0123abcd.scope"
            );
        }
        assert_eq!(Systemd.parent_dir(""), None);
    }

    #[test]
    fn the_systemd_driver_refuses_hostile_and_cgroupfs_parents() {
        for bad in [
            "/kubepods/burstable/pod1",
            "kubepods/burstable/pod1",
            "../kubepods.slice",
            "/kubepods.slice/../kubepods-burstable-pod1.slice",
            "/other.slice/kubepods-burstable-pod1.slice",
            "/kubepods.slice/kubepods-burstable-pod1.slice",
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/",
            "-.slice",
            "kubepods--pod1.slice",
            "kubepods-burstable-pod1.slice\n",
            "kubepods.slice:evil:x",
        ] {
            match Systemd.check_parent(PARENT_FIELD, bad) {
                Err(RuntimeError::InvalidArgument { field, .. }) => {
                    assert_eq!(field, PARENT_FIELD, "{bad:?}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
            assert!(Systemd.cgroups_path(Some(bad), "c").is_err(), "{bad:?}");
            assert_eq!(Systemd.parent_dir(bad), None, "{bad:?}");
            // Never a path outside the default slice.
            assert_eq!(
                Systemd.container_dir(Some(bad), "c"),
                "/system.slice/cubelet-c.scope"
            );
        }
    }

    #[test]
    fn the_cgroupfs_driver_keeps_paths() {
        for (parent, want) in [
            (None, "/cubelet/c1"),
            (Some(""), "/cubelet/c1"),
            (
                Some("/kubepods/burstable/pod1"),
                "/kubepods/burstable/pod1/c1",
            ),
            (Some("kubepods/pod1/"), "/kubepods/pod1/c1"),
            (Some("/"), "/c1"),
        ] {
            assert_eq!(Cgroupfs.cgroups_path(parent, "c1").unwrap(), want);
            assert_eq!(Cgroupfs.container_dir(parent, "c1"), want);
        }
        assert_eq!(
            Cgroupfs.parent_dir("kubepods/pod1/").as_deref(),
            Some("/kubepods/pod1")
        );
        assert_eq!(Cgroupfs.parent_dir("/"), None);
        assert_eq!(Cgroupfs.parent_dir(""), None);
        for bad in ["/a/../../b", "..", "a/..", "a\0b"] {
            assert!(Cgroupfs.check_parent("f", bad).is_err(), "{bad:?}");
            assert!(Cgroupfs.cgroups_path(Some(bad), "c").is_err(), "{bad:?}");
            assert_eq!(Cgroupfs.parent_dir(bad), None);
        }
        // A slice name is a plain directory name to cgroupfs.
        assert_eq!(
            Cgroupfs.container_dir(Some("kubepods.slice"), "c"),
            "/kubepods.slice/c"
        );
    }

    #[test]
    fn container_ids_come_back_from_directory_names() {
        assert_eq!(container_id_of_dir("cubelet-abc.scope"), "abc");
        assert_eq!(container_id_of_dir("abc"), "abc");
        assert_eq!(container_id_of_dir("cubelet-abc"), "cubelet-abc");
        assert_eq!(
            container_id_of_dir("cri-containerd-abc.scope"),
            "cri-containerd-abc.scope"
        );
    }

    #[test]
    fn auto_picks_systemd_only_on_a_systemd_v2_node() {
        assert_eq!(auto_driver(true, CgroupVersion::V2), Systemd);
        assert_eq!(auto_driver(true, CgroupVersion::Hybrid), Cgroupfs);
        assert_eq!(auto_driver(true, CgroupVersion::V1), Cgroupfs);
        assert_eq!(auto_driver(false, CgroupVersion::V2), Cgroupfs);
        let dir = tempfile::tempdir().unwrap();
        assert!(!systemd_booted(&dir.path().join("system")));
        std::fs::create_dir(dir.path().join("system")).unwrap();
        assert!(systemd_booted(&dir.path().join("system")));
    }

    #[test]
    fn the_hierarchy_is_told_by_the_file_system_type() {
        // A directory that is no cgroup2 mount, with or without a plain
        // `unified` directory in it: v1.
        let root = tempfile::tempdir().unwrap();
        assert_eq!(detect_version(root.path()).unwrap(), CgroupVersion::V1);
        std::fs::create_dir(root.path().join("unified")).unwrap();
        assert_eq!(detect_version(root.path()).unwrap(), CgroupVersion::V1);
        assert!(detect_version(&root.path().join("absent")).is_err());
        // This host, whichever it is, agrees with its mount table.
        let real = Path::new(CGROUP_ROOT);
        if real.is_dir() {
            let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
            let cgroup2_at = |p: &str| {
                mountinfo.lines().any(|l| {
                    let f: Vec<&str> = l.split(' ').collect();
                    f.get(4) == Some(&p) && l.contains(" - cgroup2 ")
                })
            };
            let want = if cgroup2_at("/sys/fs/cgroup") {
                CgroupVersion::V2
            } else if cgroup2_at("/sys/fs/cgroup/unified") {
                CgroupVersion::Hybrid
            } else {
                CgroupVersion::V1
            };
            assert_eq!(detect_version(real).unwrap(), want);
        }
    }
}
