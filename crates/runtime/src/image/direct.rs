//! Layers written straight into containerd's content store directory.
//!
//! Streaming a blob through containerd's content API costs a second copy
//! and a second hash in containerd, which containerd's own pull does not
//! pay: it was most of Cubelet's pull time beyond containerd's
//! (docs/performance.md, "image pulls"). With containerd's default content
//! sharing policy (`shared`), a blob present in the content store's
//! directory but in no namespace is committed to a namespace by a write
//! that only names it: `content.Write` answers a status of the full size
//! and the commit records it, with no data sent.
//!
//! So a layer is downloaded into a staging file of Cubelet's own (on the
//! same file system), hashed and checked against its digest and size there,
//! made read-only and hard-linked into `blobs/sha256/`; then a write that
//! names it commits it under the pull's lease. From the moment containerd
//! opens that write its ingest record protects the blob from its garbage
//! collector. A collection between the link and the write may remove the
//! blob, and containerd then answers that it wants the data: it is sent
//! from the staging file as a normal write would. When containerd does not
//! see the linked blob at all (another content root, the `isolated`
//! policy), the link is removed and direct writes are off for the rest of
//! the process.

use std::io::Write as _;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use sha2::Digest as _;

use crate::error::{io_err, RuntimeError};

/// Blobs smaller than this stream through the content API unless told
/// otherwise ([`DirectContent::with_min_size`]).
const DEFAULT_MIN_SIZE: u64 = 1 << 20;

/// Where direct writes go: containerd's blob directory and Cubelet's
/// staging directory beside it.
#[derive(Debug)]
pub struct DirectContent {
    /// `<content root>/blobs/sha256`.
    blobs: PathBuf,
    /// Cubelet's staging files, on the blobs' file system.
    staging: PathBuf,
    /// Cleared when containerd turns out not to see the blobs written.
    enabled: AtomicBool,
    /// Smaller blobs stream through the content API.
    min_size: u64,
}

impl DirectContent {
    /// Direct writes into the content store at `content_root` (containerd's
    /// `<root>/io.containerd.content.v1.content`), staged in `staging`
    /// (created; files left there by an earlier run are removed). `None`,
    /// with the reason logged, when either is unusable or they are on
    /// different file systems (a hard link cannot cross them).
    pub fn open(content_root: &Path, staging: &Path) -> Option<Self> {
        let blobs = content_root.join("blobs").join("sha256");
        let setup = || -> std::io::Result<Result<Self, String>> {
            let blobs_meta = match std::fs::metadata(&blobs) {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Ok(Err(format!("{} does not exist", blobs.display())))
                }
                Err(e) => return Err(e),
            };
            std::fs::create_dir_all(staging)?;
            std::fs::set_permissions(staging, std::fs::Permissions::from_mode(0o700))?;
            if std::fs::metadata(staging)?.dev() != blobs_meta.dev() {
                return Ok(Err(format!(
                    "{} and {} are on different file systems",
                    staging.display(),
                    blobs.display()
                )));
            }
            for entry in std::fs::read_dir(staging)? {
                let path = entry?.path();
                if let Err(e) = std::fs::remove_file(&path) {
                    tracing::warn!(path = %path.display(), error = %e, "removing a stale staging file");
                }
            }
            Ok(Ok(Self {
                blobs: blobs.clone(),
                staging: staging.to_owned(),
                enabled: AtomicBool::new(true),
                min_size: DEFAULT_MIN_SIZE,
            }))
        };
        match setup() {
            Ok(Ok(direct)) => Some(direct),
            Ok(Err(why)) => {
                tracing::info!(reason = %why, "layers go through containerd's content API");
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "layers go through containerd's content API");
                None
            }
        }
    }

    /// Writes only blobs of at least `bytes` directly (default 1 MiB:
    /// below it staging, syncing and linking cost more than the copy
    /// saves).
    pub fn with_min_size(mut self, bytes: u64) -> Self {
        self.min_size = bytes;
        self
    }

    /// Whether direct writes are still on.
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Whether a blob of `size` bytes is written directly.
    pub(crate) fn takes(&self, size: u64) -> bool {
        size >= self.min_size && self.enabled()
    }

    /// Turns direct writes off for the rest of the process.
    pub(crate) fn disable(&self, why: &str) {
        if self.enabled.swap(false, Ordering::Relaxed) {
            tracing::warn!(reason = why, blobs = %self.blobs.display(), "containerd does not see blobs written into its content directory; layers go through its content API from now on");
        }
    }

    /// The path of `digest` (`sha256:<hex>`) in containerd's blob
    /// directory; `None` for any other form (nothing is ever written
    /// outside the directory).
    pub(crate) fn blob_path(&self, digest: &str) -> Option<PathBuf> {
        let hex = digest.strip_prefix("sha256:")?;
        (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| self.blobs.join(hex))
    }

    /// A new staging file, removed when the returned guard is dropped.
    pub(crate) fn stage(&self, name: &str) -> Staged {
        Staged {
            path: self.staging.join(name),
        }
    }
}

/// A staging file, removed when dropped.
#[derive(Debug)]
pub(crate) struct Staged {
    path: PathBuf,
}

impl Staged {
    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        match std::fs::remove_file(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "removing a staging file")
            }
        }
    }
}

