//! [`Metrics`]: every Prometheus metric of the node agent, and the engine's
//! [`FlowObserver`] implementation.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use cubelet_engine::{FlowKind, FlowObserver, Outcome};
use prometheus::core::Collector;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

use crate::error::MetricsError;

/// Histogram buckets of every duration metric, in seconds: 0.5 ms to 30 s.
pub const DURATION_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The `kind` label values of `cubelet_gc_reclaimed_total` the GC reports
/// (sandboxes, containerd objects, shims, network, pod namespace pins,
/// storage and journal objects); each series is exported at 0 from the start.
pub const GC_RECLAIMED_KINDS: &[&str] = &[
    "sandbox",
    "container",
    "task",
    "snapshot",
    "shim",
    "netns",
    "podns",
    "veth",
    "lease",
    "port_rule",
    "cni_attachment",
    "directory",
    "mount",
    "journal",
];

/// The `kind` label values of `cubelet_gc_failures_total` the GC reports
/// (what it failed to list or reclaim); each series is exported at 0 from
/// the start.
pub const GC_FAILURE_KINDS: &[&str] = &[
    "store",
    "sandbox",
    "containerd",
    "shim",
    "network",
    "podns",
    "storage",
    "journal",
];

/// Histogram buckets of `cubelet_image_pull_duration_seconds`: 0.1 s to
/// 10 min, since a pull of a large image takes minutes.
pub(crate) const PULL_DURATION_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// The `size` label values of `cubelet_image_pull_duration_seconds`: the
/// pulled image's size class (per-image labels would be unbounded), or
/// `unknown` for a pull that failed.
pub(crate) const PULL_SIZE_CLASSES: &[&str] = &[
    "lt_10MiB",
    "10MiB_to_100MiB",
    "100MiB_to_1GiB",
    "ge_1GiB",
    "unknown",
];

/// The size class of an image of `size` bytes (`None`: a failed pull).
pub(crate) fn pull_size_class(size: Option<u64>) -> &'static str {
    const MIB: u64 = 1 << 20;
    match size {
        None => "unknown",
        Some(s) if s < 10 * MIB => "lt_10MiB",
        Some(s) if s < 100 * MIB => "10MiB_to_100MiB",
        Some(s) if s < 1024 * MIB => "100MiB_to_1GiB",
        Some(_) => "ge_1GiB",
    }
}

/// The outcomes a rollback is reported with (`result` of
/// `cubelet_flow_rollbacks_total`): it either finished or failed.
const ROLLBACK_OUTCOMES: [Outcome; 2] = [Outcome::Ok, Outcome::Error];

/// The node agent's metrics, registered in a caller-supplied registry.
///
/// Cheap to clone (one `Arc`); clones update the same metrics. Every method
/// is lock-free apart from the label lookup of labelled metrics, so it may be
/// called on hot paths. Label values must come from small fixed sets (flow,
/// step, gRPC method, status code, state, kind): never pass a sandbox or
/// container id.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

struct Inner {
    flow_duration: HistogramVec,
    step_duration: HistogramVec,
    rollbacks: IntCounterVec,
    /// Per-flow handles, indexed by [`flow_index`], resolved once.
    per_flow: [PerFlow; 4],
    cri_requests: IntCounterVec,
    cri_duration: HistogramVec,
    sandboxes: IntGaugeVec,
    gc_reclaimed: IntCounterVec,
    gc_runs: IntCounter,
    gc_failures: IntCounterVec,
    gc_pending: IntGauge,
    events_dropped: IntCounter,
    pool_hit: IntCounter,
    pool_miss: IntCounter,
    anchor_started: IntCounter,
    anchor_failed: IntCounter,
    shell_hits: IntCounter,
    shell_misses: IntCounter,
    shells_ready: IntGauge,
    pulls_in_flight: IntGauge,
    pull_duration: HistogramVec,
}

