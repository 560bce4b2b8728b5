//! The WebSocket half of the bad-input generator: bad handshakes, bad first frames, bad frames
//! after a good attach, and raw protocol violations (RFC 6455: reserved bits and opcodes,
//! unmasked or oversized control frames, invalid UTF-8, bad close frames), each with what the
//! gateway must do about it.

use std::time::Duration;

use serde_json::{Value, json};

use super::values::{nested, weird};
use super::{Case, Fixture, Kind};
use crate::raw::{
    self, Handshake, OP_BINARY, OP_CLOSE, OP_CONT, OP_PING, OP_TEXT, RawWs, WsEvent, WsOpts, mask,
    text_frame, ws_frame,
};
use crate::rng::Rng;

/// What the gateway must do after the case's frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Close the connection with a close frame (any code but 1011).
    Close,
    /// Keep the connection; then answer the client's close frame with one of its own.
    Open,
    /// Anything but 1011 or a hang.
    Any,
}

#[derive(Debug, Clone)]
pub enum WsCase {
    /// A handshake that is not a valid WebSocket upgrade: the answer is HTTP.
    Handshake {
        omit: Vec<&'static str>,
        extra: Vec<(&'static str, &'static str)>,
        id: String,
    },
    Frames {
        id: String,
        /// A good ATTACH_SESSION first, and SESSION_ATTACHED awaited, before `frames`.
        attach: Option<(String, String)>,
        frames: Vec<Vec<u8>>,
        expect: Expect,
    },
}

/// How a WebSocket case went; `Err` is a failure, with its kind.
pub type WsResult = Result<String, (&'static str, String)>;

pub fn case(fx: &Fixture, rng: &mut Rng, index: u64) -> Case {
    let (id, token) = rng.pick(&fx.sessions);
    let (description, ws) = match rng.below(100) {
        0..=11 => handshake(rng, &id),
        12..=54 => first_frame(rng, fx, &id, &token),
        55..=79 => after_attach(rng, &id, &token),
        _ => violation(rng, &id, &token),
    };
    Case {
        index,
        family: "ws",
        description,
        kind: Kind::Ws(ws),
    }
}

fn handshake(rng: &mut Rng, id: &str) -> (String, WsCase) {
    type Headers = Vec<(&'static str, &'static str)>;
    let (what, omit, extra): (&str, Vec<&'static str>, Headers) = match rng.below(7) {
        0 => (
            "plain GET without upgrade headers",
            vec![
                "Upgrade",
                "Connection",
                "Sec-WebSocket-Key",
                "Sec-WebSocket-Version",
            ],
            vec![],
        ),
        1 => ("no Sec-WebSocket-Key", vec!["Sec-WebSocket-Key"], vec![]),
        2 => (
            "Sec-WebSocket-Version 8",
            vec![],
            vec![("Sec-WebSocket-Version", "8")],
        ),
        3 => ("Upgrade: h2c", vec![], vec![("Upgrade", "h2c")]),
        4 => (
            "Connection: keep-alive only",
            vec![],
            vec![("Connection", "keep-alive")],
        ),
        5 => (
            "no Sec-WebSocket-Version",
            vec!["Sec-WebSocket-Version"],
            vec![],
        ),
        _ => (
            "Sec-WebSocket-Key not base64 of 16 bytes",
            vec![],
            vec![("Sec-WebSocket-Key", "x")],
        ),
    };
    (
        format!("ws handshake: {what}"),
        WsCase::Handshake {
            omit,
            extra,
            id: id.to_owned(),
        },
    )
}

fn attach_json(id: &str, token: &str) -> Value {
    json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token})
}

