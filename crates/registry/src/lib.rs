//! Cubelet's OCI distribution client.
//!
//! Owns what it takes to get an image's documents and blobs from a
//! registry: image references (normalised as containerd does), the OCI
//! distribution (Docker registry v2) API over hyper, Bearer token and Basic
//! auth, `hosts.toml` mirrors, TLS, and choosing the host's platform out of
//! an index. Image documents are oci-spec's types ([`oci_spec::image`],
//! [`oci_spec::distribution::Reference`]); Docker schema2 manifests and
//! manifest lists are accepted beside OCI ones.
//!
//! It only speaks HTTP(S): putting content into containerd is the runtime
//! crate's job, and this crate knows nothing of containerd, CRI or any other
//! Cubelet crate.
//!
//! HTTPS goes through hyper-rustls (ring): server certificates are checked
//! against the system's roots, read once per process, plus the `ca` files of
//! the host's `hosts.toml`; `skip_verify` and client certificates (`client`)
//! are honoured as containerd does (see [`hosts_for`]). Plain `http://`
//! hosts work as they are.
//!
//! Credentials go only to the host they are for (see [`RegistryClient`]),
//! every wait for a registry has a progress timeout, and a blob is refused
//! as soon as it grows past its declared size.

mod auth;
mod client;
mod error;
mod hosts;
pub mod media;
pub mod platform;
mod reference;
mod tls;

pub use auth::RegistryAuth;
pub use client::{Fetched, ImageDocuments, RegistryClient, DEFAULT_PROGRESS_TIMEOUT};
pub use error::RegistryError;
pub use hosts::{hosts_for, RegistryHost};
pub use oci_spec::distribution::Reference;
pub use platform::{host_platform, PlatformName};
pub use reference::{parse_reference, ReferenceExt, DEFAULT_REGISTRY};
pub use tls::{ClientCertFiles, TlsOptions};
