//! What the agent's containerd namespace holds, for the garbage collector:
//! containers, tasks and writable snapshots, each keyed by the container id
//! it belongs to, plus extraction snapshots a crashed pull left behind; and
//! which of them carry Cubelet's owner mark ([`crate::reclaim::owner`]): the GC
//! removes only those.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::services::v1::snapshots::{
    Info as SnapshotInfo, Kind, ListSnapshotsRequest, UpdateSnapshotRequest,
};
use containerd_client::services::v1::{
    Container, ListContainersRequest, ListTasksRequest, UpdateContainerRequest,
};
use futures::TryStreamExt;

use crate::container::ContainerRuntime;
use crate::error::RuntimeError;
use crate::reclaim::owner::{is_marked, owner_labels, OWNER_LABEL};

/// Prefix of the keys of the snapshots an image unpack writes into.
pub const EXTRACT_PREFIX: &str = "extract-";

/// An extraction snapshot untouched this long belongs to a pull that died.
pub const STALE_EXTRACT_AGE: Duration = Duration::from_secs(3600);

/// Containerd objects in the agent's namespace.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Inventory {
    /// Ids of container records.
    pub containers: BTreeSet<String>,
    /// Container ids that have a task.
    pub tasks: BTreeSet<String>,
    /// Keys of writable (active) snapshots that are container rootfs, i.e.
    /// everything active but unpack scratch space.
    pub snapshots: BTreeSet<String>,
    /// Keys of extraction snapshots older than [`STALE_EXTRACT_AGE`].
    pub stale_extracts: BTreeSet<String>,
    /// Container ids with recursive read-only mounts staged on the node.
    pub staged: BTreeSet<String>,
    /// The ids in `containers` whose record carries the owner mark.
    pub marked_containers: BTreeSet<String>,
    /// The keys in `snapshots` whose snapshot carries the owner mark.
    pub marked_snapshots: BTreeSet<String>,
}

impl Inventory {
    /// Every container id some object belongs to.
    pub fn ids(&self) -> BTreeSet<&str> {
        self.containers
            .iter()
            .chain(&self.tasks)
            .chain(&self.snapshots)
            .chain(&self.staged)
            .map(String::as_str)
            .collect()
    }

    /// Whether the objects of container `id` are Cubelet's, by the owner
    /// mark: its container record's when it has one (its task and its
    /// rootfs snapshot, keyed by its id, go with it), else its snapshot's.
    /// Mounts staged under the runtime's own directory are always its own;
    /// a task without a record cannot be told, and is not.
    pub fn owned(&self, id: &str) -> bool {
        if self.containers.contains(id) {
            self.marked_containers.contains(id)
        } else if self.snapshots.contains(id) {
            self.marked_snapshots.contains(id)
        } else {
            self.staged.contains(id)
        }
    }

    /// The ids of `known` whose container record or rootfs snapshot lacks
    /// the owner mark: (container ids, snapshot keys) to adopt.
    pub fn unmarked<'a>(
        &self,
        known: impl IntoIterator<Item = &'a str>,
    ) -> (Vec<String>, Vec<String>) {
        let mut containers = Vec::new();
        let mut snapshots = Vec::new();
        for id in known {
            if self.containers.contains(id) && !self.marked_containers.contains(id) {
                containers.push(id.to_owned());
            }
            if self.snapshots.contains(id) && !self.marked_snapshots.contains(id) {
                snapshots.push(id.to_owned());
            }
        }
        (containers, snapshots)
    }
}

/// Sorts one snapshot into `inv` (pure, for tests). A stale extraction
/// snapshot counts only with the owner mark: another client's unpack is
/// not Cubelet's to remove.
fn classify(
    inv: &mut Inventory,
    key: String,
    kind: i32,
    labels: &HashMap<String, String>,
    updated: Option<SystemTime>,
    now: SystemTime,
) {
    if kind != Kind::Active as i32 {
        return; // image layers (committed) and views are not per-container
    }
    let marked = is_marked(labels);
    if key.starts_with(EXTRACT_PREFIX) {
        let age = updated.and_then(|t| now.duration_since(t).ok());
        if marked && age.is_some_and(|a| a >= STALE_EXTRACT_AGE) {
            inv.stale_extracts.insert(key);
        }
    } else {
        if marked {
            inv.marked_snapshots.insert(key.clone());
        }
        inv.snapshots.insert(key);
    }
}

impl ContainerRuntime {
    /// Lists the containers, tasks and active snapshots of the agent's
    /// namespace.
    pub async fn inventory(&self) -> Result<Inventory, RuntimeError> {
        let client = self.client();
        let mut inv = Inventory::default();
        inv.staged
            .extend(crate::staged::staged_ids(&self.staged_root()));
        // One container per message: `containers.list` answers with every
        // container's record (its OCI spec included) in one message, ~4 MiB
        // of heap at once for 500 containers, to keep only the ids.
        let mut containers = client
            .containers()
            .list_stream(client.request(ListContainersRequest::default()))
            .await
            .map_err(|s| RuntimeError::containerd("containers.list_stream", s))?
            .into_inner();
        while let Some(msg) = containers
            .try_next()
            .await
            .map_err(|s| RuntimeError::containerd("containers.list_stream", s))?
        {
            if let Some(c) = msg.container {
                if is_marked(&c.labels) {
                    inv.marked_containers.insert(c.id.clone());
                }
                inv.containers.insert(c.id);
            }
        }
        let tasks = client
            .tasks()
            .list(client.request(ListTasksRequest::default()))
            .await
            .map_err(|s| RuntimeError::containerd("tasks.list", s))?;
        inv.tasks
            .extend(tasks.into_inner().tasks.into_iter().map(|p| p.id));
        let mut stream = client
            .snapshots()
            .list(client.request(ListSnapshotsRequest {
                snapshotter: self.config().snapshotter.clone(),
                filters: Vec::new(),
            }))
            .await
            .map_err(|s| RuntimeError::containerd("snapshots.list", s))?
            .into_inner();
        let now = SystemTime::now();
        while let Some(page) = stream
            .try_next()
            .await
            .map_err(|s| RuntimeError::containerd("snapshots.list", s))?
        {
            for info in page.info {
                let updated = info.updated_at.as_ref().and_then(timestamp);
                classify(&mut inv, info.name, info.kind, &info.labels, updated, now);
            }
        }
        Ok(inv)
    }

