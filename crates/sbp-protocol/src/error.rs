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
    /// A turn for a suspended session from a caller that sent no `sbp` object (an OpenAI SDK):
    /// refused with a status those SDKs raise and do not retry.
    SessionSuspended,
    // Federation (L6).
    /// The session is being handed over to another gateway right now.
    SessionMoving,
    /// The session lives on another gateway now.
    SessionMoved,
    /// The session is held by another holder (a handover or attach in progress elsewhere).
    SessionBusy,
    /// The handover lease ran out before the commit.
    LeaseExpired,
    FederationTokenInvalid,
    /// A federation token's `jti` was already used.
    FederationReplay,
    /// A valid federation token from an issuer this node does not trust.
    FederationUntrusted,
    /// A bundle CID that is not 64 lowercase hex characters.
    InvalidCid,
    /// A stored bundle no longer matches its CID: never served.
    BundleCorrupt,
    /// Every provider of a bundle served bytes that do not match its CID.
    BundleUnavailable,
    /// The peer gateway could not be reached.
    PeerUnreachable,
    RegistryRecordInvalid,
    RegistrySignature,
    /// A gateway announced a record for a URL whose manifest is not its own.
    RegistryNotOwner,
    /// A record's `seq` is lower than the one the tracker holds.
    RegistryStale,
    RegistryQuota,
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
            Self::SessionSuspended => "SBP_SESSION_SUSPENDED",
            Self::SessionMoving => "SBP_SESSION_MOVING",
            Self::SessionMoved => "SBP_SESSION_MOVED",
            Self::SessionBusy => "SBP_SESSION_BUSY",
            Self::LeaseExpired => "SBP_SESSION_LEASE_EXPIRED",
            Self::FederationTokenInvalid => "SBP_FEDERATION_TOKEN_INVALID",
            Self::FederationReplay => "SBP_FEDERATION_TOKEN_REPLAYED",
            Self::FederationUntrusted => "SBP_FEDERATION_UNTRUSTED",
            Self::InvalidCid => "SBP_INVALID_CID",
            Self::BundleCorrupt => "SBP_BUNDLE_CORRUPT",
            Self::BundleUnavailable => "SBP_BUNDLE_UNAVAILABLE",
            Self::PeerUnreachable => "SBP_PEER_UNREACHABLE",
            Self::RegistryRecordInvalid => "SBP_REGISTRY_RECORD_INVALID",
            Self::RegistrySignature => "SBP_REGISTRY_SIGNATURE",
            Self::RegistryNotOwner => "SBP_REGISTRY_NOT_OWNER",
            Self::RegistryStale => "SBP_REGISTRY_STALE",
            Self::RegistryQuota => "SBP_REGISTRY_QUOTA",
        }
    }

    /// The `type` OpenAI's clients read beside the code, as OpenAI names its own.
    pub fn openai_type(self) -> &'static str {
        openai_type(self.http_status())
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
            | Self::BundleInvalid
            | Self::InvalidCid => 422,
            Self::SessionConflict
            | Self::SessionMoving
            | Self::SessionMoved
            | Self::SessionBusy
            | Self::LeaseExpired
            | Self::RegistryStale => 409,
            Self::Internal | Self::BundleCorrupt => 500,
            Self::BadRequest | Self::RegistryRecordInvalid => 400,
            Self::Unauthorized
            | Self::FederationTokenInvalid
            | Self::FederationReplay
            | Self::RegistrySignature => 401,
            Self::Forbidden | Self::FederationUntrusted | Self::RegistryNotOwner => 403,
            Self::MethodNotAllowed => 405,
            Self::PayloadTooLarge => 413,
            Self::RequestTimeout => 408,
            Self::UnsupportedMediaType => 415,
            Self::NotAcceptable => 406,
            Self::UpgradeRequired => 426,
            // Not 409 (nor 429 or 5xx): OpenAI's SDKs retry those by default, and a retry cannot
            // change a suspended session.
            Self::SessionSuspended => 423,
            Self::RateLimited | Self::RegistryQuota => 429,
            Self::UpstreamUnreachable | Self::UpstreamError | Self::BundleUnavailable => 502,
            Self::UpstreamTimeout => 504,
            Self::Unavailable | Self::PeerUnreachable => 503,
        }
    }
}

