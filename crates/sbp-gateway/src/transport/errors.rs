//! How a caller sees an engine [`Error`]: the one place that picks its HTTP status, its `SBP_*`
//! code, the envelope's `detail` and the headers it carries (SPEC 12.1:
//! `{"error":{"code":"SBP_...","message":...,"detail":...}}`).

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sbp_llm::LlmError;
use sbp_protocol::error::openai_type;
use sbp_protocol::{ErrorBody, ErrorCode, UpstreamError};
use serde_json::{Value, json};

use super::headers::{add_headers, session_headers};
use crate::error::{
    Error, FedError, RegistryRefusal, upstream_refused_credentials, upstream_status,
};
use crate::ratelimit::retry_after_secs;

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(status(&self)).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, axum::Json(body(&self))).into_response();
        match &self {
            Error::InTurn { session, .. } => {
                add_headers(resp.headers_mut(), &session_headers(session));
            }
            Error::RateLimited { retry_after, .. } => {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, retry_after_secs(*retry_after).into());
            }
            Error::Federation(FedError::TokenInvalid {
                reason: "missing", ..
            }) => {
                // RFC 6750 3.1: no error code when no credentials were sent.
                resp.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"sbp-federation\""),
                );
            }
            Error::Federation(FedError::TokenInvalid { message, .. }) => {
                // RFC 6750: the reason in `error_description` (quotes and controls dropped).
                let description: String = message
                    .chars()
                    .filter(|c| *c != '"' && *c != '\\' && !c.is_control())
                    .take(200)
                    .collect();
                let value = format!(
                    "Bearer realm=\"sbp-federation\", error=\"invalid_token\", error_description=\"{description}\""
                );
                if let Ok(v) = HeaderValue::from_str(&value) {
                    resp.headers_mut().insert(header::WWW_AUTHENTICATE, v);
                }
            }
            Error::Federation(FedError::SessionMoving { retry_after }) => {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(*retry_after));
            }
            Error::SessionEnded(_) => {
                // A 409 OpenAI's SDKs would retry twice, to the same answer.
                resp.headers_mut()
                    .insert("x-should-retry", HeaderValue::from_static("false"));
            }
            Error::SessionSuspended { session_id, .. } => {
                // OpenAI's SDKs obey this header over their own retry rules.
                let headers = resp.headers_mut();
                headers.insert("x-should-retry", HeaderValue::from_static("false"));
                if let Ok(v) = HeaderValue::from_str(&session_id.to_string()) {
                    headers.insert("x-session-id", v);
                }
            }
            Error::Federation(FedError::SessionBusy) => {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            Error::Federation(FedError::TokenReplayed) => {
                resp.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static(
                        "Bearer realm=\"sbp-federation\", error=\"invalid_token\", error_description=\"replayed\"",
                    ),
                );
            }
            _ => {}
        }
        if is_unavailable(&self) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// The envelope of an error response (also sent as an SSE event when a stream fails).
pub fn body(e: &Error) -> ErrorBody {
    let mut body = ErrorBody::new(code(e), e.to_string(), detail(e)).with_param(param(e));
    // The type of the status actually sent (an upstream's 404 is OpenAI's `not_found_error`).
    body.error.kind = Some(openai_type(status(e)).to_owned());
    match upstream_error(e) {
        // Its words would be the gateway's credentials' business: only its code goes out.
        Some(err) if upstream_refused_credentials(err) => {
            if let LlmError::Status { body: b, .. } = err {
                body.error.upstream_code = UpstreamError::from_body(b).code;
            }
            body
        }
        // An SDK prints `message`: the upstream's own words, its `type`, `param` and code.
        Some(LlmError::Status { body: b, .. }) => body.with_upstream(&UpstreamError::from_body(b)),
        _ => body,
    }
}

/// The upstream's failure behind an error.
fn upstream_error(e: &Error) -> Option<&LlmError> {
    match e {
        Error::Upstream(err) => Some(err),
        Error::InTurn { cause, .. } => upstream_error(cause),
        _ => None,
    }
}

/// The request field at fault, as OpenAI's `param`.
fn param(e: &Error) -> Option<String> {
    match e {
        Error::InvalidField { param, .. } => Some(param.clone()),
        Error::InTurn { cause, .. } => param(cause),
        _ => None,
    }
}

/// A routing error (no such endpoint, method not allowed): not the engine's.
pub fn routing(code: ErrorCode, message: &str) -> Response {
    let status = StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::NOT_FOUND);
    (status, axum::Json(ErrorBody::new(code, message, None))).into_response()
}

/// A WebSocket route reached by a request that is not a WebSocket handshake: a plain `GET` (or one
/// whose `Upgrade`/`Connection` headers are missing) is told to upgrade (426, `Upgrade: websocket`),
/// an unsupported version is told the one spoken (RFC 6455 4.4), anything else is malformed.
/// Why a request to the WebSocket route is not a handshake we can take.
#[derive(Debug, Clone, Copy)]
pub enum NotAWebSocket {
    NoUpgrade,
    Version,
    NotGet,
    Malformed,
}

