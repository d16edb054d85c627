//! The built-in pod infra (pause) image.
//!
//! Cubelet builds a one-layer OCI image around the `cubelet-pause` binary in
//! process (deterministic tar + gzip, so the same binary always gives the
//! same digests), imports it into containerd's content store, unpacks it like
//! a pulled image and records it pinned, so a node needs no registry to start
//! pods.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::Path;

use bytes::Bytes;
use cubelet_registry::media::{digest, sha256_digest};
use cubelet_registry::{Fetched, ImageDocuments};
use oci_spec::image::{Descriptor, ImageManifestBuilder, MediaType, Platform};

use crate::error::io_err;
use crate::error::RuntimeError;
use crate::image::content::Store;
use crate::image::{unpack, ImageService, LABEL_MANAGED, LABEL_PINNED};
use crate::types::ImageInfo;

/// Repository of the built-in pause image.
pub const PAUSE_REPOSITORY: &str = "cubelet.local/pause";
/// Path of the pause binary inside the image.
pub const PAUSE_PATH: &str = "/pause";

/// The built-in pause image reference, `cubelet.local/pause:<version>`.
pub fn pause_image_ref() -> String {
    format!("{PAUSE_REPOSITORY}:{}", env!("CARGO_PKG_VERSION"))
}

/// The blobs of the pause image.
#[derive(Debug)]
struct PauseBlobs {
    layer: Bytes,
    layer_digest: String,
    docs: ImageDocuments,
}

/// A descriptor of `size` bytes of `media_type` content with `digest`.
fn descriptor(
    media_type: MediaType,
    digest_str: &str,
    size: usize,
) -> Result<Descriptor, RuntimeError> {
    Ok(Descriptor::new(
        media_type,
        u64::try_from(size).unwrap_or(u64::MAX),
        digest(digest_str)?,
    ))
}

/// The pause image's config document.
#[derive(serde::Serialize)]
struct PauseConfig {
    architecture: String,
    config: PauseProcess,
    os: String,
    rootfs: PauseRootfs,
    #[serde(skip_serializing_if = "Option::is_none")]
    variant: Option<String>,
}

#[derive(serde::Serialize)]
#[serde(rename_all = "PascalCase")]
struct PauseProcess {
    entrypoint: [&'static str; 1],
    labels: std::collections::BTreeMap<&'static str, &'static str>,
    stop_signal: &'static str,
    working_dir: &'static str,
}

#[derive(serde::Serialize)]
struct PauseRootfs {
    diff_ids: [String; 1],
    #[serde(rename = "type")]
    kind: &'static str,
}

/// Builds the image blobs for `platform` from the binary at `binary`
/// (blocking).
fn build(binary: &Path, platform: &Platform) -> Result<PauseBlobs, RuntimeError> {
    let bin = std::fs::read(binary).map_err(io_err("read pause binary", binary))?;
    let mut tar = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_ustar();
    header.set_size(bin.len() as u64);
    header.set_mode(0o755);
    header.set_mtime(0);
    header.set_uid(0);
    header.set_gid(0);
    header.set_entry_type(tar::EntryType::Regular);
    tar.append_data(
        &mut header,
        PAUSE_PATH.trim_start_matches('/'),
        bin.as_slice(),
    )
    .map_err(io_err("build pause layer", binary))?;
    let tar = tar
        .into_inner()
        .map_err(io_err("build pause layer", binary))?;
    let diff_id = sha256_digest(&tar);
    // mtime 0 and no file name keep the gzip stream deterministic.
    let mut gz = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::default());
    gz.write_all(&tar)
        .map_err(io_err("compress pause layer", binary))?;
    let layer = Bytes::from(
        gz.finish()
            .map_err(io_err("compress pause layer", binary))?,
    );
    let layer_digest = sha256_digest(&layer);

    // A typed document, fields in the order serde_json's default (sorted)
    // map wrote them: the bytes, and so the image's digest, must not depend
    // on whether some crate in the build turns on `preserve_order`.
    let config = PauseConfig {
        architecture: platform.architecture().to_string(),
        config: PauseProcess {
            entrypoint: [PAUSE_PATH],
            labels: std::collections::BTreeMap::from([("io.cubelet.pause", "true")]),
            stop_signal: "SIGTERM",
            working_dir: "/",
        },
        os: platform.os().to_string(),
        rootfs: PauseRootfs {
            diff_ids: [diff_id],
            kind: "layers",
        },
        variant: platform.variant().as_ref().map(|v| v.as_str().to_owned()),
    };
    let config = Bytes::from(
        serde_json::to_vec(&config).map_err(|source| RuntimeError::Json {
            what: "pause config",
            source,
        })?,
    );
    let config_digest = sha256_digest(&config);
    let bad = |e: oci_spec::OciSpecError| RuntimeError::ImageFormat {
        reference: pause_image_ref(),
        reason: e.to_string(),
    };
    let manifest = ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageManifest)
        .config(descriptor(
            MediaType::ImageConfig,
            &config_digest,
            config.len(),
        )?)
        .layers(vec![descriptor(
            MediaType::ImageLayerGzip,
            &layer_digest,
            layer.len(),
        )?])
        .build()
        .map_err(bad)?;
    let manifest_bytes =
        Bytes::from(
            serde_json::to_vec(&manifest).map_err(|source| RuntimeError::Json {
                what: "pause manifest",
                source,
            })?,
        );
    let manifest_doc = Fetched {
        media_type: MediaType::ImageManifest,
        digest: sha256_digest(&manifest_bytes),
        data: manifest_bytes,
    };
    Ok(PauseBlobs {
        layer,
        layer_digest,
        docs: ImageDocuments {
            top: manifest_doc.clone(),
            index_pick: None,
            manifest: manifest_doc,
            parsed: manifest,
            config,
        },
    })
}

