//! The workflow configuration model (`flows:` in the YAML config) and its
//! validation against the registered providers.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::flow::FlowKind;

/// One workflow: how many may run at once and which providers run in which stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowConfig {
    /// Maximum flows in flight; a request past it waits at most
    /// `admission_wait` for a slot, then is rejected.
    /// `0` means unlimited. Negative values are refused by validation.
    pub concurrent: i64,
    /// Ordered stages; the providers of one stage run in parallel.
    pub steps: Vec<Vec<String>>,
    /// How long a request may wait for a slot when the flow is full before
    /// it is rejected; `0s` rejects at once (as the seed's Cubelet does).
    /// kubelet backs off about 10 s per rejected RunPodSandbox, so a short
    /// wait serves it better than an immediate refusal.
    #[serde(
        default = "FlowConfig::default_admission_wait",
        with = "humantime_serde"
    )]
    pub admission_wait: Duration,
}

impl FlowConfig {
    /// The default [`FlowConfig::admission_wait`]: 500 ms, a few flows' worth
    /// of a cold RunPodSandbox, far below kubelet's back-off.
    pub const DEFAULT_ADMISSION_WAIT: Duration = Duration::from_millis(500);

    fn default_admission_wait() -> Duration {
        Self::DEFAULT_ADMISSION_WAIT
    }
}

/// The `flows:` section: one [`FlowConfig`] per flow name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkflowConfig {
    /// Flows by name (`create`, `destroy`, `cleanup`).
    pub flows: BTreeMap<String, FlowConfig>,
}

impl Default for WorkflowConfig {
    fn default() -> Self {
        let stage = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let flow = |concurrent, steps: Vec<Vec<String>>| FlowConfig {
            concurrent,
            steps,
            admission_wait: FlowConfig::DEFAULT_ADMISSION_WAIT,
        };
        let mut flows = BTreeMap::new();
        flows.insert(
            "create".to_owned(),
            flow(
                16,
                vec![stage(&["storage", "network"]), stage(&["sandbox"])],
            ),
        );
        flows.insert(
            "destroy".to_owned(),
            flow(
                32,
                vec![stage(&["sandbox"]), stage(&["network", "storage"])],
            ),
        );
        flows.insert(
            "cleanup".to_owned(),
            flow(4, vec![stage(&["sandbox"]), stage(&["network", "storage"])]),
        );
        Self { flows }
    }
}

/// A workflow configuration that is wrong, naming what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A flow name other than create, destroy, cleanup, prewarm.
    #[error("flows.{0}: unknown flow (expected create, destroy, cleanup or prewarm)")]
    UnknownFlow(String),
    /// A required flow is absent.
    #[error("flows.{0}: missing (create, destroy and cleanup are required)")]
    MissingFlow(&'static str),
    /// `concurrent` below zero.
    #[error("flows.{flow}.concurrent: must be >= 0 (0 = unlimited), got {value}")]
    NegativeConcurrency {
        /// Flow name.
        flow: String,
        /// Value given.
        value: i64,
    },
    /// A flow with no stages.
    #[error("flows.{0}.steps: no stages")]
    NoStages(String),
    /// A stage with no providers.
    #[error("flows.{flow}.steps[{stage}]: empty stage")]
    EmptyStage {
        /// Flow name.
        flow: String,
        /// Stage index.
        stage: usize,
    },
    /// A provider name nobody registered.
    #[error("flows.{flow}.steps[{stage}]: unknown provider {name:?} (known: {known})")]
    UnknownProvider {
        /// Flow name.
        flow: String,
        /// Stage index.
        stage: usize,
        /// Provider named.
        name: String,
        /// Registered providers, comma separated.
        known: String,
    },
    /// A provider named twice in one stage.
    #[error("flows.{flow}.steps[{stage}]: provider {name:?} appears twice in the stage")]
    DuplicateInStage {
        /// Flow name.
        flow: String,
        /// Stage index.
        stage: usize,
        /// Provider named twice.
        name: String,
    },
    /// A provider named in more than one stage of a flow.
    #[error("flows.{flow}.steps: provider {name:?} appears in more than one stage")]
    DuplicateInFlow {
        /// Flow name.
        flow: String,
        /// Provider named twice.
        name: String,
    },
}

