//! Image pull, unpack, status, removal and the pause image, against the
//! private containerd (`hack/containerd.sh start`) and registry
//! (`hack/registry.sh start && hack/test-images.sh`).
//!
//! Each test works in its own containerd namespace and deletes the namespace
//! at the end, which containerd only allows once it is empty: so a passing
//! test also proves it left nothing behind. Without the services the tests
//! print SKIP and pass.

// Helpers are test code too: a failed unwrap prints the error.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use containerd_client::services::v1::namespaces_client::NamespacesClient;
use containerd_client::services::v1::snapshots::{
    ListSnapshotsRequest, RemoveSnapshotRequest, StatSnapshotRequest,
};
use containerd_client::services::v1::{
    DeleteContentRequest, DeleteImageRequest, DeleteNamespaceRequest, DeleteRequest, InfoRequest,
    ListContentRequest, ListImagesRequest, ListRequest,
};
use cubelet_runtime::image::{ImageService, DEFAULT_SNAPSHOTTER};
use cubelet_runtime::registry::RegistryError;
use cubelet_runtime::sandbox::pause::{ensure_pause_image, pause_image_ref};
use cubelet_runtime::{Containerd, RuntimeError};

const DEFAULT_SOCKET: &str = "/run/cubelet-test/containerd/containerd.sock";
const DEFAULT_ROOT: &str = "/var/lib/cubelet-test/containerd";

fn socket() -> PathBuf {
    std::env::var_os("CUBELET_TEST_CONTAINERD").map_or_else(|| DEFAULT_SOCKET.into(), PathBuf::from)
}

fn registry() -> String {
    std::env::var("REGISTRY_ADDR").unwrap_or_else(|_| "127.0.0.1:5000".to_owned())
}

/// A test's own namespace; `finish` empties and deletes it.
struct Env {
    images: ImageService,
    cd: Containerd,
    namespace: String,
}

