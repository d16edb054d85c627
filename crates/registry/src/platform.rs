//! The platform images are pulled for: the host's, in OCI naming, and how an
//! index entry or an image config is matched against it.

use std::fmt;

use oci_spec::image::{Arch, Descriptor, ImageConfiguration, ImageIndex, Os, Platform};

use crate::error::RegistryError;
use crate::media;

/// The platform Cubelet runs containers for: `linux` and the architecture
/// (and variant) of the machine it was built for.
pub fn host_platform() -> Platform {
    oci_platform(std::env::consts::ARCH, arm_variant())
}

/// The variant of a 32-bit ARM build, from its target features.
fn arm_variant() -> &'static str {
    if cfg!(target_feature = "v8") {
        "v8"
    } else if cfg!(target_feature = "v7") {
        "v7"
    } else if cfg!(target_feature = "v6") {
        "v6"
    } else if cfg!(target_feature = "v5te") {
        "v5"
    } else {
        "v7"
    }
}

/// The OCI platform of Rust architecture `rust_arch` on Linux, as Go (and so
/// OCI and containerd) names it; `arm_variant` is used for 32-bit ARM.
/// An architecture without an OCI name keeps its Rust name.
pub fn oci_platform(rust_arch: &str, arm_variant: &str) -> Platform {
    let (arch, variant) = match rust_arch {
        "x86_64" => (Arch::Amd64, None),
        "aarch64" => (Arch::ARM64, Some("v8")),
        "arm" => (Arch::ARM, Some(arm_variant)),
        "x86" => (Arch::i386, None),
        "powerpc64" if cfg!(target_endian = "big") => (Arch::PowerPC64, None),
        "powerpc64" => (Arch::PowerPC64le, None),
        "s390x" => (Arch::s390x, None),
        "riscv64" => (Arch::RISCV64, None),
        "loongarch64" => (Arch::LoongArch64, None),
        other => (Arch::Other(other.to_owned()), None),
    };
    let mut platform = Platform::default();
    platform.set_os(Os::Linux);
    platform.set_architecture(arch);
    platform.set_variant(variant.map(str::to_owned));
    platform
}

/// `os/architecture[/variant]`, as in error messages and `--platform`.
#[derive(Debug, Clone, Copy)]
pub struct PlatformName<'a>(pub &'a Platform);

impl fmt::Display for PlatformName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.0.os(), self.0.architecture())?;
        match self.0.variant() {
            Some(v) if !v.is_empty() => write!(f, "/{v}"),
            _ => Ok(()),
        }
    }
}

/// True if an index entry for `candidate` runs on `want`: the same os and
/// architecture, and the same variant when both name one (as containerd
/// matches: an entry without a variant suits every variant).
pub fn platform_matches(want: &Platform, candidate: &Platform) -> bool {
    let variant_ok = match (want.variant().as_deref(), candidate.variant().as_deref()) {
        (Some(a), Some(b)) if !a.is_empty() && !b.is_empty() => a == b,
        _ => true,
    };
    want.os() == candidate.os() && want.architecture() == candidate.architecture() && variant_ok
}

/// The position of the first image manifest of `index` for `platform`, if
/// any; entries without a platform, or that are not image manifests (nested
/// indexes, attestations), are skipped.
pub fn select_manifest(index: &ImageIndex, platform: &Platform) -> Option<usize> {
    index.manifests().iter().position(|m| {
        m.platform()
            .as_ref()
            .is_some_and(|p| platform_matches(platform, p))
            && media::is_manifest(m.media_type())
    })
}

/// The first image manifest of `index` for `platform` and its position, or
/// an error naming the platform; `reference` names the image in it.
pub fn pick_manifest<'a>(
    index: &'a ImageIndex,
    platform: &Platform,
    reference: &str,
) -> Result<(usize, &'a Descriptor), RegistryError> {
    select_manifest(index, platform)
        .and_then(|i| index.manifests().get(i).map(|d| (i, d)))
        .ok_or_else(|| RegistryError::ImageFormat {
            reference: reference.to_owned(),
            reason: format!("no {} manifest in the index", PlatformName(platform)),
        })
}

