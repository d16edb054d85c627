//! `ContainerStats`, `ListContainerStats`, `PodSandboxStats` and
//! `ListPodSandboxStats`: the pod service's readings (which keep the CPU
//! samples the rates come from), turned into CRI messages.

use std::collections::HashMap;

use cubelet_cri_api::v1 as cri;
use cubelet_pod::{CgroupStats, ContainerStats, CpuUsage, InterfaceStats, PodStats};
use cubelet_runtime::stats::{Pressure, PsiData};

use crate::convert::{self, nanos};
use crate::error::CriResult;
use crate::service::Cri;

fn u64v(value: u64) -> cri::UInt64Value {
    cri::UInt64Value { value }
}

fn hash(m: &std::collections::BTreeMap<String, String>) -> HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// CRI 1.36's `PsiStats` of a pressure reading; `None` when there is none
/// (cgroup v1, PSI off, or a runtime that does not read it), which kubelet
/// takes as "not reported". CRI counts the total in nanoseconds.
pub(crate) fn psi_stats(p: Option<Pressure>) -> Option<cri::PsiStats> {
    let data = |d: PsiData| cri::PsiData {
        total: d.total_us.saturating_mul(1000),
        avg10: d.avg10,
        avg60: d.avg60,
        avg300: d.avg300,
    };
    p.map(|p| cri::PsiStats {
        full: p.full.map(data),
        some: Some(data(p.some)),
    })
}

/// CRI 1.36's `IoUsage` (today only I/O pressure): `None` without a reading.
pub(crate) fn io_usage(now: i64, io_pressure: Option<Pressure>) -> Option<cri::IoUsage> {
    psi_stats(io_pressure).map(|psi| cri::IoUsage {
        timestamp: now,
        psi: Some(psi),
    })
}

fn cpu(c: Option<CpuUsage>, pressure: Option<Pressure>) -> Option<cri::CpuUsage> {
    c.map(|c| cri::CpuUsage {
        timestamp: c.timestamp_ns,
        usage_core_nano_seconds: Some(u64v(c.usage_ns)),
        usage_nano_cores: c.nano_cores.map(u64v),
        psi: psi_stats(pressure),
    })
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
        psi: psi_stats(stats.psi.memory),
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

/// A container's stats as CRI carries them; `mountpoint` names the image
/// filesystem its writable layer is on.
fn container_stats(s: &ContainerStats, mountpoint: &str) -> cri::ContainerStats {
    let c = &s.container;
    let now = nanos(s.at);
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
        cpu: cpu(s.cpu, s.cgroup.psi.cpu),
        memory: memory(&s.cgroup, now),
        writable_layer: s.writable_layer.map(|(u, at)| cri::FilesystemUsage {
            timestamp: nanos(at),
            fs_id: Some(cri::FilesystemIdentifier {
                mountpoint: mountpoint.to_owned(),
            }),
            used_bytes: Some(u64v(u.bytes)),
            inodes_used: Some(u64v(u.inodes)),
        }),
        swap: None,
        io: io_usage(now, s.cgroup.psi.io),
    }
}

/// A pod's stats as CRI carries them.
fn pod_stats(s: &PodStats, mountpoint: &str) -> cri::PodSandboxStats {
    let sb = &s.sandbox;
    let now = nanos(s.at);
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
            cpu: cpu(s.cpu, s.cgroup.psi.cpu),
            memory: memory(&s.cgroup, now),
            network: network(&s.interfaces, now),
            io: io_usage(now, s.cgroup.psi.io),
            process: s.cgroup.processes.map(|n| cri::ProcessUsage {
                timestamp: now,
                process_count: Some(u64v(n)),
            }),
            containers: s
                .containers
                .iter()
                .map(|c| container_stats(c, mountpoint))
                .collect(),
        }),
        windows: None,
    }
}

impl Cri {
    /// The image filesystem's mount point, as the writable-layer usage of
    /// every container names it.
    fn mountpoint(&self) -> &str {
        &self.inner.image_fs_mountpoint
    }

    pub(crate) async fn container_stats_impl(
        &self,
        r: cri::ContainerStatsRequest,
    ) -> CriResult<cri::ContainerStatsResponse> {
        let s = self.pods().container_stats(&r.container_id).await?;
        Ok(cri::ContainerStatsResponse {
            stats: Some(container_stats(&s, self.mountpoint())),
        })
    }

