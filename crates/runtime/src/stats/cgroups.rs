//! What the node's cgroups can enforce, and container resources fitted to it.
//!
//! Kubelet asks for more than every node can do: it sends a zero hugepage
//! limit for every page size in `/sys/kernel/mm/hugepages`, a swap limit
//! equal to the memory limit, and on cgroup v2 `unified` keys. runc refuses a
//! spec whose controller is not where it places containers ("cannot set
//! hugetlb limit: container could not join or create cgroup"), so, as
//! containerd does (`tolerate_missing_hugetlb_controller`), each resource is
//! put in the OCI spec only when its controller exists. Which controllers
//! exist is read once at start:
//!
//! - cgroup v1, and hybrid layouts (v1 controllers plus a v2 mount at
//!   `unified`): runc's v1 manager only writes limits of controllers mounted
//!   as v1 hierarchies, so those are the ones that count, even when the v2
//!   mount has more (this node has `hugetlb` only on the v2 side).
//! - cgroup v2 (unified): `cgroup.controllers` of the mount's root.
//!
//! Swap needs `memory.memsw.limit_in_bytes` (v1) or `memory.swap.max` (v2).
//! A dropped resource is logged once per kind at debug and listed in
//! [`CgroupSupport::report`] (CRI `Status` verbose info).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;

use crate::error::RuntimeError;
use crate::spec::Resources;

/// A mounted cgroup hierarchy, as `/proc/self/mountinfo` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CgroupMount {
    /// `true` for a cgroup2 (unified) mount.
    pub v2: bool,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// The v1 controllers of the hierarchy (super options; empty for v2).
    pub controllers: Vec<String>,
}

/// The cgroup mounts in a mountinfo text.
pub(crate) fn cgroup_mounts(mountinfo: &str) -> Vec<CgroupMount> {
    cubelet_host::mountinfo::parse(mountinfo)
        .into_iter()
        .filter_map(|m| {
            let v2 = match m.fstype.as_str() {
                "cgroup" => false,
                "cgroup2" => true,
                _ => return None,
            };
            let controllers = if v2 {
                Vec::new()
            } else {
                m.super_options
                    .split(',')
                    .filter(|o| V1_CONTROLLERS.contains(o))
                    .map(str::to_owned)
                    .collect()
            };
            Some(CgroupMount {
                v2,
                mount_point: m.mount_point,
                controllers,
            })
        })
        .collect()
}

/// The v1 controller names a super option list can carry (the others are
/// options such as `rw` or `name=systemd`).
const V1_CONTROLLERS: &[&str] = &[
    "cpu",
    "cpuacct",
    "cpuset",
    "memory",
    "devices",
    "freezer",
    "net_cls",
    "blkio",
    "perf_event",
    "net_prio",
    "hugetlb",
    "pids",
    "rdma",
    "misc",
];

/// The cgroup layout where containers are placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupVersion {
    /// Only v1 hierarchies.
    V1,
    /// v1 controllers plus a v2 mount; runc uses the v1 side.
    Hybrid,
    /// The unified hierarchy.
    V2,
}

/// A kind of container resource whose controller may be missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResourceKind {
    /// `cpu_shares`, `cpu_quota`, `cpu_period` (controller `cpu`).
    Cpu,
    /// `cpuset_cpus`, `cpuset_mems` (controller `cpuset`).
    Cpuset,
    /// `memory_limit_in_bytes` (controller `memory`).
    Memory,
    /// `memory_swap_limit_in_bytes` (swap accounting of `memory`).
    MemorySwap,
    /// `hugepage_limits` (controller `hugetlb`, and the page size).
    Hugetlb,
    /// `unified` keys (cgroup v2 only; each key's controller).
    Unified,
}

impl ResourceKind {
    /// The CRI field of `LinuxContainerResources` this kind comes from.
    pub fn field(self) -> &'static str {
        match self {
            ResourceKind::Cpu => "linux.resources.cpu_shares/cpu_quota/cpu_period",
            ResourceKind::Cpuset => "linux.resources.cpuset_cpus/cpuset_mems",
            ResourceKind::Memory => "linux.resources.memory_limit_in_bytes",
            ResourceKind::MemorySwap => "linux.resources.memory_swap_limit_in_bytes",
            ResourceKind::Hugetlb => "linux.resources.hugepage_limits",
            ResourceKind::Unified => "linux.resources.unified",
        }
    }
}