async fn setup(test: &str) -> Option<Env> {
    static N: AtomicU32 = AtomicU32::new(0);
    let sock = socket();
    if !sock.exists() {
        eprintln!(
            "SKIP {test}: no containerd socket at {} (run hack/containerd.sh start)",
            sock.display()
        );
        return None;
    }
    if std::net::TcpStream::connect(registry()).is_err() {
        eprintln!(
            "SKIP {test}: no registry at {} (run hack/registry.sh start && hack/test-images.sh)",
            registry()
        );
        return None;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let namespace = format!(
        "cubelet-test-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    let cd = Containerd::connect(&sock, &namespace).await.unwrap();
    let images = ImageService::new(cd.clone(), "/nonexistent/cubelet-test-certs.d");
    Some(Env {
        images,
        cd,
        namespace,
    })
}

impl Env {
    async fn snapshot_exists(&self, key: &str) -> bool {
        let req = StatSnapshotRequest {
            snapshotter: DEFAULT_SNAPSHOTTER.into(),
            key: key.into(),
        };
        match self.cd.snapshots().stat(self.cd.request(req)).await {
            Ok(_) => true,
            Err(s) if s.code() == tonic::Code::NotFound => false,
            Err(s) => panic!("stat snapshot: {s}"),
        }
    }

    async fn content_labels(&self, digest: &str) -> HashMap<String, String> {
        let req = InfoRequest {
            digest: digest.into(),
        };
        self.cd
            .content()
            .info(self.cd.request(req))
            .await
            .unwrap()
            .into_inner()
            .info
            .unwrap()
            .labels
    }

    async fn lease_count(&self) -> usize {
        let req = ListRequest { filters: vec![] };
        self.cd
            .leases()
            .list(self.cd.request(req))
            .await
            .unwrap()
            .into_inner()
            .leases
            .len()
    }

    /// Removes everything left in the namespace, then the namespace itself,
    /// and fails if anything was left (the code under test must leave
    /// nothing once its images are removed).
    async fn finish(self) {
        let cd = &self.cd;
        let mut left = Vec::new();
        let imgs = cd
            .images()
            .list(cd.request(ListImagesRequest { filters: vec![] }))
            .await
            .unwrap();
        for i in imgs.into_inner().images {
            left.push(format!("image {}", i.name));
            let _ = cd
                .images()
                .delete(cd.request(DeleteImageRequest {
                    name: i.name,
                    sync: true,
                    target: None,
                }))
                .await;
        }
        let leases = cd
            .leases()
            .list(cd.request(ListRequest { filters: vec![] }))
            .await
            .unwrap();
        for l in leases.into_inner().leases {
            left.push(format!("lease {}", l.id));
            let _ = cd
                .leases()
                .delete(cd.request(DeleteRequest {
                    id: l.id,
                    sync: true,
                }))
                .await;
        }
        // Snapshots: remove leaves first until none is left.
        for round in 0..20 {
            let req = ListSnapshotsRequest {
                snapshotter: DEFAULT_SNAPSHOTTER.into(),
                filters: vec![],
            };
            let mut stream = cd
                .snapshots()
                .list(cd.request(req))
                .await
                .unwrap()
                .into_inner();
            let mut keys = Vec::new();
            while let Some(m) = stream.message().await.unwrap() {
                keys.extend(m.info.into_iter().map(|i| i.name));
            }
            if keys.is_empty() {
                break;
            }
            if round == 0 {
                left.extend(keys.iter().map(|k| format!("snapshot {k}")));
            }
            for key in keys {
                let req = RemoveSnapshotRequest {
                    snapshotter: DEFAULT_SNAPSHOTTER.into(),
                    key,
                };
                let _ = cd.snapshots().remove(cd.request(req)).await;
            }
        }
        let mut stream = cd
            .content()
            .list(cd.request(ListContentRequest { filters: vec![] }))
            .await
            .unwrap()
            .into_inner();
        let mut digests = Vec::new();
        while let Some(m) = stream.message().await.unwrap() {
            digests.extend(m.info.into_iter().map(|i| i.digest));
        }
        for digest in digests {
            left.push(format!("content {digest}"));
            let _ = cd
                .content()
                .delete(cd.request(DeleteContentRequest { digest }))
                .await;
        }
        let channel = containerd_client::connect(socket()).await.unwrap();
        match NamespacesClient::new(channel)
            .delete(DeleteNamespaceRequest {
                name: self.namespace.clone(),
            })
            .await
        {
            Ok(_) => {}
            // Nothing was ever created in it.
            Err(s) if s.code() == tonic::Code::NotFound => {}
            Err(s) => panic!("namespace {} not empty after cleanup: {s}", self.namespace),
        }
        assert!(left.is_empty(), "test left objects in containerd: {left:?}");
    }
}

#[tokio::test]
async fn pull_schema2_image_status_and_unpack() {
    let Some(env) = setup("pull_schema2_image_status_and_unpack").await else {
        return;
    };
    let reference = format!("{}/busybox:test", registry());
    let info = env.images.pull(&reference, None).await.unwrap();
    assert_eq!(info.repo_tags, vec![reference.clone()]);
    assert_eq!(
        info.repo_digests,
        vec![format!("{}/busybox@{}", registry(), info.target_digest)]
    );
    assert!(
        info.id.starts_with("sha256:") && info.id.len() == 71,
        "{}",
        info.id
    );
    assert!(info.size > 1_000_000, "size {}", info.size);
    assert_eq!(info.config.cmd, vec!["sh".to_owned()]);
    assert_eq!(info.config.user, "");
    assert!(
        info.config.env.contains(&"CUBELET_TEST=busybox".to_owned()),
        "{:?}",
        info.config.env
    );
    assert_eq!(info.config.working_dir, "/");
    assert_eq!(info.config.stop_signal, "SIGTERM");
    assert_eq!(
        info.config
            .labels
            .get("io.cubelet.test")
            .map(String::as_str),
        Some("busybox")
    );
    assert!(!info.pinned);
    assert!(
        env.snapshot_exists(&info.chain_id).await,
        "top snapshot {}",
        info.chain_id
    );
    let labels = env.content_labels(&info.id).await;
    assert_eq!(
        labels.get("containerd.io/gc.ref.snapshot.overlayfs"),
        Some(&info.chain_id)
    );
    let mlabels = env.content_labels(&info.target_digest).await;
    assert_eq!(
        mlabels.get("containerd.io/gc.ref.content.config"),
        Some(&info.id)
    );
    assert!(
        mlabels.contains_key("containerd.io/gc.ref.content.l.1"),
        "{mlabels:?}"
    );
    assert_eq!(env.lease_count().await, 0, "pull left its lease behind");

    // Idempotent, and found by short forms too.
    let again = env.images.pull(&reference, None).await.unwrap();
    assert_eq!(again, info);
    assert_eq!(
        env.images.status(&info.id).await.unwrap().as_ref(),
        Some(&info)
    );
    assert_eq!(
        env.images
            .status(info.id.trim_start_matches("sha256:"))
            .await
            .unwrap()
            .as_ref(),
        Some(&info)
    );
    assert_eq!(
        env.images
            .status(&info.repo_digests[0])
            .await
            .unwrap()
            .as_ref(),
        Some(&info)
    );
    assert_eq!(env.images.list().await.unwrap(), vec![info.clone()]);

    env.images.remove(&reference).await.unwrap();
    assert_eq!(env.images.status(&reference).await.unwrap(), None);
    assert!(env.images.list().await.unwrap().is_empty());
    env.finish().await;
}

/// A record's manifest and config are read from the content store once:
/// later lookups of an unchanged record do not read them again (a service
/// without that cache finds the record unreadable once its config is gone).
#[tokio::test]
async fn image_documents_are_read_once_per_record() {
    let Some(env) = setup("image_documents_are_read_once_per_record").await else {
        return;
    };
    let reference = format!("{}/busybox:test", registry());
    let info = env.images.pull(&reference, None).await.unwrap();
    assert_eq!(
        env.images.status(&reference).await.unwrap().as_ref(),
        Some(&info)
    );
    env.cd
        .content()
        .delete(env.cd.request(DeleteContentRequest {
            digest: info.id.clone(),
        }))
        .await
        .unwrap();
    let again = env.images.status(&reference).await.unwrap();
    assert_eq!(again.as_ref(), Some(&info), "read again");
    // Every status, listing and removal copies each image's info: the
    // config (as large as an image's author wants) is shared, not copied,
    // and the tag's and the digest's records share one.
    let by_digest = env.images.status(&info.repo_digests[0]).await.unwrap();
    let (again, by_digest) = (again.unwrap(), by_digest.unwrap());
    assert!(std::sync::Arc::ptr_eq(&again.config, &by_digest.config));
    let listed = env.images.list().await.unwrap();
    let listed = listed.iter().find(|i| i.id == info.id).unwrap();
    assert!(std::sync::Arc::ptr_eq(&again.config, &listed.config));
    let fresh = ImageService::new(env.cd.clone(), "/nonexistent/cubelet-test-certs.d");
    assert_eq!(fresh.status(&reference).await.unwrap(), None);
    env.images.remove(&reference).await.unwrap();
    assert_eq!(env.images.status(&reference).await.unwrap(), None);
    env.finish().await;
}

#[tokio::test]
async fn pull_oci_image() {
    let Some(env) = setup("pull_oci_image").await else {
        return;
    };
    let reference = format!("{}/busybox-oci:test", registry());
    let info = env.images.pull(&reference, None).await.unwrap();
    assert_eq!(info.config.user, "tester");
    assert_eq!(info.config.cmd, vec!["sleep".to_owned(), "3600".to_owned()]);
    assert!(info
        .config
        .env
        .contains(&"CUBELET_TEST=busybox-oci".to_owned()));
    assert!(env.snapshot_exists(&info.chain_id).await);
    env.images.remove(&info.id).await.unwrap();
    env.finish().await;
}

#[tokio::test]
async fn pull_manifest_list_picks_linux_amd64() {
    let Some(env) = setup("pull_manifest_list_picks_linux_amd64").await else {
        return;
    };
    let reference = format!("{}/busybox-multi:test", registry());
    let info = env.images.pull(&reference, None).await.unwrap();
    assert_eq!(
        info.config.cmd,
        vec!["sh".to_owned()],
        "picked the wrong platform"
    );
    assert!(info.config.env.contains(&"CUBELET_TEST=busybox".to_owned()));
    // The record targets the list itself, labelled to keep the chosen manifest.
    let labels = env.content_labels(&info.target_digest).await;
    assert!(
        labels
            .keys()
            .any(|k| k.starts_with("containerd.io/gc.ref.content.m.")),
        "{labels:?}"
    );
    assert!(env.snapshot_exists(&info.chain_id).await);
    env.images.remove(&reference).await.unwrap();
    env.finish().await;
}

#[tokio::test]
async fn pull_missing_tag_is_not_found() {
    let Some(env) = setup("pull_missing_tag_is_not_found").await else {
        return;
    };
    let reference = format!("{}/busybox:no-such-tag", registry());
    let err = env.images.pull(&reference, None).await.unwrap_err();
    assert!(matches!(err, RuntimeError::NotFound { .. }), "{err:?}");
    assert!(err.to_string().contains(&reference), "{err}");
    let err = env
        .images
        .pull(&format!("{}/no-such-repo:test", registry()), None)
        .await
        .unwrap_err();
    assert!(err.is_not_found(), "{err:?}");
    env.finish().await;
}

#[tokio::test]
async fn remove_is_idempotent_and_gc_takes_snapshots() {
    let Some(env) = setup("remove_is_idempotent_and_gc_takes_snapshots").await else {
        return;
    };
    let reference = format!("{}/busybox:test", registry());
    env.images.remove(&reference).await.unwrap();
    let info = env.images.pull(&reference, None).await.unwrap();
    env.images.remove(&info.id).await.unwrap();
    env.images.remove(&info.id).await.unwrap();
    env.images.remove(&reference).await.unwrap();
    assert_eq!(env.images.status(&info.id).await.unwrap(), None);
    assert!(
        !env.snapshot_exists(&info.chain_id).await,
        "GC kept the unpacked snapshot"
    );
    env.finish().await;
}

#[tokio::test]
async fn pull_through_hosts_toml_mirror() {
    let Some(env) = setup("pull_through_hosts_toml_mirror").await else {
        return;
    };
    let certs = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(certs.path().join("registry.k8s.io")).unwrap();
    std::fs::write(
        certs.path().join("registry.k8s.io/hosts.toml"),
        format!(
            "server = \"https://registry.k8s.io\"\n[host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            registry()
        ),
    )
    .unwrap();
    let images = ImageService::new(env.cd.clone(), certs.path());
    let info = images
        .pull("registry.k8s.io/busybox:test", None)
        .await
        .unwrap();
    assert_eq!(
        info.repo_tags,
        vec!["registry.k8s.io/busybox:test".to_owned()]
    );
    assert_eq!(info.config.cmd, vec!["sh".to_owned()]);
    images.remove("registry.k8s.io/busybox:test").await.unwrap();
    env.finish().await;
}

fn pause_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("PAUSE_BIN") {
        return p.into();
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/cubelet-pause");
    if built.exists() {
        return built;
    }
    // The import does not run the binary: any static executable will do.
    PathBuf::from("/bin/busybox")
}

#[tokio::test]
async fn pause_image_import_is_pinned_and_idempotent() {
    let Some(env) = setup("pause_image_import_is_pinned_and_idempotent").await else {
        return;
    };
    let bin = pause_binary();
    let info = ensure_pause_image(&env.images, &bin).await.unwrap();
    assert_eq!(info.repo_tags, vec![pause_image_ref()]);
    assert!(info.pinned);
    assert_eq!(info.config.entrypoint, vec!["/pause".to_owned()]);
    assert!(env.snapshot_exists(&info.chain_id).await);
    let size = std::fs::metadata(&bin).unwrap().len();
    assert!(
        info.size > 0 && info.size < size + 4096,
        "layer size {} for binary {size}",
        info.size
    );
    assert_eq!(ensure_pause_image(&env.images, &bin).await.unwrap(), info);
    assert_eq!(env.lease_count().await, 0);
    env.images.remove(&pause_image_ref()).await.unwrap();
    env.finish().await;
}

#[tokio::test]
async fn fs_info_reports_usage() {
    let Some(env) = setup("fs_info_reports_usage").await else {
        return;
    };
    let root =
        PathBuf::from(std::env::var("CONTAINERD_ROOT").unwrap_or_else(|_| DEFAULT_ROOT.to_owned()));
    let snap = root.join("io.containerd.snapshotter.v1.overlayfs");
    let content = root.join("io.containerd.content.v1.content");
    let info = env
        .images
        .pull(&format!("{}/busybox:test", registry()), None)
        .await
        .unwrap();
    let usage = env.images.fs_info(&snap, &content).await.unwrap();
    assert_eq!(usage.len(), 2);
    assert_eq!(usage[0].mountpoint, snap);
    assert!(
        usage[0].used_bytes > 1_000_000 && usage[0].inodes_used > 10,
        "{usage:?}"
    );
    assert!(usage[1].used_bytes >= info.size, "{usage:?}");
    env.images.remove(&info.id).await.unwrap();
    env.finish().await;
}

// ---- HTTPS registries ----------------------------------------------------

const REGISTRY_ROOT: &str = "/var/lib/cubelet-test/registry";

/// `err` and its causes, one per line part.
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        out.push_str(": ");
        out.push_str(&e.to_string());
        cur = e.source();
    }
    out
}

