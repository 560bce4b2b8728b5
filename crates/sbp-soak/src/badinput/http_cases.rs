//! The HTTP half of the bad-input generator: for case N, a route of the gateway and one kind of
//! damage (the body's structure or bytes, the path, the query, the method, the headers, the
//! framing, a resealed bundle), as the exact bytes to send.

use serde_json::{Value, json};

use super::values::{damage, mutate, obj, weird};
use super::{Case, Fixture, HttpCase, Kind};
use crate::raw::Request;
use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    None,
    Chat,
    Create,
    Status,
    Push,
    Import,
    Export,
    Handoff,
    Fork,
    Memory,
    ToolCall,
    Mcp,
}

/// Every route of `transport/mod.rs` (and the MCP route), with the body it takes.
pub const ROUTES: &[(&str, &str, Body)] = &[
    ("GET", "/", Body::None),
    ("GET", "/assets/{file}", Body::None),
    ("GET", "/healthz", Body::None),
    ("GET", "/metrics", Body::None),
    ("POST", "/v1/chat/completions", Body::Chat),
    ("POST", "/v1/sessions", Body::Create),
    ("POST", "/v1/sbp/sessions", Body::Create),
    ("GET", "/v1/sessions/{id}", Body::None),
    ("GET", "/v1/sbp/sessions/{id}", Body::None),
    ("GET", "/v1/sessions/{id}/messages", Body::None),
    ("GET", "/v1/sbp/sessions/{id}/messages", Body::None),
    ("PATCH", "/v1/sbp/sessions/{id}/status", Body::Status),
    ("POST", "/v1/sbp/sessions/{id}/status", Body::Status),
    ("GET", "/v1/sbp/sessions/{id}/snapshots", Body::None),
    ("GET", "/v1/sbp/sessions/{id}/snapshots/latest", Body::None),
    ("POST", "/v1/sbp/sessions/{id}/turns", Body::Push),
    ("POST", "/v1/sbp/sessions/import", Body::Import),
    ("POST", "/v1/sbp/sessions/{id}/export", Body::Export),
    ("POST", "/v1/sbp/sessions/{id}/handoff", Body::Handoff),
    ("POST", "/v1/sbp/sessions/{id}/fork", Body::Fork),
    ("GET", "/v1/sbp/sessions/{id}/exports", Body::None),
    ("GET", "/v1/sbp/sessions/{id}/lineage", Body::None),
    ("GET", "/v1/sbp/sessions/{id}/memory", Body::None),
    ("PUT", "/v1/sbp/sessions/{id}/memory", Body::Memory),
    ("POST", "/v1/sbp/sessions/{id}/tool_calls", Body::ToolCall),
    ("GET", "/v1/sbp/token/{token}", Body::None),
    ("GET", "/v1/sbp/ws/{id}", Body::None),
    ("POST", "/v1/sbp/sessions/{id}/mcp", Body::Mcp),
    ("GET", "/v1/sbp/sessions/{id}/mcp", Body::None),
    ("DELETE", "/v1/sbp/sessions/{id}/mcp", Body::None),
];

fn base_body(fx: &Fixture, body: Body, rng: &mut Rng) -> Option<Value> {
    Some(match body {
        Body::None => return None,
        Body::Chat => json!({
            "model": "soak-model",
            "messages": [{"role": "user", "content": "hello from badinput"}],
        }),
        Body::Create => json!({"agent_id": "soak-agent", "metadata": {"k": "v"}}),
        Body::Status => json!({"status": rng.pick(&["running", "suspended"])}),
        Body::Push => json!({"content": "pushed", "role": "assistant", "model_used": "m"}),
        Body::Import => {
            if rng.chance(50) {
                json!({"roaming_token": fx.roaming_token})
            } else {
                json!({"bundle": fx.bundle, "allow_reuse": true})
            }
        }
        Body::Export => json!({"ttl_seconds": 3600, "label": "soak", "include_bundle": false}),
        Body::Handoff => json!({
            "to_agent_id": "agent-b",
            "handoff_message": "please take over",
            "reason": "soak",
        }),
        Body::Fork => json!({"label": "fork"}),
        Body::Memory => json!({"schema_id": "urn:sbp:memory:kv:v1", "payload": {"k": "v"}}),
        Body::ToolCall => json!({"tool_name": "gps", "tool_input": {}, "timeout_ms": 50}),
        Body::Mcp => json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}),
    })
}

