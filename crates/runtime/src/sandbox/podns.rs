//! Pod namespaces without an infra process: a sandbox's IPC and UTS
//! namespaces, made on a dedicated thread and pinned by bind mounts, as the
//! network providers pin the pod's network namespace.
//!
//! `unshare` acts on the calling thread, so each sandbox's namespaces are
//! made on a fresh OS thread that unshares them, sets the pod's hostname in
//! its new UTS namespace, bind-mounts `/proc/thread-self/ns/{ipc,uts}` onto
//! the pin files and exits: no async task ever runs on a thread that changed
//! namespace. A warm-pool shell's hostname, set when its pod claims it, is
//! the one exception to a fresh thread: one long-lived thread that does
//! nothing else joins the shell's UTS namespace, sets the name and joins
//! its own again, so a claim starts no thread.
//!
//! The pins are `<dir>/<sandbox id>/{ipc,uts}`. A sandbox's directory
//! exists from the first thing its create does to the last thing its
//! teardown does, so a crash anywhere in between leaves something that
//! teardown, recovery and the GC find by the sandbox id alone, and its
//! presence says the sandbox's namespaces are alive (also for a pod that
//! shares every namespace with the node and so has no pin at all).
//!
//! No `unsafe` is needed here: `nix` wraps the system calls safely.

use std::collections::{HashMap, HashSet};
use std::fs::{self, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cubelet_engine::spec::SandboxProcess;
use cubelet_engine::SandboxId;
use nix::errno::Errno;
use nix::mount::{mount, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};

use crate::error::RuntimeError;

/// File name of the IPC namespace pin in a sandbox's directory.
pub const IPC_PIN: &str = "ipc";
/// File name of the UTS namespace pin in a sandbox's directory.
pub const UTS_PIN: &str = "uts";

/// The namespaces a sandbox without an infra process asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PinRequest {
    /// A new IPC namespace (false: the pod uses the node's).
    pub ipc: bool,
    /// A new UTS namespace with this hostname (`None`: the node's, as for
    /// host-network pods).
    pub hostname: Option<String>,
}

/// Where a sandbox's namespaces are pinned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pins {
    /// The sandbox's directory.
    pub dir: PathBuf,
    /// The IPC namespace pin, when one was asked for.
    pub ipc: Option<PathBuf>,
    /// The UTS namespace pin, when one was asked for.
    pub uts: Option<PathBuf>,
}

/// One lock per sandbox whose pins a thread is making.
type Making = Arc<Mutex<HashMap<SandboxId, Arc<tokio::sync::Mutex<()>>>>>;

/// The pins of every sandbox without an infra process, under one directory.
/// Cheap to clone; clones share their bookkeeping.
#[derive(Debug, Clone)]
pub struct PodNamespaces {
    dir: PathBuf,
    /// Held by the thread making a sandbox's pins until it is done, also
    /// when the create that started it was dropped (a cancelled flow, a
    /// step cut short); [`PodNamespaces::remove`] waits for it, so a
    /// rollback never runs beside the creation it undoes and leaves pins
    /// that thread makes after it.
    making: Making,
    /// The thread that sets claimed shells' hostnames.
    uts: Arc<UtsWorker>,
}

