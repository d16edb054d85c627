//! Streaming end-to-end scenarios (Exec, Attach, PortForward over WebSocket)
//! against one real `cubelet` daemon, with a WebSocket client written here.
//!
//! Custom runner (`harness = false`) as in `cri.rs`: one daemon whose
//! streaming idle timeout is short, scenarios in order, each followed by
//! removing every pod through CRI and a leak audit; teardown at the end.
//! Without the private containerd every scenario prints `SKIP:` and passes.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use cubelet_e2e::cri::*;
use cubelet_e2e::{container_config, stdin_once_shell, Daemon, DaemonOpts, Scenario};
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;
use tonic::Code;

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";
/// Short, so the expiry scenario need not wait 4 minutes.
const IDLE_TIMEOUT_SECS: u64 = 3;

fn scenarios() -> Vec<Scenario> {
    vec![
        ("exec_output_and_exit_code", 90, |d| Box::pin(exec_plain(d))),
        ("exec_stdin_cat", 60, |d| Box::pin(exec_stdin(d))),
        ("exec_tty_resize", 60, |d| Box::pin(exec_tty(d))),
        ("exec_token_expires", 60, |d| Box::pin(token_expires(d))),
        ("exec_spdy_bad_protocol_refused", 60, |d| {
            Box::pin(spdy_refused(d))
        }),
        ("attach_stdin_echo", 60, |d| Box::pin(attach(d))),
        ("attach_stdin_once_v5_close", 60, |d| {
            Box::pin(attach_stdin_once(d))
        }),
        ("port_forward_http", 90, |d| Box::pin(port_forward(d))),
    ]
}

fn main() -> ExitCode {
    cubelet_e2e::scenario_main(
        DaemonOpts {
            index: 1,
            extra_config: Some(format!(
                "streaming:\n  idle_timeout: {IDLE_TIMEOUT_SECS}s\n"
            )),
            ..Default::default()
        },
        scenarios(),
    )
}

// ---------------------------------------------------------------- helpers

