//! Sessions: who may act on one (session tokens, operator keys), creating one, how it looks from
//! outside, its status and snapshots, turns a backend pushes into it, and (`lifecycle.rs`) listing
//! and deleting sessions.

mod lifecycle;
mod tokens;

pub use lifecycle::{DEFAULT_PAGE, ListRequest, MAX_PAGE, SessionPage};

use std::sync::Arc;

use chrono::Utc;
use sbp_bus::TurnDone;
use sbp_protocol::{SessionStatus, SnapshotKind, SurfaceContext};
use sbp_store::{
    FinishTurn, MessageRecord, NewMessage, NewSession, NewTetherEntry, SessionRecord,
    SnapshotRecord, Store, StoreError,
};
use serde_json::{Value, json};
use uuid::Uuid;

use super::history::HistoryCache;
use super::replicas::Replicas;
use crate::auth;
use crate::config::GatewayConfig;
use crate::error::{Error, parse_uuid};
use crate::limits::{Size, stored_bytes};
use crate::metrics::{Metrics, Timed as _};
use crate::ratelimit::{Limit, Limiter};
use tokens::TokenCache;

/// Who is calling a session-scoped endpoint.
#[derive(Debug, Clone, Default)]
pub struct Caller {
    /// From `X-Session-Token`.
    pub session_token: Option<String>,
    /// Authenticated with an operator API key.
    pub operator: bool,
}

/// A session as `GET /v1/sessions/{id}` shows it: the record, and what is live about it.
#[derive(Debug, Clone)]
pub struct SessionView {
    pub session: SessionRecord,
    /// Tether turns waiting for a surface.
    pub tether_pending: u64,
    /// The snapshot a recovery would resume from.
    pub latest_snapshot: Option<SnapshotRecord>,
    /// The attached surface (here or on another replica), as it declared itself.
    pub surface: Option<SurfaceContext>,
}

/// Longest `Idempotency-Key` accepted.
const MAX_IDEMPOTENCY_KEY: usize = 255;

/// An `Idempotency-Key` and the fingerprint of the request body it came with.
pub struct IdempotencyKey {
    pub key: String,
    /// What tells a retry of the same request from another request under the key (the
    /// transport's digest of the body).
    pub fingerprint: String,
}

impl IdempotencyKey {
    pub fn check(&self) -> Result<(), Error> {
        if self.key.is_empty() || self.key.len() > MAX_IDEMPOTENCY_KEY {
            return Err(Error::invalid(
                "Idempotency-Key must be 1 to 255 characters",
            ));
        }
        Ok(())
    }
}

/// What a push did: the turn's tether seq, whether a surface was attached to take it live, and
/// whether this answer replays an earlier request with the same `Idempotency-Key`.
#[derive(Debug, Clone, Copy)]
pub struct Pushed {
    pub seq: u64,
    pub attached: bool,
    pub replayed: bool,
}

/// A turn pushed into a session by a backend (`POST /v1/sbp/sessions/{id}/turns`).
#[derive(Debug, Clone)]
pub struct PushTurn {
    pub role: String,
    pub content: String,
    pub model_used: Option<String>,
}

/// What an ATTACH_SESSION's token check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenCheck {
    Valid,
    Wrong,
    NoSuchSession,
}

#[derive(Clone)]
pub struct Sessions {
    inner: Arc<Shared>,
}

struct Shared {
    store: Arc<dyn Store>,
    config: Arc<GatewayConfig>,
    tokens: Arc<TokenCache>,
    replicas: Replicas,
    metrics: Arc<Metrics>,
    /// Recent transcripts; a deleted session's is dropped with it.
    history: Arc<HistoryCache>,
    /// Requests per session (`--rate-limit-session`), counted once the caller is authorised, so
    /// no one without the session's credentials can use up its budget.
    limiter: Option<Limiter<Uuid>>,
}

impl Sessions {
    pub fn new(
        store: Arc<dyn Store>,
        config: Arc<GatewayConfig>,
        replicas: Replicas,
        metrics: Arc<Metrics>,
        history: Arc<HistoryCache>,
    ) -> Self {
        Self {
            inner: Arc::new(Shared {
                limiter: config.rate_limits.session.map(Limiter::new),
                store,
                config,
                tokens: Arc::new(TokenCache::default()),
                replicas,
                metrics,
                history,
            }),
        }
    }