fn runs(program: &str, arg: &str) -> bool {
    std::process::Command::new(program)
        .arg(arg)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A throw-away CA (`ca.pem`), a server certificate for IP 127.0.0.1
/// (`server.pem`, `server.key`) and a client certificate (`client.pem`,
/// `client.key`, and both in `client-both.pem`), all signed by the CA.
fn make_certs(dir: &Path) {
    std::fs::write(
        dir.join("openssl.cnf"),
        "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = cubelet-test\n\
         [ca]\nbasicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign,cRLSign\n\
         subjectKeyIdentifier = hash\n\
         [server]\nbasicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature\n\
         extendedKeyUsage = serverAuth\nsubjectAltName = IP:127.0.0.1\n\
         [client]\nbasicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature\n\
         extendedKeyUsage = clientAuth\n",
    )
    .unwrap();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut ca = vec![
        "req",
        "-x509",
        "-config",
        "openssl.cnf",
        "-extensions",
        "ca",
    ];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=cubelet-test-ca",
    ]);
    openssl(dir, &ca);
    for (name, cn) in [
        ("server", "/CN=127.0.0.1"),
        ("client", "/CN=cubelet-test-client"),
    ] {
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let pem = format!("{name}.pem");
        let mut req = vec!["req", "-new", "-config", "openssl.cnf"];
        req.extend(ec);
        req.extend(["-keyout", &key, "-out", &csr, "-subj", cn]);
        openssl(dir, &req);
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "openssl.cnf",
                "-extensions",
                name,
                "-out",
                &pem,
            ],
        );
    }
    let both = [
        std::fs::read(dir.join("client.pem")).unwrap(),
        std::fs::read(dir.join("client.key")).unwrap(),
    ]
    .concat();
    std::fs::write(dir.join("client-both.pem"), both).unwrap();
}

