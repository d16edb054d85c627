//! Cubelet's `storage` flow provider.
//!
//! This crate owns everything a sandbox keeps on the node's disks: the
//! per-sandbox directory `<root_dir>/sandboxes/<id>` with the `hostname`,
//! `hosts` and `resolv.conf` files the pod gets bind-mounted into `/etc`,
//! the tmpfs mounted at the pod's `/dev/shm`, optional size-limited scratch
//! space (loop-mounted ext4 images from a pre-formatted pool), and the CRI
//! log directory kubelet asks for. [`LocalStorage`] implements
//! [`cubelet_engine::Flow`] and publishes [`cubelet_engine::spec::StorageStatus`].
//!
//! It must not know about CRI, containerd, the network step or the store:
//! its input is the engine's [`cubelet_engine::SandboxSpec`], its output
//! paths. It never creates or removes anything outside `root_dir` except
//! the log directory, which it creates but never removes (kubelet owns it).
//! No `unsafe` is needed: the mount syscalls go through `nix`.

mod collect;
mod error;
mod files;
mod mount;
mod paths;
mod provider;
mod scratch;

pub use error::StorageError;
pub use files::{
    render_hostname, render_hosts, render_resolv_conf, validate_dns, validate_hostname, write_hosts,
};
pub use mount::{is_mounted, mount_table, parse_mountinfo, unmount_all, MountEntry};
pub use paths::{sandboxes_dir, validate_log_directory, SandboxPaths, SANDBOXES_DIR};
pub use provider::{GcReport, LocalStorage, StorageConfig};
pub use scratch::{PoolStats, ScratchConfig};
