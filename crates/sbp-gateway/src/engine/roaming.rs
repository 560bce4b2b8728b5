//! L3 roaming: export a session to a content-addressed bundle and a signed roaming token, import a
//! token (or a raw bundle) into a new session, hand a session off to another agent, fork it, and
//! report its lineage. Every operation that creates a session is one atomic store write
//! (`adopt_session`), which also performs the single-use check of the token.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use chrono::{DateTime, Duration, Utc};
use sbp_protocol::bundle::{self, BundleMemory, BundleMessage, CidError, ParsedBundle};
use sbp_protocol::canonical;
use sbp_protocol::token::{self, RoamingClaims, TokenError};
use sbp_protocol::{ErrorCode, SessionStatus, SnapshotKind};
use sbp_store::{
    AdoptSession, ExportRecord, Lineage, LinkKind, LinkRecord, MemoryRecord, MessageRecord,
    NewBundle, NewExport, NewMessage, NewSession, NewSnapshot, RestoredSnapshot, SessionRecord,
    SnapshotRecord, Timestamp,
};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::sessions::new_agent_id;
use super::{Gateway, iso};
use crate::auth;
use crate::error::ApiError;

/// The memory format this gateway understands: `payload` is a JSON object of application-defined
/// keys. Bundles whose memory names another schema import without their memory.
pub const MEMORY_SCHEMA_KV: &str = "urn:sbp:memory:kv:v1";
pub const KNOWN_MEMORY_SCHEMAS: &[&str] = &[MEMORY_SCHEMA_KV];

pub const DEFAULT_EXPORT_TTL_SECS: i64 = 86_400;
pub const MIN_EXPORT_TTL_SECS: i64 = 60;
pub const MAX_LABEL_CHARS: usize = 120;
pub const MAX_HANDOFF_MESSAGE_CHARS: usize = 2000;
pub const MAX_REASON_CHARS: usize = 500;
const MAX_AGENT_ID_CHARS: usize = 256;

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

fn token_error(e: TokenError) -> ApiError {
    match e {
        TokenError::Expired { exp } => {
            ApiError::new(ErrorCode::TokenExpired, "this roaming token has expired")
                .with_detail(json!({ "expired_at": unix_iso(exp) }))
        }
        other => ApiError::new(
            ErrorCode::TokenInvalid,
            format!("roaming token rejected: {other}"),
        ),
    }
}

fn cid_error(e: CidError) -> ApiError {
    let detail = match &e {
        CidError::Mismatch { claimed, computed } => {
            json!({ "claimed": claimed, "computed": computed })
        }
        _ => Value::Null,
    };
    let err = ApiError::new(
        ErrorCode::TokenIntegrity,
        format!("bundle integrity check failed: {e}"),
    );
    if detail.is_null() {
        err
    } else {
        err.with_detail(detail)
    }
}

/// A Unix time (a token claim) in the timestamp form of responses.
pub fn unix_iso(secs: i64) -> Option<String> {
    DateTime::<Utc>::from_timestamp(secs, 0).map(|t| iso(&t))
}

/// A string of at most `max` characters, or none.
fn optional_text(
    body: &Map<String, Value>,
    key: &str,
    max: usize,
) -> Result<Option<String>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.chars().count() <= max => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad_request(format!(
            "`{key}` must be a string of at most {max} characters"
        ))),
    }
}

fn check_agent_id(key: &str, s: &str) -> Result<(), ApiError> {
    if s.is_empty() || s.chars().count() > MAX_AGENT_ID_CHARS {
        return Err(ApiError::bad_request(format!(
            "`{key}` must be a string of 1 to {MAX_AGENT_ID_CHARS} characters"
        )));
    }
    Ok(())
}

/// The optional `label` of an export or fork.
pub fn optional_label(body: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    optional_text(body, "label", MAX_LABEL_CHARS)
}

impl ExportRequest {
    pub fn from_body(body: &Map<String, Value>) -> Result<Self, ApiError> {
        let ttl_seconds = match body.get("ttl_seconds") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_i64() {
                Some(n) if (MIN_EXPORT_TTL_SECS..=token::MAX_TOKEN_TTL_SECS).contains(&n) => {
                    Some(n)
                }
                _ => {
                    return Err(ApiError::bad_request(format!(
                        "`ttl_seconds` must be an integer in [{MIN_EXPORT_TTL_SECS}, {}]",
                        token::MAX_TOKEN_TTL_SECS
                    )));
                }
            },
        };
        let include_bundle = match body.get("include_bundle") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::bad_request("`include_bundle` must be a boolean")),
        };
        Ok(Self {
            ttl_seconds,
            label: optional_label(body)?,
            include_bundle,
        })
    }
}

