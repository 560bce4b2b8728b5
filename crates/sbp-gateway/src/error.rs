//! The engine's error: what went wrong, in the engine's terms. The transport alone decides how a
//! caller sees it (HTTP status, `SBP_*` code, headers: `transport/errors.rs`).

use sbp_llm::LlmError;
use sbp_store::StoreError;
use uuid::Uuid;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The request is malformed; the text names the field.
    #[error("{0}")]
    Invalid(String),
    /// A path id that is not a UUID.
    #[error("'{0}' is not a valid UUID")]
    InvalidUuid(String),
    /// A credential is required and none was given.
    #[error("{0}")]
    Unauthorized(String),
    /// The credential given does not allow this.
    #[error("{0}")]
    Forbidden(String),
    /// The text says which session (or that a record was missing).
    #[error("{0}")]
    SessionNotFound(String),
    /// Something else the caller named does not exist here.
    #[error("{0}")]
    NotFound(String),
    /// An input over its size limit.
    #[error("{0}")]
    TooLarge(String),
    /// The request's body did not arrive within its deadline.
    #[error("{0}")]
    RequestTimeout(String),
    /// The gateway cannot serve this now (at its connection limit, shutting down); a retry later
    /// may succeed.
    #[error("{0}")]
    Unavailable(String),
    /// The session's state does not allow this now.
    #[error("{0}")]
    Conflict(String),
    #[error("this Idempotency-Key was used for a different request")]
    IdempotencyKeyReused,
    /// A roaming token past its `exp` (RFC 3339, when representable).
    #[error("this roaming token has expired")]
    TokenExpired { expired_at: Option<String> },
    #[error("roaming token rejected: {0}")]
    TokenInvalid(String),
    #[error("this roaming token has already been imported")]
    TokenConsumed,
    /// A bundle whose content does not match its address (or the token's claims).
    #[error("{message}")]
    Integrity {
        message: String,
        /// `(claimed, computed)` CIDs, when the digests disagree.
        mismatch: Option<(String, String)>,
    },
    /// The upstream LLM failed.
    #[error("{}", upstream_message(.0))]
    Upstream(LlmError),
    /// A failure of the gateway itself (already logged where it happened).
    #[error("internal error while {0}")]
    Internal(String),
    /// A turn failed after its session was resolved (and perhaps created by it): the caller must
    /// still learn the session.
    #[error("{cause}")]
    InTurn {
        session: TurnSession,
        cause: Box<Error>,
    },
}

/// The session a turn ran in, as its caller must learn it.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnSession {
    pub id: Uuid,
    pub agent_id: String,
    /// The session's token, when this request created the session (or is a retry of the
    /// request that did).
    pub new_token: Option<String>,
}

impl Error {
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::Invalid(message.into())
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::Conflict(message.into())
    }

    pub fn session_not_found(id: impl std::fmt::Display) -> Self {
        Self::SessionNotFound(format!("Session '{id}' not found"))
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::Forbidden(message.into())
    }

    /// A failure of the gateway itself: logged in full here, reported without internals.
    pub fn internal(context: &str, err: impl std::fmt::Display) -> Self {
        tracing::error!(context, error = %err, "internal error");
        Self::Internal(context.to_owned())
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound => Self::SessionNotFound("not found".into()),
            StoreError::Conflict(kind) => Self::Conflict(kind.to_string()),
            StoreError::Consumed => Self::TokenConsumed,
            StoreError::Backend(m) => Self::internal("accessing storage", m),
        }
    }
}

/// The status an upstream's error status is passed on as: its own when it is an error status.
pub fn upstream_status(status: u16) -> u16 {
    if (400..=599).contains(&status) {
        status
    } else {
        502
    }
}

fn upstream_message(e: &LlmError) -> String {
    match e {
        LlmError::Unreachable(m) => format!("the upstream LLM is unreachable: {m}"),
        LlmError::Timeout => "the upstream LLM timed out".to_owned(),
        LlmError::Status { status, .. } => {
            format!(
                "the upstream LLM answered HTTP {}",
                upstream_status(*status)
            )
        }
        LlmError::Protocol(m) => format!("the upstream LLM sent an invalid reply: {m}"),
    }
}

/// Parses a path id.
pub fn parse_uuid(raw: &str) -> Result<Uuid, Error> {
    Uuid::parse_str(raw).map_err(|_| Error::InvalidUuid(raw.to_owned()))
}
