//! Images in containerd: pull from registries into the content store,
//! unpack into snapshots, list, inspect and remove image records.
//!
//! A pull runs under a containerd lease so that garbage collection cannot
//! take half-written content; content carries containerd's GC reference
//! labels (index → manifests → config and layers, config → top snapshot), so
//! once the lease is deleted GC keeps exactly what image records reference.

pub(crate) mod content;
mod direct;
pub use direct::DirectContent;
mod fs;
pub(crate) mod unpack;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use containerd_client::services::v1::{
    CreateImageRequest, DeleteImageRequest, Image, ListImagesRequest, UpdateImageRequest,
};
use containerd_client::types::Descriptor as PbDescriptor;
use cubelet_registry::media::{self, decode_config, decode_index, decode_manifest};
use cubelet_registry::platform::{config_matches, pick_manifest};
use cubelet_registry::{
    host_platform, hosts_for, parse_reference, ImageDocuments, RegistryClient,
    DEFAULT_PROGRESS_TIMEOUT,
};
use futures::future::{BoxFuture, FutureExt as _, WeakShared};
use futures::{StreamExt as _, TryStreamExt as _};
use oci_spec::image::{Config, MediaType, Platform};

pub use cubelet_registry::RegistryAuth;
pub use fs::{usage, FsUsage};

use crate::client::Containerd;
use crate::error::RuntimeError;
use crate::types::{ImageConfig, ImageInfo};
use content::Store;

/// Snapshotter used unless configured otherwise.
pub const DEFAULT_SNAPSHOTTER: &str = "overlayfs";
/// The image config in `data`, refused unless it is for `platform`.
fn checked_config(
    name: &str,
    data: &[u8],
    platform: &Platform,
) -> Result<oci_spec::image::ImageConfiguration, RuntimeError> {
    let config = decode_config(data)?;
    if !config_matches(&config, platform) {
        return Err(RuntimeError::ImageFormat {
            reference: name.to_owned(),
            reason: format!("image is for {}/{}", config.os(), config.architecture()),
        });
    }
    Ok(config)
}

/// Layers of one pull downloaded at once unless configured otherwise
/// (containerd's CRI `max_concurrent_downloads` default).
pub const DEFAULT_MAX_CONCURRENT_DOWNLOADS: usize = 3;
/// Image-record label containerd's CRI uses to pin images (never GC'd by kubelet).
pub const LABEL_PINNED: &str = "io.cri-containerd.pinned";
/// Image-record label marking images managed by a CRI runtime.
pub const LABEL_MANAGED: &str = "io.cri-containerd.image";

/// Image operations on one containerd namespace, for the host's platform.
/// Cheap to clone; clones share their cache.
#[derive(Debug, Clone)]
pub struct ImageService {
    cd: Containerd,
    registry_config_dir: PathBuf,
    snapshotter: String,
    platform: Platform,
    /// A pull fails when a registry sends nothing for this long (`None`:
    /// never).
    progress_timeout: Option<Duration>,
    /// Layers of one pull downloaded at once (at least 1).
    max_concurrent_downloads: usize,
    /// What each image record's manifest and config say, by (record name,
    /// target digest). Content is addressed by digest and never changes,
    /// so an entry is right for as long as its record points at that
    /// target; only records that still exist are kept.
    documents: Arc<Mutex<HashMap<(String, String), ImageInfo>>>,
    /// Pulls under way, which a pull of the same reference with the same
    /// credentials joins instead of downloading the image again.
    pulls: Arc<Mutex<Vec<InFlightPull>>>,
    /// Told when each pull (not each join) starts and ends.
    observer: Option<Arc<dyn PullObserver>>,
    /// Layers written into containerd's content directory, when usable.
    direct: Option<Arc<DirectContent>>,
}

/// The result of one pull, shared by every caller that joined it.
type PullResult = Result<ImageInfo, Arc<RuntimeError>>;

