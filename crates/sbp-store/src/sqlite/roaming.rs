//! L3 roaming on SQLite: bundles, exports, adopted sessions, lineage links and session memory. Like
//! `ops`, plain synchronous functions; writes run inside the writer's per-job savepoint.

use rusqlite::{Connection, OptionalExtension, Row, params};
use sbp_protocol::SessionStatus;
use uuid::Uuid;

use super::codec::{
    SESSION_COLS, bad, col_open, col_opt_ts, col_sealed_json, col_ts, col_u64, col_uuid, db_err,
    int, json, sealed, session_row, ts, uuid,
};
use super::ops::{
    check_transition, current_status, encode_bodies, insert_encoded_messages, insert_session,
    len_i64, write_snapshot,
};
use crate::seal::{Column, Sealer};
use crate::{
    AdoptOutcome, AdoptSession, ExportRecord, Lineage, LinkKind, LinkRecord, MemoryRecord,
    NewBundle, NewExport, RedeemOutcome, StoreError, StoreResult, Sweep, Swept, Timestamp,
};

const EXPORT_COLS: &str = "id, session_id, bundle_cid, label, message_count, created_at, \
    expires_at, foreign_origin, imported_at, import_session_id";

fn col_opt_uuid(row: &Row<'_>, idx: usize) -> rusqlite::Result<Option<Uuid>> {
    match row.get::<_, Option<String>>(idx)? {
        None => Ok(None),
        Some(_) => col_uuid(row, idx).map(Some),
    }
}

fn export_row(row: &Row<'_>, seal: &Sealer) -> rusqlite::Result<ExportRecord> {
    let id = col_uuid(row, 0)?;
    Ok(ExportRecord {
        id,
        session_id: col_uuid(row, 1)?,
        bundle_cid: row.get(2)?,
        label: col_open(row, 3, seal, Column::ExportLabel, &uuid(&id))?,
        message_count: col_u64(row, 4)?,
        created_at: col_ts(row, 5)?,
        expires_at: col_ts(row, 6)?,
        foreign: row.get(7)?,
        imported_at: col_opt_ts(row, 8)?,
        import_session_id: col_opt_uuid(row, 9)?,
    })
}

const LINK_COLS: &str = "id, kind, from_session, to_session, from_agent, to_agent, export_id, \
    label, reason, fork_point, reused, created_at, peer_gateway";

fn link_row(row: &Row<'_>, seal: &Sealer) -> rusqlite::Result<LinkRecord> {
    let id = col_uuid(row, 0)?;
    let key = uuid(&id);
    let kind: String = row.get(1)?;
    let fork_point = match row.get::<_, Option<i64>>(9)? {
        None => None,
        Some(_) => Some(col_u64(row, 9)?),
    };
    Ok(LinkRecord {
        id,
        kind: LinkKind::parse(&kind).ok_or_else(|| bad(1, format!("link kind {kind:?}")))?,
        from_session: col_opt_uuid(row, 2)?,
        to_session: col_uuid(row, 3)?,
        from_agent: row.get(4)?,
        to_agent: row.get(5)?,
        export_id: col_opt_uuid(row, 6)?,
        label: col_open(row, 7, seal, Column::LinkLabel, &key)?,
        reason: col_open(row, 8, seal, Column::LinkReason, &key)?,
        fork_point,
        reused: row.get(10)?,
        created_at: col_ts(row, 11)?,
        peer_gateway: row.get(12)?,
    })
}

fn insert_bundle(
    conn: &Connection,
    seal: &Sealer,
    bundle: &NewBundle,
    now: &Timestamp,
) -> StoreResult<()> {
    // The CID stays the digest of the plaintext: the bundle is sealed after it was computed.
    let body = seal.seal_bytes(Column::BundleBody, &bundle.cid, &bundle.bytes)?;
    // Content-addressed: an equal CID means equal content, so an existing row is kept as it is.
    conn.prepare_cached(
        "INSERT INTO bundles (cid, body, created_at) VALUES (?1, ?2, ?3) \
         ON CONFLICT (cid) DO NOTHING",
    )
    .and_then(|mut st| st.execute(params![bundle.cid, body, ts(now)]))
    .map_err(db_err)?;
    Ok(())
}

