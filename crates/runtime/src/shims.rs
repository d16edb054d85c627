//! Shim processes containerd forgot.
//!
//! containerd starts one `containerd-shim-runc-v2 -namespace <ns> -id <id>`
//! per task. When the agent is killed in the middle of a create, the restart
//! rolls the create back and containerd holds no task any more, yet the shim
//! can still be running with its bundle deleted: the node keeps a process
//! nobody will ever stop. The reaper finds the shims of the agent's
//! namespace in `/proc` (by their arguments, never by name alone), asks
//! containerd which tasks it has, and stops every shim whose id is not one
//! of them, as containerd itself would: by the shim's own ttrpc
//! `containerd.task.v2.Task/Shutdown` where it still answers (its socket
//! found as containerd finds it: the `address` file in its bundle, else the
//! path containerd derives from its `-address`, namespace and id), else by
//! its pid: `SIGTERM` first, `SIGKILL` if it is still there after
//! [`SHUTDOWN_GRACE`]. Each stop is logged with the way it went
//! (`shim stopped by its own shutdown` / `shim stopped by signal`); a socket
//! file the shim left behind is removed once nobody listens on it.
//!
//! A shim exists for a moment before containerd records its task, so only
//! shims older than [`ORPHAN_MIN_AGE`] are candidates, and the shims are
//! listed before the tasks.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use containerd_client::services::v1::ListTasksRequest;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::container::ContainerRuntime;
use crate::error::RuntimeError;
use crate::ttrpc::{self, SocketAddress};

/// A shim younger than this may be one whose task containerd is still
/// creating (that takes milliseconds); it is never reaped.
pub const ORPHAN_MIN_AGE: Duration = Duration::from_secs(10);

/// How long a shim gets to exit after `SIGTERM` before `SIGKILL`, and
/// after answering a `Shutdown` before it is signalled.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// How long a shim's `Shutdown` call may take (connect, request, answer).
pub const SHUTDOWN_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Where containerd (1.5 and later) puts shim sockets:
/// `<state root>/s/<sha256 of "<containerd address>/<namespace>/<id>">`.
/// The shim derives it from the compiled-in state root, whatever
/// containerd's own `state` setting, so this is that constant.
pub const SHIM_SOCKET_DIR: &str = "/run/containerd/s";

/// A containerd shim process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shim {
    /// Its pid.
    pub pid: i32,
    /// The task id it serves (`-id`).
    pub id: String,
    /// How long it has been running.
    pub age: Duration,
    /// containerd's socket it was started for (`-address`), if given.
    pub containerd_address: Option<String>,
}

/// What a shim's command line says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimArgs {
    /// `-namespace`.
    pub namespace: String,
    /// `-id`.
    pub id: String,
    /// `-address`: containerd's socket, if given.
    pub containerd_address: Option<String>,
}

/// How an orphan shim was stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// It answered `Shutdown` and exited.
    Shutdown,
    /// By its pid: `SIGTERM`, then `SIGKILL`.
    Signal,
}

impl Stopped {
    /// For logs: `shutdown` or `signal`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stopped::Shutdown => "shutdown",
            Stopped::Signal => "signal",
        }
    }
}

/// The arguments of a shim's command line (NUL-separated, as in
/// `/proc/<pid>/cmdline`), if it is a containerd v2 shim.
pub fn parse_cmdline(cmdline: &[u8]) -> Option<ShimArgs> {
    let mut args = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(String::from_utf8_lossy);
    let argv0 = args.next()?;
    let name = argv0.rsplit('/').next().unwrap_or("");
    if !name.starts_with("containerd-shim") {
        return None;
    }
    let (mut namespace, mut id, mut containerd_address) = (None, None, None);
    while let Some(a) = args.next() {
        match a.as_ref() {
            "-namespace" | "--namespace" => namespace = args.next().map(|s| s.into_owned()),
            "-id" | "--id" => id = args.next().map(|s| s.into_owned()),
            "-address" | "--address" => containerd_address = args.next().map(|s| s.into_owned()),
            _ => {}
        }
    }
    Some(ShimArgs {
        namespace: namespace?,
        id: id?,
        containerd_address,
    })
}

