//! HTTP and WebSocket transport: routes, extractors and the mapping of engine results to responses.
//! Handlers stay thin: extract, call one engine function, map the result.

mod access;
mod cors;
mod errors;
mod extract;
mod federation;
mod headers;
mod http;
mod limits;
mod mcp;
pub mod openapi;
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

use sbp_protocol::federation::Role;

use crate::Gateway;

/// The gateway's routes behind, from the outside in: the access log (and request metrics), the
/// envelope for any error made below in plain text, the request policy (`Host`, `Origin`, path),
/// CORS when origins are configured (preflights answered there), the rate limits, operator
/// authentication. `bound` is the address the gateway listens on (a loopback one means its names
/// are known).
pub fn router(gateway: Gateway, bound: SocketAddr) -> Router {
    let max_body = gateway.config().max_body_bytes;
    let scheme = match gateway.config().edge.tls {
        Some(_) => "https",
        None => "http",
    };
    gateway.federation().bound(format!("{scheme}://{bound}"));
    let role = gateway.federation().role();
    let mut app = match role {
        // A tracker-only node hosts no sessions: no session, bundle or WebSocket routes.
        Some(Role::Tracker) => Router::new()
            .route("/healthz", get(http::healthz))
            .route("/metrics", get(http::metrics)),
        // Session routes refuse a session that moved away or is moving (`federation::guard`).
        Some(_) => session_routes(&gateway)
            .layer(from_fn_with_state(gateway.clone(), federation::guard))
            .route("/v1/sbp/bundles/{cid}", get(federation::bundle))
            .route("/v1/sbp/federation/tokens/redeem", post(federation::redeem))
            .route("/v1/sbp/federation/sessions/{id}", get(federation::locate))
            .route(
                "/v1/sbp/federation/sessions/{id}/handover",
                post(federation::handover),
            )
            .route(
                "/v1/sbp/federation/sessions/{id}/handover/{migration_id}/commit",
                post(federation::commit),
            )
            .route(
                "/v1/sbp/federation/sessions/{id}/handover/{migration_id}/abort",
                post(federation::abort),
            ),
        None => session_routes(&gateway),
    };
    if role.is_some() {
        app = app.route("/.well-known/sbp", get(federation::well_known));
    }
    if role.is_some_and(Role::hosts_registry) {
        app = app
            .route("/v1/sbp/registry", post(federation::announce))
            .route("/v1/sbp/registry/{cid}", get(federation::lookup))
            .route("/v1/sbp/registry/gateways", post(federation::register))
            .route(
                "/v1/sbp/registry/gateways/{gateway_id}",
                get(federation::vouch),
            );
    }
    let limits = Arc::new(limits::Limits::new(gateway.clone()));
    let policy = Arc::new(policy::Policy::new(gateway.config(), bound));
    let mut app = app
        .fallback(http::not_found)
        .method_not_allowed_fallback(http::method_not_allowed)
        .layer(from_fn_with_state(gateway.clone(), extract::operator_auth))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(from_fn_with_state(limits, limits::enforce));
    if let Some(cors) = cors::layer(gateway.config()) {
        app = app.layer(cors).layer(from_fn(cors::only_preflights));
    }
    app.layer(from_fn_with_state(policy, policy::enforce))
        .layer(from_fn(errors::envelope))
        .layer(from_fn_with_state(gateway.clone(), access::log))
        .with_state(gateway)
}

/// The routes of a gateway that hosts sessions (every role but tracker-only).
fn session_routes(gateway: &Gateway) -> Router<Gateway> {
    let mut app = Router::new()
        .route("/", get(page::index))
        .route("/assets/{file}", get(page::asset))
        .route("/healthz", get(http::healthz))
        .route("/metrics", get(http::metrics))
        .route("/openapi.json", get(openapi::serve))
        .route("/v1/chat/completions", post(http::chat_completions))
        .route("/v1/models", get(http::models))
        .route("/v1/models/{*id}", get(http::model))
        .route(
            "/v1/sessions",
            post(http::create_session).get(http::list_sessions),
        )
        .route(
            "/v1/sbp/sessions",
            post(http::create_session).get(http::list_sessions),
        )
        .route(
            "/v1/sessions/{id}",
            get(http::get_session).delete(http::delete_session),
        )
        .route(
            "/v1/sbp/sessions/{id}",
            get(http::get_session).delete(http::delete_session),
        )
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
    app.merge(mcp::routes(gateway.clone()))
}
