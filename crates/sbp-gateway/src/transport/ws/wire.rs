//! The byte stream under one WebSocket, followed frame by frame as tungstenite reads it: every
//! frame a client sends is counted against the connection's token bucket (a flood fails the read,
//! however the frames are built: control frames and empty continuations included), and the frame
//! boundaries stay known even after tungstenite gave up on the stream (a frame too large, a
//! protocol violation), so the closing handshake can still find the client's close frame.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

/// The opcode of a close frame (RFC 6455 §5.5.1).
const OP_CLOSE: u8 = 0x8;

/// A sustained rate with a burst allowance (a token bucket), for inbound frames.
#[derive(Debug, Clone)]
pub struct FrameLimit {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl FrameLimit {
    /// `rate` frames per second sustained, `burst` at once (at least 1 of each).
    pub fn new(rate: u32, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            rate: f64::from(rate.max(1)),
            burst,
            tokens: burst,
            last: Instant::now(),
        }
    }

    /// Takes `n` frames' tokens at `now`; false when there are not that many.
    fn take(&mut self, n: u64, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        let n = n as f64;
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }
}

/// Where the reader is in the client's frame stream.
#[derive(Debug, Clone, Default)]
pub struct FrameTracker {
    /// The header being read (at most 2 + 8 + 4 bytes) and how much of it has arrived.
    header: [u8; 14],
    have: usize,
    /// Payload bytes of the current frame still to come (`None`: reading a header).
    remaining: Option<u64>,
    opcode: u8,
    /// A whole close frame from the client has been read.
    close_seen: bool,
}

impl FrameTracker {
    /// Follows `bytes`; returns how many frames began in them.
    pub fn feed(&mut self, mut bytes: &[u8]) -> u64 {
        let mut frames = 0;
        while !bytes.is_empty() {
            match self.remaining {
                Some(left) => {
                    let take = usize::try_from(left).unwrap_or(usize::MAX).min(bytes.len());
                    bytes = &bytes[take..];
                    self.payload_read(left - take as u64);
                }
                None => {
                    let need = self.header_len();
                    let take = (need - self.have).min(bytes.len());
                    self.header[self.have..self.have + take].copy_from_slice(&bytes[..take]);
                    self.have += take;
                    bytes = &bytes[take..];
                    // The length is known once two bytes are in: read again if it grew.
                    if self.have == self.header_len() {
                        frames += 1;
                        self.opcode = self.header[0] & 0x0f;
                        let len = self.payload_len();
                        self.have = 0;
                        self.payload_read(len);
                    }
                }
            }
        }
        frames
    }

    /// Whether the client's close frame has been read whole.
    pub fn close_seen(&self) -> bool {
        self.close_seen
    }

    fn payload_read(&mut self, left: u64) {
        if left == 0 {
            self.remaining = None;
            if self.opcode == OP_CLOSE {
                self.close_seen = true;
            }
        } else {
            self.remaining = Some(left);
        }
    }

    /// The header's full length, as far as the bytes read so far tell.
    fn header_len(&self) -> usize {
        if self.have < 2 {
            return 2;
        }
        let ext = match self.header[1] & 0x7f {
            126 => 2,
            127 => 8,
            _ => 0,
        };
        let mask = if self.header[1] & 0x80 != 0 { 4 } else { 0 };
        2 + ext + mask
    }

    fn payload_len(&self) -> u64 {
        match self.header[1] & 0x7f {
            126 => u64::from(u16::from_be_bytes([self.header[2], self.header[3]])),
            127 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&self.header[2..10]);
                u64::from_be_bytes(b)
            }
            n => u64::from(n),
        }
    }
}

/// The connection's IO with the frame tracker and limit on its read side.
#[derive(Debug)]
pub struct Wire<T> {
    io: T,
    frames: FrameTracker,
    /// `None` once the connection is closing: what the client still sends is read and dropped.
    limit: Option<FrameLimit>,
    flooded: bool,
    read: u64,
    /// When bytes were last written to the client: a write times out only without progress.
    progress: WriteProgress,
}

/// When a connection last wrote bytes to its client, shared with the writer that watches it.
#[derive(Debug, Clone)]
pub struct WriteProgress(Arc<Mutex<Instant>>);

impl Default for WriteProgress {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Instant::now())))
    }
}

impl WriteProgress {
    fn made(&self) {
        if let Ok(mut at) = self.0.lock() {
            *at = Instant::now();
        }
    }

    /// The last write of at least one byte.
    pub fn last(&self) -> Instant {
        self.0.lock().map_or_else(|e| *e.into_inner(), |at| *at)
    }
}

