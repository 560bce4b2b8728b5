//! The store's operations as plain synchronous functions on a connection. Writes run on the writer
//! thread inside a savepoint, so returning `Err` at any point undoes everything the function did.

use std::borrow::Cow;

use rusqlite::{Connection, OptionalExtension, params};
use sbp_protocol::SessionStatus;
use uuid::Uuid;

use super::codec::{
    IDEMPOTENCY_COLS, MESSAGE_COLS, SESSION_COLS, SNAPSHOT_COLS, TETHER_COLS, TURN_COLS,
    col_status, db_err, idem_state, idempotency_row, int, json, message_row, session_row,
    snapshot_row, tether_row, ts, turn_row, turn_state, uuid,
};
pub(crate) use crate::codec::encode_bodies;
use crate::codec::{stored_time, written_snapshot};
use crate::seal::{Column, Sealer};
use crate::{
    BeginTurn, BeginTurnOutcome, ConflictKind, FailTurn, FinishTurn, FinishTurnOutcome,
    IdempotencyRecord, IdempotencyState, MessageRecord, NewMessage, NewSession, NewSnapshot,
    NewTetherEntry, SessionRecord, SnapshotRecord, StoreError, StoreResult, TetherEntry, Timestamp,
    TurnProgress, TurnProgressOutcome, TurnRecord, TurnState,
};

/// Error text of turns failed by `recover_interrupted_turns`.
pub(crate) const INTERRUPTED: &str = "interrupted by gateway restart";

fn conflict(kind: ConflictKind) -> StoreError {
    StoreError::Conflict(kind)
}

// ---- sessions ----

pub(crate) fn insert_session(conn: &Connection, seal: &Sealer, s: &NewSession) -> StoreResult<()> {
    let created = ts(&s.created_at);
    let metadata = json(&s.metadata)?;
    let metadata = seal.seal(Column::SessionMetadata, &uuid(&s.id), &metadata)?;
    conn.prepare_cached(
        "INSERT INTO sessions (id, agent_id, token_hash, status, created_at, updated_at, metadata) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?5, ?6)",
    )
    .and_then(|mut st| {
        st.execute(params![
            uuid(&s.id),
            s.agent_id,
            s.token_hash,
            SessionStatus::Idle.as_str(),
            created,
            metadata,
        ])
    })
    .map_err(db_err)?;
    Ok(())
}

pub(crate) fn get_session(
    conn: &Connection,
    seal: &Sealer,
    id: Uuid,
) -> StoreResult<Option<SessionRecord>> {
    conn.prepare_cached(&format!(
        "SELECT {SESSION_COLS} FROM sessions WHERE id = ?1"
    ))
    .and_then(|mut st| {
        st.query_row([uuid(&id)], |r| session_row(r, seal))
            .optional()
    })
    .map_err(db_err)
}

pub(crate) fn find_session_by_token(
    conn: &Connection,
    seal: &Sealer,
    token_hash: &str,
) -> StoreResult<Option<SessionRecord>> {
    conn.prepare_cached(&format!(
        "SELECT {SESSION_COLS} FROM sessions WHERE token_hash = ?1"
    ))
    .and_then(|mut st| {
        st.query_row([token_hash], |r| session_row(r, seal))
            .optional()
    })
    .map_err(db_err)
}

pub(crate) fn latest_suspended_for_agent(
    conn: &Connection,
    seal: &Sealer,
    agent_id: &str,
) -> StoreResult<Option<SessionRecord>> {
    // `rowid` breaks ties between sessions updated in the same microsecond: the later insert wins.
    conn.prepare_cached(&format!(
        "SELECT {SESSION_COLS} FROM sessions WHERE agent_id = ?1 AND status = 'suspended' \
         ORDER BY updated_at DESC, rowid DESC LIMIT 1"
    ))
    .and_then(|mut st| {
        st.query_row([agent_id], |r| session_row(r, seal))
            .optional()
    })
    .map_err(db_err)
}

pub(crate) fn current_status(conn: &Connection, sid: &str) -> StoreResult<SessionStatus> {
    conn.prepare_cached("SELECT status FROM sessions WHERE id = ?1")
        .and_then(|mut st| st.query_row([sid], |r| col_status(r, 0)).optional())
        .map_err(db_err)?
        .ok_or(StoreError::NotFound)
}

pub(crate) fn check_transition(from: SessionStatus, to: SessionStatus) -> StoreResult<()> {
    if from.can_transition(to) {
        Ok(())
    } else {
        Err(conflict(ConflictKind::Transition { from, to }))
    }
}

pub(crate) fn update_status(
    conn: &Connection,
    id: Uuid,
    to: SessionStatus,
    now: Timestamp,
) -> StoreResult<SessionStatus> {
    let current = current_status(conn, &uuid(&id))?;
    check_transition(current, to)?;
    conn.prepare_cached("UPDATE sessions SET status = ?2, updated_at = ?3 WHERE id = ?1")
        .and_then(|mut st| st.execute(params![uuid(&id), to.as_str(), ts(&now)]))
        .map_err(db_err)?;
    Ok(current)
}