/// Inserts the export unless one with its id exists; returns whether it inserted.
fn insert_export(conn: &Connection, seal: &Sealer, e: &NewExport) -> StoreResult<bool> {
    let message_count = int(e.message_count)?;
    let label = seal.seal_opt(Column::ExportLabel, &uuid(&e.id), e.label.as_deref())?;
    conn.prepare_cached(
        "INSERT INTO exports (id, session_id, bundle_cid, label, message_count, created_at, \
         expires_at, foreign_origin) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
         ON CONFLICT (id) DO NOTHING",
    )
    .and_then(|mut st| {
        st.execute(params![
            uuid(&e.id),
            uuid(&e.session_id),
            e.bundle_cid,
            label,
            message_count,
            ts(&e.created_at),
            ts(&e.expires_at),
            e.foreign,
        ])
    })
    .map(|inserted| inserted == 1)
    .map_err(db_err)
}

pub(crate) fn create_export(
    conn: &Connection,
    seal: &Sealer,
    export: &NewExport,
    bundle: &NewBundle,
) -> StoreResult<()> {
    // In the same write as the rows, so an export racing the session's erasure stores nothing.
    super::lifecycle::require_session(conn, &uuid(&export.session_id))?;
    insert_bundle(conn, seal, bundle, &export.created_at)?;
    if insert_export(conn, seal, export)? {
        Ok(())
    } else {
        Err(StoreError::Conflict(crate::ConflictKind::Duplicate(
            format!("export {} exists", export.id),
        )))
    }
}

pub(crate) fn get_export(
    conn: &Connection,
    seal: &Sealer,
    id: Uuid,
) -> StoreResult<Option<ExportRecord>> {
    conn.prepare_cached(&format!("SELECT {EXPORT_COLS} FROM exports WHERE id = ?1"))
        .and_then(|mut st| {
            st.query_row([uuid(&id)], |r| export_row(r, seal))
                .optional()
        })
        .map_err(db_err)
}

pub(crate) fn get_bundle(
    conn: &Connection,
    seal: &Sealer,
    cid: &str,
) -> StoreResult<Option<Vec<u8>>> {
    conn.prepare_cached("SELECT body FROM bundles WHERE cid = ?1")
        .and_then(|mut st| {
            st.query_row([cid], |r| {
                seal.open_bytes(Column::BundleBody, cid, r.get(0)?)
                    .map_err(sealed)
            })
            .optional()
        })
        .map_err(db_err)
}

pub(crate) fn redeem_export(
    conn: &Connection,
    id: Uuid,
    by: &str,
    now: &Timestamp,
    retry_after: &Timestamp,
) -> StoreResult<RedeemOutcome> {
    let changed = conn
        .prepare_cached(
            "UPDATE exports SET imported_at = ?2, redeemed_by = ?3 \
             WHERE id = ?1 AND imported_at IS NULL",
        )
        .and_then(|mut st| st.execute(params![uuid(&id), ts(now), by]))
        .map_err(db_err)?;
    if changed == 1 {
        return Ok(RedeemOutcome::Redeemed);
    }
    let row = conn
        .prepare_cached("SELECT imported_at, redeemed_by FROM exports WHERE id = ?1")
        .and_then(|mut st| {
            st.query_row(params![uuid(&id)], |r| {
                Ok((col_opt_ts(r, 0)?, r.get::<_, Option<String>>(1)?))
            })
            .optional()
        })
        .map_err(db_err)?;
    match row {
        None => Err(StoreError::NotFound),
        Some((Some(at), Some(peer))) if peer == by && at >= *retry_after => {
            Ok(RedeemOutcome::AlreadyByThisPeer)
        }
        Some(_) => Ok(RedeemOutcome::Consumed),
    }
}

fn consume_export(
    conn: &Connection,
    seal: &Sealer,
    export: Uuid,
    by: Uuid,
    now: &Timestamp,
) -> StoreResult<()> {
    let changed = conn
        .prepare_cached(
            "UPDATE exports SET imported_at = ?2, import_session_id = ?3 \
             WHERE id = ?1 AND imported_at IS NULL",
        )
        .and_then(|mut st| st.execute(params![uuid(&export), ts(now), uuid(&by)]))
        .map_err(db_err)?;
    if changed == 1 {
        return Ok(());
    }
    match get_export(conn, seal, export)? {
        Some(_) => Err(StoreError::Consumed),
        None => Err(StoreError::NotFound),
    }
}

