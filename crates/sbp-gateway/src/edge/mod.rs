//! The connection layer under the router: our own accept loop over hyper, so that every socket
//! has a limit. A request's head must arrive within `header_read_timeout` (from the connection's
//! first byte, or from its accept for one that sends nothing), its body within `body_timeout`,
//! and an idle keep-alive connection closes after `keep_alive_timeout`. Connections are capped
//! in total and per client IP (`limits.rs`); beyond the caps a small headroom still answers
//! `/healthz`, and the rest are closed at once instead of failing `accept`. Stopping is bounded
//! by `shutdown_grace`.
//!
//! - `conn.rs`: one connection's phase and deadline, and the socket wrapper that feeds it.
//! - `limits.rs`: admission under the caps.
//! - `requests.rs`: each request on its way to the router (early 413, body budget, body deadline,
//!   health-only).
//! - `tls.rs`: HTTPS and WSS with a certificate reloaded when its files change or on SIGHUP.

mod conn;
mod limits;
mod requests;
mod tls;

pub use tls::{TlsError, check as check_tls};

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::Gateway;
use crate::config::EdgeConfig;
use conn::{Conn, Timeouts, Tracked};
use limits::{Admission, Limits, Slot};
use requests::EdgeService;
use tls::Tls;

/// A connection admitted beyond the caps gets at most this long to send its `/healthz` request.
const HEALTH_HEADER_TIMEOUT: Duration = Duration::from_secs(2);
/// After the grace, how long connections get to send the failure of the turns they waited for.
const FLUSH: Duration = Duration::from_secs(2);
/// Pause after an `accept` error that is not about one connection (e.g. out of file descriptors),
/// so the loop neither spins nor dies.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `gateway` on `listener` until `shutdown` completes (or the gateway stops), then stops
/// within the configured grace: see [`crate::serve`].
pub async fn serve(
    listener: TcpListener,
    gateway: Gateway,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let cfg = gateway.config().edge.clone();
    let grace = gateway.config().shutdown_grace;
    let tls = match &cfg.tls {
        Some(files) => {
            Some(Arc::new(Tls::new(files).map_err(|e| {
                io::Error::new(io::ErrorKind::InvalidInput, e)
            })?))
        }
        None => None,
    };
    let bound = listener.local_addr()?;
    let edge = Arc::new(Edge::new(&gateway, &cfg, tls.clone(), bound));
    let reloads = tls.map(|tls| {
        let (every, stop) = (cfg.tls_reload_interval, edge.graceful.clone());
        tokio::spawn(async move { tls.watch(every, stop).await })
    });
    let stop = gateway.shutdown_token();
    tokio::pin!(shutdown);
    let mut accept_errors = AcceptErrors::default();
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut shutdown => break,
            _ = stop.cancelled() => break,
            accepted = async {
                edge.limits.room_to_evict().await;
                listener.accept().await
            } => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_errors.handle(e).await;
                    continue;
                }
            },
        };
        edge.clone().connection(tcp, peer);
    }
    drop(listener);
    let deadline = Instant::now() + grace;
    edge.stop(&gateway, deadline).await;
    if let Some(reloads) = reloads {
        let _ = reloads.await;
    }
    gateway.shutdown_by(deadline).await;
    Ok(())
}

/// What every connection task shares.
struct Edge {
    gateway: Gateway,
    app: axum::Router,
    builder: Builder<TokioExecutor>,
    tls: Option<Arc<Tls>>,
    limits: Arc<Limits>,
    timeouts: Timeouts,
    max_body: usize,
    body_timeout: Duration,
    bodies: Arc<requests::BodyBudget>,
    conns: TaskTracker,
    /// Asks connections to finish their requests and close.
    graceful: CancellationToken,
    /// Closes connections now.
    kill: CancellationToken,
}

impl Edge {
    fn new(
        gateway: &Gateway,
        cfg: &EdgeConfig,
        tls: Option<Arc<Tls>>,
        bound: std::net::SocketAddr,
    ) -> Self {
        let mut builder = Builder::new(TokioExecutor::new());
        // Header and idle deadlines are the edge's own (`conn.rs`): hyper's header timer would
        // also run while a keep-alive connection is idle.
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(None);
        // Extended CONNECT: WebSocket over HTTP/2 (RFC 8441), as axum's own server offers it.
        builder
            .http2()
            .timer(TokioTimer::new())
            .enable_connect_protocol();
        Self {
            gateway: gateway.clone(),
            app: crate::transport::router(gateway.clone(), bound),
            builder,
            tls,
            limits: Limits::new(cfg.max_connections, cfg.max_connections_per_ip),
            timeouts: Timeouts {
                header: cfg.header_read_timeout,
                idle: cfg.keep_alive_timeout,
            },
            max_body: gateway.config().max_body_bytes,
            body_timeout: cfg.body_timeout,
            bodies: requests::BodyBudget::new(cfg.max_inflight_body_bytes),
            conns: TaskTracker::new(),
            graceful: CancellationToken::new(),
            kill: CancellationToken::new(),
        }
    }

