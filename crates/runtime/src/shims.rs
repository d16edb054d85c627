//! Shim processes containerd forgot.
//!
//! containerd starts one `containerd-shim-runc-v2 -namespace <ns> -id <id>`
//! per task. When the agent is killed in the middle of a create, the restart
//! rolls the create back and containerd holds no task any more, yet the shim
//! can still be running with its bundle deleted: the node keeps a process
//! nobody will ever stop. The reaper finds the shims of the agent's
//! namespace in `/proc` (by their arguments, never by name alone), asks
//! containerd which tasks it has, and stops every shim whose id is not one
//! of them: `SIGTERM` first (the shim shuts itself down), `SIGKILL` if it is
//! still there after [`SHUTDOWN_GRACE`].
//!
//! A shim exists for a moment before containerd records its task, so only
//! shims older than [`ORPHAN_MIN_AGE`] are candidates, and the shims are
//! listed before the tasks.

use std::collections::BTreeSet;
use std::time::Duration;

use containerd_client::services::v1::ListTasksRequest;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::container::ContainerRuntime;
use crate::error::RuntimeError;

/// A shim younger than this may be one whose task containerd is still
/// creating (that takes milliseconds); it is never reaped.
pub const ORPHAN_MIN_AGE: Duration = Duration::from_secs(10);

/// How long a shim gets to exit after `SIGTERM` before `SIGKILL`.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// A containerd shim process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shim {
    /// Its pid.
    pub pid: i32,
    /// The task id it serves (`-id`).
    pub id: String,
    /// How long it has been running.
    pub age: Duration,
}

/// The `(namespace, id)` of a shim's command line (NUL-separated, as in
/// `/proc/<pid>/cmdline`), if it is a containerd v2 shim.
pub fn parse_cmdline(cmdline: &[u8]) -> Option<(String, String)> {
    let mut args = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(String::from_utf8_lossy);
    let argv0 = args.next()?;
    let name = argv0.rsplit('/').next().unwrap_or("");
    if !name.starts_with("containerd-shim") {
        return None;
    }
    let (mut namespace, mut id) = (None, None);
    while let Some(a) = args.next() {
        match a.as_ref() {
            "-namespace" | "--namespace" => namespace = args.next().map(|s| s.into_owned()),
            "-id" | "--id" => id = args.next().map(|s| s.into_owned()),
            _ => {}
        }
    }
    Some((namespace?, id?))
}

/// The shims of containerd namespace `namespace` running on this host.
pub fn list_shims(namespace: &str) -> Vec<Shim> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let uptime = read_uptime();
    let ticks = clock_ticks();
    entries
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let (ns, id) = parse_cmdline(&cmdline)?;
            if ns != namespace {
                return None;
            }
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let age = process_age(&stat, uptime?, ticks)?;
            Some(Shim { pid, id, age })
        })
        .collect()
}

fn read_uptime() -> Option<f64> {
    std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn clock_ticks() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .and_then(|t| u64::try_from(t).ok())
        .filter(|t| *t > 0)
        .unwrap_or(100)
}

/// Age of a process from its `/proc/<pid>/stat` (start time, field 22, in
/// clock ticks since boot) and the host's uptime in seconds.
fn process_age(stat: &str, uptime: f64, ticks: u64) -> Option<Duration> {
    // The command name (field 2) is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 1..];
    let start: u64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    let started = start as f64 / ticks as f64;
    Some(Duration::from_secs_f64((uptime - started).max(0.0)))
}

fn alive(pid: i32) -> bool {
    kill(Pid::from_raw(pid), None).is_ok()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                let rest = &s[s.rfind(')')? + 1..];
                rest.split_whitespace().next().map(|state| state != "Z")
            })
            .unwrap_or(false)
}

impl ContainerRuntime {
    /// Stops the shims of the agent's namespace older than
    /// [`ORPHAN_MIN_AGE`] whose task containerd does not know; returns how
    /// many it stopped.
    pub async fn reap_orphan_shims(&self) -> Result<usize, RuntimeError> {
        let namespace = self.client().namespace().to_owned();
        // Shims first, tasks after: a task created in between is listed.
        let shims: Vec<Shim> = list_shims(&namespace)
            .into_iter()
            .filter(|s| s.age >= ORPHAN_MIN_AGE)
            .collect();
        if shims.is_empty() {
            return Ok(0);
        }
        let client = self.client();
        let tasks: BTreeSet<String> = client
            .tasks()
            .list(client.request(ListTasksRequest::default()))
            .await
            .map_err(|s| RuntimeError::containerd("tasks.list", s))?
            .into_inner()
            .tasks
            .into_iter()
            .map(|t| t.id)
            .collect();
        let mut reaped = 0;
        for shim in shims.iter().filter(|s| !tasks.contains(&s.id)) {
            tracing::info!(pid = shim.pid, id = %shim.id, age = ?shim.age, "stopping a shim containerd has no task for");
            if stop(shim.pid).await {
                reaped += 1;
            }
        }
        Ok(reaped)
    }
}

/// `SIGTERM`, then `SIGKILL` after [`SHUTDOWN_GRACE`]; whether it is gone.
async fn stop(pid: i32) -> bool {
    let pid_t = Pid::from_raw(pid);
    if kill(pid_t, Signal::SIGTERM).is_err() {
        return !alive(pid);
    }
    let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
    while tokio::time::Instant::now() < deadline {
        if !alive(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tracing::warn!(pid, "shim ignored SIGTERM; killing it");
    let _ = kill(pid_t, Signal::SIGKILL);
    for _ in 0..20 {
        if !alive(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shim_command_lines() {
        let real = b"/usr/bin/containerd-shim-runc-v2\0-namespace\0k8s.cubelet.io\0-id\0abc\0-address\0/run/containerd/containerd.sock\0";
        assert_eq!(
            parse_cmdline(real),
            Some(("k8s.cubelet.io".to_owned(), "abc".to_owned()))
        );
        assert_eq!(
            parse_cmdline(b"/usr/bin/sleep\0-namespace\0x\0-id\0y\0"),
            None
        );
        assert_eq!(
            parse_cmdline(b"containerd-shim-runc-v2\0-namespace\0x\0"),
            None
        );
        assert_eq!(parse_cmdline(b""), None);
    }

    #[test]
    fn process_age_from_stat() {
        // Start time 1000 ticks (10 s at 100 Hz) after boot, uptime 70 s.
        let stat =
            "42 (containerd-shim (x)) S 1 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 10 0 1000 0 0";
        assert_eq!(process_age(stat, 70.0, 100), Some(Duration::from_secs(60)));
        assert_eq!(process_age("garbage", 70.0, 100), None);
    }

    #[test]
    fn this_process_is_alive_and_no_shim() {
        assert!(alive(std::process::id() as i32));
        let me = std::fs::read(format!("/proc/{}/cmdline", std::process::id())).unwrap();
        assert_eq!(parse_cmdline(&me), None);
    }
}
