//! One accepted connection as the edge sees it: what it is doing (waiting for a request's head,
//! idle between requests, serving, upgraded to a WebSocket), the deadline that follows from that,
//! and the socket wrapper that notices the bytes it reads.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::limits::Slot;

/// What a connection is doing, which decides its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Accepted; nothing read yet.
    Fresh { since: Instant },
    /// A request's head (or a TLS handshake) is arriving.
    Head { since: Instant },
    /// Between two requests of a keep-alive connection.
    Idle { since: Instant },
    /// Serving this many requests (more than one only over HTTP/2). Request bodies have their
    /// own deadline (`requests.rs`); responses may stream for as long as they need.
    Busy { requests: usize },
    /// Handed over to a WebSocket, which keeps its own liveness (PING/PONG).
    Upgraded,
    /// Closed by the edge to make room: reads see end-of-stream.
    Evicted,
}

/// Why the edge closed a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Closed {
    /// A request's head did not arrive in time.
    HeaderTimeout,
    /// Idle between requests for too long.
    IdleTimeout,
    /// Evicted to make room for a newer connection.
    Evicted,
}

/// How long each phase may last on one connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    pub header: Duration,
    pub idle: Duration,
}

pub(crate) struct Conn {
    pub peer: SocketAddr,
    /// Served for `/healthz` only: admitted beyond the connection caps.
    pub health_only: bool,
    phase: Mutex<Phase>,
    evicted: Notify,
    /// A second handle on a headroom connection's socket (see [`Conn::has_unread`]).
    socket: Option<socket2::Socket>,
}

impl Conn {
    pub fn new(peer: SocketAddr, health_only: bool) -> Self {
        Self {
            peer,
            health_only,
            phase: Mutex::new(Phase::Fresh {
                since: Instant::now(),
            }),
            evicted: Notify::new(),
            socket: None,
        }
    }

    /// Keeps a second handle on the socket so that [`Conn::has_unread`] can peek at it. Only for
    /// headroom connections (it costs a descriptor); without one, nothing is ever unread.
    pub fn peek_through(&mut self, socket: &impl std::os::fd::AsFd) {
        match socket2::SockRef::from(socket).try_clone() {
            Ok(dup) => self.socket = Some(dup),
            Err(err) => tracing::debug!(%err, "no second handle on a headroom socket"),
        }
    }

    /// Whether the peer has sent bytes the edge has not read yet: a health check whose request
    /// is waiting for its task to run, in a burst of accepts, is not a silent socket and must not
    /// be evicted as one. (The handle shares the socket's non-blocking mode, so this never waits.)
    pub fn has_unread(&self) -> bool {
        let Some(socket) = &self.socket else {
            return false;
        };
        let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        matches!(socket.peek(&mut byte), Ok(n) if n > 0)
    }

    fn phase(&self) -> std::sync::MutexGuard<'_, Phase> {
        // Every update leaves a valid phase: a panic elsewhere cannot leave it half-written.
        self.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes arrived: a connection that was waiting for a request is now reading one.
    fn read_some(&self) {
        let mut phase = self.phase();
        if let Phase::Fresh { .. } | Phase::Idle { .. } = *phase {
            *phase = Phase::Head {
                since: Instant::now(),
            };
        }
    }

    fn is_evicted(&self) -> bool {
        *self.phase() == Phase::Evicted
    }

    /// A request's head was read: it is being served.
    pub fn request_started(&self) {
        let mut phase = self.phase();
        *phase = match *phase {
            Phase::Busy { requests } => Phase::Busy {
                requests: requests + 1,
            },
            Phase::Upgraded | Phase::Evicted => return,
            _ => Phase::Busy { requests: 1 },
        };
    }

    /// A request's response was sent (or given up).
    pub fn request_finished(&self) {
        let mut phase = self.phase();
        if let Phase::Busy { requests } = *phase {
            *phase = match requests {
                0 | 1 => Phase::Idle {
                    since: Instant::now(),
                },
                n => Phase::Busy { requests: n - 1 },
            };
        }
    }

    /// The connection now carries a WebSocket.
    pub fn upgraded(&self) {
        *self.phase() = Phase::Upgraded;
    }

    /// Evicts the connection if it has not sent a byte yet; true if it was.
    pub fn evict_if_fresh(&self) -> Option<Instant> {
        let mut phase = self.phase();
        let Phase::Fresh { since } = *phase else {
            return None;
        };
        *phase = Phase::Evicted;
        drop(phase);
        self.evicted.notify_one();
        Some(since)
    }

