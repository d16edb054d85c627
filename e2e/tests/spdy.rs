//! Streaming over SPDY/3.1 end to end: a minimal SPDY client written here
//! (as crictl's client-go speaks it) runs an exec (stdout, and the exit
//! code through the error stream), an attach to a `stdin_once` shell (as
//! critest's attach spec: the input ends, so does the container) and a
//! port-forward, directly and tunnelled in WebSocket binary messages (the
//! `SPDY/3.1+portforward.k8s.io` transport of kubectl/crictl >= 1.30),
//! against one real `cubelet` daemon.
//!
//! Custom runner (`harness = false`) as in `streaming.rs`; without the
//! private containerd every scenario prints `SKIP:` and passes.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use cubelet_e2e::cri::*;
use cubelet_e2e::{container_config, stdin_once_shell, Daemon, DaemonOpts, Scenario};
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress};
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

const BUSYBOX: &str = "127.0.0.1:5000/busybox:test";

fn scenarios() -> Vec<Scenario> {
    vec![
        ("spdy_exec_stdout_and_exit_code", 90, |d| Box::pin(exec(d))),
        ("spdy_attach_stdin_once", 90, |d| {
            Box::pin(attach_stdin_once(d))
        }),
        ("spdy_port_forward_http", 90, |d| {
            Box::pin(port_forward(d, Transport::Direct))
        }),
        ("spdy_over_websocket_port_forward_http", 90, |d| {
            Box::pin(port_forward(d, Transport::WebSocketTunnel))
        }),
    ]
}

fn main() -> ExitCode {
    cubelet_e2e::scenario_main(
        DaemonOpts {
            index: 11,
            ..Default::default()
        },
        scenarios(),
    )
}

// ------------------------------------------------------- a SPDY client

/// The SPDY/3 header dictionary, built from the spec's word list and tail.
fn dictionary() -> Vec<u8> {
    let words = "options head post put delete trace accept accept-charset accept-encoding \
        accept-language accept-ranges age allow authorization cache-control connection \
        content-base content-encoding content-language content-length content-location \
        content-md5 content-range content-type date etag expect expires from host if-match \
        if-modified-since if-none-match if-range if-unmodified-since last-modified location \
        max-forwards pragma proxy-authenticate proxy-authorization range referer retry-after \
        server te trailer transfer-encoding upgrade user-agent vary via warning \
        www-authenticate method get status 200_OK version HTTP/1.1 url public set-cookie \
        keep-alive origin";
    let mut d = Vec::new();
    for w in words.split_whitespace() {
        let w = w.replace('_', " ");
        d.extend_from_slice(&(w.len() as u32).to_be_bytes());
        d.extend_from_slice(w.as_bytes());
    }
    d.extend_from_slice(
        concat!(
            "100101201202205206300302303304305306307402405406407408409410411412413414415416417",
            "502504505203 Non-Authoritative Information204 No Content301 Moved Permanently",
            "400 Bad Request401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error",
            "501 Not Implemented503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct ",
            "Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,",
            "image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,",
            "text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8",
            "charset=iso-8859-1,utf-,*,enq=0."
        )
        .as_bytes(),
    );
    assert_eq!(d.len(), 1423);
    d
}

/// A frame as the client sees it.
#[derive(Debug)]
enum Frame {
    Data { id: u32, fin: bool, data: Vec<u8> },
    Control { kind: u16, body: Vec<u8> },
}

/// A byte stream the SPDY frames travel on.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// How the client reaches the streaming server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    /// HTTP/1.1 upgrade to SPDY/3.1.
    Direct,
    /// WebSocket upgrade; SPDY bytes in binary messages.
    WebSocketTunnel,
}

struct Client {
    tcp: Box<dyn Io>,
    buf: Vec<u8>,
    deflate: Compress,
    inflate: Decompress,
    dict: Vec<u8>,
    next_id: u32,
}

