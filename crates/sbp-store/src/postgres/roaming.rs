//! L3 roaming on PostgreSQL: bundles, exports, adopted sessions, lineage links and session memory.
//! Like `ops`, writes run inside the caller's transaction.

use deadpool_postgres::GenericClient;
use sbp_protocol::SessionStatus;
use tokio_postgres::Row;
use uuid::Uuid;

use super::codec::{
    bad, col_open, col_sealed_json, col_u64, db_err, first_error, get, int, json, opt_text, rows,
    seal_text, session_cols, session_row, text,
};
use super::ops::{
    INSERT_MESSAGES, INSERT_SNAPSHOT, Tx, allowed_from, encode_bodies, insert_messages,
    insert_snapshot, len_i64, prep, refused_transition,
};
use crate::seal::{Column, Sealer};
use crate::{
    AdoptOutcome, AdoptSession, ExportRecord, Lineage, LinkKind, LinkRecord, MemoryRecord,
    NewBundle, NewExport, RedeemOutcome, StoreError, StoreResult, Sweep, Swept, Timestamp,
};

macro_rules! export_cols {
    () => {
        "id, session_id, bundle_cid, label, message_count, created_at, \
    expires_at, foreign_origin, imported_at, import_session_id"
    };
}

fn export_row(row: &Row, seal: &Sealer) -> StoreResult<ExportRecord> {
    let id: Uuid = get(row, 0)?;
    Ok(ExportRecord {
        id,
        session_id: get(row, 1)?,
        bundle_cid: get(row, 2)?,
        label: col_open(row, 3, seal, Column::ExportLabel, &id.to_string())?,
        message_count: col_u64(row, 4)?,
        created_at: get(row, 5)?,
        expires_at: get(row, 6)?,
        foreign: get(row, 7)?,
        imported_at: get(row, 8)?,
        import_session_id: get(row, 9)?,
    })
}

macro_rules! link_cols {
    () => {
        "id, kind, from_session, to_session, from_agent, to_agent, export_id, \
    label, reason, fork_point, reused, created_at, peer_gateway"
    };
}

fn link_row(row: &Row, seal: &Sealer) -> StoreResult<LinkRecord> {
    let id: Uuid = get(row, 0)?;
    let key = id.to_string();
    let kind: &str = get(row, 1)?;
    let fork_point = match get::<Option<i64>>(row, 9)? {
        None => None,
        Some(_) => Some(col_u64(row, 9)?),
    };
    Ok(LinkRecord {
        id,
        kind: LinkKind::parse(kind).ok_or_else(|| bad(1, format!("link kind {kind:?}")))?,
        from_session: get(row, 2)?,
        to_session: get(row, 3)?,
        from_agent: get(row, 4)?,
        to_agent: get(row, 5)?,
        export_id: get(row, 6)?,
        label: col_open(row, 7, seal, Column::LinkLabel, &key)?,
        reason: col_open(row, 8, seal, Column::LinkReason, &key)?,
        fork_point,
        reused: get(row, 10)?,
        created_at: get(row, 11)?,
        peer_gateway: get(row, 12)?,
    })
}

// Content-addressed: an equal CID means equal content, so an existing row is kept as it is.
const INSERT_BUNDLE: &str = "INSERT INTO bundles (cid, body, created_at) VALUES ($1, $2, $3) \
     ON CONFLICT (cid) DO NOTHING";

const INSERT_EXPORT: &str = "INSERT INTO exports (id, session_id, bundle_cid, label, message_count, \
     created_at, expires_at, foreign_origin) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
     ON CONFLICT (id) DO NOTHING";

async fn insert_bundle(
    tx: &Tx,
    seal: &Sealer,
    bundle: &NewBundle,
    now: &Timestamp,
) -> StoreResult<()> {
    let st = prep(tx, INSERT_BUNDLE).await?;
    // The CID stays the digest of the plaintext: the bundle is sealed after it was computed.
    let body = seal.seal_bytes(Column::BundleBody, &bundle.cid, &bundle.bytes)?;
    tx.execute(&st, &[&bundle.cid, &body.as_ref(), now])
        .await
        .map_err(db_err)?;
    Ok(())
}

/// Inserts the export unless one with its id exists; returns whether it inserted.
async fn insert_export(tx: &Tx, seal: &Sealer, e: &NewExport) -> StoreResult<bool> {
    let st = prep(tx, INSERT_EXPORT).await?;
    let message_count = int(e.message_count)?;
    let label = seal_text(seal, Column::ExportLabel, &e.id.to_string(), &e.label)?;
    let n = tx
        .execute(
            &st,
            &[
                &e.id,
                &e.session_id,
                &e.bundle_cid,
                &label,
                &message_count,
                &e.created_at,
                &e.expires_at,
                &e.foreign,
            ],
        )
        .await
        .map_err(db_err)?;
    Ok(n == 1)
}

