//! Per-key async locks whose map forgets a key once nobody holds or waits
//! for it, so the map stays as small as the set of keys in use.

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

type Slot = Arc<tokio::sync::Mutex<()>>;

/// A map of async mutexes, one per key, created on first use.
pub struct KeyedLocks<K> {
    map: Mutex<HashMap<K, Slot>>,
}

impl<K> Default for KeyedLocks<K> {
    fn default() -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<K> fmt::Debug for KeyedLocks<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedLocks")
            .field("keys", &self.len())
            .finish()
    }
}

/// Holds the lock of one key; releasing it forgets every key nobody uses.
#[must_use = "the lock is released when the guard is dropped"]
pub struct KeyedGuard<'a, K: Eq + Hash> {
    locks: &'a KeyedLocks<K>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl<K: Eq + Hash> fmt::Debug for KeyedGuard<'_, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedGuard")
            .field("held", &self.guard.is_some())
            .finish()
    }
}

impl<K> KeyedLocks<K> {
    /// Keys currently in the map (held, waited for, or not yet swept).
    pub fn len(&self) -> usize {
        self.slots().len()
    }

    /// True when no key is in the map.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<K, Slot>> {
        // A poisoned map is still consistent: every update is one call.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<K: Eq + Hash + Clone> KeyedLocks<K> {
    /// Waits for the lock of `key`.
    pub async fn lock(&self, key: &K) -> KeyedGuard<'_, K> {
        let slot = Arc::clone(self.slots().entry(key.clone()).or_default());
        let guard = slot.lock_owned().await;
        KeyedGuard {
            locks: self,
            guard: Some(guard),
        }
    }
}

impl<K: Eq + Hash> Drop for KeyedGuard<'_, K> {
    fn drop(&mut self) {
        drop(self.guard.take());
        // Forget every slot only the map references: this one if nobody
        // waits, and any left by a waiter that was cancelled after the
        // holder had gone (it cannot clean up after itself). The map holds
        // only keys in use, so the sweep is short.
        self.locks
            .slots()
            .retain(|_, slot| Arc::strong_count(slot) > 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn one_holder_per_key_and_the_map_empties() {
        let locks = KeyedLocks::<String>::default();
        let a = locks.lock(&"a".to_owned()).await;
        let b = locks.lock(&"b".to_owned()).await;
        assert_eq!(locks.len(), 2);
        // A second lock of "a" waits.
        let key = "a".to_owned();
        let again = tokio::time::timeout(Duration::from_millis(50), locks.lock(&key));
        assert!(again.await.is_err());
        drop(a);
        drop(b);
        assert!(locks.is_empty());
    }

    #[tokio::test]
    async fn a_cancelled_waiter_leaves_nothing_behind() {
        let locks = Arc::new(KeyedLocks::<u32>::default());
        let held = locks.lock(&1).await;
        let l2 = Arc::clone(&locks);
        let waiter = tokio::spawn(async move {
            let _g = l2.lock(&1).await;
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        // The holder leaves first, then the waiter is cancelled before it
        // runs again: its slot is still referenced when the holder drops.
        drop(held);
        waiter.abort();
        let _ = waiter.await;
        // The next release anywhere sweeps it.
        drop(locks.lock(&2).await);
        assert!(locks.is_empty(), "{locks:?}");
    }
}
