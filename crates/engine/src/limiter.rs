//! A concurrency limiter whose limit can change at run time, with a bounded
//! wait for a free slot.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// Counts flows in flight and refuses new ones past the limit, at once or
/// after a bounded wait ([`Limiter::acquire_within`]).
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
    /// Callers waiting for a slot in [`Limiter::acquire_within`].
    waiting: AtomicUsize,
    /// Woken when a slot frees or the limit changes.
    released: Notify,
}

/// How a bounded wait for a slot ended: the permit and how long it waited,
/// or a rejection after `waited`.
pub type WaitOutcome = Result<(Permit, Duration), Duration>;

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
            waiting: AtomicUsize::new(0),
            released: Notify::new(),
        })
    }

    /// Takes a permit if one is free, else counts a rejection and returns `None`.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Permit> {
        let permit = self.try_take();
        if permit.is_none() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
        }
        permit
    }

    /// Takes a permit, waiting at most `wait` for a slot to free. A zero
    /// `wait` is [`Limiter::try_acquire`]. At most as many callers wait as
    /// the limit admits at once (one when unlimited, where nobody waits
    /// anyway): a caller beyond them is refused at once, so a flood of
    /// requests cannot pile up waiting tasks. A refusal is counted as a
    /// rejection.
    pub async fn acquire_within(self: &Arc<Self>, wait: Duration) -> WaitOutcome {
        if let Some(permit) = self.try_take() {
            return Ok((permit, Duration::ZERO));
        }
        let queue = self.limit().max(1);
        if wait.is_zero() || self.waiting.fetch_add(1, Ordering::AcqRel) >= queue {
            if !wait.is_zero() {
                self.waiting.fetch_sub(1, Ordering::AcqRel);
            }
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(Duration::ZERO);
        }
        let _queued = Queued(self);
        let start = Instant::now();
        let deadline = start + wait;
        loop {
            // Registered before the check, so a release between the check
            // and the wait still wakes this caller.
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if let Some(permit) = self.try_take() {
                return Ok((permit, start.elapsed()));
            }
            if tokio::time::timeout_at(deadline, released).await.is_err() {
                return match self.try_take() {
                    Some(permit) => Ok((permit, start.elapsed())),
                    None => {
                        self.rejected.fetch_add(1, Ordering::Relaxed);
                        Err(start.elapsed())
                    }
                };
            }
        }
    }

    /// Takes a permit if one is free, counting nothing otherwise.
    fn try_take(self: &Arc<Self>) -> Option<Permit> {
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
            Err(_) => None,
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
        self.released.notify_waiters();
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
        if self.limiter.waiting.load(Ordering::Acquire) > 0 {
            self.limiter.released.notify_waiters();
        }
    }
}

/// A caller's place among the waiters; given back however the wait ends,
/// the caller's future dropped included.
struct Queued<'a>(&'a Limiter);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
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

    #[tokio::test(start_paused = true)]
    async fn a_wait_takes_the_slot_a_finished_flow_frees() {
        let l = Limiter::new(1);
        let held = l.try_acquire().unwrap();
        let waiter = {
            let l = Arc::clone(&l);
            tokio::spawn(async move { l.acquire_within(Duration::from_millis(500)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(held);
        let (_permit, waited) = waiter.await.unwrap().unwrap();
        assert!(waited >= Duration::from_millis(100) && waited < Duration::from_millis(500));
        assert_eq!(l.snapshot().rejected, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_runs_out_is_a_rejection() {
        let l = Limiter::new(1);
        let _held = l.try_acquire().unwrap();
        let waited = l
            .acquire_within(Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(waited, Duration::from_millis(300));
        let s = l.snapshot();
        assert_eq!((s.inflight, s.rejected), (1, 1));
        assert_eq!(l.waiting.load(Ordering::Acquire), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn no_wait_or_a_full_queue_rejects_at_once() {
        let l = Limiter::new(1);
        let held = l.try_acquire().unwrap();
        assert_eq!(
            l.acquire_within(Duration::ZERO).await.unwrap_err(),
            Duration::ZERO
        );
        // One waiter fills the queue of a limit of one; the next is refused
        // at once, without waiting.
        let first = {
            let l = Arc::clone(&l);
            tokio::spawn(async move { l.acquire_within(Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        let started = Instant::now();
        assert_eq!(
            l.acquire_within(Duration::from_secs(5)).await.unwrap_err(),
            Duration::ZERO
        );
        assert_eq!(started.elapsed(), Duration::ZERO);
        drop(held);
        assert!(first.await.unwrap().is_ok());
        assert_eq!(l.snapshot().rejected, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_raised_limit_admits_a_waiter() {
        let l = Limiter::new(1);
        let _held = l.try_acquire().unwrap();
        let waiter = {
            let l = Arc::clone(&l);
            tokio::spawn(async move { l.acquire_within(Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        l.set_limit(2);
        let (_permit, waited) = waiter.await.unwrap().unwrap();
        assert_eq!(waited, Duration::from_millis(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_waiter_gives_its_place_back() {
        let l = Limiter::new(1);
        let _held = l.try_acquire().unwrap();
        let waiter = {
            let l = Arc::clone(&l);
            tokio::spawn(async move { l.acquire_within(Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        assert_eq!(l.waiting.load(Ordering::Acquire), 1);
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(l.waiting.load(Ordering::Acquire), 0);
    }

    #[test]
    fn unchecked_ignores_limit() {
        let l = Limiter::new(1);
        let _a = l.try_acquire().unwrap();
        let _b = l.acquire_unchecked();
        assert_eq!(l.snapshot().inflight, 2);
    }
}
