//! Runtime-neutral types shared by the image, container and sandbox modules
//! and by the CRI shim (which converts CRI messages to and from them).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// An image known to containerd in Cubelet's namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInfo {
    /// Image id: the digest of its config blob (`sha256:...`), as CRI reports it.
    pub id: String,
    /// Repo tags (`registry/repo:tag`) that point at it.
    pub repo_tags: Vec<String>,
    /// Repo digests (`registry/repo@sha256:...`).
    pub repo_digests: Vec<String>,
    /// Total size of its layers (compressed, as stored), in bytes.
    pub size: u64,
    /// Digest of the manifest (or index) the image record targets.
    pub target_digest: String,
    /// Chain id of the top layer: the parent snapshot for a container rootfs.
    pub chain_id: String,
    /// Parsed image config, shared: an image's config may be as large as
    /// its author wants (up to the 16 MiB blob cap), and every listing,
    /// status and removal copies the [`ImageInfo`] of every image.
    pub config: std::sync::Arc<ImageConfig>,
    /// Whether the image is pinned (the pause image is).
    pub pinned: bool,
}

/// The parts of an OCI image config that containers need.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    /// `User` (name, uid, `uid:gid`, ...), empty when unset.
    pub user: String,
    /// Environment, `KEY=value`.
    pub env: Vec<String>,
    /// Entrypoint.
    pub entrypoint: Vec<String>,
    /// Default command.
    pub cmd: Vec<String>,
    /// Working directory, empty when unset.
    pub working_dir: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Stop signal name, empty when unset.
    pub stop_signal: String,
}
