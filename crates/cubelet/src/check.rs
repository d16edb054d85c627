//! `cubelet --check-config`: checks the node against a valid configuration
//! (runtime binaries, the containerd socket, the registry host configs, the
//! bridge subnet) without changing anything, and the runtime-binary check
//! CRI `Status` reports too.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cubelet_runtime::Containerd;

use crate::config::{Config, HandlerConfig, NetworkProvider};

/// How long containerd has to answer `Version`.
pub const CONTAINERD_TIMEOUT: Duration = Duration::from_secs(3);

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// What was checked (`runtime handler runc`, `containerd`, ...).
    pub what: String,
    /// `Ok(detail)` when it passed, `Err(cause)` when not.
    pub outcome: Result<String, String>,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.outcome {
            Ok(detail) => write!(f, "ok    {}: {detail}", self.what),
            Err(cause) => write!(f, "FAIL  {}: {cause}", self.what),
        }
    }
}

/// The binary a handler runs: its `binary`, or `runc` from `PATH` for a
/// runc shim without one. `None` when the shim finds its own.
fn handler_binary(handler: &HandlerConfig) -> Option<PathBuf> {
    if let Some(b) = &handler.binary {
        return Some(b.clone());
    }
    if !handler.runtime_type.starts_with("io.containerd.runc.") {
        return None;
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    let found = std::env::split_paths(&path)
        .map(|d| d.join("runc"))
        .find(|p| p.is_file());
    Some(found.unwrap_or_else(|| PathBuf::from("runc")))
}

/// Why `path` cannot be run, if it cannot.
fn not_executable(path: &Path) -> Option<String> {
    if !path.is_absolute() {
        return Some(format!("binary {} not found in PATH", path.display()));
    }
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Some(format!("binary {} not found", path.display()))
        }
        Err(e) => Some(format!("binary {}: {e}", path.display())),
        Ok(m) if !m.is_file() => Some(format!("binary {} is not a file", path.display())),
        Ok(m) if m.permissions().mode() & 0o111 == 0 => {
            Some(format!("binary {} is not executable", path.display()))
        }
        Ok(_) => None,
    }
}

/// The first runtime handler whose binary is missing or not executable,
/// as `runtime handler <name>: binary <path> not found`.
pub fn missing_runtime_binary<'a>(
    handlers: impl IntoIterator<Item = (&'a String, &'a HandlerConfig)>,
) -> Option<String> {
    handlers.into_iter().find_map(|(name, h)| {
        let binary = handler_binary(h)?;
        not_executable(&binary).map(|why| format!("runtime handler {name}: {why}"))
    })
}

/// containerd's version, or why it did not answer within `timeout`
/// (without the address, which the caller names).
pub async fn containerd_version(
    address: &Path,
    namespace: &str,
    timeout: Duration,
) -> Result<(Containerd, String), String> {
    let attempt = async {
        let cd = Containerd::connect(address, namespace)
            .await
            .map_err(|e| match e {
                cubelet_runtime::RuntimeError::Connect { source, .. } => {
                    cubelet_engine::chain(&source)
                }
                other => cubelet_engine::chain(&other),
            })?;
        let v = cd.version().version(()).await.map_err(|s| {
            if s.message().is_empty() {
                s.code().description().to_owned()
            } else {
                s.message().to_owned()
            }
        })?;
        Ok::<_, String>((cd, v.into_inner().version))
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer to Version within {timeout:?}")),
    }
}

/// Every `<host>/hosts.toml` under `dir` parses and its TLS files load.
fn registry_configs(dir: &Path) -> Vec<Finding> {
    let what = |host: &str| format!("registry config {host}");
    let entries = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return vec![Finding {
                what: "registry configs".to_owned(),
                outcome: Ok(format!("{} absent: defaults for every host", dir.display())),
            }]
        }
        Err(e) => {
            return vec![Finding {
                what: "registry configs".to_owned(),
                outcome: Err(format!("read {}: {e}", dir.display())),
            }]
        }
    };
    let mut hosts: Vec<String> = entries
        .flatten()
        .filter(|e| e.path().join("hosts.toml").is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    hosts.sort();
    if hosts.is_empty() {
        return vec![Finding {
            what: "registry configs".to_owned(),
            outcome: Ok(format!(
                "no <host>/hosts.toml in {}: defaults for every host",
                dir.display()
            )),
        }];
    }
    hosts
        .iter()
        .map(|host| Finding {
            what: what(host),
            outcome: match cubelet_runtime::registry::hosts_for(dir, host) {
                Ok(h) => Ok(format!("{} host(s)", h.len())),
                Err(e) => Err(cubelet_engine::chain(&e)),
            },
        })
        .collect()
}

