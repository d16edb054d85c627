//! Stdio FIFOs between containerd's shim and Cubelet.
//!
//! FIFOs live in `<state_dir>/io/<container id>/` (and `exec-<exec id>/`
//! below it for exec processes). Opening protocol: before the task (or exec
//! process) is created we hold each output FIFO open read-write (a
//! "keeper"), so the shim's blocking write-side open completes at once;
//! after creation we open the real read-only ends and drop the keepers, so
//! our readers see end-of-file exactly when the shim closes its write ends.

pub mod exec_stream;
pub mod logs;
pub mod ttrpc;

use std::path::{Path, PathBuf};

use nix::sys::stat::Mode;
use tokio::net::unix::pipe;

use crate::error::io_err;
use crate::error::RuntimeError;

/// The FIFOs of one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fifos {
    /// Directory holding them.
    pub dir: PathBuf,
    /// Stdin FIFO, when stdin is kept open.
    pub stdin: Option<PathBuf>,
    /// Stdout FIFO.
    pub stdout: PathBuf,
    /// Stderr FIFO; `None` with a terminal (output is merged).
    pub stderr: Option<PathBuf>,
}

/// Read-write handles that keep the FIFOs open while the shim opens them.
#[derive(Debug)]
pub struct Keepers {
    _stdout: pipe::Receiver,
    _stderr: Option<pipe::Receiver>,
    /// Kept open so a process with stdin does not read end-of-file.
    pub stdin: Option<pipe::Sender>,
}

/// Read ends of the output FIFOs.
#[derive(Debug)]
pub struct Readers {
    /// Stdout.
    pub stdout: pipe::Receiver,
    /// Stderr, when separate.
    pub stderr: Option<pipe::Receiver>,
}

fn mkfifo(path: &Path) -> Result<(), RuntimeError> {
    match nix::unistd::mkfifo(path, Mode::from_bits_truncate(0o600)) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => Ok(()),
        Err(e) => Err(RuntimeError::Io {
            op: "mkfifo",
            path: path.display().to_string(),
            source: std::io::Error::from(e),
        }),
    }
}

impl Fifos {
    /// The FIFO paths in `dir` (nothing is created).
    pub fn paths(dir: PathBuf, stdin: bool, tty: bool) -> Self {
        Self {
            stdin: stdin.then(|| dir.join("stdin")),
            stdout: dir.join("stdout"),
            stderr: (!tty).then(|| dir.join("stderr")),
            dir,
        }
    }

    /// Creates the directory and the FIFOs (existing ones are kept).
    pub fn create(dir: PathBuf, stdin: bool, tty: bool) -> Result<Self, RuntimeError> {
        std::fs::create_dir_all(&dir).map_err(io_err("create fifo directory", &dir))?;
        let f = Self::paths(dir, stdin, tty);
        for p in f.stdin.iter().chain(Some(&f.stdout)).chain(f.stderr.iter()) {
            mkfifo(p)?;
        }
        Ok(f)
    }

    /// Opens the keepers (see the module docs). Must be called before the
    /// shim opens the FIFOs.
    pub fn keep_open(&self) -> Result<Keepers, RuntimeError> {
        let rw = |p: &Path| {
            pipe::OpenOptions::new()
                .read_write(true)
                .open_receiver(p)
                .map_err(io_err("open fifo", p))
        };
        let stdin = match &self.stdin {
            Some(p) => Some(
                pipe::OpenOptions::new()
                    .read_write(true)
                    .open_sender(p)
                    .map_err(io_err("open stdin fifo", p))?,
            ),
            None => None,
        };
        Ok(Keepers {
            _stdout: rw(&self.stdout)?,
            _stderr: self.stderr.as_deref().map(rw).transpose()?,
            stdin,
        })
    }

    /// Opens the read ends. Once the shim holds the write ends, these see
    /// end-of-file only when the shim closes them.
    pub fn open_readers(&self) -> Result<Readers, RuntimeError> {
        let ro = |p: &Path| {
            pipe::OpenOptions::new()
                .open_receiver(p)
                .map_err(io_err("open fifo", p))
        };
        Ok(Readers {
            stdout: ro(&self.stdout)?,
            stderr: self.stderr.as_deref().map(ro).transpose()?,
        })
    }

    /// Path strings for containerd (empty when absent).
    pub fn wire(&self) -> (String, String, String) {
        let s = |p: Option<&PathBuf>| p.map(|p| p.display().to_string()).unwrap_or_default();
        (
            s(self.stdin.as_ref()),
            s(Some(&self.stdout)),
            s(self.stderr.as_ref()),
        )
    }
}

/// Removes a FIFO directory; absent is fine.
pub fn remove_dir(dir: &Path) -> Result<(), RuntimeError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(RuntimeError::Io {
            op: "remove fifo directory",
            path: dir.display().to_string(),
            source: e,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn readers_see_eof_only_after_the_writer_closes() {
        let dir = tempfile::tempdir().unwrap();
        let f = Fifos::create(dir.path().join("c"), false, false).unwrap();
        assert!(f.stdin.is_none());
        let keepers = f.keep_open().unwrap();
        // Stand-in for the shim: a writer opened while the keeper holds a reader.
        let mut w = pipe::OpenOptions::new().open_sender(&f.stdout).unwrap();
        let mut r = f.open_readers().unwrap();
        drop(keepers);
        w.write_all(b"hi").await.unwrap();
        drop(w);
        let mut got = Vec::new();
        r.stdout.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"hi");
        remove_dir(&f.dir).unwrap();
        remove_dir(&f.dir).unwrap();
        assert!(!f.dir.exists());
    }
}
