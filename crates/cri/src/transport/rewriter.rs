//! The sans-IO half of the `:authority` repair: client→server bytes in,
//! what the server reads out (see the [module docs](super)).

use std::fmt;

use bytes::BytesMut;
use loona_hpack::Decoder;

use super::wire::{
    encode_header, write_block, FLAG_END_HEADERS, FLAG_END_STREAM, FLAG_PADDED, FLAG_PRIORITY,
    FRAME_HEADER_LEN, PREFACE, TYPE_CONTINUATION, TYPE_HEADERS,
};

/// Largest HPACK dynamic table the client may ask for with a size update.
/// h2 (under hyper and tonic, which offer no knob for it) never advertises
/// `SETTINGS_HEADER_TABLE_SIZE`, so its decoder allows the default 4096 and
/// rejects larger updates; we mirror that.
const HEADER_TABLE_SIZE: usize = 4_096;
/// Largest header block (the raw frames) or decoded header list that is
/// buffered for rewriting; beyond it the connection falls back to
/// pass-through and the server's own limits apply.
pub const MAX_HEADER_BLOCK: usize = 1 << 20;
/// What an invalid `:authority` is replaced with.
const REPLACEMENT_AUTHORITY: &[u8] = b"localhost";

/// Whether `value` is an `:authority` that h2 accepts.
fn valid_authority(value: &[u8]) -> bool {
    !value.contains(&b'/') && http::uri::Authority::try_from(value).is_ok()
}

/// Where the parser is in the client→server stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Checking the preface; holds how many bytes of it have been seen.
    Preface(usize),
    /// Walking frames.
    Frames,
    /// Forwarding everything unchanged from here on.
    Passthrough,
}

/// A header block being collected (a `HEADERS` frame and its
/// `CONTINUATION`s).
struct PendingBlock {
    stream_id: u32,
    end_stream: bool,
    /// The original frames, forwarded as they are when no rewrite is needed.
    raw: BytesMut,
    /// The header block fragments, padding and priority removed.
    fragment: Vec<u8>,
}

/// The sans-IO part: turns client→server bytes into what the server reads.
pub(crate) struct Rewriter {
    phase: Phase,
    /// Bytes of a forwarded (non-header) frame payload still to come.
    payload_left: usize,
    block: Option<PendingBlock>,
    /// Mirrors the client's HPACK encoder.
    decoder: Decoder<'static>,
    /// Set at the first invalid `:authority`; from then on every block is
    /// re-encoded.
    rewriting: bool,
    /// Header blocks re-encoded so far.
    rewritten: u64,
    /// Scratch: decoded names and values back to back.
    decoded: Vec<u8>,
    /// Scratch: (offset, name length, value length) into `decoded`.
    spans: Vec<(usize, usize, usize)>,
    /// Scratch: the re-encoded block.
    encoded: Vec<u8>,
}

impl fmt::Debug for Rewriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rewriter")
            .field("phase", &self.phase)
            .field("payload_left", &self.payload_left)
            .field("pending_block", &self.block.is_some())
            .field("rewriting", &self.rewriting)
            .field("rewritten", &self.rewritten)
            .finish_non_exhaustive()
    }
}

