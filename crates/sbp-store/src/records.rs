//! The records a store saves and returns. Timestamps are UTC; ids are UUIDs made by the engine.

use chrono::{DateTime, Utc};
use sbp_protocol::{SessionStatus, SnapshotKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

pub type Timestamp = DateTime<Utc>;

#[derive(Debug, Clone, PartialEq)]
pub struct NewSession {
    pub id: Uuid,
    pub agent_id: String,
    /// Hex SHA-256 of the session token; the token itself is never stored.
    pub token_hash: String,
    pub created_at: Timestamp,
    pub metadata: Value,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionRecord {
    pub id: Uuid,
    pub agent_id: String,
    #[serde(skip)]
    pub token_hash: String,
    pub status: SessionStatus,
    /// Completed LLM turns.
    pub step_count: u64,
    pub message_count: u64,
    /// The size of the transcript: the bytes of its messages' bodies as JSON text.
    pub message_bytes: u64,
    pub last_task: Option<String>,
    pub model: Option<String>,
    /// True once a surface has attached: undelivered turns go to the tether from then on.
    pub tether_enabled: bool,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    pub metadata: Value,
}

/// Which sessions [`crate::SessionStore::list_sessions`] returns: newest first (by `created_at`,
/// then id, both descending), filtered, from a position on.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SessionQuery {
    pub agent_id: Option<String>,
    pub status: Option<SessionStatus>,
    /// Only sessions after this `(created_at, id)` in that order: the last one of the previous
    /// page (a keyset cursor, so a page is an index range whatever came before it).
    pub after: Option<(Timestamp, Uuid)>,
    pub limit: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NewMessage {
    pub role: String,
    /// The whole chat message object as the client or upstream gave it (role, content, tool_calls,
    /// ...), as the JSON text the store writes.
    pub body: MessageJson,
    pub model_used: Option<String>,
    pub cost_usd: Option<f64>,
    pub created_at: Timestamp,
}

/// A message body as the JSON text it is stored and sent upstream as, serialised once from its
/// `Value` when the message is made. A request's new messages wait for the store's writer, and
/// then go upstream, in this form: the text, not a tree several times its size.
#[derive(Clone, PartialEq, Eq)]
pub struct MessageJson(Box<str>);

impl MessageJson {
    pub fn new(body: &Value) -> Self {
        // Serialising a `Value` cannot fail (its keys are strings); keep `null` if it ever did.
        Self(
            serde_json::to_string(body)
                .unwrap_or_else(|_| "null".to_owned())
                .into_boxed_str(),
        )
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The body parsed again (the text came from a `Value`, so it parses).
    pub fn to_value(&self) -> Value {
        serde_json::from_str(&self.0).unwrap_or(Value::Null)
    }
}

impl From<&Value> for MessageJson {
    fn from(body: &Value) -> Self {
        Self::new(body)
    }
}

impl From<Value> for MessageJson {
    fn from(body: Value) -> Self {
        Self::new(&body)
    }
}

impl std::fmt::Debug for MessageJson {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MessageRecord {
    /// Zero-based position in the transcript.
    pub seq: u64,
    pub role: String,
    pub body: Value,
    pub model_used: Option<String>,
    pub cost_usd: Option<f64>,
    pub created_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NewSnapshot {
    pub id: Uuid,
    pub kind: SnapshotKind,
    pub model: Option<String>,
    pub current_task: Option<String>,
    pub created_at: Timestamp,
    /// Extra state (e.g. the pending tool call of a pre_action snapshot).
    pub state: Value,
}

/// A snapshot. Its messages are the first `message_count` messages of the transcript, which is
/// append-only, so the store keeps the count rather than a copy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SnapshotRecord {
    pub id: Uuid,
    pub session_id: Uuid,
    pub kind: SnapshotKind,
    pub step_count: u64,
    pub message_count: u64,
    pub model: Option<String>,
    pub current_task: Option<String>,
    pub created_at: Timestamp,
    pub state: Value,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NewTetherEntry {
    pub role: String,
    pub content: Option<String>,
    pub model_used: Option<String>,
    pub created_at: Timestamp,
    /// The chunk id the turn was (or would have been) streamed under.
    pub chunk_id: Uuid,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TetherEntry {
    pub session_id: Uuid,
    /// Per-session, strictly increasing, never reused.
    pub seq: u64,
    pub role: String,
    pub content: Option<String>,
    pub model_used: Option<String>,
    pub created_at: Timestamp,
    pub chunk_id: Uuid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TurnState {
    Running,
    Done,
    Failed,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnRecord {
    pub id: Uuid,
    pub session_id: Uuid,
    pub state: TurnState,
    pub started_at: Timestamp,
    pub finished_at: Option<Timestamp>,
    pub error: Option<String>,
    /// The replica that ran the turn (`BeginTurn::owner`).
    pub owner: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NewIdempotency {
    pub key: String,
    /// Hex SHA-256 of the request, to refuse a key reused for another request.
    pub fingerprint: String,
    /// Whether this request created its session.
    pub created_session: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IdempotencyState {
    InProgress,
    /// The turn failed; a retry runs it again without storing its messages twice.
    Failed,
    Done,
}

#[derive(Debug, Clone, PartialEq)]
pub struct IdempotencyRecord {
    pub key: String,
    pub session_id: Uuid,
    pub fingerprint: String,
    pub state: IdempotencyState,
    pub created_session: bool,
    pub response_status: Option<u16>,
    pub response_body: Option<Value>,
    /// The tether seq the request's write issued (a pushed turn's `seq`, replayed with it).
    pub tether_seq: Option<u64>,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BeginTurn {
    pub session_id: Uuid,
    pub turn_id: Uuid,
    /// Create this session in the same write.
    pub create: Option<NewSession>,
    pub new_messages: Vec<NewMessage>,
    /// Status to move to (checked with `can_transition`; a forbidden change is `Conflict`).
    pub status: Option<SessionStatus>,
    pub last_task: Option<String>,
    pub model: Option<String>,
    pub pre_action: Option<NewSnapshot>,
    /// Claim this key (fails with `Conflict` when it exists), or, with `retry_key`, move an existing
    /// failed record of this session back to in progress.
    pub idempotency: Option<NewIdempotency>,
    pub retry_key: Option<String>,
    /// The replica running the turn, under the id it heartbeats with
    /// (`TurnStore::replica_heartbeat`): once that replica stops heartbeating, another one's
    /// `recover_orphaned_turns` fails the turn. `None` (a single gateway) leaves the turn to any
    /// replica's recovery.
    pub owner: Option<String>,
    pub now: Timestamp,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BeginTurnOutcome {
    pub session: SessionRecord,
    pub pre_action_snapshot: Option<SnapshotRecord>,
    /// The new messages, handed back as they were given once they are written: a caller that
    /// still needs them (to send them upstream, to cache them) keeps no copy while the write
    /// waits its turn.
    pub new_messages: Vec<NewMessage>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FinishTurn {
    pub session_id: Uuid,
    /// The turn to complete; `None` for a turn pushed by a backend.
    pub turn_id: Option<Uuid>,
    pub messages: Vec<NewMessage>,
    pub count_step: bool,
    pub post_action: Option<NewSnapshot>,
    /// Written when the step count after this turn is a multiple of `checkpoint_every`.
    pub checkpoint: Option<(NewSnapshot, u32)>,
    pub tether: Option<NewTetherEntry>,
    /// Enqueue `tether` only if the session's tether is on at commit time (a surface has attached by
    /// then), read in the same transaction, so an attach during a long turn is not missed.
    pub tether_only_if_enabled: bool,
    /// Completes the idempotency record with the response to replay.
    pub idempotency_done: Option<(String, u16, Value)>,
    /// With `idempotency_done`: the record does not exist yet (a pushed turn has no `begin_turn`
    /// to claim its key); it is created here, done, with this fingerprint and the tether seq
    /// this write issues. A key that exists already is `Conflict(IdempotencyKeyClaimed)` and
    /// nothing is written.
    pub idempotency_claim: Option<String>,
    pub now: Timestamp,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FinishTurnOutcome {
    pub session: SessionRecord,
    pub tether_seq: Option<u64>,
    pub post_action_snapshot: Option<SnapshotRecord>,
    pub checkpoint_snapshot: Option<SnapshotRecord>,
    /// Seq of the first message appended.
    pub first_message_seq: u64,
}

/// What a running turn has done so far (tool rounds of the agent loop): messages and snapshots
/// written while the turn is still running, in one write.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnProgress {
    pub session_id: Uuid,
    pub turn_id: Uuid,
    pub messages: Vec<NewMessage>,
    /// Written after the messages, in order; each records the counts including them.
    pub snapshots: Vec<NewSnapshot>,
    pub now: Timestamp,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TurnProgressOutcome {
    pub session: SessionRecord,
    pub snapshots: Vec<SnapshotRecord>,
    /// Seq of the first message appended.
    pub first_message_seq: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FailTurn {
    pub session_id: Uuid,
    pub turn_id: Uuid,
    pub error: String,
    pub idempotency_key: Option<String>,
    pub now: Timestamp,
}
