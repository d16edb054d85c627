//! `with-cubelet`: runs a command next to a Cubelet of its own (its own
//! socket, state dirs, containerd namespace and bridge, as every e2e
//! daemon), then removes the pods left, checks that nothing leaked (no netns
//! pin, mount, veth or shim: the e2e leak audit) and tears the daemon down.
//!
//! The command learns where the daemon is from its environment:
//! `CUBELET_SOCKET` (the CRI socket), `CUBELET_CONTAINERD` (the containerd
//! socket the daemon uses), `CUBELET_CONTAINERD_NAMESPACE`,
//! `CUBELET_LOG` (the daemon's log) and `CUBELET_BRIDGE`.
//! `hack/node-e2e.sh` runs kubelet and the node e2e suite this way.
//!
//! Exits with the command's code, or 1 when something leaked or the
//! teardown failed. SIGINT or SIGTERM is passed on to the command, and the
//! daemon is torn down once the command is gone.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use cubelet_e2e::{leaks, Daemon};
use tokio::signal::unix::{signal, SignalKind};

/// Run a command next to a private Cubelet.
#[derive(Debug, Parser)]
#[command(name = "with-cubelet")]
struct Args {
    /// Daemon index (bridge, subnet and dirs of its own).
    #[arg(long, default_value_t = 8)]
    index: u8,
    /// A config drop-in for the daemon (e.g. `runtime: {sandbox: pause}`).
    #[arg(long)]
    drop_in: Option<PathBuf>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Runs the command to its end; a signal to us goes on to it.
async fn run_command(args: &Args, d: &Daemon) -> anyhow::Result<i32> {
    let (program, rest) = args.command.split_first().context("no command given")?;
    let mut child = tokio::process::Command::new(program)
        .args(rest)
        .env("CUBELET_SOCKET", &d.socket)
        .env("CUBELET_CONTAINERD", &d.containerd)
        .env("CUBELET_CONTAINERD_NAMESPACE", &d.namespace)
        .env("CUBELET_LOG", &d.daemon_log)
        .env("CUBELET_BRIDGE", &d.bridge)
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("spawn {program}"))?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    loop {
        tokio::select! {
            status = child.wait() => {
                let status = status?;
                eprintln!("with-cubelet: {program} exited with {status}");
                return Ok(status.code().unwrap_or(128));
            }
            _ = int.recv() => forward(&child, nix::sys::signal::Signal::SIGINT),
            _ = term.recv() => forward(&child, nix::sys::signal::Signal::SIGTERM),
        }
    }
}

fn forward(child: &tokio::process::Child, sig: nix::sys::signal::Signal) {
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        eprintln!("with-cubelet: passing {sig} on to the command");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
    }
}

async fn main_async(args: Args) -> anyhow::Result<i32> {
    let d = cubelet_e2e::start_for_tool(args.index, args.drop_in.as_deref()).await?;
    eprintln!(
        "with-cubelet: Cubelet on {} (log {}, containerd namespace {})",
        d.socket.display(),
        d.daemon_log.display(),
        d.namespace
    );
    let code = run_command(&args, &d).await;
    // What the command's clients left (kubelet's pods) is theirs, not a
    // leak: removed through CRI first; what is left after that is.
    // Bounded: a runtime call that hangs here fails the run instead of
    // stalling it (a StopContainer that never returned did once).
    let removed = match tokio::time::timeout(Duration::from_secs(180), d.remove_all()).await {
        Ok(r) => r,
        Err(_) => Err(anyhow::anyhow!(
            "removing the pods left did not finish within 180 s"
        )),
    };
    let leaked = match (&removed, leaks(&d).await) {
        (Err(e), _) => vec![format!("removing the pods left failed: {e:#}")],
        (Ok(()), Ok(l)) => l,
        (Ok(()), Err(e)) => vec![format!("leak audit failed: {e:#}")],
    };
    for l in &leaked {
        println!("with-cubelet: leak: {l}");
    }
    println!("with-cubelet: leaks: {}", leaked.len());
    let teardown = d.teardown().await;
    let code = code?;
    teardown?;
    Ok(if leaked.is_empty() { code } else { 1 })
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("with-cubelet: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(main_async(args)) {
        Ok(code) => std::process::ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("with-cubelet: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
