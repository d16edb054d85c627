//! Registries that misbehave, against a live daemon: a mirror that answers
//! 401 to fish for the pull's credentials, a registry that stalls (before
//! its headers, or in the middle of a blob), and one that sends a blob
//! larger than its descriptor says. The fakes are tiny HTTP/1.1 servers on
//! 127.0.0.1 written here on tokio; the daemon reaches them through a
//! hosts.toml in its `registry_config_dir`, as an operator would configure
//! a mirror.

use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use cubelet_e2e::cri::{AuthConfig, PullImageRequest};
use cubelet_e2e::{http_status, image_spec, run, with_daemon, Daemon, DaemonOpts, REGISTRY};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";
/// The password of the pull's credentials: no fake may ever see it.
const SECRET: &str = "e2e-hostile-secret";

/// What a fake does with one request, by its path.
enum Reply {
    /// A whole HTTP response; then the connection closes.
    Full(Vec<u8>),
    /// These bytes (maybe none), then nothing more on an open connection.
    Stall(Vec<u8>),
}

fn reply(status: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(body);
    Reply::Full(bytes)
}

type Handler = Arc<dyn Fn(&str) -> Reply + Send + Sync>;
/// Each request's path and `Authorization` header.
type Seen = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// A fake registry on 127.0.0.1; records each request's path and
/// `Authorization` header. Stops when dropped.
struct Fake {
    port: u16,
    seen: Seen,
    task: tokio::task::JoinHandle<()>,
}

impl Fake {
    async fn start(handler: Handler) -> anyhow::Result<Fake> {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let port = listener.local_addr()?.port();
        let seen = Seen::default();
        let log = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let handler = handler.clone();
                let log = log.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 2048];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&head).into_owned();
                    let path = head.split(' ').nth(1).unwrap_or_default().to_owned();
                    let auth = head.lines().find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("authorization")
                            .then(|| v.trim().to_owned())
                    });
                    if let Ok(mut seen) = log.lock() {
                        seen.push((path.clone(), auth));
                    }
                    match handler(&path) {
                        Reply::Full(bytes) => {
                            let _ = conn.write_all(&bytes).await;
                        }
                        Reply::Stall(bytes) => {
                            let _ = conn.write_all(&bytes).await;
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                        }
                    }
                });
            }
        });
        Ok(Fake { port, seen, task })
    }

    fn authority(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn requests(&self) -> Vec<(String, Option<String>)> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Writes `<registry_config_dir>/<registry>/hosts.toml`.
fn hosts_toml(d: &Daemon, registry: &str, text: &str) -> anyhow::Result<()> {
    let dir = d.config_dir().join("certs.d").join(registry);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("hosts.toml"), text)?;
    Ok(())
}