struct PerFlow {
    /// `cubelet_flow_admission_wait_seconds{flow, result="admitted"}`.
    waited_admitted: Histogram,
    /// `cubelet_flow_admission_wait_seconds{flow, result="rejected"}`.
    waited_rejected: Histogram,
    rejections: IntCounter,
    inflight: IntGauge,
    limit: IntGauge,
}

fn flow_index(flow: FlowKind) -> usize {
    match flow {
        FlowKind::Create => 0,
        FlowKind::Destroy => 1,
        FlowKind::Cleanup => 2,
        FlowKind::Prewarm => 3,
    }
}

fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn saturating_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Creates a metric and registers it, naming it in any error.
fn register<C>(
    registry: &Registry,
    name: &'static str,
    metric: Result<C, prometheus::Error>,
) -> Result<C, MetricsError>
where
    C: Collector + Clone + 'static,
{
    let metric = metric.map_err(|source| MetricsError::Register { name, source })?;
    registry
        .register(Box::new(metric.clone()))
        .map_err(|source| MetricsError::Register { name, source })?;
    Ok(metric)
}

fn histogram(
    registry: &Registry,
    name: &'static str,
    help: &str,
    labels: &[&str],
) -> Result<HistogramVec, MetricsError> {
    let opts = HistogramOpts::new(name, help).buckets(DURATION_BUCKETS.to_vec());
    register(registry, name, HistogramVec::new(opts, labels))
}

fn counter_vec(
    registry: &Registry,
    name: &'static str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, MetricsError> {
    register(
        registry,
        name,
        IntCounterVec::new(Opts::new(name, help), labels),
    )
}

fn gauge_vec(
    registry: &Registry,
    name: &'static str,
    help: &str,
    labels: &[&str],
) -> Result<IntGaugeVec, MetricsError> {
    register(
        registry,
        name,
        IntGaugeVec::new(Opts::new(name, help), labels),
    )
}

/// Registers Prometheus' standard process collector for this process:
/// `process_cpu_seconds_total`, `process_open_fds`, `process_max_fds`,
/// `process_virtual_memory_bytes`, `process_resident_memory_bytes`,
/// `process_start_time_seconds` and `process_threads`, read from `/proc` at
/// each scrape.
#[cfg(target_os = "linux")]
fn register_process_collector(registry: &Registry) -> Result<(), MetricsError> {
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .map_err(|source| MetricsError::Register {
            name: "process_*",
            source,
        })
}

/// No `/proc` to read: no process metrics.
#[cfg(not(target_os = "linux"))]
fn register_process_collector(_registry: &Registry) -> Result<(), MetricsError> {
    Ok(())
}

