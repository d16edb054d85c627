//! The `none` network provider over CRI (`network: { provider: none }` as a
//! drop-in over the harness config): NetworkReady is true; a pod gets a
//! pinned namespace of its own under `<state_dir>/netns` but no address, and
//! its host port is ignored; a busybox container in it sees only `lo`, up;
//! the node gets no bridge and no nftables table; StopPodSandbox removes
//! the pin; the GC reclaims an orphan pin (`cubelet_gc_reclaimed_total{kind="netns"}`);
//! after RemovePodSandbox nothing leaks.
//!
//! Without the private containerd it prints SKIP and passes.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{ensure, Context};
use cubelet_e2e::cri::{
    ExecSyncRequest, PodSandboxConfig, PodSandboxStatusRequest, PortMapping, Protocol,
    RemovePodSandboxRequest, StatusRequest, StopPodSandboxRequest,
};
use cubelet_e2e::{container_config, eventually, http_get, run, with_daemon, Daemon, DaemonOpts};

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";
/// The provider under test, and a fast GC so the orphan check is quick.
const EXTRA_CONFIG: &str = "network: { provider: none }\ngc: { interval: 1s }\n";

/// Runs `cmd` in container `ctr`; its stdout, failing on a non-zero exit.
async fn exec(d: &Daemon, ctr: &str, cmd: &[&str]) -> anyhow::Result<String> {
    let r = d
        .runtime
        .clone()
        .exec_sync(ExecSyncRequest {
            container_id: ctr.to_owned(),
            cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
            timeout: 15,
        })
        .await
        .with_context(|| format!("ExecSync {cmd:?}"))?
        .into_inner();
    ensure!(
        r.exit_code == 0,
        "{cmd:?} exited {}: {}",
        r.exit_code,
        String::from_utf8_lossy(&r.stderr)
    );
    Ok(String::from_utf8_lossy(&r.stdout).into_owned())
}

async fn network_ready(d: &Daemon) -> anyhow::Result<()> {
    let conds = d
        .runtime
        .clone()
        .status(StatusRequest { verbose: false })
        .await?
        .into_inner()
        .status
        .context("no runtime status")?
        .conditions;
    let c = conds
        .iter()
        .find(|c| c.r#type == "NetworkReady")
        .with_context(|| format!("no NetworkReady in {conds:?}"))?;
    ensure!(c.status, "NetworkReady false: {c:?}");
    Ok(())
}

/// Interface names in `/proc/net/dev` output (two header lines).
fn proc_net_dev_names(text: &str) -> Vec<String> {
    text.lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(|n| n.trim().to_owned())
        .collect()
}

async fn scenario(d: &Daemon) -> anyhow::Result<()> {
    network_ready(d).await?;
    d.pull(BUSYBOX).await?;

    let mut rt = d.runtime.clone();
    let config = PodSandboxConfig {
        // Ignored by the none provider (logged at debug).
        port_mappings: vec![PortMapping {
            protocol: Protocol::Tcp as i32,
            container_port: 8080,
            host_port: 18095,
            host_ip: String::new(),
        }],
        ..d.pod_config("none-pod")
    };
    let id = d.run_pod(&config, "").await?;

    // No address, and the namespace is pinned where the other providers pin it.
    let r = rt
        .pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: id.clone(),
            verbose: true,
        })
        .await
        .context("PodSandboxStatus")?
        .into_inner();
    let net = r
        .status
        .as_ref()
        .and_then(|s| s.network.as_ref())
        .context("no network status")?;
    ensure!(
        net.ip.is_empty() && net.additional_ips.is_empty(),
        "pod has addresses: {net:?}"
    );
    let info: serde_json::Value =
        serde_json::from_str(r.info.get("info").context("no verbose info")?)?;
    let pin = d.state_dir.join("netns").join(&id);
    ensure!(
        info["netnsPath"].as_str().map(PathBuf::from) == Some(pin.clone()),
        "netnsPath {} is not {}",
        info["netnsPath"],
        pin.display()
    );
    ensure!(
        !cubelet_e2e::mounts_under(&[pin.as_path()]).is_empty(),
        "netns pin {} is not mounted",
        pin.display()
    );

    // The node gets nothing: no bridge, no nftables table for the host port.
    ensure!(
        !Path::new("/sys/class/net").join(&d.bridge).exists(),
        "bridge {} created by the none provider",
        d.bridge
    );
    let table = format!("cubelet_{}", d.bridge);
    ensure!(
        run("nft", &["list", "table", "ip", &table]).await.is_err(),
        "nftables table {table} created by the none provider"
    );

    // A container of the pod: in the pinned namespace, with only lo, up.
    let ctr = d
        .start_in(
            &id,
            &config,
            container_config("none-ctr", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;
    let ns = exec(d, &ctr, &["busybox", "readlink", "/proc/self/ns/net"]).await?;
    let want = format!("net:[{}]", std::fs::metadata(&pin)?.ino());
    ensure!(ns.trim() == want, "container netns {ns:?}, pin {want:?}");
    let dev = exec(d, &ctr, &["cat", "/proc/net/dev"]).await?;
    ensure!(
        proc_net_dev_names(&dev) == ["lo"],
        "/proc/net/dev shows more than lo:\n{dev}"
    );
    let links = exec(d, &ctr, &["ip", "-o", "link"]).await?;
    ensure!(
        links.lines().count() == 1 && links.contains(": lo: ") && links.contains(",UP"),
        "ip -o link:\n{links}"
    );
    let addrs = exec(d, &ctr, &["ip", "-o", "-4", "addr"]).await?;
    ensure!(
        addrs.lines().count() == 1 && addrs.contains("127.0.0.1/8"),
        "ip -o -4 addr:\n{addrs}"
    );

    // An orphan pin (a sandbox nobody knows) is reclaimed by the GC; the
    // live pod's pin is kept.
    let ghost = d.state_dir.join("netns").join(format!("{:0>64}", "0dead"));
    std::fs::write(&ghost, "")?;
    run("unshare", &[&format!("--net={}", ghost.display()), "true"]).await?;
    // The pin goes during a pass; the pass counts it when it ends.
    eventually(
        "orphan pin reclaimed and counted",
        Duration::from_secs(30),
        || async {
            let metrics = http_get(d.metrics, "/metrics").await?.1;
            Ok(!ghost.exists()
                && metrics.lines().any(|l| {
                    l.starts_with("cubelet_gc_reclaimed_total{")
                        && l.contains("kind=\"netns\"")
                        && !l.ends_with(" 0")
                }))
        },
    )
    .await?;
    ensure!(pin.exists(), "the GC removed the live pod's pin");

    // StopPodSandbox (containers, then destroy) removes the pin;
    // RemovePodSandbox (cleanup) finds it gone and succeeds.
    rt.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: id.clone(),
    })
    .await
    .context("StopPodSandbox")?;
    ensure!(!pin.exists(), "pin {} left after stop", pin.display());
    rt.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: id.clone(),
    })
    .await
    .context("StopPodSandbox again")?;
    for _ in 0..2 {
        rt.remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: id.clone(),
        })
        .await
        .context("RemovePodSandbox")?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn none_provider_gives_pods_a_loopback_only_namespace() {
    let opts = DaemonOpts {
        index: 15,
        extra_config: Some(EXTRA_CONFIG.into()),
        ..Default::default()
    };
    with_daemon(opts, Duration::from_secs(180), |d| Box::pin(scenario(d))).await;
}
