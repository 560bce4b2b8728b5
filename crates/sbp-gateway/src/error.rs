//! The engine's error: an SBP error code, a message for the caller and optional detail. The transport
//! turns it into the SPEC 12.1 envelope with the code's HTTP status (or the upstream's own status).

use sbp_protocol::{ErrorBody, ErrorCode};
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub code: ErrorCode,
    pub status: u16,
    pub message: String,
    pub detail: Option<Value>,
    /// Headers the response must carry anyway (e.g. the token of a session created before the failure).
    pub headers: Vec<(&'static str, String)>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            status: code.http_status(),
            message: message.into(),
            detail: None,
            headers: Vec::new(),
        }
    }

    pub fn with_detail(mut self, detail: Value) -> Self {
        self.detail = Some(detail);
        self
    }

    pub fn with_status(mut self, status: u16) -> Self {
        self.status = status;
        self
    }

    pub fn with_header(mut self, name: &'static str, value: String) -> Self {
        self.headers.push((name, value));
        self
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::SessionConflict, message)
    }

    pub fn session_not_found(id: impl std::fmt::Display) -> Self {
        Self::new(
            ErrorCode::SessionNotFound,
            format!("Session '{id}' not found"),
        )
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Forbidden, message)
    }

    /// A storage failure: logged in full, reported without internals.
    pub fn internal(context: &str, err: impl std::fmt::Display) -> Self {
        tracing::error!(context, error = %err, "internal error");
        Self::new(
            ErrorCode::Internal,
            format!("internal error while {context}"),
        )
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody::new(self.code, self.message.clone(), self.detail.clone())
    }
}

impl From<sbp_store::StoreError> for ApiError {
    fn from(e: sbp_store::StoreError) -> Self {
        match e {
            sbp_store::StoreError::NotFound => Self::new(ErrorCode::SessionNotFound, "not found"),
            sbp_store::StoreError::Conflict(m) => Self::conflict(m),
            sbp_store::StoreError::Consumed => Self::new(
                ErrorCode::TokenConsumed,
                "this roaming token has already been imported",
            ),
            sbp_store::StoreError::Backend(m) => Self::internal("accessing storage", m),
        }
    }
}
