//! The SBP gateway as a library: the engine (sessions, turns, tether, attached surfaces) and its
//! HTTP/WebSocket transport. `serve` runs it on an already-bound listener until `shutdown` resolves.

pub mod auth;
pub mod config;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod transport;

pub use config::{CtpRule, GatewayConfig, run_replica_id};
pub use engine::{BusLink, Gateway};
pub use error::ApiError;

use std::future::Future;

/// Serves the gateway on `listener` until `shutdown` completes, then stops background tasks and
/// waits for in-flight turns to finish persisting.
pub async fn serve(
    listener: tokio::net::TcpListener,
    gateway: Gateway,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = transport::router(gateway.clone());
    let stop = gateway.shutdown_token();
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
