//! `critest-run`: runs the cri-tools conformance suite (critest) against a
//! Cubelet of its own (its own socket, state dirs, containerd namespace and
//! bridge, as every e2e daemon), then checks that nothing is left: no pod,
//! container, netns pin, mount, veth or shim (the e2e leak audit), and tears
//! the daemon down.
//!
//! `hack/critest.sh` builds the stand-in test images and calls this. The
//! daemon's `hosts.toml` mirrors `registry.k8s.io`, `k8s.gcr.io` and `gcr.io`
//! to the local registry, so critest pulls its images by their upstream
//! names. Prints critest's own summary and a closing line
//! `critest: N passed, N failed, N skipped`, then `leaks: N`; exits 0 only
//! when nothing failed and nothing leaked.

use std::path::PathBuf;
use std::process::Stdio;

use anyhow::{bail, Context};
use clap::Parser;
use cubelet_e2e::{leaks, Daemon};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// Run critest against a private Cubelet.
#[derive(Debug, Parser)]
#[command(name = "critest-run")]
struct Args {
    /// The critest binary.
    #[arg(long)]
    critest: PathBuf,
    /// Where critest's full output goes (kept after the run).
    #[arg(long, default_value = "/var/lib/cubelet-test/critest.log")]
    output: PathBuf,
    /// Daemon index (bridge, subnet and dirs of its own).
    #[arg(long, default_value_t = 7)]
    index: u8,
    /// A config drop-in for the daemon (e.g. `runtime: {sandbox: pause}`).
    #[arg(long)]
    drop_in: Option<PathBuf>,
    /// Extra arguments for critest (e.g. `--ginkgo.focus=UserNamespaces`).
    #[arg(last = true)]
    critest_args: Vec<String>,
}

/// Counts of critest's ginkgo summary line
/// (`... -- 92 Passed | 2 Failed | 0 Pending | 28 Skipped`).
#[derive(Debug, Default, PartialEq, Eq)]
struct Summary {
    passed: u32,
    failed: u32,
    skipped: u32,
}

fn parse_summary(line: &str) -> Option<Summary> {
    let (_, counts) = line.split_once(" -- ")?;
    let mut s = Summary::default();
    let mut seen = false;
    for part in counts.split('|') {
        let mut words = part.split_whitespace();
        let (Some(n), Some(what)) = (words.next(), words.next()) else {
            continue;
        };
        let Ok(n) = n.parse::<u32>() else { continue };
        match what {
            "Passed" => s.passed = n,
            "Failed" => s.failed = n,
            "Skipped" => s.skipped = n,
            _ => continue,
        }
        seen = true;
    }
    seen.then_some(s)
}

async fn run_critest(args: &Args, d: &Daemon) -> anyhow::Result<Option<Summary>> {
    let endpoint = format!("unix://{}", d.socket.display());
    let mut child = tokio::process::Command::new(&args.critest)
        .arg(format!("--runtime-endpoint={endpoint}"))
        .arg(format!("--image-endpoint={endpoint}"))
        .arg("--ginkgo.no-color")
        .args(&args.critest_args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("spawn {}", args.critest.display()))?;
    let mut out = tokio::fs::File::create(&args.output)
        .await
        .with_context(|| format!("create {}", args.output.display()))?;
    let stdout = child.stdout.take().context("critest stdout")?;
    let stderr = child.stderr.take().context("critest stderr")?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<String>(256);
    for reader in [
        Box::new(stdout) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
        Box::new(stderr),
    ] {
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(reader).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                if tx.send(l).await.is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);
    let mut summary = None;
    while let Some(line) = rx.recv().await {
        out.write_all(line.as_bytes()).await?;
        out.write_all(b"\n").await?;
        // Spec results and the summary, not the whole log.
        if line.starts_with("Ran ")
            || line.contains(" Passed | ")
            || line.starts_with("[FAIL]")
            || line.contains("[FAILED]")
        {
            println!("{line}");
        }
        if let Some(s) = parse_summary(&line) {
            summary = Some(s);
        }
    }
    let status = child.wait().await?;
    eprintln!("critest-run: critest exited with {status}");
    Ok(summary)
}

async fn main_async(args: Args) -> anyhow::Result<bool> {
    let d = cubelet_e2e::start_for_tool(args.index, args.drop_in.as_deref()).await?;
    eprintln!(
        "critest-run: Cubelet on {} (log {}), critest output in {}",
        d.socket.display(),
        d.daemon_log.display(),
        args.output.display()
    );
    let result = run_critest(&args, &d).await;
    // critest removes what it made; what is left is a leak.
    let leaked = match leaks(&d).await {
        Ok(l) => l,
        Err(e) => vec![format!("leak audit failed: {e:#}")],
    };
    for l in &leaked {
        println!("leak: {l}");
    }
    println!("leaks: {}", leaked.len());
    let teardown = d.teardown().await;
    let summary = result?;
    teardown?;
    let Some(s) = summary else {
        bail!("no ginkgo summary in critest's output");
    };
    println!(
        "critest: {} passed, {} failed, {} skipped",
        s.passed, s.failed, s.skipped
    );
    Ok(s.failed == 0 && leaked.is_empty())
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("critest-run: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(main_async(args)) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("critest-run: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ginkgo_summary_is_parsed() {
        assert_eq!(
            parse_summary("FAIL! -- 92 Passed | 2 Failed | 0 Pending | 28 Skipped"),
            Some(Summary {
                passed: 92,
                failed: 2,
                skipped: 28
            })
        );
        assert_eq!(
            parse_summary("SUCCESS! -- 103 Passed | 0 Failed | 0 Pending | 19 Skipped"),
            Some(Summary {
                passed: 103,
                failed: 0,
                skipped: 19
            })
        );
        assert_eq!(parse_summary("Ran 94 of 122 Specs in 600 seconds"), None);
    }
}
