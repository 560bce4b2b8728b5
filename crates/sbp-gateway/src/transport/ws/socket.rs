//! One surface's WebSocket as the connection task uses it: messages in, each read failure mapped to
//! the close code RFC 6455 asks for; frames out, each write bounded in time (and abandoned when the
//! connection's outbound budget overflows); and the closing handshake, which answers a client's
//! close and, after a close of ours, keeps reading (bounded in time and bytes) until the client's
//! close arrives, so the client sees our close frame instead of a reset.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncReadExt as _;
use tokio::time::Instant;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message, Utf8Bytes};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use sbp_protocol::ServerFrame;

use super::wire::{Wire, WriteProgress};
use crate::engine::connections::Backlog;
use crate::metrics::FrameLabels;

/// RFC 6455 close codes the transport itself sends (the protocol's own are in
/// `sbp_protocol::frames`).
pub const CLOSE_WS_PROTOCOL: u16 = 1002;
pub const CLOSE_INVALID_DATA: u16 = 1007;
pub const CLOSE_POLICY: u16 = 1008;
pub const CLOSE_TOO_BIG: u16 = 1009;
/// The reason of the close for a frame flood.
pub const FLOOD: &str = "too many frames";

/// Longest closing handshake: writing our close, then waiting for the client's.
const CLOSE_LINGER: Duration = Duration::from_secs(3);
/// Most bytes read and dropped while waiting for the client's close (a client may be in the
/// middle of sending a frame far larger than the limit: it reads our close only once it is done).
const CLOSE_LINGER_BYTES: u64 = 64 << 20;
/// Read size while lingering.
const LINGER_READ: usize = 16 << 10;

pub type Stream = WebSocketStream<Wire<TokioIo<Upgraded>>>;

/// What the client sent next.
pub enum Incoming {
    Text(Utf8Bytes),
    /// Binary frames are not part of the protocol.
    Binary,
    /// The connection is over (the client closed, broke the protocol, or went away); how to
    /// close it.
    Ended(Close),
}

/// How a connection is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    /// The connection is gone: nothing to send.
    Gone,
    /// The client sent a close frame: answer it (tungstenite has queued the answer).
    Answer,
    /// Send this close frame, then wait for the client's.
    Send(u16, &'static str),
}

/// Why a write did not complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteFailed {
    /// The connection is gone.
    Gone,
    /// The frame was not written within the write timeout: the client is not reading.
    Timeout,
    /// Turn traffic for this connection went over its outbound budget.
    Overflow,
}

/// The frames and bytes of one connection, for its access line, each frame also counted in the
/// gateway's `sbp_ws_frames_total` by type.
pub struct Tally {
    frames: Family<FrameLabels, Counter>,
    frames_in: AtomicU64,
    frames_out: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
}

/// A connection's totals: frames in, frames out, bytes in, bytes out.
pub struct Totals {
    pub frames_in: u64,
    pub frames_out: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

impl Tally {
    /// A connection's tally, counting into the gateway's `frames` family.
    pub fn new(frames: Family<FrameLabels, Counter>) -> Arc<Self> {
        Arc::new(Self {
            frames,
            frames_in: AtomicU64::new(0),
            frames_out: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
        })
    }

    /// A frame of `kind` received, `bytes` long.
    pub fn received(&self, kind: &'static str, bytes: usize) {
        self.count("in", kind);
        self.frames_in.fetch_add(1, Relaxed);
        self.bytes_in.fetch_add(bytes as u64, Relaxed);
    }

    fn sent(&self, kind: &'static str, bytes: usize) {
        self.count("out", kind);
        self.frames_out.fetch_add(1, Relaxed);
        self.bytes_out.fetch_add(bytes as u64, Relaxed);
    }

