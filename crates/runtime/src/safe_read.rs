//! Reading files that something untrusted controls: an image's
//! `/etc/passwd`, a process's `/proc/<pid>/cmdline`.
//!
//! Every read here opens without blocking (`O_NONBLOCK`: a FIFO neither
//! blocks the open nor the read), checks with `fstat` that it holds a
//! regular file (a FIFO, a device such as `/dev/zero`, a socket or a
//! directory is refused), and reads at most a cap (a bigger file is
//! refused, never truncated silently). A path inside an image's rootfs is
//! resolved with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`: an
//! absolute symlink, `..` or `/etc -> /etc` stays inside the rootfs, and
//! `/proc/self/...` style magic links are refused. The callers run these on
//! a blocking thread with a timeout.

use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};

/// Why a guarded read failed.
#[derive(Debug, thiserror::Error)]
pub enum SafeReadError {
    /// The file does not exist.
    #[error("{path} does not exist")]
    NotFound {
        /// The path as asked.
        path: String,
    },
    /// The path names something other than a regular file.
    #[error("{path} is not a regular file (it is a {kind})")]
    NotRegular {
        /// The path as asked.
        path: String,
        /// What it is instead.
        kind: &'static str,
    },
    /// The file is larger than the cap.
    #[error("{path} is larger than {cap} bytes")]
    TooLarge {
        /// The path as asked.
        path: String,
        /// The cap.
        cap: u64,
    },
    /// Opening or reading failed otherwise (e.g. a symlink loop).
    #[error("read {path}")]
    Io {
        /// The path as asked.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn kind_of(t: FileType) -> &'static str {
    match t {
        FileType::RegularFile => "regular file",
        FileType::Directory => "directory",
        FileType::Symlink => "symlink",
        FileType::Fifo => "fifo",
        FileType::Socket => "socket",
        FileType::CharacterDevice => "character device",
        FileType::BlockDevice => "block device",
        _ => "special file",
    }
}

fn io_error(path: &str, e: rustix::io::Errno) -> SafeReadError {
    if e == rustix::io::Errno::NOENT {
        SafeReadError::NotFound {
            path: path.to_owned(),
        }
    } else {
        SafeReadError::Io {
            path: path.to_owned(),
            source: e.into(),
        }
    }
}

/// Reads `fd` (already open) after checking it is a regular file, at most
/// `cap` bytes.
fn read_open(fd: OwnedFd, path: &str, cap: u64) -> Result<Vec<u8>, SafeReadError> {
    let st = rustix::fs::fstat(&fd).map_err(|e| io_error(path, e))?;
    let t = FileType::from_raw_mode(st.st_mode);
    if t != FileType::RegularFile {
        return Err(SafeReadError::NotRegular {
            path: path.to_owned(),
            kind: kind_of(t),
        });
    }
    // st_size is 0 for /proc files; the read itself is capped too.
    if u64::try_from(st.st_size).unwrap_or(u64::MAX) > cap {
        return Err(SafeReadError::TooLarge {
            path: path.to_owned(),
            cap,
        });
    }
    let mut out = Vec::new();
    std::fs::File::from(fd)
        .take(cap.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|source| SafeReadError::Io {
            path: path.to_owned(),
            source,
        })?;
    if out.len() as u64 > cap {
        return Err(SafeReadError::TooLarge {
            path: path.to_owned(),
            cap,
        });
    }
    Ok(out)
}

const READ_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::NONBLOCK)
    .union(OFlags::NOCTTY)
    .union(OFlags::CLOEXEC);

/// Reads `path` relative to the directory `root` as if `root` were `/`
/// (`openat2` with `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`): symlinks are
/// followed but never out of `root`. Only a regular file of at most `cap`
/// bytes is read.
pub fn read_in_root(root: &Path, path: &str, cap: u64) -> Result<Vec<u8>, SafeReadError> {
    let dir = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_error(&root.display().to_string(), e))?;
    read_in_root_fd(dir.as_fd(), path, cap)
}

fn read_in_root_fd(
    root: std::os::fd::BorrowedFd<'_>,
    path: &str,
    cap: u64,
) -> Result<Vec<u8>, SafeReadError> {
    let fd = rustix::fs::openat2(
        root,
        path,
        READ_FLAGS,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| io_error(path, e))?;
    read_open(fd, path, cap)
}

