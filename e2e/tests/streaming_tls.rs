//! The streaming server over TLS: with `streaming.tls_cert_file` and
//! `tls_key_file` set, Exec returns an `https://` URL, a WebSocket client
//! that trusts the test CA runs the command over `wss://`, a client that
//! does not trust it is refused by its own verification, and plain HTTP to
//! the port gets no HTTP answer. The CA and the server certificate (for IP
//! 127.0.0.1) are made by `openssl` for this test only.
//!
//! Without the private containerd (or openssl) it prints SKIP and passes.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use cubelet_e2e::cri::ExecRequest;
use cubelet_e2e::{container_config, run, with_daemon, Daemon, DaemonOpts};
use futures::StreamExt;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";

/// A CA and a server certificate for 127.0.0.1 signed by it, in `dir`.
async fn make_certs(dir: &Path) -> anyhow::Result<()> {
    let p = |f: &str| dir.join(f).display().to_string();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    let (ca_key, ca_pem) = (p("ca.key"), p("ca.pem"));
    ca.extend([
        "-keyout",
        &ca_key,
        "-out",
        &ca_pem,
        "-days",
        "1",
        "-subj",
        "/CN=cubelet-e2e-ca",
    ]);
    run("openssl", &ca).await?;
    let mut csr = vec!["req"];
    csr.extend(ec);
    let (key, csr_file) = (p("server.key"), p("server.csr"));
    csr.extend(["-keyout", &key, "-out", &csr_file, "-subj", "/CN=127.0.0.1"]);
    run("openssl", &csr).await?;
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\n")?;
    let (ext, cert, serial) = (p("ext.cnf"), p("server.pem"), p("ca.srl"));
    run(
        "openssl",
        &[
            "x509",
            "-req",
            "-in",
            &csr_file,
            "-CA",
            &ca_pem,
            "-CAkey",
            &ca_key,
            "-CAserial",
            &serial,
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "1",
            "-extfile",
            &ext,
        ],
    )
    .await?;
    Ok(())
}

/// A TLS client trusting `ca` (or nothing but that CA: an empty store when
/// `None`).
fn connector(ca: Option<&Path>) -> anyhow::Result<TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(ca) = ca {
        for cert in CertificateDer::pem_file_iter(ca)? {
            roots.add(cert?)?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

async fn scenario(d: &Daemon, certs: &Path) -> anyhow::Result<()> {
    let (_, cid) = d
        .pod_with(
            "tls-exec",
            container_config("sleeper", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;
    let exec = |cmd: &[&str]| ExecRequest {
        container_id: cid.clone(),
        cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
        tty: false,
        stdin: false,
        stdout: true,
        stderr: true,
    };
    let mut rt = d.runtime.clone();
    let url = rt
        .exec(exec(&["sh", "-c", "echo hello-tls"]))
        .await?
        .into_inner()
        .url;
    ensure!(url.starts_with("https://127.0.0.1:"), "{url}");
    let authority = url
        .trim_start_matches("https://")
        .split('/')
        .next()
        .context("authority")?
        .to_owned();
    let server = ServerName::try_from("127.0.0.1")?;

    // A client that does not trust the CA: its own verification refuses.
    let tcp = TcpStream::connect(&authority).await?;
    let refused = connector(None)?.connect(server.clone(), tcp).await;
    let err = refused
        .err()
        .context("an untrusted server certificate was accepted")?;
    ensure!(
        err.to_string().contains("UnknownIssuer") || err.to_string().contains("unknown issuer"),
        "{err}"
    );

    // Plain HTTP to the TLS port: no HTTP answer.
    let mut tcp = TcpStream::connect(&authority).await?;
    tcp.write_all(b"GET /exec/x HTTP/1.1\r\nHost: x\r\n\r\n")
        .await?;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut buf)).await;
    ensure!(
        !buf.starts_with(b"HTTP/1."),
        "plain HTTP was answered: {:?}",
        String::from_utf8_lossy(&buf)
    );

    // The trusted client runs the command over wss://.
    let tcp = TcpStream::connect(&authority).await?;
    let tls = connector(Some(&certs.join("ca.pem")))?
        .connect(server, tcp)
        .await
        .context("TLS handshake with the CA trusted")?;
    let mut req = url
        .replacen("https://", "wss://", 1)
        .into_client_request()?;
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", "v5.channel.k8s.io".parse()?);
    let (mut ws, _) = tokio_tungstenite::client_async(req, tls).await?;
    let (mut stdout, mut status) = (Vec::new(), Vec::new());
    while let Some(m) = ws.next().await {
        match m? {
            Message::Binary(b) => match b.split_first() {
                Some((1, rest)) => stdout.extend_from_slice(rest),
                Some((3, rest)) => status.extend_from_slice(rest),
                _ => {}
            },
            Message::Close(_) => break,
            _ => {}
        }
    }
    ensure!(
        stdout == b"hello-tls\n",
        "stdout {:?}",
        String::from_utf8_lossy(&stdout)
    );
    let status: serde_json::Value = serde_json::from_slice(&status).context("status")?;
    ensure!(status["status"] == "Success", "{status}");
    d.remove_all().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_over_tls() {
    if run("openssl", &["version"]).await.is_err() {
        println!("SKIP: no openssl");
        return;
    }
    let certs = tempfile::tempdir().expect("tempdir");
    make_certs(certs.path()).await.expect("certificates");
    let extra = format!(
        "streaming: {{ tls_cert_file: {}, tls_key_file: {} }}\n",
        certs.path().join("server.pem").display(),
        certs.path().join("server.key").display()
    );
    let opts = DaemonOpts {
        index: 16,
        extra_config: Some(extra),
        ..Default::default()
    };
    let dir = certs.path().to_path_buf();
    with_daemon(opts, Duration::from_secs(180), |d| {
        Box::pin(async move { scenario(d, &dir).await })
    })
    .await;
}