/// The credentials and the path of a route for one case: mostly a real session with its token,
/// sometimes a wrong token, none, or a session that does not exist.
fn fill(
    fx: &Fixture,
    path: &str,
    rng: &mut Rng,
    req_headers: &mut Vec<(Vec<u8>, Vec<u8>)>,
) -> String {
    let (id, token) = rng.pick(&fx.sessions);
    let (id, token) = match rng.below(10) {
        0 => (id, "not-the-token".to_owned()),
        1 => (id, String::new()),
        2 => (rng.uuid(), token),
        _ => (id, token),
    };
    if !token.is_empty() && (path.contains("{id}") || rng.chance(50)) {
        if path.ends_with("/mcp") && rng.chance(50) {
            req_headers.push((
                b"Authorization".to_vec(),
                format!("Bearer {token}").into_bytes(),
            ));
        } else {
            req_headers.push((b"X-Session-Token".to_vec(), token.into_bytes()));
        }
    }
    path.replace("{id}", &id)
        .replace("{file}", rng.pick(&["app.js", "style.css", "nope.txt"]))
        .replace("{token}", &fx.roaming_token)
}

/// A well-formed request for a route, before any damage: Host, JSON content type, credentials.
fn request(fx: &Fixture, route: (&str, &str, Body), rng: &mut Rng) -> (Request, Option<Value>) {
    let (method, path, body) = route;
    let mut headers = Vec::new();
    let target = fill(fx, path, rng, &mut headers);
    let mut req = Request::new(method, target.into_bytes())
        .header("Host", fx.addr.to_string())
        .header("Connection", "close");
    req.headers.extend(headers);
    if path.ends_with("/mcp") {
        req = req.header("Accept", "application/json, text/event-stream");
    }
    let value = base_body(fx, body, rng);
    if let Some(v) = &value {
        req = req
            .header("Content-Type", "application/json")
            .body(v.to_string().into_bytes());
    }
    (req, value)
}