pub(crate) fn mark_attached(
    conn: &Connection,
    seal: &Sealer,
    id: Uuid,
    now: Timestamp,
) -> StoreResult<SessionRecord> {
    conn.prepare_cached(&format!(
        "UPDATE sessions SET tether_enabled = 1, updated_at = ?2, \
         status = CASE WHEN status IN ('suspended', 'idle') THEN 'running' ELSE status END \
         WHERE id = ?1 RETURNING {SESSION_COLS}"
    ))
    .and_then(|mut st| {
        st.query_row(params![uuid(&id), ts(&now)], |r| session_row(r, seal))
            .optional()
    })
    .map_err(db_err)?
    .ok_or(StoreError::NotFound)
}

pub(crate) fn suspend_if_running(conn: &Connection, id: Uuid, now: Timestamp) -> StoreResult<bool> {
    conn.prepare_cached(
        "UPDATE sessions SET status = 'suspended', updated_at = ?2 \
         WHERE id = ?1 AND status = 'running'",
    )
    .and_then(|mut st| st.execute(params![uuid(&id), ts(&now)]))
    .map(|n| n > 0)
    .map_err(db_err)
}

/// Every status, zero counts included, in `SessionStatus::ALL` order.
pub(crate) fn count_sessions_by_status(
    conn: &Connection,
) -> StoreResult<Vec<(SessionStatus, u64)>> {
    let mut counts: Vec<(SessionStatus, u64)> =
        SessionStatus::ALL.iter().map(|s| (*s, 0)).collect();
    let rows = conn
        .prepare_cached("SELECT status, COUNT(*) FROM sessions GROUP BY status")
        .and_then(|mut st| {
            st.query_map([], |r| Ok((col_status(r, 0)?, r.get::<_, i64>(1)?)))?
                .collect::<rusqlite::Result<Vec<_>>>()
        })
        .map_err(db_err)?;
    for (status, n) in rows {
        if let Some(slot) = counts.iter_mut().find(|(s, _)| *s == status) {
            // COUNT(*) is never negative.
            slot.1 = u64::try_from(n).unwrap_or(0);
        }
    }
    Ok(counts)
}

// ---- messages ----