/// A pull under way: the normalised reference and credentials it was
/// asked with, and a handle that does not keep it alive (when every caller
/// has gone, the pull is dropped and cancelled as an unshared one is).
struct InFlightPull {
    name: String,
    auth: Option<RegistryAuth>,
    pull: WeakShared<BoxFuture<'static, PullResult>>,
}

impl std::fmt::Debug for InFlightPull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlightPull")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Told about every image pull an [`ImageService`] makes: a pull another
/// caller joined is reported once. Metrics implement it.
pub trait PullObserver: Send + Sync + std::fmt::Debug {
    /// A pull started.
    fn pull_started(&self);
    /// A pull ended after `elapsed`: `size` is the image's size (its
    /// manifest's layers and config) when it succeeded, `None` when it
    /// failed.
    fn pull_finished(&self, size: Option<u64>, elapsed: Duration);
}

/// One image (grouped by config digest) with the records naming it.
#[derive(Debug, Clone)]
struct Resolved {
    info: ImageInfo,
    records: Vec<String>,
}

fn pb_descriptor(media_type: &str, digest: &str, size: usize) -> PbDescriptor {
    PbDescriptor {
        media_type: media_type.to_owned(),
        digest: digest.to_owned(),
        size: i64::try_from(size).unwrap_or(i64::MAX),
        annotations: HashMap::new(),
    }
}

fn is_image_id(s: &str) -> Option<String> {
    let hex = s.strip_prefix("sha256:").unwrap_or(s);
    (hex.len() == 64 && hex.chars().all(|c| c.is_ascii_hexdigit())).then(|| format!("sha256:{hex}"))
}

impl ImageService {
    /// Image operations over `containerd`, reading registry host configs
    /// (`<host>/hosts.toml`) from `registry_config_dir`.
    pub fn new(containerd: Containerd, registry_config_dir: impl Into<PathBuf>) -> Self {
        Self {
            cd: containerd,
            registry_config_dir: registry_config_dir.into(),
            snapshotter: DEFAULT_SNAPSHOTTER.to_owned(),
            platform: host_platform(),
            progress_timeout: Some(DEFAULT_PROGRESS_TIMEOUT),
            max_concurrent_downloads: DEFAULT_MAX_CONCURRENT_DOWNLOADS,
            documents: Arc::default(),
            pulls: Arc::default(),
            observer: None,
            direct: None,
        }
    }

    /// Writes pulled layers into containerd's content directory through
    /// `direct` instead of streaming them through its content API, once a
    /// probe shows containerd sees the blobs written there; otherwise
    /// (logged) they keep streaming.
    pub async fn with_direct_content(mut self, direct: Arc<DirectContent>) -> Self {
        match Store::new(&self.cd).sees_direct_blobs(&direct).await {
            Ok(true) => {
                tracing::info!("layers are written into containerd's content directory");
                self.direct = Some(direct);
            }
            Ok(false) => {
                direct.disable("a probe blob linked into the directory was not seen by containerd");
            }
            Err(e) => {
                tracing::warn!(error = %e, "probing direct content writes failed; layers go through containerd's content API");
                direct.disable("the probe failed");
            }
        }
        self
    }

