//! Attached surfaces: the ATTACH_SESSION handshake, tether drain, live delivery of completed turns,
//! ACKs and detach. The transport owns the socket and calls these; each returns protocol frames.

use std::sync::atomic::Ordering::Relaxed;

use chrono::Utc;
use std::sync::Arc;

use futures::StreamExt;
use sbp_protocol::frames::{AttachSession, SessionAttached, TetherTurn, TurnChunk};
use sbp_protocol::{ServerFrame, SurfaceContext};
use sbp_store::TetherEntry;
use tokio::sync::mpsc;
use uuid::Uuid;

use super::hub::{Inbox, TurnDone};
use super::render::{CtpFrames, Renderer, Rendering, complete_frame};
use super::{Gateway, iso};
use crate::auth;

/// Protocol extensions advertised in SESSION_ATTACHED.
pub const EXTENSIONS: [&str; 2] = ["ack", "last_seq"];
/// Turns drained in one attach; any beyond are delivered by the connection's periodic catch-up.
const DRAIN_LIMIT: u32 = 100_000;
/// A tethered turn older than this that a connection has not yet sent is caught up by its poll.
const CATCH_UP_AGE_MS: i64 = 2_000;
/// CTP passes run at once for one drain.
const CTP_PARALLEL: usize = 4;

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
    /// The surface as it declared itself, and how replies are adapted for it.
    surface: Arc<SurfaceContext>,
    renderer: Renderer,
}

/// Frames for a completed turn: `frames` now, then (CTP) the rewrite's frames as they come.
pub struct TurnFrames {
    pub frames: Vec<(ServerFrame, Option<u64>)>,
    pub ctp: Option<CtpFrames>,
}

