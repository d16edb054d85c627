//! Helpers shared by the transport tests: header lists, raw frames, a
//! client's byte stream, a rewriter run in pieces and the server's view.

use bytes::BytesMut;
use loona_hpack::{Decoder, Encoder};

use super::rewriter::Rewriter;
use super::wire::{
    FLAG_END_HEADERS, FLAG_END_STREAM, FLAG_PADDED, FLAG_PRIORITY, FRAME_HEADER_LEN, PREFACE,
    TYPE_CONTINUATION, TYPE_HEADERS,
};

pub(crate) type Headers = Vec<(Vec<u8>, Vec<u8>)>;

pub(crate) fn headers(list: &[(&str, &str)]) -> Headers {
    list.iter()
        .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
}

pub(crate) fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.push(kind);
    f.push(flags);
    f.extend_from_slice(&stream_id.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

pub(crate) fn grpc_request(authority: &str, path: &str) -> Headers {
    headers(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("user-agent", "grpc-go/1.50.1"),
        ("te", "trailers"),
        ("grpc-timeout", "1999m"),
    ])
}

/// Parsed frames: (type, flags, stream id, payload).
pub(crate) fn parse_frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
    let mut frames = Vec::new();
    while !bytes.is_empty() {
        let len =
            (usize::from(bytes[0]) << 16) | (usize::from(bytes[1]) << 8) | usize::from(bytes[2]);
        let id = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
        frames.push((
            bytes[3],
            bytes[4],
            id,
            bytes[FRAME_HEADER_LEN..FRAME_HEADER_LEN + len].to_vec(),
        ));
        bytes = &bytes[FRAME_HEADER_LEN + len..];
    }
    frames
}

/// Runs `input` through a rewriter in pieces of `chunk` bytes.
pub(crate) fn run(input: &[u8], chunk: usize) -> (Vec<u8>, bool) {
    let mut rw = Rewriter::new();
    let mut pending = BytesMut::new();
    let mut out = BytesMut::new();
    let mut result = Vec::new();
    for piece in input.chunks(chunk) {
        pending.extend_from_slice(piece);
        rw.process(&mut pending, &mut out);
        result.extend_from_slice(&out);
        out.clear();
    }
    rw.finish(&mut pending, &mut out);
    result.extend_from_slice(&out);
    (result, rw.rewriting())
}

/// Decodes every header block of the server-side stream `bytes` (after
/// the preface) with one decoder, as the server would; checks that each
/// block is a single well-formed HEADERS(+CONTINUATION) sequence.
pub(crate) fn server_view(bytes: &[u8]) -> Vec<(u32, bool, Headers)> {
    assert_eq!(&bytes[..PREFACE.len()], PREFACE);
    let mut decoder = Decoder::new();
    let mut blocks = Vec::new();
    let mut current: Option<(u32, bool, Vec<u8>)> = None;
    for (kind, flags, id, payload) in parse_frames(&bytes[PREFACE.len()..]) {
        match kind {
            TYPE_HEADERS => {
                assert!(current.is_none(), "HEADERS inside a header block");
                let mut p = &payload[..];
                if flags & FLAG_PADDED != 0 {
                    let pad = usize::from(p[0]);
                    p = &p[1..p.len() - pad];
                }
                if flags & FLAG_PRIORITY != 0 {
                    p = &p[5..];
                }
                current = Some((id, flags & FLAG_END_STREAM != 0, p.to_vec()));
            }
            TYPE_CONTINUATION => {
                let c = current.as_mut().expect("CONTINUATION without HEADERS");
                assert_eq!(c.0, id);
                c.2.extend_from_slice(&payload);
            }
            _ => {
                assert!(current.is_none(), "frame inside a header block");
                continue;
            }
        }
        if flags & FLAG_END_HEADERS != 0 {
            let (id, end, block) = current.take().unwrap();
            blocks.push((id, end, decoder.decode(&block).unwrap()));
        }
    }
    assert!(current.is_none(), "unterminated header block");
    blocks
}

pub(crate) fn with_authority(mut h: Headers, authority: &str) -> Headers {
    for (n, v) in &mut h {
        if n == b":authority" {
            *v = authority.as_bytes().to_vec();
        }
    }
    h
}

/// A client connection: preface, SETTINGS, then per request one header
/// block (encoded with indexing, so later blocks use the dynamic table)
/// and a DATA frame.
pub(crate) fn client_stream(requests: &[Headers]) -> Vec<u8> {
    let mut enc = Encoder::new();
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100]));
    for (i, req) in requests.iter().enumerate() {
        let id = 1 + 2 * i as u32;
        let block = enc.encode(req.iter().map(|(n, v)| (&n[..], &v[..])));
        bytes.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, id, &block));
        bytes.extend(frame(0x0, FLAG_END_STREAM, id, &[0, 0, 0, 0, 0]));
    }
    bytes
}