/// Inserts `messages` at seqs `start..` (the caller has already moved `message_count` past them),
/// with the bodies already encoded as they are stored ([`encode_bodies`]: `bodies[i]` is the body
/// of `messages[i]`), e.g. by the caller in parallel before the write.
pub(crate) fn insert_encoded_messages(
    conn: &Connection,
    sid: &str,
    start: i64,
    messages: &[NewMessage],
    bodies: &[Cow<'_, str>],
) -> StoreResult<()> {
    if messages.is_empty() {
        return Ok(());
    }
    if bodies.len() != messages.len() {
        return Err(StoreError::Backend(
            "encoded bodies do not match the messages".to_owned(),
        ));
    }
    let body_of = |i: usize, _: &NewMessage| -> StoreResult<&str> { Ok(&bodies[i]) };
    // Long histories go in statements of many rows: a statement's fixed cost (reset, bind, VDBE
    // start) is most of a small row's insert.
    let bulk = if messages.len() >= ROWS_PER_INSERT {
        messages.len() / ROWS_PER_INSERT * ROWS_PER_INSERT
    } else {
        0
    };
    if bulk > 0 {
        let sql = format!(
            "INSERT INTO messages (session_id, seq, role, body, model_used, cost_usd, created_at) \
             VALUES {}",
            vec!["(?, ?, ?, ?, ?, ?, ?)"; ROWS_PER_INSERT].join(", ")
        );
        let mut insert = conn.prepare_cached(&sql).map_err(db_err)?;
        for (c, chunk) in messages[..bulk].chunks(ROWS_PER_INSERT).enumerate() {
            let first = c * ROWS_PER_INSERT;
            let rows = chunk
                .iter()
                .enumerate()
                .map(|(j, m)| {
                    let seq = start + i64::try_from(first + j).map_err(|_| too_many())?;
                    Ok((seq, body_of(first + j, m)?, ts(&m.created_at)))
                })
                .collect::<StoreResult<Vec<_>>>()?;
            let mut values: Vec<&dyn rusqlite::ToSql> = Vec::with_capacity(7 * ROWS_PER_INSERT);
            for (m, (seq, body, created)) in chunk.iter().zip(&rows) {
                values.extend_from_slice(&[
                    &sid as &dyn rusqlite::ToSql,
                    seq,
                    &m.role,
                    body,
                    &m.model_used,
                    &m.cost_usd,
                    created,
                ]);
            }
            insert
                .execute(rusqlite::params_from_iter(values))
                .map_err(db_err)?;
        }
    }
    let mut insert = conn
        .prepare_cached(
            "INSERT INTO messages (session_id, seq, role, body, model_used, cost_usd, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )
        .map_err(db_err)?;
    for (i, m) in messages.iter().enumerate().skip(bulk) {
        let seq = start + i64::try_from(i).map_err(|_| too_many())?;
        insert
            .execute(params![
                sid,
                seq,
                m.role,
                body_of(i, m)?,
                m.model_used,
                m.cost_usd,
                ts(&m.created_at)
            ])
            .map_err(db_err)?;
    }
    Ok(())
}

/// Rows per multi-row `INSERT` of a long history (7 parameters each, far below SQLite's limit).
const ROWS_PER_INSERT: usize = 64;

fn too_many() -> StoreError {
    StoreError::Backend("too many messages".to_owned())
}

pub(crate) fn len_i64(messages: &[NewMessage]) -> StoreResult<i64> {
    i64::try_from(messages.len()).map_err(|_| StoreError::Backend("too many messages".to_owned()))
}

pub(crate) fn list_messages(
    conn: &Connection,
    seal: &Sealer,
    session: Uuid,
    after: Option<u64>,
    limit: Option<u32>,
) -> StoreResult<Vec<MessageRecord>> {
    // `after = None` means from the start: seq >= 0, i.e. seq > -1.
    let after = match after {
        Some(a) => int(a)?,
        None => -1,
    };
    // SQLite reads a negative LIMIT as "no limit".
    let limit = limit.map_or(-1, i64::from);
    conn.prepare_cached(&format!(
        "SELECT {MESSAGE_COLS} FROM messages WHERE session_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3"
    ))
    .and_then(|mut st| {
        let sid = uuid(&session);
        st.query_map(params![sid, after, limit], |r| message_row(r, seal, &sid))?
            .collect()
    })
    .map_err(db_err)
}

// ---- snapshots ----

/// Writes a snapshot row of `session` with the counts given (sealed as every snapshot is).
pub(crate) fn write_snapshot(
    conn: &Connection,
    seal: &Sealer,
    session: Uuid,
    (steps, messages): (u64, u64),
    snap: &NewSnapshot,
) -> StoreResult<()> {
    let key = uuid(&snap.id);
    let state = json(&snap.state)?;
    let state = seal.seal(Column::SnapshotState, &key, &state)?;
    let task = seal.seal_opt(Column::SnapshotTask, &key, snap.current_task.as_deref())?;
    let (steps, messages) = (int(steps)?, int(messages)?);
    let sid = uuid(&session);
    // Chained after the session's latest, which it then becomes (schema v11).
    conn.prepare_cached(
        "INSERT INTO snapshots (id, session_id, kind, step_count, message_count, model, \
         current_task, created_at, state, prev_ord) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, \
         (SELECT latest_snapshot FROM sessions WHERE id = ?2))",
    )
    .and_then(|mut st| {
        st.execute(params![
            key,
            sid,
            snap.kind.as_str(),
            steps,
            messages,
            snap.model,
            task,
            ts(&snap.created_at),
            state,
        ])
    })
    .map_err(db_err)?;
    let chained = conn
        .prepare_cached("UPDATE sessions SET latest_snapshot = last_insert_rowid() WHERE id = ?1")
        .and_then(|mut st| st.execute([&sid]))
        .map_err(db_err)?;
    // Without the session, the row would belong to nothing (the table has no foreign key).
    if chained == 0 {
        return Err(StoreError::NotFound);
    }
    Ok(())
}

/// Writes a snapshot of `session`, the record this transaction's update of the session returned,
/// so its counts are the session's as they are now. The record returned is built from what was
/// written ([`written_snapshot`]) rather than read back: as an `INSERT … SELECT … RETURNING`
/// whose row was decoded again, the snapshots took a third of the writer thread's time per turn;
/// as this plain insert, a fifth.
fn insert_snapshot(
    conn: &Connection,
    seal: &Sealer,
    session: &SessionRecord,
    snap: NewSnapshot,
) -> StoreResult<SnapshotRecord> {
    let counts = (session.step_count, session.message_count);
    let snap = NewSnapshot {
        created_at: stored_time(snap.created_at),
        ..snap
    };
    write_snapshot(conn, seal, session.id, counts, &snap)?;
    // SQLite keeps text as it is given.
    Ok(written_snapshot(session.id, counts, snap, |s| s))
}

pub(crate) fn latest_snapshot(
    conn: &Connection,
    seal: &Sealer,
    session: Uuid,
    kind: Option<sbp_protocol::SnapshotKind>,
) -> StoreResult<Option<SnapshotRecord>> {
    let sid = uuid(&session);
    let Some(kind) = kind else {
        return conn
            .prepare_cached(&format!(
                "SELECT {SNAPSHOT_COLS} FROM snapshots \
                 WHERE ord = (SELECT latest_snapshot FROM sessions WHERE id = ?1)"
            ))
            .and_then(|mut st| st.query_row([&sid], |r| snapshot_row(r, seal)).optional())
            .map_err(db_err);
    };
    // Back along the session's chain from its latest, reading only each row's kind: every kind
    // but a rare one is a few rows back (a turn writes a pre- and a post-action snapshot). One
    // read transaction, so the walk sees one state of the chain.
    let tx = conn.unchecked_transaction().map_err(db_err)?;
    let mut at: Option<i64> = tx
        .prepare_cached("SELECT latest_snapshot FROM sessions WHERE id = ?1")
        .and_then(|mut st| st.query_row([&sid], |r| r.get(0)).optional())
        .map_err(db_err)?
        .flatten();
    let mut step = tx
        .prepare_cached("SELECT kind, prev_ord FROM snapshots WHERE ord = ?1")
        .map_err(db_err)?;
    while let Some(ord) = at {
        let Some((found, prev)) = step
            .query_row([ord], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, Option<i64>>(1)?))
            })
            .optional()
            .map_err(db_err)?
        else {
            return Ok(None);
        };
        if found == kind.as_str() {
            return tx
                .prepare_cached(&format!(
                    "SELECT {SNAPSHOT_COLS} FROM snapshots WHERE ord = ?1"
                ))
                .and_then(|mut st| st.query_row([ord], |r| snapshot_row(r, seal)).optional())
                .map_err(db_err);
        }
        at = prev;
    }
    Ok(None)
}