async fn sleeper(d: &Daemon, name: &str) -> anyhow::Result<String> {
    let (_, cid) = d
        .pod_with(
            name,
            container_config("sleeper", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;
    Ok(cid)
}

fn exec_req(cid: &str, cmd: &[&str], stdin: bool, stderr: bool, tty: bool) -> ExecRequest {
    ExecRequest {
        container_id: cid.to_owned(),
        cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
        tty,
        stdin,
        stdout: true,
        stderr,
    }
}

async fn exec_url(d: &Daemon, req: ExecRequest) -> Result<String, tonic::Status> {
    Ok(d.runtime.clone().exec(req).await?.into_inner().url)
}

type Ws = WebSocketStream<TcpStream>;

/// Opens a WebSocket to `url` offering `protocol`.
async fn ws_connect(url: &str, protocol: &str) -> Result<Ws, WsError> {
    // The CRI answer is an http URL; WebSocket clients dial it as ws://.
    let ws_url = url.replacen("http://", "ws://", 1);
    let mut req = ws_url.into_client_request()?;
    let authority = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .unwrap_or_default();
    req.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        protocol
            .parse()
            .map_err(|_| WsError::Utf8("protocol".into()))?,
    );
    let tcp = TcpStream::connect(authority).await.map_err(WsError::Io)?;
    let (ws, resp) = tokio_tungstenite::client_async(req, tcp).await?;
    let got = resp
        .headers()
        .get("Sec-WebSocket-Protocol")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    assert_eq!(got, protocol, "negotiated subprotocol");
    Ok(ws)
}

async fn send(ws: &mut Ws, channel: u8, data: &[u8]) -> anyhow::Result<()> {
    let mut v = vec![channel];
    v.extend_from_slice(data);
    ws.send(Message::Binary(v.into())).await?;
    Ok(())
}

#[derive(Debug, Default)]
struct Output {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    error: Vec<u8>,
}

impl Output {
    fn add(&mut self, m: Message) {
        if let Message::Binary(b) = m {
            if let Some((&ch, rest)) = b.split_first() {
                match ch {
                    1 => self.stdout.extend_from_slice(rest),
                    2 => self.stderr.extend_from_slice(rest),
                    3 => self.error.extend_from_slice(rest),
                    _ => {}
                }
            }
        }
    }

    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    fn status(&self) -> anyhow::Result<serde_json::Value> {
        serde_json::from_slice(&self.error)
            .with_context(|| format!("error channel {:?}", String::from_utf8_lossy(&self.error)))
    }
}

/// Reads until stdout contains `want` (or the stream ends).
async fn read_until(ws: &mut Ws, out: &mut Output, want: &str) -> anyhow::Result<()> {
    while !out.stdout().contains(want) {
        match ws.next().await {
            Some(Ok(m)) => out.add(m),
            other => bail!("stream ended waiting for {want:?}: {other:?}; got {out:?}"),
        }
    }
    Ok(())
}

/// Reads everything until the server closes; returns the close code.
async fn read_all(ws: &mut Ws, out: &mut Output) -> Option<u16> {
    while let Some(Ok(m)) = ws.next().await {
        if let Message::Close(frame) = m {
            return frame.map(|f| f.code.into());
        }
        out.add(m);
    }
    None
}

fn http_status(e: &WsError) -> Option<u16> {
    match e {
        WsError::Http(r) => Some(r.status().as_u16()),
        _ => None,
    }
}

fn expect_code<T: std::fmt::Debug>(
    r: Result<T, tonic::Status>,
    code: Code,
    what: &str,
) -> anyhow::Result<()> {
    match r {
        Err(s) if s.code() == code => Ok(()),
        other => bail!("{what}: expected {code:?}, got {other:?}"),
    }
}

// -------------------------------------------------------------- scenarios

async fn exec_plain(d: &Daemon) -> anyhow::Result<()> {
    let cid = sleeper(d, "stream-exec").await?;
    let cmd = ["sh", "-c", "echo hi; echo oops >&2; exit 3"];
    for proto in ["v5.channel.k8s.io", "v4.channel.k8s.io"] {
        let url = exec_url(d, exec_req(&cid, &cmd, false, true, false)).await?;
        ensure!(
            url.starts_with("http://127.0.0.1:") && url.contains("/exec/"),
            "url {url}"
        );
        let mut ws = ws_connect(&url, proto).await?;
        let mut out = Output::default();
        read_all(&mut ws, &mut out).await;
        ensure!(out.stdout == b"hi\n", "{proto} stdout {out:?}");
        ensure!(out.stderr == b"oops\n", "{proto} stderr {out:?}");
        let st = out.status()?;
        ensure!(
            st["status"] == "Failure" && st["reason"] == "NonZeroExitCode",
            "{st}"
        );
        ensure!(st["details"]["causes"][0]["reason"] == "ExitCode", "{st}");
        ensure!(st["details"]["causes"][0]["message"] == "3", "{st}");
        // Single use: the same URL again is refused.
        let again = ws_connect(&url, proto).await;
        ensure!(
            again.as_ref().err().and_then(http_status) == Some(404),
            "reused token: {:?}",
            again.map(|_| ())
        );
    }
    // Success reports status Success.
    let url = exec_url(d, exec_req(&cid, &["true"], false, true, false)).await?;
    let mut ws = ws_connect(&url, "v5.channel.k8s.io").await?;
    let mut out = Output::default();
    read_all(&mut ws, &mut out).await;
    ensure!(out.status()?["status"] == "Success", "{out:?}");
    // Validation as kubelet does it.
    expect_code(
        exec_url(d, exec_req(&cid, &["sh"], false, true, true)).await,
        Code::InvalidArgument,
        "tty with stderr",
    )?;
    expect_code(
        exec_url(d, exec_req(&cid, &[], false, true, false)).await,
        Code::InvalidArgument,
        "empty cmd",
    )?;
    expect_code(
        exec_url(
            d,
            exec_req("0123456789abcdef", &["true"], false, true, false),
        )
        .await,
        Code::NotFound,
        "unknown container",
    )?;
    Ok(())
}

async fn exec_stdin(d: &Daemon) -> anyhow::Result<()> {
    let cid = sleeper(d, "stream-stdin").await?;
    let url = exec_url(d, exec_req(&cid, &["cat"], true, true, false)).await?;
    let mut ws = ws_connect(&url, "v5.channel.k8s.io").await?;
    let mut out = Output::default();
    send(&mut ws, 0, b"hello cat\n").await?;
    read_until(&mut ws, &mut out, "hello cat\n").await?;
    send(&mut ws, 0, b"second\n").await?;
    read_until(&mut ws, &mut out, "second\n").await?;
    // v5: close stdin, cat sees end of file and exits 0.
    send(&mut ws, 255, &[0]).await?;
    let close = read_all(&mut ws, &mut out).await;
    // client-go fails a stream closed with anything but 1000.
    ensure!(close == Some(1000), "close code {close:?}");
    ensure!(out.stdout() == "hello cat\nsecond\n", "{out:?}");
    ensure!(out.status()?["status"] == "Success", "{out:?}");
    Ok(())
}

async fn exec_tty(d: &Daemon) -> anyhow::Result<()> {
    let cid = sleeper(d, "stream-tty").await?;
    let url = exec_url(
        d,
        exec_req(&cid, &["sh", "-c", "read x; stty size"], true, false, true),
    )
    .await?;
    let mut ws = ws_connect(&url, "v5.channel.k8s.io").await?;
    // The resize is applied before the newline reaches `read`.
    send(&mut ws, 4, br#"{"Width":123,"Height":45}"#).await?;
    send(&mut ws, 0, b"\n").await?;
    let mut out = Output::default();
    read_all(&mut ws, &mut out).await;
    ensure!(out.stdout().contains("45 123"), "stty size: {out:?}");
    ensure!(out.stderr.is_empty(), "tty has no stderr channel: {out:?}");
    ensure!(out.status()?["status"] == "Success", "{out:?}");
    Ok(())
}

async fn token_expires(d: &Daemon) -> anyhow::Result<()> {
    let cid = sleeper(d, "stream-expire").await?;
    let url = exec_url(d, exec_req(&cid, &["true"], false, true, false)).await?;
    tokio::time::sleep(Duration::from_secs(IDLE_TIMEOUT_SECS + 1)).await;
    let r = ws_connect(&url, "v5.channel.k8s.io").await;
    ensure!(
        r.as_ref().err().and_then(http_status) == Some(404),
        "expired token: {:?}",
        r.map(|_| ())
    );
    Ok(())
}

/// SPDY itself is served (see `spdy.rs`); a subprotocol it does not
/// speak is refused with 400 naming the supported ones, token untouched.
async fn spdy_refused(d: &Daemon) -> anyhow::Result<()> {
    let cid = sleeper(d, "stream-spdy").await?;
    let url = exec_url(d, exec_req(&cid, &["true"], false, true, false)).await?;
    let rest = url.strip_prefix("http://").context("http url")?;
    let (authority, path) = rest.split_once('/').context("path")?;
    let mut s = TcpStream::connect(authority).await?;
    let req = format!(
        "GET /{path} HTTP/1.1\r\nHost: {authority}\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\
         X-Stream-Protocol-Version: v99.channel.k8s.io\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await?;
    let mut all = String::new();
    let mut buf = vec![0u8; 4096];
    while !all.contains("v4.channel.k8s.io") {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        all.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    ensure!(all.starts_with("HTTP/1.1 400"), "{all}");
    ensure!(
        all.contains("v99.channel.k8s.io") && all.contains("v4.channel.k8s.io"),
        "{all}"
    );
    Ok(())
}

async fn attach(d: &Daemon) -> anyhow::Result<()> {
    let mut cfg = container_config("echo", BUSYBOX, &["cat"]);
    cfg.stdin = true;
    let (_, cid) = d.pod_with("stream-attach", cfg).await?;
    let url = d
        .runtime
        .clone()
        .attach(AttachRequest {
            container_id: cid.clone(),
            stdin: true,
            tty: false,
            stdout: true,
            stderr: true,
        })
        .await?
        .into_inner()
        .url;
    ensure!(url.contains("/attach/"), "{url}");
    let mut ws = ws_connect(&url, "v5.channel.k8s.io").await?;
    let mut out = Output::default();
    send(&mut ws, 0, b"ping attach\n").await?;
    read_until(&mut ws, &mut out, "ping attach\n").await?;
    ws.close(None).await?;
    // Leaving the attach leaves the container running.
    let st = d.container_status(&cid).await?;
    ensure!(
        st.state == ContainerState::ContainerRunning as i32,
        "{st:?}"
    );
    expect_code(
        d.runtime
            .clone()
            .attach(AttachRequest {
                container_id: "0123456789abcdef".into(),
                stdout: true,
                ..Default::default()
            })
            .await,
        Code::NotFound,
        "attach unknown container",
    )?;
    Ok(())
}

async fn attach_stdin_once(d: &Daemon) -> anyhow::Result<()> {
    let (_, cid) = d
        .pod_with("stream-attach-once", stdin_once_shell(BUSYBOX))
        .await?;
    let url = d.attach_url(&cid).await?;
    let mut ws = ws_connect(&url, "v5.channel.k8s.io").await?;
    send(&mut ws, 0, b"echo hello\n").await?;
    // v5: close stdin; with stdin_once the shell reads end of file, exits,
    // and the session ends with a success status and a normal close.
    send(&mut ws, 255, &[0]).await?;
    let mut out = Output::default();
    let close = read_all(&mut ws, &mut out).await;
    ensure!(close == Some(1000), "close code {close:?}");
    ensure!(out.stdout() == "hello\n", "{out:?}");
    ensure!(out.status()?["status"] == "Success", "{out:?}");
    let st = d.container_status(&cid).await?;
    ensure!(
        st.state == ContainerState::ContainerExited as i32 && st.exit_code == 0,
        "{st:?}"
    );
    Ok(())
}

async fn port_forward(d: &Daemon) -> anyhow::Result<()> {
    let script = "mkdir -p /tmp/www && echo hello-port-forward > /tmp/www/index.html \
                  && exec httpd -f -p 8080 -h /tmp/www";
    let (pod, _) = d
        .pod_with(
            "stream-pf",
            container_config("httpd", BUSYBOX, &["sh", "-c", script]),
        )
        .await?;
    // httpd may not listen yet: retry on a fresh URL while the error channel
    // reports a refused connection.
    let mut last = String::new();
    for _ in 0..50 {
        let url = d
            .runtime
            .clone()
            .port_forward(PortForwardRequest {
                pod_sandbox_id: pod.clone(),
                port: vec![8080],
            })
            .await?
            .into_inner()
            .url;
        ensure!(url.contains("/portforward/"), "{url}");
        let mut ws = ws_connect(&format!("{url}?port=8080"), "v4.channel.k8s.io").await?;
        // Each channel first carries the port, little-endian.
        let mut firsts = Vec::new();
        while firsts.len() < 2 {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) => firsts.push(b.to_vec()),
                other => bail!("port-forward preamble: {other:?}"),
            }
        }
        ensure!(
            firsts == vec![vec![0, 0x90, 0x1f], vec![1, 0x90, 0x1f]],
            "{firsts:?}"
        );
        send(&mut ws, 0, b"GET /index.html HTTP/1.0\r\nHost: pod\r\n\r\n").await?;
        let mut data = Vec::new();
        let mut error = Vec::new();
        loop {
            let next = tokio::time::timeout(Duration::from_secs(10), ws.next()).await;
            match next {
                Ok(Some(Ok(Message::Binary(b)))) => match b.split_first() {
                    Some((0, rest)) => data.extend_from_slice(rest),
                    Some((1, rest)) => error.extend_from_slice(rest),
                    _ => {}
                },
                Ok(Some(Ok(_))) => {}
                _ => break,
            }
            let text = String::from_utf8_lossy(&data);
            if text.contains("hello-port-forward") || !error.is_empty() {
                break;
            }
        }
        let text = String::from_utf8_lossy(&data).into_owned();
        let _ = ws.close(None).await;
        if text.contains("hello-port-forward") {
            ensure!(text.starts_with("HTTP/1."), "{text}");
            expect_code(
                d.runtime
                    .clone()
                    .port_forward(PortForwardRequest {
                        pod_sandbox_id: "nosuchsandbox".into(),
                        port: vec![80],
                    })
                    .await,
                Code::NotFound,
                "port-forward unknown sandbox",
            )?;
            return Ok(());
        }
        last = format!("data {text:?}, error {:?}", String::from_utf8_lossy(&error));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("port-forward never reached httpd: {last}")
}
