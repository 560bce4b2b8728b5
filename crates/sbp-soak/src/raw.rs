//! Raw HTTP/1.1 and WebSocket over a plain TCP socket: the soak must send what no well-behaved
//! client library would (broken framing, invalid UTF-8 in a path, unmasked or oversized frames,
//! bodies trickled a byte at a time), and see exactly what comes back, including nothing.

use std::net::SocketAddr;
use std::time::Duration;

use base64::Engine as _;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

use crate::rng::Rng;

/// A response as it came off the socket.
#[derive(Debug, Clone)]
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// Whether the body is the error envelope `{"error":{"code":"SBP_...","message":"..."}}`.
    pub fn is_envelope(&self) -> bool {
        is_envelope(&self.body)
    }

    /// Status and the start of the body, for reports.
    pub fn describe(&self) -> String {
        format!("{} {}", self.status, snippet(&self.body, 200))
    }
}

pub fn is_envelope(body: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    let Some(err) = v.get("error").and_then(Value::as_object) else {
        return false;
    };
    let code_ok = err
        .get("code")
        .and_then(Value::as_str)
        .is_some_and(|c| c.starts_with("SBP_"));
    code_ok && err.get("message").is_some_and(Value::is_string)
}

/// The first `max` bytes as text (lossy), for reports.
pub fn snippet(bytes: &[u8], max: usize) -> String {
    let end = bytes.len().min(max);
    let mut s = String::from_utf8_lossy(&bytes[..end]).into_owned();
    if bytes.len() > max {
        s.push_str(&format!("... ({} bytes)", bytes.len()));
    }
    s
}

/// How one exchange ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    Answered(RawResponse),
    /// The connection ended (EOF or reset) before any byte of a response.
    Closed(String),
    /// A response started but was cut, or the bytes were not HTTP.
    Broken(String),
    /// Nothing conclusive within the time allowed.
    Hang,
}

/// Connects, with an optional small receive buffer (set before connecting, so the window the
/// peer sees is small from the start).
pub async fn connect(addr: SocketAddr, recv_buffer: Option<u32>) -> std::io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Some(n) = recv_buffer {
        socket.set_recv_buffer_size(n)?;
    }
    let stream = socket.connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Sends `request` (half-closing the connection after it when `half_close`) and reads one
/// response, all within `timeout`. The writing goes on beside the reading: a server may answer
/// (413) before it has read what is being sent.
pub async fn exchange(
    addr: SocketAddr,
    request: Vec<u8>,
    half_close: bool,
    head_only: bool,
    timeout: Duration,
) -> Outcome {
    let deadline = Instant::now() + timeout;
    let stream = match tokio::time::timeout_at(deadline, connect(addr, None)).await {
        Err(_) => return Outcome::Hang,
        Ok(Err(e)) => return Outcome::Closed(format!("connect: {e}")),
        Ok(Ok(s)) => s,
    };
    let (mut rd, mut wr) = stream.into_split();
    let writer = tokio::spawn(async move {
        let written = wr.write_all(&request).await;
        if written.is_ok() && half_close {
            let _ = wr.shutdown().await;
        }
        // Held until the reader is done: dropping the write half would half-close.
        wr
    });
    let outcome = match tokio::time::timeout_at(deadline, read_response(&mut rd, head_only)).await {
        Err(_) => Outcome::Hang,
        Ok(o) => o,
    };
    writer.abort();
    outcome
}

/// Reads one response from `rd`.
pub async fn read_response<R: AsyncReadExt + Unpin>(rd: &mut R, head_only: bool) -> Outcome {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(&buf) {
            Ok(httparse::Status::Complete(head_len)) => {
                let status = resp.code.unwrap_or(0);
                let headers: Vec<(String, Vec<u8>)> = resp
                    .headers
                    .iter()
                    .map(|h| (h.name.to_owned(), h.value.to_vec()))
                    .collect();
                if (100..200).contains(&status) && status != 101 {
                    // An interim answer (100 Continue): the final one follows.
                    buf.drain(..head_len);
                    continue;
                }
                let rest = buf.split_off(head_len);
                return read_body(rd, status, headers, rest, head_only, &mut chunk).await;
            }
            Ok(httparse::Status::Partial) => {}
            Err(e) => {
                return Outcome::Broken(format!(
                    "not an HTTP response ({e}): {}",
                    snippet(&buf, 120)
                ));
            }
        }
        match rd.read(&mut chunk).await {
            Ok(0) if buf.is_empty() => return Outcome::Closed("closed without a response".into()),
            Ok(0) => {
                return Outcome::Broken(format!("response head cut: {}", snippet(&buf, 120)));
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if buf.is_empty() => return Outcome::Closed(format!("{e}")),
            Err(e) => return Outcome::Broken(format!("response head cut: {e}")),
        }
    }
}

