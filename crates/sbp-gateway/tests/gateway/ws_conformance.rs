//! RFC 6455 conformance of the WebSocket endpoint, driven by raw frames (`ws_raw.rs`), in the spirit
//! of the Autobahn TestSuite's sections 1-7 and 9: framing and masking, pings and pongs, reserved
//! bits and opcodes, fragmentation with control frames between fragments, UTF-8 validation, the
//! closing handshake (valid and invalid codes and reasons), and size limits. One table; each case
//! says what the client sends and what the server must answer, and how the connection ends: the
//! server's close (which the client answers, after which the server must close TCP), or the
//! server's answer to a close of the client's. A case that ends "open" is closed by the client
//! with 1000, which the server must echo.

use serde_json::{Value, json};

use crate::support::{TestGateway, TestGatewayExt as _};
use crate::ws_raw::{BINARY, CLOSE, CONT, In, Next, Out, PONG, RawWs, TEXT};

/// What a case needs before it sends its frames.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Setup {
    /// A socket on a session that does not exist: frames before ATTACH_SESSION.
    Bare,
    /// A session whose id and token the frames use (they attach themselves).
    Session,
    /// Attached (SESSION_ATTACHED read) to a fresh session.
    Attached,
}

/// A frame the server must send next.
#[derive(Debug, Clone)]
enum Want {
    /// A pong with exactly this payload.
    Pong(Vec<u8>),
    /// Pongs, the last of which carries this payload (RFC 6455 §5.5.3 lets a server answer only
    /// the most recent of several pings).
    LastPong(Vec<u8>),
    /// A JSON text frame of this protocol type.
    Json(&'static str),
}

/// How the connection ends.
#[derive(Debug, Clone, Copy, PartialEq)]
enum End {
    /// The server sends a close with this code; the client answers; the server closes TCP.
    ServerCloses(u16),
    /// The client has sent a close: the server answers with this close (`None`: no code) and
    /// closes TCP.
    Answers(Option<u16>),
    /// Nothing more: the client closes with 1000 and the server must echo it.
    Open,
}

/// The ids a case's frames may use.
struct Ctx {
    id: String,
    token: String,
}

impl Ctx {
    fn attach(&self, surface: Value) -> Vec<u8> {
        json!({
            "type": "ATTACH_SESSION",
            "session_id": self.id,
            "session_token": self.token,
            "surface_context": surface,
        })
        .to_string()
        .into_bytes()
    }
}

/// The frames a case sends, built from its session's ids.
type Frames = Box<dyn Fn(&Ctx) -> Vec<Out>>;

struct Case {
    name: String,
    setup: Setup,
    frames: Frames,
    want: Vec<Want>,
    end: End,
}

fn case(
    name: impl Into<String>,
    setup: Setup,
    frames: impl Fn(&Ctx) -> Vec<Out> + 'static,
    want: Vec<Want>,
    end: End,
) -> Case {
    Case {
        name: name.into(),
        setup,
        frames: Box::new(frames),
        want,
        end,
    }
}

/// `payload` cut into frames of `size` bytes: the first with `opcode`, then continuations.
fn fragments(opcode: u8, payload: &[u8], size: usize) -> Vec<Out> {
    let pieces: Vec<&[u8]> = payload.chunks(size).collect();
    let last = pieces.len() - 1;
    pieces
        .iter()
        .enumerate()
        .map(|(i, p)| Out::new(if i == 0 { opcode } else { CONT }, *p).fin(i == last))
        .collect()
}

/// An unknown-type frame (ignored by the gateway) of exactly `len` bytes.
fn padded_unknown(len: usize) -> Vec<u8> {
    let head = br#"{"type":"CONFORMANCE_PADDING","pad":""#;
    let tail = br#""}"#;
    let mut v = head.to_vec();
    v.resize(len - tail.len(), b'a');
    v.extend_from_slice(tail);
    v
}

fn table(max_frame: usize) -> Vec<Case> {
    use End::{Answers, Open, ServerCloses};
    use Setup::{Attached, Bare, Session};
    let mut t = vec![
        // 1: framing.
        case(
            "1.1 text frame with a 16-bit length is read (ATTACH_SESSION padded past 125 bytes)",
            Session,
            |c| {
                vec![Out::text(c.attach(
                    json!({"device_type": "desktop", "note": "x".repeat(300)}),
                ))]
            },
            vec![Want::Json("SESSION_ATTACHED")],
            Open,
        ),
        case(
            "1.2 unmasked client frame",
            Bare,
            |_| vec![Out::text("{}").unmasked()],
            vec![],
            ServerCloses(1002),
        ),
        case(
            "1.3 binary frame is not part of the protocol (SBP PROTOCOL_ERROR, 1003)",
            Bare,
            |_| vec![Out::new(BINARY, vec![1, 2, 3])],
            vec![Want::Json("PROTOCOL_ERROR")],
            ServerCloses(1003),
        ),
        // 2: pings and pongs.
        case(
            "2.1 ping without payload",
            Bare,
            |_| vec![Out::ping("")],
            vec![Want::Pong(vec![])],
            Open,
        ),
        case(
            "2.2 ping with a text payload",
            Bare,
            |_| vec![Out::ping("Hello, world!")],
            vec![Want::Pong(b"Hello, world!".to_vec())],
            Open,
        ),
        case(
            "2.3 ping with a binary payload",
            Bare,
            |_| {
                vec![Out::ping(vec![
                    0x00, 0xff, 0xfe, 0xfd, 0xfc, 0xfb, 0x00, 0xff,
                ])]
            },
            vec![Want::Pong(vec![
                0x00, 0xff, 0xfe, 0xfd, 0xfc, 0xfb, 0x00, 0xff,
            ])],
            Open,
        ),
        case(
            "2.4 ping with a 125-byte payload",
            Bare,
            |_| vec![Out::ping(vec![0xfe; 125])],
            vec![Want::Pong(vec![0xfe; 125])],
            Open,
        ),
        case(
            "2.5 ping with a 126-byte payload (control frame too big)",
            Bare,
            |_| vec![Out::ping(vec![0xfe; 126])],
            vec![],
            ServerCloses(1002),
        ),
        case(
            "2.6 unsolicited pong without payload",
            Bare,
            |_| vec![Out::new(PONG, vec![])],
            vec![],
            Open,
        ),
        case(
            "2.7 unsolicited pong with payload",
            Bare,
            |_| vec![Out::new(PONG, "unsolicited")],
            vec![],
            Open,
        ),
        case(
            "2.8 unsolicited pong, then a ping",
            Bare,
            |_| vec![Out::new(PONG, "unsolicited"), Out::ping("ping")],
            vec![Want::Pong(b"ping".to_vec())],
            Open,
        ),
        case(
            "2.9 ten pings in a row",
            Bare,
            |_| (0..10).map(|i| Out::ping(format!("ping-{i}"))).collect(),
            vec![Want::LastPong(b"ping-9".to_vec())],
            Open,
        ),
        case(
            "2.10 ping after attach",
            Attached,
            |_| vec![Out::ping("attached")],
            vec![Want::Pong(b"attached".to_vec())],
            Open,
        ),
        // 3: reserved bits.
        case(
            "3.1 RSV1 on a text frame",
            Bare,
            |_| vec![Out::text("{}").rsv(0x40)],
            vec![],
            ServerCloses(1002),
        ),
        case(
            "3.2 RSV2 on a text frame after a ping",
            Bare,
            |_| vec![Out::ping("first"), Out::text("{}").rsv(0x20)],
            vec![Want::Pong(b"first".to_vec())],
            ServerCloses(1002),
        ),
        case(
            "3.3 RSV3 on a binary frame",
            Bare,
            |_| vec![Out::new(BINARY, vec![0]).rsv(0x10)],
            vec![],
            ServerCloses(1002),
        ),
        case(
            "3.4 RSV1-3 on a ping",
            Bare,
            |_| vec![Out::ping("x").rsv(0x70)],
            vec![],
            ServerCloses(1002),
        ),
        case(
            "3.5 RSV1 on a text frame after attach",
            Attached,
            |_| vec![Out::text(r#"{"type":"PONG"}"#).rsv(0x40)],
            vec![],
            ServerCloses(1002),
        ),
    ];
    // 4: reserved opcodes.
    for op in [0x3, 0x4, 0x5, 0x6, 0x7, 0xB, 0xC, 0xD, 0xE, 0xF] {
        t.push(case(
            format!("4.{op:x} reserved opcode {op:#x}"),
            Bare,
            move |_| vec![Out::new(op, "reserved")],
            vec![],
            ServerCloses(1002),
        ));
    }
    t.extend([
        // 5: fragmentation.
        case(
            "5.1 fragmented ping",
            Bare,
            |_| vec![Out::ping("frag").fin(false), Out::new(CONT, "ment")],
            vec![],
            ServerCloses(1002),
        ),
        case(
            "5.2 fragmented pong",
            Bare,
            |_| vec![Out::new(PONG, "frag").fin(false), Out::new(CONT, "ment")],
            vec![],
            ServerCloses(1002),
        ),
        case(
            "5.3 continuation without a message",
            Bare,
            |_| vec![Out::new(CONT, "orphan")],
            vec![],
            ServerCloses(1002),
        ),
        case(
            "5.4 a second message started before the first ended",
            Bare,
            |_| vec![Out::text("{").fin(false), Out::text("}")],
            vec![],
            ServerCloses(1002),
        ),
        case(
            "5.5 ATTACH_SESSION in three fragments",
            Session,
            |c| fragments(TEXT, &c.attach(json!({"device_type": "desktop"})), 50),
            vec![Want::Json("SESSION_ATTACHED")],
            Open,
        ),
        case(
            "5.6 pings between the fragments of ATTACH_SESSION",
            Session,
            |c| {
                let mut f = fragments(TEXT, &c.attach(json!({"device_type": "desktop"})), 60);
                f.insert(1, Out::ping("between-1"));
                f.insert(3, Out::ping("between-2"));
                f
            },
            vec![
                Want::Pong(b"between-1".to_vec()),
                Want::Pong(b"between-2".to_vec()),
                Want::Json("SESSION_ATTACHED"),
            ],
            Open,
        ),
        case(
            "5.7 ATTACH_SESSION one byte per frame",
            Session,
            |c| fragments(TEXT, &c.attach(json!({"device_type": "desktop"})), 1),
            vec![Want::Json("SESSION_ATTACHED")],
            Open,
        ),
        case(
            "5.8 empty fragments around the message",
            Session,
            |c| {
                let mut f = vec![Out::text("").fin(false)];
                f.push(Out::new(CONT, c.attach(json!({}))).fin(false));
                f.push(Out::new(CONT, ""));
                f
            },
            vec![Want::Json("SESSION_ATTACHED")],
            Open,
        ),
        case(
            "5.9 close between fragments",
            Bare,
            |_| vec![Out::text("{").fin(false), Out::close(1000, b"")],
            vec![],
            Answers(Some(1000)),
        ),
        // 6: UTF-8.
        case(
            "6.1 valid text split inside a multi-byte character",
            Session,
            |c| {
                let text = c.attach(json!({"device_type": "desktop", "note": "κόσμε 𝄞"}));
                let at = text
                    .iter()
                    .position(|b| *b == 0xce)
                    .expect("a multi-byte char")
                    + 1;
                vec![
                    Out::text(&text[..at]).fin(false),
                    Out::new(CONT, &text[at..]),
                ]
            },
            vec![Want::Json("SESSION_ATTACHED")],
            Open,
        ),
        case(
            "6.3 invalid UTF-8 across fragments",
            Bare,
            |_| {
                vec![
                    Out::text(vec![0xce, 0xba]).fin(false),
                    Out::new(CONT, vec![0xe1, 0xbd]).fin(false),
                    Out::new(CONT, vec![0xff]),
                ]
            },
            vec![],
            ServerCloses(1007),
        ),
        case(
            "6.4 invalid UTF-8 after attach",
            Attached,
            |_| vec![Out::text(vec![b'{', 0xc0, 0xaf, b'}'])],
            vec![],
            ServerCloses(1007),
        ),
    ]);
    let invalid_utf8: [(&str, &[u8]); 6] = [
        ("0xff", &[0xff]),
        ("overlong '/'", &[0xc0, 0xaf]),
        ("a surrogate", &[0xed, 0xa0, 0x80]),
        ("beyond U+10FFFF", &[0xf4, 0x90, 0x80, 0x80]),
        ("a truncated sequence", &[b'a', 0xe2, 0x82]),
        ("a lone continuation byte", &[b'a', 0x80, b'b']),
    ];
    for (what, bytes) in invalid_utf8 {
        t.push(case(
            format!("6.2 invalid UTF-8 text: {what}"),
            Bare,
            move |_| vec![Out::text(bytes)],
            vec![],
            ServerCloses(1007),
        ));
    }
    t.extend([
        // 7: the closing handshake.
        case(
            "7.1 close without payload",
            Bare,
            |_| vec![Out::new(CLOSE, vec![])],
            vec![],
            Answers(None),
        ),
        case(
            "7.2 data after the close is ignored",
            Bare,
            |_| vec![Out::close(1000, b""), Out::text("after")],
            vec![],
            Answers(Some(1000)),
        ),
        case(
            "7.3 close with a 1-byte payload",
            Bare,
            |_| vec![Out::new(CLOSE, vec![0x03])],
            vec![],
            ServerCloses(1002),
        ),
        case(
            "7.4 close with a code and a reason",
            Bare,
            |_| vec![Out::close(1000, b"Hello World!")],
            vec![],
            Answers(Some(1000)),
        ),
        case(
            "7.5 close with a 123-byte reason",
            Bare,
            |_| vec![Out::close(1000, &[b'*'; 123])],
            vec![],
            Answers(Some(1000)),
        ),
        case(
            "7.6 close with a 124-byte reason (control frame too big)",
            Bare,
            |_| vec![Out::close(1000, &[b'*'; 124])],
            vec![],
            ServerCloses(1002),
        ),
        case(
            "7.7 close reason that is not UTF-8",
            Bare,
            |_| vec![Out::close(1000, &[b'a', 0xff, 0xfe])],
            vec![],
            ServerCloses(1007),
        ),
        case(
            "7.8 close after attach is answered",
            Attached,
            |_| vec![Out::close(1000, b"bye")],
            vec![],
            Answers(Some(1000)),
        ),
    ]);
    for code in [
        1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 3000, 3999, 4000, 4999,
    ] {
        t.push(case(
            format!("7.9 valid close code {code} is echoed"),
            Bare,
            move |_| vec![Out::close(code, b"")],
            vec![],
            Answers(Some(code)),
        ));
    }
    for code in [
        0, 999, 1004, 1005, 1006, 1015, 1016, 1100, 2000, 2999, 5000, 65535,
    ] {
        t.push(case(
            format!("7.10 invalid close code {code} is answered with 1002"),
            Bare,
            move |_| vec![Out::close(code, b"")],
            vec![],
            Answers(Some(1002)),
        ));
    }
    t.extend([
        // 9: limits.
        case(
            "9.1 a text frame of exactly the maximum size",
            Attached,
            move |_| vec![Out::text(padded_unknown(max_frame)), Out::ping("alive")],
            vec![Want::Pong(b"alive".to_vec())],
            Open,
        ),
        case(
            "9.2 a text frame one byte over the maximum",
            Attached,
            move |_| vec![Out::text(padded_unknown(max_frame + 1))],
            vec![],
            ServerCloses(1009),
        ),
        case(
            "9.3 a message of the maximum size in 64 fragments",
            Attached,
            move |_| {
                let mut f = fragments(TEXT, &padded_unknown(max_frame), max_frame / 64);
                f.push(Out::ping("alive"));
                f
            },
            vec![Want::Pong(b"alive".to_vec())],
            Open,
        ),
        case(
            "9.4 fragments that add up to more than the maximum",
            Attached,
            move |_| {
                fragments(
                    TEXT,
                    &padded_unknown(max_frame + 1024),
                    max_frame / 2 + 1024,
                )
            },
            vec![],
            ServerCloses(1009),
        ),
        case(
            "9.5 a first frame over the maximum",
            Bare,
            move |_| vec![Out::text(padded_unknown(max_frame * 2))],
            vec![],
            ServerCloses(1009),
        ),
    ]);
    t
}

/// Runs one case on a fresh connection; `Err` says what differed.
async fn run(gw: &TestGateway, c: &Case) -> Result<(), String> {
    let ctx = match c.setup {
        Setup::Bare => Ctx {
            id: "no-such-session".into(),
            token: String::new(),
        },
        Setup::Session | Setup::Attached => {
            let (id, token) = gw.idle_session().await;
            Ctx { id, token }
        }
    };
    let mut ws = RawWs::connect(&gw.url, &format!("/v1/sbp/ws/{}", ctx.id)).await;
    if c.setup == Setup::Attached {
        ws.send(&Out::text(ctx.attach(json!({"device_type": "desktop"}))))
            .await;
        expect_json(&frame(&mut ws).await?, "SESSION_ATTACHED")?;
    }
    let mut bytes = Vec::new();
    for f in (c.frames)(&ctx) {
        bytes.extend(f.encode());
    }
    // The server may close before it has read everything (that is the point of some cases).
    ws.try_write(&bytes).await;
    for want in &c.want {
        match want {
            Want::Pong(p) => {
                let f = frame(&mut ws).await?;
                if f.opcode != PONG || &f.payload != p {
                    return Err(format!("wanted pong {p:?}, got {f:?}"));
                }
            }
            Want::LastPong(p) => loop {
                let f = frame(&mut ws).await?;
                if f.opcode != PONG {
                    return Err(format!("wanted pongs up to {p:?}, got {f:?}"));
                }
                if &f.payload == p {
                    break;
                }
            },
            Want::Json(kind) => expect_json(&frame(&mut ws).await?, kind)?,
        }
    }
    let (code, answer) = match c.end {
        End::ServerCloses(code) => (Some(code), true),
        End::Answers(code) => (code, false),
        End::Open => {
            ws.send(&Out::close(1000, b"done")).await;
            (Some(1000), false)
        }
    };
    let close = frame(&mut ws).await?;
    if close.opcode != CLOSE || close.close_code() != code {
        return Err(format!("wanted close {code:?}, got {close:?}"));
    }
    if answer {
        let echo = Out::close(code.unwrap_or(1000), b"").encode();
        ws.try_write(&echo).await;
    }
    // After the closing handshake the server closes TCP, with nothing after its close frame.
    match ws.next().await {
        Next::End => Ok(()),
        Next::Frame(f) => Err(format!("a frame after the close: {f:?}")),
    }
}

/// The next server frame; the end of the stream is a failure here.
async fn frame(ws: &mut RawWs) -> Result<In, String> {
    match ws.next().await {
        Next::Frame(f) => Ok(f),
        Next::End => Err("the server closed TCP where a frame was expected".into()),
    }
}

fn expect_json(f: &In, kind: &str) -> Result<(), String> {
    if f.opcode == TEXT && f.json()["type"] == kind {
        Ok(())
    } else {
        Err(format!("wanted {kind}, got {f:?}"))
    }
}

/// Every case of the table, each on its own connection; the failures are listed together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_endpoint_follows_rfc_6455() {
    let gw = TestGateway::start().await;
    let cases = table(gw.gateway.config().max_frame_bytes);
    let total = cases.len();
    let mut failures = Vec::new();
    for c in &cases {
        if let Err(e) = run(&gw, c).await {
            failures.push(format!("{}: {e}", c.name));
        }
    }
    eprintln!(
        "RFC 6455 conformance: {} of {total} cases passed",
        total - failures.len()
    );
    assert!(
        failures.is_empty(),
        "failed cases:\n{}",
        failures.join("\n")
    );
    assert!(total >= 60, "the table shrank to {total} cases");
}

/// The upgrade itself: what is not a WebSocket handshake gets the error envelope, a version other
/// than 13 gets 426 naming the version spoken (RFC 6455 §4.4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_is_not_an_upgrade_gets_the_error_envelope() {
    let gw = TestGateway::start().await;
    let (id, _) = gw.idle_session().await;
    let path = format!("/v1/sbp/ws/{id}");
    let (status, body) = gw.get(&path, &[]).await;
    assert_eq!(status, 426, "{body}");
    assert_eq!(body["error"]["code"], "SBP_UPGRADE_REQUIRED", "{body}");
    let upgrade = [
        ("connection", "Upgrade"),
        ("upgrade", "websocket"),
        ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
    ];
    let mut old_version = upgrade.to_vec();
    old_version.push(("sec-websocket-version", "8"));
    let (status, headers, body) =
        sbp_test_support::send(gw.request(reqwest::Method::GET, &path, &old_version)).await;
    assert_eq!(status, 426, "{body}");
    assert_eq!(headers["sec-websocket-version"], "13");
    assert!(body["error"]["message"].is_string(), "{body}");
}