    /// The session `id`, or [`Error::SessionNotFound`].
    pub async fn get(&self, id: Uuid) -> Result<SessionRecord, Error> {
        self.inner
            .store
            .get_session(id)
            .await?
            .ok_or_else(|| Error::session_not_found(id))
    }

    /// Loads a session by path id and checks the caller may act on it.
    pub async fn authorized(&self, raw_id: &str, caller: &Caller) -> Result<SessionRecord, Error> {
        let id = parse_uuid(raw_id)?;
        let session = self.get(id).await?;
        self.inner.tokens.remember(id, &session.token_hash);
        self.authorize(&session, caller)?;
        self.admit(id)?;
        Ok(session)
    }

    /// Counts one request against session `id`'s rate limit ([`Error::RateLimited`] when over).
    pub fn admit(&self, id: Uuid) -> Result<(), Error> {
        match &self.inner.limiter {
            Some(limiter) => limiter.check(&id).map_err(|retry_after| {
                self.inner.metrics.count_rate_limited(Limit::Session);
                Error::RateLimited {
                    limit: Limit::Session,
                    retry_after,
                }
            }),
            None => Ok(()),
        }
    }

    /// [`Sessions::authorized`] for callers that need only the id: a session token whose hash is
    /// cached is checked without reading the store.
    pub async fn authorized_id(&self, raw_id: &str, caller: &Caller) -> Result<Uuid, Error> {
        let id = parse_uuid(raw_id)?;
        if let (false, Some(token)) = (self.open_to(caller), &caller.session_token)
            && self.inner.tokens.check(id, token) == Some(true)
        {
            self.admit(id)?;
            return Ok(id);
        }
        Ok(self.authorized(raw_id, caller).await?.id)
    }

    /// Whether `caller` may act on any session without its token.
    fn open_to(&self, caller: &Caller) -> bool {
        self.inner.config.insecure_no_session_auth || caller.operator
    }

    fn authorize(&self, session: &SessionRecord, caller: &Caller) -> Result<(), Error> {
        if self.open_to(caller) {
            return Ok(());
        }
        match &caller.session_token {
            Some(t) if auth::token_matches(t, &session.token_hash) => Ok(()),
            Some(_) => Err(Error::forbidden(
                "session token does not match this session",
            )),
            None => Err(Error::Unauthorized(
                "this endpoint needs the session's token in the X-Session-Token header".into(),
            )),
        }
    }

    /// Whether `token` is session `id`'s token (ATTACH_SESSION), from the cache when known.
    pub async fn check_token(&self, id: Uuid, token: &str) -> Result<TokenCheck, StoreError> {
        let matches = match self.inner.tokens.check(id, token) {
            Some(matches) => matches,
            None => {
                let Some(session) = self.inner.store.get_session(id).await? else {
                    return Ok(TokenCheck::NoSuchSession);
                };
                self.inner.tokens.remember(id, &session.token_hash);
                auth::token_matches(token, &session.token_hash)
            }
        };
        Ok(if matches {
            TokenCheck::Valid
        } else {
            TokenCheck::Wrong
        })
    }

    /// The session a token belongs to (a completion continuing a session).
    pub async fn by_token(&self, token: &str) -> Result<Option<SessionRecord>, Error> {
        Ok(self
            .inner
            .store
            .find_session_by_token(&auth::hash_token(token))
            .await?)
    }

    /// `POST /v1/sessions`: a new idle session and its token (returned once, stored as a hash).
    pub async fn create(
        &self,
        agent_id: Option<String>,
        metadata: Value,
    ) -> Result<(SessionRecord, String), Error> {
        let token = auth::new_session_token();
        let now = Utc::now();
        let new = NewSession {
            id: Uuid::now_v7(),
            agent_id: agent_id.unwrap_or_else(new_agent_id),
            token_hash: auth::hash_token(&token),
            created_at: now,
            metadata,
        };
        let id = new.id;
        let hash = new.token_hash.clone();
        let created = self.inner.store.create_session(new);
        created.timed(&self.inner.metrics, "create_session").await?;
        self.inner.tokens.remember(id, &hash);
        self.inner.metrics.sessions_created.inc();
        let session = self
            .inner
            .store
            .get_session(id)
            .await?
            .ok_or_else(|| Error::internal("creating a session", "session vanished"))?;
        Ok((session, token))
    }

