//! Checks of values that the types alone cannot express.

use std::path::Path;

use super::{Config, ConfigError};

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
        self.streaming.tls()?;
        self.streaming.limits()?;
        if self.containerd.namespace.is_empty() {
            return Err(ConfigError::Invalid {
                key: "containerd.namespace",
                message: "must not be empty".into(),
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
}
