//! Session holds on PostgreSQL (L6): where a session is held while it moves between gateways, the
//! origin's lease and commit, the target's adoption and finish, and the guard `begin_turn` and a
//! pushed turn apply.
//!
//! Every write here takes the session row's lock first and reads what it decides on in later
//! statements, each with a snapshot of its own (READ COMMITTED): a turn that committed before the
//! lock is seen, and none can commit until this transaction ends. The turn writes do the same the
//! other way round: their guard reads the hold in a statement after the one that locked the
//! session row ([`HOLD_GUARD`]). A single statement would not do: it reads other tables with the
//! snapshot it started with, from before the lock it waited for.

use async_trait::async_trait;
use deadpool_postgres::GenericClient;
use tokio_postgres::Row;
use uuid::Uuid;

use super::PostgresStore;
use super::codec::{bad, col_u64, db_err, get, int, opt_text, rows, seal_text, text};
use super::ops::{Tx, prep};
use super::roaming;
use crate::federation::hold_refuses_writes;
use crate::seal::{Column, Sealer};
use crate::{
    AdoptMigrated, ConflictKind, HoldRow, HoldState, HoldStore, LeaseRequest, LinkKind, LinkRecord,
    SessionRecord, StoreError, StoreResult, Timestamp,
};

macro_rules! hold_cols {
    () => {
        "session_id, epoch, state, peer_gateway, peer_url, migration_id, lease_expires_at, \
         updated_at"
    };
}

/// The guard of a turn write, run after the statement that locked the session row.
pub(crate) const HOLD_GUARD: &str =
    "SELECT state, lease_expires_at FROM session_holds WHERE session_id = $1";

/// The refusal [`HOLD_GUARD`]'s answer means at `now`, if any.
pub(crate) fn guard_refusal(found: &[Row], now: Timestamp) -> StoreResult<Option<ConflictKind>> {
    let Some(row) = found.first() else {
        return Ok(None);
    };
    let state: &str = get(row, 0)?;
    let state = HoldState::parse(state).ok_or_else(|| bad(0, format!("hold state {state:?}")))?;
    Ok(hold_refuses_writes(state, get(row, 1)?, now))
}

fn hold_row(row: &Row) -> StoreResult<HoldRow> {
    let state: &str = get(row, 2)?;
    let migration_id = match get::<Option<&str>>(row, 5)? {
        None => None,
        Some(m) => Some(Uuid::parse_str(m).map_err(|e| bad(5, format!("uuid {m:?}: {e}")))?),
    };
    Ok(HoldRow {
        session_id: get(row, 0)?,
        epoch: col_u64(row, 1)?,
        state: HoldState::parse(state).ok_or_else(|| bad(2, format!("hold state {state:?}")))?,
        peer_gateway: get(row, 3)?,
        peer_url: get(row, 4)?,
        migration_id,
        lease_expires_at: get(row, 6)?,
        updated_at: get(row, 7)?,
    })
}

fn conflict(kind: ConflictKind) -> StoreError {
    StoreError::Conflict(kind)
}

async fn hold(c: &impl GenericClient, session: Uuid) -> StoreResult<Option<HoldRow>> {
    let st = prep(
        c,
        concat!(
            "SELECT ",
            hold_cols!(),
            " FROM session_holds WHERE session_id = $1"
        ),
    )
    .await?;
    c.query_opt(&st, &[&session])
        .await
        .map_err(db_err)?
        .map(|r| hold_row(&r))
        .transpose()
}

/// Locks the session row for the rest of the transaction; its agent, `None` without the session.
async fn lock_session(tx: &Tx, session: Uuid) -> StoreResult<Option<String>> {
    let st = prep(tx, "SELECT agent_id FROM sessions WHERE id = $1 FOR UPDATE").await?;
    tx.query_opt(&st, &[&session])
        .await
        .map_err(db_err)?
        .map(|r| get(&r, 0))
        .transpose()
}

