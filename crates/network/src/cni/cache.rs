//! The on-disk result cache, like libcni's: one JSON file per attachment at
//! `<cache_dir>/results/<network>-<sandbox id>-<ifname>`, holding the network
//! config, the arguments and the result of ADD, so that DEL (and CHECK) run
//! with the same config and `prevResult` after an agent restart or a config
//! change.
//!
//! The entry is written twice per create: before ADD without a result (so a
//! crash during ADD still leaves the config DEL needs), and after ADD with it.
//! Writes go to a temporary file renamed into place, so a reader never sees a
//! half-written entry. There is no fsync: the cache must survive an agent
//! restart, and after a machine crash the namespaces it describes are gone.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::NetworkError;

/// The `kind` of entries this module writes.
pub(crate) const KIND: &str = "cniCacheV1";
const TMP_SUFFIX: &str = ".tmp";

/// One cached attachment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Entry {
    pub(crate) kind: String,
    pub(crate) container_id: String,
    pub(crate) network_name: String,
    pub(crate) if_name: String,
    /// The network list the attachment was made with.
    pub(crate) config: Value,
    /// `CNI_ARGS` as key/value pairs.
    pub(crate) cni_args: Vec<(String, String)>,
    /// Capability arguments (`portMappings`) given to capable plugins.
    #[serde(default)]
    pub(crate) capability_args: Map<String, Value>,
    /// The result of ADD; `None` while ADD has not completed.
    #[serde(default)]
    pub(crate) result: Option<Value>,
}

/// The results directory under `cache_dir`.
pub(crate) fn dir(cache_dir: &Path) -> PathBuf {
    cache_dir.join("results")
}

/// The entry's path.
pub(crate) fn path(cache_dir: &Path, network: &str, container: &str, ifname: &str) -> PathBuf {
    dir(cache_dir).join(format!("{network}-{container}-{ifname}"))
}

/// Writes `entry` at `path` atomically.
pub(crate) fn write(path: &Path, entry: &Entry) -> Result<(), NetworkError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| NetworkError::io("create cni cache directory", parent, e))?;
    }
    let bytes = serde_json::to_vec(entry)
        .map_err(|e| NetworkError::io("encode cni cache entry", path, io::Error::other(e)))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(TMP_SUFFIX);
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).map_err(|e| NetworkError::io("write cni cache", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| NetworkError::io("write cni cache", path, e))
}

/// Reads the entry at `path`; `None` when there is none.
pub(crate) fn read(path: &Path) -> Result<Option<Entry>, NetworkError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(NetworkError::io("read cni cache", path, e)),
    };
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        NetworkError::io(
            "decode cni cache",
            path,
            io::Error::new(io::ErrorKind::InvalidData, e),
        )
    })
}

/// Removes the entry at `path`; a missing one is fine.
pub(crate) fn remove(path: &Path) -> Result<(), NetworkError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NetworkError::io("remove cni cache", path, e)),
    }
}

/// Every readable entry in the cache, with its path. Unreadable files are
/// skipped with a warning (they name no sandbox we could act on).
pub(crate) fn list(cache_dir: &Path) -> Result<Vec<(PathBuf, Entry)>, NetworkError> {
    let dir = dir(cache_dir);
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(NetworkError::io("read cni cache directory", &dir, e)),
    };
    let mut out = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| NetworkError::io("read cni cache directory", &dir, e))?;
        let path = ent.path();
        if path.to_string_lossy().ends_with(TMP_SUFFIX) {
            continue;
        }
        match read(&path) {
            Ok(Some(entry)) => out.push((path, entry)),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(error = %cubelet_engine::chain(&e), "skipping cni cache entry")
            }
        }
    }
    Ok(out)
}

/// The entry of `container` on `ifname`, whatever network it was made on.
/// `preferred` is tried first (the current network's path), then the
/// directory is searched.
pub(crate) fn find(
    cache_dir: &Path,
    preferred: Option<&Path>,
    container: &str,
    ifname: &str,
) -> Result<Option<(PathBuf, Entry)>, NetworkError> {
    let matches = |e: &Entry| e.container_id == container && e.if_name == ifname;
    if let Some(p) = preferred {
        if let Some(e) = read(p)? {
            if matches(&e) {
                return Ok(Some((p.to_path_buf(), e)));
            }
        }
    }
    let suffix = format!("-{container}-{ifname}");
    let dir = dir(cache_dir);
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(NetworkError::io("read cni cache directory", &dir, e)),
    };
    for ent in rd.flatten() {
        if !ent.file_name().to_string_lossy().ends_with(&suffix) {
            continue;
        }
        let path = ent.path();
        if let Some(e) = read(&path)? {
            if matches(&e) {
                return Ok(Some((path, e)));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, net: &str) -> Entry {
        Entry {
            kind: KIND.into(),
            container_id: id.into(),
            network_name: net.into(),
            if_name: "eth0".into(),
            config: serde_json::json!({"name": net}),
            cni_args: vec![("K8S_POD_NAME".into(), "p".into())],
            capability_args: Map::new(),
            result: None,
        }
    }

    #[test]
    fn write_read_find_list_remove() {
        let dir = tempfile::tempdir().unwrap();
        let p = path(dir.path(), "net-a", "abc", "eth0");
        assert_eq!(p, dir.path().join("results/net-a-abc-eth0"));
        assert_eq!(read(&p).unwrap(), None);
        let mut e = entry("abc", "net-a");
        write(&p, &e).unwrap();
        e.result = Some(serde_json::json!({"ips": []}));
        write(&p, &e).unwrap();
        assert_eq!(read(&p).unwrap(), Some(e.clone()));

        // Found under another network's name, and not confused with a
        // container whose id ends the same way.
        write(
            &path(dir.path(), "net-b", "xabc", "eth0"),
            &entry("xabc", "net-b"),
        )
        .unwrap();
        let other = path(dir.path(), "net-b", "abc", "eth0");
        let (found, got) = find(dir.path(), Some(&other), "abc", "eth0")
            .unwrap()
            .unwrap();
        assert_eq!((found, got), (p.clone(), e));
        assert!(find(dir.path(), None, "zzz", "eth0").unwrap().is_none());

        std::fs::write(dir.path().join("results/garbage"), "{").unwrap();
        let mut ids: Vec<_> = list(dir.path())
            .unwrap()
            .into_iter()
            .map(|(_, e)| e.container_id)
            .collect();
        ids.sort();
        assert_eq!(ids, ["abc", "xabc"]);
        remove(&p).unwrap();
        remove(&p).unwrap();
        assert_eq!(read(&p).unwrap(), None);
    }
}
