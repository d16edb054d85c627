//! SPDY/3.1 framing: control and data frames, and the name/value header
//! blocks compressed with zlib primed by the SPDY/3 dictionary.
//!
//! Only what a server of the Kubernetes streaming protocols needs: no
//! server push, no priorities, no credential frames.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

/// Protocol version carried by every control frame.
pub(crate) const VERSION: u16 = 3;
/// Flag of DATA, SYN_STREAM, SYN_REPLY and HEADERS: the sender's last frame.
pub(crate) const FLAG_FIN: u8 = 0x01;
/// Initial per-stream and session flow-control window (64 KiB).
pub(crate) const INITIAL_WINDOW: u32 = 64 * 1024;
/// SETTINGS id of the initial per-stream window size.
pub(crate) const SETTINGS_INITIAL_WINDOW_SIZE: u32 = 7;
/// Largest frame payload we accept (the length field allows 16 MiB).
const MAX_FRAME: usize = 1 << 24;
/// Largest decompressed header block we accept.
const MAX_HEADER_BLOCK: usize = 256 * 1024;
/// Largest control frame we accept: a compressed header block can be a
/// little larger than the block itself.
pub(crate) const MAX_CONTROL_FRAME: usize = MAX_HEADER_BLOCK + 1024;

/// RST_STREAM status: protocol error.
pub(crate) const RST_PROTOCOL_ERROR: u32 = 1;

const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const SETTINGS: u16 = 4;
const PING: u16 = 6;
const GOAWAY: u16 = 7;
const HEADERS: u16 = 8;
const WINDOW_UPDATE: u16 = 9;

