//! Loading: the main file, the `config.d` drop-ins, and the key-by-key merge
//! over the serialised defaults.

use std::path::{Path, PathBuf};

use serde_norway::Value;

use super::{Config, ConfigError};

impl Config {
    /// Loads `file` (which must exist) and the drop-ins of `dir` (if it exists).
    ///
    /// The main file and then each drop-in are merged key by key over the
    /// defaults, so any file may set a single key of a default map.
    pub fn load(file: &Path, dir: Option<&Path>) -> Result<Config, ConfigError> {
        let mut merged = defaults()?;
        merge(&mut merged, read_yaml(file)?);
        let dir = dir.map(Path::to_path_buf).unwrap_or_else(|| {
            file.parent()
                .unwrap_or_else(|| Path::new("."))
                .join("config.d")
        });
        for path in drop_ins(&dir)? {
            let layer = read_yaml(&path)?;
            merge(&mut merged, layer);
        }
        Self::from_value(merged)
    }

    /// Parses one YAML document (no drop-ins), merged key by key over the
    /// defaults as [`Config::load`] does.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        let value: Value = serde_norway::from_str(text).map_err(|source| ConfigError::Yaml {
            path: "<inline>".into(),
            source,
        })?;
        let mut merged = defaults()?;
        merge(&mut merged, value);
        Self::from_value(merged)
    }

    /// Deserialises the merged document and validates it.
    fn from_value(value: Value) -> Result<Config, ConfigError> {
        let config: Config = serde_path_to_error::deserialize(value).map_err(|e| {
            let key = e.path().to_string();
            ConfigError::Schema {
                key: if key == "." { "config".to_owned() } else { key },
                message: e.into_inner().to_string(),
            }
        })?;
        config.validate()?;
        Ok(config)
    }
}

/// [`Config::default`] as a YAML value: the base every file is merged over.
fn defaults() -> Result<Value, ConfigError> {
    serde_norway::to_value(Config::default()).map_err(|source| ConfigError::Defaults { source })
}

