//! Encodings both SQL backends share: JSON columns, message bodies as stored, counters, and the
//! stored names of turn and idempotency states.

use std::borrow::Cow;

use chrono::SubsecRound;
use serde_json::Value;
use uuid::Uuid;

use crate::seal::{Column, Sealer};
use crate::{
    IdempotencyState, NewMessage, NewSnapshot, SnapshotRecord, StoreError, StoreResult, Timestamp,
    TurnState,
};

pub(crate) fn json(v: &Value) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(|e| StoreError::Backend(format!("encode json: {e}")))
}

/// Bodies encoded ahead of a write (on the blocking pool, owned) and their JSON bytes.
pub(crate) type Encoded = (Vec<Cow<'static, str>>, i64);

/// The messages' bodies as they are stored (JSON text, sealed to the session `sid` when
/// encryption is on), and the total size of their JSON text in bytes: what
/// `sessions.message_bytes` counts, the plaintext whether or not it is sealed.
pub(crate) fn encode_bodies<'a>(
    seal: &Sealer,
    sid: &str,
    messages: &'a [NewMessage],
) -> StoreResult<(Vec<Cow<'a, str>>, i64)> {
    let mut bytes = 0usize;
    let bodies = messages
        .iter()
        .map(|m| {
            let text = m.body.as_str();
            bytes += text.len();
            Ok(seal.seal(Column::MessageBody, sid, text)?)
        })
        .collect::<StoreResult<Vec<_>>>()?;
    let bytes =
        i64::try_from(bytes).map_err(|_| StoreError::Backend("messages too large".to_owned()))?;
    Ok((bodies, bytes))
}

/// A timestamp as both SQL backends keep it: to the microsecond (SQLite's fixed-width text,
/// PostgreSQL's `timestamptz`), the finer part dropped. Written as this, it reads back equal.
pub(crate) fn stored_time(t: Timestamp) -> Timestamp {
    t.trunc_subsecs(6)
}

/// The record of a snapshot just written with these counts: equal to what a read of its row
/// returns, given `stored_text` (what the backend makes of a text column) and a `created_at`
/// written as [`stored_time`], so a write need not read the row back.
pub(crate) fn written_snapshot(
    session_id: Uuid,
    (step_count, message_count): (u64, u64),
    snap: NewSnapshot,
    stored_text: fn(String) -> String,
) -> SnapshotRecord {
    SnapshotRecord {
        id: snap.id,
        session_id,
        kind: snap.kind,
        step_count,
        message_count,
        model: snap.model.map(stored_text),
        current_task: snap.current_task.map(stored_text),
        created_at: stored_time(snap.created_at),
        state: snap.state,
    }
}

pub(crate) fn int(v: u64) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| StoreError::Backend(format!("counter {v} exceeds the i64 range")))
}

const TURN_STATES: [TurnState; 3] = [TurnState::Running, TurnState::Done, TurnState::Failed];
const IDEM_STATES: [IdempotencyState; 3] = [
    IdempotencyState::InProgress,
    IdempotencyState::Failed,
    IdempotencyState::Done,
];

pub(crate) fn turn_state(s: TurnState) -> &'static str {
    match s {
        TurnState::Running => "running",
        TurnState::Done => "done",
        TurnState::Failed => "failed",
    }
}

pub(crate) fn parse_turn_state(s: &str) -> Option<TurnState> {
    TURN_STATES.into_iter().find(|st| turn_state(*st) == s)
}

pub(crate) fn idem_state(s: IdempotencyState) -> &'static str {
    match s {
        IdempotencyState::InProgress => "in_progress",
        IdempotencyState::Failed => "failed",
        IdempotencyState::Done => "done",
    }
}

pub(crate) fn parse_idem_state(s: &str) -> Option<IdempotencyState> {
    IDEM_STATES.into_iter().find(|st| idem_state(*st) == s)
}