pub(crate) async fn create_export(
    tx: &Tx,
    seal: &Sealer,
    export: NewExport,
    bundle: NewBundle,
) -> StoreResult<()> {
    // Locked against the session's erasure: an export racing it stores nothing.
    super::lifecycle::lock_session_shared(tx, export.session_id).await?;
    insert_bundle(tx, seal, &bundle, &export.created_at).await?;
    if insert_export(tx, seal, &export).await? {
        Ok(())
    } else {
        Err(StoreError::Conflict(crate::ConflictKind::Duplicate(
            format!("export {} exists", export.id),
        )))
    }
}

pub(crate) async fn get_export(
    c: &impl GenericClient,
    seal: &Sealer,
    id: Uuid,
) -> StoreResult<Option<ExportRecord>> {
    let st = prep(
        c,
        concat!("SELECT ", export_cols!(), " FROM exports WHERE id = $1"),
    )
    .await?;
    c.query_opt(&st, &[&id])
        .await
        .map_err(db_err)?
        .map(|r| export_row(&r, seal))
        .transpose()
}

pub(crate) async fn get_bundle(
    c: &impl GenericClient,
    seal: &Sealer,
    cid: &str,
) -> StoreResult<Option<Vec<u8>>> {
    let st = prep(c, "SELECT body FROM bundles WHERE cid = $1").await?;
    match c.query_opt(&st, &[&cid]).await.map_err(db_err)? {
        None => Ok(None),
        Some(r) => Ok(Some(seal.open_bytes(
            Column::BundleBody,
            cid,
            get(&r, 0)?,
        )?)),
    }
}

/// The single-use check: the conditional UPDATE locks the export row, so of concurrent imports one
/// sets `imported_at` and the others, once it commits, find it set and change nothing.
pub(crate) async fn redeem_export(
    tx: &Tx,
    id: Uuid,
    by: &str,
    now: &Timestamp,
    retry_after: &Timestamp,
) -> StoreResult<RedeemOutcome> {
    let st = prep(
        tx,
        "UPDATE exports SET imported_at = $2, redeemed_by = $3 \
         WHERE id = $1 AND imported_at IS NULL",
    )
    .await?;
    if tx.execute(&st, &[&id, now, &by]).await.map_err(db_err)? == 1 {
        return Ok(RedeemOutcome::Redeemed);
    }
    let st = prep(
        tx,
        "SELECT imported_at, redeemed_by FROM exports WHERE id = $1",
    )
    .await?;
    let row = tx.query_opt(&st, &[&id]).await.map_err(db_err)?;
    let Some(row) = row else {
        return Err(StoreError::NotFound);
    };
    let at: Option<Timestamp> = row.try_get(0).map_err(db_err)?;
    let peer: Option<String> = row.try_get(1).map_err(db_err)?;
    match (at, peer) {
        (Some(at), Some(peer)) if peer == by && at >= *retry_after => {
            Ok(RedeemOutcome::AlreadyByThisPeer)
        }
        _ => Ok(RedeemOutcome::Consumed),
    }
}

async fn consume_export(
    tx: &Tx,
    seal: &Sealer,
    export: Uuid,
    by: Uuid,
    now: &Timestamp,
) -> StoreResult<()> {
    let st = prep(
        tx,
        "UPDATE exports SET imported_at = $2, import_session_id = $3 \
         WHERE id = $1 AND imported_at IS NULL",
    )
    .await?;
    let changed = tx
        .execute(&st, &[&export, now, &by])
        .await
        .map_err(db_err)?;
    if changed == 1 {
        return Ok(());
    }
    match get_export(tx, seal, export).await? {
        Some(_) => Err(StoreError::Consumed),
        None => Err(StoreError::NotFound),
    }
}

const INSERT_LINK: &str = "INSERT INTO lineage (id, kind, from_session, to_session, from_agent, \
     to_agent, export_id, label, reason, fork_point, reused, created_at, peer_gateway) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)";

