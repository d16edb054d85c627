//! Secondary indexes, so that request paths look records up by pod, by name
//! or by sandbox without scanning a table.
//!
//! Each index is a redb multimap table from a lookup key to the primary keys
//! of the records found under it: sandboxes by pod (namespace, name, uid,
//! attempt) and by name (namespace, name, attempt), containers and IP leases
//! by sandbox id, journalled flows by sandbox id. Every write of a record
//! changes its index entries in the same write transaction, so a committed
//! state never has a record without its entries.
//!
//! The indexes are derived data: [`rebuild`] recomputes them from the
//! records every time the store opens. A file written by a build that had no
//! indexes (no index tables at all), or by an older build after a newer one
//! (records written without their entries), is therefore indexed correctly
//! from its first use; opening costs one read of every record, which
//! [`crate::Store::verify`] does at startup anyway. Lookups also check every
//! record they load against the query, so an entry can never return a record
//! that does not match.

use std::sync::Arc;

use redb::{
    MultimapTableDefinition, ReadTransaction, ReadableMultimapTable, ReadableTable,
    WriteTransaction,
};
use tracing::warn;

use crate::cache::{Decoded, Records};
use crate::error::StoreError;
use crate::records::{ContainerRecord, IpLease, SandboxRecord, ShellRecord};
use crate::store::{decode, JsonTable, CONTAINERS, FLOWS, FLOWS_NAME, LEASES, SANDBOXES};

/// An index of a JSON table: lookup key to primary keys (both strings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IndexTable {
    name: &'static str,
}

impl IndexTable {
    pub(crate) const fn def(self) -> MultimapTableDefinition<'static, &'static str, &'static str> {
        MultimapTableDefinition::new(self.name)
    }
}

/// Sandboxes by [`pod_key`].
pub(crate) const SANDBOXES_BY_POD: IndexTable = IndexTable {
    name: "sandboxes_by_pod",
};
/// Sandboxes by [`name_key`].
pub(crate) const SANDBOXES_BY_NAME: IndexTable = IndexTable {
    name: "sandboxes_by_name",
};
/// Containers by sandbox id.
pub(crate) const CONTAINERS_BY_SANDBOX: IndexTable = IndexTable {
    name: "containers_by_sandbox",
};
/// IP leases (their `pool/ip` key) by sandbox id.
pub(crate) const LEASES_BY_SANDBOX: IndexTable = IndexTable {
    name: "ip_leases_by_sandbox",
};
/// Journalled flow ids by sandbox id.
pub(crate) const FLOWS_BY_SANDBOX: MultimapTableDefinition<&str, u64> =
    MultimapTableDefinition::new("flows_by_sandbox");

const JSON_INDEXES: [IndexTable; 4] = [
    SANDBOXES_BY_POD,
    SANDBOXES_BY_NAME,
    CONTAINERS_BY_SANDBOX,
    LEASES_BY_SANDBOX,
];

/// A lookup key made of `parts`, each prefixed with its length, so that no
/// two lists of parts give the same key whatever characters they hold.
fn key(parts: &[&str]) -> String {
    let mut out = String::new();
    for p in parts {
        out.push_str(&p.len().to_string());
        out.push(':');
        out.push_str(p);
    }
    out
}

/// The key of a pod's sandboxes: namespace, name, uid and attempt.
pub(crate) fn pod_key(namespace: &str, name: &str, uid: &str, attempt: u32) -> String {
    key(&[namespace, name, uid, &attempt.to_string()])
}

/// The key of the sandboxes holding a pod name: namespace, name and attempt.
pub(crate) fn name_key(namespace: &str, name: &str, attempt: u32) -> String {
    key(&[namespace, name, &attempt.to_string()])
}

/// A record of a JSON table with secondary index entries.
pub(crate) trait Indexed {
    /// The index entries (index, lookup key) of the record.
    fn entries(&self) -> Vec<(IndexTable, String)>;
}

impl Indexed for SandboxRecord {
    fn entries(&self) -> Vec<(IndexTable, String)> {
        let s = &self.spec;
        vec![
            (
                SANDBOXES_BY_POD,
                pod_key(&s.namespace, &s.name, &s.uid, s.attempt),
            ),
            (
                SANDBOXES_BY_NAME,
                name_key(&s.namespace, &s.name, s.attempt),
            ),
        ]
    }
}

impl Indexed for ContainerRecord {
    fn entries(&self) -> Vec<(IndexTable, String)> {
        vec![(CONTAINERS_BY_SANDBOX, self.sandbox_id.as_str().to_owned())]
    }
}

impl Indexed for ShellRecord {
    fn entries(&self) -> Vec<(IndexTable, String)> {
        Vec::new()
    }
}

impl Indexed for IpLease {
    fn entries(&self) -> Vec<(IndexTable, String)> {
        vec![(LEASES_BY_SANDBOX, self.sandbox_id.as_str().to_owned())]
    }
}

/// Adds the entries of `rec`, stored under `primary`, in `txn`.
pub(crate) fn add<T: Indexed>(
    txn: &WriteTransaction,
    rec: &T,
    primary: &str,
) -> Result<(), StoreError> {
    change(txn, rec, primary, Change::Add)
}

/// Removes the entries of `rec`, stored under `primary`, in `txn`.
pub(crate) fn remove<T: Indexed>(
    txn: &WriteTransaction,
    rec: &T,
    primary: &str,
) -> Result<(), StoreError> {
    change(txn, rec, primary, Change::Remove)
}

#[derive(Clone, Copy)]
enum Change {
    Add,
    Remove,
}

