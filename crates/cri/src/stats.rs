//! `ContainerStats`, `ListContainerStats`, `PodSandboxStats` and
//! `ListPodSandboxStats`: cgroup readings from the runtime crate, turned into
//! CRI messages. CPU rates (`usage_nano_cores`) come from the previous sample
//! of the same container or pod, kept here in memory.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use cubelet_engine::SandboxId;
use cubelet_pod::{ContainerRecord, SandboxRecord, SandboxState};
use cubelet_runtime::spec::cgroup_path;
use cubelet_runtime::stats::{
    cpu_nano_cores, parse_net_dev, read_net_dev, CgroupLayout, CgroupStats, CpuSample,
    InterfaceStats, OpenFiles,
};
use futures::future::BoxFuture;
use k8s_cri::v1 as cri;
use tracing::debug;

use futures::StreamExt;

use crate::convert::{self, nanos};
use crate::error::{CriError, CriResult};
use crate::service::Cri;

/// Reads `/proc/net/dev` as a pod's network namespace shows it, through
/// the namespace's pin: the pod network stats of a sandbox without an
/// infra process, which has no process to read `/proc/<pid>/net/dev` of.
/// Entering a namespace is the network crate's business (docs/DESIGN.md),
/// so the binary wires one in.
pub trait NetnsCounters: Send + Sync + fmt::Debug + 'static {
    /// The text of `/proc/net/dev` inside the namespace pinned at `netns`.
    fn net_dev(&self, netns: PathBuf) -> BoxFuture<'static, io::Result<String>>;
}

/// Stats state of the shim: the last CPU sample per container or pod, and
/// the containers' cgroup files kept open.
#[derive(Debug, Default)]
pub(crate) struct StatsState {
    cpu: Mutex<HashMap<String, CpuSample>>,
    /// The containers' cgroup files, kept open between List*Stats calls.
    files: Arc<OpenFiles>,
    /// The image filesystem's mount point as the writable-layer usage of
    /// every container names it.
    mountpoint: std::sync::OnceLock<String>,
}

impl StatsState {
    /// The node's cgroup layout (detected once, for the whole process).
    pub(crate) fn layout(&self) -> &'static CgroupLayout {
        CgroupLayout::node()
    }

    /// `path` as a [`cri::FilesystemIdentifier`] names it (the image
    /// filesystem: the same for the life of the process).
    fn mountpoint(&self, path: &std::path::Path) -> &str {
        self.mountpoint.get_or_init(|| path.display().to_string())
    }

    /// CPU usage of `key` at `now`, with the rate since its previous sample.
    fn cpu(&self, key: &str, usage_ns: Option<u64>, now: i64) -> Option<cri::CpuUsage> {
        let usage_ns = usage_ns?;
        let cur = CpuSample {
            timestamp_ns: now,
            usage_ns,
        };
        let mut samples = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
        let rate = match samples.get(key) {
            Some(prev) => match cpu_nano_cores(prev, &cur) {
                Some(r) => {
                    samples.insert(key.to_owned(), cur);
                    Some(r)
                }
                // Two calls in the same instant: keep the older sample.
                None => None,
            },
            None => {
                samples.insert(key.to_owned(), cur);
                None
            }
        };
        Some(cri::CpuUsage {
            timestamp: now,
            usage_core_nano_seconds: Some(u64v(usage_ns)),
            usage_nano_cores: rate.map(u64v),
        })
    }

    /// Closes the cgroup files of `containers` (being removed). The List*Stats
    /// calls close those of containers removed otherwise (by the GC).
    pub(crate) fn forget(&self, containers: &[String]) {
        if !containers.is_empty() {
            self.files.retain(|id| !containers.iter().any(|c| c == id));
        }
    }

    /// Forgets the samples of containers and pods that no longer exist,
    /// and closes their cgroup files.
    fn retain(&self, live: &HashSet<&str>) {
        let mut samples = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
        samples.retain(|k, _| live.contains(k.as_str()));
        drop(samples);
        self.files.retain(|id| live.contains(id));
    }
}