pub fn not_a_websocket(refusal: NotAWebSocket) -> Response {
    let (code, message) = match refusal {
        NotAWebSocket::NoUpgrade => (
            ErrorCode::UpgradeRequired,
            "this endpoint is a WebSocket: send a WebSocket handshake (Upgrade: websocket)",
        ),
        NotAWebSocket::Version => (
            ErrorCode::UpgradeRequired,
            "unsupported WebSocket version: this endpoint speaks version 13",
        ),
        NotAWebSocket::NotGet => (
            ErrorCode::MethodNotAllowed,
            "a WebSocket handshake is a GET",
        ),
        NotAWebSocket::Malformed => (
            ErrorCode::BadRequest,
            "malformed WebSocket handshake (HTTP/1.1 and Sec-WebSocket-Key needed)",
        ),
    };
    let mut resp = routing(code, message);
    if code == ErrorCode::UpgradeRequired {
        let headers = resp.headers_mut();
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        headers.insert(
            header::SEC_WEBSOCKET_VERSION,
            HeaderValue::from_static("13"),
        );
    }
    resp
}

/// The last layer: an error response made below in anything but JSON (a rejection of axum's, the
/// MCP library's plain-text answers) gets the envelope, keeping its status and headers and, as its
/// message, its text. JSON errors (the envelope, MCP's JSON-RPC errors) pass untouched.
pub async fn envelope(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) || is_json(resp.headers()) {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let reason = status.canonical_reason().unwrap_or("error");
    let message = axum::body::to_bytes(body, 4096)
        .await
        .ok()
        .and_then(|b| String::from_utf8(b.to_vec()).ok())
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| reason.to_owned());
    let body = ErrorBody::new(code_for_status(status), message, None);
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(bytes))
}

fn is_json(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(super::extract::is_json_media_type)
}

/// The code of an error status no engine error gave.
fn code_for_status(status: StatusCode) -> ErrorCode {
    match status.as_u16() {
        401 => ErrorCode::Unauthorized,
        403 => ErrorCode::Forbidden,
        404 => ErrorCode::NotFound,
        405 => ErrorCode::MethodNotAllowed,
        406 => ErrorCode::NotAcceptable,
        413 => ErrorCode::PayloadTooLarge,
        415 => ErrorCode::UnsupportedMediaType,
        426 => ErrorCode::UpgradeRequired,
        429 => ErrorCode::RateLimited,
        503 => ErrorCode::Unavailable,
        500..=599 => ErrorCode::Internal,
        _ => ErrorCode::BadRequest,
    }
}

fn code(e: &Error) -> ErrorCode {
    match e {
        Error::Invalid(_) | Error::InvalidField { .. } => ErrorCode::BadRequest,
        Error::OverLimit { .. } => ErrorCode::PayloadTooLarge,
        Error::SessionFull { .. } => ErrorCode::SessionFull,
        Error::InvalidBundle { .. } => ErrorCode::BundleInvalid,
        Error::InvalidUuid(_) => ErrorCode::InvalidUuid,
        Error::Unauthorized(_) => ErrorCode::Unauthorized,
        Error::Forbidden(_) => ErrorCode::Forbidden,
        Error::SessionNotFound(_) => ErrorCode::SessionNotFound,
        Error::NotFound(_) => ErrorCode::NotFound,
        Error::TooLarge(_) => ErrorCode::PayloadTooLarge,
        Error::UnsupportedMediaType(_) => ErrorCode::UnsupportedMediaType,
        Error::RequestTimeout(_) => ErrorCode::RequestTimeout,
        Error::Unavailable(_) => ErrorCode::Unavailable,
        Error::Conflict(_) | Error::SessionEnded(_) => ErrorCode::SessionConflict,
        Error::SessionSuspended { .. } => ErrorCode::SessionSuspended,
        Error::IdempotencyKeyReused => ErrorCode::IdempotencyKeyReused,
        Error::TokenExpired { .. } => ErrorCode::TokenExpired,
        Error::TokenInvalid(_) => ErrorCode::TokenInvalid,
        Error::TokenConsumed => ErrorCode::TokenConsumed,
        Error::Integrity { .. } => ErrorCode::TokenIntegrity,
        Error::Upstream(LlmError::Unreachable(_)) => ErrorCode::UpstreamUnreachable,
        Error::Upstream(LlmError::Timeout) => ErrorCode::UpstreamTimeout,
        Error::Upstream(LlmError::Status { .. } | LlmError::Protocol(_)) => {
            ErrorCode::UpstreamError
        }
        Error::RateLimited { .. } => ErrorCode::RateLimited,
        Error::Federation(f) => fed_code(f),
        Error::Internal(_) => ErrorCode::Internal,
        Error::InTurn { cause, .. } => code(cause),
    }
}