impl Rewriter {
    pub(crate) fn new() -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(HEADER_TABLE_SIZE);
        Self {
            phase: Phase::Preface(0),
            payload_left: 0,
            block: None,
            decoder,
            rewriting: false,
            rewritten: 0,
            decoded: Vec::new(),
            spans: Vec::new(),
            encoded: Vec::new(),
        }
    }

    /// How many bytes the caller may read from the socket straight into the
    /// server's buffer, bypassing the parser (only when nothing is buffered).
    pub(super) fn direct_read_limit(&self) -> Option<usize> {
        match self.phase {
            Phase::Passthrough => Some(usize::MAX),
            Phase::Frames if self.payload_left > 0 => Some(self.payload_left),
            _ => None,
        }
    }

    /// Records `n` bytes read through [`Self::direct_read_limit`].
    pub(super) fn consumed_directly(&mut self, n: usize) {
        if self.phase == Phase::Frames {
            self.payload_left = self.payload_left.saturating_sub(n);
        }
    }

    /// Consumes what it can of `input`, appending the server's bytes to
    /// `out`. Returns when more input is needed.
    pub(crate) fn process(&mut self, input: &mut BytesMut, out: &mut BytesMut) {
        loop {
            match self.phase {
                Phase::Passthrough => {
                    if !input.is_empty() {
                        out.unsplit(input.split());
                    }
                    return;
                }
                Phase::Preface(seen) => {
                    let n = input.len().min(PREFACE.len() - seen);
                    if n == 0 {
                        return;
                    }
                    if input[..n] != PREFACE[seen..seen + n] {
                        tracing::debug!("not an HTTP/2 preface, passing the connection through");
                        self.phase = Phase::Passthrough;
                        continue;
                    }
                    out.unsplit(input.split_to(n));
                    self.phase = if seen + n == PREFACE.len() {
                        Phase::Frames
                    } else {
                        Phase::Preface(seen + n)
                    };
                }
                Phase::Frames => {
                    if self.payload_left > 0 {
                        let n = input.len().min(self.payload_left);
                        if n == 0 {
                            return;
                        }
                        out.unsplit(input.split_to(n));
                        self.payload_left -= n;
                        continue;
                    }
                    if input.len() < FRAME_HEADER_LEN {
                        return;
                    }
                    let len = usize::from(input[0]) << 16
                        | usize::from(input[1]) << 8
                        | usize::from(input[2]);
                    let kind = input[3];
                    let stream_id =
                        u32::from_be_bytes([input[5], input[6], input[7], input[8]]) & 0x7fff_ffff;
                    let header_frame = match &self.block {
                        None => kind == TYPE_HEADERS,
                        Some(block) => {
                            if kind != TYPE_CONTINUATION || block.stream_id != stream_id {
                                // RFC 9113 §6.10: a connection error the
                                // server must see for itself.
                                self.give_up(out, None, "frame inside a header block");
                                continue;
                            }
                            true
                        }
                    };
                    if !header_frame {
                        out.unsplit(input.split_to(FRAME_HEADER_LEN));
                        self.payload_left = len;
                        continue;
                    }
                    let held = self.block.as_ref().map_or(0, |b| b.raw.len());
                    if held + FRAME_HEADER_LEN + len > MAX_HEADER_BLOCK {
                        self.give_up(out, None, "header block too large");
                        continue;
                    }
                    if input.len() < FRAME_HEADER_LEN + len {
                        return;
                    }
                    let frame = input.split_to(FRAME_HEADER_LEN + len);
                    self.header_frame(frame, stream_id, out);
                }
            }
        }
    }

    /// Takes one complete `HEADERS` or `CONTINUATION` frame.
    fn header_frame(&mut self, frame: BytesMut, stream_id: u32, out: &mut BytesMut) {
        let kind = frame[3];
        let flags = frame[4];
        let payload = &frame[FRAME_HEADER_LEN..];
        match self.block.as_mut() {
            Some(block) => {
                block.fragment.extend_from_slice(payload);
                block.raw.unsplit(frame);
            }
            None => {
                debug_assert_eq!(kind, TYPE_HEADERS);
                let mut start = 0;
                let mut end = payload.len();
                if flags & FLAG_PADDED != 0 {
                    let pad = payload.first().copied().map_or(usize::MAX, usize::from);
                    start = 1;
                    end = end.saturating_sub(pad);
                }
                if flags & FLAG_PRIORITY != 0 {
                    start += 5;
                }
                if stream_id == 0 || start > end {
                    self.give_up(out, Some(frame), "malformed HEADERS frame");
                    return;
                }
                let fragment = payload[start..end].to_vec();
                self.block = Some(PendingBlock {
                    stream_id,
                    end_stream: flags & FLAG_END_STREAM != 0,
                    raw: frame,
                    fragment,
                });
            }
        }
        if flags & FLAG_END_HEADERS != 0 {
            self.finish_block(out);
        }
    }

    /// Decodes the complete pending block and forwards it, rewritten if
    /// needed.
    fn finish_block(&mut self, out: &mut BytesMut) {
        let Some(block) = self.block.take() else {
            return;
        };
        self.decoded.clear();
        self.spans.clear();
        let mut too_large = false;
        let decoded = &mut self.decoded;
        let spans = &mut self.spans;
        let result = self.decoder.decode_with_cb(&block.fragment, |name, value| {
            if too_large || decoded.len() + name.len() + value.len() > MAX_HEADER_BLOCK {
                too_large = true;
                return;
            }
            spans.push((decoded.len(), name.len(), value.len()));
            decoded.extend_from_slice(&name);
            decoded.extend_from_slice(&value);
        });
        if let Err(e) = result {
            tracing::debug!(error = ?e, "undecodable header block, passing the connection through");
            self.block = Some(block);
            self.give_up(out, None, "hpack error");
            return;
        }
        if too_large {
            self.block = Some(block);
            self.give_up(out, None, "header list too large");
            return;
        }
        if !self.rewriting {
            let bad = self.spans.iter().find_map(|&(at, n, v)| {
                let name = &self.decoded[at..at + n];
                let value = &self.decoded[at + n..at + n + v];
                (name == b":authority" && !valid_authority(value)).then_some(value)
            });
            match bad {
                None => {
                    out.unsplit(block.raw);
                    return;
                }
                Some(value) => {
                    tracing::debug!(
                        authority = %String::from_utf8_lossy(value),
                        "client sent an invalid :authority, re-encoding its header blocks"
                    );
                    self.rewriting = true;
                }
            }
        }
        self.encode_block();
        write_block(out, block.stream_id, block.end_stream, &self.encoded);
        self.rewritten += 1;
    }

    /// Re-encodes the decoded header list into `self.encoded`, without the
    /// dynamic table.
    fn encode_block(&mut self) {
        self.encoded.clear();
        for &(at, n, v) in &self.spans {
            let name = &self.decoded[at..at + n];
            let mut value = &self.decoded[at + n..at + n + v];
            if name == b":authority" && !valid_authority(value) {
                value = REPLACEMENT_AUTHORITY;
            }
            encode_header(&mut self.encoded, name, value);
        }
    }

    /// Falls back to forwarding everything unchanged: the held header block
    /// (and `extra`, a frame already taken out of the input) go out first.
    fn give_up(&mut self, out: &mut BytesMut, extra: Option<BytesMut>, why: &str) {
        tracing::debug!(reason = why, "passing the connection through unchanged");
        if let Some(block) = self.block.take() {
            out.unsplit(block.raw);
        }
        if let Some(extra) = extra {
            out.unsplit(extra);
        }
        self.phase = Phase::Passthrough;
    }

    /// The client closed its side: whatever is held goes out as it is.
    pub(crate) fn finish(&mut self, input: &mut BytesMut, out: &mut BytesMut) {
        if let Some(block) = self.block.take() {
            out.unsplit(block.raw);
        }
        out.unsplit(input.split());
        self.phase = Phase::Passthrough;
    }

    /// Whether header blocks of this connection are being re-encoded.
    pub(crate) fn rewriting(&self) -> bool {
        self.rewriting
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::test_util::*;
    use crate::transport::wire::{encode_string, MAX_FRAME_SIZE};
    use loona_hpack::Encoder;
    use proptest::prelude::*;

    #[test]
    fn valid_authority_is_forwarded_byte_for_byte() {
        let reqs: Vec<Headers> = (0..4)
            .map(|i| grpc_request("localhost", &format!("/runtime.v1.RuntimeService/M{i}")))
            .collect();
        let input = client_stream(&reqs);
        let (out, rewriting) = run(&input, input.len());
        assert!(!rewriting);
        assert_eq!(out, input);
    }

    #[test]
    fn rfc_7541_huffman_requests_pass_unchanged() {
        // RFC 7541 C.4: three requests, Huffman-coded, using the dynamic
        // table.
        let blocks: [&[u8]; 3] = [
            &[
                0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab,
                0x90, 0xf4, 0xff,
            ],
            &[
                0x82, 0x86, 0x84, 0xbe, 0x58, 0x86, 0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf,
            ],
            &[
                0x82, 0x87, 0x85, 0xbf, 0x40, 0x88, 0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xa9, 0x7d, 0x7f,
                0x89, 0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xb8, 0xe8, 0xb4, 0xbf,
            ],
        ];
        let mut input = PREFACE.to_vec();
        for (i, b) in blocks.iter().enumerate() {
            input.extend(frame(
                TYPE_HEADERS,
                FLAG_END_HEADERS | FLAG_END_STREAM,
                1 + 2 * i as u32,
                b,
            ));
        }
        let (out, rewriting) = run(&input, 3);
        assert!(!rewriting);
        assert_eq!(out, input);
        let view = server_view(&out);
        assert_eq!(
            view[2].2,
            headers(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value"),
            ])
        );
    }

    #[test]
    fn socket_path_authority_is_rewritten_across_requests() {
        let path = "/run/cubelet/cubelet.sock";
        let reqs: Vec<Headers> = [
            "/runtime.v1.RuntimeService/Version",
            "/runtime.v1.RuntimeService/ListPodSandbox",
            "/runtime.v1.RuntimeService/Version",
            "/runtime.v1.ImageService/ListImages",
        ]
        .iter()
        .map(|p| grpc_request(path, p))
        .collect();
        let input = client_stream(&reqs);
        for chunk in [1, 7, 100, input.len()] {
            let (out, rewriting) = run(&input, chunk);
            assert!(rewriting);
            let view = server_view(&out);
            assert_eq!(view.len(), reqs.len());
            for (i, (id, end_stream, list)) in view.into_iter().enumerate() {
                assert_eq!(id, 1 + 2 * i as u32);
                assert!(!end_stream);
                assert_eq!(list, with_authority(reqs[i].clone(), "localhost"));
            }
            // The SETTINGS and DATA frames are untouched.
            let frames = parse_frames(&out[PREFACE.len()..]);
            assert_eq!(frames[0], (0x4, 0, 0, vec![0, 3, 0, 0, 0, 100]));
            assert_eq!(frames[2], (0x0, FLAG_END_STREAM, 1, vec![0; 5]));
        }
    }

    #[test]
    fn rewriting_starts_at_the_first_bad_block_and_keeps_tables_in_sync() {
        // Block 1 is valid and forwarded raw (the server's table learns its
        // indexed entries); block 2 is bad; block 3 is valid again but its
        // encoding refers to entries the client indexed in all blocks.
        let reqs = vec![
            grpc_request("localhost", "/a"),
            grpc_request("/tmp/x.sock", "/b"),
            headers(&[
                (":method", "POST"),
                (":path", "/a"),
                (":authority", "localhost"),
                ("te", "trailers"),
                ("grpc-timeout", "1999m"),
                ("x-extra", "1"),
            ]),
        ];
        let input = client_stream(&reqs);
        let (out, rewriting) = run(&input, 5);
        assert!(rewriting);
        let view = server_view(&out);
        assert_eq!(view[0].2, reqs[0]);
        assert_eq!(view[1].2, with_authority(reqs[1].clone(), "localhost"));
        assert_eq!(view[2].2, reqs[2]);
    }

    #[test]
    fn only_invalid_authorities_are_replaced() {
        for (authority, replaced) in [
            ("localhost", false),
            ("[::]", false),
            ("[::1]:10000", false),
            ("127.0.0.1:1234", false),
            // h2 rejects these too (same parser), so they are replaced.
            ("%2Frun%2Fcubelet.sock", true),
            ("cubelet.sock", false),
            ("/run/cubelet/cubelet.sock", true),
            ("run/x", true),
            ("", true),
            ("a b", true),
        ] {
            let req = grpc_request(authority, "/x");
            let input = client_stream(std::slice::from_ref(&req));
            let (out, rewriting) = run(&input, input.len());
            assert_eq!(rewriting, replaced, "{authority:?}");
            let expect = if replaced {
                with_authority(req, "localhost")
            } else {
                req
            };
            assert_eq!(server_view(&out)[0].2, expect, "{authority:?}");
        }
    }

    #[test]
    fn padded_priority_headers_and_continuations_are_reassembled() {
        let mut req = grpc_request("/run/x.sock", "/runtime.v1.RuntimeService/Version");
        req.push((b"x-big".to_vec(), vec![b'z'; 40_000]));
        let block = Encoder::new().encode(req.iter().map(|(n, v)| (&n[..], &v[..])));
        let (a, rest) = block.split_at(10);
        let (b, c) = rest.split_at(20_000);
        // HEADERS: PADDED (pad 4) + PRIORITY + END_STREAM, then two
        // CONTINUATIONs.
        let mut first = vec![4];
        first.extend_from_slice(&[0x80, 0, 0, 3, 15]);
        first.extend_from_slice(a);
        first.extend_from_slice(&[0; 4]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM,
            5,
            &first,
        ));
        input.extend(frame(TYPE_CONTINUATION, 0, 5, b));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 5, c));
        input.extend(frame(0x6, 0, 0, &[1; 8])); // PING after it
        let (out, rewriting) = run(&input, 4096);
        assert!(rewriting);
        let view = server_view(&out);
        assert_eq!(view, vec![(5, true, with_authority(req, "localhost"))]);
        let frames = parse_frames(&out[PREFACE.len()..]);
        // 40 KB of literal: HEADERS + 2 CONTINUATIONs, END_HEADERS on the
        // last only, END_STREAM on HEADERS, no padding/priority.
        let kinds: Vec<(u8, u8)> = frames.iter().map(|f| (f.0, f.1)).collect();
        assert_eq!(
            kinds,
            vec![
                (TYPE_HEADERS, FLAG_END_STREAM),
                (TYPE_CONTINUATION, 0),
                (TYPE_CONTINUATION, FLAG_END_HEADERS),
                (0x6, 0),
            ]
        );
        assert!(frames.iter().all(|f| f.3.len() <= MAX_FRAME_SIZE));
    }

    #[test]
    fn garbage_is_passed_through() {
        // Not HTTP/2 at all.
        let h1 = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        assert_eq!(run(&h1, 3).0, h1);
        // Undecodable HPACK (index 70 with an empty dynamic table).
        let mut bad = PREFACE.to_vec();
        bad.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &[0x80 | 70]));
        bad.extend(frame(0x0, 0, 1, b"abc"));
        assert_eq!(run(&bad, 5).0, bad);
        // A DATA frame inside a header block.
        let mut inside = PREFACE.to_vec();
        inside.extend(frame(TYPE_HEADERS, 0, 1, &[0x83]));
        inside.extend(frame(0x0, 0, 1, b"abc"));
        assert_eq!(run(&inside, 2).0, inside);
        // Pad length larger than the frame.
        let mut pad = PREFACE.to_vec();
        pad.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_PADDED,
            1,
            &[9, 0x83],
        ));
        assert_eq!(run(&pad, 64).0, pad);
        // Truncated: the client goes away in the middle of a header block.
        let mut cut = PREFACE.to_vec();
        cut.extend(frame(TYPE_HEADERS, 0, 1, &[0x83]));
        cut.extend_from_slice(&[0, 0, 9, TYPE_CONTINUATION]);
        assert_eq!(run(&cut, 10).0, cut);
    }

    #[test]
    fn oversized_header_block_falls_back_to_passthrough() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, 0, 1, &[0x83]));
        let chunk = vec![0u8; MAX_FRAME_SIZE];
        for _ in 0..(MAX_HEADER_BLOCK / MAX_FRAME_SIZE + 1) {
            input.extend(frame(TYPE_CONTINUATION, 0, 1, &chunk));
        }
        let mut rw = Rewriter::new();
        let mut pending = BytesMut::new();
        let mut out = BytesMut::new();
        let mut result = Vec::new();
        for piece in input.chunks(4096) {
            pending.extend_from_slice(piece);
            rw.process(&mut pending, &mut out);
            assert!(pending.len() <= MAX_FRAME_SIZE + 4096 + FRAME_HEADER_LEN);
            assert!(rw.block.as_ref().map_or(0, |b| b.raw.len()) <= MAX_HEADER_BLOCK);
            result.extend_from_slice(&out);
            out.clear();
        }
        assert_eq!(rw.phase, Phase::Passthrough);
        rw.finish(&mut pending, &mut out);
        result.extend_from_slice(&out);
        assert_eq!(result, input);
    }

    #[test]
    fn header_list_bomb_is_bounded() {
        // One 4000-byte entry indexed once, then referenced 400 times
        // (~1.6 MB decoded from a ~400 byte block).
        let mut block = vec![0x40];
        encode_string(&mut block, b"x");
        encode_string(&mut block, &[b'v'; 4000]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block));
        let mut refs = Vec::new();
        for _ in 0..400 {
            refs.push(0x80 | 62);
        }
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 3, &refs));
        let (out, _) = run(&input, input.len());
        // Passed through unchanged rather than expanded.
        assert_eq!(out, input);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(
            body in proptest::collection::vec(any::<u8>(), 0..600),
            chunk in 1usize..64,
        ) {
            let mut input = PREFACE.to_vec();
            input.extend(body);
            let (out, rewriting) = run(&input, chunk);
            if !rewriting {
                prop_assert_eq!(out, input);
            }
        }

        #[test]
        fn arbitrary_frames_never_panic(
            frames in proptest::collection::vec(
                (0u8..10, any::<u8>(), 0u32..4, proptest::collection::vec(any::<u8>(), 0..40)),
                0..12,
            ),
        ) {
            let mut input = PREFACE.to_vec();
            for (kind, flags, id, payload) in frames {
                input.extend(frame(kind, flags, id, &payload));
            }
            let (out, rewriting) = run(&input, 9);
            if !rewriting {
                prop_assert_eq!(out, input);
            }
        }
    }
}
