//! Import: a roaming token (whose bundle is stored here, or sent along when another gateway
//! sharing the secret made it) or a raw bundle, verified by its CID, adopted as a new session with
//! a note of where it came from, in one write that also consumes the token.

use std::ops::Range;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use sbp_protocol::bundle::{
    self, BundleMemory, BundleMessage, BundleSnapshot, CidError, ParsedBundle,
};
use sbp_protocol::token::RoamingClaims;
use sbp_protocol::{SessionStatus, SnapshotKind};
use sbp_store::{
    AdoptSession, ExportRecord, LinkKind, LinkRecord, NewBundle, NewExport, NewMessage,
    NewSnapshot, RestoredSnapshot, StoreError, Timestamp,
};
use serde_json::{Map, Value};
use uuid::Uuid;

use super::{
    ImportRequest, Imported, KNOWN_MEMORY_SCHEMAS, MAX_AGENT_ID_CHARS, MAX_LABEL_CHARS, Roaming,
    SPLIT_HISTORY_AT, cid_error, integrity, new_session, system_message, token_error,
};
use crate::auth;
use crate::engine::sessions::new_agent_id;
use crate::error::Error;
use crate::limits::{Size, stored_bytes};
use sbp_protocol::time::iso;

impl Roaming {
    /// `POST /v1/sbp/sessions/import`: a token (whose bundle is stored here, or sent along when it was
    /// made by another gateway sharing the secret) or a raw bundle, verified by CID.
    pub async fn import(&self, req: ImportRequest) -> Result<Imported, Error> {
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
            let bundle = sent
                .ok_or_else(|| Error::invalid("send a `roaming_token`, a raw `bundle`, or both"))?;
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
        let claims = self
            .verify_token(&raw_token, now.timestamp())
            .map_err(token_error)?;
        self.import_claimed(claims, sent, plan, now).await
    }

    /// A token redeemed at the gateway that minted it (federation), with the bundle fetched by
    /// the CID it answered: recorded here as a foreign export consumed by this import, so the
    /// token imports here once, as a token that gateway shares would.
    pub async fn import_redeemed(
        &self,
        claims: RoamingClaims,
        bundle: Value,
        target_agent_id: Option<String>,
        allow_reuse: bool,
    ) -> Result<Imported, Error> {
        let plan = ImportPlan {
            cid: String::new(),
            export_id: None,
            source: None,
            target_agent_id,
            allow_reuse,
            via_token: true,
            bundle: None,
            export: None,
            consume: None,
        };
        self.import_claimed(claims, Some(bundle), plan, Utc::now())
            .await
    }

