//! Conversions between the store's records and SQLite columns: RFC 3339 text timestamps, hyphenated
//! UUID text, JSON text, u64 counters kept as i64, and the content columns opened with the store's
//! [`Sealer`] (sealed when encryption at rest is on).

use chrono::{DateTime, SecondsFormat, Utc};
use rusqlite::types::Type;
use rusqlite::{ErrorCode, Row};
use sbp_protocol::{SessionStatus, SnapshotKind};
use serde_json::Value;

pub(crate) use crate::codec::{idem_state, int, json, turn_state};
use crate::codec::{parse_idem_state, parse_turn_state};
use uuid::Uuid;

use crate::seal::{Column, SealError, Sealer};
use crate::{
    IdempotencyRecord, IdempotencyState, MessageRecord, SessionRecord, SnapshotRecord, StoreError,
    TetherEntry, Timestamp, TurnRecord, TurnState,
};

/// Maps a SQLite error to the store's error: unique and primary-key violations are the caller's
/// `Conflict`; everything else is a backend failure.
pub(crate) fn db_err(err: rusqlite::Error) -> StoreError {
    if let rusqlite::Error::FromSqlConversionFailure(_, _, inner) = &err
        && let Some(sealing) = inner.downcast_ref::<SealError>()
    {
        return StoreError::Sealing(sealing.clone());
    }
    if let rusqlite::Error::SqliteFailure(code, msg) = &err
        && code.code == ErrorCode::ConstraintViolation
        && matches!(
            code.extended_code,
            rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE | rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY
        )
    {
        return StoreError::Conflict(crate::ConflictKind::Duplicate(
            msg.clone().unwrap_or_else(|| "duplicate key".to_owned()),
        ));
    }
    StoreError::Backend(err.to_string())
}

/// Fixed-width UTC text (`2024-01-02T03:04:05.123456Z`), so text order is time order and indexes on
/// timestamp columns sort correctly. Precision below a microsecond is dropped.
pub(crate) fn ts(t: &Timestamp) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

pub(crate) fn uuid(id: &Uuid) -> String {
    id.hyphenated().to_string()
}

pub(crate) fn bad(idx: usize, what: String) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(idx, Type::Text, what.into())
}

pub(crate) fn col_ts(row: &Row<'_>, idx: usize) -> rusqlite::Result<Timestamp> {
    let s: String = row.get(idx)?;
    DateTime::parse_from_rfc3339(&s)
        .map(|d| d.with_timezone(&Utc))
        .map_err(|e| bad(idx, format!("timestamp {s:?}: {e}")))
}

pub(crate) fn col_opt_ts(row: &Row<'_>, idx: usize) -> rusqlite::Result<Option<Timestamp>> {
    match row.get::<_, Option<String>>(idx)? {
        None => Ok(None),
        Some(_) => col_ts(row, idx).map(Some),
    }
}

pub(crate) fn col_uuid(row: &Row<'_>, idx: usize) -> rusqlite::Result<Uuid> {
    let s: String = row.get(idx)?;
    Uuid::parse_str(&s).map_err(|e| bad(idx, format!("uuid {s:?}: {e}")))
}

/// A sealing error inside a row conversion; [`db_err`] gives it back as `StoreError::Sealing`.
pub(crate) fn sealed(e: SealError) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(0, Type::Text, Box::new(e))
}

/// A content column's text, opened: `key` is the row's key its value is bound to.
pub(crate) fn col_open(
    row: &Row<'_>,
    idx: usize,
    seal: &Sealer,
    column: Column,
    key: &str,
) -> rusqlite::Result<Option<String>> {
    let stored: Option<String> = row.get(idx)?;
    seal.open_opt(column, key, stored).map_err(sealed)
}

/// A content column holding JSON, opened and parsed.
pub(crate) fn col_open_json(
    row: &Row<'_>,
    idx: usize,
    seal: &Sealer,
    column: Column,
    key: &str,
) -> rusqlite::Result<Option<Value>> {
    match col_open(row, idx, seal, column, key)? {
        None => Ok(None),
        Some(s) => serde_json::from_str(&s)
            .map(Some)
            .map_err(|e| bad(idx, format!("json: {e}"))),
    }
}

/// A NOT NULL content column holding JSON.
pub(crate) fn col_sealed_json(
    row: &Row<'_>,
    idx: usize,
    seal: &Sealer,
    column: Column,
    key: &str,
) -> rusqlite::Result<Value> {
    col_open_json(row, idx, seal, column, key)?
        .ok_or_else(|| bad(idx, "unexpected NULL".to_owned()))
}

pub(crate) fn col_u64(row: &Row<'_>, idx: usize) -> rusqlite::Result<u64> {
    let v: i64 = row.get(idx)?;
    u64::try_from(v).map_err(|_| rusqlite::Error::IntegralValueOutOfRange(idx, v))
}

pub(crate) fn col_status(row: &Row<'_>, idx: usize) -> rusqlite::Result<SessionStatus> {
    let s: String = row.get(idx)?;
    SessionStatus::parse(&s).ok_or_else(|| bad(idx, format!("session status {s:?}")))
}

fn col_kind(row: &Row<'_>, idx: usize) -> rusqlite::Result<SnapshotKind> {
    let s: String = row.get(idx)?;
    SnapshotKind::parse(&s).ok_or_else(|| bad(idx, format!("snapshot kind {s:?}")))
}

