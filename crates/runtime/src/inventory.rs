//! What the agent's containerd namespace holds, for the garbage collector:
//! containers, tasks and writable snapshots, each keyed by the container id
//! it belongs to, plus extraction snapshots a crashed pull left behind.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::services::v1::snapshots::{Kind, ListSnapshotsRequest};
use containerd_client::services::v1::{ListContainersRequest, ListTasksRequest};
use futures::TryStreamExt;

use crate::container::ContainerRuntime;
use crate::error::RuntimeError;

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
}

/// Sorts one snapshot into `inv` (pure, for tests).
fn classify(
    inv: &mut Inventory,
    key: String,
    kind: i32,
    updated: Option<SystemTime>,
    now: SystemTime,
) {
    if kind != Kind::Active as i32 {
        return; // image layers (committed) and views are not per-container
    }
    if key.starts_with(EXTRACT_PREFIX) {
        let age = updated.and_then(|t| now.duration_since(t).ok());
        if age.is_some_and(|a| a >= STALE_EXTRACT_AGE) {
            inv.stale_extracts.insert(key);
        }
    } else {
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
            inv.containers.extend(msg.container.map(|c| c.id));
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
                classify(&mut inv, info.name, info.kind, updated, now);
            }
        }
        Ok(inv)
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
        let mut inv = Inventory::default();
        classify(
            &mut inv,
            "sha256:layer".into(),
            Kind::Committed as i32,
            old,
            now,
        );
        classify(&mut inv, "view".into(), Kind::View as i32, old, now);
        classify(&mut inv, "abc".into(), Kind::Active as i32, fresh, now);
        classify(
            &mut inv,
            "extract-1-x".into(),
            Kind::Active as i32,
            old,
            now,
        );
        classify(
            &mut inv,
            "extract-2-y".into(),
            Kind::Active as i32,
            fresh,
            now,
        );
        classify(
            &mut inv,
            "extract-3-z".into(),
            Kind::Active as i32,
            None,
            now,
        );
        assert_eq!(inv.snapshots, BTreeSet::from(["abc".to_owned()]));
        assert_eq!(
            inv.stale_extracts,
            BTreeSet::from(["extract-1-x".to_owned()])
        );
        inv.containers.insert("c".into());
        inv.tasks.insert("c".into());
        assert_eq!(inv.ids(), BTreeSet::from(["abc", "c"]));
    }
}
