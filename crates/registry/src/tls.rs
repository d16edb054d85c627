//! TLS for registry hosts: rustls client configurations (ring provider)
//! built from the system's trust roots, read once per process and shared,
//! plus what a host's `hosts.toml` adds: extra CAs (`ca`), no verification
//! (`skip_verify`) and client certificates (`client`).
//!
//! The system roots are the PEM bundle OpenSSL would use (`SSL_CERT_FILE`,
//! else the first of the usual distribution bundles such as
//! `/etc/ssl/certs/ca-certificates.crt`) and the PEM files of `SSL_CERT_DIR`
//! (else `/etc/ssl/certs` when no bundle exists).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::ResolvesClientCert;
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

use crate::error::RegistryError;

/// CA bundles of the common distributions, tried in order (as OpenSSL's
/// probe does); Debian's first.
const CERT_FILES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/cert.pem",
];
/// Directory of PEM certificates, read when no bundle exists.
const CERT_DIR: &str = "/etc/ssl/certs";

/// TLS settings of one registry host: `ca`, `skip_verify` and `client` in
/// `hosts.toml`. The default (all empty) is the system's roots and no
/// client certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct TlsOptions {
    /// PEM files of CA certificates trusted besides the system's.
    pub ca: Vec<PathBuf>,
    /// Accept any server certificate (handshake signatures are still checked).
    pub skip_verify: bool,
    /// Client certificates offered when the server asks for one.
    pub client: Vec<ClientCertFiles>,
}

/// A client certificate and its key, as PEM files.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClientCertFiles {
    /// The certificate chain, end-entity certificate first.
    pub cert: PathBuf,
    /// The private key; `None` when it is in the `cert` file.
    pub key: Option<PathBuf>,
}

impl TlsOptions {
    /// True when nothing differs from the default.
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// A rustls client configuration built from [`TlsOptions`].
#[derive(Clone)]
pub(crate) struct TlsConfig(Arc<ClientConfig>);

impl TlsConfig {
    /// The rustls configuration (hyper-rustls takes it by value).
    pub(crate) fn client_config(&self) -> ClientConfig {
        (*self.0).clone()
    }
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("client_auth", &self.0.client_auth_cert_resolver.has_certs())
            .finish_non_exhaustive()
    }
}

/// A configuration is a function of the [`TlsOptions`] it was built from,
/// which are what hosts compare; two configurations never decide equality.
impl PartialEq for TlsConfig {
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

impl Eq for TlsConfig {}

fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// The system's trust roots, read on first use and shared by every client.
fn system_roots() -> Arc<RootCertStore> {
    static ROOTS: OnceLock<Arc<RootCertStore>> = OnceLock::new();
    ROOTS.get_or_init(|| Arc::new(load_system_roots())).clone()
}

fn load_system_roots() -> RootCertStore {
    let mut roots = RootCertStore::empty();
    let file = std::env::var_os("SSL_CERT_FILE")
        .map(PathBuf::from)
        .or_else(|| CERT_FILES.iter().map(PathBuf::from).find(|p| p.is_file()));
    let dirs: Vec<PathBuf> = match std::env::var_os("SSL_CERT_DIR") {
        Some(v) => std::env::split_paths(&v).collect(),
        None if file.is_none() => vec![PathBuf::from(CERT_DIR)],
        None => Vec::new(),
    };
    if let Some(file) = &file {
        add_system_pem(&mut roots, file);
    }
    for dir in &dirs {
        let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
            Ok(entries) => entries.flatten().map(|e| e.path()).collect(),
            Err(e) => {
                tracing::debug!(dir = %dir.display(), error = %e, "no system certificate directory");
                continue;
            }
        };
        files.sort();
        for f in files.iter().filter(|p| p.is_file()) {
            add_system_pem(&mut roots, f);
        }
    }
    if roots.is_empty() {
        tracing::warn!(
            "no system trust roots found; https registries need `ca` or `skip_verify` in hosts.toml"
        );
    } else {
        tracing::debug!(roots = roots.len(), "system trust roots loaded");
    }
    roots
}

/// Adds the certificates of a system PEM file, skipping what does not parse
/// (one bad file must not cost every other root).
fn add_system_pem(roots: &mut RootCertStore, path: &Path) {
    match std::fs::read(path) {
        Ok(data) => {
            let certs = CertificateDer::pem_slice_iter(&data).filter_map(Result::ok);
            let (_, ignored) = roots.add_parsable_certificates(certs);
            if ignored > 0 {
                tracing::debug!(path = %path.display(), ignored, "unusable system certificates");
            }
        }
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "cannot read system certificates");
        }
    }
}

/// A client config builder for `provider` with TLS 1.2 and 1.3.
fn versions(
    provider: Arc<CryptoProvider>,
) -> Result<rustls::ConfigBuilder<ClientConfig, rustls::WantsVerifier>, RegistryError> {
    ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(RegistryError::TlsSetup)
}

/// The configuration of hosts without TLS options, built once.
pub(crate) fn default_config() -> Result<TlsConfig, RegistryError> {
    static DEFAULT: OnceLock<TlsConfig> = OnceLock::new();
    if let Some(c) = DEFAULT.get() {
        return Ok(c.clone());
    }
    let config = versions(provider())?
        .with_root_certificates(system_roots())
        .with_no_client_auth();
    Ok(DEFAULT.get_or_init(|| TlsConfig(Arc::new(config))).clone())
}