pub struct Attached {
    pub delivery: Delivery,
    pub inbox: Inbox,
    /// SESSION_ATTACHED, then the drained TETHER_TURNs, with the seq each carries.
    pub frames: Vec<(ServerFrame, Option<u64>)>,
    /// For a CTP surface, the drained TETHER_TURNs arrive here as their rewrites complete (in order),
    /// while the connection already serves tool calls and pings.
    pub ctp: Option<CtpFrames>,
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
        let surface = Arc::new(frame.surface_context.clone().unwrap_or_default());
        let (conn_id, inbox) = self
            .across_replicas(id, self.take_session(id, surface.clone()))
            .await
            .map_err(|e| AttachError::Internal(e.to_string()))??;
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
            renderer: Renderer::new(self.rendering_for(&surface)),
            surface: surface.clone(),
        };
        let mut frames = vec![self.attached_frame(id, frame.surface_context, pending.len())];
        let drained: Vec<_> = pending.iter().map(|e| delivery.tether_frame(e)).collect();
        let mut ctp = None;
        if matches!(delivery.renderer.rendering, Rendering::Ctp { .. }) && !drained.is_empty() {
            ctp = Some(self.ctp_drain(&delivery, drained));
        } else {
            frames.extend(self.render_tethered(&delivery, drained));
        }
        tracing::info!(session_id = %id, conn_id, queued = pending.len(), device_type = surface.device_type_or_unknown(), "surface attached");
        Ok(Attached {
            delivery,
            inbox,
            frames,
            ctp,
        })
    }

    /// A live delta for this connection, adapted for its surface (`None`: nothing to send now).
    pub fn live_chunk(
        &self,
        d: &mut Delivery,
        chunk_id: Uuid,
        delta: &str,
        round: u32,
        offset: u64,
    ) -> Option<ServerFrame> {
        d.renderer
            .chunk(chunk_id, delta, round, offset)
            .map(|delta| {
                ServerFrame::TurnChunk(TurnChunk {
                    chunk_id: chunk_id.to_string(),
                    delta,
                })
            })
    }

    /// The frames for a completed turn, in order after anything this connection has not yet seen.
    pub async fn on_turn_done(&self, d: &mut Delivery, done: TurnDone) -> TurnFrames {
        let Some(seq) = done.seq else {
            return self.completed(d, done, None, Vec::new());
        };
        if seq <= d.last_sent {
            d.renderer.drop_turn(done.chunk_id);
            return TurnFrames {
                frames: Vec::new(),
                ctp: None,
            };
        }
        let entries = match self
            .store()
            .tether_pending(d.session_id, Some(d.last_sent), DRAIN_LIMIT)
            .await
        {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(session_id = %d.session_id, error = %e, "reading the tether failed");
                return TurnFrames {
                    frames: Vec::new(),
                    ctp: None,
                };
            }
        };
        let mut older = Vec::new();
        let mut found = false;
        for entry in entries.iter().take_while(|e| e.seq <= seq) {
            if entry.seq == seq {
                found = true;
            } else {
                older.push(d.tether_frame(entry));
            }
        }
        let older = self.render_tethered(d, older);
        if !found {
            d.renderer.drop_turn(done.chunk_id);
            return TurnFrames {
                frames: older,
                ctp: None,
            };
        }
        // The seq rides on TURN_COMPLETE; it is marked for removal once that frame is sent.
        d.last_sent = seq;
        self.completed(d, done, Some(seq), older)
    }

    /// `before`, then the completed turn as this surface gets it: the rest of its adapted text
    /// (all of it if it did not stream here) and TURN_COMPLETE, or a CTP rewrite.
    fn completed(
        &self,
        d: &mut Delivery,
        done: TurnDone,
        seq: Option<u64>,
        mut before: Vec<(ServerFrame, Option<u64>)>,
    ) -> TurnFrames {
        let content = done.content.unwrap_or_default();
        let complete = complete_frame(done.chunk_id, seq, done.model_used);
        if let Rendering::Ctp { rule, profile } = &d.renderer.rendering {
            let ctp = self.ctp_stream(rule, profile, &d.surface, content, done.chunk_id, complete);
            d.renderer.drop_turn(done.chunk_id);
            return TurnFrames {
                frames: before,
                ctp: Some(ctp),
            };
        }
        let rest = d.renderer.rest(done.chunk_id, &content);
        if !rest.is_empty() {
            before.push((
                ServerFrame::TurnChunk(TurnChunk {
                    chunk_id: done.chunk_id.to_string(),
                    delta: rest,
                }),
                None,
            ));
        }
        before.push(complete);
        TurnFrames {
            frames: before,
            ctp: None,
        }
    }

    /// Adapts the content of TETHER_TURN frames for this connection's surface with the deterministic
    /// adaptation (CTP surfaces too: only the attach drain and live turns wait for a rewrite).
    pub(crate) fn render_tethered(
        &self,
        d: &Delivery,
        mut frames: Vec<(ServerFrame, Option<u64>)>,
    ) -> Vec<(ServerFrame, Option<u64>)> {
        if matches!(d.renderer.rendering, Rendering::Raw) {
            return frames;
        }
        for (frame, _) in &mut frames {
            if let ServerFrame::TetherTurn(t) = frame
                && let Some(c) = &t.content
            {
                t.content = Some(d.renderer.whole(c));
            }
        }
        frames
    }

    /// The attach drain of a CTP surface: the most recent `ctp_drain_max` turns rewritten (four at
    /// a time), older ones adapted deterministically, sent through a channel in their order.
    fn ctp_drain(&self, d: &Delivery, frames: Vec<(ServerFrame, Option<u64>)>) -> CtpFrames {
        let (tx, rx) = mpsc::channel(CTP_PARALLEL * 2);
        let Rendering::Ctp { rule, profile } = &d.renderer.rendering else {
            return rx;
        };
        let first_ctp = frames.len().saturating_sub(self.config().ctp_drain_max);
        let (gw, rule, profile, surface) =
            (self.clone(), rule.clone(), *profile, d.surface.clone());
        self.spawn(async move {
            let mut rewritten = futures::stream::iter(frames.into_iter().enumerate())
                .map(|(i, (mut frame, seq))| {
                    let (gw, rule, surface) = (gw.clone(), rule.clone(), surface.clone());
                    async move {
                        if let ServerFrame::TetherTurn(t) = &mut frame
                            && let Some(c) = &t.content
                        {
                            t.content = Some(if i >= first_ctp {
                                gw.ctp_whole(&rule, &profile, &surface, c).await
                            } else {
                                sbp_adapt::adapt(&profile, c)
                            });
                        }
                        (frame, seq)
                    }
                })
                .buffered(CTP_PARALLEL);
            while let Some(item) = rewritten.next().await {
                if tx.send(item).await.is_err() {
                    return;
                }
            }
        });
        rx
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
        let missed = entries
            .iter()
            .take_while(|e| e.created_at < cutoff)
            .map(|e| d.tether_frame(e))
            .collect();
        self.render_tethered(d, missed)
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
        if let Err(e) = self
            .across_replicas(d.session_id, self.release_session(d, reason))
            .await
        {
            // Without the bus's lock, still release: a session left "running" with no surface is
            // worse than a race with an attach on another replica.
            tracing::warn!(session_id = %d.session_id, error = %e, "detaching without the replica lock");
            let _guard = self.hub().session_lock(d.session_id).lock().await;
            self.release_session(d, reason).await;
        }
    }

    /// Runs `work` holding the session's locks: the bus's (with replicas), then this process's
    /// striped one. Always in that order, so the two never deadlock, and a session waiting for
    /// its bus lock does not hold a stripe other sessions share.
    async fn across_replicas<T>(
        &self,
        session: Uuid,
        work: impl Future<Output = T>,
    ) -> Result<T, sbp_bus::BusError> {
        let lock = match self.bus() {
            Some(bus) => Some(bus.lock(session).await?),
            None => None,
        };
        let out = {
            let _guard = self.hub().session_lock(session).lock().await;
            work.await
        };
        if let (Some(bus), Some(lock)) = (self.bus(), lock) {
            bus.unlock(lock).await;
        }
        Ok(out)
    }

    /// Marks the session attached and makes this new connection its surface, here and on the bus;
    /// the previous surface, here or on another replica, is displaced.
    async fn take_session(
        &self,
        id: Uuid,
        surface: Arc<SurfaceContext>,
    ) -> Result<(u64, Inbox), AttachError> {
        self.store()
            .mark_attached(id, Utc::now())
            .await
            .map_err(internal)?;
        // Registered here before it is claimed on the bus: a displacement sent by a later claim on
        // another replica then always finds this connection.
        let (conn_id, inbox) = self.hub().register(id, surface.clone());
        if let Some(bus) = self.bus() {
            match bus.claim(id, conn_id, &surface).await {
                Ok(Some(old)) if old.replica != bus.replica() => {
                    tracing::info!(session_id = %id, replica = %old.replica, conn_id = old.conn, "displacing the surface attached on another replica");
                    bus.send(
                        &old.replica,
                        sbp_bus::BusMsg::Displace {
                            session: id,
                            conn: old.conn,
                        },
                    );
                }
                Ok(_) => {}
                Err(e) => {
                    self.hub().remove_if_current(id, conn_id);
                    // The claim may have been applied before the error: do not leave the
                    // registry naming a connection that never served.
                    if let Err(e) = bus.release(id, conn_id).await {
                        tracing::warn!(session_id = %id, error = %e, "withdrawing a failed claim failed");
                    }
                    return Err(AttachError::Internal(e.to_string()));
                }
            }
        }
        Ok((conn_id, inbox))
    }

    /// The detach proper, under the session's locks.
    async fn release_session(&self, d: &Delivery, reason: &str) {
        let current = self.hub().remove_if_current(d.session_id, d.conn_id);
        // Calls in flight on this connection get their error result now, displaced or not. After
        // the removal: a call registered from here on sees the connection gone and fails itself.
        let cancelled = self.hub().cancel_calls(d.conn_id);
        if cancelled > 0 {
            tracing::info!(session_id = %d.session_id, conn_id = d.conn_id, cancelled, "tool calls in flight cancelled by disconnect");
        }
        if !current {
            tracing::debug!(session_id = %d.session_id, conn_id = d.conn_id, reason, "displaced connection closed");
            return;
        }
        if let Some(bus) = self.bus() {
            match bus.release(d.session_id, d.conn_id).await {
                Ok(true) => {}
                Ok(false) => {
                    // A surface on another replica holds the session now (its displacement of
                    // this connection is on its way): the session stays running.
                    tracing::debug!(session_id = %d.session_id, conn_id = d.conn_id, reason, "connection displaced from another replica closed");
                    return;
                }
                Err(e) => {
                    tracing::warn!(session_id = %d.session_id, error = %e, "releasing the session on the bus failed");
                }
            }
        }
        if let Err(e) = self
            .store()
            .suspend_if_running(d.session_id, Utc::now())
            .await
        {
            tracing::error!(session_id = %d.session_id, error = %e, "suspending on detach failed");
        }
        tracing::info!(session_id = %d.session_id, conn_id = d.conn_id, reason, "surface detached; tether active");
    }
}

