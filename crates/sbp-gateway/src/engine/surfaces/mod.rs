//! Attached surfaces: the ATTACH_SESSION handshake, the tether drain, delivery of live chunks and
//! completed turns (rendered for each surface), ACKs, catch-up and detach. The transport owns the
//! socket and calls these; each returns protocol frames.

mod ctp;
mod delivery;
pub mod render;

pub use ctp::CtpFrames;
pub use delivery::Delivery;

use std::sync::Arc;

use chrono::Utc;
use sbp_bus::{LiveChunk, TurnDone};
use sbp_protocol::frames::{AttachSession, SessionAttached};
use sbp_protocol::{ServerFrame, SurfaceContext};
use sbp_store::{Store, StoreError};
use uuid::Uuid;

use super::connections::{Connections, Inbox};
use super::replicas::Replicas;
use super::sessions::{Sessions, TokenCheck};
use super::tasks::Tasks;
use super::tools::Tools;
use crate::config::GatewayConfig;
use crate::engine::federation::Federation;
use crate::engine::federation::migration::PullError;
use crate::metrics::Metrics;
use ctp::Ctp;
use render::{Rendering, TurnTag, chunk_frame, complete_frame, rendering_for};

/// A frame for a connection and the tether seq it carries (reported sent once written).
pub type Frame = (ServerFrame, Option<u64>);

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
    /// 1013: the session is held by another gateway that could not hand it over now; retry.
    TryAgain(String),
}

fn internal(e: StoreError) -> AttachError {
    AttachError::Internal(e.to_string())
}

/// Frames for a completed turn: `frames` now, then (CTP) the rewrite's frames as they come.
pub struct TurnFrames {
    pub frames: Vec<Frame>,
    pub ctp: Option<CtpFrames>,
}

impl TurnFrames {
    fn now(frames: Vec<Frame>) -> Self {
        Self { frames, ctp: None }
    }
}

pub struct Attached {
    pub delivery: Delivery,
    pub inbox: Inbox,
    /// SESSION_ATTACHED, then the drained TETHER_TURNs, with the seq each carries.
    pub frames: Vec<Frame>,
    /// For a CTP surface, the drained TETHER_TURNs arrive here as their rewrites complete (in order),
    /// while the connection already serves tool calls and pings.
    pub ctp: Option<CtpFrames>,
}

#[derive(Clone)]
pub struct Surfaces {
    inner: Arc<Shared>,
}

struct Shared {
    store: Arc<dyn Store>,
    config: Arc<GatewayConfig>,
    federation: Federation,
    connections: Arc<Connections>,
    replicas: Replicas,
    sessions: Sessions,
    tools: Tools,
    ctp: Ctp,
    metrics: Arc<Metrics>,
}

impl Surfaces {
    #[allow(clippy::too_many_arguments)] // One per dependency; a struct would only rename them.
    pub fn new(
        store: Arc<dyn Store>,
        config: Arc<GatewayConfig>,
        federation: Federation,
        connections: Arc<Connections>,
        replicas: Replicas,
        sessions: Sessions,
        tools: Tools,
        provider: Arc<dyn sbp_llm::Provider>,
        tasks: Tasks,
        metrics: Arc<Metrics>,
    ) -> Self {
        let ctp = Ctp::new(provider, config.ctp_timeout, config.ctp_drain_max, tasks);
        Self {
            inner: Arc::new(Shared {
                store,
                config,
                federation,
                connections,
                replicas,
                sessions,
                tools,
                ctp,
                metrics,
            }),
        }
    }