async fn read_body<R: AsyncReadExt + Unpin>(
    rd: &mut R,
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    mut body: Vec<u8>,
    head_only: bool,
    chunk: &mut [u8],
) -> Outcome {
    let answered = |body: Vec<u8>, headers: Vec<(String, Vec<u8>)>| {
        Outcome::Answered(RawResponse {
            status,
            headers,
            body,
        })
    };
    if head_only || status == 101 || status == 204 || status == 304 {
        return answered(Vec::new(), headers);
    }
    let find = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| String::from_utf8_lossy(v).trim().to_ascii_lowercase())
    };
    let chunked = find("transfer-encoding").is_some_and(|v| v.contains("chunked"));
    let length = find("content-length").and_then(|v| v.parse::<usize>().ok());
    loop {
        if chunked {
            if let Some(decoded) = decode_chunked(&body) {
                return answered(decoded, headers);
            }
        } else if let Some(len) = length
            && body.len() >= len
        {
            body.truncate(len);
            return answered(body, headers);
        }
        match rd.read(chunk).await {
            Ok(0) if !chunked && length.is_none() => return answered(body, headers),
            Ok(0) => return Outcome::Broken(format!("{status} response body cut")),
            Ok(n) => body.extend_from_slice(&chunk[..n]),
            Err(e) if !chunked && length.is_none() => {
                let _ = e;
                return answered(body, headers);
            }
            Err(e) => return Outcome::Broken(format!("{status} response body cut: {e}")),
        }
    }
}

/// The body of a complete chunked encoding, or `None` while it is incomplete.
fn decode_chunked(mut data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = data.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&data[..line_end]).ok()?;
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).ok()?;
        data = &data[line_end + 2..];
        if size == 0 {
            // Trailers (none expected) end with an empty line.
            return data.windows(2).position(|w| w == b"\r\n").map(|_| out);
        }
        if data.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

/// An HTTP/1.1 request assembled byte by byte. `Content-Length` is added from the body unless a
/// header of that name is given (or `no_length` is set).
#[derive(Debug, Clone)]
pub struct Request {
    pub method: Vec<u8>,
    pub target: Vec<u8>,
    pub headers: Vec<(Vec<u8>, Vec<u8>)>,
    pub body: Vec<u8>,
    pub no_length: bool,
}

impl Request {
    pub fn new(method: &str, target: impl Into<Vec<u8>>) -> Self {
        Self {
            method: method.as_bytes().to_vec(),
            target: target.into(),
            headers: Vec::new(),
            body: Vec::new(),
            no_length: false,
        }
    }

