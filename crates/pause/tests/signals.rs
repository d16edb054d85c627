//! Runs the built `cubelet-pause` binary and checks how it ends.

// Helpers are test code too: a failed unwrap prints the error.
#![allow(clippy::unwrap_used)]

use std::process::{Child, Command};
use std::time::Duration;

/// Spawns the binary and waits until SIGTERM can no longer take its default
/// action: either it is blocked (`SigBlk` in `/proc/<pid>/status`) or the
/// process sits in `sigtimedwait` (which unblocks the waited signals while
/// it sleeps, so `SigBlk` reads 0 then).
fn spawn_ready() -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cubelet-pause"))
        .spawn()
        .unwrap();
    let proc_dir = format!("/proc/{}", child.id());
    let sigterm_bit = 1u64 << (libc_sigterm() - 1);
    for _ in 0..1000 {
        let status = std::fs::read_to_string(format!("{proc_dir}/status")).unwrap();
        let blocked = status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
            .unwrap();
        let wchan = std::fs::read_to_string(format!("{proc_dir}/wchan")).unwrap_or_default();
        if blocked & sigterm_bit != 0 || wchan.contains("sigtimedwait") {
            return child;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    panic!("cubelet-pause never blocked SIGTERM");
}

fn libc_sigterm() -> u32 {
    nix::sys::signal::Signal::SIGTERM as u32
}

fn signal_and_wait(sig: nix::sys::signal::Signal) -> std::process::ExitStatus {
    let mut child = spawn_ready();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, sig).unwrap();
    child.wait().unwrap()
}

#[test]
fn exits_zero_on_sigterm() {
    let status = signal_and_wait(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(status.code(), Some(0), "status {status:?}");
}

#[test]
fn exits_zero_on_sigint() {
    let status = signal_and_wait(nix::sys::signal::Signal::SIGINT);
    assert_eq!(status.code(), Some(0), "status {status:?}");
}

#[test]
fn survives_sigchld() {
    let mut child = spawn_ready();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCHLD).unwrap();
    // Still alive after handling SIGCHLD (it reaps, finds nothing, waits again);
    // SIGTERM then ends it cleanly.
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "status {status:?}");
}

/// Host pids of the children of `pid` (from `/proc/*/status` `PPid`), with their state.
fn children_of(pid: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_owned())
                .unwrap_or_default()
        };
        if field("PPid:") == pid.to_string() {
            out.push((child, field("State:")));
        }
    }
    out
}

#[test]
fn reaps_zombies_as_pid_one() {
    // In a new PID namespace, sh starts two short-lived children and execs
    // cubelet-pause, which becomes PID 1 and the parent of both.
    let pause = env!("CARGO_BIN_EXE_cubelet-pause");
    let mut unshare = Command::new("unshare")
        .args(["--pid", "--fork", "sh", "-c"])
        .arg(format!("true & true & exec {pause}"))
        .spawn()
        .unwrap();
    let mut pause_pid = None;
    let mut zombies = Vec::new();
    for _ in 0..500 {
        if pause_pid.is_none() {
            pause_pid = children_of(unshare.id()).first().map(|c| c.0);
        }
        if let Some(pid) = pause_pid {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "cubelet-pause" {
                zombies = children_of(pid);
                if zombies.is_empty() {
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid = pause_pid.expect("unshare never forked");
    let nix_pid = nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap());
    nix::sys::signal::kill(nix_pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = unshare.wait().unwrap();
    assert!(zombies.is_empty(), "children left unreaped: {zombies:?}");
    assert_eq!(status.code(), Some(0), "status {status:?}");
}
