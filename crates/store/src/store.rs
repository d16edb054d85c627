//! [`Store`]: the redb file, its tables and the record operations.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cubelet_engine::{FlowRecord, SandboxId};
use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::{debug, info};

use crate::cache::{Change, RecordCache, Records};
use crate::error::StoreError;
use crate::index::{self, Indexed};
use crate::records::{ContainerRecord, IpLease, SandboxRecord, ShellRecord};

/// Schema version this build reads and writes. Bump it only for changes that
/// old builds cannot read; adding a field with `#[serde(default)]` is not one.
pub const SCHEMA_VERSION: u32 = 1;

/// A string-keyed table of JSON values; the name is kept `'static` for errors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JsonTable {
    pub(crate) name: &'static str,
}

impl JsonTable {
    pub(crate) const fn def(self) -> TableDefinition<'static, &'static str, &'static [u8]> {
        TableDefinition::new(self.name)
    }
}

pub(crate) const SANDBOXES: JsonTable = JsonTable { name: "sandboxes" };
pub(crate) const CONTAINERS: JsonTable = JsonTable { name: "containers" };
pub(crate) const LEASES: JsonTable = JsonTable { name: "ip_leases" };
pub(crate) const SHELLS: JsonTable = JsonTable { name: "shells" };
/// Journalled flows by id; the table name doubles as the error label.
pub(crate) const FLOWS_NAME: &str = "flows";
pub(crate) const FLOWS: TableDefinition<u64, &[u8]> = TableDefinition::new(FLOWS_NAME);
pub(crate) const META: TableDefinition<&str, &str> = TableDefinition::new("meta");

/// Meta key holding [`SCHEMA_VERSION`].
pub(crate) const META_SCHEMA: &str = "schema_version";
/// Meta key holding the last flow id handed out, so ids never repeat even
/// after the newest flows were forgotten.
pub(crate) const META_LAST_FLOW: &str = "last_flow_id";
const RESERVED_META: [&str; 2] = [META_SCHEMA, META_LAST_FLOW];

/// Page cache for the database. Node state is small (a few MiB at most);
/// redb's default of 1 GiB would only matter for a much larger file.
const CACHE_BYTES: usize = 64 * 1024 * 1024;
/// Mode of the database file (as containerd's `meta.db`).
const STORE_FILE_MODE: u32 = 0o600;

/// Durable node state in one redb file: sandboxes, containers, IP leases,
/// the flow journal (see the [`cubelet_engine::Journal`] impl) and a small
/// `meta` table.
///
/// Every write is one redb write transaction, committed with
/// [`Durability::Immediate`] (on disk when the call returns) unless
/// documented otherwise. Write transactions are serialised by redb; reads run
/// on snapshots and never block writes. Calls block on disk I/O: from async
/// code, call them where blocking briefly is acceptable or via
/// `spawn_blocking`.
///
/// `Store` is `Send + Sync`; share it with an `Arc`. Only one process may
/// have the file open at a time (redb locks it).
#[derive(Debug)]
pub struct Store {
    pub(crate) db: Database,
    path: PathBuf,
    /// The sandbox and container records as of the last commit, for the
    /// scans of both tables (see `cache`).
    cache: RecordCache,
}

/// The table of a cached record.
#[derive(Debug, Clone, Copy)]
enum Cached {
    Sandbox,
    Container,
}

/// Counts of what [`Store::verify`] read and decoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Sandbox records.
    pub sandboxes: usize,
    /// Container records.
    pub containers: usize,
    /// IP leases.
    pub leases: usize,
    /// Journalled flows.
    pub flows: usize,
}

