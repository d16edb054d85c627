//! Pod networking over CRI with each network provider: a hostPort mapping
//! answers on the node's bridge address (from the host itself and from
//! another pod), pods reach each other by IP, and a pod reaches the gateway.
//! The bridge provider runs as configured by default; the CNI provider runs
//! Debian's plugins (bridge, host-local, portmap) from a conflist in a
//! tempdir. 127.0.0.1 host ports are not supported (no `route_localnet`).
//!
//! Without the private containerd (or the CNI plugins) a test prints SKIP.

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context};
use cubelet_e2e::cri::{ExecSyncRequest, PodSandboxConfig, PortMapping, Protocol};
use cubelet_e2e::{container_config, leaks, run, Daemon, DaemonOpts};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";

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

/// GETs `/index.html` from `addr:port` on the host, retrying while httpd starts.
async fn host_get(addr: Ipv4Addr, port: u16) -> anyhow::Result<String> {
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
    anyhow::bail!("{addr}:{port} did not answer: {last}")
}

async fn exec(d: &Daemon, ctr: &str, script: &str) -> anyhow::Result<(i32, String)> {
    let mut rt = d.runtime.clone();
    let r = rt
        .exec_sync(ExecSyncRequest {
            container_id: ctr.to_owned(),
            cmd: vec!["sh".into(), "-c".into(), script.into()],
            timeout: 15,
        })
        .await?
        .into_inner();
    Ok((r.exit_code, String::from_utf8_lossy(&r.stdout).into_owned()))
}

/// The scenarios both providers must pass; `gateway` is the node's address
/// on the pod network.
async fn scenarios(d: &Daemon, gateway: Ipv4Addr, host_port: u16) -> anyhow::Result<()> {
    d.pull(BUSYBOX).await?;
    let mapping = PortMapping {
        protocol: Protocol::Tcp as i32,
        container_port: 8080,
        host_port: i32::from(host_port),
        host_ip: String::new(),
    };
    let (_, _, server_ip) = pod(
        d,
        "hp-server",
        vec![mapping],
        &["httpd", "-f", "-p", "8080", "-h", "/www"],
    )
    .await?;
    let (_, client, client_ip) = pod(d, "hp-client", Vec::new(), &["sleep", "3600"]).await?;
    ensure!(server_ip != client_ip, "two pods share {server_ip}");

    // Host port on the node's own (bridge) address, from the node itself.
    let body = host_get(gateway, host_port).await?;
    ensure!(
        body.ends_with("cubelet test\n"),
        "host port from the node: {body:?}"
    );

    // The same host port from another pod, and pod to pod by IP.
    for target in [
        format!("{gateway} {host_port}"),
        format!("{server_ip} 8080"),
    ] {
        let get = format!("printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {target}");
        let (code, out) = exec(d, &client, &get).await?;
        ensure!(
            code == 0 && out.ends_with("cubelet test\n"),
            "{target} from a pod: {code} {out:?}"
        );
    }
    // Pod to the gateway.
    let (code, _) = exec(d, &client, &format!("ping -c1 -W2 {gateway}")).await?;
    ensure!(code == 0, "ping {gateway} from {client_ip}");
    Ok(())
}

async fn finish(
    d: Daemon,
    result: anyhow::Result<()>,
    extra_cleanup: impl std::future::Future<Output = ()>,
) {
    let log = d.log_tail(60);
    let result = match result {
        Ok(()) => match d.remove_all().await {
            Ok(()) => match leaks(&d).await {
                Ok(l) if l.is_empty() => Ok(()),
                Ok(l) => Err(anyhow::anyhow!("leaked:\n  {}", l.join("\n  "))),
                Err(e) => Err(e.context("leak audit")),
            },
            Err(e) => Err(e.context("remove pods")),
        },
        Err(e) => Err(e),
    };
    let torn = d.teardown().await;
    extra_cleanup.await;
    if let Err(e) = result {
        panic!("{e:#}\ndaemon log tail:\n{log}");
    }
    torn.expect("teardown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridge_provider_host_ports_and_pod_network() {
    if let Some(reason) = cubelet_e2e::skip_reason() {
        println!("SKIP: {reason}");
        return;
    }
    let d = Daemon::start(DaemonOpts {
        index: 12,
        ..Default::default()
    })
    .await
    .expect("start daemon");
    let gateway = d.gateway;
    let result = tokio::time::timeout(Duration::from_secs(180), scenarios(&d, gateway, 18080))
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("timed out")));
    finish(d, result, async {}).await;
}