/// A first frame that is not a valid attach (or an attach with bad fields).
fn first_frame(rng: &mut Rng, fx: &Fixture, id: &str, token: &str) -> (String, WsCase) {
    let mut attach = attach_json(id, token);
    let (what, text): (String, Vec<u8>) = match rng.below(10) {
        0 => {
            let t: &str = rng.pick(&[
                "hello",
                "",
                "{",
                "[]",
                "1",
                "null",
                "\"ATTACH_SESSION\"",
                "{}",
            ]);
            (format!("first frame {t:?}"), t.as_bytes().to_vec())
        }
        1 => {
            let ty = match rng.below(6) {
                0 => Value::Null,
                1 => json!(5),
                2 => json!(""),
                3 => json!("attach_session"),
                4 => json!(["ATTACH_SESSION"]),
                _ => Value::Bool(true),
            };
            attach["type"] = ty.clone();
            (format!("type {ty}"), attach.to_string().into_bytes())
        }
        2 => {
            let t: &str = rng.pick(&["ACK", "PONG", "DETACH", "TOOL_RESULT", "FOO", "PING"]);
            let f = json!({"type": t, "seq": 1, "call_id": "x"});
            (format!("{t} first"), f.to_string().into_bytes())
        }
        3 => {
            let v = match rng.below(5) {
                0 => json!(5),
                1 => Value::Null,
                2 => json!(""),
                3 => json!(rng.pick(&fx.sessions).0),
                _ => json!(id.to_uppercase()),
            };
            attach["session_id"] = v.clone();
            (format!("session_id {v}"), attach.to_string().into_bytes())
        }
        4 => {
            let v = match rng.below(4) {
                0 => json!(""),
                1 => json!("wrong"),
                2 => json!(5),
                _ => json!("t".repeat(10_000)),
            };
            attach["session_token"] = v.clone();
            (
                format!(
                    "session_token {}",
                    raw::snippet(v.to_string().as_bytes(), 40)
                ),
                attach.to_string().into_bytes(),
            )
        }
        5 => {
            // last_seq as text, so values beyond u64 and odd spellings reach the parser.
            let v: &str = rng.pick(&[
                "-1",
                "\"5\"",
                "1.5",
                "18446744073709551616",
                "1e30",
                "18446744073709551615",
                "9223372036854775808",
                "1000",
                "null",
                "[]",
            ]);
            let text = format!(
                r#"{{"type":"ATTACH_SESSION","session_id":"{id}","session_token":"{token}","last_seq":{v}}}"#
            );
            (format!("last_seq {v}"), text.into_bytes())
        }
        6..=7 => {
            let ctx = match rng.below(10) {
                0 => json!("x"),
                1 => json!(5),
                2 => json!([]),
                3 => json!({"device_type": 5, "ui_capabilities": "x"}),
                4 => json!({"mcp_tools": "x"}),
                5 => json!({"mcp_tools": [{"name": 5}, null, 7]}),
                6 => json!({"max_output_tokens": -1, "locale": {"a": 1}}),
                7 => json!({"mcp_tool_schemas": [{"name": "x", "input_schema": "not an object"}]}),
                8 => json!({"device_type": "x".repeat(200_000)}),
                _ => json!({"extra": nested(rng.range(50, 120) as usize, rng.chance(50))}),
            };
            let key = if rng.chance(50) {
                "surface_context"
            } else {
                "surface"
            };
            let what = format!("{key} {}", raw::snippet(ctx.to_string().as_bytes(), 50));
            attach[key] = ctx;
            (what, attach.to_string().into_bytes())
        }
        8 => {
            let v = weird(rng);
            let key: &str = rng.pick(&[
                "last_seq",
                "session_id",
                "session_token",
                "type",
                "surface_context",
            ]);
            let what = format!("{key} {}", raw::snippet(v.to_string().as_bytes(), 50));
            attach[key] = v;
            (what, attach.to_string().into_bytes())
        }
        _ => {
            // A path id that is not the attach's session.
            let other = rng.pick(&["not-a-uuid", "00000000-0000-0000-0000-000000000000", "%FF"]);
            let frames = vec![text_frame(rng, attach.to_string().as_bytes())];
            return (
                format!("attach on path id {other}"),
                WsCase::Frames {
                    id: (*other).to_owned(),
                    attach: None,
                    frames,
                    expect: Expect::Any,
                },
            );
        }
    };
    let frames = vec![text_frame(rng, &text)];
    (
        format!("ws first frame: {what}"),
        WsCase::Frames {
            id: id.to_owned(),
            attach: None,
            frames,
            // A wrong attach may still be a right one (an upper-case id of the same session,
            // a valid last_seq): what matters is no 1011 and no hang.
            expect: Expect::Any,
        },
    )
}

