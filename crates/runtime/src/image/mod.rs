//! Images in containerd: pull from registries into the content store,
//! unpack into snapshots, list, inspect and remove image records.
//!
//! A pull runs under a containerd lease so that garbage collection cannot
//! take half-written content; content carries containerd's GC reference
//! labels (index → manifests → config and layers, config → top snapshot), so
//! once the lease is deleted GC keeps exactly what image records reference.

pub(crate) mod content;
mod fs;
pub(crate) mod oci;
mod reference;
pub(crate) mod unpack;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use containerd_client::services::v1::{
    CreateImageRequest, DeleteImageRequest, Image, ListImagesRequest, UpdateImageRequest,
};
use containerd_client::types::Descriptor as PbDescriptor;

pub use fs::{usage, FsUsage};
pub use oci::{
    MEDIA_DOCKER_LIST, MEDIA_DOCKER_MANIFEST, MEDIA_OCI_CONFIG, MEDIA_OCI_INDEX,
    MEDIA_OCI_LAYER_GZIP, MEDIA_OCI_MANIFEST,
};
pub use reference::{Reference, DEFAULT_REGISTRY};

use crate::client::Containerd;
use crate::error::RuntimeError;
pub use crate::registry::RegistryAuth;
use crate::registry::{hosts_for, RegistryClient};
use crate::types::{ImageConfig, ImageInfo};
use content::Store;
use oci::{ConfigFile, Descriptor, Index, Manifest};

/// Snapshotter used unless configured otherwise.
pub const DEFAULT_SNAPSHOTTER: &str = "overlayfs";
/// Image-record label containerd's CRI uses to pin images (never GC'd by kubelet).
pub const LABEL_PINNED: &str = "io.cri-containerd.pinned";
/// Image-record label marking images managed by a CRI runtime.
pub const LABEL_MANAGED: &str = "io.cri-containerd.image";

/// Image operations on one containerd namespace.
#[derive(Debug, Clone)]
pub struct ImageService {
    cd: Containerd,
    registry_config_dir: PathBuf,
    snapshotter: String,
}

/// One image (grouped by config digest) with the records naming it.
#[derive(Debug, Clone)]
struct Resolved {
    info: ImageInfo,
    records: Vec<String>,
}

/// What a pull fetched: the top-level descriptor and the image documents.
#[derive(Debug)]
pub(crate) struct ImageDocs {
    /// Top-level (index or manifest) media type, digest and bytes.
    pub(crate) top: (String, String, Bytes),
    /// Index position of the chosen manifest, when `top` is an index.
    pub(crate) index_pick: Option<usize>,
    /// The chosen manifest's digest and bytes (equal to `top` without an index).
    pub(crate) manifest: (String, Bytes),
    pub(crate) parsed: Manifest,
    pub(crate) config: Bytes,
}

fn pb_descriptor(media_type: &str, digest: &str, size: usize) -> PbDescriptor {
    PbDescriptor {
        media_type: media_type.to_owned(),
        digest: digest.to_owned(),
        size: i64::try_from(size).unwrap_or(i64::MAX),
        annotations: HashMap::new(),
    }
}