/// The `type` of an error answered with `status`, as OpenAI names its own.
pub fn openai_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        429 => "rate_limit_error",
        502 => "upstream_error",
        503 => "service_unavailable_error",
        500..=599 => "server_error",
        _ => "invalid_request_error",
    }
}

/// The envelope of every error answer (SPEC 12.1).
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// An `SBP_*` code: SPEC 12.1's, or one of this gateway's in the same namespace.
    pub code: String,
    /// What happened, for a person.
    pub message: String,
    /// OpenAI's error `type` (`invalid_request_error`, ...): the upstream's own for its errors.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The request field at fault, as OpenAI's errors name it (`messages[3].role`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param: Option<String>,
    /// The upstream's own error code (`model_not_found`), for an upstream error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_code: Option<Value>,
    /// Facts about the error a program can use (a rate limit's `retry_after`, the gateway a
    /// session moved to, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<Value>,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>, detail: Option<Value>) -> Self {
        Self {
            error: ErrorDetail {
                code: code.as_str().to_owned(),
                message: message.into(),
                kind: Some(code.openai_type().to_owned()),
                param: None,
                upstream_code: None,
                detail,
            },
        }
    }

    /// The envelope naming the request field at fault.
    pub fn with_param(mut self, param: Option<String>) -> Self {
        self.error.param = param;
        self
    }

    /// The envelope of an upstream's error: its own message, `type`, `param` and code where it
    /// sent them (the gateway's stay where it sent none).
    pub fn with_upstream(mut self, upstream: &UpstreamError) -> Self {
        if let Some(m) = &upstream.message {
            self.error.message = m.clone();
        }
        if let Some(t) = &upstream.kind {
            self.error.kind = Some(t.clone());
        }
        if upstream.param.is_some() {
            self.error.param = upstream.param.clone();
        }
        self.error.upstream_code = upstream.code.clone();
        self
    }
}

/// What an upstream's error body says, in OpenAI's shape (`{"error":{"message","type","param",
/// "code"}}`) or Anthropic's (`{"type":"error","error":{"type","message"}}`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpstreamError {
    pub message: Option<String>,
    pub kind: Option<String>,
    pub param: Option<String>,
    /// A string or a number, as the upstream sent it.
    pub code: Option<Value>,
}