impl PodNamespaces {
    /// Pins under `dir` (`<state_dir>/podns`).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            making: Arc::default(),
            uts: Arc::default(),
        }
    }

    fn making(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Arc<tokio::sync::Mutex<()>>>> {
        // Nothing panics while holding it (map inserts and removals only).
        self.making.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The directory every sandbox's pins are under.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The directory of `id`'s pins.
    pub fn sandbox_dir(&self, id: &SandboxId) -> PathBuf {
        self.dir.join(id.as_str())
    }

    /// Creates the directory and makes it a mount point with shared
    /// propagation (as `ip netns` does for `/run/netns`), so that a pin
    /// unmounted here also leaves the mount namespaces that were copied
    /// while it existed. Idempotent.
    pub fn prepare(&self) -> Result<(), RuntimeError> {
        Ok(cubelet_host::pins::prepare_dir(&self.dir)?)
    }

    /// Makes `id`'s namespaces as `req` asks, on a thread of their own, and
    /// pins them. Pins that already exist are kept; on failure nothing of
    /// the sandbox is left (its directory and every pin in it removed).
    ///
    /// The work runs to its end on its thread even if this future is
    /// dropped; [`PodNamespaces::remove`] waits for it.
    pub async fn create(&self, id: &SandboxId, req: &PinRequest) -> Result<Pins, RuntimeError> {
        let lock = Arc::clone(self.making().entry(id.clone()).or_default());
        let held = lock.lock_owned().await;
        let dir = self.sandbox_dir(id);
        let req = req.clone();
        let what = dir.display().to_string();
        let making = Arc::clone(&self.making);
        let id = id.clone();
        on_thread(what, move || {
            let made = create_blocking(&dir, &req);
            if made.is_err() {
                if let Err(e) = remove_blocking(&dir) {
                    tracing::warn!(dir = %dir.display(), error = %cubelet_engine::chain(&e), "removing the pins of a failed create");
                }
            }
            // Done: a removal from now on has nothing to wait for.
            making
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
            drop(held);
            made
        })
        .await
    }

    /// Sets `hostname` in `id`'s pinned UTS namespace (a warm-pool shell's,
    /// made before its pod was known). A claim is on the pod's path, so
    /// this runs on one long-lived thread (see `UtsWorker`) rather than
    /// on a thread started for it; if that thread is gone, on a fresh one
    /// that joins the namespace, sets the name and exits.
    pub async fn set_hostname(&self, id: &SandboxId, hostname: &str) -> Result<(), RuntimeError> {
        let pin = self.sandbox_dir(id).join(UTS_PIN);
        if let Some(done) = self.uts.submit(&pin, hostname) {
            if let Ok(result) = done.await {
                return result;
            }
        }
        let hostname = hostname.to_owned();
        on_thread(pin.display().to_string(), move || {
            // This thread now lives in the pod's UTS namespace and exits
            // right after.
            enter_uts(&pin)?;
            set_hostname_of(&pin, &hostname)
        })
        .await
    }

    /// Unmounts and deletes `id`'s pins and directory, after any creation of
    /// them still in flight. Returns whether there was anything; nothing is
    /// fine (idempotent).
    pub async fn remove(&self, id: &SandboxId) -> Result<bool, RuntimeError> {
        let in_flight = self.making().get(id).cloned();
        let _settled = match &in_flight {
            Some(lock) => Some(lock.lock().await),
            None => None,
        };
        let dir = self.sandbox_dir(id);
        cubelet_engine::blocking(|| remove_blocking(&dir))
    }

    /// Removes the pins of every sandbox not in `keep()`. Only entries named
    /// by a sandbox id in Cubelet's own format are considered
    /// ([`cubelet_host::pins::own_id`]): anything else in the directory is
    /// not Cubelet's and is left alone. `keep` is asked after the
    /// directory has been listed (see [`cubelet_engine::LiveSandboxes`]);
    /// when it returns `None` nothing is removed. Returns how many
    /// sandboxes' pins were removed; a missing directory holds none.
    pub fn remove_except(
        &self,
        keep: impl FnOnce() -> Option<HashSet<SandboxId>>,
    ) -> Result<usize, RuntimeError> {
        let found = cubelet_host::pins::entries(&self.dir)?;
        if found.is_empty() {
            return Ok(0);
        }
        let Some(keep) = keep() else {
            return Ok(0);
        };
        let mut removed = 0;
        for (path, id) in found {
            if keep.contains(&id) {
                continue;
            }
            let gone = if path.is_dir() {
                remove_blocking(&path)?
            } else {
                remove_pin(&path)?
            };
            if gone {
                removed += 1;
            }
        }
        Ok(removed)
    }
}

/// True when `path` is a mounted namespace (an nsfs bind mount).
pub fn is_pinned(path: &Path) -> bool {
    cubelet_host::pins::is_pinned(path)
}

/// Whether the namespaces of a sandbox without an infra process are still
/// there: its directory exists and every pin it was given is mounted.
/// Always false for a sandbox with an infra process (ask the runtime about
/// its task instead).
pub fn pins_alive(process: &SandboxProcess) -> bool {
    process.is_infraless()
        && process.pins_dir.as_deref().is_some_and(Path::is_dir)
        && [&process.ipc_path, &process.uts_path]
            .into_iter()
            .flatten()
            .all(|p| is_pinned(p))
}

fn create_blocking(dir: &Path, req: &PinRequest) -> Result<Pins, RuntimeError> {
    fs::create_dir_all(dir).map_err(|e| io_err("create directory", dir, e))?;
    let ipc = req.ipc.then(|| dir.join(IPC_PIN));
    let uts = req.hostname.as_ref().map(|_| dir.join(UTS_PIN));
    let mut flags = CloneFlags::empty();
    let mut todo = Vec::new();
    for (pin, flag, ns) in [
        (&ipc, CloneFlags::CLONE_NEWIPC, IPC_PIN),
        (&uts, CloneFlags::CLONE_NEWUTS, UTS_PIN),
    ] {
        let Some(pin) = pin.as_deref().filter(|p| !is_pinned(p)) else {
            continue;
        };
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(pin)
            .map_err(|e| io_err("create pin", pin, e))?;
        flags |= flag;
        todo.push((pin, ns));
    }
    if flags.is_empty() {
        return Ok(Pins {
            dir: dir.to_path_buf(),
            ipc,
            uts,
        });
    }
    // This thread now gets namespaces of its own and exits right after.
    unshare(flags).map_err(|e| ns_err("unshare namespaces for", dir, e))?;
    if flags.contains(CloneFlags::CLONE_NEWUTS) {
        if let Some(hostname) = &req.hostname {
            set_hostname_of(dir, hostname)?;
        }
    }
    for (pin, ns) in todo {
        mount(
            Some(Path::new("/proc/thread-self/ns").join(ns).as_path()),
            pin,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|e| ns_err("bind mount namespace on", pin, e))?;
    }
    Ok(Pins {
        dir: dir.to_path_buf(),
        ipc,
        uts,
    })
}

/// Unmounts and deletes every pin in `dir`, then `dir`. Whether anything
/// was there.
fn remove_blocking(dir: &Path) -> Result<bool, RuntimeError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err("read", dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| io_err("read", dir, e))?;
        remove_pin(&entry.path())?;
    }
    match fs::remove_dir(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(io_err("remove", dir, e)),
    }
}