impl ImportRequest {
    /// Takes the body by value: a raw bundle can be megabytes, and is moved rather than copied.
    pub fn from_body(mut body: Map<String, Value>) -> Result<Self, ApiError> {
        let roaming_token = match body.get("roaming_token").or_else(|| body.get("token")) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.trim().to_owned()),
            Some(_) => return Err(ApiError::bad_request("`roaming_token` must be a string")),
        };
        let bundle = match body.remove("bundle") {
            None | Some(Value::Null) => None,
            Some(v @ Value::Object(_)) => Some(v),
            Some(_) => return Err(ApiError::bad_request("`bundle` must be an object")),
        };
        if roaming_token.is_none() && bundle.is_none() {
            return Err(ApiError::bad_request(
                "send a `roaming_token`, a raw `bundle`, or both",
            ));
        }
        let target_agent_id = match body.get("target_agent_id").or_else(|| body.get("agent_id")) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => {
                check_agent_id("target_agent_id", s)?;
                Some(s.clone())
            }
            Some(_) => return Err(ApiError::bad_request("`target_agent_id` must be a string")),
        };
        let allow_reuse = match body.get("allow_reuse") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::bad_request("`allow_reuse` must be a boolean")),
        };
        Ok(Self {
            roaming_token,
            bundle,
            target_agent_id,
            allow_reuse,
        })
    }
}

