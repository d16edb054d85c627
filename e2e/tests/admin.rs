//! `cubelet ctl` against the real daemon's admin socket
//! (`<state_dir>/admin.sock`): flows, a run-time limit change that the
//! `cubelet_flow_limit` gauge reflects, sandboxes with their create-flow
//! steps, and a GC pass. Without the private containerd the test prints SKIP
//! and passes.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{ensure, Context};
use cubelet_e2e::cri::{RemovePodSandboxRequest, StopPodSandboxRequest};
use cubelet_e2e::{with_daemon, workspace_root, Daemon, DaemonOpts};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn cubelet_bin() -> PathBuf {
    std::env::var_os("CUBELET_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| workspace_root().join("target"))
                .join("debug")
                .join("cubelet")
        })
}

/// Runs `cubelet ctl --socket <socket> <args>`; its stdout, or an error with
/// its stderr.
async fn ctl(socket: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = tokio::process::Command::new(cubelet_bin())
        .arg("ctl")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .await
        .context("run cubelet ctl")?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "`cubelet ctl {}` failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    println!("$ cubelet ctl {}\n{stdout}", args.join(" "));
    Ok(stdout)
}

/// The body of `GET /metrics`.
async fn scrape(addr: SocketAddr) -> anyhow::Result<String> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (_, body) = text.split_once("\r\n\r\n").context("no header end")?;
        anyhow::Ok(body.to_owned())
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .context("scrape timeout")?
}

/// Whitespace-split cells of the table row whose first cell is `first`.
fn row(table: &str, first: &str) -> anyhow::Result<Vec<String>> {
    table
        .lines()
        .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .find(|cells| cells.first().map(String::as_str) == Some(first))
        .with_context(|| format!("no `{first}` row in:\n{table}"))
}

async fn scenario(d: &Daemon) -> anyhow::Result<()> {
    let socket = d.state_dir.join("admin.sock");
    let mode = std::fs::metadata(&socket)
        .with_context(|| format!("{}", socket.display()))?
        .permissions()
        .mode();
    ensure!(
        mode & 0o777 == 0o600,
        "admin socket mode {:o}",
        mode & 0o777
    );

    let flows = ctl(&socket, &["flows"]).await?;
    ensure!(flows.starts_with("FLOW"), "{flows}");
    for flow in ["create", "destroy", "cleanup"] {
        row(&flows, flow)?;
    }
    ensure!(
        row(&flows, "create")?[1] == "16",
        "default create limit: {flows}"
    );

    let set = ctl(&socket, &["set-limit", "create", "4"]).await?;
    ensure!(set.contains("create limit set to 4"), "{set}");
    let flows = ctl(&socket, &["flows"]).await?;
    ensure!(row(&flows, "create")?[1] == "4", "after set-limit: {flows}");
    let metrics = scrape(d.metrics).await?;
    let gauge = metrics
        .lines()
        .find(|l| l.starts_with(r#"cubelet_flow_limit{flow="create"}"#))
        .context("no cubelet_flow_limit{flow=\"create\"} in /metrics")?;
    ensure!(gauge.split_whitespace().nth(1) == Some("4"), "{gauge}");

    // A pod, then its history.
    let mut rt = d.runtime.clone();
    let id = d.run_pod(&d.pod_config("ctl-pod"), "").await?;
    let listing = ctl(&socket, &["sandboxes"]).await?;
    let summary = row(&listing, &id[..13])?;
    ensure!(summary[1] == "ready", "{listing}");
    ensure!(summary[2] == "e2e/ctl-pod", "{listing}");
    ensure!(listing.contains(&id), "full id in the detail: {listing}");
    let create = listing
        .lines()
        .find(|l| l.trim_start().starts_with('#') && l.contains("create"))
        .with_context(|| format!("no create flow in:\n{listing}"))?;
    ensure!(create.contains("succeeded"), "{create}");
    for step in ["storage", "network", "sandbox"] {
        ensure!(
            listing
                .lines()
                .any(|l| l.split_whitespace().nth(1) == Some(step)
                    && l.split_whitespace().nth(2) == Some("ok")),
            "no finished {step} step in:\n{listing}"
        );
    }

    rt.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: id.clone(),
    })
    .await
    .context("StopPodSandbox")?;
    rt.remove_pod_sandbox(RemovePodSandboxRequest {
        pod_sandbox_id: id.clone(),
    })
    .await
    .context("RemovePodSandbox")?;
    let listing = ctl(&socket, &["sandboxes"]).await?;
    ensure!(
        !listing.contains(&id),
        "removed pod still listed: {listing}"
    );

    // The removed pod's journal is an orphan the pass may reclaim; either
    // way the pass reports and succeeds.
    let gc = ctl(&socket, &["gc"]).await?;
    ensure!(gc.starts_with("gc pass done"), "{gc}");
    ensure!(
        !gc.contains("FAILURES") || gc.lines().skip(2).all(|l| l.ends_with(" 0")),
        "{gc}"
    );

    // Wrong input is refused with a readable error and exit code 1.
    let out = tokio::process::Command::new(cubelet_bin())
        .args(["ctl", "--socket"])
        .arg(&socket)
        .args(["set-limit", "bogus", "3"])
        .output()
        .await?;
    ensure!(out.status.code() == Some(1), "bad flow: {}", out.status);
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(err.contains("unknown flow"), "{err}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_talks_to_the_admin_socket() {
    let opts = DaemonOpts {
        index: 6,
        ..Default::default()
    };
    with_daemon(opts, Duration::from_secs(240), |d| {
        Box::pin(async move {
            scenario(d).await?;
            // A clean stop removes the admin socket.
            let socket = d.state_dir.join("admin.sock");
            d.stop().await?;
            ensure!(!socket.exists(), "admin socket left behind");
            d.start_with_env(&[]).await
        })
    })
    .await;
}
