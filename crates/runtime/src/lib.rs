//! Cubelet's runtime on containerd.
//!
//! Owns everything that talks to containerd over its gRPC API, in Cubelet's
//! own containerd namespace: image pull and unpack, the pod infra (pause)
//! image, containers and tasks, stdio FIFOs and CRI log files, exit events,
//! and the `sandbox` flow provider (a pause container, or the pod's IPC and
//! UTS namespaces pinned without one: `sandbox::podns`). Modules go by job:
//! `image`, `sandbox`, `container` and `spec`, `stats`, `io` (stdio, logs,
//! exec streams, ttrpc), `reclaim` (what the GC may take back: inventory,
//! owner mark, orphan shims). Registries are spoken to through the
//! `cubelet-registry` crate, whose oci-spec image types this crate stores.
//! Containerd's protobuf types stay inside this crate (converted in
//! `convert.rs`-style helpers); it knows nothing of CRI wire types, of the
//! store or of the other providers.

pub mod cgroup;
pub mod client;
pub mod container;
pub mod error;
pub mod events;
#[allow(unsafe_code)]
mod idmap;
pub mod image;
pub mod io;
pub mod reclaim;
pub mod safe_read;
pub mod sandbox;
pub mod spec;
mod staged;
pub mod stats;
pub mod types;

pub use client::Containerd;
/// The OCI distribution client images are pulled with.
pub use cubelet_registry as registry;
pub use error::RuntimeError;
