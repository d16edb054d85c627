//! Fake providers for tests, beside the trait they implement.
//!
//! A [`FakeFlow`] "holds a resource" per sandbox from the moment its `create`
//! acts until `destroy` or `cleanup` releases it, so tests can assert that
//! nothing is left after any failure. Each flow kind can be told to fail,
//! panic, sleep, wait on a barrier (with its thread free or blocked) or hang.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::Barrier;

use crate::error::{Message, StepError};
use crate::flow::{Flow, FlowContext, FlowKind};
use crate::spec::SandboxId;

/// What a fake does when called for one flow kind.
#[derive(Debug, Clone, Default)]
pub enum Behavior {
    /// Succeed.
    #[default]
    Ok,
    /// Return an error, after acquiring the resource if `after_acquire`.
    Fail {
        /// Whether the resource is taken before failing.
        after_acquire: bool,
    },
    /// Panic, after acquiring the resource if `after_acquire`.
    Panic {
        /// Whether the resource is taken before panicking.
        after_acquire: bool,
    },
    /// Sleep, then succeed.
    Delay(Duration),
    /// Wait on the barrier, then succeed.
    Barrier(Arc<Barrier>),
    /// Wait on the rendezvous with the thread blocked (as a step's
    /// synchronous work blocks it), then succeed; fail if the other
    /// parties do not come within its patience.
    Rendezvous(Arc<Rendezvous>),
    /// Acquire, then never return (until dropped by cancellation).
    Hang,
    /// Fail the first `n` calls, then succeed.
    FailTimes(Arc<Mutex<u32>>),
}

/// A barrier whose parties block their threads while they wait, and give
/// up after a while instead of waiting for ever.
#[derive(Debug)]
pub struct Rendezvous {
    parties: usize,
    arrived: Mutex<usize>,
    all_here: Condvar,
    patience: Duration,
}

impl Rendezvous {
    /// A rendezvous of `parties`, each waiting at most `patience`.
    pub fn new(parties: usize, patience: Duration) -> Arc<Self> {
        Arc::new(Self {
            parties,
            arrived: Mutex::new(0),
            all_here: Condvar::new(),
            patience,
        })
    }

    /// Blocks until every party has arrived (true) or the patience ran out
    /// (false).
    pub fn wait(&self) -> bool {
        let deadline = Instant::now() + self.patience;
        let mut arrived = lock(&self.arrived);
        *arrived += 1;
        self.all_here.notify_all();
        while *arrived < self.parties {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            arrived = self
                .all_here
                .wait_timeout(arrived, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }
}

/// A provider that counts what it holds.
#[derive(Debug)]
pub struct FakeFlow {
    name: String,
    held: Mutex<HashSet<SandboxId>>,
    behavior: Mutex<HashMap<FlowKind, Behavior>>,
    log: Arc<Mutex<Vec<String>>>,
    init_calls: Mutex<u32>,
    confined: std::sync::atomic::AtomicBool,
}

impl FakeFlow {
    /// A fake named `name` that always succeeds.
    pub fn new(name: &str) -> Arc<Self> {
        Self::with_log(name, Arc::default())
    }

    /// A fake that appends `"<kind>:<name>:start"` and `"...:end"` to a shared log.
    pub fn with_log(name: &str, log: Arc<Mutex<Vec<String>>>) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_owned(),
            held: Mutex::default(),
            behavior: Mutex::default(),
            log,
            init_calls: Mutex::new(0),
            confined: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Sets the behaviour for one flow kind.
    pub fn set(&self, kind: FlowKind, behavior: Behavior) {
        lock(&self.behavior).insert(kind, behavior);
    }

    /// Makes it answer [`Flow::confined_to_shell`] with `confined`, for
    /// any context (`false` until set): the engine alone must tell claims
    /// from cold creates.
    pub fn set_confined(&self, confined: bool) {
        self.confined
            .store(confined, std::sync::atomic::Ordering::Relaxed);
    }

    /// Number of sandboxes this fake holds a resource for.
    pub fn held(&self) -> usize {
        lock(&self.held).len()
    }

    /// Whether it holds a resource for `id`.
    pub fn holds(&self, id: &SandboxId) -> bool {
        lock(&self.held).contains(id)
    }

    /// How many times `init` ran.
    pub fn init_calls(&self) -> u32 {
        *lock(&self.init_calls)
    }

    /// The shared log.
    pub fn log(&self) -> Vec<String> {
        lock(&self.log).clone()
    }

    fn note(&self, kind: FlowKind, what: &str) {
        lock(&self.log).push(format!("{kind}:{}:{what}", self.name));
    }

    fn acquire(&self, id: &SandboxId) {
        lock(&self.held).insert(id.clone());
    }

    fn release(&self, id: &SandboxId) {
        lock(&self.held).remove(id);
    }

    async fn act(&self, kind: FlowKind, ctx: &FlowContext) -> Result<(), StepError> {
        self.note(kind, "start");
        let behavior = lock(&self.behavior).get(&kind).cloned().unwrap_or_default();
        let id = ctx.sandbox_id();
        let forward = !kind.is_teardown();
        let fail = || StepError::internal(Message(format!("{} {kind} failed", self.name)));
        match behavior {
            Behavior::Ok => {}
            Behavior::Fail { after_acquire } => {
                if after_acquire && forward {
                    self.acquire(id);
                }
                self.note(kind, "fail");
                return Err(fail());
            }
            Behavior::Panic { after_acquire } => {
                if after_acquire && forward {
                    self.acquire(id);
                }
                panic!("fake-panic: {} {kind}", self.name);
            }
            Behavior::Delay(d) => tokio::time::sleep(d).await,
            Behavior::Barrier(b) => {
                b.wait().await;
            }
            Behavior::Rendezvous(r) => {
                if !crate::collect::blocking(|| r.wait()) {
                    self.note(kind, "alone");
                    return Err(fail());
                }
            }
            Behavior::Hang => {
                if forward {
                    self.acquire(id);
                }
                std::future::pending::<()>().await;
            }
            Behavior::FailTimes(left) => {
                let mut n = lock(&left);
                if *n > 0 {
                    *n -= 1;
                    return Err(fail());
                }
            }
        }
        if forward {
            self.acquire(id);
            // The sandbox slot carries the name of the last fake to finish.
            ctx.publish(crate::spec::SandboxProcess {
                pid: Some(1),
                runtime_handler: self.name.clone(),
                ..Default::default()
            });
        } else {
            self.release(id);
        }
        self.note(kind, "end");
        Ok(())
    }
}

#[async_trait]
impl Flow for FakeFlow {
    async fn init(&self) -> Result<(), StepError> {
        *lock(&self.init_calls) += 1;
        Ok(())
    }

    async fn create(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.act(FlowKind::Create, ctx).await
    }

    async fn destroy(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.act(FlowKind::Destroy, ctx).await
    }

    async fn cleanup(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.act(FlowKind::Cleanup, ctx).await
    }

    async fn prewarm(&self, ctx: &FlowContext) -> Result<(), StepError> {
        self.act(FlowKind::Prewarm, ctx).await
    }

    fn confined_to_shell(&self, _ctx: &FlowContext) -> bool {
        self.confined.load(std::sync::atomic::Ordering::Relaxed)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
