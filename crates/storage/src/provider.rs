//! [`LocalStorage`], the `storage` flow provider.

use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Component, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use cubelet_engine::spec::{NamespaceMode, NetworkStatus, StorageStatus};
use cubelet_engine::{
    blocking, Flow, FlowContext, LiveSandboxes, SandboxId, SandboxSpec, StepError,
};
use tokio::task::JoinHandle;

use crate::error::StorageError;
use crate::files::{self, validate_dns, validate_hostname, write_file};
use crate::mount::{first_mount, is_mounted, mount_shm, mount_table, unmount_all};
use crate::paths::{
    self, check_sandbox_dir, ensure_dir, remove_tree, validate_log_directory, SandboxPaths,
};
use crate::scratch::{self, PoolStats, ScratchConfig, ScratchPool};
use tracing::Instrument;

/// Mode of the root, `sandboxes` and per-sandbox directories: traversable,
/// not listable, by the pod's users.
const DIR_MODE: u32 = 0o711;
/// Mode of a CRI log directory this crate creates.
const LOG_DIR_MODE: u32 = 0o755;

/// Configuration of [`LocalStorage`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageConfig {
    /// Persistent root; sandboxes go in `<root_dir>/sandboxes/<id>`.
    pub root_dir: PathBuf,
    /// Size of each pod's `/dev/shm` in bytes.
    pub shm_size: u64,
    /// The node's resolv.conf, copied for pods without DNS settings and
    /// for host-network pods.
    pub host_resolv_conf: PathBuf,
    /// Scratch space; `None` (the default) turns it off.
    pub scratch: Option<ScratchConfig>,
}

impl StorageConfig {
    /// Default `/dev/shm` size: 64 MiB.
    pub const DEFAULT_SHM_SIZE: u64 = 64 << 20;

    /// Defaults under `root_dir`: 64 MiB shm, `/etc/resolv.conf`, no scratch.
    pub fn new(root_dir: impl Into<PathBuf>) -> Self {
        Self {
            root_dir: root_dir.into(),
            shm_size: Self::DEFAULT_SHM_SIZE,
            host_resolv_conf: PathBuf::from("/etc/resolv.conf"),
            scratch: None,
        }
    }

    fn validate(&self) -> Result<(), StorageError> {
        if !paths::is_normal_absolute(&self.root_dir) || self.root_dir.parent().is_none() {
            return Err(StorageError::Config(format!(
                "root_dir {:?} must be a normalised absolute path below /",
                self.root_dir
            )));
        }
        if self.shm_size == 0 {
            return Err(StorageError::Config("shm_size must be above zero".into()));
        }
        if !self.host_resolv_conf.is_absolute() {
            return Err(StorageError::Config(format!(
                "host_resolv_conf {:?} must be absolute",
                self.host_resolv_conf
            )));
        }
        Ok(())
    }
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self::new("/var/lib/cubelet")
    }
}

/// What one [`LocalStorage::gc`] pass reclaimed.
#[derive(Debug, Default)]
pub struct GcReport {
    /// Orphan sandbox directories removed.
    pub dirs: usize,
    /// Orphan shm and scratch mounts unmounted.
    pub mounts: usize,
    /// Orphans that could not be reclaimed; the pass went on past them.
    pub errors: Vec<StorageError>,
}

/// The `storage` flow provider: per-sandbox directory, `hostname`, `hosts`,
/// `resolv.conf`, a `/dev/shm` tmpfs, optional scratch space and the CRI
/// log directory.
///
/// Work runs on the calling thread on purpose: mounts belong to the
/// caller's mount namespace. Teardown (umounts, tree removal) runs there
/// through [`blocking`], so it does not stall the async workers; the slow
/// part of a create, formatting scratch images, happens in the pool's
/// background task.
#[derive(Debug)]
pub struct LocalStorage {
    cfg: StorageConfig,
    pool: Option<Arc<ScratchPool>>,
    filler: Mutex<Option<JoinHandle<()>>>,
}

