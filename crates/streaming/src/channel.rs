//! The Kubernetes channel protocol over WebSocket: every binary message
//! starts with one byte naming its channel; the error channel carries a
//! `metav1.Status` as JSON and the resize channel a `{Width,Height}` object.

use bytes::Bytes;
use serde::Deserialize;

/// Remote command channel: stdin (client to server).
pub(crate) const STDIN: u8 = 0;
/// Remote command channel: stdout.
pub(crate) const STDOUT: u8 = 1;
/// Remote command channel: stderr.
pub(crate) const STDERR: u8 = 2;
/// Remote command channel: the final status.
pub(crate) const ERROR: u8 = 3;
/// Remote command channel: terminal resize events (client to server).
pub(crate) const RESIZE: u8 = 4;
/// v5 only: the client closed the channel named by the payload's first byte.
pub(crate) const CLOSE: u8 = 255;

/// `channel.k8s.io`: the first WebSocket remote command protocol (what
/// Kubernetes' node e2e suite still asks for): v4's channels, but the error
/// channel carries only a failure's message, and nothing on success.
pub(crate) const V1: &str = "channel.k8s.io";
/// `v4.channel.k8s.io`: channels 0-4, no stream close.
pub(crate) const V4: &str = "v4.channel.k8s.io";
/// `v5.channel.k8s.io`: v4 plus the close channel.
pub(crate) const V5: &str = "v5.channel.k8s.io";
/// The port-forward subprotocol name kubelet also accepts.
pub(crate) const PORT_FORWARD: &str = "portforward.k8s.io";
/// Port-forward as SPDY/3.1 tunnelled in WebSocket binary messages (what
/// kubectl ≥ 1.30 and crictl ≥ 1.30 send with the WebSocket transport).
pub(crate) const SPDY_TUNNEL_PORT_FORWARD: &str = "SPDY/3.1+portforward.k8s.io";

/// A message on `channel` carrying `data`.
pub(crate) fn frame(channel: u8, data: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(data.len() + 1);
    v.push(channel);
    v.extend_from_slice(data);
    Bytes::from(v)
}

/// Splits a message into its channel and payload; `None` for an empty one.
pub(crate) fn parse(msg: &[u8]) -> Option<(u8, &[u8])> {
    let (&ch, rest) = msg.split_first()?;
    Some((ch, rest))
}

/// A terminal size as sent on the resize channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(crate) struct TermSize {
    /// Columns.
    #[serde(rename = "Width")]
    pub(crate) width: u16,
    /// Rows.
    #[serde(rename = "Height")]
    pub(crate) height: u16,
}

/// Parses a resize payload.
pub(crate) fn parse_resize(data: &[u8]) -> Option<TermSize> {
    serde_json::from_slice(data).ok()
}

/// The `metav1.Status` sent on the error channel when a command exits:
/// `Success` for 0, else `Failure` with reason `NonZeroExitCode` and the
/// code in `details.causes[{reason: ExitCode}]`, as kubelet sends it.
pub(crate) fn exit_status(code: i32) -> Vec<u8> {
    let v = if code == 0 {
        serde_json::json!({"metadata": {}, "status": "Success"})
    } else {
        serde_json::json!({
            "metadata": {},
            "status": "Failure",
            "message": format!("command terminated with non-zero exit code: exit status {code}"),
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
        })
    };
    v.to_string().into_bytes()
}

/// A `metav1.Status` failure with `message` (the command could not run).
pub(crate) fn failure_status(message: &str) -> Vec<u8> {
    serde_json::json!({
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "InternalError",
        "code": 500,
    })
    .to_string()
    .into_bytes()
}

/// Picks the subprotocol to answer from a client's `Sec-WebSocket-Protocol`
/// offers (comma separated, possibly in several headers), preferring the
/// first of `supported`. `Some("")` when the client offered none (the
/// server then speaks the first supported protocol without naming it).
pub(crate) fn negotiate<'a>(offers: &[&str], supported: &[&'a str]) -> Option<&'a str> {
    let offered: Vec<&str> = offers
        .iter()
        .flat_map(|h| h.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if offered.is_empty() {
        return Some("");
    }
    supported.iter().copied().find(|s| offered.contains(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let f = frame(STDERR, b"oops");
        assert_eq!(&f[..], b"\x02oops");
        assert_eq!(parse(&f), Some((STDERR, &b"oops"[..])));
        assert_eq!(parse(&frame(CLOSE, &[STDIN])), Some((CLOSE, &[0u8][..])));
        assert_eq!(parse(&[]), None);
        assert_eq!(parse(&[RESIZE]), Some((RESIZE, &[][..])));
    }

    #[test]
    fn resize_payload_parses() {
        assert_eq!(
            parse_resize(br#"{"Width":100,"Height":40}"#),
            Some(TermSize {
                width: 100,
                height: 40
            })
        );
        assert_eq!(parse_resize(b"garbage"), None);
    }

    #[test]
    fn exit_status_carries_the_code() {
        let ok: serde_json::Value = serde_json::from_slice(&exit_status(0)).unwrap();
        assert_eq!(ok["status"], "Success");
        let bad: serde_json::Value = serde_json::from_slice(&exit_status(3)).unwrap();
        assert_eq!(bad["status"], "Failure");
        assert_eq!(bad["reason"], "NonZeroExitCode");
        assert_eq!(bad["details"]["causes"][0]["reason"], "ExitCode");
        assert_eq!(bad["details"]["causes"][0]["message"], "3");
        let f: serde_json::Value = serde_json::from_slice(&failure_status("no")).unwrap();
        assert_eq!(f["message"], "no");
    }

    #[test]
    fn negotiation_prefers_our_order() {
        assert_eq!(
            negotiate(&["v4.channel.k8s.io, v5.channel.k8s.io"], &[V5, V4]),
            Some(V5)
        );
        assert_eq!(negotiate(&["v4.channel.k8s.io", "x"], &[V5, V4]), Some(V4));
        assert_eq!(negotiate(&["channel.k8s.io"], &[V5, V4]), None);
        assert_eq!(negotiate(&[], &[V5, V4]), Some(""));
    }
}
