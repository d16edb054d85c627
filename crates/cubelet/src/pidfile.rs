//! `<state_dir>/cubelet.pid`: one Cubelet per state directory. The file is
//! locked (`flock`) for as long as the daemon runs, so a second start names
//! the running one instead of failing later on a lock of its database.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation};

/// File name of the lock under `state_dir`.
pub const PID_FILE: &str = "cubelet.pid";

/// Why the lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum PidLockError {
    /// Another process holds the lock.
    #[error("another Cubelet is running ({}) with state_dir {}", pid.map_or_else(|| "pid unknown".to_owned(), |p| format!("pid {p}")), state_dir.display())]
    Running {
        /// The running one's pid, as its file says.
        pid: Option<u32>,
        /// The shared state directory.
        state_dir: PathBuf,
    },
    /// The file could not be opened, locked or written.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// The pid file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// The held lock; released (and the file removed) when dropped.
#[derive(Debug)]
pub struct PidLock {
    file: File,
    path: PathBuf,
}

impl PidLock {
    /// Locks `<state_dir>/cubelet.pid` and writes this process's pid to it.
    pub fn acquire(state_dir: &Path) -> Result<PidLock, PidLockError> {
        let path = state_dir.join(PID_FILE);
        let io = |op, source| PidLockError::Io {
            op,
            path: path.clone(),
            source,
        };
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io("open", e))?;
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                return Err(PidLockError::Running {
                    pid: text.trim().parse().ok(),
                    state_dir: state_dir.to_path_buf(),
                });
            }
            Err(e) => return Err(io("lock", std::io::Error::from(e))),
        }
        file.set_len(0).map_err(|e| io("truncate", e))?;
        file.rewind().map_err(|e| io("rewind", e))?;
        writeln!(file, "{}", std::process::id()).map_err(|e| io("write", e))?;
        file.flush().map_err(|e| io("write", e))?;
        Ok(PidLock { file, path })
    }
}

impl Drop for PidLock {
    fn drop(&mut self) {
        // Removed while still locked: a start racing this one finds the
        // lock held, never an unlocked file of a stopped daemon.
        let _ = std::fs::remove_file(&self.path);
        let _ = flock(&self.file, FlockOperation::Unlock);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The second lock of one state dir fails naming the first one's pid,
    /// once; after the first is dropped the file is gone and it works.
    #[test]
    fn a_second_instance_names_the_first_ones_pid() {
        let tmp = tempfile::tempdir().unwrap();
        let first = PidLock::acquire(tmp.path()).unwrap();
        let text = std::fs::read_to_string(tmp.path().join(PID_FILE)).unwrap();
        assert_eq!(text.trim(), std::process::id().to_string());
        let err = PidLock::acquire(tmp.path()).unwrap_err();
        let msg = err.to_string();
        let pid = format!("(pid {})", std::process::id());
        assert!(
            msg.starts_with(&format!("another Cubelet is running {pid}")),
            "{msg}"
        );
        assert_eq!(msg.matches(&pid).count(), 1, "{msg}");
        drop(first);
        assert!(!tmp.path().join(PID_FILE).exists());
        let _again = PidLock::acquire(tmp.path()).unwrap();
    }
}
