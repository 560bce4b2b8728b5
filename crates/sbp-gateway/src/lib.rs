//! The SBP gateway as a library: the engine (one service per concept: turns, sessions, surfaces,
//! tools, replicas, roaming) and its HTTP/WebSocket transport. `serve` runs it on an already-bound
//! listener until `shutdown` resolves.

pub mod auth;
pub mod config;
pub mod engine;
pub mod error;
pub mod limits;
pub mod metrics;
pub mod ratelimit;
pub mod transport;

pub use config::{CtpRule, GatewayConfig, PublicUrl, run_replica_id};
pub use engine::Gateway;
pub use engine::replicas::BusLink;
pub use engine::tools::ServerTools;
pub use error::Error;
pub use limits::Limits;
pub use ratelimit::{Rate, RateLimits};

use std::future::Future;

/// Serves the gateway on `listener` until `shutdown` completes, then stops background tasks and
/// waits for in-flight turns to finish persisting.
pub async fn serve(
    listener: tokio::net::TcpListener,
    gateway: Gateway,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt as _;
    let app = transport::router(gateway.clone(), listener.local_addr()?);
    let stop = gateway.shutdown_token();
    // Frames are small and often sent back to back (an ACK after a TURN_COMPLETE, a TOOL_RESULT
    // after a PONG): with Nagle on, the second waits for the peer's delayed ACK, up to 40 ms.
    let listener = listener.tap_io(|tcp| {
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(%err, "could not set TCP_NODELAY");
        }
    });
    // The peer's address reaches handlers as `ConnectInfo` (the rate limits are keyed by it).
    let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
    let result = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            tokio::select! {
                _ = shutdown => {}
                _ = stop.cancelled() => {}
            }
        })
        .await;
    gateway.shutdown().await;
    result
}