/// Case `index` of the HTTP families.
pub fn case(fx: &Fixture, rng: &mut Rng, index: u64) -> Case {
    let route = rng.pick(ROUTES);
    let with_body: Vec<_> = ROUTES
        .iter()
        .filter(|r| r.2 != Body::None)
        .copied()
        .collect();
    let (family, description, http) = match rng.below(100) {
        0..=27 => {
            let route = rng.pick(&with_body);
            let (mut req, value) = request(fx, route, rng);
            let mut v = value.unwrap_or(Value::Null);
            let mut what = Vec::new();
            for _ in 0..rng.range(1, 3) {
                what.push(mutate(rng, &mut v));
            }
            req.body = v.to_string().into_bytes();
            (
                "json",
                format!("{} {}: {}", route.0, route.1, what.join("; ")),
                plain(req),
            )
        }
        28..=44 => {
            let route = rng.pick(&with_body);
            let (mut req, _) = request(fx, route, rng);
            let what = damage(rng, &mut req.body);
            if rng.chance(1) {
                // Above the 8 MiB body limit.
                req.body = vec![b' '; 9 * 1024 * 1024];
            }
            (
                "bytes",
                format!("{} {}: {what}", route.0, route.1),
                plain(req),
            )
        }
        45..=54 => {
            let route = rng.pick(ROUTES);
            let (mut req, _) = request(fx, route, rng);
            let (target, what, broken) = bad_target(fx, route.1, rng);
            req.target = target;
            let mut c = plain(req);
            c.framing_broken = broken;
            ("path", format!("{} {}: {what}", route.0, route.1), c)
        }
        55..=58 => {
            let route = rng.pick(&ROUTES[9..11]);
            let (mut req, _) = request(fx, route, rng);
            let q: &str = rng.pick(&[
                "?after=abc",
                "?limit=-1",
                "?limit=0",
                "?limit=1e3",
                "?limit=99999999999999999999",
                "?after=-5",
                "?after=18446744073709551616",
                "?limit=1&limit=2",
                "?%FF=1",
                "?after=%FF",
                "?=&&=",
                "?after",
                "?limit=%00",
            ]);
            req.target.extend_from_slice(q.as_bytes());
            ("query", format!("{} {}{q}", route.0, route.1), plain(req))
        }
        59..=66 => {
            let (mut req, _) = request(fx, route, rng);
            let m: &str = rng.pick(&[
                "GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD", "TRACE", "FOO", "get",
                "M-SEARCH",
            ]);
            req.method = m.as_bytes().to_vec();
            let mut c = plain(req);
            c.head_only = m == "HEAD";
            ("method", format!("{m} {}", route.1), c)
        }
        67..=78 => {
            let (mut req, _) = request(fx, route, rng);
            let (what, broken) = bad_headers(&mut req, rng);
            let mut c = plain(req);
            c.framing_broken = broken;
            ("headers", format!("{} {}: {what}", route.0, route.1), c)
        }
        79..=85 => {
            let route = rng.pick(&with_body);
            let (req, _) = request(fx, route, rng);
            let (c, what) = bad_framing(req, rng);
            ("framing", format!("{} {}: {what}", route.0, route.1), c)
        }
        _ => {
            let (req, what) = bad_bundle(fx, rng);
            (
                "bundle",
                format!("POST /v1/sbp/sessions/import: {what}"),
                plain(req),
            )
        }
    };
    Case {
        index,
        family,
        description,
        kind: Kind::Http(http),
    }
}

fn plain(req: Request) -> HttpCase {
    HttpCase {
        bytes: req.to_bytes(),
        half_close: false,
        head_only: false,
        framing_broken: false,
    }
}

/// A request target with a bad id, file or token, or a bad shape; `true` when the bytes are
/// not a valid request target at all (raw non-ASCII, a fragment), which the HTTP parser may
/// refuse before the gateway sees it.
fn bad_target(fx: &Fixture, path: &str, rng: &mut Rng) -> (Vec<u8>, String, bool) {
    let (id, _) = rng.pick(&fx.sessions);
    let ids: Vec<String> = vec![
        "not-a-uuid".into(),
        id.to_uppercase(),
        format!("{{{id}}}"),
        format!("urn:uuid:{id}"),
        id.replace('-', ""),
        "00000000-0000-0000-0000-000000000000".into(),
        "%FF%FE%FD".into(),
        "%00".into(),
        "%C0%AF".into(),
        "%ED%A0%80".into(),
        "%".into(),
        "%zz".into(),
        "..%2F..%2Fetc%2Fpasswd".into(),
        "a".repeat(rng.range(300, 20_000) as usize),
        "%E2%80%AE".into(),
        format!("{id}%20"),
        format!("{id}/extra"),
        "-1".into(),
        "null".into(),
        "%F0%9F%98%80".into(),
        format!("{id}%00"),
    ];
    let raw = rng.chance(12);
    if raw {
        let bytes: &[u8] = rng.pick(&[&[0xff, 0xfe][..], &[0xc3, 0xa9], &[0x80]]);
        let mut t = path
            .replace("{id}", &id)
            .replace("{token}", "t")
            .replace("{file}", "f")
            .into_bytes();
        t.extend_from_slice(bytes);
        return (t, format!("raw bytes {bytes:02x?} in the target"), true);
    }
    if !path.contains('{') || rng.chance(15) {
        let t: &str = rng.pick(&[
            "//v1/sessions",
            "/v1/sessions/",
            "/V1/Sessions",
            "/v1/sbp/ws/",
            "/v1/sbp/sessions//turns",
            "/v1/sessions/%2e%2e/%2e%2e/",
            "http://evil.example/v1/sessions",
            "/v1/chat/completions/extra",
            "/assets/..%2f..%2fCargo.toml",
            "/assets/",
        ]);
        return (t.as_bytes().to_vec(), format!("target {t}"), false);
    }
    let bad = rng.pick(&ids);
    let target = path
        .replace("{id}", &bad)
        .replace("{token}", &bad)
        .replace("{file}", &bad);
    let what = format!("id {}", crate::raw::snippet(bad.as_bytes(), 60));
    (target.into_bytes(), what, false)
}