pub(crate) fn insert_link(conn: &Connection, seal: &Sealer, l: &LinkRecord) -> StoreResult<()> {
    let fork_point = l.fork_point.map(int).transpose()?;
    let key = uuid(&l.id);
    let label = seal.seal_opt(Column::LinkLabel, &key, l.label.as_deref())?;
    let reason = seal.seal_opt(Column::LinkReason, &key, l.reason.as_deref())?;
    conn.prepare_cached(
        "INSERT INTO lineage (id, kind, from_session, to_session, from_agent, to_agent, export_id, \
         label, reason, fork_point, reused, created_at, peer_gateway) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
    )
    .and_then(|mut st| {
        st.execute(params![
            uuid(&l.id),
            l.kind.as_str(),
            l.from_session.as_ref().map(uuid),
            uuid(&l.to_session),
            l.from_agent,
            l.to_agent,
            l.export_id.as_ref().map(uuid),
            label,
            reason,
            fork_point,
            l.reused,
            ts(&l.created_at),
            l.peer_gateway,
        ])
    })
    .map_err(db_err)?;
    Ok(())
}

fn upsert_memory(
    conn: &Connection,
    seal: &Sealer,
    session: Uuid,
    schema_id: &str,
    payload: &serde_json::Value,
    now: &Timestamp,
) -> StoreResult<()> {
    let payload = json(payload)?;
    let payload = seal.seal(Column::MemoryPayload, &uuid(&session), &payload)?;
    conn.prepare_cached(
        "INSERT INTO session_memory (session_id, schema_id, payload, updated_at) \
         VALUES (?1, ?2, ?3, ?4) ON CONFLICT (session_id) DO UPDATE SET \
         schema_id = excluded.schema_id, payload = excluded.payload, updated_at = excluded.updated_at",
    )
    .and_then(|mut st| {
        st.execute(params![uuid(&session), schema_id, payload, ts(now)])
    })
    .map_err(db_err)?;
    Ok(())
}

/// `encoded`: the messages' bodies as stored and their plaintext size ([`encode_bodies`]),
/// encoded ahead of the write, or `None`.
pub(crate) fn adopt_session(
    conn: &Connection,
    seal: &Sealer,
    a: &AdoptSession,
    encoded: Option<&crate::codec::Encoded>,
) -> StoreResult<AdoptOutcome> {
    let new_id = a.session.id;
    let sid = uuid(&new_id);
    if let Some(bundle) = &a.bundle {
        insert_bundle(conn, seal, bundle, &a.now)?;
    }
    if let Some(export) = &a.export {
        // A foreign export already recorded by an earlier import stays as it is.
        insert_export(conn, seal, export)?;
    }
    // First, so a losing import fails before writing thousands of messages.
    if let Some(export) = a.consume_export {
        consume_export(conn, seal, export, new_id, &a.now)?;
    }
    if let Some(source) = a.suspend {
        let current = current_status(conn, &uuid(&source))?;
        check_transition(current, SessionStatus::Suspended)?;
        conn.prepare_cached("UPDATE sessions SET status = ?2, updated_at = ?3 WHERE id = ?1")
            .and_then(|mut st| {
                st.execute(params![
                    uuid(&source),
                    SessionStatus::Suspended.as_str(),
                    ts(&a.now)
                ])
            })
            .map_err(db_err)?;
    }
    insert_session(conn, seal, &a.session)?;
    if let Some(bundle) = &a.bundle {
        // The bundle it came in with holds its history: its erasure removes it.
        conn.prepare_cached(
            "INSERT INTO session_bundles (session_id, bundle_cid) VALUES (?1, ?2) \
             ON CONFLICT DO NOTHING",
        )
        .and_then(|mut st| st.execute(params![sid, bundle.cid]))
        .map_err(db_err)?;
    }
    let here;
    let (bodies, bytes) = match encoded {
        Some(e) => e,
        None => {
            here = encode_bodies(seal, &sid, &a.messages)?;
            &here
        }
    };
    insert_encoded_messages(conn, &sid, 0, &a.messages, bodies)?;
    let (steps, messages) = (int(a.step_count)?, len_i64(&a.messages)?);
    let last_task = seal.seal_opt(Column::SessionLastTask, &sid, a.last_task.as_deref())?;
    let session = conn
        .prepare_cached(&format!(
            "UPDATE sessions SET status = ?2, step_count = ?3, message_count = ?4, last_task = ?5, \
             model = ?6, updated_at = ?7, message_bytes = ?8 WHERE id = ?1 RETURNING {SESSION_COLS}"
        ))
        .and_then(|mut st| {
            st.query_row(
                params![
                    sid,
                    a.status.as_str(),
                    steps,
                    messages,
                    last_task,
                    a.model,
                    ts(&a.now),
                    bytes,
                ],
                |r| session_row(r, seal),
            )
        })
        .map_err(db_err)?;
    if let Some(snapshot) = &a.snapshot {
        write_snapshot(
            conn,
            seal,
            new_id,
            (snapshot.step_count, snapshot.message_count),
            &snapshot.snapshot,
        )?;
    }
    if let Some((schema_id, payload)) = &a.memory {
        upsert_memory(conn, seal, new_id, schema_id, payload, &a.now)?;
    }
    if let Some(link) = &a.link {
        insert_link(conn, seal, link)?;
    }
    Ok(session)
}