    /// Validates ATTACH_SESSION, marks the session attached (tether on for later detaches, suspended
    /// -> running), registers the connection (displacing any other) and prepares the drain.
    /// With federation, a session another gateway holds is brought here first, all before
    /// `deadline` (the attach timeout, counted from the connection's start).
    pub async fn attach(
        &self,
        path_id: &str,
        frame: AttachSession,
        deadline: tokio::time::Instant,
    ) -> Result<Attached, AttachError> {
        if frame.session_id != path_id {
            return Err(AttachError::Protocol(format!(
                "session_id '{}' does not match the URL's '{path_id}'",
                frame.session_id
            )));
        }
        let id = sbp_protocol::id::parse_canonical(path_id).ok_or_else(|| {
            AttachError::NotFound(format!(
                "No session with ID {path_id} (ids are lower-case hyphenated UUIDs)"
            ))
        })?;
        self.arrive(id, &frame.session_token, deadline).await?;
        let surface = Arc::new(frame.surface_context.clone().unwrap_or_default());
        let (conn_id, inbox) = self
            .inner
            .replicas
            .locked(id, self.take_session(id, surface.clone()))
            .await
            .map_err(|e| AttachError::Internal(e.to_string()))??;
        let (last_seq, reset) = self.trusted_position(id, frame.last_seq).await?;
        if let Some(after) = last_seq.filter(|s| *s > 0) {
            self.inner
                .store
                .tether_ack(id, after)
                .await
                .map_err(internal)?;
        }
        let pending = self
            .inner
            .store
            .tether_pending(id, last_seq.or(Some(0)), DRAIN_LIMIT)
            .await
            .map_err(internal)?;
        let rendering = rendering_for(&self.inner.config.ctp, &surface);
        let mut delivery = Delivery::new(id, conn_id, last_seq, surface.clone(), rendering);
        let mut frames = vec![self.attached_frame(id, frame.surface_context, pending.len(), reset)];
        let drained: Vec<Frame> = pending.iter().map(|e| delivery.tether_frame(e)).collect();
        let mut ctp = None;
        match &delivery.renderer.rendering {
            Rendering::Ctp { rule, profile } if !drained.is_empty() => {
                ctp = Some(
                    self.inner
                        .ctp
                        .drain(rule, *profile, delivery.surface.clone(), drained),
                );
            }
            _ => frames.extend(delivery.render_tethered(drained)),
        }
        tracing::info!(session_id = %id, conn_id, queued = pending.len(), device_type = surface.device_type_or_unknown(), "surface attached");
        Ok(Attached {
            delivery,
            inbox,
            frames,
            ctp,
        })
    }

    /// A repeated ATTACH_SESSION on an attached connection (SPEC 7.4: resumes are idempotent):
    /// SESSION_ATTACHED again, then anything this connection has not been sent.
    pub async fn reattach(
        &self,
        d: &mut Delivery,
        frame: AttachSession,
    ) -> Result<Vec<Frame>, AttachError> {
        if frame.session_id != d.session_id.to_string() {
            return Err(AttachError::Protocol(
                "session_id does not match this connection's session".into(),
            ));
        }
        self.check_token(d.session_id, &frame.session_token).await?;
        let (last_seq, reset) = self.trusted_position(d.session_id, frame.last_seq).await?;
        if let Some(last) = last_seq {
            d.ack_mode = true;
            if reset {
                // Everything pending again: the surface's own position cannot be trusted.
                d.last_sent = 0;
            } else {
                d.last_sent = d.last_sent.max(last);
                self.inner
                    .store
                    .tether_ack(d.session_id, last)
                    .await
                    .map_err(internal)?;
            }
        }
        let pending = self
            .inner
            .store
            .tether_pending(d.session_id, Some(d.last_sent), DRAIN_LIMIT)
            .await
            .map_err(internal)?;
        let surface = frame.surface_context.clone().unwrap_or_default();
        // Turns streaming live keep what they streamed here (a re-attach must not repeat it).
        d.renderer.rendering = rendering_for(&self.inner.config.ctp, &surface);
        d.surface = Arc::new(surface.clone());
        self.inner
            .connections
            .update_surface(d.session_id, d.conn_id, surface.clone());
        self.inner
            .replicas
            .update_surface(d.session_id, d.conn_id, &surface)
            .await;
        let mut frames =
            vec![self.attached_frame(d.session_id, frame.surface_context, pending.len(), reset)];
        let drained = pending.iter().map(|e| d.tether_frame(e)).collect();
        frames.extend(d.render_tethered(drained));
        Ok(frames)
    }

    /// A live delta for this connection, adapted for its surface (`None`: nothing to send now).
    pub fn live_chunk(&self, d: &mut Delivery, c: &LiveChunk) -> Option<Frame> {
        let session_id = d.session_id;
        d.renderer
            .chunk(c.chunk_id, &c.delta, c.round, c.offset)
            .map(|delta| {
                let tag = TurnTag {
                    chunk_id: c.chunk_id,
                    session_id,
                    step: c.step,
                    model: c.model.clone(),
                };
                chunk_frame(&tag, delta)
            })
    }

