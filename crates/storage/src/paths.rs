//! Where a sandbox's files live, validation of request paths, and removal
//! that never leaves the tree it was given.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use cubelet_engine::SandboxId;

use crate::error::StorageError;

/// Name of the directory under the root that holds one directory per sandbox.
pub const SANDBOXES_DIR: &str = "sandboxes";

/// The files and mount points of one sandbox, all derived from the root
/// directory and the sandbox id so that teardown after a restart finds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxPaths {
    /// `<root>/sandboxes/<id>`.
    pub dir: PathBuf,
    /// `<dir>/hostname`.
    pub hostname: PathBuf,
    /// `<dir>/hosts`.
    pub hosts: PathBuf,
    /// `<dir>/resolv.conf`.
    pub resolv_conf: PathBuf,
    /// `<dir>/shm`, the tmpfs mounted at the pod's `/dev/shm`.
    pub shm: PathBuf,
    /// `<dir>/scratch`, mount point of the scratch image.
    pub scratch: PathBuf,
    /// `<dir>/scratch.img`, the scratch image file.
    pub scratch_image: PathBuf,
}

impl SandboxPaths {
    /// The paths of sandbox `id` under `root_dir`.
    pub fn new(root_dir: &Path, id: &SandboxId) -> Self {
        let dir = sandboxes_dir(root_dir).join(id.as_str());
        Self {
            hostname: dir.join("hostname"),
            hosts: dir.join("hosts"),
            resolv_conf: dir.join("resolv.conf"),
            shm: dir.join("shm"),
            scratch: dir.join("scratch"),
            scratch_image: dir.join("scratch.img"),
            dir,
        }
    }

    /// The mount points this crate may create inside the sandbox directory.
    pub fn mount_points(&self) -> [&Path; 2] {
        [&self.scratch, &self.shm]
    }
}

/// `<root>/sandboxes`.
pub fn sandboxes_dir(root_dir: &Path) -> PathBuf {
    root_dir.join(SANDBOXES_DIR)
}

/// True when `path` is absolute and written in normal form: no `.` or `..`
/// components, no doubled or trailing slashes.
pub(crate) fn is_normal_absolute(path: &Path) -> bool {
    if !path.is_absolute() {
        return false;
    }
    if path
        .components()
        .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
    {
        return false;
    }
    // `components()` silently folds `//`, `/./` and a trailing `/`; the
    // path is normal only if nothing was folded.
    let rebuilt: PathBuf = path.components().collect();
    rebuilt.as_os_str() == path.as_os_str()
}

/// Checks a CRI `log_directory` before anything is created: it must be
/// absolute, normalised and free of `..` components.
pub fn validate_log_directory(path: &Path) -> Result<(), StorageError> {
    let refuse = |reason| StorageError::InvalidArgument {
        field: "log_directory",
        value: path.display().to_string(),
        reason,
    };
    if path.as_os_str().is_empty() {
        return Err(refuse("must not be empty"));
    }
    if !path.is_absolute() {
        return Err(refuse("must be an absolute path"));
    }
    if path.components().any(|c| c == Component::ParentDir) {
        return Err(refuse("must not contain `..` components"));
    }
    if path.as_os_str().as_encoded_bytes().contains(&0) {
        return Err(refuse("must not contain NUL bytes"));
    }
    if !is_normal_absolute(path) {
        return Err(refuse("must be normalised (no `.`, `//` or trailing `/`)"));
    }
    if path.parent().is_none() {
        return Err(refuse("must not be the root directory"));
    }
    Ok(())
}

/// Creates `path` as a directory with exactly `mode` (not reduced by the
/// umask). An existing directory is accepted and left as it is; an existing
/// symlink or non-directory is refused.
pub(crate) fn ensure_dir(path: &Path, mode: u32) -> Result<(), StorageError> {
    match fs::DirBuilder::new().mode(mode).create(path) {
        Ok(()) => fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .map_err(|e| StorageError::io("set mode of", path, e)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let meta =
                fs::symlink_metadata(path).map_err(|e| StorageError::io("inspect", path, e))?;
            if meta.file_type().is_dir() {
                Ok(())
            } else {
                Err(StorageError::UnsafePath {
                    path: path.into(),
                    reason: "exists and is not a directory",
                })
            }
        }
        Err(e) => Err(StorageError::io("create directory", path, e)),
    }
}

