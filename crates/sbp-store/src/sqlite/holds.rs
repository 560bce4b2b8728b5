//! Session holds on SQLite (L6): where a session is held while it moves between gateways, the
//! origin's lease and commit, the target's adoption and finish, and the guard `begin_turn` and a
//! pushed turn apply. Each write is one job of the single writer, so a check and the write it
//! decides are never separated by another write.

use std::sync::Arc;

use async_trait::async_trait;
use rusqlite::{Connection, OptionalExtension, Row, params};
use uuid::Uuid;

use super::SqliteStore;
use super::codec::{bad, col_opt_ts, col_ts, col_u64, col_uuid, db_err, int, ts, uuid};
use super::roaming;
use crate::federation::hold_refuses_writes;
use crate::seal::{Column, Sealer};
use crate::{
    AdoptMigrated, ConflictKind, HoldRow, HoldState, HoldStore, LeaseRequest, LinkKind, LinkRecord,
    NewTetherEntry, SessionRecord, StoreError, StoreResult, Timestamp,
};

const HOLD_COLS: &str = "session_id, epoch, state, peer_gateway, peer_url, migration_id, \
    lease_expires_at, updated_at";

fn hold_row(row: &Row<'_>) -> rusqlite::Result<HoldRow> {
    let state: String = row.get(2)?;
    let migration_id = match row.get::<_, Option<String>>(5)? {
        None => None,
        Some(_) => Some(col_uuid(row, 5)?),
    };
    Ok(HoldRow {
        session_id: col_uuid(row, 0)?,
        epoch: col_u64(row, 1)?,
        state: HoldState::parse(&state).ok_or_else(|| bad(2, format!("hold state {state:?}")))?,
        peer_gateway: row.get(3)?,
        peer_url: row.get(4)?,
        migration_id,
        lease_expires_at: col_opt_ts(row, 6)?,
        updated_at: col_ts(row, 7)?,
    })
}

fn conflict(kind: ConflictKind) -> StoreError {
    StoreError::Conflict(kind)
}

fn hold(conn: &Connection, session: Uuid) -> StoreResult<Option<HoldRow>> {
    conn.prepare_cached(&format!(
        "SELECT {HOLD_COLS} FROM session_holds WHERE session_id = ?1"
    ))
    .and_then(|mut st| st.query_row([uuid(&session)], hold_row).optional())
    .map_err(db_err)
}

/// Inside the write of a turn or a pushed turn: refuses a session that is leased (unexpired),
/// arriving, or moved away ([`hold_refuses_writes`]).
pub(crate) fn refuse_if_not_held(conn: &Connection, sid: &str, now: &Timestamp) -> StoreResult<()> {
    let found: Option<(String, Option<Timestamp>)> = conn
        .prepare_cached("SELECT state, lease_expires_at FROM session_holds WHERE session_id = ?1")
        .and_then(|mut st| {
            st.query_row([sid], |r| {
                let state: String = r.get(0)?;
                Ok((state, col_opt_ts(r, 1)?))
            })
            .optional()
        })
        .map_err(db_err)?;
    let Some((state, until)) = found else {
        return Ok(());
    };
    let state = HoldState::parse(&state)
        .ok_or_else(|| StoreError::Backend(format!("hold state {state:?}")))?;
    match hold_refuses_writes(state, until, *now) {
        Some(kind) => Err(conflict(kind)),
        None => Ok(()),
    }
}

/// The session's agent, `NotFound` without the session.
fn agent_of(conn: &Connection, sid: &str) -> StoreResult<String> {
    conn.prepare_cached("SELECT agent_id FROM sessions WHERE id = ?1")
        .and_then(|mut st| st.query_row([sid], |r| r.get(0)).optional())
        .map_err(db_err)?
        .ok_or(StoreError::NotFound)
}