impl HandoffRequest {
    pub fn from_body(body: &Map<String, Value>) -> Result<Self, ApiError> {
        let to_agent_id = match body
            .get("to_agent_id")
            .or_else(|| body.get("target_agent_id"))
        {
            Some(Value::String(s)) => {
                check_agent_id("to_agent_id", s)?;
                s.clone()
            }
            _ => {
                return Err(ApiError::bad_request(
                    "`to_agent_id` (a string) is required",
                ));
            }
        };
        Ok(Self {
            to_agent_id,
            handoff_message: optional_text(body, "handoff_message", MAX_HANDOFF_MESSAGE_CHARS)?,
            reason: optional_text(body, "reason", MAX_REASON_CHARS)?,
        })
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

impl Gateway {
    fn secret(&self) -> &[u8] {
        &self.config().secret
    }

    /// The transcript, snapshot and memory of a session, read concurrently. A long transcript is read
    /// as two ranges on two pooled connections: the transcript is append-only, so the second range
    /// (open-ended) still joins the first exactly.
    async fn session_state(&self, session: &SessionRecord) -> Result<SessionState, ApiError> {
        let store = self.store();
        let half = session.message_count.div_ceil(2);
        let pieces = async {
            if session.message_count < SPLIT_HISTORY_AT {
                return Ok::<_, ApiError>(vec![store.history(session.id).await?]);
            }
            let limit = u32::try_from(half).unwrap_or(u32::MAX);
            let (first, rest) = tokio::try_join!(
                store.list_messages(session.id, None, limit),
                store.list_messages(session.id, Some(half - 1), u32::MAX),
            )?;
            Ok(vec![first, rest])
        };
        let (pieces, snapshot, memory) =
            tokio::try_join!(pieces, self.recovery_snapshot(session.id), async {
                Ok(store.get_memory(session.id).await?)
            },)?;
        Ok(SessionState {
            pieces,
            snapshot,
            memory,
        })
    }

    /// The sealed canonical bytes of the session's bundle and its CID. The messages, nearly all of
    /// the bytes, are canonicalised piece by piece in parallel on the blocking pool.
    async fn seal_bundle(
        &self,
        session: &SessionRecord,
        state: SessionState,
        export_id: Uuid,
        label: Option<&str>,
        now: Timestamp,
    ) -> Result<(String, Vec<u8>), ApiError> {
        let count = state.message_count();
        let SessionState {
            pieces,
            snapshot,
            memory,
        } = state;
        let rendering: Vec<_> = pieces
            .into_iter()
            .map(|piece| self.blocking(move || canonical_messages(piece)))
            .collect();
        let mut raw = Vec::new();
        let mut total_cost: Option<f64> = None;
        for piece in rendering {
            let (bytes, cost) = piece
                .await
                .map_err(|e| ApiError::internal("rendering a bundle", e))?;
            raw.push(bytes);
            if let Some(c) = cost {
                total_cost = Some(total_cost.unwrap_or(0.0) + c);
            }
        }
        let mut messages = Vec::with_capacity(raw.iter().map(Vec::len).sum::<usize>() + 8);
        messages.push(b'[');
        for piece in raw.iter().filter(|p| !p.is_empty()) {
            if messages.len() > 1 {
                messages.extend_from_slice(b", ");
            }
            messages.extend_from_slice(piece);
        }
        messages.push(b']');
        let mut envelope = bundle_envelope(
            session,
            snapshot.as_ref(),
            memory.as_ref(),
            count,
            total_cost,
            export_id,
            label,
            now,
        );
        Ok(bundle::seal_with_raw(&mut envelope, "messages", &messages))
    }

    /// A new export of `session` as of `now`: the export row and the sealed bundle's bytes.
    async fn new_export(
        &self,
        session: &SessionRecord,
        state: SessionState,
        label: Option<String>,
        now: Timestamp,
        ttl_secs: i64,
    ) -> Result<(NewExport, Vec<u8>), ApiError> {
        let export_id = Uuid::now_v7();
        let message_count = state.message_count();
        let (cid, bytes) = self
            .seal_bundle(session, state, export_id, label.as_deref(), now)
            .await?;
        let export = NewExport {
            id: export_id,
            session_id: session.id,
            bundle_cid: cid,
            label,
            message_count,
            created_at: now,
            expires_at: now + Duration::seconds(ttl_secs),
            foreign: false,
        };
        Ok((export, bytes))
    }

    /// Builds and seals the bundle, signs the token and stores both (`POST .../export`).
    pub async fn export_session(
        &self,
        session: &SessionRecord,
        req: ExportRequest,
    ) -> Result<Exported, ApiError> {
        let state = self.session_state(session).await?;
        let now = Utc::now();
        let ttl = req.ttl_seconds.unwrap_or(DEFAULT_EXPORT_TTL_SECS);
        let (export, bytes) = self.new_export(session, state, req.label, now, ttl).await?;
        let sealed = if req.include_bundle {
            Some(
                serde_json::from_slice::<Value>(&bytes)
                    .map_err(|e| ApiError::internal("re-reading a sealed bundle", e))?,
            )
        } else {
            None
        };
        let roaming_token = self.sign_export(&export);
        self.store()
            .create_export(
                export.clone(),
                NewBundle {
                    cid: export.bundle_cid.clone(),
                    bytes,
                },
            )
            .await?;
        self.metrics().exports.fetch_add(1, Relaxed);
        Ok(Exported {
            export: record_of(export),
            roaming_token,
            bundle: sealed,
        })
    }

    fn sign_export(&self, export: &NewExport) -> String {
        token::sign(
            &RoamingClaims {
                sub: export.id.to_string(),
                sid: export.session_id.to_string(),
                iat: export.created_at.timestamp(),
                exp: export.expires_at.timestamp(),
            },
            self.secret(),
        )
    }

    /// `GET /v1/sbp/token/{token}`: the export behind a token, without consuming it. An expired token
    /// is still described (with `expired: true`); a bad signature is not.
    pub async fn inspect_token(&self, raw: &str) -> Result<TokenInfo, ApiError> {
        // Verifying at the earliest instant checks the signature and claims but never expiry.
        let claims = token::verify(raw, self.secret(), i64::MIN).map_err(token_error)?;
        let export = self.token_export(&claims).await?.1.ok_or_else(|| {
            ApiError::new(
                ErrorCode::NotFound,
                "the export this token refers to is not stored on this gateway",
            )
        })?;
        Ok(TokenInfo { claims, export })
    }

    /// The stored export a verified token refers to; a token whose claims disagree with the stored
    /// export is invalid.
    async fn token_export(
        &self,
        claims: &RoamingClaims,
    ) -> Result<(Uuid, Option<ExportRecord>), ApiError> {
        let invalid = |why: &str| {
            ApiError::new(
                ErrorCode::TokenInvalid,
                format!("roaming token rejected: {why}"),
            )
        };
        let export_id = Uuid::parse_str(&claims.sub).map_err(|_| invalid("`sub` is not a UUID"))?;
        let Some(export) = self.store().get_export(export_id).await? else {
            return Ok((export_id, None));
        };
        if claims.sid != export.session_id.to_string()
            && Uuid::parse_str(&claims.sid).ok() != Some(export.session_id)
        {
            return Err(invalid("`sid` does not match the export"));
        }
        Ok((export_id, Some(export)))
    }

    /// `POST /v1/sbp/sessions/import`: a token (whose bundle is stored here, or sent along when it was
    /// made by another gateway sharing the secret) or a raw bundle, verified by CID.
    pub async fn import_session(&self, req: ImportRequest) -> Result<Imported, ApiError> {
        let now = Utc::now();
        let ImportRequest {
            roaming_token,
            bundle: sent,
            target_agent_id,
            allow_reuse,
        } = req;
        let mut plan = ImportPlan {
            cid: String::new(),
            export_id: None,
            source: None,
            target_agent_id,
            allow_reuse,
            via_token: roaming_token.is_some(),
            bundle: None,
            export: None,
            consume: None,
        };
        let Some(raw_token) = roaming_token else {
            // A raw bundle: integrity by CID only; nothing to consume.
            let bundle = sent.ok_or_else(|| {
                ApiError::bad_request("send a `roaming_token`, a raw `bundle`, or both")
            })?;
            let (stored, parsed) = received(bundle)?;
            plan.cid = stored.cid.clone();
            plan.bundle = Some(stored);
            plan.export_id = parsed
                .export_id
                .as_deref()
                .and_then(|s| Uuid::parse_str(s).ok());
            plan.source = parsed.session.id.clone();
            return self.adopt_import(plan, parsed, now).await;
        };
        let claims =
            token::verify(&raw_token, self.secret(), now.timestamp()).map_err(token_error)?;
        let (export_id, export) = self.token_export(&claims).await?;
        plan.export_id = Some(export_id);
        plan.consume = (!allow_reuse).then_some(export_id);
        plan.source = Some(claims.sid.clone());
        let parsed = match export {
            Some(export) => {
                if export.imported_at.is_some() && !allow_reuse {
                    return Err(sbp_store::StoreError::Consumed.into());
                }
                let parsed = self.stored_bundle(&export).await?;
                // A bundle sent along with a token this gateway holds must be that bundle.
                if let Some(sent) = &sent {
                    verify_as(sent, &export.bundle_cid)?;
                }
                plan.cid = export.bundle_cid;
                parsed
            }
            None => {
                // Made by another gateway that shares the secret: its bundle must come along.
                let bundle = sent.ok_or_else(|| {
                    ApiError::new(
                        ErrorCode::NotFound,
                        "the export this token refers to is not stored on this gateway; send its \
                         `bundle` along with the token",
                    )
                })?;
                let (stored, parsed) = received(bundle)?;
                plan.cid = stored.cid.clone();
                if parsed.export_id.as_deref() != Some(claims.sub.as_str()) {
                    return Err(ApiError::new(
                        ErrorCode::TokenIntegrity,
                        "the bundle's metadata.export_id is not the token's export",
                    ));
                }
                if parsed.session.id.as_deref() != Some(claims.sid.as_str()) {
                    return Err(ApiError::new(
                        ErrorCode::TokenIntegrity,
                        "the bundle's session.id is not the token's session",
                    ));
                }
                let source_session = Uuid::parse_str(&claims.sid).map_err(|_| {
                    ApiError::new(
                        ErrorCode::TokenInvalid,
                        "roaming token rejected: `sid` is not a UUID",
                    )
                })?;
                plan.export = Some(NewExport {
                    id: export_id,
                    session_id: source_session,
                    bundle_cid: plan.cid.clone(),
                    label: parsed.label.clone(),
                    message_count: parsed.messages.len() as u64,
                    created_at: DateTime::from_timestamp(claims.iat, 0).unwrap_or(now),
                    expires_at: DateTime::from_timestamp(claims.exp, 0).unwrap_or(now),
                    foreign: true,
                });
                plan.bundle = Some(stored);
                parsed
            }
        };
        self.adopt_import(plan, parsed, now).await
    }

    /// The stored bundle of an export, its integrity verified, parsed. What an export stored (the
    /// sealed canonical form) is verified by hashing the bytes as they are, while its messages are
    /// delimited (both passes read the whole bundle, so they run at once), and then parsed in two
    /// halves at once. Any other stored form is verified by recomputing the CID of the parsed bundle.
    async fn stored_bundle(&self, export: &ExportRecord) -> Result<ParsedBundle, ApiError> {
        let stored = self
            .store()
            .get_bundle(&export.bundle_cid)
            .await?
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::TokenIntegrity,
                    "the bundle of this export is missing from storage",
                )
            })?;
        let stored = Arc::new(stored);
        let (hashed, delimited) = {
            let (a, b, cid) = (
                Arc::clone(&stored),
                Arc::clone(&stored),
                export.bundle_cid.clone(),
            );
            tokio::join!(
                self.blocking(move || bundle::sealed_bytes_match(&a, &cid)),
                self.blocking(move || {
                    std::str::from_utf8(&b)
                        .map_err(|e| e.to_string())
                        .and_then(|text| bundle::delimit_messages(text).map_err(|e| e.to_string()))
                }),
            )
        };
        let joined = |e: tokio::task::JoinError| ApiError::internal("reading a bundle", e);
        if hashed.map_err(joined)? {
            let parts = delimited.map_err(joined)?.map_err(malformed)?;
            return self
                .parse_messages(stored, parts.envelope, parts.messages)
                .await;
        }
        let bundle = match serde_json::from_slice::<Value>(&stored) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                return Err(ApiError::new(
                    ErrorCode::TokenIntegrity,
                    "the stored bundle of this export is not a JSON object",
                ));
            }
        };
        verify_as(&bundle, &export.bundle_cid)?;
        parse(bundle)
    }

    /// Parses the delimited messages of `bytes` (in two halves at once when there are many) and
    /// assembles the bundle.
    async fn parse_messages(
        &self,
        bytes: Arc<Vec<u8>>,
        envelope: Map<String, Value>,
        ranges: Vec<Range<usize>>,
    ) -> Result<ParsedBundle, ApiError> {
        let half = if ranges.len() as u64 >= SPLIT_HISTORY_AT {
            ranges.len().div_ceil(2)
        } else {
            ranges.len().max(1)
        };
        let parsing: Vec<_> = ranges
            .chunks(half)
            .enumerate()
            .map(|(n, chunk)| {
                let (bytes, chunk, first) = (Arc::clone(&bytes), chunk.to_vec(), n * half);
                self.blocking(move || {
                    chunk
                        .into_iter()
                        .enumerate()
                        .map(|(j, range)| {
                            let value = serde_json::from_slice(&bytes[range]).map_err(|e| {
                                bundle::BundleError {
                                    path: format!("messages[{}]", first + j),
                                    reason: e.to_string(),
                                }
                            })?;
                            bundle::parse_message(first + j, value)
                        })
                        .collect::<Result<Vec<_>, _>>()
                })
            })
            .collect();
        let mut messages = Vec::with_capacity(ranges.len());
        for piece in parsing {
            let piece = piece
                .await
                .map_err(|e| ApiError::internal("parsing a bundle", e))?
                .map_err(|e| malformed(e.to_string()))?;
            messages.extend(piece);
        }
        bundle::parse_envelope(envelope, messages).map_err(|e| malformed(e.to_string()))
    }

    async fn adopt_import(
        &self,
        plan: ImportPlan,
        parsed: ParsedBundle,
        now: Timestamp,
    ) -> Result<Imported, ApiError> {
        let ParsedBundle {
            session: origin,
            messages: bundle_messages,
            memory,
            state_snapshot,
            label,
            ..
        } = parsed;
        let session_token = auth::new_session_token();
        let agent_id = plan
            .target_agent_id
            .clone()
            .or_else(|| origin.agent_id.clone().filter(|a| !a.is_empty()))
            .unwrap_or_else(new_agent_id);
        let new_id = Uuid::now_v7();
        let assistant_turns = bundle_messages
            .iter()
            .filter(|m| m.role == "assistant")
            .count() as u64;
        let mut messages: Vec<NewMessage> = bundle_messages
            .into_iter()
            .map(|m| restored_message(m, now))
            .collect();
        let restored = messages.len() as u64;
        let source_text = plan.source.as_deref().unwrap_or("an unknown session");
        let export_text = plan
            .export_id
            .map(|e| format!(", export {e}"))
            .unwrap_or_default();
        messages.push(system_message(
            format!(
                "This session was imported from {source_text} (bundle {}{export_text}) on {}. \
                 The conversation above is its history.",
                plan.cid,
                iso(&now)
            ),
            now,
        ));
        let (memory, memory_skipped) = restorable_memory(memory);
        let snapshot = restored_snapshot(state_snapshot.as_ref(), restored, now);
        let step_count = origin
            .step_count
            .or_else(|| snapshot.as_ref().map(|s| s.step_count))
            .unwrap_or(assistant_turns);
        let link = LinkRecord {
            id: Uuid::now_v7(),
            kind: LinkKind::Import,
            from_session: plan.source.as_deref().and_then(|s| Uuid::parse_str(s).ok()),
            to_session: new_id,
            from_agent: origin.agent_id.clone(),
            to_agent: Some(agent_id.clone()),
            export_id: plan.export_id,
            label,
            reason: None,
            fork_point: Some(restored),
            reused: plan.allow_reuse,
            created_at: now,
        };
        let snapshot_restored = snapshot.is_some();
        let memory_restored = memory.is_some();
        let session = self
            .store()
            .adopt_session(AdoptSession {
                session: new_session(new_id, agent_id, &session_token, now),
                status: SessionStatus::Idle,
                step_count,
                last_task: origin.last_task,
                model: origin.model,
                messages,
                snapshot,
                memory,
                bundle: plan.bundle,
                export: plan.export,
                consume_export: plan.consume,
                link: Some(link),
                suspend: None,
                now,
            })
            .await?;
        self.metrics().imports.fetch_add(1, Relaxed);
        self.metrics().sessions_created.fetch_add(1, Relaxed);
        Ok(Imported {
            session,
            session_token,
            export_id: plan.export_id,
            source_session_id: plan.source,
            bundle_cid: plan.cid,
            messages_restored: restored,
            memory_restored,
            memory_skipped,
            snapshot_restored,
            allow_reuse: plan.allow_reuse,
            via_token: plan.via_token,
        })
    }

    /// `POST .../handoff`: export, import under `to_agent_id` with a bridge message first, and suspend
    /// the source: one store write, so a crash leaves either all of it or none.
    pub async fn handoff(
        &self,
        source: &SessionRecord,
        req: HandoffRequest,
    ) -> Result<HandedOff, ApiError> {
        if source.status.is_terminal() {
            return Err(ApiError::conflict(format!(
                "a {} session cannot be handed off",
                source.status
            )));
        }
        let state = self.session_state(source).await?;
        let now = Utc::now();
        let label = Some(format!("handoff to {}", req.to_agent_id))
            .filter(|l| l.chars().count() <= MAX_LABEL_CHARS);
        let copied: Vec<NewMessage> = state.messages().map(copied_message).collect();
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
        };
        let session = self
            .store()
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
                sbp_store::StoreError::Conflict(_) => ApiError::conflict(
                    "the source session's status changed; it cannot be handed off now",
                ),
                other => other.into(),
            })?;
        self.metrics().handoffs.fetch_add(1, Relaxed);
        self.metrics().sessions_created.fetch_add(1, Relaxed);
        let source = self
            .store()
            .get_session(source.id)
            .await?
            .ok_or_else(|| ApiError::session_not_found(source.id))?;
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
    /// or, while a turn is in flight, the last completed turn.
    pub async fn fork(
        &self,
        origin: &SessionRecord,
        label: Option<String>,
    ) -> Result<Forked, ApiError> {
        if origin.status.is_terminal() {
            return Err(ApiError::conflict(format!(
                "a {} session cannot be forked",
                origin.status
            )));
        }
        let state = self.session_state(origin).await?;
        // A turn is in flight when its turn-level pre_action is the newest turn-level snapshot.
        let in_flight = matches!(
            self.turn_snapshots(origin.id).await?.first(),
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
        let messages: Vec<NewMessage> = state.messages().take(point).map(copied_message).collect();
        let snapshot = state
            .snapshot
            .as_ref()
            .filter(|s| s.message_count <= point_msg)
            .map(|s| copied_snapshot(s, 0, now));
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
        };
        let session = self
            .store()
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
        self.metrics().forks.fetch_add(1, Relaxed);
        self.metrics().sessions_created.fetch_add(1, Relaxed);
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

    pub async fn lineage(&self, session: &SessionRecord) -> Result<Lineage, ApiError> {
        Ok(self.store().lineage(session.id).await?)
    }

    /// The session's memory document (an empty one of the built-in schema when none was stored).
    pub async fn memory(&self, session: &SessionRecord) -> Result<MemoryRecord, ApiError> {
        Ok(self
            .store()
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
    ) -> Result<MemoryRecord, ApiError> {
        let schema_id = schema_id.unwrap_or_else(|| MEMORY_SCHEMA_KV.to_owned());
        if !KNOWN_MEMORY_SCHEMAS.contains(&schema_id.as_str()) {
            return Err(ApiError::bad_request(format!(
                "unknown memory schema_id '{schema_id}'; this gateway knows {KNOWN_MEMORY_SCHEMAS:?}"
            )));
        }
        if !payload.is_object() {
            return Err(ApiError::bad_request("`payload` must be a JSON object"));
        }
        Ok(self
            .store()
            .put_memory(session.id, schema_id, payload, Utc::now())
            .await?)
    }
}

/// What an import writes besides the bundle's content.
struct ImportPlan {
    /// The verified CID of the bundle.
    cid: String,
    export_id: Option<Uuid>,
    /// The source session id as the token or bundle names it.
    source: Option<String>,
    target_agent_id: Option<String>,
    allow_reuse: bool,
    via_token: bool,
    /// To store (raw and foreign bundles).
    bundle: Option<NewBundle>,
    /// A foreign export to record.
    export: Option<NewExport>,
    /// The export this import consumes.
    consume: Option<Uuid>,
}

/// The CID of a bundle (a JSON object), checked against the digest it carries.
fn verify(bundle: &Value) -> Result<String, ApiError> {
    let map = bundle
        .as_object()
        .ok_or_else(|| ApiError::bad_request("a bundle must be a JSON object"))?;
    bundle::verify_cid(map).map_err(cid_error)
}

/// [`verify`], and the CID must be `expected` (the one an export recorded).
fn verify_as(bundle: &Value, expected: &str) -> Result<(), ApiError> {
    let cid = verify(bundle)?;
    if cid == expected {
        return Ok(());
    }
    Err(cid_error(CidError::Mismatch {
        claimed: expected.to_owned(),
        computed: cid,
    }))
}

/// A bundle received in a request: verified by its CID and sealed for storage in one serialisation,
/// then parsed.
fn received(mut bundle: Value) -> Result<(NewBundle, ParsedBundle), ApiError> {
    let map = bundle
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("a bundle must be a JSON object"))?;
    let (cid, bytes) = bundle::verify_and_seal(map).map_err(cid_error)?;
    Ok((NewBundle { cid, bytes }, parse(bundle)?))
}

