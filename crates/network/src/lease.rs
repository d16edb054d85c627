//! Where address leases live: the [`LeaseStore`] trait the binary adapts the
//! node's database to, and [`MemLeases`], an in-memory store for tests.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;

use cubelet_engine::{BoxError, SandboxId};

/// Durable record of which sandbox holds which address of a pool.
///
/// Calls are synchronous and short; the provider calls them while holding its
/// allocation lock, never across an `.await`. The provider adds leases only
/// inside the journaled `create` and `prewarm` flows, so [`LeaseStore::add`]
/// may return before the lease is on disk, as long as it is there by the
/// store's next durable write: the flow's last journal write is one, and a
/// crash before it leaves the flow open for recovery, which tears the
/// sandbox's network down and would free the address anyway.
pub trait LeaseStore: Send + Sync + 'static {
    /// Records `ip` in `pool` for `sandbox`. Returns `false` if another sandbox
    /// already holds it; re-adding a lease the same sandbox holds returns `true`.
    fn add(&self, pool: &str, ip: IpAddr, sandbox: &SandboxId) -> Result<bool, BoxError>;

    /// Removes every lease of `sandbox` in `pool` and returns the addresses freed
    /// (empty when it held none).
    fn release_sandbox(&self, pool: &str, sandbox: &SandboxId) -> Result<Vec<IpAddr>, BoxError>;

    /// Every lease of `pool`.
    fn list(&self, pool: &str) -> Result<Vec<(IpAddr, SandboxId)>, BoxError>;
}

/// An in-memory [`LeaseStore`], for tests and for running without a database.
#[derive(Debug, Default)]
pub struct MemLeases {
    leases: Mutex<BTreeMap<(String, IpAddr), SandboxId>>,
}

impl MemLeases {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of leases across all pools.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no lease is held.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, IpAddr), SandboxId>> {
        // The map is never left half-updated: each operation is one insert or
        // retain, so a poisoned lock still guards consistent data.
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl LeaseStore for MemLeases {
    fn add(&self, pool: &str, ip: IpAddr, sandbox: &SandboxId) -> Result<bool, BoxError> {
        let mut map = self.lock();
        match map.get(&(pool.to_owned(), ip)) {
            Some(owner) => Ok(owner == sandbox),
            None => {
                map.insert((pool.to_owned(), ip), sandbox.clone());
                Ok(true)
            }
        }
    }

    fn release_sandbox(&self, pool: &str, sandbox: &SandboxId) -> Result<Vec<IpAddr>, BoxError> {
        let mut map = self.lock();
        let mut freed = Vec::new();
        map.retain(|(p, ip), owner| {
            let drop = p == pool && owner == sandbox;
            if drop {
                freed.push(*ip);
            }
            !drop
        });
        Ok(freed)
    }

    fn list(&self, pool: &str) -> Result<Vec<(IpAddr, SandboxId)>, BoxError> {
        Ok(self
            .lock()
            .iter()
            .filter(|((p, _), _)| p == pool)
            .map(|((_, ip), owner)| (*ip, owner.clone()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_release_list() {
        let s = MemLeases::new();
        let a = SandboxId::new_unchecked("a");
        let b = SandboxId::new_unchecked("b");
        let ip: IpAddr = "10.0.0.2".parse().unwrap();
        assert!(s.add("p", ip, &a).unwrap());
        assert!(s.add("p", ip, &a).unwrap(), "re-adding own lease is fine");
        assert!(!s.add("p", ip, &b).unwrap(), "taken by a");
        assert!(s.add("q", ip, &b).unwrap(), "pools are separate");
        assert_eq!(s.list("p").unwrap(), vec![(ip, a.clone())]);
        assert_eq!(s.release_sandbox("p", &a).unwrap(), vec![ip]);
        assert!(s.release_sandbox("p", &a).unwrap().is_empty());
        assert_eq!(s.len(), 1);
    }
}
