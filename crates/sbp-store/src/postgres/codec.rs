//! Conversions between the store's records and PostgreSQL columns: `uuid`, `timestamptz`
//! (microseconds, like SQLite's text), JSON kept as the exact text serde_json wrote, and u64
//! counters kept as `bigint`; content columns opened with the store's [`Sealer`] (sealed when
//! encryption at rest is on).

use std::borrow::Cow;

use sbp_protocol::{SessionStatus, SnapshotKind};
use serde_json::Value;

pub(crate) use crate::codec::{idem_state, int, json, turn_state};
use crate::codec::{parse_idem_state, parse_turn_state};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;

use crate::seal::{Column, Sealer};
use crate::{
    IdempotencyRecord, IdempotencyState, MessageRecord, SessionRecord, SnapshotRecord, StoreError,
    StoreResult, TetherEntry, TurnRecord, TurnState,
};

/// Maps a PostgreSQL error to the store's error: unique and primary-key violations are the caller's
/// `Conflict` (as on SQLite); everything else is a backend failure.
pub(crate) fn db_err(err: tokio_postgres::Error) -> StoreError {
    match err.as_db_error() {
        Some(db) if *db.code() == SqlState::UNIQUE_VIOLATION => {
            StoreError::Conflict(crate::ConflictKind::Duplicate(db.message().to_owned()))
        }
        Some(db) => StoreError::Backend(format!("postgres {}: {}", db.code().code(), db.message())),
        None => StoreError::Backend(format!("postgres: {}", describe(&err))),
    }
}

/// The error with its causes (tokio-postgres's own text omits them: "error connecting to server").
pub(crate) fn describe(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Whether `err` only says that an earlier statement of the transaction failed: when statements are
/// pipelined, the first real error is the one to report.
pub(crate) fn is_aborted(err: &StoreError) -> bool {
    matches!(err, StoreError::Backend(m) if m.starts_with("postgres 25P02"))
}

/// The first error of pipelined statements, in statement order, preferring a real cause over
/// "current transaction is aborted" (which only says that another statement failed).
pub(crate) fn first_error<const N: usize>(errors: [Option<StoreError>; N]) -> StoreResult<()> {
    let mut aborted = None;
    for e in errors.into_iter().flatten() {
        if !is_aborted(&e) {
            return Err(e);
        }
        aborted.get_or_insert(e);
    }
    aborted.map_or(Ok(()), Err)
}

/// Free text for a `text` column. PostgreSQL's text cannot hold U+0000 (SQLite's can), so it is
/// stored as U+FFFD: a task label, a tether entry or a label with a NUL in it is kept, not refused.
/// JSON columns never need this: serde_json writes U+0000 as the escape `\u0000`.
pub(crate) fn text(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// An owned text as [`text`] stores it, so what a read gives back.
pub(crate) fn stored_text(s: String) -> String {
    match text(&s) {
        Cow::Borrowed(_) => s,
        Cow::Owned(clean) => clean,
    }
}

pub(crate) fn opt_text(s: &Option<String>) -> Option<Cow<'_, str>> {
    s.as_deref().map(text)
}

pub(crate) fn bad(idx: usize, what: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("column {idx}: {what}"))
}

/// A column of the row, its conversion failure as `Backend`.
pub(crate) fn get<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    idx: usize,
) -> Result<T, StoreError> {
    row.try_get(idx).map_err(|e| bad(idx, e))
}

/// Plaintext for a content column: NULs as in [`text`], then sealed to the row `key` when
/// encryption is on.
pub(crate) fn seal_text(
    seal: &Sealer,
    column: Column,
    key: &str,
    s: &Option<String>,
) -> StoreResult<Option<String>> {
    match s {
        None => Ok(None),
        Some(s) => Ok(Some(seal.seal(column, key, &text(s))?.into_owned())),
    }
}

