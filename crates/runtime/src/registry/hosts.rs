//! Registry host configuration in containerd's `hosts.toml` format, read from
//! `<registry_config_dir>/<registry>/hosts.toml`:
//!
//! ```toml
//! server = "https://registry.k8s.io"
//! [host."http://127.0.0.1:5000"]
//!   capabilities = ["pull", "resolve"]
//! ```
//!
//! Hosts are tried in file order, then `server`. Without a file, the registry
//! itself is used (`docker.io` means `registry-1.docker.io`), over plain HTTP
//! for `localhost`, `127.0.0.1` and `::1`, HTTPS otherwise.

use std::path::Path;

use serde::Deserialize;

use crate::error::RuntimeError;

/// One endpoint that can serve a registry's repositories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryHost {
    /// `http` or `https`.
    pub scheme: String,
    /// `host[:port]`.
    pub authority: String,
    /// Path prefix of the API, normally `/v2`.
    pub path: String,
    /// May be used to fetch content by digest.
    pub pull: bool,
    /// May be used to resolve tags to digests.
    pub resolve: bool,
    /// Extra request headers.
    pub headers: Vec<(String, String)>,
}

impl RegistryHost {
    /// URL of `<path>/<repository>/<kind>/<object>`.
    pub fn url(&self, repository: &str, kind: &str, object: &str) -> String {
        format!(
            "{}://{}{}/{repository}/{kind}/{object}",
            self.scheme, self.authority, self.path
        )
    }
}

#[derive(Debug, Default, Deserialize)]
struct HostsFile {
    server: Option<String>,
    #[serde(default)]
    capabilities: Option<Vec<String>>,
    #[serde(default)]
    override_path: bool,
    #[serde(default)]
    host: toml::map::Map<String, toml::Value>,
}

#[derive(Debug, Default, Deserialize)]
struct HostEntry {
    capabilities: Option<Vec<String>>,
    #[serde(default)]
    override_path: bool,
    #[serde(default)]
    header: toml::map::Map<String, toml::Value>,
}

/// True for registries that default to plain HTTP.
fn is_local(registry: &str) -> bool {
    let host = if let Some(rest) = registry.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else {
        registry.rsplit_once(':').map_or(registry, |(h, _)| h)
    };
    matches!(host, "localhost" | "127.0.0.1" | "::1")
}

/// The default server URL for `registry`.
fn default_server(registry: &str) -> String {
    if registry == "docker.io" {
        "https://registry-1.docker.io".to_owned()
    } else if is_local(registry) {
        format!("http://{registry}")
    } else {
        format!("https://{registry}")
    }
}

fn parse_host(
    url: &str,
    override_path: bool,
    caps: Option<&[String]>,
    headers: Vec<(String, String)>,
) -> Result<RegistryHost, String> {
    let with_scheme = if url.contains("://") {
        url.to_owned()
    } else {
        format!("https://{url}")
    };
    let uri: http::Uri = with_scheme
        .parse()
        .map_err(|e| format!("host {url:?}: {e}"))?;
    let scheme = uri.scheme_str().unwrap_or("https").to_owned();
    if scheme != "http" && scheme != "https" {
        return Err(format!("host {url:?}: unsupported scheme {scheme}"));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| format!("host {url:?}: no host"))?
        .to_string();
    let mut path = uri.path().trim_end_matches('/').to_owned();
    if !override_path {
        path.push_str("/v2");
    }
    let has = |c: &str| caps.is_none_or(|cs| cs.iter().any(|x| x == c));
    Ok(RegistryHost {
        scheme,
        authority,
        path,
        pull: has("pull"),
        resolve: has("resolve"),
        headers,
    })
}

/// The hosts to try for `registry`, in order.
pub fn hosts_for(config_dir: &Path, registry: &str) -> Result<Vec<RegistryHost>, RuntimeError> {
    let path = config_dir.join(registry).join("hosts.toml");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(RuntimeError::Io {
                op: "read registry host config",
                path: path.display().to_string(),
                source,
            })
        }
    };
    let bad = |reason: String| RuntimeError::InvalidArgument {
        field: format!("registry host config {}", path.display()),
        reason,
    };
    let Some(text) = text else {
        let server = default_server(registry);
        return Ok(vec![
            parse_host(&server, false, None, Vec::new()).map_err(bad)?
        ]);
    };
    let file: HostsFile = toml::from_str(&text).map_err(|source| RuntimeError::HostsConfig {
        path: path.display().to_string(),
        source,
    })?;
    let mut hosts = Vec::new();
    for (url, value) in &file.host {
        let entry: HostEntry =
            value
                .clone()
                .try_into()
                .map_err(|source| RuntimeError::HostsConfig {
                    path: path.display().to_string(),
                    source,
                })?;
        let headers = entry
            .header
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v.as_str().map_or_else(|| v.to_string(), str::to_owned),
                )
            })
            .collect();
        hosts.push(
            parse_host(
                url,
                entry.override_path,
                entry.capabilities.as_deref(),
                headers,
            )
            .map_err(bad)?,
        );
    }
    let server = file.server.unwrap_or_else(|| default_server(registry));
    hosts.push(
        parse_host(
            &server,
            file.override_path,
            file.capabilities.as_deref(),
            Vec::new(),
        )
        .map_err(bad)?,
    );
    Ok(hosts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_without_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let h = hosts_for(dir.path(), "docker.io").unwrap();
        assert_eq!(h.len(), 1);
        assert_eq!(
            h[0].url("library/busybox", "manifests", "latest"),
            "https://registry-1.docker.io/v2/library/busybox/manifests/latest"
        );
        let h = hosts_for(dir.path(), "127.0.0.1:5000").unwrap();
        assert_eq!(h[0].scheme, "http");
        let h = hosts_for(dir.path(), "localhost").unwrap();
        assert_eq!(h[0].scheme, "http");
        let h = hosts_for(dir.path(), "registry.k8s.io").unwrap();
        assert_eq!(h[0].scheme, "https");
    }

    #[test]
    fn mirrors_in_file_order_then_server() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("registry.k8s.io")).unwrap();
        std::fs::write(
            dir.path().join("registry.k8s.io/hosts.toml"),
            r#"server = "https://registry.k8s.io"
[host."http://127.0.0.1:5000"]
  capabilities = ["pull", "resolve"]
[host."http://127.0.0.1:5001/mirror"]
  capabilities = ["pull"]
  override_path = true
  [host."http://127.0.0.1:5001/mirror".header]
    x-test = "1"
"#,
        )
        .unwrap();
        let h = hosts_for(dir.path(), "registry.k8s.io").unwrap();
        assert_eq!(h.len(), 3);
        assert_eq!(
            h[0].url("pause", "manifests", "3.9"),
            "http://127.0.0.1:5000/v2/pause/manifests/3.9"
        );
        assert!(h[0].pull && h[0].resolve);
        assert_eq!(
            h[1].url("pause", "blobs", "x"),
            "http://127.0.0.1:5001/mirror/pause/blobs/x"
        );
        assert!(h[1].pull && !h[1].resolve);
        assert_eq!(h[1].headers, vec![("x-test".to_owned(), "1".to_owned())]);
        assert_eq!(h[2].authority, "registry.k8s.io");
        assert!(h[2].pull && h[2].resolve);
    }

    #[test]
    fn bad_toml_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("r.example")).unwrap();
        std::fs::write(dir.path().join("r.example/hosts.toml"), "server = [").unwrap();
        let err = hosts_for(dir.path(), "r.example").unwrap_err();
        assert!(err.to_string().contains("hosts.toml"), "{err}");
    }
}