/// Checks that `dir` is a real directory strictly below `sandboxes` (itself
/// a real directory), reached without following a symlink. Returns `false`
/// when `dir` does not exist.
pub(crate) fn check_sandbox_dir(sandboxes: &Path, dir: &Path) -> Result<bool, StorageError> {
    let Ok(rest) = dir.strip_prefix(sandboxes) else {
        return Err(StorageError::UnsafePath {
            path: dir.into(),
            reason: "not under the sandboxes directory",
        });
    };
    let mut parts = rest.components();
    if !matches!(
        (parts.next(), parts.next()),
        (Some(Component::Normal(_)), None)
    ) {
        return Err(StorageError::UnsafePath {
            path: dir.into(),
            reason: "not a direct child of the sandboxes directory",
        });
    }
    match fs::symlink_metadata(sandboxes) {
        Ok(m) if m.file_type().is_dir() => {}
        Ok(_) => {
            return Err(StorageError::UnsafePath {
                path: sandboxes.into(),
                reason: "is not a real directory",
            })
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(StorageError::io("inspect", sandboxes, e)),
    }
    match fs::symlink_metadata(dir) {
        Ok(m) if m.file_type().is_dir() => Ok(true),
        Ok(_) => Err(StorageError::UnsafePath {
            path: dir.into(),
            reason: "is not a real directory",
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(StorageError::io("inspect", dir, e)),
    }
}

/// Removes `dir` and everything in it without following symlinks (a link is
/// removed, never its target) and without descending into another
/// filesystem (a directory with another device number is an error). Bind
/// mounts from the same filesystem are invisible to that check: callers
/// consult the mount table first. Absent is fine.
pub(crate) fn remove_tree(dir: &Path) -> Result<(), StorageError> {
    let meta = match fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(StorageError::io("inspect", dir, e)),
    };
    if !meta.file_type().is_dir() {
        return Err(StorageError::UnsafePath {
            path: dir.into(),
            reason: "is not a real directory",
        });
    }
    remove_children(dir, meta.dev())?;
    match fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StorageError::io("remove directory", dir, e)),
    }
}

fn remove_children(dir: &Path, dev: u64) -> Result<(), StorageError> {
    let entries = match fs::read_dir(dir) {
        Ok(it) => it,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(StorageError::io("read directory", dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| StorageError::io("read directory", dir, e))?;
        let path = entry.path();
        // `symlink_metadata` never follows the last component; the parents
        // were checked on the way down.
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(StorageError::io("inspect", &path, e)),
        };
        if meta.file_type().is_dir() {
            if meta.dev() != dev {
                return Err(StorageError::UnsafePath {
                    path,
                    reason: "is still a mount point",
                });
            }
            remove_children(&path, dev)?;
            match fs::remove_dir(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(StorageError::io("remove directory", &path, e)),
            }
        } else {
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(StorageError::io("remove", &path, e)),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_derived_from_root_and_id() {
        let p = SandboxPaths::new(
            Path::new("/var/lib/cubelet"),
            &SandboxId::new_unchecked("abc"),
        );
        assert_eq!(p.dir, Path::new("/var/lib/cubelet/sandboxes/abc"));
        assert_eq!(p.hosts, Path::new("/var/lib/cubelet/sandboxes/abc/hosts"));
        assert_eq!(
            p.hostname,
            Path::new("/var/lib/cubelet/sandboxes/abc/hostname")
        );
        assert_eq!(
            p.resolv_conf,
            Path::new("/var/lib/cubelet/sandboxes/abc/resolv.conf")
        );
        assert_eq!(p.shm, Path::new("/var/lib/cubelet/sandboxes/abc/shm"));
        assert_eq!(
            p.scratch,
            Path::new("/var/lib/cubelet/sandboxes/abc/scratch")
        );
    }

    #[test]
    fn log_directory_accepts_normal_absolute_paths() {
        for ok in ["/var/log/pods/ns_name_uid", "/a", "/a/b.c/..d"] {
            validate_log_directory(Path::new(ok)).unwrap();
        }
    }

    #[test]
    fn log_directory_refuses_bad_paths() {
        for bad in [
            "",
            "relative/dir",
            "./x",
            "/a/../b",
            "/..",
            "/a/..",
            "..",
            "/a/./b",
            "/a//b",
            "/a/b/",
            "/",
        ] {
            let err = validate_log_directory(Path::new(bad)).unwrap_err();
            assert!(
                matches!(
                    err,
                    StorageError::InvalidArgument {
                        field: "log_directory",
                        ..
                    }
                ),
                "{bad:?}: {err}"
            );
            assert!(err.to_string().contains("log_directory"), "{err}");
        }
    }

    #[test]
    fn remove_tree_removes_links_not_targets() {
        let outside = tempfile::tempdir().unwrap();
        let keep = outside.path().join("keep");
        fs::write(&keep, "x").unwrap();
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("d");
        fs::create_dir_all(dir.join("sub")).unwrap();
        fs::write(dir.join("sub/f"), "y").unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.join("link")).unwrap();
        std::os::unix::fs::symlink(&keep, dir.join("sub/flink")).unwrap();
        remove_tree(&dir).unwrap();
        assert!(!dir.exists());
        assert_eq!(fs::read_to_string(&keep).unwrap(), "x");
        // Absent is fine.
        remove_tree(&dir).unwrap();
    }

    #[test]
    fn sandbox_dir_check_refuses_symlinks_and_strays() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let sb = root.path().join("sandboxes");
        fs::create_dir(&sb).unwrap();
        assert!(!check_sandbox_dir(&sb, &sb.join("absent")).unwrap());
        std::os::unix::fs::symlink(outside.path(), sb.join("evil")).unwrap();
        assert!(matches!(
            check_sandbox_dir(&sb, &sb.join("evil")),
            Err(StorageError::UnsafePath { .. })
        ));
        assert!(check_sandbox_dir(&sb, root.path()).is_err());
        assert!(check_sandbox_dir(&sb, &sb.join("a/b")).is_err());
        fs::create_dir(sb.join("real")).unwrap();
        assert!(check_sandbox_dir(&sb, &sb.join("real")).unwrap());
    }
}