fn change<T: Indexed>(
    txn: &WriteTransaction,
    rec: &T,
    primary: &str,
    change: Change,
) -> Result<(), StoreError> {
    let op = match change {
        Change::Add => "index",
        Change::Remove => "unindex",
    };
    for (index, k) in rec.entries() {
        let mut t = txn
            .open_multimap_table(index.def())
            .map_err(StoreError::db(op))?;
        match change {
            Change::Add => t.insert(k.as_str(), primary),
            Change::Remove => t.remove(k.as_str(), primary),
        }
        .map_err(StoreError::db(op))?;
    }
    Ok(())
}

/// The primary keys under `k` in `index`, in key order.
pub(crate) fn lookup(
    txn: &ReadTransaction,
    index: IndexTable,
    k: &str,
) -> Result<Vec<String>, StoreError> {
    let t = txn
        .open_multimap_table(index.def())
        .map_err(StoreError::db("index lookup"))?;
    values(&t, k)
}

/// Like [`lookup`], inside a write transaction.
pub(crate) fn lookup_in(
    txn: &WriteTransaction,
    index: IndexTable,
    k: &str,
) -> Result<Vec<String>, StoreError> {
    let t = txn
        .open_multimap_table(index.def())
        .map_err(StoreError::db("index lookup"))?;
    values(&t, k)
}

fn values(
    t: &impl ReadableMultimapTable<&'static str, &'static str>,
    k: &str,
) -> Result<Vec<String>, StoreError> {
    let op = "index lookup";
    let mut out = Vec::new();
    for v in t.get(k).map_err(StoreError::db(op))? {
        out.push(v.map_err(StoreError::db(op))?.value().to_owned());
    }
    Ok(out)
}

/// How many entries [`rebuild`] wrote, per index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Rebuilt {
    pub(crate) sandboxes: usize,
    pub(crate) containers: usize,
    pub(crate) leases: usize,
    pub(crate) flows: usize,
}

/// Drops every index table and builds it again from the records, in `txn`.
/// A record that does not decode is left out of the indexes (and reported
/// by whoever reads it). Returns the counts and the decoded sandbox and
/// container records for the store's cache (`None` if one did not decode).
pub(crate) fn rebuild(txn: &WriteTransaction) -> Result<(Rebuilt, Option<Records>), StoreError> {
    let op = "rebuild indexes";
    for index in JSON_INDEXES {
        txn.delete_multimap_table(index.def())
            .map_err(StoreError::db(op))?;
        txn.open_multimap_table(index.def())
            .map_err(StoreError::db(op))?;
    }
    txn.delete_multimap_table(FLOWS_BY_SANDBOX)
        .map_err(StoreError::db(op))?;
    let mut flows_by_sandbox = txn
        .open_multimap_table(FLOWS_BY_SANDBOX)
        .map_err(StoreError::db(op))?;
    let (sandboxes, sandbox_records) = reindex::<SandboxRecord>(txn, SANDBOXES)?;
    let (containers, container_records) = reindex::<ContainerRecord>(txn, CONTAINERS)?;
    let mut counts = Rebuilt {
        sandboxes,
        containers,
        leases: reindex::<IpLease>(txn, LEASES)?.0,
        flows: 0,
    };
    let records = sandbox_records
        .zip(container_records)
        .map(|(sandboxes, containers)| Records {
            sandboxes,
            containers,
        });
    let flows = txn.open_table(FLOWS).map_err(StoreError::db(op))?;
    for entry in flows.iter().map_err(StoreError::db(op))? {
        let (k, v) = entry.map_err(StoreError::db(op))?;
        let id = k.value();
        match decode::<cubelet_engine::FlowRecord>(FLOWS_NAME, &id.to_string(), v.value()) {
            Ok(rec) => {
                flows_by_sandbox
                    .insert(rec.sandbox_id.as_str(), id)
                    .map_err(StoreError::db(op))?;
                counts.flows += 1;
            }
            Err(e) => warn!(error = %cubelet_engine::chain(&e), "flow left out of the index"),
        }
    }
    Ok((counts, records))
}

/// Indexes every record of `table`; how many, and the records by key
/// (`None` if one did not decode).
fn reindex<T: Indexed + serde::de::DeserializeOwned>(
    txn: &WriteTransaction,
    table: JsonTable,
) -> Result<(usize, Option<Decoded<T>>), StoreError> {
    let op = "rebuild indexes";
    let t = txn.open_table(table.def()).map_err(StoreError::db(op))?;
    let mut records = Some(Decoded::new());
    let mut n = 0;
    for entry in t.iter().map_err(StoreError::db(op))? {
        let (k, v) = entry.map_err(StoreError::db(op))?;
        match decode::<T>(table.name, k.value(), v.value()) {
            Ok(rec) => {
                add(txn, &rec, k.value())?;
                n += 1;
                if let Some(records) = records.as_mut() {
                    records.insert(k.value().to_owned(), Arc::new(rec));
                }
            }
            Err(e) => {
                warn!(error = %cubelet_engine::chain(&e), "record left out of the index");
                records = None;
            }
        }
    }
    Ok((n, records))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_different_parts_differ() {
        assert_ne!(key(&["a:b", "c"]), key(&["a", "b:c"]));
        assert_ne!(key(&["ab", ""]), key(&["a", "b"]));
        assert_ne!(pod_key("ns", "p", "u", 1), pod_key("ns", "p", "u", 11));
        assert_eq!(key(&["ns", "web"]), "2:ns3:web");
    }
}
