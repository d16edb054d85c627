//! The crate's error type.

use std::net::SocketAddr;

/// Errors of the metrics registry and the admin server.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// A metric could not be created or registered (bad name, bad buckets,
    /// or a metric of that name already in the registry).
    #[error("cannot register metric {name}")]
    Register {
        /// The metric's name.
        name: &'static str,
        /// What prometheus said.
        #[source]
        source: prometheus::Error,
    },
    /// The admin server could not bind its address.
    #[error("cannot bind admin server to {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// The bound socket's local address could not be read.
    #[error("cannot read local address of admin server bound to {addr}")]
    LocalAddr {
        /// The address asked for.
        addr: SocketAddr,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// The bound socket could not be handed to the async runtime.
    #[error("cannot listen on admin address {addr}")]
    Listen {
        /// The bound address.
        addr: SocketAddr,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
}
