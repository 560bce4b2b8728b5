//! The rate limits the transport applies before a request is handled: per operator key for
//! requests carrying a valid one, per client address for every other request, and a stricter
//! count of failed authentications per address (a 401 or 403 answer to a request that presented a
//! credential, `X-Session-Token` or `Authorization`: a request without one guesses nothing), which,
//! once exhausted, refuses every request from that address until it refills. Loopback clients are
//! counted like any other; `/healthz` is not counted (a load balancer's probe must not be the first
//! thing refused). The per-session limit is the engine's (`Sessions::admit`), applied once a caller
//! is authorised.
//!
//! A refusal is `429` with `Retry-After` and the envelope code `SBP_RATE_LIMITED`, counted in
//! `sbp_rate_limited_total{limit}`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::extract::bearer;
use crate::Gateway;
use crate::auth::api_key_index;
use crate::error::Error;
use crate::ratelimit::{Limit, Limiter, Strikes, address_key};

pub struct Limits {
    gateway: Gateway,
    address: Option<Limiter<IpAddr>>,
    operator_key: Option<Limiter<usize>>,
    failures: Option<Strikes<IpAddr>>,
    keys: Vec<String>,
}

impl Limits {
    pub fn new(gateway: Gateway) -> Self {
        let config = gateway.config();
        let limits = &config.rate_limits;
        Self {
            address: limits.address.map(Limiter::new),
            operator_key: limits.operator_key.map(Limiter::new),
            failures: limits.auth_failures.map(Strikes::new),
            keys: config.api_keys.clone(),
            gateway,
        }
    }

    /// Which bucket `req` is counted in, and whether it has a token.
    fn admit(&self, req: &Request, ip: Option<IpAddr>) -> Result<(), Error> {
        let refuse = |limit| {
            move |retry_after| {
                self.gateway.metrics().count_rate_limited(limit);
                Error::RateLimited { limit, retry_after }
            }
        };
        if let (Some(failures), Some(ip)) = (&self.failures, ip) {
            failures.admit(&ip).map_err(refuse(Limit::AuthFailures))?;
        }
        let key = bearer(req.headers()).and_then(|k| api_key_index(&k, &self.keys));
        match (key, ip) {
            (Some(key), _) => match &self.operator_key {
                Some(l) => l.check(&key).map_err(refuse(Limit::OperatorKey)),
                None => Ok(()),
            },
            (None, Some(ip)) => match &self.address {
                Some(l) => l.check(&ip).map_err(refuse(Limit::Address)),
                None => Ok(()),
            },
            // Served without the peer's address (not through `serve`): nothing to key on.
            (None, None) => Ok(()),
        }
    }
}

/// Marks a 401/403 that does not count against the caller's address (`--rate-limit-auth-failures`).
#[derive(Debug, Clone, Copy)]
pub struct NotTheCallersFailure;

pub async fn enforce(State(limits): State<Arc<Limits>>, req: Request, next: Next) -> Response {
    if req.uri().path() == "/healthz" {
        return next.run(req).await;
    }
    let ip = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| address_key(c.0.ip()));
    if let Err(e) = limits.admit(&req, ip) {
        return e.into_response();
    }
    let credentials = req.headers().contains_key("x-session-token")
        || req.headers().contains_key(header::AUTHORIZATION);
    let resp = next.run(req).await;
    // A handover refused for the surface's session token, asked by an authenticated peer, is
    // the surface's failure, not the peer's: it must not get the peer's address blocked here.
    let failed = matches!(
        resp.status(),
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
    ) && resp.extensions().get::<NotTheCallersFailure>().is_none();
    if credentials
        && failed
        && let (Some(failures), Some(ip)) = (&limits.failures, ip)
    {
        failures.strike(&ip);
    }
    resp
}
