//! Shim processes containerd forgot.
//!
//! containerd starts one `containerd-shim-runc-v2 -namespace <ns> -id <id>`
//! per task. When the agent is killed in the middle of a create, the restart
//! rolls the create back and containerd holds no task any more, yet the shim
//! can still be running with its bundle deleted: the node keeps a process
//! nobody will ever stop.
//!
//! **Ownership, not shape.** A command line proves nothing: any pod can run
//! a process whose argv reads like a shim's. A shim is the agent's only if
//! the agent recorded it when it started it, in its *shim ledger* (one file
//! per task id under `<runtime state dir>/shims/`, see [`ShimLedger`]):
//! before `tasks.create` an *intent* (the boot-clock time it asked), after it
//! the shim's identity (its pid and its start time from `/proc/<pid>/stat`,
//! the shim being the parent of the task's init process). A process is that
//! shim if its pid and start time match the identity; or, when only the
//! intent was written (the agent was killed inside `tasks.create`), if it
//! started within [`INTENT_WINDOW`] after the intent, in the agent's own pid
//! namespace, with the task id of the intent. Anything else is left alone,
//! whatever its arguments say.
//!
//! The reaper lists the shims of the agent's namespace in `/proc` (their
//! `cmdline` and `stat`, read with the guards of [`crate::safe_read`], on a
//! blocking thread under [`SCAN_TIMEOUT`]), asks containerd which tasks it
//! has, and stops every shim of its own whose id is not one of them and
//! that is the parent of no task's process (a task grouped into another's
//! shim, as a pod's stats anchor is, keeps that shim), as
//! containerd itself would: by the shim's own ttrpc
//! `containerd.task.v2.Task/Shutdown` where it still answers (on the socket
//! containerd derives from its `-address`, namespace and id, under
//! [`SHIM_SOCKET_DIR`]; nothing is ever read through the shim's
//! `/proc/<pid>/cwd` or `root`), else by a pidfd opened after its identity
//! was checked again: `SIGTERM` first, `SIGKILL` if it is still there after
//! [`SHUTDOWN_GRACE`]. Each stop is logged with the way it went
//! (`shim stopped by its own shutdown` / `shim stopped by signal`); a socket
//! file the shim left behind is removed once nobody listens on it.
//!
//! A shim exists for a moment before containerd records its task, so only
//! shims older than [`ORPHAN_MIN_AGE`] are candidates, and the shims are
//! listed before the tasks.
//!
//! **Wedged shims.** A shim of the agent's own that containerd still lists
//! but that answers nothing (containerd 1.6's deadlocks) is killed the same
//! way on request of a stop that ran too long
//! ([`ContainerRuntime::unwedge_shim`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use containerd_client::services::v1::ListTasksRequest;
use containerd_client::types::v1::Status as TaskStatus;

use crate::container::ContainerRuntime;
use crate::error::RuntimeError;
use crate::io::ttrpc::{self, SocketAddress};
use crate::safe_read::read_no_follow;

/// A shim younger than this may be one whose task containerd is still
/// creating (that takes milliseconds); it is never reaped.
pub const ORPHAN_MIN_AGE: Duration = Duration::from_secs(10);

/// How long containerd has to tell a task's status when the agent checks
/// whether its shim still answers ([`ContainerRuntime::unwedge_shim`]).
pub const SHIM_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long containerd has to delete the tasks of a shim the agent killed
/// ([`ContainerRuntime::unwedge_shim`]); it takes about a second.
pub const DEAD_SHIM_CLEANUP_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a shim gets to exit after `SIGTERM` before `SIGKILL`.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// How long a shim's `Shutdown` call may take (connect, request, answer).
/// A Go shim on a loaded node (a build and a guest beside it) took over 2 s
/// to answer once, and was then signalled instead of shutting down cleanly;
/// containerd itself gives a shim's cleanup seconds, not milliseconds.
pub const SHUTDOWN_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a shim that answered `Shutdown` gets to exit before it is
/// signalled (it exits at once unless it still serves a container).
pub const SHUTDOWN_EXIT_WAIT: Duration = Duration::from_secs(5);

/// How long listing the shims in `/proc` may take; past it the pass fails
/// (and readiness never waits on it longer).
pub const SCAN_TIMEOUT: Duration = Duration::from_secs(5);

/// How long containerd's task list may take.
pub const TASKS_TIMEOUT: Duration = Duration::from_secs(10);

