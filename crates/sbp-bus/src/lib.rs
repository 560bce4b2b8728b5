//! The bus between gateway replicas that share one database (`sbp serve --bus redis://...`).
//!
//! Replicas behind one address each hold some surfaces' WebSockets; a turn, an HTTP tool call or a
//! pushed turn may run on any of them. The bus answers "which replica holds this session's surface"
//! (the registry), carries the messages that must reach that replica (live chunks, completed-turn
//! notices, TOOL_CALLs, displacement) and the TOOL_RESULTs back to the replica whose turn waits,
//! and serialises attach/detach of one session across replicas (a lock).
//!
//! What the bus carries is never the only copy of anything acknowledged: turns are committed to the
//! database (and its tether) before any notice goes out, so a lost message costs latency (the
//! surface's catch-up reads storage) or a tool call's timeout, never data. Messages from one replica
//! to another arrive in the order they were sent.
//!
//! [`Bus`] is what the engine sees; [`RedisBus`] implements it on Redis pub/sub and keys. Without a
//! bus, one process serves everything through in-process channels.

mod redis_bus;

pub use redis_bus::{RedisBus, RedisBusOptions};

use async_trait::async_trait;
use sbp_protocol::frames::ToolCall;
use sbp_protocol::{SurfaceContext, ToolFailure, ToolOutcome};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use uuid::Uuid;

/// A message from one replica to another. Its JSON stays readable by replicas of earlier
/// versions (a rolling upgrade runs both): fields are added, never moved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BusMsg {
    /// A live delta for connection `conn` (dropped if it is no longer current).
    Chunk {
        session: Uuid,
        conn: u64,
        #[serde(flatten)]
        chunk: LiveChunk,
    },
    /// A turn of `session` was completed and committed; for its current connection.
    TurnDone { session: Uuid, done: TurnDone },
    /// Send `call` to connection `conn` and route its TOOL_RESULT to `reply_to`.
    ToolCall {
        session: Uuid,
        conn: u64,
        reply_to: String,
        call: ToolCall,
    },
    /// The outcome of a call relayed by [`BusMsg::ToolCall`].
    ToolReply {
        call_id: Uuid,
        #[serde(flatten)]
        outcome: RelayedOutcome,
    },
    /// Another replica's surface took `session` over: connection `conn` must close.
    Displace { session: Uuid, conn: u64 },
    /// `session` was deleted: connection `conn` must close (as for a session not found). A
    /// replica of an earlier version does not read it (it logs it and goes on): its surface
    /// stays open on a session whose every request then answers 404.
    Deleted { session: Uuid, conn: u64 },
}

/// A live streaming delta of the turn `chunk_id`, starting `offset` bytes into the text of the
/// turn's upstream round `round`, so the receiver can tell a missed delta. The same notice
/// reaches a connection from a turn in its own process or, over the bus, from another replica.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LiveChunk {
    pub chunk_id: Uuid,
    pub delta: String,
    pub round: u32,
    pub offset: u64,
    /// The session's step this turn is, and the model writing it, for the TURN_CHUNK frame
    /// (absent from earlier versions' messages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// A completed (committed) turn as the connection holding the session needs it, wherever the
/// turn ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnDone {
    pub chunk_id: Uuid,
    /// Its tether seq, when it was tethered.
    pub seq: Option<u64>,
    pub role: String,
    pub content: Option<String>,
    pub model_used: Option<String>,
    /// The session's step count after the turn, and the turn's cost, for the TURN_COMPLETE
    /// frame (absent from earlier versions' messages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
}

/// A relayed call's outcome as replicas exchange it: `"outcome": {"result": …}` or
/// `{"error": "<text>"}`, as every version reads it, and beside it `"failure"`, how the call
/// failed. A message without `failure` (from an earlier version) is read by its text.
#[derive(Debug, Clone, PartialEq)]
pub struct RelayedOutcome(pub ToolOutcome);

#[derive(Serialize, Deserialize)]
struct RelayedWire {
    outcome: OutcomeWire,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    failure: Option<ToolFailure>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum OutcomeWire {
    Result(Value),
    Error(String),
}

impl Serialize for RelayedOutcome {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let wire = match &self.0 {
            Ok(v) => RelayedWire {
                outcome: OutcomeWire::Result(v.clone()),
                failure: None,
            },
            Err(f) => RelayedWire {
                outcome: OutcomeWire::Error(f.message().to_owned()),
                failure: Some(f.clone()),
            },
        };
        wire.serialize(s)
    }
}

impl<'de> Deserialize<'de> for RelayedOutcome {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let wire = RelayedWire::deserialize(d)?;
        Ok(Self(match (wire.outcome, wire.failure) {
            (OutcomeWire::Result(v), _) => Ok(v),
            (OutcomeWire::Error(_), Some(failure)) => Err(failure),
            // An earlier version sent only the text.
            (OutcomeWire::Error(text), None) => Err(ToolFailure::from_message(text)),
        }))
    }
}

/// The replica and connection holding a session's surface, and the surface as it declared itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Holder {
    pub replica: String,
    pub conn: u64,
    pub surface: SurfaceContext,
}

