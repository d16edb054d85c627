//! One SPDY/3.1 server connection: a reader task that decodes frames,
//! answers every client SYN_STREAM with a SYN_REPLY, echoes PINGs, tracks
//! the client's flow-control windows and hands stream events to the
//! session; a writer task that owns the socket's write half.
//!
//! Flow control: as each DATA frame is handed on, a WINDOW_UPDATE for the
//! stream and the session returns its bytes to the client. Outgoing DATA
//! is kept within the client's windows; a client that lets a window run
//! dry without ever sending a WINDOW_UPDATE (moby/spdystream, which
//! crictl and kubelet's proxy use, has no flow control) is treated as not
//! doing flow control after [`NO_FLOW_CONTROL_GRACE`], as kubelet's own
//! SPDY server (also spdystream) does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::limits::{Idle, Limits};
use crate::spdy::{Frame, HeaderCodec, HeaderList, SpdyError};
use crate::spdy::{INITIAL_WINDOW, RST_PROTOCOL_ERROR, SETTINGS_INITIAL_WINDOW_SIZE};

/// How long a sender waits on an exhausted window of a client that never
/// sent a WINDOW_UPDATE before it stops enforcing the windows.
pub(crate) const NO_FLOW_CONTROL_GRACE: Duration = Duration::from_millis(500);
/// Largest DATA payload we send.
const MAX_DATA: usize = 16 * 1024;
/// Client stream events waiting for the session (each a frame of at most
/// `max_message_size`, or a header block).
const EVENTS_QUEUED: usize = 4;
/// Streams a client may have open on one connection (we have not sent our
/// FIN yet); more are refused with RST_STREAM.
pub(crate) const MAX_OPEN_STREAMS: usize = 512;
/// RST_STREAM status: refused.
const RST_REFUSED_STREAM: u32 = 3;
/// GOAWAY status: ok.
const GOAWAY_OK: u32 = 0;
/// GOAWAY status: protocol error.
const GOAWAY_PROTOCOL_ERROR: u32 = 1;

/// What the client did on one of its streams.
#[derive(Debug)]
pub(crate) enum Event {
    /// It opened a stream (already answered with SYN_REPLY).
    Open {
        /// Stream id.
        id: u32,
        /// Its decoded headers.
        headers: HeaderList,
    },
    /// Data on a stream.
    Data {
        /// Stream id.
        id: u32,
        /// Payload.
        data: Bytes,
    },
    /// The client will send no more on this stream (FIN or RST_STREAM).
    Fin {
        /// Stream id.
        id: u32,
    },
}

#[derive(Debug)]
struct FlowState {
    session: i64,
    initial: i64,
    streams: HashMap<u32, i64>,
    peer_updates: bool,
    unlimited: bool,
    closed: bool,
}

#[derive(Debug)]
struct Flow {
    st: Mutex<FlowState>,
    notify: Notify,
}

impl Flow {
    fn lock(&self) -> std::sync::MutexGuard<'_, FlowState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut FlowState)) {
        f(&mut self.lock());
        self.notify.notify_waiters();
    }

    /// Waits until `want` (> 0) bytes, or part of them, may be sent on
    /// `id`; `None` once the connection is gone.
    async fn acquire(&self, id: u32, want: usize) -> Option<usize> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let patient = {
                let mut st = self.lock();
                if st.closed {
                    return None;
                }
                if st.unlimited {
                    return Some(want);
                }
                let initial = st.initial;
                let stream = *st.streams.entry(id).or_insert(initial);
                let avail = st.session.min(stream);
                if avail > 0 {
                    let n = want.min(usize::try_from(avail).unwrap_or(usize::MAX));
                    let n64 = i64::try_from(n).unwrap_or(i64::MAX);
                    st.session -= n64;
                    if let Some(w) = st.streams.get_mut(&id) {
                        *w -= n64;
                    }
                    return Some(n);
                }
                st.peer_updates
            };
            if patient {
                notified.await;
            } else if tokio::time::timeout(NO_FLOW_CONTROL_GRACE, notified)
                .await
                .is_err()
            {
                let mut st = self.lock();
                if !st.peer_updates {
                    tracing::debug!(
                        "spdy client sends no WINDOW_UPDATE: not enforcing its windows"
                    );
                    st.unlimited = true;
                }
            }
        }
    }
}