async fn pull_with(d: &Daemon, image: &str, auth: Option<AuthConfig>) -> Result<String, String> {
    d.images
        .clone()
        .pull_image(PullImageRequest {
            image: Some(image_spec(image)),
            auth,
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().image_ref)
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

/// The daemon is still ready and still pulls from the real registry.
async fn still_serving(d: &Daemon) -> anyhow::Result<()> {
    ensure!(
        http_status(d.metrics, "/readyz").await? == 200,
        "daemon not ready"
    );
    d.pull(BUSYBOX).await?;
    Ok(())
}

async fn mirror_scenario(d: &Daemon) -> anyhow::Result<()> {
    // One mirror asks for Basic auth, the other for a token from itself
    // (whose token endpoint refuses anonymous requests).
    let basic = Fake::start(Arc::new(|_: &str| {
        reply(
            "401 Unauthorized",
            &[("WWW-Authenticate", r#"Basic realm="mirror""#)],
            b"{}",
        )
    }))
    .await?;
    let realm = Arc::new(std::sync::OnceLock::<String>::new());
    let cell = realm.clone();
    let bearer = Fake::start(Arc::new(move |_: &str| {
        let realm = cell.get().map_or("", String::as_str);
        reply(
            "401 Unauthorized",
            &[(
                "WWW-Authenticate",
                &format!(r#"Bearer realm="{realm}",service="mirror""#),
            )],
            b"{}",
        )
    }))
    .await?;
    realm
        .set(format!("http://{}/token", bearer.authority()))
        .map_err(|_| anyhow::anyhow!("realm set twice"))?;
    hosts_toml(
        d,
        REGISTRY,
        &format!(
            "server = \"http://{REGISTRY}\"\n\
             [host.\"http://{b}\"]\n  capabilities = [\"pull\", \"resolve\"]\n\
             [host.\"http://{t}\"]\n  capabilities = [\"pull\", \"resolve\"]\n\
             [host.\"http://{REGISTRY}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            b = basic.authority(),
            t = bearer.authority(),
        ),
    )?;
    let auth = AuthConfig {
        username: "e2e-user".into(),
        password: SECRET.into(),
        server_address: REGISTRY.into(),
        ..Default::default()
    };
    let pulled = pull_with(d, BUSYBOX, Some(auth)).await;
    let seen: Vec<_> = basic
        .requests()
        .into_iter()
        .chain(bearer.requests())
        .collect();
    ensure!(
        seen.iter().any(|(p, _)| p.starts_with("/v2/")),
        "the mirrors were never asked: {seen:?}"
    );
    let leaked: Vec<_> = seen.iter().filter(|(_, a)| a.is_some()).collect();
    ensure!(
        leaked.is_empty(),
        "a mirror that answered 401 was sent credentials: {leaked:?}"
    );
    pulled.map_err(|e| anyhow::anyhow!("pull through the mirrors to the registry: {e}"))?;
    still_serving(d).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_that_answers_401_never_sees_the_credentials() {
    with_daemon(
        DaemonOpts {
            index: 42,
            ..Default::default()
        },
        Duration::from_secs(180),
        |d| Box::pin(mirror_scenario(d)),
    )
    .await;
}

/// `sha256:<hex>` of `data`, by `sha256sum`.
async fn sha256(dir: &Path, data: &[u8]) -> anyhow::Result<String> {
    let file = dir.join("blob");
    std::fs::write(&file, data)?;
    let out = run("sha256sum", &[&file.display().to_string()]).await?;
    let hex = out.split_whitespace().next().context("sha256sum output")?;
    Ok(format!("sha256:{hex}"))
}

/// An image whose one layer (`layer_size` bytes declared, digest
/// `layer_digest`) the fake serves as `blob`.
struct FakeImage {
    manifest: Vec<u8>,
    config: Vec<u8>,
    config_digest: String,
}

async fn fake_image(dir: &Path, layer_digest: &str, layer_size: u64) -> anyhow::Result<FakeImage> {
    let config = format!(
        r#"{{"architecture":"amd64","os":"linux","rootfs":{{"type":"layers","diff_ids":["{layer_digest}"]}},"config":{{}}}}"#
    )
    .into_bytes();
    let config_digest = sha256(dir, &config).await?;
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{config_digest}","size":{}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"{layer_digest}","size":{layer_size}}}]}}"#,
        config.len()
    )
    .into_bytes();
    Ok(FakeImage {
        manifest,
        config,
        config_digest,
    })
}

/// Pulls `image` and expects it to fail; returns the message and how long
/// it took.
async fn refused(d: &Daemon, image: &str) -> anyhow::Result<(String, Duration)> {
    let start = Instant::now();
    match pull_with(d, image, None).await {
        Ok(r) => anyhow::bail!("{image} was pulled ({r})"),
        Err(e) => Ok((e, start.elapsed())),
    }
}

async fn bad_registry_scenario(d: &Daemon) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // The stalled blob: 1 MiB declared, 64 KiB sent, then nothing.
    let stall_layer = vec![0x5au8; 1 << 20];
    let stall_digest = sha256(dir.path(), &stall_layer).await?;
    let stalled = fake_image(dir.path(), &stall_digest, stall_layer.len() as u64).await?;
    // The oversized blob: 4 KiB declared, 1 MiB sent (chunked, so no length
    // gives it away before the bytes do), then the body stays open.
    let big_declared = vec![0x33u8; 4096];
    let big_digest = sha256(dir.path(), &big_declared).await?;
    let big = fake_image(dir.path(), &big_digest, big_declared.len() as u64).await?;

    // The tampered blob: the declared size, other bytes than its digest.
    let honest = vec![0x44u8; 4096];
    let tampered_digest = sha256(dir.path(), &honest).await?;
    let tampered = fake_image(dir.path(), &tampered_digest, honest.len() as u64).await?;

    // The junk layer: served honestly (its digest and size match), but its
    // bytes are no tar: containerd cannot apply it.
    let junk = vec![0x46u8; 4096];
    let junk_digest = sha256(dir.path(), &junk).await?;
    let junk_image = fake_image(dir.path(), &junk_digest, junk.len() as u64).await?;

    let docs = Arc::new([stalled, big, tampered, junk_image]);
    let (stall_digest2, big_digest2) = (stall_digest.clone(), big_digest.clone());
    let (tampered_digest2, junk_digest2) = (tampered_digest.clone(), junk_digest.clone());
    let handler: Handler = Arc::new(move |path: &str| {
        let manifest = |i: usize| {
            reply(
                "200 OK",
                &[("Content-Type", "application/vnd.oci.image.manifest.v1+json")],
                &docs[i].manifest,
            )
        };
        if path.starts_with("/v2/stall-headers/") {
            return Reply::Stall(Vec::new());
        }
        if path.starts_with("/v2/stall-blob/app/manifests/") {
            return manifest(0);
        }
        if path.starts_with("/v2/big-blob/app/manifests/") {
            return manifest(1);
        }
        if path.starts_with("/v2/tampered/app/manifests/") {
            return manifest(2);
        }
        if path.starts_with("/v2/junk-layer/app/manifests/") {
            return manifest(3);
        }
        if path.ends_with(&tampered_digest2) {
            return reply("200 OK", &[], &[0x45u8; 4096]);
        }
        if path.ends_with(&junk_digest2) {
            return reply("200 OK", &[], &[0x46u8; 4096]);
        }
        for doc in docs.iter() {
            if path.ends_with(&doc.config_digest) {
                return reply("200 OK", &[], &doc.config);
            }
        }
        if path.ends_with(&stall_digest2) {
            let mut r =
                format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", 1 << 20).into_bytes();
            r.extend_from_slice(&[0x5au8; 64 << 10]);
            return Reply::Stall(r);
        }
        if path.ends_with(&big_digest2) {
            let mut r =
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                    .to_vec();
            for _ in 0..16 {
                r.extend_from_slice(format!("{:x}\r\n", 64 << 10).as_bytes());
                r.extend_from_slice(&[0x33u8; 64 << 10]);
                r.extend_from_slice(b"\r\n");
            }
            // ... and more to come, as far as the client can tell: only a
            // cap at the declared size ends this pull for the right reason.
            return Reply::Stall(r);
        }
        reply("404 Not Found", &[], b"{}")
    });
    let fake = Fake::start(handler).await?;
    let host = fake.authority();
    hosts_toml(d, &host, &format!("server = \"http://{host}\"\n"))?;

    // Stalls before the headers, and in the middle of a blob: both fail
    // once the 3 s progress timeout has passed, saying what and where.
    for repo in ["stall-headers", "stall-blob"] {
        let image = format!("{host}/{repo}/app:v1");
        let (msg, took) = refused(d, &image).await?;
        ensure!(
            took >= Duration::from_secs(3),
            "{image} failed before the timeout: {msg}"
        );
        ensure!(
            msg.contains(&image) && msg.contains(&format!("registry host {host}")),
            "{image}: the message names neither the image nor the host: {msg}"
        );
        ensure!(
            msg.contains("pull_progress_timeout"),
            "{image}: the message does not name the setting: {msg}"
        );
        ensure!(msg.starts_with("DeadlineExceeded"), "{image}: {msg}");
        still_serving(d).await?;
    }
    // Larger than declared: refused, and nothing of it is kept.
    let image = format!("{host}/big-blob/app:v1");
    let (msg, _) = refused(d, &image).await?;
    ensure!(
        msg.contains("declared 4096") && !msg.contains("stalled"),
        "{image}: not refused for its size: {msg}"
    );
    // The image's fault, not the agent's: never Internal.
    ensure!(msg.starts_with("FailedPrecondition"), "{image}: {msg}");
    // Other bytes than its digest names: refused, and nothing kept.
    let image = format!("{host}/tampered/app:v1");
    let (msg, _) = refused(d, &image).await?;
    ensure!(
        msg.contains("does not match its digest") && msg.contains(&tampered_digest),
        "{image}: not refused for its digest: {msg}"
    );
    ensure!(msg.starts_with("FailedPrecondition"), "{image}: {msg}");
    // A layer that is no tar: the image's fault, named with its layer, and
    // no snapshot of it is left.
    let image = format!("{host}/junk-layer/app:v1");
    let (msg, _) = refused(d, &image).await?;
    ensure!(
        msg.starts_with("FailedPrecondition")
            && msg.contains(&junk_digest)
            && msg.contains("could not be unpacked"),
        "{image}: {msg}"
    );
    let snapshots = d.ctr(&["snapshots", "ls"]).await?;
    ensure!(
        !snapshots.contains("extract-"),
        "a failed extraction's snapshot was left:\n{snapshots}"
    );
    // A registry nobody answers for is unavailable (a retry may succeed),
    // not an agent bug either.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let image = format!("{closed}/nobody/app:v1");
    let (msg, _) = refused(d, &image).await?;
    ensure!(
        msg.starts_with("Unavailable") && msg.contains("unreachable"),
        "{image}: {msg}"
    );
    let content = d.ctr(&["content", "ls", "-q"]).await?;
    for digest in [&big_digest, &stall_digest, &tampered_digest] {
        ensure!(
            !content.contains(digest.as_str()),
            "{digest} was kept in the content store"
        );
    }
    let active = d.ctr(&["content", "active"]).await?;
    ensure!(
        [&big_digest, &stall_digest, &tampered_digest]
            .iter()
            .all(|digest| !active.contains(digest.as_str())),
        "an ingest was left behind:\n{active}"
    );
    // Layers are staged under the agent's root and linked into
    // containerd's content directory only once whole and verified: no
    // staging file stays, and no refused blob reached that directory.
    let staging = d.root_dir.join("ingest");
    let staged: Vec<_> = std::fs::read_dir(&staging)
        .with_context(|| format!("reading {}", staging.display()))?
        .collect();
    ensure!(staged.is_empty(), "staging files left: {staged:?}");
    let blobs = Path::new(cubelet_e2e::CONTAINERD_ROOT)
        .join("io.containerd.content.v1.content/blobs/sha256");
    for digest in [&big_digest, &stall_digest, &tampered_digest] {
        let hex = digest.trim_start_matches("sha256:");
        ensure!(
            !blobs.join(hex).exists(),
            "{digest} reached containerd's content directory"
        );
    }
    still_serving(d).await?;
    d.remove_all().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_oversized_and_tampered_registries_fail_the_pull_and_leave_nothing() {
    with_daemon(
        DaemonOpts {
            index: 43,
            extra_config: Some("images:\n  pull_progress_timeout: 3s\n".into()),
            ..Default::default()
        },
        Duration::from_secs(180),
        |d| Box::pin(bad_registry_scenario(d)),
    )
    .await;
}
