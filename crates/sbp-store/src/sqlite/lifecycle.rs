//! Session lifecycle on SQLite: listing sessions page by page, and erasing one with everything
//! that holds its content. Plain synchronous functions like `ops`; the erasure runs as one job of
//! the writer (one savepoint of its transaction), and the store truncates the WAL after it
//! (`SqliteStore::delete_session`), so no earlier page holding the content stays in a file.

use rusqlite::types::Value;
use rusqlite::{Connection, OptionalExtension, params_from_iter};
use uuid::Uuid;

use super::codec::{SESSION_COLS, col_opt_ts, db_err, session_row, ts, uuid};
use crate::federation::hold_refuses_writes;
use crate::seal::Sealer;
use crate::{
    ConflictKind, HoldState, SessionQuery, SessionRecord, StoreError, StoreResult, Timestamp,
};

/// The page `q` asks for. The statement is built from the filters present, so each combination
/// has a plain one its index serves (a `? IS NULL OR ...` term would hide the index from a plan
/// that must serve every binding).
pub(crate) fn list_sessions(
    conn: &Connection,
    seal: &Sealer,
    q: &SessionQuery,
) -> StoreResult<Vec<SessionRecord>> {
    let mut terms = Vec::new();
    let mut args: Vec<Value> = Vec::new();
    if let Some(agent) = &q.agent_id {
        args.push(Value::Text(agent.clone()));
        terms.push(format!("agent_id = ?{}", args.len()));
    }
    if let Some(status) = q.status {
        args.push(Value::Text(status.as_str().to_owned()));
        terms.push(format!("status = ?{}", args.len()));
    }
    if let Some((created, id)) = &q.after {
        args.push(Value::Text(ts(created)));
        args.push(Value::Text(uuid(id)));
        let n = args.len();
        terms.push(format!("(created_at, id) < (?{}, ?{n})", n - 1));
    }
    let filter = if terms.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", terms.join(" AND "))
    };
    args.push(Value::Integer(i64::from(q.limit)));
    let sql = format!(
        "SELECT {SESSION_COLS} FROM sessions {filter} ORDER BY created_at DESC, id DESC LIMIT ?{}",
        args.len()
    );
    conn.prepare_cached(&sql)
        .and_then(|mut st| {
            st.query_map(params_from_iter(args), |r| session_row(r, seal))?
                .collect()
        })
        .map_err(db_err)
}

/// `NotFound` unless the session is stored here.
pub(crate) fn require_session(conn: &Connection, sid: &str) -> StoreResult<()> {
    let found = conn
        .prepare_cached("SELECT 1 FROM sessions WHERE id = ?1")
        .and_then(|mut st| st.exists([sid]))
        .map_err(db_err)?;
    if found {
        Ok(())
    } else {
        Err(StoreError::NotFound)
    }
}

fn execute(conn: &Connection, sql: &str, p: impl rusqlite::Params) -> StoreResult<usize> {
    conn.prepare_cached(sql)
        .and_then(|mut st| st.execute(p))
        .map_err(db_err)
}

/// [`crate::SessionStore::delete_session`] inside the writer's transaction. The writer's
/// connection has `secure_delete` on, so every cell and page this frees is zeroed, not left in
/// the file's free space.
pub(crate) fn delete_session(conn: &Connection, id: Uuid, now: &Timestamp) -> StoreResult<()> {
    let sid = uuid(&id);
    require_session(conn, &sid)?;
    let hold: Option<(String, Option<Timestamp>)> = conn
        .prepare_cached("SELECT state, lease_expires_at FROM session_holds WHERE session_id = ?1")
        .and_then(|mut st| {
            st.query_row([&sid], |r| Ok((r.get(0)?, col_opt_ts(r, 1)?)))
                .optional()
        })
        .map_err(db_err)?;
    if let Some((state, until)) = hold {
        let state = HoldState::parse(&state)
            .ok_or_else(|| StoreError::Backend(format!("hold state {state:?}")))?;
        // A move in progress must finish (or fail) first; a copy left by a move away may go.
        if hold_refuses_writes(state, until, *now) == Some(ConflictKind::SessionMoving) {
            return Err(StoreError::Conflict(ConflictKind::SessionMoving));
        }
    }
    // Its own exports' bundles and those it came in with; which of them go is decided once the
    // rows that refer to them are gone.
    let cids: Vec<String> = conn
        .prepare_cached(
            "SELECT bundle_cid FROM exports WHERE session_id = ?1 AND foreign_origin = 0 \
             UNION SELECT bundle_cid FROM session_bundles WHERE session_id = ?1",
        )
        .and_then(|mut st| st.query_map([&sid], |r| r.get(0))?.collect())
        .map_err(db_err)?;
    execute(
        conn,
        "DELETE FROM exports WHERE session_id = ?1 AND foreign_origin = 0",
        [&sid],
    )?;
    execute(
        conn,
        "UPDATE exports SET label = NULL WHERE import_session_id = ?1 AND foreign_origin = 1",
        [&sid],
    )?;
    execute(
        conn,
        "UPDATE lineage SET label = NULL, reason = NULL WHERE from_session = ?1 OR to_session = ?1",
        [&sid],
    )?;
    // Messages, tether, turns, idempotency records, memory, the hold and the record of the bundles
    // it came in with go with the row (ON DELETE CASCADE); snapshots along their chain first.
    super::ops::delete_snapshots(conn, &sid)?;
    execute(conn, "DELETE FROM sessions WHERE id = ?1", [&sid])?;
    for cid in cids {
        // Kept while an export of another session refers to it (a consumed foreign export of this
        // one is only a record now), or another session came in with the same bundle.
        let gone = execute(
            conn,
            "DELETE FROM bundles WHERE cid = ?1 \
             AND NOT EXISTS (SELECT 1 FROM exports e WHERE e.bundle_cid = ?1 \
                 AND NOT (e.foreign_origin = 1 AND e.import_session_id IS ?2)) \
             AND NOT EXISTS (SELECT 1 FROM session_bundles b WHERE b.bundle_cid = ?1)",
            [&cid, &sid],
        )?;
        if gone > 0 {
            execute(
                conn,
                "DELETE FROM announcements WHERE bundle_cid = ?1",
                [&cid],
            )?;
        }
    }
    Ok(())
}
