//! Network namespaces: create and pin, run netlink inside, remove.
//!
//! This is the only module that changes a thread's namespace. `unshare` and
//! `setns` act on the calling thread, so every namespace operation runs on a
//! dedicated OS thread that does its work and exits; no async task ever runs
//! on a thread that changed namespace, and no namespace is held across an
//! `.await` of the caller. Pins are bind mounts of `/proc/thread-self/ns/net`
//! on files under the provider's `netns` directory, like `ip netns add`.
//!
//! No `unsafe` is needed here: `nix` wraps the system calls safely.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use cubelet_engine::spec::{NetworkStatus, UserNamespace};
use cubelet_engine::SandboxId;
use nix::mount::{mount, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};
use rtnetlink::LinkUnspec;

use crate::error::NetworkError;
use tracing::Instrument;

/// Makes `dir` a mount point with shared propagation, as `ip netns` does for
/// `/run/netns` (see [`cubelet_host::pins::prepare_dir`]).
pub(crate) fn prepare_dir(dir: &Path) -> Result<(), NetworkError> {
    Ok(cubelet_host::pins::prepare_dir(dir)?)
}

/// True when `pin` is a mounted namespace.
pub(crate) fn is_pinned(pin: &Path) -> bool {
    cubelet_host::pins::is_pinned(pin)
}

/// One lock per pin whose creating thread is still running.
type Making = HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>;

/// Pins being made. A create whose future is dropped (a cancelled flow, a
/// step cut short) leaves its thread running, and that thread may pin the
/// namespace after the rollback removed the pin; the thread therefore holds
/// its pin's lock until it is done and [`remove`] waits for it. Namespaces
/// are a process-wide resource, so the table is too.
static MAKING: LazyLock<Mutex<Making>> = LazyLock::new(Mutex::default);

fn making() -> MutexGuard<'static, Making> {
    // Nothing panics while holding it (map lookups, inserts and removals).
    MAKING.lock().unwrap_or_else(|p| p.into_inner())
}

/// Forgets `pin`'s lock once nobody holds or waits for it.
fn settle(pin: &Path) {
    let mut making = making();
    if making.get(pin).is_some_and(|l| Arc::strong_count(l) == 1) {
        making.remove(pin);
    }
}

/// Creates a network namespace pinned at `pin`. An existing pin is kept.
/// With `userns`, the network namespace is owned by a new user namespace
/// with those mappings, pinned beside it ([`crate::userns`]); its pin is
/// returned.
///
/// The work runs to its end on its thread even if this future is dropped;
/// [`remove`] waits for it.
pub(crate) async fn create(
    pin: PathBuf,
    userns: Option<UserNamespace>,
) -> Result<Option<PathBuf>, NetworkError> {
    let lock = Arc::clone(making().entry(pin.clone()).or_default());
    let held = lock.lock_owned().await;
    let what = pin.display().to_string();
    on_thread(what, move || {
        let made = match userns {
            None => create_blocking(&pin).map(|()| None),
            Some(mapping) => {
                let user_pin = crate::userns::pin_for(&pin);
                crate::userns::create_blocking(&pin, &user_pin, &mapping).map(|()| Some(user_pin))
            }
        };
        drop(held);
        settle(&pin);
        made
    })
    .await
}