/// True if an executable file `name` is in a `PATH` directory.
pub(crate) fn on_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|d| {
            std::fs::metadata(d.join(name))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// Containers or pods whose stats are gathered at once by the List*Stats
/// calls (their containerd round trips overlap).
const STATS_CONCURRENCY: usize = 16;

/// Cgroups a List*Stats call reads on one thread; from this many on they
/// are shared out among the cores.
const PARALLEL_READS_FROM: usize = 32;

/// The cores the List*Stats calls share their cgroup reads among, asked
/// once (`available_parallelism` reads the process's cgroup files).
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get))
}

/// `read` of every item, in order, the items shared out among `cores`:
/// the last share is read on this thread, the others on blocking threads.
/// Fewer than [`PARALLEL_READS_FROM`] items are all read here.
async fn in_shares<T, R, F>(items: Vec<T>, cores: usize, read: F) -> CriResult<Vec<R>>
where
    T: Send + 'static,
    R: Send + 'static,
    F: Fn(&T) -> R + Clone + Send + 'static,
{
    if items.len() < PARALLEL_READS_FROM || cores < 2 {
        return Ok(items.iter().map(read).collect());
    }
    let share = items.len().div_ceil(cores);
    let mut shares: Vec<Vec<T>> = Vec::with_capacity(cores);
    let mut rest = items.into_iter().peekable();
    while rest.peek().is_some() {
        shares.push(rest.by_ref().take(share).collect());
    }
    let last = shares.pop().unwrap_or_default();
    let others: Vec<_> = shares
        .into_iter()
        .map(|share| {
            let read = read.clone();
            tokio::task::spawn_blocking(move || share.iter().map(read).collect::<Vec<R>>())
        })
        .collect();
    let mine: Vec<R> = last.iter().map(read).collect();
    let mut out = Vec::new();
    for task in others {
        out.extend(
            task.await
                .map_err(|e| CriError::Internal(format!("cgroup reading task: {e}")))?,
        );
    }
    out.extend(mine);
    Ok(out)
}

/// The cgroup parent of pod `sb`, if it is known.
fn parent_of(sb: Option<&SandboxRecord>) -> Option<&str> {
    sb.and_then(|s| s.spec.cgroup_parent.as_deref())
}

fn u64v(value: u64) -> cri::UInt64Value {
    cri::UInt64Value { value }
}

fn hash(m: &std::collections::BTreeMap<String, String>) -> HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn memory(stats: &CgroupStats, now: i64) -> Option<cri::MemoryUsage> {
    let m = stats.memory?;
    Some(cri::MemoryUsage {
        timestamp: now,
        working_set_bytes: Some(u64v(m.working_set_bytes)),
        available_bytes: m.available_bytes().map(u64v),
        usage_bytes: Some(u64v(m.usage_bytes)),
        rss_bytes: Some(u64v(m.rss_bytes)),
        page_faults: Some(u64v(m.page_faults)),
        major_page_faults: Some(u64v(m.major_page_faults)),
    })
}

/// The network usage of a pod from its interfaces; `eth0` (else the first)
/// is the default interface.
fn network(ifaces: &[InterfaceStats], now: i64) -> Option<cri::NetworkUsage> {
    if ifaces.is_empty() {
        return None;
    }
    let conv = |i: &InterfaceStats| cri::NetworkInterfaceUsage {
        name: i.name.clone(),
        rx_bytes: Some(u64v(i.rx_bytes)),
        rx_errors: Some(u64v(i.rx_errors)),
        tx_bytes: Some(u64v(i.tx_bytes)),
        tx_errors: Some(u64v(i.tx_errors)),
    };
    let default = ifaces
        .iter()
        .find(|i| i.name == "eth0")
        .or_else(|| ifaces.first())
        .map(conv);
    Some(cri::NetworkUsage {
        timestamp: now,
        default_interface: default,
        interfaces: ifaces.iter().map(conv).collect(),
    })
}