fn malformed(reason: String) -> ApiError {
    ApiError::new(ErrorCode::BadRequest, format!("malformed bundle: {reason}"))
}

fn parse(bundle: Value) -> Result<ParsedBundle, ApiError> {
    bundle::parse_bundle(bundle).map_err(|e| malformed(e.to_string()))
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

/// The canonical bytes of a run of bundle messages (`m1, m2, ...`, no brackets) and their summed
/// cost when any message has one. Frees the records where it runs (off the request path).
fn canonical_messages(records: Vec<MessageRecord>) -> (Vec<u8>, Option<f64>) {
    let mut out = Vec::with_capacity(records.len() * 512);
    let mut cost: Option<f64> = None;
    for (i, m) in records.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        write_bundle_message(m, &mut out);
        if let Some(c) = m.cost_usd {
            cost = Some(cost.unwrap_or(0.0) + c);
        }
    }
    (out, cost)
}

/// A stored message as a bundle entry: the chat message object plus the gateway's per-message facts
/// (`role`, `model_used`, `cost_usd`, `created_at`), written without building the merged object.
fn write_bundle_message(m: &MessageRecord, out: &mut Vec<u8>) {
    let role = Value::String(m.role.clone());
    let model_used = json!(m.model_used);
    let cost_usd = json!(m.cost_usd);
    let created_at = Value::String(iso(&m.created_at));
    let extra = [
        ("cost_usd", &cost_usd),
        ("created_at", &created_at),
        ("model_used", &model_used),
        ("role", &role),
    ];
    match &m.body {
        Value::Object(body) => canonical::write_object_with(body, &extra, out),
        other => {
            let mut body = Map::new();
            body.insert("content".to_owned(), other.clone());
            canonical::write_object_with(&body, &extra, out);
        }
    }
}

