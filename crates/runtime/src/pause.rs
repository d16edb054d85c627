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
use serde_json::json;

use crate::error::RuntimeError;
use crate::image::content::Store;
use crate::image::oci::{
    self, Manifest, MEDIA_OCI_CONFIG, MEDIA_OCI_LAYER_GZIP, MEDIA_OCI_MANIFEST,
};
use crate::image::{
    layer_descriptor, unpack, ImageDocs, ImageService, LABEL_MANAGED, LABEL_PINNED,
};
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
    docs: ImageDocs,
}

fn io_err<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> RuntimeError + 'a {
    move |source| RuntimeError::Io {
        op,
        path: path.display().to_string(),
        source,
    }
}

/// Builds the image blobs from the binary at `binary` (blocking).
fn build(binary: &Path) -> Result<PauseBlobs, RuntimeError> {
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
    let diff_id = oci::sha256_digest(&tar);
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
    let layer_digest = oci::sha256_digest(&layer);

    let config = json!({
        "architecture": oci::ARCH,
        "os": oci::OS,
        "config": { "Entrypoint": [PAUSE_PATH], "WorkingDir": "/", "StopSignal": "SIGTERM",
                    "Labels": { "io.cubelet.pause": "true" } },
        "rootfs": { "type": "layers", "diff_ids": [diff_id] },
    });
    let config = Bytes::from(
        serde_json::to_vec(&config).map_err(|source| RuntimeError::Json {
            what: "pause config",
            source,
        })?,
    );
    let config_digest = oci::sha256_digest(&config);
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(MEDIA_OCI_MANIFEST.to_owned()),
        config: layer_descriptor(MEDIA_OCI_CONFIG, &config_digest, config.len()),
        layers: vec![layer_descriptor(
            MEDIA_OCI_LAYER_GZIP,
            &layer_digest,
            layer.len(),
        )],
    };
    let manifest_bytes =
        Bytes::from(
            serde_json::to_vec(&manifest).map_err(|source| RuntimeError::Json {
                what: "pause manifest",
                source,
            })?,
        );
    let manifest_digest = oci::sha256_digest(&manifest_bytes);
    Ok(PauseBlobs {
        layer,
        docs: ImageDocs {
            top: (
                MEDIA_OCI_MANIFEST.to_owned(),
                manifest_digest.clone(),
                manifest_bytes.clone(),
            ),
            index_pick: None,
            manifest: (manifest_digest, manifest_bytes),
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
    let blobs = tokio::task::spawn_blocking(move || build(&path))
        .await
        .map_err(|e| RuntimeError::Io {
            op: "build pause image",
            path: binary.display().to_string(),
            source: std::io::Error::other(e),
        })??;
    let name = pause_image_ref();
    if let Some(info) = images.status(&name).await? {
        let store = Store::new(images.containerd());
        if info.target_digest == blobs.docs.top.1
            && info.pinned
            && unpack::snapshot_exists(&store, images.snapshotter(), &info.chain_id).await?
        {
            return Ok(info);
        }
    }
    let store = Store::leased(images.containerd(), "pause").await?;
    let result = async {
        let layer = &blobs.docs.parsed.layers[0];
        store
            .put(&layer.digest, blobs.layer.clone(), HashMap::new())
            .await?;
        let labels = HashMap::from([
            (LABEL_MANAGED.to_owned(), "managed".to_owned()),
            (LABEL_PINNED.to_owned(), "pinned".to_owned()),
        ]);
        images
            .commit(&store, std::slice::from_ref(&name), &blobs.docs, labels)
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

    #[test]
    fn build_is_deterministic() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("pause");
        std::fs::write(&bin, b"\x7fELF not really").unwrap();
        let a = build(&bin).unwrap();
        let b = build(&bin).unwrap();
        assert_eq!(a.docs.top.1, b.docs.top.1);
        assert_eq!(a.layer, b.layer);
        let cfg: oci::ConfigFile = serde_json::from_slice(&a.docs.config).unwrap();
        assert_eq!(
            cfg.config.unwrap().entrypoint.unwrap(),
            vec![PAUSE_PATH.to_owned()]
        );
        assert_eq!(cfg.rootfs.diff_ids.len(), 1);
        assert_eq!(a.docs.parsed.layers[0].digest, oci::sha256_digest(&a.layer));
    }

    #[test]
    fn missing_binary_is_an_io_error_naming_it() {
        let err = build(Path::new("/nonexistent/cubelet-pause")).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/cubelet-pause"),
            "{err}"
        );
    }
}