    /// The frames for a completed turn, in order after anything this connection has not yet seen.
    pub async fn turn_done(&self, d: &mut Delivery, done: TurnDone) -> TurnFrames {
        let Some(seq) = done.seq else {
            return self.completed(d, done, None, Vec::new());
        };
        if seq <= d.last_sent {
            d.renderer.drop_turn(done.chunk_id);
            return TurnFrames::now(Vec::new());
        }
        let entries = match self
            .inner
            .store
            .tether_pending(d.session_id, Some(d.last_sent), DRAIN_LIMIT)
            .await
        {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(session_id = %d.session_id, error = %e, "reading the tether failed");
                return TurnFrames::now(Vec::new());
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
        let older = d.render_tethered(older);
        if !found {
            d.renderer.drop_turn(done.chunk_id);
            return TurnFrames::now(older);
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
        mut before: Vec<Frame>,
    ) -> TurnFrames {
        let content = done.content.unwrap_or_default();
        let tag = TurnTag {
            chunk_id: done.chunk_id,
            session_id: d.session_id,
            step: done.step,
            model: done.model_used,
        };
        let complete = complete_frame(&tag, seq, done.cost_usd);
        if let Rendering::Ctp { rule, profile } = &d.renderer.rendering {
            let ctp = self
                .inner
                .ctp
                .stream(rule, profile, &d.surface, content, tag, complete);
            d.renderer.drop_turn(done.chunk_id);
            return TurnFrames {
                frames: before,
                ctp: Some(ctp),
            };
        }
        let rest = d.renderer.rest(done.chunk_id, &content);
        if !rest.is_empty() {
            before.push(chunk_frame(&tag, rest));
        }
        before.push(complete);
        TurnFrames::now(before)
    }

    /// Tethered turns this connection has not been sent that are older than a moment: a safety net
    /// for a notification lost to a full inbox.
    pub async fn catch_up(&self, d: &mut Delivery) -> Vec<Frame> {
        let Ok(entries) = self
            .inner
            .store
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
        d.render_tethered(missed)
    }

    /// Called after frames carrying these seqs were written to the socket. Without ACKs, sending is
    /// delivery and the turns leave the tether now.
    pub async fn sent(&self, d: &Delivery, seqs: &[u64]) {
        if seqs.is_empty() {
            return;
        }
        self.inner
            .metrics
            .tether_delivered
            .inc_by(seqs.len() as u64);
        if d.ack_mode {
            return;
        }
        if let Err(e) = self.inner.store.tether_remove(d.session_id, seqs).await {
            tracing::error!(session_id = %d.session_id, error = %e, "removing delivered turns failed");
        }
    }

    /// ACK extension: every turn up to `seq` (at most what this connection was sent) is delivered.
    pub async fn ack(&self, d: &mut Delivery, seq: u64) {
        d.ack_mode = true;
        let up_to = seq.min(d.last_sent);
        if let Err(e) = self.inner.store.tether_ack(d.session_id, up_to).await {
            tracing::error!(session_id = %d.session_id, error = %e, "acknowledging turns failed");
        }
    }

    /// Whether this connection is still its session's surface.
    pub fn is_current(&self, d: &Delivery) -> bool {
        self.inner.connections.is_current(d.session_id, d.conn_id)
    }

    /// The connection closed (DETACH, disconnect or timeout). If it was still the session's surface,
    /// the session is suspended and from now on turns go to the tether. A displaced connection
    /// changes nothing.
    pub async fn detach(&self, d: &Delivery, reason: &str) {
        if let Err(e) = self
            .inner
            .replicas
            .locked(d.session_id, self.release_session(d, reason))
            .await
        {
            // Without the bus's lock, still release: a session left "running" with no surface is
            // worse than a race with an attach on another replica.
            tracing::warn!(session_id = %d.session_id, error = %e, "detaching without the replica lock");
            let _guard = self
                .inner
                .connections
                .session_lock(d.session_id)
                .lock()
                .await;
            self.release_session(d, reason).await;
        }
    }

    /// Marks the session attached and makes this new connection its surface, here and on the bus;
    /// the previous surface, here or on another replica, is displaced.
    async fn take_session(
        &self,
        id: Uuid,
        surface: Arc<SurfaceContext>,
    ) -> Result<(u64, Inbox), AttachError> {
        self.inner
            .store
            .mark_attached(id, Utc::now())
            .await
            .map_err(|e| match e {
                // Deleted since its token was checked (another replica's cache knew the token).
                StoreError::NotFound => AttachError::NotFound(format!("No session with ID {id}")),
                other => internal(other),
            })?;
        // Registered here before it is claimed on the bus: a displacement sent by a later claim on
        // another replica then always finds this connection.
        let (conn_id, inbox) = self.inner.connections.register(id, surface.clone());
        if let Err(e) = self.inner.replicas.claim(id, conn_id, &surface).await {
            self.inner.connections.remove_if_current(id, conn_id);
            self.inner.replicas.withdraw(id, conn_id).await;
            return Err(AttachError::Internal(e.to_string()));
        }
        Ok((conn_id, inbox))
    }

    /// The detach proper, under the session's locks.
    async fn release_session(&self, d: &Delivery, reason: &str) {
        let current = self
            .inner
            .connections
            .remove_if_current(d.session_id, d.conn_id);
        // Calls in flight on this connection get their error result now, displaced or not. After
        // the removal: a call registered from here on sees the connection gone and fails itself.
        let cancelled = self.inner.tools.connection_closed(d.conn_id);
        if cancelled > 0 {
            tracing::info!(session_id = %d.session_id, conn_id = d.conn_id, cancelled, "tool calls in flight cancelled by disconnect");
        }
        if !current {
            tracing::debug!(session_id = %d.session_id, conn_id = d.conn_id, reason, "displaced connection closed");
            return;
        }
        if !self.inner.replicas.release(d.session_id, d.conn_id).await {
            tracing::debug!(session_id = %d.session_id, conn_id = d.conn_id, reason, "connection displaced from another replica closed");
            return;
        }
        if let Err(e) = self
            .inner
            .store
            .suspend_if_running(d.session_id, Utc::now())
            .await
        {
            tracing::error!(session_id = %d.session_id, error = %e, "suspending on detach failed");
        }
        tracing::info!(session_id = %d.session_id, conn_id = d.conn_id, reason, "surface detached; tether active");
    }

    /// Closes the session's surface (4409), here or on another replica: it moved to another
    /// gateway.
    pub async fn displace_everywhere(&self, id: Uuid) {
        self.inner.replicas.displace(id).await;
    }

    /// The session is here (brought from the peer holding it, with federation, when it is not)
    /// and `token` is its token.
    async fn arrive(
        &self,
        id: Uuid,
        token: &str,
        deadline: tokio::time::Instant,
    ) -> Result<(), AttachError> {
        let federation = &self.inner.federation;
        let checked = self.check_token(id, token).await;
        let away = match &checked {
            Err(AttachError::NotFound(_)) => federation.enabled(),
            Ok(()) => federation.is_away(id).await.map_err(internal)?,
            Err(_) => false,
        };
        if !away {
            return checked;
        }
        match federation.pull_session(id, token, deadline).await {
            Ok(()) => self.check_token(id, token).await,
            Err(PullError::NotHeld) => match checked {
                Err(e) => Err(e),
                Ok(()) => Err(AttachError::NotFound(format!("No session with ID {id}"))),
            },
            Err(PullError::Forbidden) => Err(AttachError::Forbidden(
                "session_token invalid or expired".into(),
            )),
            Err(PullError::TryAgain(why)) => Err(AttachError::TryAgain(why)),
        }
    }

    /// The session exists (else SESSION_NOT_FOUND) and `token` is its token (else FORBIDDEN).
    async fn check_token(&self, id: Uuid, token: &str) -> Result<(), AttachError> {
        match self
            .inner
            .sessions
            .check_token(id, token)
            .await
            .map_err(internal)?
        {
            TokenCheck::Valid => Ok(()),
            TokenCheck::Wrong => Err(AttachError::Forbidden(
                "session_token invalid or expired".into(),
            )),
            TokenCheck::NoSuchSession => {
                Err(AttachError::NotFound(format!("No session with ID {id}")))
            }
        }
    }

    /// The attach's `last_seq` if this session could have issued it, with whether it was reset.
    /// A position beyond the highest seq ever issued is not from this session's history (a
    /// restored database, another gateway, a client bug): trusting it would acknowledge, and so
    /// delete, turns that were never delivered. It counts as "nothing received" instead.
    async fn trusted_position(
        &self,
        session: Uuid,
        last_seq: Option<u64>,
    ) -> Result<(Option<u64>, bool), AttachError> {
        let Some(claimed) = last_seq.filter(|s| *s > 0) else {
            return Ok((last_seq, false));
        };
        let issued = self
            .inner
            .store
            .tether_issued(session)
            .await
            .map_err(internal)?;
        if claimed <= issued {
            return Ok((last_seq, false));
        }
        tracing::warn!(session_id = %session, last_seq = claimed, issued, "last_seq beyond every issued seq: ignored, draining from the oldest pending turn");
        Ok((Some(0), true))
    }

    /// SESSION_ATTACHED for `session`, echoing the surface's context, announcing `queued` turns.
    fn attached_frame(
        &self,
        session: Uuid,
        ctx: Option<SurfaceContext>,
        queued: usize,
        last_seq_reset: bool,
    ) -> Frame {
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
                .filter(|t| self.inner.config.tool_allowed(t))
                .cloned()
                .collect(),
            sbp_version: self.inner.config.sbp_version.clone(),
            sbp_level: self.inner.config.sbp_level.clone(),
            surface_context: ctx,
            extensions: EXTENSIONS.iter().map(|s| (*s).to_owned()).collect(),
            last_seq_reset,
        };
        (ServerFrame::SessionAttached(Box::new(attached)), None)
    }
}
