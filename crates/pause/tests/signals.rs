//! Runs the built `cubelet-pause` binary and checks how it ends.

use std::process::{Child, Command};
use std::time::Duration;

/// Spawns the binary and waits until it has blocked SIGTERM (read from
/// `/proc/<pid>/status`), so a signal sent afterwards is taken by `sigwait`
/// rather than by the default action.
fn spawn_ready() -> Child {
    let child = Command::new(env!("CARGO_BIN_EXE_cubelet-pause"))
        .spawn()
        .unwrap();
    let status_path = format!("/proc/{}/status", child.id());
    let sigterm_bit = 1u64 << (libc_sigterm() - 1);
    for _ in 0..1000 {
        let status = std::fs::read_to_string(&status_path).unwrap();
        let blocked = status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
            .unwrap();
        if blocked & sigterm_bit != 0 {
            return child;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
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
