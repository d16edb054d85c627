//! Namespace pins, shared by the two crates that make them: the network
//! provider's network (and user) namespaces, and the runtime's IPC and UTS
//! namespaces of pods without an infra process.
//!
//! A pin is a bind mount of a `/proc/thread-self/ns/*` file on a plain file,
//! as `ip netns add` makes them, in a directory that is a mount point with
//! shared propagation, so that a pin unmounted there also leaves the mount
//! namespaces copied while it existed. This module prepares such a
//! directory, tells a pin from a plain file, lists and removes pins, and
//! runs namespace work on an OS thread of its own (`unshare` and `setns`
//! act on the calling thread). Making a pin is left to its owner: what it
//! unshares and where it mounts differ.

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use cubelet_engine::SandboxId;
use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::statfs::{statfs, NSFS_MAGIC};

/// What a pin operation failed with; each owner turns it into its own
/// error type.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// A file operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// Path involved.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A mount or namespace system call failed.
    #[error("{op} {}: {source}", path.display())]
    Sys {
        /// What was being done.
        op: &'static str,
        /// Path involved.
        path: PathBuf,
        /// Why.
        #[source]
        source: Errno,
    },
    /// The thread for namespace work could not start, or died.
    #[error("namespace thread for {what}: {source}")]
    Thread {
        /// What the thread was for.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> PinError + 'a {
    move |source| PinError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

fn sys_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(Errno) -> PinError + 'a {
    move |source| PinError::Sys {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Creates `dir` and makes it a mount point with shared propagation (as
/// `ip netns` does for `/run/netns`), so that a pin unmounted here also
/// leaves the mount namespaces copied while it existed. Idempotent.
pub fn prepare_dir(dir: &Path) -> Result<(), PinError> {
    fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
    let shared = || {
        mount(
            None::<&str>,
            dir,
            None::<&str>,
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None::<&str>,
        )
    };
    match shared() {
        Ok(()) => Ok(()),
        Err(Errno::EINVAL) => {
            // Not a mount point yet: bind it onto itself first.
            mount(
                Some(dir),
                dir,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .map_err(sys_err("bind mount", dir))?;
            shared().map_err(sys_err("make shared", dir))
        }
        Err(e) => Err(sys_err("make shared", dir)(e)),
    }
}

/// True when `path` is a mounted namespace (an nsfs bind mount).
pub fn is_pinned(path: &Path) -> bool {
    statfs(path)
        .map(|s| s.filesystem_type() == NSFS_MAGIC)
        .unwrap_or(false)
}

/// Unmounts and deletes one pin. Returns whether there was anything to
/// remove; a missing pin is fine.
pub fn remove_pin(pin: &Path) -> Result<bool, PinError> {
    let mut removed = match umount2(pin, MntFlags::MNT_DETACH) {
        Ok(()) => true,
        Err(Errno::EINVAL | Errno::ENOENT) => false,
        Err(e) => return Err(sys_err("unmount namespace pin", pin)(e)),
    };
    match fs::remove_file(pin) {
        Ok(()) => removed = true,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("remove namespace pin", pin)(e)),
    }
    Ok(removed)
}

/// The sandbox id a pin named `name` belongs to, when the name is in the
/// format of the ids Cubelet makes (64 lowercase hex characters, as
/// containerd's); `None` for any other file, which is not Cubelet's.
pub fn own_id(name: &OsStr) -> Option<SandboxId> {
    let name = name.to_str()?;
    let own = name.len() == 64
        && name
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if own {
        SandboxId::parse(name)
    } else {
        None
    }
}

/// Every entry of `dir` that is Cubelet's: named by a sandbox id in
/// Cubelet's own format ([`own_id`]), with that id. Any other file there
/// was put by someone else and is not listed, so no caller removes it. A
/// missing directory has none.
pub fn entries(dir: &Path) -> Result<Vec<(PathBuf, SandboxId)>, PinError> {
    let read = match fs::read_dir(dir) {
        Ok(read) => read,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("read", dir)(e)),
    };
    let mut out = Vec::new();
    for entry in read {
        let entry = entry.map_err(io_err("read", dir))?;
        if let Some(id) = own_id(&entry.file_name()) {
            out.push((entry.path(), id));
        }
    }
    Ok(out)
}

/// Runs blocking `work` on a fresh OS thread named `name` (which inherits
/// the caller's namespaces, may change its own, and exits after) and
/// awaits its result without blocking the executor. `what` names the work
/// in errors.
pub async fn on_thread<T, E, W>(name: &str, what: String, work: W) -> Result<T, E>
where
    W: FnOnce() -> Result<T, E> + Send + 'static,
    T: Send + 'static,
    E: From<PinError> + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let _ = tx.send(work());
        });
    if let Err(source) = spawned {
        return Err(PinError::Thread { what, source }.into());
    }
    rx.await.unwrap_or_else(|_| {
        Err(PinError::Thread {
            what,
            source: io::Error::other("namespace thread panicked"),
        }
        .into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_only_files_named_by_cubelets_ids_and_a_missing_directory_has_none() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(entries(&tmp.path().join("absent")).unwrap().is_empty());
        let own = "0123456789abcdef".repeat(4);
        fs::write(tmp.path().join(&own), "").unwrap();
        for other in ["abc123", "Not An Id", "cni-1234"] {
            fs::write(tmp.path().join(other), "").unwrap();
        }
        fs::write(tmp.path().join(own.to_uppercase()), "").unwrap();
        let found = entries(tmp.path()).unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].1.as_str(), own);
        assert_eq!(found[0].0, tmp.path().join(&own));
    }

    #[test]
    fn a_plain_file_is_no_pin_and_removing_it_or_nothing_is_fine() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("pin");
        fs::write(&file, "").unwrap();
        assert!(!is_pinned(&file));
        assert!(remove_pin(&file).unwrap());
        assert!(!remove_pin(&file).unwrap());
    }

    #[tokio::test]
    async fn work_runs_on_its_own_thread_and_a_panic_is_an_error() {
        let me = std::thread::current().id();
        let other = on_thread::<_, PinError, _>("cubelet-host-test", "test".into(), move || {
            Ok(std::thread::current().id())
        })
        .await
        .unwrap();
        assert_ne!(other, me);
        let died =
            on_thread::<(), PinError, _>("cubelet-host-test", "test".into(), || panic!("boom"))
                .await
                .unwrap_err();
        assert!(died.to_string().contains("panicked"), "{died}");
    }
}
