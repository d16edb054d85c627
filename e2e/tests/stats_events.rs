//! Stats, metrics and container events over the real CRI socket:
//! CPU usage and rate of a busy container, memory working set of one that
//! holds 20 MB, pod network counters for `eth0`, the cAdvisor-named pod
//! metrics, a full lifecycle on a `GetContainerEvents` stream, and a stalled
//! event subscriber that does not stall the agent. Without the private
//! containerd the test prints SKIP and passes.

use std::time::Duration;

use anyhow::{bail, ensure, Context};
use cubelet_e2e::cri::*;
use cubelet_e2e::{container_config, image_spec, leaks, Daemon, DaemonOpts};
use futures::StreamExt;

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";

/// Upper bound for one CRI call while a subscriber is stalled: generous,
/// only there so a blocked agent fails the test instead of hanging it.
const CALL_BOUND: Duration = Duration::from_secs(30);

async fn run_pod(d: &Daemon, name: &str) -> anyhow::Result<(String, PodSandboxConfig)> {
    let config = d.pod_config(name);
    Ok((d.run_pod(&config, "").await?, config))
}

async fn create(
    d: &Daemon,
    pod: &str,
    pod_config: &PodSandboxConfig,
    name: &str,
    cmd: &[&str],
) -> anyhow::Result<String> {
    let mut config = container_config(name, BUSYBOX, cmd);
    config.labels.insert("stats-test".into(), name.into());
    Ok(d.runtime
        .clone()
        .create_container(CreateContainerRequest {
            pod_sandbox_id: pod.to_owned(),
            config: Some(config),
            sandbox_config: Some(pod_config.clone()),
        })
        .await
        .with_context(|| format!("CreateContainer {name}"))?
        .into_inner()
        .container_id)
}

async fn start(d: &Daemon, id: &str) -> anyhow::Result<()> {
    d.runtime
        .clone()
        .start_container(StartContainerRequest {
            container_id: id.to_owned(),
        })
        .await
        .with_context(|| format!("StartContainer {id}"))?;
    Ok(())
}

async fn container_stats(d: &Daemon, id: &str) -> anyhow::Result<ContainerStats> {
    d.runtime
        .clone()
        .container_stats(ContainerStatsRequest {
            container_id: id.to_owned(),
        })
        .await?
        .into_inner()
        .stats
        .context("no stats")
}

fn val(v: &Option<UInt64Value>) -> u64 {
    v.as_ref().map_or(0, |v| v.value)
}