/// How long after an intent a shim may start and still be the one that
/// intent announced (containerd starts the shim first thing in
/// `tasks.create`).
pub const INTENT_WINDOW: Duration = Duration::from_secs(60);

/// The ledger's directory under the runtime's state directory.
pub const LEDGER_DIR: &str = "shims";

/// Most of a `/proc/<pid>/cmdline` read (a shim's is a few hundred bytes).
const CMDLINE_CAP: u64 = 64 * 1024;
/// Most of a `/proc/<pid>/stat` or a ledger file read.
const STAT_CAP: u64 = 4096;

/// Where containerd (1.5 and later) puts shim sockets:
/// `<state root>/s/<sha256 of "<containerd address>/<namespace>/<id>">`.
/// The shim derives it from the compiled-in state root, whatever
/// containerd's own `state` setting, so this is that constant.
pub const SHIM_SOCKET_DIR: &str = "/run/containerd/s";

/// Who a process is: its pid and its start time (clock ticks after boot,
/// field 22 of `/proc/<pid>/stat`), which together never name two
/// processes of one boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessIdentity {
    /// Its pid.
    pub pid: i32,
    /// When it started, in clock ticks after boot.
    pub start_ticks: u64,
}

/// A containerd shim process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shim {
    /// Its pid and start time.
    pub identity: ProcessIdentity,
    /// The task id it serves (`-id`).
    pub id: String,
    /// How long it has been running.
    pub age: Duration,
    /// containerd's socket it was started for (`-address`), if given.
    pub containerd_address: Option<String>,
    /// Whether it runs in the agent's own pid namespace.
    pub in_our_pid_ns: bool,
}

impl Shim {
    /// Its pid.
    pub fn pid(&self) -> i32 {
        self.identity.pid
    }
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
    derived_socket_in(
        Path::new(SHIM_SOCKET_DIR),
        containerd_address,
        namespace,
        id,
    )
}

fn derived_socket_in(dir: &Path, containerd_address: &str, namespace: &str, id: &str) -> PathBuf {
    use sha2::Digest;
    let joined = Path::new(containerd_address).join(namespace).join(id);
    let digest = sha2::Sha256::digest(joined.as_os_str().as_encoded_bytes());
    dir.join(hex::encode(digest))
}

/// Where shim `shim` of `namespace` may listen: the socket containerd
/// derives for it under `socket_dir`, when a socket file is there. Nothing
/// the shim's own directory holds is read: its working directory may be a
/// pod's.
pub fn shim_sockets(shim: &Shim, namespace: &str, socket_dir: &Path) -> Vec<SocketAddress> {
    use std::os::unix::fs::FileTypeExt;
    let Some(containerd) = &shim.containerd_address else {
        return Vec::new();
    };
    let path = derived_socket_in(socket_dir, containerd, namespace, &shim.id);
    let is_socket = std::fs::symlink_metadata(&path)
        .map(|m| m.file_type().is_socket())
        .unwrap_or(false);
    if is_socket {
        vec![SocketAddress::Path(path)]
    } else {
        Vec::new()
    }
}

/// The fields after the command name of a `/proc/<pid>/stat` (which is in
/// parentheses and may hold spaces and parentheses itself).
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    Some(stat[stat.rfind(')')? + 1..].split_whitespace().collect())
}

fn read_stat(pid: i32) -> Option<String> {
    let bytes = read_no_follow(Path::new(&format!("/proc/{pid}/stat")), STAT_CAP).ok()?;
    String::from_utf8(bytes).ok()
}

/// The identity of process `pid` now, if it exists and is not a zombie.
pub fn identity(pid: i32) -> Option<ProcessIdentity> {
    let stat = read_stat(pid)?;
    let fields = stat_fields(&stat)?;
    if fields.first() == Some(&"Z") {
        return None;
    }
    Some(ProcessIdentity {
        pid,
        start_ticks: fields.get(19)?.parse().ok()?,
    })
}

/// The parent of process `pid`.
fn parent(pid: i32) -> Option<i32> {
    stat_fields(&read_stat(pid)?)?.get(1)?.parse().ok()
}

fn pid_ns(pid: &str) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()
}

/// Clock ticks since boot now (the clock of `/proc/<pid>/stat` start
/// times).
fn now_ticks() -> Option<u64> {
    let up = read_uptime()?;
    Some((up * clock_ticks() as f64) as u64)
}

/// One task id's record in the [`ShimLedger`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerEntry {
    /// The agent asked containerd to create the task at this time (clock
    /// ticks after boot); the shim it starts starts after it.
    Intent {
        /// The earliest start time of the announced shim.
        not_before: u64,
    },
    /// The shim the task got.
    Shim(ProcessIdentity),
}