impl Cri {
    /// Cgroup readings of a container (empty if its cgroup is gone).
    pub(crate) fn container_cgroup(
        &self,
        c: &ContainerRecord,
        sb: Option<&SandboxRecord>,
    ) -> CgroupStats {
        self.inner
            .stats
            .layout()
            .read(&cgroup_path(parent_of(sb), &c.id))
    }

    /// Reads the cgroups at `paths`, in order, a share of them per core on
    /// blocking threads, through the files kept open from the last call
    /// (see [`OpenFiles`]): a reading is three to five cgroup files of a
    /// few microseconds each, times every container on the node. Without
    /// `processes`, the process counts are left out (see
    /// [`CgroupLayout::read_usage`]).
    async fn read_cgroups(
        &self,
        paths: Vec<String>,
        processes: bool,
    ) -> CriResult<Vec<CgroupStats>> {
        let layout = self.inner.stats.layout();
        let files = Arc::clone(&self.inner.stats.files);
        in_shares(paths, cores(), move |p: &String| {
            layout.read_with(p, processes, &files)
        })
        .await
    }

    /// Cgroup readings of a pod: its parent cgroup when it has one, else the
    /// sum of its infra container (a sandbox without an infra process has
    /// no cgroup of its own) and containers.
    pub(crate) fn pod_cgroup(&self, sb: &SandboxRecord, containers: &[CgroupStats]) -> CgroupStats {
        let layout = self.inner.stats.layout();
        if let Some(parent) = sb.spec.cgroup_parent.as_deref().filter(|p| !p.is_empty()) {
            let s = layout.read(parent);
            if !s.is_empty() {
                return s;
            }
        }
        let infraless = sb.process.as_ref().is_some_and(|p| p.is_infraless());
        let mut total = if infraless {
            CgroupStats::default()
        } else {
            layout.read(&cgroup_path(
                sb.spec.cgroup_parent.as_deref(),
                sb.id.as_str(),
            ))
        };
        for c in containers {
            total.accumulate(c);
        }
        total
    }

    /// The interfaces of a ready pod's network namespace: read through its
    /// infra process, or, without one, through the network step's pin.
    pub(crate) async fn pod_interfaces(&self, sb: &SandboxRecord) -> Vec<InterfaceStats> {
        if sb.state != SandboxState::Ready || sb.spec.host_network() {
            return Vec::new();
        }
        let Some(process) = sb.process.as_ref() else {
            return Vec::new();
        };
        let read = match process.pid {
            Some(pid) => read_net_dev(pid).map_err(|e| e.to_string()),
            None => match sb.network.as_ref().and_then(|n| n.netns_path.clone()) {
                Some(netns) => self
                    .deps()
                    .netns_counters
                    .net_dev(netns)
                    .await
                    .map(|text| parse_net_dev(&text))
                    .map_err(|e| e.to_string()),
                None => Ok(Vec::new()),
            },
        };
        read.unwrap_or_else(|e| {
            debug!(sandbox_id = %sb.id, error = %e, "pod network stats");
            Vec::new()
        })
    }

