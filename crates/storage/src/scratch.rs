//! Size-limited scratch space: ext4 images, loop-mounted per sandbox.
//!
//! Formatting an image (`mkfs.ext4`) costs far more than mounting one, so a
//! pool of formatted images is kept ready in `pool_dir` and refilled in the
//! background. `create` takes an image by renaming it into the sandbox
//! directory (hence `pool_dir` must be on the same filesystem as the root
//! directory) and formats inline only when the pool is empty, which is
//! counted as a miss.

use std::collections::VecDeque;
use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use crate::error::StorageError;
use crate::paths::ensure_dir;

/// Prefix of a formatted image waiting in the pool.
const READY_PREFIX: &str = "ready-";
/// Prefix of an image being formatted; removed at start-up if left over.
const TMP_PREFIX: &str = ".tmp-";

/// Configuration of scratch space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScratchConfig {
    /// Where formatted images wait; must be on the root directory's filesystem.
    pub pool_dir: PathBuf,
    /// How many formatted images to keep ready.
    pub pool_size: usize,
    /// Size of each image in bytes (the file is sparse).
    pub image_size: u64,
}

/// Counters of the scratch image pool, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Creates served from the pool.
    pub hits: u64,
    /// Creates that had to format an image inline.
    pub misses: u64,
    /// Images ready now.
    pub ready: usize,
    /// Configured pool size.
    pub capacity: usize,
}

/// The pool of formatted images.
#[derive(Debug)]
pub(crate) struct ScratchPool {
    cfg: ScratchConfig,
    ready: Mutex<VecDeque<PathBuf>>,
    hits: AtomicU64,
    misses: AtomicU64,
    seq: AtomicU64,
    refill: Notify,
}

impl ScratchPool {
    pub(crate) fn new(cfg: ScratchConfig) -> Self {
        Self {
            cfg,
            ready: Mutex::default(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            refill: Notify::new(),
        }
    }

    pub(crate) fn config(&self) -> &ScratchConfig {
        &self.cfg
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<PathBuf>> {
        // The queue holds plain paths; a panic elsewhere cannot leave it torn.
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn stats(&self) -> PoolStats {
        PoolStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            ready: self.lock().len(),
            capacity: self.cfg.pool_size,
        }
    }

    /// Creates the pool directory (checking it shares a filesystem with
    /// `sandboxes`), drops half-formatted leftovers and adopts images a
    /// previous run left ready.
    pub(crate) fn prepare(&self, sandboxes: &Path) -> Result<(), StorageError> {
        if self.cfg.image_size < 1 << 20 {
            return Err(StorageError::Config(format!(
                "scratch image_size {} is below 1 MiB",
                self.cfg.image_size
            )));
        }
        ensure_dir(&self.cfg.pool_dir, 0o700)?;
        let dev = |p: &Path| {
            fs::metadata(p)
                .map(|m| m.dev())
                .map_err(|e| StorageError::io("inspect", p, e))
        };
        if dev(&self.cfg.pool_dir)? != dev(sandboxes)? {
            return Err(StorageError::Config(format!(
                "scratch pool_dir {} is not on the filesystem of {}",
                self.cfg.pool_dir.display(),
                sandboxes.display()
            )));
        }
        let entries = fs::read_dir(&self.cfg.pool_dir)
            .map_err(|e| StorageError::io("read directory", &self.cfg.pool_dir, e))?;
        let mut adopted = Vec::new();
        for entry in entries {
            let entry =
                entry.map_err(|e| StorageError::io("read directory", &self.cfg.pool_dir, e))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let is_file = entry.file_type().map(|t| t.is_file()).unwrap_or(false);
            if !is_file {
                continue;
            }
            if name.starts_with(TMP_PREFIX) {
                remove_file_quiet(&entry.path())?;
            } else if name.starts_with(READY_PREFIX) {
                let size = entry.metadata().map(|m| m.len()).unwrap_or(0);
                if size == self.cfg.image_size {
                    adopted.push(entry.path());
                } else {
                    // Formatted for another size: not usable any more.
                    remove_file_quiet(&entry.path())?;
                }
            }
        }
        adopted.sort();
        let mut q = self.lock();
        for p in adopted {
            if !q.contains(&p) {
                q.push_back(p);
            }
        }
        Ok(())
    }

    /// Takes a ready image, if any, and wakes the filler.
    pub(crate) fn take(&self) -> Option<PathBuf> {
        let got = self.lock().pop_front();
        match got {
            Some(_) => self.hits.fetch_add(1, Ordering::Relaxed),
            None => self.misses.fetch_add(1, Ordering::Relaxed),
        };
        self.refill.notify_one();
        got
    }

    /// Formats one image into the pool.
    async fn fill_one(&self) -> Result<(), StorageError> {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let name = format!("{stamp}-{}-{n}.img", std::process::id());
        let tmp = self.cfg.pool_dir.join(format!("{TMP_PREFIX}{name}"));
        let ready = self.cfg.pool_dir.join(format!("{READY_PREFIX}{name}"));
        if let Err(e) = format_image(&tmp, self.cfg.image_size).await {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        fs::rename(&tmp, &ready).map_err(|e| StorageError::io("rename", &tmp, e))?;
        self.lock().push_back(ready);
        Ok(())
    }

    /// Keeps the pool full until the task is aborted.
    pub(crate) async fn run_filler(self: Arc<Self>) {
        let mut backoff = Duration::from_millis(500);
        loop {
            while self.lock().len() < self.cfg.pool_size {
                match self.fill_one().await {
                    Ok(()) => backoff = Duration::from_millis(500),
                    Err(e) => {
                        tracing::warn!(error = %cubelet_engine::chain(&e), "scratch pool refill failed");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(30));
                    }
                }
            }
            self.refill.notified().await;
        }
    }
}

fn remove_file_quiet(path: &Path) -> Result<(), StorageError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(StorageError::io("remove", path, e)),
        _ => Ok(()),
    }
}

