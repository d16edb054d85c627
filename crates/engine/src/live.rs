//! What a garbage collector asks to learn which sandboxes exist.

use std::collections::HashSet;

use crate::spec::SandboxId;

/// The sandboxes that exist, read fresh on every call.
///
/// A sandbox's record is written before any of its objects is made, so a
/// collector that lists its objects first and asks [`now`](Self::now)
/// afterwards never takes an object of a sandbox still being created for
/// an orphan. A set read once before the listing would: a create that
/// starts in between makes objects the set does not know.
pub trait LiveSandboxes: Sync {
    /// The sandboxes that exist now; `None` when that cannot be read, and
    /// then the collector removes nothing.
    fn now(&self) -> Option<HashSet<SandboxId>>;
}

/// A fixed set (tests, and callers that know nothing can start meanwhile).
impl LiveSandboxes for HashSet<SandboxId> {
    fn now(&self) -> Option<HashSet<SandboxId>> {
        Some(self.clone())
    }
}
