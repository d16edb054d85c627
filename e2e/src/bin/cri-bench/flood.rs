//! The log flood phase (`--log-floods N`): on every endpoint in turn, a pod
//! whose container prints the shortest lines it can (`busybox yes`) for
//! `--log-flood-secs`, and what that cost the process serving the CRI
//! socket (the agent; for containerd's CRI, containerd, which copies the
//! logs there). The shim copies the container's output into the FIFOs on
//! both, so it is not counted. Per endpoint, p50 over the rounds of the
//! lines a second that reached the log and of the serving process's CPU
//! seconds.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use cubelet_e2e::cpu_secs;
use cubelet_e2e::cri::{CreateContainerRequest, StartContainerRequest};

use crate::lifecycle::{container_config, pod_config, pod_name, remove_pod, run_pod, Workload};
use crate::{progress, progress_done, rotation, Endpoint};

/// One flood's figures.
#[derive(Debug, Clone, Copy)]
struct Flood {
    lines_per_sec: f64,
    cpu_secs: f64,
}

/// The pid of the process listening on the unix socket `socket`: its inode
/// from /proc/net/unix, then the process holding a descriptor to it.
fn serving_pid(socket: &Path) -> anyhow::Result<u32> {
    let table = std::fs::read_to_string("/proc/net/unix")?;
    let want = socket.to_string_lossy();
    // Num RefCount Protocol Flags Type St Inode Path; St 01 is listening.
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 8 && f[7] == want && f[5] == "01").then(|| format!("socket:[{}]", f[6]))
        })
        .collect();
    if inodes.is_empty() {
        bail!("no process listens on {want}");
    }
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                if inodes.iter().any(|i| target.as_os_str() == i.as_str()) {
                    return Ok(pid);
                }
            }
        }
    }
    bail!("no process holds the socket {want}")
}

/// Bytes of `path` (0 before it exists).
fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// The mean length of the log's last whole entries (all `y` lines).
fn entry_len(path: &Path) -> anyhow::Result<u64> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(64 << 10)))?;
    let mut tail = String::new();
    f.read_to_string(&mut tail)?;
    let lines: Vec<&str> = tail.lines().skip(1).collect();
    let lines = &lines[..lines.len().saturating_sub(1)];
    anyhow::ensure!(!lines.is_empty(), "{}: no whole entry", path.display());
    Ok(lines.iter().map(|l| l.len() as u64 + 1).sum::<u64>() / lines.len() as u64)
}

/// One flood of `secs` on `e`; the pod is removed whatever happens.
async fn flood(e: &Endpoint, w: &Workload, name: &str, secs: f64) -> anyhow::Result<Flood> {
    let pid = match &e.daemon {
        Some(d) => d.pid().context("the started Cubelet's pid")?,
        None => serving_pid(&e.socket)?,
    };
    let pod_cfg = pod_config(name, &format!("uid-{name}"), &w.log_root);
    let mut cfg = container_config(&pod_cfg, &w.image);
    cfg.command = vec!["busybox".into(), "yes".into()];
    if let Some(m) = cfg.metadata.as_mut() {
        m.name = "flood".into();
    }
    cfg.log_path = "flood/0.log".into();
    let log: PathBuf = Path::new(&pod_cfg.log_directory).join("flood/0.log");
    std::fs::create_dir_all(Path::new(&pod_cfg.log_directory).join("flood"))?;
    let mut rt = e.rt.clone();
    let (pod, _) = run_pod(&mut rt, w, &pod_cfg).await?;
    let measured = async {
        let cid = rt
            .create_container(CreateContainerRequest {
                pod_sandbox_id: pod.clone(),
                config: Some(cfg),
                sandbox_config: Some(pod_cfg.clone()),
            })
            .await
            .context("CreateContainer")?
            .into_inner()
            .container_id;
        rt.start_container(StartContainerRequest { container_id: cid })
            .await
            .context("StartContainer")?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (cpu0, size0, t0) = (cpu_secs(pid)?, size(&log), std::time::Instant::now());
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
        let (cpu1, size1, wall) = (cpu_secs(pid)?, size(&log), t0.elapsed().as_secs_f64());
        let lines = (size1 - size0) as f64 / entry_len(&log)? as f64;
        anyhow::Ok(Flood {
            lines_per_sec: lines / wall,
            cpu_secs: (cpu1 - cpu0) * secs / wall,
        })
    }
    .await;
    let removed = remove_pod(&mut rt, &pod).await;
    let _ = std::fs::remove_dir_all(&pod_cfg.log_directory);
    let f = measured.with_context(|| format!("{}: log flood", e.label))?;
    removed.with_context(|| format!("{}: removing the flood's pod", e.label))?;
    Ok(f)
}

/// Runs the phase and prints its table.
pub(crate) async fn flood_phase(
    eps: &[Endpoint],
    w: &Workload,
    rounds: usize,
    secs: f64,
    baseline: usize,
) -> anyhow::Result<()> {
    let mut out: Vec<Vec<Flood>> = eps.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for i in rotation(eps.len(), round) {
            let name = pod_name("flood", i, round);
            out[i].push(flood(&eps[i], w, &name, secs).await?);
        }
        progress(&format!("log flood round {}/{rounds}", round + 1));
    }
    progress_done();
    let p50 = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let rows: Vec<(f64, f64)> = out
        .iter()
        .map(|fs| {
            let mut lines: Vec<f64> = fs.iter().map(|f| f.lines_per_sec).collect();
            let mut cpu: Vec<f64> = fs.iter().map(|f| f.cpu_secs).collect();
            (p50(&mut lines), p50(&mut cpu))
        })
        .collect();
    println!(
        "\ncri-bench log flood: `busybox yes` for {secs:.0} s per round, {rounds} rounds per endpoint, alternating; \
         CPU of the process serving the CRI socket; baseline {}\n",
        eps[baseline].label
    );
    println!("| log flood (p50) | lines/s into the log | × baseline | CPU s of the serving process | × baseline | CPU s per million lines |");
    println!("|---|---|---|---|---|---|");
    let (bl, bc) = rows[baseline];
    for (e, (l, c)) in eps.iter().zip(&rows) {
        println!(
            "| {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.3} |",
            e.label,
            l,
            l / bl.max(1e-9),
            c,
            c / bc.max(1e-9),
            c / (l * secs / 1e6).max(1e-9)
        );
    }
    Ok(())
}