impl Store {
    /// Opens the store at `path`, creating the file and its parent directory
    /// if needed, creating missing tables, and checking the schema version.
    ///
    /// After a crash redb repairs the file on open (this can take a moment on
    /// a large file); the result is the state of the last durable commit.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
        }
        // Created 0600 before redb opens it, and an older, wider one
        // tightened: the store holds every pod's configuration.
        {
            use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(STORE_FILE_MODE)
                .open(path)
                .map_err(|source| StoreError::CreateFile {
                    path: path.to_owned(),
                    source,
                })?;
            file.set_permissions(std::fs::Permissions::from_mode(STORE_FILE_MODE))
                .map_err(|source| StoreError::CreateFile {
                    path: path.to_owned(),
                    source,
                })?;
        }
        let db = Database::builder()
            .set_cache_size(CACHE_BYTES)
            .create(path)
            .map_err(|e| StoreError::Open {
                path: path.to_owned(),
                source: Box::new(e),
            })?;
        // The index rebuild decodes every record: the cache starts from it.
        let records = Store::init_schema(&db, path)?;
        let store = Store {
            db,
            path: path.to_owned(),
            cache: RecordCache::new(records),
        };
        info!(path = %path.display(), schema = SCHEMA_VERSION, "store opened");
        Ok(store)
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Checks the schema version, creates missing tables and rebuilds the
    /// indexes; returns the decoded records for the cache.
    fn init_schema(db: &Database, path: &Path) -> Result<Option<Records>, StoreError> {
        let txn = db.begin_write().map_err(StoreError::db("open"))?;
        {
            let mut meta = txn.open_table(META).map_err(StoreError::db("open"))?;
            let found = meta
                .get(META_SCHEMA)
                .map_err(StoreError::db("open"))?
                .map(|g| g.value().to_owned());
            match found {
                None => {
                    let v = SCHEMA_VERSION.to_string();
                    meta.insert(META_SCHEMA, v.as_str())
                        .map_err(StoreError::db("open"))?;
                    debug!(path = %path.display(), "new store initialised");
                }
                Some(v) if v == SCHEMA_VERSION.to_string() => {}
                Some(found) => {
                    return Err(StoreError::SchemaMismatch {
                        path: path.to_owned(),
                        found,
                        expected: SCHEMA_VERSION,
                    })
                }
            }
            // Create every table, so readers never meet a missing one.
            txn.open_table(SANDBOXES.def())
                .map_err(StoreError::db("open"))?;
            txn.open_table(CONTAINERS.def())
                .map_err(StoreError::db("open"))?;
            txn.open_table(LEASES.def())
                .map_err(StoreError::db("open"))?;
            txn.open_table(SHELLS.def())
                .map_err(StoreError::db("open"))?;
            txn.open_table(FLOWS).map_err(StoreError::db("open"))?;
        }
        // Derived from the records on every open (see `index`), so a file of
        // a build without indexes, or one an older build wrote to, is
        // indexed as well as one this build wrote.
        let (rebuilt, records) = index::rebuild(&txn)?;
        debug!(path = %path.display(), ?rebuilt, "indexes rebuilt");
        txn.commit().map_err(StoreError::db("open"))?;
        Ok(records)
    }

    /// Runs `write`, a write of record `key` of `table`, under the cache's
    /// writer lock, then gives the cache `change` of its result; if the
    /// write fails, the cache takes the record as the file now has it.
    fn cached<R>(
        &self,
        table: Cached,
        key: &str,
        write: impl FnOnce() -> Result<R, StoreError>,
        change: impl FnOnce(&R) -> Change,
    ) -> Result<R, StoreError> {
        let _writer = self.cache.writer();
        match write() {
            Ok(out) => {
                self.cache.apply(change(&out));
                Ok(out)
            }
            Err(e) => {
                let now = match table {
                    Cached::Sandbox => {
                        self.reread(SANDBOXES, key, Change::Sandbox, Change::NoSandbox)
                    }
                    Cached::Container => {
                        self.reread(CONTAINERS, key, Change::Container, Change::NoContainer)
                    }
                };
                match now {
                    Ok(change) => self.cache.apply(change),
                    Err(_) => self
                        .cache
                        .drop_all("a record could not be read back after a failed write"),
                }
                Err(e)
            }
        }
    }

    /// Record `key` of `table` as the file has it now, as a cache change.
    fn reread<T: DeserializeOwned>(
        &self,
        table: JsonTable,
        key: &str,
        present: fn(Arc<T>) -> Change,
        absent: fn(String) -> Change,
    ) -> Result<Change, StoreError> {
        Ok(match self.get_json::<T>(table, key)? {
            Some(rec) => present(Arc::new(rec)),
            None => absent(key.to_owned()),
        })
    }

    pub(crate) fn write(&self, op: &'static str) -> Result<WriteTransaction, StoreError> {
        self.db.begin_write().map_err(StoreError::db(op))
    }

    // ---- generic helpers over string-keyed JSON tables ----

    fn get_json<T: DeserializeOwned>(
        &self,
        table: JsonTable,
        key: &str,
    ) -> Result<Option<T>, StoreError> {
        let op = "read";
        let txn = self.db.begin_read().map_err(StoreError::db(op))?;
        let t = txn.open_table(table.def()).map_err(StoreError::db(op))?;
        let guard = t.get(key).map_err(StoreError::db(op))?;
        guard
            .map(|g| decode(table.name, key, g.value()))
            .transpose()
    }

    /// The records of `table` whose primary keys `index` holds under `key`
    /// and that `matches` accepts, in primary key order. An entry whose
    /// record is gone or does not match is skipped.
    fn find<T: DeserializeOwned>(
        &self,
        table: JsonTable,
        index: index::IndexTable,
        key: &str,
        matches: impl Fn(&T) -> bool,
    ) -> Result<Vec<T>, StoreError> {
        let op = "find";
        let txn = self.db.begin_read().map_err(StoreError::db(op))?;
        let primaries = index::lookup(&txn, index, key)?;
        let t = txn.open_table(table.def()).map_err(StoreError::db(op))?;
        let mut out = Vec::new();
        for primary in primaries {
            if let Some(g) = t.get(primary.as_str()).map_err(StoreError::db(op))? {
                let rec: T = decode(table.name, &primary, g.value())?;
                if matches(&rec) {
                    out.push(rec);
                }
            }
        }
        Ok(out)
    }

    fn scan<T: DeserializeOwned>(
        &self,
        table: JsonTable,
        mut keep: impl FnMut(&T) -> bool,
    ) -> Result<Vec<T>, StoreError> {
        let op = "scan";
        let txn = self.db.begin_read().map_err(StoreError::db(op))?;
        let t = txn.open_table(table.def()).map_err(StoreError::db(op))?;
        let mut out = Vec::new();
        for entry in t.iter().map_err(StoreError::db(op))? {
            let (k, v) = entry.map_err(StoreError::db(op))?;
            let rec: T = decode(table.name, k.value(), v.value())?;
            if keep(&rec) {
                out.push(rec);
            }
        }
        Ok(out)
    }

    fn put_json<T: Serialize + DeserializeOwned + Indexed>(
        &self,
        table: JsonTable,
        key: &str,
        value: &T,
        durability: Durability,
    ) -> Result<(), StoreError> {
        let op = "put";
        let bytes = encode(table.name, key, value)?;
        let mut txn = self.write(op)?;
        txn.set_durability(durability).map_err(StoreError::db(op))?;
        put_in(&txn, op, table, key, value, &bytes)?;
        txn.commit().map_err(StoreError::db(op))
    }

    fn delete_key<T: DeserializeOwned + Indexed>(
        &self,
        table: JsonTable,
        key: &str,
    ) -> Result<bool, StoreError> {
        self.delete_key_with::<T>(table, key, Durability::Immediate)
    }

    fn delete_key_with<T: DeserializeOwned + Indexed>(
        &self,
        table: JsonTable,
        key: &str,
        durability: Durability,
    ) -> Result<bool, StoreError> {
        let op = "delete";
        let mut txn = self.write(op)?;
        txn.set_durability(durability).map_err(StoreError::db(op))?;
        let old = txn
            .open_table(table.def())
            .map_err(StoreError::db(op))?
            .remove(key)
            .map_err(StoreError::db(op))?
            .map(|g| g.value().to_vec());
        let existed = old.is_some();
        if let Some(old) = old {
            unindex::<T>(&txn, table, key, &old)?;
        }
        txn.commit().map_err(StoreError::db(op))?;
        Ok(existed)
    }

    /// Reads, changes and writes back one record in a single write
    /// transaction. `not_found` builds the error for a missing key; `key_of`
    /// reads the key back so the closure cannot move the record.
    fn update_json<T: Serialize + DeserializeOwned + Indexed>(
        &self,
        table: JsonTable,
        key: &str,
        not_found: impl FnOnce() -> StoreError,
        key_of: impl FnOnce(&T) -> &str,
        f: impl FnOnce(&mut T),
    ) -> Result<T, StoreError> {
        let op = "update";
        let txn = self.write(op)?;
        let rec = {
            let mut t = txn.open_table(table.def()).map_err(StoreError::db(op))?;
            let current: Option<T> = t
                .get(key)
                .map_err(StoreError::db(op))?
                .map(|g| decode(table.name, key, g.value()))
                .transpose()?;
            let Some(mut rec) = current else {
                return Err(not_found());
            };
            let before = rec.entries();
            f(&mut rec);
            if key_of(&rec) != key {
                return Err(StoreError::IdChanged {
                    table: table.name,
                    id: key.to_owned(),
                });
            }
            let bytes = encode(table.name, key, &rec)?;
            t.insert(key, bytes.as_slice())
                .map_err(StoreError::db(op))?;
            (rec, before)
        };
        let (rec, before) = rec;
        // Most updates change no indexed field: leave their entries alone.
        if before != rec.entries() {
            for (index, k) in before {
                txn.open_multimap_table(index.def())
                    .map_err(StoreError::db(op))?
                    .remove(k.as_str(), key)
                    .map_err(StoreError::db(op))?;
            }
            index::add(&txn, &rec, key)?;
        }
        txn.commit().map_err(StoreError::db(op))?;
        Ok(rec)
    }

    // ---- sandboxes ----

    /// Inserts or replaces a sandbox record.
    pub fn put_sandbox(&self, rec: &SandboxRecord) -> Result<(), StoreError> {
        self.put_sandbox_with(rec, Durability::Immediate)
    }

    fn put_sandbox_with(
        &self,
        rec: &SandboxRecord,
        durability: Durability,
    ) -> Result<(), StoreError> {
        let key = rec.id.as_str();
        self.cached(
            Cached::Sandbox,
            key,
            || self.put_json(SANDBOXES, key, rec, durability),
            |()| Change::Sandbox(Arc::new(rec.clone())),
        )
    }

    /// Inserts or replaces a sandbox record with a buffered commit: every
    /// reader sees it at once, and it is on disk once the next durable
    /// commit of any kind returns (redb persists every commit before a
    /// durable one, and a crash reopens at the last durable commit, so it is
    /// never torn). For a record that a durable write follows before
    /// anything acts on it: the pod service records a new sandbox this way
    /// just before its `create` flow's first journal write, which is durable
    /// and returns before any step acts. A crash in between loses both and
    /// nothing was built.
    pub fn put_sandbox_buffered(&self, rec: &SandboxRecord) -> Result<(), StoreError> {
        self.put_sandbox_with(rec, Durability::None)
    }

    /// The sandbox record with this id, if any.
    pub fn get_sandbox(&self, id: &SandboxId) -> Result<Option<SandboxRecord>, StoreError> {
        self.get_json(SANDBOXES, id.as_str())
    }

    /// Every sandbox record, ordered by id.
    pub fn list_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        self.scan(SANDBOXES, |_| true)
    }

    /// Every sandbox record, ordered by id, shared with the store's cache:
    /// for the calls that read every record of the node (a copy of a
    /// record costs as much as decoding it).
    pub fn list_sandboxes_shared(&self) -> Result<Vec<Arc<SandboxRecord>>, StoreError> {
        match self.cache.sandboxes() {
            Some(all) => Ok(all),
            None => Ok(self.list_sandboxes()?.into_iter().map(Arc::new).collect()),
        }
    }

    /// Deletes a sandbox record. Idempotent: returns whether it existed.
    pub fn delete_sandbox(&self, id: &SandboxId) -> Result<bool, StoreError> {
        let key = id.as_str();
        self.cached(
            Cached::Sandbox,
            key,
            || self.delete_key::<SandboxRecord>(SANDBOXES, key),
            |_| Change::NoSandbox(key.to_owned()),
        )
    }

    /// Changes a sandbox record atomically: read, `f`, write back in one
    /// write transaction, so concurrent updates never lose each other's
    /// changes. Returns the record as written. `f` runs while the store's
    /// write lock is held: keep it short and do no I/O in it. Fails with
    /// [`StoreError::SandboxNotFound`] if there is no such sandbox, and with
    /// [`StoreError::IdChanged`] (writing nothing) if `f` changes the id.
    pub fn update_sandbox(
        &self,
        id: &SandboxId,
        f: impl FnOnce(&mut SandboxRecord),
    ) -> Result<SandboxRecord, StoreError> {
        self.cached(
            Cached::Sandbox,
            id.as_str(),
            || {
                self.update_json(
                    SANDBOXES,
                    id.as_str(),
                    || StoreError::SandboxNotFound(id.clone()),
                    |r: &SandboxRecord| r.id.as_str(),
                    f,
                )
            },
            |rec| Change::Sandbox(Arc::new(rec.clone())),
        )
    }

    /// The sandbox of a pod (namespace, name, uid) at an attempt, for
    /// RunPodSandbox idempotency. If several match, the newest.
    pub fn find_sandbox_by_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        attempt: u32,
    ) -> Result<Option<SandboxRecord>, StoreError> {
        let key = index::pod_key(namespace, name, uid, attempt);
        let found = self.find(
            SANDBOXES,
            index::SANDBOXES_BY_POD,
            &key,
            |r: &SandboxRecord| {
                r.spec.namespace == namespace
                    && r.spec.name == name
                    && r.spec.uid == uid
                    && r.spec.attempt == attempt
            },
        )?;
        Ok(newest(found))
    }

    /// The sandbox holding a pod name (namespace, name) at an attempt,
    /// whatever its uid, for name-in-use checks. If several match, the newest.
    pub fn find_sandbox_by_name(
        &self,
        namespace: &str,
        name: &str,
        attempt: u32,
    ) -> Result<Option<SandboxRecord>, StoreError> {
        let key = index::name_key(namespace, name, attempt);
        let found = self.find(
            SANDBOXES,
            index::SANDBOXES_BY_NAME,
            &key,
            |r: &SandboxRecord| {
                r.spec.namespace == namespace && r.spec.name == name && r.spec.attempt == attempt
            },
        )?;
        Ok(newest(found))
    }

    // ---- containers ----

    /// Inserts or replaces a container record.
    pub fn put_container(&self, rec: &ContainerRecord) -> Result<(), StoreError> {
        self.cached(
            Cached::Container,
            &rec.id,
            || self.put_json(CONTAINERS, &rec.id, rec, Durability::Immediate),
            |()| Change::Container(Arc::new(rec.clone())),
        )
    }

    /// The container record with this id, if any.
    pub fn get_container(&self, id: &str) -> Result<Option<ContainerRecord>, StoreError> {
        self.get_json(CONTAINERS, id)
    }

    /// Every container record, ordered by id.
    pub fn list_containers(&self) -> Result<Vec<ContainerRecord>, StoreError> {
        self.scan(CONTAINERS, |_| true)
    }

    /// Every container record, ordered by id, shared with the store's
    /// cache, as [`Store::list_sandboxes_shared`].
    pub fn list_containers_shared(&self) -> Result<Vec<Arc<ContainerRecord>>, StoreError> {
        match self.cache.containers() {
            Some(all) => Ok(all),
            None => Ok(self.list_containers()?.into_iter().map(Arc::new).collect()),
        }
    }

    /// The containers of one sandbox, ordered by id.
    pub fn list_containers_of(
        &self,
        sandbox_id: &SandboxId,
    ) -> Result<Vec<ContainerRecord>, StoreError> {
        self.find(
            CONTAINERS,
            index::CONTAINERS_BY_SANDBOX,
            sandbox_id.as_str(),
            |r: &ContainerRecord| &r.sandbox_id == sandbox_id,
        )
    }

    /// Deletes a container record. Idempotent: returns whether it existed.
    pub fn delete_container(&self, id: &str) -> Result<bool, StoreError> {
        self.delete_container_with(id, Durability::Immediate)
    }

    fn delete_container_with(&self, id: &str, durability: Durability) -> Result<bool, StoreError> {
        self.cached(
            Cached::Container,
            id,
            || self.delete_key_with::<ContainerRecord>(CONTAINERS, id, durability),
            |_| Change::NoContainer(id.to_owned()),
        )
    }

    /// [`Store::delete_container`] without waiting for the disk: the change
    /// is visible at once and reaches the disk with the next durable
    /// commit of any kind. For a container being removed: a crash before
    /// that commit brings the record back, and the restart's reconciliation
    /// reads its state from the runtime (`Unknown` if nothing of it is
    /// left there), for the client's next RemoveContainer.
    pub fn delete_container_buffered(&self, id: &str) -> Result<bool, StoreError> {
        self.delete_container_with(id, Durability::None)
    }

    /// Changes a container record atomically, like [`Store::update_sandbox`].
    pub fn update_container(
        &self,
        id: &str,
        f: impl FnOnce(&mut ContainerRecord),
    ) -> Result<ContainerRecord, StoreError> {
        self.cached(
            Cached::Container,
            id,
            || {
                self.update_json(
                    CONTAINERS,
                    id,
                    || StoreError::ContainerNotFound(id.to_owned()),
                    |r: &ContainerRecord| r.id.as_str(),
                    f,
                )
            },
            |rec| Change::Container(Arc::new(rec.clone())),
        )
    }

    // ---- warm-pool shells ----

    /// Records a shell, durably, before its `prewarm` flow acts.
    pub fn put_shell(&self, rec: &ShellRecord) -> Result<(), StoreError> {
        self.put_json(SHELLS, rec.id.as_str(), rec, Durability::Immediate)
    }

    /// Every shell record, ordered by id.
    pub fn list_shells(&self) -> Result<Vec<ShellRecord>, StoreError> {
        self.scan(SHELLS, |_| true)
    }

    /// A pod claims shell `rec.id`: records its sandbox `rec` and deletes
    /// the shell record, in one write transaction, so the id is never
    /// without a record (the GC never sees its objects as orphans). The
    /// commit is buffered as [`Store::put_sandbox_buffered`]'s: the
    /// `create` flow's first journal write follows, and a crash before the
    /// next durable commit loses both together and leaves the shell's
    /// record as it was. That write is durable, and returns before any
    /// step acts, unless every step acts only inside the shell
    /// (`Flow::confined_to_shell` in the engine); then the shell's
    /// destruction at the restart undoes what they did.
    pub fn claim_shell(&self, rec: &SandboxRecord) -> Result<(), StoreError> {
        let op = "claim shell";
        let key = rec.id.as_str();
        let bytes = encode(SANDBOXES.name, key, rec)?;
        let claim = || {
            let mut txn = self.write(op)?;
            txn.set_durability(Durability::None)
                .map_err(StoreError::db(op))?;
            txn.open_table(SHELLS.def())
                .map_err(StoreError::db(op))?
                .remove(key)
                .map_err(StoreError::db(op))?;
            put_in(&txn, op, SANDBOXES, key, rec, &bytes)?;
            txn.commit().map_err(StoreError::db(op))
        };
        self.cached(Cached::Sandbox, key, claim, |()| {
            Change::Sandbox(Arc::new(rec.clone()))
        })
    }

    /// The ids of every sandbox and every shell, read in one transaction:
    /// a claim turns a shell record into a sandbox record atomically, and
    /// two separate reads could miss the id between them.
    pub fn sandbox_and_shell_ids(&self) -> Result<Vec<SandboxId>, StoreError> {
        let op = "scan";
        let txn = self.db.begin_read().map_err(StoreError::db(op))?;
        let mut out = Vec::new();
        for table in [SANDBOXES, SHELLS] {
            let t = txn.open_table(table.def()).map_err(StoreError::db(op))?;
            for entry in t.iter().map_err(StoreError::db(op))? {
                let (k, _) = entry.map_err(StoreError::db(op))?;
                out.push(SandboxId::new_unchecked(k.value()));
            }
        }
        Ok(out)
    }

    /// Deletes a shell record. Idempotent: returns whether it existed.
    pub fn delete_shell(&self, id: &SandboxId) -> Result<bool, StoreError> {
        self.delete_key::<ShellRecord>(SHELLS, id.as_str())
    }

    // ---- IP leases ----

    /// Records a lease. Check and insert happen in one write transaction, so
    /// two callers can never both get an address. Fails with
    /// [`StoreError::AlreadyLeased`] if another sandbox holds the address; a
    /// lease already held by the same sandbox is kept as it is (a retried
    /// allocation succeeds).
    pub fn add_lease(&self, lease: &IpLease) -> Result<(), StoreError> {
        self.add_lease_with(lease, Durability::Immediate)
    }

    /// [`Store::add_lease`] without waiting for the disk: the lease is
    /// seen at once and reaches the disk with the next durable commit of
    /// any kind. For the bridge provider, which takes a lease only inside a
    /// `create` or `prewarm` flow: the flow's first journal write is
    /// durable before the lease is taken, and its last one is durable
    /// before the caller hears of the sandbox. A crash in between loses
    /// the lease with nothing depending on it, and leaves the flow open,
    /// so recovery tears the sandbox's network down (its address with it).
    pub fn add_lease_buffered(&self, lease: &IpLease) -> Result<(), StoreError> {
        self.add_lease_with(lease, Durability::None)
    }

    fn add_lease_with(&self, lease: &IpLease, durability: Durability) -> Result<(), StoreError> {
        let op = "add lease";
        let key = IpLease::key(&lease.pool, lease.ip);
        let bytes = encode(LEASES.name, &key, lease)?;
        let mut txn = self.write(op)?;
        txn.set_durability(durability).map_err(StoreError::db(op))?;
        {
            let mut t = txn.open_table(LEASES.def()).map_err(StoreError::db(op))?;
            let existing: Option<IpLease> = t
                .get(key.as_str())
                .map_err(StoreError::db(op))?
                .map(|g| decode(LEASES.name, &key, g.value()))
                .transpose()?;
            if let Some(held) = existing {
                if held.sandbox_id == lease.sandbox_id {
                    return Ok(());
                }
                return Err(StoreError::AlreadyLeased {
                    pool: lease.pool.clone(),
                    ip: lease.ip,
                    holder: held.sandbox_id,
                });
            }
            t.insert(key.as_str(), bytes.as_slice())
                .map_err(StoreError::db(op))?;
        }
        index::add(&txn, lease, &key)?;
        txn.commit().map_err(StoreError::db(op))
    }

    /// Releases one address. Idempotent: returns whether it was leased.
    pub fn release_lease(&self, pool: &str, ip: IpAddr) -> Result<bool, StoreError> {
        self.delete_key::<IpLease>(LEASES, &IpLease::key(pool, ip))
    }

    /// Releases every address a sandbox holds, in every pool, in one write
    /// transaction. Idempotent: returns how many were released.
    pub fn release_leases_of(&self, sandbox_id: &SandboxId) -> Result<usize, StoreError> {
        Ok(self.release_leases_where(sandbox_id, |_| true)?.len())
    }

    /// Releases every address a sandbox holds in `pool`, in one write
    /// transaction. Idempotent: returns the addresses released.
    pub fn release_leases_in(
        &self,
        pool: &str,
        sandbox_id: &SandboxId,
    ) -> Result<Vec<IpAddr>, StoreError> {
        self.release_leases_where(sandbox_id, |l| l.pool == pool)
    }

    /// Releases the leases of `sandbox_id` that `keep` accepts, found by the
    /// lease index.
    fn release_leases_where(
        &self,
        sandbox_id: &SandboxId,
        keep: impl Fn(&IpLease) -> bool,
    ) -> Result<Vec<IpAddr>, StoreError> {
        let op = "release leases";
        let txn = self.write(op)?;
        let keys = index::lookup_in(&txn, index::LEASES_BY_SANDBOX, sandbox_id.as_str())?;
        let mut released = Vec::new();
        {
            let mut t = txn.open_table(LEASES.def()).map_err(StoreError::db(op))?;
            for k in &keys {
                let lease: Option<IpLease> = t
                    .get(k.as_str())
                    .map_err(StoreError::db(op))?
                    .map(|g| decode(LEASES.name, k, g.value()))
                    .transpose()?;
                let Some(lease) = lease.filter(|l| &l.sandbox_id == sandbox_id && keep(l)) else {
                    continue;
                };
                t.remove(k.as_str()).map_err(StoreError::db(op))?;
                released.push((k.clone(), lease));
            }
        }
        for (k, lease) in &released {
            index::remove(&txn, lease, k)?;
        }
        txn.commit().map_err(StoreError::db(op))?;
        Ok(released.into_iter().map(|(_, l)| l.ip).collect())
    }

    /// Every lease of a pool.
    pub fn list_leases(&self, pool: &str) -> Result<Vec<IpLease>, StoreError> {
        self.scan(LEASES, |l: &IpLease| l.pool == pool)
    }

    /// Every lease of every pool.
    pub fn list_all_leases(&self) -> Result<Vec<IpLease>, StoreError> {
        self.scan(LEASES, |_| true)
    }

    // ---- meta ----

    /// A value of the `meta` table.
    pub fn get_meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        let op = "read meta";
        let txn = self.db.begin_read().map_err(StoreError::db(op))?;
        let t = txn.open_table(META).map_err(StoreError::db(op))?;
        let v = t
            .get(key)
            .map_err(StoreError::db(op))?
            .map(|g| g.value().to_owned());
        Ok(v)
    }

    /// Sets a value of the `meta` table. Keys the store uses itself
    /// (`schema_version`, `last_flow_id`) are refused.
    pub fn set_meta(&self, key: &str, value: &str) -> Result<(), StoreError> {
        if RESERVED_META.contains(&key) {
            return Err(StoreError::ReservedMetaKey(key.to_owned()));
        }
        let op = "write meta";
        let txn = self.write(op)?;
        txn.open_table(META)
            .map_err(StoreError::db(op))?
            .insert(key, value)
            .map_err(StoreError::db(op))?;
        txn.commit().map_err(StoreError::db(op))
    }

    // ---- whole store ----

    /// Reads and decodes every record of every table, as a startup check.
    pub fn verify(&self) -> Result<VerifyReport, StoreError> {
        Ok(VerifyReport {
            sandboxes: self.list_sandboxes()?.len(),
            containers: self.list_containers()?.len(),
            leases: self.list_all_leases()?.len(),
            flows: self.list_flows()?.len(),
        })
    }

    /// Every journalled flow, oldest first (for the admin API and tools).
    pub fn list_flows(&self) -> Result<Vec<FlowRecord>, StoreError> {
        self.scan_flows(|_| true)
    }
}

