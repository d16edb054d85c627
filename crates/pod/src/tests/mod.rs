//! Unit tests of the lifecycle rules: a real engine with fake providers, a
//! real store in a temporary directory, the fake runtime.

mod harness;
