//! Registry host configuration in containerd's `hosts.toml` format, read from
//! `<registry_config_dir>/<registry>/hosts.toml`:
//!
//! ```toml
//! server = "https://registry.k8s.io"
//! ca = "/etc/cubelet/certs.d/registry.k8s.io/ca.pem"
//!
//! [host."https://mirror.example:5443"]
//!   capabilities = ["pull", "resolve"]
//!   ca = ["mirror-ca.pem", "other-ca.pem"]       # relative to this file's directory
//!   client = [["client.pem", "client-key.pem"]]  # or "both-in-one.pem"
//!
//! [host."https://10.0.0.1:5000"]
//!   skip_verify = true
//! ```
//!
//! Credentials (CRI's `AuthConfig`) go to the registry's own `server` only,
//! never to a `[host."..."]` mirror unless it says `send_credentials = true`
//! (a Cubelet key containerd does not have) and is reached over HTTPS; see
//! [`crate::RegistryClient`] for every rule.
//!
//! Hosts are tried in file order, then `server`. TLS options (`ca`,
//! `skip_verify`, `client`) go at the top level for `server` and under each
//! `[host."..."]`; server certificates are checked against the system's
//! roots plus the host's `ca` files. As in containerd, an `http://` host
//! with TLS options and a port other than 80 is tried over HTTPS first.
//!
//! Without a file, the registry itself is used (`docker.io` means
//! `registry-1.docker.io`) over HTTPS. `localhost`, `127.0.0.1` and `::1`
//! (unless on port 80, which is plain HTTP) are tried over HTTPS first and
//! fall back to plain HTTP when the server does not speak TLS, like
//! containerd; unlike containerd ≥ 1.7, their certificates are still
//! verified (add `skip_verify` in a hosts.toml to accept any).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::RegistryError;
use crate::tls::{self, ClientCertFiles, TlsConfig, TlsOptions};

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
    /// Retry over plain HTTP when this `https` host does not speak TLS.
    pub http_fallback: bool,
    /// This mirror may be sent the pull's credentials (over HTTPS only):
    /// `send_credentials = true` under its `[host."..."]` table. The
    /// registry's own server needs no such key.
    pub send_credentials: bool,
    /// TLS settings (private: `tls_config` is built from them).
    tls: TlsOptions,
    /// The client configuration built from `tls` by [`hosts_for`]; `None`
    /// only for hosts parsed without loading (tests), which build it from
    /// `tls` on demand.
    tls_config: Option<TlsConfig>,
}

impl RegistryHost {
    /// URL of `<path>/<repository>/<kind>/<object>`.
    pub fn url(&self, repository: &str, kind: &str, object: &str) -> String {
        format!(
            "{}://{}{}/{repository}/{kind}/{object}",
            self.scheme, self.authority, self.path
        )
    }

    /// The host's TLS settings.
    pub fn tls(&self) -> &TlsOptions {
        &self.tls
    }

    /// The client configuration for this host's TLS settings (loaded by
    /// [`hosts_for`]; built from them now for a host made otherwise).
    pub(crate) fn tls_config(&self) -> Result<TlsConfig, RegistryError> {
        match &self.tls_config {
            Some(c) => Ok(c.clone()),
            None => tls::client_config(&self.tls),
        }
    }
}

/// A string or a list of strings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// `client`: `"both.pem"`, `["a.pem", "b.pem"]` or `[["cert.pem", "key.pem"]]`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ClientSpec {
    One(String),
    Many(Vec<OneOrMany>),
}

/// TLS keys shared by the top level and `[host."..."]` tables.
#[derive(Debug, Default, Deserialize)]
struct TlsKeys {
    ca: Option<OneOrMany>,
    skip_verify: Option<bool>,
    client: Option<ClientSpec>,
}

#[derive(Debug, Default, Deserialize)]
struct HostsFile {
    server: Option<String>,
    #[serde(default)]
    capabilities: Option<Vec<String>>,
    #[serde(default)]
    override_path: bool,
    #[serde(flatten)]
    tls: TlsKeys,
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
    #[serde(default)]
    send_credentials: bool,
    #[serde(flatten)]
    tls: TlsKeys,
}