pub(crate) fn get_snapshot(
    conn: &Connection,
    seal: &Sealer,
    id: Uuid,
) -> StoreResult<Option<SnapshotRecord>> {
    conn.prepare_cached(&format!(
        "SELECT {SNAPSHOT_COLS} FROM snapshots WHERE id = ?1"
    ))
    .and_then(|mut st| {
        st.query_row([uuid(&id)], |r| snapshot_row(r, seal))
            .optional()
    })
    .map_err(db_err)
}

/// The session's snapshots along its chain (schema v11): `o` is a row's `ord`, `n` its place from
/// the latest (1). A row the retention sweep removed ends the chain.
const SNAPSHOT_CHAIN: &str = "WITH RECURSIVE chain(o, n) AS ( \
     SELECT latest_snapshot, 1 FROM sessions WHERE id = ?1 AND ?2 > 0 \
     UNION ALL \
     SELECT s.prev_ord, chain.n + 1 FROM chain JOIN snapshots s \
     ON s.ord = chain.o AND s.session_id = ?1 WHERE chain.n < ?2)";

pub(crate) fn list_snapshots(
    conn: &Connection,
    seal: &Sealer,
    session: Uuid,
    limit: u32,
) -> StoreResult<Vec<SnapshotRecord>> {
    conn.prepare_cached(&format!(
        "{SNAPSHOT_CHAIN} SELECT {SNAPSHOT_COLS} FROM chain \
         JOIN snapshots ON snapshots.ord = chain.o ORDER BY chain.n"
    ))
    .and_then(|mut st| {
        st.query_map(params![uuid(&session), i64::from(limit)], |r| {
            snapshot_row(r, seal)
        })?
        .collect()
    })
    .map_err(db_err)
}

/// Removes every snapshot of the session, along its chain; before the session's row goes (the
/// table has no foreign key to cascade from it).
pub(crate) fn delete_snapshots(conn: &Connection, sid: &str) -> StoreResult<u64> {
    conn.prepare_cached(&format!(
        "{SNAPSHOT_CHAIN} DELETE FROM snapshots WHERE session_id = ?1 \
         AND ord IN (SELECT o FROM chain)"
    ))
    .and_then(|mut st| st.execute(params![sid, i64::MAX]))
    .map(|n| n as u64)
    .map_err(db_err)
}

// ---- tether ----

