//! [`Readiness`]: whether the node agent is ready to serve, and why not.

use std::fmt;
use std::sync::{Arc, RwLock};

/// A cloneable readiness flag with a reason when not ready; clones share
/// state. Served on `/readyz`.
#[derive(Clone)]
pub struct Readiness {
    /// `None` when ready, otherwise why not.
    state: Arc<RwLock<Option<String>>>,
}

impl Readiness {
    /// A handle that starts not ready, with reason `starting`.
    pub fn new() -> Self {
        Self {
            state: Arc::new(RwLock::new(Some("starting".to_owned()))),
        }
    }

    /// Marks the agent ready.
    pub fn set_ready(&self) {
        *self.write() = None;
    }

    /// Marks the agent not ready, saying why (served as the `/readyz` body).
    pub fn set_not_ready(&self, reason: impl Into<String>) {
        *self.write() = Some(reason.into());
    }

    /// Whether the agent is ready.
    pub fn is_ready(&self) -> bool {
        self.read().is_none()
    }

    /// Why the agent is not ready; `None` when it is ready.
    pub fn reason(&self) -> Option<String> {
        self.read().clone()
    }

    // The lock only guards a plain assignment or clone, which cannot leave
    // the value half-written, so a poisoned lock is still safe to use.
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Option<String>> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Option<String>> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }
}

impl Default for Readiness {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Readiness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.reason() {
            None => f.write_str("Readiness(ready)"),
            Some(reason) => write!(f, "Readiness(not ready: {reason})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_not_ready_and_clones_share_state() {
        let r = Readiness::new();
        assert!(!r.is_ready());
        assert_eq!(r.reason().as_deref(), Some("starting"));
        let other = r.clone();
        other.set_ready();
        assert!(r.is_ready());
        assert_eq!(r.reason(), None);
        r.set_not_ready("recovering");
        assert!(!other.is_ready());
        assert_eq!(other.reason().as_deref(), Some("recovering"));
        assert_eq!(format!("{other:?}"), "Readiness(not ready: recovering)");
    }
}
