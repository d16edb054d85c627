//! Cubelet's durable node state, in one redb file under the root dir.
//!
//! This crate owns the on-disk records of the node: sandboxes
//! ([`SandboxRecord`]), containers ([`ContainerRecord`]), IP leases
//! ([`IpLease`]), warm-pool shells ([`ShellRecord`]), the flow journal (the [`cubelet_engine::Journal`] impl of
//! [`Store`]) and a small `meta` table with the schema version. Values are
//! JSON, so fields can be added without a migration.
//!
//! It knows the engine's spec and journal types and nothing else: no CRI,
//! no containerd, no netlink. It decides nothing about lifecycles; callers
//! set states, and the store only keeps them durably and atomically.

mod cache;
mod error;
mod index;
mod journal;
mod records;
mod store;

pub use error::StoreError;
pub use records::{
    ContainerRecord, ContainerState, IpLease, SandboxRecord, SandboxState, ShellRecord,
};
pub use store::{Store, VerifyReport, SCHEMA_VERSION};
