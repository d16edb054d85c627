//! What Cubelet's providers share of the node's kernel interfaces: the
//! namespace pins of the network and runtime crates ([`pins`]) and the
//! mount table of the storage and runtime crates ([`mountinfo`]). It
//! imports no provider; providers import it instead of each other.
//!
//! No `unsafe` is needed here: `nix` wraps the system calls safely.

pub mod mountinfo;
pub mod pins;
