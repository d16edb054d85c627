//! Image documents on oci-spec's types: the media types Cubelet accepts
//! (OCI and Docker schema2), decoding manifests, indexes and configs as
//! leniently as containerd does, and digests.
//!
//! containerd decodes these documents into Go structs, where a missing field
//! is its zero value; oci-spec's serde types require some of them. Decoding
//! here fills in what containerd (and Cubelet before oci-spec) let be
//! missing, and nothing else: a descriptor's `mediaType`, an index's
//! `schemaVersion`, a config's `architecture`, `os` and `rootfs` parts.

use oci_spec::image::{Digest, ImageConfiguration, ImageIndex, ImageManifest, MediaType};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::RegistryError;

/// Docker schema2 image manifest.
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker manifest list (schema2's index).
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// The `Accept` header for manifest requests.
pub const MANIFEST_ACCEPT: &str = "application/vnd.docker.distribution.manifest.v2+json, \
     application/vnd.docker.distribution.manifest.list.v2+json, \
     application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json";

/// True for index / manifest-list media types.
pub fn is_index(media_type: &MediaType) -> bool {
    *media_type == MediaType::ImageIndex || media_type.as_ref() == DOCKER_MANIFEST_LIST
}

/// True for single-image manifest media types.
pub fn is_manifest(media_type: &MediaType) -> bool {
    *media_type == MediaType::ImageManifest || media_type.as_ref() == DOCKER_MANIFEST
}

/// `sha256:<hex>` of `data`.
pub fn sha256_digest(data: &[u8]) -> String {
    use sha2::Digest as _;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(data)))
}

/// `digest` as oci-spec's [`Digest`].
pub fn digest(digest: &str) -> Result<Digest, RegistryError> {
    digest
        .parse()
        .map_err(|source| RegistryError::InvalidDigest {
            digest: digest.to_owned(),
            source,
        })
}

/// Sets `key` of the JSON object `v` to `default` if it is missing.
fn fill(v: &mut Value, key: &str, default: Value) {
    if let Some(map) = v.as_object_mut() {
        map.entry(key.to_owned()).or_insert(default);
    }
}

/// Fills a missing `mediaType` of the descriptors in `v[key]` (one or an
/// array).
fn fill_descriptors(v: &mut Value, key: &str) {
    match v.get_mut(key) {
        Some(Value::Array(items)) => {
            for d in items {
                fill(d, "mediaType", Value::from(""));
            }
        }
        Some(d) => fill(d, "mediaType", Value::from("")),
        None => {}
    }
}

fn decode<T: DeserializeOwned>(
    what: &'static str,
    data: &[u8],
    lenient: impl FnOnce(&mut Value),
) -> Result<T, RegistryError> {
    let json = |source| RegistryError::Json { what, source };
    let mut v: Value = serde_json::from_slice(data).map_err(json)?;
    lenient(&mut v);
    serde_json::from_value(v).map_err(json)
}

/// Decodes an image manifest (OCI or Docker schema2).
pub fn decode_manifest(data: &[u8]) -> Result<ImageManifest, RegistryError> {
    decode("image manifest", data, |v| {
        fill_descriptors(v, "config");
        fill_descriptors(v, "layers");
    })
}

/// Decodes an image index (OCI or Docker manifest list).
pub fn decode_index(data: &[u8]) -> Result<ImageIndex, RegistryError> {
    decode("image index", data, |v| {
        fill(v, "schemaVersion", Value::from(2));
        fill_descriptors(v, "manifests");
    })
}

