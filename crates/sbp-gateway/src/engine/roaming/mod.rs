//! L3 roaming: export a session to a content-addressed bundle and a signed roaming token
//! (`export.rs`), import a token or a raw bundle into a new session (`import.rs`), hand a session
//! off to another agent, fork it, and report its lineage and memory. Every operation that creates
//! a session is one atomic store write (`adopt_session`), which also performs the single-use check
//! of the token.

mod export;
mod import;
mod migrate;
mod redeem;

pub use redeem::{REDEEM_RETRY_WINDOW, Redeemed};

use std::sync::Arc;

use chrono::Utc;
use sbp_protocol::bundle::{CidError, KNOWN_MEMORY_SCHEMAS, MEMORY_SCHEMA_KV};
use sbp_protocol::token::{RoamingClaims, TokenError};
use sbp_protocol::{SessionStatus, SnapshotKind};
use sbp_store::{
    AdoptSession, ExportRecord, Lineage, LinkKind, LinkRecord, MemoryRecord, MessageRecord,
    NewBundle, NewExport, NewMessage, NewSession, NewSnapshot, RestoredSnapshot, SessionRecord,
    SnapshotRecord, Store, StoreError, Timestamp,
};
use serde_json::{Value, json};
use uuid::Uuid;

use super::sessions::Sessions;
use super::tasks::Tasks;
use crate::auth;
use crate::config::GatewayConfig;
use crate::error::{Error, SizeLimit};
use crate::limits::Size;
use crate::metrics::Metrics;
use sbp_protocol::time::unix_iso;

pub const DEFAULT_EXPORT_TTL_SECS: i64 = 86_400;
pub const MIN_EXPORT_TTL_SECS: i64 = 60;
pub const MAX_LABEL_CHARS: usize = 120;
pub const MAX_HANDOFF_MESSAGE_CHARS: usize = 2000;
pub const MAX_REASON_CHARS: usize = 500;
pub const MAX_AGENT_ID_CHARS: usize = 256;

pub struct ExportRequest {
    pub ttl_seconds: Option<i64>,
    pub label: Option<String>,
    /// Return the sealed bundle in the response too (for gateways that share no secret).
    pub include_bundle: bool,
}

pub struct Exported {
    pub export: ExportRecord,
    pub roaming_token: String,
    /// The sealed bundle, when asked for.
    pub bundle: Option<Value>,
}

pub struct ImportRequest {
    pub roaming_token: Option<String>,
    /// A JSON object.
    pub bundle: Option<Value>,
    pub target_agent_id: Option<String>,
    pub allow_reuse: bool,
}

pub struct Imported {
    pub session: SessionRecord,
    pub session_token: String,
    pub export_id: Option<Uuid>,
    pub source_session_id: Option<String>,
    pub bundle_cid: String,
    pub messages_restored: u64,
    pub memory_restored: bool,
    /// Why the bundle's memory was not restored, when it was not.
    pub memory_skipped: Option<String>,
    pub snapshot_restored: bool,
    pub allow_reuse: bool,
    pub via_token: bool,
}

pub struct HandoffRequest {
    pub to_agent_id: String,
    pub handoff_message: Option<String>,
    pub reason: Option<String>,
}

pub struct HandedOff {
    pub handoff_id: Uuid,
    pub source: SessionRecord,
    pub session: SessionRecord,
    pub session_token: String,
    pub export: ExportRecord,
}

pub struct ForkRequest {
    pub label: Option<String>,
    /// Keep only the last this many messages (after the leading system messages): how a session
    /// at its size limit continues.
    pub keep_last: Option<u64>,
}

pub struct Forked {
    pub fork_id: Uuid,
    pub origin: SessionRecord,
    pub session: SessionRecord,
    pub session_token: String,
    pub label: Option<String>,
    pub fork_point_msg: u64,
    pub fork_point_step: u64,
}

/// What `GET /v1/sbp/token/{token}` shows.
pub struct TokenInfo {
    pub claims: RoamingClaims,
    pub export: ExportRecord,
}