impl Metrics {
    /// Creates every metric and registers it in `registry` (never the global
    /// default). `version` is exported as `cubelet_build_info{version}` = 1.
    ///
    /// Labelled counters whose label values are known up front (per flow,
    /// rollback result, GC kind, pool result) are exported at 0 from the
    /// first scrape, so a rate or an alert on them has data before the first
    /// event. The standard `process_*` metrics of this process (CPU, memory,
    /// file descriptors, start time, threads) are registered too.
    ///
    /// Fails if a metric of the same name is already registered there.
    pub fn new(registry: &Registry, version: &str) -> Result<Metrics, MetricsError> {
        let flow_duration = histogram(
            registry,
            "cubelet_flow_duration_seconds",
            "Duration of sandbox flows, by flow and result (ok, error, cancelled).",
            &["flow", "result"],
        )?;
        let step_duration = histogram(
            registry,
            "cubelet_flow_step_duration_seconds",
            "Duration of flow steps, by flow, step (provider) and result.",
            &["flow", "step", "result"],
        )?;
        let rejections = counter_vec(
            registry,
            "cubelet_flow_rejections_total",
            "Flows rejected at admission because their concurrency limit was reached.",
            &["flow"],
        )?;
        let admission_wait = histogram(
            registry,
            "cubelet_flow_admission_wait_seconds",
            "Time requests waited for a slot of a full flow, by flow and result \
             (admitted, rejected); requests admitted at once are not counted.",
            &["flow", "result"],
        )?;
        let inflight = gauge_vec(
            registry,
            "cubelet_flow_inflight",
            "Flows running now, including rollbacks.",
            &["flow"],
        )?;
        let limit = gauge_vec(
            registry,
            "cubelet_flow_limit",
            "Concurrency limit of each flow; 0 means unlimited.",
            &["flow"],
        )?;
        let rollbacks = counter_vec(
            registry,
            "cubelet_flow_rollbacks_total",
            "Rollbacks (failover destroy) run for failed flows, by flow and result.",
            &["flow", "result"],
        )?;
        let cri_requests = counter_vec(
            registry,
            "cubelet_cri_requests_total",
            "CRI requests served, by gRPC method and status code.",
            &["method", "code"],
        )?;
        let cri_duration = histogram(
            registry,
            "cubelet_cri_request_duration_seconds",
            "Duration of CRI requests, by gRPC method.",
            &["method"],
        )?;
        let sandboxes = gauge_vec(
            registry,
            "cubelet_sandboxes",
            "Pod sandboxes known to the node, by state.",
            &["state"],
        )?;
        let gc_reclaimed = counter_vec(
            registry,
            "cubelet_gc_reclaimed_total",
            "Objects reclaimed by garbage collection, by kind.",
            &["kind"],
        )?;
        let gc_runs = register(
            registry,
            "cubelet_gc_runs_total",
            IntCounter::new("cubelet_gc_runs_total", "Garbage collection passes run."),
        )?;
        let gc_failures = counter_vec(
            registry,
            "cubelet_gc_failures_total",
            "Objects garbage collection failed to reclaim, by kind.",
            &["kind"],
        )?;
        let gc_pending = register(
            registry,
            "cubelet_gc_pending",
            IntGauge::new(
                "cubelet_gc_pending",
                "Objects waiting to be garbage collected.",
            ),
        )?;
        let events_dropped = register(
            registry,
            "cubelet_events_dropped_total",
            IntCounter::new(
                "cubelet_events_dropped_total",
                "Container events dropped because a subscriber was too slow.",
            ),
        )?;
        let storage_pool = counter_vec(
            registry,
            "cubelet_storage_pool_total",
            "Sandbox storage requests served from the warm pool (hit) or built (miss).",
            &["result"],
        )?;
        let anchors = counter_vec(
            registry,
            "cubelet_stats_anchors_total",
            "Stats anchors of pods without an infra process started, or failed to start (the pod's network is then missing from kubelet's cAdvisor).",
            &["result"],
        )?;
        let shell_hits = register(
            registry,
            "cubelet_pool_hits_total",
            IntCounter::new(
                "cubelet_pool_hits_total",
                "RunPodSandbox calls that claimed a ready warm-pool shell.",
            ),
        )?;
        let shell_misses = register(
            registry,
            "cubelet_pool_misses_total",
            IntCounter::new(
                "cubelet_pool_misses_total",
                "RunPodSandbox calls, with the warm pool on, that took the cold path (no ready shell, or a pod no shell fits).",
            ),
        )?;
        let shells_ready = register(
            registry,
            "cubelet_pool_ready",
            IntGauge::new(
                "cubelet_pool_ready",
                "Warm-pool shells ready to be claimed.",
            ),
        )?;
        let build_info = gauge_vec(
            registry,
            "cubelet_build_info",
            "Build information; the value is always 1.",
            &["version"],
        )?;
        build_info.with_label_values(&[version]).set(1);

        // Resolving these once makes them appear at zero on the first scrape
        // and spares the hot path a label lookup.
        let per_flow = FlowKind::ALL.map(|flow| {
            let label = [flow.as_str()];
            PerFlow {
                waited_admitted: admission_wait.with_label_values(&[flow.as_str(), "admitted"]),
                waited_rejected: admission_wait.with_label_values(&[flow.as_str(), "rejected"]),
                rejections: rejections.with_label_values(&label),
                inflight: inflight.with_label_values(&label),
                limit: limit.with_label_values(&label),
            }
        });
        debug_assert!(FlowKind::ALL
            .iter()
            .enumerate()
            .all(|(i, k)| flow_index(*k) == i));
        for flow in FlowKind::ALL {
            for outcome in ROLLBACK_OUTCOMES {
                rollbacks.with_label_values(&[flow.as_str(), outcome.as_str()]);
            }
        }
        for kind in GC_RECLAIMED_KINDS {
            gc_reclaimed.with_label_values(&[kind]);
        }
        for kind in GC_FAILURE_KINDS {
            gc_failures.with_label_values(&[kind]);
        }
        let pulls_in_flight = register(
            registry,
            "cubelet_image_pulls_in_flight",
            IntGauge::new(
                "cubelet_image_pulls_in_flight",
                "Image pulls under way (callers that joined a pull of the same image are not counted).",
            ),
        )?;
        let pull_duration = register(
            registry,
            "cubelet_image_pull_duration_seconds",
            HistogramVec::new(
                HistogramOpts::new(
                    "cubelet_image_pull_duration_seconds",
                    "Duration of image pulls, by result (ok, error) and the image's size class \
                     (lt_10MiB, 10MiB_to_100MiB, 100MiB_to_1GiB, ge_1GiB; unknown when it failed).",
                )
                .buckets(PULL_DURATION_BUCKETS.to_vec()),
                &["result", "size"],
            ),
        )?;
        for size in PULL_SIZE_CLASSES {
            let result = if *size == "unknown" { "error" } else { "ok" };
            pull_duration.with_label_values(&[result, size]);
        }
        register_process_collector(registry)?;

        Ok(Metrics {
            inner: Arc::new(Inner {
                flow_duration,
                step_duration,
                rollbacks,
                per_flow,
                cri_requests,
                cri_duration,
                sandboxes,
                gc_reclaimed,
                gc_runs,
                gc_failures,
                gc_pending,
                events_dropped,
                pool_hit: storage_pool.with_label_values(&["hit"]),
                pool_miss: storage_pool.with_label_values(&["miss"]),
                anchor_started: anchors.with_label_values(&["started"]),
                anchor_failed: anchors.with_label_values(&["failed"]),
                shell_hits,
                shell_misses,
                shells_ready,
                pulls_in_flight,
                pull_duration,
            }),
        })
    }