/// What the node's cgroups can enforce (see the module docs).
#[derive(Debug)]
pub struct CgroupSupport {
    version: CgroupVersion,
    controllers: BTreeSet<String>,
    swap: bool,
    hugepage_sizes: BTreeSet<String>,
    tolerate_missing_hugetlb: bool,
    /// Kinds dropped so far (each logged once).
    dropped: Mutex<BTreeSet<ResourceKind>>,
}

/// [`CgroupSupport`] as CRI `Status` verbose info shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CgroupReport {
    /// Layout where containers are placed.
    pub version: CgroupVersion,
    /// Controllers runc can use for containers.
    pub controllers: Vec<String>,
    /// Swap limits can be enforced.
    pub swap: bool,
    /// Hugepage sizes of the node (`2MB`, `1GB`).
    pub hugepage_sizes: Vec<String>,
    /// `runtime.tolerate_missing_hugetlb_controller`.
    pub tolerate_missing_hugetlb_controller: bool,
    /// Resource kinds that a request asked for and the node cannot enforce,
    /// left out of the spec since start.
    pub dropped: Vec<ResourceKind>,
}

impl CgroupSupport {
    /// Reads the host: `/proc/self/mountinfo`, the v2 root's
    /// `cgroup.controllers`, swap files and `/sys/kernel/mm/hugepages`.
    pub fn detect(tolerate_missing_hugetlb: bool) -> Result<Self, RuntimeError> {
        let read = |path: &str| {
            std::fs::read_to_string(path).map_err(|source| RuntimeError::Io {
                op: "read",
                path: path.to_owned(),
                source,
            })
        };
        let mountinfo = read("/proc/self/mountinfo")?;
        Ok(Self::from_host(
            &mountinfo,
            Path::new("/sys/kernel/mm/hugepages"),
            tolerate_missing_hugetlb,
        ))
    }

    /// The support described by a mountinfo text, reading the mounts it
    /// names and the hugepage directory `hugepages` (fixtures in tests).
    pub fn from_host(mountinfo: &str, hugepages: &Path, tolerate_missing_hugetlb: bool) -> Self {
        let mounts = cgroup_mounts(mountinfo);
        let v1: BTreeMap<String, PathBuf> = mounts
            .iter()
            .filter(|m| !m.v2)
            .flat_map(|m| {
                m.controllers
                    .iter()
                    .map(|c| (c.clone(), m.mount_point.clone()))
            })
            .collect();
        let v2_root = mounts.iter().find(|m| m.v2).map(|m| m.mount_point.clone());
        let (version, controllers, swap) = if !v1.is_empty() {
            let swap = v1
                .get("memory")
                .is_some_and(|m| m.join("memory.memsw.limit_in_bytes").exists());
            let version = if v2_root.is_some() {
                CgroupVersion::Hybrid
            } else {
                CgroupVersion::V1
            };
            (version, v1.keys().cloned().collect(), swap)
        } else {
            let root = v2_root.unwrap_or_else(|| PathBuf::from("/sys/fs/cgroup"));
            let controllers: BTreeSet<String> =
                std::fs::read_to_string(root.join("cgroup.controllers"))
                    .map(|t| t.split_whitespace().map(str::to_owned).collect())
                    .unwrap_or_default();
            let swap = controllers.contains("memory") && v2_has_swap(&root);
            (CgroupVersion::V2, controllers, swap)
        };
        Self::new(
            version,
            controllers,
            swap,
            hugepage_sizes(hugepages),
            tolerate_missing_hugetlb,
        )
    }

    /// Support from known facts.
    pub fn new(
        version: CgroupVersion,
        controllers: BTreeSet<String>,
        swap: bool,
        hugepage_sizes: BTreeSet<String>,
        tolerate_missing_hugetlb: bool,
    ) -> Self {
        Self {
            version,
            controllers,
            swap,
            hugepage_sizes,
            tolerate_missing_hugetlb,
            dropped: Mutex::new(BTreeSet::new()),
        }
    }

