//! Attacks a tenant can make, run for real against a live daemon: from inside
//! pods, with crafted images, and with clients that flood or stall. Each
//! module is one attack surface; every scenario checks that the agent stays
//! up and ready, that what it must not touch is left alone, and that nothing
//! leaks.

#[path = "hostile/gc.rs"]
mod gc;
#[path = "hostile/image_user.rs"]
mod image_user;
#[path = "hostile/logs.rs"]
mod logs;
#[path = "hostile/network.rs"]
mod network;
#[path = "hostile/registry.rs"]
mod registry;
#[path = "hostile/shims.rs"]
mod shims;
#[path = "hostile/streaming.rs"]
mod streaming;