    /// Admits (or sheds) one accepted socket and serves it on a task of its own.
    fn connection(self: Arc<Self>, tcp: TcpStream, peer: std::net::SocketAddr) {
        let health_only = !self.limits.fits(peer.ip());
        let conn = Arc::new(Conn::new(peer, health_only));
        if health_only {
            conn.peek_through(&tcp);
        }
        let slot = match self.limits.admit(&conn) {
            Admission::Normal(slot) => slot,
            Admission::HealthOnly(slot) => {
                self.shed(peer, "serving /healthz only");
                slot
            }
            Admission::Refused => {
                self.shed(peer, "closed");
                return;
            }
        };
        // Frames are small and often sent back to back (an ACK after a TURN_COMPLETE, a
        // TOOL_RESULT after a PONG): with Nagle on, the second waits for the peer's delayed ACK,
        // up to 40 ms.
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(%err, "could not set TCP_NODELAY");
        }
        let edge = self.clone();
        self.conns
            .spawn(async move { edge.run(tcp, conn, slot).await });
    }

    fn shed(&self, peer: std::net::SocketAddr, what: &'static str) {
        let (open, health) = self.limits.open();
        self.gateway.metrics().connections_shed.inc();
        tracing::debug!(%peer, open, health, what, "connection over a connection cap");
    }

    async fn run(&self, tcp: TcpStream, conn: Arc<Conn>, slot: Slot) {
        let timeouts = match conn.health_only {
            true => Timeouts {
                header: self.timeouts.header.min(HEALTH_HEADER_TIMEOUT),
                ..self.timeouts
            },
            false => self.timeouts,
        };
        let serving = async {
            let io = Tracked::new(tcp, conn.clone(), slot);
            match &self.tls {
                None => self.http(io, &conn).await,
                Some(tls) => match tls.acceptor().accept(io).await {
                    Ok(io) => self.http(io, &conn).await,
                    Err(err) => {
                        tracing::debug!(peer = %conn.peer, %err, "TLS handshake failed");
                    }
                },
            }
        };
        tokio::select! {
            _ = serving => {}
            closed = conn.watch(timeouts) => {
                self.gateway
                    .metrics()
                    .connections_timed_out
                    .inc();
                tracing::debug!(peer = %conn.peer, reason = ?closed, "connection closed by the edge");
            }
            _ = self.kill.cancelled() => {}
        }
    }

    /// Serves HTTP on `io` until the connection ends (or, upgraded, is handed to its WebSocket).
    async fn http<I>(&self, io: I, conn: &Arc<Conn>)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let service = EdgeService {
            app: self.app.clone(),
            conn: conn.clone(),
            max_body: self.max_body,
            body_timeout: self.body_timeout,
            bodies: self.bodies.clone(),
        };
        let served = self
            .builder
            .serve_connection_with_upgrades(TokioIo::new(io), service);
        tokio::pin!(served);
        let result = tokio::select! {
            r = served.as_mut() => r,
            _ = self.graceful.cancelled() => {
                served.as_mut().graceful_shutdown();
                served.await
            }
        };
        if let Err(err) = result {
            tracing::debug!(peer = %conn.peer, %err, "connection ended with an error");
        }
    }

    /// Stops serving: idle connections close now, the others after their request; past
    /// `deadline` the turns they wait for are failed, and what is still open a moment later is
    /// closed.
    async fn stop(&self, gateway: &Gateway, deadline: Instant) {
        self.conns.close();
        self.graceful.cancel();
        if tokio::time::timeout_at(deadline, self.conns.wait())
            .await
            .is_ok()
        {
            return;
        }
        gateway.abort_turns();
        if tokio::time::timeout(FLUSH, self.conns.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                connections = self.conns.len(),
                "shutdown grace over: closing connections still open"
            );
            self.kill.cancel();
            self.conns.wait().await;
        }
    }
}

/// `accept` failures: those of one connection (reset before it was accepted) are skipped; any
/// other (out of file descriptors, out of memory) pauses the loop briefly and is logged at most
/// once a second, with how many there were.
#[derive(Default)]
struct AcceptErrors {
    last_log: Option<Instant>,
    unlogged: u64,
}

impl AcceptErrors {
    async fn handle(&mut self, e: io::Error) {
        if matches!(
            e.kind(),
            io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionRefused
        ) {
            return;
        }
        self.unlogged += 1;
        let now = Instant::now();
        if self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            tracing::error!(error = %e, count = self.unlogged, "accepting connections failed; retrying");
            self.last_log = Some(now);
            self.unlogged = 0;
        }
        tokio::time::sleep(ACCEPT_BACKOFF).await;
    }
}