/// A good attach, then frames that are bad or merely unusual.
fn after_attach(rng: &mut Rng, id: &str, token: &str) -> (String, WsCase) {
    let (what, text, expect): (String, Vec<u8>, Expect) = match rng.below(9) {
        0 => {
            let v: &str = rng.pick(&["-1", "\"x\"", "18446744073709551616", "null", "1.5", "[]"]);
            (
                format!("ACK seq {v}"),
                format!(r#"{{"type":"ACK","seq":{v}}}"#).into_bytes(),
                Expect::Close,
            )
        }
        1 => (
            "ACK without seq".into(),
            br#"{"type":"ACK"}"#.to_vec(),
            Expect::Close,
        ),
        2 => {
            let v: &str = rng.pick(&[
                "18446744073709551615",
                "9223372036854775808",
                "0",
                "1000000",
            ]);
            (
                format!("ACK seq {v} (beyond what was sent)"),
                format!(r#"{{"type":"ACK","seq":{v}}}"#).into_bytes(),
                Expect::Any,
            )
        }
        3 => (
            "TOOL_RESULT with a numeric call_id".into(),
            br#"{"type":"TOOL_RESULT","call_id":5,"result":1}"#.to_vec(),
            Expect::Close,
        ),
        4 => (
            "TOOL_RESULT for an unknown call".into(),
            format!(
                r#"{{"type":"TOOL_RESULT","call_id":"{}","result":{{"a":1}}}}"#,
                rng.uuid()
            )
            .into_bytes(),
            Expect::Open,
        ),
        5 => (
            "unknown frame type".into(),
            json!({"type": "FOO", "x": nested(rng.range(10, 100) as usize, true)})
                .to_string()
                .into_bytes(),
            Expect::Open,
        ),
        6 => (
            "PONG with extra fields".into(),
            br#"{"type":"PONG","extra":[1,2,3]}"#.to_vec(),
            Expect::Open,
        ),
        7 => (
            "second ATTACH_SESSION with a wrong token".into(),
            attach_json(id, "wrong").to_string().into_bytes(),
            Expect::Close,
        ),
        _ => {
            let t: &str = rng.pick(&["not json", "[]", "{\"type\":7}", ""]);
            (format!("frame {t:?}"), t.as_bytes().to_vec(), Expect::Close)
        }
    };
    let frames = vec![text_frame(rng, &text)];
    (
        format!("ws after attach: {what}"),
        WsCase::Frames {
            id: id.to_owned(),
            attach: Some((id.to_owned(), token.to_owned())),
            frames,
            expect,
        },
    )
}

/// Raw RFC 6455 violations, before or after a good attach.
fn violation(rng: &mut Rng, id: &str, token: &str) -> (String, WsCase) {
    let m = mask(rng);
    let attach_text = attach_json(id, token).to_string();
    let (what, frames, expect): (&str, Vec<Vec<u8>>, Expect) = match rng.below(16) {
        0 => (
            "binary frame",
            vec![ws_frame(true, 0, OP_BINARY, Some(m), b"\x00\x01")],
            Expect::Close,
        ),
        1 => (
            "invalid UTF-8 in a text frame",
            vec![ws_frame(
                true,
                0,
                OP_TEXT,
                Some(m),
                b"{\"type\":\"\xff\xfe\"}",
            )],
            Expect::Close,
        ),
        2 => {
            let big = rng.chance(3);
            let n = if big {
                10 * 1024 * 1024
            } else {
                1024 * 1024 + 100
            };
            let mut body = format!(
                r#"{{"type":"ATTACH_SESSION","session_id":"{id}","session_token":"{token}","pad":""#
            )
            .into_bytes();
            body.resize(n, b'x');
            body.extend_from_slice(b"\"}");
            (
                if big {
                    "a 10 MB ATTACH_SESSION"
                } else {
                    "a text frame over the 1 MiB limit"
                },
                vec![ws_frame(true, 0, OP_TEXT, Some(m), &body)],
                Expect::Close,
            )
        }
        3 => (
            "ping with a 126-byte payload",
            vec![ws_frame(true, 0, OP_PING, Some(m), &[b'p'; 126])],
            Expect::Close,
        ),
        4 => (
            "fragmented ping",
            vec![ws_frame(false, 0, OP_PING, Some(m), b"p")],
            Expect::Close,
        ),
        5 => (
            "reserved opcode 0x3",
            vec![ws_frame(true, 0, 0x3, Some(m), b"x")],
            Expect::Close,
        ),
        6 => (
            "reserved control opcode 0xB",
            vec![ws_frame(true, 0, 0xB, Some(m), b"x")],
            Expect::Close,
        ),
        7 => (
            "RSV1 set without an extension",
            vec![ws_frame(true, 4, OP_TEXT, Some(m), attach_text.as_bytes())],
            Expect::Close,
        ),
        8 => (
            "unmasked client frame",
            vec![ws_frame(true, 0, OP_TEXT, None, attach_text.as_bytes())],
            Expect::Close,
        ),
        9 => (
            "continuation without a start",
            vec![ws_frame(true, 0, OP_CONT, Some(m), b"x")],
            Expect::Close,
        ),
        10 => (
            "close frame with a 1-byte payload",
            vec![ws_frame(true, 0, OP_CLOSE, Some(m), &[3])],
            Expect::Close,
        ),
        11 => {
            let code: u16 = rng.pick(&[999, 1004, 1005, 1006, 1015, 5000, 0]);
            let mut p = code.to_be_bytes().to_vec();
            p.extend_from_slice(b"bye");
            (
                "close frame with an invalid code",
                vec![ws_frame(true, 0, OP_CLOSE, Some(m), &p)],
                Expect::Close,
            )
        }
        12 => {
            let mut p = 1000u16.to_be_bytes().to_vec();
            p.extend_from_slice(&[0xff, 0xfe]);
            (
                "close frame with an invalid UTF-8 reason",
                vec![ws_frame(true, 0, OP_CLOSE, Some(m), &p)],
                Expect::Close,
            )
        }
        13 => {
            // A 64-bit length with its top bit set (RFC 6455 §5.2 forbids it).
            let mut f = vec![0x81, 0xff];
            f.extend_from_slice(&u64::MAX.to_be_bytes());
            f.extend_from_slice(&m);
            ("frame length with the top bit set", vec![f], Expect::Close)
        }
        14 => {
            // A valid attach split in two fragments: must work.
            let (a, b) = attach_text.as_bytes().split_at(attach_text.len() / 2);
            let m2 = mask(rng);
            (
                "ATTACH_SESSION in two fragments",
                vec![
                    ws_frame(false, 0, OP_TEXT, Some(m), a),
                    ws_frame(true, 0, OP_CONT, Some(m2), b),
                ],
                Expect::Any,
            )
        }
        _ => {
            // Half a frame header, then the client goes away.
            (
                "half a frame header, then EOF",
                vec![vec![0x81]],
                Expect::Any,
            )
        }
    };
    let after = rng.chance(50) && what != "ATTACH_SESSION in two fragments";
    (
        format!(
            "ws violation{}: {what}",
            if after { " after attach" } else { "" }
        ),
        WsCase::Frames {
            id: id.to_owned(),
            attach: after.then(|| (id.to_owned(), token.to_owned())),
            frames,
            expect,
        },
    )
}

/// Runs a WebSocket case; `Ok` describes what happened.
pub async fn run(
    fx: &Fixture,
    case: &WsCase,
    rng: &mut Rng,
    timeout: Duration,
) -> (WsResult, Option<crate::raw::RawResponse>) {
    match case {
        WsCase::Handshake { omit, extra, id } => {
            let path = format!("/v1/sbp/ws/{id}");
            let opts = WsOpts {
                extra,
                omit,
                recv_buffer: None,
            };
            match raw::ws_connect(fx.addr, path.as_bytes(), opts, rng, timeout).await {
                Handshake::Upgraded(mut ws) => {
                    let _ = ws
                        .send(&ws_frame(
                            true,
                            0,
                            OP_CLOSE,
                            Some(mask(rng)),
                            &1000u16.to_be_bytes(),
                        ))
                        .await;
                    (Ok("upgraded anyway".into()), None)
                }
                Handshake::Refused(r) => (Ok(format!("refused {}", r.status)), Some(r)),
                Handshake::Failed(o) => (Err(("ws handshake failed", format!("{o:?}"))), None),
            }
        }
        WsCase::Frames {
            id,
            attach,
            frames,
            expect,
        } => {
            let path = format!("/v1/sbp/ws/{id}");
            let mut ws =
                match raw::ws_connect(fx.addr, path.as_bytes(), WsOpts::default(), rng, timeout)
                    .await
                {
                    Handshake::Upgraded(ws) => ws,
                    Handshake::Refused(r) => return (Ok(format!("refused {}", r.status)), Some(r)),
                    Handshake::Failed(o) => {
                        return (Err(("ws handshake failed", format!("{o:?}"))), None);
                    }
                };
            if let Some((aid, token)) = attach {
                let text = attach_json(aid, token).to_string();
                if ws.send_text(rng, &text).await.is_err() {
                    return (Err(("ws attach failed", "write failed".into())), None);
                }
                match ws.next_json(rng, timeout).await {
                    Ok(v) if v["type"] == "SESSION_ATTACHED" => {}
                    // Another case displaced it first, or the session was made unusable by an
                    // earlier case: not this case's finding.
                    Ok(v) => return (Ok(format!("attach answered {v}")), None),
                    Err(e) => return (Ok(format!("attach did not complete: {e}")), None),
                }
            }
            for f in frames {
                // The gateway may close before it has read a big frame: the close frame is
                // what counts, so keep going to the read.
                if ws.send(f).await.is_err() {
                    break;
                }
            }
            if frames.len() == 1 && frames[0] == [0x81] {
                let _ = tokio::io::AsyncWriteExt::shutdown(&mut ws.stream).await;
            }
            (judge(&mut ws, *expect, rng, timeout).await, None)
        }
    }
}

async fn judge(ws: &mut RawWs, expect: Expect, rng: &mut Rng, timeout: Duration) -> WsResult {
    // Error frames (PROTOCOL_ERROR, FORBIDDEN, ...) may come before the close.
    let window = match expect {
        Expect::Open => Duration::from_millis(500),
        _ => timeout,
    };
    let deadline = tokio::time::Instant::now() + window;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match ws.next(left).await {
            None => break,
            Some(WsEvent::Close(code, reason)) => {
                return match (code, expect) {
                    (Some(1011), _) => Err((
                        "ws closed 1011 (internal error)",
                        format!("{reason:?} after {seen:?}"),
                    )),
                    (Some(4409), _) => Ok("displaced by another case (4409)".into()),
                    (_, Expect::Open) => Err((
                        "ws closed a benign session",
                        format!("close {code:?} {reason:?} after {seen:?}"),
                    )),
                    _ => Ok(format!("closed {code:?} {reason:?}")),
                };
            }
            Some(WsEvent::Eof(e)) => {
                return match expect {
                    Expect::Any => Ok(format!("dropped ({e})")),
                    _ => Err((
                        "ws dropped without a close frame",
                        format!("{e} after {seen:?}"),
                    )),
                };
            }
            Some(WsEvent::Garbage(e)) => return Err(("ws server sent invalid frames", e)),
            Some(WsEvent::Text(t)) => {
                let t = raw::snippet(&t, 80);
                if t.contains("\"PING\"") {
                    let _ = ws.send_text(rng, r#"{"type":"PONG"}"#).await;
                }
                seen.push(t);
            }
            Some(_) => {}
        }
    }
    match expect {
        Expect::Close => Err((
            "ws hang: no close after a violation",
            format!("nothing within {} s after {seen:?}", window.as_secs()),
        )),
        Expect::Any => Ok("still open".into()),
        Expect::Open => {
            // RFC 6455 §5.5.1: a close frame is answered with a close frame.
            let close = ws_frame(true, 0, OP_CLOSE, Some(mask(rng)), &1000u16.to_be_bytes());
            if ws.send(&close).await.is_err() {
                return Err(("ws close not answered", "the socket was gone".into()));
            }
            let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
            loop {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                match ws.next(left).await {
                    Some(WsEvent::Close(..)) => return Ok("stayed open; close answered".into()),
                    Some(WsEvent::Eof(e)) => {
                        return Err(("ws close not answered", format!("dropped: {e}")));
                    }
                    None => return Err(("ws close not answered", "nothing within 3 s".into())),
                    Some(_) => {}
                }
            }
        }
    }
}
