//! Stats of containers and pods: cgroup readings, writable-layer usage and
//! network counters, read through the [`Runtime`](crate::Runtime), with
//! CPU rates from the previous sample of the same container or pod. The
//! samples and the cgroup files kept open between calls live here, with the
//! service that creates and removes what they describe: removing a
//! container or a pod forgets its state.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use cubelet_engine::SandboxId;
use cubelet_runtime::stats::{cpu_nano_cores, CpuSample, OpenFiles};
use cubelet_store::{ContainerRecord, SandboxRecord, SandboxState};
use futures::StreamExt;
use tracing::debug;

use crate::error::{PodError, PodResult};
use crate::runtime::Runtime;
use crate::service::PodService;

pub use cubelet_runtime::stats::{
    CgroupStats, InterfaceStats, IoStats, MemoryStats, Pressure, PsiData, PsiStats, SnapshotUsage,
};

/// CPU usage at one instant, with the rate since the previous sample of
/// the same container or pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuUsage {
    /// When it was read, in nanoseconds since the Unix epoch.
    pub timestamp_ns: i64,
    /// Cumulative CPU time, in nanoseconds.
    pub usage_ns: u64,
    /// Cores used since the previous sample, in billionths of a core;
    /// `None` for the first sample (or two in the same instant).
    pub nano_cores: Option<u64>,
}

/// One container's stats.
#[derive(Debug, Clone)]
pub struct ContainerStats {
    /// The container.
    pub container: Arc<ContainerRecord>,
    /// When the cgroup was read.
    pub at: SystemTime,
    /// Its cgroup's readings (empty once the cgroup is gone).
    pub cgroup: CgroupStats,
    /// CPU usage and rate (`None` without a cgroup, or when not asked for).
    pub cpu: Option<CpuUsage>,
    /// Usage of its writable layer and when it was read (`None` when
    /// unknown, or when not asked for).
    pub writable_layer: Option<(SnapshotUsage, SystemTime)>,
}

/// One pod's stats.
#[derive(Debug, Clone)]
pub struct PodStats {
    /// The pod's sandbox.
    pub sandbox: Arc<SandboxRecord>,
    /// When it was read.
    pub at: SystemTime,
    /// The pod's cgroup readings: its parent cgroup when it has one, else
    /// the sum of its infra container and containers.
    pub cgroup: CgroupStats,
    /// CPU usage and rate (`None` when not asked for).
    pub cpu: Option<CpuUsage>,
    /// The interfaces of its network namespace (none for host network, or
    /// a pod that is not ready).
    pub interfaces: Vec<InterfaceStats>,
    /// Its containers' stats.
    pub containers: Vec<ContainerStats>,
}

/// The stats state of the service: the last CPU sample per container or
/// pod, and the containers' cgroup files kept open between List*Stats
/// calls.
#[derive(Debug, Default)]
pub(crate) struct StatsState {
    cpu: Mutex<HashMap<String, CpuSample>>,
    files: Arc<OpenFiles>,
}

impl StatsState {
    /// CPU usage of `key` at `now`, with the rate since its previous sample.
    fn cpu(&self, key: &str, usage_ns: Option<u64>, now: SystemTime) -> Option<CpuUsage> {
        let usage_ns = usage_ns?;
        let cur = CpuSample {
            timestamp_ns: nanos(now),
            usage_ns,
        };
        let mut samples = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
        let prev = samples.get(key).copied();
        let nano_cores = prev.and_then(|prev| cpu_nano_cores(&prev, &cur));
        // Two calls in the same instant: keep the older sample.
        if prev.is_none() || nano_cores.is_some() {
            samples.insert(key.to_owned(), cur);
        }
        Some(CpuUsage {
            timestamp_ns: cur.timestamp_ns,
            usage_ns,
            nano_cores,
        })
    }

    /// Forgets the sample of `key` (a container or pod being removed) and
    /// closes its cgroup files.
    pub(crate) fn forget(&self, key: &str) {
        self.cpu
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
        self.files.retain(|id| id != key);
    }

    /// Forgets the samples of containers and pods not in `live`, and closes
    /// their cgroup files (those removed otherwise, by the GC).
    fn retain(&self, live: &HashSet<&str>) {
        let mut samples = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
        samples.retain(|k, _| live.contains(k.as_str()));
        drop(samples);
        self.files.retain(|id| live.contains(id));
    }

