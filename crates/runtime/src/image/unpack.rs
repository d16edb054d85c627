//! Unpacking image layers into snapshots: for each layer, by chain id,
//! `Prepare` → `Diff.Apply` → `Commit`, skipping layers already unpacked.

use std::collections::HashMap;

use containerd_client::services::v1::snapshots::{
    CommitSnapshotRequest, PrepareSnapshotRequest, RemoveSnapshotRequest, StatSnapshotRequest,
};
use containerd_client::services::v1::ApplyRequest;
use containerd_client::types::Descriptor as PbDescriptor;

use cubelet_registry::media::sha256_digest;
use oci_spec::image::Descriptor;

use super::content::{unique, Store};
use crate::error::RuntimeError;

/// Chain ids of a layer stack: `chain[0] = diff[0]`,
/// `chain[n] = sha256(chain[n-1] + " " + diff[n])`.
pub(crate) fn chain_ids(diff_ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(diff_ids.len());
    for d in diff_ids {
        let next = match out.last() {
            None => d.clone(),
            Some(parent) => sha256_digest(format!("{parent} {d}").as_bytes()),
        };
        out.push(next);
    }
    out
}

/// True if snapshot `key` exists in `snapshotter`.
pub(crate) async fn snapshot_exists(
    store: &Store,
    snapshotter: &str,
    key: &str,
) -> Result<bool, RuntimeError> {
    let cd = store.containerd();
    let req = store.req(StatSnapshotRequest {
        snapshotter: snapshotter.to_owned(),
        key: key.to_owned(),
    });
    match cd.snapshots().stat(req).await {
        Ok(_) => Ok(true),
        Err(s) if s.code() == tonic::Code::NotFound => Ok(false),
        Err(s) => Err(RuntimeError::containerd("snapshots.stat", s)),
    }
}

/// Unpacks `layers` (whose uncompressed digests are `diff_ids`) and returns
/// the chain id of the top layer. Layer `i` is unpacked once `stored` says
/// more than `i` layers are in the content store, so a pull unpacks while
/// its later layers still download, as containerd's does; a closed `stored`
/// short of the stack ends the unpack with an error.
pub(crate) async fn unpack(
    store: &Store,
    snapshotter: &str,
    reference: &str,
    layers: &[Descriptor],
    diff_ids: &[String],
    mut stored: tokio::sync::watch::Receiver<usize>,
) -> Result<String, RuntimeError> {
    if layers.len() != diff_ids.len() || layers.is_empty() {
        return Err(RuntimeError::ImageFormat {
            reference: reference.to_owned(),
            reason: format!("{} layers but {} diff ids", layers.len(), diff_ids.len()),
        });
    }
    let chain = chain_ids(diff_ids);
    let cd = store.containerd();
    let mut parent = String::new();
    for (i, ((layer, diff_id), chain_id)) in layers.iter().zip(diff_ids).zip(&chain).enumerate() {
        if stored.wait_for(|&n| n > i).await.is_err() {
            return Err(RuntimeError::ImageFormat {
                reference: reference.to_owned(),
                reason: format!("layer {} was not stored", layer.digest()),
            });
        }
        if snapshot_exists(store, snapshotter, chain_id).await? {
            parent.clone_from(chain_id);
            continue;
        }
        let key = format!("extract-{}-{chain_id}", unique());
        let prep = PrepareSnapshotRequest {
            snapshotter: snapshotter.to_owned(),
            key: key.clone(),
            parent: parent.clone(),
            labels: crate::reclaim::owner::owner_labels(),
        };
        let mounts = cd
            .snapshots()
            .prepare(store.req(prep))
            .await
            .map_err(|s| RuntimeError::containerd("snapshots.prepare", s))?
            .into_inner()
            .mounts;
        let result = apply_and_commit(
            store,
            snapshotter,
            reference,
            &key,
            chain_id,
            layer,
            diff_id,
            mounts,
        )
        .await;
        if result.is_err() {
            let rm = RemoveSnapshotRequest {
                snapshotter: snapshotter.to_owned(),
                key: key.clone(),
            };
            if let Err(s) = cd.snapshots().remove(store.req(rm)).await {
                tracing::warn!(%key, error = %s, "removing failed extraction snapshot");
            }
        }
        result?;
        parent.clone_from(chain_id);
    }
    Ok(parent)
}