/// Header damage; `true` when the head itself is malformed (the HTTP parser may refuse it).
fn bad_headers(req: &mut Request, rng: &mut Rng) -> (String, bool) {
    match rng.below(20) {
        0 => {
            req.remove_header("content-type");
            ("no Content-Type".into(), false)
        }
        1 => {
            let ct: &str = rng.pick(&[
                "text/plain",
                "text/plain;charset=UTF-8",
                "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x",
                "application/json; charset=utf-16",
                "application/jsonx",
                "application/json, text/html",
                "",
                "*/*",
                "application/merge-patch+json",
            ]);
            req.set_header("Content-Type", ct.as_bytes());
            (format!("Content-Type {ct:?}"), false)
        }
        2 => {
            req.headers
                .push((b"Content-Type".to_vec(), b"text/plain".to_vec()));
            ("two Content-Types".into(), false)
        }
        3 => {
            let t = match rng.below(4) {
                0 => Vec::new(),
                1 => vec![b'a'; rng.range(1_000, 16_000) as usize],
                2 => vec![0xc3, 0xa9, 0xff],
                _ => b"wrong-token".to_vec(),
            };
            let what = format!("X-Session-Token of {} bytes", t.len());
            req.set_header("X-Session-Token", t);
            (what, false)
        }
        4 => {
            let a: &str = rng.pick(&[
                "Bearer",
                "Bearer  x",
                "Basic eHh4",
                "Bearer \u{7f}",
                "bearer x y",
            ]);
            req.set_header("Authorization", a.as_bytes());
            (format!("Authorization {a:?}"), has_control(a))
        }
        5 => {
            let k = match rng.below(3) {
                0 => Vec::new(),
                1 => vec![b'k'; rng.range(500, 12_000) as usize],
                _ => vec![0xe2, 0x98, 0x83, 0xff],
            };
            let what = format!("Idempotency-Key of {} bytes", k.len());
            req.set_header("Idempotency-Key", k);
            (what, false)
        }
        6 => {
            req.remove_header("host");
            ("no Host".into(), false)
        }
        7 => {
            let h: &str = rng.pick(&[
                "evil.example",
                "127.0.0.1:1",
                "[::1]",
                "",
                "a b",
                "localhost.evil.example",
            ]);
            req.set_header("Host", h.as_bytes());
            (format!("Host {h:?}"), false)
        }
        8 => {
            let o: &str = rng.pick(&[
                "http://evil.example",
                "null",
                "file://",
                "http://127.0.0.1.evil.example",
            ]);
            req.set_header("Origin", o.as_bytes());
            (format!("Origin {o:?}"), false)
        }
        9 => {
            let a: &str = rng.pick(&["text/html", "application/xml", "*/*;q=x", "\u{1}"]);
            req.set_header("Accept", a.as_bytes());
            (format!("Accept {a:?}"), has_control(a))
        }
        10 => {
            req.set_header("Content-Encoding", "gzip");
            ("Content-Encoding gzip on a plain body".into(), false)
        }
        11 => {
            req.set_header("Expect", "100-continue");
            ("Expect 100-continue".into(), false)
        }
        12 => {
            req.set_header("Expect", "the-unexpected");
            ("Expect garbage".into(), false)
        }
        13 => {
            req.set_header("X-Agent-ID", "a".repeat(rng.range(257, 5_000) as usize));
            ("long X-Agent-ID".into(), false)
        }
        14 => {
            for i in 0..rng.range(101, 300) {
                req.headers
                    .push((format!("X-Many-{i}").into_bytes(), b"1".to_vec()));
            }
            ("more than 100 headers".into(), true)
        }
        15 => {
            req.headers.push((
                b"X-Big".to_vec(),
                vec![b'b'; rng.range(64_000, 600_000) as usize],
            ));
            ("one header of tens to hundreds of KiB".into(), true)
        }
        16 => {
            req.headers.push((b"X Bad".to_vec(), b"1".to_vec()));
            ("a header name with a space".into(), true)
        }
        17 => {
            req.headers
                .push((b"X-Ctl".to_vec(), vec![b'a', 0x00, b'b']));
            ("NUL in a header value".into(), true)
        }
        18 => {
            req.headers
                .push((b"X-Fold".to_vec(), b"a\r\n folded".to_vec()));
            ("an obs-fold continuation line".into(), true)
        }
        _ => {
            req.set_header("Content-Type", "application/json");
            req.headers
                .push((b"X-Session-Token".to_vec(), b"second".to_vec()));
            ("X-Session-Token twice".into(), false)
        }
    }
}

