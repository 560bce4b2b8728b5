//! The SBP gateway as a library: the engine (one service per concept: turns, sessions, surfaces,
//! tools, replicas, roaming) and its HTTP/WebSocket transport. `serve` runs it on an already-bound
//! listener until `shutdown` resolves.

pub mod auth;
pub mod config;
mod edge;
pub mod engine;
pub mod error;
pub mod federation;
pub mod limits;
pub mod metrics;
pub mod ratelimit;
pub mod transport;

pub use config::{CtpRule, EdgeConfig, GatewayConfig, PublicUrl, TlsFiles, run_replica_id};
pub use edge::{TlsError, check_tls};
pub use engine::Gateway;
pub use engine::replicas::BusLink;
pub use engine::tools::ServerTools;
pub use error::Error;
pub use limits::Limits;
pub use ratelimit::{Rate, RateLimits};

use std::future::Future;

/// Serves the gateway on `listener` until `shutdown` completes (or the gateway stops): every
/// connection under the limits of `config.edge` (timeouts, connection caps; see `edge/`). Then
/// stops accepting, lets requests in flight finish, closes surfaces (1001) and waits for turns to
/// persist, for at most `config.shutdown_grace`: past it, turns still running are failed (their
/// idempotency keys retryable), remaining connections are closed, and this returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    gateway: Gateway,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    edge::serve(listener, gateway, shutdown).await
}
