//! Disk usage of the image filesystem (snapshotter root, content store), for
//! CRI `ImageFsInfo`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::RuntimeError;

/// Usage of one directory tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsUsage {
    /// The directory measured (CRI's `FilesystemIdentifier.mountpoint`).
    pub mountpoint: PathBuf,
    /// Bytes allocated by its files (hard links counted once).
    pub used_bytes: u64,
    /// Inodes used (hard links counted once).
    pub inodes_used: u64,
    /// When it was measured, nanoseconds since the epoch.
    pub timestamp_ns: i64,
}

/// Walks `path` (not crossing into other filesystems) and sums its usage.
/// A missing directory counts as empty.
///
/// Containers' writable layers live under the snapshotter's root, so a
/// tenant decides what this walks: every directory is opened relative to
/// its parent's descriptor (no path grows with the depth, so a tree deeper
/// than `PATH_MAX` is walked like any other), symlinks are never followed,
/// and a directory that cannot be read (removed meanwhile, out of
/// descriptors) is left out and counted in the log, never failing the call.
pub fn usage(path: &Path) -> Result<FsUsage, RuntimeError> {
    use rustix::fs::{openat, statat, AtFlags, Dir, Mode, OFlags, CWD};
    use std::rc::Rc;

    let timestamp_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
    let mut out = FsUsage {
        mountpoint: path.to_path_buf(),
        used_bytes: 0,
        inodes_used: 0,
        timestamp_ns,
    };
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let root = match openat(CWD, path, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(out),
        Err(e) => {
            return Err(RuntimeError::Io {
                op: "open directory",
                path: path.display().to_string(),
                source: e.into(),
            })
        }
    };
    let root_stat = rustix::fs::fstat(&root).map_err(|e| RuntimeError::Io {
        op: "stat",
        path: path.display().to_string(),
        source: e.into(),
    })?;
    let dev = root_stat.st_dev;
    out.inodes_used += 1;
    out.used_bytes += u64::try_from(root_stat.st_blocks).unwrap_or(0) * 512;
    let mut seen = HashSet::new();
    let mut skipped = 0u64;
    // Directories still to read, each as (its parent, its name): depth
    // first, so the descriptors held open are those along one path.
    let root = Rc::new(root);
    let mut stack: Vec<(Rc<rustix::fd::OwnedFd>, Option<std::ffi::CString>)> = vec![(root, None)];
    while let Some((parent, name)) = stack.pop() {
        let dir = match &name {
            None => Ok(Rc::clone(&parent)),
            Some(n) => openat(&*parent, n.as_c_str(), flags, Mode::empty()).map(Rc::new),
        };
        drop(parent);
        let Ok(dir) = dir else {
            skipped += 1;
            continue;
        };
        let Ok(entries) = Dir::read_from(&*dir) else {
            skipped += 1;
            continue;
        };
        for entry in entries {
            let Ok(entry) = entry else {
                skipped += 1;
                break;
            };
            let name = entry.file_name();
            if name == c"." || name == c".." {
                continue;
            }
            let Ok(st) = statat(&*dir, name, AtFlags::SYMLINK_NOFOLLOW) else {
                continue;
            };
            if st.st_dev != dev || !seen.insert(st.st_ino) {
                continue;
            }
            out.inodes_used += 1;
            out.used_bytes += u64::try_from(st.st_blocks).unwrap_or(0) * 512;
            if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory {
                stack.push((Rc::clone(&dir), Some(name.to_owned())));
            }
        }
    }
    if skipped > 0 {
        tracing::debug!(path = %path.display(), skipped, "directories left out of the usage");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_files_and_hard_links_once() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/a"), vec![1u8; 10_000]).unwrap();
        std::fs::hard_link(dir.path().join("sub/a"), dir.path().join("b")).unwrap();
        let u = usage(dir.path()).unwrap();
        // root, sub, a (b is the same inode)
        assert_eq!(u.inodes_used, 3);
        assert!(u.used_bytes >= 10_000, "{u:?}");
        let missing = usage(&dir.path().join("nope")).unwrap();
        assert_eq!((missing.used_bytes, missing.inodes_used), (0, 0));
    }

    #[test]
    fn a_tree_deeper_than_path_max_is_walked_and_symlinks_are_not_followed() {
        use rustix::fs::{mkdirat, openat, Mode, OFlags, CWD};
        let dir = tempfile::tempdir().unwrap();
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let mut fd = openat(CWD, dir.path(), flags, Mode::empty()).unwrap();
        // 2100 levels of "d/": 4200 bytes of path, past PATH_MAX (4096).
        for _ in 0..2100 {
            mkdirat(&fd, "d", Mode::from_raw_mode(0o755)).unwrap();
            fd = openat(&fd, "d", flags, Mode::empty()).unwrap();
        }
        let file = openat(
            &fd,
            "f",
            OFlags::WRONLY | OFlags::CREATE | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )
        .unwrap();
        rustix::io::write(&file, &[7u8; 20_000]).unwrap();
        rustix::fs::symlinkat("/", &fd, "up").unwrap();
        let u = usage(dir.path()).unwrap();
        // root, 2100 directories, the file and the link (not what it names).
        assert_eq!(u.inodes_used, 2103, "{u:?}");
        assert!(u.used_bytes >= 20_000, "{u:?}");
        // std's remove_dir_all walks by descriptors too.
        drop(fd);
        std::fs::remove_dir_all(dir.path()).unwrap();
    }
}
