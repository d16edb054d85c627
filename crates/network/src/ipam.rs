//! IPv4 address management over one subnet.
//!
//! The network address, the gateway (first host address, held by the bridge)
//! and the broadcast address are reserved. Allocation walks the pool from a
//! cursor so that a freed address is not handed out again at once. Every
//! lease is written through the [`LeaseStore`] with its sandbox id before it
//! is returned, and [`Ipam::load`] rebuilds the state from the store after a
//! restart. One mutex serialises allocations; the store is only called under
//! it, never across an `.await`.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, MutexGuard};

use cubelet_engine::SandboxId;
use ipnet::Ipv4Net;

use crate::error::NetworkError;
use crate::lease::LeaseStore;

/// Address allocator for one pool (one bridge's subnet).
pub struct Ipam {
    pool: String,
    subnet: Ipv4Net,
    store: Arc<dyn LeaseStore>,
    state: Mutex<State>,
}

impl std::fmt::Debug for Ipam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ipam")
            .field("pool", &self.pool)
            .field("subnet", &self.subnet)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct State {
    /// Leased addresses (as u32) and their holders.
    leases: BTreeMap<u32, SandboxId>,
    /// Offset into the host range where the next search starts.
    cursor: u32,
}

impl Ipam {
    /// An allocator for `subnet`, persisting leases in `store` under `pool`.
    /// The subnet needs room for at least one address besides the gateway
    /// (a /30 or larger).
    pub fn new(
        pool: impl Into<String>,
        subnet: Ipv4Net,
        store: Arc<dyn LeaseStore>,
    ) -> Result<Self, NetworkError> {
        let subnet = subnet.trunc();
        if subnet.prefix_len() > 30 {
            return Err(NetworkError::InvalidConfig {
                reason: format!("subnet {subnet} is too small, need a /30 or larger"),
            });
        }
        Ok(Self {
            pool: pool.into(),
            subnet,
            store,
            state: Mutex::default(),
        })
    }

    /// The pool's name in the lease store.
    pub fn pool(&self) -> &str {
        &self.pool
    }

    /// The subnet addresses come from.
    pub fn subnet(&self) -> Ipv4Net {
        self.subnet
    }