    /// Reports every pull (start, end, size, duration) to `observer`.
    pub fn with_pull_observer(mut self, observer: Arc<dyn PullObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Fails a pull when a registry sends nothing for `timeout` (containerd's
    /// `image_pull_progress_timeout`; default five minutes); zero never does.
    pub fn with_pull_progress_timeout(mut self, timeout: Duration) -> Self {
        self.progress_timeout = Some(timeout).filter(|t| !t.is_zero());
        self
    }

    /// Downloads up to `n` layers of one pull at once (containerd's
    /// `max_concurrent_downloads`; default 3); 0 counts as 1.
    pub fn with_max_concurrent_downloads(mut self, n: usize) -> Self {
        self.max_concurrent_downloads = n.max(1);
        self
    }

    /// Uses `snapshotter` instead of overlayfs.
    pub fn with_snapshotter(mut self, snapshotter: &str) -> Self {
        snapshotter.clone_into(&mut self.snapshotter);
        self
    }

    /// The snapshotter images are unpacked into.
    pub fn snapshotter(&self) -> &str {
        &self.snapshotter
    }

    /// The containerd connection.
    pub fn containerd(&self) -> &Containerd {
        &self.cd
    }

    /// The platform images are pulled and run for (the host's).
    pub fn platform(&self) -> &Platform {
        &self.platform
    }

    /// Pulls `reference` (normalised as containerd does), stores it in the
    /// content store, unpacks it and records it under its normalised name
    /// (and `repo@digest`). Pulling what is already present is cheap and
    /// succeeds. A reference the registry does not know is `NotFound`.
    ///
    /// Concurrent pulls of one reference with the same credentials are one
    /// download: later callers join the pull under way and get its result
    /// (a failure included). Different credentials never share a pull, so
    /// a caller without the right ones cannot ride on one that has them.
    /// When every caller of a pull has gone, it is cancelled.
    pub async fn pull(
        &self,
        reference: &str,
        auth: Option<RegistryAuth>,
    ) -> Result<ImageInfo, RuntimeError> {
        let name = parse_reference(reference)?.to_string();
        let shared = {
            let mut pulls = self.pulls.lock().unwrap_or_else(|p| p.into_inner());
            // Forget pulls that ended or that every caller left.
            pulls.retain(|p| p.pull.upgrade().is_some_and(|s| s.peek().is_none()));
            let joined = pulls
                .iter()
                .find(|p| p.name == name && p.auth == auth)
                .and_then(|p| p.pull.upgrade());
            match joined {
                Some(shared) => {
                    tracing::debug!(image = %name, "joining a pull under way");
                    shared
                }
                None => {
                    let this = self.clone();
                    let reference = reference.to_owned();
                    let creds = auth.clone();
                    let fut: BoxFuture<'static, PullResult> = Box::pin(async move {
                        this.observed_pull(&reference, creds)
                            .await
                            .map_err(Arc::new)
                    });
                    let shared = fut.shared();
                    if let Some(weak) = shared.downgrade() {
                        pulls.push(InFlightPull {
                            name,
                            auth,
                            pull: weak,
                        });
                    }
                    shared
                }
            }
        };
        // The last caller to see the result gets the error itself; the
        // others share it.
        shared
            .await
            .map_err(|e| Arc::try_unwrap(e).unwrap_or_else(RuntimeError::Shared))
    }

    /// [`Self::pull_once`], reported to the observer.
    async fn observed_pull(
        &self,
        reference: &str,
        auth: Option<RegistryAuth>,
    ) -> Result<ImageInfo, RuntimeError> {
        let Some(observer) = self.observer.clone() else {
            return self.pull_once(reference, auth).await;
        };
        observer.pull_started();
        let started = std::time::Instant::now();
        // Reported on every path, a cancelled pull included.
        struct Done {
            observer: Arc<dyn PullObserver>,
            started: std::time::Instant,
            size: Option<u64>,
        }
        impl Drop for Done {
            fn drop(&mut self) {
                self.observer
                    .pull_finished(self.size, self.started.elapsed());
            }
        }
        let mut done = Done {
            observer,
            started,
            size: None,
        };
        let pulled = self.pull_once(reference, auth).await;
        if let Ok(info) = &pulled {
            done.size = Some(info.size);
        }
        pulled
    }