pub(crate) async fn insert_link(tx: &Tx, seal: &Sealer, l: &LinkRecord) -> StoreResult<()> {
    let st = prep(tx, INSERT_LINK).await?;
    let fork_point = l.fork_point.map(int).transpose()?;
    let key = l.id.to_string();
    let label = seal_text(seal, Column::LinkLabel, &key, &l.label)?;
    let reason = seal_text(seal, Column::LinkReason, &key, &l.reason)?;
    tx.execute(
        &st,
        &[
            &l.id,
            &l.kind.as_str(),
            &l.from_session,
            &l.to_session,
            &opt_text(&l.from_agent),
            &opt_text(&l.to_agent),
            &l.export_id,
            &label,
            &reason,
            &fork_point,
            &l.reused,
            &l.created_at,
            &opt_text(&l.peer_gateway),
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

/// Inserts or replaces the memory of an existing session; `None` when there is no such session.
const UPSERT_MEMORY: &str = "INSERT INTO session_memory (session_id, schema_id, payload, updated_at) \
     SELECT id, $2, $3, $4 FROM sessions WHERE id = $1 \
     ON CONFLICT (session_id) DO UPDATE SET schema_id = excluded.schema_id, \
     payload = excluded.payload, updated_at = excluded.updated_at \
     RETURNING schema_id, payload, updated_at";

async fn upsert_memory(
    c: &impl GenericClient,
    seal: &Sealer,
    session: Uuid,
    schema_id: &str,
    payload: &serde_json::Value,
    now: &Timestamp,
) -> StoreResult<Option<MemoryRecord>> {
    let st = prep(c, UPSERT_MEMORY).await?;
    let payload = json(payload)?;
    let payload = seal.seal(Column::MemoryPayload, &session.to_string(), &payload)?;
    c.query_opt(&st, &[&session, &text(schema_id), &payload.as_ref(), now])
        .await
        .map_err(db_err)?
        .map(|r| memory_row(&r, seal, session))
        .transpose()
}

fn memory_row(row: &Row, seal: &Sealer, session: Uuid) -> StoreResult<MemoryRecord> {
    Ok(MemoryRecord {
        schema_id: get(row, 0)?,
        payload: col_sealed_json(row, 1, seal, Column::MemoryPayload, &session.to_string())?,
        updated_at: get(row, 2)?,
    })
}

/// `encoded`: the messages' bodies as stored and their plaintext size ([`encode_bodies`]),
/// encoded ahead of the write, or `None`.
pub(crate) async fn adopt_session(
    tx: &Tx,
    seal: &Sealer,
    a: AdoptSession,
    encoded: Option<crate::codec::Encoded>,
) -> StoreResult<AdoptOutcome> {
    let new_id = a.session.id;
    let sid = new_id.to_string();
    if let Some(bundle) = &a.bundle {
        insert_bundle(tx, seal, bundle, &a.now).await?;
    }
    if let Some(export) = &a.export {
        // A foreign export already recorded by an earlier import stays as it is.
        insert_export(tx, seal, export).await?;
    }
    // First, so a losing import fails before writing thousands of messages.
    if let Some(export) = a.consume_export {
        consume_export(tx, seal, export, new_id, &a.now).await?;
    }
    if let Some(source) = a.suspend {
        let st = prep(
            tx,
            "UPDATE sessions SET status = $2, updated_at = $3 WHERE id = $1 AND status = ANY($4)",
        )
        .await?;
        let to = SessionStatus::Suspended;
        let n = tx
            .execute(&st, &[&source, &to.as_str(), &a.now, &allowed_from(to)])
            .await
            .map_err(db_err)?;
        if n == 0 {
            return Err(refused_transition(tx, source, to).await);
        }
    }
    let (session, messages, snapshot) = tokio::try_join!(
        prep(
            tx,
            concat!(
                "INSERT INTO sessions (id, agent_id, token_hash, status, step_count, \
                 message_count, last_task, model, created_at, updated_at, metadata, message_bytes) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) RETURNING ",
                session_cols!()
            )
        ),
        prep(tx, INSERT_MESSAGES),
        prep(tx, INSERT_SNAPSHOT),
    )?;
    let (steps, count) = (int(a.step_count)?, len_i64(&a.messages)?);
    let (bodies, bytes) = match encoded {
        Some(e) => e,
        None => encode_bodies(seal, &sid, &a.messages)?,
    };
    let metadata = json(&a.session.metadata)?;
    let metadata = seal.seal(Column::SessionMetadata, &sid, &metadata)?;
    let last_task = seal_text(seal, Column::SessionLastTask, &sid, &a.last_task)?;
    // The session first (the rest refers to it); everything after it is sent at once.
    let session = async {
        let row = tx
            .query_one(
                &session,
                &[
                    &new_id,
                    &text(&a.session.agent_id),
                    &a.session.token_hash,
                    &a.status.as_str(),
                    &steps,
                    &count,
                    &last_task,
                    &opt_text(&a.model),
                    &a.session.created_at,
                    &a.now,
                    &metadata.as_ref(),
                    &bytes,
                ],
            )
            .await
            .map_err(db_err)?;
        session_row(&row, seal)
    };
    let messages = insert_messages(tx, &messages, new_id, 0, &a.messages, bodies);
    let snapshot = async {
        match &a.snapshot {
            Some(r) => insert_snapshot(
                tx,
                seal,
                &snapshot,
                new_id,
                (r.step_count, r.message_count),
                &r.snapshot,
            )
            .await
            .map(drop),
            None => Ok(()),
        }
    };
    let memory = async {
        match &a.memory {
            Some((schema_id, payload)) => {
                upsert_memory(tx, seal, new_id, schema_id, payload, &a.now)
                    .await
                    .map(drop)
            }
            None => Ok(()),
        }
    };
    let link = async {
        match &a.link {
            Some(link) => insert_link(tx, seal, link).await,
            None => Ok(()),
        }
    };
    // The bundle it came in with holds its history: its erasure removes it.
    let came_with = async {
        let Some(bundle) = &a.bundle else {
            return Ok(());
        };
        let st = prep(
            tx,
            "INSERT INTO session_bundles (session_id, bundle_cid) VALUES ($1, $2) \
             ON CONFLICT DO NOTHING",
        )
        .await?;
        tx.execute(&st, &[&new_id, &bundle.cid])
            .await
            .map(drop)
            .map_err(db_err)
    };
    let (session, messages, snapshot, memory, link, came_with) =
        tokio::join!(session, messages, snapshot, memory, link, came_with);
    first_error([
        session.as_ref().err().cloned(),
        messages.err(),
        snapshot.err(),
        memory.err(),
        link.err(),
        came_with.err(),
    ])?;
    session
}

pub(crate) async fn lineage(
    c: &impl GenericClient,
    seal: &Sealer,
    session: Uuid,
) -> StoreResult<Lineage> {
    let (exports, outgoing, incoming) = tokio::try_join!(
        prep(
            c,
            concat!(
                "SELECT ",
                export_cols!(),
                " FROM exports WHERE session_id = $1 ORDER BY created_at, id"
            )
        ),
        prep(
            c,
            concat!(
                "SELECT ",
                link_cols!(),
                " FROM lineage WHERE from_session = $1 ORDER BY created_at, id"
            )
        ),
        prep(
            c,
            concat!(
                "SELECT ",
                link_cols!(),
                " FROM lineage WHERE to_session = $1 ORDER BY created_at, id"
            )
        ),
    )?;
    let (exports, outgoing, incoming) = tokio::try_join!(
        async { c.query(&exports, &[&session]).await.map_err(db_err) },
        async { c.query(&outgoing, &[&session]).await.map_err(db_err) },
        async { c.query(&incoming, &[&session]).await.map_err(db_err) },
    )?;
    Ok(Lineage {
        exports: rows(&exports, |r| export_row(r, seal))?,
        outgoing: rows(&outgoing, |r| link_row(r, seal))?,
        incoming: rows(&incoming, |r| link_row(r, seal))?,
    })
}

pub(crate) async fn get_memory(
    c: &impl GenericClient,
    seal: &Sealer,
    session: Uuid,
) -> StoreResult<Option<MemoryRecord>> {
    let st = prep(
        c,
        "SELECT schema_id, payload, updated_at FROM session_memory WHERE session_id = $1",
    )
    .await?;
    c.query_opt(&st, &[&session])
        .await
        .map_err(db_err)?
        .map(|r| memory_row(&r, seal, session))
        .transpose()
}

/// One statement: it writes only when the session exists, and `NotFound` otherwise.
pub(crate) async fn put_memory(
    c: &impl GenericClient,
    seal: &Sealer,
    session: Uuid,
    schema_id: &str,
    payload: &serde_json::Value,
    now: &Timestamp,
) -> StoreResult<MemoryRecord> {
    upsert_memory(c, seal, session, schema_id, payload, now)
        .await?
        .ok_or(StoreError::NotFound)
}

pub(crate) async fn sweep(c: &Tx, sweep: Sweep) -> StoreResult<Swept> {
    let mut swept = Swept::default();
    if let Some(before) = &sweep.exports_before {
        let st = prep(
            c,
            "DELETE FROM exports WHERE expires_at < $1 \
             OR (imported_at IS NOT NULL AND imported_at < $1)",
        )
        .await?;
        swept.exports = c.execute(&st, &[before]).await.map_err(db_err)?;
        let st = prep(
            c,
            "DELETE FROM bundles WHERE created_at < $1 \
             AND NOT EXISTS (SELECT 1 FROM exports e WHERE e.bundle_cid = bundles.cid)",
        )
        .await?;
        swept.bundles = c.execute(&st, &[before]).await.map_err(db_err)?;
    }
    if let Some(before) = &sweep.snapshots_before {
        let st = prep(
            c,
            "DELETE FROM snapshots s WHERE s.created_at < $1 AND s.ord < \
             (SELECT MAX(l.ord) FROM snapshots l WHERE l.session_id = s.session_id)",
        )
        .await?;
        swept.snapshots = c.execute(&st, &[before]).await.map_err(db_err)?;
    }
    Ok(swept)
}