fn json<T: serde::de::DeserializeOwned>(
    what: &'static str,
    data: &[u8],
) -> Result<T, RuntimeError> {
    serde_json::from_slice(data).map_err(|source| RuntimeError::Json { what, source })
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
        }
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

    /// Pulls `reference` (normalised as containerd does), stores it in the
    /// content store, unpacks it and records it under its normalised name
    /// (and `repo@digest`). Pulling what is already present is cheap and
    /// succeeds. A reference the registry does not know is `NotFound`.
    pub async fn pull(
        &self,
        reference: &str,
        auth: Option<RegistryAuth>,
    ) -> Result<ImageInfo, RuntimeError> {
        let r = Reference::parse(reference)?;
        let name = r.to_string();
        let hosts = hosts_for(&self.registry_config_dir, &r.registry)?;
        let client = RegistryClient::new(hosts, &r.repository, auth)?;
        let not_found = || RuntimeError::NotFound {
            kind: "image",
            id: reference.to_owned(),
        };
        let (host, top) = client.resolve(r.object()).await?.ok_or_else(not_found)?;
        tracing::debug!(%name, digest = %top.digest, media_type = %top.media_type, "resolved");

        let (index_pick, manifest) = if oci::is_index(&top.media_type) {
            let index: Index = json("image index", &top.data)?;
            let pick = index
                .pick_platform()
                .ok_or_else(|| RuntimeError::ImageFormat {
                    reference: name.clone(),
                    reason: format!("no {}/{} manifest in the index", oci::OS, oci::ARCH),
                })?;
            let digest = &index.manifests[pick].digest;
            let m = client.manifest(host, digest).await?.ok_or_else(not_found)?;
            (Some(pick), (m.digest, m.data))
        } else if oci::is_manifest(&top.media_type) {
            (None, (top.digest.clone(), top.data.clone()))
        } else {
            return Err(RuntimeError::ImageFormat {
                reference: name,
                reason: format!("unsupported manifest media type {:?}", top.media_type),
            });
        };
        let parsed: Manifest = json("image manifest", &manifest.1)?;
        let config = client.blob_bytes(host, &parsed.config.digest).await?;
        let docs = ImageDocs {
            top: (top.media_type, top.digest, top.data),
            index_pick,
            manifest,
            parsed,
            config,
        };

        let store = Store::leased(&self.cd, "pull").await?;
        let result = async {
            for layer in &docs.parsed.layers {
                if store.reuse(&layer.digest, &HashMap::new()).await? {
                    continue;
                }
                let (url, body) = client.blob(host, &layer.digest).await?;
                let size = u64::try_from(layer.size).unwrap_or(0);
                let stream = content::body_stream(url, body);
                store
                    .write(&layer.digest, size, HashMap::new(), stream)
                    .await?;
            }
            let mut names = vec![name.clone()];
            if r.digest.is_none() {
                names.push(r.with_digest(&docs.top.1).to_string());
            }
            let labels = HashMap::from([(LABEL_MANAGED.to_owned(), "managed".to_owned())]);
            self.commit(&store, &names, &docs, labels).await
        }
        .await;
        let released = store.release().await;
        result?;
        released?;
        self.status(&name).await?.ok_or_else(not_found)
    }

    /// Writes config, manifest and index (layers must already be stored
    /// under `store`'s lease), unpacks, and creates or updates the image
    /// records `names` with `labels`.
    pub(crate) async fn commit(
        &self,
        store: &Store,
        names: &[String],
        docs: &ImageDocs,
        labels: HashMap<String, String>,
    ) -> Result<(), RuntimeError> {
        let name = names.first().cloned().unwrap_or_default();
        let config: ConfigFile = json("image config", &docs.config)?;
        if config.os != oci::OS
            || (config.architecture != oci::ARCH && !config.architecture.is_empty())
        {
            return Err(RuntimeError::ImageFormat {
                reference: name,
                reason: format!("image is for {}/{}", config.os, config.architecture),
            });
        }
        let config_digest = &docs.parsed.config.digest;
        store
            .put(config_digest, docs.config.clone(), HashMap::new())
            .await?;

        let mut mlabels = HashMap::from([(
            "containerd.io/gc.ref.content.config".to_owned(),
            config_digest.clone(),
        )]);
        for (i, l) in docs.parsed.layers.iter().enumerate() {
            mlabels.insert(
                format!("containerd.io/gc.ref.content.l.{i}"),
                l.digest.clone(),
            );
        }
        store
            .put(&docs.manifest.0, docs.manifest.1.clone(), mlabels)
            .await?;
        if let Some(pick) = docs.index_pick {
            let ilabels = HashMap::from([(
                format!("containerd.io/gc.ref.content.m.{pick}"),
                docs.manifest.0.clone(),
            )]);
            store.put(&docs.top.1, docs.top.2.clone(), ilabels).await?;
        }

        let top_chain = unpack::unpack(
            store,
            &self.snapshotter,
            &name,
            &docs.parsed.layers,
            &config.rootfs.diff_ids,
        )
        .await?;
        let snap_label = HashMap::from([(
            format!("containerd.io/gc.ref.snapshot.{}", self.snapshotter),
            top_chain,
        )]);
        store.set_labels(config_digest, &snap_label).await?;

        let target = pb_descriptor(&docs.top.0, &docs.top.1, docs.top.2.len());
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
        let name = Reference::parse(reference_or_id)?.to_string();
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
        for image in images {
            let resolved = match self.resolve_record(&store, &image).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!(name = %image.name, error = %e, "skipping unreadable image");
                    continue;
                }
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
            if let Ok(r) = Reference::parse(&image.name) {
                let digest_ref = r.with_digest(&target).to_string();
                if !entry.info.repo_digests.contains(&digest_ref) {
                    entry.info.repo_digests.push(digest_ref);
                }
                if r.digest.is_none() && !entry.info.repo_tags.contains(&image.name) {
                    entry.info.repo_tags.push(image.name.clone());
                    target.clone_into(&mut entry.info.target_digest);
                }
            }
        }
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
        if oci::is_index(&target.media_type) {
            let index: Index = json("image index", &store.read(&target.digest).await?)?;
            let pick = index
                .pick_platform()
                .ok_or_else(|| RuntimeError::ImageFormat {
                    reference: image.name.clone(),
                    reason: "no linux/amd64 manifest".to_owned(),
                })?;
            manifest_digest.clone_from(&index.manifests[pick].digest);
        }
        let manifest: Manifest = json("image manifest", &store.read(&manifest_digest).await?)?;
        let config: ConfigFile = json("image config", &store.read(&manifest.config.digest).await?)?;
        let chain = oci::chain_ids(&config.rootfs.diff_ids);
        Ok(ImageInfo {
            id: manifest.config.digest.clone(),
            repo_tags: Vec::new(),
            repo_digests: Vec::new(),
            size: manifest
                .layers
                .iter()
                .map(|l| u64::try_from(l.size).unwrap_or(0))
                .sum(),
            target_digest: target.digest.clone(),
            chain_id: chain.last().cloned().unwrap_or_default(),
            config: config.config.map(ImageConfig::from).unwrap_or_default(),
            pinned: image
                .labels
                .get(LABEL_PINNED)
                .is_some_and(|v| v == "pinned"),
        })
    }
}

/// Builds the descriptor for a layer stored by the caller (used by `pause`).
pub(crate) fn layer_descriptor(media_type: &str, digest: &str, size: usize) -> Descriptor {
    Descriptor {
        media_type: media_type.to_owned(),
        digest: digest.to_owned(),
        size: i64::try_from(size).unwrap_or(i64::MAX),
        platform: None,
    }
}