fn create_blocking(pin: &Path) -> Result<(), NetworkError> {
    if is_pinned(pin) {
        return Ok(());
    }
    if let Some(dir) = pin.parent() {
        fs::create_dir_all(dir).map_err(|e| NetworkError::io("create directory", dir, e))?;
    }
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(pin)
        .map_err(|e| NetworkError::io("create pin", pin, e))?;
    // This thread now gets a namespace of its own and exits right after.
    let pinned = unshare(CloneFlags::CLONE_NEWNET)
        .map_err(|e| NetworkError::nix("unshare network namespace for", pin, e))
        .and_then(|()| {
            mount(
                Some("/proc/thread-self/ns/net"),
                pin,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(|e| NetworkError::nix("bind mount netns on", pin, e))
        });
    if pinned.is_err() {
        let _ = fs::remove_file(pin);
    }
    pinned
}

/// Unmounts and deletes the netns pin and the user-namespace pin beside it
/// (pods with a user namespace of their own have one), after any creation
/// of them still in flight. Returns whether there was anything to remove;
/// missing pins are fine.
pub(crate) async fn remove(pin: &Path) -> Result<bool, NetworkError> {
    let in_flight = making().get(pin).cloned();
    if let Some(lock) = in_flight {
        drop(lock.lock().await);
        drop(lock);
        settle(pin);
    }
    remove_now(pin)
}

/// [`remove`] without waiting: for the creating thread's own cleanup.
pub(crate) fn remove_now(pin: &Path) -> Result<bool, NetworkError> {
    let net = remove_pin(pin)?;
    let user = remove_pin(&crate::userns::pin_for(pin))?;
    Ok(net || user)
}

/// Unmounts and deletes one pin (see [`cubelet_host::pins::remove_pin`]).
pub(crate) fn remove_pin(pin: &Path) -> Result<bool, NetworkError> {
    Ok(cubelet_host::pins::remove_pin(pin)?)
}

/// What a pod in the node's own namespace publishes: no pin, no interface,
/// and the node's primary IPv4 address when it has one.
pub(crate) async fn host_network_status() -> NetworkStatus {
    NetworkStatus {
        netns_path: None,
        ips: crate::bridge::host_primary_ipv4()
            .await
            .map(IpAddr::V4)
            .into_iter()
            .collect(),
        interface: None,
        userns_path: None,
    }
}

/// Removes every pin in `dir`, and in the user-namespace pin directory
/// beside it, that belongs to no sandbox in `keep()`. Only pins whose names
/// are in Cubelet's own id format ([`cubelet_host::pins::own_id`]) are considered: any
/// other file there is not Cubelet's and is left alone. `keep` is asked
/// after both have been listed (see [`cubelet_engine::LiveSandboxes`]);
/// when it returns `None` nothing is removed. Returns how many were
/// removed; a missing directory holds none.
pub(crate) fn remove_pins_except(
    dir: &Path,
    keep: impl FnOnce() -> Option<HashSet<SandboxId>>,
) -> Result<usize, NetworkError> {
    let userns_dir = crate::userns::dir_for(dir);
    let found: Vec<(PathBuf, SandboxId)> = cubelet_host::pins::entries(dir)?
        .into_iter()
        .chain(cubelet_host::pins::entries(&userns_dir)?)
        .collect();
    if found.is_empty() {
        return Ok(0);
    }
    let Some(keep) = keep() else {
        return Ok(0);
    };
    let mut removed = 0;
    for (path, id) in found {
        if !keep.contains(&id) && remove_pin(&path)? {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Brings the loopback interface up inside the namespace pinned at `pin`
/// (a new namespace starts with `lo` down). Idempotent.
pub(crate) async fn loopback_up(pin: PathBuf) -> Result<(), NetworkError> {
    with_netlink(pin, |h| async move { link_up(&h, "lo").await }).await
}

/// Sets link `name` up through `h` (inside [`with_netlink`], the link of
/// that namespace). Idempotent.
pub(crate) async fn link_up(h: &rtnetlink::Handle, name: &str) -> Result<(), NetworkError> {
    h.link()
        .set(LinkUnspec::new_with_name(name).up().build())
        .execute()
        .await
        .map_err(|e| NetworkError::netlink("set up", name, e))
}

/// Runs `f` with an rtnetlink handle whose socket lives in the namespace
/// pinned at `pin`. `f` runs to completion on a dedicated thread that entered
/// the namespace, with its own single-threaded runtime.
pub(crate) async fn with_netlink<F, Fut, T>(pin: PathBuf, f: F) -> Result<T, NetworkError>
where
    F: FnOnce(rtnetlink::Handle) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, NetworkError>>,
    T: Send + 'static,
{
    let what = pin.display().to_string();
    on_thread(what, move || {
        let ns = File::open(&pin).map_err(|e| NetworkError::io("open netns", &pin, e))?;
        if !is_pinned(&pin) {
            return Err(NetworkError::io(
                "enter netns",
                &pin,
                io::Error::new(io::ErrorKind::NotFound, "not a network namespace"),
            ));
        }
        setns(&ns, CloneFlags::CLONE_NEWNET)
            .map_err(|e| NetworkError::nix("enter netns", &pin, e))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(|e| NetworkError::io("start netns runtime for", &pin, e))?;
        rt.block_on(async move {
            // The socket is created here, on a thread inside the namespace,
            // so every request it carries acts on that namespace.
            let (conn, handle, _) = rtnetlink::new_connection()
                .map_err(|e| NetworkError::io("open netlink socket in", &pin, e))?;
            let conn = tokio::spawn(conn.in_current_span());
            let out = f(handle).await;
            conn.abort();
            out
        })
    })
    .await
}

/// Runs blocking `work` on a fresh OS thread (which inherits the caller's
/// namespaces) and awaits its result without blocking the executor.
async fn on_thread<T, W>(what: String, work: W) -> Result<T, NetworkError>
where
    W: FnOnce() -> Result<T, NetworkError> + Send + 'static,
    T: Send + 'static,
{
    cubelet_host::pins::on_thread("cubelet-netns", what, work).await
}

/// How long a connection inside a pod may take to be established.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn connect_local(port: u16) -> io::Result<std::net::TcpStream> {
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    match TcpStream::connect_timeout(&v4, CONNECT_TIMEOUT) {
        Ok(s) => Ok(s),
        Err(e4) => {
            let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
            TcpStream::connect_timeout(&v6, CONNECT_TIMEOUT).map_err(|_| e4)
        }
    }
}

/// Connects to `localhost:port` inside the network namespace pinned at
/// `netns` (the agent's own namespace when `None`), for port forwarding.
///
/// The socket is made on a fresh OS thread that enters the namespace,
/// connects and exits; the connected socket stays in the pod's namespace
/// whichever thread uses it afterwards.
pub async fn connect_in_netns(
    netns: Option<PathBuf>,
    port: u16,
) -> io::Result<tokio::net::TcpStream> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("cubelet-netns-dial".to_owned())
        .spawn(move || {
            let result = (|| {
                if let Some(ns) = &netns {
                    let f = File::open(ns).map_err(|e| {
                        io::Error::new(
                            e.kind(),
                            format!("open network namespace {}: {e}", ns.display()),
                        )
                    })?;
                    setns(&f, CloneFlags::CLONE_NEWNET).map_err(|e| {
                        io::Error::other(format!("enter network namespace {}: {e}", ns.display()))
                    })?;
                }
                connect_local(port)
            })();
            // The thread ends right after, so its namespace dies with it.
            let _ = tx.send(result);
        })?;
    let stream = rx
        .await
        .map_err(|_| io::Error::other("netns dial thread panicked"))??;
    stream.set_nonblocking(true)?;
    tokio::net::TcpStream::from_std(stream)
}

/// The text of `/proc/net/dev` as the network namespace pinned at `netns`
/// shows it, for the pod network stats of a sandbox with no process of its
/// own to read `/proc/<pid>/net/dev` of.
///
/// Read on a fresh OS thread that enters the namespace, reads its own
/// `/proc/thread-self/net/dev` (a thread's view follows its namespace) and
/// exits.
pub async fn net_dev_in_netns(netns: PathBuf) -> io::Result<String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("cubelet-netns-stats".to_owned())
        .spawn(move || {
            let result = (|| {
                let f = File::open(&netns).map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!("open network namespace {}: {e}", netns.display()),
                    )
                })?;
                setns(&f, CloneFlags::CLONE_NEWNET).map_err(|e| {
                    io::Error::other(format!("enter network namespace {}: {e}", netns.display()))
                })?;
                fs::read_to_string("/proc/thread-self/net/dev")
            })();
            // The thread ends right after, so its namespace dies with it.
            let _ = tx.send(result);
        })?;
    rx.await
        .map_err(|_| io::Error::other("netns stats thread panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn only_names_in_cubelets_id_format_are_its_pins() {
        let id = "0123456789abcdef".repeat(4);
        assert_eq!(
            cubelet_host::pins::own_id(OsStr::new(&id)).map(|i| i.to_string()),
            Some(id.clone())
        );
        let others = [
            "cni-1234".to_owned(),
            "Not-An-Id".to_owned(),
            "abc".to_owned(),
            id[..63].to_owned(),
            format!("{id}0"),
            "0123456789ABCDEF".repeat(4),
            "0123456789abcdeg".repeat(4),
        ];
        for other in &others {
            assert!(
                cubelet_host::pins::own_id(OsStr::new(other)).is_none(),
                "{other}"
            );
        }
    }

    #[test]
    fn foreign_files_in_the_pin_dir_are_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("netns");
        fs::create_dir(&dir).unwrap();
        let ours = "ab".repeat(32);
        let upper = "AB".repeat(32);
        let foreign = ["cni-5f2a", "README", upper.as_str()];
        for name in foreign.iter().chain([&ours.as_str()]) {
            fs::write(dir.join(name), b"").unwrap();
        }
        // Nothing live: only Cubelet's pin goes.
        let removed = remove_pins_except(&dir, || Some(HashSet::new())).unwrap();
        assert_eq!(removed, 1);
        for name in foreign {
            assert!(dir.join(name).exists(), "{name} removed");
        }
        assert!(!dir.join(&ours).exists());
    }
}
