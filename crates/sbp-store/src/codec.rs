//! Encodings both SQL backends share: JSON columns, message bodies as stored, counters, and the
//! stored names of turn and idempotency states.

use std::borrow::Cow;
use std::sync::Arc;

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

/// Histories at least this long are sealed on the blocking pool before a write adopts them.
const PARALLEL_ENCODE_AT: usize = 512;

/// A long history's bodies sealed on the blocking pool, in two halves at once, before the write
/// that adopts them: CPU-bound work that would otherwise hold SQLite's single writer thread, or
/// stall an async worker while a PostgreSQL transaction holds its locks. `None` for a short one,
/// or when encryption is off (the bodies are JSON text already): the write encodes those itself.
/// `messages` picks the history out of `owner`.
pub(crate) async fn encode_ahead<T: Send + Sync + 'static>(
    seal: &Sealer,
    owner: &Arc<T>,
    messages: fn(&T) -> &[NewMessage],
    session: Uuid,
) -> StoreResult<Option<Encoded>> {
    let len = messages(owner).len();
    if len < PARALLEL_ENCODE_AT || !seal.is_on() {
        return Ok(None);
    }
    let half = len.div_ceil(2);
    let sid = session.hyphenated().to_string();
    let encode = |range: std::ops::Range<usize>| {
        let (owner, seal, sid) = (Arc::clone(owner), seal.clone(), sid.clone());
        tokio::task::spawn_blocking(move || {
            let (bodies, bytes) = encode_bodies(&seal, &sid, &messages(&owner)[range])?;
            let owned = bodies.into_iter().map(|b| Cow::Owned(b.into_owned()));
            Ok::<_, StoreError>((owned.collect::<Vec<_>>(), bytes))
        })
    };
    let (first, second) = tokio::join!(encode(0..half), encode(half..len));
    let failed = |e: tokio::task::JoinError| StoreError::Backend(format!("encode task: {e}"));
    let (mut bodies, bytes) = first.map_err(failed)??;
    let (rest, more) = second.map_err(failed)??;
    bodies.extend(rest);
    Ok(Some((bodies, bytes + more)))
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