fn lease_handover(conn: &Connection, r: &LeaseRequest) -> StoreResult<HoldRow> {
    let sid = uuid(&r.session_id);
    agent_of(conn, &sid)?;
    let current = hold(conn, r.session_id)?;
    if let Some(h) = &current {
        let unexpired = h.lease_expires_at.is_some_and(|until| until > r.now);
        match h.state {
            HoldState::Leased if unexpired => {
                let retry = h.migration_id == Some(r.migration_id)
                    && h.peer_gateway.as_deref() == Some(r.to_gateway.as_str());
                return if retry {
                    Ok(h.clone())
                } else {
                    Err(conflict(ConflictKind::SessionMoving))
                };
            }
            HoldState::Leased | HoldState::Home => {}
            HoldState::Incoming => return Err(conflict(ConflictKind::SessionMoving)),
            HoldState::Moved => return Err(conflict(ConflictKind::SessionMoved)),
        }
    }
    let running = conn
        .prepare_cached("SELECT 1 FROM turns WHERE session_id = ?1 AND state = 'running'")
        .and_then(|mut st| st.exists([&sid]))
        .map_err(db_err)?;
    if running {
        return Err(conflict(ConflictKind::SessionBusy));
    }
    let epoch = int(current.map_or(0, |h| h.epoch) + 1)?;
    conn.prepare_cached(&format!(
        "INSERT INTO session_holds ({HOLD_COLS}) VALUES (?1, ?2, 'leased', ?3, ?4, ?5, ?6, ?7) \
         ON CONFLICT (session_id) DO UPDATE SET epoch = excluded.epoch, state = excluded.state, \
         peer_gateway = excluded.peer_gateway, peer_url = excluded.peer_url, \
         migration_id = excluded.migration_id, lease_expires_at = excluded.lease_expires_at, \
         updated_at = excluded.updated_at RETURNING {HOLD_COLS}"
    ))
    .and_then(|mut st| {
        st.query_row(
            params![
                sid,
                epoch,
                r.to_gateway,
                r.to_url,
                uuid(&r.migration_id),
                ts(&r.until),
                ts(&r.now)
            ],
            hold_row,
        )
    })
    .map_err(db_err)
}

/// A `migrated_to` / `migrated_from` link of `session`: its id is the migration's, the session is
/// both ends.
fn move_link(
    kind: LinkKind,
    session: Uuid,
    agent: String,
    migration_id: Uuid,
    peer: Option<String>,
    now: Timestamp,
) -> LinkRecord {
    LinkRecord {
        id: migration_id,
        kind,
        from_session: Some(session),
        to_session: session,
        from_agent: Some(agent.clone()),
        to_agent: Some(agent),
        export_id: None,
        label: None,
        reason: None,
        fork_point: None,
        reused: false,
        created_at: now,
        peer_gateway: peer,
    }
}

fn commit_handover(
    conn: &Connection,
    seal: &Sealer,
    session: Uuid,
    migration_id: Uuid,
    by: &str,
    now: &Timestamp,
) -> StoreResult<HoldRow> {
    let sid = uuid(&session);
    let agent = agent_of(conn, &sid)?;
    let ours =
        |h: &HoldRow| h.migration_id == Some(migration_id) && h.peer_gateway.as_deref() == Some(by);
    match hold(conn, session)? {
        Some(h) if h.state == HoldState::Moved && ours(&h) => return Ok(h),
        Some(h)
            if h.state == HoldState::Leased
                && ours(&h)
                && h.lease_expires_at.is_some_and(|until| until > *now) => {}
        _ => return Err(conflict(ConflictKind::LeaseExpired)),
    }
    let moved = conn
        .prepare_cached(&format!(
            "UPDATE session_holds SET state = 'moved', lease_expires_at = NULL, updated_at = ?2 \
             WHERE session_id = ?1 RETURNING {HOLD_COLS}"
        ))
        .and_then(|mut st| st.query_row(params![sid, ts(now)], hold_row))
        .map_err(db_err)?;
    conn.prepare_cached("DELETE FROM tether WHERE session_id = ?1")
        .and_then(|mut st| st.execute([&sid]))
        .map_err(db_err)?;
    let link = move_link(
        LinkKind::MigratedTo,
        session,
        agent,
        migration_id,
        Some(by.to_owned()),
        *now,
    );
    roaming::insert_link(conn, seal, &link)?;
    Ok(moved)
}