    /// One pull, shared by nobody.
    async fn pull_once(
        &self,
        reference: &str,
        auth: Option<RegistryAuth>,
    ) -> Result<ImageInfo, RuntimeError> {
        let r = parse_reference(reference)?;
        let name = r.to_string();
        let hosts = hosts_for(&self.registry_config_dir, r.registry())?;
        let client =
            RegistryClient::new(hosts, &r, auth)?.with_progress_timeout(self.progress_timeout);
        let not_found = || RuntimeError::NotFound {
            kind: "image",
            id: reference.to_owned(),
        };
        let (host, docs) = client
            .fetch_image(&r, &self.platform)
            .await?
            .ok_or_else(not_found)?;

        let store = Store::leased(&self.cd, "pull")
            .await?
            .with_direct(self.direct.clone());
        let result = async {
            let config = checked_config(&name, &docs.config, &self.platform)?;
            // Layers download side by side, as containerd's do (one stream
            // rarely fills the link or the CPU that hashes it), and each is
            // unpacked as soon as it and those below it are stored.
            let layers: Vec<(String, u64)> = docs
                .parsed
                .layers()
                .iter()
                .map(|l| (l.digest().to_string(), l.size()))
                .collect();
            let (client, store) = (&client, &store);
            let started = std::time::Instant::now();
            let (stored_tx, stored_rx) = tokio::sync::watch::channel(0usize);
            let image = name.as_str();
            let download = async move {
                let mut done = futures::stream::iter(layers)
                    .map(move |(digest, size)| async move {
                        if store.reuse(&digest, &HashMap::new()).await? {
                            return Ok::<(), RuntimeError>(());
                        }
                        let body = client.blob_stream(host, &digest, size).await?;
                        let stream = body.map_err(RuntimeError::from);
                        store.write(&digest, size, HashMap::new(), stream).await
                    })
                    .buffered(self.max_concurrent_downloads);
                let mut n = 0;
                while let Some(layer) = done.next().await {
                    layer?;
                    n += 1;
                    stored_tx.send_replace(n);
                }
                tracing::debug!(image, elapsed = ?started.elapsed(), "layers stored");
                Ok(())
            };
            let unpacked = unpack::unpack(
                store,
                &self.snapshotter,
                &name,
                docs.parsed.layers(),
                config.rootfs().diff_ids(),
                stored_rx,
            );
            let ((), top_chain) = tokio::try_join!(download, unpacked)?;
            tracing::debug!(image = %name, elapsed = ?started.elapsed(), "layers unpacked");
            let mut names = vec![name.clone()];
            if r.digest().is_none() {
                names.push(r.clone_with_digest(docs.top.digest.clone()).to_string());
            }
            let mut labels = HashMap::from([(LABEL_MANAGED.to_owned(), "managed".to_owned())]);
            crate::reclaim::owner::mark(&mut labels);
            self.commit(store, &names, &docs, labels, Some(top_chain))
                .await
        }
        .await;
        let released = store.release().await;
        result?;
        released?;
        self.status(&name).await?.ok_or_else(not_found)
    }

