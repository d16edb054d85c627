//! The garbage collector: reclaims sandboxes whose teardown failed or that
//! kubelet no longer lists, and orphans (containerd containers, tasks and
//! snapshots, netns pins, IPC/UTS pins, veths, leases, sandbox directories,
//! mounts, journal entries) that belong to no known sandbox or container.
//!
//! It removes only what is Cubelet's: containerd objects that carry its
//! owner mark (`cubelet_runtime::reclaim::owner`), files under its own directories
//! with names of its own format. Whatever else shares the namespace or a
//! directory is left alone (and start-up refuses a configuration that
//! shares one with another runtime: `config::validate`).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use cubelet_engine::{Collector, GcReport, LiveSandboxes, SandboxId};
use cubelet_pod::PodService;
use cubelet_runtime::container::ContainerRuntime;
use cubelet_store::Store;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn, Instrument};

use crate::app::Parts;

/// Longest wait between retries of one failing item.
const MAX_BACKOFF: Duration = Duration::from_secs(600);

/// What one pass reclaimed, by kind.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct PassReport {
    pub(crate) reclaimed: HashMap<&'static str, u64>,
    pub(crate) failures: HashMap<&'static str, u64>,
}

/// Periodic garbage collector with per-item exponential backoff.
pub(crate) struct Gc {
    parts: Arc<Parts>,
    /// Sandbox id → (failures so far, not before).
    backoff: tokio::sync::Mutex<HashMap<SandboxId, (u32, Instant)>>,
}

impl Gc {
    pub(crate) fn new(parts: Arc<Parts>) -> Self {
        Self {
            parts,
            backoff: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Runs a pass every `gc.interval` until shutdown.
    pub(crate) async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let interval = self.parts.config.gc.interval;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            let report = self.pass().instrument(info_span!("gc")).await;
            if !report.reclaimed.is_empty() {
                info!(reclaimed = ?report.reclaimed, failures = ?report.failures, "gc pass");
            }
            crate::notify::notify_systemd("WATCHDOG=1");
        }
    }

    /// One pass: sandboxes first (through the `cleanup` flow), then orphans.
    pub(crate) async fn pass(&self) -> PassReport {
        let parts = &self.parts;
        parts.metrics.gc_run();
        let mut report = PassReport::default();
        let ttl = parts.config.gc.dead_sandbox_ttl;
        let candidates = match parts.pods.gc_candidates(ttl) {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %cubelet_engine::chain(&e), "gc: list sandboxes");
                *report.failures.entry("store").or_default() += 1;
                parts.metrics.gc_failure("store");
                return report;
            }
        };
        parts
            .metrics
            .set_gc_pending(i64::try_from(candidates.len()).unwrap_or(i64::MAX));
        let now = Instant::now();
        let due: Vec<_> = {
            let backoff = self.backoff.lock().await;
            candidates
                .into_iter()
                .filter(|c| {
                    backoff
                        .get(&c.id)
                        .is_none_or(|(_, not_before)| *not_before <= now)
                })
                .collect()
        };
        let results = futures::stream::iter(due)
            .map(|rec| async move {
                let result = parts.pods.remove_sandbox(rec.id.as_str()).await;
                (rec.id, result)
            })
            .buffer_unordered(parts.config.gc.concurrency.max(1))
            .collect::<Vec<_>>()
            .await;
        {
            let mut backoff = self.backoff.lock().await;
            for (id, result) in results {
                match result {
                    Ok(_) => {
                        backoff.remove(&id);
                        *report.reclaimed.entry("sandbox").or_default() += 1;
                    }
                    Err(e) => {
                        let entry = backoff.entry(id.clone()).or_insert((0, now));
                        entry.0 += 1;
                        let wait = backoff_delay(parts.config.gc.interval, entry.0);
                        entry.1 = Instant::now() + wait;
                        warn!(sandbox_id = %id, retry_in = ?wait, error = %cubelet_engine::chain(&e), "gc: cleanup failed");
                        *report.failures.entry("sandbox").or_default() += 1;
                    }
                }
            }
        }

        // Orphans: anything of a sandbox the store does not know. A sandbox
        // is recorded before any of its objects is made, so every collector
        // lists its objects first and reads the store after it: whatever a
        // listing saw has its record by then. (A set read once at the start
        // would let a create that begins during the pass lose its directory
        // or netns.)
        let live = StoreLive {
            store: &parts.store,
            failed: AtomicBool::new(false),
        };
        let containerd = ContainerdOrphans {
            runtime: &parts.runtime,
            store: &parts.store,
            pods: &parts.pods,
            concurrency: parts.config.gc.concurrency.max(1),
        };
        let network = parts.network.collector();
        let journal = JournalOrphans {
            store: &parts.store,
        };
        let collectors: [&dyn Collector; 6] = [
            &containerd,
            // Shims whose task containerd forgot (it lists its tasks itself).
            &*parts.runtime,
            network,
            // IPC/UTS pins of sandboxes without an infra process.
            &parts.podns,
            &*parts.storage,
            &journal,
        ];
        for collector in collectors {
            let found = collector
                .collect(&live)
                .instrument(info_span!("collect", collector = collector.name()))
                .await;
            for (kind, error) in &found.failures {
                warn!(kind, %error, "gc failure");
            }
            for (kind, n) in found.failure_counts() {
                *report.failures.entry(kind).or_default() += n;
            }
            for (kind, n) in found.reclaimed {
                *report.reclaimed.entry(kind).or_default() += n;
            }
        }
        if live.failed.load(Ordering::Relaxed) {
            *report.failures.entry("store").or_default() += 1;
        }
        for (kind, n) in &report.reclaimed {
            parts.metrics.gc_reclaimed(kind, *n);
        }
        for (kind, n) in &report.failures {
            for _ in 0..*n {
                parts.metrics.gc_failure(kind);
            }
        }
        parts.metrics_sandboxes();
        debug!(?report, "gc pass done");
        report
    }
}