    /// How many samples are kept (for tests).
    #[cfg(test)]
    pub(crate) fn samples(&self) -> usize {
        self.cpu.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// Nanoseconds since the Unix epoch.
fn nanos(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// Containers or pods whose stats are gathered at once by the list calls
/// (their runtime round trips overlap).
const STATS_CONCURRENCY: usize = 16;

/// Cgroups a list call reads on one thread; from this many on they are
/// shared out among the cores.
const PARALLEL_READS_FROM: usize = 32;

/// The cores the list calls share their cgroup reads among, asked once
/// (`available_parallelism` reads the process's cgroup files).
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get))
}

/// `read` of every item, in order, the items shared out among `cores`:
/// the last share is read on this thread, the others on blocking threads.
/// Fewer than [`PARALLEL_READS_FROM`] items are all read here.
async fn in_shares<T, R, F>(items: Vec<T>, cores: usize, read: F) -> PodResult<Vec<R>>
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
        out.extend(task.await.map_err(|e| PodError::TaskDied {
            what: "cgroup reading",
            reason: e.to_string(),
        })?);
    }
    out.extend(mine);
    Ok(out)
}

/// The cgroup parent of pod `sb`, if it is known.
fn parent_of(sb: Option<&SandboxRecord>) -> Option<&str> {
    sb.and_then(|s| s.spec.cgroup_parent.as_deref())
}

/// How a container's cgroup is read.
#[derive(Debug, Clone, Copy)]
enum Reading {
    /// Usage only (no process count), as a container's stats carry.
    Usage,
    /// Everything, process count included.
    Full,
}

impl PodService {
    pub(crate) fn stats(&self) -> &StatsState {
        &self.inner.stats
    }

    /// The readings of the cgroup at `path`, through the runtime.
    fn read_cgroup(&self, path: &str, reading: Reading) -> CgroupStats {
        self.runtime()
            .read_cgroup(path, matches!(reading, Reading::Full), None)
    }

    /// Reads the cgroups at `paths`, in order, a share of them per core on
    /// blocking threads, through the files kept open from the last call
    /// (a reading is three to five cgroup files of a few microseconds
    /// each, times every container on the node).
    async fn read_cgroups(
        &self,
        paths: Vec<String>,
        reading: Reading,
    ) -> PodResult<Vec<CgroupStats>> {
        let runtime: Arc<dyn Runtime> = Arc::clone(&self.deps().runtime);
        let files = Arc::clone(&self.inner.stats.files);
        let processes = matches!(reading, Reading::Full);
        in_shares(paths, cores(), move |p: &String| {
            runtime.read_cgroup(p, processes, Some(&files))
        })
        .await
    }

    /// The cgroup readings of a pod: its parent cgroup when it has one,
    /// else the sum of its infra container (a sandbox without an infra
    /// process has no cgroup of its own) and containers.
    fn pod_cgroup(&self, sb: &SandboxRecord, containers: &[CgroupStats]) -> CgroupStats {
        let parent = sb.spec.cgroup_parent.as_deref();
        if let Some(dir) = parent.and_then(|p| self.runtime().pod_cgroup(p)) {
            let s = self.read_cgroup(&dir, Reading::Full);
            if !s.is_empty() {
                return s;
            }
        }
        let infraless = sb.process.as_ref().is_some_and(|p| p.is_infraless());
        let mut total = if infraless {
            CgroupStats::default()
        } else {
            self.read_cgroup(
                &self.runtime().container_cgroup(parent, sb.id.as_str()),
                Reading::Full,
            )
        };
        for c in containers {
            total.accumulate(c);
        }
        total
    }

    /// The interfaces of a ready pod's network namespace: read through its
    /// infra process, or, without one, through the network step's pin.
    async fn pod_interfaces(&self, sb: &SandboxRecord) -> Vec<InterfaceStats> {
        if sb.state != SandboxState::Ready || sb.spec.host_network() {
            return Vec::new();
        }
        let Some(process) = sb.process.as_ref() else {
            return Vec::new();
        };
        let netns = sb.network.as_ref().and_then(|n| n.netns_path.clone());
        if process.pid.is_none() && netns.is_none() {
            return Vec::new();
        }
        self.runtime()
            .pod_interfaces(process.pid, netns)
            .await
            .unwrap_or_else(|e| {
                debug!(sandbox_id = %sb.id, error = %e, "pod network stats");
                Vec::new()
            })
    }