/// A `docker-registry` serving the plain test registry's storage over TLS
/// on a free port of 127.0.0.1, read-only; killed (and its certificates
/// removed) when dropped, also when a test fails.
struct TlsRegistry {
    child: std::process::Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Drop for TlsRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.path().join("registry.log"));
            eprintln!("TLS registry log:\n{}", log.unwrap_or_default());
        }
    }
}

impl TlsRegistry {
    /// Starts one, or says why it cannot (SKIP).
    fn start(test: &str, client_auth: bool) -> Option<Self> {
        let bin = std::env::var("REGISTRY_BIN").unwrap_or_else(|_| "docker-registry".to_owned());
        if !runs(&bin, "--version") {
            eprintln!("SKIP {test}: no {bin} (Debian package docker-registry)");
            return None;
        }
        if !runs("openssl", "version") {
            eprintln!("SKIP {test}: no openssl");
            return None;
        }
        let root = std::env::var("REGISTRY_ROOT").unwrap_or_else(|_| REGISTRY_ROOT.to_owned());
        if !Path::new(&root).is_dir() {
            eprintln!("SKIP {test}: no registry storage at {root}");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        make_certs(dir.path());
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let d = dir.path().display();
        let client_cas = if client_auth {
            format!("    clientcas:\n      - {d}/ca.pem\n")
        } else {
            String::new()
        };
        // Read-only and without upload purging: it shares the plain
        // registry's storage and must not change it.
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root}\n\
             \x20 maintenance:\n    uploadpurging:\n      enabled: false\n    readonly:\n      enabled: true\n\
             http:\n  addr: 127.0.0.1:{port}\n  tls:\n    certificate: {d}/server.pem\n    key: {d}/server.key\n\
             {client_cas}"
        );
        let config_path = dir.path().join("config.yml");
        std::fs::write(&config_path, config).unwrap();
        let log = std::fs::File::create(dir.path().join("registry.log")).unwrap();
        let child = std::process::Command::new(&bin)
            .arg("serve")
            .arg(&config_path)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut reg = TlsRegistry { child, port, dir };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = reg.child.try_wait().unwrap() {
                panic!("{bin} exited with {status} before answering");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{bin} did not listen on 127.0.0.1:{port} within 20 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Some(reg)
    }