/// A control character (other than tab) is not allowed in a header value (RFC 9110 §5.5): the
/// HTTP parser refuses the head.
fn has_control(v: &str) -> bool {
    v.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f)
}

/// Broken framing: the request cannot be read as the bytes say.
fn bad_framing(mut req: Request, rng: &mut Rng) -> (HttpCase, String) {
    let mut half_close = false;
    let what: String = match rng.below(14) {
        0 => {
            // Fewer bytes than announced, then the client's half of the connection closes.
            let full = req.body.len();
            req.set_header(
                "Content-Length",
                (full + rng.range(1, 1000) as usize).to_string(),
            );
            half_close = true;
            "Content-Length above the bytes sent, then half-close".into()
        }
        1 => {
            req.set_header("Content-Length", "1");
            "Content-Length below the body (the rest is a pipelined garbage request)".into()
        }
        2 => {
            let v: &str = rng.pick(&["abc", "-1", "1, 2", "0x10", " ", "99999999999999999999999"]);
            req.set_header("Content-Length", v.as_bytes());
            format!("Content-Length {v:?}")
        }
        3 => {
            let n = req.body.len();
            req.set_header("Content-Length", n.to_string());
            req.headers
                .push((b"Content-Length".to_vec(), (n + 1).to_string().into_bytes()));
            "two different Content-Lengths".into()
        }
        4 => {
            req.headers
                .push((b"Transfer-Encoding".to_vec(), b"chunked".to_vec()));
            "Content-Length and Transfer-Encoding: chunked together".into()
        }
        5 => {
            req.remove_header("content-length");
            req.no_length = true;
            req.set_header("Transfer-Encoding", "chunked");
            let size: &str = rng.pick(&["zz", "FFFFFFFFFFFFFFFFFFFF", "-1", "5;ext=\u{1}"]);
            let mut b = format!("{size}\r\n").into_bytes();
            b.extend_from_slice(&req.body);
            b.extend_from_slice(b"\r\n0\r\n\r\n");
            req.body = b;
            format!("chunk size {size:?}")
        }
        6 => {
            req.remove_header("content-length");
            req.no_length = true;
            req.set_header("Transfer-Encoding", "chunked");
            let mut b = format!("{:x}\r\n", req.body.len() + 10).into_bytes();
            b.extend_from_slice(&req.body);
            req.body = b;
            half_close = true;
            "chunked body cut before its last chunk, then half-close".into()
        }
        7 => {
            req.set_header("Transfer-Encoding", "gzip");
            "Transfer-Encoding gzip".into()
        }
        8 => {
            let line: &str = rng.pick(&[
                "GARBAGE\r\n\r\n",
                "GET /healthz HTTP/9.9\r\n\r\n",
                "GET  /healthz  HTTP/1.1\r\nHost: x\r\n\r\n",
                "GET /healthz\r\n\r\n",
                "\r\n\r\n\r\n",
                "G\u{1}T /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
                "GET /healthz HTTP/1.1\nHost: x\n\n",
            ]);
            return (
                HttpCase {
                    bytes: line.as_bytes().to_vec(),
                    half_close: true,
                    head_only: false,
                    framing_broken: true,
                },
                format!("request line {line:?}"),
            );
        }
        9 => {
            let n = rng.range(1, 4096) as usize;
            return (
                HttpCase {
                    bytes: rng.bytes(n),
                    half_close: true,
                    head_only: false,
                    framing_broken: true,
                },
                format!("{n} random bytes"),
            );
        }
        10 => {
            // The first bytes of a TLS ClientHello, on the plain-text port.
            return (
                HttpCase {
                    bytes: vec![
                        0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03,
                    ],
                    half_close: true,
                    head_only: false,
                    framing_broken: true,
                },
                "a TLS ClientHello".into(),
            );
        }
        11 => {
            return (
                HttpCase {
                    bytes: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec(),
                    half_close: true,
                    head_only: false,
                    framing_broken: true,
                },
                "the HTTP/2 preface".into(),
            );
        }
        12 => {
            // The request's head cut in the middle.
            let bytes = req.to_bytes();
            let cut = rng.range(1, 40) as usize;
            return (
                HttpCase {
                    bytes: bytes[..cut.min(bytes.len())].to_vec(),
                    half_close: true,
                    head_only: false,
                    framing_broken: true,
                },
                format!("head cut after {cut} bytes, then half-close"),
            );
        }
        _ => {
            req.set_header("Content-Length", "0");
            "Content-Length 0 with a body following".into()
        }
    };
    (
        HttpCase {
            bytes: req.to_bytes(),
            half_close,
            head_only: false,
            framing_broken: true,
        },
        what,
    )
}