#[derive(Clone)]
pub struct Roaming {
    inner: Arc<Shared>,
}

struct Shared {
    store: Arc<dyn Store>,
    config: Arc<GatewayConfig>,
    sessions: Sessions,
    metrics: Arc<Metrics>,
    tasks: Tasks,
    /// This gateway's id as `iss` of the tokens it mints (federation on).
    issuer: redeem::Issuer,
}

fn token_error(e: TokenError) -> Error {
    match e {
        TokenError::Expired { exp } => Error::TokenExpired {
            expired_at: unix_iso(exp),
        },
        other => Error::TokenInvalid(other.to_string()),
    }
}

fn cid_error(e: CidError) -> Error {
    let mismatch = match &e {
        CidError::Mismatch { claimed, computed } => Some((claimed.clone(), computed.clone())),
        _ => None,
    };
    Error::Integrity {
        message: format!("bundle integrity check failed: {e}"),
        mismatch,
    }
}

/// A failed integrity check without digests to compare.
fn integrity(message: &str) -> Error {
    Error::Integrity {
        message: message.to_owned(),
        mismatch: None,
    }
}

/// Transcripts longer than this are read and canonicalised in two halves at once.
const SPLIT_HISTORY_AT: u64 = 512;

/// The parts of a session that go into a bundle.
struct SessionState {
    /// The transcript as consecutive pieces, oldest first (read concurrently when long).
    pieces: Vec<Vec<MessageRecord>>,
    snapshot: Option<SnapshotRecord>,
    memory: Option<MemoryRecord>,
}

impl SessionState {
    fn messages(&self) -> impl Iterator<Item = &MessageRecord> {
        self.pieces.iter().flatten()
    }

    fn message_count(&self) -> u64 {
        self.pieces.iter().map(|p| p.len() as u64).sum()
    }
}

impl Roaming {
    /// Verifies a roaming token with the signing secret, or with a previous one (rotation): a
    /// signature none of them made is `BadSignature`; any other fault is the current secret's.
    fn verify_token(&self, raw: &str, now_unix: i64) -> Result<RoamingClaims, TokenError> {
        let mut outcome = Err(TokenError::BadSignature);
        for secret in self.inner.config.verifying_secrets() {
            outcome = sbp_protocol::token::verify(raw, secret, now_unix);
            if !matches!(outcome, Err(TokenError::BadSignature)) {
                break;
            }
        }
        outcome
    }

    pub fn new(
        store: Arc<dyn Store>,
        config: Arc<GatewayConfig>,
        sessions: Sessions,
        metrics: Arc<Metrics>,
        tasks: Tasks,
    ) -> Self {
        Self {
            inner: Arc::new(Shared {
                store,
                config,
                sessions,
                metrics,
                tasks,
                issuer: redeem::Issuer::new(),
            }),
        }
    }

    /// The transcript, snapshot and memory of a session, read concurrently. A long transcript is read
    /// as two ranges on two pooled connections: the transcript is append-only, so the second range
    /// (open-ended) still joins the first exactly.
    async fn session_state(&self, session: &SessionRecord) -> Result<SessionState, Error> {
        let store = &self.inner.store;
        let half = session.message_count.div_ceil(2);
        let pieces = async {
            if session.message_count < SPLIT_HISTORY_AT {
                return Ok::<_, Error>(vec![store.history(session.id).await?]);
            }
            let limit = u32::try_from(half).unwrap_or(u32::MAX);
            let (first, rest) = tokio::try_join!(
                store.list_messages(session.id, None, limit),
                store.list_messages(session.id, Some(half - 1), u32::MAX),
            )?;
            Ok(vec![first, rest])
        };
        let (pieces, snapshot, memory) = tokio::try_join!(
            pieces,
            self.inner.sessions.recovery_snapshot(session.id),
            async { Ok(store.get_memory(session.id).await?) },
        )?;
        Ok(SessionState {
            pieces,
            snapshot,
            memory,
        })
    }