/// containerd containers, tasks and rootfs snapshots that carry Cubelet's
/// owner mark and belong to neither a live sandbox (its infra container)
/// nor a container the store knows (or one whose removal is under way), and
/// marked extraction snapshots of pulls that died. Unmarked objects the
/// store knows (made before the mark) are adopted: marked, not removed.
struct ContainerdOrphans<'a> {
    runtime: &'a ContainerRuntime,
    store: &'a Store,
    pods: &'a PodService,
    concurrency: usize,
}

#[async_trait]
impl Collector for ContainerdOrphans<'_> {
    fn name(&self) -> &'static str {
        "containerd"
    }

    async fn collect(&self, live: &dyn LiveSandboxes) -> GcReport {
        let mut report = GcReport::default();
        let inv = match self.runtime.inventory().await {
            Ok(inv) => inv,
            Err(e) => {
                report.fail("containerd", &e);
                return report;
            }
        };
        let Some(live) = live.now() else {
            return report;
        };
        let containers = match self.store.list_containers() {
            Ok(c) => c,
            Err(e) => {
                report.fail("containerd", &e);
                return report;
            }
        };
        // Asked after the store: a removal is registered before its record
        // goes (see the pod crate's `removals`).
        let removing = self.pods.removing();
        let known: HashSet<&str> = live
            .iter()
            .map(SandboxId::as_str)
            .chain(containers.iter().map(|c| c.id.as_str()))
            .chain(removing.iter().map(String::as_str))
            .collect();
        let all = inv.ids();
        let (foreign, orphans): (Vec<&str>, Vec<&str>) = all
            .iter()
            .copied()
            .filter(|id| !known.contains(id))
            .partition(|id| !inv.owned(id));
        if !foreign.is_empty() {
            debug!(count = foreign.len(), ids = ?foreign, "gc: left alone containerd objects without Cubelet's mark");
        }
        let orphans: Vec<String> = orphans.into_iter().map(str::to_owned).collect();
        // The store's own objects that lack the mark: adopted. (Not the
        // ones being removed: they go anyway.)
        let ours = live
            .iter()
            .map(SandboxId::as_str)
            .chain(containers.iter().map(|c| c.id.as_str()));
        let (adopt_containers, adopt_snapshots) = inv.unmarked(ours);
        for id in &adopt_containers {
            match self.runtime.adopt_container(id).await {
                Ok(()) => {
                    info!(container_id = %id, "gc: marked a container of the store as Cubelet's")
                }
                Err(e) => report.fail("containerd", &e),
            }
        }
        for key in &adopt_snapshots {
            match self.runtime.adopt_snapshot(key).await {
                Ok(()) => info!(snapshot = %key, "gc: marked a snapshot of the store as Cubelet's"),
                Err(e) => report.fail("containerd", &e),
            }
        }
        let results = futures::stream::iter(orphans)
            .map(|id: String| async move {
                let result = self.runtime.remove(&id).await;
                (id, result)
            })
            .buffer_unordered(self.concurrency)
            .collect::<Vec<_>>()
            .await;
        for (id, result) in results {
            match result {
                Ok(()) => {
                    debug!(container_id = %id, "gc: removed orphan containerd objects");
                    report.add("container", usize::from(inv.containers.contains(&id)));
                    report.add("task", usize::from(inv.tasks.contains(&id)));
                    report.add("snapshot", usize::from(inv.snapshots.contains(&id)));
                    report.add("mount", usize::from(inv.staged.contains(&id)));
                }
                Err(e) => report.fail("containerd", &e),
            }
        }
        for key in &inv.stale_extracts {
            match self.runtime.remove_extract_snapshot(key).await {
                Ok(()) => report.add("snapshot", 1),
                Err(e) => report.fail("containerd", &e),
            }
        }
        report
    }
}