/// The socket containerd derives for the shim of task `id` in `namespace`
/// started for the containerd at `containerd_address` (its
/// `shim.SocketAddress`: the hex SHA-256 of the three joined as a path,
/// under [`SHIM_SOCKET_DIR`]).
pub fn derived_socket(containerd_address: &str, namespace: &str, id: &str) -> PathBuf {
    use sha2::Digest;
    let joined = Path::new(containerd_address).join(namespace).join(id);
    let digest = sha2::Sha256::digest(joined.as_os_str().as_encoded_bytes());
    Path::new(SHIM_SOCKET_DIR).join(hex::encode(digest))
}

/// Where shim `shim` of `namespace` may listen, in the order containerd
/// looks: the `address` its bundle (its working directory) holds, then the
/// derived path when that socket file exists. Empty when neither is there
/// (a shim whose bundle is gone and whose socket was removed).
pub fn shim_sockets(shim: &Shim, namespace: &str) -> Vec<SocketAddress> {
    let mut found = Vec::new();
    if let Some(a) = std::fs::read_to_string(format!("/proc/{}/cwd/address", shim.pid))
        .ok()
        .and_then(|a| SocketAddress::parse(&a))
    {
        found.push(a);
    }
    if let Some(containerd) = &shim.containerd_address {
        let path = derived_socket(containerd, namespace, &shim.id);
        let derived = SocketAddress::Path(path.clone());
        if path.exists() && !found.contains(&derived) {
            found.push(derived);
        }
    }
    found
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
            let args = parse_cmdline(&cmdline)?;
            if args.namespace != namespace {
                return None;
            }
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let age = process_age(&stat, uptime?, ticks)?;
            Some(Shim {
                pid,
                id: args.id,
                age,
                containerd_address: args.containerd_address,
            })
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
            if stop_shim(shim, &namespace).await.is_some() {
                reaped += 1;
            }
        }
        Ok(reaped)
    }
}

/// Stops `shim`: its own `Shutdown` where it answers and then exits, else
/// by its pid. How it went, or `None` if it is still running.
pub async fn stop_shim(shim: &Shim, namespace: &str) -> Option<Stopped> {
    let sockets = shim_sockets(shim, namespace);
    let mut how = None;
    for socket in &sockets {
        match ttrpc::shutdown_shim(socket, namespace, &shim.id, SHUTDOWN_CALL_TIMEOUT).await {
            Ok(()) => {
                if exits_within(shim.pid, SHUTDOWN_GRACE).await {
                    how = Some(Stopped::Shutdown);
                } else {
                    // The runc shim answers but stays while it still serves
                    // a container.
                    tracing::warn!(pid = shim.pid, id = %shim.id, "shim answered shutdown but is still running; signalling it");
                }
                break;
            }
            Err(e) => {
                tracing::debug!(pid = shim.pid, id = %shim.id, socket = %socket.display(), error = %e, "shim did not take a shutdown")
            }
        }
    }
    if how.is_none() && stop(shim.pid).await {
        how = Some(Stopped::Signal);
    }
    let how = how?;
    tracing::info!(
        pid = shim.pid,
        id = %shim.id,
        how = how.as_str(),
        "shim stopped by {}",
        match how {
            Stopped::Shutdown => "its own shutdown",
            Stopped::Signal => "signal",
        }
    );
    for socket in &sockets {
        if let SocketAddress::Path(path) = socket {
            if ttrpc::is_stale_socket(path) {
                if let Err(e) = std::fs::remove_file(path) {
                    tracing::debug!(path = %path.display(), error = %e, "removing a stopped shim's socket");
                }
            }
        }
    }
    Some(how)
}

