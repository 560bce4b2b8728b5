//! How a caller sees an engine [`Error`]: the one place that picks its HTTP status, its `SBP_*`
//! code, the envelope's `detail` and the headers it carries (SPEC 12.1:
//! `{"error":{"code":"SBP_...","message":...,"detail":...}}`).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sbp_llm::LlmError;
use sbp_protocol::{ErrorBody, ErrorCode};
use serde_json::{Value, json};

use super::headers::{add_headers, session_headers};
use crate::error::{Error, upstream_status};

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(status(&self)).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, axum::Json(body(&self))).into_response();
        if let Error::InTurn { session, .. } = &self {
            add_headers(resp.headers_mut(), &session_headers(session));
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
    ErrorBody::new(code(e), e.to_string(), detail(e))
}

/// A routing error (no such endpoint, method not allowed): not the engine's.
pub fn routing(code: ErrorCode, message: &str) -> Response {
    let status = StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::NOT_FOUND);
    (status, axum::Json(ErrorBody::new(code, message, None))).into_response()
}

fn code(e: &Error) -> ErrorCode {
    match e {
        Error::Invalid(_) => ErrorCode::BadRequest,
        Error::InvalidUuid(_) => ErrorCode::InvalidUuid,
        Error::Unauthorized(_) => ErrorCode::Unauthorized,
        Error::Forbidden(_) => ErrorCode::Forbidden,
        Error::SessionNotFound(_) => ErrorCode::SessionNotFound,
        Error::NotFound(_) => ErrorCode::NotFound,
        Error::TooLarge(_) => ErrorCode::PayloadTooLarge,
        Error::RequestTimeout(_) => ErrorCode::RequestTimeout,
        Error::Unavailable(_) => ErrorCode::Unavailable,
        Error::Conflict(_) => ErrorCode::SessionConflict,
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
        Error::Internal(_) => ErrorCode::Internal,
        Error::InTurn { cause, .. } => code(cause),
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

fn detail(e: &Error) -> Option<Value> {
    match e {
        Error::TokenExpired { expired_at } => Some(json!({ "expired_at": expired_at })),
        Error::Integrity {
            mismatch: Some((claimed, computed)),
            ..
        } => Some(json!({ "claimed": claimed, "computed": computed })),
        Error::Upstream(LlmError::Status { body, .. }) => Some(json!({ "upstream": body })),
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