    /// A container's stats from its cgroup reading `cg`.
    async fn container_stats_of(
        &self,
        c: &ContainerRecord,
        cg: CgroupStats,
    ) -> cri::ContainerStats {
        let now = nanos(SystemTime::now());
        let writable_layer = match self.deps().runtime.writable_layer_usage(&c.id).await {
            Ok((u, at)) => Some(cri::FilesystemUsage {
                timestamp: nanos(at),
                fs_id: Some(cri::FilesystemIdentifier {
                    mountpoint: self
                        .inner
                        .stats
                        .mountpoint(&self.deps().image_fs.0)
                        .to_owned(),
                }),
                used_bytes: Some(u64v(u.bytes)),
                inodes_used: Some(u64v(u.inodes)),
            }),
            Err(e) => {
                debug!(container_id = %c.id, error = %e, "writable layer usage");
                None
            }
        };
        cri::ContainerStats {
            attributes: Some(cri::ContainerAttributes {
                id: c.id.clone(),
                metadata: Some(cri::ContainerMetadata {
                    name: c.name.clone(),
                    attempt: c.attempt,
                }),
                labels: hash(&c.labels),
                annotations: hash(&c.annotations),
            }),
            cpu: self.inner.stats.cpu(&c.id, cg.cpu_usage_ns, now),
            memory: memory(&cg, now),
            writable_layer,
            swap: None,
        }
    }

    /// A pod's stats, from its containers and their cgroup readings.
    async fn pod_stats_of(
        &self,
        sb: &SandboxRecord,
        containers: &[(&ContainerRecord, CgroupStats)],
    ) -> cri::PodSandboxStats {
        let mut stats = Vec::with_capacity(containers.len());
        for (c, cg) in containers {
            stats.push(self.container_stats_of(c, *cg).await);
        }
        let cgroups: Vec<CgroupStats> = containers.iter().map(|(_, cg)| *cg).collect();
        let pod = self.pod_cgroup(sb, &cgroups);
        let now = nanos(SystemTime::now());
        cri::PodSandboxStats {
            attributes: Some(cri::PodSandboxAttributes {
                id: sb.id.to_string(),
                metadata: Some(cri::PodSandboxMetadata {
                    name: sb.spec.name.clone(),
                    uid: sb.spec.uid.clone(),
                    namespace: sb.spec.namespace.clone(),
                    attempt: sb.spec.attempt,
                }),
                labels: hash(&sb.spec.labels),
                annotations: hash(&sb.spec.annotations),
            }),
            linux: Some(cri::LinuxPodSandboxStats {
                cpu: self.inner.stats.cpu(sb.id.as_str(), pod.cpu_usage_ns, now),
                memory: memory(&pod, now),
                network: network(&self.pod_interfaces(sb).await, now),
                process: pod.processes.map(|n| cri::ProcessUsage {
                    timestamp: now,
                    process_count: Some(u64v(n)),
                }),
                containers: stats,
            }),
            windows: None,
        }
    }

