//! The HTTP/1.1 upgrade to WebSocket (RFC 6455 §4.2), done here rather than by axum's extractor so
//! the connection task owns the raw byte stream under tungstenite (`wire.rs`): frame counting and
//! the closing handshake need it. A request that is not a valid upgrade gets the error envelope.

use axum::extract::FromRequestParts;
use axum::response::Response;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Method, StatusCode, Version, header};
use hyper::upgrade::OnUpgrade;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

use super::super::errors::NotAWebSocket;

/// A valid upgrade request: its key and the connection to take over once answered.
pub struct WsUpgrade {
    key: HeaderValue,
    on_upgrade: OnUpgrade,
}

impl<S: Send + Sync> FromRequestParts<S> for WsUpgrade {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let refuse = super::super::errors::not_a_websocket;
        if parts.method != Method::GET {
            return Err(refuse(NotAWebSocket::NotGet));
        }
        if !has_token(&parts.headers, header::CONNECTION, "upgrade")
            || !has_token(&parts.headers, header::UPGRADE, "websocket")
        {
            return Err(refuse(NotAWebSocket::NoUpgrade));
        }
        if parts.version != Version::HTTP_11 {
            return Err(refuse(NotAWebSocket::Malformed));
        }
        if parts
            .headers
            .get(header::SEC_WEBSOCKET_VERSION)
            .is_none_or(|v| v.as_bytes() != b"13")
        {
            // RFC 6455 §4.4: 426 naming the versions we speak.
            return Err(refuse(NotAWebSocket::Version));
        }
        let Some(key) = parts.headers.get(header::SEC_WEBSOCKET_KEY).cloned() else {
            return Err(refuse(NotAWebSocket::Malformed));
        };
        let Some(on_upgrade) = parts.extensions.remove::<OnUpgrade>() else {
            return Err(refuse(NotAWebSocket::Malformed));
        };
        Ok(Self { key, on_upgrade })
    }
}

impl WsUpgrade {
    /// The 101 answer, and the connection once the client has it.
    pub fn accept(self) -> (Response, OnUpgrade) {
        let accept = derive_accept_key(self.key.as_bytes());
        let mut resp = Response::new(axum::body::Body::empty());
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let headers = resp.headers_mut();
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        if let Ok(v) = HeaderValue::from_str(&accept) {
            headers.insert(header::SEC_WEBSOCKET_ACCEPT, v);
        }
        (resp, self.on_upgrade)
    }
}

/// Whether header `name` lists `token` (comma-separated, case-insensitive).
fn has_token(headers: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers.get_all(name).iter().any(|v| {
        v.to_str()
            .is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    })
}
