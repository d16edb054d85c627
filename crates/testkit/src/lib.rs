//! Helpers shared by the workspace's tests and benches; a dev-dependency
//! only, never part of the agent.
//!
//! Tests that mount, pin namespaces or make links run on an OS thread of
//! their own that has left the node's mount namespace (and, when asked, its
//! network namespace) with `/` made recursively private: nothing they do
//! is seen on the node, and all of it goes with the thread, on a panic too.

use std::future::Future;

use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};

/// The namespaces a private thread leaves the node's for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Namespaces {
    /// A mount namespace of its own.
    Mount,
    /// A network and a mount namespace of its own (its `lo` is down).
    NetworkAndMount,
}

/// True when running as root; otherwise prints that `what` is skipped and
/// why, as every root-only test and bench does.
pub fn is_root(what: &str) -> bool {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        eprintln!("SKIPPED {what}: needs root (namespaces, mounts)");
    }
    root
}

/// Leaves the node's namespaces on the calling thread, making `/`
/// recursively private. For a thread of its own: the thread never goes
/// back. Fails when the thread may not (not root).
pub fn enter_private(ns: Namespaces) -> nix::Result<()> {
    let flags = match ns {
        Namespaces::Mount => CloneFlags::CLONE_NEWNS,
        Namespaces::NetworkAndMount => CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWNET,
    };
    unshare(flags)?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
}

/// Runs `f` on a fresh OS thread in private namespaces `ns` and returns
/// what it returns; a panic of `f` is resumed here. Panics when the
/// namespaces cannot be entered (check [`is_root`] first).
pub fn on_private_thread<R, F>(ns: Namespaces, f: F) -> R
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    let handle = std::thread::spawn(move || {
        if let Err(e) = enter_private(ns) {
            panic!("entering private {ns:?} namespaces: {e}");
        }
        f()
    });
    match handle.join() {
        Ok(r) => r,
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// [`on_private_thread`] running the future `f` makes on a current-thread
/// Tokio runtime of that thread, so every task it spawns (and every
/// process those start) is in the private namespaces too.
pub fn block_on_private<R, F, Fut>(ns: Namespaces, f: F) -> R
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = R>,
    R: Send + 'static,
{
    on_private_thread(ns, move || {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => panic!("a runtime for the private thread: {e}"),
        };
        rt.block_on(f())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_private_thread_returns_its_value_and_resumes_its_panic() {
        if !is_root("a_private_thread_returns_its_value_and_resumes_its_panic") {
            return;
        }
        let node = std::fs::read_link("/proc/thread-self/ns/mnt").unwrap();
        let inside = on_private_thread(Namespaces::Mount, || {
            std::fs::read_link("/proc/thread-self/ns/mnt").unwrap()
        });
        assert_ne!(inside, node);
        let v = block_on_private(Namespaces::NetworkAndMount, || async { 7 });
        assert_eq!(v, 7);
        let panicked = std::panic::catch_unwind(|| {
            on_private_thread(Namespaces::Mount, || panic!("inside"));
        });
        assert!(panicked.is_err());
    }
}
