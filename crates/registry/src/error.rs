//! The registry crate's error type.

/// Errors of the distribution client, of image references and of image
/// documents.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A value given to the client is not acceptable (an image reference,
    /// a registry host, a hosts.toml entry).
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// Field name as the caller knows it.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// A registry has no such object.
    #[error("{kind} {id} not found")]
    NotFound {
        /// Kind of object (`blob`).
        kind: &'static str,
        /// Its URL or reference.
        id: String,
    },
    /// Reading a registry host config failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// Path involved.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A JSON document (manifest, index, config, token response) could not
    /// be decoded.
    #[error("{what} json")]
    Json {
        /// Which document.
        what: &'static str,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// An HTTP exchange with a registry failed below the HTTP level.
    #[error("registry request {url}")]
    Http {
        /// URL requested.
        url: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A local registry answered neither over HTTPS nor over plain HTTP
    /// (nothing listens on its port, typically): both attempts are named.
    #[error("registry {authority} unreachable over https ({https_url}: {https_cause}) and over http ({http_url}: {http_cause})")]
    Unreachable {
        /// The registry's host and port.
        authority: String,
        /// URL of the HTTPS attempt.
        https_url: String,
        /// Why it failed (the innermost cause).
        https_cause: String,
        /// URL of the plain HTTP attempt.
        http_url: String,
        /// Why it failed.
        http_cause: String,
    },
    /// A registry answered with an unexpected HTTP status.
    #[error("registry {url} answered {status}: {body}")]
    Status {
        /// URL requested.
        url: String,
        /// HTTP status code.
        status: u16,
        /// Start of the response body.
        body: String,
    },
    /// A registry refused access (bad or missing credentials).
    #[error("registry {url} denied access: {reason}")]
    Unauthorized {
        /// URL requested.
        url: String,
        /// What the registry or the token server said.
        reason: String,
    },
    /// Downloaded content does not match its digest.
    #[error("content {digest} does not match its digest (got {actual})")]
    DigestMismatch {
        /// Expected digest.
        digest: String,
        /// Digest of what was received.
        actual: String,
    },
    /// A registry host sent nothing for the progress timeout
    /// (`images.pull_progress_timeout`).
    #[error(
        "pull of {image} stalled: registry host {host} sent nothing for {timeout:?} \
         (images.pull_progress_timeout) while fetching {url}"
    )]
    Stalled {
        /// The image being pulled.
        image: String,
        /// `host[:port]` that stalled.
        host: String,
        /// URL requested.
        url: String,
        /// The progress timeout.
        timeout: std::time::Duration,
    },
    /// A blob is larger than its descriptor declares.
    #[error(
        "blob {digest} from {url} is larger than its declared {declared} bytes (got {received})"
    )]
    TooLarge {
        /// The blob's digest.
        digest: String,
        /// URL requested.
        url: String,
        /// Size in the descriptor.
        declared: u64,
        /// Bytes received (or announced) so far.
        received: u64,
    },
    /// A blob is smaller than its descriptor declares (its digest may
    /// still match: the descriptor lies about the size).
    #[error(
        "blob {digest} from {url} is smaller than its declared {declared} bytes (got {received})"
    )]
    TooSmall {
        /// The blob's digest.
        digest: String,
        /// URL requested.
        url: String,
        /// Size in the descriptor.
        declared: u64,
        /// Bytes received.
        received: u64,
    },
    /// A digest string is not one (`algorithm:encoded`).
    #[error("invalid digest {digest:?}")]
    InvalidDigest {
        /// The string.
        digest: String,
        /// What oci-spec found wrong.
        #[source]
        source: oci_spec::OciSpecError,
    },
    /// An image document is malformed or unusable on this node.
    #[error("image {reference}: {reason}")]
    ImageFormat {
        /// Image reference (or digest) concerned.
        reference: String,
        /// What is wrong.
        reason: String,
    },
    /// A registry host config file (`hosts.toml`) could not be parsed.
    #[error("registry host config {path}")]
    HostsConfig {
        /// Path of the file.
        path: String,
        /// Why.
        #[source]
        source: toml::de::Error,
    },
    /// A TLS file named by a registry host config (`ca`, `client`) is
    /// missing or unusable.
    #[error("registry tls {what} {path}")]
    TlsFile {
        /// Which file (`CA certificate`, `client certificate`, `client key`).
        what: &'static str,
        /// Path of the file.
        path: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// rustls refused to build a client configuration.
    #[error("registry TLS setup")]
    TlsSetup(#[source] rustls::Error),
    /// A registry's TLS server certificate was not accepted.
    #[error(
        "registry {url}: server certificate not trusted (give its CA with `ca`, \
         or set `skip_verify`, in the registry's hosts.toml)"
    )]
    Certificate {
        /// URL requested.
        url: String,
        /// What rustls found wrong with the certificate.
        #[source]
        source: rustls::Error,
    },
}
