//! Sandboxes without an infra process (`runtime.sandbox: auto`, the
//! default), over CRI against the real daemon and containerd.
//!
//! A pod that does not share one PID namespace gets no pause container: its
//! containers share the IPC namespace (a message queue one makes, the other
//! sees) and the UTS namespace (the pod's hostname) through pins under the
//! state dir, and the netns pin. Status, stats, metrics, events and
//! port-forward work for it; stop and remove leave nothing. A pod-level PID
//! namespace, or a user namespace of the pod's own, still gets a pause
//! container; `runtime.sandbox: pause` gives
//! every pod one, and a restart in either mode keeps the pods of the other.
//! A restart keeps an infra-less pod ready while its pins exist, and the GC
//! takes pins no sandbox owns. Once a container runs, such a pod gets a
//! stats anchor (a pause container with the sandbox id in the pod's
//! namespaces, for kubelet's cAdvisor); its death is not the pod's, and
//! the pod's teardown, a kill in the middle and a restart leave none.
//!
//! Custom runner ([`cubelet_e2e::scenario_main`]): one daemon, scenarios in
//! order, each followed by removal through CRI and the leak audit.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use cubelet_e2e::cri::{
    ContainerEventType, ExecSyncRequest, GetEventsRequest, IdMapping, LinuxContainerConfig,
    LinuxContainerSecurityContext, ListPodSandboxMetricsRequest, NamespaceMode, PodSandboxConfig,
    PodSandboxState, PodSandboxStatsRequest, PodSandboxStatusRequest, PortForwardRequest,
    RemoveContainerRequest, RemovePodSandboxRequest, StatusRequest, StopContainerRequest,
    StopPodSandboxRequest, UserNamespace,
};
use cubelet_e2e::{
    container_config, eventually, http_get, pid_per_container, Daemon, DaemonOpts, Scenario,
};
use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";

fn scenarios() -> Vec<Scenario> {
    vec![
        ("infraless_pod_shares_ipc_and_uts", 180, |d| {
            Box::pin(shares_ipc_and_uts(d))
        }),
        ("pod_pid_namespace_keeps_the_pause_container", 120, |d| {
            Box::pin(pod_pid_keeps_pause(d))
        }),
        ("a_pod_user_namespace_keeps_the_pause_container", 120, |d| {
            Box::pin(userns_keeps_pause(d))
        }),
        ("restart_keeps_infraless_pods_by_their_pins", 180, |d| {
            Box::pin(restart_by_pins(d))
        }),
        ("pause_mode_and_back", 240, |d| {
            Box::pin(pause_mode_and_back(d))
        }),
        ("gc_reclaims_orphan_pins", 120, |d| {
            Box::pin(gc_orphan_pins(d))
        }),
        (
            "a_stats_anchor_serves_cadvisor_and_goes_with_its_pod",
            180,
            |d| Box::pin(stats_anchor(d)),
        ),
    ]
}

fn main() -> ExitCode {
    let opts = DaemonOpts {
        index: 31,
        extra_config: Some("gc: { interval: 1s }\n".to_owned()),
        ..Default::default()
    };
    cubelet_e2e::scenario_main(opts, scenarios())
}

/// Runs an infra-less pod `name`; returns its id and config.
async fn infraless(d: &Daemon, name: &str) -> anyhow::Result<(String, PodSandboxConfig)> {
    d.pull(BUSYBOX).await?;
    let cfg = pid_per_container(d.pod_config(name));
    let id = d.run_pod(&cfg, "").await?;
    Ok((id, cfg))
}

