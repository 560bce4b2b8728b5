//! The engine: everything the gateway does, independent of HTTP and WebSocket types. Transport
//! handlers extract their inputs, call one engine function and map its result.
//!
//! Ids the engine makes are UUIDv7 (time-ordered): stored keys then grow at the end of their
//! B-trees instead of dirtying a random page per insert, which is most of the cost of a durable
//! write. They carry no secret; session tokens do.

mod chat;
pub mod hub;
mod render;
mod roaming;
mod sessions;
mod surface;
mod tokens;
mod tools;

pub use chat::{ChatInput, ChatOutcome, ChatReply, SseEvent};
pub use render::{CtpFrames, Rendering};
pub use roaming::{
    ExportRequest, Exported, Forked, HandedOff, HandoffRequest, ImportRequest, Imported,
    KNOWN_MEMORY_SCHEMAS, MEMORY_SCHEMA_KV, TokenInfo, optional_label, unix_iso,
};
pub use sessions::{Caller, PushTurn, SessionView};
pub use surface::{AttachError, Attached, Delivery, TurnFrames};
pub use tools::{
    BackendToolCall, Catalog, MAX_BACKEND_TIMEOUT_MS, NoServerTools, SURFACE_PREFIX, ServerTools,
    SurfaceCallOutcome, TIMEOUT, ToolCallError, ToolTarget, tool_message_content,
};

use std::sync::Arc;

use chrono::{SecondsFormat, Utc};
use sbp_bus::{Bus, BusMsg};
use sbp_llm::Provider;
use sbp_store::{Store, Timestamp};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::config::GatewayConfig;
use crate::error::ApiError;
use crate::metrics::{LiveGauges, Metrics};
use hub::{Attachment, Hub, Route};

/// A replica bus handed to the engine: the bus, and what other replicas send this one.
pub struct BusLink {
    pub bus: Arc<dyn Bus>,
    pub inbox: mpsc::Receiver<BusMsg>,
}

/// The cheap-to-clone handle to one running gateway.
#[derive(Clone)]
pub struct Gateway {
    inner: Arc<Inner>,
}

struct Inner {
    config: GatewayConfig,
    store: Arc<dyn Store>,
    provider: Arc<dyn Provider>,
    server_tools: Arc<dyn ServerTools>,
    hub: Hub,
    tokens: tokens::TokenCache,
    bus: Option<Arc<dyn Bus>>,
    metrics: Metrics,
    tasks: TaskTracker,
    shutdown: CancellationToken,
    /// The replica's own tasks (bus dispatcher, heartbeat): they outlive `tasks`, because turns
    /// finishing during shutdown still need their heartbeat (or another replica fails them) and
    /// their TOOL_RESULTs from other replicas.
    replica_tasks: TaskTracker,
    replica_stop: CancellationToken,
}

impl Gateway {
    /// Builds the engine and recovers from an unclean stop: turns still marked running were
    /// interrupted and are marked failed (their sessions keep their last snapshot).
    pub async fn start(
        config: GatewayConfig,
        store: Arc<dyn Store>,
        provider: Arc<dyn Provider>,
    ) -> Result<Self, ApiError> {
        Self::start_with_tools(config, store, provider, Arc::new(NoServerTools)).await
    }

    /// [`Gateway::start`] with the tools of southbound MCP servers offered to the LLM.
    pub async fn start_with_tools(
        config: GatewayConfig,
        store: Arc<dyn Store>,
        provider: Arc<dyn Provider>,
        server_tools: Arc<dyn ServerTools>,
    ) -> Result<Self, ApiError> {
        Self::start_replica(config, store, provider, server_tools, None).await
    }

