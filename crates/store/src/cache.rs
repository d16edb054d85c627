//! The sandbox and container records, decoded, as of the last commit.
//!
//! The List calls read every record of both tables: at 250 pods, decoding
//! them from the file on each call was most of ListPodSandbox and
//! ListContainers and a fifth of ListContainerStats (containerd's CRI plugin
//! likewise serves its lists from in-memory stores). The cache starts from
//! the records the index rebuild decodes when the store opens, and every
//! write of either table changes it after its commit, under a lock held
//! from before the write transaction begins until the cache has the
//! result, so it changes in commit order. It holds
//! nothing the file does not: a restart loads it again. The lists are
//! handed out as shared records ([`Arc`]): a copy of a record, its spec or
//! config, costs as much as decoding it. Point lookups, index lookups and
//! the lists of owned records still read the file.
//!
//! If a record of the file does not decode at open, or a write fails and
//! the record cannot be read back, the cache is dropped for good and the
//! scans read the file again (where they report the record that does not
//! decode, as before).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use tracing::warn;

use crate::records::{ContainerRecord, SandboxRecord};

/// Reports the cache off for `why`.
fn off(why: &str) {
    warn!(reason = why, "record cache off; lists read the store file");
}

/// The decoded records of one table, by primary key.
pub(crate) type Decoded<T> = BTreeMap<String, Arc<T>>;

/// The decoded records of the two tables, by primary key.
#[derive(Debug)]
pub(crate) struct Records {
    /// Sandbox records by id.
    pub(crate) sandboxes: Decoded<SandboxRecord>,
    /// Container records by id.
    pub(crate) containers: Decoded<ContainerRecord>,
}

/// [`Records`] with the lock that orders its changes like the commits.
#[derive(Debug)]
pub(crate) struct RecordCache {
    records: RwLock<Option<Records>>,
    writer: Mutex<()>,
}

/// A change of one record, applied after its commit.
pub(crate) enum Change {
    /// The sandbox as written.
    Sandbox(Arc<SandboxRecord>),
    /// The sandbox with this id is gone.
    NoSandbox(String),
    /// The container as written.
    Container(Arc<ContainerRecord>),
    /// The container with this id is gone.
    NoContainer(String),
}

impl RecordCache {
    /// A cache of `records`, or a cache that is off (`None`).
    pub(crate) fn new(records: Option<Records>) -> Self {
        if records.is_none() {
            off("a record of the file does not decode");
        }
        Self {
            records: RwLock::new(records),
            writer: Mutex::new(()),
        }
    }

    /// Held by a writer of either table from before its write transaction
    /// until its [`RecordCache::apply`].
    pub(crate) fn writer(&self) -> MutexGuard<'_, ()> {
        // Guards no data of its own.
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies a committed change.
    pub(crate) fn apply(&self, change: Change) {
        let mut records = self.records.write().unwrap_or_else(|p| p.into_inner());
        let Some(r) = records.as_mut() else {
            return;
        };
        match change {
            Change::Sandbox(rec) => {
                r.sandboxes.insert(rec.id.as_str().to_owned(), rec);
            }
            Change::NoSandbox(id) => {
                r.sandboxes.remove(&id);
            }
            Change::Container(rec) => {
                r.containers.insert(rec.id.clone(), rec);
            }
            Change::NoContainer(id) => {
                r.containers.remove(&id);
            }
        }
    }

    /// Turns the cache off: a write's outcome is unknown.
    pub(crate) fn drop_all(&self, why: &str) {
        let mut records = self.records.write().unwrap_or_else(|p| p.into_inner());
        if records.take().is_some() {
            off(why);
        }
    }

    /// `f` of the records, if the cache is on.
    fn read<R>(&self, f: impl FnOnce(&Records) -> R) -> Option<R> {
        let records = self.records.read().unwrap_or_else(|p| p.into_inner());
        records.as_ref().map(f)
    }

    /// Every sandbox record, ordered by id.
    pub(crate) fn sandboxes(&self) -> Option<Vec<Arc<SandboxRecord>>> {
        self.read(|r| r.sandboxes.values().cloned().collect())
    }

    /// Every container record, ordered by id.
    pub(crate) fn containers(&self) -> Option<Vec<Arc<ContainerRecord>>> {
        self.read(|r| r.containers.values().cloned().collect())
    }
}