    /// Puts the owner mark on container record `id` (an unmarked one the
    /// store knows, made before the mark existed). Idempotent; a record
    /// that is gone is fine.
    pub async fn adopt_container(&self, id: &str) -> Result<(), RuntimeError> {
        let client = self.client();
        let update = Container {
            id: id.to_owned(),
            labels: owner_labels(),
            ..Default::default()
        };
        match client
            .containers()
            .update(client.request(UpdateContainerRequest {
                container: Some(update),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec![format!("labels.{OWNER_LABEL}")],
                }),
            }))
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
            Err(s) => Err(RuntimeError::containerd("containers.update", s)),
        }
    }

    /// Puts the owner mark on snapshot `key` of the agent's snapshotter
    /// (see [`Self::adopt_container`]). Idempotent.
    pub async fn adopt_snapshot(&self, key: &str) -> Result<(), RuntimeError> {
        let client = self.client();
        let info = SnapshotInfo {
            name: key.to_owned(),
            labels: owner_labels(),
            ..Default::default()
        };
        match client
            .snapshots()
            .update(client.request(UpdateSnapshotRequest {
                snapshotter: self.config().snapshotter.clone(),
                info: Some(info),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec![format!("labels.{OWNER_LABEL}")],
                }),
            }))
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
            Err(s) => Err(RuntimeError::containerd("snapshots.update", s)),
        }
    }

    /// Removes the extraction snapshot `key` (of a pull that died).
    /// Idempotent.
    pub async fn remove_extract_snapshot(&self, key: &str) -> Result<(), RuntimeError> {
        if !key.starts_with(EXTRACT_PREFIX) {
            return Err(RuntimeError::InvalidArgument {
                field: "key".to_owned(),
                reason: format!("{key:?} is not an extraction snapshot"),
            });
        }
        self.remove_snapshot(key).await
    }
}

fn timestamp(ts: &prost_types::Timestamp) -> Option<SystemTime> {
    let secs = u64::try_from(ts.seconds).ok()?;
    let nanos = u32::try_from(ts.nanos).ok()?;
    Some(UNIX_EPOCH + Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_snapshots_by_kind_and_age() {
        let now = UNIX_EPOCH + Duration::from_secs(10_000);
        let old = Some(now - STALE_EXTRACT_AGE);
        let fresh = Some(now - Duration::from_secs(5));
        let m = owner_labels();
        let mut inv = Inventory::default();
        let active = Kind::Active as i32;
        classify(
            &mut inv,
            "sha256:layer".into(),
            Kind::Committed as i32,
            &m,
            old,
            now,
        );
        classify(&mut inv, "view".into(), Kind::View as i32, &m, old, now);
        classify(&mut inv, "abc".into(), active, &m, fresh, now);
        classify(&mut inv, "extract-1-x".into(), active, &m, old, now);
        classify(&mut inv, "extract-2-y".into(), active, &m, fresh, now);
        classify(&mut inv, "extract-3-z".into(), active, &m, None, now);
        // Another client's stale unpack: not Cubelet's.
        let none = HashMap::new();
        classify(&mut inv, "extract-4-w".into(), active, &none, old, now);
        assert_eq!(inv.snapshots, BTreeSet::from(["abc".to_owned()]));
        assert_eq!(
            inv.stale_extracts,
            BTreeSet::from(["extract-1-x".to_owned()])
        );
        inv.containers.insert("c".into());
        inv.tasks.insert("c".into());
        assert_eq!(inv.ids(), BTreeSet::from(["abc", "c"]));
    }

    #[test]
    fn only_marked_objects_are_owned_and_unmarked_known_ones_are_adopted() {
        let now = UNIX_EPOCH + Duration::from_secs(10_000);
        let m = owner_labels();
        let none = HashMap::new();
        let active = Kind::Active as i32;
        let mut inv = Inventory::default();
        // "ours": marked record and snapshot. "ctr": a record without the
        // mark (its snapshot marked or not, the record decides). "snap": a
        // marked snapshot without a record. "bare": an unmarked snapshot.
        // "staged": only mounts under the runtime's own directory.
        for (id, marked) in [("ours", true), ("ctr", false)] {
            inv.containers.insert(id.into());
            if marked {
                inv.marked_containers.insert(id.into());
            }
        }
        inv.tasks.insert("ctr".into());
        classify(&mut inv, "ours".into(), active, &m, None, now);
        classify(&mut inv, "ctr".into(), active, &m, None, now);
        classify(&mut inv, "snap".into(), active, &m, None, now);
        classify(&mut inv, "bare".into(), active, &none, None, now);
        inv.staged.insert("staged".into());
        inv.tasks.insert("taskonly".into());
        let owned: Vec<&str> = inv.ids().into_iter().filter(|id| inv.owned(id)).collect();
        assert_eq!(owned, ["ours", "snap", "staged"]);
        let (containers, snapshots) = inv.unmarked(["ours", "ctr", "bare", "gone"]);
        assert_eq!(containers, ["ctr"]);
        assert_eq!(snapshots, ["bare"]);
    }
}