/// `p` as containerd reads it: relative to the hosts.toml's directory.
fn resolve_path(base: &Path, p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

impl TlsKeys {
    /// The options, with paths resolved against `base`, and whether any TLS
    /// key was written at all (containerd's "explicit TLS").
    fn options(&self, base: &Path) -> Result<(TlsOptions, bool), String> {
        let ca = match &self.ca {
            None => Vec::new(),
            Some(OneOrMany::One(p)) => vec![resolve_path(base, p)],
            Some(OneOrMany::Many(ps)) => ps.iter().map(|p| resolve_path(base, p)).collect(),
        };
        let client = match &self.client {
            None => Vec::new(),
            Some(ClientSpec::One(p)) => vec![ClientCertFiles {
                cert: resolve_path(base, p),
                key: None,
            }],
            Some(ClientSpec::Many(entries)) => entries
                .iter()
                .map(|e| match e {
                    OneOrMany::One(p) => Ok(ClientCertFiles {
                        cert: resolve_path(base, p),
                        key: None,
                    }),
                    OneOrMany::Many(pair) => match pair.as_slice() {
                        [cert, key] => Ok(ClientCertFiles {
                            cert: resolve_path(base, cert),
                            key: Some(resolve_path(base, key)),
                        }),
                        _ => Err(format!(
                            "client pair {pair:?}: want [\"cert.pem\", \"key.pem\"]"
                        )),
                    },
                })
                .collect::<Result<_, _>>()?,
        };
        let explicit = self.ca.is_some() || self.client.is_some() || self.skip_verify.is_some();
        let options = TlsOptions {
            ca,
            skip_verify: self.skip_verify.unwrap_or(false),
            client,
        };
        Ok((options, explicit))
    }
}

/// Splits `authority` into host and port (`""` without one).
fn split_port(authority: &str) -> (&str, &str) {
    if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest.split_once(']').unwrap_or((rest, ""));
        (host, after.strip_prefix(':').unwrap_or(""))
    } else {
        authority.rsplit_once(':').unwrap_or((authority, ""))
    }
}

/// True for registries that may serve plain HTTP without saying so.
fn is_local(registry: &str) -> bool {
    matches!(split_port(registry).0, "localhost" | "127.0.0.1" | "::1")
}

/// The default server URL for `registry`.
fn default_server(registry: &str) -> String {
    if registry == "docker.io" {
        "https://registry-1.docker.io".to_owned()
    } else if is_local(registry) && split_port(registry).1 == "80" {
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
    (tls, explicit_tls): (TlsOptions, bool),
) -> Result<RegistryHost, String> {
    let with_scheme = if url.contains("://") {
        url.to_owned()
    } else {
        format!("https://{url}")
    };
    let uri: http::Uri = with_scheme
        .parse()
        .map_err(|e| format!("host {url:?}: {e}"))?;
    let mut scheme = uri.scheme_str().unwrap_or("https").to_owned();
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
    // containerd: TLS settings on an http host whose port does not say
    // which protocol it speaks mean "try HTTPS first".
    let port = split_port(&authority).1;
    let mut http_fallback = false;
    if scheme == "http" && explicit_tls && !port.is_empty() && port != "80" {
        scheme = "https".to_owned();
        http_fallback = true;
    }
    let has = |c: &str| caps.is_none_or(|cs| cs.iter().any(|x| x == c));
    Ok(RegistryHost {
        scheme,
        authority,
        path,
        pull: has("pull"),
        resolve: has("resolve"),
        headers,
        http_fallback,
        send_credentials: false,
        tls,
        tls_config: None,
    })
}

/// The default host of `registry` when no `server` is configured.
fn default_host(
    registry: &str,
    override_path: bool,
    caps: Option<&[String]>,
    tls: (TlsOptions, bool),
) -> Result<RegistryHost, String> {
    let server = default_server(registry);
    let mut host = parse_host(&server, override_path, caps, Vec::new(), tls)?;
    if is_local(registry) && host.scheme == "https" {
        host.http_fallback = true;
    }
    Ok(host)
}

/// The hosts to try for `registry`, in order, with their TLS files read:
/// a missing or unusable `ca` or `client` file is an error naming it.
pub fn hosts_for(config_dir: &Path, registry: &str) -> Result<Vec<RegistryHost>, RegistryError> {
    // The registry names a directory under `config_dir`: never a way out.
    if registry.is_empty()
        || registry == "."
        || registry == ".."
        || registry.contains(['/', '\\', '\0'])
    {
        return Err(RegistryError::InvalidArgument {
            field: "registry".to_owned(),
            reason: format!("{registry:?} is not a registry host"),
        });
    }
    let path = config_dir.join(registry).join("hosts.toml");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(RegistryError::Io {
                op: "read registry host config",
                path: path.display().to_string(),
                source,
            })
        }
    };
    let mut hosts = match text {
        Some(text) => parse_hosts_file(&path, &text, registry)?,
        None => vec![
            default_host(registry, false, None, Default::default()).map_err(|reason| {
                RegistryError::InvalidArgument {
                    field: "registry".to_owned(),
                    reason,
                }
            })?,
        ],
    };
    let mut loaded: HashMap<TlsOptions, TlsConfig> = HashMap::new();
    for host in &mut hosts {
        let config = match loaded.get(&host.tls) {
            Some(c) => c.clone(),
            None => {
                let c = tls::client_config(&host.tls)?;
                loaded.insert(host.tls.clone(), c.clone());
                c
            }
        };
        host.tls_config = Some(config);
    }
    Ok(hosts)
}

