//! The failpoints themselves: parsing `CUBELET_TEST_FAILPOINTS` and the
//! [`Flow`] wrapper that injects the actions (built with the `failpoints`
//! feature only).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use cubelet_engine::{Flow, FlowContext, FlowKind, Message, StepError};
use tracing::warn;

use super::ENV;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    Sleep(Duration),
    Fail,
    FailFirst(u32),
}

/// When an action runs, relative to the real step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Phase {
    /// Before it: a failure leaves the step undone.
    Before,
    /// During it: the step is stopped part-way (its future dropped after
    /// [`DURING`] of work, as a cancellation would) and the call fails, so
    /// whatever it had done by then must be rolled back. A step that
    /// finishes sooner fails as `After` does.
    During,
    /// After it: a failure has the step's work to roll back.
    After,
}

/// How long a step works before a `@during` failpoint stops it.
const DURING: Duration = Duration::from_millis(2);

/// Parsed failpoints, keyed by provider then flow kind and phase.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Failpoints(HashMap<String, HashMap<(FlowKind, Phase), Action>>);

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
            let (method, phase) = match method.split_once('@') {
                None => (method, Phase::After),
                Some((m, "before")) => (m, Phase::Before),
                Some((m, "during")) => (m, Phase::During),
                Some((m, "after")) => (m, Phase::After),
                Some((_, other)) => {
                    return Err(format!("{ENV}: {item:?}: unknown phase {other:?}"))
                }
            };
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
                .insert((kind, phase), action);
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
    points: HashMap<(FlowKind, Phase), Action>,
    /// Failures injected so far, for `fail:<n>`.
    failed: std::sync::Mutex<HashMap<(FlowKind, Phase), u32>>,
}

impl Injected {
    /// Runs the step with its failpoints around it.
    async fn around<'a>(
        &'a self,
        kind: FlowKind,
        step: impl std::future::Future<Output = Result<(), StepError>> + Send + 'a,
    ) -> Result<(), StepError> {
        self.at(kind, Phase::Before).await?;
        if self.points.contains_key(&(kind, Phase::During)) && self.due(kind, Phase::During) {
            // Interrupted part-way: the step's future is dropped mid-work.
            tokio::select! {
                r = step => r?,
                () = tokio::time::sleep(DURING) => {}
            }
            return Err(injected(kind));
        }
        step.await?;
        self.at(kind, Phase::After).await
    }

    /// Whether a `fail`/`fail:<n>` point at `phase` fires now (and counts it).
    fn due(&self, kind: FlowKind, phase: Phase) -> bool {
        let key = (kind, phase);
        match self.points.get(&key) {
            Some(Action::Fail) => true,
            Some(Action::FailFirst(n)) => {
                let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
                let count = failed.entry(key).or_default();
                if *count < *n {
                    *count += 1;
                    true
                } else {
                    false
                }
            }
            _ => false,
        }
    }

    async fn at(&self, kind: FlowKind, phase: Phase) -> Result<(), StepError> {
        let key = (kind, phase);
        match self.points.get(&key) {
            None => Ok(()),
            Some(Action::Sleep(d)) => {
                tokio::time::sleep(*d).await;
                Ok(())
            }
            Some(Action::Fail) => Err(injected(kind)),
            Some(Action::FailFirst(n)) => {
                let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
                let count = failed.entry(key).or_default();
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
        self.around(FlowKind::Create, self.inner.create(ctx)).await
    }
    async fn destroy(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.around(FlowKind::Destroy, self.inner.destroy(ctx))
            .await
    }
    async fn cleanup(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.around(FlowKind::Cleanup, self.inner.cleanup(ctx))
            .await
    }
    async fn prewarm(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.around(FlowKind::Prewarm, self.inner.prewarm(ctx))
            .await
    }
    fn confined_to_shell(&self, ctx: &FlowContext) -> bool {
        self.inner.confined_to_shell(ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let f = Failpoints::parse("storage.create=sleep:2s, network.destroy=fail").unwrap();
        assert_eq!(
            f.0["storage"][&(FlowKind::Create, Phase::After)],
            Action::Sleep(Duration::from_secs(2))
        );
        assert_eq!(
            f.0["network"][&(FlowKind::Destroy, Phase::After)],
            Action::Fail
        );
        let f = Failpoints::parse("sandbox.create@before=fail").unwrap();
        assert_eq!(
            f.0["sandbox"][&(FlowKind::Create, Phase::Before)],
            Action::Fail
        );
        let f = Failpoints::parse("sandbox.create@during=fail").unwrap();
        assert_eq!(
            f.0["sandbox"][&(FlowKind::Create, Phase::During)],
            Action::Fail
        );
        assert!(Failpoints::parse("sandbox.create@midway=fail").is_err());
        assert!(Failpoints::parse("storage=fail").is_err());
        assert!(Failpoints::parse("storage.start=fail").is_err());
        assert!(Failpoints::parse("storage.create=explode").is_err());
        assert!(Failpoints::parse("storage.cleanup=fail:x").is_err());
    }

    #[tokio::test]
    async fn before_fails_without_running_the_step_after_fails_after_it() {
        let ctx = FlowContext::new(
            cubelet_engine::SandboxId::new_unchecked("b".repeat(64)),
            Arc::new(cubelet_engine::SandboxSpec::default()),
        );
        let before = cubelet_engine::fake::FakeFlow::new("storage");
        let f = Failpoints::parse("storage.create@before=fail").unwrap();
        let flow = f.wrap("storage", before.clone());
        assert!(flow.create(&ctx).await.is_err());
        assert_eq!(before.held(), 0, "the step ran");
        let after = cubelet_engine::fake::FakeFlow::new("storage");
        let f = Failpoints::parse("storage.create=fail").unwrap();
        let flow = f.wrap("storage", after.clone());
        assert!(flow.create(&ctx).await.is_err());
        assert_eq!(after.held(), 1, "the step did not run");
    }

    #[tokio::test]
    async fn fail_first_n_then_pass() {
        let f = Failpoints::parse("storage.cleanup=fail:2").unwrap();
        assert_eq!(
            f.0["storage"][&(FlowKind::Cleanup, Phase::After)],
            Action::FailFirst(2)
        );
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

    #[tokio::test]
    async fn during_stops_the_step_part_way() {
        let ctx = FlowContext::new(
            cubelet_engine::SandboxId::new_unchecked("c".repeat(64)),
            Arc::new(cubelet_engine::SandboxSpec::default()),
        );
        let step = cubelet_engine::fake::FakeFlow::new("network");
        // A step that has taken its resource and would go on for ever.
        step.set(FlowKind::Create, cubelet_engine::fake::Behavior::Hang);
        let f = Failpoints::parse("network.create@during=fail:1").unwrap();
        let flow = f.wrap("network", step.clone());
        let err = tokio::time::timeout(Duration::from_secs(5), flow.create(&ctx))
            .await
            .expect("the failpoint stops the step")
            .unwrap_err();
        assert!(err.to_string().contains("injected create failure"), "{err}");
        assert_eq!(step.held(), 1, "stopped after it had done part of its work");
        // Counted: the next call runs the step to its end.
        step.set(FlowKind::Create, cubelet_engine::fake::Behavior::Ok);
        flow.create(&ctx).await.unwrap();
    }
}