/// Decodes an image config blob.
pub fn decode_config(data: &[u8]) -> Result<ImageConfiguration, RegistryError> {
    decode("image config", data, |v| {
        fill(v, "architecture", Value::from(""));
        fill(v, "os", Value::from(""));
        if let Some(rootfs) = v.get_mut("rootfs") {
            fill(rootfs, "type", Value::from(""));
            fill(rootfs, "diff_ids", Value::Array(Vec::new()));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const AA: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    #[test]
    fn docker_and_oci_media_types() {
        assert!(is_index(&MediaType::from(DOCKER_MANIFEST_LIST)));
        assert!(is_index(&MediaType::ImageIndex));
        assert!(is_manifest(&MediaType::from(DOCKER_MANIFEST)));
        assert!(is_manifest(&MediaType::from(
            "application/vnd.oci.image.manifest.v1+json"
        )));
        assert!(!is_manifest(&MediaType::ImageIndex));
        assert!(!is_index(&MediaType::from("application/json")));
        assert!(!is_manifest(&MediaType::from("")));
        for t in [
            DOCKER_MANIFEST,
            DOCKER_MANIFEST_LIST,
            MediaType::ImageManifest.as_ref(),
            MediaType::ImageIndex.as_ref(),
        ] {
            assert!(MANIFEST_ACCEPT.contains(t), "{t}");
        }
    }

    #[test]
    fn decodes_a_docker_schema2_manifest() {
        let m = decode_manifest(
            format!(
                r#"{{"schemaVersion":2,"mediaType":"{DOCKER_MANIFEST}",
                "config":{{"mediaType":"application/vnd.docker.container.image.v1+json","digest":"{AA}","size":7}},
                "layers":[{{"mediaType":"application/vnd.docker.image.rootfs.diff.tar.gzip","digest":"{AA}","size":9}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(
            m.media_type().as_ref().map(|t| t.to_string()).as_deref(),
            Some(DOCKER_MANIFEST)
        );
        assert_eq!(m.config().digest().to_string(), AA);
        assert_eq!(m.layers()[0].size(), 9);
        assert_eq!(
            m.layers()[0].media_type().as_ref(),
            "application/vnd.docker.image.rootfs.diff.tar.gzip"
        );
    }

    #[test]
    fn fields_containerd_lets_be_missing_may_be() {
        let m = decode_manifest(
            format!(
                r#"{{"schemaVersion":2,"config":{{"digest":"{AA}","size":7}},"layers":[{{"digest":"{AA}","size":9}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(m.config().media_type().as_ref(), "");
        assert_eq!(m.layers()[0].media_type().as_ref(), "");
        let i =
            decode_index(format!(r#"{{"manifests":[{{"digest":"{AA}","size":1}}]}}"#).as_bytes())
                .unwrap();
        assert_eq!(i.schema_version(), 2);
        assert!(!is_manifest(i.manifests()[0].media_type()));
        let c = decode_config(br#"{"rootfs":{}}"#).unwrap();
        assert_eq!(c.architecture().to_string(), "");
        assert_eq!(c.os().to_string(), "");
        assert!(c.rootfs().diff_ids().is_empty());
        assert!(c.config().is_none());
    }

    #[test]
    fn required_fields_stay_required() {
        // A manifest's schemaVersion, config and layers; a config's rootfs.
        let cfg = format!(r#""config":{{"mediaType":"x","digest":"{AA}","size":7}}"#);
        for bad in [
            format!(r#"{{{cfg},"layers":[]}}"#),
            r#"{"schemaVersion":2,"layers":[]}"#.to_owned(),
            format!(r#"{{"schemaVersion":2,{cfg}}}"#),
        ] {
            let err = decode_manifest(bad.as_bytes()).unwrap_err();
            assert!(
                matches!(
                    err,
                    RegistryError::Json {
                        what: "image manifest",
                        ..
                    }
                ),
                "{bad}: {err}"
            );
        }
        let err = decode_config(br#"{"architecture":"amd64","os":"linux"}"#).unwrap_err();
        assert!(
            matches!(
                err,
                RegistryError::Json {
                    what: "image config",
                    ..
                }
            ),
            "{err}"
        );
        assert!(decode_index(b"[]").is_err());
        assert!(decode_manifest(b"not json").is_err());
    }

    #[test]
    fn config_fields_reach_the_oci_types() {
        let cfg = decode_config(
            br#"{"architecture":"amd64","os":"linux","config":{"User":"1000","Env":["A=b"],"Cmd":["sh"],
               "ExposedPorts":{"80/tcp":{}},"Labels":{"k":"v"},"StopSignal":"SIGTERM"},
               "rootfs":{"type":"layers","diff_ids":["sha256:aa"]}}"#,
        )
        .unwrap();
        let c = cfg.config().clone().unwrap_or_default();
        assert_eq!(c.user().as_deref(), Some("1000"));
        assert_eq!(c.env().clone().unwrap_or_default(), vec!["A=b".to_owned()]);
        assert_eq!(c.cmd().clone().unwrap_or_default(), vec!["sh".to_owned()]);
        assert_eq!(c.entrypoint(), &None);
        assert_eq!(c.stop_signal().as_deref(), Some("SIGTERM"));
        assert_eq!(cfg.rootfs().diff_ids(), &vec!["sha256:aa".to_owned()]);
    }

    #[test]
    fn digests() {
        let d = sha256_digest(b"a");
        assert_eq!(
            d,
            "sha256:ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb"
        );
        assert_eq!(digest(&d).unwrap().to_string(), d);
        let err = digest("sha256:abc").unwrap_err();
        assert!(matches!(err, RegistryError::InvalidDigest { .. }), "{err}");
    }
}