impl LedgerEntry {
    fn encode(&self) -> String {
        match self {
            LedgerEntry::Intent { not_before } => format!("intent {not_before}\n"),
            LedgerEntry::Shim(i) => format!("shim {} {}\n", i.pid, i.start_ticks),
        }
    }

    fn parse(text: &str) -> Option<LedgerEntry> {
        let mut words = text.split_whitespace();
        match words.next()? {
            "intent" => Some(LedgerEntry::Intent {
                not_before: words.next()?.parse().ok()?,
            }),
            "shim" => Some(LedgerEntry::Shim(ProcessIdentity {
                pid: words.next()?.parse().ok()?,
                start_ticks: words.next()?.parse().ok()?,
            })),
            _ => None,
        }
    }
}

/// The shims this agent started, by task id: one small file per id under
/// its own state directory (volatile, as the shims themselves: a reboot
/// ends both). See the module documentation.
#[derive(Debug, Clone)]
pub struct ShimLedger {
    dir: PathBuf,
}

/// Whether `id` can name a ledger file (Cubelet's ids are hex; anything
/// else is never recorded, so never reaped).
fn ledger_name_ok(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

impl ShimLedger {
    /// The ledger in `dir` (made on the first record, mode 0700).
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn write(&self, id: &str, entry: LedgerEntry) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        if !ledger_name_ok(id) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("task id {id:?} cannot name a ledger file"),
            ));
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)?;
        let tmp = self.dir.join(format!(".{id}.tmp"));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(entry.encode().as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, self.dir.join(id))
    }

    /// Records that the agent is about to have containerd create task
    /// `id` (and so start its shim).
    pub fn intend(&self, id: &str) -> std::io::Result<()> {
        let now = now_ticks().ok_or_else(|| std::io::Error::other("no /proc/uptime"))?;
        // One second of slack for the rounding of uptime and start times.
        let not_before = now.saturating_sub(clock_ticks());
        self.write(id, LedgerEntry::Intent { not_before })
    }

    /// Records the shim of task `id` now that containerd created it: the
    /// parent of the task's init process `task_pid`, if it is a shim for
    /// `id` in `namespace`. Otherwise (a runtime whose processes are not
    /// children of a shim) the intent stays.
    pub fn record_task(&self, id: &str, namespace: &str, task_pid: u32) -> std::io::Result<()> {
        let not_a_shim =
            || std::io::Error::other(format!("no shim of task {id} above pid {task_pid}"));
        let pid = i32::try_from(task_pid).map_err(|_| not_a_shim())?;
        let shim = parent(pid).ok_or_else(not_a_shim)?;
        let cmdline = read_no_follow(Path::new(&format!("/proc/{shim}/cmdline")), CMDLINE_CAP)
            .map_err(|_| not_a_shim())?;
        let args = parse_cmdline(&cmdline).ok_or_else(not_a_shim)?;
        if args.namespace != namespace || args.id != id {
            return Err(not_a_shim());
        }
        let identity = identity(shim).ok_or_else(not_a_shim)?;
        self.write(id, LedgerEntry::Shim(identity))
    }

    /// Records shim `identity` for task `id` directly.
    pub fn record(&self, id: &str, identity: ProcessIdentity) -> std::io::Result<()> {
        self.write(id, LedgerEntry::Shim(identity))
    }

    /// Every record, by task id (an unreadable one is skipped).
    pub fn entries(&self) -> BTreeMap<String, LedgerEntry> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return BTreeMap::new();
        };
        rd.flatten()
            .filter_map(|e| {
                let id = e.file_name().into_string().ok()?;
                if !ledger_name_ok(&id) {
                    return None;
                }
                let text = read_no_follow(&e.path(), STAT_CAP).ok()?;
                let entry = LedgerEntry::parse(std::str::from_utf8(&text).ok()?)?;
                Some((id, entry))
            })
            .collect()
    }

    /// Removes the record of `id`.
    pub fn forget(&self, id: &str) {
        if ledger_name_ok(id) {
            let _ = std::fs::remove_file(self.dir.join(id));
        }
    }

    /// Removes records that can name no running process any more: a shim
    /// that is gone, an intent older than [`INTENT_WINDOW`] that no
    /// running shim of `shims` fits.
    fn prune(&self, entries: &BTreeMap<String, LedgerEntry>, shims: &[Shim], now: u64) {
        let window = INTENT_WINDOW.as_secs() * clock_ticks();
        for (id, entry) in entries {
            let stale = match entry {
                LedgerEntry::Shim(i) => identity(i.pid) != Some(*i),
                LedgerEntry::Intent { not_before } => {
                    now > not_before.saturating_add(window)
                        && !shims.iter().any(|s| owns(Some(entry), s))
                }
            };
            if stale {
                self.forget(id);
            }
        }
    }
}

