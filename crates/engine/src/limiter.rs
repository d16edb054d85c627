//! A non-blocking concurrency limiter whose limit can change at run time.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Counts flows in flight and refuses new ones past the limit, without waiting.
///
/// A plain semaphore cannot shrink while permits are out; this one can: a
/// lower limit takes effect for new admissions while flows already running
/// finish normally.
#[derive(Debug)]
pub struct Limiter {
    limit: AtomicUsize,
    inflight: AtomicUsize,
    peak: AtomicUsize,
    rejected: AtomicU64,
}

/// Counters of a [`Limiter`] at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimiterSnapshot {
    /// Current limit, `0` = unlimited.
    pub limit: usize,
    /// Flows in flight.
    pub inflight: usize,
    /// Highest in-flight count seen.
    pub peak: usize,
    /// Requests rejected since start.
    pub rejected: u64,
}

impl Limiter {
    /// A limiter admitting `limit` at once; `0` means unlimited.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit: AtomicUsize::new(limit),
            inflight: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            rejected: AtomicU64::new(0),
        })
    }

    /// Takes a permit if one is free, else counts a rejection and returns `None`.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Permit> {
        let limit = self.limit.load(Ordering::Acquire);
        let admitted = self
            .inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (limit == 0 || n < limit).then_some(n + 1)
            });
        match admitted {
            Ok(prev) => {
                self.peak.fetch_max(prev + 1, Ordering::Relaxed);
                Some(Permit {
                    limiter: Arc::clone(self),
                })
            }
            Err(_) => {
                self.rejected.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Takes a permit regardless of the limit (used for compensation, which
    /// must never be refused), still counting it as in flight.
    pub fn acquire_unchecked(self: &Arc<Self>) -> Permit {
        let prev = self.inflight.fetch_add(1, Ordering::AcqRel);
        self.peak.fetch_max(prev + 1, Ordering::Relaxed);
        Permit {
            limiter: Arc::clone(self),
        }
    }

    /// Changes the limit; `0` means unlimited.
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Release);
    }

    /// The current limit.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Acquire)
    }

    /// Current counters.
    pub fn snapshot(&self) -> LimiterSnapshot {
        LimiterSnapshot {
            limit: self.limit.load(Ordering::Acquire),
            inflight: self.inflight.load(Ordering::Acquire),
            peak: self.peak.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
        }
    }
}

/// An admitted flow; dropping it frees the slot.
#[derive(Debug)]
pub struct Permit {
    limiter: Arc<Limiter>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.limiter.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_limit_then_rejects() {
        let l = Limiter::new(2);
        let a = l.try_acquire().unwrap();
        let _b = l.try_acquire().unwrap();
        assert!(l.try_acquire().is_none());
        drop(a);
        let _c = l.try_acquire().unwrap();
        let s = l.snapshot();
        assert_eq!((s.inflight, s.peak, s.rejected), (2, 2, 1));
    }

    #[test]
    fn limit_changes_apply_to_new_admissions() {
        let l = Limiter::new(3);
        let held: Vec<_> = (0..3).map(|_| l.try_acquire().unwrap()).collect();
        l.set_limit(1);
        assert!(l.try_acquire().is_none());
        drop(held);
        let _one = l.try_acquire().unwrap();
        assert!(l.try_acquire().is_none());
        l.set_limit(0);
        let _many: Vec<_> = (0..100).map(|_| l.try_acquire().unwrap()).collect();
    }

    #[test]
    fn unchecked_ignores_limit() {
        let l = Limiter::new(1);
        let _a = l.try_acquire().unwrap();
        let _b = l.acquire_unchecked();
        assert_eq!(l.snapshot().inflight, 2);
    }
}
