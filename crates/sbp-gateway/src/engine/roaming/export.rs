//! Export: a session's transcript, snapshot and memory sealed into a content-addressed bundle
//! (its messages canonicalised in parallel pieces), a signed roaming token naming the export, and
//! inspection of such a token.

use chrono::{Duration, Utc};
use sbp_protocol::bundle::{self, Envelope, EnvelopeSession, EnvelopeSnapshot, MessageOut};
use sbp_protocol::token::{self, RoamingClaims};
use sbp_store::{ExportRecord, MessageRecord, NewBundle, NewExport, SessionRecord, Timestamp};
use serde_json::Value;
use uuid::Uuid;

use super::{
    DEFAULT_EXPORT_TTL_SECS, ExportRequest, Exported, Roaming, SessionState, TokenInfo, record_of,
    token_error,
};
use crate::error::Error;
use sbp_protocol::time::iso;

impl Roaming {
    /// The sealed canonical bytes of the session's bundle and its CID. The messages, nearly all of
    /// the bytes, are canonicalised piece by piece in parallel on the blocking pool.
    async fn seal_bundle(
        &self,
        session: &SessionRecord,
        state: SessionState,
        export_id: Uuid,
        label: Option<&str>,
        now: Timestamp,
    ) -> Result<(String, Vec<u8>), Error> {
        let count = state.message_count();
        let SessionState {
            pieces,
            snapshot,
            memory,
        } = state;
        let rendering: Vec<_> = pieces
            .into_iter()
            .map(|piece| self.inner.tasks.blocking(move || canonical_messages(piece)))
            .collect();
        let mut raw = Vec::new();
        let mut total_cost: Option<f64> = None;
        for piece in rendering {
            let (bytes, cost) = piece
                .await
                .map_err(|e| Error::internal("rendering a bundle", e))?;
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
        let (exported_at, created_at) = (iso(&now), iso(&session.created_at));
        let snapshot_at = snapshot.as_ref().map(|s| iso(&s.created_at));
        let mut envelope = Envelope {
            exported_at: &exported_at,
            label,
            session: EnvelopeSession {
                id: session.id,
                agent_id: &session.agent_id,
                status: session.status.as_str(),
                last_task: session.last_task.as_deref(),
                created_at: &created_at,
                step_count: session.step_count,
                model: session.model.as_deref(),
            },
            memory: memory.as_ref().map(|m| (m.schema_id.as_str(), &m.payload)),
            snapshot: snapshot
                .as_ref()
                .zip(snapshot_at.as_deref())
                .map(|(s, created_at)| EnvelopeSnapshot {
                    id: s.id,
                    kind: s.kind.as_str(),
                    step_count: s.step_count,
                    message_count: s.message_count,
                    model: s.model.as_deref(),
                    current_task: s.current_task.as_deref(),
                    created_at,
                    state: &s.state,
                }),
            message_count: count,
            total_cost_usd: total_cost,
            export_id,
            exported_by: concat!("sbp-gateway/", env!("CARGO_PKG_VERSION")),
        }
        .to_map();
        Ok(bundle::seal_with_raw(&mut envelope, "messages", &messages))
    }

    /// A new export of `session` as of `now`: the export row and the sealed bundle's bytes.
    pub(super) async fn new_export(
        &self,
        session: &SessionRecord,
        state: SessionState,
        label: Option<String>,
        now: Timestamp,
        ttl_secs: i64,
    ) -> Result<(NewExport, Vec<u8>), Error> {
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
    pub async fn export(
        &self,
        session: &SessionRecord,
        req: ExportRequest,
    ) -> Result<Exported, Error> {
        let state = self.session_state(session).await?;
        let now = Utc::now();
        let ttl = req.ttl_seconds.unwrap_or(DEFAULT_EXPORT_TTL_SECS);
        let (export, bytes) = self.new_export(session, state, req.label, now, ttl).await?;
        let sealed = if req.include_bundle {
            Some(
                serde_json::from_slice::<Value>(&bytes)
                    .map_err(|e| Error::internal("re-reading a sealed bundle", e))?,
            )
        } else {
            None
        };
        let roaming_token = self.sign_export(&export);
        self.inner
            .store
            .create_export(
                export.clone(),
                NewBundle {
                    cid: export.bundle_cid.clone(),
                    bytes,
                },
            )
            .await?;
        self.inner.metrics.exports.inc();
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
                iss: self.issuer(),
            },
            &self.inner.config.secret,
        )
    }

    /// `GET /v1/sbp/token/{token}`: the export behind a token, without consuming it. An expired token
    /// is still described (with `expired: true`); a bad signature is not.
    pub async fn inspect_token(&self, raw: &str) -> Result<TokenInfo, Error> {
        // Verifying at the earliest instant checks the signature and claims but never expiry.
        let claims = self.verify_token(raw, i64::MIN).map_err(token_error)?;
        let export = self.token_export(&claims).await?.1.ok_or_else(|| {
            Error::NotFound("the export this token refers to is not stored on this gateway".into())
        })?;
        Ok(TokenInfo { claims, export })
    }

    /// The stored export a verified token refers to; a token whose claims disagree with the stored
    /// export is invalid.
    pub(super) async fn token_export(
        &self,
        claims: &RoamingClaims,
    ) -> Result<(Uuid, Option<ExportRecord>), Error> {
        let invalid = |why: &str| Error::TokenInvalid(why.to_owned());
        let export_id = Uuid::parse_str(&claims.sub).map_err(|_| invalid("`sub` is not a UUID"))?;
        let Some(export) = self.inner.store.get_export(export_id).await? else {
            return Ok((export_id, None));
        };
        if claims.sid != export.session_id.to_string()
            && Uuid::parse_str(&claims.sid).ok() != Some(export.session_id)
        {
            return Err(invalid("`sid` does not match the export"));
        }
        Ok((export_id, Some(export)))
    }
}

/// The canonical bytes of a run of stored messages as bundle entries (see
/// [`bundle::write_messages`]). Frees the records where it runs (off the request path).
fn canonical_messages(records: Vec<MessageRecord>) -> (Vec<u8>, Option<f64>) {
    let created: Vec<String> = records.iter().map(|m| iso(&m.created_at)).collect();
    bundle::write_messages(
        records
            .iter()
            .zip(&created)
            .map(|(m, created_at)| MessageOut {
                body: &m.body,
                role: &m.role,
                model_used: m.model_used.as_deref(),
                cost_usd: m.cost_usd,
                created_at,
            }),
    )
}