    pub async fn view(&self, session: SessionRecord) -> Result<SessionView, Error> {
        let tether_pending = self.inner.store.tether_count(session.id).await?;
        let latest_snapshot = self.recovery_snapshot(session.id).await?;
        let attachment = self.inner.replicas.locate(session.id).await;
        Ok(SessionView {
            session,
            tether_pending,
            latest_snapshot,
            surface: attachment.map(|a| (*a.surface).clone()),
        })
    }

    /// The snapshot a crash recovery resumes from: the latest post_action, else the latest checkpoint.
    pub async fn recovery_snapshot(
        &self,
        session_id: Uuid,
    ) -> Result<Option<SnapshotRecord>, Error> {
        Ok(self
            .turn_snapshots(session_id)
            .await?
            .into_iter()
            .find(|s| s.kind != SnapshotKind::PreAction))
    }

    /// The session's turn-level snapshots, newest first: not the pre_action / post_action pairs the
    /// agent loop writes around each tool call inside a turn (their state names the tool action),
    /// which are not points a turn can be resumed or forked from.
    pub async fn turn_snapshots(&self, session_id: Uuid) -> Result<Vec<SnapshotRecord>, Error> {
        let mut limit = 64;
        loop {
            let all = self.inner.store.list_snapshots(session_id, limit).await?;
            let full = all.len() == limit as usize;
            let turn_level: Vec<SnapshotRecord> =
                all.into_iter().filter(|s| !is_tool_snapshot(s)).collect();
            if !turn_level.is_empty() || !full || limit >= 1 << 16 {
                return Ok(turn_level);
            }
            limit *= 8;
        }
    }

    /// The latest snapshot of any kind.
    pub async fn latest_snapshot(&self, session_id: Uuid) -> Result<Option<SnapshotRecord>, Error> {
        Ok(self.inner.store.latest_snapshot(session_id, None).await?)
    }

    pub async fn snapshots(
        &self,
        session_id: Uuid,
        limit: u32,
    ) -> Result<Vec<SnapshotRecord>, Error> {
        Ok(self.inner.store.list_snapshots(session_id, limit).await?)
    }

    /// A snapshot's messages (they are the transcript's first `message_count`).
    pub async fn snapshot_messages(
        &self,
        snap: &SnapshotRecord,
    ) -> Result<Vec<MessageRecord>, Error> {
        let count = u32::try_from(snap.message_count).unwrap_or(u32::MAX);
        Ok(self
            .inner
            .store
            .list_messages(snap.session_id, None, count)
            .await?)
    }

    pub async fn messages(
        &self,
        session: &SessionRecord,
        after: Option<u64>,
        limit: u32,
    ) -> Result<Vec<MessageRecord>, Error> {
        Ok(self
            .inner
            .store
            .list_messages(session.id, after, limit.clamp(1, 1000))
            .await?)
    }

    /// `PATCH /v1/sbp/sessions/{id}/status`: suspend, complete, fail (or resume) a session.
    pub async fn set_status(
        &self,
        session: &SessionRecord,
        status: &str,
    ) -> Result<SessionRecord, Error> {
        let to = SessionStatus::parse(status).ok_or_else(|| {
            Error::invalid(format!(
                "unknown status '{status}': expected one of running, suspended, completed, failed"
            ))
        })?;
        if to == SessionStatus::Idle && session.status != SessionStatus::Idle {
            return Err(Error::conflict("a session cannot return to idle"));
        }
        self.inner
            .store
            .update_status(session.id, to, Utc::now())
            .await
            .map_err(|e| match e {
                StoreError::Conflict(_) => Error::conflict(format!(
                    "cannot change status from {} to {to}",
                    session.status
                )),
                other => other.into(),
            })?;
        self.get(session.id).await
    }

