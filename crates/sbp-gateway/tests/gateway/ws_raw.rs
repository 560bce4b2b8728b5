//! A WebSocket client at the frame level, for what a real client library will not send: a manual
//! upgrade over a plain `TcpStream`, frames built bit by bit (reserved bits, opcodes, masking,
//! fragmentation, lengths that lie), and the server's frames read back raw, each checked to be a
//! well-formed server frame (unmasked, no reserved bits).

use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};

use crate::support::WAIT;

pub const TEXT: u8 = 0x1;
pub const BINARY: u8 = 0x2;
pub const CONT: u8 = 0x0;
pub const CLOSE: u8 = 0x8;
pub const PING: u8 = 0x9;
pub const PONG: u8 = 0xA;

/// A client frame as it goes on the wire.
#[derive(Debug, Clone)]
pub struct Out {
    pub fin: bool,
    /// RSV1..3 as the bits 0x40, 0x20, 0x10 of the first byte.
    pub rsv: u8,
    pub opcode: u8,
    pub masked: bool,
    pub payload: Vec<u8>,
}

impl Out {
    pub fn new(opcode: u8, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            fin: true,
            rsv: 0,
            opcode,
            masked: true,
            payload: payload.into(),
        }
    }

    pub fn text(t: impl Into<Vec<u8>>) -> Self {
        Self::new(TEXT, t)
    }

    pub fn ping(p: impl Into<Vec<u8>>) -> Self {
        Self::new(PING, p)
    }

    /// A close frame with `code` and `reason` (raw bytes: may be invalid UTF-8).
    pub fn close(code: u16, reason: &[u8]) -> Self {
        let mut p = code.to_be_bytes().to_vec();
        p.extend_from_slice(reason);
        Self::new(CLOSE, p)
    }

    pub fn fin(mut self, fin: bool) -> Self {
        self.fin = fin;
        self
    }

    pub fn rsv(mut self, rsv: u8) -> Self {
        self.rsv = rsv;
        self
    }

    pub fn unmasked(mut self) -> Self {
        self.masked = false;
        self
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut f = vec![(if self.fin { 0x80 } else { 0 }) | self.rsv | (self.opcode & 0x0f)];
        let mask_bit = if self.masked { 0x80 } else { 0 };
        let n = self.payload.len();
        if n < 126 {
            f.push(mask_bit | n as u8);
        } else if n <= 0xffff {
            f.push(mask_bit | 126);
            f.extend((n as u16).to_be_bytes());
        } else {
            f.push(mask_bit | 127);
            f.extend((n as u64).to_be_bytes());
        }
        if self.masked {
            let key = [0x37, 0xfa, 0x21, 0x3d];
            f.extend(key);
            f.extend(self.payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
        } else {
            f.extend(&self.payload);
        }
        f
    }
}

/// A frame the server sent.
#[derive(Debug, Clone, PartialEq)]
pub struct In {
    pub fin: bool,
    pub opcode: u8,
    pub payload: Vec<u8>,
}

impl In {
    /// The close code, for a close frame with one.
    pub fn close_code(&self) -> Option<u16> {
        (self.opcode == CLOSE && self.payload.len() >= 2)
            .then(|| u16::from_be_bytes([self.payload[0], self.payload[1]]))
    }

    /// The close reason, for a close frame.
    pub fn close_reason(&self) -> String {
        String::from_utf8_lossy(self.payload.get(2..).unwrap_or_default()).into_owned()
    }

    /// The JSON of a text frame.
    pub fn json(&self) -> Value {
        assert_eq!(self.opcode, TEXT, "a text frame expected: {self:?}");
        serde_json::from_slice(&self.payload).expect("the server sends JSON")
    }
}

/// What came next from the server.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    Frame(In),
    /// The server closed TCP (EOF or reset), possibly in the middle of a frame.
    End,
}

pub struct RawWs {
    pub stream: TcpStream,
    /// Bytes read and not yet parsed.
    buf: Vec<u8>,
}

impl RawWs {
    /// Upgrades `GET path` on the gateway at `http://HOST:PORT`.
    pub async fn connect(url: &str, path: &str) -> RawWs {
        Self::connect_with(url, path, None).await
    }