    /// `POST .../handoff`: export, import under `to_agent_id` with a bridge message first, and suspend
    /// the source: one store write, so a crash leaves either all of it or none.
    pub async fn handoff(
        &self,
        source: &SessionRecord,
        req: HandoffRequest,
    ) -> Result<HandedOff, Error> {
        if source.status.is_terminal() {
            return Err(Error::conflict(format!(
                "a {} session cannot be handed off",
                source.status
            )));
        }
        let state = self.session_state(source).await?;
        let now = Utc::now();
        let label = Some(format!("handoff to {}", req.to_agent_id))
            .filter(|l| l.chars().count() <= MAX_LABEL_CHARS);
        let copied: Vec<NewMessage> = state.messages().map(copied_message).collect();
        self.check_copy(source, &copied)?;
        let history_len = copied.len() as u64;
        let snapshot = state.snapshot.as_ref().map(|s| copied_snapshot(s, 1, now));
        let memory = state.memory.clone().map(|m| (m.schema_id, m.payload));
        let (export, bytes) = self
            .new_export(source, state, label, now, DEFAULT_EXPORT_TTL_SECS)
            .await?;
        let new_id = Uuid::now_v7();
        let session_token = auth::new_session_token();
        let reason = req
            .reason
            .as_deref()
            .map(|r| format!(" Reason: {r}."))
            .unwrap_or_default();
        let note = req
            .handoff_message
            .as_deref()
            .map(|m| format!("\n\n{m}"))
            .unwrap_or_default();
        let mut messages = vec![system_message(
            format!(
                "Handoff: agent '{}' handed this conversation (session {}) to agent '{}'.{reason}{note}",
                source.agent_id, source.id, req.to_agent_id
            ),
            now,
        )];
        messages.extend(copied);
        let handoff_id = Uuid::now_v7();
        let link = LinkRecord {
            id: handoff_id,
            kind: LinkKind::Handoff,
            from_session: Some(source.id),
            to_session: new_id,
            from_agent: Some(source.agent_id.clone()),
            to_agent: Some(req.to_agent_id.clone()),
            export_id: Some(export.id),
            label: export.label.clone(),
            reason: req.reason.clone(),
            fork_point: Some(history_len),
            reused: false,
            created_at: now,
            peer_gateway: None,
        };
        let session = self
            .inner
            .store
            .adopt_session(AdoptSession {
                session: new_session(new_id, req.to_agent_id.clone(), &session_token, now),
                status: SessionStatus::Idle,
                step_count: source.step_count,
                last_task: source.last_task.clone(),
                model: source.model.clone(),
                messages,
                snapshot,
                memory,
                bundle: Some(NewBundle {
                    cid: export.bundle_cid.clone(),
                    bytes,
                }),
                export: Some(export.clone()),
                consume_export: Some(export.id),
                link: Some(link),
                suspend: Some(source.id),
                now,
            })
            .await
            .map_err(|e| match e {
                StoreError::Conflict(_) => Error::conflict(
                    "the source session's status changed; it cannot be handed off now",
                ),
                other => other.into(),
            })?;
        self.inner.metrics.handoffs.inc();
        self.inner.metrics.sessions_created.inc();
        let source = self.inner.sessions.get(source.id).await?;
        let mut export = record_of(export);
        export.imported_at = Some(now);
        export.import_session_id = Some(new_id);
        Ok(HandedOff {
            handoff_id,
            source,
            session,
            session_token,
            export,
        })
    }

