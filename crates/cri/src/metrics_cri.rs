//! `ListMetricDescriptors` and `ListPodSandboxMetrics`: the cAdvisor-named
//! container metrics kubelet re-exports on `/metrics/cadvisor` when it runs
//! with `PodAndContainerStatsFromCRI`.
//!
//! Label keys follow cAdvisor: `container`, `id`, `image`, `name`,
//! `namespace`, `pod` (plus `interface` for network metrics). Pod-level
//! network metrics carry the container name `POD`, as cAdvisor reports them
//! for the infra container. Values are integers (the CRI `Metric` carries a
//! `UInt64Value`): CPU time is reported in whole seconds.

use cubelet_cri_api::v1 as cri;
use cubelet_pod::{CgroupStats, InterfaceStats, PodStats, SandboxRecord};

use crate::convert::nanos;
use crate::error::CriResult;
use crate::service::Cri;

/// Label keys of container metrics, in the order of the values.
const LABELS: [&str; 6] = ["container", "id", "image", "name", "namespace", "pod"];

/// What one metric reads from a cgroup.
type Read = fn(&CgroupStats) -> Option<u64>;

/// Container metrics: name, help, type, reader.
const CONTAINER_METRICS: &[(&str, &str, cri::MetricType, Read)] = &[
    (
        "container_cpu_usage_seconds_total",
        "Cumulative cpu time consumed in seconds.",
        cri::MetricType::Counter,
        |s| s.cpu_usage_ns.map(|ns| ns / 1_000_000_000),
    ),
    (
        "container_memory_usage_bytes",
        "Current memory usage in bytes, including all memory regardless of when it was accessed",
        cri::MetricType::Gauge,
        |s| s.memory.map(|m| m.usage_bytes),
    ),
    (
        "container_memory_working_set_bytes",
        "Current working set in bytes.",
        cri::MetricType::Gauge,
        |s| s.memory.map(|m| m.working_set_bytes),
    ),
    (
        "container_memory_rss",
        "Size of RSS in bytes.",
        cri::MetricType::Gauge,
        |s| s.memory.map(|m| m.rss_bytes),
    ),
    (
        "container_spec_memory_limit_bytes",
        "Memory limit for the container.",
        cri::MetricType::Gauge,
        |s| s.memory.map(|m| m.limit_bytes.unwrap_or(0)),
    ),
    (
        "container_processes",
        "Number of processes running inside the container.",
        cri::MetricType::Gauge,
        |s| s.processes,
    ),
];

/// Network metrics (per pod and interface): name, help, reader.
type NetRead = fn(&InterfaceStats) -> u64;
const NETWORK_METRICS: &[(&str, &str, NetRead)] = &[
    (
        "container_network_receive_bytes_total",
        "Cumulative count of bytes received",
        |i| i.rx_bytes,
    ),
    (
        "container_network_receive_errors_total",
        "Cumulative count of errors encountered while receiving",
        |i| i.rx_errors,
    ),
    (
        "container_network_transmit_bytes_total",
        "Cumulative count of bytes transmitted",
        |i| i.tx_bytes,
    ),
    (
        "container_network_transmit_errors_total",
        "Cumulative count of errors encountered while transmitting",
        |i| i.tx_errors,
    ),
];

/// Every metric descriptor this runtime reports.
pub(crate) fn descriptors() -> Vec<cri::MetricDescriptor> {
    let keys = |extra: &[&str]| {
        LABELS
            .iter()
            .chain(extra)
            .map(|k| (*k).to_owned())
            .collect::<Vec<_>>()
    };
    CONTAINER_METRICS
        .iter()
        .map(|(name, help, _, _)| cri::MetricDescriptor {
            name: (*name).to_owned(),
            help: (*help).to_owned(),
            label_keys: keys(&[]),
        })
        .chain(
            NETWORK_METRICS
                .iter()
                .map(|(name, help, _)| cri::MetricDescriptor {
                    name: (*name).to_owned(),
                    help: (*help).to_owned(),
                    label_keys: keys(&["interface"]),
                }),
        )
        .collect()
}

/// Label values in [`LABELS`] order.
fn label_values(sb: &SandboxRecord, container: &str, id: &str, image: &str) -> Vec<String> {
    vec![
        container.to_owned(),
        id.to_owned(),
        image.to_owned(),
        id.to_owned(),
        sb.spec.namespace.clone(),
        sb.spec.name.clone(),
    ]
}