/// Sending half of a connection: cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Sender {
    frames: mpsc::Sender<Frame>,
    flow: Arc<Flow>,
}

impl Sender {
    /// Sends `data` on stream `id` within the client's windows; false once
    /// the connection is gone.
    pub(crate) async fn data(&self, id: u32, mut data: Bytes) -> bool {
        while !data.is_empty() {
            let Some(n) = self.flow.acquire(id, data.len().min(MAX_DATA)).await else {
                return false;
            };
            let chunk = data.split_to(n);
            let frame = Frame::Data {
                stream_id: id,
                fin: false,
                data: chunk,
            };
            if self.frames.send(frame).await.is_err() {
                return false;
            }
        }
        true
    }

    /// Resolves once the connection is gone (the client left, broke the
    /// protocol, or was idle too long).
    pub(crate) async fn closed(&self) {
        loop {
            let notified = self.flow.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.flow.lock().closed {
                return;
            }
            notified.await;
        }
    }

    /// Half-closes stream `id` from our side (empty DATA with FIN); its
    /// window is forgotten, as nothing more is sent on it.
    pub(crate) async fn fin(&self, id: u32) -> bool {
        self.flow.update(|st| {
            st.streams.remove(&id);
        });
        let frame = Frame::Data {
            stream_id: id,
            fin: true,
            data: Bytes::new(),
        };
        self.frames.send(frame).await.is_ok()
    }
}

/// A running SPDY connection.
#[derive(Debug)]
pub(crate) struct Conn {
    /// Client stream events; `None` once the client is gone.
    pub(crate) events: mpsc::Receiver<Event>,
    /// Our sending half.
    pub(crate) out: Sender,
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
}