    pub fn header(mut self, name: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn set_header(&mut self, name: &str, value: impl Into<Vec<u8>>) {
        self.remove_header(name);
        self.headers.push((name.as_bytes().to_vec(), value.into()));
    }

    pub fn remove_header(&mut self, name: &str) {
        self.headers
            .retain(|(n, _)| !n.eq_ignore_ascii_case(name.as_bytes()));
    }

    pub fn has_header(&self, name: &str) -> bool {
        self.headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
    }

    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(256 + self.body.len());
        out.extend_from_slice(&self.method);
        out.push(b' ');
        out.extend_from_slice(&self.target);
        out.extend_from_slice(b" HTTP/1.1\r\n");
        for (n, v) in &self.headers {
            out.extend_from_slice(n);
            out.extend_from_slice(b": ");
            out.extend_from_slice(v);
            out.extend_from_slice(b"\r\n");
        }
        if !self.no_length && !self.has_header("content-length") {
            out.extend_from_slice(format!("Content-Length: {}\r\n", self.body.len()).as_bytes());
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(&self.body);
        out
    }
}

/// Client WebSocket frame: FIN, RSV bits (0..=7), opcode, masked unless `mask` is `None`.
pub fn ws_frame(fin: bool, rsv: u8, opcode: u8, mask: Option<[u8; 4]>, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 14);
    out.push((u8::from(fin) << 7) | ((rsv & 7) << 4) | (opcode & 0x0f));
    let mask_bit = if mask.is_some() { 0x80 } else { 0 };
    match payload.len() {
        n @ 0..=125 => out.push(mask_bit | n as u8),
        n @ 126..=65535 => {
            out.push(mask_bit | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(mask_bit | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    match mask {
        Some(m) => {
            out.extend_from_slice(&m);
            out.extend(payload.iter().enumerate().map(|(i, b)| b ^ m[i % 4]));
        }
        None => out.extend_from_slice(payload),
    }
    out
}

pub const OP_CONT: u8 = 0x0;
pub const OP_TEXT: u8 = 0x1;
pub const OP_BINARY: u8 = 0x2;
pub const OP_CLOSE: u8 = 0x8;
pub const OP_PING: u8 = 0x9;
pub const OP_PONG: u8 = 0xA;

/// A masked text frame, the normal thing a client sends.
pub fn text_frame(rng: &mut Rng, text: &[u8]) -> Vec<u8> {
    ws_frame(true, 0, OP_TEXT, Some(mask(rng)), text)
}

pub fn mask(rng: &mut Rng) -> [u8; 4] {
    (rng.next_u64() as u32).to_be_bytes()
}

/// What the server sent on a WebSocket.
#[derive(Debug, Clone, PartialEq)]
pub enum WsEvent {
    Text(Vec<u8>),
    Binary(Vec<u8>),
    Ping(Vec<u8>),
    Pong(Vec<u8>),
    /// The close frame's code (none when its payload is empty) and reason.
    Close(Option<u16>, String),
    /// TCP ended without a close frame.
    Eof(String),
    /// The server's bytes were not valid frames.
    Garbage(String),
}

/// A client WebSocket over a raw socket, after a 101.
pub struct RawWs {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

/// What a WebSocket handshake got.
pub enum Handshake {
    Upgraded(RawWs),
    /// An HTTP answer other than 101.
    Refused(RawResponse),
    Failed(Outcome),
}

/// How a WebSocket handshake departs from the normal one.
#[derive(Debug, Clone, Copy, Default)]
pub struct WsOpts<'a> {
    /// Added, replacing a standard header of the same name.
    pub extra: &'a [(&'a str, &'a str)],
    /// Standard headers left out (to make bad handshakes).
    pub omit: &'a [&'a str],
    /// A small socket receive buffer (for a surface that stops reading).
    pub recv_buffer: Option<u32>,
}

/// Opens `path` as a WebSocket.
pub async fn ws_connect(
    addr: SocketAddr,
    path: &[u8],
    opts: WsOpts<'_>,
    rng: &mut Rng,
    timeout: Duration,
) -> Handshake {
    let deadline = Instant::now() + timeout;
    let host = addr.to_string();
    let WsOpts {
        extra,
        omit,
        recv_buffer,
    } = opts;
    let mut stream = match tokio::time::timeout_at(deadline, connect(addr, recv_buffer)).await {
        Err(_) => return Handshake::Failed(Outcome::Hang),
        Ok(Err(e)) => return Handshake::Failed(Outcome::Closed(format!("connect: {e}"))),
        Ok(Ok(s)) => s,
    };
    let key = base64::engine::general_purpose::STANDARD.encode(rng.bytes(16));
    let mut req = Request::new("GET", path.to_vec());
    req.no_length = true;
    for (n, v) in [
        ("Host", host.as_str()),
        ("Upgrade", "websocket"),
        ("Connection", "Upgrade"),
        ("Sec-WebSocket-Key", key.as_str()),
        ("Sec-WebSocket-Version", "13"),
    ] {
        if !omit.iter().any(|o| o.eq_ignore_ascii_case(n)) {
            req = req.header(n, v);
        }
    }
    for (n, v) in extra {
        req.set_header(n, *v);
    }
    if let Err(e) = stream.write_all(&req.to_bytes()).await {
        return Handshake::Failed(Outcome::Closed(format!("write: {e}")));
    }
    // Read the head only, byte-exact: what follows a 101 belongs to the WebSocket.
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head_len = end + 4;
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut resp = httparse::Response::new(&mut headers);
            if resp.parse(&buf[..head_len]).is_err() {
                return Handshake::Failed(Outcome::Broken(snippet(&buf, 120)));
            }
            let status = resp.code.unwrap_or(0);
            let headers: Vec<(String, Vec<u8>)> = resp
                .headers
                .iter()
                .map(|h| (h.name.to_owned(), h.value.to_vec()))
                .collect();
            let rest = buf.split_off(head_len);
            if status == 101 {
                return Handshake::Upgraded(RawWs { stream, buf: rest });
            }
            let mut chunk = vec![0u8; 16 * 1024];
            let body = tokio::time::timeout_at(
                deadline,
                read_body(&mut stream, status, headers, rest, false, &mut chunk),
            )
            .await;
            return match body {
                Err(_) => Handshake::Failed(Outcome::Hang),
                Ok(Outcome::Answered(r)) => Handshake::Refused(r),
                Ok(other) => Handshake::Failed(other),
            };
        }
        match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
            Err(_) => return Handshake::Failed(Outcome::Hang),
            Ok(Ok(0)) if buf.is_empty() => {
                return Handshake::Failed(Outcome::Closed("closed without a response".into()));
            }
            Ok(Ok(0)) => return Handshake::Failed(Outcome::Broken(snippet(&buf, 120))),
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Ok(Err(e)) => return Handshake::Failed(Outcome::Closed(format!("{e}"))),
        }
    }
}

