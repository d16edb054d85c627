//! The Cubelet agent as a library: configuration, wiring and the garbage
//! collector. The `cubelet` binary is a thin `main` over [`run`]. This is the
//! only crate that names concrete providers (bridge network, local storage,
//! containerd sandbox); everything else sees them as engine `Flow`s.

mod adapters;
pub mod admin;
mod app;
pub mod check;
pub mod config;
pub mod ctl;
mod failpoint;
mod gc;
pub mod malloc;
mod network;
mod notify;
pub mod pidfile;
pub mod uninstall;

pub use app::{run, PROVIDERS};
