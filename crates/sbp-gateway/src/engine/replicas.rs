//! Everything that crosses the replica bus (`sbp serve --bus`), in one place: finding a session's
//! surface (here or on another replica), delivering to it wherever it is (live chunks, completed
//! turns, TOOL_CALLs), the per-session locks and registry claims of attach and detach, the
//! dispatcher of what other replicas send, and the replica's upkeep (heartbeats, failing the turns
//! and calls of replicas that died, reconciling the registry).
//!
//! Without a bus every function here reduces to this process's [`Connections`].
//!
//! What crosses the bus is never the only copy of anything acknowledged: a turn is committed (with
//! its tether entry) before its notice is published, so a lost message costs latency (the
//! surface's catch-up reads the tether) or, for a TOOL_CALL, a timeout; never data.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sbp_bus::{Bus, BusError, BusMsg, LiveChunk, RelayedOutcome, TurnDone};
use sbp_protocol::frames::ToolCall;
use sbp_protocol::{SessionStatus, SurfaceContext, ToolFailure};
use sbp_store::Store;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::calls::PendingCalls;
use super::connections::{Attachment, ConnMsg, Connections, Route, Sent};
use super::tasks::Tasks;
use crate::config::GatewayConfig;

/// A replica bus handed to the engine: the bus, and what other replicas send this one.
pub struct BusLink {
    pub bus: Arc<dyn Bus>,
    pub inbox: mpsc::Receiver<BusMsg>,
}

/// Registry checks read this many sessions at once.
const RECONCILE_BATCH: usize = 500;
/// Longest a relayed call is kept for its caller on another replica.
const MAX_RELAY: Duration = Duration::from_secs(86_400);

#[derive(Clone)]
pub struct Replicas {
    inner: Arc<Shared>,
}

struct Shared {
    bus: Option<Arc<dyn Bus>>,
    connections: Arc<Connections>,
    calls: Arc<PendingCalls>,
    store: Arc<dyn Store>,
    config: Arc<GatewayConfig>,
    /// The replica's own tasks (dispatcher, heartbeats, relays): they outlive the gateway's, because
    /// turns finishing during shutdown still need their heartbeat (or another replica fails them)
    /// and their TOOL_RESULTs from other replicas.
    tasks: Tasks,
}

impl Replicas {
    pub fn new(
        bus: Option<Arc<dyn Bus>>,
        connections: Arc<Connections>,
        calls: Arc<PendingCalls>,
        store: Arc<dyn Store>,
        config: Arc<GatewayConfig>,
    ) -> Self {
        Self {
            inner: Arc::new(Shared {
                bus,
                connections,
                calls,
                store,
                config,
                tasks: Tasks::default(),
            }),
        }
    }

    /// Fails the turns a stopped gateway left running. Alone (no bus) every running turn was
    /// interrupted by this process's own restart; among replicas only those of replicas whose
    /// heartbeat stopped are (and then periodically, by [`Replicas::start`]'s upkeep).
    pub async fn recover_turns(
        store: &dyn Store,
        config: &GatewayConfig,
        replicated: bool,
    ) -> Result<(), sbp_store::StoreError> {
        let now = Utc::now();
        let recovered = if replicated {
            store.replica_heartbeat(&config.replica_id, now).await?;
            store
                .recover_orphaned_turns(now, now - chrono_span(config.replica_timeout))
                .await?
        } else {
            store.recover_interrupted_turns(now).await?
        };
        for turn in &recovered {
            tracing::warn!(session_id = %turn.session_id, turn_id = %turn.id, owner = turn.owner.as_deref().unwrap_or(""), "turn interrupted by a stopped gateway marked failed");
        }
        Ok(())
    }

    /// Starts the dispatcher of `inbox` and the upkeep tasks (with a bus only).
    pub fn start(&self, inbox: mpsc::Receiver<BusMsg>) {
        let Some(bus) = self.inner.bus.clone() else {
            return;
        };
        self.inner.tasks.spawn(self.clone().dispatch(inbox));
        self.inner.tasks.spawn(self.clone().heartbeat());
        self.inner.tasks.spawn(self.clone().bus_upkeep(bus));
    }

