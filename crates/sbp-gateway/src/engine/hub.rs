//! Which surface is attached to which session, in this process, and the channel that reaches it.
//! One surface per session: registering a new one displaces the old. Attach/detach status changes of
//! one session are serialised by a striped async lock so a displaced socket's close cannot suspend a
//! session a new surface has just attached to.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

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

/// A message from the engine to one attached connection.
#[derive(Debug, Clone)]
pub enum ConnMsg {
    /// A live streaming delta of the turn `chunk_id`.
    Chunk { chunk_id: Uuid, delta: String },
    /// A turn was completed and persisted (boxed: inbox slots stay small, which matters for
    /// thousands of idle connections).
    TurnDone(Box<TurnDone>),
    /// Another surface attached to the session; this connection must close.
    Displaced,
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

/// A TOOL_CALL waiting for its TOOL_RESULT.
#[derive(Debug)]
struct PendingCall {
    session: Uuid,
    conn_id: u64,
    tx: oneshot::Sender<ToolReply>,
}

#[derive(Debug, Clone)]
pub struct TurnDone {
    pub chunk_id: Uuid,
    /// Its tether seq, when it was tethered.
    pub seq: Option<u64>,
    /// The connection that received every chunk of it live, if any.
    pub streamed_to: Option<u64>,
    pub role: String,
    pub content: Option<String>,
    pub model_used: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Attachment {
    pub conn_id: u64,
    pub tx: mpsc::Sender<ConnMsg>,
    pub calls: Arc<CallQueue>,
    pub surface: Arc<SurfaceContext>,
}

#[derive(Debug)]
pub struct Hub {
    conns: Mutex<HashMap<Uuid, Attachment>>,
    /// In-flight tool calls by call_id.
    calls: Mutex<HashMap<Uuid, PendingCall>>,
    next_conn: AtomicU64,
    stripes: Vec<tokio::sync::Mutex<()>>,
}

impl Default for Hub {
    fn default() -> Self {
        Self {
            conns: Mutex::new(HashMap::new()),
            calls: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            stripes: (0..LOCK_STRIPES)
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
        }
    }
}

impl Hub {
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
        let (tx, rx) = oneshot::channel();
        self.calls().insert(
            call_id,
            PendingCall {
                session,
                conn_id,
                tx,
            },
        );
        if !self.is_current(session, conn_id) {
            self.finish_call(call_id, ToolReply::Error(DISCONNECTED.into()));
        }
        rx
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
        pending.is_some_and(|p| p.tx.send(reply).is_ok())
    }

    /// Ends a call with `reply` (timeout, or the sender giving up); false if it already ended.
    pub fn finish_call(&self, call_id: Uuid, reply: ToolReply) -> bool {
        let pending = self.calls().remove(&call_id);
        pending.is_some_and(|p| p.tx.send(reply).is_ok())
    }

    /// The connection closed: every call in flight on it fails now with "surface disconnected".
    pub fn cancel_calls(&self, conn_id: u64) -> usize {
        let cancelled: Vec<PendingCall> = {
            let mut calls = self.calls();
            let ids: Vec<Uuid> = calls
                .iter()
                .filter(|(_, p)| p.conn_id == conn_id)
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| calls.remove(id)).collect()
        };
        let n = cancelled.len();
        for p in cancelled {
            let _ = p.tx.send(ToolReply::Error(DISCONNECTED.into()));
        }
        n
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
            tx,
            calls: calls.clone(),
            surface,
        };
        let old = self.conns().insert(session, att);
        if let Some(old) = old {
            // If its inbox is full the old connection still notices: its sender is gone from the
            // map, and it checks `is_current` when it drains.
            let _ = old.tx.try_send(ConnMsg::Displaced);
        }
        (conn_id, Inbox { msgs: rx, calls })
    }

    /// Removes the connection if it is still the session's current one.
    pub fn remove_if_current(&self, session: Uuid, conn_id: u64) -> bool {
        let mut conns = self.conns();
        if conns.get(&session).is_some_and(|a| a.conn_id == conn_id) {
            conns.remove(&session);
            true
        } else {
            false
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

    pub fn attached_count(&self) -> usize {
        self.conns().len()
    }

    /// Best-effort notification of the session's current connection.
    pub fn notify(&self, session: Uuid, msg: ConnMsg) {
        if let Some(att) = self.get(session) {
            let _ = att.tx.try_send(msg);
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
    sent_any: bool,
}

impl<'a> LiveSink<'a> {
    pub fn new(hub: &'a Hub, session: Uuid) -> Self {
        Self {
            hub,
            session,
            chunk_id: Uuid::now_v7(),
            target: hub.get(session),
            sent_any: false,
        }
    }

    pub fn is_live(&self) -> bool {
        self.target.is_some()
    }

    pub fn chunk(&mut self, delta: &str) {
        let Some(target) = &self.target else { return };
        if !self.hub.is_current(self.session, target.conn_id) {
            self.target = None;
            return;
        }
        let msg = ConnMsg::Chunk {
            chunk_id: self.chunk_id,
            delta: delta.to_owned(),
        };
        if target.tx.try_send(msg).is_err() {
            self.target = None;
            return;
        }
        self.sent_any = true;
    }

    /// The connection that got every chunk, if streaming stayed intact.
    pub fn streamed_to(&self) -> Option<u64> {
        self.target
            .as_ref()
            .filter(|_| self.sent_any)
            .map(|t| t.conn_id)
    }
}