    /// A node that can enforce everything (tests, and hosts where detection
    /// is not wanted).
    pub fn permissive() -> Self {
        let controllers = ["cpu", "cpuset", "memory", "hugetlb", "pids", "io"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        Self::new(CgroupVersion::V2, controllers, true, BTreeSet::new(), true)
    }

    /// The layout.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// Whether containers can get limits of `controller`.
    pub fn has(&self, controller: &str) -> bool {
        self.controllers.contains(controller)
    }

    /// `resources` with what the node cannot enforce left out, or `None`
    /// when it can enforce all of it. A non-zero hugepage limit without the
    /// controller is `FailedPrecondition` naming the field unless
    /// `tolerate_missing_hugetlb_controller`; a non-zero limit for a page
    /// size the node does not have is `InvalidArgument` (runc would fail on
    /// the missing file).
    pub fn fit(&self, resources: &Resources) -> Result<Option<Resources>, RuntimeError> {
        let mut r = resources.clone();
        let mut dropped = BTreeSet::new();
        let mut drop_if = |missing: bool, kind: ResourceKind, set: bool| {
            if missing && set {
                dropped.insert(kind);
            }
            missing && set
        };
        if drop_if(
            !self.has("cpu"),
            ResourceKind::Cpu,
            r.cpu_shares != 0 || r.cpu_quota != 0 || r.cpu_period != 0,
        ) {
            (r.cpu_shares, r.cpu_quota, r.cpu_period) = (0, 0, 0);
        }
        if drop_if(
            !self.has("cpuset"),
            ResourceKind::Cpuset,
            !r.cpuset_cpus.is_empty() || !r.cpuset_mems.is_empty(),
        ) {
            r.cpuset_cpus.clear();
            r.cpuset_mems.clear();
        }
        if drop_if(
            !self.has("memory"),
            ResourceKind::Memory,
            r.memory_limit > 0,
        ) {
            r.memory_limit = 0;
        }
        if drop_if(
            !(self.has("memory") && self.swap),
            ResourceKind::MemorySwap,
            r.memory_swap_limit != 0,
        ) {
            r.memory_swap_limit = 0;
        }
        if !r.hugepages.is_empty() {
            if !self.has("hugetlb") {
                if let Some((i, _)) = r.hugepages.iter().enumerate().find(|(_, h)| h.limit > 0) {
                    if !self.tolerate_missing_hugetlb {
                        return Err(RuntimeError::FailedPrecondition(format!(
                            "linux.resources.hugepage_limits[{i}]: a non-zero hugepage limit \
                             needs the hugetlb cgroup controller, which this node does not \
                             have for containers (set runtime.tolerate_missing_hugetlb_controller \
                             to ignore such limits)"
                        )));
                    }
                }
                dropped.insert(ResourceKind::Hugetlb);
                r.hugepages.clear();
            } else {
                let mut unknown = Vec::new();
                for (i, h) in r.hugepages.iter().enumerate() {
                    if !self.hugepage_sizes.contains(&h.page_size) {
                        if h.limit > 0 {
                            return Err(RuntimeError::InvalidArgument {
                                field: format!("linux.resources.hugepage_limits[{i}].page_size"),
                                reason: format!(
                                    "{:?} is not a hugepage size of this node (it has {:?})",
                                    h.page_size, self.hugepage_sizes
                                ),
                            });
                        }
                        unknown.push(i);
                    }
                }
                if !unknown.is_empty() {
                    dropped.insert(ResourceKind::Hugetlb);
                    let mut i = 0;
                    r.hugepages.retain(|_| {
                        i += 1;
                        !unknown.contains(&(i - 1))
                    });
                }
            }
        }
        if !r.unified.is_empty() {
            let before = r.unified.len();
            if self.version == CgroupVersion::V2 {
                r.unified.retain(|key, _| {
                    let controller = key.split('.').next().unwrap_or("");
                    controller == "cgroup" || self.has(controller)
                });
            } else {
                // runc refuses `unified` on a v1 manager outright.
                r.unified.clear();
            }
            if r.unified.len() != before {
                dropped.insert(ResourceKind::Unified);
            }
        }
        if dropped.is_empty() {
            return Ok(None);
        }
        self.note_dropped(&dropped);
        Ok(Some(r))
    }

    fn note_dropped(&self, kinds: &BTreeSet<ResourceKind>) {
        let mut seen = self.dropped.lock().unwrap_or_else(|p| p.into_inner());
        for kind in kinds {
            if seen.insert(*kind) {
                tracing::debug!(
                    kind = ?kind,
                    field = kind.field(),
                    version = ?self.version,
                    "left out of container specs: the node's cgroups cannot enforce it"
                );
            }
        }
    }

    /// The support and what was dropped so far.
    pub fn report(&self) -> CgroupReport {
        let dropped = self
            .dropped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .copied()
            .collect();
        CgroupReport {
            version: self.version,
            controllers: self.controllers.iter().cloned().collect(),
            swap: self.swap,
            hugepage_sizes: self.hugepage_sizes.iter().cloned().collect(),
            tolerate_missing_hugetlb_controller: self.tolerate_missing_hugetlb,
            dropped,
        }
    }
}

/// Whether the unified hierarchy at `root` accounts swap: `memory.swap.max`
/// exists in non-root cgroups only, so look one level down.
fn v2_has_swap(root: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(root) else {
        return false;
    };
    entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .any(|e| e.path().join("memory.swap.max").exists())
}

/// Hugepage sizes under `dir` (`hugepages-2048kB` → `2MB`), as kubelet
/// names them in `hugepage_limits`.
fn hugepage_sizes(dir: &Path) -> BTreeSet<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeSet::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let kb: u64 = name
                .strip_prefix("hugepages-")?
                .strip_suffix("kB")?
                .parse()
                .ok()?;
            Some(page_size_name(kb))
        })
        .collect()
}