impl Conn {
    /// Starts serving SPDY on `io` (already switched protocols): DATA
    /// frames over `limits.max_message_size` end the connection with a
    /// GOAWAY (protocol error), and so does `limits.stream_idle_timeout`
    /// without a frame in either direction (GOAWAY ok).
    pub(crate) fn start<S>(io: S, limits: &Limits) -> Conn
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (rd, mut wr) = tokio::io::split(io);
        let idle = Idle::new(limits.stream_idle_timeout);
        let max_data = limits.max_message_size;
        let (frames_tx, mut frames_rx) = mpsc::channel::<Frame>(64);
        let (events_tx, events) = mpsc::channel::<Event>(EVENTS_QUEUED);
        let flow = Arc::new(Flow {
            st: Mutex::new(FlowState {
                session: i64::from(INITIAL_WINDOW),
                initial: i64::from(INITIAL_WINDOW),
                streams: HashMap::new(),
                peer_updates: false,
                unlimited: false,
                closed: false,
            }),
            notify: Notify::new(),
        });
        let writer = {
            let idle = idle.clone();
            tokio::spawn(
                async move {
                    let mut buf = BytesMut::with_capacity(MAX_DATA + 64);
                    while let Some(f) = frames_rx.recv().await {
                        buf.clear();
                        f.encode(&mut buf);
                        // Coalesce what is already queued into one write.
                        while buf.len() < 64 * 1024 {
                            match frames_rx.try_recv() {
                                Ok(f) => f.encode(&mut buf),
                                Err(_) => break,
                            }
                        }
                        // A client that reads nothing holds this write
                        // only until it has been idle for the timeout.
                        let written = tokio::select! {
                            biased;
                            r = wr.write_all(&buf) => r.is_ok(),
                            () = idle.expired() => false,
                        };
                        if !written {
                            return;
                        }
                        idle.touch();
                    }
                    let _ = wr.flush().await;
                    let _ = wr.shutdown().await;
                }
                .in_current_span(),
            )
        };
        let reader = {
            let frames = frames_tx.clone();
            let flow = Arc::clone(&flow);
            tokio::spawn(
                async move {
                    let ended = tokio::select! {
                        r = read_loop(rd, &frames, &events_tx, &flow, &idle, max_data) => r,
                        () = idle.expired() => Err(SpdyError::Idle(idle.timeout())),
                    };
                    if let Err(e) = ended {
                        let status = match e {
                            SpdyError::Idle(_) => {
                                tracing::info!(error = %e, "spdy session ended");
                                GOAWAY_OK
                            }
                            SpdyError::TooLarge { .. } => {
                                tracing::info!(error = %e, "spdy session ended");
                                GOAWAY_PROTOCOL_ERROR
                            }
                            _ => {
                                tracing::debug!(error = %e, "spdy connection ended");
                                GOAWAY_PROTOCOL_ERROR
                            }
                        };
                        // Never wait on a writer a client does not drain.
                        let _ = frames.try_send(Frame::GoAway {
                            last_good: 0,
                            status,
                        });
                    }
                    flow.update(|st| st.closed = true);
                }
                .in_current_span(),
            )
        };
        Conn {
            events,
            out: Sender {
                frames: frames_tx,
                flow,
            },
            reader,
            writer,
        }
    }

    /// Says GOAWAY, lets the writer flush everything queued (every other
    /// [`Sender`] clone must be gone), and closes the connection.
    pub(crate) async fn shutdown(self) {
        let Conn {
            events,
            out,
            reader,
            writer,
        } = self;
        let _ = out
            .frames
            .send(Frame::GoAway {
                last_good: 0,
                status: 0,
            })
            .await;
        drop(out);
        reader.abort();
        drop(events);
        let _ = reader.await;
        let mut writer = writer;
        if tokio::time::timeout(Duration::from_secs(10), &mut writer)
            .await
            .is_err()
        {
            writer.abort();
        }
    }
}