/// Whether process `pid` is gone within `limit`.
async fn exits_within(pid: i32, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if !alive(pid) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
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
            Some(ShimArgs {
                namespace: "k8s.cubelet.io".to_owned(),
                id: "abc".to_owned(),
                containerd_address: Some("/run/containerd/containerd.sock".to_owned()),
            })
        );
        assert_eq!(
            parse_cmdline(b"containerd-shim-runc-v2\0-id\0abc\0-namespace\0x\0").map(|a| (
                a.namespace,
                a.id,
                a.containerd_address
            )),
            Some(("x".to_owned(), "abc".to_owned(), None))
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

    #[test]
    fn the_socket_is_derived_as_containerd_derives_it() {
        // What containerd-shim-runc-v2 1.6.20 printed and wrote to `address`
        // for `-namespace scale-probe -id probe1 -address <this>`.
        assert_eq!(
            derived_socket(
                "/run/cubelet-test/containerd/containerd.sock",
                "scale-probe",
                "probe1"
            ),
            PathBuf::from(
                "/run/containerd/s/c695dc33a9adacfc99c8789fe5f6c80e9a126e7ef7102667d346862a6cb5177d"
            )
        );
    }

    /// Held by each test that starts a stand-in shim, for all of it. A
    /// child forked by a test on another thread holds a copy of every fd of
    /// this process until it execs, so a listener one test drops could still
    /// take connections for that moment and its socket would not look stale.
    static STAND_INS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// A stand-in shim: `sleep` running in `bundle`, reaped by a thread so
    /// that it does not stay a zombie.
    fn stand_in(bundle: &Path) -> (i32, std::thread::JoinHandle<()>) {
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .current_dir(bundle)
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let waiter = std::thread::spawn(move || {
            let _ = child.wait();
        });
        (pid, waiter)
    }

    #[tokio::test]
    async fn a_shim_that_answers_is_stopped_by_its_own_shutdown() {
        let _serial = STAND_INS.lock().await;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let bundle = tempfile::tempdir().unwrap();
        let socket = bundle.path().join("s.sock");
        std::fs::write(
            bundle.path().join("address"),
            format!("unix://{}", socket.display()),
        )
        .unwrap();
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let (pid, waiter) = stand_in(bundle.path());
        // The fake shim: answers Shutdown for the right id, then exits (its
        // process is killed, its listener dropped, its socket file left).
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut h = [0u8; 10];
            conn.read_exact(&mut h).await.unwrap();
            let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
            let mut body = vec![0u8; len];
            conn.read_exact(&mut body).await.unwrap();
            let req: ttrpc::Request = prost::Message::decode(body.as_slice()).unwrap();
            let shutdown: ttrpc::ShutdownRequest =
                prost::Message::decode(req.payload.as_slice()).unwrap();
            assert_eq!(
                (req.method.as_str(), shutdown.id.as_str()),
                ("Shutdown", "orphan")
            );
            let reply = prost::Message::encode_to_vec(&ttrpc::Response::default());
            let mut frame = ttrpc::header(reply.len() as u32, 1, 2).to_vec();
            frame.extend(reply);
            conn.write_all(&frame).await.unwrap();
            drop(listener);
            kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
        });
        let shim = Shim {
            pid,
            id: "orphan".into(),
            age: ORPHAN_MIN_AGE,
            containerd_address: Some("/nonexistent/containerd.sock".into()),
        };
        assert_eq!(
            shim_sockets(&shim, "ns"),
            vec![SocketAddress::Path(socket.clone())]
        );
        assert_eq!(stop_shim(&shim, "ns").await, Some(Stopped::Shutdown));
        server.await.unwrap();
        waiter.join().unwrap();
        assert!(!socket.exists(), "the socket the shim left is removed");
    }

    #[tokio::test]
    async fn a_shim_without_a_socket_is_stopped_by_its_pid() {
        let _serial = STAND_INS.lock().await;
        let bundle = tempfile::tempdir().unwrap();
        let (pid, waiter) = stand_in(bundle.path());
        let shim = Shim {
            pid,
            id: "orphan".into(),
            age: ORPHAN_MIN_AGE,
            containerd_address: Some("/nonexistent/containerd.sock".into()),
        };
        assert!(shim_sockets(&shim, "ns").is_empty());
        assert_eq!(stop_shim(&shim, "ns").await, Some(Stopped::Signal));
        waiter.join().unwrap();
    }

    #[tokio::test]
    async fn a_shim_whose_socket_does_not_answer_is_stopped_by_its_pid() {
        let _serial = STAND_INS.lock().await;
        let bundle = tempfile::tempdir().unwrap();
        let socket = bundle.path().join("s.sock");
        // A socket file nobody listens on: the shim's server is gone.
        drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
        std::fs::write(bundle.path().join("address"), socket.display().to_string()).unwrap();
        let (pid, waiter) = stand_in(bundle.path());
        let shim = Shim {
            pid,
            id: "orphan".into(),
            age: ORPHAN_MIN_AGE,
            containerd_address: None,
        };
        assert_eq!(stop_shim(&shim, "ns").await, Some(Stopped::Signal));
        waiter.join().unwrap();
        assert!(!socket.exists(), "the stale socket is removed");
    }
}
