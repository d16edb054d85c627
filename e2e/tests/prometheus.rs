//! Prometheus for real: Debian's `prometheus` scrapes the real daemon every
//! second while pods run through CRI, and its HTTP query API must show the
//! flow metrics with their labels; `promtool check metrics` must find no
//! problem in a real scrape of `/metrics`.
//!
//! Prometheus listens on 127.0.0.1 only, keeps its data in a temp dir, and is
//! stopped (and the dir removed) at the end, as is the daemon with everything
//! it created. Without the private containerd the test prints SKIP and passes.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use cubelet_e2e::cri::{RemovePodSandboxRequest, RunPodSandboxRequest, StopPodSandboxRequest};
use cubelet_e2e::{pod_config, with_daemon, Daemon, DaemonOpts};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PROMETHEUS: &str = "/usr/bin/prometheus";
const PROMTOOL: &str = "/usr/bin/promtool";

fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// `GET path` over HTTP/1.0; status and body.
async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").context("no header end")?;
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .context("no status line")?;
        anyhow::Ok((code, body.to_owned()))
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .context("http timeout")?
}

/// Percent-encodes a PromQL expression for a query string.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The result vector of an instant query (`data.result`).
async fn query(prom: SocketAddr, q: &str) -> anyhow::Result<Vec<Value>> {
    let (code, body) = http_get(prom, &format!("/api/v1/query?query={}", encode(q))).await?;
    ensure!(code == 200, "query {q}: HTTP {code}: {body}");
    let v: Value = serde_json::from_str(&body).with_context(|| format!("query {q}: {body}"))?;
    ensure!(v["status"] == "success", "query {q}: {body}");
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

/// A running Prometheus; killed if dropped without [`Prometheus::stop`].
struct Prometheus {
    child: tokio::process::Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start(target: SocketAddr) -> anyhow::Result<Prometheus> {
        let dir = tempfile::Builder::new()
            .prefix("cubelet-test-prometheus")
            .tempdir()?;
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: cubelet\n    static_configs:\n\
                 \x20     - targets: ['{target}']\n"
            ),
        )?;
        let addr: SocketAddr = (Ipv4Addr::LOCALHOST, free_port()?).into();
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = tokio::process::Command::new(PROMETHEUS)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("spawn prometheus")?;
        let mut p = Prometheus { child, addr, dir };
        for _ in 0..150 {
            if let Some(status) = p.child.try_wait()? {
                bail!("prometheus exited at start ({status}):\n{}", p.log());
            }
            if matches!(http_get(addr, "/-/ready").await, Ok((200, _))) {
                return Ok(p);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!("prometheus not ready on {addr}:\n{}", p.log())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// SIGTERM, wait, then the temp dir goes.
    async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(pid)?),
                nix::sys::signal::Signal::SIGTERM,
            )?;
        }
        match tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await {
            Ok(status) => {
                status?;
            }
            Err(_) => self.child.kill().await?,
        }
        let path = self.dir.path().to_path_buf();
        self.dir.close()?;
        ensure!(!path.exists(), "{} left behind", path.display());
        Ok(())
    }
}

async fn run_pods(d: &Daemon, n: usize) -> anyhow::Result<()> {
    let mut rt = d.runtime.clone();
    for i in 0..n {
        let name = format!("prom-{i}");
        let log_dir = d.log_base.join(&name);
        let id = rt
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(pod_config(&name, &format!("uid-{name}"), &log_dir)),
                runtime_handler: String::new(),
            })
            .await
            .context("RunPodSandbox")?
            .into_inner()
            .pod_sandbox_id;
        rt.stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: id.clone(),
        })
        .await
        .context("StopPodSandbox")?;
        rt.remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id: id })
            .await
            .context("RemovePodSandbox")?;
    }
    Ok(())
}

/// Label values of `label` across a result vector.
fn label_values(results: &[Value], label: &str) -> Vec<String> {
    let mut v: Vec<String> = results
        .iter()
        .filter_map(|r| r["metric"][label].as_str().map(str::to_owned))
        .collect();
    v.sort();
    v.dedup();
    v
}

async fn scenario(d: &Daemon, prom: &Prometheus) -> anyhow::Result<()> {
    run_pods(d, 3).await?;

    // Scrapes run every second; wait (bounded) for the flow histograms.
    let mut present = Vec::new();
    for _ in 0..60 {
        present = query(prom.addr, "cubelet_flow_duration_seconds_count").await?;
        let has_create = present
            .iter()
            .any(|r| r["metric"]["flow"] == "create" && r["metric"]["result"] == "ok");
        if has_create {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    ensure!(
        !present.is_empty(),
        "cubelet_flow_duration_seconds_count never appeared in prometheus; its log:\n{}",
        prom.log()
    );

    let create = query(
        prom.addr,
        r#"cubelet_flow_duration_seconds_count{flow="create",result="ok"}"#,
    )
    .await?;
    ensure!(create.len() == 1, "create/ok series: {create:?}");
    let count: f64 = create[0]["value"][1]
        .as_str()
        .context("sample value")?
        .parse()?;
    ensure!(count >= 3.0, "create/ok count {count}, ran 3 pods");
    ensure!(
        create[0]["metric"]["job"] == "cubelet",
        "scraped by the cubelet job: {create:?}"
    );

    let rejections = query(prom.addr, "cubelet_flow_rejections_total").await?;
    ensure!(
        label_values(&rejections, "flow") == ["cleanup", "create", "destroy", "prewarm"],
        "rejection counters per flow: {rejections:?}"
    );

    let buckets = query(prom.addr, "cubelet_flow_step_duration_seconds_bucket").await?;
    ensure!(!buckets.is_empty(), "no step duration buckets");
    for label in ["flow", "step", "result", "le"] {
        ensure!(
            buckets.iter().all(|r| r["metric"][label].is_string()),
            "a step bucket lacks label {label}: {buckets:?}"
        );
    }
    let steps = label_values(&buckets, "step");
    for step in ["network", "sandbox", "storage"] {
        ensure!(steps.iter().any(|s| s == step), "steps {steps:?}");
    }
    ensure!(
        label_values(&buckets, "flow").contains(&"create".to_owned()),
        "flows of step buckets: {buckets:?}"
    );

    // promtool on a real scrape.
    let (code, metrics) = http_get(d.metrics, "/metrics").await?;
    ensure!(code == 200, "/metrics: HTTP {code}");
    let mut check = tokio::process::Command::new(PROMTOOL)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("spawn promtool")?;
    let mut stdin = check.stdin.take().context("promtool stdin")?;
    stdin.write_all(metrics.as_bytes()).await?;
    drop(stdin);
    let out = check.wait_with_output().await?;
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "promtool check metrics ({} bytes scraped): exit {}, output {:?}",
        metrics.len(),
        out.status,
        report.trim()
    );
    ensure!(
        out.status.success() && report.trim().is_empty(),
        "promtool check metrics found problems ({}):\n{report}",
        out.status
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_flow_metrics() {
    for tool in [PROMETHEUS, PROMTOOL] {
        if !Path::new(tool).is_file() {
            println!("SKIP: {tool} missing");
            return;
        }
    }
    let opts = DaemonOpts {
        index: 5,
        ..Default::default()
    };
    with_daemon(opts, Duration::from_secs(300), |d| {
        Box::pin(async move {
            let prom = Prometheus::start(d.metrics).await?;
            let r = scenario(d, &prom).await;
            let stopped = prom.stop().await;
            r.and(stopped)
        })
    })
    .await;
}
