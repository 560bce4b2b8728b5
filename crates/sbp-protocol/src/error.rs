//! The error envelope of SPEC 12.1 (`{"error":{"code":"SBP_...","message":...,"detail":...}}`) and the
//! codes this gateway uses, each with its HTTP status.

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    SessionNotFound,
    TokenExpired,
    TokenConsumed,
    TokenInvalid,
    TokenIntegrity,
    InvalidUuid,
    SessionConflict,
    Internal,
    // Codes beyond the spec's table, in the same `SBP_` namespace.
    BadRequest,
    Unauthorized,
    Forbidden,
    NotFound,
    MethodNotAllowed,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
    NotAcceptable,
    UpgradeRequired,
    RateLimited,
    IdempotencyKeyReused,
    UpstreamUnreachable,
    UpstreamTimeout,
    UpstreamError,
    Unavailable,
    /// The session's transcript is at its configured size limit.
    SessionFull,
    /// An imported bundle's content is not of the right type or range.
    BundleInvalid,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SessionNotFound => "SBP_SESSION_NOT_FOUND",
            Self::TokenExpired => "SBP_TOKEN_EXPIRED",
            Self::TokenConsumed => "SBP_TOKEN_CONSUMED",
            Self::TokenInvalid => "SBP_TOKEN_INVALID",
            Self::TokenIntegrity => "SBP_TOKEN_INTEGRITY",
            Self::InvalidUuid => "SBP_INVALID_UUID",
            Self::SessionConflict => "SBP_SESSION_CONFLICT",
            Self::Internal => "SBP_INTERNAL",
            Self::BadRequest => "SBP_BAD_REQUEST",
            Self::Unauthorized => "SBP_UNAUTHORIZED",
            Self::Forbidden => "SBP_FORBIDDEN",
            Self::NotFound => "SBP_NOT_FOUND",
            Self::MethodNotAllowed => "SBP_METHOD_NOT_ALLOWED",
            Self::PayloadTooLarge => "SBP_PAYLOAD_TOO_LARGE",
            Self::RequestTimeout => "SBP_REQUEST_TIMEOUT",
            Self::UnsupportedMediaType => "SBP_UNSUPPORTED_MEDIA_TYPE",
            Self::NotAcceptable => "SBP_NOT_ACCEPTABLE",
            Self::UpgradeRequired => "SBP_UPGRADE_REQUIRED",
            Self::RateLimited => "SBP_RATE_LIMITED",
            Self::IdempotencyKeyReused => "SBP_IDEMPOTENCY_KEY_REUSED",
            Self::UpstreamUnreachable => "SBP_UPSTREAM_UNREACHABLE",
            Self::UpstreamTimeout => "SBP_UPSTREAM_TIMEOUT",
            Self::UpstreamError => "SBP_UPSTREAM_ERROR",
            Self::Unavailable => "SBP_UNAVAILABLE",
            Self::SessionFull => "SBP_SESSION_FULL",
            Self::BundleInvalid => "SBP_BUNDLE_INVALID",
        }
    }

    /// The status for this code. `UpstreamError` passes the upstream's own status on instead.
    pub fn http_status(self) -> u16 {
        match self {
            Self::SessionNotFound | Self::NotFound => 404,
            Self::TokenExpired | Self::TokenConsumed => 410,
            Self::TokenInvalid
            | Self::TokenIntegrity
            | Self::InvalidUuid
            | Self::IdempotencyKeyReused
            | Self::SessionFull
            | Self::BundleInvalid => 422,
            Self::SessionConflict => 409,
            Self::Internal => 500,
            Self::BadRequest => 400,
            Self::Unauthorized => 401,
            Self::Forbidden => 403,
            Self::MethodNotAllowed => 405,
            Self::PayloadTooLarge => 413,
            Self::RequestTimeout => 408,
            Self::UnsupportedMediaType => 415,
            Self::NotAcceptable => 406,
            Self::UpgradeRequired => 426,
            Self::RateLimited => 429,
            Self::UpstreamUnreachable | Self::UpstreamError => 502,
            Self::UpstreamTimeout => 504,
            Self::Unavailable => 503,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
    /// The request field at fault, as OpenAI's errors name it (`messages[3].role`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<Value>,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>, detail: Option<Value>) -> Self {
        Self {
            error: ErrorDetail {
                code: code.as_str().to_owned(),
                message: message.into(),
                param: None,
                detail,
            },
        }
    }

    /// The envelope naming the request field at fault.
    pub fn with_param(mut self, param: Option<String>) -> Self {
        self.error.param = param;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_table_statuses() {
        for (code, name, status) in [
            (ErrorCode::SessionNotFound, "SBP_SESSION_NOT_FOUND", 404),
            (ErrorCode::TokenExpired, "SBP_TOKEN_EXPIRED", 410),
            (ErrorCode::TokenConsumed, "SBP_TOKEN_CONSUMED", 410),
            (ErrorCode::TokenInvalid, "SBP_TOKEN_INVALID", 422),
            (ErrorCode::TokenIntegrity, "SBP_TOKEN_INTEGRITY", 422),
            (ErrorCode::InvalidUuid, "SBP_INVALID_UUID", 422),
            (ErrorCode::SessionConflict, "SBP_SESSION_CONFLICT", 409),
            (ErrorCode::Internal, "SBP_INTERNAL", 500),
        ] {
            assert_eq!(code.as_str(), name);
            assert_eq!(code.http_status(), status);
        }
    }

    #[test]
    fn envelope_shape() {
        let body = ErrorBody::new(ErrorCode::InvalidUuid, "bad id", None);
        let v = serde_json::to_value(&body).expect("serialises");
        assert_eq!(
            v,
            serde_json::json!({"error": {"code": "SBP_INVALID_UUID", "message": "bad id"}})
        );
    }
}