fn col_turn_state(row: &Row<'_>, idx: usize) -> rusqlite::Result<TurnState> {
    let s: String = row.get(idx)?;
    parse_turn_state(&s).ok_or_else(|| bad(idx, format!("turn state {s:?}")))
}

fn col_idem_state(row: &Row<'_>, idx: usize) -> rusqlite::Result<IdempotencyState> {
    let s: String = row.get(idx)?;
    parse_idem_state(&s).ok_or_else(|| bad(idx, format!("idempotency state {s:?}")))
}

pub(crate) const SESSION_COLS: &str = "id, agent_id, token_hash, status, step_count, message_count, \
     last_task, model, tether_enabled, created_at, updated_at, metadata, message_bytes";

pub(crate) fn session_row(row: &Row<'_>, seal: &Sealer) -> rusqlite::Result<SessionRecord> {
    let id = col_uuid(row, 0)?;
    let key = uuid(&id);
    Ok(SessionRecord {
        id,
        agent_id: row.get(1)?,
        token_hash: row.get(2)?,
        status: col_status(row, 3)?,
        step_count: col_u64(row, 4)?,
        message_count: col_u64(row, 5)?,
        last_task: col_open(row, 6, seal, Column::SessionLastTask, &key)?,
        model: row.get(7)?,
        tether_enabled: row.get(8)?,
        created_at: col_ts(row, 9)?,
        updated_at: col_ts(row, 10)?,
        metadata: col_sealed_json(row, 11, seal, Column::SessionMetadata, &key)?,
        message_bytes: col_u64(row, 12)?,
    })
}

pub(crate) const MESSAGE_COLS: &str = "seq, role, body, model_used, cost_usd, created_at";

/// A message of the session `session` (its key, which the bodies are bound to).
pub(crate) fn message_row(
    row: &Row<'_>,
    seal: &Sealer,
    session: &str,
) -> rusqlite::Result<MessageRecord> {
    Ok(MessageRecord {
        seq: col_u64(row, 0)?,
        role: row.get(1)?,
        body: col_sealed_json(row, 2, seal, Column::MessageBody, session)?,
        model_used: row.get(3)?,
        cost_usd: row.get(4)?,
        created_at: col_ts(row, 5)?,
    })
}

pub(crate) const SNAPSHOT_COLS: &str =
    "id, session_id, kind, step_count, message_count, model, current_task, created_at, state";

pub(crate) fn snapshot_row(row: &Row<'_>, seal: &Sealer) -> rusqlite::Result<SnapshotRecord> {
    let id = col_uuid(row, 0)?;
    let key = uuid(&id);
    Ok(SnapshotRecord {
        id,
        session_id: col_uuid(row, 1)?,
        kind: col_kind(row, 2)?,
        step_count: col_u64(row, 3)?,
        message_count: col_u64(row, 4)?,
        model: row.get(5)?,
        current_task: col_open(row, 6, seal, Column::SnapshotTask, &key)?,
        created_at: col_ts(row, 7)?,
        state: col_sealed_json(row, 8, seal, Column::SnapshotState, &key)?,
    })
}

pub(crate) const TETHER_COLS: &str =
    "session_id, seq, role, content, model_used, created_at, chunk_id";

pub(crate) fn tether_row(row: &Row<'_>, seal: &Sealer) -> rusqlite::Result<TetherEntry> {
    let session_id = col_uuid(row, 0)?;
    Ok(TetherEntry {
        session_id,
        seq: col_u64(row, 1)?,
        role: row.get(2)?,
        content: col_open(row, 3, seal, Column::TetherContent, &uuid(&session_id))?,
        model_used: row.get(4)?,
        created_at: col_ts(row, 5)?,
        chunk_id: col_uuid(row, 6)?,
    })
}

pub(crate) const TURN_COLS: &str = "id, session_id, state, started_at, finished_at, error, owner";

pub(crate) fn turn_row(row: &Row<'_>, seal: &Sealer) -> rusqlite::Result<TurnRecord> {
    let id = col_uuid(row, 0)?;
    Ok(TurnRecord {
        id,
        session_id: col_uuid(row, 1)?,
        state: col_turn_state(row, 2)?,
        started_at: col_ts(row, 3)?,
        finished_at: col_opt_ts(row, 4)?,
        error: col_open(row, 5, seal, Column::TurnError, &uuid(&id))?,
        owner: row.get(6)?,
    })
}

pub(crate) const IDEMPOTENCY_COLS: &str = "key, session_id, fingerprint, state, created_session, \
     response_status, response_body, created_at, updated_at, tether_seq";

pub(crate) fn idempotency_row(row: &Row<'_>, seal: &Sealer) -> rusqlite::Result<IdempotencyRecord> {
    let key: String = row.get(0)?;
    Ok(IdempotencyRecord {
        session_id: col_uuid(row, 1)?,
        fingerprint: row.get(2)?,
        state: col_idem_state(row, 3)?,
        created_session: row.get(4)?,
        response_status: row.get(5)?,
        response_body: col_open_json(row, 6, seal, Column::IdempotencyResponse, &key)?,
        created_at: col_ts(row, 7)?,
        updated_at: col_ts(row, 8)?,
        tether_seq: row
            .get::<_, Option<i64>>(9)?
            .map(|s| u64::try_from(s).map_err(|_| rusqlite::Error::IntegralValueOutOfRange(9, s)))
            .transpose()?,
        key,
    })
}