/// A validated flow: its kind, limit and stages of provider names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidFlow {
    /// Which flow.
    pub kind: FlowKind,
    /// Limit, `0` = unlimited.
    pub concurrent: usize,
    /// Longest wait for a slot before a rejection; zero rejects at once.
    pub admission_wait: Duration,
    /// Stages of provider names.
    pub stages: Vec<Vec<String>>,
}

impl WorkflowConfig {
    /// The `prewarm` flow's limit when the configuration leaves the flow
    /// out: one shell at a time, so refilling the pool takes at most one
    /// flow's worth of the node while user flows run.
    pub const PREWARM_CONCURRENT: i64 = 1;

    /// Checks the configuration against the registered provider names and
    /// returns the flows in [`FlowKind::ALL`] order. `prewarm` may be left
    /// out: it then runs the `create` flow's stages, one at a time
    /// ([`WorkflowConfig::PREWARM_CONCURRENT`]).
    pub fn validate<'a>(
        &self,
        providers: impl IntoIterator<Item = &'a str>,
    ) -> Result<Vec<ValidFlow>, ConfigError> {
        let known: Vec<&str> = providers.into_iter().collect();
        for name in self.flows.keys() {
            name.parse::<FlowKind>()
                .map_err(|_| ConfigError::UnknownFlow(name.clone()))?;
        }
        let mut out = Vec::with_capacity(FlowKind::ALL.len());
        for kind in FlowKind::ALL {
            let name = kind.as_str();
            let derived;
            let cfg = match self.flows.get(name) {
                Some(cfg) => cfg,
                None if kind == FlowKind::Prewarm => {
                    let create = FlowKind::Create.as_str();
                    let steps = self
                        .flows
                        .get(create)
                        .ok_or(ConfigError::MissingFlow(create))?
                        .steps
                        .clone();
                    derived = FlowConfig {
                        concurrent: Self::PREWARM_CONCURRENT,
                        steps,
                        admission_wait: Duration::ZERO,
                    };
                    &derived
                }
                None => return Err(ConfigError::MissingFlow(name)),
            };
            let concurrent =
                usize::try_from(cfg.concurrent).map_err(|_| ConfigError::NegativeConcurrency {
                    flow: name.to_owned(),
                    value: cfg.concurrent,
                })?;
            if cfg.steps.is_empty() {
                return Err(ConfigError::NoStages(name.to_owned()));
            }
            let mut in_flow = HashSet::new();
            for (i, stage) in cfg.steps.iter().enumerate() {
                if stage.is_empty() {
                    return Err(ConfigError::EmptyStage {
                        flow: name.to_owned(),
                        stage: i,
                    });
                }
                let mut in_stage = HashSet::new();
                for step in stage {
                    if !known.contains(&step.as_str()) {
                        return Err(ConfigError::UnknownProvider {
                            flow: name.to_owned(),
                            stage: i,
                            name: step.clone(),
                            known: known.join(", "),
                        });
                    }
                    if !in_stage.insert(step.as_str()) {
                        return Err(ConfigError::DuplicateInStage {
                            flow: name.to_owned(),
                            stage: i,
                            name: step.clone(),
                        });
                    }
                    if !in_flow.insert(step.as_str()) {
                        return Err(ConfigError::DuplicateInFlow {
                            flow: name.to_owned(),
                            name: step.clone(),
                        });
                    }
                }
            }
            out.push(ValidFlow {
                kind,
                concurrent,
                admission_wait: cfg.admission_wait,
                stages: cfg.steps.clone(),
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROVIDERS: [&str; 3] = ["storage", "network", "sandbox"];

    fn parse(yaml: &str) -> WorkflowConfig {
        serde_norway::from_str(yaml).unwrap()
    }

    #[test]
    fn default_is_valid_and_matches_design() {
        let flows = WorkflowConfig::default().validate(PROVIDERS).unwrap();
        assert_eq!(flows[0].kind, FlowKind::Create);
        assert_eq!(flows[0].concurrent, 16);
        assert_eq!(
            flows[0].stages,
            vec![vec!["storage", "network"], vec!["sandbox"]]
        );
        assert_eq!(flows[1].concurrent, 32);
        assert_eq!(flows[2].concurrent, 4);
    }

    #[test]
    fn yaml_round_trip() {
        let cfg = parse(
            "create: { concurrent: 2, steps: [[storage, network], [sandbox]] }\n\
             destroy: { concurrent: 0, steps: [[sandbox], [network, storage]] }\n\
             cleanup: { concurrent: 1, steps: [[sandbox, network, storage]] }\n",
        );
        let flows = cfg.validate(PROVIDERS).unwrap();
        assert_eq!(flows[1].concurrent, 0);
        assert_eq!(flows[2].stages.len(), 1);
        assert_eq!(flows[0].admission_wait, FlowConfig::DEFAULT_ADMISSION_WAIT);
    }

    #[test]
    fn admission_wait_is_per_flow_and_prewarm_never_waits_unless_told() {
        let flows = parse(
            "create: { concurrent: 2, admission_wait: 250ms, steps: [[storage, network], [sandbox]] }\n\
             destroy: { concurrent: 1, admission_wait: 0s, steps: [[sandbox]] }\n\
             cleanup: { concurrent: 1, steps: [[sandbox]] }\n",
        )
        .validate(PROVIDERS)
        .unwrap();
        let wait = |kind| {
            flows
                .iter()
                .find(|f| f.kind == kind)
                .unwrap()
                .admission_wait
        };
        assert_eq!(wait(FlowKind::Create), Duration::from_millis(250));
        assert_eq!(wait(FlowKind::Destroy), Duration::ZERO);
        assert_eq!(wait(FlowKind::Cleanup), FlowConfig::DEFAULT_ADMISSION_WAIT);
        assert_eq!(wait(FlowKind::Prewarm), Duration::ZERO);
    }

    fn err(yaml: &str) -> String {
        parse(yaml).validate(PROVIDERS).unwrap_err().to_string()
    }

    const OK_DESTROY: &str = "destroy: { concurrent: 1, steps: [[sandbox]] }\n";
    const OK_CLEANUP: &str = "cleanup: { concurrent: 1, steps: [[sandbox]] }\n";

    #[test]
    fn errors_name_the_problem() {
        let e = err(&format!(
            "create: {{ concurrent: 1, steps: [[nope]] }}\n{OK_DESTROY}{OK_CLEANUP}"
        ));
        assert!(
            e.contains("flows.create.steps[0]") && e.contains("\"nope\""),
            "{e}"
        );
        assert!(e.contains("storage, network, sandbox"), "{e}");

        let e = err(&format!(
            "create: {{ concurrent: 1, steps: [[storage], []] }}\n{OK_DESTROY}{OK_CLEANUP}"
        ));
        assert_eq!(e, "flows.create.steps[1]: empty stage");

        let e = err(&format!(
            "create: {{ concurrent: 1, steps: [] }}\n{OK_DESTROY}{OK_CLEANUP}"
        ));
        assert_eq!(e, "flows.create.steps: no stages");

        let e = err(&format!(
            "create: {{ concurrent: 1, steps: [[storage, storage]] }}\n{OK_DESTROY}{OK_CLEANUP}"
        ));
        assert!(e.contains("appears twice"), "{e}");

        let e = err(&format!(
            "create: {{ concurrent: 1, steps: [[storage], [storage]] }}\n{OK_DESTROY}{OK_CLEANUP}"
        ));
        assert!(e.contains("more than one stage"), "{e}");

        let e = err(&format!(
            "create: {{ concurrent: -1, steps: [[storage]] }}\n{OK_DESTROY}{OK_CLEANUP}"
        ));
        assert!(e.starts_with("flows.create.concurrent"), "{e}");

        let e = err(&format!("{OK_DESTROY}{OK_CLEANUP}"));
        assert_eq!(
            e,
            "flows.create: missing (create, destroy and cleanup are required)"
        );

        let e = err(&format!(
            "create: {{ concurrent: 1, steps: [[storage]] }}\n{OK_DESTROY}{OK_CLEANUP}gc: {{ concurrent: 1, steps: [[storage]] }}\n"
        ));
        assert!(e.starts_with("flows.gc: unknown flow"), "{e}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        let r: Result<WorkflowConfig, _> =
            serde_norway::from_str("create: { concurrent: 1, steps: [[a]], parallel: true }");
        assert!(r.unwrap_err().to_string().contains("parallel"));
    }
}