/// Parses the hosts.toml at `path` (its text is `text`) without reading
/// the files it names.
fn parse_hosts_file(
    path: &Path,
    text: &str,
    registry: &str,
) -> Result<Vec<RegistryHost>, RegistryError> {
    let base = path.parent().unwrap_or(Path::new("/"));
    let bad = |reason: String| RegistryError::InvalidArgument {
        field: format!("registry host config {}", path.display()),
        reason,
    };
    let file: HostsFile = toml::from_str(text).map_err(|source| RegistryError::HostsConfig {
        path: path.display().to_string(),
        source,
    })?;
    let mut hosts = Vec::new();
    for (url, value) in &file.host {
        let entry: HostEntry =
            value
                .clone()
                .try_into()
                .map_err(|source| RegistryError::HostsConfig {
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
        let tls = entry
            .tls
            .options(base)
            .map_err(|e| bad(format!("host {url:?}: {e}")))?;
        let mut host = parse_host(
            url,
            entry.override_path,
            entry.capabilities.as_deref(),
            headers,
            tls,
        )
        .map_err(bad)?;
        host.send_credentials = entry.send_credentials;
        hosts.push(host);
    }
    let tls = file.tls.options(base).map_err(bad)?;
    let server = match &file.server {
        Some(server) => parse_host(
            server,
            file.override_path,
            file.capabilities.as_deref(),
            Vec::new(),
            tls,
        ),
        None => default_host(
            registry,
            file.override_path,
            file.capabilities.as_deref(),
            tls,
        ),
    }
    .map_err(bad)?;
    hosts.push(server);
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
        assert!(!h[0].http_fallback);
        // Local registries: HTTPS first, plain HTTP if they do not speak TLS.
        let h = hosts_for(dir.path(), "127.0.0.1:5000").unwrap();
        assert_eq!((h[0].scheme.as_str(), h[0].http_fallback), ("https", true));
        let h = hosts_for(dir.path(), "localhost").unwrap();
        assert_eq!((h[0].scheme.as_str(), h[0].http_fallback), ("https", true));
        let h = hosts_for(dir.path(), "[::1]:5000").unwrap();
        assert_eq!((h[0].scheme.as_str(), h[0].http_fallback), ("https", true));
        let h = hosts_for(dir.path(), "localhost:80").unwrap();
        assert_eq!((h[0].scheme.as_str(), h[0].http_fallback), ("http", false));
        let h = hosts_for(dir.path(), "registry.k8s.io").unwrap();
        assert_eq!((h[0].scheme.as_str(), h[0].http_fallback), ("https", false));
        assert!(h[0].tls().is_default());
    }

    fn parse(dir: &Path, registry: &str, text: &str) -> Result<Vec<RegistryHost>, RegistryError> {
        parse_hosts_file(&dir.join(registry).join("hosts.toml"), text, registry)
    }

    #[test]
    fn ca_as_string_or_list_relative_to_the_file() {
        let dir = Path::new("/etc/cubelet/certs.d");
        let h = parse(
            dir,
            "r.example:5443",
            r#"server = "https://r.example:5443"
ca = "ca.pem"
[host."https://mirror.example"]
  ca = ["/abs/one.pem", "sub/two.pem"]
"#,
        )
        .unwrap();
        assert_eq!(h.len(), 2);
        assert_eq!(
            h[0].tls().ca,
            vec![
                PathBuf::from("/abs/one.pem"),
                PathBuf::from("/etc/cubelet/certs.d/r.example:5443/sub/two.pem")
            ]
        );
        assert!(!h[0].tls().skip_verify);
        assert_eq!(h[1].authority, "r.example:5443");
        assert_eq!(
            h[1].tls().ca,
            vec![PathBuf::from("/etc/cubelet/certs.d/r.example:5443/ca.pem")]
        );
        assert!(h[1].tls().client.is_empty());
    }

    #[test]
    fn skip_verify_at_top_level_and_per_host() {
        let dir = Path::new("/certs.d");
        let h = parse(
            dir,
            "r.example",
            r#"skip_verify = true
[host."https://a.example"]
  skip_verify = true
[host."https://b.example"]
  capabilities = ["pull"]
"#,
        )
        .unwrap();
        assert_eq!(h.len(), 3);
        assert!(h[0].tls().skip_verify);
        assert!(!h[1].tls().skip_verify && h[1].tls().is_default());
        // No `server`: the registry itself, with the top-level options.
        assert_eq!(
            h[2].url("x", "manifests", "t"),
            "https://r.example/v2/x/manifests/t"
        );
        assert!(h[2].tls().skip_verify);
        assert!(h[2].pull && h[2].resolve);
    }

    #[test]
    fn client_certificates_in_every_form() {
        let dir = Path::new("/certs.d");
        let h = parse(
            dir,
            "r.example",
            r#"server = "https://r.example"
client = "both.pem"
[host."https://a.example"]
  client = [["a.crt", "/keys/a.key"], "c.pem"]
"#,
        )
        .unwrap();
        assert_eq!(
            h[0].tls().client,
            vec![
                ClientCertFiles {
                    cert: "/certs.d/r.example/a.crt".into(),
                    key: Some("/keys/a.key".into()),
                },
                ClientCertFiles {
                    cert: "/certs.d/r.example/c.pem".into(),
                    key: None,
                },
            ]
        );
        assert_eq!(
            h[1].tls().client,
            vec![ClientCertFiles {
                cert: "/certs.d/r.example/both.pem".into(),
                key: None,
            }]
        );
        let err = parse(
            dir,
            "r.example",
            "[host.\"https://a.example\"]\n  client = [[\"a\", \"b\", \"c\"]]\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("hosts.toml"), "{err}");
        assert!(format!("{err:?}").contains("client pair"), "{err:?}");
        let err = parse(dir, "r.example", "ca = 5\n").unwrap_err();
        assert!(matches!(err, RegistryError::HostsConfig { .. }), "{err:?}");
    }

    #[test]
    fn http_host_with_tls_options_tries_https_first() {
        let dir = Path::new("/certs.d");
        let h = parse(
            dir,
            "r.example",
            r#"server = "http://r.example:80"
skip_verify = true
[host."http://a.example:5000"]
  ca = "ca.pem"
[host."http://b.example:5000"]
"#,
        )
        .unwrap();
        assert_eq!((h[0].scheme.as_str(), h[0].http_fallback), ("https", true));
        assert_eq!((h[1].scheme.as_str(), h[1].http_fallback), ("http", false));
        // Port 80 says plain HTTP.
        assert_eq!((h[2].scheme.as_str(), h[2].http_fallback), ("http", false));
    }

    #[test]
    fn unreadable_tls_files_fail_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("r.example")).unwrap();
        std::fs::write(
            dir.path().join("r.example/hosts.toml"),
            "server = \"https://r.example\"\nca = \"missing-ca.pem\"\n",
        )
        .unwrap();
        let err = hosts_for(dir.path(), "r.example").unwrap_err();
        let want = dir.path().join("r.example/missing-ca.pem");
        assert!(
            matches!(&err, RegistryError::TlsFile { what: "CA certificate", path, .. }
                if *path == want.display().to_string()),
            "{err:?}"
        );
        std::fs::write(dir.path().join("r.example/missing-ca.pem"), "garbage").unwrap();
        let err = hosts_for(dir.path(), "r.example").unwrap_err();
        assert!(err.to_string().contains("missing-ca.pem"), "{err}");
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
        assert!(!h[0].send_credentials && !h[1].send_credentials);
        assert_eq!(h[2].authority, "registry.k8s.io");
        assert!(h[2].pull && h[2].resolve);
    }

    #[test]
    fn mirrors_get_credentials_only_when_the_file_says_so() {
        let h = parse(
            Path::new("/certs.d"),
            "r.example",
            r#"[host."https://trusted.example"]
  send_credentials = true
[host."https://other.example"]
"#,
        )
        .unwrap();
        assert!(h[0].send_credentials);
        assert!(!h[1].send_credentials);
        assert!(!h[2].send_credentials, "the server needs no opt-in");
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