    /// A container's stats from its cgroup reading `cgroup`, with its CPU
    /// rate and writable layer.
    async fn container_stats_of(
        &self,
        c: Arc<ContainerRecord>,
        cgroup: CgroupStats,
    ) -> ContainerStats {
        let at = SystemTime::now();
        let writable_layer = match self.runtime().writable_layer_usage(&c.id).await {
            Ok(u) => Some(u),
            Err(e) => {
                debug!(container_id = %c.id, error = %e, "writable layer usage");
                None
            }
        };
        ContainerStats {
            cpu: self.stats().cpu(&c.id, cgroup.cpu_usage_ns, at),
            container: c,
            at,
            cgroup,
            writable_layer,
        }
    }

    /// A pod's stats, from its containers and their cgroup readings; with
    /// `samples`, CPU rates and writable layers too.
    async fn pod_stats_of(
        &self,
        sb: Arc<SandboxRecord>,
        containers: Vec<(Arc<ContainerRecord>, CgroupStats)>,
        samples: bool,
    ) -> PodStats {
        let cgroups: Vec<CgroupStats> = containers.iter().map(|(_, cg)| *cg).collect();
        let mut stats = Vec::with_capacity(containers.len());
        for (c, cgroup) in containers {
            stats.push(if samples {
                self.container_stats_of(c, cgroup).await
            } else {
                ContainerStats {
                    container: c,
                    at: SystemTime::now(),
                    cgroup,
                    cpu: None,
                    writable_layer: None,
                }
            });
        }
        let cgroup = self.pod_cgroup(&sb, &cgroups);
        let at = SystemTime::now();
        let cpu = if samples {
            self.stats().cpu(sb.id.as_str(), cgroup.cpu_usage_ns, at)
        } else {
            None
        };
        let interfaces = self.pod_interfaces(&sb).await;
        PodStats {
            sandbox: sb,
            at,
            cgroup,
            cpu,
            interfaces,
            containers: stats,
        }
    }