/// Whether the ledger `entry` of a shim's task id says the agent started
/// that shim.
pub fn owns(entry: Option<&LedgerEntry>, shim: &Shim) -> bool {
    match entry {
        Some(LedgerEntry::Shim(i)) => *i == shim.identity,
        Some(LedgerEntry::Intent { not_before }) => {
            let window = INTENT_WINDOW.as_secs() * clock_ticks();
            shim.in_our_pid_ns
                && shim.identity.start_ticks >= *not_before
                && shim.identity.start_ticks <= not_before.saturating_add(window)
        }
        None => false,
    }
}

/// The processes whose command line says they are shims of containerd
/// namespace `namespace` (which proves nothing about who started them).
pub fn list_shims(namespace: &str) -> Vec<Shim> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let Some(now) = now_ticks() else {
        return Vec::new();
    };
    let ticks = clock_ticks();
    let ours = pid_ns("self");
    entries
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = read_no_follow(&e.path().join("cmdline"), CMDLINE_CAP).ok()?;
            let args = parse_cmdline(&cmdline)?;
            if args.namespace != namespace {
                return None;
            }
            let identity = identity(pid)?;
            let age = Duration::from_secs_f64(
                now.saturating_sub(identity.start_ticks) as f64 / ticks as f64,
            );
            Some(Shim {
                identity,
                id: args.id,
                age,
                containerd_address: args.containerd_address,
                in_our_pid_ns: ours.is_some() && pid_ns(&pid.to_string()) == ours,
            })
        })
        .collect()
}

/// The shims of `namespace` old enough to be orphans, each with whether the
/// agent's ledger says it started it; prunes the ledger on the way.
fn scan(namespace: &str, ledger: &ShimLedger) -> Vec<(Shim, bool)> {
    let shims = list_shims(namespace);
    let entries = ledger.entries();
    if let Some(now) = now_ticks() {
        ledger.prune(&entries, &shims, now);
    }
    shims
        .into_iter()
        .filter(|s| s.age >= ORPHAN_MIN_AGE)
        .map(|s| {
            let owned = owns(entries.get(&s.id), &s);
            (s, owned)
        })
        .collect()
}