impl Gateway {
    /// The session exists (else SESSION_NOT_FOUND) and `token` is its token (else FORBIDDEN).
    async fn check_token(&self, id: Uuid, token: &str) -> Result<(), AttachError> {
        match self.tokens().check(id, token) {
            Some(true) => return Ok(()),
            Some(false) => {
                return Err(AttachError::Forbidden(
                    "session_token invalid or expired".into(),
                ));
            }
            None => {}
        }
        let session = self
            .store()
            .get_session(id)
            .await
            .map_err(internal)?
            .ok_or_else(|| AttachError::NotFound(format!("No session with ID {id}")))?;
        self.tokens().remember(id, &session.token_hash);
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
            mcp_tools_registered: surface
                .mcp_tools
                .iter()
                .filter(|t| self.tool_allowed(t))
                .cloned()
                .collect(),
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
            chunk_id: Some(e.chunk_id.to_string()),
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
        // Turns streaming live keep what they streamed here (a re-attach must not repeat it).
        d.renderer.rendering = self.rendering_for(&surface);
        d.surface = Arc::new(surface.clone());
        self.hub()
            .update_surface(d.session_id, d.conn_id, surface.clone());
        if let Some(bus) = self.bus()
            && let Err(e) = bus.update(d.session_id, d.conn_id, &surface).await
        {
            tracing::warn!(session_id = %d.session_id, error = %e, "updating the surface on the bus failed");
        }
        let mut frames =
            vec![self.attached_frame(d.session_id, frame.surface_context, pending.len())];
        let drained = pending.iter().map(|e| d.tether_frame(e)).collect();
        frames.extend(self.render_tethered(d, drained));
        Ok(frames)
    }
}