/// The ids of every containerd container of the daemon's namespace but
/// the keepers of its warm-pool shells (`pools.sandbox.shim`: a pause
/// container with the shell's id, which a claiming pod's stats anchor
/// replaces; the leak audit after each scenario counts them).
async fn containerd_containers(d: &Daemon) -> anyhow::Result<BTreeSet<String>> {
    let ids = |out: String| -> BTreeSet<String> {
        out.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let all = ids(d.ctr(&["containers", "ls", "-q"]).await?);
    let keepers = ids(d
        .ctr(&[
            "containers",
            "ls",
            "-q",
            "labels.\"io.cubelet.sandbox/keeper\"==true",
        ])
        .await?);
    Ok(all.difference(&keepers).cloned().collect())
}

/// Runs `sh -c cmd` in container `id`; its stdout, trimmed.
async fn sh(d: &Daemon, id: &str, cmd: &str) -> anyhow::Result<String> {
    let r = d
        .runtime
        .clone()
        .exec_sync(ExecSyncRequest {
            container_id: id.to_owned(),
            cmd: vec!["sh".into(), "-c".into(), cmd.into()],
            timeout: 10,
        })
        .await
        .with_context(|| format!("exec {cmd:?} in {id}"))?
        .into_inner();
    ensure!(
        r.exit_code == 0,
        "{cmd:?} in {id} exited {}: {}",
        r.exit_code,
        String::from_utf8_lossy(&r.stderr)
    );
    Ok(String::from_utf8_lossy(&r.stdout).trim().to_owned())
}

/// The verbose info of PodSandboxStatus, as JSON.
async fn verbose(d: &Daemon, id: &str) -> anyhow::Result<serde_json::Value> {
    let r = d
        .runtime
        .clone()
        .pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: id.to_owned(),
            verbose: true,
        })
        .await?
        .into_inner();
    let info = r.info.get("info").context("no verbose info")?;
    Ok(serde_json::from_str(info)?)
}

/// The nsfs mount points at or under `dir`.
fn ns_mount_points(dir: &Path) -> Vec<std::path::PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter(|l| l.contains(" nsfs "))
        .filter_map(|l| l.split(' ').nth(4))
        .map(std::path::PathBuf::from)
        .filter(|m| m.starts_with(dir))
        .collect()
}

/// nsfs mounts at or under `dir`.
fn ns_mounts(dir: &Path) -> usize {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter(|l| l.contains(" nsfs "))
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| Path::new(m).starts_with(dir))
        .count()
}

async fn stop_and_remove(d: &Daemon, id: &str) -> anyhow::Result<()> {
    let mut rt = d.runtime.clone();
    rt.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: id.to_owned(),
    })
    .await?;
    rt.remove_pod_sandbox(RemovePodSandboxRequest {
        pod_sandbox_id: id.to_owned(),
    })
    .await?;
    Ok(())
}

/// Forwards to `port` of pod `pod` over WebSocket (`v4.channel.k8s.io`)
/// and sends `request`; what came back on the data channel, or an error
/// once the pod's error channel speaks.
async fn port_forward(d: &Daemon, pod: &str, port: u16, request: &[u8]) -> anyhow::Result<String> {
    let url = d
        .runtime
        .clone()
        .port_forward(PortForwardRequest {
            pod_sandbox_id: pod.to_owned(),
            port: vec![i32::from(port)],
        })
        .await?
        .into_inner()
        .url;
    let ws_url = format!("{url}?port={port}").replacen("http://", "ws://", 1);
    let mut req = ws_url.into_client_request()?;
    let authority = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .context("no authority")?;
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", "v4.channel.k8s.io".parse()?);
    let tcp = tokio::net::TcpStream::connect(authority).await?;
    let (mut ws, _) = tokio_tungstenite::client_async(req, tcp).await?;
    // Each channel first carries the port.
    for _ in 0..2 {
        match ws.next().await {
            Some(Ok(Message::Binary(_))) => {}
            other => bail!("port-forward preamble: {other:?}"),
        }
    }
    let mut frame = vec![0u8];
    frame.extend_from_slice(request);
    ws.send(Message::Binary(frame.into())).await?;
    let mut data = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => match b.split_first() {
                Some((0, rest)) => data.extend_from_slice(rest),
                Some((1, rest)) if !rest.is_empty() => {
                    bail!("port-forward error: {}", String::from_utf8_lossy(rest))
                }
                _ => {}
            },
            Ok(Some(Ok(_))) => {}
            _ => break,
        }
        if String::from_utf8_lossy(&data).contains("</html>")
            || String::from_utf8_lossy(&data).contains("hello-pod")
        {
            break;
        }
    }
    let _ = ws.close(None).await;
    Ok(String::from_utf8_lossy(&data).into_owned())
}