/// Unmounts and deletes one pin. Whether there was anything.
fn remove_pin(pin: &Path) -> Result<bool, RuntimeError> {
    Ok(cubelet_host::pins::remove_pin(pin)?)
}

/// A hostname for the UTS namespace pinned at `pin`, and where to answer.
struct HostnameJob {
    pin: PathBuf,
    hostname: String,
    done: tokio::sync::oneshot::Sender<Result<(), RuntimeError>>,
}

/// One OS thread, started at the first claim, that sets hostnames in
/// pinned UTS namespaces: it joins a pod's namespace, sets the name and
/// joins its own again, so a claim costs no thread start (a `clone`, a
/// stack mapped and unmapped, on every pod start). The thread does nothing
/// else, so nothing ever runs in a pod's namespace but `sethostname`. If it
/// cannot get back to its own namespace it answers and exits; the next
/// hostname starts another. It ends when the [`PodNamespaces`] it belongs
/// to is dropped (the channel closes).
#[derive(Debug, Default)]
struct UtsWorker {
    jobs: Mutex<Option<std::sync::mpsc::Sender<HostnameJob>>>,
}

impl UtsWorker {
    /// Hands `hostname` for `pin` to the thread, starting it if needed;
    /// the answer arrives on the returned channel. `None` when no thread
    /// can be started (the caller then uses one of its own).
    fn submit(
        &self,
        pin: &Path,
        hostname: &str,
    ) -> Option<tokio::sync::oneshot::Receiver<Result<(), RuntimeError>>> {
        let (done, answer) = tokio::sync::oneshot::channel();
        let mut job = HostnameJob {
            pin: pin.to_owned(),
            hostname: hostname.to_owned(),
            done,
        };
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = jobs.as_ref() {
            match tx.send(job) {
                Ok(()) => return Some(answer),
                // The thread exited: start another.
                Err(std::sync::mpsc::SendError(back)) => job = back,
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("cubelet-uts".into())
            .spawn(move || uts_worker(&rx))
            .ok()?;
        let sent = tx.send(job).is_ok();
        *jobs = Some(tx);
        sent.then_some(answer)
    }
}

/// The body of the [`UtsWorker`] thread.
fn uts_worker(jobs: &std::sync::mpsc::Receiver<HostnameJob>) {
    let home = match fs::File::open("/proc/thread-self/ns/uts") {
        Ok(home) => home,
        Err(e) => {
            // Without a way back, take no job: the one waiting is dropped
            // and its caller uses a thread of its own.
            tracing::warn!(error = %e, "hostname thread cannot open its own UTS namespace");
            return;
        }
    };
    for job in jobs {
        let (result, home_again) = set_hostname_in(&job.pin, &job.hostname, &home);
        let _ = job.done.send(result);
        if !home_again {
            tracing::warn!(pin = %job.pin.display(), "hostname thread could not rejoin its UTS namespace; it exits");
            return;
        }
    }
}

/// Joins the UTS namespace pinned at `pin`, sets `hostname` in it and
/// rejoins `home`. The result, and whether the thread is in `home` again.
fn set_hostname_in(
    pin: &Path,
    hostname: &str,
    home: &fs::File,
) -> (Result<(), RuntimeError>, bool) {
    if let Err(e) = enter_uts(pin) {
        return (Err(e), true);
    }
    let set = set_hostname_of(pin, hostname);
    let home_again = setns(home, CloneFlags::CLONE_NEWUTS).is_ok();
    (set, home_again)
}

/// Moves the calling thread into the UTS namespace pinned at `pin`; on
/// failure it stays where it was.
fn enter_uts(pin: &Path) -> Result<(), RuntimeError> {
    let ns = fs::File::open(pin).map_err(|e| io_err("open namespace pin", pin, e))?;
    setns(&ns, CloneFlags::CLONE_NEWUTS).map_err(|e| ns_err("enter the UTS namespace", pin, e))
}

/// Sets `hostname` in the calling thread's UTS namespace, the one at
/// `path` (named in the error).
fn set_hostname_of(path: &Path, hostname: &str) -> Result<(), RuntimeError> {
    nix::unistd::sethostname(hostname).map_err(|e| ns_err("set the hostname in", path, e))
}

/// Runs blocking `work` on a fresh OS thread (which inherits the caller's
/// namespaces and leaves with its own) and awaits its result without
/// blocking the executor.
async fn on_thread<T, W>(what: String, work: W) -> Result<T, RuntimeError>
where
    W: FnOnce() -> Result<T, RuntimeError> + Send + 'static,
    T: Send + 'static,
{
    cubelet_host::pins::on_thread("cubelet-podns", what, work).await
}

fn io_err(op: &'static str, path: &Path, source: io::Error) -> RuntimeError {
    RuntimeError::Io {
        op,
        path: path.display().to_string(),
        source,
    }
}

fn ns_err(op: &'static str, path: &Path, source: Errno) -> RuntimeError {
    RuntimeError::Namespace {
        op,
        path: path.display().to_string(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(dir: &Path, ipc: bool) -> SandboxProcess {
        SandboxProcess {
            pid: None,
            runtime_handler: "runc".into(),
            ipc_path: ipc.then(|| dir.join(IPC_PIN)),
            uts_path: None,
            pins_dir: Some(dir.to_path_buf()),
        }
    }

    #[test]
    fn a_sandbox_with_an_infra_process_is_never_alive_by_its_pins() {
        let tmp = tempfile::tempdir().unwrap();
        let mut p = process(tmp.path(), false);
        assert!(pins_alive(&p), "no pins asked for: the directory is enough");
        p.pid = Some(1);
        assert!(!pins_alive(&p));
    }

    #[test]
    fn pins_are_alive_only_while_mounted_and_the_directory_exists() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a");
        std::fs::create_dir(&dir).unwrap();
        // A plain file where the pin should be is not a namespace.
        std::fs::write(dir.join(IPC_PIN), b"").unwrap();
        assert!(!pins_alive(&process(&dir, true)));
        assert!(pins_alive(&process(&dir, false)));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(!pins_alive(&process(&dir, false)));
    }

    #[tokio::test]
    async fn removing_unmounted_leftovers_is_idempotent() {
        let tmp = tempfile::tempdir().unwrap();
        let pods = PodNamespaces::new(tmp.path());
        let id = SandboxId::new_unchecked("abc");
        assert!(!pods.remove(&id).await.unwrap(), "nothing there");
        let dir = pods.sandbox_dir(&id);
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join(UTS_PIN), b"").unwrap();
        assert!(pods.remove(&id).await.unwrap());
        assert!(!dir.exists());
        assert!(!pods.remove(&id).await.unwrap());
    }

    #[test]
    fn the_gc_keeps_live_sandboxes_and_asks_only_after_listing() {
        let tmp = tempfile::tempdir().unwrap();
        let pods = PodNamespaces::new(tmp.path().join("podns"));
        // A missing directory holds nothing, and keep is not asked.
        assert_eq!(pods.remove_except(|| panic!("asked")).unwrap(), 0);
        let (live, dead) = ("a".repeat(64), "d".repeat(64));
        for id in [&live, &dead] {
            std::fs::create_dir_all(pods.sandbox_dir(&SandboxId::new_unchecked(id))).unwrap();
        }
        // Not in Cubelet's id format: someone else's, never removed.
        std::fs::write(pods.dir().join("Not An Id"), b"").unwrap();
        std::fs::create_dir(pods.dir().join("live")).unwrap();
        assert_eq!(pods.remove_except(|| None).unwrap(), 0, "store unreadable");
        let keep = || Some([SandboxId::new_unchecked(&live)].into_iter().collect());
        assert_eq!(pods.remove_except(keep).unwrap(), 1);
        let mut left: Vec<_> = std::fs::read_dir(pods.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "Not An Id",
                "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                "live"
            ]
        );
    }
}
