//! A pod against the node's loopback (the CVE-2020-8558 class). The bridge
//! has `route_localnet` on, so without a guard a pod holding the default
//! `CAP_NET_RAW` can send the bridge's MAC a packet for 127.0.0.1 and reach
//! what the node serves there, or a host port bound to `hostIP: 127.0.0.1`.
//!
//! The attack is made for real from the attacking pod's network namespace
//! (a thread of the test `setns`es into its pin): 127.0.0.1 is routed there
//! to the bridge, so a connect to 127.0.0.1 puts on the wire exactly the
//! frame an attacker crafts with a raw socket (to the bridge's MAC, from
//! the pod's address, to 127.0.0.1), and the handshake tells whether the
//! node answered. (Rewiring the pod's routes stands in for the raw socket,
//! which the workspace's `forbid(unsafe_code)` keeps out of the tests; the
//! node sees the same packets.) A connect to the bridge address from the
//! same namespace is the control, so "no answer" means the guard, not a
//! broken probe.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use cubelet_e2e::cri::{ExecSyncRequest, PodSandboxConfig, PortMapping, Protocol};
use cubelet_e2e::{container_config, with_daemon, Daemon, DaemonOpts};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";

/// Runs a pod with one busybox container running `command`; returns the
/// pod id, the container id and the pod's IP.
async fn pod(
    d: &Daemon,
    name: &str,
    ports: Vec<PortMapping>,
    command: &[&str],
) -> anyhow::Result<(String, String, Ipv4Addr)> {
    let config = PodSandboxConfig {
        port_mappings: ports,
        ..d.pod_config(name)
    };
    let id = d.run_pod(&config, "").await?;
    let ctr = d
        .start_in(&id, &config, container_config(name, BUSYBOX, command))
        .await?;
    let ip = d
        .pod_status(&id)
        .await?
        .network
        .context("no network status")?
        .ip
        .parse()?;
    Ok((id, ctr, ip))
}

/// Runs `prog args` (from the calling thread's namespaces).
fn run_here(prog: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = std::process::Command::new(prog)
        .args(args)
        .output()
        .with_context(|| format!("run {prog}"))?;
    ensure!(
        out.status.success(),
        "{prog} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Turns the network namespace pinned at `pin` into the attacker: its
/// 127.0.0.0/8 is no longer its own, 127.0.0.1 is routed to `gateway` (the
/// bridge) and answers from 127.0.0.1 are accepted on `eth0`. What leaves
/// it for 127.0.0.1 is then exactly the crafted frame of CVE-2020-8558: to
/// the bridge's MAC, from the pod's address, to 127.0.0.1.
fn arm(pin: &Path, gateway: Ipv4Addr) -> anyhow::Result<()> {
    in_netns(pin, move || {
        run_here("ip", &["addr", "flush", "dev", "lo"])?;
        run_here(
            "ip",
            &[
                "route",
                "add",
                "127.0.0.1/32",
                "via",
                &gateway.to_string(),
                "dev",
                "eth0",
            ],
        )?;
        run_here("sysctl", &["-qw", "net.ipv4.conf.eth0.route_localnet=1"])?;
        run_here("sysctl", &["-qw", "net.ipv4.conf.all.rp_filter=0"])?;
        run_here("sysctl", &["-qw", "net.ipv4.conf.eth0.rp_filter=0"])
    })
}

/// Runs `f` on a thread that joined the network namespace at `pin` (the
/// commands it starts run there too).
fn in_netns<T: Send + 'static>(
    pin: &Path,
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    let pin = pin.to_path_buf();
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&pin).with_context(|| format!("open {}", pin.display()))?;
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
        f()
    })
    .join()
    .map_err(|_| anyhow::anyhow!("netns thread panicked"))?
}