async fn shares_ipc_and_uts(d: &Daemon) -> anyhow::Result<()> {
    let mut events = d
        .runtime
        .clone()
        .get_container_events(GetEventsRequest {})
        .await?
        .into_inner();
    let (pod, cfg) = infraless(d, "nopause").await?;

    // Ready, with an IP, and no infra container anywhere.
    let status = d.pod_status(&pod).await?;
    ensure!(
        status.state == PodSandboxState::SandboxReady as i32,
        "{status:?}"
    );
    let ip = status
        .network
        .as_ref()
        .map(|n| n.ip.clone())
        .unwrap_or_default();
    ensure!(!ip.is_empty(), "no pod IP: {status:?}");
    let info = verbose(d, &pod).await?;
    ensure!(info["pid"].is_null(), "an infra pid: {info}");
    ensure!(info["infraContainer"] == false, "{info}");
    let pins = d.podns_dir().join(&pod);
    ensure!(
        info["ipcPath"] == pins.join("ipc").display().to_string()
            && info["utsPath"] == pins.join("uts").display().to_string(),
        "pins not where expected: {info}"
    );
    ensure!(ns_mounts(&pins) == 2, "ipc and uts pins mounted");
    ensure!(
        containerd_containers(d).await?.is_empty(),
        "containerd holds a container for the pod itself"
    );

    // Two containers: one IPC namespace, one hostname, a PID namespace each.
    let a = d
        .start_in(
            &pod,
            &cfg,
            container_config(
                "a",
                BUSYBOX,
                &[
                    "sh",
                    "-c",
                    "touch /dev/mqueue/cubelet-q && mkdir -p /tmp/www && \
                     echo hello-pod > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www",
                ],
            ),
        )
        .await?;
    let b = d
        .start_in(
            &pod,
            &cfg,
            container_config("b", BUSYBOX, &["sleep", "100000"]),
        )
        .await?;
    // The two containers, and (made in the background once a container
    // runs) the pod's stats anchor: nothing else.
    eventually(
        "the two containers and the stats anchor",
        Duration::from_secs(30),
        || async {
            Ok(containerd_containers(d).await?
                == [a.clone(), b.clone(), pod.clone()].into_iter().collect())
        },
    )
    .await?;
    eventually(
        "b sees a's message queue",
        Duration::from_secs(10),
        || async { Ok(sh(d, &b, "ls /dev/mqueue").await? == "cubelet-q") },
    )
    .await?;
    let ipc_ino =
        std::fs::metadata(pins.join("ipc")).map(|m| std::os::unix::fs::MetadataExt::ino(&m))?;
    for c in [&a, &b] {
        ensure!(
            sh(d, c, "readlink /proc/self/ns/ipc").await? == format!("ipc:[{ipc_ino}]"),
            "{c} is not in the pinned IPC namespace"
        );
        ensure!(sh(d, c, "hostname").await? == "nopause", "hostname of {c}");
    }
    ensure!(
        sh(d, &a, "readlink /proc/self/ns/pid").await?
            != sh(d, &b, "readlink /proc/self/ns/pid").await?,
        "a PID namespace each"
    );
    ensure!(
        sh(d, &b, "cat /proc/1/cmdline | tr '\\0' ' '").await? == "sleep 100000",
        "b is pid 1 of its own namespace"
    );

    // Port-forward dials into the netns pin; the pod's traffic shows in
    // its stats and metrics (read through the pin: there is no infra process).
    let mut got = String::new();
    for _ in 0..50 {
        got = port_forward(d, &pod, 8080, b"GET /index.html HTTP/1.0\r\n\r\n")
            .await
            .unwrap_or_else(|e| format!("{e:#}"));
        if got.contains("hello-pod") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ensure!(got.contains("hello-pod"), "port-forward: {got}");
    let stats = d
        .runtime
        .clone()
        .pod_sandbox_stats(PodSandboxStatsRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await?
        .into_inner()
        .stats
        .context("no pod stats")?;
    let linux = stats.linux.context("no linux pod stats")?;
    let eth0 = linux
        .network
        .as_ref()
        .and_then(|n| n.default_interface.clone())
        .context("no pod network stats")?;
    ensure!(eth0.name == "eth0", "{eth0:?}");
    ensure!(
        eth0.rx_bytes.map_or(0, |v| v.value) > 0 || eth0.tx_bytes.map_or(0, |v| v.value) > 0,
        "no traffic counted: {eth0:?}"
    );
    ensure!(
        linux.cpu.is_some() && linux.memory.is_some(),
        "pod cpu/memory"
    );
    ensure!(linux.containers.len() == 2, "two containers' stats");
    let metrics = d
        .runtime
        .clone()
        .list_pod_sandbox_metrics(ListPodSandboxMetricsRequest {})
        .await?
        .into_inner();
    let ours = metrics
        .pod_metrics
        .iter()
        .find(|m| m.pod_sandbox_id == pod)
        .context("no metrics for the pod")?;
    ensure!(
        ours.metrics
            .iter()
            .any(|m| m.name == "container_network_receive_bytes_total"),
        "no pod network metrics"
    );
    ensure!(ours.container_metrics.len() == 2, "two containers' metrics");

    // From the host: the pod answers on its IP (the bridge).
    let (code, body) = http_get(format!("{ip}:8080").parse()?, "/index.html").await?;
    ensure!(code == 200 && body.contains("hello-pod"), "{code} {body}");

    // Stop: containers stopped, pins gone; remove: nothing left.
    d.runtime
        .clone()
        .stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await?;
    ensure!(!pins.exists(), "pins left after StopPodSandbox");
    // The warm pool's shells (pools.sandbox.size, on by default) hold pins
    // of their own there; nothing else may.
    // Listed before the shells are asked for, so a shell begun meanwhile
    // is never taken for a leak.
    let mounted = ns_mount_points(&d.podns_dir());
    let shells = d.shells().await?;
    let left: Vec<_> = mounted
        .iter()
        .filter(|m| !shells.iter().any(|s| m.starts_with(d.podns_dir().join(s))))
        .collect();
    ensure!(left.is_empty(), "nsfs mounts left: {left:?}");
    let status = d.pod_status(&pod).await?;
    ensure!(
        status.state == PodSandboxState::SandboxNotready as i32,
        "{status:?}"
    );
    ensure!(
        d.container_status(&a).await?.state
            == cubelet_e2e::cri::ContainerState::ContainerExited as i32,
        "a still running"
    );
    d.runtime
        .clone()
        .remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await?;

    // The pod's own events: created, started, stopped, deleted, in order.
    let mut seen = Vec::new();
    let collect = async {
        while let Some(ev) = events.next().await {
            let ev = ev?;
            if ev.container_id == pod {
                let k = ContainerEventType::try_from(ev.container_event_type)?;
                seen.push(k);
                if k == ContainerEventType::ContainerDeletedEvent {
                    return anyhow::Ok(());
                }
            }
        }
        bail!("event stream ended")
    };
    tokio::time::timeout(Duration::from_secs(10), collect)
        .await
        .with_context(|| format!("no DELETED event for the pod; saw {seen:?}"))??;
    ensure!(
        seen == [
            ContainerEventType::ContainerCreatedEvent,
            ContainerEventType::ContainerStartedEvent,
            ContainerEventType::ContainerStoppedEvent,
            ContainerEventType::ContainerDeletedEvent,
        ],
        "pod events: {seen:?}"
    );
    Ok(())
}

async fn pod_pid_keeps_pause(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let cfg = d.pod_config("shared-pid");
    let pod = d.run_pod(&cfg, "").await?;
    ensure!(
        containerd_containers(d).await?.contains(&pod),
        "no pause container for a pod-level PID namespace"
    );
    let info = verbose(d, &pod).await?;
    ensure!(
        info["pid"].is_u64() && info["infraContainer"] == true,
        "{info}"
    );
    ensure!(!d.podns_dir().join(&pod).exists(), "pins for a pause pod");
    let c = d
        .start_in(
            &pod,
            &cfg,
            container_config("c", BUSYBOX, &["sleep", "100000"]),
        )
        .await?;
    ensure!(
        sh(d, &c, "cat /proc/1/cmdline | tr '\\0' ' '")
            .await?
            .trim()
            == "/pause",
        "pid 1 of the pod is not the pause process"
    );
    ensure!(sh(d, &c, "hostname").await? == "shared-pid", "hostname");
    stop_and_remove(d, &pod).await
}

async fn userns_keeps_pause(d: &Daemon) -> anyhow::Result<()> {
    let status = d
        .runtime
        .clone()
        .status(StatusRequest { verbose: false })
        .await?
        .into_inner();
    let userns = status
        .runtime_handlers
        .iter()
        .find(|h| h.name.is_empty())
        .and_then(|h| h.features)
        .is_some_and(|f| f.user_namespaces);
    if !userns {
        println!("SKIP: this node cannot make user namespaces");
        return Ok(());
    }
    d.pull(BUSYBOX).await?;
    // As kubelet asks for a hostUsers: false pod: a PID namespace per
    // container, and a user namespace of the pod's own.
    let mut cfg = pid_per_container(d.pod_config("own-users"));
    let map = IdMapping {
        host_id: 400_000,
        container_id: 0,
        length: 65536,
    };
    let options = cfg
        .linux
        .as_mut()
        .and_then(|l| l.security_context.as_mut())
        .and_then(|s| s.namespace_options.as_mut())
        .context("namespace options")?;
    options.userns_options = Some(UserNamespace {
        mode: NamespaceMode::Pod as i32,
        uids: vec![map],
        gids: vec![map],
    });
    let options = options.clone();
    let pod = d.run_pod(&cfg, "").await?;
    ensure!(
        containerd_containers(d).await?.contains(&pod),
        "a pod with a user namespace runs its pause container"
    );
    ensure!(!d.podns_dir().join(&pod).exists(), "pins for a pause pod");
    let mut c = container_config("c", BUSYBOX, &["sleep", "100000"]);
    c.linux = Some(LinuxContainerConfig {
        security_context: Some(LinuxContainerSecurityContext {
            namespace_options: Some(options),
            ..Default::default()
        }),
        ..Default::default()
    });
    let c = d.start_in(&pod, &cfg, c).await?;
    let map = sh(d, &c, "cat /proc/self/uid_map").await?;
    ensure!(
        map.split_whitespace().collect::<Vec<_>>() == ["0", "400000", "65536"],
        "{map}"
    );
    ensure!(
        sh(d, &c, "cat /proc/1/cmdline | tr '\\0' ' '")
            .await?
            .trim()
            == "sleep 100000",
        "a PID namespace of its own"
    );
    stop_and_remove(d, &pod).await
}

async fn restart_by_pins(d: &Daemon) -> anyhow::Result<()> {
    let (pod, cfg) = infraless(d, "survivor").await?;
    let c = d
        .start_in(
            &pod,
            &cfg,
            container_config("c", BUSYBOX, &["sleep", "100000"]),
        )
        .await?;
    d.restart().await?;
    let status = d.pod_status(&pod).await?;
    ensure!(
        status.state == PodSandboxState::SandboxReady as i32,
        "not ready after a restart: {status:?}"
    );
    ensure!(sh(d, &c, "hostname").await? == "survivor", "container lost");

    // Pins gone while the agent was down: the sandbox is not ready.
    let (doomed, _) = infraless(d, "doomed").await?;
    d.kill9().await?;
    let uts = d.podns_dir().join(&doomed).join("uts");
    nix::mount::umount2(&uts, nix::mount::MntFlags::MNT_DETACH)?;
    d.start_with_env(&[]).await?;
    let status = d.pod_status(&doomed).await?;
    ensure!(
        status.state == PodSandboxState::SandboxNotready as i32,
        "ready without its UTS pin: {status:?}"
    );
    ensure!(
        d.pod_status(&pod).await?.state == PodSandboxState::SandboxReady as i32,
        "the other pod is still ready"
    );
    stop_and_remove(d, &doomed).await?;
    stop_and_remove(d, &pod).await
}

/// Writes (or with `None` removes) the drop-in that sets `runtime.sandbox`,
/// and restarts the daemon.
async fn set_mode(d: &Daemon, mode: Option<&str>) -> anyhow::Result<()> {
    let file = d.config_dir().join("config.d").join("60-sandbox.yaml");
    match mode {
        Some(m) => std::fs::write(&file, format!("runtime: {{ sandbox: {m} }}\n"))?,
        None => std::fs::remove_file(&file)?,
    }
    d.restart().await
}

async fn pause_mode_and_back(d: &Daemon) -> anyhow::Result<()> {
    let (before, _) = infraless(d, "made-in-auto").await?;
    set_mode(d, Some("pause")).await?;
    let result = async {
        ensure!(
            d.pod_status(&before).await?.state == PodSandboxState::SandboxReady as i32,
            "an auto-mode pod is kept by its pins in pause mode"
        );
        let (paused, cfg) = infraless(d, "made-in-pause").await?;
        ensure!(
            containerd_containers(d).await?.contains(&paused),
            "pause mode: no pause container"
        );
        ensure!(!d.podns_dir().join(&paused).exists());
        let c = d
            .start_in(
                &paused,
                &cfg,
                container_config("c", BUSYBOX, &["sleep", "100000"]),
            )
            .await?;
        ensure!(
            sh(d, &c, "cat /proc/1/cmdline | tr '\\0' ' '")
                .await?
                .trim()
                == "sleep 100000",
            "pid namespace per container, still"
        );
        // Torn down in pause mode: pins go.
        stop_and_remove(d, &before).await?;
        ensure!(!d.podns_dir().join(&before).exists());
        anyhow::Ok(paused)
    }
    .await;
    set_mode(d, None).await?;
    let paused = result?;
    // Back in auto mode, the pause-mode pod is torn down whole.
    ensure!(
        d.pod_status(&paused).await?.state == PodSandboxState::SandboxReady as i32,
        "the pause-mode pod survives the switch back"
    );
    stop_and_remove(d, &paused).await?;
    ensure!(
        !containerd_containers(d).await?.contains(&paused),
        "pause container left"
    );
    Ok(())
}

async fn gc_orphan_pins(d: &Daemon) -> anyhow::Result<()> {
    // An orphan: the pins of a sandbox the store never knew (a pin of the
    // test's own IPC namespace: pinning it changes nothing).
    let orphan = d.podns_dir().join(format!("{:064x}", 0xdead_u32));
    std::fs::create_dir_all(&orphan)?;
    let pin = orphan.join("ipc");
    std::fs::write(&pin, b"")?;
    nix::mount::mount(
        Some("/proc/self/ns/ipc"),
        &pin,
        None::<&str>,
        nix::mount::MsFlags::MS_BIND,
        None::<&str>,
    )?;
    // A live pod's pins stay.
    let (pod, _) = infraless(d, "kept").await?;
    eventually("orphan pins reclaimed", Duration::from_secs(30), || async {
        Ok(!orphan.exists())
    })
    .await?;
    ensure!(ns_mounts(&orphan) == 0, "orphan pin still mounted");
    ensure!(
        d.podns_dir().join(&pod).join("ipc").exists(),
        "a live pod lost its pins"
    );
    let (_, metrics) = http_get(d.metrics, "/metrics").await?;
    let reclaimed = metrics
        .lines()
        .find(|l| l.starts_with("cubelet_gc_reclaimed_total{kind=\"podns\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    ensure!(reclaimed >= 1.0, "podns reclaims not counted: {reclaimed}");
    stop_and_remove(d, &pod).await
}

/// The pid of the running task `id` (`ctr tasks ls`), if there is one.
async fn task_pid(d: &Daemon, id: &str) -> anyhow::Result<Option<u32>> {
    let tasks = d.ctr(&["tasks", "ls"]).await?;
    Ok(tasks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() >= 3 && f[0] == id && f[2] == "RUNNING")
            .then(|| f[1].parse().ok())
            .flatten()
    }))
}

/// Waits for pod `pod`'s stats anchor to run (not its shell's keeper,
/// which the anchor replaces); its pid.
async fn anchor_pid(d: &Daemon, pod: &str) -> anyhow::Result<u32> {
    eventually("the stats anchor runs", Duration::from_secs(30), || async {
        Ok(containerd_containers(d).await?.contains(pod) && task_pid(d, pod).await?.is_some())
    })
    .await?;
    task_pid(d, pod).await?.context("no anchor pid")
}

async fn stats_anchor(d: &Daemon) -> anyhow::Result<()> {
    let (pod, cfg) = infraless(d, "anchored").await?;
    // None before a container runs: RunPodSandbox makes nothing in containerd.
    ensure!(
        containerd_containers(d).await?.is_empty(),
        "an anchor before any container"
    );
    let c = d
        .start_in(
            &pod,
            &cfg,
            container_config("c", BUSYBOX, &["sleep", "100000"]),
        )
        .await?;
    let pid = anchor_pid(d, &pod).await?;

    // What kubelet's cAdvisor needs: the sandbox id, the sandbox kind and
    // the pod's labels, a cgroup named by the id, a task in the pod's netns.
    let info: serde_json::Value =
        serde_json::from_str(&d.ctr(&["containers", "info", &pod]).await?)?;
    let labels = &info["Labels"];
    ensure!(labels["io.cri-containerd.kind"] == "sandbox", "{labels}");
    ensure!(labels["app"] == "anchored", "the pod's labels: {labels}");
    // It shares the container's shim: no shim of its own.
    let parent = |p: u32| -> anyhow::Result<String> {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat"))?;
        let after = stat.rsplit_once(')').map_or("", |(_, a)| a);
        Ok(after.split_whitespace().nth(1).unwrap_or("").to_owned())
    };
    let c_pid = task_pid(d, &c).await?.context("no task of c")?;
    ensure!(
        parent(pid)? == parent(c_pid)?,
        "the anchor has a shim of its own"
    );
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    ensure!(
        cgroup
            .lines()
            .any(|l| l.trim_end().ends_with(&format!("/{pod}"))),
        "the anchor's cgroup is not named by the sandbox id: {cgroup}"
    );
    let anchor_net = std::fs::read_link(format!("/proc/{pid}/ns/net"))?;
    ensure!(
        sh(d, &c, "readlink /proc/self/ns/net").await? == anchor_net.display().to_string(),
        "the anchor is not in the pod's network namespace"
    );
    let anchor_uts = std::fs::read_link(format!("/proc/{pid}/ns/uts"))?;
    ensure!(
        sh(d, &c, "readlink /proc/self/ns/uts").await? == anchor_uts.display().to_string(),
        "the anchor is not in the pod's UTS namespace"
    );
    ensure!(
        d.podns_dir().join(&pod).join("stats-anchor").exists(),
        "no anchor marker in the pin directory"
    );

    // The container whose shim it shares goes: the shim stays for the
    // anchor, and the GC (every second here) does not take it for an
    // orphan once it is past the reaper's minimum age (10 s).
    let mut rt = d.runtime.clone();
    rt.stop_container(StopContainerRequest {
        container_id: c.clone(),
        timeout: 0,
    })
    .await?;
    rt.remove_container(RemoveContainerRequest {
        container_id: c.clone(),
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(12)).await;
    ensure!(
        task_pid(d, &pod).await? == Some(pid),
        "the anchor did not outlive the container whose shim it shares"
    );
    ensure!(
        Path::new(&format!("/proc/{}", parent(pid)?)).exists(),
        "the shared shim is gone"
    );

    // Its death is not the pod's; the next container start makes it again.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid)?),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    eventually("the anchor's exit", Duration::from_secs(10), || async {
        Ok(task_pid(d, &pod).await?.is_none())
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    ensure!(
        d.pod_status(&pod).await?.state == PodSandboxState::SandboxReady as i32,
        "the anchor's exit made the pod not ready"
    );
    d.start_in(
        &pod,
        &cfg,
        container_config("c2", BUSYBOX, &["sleep", "100000"]),
    )
    .await?;
    let again = anchor_pid(d, &pod).await?;
    ensure!(again != pid, "the same anchor");
    let (_, metrics) = http_get(d.metrics, "/metrics").await?;
    let started = metrics
        .lines()
        .find(|l| l.starts_with("cubelet_stats_anchors_total{result=\"started\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    ensure!(started >= 2.0, "anchors not counted: {started}");

    // A kill of the agent, then a restart: the anchor is still there, and
    // the pod's stop and removal take it with the pins.
    d.kill9().await?;
    d.start_with_env(&[]).await?;
    ensure!(
        task_pid(d, &pod).await? == Some(again),
        "the anchor did not survive the agent's restart"
    );
    stop_and_remove(d, &pod).await?;
    ensure!(
        !containerd_containers(d).await?.contains(&pod),
        "the anchor outlived its pod"
    );
    ensure!(!d.podns_dir().join(&pod).exists(), "pins left");

    // A pod removed right after its first container started (before the
    // anchor's delay): none is made for it, then or later (the leak audit
    // after this scenario checks containerd, tasks and shims).
    for i in 0..5 {
        let (p, cfg) = infraless(d, &format!("quick-{i}")).await?;
        d.start_in(
            &p,
            &cfg,
            container_config("c", BUSYBOX, &["sleep", "100000"]),
        )
        .await?;
        stop_and_remove(d, &p).await?;
        ensure!(
            !containerd_containers(d).await?.contains(&p),
            "an anchor outlived pod quick-{i}"
        );
    }
    // A pod removed while its anchor is being made (just past the delay):
    // the removal waits for it and takes it.
    for i in 0..4u64 {
        let (p, cfg) = infraless(d, &format!("racing-{i}")).await?;
        d.start_in(
            &p,
            &cfg,
            container_config("c", BUSYBOX, &["sleep", "100000"]),
        )
        .await?;
        tokio::time::sleep(Duration::from_millis(2000 + 40 * i)).await;
        stop_and_remove(d, &p).await?;
        ensure!(
            !containerd_containers(d).await?.contains(&p),
            "an anchor outlived pod racing-{i}"
        );
    }
    // Nothing made later either (past the delay, 2 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        containerd_containers(d).await?.is_empty(),
        "anchors made after their pods went"
    );
    Ok(())
}
