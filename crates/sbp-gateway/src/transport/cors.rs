//! CORS for web apps served from other origins (`--cors-origin`, off by default): a page of such
//! an origin may call the API with `fetch`, its headers included, and read the answers and the
//! headers the gateway sends besides them (the session's id and token, a replay's mark).
//!
//! Preflights (`OPTIONS` with `Access-Control-Request-Method`) are answered here, before the rate
//! limits and the operator key: a browser sends them without credentials. Other origins never get
//! this far: the request policy (`policy.rs`) refuses them with 403, preflights included. No
//! `Access-Control-Allow-Credentials`: the API authenticates with headers the app sets itself
//! (`Authorization`, `X-Session-Token`), never with cookies. The browser page at `/` is not
//! affected: its Content-Security-Policy (`page.rs`) stays `'self'`.

use std::time::Duration;

use axum::http::{HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::config::{GatewayConfig, PublicUrl};

/// The request headers of the API, beyond the CORS-safelisted ones.
const ALLOWED_HEADERS: [&str; 8] = [
    "authorization",
    "content-type",
    "x-session-token",
    "x-agent-id",
    "idempotency-key",
    "x-sbp-auto-resume",
    "x-request-id",
    "mcp-protocol-version",
];

/// The response headers a page may read, beyond the CORS-safelisted ones.
const EXPOSED_HEADERS: [&str; 6] = [
    "x-session-id",
    "x-agent-id",
    "x-session-token",
    "idempotent-replayed",
    "x-request-id",
    "retry-after",
];

/// How long a browser may keep a preflight's answer.
const MAX_AGE: Duration = Duration::from_secs(600);

/// The CORS layer for the configured origins; none when there are none.
pub fn layer(config: &GatewayConfig) -> Option<CorsLayer> {
    if config.cors_origins.is_empty() {
        return None;
    }
    let origins = config.cors_origins.clone();
    let allowed = move |origin: &HeaderValue, _: &axum::http::request::Parts| {
        origin
            .to_str()
            .ok()
            .and_then(|o| o.parse::<PublicUrl>().ok())
            .is_some_and(|o| origins.iter().any(|allowed| allowed.same_origin(&o)))
    };
    Some(
        CorsLayer::new()
            .allow_origin(AllowOrigin::predicate(allowed))
            .allow_methods([
                Method::GET,
                Method::POST,
                Method::PUT,
                Method::PATCH,
                Method::DELETE,
            ])
            .allow_headers(ALLOWED_HEADERS.map(HeaderName::from_static))
            .expose_headers(EXPOSED_HEADERS.map(HeaderName::from_static))
            .max_age(MAX_AGE),
    )
}

/// Outside the CORS layer, which answers every `OPTIONS` as a preflight: an `OPTIONS` that is not
/// one (no `Access-Control-Request-Method`) gets the 405 it gets without CORS, through the rate
/// limits like any request.
pub async fn only_preflights(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let preflight = req.headers().contains_key("access-control-request-method");
    if req.method() == Method::OPTIONS && !preflight {
        return super::http::method_not_allowed().await;
    }
    next.run(req).await
}