/// A content column's text, opened: `key` is the row's key its value is bound to.
pub(crate) fn col_open(
    row: &Row,
    idx: usize,
    seal: &Sealer,
    column: Column,
    key: &str,
) -> StoreResult<Option<String>> {
    let stored: Option<String> = get(row, idx)?;
    Ok(seal.open_opt(column, key, stored)?)
}

/// A content column holding JSON, opened and parsed.
pub(crate) fn col_open_json(
    row: &Row,
    idx: usize,
    seal: &Sealer,
    column: Column,
    key: &str,
) -> StoreResult<Option<Value>> {
    match col_open(row, idx, seal, column, key)? {
        None => Ok(None),
        Some(s) => serde_json::from_str(&s)
            .map(Some)
            .map_err(|e| bad(idx, format!("json: {e}"))),
    }
}

/// A NOT NULL content column holding JSON.
pub(crate) fn col_sealed_json(
    row: &Row,
    idx: usize,
    seal: &Sealer,
    column: Column,
    key: &str,
) -> StoreResult<Value> {
    col_open_json(row, idx, seal, column, key)?.ok_or_else(|| bad(idx, "unexpected NULL"))
}

pub(crate) fn col_u64(row: &Row, idx: usize) -> Result<u64, StoreError> {
    let v: i64 = get(row, idx)?;
    u64::try_from(v).map_err(|_| bad(idx, format!("negative counter {v}")))
}

pub(crate) fn col_status(row: &Row, idx: usize) -> Result<SessionStatus, StoreError> {
    let s: &str = get(row, idx)?;
    SessionStatus::parse(s).ok_or_else(|| bad(idx, format!("session status {s:?}")))
}

fn col_kind(row: &Row, idx: usize) -> Result<SnapshotKind, StoreError> {
    let s: &str = get(row, idx)?;
    SnapshotKind::parse(s).ok_or_else(|| bad(idx, format!("snapshot kind {s:?}")))
}

fn col_turn_state(row: &Row, idx: usize) -> Result<TurnState, StoreError> {
    let s: &str = get(row, idx)?;
    parse_turn_state(s).ok_or_else(|| bad(idx, format!("turn state {s:?}")))
}

fn col_idem_state(row: &Row, idx: usize) -> Result<IdempotencyState, StoreError> {
    let s: &str = get(row, idx)?;
    parse_idem_state(s).ok_or_else(|| bad(idx, format!("idempotency state {s:?}")))
}

macro_rules! session_cols {
    () => {
        "id, agent_id, token_hash, status, step_count, message_count, \
     last_task, model, tether_enabled, created_at, updated_at, metadata, message_bytes"
    };
}
pub(crate) use session_cols;

pub(crate) fn session_row(row: &Row, seal: &Sealer) -> Result<SessionRecord, StoreError> {
    let id: uuid::Uuid = get(row, 0)?;
    let key = id.to_string();
    Ok(SessionRecord {
        id,
        agent_id: get(row, 1)?,
        token_hash: get(row, 2)?,
        status: col_status(row, 3)?,
        step_count: col_u64(row, 4)?,
        message_count: col_u64(row, 5)?,
        last_task: col_open(row, 6, seal, Column::SessionLastTask, &key)?,
        model: get(row, 7)?,
        tether_enabled: get(row, 8)?,
        created_at: get(row, 9)?,
        updated_at: get(row, 10)?,
        metadata: col_sealed_json(row, 11, seal, Column::SessionMetadata, &key)?,
        message_bytes: col_u64(row, 12)?,
    })
}

macro_rules! message_cols {
    () => {
        "seq, role, body, model_used, cost_usd, created_at"
    };
}
pub(crate) use message_cols;

/// A message of the session `session` (its key, which the bodies are bound to).
pub(crate) fn message_row(
    row: &Row,
    seal: &Sealer,
    session: &str,
) -> Result<MessageRecord, StoreError> {
    Ok(MessageRecord {
        seq: col_u64(row, 0)?,
        role: get(row, 1)?,
        body: col_sealed_json(row, 2, seal, Column::MessageBody, session)?,
        model_used: get(row, 3)?,
        cost_usd: get(row, 4)?,
        created_at: get(row, 5)?,
    })
}

