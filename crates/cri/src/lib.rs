//! Cubelet's CRI shim.
//!
//! Serves the CRI v1 `RuntimeService` and `ImageService` (from `cubelet-cri-api`) on a
//! unix socket. It validates every request (naming the bad field), maps pod
//! sandbox calls to engine flows (`create` with failover, `destroy`,
//! `cleanup`), container and image calls to the `runtime` crate, keeps node
//! state in the store, and turns every error into a gRPC status in one place
//! ([`error`]). CRI wire types stay inside this crate; it does not know which
//! providers run the flows.

mod container;
pub mod convert;
mod deadline;
pub mod error;
mod events;
pub mod features;
mod image;
mod metrics_cri;
mod sandbox;
mod server;
mod service;
mod stats;
mod streaming;
pub mod transport;
pub mod validate;

pub use error::{CriError, CriResult};
pub use server::{serve_unix, CriSocket};
pub use service::{Cri, CriDeps, CriObserver, NodeConditions, NoopCriObserver};