/// The bundle envelope (SPEC 8.2 and the seeds) without its messages, with the names of spec, docs
/// and reference server.
#[allow(clippy::too_many_arguments)] // One value per envelope field; a struct would only rename them.
fn bundle_envelope(
    session: &SessionRecord,
    snapshot: Option<&SnapshotRecord>,
    memory: Option<&MemoryRecord>,
    message_count: u64,
    total_cost: Option<f64>,
    export_id: Uuid,
    label: Option<&str>,
    now: Timestamp,
) -> Map<String, Value> {
    let memory = match memory {
        Some(m) => json!({ "schema_id": m.schema_id, "payload": m.payload }),
        None => json!({ "schema_id": MEMORY_SCHEMA_KV, "payload": {} }),
    };
    let snapshot = snapshot.map_or(Value::Null, |s| {
        json!({
            "snapshot_id": s.id,
            "kind": s.kind.as_str(),
            "step": s.step_count,
            "step_count": s.step_count,
            "message_count": s.message_count,
            "model": s.model,
            "current_task": s.current_task,
            "created_at": iso(&s.created_at),
            "state": s.state,
        })
    });
    let body = json!({
        "sbp_version": bundle::BUNDLE_FORMAT_VERSION,
        "exported_at": iso(&now),
        "label": label,
        "session": {
            "id": session.id,
            "agent_id": session.agent_id,
            "agent_external_id": session.agent_id,
            "status": session.status.as_str(),
            "last_task": session.last_task,
            "created_at": iso(&session.created_at),
            "step_count": session.step_count,
            "message_count": message_count,
            "model": session.model,
        },
        "memory": memory,
        "state_snapshot": snapshot,
        "metadata": {
            "export_id": export_id,
            "message_count": message_count,
            "total_cost_usd": total_cost,
            "exported_by": concat!("sbp-gateway/", env!("CARGO_PKG_VERSION")),
        },
    });
    match body {
        Value::Object(m) => m,
        // `json!` of an object literal is always an object.
        _ => Map::new(),
    }
}