    /// When the connection was accepted, while it has not sent a byte yet.
    pub fn fresh_since(&self) -> Option<Instant> {
        match *self.phase() {
            Phase::Fresh { since } => Some(since),
            _ => None,
        }
    }

    /// Resolves when the connection must be closed: its phase outlived its timeout, or it was
    /// evicted. Never resolves while it serves a request or carries a WebSocket.
    pub async fn watch(&self, t: Timeouts) -> Closed {
        // The phase is looked at again at least this often: it may change meanwhile (to idle,
        // from a head with a longer timeout), and since a new deadline is never less than this
        // away from the change that set it, no deadline is missed by waiting this long.
        let recheck = t.header.min(t.idle);
        loop {
            let now = Instant::now();
            let due = match *self.phase() {
                Phase::Fresh { since } | Phase::Head { since } => {
                    Some((since + t.header, Closed::HeaderTimeout))
                }
                Phase::Idle { since } => Some((since + t.idle, Closed::IdleTimeout)),
                Phase::Busy { .. } | Phase::Upgraded => None,
                Phase::Evicted => return Closed::Evicted,
            };
            let wake = match due {
                Some((deadline, reason)) if deadline <= now => return reason,
                Some((deadline, _)) => deadline.min(now + recheck),
                None => now + recheck,
            };
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = self.evicted.notified() => return Closed::Evicted,
            }
        }
    }
}

/// A socket as the edge serves it: it holds the connection's place under the caps for as long as
/// the socket lives (through a WebSocket upgrade too), and tells the connection when bytes arrive.
pub(crate) struct Tracked<T> {
    inner: T,
    conn: Arc<Conn>,
    _slot: Slot,
}

impl<T> Tracked<T> {
    pub fn new(inner: T, conn: Arc<Conn>, slot: Slot) -> Self {
        Self {
            inner,
            conn,
            _slot: slot,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Tracked<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.conn.is_evicted() {
            // End-of-stream: hyper closes an idle connection on it without an error.
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.conn.read_some();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Tracked<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn() -> Conn {
        Conn::new(SocketAddr::from(([127, 0, 0, 1], 1)), false)
    }

    const T: Timeouts = Timeouts {
        header: Duration::from_secs(10),
        idle: Duration::from_secs(60),
    };

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_is_closed_after_the_header_timeout() {
        let c = conn();
        let start = Instant::now();
        assert_eq!(c.watch(T).await, Closed::HeaderTimeout);
        assert_eq!(start.elapsed(), T.header);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_counts_from_the_end_of_the_last_response() {
        let c = conn();
        c.read_some();
        c.request_started();
        tokio::time::advance(Duration::from_secs(100)).await;
        c.request_finished();
        let idle_from = Instant::now();
        assert_eq!(c.watch(T).await, Closed::IdleTimeout);
        assert_eq!(idle_from.elapsed(), T.idle);
    }

    #[tokio::test(start_paused = true)]
    async fn a_shorter_timeout_after_a_phase_change_is_not_overslept() {
        let t = Timeouts {
            header: Duration::from_secs(60),
            idle: Duration::from_secs(5),
        };
        let c = Arc::new(conn());
        let watching = tokio::spawn({
            let c = c.clone();
            async move { (c.watch(t).await, Instant::now()) }
        });
        // The watch has seen a fresh connection (60 s to go) before the request comes.
        tokio::time::advance(Duration::from_secs(1)).await;
        c.read_some();
        c.request_started();
        c.request_finished();
        let idle_from = Instant::now();
        let (closed, at) = watching.await.expect("watch");
        assert_eq!(closed, Closed::IdleTimeout);
        assert_eq!(at - idle_from, t.idle);
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_arriving_while_idle_gets_the_header_timeout() {
        let c = conn();
        c.request_started();
        c.request_finished();
        tokio::time::advance(Duration::from_secs(30)).await;
        c.read_some();
        let head_from = Instant::now();
        assert_eq!(c.watch(T).await, Closed::HeaderTimeout);
        assert_eq!(head_from.elapsed(), T.header);
    }

    #[tokio::test(start_paused = true)]
    async fn busy_and_upgraded_connections_have_no_deadline_and_only_fresh_ones_are_evicted() {
        let c = conn();
        c.request_started();
        c.request_started();
        c.request_finished();
        let watch = c.watch(T);
        tokio::pin!(watch);
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), &mut watch)
                .await
                .is_err()
        );
        assert!(c.evict_if_fresh().is_none());
        c.upgraded();
        c.request_finished();
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), &mut watch)
                .await
                .is_err()
        );
        let fresh = conn();
        assert!(fresh.evict_if_fresh().is_some());
        assert_eq!(fresh.watch(T).await, Closed::Evicted);
    }
}