    /// Writes config, manifest and index (layers must already be stored
    /// under `store`'s lease), unpacks unless `unpacked` names the top
    /// layer's chain id already, and creates or updates the image records
    /// `names` with `labels`.
    pub(crate) async fn commit(
        &self,
        store: &Store,
        names: &[String],
        docs: &ImageDocuments,
        labels: HashMap<String, String>,
        unpacked: Option<String>,
    ) -> Result<(), RuntimeError> {
        let name = names.first().cloned().unwrap_or_default();
        let config = checked_config(&name, &docs.config, &self.platform)?;
        let config_digest = docs.parsed.config().digest().to_string();
        store
            .put(&config_digest, docs.config.clone(), HashMap::new())
            .await?;

        let mut mlabels = HashMap::from([(
            "containerd.io/gc.ref.content.config".to_owned(),
            config_digest.clone(),
        )]);
        for (i, l) in docs.parsed.layers().iter().enumerate() {
            mlabels.insert(
                format!("containerd.io/gc.ref.content.l.{i}"),
                l.digest().to_string(),
            );
        }
        store
            .put(&docs.manifest.digest, docs.manifest.data.clone(), mlabels)
            .await?;
        if let Some(pick) = docs.index_pick {
            let ilabels = HashMap::from([(
                format!("containerd.io/gc.ref.content.m.{pick}"),
                docs.manifest.digest.clone(),
            )]);
            store
                .put(&docs.top.digest, docs.top.data.clone(), ilabels)
                .await?;
        }

        let top_chain = match unpacked {
            Some(top) => top,
            None => {
                let layers = docs.parsed.layers();
                let all_stored = tokio::sync::watch::channel(layers.len()).1;
                let diff_ids = config.rootfs().diff_ids();
                unpack::unpack(
                    store,
                    &self.snapshotter,
                    &name,
                    layers,
                    diff_ids,
                    all_stored,
                )
                .await?
            }
        };
        let snap_label = HashMap::from([(
            format!("containerd.io/gc.ref.snapshot.{}", self.snapshotter),
            top_chain,
        )]);
        store.set_labels(&config_digest, &snap_label).await?;

        let target = pb_descriptor(
            docs.top.media_type.as_ref(),
            &docs.top.digest,
            docs.top.data.len(),
        );
        for n in names {
            self.put_record(store, n, &target, &labels).await?;
        }
        Ok(())
    }