    fn count(&self, direction: &'static str, r#type: &'static str) {
        self.frames
            .get_or_create(&FrameLabels { direction, r#type })
            .inc();
    }

    pub fn totals(&self) -> Totals {
        Totals {
            frames_in: self.frames_in.load(Relaxed),
            frames_out: self.frames_out.load(Relaxed),
            bytes_in: self.bytes_in.load(Relaxed),
            bytes_out: self.bytes_out.load(Relaxed),
        }
    }
}

pub struct Socket {
    ws: Stream,
    tally: Arc<Tally>,
    write_timeout: Duration,
    progress: WriteProgress,
    /// Once attached: the connection's queued turn traffic, whose overflow abandons a write.
    backlog: Option<Arc<Backlog>>,
    /// A write was abandoned with part of its frame still in tungstenite's buffer: the close
    /// frame, if it gets out, goes after the rest of it.
    abandoned: bool,
}

impl Socket {
    pub fn new(ws: Stream, write_timeout: Duration, tally: Arc<Tally>) -> Self {
        let progress = ws.get_ref().progress();
        Self {
            ws,
            tally,
            write_timeout,
            progress,
            backlog: None,
            abandoned: false,
        }
    }

    /// From now on a write is abandoned as soon as `backlog` overflows.
    pub fn watch(&mut self, backlog: Arc<Backlog>) {
        self.backlog = Some(backlog);
    }

    /// The next message; PINGs are answered (by tungstenite, on the next read or write) and
    /// PONGs dropped.
    pub async fn recv(&mut self) -> Incoming {
        loop {
            let msg = match self.ws.next().await {
                None => return Incoming::Ended(Close::Gone),
                Some(Ok(msg)) => msg,
                Some(Err(e)) => return Incoming::Ended(self.close_for(&e)),
            };
            match msg {
                Message::Text(t) => return Incoming::Text(t),
                Message::Binary(b) => {
                    self.tally.received("BINARY", b.len());
                    return Incoming::Binary;
                }
                Message::Close(_) => return Incoming::Ended(Close::Answer),
                Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => continue,
            }
        }
    }

    /// The close a read error calls for (RFC 6455 §7.4.1).
    fn close_for(&self, e: &WsError) -> Close {
        match e {
            WsError::Io(_) if self.ws.get_ref().flooded() => Close::Send(CLOSE_POLICY, FLOOD),
            WsError::Capacity(_) => Close::Send(CLOSE_TOO_BIG, "frame too large"),
            WsError::Utf8(_) => Close::Send(CLOSE_INVALID_DATA, "invalid UTF-8"),
            // The peer closed TCP without a close frame: nobody to tell.
            WsError::Protocol(
                tokio_tungstenite::tungstenite::error::ProtocolError::ResetWithoutClosingHandshake,
            ) => Close::Gone,
            WsError::Protocol(_) => Close::Send(CLOSE_WS_PROTOCOL, "protocol violation"),
            _ => Close::Gone,
        }
    }

    /// A frame of `kind` received, `bytes` long (counted by the caller, who knows its type).
    pub fn received(&self, kind: &'static str, bytes: usize) {
        self.tally.received(kind, bytes);
    }

    /// Writes one protocol frame, counted once written (see [`Socket::send`]).
    pub async fn send_frame(&mut self, frame: &ServerFrame) -> Result<(), WriteFailed> {
        let text = frame.to_json();
        let bytes = text.len();
        self.send(text).await?;
        self.tally.sent(frame.type_name(), bytes);
        Ok(())
    }

    /// Writes one text frame. It fails with `Timeout` only when no byte could be written for the
    /// whole write timeout (a slow link still sends a large turn; a stalled reader is dropped).
    pub async fn send(&mut self, text: String) -> Result<(), WriteFailed> {
        let started = Instant::now();
        let timeout = self.write_timeout;
        let progress = self.progress.clone();
        let backlog = self.backlog.clone();
        let write = self.ws.send(Message::text(text));
        tokio::pin!(write);
        let result = loop {
            let stalled_since = progress.last().max(started);
            tokio::select! {
                // A write that completed counts, even if the budget overflowed meanwhile: its
                // frame is out and must be reported sent.
                biased;
                r = &mut write => break r.map_err(|_| WriteFailed::Gone),
                () = overflowed(backlog.as_deref()) => break Err(WriteFailed::Overflow),
                () = tokio::time::sleep_until(stalled_since + timeout) => {
                    if progress.last().max(started) + timeout <= Instant::now() {
                        break Err(WriteFailed::Timeout);
                    }
                }
            }
        };
        if matches!(result, Err(WriteFailed::Overflow | WriteFailed::Timeout)) {
            self.abandoned = true;
        }
        result
    }

    /// Whether a write was abandoned part-way (its frame may still complete before a close).
    pub fn abandoned(&self) -> bool {
        self.abandoned
    }

    /// Ends the connection as `close` says; bounded by [`CLOSE_LINGER`] in all. Returns whether
    /// our close frame was written (after an abandoned write: that frame went out whole first).
    pub async fn finish(mut self, close: Close) -> bool {
        let deadline = Instant::now() + CLOSE_LINGER;
        match close {
            Close::Gone => false,
            // Writes the queued answer; tungstenite then ends the stream (the server closes TCP
            // first, RFC 6455 §7.1.1).
            Close::Answer => {
                let _ = tokio::time::timeout_at(deadline, self.ws.flush()).await;
                false
            }
            Close::Send(code, reason) => {
                let frame = Message::Close(Some(CloseFrame {
                    code: code.into(),
                    reason: reason.into(),
                }));
                match tokio::time::timeout_at(deadline, self.ws.send(frame)).await {
                    // Written: the client answers once it has read it.
                    Ok(Ok(())) => {
                        self.linger(deadline).await;
                        true
                    }
                    // The client already closed (a close frame of its own crossed ours).
                    Ok(Err(WsError::ConnectionClosed)) => false,
                    // Not written: the client will never see it, so nothing to wait for.
                    Ok(Err(_)) | Err(_) => false,
                }
            }
        }
    }

    /// After our close: reads and drops what the client still sends until its close frame, the end
    /// of the stream, `deadline` or [`CLOSE_LINGER_BYTES`]. Reads below tungstenite (which may
    /// have given up on the stream); the wire still knows where frames begin.
    async fn linger(&mut self, deadline: Instant) {
        let wire = self.ws.get_mut();
        wire.stop_limiting();
        let start = wire.bytes_read();
        // Allocated here, not on the stack: the connection task's state would carry it.
        let mut buf = vec![0u8; LINGER_READ];
        while !wire.close_seen() && wire.bytes_read() - start < CLOSE_LINGER_BYTES {
            match tokio::time::timeout_at(deadline, wire.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            }
        }
    }
}

/// Resolves once `backlog` overflows; never without one.
async fn overflowed(backlog: Option<&Backlog>) {
    match backlog {
        Some(b) => b.overflowed().await,
        None => std::future::pending().await,
    }
}