/// Finished journal entries of sandboxes the store no longer has.
struct JournalOrphans<'a> {
    store: &'a Store,
}

#[async_trait]
impl Collector for JournalOrphans<'_> {
    fn name(&self) -> &'static str {
        "journal"
    }

    async fn collect(&self, live: &dyn LiveSandboxes) -> GcReport {
        let mut report = GcReport::default();
        let flows = match self.store.list_flows() {
            Ok(flows) => flows,
            Err(e) => {
                report.fail("journal", &e);
                return report;
            }
        };
        let Some(known) = live.now() else {
            return report;
        };
        let orphans: HashSet<SandboxId> = flows
            .into_iter()
            .filter(|f| !f.state.is_open() && !known.contains(&f.sandbox_id))
            .map(|f| f.sandbox_id)
            .collect();
        for id in orphans {
            match cubelet_engine::blocking(|| cubelet_engine::Journal::forget(self.store, &id)) {
                Ok(n) => report.add("journal", n),
                Err(e) => report.fail("journal", &e),
            }
        }
        report
    }
}

/// How long an item that failed `failures` times in a row waits before the
/// next attempt: the GC interval doubled per failure, at most [`MAX_BACKOFF`].
fn backoff_delay(interval: Duration, failures: u32) -> Duration {
    interval
        .saturating_mul(1u32 << failures.min(10))
        .min(MAX_BACKOFF)
}

/// The store's sandbox and warm-pool shell records, read afresh (in one
/// transaction) each time a collector asks: a shell's objects are live
/// while its record is (it is written before its `prewarm` flow acts and
/// becomes its pod's sandbox record in one transaction), and an orphaned
/// shell's, whose record is gone, are reclaimed like any sandbox's.
struct StoreLive<'a> {
    store: &'a Store,
    /// Set when a read failed (the collector then removed nothing).
    failed: AtomicBool,
}

impl LiveSandboxes for StoreLive<'_> {
    fn now(&self) -> Option<HashSet<SandboxId>> {
        match self.store.sandbox_and_shell_ids() {
            Ok(all) => Some(all.into_iter().collect()),
            Err(e) => {
                warn!(error = %cubelet_engine::chain(&e), "gc: list sandboxes");
                self.failed.store(true, Ordering::Relaxed);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_per_failure_up_to_the_cap() {
        let i = Duration::from_secs(1);
        let waits: Vec<u64> = (1..=4).map(|n| backoff_delay(i, n).as_secs()).collect();
        assert_eq!(waits, [2, 4, 8, 16]);
        assert_eq!(backoff_delay(i, 30), MAX_BACKOFF);
        assert_eq!(backoff_delay(Duration::from_secs(60), 5), MAX_BACKOFF);
        assert_eq!(backoff_delay(Duration::MAX, 3), MAX_BACKOFF);
    }
}
