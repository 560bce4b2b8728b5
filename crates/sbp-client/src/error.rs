//! The SDK's one error type: HTTP failures, the gateway's `SBP_*` error envelope, and the ways a
//! WebSocket attach can be refused.

use serde_json::Value;

/// Everything an SDK call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The base URL (or a URL derived from it) is not usable.
    #[error("invalid URL `{url}`: {reason}")]
    InvalidUrl { url: String, reason: String },

    /// The HTTP request could not be made or its body not read (connection refused, timeout, TLS).
    #[error("HTTP request failed: {0}")]
    Http(#[from] reqwest::Error),

    /// The gateway answered with its error envelope `{"error":{"code","message","detail"}}`.
    #[error("gateway error {status} {code}: {message}")]
    Api {
        status: u16,
        /// The `SBP_*` code, e.g. `SBP_TOKEN_CONSUMED`.
        code: String,
        message: String,
        detail: Option<Value>,
    },

    /// The gateway answered something this SDK cannot read (not JSON, or missing a field it needs).
    #[error("unexpected response ({status}): {reason}")]
    UnexpectedResponse { status: u16, reason: String },

    /// A frame could not be encoded.
    #[error("cannot encode frame: {0}")]
    Encode(#[from] serde_json::Error),

    /// The WebSocket could not be opened or failed during the attach handshake.
    #[error("WebSocket: {0}")]
    WebSocket(Box<tokio_tungstenite::tungstenite::Error>),

    /// FORBIDDEN / close 4003: the session token is not this session's.
    #[error("forbidden: {detail}")]
    Forbidden { detail: String },

    /// SESSION_NOT_FOUND / close 4004.
    #[error("session not found: {detail}")]
    SessionNotFound { detail: String },

    /// PROTOCOL_ERROR / close 1003: the gateway did not accept a frame this SDK sent.
    #[error("protocol error: {detail}")]
    Protocol { detail: String },

    /// The gateway closed the connection before SESSION_ATTACHED (any other close code).
    #[error("closed before SESSION_ATTACHED (code {code:?}): {reason}")]
    Closed { code: Option<u16>, reason: String },

    /// The connect + attach handshake did not finish within the configured timeout.
    #[error("attach did not complete within {0:?}")]
    Timeout(std::time::Duration),
}

impl From<tokio_tungstenite::tungstenite::Error> for Error {
    fn from(e: tokio_tungstenite::tungstenite::Error) -> Self {
        Self::WebSocket(Box::new(e))
    }
}

impl Error {
    /// The gateway's `SBP_*` code, for [`Error::Api`].
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// A WebSocket attach closed with 1013 ("try again later"): with federation, the session is
    /// held by another gateway that could not hand it over just now. Retrying after a pause (the
    /// surface's backoff) is expected to succeed.
    pub fn is_try_again(&self) -> bool {
        matches!(
            self,
            Self::Closed {
                code: Some(crate::reconnect::CLOSE_TRY_AGAIN),
                ..
            }
        )
    }

    /// The HTTP status, for [`Error::Api`] and [`Error::UnexpectedResponse`].
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Api { status, .. } | Self::UnexpectedResponse { status, .. } => Some(*status),
            Self::Http(e) => e.status().map(|s| s.as_u16()),
            _ => None,
        }
    }
}