    /// The import of a token whose claims are verified: its export's bundle (stored here, or sent
    /// along for a foreign export), consumed unless `allow_reuse`.
    async fn import_claimed(
        &self,
        claims: RoamingClaims,
        sent: Option<Value>,
        mut plan: ImportPlan,
        now: DateTime<Utc>,
    ) -> Result<Imported, Error> {
        let allow_reuse = plan.allow_reuse;
        let (export_id, export) = self.token_export(&claims).await?;
        plan.export_id = Some(export_id);
        plan.consume = (!allow_reuse).then_some(export_id);
        plan.source = Some(claims.sid.clone());
        let parsed = match export {
            Some(export) => {
                if export.imported_at.is_some() && !allow_reuse {
                    return Err(StoreError::Consumed.into());
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
                    Error::NotFound(
                        "the export this token refers to is not stored on this gateway; send its \
                         `bundle` along with the token"
                            .into(),
                    )
                })?;
                let (stored, parsed) = received(bundle)?;
                plan.cid = stored.cid.clone();
                if parsed.export_id.as_deref() != Some(claims.sub.as_str()) {
                    return Err(integrity(
                        "the bundle's metadata.export_id is not the token's export",
                    ));
                }
                if parsed.session.id.as_deref() != Some(claims.sid.as_str()) {
                    return Err(integrity(
                        "the bundle's session.id is not the token's session",
                    ));
                }
                let source_session = Uuid::parse_str(&claims.sid)
                    .map_err(|_| Error::TokenInvalid("`sid` is not a UUID".into()))?;
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
    async fn stored_bundle(&self, export: &ExportRecord) -> Result<ParsedBundle, Error> {
        let stored = self
            .inner
            .store
            .get_bundle(&export.bundle_cid)
            .await?
            .ok_or_else(|| integrity("the bundle of this export is missing from storage"))?;
        let stored = Arc::new(stored);
        let (hashed, delimited) = {
            let (a, b, cid) = (
                Arc::clone(&stored),
                Arc::clone(&stored),
                export.bundle_cid.clone(),
            );
            tokio::join!(
                self.inner
                    .tasks
                    .blocking(move || bundle::sealed_bytes_match(&a, &cid)),
                self.inner.tasks.blocking(move || {
                    std::str::from_utf8(&b)
                        .map_err(|e| e.to_string())
                        .and_then(|text| bundle::delimit_messages(text).map_err(|e| e.to_string()))
                }),
            )
        };
        let joined = |e: tokio::task::JoinError| Error::internal("reading a bundle", e);
        if hashed.map_err(joined)? {
            let parts = delimited
                .map_err(joined)?
                .map_err(|reason| Error::InvalidBundle {
                    path: "$".to_owned(),
                    reason,
                })?;
            return self
                .parse_messages(stored, parts.envelope, parts.messages)
                .await;
        }
        let bundle = match serde_json::from_slice::<Value>(&stored) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                return Err(integrity(
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
    ) -> Result<ParsedBundle, Error> {
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
                self.inner.tasks.blocking(move || {
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
                .map_err(|e| Error::internal("parsing a bundle", e))?
                .map_err(malformed)?;
            messages.extend(piece);
        }
        bundle::parse_envelope(envelope, messages).map_err(malformed)
    }

    /// Refuses a bundle whose content is beyond what this gateway stores: a message or a
    /// transcript past the configured limits (with the note the import adds), an agent id or a
    /// label longer than a session or lineage takes.
    pub(super) fn check_importable(&self, parsed: &ParsedBundle) -> Result<(), Error> {
        let limits = &self.inner.config.limits;
        let refuse = |path: String, reason: String| Error::InvalidBundle { path, reason };
        let mut total = Size::default();
        for (i, m) in parsed.messages.iter().enumerate() {
            let bytes = stored_bytes(&m.body);
            if bytes > limits.max_message_bytes as u64 {
                return Err(refuse(
                    format!("messages[{i}]"),
                    format!(
                        "is {bytes} bytes of JSON; a message takes at most {} \
                         (max_message_bytes)",
                        limits.max_message_bytes
                    ),
                ));
            }
            total.messages += 1;
            total.bytes += bytes;
        }
        // The import appends its provenance note.
        if total.messages + 1 > limits.max_session_messages {
            return Err(refuse(
                "messages".to_owned(),
                format!(
                    "holds {} messages; a session takes at most {} with the import's note \
                     (max_session_messages)",
                    total.messages, limits.max_session_messages
                ),
            ));
        }
        if total.bytes > limits.max_session_bytes {
            return Err(refuse(
                "messages".to_owned(),
                format!(
                    "holds {} bytes of messages; a session takes at most {} (max_session_bytes)",
                    total.bytes, limits.max_session_bytes
                ),
            ));
        }
        if let Some(agent) = &parsed.session.agent_id
            && agent.chars().count() > MAX_AGENT_ID_CHARS
        {
            return Err(refuse(
                "session.agent_external_id".to_owned(),
                format!("must be at most {MAX_AGENT_ID_CHARS} characters"),
            ));
        }
        if let Some(label) = &parsed.label
            && label.chars().count() > MAX_LABEL_CHARS
        {
            return Err(refuse(
                "label".to_owned(),
                format!("must be at most {MAX_LABEL_CHARS} characters"),
            ));
        }
        Ok(())
    }

    async fn adopt_import(
        &self,
        plan: ImportPlan,
        parsed: ParsedBundle,
        now: Timestamp,
    ) -> Result<Imported, Error> {
        self.check_importable(&parsed)?;
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
        let snapshot = restored_snapshot(state_snapshot, restored, now);
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
            peer_gateway: None,
        };
        let snapshot_restored = snapshot.is_some();
        let memory_restored = memory.is_some();
        let session = self
            .inner
            .store
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
        self.inner.metrics.imports.inc();
        self.inner.metrics.sessions_created.inc();
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
fn verify(bundle: &Value) -> Result<String, Error> {
    let map = bundle
        .as_object()
        .ok_or_else(|| Error::invalid("a bundle must be a JSON object"))?;
    bundle::verify_cid(map).map_err(cid_error)
}

/// [`verify`], and the CID must be `expected` (the one an export recorded).
fn verify_as(bundle: &Value, expected: &str) -> Result<(), Error> {
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
pub(super) fn received(mut bundle: Value) -> Result<(NewBundle, ParsedBundle), Error> {
    let map = bundle
        .as_object_mut()
        .ok_or_else(|| Error::invalid("a bundle must be a JSON object"))?;
    let (cid, bytes) = bundle::verify_and_seal(map).map_err(cid_error)?;
    Ok((NewBundle { cid, bytes }, parse(bundle)?))
}

fn malformed(e: bundle::BundleError) -> Error {
    Error::InvalidBundle {
        path: e.path,
        reason: e.reason,
    }
}

fn parse(bundle: Value) -> Result<ParsedBundle, Error> {
    bundle::parse_bundle(bundle).map_err(malformed)
}

pub(super) fn restored_message(m: BundleMessage, now: Timestamp) -> NewMessage {
    NewMessage {
        role: m.role,
        body: m.body.into(),
        model_used: m.model_used,
        cost_usd: m.cost_usd,
        created_at: m.created_at.unwrap_or(now),
    }
}

/// The bundle's `state_snapshot` as a snapshot of the new session, whose first `restored` messages
/// are the bundle's.
pub(super) fn restored_snapshot(
    snap: Option<BundleSnapshot>,
    restored: u64,
    now: Timestamp,
) -> Option<RestoredSnapshot> {
    let s = snap?;
    Some(RestoredSnapshot {
        snapshot: NewSnapshot {
            id: Uuid::now_v7(),
            kind: s.kind.unwrap_or(SnapshotKind::Checkpoint),
            model: s.model,
            current_task: s.current_task,
            created_at: now,
            state: s.state,
        },
        step_count: s.step_count,
        message_count: s.message_count.unwrap_or(restored).min(restored),
    })
}

/// The bundle's memory when its schema is one this gateway knows; otherwise why it is skipped.
pub(super) fn restorable_memory(
    memory: Option<BundleMemory>,
) -> (Option<(String, Value)>, Option<String>) {
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