/// Runs every check of `config` against the node.
pub async fn run(config: &Config) -> Vec<Finding> {
    let mut out = Vec::new();
    for (name, h) in &config.runtime.handlers {
        let what = format!("runtime handler {name}");
        let outcome = match handler_binary(h) {
            None => Ok(format!("{} finds its own binary", h.runtime_type)),
            Some(b) => match not_executable(&b) {
                None => Ok(b.display().to_string()),
                Some(why) => Err(why),
            },
        };
        out.push(Finding { what, outcome });
    }
    let address = &config.containerd.address;
    out.push(Finding {
        what: format!("containerd at {}", address.display()),
        outcome: containerd_version(address, &config.containerd.namespace, CONTAINERD_TIMEOUT)
            .await
            .map(|(_, v)| format!("version {v}")),
    });
    out.extend(registry_configs(&config.images.registry_config_dir));
    if config.network.provider == NetworkProvider::Bridge {
        let b = &config.network.bridge;
        out.push(Finding {
            what: "network.bridge.subnet".to_owned(),
            outcome: cubelet_network::check_subnet(&b.name, b.subnet)
                .await
                .map(|()| format!("{}: no other route or address overlaps it", b.subnet))
                .map_err(|e| cubelet_engine::chain(&e)),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn handler(binary: Option<&Path>) -> HandlerConfig {
        HandlerConfig {
            runtime_type: "io.containerd.runc.v2".into(),
            binary: binary.map(Path::to_path_buf),
            root: None,
        }
    }

    /// A missing runc is named once, with its handler and path.
    #[test]
    fn a_missing_or_unexecutable_runtime_binary_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let plain = tmp.path().join("runc-not-exec");
        std::fs::write(&plain, "").unwrap();
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
        let exec = tmp.path().join("runc");
        std::fs::write(&exec, "").unwrap();
        std::fs::set_permissions(&exec, std::fs::Permissions::from_mode(0o755)).unwrap();

        let mut handlers = BTreeMap::new();
        handlers.insert("runc".to_owned(), handler(Some(&exec)));
        assert_eq!(missing_runtime_binary(&handlers), None);
        handlers.insert(
            "alt".to_owned(),
            handler(Some(Path::new("/nonexistent/runc"))),
        );
        let msg = missing_runtime_binary(&handlers).unwrap();
        assert_eq!(
            msg,
            "runtime handler alt: binary /nonexistent/runc not found"
        );
        assert_eq!(msg.matches("/nonexistent/runc").count(), 1);
        handlers.insert("alt".to_owned(), handler(Some(&plain)));
        let msg = missing_runtime_binary(&handlers).unwrap();
        assert!(msg.ends_with("runc-not-exec is not executable"), "{msg}");
        // A shim that finds its own binary is not checked.
        let kata = HandlerConfig {
            runtime_type: "io.containerd.kata.v2".into(),
            binary: None,
            root: None,
        };
        assert_eq!(handler_binary(&kata), None);
    }

    /// A socket nobody listens on: the cause, without the address (the
    /// caller names it), within the timeout.
    #[tokio::test]
    async fn a_containerd_socket_that_is_absent_names_the_cause() {
        let tmp = tempfile::tempdir().unwrap();
        let sock = tmp.path().join("containerd.sock");
        let started = std::time::Instant::now();
        let err = containerd_version(&sock, "ns", Duration::from_secs(3))
            .await
            .map(|(_, v)| v)
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(4));
        assert!(!err.contains(&sock.display().to_string()), "{err}");
        assert!(!err.is_empty());
    }

    /// A hosts.toml that does not parse fails its check, naming the file;
    /// a good one passes.
    #[test]
    fn registry_host_configs_are_parsed() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("good.example")).unwrap();
        std::fs::write(
            tmp.path().join("good.example/hosts.toml"),
            "server = \"https://good.example\"\n",
        )
        .unwrap();
        std::fs::create_dir(tmp.path().join("bad.example")).unwrap();
        std::fs::write(tmp.path().join("bad.example/hosts.toml"), "server = [\n").unwrap();
        let f = registry_configs(tmp.path());
        assert_eq!(f.len(), 2, "{f:?}");
        assert_eq!(f[0].what, "registry config bad.example");
        let cause = f[0].outcome.clone().unwrap_err();
        assert!(cause.contains("bad.example/hosts.toml"), "{cause}");
        assert!(f[1].outcome.is_ok(), "{f:?}");
        assert!(registry_configs(&tmp.path().join("absent"))[0]
            .outcome
            .is_ok());
    }
}