impl RawWs {
    pub async fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    pub async fn send_text(&mut self, rng: &mut Rng, text: &str) -> std::io::Result<()> {
        let f = text_frame(rng, text.as_bytes());
        self.stream.write_all(&f).await
    }

    /// The next whole message or control frame; `None` when nothing came within `timeout`.
    pub async fn next(&mut self, timeout: Duration) -> Option<WsEvent> {
        let deadline = Instant::now() + timeout;
        let mut message: Option<(u8, Vec<u8>)> = None;
        let mut chunk = vec![0u8; 16 * 1024];
        loop {
            match parse_frame(&self.buf) {
                Err(e) => return Some(WsEvent::Garbage(e)),
                Ok(Some((fin, opcode, payload, used))) => {
                    self.buf.drain(..used);
                    match opcode {
                        OP_CLOSE => {
                            let code = (payload.len() >= 2)
                                .then(|| u16::from_be_bytes([payload[0], payload[1]]));
                            let reason = String::from_utf8_lossy(payload.get(2..).unwrap_or(&[]))
                                .into_owned();
                            return Some(WsEvent::Close(code, reason));
                        }
                        OP_PING => return Some(WsEvent::Ping(payload)),
                        OP_PONG => return Some(WsEvent::Pong(payload)),
                        OP_TEXT | OP_BINARY => {
                            if fin {
                                return Some(if opcode == OP_TEXT {
                                    WsEvent::Text(payload)
                                } else {
                                    WsEvent::Binary(payload)
                                });
                            }
                            message = Some((opcode, payload));
                        }
                        OP_CONT => match message.take() {
                            Some((op, mut data)) => {
                                data.extend_from_slice(&payload);
                                if fin {
                                    return Some(if op == OP_TEXT {
                                        WsEvent::Text(data)
                                    } else {
                                        WsEvent::Binary(data)
                                    });
                                }
                                message = Some((op, data));
                            }
                            None => {
                                return Some(WsEvent::Garbage(
                                    "continuation without a start".into(),
                                ));
                            }
                        },
                        other => {
                            return Some(WsEvent::Garbage(format!("opcode {other:#x}")));
                        }
                    }
                    continue;
                }
                Ok(None) => {}
            }
            match tokio::time::timeout_at(deadline, self.stream.read(&mut chunk)).await {
                Err(_) => return None,
                Ok(Ok(0)) => return Some(WsEvent::Eof("EOF".into())),
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
                Ok(Err(e)) => return Some(WsEvent::Eof(e.to_string())),
            }
        }
    }

    /// The next text message parsed as JSON, answering PINGs (frame-level and the protocol's
    /// own `PING` frames) on the way; `Err` says what came instead.
    pub async fn next_json(&mut self, rng: &mut Rng, timeout: Duration) -> Result<Value, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next(left).await {
                None => return Err("no frame in time".into()),
                Some(WsEvent::Text(t)) => {
                    let v: Value = serde_json::from_slice(&t)
                        .map_err(|e| format!("text frame is not JSON: {e}"))?;
                    if v["type"] == "PING" {
                        let _ = self.send_text(rng, r#"{"type":"PONG"}"#).await;
                        continue;
                    }
                    return Ok(v);
                }
                Some(WsEvent::Ping(p)) => {
                    let _ = self
                        .send(&ws_frame(true, 0, OP_PONG, Some(mask(rng)), &p))
                        .await;
                }
                Some(WsEvent::Pong(_)) => {}
                Some(other) => return Err(format!("{other:?}")),
            }
        }
    }
}