/// `2048` kB → `2MB`, `1048576` → `1GB`, `64` → `64KB` (the kernel's
/// `hugetlb.<size>.*` file names, which runc writes).
fn page_size_name(kb: u64) -> String {
    if kb >= 1 << 20 && kb.is_multiple_of(1 << 20) {
        format!("{}GB", kb >> 20)
    } else if kb >= 1 << 10 && kb.is_multiple_of(1 << 10) {
        format!("{}MB", kb >> 10)
    } else {
        format!("{kb}KB")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::HugepageLimit;

    /// This node's layout: v1 controllers, hugetlb only on the v2 mount.
    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    fn kubelet_resources() -> Resources {
        Resources {
            cpu_shares: 51,
            cpu_quota: 20_000,
            cpu_period: 100_000,
            memory_limit: 64 << 20,
            memory_swap_limit: 64 << 20,
            hugepages: vec![
                HugepageLimit {
                    page_size: "1GB".into(),
                    limit: 0,
                },
                HugepageLimit {
                    page_size: "2MB".into(),
                    limit: 0,
                },
            ],
            ..Default::default()
        }
    }

    fn hugepage_dir(sizes: &[&str]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for s in sizes {
            std::fs::create_dir(d.path().join(format!("hugepages-{s}kB"))).unwrap();
        }
        d
    }

    fn controllers(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn hybrid_counts_only_the_v1_controllers() {
        let pages = hugepage_dir(&["2048", "1048576"]);
        let s = CgroupSupport::from_host(HYBRID, pages.path(), true);
        assert_eq!(s.version(), CgroupVersion::Hybrid);
        let r = s.report();
        assert_eq!(
            r.controllers,
            ["cpu", "cpuacct", "cpuset", "memory", "pids"]
        );
        assert_eq!(r.hugepage_sizes, ["1GB", "2MB"]);
        assert!(!s.has("hugetlb"));
        // Swap needs memory.memsw.*, which the fixture paths do not have
        // unless this host's real /sys/fs/cgroup/memory has them.
        assert_eq!(
            r.swap,
            Path::new("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists()
        );
    }

    #[test]
    fn v2_reads_cgroup_controllers_and_swap_one_level_down() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        std::fs::create_dir(root.path().join("init.scope")).unwrap();
        std::fs::write(root.path().join("init.scope/memory.swap.max"), "max\n").unwrap();
        let mountinfo = format!(
            "30 23 0:26 / {} rw,nosuid - cgroup2 cgroup2 rw\n",
            root.path().display()
        );
        let s = CgroupSupport::from_host(&mountinfo, Path::new("/nonexistent"), true);
        assert_eq!(s.version(), CgroupVersion::V2);
        assert_eq!(s.report().controllers, ["cpu", "memory", "pids"]);
        assert!(s.report().swap);
    }

    #[test]
    fn kubelets_zero_hugepage_limits_are_dropped_without_the_controller() {
        let s = CgroupSupport::new(
            CgroupVersion::Hybrid,
            controllers(&["cpu", "cpuset", "memory", "pids"]),
            true,
            controllers(&["1GB", "2MB"]),
            false,
        );
        let fitted = s.fit(&kubelet_resources()).unwrap().unwrap();
        assert!(fitted.hugepages.is_empty());
        assert_eq!(fitted.memory_limit, 64 << 20);
        assert_eq!(fitted.memory_swap_limit, 64 << 20);
        assert_eq!(fitted.cpu_shares, 51);
        assert_eq!(s.report().dropped, [ResourceKind::Hugetlb]);
    }

    #[test]
    fn a_nonzero_hugepage_limit_without_the_controller_fails_unless_tolerated() {
        let mut r = kubelet_resources();
        r.hugepages[1].limit = 4 << 20;
        let strict = CgroupSupport::new(
            CgroupVersion::Hybrid,
            controllers(&["memory"]),
            false,
            controllers(&["2MB"]),
            false,
        );
        let err = strict.fit(&r).unwrap_err();
        assert!(
            matches!(err, RuntimeError::FailedPrecondition(ref m)
            if m.contains("linux.resources.hugepage_limits[1]")),
            "{err}"
        );
        let tolerant = CgroupSupport::new(
            CgroupVersion::Hybrid,
            controllers(&["memory"]),
            false,
            controllers(&["2MB"]),
            true,
        );
        assert!(tolerant.fit(&r).unwrap().unwrap().hugepages.is_empty());
    }

    #[test]
    fn everything_enforceable_is_left_alone() {
        let s = CgroupSupport::new(
            CgroupVersion::V2,
            controllers(&["cpu", "cpuset", "memory", "hugetlb", "pids"]),
            true,
            controllers(&["1GB", "2MB"]),
            true,
        );
        assert_eq!(s.fit(&kubelet_resources()).unwrap(), None);
        assert!(s.report().dropped.is_empty());
    }

    #[test]
    fn hugepage_sizes_the_node_lacks() {
        let s = CgroupSupport::new(
            CgroupVersion::V2,
            controllers(&["hugetlb", "memory", "cpu"]),
            true,
            controllers(&["2MB"]),
            true,
        );
        // A zero limit for a size the node lacks is dropped; the rest kept.
        let fitted = s.fit(&kubelet_resources()).unwrap().unwrap();
        assert_eq!(fitted.hugepages.len(), 1);
        assert_eq!(fitted.hugepages[0].page_size, "2MB");
        let mut r = kubelet_resources();
        r.hugepages[0].limit = 1 << 30;
        let err = s.fit(&r).unwrap_err();
        assert!(
            matches!(err, RuntimeError::InvalidArgument { ref field, .. }
            if field == "linux.resources.hugepage_limits[0].page_size"),
            "{err}"
        );
    }

    #[test]
    fn missing_cpu_cpuset_memory_and_swap_are_dropped() {
        let s = CgroupSupport::new(
            CgroupVersion::V1,
            controllers(&["pids"]),
            false,
            BTreeSet::new(),
            true,
        );
        let mut r = kubelet_resources();
        r.cpuset_cpus = "0".into();
        r.oom_score_adj = 1000;
        let fitted = s.fit(&r).unwrap().unwrap();
        assert_eq!(
            fitted,
            Resources {
                oom_score_adj: 1000,
                ..Default::default()
            }
        );
        assert_eq!(
            s.report().dropped,
            [
                ResourceKind::Cpu,
                ResourceKind::Cpuset,
                ResourceKind::Memory,
                ResourceKind::MemorySwap,
                ResourceKind::Hugetlb
            ]
        );
    }

    #[test]
    fn unified_keys_need_v2_and_their_controller() {
        let r = Resources {
            unified: BTreeMap::from([
                ("memory.high".to_owned(), "1000000".to_owned()),
                ("io.max".to_owned(), "8:0 rbps=1".to_owned()),
                ("cgroup.freeze".to_owned(), "0".to_owned()),
            ]),
            ..Default::default()
        };
        let v2 = CgroupSupport::new(
            CgroupVersion::V2,
            controllers(&["memory"]),
            false,
            BTreeSet::new(),
            true,
        );
        let fitted = v2.fit(&r).unwrap().unwrap();
        assert_eq!(
            fitted.unified.keys().collect::<Vec<_>>(),
            ["cgroup.freeze", "memory.high"]
        );
        let hybrid = CgroupSupport::new(
            CgroupVersion::Hybrid,
            controllers(&["memory", "io"]),
            false,
            BTreeSet::new(),
            true,
        );
        assert!(hybrid.fit(&r).unwrap().unwrap().unified.is_empty());
    }

    #[test]
    fn page_sizes_are_named_as_the_kernel_files() {
        assert_eq!(page_size_name(2048), "2MB");
        assert_eq!(page_size_name(1_048_576), "1GB");
        assert_eq!(page_size_name(64), "64KB");
        assert_eq!(page_size_name(32_768), "32MB");
    }
}