fn read_yaml(path: &Path) -> Result<Value, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let value: Value = serde_norway::from_str(&text).map_err(|source| ConfigError::Yaml {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(if value.is_null() {
        Value::Mapping(Default::default())
    } else {
        value
    })
}

fn drop_ins(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(ConfigError::Read {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| ConfigError::Read {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "yaml") && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Merges `layer` into `base`: maps key by key (recursively), anything else
/// replaced. A null over a map (an empty section such as `gc:`) changes
/// nothing; a null over anything else replaces it (`binary: null` unsets an
/// optional key).
fn merge(base: &mut Value, layer: Value) {
    match (base, layer) {
        (Value::Mapping(_), Value::Null) => {}
        (Value::Mapping(b), Value::Mapping(l)) => {
            for (k, v) in l {
                match b.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (base, layer) => *base = layer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ByteSize, CgroupDriver, HandlerConfig, NetworkProvider};
    use cubelet_engine::WorkflowConfig;
    use std::time::Duration;

    #[test]
    fn unknown_keys_are_named_with_their_path() {
        let e = Config::from_yaml("network: { bridge: { nmae: x } }")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("network.bridge"), "{e}");
        assert!(e.contains("nmae"), "{e}");
        let e = Config::from_yaml("sockett: /x").unwrap_err().to_string();
        assert!(e.contains("sockett"), "{e}");
    }

    #[test]
    fn drop_ins_merge_key_by_key_last_wins() {
        let dir = tempfile::tempdir().unwrap();
        let main = dir.path().join("config.yaml");
        std::fs::write(&main, "gc: { interval: 10s }\nflows: { create: { concurrent: 8, steps: [[storage, network], [sandbox]] } }\n").unwrap();
        let d = dir.path().join("config.d");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(
            d.join("20-b.yaml"),
            "flows: { create: { concurrent: 2 } }\n",
        )
        .unwrap();
        std::fs::write(
            d.join("10-a.yaml"),
            "flows: { create: { concurrent: 4 } }\ngc: { dead_sandbox_ttl: 5m }\n",
        )
        .unwrap();
        std::fs::write(d.join("ignored.txt"), "not: yaml: at all").unwrap();
        let c = Config::load(&main, None).unwrap();
        assert_eq!(c.flows.flows["create"].concurrent, 2);
        assert_eq!(
            c.flows.flows["create"].steps.len(),
            2,
            "steps kept from the main file"
        );
        assert_eq!(c.gc.interval, Duration::from_secs(10));
        assert_eq!(c.gc.dead_sandbox_ttl, Duration::from_secs(300));
    }

    type Change = fn(&mut Config);

    /// One key of each default map, the YAML that sets it alone and what
    /// it must change in `Config::default()`.
    fn one_key_cases() -> Vec<(&'static str, &'static str, Change)> {
        vec![
            ("socket", "/run/other/cubelet.sock", |c| {
                c.socket = "/run/other/cubelet.sock".into()
            }),
            ("cri.rewrite_invalid_authority", "false", |c| {
                c.cri.rewrite_invalid_authority = false
            }),
            ("containerd.namespace", "other.ns", |c| {
                c.containerd.namespace = "other.ns".into()
            }),
            ("metrics.address", "0.0.0.0:9999", |c| {
                c.metrics.address = "0.0.0.0:9999".parse().unwrap()
            }),
            ("streaming.port", "10010", |c| c.streaming.port = 10010),
            ("streaming.idle_timeout", "90s", |c| {
                c.streaming.idle_timeout = Duration::from_secs(90)
            }),
            ("images.pause_image", "registry.k8s.io/pause:3.9", |c| {
                c.images.pause_image = "registry.k8s.io/pause:3.9".into()
            }),
            ("runtime.cgroup_driver", "systemd", |c| {
                c.runtime.cgroup_driver = CgroupDriver::Systemd
            }),
            ("runtime.cgroup_driver", "cgroupfs", |c| {
                c.runtime.cgroup_driver = CgroupDriver::Cgroupfs
            }),
            ("runtime.handlers.runc.binary", "/usr/local/bin/runc", |c| {
                c.runtime.handlers.get_mut("runc").unwrap().binary =
                    Some("/usr/local/bin/runc".into())
            }),
            ("runtime.handlers.runc.binary", "null", |c| {
                c.runtime.handlers.get_mut("runc").unwrap().binary = None
            }),
            (
                "runtime.handlers.kata",
                "{ runtime_type: io.containerd.kata.v2 }",
                |c| {
                    c.runtime.handlers.insert(
                        "kata".into(),
                        HandlerConfig {
                            runtime_type: "io.containerd.kata.v2".into(),
                            binary: None,
                            root: None,
                        },
                    );
                },
            ),
            ("network.provider", "cni", |c| {
                c.network.provider = NetworkProvider::Cni
            }),
            ("network.bridge.mtu", "9000", |c| {
                c.network.bridge.mtu = 9000
            }),
            ("network.cni.conf_dir", "/etc/cni/other.d", |c| {
                c.network.cni.conf_dir = "/etc/cni/other.d".into()
            }),
            ("storage.shm_size", "128Mi", |c| {
                c.storage.shm_size = ByteSize(128 << 20)
            }),
            ("storage.scratch.pool_size", "8", |c| {
                c.storage.scratch.pool_size = 8
            }),
            ("storage.scratch.size", "1Gi", |c| {
                c.storage.scratch.size = ByteSize(1 << 30)
            }),
            ("flows.create.concurrent", "2", |c| {
                c.flows.flows.get_mut("create").unwrap().concurrent = 2
            }),
            (
                "flows.create",
                "{ steps: [[storage], [network], [sandbox]] }",
                |c| {
                    c.flows.flows.get_mut("create").unwrap().steps = vec![
                        vec!["storage".into()],
                        vec!["network".into()],
                        vec!["sandbox".into()],
                    ]
                },
            ),
            ("flows.destroy.concurrent", "3", |c| {
                c.flows.flows.get_mut("destroy").unwrap().concurrent = 3
            }),
            ("flows.cleanup.concurrent", "1", |c| {
                c.flows.flows.get_mut("cleanup").unwrap().concurrent = 1
            }),
            ("engine.rollback_timeout", "30s", |c| {
                c.engine.rollback_timeout = Duration::from_secs(30)
            }),
            ("gc.interval", "5s", |c| {
                c.gc.interval = Duration::from_secs(5)
            }),
            ("pools.sandbox.size", "2", |c| c.pools.sandbox.size = 2),
            ("pools.sandbox", "{ size: 0 }", |c| c.pools.sandbox.size = 0),
        ]
    }

    /// `a.b.c` and `v` as the YAML document `{a: {b: {c: v}}}`.
    fn nested(path: &str, value: &str) -> String {
        let mut v: Value = serde_norway::from_str(value).unwrap();
        for key in path.rsplit('.') {
            let mut m = serde_norway::Mapping::new();
            m.insert(Value::String(key.to_owned()), v);
            v = Value::Mapping(m);
        }
        serde_norway::to_string(&v).unwrap()
    }

    fn expected(change: Change) -> Config {
        let mut c = Config::default();
        change(&mut c);
        assert_ne!(c, Config::default(), "the case changes nothing");
        c
    }

    fn map_paths(prefix: &str, value: &Value, out: &mut Vec<String>) {
        if let Value::Mapping(m) = value {
            out.push(prefix.to_owned());
            for (k, v) in m {
                let k = k.as_str().unwrap();
                let path = if prefix.is_empty() {
                    k.to_owned()
                } else {
                    format!("{prefix}.{k}")
                };
                map_paths(&path, v, out);
            }
        }
    }

    #[test]
    fn the_one_key_cases_cover_every_default_map() {
        let mut maps = Vec::new();
        map_paths(
            "",
            &serde_norway::to_value(Config::default()).unwrap(),
            &mut maps,
        );
        assert!(maps.len() > 15, "{maps:?}");
        let cases = one_key_cases();
        for map in maps {
            let covered = cases.iter().any(|(path, _, _)| {
                let parent = path.rsplit_once('.').map_or("", |(p, _)| p);
                parent == map
            });
            assert!(covered, "no one-key case sets a key directly in `{map}`");
        }
    }

    #[test]
    fn a_drop_in_changes_one_key_of_any_default_map_alone() {
        for (path, value, change) in one_key_cases() {
            let dir = tempfile::tempdir().unwrap();
            let main = dir.path().join("config.yaml");
            std::fs::write(&main, "").unwrap();
            let d = dir.path().join("config.d");
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("50-one.yaml"), nested(path, value)).unwrap();
            let c = Config::load(&main, None)
                .unwrap_or_else(|e| panic!("drop-in {path}: {value}: {e}"));
            assert_eq!(c, expected(change), "drop-in {path}: {value}");
            c.flows
                .validate(crate::PROVIDERS.iter().copied())
                .unwrap_or_else(|e| panic!("drop-in {path}: {value}: {e}"));
        }
    }

    #[test]
    fn the_main_file_changes_one_key_of_any_default_map_alone() {
        for (path, value, change) in one_key_cases() {
            let dir = tempfile::tempdir().unwrap();
            let main = dir.path().join("config.yaml");
            std::fs::write(&main, nested(path, value)).unwrap();
            let c = Config::load(&main, None)
                .unwrap_or_else(|e| panic!("main file {path}: {value}: {e}"));
            assert_eq!(c, expected(change), "main file {path}: {value}");
            let inline = Config::from_yaml(&nested(path, value))
                .unwrap_or_else(|e| panic!("inline {path}: {value}: {e}"));
            assert_eq!(inline, c, "inline {path}: {value}");
        }
    }

    #[test]
    fn one_flow_key_alone_as_the_issue_wrote_it() {
        let c = Config::from_yaml("flows: { create: { concurrent: 2 } }").unwrap();
        assert_eq!(c.flows.flows["create"].concurrent, 2);
        assert_eq!(
            c.flows.flows["create"].steps,
            WorkflowConfig::default().flows["create"].steps
        );
        assert_eq!(
            c.flows.flows["destroy"],
            WorkflowConfig::default().flows["destroy"]
        );
        c.flows.validate(crate::PROVIDERS.iter().copied()).unwrap();
    }

    #[test]
    fn an_empty_section_keeps_its_defaults() {
        for text in [
            "gc:",
            "flows:",
            "runtime: { handlers: }",
            "flows: { create: }",
        ] {
            assert_eq!(
                Config::from_yaml(text).unwrap(),
                Config::default(),
                "{text}"
            );
        }
    }

    #[test]
    fn unknown_keys_in_drop_ins_are_named_with_their_path() {
        let dir = tempfile::tempdir().unwrap();
        let main = dir.path().join("config.yaml");
        std::fs::write(&main, "").unwrap();
        let d = dir.path().join("config.d");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("10-x.yaml"), "flows: { create: { concurent: 2 } }").unwrap();
        let e = Config::load(&main, None).unwrap_err().to_string();
        assert!(e.starts_with("flows.create"), "{e}");
        assert!(e.contains("concurent"), "{e}");
    }

    #[test]
    fn missing_file_is_an_error_naming_it() {
        let e = Config::load(Path::new("/nonexistent/cubelet.yaml"), None).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cubelet.yaml"), "{e}");
    }
}