    /// `POST .../fork`: an independent copy of the session at its latest consistent point: all of it,
    /// or, while a turn is in flight, the last completed turn. With `keep_last`, only the leading
    /// system messages and the last messages of that copy ([`trimmed`]).
    pub async fn fork(&self, origin: &SessionRecord, req: ForkRequest) -> Result<Forked, Error> {
        let ForkRequest { label, keep_last } = req;
        if origin.status.is_terminal() {
            return Err(Error::conflict(format!(
                "a {} session cannot be forked",
                origin.status
            )));
        }
        let state = self.session_state(origin).await?;
        // A turn is in flight when its turn-level pre_action is the newest turn-level snapshot.
        let in_flight = matches!(
            self.inner.sessions.turn_snapshots(origin.id).await?.first(),
            Some(s) if s.kind == SnapshotKind::PreAction
        );
        let (point_msg, point_step) = match (&state.snapshot, in_flight) {
            (Some(s), true) => (s.message_count, s.step_count),
            (None, true) => (0, 0),
            (_, false) => (state.message_count(), origin.step_count),
        };
        let point = usize::try_from(point_msg).unwrap_or(usize::MAX);
        let now = Utc::now();
        let new_id = Uuid::now_v7();
        let session_token = auth::new_session_token();
        let copy: Vec<&MessageRecord> = state.messages().take(point).collect();
        let (kept, dropped) = match keep_last {
            Some(n) => trimmed(&copy, n),
            None => ((0..copy.len()).collect(), (0, 0)),
        };
        let messages: Vec<NewMessage> = kept.iter().map(|&i| copied_message(copy[i])).collect();
        self.check_copy(origin, &messages)?;
        // A snapshot counts messages from the start: it survives a trim only when it lies after
        // the cut, counted in the shorter transcript.
        let (lead, cut) = dropped;
        let snapshot = state
            .snapshot
            .as_ref()
            .filter(|s| s.message_count <= point_msg)
            .filter(|s| cut == lead || s.message_count >= cut as u64)
            .map(|s| {
                let mut copied = copied_snapshot(s, 0, now);
                copied.message_count -= (cut - lead) as u64;
                copied
            });
        let fork_id = Uuid::now_v7();
        let link = LinkRecord {
            id: fork_id,
            kind: LinkKind::Fork,
            from_session: Some(origin.id),
            to_session: new_id,
            from_agent: Some(origin.agent_id.clone()),
            to_agent: Some(origin.agent_id.clone()),
            export_id: None,
            label: label.clone(),
            reason: None,
            fork_point: Some(point_msg),
            reused: false,
            created_at: now,
            peer_gateway: None,
        };
        let session = self
            .inner
            .store
            .adopt_session(AdoptSession {
                session: new_session(new_id, origin.agent_id.clone(), &session_token, now),
                status: SessionStatus::Idle,
                step_count: point_step,
                last_task: origin.last_task.clone(),
                model: origin.model.clone(),
                messages,
                snapshot,
                memory: state.memory.map(|m| (m.schema_id, m.payload)),
                bundle: None,
                export: None,
                consume_export: None,
                link: Some(link),
                suspend: None,
                now,
            })
            .await?;
        self.inner.metrics.forks.inc();
        self.inner.metrics.sessions_created.inc();
        Ok(Forked {
            fork_id,
            origin: origin.clone(),
            session,
            session_token,
            label,
            fork_point_msg: point_msg,
            fork_point_step: point_step,
        })
    }

    /// Refuses a copy of `origin` (a fork, a handoff) that would be past the session limits.
    fn check_copy(&self, origin: &SessionRecord, messages: &[NewMessage]) -> Result<(), Error> {
        let limits = &self.inner.config.limits;
        let size = Size::of_text(messages.iter().map(|m| m.body.as_str()));
        if limits.check_room(origin.id, Size::default(), size).is_ok() {
            return Ok(());
        }
        let (limit, max) = if size.messages > limits.max_session_messages {
            (SizeLimit::SessionMessages, limits.max_session_messages)
        } else {
            (SizeLimit::SessionBytes, limits.max_session_bytes)
        };
        Err(Error::SessionFull {
            session_id: origin.id,
            limit,
            max,
            message: format!(
                "a copy of session {} would hold {} messages ({} bytes), past the {max} a \
                 session takes ({}); fork it with {{\"keep_last\": N}} to keep only its last N \
                 messages",
                origin.id,
                size.messages,
                size.bytes,
                limit.name()
            ),
        })
    }

    pub async fn lineage(&self, session: &SessionRecord) -> Result<Lineage, Error> {
        Ok(self.inner.store.lineage(session.id).await?)
    }