fn container_metrics(labels: &[String], cg: &CgroupStats, now: i64) -> Vec<cri::Metric> {
    CONTAINER_METRICS
        .iter()
        .filter_map(|(name, _, kind, read)| {
            Some(cri::Metric {
                name: (*name).to_owned(),
                timestamp: now,
                metric_type: *kind as i32,
                label_values: labels.to_vec(),
                value: Some(cri::UInt64Value { value: read(cg)? }),
            })
        })
        .collect()
}

/// The metrics of one pod and its containers from the pod service's readings.
fn pod_metrics(p: &PodStats) -> cri::PodSandboxMetrics {
    let sb = &p.sandbox;
    let now = nanos(p.at);
    let container_metrics_out = p
        .containers
        .iter()
        .map(|c| {
            let labels = label_values(sb, &c.container.name, &c.container.id, &c.container.image);
            cri::ContainerMetrics {
                container_id: c.container.id.clone(),
                metrics: container_metrics(&labels, &c.cgroup, nanos(c.at)),
            }
        })
        .collect();
    let pod_labels = label_values(sb, "POD", sb.id.as_str(), "");
    let mut metrics = container_metrics(&pod_labels, &p.cgroup, now);
    for iface in &p.interfaces {
        let mut labels = pod_labels.clone();
        labels.push(iface.name.clone());
        metrics.extend(NETWORK_METRICS.iter().map(|(name, _, read)| cri::Metric {
            name: (*name).to_owned(),
            timestamp: now,
            metric_type: cri::MetricType::Counter as i32,
            label_values: labels.clone(),
            value: Some(cri::UInt64Value { value: read(iface) }),
        }));
    }
    cri::PodSandboxMetrics {
        pod_sandbox_id: sb.id.to_string(),
        metrics,
        container_metrics: container_metrics_out,
    }
}

impl Cri {
    pub(crate) async fn list_pod_sandbox_metrics_impl(
        &self,
    ) -> CriResult<cri::ListPodSandboxMetricsResponse> {
        let pods = self.pods().pod_readings().await?;
        Ok(cri::ListPodSandboxMetricsResponse {
            pod_metrics: pods.iter().map(pod_metrics).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cubelet_pod::MemoryStats;

    #[test]
    fn descriptors_use_cadvisor_names_and_labels() {
        let d = descriptors();
        let names: Vec<&str> = d.iter().map(|d| d.name.as_str()).collect();
        for want in [
            "container_cpu_usage_seconds_total",
            "container_memory_working_set_bytes",
            "container_memory_rss",
            "container_memory_usage_bytes",
            "container_network_receive_bytes_total",
            "container_network_transmit_bytes_total",
            "container_processes",
        ] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        let rx = d
            .iter()
            .find(|d| d.name == "container_network_receive_bytes_total")
            .unwrap();
        assert_eq!(rx.label_keys.last().map(String::as_str), Some("interface"));
        assert!(d.iter().all(|d| d.label_keys[..6] == LABELS));
    }

    #[test]
    fn metrics_from_cgroup_readings() {
        let cg = CgroupStats {
            cpu_usage_ns: Some(3_500_000_000),
            memory: Some(MemoryStats {
                usage_bytes: 10,
                working_set_bytes: 8,
                rss_bytes: 4,
                page_faults: 0,
                major_page_faults: 0,
                limit_bytes: None,
            }),
            processes: None,
            ..Default::default()
        };
        let labels: Vec<String> = LABELS.iter().map(|l| format!("v-{l}")).collect();
        let m = container_metrics(&labels, &cg, 7);
        let get = |n: &str| {
            m.iter()
                .find(|m| m.name == n)
                .and_then(|m| m.value.as_ref())
                .map(|v| v.value)
        };
        assert_eq!(get("container_cpu_usage_seconds_total"), Some(3));
        assert_eq!(get("container_memory_working_set_bytes"), Some(8));
        // No pids reading: no metric rather than a false zero.
        assert_eq!(get("container_processes"), None);
        assert!(m
            .iter()
            .all(|m| m.label_values == labels && m.timestamp == 7));
    }
}
