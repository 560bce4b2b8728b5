//! Encodings both SQL backends share: JSON columns, message bodies as stored, counters, and the
//! stored names of turn and idempotency states.

use serde_json::Value;

use crate::seal::{Column, Sealer};
use crate::{IdempotencyState, NewMessage, StoreError, StoreResult, TurnState};

pub(crate) fn json(v: &Value) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(|e| StoreError::Backend(format!("encode json: {e}")))
}

/// The messages' bodies as they are stored (JSON text, sealed to the session `sid` when
/// encryption is on), and the total size of their JSON text in bytes: what
/// `sessions.message_bytes` counts, the plaintext whether or not it is sealed.
pub(crate) fn encode_bodies(
    seal: &Sealer,
    sid: &str,
    messages: &[NewMessage],
) -> StoreResult<(Vec<String>, i64)> {
    let mut bytes = 0usize;
    let bodies = messages
        .iter()
        .map(|m| {
            let text = json(&m.body)?;
            bytes += text.len();
            Ok(match seal.seal(Column::MessageBody, sid, &text)? {
                std::borrow::Cow::Borrowed(_) => text,
                std::borrow::Cow::Owned(sealed) => sealed,
            })
        })
        .collect::<StoreResult<Vec<_>>>()?;
    let bytes =
        i64::try_from(bytes).map_err(|_| StoreError::Backend("messages too large".to_owned()))?;
    Ok((bodies, bytes))
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