    async fn put_record(
        &self,
        store: &Store,
        name: &str,
        target: &PbDescriptor,
        labels: &HashMap<String, String>,
    ) -> Result<(), RuntimeError> {
        let image = Image {
            name: name.to_owned(),
            labels: labels.clone(),
            target: Some(target.clone()),
            created_at: None,
            updated_at: None,
        };
        let create = CreateImageRequest {
            image: Some(image.clone()),
            source_date_epoch: None,
        };
        match self.cd.images().create(store.req(create)).await {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                let update = UpdateImageRequest {
                    image: Some(image),
                    update_mask: None,
                    source_date_epoch: None,
                };
                self.cd
                    .images()
                    .update(store.req(update))
                    .await
                    .map_err(|s| RuntimeError::containerd("images.update", s))?;
                Ok(())
            }
            Err(s) => Err(RuntimeError::containerd("images.create", s)),
        }
    }

    /// Every image, one entry per image id (config digest).
    pub async fn list(&self) -> Result<Vec<ImageInfo>, RuntimeError> {
        Ok(self
            .resolve_all()
            .await?
            .into_iter()
            .map(|r| r.info)
            .collect())
    }

    /// The image named by `reference_or_id` (a reference, `sha256:<id>` or a
    /// bare 64-hex id), or `None`.
    pub async fn status(&self, reference_or_id: &str) -> Result<Option<ImageInfo>, RuntimeError> {
        Ok(self.find(reference_or_id).await?.map(|r| r.info))
    }

    /// Removes every record of the image named by `reference_or_id`;
    /// containerd's GC then removes its content and snapshots. Absent is Ok.
    pub async fn remove(&self, reference_or_id: &str) -> Result<(), RuntimeError> {
        let Some(found) = self.find(reference_or_id).await? else {
            return Ok(());
        };
        let last = found.records.len().saturating_sub(1);
        for (i, name) in found.records.iter().enumerate() {
            let req = DeleteImageRequest {
                name: name.clone(),
                sync: i == last,
                target: None,
            };
            match self.cd.images().delete(self.cd.request(req)).await {
                Ok(_) => {}
                Err(s) if s.code() == tonic::Code::NotFound => {}
                Err(s) => return Err(RuntimeError::containerd("images.delete", s)),
            }
        }
        Ok(())
    }

    /// Disk usage of the snapshotter root and the content store (paths as
    /// configured for containerd, e.g.
    /// `/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs`).
    pub async fn fs_info(
        &self,
        snapshotter_root: &Path,
        content_root: &Path,
    ) -> Result<Vec<FsUsage>, RuntimeError> {
        let paths = [snapshotter_root.to_path_buf(), content_root.to_path_buf()];
        tokio::task::spawn_blocking(move || paths.iter().map(|p| fs::usage(p)).collect())
            .await
            .map_err(|e| RuntimeError::Io {
                op: "measure image filesystem",
                path: snapshotter_root.display().to_string(),
                source: std::io::Error::other(e),
            })?
    }

    async fn find(&self, reference_or_id: &str) -> Result<Option<Resolved>, RuntimeError> {
        let all = self.resolve_all().await?;
        if let Some(id) = is_image_id(reference_or_id) {
            return Ok(all.into_iter().find(|r| r.info.id == id));
        }
        let name = parse_reference(reference_or_id)?.to_string();
        Ok(all.into_iter().find(|r| r.records.contains(&name)))
    }

    async fn resolve_all(&self) -> Result<Vec<Resolved>, RuntimeError> {
        let images = self
            .cd
            .images()
            .list(self.cd.request(ListImagesRequest {
                filters: Vec::new(),
            }))
            .await
            .map_err(|s| RuntimeError::containerd("images.list", s))?
            .into_inner()
            .images;
        let store = Store::new(&self.cd);
        let mut by_id: BTreeMap<String, Resolved> = BTreeMap::new();
        let mut seen = HashSet::new();
        for image in images {
            let key = (
                image.name.clone(),
                image
                    .target
                    .as_ref()
                    .map(|t| t.digest.clone())
                    .unwrap_or_default(),
            );
            let cached = lock(&self.documents).get(&key).cloned();
            let resolved = match cached {
                Some(info) => info,
                None => match self.resolve_record(&store, &image).await {
                    Ok(mut r) => {
                        let mut documents = lock(&self.documents);
                        // One parsed config per image, however many
                        // records (tag, digest) name it.
                        if let Some(same) = documents.values().find(|d| d.id == r.id) {
                            r.config = Arc::clone(&same.config);
                        }
                        documents.insert(key.clone(), r.clone());
                        r
                    }
                    Err(e) => {
                        tracing::debug!(name = %image.name, error = %e, "skipping unreadable image");
                        continue;
                    }
                },
            };
            seen.insert(key);
            // A record's labels may change under the same target.
            let resolved = ImageInfo {
                pinned: is_pinned(&image),
                ..resolved
            };
            let entry = by_id
                .entry(resolved.id.clone())
                .or_insert_with(|| Resolved {
                    info: resolved.clone(),
                    records: Vec::new(),
                });
            entry.records.push(image.name.clone());
            entry.info.pinned |= resolved.pinned;
            let target = image.target.map(|t| t.digest).unwrap_or_default();
            if let Ok(r) = parse_reference(&image.name) {
                let digest_ref = r.clone_with_digest(target.clone()).to_string();
                if !entry.info.repo_digests.contains(&digest_ref) {
                    entry.info.repo_digests.push(digest_ref);
                }
                if r.digest().is_none() && !entry.info.repo_tags.contains(&image.name) {
                    entry.info.repo_tags.push(image.name.clone());
                    target.clone_into(&mut entry.info.target_digest);
                }
            }
        }
        lock(&self.documents).retain(|k, _| seen.contains(k));
        Ok(by_id.into_values().collect())
    }

    /// Reads an image record's manifest and config from the content store.
    async fn resolve_record(
        &self,
        store: &Store,
        image: &Image,
    ) -> Result<ImageInfo, RuntimeError> {
        let target = image
            .target
            .clone()
            .ok_or_else(|| RuntimeError::ImageFormat {
                reference: image.name.clone(),
                reason: "record has no target".to_owned(),
            })?;
        let mut manifest_digest = target.digest.clone();
        if media::is_index(&MediaType::from(target.media_type.as_str())) {
            let index = decode_index(&store.read(&target.digest).await?)?;
            let (_, entry) = pick_manifest(&index, &self.platform, &image.name)?;
            manifest_digest = entry.digest().to_string();
        }
        let manifest = decode_manifest(&store.read(&manifest_digest).await?)?;
        let config_digest = manifest.config().digest().to_string();
        let config = decode_config(&store.read(&config_digest).await?)?;
        let chain = unpack::chain_ids(config.rootfs().diff_ids());
        Ok(ImageInfo {
            id: config_digest,
            repo_tags: Vec::new(),
            repo_digests: Vec::new(),
            size: manifest.layers().iter().map(|l| l.size()).sum(),
            target_digest: target.digest.clone(),
            chain_id: chain.last().cloned().unwrap_or_default(),
            config: std::sync::Arc::new(
                config
                    .config()
                    .as_ref()
                    .map(ImageConfig::from)
                    .unwrap_or_default(),
            ),
            pinned: is_pinned(image),
        })
    }
}