macro_rules! snapshot_cols {
    () => {
        "id, session_id, kind, step_count, message_count, model, current_task, created_at, state"
    };
}
pub(crate) use snapshot_cols;

pub(crate) fn snapshot_row(row: &Row, seal: &Sealer) -> Result<SnapshotRecord, StoreError> {
    let id: uuid::Uuid = get(row, 0)?;
    let key = id.to_string();
    Ok(SnapshotRecord {
        id,
        session_id: get(row, 1)?,
        kind: col_kind(row, 2)?,
        step_count: col_u64(row, 3)?,
        message_count: col_u64(row, 4)?,
        model: get(row, 5)?,
        current_task: col_open(row, 6, seal, Column::SnapshotTask, &key)?,
        created_at: get(row, 7)?,
        state: col_sealed_json(row, 8, seal, Column::SnapshotState, &key)?,
    })
}

macro_rules! tether_cols {
    () => {
        "session_id, seq, role, content, model_used, created_at, chunk_id"
    };
}
pub(crate) use tether_cols;

pub(crate) fn tether_row(row: &Row, seal: &Sealer) -> Result<TetherEntry, StoreError> {
    let session_id: uuid::Uuid = get(row, 0)?;
    Ok(TetherEntry {
        session_id,
        seq: col_u64(row, 1)?,
        role: get(row, 2)?,
        content: col_open(row, 3, seal, Column::TetherContent, &session_id.to_string())?,
        model_used: get(row, 4)?,
        created_at: get(row, 5)?,
        chunk_id: get(row, 6)?,
    })
}

macro_rules! turn_cols {
    () => {
        "id, session_id, state, started_at, finished_at, error, owner"
    };
}
pub(crate) use turn_cols;

pub(crate) fn turn_row(row: &Row, seal: &Sealer) -> Result<TurnRecord, StoreError> {
    let id: uuid::Uuid = get(row, 0)?;
    Ok(TurnRecord {
        id,
        session_id: get(row, 1)?,
        state: col_turn_state(row, 2)?,
        started_at: get(row, 3)?,
        finished_at: get(row, 4)?,
        error: col_open(row, 5, seal, Column::TurnError, &id.to_string())?,
        owner: get(row, 6)?,
    })
}

macro_rules! idempotency_cols {
    () => {
        "key, session_id, fingerprint, state, created_session, \
     response_status, response_body, created_at, updated_at, tether_seq"
    };
}
pub(crate) use idempotency_cols;

pub(crate) fn idempotency_row(row: &Row, seal: &Sealer) -> Result<IdempotencyRecord, StoreError> {
    let status: Option<i32> = get(row, 5)?;
    let key: String = get(row, 0)?;
    Ok(IdempotencyRecord {
        session_id: get(row, 1)?,
        fingerprint: get(row, 2)?,
        state: col_idem_state(row, 3)?,
        created_session: get(row, 4)?,
        response_status: status
            .map(|s| u16::try_from(s).map_err(|_| bad(5, format!("response status {s}"))))
            .transpose()?,
        response_body: col_open_json(row, 6, seal, Column::IdempotencyResponse, &key)?,
        created_at: get(row, 7)?,
        updated_at: get(row, 8)?,
        tether_seq: get::<Option<i64>>(row, 9)?
            .map(|s| u64::try_from(s).map_err(|_| bad(9, format!("tether seq {s}"))))
            .transpose()?,
        key,
    })
}

/// Maps every row with `f`, stopping at the first failure.
pub(crate) fn rows<T>(
    rows: &[Row],
    f: impl Fn(&Row) -> Result<T, StoreError>,
) -> Result<Vec<T>, StoreError> {
    rows.iter().map(f).collect()
}
