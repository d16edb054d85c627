//! HTTP/2 framing constants and the HPACK encoder the rewriter re-encodes
//! header blocks with: static-table indexes and literals *without
//! indexing* only, so the server's dynamic table is never touched
//! (RFC 9113 §4 and §6, RFC 7541).

use bytes::{BufMut, BytesMut};

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
pub(super) const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Length of an HTTP/2 frame header.
pub(super) const FRAME_HEADER_LEN: usize = 9;
/// Frame types.
pub(super) const TYPE_HEADERS: u8 = 0x1;
pub(super) const TYPE_CONTINUATION: u8 = 0x9;
/// Frame flags.
pub(super) const FLAG_END_STREAM: u8 = 0x1;
pub(super) const FLAG_END_HEADERS: u8 = 0x4;
pub(super) const FLAG_PADDED: u8 = 0x8;
pub(super) const FLAG_PRIORITY: u8 = 0x20;
/// Largest frame payload we emit: the protocol minimum for
/// `SETTINGS_MAX_FRAME_SIZE`, which every server accepts.
pub(super) const MAX_FRAME_SIZE: usize = 16_384;

/// Writes `block` as one `HEADERS` frame, split into `CONTINUATION` frames
/// past [`MAX_FRAME_SIZE`].
pub(super) fn write_block(out: &mut BytesMut, stream_id: u32, end_stream: bool, block: &[u8]) {
    let frames = block.len().div_ceil(MAX_FRAME_SIZE).max(1);
    out.reserve(block.len() + frames * FRAME_HEADER_LEN);
    let mut rest = block;
    let mut first = true;
    loop {
        let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME_SIZE));
        let kind = if first {
            TYPE_HEADERS
        } else {
            TYPE_CONTINUATION
        };
        let mut flags = 0;
        if first && end_stream {
            flags |= FLAG_END_STREAM;
        }
        if tail.is_empty() {
            flags |= FLAG_END_HEADERS;
        }
        // chunk.len() <= MAX_FRAME_SIZE < 2^24
        let len = chunk.len() as u32;
        out.put_slice(&len.to_be_bytes()[1..]);
        out.put_u8(kind);
        out.put_u8(flags);
        out.put_u32(stream_id);
        out.put_slice(chunk);
        if tail.is_empty() {
            return;
        }
        rest = tail;
        first = false;
    }
}

/// The HPACK static table (RFC 7541 Appendix A), index = position + 1.
const STATIC_TABLE: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

/// Appends one header field: a static-table index when name and value
/// match an entry, else a literal without indexing (name indexed when it is
/// in the static table). Strings are sent raw, not Huffman-coded.
pub(super) fn encode_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    let mut name_index = 0;
    for (i, &(n, v)) in STATIC_TABLE.iter().enumerate() {
        if n == name {
            if v == value {
                encode_integer(out, i + 1, 7, 0x80);
                return;
            }
            if name_index == 0 {
                name_index = i + 1;
            }
        }
    }
    // Literal Header Field without Indexing: 0000 + 4-bit name index.
    encode_integer(out, name_index, 4, 0x00);
    if name_index == 0 {
        encode_string(out, name);
    }
    encode_string(out, value);
}

/// An HPACK string literal, not Huffman-coded.
pub(super) fn encode_string(out: &mut Vec<u8>, s: &[u8]) {
    encode_integer(out, s.len(), 7, 0x00);
    out.extend_from_slice(s);
}

/// An HPACK integer with an N-bit prefix (RFC 7541 §5.1); `flags` are the
/// bits above the prefix in the first octet.
fn encode_integer(out: &mut Vec<u8>, mut value: usize, prefix_bits: u8, flags: u8) {
    let max_prefix = (1usize << prefix_bits) - 1;
    if value < max_prefix {
        // value < 2^prefix_bits <= 128
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | max_prefix as u8);
    value -= max_prefix;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::test_util::headers;
    use loona_hpack::Decoder;

    #[test]
    fn static_table_matches_rfc_7541() {
        for (i, &(name, value)) in STATIC_TABLE.iter().enumerate() {
            let mut decoder = Decoder::new();
            let got = decoder.decode(&[0x80 | (i as u8 + 1)]).unwrap();
            assert_eq!(
                got,
                vec![(name.to_vec(), value.to_vec())],
                "index {}",
                i + 1
            );
        }
    }

    #[test]
    fn encoded_fields_decode_back() {
        let list = headers(&[
            (":method", "POST"),
            (":status", "200"),
            (":path", "/runtime.v1.RuntimeService/Version"),
            ("accept-encoding", "gzip, deflate"),
            ("x-long", &"v".repeat(300)),
            (&"n".repeat(200), ""),
        ]);
        let mut block = Vec::new();
        for (n, v) in &list {
            encode_header(&mut block, n, v);
        }
        assert_eq!(Decoder::new().decode(&block).unwrap(), list);
        // ":method: POST" is static index 3.
        assert_eq!(block[0], 0x83);
    }
}