/// Reads the file at `path` itself, never through a symlink in its last
/// component (`O_NOFOLLOW`); only a regular file of at most `cap` bytes.
pub fn read_no_follow(path: &Path, cap: u64) -> Result<Vec<u8>, SafeReadError> {
    let shown = path.display().to_string();
    let fd = rustix::fs::open(path, READ_FLAGS | OFlags::NOFOLLOW, Mode::empty())
        .map_err(|e| io_error(&shown, e))?;
    read_open(fd, &shown, cap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn rootfs() -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("etc")).unwrap();
        root
    }

    #[test]
    fn a_regular_file_is_read() {
        let root = rootfs();
        std::fs::write(root.path().join("etc/passwd"), "root:x:0:0::/:/bin/sh\n").unwrap();
        assert_eq!(
            read_in_root(root.path(), "/etc/passwd", 1024).unwrap(),
            b"root:x:0:0::/:/bin/sh\n"
        );
    }

    #[test]
    fn a_symlink_to_dev_zero_is_refused_not_read_for_ever() {
        let root = rootfs();
        // Inside the root, /dev/zero of the image: here absent, so not found;
        // the host's /dev/zero is never reached.
        symlink("/dev/zero", root.path().join("etc/passwd")).unwrap();
        assert!(matches!(
            read_in_root(root.path(), "/etc/passwd", 1024),
            Err(SafeReadError::NotFound { .. })
        ));
        // A device the image does hold is refused by its type.
        let dev = std::fs::File::open("/dev/zero").unwrap();
        let err = read_open(dev.into(), "/etc/passwd", 1024).unwrap_err();
        assert!(
            matches!(
                err,
                SafeReadError::NotRegular {
                    kind: "character device",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let root = rootfs();
        nix::unistd::mkfifo(
            &root.path().join("etc/group"),
            nix::sys::stat::Mode::S_IRWXU,
        )
        .unwrap();
        let err = read_in_root(root.path(), "/etc/group", 1024).unwrap_err();
        assert!(
            matches!(err, SafeReadError::NotRegular { kind: "fifo", .. }),
            "{err}"
        );
        let err = read_no_follow(&root.path().join("etc/group"), 1024).unwrap_err();
        assert!(
            matches!(err, SafeReadError::NotRegular { kind: "fifo", .. }),
            "{err}"
        );
    }

    #[test]
    fn an_absolute_symlink_stays_in_the_root() {
        let root = tempfile::tempdir().unwrap();
        // `/etc -> /etc`: resolved in the root it points at itself.
        symlink("/etc", root.path().join("etc")).unwrap();
        let err = read_in_root(root.path(), "/etc/passwd", 1 << 20).unwrap_err();
        assert!(matches!(err, SafeReadError::Io { .. }), "{err}");
        // `/etc -> /host-etc` inside the root reads the root's file, never
        // the host's /etc.
        std::fs::remove_file(root.path().join("etc")).unwrap();
        std::fs::create_dir(root.path().join("image-etc")).unwrap();
        std::fs::write(root.path().join("image-etc/group"), "g:x:7:\n").unwrap();
        symlink("/image-etc", root.path().join("etc")).unwrap();
        assert_eq!(
            read_in_root(root.path(), "/etc/group", 1024).unwrap(),
            b"g:x:7:\n"
        );
        symlink("../../../../../../etc/passwd", root.path().join("up")).unwrap();
        assert!(matches!(
            read_in_root(root.path(), "/up", 1 << 20),
            Err(SafeReadError::NotFound { .. })
        ));
    }

    #[test]
    fn a_large_file_is_refused() {
        let root = rootfs();
        std::fs::write(root.path().join("etc/passwd"), vec![b'a'; 2048]).unwrap();
        assert!(matches!(
            read_in_root(root.path(), "/etc/passwd", 1024),
            Err(SafeReadError::TooLarge { cap: 1024, .. })
        ));
    }

    #[test]
    fn no_follow_refuses_a_symlink_and_caps_proc_files() {
        let dir = tempfile::tempdir().unwrap();
        symlink("/dev/zero", dir.path().join("address")).unwrap();
        assert!(matches!(
            read_no_follow(&dir.path().join("address"), 1024),
            Err(SafeReadError::Io { .. })
        ));
        let me = read_no_follow(Path::new("/proc/self/cmdline"), 1 << 16).unwrap();
        assert!(!me.is_empty());
        assert!(matches!(
            read_no_follow(Path::new("/proc/self/cmdline"), 1),
            Err(SafeReadError::TooLarge { .. })
        ));
    }
}