    /// Stops the replica's own tasks (after the gateway's).
    pub async fn stop(&self) {
        self.inner.tasks.stop().await;
    }

    /// The session's surface, attached here or (with a bus) on another live replica.
    /// With a bus, a connection here counts only while the registry names it: one displaced by
    /// an attach elsewhere whose message has not arrived (or was lost) must not get this
    /// session's turns.
    pub async fn locate(&self, session: Uuid) -> Option<Attachment> {
        let local = self.inner.connections.get(session);
        let Some(bus) = &self.inner.bus else {
            return local;
        };
        if let Some(att) = local {
            match bus.holders(&[session]).await {
                Ok(h)
                    if is_ours(
                        bus.as_ref(),
                        h.first().and_then(Option::as_ref),
                        att.conn_id,
                    ) =>
                {
                    return Some(att);
                }
                Ok(_) => {
                    self.recheck_holder(bus.as_ref(), session, att.conn_id)
                        .await;
                    if let Some(att) = self.inner.connections.get(session) {
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
            // Held by this replica but not registered here: a connection that is closing.
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
    pub async fn notify_turn_done(&self, session: Uuid, done: TurnDone) -> bool {
        let Some(att) = self.locate(session).await else {
            return false;
        };
        match &att.route {
            // A full inbox still counts: the connection catches the turn up from the tether. A
            // connection being dropped as a slow consumer does not.
            Route::Local { .. } => {
                self.inner
                    .connections
                    .send(session, None, ConnMsg::TurnDone(Box::new(done)))
                    != Sent::Gone
            }
            Route::Remote(replica) => {
                if let Some(bus) = &self.inner.bus {
                    bus.send(replica, BusMsg::TurnDone { session, done });
                }
                true
            }
        }
    }

    /// A live delta for `target`, the session's surface when the turn started; false when it can
    /// no longer be streamed there (gone, displaced, or behind): the turn then reaches it whole.
    pub fn send_chunk(&self, session: Uuid, target: &Attachment, chunk: LiveChunk) -> bool {
        match &target.route {
            Route::Local { .. } => {
                self.inner.connections.send(
                    session,
                    Some(target.conn_id),
                    ConnMsg::Chunk(Box::new(chunk)),
                ) == Sent::Queued
            }
            // The holder's replica drops it if the connection is no longer current.
            Route::Remote(replica) => self.inner.bus.as_ref().is_some_and(|bus| {
                bus.send(
                    replica,
                    BusMsg::Chunk {
                        session,
                        conn: target.conn_id,
                        chunk,
                    },
                )
            }),
        }
    }

    /// Sends a TOOL_CALL to the surface `att`, here or through its replica; false when it cannot
    /// reach it (the connection is no longer current, or the bus refused the message).
    pub fn deliver_tool_call(&self, session: Uuid, att: &Attachment, call: ToolCall) -> bool {
        match &att.route {
            Route::Local { .. } => {
                tracing::info!(session_id = %session, call_id = %call.call_id, tool = %call.tool_name, conn_id = att.conn_id, "TOOL_CALL sent");
                // Only to the connection that is still the session's: one that closed (or was
                // displaced) before its cancel sweep could see this call must not be waited on.
                self.inner.connections.push_call(session, att.conn_id, call)
            }
            Route::Remote(replica) => {
                tracing::info!(session_id = %session, call_id = %call.call_id, tool = %call.tool_name, conn_id = att.conn_id, replica = %replica, "TOOL_CALL sent through another replica");
                self.inner.bus.as_ref().is_some_and(|bus| {
                    bus.send(
                        replica,
                        BusMsg::ToolCall {
                            session,
                            conn: att.conn_id,
                            reply_to: bus.replica().to_owned(),
                            call,
                        },
                    )
                })
            }
        }
    }

    /// Runs `work` holding the session's locks: the bus's (with replicas), then this process's
    /// striped one. Always in that order, so the two never deadlock, and a session waiting for
    /// its bus lock does not hold a stripe other sessions share.
    pub async fn locked<T>(
        &self,
        session: Uuid,
        work: impl Future<Output = T>,
    ) -> Result<T, BusError> {
        let lock = match &self.inner.bus {
            Some(bus) => Some(bus.lock(session).await?),
            None => None,
        };
        let out = {
            let _guard = self.inner.connections.session_lock(session).lock().await;
            work.await
        };
        if let (Some(bus), Some(lock)) = (&self.inner.bus, lock) {
            bus.unlock(lock).await;
        }
        Ok(out)
    }

    /// Records on the bus that `conn` (registered here already) holds the session now; a
    /// previous holder on another replica is told to close.
    pub async fn claim(
        &self,
        session: Uuid,
        conn: u64,
        surface: &SurfaceContext,
    ) -> Result<(), BusError> {
        let Some(bus) = &self.inner.bus else {
            return Ok(());
        };
        if let Some(old) = bus.claim(session, conn, surface).await?
            && old.replica != bus.replica()
        {
            tracing::info!(session_id = %session, replica = %old.replica, conn_id = old.conn, "displacing the surface attached on another replica");
            bus.send(
                &old.replica,
                BusMsg::Displace {
                    session,
                    conn: old.conn,
                },
            );
        }
        Ok(())
    }

    /// Displaces the session's surface wherever it is attached (the session left this
    /// deployment: it moved to another gateway).
    pub async fn displace(&self, session: Uuid) {
        let displaced = |session, conn| BusMsg::Displace { session, conn };
        self.end_surface(session, displaced, Connections::displace)
            .await;
    }

    /// Closes the session's surface wherever it is attached, and forgets it on the bus: the
    /// session was deleted (the closing connection, no longer current, releases nothing).
    pub async fn close_deleted(&self, session: Uuid) {
        let deleted = |session, conn| BusMsg::Deleted { session, conn };
        let Some(att) = self
            .end_surface(session, deleted, Connections::deleted)
            .await
        else {
            return;
        };
        if let Some(bus) = &self.inner.bus
            && let Err(e) = bus.release(session, att.conn_id).await
        {
            tracing::warn!(session_id = %session, error = %e, "forgetting a deleted session's surface on the bus failed");
        }
    }

    /// Ends the session's surface wherever it is attached: `remote` is the message for the
    /// replica holding it, `local` ends it in this process. Returns the attachment it ended.
    async fn end_surface(
        &self,
        session: Uuid,
        remote: impl FnOnce(Uuid, u64) -> BusMsg,
        local: impl FnOnce(&Connections, Uuid, u64) -> bool,
    ) -> Option<Attachment> {
        let att = self.locate(session).await?;
        match (att.replica(), &self.inner.bus) {
            (Some(replica), Some(bus)) => {
                bus.send(&replica, remote(session, att.conn_id));
            }
            _ => {
                local(&self.inner.connections, session, att.conn_id);
            }
        }
        Some(att)
    }

    /// Withdraws a claim whose attach failed (the claim may have been applied before the error):
    /// the registry must not name a connection that never served.
    pub async fn withdraw(&self, session: Uuid, conn: u64) {
        if let Some(bus) = &self.inner.bus
            && let Err(e) = bus.release(session, conn).await
        {
            tracing::warn!(session_id = %session, error = %e, "withdrawing a failed claim failed");
        }
    }

    /// Forgets `conn` as the session's holder. False when a surface on another replica holds the
    /// session now (its displacement of `conn` is on its way): the session must stay running.
    pub async fn release(&self, session: Uuid, conn: u64) -> bool {
        let Some(bus) = &self.inner.bus else {
            return true;
        };
        match bus.release(session, conn).await {
            Ok(released) => released,
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "releasing the session on the bus failed");
                true
            }
        }
    }

    /// The surface of `conn` declared itself again (a repeated ATTACH_SESSION).
    pub async fn update_surface(&self, session: Uuid, conn: u64, surface: &SurfaceContext) {
        if let Some(bus) = &self.inner.bus
            && let Err(e) = bus.update(session, conn, surface).await
        {
            tracing::warn!(session_id = %session, error = %e, "updating the surface on the bus failed");
        }
    }

    /// Handles what other replicas send this one until shutdown.
    async fn dispatch(self, mut inbox: mpsc::Receiver<BusMsg>) {
        let stop = self.inner.tasks.stopping();
        loop {
            let msg = tokio::select! {
                _ = stop.cancelled() => return,
                m = inbox.recv() => match m {
                    Some(m) => m,
                    None => return,
                },
            };
            match msg {
                BusMsg::Chunk {
                    session,
                    conn,
                    chunk,
                } => {
                    // One dropped here (full inbox) shows as a gap in the offsets downstream.
                    self.inner.connections.send(
                        session,
                        Some(conn),
                        ConnMsg::Chunk(Box::new(chunk)),
                    );
                }
                BusMsg::TurnDone { session, done } => {
                    self.inner
                        .connections
                        .send(session, None, ConnMsg::TurnDone(Box::new(done)));
                }
                BusMsg::ToolCall {
                    session,
                    conn,
                    reply_to,
                    call,
                } => self.relay_tool_call(session, conn, reply_to, call),
                BusMsg::ToolReply { call_id, outcome } => {
                    self.inner.calls.finish(call_id, outcome.0);
                }
                BusMsg::Displace { session, conn } => {
                    if self.inner.connections.displace(session, conn) {
                        tracing::info!(session_id = %session, conn_id = conn, "surface displaced by an attach on another replica");
                    }
                }
                BusMsg::Deleted { session, conn } => {
                    if self.inner.connections.deleted(session, conn) {
                        tracing::info!(session_id = %session, conn_id = conn, "surface closed: its session was deleted on another replica");
                    }
                }
            }
        }
    }

    /// A TOOL_CALL from a turn on replica `reply_to` for this process's connection `conn`: sent to
    /// the surface, its outcome (or a timeout, or "surface disconnected" when the connection
    /// closes) sent back. Kept no longer than the call's own timeout, after which the waiting
    /// replica has given up anyway.
    fn relay_tool_call(&self, session: Uuid, conn: u64, reply_to: String, call: ToolCall) {
        let (Some(bus), Ok(call_id)) = (self.inner.bus.clone(), Uuid::parse_str(&call.call_id))
        else {
            return;
        };
        let timeout = call
            .timeout_ms
            .map(Duration::from_millis)
            .unwrap_or(self.inner.config.tool_timeout)
            .min(MAX_RELAY);
        tracing::debug!(session_id = %session, call_id = %call.call_id, tool = %call.tool_name, conn_id = conn, from = %reply_to, "TOOL_CALL relayed for another replica");
        let mut rx = self.inner.calls.register(session, conn, call_id, None);
        if !self.inner.connections.push_call(session, conn, call) {
            self.inner
                .calls
                .finish(call_id, Err(ToolFailure::Disconnected));
        }
        let (calls, stop) = (self.inner.calls.clone(), self.inner.tasks.stopping());
        let deadline = tokio::time::Instant::now() + timeout;
        self.inner.tasks.spawn(async move {
            let outcome = tokio::select! {
                // An outcome already there (a connection closing at shutdown fails its calls
                // just before the replica's tasks stop) is still sent.
                biased;
                outcome = calls.wait(call_id, &mut rx, deadline) => outcome,
                _ = stop.cancelled() => return,
            };
            let outcome = RelayedOutcome(outcome);
            bus.send(&reply_to, BusMsg::ToolReply { call_id, outcome });
        });
    }

    /// Heartbeats into the database and fails the turns of replicas that stopped doing so. In a
    /// task of its own, so a slow or unreachable Redis never delays it.
    async fn heartbeat(self) {
        let every = self.inner.config.replica_heartbeat;
        let mut ticks = Ticks::new(every, self.inner.tasks.stopping());
        while ticks.next().await {
            let now = Utc::now();
            // Bounded: a stalled database must not stop the rest of the upkeep for long (the
            // heartbeat is retried on the next tick).
            let beat = tokio::time::timeout(
                every,
                self.inner
                    .store
                    .replica_heartbeat(&self.inner.config.replica_id, now),
            )
            .await;
            if let Ok(Err(e)) = beat {
                tracing::warn!(error = %e, "recording the replica heartbeat failed");
            }
            let stale = now - chrono_span(self.inner.config.replica_timeout);
            match self.inner.store.recover_orphaned_turns(now, stale).await {
                Ok(turns) => {
                    for turn in turns {
                        tracing::warn!(session_id = %turn.session_id, turn_id = %turn.id, owner = turn.owner.as_deref().unwrap_or(""), "turn of a stopped replica marked failed");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "recovering turns of stopped replicas failed"),
            }
        }
    }

    /// The bus side of the upkeep: the registry reconcile, and failing calls waiting on dead
    /// replicas.
    async fn bus_upkeep(self, bus: Arc<dyn Bus>) {
        let mut ticks = Ticks::new(
            self.inner.config.replica_heartbeat,
            self.inner.tasks.stopping(),
        );
        while ticks.next().await {
            self.reconcile_holders(bus.as_ref()).await;
            let waited_on = self.inner.calls.replicas_waited_on();
            if waited_on.is_empty() {
                continue;
            }
            match bus.alive(&waited_on).await {
                Ok(alive) => {
                    let dead: Vec<&String> = waited_on
                        .iter()
                        .zip(alive)
                        .filter(|(_, a)| !a)
                        .map(|(r, _)| r)
                        .collect();
                    if !dead.is_empty() {
                        let n = self.inner.calls.fail_via(|r| dead.iter().any(|d| *d == r));
                        tracing::warn!(replicas = ?dead, calls = n, "tool calls waiting on stopped replicas failed");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "checking replica liveness failed"),
            }
        }
    }

    /// Compares this process's connections with the bus registry, which is the truth about who
    /// holds a session: a connection the registry no longer names was displaced by a message this
    /// replica never got (pub/sub is at most once) and is displaced now; a session the registry
    /// lost (Redis restarted empty) is registered again.
    async fn reconcile_holders(&self, bus: &dyn Bus) {
        let local = self.inner.connections.all();
        for part in local.chunks(RECONCILE_BATCH) {
            let sessions: Vec<Uuid> = part.iter().map(|(s, _)| *s).collect();
            let holders = match bus.holders(&sessions).await {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(error = %e, "reading the surface registry failed");
                    return;
                }
            };
            for (&(session, conn), holder) in part.iter().zip(holders) {
                if !is_ours(bus, holder.as_ref(), conn) {
                    self.recheck_holder(bus, session, conn).await;
                }
            }
        }
    }

    /// [`Replicas::reconcile_holders`] for one connection, under the session's locks (an attach
    /// in progress registers here before it claims the registry: it must not be mistaken for one
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
            let _guard = self.inner.connections.session_lock(session).lock().await;
            self.recheck_locked(bus, session, conn).await;
        }
        bus.unlock(lock).await;
    }

    async fn recheck_locked(&self, bus: &dyn Bus, session: Uuid, conn: u64) {
        let Some(att) = self
            .inner
            .connections
            .get(session)
            .filter(|a| a.conn_id == conn)
        else {
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
                if self.inner.connections.displace(session, conn) {
                    tracing::warn!(session_id = %session, conn_id = conn, holder = %replica, "surface displaced late: the registry names another surface (a displacement message was lost)");
                }
            }
            None => {
                // Either the registry lost the entry (Redis restarted empty: this connection is
                // still the session's) or a newer surface displaced this one and then detached
                // (the session is suspended): only the first is claimed again.
                let suspended = matches!(
                    self.inner.store.get_session(session).await,
                    Ok(Some(s)) if s.status == SessionStatus::Suspended
                );
                if suspended {
                    if self.inner.connections.displace(session, conn) {
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
}

/// A periodic task's clock: a tick every `every` (late ticks are delayed, not bunched) until
/// stopped.
struct Ticks {
    tick: tokio::time::Interval,
    stop: CancellationToken,
}

impl Ticks {
    fn new(every: Duration, stop: CancellationToken) -> Self {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self { tick, stop }
    }

    /// Waits for the next tick; false once stopped.
    async fn next(&mut self) -> bool {
        tokio::select! {
            _ = self.stop.cancelled() => false,
            _ = self.tick.tick() => true,
        }
    }
}

/// Whether the registry's `holder` is connection `conn` of this replica.
fn is_ours(bus: &dyn Bus, holder: Option<&(String, u64)>, conn: u64) -> bool {
    holder.is_some_and(|(r, c)| r == bus.replica() && *c == conn)
}

/// A std duration as a chrono one (saturating: durations here are seconds, never centuries).
fn chrono_span(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}
