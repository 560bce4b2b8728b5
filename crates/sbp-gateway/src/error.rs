//! The engine's error: what went wrong, in the engine's terms. The transport alone decides how a
//! caller sees it (HTTP status, `SBP_*` code, headers: `transport/errors.rs`).

use std::time::Duration;

use sbp_llm::LlmError;
use sbp_store::StoreError;
use uuid::Uuid;

use crate::ratelimit::{Limit as RateLimit, retry_after_secs};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The request is malformed; the text names the field.
    #[error("{0}")]
    Invalid(String),
    /// A field of the request does not fit its schema (a chat message as OpenAI checks it).
    #[error("{message}")]
    InvalidField {
        /// Its path, as OpenAI's `param` (`messages[3].role`).
        param: String,
        message: String,
    },
    /// An input over one of the configured limits, refused before anything was stored.
    #[error("{message}")]
    OverLimit {
        limit: SizeLimit,
        max: u64,
        message: String,
    },
    /// The session's transcript is at a configured limit: no turn can be added to it.
    #[error("{message}")]
    SessionFull {
        session_id: Uuid,
        limit: SizeLimit,
        max: u64,
        message: String,
    },
    /// A bundle to import whose content is not of the right type or range; nothing was written.
    #[error("invalid bundle: `{path}` {reason}")]
    InvalidBundle { path: String, reason: String },
    /// A path id that is not a UUID in the canonical form.
    #[error("'{0}' is not a valid UUID (lower-case, hyphenated)")]
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
    /// A body in a format the endpoint does not take (not JSON).
    #[error("{0}")]
    UnsupportedMediaType(String),
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
    /// The session is completed or failed: no retry of the same request can succeed.
    #[error("{0}")]
    SessionEnded(String),
    /// A turn for a suspended session from a caller that sent no `sbp` object (so cannot read
    /// the spec's 202): the text says how to resume it.
    #[error("{message}")]
    SessionSuspended { session_id: Uuid, message: String },
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
    /// A rate limit refused the request: `limit` says which, `retry_after` when a request would
    /// be let through again.
    #[error("{}", rate_limited_message(*.limit, *.retry_after))]
    RateLimited {
        limit: RateLimit,
        retry_after: Duration,
    },
    /// Federation (L6): a peer's request refused, or a peer that failed us.
    #[error("{0}")]
    Federation(FedError),
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

/// What went wrong between gateways (L6).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FedError {
    /// A federation token that is missing, malformed, badly signed, for another request, expired
    /// or from an unknown key; `reason` is the metrics label.
    #[error("federation token rejected: {message}")]
    TokenInvalid {
        reason: &'static str,
        message: String,
    },
    /// A federation token whose `jti` was used before.
    #[error("federation token rejected: this token was used before")]
    TokenReplayed,
    /// A valid token from a gateway this node does not trust.
    #[error("{0}")]
    Untrusted(String),
    /// A path CID that is not 64 lower-case hex digits.
    #[error("'{0}' is not a bundle CID (64 lower-case hex digits)")]
    InvalidCid(String),
    /// A stored bundle whose bytes no longer match its CID: never served.
    #[error("the stored bundle {0} does not match its CID")]
    BundleCorrupt(String),
    /// Every provider of a bundle served bytes that do not match the CID asked for.
    #[error("{0}")]
    BundleUnavailable(String),
    /// A peer that could not be reached (or did not answer in time).
    #[error("{0}")]
    PeerUnreachable(String),
    /// The session is being handed over to another gateway; retry after `retry_after` seconds.
    #[error("this session is moving to another gateway; retry in {retry_after} s")]
    SessionMoving { retry_after: u64 },
    /// The session moved to another gateway: continue there.
    #[error("this session moved to gateway {gateway_id} ({gateway_url})")]
    SessionMoved {
        gateway_id: String,
        gateway_url: String,
    },
    /// A handover asked while a turn of the session runs.
    #[error("a turn of this session is running; retry when it ends")]
    SessionBusy,
    /// A handover committed after its lease expired (or by another gateway than the lease's).
    #[error("the handover lease expired")]
    LeaseExpired,
    /// A registry record or announce refused by a tracker.
    #[error("{message}")]
    Registry {
        refusal: RegistryRefusal,
        message: String,
    },
}

/// Why a tracker refused an announce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegistryRefusal {
    /// The record is malformed, too long-lived, or not about a bundle URL of its gateway.
    Invalid,
    /// Its signature does not verify by the announcing gateway's manifest key.
    Signature,
    /// The manifest at the bundle URL's origin is not the announcing gateway's.
    NotOwner,
    /// A record with a higher `seq` is held.
    Stale,
    /// The gateway holds as many records as allowed, or announces too fast.
    Quota,
}