/// Makes sure the pause image built from `binary` is present, unpacked and
/// pinned as [`pause_image_ref`]; does nothing if the same digest already is.
pub async fn ensure_pause_image(
    images: &ImageService,
    binary: &Path,
) -> Result<ImageInfo, RuntimeError> {
    let path = binary.to_path_buf();
    let platform = images.platform().clone();
    let blobs = tokio::task::spawn_blocking(move || build(&path, &platform))
        .await
        .map_err(|e| RuntimeError::Io {
            op: "build pause image",
            path: binary.display().to_string(),
            source: std::io::Error::other(e),
        })??;
    let name = pause_image_ref();
    if let Some(info) = images.status(&name).await? {
        let store = Store::new(images.containerd());
        if info.target_digest == blobs.docs.top.digest
            && info.pinned
            && unpack::snapshot_exists(&store, images.snapshotter(), &info.chain_id).await?
        {
            return Ok(info);
        }
    }
    let store = Store::leased(images.containerd(), "pause").await?;
    let result = async {
        store
            .put(&blobs.layer_digest, blobs.layer.clone(), HashMap::new())
            .await?;
        let mut labels = HashMap::from([
            (LABEL_MANAGED.to_owned(), "managed".to_owned()),
            (LABEL_PINNED.to_owned(), "pinned".to_owned()),
        ]);
        crate::reclaim::owner::mark(&mut labels);
        images
            .commit(
                &store,
                std::slice::from_ref(&name),
                &blobs.docs,
                labels,
                None,
            )
            .await
    }
    .await;
    let released = store.release().await;
    result?;
    released?;
    images.status(&name).await?.ok_or(RuntimeError::NotFound {
        kind: "image",
        id: name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use cubelet_registry::media::{decode_config, decode_manifest};
    use cubelet_registry::platform::oci_platform;

    fn fake_binary() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("pause");
        std::fs::write(&bin, b"\x7fELF not really").unwrap();
        (dir, bin)
    }

    #[test]
    fn build_is_deterministic() {
        let (_dir, bin) = fake_binary();
        let host = cubelet_registry::host_platform();
        let a = build(&bin, &host).unwrap();
        let b = build(&bin, &host).unwrap();
        assert_eq!(a.docs.top.digest, b.docs.top.digest);
        assert_eq!(a.layer, b.layer);
        let cfg = decode_config(&a.docs.config).unwrap();
        assert_eq!(
            cfg.config().as_ref().unwrap().entrypoint().clone().unwrap(),
            vec![PAUSE_PATH.to_owned()]
        );
        assert_eq!(cfg.rootfs().diff_ids().len(), 1);
        assert_eq!(cfg.architecture(), host.architecture());
        assert_eq!(
            a.docs.parsed.layers()[0].digest().to_string(),
            sha256_digest(&a.layer)
        );
        assert_eq!(
            decode_manifest(&a.docs.manifest.data).unwrap(),
            a.docs.parsed
        );
    }

    /// The documents are the same bytes whatever else is compiled with this
    /// crate, so a node keeps its pause image across builds: the config is
    /// a typed document (not a map whose key order depends on serde_json's
    /// `preserve_order` feature), and the layer is gzip from flate2's zlib-rs
    /// backend, which this crate asks for itself (the default backend
    /// depended on what else was in the build, and with it the digest).
    #[test]
    fn amd64_documents_are_unchanged() {
        let (_dir, bin) = fake_binary();
        let a = build(&bin, &oci_platform("x86_64", "")).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&a.docs.config),
            r#"{"architecture":"amd64","config":{"Entrypoint":["/pause"],"Labels":{"io.cubelet.pause":"true"},"StopSignal":"SIGTERM","WorkingDir":"/"},"os":"linux","rootfs":{"diff_ids":["sha256:0c381adee8f41b9393e58afe2720f08c48cdc3f778abcb55fc09528264c53aeb"],"type":"layers"}}"#
        );
        assert_eq!(
            String::from_utf8_lossy(&a.docs.manifest.data),
            r#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:5f8dfd4c4758010acfa2df54d1bdda7c2e6688cf6735202a9d768ac48cb76e6b","size":263},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:ee2168a17ae33867fd491e3ac231add5973669a6a82aecbc06e4eacb632ef88c","size":99}]}"#
        );
        assert_eq!(
            a.docs.top.digest,
            "sha256:65587d5338b423c78f3d62d409283cc1469809454a78c7bccdee70fad2b05bd3"
        );
    }

    #[test]
    fn other_platforms_name_their_variant() {
        let (_dir, bin) = fake_binary();
        let a = build(&bin, &oci_platform("aarch64", "")).unwrap();
        let cfg = decode_config(&a.docs.config).unwrap();
        assert_eq!(cfg.architecture().to_string(), "arm64");
        assert_eq!(cfg.variant().as_deref(), Some("v8"));
    }

    #[test]
    fn missing_binary_is_an_io_error_naming_it() {
        let err = build(
            Path::new("/nonexistent/cubelet-pause"),
            &cubelet_registry::host_platform(),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/cubelet-pause"),
            "{err}"
        );
    }
}
