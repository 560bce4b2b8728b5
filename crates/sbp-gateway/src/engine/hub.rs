//! Which surface is attached to which session, in this process, and the channel that reaches it.
//! One surface per session: registering a new one displaces the old. Attach/detach status changes of
//! one session are serialised by a striped async lock so a displaced socket's close cannot suspend a
//! session a new surface has just attached to (with replicas, by the bus's lock as well).
//!
//! With a replica bus, an [`Attachment`] may also be [`Route::Remote`]: the surface is held by
//! another replica, and what this process sends it goes over the bus. Tool calls whose surface is
//! here but whose turn runs elsewhere are *relayed*: their TOOL_RESULT goes back over the bus.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use sbp_bus::{Bus, BusMsg, CallOutcome};
use sbp_protocol::SurfaceContext;
use sbp_protocol::frames::ToolCall;
use tokio::sync::{Notify, mpsc, oneshot};
use uuid::Uuid;

/// Capacity of a connection's inbox. A producer that finds it full stops streaming live to that
/// connection; the turn is still persisted (and tethered) and reaches the surface from storage.
pub const CONN_INBOX: usize = 1024;
const LOCK_STRIPES: usize = 64;
/// The error result of a tool call whose surface went away.
pub const DISCONNECTED: &str = "surface disconnected";
/// The error result of a call the surface did not answer in time (SPEC 10.4).
pub const TIMEOUT: &str = "timeout";

/// A message from the engine to one attached connection.
#[derive(Debug, Clone)]
pub enum ConnMsg {
    /// A live streaming delta (boxed like `TurnDone`: a channel allocates its first block of
    /// slots up front, so the slot size is paid by every idle connection).
    Chunk(Box<LiveChunk>),
    /// A turn was completed and persisted (boxed: inbox slots stay small, which matters for
    /// thousands of idle connections).
    TurnDone(Box<TurnDone>),
    /// Another surface attached to the session; this connection must close.
    Displaced,
}

/// A live streaming delta of the turn `chunk_id`, starting `offset` bytes into the text of the
/// turn's upstream round `round`.
#[derive(Debug, Clone)]
pub struct LiveChunk {
    pub chunk_id: Uuid,
    pub delta: String,
    pub round: u32,
    pub offset: u64,
}

/// What a connection receives from the engine: turn traffic, and TOOL_CALLs on their own queue so
/// a call never waits behind a backlog of chunks or a CTP rewrite.
#[derive(Debug)]
pub struct Inbox {
    pub msgs: mpsc::Receiver<ConnMsg>,
    pub calls: Arc<CallQueue>,
}

impl Drop for Inbox {
    fn drop(&mut self) {
        // Calls pushed from now on fail at once instead of waiting for a reader that is gone.
        self.calls.close();
    }
}

/// TOOL_CALLs waiting to be written to one connection. A queue and a `Notify` rather than a second
/// channel: a channel allocates its first block of slots up front, which thousands of idle surfaces
/// would pay for; this costs nothing until a call is made.
#[derive(Debug, Default)]
pub struct CallQueue {
    queue: Mutex<VecDeque<Box<ToolCall>>>,
    ready: Notify,
    closed: AtomicBool,
}

impl CallQueue {
    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Box<ToolCall>>> {
        // push/pop cannot leave the queue half-updated, so a poisoned lock is still usable.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a call for the connection; false when the connection is gone.
    pub fn push(&self, call: Box<ToolCall>) -> bool {
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        self.queue().push_back(call);
        self.ready.notify_one();
        true
    }

    pub fn pop(&self) -> Option<Box<ToolCall>> {
        self.queue().pop_front()
    }

    /// Resolves when calls may be waiting (a permit is kept if nobody is waiting yet).
    pub async fn ready(&self) {
        self.ready.notified().await;
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.queue().clear();
    }
}

/// The outcome of one surface tool call, as the LLM (or a backend) gets it.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolReply {
    Result(serde_json::Value),
    /// The surface's error string, or the gateway's ("timeout", "surface disconnected").
    Error(String),
}