fn fed_code(e: &FedError) -> ErrorCode {
    match e {
        FedError::TokenInvalid { .. } => ErrorCode::FederationTokenInvalid,
        FedError::TokenReplayed => ErrorCode::FederationReplay,
        FedError::Untrusted(_) => ErrorCode::FederationUntrusted,
        FedError::InvalidCid(_) => ErrorCode::InvalidCid,
        FedError::BundleCorrupt(_) => ErrorCode::BundleCorrupt,
        FedError::BundleUnavailable(_) => ErrorCode::BundleUnavailable,
        FedError::PeerUnreachable(_) => ErrorCode::PeerUnreachable,
        FedError::SessionMoving { .. } => ErrorCode::SessionMoving,
        FedError::SessionMoved { .. } => ErrorCode::SessionMoved,
        FedError::SessionBusy => ErrorCode::SessionBusy,
        FedError::LeaseExpired => ErrorCode::LeaseExpired,
        FedError::Registry { refusal, .. } => match refusal {
            RegistryRefusal::Invalid => ErrorCode::RegistryRecordInvalid,
            RegistryRefusal::Signature => ErrorCode::RegistrySignature,
            RegistryRefusal::NotOwner => ErrorCode::RegistryNotOwner,
            RegistryRefusal::Stale => ErrorCode::RegistryStale,
            RegistryRefusal::Quota => ErrorCode::RegistryQuota,
        },
    }
}

fn is_unavailable(e: &Error) -> bool {
    match e {
        Error::Unavailable(_) => true,
        Error::InTurn { cause, .. } => is_unavailable(cause),
        _ => false,
    }
}

fn status(e: &Error) -> u16 {
    match e {
        // The upstream's own error status is passed on.
        Error::Upstream(LlmError::Status { status, .. }) => upstream_status(*status),
        Error::InTurn { cause, .. } => status(cause),
        other => code(other).http_status(),
    }
}

/// Longest upstream error body an envelope carries whole.
const MAX_SHOWN_UPSTREAM_BODY: usize = 16 << 10;

/// An upstream's error body as an envelope shows it: whole when short; else its text cut at
/// [`MAX_SHOWN_UPSTREAM_BODY`] bytes (a server may quote a whole request back, and every client
/// of a failing upstream would be sent it), its message, type and code being in the envelope
/// already.
fn shown_upstream_body(body: &Value) -> Value {
    let text = match body {
        Value::String(text) => std::borrow::Cow::Borrowed(text.as_str()),
        other => std::borrow::Cow::Owned(other.to_string()),
    };
    if text.len() <= MAX_SHOWN_UPSTREAM_BODY {
        return body.clone();
    }
    let mut end = MAX_SHOWN_UPSTREAM_BODY;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Value::String(format!("{}…", &text[..end]))
}

fn detail(e: &Error) -> Option<Value> {
    match e {
        Error::TokenExpired { expired_at } => Some(json!({ "expired_at": expired_at })),
        Error::Integrity {
            mismatch: Some((claimed, computed)),
            ..
        } => Some(json!({ "claimed": claimed, "computed": computed })),
        Error::Upstream(e @ LlmError::Status { body, .. }) if !upstream_refused_credentials(e) => {
            Some(json!({ "upstream": shown_upstream_body(body) }))
        }
        Error::RateLimited { limit, retry_after } => Some(json!({
            "limit": limit.as_str(),
            "retry_after": retry_after_secs(*retry_after),
        })),
        Error::OverLimit { limit, max, .. } => Some(json!({ "limit": limit.name(), "max": max })),
        Error::SessionFull {
            session_id,
            limit,
            max,
            ..
        } => Some(json!({
            "session_id": session_id,
            "limit": limit.name(),
            "max": max,
            "continue_with": format!("POST /v1/sbp/sessions/{session_id}/fork {{\"keep_last\": N}}"),
        })),
        Error::InvalidBundle { path, .. } => Some(json!({ "path": path })),
        Error::SessionSuspended { session_id, .. } => Some(json!({
            "session_id": session_id,
            "resume_with": {"sbp": {"resume": true}},
            "auto_resume_header": "X-SBP-Auto-Resume: true",
        })),
        Error::Federation(FedError::SessionMoved {
            gateway_id,
            gateway_url,
        }) => Some(json!({ "gateway_id": gateway_id, "gateway_url": gateway_url })),
        Error::Federation(FedError::SessionMoving { retry_after }) => {
            Some(json!({ "retry_after": retry_after }))
        }
        Error::InTurn { session, cause } => {
            let mut detail = detail(cause).unwrap_or_else(|| json!({}));
            if let Some(obj) = detail.as_object_mut() {
                obj.insert("session_id".into(), json!(session.id));
            }
            Some(detail)
        }
        _ => None,
    }
}