    /// The metrics as an engine observer, for `EngineBuilder::observer`.
    pub fn observer(&self) -> Arc<dyn FlowObserver> {
        Arc::new(self.clone())
    }

    fn flow(&self, flow: FlowKind) -> &PerFlow {
        &self.inner.per_flow[flow_index(flow)]
    }

    /// Records one CRI request: `method` is the gRPC method name (e.g.
    /// `RunPodSandbox`), `code` the gRPC status code name (e.g. `OK`,
    /// `NotFound`).
    pub fn cri_request(&self, method: &str, code: &str, elapsed: Duration) {
        self.inner
            .cri_requests
            .with_label_values(&[method, code])
            .inc();
        self.inner
            .cri_duration
            .with_label_values(&[method])
            .observe(seconds(elapsed));
    }

    /// Sets how many sandboxes are in `state` (e.g. `ready`, `notready`).
    pub fn set_sandboxes(&self, state: &str, n: i64) {
        self.inner.sandboxes.with_label_values(&[state]).set(n);
    }

    /// Counts one garbage collection pass.
    pub fn gc_run(&self) {
        self.inner.gc_runs.inc();
    }

    /// Counts `n` objects of `kind` (one of [`GC_RECLAIMED_KINDS`]; another
    /// value is counted too, but only from its first event) reclaimed by GC.
    pub fn gc_reclaimed(&self, kind: &str, n: u64) {
        self.inner.gc_reclaimed.with_label_values(&[kind]).inc_by(n);
    }

    /// Counts one object of `kind` (one of [`GC_FAILURE_KINDS`]; another
    /// value is counted too, but only from its first event) that GC failed
    /// to reclaim.
    pub fn gc_failure(&self, kind: &str) {
        self.inner.gc_failures.with_label_values(&[kind]).inc();
    }