/// Splits an `iptables-save` rule into words, keeping "quoted text" whole.
fn split_quoted(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !cur.is_empty() {
                    words.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    words
}

/// Removes what Debian's portmap plugin leaves in the host's nat table
/// (its top-level chains and the jumps to them).
async fn remove_portmap_chains() {
    let Ok(rules) = run("iptables-save", &["-t", "nat"]).await else {
        return;
    };
    for line in rules
        .lines()
        .filter(|l| l.starts_with("-A ") && l.contains("CNI-"))
    {
        let words = split_quoted(&line[3..]);
        let mut args = vec!["-t", "nat", "-D"];
        args.extend(words.iter().map(String::as_str));
        let _ = run("iptables", &args).await;
    }
    for chain in rules
        .lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
    {
        if chain.starts_with("CNI-") {
            let _ = run("iptables", &["-t", "nat", "-F", chain]).await;
            let _ = run("iptables", &["-t", "nat", "-X", chain]).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cni_provider_host_ports_and_pod_network() {
    if let Some(reason) = cubelet_e2e::skip_reason() {
        println!("SKIP: {reason}");
        return;
    }
    if !Path::new("/usr/lib/cni/bridge").exists() {
        println!("SKIP: containernetworking-plugins not installed");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let conf_dir = dir.path().join("net.d");
    std::fs::create_dir_all(&conf_dir).expect("conf dir");
    let bridge = format!("cbcni{}", std::process::id() % 1000);
    let gateway = Ipv4Addr::new(10, 205, 7, 1);
    let conflist = format!(
        r#"{{"cniVersion":"1.0.0","name":"e2e-cni","plugins":[
  {{"type":"bridge","bridge":"{bridge}","isGateway":true,"ipMasq":false,
    "ipam":{{"type":"host-local","ranges":[[{{"subnet":"10.205.7.0/24","gateway":"{gateway}"}}]],
             "routes":[{{"dst":"0.0.0.0/0"}}],"dataDir":"{data}"}}}},
  {{"type":"portmap","capabilities":{{"portMappings":true}},"snat":true}}
]}}"#,
        data = dir.path().join("ipam").display()
    );
    std::fs::write(conf_dir.join("10-e2e.conflist"), conflist).expect("conflist");
    let extra = format!(
        "network: {{ provider: cni, cni: {{ bin_dir: /usr/lib/cni, conf_dir: {} }} }}\n",
        conf_dir.display()
    );
    let d = Daemon::start(DaemonOpts {
        index: 13,
        extra_config: Some(extra),
        ..Default::default()
    })
    .await
    .expect("start daemon");
    let result = tokio::time::timeout(Duration::from_secs(180), scenarios(&d, gateway, 18081))
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("timed out")));
    let leases = std::fs::read_dir(dir.path().join("ipam").join("e2e-cni"))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("10."))
                .count()
        })
        .unwrap_or(0);
    finish(d, result, async {
        let _ = run("ip", &["link", "del", &bridge]).await;
        remove_portmap_chains().await;
    })
    .await;
    // Checked after teardown removed every pod: no host-local lease remains.
    let after = std::fs::read_dir(dir.path().join("ipam").join("e2e-cni"))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("10."))
                .count()
        })
        .unwrap_or(0);
    println!("host-local leases during the test: {leases}, after teardown: {after}");
    assert_eq!(after, 0, "host-local leases left");
}
