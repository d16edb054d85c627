//! Test-only fault injection at the `Flow` seam, for end-to-end tests of
//! crash recovery and rollback against the real daemon.
//!
//! Compiled in only with the `cubelet` crate's `failpoints` cargo feature
//! (off by default, so release builds leave the hook out; the test suite
//! builds with it) and enabled only by the `CUBELET_TEST_FAILPOINTS`
//! environment variable, a comma-separated list of
//! `<provider>.<method>[@before]=<action>` where
//! method is `create`, `destroy` or `cleanup` and action is
//! `sleep:<duration>`, `fail` or `fail:<n>` (the first `n` calls of that
//! method fail, whatever the sandbox, later ones pass: a flaky step). The
//! action runs after the real step (so a failure has something to roll
//! back), or with `@before` instead of it having run at all (the step fails
//! before doing anything, or waits before starting).
//! Example:
//! `CUBELET_TEST_FAILPOINTS=storage.create=sleep:60s,network.create@before=fail`.
//!
//! Without the feature, a set `CUBELET_TEST_FAILPOINTS` stops the agent at
//! startup: a fault test must never pass against a binary that silently
//! ignores its faults.

/// Name of the environment variable that enables failpoints.
pub(crate) const ENV: &str = "CUBELET_TEST_FAILPOINTS";

#[cfg(feature = "failpoints")]
mod inject;
#[cfg(not(feature = "failpoints"))]
pub(crate) use disabled::Failpoints;
#[cfg(feature = "failpoints")]
pub(crate) use inject::Failpoints;

/// The stand-in of a build without the `failpoints` feature: no failpoint
/// code, only the refusal to start when some are asked for.
#[cfg(not(feature = "failpoints"))]
mod disabled {
    use std::sync::Arc;

    use cubelet_engine::Flow;

    use super::ENV;

    /// No failpoints: this build cannot inject any.
    #[derive(Debug, Default, Clone, PartialEq, Eq)]
    pub(crate) struct Failpoints;

    impl Failpoints {
        /// An error when `CUBELET_TEST_FAILPOINTS` is set at all.
        pub(crate) fn from_env() -> Result<Self, String> {
            Self::check(std::env::var_os(ENV).is_some())
        }

        fn check(requested: bool) -> Result<Self, String> {
            if requested {
                Err(format!(
                    "{ENV} is set, but this cubelet was built without the `failpoints` \
                     feature and cannot inject faults (build it with \
                     `--features cubelet/failpoints`)"
                ))
            } else {
                Ok(Self)
            }
        }

        /// `flow` itself.
        pub(crate) fn wrap(&self, _provider: &str, flow: Arc<dyn Flow>) -> Arc<dyn Flow> {
            flow
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn asking_for_failpoints_without_the_feature_is_an_error() {
            let err = Failpoints::check(true).unwrap_err();
            assert!(err.contains(ENV) && err.contains("failpoints"), "{err}");
            assert_eq!(Failpoints::check(false).unwrap(), Failpoints);
        }
    }
}