fn expire_leases(conn: &Connection, now: &Timestamp) -> StoreResult<u64> {
    conn.prepare_cached(
        "UPDATE session_holds SET state = 'home', peer_gateway = NULL, peer_url = NULL, \
         migration_id = NULL, lease_expires_at = NULL, updated_at = ?1 \
         WHERE state = 'leased' AND lease_expires_at <= ?1",
    )
    .and_then(|mut st| st.execute([ts(now)]))
    .map(|n| n as u64)
    .map_err(db_err)
}

fn release_lease(
    conn: &Connection,
    session: Uuid,
    migration_id: Uuid,
    by: &str,
    now: &Timestamp,
) -> StoreResult<bool> {
    conn.prepare_cached(
        "UPDATE session_holds SET state = 'home', peer_gateway = NULL, peer_url = NULL, \
         migration_id = NULL, lease_expires_at = NULL, updated_at = ?4 \
         WHERE session_id = ?1 AND state = 'leased' AND migration_id = ?2 AND peer_gateway = ?3",
    )
    .and_then(|mut st| st.execute(params![uuid(&session), uuid(&migration_id), by, ts(now)]))
    .map(|n| n == 1)
    .map_err(db_err)
}

fn delete_session(conn: &Connection, sid: &str) -> StoreResult<()> {
    // Messages, tether, turns, idempotency records, memory and the hold go with it (ON DELETE
    // CASCADE), snapshots along their chain first; lineage and exports name sessions without a
    // key and stay.
    super::ops::delete_snapshots(conn, sid)?;
    conn.prepare_cached("DELETE FROM sessions WHERE id = ?1")
        .and_then(|mut st| st.execute([sid]))
        .map_err(db_err)?;
    Ok(())
}

