//! Unit tests of the lifecycle rules: a real engine with fake providers, a
//! real store in a temporary directory, and the fake runtime. No root needed.

mod container;
mod harness;
mod pool;
mod reconcile;
mod sandbox;
mod stats;