    /// [`Gateway::start_with_tools`] as one of several replicas sharing the store, connected by
    /// `bus`. Alone (no bus) every turn still running in the store was interrupted by this
    /// process's own restart and is failed now; among replicas only the turns of replicas that
    /// stopped heartbeating are, now and periodically.
    pub async fn start_replica(
        config: GatewayConfig,
        store: Arc<dyn Store>,
        provider: Arc<dyn Provider>,
        server_tools: Arc<dyn ServerTools>,
        bus: Option<BusLink>,
    ) -> Result<Self, ApiError> {
        if config.secret.len() < 32 {
            return Err(ApiError::internal(
                "starting the gateway",
                "the signing secret must be at least 32 bytes",
            ));
        }
        let now = Utc::now();
        let recovered = match &bus {
            None => store.recover_interrupted_turns(now).await?,
            Some(_) => {
                store.replica_heartbeat(&config.replica_id, now).await?;
                store
                    .recover_orphaned_turns(now, now - chrono_span(config.replica_timeout))
                    .await?
            }
        };
        for turn in &recovered {
            tracing::warn!(session_id = %turn.session_id, turn_id = %turn.id, owner = turn.owner.as_deref().unwrap_or(""), "turn interrupted by a stopped gateway marked failed");
        }
        let (bus, inbox) = match bus {
            Some(link) => (Some(link.bus), Some(link.inbox)),
            None => (None, None),
        };
        let gw = Self {
            inner: Arc::new(Inner {
                config,
                store,
                provider,
                server_tools,
                hub: Hub::new(bus.clone()),
                tokens: tokens::TokenCache::default(),
                bus,
                metrics: Metrics::default(),
                tasks: TaskTracker::new(),
                shutdown: CancellationToken::new(),
                replica_tasks: TaskTracker::new(),
                replica_stop: CancellationToken::new(),
            }),
        };
        if let Some(inbox) = inbox {
            gw.inner.replica_tasks.spawn(gw.clone().dispatch(inbox));
            gw.inner.replica_tasks.spawn(gw.clone().replica_upkeep());
            gw.inner.replica_tasks.spawn(gw.clone().bus_upkeep());
        }
        Ok(gw)
    }

    /// The replica bus, when this gateway is one of several.
    pub(crate) fn bus(&self) -> Option<&Arc<dyn Bus>> {
        self.inner.bus.as_ref()
    }

