//! Cubelet's observability surface.
//!
//! This crate owns the Prometheus metrics of the node agent ([`Metrics`]),
//! which the engine reports to through [`cubelet_engine::FlowObserver`] and
//! other crates through plain methods (CRI requests, sandboxes, GC, events,
//! storage pool), and the admin HTTP server ([`AdminServer`]) that serves
//! `/metrics`, `/healthz` and `/readyz` on hyper, with a [`Readiness`] handle
//! the daemon flips once recovery is done.
//!
//! It must not know about CRI, containerd, the store or any provider: it only
//! receives label values (flow, step, method, code, state, kind) and numbers.
//! Metric names are a contract (see docs/DESIGN.md, "Metrics"); sandbox ids
//! never appear in a label. Metrics are registered in a registry passed in by the
//! caller, never in the process-global default registry.

mod error;
mod metrics;
mod readiness;
mod server;

pub use error::MetricsError;
pub use metrics::{Metrics, DURATION_BUCKETS, GC_FAILURE_KINDS, GC_RECLAIMED_KINDS};
pub use readiness::Readiness;
pub use server::{AdminServer, MAX_CONNECTIONS, MAX_RENDERS_PER_SECOND, METRICS_CONTENT_TYPE};