async fn stats_and_metrics(d: &Daemon) -> anyhow::Result<()> {
    d.images
        .clone()
        .pull_image(PullImageRequest {
            image: Some(image_spec(BUSYBOX)),
            ..Default::default()
        })
        .await
        .context("pull busybox")?;
    let (pod, pc) = run_pod(d, "stats").await?;
    let spin = create(d, &pod, &pc, "spin", &["sh", "-c", "while :; do :; done"]).await?;
    let mem = create(
        d,
        &pod,
        &pc,
        "mem",
        &[
            "sh",
            "-c",
            // The trailing echo keeps the shell (and `x`) alive: busybox sh
            // would otherwise exec its last command.
            "x=$(head -c 20000000 /dev/zero | tr '\\0' a); sleep 3600; echo ${#x}",
        ],
    )
    .await?;
    start(d, &spin).await?;
    start(d, &mem).await?;

    // CPU: the counter rises between two samples, and the second has a rate.
    let first = container_stats(d, &spin).await?;
    let cpu1 = first.cpu.context("no cpu on first sample")?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = container_stats(d, &spin).await?;
    let cpu2 = second.cpu.context("no cpu on second sample")?;
    println!("spin cpu: {cpu1:?} then {cpu2:?}");
    ensure!(
        val(&cpu2.usage_core_nano_seconds) > val(&cpu1.usage_core_nano_seconds),
        "cpu usage did not rise: {cpu1:?} -> {cpu2:?}"
    );
    ensure!(
        val(&cpu2.usage_nano_cores) > 0,
        "no cpu rate on the second sample: {cpu2:?}"
    );
    ensure!(
        second.attributes.as_ref().map(|a| a.id.as_str()) == Some(spin.as_str()),
        "attributes {:?}",
        second.attributes
    );
    ensure!(
        second.writable_layer.is_some(),
        "no writable layer usage: {second:?}"
    );

    // Memory: poll until the shell holds its 20 MB (bounded), then check.
    let mut ws = 0;
    for _ in 0..100 {
        let s = container_stats(d, &mem).await?;
        ws = s.memory.as_ref().map_or(0, |m| val(&m.working_set_bytes));
        if ws >= 20_000_000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("mem working set: {ws} bytes");
    ensure!(
        ws >= 20_000_000,
        "working set {ws} < 20 MB; container log: {:?}",
        std::fs::read_to_string(d.log_base.join("stats").join("mem.log")).unwrap_or_default()
    );

    // ListContainerStats filters.
    let mut rt = d.runtime.clone();
    let list = |filter: ContainerStatsFilter| {
        let mut rt = rt.clone();
        async move {
            anyhow::Ok(
                rt.list_container_stats(ListContainerStatsRequest {
                    filter: Some(filter),
                })
                .await?
                .into_inner()
                .stats,
            )
        }
    };
    let by_pod = list(ContainerStatsFilter {
        pod_sandbox_id: pod.clone(),
        ..Default::default()
    })
    .await?;
    ensure!(by_pod.len() == 2, "by pod: {} stats", by_pod.len());
    let by_label = list(ContainerStatsFilter {
        label_selector: [("stats-test".to_owned(), "mem".to_owned())].into(),
        ..Default::default()
    })
    .await?;
    ensure!(
        by_label.len() == 1
            && by_label[0].attributes.as_ref().map(|a| a.id.as_str()) == Some(mem.as_str()),
        "by label: {by_label:?}"
    );
    let by_id = list(ContainerStatsFilter {
        id: spin[..12].to_owned(),
        ..Default::default()
    })
    .await?;
    ensure!(by_id.len() == 1, "by id prefix: {} stats", by_id.len());

    // Pod network: connect from the host to a closed port of the pod over
    // the test bridge; the pod's kernel answers with a reset, so eth0 has
    // traffic both ways.
    let status = d.pod_status(&pod).await?;
    let ip: std::net::IpAddr = status
        .network
        .as_ref()
        .context("no pod network")?
        .ip
        .parse()
        .context("pod ip")?;
    for _ in 0..3 {
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            tokio::net::TcpStream::connect((ip, 9)),
        )
        .await;
    }
    let ps = rt
        .pod_sandbox_stats(PodSandboxStatsRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await?
        .into_inner()
        .stats
        .context("no pod stats")?;
    let linux = ps.linux.context("no linux pod stats")?;
    let eth0 = linux
        .network
        .as_ref()
        .and_then(|n| n.default_interface.clone())
        .context("no default interface")?;
    println!("pod eth0: {eth0:?}");
    ensure!(eth0.name == "eth0", "default interface {}", eth0.name);
    ensure!(
        val(&eth0.rx_bytes) > 0 && val(&eth0.tx_bytes) > 0,
        "no traffic on eth0: {eth0:?}"
    );
    ensure!(
        linux.containers.len() == 2,
        "pod lists {} containers",
        linux.containers.len()
    );
    ensure!(
        linux
            .memory
            .as_ref()
            .map_or(0, |m| val(&m.working_set_bytes))
            >= 20_000_000,
        "pod memory {:?}",
        linux.memory
    );
    ensure!(
        linux.process.as_ref().map_or(0, |p| val(&p.process_count)) >= 3,
        "pod processes {:?}",
        linux.process
    );
    let all = rt
        .list_pod_sandbox_stats(ListPodSandboxStatsRequest {
            filter: Some(PodSandboxStatsFilter {
                id: pod.clone(),
                ..Default::default()
            }),
        })
        .await?
        .into_inner()
        .stats;
    ensure!(all.len() == 1, "ListPodSandboxStats by id: {}", all.len());

    // cAdvisor-named metrics.
    let descriptors = rt
        .list_metric_descriptors(ListMetricDescriptorsRequest {})
        .await?
        .into_inner()
        .descriptors;
    ensure!(
        descriptors
            .iter()
            .any(|d| d.name == "container_memory_working_set_bytes"),
        "descriptors {descriptors:?}"
    );
    let metrics = rt
        .list_pod_sandbox_metrics(ListPodSandboxMetricsRequest {})
        .await?
        .into_inner()
        .pod_metrics;
    let pm = metrics
        .iter()
        .find(|m| m.pod_sandbox_id == pod)
        .context("no metrics for the pod")?;
    ensure!(
        pm.metrics
            .iter()
            .any(|m| m.name == "container_network_receive_bytes_total"
                && m.label_values.last().map(String::as_str) == Some("eth0")),
        "no eth0 receive metric: {:?}",
        pm.metrics
    );
    let mem_metrics = pm
        .container_metrics
        .iter()
        .find(|c| c.container_id == mem)
        .context("no metrics for the mem container")?;
    let ws_metric = mem_metrics
        .metrics
        .iter()
        .find(|m| m.name == "container_memory_working_set_bytes")
        .context("no working set metric")?;
    ensure!(
        val(&ws_metric.value) >= 20_000_000 && ws_metric.label_values[0] == "mem",
        "working set metric {ws_metric:?}"
    );
    Ok(())
}

fn kind(e: &ContainerEventResponse) -> ContainerEventType {
    ContainerEventType::try_from(e.container_event_type)
        .unwrap_or(ContainerEventType::ContainerCreatedEvent)
}

async fn events_lifecycle(d: &Daemon) -> anyhow::Result<()> {
    let mut rt = d.runtime.clone();
    let mut stream = rt
        .get_container_events(GetEventsRequest {})
        .await?
        .into_inner();
    let (pod, pc) = run_pod(d, "events").await?;
    let id = create(d, &pod, &pc, "life", &["sleep", "3600"]).await?;
    start(d, &id).await?;
    rt.stop_container(StopContainerRequest {
        container_id: id.clone(),
        timeout: 0,
    })
    .await?;
    rt.remove_container(RemoveContainerRequest {
        container_id: id.clone(),
    })
    .await?;
    let mut seen = Vec::new();
    let collect = async {
        while let Some(ev) = stream.next().await {
            let ev = ev?;
            if ev.container_id == id {
                let k = kind(&ev);
                if k == ContainerEventType::ContainerCreatedEvent {
                    ensure!(
                        ev.pod_sandbox_status.as_ref().map(|s| s.id.as_str()) == Some(pod.as_str()),
                        "event without pod status: {ev:?}"
                    );
                }
                seen.push(k);
                if k == ContainerEventType::ContainerDeletedEvent {
                    return Ok(());
                }
            }
        }
        bail!("event stream ended")
    };
    tokio::time::timeout(CALL_BOUND, collect)
        .await
        .with_context(|| format!("no DELETED event; saw {seen:?}"))??;
    ensure!(
        seen == [
            ContainerEventType::ContainerCreatedEvent,
            ContainerEventType::ContainerStartedEvent,
            ContainerEventType::ContainerStoppedEvent,
            ContainerEventType::ContainerDeletedEvent,
        ],
        "events out of order: {seen:?}"
    );
    Ok(())
}

async fn stalled_subscriber(d: &Daemon) -> anyhow::Result<()> {
    let mut rt = d.runtime.clone();
    // Opened and never polled while the agent works: the HTTP/2 window
    // fills and the server side of this stream cannot send.
    let mut stalled = rt
        .get_container_events(GetEventsRequest {})
        .await?
        .into_inner();
    let mut pods = Vec::new();
    for p in 0..3 {
        let name = format!("stall{p}");
        let (pod, pc) = tokio::time::timeout(CALL_BOUND, run_pod(d, &name))
            .await
            .context("RunPodSandbox stalled")??;
        // Every event carries the statuses of all the pod's containers, so
        // these events add up to well over the stream's 64 KiB window.
        let mut ids = Vec::new();
        for i in 0..20 {
            let id = tokio::time::timeout(
                CALL_BOUND,
                create(d, &pod, &pc, &format!("c{i}"), &["sleep", "3600"]),
            )
            .await
            .context("CreateContainer stalled")??;
            ids.push(id);
        }
        for id in ids {
            tokio::time::timeout(
                CALL_BOUND,
                rt.remove_container(RemoveContainerRequest { container_id: id }),
            )
            .await
            .context("RemoveContainer stalled")??;
        }
        pods.push(pod);
    }
    // The stalled stream still works once read: it yields events (the oldest
    // may have been dropped and counted).
    let first = tokio::time::timeout(CALL_BOUND, stalled.next())
        .await
        .context("stalled stream yields nothing")?
        .context("stalled stream ended")??;
    ensure!(!first.container_id.is_empty(), "empty event {first:?}");
    for pod in pods {
        rt.stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await?;
        rt.remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: pod,
        })
        .await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_metrics_and_events() {
    if let Some(reason) = cubelet_e2e::skip_reason() {
        println!("SKIP: {reason}");
        return;
    }
    let d = Daemon::start(DaemonOpts {
        index: 8,
        ..Default::default()
    })
    .await
    .expect("start daemon");
    let mut failures = Vec::new();
    for name in [
        "stats_and_metrics",
        "events_lifecycle",
        "stalled_subscriber",
    ] {
        let result = match name {
            "stats_and_metrics" => stats_and_metrics(&d).await,
            "events_lifecycle" => events_lifecycle(&d).await,
            _ => stalled_subscriber(&d).await,
        };
        let result = match result {
            Ok(()) => d.remove_all().await.context("remove pods"),
            Err(e) => {
                let _ = d.remove_all().await;
                Err(e)
            }
        };
        let audit = leaks(&d).await;
        match (result, audit) {
            (Ok(()), Ok(l)) if l.is_empty() => println!("{name} ... ok"),
            (Ok(()), Ok(l)) => failures.push(format!("{name}: leaked:\n  {}", l.join("\n  "))),
            (Ok(()), Err(e)) => failures.push(format!("{name}: leak audit: {e:#}")),
            (Err(e), _) => failures.push(format!("{name}: {e:#}")),
        }
    }
    let log = d.log_tail(40);
    let torn = d.teardown().await;
    if !failures.is_empty() {
        panic!("{}\ndaemon log tail:\n{log}", failures.join("\n"));
    }
    torn.expect("teardown");
}
