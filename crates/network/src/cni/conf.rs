//! CNI network configuration: finding and reading the node's network list in
//! `conf_dir`, as libcni does.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::NetworkError;

/// File extensions that hold network configs, as libcni accepts them.
const EXTENSIONS: [&str; 3] = ["conflist", "conf", "json"];

/// A network configuration list (`*.conflist`, or a single-plugin `*.conf`
/// wrapped into a list of one).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NetworkList {
    /// Network name; names the cache files.
    pub(crate) name: String,
    /// CNI version of every plugin config in the list.
    pub(crate) cni_version: String,
    /// `disableCheck` of the list.
    pub(crate) disable_check: bool,
    /// The plugin configs in order; each has a string `type`.
    pub(crate) plugins: Vec<Map<String, Value>>,
    /// The file it came from (informational).
    pub(crate) source: PathBuf,
}

impl NetworkList {
    /// The list as one JSON object, as kept in the result cache.
    pub(crate) fn to_value(&self) -> Value {
        serde_json::json!({
            "cniVersion": self.cni_version,
            "name": self.name,
            "disableCheck": self.disable_check,
            "plugins": self.plugins,
        })
    }

    /// Reads a list back from [`Self::to_value`] output (or any conflist).
    pub(crate) fn from_value(value: Value, source: &Path) -> Result<Self, NetworkError> {
        let bad = |reason: String| NetworkError::CniConfig {
            path: source.to_path_buf(),
            reason,
        };
        let Value::Object(mut obj) = value else {
            return Err(bad("not a JSON object".into()));
        };
        let name = match obj.get("name") {
            Some(Value::String(n)) if valid_name(n) => n.clone(),
            Some(Value::String(n)) => {
                return Err(bad(format!(
                    "network name {n:?} must be 1-64 characters of [A-Za-z0-9._-]"
                )))
            }
            _ => return Err(bad("missing string field \"name\"".into())),
        };
        let cni_version = match obj.get("cniVersion") {
            Some(Value::String(v)) if parse_version(v).is_some() => v.clone(),
            Some(v) => return Err(bad(format!("bad cniVersion {v}"))),
            None => return Err(bad("missing field \"cniVersion\"".into())),
        };
        let disable_check = matches!(obj.get("disableCheck"), Some(Value::Bool(true)));
        let plugins = match obj.remove("plugins") {
            // A list.
            Some(Value::Array(items)) => items
                .into_iter()
                .enumerate()
                .map(|(i, p)| match p {
                    Value::Object(m) => Ok(m),
                    _ => Err(bad(format!("plugin {i} is not a JSON object"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(_) => return Err(bad("\"plugins\" is not an array".into())),
            // A single plugin config: the whole object is the plugin.
            None => vec![obj],
        };
        if plugins.is_empty() {
            return Err(bad("no plugins".into()));
        }
        for (i, p) in plugins.iter().enumerate() {
            match p.get("type") {
                Some(Value::String(t)) if valid_name(t) => {}
                Some(t) => return Err(bad(format!("plugin {i} has an invalid type {t}"))),
                None => return Err(bad(format!("plugin {i} has no \"type\""))),
            }
        }
        Ok(Self {
            name,
            cni_version,
            disable_check,
            plugins,
            source: source.to_path_buf(),
        })
    }

    /// The `type` of plugin `i`.
    pub(crate) fn plugin_type(&self, i: usize) -> &str {
        self.plugins
            .get(i)
            .and_then(|p| p.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    /// Whether plugin `i` declares capability `cap`.
    pub(crate) fn has_capability(&self, i: usize, cap: &str) -> bool {
        self.plugins
            .get(i)
            .and_then(|p| p.get("capabilities"))
            .and_then(|c| c.get(cap))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }

    /// True when the list's version is at least `major.minor.patch`.
    pub(crate) fn version_at_least(&self, min: (u32, u32, u32)) -> bool {
        parse_version(&self.cni_version).is_some_and(|v| v >= min)
    }
}

/// Network and plugin names end up in file names and paths: keep them tame.
fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// `"1.0.0"` → `(1, 0, 0)`; a missing patch or minor counts as 0.
pub(crate) fn parse_version(v: &str) -> Option<(u32, u32, u32)> {
    let mut parts = v.split('.').map(|p| p.parse::<u32>());
    let major = parts.next()?.ok()?;
    let minor = parts.next().unwrap_or(Ok(0)).ok()?;
    let patch = parts.next().unwrap_or(Ok(0)).ok()?;
    parts.next().is_none().then_some((major, minor, patch))
}

/// Config files in `dir`, sorted by name.
fn candidates(dir: &Path) -> Result<Vec<PathBuf>, NetworkError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(NetworkError::io("read cni config directory", dir, e)),
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| EXTENSIONS.contains(&e))
                && p.is_file()
        })
        .collect();
    files.sort();
    Ok(files)
}

/// Reads one config file.
fn read(path: &Path) -> Result<NetworkList, NetworkError> {
    let bytes = std::fs::read(path).map_err(|e| NetworkError::io("read cni config", path, e))?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| NetworkError::CniConfig {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    NetworkList::from_value(value, path)
}

/// The node's network: the first valid config in `dir` by file name. Invalid
/// files are skipped with a warning (as CRI-O and containerd do); when there
/// are files but none is valid, the first one's error is returned.
pub(crate) fn load(dir: &Path) -> Result<NetworkList, NetworkError> {
    let mut first_err = None;
    for path in candidates(dir)? {
        match read(&path) {
            Ok(list) => return Ok(list),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "skipping cni config");
                first_err.get_or_insert(e);
            }
        }
    }
    Err(first_err.unwrap_or_else(|| NetworkError::NoCniConfig {
        conf_dir: dir.to_path_buf(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_compare() {
        assert_eq!(parse_version("1.0.0"), Some((1, 0, 0)));
        assert_eq!(parse_version("0.4"), Some((0, 4, 0)));
        assert_eq!(parse_version("x"), None);
        assert_eq!(parse_version("1.2.3.4"), None);
        assert!(parse_version("0.4.0") < parse_version("1.0.0"));
        assert!(parse_version("0.3.1") < parse_version("0.4.0"));
    }

    #[test]
    fn conflist_first_by_name_and_single_conf_wrapped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("README"), "not a config").unwrap();
        std::fs::write(
            dir.path().join("20-single.conf"),
            r#"{"cniVersion":"0.4.0","name":"single","type":"bridge","bridge":"x0"}"#,
        )
        .unwrap();
        let single = load(dir.path()).unwrap();
        assert_eq!(single.name, "single");
        assert_eq!(single.plugins.len(), 1);
        assert_eq!(single.plugin_type(0), "bridge");
        assert!(!single.version_at_least((1, 0, 0)));

        std::fs::write(
            dir.path().join("10-list.conflist"),
            r#"{"cniVersion":"1.0.0","name":"lst","plugins":[
                {"type":"bridge"},{"type":"portmap","capabilities":{"portMappings":true}}]}"#,
        )
        .unwrap();
        let list = load(dir.path()).unwrap();
        assert_eq!(list.name, "lst");
        assert_eq!(list.plugins.len(), 2);
        assert!(list.has_capability(1, "portMappings"));
        assert!(!list.has_capability(0, "portMappings"));
        let again = NetworkList::from_value(list.to_value(), &list.source).unwrap();
        assert_eq!(again, list);
    }

    #[test]
    fn invalid_configs_are_skipped_or_reported() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            load(dir.path()),
            Err(NetworkError::NoCniConfig { .. })
        ));
        assert!(matches!(
            load(&dir.path().join("absent")),
            Err(NetworkError::NoCniConfig { .. })
        ));
        std::fs::write(dir.path().join("00-bad.conflist"), "{").unwrap();
        let err = load(dir.path()).unwrap_err();
        assert!(matches!(err, NetworkError::CniConfig { .. }), "{err}");
        for bad in [
            r#"{"cniVersion":"1.0.0","name":"a/b","plugins":[{"type":"bridge"}]}"#,
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[]}"#,
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"../x"}]}"#,
            r#"{"cniVersion":"one","name":"n","plugins":[{"type":"bridge"}]}"#,
            r#"{"name":"n","plugins":[{"type":"bridge"}]}"#,
        ] {
            let v: Value = serde_json::from_str(bad).unwrap();
            assert!(
                NetworkList::from_value(v, Path::new("t")).is_err(),
                "{bad} accepted"
            );
        }
        std::fs::write(
            dir.path().join("10-good.conflist"),
            r#"{"cniVersion":"1.0.0","name":"good","plugins":[{"type":"bridge"}]}"#,
        )
        .unwrap();
        assert_eq!(load(dir.path()).unwrap().name, "good");
    }
}
