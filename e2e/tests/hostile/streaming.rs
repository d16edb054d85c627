//! The streaming server under a hostile client, on a live daemon: 1000
//! half-open connections, and a 1 GiB stdin flood into `exec -i` of a
//! process that reads nothing. The daemon's RSS stays bounded, another
//! session is served meanwhile, the half-open connections are closed after
//! the header read timeout. All traffic is on 127.0.0.1.

use std::time::Duration;

use anyhow::{ensure, Context};
use cubelet_e2e::cri::ExecRequest;
use cubelet_e2e::{container_config, with_daemon, Daemon, DaemonOpts};
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";
/// Short, so the scenario need not wait the default 10 s.
const HEADER_TIMEOUT_SECS: u64 = 3;
/// How much the daemon's RSS may grow under an attack: generous (the
/// allocator keeps freed pages), far below what the attack sends.
const RSS_SLACK_KIB: u64 = 96 * 1024;

fn opts(index: u8) -> DaemonOpts {
    DaemonOpts {
        index,
        extra_config: Some(format!(
            "streaming:\n  header_read_timeout: {HEADER_TIMEOUT_SECS}s\n"
        )),
        ..Default::default()
    }
}

/// The daemon's resident set, KiB.
fn rss_kib(d: &Daemon) -> anyhow::Result<u64> {
    cubelet_e2e::rss_kib(d.pid().context("daemon pid")?)
}

async fn exec_url(d: &Daemon, cid: &str, cmd: &[&str], stdin: bool) -> anyhow::Result<String> {
    let req = ExecRequest {
        container_id: cid.to_owned(),
        cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
        stdin,
        stdout: true,
        stderr: true,
        tty: false,
    };
    Ok(d.runtime.clone().exec(req).await?.into_inner().url)
}

type Ws = tokio_tungstenite::WebSocketStream<TcpStream>;

/// A `v5.channel.k8s.io` WebSocket to an exec URL.
async fn ws(url: &str) -> anyhow::Result<Ws> {
    let mut req = url.replacen("http://", "ws://", 1).into_client_request()?;
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", "v5.channel.k8s.io".parse()?);
    let authority = req.uri().authority().context("authority")?.to_string();
    let tcp = TcpStream::connect(authority).await?;
    Ok(tokio_tungstenite::client_async(req, tcp).await?.0)
}

/// Runs `echo <word>` in `cid` over WebSocket; checks its stdout.
async fn served(d: &Daemon, cid: &str, word: &str) -> anyhow::Result<()> {
    let mut s = ws(&exec_url(d, cid, &["echo", word], false).await?).await?;
    let mut stdout = Vec::new();
    while let Some(Ok(m)) = s.next().await {
        match m {
            Message::Binary(b) if b.first() == Some(&1) => stdout.extend_from_slice(&b[1..]),
            Message::Close(_) => break,
            _ => {}
        }
    }
    ensure!(
        stdout == format!("{word}\n").as_bytes(),
        "exec echo {word}: stdout {:?}",
        String::from_utf8_lossy(&stdout)
    );
    Ok(())
}

async fn sleeper(d: &Daemon, name: &str) -> anyhow::Result<String> {
    let cfg = container_config("sleeper", BUSYBOX, &["sleep", "3600"]);
    Ok(d.pod_with(name, cfg).await?.1)
}

#[tokio::test(flavor = "multi_thread")]
async fn thousand_half_open_connections_are_bounded_and_closed() {
    with_daemon(opts(31), Duration::from_secs(300), |d| {
        Box::pin(async move {
            let cid = sleeper(d, "hostile-stream-halfopen").await?;
            served(d, &cid, "warm").await?;
            let url = exec_url(d, &cid, &["true"], false).await?;
            let addr = url
                .trim_start_matches("http://")
                .split('/')
                .next()
                .context("streaming address")?
                .to_owned();
            ensure!(addr.starts_with("127.0.0.1:"), "{addr}");
            let before = rss_kib(d)?;
            let mut conns = Vec::with_capacity(1000);
            for i in 0..1000 {
                let mut c = TcpStream::connect(&addr).await?;
                if i % 2 == 1 {
                    c.write_all(b"GET /exec/x HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: web")
                        .await?;
                }
                conns.push(c);
            }
            let during = rss_kib(d)?;
            served(d, &cid, "meanwhile").await?;
            // Every one is closed by the server after the header timeout.
            let limit = Duration::from_secs(HEADER_TIMEOUT_SECS + 10);
            let closing = futures::future::join_all(conns.iter_mut().map(|c| async move {
                let mut sink = Vec::new();
                tokio::time::timeout(limit, c.read_to_end(&mut sink)).await
            }));
            let results = closing.await;
            let kept = results.iter().filter(|r| r.is_err()).count();
            drop(conns);
            let after = rss_kib(d)?;
            println!(
                "1000 half-open: daemon RSS before {before} KiB, with them {during} KiB, after {after} KiB"
            );
            ensure!(kept == 0, "{kept} half-open connections kept past the header timeout");
            ensure!(
                during < before + RSS_SLACK_KIB,
                "RSS grew from {before} to {during} KiB"
            );
            served(d, &cid, "after").await?;
            d.remove_all().await?;
            Ok(())
        })
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gibibyte_stdin_flood_keeps_rss_bounded_and_others_served() {
    with_daemon(opts(32), Duration::from_secs(300), |d| {
        Box::pin(async move {
            let cid = sleeper(d, "hostile-stream-flood").await?;
            served(d, &cid, "warm").await?;
            let before = rss_kib(d)?;
            // `sleep 60` never reads its stdin.
            let mut flood = ws(&exec_url(d, &cid, &["sleep", "60"], true).await?).await?;
            let chunk = {
                let mut v = vec![0u8; 1 << 20];
                v.truncate((1 << 20) - 64);
                v[0] = 0; // stdin channel
                bytes::Bytes::from(v)
            };
            let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            let counter = std::sync::Arc::clone(&sent);
            let flooding = tokio::spawn(async move {
                for _ in 0..1024 {
                    if flood.send(Message::Binary(chunk.clone())).await.is_err() {
                        break;
                    }
                    counter.fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
                }
                flood
            });
            // Let the flood run into the backpressure.
            tokio::time::sleep(Duration::from_secs(10)).await;
            let during = rss_kib(d)?;
            served(d, &cid, "meanwhile").await?;
            let accepted = sent.load(std::sync::atomic::Ordering::Relaxed);
            flooding.abort();
            // A message over the size limit ends its session with 1009.
            let mut big = ws(&exec_url(d, &cid, &["sleep", "60"], true).await?).await?;
            let mut msg = vec![0u8; 16 << 20];
            msg[0] = 0;
            let _ = big.send(Message::Binary(msg.into())).await;
            let mut code = None;
            while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_secs(20), big.next()).await {
                if let Message::Close(f) = m {
                    code = f.map(|f| u16::from(f.code));
                    break;
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            let after = rss_kib(d)?;
            println!(
                "stdin flood: daemon RSS before {before} KiB, flooding {during} KiB, after {after} KiB; \
                 the server took {} MiB of 1024 before pushing back",
                accepted >> 20
            );
            ensure!(code == Some(1009), "16 MiB message: close code {code:?}");
            ensure!(accepted < 512 << 20, "the server took {accepted} bytes");
            ensure!(
                during < before + RSS_SLACK_KIB,
                "RSS grew from {before} to {during} KiB"
            );
            served(d, &cid, "after").await?;
            d.remove_all().await?;
            Ok(())
        })
    })
    .await;
}
