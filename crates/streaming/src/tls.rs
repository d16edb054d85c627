//! Optional TLS for the streaming server: a certificate chain and key in PEM
//! files, TLS 1.2/1.3 with the ring provider, HTTP/1.1 only (the upgrades
//! to WebSocket and SPDY need it).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::StreamingError;

/// PEM files of the streaming server's certificate chain and private key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// Private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

fn invalid(path: &Path, what: &'static str, e: impl std::fmt::Display) -> StreamingError {
    StreamingError::Tls {
        what,
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// Loads `files` into an acceptor.
pub(crate) fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, StreamingError> {
    let certs = CertificateDer::pem_file_iter(&files.cert_file)
        .map_err(|e| invalid(&files.cert_file, "certificate", e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(&files.cert_file, "certificate", e))?;
    if certs.is_empty() {
        return Err(invalid(
            &files.cert_file,
            "certificate",
            "no CERTIFICATE block",
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key_file)
        .map_err(|e| invalid(&files.key_file, "key", e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(&files.cert_file, "setup", e))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| invalid(&files.key_file, "key pair", e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_or_empty_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("cert.pem");
        let key = dir.path().join("key.pem");
        let files = TlsFiles {
            cert_file: cert.clone(),
            key_file: key.clone(),
        };
        let e = acceptor(&files).err().unwrap().to_string();
        assert!(e.contains("cert.pem"), "{e}");
        std::fs::write(&cert, "not pem\n").unwrap();
        let e = acceptor(&files).err().unwrap().to_string();
        assert!(e.contains("no CERTIFICATE block"), "{e}");
    }
}