/// A held per-session lock; give it back with [`Bus::unlock`].
#[derive(Debug)]
pub struct SessionLock {
    session: Uuid,
    token: String,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BusError {
    #[error("the replica bus is unavailable: {0}")]
    Unavailable(String),
    #[error("{0}")]
    Config(String),
}

/// The replicas' shared view and messaging, as the engine uses it.
#[async_trait]
pub trait Bus: Send + Sync {
    /// This replica's id.
    fn replica(&self) -> &str;
    /// Queues `msg` for `replica`, in order after everything queued before; false when it cannot be
    /// queued (the outgoing queue is full), and then it is dropped.
    fn send(&self, replica: &str, msg: BusMsg) -> bool;
    /// Records that `conn` on this replica now holds the session's surface; returns the previous
    /// holder (whose connection the caller displaces), if it is alive.
    async fn claim(
        &self,
        session: Uuid,
        conn: u64,
        surface: &SurfaceContext,
    ) -> Result<Option<Holder>, BusError>;
    /// Forgets the session's holder if it is still `conn` on this replica; false when someone else
    /// holds it now.
    async fn release(&self, session: Uuid, conn: u64) -> Result<bool, BusError>;
    /// Replaces the stored surface if `conn` on this replica still holds the session.
    async fn update(
        &self,
        session: Uuid,
        conn: u64,
        surface: &SurfaceContext,
    ) -> Result<bool, BusError>;
    /// The session's holder, if any and if its replica is alive.
    async fn holder(&self, session: Uuid) -> Result<Option<Holder>, BusError>;
    /// The registered holder of each session as (replica, conn), alive or not: what a replica
    /// compares its own connections with.
    async fn holders(&self, sessions: &[Uuid]) -> Result<Vec<Option<(String, u64)>>, BusError>;
    /// Registers `conn` on this replica as the holder only if the session has none (the registry
    /// lost it); false when another holder is registered.
    async fn reclaim(
        &self,
        session: Uuid,
        conn: u64,
        surface: &SurfaceContext,
    ) -> Result<bool, BusError>;
    /// Takes the session's cross-replica lock (attach and detach status changes), waiting for it.
    async fn lock(&self, session: Uuid) -> Result<SessionLock, BusError>;
    async fn unlock(&self, lock: SessionLock);
    /// Which of `replicas` are alive now.
    async fn alive(&self, replicas: &[String]) -> Result<Vec<bool>, BusError>;
}

/// Whether `id` can name a replica: 1-64 characters of `[A-Za-z0-9._-]`.
pub fn valid_replica_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn messages_round_trip() {
        let msgs = [
            BusMsg::Chunk {
                session: Uuid::now_v7(),
                conn: 7,
                chunk: LiveChunk {
                    chunk_id: Uuid::now_v7(),
                    delta: "héllo".into(),
                    round: 2,
                    offset: 17,
                    step: Some(4),
                    model: Some("m".into()),
                },
            },
            BusMsg::ToolReply {
                call_id: Uuid::new_v4(),
                outcome: RelayedOutcome(Ok(json!({"lat": 1.5}))),
            },
            BusMsg::ToolReply {
                call_id: Uuid::new_v4(),
                outcome: RelayedOutcome(Err(ToolFailure::Timeout)),
            },
            BusMsg::ToolReply {
                call_id: Uuid::new_v4(),
                outcome: RelayedOutcome(Err(ToolFailure::Surface("timeout".into()))),
            },
            BusMsg::Deleted {
                session: Uuid::now_v7(),
                conn: 9,
            },
            BusMsg::ToolCall {
                session: Uuid::now_v7(),
                conn: u64::MAX,
                reply_to: "b".into(),
                call: ToolCall {
                    call_id: Uuid::new_v4().to_string(),
                    tool_name: "gps".into(),
                    tool_input: json!({}),
                    timeout_ms: Some(5000),
                },
            },
        ];
        for m in msgs {
            let text = serde_json::to_string(&m).expect("serialises");
            let back: BusMsg = serde_json::from_str(&text).expect("parses");
            assert_eq!(back, m);
        }
    }

    /// Replicas of the version before typed outcomes wrote and read these shapes.
    #[test]
    fn earlier_versions_messages_are_read_and_ours_are_readable_by_them() {
        let (session, chunk_id, call_id) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::new_v4());
        let chunk = json!({"kind": "chunk", "session": session, "conn": 7, "chunk_id": chunk_id,
                           "delta": "hé", "round": 2, "offset": 17});
        let msg = BusMsg::Chunk {
            session,
            conn: 7,
            chunk: LiveChunk {
                chunk_id,
                delta: "hé".into(),
                round: 2,
                offset: 17,
                step: None,
                model: None,
            },
        };
        assert_eq!(serde_json::to_value(&msg).expect("serialises"), chunk);
        assert_eq!(
            serde_json::from_value::<BusMsg>(chunk).expect("parses"),
            msg
        );
        for (text, failure) in [
            ("timeout", ToolFailure::Timeout),
            ("surface disconnected", ToolFailure::Disconnected),
            ("denied", ToolFailure::Surface("denied".into())),
        ] {
            let old = json!({"kind": "tool_reply", "call_id": call_id, "outcome": {"error": text}});
            let read: BusMsg = serde_json::from_value(old).expect("parses");
            assert_eq!(
                read,
                BusMsg::ToolReply {
                    call_id,
                    outcome: RelayedOutcome(Err(failure.clone()))
                }
            );
            let ours = serde_json::to_value(read).expect("serialises");
            assert_eq!(
                ours["outcome"],
                json!({"error": text}),
                "what earlier versions read"
            );
        }
        let ok = BusMsg::ToolReply {
            call_id,
            outcome: RelayedOutcome(Ok(json!([1]))),
        };
        assert_eq!(
            serde_json::to_value(ok).expect("serialises"),
            json!({"kind": "tool_reply", "call_id": call_id, "outcome": {"result": [1]}})
        );
    }

    #[test]
    fn replica_ids() {
        assert!(valid_replica_id("gw-1.eu_west"));
        assert!(!valid_replica_id(""));
        assert!(!valid_replica_id("a|b"));
        assert!(!valid_replica_id(&"x".repeat(65)));
    }
}
