//! Session lifecycle on PostgreSQL: listing sessions page by page, and erasing one with everything
//! that holds its content in one transaction that takes the session row's lock first, so a turn,
//! an export or a memory write of the session either commits before it or finds no session.

use deadpool_postgres::GenericClient;
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use super::codec::{db_err, get, rows, session_cols, session_row, text};
use super::holds::{HOLD_GUARD, guard_refusal};
use super::ops::{Tx, prep};
use crate::seal::Sealer;
use crate::{ConflictKind, SessionQuery, SessionRecord, StoreError, StoreResult, Timestamp};

/// The page `q` asks for. The statement is built from the filters present, so each combination
/// has a plain one its index serves under the generic plans this store forces.
pub(crate) async fn list_sessions(
    c: &impl GenericClient,
    seal: &Sealer,
    q: &SessionQuery,
) -> StoreResult<Vec<SessionRecord>> {
    let agent = q.agent_id.as_deref().map(text);
    let status = q.status.map(|s| s.as_str());
    let limit = i64::from(q.limit);
    let mut terms = Vec::new();
    let mut args: Vec<&(dyn ToSql + Sync)> = Vec::new();
    if let Some(agent) = &agent {
        args.push(agent);
        terms.push(format!("agent_id = ${}", args.len()));
    }
    if let Some(status) = &status {
        args.push(status);
        terms.push(format!("status = ${}", args.len()));
    }
    if let Some((created, id)) = &q.after {
        args.push(created);
        args.push(id);
        let n = args.len();
        terms.push(format!("(created_at, id) < (${}, ${n})", n - 1));
    }
    let filter = if terms.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", terms.join(" AND "))
    };
    args.push(&limit);
    let sql = format!(
        concat!(
            "SELECT ",
            session_cols!(),
            " FROM sessions {} ORDER BY created_at DESC, id DESC LIMIT ${}"
        ),
        filter,
        args.len()
    );
    let st = prep(c, &sql).await?;
    let found = c.query(&st, &args).await.map_err(db_err)?;
    rows(&found, |r| session_row(r, seal))
}

/// `NotFound` unless the session is stored here; holds a share lock on its row until the
/// transaction ends, so the session cannot be erased in between.
pub(crate) async fn lock_session_shared(tx: &Tx, id: Uuid) -> StoreResult<()> {
    let st = prep(tx, "SELECT 1 FROM sessions WHERE id = $1 FOR KEY SHARE").await?;
    match tx.query_opt(&st, &[&id]).await.map_err(db_err)? {
        Some(_) => Ok(()),
        None => Err(StoreError::NotFound),
    }
}

/// [`crate::SessionStore::delete_session`] inside one transaction.
pub(crate) async fn delete_session(tx: &Tx, id: Uuid, now: Timestamp) -> StoreResult<()> {
    let st = prep(tx, "SELECT 1 FROM sessions WHERE id = $1 FOR UPDATE").await?;
    if tx.query_opt(&st, &[&id]).await.map_err(db_err)?.is_none() {
        return Err(StoreError::NotFound);
    }
    // After the lock, in a statement of its own (READ COMMITTED): a lease granted before it is
    // seen, and none can be granted until this transaction ends.
    let st = prep(tx, HOLD_GUARD).await?;
    let hold = tx.query(&st, &[&id]).await.map_err(db_err)?;
    // A move in progress must finish (or fail) first; a copy left by a move away may go.
    if guard_refusal(&hold, now)? == Some(ConflictKind::SessionMoving) {
        return Err(StoreError::Conflict(ConflictKind::SessionMoving));
    }
    // Its own exports' bundles and those it came in with; which of them go is decided once the
    // rows that refer to them are gone.
    let st = prep(
        tx,
        "SELECT bundle_cid FROM exports WHERE session_id = $1 AND NOT foreign_origin \
         UNION SELECT bundle_cid FROM session_bundles WHERE session_id = $1",
    )
    .await?;
    let found = tx.query(&st, &[&id]).await.map_err(db_err)?;
    let cids: Vec<String> = rows(&found, |r| get(r, 0))?;
    for sql in [
        "DELETE FROM exports WHERE session_id = $1 AND NOT foreign_origin",
        "UPDATE exports SET label = NULL WHERE import_session_id = $1 AND foreign_origin",
        "UPDATE lineage SET label = NULL, reason = NULL WHERE from_session = $1 OR to_session = $1",
        // Messages, snapshots, tether, turns, idempotency records, memory, the hold and the
        // record of the bundles it came in with go with the row (ON DELETE CASCADE).
        "DELETE FROM sessions WHERE id = $1",
    ] {
        let st = prep(tx, sql).await?;
        tx.execute(&st, &[&id]).await.map_err(db_err)?;
    }
    if cids.is_empty() {
        return Ok(());
    }
    // Kept while an export of another session refers to it (a consumed foreign export of this
    // one is only a record now), or another session came in with the same bundle.
    let st = prep(
        tx,
        "DELETE FROM bundles b WHERE b.cid = ANY($1) \
         AND NOT EXISTS (SELECT 1 FROM exports e WHERE e.bundle_cid = b.cid \
             AND NOT (e.foreign_origin AND e.import_session_id IS NOT DISTINCT FROM $2)) \
         AND NOT EXISTS (SELECT 1 FROM session_bundles s WHERE s.bundle_cid = b.cid) \
         RETURNING b.cid",
    )
    .await?;
    let gone = tx.query(&st, &[&cids, &id]).await.map_err(db_err)?;
    let gone: Vec<String> = rows(&gone, |r| get(r, 0))?;
    if !gone.is_empty() {
        let st = prep(tx, "DELETE FROM announcements WHERE bundle_cid = ANY($1)").await?;
        tx.execute(&st, &[&gone]).await.map_err(db_err)?;
    }
    Ok(())
}
