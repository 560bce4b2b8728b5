//! Tool calls waiting for their TOOL_RESULT, by call id: who waits (a turn or request of this
//! process), which connection the call went to, and which replica holds that connection when it is
//! not this one. Every entry ends with an outcome: the surface's, a timeout, or
//! [`ToolFailure::Disconnected`] when the connection (or its replica) goes away.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sbp_protocol::{ToolFailure, ToolOutcome};
use tokio::sync::oneshot;
use uuid::Uuid;

/// A TOOL_CALL waiting for its TOOL_RESULT.
#[derive(Debug)]
struct Pending {
    session: Uuid,
    conn_id: u64,
    waiter: oneshot::Sender<ToolOutcome>,
    /// The replica holding the connection, when it is not this process.
    via: Option<Arc<str>>,
}

#[derive(Debug, Default)]
pub struct PendingCalls {
    calls: Mutex<HashMap<Uuid, Pending>>,
}

impl PendingCalls {
    fn calls(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Pending>> {
        // Single insert/remove calls cannot leave the map half-updated, so a poisoned lock is
        // still safe to use.
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers call `call_id` to connection `conn_id` (on replica `via`, if not here); its
    /// outcome arrives on the returned receiver.
    pub fn register(
        &self,
        session: Uuid,
        conn_id: u64,
        call_id: Uuid,
        via: Option<Arc<str>>,
    ) -> oneshot::Receiver<ToolOutcome> {
        let (tx, rx) = oneshot::channel();
        self.calls().insert(
            call_id,
            Pending {
                session,
                conn_id,
                waiter: tx,
                via,
            },
        );
        rx
    }

    /// A TOOL_RESULT arrived on `conn_id`. False when no call with this id is waiting for that
    /// connection (late, unknown, or another session's).
    pub fn complete(
        &self,
        session: Uuid,
        conn_id: u64,
        call_id: &str,
        outcome: ToolOutcome,
    ) -> bool {
        let Some(id) = sbp_protocol::id::parse_canonical(call_id) else {
            return false;
        };
        let pending = {
            let mut calls = self.calls();
            match calls.get(&id) {
                Some(p) if p.session == session && p.conn_id == conn_id => calls.remove(&id),
                _ => None,
            }
        };
        pending.is_some_and(|p| p.waiter.send(outcome).is_ok())
    }

    /// Ends a call with `outcome` (its deadline passed, its waiter gave up, or the answer came
    /// from another replica); false if it already ended.
    pub fn finish(&self, call_id: Uuid, outcome: ToolOutcome) -> bool {
        let pending = self.calls().remove(&call_id);
        pending.is_some_and(|p| p.waiter.send(outcome).is_ok())
    }

    /// Waits for call `call_id`'s outcome on `rx` until `deadline`; past it the call ends as a
    /// timeout, unless its result raced the deadline and won.
    pub async fn wait(
        &self,
        call_id: Uuid,
        rx: &mut oneshot::Receiver<ToolOutcome>,
        deadline: tokio::time::Instant,
    ) -> ToolOutcome {
        match tokio::time::timeout_at(deadline, &mut *rx).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => Err(ToolFailure::Disconnected),
            Err(_) => {
                self.finish(call_id, Err(ToolFailure::Timeout));
                rx.try_recv().unwrap_or(Err(ToolFailure::Timeout))
            }
        }
    }

    /// The connection closed: every call in flight on it fails now. Returns how many.
    pub fn cancel_conn(&self, conn_id: u64) -> usize {
        self.fail(|p| p.conn_id == conn_id)
    }

    /// Calls waiting on surfaces of replicas `dead` names fail. Returns how many.
    pub fn fail_via(&self, dead: impl Fn(&str) -> bool) -> usize {
        self.fail(|p| p.via.as_deref().is_some_and(&dead))
    }

    /// Replicas that calls of this process are waiting on.
    pub fn replicas_waited_on(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .calls()
            .values()
            .filter_map(|p| p.via.as_deref().map(str::to_owned))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Ends every call `matches` picks with [`ToolFailure::Disconnected`].
    fn fail(&self, matches: impl Fn(&Pending) -> bool) -> usize {
        let ended: Vec<Pending> = self
            .calls()
            .extract_if(|_, p| matches(p))
            .map(|(_, p)| p)
            .collect();
        let n = ended.len();
        for p in ended {
            let _ = p.waiter.send(Err(ToolFailure::Disconnected));
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_result_ends_only_its_own_connections_call() {
        let calls = PendingCalls::default();
        let (session, call) = (Uuid::now_v7(), Uuid::new_v4());
        let mut rx = calls.register(session, 1, call, None);
        assert!(!calls.complete(session, 2, &call.to_string(), Ok(json!(1))));
        assert!(!calls.complete(Uuid::now_v7(), 1, &call.to_string(), Ok(json!(1))));
        assert!(!calls.complete(session, 1, "not-a-uuid", Ok(json!(1))));
        assert!(calls.complete(session, 1, &call.to_string(), Ok(json!(2))));
        assert_eq!(rx.try_recv().ok(), Some(Ok(json!(2))));
        assert!(
            !calls.finish(call, Err(ToolFailure::Timeout)),
            "already ended"
        );
    }

    #[test]
    fn a_closed_connection_or_dead_replica_fails_its_calls() {
        let calls = PendingCalls::default();
        let s = Uuid::now_v7();
        let mut here = calls.register(s, 1, Uuid::new_v4(), None);
        let mut there = calls.register(s, 2, Uuid::new_v4(), Some(Arc::from("b")));
        let mut other = calls.register(s, 3, Uuid::new_v4(), Some(Arc::from("c")));
        assert_eq!(calls.replicas_waited_on(), vec!["b", "c"]);
        assert_eq!(calls.fail_via(|r| r == "b"), 1);
        assert_eq!(there.try_recv().ok(), Some(Err(ToolFailure::Disconnected)));
        assert_eq!(calls.cancel_conn(1), 1);
        assert_eq!(here.try_recv().ok(), Some(Err(ToolFailure::Disconnected)));
        assert!(other.try_recv().is_err(), "still waiting");
        assert_eq!(calls.replicas_waited_on(), vec!["c"]);
    }
}