    /// The session's surface, attached here or (with a bus) on another live replica.
    /// With a bus, a connection here counts only while the registry names it: one displaced by
    /// an attach elsewhere whose message has not arrived (or was lost) must not get this
    /// session's turns.
    pub(crate) async fn locate(&self, session: Uuid) -> Option<Attachment> {
        let local = self.hub().get(session);
        let Some(bus) = self.bus() else {
            return local;
        };
        if let Some(att) = local {
            match bus.holders(&[session]).await {
                Ok(h)
                    if h.first().is_some_and(|h| {
                        h.as_ref()
                            .is_some_and(|(r, c)| r == bus.replica() && *c == att.conn_id)
                    }) =>
                {
                    return Some(att);
                }
                Ok(_) => {
                    self.recheck_holder(bus.as_ref(), session, att.conn_id)
                        .await;
                    if let Some(att) = self.hub().get(session) {
                        return Some(att);
                    }
                }
                Err(e) => {
                    tracing::warn!(session_id = %session, error = %e, "checking the surface registry failed");
                    return Some(att);
                }
            }
        }
        match bus.holder(session).await {
            // Held by this replica but not in the hub: a connection that is closing.
            Ok(Some(h)) if h.replica != bus.replica() => Some(Attachment {
                conn_id: h.conn,
                surface: Arc::new(h.surface),
                route: Route::Remote(Arc::from(h.replica)),
            }),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "looking up the session's surface on the bus failed");
                None
            }
        }
    }

    /// Tells the session's surface, wherever it is attached, that a turn was committed. Returns
    /// whether a surface was attached. Best effort: a surface that misses it catches up from the
    /// tether.
    pub(crate) async fn turn_done(&self, session: Uuid, done: hub::TurnDone) -> bool {
        let Some(att) = self.locate(session).await else {
            return false;
        };
        match &att.route {
            Route::Local { .. } => self
                .hub()
                .notify(session, hub::ConnMsg::TurnDone(Box::new(done))),
            Route::Remote(replica) => {
                if let Some(bus) = self.bus() {
                    let msg = sbp_bus::TurnDoneMsg {
                        chunk_id: done.chunk_id,
                        seq: done.seq,
                        role: done.role,
                        content: done.content,
                        model_used: done.model_used,
                    };
                    bus.send(replica, BusMsg::TurnDone { session, done: msg });
                }
            }
        }
        true
    }

    /// Handles what other replicas send this one until shutdown.
    async fn dispatch(self, mut inbox: mpsc::Receiver<BusMsg>) {
        let shutdown = self.inner.replica_stop.clone();
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => return,
                m = inbox.recv() => match m {
                    Some(m) => m,
                    None => return,
                },
            };
            match msg {
                BusMsg::Chunk {
                    session,
                    conn,
                    chunk_id,
                    delta,
                    round,
                    offset,
                } => self.hub().chunk_for(
                    session,
                    conn,
                    hub::ConnMsg::Chunk(Box::new(hub::LiveChunk {
                        chunk_id,
                        delta,
                        round,
                        offset,
                    })),
                ),
                BusMsg::TurnDone { session, done } => self.hub().notify(
                    session,
                    hub::ConnMsg::TurnDone(Box::new(hub::TurnDone {
                        chunk_id: done.chunk_id,
                        seq: done.seq,
                        role: done.role,
                        content: done.content,
                        model_used: done.model_used,
                    })),
                ),
                BusMsg::ToolCall {
                    session,
                    conn,
                    reply_to,
                    call,
                } => self.relay_tool_call(session, conn, reply_to, call),
                BusMsg::ToolReply { call_id, outcome } => {
                    self.hub().finish_call(call_id, outcome.into());
                }
                BusMsg::Displace { session, conn } => {
                    if self.hub().displace(session, conn) {
                        tracing::info!(session_id = %session, conn_id = conn, "surface displaced by an attach on another replica");
                    }
                }
            }
        }
    }

    /// Compares this process's connections with the bus registry, which is the truth about who
    /// holds a session: a connection the registry no longer names was displaced by a message this
    /// replica never got (pub/sub is at most once) and is displaced now; a session the registry
    /// lost (Redis restarted empty) is registered again.
    async fn reconcile_holders(&self, bus: &dyn Bus) {
        const BATCH: usize = 500;
        let local = self.hub().local_attachments();
        for part in local.chunks(BATCH) {
            let sessions: Vec<Uuid> = part.iter().map(|(s, _)| *s).collect();
            let holders = match bus.holders(&sessions).await {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(error = %e, "reading the surface registry failed");
                    return;
                }
            };
            for (&(session, conn), holder) in part.iter().zip(holders) {
                let ours = matches!(&holder, Some((r, c)) if r == bus.replica() && *c == conn);
                if !ours {
                    self.recheck_holder(bus, session, conn).await;
                }
            }
        }
    }

    /// [`Gateway::reconcile_holders`] for one connection, under the session's lock (an attach in
    /// progress registers here before it claims the registry: it must not be mistaken for one
    /// the registry forgot).
    async fn recheck_holder(&self, bus: &dyn Bus, session: Uuid, conn: u64) {
        // The same order as attach and detach: the bus's lock, then this process's.
        let lock = match bus.lock(session).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "checking the surface registry failed");
                return;
            }
        };
        {
            let _guard = self.hub().session_lock(session).lock().await;
            self.recheck_locked(bus, session, conn).await;
        }
        bus.unlock(lock).await;
    }

    async fn recheck_locked(&self, bus: &dyn Bus, session: Uuid, conn: u64) {
        let Some(att) = self.hub().get(session).filter(|a| a.conn_id == conn) else {
            return;
        };
        let holder = match bus.holders(&[session]).await {
            Ok(h) => h.into_iter().next().flatten(),
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "reading the surface registry failed");
                return;
            }
        };
        match holder {
            Some((r, c)) if r == bus.replica() && c == conn => {}
            Some((replica, _)) => {
                if self.hub().displace(session, conn) {
                    tracing::warn!(session_id = %session, conn_id = conn, holder = %replica, "surface displaced late: the registry names another surface (a displacement message was lost)");
                }
            }
            None => {
                // Either the registry lost the entry (Redis restarted empty: this connection is
                // still the session's) or a newer surface displaced this one and then detached
                // (the session is suspended): only the first is claimed again.
                let suspended = matches!(
                    self.store().get_session(session).await,
                    Ok(Some(s)) if s.status == sbp_protocol::SessionStatus::Suspended
                );
                if suspended {
                    if self.hub().displace(session, conn) {
                        tracing::warn!(session_id = %session, conn_id = conn, "surface displaced late: another surface took the session and detached");
                    }
                    return;
                }
                match bus.reclaim(session, conn, &att.surface).await {
                    Ok(true) => {
                        tracing::warn!(session_id = %session, conn_id = conn, "surface registered again: the registry had lost it");
                    }
                    Ok(false) => {} // claimed by another surface meanwhile: the next pass displaces this one
                    Err(e) => {
                        tracing::warn!(session_id = %session, error = %e, "registering the surface again failed");
                    }
                }
            }
        }
    }

    /// Heartbeats into the database and fails the turns of replicas that stopped doing so.
    async fn replica_upkeep(self) {
        let shutdown = self.inner.replica_stop.clone();
        let every = self.config().replica_heartbeat;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let now = Utc::now();
            let id = &self.config().replica_id;
            // Bounded: a stalled database must not stop the rest of the upkeep for long (the
            // heartbeat is retried on the next tick).
            let beat = tokio::time::timeout(every, self.store().replica_heartbeat(id, now)).await;
            if let Ok(Err(e)) = beat {
                tracing::warn!(error = %e, "recording the replica heartbeat failed");
            }
            let stale = now - chrono_span(self.config().replica_timeout);
            match self.store().recover_orphaned_turns(now, stale).await {
                Ok(turns) => {
                    for turn in turns {
                        tracing::warn!(session_id = %turn.session_id, turn_id = %turn.id, owner = turn.owner.as_deref().unwrap_or(""), "turn of a stopped replica marked failed");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "recovering turns of stopped replicas failed"),
            }
        }
    }

    /// The bus side of the upkeep, in its own task so a slow or unreachable Redis never delays
    /// the heartbeat that keeps this replica's turns from being failed by the others: the
    /// registry reconcile, expiring relays, and failing calls waiting on dead replicas.
    async fn bus_upkeep(self) {
        let Some(bus) = self.bus().cloned() else {
            return;
        };
        let shutdown = self.inner.replica_stop.clone();
        let mut tick = tokio::time::interval(self.config().replica_heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            self.reconcile_holders(bus.as_ref()).await;
            let expired = self.hub().expire_relays(std::time::Instant::now());
            if expired > 0 {
                tracing::info!(
                    calls = expired,
                    "relayed tool calls the surface never answered expired"
                );
            }
            let waited_on = self.hub().remote_call_replicas();
            if !waited_on.is_empty() {
                match bus.alive(&waited_on).await {
                    Ok(alive) => {
                        let dead: Vec<&String> = waited_on
                            .iter()
                            .zip(alive)
                            .filter(|(_, a)| !a)
                            .map(|(r, _)| r)
                            .collect();
                        if !dead.is_empty() {
                            let n = self.hub().fail_calls_via(|r| dead.iter().any(|d| *d == r));
                            tracing::warn!(replicas = ?dead, calls = n, "tool calls waiting on stopped replicas failed");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "checking replica liveness failed"),
                }
            }
        }
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.inner.config
    }

    pub(crate) fn store(&self) -> &dyn Store {
        self.inner.store.as_ref()
    }

    pub(crate) fn server_tools(&self) -> &dyn ServerTools {
        self.inner.server_tools.as_ref()
    }

    pub(crate) fn hub(&self) -> &Hub {
        &self.inner.hub
    }

    pub(crate) fn tokens(&self) -> &tokens::TokenCache {
        &self.inner.tokens
    }

    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Cancelled when the gateway stops; long-lived tasks (sockets, streams) watch it.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.inner.shutdown.clone()
    }

    /// Runs `fut` as a tracked task: shutdown waits for it.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.inner.tasks.spawn(fut)
    }

    /// Runs `f` as a tracked task on the blocking pool.
    pub fn blocking<F, R>(&self, f: F) -> tokio::task::JoinHandle<R>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        self.inner.tasks.spawn_blocking(f)
    }

    /// Tracks a future that is already running on its own task (e.g. an upgraded WebSocket).
    pub fn track<F: std::future::Future>(
        &self,
        fut: F,
    ) -> tokio_util::task::task_tracker::TrackedFuture<F> {
        self.inner.tasks.track_future(fut)
    }

    /// Stops accepting work, signals connections to close and waits for tracked tasks; then stops
    /// the replica's own tasks.
    pub async fn shutdown(&self) {
        self.inner.shutdown.cancel();
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
        self.inner.replica_stop.cancel();
        self.inner.replica_tasks.close();
        self.inner.replica_tasks.wait().await;
    }

    /// The Prometheus text for `/metrics`.
    pub async fn render_metrics(&self) -> Result<String, ApiError> {
        let counts = self.store().count_sessions_by_status().await?;
        let sessions_by_status = sbp_protocol::SessionStatus::ALL
            .iter()
            .map(|st| {
                let n = counts
                    .iter()
                    .find(|(s, _)| s == st)
                    .map(|(_, n)| *n)
                    .unwrap_or(0);
                (st.as_str(), n)
            })
            .collect();
        let live = LiveGauges {
            sessions_by_status,
            tether_depth: self.store().tether_depth_total().await?,
            attached_surfaces: self.hub().attached_count() as u64,
        };
        Ok(self.metrics().render(&live))
    }
}

/// A std duration as a chrono one (saturating: durations here are seconds, never centuries).
fn chrono_span(d: std::time::Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

/// RFC 3339 with milliseconds, UTC: the timestamp form of every response and frame.
pub fn iso(ts: &Timestamp) -> String {
    ts.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Parses a path id, or fails with SPEC 12's `SBP_INVALID_UUID`.
pub fn parse_uuid(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| {
        ApiError::new(
            sbp_protocol::ErrorCode::InvalidUuid,
            format!("'{raw}' is not a valid UUID"),
        )
    })
}