async fn lease_handover(tx: &Tx, r: &LeaseRequest) -> StoreResult<HoldRow> {
    lock_session(tx, r.session_id)
        .await?
        .ok_or(StoreError::NotFound)?;
    if let Some(h) = hold(tx, r.session_id).await? {
        let unexpired = h.lease_expires_at.is_some_and(|until| until > r.now);
        match h.state {
            HoldState::Leased if unexpired => {
                let retry = h.migration_id == Some(r.migration_id)
                    && h.peer_gateway.as_deref() == Some(r.to_gateway.as_str());
                return if retry {
                    Ok(h)
                } else {
                    Err(conflict(ConflictKind::SessionMoving))
                };
            }
            HoldState::Leased | HoldState::Home => {}
            HoldState::Incoming => return Err(conflict(ConflictKind::SessionMoving)),
            HoldState::Moved => return Err(conflict(ConflictKind::SessionMoved)),
        }
    }
    let st = prep(
        tx,
        "SELECT EXISTS (SELECT 1 FROM turns WHERE session_id = $1 AND state = 'running')",
    )
    .await?;
    let running: bool = get(
        &tx.query_one(&st, &[&r.session_id]).await.map_err(db_err)?,
        0,
    )?;
    if running {
        return Err(conflict(ConflictKind::SessionBusy));
    }
    let st = prep(
        tx,
        concat!(
            "INSERT INTO session_holds (",
            hold_cols!(),
            ") VALUES ($1, 1, 'leased', $2, $3, $4, $5, $6) \
             ON CONFLICT (session_id) DO UPDATE SET epoch = session_holds.epoch + 1, \
             state = excluded.state, peer_gateway = excluded.peer_gateway, \
             peer_url = excluded.peer_url, migration_id = excluded.migration_id, \
             lease_expires_at = excluded.lease_expires_at, updated_at = excluded.updated_at \
             RETURNING ",
            hold_cols!()
        ),
    )
    .await?;
    let row = tx
        .query_one(
            &st,
            &[
                &r.session_id,
                &text(&r.to_gateway),
                &text(&r.to_url),
                &r.migration_id.to_string(),
                &r.until,
                &r.now,
            ],
        )
        .await
        .map_err(db_err)?;
    hold_row(&row)
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

async fn commit_handover(
    tx: &Tx,
    seal: &Sealer,
    session: Uuid,
    migration_id: Uuid,
    by: &str,
    now: Timestamp,
) -> StoreResult<HoldRow> {
    let agent = lock_session(tx, session)
        .await?
        .ok_or(StoreError::NotFound)?;
    let ours =
        |h: &HoldRow| h.migration_id == Some(migration_id) && h.peer_gateway.as_deref() == Some(by);
    match hold(tx, session).await? {
        Some(h) if h.state == HoldState::Moved && ours(&h) => return Ok(h),
        Some(h)
            if h.state == HoldState::Leased
                && ours(&h)
                && h.lease_expires_at.is_some_and(|until| until > now) => {}
        _ => return Err(conflict(ConflictKind::LeaseExpired)),
    }
    // Conditional: a reaper's expiry that committed in between (its clock at the boundary)
    // leaves nothing to move.
    let st = prep(
        tx,
        concat!(
            "UPDATE session_holds SET state = 'moved', lease_expires_at = NULL, updated_at = $3 \
             WHERE session_id = $1 AND state = 'leased' AND migration_id = $2 RETURNING ",
            hold_cols!()
        ),
    )
    .await?;
    let moved = tx
        .query_opt(&st, &[&session, &migration_id.to_string(), &now])
        .await
        .map_err(db_err)?
        .ok_or_else(|| conflict(ConflictKind::LeaseExpired))?;
    let st = prep(tx, "DELETE FROM tether WHERE session_id = $1").await?;
    tx.execute(&st, &[&session]).await.map_err(db_err)?;
    let link = move_link(
        LinkKind::MigratedTo,
        session,
        agent,
        migration_id,
        Some(by.to_owned()),
        now,
    );
    roaming::insert_link(tx, seal, &link).await?;
    hold_row(&moved)
}

/// One statement: a lease renewed or committed meanwhile no longer matches (its row is
/// re-checked once the other write committed).
async fn expire_leases(c: &impl GenericClient, now: Timestamp) -> StoreResult<u64> {
    let st = prep(
        c,
        "UPDATE session_holds SET state = 'home', peer_gateway = NULL, peer_url = NULL, \
         migration_id = NULL, lease_expires_at = NULL, updated_at = $1 \
         WHERE state = 'leased' AND lease_expires_at <= $1",
    )
    .await?;
    c.execute(&st, &[&now]).await.map_err(db_err)
}

async fn release_lease(
    c: &impl GenericClient,
    session: Uuid,
    migration_id: Uuid,
    by: &str,
    now: Timestamp,
) -> StoreResult<bool> {
    let st = prep(
        c,
        "UPDATE session_holds SET state = 'home', peer_gateway = NULL, peer_url = NULL, \
         migration_id = NULL, lease_expires_at = NULL, updated_at = $4 \
         WHERE session_id = $1 AND state = 'leased' AND migration_id = $2 AND peer_gateway = $3",
    )
    .await?;
    let mid = migration_id.to_string();
    c.execute(&st, &[&session, &mid, &by, &now])
        .await
        .map(|n| n == 1)
        .map_err(db_err)
}

async fn delete_session(tx: &Tx, session: Uuid) -> StoreResult<()> {
    // Messages, snapshots, tether, turns, idempotency records, memory and the hold go with it
    // (ON DELETE CASCADE); lineage and exports name sessions without a key and stay.
    let st = prep(tx, "DELETE FROM sessions WHERE id = $1").await?;
    tx.execute(&st, &[&session]).await.map_err(db_err)?;
    Ok(())
}

const INSERT_CARRIED_TETHER: &str = "INSERT INTO tether \
     (session_id, seq, role, content, model_used, created_at, chunk_id) \
     SELECT $1, v.seq, v.role, v.content, v.model_used, v.created_at, v.chunk_id \
     FROM UNNEST($2::bigint[], $3::text[], $4::text[], $5::text[], $6::timestamptz[], \
     $7::uuid[]) AS v (seq, role, content, model_used, created_at, chunk_id)";

/// `encoded`: the messages' bodies as stored, encoded ahead of the transaction, or `None`.
async fn adopt_migrated(
    tx: &Tx,
    seal: &Sealer,
    m: AdoptMigrated,
    encoded: Option<crate::codec::Encoded>,
) -> StoreResult<SessionRecord> {
    let id = m.adopt.session.id;
    let sid = id.to_string();
    if lock_session(tx, id).await?.is_some() {
        match hold(tx, id).await? {
            Some(h) if h.state == HoldState::Moved => delete_session(tx, id).await?,
            _ => {
                return Err(conflict(ConflictKind::Duplicate(format!(
                    "session {id} is held here"
                ))));
            }
        }
    }
    let now = m.adopt.now;
    let session = roaming::adopt_session(tx, seal, m.adopt, encoded).await?;
    if !m.tether.is_empty() {
        let seqs = m
            .tether
            .iter()
            .map(|(seq, _)| int(*seq))
            .collect::<StoreResult<Vec<i64>>>()?;
        let roles: Vec<_> = m.tether.iter().map(|(_, e)| text(&e.role)).collect();
        let contents = m
            .tether
            .iter()
            .map(|(_, e)| seal_text(seal, Column::TetherContent, &sid, &e.content))
            .collect::<StoreResult<Vec<_>>>()?;
        let models: Vec<_> = m
            .tether
            .iter()
            .map(|(_, e)| opt_text(&e.model_used))
            .collect();
        let created: Vec<Timestamp> = m.tether.iter().map(|(_, e)| e.created_at).collect();
        let chunks: Vec<Uuid> = m.tether.iter().map(|(_, e)| e.chunk_id).collect();
        let st = prep(tx, INSERT_CARRIED_TETHER).await?;
        tx.execute(
            &st,
            &[&id, &seqs, &roles, &contents, &models, &created, &chunks],
        )
        .await
        .map_err(db_err)?;
    }
    // Past every carried seq whatever the origin said, so a seq is never issued twice.
    let highest = m.tether.iter().map(|(seq, _)| *seq).max().unwrap_or(0);
    let next = int(m.tether_next_seq.max(highest + 1))?;
    let st = prep(tx, "UPDATE sessions SET tether_seq = $2 WHERE id = $1").await?;
    tx.execute(&st, &[&id, &next]).await.map_err(db_err)?;
    let st = prep(
        tx,
        concat!(
            "INSERT INTO session_holds (",
            hold_cols!(),
            ") VALUES ($1, $2, 'incoming', $3, $4, $5, NULL, $6)"
        ),
    )
    .await?;
    tx.execute(
        &st,
        &[
            &id,
            &int(m.epoch)?,
            &text(&m.from_gateway),
            &text(&m.from_url),
            &m.migration_id.to_string(),
            &now,
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(session)
}

async fn finish_incoming(
    tx: &Tx,
    seal: &Sealer,
    session: Uuid,
    migration_id: Uuid,
    ok: bool,
    now: Timestamp,
) -> StoreResult<()> {
    let agent = lock_session(tx, session).await?;
    let found = match agent {
        Some(_) => hold(tx, session).await?,
        None => None,
    };
    let this_move = |state: HoldState| {
        found
            .as_ref()
            .is_some_and(|h| h.state == state && h.migration_id == Some(migration_id))
    };
    if !ok {
        if this_move(HoldState::Incoming) {
            delete_session(tx, session).await?;
        }
        return Ok(());
    }
    if this_move(HoldState::Home) {
        return Ok(());
    }
    let agent = agent.ok_or(StoreError::NotFound)?;
    if !this_move(HoldState::Incoming) {
        return Err(conflict(ConflictKind::LeaseExpired));
    }
    let origin = found.and_then(|h| h.peer_gateway);
    let st = prep(
        tx,
        "UPDATE session_holds SET state = 'home', peer_gateway = NULL, peer_url = NULL, \
         lease_expires_at = NULL, updated_at = $2 WHERE session_id = $1",
    )
    .await?;
    tx.execute(&st, &[&session, &now]).await.map_err(db_err)?;
    let link = move_link(
        LinkKind::MigratedFrom,
        session,
        agent,
        migration_id,
        origin,
        now,
    );
    roaming::insert_link(tx, seal, &link).await
}

async fn incoming_holds(c: &impl GenericClient) -> StoreResult<Vec<HoldRow>> {
    let st = prep(
        c,
        concat!(
            "SELECT ",
            hold_cols!(),
            " FROM session_holds WHERE state = 'incoming' ORDER BY updated_at, session_id"
        ),
    )
    .await?;
    rows(&c.query(&st, &[]).await.map_err(db_err)?, hold_row)
}

#[async_trait]
impl HoldStore for PostgresStore {
    async fn hold(&self, session_id: Uuid) -> StoreResult<Option<HoldRow>> {
        hold(&self.client().await?, session_id).await
    }

    async fn lease_handover(&self, req: LeaseRequest) -> StoreResult<HoldRow> {
        self.write(move |tx| Box::pin(async move { lease_handover(tx, &req).await }))
            .await
    }

    async fn commit_handover(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        by_gateway: &str,
        now: Timestamp,
    ) -> StoreResult<HoldRow> {
        let by = by_gateway.to_owned();
        self.write(move |tx| {
            let seal = self.seal.clone();
            Box::pin(
                async move { commit_handover(tx, &seal, session_id, migration_id, &by, now).await },
            )
        })
        .await
    }

    async fn expire_leases(&self, now: Timestamp) -> StoreResult<u64> {
        expire_leases(&self.client().await?, now).await
    }

    async fn release_lease(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        by_gateway: &str,
        now: Timestamp,
    ) -> StoreResult<bool> {
        release_lease(
            &self.client().await?,
            session_id,
            migration_id,
            by_gateway,
            now,
        )
        .await
    }

    async fn adopt_migrated(&self, m: AdoptMigrated) -> StoreResult<SessionRecord> {
        let m = std::sync::Arc::new(m);
        let encoded =
            crate::codec::encode_ahead(&self.seal, &m, |m| &m.adopt.messages, m.adopt.session.id)
                .await?;
        let m = std::sync::Arc::unwrap_or_clone(m);
        self.write(move |tx| {
            let seal = self.seal.clone();
            Box::pin(async move { adopt_migrated(tx, &seal, m, encoded).await })
        })
        .await
    }

    async fn finish_incoming(
        &self,
        session_id: Uuid,
        migration_id: Uuid,
        ok: bool,
        now: Timestamp,
    ) -> StoreResult<()> {
        self.write(move |tx| {
            let seal = self.seal.clone();
            Box::pin(
                async move { finish_incoming(tx, &seal, session_id, migration_id, ok, now).await },
            )
        })
        .await
    }

    async fn incoming_holds(&self) -> StoreResult<Vec<HoldRow>> {
        incoming_holds(&self.client().await?).await
    }
}
