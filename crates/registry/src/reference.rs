//! Image references, parsed and normalised the way containerd (and docker)
//! do: `busybox` is `docker.io/library/busybox:latest`.
//!
//! The value is oci-spec's [`Reference`]; the grammar is Cubelet's own,
//! because oci-spec's parser differs from containerd's where it matters to
//! a node (each case is a test below): it keeps the tag of a `name:tag@digest`
//! reference (containerd pulls by the digest and names the image without the
//! tag), refuses bracketed IPv6 registry hosts (`[::1]:5000/x`), and accepts
//! what containerd refuses: upper case in a first path component or a
//! dot-less host (`Foo:5000/x`), non-ASCII tags, and digests other than
//! sha256 that the content store cannot verify.

use oci_spec::distribution::Reference;

use crate::error::RegistryError;

/// The registry that short names resolve to.
pub const DEFAULT_REGISTRY: &str = "docker.io";
const DEFAULT_TAG: &str = "latest";

/// Parses and normalises `s`.
///
/// A reference with both a tag and a digest keeps only the digest, as
/// containerd does; a reference with neither gets the tag `latest`. The
/// registry host also names a directory under the registry config dir, so
/// `.`/`..` and other path tricks are refused.
pub fn parse_reference(s: &str) -> Result<Reference, RegistryError> {
    let bad = |reason: &str| RegistryError::InvalidArgument {
        field: "image reference".to_owned(),
        reason: format!("{s:?}: {reason}"),
    };
    if s.is_empty() {
        return Err(bad("empty"));
    }
    let (rest, digest) = match s.split_once('@') {
        Some((r, d)) => {
            validate_digest(d).map_err(|e| bad(&e))?;
            (r, Some(d.to_owned()))
        }
        None => (s, None),
    };
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match rest[last_slash..].rfind(':') {
        Some(i) => (&rest[..last_slash + i], Some(&rest[last_slash + i + 1..])),
        None => (rest, None),
    };
    if let Some(t) = tag {
        let ok = !t.is_empty()
            && t.len() <= 128
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
            && !t.starts_with(['.', '-']);
        if !ok {
            return Err(bad("invalid tag"));
        }
    }
    let (registry, path) = match name.split_once('/') {
        Some((first, path))
            if first.contains('.') || first.contains(':') || first == "localhost" =>
        {
            (first.to_owned(), path.to_owned())
        }
        _ => (DEFAULT_REGISTRY.to_owned(), name.to_owned()),
    };
    let registry = if registry == "index.docker.io" {
        DEFAULT_REGISTRY.to_owned()
    } else {
        registry
    };
    if registry.chars().any(|c| c.is_ascii_uppercase()) && !registry.contains('.') {
        return Err(bad("invalid registry host"));
    }
    // host[:port] or [ipv6]:port.
    let host_ok = registry.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '[')
        && registry
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || ".-:[]".contains(c));
    if !host_ok {
        return Err(bad("invalid registry host"));
    }
    let repository = if registry == DEFAULT_REGISTRY && !path.contains('/') {
        format!("library/{path}")
    } else {
        path
    };
    let component_ok = |c: &str| {
        !c.is_empty()
            && c.chars()
                .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || "._-".contains(ch))
            && c.starts_with(|ch: char| ch.is_ascii_alphanumeric())
            && c.ends_with(|ch: char| ch.is_ascii_alphanumeric())
    };
    if !repository.split('/').all(component_ok) {
        return Err(bad(
            "invalid repository name (lowercase letters, digits and ._- only)",
        ));
    }
    Ok(match (digest, tag) {
        (Some(d), _) => Reference::with_digest(registry, repository, d),
        (None, Some(t)) => Reference::with_tag(registry, repository, t.to_owned()),
        (None, None) => Reference::with_tag(registry, repository, DEFAULT_TAG.to_owned()),
    })
}

/// What Cubelet asks of a parsed [`Reference`] besides oci-spec's accessors.
pub trait ReferenceExt {
    /// `registry/repository`, without tag or digest.
    fn name(&self) -> String;
    /// What to ask the registry for: the digest if pinned, else the tag.
    fn object(&self) -> &str;
}

impl ReferenceExt for Reference {
    fn name(&self) -> String {
        format!("{}/{}", self.registry(), self.repository())
    }

    fn object(&self) -> &str {
        self.digest().or(self.tag()).unwrap_or(DEFAULT_TAG)
    }
}