/// Whether a TCP handshake with `addr:port` completes from the network
/// namespace at `pin` within three seconds.
fn reaches(pin: &Path, addr: Ipv4Addr, port: u16) -> anyhow::Result<bool> {
    in_netns(pin, move || {
        Ok(TcpStream::connect_timeout(&(addr, port).into(), Duration::from_secs(3)).is_ok())
    })
}

/// GETs `/index.html` from `addr:port` on the node, retrying while httpd
/// starts.
async fn node_get(addr: Ipv4Addr, port: u16) -> anyhow::Result<String> {
    let mut last = String::new();
    for _ in 0..50 {
        match tokio::net::TcpStream::connect((addr, port)).await {
            Ok(mut s) => {
                s.write_all(b"GET /index.html HTTP/1.0\r\n\r\n").await?;
                let mut body = String::new();
                s.read_to_string(&mut body).await?;
                if body.starts_with("HTTP/1.1 200") {
                    return Ok(body);
                }
                last = body;
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("{addr}:{port} did not answer: {last}")
}

async fn scenario(d: &Daemon) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    // What the node serves on its loopback, and on the bridge (control).
    let loopback = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let on_bridge = TcpListener::bind((d.gateway, 0))?;
    let host_port: u16 = 18090;
    let mapping = PortMapping {
        protocol: Protocol::Tcp as i32,
        container_port: 8080,
        host_port: i32::from(host_port),
        host_ip: "127.0.0.1".into(),
    };
    let (_, _, _server_ip) = pod(
        d,
        "lo-server",
        vec![mapping],
        &["httpd", "-f", "-p", "8080", "-h", "/www"],
    )
    .await?;
    let (attacker, attacker_ctr, _) = pod(d, "lo-attacker", Vec::new(), &["sleep", "3600"]).await?;
    let pin = d.state_dir.join("netns").join(&attacker);
    ensure!(pin.exists(), "no netns pin {}", pin.display());

    // The 127.0.0.1 host port works for the node itself.
    let body = node_get(Ipv4Addr::LOCALHOST, host_port).await?;
    ensure!(
        body.ends_with("cubelet test\n"),
        "127.0.0.1:{host_port} from the node: {body:?}"
    );

    arm(&pin, d.gateway)?;
    // Control: from the armed pod, the node's bridge address answers.
    let control = on_bridge.local_addr()?.port();
    ensure!(
        reaches(&pin, d.gateway, control)?,
        "the probe is broken: {}:{control} does not answer the pod",
        d.gateway
    );
    // The node's 127.0.0.1 service: no answer.
    let port = loopback.local_addr()?.port();
    ensure!(
        !reaches(&pin, Ipv4Addr::LOCALHOST, port)?,
        "a pod reached the node's 127.0.0.1:{port}"
    );
    // The 127.0.0.1 host port, from another netns on the bridge: no answer.
    ensure!(
        !reaches(&pin, Ipv4Addr::LOCALHOST, host_port)?,
        "a pod reached the 127.0.0.1:{host_port} host port"
    );
    // Nor through the bridge address, without crafting anything.
    let mut rt = d.runtime.clone();
    let r = rt
        .exec_sync(ExecSyncRequest {
            container_id: attacker_ctr,
            cmd: vec![
                "sh".into(),
                "-c".into(),
                format!(
                    "printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {} {host_port}",
                    d.gateway
                ),
            ],
            timeout: 15,
        })
        .await?
        .into_inner();
    ensure!(
        !String::from_utf8_lossy(&r.stdout).contains("cubelet test"),
        "the 127.0.0.1 host port answered on {}",
        d.gateway
    );

    // Still served to the node after the attack.
    node_get(Ipv4Addr::LOCALHOST, host_port).await?;
    drop((loopback, on_bridge));
    d.remove_all().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_cannot_reach_the_node_loopback_nor_its_127_host_ports() {
    with_daemon(
        DaemonOpts {
            index: 41,
            ..Default::default()
        },
        Duration::from_secs(180),
        |d| Box::pin(scenario(d)),
    )
    .await;
}