    fn authority(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// A registry config dir with `hosts.toml` (and the CA and client
    /// files beside it, so relative paths are exercised) for this registry.
    fn certs_dir(&self, hosts_toml: &str) -> tempfile::TempDir {
        let certs = tempfile::tempdir().unwrap();
        let host_dir = certs.path().join(self.authority());
        std::fs::create_dir_all(&host_dir).unwrap();
        for f in ["ca.pem", "client.pem", "client.key", "client-both.pem"] {
            std::fs::copy(self.dir.path().join(f), host_dir.join(f)).unwrap();
        }
        std::fs::write(host_dir.join("hosts.toml"), hosts_toml).unwrap();
        certs
    }
}

/// Pulls `reference` with the hosts.toml files of `certs`, checks the image
/// and removes it.
async fn pull_and_remove(env: &Env, certs: &Path, reference: &str) {
    let images = ImageService::new(env.cd.clone(), certs);
    let info = match images.pull(reference, None).await {
        Ok(info) => info,
        Err(e) => panic!("pull {reference}: {}", error_chain(&e)),
    };
    assert_eq!(info.repo_tags, vec![reference.to_owned()]);
    assert_eq!(info.config.cmd, vec!["sh".to_owned()]);
    assert!(env.snapshot_exists(&info.chain_id).await);
    images.remove(reference).await.unwrap();
}

#[tokio::test]
async fn pull_over_https_with_ca_or_skip_verify() {
    let test = "pull_over_https_with_ca_or_skip_verify";
    let Some(env) = setup(test).await else {
        return;
    };
    let Some(reg) = TlsRegistry::start(test, false) else {
        env.finish().await;
        return;
    };
    let host = reg.authority();
    let reference = format!("{host}/busybox:test");

    // The server's CA from a hosts.toml, by a path relative to it.
    let certs = reg.certs_dir(&format!("server = \"https://{host}\"\nca = \"ca.pem\"\n"));
    pull_and_remove(&env, certs.path(), &reference).await;

    // Without a hosts.toml the system roots do not know the CA.
    let none = tempfile::tempdir().unwrap();
    let err = ImageService::new(env.cd.clone(), none.path())
        .pull(&reference, None)
        .await
        .unwrap_err();
    let chain = error_chain(&err);
    assert!(
        matches!(
            err,
            RuntimeError::Registry(RegistryError::Certificate { .. })
        ),
        "{chain}"
    );
    assert!(
        chain.contains("certificate") && chain.contains("UnknownIssuer"),
        "{chain}"
    );

    // skip_verify on a [host] entry accepts the unknown certificate.
    let certs = reg.certs_dir(&format!(
        "[host.\"https://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n  skip_verify = true\n"
    ));
    pull_and_remove(&env, certs.path(), &reference).await;

    drop(reg);
    env.finish().await;
}

#[tokio::test]
async fn pull_over_mutual_tls_with_client_certificates() {
    let test = "pull_over_mutual_tls_with_client_certificates";
    let Some(env) = setup(test).await else {
        return;
    };
    let Some(reg) = TlsRegistry::start(test, true) else {
        env.finish().await;
        return;
    };
    let host = reg.authority();
    let reference = format!("{host}/busybox:test");

    // The server asks for a client certificate and gets none.
    let certs = reg.certs_dir(&format!("server = \"https://{host}\"\nca = \"ca.pem\"\n"));
    let err = ImageService::new(env.cd.clone(), certs.path())
        .pull(&reference, None)
        .await
        .unwrap_err();
    let chain = error_chain(&err);
    // Go ≥ 1.21 sends certificate_required, older versions bad_certificate.
    assert!(
        chain.contains("fatal alert")
            && (chain.contains("CertificateRequired") || chain.contains("BadCertificate")),
        "{chain}"
    );

    // Certificate and key as a pair, then both in one file.
    let certs = reg.certs_dir(&format!(
        "server = \"https://{host}\"\nca = \"ca.pem\"\nclient = [[\"client.pem\", \"client.key\"]]\n"
    ));
    pull_and_remove(&env, certs.path(), &reference).await;
    let certs = reg.certs_dir(&format!(
        "server = \"https://{host}\"\nca = \"ca.pem\"\nclient = \"client-both.pem\"\n"
    ));
    pull_and_remove(&env, certs.path(), &reference).await;

    drop(reg);
    env.finish().await;
}

/// Counts the pulls an [`ImageService`] reports.
#[derive(Debug, Default)]
struct CountingObserver {
    started: std::sync::atomic::AtomicUsize,
    finished: std::sync::Mutex<Vec<Option<u64>>>,
}

impl cubelet_runtime::image::PullObserver for CountingObserver {
    fn pull_started(&self) {
        self.started.fetch_add(1, Ordering::SeqCst);
    }