/// True if an image whose config is `config` runs on `platform`: the same
/// os, and the same architecture unless the config names none.
pub fn config_matches(config: &ImageConfiguration, platform: &Platform) -> bool {
    config.os() == platform.os()
        && (config.architecture() == platform.architecture()
            || config.architecture().to_string().is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::media::{decode_config, decode_index, DOCKER_MANIFEST, DOCKER_MANIFEST_LIST};

    const AA: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const BB: &str = "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
    const CC: &str = "sha256:cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc";

    fn entry(media_type: &str, digest: &str, platform: &str) -> String {
        format!(
            r#"{{"mediaType":"{media_type}","digest":"{digest}","size":1,"platform":{platform}}}"#
        )
    }

    fn index(entries: &[String]) -> ImageIndex {
        decode_index(
            format!(
                r#"{{"schemaVersion":2,"mediaType":"{DOCKER_MANIFEST_LIST}","manifests":[{}]}}"#,
                entries.join(",")
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn linux(arch: &str, variant: Option<&str>) -> String {
        match variant {
            Some(v) => format!(r#"{{"architecture":"{arch}","os":"linux","variant":"{v}"}}"#),
            None => format!(r#"{{"architecture":"{arch}","os":"linux"}}"#),
        }
    }

    #[test]
    fn rust_architectures_map_to_oci_names() {
        let cases = [
            ("x86_64", "amd64", None),
            ("aarch64", "arm64", Some("v8")),
            ("arm", "arm", Some("v6")),
            ("x86", "386", None),
            ("s390x", "s390x", None),
            ("riscv64", "riscv64", None),
            ("loongarch64", "loong64", None),
            ("sparc64", "sparc64", None),
        ];
        for (rust, arch, variant) in cases {
            let p = oci_platform(rust, "v6");
            assert_eq!(p.os(), &Os::Linux, "{rust}");
            assert_eq!(p.architecture().to_string(), arch, "{rust}");
            assert_eq!(p.variant().as_deref(), variant, "{rust}");
        }
        let ppc = oci_platform("powerpc64", "v7");
        let want = if cfg!(target_endian = "big") {
            "ppc64"
        } else {
            "ppc64le"
        };
        assert_eq!(ppc.architecture().to_string(), want);
        assert_eq!(
            PlatformName(&oci_platform("aarch64", "")).to_string(),
            "linux/arm64/v8"
        );
        assert_eq!(
            PlatformName(&oci_platform("x86_64", "")).to_string(),
            "linux/amd64"
        );
    }

    #[test]
    fn the_host_platform_is_the_build_target() {
        let host = host_platform();
        assert_eq!(host.os(), &Os::Linux);
        assert!(
            !matches!(host.architecture(), Arch::Other(_)),
            "{} has no OCI name",
            std::env::consts::ARCH
        );
        #[cfg(target_arch = "x86_64")]
        assert_eq!(PlatformName(&host).to_string(), "linux/amd64");
        #[cfg(target_arch = "aarch64")]
        assert_eq!(PlatformName(&host).to_string(), "linux/arm64/v8");
    }

    #[test]
    fn picks_linux_amd64_from_an_index() {
        let idx = index(&[
            entry(DOCKER_MANIFEST, AA, &linux("arm64", None)),
            entry(DOCKER_MANIFEST, BB, &linux("amd64", None)),
        ]);
        assert_eq!(select_manifest(&idx, &oci_platform("x86_64", "")), Some(1));
    }

    #[test]
    fn picks_the_hosts_entry_among_arm64_and_amd64() {
        let idx = index(&[
            entry(DOCKER_MANIFEST, AA, &linux("amd64", None)),
            entry(DOCKER_MANIFEST, BB, &linux("arm64", Some("v8"))),
        ]);
        assert_eq!(select_manifest(&idx, &oci_platform("x86_64", "")), Some(0));
        assert_eq!(select_manifest(&idx, &oci_platform("aarch64", "")), Some(1));
        let want = if cfg!(target_arch = "x86_64") {
            Some(0)
        } else if cfg!(target_arch = "aarch64") {
            Some(1)
        } else {
            None
        };
        assert_eq!(select_manifest(&idx, &host_platform()), want);
    }

    #[test]
    fn variants_count_only_when_both_name_one() {
        let idx = index(&[
            entry(DOCKER_MANIFEST, AA, &linux("arm", Some("v6"))),
            entry(DOCKER_MANIFEST, BB, &linux("arm", Some("v7"))),
            entry(DOCKER_MANIFEST, CC, &linux("arm64", None)),
        ]);
        assert_eq!(select_manifest(&idx, &oci_platform("arm", "v7")), Some(1));
        assert_eq!(select_manifest(&idx, &oci_platform("arm", "v6")), Some(0));
        assert_eq!(select_manifest(&idx, &oci_platform("arm", "v5")), None);
        // arm64 without a variant suits the host's v8.
        assert_eq!(select_manifest(&idx, &oci_platform("aarch64", "")), Some(2));
        // A host without a variant takes the first entry of its architecture.
        let mut any_arm = oci_platform("arm", "");
        any_arm.set_variant(None);
        assert_eq!(select_manifest(&idx, &any_arm), Some(0));
    }

    #[test]
    fn skips_other_oses_entries_without_platform_and_non_manifests() {
        let idx = index(&[
            entry(
                DOCKER_MANIFEST,
                AA,
                r#"{"architecture":"amd64","os":"windows"}"#,
            ),
            format!(r#"{{"mediaType":"{DOCKER_MANIFEST}","digest":"{AA}","size":1}}"#),
            entry(
                "application/vnd.oci.image.index.v1+json",
                BB,
                &linux("amd64", None),
            ),
            entry(
                "application/vnd.oci.image.manifest.v1+json",
                CC,
                &linux("amd64", None),
            ),
        ]);
        assert_eq!(select_manifest(&idx, &oci_platform("x86_64", "")), Some(3));
        assert_eq!(select_manifest(&idx, &oci_platform("s390x", "")), None);
    }

    #[test]
    fn no_entry_for_the_platform_is_an_error_naming_it() {
        let idx = index(&[
            entry(DOCKER_MANIFEST, AA, &linux("arm64", Some("v8"))),
            entry(DOCKER_MANIFEST, BB, &linux("s390x", None)),
        ]);
        let err = pick_manifest(&idx, &oci_platform("x86_64", ""), "r.example/app:1").unwrap_err();
        assert!(
            matches!(&err, RegistryError::ImageFormat { reference, .. } if reference == "r.example/app:1"),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "image r.example/app:1: no linux/amd64 manifest in the index"
        );
        let err = pick_manifest(&idx, &oci_platform("arm", "v7"), "x").unwrap_err();
        assert!(
            err.to_string().contains("no linux/arm/v7 manifest"),
            "{err}"
        );
        let (i, d) = pick_manifest(&idx, &oci_platform("aarch64", ""), "x").unwrap();
        assert_eq!((i, d.digest().to_string()), (0, AA.to_owned()));
        let empty = index(&[]);
        assert!(pick_manifest(&empty, &host_platform(), "x").is_err());
    }

    #[test]
    fn configs_match_by_os_and_architecture_if_named() {
        let amd64 = oci_platform("x86_64", "");
        let cfg = |json: &str| decode_config(json.as_bytes()).unwrap();
        let rootfs = r#""rootfs":{"type":"layers","diff_ids":[]}"#;
        assert!(config_matches(
            &cfg(&format!(
                r#"{{"architecture":"amd64","os":"linux",{rootfs}}}"#
            )),
            &amd64
        ));
        assert!(config_matches(
            &cfg(&format!(r#"{{"os":"linux",{rootfs}}}"#)),
            &amd64
        ));
        assert!(!config_matches(
            &cfg(&format!(
                r#"{{"architecture":"arm64","os":"linux",{rootfs}}}"#
            )),
            &amd64
        ));
        assert!(!config_matches(
            &cfg(&format!(
                r#"{{"architecture":"amd64","os":"windows",{rootfs}}}"#
            )),
            &amd64
        ));
        assert!(!config_matches(
            &cfg(&format!(r#"{{"architecture":"amd64",{rootfs}}}"#)),
            &amd64
        ));
    }
}
