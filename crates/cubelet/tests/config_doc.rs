//! The configuration table of docs/configuration.md is the reference for
//! operators: every key of the default configuration must appear in it, and
//! every key it lists must exist.

use std::collections::BTreeSet;
use std::path::Path;

use serde_norway::Value;

/// Maps that hold user-named entries: documented as one key.
const OPEN_MAPS: [(&str, &str); 2] = [
    ("runtime.handlers", "runtime.handlers.<name>"),
    ("flows", "flows.*"),
];

fn collect(prefix: &str, value: &Value, out: &mut BTreeSet<String>) {
    if let Some((_, doc)) = OPEN_MAPS.iter().find(|(p, _)| *p == prefix) {
        out.insert((*doc).to_owned());
        return;
    }
    match value {
        Value::Mapping(map) => {
            for (k, v) in map {
                let key = k.as_str().expect("config keys are strings");
                let path = if prefix.is_empty() {
                    key.to_owned()
                } else {
                    format!("{prefix}.{key}")
                };
                collect(&path, v, out);
            }
        }
        _ => {
            out.insert(prefix.to_owned());
        }
    }
}

/// Every dotted key path of the default configuration.
fn config_keys() -> BTreeSet<String> {
    let yaml = serde_norway::to_string(&cubelet::config::Config::default())
        .expect("the default config serialises");
    let value: Value = serde_norway::from_str(&yaml).expect("its YAML parses back");
    let mut keys = BTreeSet::new();
    collect("", &value, &mut keys);
    keys
}

/// Keys named in the first column of the table under the first `## Configuration…`
/// heading.
/// A cell may list several keys; `.d` after `a.b.c` in the same cell means
/// `a.b.d`.
fn documented_keys(doc: &str) -> BTreeSet<String> {
    let text = format!("\n{doc}");
    let section = text
        .split("\n## ")
        .find(|s| s.starts_with("Configuration"))
        .expect("docs/configuration.md has a ## Configuration keys section");
    let mut keys = BTreeSet::new();
    for line in section.lines().filter(|l| l.starts_with('|')) {
        let Some(cell) = line.split('|').nth(1) else {
            continue;
        };
        let mut last_full: Option<String> = None;
        for (i, piece) in cell.split('`').enumerate() {
            // Odd pieces are inside backticks.
            if i.is_multiple_of(2) || piece.is_empty() {
                continue;
            }
            let key = if let Some(leaf) = piece.strip_prefix('.') {
                let base = last_full
                    .as_deref()
                    .and_then(|k| k.rsplit_once('.'))
                    .map(|(parent, _)| parent)
                    .unwrap_or_else(|| {
                        panic!("shorthand `{piece}` without a full key before it in: {line}")
                    });
                format!("{base}.{leaf}")
            } else {
                last_full = Some(piece.to_owned());
                piece.to_owned()
            };
            keys.insert(key);
        }
    }
    keys
}

fn config_doc() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/configuration.md");
    std::fs::read_to_string(&path).expect("docs/configuration.md in the workspace")
}

#[test]
fn every_config_key_is_in_the_docs_table() {
    let documented = documented_keys(&config_doc());
    let missing: Vec<_> = config_keys()
        .into_iter()
        .filter(|k| !documented.contains(k))
        .collect();
    assert!(
        missing.is_empty(),
        "keys missing from docs/configuration.md's table: {missing:?}"
    );
}

#[test]
fn every_key_in_the_docs_table_exists() {
    let keys = config_keys();
    let stale: Vec<_> = documented_keys(&config_doc())
        .into_iter()
        .filter(|k| !keys.contains(k))
        .collect();
    assert!(
        stale.is_empty(),
        "docs/configuration.md documents keys the configuration does not have: {stale:?}"
    );
}

#[test]
fn shorthand_rows_expand_to_full_keys() {
    let text = "## Configuration\n\n| key | default |\n|---|---|\n\
                | `network.bridge.name`, `.subnet`, `.mtu` | `cubelet0` |\n\
                | `gc.interval`, `gc.concurrency` | `60s`, `4` |\n\n## Next\n| `not.this` |\n";
    let keys: Vec<_> = documented_keys(text).into_iter().collect();
    assert_eq!(
        keys,
        [
            "gc.concurrency",
            "gc.interval",
            "network.bridge.mtu",
            "network.bridge.name",
            "network.bridge.subnet"
        ]
    );
}

#[test]
fn open_maps_count_as_one_key() {
    let keys = config_keys();
    assert!(keys.contains("runtime.handlers.<name>"), "{keys:?}");
    assert!(keys.contains("flows.*"), "{keys:?}");
    assert!(!keys.iter().any(|k| k.starts_with("runtime.handlers.runc")));
    assert!(keys.contains("network.bridge.subnet"), "{keys:?}");
}