/// Builds the client configuration for `options`, reading its files now:
/// a missing or unusable file is an error naming it.
pub(crate) fn client_config(options: &TlsOptions) -> Result<TlsConfig, RegistryError> {
    if options.is_default() {
        return default_config();
    }
    let provider = provider();
    // Read the CAs even with skip_verify, so that a wrong path is reported
    // whatever the other settings are (as containerd does).
    let mut roots = (*system_roots()).clone();
    for path in &options.ca {
        for cert in read_certs("CA certificate", path)? {
            roots
                .add(cert)
                .map_err(|e| tls_file("CA certificate", path, e))?;
        }
    }
    let builder = versions(provider.clone())?;
    let builder = if options.skip_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyServerCert {
                algorithms: provider.signature_verification_algorithms,
            }))
    } else {
        builder.with_root_certificates(roots)
    };
    let config = if options.client.is_empty() {
        builder.with_no_client_auth()
    } else {
        let keys = options
            .client
            .iter()
            .map(|c| client_key(c, &provider))
            .collect::<Result<Vec<_>, _>>()?;
        builder.with_client_cert_resolver(Arc::new(ClientCerts(keys)))
    };
    Ok(TlsConfig(Arc::new(config)))
}

fn tls_file(
    what: &'static str,
    path: &Path,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> RegistryError {
    RegistryError::TlsFile {
        what,
        path: path.display().to_string(),
        source: source.into(),
    }
}

fn read_file(what: &'static str, path: &Path) -> Result<Vec<u8>, RegistryError> {
    std::fs::read(path).map_err(|e| tls_file(what, path, e))
}

/// Every certificate of a PEM file; none at all is an error.
fn read_certs(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, RegistryError> {
    let data = read_file(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&data)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_file(what, path, e))?;
    if certs.is_empty() {
        return Err(tls_file(what, path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

fn client_key(
    files: &ClientCertFiles,
    provider: &CryptoProvider,
) -> Result<Arc<CertifiedKey>, RegistryError> {
    let chain = read_certs("client certificate", &files.cert)?;
    let key_path = files.key.as_deref().unwrap_or(&files.cert);
    let key = PrivateKeyDer::from_pem_slice(&read_file("client key", key_path)?)
        .map_err(|e| tls_file("client key", key_path, e))?;
    let key = CertifiedKey::from_der(chain, key, provider)
        .map_err(|e| tls_file("client key", key_path, e))?;
    Ok(Arc::new(key))
}

/// `skip_verify`: any certificate chain and name are accepted, but the
/// server must still prove it holds the certificate's key (handshake
/// signatures are checked with the ring provider's algorithms).
#[derive(Debug)]
struct AcceptAnyServerCert {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for AcceptAnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The client certificates of a host: the first whose key can sign with a
/// scheme the server accepts is offered.
#[derive(Debug)]
struct ClientCerts(Vec<Arc<CertifiedKey>>);

impl ResolvesClientCert for ClientCerts {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.0
            .iter()
            .find(|k| k.key.choose_scheme(sigschemes).is_some())
            .cloned()
    }

    fn has_certs(&self) -> bool {
        !self.0.is_empty()
    }
}

/// `err` and its causes, including the errors inside (nested) `io::Error`s:
/// `io::Error::source` skips the error it wraps, so those are opened with
/// `get_ref` (TLS streams and hyper-rustls wrap rustls errors that way).
pub(crate) fn error_chain<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(err), |e| {
        match e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        }
    })
}

/// The rustls error somewhere in `err`'s chain.
pub(crate) fn find_rustls_error<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rustls::Error> {
    error_chain(err).find_map(|e| e.downcast_ref::<rustls::Error>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_options_share_one_config() {
        let a = client_config(&TlsOptions::default()).unwrap();
        let b = default_config().unwrap();
        assert!(Arc::ptr_eq(&a.0, &b.0));
    }

    #[test]
    fn missing_and_empty_ca_files_are_errors_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let err = client_config(&TlsOptions {
            ca: vec![missing.clone()],
            ..Default::default()
        })
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&missing.display().to_string()), "{msg}");
        assert!(msg.contains("CA certificate"), "{msg}");

        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = client_config(&TlsOptions {
            ca: vec![empty.clone()],
            skip_verify: true,
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            matches!(&err, RegistryError::TlsFile { path, .. } if *path == empty.display().to_string()),
            "{err:?}"
        );
    }

    #[test]
    fn client_key_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("client.pem");
        let err = client_config(&TlsOptions {
            client: vec![ClientCertFiles {
                cert: cert.clone(),
                key: None,
            }],
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("client certificate"), "{err}");
        assert!(
            err.to_string().contains(&cert.display().to_string()),
            "{err}"
        );
    }

    #[test]
    fn skip_verify_alone_builds() {
        let c = client_config(&TlsOptions {
            skip_verify: true,
            ..Default::default()
        })
        .unwrap();
        assert!(c.client_config().alpn_protocols.is_empty());
    }

    #[test]
    fn finds_rustls_errors_inside_io_errors() {
        let inner = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, inner.clone());
        assert_eq!(find_rustls_error(&io), Some(&inner));
        // hyper-rustls wraps the handshake's io::Error in another one.
        let twice = std::io::Error::other(io);
        assert_eq!(find_rustls_error(&twice), Some(&inner));
        let plain = std::io::Error::other("x");
        assert_eq!(find_rustls_error(&plain), None);
    }
}