/// Whether an image record carries the CRI's pin label.
fn is_pinned(image: &Image) -> bool {
    image
        .labels
        .get(LABEL_PINNED)
        .is_some_and(|v| v == "pinned")
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every update is one insert or retain: consistent even if a holder
    // panicked.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl From<&Config> for ImageConfig {
    fn from(c: &Config) -> Self {
        Self {
            user: c.user().clone().unwrap_or_default(),
            env: c.env().clone().unwrap_or_default(),
            entrypoint: c.entrypoint().clone().unwrap_or_default(),
            cmd: c.cmd().clone().unwrap_or_default(),
            working_dir: c.working_dir().clone().unwrap_or_default(),
            labels: c.labels().clone().unwrap_or_default().into_iter().collect(),
            stop_signal: c.stop_signal().clone().unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_maps_to_image_config() {
        let cfg = decode_config(
            br#"{"architecture":"amd64","os":"linux","config":{"User":"1000","Env":["A=b"],"Cmd":["sh"]},
               "rootfs":{"type":"layers","diff_ids":["sha256:aa"]}}"#,
        )
        .unwrap();
        let ic: ImageConfig = cfg
            .config()
            .as_ref()
            .map(ImageConfig::from)
            .unwrap_or_default();
        assert_eq!(ic.user, "1000");
        assert_eq!(ic.env, vec!["A=b".to_owned()]);
        assert_eq!(ic.cmd, vec!["sh".to_owned()]);
        assert!(ic.entrypoint.is_empty());
    }

    #[test]
    fn every_config_field_and_the_labels_map_over() {
        let cfg = decode_config(
            br#"{"architecture":"amd64","os":"linux","config":{"User":"a:b","Env":["A=b","C=d"],
               "Entrypoint":["/bin/x"],"Cmd":["-v"],"WorkingDir":"/w","StopSignal":"SIGINT",
               "Labels":{"z":"1","a":"2"}},"rootfs":{"type":"layers","diff_ids":[]}}"#,
        )
        .unwrap();
        let ic = cfg
            .config()
            .as_ref()
            .map(ImageConfig::from)
            .unwrap_or_default();
        assert_eq!(
            ic,
            ImageConfig {
                user: "a:b".to_owned(),
                env: vec!["A=b".to_owned(), "C=d".to_owned()],
                entrypoint: vec!["/bin/x".to_owned()],
                cmd: vec!["-v".to_owned()],
                working_dir: "/w".to_owned(),
                labels: BTreeMap::from([
                    ("a".to_owned(), "2".to_owned()),
                    ("z".to_owned(), "1".to_owned())
                ]),
                stop_signal: "SIGINT".to_owned(),
            }
        );
        // No `config` at all: every field empty.
        let bare = decode_config(
            br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#,
        )
        .unwrap();
        assert_eq!(
            bare.config()
                .as_ref()
                .map(ImageConfig::from)
                .unwrap_or_default(),
            ImageConfig::default()
        );
    }
}