/// Errors of the SPDY layer (framing, header compression, I/O).
#[derive(Debug, thiserror::Error)]
pub(crate) enum SpdyError {
    /// A frame broke the framing rules.
    #[error("spdy protocol error: {0}")]
    Protocol(String),
    /// A frame is larger than allowed.
    #[error(
        "spdy frame of {len} bytes exceeds the limit of {max} bytes (streaming.max_message_size)"
    )]
    TooLarge {
        /// Its announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A header block did not inflate.
    #[error("spdy header block: {0}")]
    Inflate(#[source] flate2::DecompressError),
    /// A header block did not deflate.
    #[error("spdy header block: {0}")]
    Deflate(#[source] flate2::CompressError),
    /// Nothing moved either way for this long.
    #[error("no frame in either direction for {}s (streaming.stream_idle_timeout)", .0.as_secs())]
    Idle(std::time::Duration),
    /// The connection failed.
    #[error("spdy connection: {0}")]
    Io(#[source] std::io::Error),
}

/// One SPDY/3.1 frame. Header blocks are carried compressed; see
/// [`HeaderCodec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Frame {
    /// DATA.
    Data {
        /// Stream.
        stream_id: u32,
        /// FIN flag.
        fin: bool,
        /// Payload.
        data: Bytes,
    },
    /// SYN_STREAM: the peer opens a stream.
    SynStream {
        /// New stream.
        stream_id: u32,
        /// Stream this one is associated to (0: none).
        associated_to: u32,
        /// Priority (0 highest).
        priority: u8,
        /// Raw flags (FIN, UNIDIRECTIONAL).
        flags: u8,
        /// Compressed header block.
        block: Bytes,
    },
    /// SYN_REPLY: answer to a SYN_STREAM.
    SynReply {
        /// Stream.
        stream_id: u32,
        /// FIN flag.
        fin: bool,
        /// Compressed header block.
        block: Bytes,
    },
    /// RST_STREAM: abnormal end of a stream.
    RstStream {
        /// Stream.
        stream_id: u32,
        /// Status code.
        status: u32,
    },
    /// SETTINGS: (flags, id, value) entries.
    Settings {
        /// Entries.
        entries: Vec<(u8, u32, u32)>,
    },
    /// PING, echoed by the receiver of a peer-initiated one.
    Ping {
        /// Opaque id.
        id: u32,
    },
    /// GOAWAY: no new streams after `last_good`.
    GoAway {
        /// Last stream the sender processed.
        last_good: u32,
        /// Status code.
        status: u32,
    },
    /// HEADERS: more headers for a stream.
    Headers {
        /// Stream.
        stream_id: u32,
        /// FIN flag.
        fin: bool,
        /// Compressed header block.
        block: Bytes,
    },
    /// WINDOW_UPDATE: the receiver consumed `delta` bytes (stream 0: the
    /// session window).
    WindowUpdate {
        /// Stream, or 0 for the session.
        stream_id: u32,
        /// Bytes added to the window.
        delta: u32,
    },
    /// A control frame type we ignore (e.g. CREDENTIAL).
    Unknown {
        /// Its type.
        kind: u16,
    },
}

fn control(out: &mut BytesMut, kind: u16, flags: u8, len: usize) {
    out.put_u16(0x8000 | VERSION);
    out.put_u16(kind);
    out.put_u32((u32::from(flags) << 24) | (len as u32 & 0x00ff_ffff));
}

impl Frame {
    /// Appends the wire form of this frame to `out`.
    pub(crate) fn encode(&self, out: &mut BytesMut) {
        match self {
            Frame::Data {
                stream_id,
                fin,
                data,
            } => {
                out.put_u32(stream_id & 0x7fff_ffff);
                let flags = if *fin { FLAG_FIN } else { 0 };
                out.put_u32((u32::from(flags) << 24) | (data.len() as u32 & 0x00ff_ffff));
                out.put_slice(data);
            }
            Frame::SynStream {
                stream_id,
                associated_to,
                priority,
                flags,
                block,
            } => {
                control(out, SYN_STREAM, *flags, 10 + block.len());
                out.put_u32(stream_id & 0x7fff_ffff);
                out.put_u32(associated_to & 0x7fff_ffff);
                out.put_u8((priority & 0x07) << 5);
                out.put_u8(0);
                out.put_slice(block);
            }
            Frame::SynReply {
                stream_id,
                fin,
                block,
            }
            | Frame::Headers {
                stream_id,
                fin,
                block,
            } => {
                let kind = if matches!(self, Frame::SynReply { .. }) {
                    SYN_REPLY
                } else {
                    HEADERS
                };
                control(out, kind, if *fin { FLAG_FIN } else { 0 }, 4 + block.len());
                out.put_u32(stream_id & 0x7fff_ffff);
                out.put_slice(block);
            }
            Frame::RstStream { stream_id, status } => {
                control(out, RST_STREAM, 0, 8);
                out.put_u32(stream_id & 0x7fff_ffff);
                out.put_u32(*status);
            }
            Frame::Settings { entries } => {
                control(out, SETTINGS, 0, 4 + 8 * entries.len());
                out.put_u32(entries.len() as u32);
                for (flags, id, value) in entries {
                    out.put_u32((u32::from(*flags) << 24) | (id & 0x00ff_ffff));
                    out.put_u32(*value);
                }
            }
            Frame::Ping { id } => {
                control(out, PING, 0, 4);
                out.put_u32(*id);
            }
            Frame::GoAway { last_good, status } => {
                control(out, GOAWAY, 0, 8);
                out.put_u32(last_good & 0x7fff_ffff);
                out.put_u32(*status);
            }
            Frame::WindowUpdate { stream_id, delta } => {
                control(out, WINDOW_UPDATE, 0, 8);
                out.put_u32(stream_id & 0x7fff_ffff);
                out.put_u32(delta & 0x7fff_ffff);
            }
            Frame::Unknown { kind } => control(out, *kind, 0, 0),
        }
    }

    /// Takes one whole frame off the front of `buf`; `Ok(None)` when more
    /// bytes are needed.
    #[cfg(test)]
    pub(crate) fn decode(buf: &mut BytesMut) -> Result<Option<Frame>, SpdyError> {
        Self::decode_limited(buf, MAX_FRAME)
    }

    /// [`Frame::decode`], refusing a DATA frame of more than `max_data`
    /// bytes (and a control frame of more than [`MAX_CONTROL_FRAME`]) as
    /// soon as its header is read, before buffering it.
    pub(crate) fn decode_limited(
        buf: &mut BytesMut,
        max_data: usize,
    ) -> Result<Option<Frame>, SpdyError> {
        if buf.len() < 8 {
            return Ok(None);
        }
        let w1 = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
        let w2 = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
        let flags = (w2 >> 24) as u8;
        let len = (w2 & 0x00ff_ffff) as usize;
        let max = if w1 & 0x8000_0000 == 0 {
            max_data.min(MAX_FRAME - 1)
        } else {
            MAX_CONTROL_FRAME
        };
        if len > max {
            return Err(SpdyError::TooLarge { len, max });
        }
        if buf.len() < 8 + len {
            buf.reserve(8 + len - buf.len());
            return Ok(None);
        }
        buf.advance(8);
        let mut p = buf.split_to(len).freeze();
        if w1 & 0x8000_0000 == 0 {
            return Ok(Some(Frame::Data {
                stream_id: w1 & 0x7fff_ffff,
                fin: flags & FLAG_FIN != 0,
                data: p,
            }));
        }
        let version = ((w1 >> 16) & 0x7fff) as u16;
        if version != VERSION {
            return Err(SpdyError::Protocol(format!(
                "unsupported version {version}"
            )));
        }
        let kind = (w1 & 0xffff) as u16;
        let need = |n: usize| {
            if len < n {
                Err(SpdyError::Protocol(format!(
                    "control frame type {kind} of {len} bytes, want at least {n}"
                )))
            } else {
                Ok(())
            }
        };
        let fin = flags & FLAG_FIN != 0;
        let f = match kind {
            SYN_STREAM => {
                need(10)?;
                let stream_id = p.get_u32() & 0x7fff_ffff;
                let associated_to = p.get_u32() & 0x7fff_ffff;
                let priority = p.get_u8() >> 5;
                p.advance(1);
                Frame::SynStream {
                    stream_id,
                    associated_to,
                    priority,
                    flags,
                    block: p,
                }
            }
            SYN_REPLY | HEADERS => {
                need(4)?;
                let stream_id = p.get_u32() & 0x7fff_ffff;
                if kind == SYN_REPLY {
                    Frame::SynReply {
                        stream_id,
                        fin,
                        block: p,
                    }
                } else {
                    Frame::Headers {
                        stream_id,
                        fin,
                        block: p,
                    }
                }
            }
            RST_STREAM => {
                need(8)?;
                Frame::RstStream {
                    stream_id: p.get_u32() & 0x7fff_ffff,
                    status: p.get_u32(),
                }
            }
            SETTINGS => {
                need(4)?;
                let n = p.get_u32() as usize;
                if p.remaining() < n.saturating_mul(8) {
                    return Err(SpdyError::Protocol(format!(
                        "SETTINGS announces {n} entries in {len} bytes"
                    )));
                }
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    let w = p.get_u32();
                    entries.push(((w >> 24) as u8, w & 0x00ff_ffff, p.get_u32()));
                }
                Frame::Settings { entries }
            }
            PING => {
                need(4)?;
                Frame::Ping { id: p.get_u32() }
            }
            GOAWAY => {
                need(4)?;
                let last_good = p.get_u32() & 0x7fff_ffff;
                let status = if p.remaining() >= 4 { p.get_u32() } else { 0 };
                Frame::GoAway { last_good, status }
            }
            WINDOW_UPDATE => {
                need(8)?;
                Frame::WindowUpdate {
                    stream_id: p.get_u32() & 0x7fff_ffff,
                    delta: p.get_u32() & 0x7fff_ffff,
                }
            }
            kind => Frame::Unknown { kind },
        };
        Ok(Some(f))
    }
}

const DICT_WORDS: &[&str] = &[
    "options",
    "head",
    "post",
    "put",
    "delete",
    "trace",
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-base",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-md5",
    "content-range",
    "content-type",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "method",
    "get",
    "status",
    "200 OK",
    "version",
    "HTTP/1.1",
    "url",
    "public",
    "set-cookie",
    "keep-alive",
    "origin",
];

const DICT_TAIL: &str = concat!(
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505",
    "203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request",
    "401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented",
    "503 Service Unavailable",
    "Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 ",
    "Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT",
    "chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,",
    "text/plain,text/javascript,publicprivatemax-age=gzip,deflate,sdch",
    "charset=utf-8charset=iso-8859-1,utf-,*,enq=0.",
);

/// The SPDY/3 header compression dictionary (1423 bytes): each of the
/// spec's words with a 4-byte big-endian length, then its fixed tail.
pub(crate) fn dictionary() -> Vec<u8> {
    let mut d = Vec::with_capacity(1423);
    for w in DICT_WORDS {
        d.extend_from_slice(&(w.len() as u32).to_be_bytes());
        d.extend_from_slice(w.as_bytes());
    }
    d.extend_from_slice(DICT_TAIL.as_bytes());
    d
}

/// Name/value pairs of a header block (names lowercase; a value may hold
/// several NUL-separated values).
pub(crate) type HeaderList = Vec<(String, Vec<u8>)>;

/// Looks up the first value of `name` in `h`.
pub(crate) fn header<'a>(h: &'a HeaderList, name: &str) -> Option<&'a str> {
    h.iter()
        .find(|(n, _)| n == name)
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
        .map(|v| v.split('\0').next().unwrap_or(v))
}

