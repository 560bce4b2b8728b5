//! Which connection of this process holds which session, and the inbox that reaches it. One
//! surface per session: registering a new connection displaces the old one. Attach/detach status
//! changes of one session are serialised by a striped async lock, so a displaced socket's close
//! cannot suspend a session a new surface has just attached to (with replicas, the bus's lock is
//! taken too: `replicas.rs`). Each inbox has an outbound byte budget ([`Backlog`]): a surface that
//! stops reading is dropped instead of growing its queue.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use sbp_bus::{LiveChunk, TurnDone};
use sbp_protocol::SurfaceContext;
use sbp_protocol::frames::ToolCall;
use tokio::sync::{Notify, mpsc};
use uuid::Uuid;

/// Capacity of a connection's inbox. A producer that finds it full stops streaming live to that
/// connection; the turn is still persisted (and tethered) and reaches the surface from storage.
pub const CONN_INBOX: usize = 1024;
const LOCK_STRIPES: usize = 64;

/// What a queued message is counted as besides its text (ids, JSON keys of its frame).
const MSG_OVERHEAD: usize = 128;

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
    /// The session was deleted; this connection must close.
    Deleted,
}

impl ConnMsg {
    /// The bytes this message holds until its frames are written, as the [`Backlog`] counts them.
    pub fn weight(&self) -> usize {
        match self {
            ConnMsg::Chunk(c) => c.delta.len() + MSG_OVERHEAD,
            ConnMsg::TurnDone(d) => d.content.as_ref().map_or(0, String::len) + MSG_OVERHEAD,
            ConnMsg::Displaced | ConnMsg::Deleted => 0,
        }
    }
}

/// What [`Connections::send`] did with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// In the connection's inbox.
    Queued,
    /// Not queued: the inbox is full. The connection is alive and catches up from the tether.
    Behind,
    /// Not queued: no such connection here, or it is being dropped as a slow consumer.
    Gone,
}

/// What a connection receives from the engine: turn traffic, and TOOL_CALLs on their own queue so
/// a call never waits behind a backlog of chunks or a CTP rewrite.
#[derive(Debug)]
pub struct Inbox {
    pub msgs: mpsc::Receiver<ConnMsg>,
    pub calls: Arc<CallQueue>,
    /// The bytes queued in `msgs` and not yet written; the connection reports what it wrote.
    pub backlog: Arc<Backlog>,
}

/// The outbound byte budget of one connection: bytes of turn traffic queued for it and not yet
/// written to its socket. A message that would take it over the budget is refused and the
/// connection is marked overflowed; the connection then drops itself as a slow consumer (its
/// turns stay in the tether). One message larger than the whole budget is still accepted into an
/// empty backlog, so a single big turn never drops a surface that keeps up.
#[derive(Debug)]
pub struct Backlog {
    queued: AtomicUsize,
    budget: usize,
    overflowed: AtomicBool,
    wake: Notify,
}

impl Backlog {
    fn new(budget: usize) -> Self {
        Self {
            queued: AtomicUsize::new(0),
            budget,
            overflowed: AtomicBool::new(false),
            wake: Notify::new(),
        }
    }

    /// Counts `bytes` about to be queued; false (and overflowed from now on) when they do not fit.
    fn admit(&self, bytes: usize) -> bool {
        if self.is_overflowed() {
            return false;
        }
        let admitted = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q == 0 || q.saturating_add(bytes) <= self.budget).then(|| q.saturating_add(bytes))
            })
            .is_ok();
        if !admitted {
            self.overflowed.store(true, Ordering::Release);
            self.wake.notify_one();
        }
        admitted
    }

    /// Bytes admitted earlier that are no longer queued (written, or not deliverable).
    pub fn release(&self, bytes: usize) {
        let _ = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                Some(q.saturating_sub(bytes))
            });
    }

    /// Bytes queued and not yet written.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    pub fn is_overflowed(&self) -> bool {
        self.overflowed.load(Ordering::Acquire)
    }

    /// Resolves once the backlog went over its budget.
    pub async fn overflowed(&self) {
        // `notify_one` keeps a permit when nobody waits, so a flag set between the check and
        // the wait still wakes this.
        while !self.is_overflowed() {
            self.wake.notified().await;
        }
    }
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
        backlog: Arc<Backlog>,
    },
    /// A connection held by this replica of the bus.
    Remote(Arc<str>),
}

impl Attachment {
    /// The replica holding the connection, when it is not this process.
    pub fn replica(&self) -> Option<Arc<str>> {
        match &self.route {
            Route::Local { .. } => None,
            Route::Remote(replica) => Some(replica.clone()),
        }
    }

    /// Tells the (local) connection it must close (`Displaced` or `Deleted`). If its inbox is full
    /// it still notices: it is gone from the map, and it checks `is_current` when it drains.
    fn close(&self, why: ConnMsg) {
        if let Route::Local { tx, .. } = &self.route {
            let _ = tx.try_send(why);
        }
    }
}

pub struct Connections {
    conns: Mutex<HashMap<Uuid, Attachment>>,
    next_conn: AtomicU64,
    stripes: Vec<tokio::sync::Mutex<()>>,
    /// Each connection's outbound byte budget ([`Backlog`]).
    outbound_budget: usize,
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connections")
            .field("attached", &self.count())
            .finish_non_exhaustive()
    }
}