impl LocalStorage {
    /// A provider for `cfg`. Nothing is touched until [`Flow::init`] or
    /// the first flow.
    pub fn new(cfg: StorageConfig) -> Self {
        let pool = cfg.scratch.clone().map(|s| Arc::new(ScratchPool::new(s)));
        Self {
            cfg,
            pool,
            filler: Mutex::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &StorageConfig {
        &self.cfg
    }

    /// The paths of sandbox `id`.
    pub fn paths(&self, id: &SandboxId) -> SandboxPaths {
        SandboxPaths::new(&self.cfg.root_dir, id)
    }

    /// Scratch pool counters; `None` when scratch space is off.
    pub fn pool_stats(&self) -> Option<PoolStats> {
        self.pool.as_ref().map(|p| p.stats())
    }

    fn sandboxes_dir(&self) -> PathBuf {
        paths::sandboxes_dir(&self.cfg.root_dir)
    }

    /// Creates the root and `sandboxes` directories (not their parents).
    /// The root may be a symlink to a directory (it comes from the
    /// operator's configuration); `sandboxes` and everything below may not.
    fn ensure_root(&self) -> Result<(), StorageError> {
        self.cfg.validate()?;
        if !fs::metadata(&self.cfg.root_dir).is_ok_and(|m| m.is_dir()) {
            ensure_dir(&self.cfg.root_dir, DIR_MODE)?;
        }
        ensure_dir(&self.sandboxes_dir(), DIR_MODE)
    }

    /// Prepares the root directory and, with scratch on, fills the image
    /// pool in a background task (which must be spawned on a Tokio runtime).
    pub async fn init_storage(&self) -> Result<(), StorageError> {
        self.ensure_root()?;
        if let Some(pool) = &self.pool {
            pool.prepare(&self.sandboxes_dir())?;
            let mut filler = self.filler.lock().unwrap_or_else(|p| p.into_inner());
            if filler.as_ref().is_none_or(|h| h.is_finished()) {
                *filler = Some(tokio::spawn(
                    Arc::clone(pool).run_filler().in_current_span(),
                ));
            }
        }
        Ok(())
    }

    /// Builds the sandbox's storage and returns what to publish. Every
    /// request field is validated before anything is created.
    pub async fn create_sandbox(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        ips: &[std::net::IpAddr],
    ) -> Result<StorageStatus, StorageError> {
        self.build_sandbox(id, spec, ips, None).await
    }

    /// The pod-independent part of a sandbox's storage, for a warm-pool
    /// shell: its directory, its `/dev/shm`, (with scratch on) its scratch
    /// space, and the pod's three files, empty. [`LocalStorage::finish_shell`]
    /// writes the files' content into them in place, so a claim allocates
    /// no inode for them on the pod's path (ext4 without a journal, as on
    /// many VMs, checks recently freed inodes on every allocation, which
    /// grows while a node starts and removes containers).
    pub async fn prepare_shell(&self, id: &SandboxId) -> Result<StorageStatus, StorageError> {
        self.ensure_root()?;
        let p = self.paths(id);
        ensure_dir(&p.dir, DIR_MODE)?;
        check_sandbox_dir(&self.sandboxes_dir(), &p.dir)?;
        for file in [&p.hostname, &p.hosts, &p.resolv_conf] {
            write_file(file, b"")?;
        }
        ensure_dir(&p.shm, 0o755)?;
        if !is_mounted(&p.shm)? {
            mount_shm(&p.shm, self.cfg.shm_size)?;
        }
        let scratch_path = match &self.pool {
            Some(pool) => {
                self.create_scratch(pool, &p).await?;
                Some(p.scratch.clone())
            }
            None => None,
        };
        Ok(StorageStatus {
            sandbox_dir: p.dir.clone(),
            hostname_path: p.hostname,
            hosts_path: p.hosts,
            resolv_conf_path: p.resolv_conf,
            shm_path: Some(p.shm),
            scratch_path,
        })
    }

    /// [`LocalStorage::create_sandbox`] of a pod that claimed the shell
    /// `shell` made by [`LocalStorage::prepare_shell`]: validates the
    /// request and writes only what depends on the pod (hostname, hosts,
    /// resolv.conf, its log directory).
    pub async fn finish_shell(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        ips: &[std::net::IpAddr],
        shell: StorageStatus,
    ) -> Result<StorageStatus, StorageError> {
        self.build_sandbox(id, spec, ips, Some(shell)).await
    }

    async fn build_sandbox(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        ips: &[std::net::IpAddr],
        shell: Option<StorageStatus>,
    ) -> Result<StorageStatus, StorageError> {
        if let Some(dir) = &spec.log_directory {
            validate_log_directory(dir)?;
        }
        let hostname = spec.effective_hostname();
        validate_hostname(hostname)?;
        let dns = if spec.host_network() {
            None
        } else {
            spec.dns.as_ref()
        };
        if let Some(dns) = dns {
            validate_dns(dns)?;
        }

        let p = self.paths(id);
        if let Some(shell) = shell.filter(|s| s.sandbox_dir == p.dir) {
            // The directory, shm and scratch are the shell's, checked
            // when it was made; only the pod's files are left.
            write_file(&p.hostname, files::render_hostname(hostname).as_bytes())?;
            files::write_hosts(&p.dir, hostname, ips)?;
            files::write_resolv_conf(&p, dns, &self.cfg.host_resolv_conf)?;
            if let Some(dir) = &spec.log_directory {
                create_log_directory(dir)?;
            }
            return Ok(shell);
        }
        self.ensure_root()?;
        ensure_dir(&p.dir, DIR_MODE)?;
        check_sandbox_dir(&self.sandboxes_dir(), &p.dir)?;

        write_file(&p.hostname, files::render_hostname(hostname).as_bytes())?;
        files::write_hosts(&p.dir, hostname, ips)?;
        files::write_resolv_conf(&p, dns, &self.cfg.host_resolv_conf)?;

        let shm_path = if spec.namespaces.ipc == NamespaceMode::Node {
            None
        } else {
            ensure_dir(&p.shm, 0o755)?;
            if !is_mounted(&p.shm)? {
                mount_shm(&p.shm, self.cfg.shm_size)?;
            }
            Some(p.shm.clone())
        };

        let scratch_path = match &self.pool {
            Some(pool) => {
                self.create_scratch(pool, &p).await?;
                Some(p.scratch.clone())
            }
            None => None,
        };

        if let Some(dir) = &spec.log_directory {
            create_log_directory(dir)?;
        }

        Ok(StorageStatus {
            sandbox_dir: p.dir.clone(),
            hostname_path: p.hostname,
            hosts_path: p.hosts,
            resolv_conf_path: p.resolv_conf,
            shm_path,
            scratch_path,
        })
    }

    async fn create_scratch(
        &self,
        pool: &ScratchPool,
        p: &SandboxPaths,
    ) -> Result<(), StorageError> {
        ensure_dir(&p.scratch, 0o755)?;
        if is_mounted(&p.scratch)? {
            return Ok(());
        }
        let have_image = match fs::symlink_metadata(&p.scratch_image) {
            Ok(m) if m.file_type().is_file() => true,
            Ok(_) => {
                return Err(StorageError::UnsafePath {
                    path: p.scratch_image.clone(),
                    reason: "is not a regular file",
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(StorageError::io("inspect", &p.scratch_image, e)),
        };
        if !have_image {
            match pool.take() {
                Some(img) => fs::rename(&img, &p.scratch_image)
                    .map_err(|e| StorageError::io("move scratch image", &img, e))?,
                None => {
                    tracing::warn!(dir = %p.dir.display(), "scratch pool empty, formatting inline");
                    if let Err(e) =
                        scratch::format_image(&p.scratch_image, pool.config().image_size).await
                    {
                        let _ = fs::remove_file(&p.scratch_image);
                        return Err(e);
                    }
                }
            }
        }
        scratch::mount_image(&p.scratch_image, &p.scratch).await
    }

    /// Unmounts the sandbox's scratch and shm, keeping its files. Absent is fine.
    pub fn destroy_sandbox(&self, id: &SandboxId) -> Result<(), StorageError> {
        let p = self.paths(id);
        if !check_sandbox_dir(&self.sandboxes_dir(), &p.dir)? {
            return Ok(());
        }
        unmount_sandbox(&p)?;
        Ok(())
    }

    /// Unmounts what is still mounted and removes the sandbox directory.
    /// Never follows a symlink and never descends into a foreign mount;
    /// the CRI log directory is kubelet's and is left alone. Absent is fine.
    pub fn cleanup_sandbox(&self, id: &SandboxId) -> Result<(), StorageError> {
        let p = self.paths(id);
        if !check_sandbox_dir(&self.sandboxes_dir(), &p.dir)? {
            return Ok(());
        }
        unmount_sandbox(&p)?;
        // A bind mount from the same filesystem keeps the device number,
        // so the removal's device check cannot see it: look for mounts
        // first, entry by entry (or, on a kernel that cannot tell, in the
        // mount table, whose size grows with every pod on the node).
        let foreign = match first_mount(&p.dir)? {
            Some(found) => found,
            None => {
                let canon =
                    fs::canonicalize(&p.dir).map_err(|e| StorageError::io("resolve", &p.dir, e))?;
                mount_table()?
                    .into_iter()
                    .map(|m| m.mount_point)
                    .find(|m| m.starts_with(&canon))
            }
        };
        if let Some(path) = foreign {
            return Err(StorageError::UnsafePath {
                path,
                reason: "a mount not made by the storage provider is inside the sandbox directory",
            });
        }
        remove_tree(&p.dir)
    }

    /// Reclaims sandbox directories and shm/scratch mounts under the root
    /// that belong to no sandbox in `live`. The mounts and the directories
    /// are each listed first and `live` asked afterwards (see
    /// [`LiveSandboxes`]), so a sandbox whose create starts during the pass
    /// is never reclaimed under it; once `live` cannot be read nothing
    /// further is removed. Entries that are not sandbox ids, and symlinks,
    /// are left alone.
    pub fn gc(&self, live: &dyn LiveSandboxes) -> Result<GcReport, StorageError> {
        let mut report = GcReport::default();
        let sandboxes = self.sandboxes_dir();
        match fs::symlink_metadata(&sandboxes) {
            Ok(m) if m.file_type().is_dir() => {}
            Ok(_) => {
                return Err(StorageError::UnsafePath {
                    path: sandboxes,
                    reason: "is not a real directory",
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(report),
            Err(e) => return Err(StorageError::io("inspect", &sandboxes, e)),
        }
        let canon =
            fs::canonicalize(&sandboxes).map_err(|e| StorageError::io("resolve", &sandboxes, e))?;

        // Mounts first, deepest first, so directory removal finds none.
        let mut candidates: Vec<(SandboxId, PathBuf, bool)> = Vec::new();
        for m in mount_table()? {
            let Ok(rel) = m.mount_point.strip_prefix(&canon) else {
                continue;
            };
            let parts: Vec<Component<'_>> = rel.components().collect();
            let [Component::Normal(id), Component::Normal(leaf)] = parts[..] else {
                continue;
            };
            let Some(id) = id.to_str().and_then(SandboxId::parse) else {
                continue;
            };
            let is_scratch = leaf == "scratch";
            if is_scratch || leaf == "shm" {
                candidates.push((id, m.mount_point.clone(), is_scratch));
            }
        }
        let mut orphan_mounts: Vec<(PathBuf, bool)> = Vec::new();
        if !candidates.is_empty() {
            let Some(now) = live.now() else {
                return Ok(report);
            };
            for (id, mount_point, is_scratch) in candidates {
                if !now.contains(&id) && !orphan_mounts.iter().any(|(p, _)| *p == mount_point) {
                    orphan_mounts.push((mount_point, is_scratch));
                }
            }
        }
        for (mount_point, is_scratch) in orphan_mounts {
            match unmount_all(&mount_point) {
                Ok(n) => report.mounts += n,
                Err(e) => report.errors.push(e),
            }
            if is_scratch {
                if let Some(dir) = mount_point.parent() {
                    if let Err(e) = scratch::detach_loops(&dir.join("scratch.img")) {
                        report.errors.push(e);
                    }
                }
            }
        }

        let entries = match fs::read_dir(&sandboxes) {
            Ok(it) => it
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| StorageError::io("read directory", &sandboxes, e))?,
            Err(e) => return Err(StorageError::io("read directory", &sandboxes, e)),
        };
        if entries.is_empty() {
            return Ok(report);
        }
        let Some(now) = live.now() else {
            return Ok(report);
        };
        for entry in entries {
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(SandboxId::parse) else {
                tracing::debug!(entry = ?name, "gc: not a sandbox directory, left alone");
                continue;
            };
            if now.contains(&id) {
                continue;
            }
            match entry.file_type() {
                Ok(t) if t.is_dir() => {}
                _ => {
                    tracing::warn!(entry = ?name, "gc: not a real directory, left alone");
                    continue;
                }
            }
            match self.cleanup_sandbox(&id) {
                Ok(()) => report.dirs += 1,
                Err(e) => report.errors.push(e),
            }
        }
        Ok(report)
    }
}

/// Creates the CRI log directory (and missing parents) if absent, the leaf
/// with exactly mode 0755. An existing directory is left as it is.
fn create_log_directory(dir: &std::path::Path) -> Result<(), StorageError> {
    if fs::metadata(dir).is_ok_and(|m| m.is_dir()) {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(LOG_DIR_MODE)
        .create(dir)
        .map_err(|e| StorageError::io("create log directory", dir, e))?;
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(dir, fs::Permissions::from_mode(LOG_DIR_MODE))
        .map_err(|e| StorageError::io("set mode of", dir, e))
}

/// Unmounts scratch then shm of one sandbox whose directory was checked.
fn unmount_sandbox(p: &SandboxPaths) -> Result<usize, StorageError> {
    let mut n = 0;
    for target in p.mount_points() {
        n += unmount_all(target)?;
    }
    scratch::detach_loops(&p.scratch_image)?;
    Ok(n)
}

impl Drop for LocalStorage {
    fn drop(&mut self) {
        let filler = self.filler.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = filler.take() {
            h.abort();
        }
    }
}

#[async_trait]
impl Flow for LocalStorage {
    async fn init(&self) -> Result<(), StepError> {
        Ok(self.init_storage().await?)
    }

    async fn create(&self, ctx: &FlowContext) -> Result<(), StepError> {
        // The network step usually runs beside this one; if it already
        // published (a later-stage configuration), use its addresses.
        let ips = ctx
            .get::<NetworkStatus>()
            .map(|n| n.ips)
            .unwrap_or_default();
        let shell = ctx.get::<StorageStatus>().filter(|_| ctx.claimed());
        let status = match shell {
            Some(shell) => {
                self.finish_shell(ctx.sandbox_id(), ctx.spec(), &ips, shell)
                    .await?
            }
            None => {
                self.create_sandbox(ctx.sandbox_id(), ctx.spec(), &ips)
                    .await?
            }
        };
        ctx.publish(status);
        Ok(())
    }

    async fn prewarm(&self, ctx: &FlowContext) -> Result<(), StepError> {
        let status = self.prepare_shell(ctx.sandbox_id()).await?;
        ctx.publish(status);
        Ok(())
    }

    /// A claimed shell's `create` writes the pod's hostname, hosts and
    /// resolv.conf into the shell's directory, which its `cleanup` removes
    /// whole. The CRI log directory lies outside it (and no teardown
    /// removes one: it is the client's, made by kubelet before the call),
    /// so a pod whose log directory is not there yet is not confined.
    fn confined_to_shell(&self, ctx: &FlowContext) -> bool {
        let in_shell = ctx
            .get::<StorageStatus>()
            .is_some_and(|s| ctx.claimed() && s.sandbox_dir == self.paths(ctx.sandbox_id()).dir);
        in_shell
            && ctx
                .spec()
                .log_directory
                .as_deref()
                .is_none_or(std::path::Path::is_dir)
    }

    async fn destroy(&self, ctx: &FlowContext) -> Result<(), StepError> {
        // Umounts block: off the async workers, on this thread (its mount
        // namespace).
        Ok(blocking(|| self.destroy_sandbox(ctx.sandbox_id()))?)
    }

    async fn cleanup(&self, ctx: &FlowContext) -> Result<(), StepError> {
        Ok(blocking(|| self.cleanup_sandbox(ctx.sandbox_id()))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cubelet_engine::spec::{DnsConfig, NamespaceOptions};
    use std::collections::HashSet;
    use std::path::Path;

    /// A provider under a temp root with a fake host resolv.conf. IPC is
    /// the node's in every spec here, so nothing is mounted.
    fn setup() -> (tempfile::TempDir, LocalStorage) {
        let tmp = tempfile::tempdir().unwrap();
        let host = tmp.path().join("host-resolv.conf");
        fs::write(&host, "nameserver 192.0.2.53\nsearch node.example\n").unwrap();
        let mut cfg = StorageConfig::new(tmp.path().join("root"));
        cfg.host_resolv_conf = host;
        (tmp, LocalStorage::new(cfg))
    }

    fn spec() -> SandboxSpec {
        SandboxSpec {
            name: "web-0".into(),
            hostname: "web-host".into(),
            namespaces: NamespaceOptions {
                ipc: NamespaceMode::Node,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn id() -> SandboxId {
        SandboxId::new_unchecked("0123abcd")
    }

    fn read(p: &Path) -> String {
        fs::read_to_string(p).unwrap()
    }

    #[tokio::test]
    async fn custom_dns_is_rendered() {
        let (_tmp, s) = setup();
        let mut spec = spec();
        spec.dns = Some(DnsConfig {
            servers: vec!["10.96.0.10".into()],
            searches: vec!["default.svc.cluster.local".into(), "cluster.local".into()],
            options: vec!["ndots:5".into()],
        });
        let st = s.create_sandbox(&id(), &spec, &[]).await.unwrap();
        assert_eq!(
            read(&st.resolv_conf_path),
            "nameserver 10.96.0.10\nsearch default.svc.cluster.local cluster.local\noptions ndots:5\n"
        );
        assert_eq!(read(&st.hostname_path), "web-host\n");
        assert_eq!(
            read(&st.hosts_path),
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tweb-host\n"
        );
        assert_eq!(st.shm_path, None);
        assert_eq!(st.scratch_path, None);
        assert_eq!(st.sandbox_dir, s.paths(&id()).dir);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            fs::metadata(&st.sandbox_dir).unwrap().permissions().mode() & 0o7777,
            0o711
        );
        s.cleanup_sandbox(&id()).unwrap();
        assert!(!st.sandbox_dir.exists());
    }

    #[tokio::test]
    async fn no_dns_copies_host() {
        let (tmp, s) = setup();
        let st = s.create_sandbox(&id(), &spec(), &[]).await.unwrap();
        assert_eq!(
            read(&st.resolv_conf_path),
            read(&tmp.path().join("host-resolv.conf"))
        );
    }

    #[tokio::test]
    async fn host_network_copies_host_even_with_dns() {
        let (tmp, s) = setup();
        let mut spec = spec();
        spec.namespaces.network = NamespaceMode::Node;
        spec.dns = Some(DnsConfig {
            servers: vec!["10.96.0.10".into()],
            ..Default::default()
        });
        let st = s.create_sandbox(&id(), &spec, &[]).await.unwrap();
        assert_eq!(
            read(&st.resolv_conf_path),
            read(&tmp.path().join("host-resolv.conf"))
        );
    }

    #[tokio::test]
    async fn empty_dns_copies_host() {
        let (tmp, s) = setup();
        let mut spec = spec();
        spec.dns = Some(DnsConfig::default());
        let st = s.create_sandbox(&id(), &spec, &[]).await.unwrap();
        assert_eq!(
            read(&st.resolv_conf_path),
            read(&tmp.path().join("host-resolv.conf"))
        );
    }

    #[tokio::test]
    async fn empty_hostname_uses_pod_name() {
        let (_tmp, s) = setup();
        let mut spec = spec();
        spec.hostname.clear();
        let st = s.create_sandbox(&id(), &spec, &[]).await.unwrap();
        assert_eq!(read(&st.hostname_path), "web-0\n");
        assert!(read(&st.hosts_path).contains("127.0.1.1\tweb-0\n"));
        // The caller adds the pod IP once the network step is done.
        files::write_hosts(&st.sandbox_dir, "web-0", &["10.86.0.7".parse().unwrap()]).unwrap();
        assert!(read(&st.hosts_path).ends_with("10.86.0.7\tweb-0\n"));
    }

    #[tokio::test]
    async fn create_is_idempotent_and_log_dir_is_made_and_kept() {
        let (tmp, s) = setup();
        let mut spec = spec();
        let logs = tmp.path().join("logs/ns_web-0_uid");
        spec.log_directory = Some(logs.clone());
        s.create_sandbox(&id(), &spec, &[]).await.unwrap();
        s.create_sandbox(&id(), &spec, &[]).await.unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            fs::metadata(&logs).unwrap().permissions().mode() & 0o7777,
            0o755
        );
        s.destroy_sandbox(&id()).unwrap();
        s.cleanup_sandbox(&id()).unwrap();
        s.cleanup_sandbox(&id()).unwrap();
        assert!(logs.is_dir(), "kubelet owns the log directory");
    }

    #[test]
    fn only_a_claim_of_its_own_shell_with_the_log_directory_made_is_confined() {
        let (tmp, s) = setup();
        let p = s.paths(&id());
        let shell = StorageStatus {
            sandbox_dir: p.dir.clone(),
            hostname_path: p.hostname,
            hosts_path: p.hosts,
            resolv_conf_path: p.resolv_conf,
            shm_path: Some(p.shm),
            scratch_path: None,
        };
        let logs = tmp.path().join("logs/ns_web-0_uid");
        let mut spec = spec();
        spec.log_directory = Some(logs.clone());
        let claim = |spec: &SandboxSpec, shell: StorageStatus| {
            FlowContext::new(id(), std::sync::Arc::new(spec.clone())).with_shell(
                cubelet_engine::SandboxOutputs {
                    storage: Some(shell),
                    ..Default::default()
                },
            )
        };
        // The log directory would be made outside the shell.
        assert!(!s.confined_to_shell(&claim(&spec, shell.clone())));
        fs::create_dir_all(&logs).unwrap();
        assert!(s.confined_to_shell(&claim(&spec, shell.clone())));
        spec.log_directory = None;
        assert!(s.confined_to_shell(&claim(&spec, shell.clone())));
        // Not a claim; another directory.
        let cold = FlowContext::new(id(), std::sync::Arc::new(spec.clone()));
        cold.publish(shell.clone());
        assert!(!s.confined_to_shell(&cold));
        let elsewhere = StorageStatus {
            sandbox_dir: tmp.path().join("elsewhere"),
            ..shell
        };
        assert!(!s.confined_to_shell(&claim(&spec, elsewhere)));
    }

    #[tokio::test]
    async fn bad_input_is_refused_before_anything_is_created() {
        let (tmp, s) = setup();
        for bad in ["relative", "/a/../b", "/x/.."] {
            let mut spec = spec();
            spec.log_directory = Some(PathBuf::from(bad));
            let err = s.create_sandbox(&id(), &spec, &[]).await.unwrap_err();
            let step = StepError::from(err);
            assert_eq!(step.kind(), cubelet_engine::StepErrorKind::InvalidArgument);
            assert!(step.to_string().contains("log_directory"), "{step}");
        }
        let mut spec = spec();
        spec.hostname = "evil\n10.0.0.1 bank".into();
        assert!(s.create_sandbox(&id(), &spec, &[]).await.is_err());
        assert!(!tmp.path().join("root").exists(), "nothing may be created");
    }

    #[tokio::test]
    async fn teardown_of_unknown_sandbox_is_fine() {
        let (_tmp, s) = setup();
        s.destroy_sandbox(&id()).unwrap();
        s.cleanup_sandbox(&id()).unwrap();
        assert!(s.gc(&HashSet::new()).unwrap().dirs == 0);
    }

    /// A store that cannot be read.
    struct Unreadable;

    impl LiveSandboxes for Unreadable {
        fn now(&self) -> Option<HashSet<SandboxId>> {
            None
        }
    }

    #[tokio::test]
    async fn gc_removes_nothing_when_the_live_sandboxes_cannot_be_read() {
        let (_tmp, s) = setup();
        s.ensure_root().unwrap();
        let dir = s.paths(&id()).dir;
        fs::create_dir(&dir).unwrap();
        assert_eq!(s.gc(&Unreadable).unwrap().dirs, 0);
        assert!(dir.is_dir());
        assert_eq!(s.gc(&HashSet::new()).unwrap().dirs, 1);
        assert!(!dir.exists());
    }

    #[tokio::test]
    async fn cleanup_refuses_symlinked_sandbox_dir() {
        let (tmp, s) = setup();
        let outside = tmp.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("precious"), "x").unwrap();
        s.ensure_root().unwrap();
        std::os::unix::fs::symlink(&outside, s.paths(&id()).dir).unwrap();
        assert!(matches!(
            s.cleanup_sandbox(&id()),
            Err(StorageError::UnsafePath { .. })
        ));
        assert!(matches!(
            s.destroy_sandbox(&id()),
            Err(StorageError::UnsafePath { .. })
        ));
        let report = s.gc(&HashSet::new()).unwrap();
        assert_eq!(report.dirs, 0);
        assert_eq!(read(&outside.join("precious")), "x");
    }

    #[tokio::test]
    async fn flow_publishes_status() {
        let (_tmp, s) = setup();
        let ctx = FlowContext::new(id(), Arc::new(spec()));
        Flow::init(&s).await.unwrap();
        Flow::create(&s, &ctx).await.unwrap();
        let st = ctx.get::<StorageStatus>().unwrap();
        assert!(st.hosts_path.is_file());
        Flow::destroy(&s, &ctx).await.unwrap();
        Flow::cleanup(&s, &ctx).await.unwrap();
        assert!(!st.sandbox_dir.exists());
    }

    #[tokio::test]
    async fn root_dir_may_be_a_symlink_but_sandboxes_may_not() {
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir(tmp.path().join("real")).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("real"), tmp.path().join("link")).unwrap();
        let mut cfg = StorageConfig::new(tmp.path().join("link"));
        cfg.host_resolv_conf = tmp.path().join("absent-resolv.conf");
        let s = LocalStorage::new(cfg);
        let st = s.create_sandbox(&id(), &spec(), &[]).await.unwrap();
        assert_eq!(
            read(&st.resolv_conf_path),
            "",
            "no host resolv.conf gives an empty one"
        );
        s.cleanup_sandbox(&id()).unwrap();
        assert!(tmp.path().join("real/sandboxes").is_dir());

        fs::remove_dir(tmp.path().join("real/sandboxes")).unwrap();
        fs::create_dir(tmp.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(
            tmp.path().join("elsewhere"),
            tmp.path().join("real/sandboxes"),
        )
        .unwrap();
        assert!(matches!(
            s.create_sandbox(&id(), &spec(), &[]).await,
            Err(StorageError::UnsafePath { .. })
        ));
        assert!(matches!(
            s.gc(&HashSet::new()),
            Err(StorageError::UnsafePath { .. })
        ));
        assert!(fs::read_dir(tmp.path().join("elsewhere"))
            .unwrap()
            .next()
            .is_none());
    }

    #[test]
    fn bad_config_is_refused() {
        let mut cfg = StorageConfig::new("relative");
        assert!(matches!(cfg.validate(), Err(StorageError::Config(_))));
        cfg.root_dir = "/var/lib/../x".into();
        assert!(cfg.validate().is_err());
        cfg.root_dir = "/var/lib/cubelet".into();
        cfg.validate().unwrap();
        cfg.shm_size = 0;
        assert!(cfg.validate().is_err());
    }
}