/// Writes what `chunks` carries into the new file `staged`, hashing it on
/// the way, on the calling (blocking) thread; synced and made read-only at
/// the end. Returns the file's guard with the sha256 digest
/// (`sha256:<hex>`) and the size. The guard travels with the work so that
/// a caller that gave up (a cancelled pull) never leaves the file behind:
/// it is removed when this thread is done with it. The sender bounds the
/// size; a closed channel ends the file.
pub(crate) fn write_staged(
    staged: Staged,
    chunks: tokio::sync::mpsc::Receiver<Bytes>,
) -> (Staged, Result<(String, u64), RuntimeError>) {
    let written = write_file(&staged.path, chunks);
    (staged, written)
}

fn write_file(
    path: &Path,
    mut chunks: tokio::sync::mpsc::Receiver<Bytes>,
) -> Result<(String, u64), RuntimeError> {
    let io = |source| RuntimeError::Io {
        op: "writing the staging file",
        path: path.display().to_string(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io)?;
    let mut hasher = sha2::Sha256::new();
    let mut size = 0u64;
    while let Some(chunk) = chunks.blocking_recv() {
        hasher.update(&chunk);
        file.write_all(&chunk).map_err(io)?;
        size += chunk.len() as u64;
    }
    file.sync_all().map_err(io)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o444))
        .map_err(io)?;
    Ok((format!("sha256:{}", hex::encode(hasher.finalize())), size))
}

/// Links the staged file into the blob directory at `target`. Returns
/// whether this call made the link (false: the blob was there already,
/// written by containerd or another pull, always whole).
pub(crate) fn link(staged: &Path, target: &Path) -> Result<bool, RuntimeError> {
    match std::fs::hard_link(staged, target) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(io_err("linking a staged blob into", target)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sha256_digests_name_a_blob_path() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = dir.path().join("blobs/sha256");
        std::fs::create_dir_all(&blobs).unwrap();
        let d = DirectContent::open(dir.path(), &dir.path().join("staging")).unwrap();
        let hex = "a".repeat(64);
        assert_eq!(
            d.blob_path(&format!("sha256:{hex}")),
            Some(blobs.join(&hex))
        );
        for bad in [
            format!("sha512:{hex}"),
            "sha256:../../etc/passwd".to_owned(),
            format!("sha256:{}", "a".repeat(63)),
            format!("sha256:{}/", "a".repeat(63)),
        ] {
            assert_eq!(d.blob_path(&bad), None, "{bad}");
        }
    }

    #[test]
    fn stale_staging_files_are_removed_and_a_missing_store_turns_it_off() {
        let dir = tempfile::tempdir().unwrap();
        assert!(DirectContent::open(dir.path(), &dir.path().join("staging")).is_none());
        std::fs::create_dir_all(dir.path().join("blobs/sha256")).unwrap();
        let staging = dir.path().join("staging");
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::write(staging.join("left-over"), b"x").unwrap();
        let d = DirectContent::open(dir.path(), &staging).unwrap();
        assert!(d.enabled());
        assert_eq!(std::fs::read_dir(&staging).unwrap().count(), 0);
        d.disable("test");
        assert!(!d.enabled());
    }

    #[tokio::test]
    async fn a_staged_file_is_hashed_read_only_linked_and_removed_with_its_guard() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("blobs/sha256")).unwrap();
        let d = DirectContent::open(dir.path(), &dir.path().join("staging")).unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let writer = tokio::task::spawn_blocking({
            let staged = d.stage("one");
            move || write_staged(staged, rx)
        });
        tx.send(Bytes::from_static(b"hello ")).await.unwrap();
        tx.send(Bytes::from_static(b"world")).await.unwrap();
        drop(tx);
        let (staged, written) = writer.await.unwrap();
        let (digest, size) = written.unwrap();
        let want = format!(
            "sha256:{}",
            hex::encode(sha2::Sha256::digest(b"hello world"))
        );
        assert_eq!((digest.as_str(), size), (want.as_str(), 11));
        let meta = std::fs::metadata(staged.path()).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o444);
        let target = d.blob_path(&digest).unwrap();
        assert!(link(staged.path(), &target).unwrap());
        assert!(!link(staged.path(), &target).unwrap(), "already there");
        drop(staged);
        assert_eq!(std::fs::read(&target).unwrap(), b"hello world");
        assert_eq!(
            std::fs::read_dir(dir.path().join("staging"))
                .unwrap()
                .count(),
            0
        );
    }

    /// A caller that gives up while the file is written (a cancelled pull)
    /// leaves no staging file: the writer removes it when it is done.
    #[tokio::test]
    async fn a_write_given_up_on_leaves_no_staging_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("blobs/sha256")).unwrap();
        let d = DirectContent::open(dir.path(), &dir.path().join("staging")).unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let writer = tokio::task::spawn_blocking({
            let staged = d.stage("abandoned");
            move || write_staged(staged, rx)
        });
        tx.send(Bytes::from_static(b"part")).await.unwrap();
        // The caller is gone: its handle and its sender are dropped.
        drop(tx);
        drop(writer);
        let staging = dir.path().join("staging");
        for _ in 0..500 {
            if std::fs::read_dir(&staging).unwrap().count() == 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("the staging file was left");
    }
}