/// Serializes pairs into an uncompressed header block.
pub(crate) fn encode_block(h: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(h.len() as u32).to_be_bytes());
    for (n, v) in h {
        out.extend_from_slice(&(n.len() as u32).to_be_bytes());
        out.extend_from_slice(n.as_bytes());
        out.extend_from_slice(&(v.len() as u32).to_be_bytes());
        out.extend_from_slice(v);
    }
    out
}

/// Parses an uncompressed header block.
pub(crate) fn parse_block(mut b: &[u8]) -> Result<HeaderList, SpdyError> {
    let bad = |what: &str| SpdyError::Protocol(format!("header block: {what}"));
    if b.remaining() < 4 {
        return Err(bad("truncated count"));
    }
    let n = b.get_u32() as usize;
    let mut out = Vec::with_capacity(n.min(64));
    for _ in 0..n {
        let mut field = || -> Result<Vec<u8>, SpdyError> {
            if b.remaining() < 4 {
                return Err(bad("truncated length"));
            }
            let len = b.get_u32() as usize;
            if b.remaining() < len {
                return Err(bad("truncated field"));
            }
            let v = b[..len].to_vec();
            b.advance(len);
            Ok(v)
        };
        let name = field()?;
        let value = field()?;
        let name = String::from_utf8(name).map_err(|_| bad("name is not UTF-8"))?;
        out.push((name.to_ascii_lowercase(), value));
    }
    Ok(out)
}

