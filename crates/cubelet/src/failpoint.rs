//! Test-only fault injection at the `Flow` seam, for end-to-end tests of
//! crash recovery and rollback against the real daemon.
//!
//! Enabled only by the `CUBELET_TEST_FAILPOINTS` environment variable, a
//! comma-separated list of `<provider>.<method>=<action>` where method is
//! `create`, `destroy` or `cleanup` and action is `sleep:<duration>` (after
//! the real step ran), `fail` (after the real step ran, so there is
//! something to roll back) or `fail:<n>` (the first `n` calls of that
//! method fail, whatever the sandbox, later ones pass: a flaky step).
//! Example:
//! `CUBELET_TEST_FAILPOINTS=storage.create=sleep:60s,network.create=fail`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use cubelet_engine::{Flow, FlowContext, FlowKind, Message, StepError};
use tracing::warn;

/// Name of the environment variable that enables failpoints.
pub(crate) const ENV: &str = "CUBELET_TEST_FAILPOINTS";

#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    Sleep(Duration),
    Fail,
    FailFirst(u32),
}

/// Parsed failpoints, keyed by provider then flow kind.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Failpoints(HashMap<String, HashMap<FlowKind, Action>>);

impl Failpoints {
    /// Reads `CUBELET_TEST_FAILPOINTS`; empty when unset.
    pub(crate) fn from_env() -> Result<Self, String> {
        match std::env::var(ENV) {
            Ok(spec) => Self::parse(&spec),
            Err(_) => Ok(Self::default()),
        }
    }

    fn parse(spec: &str) -> Result<Self, String> {
        let mut out = Self::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (target, action) = item
                .split_once('=')
                .ok_or_else(|| format!("{ENV}: {item:?} has no '='"))?;
            let (provider, method) = target
                .split_once('.')
                .ok_or_else(|| format!("{ENV}: {target:?} is not <provider>.<method>"))?;
            let kind: FlowKind = method.parse().map_err(|e| format!("{ENV}: {e}"))?;
            let action = match action.split_once(':') {
                None if action == "fail" => Action::Fail,
                Some(("fail", n)) => Action::FailFirst(
                    n.parse()
                        .map_err(|e| format!("{ENV}: {item:?}: fail count: {e}"))?,
                ),
                Some(("sleep", d)) => Action::Sleep(
                    humantime::parse_duration(d).map_err(|e| format!("{ENV}: {d:?}: {e}"))?,
                ),
                _ => return Err(format!("{ENV}: unknown action {action:?}")),
            };
            out.0
                .entry(provider.to_owned())
                .or_default()
                .insert(kind, action);
        }
        Ok(out)
    }

    /// Wraps `flow` if any failpoint names `provider`.
    pub(crate) fn wrap(&self, provider: &str, flow: Arc<dyn Flow>) -> Arc<dyn Flow> {
        match self.0.get(provider) {
            Some(points) => {
                warn!(provider, ?points, "test failpoints enabled");
                Arc::new(Injected {
                    inner: flow,
                    points: points.clone(),
                    failed: std::sync::Mutex::new(HashMap::new()),
                })
            }
            None => flow,
        }
    }
}

struct Injected {
    inner: Arc<dyn Flow>,
    points: HashMap<FlowKind, Action>,
    /// Failures injected so far, for `fail:<n>`.
    failed: std::sync::Mutex<HashMap<FlowKind, u32>>,
}

impl Injected {
    async fn after(&self, kind: FlowKind) -> Result<(), StepError> {
        match self.points.get(&kind) {
            None => Ok(()),
            Some(Action::Sleep(d)) => {
                tokio::time::sleep(*d).await;
                Ok(())
            }
            Some(Action::Fail) => Err(injected(kind)),
            Some(Action::FailFirst(n)) => {
                let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
                let count = failed.entry(kind).or_default();
                if *count < *n {
                    *count += 1;
                    Err(injected(kind))
                } else {
                    Ok(())
                }
            }
        }
    }
}

fn injected(kind: FlowKind) -> StepError {
    StepError::internal(Message(format!("failpoint: injected {kind} failure")))
}

#[async_trait]
impl Flow for Injected {
    async fn init(&self) -> Result<(), StepError> {
        self.inner.init().await
    }
    async fn create(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.inner.create(ctx).await?;
        self.after(FlowKind::Create).await
    }
    async fn destroy(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.inner.destroy(ctx).await?;
        self.after(FlowKind::Destroy).await
    }
    async fn cleanup(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.inner.cleanup(ctx).await?;
        self.after(FlowKind::Cleanup).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let f = Failpoints::parse("storage.create=sleep:2s, network.destroy=fail").unwrap();
        assert_eq!(
            f.0["storage"][&FlowKind::Create],
            Action::Sleep(Duration::from_secs(2))
        );
        assert_eq!(f.0["network"][&FlowKind::Destroy], Action::Fail);
        assert!(Failpoints::parse("storage=fail").is_err());
        assert!(Failpoints::parse("storage.start=fail").is_err());
        assert!(Failpoints::parse("storage.create=explode").is_err());
        assert!(Failpoints::parse("storage.cleanup=fail:x").is_err());
    }

    #[tokio::test]
    async fn fail_first_n_then_pass() {
        let f = Failpoints::parse("storage.cleanup=fail:2").unwrap();
        assert_eq!(f.0["storage"][&FlowKind::Cleanup], Action::FailFirst(2));
        let flow = f.wrap("storage", cubelet_engine::fake::FakeFlow::new("storage"));
        let ctx = FlowContext::new(
            cubelet_engine::SandboxId::new_unchecked("a".repeat(64)),
            Arc::new(cubelet_engine::SandboxSpec::default()),
        );
        assert!(flow.cleanup(&ctx).await.is_err());
        assert!(flow.cleanup(&ctx).await.is_err());
        assert!(flow.cleanup(&ctx).await.is_ok());
        assert!(flow.cleanup(&ctx).await.is_ok());
    }
}
