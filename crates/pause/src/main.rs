//! `cubelet-pause`: the pod infra process.
//!
//! It owns nothing but itself: it holds the pod's namespaces open by being
//! alive, reaps zombies (as PID 1 of a pod PID namespace every orphan is
//! re-parented to it), and exits 0 on SIGTERM or SIGINT. It knows nothing of
//! Cubelet, containerd or CRI. Signals are blocked and taken synchronously
//! with `sigwait`, so no signal handler (and no `unsafe`) is needed.

use std::process::ExitCode;

use nix::errno::Errno;
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// Reaps every exited child without blocking.
fn reap_children() {
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(e) => {
                eprintln!("cubelet-pause: waitpid: {e}");
                return;
            }
        }
    }
}

fn main() -> ExitCode {
    let mut set = SigSet::empty();
    for sig in [Signal::SIGCHLD, Signal::SIGTERM, Signal::SIGINT] {
        set.add(sig);
    }
    if let Err(e) = nix::sys::signal::sigprocmask(SigmaskHow::SIG_BLOCK, Some(&set), None) {
        eprintln!("cubelet-pause: sigprocmask: {e}");
        return ExitCode::FAILURE;
    }
    // Children may have exited before the mask was set.
    reap_children();
    loop {
        match set.wait() {
            Ok(Signal::SIGCHLD) => reap_children(),
            Ok(Signal::SIGTERM | Signal::SIGINT) => return ExitCode::SUCCESS,
            Ok(_) => {}
            Err(e) => {
                eprintln!("cubelet-pause: sigwait: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
}