    fn pull_finished(&self, size: Option<u64>, _elapsed: std::time::Duration) {
        self.finished.lock().unwrap().push(size);
    }
}

#[tokio::test]
async fn concurrent_pulls_of_one_image_are_one_download() {
    let Some(mut env) = setup("concurrent_pulls_of_one_image_are_one_download").await else {
        return;
    };
    let observer = std::sync::Arc::new(CountingObserver::default());
    env.images = env.images.clone().with_pull_observer(observer.clone());
    let reference = format!("{}/busybox:test", registry());

    // Five callers at once with the same (no) credentials: one pull.
    let pulls = (0..5).map(|_| env.images.pull(&reference, None));
    let infos = futures::future::join_all(pulls).await;
    let ids: Vec<_> = infos.into_iter().map(|i| i.unwrap().id).collect();
    assert!(ids.iter().all(|id| id == &ids[0]), "{ids:?}");
    assert_eq!(observer.started.load(Ordering::SeqCst), 1);
    let sizes = observer.finished.lock().unwrap().clone();
    assert_eq!(sizes.len(), 1);
    assert!(sizes[0].is_some_and(|s| s > 0), "{sizes:?}");

    // Other credentials never join: two pulls.
    let auth = cubelet_runtime::registry::RegistryAuth {
        username: "someone".into(),
        password: "secret".into(),
        ..Default::default()
    };
    let (a, b) = tokio::join!(
        env.images.pull(&reference, None),
        env.images.pull(&reference, Some(auth))
    );
    assert_eq!(a.unwrap().id, ids[0]);
    assert_eq!(b.unwrap().id, ids[0]);
    assert_eq!(observer.started.load(Ordering::SeqCst), 3);

    // A failure is shared too, and keeps its kind.
    let missing = format!("{}/busybox:no-such-tag", registry());
    let errs = futures::future::join_all((0..3).map(|_| env.images.pull(&missing, None))).await;
    assert_eq!(observer.started.load(Ordering::SeqCst), 4);
    for err in errs {
        let err = err.unwrap_err();
        assert!(err.is_not_found(), "{err:?}");
        assert!(err.to_string().contains(&missing), "{err}");
    }
    assert_eq!(observer.finished.lock().unwrap().last(), Some(&None));

    env.images.remove(&reference).await.unwrap();
    env.finish().await;
}

// ---- direct content writes -------------------------------------------------

/// A staging directory of the test's own beside containerd's root (one
/// file system, as a hard link needs), removed when dropped.
struct Staging(PathBuf);

impl Staging {
    fn new(test: &str) -> Self {
        let root = PathBuf::from(
            std::env::var("CONTAINERD_ROOT").unwrap_or_else(|_| DEFAULT_ROOT.to_owned()),
        );
        let dir = root
            .parent()
            .unwrap()
            .join(format!("ingest-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn content_root() -> PathBuf {
    PathBuf::from(std::env::var("CONTAINERD_ROOT").unwrap_or_else(|_| DEFAULT_ROOT.to_owned()))
        .join("io.containerd.content.v1.content")
}

/// Layers staged, linked into containerd's content directory and
/// committed with no data sent: the image is whole (unpacked, its layers
/// in the namespace, read back by digest), the staging directory is empty
/// and the pull's lease is gone.
#[tokio::test]
async fn pulled_layers_are_linked_into_the_content_directory() {
    let Some(mut env) = setup("pulled_layers_are_linked_into_the_content_directory").await else {
        return;
    };
    let staging = Staging::new("direct");
    let direct = std::sync::Arc::new(
        cubelet_runtime::image::DirectContent::open(&content_root(), &staging.0)
            .expect("the test containerd's content directory is usable")
            .with_min_size(0),
    );
    env.images = env.images.clone().with_direct_content(direct.clone()).await;
    assert!(direct.enabled(), "the probe did not see the linked blob");
    // The probe left nothing.
    assert_eq!(std::fs::read_dir(&staging.0).unwrap().count(), 0);
    let reference = format!("{}/busybox:test", registry());
    let info = env.images.pull(&reference, None).await.unwrap();
    assert!(direct.enabled(), "a layer write fell back");
    assert!(env.snapshot_exists(&info.chain_id).await);
    assert_eq!(std::fs::read_dir(&staging.0).unwrap().count(), 0);
    assert_eq!(env.lease_count().await, 0, "pull left its lease behind");
    let mlabels = env.content_labels(&info.target_digest).await;
    let layers: Vec<&String> = mlabels
        .iter()
        .filter(|(k, _)| k.starts_with("containerd.io/gc.ref.content.l."))
        .map(|(_, v)| v)
        .collect();
    assert!(!layers.is_empty(), "{mlabels:?}");
    for digest in layers {
        let hex = digest.strip_prefix("sha256:").unwrap();
        let blob = content_root().join("blobs/sha256").join(hex);
        let meta = std::fs::metadata(&blob).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            meta.nlink(),
            1,
            "{} still linked from staging",
            blob.display()
        );
        // It is whole, and committed in this namespace (Info finds it).
        let data = std::fs::read(&blob).unwrap();
        let actual = format!("sha256:{}", sha256_hex(&data));
        assert_eq!(&actual, digest);
        env.content_labels(digest).await;
    }
    // A second image sharing the layers commits them again at once.
    let again = env
        .images
        .pull(&format!("{}/busybox-oci:test", registry()), None)
        .await
        .unwrap();
    assert!(env.snapshot_exists(&again.chain_id).await);
    env.images.remove(&reference).await.unwrap();
    env.images.remove(&again.id).await.unwrap();
    env.finish().await;
}

/// A content directory containerd does not read (a stale or wrong
/// `containerd.root`): the probe finds out, nothing is left in it, and
/// pulls stream through the content API.
#[tokio::test]
async fn a_content_directory_containerd_does_not_read_is_not_used() {
    let Some(mut env) = setup("a_content_directory_containerd_does_not_read_is_not_used").await
    else {
        return;
    };
    let staging = Staging::new("wrong-root");
    let wrong = staging.0.join("content");
    std::fs::create_dir_all(wrong.join("blobs/sha256")).unwrap();
    let direct = std::sync::Arc::new(
        cubelet_runtime::image::DirectContent::open(&wrong, &staging.0.join("staging"))
            .unwrap()
            .with_min_size(0),
    );
    env.images = env.images.clone().with_direct_content(direct.clone()).await;
    assert!(!direct.enabled());
    assert_eq!(
        std::fs::read_dir(wrong.join("blobs/sha256"))
            .unwrap()
            .count(),
        0,
        "the probe's blob was left"
    );
    let reference = format!("{}/busybox:test", registry());
    let info = env.images.pull(&reference, None).await.unwrap();
    assert!(env.snapshot_exists(&info.chain_id).await);
    assert_eq!(
        std::fs::read_dir(wrong.join("blobs/sha256"))
            .unwrap()
            .count(),
        0
    );
    env.images.remove(&reference).await.unwrap();
    env.finish().await;
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(data))
}

/// containerd's errors name what they failed on, and a tenant may make
/// that long (a 500-layer image's `mount options is too long` is 46 KB):
/// a status past h2's default 16 KiB header limit arrives whole, with its
/// code, not as an `h2 protocol error`.
#[tokio::test]
async fn a_containerd_error_longer_than_16_kib_arrives_with_its_code() {
    let Some(env) = setup("a_containerd_error_longer_than_16_kib_arrives_with_its_code").await
    else {
        return;
    };
    let id = "x".repeat(40_000);
    let req = containerd_client::services::v1::GetContainerRequest { id: id.clone() };
    let err = env
        .cd
        .containers()
        .get(env.cd.request(req))
        .await
        .expect_err("no such container");
    assert!(
        matches!(
            err.code(),
            tonic::Code::NotFound | tonic::Code::InvalidArgument
        ),
        "{:?}: {:.200}",
        err.code(),
        err.message()
    );
    assert!(err.message().contains(&id), "{:.200}", err.message());
    env.finish().await;
}