pub(crate) fn lineage(conn: &Connection, seal: &Sealer, session: Uuid) -> StoreResult<Lineage> {
    let sid = uuid(&session);
    let exports = conn
        .prepare_cached(&format!(
            "SELECT {EXPORT_COLS} FROM exports WHERE session_id = ?1 ORDER BY created_at, id"
        ))
        .and_then(|mut st| st.query_map([&sid], |r| export_row(r, seal))?.collect())
        .map_err(db_err)?;
    let links = |col: &str| -> StoreResult<Vec<LinkRecord>> {
        conn.prepare_cached(&format!(
            "SELECT {LINK_COLS} FROM lineage WHERE {col} = ?1 ORDER BY created_at, id"
        ))
        .and_then(|mut st| st.query_map([&sid], |r| link_row(r, seal))?.collect())
        .map_err(db_err)
    };
    Ok(Lineage {
        exports,
        outgoing: links("from_session")?,
        incoming: links("to_session")?,
    })
}

pub(crate) fn get_memory(
    conn: &Connection,
    seal: &Sealer,
    session: Uuid,
) -> StoreResult<Option<MemoryRecord>> {
    let sid = uuid(&session);
    conn.prepare_cached(
        "SELECT schema_id, payload, updated_at FROM session_memory WHERE session_id = ?1",
    )
    .and_then(|mut st| {
        st.query_row([&sid], |r| {
            Ok(MemoryRecord {
                schema_id: r.get(0)?,
                payload: col_sealed_json(r, 1, seal, Column::MemoryPayload, &sid)?,
                updated_at: col_ts(r, 2)?,
            })
        })
        .optional()
    })
    .map_err(db_err)
}

pub(crate) fn put_memory(
    conn: &Connection,
    seal: &Sealer,
    session: Uuid,
    schema_id: &str,
    payload: &serde_json::Value,
    now: &Timestamp,
) -> StoreResult<MemoryRecord> {
    current_status(conn, &uuid(&session))?;
    upsert_memory(conn, seal, session, schema_id, payload, now)?;
    get_memory(conn, seal, session)?.ok_or(StoreError::NotFound)
}

pub(crate) fn sweep(conn: &Connection, sweep: &Sweep) -> StoreResult<Swept> {
    let mut swept = Swept::default();
    if let Some(before) = &sweep.exports_before {
        let before = ts(before);
        swept.exports = conn
            .prepare_cached(
                "DELETE FROM exports WHERE expires_at < ?1 \
                 OR (imported_at IS NOT NULL AND imported_at < ?1)",
            )
            .and_then(|mut st| st.execute([&before]))
            .map_err(db_err)? as u64;
        swept.bundles = conn
            .prepare_cached(
                "DELETE FROM bundles WHERE created_at < ?1 \
                 AND NOT EXISTS (SELECT 1 FROM exports e WHERE e.bundle_cid = bundles.cid)",
            )
            .and_then(|mut st| st.execute([&before]))
            .map_err(db_err)? as u64;
    }
    if let Some(before) = &sweep.snapshots_before {
        // Each session's latest stays. Removing rows from the middle of a session's chain
        // (schema v11) leaves their successors pointing at nothing: the rows left are linked
        // again, each to the one before it in its session, in the same write.
        swept.snapshots = conn
            .prepare_cached(
                "DELETE FROM snapshots WHERE created_at < ?1 AND ord IS NOT \
                 (SELECT latest_snapshot FROM sessions WHERE id = snapshots.session_id)",
            )
            .and_then(|mut st| st.execute([ts(before)]))
            .map_err(db_err)? as u64;
        if swept.snapshots > 0 {
            conn.prepare_cached(
                "UPDATE snapshots SET prev_ord = chain.prev FROM (SELECT ord, \
                 LAG(ord) OVER (PARTITION BY session_id ORDER BY ord) AS prev FROM snapshots) \
                 AS chain WHERE chain.ord = snapshots.ord AND snapshots.prev_ord IS NOT chain.prev",
            )
            .and_then(|mut st| st.execute([]))
            .map_err(db_err)?;
        }
    }
    Ok(swept)
}