    /// Sets how many objects wait for garbage collection.
    pub fn set_gc_pending(&self, n: i64) {
        self.inner.gc_pending.set(n);
    }

    /// Counts one container event dropped for a slow subscriber.
    pub fn event_dropped(&self) {
        self.inner.events_dropped.inc();
    }

    /// Counts `n` container events dropped for a slow subscriber.
    pub fn events_dropped(&self, n: u64) {
        self.inner.events_dropped.inc_by(n);
    }

    /// Counts one RunPodSandbox with the warm pool on: a claimed shell
    /// (`hit`) or the cold path.
    pub fn pool_claim(&self, hit: bool) {
        if hit {
            self.inner.shell_hits.inc();
        } else {
            self.inner.shell_misses.inc();
        }
    }

    /// Sets how many warm-pool shells are ready.
    pub fn set_pool_ready(&self, n: usize) {
        self.inner
            .shells_ready
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Counts an image pull that started.
    pub fn pull_started(&self) {
        self.inner.pulls_in_flight.inc();
    }

    /// Records an image pull that ended after `elapsed`; `size` is the
    /// image's size when it succeeded, `None` when it failed.
    pub fn pull_finished(&self, size: Option<u64>, elapsed: Duration) {
        self.inner.pulls_in_flight.dec();
        let result = if size.is_some() { "ok" } else { "error" };
        self.inner
            .pull_duration
            .with_label_values(&[result, pull_size_class(size)])
            .observe(seconds(elapsed));
    }

    /// Counts one storage request served from the warm pool (`hit`) or
    /// built on demand (miss).
    pub fn storage_pool(&self, hit: bool) {
        if hit {
            self.inner.pool_hit.inc();
        } else {
            self.inner.pool_miss.inc();
        }
    }

    /// Counts one stats anchor started (`true`) or failed to start.
    pub fn stats_anchor(&self, started: bool) {
        if started {
            self.inner.anchor_started.inc();
        } else {
            self.inner.anchor_failed.inc();
        }
    }
}

impl FlowObserver for Metrics {
    fn flow_started(&self, flow: FlowKind) {
        self.flow(flow).inflight.inc();
    }

    fn flow_finished(&self, flow: FlowKind, outcome: Outcome, elapsed: Duration) {
        self.flow(flow).inflight.dec();
        self.inner
            .flow_duration
            .with_label_values(&[flow.as_str(), outcome.as_str()])
            .observe(seconds(elapsed));
    }

    fn step_finished(&self, flow: FlowKind, step: &str, outcome: Outcome, elapsed: Duration) {
        self.inner
            .step_duration
            .with_label_values(&[flow.as_str(), step, outcome.as_str()])
            .observe(seconds(elapsed));
    }

    fn rejected(&self, flow: FlowKind, _limit: usize) {
        self.flow(flow).rejections.inc();
    }

    fn admission_waited(&self, flow: FlowKind, waited: Duration, admitted: bool) {
        let per_flow = self.flow(flow);
        let histogram = if admitted {
            &per_flow.waited_admitted
        } else {
            &per_flow.waited_rejected
        };
        histogram.observe(seconds(waited));
    }

    fn rollback(&self, flow: FlowKind, outcome: Outcome) {
        self.inner
            .rollbacks
            .with_label_values(&[flow.as_str(), outcome.as_str()])
            .inc();
    }

    fn limit_changed(&self, flow: FlowKind, limit: usize) {
        self.flow(flow).limit.set(saturating_i64(limit));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::proto::MetricFamily;

    fn family<'a>(families: &'a [MetricFamily], name: &str) -> &'a MetricFamily {
        families
            .iter()
            .find(|f| f.name() == name)
            .unwrap_or_else(|| panic!("metric {name} not gathered"))
    }

    fn labels(m: &prometheus::proto::Metric) -> Vec<(String, String)> {
        m.get_label()
            .iter()
            .map(|l| (l.name().to_owned(), l.value().to_owned()))
            .collect()
    }