    /// Persists a backend-pushed turn and delivers it live, or tethers it for the next attach.
    /// With an `Idempotency-Key`, the turn and the key's record are one write: a retry of a push
    /// whose answer was lost replays its seq instead of pushing the turn again.
    pub async fn push_turn(
        &self,
        session: &SessionRecord,
        push: PushTurn,
        key: Option<IdempotencyKey>,
    ) -> Result<Pushed, Error> {
        let key = match key {
            Some(k) => {
                k.check()?;
                let scoped = auth::sha256_hex(format!("push:{}\n{}", session.id, k.key).as_bytes());
                if let Some(replay) = self
                    .replay_push(&scoped, &k.fingerprint, session.id)
                    .await?
                {
                    return Ok(replay);
                }
                Some((scoped, k.fingerprint))
            }
            None => None,
        };
        if session.status.is_terminal() {
            return Err(Error::conflict(format!("session is {}", session.status)));
        }
        let now = Utc::now();
        let chunk_id = Uuid::now_v7();
        let body = json!({"role": push.role, "content": push.content});
        let limits = &self.inner.config.limits;
        let size = stored_bytes(&body);
        limits.check_message_bytes(
            "the pushed turn",
            usize::try_from(size).unwrap_or(usize::MAX),
        )?;
        let have = Size {
            messages: session.message_count,
            bytes: session.message_bytes,
        };
        let add = Size {
            messages: 1,
            bytes: size,
        };
        limits.check_room(session.id, have, add)?;
        let outcome = self
            .inner
            .store
            .finish_turn(FinishTurn {
                session_id: session.id,
                turn_id: None,
                messages: vec![NewMessage {
                    role: push.role.clone(),
                    body: body.into(),
                    model_used: push.model_used.clone(),
                    cost_usd: None,
                    created_at: now,
                }],
                count_step: false,
                post_action: None,
                checkpoint: None,
                tether: Some(NewTetherEntry {
                    role: push.role.clone(),
                    content: Some(push.content.clone()),
                    model_used: push.model_used.clone(),
                    created_at: now,
                    chunk_id,
                }),
                tether_only_if_enabled: false,
                idempotency_done: key.as_ref().map(|(k, _)| (k.clone(), 201, json!({}))),
                idempotency_claim: key.as_ref().map(|(_, f)| f.clone()),
                now,
            })
            .timed(&self.inner.metrics, "push_turn")
            .await;
        let outcome = match (outcome, &key) {
            // Another request with this key committed first: answer as its retry would.
            (Err(StoreError::Conflict(kind)), Some((scoped, fingerprint)))
                if kind.is_idempotency() =>
            {
                return match self.replay_push(scoped, fingerprint, session.id).await? {
                    Some(replay) => Ok(replay),
                    None => Err(Error::conflict(
                        "a request with this Idempotency-Key is still in progress",
                    )),
                };
            }
            (outcome, _) => outcome?,
        };
        self.inner.metrics.turns_pushed.inc();
        self.inner.metrics.tether_enqueued.inc();
        let seq = outcome.tether_seq.unwrap_or_default();
        let attached = self
            .inner
            .replicas
            .notify_turn_done(
                session.id,
                TurnDone {
                    chunk_id,
                    seq: outcome.tether_seq,
                    role: push.role,
                    content: Some(push.content),
                    model_used: push.model_used,
                    // A pushed turn is not a step: the count stays where the last turn left it.
                    step: Some(outcome.session.step_count),
                    cost_usd: None,
                },
            )
            .await;
        Ok(Pushed {
            seq,
            attached,
            replayed: false,
        })
    }

    /// The earlier push recorded under `scoped`, if there is one; a different body under the same
    /// key is refused.
    async fn replay_push(
        &self,
        scoped: &str,
        fingerprint: &str,
        session: Uuid,
    ) -> Result<Option<Pushed>, Error> {
        let Some(record) = self.inner.store.get_idempotency(scoped).await? else {
            return Ok(None);
        };
        if record.fingerprint != fingerprint || record.session_id != session {
            return Err(Error::IdempotencyKeyReused);
        }
        Ok(Some(Pushed {
            seq: record.tether_seq.unwrap_or_default(),
            // Whether the first answer's live delivery happened is not recorded: the turn is
            // durable either way, and a surface in ack mode gets it until it acknowledges it.
            attached: false,
            replayed: true,
        }))
    }
}

/// An agent id for a session whose caller named none.
pub fn new_agent_id() -> String {
    format!("agent-{}", Uuid::now_v7())
}

/// A snapshot the agent loop wrote around one tool call.
fn is_tool_snapshot(s: &SnapshotRecord) -> bool {
    matches!(
        s.state.get("action").and_then(Value::as_str),
        Some("tool_call" | "tool_result")
    )
}