fn insert_carried_tether(
    conn: &Connection,
    seal: &Sealer,
    sid: &str,
    seq: u64,
    e: &NewTetherEntry,
) -> StoreResult<()> {
    let content = seal.seal_opt(Column::TetherContent, sid, e.content.as_deref())?;
    let seq = int(seq)?;
    conn.prepare_cached(
        "INSERT INTO tether (session_id, seq, role, content, model_used, created_at, chunk_id) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )
    .and_then(|mut st| {
        st.execute(params![
            sid,
            seq,
            e.role,
            content,
            e.model_used,
            ts(&e.created_at),
            uuid(&e.chunk_id)
        ])
    })
    .map_err(db_err)?;
    Ok(())
}

/// `encoded`: the messages' bodies as stored, encoded ahead of the write, or `None`.
fn adopt_migrated(
    conn: &Connection,
    seal: &Sealer,
    m: &AdoptMigrated,
    encoded: Option<&crate::codec::Encoded>,
) -> StoreResult<SessionRecord> {
    let id = m.adopt.session.id;
    let sid = uuid(&id);
    if agent_of(conn, &sid).is_ok() {
        match hold(conn, id)? {
            Some(h) if h.state == HoldState::Moved => delete_session(conn, &sid)?,
            _ => {
                return Err(conflict(ConflictKind::Duplicate(format!(
                    "session {id} is held here"
                ))));
            }
        }
    }
    let session = roaming::adopt_session(conn, seal, &m.adopt, encoded)?;
    for (seq, entry) in &m.tether {
        insert_carried_tether(conn, seal, &sid, *seq, entry)?;
    }
    // Past every carried seq whatever the origin said, so a seq is never issued twice.
    let highest = m.tether.iter().map(|(seq, _)| *seq).max().unwrap_or(0);
    let next = int(m.tether_next_seq.max(highest + 1))?;
    conn.prepare_cached("UPDATE sessions SET tether_seq = ?2 WHERE id = ?1")
        .and_then(|mut st| st.execute(params![sid, next]))
        .map_err(db_err)?;
    let epoch = int(m.epoch)?;
    conn.prepare_cached(&format!(
        "INSERT INTO session_holds ({HOLD_COLS}) VALUES (?1, ?2, 'incoming', ?3, ?4, ?5, NULL, ?6)"
    ))
    .and_then(|mut st| {
        st.execute(params![
            sid,
            epoch,
            m.from_gateway,
            m.from_url,
            uuid(&m.migration_id),
            ts(&m.adopt.now)
        ])
    })
    .map_err(db_err)?;
    Ok(session)
}

fn finish_incoming(
    conn: &Connection,
    seal: &Sealer,
    session: Uuid,
    migration_id: Uuid,
    ok: bool,
    now: &Timestamp,
) -> StoreResult<()> {
    let sid = uuid(&session);
    let found = hold(conn, session)?;
    let this_move = |state: HoldState| {
        found
            .as_ref()
            .is_some_and(|h| h.state == state && h.migration_id == Some(migration_id))
    };
    if !ok {
        if this_move(HoldState::Incoming) {
            delete_session(conn, &sid)?;
        }
        return Ok(());
    }
    if this_move(HoldState::Home) {
        return Ok(());
    }
    let agent = agent_of(conn, &sid)?;
    if !this_move(HoldState::Incoming) {
        return Err(conflict(ConflictKind::LeaseExpired));
    }
    let origin = found.and_then(|h| h.peer_gateway);
    conn.prepare_cached(
        "UPDATE session_holds SET state = 'home', peer_gateway = NULL, peer_url = NULL, \
         lease_expires_at = NULL, updated_at = ?2 WHERE session_id = ?1",
    )
    .and_then(|mut st| st.execute(params![sid, ts(now)]))
    .map_err(db_err)?;
    let link = move_link(
        LinkKind::MigratedFrom,
        session,
        agent,
        migration_id,
        origin,
        *now,
    );
    roaming::insert_link(conn, seal, &link)
}

fn incoming_holds(conn: &Connection) -> StoreResult<Vec<HoldRow>> {
    conn.prepare_cached(&format!(
        "SELECT {HOLD_COLS} FROM session_holds WHERE state = 'incoming' \
         ORDER BY updated_at, session_id"
    ))
    .and_then(|mut st| st.query_map([], hold_row)?.collect())
    .map_err(db_err)
}

#[async_trait]
impl HoldStore for SqliteStore {
    async fn hold(&self, session_id: Uuid) -> StoreResult<Option<HoldRow>> {
        self.read_point(move |c, _| hold(c, session_id)).await
    }

    async fn lease_handover(&self, req: LeaseRequest) -> StoreResult<HoldRow> {
        self.write(move |c, _| lease_handover(c, &req)).await
    }

    async fn commit_handover(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        by_gateway: &str,
        now: Timestamp,
    ) -> StoreResult<HoldRow> {
        let by = by_gateway.to_owned();
        self.write(move |c, s| commit_handover(c, s, session_id, migration_id, &by, &now))
            .await
    }

    async fn expire_leases(&self, now: Timestamp) -> StoreResult<u64> {
        self.write(move |c, _| expire_leases(c, &now)).await
    }

    async fn release_lease(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        by_gateway: &str,
        now: Timestamp,
    ) -> StoreResult<bool> {
        let by = by_gateway.to_owned();
        self.write(move |c, _| release_lease(c, session_id, migration_id, &by, &now))
            .await
    }

    async fn adopt_migrated(&self, m: AdoptMigrated) -> StoreResult<SessionRecord> {
        let m = Arc::new(m);
        let encoded = crate::codec::encode_ahead(
            &self.inner.seal,
            &m,
            |m: &AdoptMigrated| &m.adopt.messages,
            m.adopt.session.id,
        )
        .await?;
        self.write(move |c, s| adopt_migrated(c, s, &m, encoded.as_ref()))
            .await
    }

    async fn finish_incoming(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        ok: bool,
        now: Timestamp,
    ) -> StoreResult<()> {
        self.write(move |c, s| finish_incoming(c, s, session_id, migration_id, ok, &now))
            .await
    }

    async fn incoming_holds(&self) -> StoreResult<Vec<HoldRow>> {
        self.read(|c, _| incoming_holds(c)).await
    }
}