    #[test]
    fn pulls_are_counted_in_flight_and_timed_by_size_class() {
        let registry = Registry::new();
        let m = Metrics::new(&registry, "1").unwrap();
        let families = registry.gather();
        let series = family(&families, "cubelet_image_pull_duration_seconds").get_metric();
        assert_eq!(series.len(), PULL_SIZE_CLASSES.len(), "pre-initialised");

        m.pull_started();
        m.pull_started();
        let families = registry.gather();
        let gauge = family(&families, "cubelet_image_pulls_in_flight");
        assert_eq!(gauge.get_metric()[0].get_gauge().get_value(), 2.0);

        m.pull_finished(Some(40 << 20), Duration::from_secs(3));
        m.pull_finished(None, Duration::from_millis(200));
        let families = registry.gather();
        let gauge = family(&families, "cubelet_image_pulls_in_flight");
        assert_eq!(gauge.get_metric()[0].get_gauge().get_value(), 0.0);
        let hist = family(&families, "cubelet_image_pull_duration_seconds");
        let count = |result: &str, size: &str| {
            hist.get_metric()
                .iter()
                .find(|m| {
                    labels(m)
                        == [
                            ("result".to_owned(), result.to_owned()),
                            ("size".to_owned(), size.to_owned()),
                        ]
                })
                .map(|m| m.get_histogram().get_sample_count())
        };
        assert_eq!(count("ok", "10MiB_to_100MiB"), Some(1));
        assert_eq!(count("error", "unknown"), Some(1));
        assert_eq!(count("ok", "lt_10MiB"), Some(0));
        assert_eq!(pull_size_class(Some(2 << 30)), "ge_1GiB");
        assert_eq!(pull_size_class(Some(100 << 20)), "100MiB_to_1GiB");
    }

    #[test]
    fn registers_every_contract_name_and_preinitialises_flows() {
        let registry = Registry::new();
        let _m = Metrics::new(&registry, "1.2.3").unwrap();
        let families = registry.gather();
        for name in [
            "cubelet_flow_rejections_total",
            "cubelet_flow_inflight",
            "cubelet_flow_limit",
            "cubelet_flow_admission_wait_seconds",
            "cubelet_build_info",
            "cubelet_gc_runs_total",
            "cubelet_gc_pending",
            "cubelet_events_dropped_total",
            "cubelet_storage_pool_total",
            "cubelet_stats_anchors_total",
            "cubelet_pool_hits_total",
            "cubelet_pool_misses_total",
            "cubelet_pool_ready",
        ] {
            family(&families, name);
        }
        for name in [
            "cubelet_flow_rejections_total",
            "cubelet_flow_inflight",
            "cubelet_flow_limit",
        ] {
            let flows: Vec<_> = family(&families, name)
                .get_metric()
                .iter()
                .map(|m| labels(m)[0].1.clone())
                .collect();
            assert_eq!(flows, ["cleanup", "create", "destroy", "prewarm"], "{name}");
        }
        let info = &family(&families, "cubelet_build_info").get_metric()[0];
        assert_eq!(labels(info), [("version".to_owned(), "1.2.3".to_owned())]);
        assert_eq!(info.get_gauge().get_value(), 1.0);

        // Labelled counters with known label values are there at 0.
        let zeros = |name: &str| -> Vec<Vec<(String, String)>> {
            family(&families, name)
                .get_metric()
                .iter()
                .map(|m| {
                    assert_eq!(m.get_counter().get_value(), 0.0, "{name} {:?}", labels(m));
                    labels(m)
                })
                .collect()
        };
        let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        let mut want = Vec::new();
        for flow in ["cleanup", "create", "destroy", "prewarm"] {
            for result in ["error", "ok"] {
                want.push(vec![pair("flow", flow), pair("result", result)]);
            }
        }
        assert_eq!(zeros("cubelet_flow_rollbacks_total"), want);
        assert_eq!(
            zeros("cubelet_flow_rejections_total"),
            ["cleanup", "create", "destroy", "prewarm"].map(|f| vec![pair("flow", f)])
        );
        for (name, kinds) in [
            ("cubelet_gc_reclaimed_total", GC_RECLAIMED_KINDS),
            ("cubelet_gc_failures_total", GC_FAILURE_KINDS),
        ] {
            let mut want: Vec<_> = kinds.iter().map(|k| vec![pair("kind", k)]).collect();
            want.sort();
            assert_eq!(zeros(name), want, "{name}");
        }
        assert_eq!(
            zeros("cubelet_storage_pool_total"),
            ["hit", "miss"].map(|r| vec![pair("result", r)])
        );
        assert_eq!(
            zeros("cubelet_stats_anchors_total"),
            ["failed", "started"].map(|r| vec![pair("result", r)])
        );
        for name in ["cubelet_gc_runs_total", "cubelet_events_dropped_total"] {
            assert_eq!(
                family(&families, name).get_metric()[0]
                    .get_counter()
                    .get_value(),
                0.0
            );
        }
    }