    /// The session's memory document (an empty one of the built-in schema when none was stored).
    pub async fn memory(&self, session: &SessionRecord) -> Result<MemoryRecord, Error> {
        Ok(self
            .inner
            .store
            .get_memory(session.id)
            .await?
            .unwrap_or_else(|| MemoryRecord {
                schema_id: MEMORY_SCHEMA_KV.to_owned(),
                payload: json!({}),
                updated_at: session.created_at,
            }))
    }

    pub async fn put_memory(
        &self,
        session: &SessionRecord,
        schema_id: Option<String>,
        payload: Value,
    ) -> Result<MemoryRecord, Error> {
        let schema_id = schema_id.unwrap_or_else(|| MEMORY_SCHEMA_KV.to_owned());
        if !KNOWN_MEMORY_SCHEMAS.contains(&schema_id.as_str()) {
            return Err(Error::invalid(format!(
                "unknown memory schema_id '{schema_id}'; this gateway knows {KNOWN_MEMORY_SCHEMAS:?}"
            )));
        }
        if !payload.is_object() {
            return Err(Error::invalid("`payload` must be a JSON object"));
        }
        Ok(self
            .inner
            .store
            .put_memory(session.id, schema_id, payload, Utc::now())
            .await?)
    }
}

/// The record of a session created by roaming; its token is returned once and stored as a hash.
fn new_session(id: Uuid, agent_id: String, token: &str, now: Timestamp) -> NewSession {
    NewSession {
        id,
        agent_id,
        token_hash: auth::hash_token(token),
        created_at: now,
        metadata: json!({}),
    }
}

fn record_of(e: NewExport) -> ExportRecord {
    ExportRecord {
        id: e.id,
        session_id: e.session_id,
        bundle_cid: e.bundle_cid,
        label: e.label,
        message_count: e.message_count,
        created_at: e.created_at,
        expires_at: e.expires_at,
        foreign: e.foreign,
        imported_at: None,
        import_session_id: None,
    }
}

fn copied_message(m: &MessageRecord) -> NewMessage {
    NewMessage {
        role: m.role.clone(),
        body: (&m.body).into(),
        model_used: m.model_used.clone(),
        cost_usd: m.cost_usd,
        created_at: m.created_at,
    }
}

fn system_message(content: String, now: Timestamp) -> NewMessage {
    NewMessage {
        role: "system".to_owned(),
        body: json!({ "role": "system", "content": content }).into(),
        model_used: None,
        cost_usd: None,
        created_at: now,
    }
}

/// The messages of a fork that keeps the last `n`: the leading system messages (the instructions),
/// then the last `n` of the rest, the cut moved later past any `tool` message so that no tool
/// result is kept without the call it answers. Returns the kept indexes and `(lead, cut)`: the
/// leading system messages are `0..lead`, the kept tail starts at `cut` (`lead == cut`: nothing
/// dropped).
fn trimmed(messages: &[&MessageRecord], n: u64) -> (Vec<usize>, (usize, usize)) {
    let lead = messages.iter().take_while(|m| m.role == "system").count();
    let rest = messages.len() - lead;
    let keep = usize::try_from(n).unwrap_or(usize::MAX).min(rest);
    let mut cut = messages.len() - keep;
    while cut < messages.len() && messages[cut].role == "tool" {
        cut += 1;
    }
    ((0..lead).chain(cut..messages.len()).collect(), (lead, cut))
}

/// `s` copied into a new session whose transcript has `in_front` more messages before the copied ones.
fn copied_snapshot(s: &SnapshotRecord, in_front: u64, now: Timestamp) -> RestoredSnapshot {
    RestoredSnapshot {
        snapshot: NewSnapshot {
            id: Uuid::now_v7(),
            kind: s.kind,
            model: s.model.clone(),
            current_task: s.current_task.clone(),
            created_at: now,
            state: s.state.clone(),
        },
        step_count: s.step_count,
        message_count: s.message_count + in_front,
    }
}
