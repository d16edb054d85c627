//! Cubelet's `network` flow provider.
//!
//! This crate owns the pod network on the node: the bridge, one network
//! namespace per sandbox (pinned by a bind mount under `<state_dir>/netns`),
//! the veth pair joining them, IPv4 address management over the bridge
//! subnet, and the nftables rules for masquerading and host ports. It is the
//! only crate that calls `setns`/`unshare` or speaks netlink. Namespace entry
//! lives in one module (`netns.rs`) and happens only on dedicated threads
//! that exit afterwards, never across an `.await`; host-side netlink runs on
//! the caller's runtime in the node's namespace. No `unsafe` is used.
//!
//! It knows the engine's [`Flow`](cubelet_engine::Flow) contract and spec
//! types only. It does not know the database: leases go through the
//! [`LeaseStore`] trait, which the binary implements over the real store
//! ([`MemLeases`] is the in-memory one for tests). It knows nothing of CRI,
//! containerd or the other providers.
//!
//! [`CniNetwork`] is the alternative provider on standard CNI plugin
//! binaries: it pins the namespace with the same code, then runs the node's
//! CNI config against it and caches each result on disk for DEL.
//! [`NoneNetwork`] (`network.provider: none`) pins the namespace with the
//! same code too and brings up its loopback, and does nothing else: no
//! interface, no address, no host ports.

mod bridge;
mod cni;
mod collect;
mod create;
mod error;
mod ipam;
mod lease;
mod netns;
mod nft;
mod none;
mod overlap;
mod userns;

pub use bridge::{
    veth_name, BridgeConfig, BridgeNetwork, GcReport, SubStep, POD_INTERFACE, VETH_PREFIX,
};
pub use cni::{CniConfig, CniGcReport, CniNetwork, PluginVersion, Readiness};
pub use error::NetworkError;
pub use ipam::Ipam;
pub use lease::{LeaseStore, MemLeases};
pub use netns::{connect_in_netns, net_dev_in_netns};
pub use nft::table_name as nft_table_name;
pub use none::{NoneGcReport, NoneNetwork};
pub use overlap::check_subnet;
