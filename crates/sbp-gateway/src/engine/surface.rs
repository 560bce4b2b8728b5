//! Attached surfaces: the ATTACH_SESSION handshake, tether drain, live delivery of completed turns,
//! ACKs and detach. The transport owns the socket and calls these; each returns protocol frames.

use std::sync::atomic::Ordering::Relaxed;

use chrono::Utc;
use sbp_protocol::frames::{AttachSession, SessionAttached, TetherTurn, TurnChunk, TurnComplete};
use sbp_protocol::{ServerFrame, SessionStatus, SurfaceContext};
use sbp_store::TetherEntry;
use tokio::sync::mpsc;
use uuid::Uuid;

use super::hub::{ConnMsg, TurnDone};
use super::{Gateway, iso};
use crate::auth;

/// Protocol extensions advertised in SESSION_ATTACHED.
pub const EXTENSIONS: [&str; 2] = ["ack", "last_seq"];
/// Turns drained in one attach; any beyond are delivered by the connection's periodic catch-up.
const DRAIN_LIMIT: u32 = 100_000;
/// A tethered turn older than this that a connection has not yet sent is caught up by its poll.
const CATCH_UP_AGE_MS: i64 = 2_000;

/// Why an attach was refused; each maps to a frame and close code.
#[derive(Debug, Clone, PartialEq)]
pub enum AttachError {
    /// SESSION_NOT_FOUND, 4004.
    NotFound(String),
    /// FORBIDDEN, 4003.
    Forbidden(String),
    /// PROTOCOL_ERROR, 1003.
    Protocol(String),
    /// PROTOCOL_ERROR, 1011: the gateway could not complete the attach.
    Internal(String),
}

/// One attached connection's delivery state.
#[derive(Debug)]
pub struct Delivery {
    pub session_id: Uuid,
    pub conn_id: u64,
    /// The surface sent `last_seq` or an ACK: turns leave the tether only when acknowledged.
    pub ack_mode: bool,
    /// Highest tether seq sent on this connection.
    last_sent: u64,
    /// Next `turn_index` for a TETHER_TURN on this connection.
    tether_index: u64,
}

pub struct Attached {
    pub delivery: Delivery,
    pub inbox: mpsc::Receiver<ConnMsg>,
    /// SESSION_ATTACHED, then the drained TETHER_TURNs, with the seq each carries.
    pub frames: Vec<(ServerFrame, Option<u64>)>,
}

impl Gateway {
    /// Validates ATTACH_SESSION, marks the session attached (tether on for later detaches, suspended
    /// -> running), registers the connection (displacing any other) and prepares the drain.
    pub async fn attach(
        &self,
        path_id: &str,
        frame: AttachSession,
    ) -> Result<Attached, AttachError> {
        if frame.session_id != path_id {
            return Err(AttachError::Protocol(format!(
                "session_id '{}' does not match the URL's '{path_id}'",
                frame.session_id
            )));
        }
        let id = Uuid::parse_str(path_id)
            .map_err(|_| AttachError::NotFound(format!("No session with ID {path_id}")))?;
        self.check_token(id, &frame.session_token).await?;
        let surface = frame.surface_context.clone().unwrap_or_default();
        let (conn_id, inbox) = {
            let _guard = self.hub().session_lock(id).lock().await;
            self.store()
                .mark_attached(id, Utc::now())
                .await
                .map_err(internal)?;
            self.hub().register(id, surface.clone())
        };
        let ack_mode = frame.last_seq.is_some();
        let after = frame.last_seq.unwrap_or(0);
        if after > 0 {
            self.store().tether_ack(id, after).await.map_err(internal)?;
        }
        let pending = self
            .store()
            .tether_pending(id, Some(after), DRAIN_LIMIT)
            .await
            .map_err(internal)?;
        let mut delivery = Delivery {
            session_id: id,
            conn_id,
            ack_mode,
            last_sent: after,
            tether_index: 0,
        };
        let mut frames = vec![self.attached_frame(id, frame.surface_context, pending.len())];
        frames.extend(pending.iter().map(|e| delivery.tether_frame(e)));
        tracing::info!(session_id = %id, conn_id, queued = pending.len(), device_type = surface.device_type_or_unknown(), "surface attached");
        Ok(Attached {
            delivery,
            inbox,
            frames,
        })
    }

