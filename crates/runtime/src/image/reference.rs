//! Image references, parsed and normalised the way containerd (and docker)
//! do: `busybox` is `docker.io/library/busybox:latest`.

use std::fmt;

use crate::error::RuntimeError;

/// The registry that short names resolve to.
pub const DEFAULT_REGISTRY: &str = "docker.io";
const DEFAULT_TAG: &str = "latest";

/// A normalised image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// Registry host (and port), e.g. `docker.io`, `127.0.0.1:5000`.
    pub registry: String,
    /// Repository path inside the registry, e.g. `library/busybox`.
    pub repository: String,
    /// Tag; `None` when the reference is by digest only.
    pub tag: Option<String>,
    /// Digest (`sha256:...`), when the reference pins one.
    pub digest: Option<String>,
}

impl Reference {
    /// Parses and normalises `s`.
    ///
    /// A reference with both a tag and a digest keeps only the digest, as
    /// containerd does; a reference with neither gets the tag `latest`.
    pub fn parse(s: &str) -> Result<Self, RuntimeError> {
        let bad = |reason: &str| RuntimeError::InvalidArgument {
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
        // host[:port] or [ipv6]:port: it also names a directory under the
        // registry config dir, so `.`/`..` and other path tricks are refused.
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
        let tag = match (&digest, tag) {
            (Some(_), _) => None,
            (None, Some(t)) => Some(t.to_owned()),
            (None, None) => Some(DEFAULT_TAG.to_owned()),
        };
        Ok(Self {
            registry,
            repository,
            tag,
            digest,
        })
    }

    /// `registry/repository`, without tag or digest.
    pub fn name(&self) -> String {
        format!("{}/{}", self.registry, self.repository)
    }

    /// What to ask the registry for: the digest if pinned, else the tag.
    pub fn object(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or(DEFAULT_TAG)
    }

    /// The same repository pinned to `digest`.
    pub fn with_digest(&self, digest: &str) -> Self {
        Self {
            tag: None,
            digest: Some(digest.to_owned()),
            ..self.clone()
        }
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name())?;
        if let Some(d) = &self.digest {
            write!(f, "@{d}")
        } else if let Some(t) = &self.tag {
            write!(f, ":{t}")
        } else {
            Ok(())
        }
    }
}

/// Checks that `d` is a `sha256:<64 lowercase hex>` digest.
pub(crate) fn validate_digest(d: &str) -> Result<(), String> {
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
                assert!(Reference::parse(r).is_err(), "{r}");
                continue;
            }
            let e = Reference::parse(r).unwrap_err().to_string();
            assert!(e.contains("registry host"), "{r}: {e}");
        }
        assert_eq!(
            Reference::parse("[::1]:5000/x").unwrap().registry,
            "[::1]:5000"
        );
        assert_eq!(
            Reference::parse("127.0.0.1:5000/x").unwrap().registry,
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
            assert_eq!(
                Reference::parse(input).unwrap().to_string(),
                want,
                "{input}"
            );
        }
    }

    #[test]
    fn digest_wins_over_tag() {
        let r = Reference::parse(&format!("busybox:1.36@{D}")).unwrap();
        assert_eq!(r.to_string(), format!("docker.io/library/busybox@{D}"));
        assert_eq!(r.object(), D);
        assert_eq!(r.tag, None);
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
            let err = Reference::parse(bad).unwrap_err();
            assert!(
                matches!(err, RuntimeError::InvalidArgument { .. }),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn with_digest_drops_tag() {
        let r = Reference::parse("127.0.0.1:5000/busybox:test")
            .unwrap()
            .with_digest(D);
        assert_eq!(r.to_string(), format!("127.0.0.1:5000/busybox@{D}"));
    }
}