impl<T> Wire<T> {
    pub fn new(io: T, limit: FrameLimit) -> Self {
        Self {
            io,
            frames: FrameTracker::default(),
            limit: Some(limit),
            flooded: false,
            read: 0,
            progress: WriteProgress::default(),
        }
    }

    /// A handle on this connection's write progress.
    pub fn progress(&self) -> WriteProgress {
        self.progress.clone()
    }

    /// The client sent frames faster than its limit allows (the read that saw it failed).
    pub fn flooded(&self) -> bool {
        self.flooded
    }

    /// Whether the client's close frame has arrived (tungstenite may not have parsed it yet).
    pub fn close_seen(&self) -> bool {
        self.frames.close_seen()
    }

    /// Bytes read from the client so far.
    pub fn bytes_read(&self) -> u64 {
        self.read
    }

    /// Stops counting frames: the connection is closing and only waits for the client's close.
    pub fn stop_limiting(&mut self) {
        self.limit = None;
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Wire<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
        let fresh = &buf.filled()[before..];
        this.read += fresh.len() as u64;
        let frames = this.frames.feed(fresh);
        if frames > 0
            && let Some(limit) = &mut this.limit
            && !limit.take(frames, Instant::now())
        {
            this.flooded = true;
            this.limit = None;
            return Poll::Ready(Err(io::Error::other("inbound frame rate limit exceeded")));
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Wire<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.progress.made();
        }
        polled
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.progress.made();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A masked client frame: FIN + `opcode`, `payload` (masked with a zero key: the bytes are
    /// the same, the tracker never unmasks).
    fn frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0x80 | opcode];
        match payload.len() {
            n if n < 126 => f.push(0x80 | n as u8),
            n if n <= 0xffff => {
                f.push(0x80 | 126);
                f.extend((n as u16).to_be_bytes());
            }
            n => {
                f.push(0x80 | 127);
                f.extend((n as u64).to_be_bytes());
            }
        }
        f.extend([0, 0, 0, 0]);
        f.extend(payload);
        f
    }

    #[test]
    fn frames_are_counted_and_the_close_found_whatever_the_read_sizes() {
        let mut stream = Vec::new();
        stream.extend(frame(0x1, b"hello"));
        stream.extend(frame(0x9, b""));
        stream.extend(frame(0x2, &[7u8; 300]));
        stream.extend(frame(0x1, &[b'a'; 70_000]));
        stream.extend(frame(0x8, &[0x03, 0xe8]));
        for chunk in [1, 2, 3, 7, 13, 1024, stream.len()] {
            let mut t = FrameTracker::default();
            let mut frames = 0;
            for piece in stream.chunks(chunk) {
                assert!(!t.close_seen(), "chunk {chunk}: close seen too early");
                frames += t.feed(piece);
            }
            assert_eq!(frames, 5, "chunk {chunk}");
            assert!(t.close_seen(), "chunk {chunk}");
        }
    }

    #[test]
    fn a_close_frame_counts_only_once_its_payload_is_in() {
        let close = frame(0x8, &[0x03, 0xe8, b'b', b'y', b'e']);
        let mut t = FrameTracker::default();
        t.feed(&close[..close.len() - 1]);
        assert!(!t.close_seen());
        t.feed(&close[close.len() - 1..]);
        assert!(t.close_seen());
    }

    #[test]
    fn a_frame_too_large_to_read_is_skipped_byte_for_byte() {
        // A 10 MB text frame's header, its payload in pieces, then the close.
        let mut t = FrameTracker::default();
        let big = 10_000_000usize;
        let mut header = vec![0x81, 0x80 | 127];
        header.extend((big as u64).to_be_bytes());
        header.extend([1, 2, 3, 4]);
        assert_eq!(t.feed(&header), 1);
        let piece = vec![b'x'; 65_536];
        let mut left = big;
        while left > 0 {
            let n = left.min(piece.len());
            assert_eq!(t.feed(&piece[..n]), 0);
            left -= n;
        }
        assert!(!t.close_seen());
        assert_eq!(t.feed(&frame(0x8, &[])), 1);
        assert!(t.close_seen());
    }

    #[test]
    fn the_bucket_allows_the_burst_then_the_rate() {
        let start = Instant::now();
        let mut limit = FrameLimit::new(10, 20);
        limit.last = start;
        assert!(limit.take(20, start));
        assert!(!limit.take(1, start));
        // 0.5 s refills 5 frames, not 6.
        let later = start + Duration::from_millis(500);
        assert!(limit.take(5, later));
        assert!(!limit.take(1, later));
        // Never more than the burst, however long the pause.
        let much_later = later + Duration::from_secs(3600);
        assert!(!limit.take(21, much_later));
        assert!(limit.take(20, much_later));
    }
}