/// One direction's zlib context: SPDY compresses every header block of a
/// connection in one stream, so each side keeps one inflater (for the
/// peer's blocks) and one deflater (for its own).
pub(crate) struct HeaderCodec {
    inflate: Decompress,
    deflate: Compress,
    dict: Vec<u8>,
    deflate_primed: bool,
}

impl std::fmt::Debug for HeaderCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeaderCodec").finish_non_exhaustive()
    }
}

impl Default for HeaderCodec {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderCodec {
    /// Fresh contexts for a new connection.
    pub(crate) fn new() -> Self {
        Self {
            inflate: Decompress::new(true),
            deflate: Compress::new(Compression::default(), true),
            dict: dictionary(),
            deflate_primed: false,
        }
    }

    /// Inflates one compressed header block and parses it.
    pub(crate) fn decode(&mut self, block: &[u8]) -> Result<HeaderList, SpdyError> {
        let mut out = Vec::with_capacity(block.len() * 4 + 64);
        let mut input = block;
        loop {
            if out.capacity() - out.len() < 256 {
                out.reserve(out.capacity().max(1024));
            }
            let before = self.inflate.total_in();
            let r = self
                .inflate
                .decompress_vec(input, &mut out, FlushDecompress::Sync);
            let used = (self.inflate.total_in() - before) as usize;
            input = &input[used..];
            match r {
                Ok(Status::StreamEnd) => break,
                Ok(_) => {
                    if input.is_empty() && out.capacity() > out.len() {
                        break;
                    }
                }
                Err(e) if e.needs_dictionary().is_some() => {
                    self.inflate
                        .set_dictionary(&self.dict)
                        .map_err(SpdyError::Inflate)?;
                }
                Err(e) => return Err(SpdyError::Inflate(e)),
            }
            if out.len() > MAX_HEADER_BLOCK {
                return Err(SpdyError::Protocol("header block too large".into()));
            }
        }
        parse_block(&out)
    }

