//! The streaming crate's error type.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Errors of the streaming server itself (session failures are reported to
/// the session's client, not returned).
#[derive(Debug, thiserror::Error)]
pub enum StreamingError {
    /// A TLS certificate or key file is unusable.
    #[error("streaming TLS {what} {}: {reason}", path.display())]
    Tls {
        /// What the file was read as (`certificate`, `key`, `key pair`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The listener could not be bound.
    #[error("bind the streaming listener on {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No random bytes for a token.
    #[error("read random bytes for a streaming token")]
    Random(#[source] getrandom::Error),
    /// `max` URLs are handed out and unused: no new one until some are used
    /// or expire.
    #[error("too many streaming URLs in flight: {max} are unused (streaming.max_in_flight_urls)")]
    TooManyInFlight {
        /// The limit.
        max: usize,
    },
    /// [`crate::StreamingServer::serve`] was called twice.
    #[error("the streaming server is already serving")]
    AlreadyServing,
}