/// Checks that `d` is a `sha256:<64 lowercase hex>` digest.
fn validate_digest(d: &str) -> Result<(), String> {
    match d.strip_prefix("sha256:") {
        Some(h) if h.len() == 64 && h.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')) => Ok(()),
        Some(_) => Err("invalid sha256 digest".to_owned()),
        None => Err("unsupported digest algorithm (only sha256)".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn registry_hosts_that_are_paths_are_refused() {
        for r in ["../busybox", "./busybox", "../x/busybox:1", "a..b/../c"] {
            // `a..b` is a host (odd but harmless); `..` as a component is not.
            if r == "a..b/../c" {
                assert!(parse_reference(r).is_err(), "{r}");
                continue;
            }
            let e = parse_reference(r).unwrap_err().to_string();
            assert!(e.contains("registry host"), "{r}: {e}");
        }
        assert_eq!(
            parse_reference("[::1]:5000/x").unwrap().registry(),
            "[::1]:5000"
        );
        assert_eq!(
            parse_reference("127.0.0.1:5000/x").unwrap().registry(),
            "127.0.0.1:5000"
        );
    }

    #[test]
    fn normalises_like_containerd() {
        let cases = [
            ("busybox", "docker.io/library/busybox:latest"),
            ("busybox:1.36", "docker.io/library/busybox:1.36"),
            ("user/app", "docker.io/user/app:latest"),
            (
                "index.docker.io/library/busybox",
                "docker.io/library/busybox:latest",
            ),
            ("registry.k8s.io/pause:3.9", "registry.k8s.io/pause:3.9"),
            ("127.0.0.1:5000/busybox:test", "127.0.0.1:5000/busybox:test"),
            ("localhost/a/b", "localhost/a/b:latest"),
            ("localhost:5000/a", "localhost:5000/a:latest"),
        ];
        for (input, want) in cases {
            assert_eq!(parse_reference(input).unwrap().to_string(), want, "{input}");
        }
    }

    #[test]
    fn parts_of_a_normalised_reference() {
        let r = parse_reference("busybox").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag(), r.digest()),
            ("docker.io", "library/busybox", Some("latest"), None)
        );
        assert_eq!(r.name(), "docker.io/library/busybox");
        assert_eq!(r.object(), "latest");
        let r = parse_reference("localhost:5000/a/b:v1").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("localhost:5000", "a/b", Some("v1"))
        );
    }

    #[test]
    fn digest_wins_over_tag() {
        let r = parse_reference(&format!("busybox:1.36@{D}")).unwrap();
        assert_eq!(r.to_string(), format!("docker.io/library/busybox@{D}"));
        assert_eq!(r.object(), D);
        assert_eq!(r.tag(), None);
    }

    #[test]
    fn rejects_bad_references() {
        for bad in [
            "",
            "Busybox",
            "busybox:",
            "busybox@sha256:abc",
            "busybox@md5:00",
            "a//b",
            "-a",
        ] {
            let err = parse_reference(bad).unwrap_err();
            assert!(
                matches!(&err, RegistryError::InvalidArgument { field, .. } if field == "image reference"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn with_digest_drops_tag() {
        let r = parse_reference("127.0.0.1:5000/busybox:test")
            .unwrap()
            .clone_with_digest(D.to_owned());
        assert_eq!(r.to_string(), format!("127.0.0.1:5000/busybox@{D}"));
    }

    /// Where oci-spec's own parser answers differently, ours keeps
    /// containerd's answer.
    #[test]
    fn differs_from_oci_spec_where_containerd_does() {
        let oci = |s: &str| s.parse::<Reference>();

        // Tag and digest: containerd pulls by digest and drops the tag.
        let both = format!("busybox:1.36@{D}");
        assert_eq!(oci(&both).unwrap().tag(), Some("1.36"));
        assert_eq!(parse_reference(&both).unwrap().tag(), None);

        // Bracketed IPv6 hosts.
        assert!(oci("[::1]:5000/x").is_err());
        assert_eq!(
            parse_reference("[::1]:5000/x").unwrap().to_string(),
            "[::1]:5000/x:latest"
        );

        // Upper case outside a dotted host.
        for s in ["Foo:5000/x", "Uppercase/lowercase:tag"] {
            assert!(oci(s).is_ok(), "{s}");
            assert!(parse_reference(s).is_err(), "{s}");
        }
        // A dotted host may have capitals, as in containerd.
        assert_eq!(
            parse_reference("Registry.Example/x").unwrap().registry(),
            "Registry.Example"
        );

        // Non-ASCII tags.
        assert!(oci("busybox:é").is_ok());
        assert!(parse_reference("busybox:é").is_err());

        // Digests the content store cannot verify.
        let sha512 = format!("busybox@sha512:{}", "f".repeat(128));
        assert!(oci(&sha512).is_ok());
        let err = parse_reference(&sha512).unwrap_err();
        assert!(err.to_string().contains("only sha256"), "{err}");
        let upper = format!("busybox@sha256:{}", "F".repeat(64));
        assert!(oci(&upper).is_ok());
        assert!(parse_reference(&upper).is_err());

        // Names oci-spec's stricter component grammar refuses.
        for s in ["a..b/c", "x.example/a..b", "x.example/a._b"] {
            assert!(oci(s).is_err(), "{s}");
            assert!(parse_reference(s).is_ok(), "{s}");
        }
    }
}
