//! Encodings both SQL backends share: JSON columns, counters, and the stored names of turn and
//! idempotency states.

use serde_json::Value;

use crate::{IdempotencyState, StoreError, TurnState};

pub(crate) fn json(v: &Value) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(|e| StoreError::Backend(format!("encode json: {e}")))
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
