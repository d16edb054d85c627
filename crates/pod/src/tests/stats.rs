//! Stats: readings through the runtime, CPU rates from the samples the
//! service keeps, and the samples forgotten when what they describe is
//! removed.

use cubelet_runtime::spec::cgroup_path;
use cubelet_runtime::stats::{CgroupStats, InterfaceStats, MemoryStats};

use super::harness::Rig;

fn cgroup(cpu_ns: u64, processes: u64) -> CgroupStats {
    CgroupStats {
        cpu_usage_ns: Some(cpu_ns),
        memory: Some(MemoryStats {
            usage_bytes: 100,
            working_set_bytes: 80,
            ..Default::default()
        }),
        processes: Some(processes),
        ..Default::default()
    }
}

#[tokio::test]
async fn container_and_pod_stats_come_from_the_runtime_with_rates_from_the_last_sample() {
    let r = Rig::new();
    // Without an infra process: the network counters are read through the
    // pinned namespace.
    let sb = r.infraless_pod("web").await;
    let a = r.running(&sb, "a").await;
    let b = r.running(&sb, "b").await;
    let parent = "/kubepods/pod-test";
    r.runtime
        .set_cgroup(&cgroup_path(Some(parent), &a), cgroup(1_000_000_000, 2));
    r.runtime
        .set_cgroup(&cgroup_path(Some(parent), &b), cgroup(500, 1));
    r.runtime.set_cgroup(parent, cgroup(3_000_000_000, 4));
    r.runtime.set_interfaces(vec![InterfaceStats {
        name: "eth0".into(),
        rx_bytes: 7,
        rx_errors: 0,
        tx_bytes: 9,
        tx_errors: 0,
    }]);

    // A container's own stats carry no process count.
    let one = r.pods.container_stats(&a[..12]).await.unwrap();
    assert_eq!(one.container.id, a);
    assert_eq!(one.cgroup.processes, None);
    assert_eq!(one.cgroup.cpu_usage_ns, Some(1_000_000_000));
    let cpu = one.cpu.unwrap();
    assert_eq!((cpu.usage_ns, cpu.nano_cores), (1_000_000_000, None));
    assert_eq!(one.writable_layer.unwrap().0.bytes, 4096);

    // The second sample of `a` has a rate.
    r.runtime
        .set_cgroup(&cgroup_path(Some(parent), &a), cgroup(2_000_000_000, 2));
    let list = r.pods.list_container_stats(|c| c.id == a).await.unwrap();
    assert_eq!(list.len(), 1);
    assert!(list[0].cpu.unwrap().nano_cores.is_some());

    let pod = r
        .pods
        .pod_stats("pod_sandbox_id", sb.as_str())
        .await
        .unwrap();
    assert_eq!(pod.sandbox.id, sb);
    // The pod's parent cgroup, process count included.
    assert_eq!(pod.cgroup, cgroup(3_000_000_000, 4));
    assert_eq!(pod.containers.len(), 2);
    assert_eq!(pod.interfaces.len(), 1);
    let pods = r.pods.list_pod_stats(|_| true).await.unwrap();
    assert_eq!(pods.len(), 1);
    assert!(pods[0].cpu.unwrap().nano_cores.is_some());

    // Readings for metrics: no samples taken.
    let readings = r.pods.pod_readings().await.unwrap();
    assert_eq!(readings[0].containers.len(), 2);
    assert!(readings[0].cpu.is_none());
    assert!(readings[0].containers.iter().all(|c| c.cpu.is_none()));
}

#[tokio::test]
async fn removing_a_container_or_a_pod_forgets_its_samples() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let a = r.running(&sb, "a").await;
    let b = r.running(&sb, "b").await;
    let parent = "/kubepods/pod-test";
    for id in [&a, &b] {
        r.runtime
            .set_cgroup(&cgroup_path(Some(parent), id), cgroup(10, 1));
    }
    r.runtime.set_cgroup(parent, cgroup(20, 2));
    r.pods.list_pod_stats(|_| true).await.unwrap();
    // Two containers and the pod.
    assert_eq!(r.pods.stats().samples(), 3);

    r.pods.remove_container(&a).await.unwrap();
    assert_eq!(r.pods.stats().samples(), 2);
    r.pods.remove_sandbox(sb.as_str()).await.unwrap();
    assert_eq!(r.pods.stats().samples(), 0);
}

#[tokio::test]
async fn bad_or_unknown_ids_are_refused_naming_the_field() {
    let r = Rig::new();
    let e = r.pods.container_stats("").await.unwrap_err();
    assert!(e.to_string().contains("container_id"), "{e}");
    let e = r.pods.pod_stats("pod_sandbox_id", "").await.unwrap_err();
    assert!(e.to_string().contains("pod_sandbox_id"), "{e}");
    let e = r
        .pods
        .pod_stats("pod_sandbox_id", &"f".repeat(64))
        .await
        .unwrap_err();
    assert!(matches!(e, crate::PodError::NotFound { .. }), "{e}");
}

#[tokio::test]
async fn a_writable_layer_the_runtime_cannot_read_is_left_out_not_an_error() {
    let r = Rig::new();
    let sb = r.ready_pod("web").await;
    let a = r.running(&sb, "a").await;
    r.runtime.fail_next("writable_layer_usage", |id| {
        cubelet_runtime::RuntimeError::FailedPrecondition(format!("no snapshot of {id}"))
    });
    let s = r.pods.container_stats(&a).await.unwrap();
    assert!(s.writable_layer.is_none());
    // No cgroup reading: no CPU entry either, and no sample kept.
    assert!(s.cpu.is_none());
    assert_eq!(r.pods.stats().samples(), 0);
    assert!(r
        .pods
        .container_stats(&a)
        .await
        .unwrap()
        .writable_layer
        .is_some());
}

/// Under the systemd driver every cgroup the service reads is named as
/// systemd lays it out: each container's scope in the pod's slice, and
/// the pod's own slice expanded by its dashes; a cgroupfs-style parent is
/// refused at RunPodSandbox, naming the field, before any step runs.
#[tokio::test]
async fn the_systemd_driver_names_the_scopes_and_slices_stats_read() {
    use cubelet_runtime::cgroup::CgroupDriver;
    let r = Rig::new();
    r.runtime.set_cgroup_driver(CgroupDriver::Systemd);
    let mut s = super::harness::spec("web");
    s.cgroup_parent = Some("/kubepods/pod-test".to_owned());
    match r.pods.run_sandbox(s.clone()).await.unwrap_err() {
        crate::PodError::InvalidArgument { field, reason } => {
            assert_eq!(field, "config.linux.cgroup_parent");
            assert!(reason.contains("systemd"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(r.held(), 0, "no step ran");
    s.cgroup_parent =
        Some("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podx.slice".to_owned());
    let sb = r.pods.run_sandbox(s).await.unwrap();
    let a = r.running(&sb, "a").await;
    let slice = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podx.slice";
    r.runtime
        .set_cgroup(&format!("{slice}/cubelet-{a}.scope"), cgroup(1_000, 1));
    r.runtime.set_cgroup(slice, cgroup(5_000, 3));
    let one = r.pods.container_stats(&a).await.unwrap();
    assert_eq!(one.cgroup.cpu_usage_ns, Some(1_000));
    let pod = r
        .pods
        .pod_stats("pod_sandbox_id", sb.as_str())
        .await
        .unwrap();
    assert_eq!(pod.cgroup, cgroup(5_000, 3));
    assert_eq!(pod.containers[0].cgroup.cpu_usage_ns, Some(1_000));
}