/// An import of the fixture's bundle with its fields broken, mostly resealed so the digest
/// holds and the gateway's validation is what answers.
fn bad_bundle(fx: &Fixture, rng: &mut Rng) -> (Request, String) {
    let mut b = fx.bundle.clone();
    let mut what = Vec::new();
    for _ in 0..rng.range(1, 2) {
        let field = rng.below(12);
        let v = match rng.below(8) {
            0 => json!(1u64 << 63),
            1 => json!(u64::MAX),
            2 => json!((1u64 << 63) - 1),
            3 => json!(-1),
            4 => json!("7"),
            _ => weird(rng),
        };
        let label = crate::raw::snippet(v.to_string().as_bytes(), 40);
        match field {
            0 => {
                if let Some(s) = b.get_mut("session").and_then(Value::as_object_mut) {
                    s.insert("step_count".into(), v);
                }
                what.push(format!("session.step_count := {label}"));
            }
            1 => {
                let id: Value = json!(rng.pick(&[
                    "not-a-uuid",
                    "",
                    "X",
                    "00000000-0000-0000-0000-00000000000G"
                ]));
                if let Some(s) = b.get_mut("session").and_then(Value::as_object_mut) {
                    s.insert("id".into(), id.clone());
                }
                what.push(format!("session.id := {id}"));
            }
            2 => {
                let t: Value = json!(rng.pick(&["yesterday", "", "2024-13-45T99:99:99Z", "0"]));
                if let Some(s) = b.get_mut("session").and_then(Value::as_object_mut) {
                    s.insert("created_at".into(), t.clone());
                }
                what.push(format!("session.created_at := {t}"));
            }
            3 => {
                let msg = weird(rng);
                let label = crate::raw::snippet(msg.to_string().as_bytes(), 40);
                if let Some(m) = b.get_mut("messages").and_then(Value::as_array_mut) {
                    m.push(msg);
                }
                what.push(format!("messages += {label}"));
            }
            4 => {
                if let Some(Value::Object(m)) = b
                    .get_mut("messages")
                    .and_then(Value::as_array_mut)
                    .and_then(|m| m.first_mut())
                {
                    let key: &str = rng.pick(&[
                        "role",
                        "content",
                        "created_at",
                        "cost_usd",
                        "model_used",
                        "tool_calls",
                    ]);
                    m.insert(key.into(), v);
                    what.push(format!("messages[0].{key} := {label}"));
                }
            }
            5 => {
                if let Some(m) = b.get_mut("metadata").and_then(Value::as_object_mut) {
                    m.insert("message_count".into(), v);
                }
                what.push(format!("metadata.message_count := {label}"));
            }
            6 => {
                let snap = match rng.below(3) {
                    0 => {
                        json!({"step_count": u64::MAX, "message_count": 1u64 << 63, "kind": "weird", "state": 1})
                    }
                    1 => json!({"messages": "x", "step": -5}),
                    _ => v,
                };
                what.push(format!(
                    "state_snapshot := {}",
                    crate::raw::snippet(snap.to_string().as_bytes(), 60)
                ));
                b.insert("state_snapshot".into(), snap);
            }
            7 => {
                let mem = match rng.below(3) {
                    0 => json!({"schema_id": 1}),
                    1 => json!({"schema_id": "urn:sbp:memory:kv:v1", "payload": "not an object"}),
                    _ => {
                        json!({"schema_id": "urn:sbp:memory:kv:v1", "payload": super::values::nested(100, true)})
                    }
                };
                what.push(format!(
                    "memory := {}",
                    crate::raw::snippet(mem.to_string().as_bytes(), 60)
                ));
                b.insert("memory".into(), mem);
            }
            8 => {
                let n = rng.range(500, 5_000) as usize;
                if let Some(m) = b.get_mut("messages").and_then(Value::as_array_mut)
                    && let Some(first) = m.first().cloned()
                {
                    m.extend(std::iter::repeat_n(first, n));
                }
                what.push(format!("{n} more messages"));
            }
            9 => {
                b.insert("sbp_version".into(), v);
                what.push(format!("sbp_version := {label}"));
            }
            10 => {
                if let Some(s) = b.get_mut("session").and_then(Value::as_object_mut) {
                    s.insert("status".into(), v);
                }
                what.push(format!("session.status := {label}"));
            }
            _ => {
                b.insert("session".into(), v);
                what.push(format!("session := {label}"));
            }
        }
    }
    match rng.below(10) {
        0 => what.push("digest left stale".into()),
        1 => {
            b.remove("bundle_cid");
            b.remove("hash");
            what.push("no digest".into());
        }
        2 => {
            b.insert("hash".into(), json!("0".repeat(64)));
            what.push("conflicting hash".into());
        }
        _ => {
            sbp_protocol::bundle::seal(&mut b);
            what.push("resealed".into());
        }
    }
    let mut body = obj(json!({"bundle": b}));
    if rng.chance(30) {
        body.insert("allow_reuse".into(), json!(true));
    }
    if rng.chance(20) {
        body.insert("target_agent_id".into(), weird(rng));
    }
    let req = Request::new("POST", "/v1/sbp/sessions/import")
        .header("Host", fx.addr.to_string())
        .header("Connection", "close")
        .header("Content-Type", "application/json")
        .body(Value::Object(body).to_string().into_bytes());
    (req, what.join("; "))
}
