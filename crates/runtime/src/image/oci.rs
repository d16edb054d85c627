//! OCI / Docker image documents: manifests, indexes, configs, media types,
//! and the platform choice.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Docker schema2 manifest.
pub const MEDIA_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker manifest list.
pub const MEDIA_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// OCI image manifest.
pub const MEDIA_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI image index.
pub const MEDIA_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// OCI image config.
pub const MEDIA_OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// OCI gzip layer.
pub const MEDIA_OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// The `Accept` header for manifest requests.
pub(crate) const MANIFEST_ACCEPT: &str = "application/vnd.docker.distribution.manifest.v2+json, \
     application/vnd.docker.distribution.manifest.list.v2+json, \
     application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json";

/// The platform Cubelet runs images for.
pub(crate) const OS: &str = "linux";
/// The architecture Cubelet runs images for (OCI naming).
pub(crate) const ARCH: &str = "amd64";

/// True for index / manifest-list media types.
pub(crate) fn is_index(media_type: &str) -> bool {
    media_type == MEDIA_DOCKER_LIST || media_type == MEDIA_OCI_INDEX
}

/// True for single-image manifest media types.
pub(crate) fn is_manifest(media_type: &str) -> bool {
    media_type == MEDIA_DOCKER_MANIFEST || media_type == MEDIA_OCI_MANIFEST
}

/// A content descriptor as found in manifests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Descriptor {
    #[serde(default)]
    pub(crate) media_type: String,
    pub(crate) digest: String,
    pub(crate) size: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) platform: Option<Platform>,
}

/// A platform in an index entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Platform {
    pub(crate) architecture: String,
    pub(crate) os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) variant: Option<String>,
}

/// An image manifest (Docker schema2 or OCI).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Manifest {
    pub(crate) schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) media_type: Option<String>,
    pub(crate) config: Descriptor,
    pub(crate) layers: Vec<Descriptor>,
}

/// An image index or manifest list.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Index {
    #[serde(default)]
    pub(crate) media_type: Option<String>,
    pub(crate) manifests: Vec<Descriptor>,
}

impl Index {
    /// The position of the linux/amd64 manifest, if any.
    pub(crate) fn pick_platform(&self) -> Option<usize> {
        self.manifests.iter().position(|m| {
            m.platform
                .as_ref()
                .is_some_and(|p| p.os == OS && p.architecture == ARCH)
                && is_manifest(&m.media_type)
        })
    }
}

/// An image config blob.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct ConfigFile {
    #[serde(default)]
    pub(crate) architecture: String,
    #[serde(default)]
    pub(crate) os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) config: Option<ContainerConfig>,
    pub(crate) rootfs: RootFs,
}

/// The `config` part of an image config.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct ContainerConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) env: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) entrypoint: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cmd: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) working_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) stop_signal: Option<String>,
}

/// The `rootfs` part of an image config.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct RootFs {
    #[serde(rename = "type", default)]
    pub(crate) kind: String,
    #[serde(default)]
    pub(crate) diff_ids: Vec<String>,
}

impl From<ContainerConfig> for crate::types::ImageConfig {
    fn from(c: ContainerConfig) -> Self {
        Self {
            user: c.user.unwrap_or_default(),
            env: c.env.unwrap_or_default(),
            entrypoint: c.entrypoint.unwrap_or_default(),
            cmd: c.cmd.unwrap_or_default(),
            working_dir: c.working_dir.unwrap_or_default(),
            labels: c.labels.unwrap_or_default(),
            stop_signal: c.stop_signal.unwrap_or_default(),
        }
    }
}

/// `sha256:<hex>` of `data`.
pub(crate) fn sha256_digest(data: &[u8]) -> String {
    use sha2::Digest as _;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(data)))
}

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
    fn picks_linux_amd64_from_an_index() {
        let idx: Index = serde_json::from_str(&format!(
            r#"{{"mediaType":"{MEDIA_DOCKER_LIST}","manifests":[
            {{"mediaType":"{MEDIA_DOCKER_MANIFEST}","digest":"sha256:aa","size":1,"platform":{{"architecture":"arm64","os":"linux"}}}},
            {{"mediaType":"{MEDIA_DOCKER_MANIFEST}","digest":"sha256:bb","size":1,"platform":{{"architecture":"amd64","os":"linux"}}}}]}}"#
        ))
        .unwrap();
        assert_eq!(idx.pick_platform(), Some(1));
    }

    #[test]
    fn config_maps_to_image_config() {
        let cfg: ConfigFile = serde_json::from_str(
            r#"{"architecture":"amd64","os":"linux","config":{"User":"1000","Env":["A=b"],"Cmd":["sh"]},
               "rootfs":{"type":"layers","diff_ids":["sha256:aa"]}}"#,
        )
        .unwrap();
        let ic: crate::types::ImageConfig = cfg.config.unwrap_or_default().into();
        assert_eq!(ic.user, "1000");
        assert_eq!(ic.env, vec!["A=b".to_owned()]);
        assert_eq!(ic.cmd, vec!["sh".to_owned()]);
        assert!(ic.entrypoint.is_empty());
    }
}
