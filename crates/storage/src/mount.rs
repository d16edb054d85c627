//! Mounting, unmounting and reading the mount table.
//!
//! Mounts belong to a mount namespace, and a namespace can be per thread,
//! so the table is read from `/proc/thread-self/mountinfo` (the calling
//! thread's view) rather than `/proc/self/mountinfo` (the main thread's).
//! In the daemon both are the same; in tests that unshare a thread they
//! are not.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::error::StorageError;

pub use cubelet_host::mountinfo::{parse as parse_mountinfo, MountEntry};

/// The calling thread's mount table.
pub fn mount_table() -> Result<Vec<MountEntry>, StorageError> {
    cubelet_host::mountinfo::own()
        .map_err(|e| StorageError::io("read", "/proc/thread-self/mountinfo", e))
}

/// The path as the mount table spells it: symlinks in the parents resolved.
/// A path whose parent does not exist is returned unchanged.
pub(crate) fn table_path(path: &Path) -> PathBuf {
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => match fs::canonicalize(parent) {
            Ok(p) => p.join(name),
            Err(_) => path.to_path_buf(),
        },
        _ => path.to_path_buf(),
    }
}

/// True when something is mounted at `path` in the calling thread's
/// namespace. Asked of `statx(2)` where the kernel says (reading the mount
/// table costs a line per mount on the node, a millisecond or more at a few
/// hundred pods); the mount table otherwise.
pub fn is_mounted(path: &Path) -> Result<bool, StorageError> {
    if let Some(root) = mount_root(path)? {
        return Ok(root);
    }
    let want = table_path(path);
    Ok(mount_table()?.iter().any(|m| m.mount_point == want))
}

/// Whether `path` (its last component not followed) is the root of a
/// mount in the calling thread's namespace, as `statx(2)`'s
/// `STATX_ATTR_MOUNT_ROOT` says (Linux ≥ 5.8; bind mounts of the same
/// filesystem included); `None` when the kernel does not say. A missing
/// path is no mount.
pub(crate) fn mount_root(path: &Path) -> Result<Option<bool>, StorageError> {
    use rustix::fs::{statx, AtFlags, StatxAttributes, StatxFlags, CWD};
    match statx(
        CWD,
        path,
        AtFlags::NO_AUTOMOUNT | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::empty(),
    ) {
        Ok(st) => Ok(st
            .stx_attributes_mask
            .contains(StatxAttributes::MOUNT_ROOT)
            .then(|| st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT))),
        Err(rustix::io::Errno::NOENT) => Ok(Some(false)),
        Err(rustix::io::Errno::NOSYS) => Ok(None),
        Err(e) => Err(StorageError::io("inspect", path, e.into())),
    }
}

/// The first mount found at directory `dir` or anywhere inside it
/// (symlinks are not entered), by `statx(2)`; `None` when the kernel cannot
/// tell mount roots apart (callers then read the mount table), `Some(None)`
/// when there is none.
pub(crate) fn first_mount(dir: &Path) -> Result<Option<Option<PathBuf>>, StorageError> {
    // Whether this kernel's statx reports mount roots, asked of `/` once.
    static KNOWN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*KNOWN.get_or_init(|| matches!(mount_root(Path::new("/")), Ok(Some(_)))) {
        return Ok(None);
    }
    if mount_root(dir)? == Some(true) {
        return Ok(Some(Some(dir.to_path_buf())));
    }
    mount_inside(dir).map(Some)
}

fn mount_inside(dir: &Path) -> Result<Option<PathBuf>, StorageError> {
    let entries = match fs::read_dir(dir) {
        Ok(it) => it,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StorageError::io("read directory", dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| StorageError::io("read directory", dir, e))?;
        let path = entry.path();
        if mount_root(&path)? == Some(true) {
            return Ok(Some(path));
        }
        let is_dir = entry
            .file_type()
            .map_err(|e| StorageError::io("inspect", &path, e))?
            .is_dir();
        if is_dir {
            if let Some(found) = mount_inside(&path)? {
                return Ok(Some(found));
            }
        }
    }
    Ok(None)
}

/// Mounts a tmpfs for `/dev/shm` at `target`: `size` bytes, mode 1777,
/// nosuid, nodev, noexec.
pub(crate) fn mount_shm(target: &Path, size: u64) -> Result<(), StorageError> {
    let data = format!("mode=1777,size={size}");
    mount(
        Some("shm"),
        target,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(data.as_str()),
    )
    .map_err(|source| StorageError::Mount {
        fstype: "tmpfs",
        target: target.into(),
        source,
    })
}

/// Unmounts everything stacked at `target` (detaching lazily, never
/// following a symlink). Returns how many mounts were removed; "not
/// mounted" (`EINVAL`) and "absent" (`ENOENT`) end the loop successfully.
pub fn unmount_all(target: &Path) -> Result<usize, StorageError> {
    // A bound on stacked mounts, so a kernel that keeps answering success
    // cannot loop us forever.
    const MAX_STACKED: usize = 64;
    let mut removed = 0;
    while removed < MAX_STACKED {
        match umount2(target, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
            Ok(()) => removed += 1,
            Err(Errno::EINVAL | Errno::ENOENT) => return Ok(removed),
            Err(source) => {
                return Err(StorageError::Unmount {
                    target: target.into(),
                    source,
                })
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statx_tells_mount_roots_as_the_mount_table_does() {
        // Every mount point the table lists that statx can see is a mount
        // root to it, and plain paths are not.
        if mount_root(Path::new("/")).unwrap().is_none() {
            eprintln!("skipped: this kernel's statx does not report mount roots");
            return;
        }
        assert_eq!(mount_root(Path::new("/")).unwrap(), Some(true));
        assert_eq!(mount_root(Path::new("/proc")).unwrap(), Some(true));
        assert_eq!(mount_root(Path::new("/proc/self")).unwrap(), Some(false));
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(mount_root(dir.path()).unwrap(), Some(false));
        assert_eq!(
            mount_root(&dir.path().join("missing")).unwrap(),
            Some(false)
        );
        assert!(!is_mounted(dir.path()).unwrap());
        assert!(is_mounted(Path::new("/proc")).unwrap());
        assert_eq!(first_mount(dir.path()).unwrap(), Some(None));
    }
}