impl Connections {
    /// An empty map whose connections each get `outbound_budget` bytes of queued turn traffic.
    pub fn new(outbound_budget: usize) -> Self {
        // Connection ids start at a random point so that ids of different replicas (and of one
        // replica's successive runs) do not collide: a completed turn names the connection that
        // streamed it, and a bus message names the connection it is for.
        let start = (Uuid::new_v4().as_u128() as u64) >> 2;
        Self {
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(start.max(1)),
            stripes: (0..LOCK_STRIPES)
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
            outbound_budget,
        }
    }

    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Attachment>> {
        // A panic while holding this lock cannot leave the map half-updated (single insert/remove
        // calls), so a poisoned lock is still safe to use.
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
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
        let backlog = Arc::new(Backlog::new(self.outbound_budget));
        let att = Attachment {
            conn_id,
            surface,
            route: Route::Local {
                tx,
                calls: calls.clone(),
                backlog: backlog.clone(),
            },
        };
        let old = self.conns().insert(session, att);
        if let Some(old) = old {
            old.close(ConnMsg::Displaced);
        }
        (
            conn_id,
            Inbox {
                msgs: rx,
                calls,
                backlog,
            },
        )
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

    /// A surface elsewhere took the session over: connection `conn_id`, if still current, stops
    /// being the session's and is told to close. Its close then changes nothing (it is no longer
    /// current).
    pub fn displace(&self, session: Uuid, conn_id: u64) -> bool {
        self.end(session, conn_id, ConnMsg::Displaced)
    }

    /// The session was deleted: connection `conn_id`, if still current, stops being the
    /// session's and is told to close.
    pub fn deleted(&self, session: Uuid, conn_id: u64) -> bool {
        self.end(session, conn_id, ConnMsg::Deleted)
    }

    fn end(&self, session: Uuid, conn_id: u64, why: ConnMsg) -> bool {
        match self.take_if_current(session, conn_id) {
            Some(att) => {
                att.close(why);
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
    pub fn all(&self) -> Vec<(Uuid, u64)> {
        self.conns().iter().map(|(s, a)| (*s, a.conn_id)).collect()
    }

    pub fn count(&self) -> usize {
        self.conns().len()
    }

    /// Runs `f` with the inbox and call queue of the session's connection in this process, if
    /// it is `conn` (any, with `None`); without cloning the attachment, under the map's lock
    /// (`f` must not block: `try_send`, a queue push).
    fn with_local<T>(
        &self,
        session: Uuid,
        conn: Option<u64>,
        f: impl FnOnce(&mpsc::Sender<ConnMsg>, &CallQueue, &Backlog) -> T,
    ) -> Option<T> {
        match self.conns().get(&session) {
            Some(Attachment {
                conn_id,
                route: Route::Local { tx, calls, backlog },
                ..
            }) if conn.is_none_or(|c| c == *conn_id) => Some(f(tx, calls, backlog)),
            _ => None,
        }
    }

    /// Best-effort delivery to the session's connection in this process; with `conn`, only if it
    /// is still that connection. A message that would take the connection over its outbound
    /// budget is refused and the connection is dropped as a slow consumer.
    pub fn send(&self, session: Uuid, conn: Option<u64>, msg: ConnMsg) -> Sent {
        self.with_local(session, conn, |tx, _, backlog| {
            let weight = msg.weight();
            if !backlog.admit(weight) {
                return Sent::Gone;
            }
            match tx.try_send(msg) {
                Ok(()) => Sent::Queued,
                Err(_) => {
                    backlog.release(weight);
                    Sent::Behind
                }
            }
        })
        .unwrap_or(Sent::Gone)
    }

    /// Queues a TOOL_CALL on the session's connection `conn_id` in this process; false when that
    /// connection is gone.
    pub fn push_call(&self, session: Uuid, conn_id: u64, call: ToolCall) -> bool {
        self.with_local(session, Some(conn_id), |_, calls, _| {
            calls.push(Box::new(call))
        })
        .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::{Backlog, ConnMsg};

    #[test]
    fn backlog_admits_up_to_its_budget_then_overflows_for_good() {
        let b = Backlog::new(1000);
        assert!(b.admit(600));
        assert!(b.admit(400));
        assert!(!b.is_overflowed());
        b.release(400);
        assert_eq!(b.queued(), 600);
        assert!(!b.admit(401));
        assert!(b.is_overflowed());
        // Once over, nothing more is queued, even what would fit again.
        b.release(600);
        assert!(!b.admit(1));
    }

    #[test]
    fn one_message_larger_than_the_budget_still_goes_to_an_empty_backlog() {
        let b = Backlog::new(1000);
        assert!(b.admit(5000));
        assert!(!b.admit(1));
        assert!(b.is_overflowed());
    }

    #[tokio::test]
    async fn overflow_wakes_the_connection_waiting_for_it() {
        let b = std::sync::Arc::new(Backlog::new(10));
        let waiter = tokio::spawn({
            let b = b.clone();
            async move { b.overflowed().await }
        });
        assert!(b.admit(10));
        assert!(!b.admit(10));
        tokio::time::timeout(std::time::Duration::from_secs(10), waiter)
            .await
            .expect("woken")
            .expect("task");
    }

    /// Every idle connection pays for its inbox's first block of 32 slots: each byte a message
    /// grows costs 10,000 idle surfaces ~0.3 MiB (BENCHMARKS.md, "Idle surfaces after issues 5
    /// and 6"). Box a new bulky variant instead of widening this.
    #[test]
    fn inbox_messages_stay_small() {
        assert!(std::mem::size_of::<ConnMsg>() <= 16);
    }
}