async fn read_loop<R>(
    mut rd: R,
    frames: &mpsc::Sender<Frame>,
    events: &mpsc::Sender<Event>,
    flow: &Flow,
    idle: &Idle,
    max_data: usize,
) -> Result<(), SpdyError>
where
    R: AsyncRead + Unpin,
{
    let mut codec = HeaderCodec::new();
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let send = |f: Frame| async move {
        frames
            .send(f)
            .await
            .map_err(|_| SpdyError::Protocol("writer gone".into()))
    };
    loop {
        let frame = loop {
            if let Some(f) = Frame::decode_limited(&mut buf, max_data)? {
                break f;
            }
            if buf.capacity() - buf.len() < 4096 {
                buf.reserve(16 * 1024);
            }
            let n = rd.read_buf(&mut buf).await.map_err(SpdyError::Io)?;
            if n == 0 {
                return Ok(());
            }
            idle.touch();
        };
        match frame {
            Frame::SynStream {
                stream_id,
                flags,
                block,
                ..
            } => {
                // The zlib context must see every block, even of a
                // stream we refuse.
                let headers = codec.decode(&block)?;
                if stream_id == 0 || stream_id.is_multiple_of(2) {
                    send(Frame::RstStream {
                        stream_id,
                        status: RST_PROTOCOL_ERROR,
                    })
                    .await?;
                    continue;
                }
                if flow.lock().streams.len() >= MAX_OPEN_STREAMS {
                    tracing::debug!(stream_id, "spdy: too many open streams, refusing one");
                    send(Frame::RstStream {
                        stream_id,
                        status: RST_REFUSED_STREAM,
                    })
                    .await?;
                    continue;
                }
                let block = codec.encode(&[])?;
                send(Frame::SynReply {
                    stream_id,
                    fin: false,
                    block,
                })
                .await?;
                flow.update(|st| {
                    let initial = st.initial;
                    st.streams.insert(stream_id, initial);
                });
                let open = Event::Open {
                    id: stream_id,
                    headers,
                };
                if events.send(open).await.is_err() {
                    return Ok(());
                }
                if flags & crate::spdy::FLAG_FIN != 0
                    && events.send(Event::Fin { id: stream_id }).await.is_err()
                {
                    return Ok(());
                }
            }
            Frame::Data {
                stream_id,
                fin,
                data,
            } => {
                let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
                if !data.is_empty() {
                    let ev = Event::Data {
                        id: stream_id,
                        data,
                    };
                    if events.send(ev).await.is_err() {
                        return Ok(());
                    }
                    // Consumed: give the bytes back to the client.
                    send(Frame::WindowUpdate {
                        stream_id,
                        delta: len,
                    })
                    .await?;
                    send(Frame::WindowUpdate {
                        stream_id: 0,
                        delta: len,
                    })
                    .await?;
                }
                if fin && events.send(Event::Fin { id: stream_id }).await.is_err() {
                    return Ok(());
                }
            }
            Frame::Headers { block, .. } => {
                codec.decode(&block)?;
            }
            Frame::SynReply { block, .. } => {
                codec.decode(&block)?;
            }
            Frame::RstStream { stream_id, .. } => {
                flow.update(|st| {
                    st.streams.remove(&stream_id);
                });
                if events.send(Event::Fin { id: stream_id }).await.is_err() {
                    return Ok(());
                }
            }
            Frame::Settings { entries } => {
                for (_, id, value) in entries {
                    if id == SETTINGS_INITIAL_WINDOW_SIZE {
                        flow.update(|st| {
                            let delta = i64::from(value) - st.initial;
                            st.initial = i64::from(value);
                            for w in st.streams.values_mut() {
                                *w += delta;
                            }
                        });
                    }
                }
            }
            Frame::Ping { id } => {
                // Client pings have odd ids; ours (none sent) would be even.
                if id % 2 == 1 {
                    send(Frame::Ping { id }).await?;
                }
            }
            Frame::GoAway { .. } => return Ok(()),
            Frame::WindowUpdate { stream_id, delta } => flow.update(|st| {
                st.peer_updates = true;
                if stream_id == 0 {
                    st.session += i64::from(delta);
                } else if let Some(w) = st.streams.get_mut(&stream_id) {
                    *w += i64::from(delta);
                }
            }),
            Frame::Unknown { kind } => {
                tracing::debug!(kind, "ignoring spdy control frame");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spdy::header;

    /// Client side over a duplex pipe: frames in, frames out.
    struct Client {
        io: tokio::io::DuplexStream,
        buf: BytesMut,
        codec: HeaderCodec,
    }

    impl Client {
        async fn send(&mut self, f: Frame) {
            let mut b = BytesMut::new();
            f.encode(&mut b);
            self.io.write_all(&b).await.unwrap();
        }

        async fn recv(&mut self) -> Option<Frame> {
            loop {
                if let Some(f) = Frame::decode(&mut self.buf).unwrap() {
                    return Some(f);
                }
                if self.io.read_buf(&mut self.buf).await.unwrap() == 0 {
                    return None;
                }
            }
        }

        async fn open(&mut self, id: u32, kind: &str) {
            let block = self
                .codec
                .encode(&[("streamtype", kind.as_bytes())])
                .unwrap();
            self.send(Frame::SynStream {
                stream_id: id,
                associated_to: 0,
                priority: 0,
                flags: 0,
                block,
            })
            .await;
        }
    }

    #[tokio::test]
    async fn replies_pings_windows_and_data() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let mut conn = Conn::start(b, &Limits::default());
        let mut c = Client {
            io: a,
            buf: BytesMut::new(),
            codec: HeaderCodec::new(),
        };
        c.open(1, "stdout").await;
        match c.recv().await.unwrap() {
            Frame::SynReply {
                stream_id, block, ..
            } => {
                assert_eq!(stream_id, 1);
                assert!(c.codec.decode(&block).unwrap().is_empty());
            }
            f => panic!("{f:?}"),
        }
        match conn.events.recv().await.unwrap() {
            Event::Open { id, headers } => {
                assert_eq!(id, 1);
                assert_eq!(header(&headers, "streamtype"), Some("stdout"));
            }
            e => panic!("{e:?}"),
        }
        c.send(Frame::Ping { id: 7 }).await;
        assert_eq!(c.recv().await.unwrap(), Frame::Ping { id: 7 });
        c.send(Frame::Data {
            stream_id: 1,
            fin: true,
            data: Bytes::from_static(b"abc"),
        })
        .await;
        assert!(
            matches!(conn.events.recv().await, Some(Event::Data { id: 1, data }) if &data[..] == b"abc")
        );
        assert!(matches!(
            conn.events.recv().await,
            Some(Event::Fin { id: 1 })
        ));
        assert_eq!(
            c.recv().await.unwrap(),
            Frame::WindowUpdate {
                stream_id: 1,
                delta: 3
            }
        );
        assert_eq!(
            c.recv().await.unwrap(),
            Frame::WindowUpdate {
                stream_id: 0,
                delta: 3
            }
        );
        // A client that does flow control: shrink the window to 4 bytes.
        c.send(Frame::Settings {
            entries: vec![(0, SETTINGS_INITIAL_WINDOW_SIZE, 4)],
        })
        .await;
        c.send(Frame::WindowUpdate {
            stream_id: 0,
            delta: 1,
        })
        .await;
        c.open(3, "data").await;
        assert!(matches!(
            c.recv().await,
            Some(Frame::SynReply { stream_id: 3, .. })
        ));
        assert!(matches!(
            conn.events.recv().await,
            Some(Event::Open { id: 3, .. })
        ));
        let out = conn.out.clone();
        let sending = tokio::spawn(async move {
            out.data(3, Bytes::from_static(b"0123456789")).await && out.fin(3).await
        });
        let mut got = Vec::new();
        match c.recv().await.unwrap() {
            Frame::Data {
                stream_id: 3,
                data,
                fin: false,
            } => got.extend_from_slice(&data),
            f => panic!("{f:?}"),
        }
        assert_eq!(got, b"0123", "held to the 4-byte stream window");
        c.send(Frame::WindowUpdate {
            stream_id: 3,
            delta: 100,
        })
        .await;
        loop {
            match c.recv().await.unwrap() {
                Frame::Data {
                    stream_id: 3,
                    data,
                    fin,
                } => {
                    got.extend_from_slice(&data);
                    if fin {
                        break;
                    }
                }
                f => panic!("{f:?}"),
            }
        }
        assert_eq!(got, b"0123456789");
        assert!(sending.await.unwrap());
        conn.shutdown().await;
        assert!(matches!(c.recv().await, Some(Frame::GoAway { .. })));
        assert_eq!(c.recv().await, None);
    }

    #[tokio::test]
    async fn a_client_without_flow_control_still_gets_everything() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let mut conn = Conn::start(b, &Limits::default());
        let mut c = Client {
            io: a,
            buf: BytesMut::new(),
            codec: HeaderCodec::new(),
        };
        c.open(1, "stdout").await;
        assert!(matches!(
            conn.events.recv().await,
            Some(Event::Open { id: 1, .. })
        ));
        let out = conn.out.clone();
        let big = Bytes::from(vec![7u8; 200 * 1024]);
        let sending = tokio::spawn(async move { out.data(1, big).await && out.fin(1).await });
        let mut n = 0;
        loop {
            match c.recv().await.unwrap() {
                Frame::Data { data, fin, .. } => {
                    n += data.len();
                    if fin {
                        break;
                    }
                }
                Frame::SynReply { .. } => {}
                f => panic!("{f:?}"),
            }
        }
        assert_eq!(n, 200 * 1024);
        assert!(sending.await.unwrap());
        conn.shutdown().await;
    }

    fn client(io: tokio::io::DuplexStream) -> Client {
        Client {
            io,
            buf: BytesMut::new(),
            codec: HeaderCodec::new(),
        }
    }

    /// Frames until the server closes, with a limit: a missing bound waits
    /// for ever.
    async fn until_closed(c: &mut Client) -> Vec<Frame> {
        let mut got = Vec::new();
        let all = async {
            while let Some(f) = c.recv().await {
                got.push(f);
            }
        };
        tokio::time::timeout(Duration::from_secs(5), all)
            .await
            .expect("the connection was kept");
        got
    }

    #[tokio::test]
    async fn a_data_frame_over_the_limit_ends_the_connection_with_a_goaway() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let limits = Limits {
            max_message_size: 64 * 1024,
            ..Limits::default()
        };
        let mut conn = Conn::start(b, &limits);
        let mut c = client(a);
        c.open(1, "stdin").await;
        assert!(matches!(
            conn.events.recv().await,
            Some(Event::Open { id: 1, .. })
        ));
        // Only the frame's header: it is refused before its body is buffered.
        let mut head = BytesMut::new();
        Frame::Data {
            stream_id: 1,
            fin: false,
            data: Bytes::from(vec![0u8; 128 * 1024]),
        }
        .encode(&mut head);
        c.io.write_all(&head[..8]).await.unwrap();
        let events = tokio::spawn(async move {
            let mut n = 0;
            while let Some(e) = conn.events.recv().await {
                assert!(!matches!(e, Event::Data { .. }), "{e:?}");
                n += 1;
            }
            conn.shutdown().await;
            n
        });
        let got = until_closed(&mut c).await;
        assert!(
            got.iter().any(|f| matches!(
                f,
                Frame::GoAway {
                    status: GOAWAY_PROTOCOL_ERROR,
                    ..
                }
            )),
            "{got:?}"
        );
        assert_eq!(events.await.unwrap(), 0);
    }

    #[tokio::test]
    async fn an_idle_connection_ends_with_a_goaway() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let limits = Limits {
            stream_idle_timeout: Duration::from_millis(300),
            ..Limits::default()
        };
        let mut conn = Conn::start(b, &limits);
        let mut c = client(a);
        c.open(1, "stdin").await;
        assert!(matches!(
            conn.events.recv().await,
            Some(Event::Open { id: 1, .. })
        ));
        let closed = tokio::spawn(async move {
            while conn.events.recv().await.is_some() {}
            conn.shutdown().await;
        });
        let got = until_closed(&mut c).await;
        assert!(
            got.iter().any(|f| matches!(
                f,
                Frame::GoAway {
                    status: GOAWAY_OK,
                    ..
                }
            )),
            "{got:?}"
        );
        closed.await.unwrap();
    }

    #[tokio::test]
    async fn streams_past_the_cap_are_refused() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let mut conn = Conn::start(b, &Limits::default());
        let mut c = client(a);
        let drain = tokio::spawn(async move {
            let mut opened = 0;
            while let Some(e) = conn.events.recv().await {
                if matches!(e, Event::Open { .. }) {
                    opened += 1;
                }
            }
            opened
        });
        let n = u32::try_from(MAX_OPEN_STREAMS).unwrap() + 3;
        for i in 0..n {
            c.open(2 * i + 1, "data").await;
        }
        let mut refused = Vec::new();
        let mut replies = 0;
        while replies + refused.len() < n as usize {
            match c.recv().await.unwrap() {
                Frame::SynReply { .. } => replies += 1,
                Frame::RstStream { stream_id, status } => {
                    assert_eq!(status, RST_REFUSED_STREAM);
                    refused.push(stream_id);
                }
                f => panic!("{f:?}"),
            }
        }
        assert_eq!(replies, MAX_OPEN_STREAMS);
        assert_eq!(refused.len(), 3);
        drop(c);
        assert_eq!(drain.await.unwrap(), MAX_OPEN_STREAMS);
    }
}
