//! A raw HTTP/1.1 client over one TCP socket, for what a well-behaved client never does: send
//! nothing, trickle a body, declare a body and not send it, hold a connection idle. It reads what
//! the server writes and notices when the server closes.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

use crate::WAIT;

/// One HTTP/1.1 response as read off the socket.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body as JSON, or as a JSON string when it is not JSON.
    pub body: Value,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

pub struct RawHttp {
    stream: TcpStream,
    /// Read but not yet consumed.
    buf: Vec<u8>,
}

impl RawHttp {
    /// Connects to `addr` (`host:port`, or an `http://` URL).
    pub async fn connect(addr: &str) -> Self {
        let addr: SocketAddr = addr
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .parse()
            .expect("a socket address");
        let stream = tokio::time::timeout(WAIT, TcpStream::connect(addr))
            .await
            .expect("connect within the wait")
            .expect("connect");
        Self::from_stream(stream)
    }

    /// Connects to `addr` from the local address `from` (e.g. `127.0.0.2`: all of 127/8 is this
    /// machine, so a test can be a second client IP).
    pub async fn connect_from(addr: &str, from: std::net::Ipv4Addr) -> Self {
        let addr: SocketAddr = addr
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .parse()
            .expect("a socket address");
        let socket = TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::from((from, 0)))
            .expect("bind the local address");
        let stream = tokio::time::timeout(WAIT, socket.connect(addr))
            .await
            .expect("connect within the wait")
            .expect("connect");
        Self::from_stream(stream)
    }

    pub fn from_stream(stream: TcpStream) -> Self {
        Self {
            stream,
            buf: Vec::new(),
        }
    }

    /// Writes `bytes` as they are.
    pub async fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await?;
        self.stream.flush().await
    }

    /// A request with `headers` (`Host` and `Content-Length` added) and its whole `body`.
    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) {
        let head = head(method, path, headers, Some(body.len()));
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(body);
        self.write(&bytes).await.expect("write the request");
    }

    /// Reads one response, waiting at most `within`; `None` if the server closed first.
    pub async fn response_within(&mut self, within: Duration) -> Option<RawResponse> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(resp) = self.parsed() {
                return Some(resp);
            }
            if !self.fill(deadline).await {
                return None;
            }
        }
    }

    /// Sends `bytes` one at a time, one every `every`, while reading: returns the response as soon
    /// as it is complete (the rest is not sent), or `None` if the server closes first. Waits at
    /// most [`WAIT`].
    pub async fn trickle(&mut self, bytes: &[u8], every: Duration) -> Option<RawResponse> {
        let deadline = Instant::now() + WAIT;
        let mut ticks = tokio::time::interval(every);
        let mut sent = 0;
        loop {
            if let Some(resp) = self.parsed() {
                return Some(resp);
            }
            let mut chunk = [0u8; 8192];
            tokio::select! {
                read = self.stream.read(&mut chunk) => match read {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                },
                _ = ticks.tick(), if sent < bytes.len() => {
                    // A server that stopped reading may refuse more: keep reading its answer.
                    if self.stream.write_all(&bytes[sent..sent + 1]).await.is_err() {
                        sent = bytes.len();
                    } else {
                        sent += 1;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => panic!("no response within the wait"),
            }
        }
    }

    /// The first response in the buffer, taken out, once all of it has arrived.
    fn parsed(&mut self) -> Option<RawResponse> {
        let head_end = find(&self.buf, b"\r\n\r\n")?;
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let status: u16 = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP response: {head}"));
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let length: usize = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        let body_start = head_end + 4;
        if self.buf.len() < body_start + length {
            return None;
        }
        let body: Vec<u8> = self
            .buf
            .drain(..body_start + length)
            .skip(body_start)
            .collect();
        let text = String::from_utf8_lossy(&body).into_owned();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Some(RawResponse {
            status,
            headers,
            body,
        })
    }

    /// Reads one response within [`WAIT`]; panics if the server closed first.
    pub async fn response(&mut self) -> RawResponse {
        self.response_within(WAIT)
            .await
            .expect("a response before the server closed")
    }

    /// Whether the server closes the connection within `within` (anything it sends first is
    /// discarded). A reset counts as closed.
    pub async fn closed_within(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            let mut chunk = [0u8; 4096];
            match tokio::time::timeout_at(deadline, self.stream.read(&mut chunk)).await {
                Err(_) => return false,
                Ok(Ok(0) | Err(_)) => return true,
                Ok(Ok(_)) => {}
            }
        }
    }

    /// Reads more into the buffer until `deadline`; false on end-of-stream or error.
    async fn fill(&mut self, deadline: Instant) -> bool {
        let mut chunk = [0u8; 8192];
        match tokio::time::timeout_at(deadline, self.stream.read(&mut chunk)).await {
            Err(_) => panic!("no response within the wait"),
            Ok(Ok(0) | Err(_)) => false,
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }
}

/// A request head: `headers` with `Host` added (and `Content-Length` when `length` is given).
pub fn head(method: &str, path: &str, headers: &[(&str, &str)], length: Option<usize>) -> String {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(n) = length {
        head.push_str(&format!("Content-Length: {n}\r\n"));
    }
    head.push_str("\r\n");
    head
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