/// Writes `bytes` (the encoding of `value`) under `key` of `table` in
/// `txn`, moving the indexes from the record it replaces to the new one.
fn put_in<T: DeserializeOwned + Indexed>(
    txn: &WriteTransaction,
    op: &'static str,
    table: JsonTable,
    key: &str,
    value: &T,
    bytes: &[u8],
) -> Result<(), StoreError> {
    let old = {
        let mut t = txn.open_table(table.def()).map_err(StoreError::db(op))?;
        let old = t
            .insert(key, bytes)
            .map_err(StoreError::db(op))?
            .map(|g| g.value().to_vec());
        old
    };
    if let Some(old) = old {
        unindex::<T>(txn, table, key, &old)?;
    }
    index::add(txn, value, key)
}

/// Removes the index entries of the record `bytes` held under `key` (a
/// record that no longer decodes has none it could be found by: lookups
/// check every record they load).
fn unindex<T: DeserializeOwned + Indexed>(
    txn: &WriteTransaction,
    table: JsonTable,
    key: &str,
    bytes: &[u8],
) -> Result<(), StoreError> {
    match decode::<T>(table.name, key, bytes) {
        Ok(old) => index::remove(txn, &old, key),
        Err(e) => {
            debug!(error = %cubelet_engine::chain(&e), "replaced record had no index entries");
            Ok(())
        }
    }
}