impl UpstreamError {
    /// Reads an upstream's error body; fields of the wrong type (or too long) are left out.
    pub fn from_body(body: &Value) -> Self {
        let Some(err) = body
            .get("error")
            .or_else(|| body.get("type").and(Some(body)))
        else {
            return Self::default();
        };
        let text = |key: &str, max: usize| {
            err.get(key)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(|s| s.chars().take(max).collect::<String>())
        };
        // A bare string error (`{"error": "..."}`) is its message.
        let message = match err {
            Value::String(s) if !s.is_empty() => Some(s.chars().take(2000).collect()),
            _ => text("message", 2000),
        };
        let code = match err.get("code") {
            Some(Value::String(s)) if !s.is_empty() => {
                Some(Value::String(s.chars().take(200).collect()))
            }
            Some(n @ Value::Number(_)) => Some(n.clone()),
            _ => None,
        };
        Self {
            message,
            kind: text("type", 200).filter(|t| t != "error"),
            param: text("param", 200),
            code,
        }
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
    fn federation_codes() {
        for (code, name, status) in [
            (ErrorCode::SessionMoving, "SBP_SESSION_MOVING", 409),
            (ErrorCode::SessionMoved, "SBP_SESSION_MOVED", 409),
            (ErrorCode::SessionBusy, "SBP_SESSION_BUSY", 409),
            (ErrorCode::LeaseExpired, "SBP_SESSION_LEASE_EXPIRED", 409),
            (
                ErrorCode::FederationTokenInvalid,
                "SBP_FEDERATION_TOKEN_INVALID",
                401,
            ),
            (
                ErrorCode::FederationReplay,
                "SBP_FEDERATION_TOKEN_REPLAYED",
                401,
            ),
            (
                ErrorCode::FederationUntrusted,
                "SBP_FEDERATION_UNTRUSTED",
                403,
            ),
            (ErrorCode::InvalidCid, "SBP_INVALID_CID", 422),
            (ErrorCode::BundleCorrupt, "SBP_BUNDLE_CORRUPT", 500),
            (ErrorCode::BundleUnavailable, "SBP_BUNDLE_UNAVAILABLE", 502),
            (ErrorCode::PeerUnreachable, "SBP_PEER_UNREACHABLE", 503),
            (
                ErrorCode::RegistryRecordInvalid,
                "SBP_REGISTRY_RECORD_INVALID",
                400,
            ),
            (ErrorCode::RegistrySignature, "SBP_REGISTRY_SIGNATURE", 401),
            (ErrorCode::RegistryNotOwner, "SBP_REGISTRY_NOT_OWNER", 403),
            (ErrorCode::RegistryStale, "SBP_REGISTRY_STALE", 409),
            (ErrorCode::RegistryQuota, "SBP_REGISTRY_QUOTA", 429),
        ] {
            assert_eq!(code.as_str(), name);
            assert_eq!(code.http_status(), status, "{name}");
        }
    }

    #[test]
    fn envelope_shape() {
        let body = ErrorBody::new(ErrorCode::InvalidUuid, "bad id", None);
        let v = serde_json::to_value(&body).expect("serialises");
        assert_eq!(
            v,
            serde_json::json!({"error": {"code": "SBP_INVALID_UUID", "message": "bad id",
                "type": "invalid_request_error"}})
        );
    }

    #[test]
    fn openai_types_follow_the_status() {
        for (code, kind) in [
            (ErrorCode::BadRequest, "invalid_request_error"),
            (ErrorCode::Unauthorized, "authentication_error"),
            (ErrorCode::Forbidden, "permission_error"),
            (ErrorCode::SessionNotFound, "not_found_error"),
            (ErrorCode::RateLimited, "rate_limit_error"),
            (ErrorCode::Internal, "server_error"),
            (ErrorCode::SessionSuspended, "invalid_request_error"),
        ] {
            assert_eq!(code.openai_type(), kind, "{}", code.as_str());
        }
        assert_eq!(ErrorCode::SessionSuspended.http_status(), 423);
    }

    #[test]
    fn upstream_errors_are_read_in_both_shapes() {
        use serde_json::json;
        let openai = UpstreamError::from_body(&json!({"error": {
            "message": "The model `gpt-9` does not exist", "type": "invalid_request_error",
            "param": "model", "code": "model_not_found"}}));
        assert_eq!(
            openai.message.as_deref(),
            Some("The model `gpt-9` does not exist")
        );
        assert_eq!(openai.kind.as_deref(), Some("invalid_request_error"));
        assert_eq!(openai.param.as_deref(), Some("model"));
        assert_eq!(openai.code, Some(json!("model_not_found")));
        let anthropic = UpstreamError::from_body(&json!({"type": "error",
            "error": {"type": "not_found_error", "message": "model: nope"}}));
        assert_eq!(anthropic.kind.as_deref(), Some("not_found_error"));
        assert_eq!(anthropic.code, None);
        let bare = UpstreamError::from_body(&json!({"error": "overloaded"}));
        assert_eq!(bare.message.as_deref(), Some("overloaded"));
        assert_eq!(
            UpstreamError::from_body(&json!("<html>")),
            UpstreamError::default()
        );
        let body = ErrorBody::new(
            ErrorCode::UpstreamError,
            "the upstream LLM answered HTTP 404",
            None,
        )
        .with_upstream(&openai);
        let v = serde_json::to_value(&body).expect("serialises");
        assert_eq!(v["error"]["code"], "SBP_UPSTREAM_ERROR");
        assert_eq!(v["error"]["message"], "The model `gpt-9` does not exist");
        assert_eq!(v["error"]["upstream_code"], "model_not_found");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
}
