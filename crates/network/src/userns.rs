//! User namespaces of pods that have their own (CRI `NamespaceMode_POD`),
//! created together with the network namespace they own.
//!
//! A pod in a user namespace needs its network namespace to be owned by
//! that user namespace: the kernel lets a process mount `sysfs` only over
//! the network namespace of a user namespace it is privileged in, and runc
//! mounts `/sys` in every container. So both are made at once, by a
//! short-lived helper process: `unshare --user --net` (util-linux) runs a
//! shell that reports it is ready and waits on its stdin. The agent writes
//! the pod's `uid_map`/`gid_map` into the helper's user namespace, pins
//! both namespaces by bind mounts of `/proc/<pid>/ns/{user,net}` (the user
//! namespace under `<state_dir>/userns/<sandbox>`, beside
//! `<state_dir>/netns/<sandbox>`), and closes the helper's stdin so it
//! exits. A process is needed because a multi-threaded one (the agent) may
//! not enter or create a user namespace itself.
//!
//! Runs on the namespace thread of [`crate::netns`]; no `unsafe`.

use std::fs::{self, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use cubelet_engine::spec::UserNamespace;
use nix::mount::{mount, MsFlags};

use crate::error::NetworkError;
use crate::netns;

/// The helper that creates the namespaces (util-linux).
const UNSHARE: &str = "unshare";

/// The user-namespace pin that goes with the network-namespace pin `netns`:
/// `<dir>/netns/<id>` → `<dir>/userns/<id>`.
pub(crate) fn pin_for(netns: &Path) -> PathBuf {
    let dir = netns
        .parent()
        .map(|d| d.with_file_name("userns"))
        .unwrap_or_else(|| PathBuf::from("userns"));
    match netns.file_name() {
        Some(name) => dir.join(name),
        None => dir,
    }
}

/// The directory of user-namespace pins that goes with the netns pin
/// directory `netns_dir`.
pub(crate) fn dir_for(netns_dir: &Path) -> PathBuf {
    netns_dir.with_file_name("userns")
}

/// Creates a user namespace with `mapping` and a network namespace owned by
/// it, pinned at `userns_pin` and `netns_pin`. Existing pins are kept.
/// Blocking: call it on a namespace thread.
pub(crate) fn create_blocking(
    netns_pin: &Path,
    userns_pin: &Path,
    mapping: &UserNamespace,
) -> Result<(), NetworkError> {
    if netns::is_pinned(netns_pin) && netns::is_pinned(userns_pin) {
        return Ok(());
    }
    if let Some(dir) = userns_pin.parent() {
        netns::prepare_dir(dir)?;
    }
    for pin in [netns_pin, userns_pin] {
        if let Some(dir) = pin.parent() {
            fs::create_dir_all(dir).map_err(|e| NetworkError::io("create directory", dir, e))?;
        }
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(pin)
            .map_err(|e| NetworkError::io("create pin", pin, e))?;
    }
    let pinned = pin_with_helper(netns_pin, userns_pin, mapping);
    if pinned.is_err() {
        for pin in [netns_pin, userns_pin] {
            let _ = netns::remove_now(pin);
        }
    }
    pinned
}

/// A helper process that exits when dropped (its stdin closes) and is
/// reaped.
struct Helper {
    child: Child,
}

impl Drop for Helper {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        if let Ok(None) = self.child.try_wait() {
            // It exits at end of input; a helper stuck elsewhere is killed.
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

fn pin_with_helper(
    netns_pin: &Path,
    userns_pin: &Path,
    mapping: &UserNamespace,
) -> Result<(), NetworkError> {
    let child = Command::new(UNSHARE)
        .args(["--user", "--net", "--", "sh", "-c", "echo ready; read -r _"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            let e = if e.kind() == io::ErrorKind::NotFound {
                io::Error::new(e.kind(), "unshare not found in PATH (install util-linux)")
            } else {
                e
            };
            NetworkError::io("start user namespace helper for", netns_pin, e)
        })?;
    let mut helper = Helper { child };
    let pid = helper.child.id();
    let mut ready = String::new();
    let stdout = helper.child.stdout.take();
    if let Some(out) = stdout {
        BufReader::new(out)
            .read_line(&mut ready)
            .map_err(|e| NetworkError::io("wait for user namespace helper of", netns_pin, e))?;
    }
    if ready.trim() != "ready" {
        let mut why = String::new();
        if let Some(mut err) = helper.child.stderr.take() {
            let _ = io::Read::read_to_string(&mut err, &mut why);
        }
        return Err(NetworkError::io(
            "create user namespace for",
            netns_pin,
            io::Error::other(format!(
                "unshare --user --net exited before it was ready: {}",
                why.trim()
            )),
        ));
    }
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    // Each map is written in one write(2), as the kernel requires.
    for (file, m) in [("uid_map", &mapping.uids), ("gid_map", &mapping.gids)] {
        let path = proc_dir.join(file);
        OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| f.write_all(m.map_line().as_bytes()))
            .map_err(|e| NetworkError::io("write", &path, e))?;
    }
    for (ns, pin) in [("user", userns_pin), ("net", netns_pin)] {
        let source = proc_dir.join("ns").join(ns);
        mount(
            Some(&source),
            pin,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|e| NetworkError::nix("bind mount namespace on", pin, e))?;
    }
    drop(helper);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userns_pins_sit_beside_the_netns_pins() {
        assert_eq!(
            pin_for(Path::new("/run/cubelet/netns/abc")),
            Path::new("/run/cubelet/userns/abc")
        );
        assert_eq!(
            dir_for(Path::new("/run/cubelet/netns")),
            Path::new("/run/cubelet/userns")
        );
    }
}