impl Client {
    /// Connects to a streaming `url`, upgrading to SPDY/3.1 with `protocol`.
    async fn connect(url: &str, protocol: &str) -> anyhow::Result<Client> {
        let rest = url.strip_prefix("http://").context("http url")?;
        let (authority, path) = rest.split_once('/').context("path")?;
        let mut tcp = TcpStream::connect(authority).await?;
        let req = format!(
            "POST /{path} HTTP/1.1\r\nHost: {authority}\r\nConnection: Upgrade\r\n\
             Upgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: {protocol}\r\n\
             X-Stream-Protocol-Version: v2.channel.k8s.io\r\nContent-Length: 0\r\n\r\n"
        );
        tcp.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 1024];
            let n = tcp.read(&mut chunk).await?;
            ensure!(
                n > 0,
                "closed during the upgrade: {:?}",
                String::from_utf8_lossy(&buf)
            );
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        ensure!(head.starts_with("http/1.1 101"), "{head}");
        ensure!(head.contains("upgrade: spdy/3.1"), "{head}");
        ensure!(
            head.contains(&format!("x-stream-protocol-version: {protocol}")),
            "{head}"
        );
        Self::over(Box::new(tcp), buf[end..].to_vec())
    }

    /// Connects to a port-forward `url` by WebSocket, offering the SPDY
    /// tunnel subprotocol, as client-go's tunnelling dialer does.
    async fn connect_tunnel(url: &str) -> anyhow::Result<Client> {
        const TUNNEL: &str = "SPDY/3.1+portforward.k8s.io";
        let mut req = url.replacen("http://", "ws://", 1).into_client_request()?;
        let authority = req
            .uri()
            .authority()
            .map(|a| a.as_str().to_owned())
            .context("authority")?;
        req.headers_mut()
            .insert("Sec-WebSocket-Protocol", TUNNEL.parse()?);
        let tcp = TcpStream::connect(authority).await?;
        let (ws, resp) = tokio_tungstenite::client_async(req, tcp).await?;
        let got = resp
            .headers()
            .get("Sec-WebSocket-Protocol")
            .and_then(|v| v.to_str().ok());
        ensure!(got == Some(TUNNEL), "negotiated {got:?}");
        // Bytes <-> binary messages through an in-memory pipe.
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        let (mut rd, mut wr) = tokio::io::split(theirs);
        let (mut sink, mut stream) = ws.split();
        tokio::spawn(async move {
            while let Some(Ok(m)) = stream.next().await {
                match m {
                    Message::Binary(b) if wr.write_all(&b).await.is_ok() => {}
                    Message::Binary(_) | Message::Close(_) => break,
                    _ => {}
                }
            }
            let _ = wr.shutdown().await;
        });
        tokio::spawn(async move {
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n @ 1..) = rd.read(&mut buf).await {
                let msg = Message::Binary(buf[..n].to_vec().into());
                if sink.send(msg).await.is_err() {
                    return;
                }
            }
            let _ = sink.close().await;
        });
        Self::over(Box::new(ours), Vec::new())
    }

    /// A client on an established byte stream (`buf`: bytes already read).
    fn over(tcp: Box<dyn Io>, buf: Vec<u8>) -> anyhow::Result<Client> {
        let dict = dictionary();
        let mut deflate = Compress::new(Compression::default(), true);
        deflate.set_dictionary(&dict)?;
        Ok(Client {
            tcp,
            buf,
            deflate,
            inflate: Decompress::new(true),
            dict,
            next_id: 1,
        })
    }

    async fn write_control(&mut self, kind: u16, flags: u8, body: &[u8]) -> anyhow::Result<()> {
        let mut f = vec![0x80, 0x03];
        f.extend_from_slice(&kind.to_be_bytes());
        f.extend_from_slice(&((u32::from(flags) << 24) | body.len() as u32).to_be_bytes());
        f.extend_from_slice(body);
        self.tcp.write_all(&f).await?;
        Ok(())
    }

    /// Opens a stream with these headers (waits for no reply).
    async fn open(&mut self, headers: &[(&str, &str)]) -> anyhow::Result<u32> {
        let mut raw = (headers.len() as u32).to_be_bytes().to_vec();
        for (n, v) in headers {
            raw.extend_from_slice(&(n.len() as u32).to_be_bytes());
            raw.extend_from_slice(n.as_bytes());
            raw.extend_from_slice(&(v.len() as u32).to_be_bytes());
            raw.extend_from_slice(v.as_bytes());
        }
        let mut z = Vec::with_capacity(raw.len() + 128);
        self.deflate
            .compress_vec(&raw, &mut z, FlushCompress::Sync)?;
        let id = self.next_id;
        self.next_id += 2;
        let mut body = id.to_be_bytes().to_vec();
        body.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        body.extend_from_slice(&z);
        self.write_control(1, 0, &body).await?;
        Ok(id)
    }

    async fn data(&mut self, id: u32, fin: bool, data: &[u8]) -> anyhow::Result<()> {
        let mut f = id.to_be_bytes().to_vec();
        f.extend_from_slice(&((u32::from(fin) << 24) | data.len() as u32).to_be_bytes());
        f.extend_from_slice(data);
        self.tcp.write_all(&f).await?;
        Ok(())
    }

    /// The next frame; `None` at end of connection.
    async fn next(&mut self) -> anyhow::Result<Option<Frame>> {
        loop {
            if self.buf.len() >= 8 {
                let len = (u32::from_be_bytes([0, self.buf[5], self.buf[6], self.buf[7]])) as usize;
                if self.buf.len() >= 8 + len {
                    let head: Vec<u8> = self.buf.drain(..8).collect();
                    let body: Vec<u8> = self.buf.drain(..len).collect();
                    let w1 = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
                    return Ok(Some(if w1 & 0x8000_0000 == 0 {
                        Frame::Data {
                            id: w1,
                            fin: head[4] & 1 != 0,
                            data: body,
                        }
                    } else {
                        Frame::Control {
                            kind: (w1 & 0xffff) as u16,
                            body,
                        }
                    }));
                }
            }
            let mut chunk = [0u8; 16 * 1024];
            let n = self.tcp.read(&mut chunk).await?;
            if n == 0 {
                return Ok(None);
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Inflates a SYN_REPLY's header block (the zlib context must see it).
    fn inflate_block(&mut self, block: &[u8]) -> anyhow::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(4096);
        match self
            .inflate
            .decompress_vec(block, &mut out, FlushDecompress::Sync)
        {
            Ok(_) => {}
            Err(e) if e.needs_dictionary().is_some() => {
                let used = self.inflate.total_in() as usize;
                self.inflate.set_dictionary(&self.dict)?;
                self.inflate
                    .decompress_vec(&block[used..], &mut out, FlushDecompress::Sync)?;
            }
            Err(e) => return Err(e.into()),
        }
        Ok(out)
    }
}

/// What the client has received so far, per stream.
#[derive(Debug, Default)]
struct Received {
    data: std::collections::HashMap<u32, Vec<u8>>,
    ended: Vec<u32>,
    replied: Vec<u32>,
}

impl Received {
    /// The data received on stream `id`, as text.
    fn text(&self, id: u32) -> String {
        String::from_utf8_lossy(self.data.get(&id).map_or(&[][..], |v| v)).into_owned()
    }

    /// Reads frames until `done` holds, checking every data frame follows
    /// its stream's SYN_REPLY.
    async fn until(&mut self, c: &mut Client, done: impl Fn(&Self) -> bool) -> anyhow::Result<()> {
        while !done(self) {
            match c.next().await? {
                None => bail!("connection closed; got {:?}", self.data),
                Some(Frame::Data { id, fin, data: d }) => {
                    ensure!(self.replied.contains(&id), "data before SYN_REPLY on {id}");
                    self.data.entry(id).or_default().extend_from_slice(&d);
                    if fin {
                        self.ended.push(id);
                    }
                }
                Some(Frame::Control { kind: 2, body, .. }) => {
                    let id = u32::from_be_bytes([body[0], body[1], body[2], body[3]]);
                    let block = c.inflate_block(&body[4..])?;
                    ensure!(block == [0, 0, 0, 0], "SYN_REPLY headers {block:?}");
                    self.replied.push(id);
                }
                Some(Frame::Control { kind: 3, body, .. }) => bail!("RST_STREAM {body:?}"),
                Some(Frame::Control { kind: 6, body, .. }) => {
                    bail!("unexpected PING from the server {body:?}")
                }
                Some(Frame::Control { .. }) => {}
            }
        }
        Ok(())
    }
}

/// Reads frames until every stream in `ids` has ended (FIN), collecting
/// data per stream; checks every stream in `ids` got a SYN_REPLY.
async fn collect(
    c: &mut Client,
    ids: &[u32],
) -> anyhow::Result<std::collections::HashMap<u32, Vec<u8>>> {
    let mut r = Received::default();
    r.until(c, |r| ids.iter().all(|i| r.ended.contains(i)))
        .await?;
    Ok(r.data)
}

// ---------------------------------------------------------- scenarios

async fn exec(d: &Daemon) -> anyhow::Result<()> {
    let (_, cid) = d
        .pod_with(
            "spdy-exec",
            container_config("sleeper", BUSYBOX, &["sleep", "3600"]),
        )
        .await?;
    let url = d
        .runtime
        .clone()
        .exec(ExecRequest {
            container_id: cid.clone(),
            cmd: ["sh", "-c", "echo hello-spdy; echo oops >&2; exit 3"]
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            tty: false,
            stdin: false,
            stdout: true,
            stderr: true,
        })
        .await?
        .into_inner()
        .url;
    let mut c = Client::connect(&url, "v4.channel.k8s.io").await?;
    // As client-go: the error stream first, then the output streams.
    let err = c.open(&[("streamtype", "error")]).await?;
    let out = c.open(&[("streamtype", "stdout")]).await?;
    let serr = c.open(&[("streamtype", "stderr")]).await?;
    let data = collect(&mut c, &[err, out, serr]).await?;
    let stdout = String::from_utf8_lossy(data.get(&out).map_or(&[][..], |v| v));
    ensure!(stdout == "hello-spdy\n", "stdout {stdout:?}");
    let stderr = String::from_utf8_lossy(data.get(&serr).map_or(&[][..], |v| v));
    ensure!(stderr == "oops\n", "stderr {stderr:?}");
    let status: serde_json::Value =
        serde_json::from_slice(data.get(&err).map_or(&[][..], |v| v)).context("error stream")?;
    ensure!(status["status"] == "Failure", "{status}");
    ensure!(status["reason"] == "NonZeroExitCode", "{status}");
    ensure!(status["details"]["causes"][0]["message"] == "3", "{status}");
    // Then the server closes the connection.
    while let Some(f) = c.next().await? {
        if let Frame::Data { data, .. } = f {
            ensure!(data.is_empty(), "data after the end: {data:?}");
        }
    }
    Ok(())
}

async fn attach_stdin_once(d: &Daemon) -> anyhow::Result<()> {
    let (_, cid) = d.pod_with("spdy-attach", stdin_once_shell(BUSYBOX)).await?;
    let url = d.attach_url(&cid).await?;
    let mut c = Client::connect(&url, "v4.channel.k8s.io").await?;
    let err = c.open(&[("streamtype", "error")]).await?;
    let input = c.open(&[("streamtype", "stdin")]).await?;
    let out = c.open(&[("streamtype", "stdout")]).await?;
    let serr = c.open(&[("streamtype", "stderr")]).await?;
    // As critest: output without a newline must reach the client while the
    // shell still runs (not only when its stream ends).
    c.data(input, false, b"echo -n hello\n").await?;
    let mut got = Received::default();
    tokio::time::timeout(
        Duration::from_secs(20),
        got.until(&mut c, |r| r.text(out) == "hello"),
    )
    .await
    .context("\"hello\" without a newline did not arrive while the shell runs")??;
    // End of input: the shell exits and the session ends.
    c.data(input, true, b"").await?;
    got.until(&mut c, |r| {
        [err, out, serr].iter().all(|i| r.ended.contains(i))
    })
    .await?;
    ensure!(got.text(out) == "hello", "stdout {:?}", got.text(out));
    ensure!(got.text(serr).is_empty(), "stderr {:?}", got.text(serr));
    let status: serde_json::Value = serde_json::from_str(&got.text(err)).context("error stream")?;
    ensure!(status["status"] == "Success", "{status}");
    let state = d.container_status(&cid).await?;
    ensure!(
        state.state == ContainerState::ContainerExited as i32 && state.exit_code == 0,
        "the shell should have exited 0 at end of input: {state:?}"
    );
    Ok(())
}

async fn port_forward(d: &Daemon, transport: Transport) -> anyhow::Result<()> {
    let script = "mkdir -p /tmp/www && echo hello-spdy-forward > /tmp/www/index.html \
                  && exec httpd -f -p 8080 -h /tmp/www";
    let name = match transport {
        Transport::Direct => "spdy-pf",
        Transport::WebSocketTunnel => "spdy-ws-pf",
    };
    let (pod, _) = d
        .pod_with(
            name,
            container_config("httpd", BUSYBOX, &["sh", "-c", script]),
        )
        .await?;
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
    let mut c = match transport {
        Transport::Direct => Client::connect(&url, "portforward.k8s.io").await?,
        Transport::WebSocketTunnel => Client::connect_tunnel(&url).await?,
    };
    // httpd may not listen yet: one stream pair per attempt, as client-go
    // opens one per local connection.
    let mut last = String::new();
    for attempt in 0..50 {
        let req = attempt.to_string();
        let h = |kind| {
            [
                ("streamtype", kind),
                ("port", "8080"),
                ("requestid", req.as_str()),
            ]
        };
        let err = c.open(&h("error")).await?;
        let data = c.open(&h("data")).await?;
        c.data(err, true, b"").await?;
        c.data(data, true, b"GET /index.html HTTP/1.0\r\nHost: pod\r\n\r\n")
            .await?;
        let got = collect(&mut c, &[err, data]).await?;
        let body = String::from_utf8_lossy(got.get(&data).map_or(&[][..], |v| v)).into_owned();
        let error = String::from_utf8_lossy(got.get(&err).map_or(&[][..], |v| v)).into_owned();
        if body.contains("hello-spdy-forward") {
            ensure!(body.starts_with("HTTP/1."), "{body}");
            ensure!(error.is_empty(), "error stream {error:?}");
            return Ok(());
        }
        ensure!(
            !error.is_empty() || !body.is_empty(),
            "neither data nor error"
        );
        last = format!("data {body:?}, error {error:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("port-forward never reached httpd: {last}")
}