impl From<ToolReply> for CallOutcome {
    fn from(r: ToolReply) -> Self {
        match r {
            ToolReply::Result(v) => CallOutcome::Result(v),
            ToolReply::Error(e) => CallOutcome::Error(e),
        }
    }
}

impl From<CallOutcome> for ToolReply {
    fn from(o: CallOutcome) -> Self {
        match o {
            CallOutcome::Result(v) => ToolReply::Result(v),
            CallOutcome::Error(e) => ToolReply::Error(e),
        }
    }
}

/// A TOOL_CALL waiting for its TOOL_RESULT.
#[derive(Debug)]
struct PendingCall {
    session: Uuid,
    conn_id: u64,
    waiter: Waiter,
}

/// Who gets a call's outcome.
#[derive(Debug)]
enum Waiter {
    /// A turn or request of this process; `via` is the replica holding the surface, if remote.
    Local {
        tx: oneshot::Sender<ToolReply>,
        via: Option<Arc<str>>,
    },
    /// A turn on another replica: the outcome goes back over the bus. After `until` the other
    /// replica has given up; the entry is then swept.
    Relay {
        reply_to: String,
        until: std::time::Instant,
    },
}

#[derive(Debug, Clone)]
pub struct TurnDone {
    pub chunk_id: Uuid,
    /// Its tether seq, when it was tethered.
    pub seq: Option<u64>,
    pub role: String,
    pub content: Option<String>,
    pub model_used: Option<String>,
}

/// The surface attached to a session: its connection and how to reach it.
#[derive(Debug, Clone)]
pub struct Attachment {
    pub conn_id: u64,
    pub surface: Arc<SurfaceContext>,
    pub route: Route,
}

#[derive(Debug, Clone)]
pub enum Route {
    /// A connection of this process.
    Local {
        tx: mpsc::Sender<ConnMsg>,
        calls: Arc<CallQueue>,
    },
    /// A connection held by this replica of the bus.
    Remote(Arc<str>),
}

pub struct Hub {
    /// Connections of this process only.
    conns: Mutex<HashMap<Uuid, Attachment>>,
    /// In-flight tool calls by call_id.
    calls: Mutex<HashMap<Uuid, PendingCall>>,
    next_conn: AtomicU64,
    stripes: Vec<tokio::sync::Mutex<()>>,
    bus: Option<Arc<dyn Bus>>,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("attached", &self.attached_count())
            .finish_non_exhaustive()
    }
}

impl Hub {
    /// A hub whose relayed tool calls answer over `bus` (if any).
    pub fn new(bus: Option<Arc<dyn Bus>>) -> Self {
        // Connection ids start at a random point so that ids of different replicas (and of one
        // replica's successive runs) do not collide: a completed turn names the connection that
        // streamed it, and a bus message names the connection it is for.
        let start = (Uuid::new_v4().as_u128() as u64) >> 2;
        Self {
            conns: Mutex::new(HashMap::new()),
            calls: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(start.max(1)),
            stripes: (0..LOCK_STRIPES)
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
            bus,
        }
    }

    pub fn bus(&self) -> Option<&Arc<dyn Bus>> {
        self.bus.as_ref()
    }

