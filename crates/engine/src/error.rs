//! Errors of the engine and of the steps it runs.

use std::error::Error as StdError;
use std::fmt;

use crate::flow::FlowKind;
use crate::spec::SandboxId;

/// Boxed error from a provider, kept whole so its cause chain survives.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// What kind of failure a step hit, so the CRI layer can choose a status
/// code without knowing the provider's error type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepErrorKind {
    /// The request cannot be served as asked (bad value that got past validation).
    InvalidArgument,
    /// Something the step needs does not exist.
    NotFound,
    /// Something the step would create already exists (a host port in use, ...).
    AlreadyExists,
    /// A finite resource ran out (addresses, pool entries).
    ResourceExhausted,
    /// The node is not in a state that allows the step.
    FailedPrecondition,
    /// The step was cancelled by the caller.
    Cancelled,
    /// The step ran past its deadline.
    DeadlineExceeded,
    /// A service the step depends on (containerd, an image registry) could
    /// not be reached or failed; trying again later may succeed.
    Unavailable,
    /// Anything else.
    Internal,
}

/// The error a [`crate::Flow`] step returns.
#[derive(Debug)]
pub struct StepError {
    kind: StepErrorKind,
    source: BoxError,
}

impl StepError {
    /// An error of the given kind caused by `source`.
    pub fn new(kind: StepErrorKind, source: impl Into<BoxError>) -> Self {
        Self {
            kind,
            source: source.into(),
        }
    }

    /// An internal error caused by `source`.
    pub fn internal(source: impl Into<BoxError>) -> Self {
        Self::new(StepErrorKind::Internal, source)
    }

    /// The kind of failure.
    pub fn kind(&self) -> StepErrorKind {
        self.kind
    }

    /// The provider's own error.
    pub fn inner(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.source
    }
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The provider's message is the useful part; its own sources follow
        // through `source()`.
        fmt::Display::fmt(&self.source, f)
    }
}

impl StdError for StepError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source.source()
    }
}

/// A failure of one step of a flow.
#[derive(Debug, thiserror::Error)]
#[error("step {step} failed: {error}")]
pub struct StepFailure {
    /// Provider name of the step.
    pub step: String,
    /// What it returned.
    #[source]
    pub error: StepError,
}

/// A message-only error, for failures the engine itself produces (panics,
/// timeouts, cancellation).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Message(pub String);

/// Errors of the journal (durable flow records).
#[derive(Debug, thiserror::Error)]
#[error("journal {op} failed")]
pub struct JournalError {
    /// What the journal was doing.
    pub op: &'static str,
    /// Why it failed.
    #[source]
    pub source: BoxError,
}

/// Errors returned by [`crate::Engine`].
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The flow's concurrency limit was reached; the request was not started.
    #[error("flow {flow} rejected: {limit} flows already in flight")]
    Rejected {
        /// Flow that was full.
        flow: FlowKind,
        /// Its limit at the time.
        limit: usize,
    },
    /// One or more steps failed. With failover the rollback result is attached.
    #[error(
        "flow {flow} for sandbox {sandbox_id} failed: {}{}",
        join(failures),
        rollback_note(rollback)
    )]
    Failed {
        /// Flow that failed.
        flow: FlowKind,
        /// Sandbox it ran for.
        sandbox_id: SandboxId,
        /// Every step failure, first one first.
        failures: Vec<StepFailure>,
        /// Outcome of the rollback, when failover ran.
        rollback: Option<Box<RollbackError>>,
    },
    /// The caller cancelled the flow before it finished; compensation ran.
    #[error(
        "flow {flow} for sandbox {sandbox_id} cancelled{}",
        rollback_note(rollback)
    )]
    Cancelled {
        /// Flow that was cancelled.
        flow: FlowKind,
        /// Sandbox it ran for.
        sandbox_id: SandboxId,
        /// Outcome of the rollback, when failover ran.
        rollback: Option<Box<RollbackError>>,
    },
    /// The journal could not record the flow, so it was not started.
    #[error("flow {flow} for sandbox {sandbox_id} not started")]
    Journal {
        /// Flow that could not start.
        flow: FlowKind,
        /// Sandbox it was for.
        sandbox_id: SandboxId,
        /// Why.
        #[source]
        source: JournalError,
    },
    /// A provider's `init` failed at startup.
    #[error("provider {step} failed to initialise")]
    Init {
        /// Provider name.
        step: String,
        /// What it returned.
        #[source]
        source: StepFailure,
    },
    /// The flow is not configured (only possible with a hand-built engine).
    #[error("flow {0} is not configured")]
    NotConfigured(FlowKind),
}