/// Runs `program args` and turns a spawn failure or non-zero exit into
/// [`StorageError::Command`].
pub(crate) async fn run(
    program: &'static str,
    args: &[&std::ffi::OsStr],
    path: &Path,
) -> Result<(), StorageError> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| StorageError::Command {
            program,
            path: path.into(),
            detail: e.to_string(),
        })?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: String = stderr
        .trim()
        .chars()
        .rev()
        .take(400)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    Err(StorageError::Command {
        program,
        path: path.into(),
        detail: format!("{}: {tail}", out.status),
    })
}

/// Creates a sparse file of `size` bytes at `path` (which must not exist)
/// and formats it as ext4 with no reserved blocks.
pub(crate) async fn format_image(path: &Path, size: u64) -> Result<(), StorageError> {
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| StorageError::io("create", path, e))?;
    file.set_len(size)
        .map_err(|e| StorageError::io("size", path, e))?;
    drop(file);
    run(
        "mkfs.ext4",
        &[
            "-q".as_ref(),
            "-F".as_ref(),
            "-m".as_ref(),
            "0".as_ref(),
            path.as_os_str(),
        ],
        path,
    )
    .await
}

/// Loop-mounts the ext4 image at `target` (nosuid, nodev) and opens its
/// root to every user of the pod, like `/tmp`.
pub(crate) async fn mount_image(image: &Path, target: &Path) -> Result<(), StorageError> {
    run(
        "mount",
        &[
            "-t".as_ref(),
            "ext4".as_ref(),
            "-o".as_ref(),
            "loop,nosuid,nodev".as_ref(),
            image.as_os_str(),
            target.as_os_str(),
        ],
        target,
    )
    .await?;
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(target, fs::Permissions::from_mode(0o1777))
        .map_err(|e| StorageError::io("set mode of", target, e))
}

/// Detaches every loop device still backed by `image`. `mount -o loop`
/// sets auto-clear, so this normally finds nothing; it catches devices left
/// by an interrupted mount.
pub(crate) fn detach_loops(image: &Path) -> Result<usize, StorageError> {
    let Ok(want) = fs::canonicalize(image) else {
        return Ok(0);
    };
    let Ok(blocks) = fs::read_dir("/sys/block") else {
        return Ok(0);
    };
    let mut detached = 0;
    for entry in blocks.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with("loop") {
            continue;
        }
        let backing = entry.path().join("loop/backing_file");
        let Ok(text) = fs::read_to_string(&backing) else {
            continue;
        };
        if Path::new(text.trim_end_matches('\n')) != want {
            continue;
        }
        let dev = Path::new("/dev").join(&*name);
        let out = std::process::Command::new("losetup")
            .arg("-d")
            .arg(&dev)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| StorageError::Command {
                program: "losetup",
                path: dev.clone(),
                detail: e.to_string(),
            })?;
        if out.status.success() {
            detached += 1;
        } else {
            // Auto-clear may have released it between the read and now.
            tracing::debug!(device = %dev.display(), stderr = %String::from_utf8_lossy(&out.stderr), "losetup -d failed");
        }
    }
    Ok(detached)
}
