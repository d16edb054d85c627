//! Cubelet's pod lifecycle service.
//!
//! [`PodService`] owns every pod and container state transition: run, stop
//! and remove a pod sandbox (the engine's `create`, `destroy` and `cleanup`
//! flows), create, start, stop and remove its containers (through the
//! [`Runtime`] trait, containerd in production), containerd's exit and OOM
//! events, reconciliation after a restart, the garbage collector's work
//! list, container and pod stats (with the CPU samples they keep), and a warm pool of sandbox shells that RunPodSandbox claims. State lives in the store; lifecycle events go to subscribers.
//!
//! It knows no wire format: the CRI edge (`cubelet-cri`) converts requests
//! into this crate's types and its errors into gRPC statuses; the binary
//! and the GC call it directly. With the `fake` feature, `fake::FakeRuntime`
//! stands in for containerd so the lifecycle rules are unit-tested without
//! root.

mod anchor;
mod container;
mod error;
mod events;
pub mod exec_gate;
mod pool;
mod reconcile;
mod removals;
mod runtime;
mod sandbox;
mod service;
mod stats;
mod stops;

#[cfg(any(test, feature = "fake"))]
pub mod fake;

#[cfg(test)]
mod tests;

pub use anchor::ANCHOR_TIMEOUT;
pub use container::{ContainerRequest, ExecResult};
pub use error::{PodError, PodResult};
pub use exec_gate::{MAX_EXECS_PER_POD, MAX_EXEC_WAITERS_PER_POD};
pub use pool::{NoopPoolObserver, PoolConfig, PoolObserver};
pub use reconcile::ReconcileReport;
pub use runtime::{AnchorObserver, Containerd, NetnsCounters, Runtime, DEFAULT_ANCHOR_DELAY};
pub use service::{PodDeps, PodEvent, PodEventKind, PodService, EVENT_BUFFER};
pub use stats::{
    CgroupStats, ContainerStats, CpuUsage, InterfaceStats, IoStats, MemoryStats, PodStats,
    Pressure, PsiData, PsiStats, SnapshotUsage,
};

/// The records the service keeps, as callers read them.
pub use cubelet_store::{ContainerRecord, ContainerState, SandboxRecord, SandboxState, StoreError};

/// How long a StopPodSandbox (a StopContainer: past its own timeout) may
/// run before the pod's shim is checked for a deadlock and killed if it
/// answers nothing ([`Runtime::unwedge_shim`]). A working shim kills and
/// reaps in milliseconds.
pub const SHIM_ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