/// The configured limits an input can exceed, by their configuration name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeLimit {
    RequestMessages,
    MessageBytes,
    SessionMessages,
    SessionBytes,
    JsonDepth,
    JsonObjects,
    JsonValues,
}

impl SizeLimit {
    /// The name of its setting (`max_request_messages`; the flag is `--max-request-messages`).
    pub fn name(self) -> &'static str {
        match self {
            Self::RequestMessages => "max_request_messages",
            Self::MessageBytes => "max_message_bytes",
            Self::SessionMessages => "max_session_messages",
            Self::SessionBytes => "max_session_bytes",
            Self::JsonDepth => "max_json_depth",
            Self::JsonObjects => "max_json_objects",
            Self::JsonValues => "max_json_values",
        }
    }
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

impl From<FedError> for Error {
    fn from(e: FedError) -> Self {
        Self::Federation(e)
    }
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

    pub fn over_limit(
        limit: SizeLimit,
        max: impl TryInto<u64>,
        message: impl Into<String>,
    ) -> Self {
        Self::OverLimit {
            limit,
            max: max.try_into().unwrap_or(u64::MAX),
            message: message.into(),
        }
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
            StoreError::Conflict(sbp_store::ConflictKind::SessionBusy) => {
                Self::Federation(FedError::SessionBusy)
            }
            // A session that moved is told apart (with where to) before its write is tried; a
            // move racing the write is answered like a move in progress, and the retry learns
            // where it went.
            StoreError::Conflict(
                sbp_store::ConflictKind::SessionMoving | sbp_store::ConflictKind::SessionMoved,
            ) => Self::Federation(FedError::SessionMoving { retry_after: 1 }),
            StoreError::Conflict(sbp_store::ConflictKind::LeaseExpired) => {
                Self::Federation(FedError::LeaseExpired)
            }
            StoreError::NotFound => Self::SessionNotFound("not found".into()),
            StoreError::Conflict(kind) => Self::Conflict(kind.to_string()),
            StoreError::Consumed => Self::TokenConsumed,
            StoreError::Backend(m) => Self::internal("accessing storage", m),
            // A value that does not open after the start's key check: tampering, or another
            // process writing under a key this one lacks. Logged; never its content.
            StoreError::Sealing(e) => Self::internal("opening stored content", e.to_string()),
        }
    }
}

/// The status an upstream's error status is passed on as: its own when it is an error status,
/// except a refusal of the gateway's own credentials (401, 403), which is the operator's problem,
/// not the caller's: 502 (a caller's SDK would take a 401 for its own key, and the address-based
/// limit on failed authentications would count it against the caller).
pub fn upstream_status(status: u16) -> u16 {
    match status {
        401 | 403 => 502,
        400..=599 => status,
        _ => 502,
    }
}

/// The upstream refused the gateway's own credentials: its words (which may quote the key) stay
/// in the log.
pub fn upstream_refused_credentials(e: &LlmError) -> bool {
    matches!(
        e,
        LlmError::Status {
            status: 401 | 403,
            ..
        }
    )
}

fn upstream_message(e: &LlmError) -> String {
    match e {
        LlmError::Unreachable(m) => format!("the upstream LLM is unreachable: {m}"),
        LlmError::Timeout => "the upstream LLM timed out".to_owned(),
        LlmError::Status {
            status: status @ (401 | 403),
            ..
        } => format!(
            "the upstream LLM refused the gateway's credentials (HTTP {status}); the operator must fix the upstream API key"
        ),
        LlmError::Status { status, .. } => {
            format!(
                "the upstream LLM answered HTTP {}",
                upstream_status(*status)
            )
        }
        LlmError::Protocol(m) => format!("the upstream LLM sent an invalid reply: {m}"),
    }
}

fn rate_limited_message(limit: RateLimit, retry_after: Duration) -> String {
    let what = match limit {
        RateLimit::Address => "too many requests from this address",
        RateLimit::Session => "too many requests for this session",
        RateLimit::OperatorKey => "too many requests with this operator key",
        RateLimit::AuthFailures => "too many failed authentications from this address",
    };
    format!("{what}; retry in {} s", retry_after_secs(retry_after))
}

/// Parses an id a caller sent (a path, `sbp.session_id`): only the canonical lower-case hyphenated
/// form is an id (`sbp_protocol::id`).
pub fn parse_uuid(raw: &str) -> Result<Uuid, Error> {
    sbp_protocol::id::parse_canonical(raw).ok_or_else(|| Error::InvalidUuid(raw.to_owned()))
}
