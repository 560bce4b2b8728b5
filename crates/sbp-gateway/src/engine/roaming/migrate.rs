//! Roaming's part in moving a session between gateways (federation): the bundle the holder
//! stores for the handover, and the adoption of a moved session under its own id and token with
//! its transcript verbatim (no "imported from" note: it is the same session, continuing).

use chrono::Utc;
use sbp_protocol::SessionStatus;
use sbp_protocol::federation::HandoverEnvelope;
use sbp_store::{AdoptMigrated, AdoptSession, NewSession, NewTetherEntry, SessionRecord};
use serde_json::{Value, json};

use super::import::{received, restorable_memory, restored_message, restored_snapshot};
use super::{ExportRequest, Roaming};
use crate::engine::sessions::new_agent_id;
use crate::error::Error;

/// How long the export made for a handover stays importable by token (its token is never
/// handed out; the bundle is fetched by CID).
const HANDOVER_EXPORT_TTL_SECS: i64 = 600;

impl Roaming {
    /// Stores the session's bundle for a handover; its CID.
    pub async fn handover_bundle(&self, session: &SessionRecord) -> Result<String, Error> {
        let out = self
            .export(
                session,
                ExportRequest {
                    ttl_seconds: Some(HANDOVER_EXPORT_TTL_SECS),
                    label: Some("handover".to_owned()),
                    include_bundle: false,
                },
            )
            .await?;
        Ok(out.export.bundle_cid)
    }

    /// Adopts a moved session: `bundle` (whose CID the caller verified against the envelope's)
    /// under the envelope's id and token hash, with the carried tether entries, held `incoming`
    /// until the holder commits.
    pub async fn adopt_migrated(
        &self,
        bundle: Value,
        envelope: &HandoverEnvelope,
        tether: Vec<(u64, NewTetherEntry)>,
        from_gateway: &str,
        from_url: &str,
    ) -> Result<SessionRecord, Error> {
        let now = Utc::now();
        let (stored, parsed) = received(bundle)?;
        if stored.cid != envelope.bundle_cid {
            return Err(Error::Integrity {
                message: "the handed-over bundle is not the envelope's".into(),
                mismatch: Some((envelope.bundle_cid.clone(), stored.cid.clone())),
            });
        }
        self.check_importable(&parsed)?;
        let origin = parsed.session;
        let agent_id = envelope
            .agent_id
            .clone()
            .or_else(|| origin.agent_id.clone().filter(|a| !a.is_empty()))
            .unwrap_or_else(new_agent_id);
        let assistant_turns = parsed
            .messages
            .iter()
            .filter(|m| m.role == "assistant")
            .count() as u64;
        let messages: Vec<_> = parsed
            .messages
            .into_iter()
            .map(|m| restored_message(m, now))
            .collect();
        let restored = messages.len() as u64;
        let (memory, _) = restorable_memory(parsed.memory);
        let snapshot = restored_snapshot(parsed.state_snapshot, restored, now);
        let step_count = origin
            .step_count
            .or_else(|| snapshot.as_ref().map(|s| s.step_count))
            .unwrap_or(assistant_turns);
        let created_at = origin
            .created_at
            .as_deref()
            .and_then(sbp_protocol::time::parse)
            .unwrap_or(now);
        let status = origin
            .status
            .as_deref()
            .and_then(SessionStatus::parse)
            .filter(|s| *s != SessionStatus::Running)
            .unwrap_or(SessionStatus::Idle);
        let session = self
            .inner
            .store
            .adopt_migrated(AdoptMigrated {
                adopt: AdoptSession {
                    session: NewSession {
                        id: envelope.session_id,
                        agent_id,
                        token_hash: envelope.token_hash.clone(),
                        created_at,
                        metadata: json!({}),
                    },
                    status,
                    step_count,
                    last_task: origin.last_task,
                    model: origin.model,
                    messages,
                    snapshot,
                    memory,
                    bundle: Some(stored),
                    export: None,
                    consume_export: None,
                    link: None,
                    suspend: None,
                    now,
                },
                tether,
                tether_next_seq: envelope.next_seq,
                epoch: envelope.epoch,
                from_gateway: from_gateway.to_owned(),
                from_url: from_url.to_owned(),
                migration_id: envelope.migration_id,
            })
            .await?;
        Ok(session)
    }
}
