//! The frame all three providers run their create in, so that the rules
//! around a provider's own work are written once:
//!
//! - a host-network pod gets the node's status and nothing is built;
//! - the sandbox counts as in flight until the create returns, so the
//!   provider's GC keeps off its half-built network even when it is given a
//!   fixed set of live sandboxes (the agent's GC reads the store after
//!   listing, which covers it too);
//! - a flow cancelled before anything is built stops there;
//! - a failed preparation (checks that build nothing, such as finding the
//!   CNI config and plugins) returns its error as it is;
//! - when the build fails, the provider's teardown removes whatever part of
//!   it was made before the error returns, and if that fails too, both
//!   errors are reported.

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Mutex, MutexGuard};

use cubelet_engine::spec::NetworkStatus;
use cubelet_engine::{LiveSandboxes, SandboxId};

use crate::error::NetworkError;
use crate::netns;

/// Sandboxes whose create is running in one provider.
#[derive(Debug, Default)]
pub(crate) struct InFlight(Mutex<HashSet<SandboxId>>);

impl InFlight {
    fn set(&self) -> MutexGuard<'_, HashSet<SandboxId>> {
        // Every update is a single insert or remove: the set stays
        // consistent even if a holder panicked.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn enter<'a>(&'a self, sandbox: &SandboxId) -> Entered<'a> {
        self.set().insert(sandbox.clone());
        Entered {
            set: self,
            sandbox: sandbox.clone(),
        }
    }

    /// The sandboxes that exist now plus every sandbox in flight: what a
    /// GC pass must not touch. Asked after the pass has listed its objects
    /// (see [`LiveSandboxes`]); `None` when `live` cannot be read.
    pub(crate) fn and(&self, live: &dyn LiveSandboxes) -> Option<HashSet<SandboxId>> {
        let mut all = live.now()?;
        all.extend(self.set().iter().cloned());
        Some(all)
    }
}

/// Marks one sandbox in flight until dropped.
struct Entered<'a> {
    set: &'a InFlight,
    sandbox: SandboxId,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.set.set().remove(&self.sandbox);
    }
}

/// Runs `prepare` and then `build` for `sandbox` inside the frame described
/// in the module documentation; `undo` is the provider's (idempotent)
/// teardown, run only when `build` fails.
pub(crate) async fn create<P, B, U>(
    in_flight: &InFlight,
    sandbox: &SandboxId,
    host_network: bool,
    cancelled: &(dyn Fn() -> bool + Sync),
    prepare: impl FnOnce() -> Result<P, NetworkError>,
    build: impl FnOnce(P) -> B,
    undo: impl FnOnce() -> U,
) -> Result<NetworkStatus, NetworkError>
where
    B: Future<Output = Result<NetworkStatus, NetworkError>>,
    U: Future<Output = Result<(), NetworkError>>,
{
    if host_network {
        return Ok(netns::host_network_status().await);
    }
    let _entered = in_flight.enter(sandbox);
    if cancelled() {
        return Err(NetworkError::Cancelled {
            sandbox: sandbox.clone(),
            after: None,
        });
    }
    let prepared = prepare()?;
    match build(prepared).await {
        Ok(status) => Ok(status),
        Err(error) => match undo().await {
            Ok(()) => Err(error),
            Err(rollback) => Err(NetworkError::RollbackFailed {
                error: Box::new(error),
                rollback: Box::new(rollback),
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::{AtomicUsize, Ordering};

    fn id(s: &str) -> SandboxId {
        SandboxId::new_unchecked(s)
    }

    #[tokio::test]
    async fn a_sandbox_is_in_flight_only_while_it_builds() {
        let in_flight = InFlight::default();
        let live = HashSet::from([id("live")]);
        let status = create(
            &in_flight,
            &id("new"),
            false,
            &|| false,
            || Ok(()),
            |()| async {
                assert_eq!(
                    in_flight.and(&live),
                    Some(HashSet::from([id("live"), id("new")]))
                );
                Ok(NetworkStatus::default())
            },
            || async { unreachable!("nothing failed") },
        )
        .await
        .unwrap();
        assert_eq!(status, NetworkStatus::default());
        assert_eq!(in_flight.and(&live), Some(live));
    }

    #[tokio::test]
    async fn a_failed_build_is_undone_and_both_errors_are_kept() {
        let in_flight = InFlight::default();
        let undone = AtomicUsize::new(0);
        for undo_fails in [false, true] {
            let err = create(
                &in_flight,
                &id("a"),
                false,
                &|| false,
                || Ok(()),
                |()| async {
                    Err(NetworkError::InvalidConfig {
                        reason: "build".into(),
                    })
                },
                || async {
                    undone.fetch_add(1, Ordering::SeqCst);
                    if undo_fails {
                        Err(NetworkError::InvalidConfig {
                            reason: "undo".into(),
                        })
                    } else {
                        Ok(())
                    }
                },
            )
            .await
            .unwrap_err();
            if undo_fails {
                assert!(
                    matches!(&err, NetworkError::RollbackFailed { error, rollback }
                        if error.to_string().contains("build")
                            && rollback.to_string().contains("undo")),
                    "{err:?}"
                );
            } else {
                assert!(
                    matches!(&err, NetworkError::InvalidConfig { reason } if reason == "build"),
                    "{err:?}"
                );
            }
        }
        assert_eq!(undone.load(Ordering::SeqCst), 2);
        assert_eq!(in_flight.and(&HashSet::new()), Some(HashSet::new()));
    }

    #[tokio::test]
    async fn a_failed_preparation_is_returned_without_undo() {
        let in_flight = InFlight::default();
        let err = create(
            &in_flight,
            &id("p"),
            false,
            &|| false,
            || {
                Err::<(), _>(NetworkError::InvalidConfig {
                    reason: "no plugin".into(),
                })
            },
            |()| async { unreachable!("must not build") },
            || async { unreachable!("must not undo") },
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&err, NetworkError::InvalidConfig { reason } if reason == "no plugin"),
            "{err:?}"
        );
        assert_eq!(in_flight.and(&HashSet::new()), Some(HashSet::new()));
    }

    #[tokio::test]
    async fn cancelled_or_host_network_creates_build_nothing() {
        let in_flight = InFlight::default();
        let never = |()| async { unreachable!("must not build") };
        let no_undo = || async { unreachable!("must not undo") };
        let ok = || Ok(());
        let err = create(&in_flight, &id("c"), false, &|| true, ok, never, no_undo)
            .await
            .unwrap_err();
        assert!(
            matches!(err, NetworkError::Cancelled { after: None, .. }),
            "{err:?}"
        );
        let status = create(&in_flight, &id("h"), true, &|| true, ok, never, no_undo)
            .await
            .unwrap();
        assert!(status.netns_path.is_none());
    }
}
