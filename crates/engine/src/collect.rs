//! What the garbage collector asks of every provider, and what it gets
//! back; and the helper that keeps blocking work off the async workers.

use std::collections::BTreeMap;
use std::error::Error as StdError;

use async_trait::async_trait;

use crate::error::chain;
use crate::live::LiveSandboxes;

/// What one collector reclaimed in a pass, by kind (`netns`, `veth`,
/// `directory`, ...), and what it could not.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Objects reclaimed, by kind.
    pub reclaimed: BTreeMap<&'static str, u64>,
    /// Failures by kind, with the error each gave; the pass went on past them.
    pub failures: Vec<(&'static str, String)>,
}

impl GcReport {
    /// Counts `n` reclaimed objects of `kind` (zero counts are left out).
    pub fn add(&mut self, kind: &'static str, n: usize) {
        if n > 0 {
            *self.reclaimed.entry(kind).or_default() += u64::try_from(n).unwrap_or(u64::MAX);
        }
    }

    /// Records a failure of `kind`.
    pub fn fail(&mut self, kind: &'static str, error: &dyn StdError) {
        self.failures.push((kind, chain(error)));
    }

    /// Adds another report's counts and failures to this one.
    pub fn merge(&mut self, other: GcReport) {
        for (kind, n) in other.reclaimed {
            *self.reclaimed.entry(kind).or_default() += n;
        }
        self.failures.extend(other.failures);
    }

    /// Failures by kind.
    pub fn failure_counts(&self) -> BTreeMap<&'static str, u64> {
        let mut counts = BTreeMap::new();
        for (kind, _) in &self.failures {
            *counts.entry(*kind).or_default() += 1;
        }
        counts
    }
}

/// A provider's part of the garbage collector: reclaims what it holds for
/// sandboxes that no longer exist. It lists its objects first and asks
/// `live` afterwards (see [`LiveSandboxes`]), and removes nothing once
/// `live` cannot be read.
#[async_trait]
pub trait Collector: Send + Sync {
    /// The collector's name, for logs.
    fn name(&self) -> &'static str;

    /// One pass.
    async fn collect(&self, live: &dyn LiveSandboxes) -> GcReport;
}

/// Runs blocking work (an fsync, an umount, a tree removal) without
/// stalling the other tasks of a multi-threaded runtime's worker: on the
/// same thread, so it keeps that thread's namespaces; on a current-thread
/// runtime (tests) it just runs.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_add_merge_and_count() {
        let mut a = GcReport::default();
        a.add("netns", 2);
        a.add("veth", 0);
        let mut b = GcReport::default();
        b.add("netns", 1);
        b.fail("network", &std::io::Error::other("busy"));
        a.merge(b);
        assert_eq!(a.reclaimed.get("netns"), Some(&3));
        assert!(!a.reclaimed.contains_key("veth"));
        assert_eq!(a.failure_counts().get("network"), Some(&1));
        assert_eq!(a.failures[0].1, "busy");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blocking_work_runs_on_the_calling_thread() {
        let here = std::thread::current().id();
        assert_eq!(blocking(|| std::thread::current().id()), here);
    }
}