    /// Hands `reply` to whoever waits for the call; false if nobody does any more.
    fn resolve(&self, call_id: Uuid, pending: PendingCall, reply: ToolReply) -> bool {
        match pending.waiter {
            Waiter::Local { tx, .. } => tx.send(reply).is_ok(),
            Waiter::Relay { reply_to, .. } => match &self.bus {
                Some(bus) => bus.send(
                    &reply_to,
                    BusMsg::ToolReply {
                        call_id,
                        outcome: reply.into(),
                    },
                ),
                None => false,
            },
        }
    }

    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Attachment>> {
        // A panic while holding this lock cannot leave the map half-updated (single insert/remove
        // calls), so a poisoned lock is still safe to use.
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn calls(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, PendingCall>> {
        // Same reasoning as `conns`: single insert/remove calls cannot leave it half-updated.
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a tool call about to be sent on `conn_id`. If that connection is no longer the
    /// session's (it closed or was displaced, possibly before its cancel sweep could see this
    /// call), the call fails at once with "surface disconnected".
    pub fn register_call(
        &self,
        session: Uuid,
        conn_id: u64,
        call_id: Uuid,
    ) -> oneshot::Receiver<ToolReply> {
        let rx = self.wait_for_reply(session, conn_id, call_id, None);
        if !self.is_current(session, conn_id) {
            self.finish_call(call_id, ToolReply::Error(DISCONNECTED.into()));
        }
        rx
    }

    /// Registers a tool call about to be sent over the bus to `conn_id` on `replica`. The other
    /// replica answers it (or reports its connection gone); if that replica dies, see
    /// [`Hub::fail_calls_via`].
    pub fn register_remote_call(
        &self,
        session: Uuid,
        conn_id: u64,
        call_id: Uuid,
        replica: Arc<str>,
    ) -> oneshot::Receiver<ToolReply> {
        self.wait_for_reply(session, conn_id, call_id, Some(replica))
    }

    /// A pending call answered here (`via`: the replica its surface is on, if not this one).
    fn wait_for_reply(
        &self,
        session: Uuid,
        conn_id: u64,
        call_id: Uuid,
        via: Option<Arc<str>>,
    ) -> oneshot::Receiver<ToolReply> {
        let (tx, rx) = oneshot::channel();
        self.calls().insert(
            call_id,
            PendingCall {
                session,
                conn_id,
                waiter: Waiter::Local { tx, via },
            },
        );
        rx
    }

    /// A call from a turn on `reply_to` for this process's connection `conn_id`: queued to the
    /// connection, its outcome sent back over the bus. False when the connection is gone (the
    /// "surface disconnected" answer is already on its way).
    pub fn relay_call(
        &self,
        session: Uuid,
        conn_id: u64,
        call: ToolCall,
        reply_to: String,
        until: std::time::Instant,
    ) -> bool {
        let Ok(call_id) = Uuid::parse_str(&call.call_id) else {
            return false;
        };
        self.calls().insert(
            call_id,
            PendingCall {
                session,
                conn_id,
                waiter: Waiter::Relay { reply_to, until },
            },
        );
        let pushed = match self.get(session) {
            Some(Attachment {
                conn_id: current,
                route: Route::Local { calls, .. },
                ..
            }) if current == conn_id => calls.push(Box::new(call)),
            _ => false,
        };
        if !pushed {
            self.finish_call(call_id, ToolReply::Error(DISCONNECTED.into()));
        }
        pushed
    }

    /// Calls waiting on surfaces of replicas for which `dead` says so fail with "surface
    /// disconnected". Returns how many.
    pub fn fail_calls_via(&self, dead: impl Fn(&str) -> bool) -> usize {
        self.end_calls(
            |p| matches!(&p.waiter, Waiter::Local { via: Some(r), .. } if dead(r)),
            DISCONNECTED,
        )
    }

    /// Relayed calls whose waiting replica has given up by `now` end with "timeout" (their
    /// surface never answered). Returns how many.
    pub fn expire_relays(&self, now: std::time::Instant) -> usize {
        self.end_calls(
            |p| matches!(&p.waiter, Waiter::Relay { until, .. } if *until <= now),
            TIMEOUT,
        )
    }

    /// Replicas that calls of this process are waiting on.
    pub fn remote_call_replicas(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .calls()
            .values()
            .filter_map(|p| match &p.waiter {
                Waiter::Local { via: Some(r), .. } => Some(r.to_string()),
                _ => None,
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Delivers a TOOL_RESULT that arrived on `conn_id`. False when no call with this id is
    /// waiting for that connection (late, unknown, or another session's).
    pub fn complete_call(
        &self,
        session: Uuid,
        conn_id: u64,
        call_id: &str,
        reply: ToolReply,
    ) -> bool {
        let Ok(id) = Uuid::parse_str(call_id) else {
            return false;
        };
        let pending = {
            let mut calls = self.calls();
            match calls.get(&id) {
                Some(p) if p.session == session && p.conn_id == conn_id => calls.remove(&id),
                _ => None,
            }
        };
        pending.is_some_and(|p| self.resolve(id, p, reply))
    }

    /// Ends a call with `reply` (timeout, the sender giving up, or the answer relayed from another
    /// replica); false if it already ended.
    pub fn finish_call(&self, call_id: Uuid, reply: ToolReply) -> bool {
        let pending = self.calls().remove(&call_id);
        pending.is_some_and(|p| self.resolve(call_id, p, reply))
    }

    /// Ends every pending call `matches` picks with the error result `error`; returns how many.
    fn end_calls(&self, matches: impl Fn(&PendingCall) -> bool, error: &str) -> usize {
        let ended: Vec<(Uuid, PendingCall)> = self.calls().extract_if(|_, p| matches(p)).collect();
        let n = ended.len();
        for (id, p) in ended {
            self.resolve(id, p, ToolReply::Error(error.into()));
        }
        n
    }

    /// The connection closed: every call in flight on it fails now with "surface disconnected".
    pub fn cancel_calls(&self, conn_id: u64) -> usize {
        self.end_calls(|p| p.conn_id == conn_id, DISCONNECTED)
    }

    /// The lock serialising attach/detach state changes of `session`.
    pub fn session_lock(&self, session: Uuid) -> &tokio::sync::Mutex<()> {
        let idx = (session.as_u128() % LOCK_STRIPES as u128) as usize;
        &self.stripes[idx]
    }

    /// Registers a connection for `session`, displacing (and notifying) the previous one.
    pub fn register(&self, session: Uuid, surface: Arc<SurfaceContext>) -> (u64, Inbox) {
        let conn_id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(CONN_INBOX);
        let calls = Arc::new(CallQueue::default());
        let att = Attachment {
            conn_id,
            surface,
            route: Route::Local {
                tx,
                calls: calls.clone(),
            },
        };
        let old = self.conns().insert(session, att);
        if let Some(old) = old {
            old.displace();
        }
        (conn_id, Inbox { msgs: rx, calls })
    }

    /// Removes the connection if it is still the session's current one.
    pub fn remove_if_current(&self, session: Uuid, conn_id: u64) -> bool {
        self.take_if_current(session, conn_id).is_some()
    }

    fn take_if_current(&self, session: Uuid, conn_id: u64) -> Option<Attachment> {
        let mut conns = self.conns();
        if conns.get(&session).is_some_and(|a| a.conn_id == conn_id) {
            conns.remove(&session)
        } else {
            None
        }
    }

    /// A surface on another replica took the session over: this process's connection `conn_id`,
    /// if still current, stops being the session's and is told to close. Its close then changes
    /// nothing (it is no longer current).
    pub fn displace(&self, session: Uuid, conn_id: u64) -> bool {
        match self.take_if_current(session, conn_id) {
            Some(att) => {
                att.displace();
                true
            }
            None => false,
        }
    }

    /// Replaces the stored SurfaceContext of the session's connection, if it is still `conn_id`.
    pub fn update_surface(&self, session: Uuid, conn_id: u64, surface: SurfaceContext) {
        if let Some(att) = self
            .conns()
            .get_mut(&session)
            .filter(|a| a.conn_id == conn_id)
        {
            att.surface = Arc::new(surface);
        }
    }

    pub fn is_current(&self, session: Uuid, conn_id: u64) -> bool {
        self.conns()
            .get(&session)
            .is_some_and(|a| a.conn_id == conn_id)
    }

    pub fn get(&self, session: Uuid) -> Option<Attachment> {
        self.conns().get(&session).cloned()
    }

    /// (session, connection) of every connection attached in this process.
    pub fn local_attachments(&self) -> Vec<(Uuid, u64)> {
        self.conns().iter().map(|(s, a)| (*s, a.conn_id)).collect()
    }

    pub fn attached_count(&self) -> usize {
        self.conns().len()
    }

    /// Best-effort notification of the session's current connection in this process.
    pub fn notify(&self, session: Uuid, msg: ConnMsg) {
        if let Some(Attachment {
            route: Route::Local { tx, .. },
            ..
        }) = self.get(session)
        {
            let _ = tx.try_send(msg);
        }
    }

    /// A live chunk from another replica for this process's connection `conn_id`, if it is still
    /// the session's. One dropped here (full inbox) shows as a gap in the offsets downstream.
    pub fn chunk_for(&self, session: Uuid, conn_id: u64, msg: ConnMsg) {
        if let Some(Attachment {
            conn_id: current,
            route: Route::Local { tx, .. },
            ..
        }) = self.get(session)
            && current == conn_id
        {
            let _ = tx.try_send(msg);
        }
    }
}

impl Attachment {
    /// Tells the (local) connection it was displaced. If its inbox is full it still notices: it is
    /// gone from the map, and it checks `is_current` when it drains.
    fn displace(&self) {
        if let Route::Local { tx, .. } = &self.route {
            let _ = tx.try_send(ConnMsg::Displaced);
        }
    }
}

/// Streams one turn's deltas live to the connection attached when the turn started. If that
/// connection goes away, is displaced or falls behind, live streaming of this turn stops for good
/// (the turn is then delivered whole, from storage).
pub struct LiveSink<'a> {
    hub: &'a Hub,
    session: Uuid,
    pub chunk_id: Uuid,
    target: Option<Attachment>,
    /// The upstream round streaming now, and the bytes of its text sent so far.
    round: u32,
    offset: u64,
}

impl<'a> LiveSink<'a> {
    /// A sink streaming to `target`, the session's surface when the turn starts (here or on
    /// another replica).
    pub fn new(hub: &'a Hub, session: Uuid, target: Option<Attachment>) -> Self {
        Self {
            hub,
            session,
            chunk_id: Uuid::now_v7(),
            target,
            round: 0,
            offset: 0,
        }
    }

    /// The agent loop asks the model again: its text starts over (the stored reply is the last
    /// round's text).
    pub fn new_round(&mut self) {
        self.round += 1;
        self.offset = 0;
    }

    pub fn is_live(&self) -> bool {
        self.target.is_some()
    }

    pub fn chunk(&mut self, delta: &str) {
        let Some(target) = &self.target else { return };
        let sent = match &target.route {
            Route::Local { tx, .. } => {
                self.hub.is_current(self.session, target.conn_id)
                    && tx
                        .try_send(ConnMsg::Chunk(Box::new(LiveChunk {
                            chunk_id: self.chunk_id,
                            delta: delta.to_owned(),
                            round: self.round,
                            offset: self.offset,
                        })))
                        .is_ok()
            }
            // The holder's replica drops it if the connection is no longer current; the turn
            // then reaches the surface whole, as for a local connection that went away.
            Route::Remote(replica) => self.hub.bus.as_ref().is_some_and(|bus| {
                bus.send(
                    replica,
                    BusMsg::Chunk {
                        session: self.session,
                        conn: target.conn_id,
                        chunk_id: self.chunk_id,
                        delta: delta.to_owned(),
                        round: self.round,
                        offset: self.offset,
                    },
                )
            }),
        };
        if sent {
            self.offset += delta.len() as u64;
        } else {
            self.target = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ConnMsg;

    /// Every idle connection pays for its inbox's first block of 32 slots: each byte a message
    /// grows costs 10,000 idle surfaces ~0.3 MiB (BENCHMARKS.md, "Idle surfaces after issues 5
    /// and 6"). Box a new bulky variant instead of widening this.
    #[test]
    fn inbox_messages_stay_small() {
        assert!(std::mem::size_of::<ConnMsg>() <= 16);
    }
}
