//! Shared helpers for the root tests: each test runs on its own OS thread
//! inside a private mount namespace, so no mount it makes is ever visible
//! on the host, and all of them vanish with the thread even on panic.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashSet;
use std::fs;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cubelet_engine::spec::{NamespaceMode, NamespaceOptions};
use cubelet_engine::{FlowContext, SandboxId, SandboxSpec};
use cubelet_storage::{mount_table, LocalStorage, StorageConfig};

/// True when running as root; otherwise prints why the test is skipped.
pub fn need_root(test: &str) -> bool {
    cubelet_testkit::is_root(test)
}

/// Runs `f` on a fresh thread in a private mount namespace, on a
/// current-thread Tokio runtime of that thread (so every mount syscall and
/// every spawned `mount`/`mkfs` process happens in that namespace).
pub fn in_private_ns<F, Fut, R>(f: F) -> R
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = R>,
    R: Send + 'static,
{
    cubelet_testkit::block_on_private(cubelet_testkit::Namespaces::Mount, f)
}

/// A provider rooted in a temp directory, with a fake host resolv.conf.
pub struct Fixture {
    pub tmp: tempfile::TempDir,
    pub storage: LocalStorage,
}

impl Fixture {
    pub fn new(shm_size: u64) -> Self {
        let tmp = tempfile::Builder::new()
            .prefix("cubelet-storage-test-")
            .tempdir()
            .expect("tempdir");
        let host = tmp.path().join("host-resolv.conf");
        fs::write(&host, "nameserver 192.0.2.53\n").expect("write host resolv.conf");
        let mut cfg = StorageConfig::new(tmp.path().join("root"));
        cfg.shm_size = shm_size;
        cfg.host_resolv_conf = host;
        Fixture {
            tmp,
            storage: LocalStorage::new(cfg),
        }
    }

    pub fn with_config(tmp: tempfile::TempDir, cfg: StorageConfig) -> Self {
        Fixture {
            tmp,
            storage: LocalStorage::new(cfg),
        }
    }

    pub fn root(&self) -> PathBuf {
        self.tmp.path().join("root")
    }

    /// Mount points under the temp directory, in this thread's namespace.
    pub fn mounts_under_tmp(&self) -> Vec<PathBuf> {
        mounts_under(self.tmp.path())
    }
}

impl Drop for Fixture {
    /// Even when a test fails half-way, unmount what it left (deepest
    /// first) so the temp directory can be removed.
    fn drop(&mut self) {
        let mut left = try_mounts_under(self.tmp.path()).unwrap_or_default();
        left.sort();
        for m in left.iter().rev() {
            let _ = cubelet_storage::unmount_all(m);
        }
    }
}

pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    try_mounts_under(dir).expect("mount table")
}

fn try_mounts_under(dir: &Path) -> Result<Vec<PathBuf>, cubelet_storage::StorageError> {
    let canon = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    Ok(mount_table()?
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(&canon))
        .collect())
}

pub fn id(s: &str) -> SandboxId {
    SandboxId::parse(s).expect("valid id")
}

pub fn pod_spec() -> SandboxSpec {
    SandboxSpec {
        name: "web-0".into(),
        namespace: "default".into(),
        uid: "uid-1".into(),
        namespaces: NamespaceOptions {
            ipc: NamespaceMode::Pod,
            ..Default::default()
        },
        ..Default::default()
    }
}

pub fn ctx(id: &SandboxId, spec: SandboxSpec) -> FlowContext {
    FlowContext::new(id.clone(), Arc::new(spec))
}

pub fn live(ids: &[&SandboxId]) -> HashSet<SandboxId> {
    ids.iter().map(|i| (*i).clone()).collect()
}

/// Every file and directory below `dir`, relative, sorted.
pub fn tree(dir: &Path) -> Vec<PathBuf> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(rd) = fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            let p = e.path();
            out.push(p.strip_prefix(base).expect("under base").to_path_buf());
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                walk(base, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// Loop devices whose backing file lies under `dir`.
pub fn loops_under(dir: &Path) -> Vec<String> {
    let canon = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mut out = Vec::new();
    let Ok(rd) = fs::read_dir("/sys/block") else {
        return out;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(b) = fs::read_to_string(e.path().join("loop/backing_file")) {
            if Path::new(b.trim_end()).starts_with(&canon) {
                out.push(name);
            }
        }
    }
    out
}