    /// The frames for a completed turn, in order after anything this connection has not yet seen.
    pub async fn on_turn_done(
        &self,
        d: &mut Delivery,
        done: TurnDone,
    ) -> Vec<(ServerFrame, Option<u64>)> {
        let live = |content_needed: bool| {
            let mut frames = Vec::new();
            if content_needed {
                frames.push(ServerFrame::TurnChunk(TurnChunk {
                    chunk_id: done.chunk_id.to_string(),
                    delta: done.content.clone().unwrap_or_default(),
                }));
            }
            frames.push(ServerFrame::TurnComplete(TurnComplete {
                chunk_id: done.chunk_id.to_string(),
                seq: done.seq,
                model_used: done.model_used.clone(),
            }));
            frames
        };
        let streamed_here = done.streamed_to == Some(d.conn_id);
        let Some(seq) = done.seq else {
            return live(!streamed_here)
                .into_iter()
                .map(|f| (f, None))
                .collect();
        };
        if seq <= d.last_sent {
            return Vec::new();
        }
        let entries = match self
            .store()
            .tether_pending(d.session_id, Some(d.last_sent), DRAIN_LIMIT)
            .await
        {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(session_id = %d.session_id, error = %e, "reading the tether failed");
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        for entry in entries.iter().take_while(|e| e.seq <= seq) {
            if entry.seq == seq {
                out.extend(live(!streamed_here).into_iter().map(|f| (f, None)));
                // The seq rides on TURN_COMPLETE; mark it for removal once that frame is sent.
                if let Some(last) = out.last_mut() {
                    last.1 = Some(seq);
                }
                d.last_sent = seq;
            } else {
                out.push(d.tether_frame(entry));
            }
        }
        out
    }

    /// Tethered turns this connection has not been sent that are older than a moment: a safety net
    /// for a notification lost to a full inbox.
    pub async fn catch_up(&self, d: &mut Delivery) -> Vec<(ServerFrame, Option<u64>)> {
        let Ok(entries) = self
            .store()
            .tether_pending(d.session_id, Some(d.last_sent), DRAIN_LIMIT)
            .await
        else {
            return Vec::new();
        };
        let cutoff = Utc::now() - chrono::Duration::milliseconds(CATCH_UP_AGE_MS);
        entries
            .iter()
            .take_while(|e| e.created_at < cutoff)
            .map(|e| d.tether_frame(e))
            .collect()
    }

    /// Called after frames carrying these seqs were written to the socket. Without ACKs, sending is
    /// delivery and the turns leave the tether now.
    pub async fn sent(&self, d: &Delivery, seqs: &[u64]) {
        if seqs.is_empty() {
            return;
        }
        self.metrics()
            .tether_delivered
            .fetch_add(seqs.len() as u64, Relaxed);
        if d.ack_mode {
            return;
        }
        if let Err(e) = self.store().tether_remove(d.session_id, seqs).await {
            tracing::error!(session_id = %d.session_id, error = %e, "removing delivered turns failed");
        }
    }

    /// ACK extension: every turn up to `seq` (at most what this connection was sent) is delivered.
    pub async fn ack(&self, d: &mut Delivery, seq: u64) {
        d.ack_mode = true;
        let up_to = seq.min(d.last_sent);
        if let Err(e) = self.store().tether_ack(d.session_id, up_to).await {
            tracing::error!(session_id = %d.session_id, error = %e, "acknowledging turns failed");
        }
    }

    pub fn is_current(&self, d: &Delivery) -> bool {
        self.hub().is_current(d.session_id, d.conn_id)
    }

    /// The connection closed (DETACH, disconnect or timeout). If it was still the session's surface,
    /// the session is suspended and from now on turns go to the tether. A displaced connection
    /// changes nothing.
    pub async fn detach(&self, d: &Delivery, reason: &str) {
        let _guard = self.hub().session_lock(d.session_id).lock().await;
        if !self.hub().remove_if_current(d.session_id, d.conn_id) {
            tracing::debug!(session_id = %d.session_id, conn_id = d.conn_id, reason, "displaced connection closed");
            return;
        }
        match self.store().get_session(d.session_id).await {
            Ok(Some(s)) if s.status == SessionStatus::Running => {
                if let Err(e) = self
                    .store()
                    .update_status(d.session_id, SessionStatus::Suspended, Utc::now())
                    .await
                {
                    tracing::error!(session_id = %d.session_id, error = %e, "suspending on detach failed");
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::error!(session_id = %d.session_id, error = %e, "reading session on detach failed")
            }
        }
        tracing::info!(session_id = %d.session_id, conn_id = d.conn_id, reason, "surface detached; tether active");
    }
}

impl Gateway {
    /// The session exists (else SESSION_NOT_FOUND) and `token` is its token (else FORBIDDEN).
    async fn check_token(&self, id: Uuid, token: &str) -> Result<(), AttachError> {
        let session = self
            .store()
            .get_session(id)
            .await
            .map_err(internal)?
            .ok_or_else(|| AttachError::NotFound(format!("No session with ID {id}")))?;
        if !auth::token_matches(token, &session.token_hash) {
            return Err(AttachError::Forbidden(
                "session_token invalid or expired".into(),
            ));
        }
        Ok(())
    }

    /// SESSION_ATTACHED for `session`, echoing the surface's context, announcing `queued` turns.
    fn attached_frame(
        &self,
        session: Uuid,
        ctx: Option<SurfaceContext>,
        queued: usize,
    ) -> (ServerFrame, Option<u64>) {
        let surface = ctx.clone().unwrap_or_default();
        let attached = SessionAttached {
            session_id: session.to_string(),
            surface_id: surface.surface_id.clone(),
            device_type: surface.device_type_or_unknown().to_owned(),
            queued_turns: queued as u64,
            tether_turns_pending: queued as u64,
            mcp_tools_registered: Vec::new(),
            sbp_version: self.config().sbp_version.clone(),
            sbp_level: self.config().sbp_level.clone(),
            surface_context: ctx,
            extensions: EXTENSIONS.iter().map(|s| (*s).to_owned()).collect(),
        };
        (ServerFrame::SessionAttached(Box::new(attached)), None)
    }
}

fn internal(e: sbp_store::StoreError) -> AttachError {
    AttachError::Internal(e.to_string())
}

impl Delivery {
    fn tether_frame(&mut self, e: &TetherEntry) -> (ServerFrame, Option<u64>) {
        let frame = ServerFrame::TetherTurn(TetherTurn {
            turn_index: self.tether_index,
            role: e.role.clone(),
            content: e.content.clone(),
            model_used: e.model_used.clone(),
            created_at: iso(&e.created_at),
            seq: e.seq,
            session_id: Some(self.session_id.to_string()),
        });
        self.tether_index += 1;
        self.last_sent = self.last_sent.max(e.seq);
        (frame, Some(e.seq))
    }
}

impl Gateway {
    /// A repeated ATTACH_SESSION on an attached connection (SPEC 7.4: resumes are idempotent):
    /// SESSION_ATTACHED again, then anything this connection has not been sent.
    pub async fn reattach(
        &self,
        d: &mut Delivery,
        frame: AttachSession,
    ) -> Result<Vec<(ServerFrame, Option<u64>)>, AttachError> {
        if frame.session_id != d.session_id.to_string() {
            return Err(AttachError::Protocol(
                "session_id does not match this connection's session".into(),
            ));
        }
        self.check_token(d.session_id, &frame.session_token).await?;
        if let Some(last) = frame.last_seq {
            d.ack_mode = true;
            d.last_sent = d.last_sent.max(last);
            self.store()
                .tether_ack(d.session_id, last)
                .await
                .map_err(internal)?;
        }
        let pending = self
            .store()
            .tether_pending(d.session_id, Some(d.last_sent), DRAIN_LIMIT)
            .await
            .map_err(internal)?;
        let surface = frame.surface_context.clone().unwrap_or_default();
        self.hub().update_surface(d.session_id, d.conn_id, surface);
        let mut frames =
            vec![self.attached_frame(d.session_id, frame.surface_context, pending.len())];
        frames.extend(pending.iter().map(|e| d.tether_frame(e)));
        Ok(frames)
    }
}