fn insert_tether(
    conn: &Connection,
    seal: &Sealer,
    session: Uuid,
    entry: &NewTetherEntry,
) -> StoreResult<u64> {
    let sid = uuid(&session);
    let content = seal.seal_opt(Column::TetherContent, &sid, entry.content.as_deref())?;
    // Taking the seq from the session row (not MAX(seq) of the table) keeps it growing after the
    // newest entries were acknowledged or removed.
    let seq: i64 = conn
        .prepare_cached("UPDATE sessions SET tether_seq = tether_seq + 1 WHERE id = ?1 RETURNING tether_seq - 1")
        .and_then(|mut st| st.query_row([&sid], |r| r.get(0)).optional())
        .map_err(db_err)?
        .ok_or(StoreError::NotFound)?;
    conn.prepare_cached(
        "INSERT INTO tether (session_id, seq, role, content, model_used, created_at, chunk_id) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )
    .and_then(|mut st| {
        st.execute(params![
            sid,
            seq,
            entry.role,
            content,
            entry.model_used,
            ts(&entry.created_at),
            uuid(&entry.chunk_id)
        ])
    })
    .map_err(db_err)?;
    u64::try_from(seq).map_err(|_| StoreError::Backend("negative tether seq".to_owned()))
}

pub(crate) fn tether_pending(
    conn: &Connection,
    seal: &Sealer,
    session: Uuid,
    after: Option<u64>,
    limit: u32,
) -> StoreResult<Vec<TetherEntry>> {
    let after = match after {
        Some(a) => int(a)?,
        None => 0,
    };
    conn.prepare_cached(&format!(
        "SELECT {TETHER_COLS} FROM tether WHERE session_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3"
    ))
    .and_then(|mut st| {
        st.query_map(params![uuid(&session), after, i64::from(limit)], |r| {
            tether_row(r, seal)
        })?
        .collect()
    })
    .map_err(db_err)
}

fn count(conn: &Connection, sql: &str, p: impl rusqlite::Params) -> StoreResult<u64> {
    let n: i64 = conn
        .prepare_cached(sql)
        .and_then(|mut st| st.query_row(p, |r| r.get(0)))
        .map_err(db_err)?;
    // COUNT(*) is never negative.
    Ok(u64::try_from(n).unwrap_or(0))
}

pub(crate) fn tether_count(conn: &Connection, session: Uuid) -> StoreResult<u64> {
    count(
        conn,
        "SELECT COUNT(*) FROM tether WHERE session_id = ?1",
        [uuid(&session)],
    )
}

pub(crate) fn tether_depth_total(conn: &Connection) -> StoreResult<u64> {
    count(conn, "SELECT COUNT(*) FROM tether", [])
}

pub(crate) fn tether_issued(conn: &Connection, session: Uuid) -> StoreResult<u64> {
    // `tether_seq` is the next seq to issue.
    let next: i64 = conn
        .prepare_cached("SELECT tether_seq FROM sessions WHERE id = ?1")
        .and_then(|mut st| st.query_row([uuid(&session)], |r| r.get(0)).optional())
        .map_err(db_err)?
        .ok_or(StoreError::NotFound)?;
    u64::try_from(next - 1).map_err(|_| StoreError::Backend("negative tether seq".to_owned()))
}

pub(crate) fn tether_ack(conn: &Connection, session: Uuid, up_to: u64) -> StoreResult<u64> {
    // Clamp rather than fail: "everything up to a huge seq" is simply everything.
    let up_to = i64::try_from(up_to).unwrap_or(i64::MAX);
    let n = conn
        .prepare_cached("DELETE FROM tether WHERE session_id = ?1 AND seq <= ?2")
        .and_then(|mut st| st.execute(params![uuid(&session), up_to]))
        .map_err(db_err)?;
    Ok(n as u64)
}

pub(crate) fn tether_remove(conn: &Connection, session: Uuid, seqs: &[u64]) -> StoreResult<u64> {
    let sid = uuid(&session);
    let mut delete = conn
        .prepare_cached("DELETE FROM tether WHERE session_id = ?1 AND seq = ?2")
        .map_err(db_err)?;
    let mut removed = 0u64;
    for &seq in seqs {
        // A seq beyond i64 was never handed out, so there is nothing to remove.
        let Ok(seq) = i64::try_from(seq) else {
            continue;
        };
        removed += delete.execute(params![sid, seq]).map_err(db_err)? as u64;
    }
    Ok(removed)
}

// ---- turns ----

pub(crate) fn get_turn(
    conn: &Connection,
    seal: &Sealer,
    id: Uuid,
) -> StoreResult<Option<TurnRecord>> {
    conn.prepare_cached(&format!("SELECT {TURN_COLS} FROM turns WHERE id = ?1"))
        .and_then(|mut st| st.query_row([uuid(&id)], |r| turn_row(r, seal)).optional())
        .map_err(db_err)
}

/// The session row after a turn's update: `message_count` already includes the new messages.
fn updated_session(
    conn: &Connection,
    seal: &Sealer,
    sql: &str,
    p: impl rusqlite::Params,
    appended: i64,
) -> StoreResult<(SessionRecord, i64)> {
    let session = conn
        .prepare_cached(sql)
        .and_then(|mut st| st.query_row(p, |r| session_row(r, seal)).optional())
        .map_err(db_err)?
        .ok_or(StoreError::NotFound)?;
    let end = int(session.message_count)?;
    Ok((session, end - appended))
}

pub(crate) fn begin_turn(
    conn: &Connection,
    seal: &Sealer,
    b: BeginTurn,
) -> StoreResult<BeginTurnOutcome> {
    let now = ts(&b.now);
    let sid = uuid(&b.session_id);
    let turn_id = uuid(&b.turn_id);
    if let Some(create) = &b.create {
        if create.id != b.session_id {
            return Err(conflict(ConflictKind::CreatedIdDiffers));
        }
        insert_session(conn, seal, create)?;
    }
    let current = current_status(conn, &sid)?;
    // Read in this write: a lease granted before it is seen, and none can be granted during it.
    super::holds::refuse_if_not_held(conn, &sid, &b.now)?;
    if let Some(to) = b.status {
        check_transition(current, to)?;
    }
    if let Some(idem) = &b.idempotency {
        let claimed = conn
            .prepare_cached(
                "INSERT INTO idempotency (key, session_id, turn_id, fingerprint, state, \
                 created_session, created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7) \
                 ON CONFLICT (key) DO NOTHING",
            )
            .and_then(|mut st| {
                st.execute(params![
                    idem.key,
                    sid,
                    turn_id,
                    idem.fingerprint,
                    idem_state(IdempotencyState::InProgress),
                    idem.created_session,
                    now
                ])
            })
            .map_err(db_err)?;
        if claimed == 0 {
            return Err(conflict(ConflictKind::IdempotencyKeyClaimed));
        }
    }
    if let Some(key) = &b.retry_key {
        let n = conn
            .prepare_cached(
                "UPDATE idempotency SET state = ?4, turn_id = ?3, updated_at = ?5 \
                 WHERE key = ?1 AND session_id = ?2 AND state = ?6",
            )
            .and_then(|mut st| {
                st.execute(params![
                    key,
                    sid,
                    turn_id,
                    idem_state(IdempotencyState::InProgress),
                    now,
                    idem_state(IdempotencyState::Failed)
                ])
            })
            .map_err(db_err)?;
        if n == 0 {
            return Err(conflict(ConflictKind::IdempotencyKeyNotRetryable));
        }
    }
    conn.prepare_cached(
        "INSERT INTO turns (id, session_id, state, started_at, owner) VALUES (?1, ?2, ?3, ?4, ?5)",
    )
    .and_then(|mut st| {
        st.execute(params![
            turn_id,
            sid,
            turn_state(TurnState::Running),
            now,
            b.owner
        ])
    })
    .map_err(db_err)?;
    let appended = len_i64(&b.new_messages)?;
    let (bodies, bytes) = encode_bodies(seal, &sid, &b.new_messages)?;
    let last_task = seal.seal_opt(Column::SessionLastTask, &sid, b.last_task.as_deref())?;
    // The status only when it changes: a column in the SET list costs its index (`sessions_status`)
    // a page in the commit even when the value stays the same, and a turn of a running session
    // (nearly every turn) leaves it as it is.
    let status = b.status.filter(|to| *to != current);
    let set_status = match status {
        Some(_) => "status = ?3,",
        None => "",
    };
    let (session, start) = updated_session(
        conn,
        seal,
        &format!(
            "UPDATE sessions SET message_count = message_count + ?2, {set_status} \
             last_task = COALESCE(?4, last_task), model = COALESCE(?5, model), updated_at = ?6, \
             message_bytes = message_bytes + ?7 WHERE id = ?1 RETURNING {SESSION_COLS}"
        ),
        params![
            sid,
            appended,
            status.map(SessionStatus::as_str),
            last_task,
            b.model,
            now,
            bytes
        ],
        appended,
    )?;
    insert_encoded_messages(conn, &sid, start, &b.new_messages, &bodies)?;
    // After the messages, so the snapshot covers the prompt it is about to act on.
    let pre_action_snapshot = match b.pre_action {
        Some(snap) => Some(insert_snapshot(conn, seal, &session, snap)?),
        None => None,
    };
    Ok(BeginTurnOutcome {
        session,
        pre_action_snapshot,
        new_messages: b.new_messages,
    })
}

pub(crate) fn finish_turn(
    conn: &Connection,
    seal: &Sealer,
    f: FinishTurn,
) -> StoreResult<FinishTurnOutcome> {
    let now = ts(&f.now);
    let sid = uuid(&f.session_id);
    // A pushed turn is refused like a new turn while the session is away; a turn that began
    // before the lease (none runs during one) still finishes.
    if f.turn_id.is_none() {
        super::holds::refuse_if_not_held(conn, &sid, &f.now)?;
    }
    // One update moves the counts past the new messages and the step, so the snapshots below read
    // the final values; a missing session is `NotFound` before anything else is checked.
    let appended = len_i64(&f.messages)?;
    let (bodies, bytes) = encode_bodies(seal, &sid, &f.messages)?;
    let (session, start) = updated_session(
        conn,
        seal,
        &format!(
            "UPDATE sessions SET message_count = message_count + ?2, step_count = step_count + ?3, \
             updated_at = ?4, message_bytes = message_bytes + ?5 WHERE id = ?1 \
             RETURNING {SESSION_COLS}"
        ),
        params![sid, appended, i64::from(f.count_step), now, bytes],
        appended,
    )?;
    if let Some(turn) = f.turn_id {
        let n = conn
            // 'running' is inline, not a parameter: a bound value compared with the predicate of
            // the partial index `turns_running` makes SQLite re-prepare the statement every call.
            .prepare_cached(
                "UPDATE turns SET state = ?3, finished_at = ?4 \
                 WHERE id = ?1 AND session_id = ?2 AND state = 'running'",
            )
            .and_then(|mut st| {
                st.execute(params![uuid(&turn), sid, turn_state(TurnState::Done), now])
            })
            .map_err(db_err)?;
        if n == 0 {
            return Err(conflict(ConflictKind::TurnNotRunning));
        }
    }
    insert_encoded_messages(conn, &sid, start, &f.messages, &bodies)?;
    let post_action_snapshot = match f.post_action {
        Some(snap) => Some(insert_snapshot(conn, seal, &session, snap)?),
        None => None,
    };
    let checkpoint_snapshot = match f.checkpoint {
        Some((snap, every))
            if f.count_step && every > 0 && session.step_count % u64::from(every) == 0 =>
        {
            Some(insert_snapshot(conn, seal, &session, snap)?)
        }
        _ => None,
    };
    let tether_seq = match &f.tether {
        Some(entry) if session.tether_enabled || !f.tether_only_if_enabled => {
            Some(insert_tether(conn, seal, f.session_id, entry)?)
        }
        _ => None,
    };
    if let (Some((key, status, body)), Some(fingerprint)) =
        (&f.idempotency_done, &f.idempotency_claim)
    {
        let tether = tether_seq.map(int).transpose()?;
        let body = json(body)?;
        let body = seal.seal(Column::IdempotencyResponse, key, &body)?;
        let created = conn
            .prepare_cached(
                "INSERT INTO idempotency (key, session_id, turn_id, fingerprint, state, \
                 created_session, response_status, response_body, tether_seq, created_at, \
                 updated_at) VALUES (?1, ?2, NULL, ?3, ?4, 0, ?5, ?6, ?7, ?8, ?8) \
                 ON CONFLICT (key) DO NOTHING",
            )
            .and_then(|mut st| {
                st.execute(params![
                    key,
                    sid,
                    fingerprint,
                    idem_state(IdempotencyState::Done),
                    status,
                    body,
                    tether,
                    now
                ])
            })
            .map_err(db_err)?;
        if created == 0 {
            return Err(conflict(ConflictKind::IdempotencyKeyClaimed));
        }
    } else if let Some((key, status, body)) = &f.idempotency_done {
        let body = json(body)?;
        let body = seal.seal(Column::IdempotencyResponse, key, &body)?;
        let n = conn
            .prepare_cached(
                "UPDATE idempotency SET state = ?3, response_status = ?4, response_body = ?5, \
                 updated_at = ?6 WHERE key = ?1 AND session_id = ?2",
            )
            .and_then(|mut st| {
                st.execute(params![
                    key,
                    sid,
                    idem_state(IdempotencyState::Done),
                    status,
                    body,
                    now
                ])
            })
            .map_err(db_err)?;
        if n == 0 {
            return Err(conflict(ConflictKind::IdempotencyKeyNotHeld));
        }
    }
    Ok(FinishTurnOutcome {
        session,
        tether_seq,
        post_action_snapshot,
        checkpoint_snapshot,
        first_message_seq: u64::try_from(start)
            .map_err(|_| StoreError::Backend("negative message_count".to_owned()))?,
    })
}

pub(crate) fn record_progress(
    conn: &Connection,
    seal: &Sealer,
    p: TurnProgress,
) -> StoreResult<TurnProgressOutcome> {
    let sid = uuid(&p.session_id);
    let running = conn
        .prepare_cached(
            "SELECT 1 FROM turns WHERE id = ?1 AND session_id = ?2 AND state = 'running'",
        )
        .and_then(|mut st| st.exists(params![uuid(&p.turn_id), sid]))
        .map_err(db_err)?;
    if !running {
        return Err(conflict(ConflictKind::TurnNotRunning));
    }
    let appended = len_i64(&p.messages)?;
    let (bodies, bytes) = encode_bodies(seal, &sid, &p.messages)?;
    let (session, start) = updated_session(
        conn,
        seal,
        &format!(
            "UPDATE sessions SET message_count = message_count + ?2, updated_at = ?3, \
             message_bytes = message_bytes + ?4 WHERE id = ?1 RETURNING {SESSION_COLS}"
        ),
        params![sid, appended, ts(&p.now), bytes],
        appended,
    )?;
    insert_encoded_messages(conn, &sid, start, &p.messages, &bodies)?;
    let snapshots = p
        .snapshots
        .into_iter()
        .map(|snap| insert_snapshot(conn, seal, &session, snap))
        .collect::<StoreResult<Vec<_>>>()?;
    Ok(TurnProgressOutcome {
        session,
        snapshots,
        first_message_seq: u64::try_from(start)
            .map_err(|_| StoreError::Backend("negative message_count".to_owned()))?,
    })
}

pub(crate) fn fail_turn(conn: &Connection, seal: &Sealer, f: &FailTurn) -> StoreResult<()> {
    let now = ts(&f.now);
    let sid = uuid(&f.session_id);
    let turn = get_turn(conn, seal, f.turn_id)?
        .filter(|t| t.session_id == f.session_id)
        .ok_or(StoreError::NotFound)?;
    match turn.state {
        TurnState::Done => return Err(conflict(ConflictKind::TurnFinished)),
        // Already failed (e.g. by restart recovery): keep its first error, still release the key.
        TurnState::Failed => {}
        TurnState::Running => {
            // An upstream's error text can quote the conversation.
            let error = seal.seal(Column::TurnError, &uuid(&f.turn_id), &f.error)?;
            conn.prepare_cached(
                "UPDATE turns SET state = ?2, finished_at = ?3, error = ?4 WHERE id = ?1",
            )
            .and_then(|mut st| {
                st.execute(params![
                    uuid(&f.turn_id),
                    turn_state(TurnState::Failed),
                    now,
                    error
                ])
            })
            .map_err(db_err)?;
        }
    }
    if let Some(key) = &f.idempotency_key {
        conn.prepare_cached(
            "UPDATE idempotency SET state = ?3, updated_at = ?4 \
             WHERE key = ?1 AND session_id = ?2 AND state = ?5",
        )
        .and_then(|mut st| {
            st.execute(params![
                key,
                sid,
                idem_state(IdempotencyState::Failed),
                now,
                idem_state(IdempotencyState::InProgress)
            ])
        })
        .map_err(db_err)?;
    }
    Ok(())
}

pub(crate) fn recover_interrupted_turns(
    conn: &Connection,
    seal: &Sealer,
    now: Timestamp,
) -> StoreResult<Vec<TurnRecord>> {
    let now = ts(&now);
    let turns: Vec<TurnRecord> = conn
        .prepare_cached(&format!(
            "UPDATE turns SET state = ?1, finished_at = ?2, error = ?3 \
             WHERE state = 'running' RETURNING {TURN_COLS}"
        ))
        .and_then(|mut st| {
            st.query_map(
                params![turn_state(TurnState::Failed), now, INTERRUPTED],
                |r| turn_row(r, seal),
            )?
            .collect()
        })
        .map_err(db_err)?;
    release_keys(conn, &turns, &now)?;
    Ok(turns)
}

pub(crate) fn replica_heartbeat(
    conn: &Connection,
    replica: &str,
    now: Timestamp,
) -> StoreResult<()> {
    conn.prepare_cached(
        "INSERT INTO replicas (id, heartbeat_at) VALUES (?1, ?2) \
         ON CONFLICT (id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
    )
    .and_then(|mut st| st.execute(params![replica, ts(&now)]))
    .map_err(db_err)?;
    Ok(())
}

/// [`recover_interrupted_turns`] for the running turns of no live replica: no owner, or an owner
/// without a heartbeat at or after `stale_before`.
pub(crate) fn recover_orphaned_turns(
    conn: &Connection,
    seal: &Sealer,
    now: Timestamp,
    stale_before: Timestamp,
) -> StoreResult<Vec<TurnRecord>> {
    let now = ts(&now);
    let stale_before = ts(&stale_before);
    let turns: Vec<TurnRecord> = conn
        .prepare_cached(&format!(
            "UPDATE turns SET state = ?1, finished_at = ?2, error = ?3 \
             WHERE state = 'running' AND (owner IS NULL OR NOT EXISTS \
             (SELECT 1 FROM replicas r WHERE r.id = turns.owner AND r.heartbeat_at >= ?4)) \
             RETURNING {TURN_COLS}"
        ))
        .and_then(|mut st| {
            st.query_map(
                params![
                    turn_state(TurnState::Failed),
                    now,
                    INTERRUPTED,
                    stale_before
                ],
                |r| turn_row(r, seal),
            )?
            .collect()
        })
        .map_err(db_err)?;
    release_keys(conn, &turns, &now)?;
    // A replica that is gone for good would otherwise keep its row forever. Here the update above
    // left no stale replica a running turn; the condition is PostgreSQL's, where one can begin a
    // turn in between (and is then alive after all).
    conn.prepare_cached(
        "DELETE FROM replicas WHERE heartbeat_at < ?1 AND NOT EXISTS \
         (SELECT 1 FROM turns WHERE state = 'running' AND owner = replicas.id)",
    )
    .and_then(|mut st| st.execute([stale_before]))
    .map_err(db_err)?;
    Ok(turns)
}

/// Makes the idempotency keys held by `turns`, which recovery just failed, retryable.
fn release_keys(conn: &Connection, turns: &[TurnRecord], now: &str) -> StoreResult<()> {
    // The keys those turns held would otherwise stay in progress forever and block every retry.
    let mut release = conn
        .prepare_cached(
            "UPDATE idempotency SET state = ?2, updated_at = ?3 WHERE turn_id = ?1 AND state = ?4",
        )
        .map_err(db_err)?;
    for t in turns {
        release
            .execute(params![
                uuid(&t.id),
                idem_state(IdempotencyState::Failed),
                now,
                idem_state(IdempotencyState::InProgress)
            ])
            .map_err(db_err)?;
    }
    Ok(())
}

// ---- idempotency ----

pub(crate) fn get_idempotency(
    conn: &Connection,
    seal: &Sealer,
    key: &str,
) -> StoreResult<Option<IdempotencyRecord>> {
    conn.prepare_cached(&format!(
        "SELECT {IDEMPOTENCY_COLS} FROM idempotency WHERE key = ?1"
    ))
    .and_then(|mut st| st.query_row([key], |r| idempotency_row(r, seal)).optional())
    .map_err(db_err)
}
