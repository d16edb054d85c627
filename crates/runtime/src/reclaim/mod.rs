//! What Cubelet finds on the node that it may have to reclaim: the
//! inventory of containerd objects and pins the GC compares with the store,
//! the owner mark that says which of them are Cubelet's, and the orphan
//! shims it may stop.

pub mod inventory;
pub mod owner;
pub mod shims;