    pub(crate) async fn list_container_stats_impl(
        &self,
        r: cri::ListContainerStatsRequest,
    ) -> CriResult<cri::ListContainerStatsResponse> {
        let f = r.filter.unwrap_or_default();
        let stats = self
            .pods()
            .list_container_stats(|c| {
                (f.id.is_empty() || c.id.starts_with(&f.id))
                    && (f.pod_sandbox_id.is_empty()
                        || c.sandbox_id.as_str().starts_with(&f.pod_sandbox_id))
                    && convert::labels_match(&f.label_selector, &c.labels)
            })
            .await?;
        Ok(cri::ListContainerStatsResponse {
            stats: stats
                .iter()
                .map(|s| container_stats(s, self.mountpoint()))
                .collect(),
        })
    }

    pub(crate) async fn pod_sandbox_stats_impl(
        &self,
        r: cri::PodSandboxStatsRequest,
    ) -> CriResult<cri::PodSandboxStatsResponse> {
        let s = self
            .pods()
            .pod_stats("pod_sandbox_id", &r.pod_sandbox_id)
            .await?;
        Ok(cri::PodSandboxStatsResponse {
            stats: Some(pod_stats(&s, self.mountpoint())),
        })
    }

    pub(crate) async fn list_pod_sandbox_stats_impl(
        &self,
        r: cri::ListPodSandboxStatsRequest,
    ) -> CriResult<cri::ListPodSandboxStatsResponse> {
        let f = r.filter.unwrap_or_default();
        let stats = self
            .pods()
            .list_pod_stats(|s| {
                (f.id.is_empty() || s.id.as_str().starts_with(&f.id))
                    && convert::labels_match(&f.label_selector, &s.spec.labels)
            })
            .await?;
        Ok(cri::ListPodSandboxStatsResponse {
            stats: stats
                .iter()
                .map(|s| pod_stats(s, self.mountpoint()))
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psi_converts_to_cri_units_and_none_stays_none() {
        assert_eq!(psi_stats(None), None);
        assert_eq!(io_usage(5, None), None);
        let some = PsiData {
            avg10: 2.0,
            avg60: 1.0,
            avg300: 0.5,
            total_us: 900,
        };
        let p = Pressure { some, full: None };
        let got = psi_stats(Some(p)).unwrap();
        assert_eq!(got.full, None);
        let s = got.some.unwrap();
        assert_eq!(
            (s.avg10, s.avg60, s.avg300, s.total),
            (2.0, 1.0, 0.5, 900_000)
        );
        // Survives the wire with CRI's capitalised field names.
        use prost::Message;
        let io = io_usage(
            5,
            Some(Pressure {
                some,
                full: Some(some),
            }),
        )
        .unwrap();
        let back = cri::IoUsage::decode(io.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back.timestamp, 5);
        assert_eq!(back.psi.unwrap().full.unwrap().total, 900_000);
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

    #[test]
    fn cpu_rate_is_carried_when_known() {
        let c = cpu(
            Some(CpuUsage {
                timestamp_ns: 5,
                usage_ns: 7,
                nano_cores: None,
            }),
            None,
        )
        .unwrap();
        assert_eq!(
            (c.timestamp, c.usage_core_nano_seconds, c.usage_nano_cores),
            (5, Some(u64v(7)), None)
        );
        assert!(cpu(None, None).is_none());
    }

    /// A cgroup's pressure reaches the CRI message of its resource.
    #[test]
    fn pressure_of_a_cgroup_reaches_cpu_memory_and_io() {
        let p = |total_us| Pressure {
            some: PsiData {
                total_us,
                ..Default::default()
            },
            full: None,
        };
        let stats = CgroupStats {
            memory: Some(cubelet_runtime::stats::MemoryStats::default()),
            psi: cubelet_runtime::stats::PsiStats {
                cpu: Some(p(1)),
                memory: Some(p(2)),
                io: Some(p(3)),
            },
            ..Default::default()
        };
        let total = |s: Option<cri::PsiStats>| s.and_then(|s| s.some).map(|d| d.total);
        let usage = CpuUsage {
            timestamp_ns: 1,
            usage_ns: 1,
            nano_cores: None,
        };
        let c = cpu(Some(usage), stats.psi.cpu).unwrap();
        assert_eq!(total(c.psi), Some(1000));
        assert_eq!(total(memory(&stats, 1).unwrap().psi), Some(2000));
        assert_eq!(total(io_usage(1, stats.psi.io).unwrap().psi), Some(3000));
    }
}