/// One server frame from the front of `buf`: `(fin, opcode, payload, bytes used)`, `None` while
/// incomplete.
#[allow(clippy::type_complexity)]
fn parse_frame(buf: &[u8]) -> Result<Option<(bool, u8, Vec<u8>, usize)>, String> {
    if buf.len() < 2 {
        return Ok(None);
    }
    let fin = buf[0] & 0x80 != 0;
    let opcode = buf[0] & 0x0f;
    let masked = buf[1] & 0x80 != 0;
    let (len, mut at) = match buf[1] & 0x7f {
        126 => {
            if buf.len() < 4 {
                return Ok(None);
            }
            (u64::from(u16::from_be_bytes([buf[2], buf[3]])), 4)
        }
        127 => {
            if buf.len() < 10 {
                return Ok(None);
            }
            let mut b = [0u8; 8];
            b.copy_from_slice(&buf[2..10]);
            (u64::from_be_bytes(b), 10)
        }
        n => (u64::from(n), 2),
    };
    if len > 64 * 1024 * 1024 {
        return Err(format!("server frame of {len} bytes"));
    }
    let mask = if masked {
        if buf.len() < at + 4 {
            return Ok(None);
        }
        let m = [buf[at], buf[at + 1], buf[at + 2], buf[at + 3]];
        at += 4;
        Some(m)
    } else {
        None
    };
    let len = len as usize;
    if buf.len() < at + len {
        return Ok(None);
    }
    let mut payload = buf[at..at + len].to_vec();
    if let Some(m) = mask {
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= m[i % 4];
        }
    }
    Ok(Some((fin, opcode, payload, at + len)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_decode_only_when_complete() {
        assert_eq!(
            decode_chunked(b"5\r\nhello\r\n0\r\n\r\n"),
            Some(b"hello".to_vec())
        );
        assert_eq!(decode_chunked(b"5\r\nhel"), None);
        assert_eq!(decode_chunked(b"5\r\nhello\r\n0\r\n"), None);
    }

    #[test]
    fn frames_round_trip_through_the_parser() {
        let mut rng = Rng::new(1);
        for len in [0usize, 5, 125, 126, 65535, 65536] {
            let payload = vec![b'x'; len];
            let unmasked = ws_frame(true, 0, OP_TEXT, None, &payload);
            let (fin, op, p, used) = parse_frame(&unmasked).expect("valid").expect("whole");
            assert!(fin);
            assert_eq!((op, p.len(), used), (OP_TEXT, len, unmasked.len()));
            let masked = ws_frame(false, 0, OP_BINARY, Some(mask(&mut rng)), &payload);
            let (_, _, p, _) = parse_frame(&masked).expect("valid").expect("whole");
            assert_eq!(p, payload);
            assert_eq!(parse_frame(&masked[..masked.len() - 1]), Ok(None));
        }
    }

    #[test]
    fn envelopes_are_recognised() {
        assert!(is_envelope(
            br#"{"error":{"code":"SBP_BAD_REQUEST","message":"x","detail":null}}"#
        ));
        assert!(!is_envelope(b"Failed to parse the request body as JSON"));
        assert!(!is_envelope(br#"{"error":"x"}"#));
        assert!(!is_envelope(br#"{"error":{"code":"BAD","message":"x"}}"#));
    }

    #[test]
    fn requests_get_a_content_length_unless_given() {
        let r = Request::new("POST", "/x").header("Host", "h").body("abc");
        let text = String::from_utf8(r.to_bytes()).expect("ascii");
        assert!(
            text.starts_with("POST /x HTTP/1.1\r\nHost: h\r\n"),
            "{text}"
        );
        assert!(text.ends_with("Content-Length: 3\r\n\r\nabc"), "{text}");
        let r = Request::new("POST", "/x")
            .header("Content-Length", "10")
            .body("abc");
        let text = String::from_utf8(r.to_bytes()).expect("ascii");
        assert_eq!(text.matches("Content-Length").count(), 1, "{text}");
    }
}