    /// [`RawWs::connect`] with the client's receive buffer set to `recv_buffer` bytes: a client
    /// that does not read then stalls the server's writes after little data.
    pub async fn connect_with(url: &str, path: &str, recv_buffer: Option<u32>) -> RawWs {
        let addr = url
            .strip_prefix("http://")
            .expect("an http:// URL")
            .parse()
            .expect("HOST:PORT");
        let socket = TcpSocket::new_v4().expect("socket");
        if let Some(size) = recv_buffer {
            socket.set_recv_buffer_size(size).expect("SO_RCVBUF");
        }
        let mut stream = tokio::time::timeout(WAIT, socket.connect(addr))
            .await
            .expect("connect within the wait")
            .expect("connect");
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut ws = RawWs {
            stream,
            buf: Vec::new(),
        };
        let head = loop {
            if let Some(end) = ws.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&ws.buf[..end]).into_owned();
                ws.buf.drain(..end + 4);
                break head;
            }
            assert!(ws.fill(WAIT).await, "the upgrade response ended early");
        };
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        // RFC 6455 §1.3's example key and its answer.
        assert!(
            head.to_ascii_lowercase()
                .contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
            "{head}"
        );
        ws
    }

    /// Reads more bytes into the buffer; false at the end of the stream.
    async fn fill(&mut self, within: Duration) -> bool {
        let mut chunk = [0u8; 16384];
        match tokio::time::timeout(within, self.stream.read(&mut chunk)).await {
            Err(_) => panic!("nothing from the server within {within:?}"),
            Ok(Ok(0) | Err(_)) => false,
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }

    pub async fn send(&mut self, frame: &Out) {
        self.write(&frame.encode()).await;
    }

    pub async fn write(&mut self, bytes: &[u8]) {
        self.stream
            .write_all(bytes)
            .await
            .expect("write to the gateway");
    }

    /// Writes, ignoring a failure (the server may already have closed).
    pub async fn try_write(&mut self, bytes: &[u8]) -> bool {
        self.stream.write_all(bytes).await.is_ok()
    }

    /// The next server frame or the end of the stream, within `within`.
    pub async fn next_within(&mut self, within: Duration) -> Next {
        loop {
            if let Some(frame) = self.parse() {
                return Next::Frame(frame);
            }
            if !self.fill(within).await {
                return Next::End;
            }
        }
    }

    /// [`RawWs::next_within`] with the standard wait.
    pub async fn next(&mut self) -> Next {
        self.next_within(WAIT).await
    }

    /// The next frame; fails at the end of the stream.
    pub async fn frame(&mut self) -> In {
        match self.next().await {
            Next::Frame(f) => f,
            Next::End => panic!("the server closed where a frame was expected"),
        }
    }

    /// A whole frame from the buffer, if one is there; checks it is a valid server frame.
    fn parse(&mut self) -> Option<In> {
        let b = &self.buf;
        if b.len() < 2 {
            return None;
        }
        assert_eq!(b[0] & 0x70, 0, "server frame with reserved bits set");
        assert_eq!(b[1] & 0x80, 0, "server frames are never masked");
        let (len, header) = match b[1] & 0x7f {
            126 if b.len() >= 4 => (u16::from_be_bytes([b[2], b[3]]) as usize, 4),
            127 if b.len() >= 10 => {
                let mut l = [0u8; 8];
                l.copy_from_slice(&b[2..10]);
                (u64::from_be_bytes(l) as usize, 10)
            }
            126 | 127 => return None,
            n => (n as usize, 2),
        };
        if b.len() < header + len {
            return None;
        }
        let frame = In {
            fin: b[0] & 0x80 != 0,
            opcode: b[0] & 0x0f,
            payload: b[header..header + len].to_vec(),
        };
        self.buf.drain(..header + len);
        Some(frame)
    }

    /// Every whole frame until the server closes TCP (what a stalled client still finds in its
    /// buffers), the close frame included; a frame cut off by the end is not returned.
    pub async fn rest(&mut self) -> Vec<In> {
        let mut frames = Vec::new();
        loop {
            match self.next().await {
                Next::Frame(f) => frames.push(f),
                Next::End => return frames,
            }
        }
    }
}
