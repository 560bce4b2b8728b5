//! HTTP and WebSocket transport: routes, extractors and the mapping of engine results to responses.
//! Handlers stay thin: extract, call one engine function, map the result.

mod errors;
mod extract;
mod headers;
mod http;
mod limits;
mod mcp;
mod page;
mod policy;
mod requests;
mod roaming;
mod to_wire;
mod tools;
mod ws;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::routing::{get, patch, post};

use crate::Gateway;

/// The gateway's routes behind, from the outside in: the envelope for any error made below in
/// plain text, the request policy (`Host`, `Origin`, path), the rate limits, operator
/// authentication. `bound` is the address the gateway listens on (a loopback one means its names
/// are known).
pub fn router(gateway: Gateway, bound: SocketAddr) -> Router {
    let max_body = gateway.config().max_body_bytes;
    let mut app = Router::new()
        .route("/", get(page::index))
        .route("/assets/{file}", get(page::asset))
        .route("/healthz", get(http::healthz))
        .route("/metrics", get(http::metrics))
        .route("/v1/chat/completions", post(http::chat_completions))
        .route("/v1/sessions", post(http::create_session))
        .route("/v1/sbp/sessions", post(http::create_session))
        .route("/v1/sessions/{id}", get(http::get_session))
        .route("/v1/sbp/sessions/{id}", get(http::get_session))
        .route("/v1/sessions/{id}/messages", get(http::list_messages))
        .route("/v1/sbp/sessions/{id}/messages", get(http::list_messages))
        .route(
            "/v1/sbp/sessions/{id}/status",
            patch(http::set_status).post(http::set_status),
        )
        .route("/v1/sbp/sessions/{id}/snapshots", get(http::list_snapshots))
        .route(
            "/v1/sbp/sessions/{id}/snapshots/latest",
            get(http::latest_snapshot),
        )
        .route("/v1/sbp/sessions/{id}/turns", post(http::push_turn))
        .route("/v1/sbp/sessions/import", post(roaming::import))
        .route("/v1/sbp/sessions/{id}/export", post(roaming::export))
        .route("/v1/sbp/sessions/{id}/handoff", post(roaming::handoff))
        .route("/v1/sbp/sessions/{id}/fork", post(roaming::fork))
        .route("/v1/sbp/sessions/{id}/exports", get(roaming::exports))
        .route("/v1/sbp/sessions/{id}/lineage", get(roaming::lineage))
        .route(
            "/v1/sbp/sessions/{id}/memory",
            get(roaming::get_memory).put(roaming::put_memory),
        )
        .route("/v1/sbp/sessions/{id}/tool_calls", post(tools::call))
        .route("/v1/sbp/token/{token}", get(roaming::inspect_token))
        .route("/v1/sbp/ws/{id}", get(ws::upgrade));
    if gateway.config().enable_test_hooks {
        app = app.route(
            "/v1/sbp/sessions/{id}/_test/tether",
            post(http::test_tether),
        );
    }
    app = app.merge(mcp::routes(gateway.clone()));
    let limits = Arc::new(limits::Limits::new(gateway.clone()));
    let policy = Arc::new(policy::Policy::new(gateway.config(), bound));
    app.fallback(http::not_found)
        .method_not_allowed_fallback(http::method_not_allowed)
        .layer(from_fn_with_state(gateway.clone(), extract::operator_auth))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(from_fn_with_state(limits, limits::enforce))
        .layer(from_fn_with_state(policy, policy::enforce))
        .layer(from_fn(errors::envelope))
        .with_state(gateway)
}
