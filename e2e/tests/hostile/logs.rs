//! A container that floods its log with the shortest lines it can write
//! (`yes`: `y\n`, as fast as the agent takes them). The agent copies every
//! line into the CRI log file, held to `runtime.log_rate_limit` (32 MiB of
//! entries a second by default): the log grows no faster than that; while
//! the flood runs the agent stays ready, starts another pod and serves an
//! exec in it, its RSS stays bounded; the flood's pod stops when asked; the
//! log holds well-formed entries. What the flood cost the agent (CPU
//! seconds, lines a second) is printed, not asserted.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use cubelet_e2e::cri::{ExecSyncRequest, StopPodSandboxRequest};
use cubelet_e2e::{container_config, eventually, http_status, with_daemon, Daemon, DaemonOpts};

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";
/// How long the flood runs before it is measured and stopped.
const FLOOD: Duration = Duration::from_secs(8);
/// How much the daemon's RSS may grow under the flood: generous (the
/// allocator keeps freed pages), far below the gigabytes the flood writes.
const RSS_SLACK_KIB: u64 = 64 * 1024;
/// The default `runtime.log_rate_limit`, bytes a second.
const LOG_RATE: u64 = 32 << 20;
/// What a log may write beyond its rate: a second's worth, and one write.
const LOG_BURST: u64 = LOG_RATE + (256 << 10);

/// (VmRSS KiB, user + system CPU seconds) of the daemon.
fn usage(d: &Daemon) -> anyhow::Result<(u64, f64)> {
    let pid = d.pid().context("daemon pid")?;
    Ok((cubelet_e2e::rss_kib(pid)?, cubelet_e2e::cpu_secs(pid)?))
}

/// Entries in `text` (whole lines only), checked to be `want` lines on stdout.
fn count_entries(text: &str, want: &str) -> anyhow::Result<u64> {
    let mut n = 0;
    for line in text.lines() {
        let mut parts = line.splitn(4, ' ');
        let (ts, stream, tag, body) = (parts.next(), parts.next(), parts.next(), parts.next());
        ensure!(
            ts.is_some_and(|t| t.len() > 20 && t.ends_with('Z'))
                && stream == Some("stdout")
                && tag == Some("F")
                && body == Some(want),
            "malformed log entry {line:?}"
        );
        n += 1;
    }
    Ok(n)
}

/// The floods: (pod name, command, the line it prints). `yes` writes its
/// lines a few KiB at a time; the shell loop writes each line on its own,
/// so every line is a read and a write of the agent's.
const FLOODS: [(&str, &[&str], &str); 2] = [
    ("hostile-log-yes", &["busybox", "yes"], "y"),
    (
        "hostile-log-echo",
        &[
            "sh",
            "-c",
            "while :; do echo spamspamspamspamspamspam; done",
        ],
        "spamspamspamspamspamspam",
    ),
];

async fn scenario(d: &Daemon) -> anyhow::Result<()> {
    for (name, cmd, line) in FLOODS {
        flood(d, name, cmd, line).await?;
    }
    Ok(())
}

async fn flood(d: &Daemon, name: &str, cmd: &[&str], want: &str) -> anyhow::Result<()> {
    let cfg = container_config("flood", BUSYBOX, cmd);
    let (flood_pod, _) = d.pod_with(name, cfg).await?;
    let log = d.pod_config(name).log_directory.clone() + "/flood.log";
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss0, cpu0) = usage(d)?;
    let size0 = std::fs::metadata(&log)?.len();
    let t0 = Instant::now();

    // Meanwhile: the agent is ready, starts another pod, runs an exec in it.
    let other = container_config("sleeper", BUSYBOX, &["sleep", "3600"]);
    let started = Instant::now();
    let (other_pod, other_cid) = d.pod_with(&format!("{name}-other"), other).await?;
    let pod_start = started.elapsed();
    let exec = d
        .runtime
        .clone()
        .exec_sync(ExecSyncRequest {
            container_id: other_cid,
            cmd: vec!["echo".into(), "served".into()],
            timeout: 30,
        })
        .await
        .context("ExecSync during the flood")?
        .into_inner();
    ensure!(
        exec.stdout == b"served\n",
        "exec during the flood: {:?}",
        exec.stdout
    );
    ensure!(
        http_status(d.metrics, "/readyz").await? == 200,
        "not ready during the flood"
    );
    tokio::time::sleep(FLOOD.saturating_sub(t0.elapsed())).await;

    let (rss1, cpu1) = usage(d)?;
    let size1 = std::fs::metadata(&log)?.len();
    let secs = t0.elapsed().as_secs_f64();
    // Each `y` entry is one line of the same length: count from the bytes.
    let tail = {
        let text = std::fs::read_to_string(&log)?;
        let last: Vec<&str> = text.lines().rev().skip(1).take(10_000).collect();
        let sample = last.join("\n");
        count_entries(&sample, want)?;
        sample.len() as u64 / last.len().max(1) as u64 + 1
    };
    let lines = (size1 - size0) / tail;
    let cpu = cpu1 - cpu0;
    println!(
        "log flood {name}: {:.0} lines/s into the log over {secs:.1} s, agent CPU {cpu:.2} s \
         ({:.2} s per million lines), RSS {rss0} -> {rss1} KiB; another pod started in {} ms meanwhile",
        lines as f64 / secs,
        cpu / (lines.max(1) as f64 / 1e6),
        pod_start.as_millis()
    );
    ensure!(lines > 0, "the flood wrote nothing to its log");
    let allowed = (LOG_RATE as f64 * secs) as u64 + LOG_BURST;
    ensure!(
        size1 - size0 <= allowed,
        "the log grew {} bytes in {secs:.1} s, past its rate limit ({allowed})",
        size1 - size0
    );
    ensure!(
        rss1 <= rss0 + RSS_SLACK_KIB,
        "RSS grew from {rss0} to {rss1} KiB under the flood"
    );

    for pod in [flood_pod, other_pod] {
        d.runtime
            .clone()
            .stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: pod.clone(),
            })
            .await
            .with_context(|| format!("StopPodSandbox {pod} after the flood"))?;
    }
    // What the pipe held when the process died is copied, then nothing more.
    eventually(
        "the log to stop growing after its pod stopped",
        Duration::from_secs(20),
        || {
            let log = log.clone();
            async move {
                let before = std::fs::metadata(&log)?.len();
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok(std::fs::metadata(&log)?.len() == before)
            }
        },
    )
    .await?;
    d.remove_all().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_container_flooding_its_log_with_short_lines_leaves_the_agent_serving() {
    with_daemon(
        DaemonOpts {
            index: 45,
            ..Default::default()
        },
        Duration::from_secs(180),
        |d| Box::pin(scenario(d)),
    )
    .await;
}