    #[test]
    fn gc_kinds_are_unique() {
        for kinds in [GC_RECLAIMED_KINDS, GC_FAILURE_KINDS] {
            let mut sorted = kinds.to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), kinds.len(), "{kinds:?}");
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn process_metrics_have_plausible_values() {
        let registry = Registry::new();
        let _m = Metrics::new(&registry, "v").unwrap();
        let families = registry.gather();
        let value = |name: &str| {
            let f = family(&families, name);
            let m = &f.get_metric()[0];
            match f.get_field_type() {
                prometheus::proto::MetricType::COUNTER => m.get_counter().get_value(),
                _ => m.get_gauge().get_value(),
            }
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(value("process_resident_memory_bytes") > 0.0);
        assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
        assert!(value("process_open_fds") > 0.0);
        assert!(value("process_max_fds") >= value("process_open_fds"));
        assert!(value("process_cpu_seconds_total") >= 0.0);
        assert!(value("process_threads") >= 1.0);
        let start = value("process_start_time_seconds");
        assert!(
            start <= now + 1.0 && start > now - 3600.0,
            "start {start}, now {now}"
        );
    }

    #[test]
    fn second_registration_in_same_registry_fails_with_name() {
        let registry = Registry::new();
        let _m = Metrics::new(&registry, "v").unwrap();
        let err = Metrics::new(&registry, "v").unwrap_err();
        assert!(
            err.to_string().contains("cubelet_flow_duration_seconds"),
            "{err}"
        );
    }

    #[test]
    fn observer_methods_update_metrics() {
        let registry = Registry::new();
        let m = Metrics::new(&registry, "v").unwrap();
        let obs: Arc<dyn FlowObserver> = m.observer();
        obs.limit_changed(FlowKind::Create, 16);
        obs.flow_started(FlowKind::Create);
        obs.flow_started(FlowKind::Create);
        obs.step_finished(
            FlowKind::Create,
            "network",
            Outcome::Ok,
            Duration::from_millis(3),
        );
        obs.flow_finished(FlowKind::Create, Outcome::Ok, Duration::from_millis(7));
        obs.rejected(FlowKind::Create, 16);
        obs.admission_waited(FlowKind::Create, Duration::from_millis(40), true);
        obs.admission_waited(FlowKind::Create, Duration::from_millis(500), false);
        obs.rollback(FlowKind::Create, Outcome::Error);
        m.storage_pool(true);
        m.storage_pool(false);
        m.storage_pool(false);
        m.pool_claim(true);
        m.pool_claim(true);
        m.pool_claim(false);
        m.set_pool_ready(3);
        m.gc_reclaimed("netns", 3);
        m.set_sandboxes("ready", 4);

        let f = registry.gather();
        let by_flow = |name: &str, flow: &str| {
            family(&f, name)
                .get_metric()
                .iter()
                .find(|m| labels(m).contains(&("flow".to_owned(), flow.to_owned())))
                .cloned()
                .unwrap()
        };
        assert_eq!(
            by_flow("cubelet_flow_inflight", "create")
                .get_gauge()
                .get_value(),
            1.0
        );
        assert_eq!(
            by_flow("cubelet_flow_limit", "create")
                .get_gauge()
                .get_value(),
            16.0
        );
        assert_eq!(
            by_flow("cubelet_flow_rejections_total", "create")
                .get_counter()
                .get_value(),
            1.0
        );
        assert_eq!(
            by_flow("cubelet_flow_rejections_total", "destroy")
                .get_counter()
                .get_value(),
            0.0
        );
        let waits: Vec<_> = family(&f, "cubelet_flow_admission_wait_seconds")
            .get_metric()
            .iter()
            .filter(|m| m.get_histogram().get_sample_count() != 0)
            .map(|m| (labels(m), m.get_histogram().get_sample_sum()))
            .collect();
        assert_eq!(
            waits,
            [
                (
                    vec![
                        ("flow".to_owned(), "create".to_owned()),
                        ("result".to_owned(), "admitted".to_owned())
                    ],
                    0.04
                ),
                (
                    vec![
                        ("flow".to_owned(), "create".to_owned()),
                        ("result".to_owned(), "rejected".to_owned())
                    ],
                    0.5
                ),
            ]
        );
        let h = by_flow("cubelet_flow_duration_seconds", "create");
        assert_eq!(h.get_histogram().get_sample_count(), 1);
        assert!((h.get_histogram().get_sample_sum() - 0.007).abs() < 1e-9);
        let step = &family(&f, "cubelet_flow_step_duration_seconds").get_metric()[0];
        assert_eq!(
            labels(step),
            [
                ("flow".to_owned(), "create".to_owned()),
                ("result".to_owned(), "ok".to_owned()),
                ("step".to_owned(), "network".to_owned()),
            ]
        );
        let rb: Vec<_> = family(&f, "cubelet_flow_rollbacks_total")
            .get_metric()
            .iter()
            .filter(|m| m.get_counter().get_value() != 0.0)
            .collect();
        assert_eq!(rb.len(), 1);
        assert_eq!(rb[0].get_counter().get_value(), 1.0);
        assert_eq!(
            labels(rb[0]),
            [
                ("flow".to_owned(), "create".to_owned()),
                ("result".to_owned(), "error".to_owned())
            ]
        );
        let pool: Vec<_> = family(&f, "cubelet_storage_pool_total")
            .get_metric()
            .iter()
            .map(|m| (labels(m)[0].1.clone(), m.get_counter().get_value()))
            .collect();
        assert_eq!(pool, [("hit".to_owned(), 1.0), ("miss".to_owned(), 2.0)]);
        let value = |name: &str| {
            let m = &family(&f, name).get_metric()[0];
            m.get_counter().get_value() + m.get_gauge().get_value()
        };
        assert_eq!(value("cubelet_pool_hits_total"), 2.0);
        assert_eq!(value("cubelet_pool_misses_total"), 1.0);
        assert_eq!(value("cubelet_pool_ready"), 3.0);
        let gc = family(&f, "cubelet_gc_reclaimed_total")
            .get_metric()
            .iter()
            .find(|m| labels(m) == [("kind".to_owned(), "netns".to_owned())])
            .unwrap();
        assert_eq!(gc.get_counter().get_value(), 3.0);
        let sb = &family(&f, "cubelet_sandboxes").get_metric()[0];
        assert_eq!(sb.get_gauge().get_value(), 4.0);
    }

    #[test]
    fn huge_limit_saturates() {
        assert_eq!(saturating_i64(usize::MAX), i64::MAX);
        assert_eq!(saturating_i64(32), 32);
    }

    #[test]
    fn metrics_are_send_sync_and_cheap_to_clone() {
        fn assert_send_sync<T: Send + Sync + Clone + 'static>() {}
        assert_send_sync::<Metrics>();
    }
}