fn newest(mut found: Vec<SandboxRecord>) -> Option<SandboxRecord> {
    found.sort_by_key(|r| r.created_at);
    found.pop()
}

pub(crate) fn encode<T: Serialize>(
    table: &'static str,
    key: &str,
    value: &T,
) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|source| StoreError::Encode {
        table,
        key: key.to_owned(),
        source,
    })
}

pub(crate) fn decode<T: DeserializeOwned>(
    table: &'static str,
    key: &str,
    bytes: &[u8],
) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Decode {
        table,
        key: key.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::{Duration, SystemTime};

    use cubelet_engine::spec::NetworkStatus;
    use cubelet_engine::{FlowRecord, SandboxSpec};

    use super::*;
    use crate::records::{ContainerState, SandboxState};

    fn sid(s: &str) -> SandboxId {
        SandboxId::parse(s).unwrap()
    }

    fn spec(ns: &str, name: &str, uid: &str, attempt: u32) -> SandboxSpec {
        SandboxSpec {
            namespace: ns.into(),
            name: name.into(),
            uid: uid.into(),
            attempt,
            ..Default::default()
        }
    }

    fn open_tmp() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("state").join("cubelet.redb")).unwrap();
        (dir, store)
    }

    /// The store holds every pod's configuration: 0600, as containerd's
    /// `meta.db` (it was 0644), and an older 0644 file is tightened.
    #[test]
    fn the_store_file_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let (dir, store) = open_tmp();
        let path = dir.path().join("state").join("cubelet.redb");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        drop(store);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let store = Store::open(&path).unwrap();
        assert_eq!(mode(&path), 0o600);
        drop(store);
    }

    #[test]
    fn store_is_send_sync() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<Store>();
        assert_send_sync::<StoreError>();
    }

    #[test]
    fn open_creates_parent_dir_and_schema() {
        let (dir, store) = open_tmp();
        assert!(dir.path().join("state").join("cubelet.redb").is_file());
        assert_eq!(
            store.get_meta(META_SCHEMA).unwrap(),
            Some(SCHEMA_VERSION.to_string())
        );
        assert_eq!(store.verify().unwrap(), VerifyReport::default());
    }

    #[test]
    fn a_claimed_shell_becomes_its_sandbox_in_one_step() {
        let (_dir, store) = open_tmp();
        store.put_shell(&ShellRecord::new(sid("s1"))).unwrap();
        store.put_shell(&ShellRecord::new(sid("s2"))).unwrap();
        let ids = |v: Vec<ShellRecord>| v.into_iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(ids(store.list_shells().unwrap()), [sid("s1"), sid("s2")]);
        let rec = SandboxRecord::new(sid("s1"), spec("default", "web", "u1", 0));
        store.claim_shell(&rec).unwrap();
        assert_eq!(ids(store.list_shells().unwrap()), [sid("s2")]);
        assert_eq!(store.get_sandbox(&sid("s1")).unwrap(), Some(rec.clone()));
        // Found through the pod index like any sandbox.
        let found = store
            .find_sandbox_by_pod("default", "web", "u1", 0)
            .unwrap()
            .unwrap();
        assert_eq!(found.id, sid("s1"));
        assert_eq!(
            store.sandbox_and_shell_ids().unwrap(),
            [sid("s1"), sid("s2")]
        );
        assert!(store.delete_shell(&sid("s2")).unwrap());
        assert!(!store.delete_shell(&sid("s2")).unwrap());
        assert!(store.list_shells().unwrap().is_empty());
    }

    #[test]
    fn sandbox_crud_round_trip() {
        let (_dir, store) = open_tmp();
        let mut rec = SandboxRecord::new(sid("sb1"), spec("default", "web", "u1", 0));
        rec.network = Some(NetworkStatus {
            netns_path: Some("/run/netns/x".into()),
            ips: vec!["10.86.0.2".parse().unwrap()],
            interface: Some("eth0".into()),
            userns_path: None,
        });
        rec.spec.labels = BTreeMap::from([("app".to_owned(), "web".to_owned())]);
        store.put_sandbox(&rec).unwrap();
        assert_eq!(store.get_sandbox(&rec.id).unwrap(), Some(rec.clone()));

        let other = SandboxRecord::new(sid("sb0"), spec("default", "db", "u2", 0));
        store.put_sandbox(&other).unwrap();
        let ids: Vec<_> = store
            .list_sandboxes()
            .unwrap()
            .into_iter()
            .map(|r| r.id.to_string())
            .collect();
        assert_eq!(ids, ["sb0", "sb1"]);

        // put replaces
        rec.state = SandboxState::Ready;
        store.put_sandbox(&rec).unwrap();
        assert_eq!(
            store.get_sandbox(&rec.id).unwrap().unwrap().state,
            SandboxState::Ready
        );

        assert!(store.delete_sandbox(&rec.id).unwrap());
        assert!(
            !store.delete_sandbox(&rec.id).unwrap(),
            "delete is idempotent"
        );
        assert_eq!(store.get_sandbox(&rec.id).unwrap(), None);
        assert_eq!(store.list_sandboxes().unwrap().len(), 1);
    }

    #[test]
    fn a_buffered_sandbox_is_read_at_once_and_kept_by_the_next_durable_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cubelet.redb");
        let rec = SandboxRecord::new(sid("sb1"), spec("ns", "p", "u", 0));
        {
            let store = Store::open(&path).unwrap();
            store.put_sandbox_buffered(&rec).unwrap();
            assert_eq!(store.get_sandbox(&rec.id).unwrap(), Some(rec.clone()));
            store.set_meta("k", "v").unwrap();
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(store.get_sandbox(&rec.id).unwrap(), Some(rec));
    }

    #[test]
    fn a_buffered_container_delete_is_seen_at_once_and_kept_by_the_next_durable_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cubelet.redb");
        {
            let store = Store::open(&path).unwrap();
            let c = ContainerRecord::new("c1", sid("sb1"), "app", 0, "busybox");
            store.put_container(&c).unwrap();
            assert!(store.delete_container_buffered("c1").unwrap());
            assert_eq!(store.get_container("c1").unwrap(), None);
            assert!(store.list_containers_of(&sid("sb1")).unwrap().is_empty());
            assert!(!store.delete_container_buffered("c1").unwrap());
            store.set_meta("k", "v").unwrap();
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(store.get_container("c1").unwrap(), None);
        assert!(store.list_containers_of(&sid("sb1")).unwrap().is_empty());
    }

    #[test]
    fn a_buffered_lease_is_seen_at_once_and_kept_by_the_next_durable_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cubelet.redb");
        let l = lease("10.86.0.2", "sb1", "p");
        {
            let store = Store::open(&path).unwrap();
            store.add_lease_buffered(&l).unwrap();
            assert_eq!(store.list_leases("p").unwrap(), vec![l.clone()]);
            // Taken is taken, buffered or not.
            assert!(matches!(
                store.add_lease_buffered(&lease("10.86.0.2", "sb2", "p")),
                Err(StoreError::AlreadyLeased { .. })
            ));
            store.set_meta("k", "v").unwrap();
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(store.list_leases("p").unwrap(), vec![l]);
    }

    #[test]
    fn update_sandbox_changes_and_returns_record() {
        let (_dir, store) = open_tmp();
        let rec = SandboxRecord::new(sid("sb1"), spec("ns", "p", "u", 0));
        store.put_sandbox(&rec).unwrap();
        let now = SystemTime::now();
        let updated = store
            .update_sandbox(&rec.id, |r| {
                r.state = SandboxState::NotReady;
                r.stopped_at = Some(now);
                r.last_error = Some("boom".into());
            })
            .unwrap();
        assert_eq!(updated.state, SandboxState::NotReady);
        assert_eq!(store.get_sandbox(&rec.id).unwrap(), Some(updated));

        let err = store.update_sandbox(&sid("missing"), |_| {}).unwrap_err();
        assert!(err.is_not_found(), "{err}");
        assert!(store.get_sandbox(&sid("missing")).unwrap().is_none());
    }

    #[test]
    fn update_that_changes_id_writes_nothing() {
        let (_dir, store) = open_tmp();
        let rec = SandboxRecord::new(sid("sb1"), spec("ns", "p", "u", 0));
        store.put_sandbox(&rec).unwrap();
        let err = store
            .update_sandbox(&rec.id, |r| {
                r.id = sid("sb2");
                r.cleanup_attempts = 7;
            })
            .unwrap_err();
        assert!(matches!(err, StoreError::IdChanged { .. }), "{err}");
        assert_eq!(store.get_sandbox(&rec.id).unwrap(), Some(rec));
        assert!(store.get_sandbox(&sid("sb2")).unwrap().is_none());
    }

    #[test]
    fn concurrent_updates_lose_nothing() {
        let (_dir, store) = open_tmp();
        let store = Arc::new(store);
        let id = sid("sb1");
        store
            .put_sandbox(&SandboxRecord::new(id.clone(), SandboxSpec::default()))
            .unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = Arc::clone(&store);
                let id = id.clone();
                std::thread::spawn(move || {
                    for _ in 0..25 {
                        store
                            .update_sandbox(&id, |r| r.cleanup_attempts += 1)
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(
            store.get_sandbox(&id).unwrap().unwrap().cleanup_attempts,
            100
        );
    }

    #[test]
    fn find_sandbox_by_pod_and_by_name() {
        let (_dir, store) = open_tmp();
        let a = SandboxRecord::new(sid("a"), spec("ns", "web", "u1", 0));
        let b = SandboxRecord::new(sid("b"), spec("ns", "web", "u1", 1));
        let c = SandboxRecord::new(sid("c"), spec("other", "web", "u3", 0));
        for r in [&a, &b, &c] {
            store.put_sandbox(r).unwrap();
        }
        assert_eq!(
            store.find_sandbox_by_pod("ns", "web", "u1", 1).unwrap(),
            Some(b.clone())
        );
        assert_eq!(
            store.find_sandbox_by_pod("ns", "web", "u1", 0).unwrap(),
            Some(a.clone())
        );
        assert_eq!(
            store.find_sandbox_by_pod("ns", "web", "u2", 0).unwrap(),
            None
        );
        assert_eq!(store.find_sandbox_by_name("ns", "web", 0).unwrap(), Some(a));
        assert_eq!(
            store.find_sandbox_by_name("other", "web", 0).unwrap(),
            Some(c)
        );
        assert_eq!(store.find_sandbox_by_name("ns", "db", 0).unwrap(), None);

        // A newer sandbox of the same name wins.
        let mut d = SandboxRecord::new(sid("d"), spec("ns", "web", "u9", 0));
        d.created_at = SystemTime::now() + Duration::from_secs(5);
        store.put_sandbox(&d).unwrap();
        assert_eq!(store.find_sandbox_by_name("ns", "web", 0).unwrap(), Some(d));
    }

    #[test]
    fn indexes_follow_replace_update_and_delete() {
        let (_dir, store) = open_tmp();
        let mut a = SandboxRecord::new(sid("a"), spec("ns", "web", "u1", 0));
        store.put_sandbox(&a).unwrap();
        // Replaced under another name: found by the new one only.
        a.spec.name = "api".into();
        store.put_sandbox(&a).unwrap();
        assert_eq!(store.find_sandbox_by_name("ns", "web", 0).unwrap(), None);
        assert_eq!(
            store.find_sandbox_by_pod("ns", "api", "u1", 0).unwrap(),
            Some(a.clone())
        );
        // An update that moves the pod, then one that changes no key.
        store
            .update_sandbox(&a.id, |r| r.spec.namespace = "other".into())
            .unwrap();
        let moved = store
            .update_sandbox(&a.id, |r| r.state = SandboxState::Ready)
            .unwrap();
        assert_eq!(store.find_sandbox_by_name("ns", "api", 0).unwrap(), None);
        assert_eq!(
            store.find_sandbox_by_name("other", "api", 0).unwrap(),
            Some(moved.clone())
        );
        assert_eq!(
            store.find_sandbox_by_pod("other", "api", "u1", 0).unwrap(),
            Some(moved)
        );
        store.delete_sandbox(&a.id).unwrap();
        assert_eq!(store.find_sandbox_by_name("other", "api", 0).unwrap(), None);
        assert_eq!(
            store.find_sandbox_by_pod("other", "api", "u1", 0).unwrap(),
            None
        );

        let c = ContainerRecord::new("c1", sid("sb1"), "app", 0, "busybox");
        store.put_container(&c).unwrap();
        store
            .update_container("c1", |c| c.sandbox_id = sid("sb2"))
            .unwrap();
        assert!(store.list_containers_of(&sid("sb1")).unwrap().is_empty());
        assert_eq!(store.list_containers_of(&sid("sb2")).unwrap().len(), 1);
        store.delete_container("c1").unwrap();
        assert!(store.list_containers_of(&sid("sb2")).unwrap().is_empty());

        store.add_lease(&lease("10.86.0.2", "sb1", "p")).unwrap();
        store.add_lease(&lease("10.86.0.3", "sb1", "q")).unwrap();
        assert_eq!(
            store.release_leases_in("p", &sid("sb1")).unwrap(),
            vec!["10.86.0.2".parse::<IpAddr>().unwrap()]
        );
        assert!(store
            .release_leases_in("p", &sid("sb1"))
            .unwrap()
            .is_empty());
        assert_eq!(store.release_leases_of(&sid("sb1")).unwrap(), 1);
        assert!(store.list_all_leases().unwrap().is_empty());
    }

    /// Writes records the way the previous release did: the same tables
    /// and JSON, no index tables.
    fn write_without_indexes(path: &std::path::Path, flows: &[FlowRecord]) {
        let db = Database::create(path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn.open_table(META).unwrap();
            meta.insert(META_SCHEMA, SCHEMA_VERSION.to_string().as_str())
                .unwrap();
            meta.insert(META_LAST_FLOW, "7").unwrap();
            let mut sb = txn.open_table(SANDBOXES.def()).unwrap();
            for (id, name, uid) in [("a", "web", "u1"), ("b", "web", "u2"), ("c", "db", "u3")] {
                let rec = SandboxRecord::new(sid(id), spec("ns", name, uid, 0));
                let bytes = encode(SANDBOXES.name, id, &rec).unwrap();
                sb.insert(id, bytes.as_slice()).unwrap();
            }
            let mut cs = txn.open_table(CONTAINERS.def()).unwrap();
            for (id, sandbox) in [("c1", "a"), ("c2", "b"), ("c3", "a")] {
                let rec = ContainerRecord::new(id, sid(sandbox), id, 0, "busybox");
                let bytes = encode(CONTAINERS.name, id, &rec).unwrap();
                cs.insert(id, bytes.as_slice()).unwrap();
            }
            let mut ls = txn.open_table(LEASES.def()).unwrap();
            let l = lease("10.86.0.2", "a", "p");
            let key = IpLease::key(&l.pool, l.ip);
            ls.insert(
                key.as_str(),
                encode(LEASES.name, &key, &l).unwrap().as_slice(),
            )
            .unwrap();
            let mut fs = txn.open_table(FLOWS).unwrap();
            for f in flows {
                let bytes = encode(FLOWS_NAME, &f.id.to_string(), f).unwrap();
                fs.insert(f.id, bytes.as_slice()).unwrap();
            }
        }
        txn.commit().unwrap();
    }

    fn flow(id: u64, sandbox: &str) -> FlowRecord {
        FlowRecord {
            id,
            kind: cubelet_engine::FlowKind::Create,
            sandbox_id: sid(sandbox),
            spec: SandboxSpec::default(),
            compensates: None,
            started_at: SystemTime::UNIX_EPOCH,
            finished_at: None,
            state: cubelet_engine::FlowState::Running,
            error: None,
            steps: Vec::new(),
            attempts: 1,
        }
    }

    #[test]
    fn a_store_written_without_indexes_opens_and_finds_everything() {
        use cubelet_engine::Journal;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cubelet.redb");
        write_without_indexes(&path, &[flow(3, "a"), flow(5, "b"), flow(7, "a")]);
        {
            let db = Database::open(&path).unwrap();
            let txn = db.begin_read().unwrap();
            assert_eq!(txn.list_multimap_tables().unwrap().count(), 0);
        }

        let store = Store::open(&path).unwrap();
        let found = store.find_sandbox_by_pod("ns", "web", "u2", 0).unwrap();
        assert_eq!(found.map(|r| r.id), Some(sid("b")));
        assert!(store
            .find_sandbox_by_name("ns", "web", 0)
            .unwrap()
            .is_some());
        assert_eq!(
            store
                .find_sandbox_by_name("ns", "db", 0)
                .unwrap()
                .map(|r| r.id),
            Some(sid("c"))
        );
        let of_a: Vec<_> = store
            .list_containers_of(&sid("a"))
            .unwrap()
            .into_iter()
            .map(|c| c.id)
            .collect();
        assert_eq!(of_a, ["c1", "c3"]);
        let history: Vec<u64> = store
            .sandbox_history(&sid("a"))
            .unwrap()
            .iter()
            .map(|f| f.id)
            .collect();
        assert_eq!(history, [3, 7]);
        assert_eq!(store.forget(&sid("a")).unwrap(), 2);
        assert_eq!(store.list_flows().unwrap().len(), 1);
        assert_eq!(store.release_leases_of(&sid("a")).unwrap(), 1);
        // Writes go on from there, indexed.
        let d = SandboxRecord::new(sid("d"), spec("ns", "db", "u4", 1));
        store.put_sandbox(&d).unwrap();
        assert_eq!(
            store.find_sandbox_by_pod("ns", "db", "u4", 1).unwrap(),
            Some(d)
        );
    }

    #[test]
    fn records_an_older_build_wrote_after_this_one_are_indexed_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cubelet.redb");
        drop(Store::open(&path).unwrap());
        // An older build adds records without touching the index tables.
        write_without_indexes(&path, &[]);
        let store = Store::open(&path).unwrap();
        assert!(store
            .find_sandbox_by_pod("ns", "db", "u3", 0)
            .unwrap()
            .is_some());
        assert_eq!(store.list_containers_of(&sid("b")).unwrap().len(), 1);
    }

    #[test]
    fn an_index_entry_that_does_not_match_its_record_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cubelet.redb");
        let store = Store::open(&path).unwrap();
        store
            .put_sandbox(&SandboxRecord::new(sid("a"), spec("ns", "web", "u1", 0)))
            .unwrap();
        {
            let txn = store.db.begin_write().unwrap();
            let key = index::pod_key("ns", "db", "u1", 0);
            txn.open_multimap_table(index::SANDBOXES_BY_POD.def())
                .unwrap()
                .insert(key.as_str(), "a")
                .unwrap();
            txn.open_multimap_table(index::CONTAINERS_BY_SANDBOX.def())
                .unwrap()
                .insert("a", "gone")
                .unwrap();
            txn.commit().unwrap();
        }
        assert_eq!(
            store.find_sandbox_by_pod("ns", "db", "u1", 0).unwrap(),
            None
        );
        assert!(store.list_containers_of(&sid("a")).unwrap().is_empty());
    }

    #[test]
    fn container_crud_round_trip_and_list_by_sandbox() {
        let (_dir, store) = open_tmp();
        let mut c1 = ContainerRecord::new("c1", sid("sb1"), "app", 0, "busybox:latest");
        c1.labels.insert("l".into(), "v".into());
        c1.annotations.insert("a".into(), "b".into());
        c1.log_path = Some("/var/log/pods/x/app/0.log".into());
        c1.config = serde_json::json!({ "command": ["sleep", "1"] });
        let c2 = ContainerRecord::new("c2", sid("sb2"), "side", 1, "nginx");
        let c3 = ContainerRecord::new("c3", sid("sb1"), "init", 0, "busybox");
        for c in [&c1, &c2, &c3] {
            store.put_container(c).unwrap();
        }
        assert_eq!(store.get_container("c1").unwrap(), Some(c1.clone()));
        assert_eq!(store.list_containers().unwrap().len(), 3);
        let of_sb1: Vec<_> = store
            .list_containers_of(&sid("sb1"))
            .unwrap()
            .into_iter()
            .map(|c| c.id)
            .collect();
        assert_eq!(of_sb1, ["c1", "c3"]);

        let started = SystemTime::now();
        let updated = store
            .update_container("c1", |c| {
                c.state = ContainerState::Running;
                c.started_at = Some(started);
                c.pid = Some(42);
            })
            .unwrap();
        assert_eq!(store.get_container("c1").unwrap(), Some(updated));
        let err = store.update_container("nope", |_| {}).unwrap_err();
        assert!(
            matches!(err, StoreError::ContainerNotFound(ref id) if id == "nope"),
            "{err}"
        );

        assert!(store.delete_container("c1").unwrap());
        assert!(!store.delete_container("c1").unwrap());
        assert_eq!(store.get_container("c1").unwrap(), None);
    }

    fn lease(ip: &str, sb: &str, pool: &str) -> IpLease {
        IpLease {
            ip: ip.parse().unwrap(),
            sandbox_id: sid(sb),
            pool: pool.into(),
            allocated_at: SystemTime::now(),
        }
    }

    #[test]
    fn lease_conflicts_are_typed_and_release_is_by_sandbox() {
        let (_dir, store) = open_tmp();
        store
            .add_lease(&lease("10.86.0.2", "a", "cubelet0"))
            .unwrap();
        store
            .add_lease(&lease("10.86.0.3", "a", "cubelet0"))
            .unwrap();
        store.add_lease(&lease("fd00::2", "a", "v6")).unwrap();
        store
            .add_lease(&lease("10.86.0.4", "b", "cubelet0"))
            .unwrap();
        // Same address in another pool is another lease.
        store.add_lease(&lease("10.86.0.4", "c", "other")).unwrap();

        let err = store
            .add_lease(&lease("10.86.0.2", "b", "cubelet0"))
            .unwrap_err();
        match err {
            StoreError::AlreadyLeased { pool, ip, holder } => {
                assert_eq!(pool, "cubelet0");
                assert_eq!(ip, "10.86.0.2".parse::<IpAddr>().unwrap());
                assert_eq!(holder, sid("a"));
            }
            other => panic!("unexpected error {other}"),
        }
        // A retry by the holder succeeds and keeps the lease.
        store
            .add_lease(&lease("10.86.0.2", "a", "cubelet0"))
            .unwrap();

        assert_eq!(store.list_leases("cubelet0").unwrap().len(), 3);
        assert_eq!(store.list_leases("v6").unwrap().len(), 1);
        assert_eq!(store.list_all_leases().unwrap().len(), 5);

        assert_eq!(store.release_leases_of(&sid("a")).unwrap(), 3);
        assert_eq!(store.release_leases_of(&sid("a")).unwrap(), 0);
        let left: Vec<_> = store.list_leases("cubelet0").unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].sandbox_id, sid("b"));
        // Released addresses can be leased again.
        store
            .add_lease(&lease("10.86.0.2", "b", "cubelet0"))
            .unwrap();
        assert!(store
            .release_lease("cubelet0", "10.86.0.2".parse().unwrap())
            .unwrap());
        assert!(!store
            .release_lease("cubelet0", "10.86.0.2".parse().unwrap())
            .unwrap());
    }

    #[test]
    fn concurrent_lease_of_one_address_has_one_winner() {
        let (_dir, store) = open_tmp();
        let store = Arc::new(store);
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    store
                        .add_lease(&lease("10.86.0.9", &format!("sb{i}"), "p"))
                        .is_ok()
                })
            })
            .collect();
        let winners = threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .filter(|ok| *ok)
            .count();
        assert_eq!(winners, 1);
        assert_eq!(store.list_leases("p").unwrap().len(), 1);
    }

    #[test]
    fn meta_round_trip_and_reserved_keys() {
        let (_dir, store) = open_tmp();
        store.set_meta("node_name", "n1").unwrap();
        assert_eq!(store.get_meta("node_name").unwrap().as_deref(), Some("n1"));
        assert_eq!(store.get_meta("absent").unwrap(), None);
        let err = store.set_meta(META_SCHEMA, "2").unwrap_err();
        assert!(matches!(err, StoreError::ReservedMetaKey(_)), "{err}");
        assert_eq!(
            store.get_meta(META_SCHEMA).unwrap(),
            Some(SCHEMA_VERSION.to_string())
        );
    }

    #[test]
    fn reopen_keeps_everything() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cubelet.redb");
        let rec = SandboxRecord::new(sid("sb1"), spec("ns", "p", "u", 0));
        let c = ContainerRecord::new("c1", sid("sb1"), "app", 0, "busybox");
        let l = lease("10.86.0.2", "sb1", "p");
        {
            let store = Store::open(&path).unwrap();
            store.put_sandbox(&rec).unwrap();
            store.put_container(&c).unwrap();
            store.add_lease(&l).unwrap();
            store.set_meta("k", "v").unwrap();
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(store.get_sandbox(&rec.id).unwrap(), Some(rec));
        assert_eq!(store.get_container("c1").unwrap(), Some(c));
        assert_eq!(store.list_leases("p").unwrap(), vec![l]);
        assert_eq!(store.get_meta("k").unwrap().as_deref(), Some("v"));
        assert_eq!(
            store.verify().unwrap(),
            VerifyReport {
                sandboxes: 1,
                containers: 1,
                leases: 1,
                flows: 0
            }
        );
    }

    #[test]
    fn schema_mismatch_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cubelet.redb");
        drop(Store::open(&path).unwrap());
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(META)
                .unwrap()
                .insert(META_SCHEMA, "999")
                .unwrap();
            txn.commit().unwrap();
        }
        let err = Store::open(&path).unwrap_err();
        match &err {
            StoreError::SchemaMismatch {
                found, expected, ..
            } => {
                assert_eq!(found, "999");
                assert_eq!(*expected, SCHEMA_VERSION);
            }
            other => panic!("unexpected error {other}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains("schema version 999") && msg.contains("version 1"),
            "{msg}"
        );
    }

    #[test]
    fn undecodable_record_names_table_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cubelet.redb");
        drop(Store::open(&path).unwrap());
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(SANDBOXES.def())
                .unwrap()
                .insert("bad", b"{not json".as_slice())
                .unwrap();
            txn.commit().unwrap();
        }
        let store = Store::open(&path).unwrap();
        assert!(store.cache.sandboxes().is_none(), "the cache is off");
        let err = store.list_sandboxes_shared().unwrap_err();
        assert!(
            matches!(err, StoreError::Decode { table: "sandboxes", ref key, .. } if key == "bad"),
            "{err}"
        );
        let err = store.list_sandboxes().unwrap_err();
        assert!(
            matches!(err, StoreError::Decode { table: "sandboxes", ref key, .. } if key == "bad"),
            "{err}"
        );
    }

    /// The cached lists against the file's own scans.
    fn assert_cache_is_the_file(store: &Store) {
        let sandboxes: Vec<SandboxRecord> = store.scan(SANDBOXES, |_| true).unwrap();
        let containers: Vec<ContainerRecord> = store.scan(CONTAINERS, |_| true).unwrap();
        let shared =
            |v: Vec<Arc<SandboxRecord>>| v.into_iter().map(|r| (*r).clone()).collect::<Vec<_>>();
        assert_eq!(shared(store.list_sandboxes_shared().unwrap()), sandboxes);
        let shared =
            |v: Vec<Arc<ContainerRecord>>| v.into_iter().map(|r| (*r).clone()).collect::<Vec<_>>();
        assert_eq!(shared(store.list_containers_shared().unwrap()), containers);
    }

    #[test]
    fn the_lists_read_the_records_as_the_file_has_them() {
        let (dir, store) = open_tmp();
        let mut a = SandboxRecord::new(sid("a"), spec("ns", "web", "u1", 0));
        a.spec.cgroup_parent = Some("/kubepods/pod-a".into());
        store.put_sandbox(&a).unwrap();
        store
            .put_sandbox_buffered(&SandboxRecord::new(sid("b"), spec("ns", "db", "u2", 0)))
            .unwrap();
        assert_cache_is_the_file(&store);
        store
            .update_sandbox(&sid("a"), |r| r.state = SandboxState::Ready)
            .unwrap();
        // Failed updates change nothing.
        assert!(store.update_sandbox(&sid("zz"), |_| {}).is_err());
        assert!(store
            .update_sandbox(&sid("a"), |r| r.id = sid("moved"))
            .is_err());
        assert_cache_is_the_file(&store);

        let mut c = ContainerRecord::new("c1", sid("a"), "app", 0, "busybox");
        c.labels.insert("l".into(), "v".into());
        store.put_container(&c).unwrap();
        store
            .put_container(&ContainerRecord::new("c2", sid("b"), "db", 0, "busybox"))
            .unwrap();
        store
            .update_container("c1", |c| c.state = ContainerState::Running)
            .unwrap();
        assert!(store.update_container("nope", |_| {}).is_err());
        assert_cache_is_the_file(&store);

        store.put_shell(&ShellRecord::new(sid("s"))).unwrap();
        store
            .claim_shell(&SandboxRecord::new(sid("s"), spec("ns", "api", "u3", 0)))
            .unwrap();
        assert!(store.delete_container_buffered("c2").unwrap());
        assert!(store.delete_container("c1").unwrap());
        assert!(!store.delete_container("c1").unwrap());
        assert!(store.delete_sandbox(&sid("b")).unwrap());
        assert_cache_is_the_file(&store);
        assert_eq!(store.list_sandboxes().unwrap().len(), 2);

        // A reopened store loads what the file has.
        let path = store.path().to_owned();
        let before = store.list_sandboxes().unwrap();
        drop(store);
        let store = Store::open(&path).unwrap();
        assert!(store.cache.sandboxes().is_some(), "the cache is on");
        assert_eq!(store.list_sandboxes().unwrap(), before);
        assert_cache_is_the_file(&store);
        drop(dir);
    }

    #[test]
    fn concurrent_writers_leave_the_cache_as_the_file() {
        let (_dir, store) = open_tmp();
        let store = Arc::new(store);
        for i in 0..4 {
            store
                .put_container(&ContainerRecord::new(
                    format!("c{i}"),
                    sid("a"),
                    "app",
                    0,
                    "i",
                ))
                .unwrap();
        }
        let writers: Vec<_> = (0..4)
            .map(|t| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    for n in 0..40u32 {
                        // Every thread changes every record: the last
                        // commit of each must be what the cache keeps.
                        let id = format!("c{}", (t + n) % 4);
                        let _ = store.update_container(&id, |c| c.attempt = t * 100 + n);
                        if n.is_multiple_of(10) {
                            let extra = format!("x{t}-{n}");
                            store
                                .put_container(&ContainerRecord::new(&extra, sid("b"), "x", 0, "i"))
                                .unwrap();
                            store.delete_container_buffered(&extra).unwrap();
                        }
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        assert_cache_is_the_file(&store);
        assert_eq!(store.list_containers().unwrap().len(), 4);
    }

    #[test]
    fn second_open_of_same_file_fails_cleanly() {
        let (dir, _store) = open_tmp();
        let err = Store::open(&dir.path().join("state").join("cubelet.redb")).unwrap_err();
        assert!(matches!(err, StoreError::Open { .. }), "{err}");
    }
}