    /// The gateway: the subnet's first host address.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.subnet.network()) + 1)
    }

    /// First and last address that can be leased, as integers.
    fn range(&self) -> (u32, u32) {
        let net = u32::from(self.subnet.network());
        let bcast = u32::from(self.subnet.broadcast());
        (net + 2, bcast - 1)
    }

    /// Replaces the in-memory state with the leases recorded in the store.
    /// Leases outside the subnet (an old configuration) are ignored.
    pub fn load(&self) -> Result<usize, NetworkError> {
        let listed = self
            .store
            .list(&self.pool)
            .map_err(|source| NetworkError::LeaseStore {
                op: "list",
                pool: self.pool.clone(),
                source,
            })?;
        let (first, _) = self.range();
        let mut st = self.lock();
        st.leases.clear();
        for (ip, owner) in listed {
            if let IpAddr::V4(v4) = ip {
                if self.subnet.contains(&v4) {
                    st.leases.insert(u32::from(v4), owner);
                }
            }
        }
        // Continue after the highest lease, so restarts keep spreading.
        st.cursor = st
            .leases
            .keys()
            .next_back()
            .map_or(0, |ip| ip.saturating_sub(first) + 1);
        Ok(st.leases.len())
    }

    /// Leases an address to `sandbox`, or returns the one it already holds.
    pub fn allocate(&self, sandbox: &SandboxId) -> Result<Ipv4Addr, NetworkError> {
        let mut st = self.lock();
        if let Some((ip, _)) = st.leases.iter().find(|(_, owner)| *owner == sandbox) {
            return Ok(Ipv4Addr::from(*ip));
        }
        let (first, last) = self.range();
        let size = last - first + 1;
        for i in 0..size {
            let offset = (st.cursor + i) % size;
            let candidate = first + offset;
            if st.leases.contains_key(&candidate) {
                continue;
            }
            let ip = Ipv4Addr::from(candidate);
            let added = self
                .store
                .add(&self.pool, IpAddr::V4(ip), sandbox)
                .map_err(|source| NetworkError::LeaseStore {
                    op: "add",
                    pool: self.pool.clone(),
                    source,
                })?;
            if added {
                st.leases.insert(candidate, sandbox.clone());
                st.cursor = (offset + 1) % size;
                return Ok(ip);
            }
            // Someone else recorded it behind our back: learn who and move on.
            self.merge_from_store(&mut st)?;
        }
        Err(NetworkError::PoolExhausted {
            pool: self.pool.clone(),
            subnet: self.subnet,
        })
    }

    /// Frees every address `sandbox` holds. Releasing nothing is fine.
    pub fn release(&self, sandbox: &SandboxId) -> Result<Vec<Ipv4Addr>, NetworkError> {
        let mut st = self.lock();
        let freed = self
            .store
            .release_sandbox(&self.pool, sandbox)
            .map_err(|source| NetworkError::LeaseStore {
                op: "release",
                pool: self.pool.clone(),
                source,
            })?;
        st.leases.retain(|_, owner| owner != sandbox);
        Ok(freed
            .into_iter()
            .filter_map(|ip| match ip {
                IpAddr::V4(v4) => Some(v4),
                IpAddr::V6(_) => None,
            })
            .collect())
    }

    /// The address `sandbox` holds, if any.
    pub fn lookup(&self, sandbox: &SandboxId) -> Option<Ipv4Addr> {
        self.lock()
            .leases
            .iter()
            .find(|(_, owner)| *owner == sandbox)
            .map(|(ip, _)| Ipv4Addr::from(*ip))
    }

    /// A snapshot of every lease.
    pub fn leases(&self) -> Vec<(Ipv4Addr, SandboxId)> {
        self.lock()
            .leases
            .iter()
            .map(|(ip, s)| (Ipv4Addr::from(*ip), s.clone()))
            .collect()
    }

    fn merge_from_store(&self, st: &mut State) -> Result<(), NetworkError> {
        let listed = self
            .store
            .list(&self.pool)
            .map_err(|source| NetworkError::LeaseStore {
                op: "list",
                pool: self.pool.clone(),
                source,
            })?;
        for (ip, owner) in listed {
            if let IpAddr::V4(v4) = ip {
                if self.subnet.contains(&v4) {
                    st.leases.insert(u32::from(v4), owner);
                }
            }
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update leaves the map consistent (single insert/retain), so a
        // poisoned lock still guards valid state.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::lease::MemLeases;

    fn id(n: usize) -> SandboxId {
        SandboxId::new_unchecked(format!("sb{n}"))
    }

    fn ipam(subnet: &str, store: Arc<MemLeases>) -> Ipam {
        Ipam::new("test", subnet.parse().unwrap(), store).unwrap()
    }

    #[test]
    fn allocates_after_gateway_and_is_idempotent() {
        let store = Arc::new(MemLeases::new());
        let ipam = ipam("10.1.0.0/24", store.clone());
        assert_eq!(ipam.gateway(), Ipv4Addr::new(10, 1, 0, 1));
        let a = ipam.allocate(&id(1)).unwrap();
        assert_eq!(a, Ipv4Addr::new(10, 1, 0, 2));
        assert_eq!(
            ipam.allocate(&id(1)).unwrap(),
            a,
            "same sandbox, same lease"
        );
        let b = ipam.allocate(&id(2)).unwrap();
        assert_eq!(b, Ipv4Addr::new(10, 1, 0, 3));
        assert_eq!(store.list("test").unwrap().len(), 2);
        assert_eq!(ipam.lookup(&id(2)), Some(b));
    }

    #[test]
    fn release_frees_and_cursor_moves_on() {
        let store = Arc::new(MemLeases::new());
        let ipam = ipam("10.1.0.0/24", store.clone());
        let a = ipam.allocate(&id(1)).unwrap();
        assert_eq!(ipam.release(&id(1)).unwrap(), vec![a]);
        assert!(
            ipam.release(&id(1)).unwrap().is_empty(),
            "second release is a no-op"
        );
        assert!(store.is_empty());
        assert_eq!(ipam.lookup(&id(1)), None);
        let b = ipam.allocate(&id(2)).unwrap();
        assert_ne!(a, b, "a freed address is not reused at once");
    }

    #[test]
    fn exhaustion_on_a_29_is_a_typed_error() {
        let store = Arc::new(MemLeases::new());
        let ipam = ipam("10.2.0.0/29", store);
        let got: Vec<_> = (0..5).map(|n| ipam.allocate(&id(n)).unwrap()).collect();
        let expect: Vec<_> = (2..=6).map(|h| Ipv4Addr::new(10, 2, 0, h)).collect();
        assert_eq!(got, expect, "network, gateway and broadcast are reserved");
        let err = ipam.allocate(&id(99)).unwrap_err();
        assert!(matches!(err, NetworkError::PoolExhausted { .. }), "{err}");
        assert_eq!(err.kind(), cubelet_engine::StepErrorKind::ResourceExhausted);
        ipam.release(&id(3)).unwrap();
        assert_eq!(ipam.allocate(&id(99)).unwrap(), Ipv4Addr::new(10, 2, 0, 5));
    }

    #[test]
    fn tiny_subnets_are_rejected() {
        let store: Arc<dyn LeaseStore> = Arc::new(MemLeases::new());
        let err = Ipam::new("p", "10.0.0.0/31".parse().unwrap(), store).unwrap_err();
        assert!(err.to_string().contains("too small"), "{err}");
    }

    #[test]
    fn recovers_from_store() {
        let store = Arc::new(MemLeases::new());
        store
            .add("test", "10.3.0.2".parse().unwrap(), &id(1))
            .unwrap();
        store
            .add("test", "10.3.0.4".parse().unwrap(), &id(2))
            .unwrap();
        store
            .add("test", "192.168.0.9".parse().unwrap(), &id(3))
            .unwrap();
        store
            .add("other", "10.3.0.3".parse().unwrap(), &id(4))
            .unwrap();
        let ipam = ipam("10.3.0.0/24", store.clone());
        assert_eq!(ipam.load().unwrap(), 2, "foreign subnet and pool ignored");
        assert_eq!(ipam.lookup(&id(2)), Some(Ipv4Addr::new(10, 3, 0, 4)));
        let next = ipam.allocate(&id(5)).unwrap();
        assert_eq!(
            next,
            Ipv4Addr::new(10, 3, 0, 5),
            "continues after the highest lease"
        );
        assert_eq!(ipam.leases().len(), 3);
    }

    #[test]
    fn store_conflict_is_skipped() {
        let store = Arc::new(MemLeases::new());
        let ipam = ipam("10.4.0.0/24", store.clone());
        // Recorded after load, e.g. by another writer.
        store
            .add("test", "10.4.0.2".parse().unwrap(), &id(7))
            .unwrap();
        assert_eq!(ipam.allocate(&id(1)).unwrap(), Ipv4Addr::new(10, 4, 0, 3));
        assert_eq!(ipam.lookup(&id(7)), Some(Ipv4Addr::new(10, 4, 0, 2)));
    }

    #[test]
    fn no_double_allocation_under_concurrency() {
        let store = Arc::new(MemLeases::new());
        let ipam = Arc::new(ipam("10.5.0.0/24", store.clone()));
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let ipam = Arc::clone(&ipam);
                std::thread::spawn(move || {
                    (0..30)
                        .map(|n| ipam.allocate(&id(t * 100 + n)).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all = HashSet::new();
        for h in handles {
            for ip in h.join().unwrap() {
                assert!(all.insert(ip), "{ip} handed out twice");
            }
        }
        assert_eq!(all.len(), 240);
        assert_eq!(store.len(), 240);
        // 253 usable in a /24: 13 left, then exhaustion.
        for n in 0..13 {
            ipam.allocate(&id(10_000 + n)).unwrap();
        }
        assert!(ipam.allocate(&id(20_000)).is_err());
    }
}