    /// Drops the CPU samples of every container and pod not in the full
    /// lists a List*Stats call read (the containers, the sandboxes' ids).
    fn prune_samples<'a>(
        &self,
        containers: &'a [Arc<ContainerRecord>],
        sandboxes: impl Iterator<Item = &'a SandboxId>,
    ) {
        let live: HashSet<&str> = containers
            .iter()
            .map(|c| c.id.as_str())
            .chain(sandboxes.map(SandboxId::as_str))
            .collect();
        self.inner.stats.retain(&live);
    }

    pub(crate) async fn container_stats_impl(
        &self,
        r: cri::ContainerStatsRequest,
    ) -> CriResult<cri::ContainerStatsResponse> {
        if r.container_id.is_empty() {
            return Err(CriError::invalid("container_id", "must not be empty"));
        }
        let c = self.pods().require_container(&r.container_id)?;
        let sb = self.pods().sandbox(&c.sandbox_id)?;
        let cg = self
            .inner
            .stats
            .layout()
            .read_usage(&cgroup_path(parent_of(sb.as_ref()), &c.id));
        let stats = self.container_stats_of(&c, cg).await;
        Ok(cri::ContainerStatsResponse { stats: Some(stats) })
    }

    pub(crate) async fn list_container_stats_impl(
        &self,
        r: cri::ListContainerStatsRequest,
    ) -> CriResult<cri::ListContainerStatsResponse> {
        let f = r.filter.unwrap_or_default();
        // The records as the store's in-memory copy shares them: nothing
        // of a record is copied but what the response carries.
        let all_sandboxes = self.pods().list_sandboxes()?;
        let all_containers = self.pods().list_containers()?;
        let parents: HashMap<&str, Option<&str>> = all_sandboxes
            .iter()
            .map(|s| (s.id.as_str(), parent_of(Some(s))))
            .collect();
        let containers = all_containers
            .iter()
            .filter(|c| f.id.is_empty() || c.id.starts_with(&f.id))
            .filter(|c| {
                f.pod_sandbox_id.is_empty() || c.sandbox_id.as_str().starts_with(&f.pod_sandbox_id)
            })
            .filter(|c| convert::labels_match(&f.label_selector, &c.labels))
            .collect::<Vec<_>>();
        let paths = containers
            .iter()
            .map(|c| {
                let parent = parents.get(c.sandbox_id.as_str()).copied().flatten();
                cgroup_path(parent, &c.id)
            })
            .collect();
        let cgroups = self.read_cgroups(paths, false).await?;
        // A container's writable-layer usage may be a containerd round trip
        // (the first time it is asked for): overlap them, in order.
        let pending: Vec<_> = containers
            .iter()
            .zip(cgroups)
            .map(|(c, cg)| self.container_stats_of(c, cg))
            .collect();
        let stats = futures::stream::iter(pending)
            .buffered(STATS_CONCURRENCY)
            .collect::<Vec<_>>()
            .await;
        self.prune_samples(&all_containers, all_sandboxes.iter().map(|s| &s.id));
        Ok(cri::ListContainerStatsResponse { stats })
    }

    pub(crate) async fn pod_sandbox_stats_impl(
        &self,
        r: cri::PodSandboxStatsRequest,
    ) -> CriResult<cri::PodSandboxStatsResponse> {
        if r.pod_sandbox_id.is_empty() {
            return Err(CriError::invalid("pod_sandbox_id", "must not be empty"));
        }
        let sb = self
            .pods()
            .find_sandbox("pod_sandbox_id", &r.pod_sandbox_id)?
            .ok_or_else(|| CriError::not_found("pod sandbox", r.pod_sandbox_id.clone()))?;
        let containers = self.pods().containers_of(&sb.id)?;
        let layout = self.inner.stats.layout();
        let containers: Vec<_> = containers
            .iter()
            .map(|c| {
                let path = cgroup_path(parent_of(Some(&sb)), &c.id);
                (c, layout.read(&path))
            })
            .collect();
        Ok(cri::PodSandboxStatsResponse {
            stats: Some(self.pod_stats_of(&sb, &containers).await),
        })
    }

    pub(crate) async fn list_pod_sandbox_stats_impl(
        &self,
        r: cri::ListPodSandboxStatsRequest,
    ) -> CriResult<cri::ListPodSandboxStatsResponse> {
        let f = r.filter.unwrap_or_default();
        // Two reads of the store for the whole node, not one per pod.
        let all_sandboxes = self.pods().list_sandboxes()?;
        let all_containers = self.pods().list_containers()?;
        let pods: Vec<&SandboxRecord> = all_sandboxes
            .iter()
            .map(|s| &**s)
            .filter(|s| s.state == SandboxState::Ready)
            .filter(|s| f.id.is_empty() || s.id.as_str().starts_with(&f.id))
            .filter(|s| convert::labels_match(&f.label_selector, &s.spec.labels))
            .collect();
        let wanted: HashMap<&str, &SandboxRecord> =
            pods.iter().map(|s| (s.id.as_str(), *s)).collect();
        let containers: Vec<(&ContainerRecord, &SandboxRecord)> = all_containers
            .iter()
            .filter_map(|c| Some((&**c, *wanted.get(c.sandbox_id.as_str())?)))
            .collect();
        let paths = containers
            .iter()
            .map(|(c, sb)| cgroup_path(parent_of(Some(sb)), &c.id))
            .collect();
        let cgroups = self.read_cgroups(paths, true).await?;
        let mut by_pod: HashMap<&str, Vec<(&ContainerRecord, CgroupStats)>> = HashMap::new();
        for ((c, _), cg) in containers.into_iter().zip(cgroups) {
            by_pod
                .entry(c.sandbox_id.as_str())
                .or_default()
                .push((c, cg));
        }
        let pending: Vec<_> = pods
            .into_iter()
            .map(|sb| {
                let containers = by_pod.get(sb.id.as_str()).map_or(&[][..], Vec::as_slice);
                self.pod_stats_of(sb, containers)
            })
            .collect();
        let stats = futures::stream::iter(pending)
            .buffered(STATS_CONCURRENCY)
            .collect::<Vec<_>>()
            .await;
        self.prune_samples(&all_containers, all_sandboxes.iter().map(|s| &s.id));
        Ok(cri::ListPodSandboxStatsResponse { stats })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_sample_has_no_rate_second_has_one() {
        let s = StatsState::default();
        let first = s.cpu("c", Some(1_000_000_000), 10_000_000_000).unwrap();
        assert_eq!(first.usage_core_nano_seconds, Some(u64v(1_000_000_000)));
        assert_eq!(first.usage_nano_cores, None);
        // One core-second over two seconds: half a core.
        let second = s.cpu("c", Some(2_000_000_000), 12_000_000_000).unwrap();
        assert_eq!(second.usage_nano_cores, Some(u64v(500_000_000)));
        // Same instant again: no rate, and the sample kept is the older one.
        assert_eq!(
            s.cpu("c", Some(2_000_000_000), 12_000_000_000)
                .unwrap()
                .usage_nano_cores,
            None
        );
        // Another key is independent.
        assert_eq!(
            s.cpu("d", Some(5), 12_000_000_000)
                .unwrap()
                .usage_nano_cores,
            None
        );
        // No cgroup: no CPU entry.
        assert!(s.cpu("e", None, 1).is_none());
        s.retain(&["d"].into_iter().collect());
        assert_eq!(
            s.cpu("c", Some(3_000_000_000), 13_000_000_000)
                .unwrap()
                .usage_nano_cores,
            None
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readings_shared_out_among_cores_come_back_in_order() {
        for (n, cores) in [
            (0, 2),
            (5, 2),
            (31, 2),
            (32, 2),
            (33, 2),
            (250, 2),
            (250, 3),
            (100, 1),
        ] {
            let items: Vec<usize> = (0..n).collect();
            let threads = Arc::new(Mutex::new(HashSet::new()));
            let seen = Arc::clone(&threads);
            let out = in_shares(items, cores, move |i: &usize| {
                seen.lock().unwrap().insert(std::thread::current().id());
                i * 10
            })
            .await
            .unwrap();
            assert_eq!(
                out,
                (0..n).map(|i| i * 10).collect::<Vec<_>>(),
                "n={n} cores={cores}"
            );
            // Shared out: this thread and at least one blocking thread (the
            // pool may run two shares one after the other on one thread).
            let used = threads.lock().unwrap().len();
            if n >= PARALLEL_READS_FROM && cores > 1 {
                assert!(
                    (2..=cores).contains(&used),
                    "n={n} cores={cores}: {used} threads"
                );
            } else {
                assert_eq!(used, usize::from(n > 0), "n={n} cores={cores}");
            }
        }
    }

    #[test]
    fn network_prefers_eth0() {
        let i = |n: &str, rx| InterfaceStats {
            name: n.into(),
            rx_bytes: rx,
            rx_errors: 0,
            tx_bytes: 2,
            tx_errors: 0,
        };
        let n = network(&[i("net1", 5), i("eth0", 7)], 1).unwrap();
        let d = n.default_interface.unwrap();
        assert_eq!((d.name.as_str(), d.rx_bytes), ("eth0", Some(u64v(7))));
        assert_eq!(n.interfaces.len(), 2);
        assert!(network(&[], 1).is_none());
    }
}
