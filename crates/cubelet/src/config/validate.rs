//! Checks of values that the types alone cannot express.

use std::path::{Component, Path, PathBuf};

use super::{Config, ConfigError};

/// containerd namespaces other runtimes keep their objects in: containerd's
/// own CRI plugin (`k8s.io`), Docker (`moby`), `ctr` and nerdctl
/// (`default`) and BuildKit (`buildkit`). Cubelet's GC removes what it
/// marked and no longer knows; sharing a namespace with one of them puts
/// their objects beside Cubelet's, so start-up refuses it.
pub(crate) const FOREIGN_NAMESPACES: [&str; 4] = ["k8s.io", "moby", "default", "buildkit"];

/// System directories that other programs keep files in: `root_dir` or
/// `state_dir` naming one of them would make Cubelet's pin, sandbox and
/// scratch directories (`<state_dir>/netns`, ...) shared with them.
pub(crate) const SHARED_DIRS: [&str; 18] = [
    "/",
    "/run",
    "/var/run",
    "/run/netns",
    "/var/run/netns",
    "/run/containerd",
    "/var/run/containerd",
    "/var/lib",
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/lib/kubelet",
    "/run/docker",
    "/var",
    "/tmp",
    "/etc",
    "/usr",
    "/home",
    "/root",
];

/// `p` with `.` and `..` components and repeated or trailing slashes
/// resolved lexically (symlinks are not followed: the check is about what
/// the operator wrote).
fn lexical(p: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// Refuses a directory that is shared with other programs.
fn own_dir(key: &'static str, p: &Path) -> Result<(), ConfigError> {
    let norm = lexical(p);
    if SHARED_DIRS.iter().any(|d| norm.as_path() == Path::new(d)) {
        return Err(ConfigError::Invalid {
            key,
            message: format!(
                "{} is a directory other programs use; Cubelet's GC removes what it \
                 does not know in its own directories, so give it one of its own \
                 (e.g. /run/cubelet, /var/lib/cubelet)",
                p.display()
            ),
        });
    }
    Ok(())
}

impl Config {
    /// Checks values that the types alone cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let abs = |key: &'static str, p: &Path| {
            if p.is_absolute() {
                Ok(())
            } else {
                Err(ConfigError::Invalid {
                    key,
                    message: format!("{} is not absolute", p.display()),
                })
            }
        };
        abs("socket", &self.socket)?;
        abs("root_dir", &self.root_dir)?;
        abs("state_dir", &self.state_dir)?;
        abs("containerd.address", &self.containerd.address)?;
        own_dir("root_dir", &self.root_dir)?;
        own_dir("state_dir", &self.state_dir)?;
        if lexical(&self.root_dir) == lexical(&self.state_dir) {
            return Err(ConfigError::Invalid {
                key: "state_dir",
                message: format!(
                    "{} is also root_dir; the two hold different things",
                    self.state_dir.display()
                ),
            });
        }
        self.streaming.tls()?;
        self.streaming.limits()?;
        self.runtime.log_rate()?;
        if self.containerd.namespace.is_empty() {
            return Err(ConfigError::Invalid {
                key: "containerd.namespace",
                message: "must not be empty".into(),
            });
        }
        if FOREIGN_NAMESPACES.contains(&self.containerd.namespace.as_str()) {
            return Err(ConfigError::Invalid {
                key: "containerd.namespace",
                message: format!(
                    "{:?} is another runtime's namespace ({}); Cubelet needs one of its \
                     own (default k8s.cubelet.io)",
                    self.containerd.namespace,
                    match self.containerd.namespace.as_str() {
                        "k8s.io" => "containerd's CRI plugin",
                        "moby" => "Docker",
                        "buildkit" => "BuildKit",
                        _ => "ctr and nerdctl",
                    }
                ),
            });
        }
        if !self
            .runtime
            .handlers
            .contains_key(&self.runtime.default_handler)
        {
            return Err(ConfigError::Invalid {
                key: "runtime.default_handler",
                message: format!(
                    "{:?} is not in runtime.handlers (have: {})",
                    self.runtime.default_handler,
                    self.runtime
                        .handlers
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        if self.network.bridge.subnet.prefix_len() > 30 {
            return Err(ConfigError::Invalid {
                key: "network.bridge.subnet",
                message: format!(
                    "{} leaves no room for pods (use /30 or wider)",
                    self.network.bridge.subnet
                ),
            });
        }
        if !(68..=65535).contains(&self.network.bridge.mtu) {
            return Err(ConfigError::Invalid {
                key: "network.bridge.mtu",
                message: format!("{} is outside 68..=65535", self.network.bridge.mtu),
            });
        }
        if self.containerd.connect_attempts == 0 {
            return Err(ConfigError::Invalid {
                key: "containerd.connect_attempts",
                message: "must be >= 1".into(),
            });
        }
        if self.gc.interval.is_zero() {
            return Err(ConfigError::Invalid {
                key: "gc.interval",
                message: "must be > 0".into(),
            });
        }
        if self.storage.shm_size.0 == 0 {
            return Err(ConfigError::Invalid {
                key: "storage.shm_size",
                message: "must be > 0".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_name_the_key() {
        let e = Config::from_yaml("gc: { interval: soon }")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("gc.interval"), "{e}");
        let e = Config::from_yaml("storage: { shm_size: 64Qi }")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("storage.shm_size") && e.contains("Qi"), "{e}");
        let e = Config::from_yaml("runtime: { default_handler: kata }")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("runtime.default_handler") && e.contains("kata"),
            "{e}"
        );
        let e = Config::from_yaml("socket: relative.sock")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("socket:"), "{e}");
        let e = Config::from_yaml("network: { provider: flannel }")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("network.provider"), "{e}");
    }

    #[test]
    fn another_runtimes_namespace_is_refused() {
        for ns in FOREIGN_NAMESPACES {
            let e = Config::from_yaml(&format!("containerd: {{ namespace: {ns} }}"))
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("containerd.namespace:"), "{e}");
            assert!(e.contains(ns) && e.contains("own"), "{e}");
        }
        let ok = Config::from_yaml("containerd: { namespace: k8s.cubelet.test }").unwrap();
        assert_eq!(ok.containerd.namespace, "k8s.cubelet.test");
    }

    #[test]
    fn shared_system_dirs_are_refused_for_state_and_root() {
        for (key, dir) in [
            ("state_dir", "/run"),
            ("state_dir", "/var/run/"),
            ("state_dir", "/run/netns"),
            ("state_dir", "/run/cubelet/.."),
            ("state_dir", "//"),
            ("root_dir", "/var/lib/containerd"),
            ("root_dir", "/"),
            ("root_dir", "/var/lib/./kubelet"),
        ] {
            let e = Config::from_yaml(&format!("{key}: {dir}"))
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(&format!("{key}:")), "{dir}: {e}");
            assert!(e.contains("other programs"), "{e}");
        }
        let e = Config::from_yaml("root_dir: /srv/cubelet\nstate_dir: /srv/cubelet/")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("state_dir:") && e.contains("root_dir"), "{e}");
        // Directories of its own, also under a shared one, are fine.
        Config::from_yaml("root_dir: /var/lib/cubelet\nstate_dir: /run/cubelet/x").unwrap();
    }

    #[test]
    fn paths_are_normalised_lexically() {
        assert_eq!(lexical(Path::new("/run/./a/../")), PathBuf::from("/run"));
        assert_eq!(lexical(Path::new("/..")), PathBuf::from("/"));
    }
}
