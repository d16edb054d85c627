//! Disk usage of the image filesystem (snapshotter root, content store), for
//! CRI `ImageFsInfo`.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt as _;
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
pub fn usage(path: &Path) -> Result<FsUsage, RuntimeError> {
    let timestamp_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
    let mut out = FsUsage {
        mountpoint: path.to_path_buf(),
        used_bytes: 0,
        inodes_used: 0,
        timestamp_ns,
    };
    let root = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(source) => {
            return Err(RuntimeError::Io {
                op: "stat",
                path: path.display().to_string(),
                source,
            })
        }
    };
    let dev = root.dev();
    let mut seen = HashSet::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            // Removed while walking (GC, unpack in progress).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(RuntimeError::Io {
                    op: "read dir",
                    path: dir.display().to_string(),
                    source,
                })
            }
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.metadata() else { continue };
            if meta.dev() != dev || !seen.insert(meta.ino()) {
                continue;
            }
            out.inodes_used += 1;
            out.used_bytes += meta.blocks() * 512;
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    out.inodes_used += 1;
    out.used_bytes += root.blocks() * 512;
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
}