fn read_uptime() -> Option<f64> {
    let text = read_no_follow(Path::new("/proc/uptime"), STAT_CAP).ok()?;
    std::str::from_utf8(&text)
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
#[cfg(test)]
fn process_age(stat: &str, uptime: f64, ticks: u64) -> Option<Duration> {
    let start: u64 = stat_fields(stat)?.get(19)?.parse().ok()?;
    let started = start as f64 / ticks as f64;
    Some(Duration::from_secs_f64((uptime - started).max(0.0)))
}

/// Whether the process `identity` names is still running.
fn alive(identity: ProcessIdentity) -> bool {
    self::identity(identity.pid) == Some(identity)
}

impl ContainerRuntime {
    /// The ledger of the shims this agent started.
    pub fn shim_ledger(&self) -> ShimLedger {
        ShimLedger::new(self.config().state_dir.join(LEDGER_DIR))
    }

    /// The shims of the agent's namespace older than [`ORPHAN_MIN_AGE`],
    /// each with whether the agent started it; read on a blocking thread
    /// within [`SCAN_TIMEOUT`].
    async fn scan_shims(&self) -> Result<Vec<(Shim, bool)>, RuntimeError> {
        let namespace = self.client().namespace().to_owned();
        let ledger = self.shim_ledger();
        let ns = namespace.clone();
        tokio::time::timeout(
            SCAN_TIMEOUT,
            tokio::task::spawn_blocking(move || scan(&ns, &ledger)),
        )
        .await
        .map_err(|_| RuntimeError::Timeout {
            op: "shim scan",
            id: namespace,
            timeout: SCAN_TIMEOUT,
        })?
        .map_err(|e| RuntimeError::FailedPrecondition(format!("shim scan task failed: {e}")))
    }

    /// Stops the shims of the agent's namespace older than
    /// [`ORPHAN_MIN_AGE`] that the agent started (its ledger says so) and
    /// whose task containerd does not know; returns how many it stopped.
    /// Processes that only look like shims are left alone.
    pub async fn reap_orphan_shims(&self) -> Result<usize, RuntimeError> {
        let namespace = self.client().namespace().to_owned();
        // Shims first, tasks after: a task created in between is listed.
        let scanned = self.scan_shims().await?;
        if scanned.is_empty() {
            return Ok(0);
        }
        let client = self.client();
        let tasks = tokio::time::timeout(
            TASKS_TIMEOUT,
            client
                .tasks()
                .list(client.request(ListTasksRequest::default())),
        )
        .await
        .map_err(|_| RuntimeError::Timeout {
            op: "tasks.list",
            id: namespace.clone(),
            timeout: TASKS_TIMEOUT,
        })?
        .map_err(|s| RuntimeError::containerd("tasks.list", s))?
        .into_inner()
        .tasks;
        // A shim serves every task whose process is its child, whatever
        // its `-id` says: a task grouped into another's shim (a pod's stats
        // anchor) keeps that shim after the task it was started for is gone.
        let pids: Vec<u32> = tasks.iter().map(|t| t.pid).filter(|p| *p > 0).collect();
        let serving: BTreeSet<i32> = tokio::task::spawn_blocking(move || {
            pids.into_iter()
                .filter_map(|p| parent(i32::try_from(p).ok()?))
                .collect()
        })
        .await
        .unwrap_or_default();
        let tasks: BTreeSet<String> = tasks.into_iter().map(|t| t.id).collect();
        let mut reaped = 0;
        for (shim, owned) in scanned
            .iter()
            .filter(|(s, _)| !tasks.contains(&s.id) && !serving.contains(&s.pid()))
        {
            if !owned {
                tracing::debug!(pid = shim.pid(), id = %shim.id, "a process with a shim's command line this agent did not start: left alone");
                continue;
            }
            tracing::info!(pid = shim.pid(), id = %shim.id, age = ?shim.age, "stopping a shim containerd has no task for");
            if stop_shim(shim, &namespace, Path::new(SHIM_SOCKET_DIR))
                .await
                .is_some()
            {
                reaped += 1;
                self.shim_ledger().forget(&shim.id);
            }
        }
        Ok(reaped)
    }
}

impl ContainerRuntime {
    /// Kills the shim of task group `group` (a pod's sandbox id) if it
    /// answers nothing: twice, [`SHIM_PROBE_TIMEOUT`] apart, no task of
    /// `tasks` (the pod's) has a known status from containerd within
    /// [`SHIM_PROBE_TIMEOUT`] (containerd 1.6 itself
    /// answers `Get` with the status `Unknown` when the shim does not
    /// answer `State` in 2 s), at least one exists, and containerd itself
    /// answers `Version` (a hung containerd is no shim's fault). Only a shim this
    /// agent started (its ledger says so) is killed. containerd then cleans
    /// up after the dead shim: it deletes the shim's tasks (runc kills what
    /// is left of their processes, unmounts their rootfs) and publishes
    /// their exits, and the calls that waited on the shim return; this
    /// waits for that cleanup. Whether a shim was killed.
    pub async fn unwedge_shim(&self, group: &str, tasks: &[String]) -> Result<bool, RuntimeError> {
        // Twice, [`SHIM_PROBE_TIMEOUT`] apart: a shim only slow to answer
        // (a loaded or emulated machine) answers one of them.
        for round in 0..2 {
            if round > 0 {
                tokio::time::sleep(SHIM_PROBE_TIMEOUT).await;
            }
            if !self.no_task_state(tasks).await? {
                return Ok(false);
            }
        }
        // containerd itself must answer: a hung containerd is not the
        // shim's fault, and its shims are left alone.
        let client = self.client();
        let mut version_client = client.version();
        let version = version_client.version(client.request(()));
        match tokio::time::timeout(SHIM_PROBE_TIMEOUT, version).await {
            Ok(Ok(_)) => {
                let Some(bundles) = self.kill_wedged_shim(group).await? else {
                    return Ok(false);
                };
                self.dead_shim_cleaned_up(tasks, bundles.as_deref()).await;
                Ok(true)
            }
            Ok(Err(s)) => Err(RuntimeError::containerd("version", s)),
            Err(_) => Err(RuntimeError::Timeout {
                op: "version",
                id: "containerd".to_owned(),
                timeout: SHIM_PROBE_TIMEOUT,
            }),
        }
    }

    /// Waits, for at most [`DEAD_SHIM_CLEANUP_TIMEOUT`], until containerd
    /// has cleaned up `tasks` after their shim died: each is gone from its
    /// task list and its bundle from `bundles` (containerd removes a bundle
    /// once the shim's `delete` has unmounted its rootfs), so that what
    /// runs next finds nothing of them.
    async fn dead_shim_cleaned_up(&self, tasks: &[String], bundles: Option<&Path>) {
        let deadline = tokio::time::Instant::now() + DEAD_SHIM_CLEANUP_TIMEOUT;
        for id in tasks {
            loop {
                let listed = !matches!(
                    tokio::time::timeout_at(deadline, self.get_task(id)).await,
                    Ok(Ok(None))
                );
                let bundle = bundles.is_some_and(|b| b.join(id).exists());
                if !listed && !bundle {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    tracing::warn!(task = %id, listed, bundle, "containerd has not cleaned up after a killed shim");
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// Whether containerd knows the status of none of `tasks` within
    /// [`SHIM_PROBE_TIMEOUT`] each, and at least one exists.
    async fn no_task_state(&self, tasks: &[String]) -> Result<bool, RuntimeError> {
        let mut unanswered = 0;
        for id in tasks {
            match tokio::time::timeout(SHIM_PROBE_TIMEOUT, self.get_task(id)).await {
                Err(_) => unanswered += 1,
                Ok(Ok(Some(p))) if p.status == TaskStatus::Unknown as i32 => unanswered += 1,
                Ok(Ok(Some(_))) => return Ok(false),
                Ok(Ok(None)) => {}
                Ok(Err(e)) => return Err(e),
            }
        }
        Ok(unanswered > 0)
    }

    /// Kills the shim of task group `group` when this agent started it (see
    /// [`ContainerRuntime::unwedge_shim`]). `None` when none was killed,
    /// else the directory of its tasks' bundles (the parent of the shim's
    /// working directory, its group's bundle), if it could be read.
    async fn kill_wedged_shim(&self, group: &str) -> Result<Option<Option<PathBuf>>, RuntimeError> {
        let scanned = self.scan_shims().await?;
        let Some((shim, _)) = scanned
            .into_iter()
            .find(|(s, owned)| *owned && s.id == group)
        else {
            return Ok(None);
        };
        // Only the link's text, of a shim whose identity was just checked
        // (and again after): nothing is read through it.
        let bundles = std::fs::read_link(format!("/proc/{}/cwd", shim.pid()))
            .ok()
            .filter(|_| alive(shim.identity))
            .and_then(|cwd| cwd.parent().map(Path::to_path_buf));
        tracing::warn!(pid = shim.pid(), id = %shim.id, "killing a shim that answers nothing");
        if !stop(shim.identity).await {
            return Ok(None);
        }
        self.shim_ledger().forget(&shim.id);
        Ok(Some(bundles))
    }
}

/// Stops `shim`: its own `Shutdown` (on its socket under `socket_dir`)
/// where it answers and then exits, else by a pidfd. How it went, or `None`
/// if it is still running.
pub async fn stop_shim(shim: &Shim, namespace: &str, socket_dir: &Path) -> Option<Stopped> {
    let sockets = shim_sockets(shim, namespace, socket_dir);
    let mut how = None;
    for socket in &sockets {
        match ttrpc::shutdown_shim(socket, namespace, &shim.id, SHUTDOWN_CALL_TIMEOUT).await {
            Ok(()) => {
                if exits_within(shim.identity, SHUTDOWN_EXIT_WAIT).await {
                    how = Some(Stopped::Shutdown);
                } else {
                    // The runc shim answers but stays while it still serves
                    // a container.
                    tracing::warn!(pid = shim.pid(), id = %shim.id, "shim answered shutdown but is still running; signalling it");
                }
                break;
            }
            Err(e) => {
                tracing::debug!(pid = shim.pid(), id = %shim.id, socket = %socket.display(), error = %e, "shim did not take a shutdown")
            }
        }
    }
    if how.is_none() && stop(shim.identity).await {
        how = Some(Stopped::Signal);
    }
    let how = how?;
    tracing::info!(
        pid = shim.pid(),
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

/// Whether the process `identity` names is gone within `limit`.
async fn exits_within(identity: ProcessIdentity, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if !alive(identity) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A pidfd of the process `identity` names, opened and then checked to
/// still be that process (so a recycled pid is never signalled).
fn pidfd(identity: ProcessIdentity) -> Option<std::os::fd::OwnedFd> {
    let pid = rustix::process::Pid::from_raw(identity.pid)?;
    let fd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()?;
    alive(identity).then_some(fd)
}

/// `SIGTERM`, then `SIGKILL` after [`SHUTDOWN_GRACE`], through a pidfd;
/// whether it is gone.
async fn stop(identity: ProcessIdentity) -> bool {
    use rustix::process::{pidfd_send_signal, Signal};
    let Some(fd) = pidfd(identity) else {
        return !alive(identity);
    };
    if pidfd_send_signal(&fd, Signal::TERM).is_err() {
        return !alive(identity);
    }
    if exits_within(identity, SHUTDOWN_GRACE).await {
        return true;
    }
    tracing::warn!(pid = identity.pid, "shim ignored SIGTERM; killing it");
    let _ = pidfd_send_signal(&fd, Signal::KILL);
    exits_within(identity, Duration::from_secs(1)).await
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
        let me = identity(std::process::id() as i32).unwrap();
        assert!(alive(me));
        assert!(!alive(ProcessIdentity {
            start_ticks: me.start_ticks + 1,
            ..me
        }));
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", std::process::id())).unwrap();
        assert_eq!(parse_cmdline(&cmdline), None);
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

    #[test]
    fn ledger_entries_read_back_and_bad_ids_are_never_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = ShimLedger::new(dir.path().join("shims"));
        let me = identity(std::process::id() as i32).unwrap();
        ledger.record("abc", me).unwrap();
        ledger.intend("def").unwrap();
        assert!(ledger.record("../escape", me).is_err());
        assert!(ledger.record(".hidden", me).is_err());
        let entries = ledger.entries();
        assert_eq!(entries.get("abc"), Some(&LedgerEntry::Shim(me)));
        assert!(matches!(
            entries.get("def"),
            Some(LedgerEntry::Intent { .. })
        ));
        assert_eq!(entries.len(), 2);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(ledger.dir())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        // A record whose process is gone is pruned; a live one stays.
        ledger
            .record(
                "gone",
                ProcessIdentity {
                    start_ticks: me.start_ticks + 1,
                    ..me
                },
            )
            .unwrap();
        let entries = ledger.entries();
        ledger.prune(&entries, &[], now_ticks().unwrap());
        let left = ledger.entries();
        assert!(left.contains_key("abc") && left.contains_key("def"));
        assert!(!left.contains_key("gone"));
    }

    fn shim(identity: ProcessIdentity, id: &str) -> Shim {
        Shim {
            identity,
            id: id.into(),
            age: ORPHAN_MIN_AGE,
            containerd_address: Some("/nonexistent/containerd.sock".into()),
            in_our_pid_ns: true,
        }
    }

    /// The attack: a process that has a shim's command line for a task id
    /// the ledger has no shim of is not the agent's; one whose pid or start
    /// time differ from the record is not either; only the recorded one is.
    #[test]
    fn only_a_shim_the_agent_recorded_is_its_own() {
        let me = identity(std::process::id() as i32).unwrap();
        let s = shim(me, "abc");
        assert!(!owns(None, &s), "a command line alone proves nothing");
        assert!(owns(Some(&LedgerEntry::Shim(me)), &s));
        let recycled = ProcessIdentity {
            start_ticks: me.start_ticks + 5,
            ..me
        };
        assert!(!owns(Some(&LedgerEntry::Shim(recycled)), &s));
        // An intent: a shim started after it, in our pid namespace, only.
        let intent = |not_before| LedgerEntry::Intent { not_before };
        assert!(owns(Some(&intent(me.start_ticks)), &s));
        assert!(!owns(Some(&intent(me.start_ticks + 1)), &s));
        let late = INTENT_WINDOW.as_secs() * clock_ticks() + 1;
        assert!(!owns(
            Some(&intent(me.start_ticks.saturating_sub(late))),
            &s
        ));
        let other_ns = Shim {
            in_our_pid_ns: false,
            ..s.clone()
        };
        assert!(!owns(Some(&intent(me.start_ticks)), &other_ns));
    }

    /// Held by each test that starts a stand-in shim, for all of it. A
    /// child forked by a test on another thread holds a copy of every fd of
    /// this process until it execs, so a listener one test drops could still
    /// take connections for that moment and its socket would not look stale.
    static STAND_INS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// A stand-in shim: a sleeping python running in `cwd` with the command line of a
    /// shim of `namespace` for task `id`, reaped by a thread so that it does
    /// not stay a zombie.
    fn stand_in(
        cwd: &Path,
        namespace: &str,
        id: &str,
    ) -> (ProcessIdentity, std::thread::JoinHandle<()>) {
        use std::os::unix::process::CommandExt;
        // Debian's interpreter itself, which ignores the extra arguments.
        let mut child = std::process::Command::new("/usr/bin/python3")
            .arg0("containerd-shim-runc-v2")
            .args(["-c", "import time; time.sleep(600)"])
            .args(["-namespace", namespace, "-id", id])
            .args(["-address", "/nonexistent/containerd.sock"])
            .current_dir(cwd)
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let waiter = std::thread::spawn(move || {
            let _ = child.wait();
        });
        // Until it has exec'd and has the shim's command line.
        let cmdline = format!("/proc/{pid}/cmdline");
        for _ in 0..100 {
            if std::fs::read(&cmdline)
                .ok()
                .and_then(|c| parse_cmdline(&c))
                .is_some()
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let identity = identity(pid).unwrap();
        (identity, waiter)
    }

    #[tokio::test]
    async fn a_shim_that_answers_is_stopped_by_its_own_shutdown() {
        let _serial = STAND_INS.lock().await;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let bundle = tempfile::tempdir().unwrap();
        let sockets = tempfile::tempdir().unwrap();
        let socket = derived_socket_in(
            sockets.path(),
            "/nonexistent/containerd.sock",
            "ns",
            "orphan",
        );
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let (me, waiter) = stand_in(bundle.path(), "ns", "orphan");
        let pid = me.pid;
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
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .unwrap();
        });
        let shim = shim(me, "orphan");
        assert_eq!(
            shim_sockets(&shim, "ns", sockets.path()),
            vec![SocketAddress::Path(socket.clone())]
        );
        assert_eq!(
            stop_shim(&shim, "ns", sockets.path()).await,
            Some(Stopped::Shutdown)
        );
        server.await.unwrap();
        waiter.join().unwrap();
        assert!(!socket.exists(), "the socket the shim left is removed");
    }

    #[tokio::test]
    async fn a_shim_without_a_socket_is_stopped_by_its_pid() {
        let _serial = STAND_INS.lock().await;
        let bundle = tempfile::tempdir().unwrap();
        let sockets = tempfile::tempdir().unwrap();
        let (me, waiter) = stand_in(bundle.path(), "ns", "orphan");
        let shim = shim(me, "orphan");
        assert!(shim_sockets(&shim, "ns", sockets.path()).is_empty());
        assert_eq!(
            stop_shim(&shim, "ns", sockets.path()).await,
            Some(Stopped::Signal)
        );
        waiter.join().unwrap();
    }

    /// The attack of issue 30: a fake shim whose working directory holds an
    /// `address` that is a FIFO (the old reaper blocked for ever opening it)
    /// or a symlink to `/dev/zero` (it read without end). The scan returns
    /// at once, the fake is not the agent's, and it is left running.
    #[tokio::test]
    async fn a_fake_shim_with_a_fifo_or_dev_zero_address_is_listed_fast_and_left_alone() {
        let _serial = STAND_INS.lock().await;
        let namespace = format!("fake-shim-test-{}", std::process::id());
        let fifo_dir = tempfile::tempdir().unwrap();
        nix::unistd::mkfifo(
            &fifo_dir.path().join("address"),
            nix::sys::stat::Mode::S_IRWXU,
        )
        .unwrap();
        let zero_dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/dev/zero", zero_dir.path().join("address")).unwrap();
        let (fifo_shim, w1) = stand_in(fifo_dir.path(), &namespace, "fifo");
        let (zero_shim, w2) = stand_in(zero_dir.path(), &namespace, "zero");
        let state = tempfile::tempdir().unwrap();
        let ledger = ShimLedger::new(state.path().join(LEDGER_DIR));
        let ns = namespace.clone();
        let found = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::task::spawn_blocking(move || list_shims(&ns)),
        )
        .await
        .expect("listing shims does not hang on a FIFO")
        .unwrap();
        assert_eq!(found.len(), 2, "{found:?}");
        for s in &found {
            assert!(s.in_our_pid_ns);
            assert!(!owns(ledger.entries().get(&s.id), s), "{s:?}");
            // The only socket tried is containerd's derived one.
            assert!(shim_sockets(s, &namespace, state.path()).is_empty());
        }
        assert!(alive(fifo_shim) && alive(zero_shim));
        for me in [fifo_shim, zero_shim] {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(me.pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .unwrap();
        }
        w1.join().unwrap();
        w2.join().unwrap();
    }
}