#[allow(clippy::too_many_arguments)]
async fn apply_and_commit(
    store: &Store,
    snapshotter: &str,
    reference: &str,
    key: &str,
    chain_id: &str,
    layer: &Descriptor,
    diff_id: &str,
    mounts: Vec<containerd_client::types::Mount>,
) -> Result<(), RuntimeError> {
    let cd = store.containerd();
    let desc = PbDescriptor {
        media_type: layer.media_type().to_string(),
        digest: layer.digest().to_string(),
        size: i64::try_from(layer.size()).unwrap_or(i64::MAX),
        annotations: HashMap::new(),
    };
    let applied = cd
        .diff()
        .apply(store.req(ApplyRequest {
            diff: Some(desc),
            mounts,
            payloads: HashMap::new(),
            sync_fs: false,
        }))
        .await
        .map_err(|s| apply_error(reference, layer, s))?
        .into_inner()
        .applied
        .map(|d| d.digest)
        .unwrap_or_default();
    if applied != diff_id {
        return Err(RuntimeError::DigestMismatch {
            digest: diff_id.to_owned(),
            actual: format!("{applied} (uncompressed layer {})", layer.digest()),
        });
    }
    let commit = CommitSnapshotRequest {
        snapshotter: snapshotter.to_owned(),
        name: chain_id.to_owned(),
        key: key.to_owned(),
        labels: crate::reclaim::owner::owner_labels(),
    };
    match cd.snapshots().commit(store.req(commit)).await {
        Ok(_) => Ok(()),
        // Unpacked concurrently by another pull: theirs is as good as ours
        // (our active snapshot is removed by the caller's error path? no:
        // remove it here since we succeed).
        Err(s) if s.code() == tonic::Code::AlreadyExists => {
            let rm = RemoveSnapshotRequest {
                snapshotter: snapshotter.to_owned(),
                key: key.to_owned(),
            };
            let _ = cd.snapshots().remove(store.req(rm)).await;
            Ok(())
        }
        Err(s) => Err(RuntimeError::containerd("snapshots.commit", s)),
    }
}

/// What a failed `diff.apply` of `layer` is: containerd down, a deadline or
/// a cancel as for any containerd call; anything else is the layer's content
/// (not a tar, a broken compression, an entry containerd refuses) or the
/// node's disk, so the image cannot be used as it stands, which is not a
/// failure of the agent.
fn apply_error(reference: &str, layer: &Descriptor, s: tonic::Status) -> RuntimeError {
    match s.code() {
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => {
            RuntimeError::containerd("diff.apply", s)
        }
        _ => RuntimeError::ImageFormat {
            reference: reference.to_owned(),
            reason: format!(
                "layer {} could not be unpacked: {}",
                layer.digest(),
                s.message()
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_ids_follow_the_oci_definition() {
        let a = sha256_digest(b"a");
        let b = sha256_digest(b"b");
        let chain = chain_ids(&[a.clone(), b.clone()]);
        assert_eq!(chain[0], a);
        assert_eq!(chain[1], sha256_digest(format!("{a} {b}").as_bytes()));
        assert!(chain_ids(&[]).is_empty());
    }

    #[test]
    fn a_layer_containerd_cannot_apply_is_the_images_fault_unless_containerd_is_down() {
        let layer: Descriptor = serde_json::from_str(&format!(
            r#"{{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"{}","size":4}}"#,
            sha256_digest(b"junk")
        ))
        .unwrap();
        let bad = apply_error(
            "r/app:v1",
            &layer,
            tonic::Status::unknown("archive/tar: invalid tar header"),
        );
        assert_eq!(
            bad.kind(),
            cubelet_engine::StepErrorKind::FailedPrecondition
        );
        let text = bad.to_string();
        assert!(
            text.contains("r/app:v1")
                && text.contains(&layer.digest().to_string())
                && text.contains("invalid tar header"),
            "{text}"
        );
        let down = apply_error("r/app:v1", &layer, tonic::Status::unavailable("closing"));
        assert_eq!(down.kind(), cubelet_engine::StepErrorKind::Unavailable);
    }
}