fn restored_message(m: BundleMessage, now: Timestamp) -> NewMessage {
    let created_at = m
        .created_at
        .as_deref()
        .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
        .map_or(now, |t| t.with_timezone(&Utc));
    NewMessage {
        role: m.role,
        body: m.body,
        model_used: m.model_used,
        cost_usd: m.cost_usd,
        created_at,
    }
}

fn copied_message(m: &MessageRecord) -> NewMessage {
    NewMessage {
        role: m.role.clone(),
        body: m.body.clone(),
        model_used: m.model_used.clone(),
        cost_usd: m.cost_usd,
        created_at: m.created_at,
    }
}

fn system_message(content: String, now: Timestamp) -> NewMessage {
    NewMessage {
        role: "system".to_owned(),
        body: json!({ "role": "system", "content": content }),
        model_used: None,
        cost_usd: None,
        created_at: now,
    }
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

/// The bundle's `state_snapshot` as a snapshot of the new session, whose first `restored` messages
/// are the bundle's. Ours carry `step_count`/`message_count`; the reference
/// server's carry `step` and a copy of the `messages`.
fn restored_snapshot(
    snap: Option<&Value>,
    restored: u64,
    now: Timestamp,
) -> Option<RestoredSnapshot> {
    let s = snap?.as_object()?;
    let step_count = s
        .get("step_count")
        .or_else(|| s.get("step"))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let message_count = s
        .get("message_count")
        .and_then(Value::as_u64)
        .or_else(|| {
            s.get("messages")
                .and_then(Value::as_array)
                .map(|m| m.len() as u64)
        })
        .unwrap_or(restored)
        .min(restored);
    let kind = s
        .get("kind")
        .and_then(Value::as_str)
        .and_then(SnapshotKind::parse)
        .unwrap_or(SnapshotKind::Checkpoint);
    let state = match s.get("state") {
        Some(v @ Value::Object(_)) => v.clone(),
        _ => {
            // A foreign snapshot: keep what it says about itself, minus the copy of the transcript.
            let mut rest = s.clone();
            rest.remove("messages");
            Value::Object(rest)
        }
    };
    Some(RestoredSnapshot {
        snapshot: NewSnapshot {
            id: Uuid::now_v7(),
            kind,
            model: s.get("model").and_then(Value::as_str).map(str::to_owned),
            current_task: s
                .get("current_task")
                .and_then(Value::as_str)
                .map(str::to_owned),
            created_at: now,
            state,
        },
        step_count,
        message_count,
    })
}

/// The bundle's memory when its schema is one this gateway knows; otherwise why it is skipped.
fn restorable_memory(memory: Option<BundleMemory>) -> (Option<(String, Value)>, Option<String>) {
    match memory {
        None => (
            None,
            Some("the bundle carries no memory schema_id".to_owned()),
        ),
        Some(m) if !KNOWN_MEMORY_SCHEMAS.contains(&m.schema_id.as_str()) => (
            None,
            Some(format!("unknown memory schema_id '{}'", m.schema_id)),
        ),
        Some(m) if !m.payload.is_object() => (
            None,
            Some(format!(
                "memory payload of '{}' is not an object",
                m.schema_id
            )),
        ),
        Some(m) => (Some((m.schema_id, m.payload)), None),
    }
}