    /// Serializes and deflates a header block (sync-flushed, so the peer
    /// can inflate it on its own).
    pub(crate) fn encode(&mut self, h: &[(&str, &[u8])]) -> Result<Bytes, SpdyError> {
        if !self.deflate_primed {
            self.deflate
                .set_dictionary(&self.dict)
                .map_err(SpdyError::Deflate)?;
            self.deflate_primed = true;
        }
        let raw = encode_block(h);
        let mut out = Vec::with_capacity(raw.len() + 64);
        let mut input = &raw[..];
        loop {
            if out.capacity() - out.len() < 64 {
                out.reserve(256);
            }
            let before = self.deflate.total_in();
            self.deflate
                .compress_vec(input, &mut out, FlushCompress::Sync)
                .map_err(SpdyError::Deflate)?;
            let used = (self.deflate.total_in() - before) as usize;
            input = &input[used..];
            // Done once all input is in and the flush left room to spare.
            if input.is_empty() && out.capacity() > out.len() {
                break;
            }
        }
        Ok(Bytes::from(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(f: Frame) {
        let mut b = BytesMut::new();
        f.encode(&mut b);
        let whole = b.clone();
        // A partial frame waits for more bytes.
        let mut part = BytesMut::from(&whole[..whole.len() - 1]);
        if whole.len() > 8 {
            assert_eq!(Frame::decode(&mut part).unwrap(), None);
        }
        assert_eq!(Frame::decode(&mut b).unwrap(), Some(f));
        assert!(b.is_empty());
    }

    #[test]
    fn frames_round_trip() {
        round_trip(Frame::Data {
            stream_id: 5,
            fin: true,
            data: Bytes::from_static(b"hello"),
        });
        round_trip(Frame::Data {
            stream_id: 0x7fff_fff1,
            fin: false,
            data: Bytes::new(),
        });
        round_trip(Frame::SynStream {
            stream_id: 1,
            associated_to: 0,
            priority: 3,
            flags: FLAG_FIN,
            block: Bytes::from_static(b"\x01\x02"),
        });
        round_trip(Frame::SynReply {
            stream_id: 3,
            fin: false,
            block: Bytes::from_static(b"zz"),
        });
        round_trip(Frame::Headers {
            stream_id: 3,
            fin: true,
            block: Bytes::new(),
        });
        round_trip(Frame::RstStream {
            stream_id: 7,
            status: RST_PROTOCOL_ERROR,
        });
        round_trip(Frame::Settings {
            entries: vec![(0, SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20), (1, 4, 100)],
        });
        round_trip(Frame::Ping { id: 0xdead_beef });
        round_trip(Frame::GoAway {
            last_good: 9,
            status: 0,
        });
        round_trip(Frame::WindowUpdate {
            stream_id: 0,
            delta: 4096,
        });
    }

    #[test]
    fn data_frame_wire_layout_matches_the_spec() {
        let mut b = BytesMut::new();
        Frame::Data {
            stream_id: 1,
            fin: true,
            data: Bytes::from_static(b"ab"),
        }
        .encode(&mut b);
        assert_eq!(&b[..], b"\x00\x00\x00\x01\x01\x00\x00\x02ab");
        let mut b = BytesMut::new();
        Frame::Ping { id: 1 }.encode(&mut b);
        assert_eq!(&b[..], b"\x80\x03\x00\x06\x00\x00\x00\x04\x00\x00\x00\x01");
    }

    #[test]
    fn bad_frames_are_errors_not_panics() {
        // Version 2 control frame.
        let mut b = BytesMut::from(&b"\x80\x02\x00\x06\x00\x00\x00\x04\x00\x00\x00\x01"[..]);
        assert!(Frame::decode(&mut b).is_err());
        // RST_STREAM too short.
        let mut b = BytesMut::from(&b"\x80\x03\x00\x03\x00\x00\x00\x02\x00\x00"[..]);
        assert!(Frame::decode(&mut b).is_err());
        // SETTINGS announcing more entries than it carries.
        let mut b = BytesMut::from(&b"\x80\x03\x00\x04\x00\x00\x00\x04\x00\x00\x00\x09"[..]);
        assert!(Frame::decode(&mut b).is_err());
        assert!(parse_block(b"\x00\x00\x00\x01\x00\x00\x00\x09ab").is_err());
        assert!(HeaderCodec::new().decode(b"garbage!").is_err());
    }

    #[test]
    fn dictionary_is_the_spdy3_one() {
        let d = dictionary();
        assert_eq!(d.len(), 1423);
        assert!(d.starts_with(b"\x00\x00\x00\x07options\x00\x00\x00\x04head"));
        assert!(d.ends_with(b"charset=iso-8859-1,utf-,*,enq=0."));
        // The DICTID a zlib stream primed with it announces.
        let mut c = Compress::new(Compression::default(), true);
        c.set_dictionary(&d).unwrap();
        let mut out = Vec::with_capacity(64);
        c.compress_vec(b"x", &mut out, FlushCompress::Sync).unwrap();
        assert_eq!(out[0] & 0x0f, 8, "deflate");
        assert_ne!(out[1] & 0x20, 0, "FDICT set");
        assert_eq!(&out[2..6], &0xe3c6_a7c2u32.to_be_bytes());
    }

    #[test]
    fn header_blocks_round_trip_through_the_zlib_contexts() {
        let mut server = HeaderCodec::new();
        let mut client = HeaderCodec::new();
        let first = client
            .encode(&[("streamtype", b"error"), ("port", b"8080")])
            .unwrap();
        let second = client
            .encode(&[("streamtype", b"data"), ("requestid", b"0")])
            .unwrap();
        // Later blocks reuse the context: each decodes only in order.
        let h = server.decode(&first).unwrap();
        assert_eq!(header(&h, "streamtype"), Some("error"));
        assert_eq!(header(&h, "port"), Some("8080"));
        let h = server.decode(&second).unwrap();
        assert_eq!(header(&h, "streamtype"), Some("data"));
        assert_eq!(header(&h, "requestid"), Some("0"));
        assert_eq!(header(&h, "nope"), None);
        let empty = server.encode(&[]).unwrap();
        assert_eq!(client.decode(&empty).unwrap(), vec![]);
    }

    #[test]
    fn decodes_a_block_built_from_the_spec_rules() {
        // Uncompressed block per SPDY/3 2.6.10, compressed by plain zlib
        // (not our deflater) with the dictionary, as a Go client does.
        let raw = b"\x00\x00\x00\x02\
                    \x00\x00\x00\x0astreamtype\x00\x00\x00\x06stdout\
                    \x00\x00\x00\x07version\x00\x00\x00\x08HTTP/1.1";
        let mut c = Compress::new(Compression::best(), true);
        c.set_dictionary(&dictionary()).unwrap();
        let mut z = Vec::with_capacity(256);
        c.compress_vec(raw, &mut z, FlushCompress::Sync).unwrap();
        let h = HeaderCodec::new().decode(&z).unwrap();
        assert_eq!(
            h,
            vec![
                ("streamtype".to_owned(), b"stdout".to_vec()),
                ("version".to_owned(), b"HTTP/1.1".to_vec()),
            ]
        );
        // Multi-valued headers keep their NUL separators; `header` gives
        // the first.
        let h = parse_block(&encode_block(&[("x", b"a\0b")])).unwrap();
        assert_eq!(header(&h, "x"), Some("a"));
    }
}