    /// Drops the CPU samples of every container and pod not in the full
    /// lists a list call read (the containers, the sandboxes' ids).
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
        self.stats().retain(&live);
    }

    /// ContainerStats: the stats of the container `id` names (a full id or
    /// a unique prefix).
    pub async fn container_stats(&self, id: &str) -> PodResult<ContainerStats> {
        let c = self.require_container(id)?;
        let sb = self.sandbox(&c.sandbox_id)?;
        let dir = self
            .runtime()
            .container_cgroup(parent_of(sb.as_ref()), &c.id);
        let cg = self.read_cgroup(&dir, Reading::Usage);
        Ok(self.container_stats_of(Arc::new(c), cg).await)
    }

    /// ListContainerStats: the stats of every container `keep` accepts, in
    /// the store's order. Forgets the samples of what no longer exists.
    pub async fn list_container_stats(
        &self,
        keep: impl Fn(&ContainerRecord) -> bool,
    ) -> PodResult<Vec<ContainerStats>> {
        // The records as the store's in-memory copy shares them: nothing
        // of a record is copied.
        let all_sandboxes = self.list_sandboxes()?;
        let all_containers = self.list_containers()?;
        let parents: HashMap<&str, Option<&str>> = all_sandboxes
            .iter()
            .map(|s| (s.id.as_str(), parent_of(Some(s))))
            .collect();
        let containers: Vec<&Arc<ContainerRecord>> =
            all_containers.iter().filter(|c| keep(c)).collect();
        let paths = containers
            .iter()
            .map(|c| {
                let parent = parents.get(c.sandbox_id.as_str()).copied().flatten();
                self.runtime().container_cgroup(parent, &c.id)
            })
            .collect();
        let cgroups = self.read_cgroups(paths, Reading::Usage).await?;
        // A container's writable-layer usage may be a runtime round trip
        // (the first time it is asked for): overlap them, in order.
        let pending: Vec<_> = containers
            .into_iter()
            .zip(cgroups)
            .map(|(c, cg)| self.container_stats_of(Arc::clone(c), cg))
            .collect();
        let stats = futures::stream::iter(pending)
            .buffered(STATS_CONCURRENCY)
            .collect::<Vec<_>>()
            .await;
        self.prune_samples(&all_containers, all_sandboxes.iter().map(|s| &s.id));
        Ok(stats)
    }

    /// PodSandboxStats: the stats of the pod `id` names (`field` names the
    /// request field in errors).
    pub async fn pod_stats(&self, field: &str, id: &str) -> PodResult<PodStats> {
        let sb = self.require_sandbox(field, id)?;
        let containers = self
            .containers_of(&sb.id)?
            .into_iter()
            .map(|c| {
                let dir = self.runtime().container_cgroup(parent_of(Some(&sb)), &c.id);
                let cg = self.read_cgroup(&dir, Reading::Full);
                (Arc::new(c), cg)
            })
            .collect();
        Ok(self.pod_stats_of(Arc::new(sb), containers, true).await)
    }

    /// ListPodSandboxStats: the stats of every ready pod `keep` accepts.
    /// Forgets the samples of what no longer exists.
    pub async fn list_pod_stats(
        &self,
        keep: impl Fn(&SandboxRecord) -> bool,
    ) -> PodResult<Vec<PodStats>> {
        // Two reads of the store for the whole node, not one per pod.
        let all_sandboxes = self.list_sandboxes()?;
        let all_containers = self.list_containers()?;
        let stats = self
            .read_pods(&all_sandboxes, &all_containers, |s| keep(s), |_| true, true)
            .await?;
        self.prune_samples(&all_containers, all_sandboxes.iter().map(|s| &s.id));
        Ok(stats)
    }

    /// The cgroup and network readings of every ready pod and its running
    /// containers, without CPU rates or writable layers: what the
    /// cAdvisor-named metrics report.
    pub async fn pod_readings(&self) -> PodResult<Vec<PodStats>> {
        let all_sandboxes = self.list_sandboxes()?;
        let all_containers = self.list_containers()?;
        self.read_pods(
            &all_sandboxes,
            &all_containers,
            |_| true,
            |c| c.state == crate::ContainerState::Running,
            false,
        )
        .await
    }

    /// The stats of the ready pods `keep_pod` accepts, with their
    /// containers `keep_container` accepts.
    async fn read_pods(
        &self,
        all_sandboxes: &[Arc<SandboxRecord>],
        all_containers: &[Arc<ContainerRecord>],
        keep_pod: impl Fn(&SandboxRecord) -> bool,
        keep_container: impl Fn(&ContainerRecord) -> bool,
        samples: bool,
    ) -> PodResult<Vec<PodStats>> {
        let pods: Vec<&Arc<SandboxRecord>> = all_sandboxes
            .iter()
            .filter(|s| s.state == SandboxState::Ready && keep_pod(s))
            .collect();
        let wanted: HashMap<&str, &SandboxRecord> = pods
            .iter()
            .copied()
            .map(|s| (s.id.as_str(), &**s))
            .collect();
        let containers: Vec<(&Arc<ContainerRecord>, &SandboxRecord)> = all_containers
            .iter()
            .filter(|c| keep_container(c))
            .filter_map(|c| Some((c, *wanted.get(c.sandbox_id.as_str())?)))
            .collect();
        let paths = containers
            .iter()
            .map(|(c, sb)| self.runtime().container_cgroup(parent_of(Some(sb)), &c.id))
            .collect();
        let cgroups = self.read_cgroups(paths, Reading::Full).await?;
        let mut by_pod: HashMap<&str, Vec<(Arc<ContainerRecord>, CgroupStats)>> = HashMap::new();
        for ((c, _), cg) in containers.into_iter().zip(cgroups) {
            by_pod
                .entry(c.sandbox_id.as_str())
                .or_default()
                .push((Arc::clone(c), cg));
        }
        let pending: Vec<_> = pods
            .into_iter()
            .map(|sb| {
                let containers = by_pod.remove(sb.id.as_str()).unwrap_or_default();
                self.pod_stats_of(Arc::clone(sb), containers, samples)
            })
            .collect();
        Ok(futures::stream::iter(pending)
            .buffered(STATS_CONCURRENCY)
            .collect::<Vec<_>>()
            .await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn first_sample_has_no_rate_second_has_one() {
        let s = StatsState::default();
        let first = s.cpu("c", Some(1_000_000_000), at(10)).unwrap();
        assert_eq!(first.usage_ns, 1_000_000_000);
        assert_eq!(first.nano_cores, None);
        // One core-second over two seconds: half a core.
        let second = s.cpu("c", Some(2_000_000_000), at(12)).unwrap();
        assert_eq!(second.nano_cores, Some(500_000_000));
        // Same instant again: no rate, and the sample kept is the older one.
        assert_eq!(
            s.cpu("c", Some(2_000_000_000), at(12)).unwrap().nano_cores,
            None
        );
        // Another key is independent.
        assert_eq!(s.cpu("d", Some(5), at(12)).unwrap().nano_cores, None);
        // No cgroup: no CPU entry.
        assert!(s.cpu("e", None, at(1)).is_none());
        s.retain(&["d"].into_iter().collect());
        assert_eq!(
            s.cpu("c", Some(3_000_000_000), at(13)).unwrap().nano_cores,
            None
        );
        s.forget("c");
        s.forget("d");
        assert_eq!(s.samples(), 0);
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
}