/// How a rollback ended, attached to the original error.
#[derive(Debug, thiserror::Error)]
pub enum RollbackError {
    /// Rollback finished and removed everything.
    #[error("rolled back")]
    RolledBack,
    /// Some destroy steps failed; the sandbox needs cleanup.
    #[error("rollback failed: {}", join(.0))]
    Failed(Vec<StepFailure>),
    /// Rollback did not finish within its timeout.
    #[error("rollback timed out after {0:?}")]
    TimedOut(std::time::Duration),
}

impl EngineError {
    /// The kind of the first step failure, if any; `Cancelled` for cancelled
    /// flows. The CRI layer maps it to a status code.
    pub fn step_kind(&self) -> Option<StepErrorKind> {
        match self {
            EngineError::Failed { failures, .. } => failures.first().map(|f| f.error.kind()),
            EngineError::Cancelled { .. } => Some(StepErrorKind::Cancelled),
            _ => None,
        }
    }

    /// True when a rollback ran and did not finish cleanly.
    pub fn rollback_failed(&self) -> bool {
        match self {
            EngineError::Failed { rollback, .. } | EngineError::Cancelled { rollback, .. } => {
                matches!(rollback.as_deref(), Some(r) if !matches!(r, RollbackError::RolledBack))
            }
            _ => false,
        }
    }
}

fn join(failures: &[StepFailure]) -> String {
    let mut out = String::new();
    for (i, f) in failures.iter().enumerate() {
        if i > 0 {
            out.push_str("; ");
        }
        out.push_str(&f.step);
        out.push_str(": ");
        out.push_str(&chain(&f.error));
    }
    out
}

fn rollback_note(rollback: &Option<Box<RollbackError>>) -> String {
    match rollback {
        None => String::new(),
        Some(r) => format!(" ({r})"),
    }
}

/// Formats an error with its whole cause chain: `a: b: c`. A cause whose
/// text the message so far already contains (an error that prints its
/// source inside its own text, as many do) is skipped, so each cause is
/// named once.
pub fn chain(err: &dyn StdError) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let s = e.to_string();
        if !s.is_empty() && !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = e.source();
    }
    out
}

#[cfg(test)]
mod chain_tests {
    use super::chain;

    #[derive(Debug, thiserror::Error)]
    #[error("{text}")]
    struct E {
        text: String,
        #[source]
        source: Option<Box<E>>,
    }

    fn e(text: &str, source: Option<E>) -> E {
        E {
            text: text.to_owned(),
            source: source.map(Box::new),
        }
    }

    /// An error that repeats its source in its own text (as a runc error
    /// relayed by containerd and wrapped again) names the cause once.
    #[test]
    fn a_cause_already_in_the_message_is_named_once() {
        let runc = "runc create failed: exec: \"nope\": executable file not found in $PATH";
        let err = e(
            &format!("start container c1: {runc}"),
            Some(e(runc, Some(e("executable file not found in $PATH", None)))),
        );
        let s = chain(&err);
        assert_eq!(s, format!("start container c1: {runc}"));
        assert_eq!(s.matches("executable file not found").count(), 1, "{s}");
        // Distinct causes are all kept, in order.
        let err = e("a", Some(e("b", Some(e("c", None)))));
        assert_eq!(chain(&err), "a: b: c");
    }
}
