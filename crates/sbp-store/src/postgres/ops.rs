//! The store's operations on PostgreSQL. A multi-statement write runs inside one transaction (the
//! caller commits only an `Ok` and rolls back an `Err`); one that changes a session takes the
//! session row's lock first, so a session's writes serialise while other sessions' proceed. The
//! independent statements that follow are sent together (tokio-postgres pipelines requests issued
//! concurrently on one connection), so a turn costs a few round trips instead of one per row.

use std::borrow::Cow;

use deadpool_postgres::{Client, GenericClient};
use sbp_protocol::{SessionStatus, SnapshotKind};
use tokio_postgres::Statement;
use uuid::Uuid;

use super::codec::{
    col_status, col_u64, db_err, first_error, get, idem_state, idempotency_cols, idempotency_row,
    int, json, message_cols, message_row, opt_text, rows, seal_text, session_cols, session_row,
    snapshot_cols, snapshot_row, stored_text, tether_cols, tether_row, text, turn_cols, turn_row,
    turn_state,
};
use super::holds::{HOLD_GUARD, guard_refusal};
pub(crate) use crate::codec::encode_bodies;
use crate::codec::{stored_time, written_snapshot};
use crate::seal::{Column, Sealer};
use crate::{
    BeginTurn, BeginTurnOutcome, ConflictKind, FailTurn, FinishTurn, FinishTurnOutcome,
    IdempotencyRecord, IdempotencyState, MessageRecord, NewMessage, NewSession, NewSnapshot,
    SessionRecord, SnapshotRecord, StoreError, StoreResult, TetherEntry, Timestamp, TurnProgress,
    TurnProgressOutcome, TurnRecord, TurnState,
};

/// Error text of turns failed by `recover_interrupted_turns` (the same as SQLite's).
pub(crate) const INTERRUPTED: &str = "interrupted by gateway restart";

/// A pooled connection inside a transaction that [`crate::postgres::PostgresStore`]'s `write` opened
/// (and will commit or roll back).
pub(crate) type Tx = Client;

pub(crate) fn conflict(kind: ConflictKind) -> StoreError {
    StoreError::Conflict(kind)
}

pub(crate) async fn prep(c: &impl GenericClient, sql: &str) -> StoreResult<Statement> {
    c.prepare_cached(sql).await.map_err(db_err)
}

// ---- sessions ----

const INSERT_SESSION: &str = "INSERT INTO sessions \
     (id, agent_id, token_hash, status, created_at, updated_at, metadata) \
     VALUES ($1, $2, $3, $4, $5, $5, $6)";

pub(crate) async fn insert_session(
    c: &impl GenericClient,
    seal: &Sealer,
    s: &NewSession,
) -> StoreResult<()> {
    let st = prep(c, INSERT_SESSION).await?;
    exec_insert_session(c, seal, &st, s).await
}

/// Runs [`INSERT_SESSION`], prepared as `st`.
async fn exec_insert_session(
    c: &impl GenericClient,
    seal: &Sealer,
    st: &Statement,
    s: &NewSession,
) -> StoreResult<()> {
    let metadata = json(&s.metadata)?;
    let metadata = seal.seal(Column::SessionMetadata, &s.id.to_string(), &metadata)?;
    c.execute(
        st,
        &[
            &s.id,
            &text(&s.agent_id),
            &s.token_hash,
            &SessionStatus::Idle.as_str(),
            &s.created_at,
            &metadata,
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

async fn session_where(
    c: &impl GenericClient,
    seal: &Sealer,
    sql: &str,
    param: &(dyn tokio_postgres::types::ToSql + Sync),
) -> StoreResult<Option<SessionRecord>> {
    let st = prep(c, sql).await?;
    c.query_opt(&st, &[param])
        .await
        .map_err(db_err)?
        .map(|r| session_row(&r, seal))
        .transpose()
}

pub(crate) async fn get_session(
    c: &impl GenericClient,
    seal: &Sealer,
    id: Uuid,
) -> StoreResult<Option<SessionRecord>> {
    let sql = concat!("SELECT ", session_cols!(), " FROM sessions WHERE id = $1");
    session_where(c, seal, sql, &id).await
}

pub(crate) async fn find_session_by_token(
    c: &impl GenericClient,
    seal: &Sealer,
    token_hash: &str,
) -> StoreResult<Option<SessionRecord>> {
    let sql = concat!(
        "SELECT ",
        session_cols!(),
        " FROM sessions WHERE token_hash = $1"
    );
    session_where(c, seal, sql, &token_hash).await
}

pub(crate) async fn latest_suspended_for_agent(
    c: &impl GenericClient,
    seal: &Sealer,
    agent_id: &str,
) -> StoreResult<Option<SessionRecord>> {
    // `ord` breaks ties between sessions updated in the same microsecond: the later insert wins.
    let sql = concat!(
        "SELECT ",
        session_cols!(),
        " FROM sessions WHERE agent_id = $1 AND status = 'suspended' \
         ORDER BY updated_at DESC, ord DESC LIMIT 1"
    );
    session_where(c, seal, sql, &text(agent_id)).await
}

/// The session's status, read without a lock (the callers have taken it, or only need it to name
/// the error of a write that changed nothing).
pub(crate) async fn current_status(
    c: &impl GenericClient,
    id: Uuid,
) -> StoreResult<Option<SessionStatus>> {
    let st = prep(c, "SELECT status FROM sessions WHERE id = $1").await?;
    c.query_opt(&st, &[&id])
        .await
        .map_err(db_err)?
        .map(|r| col_status(&r, 0))
        .transpose()
}

pub(crate) fn check_transition(from: SessionStatus, to: SessionStatus) -> StoreResult<()> {
    if from.can_transition(to) {
        Ok(())
    } else {
        Err(conflict(ConflictKind::Transition { from, to }))
    }
}

/// The statuses from which `to` may be reached, for a conditional UPDATE.
pub(crate) fn allowed_from(to: SessionStatus) -> Vec<&'static str> {
    SessionStatus::ALL
        .iter()
        .filter(|from| from.can_transition(to))
        .map(|s| s.as_str())
        .collect()
}

/// The error of a conditional status change that changed nothing: the session is missing, or its
/// status does not allow `to`.
pub(crate) async fn refused_transition(
    c: &impl GenericClient,
    id: Uuid,
    to: SessionStatus,
) -> StoreError {
    match current_status(c, id).await {
        Err(e) => e,
        Ok(None) => StoreError::NotFound,
        Ok(Some(from)) => check_transition(from, to)
            .err()
            // Allowed now, so another write changed the status in between: still a refusal.
            .unwrap_or_else(|| conflict(ConflictKind::StatusChanged(from))),
    }
}

pub(crate) async fn update_status(
    tx: &Tx,
    id: Uuid,
    to: SessionStatus,
    now: Timestamp,
) -> StoreResult<SessionStatus> {
    let lock = prep(tx, "SELECT status FROM sessions WHERE id = $1 FOR UPDATE").await?;
    let current = match tx.query_opt(&lock, &[&id]).await.map_err(db_err)? {
        Some(row) => col_status(&row, 0)?,
        None => return Err(StoreError::NotFound),
    };
    check_transition(current, to)?;
    let st = prep(
        tx,
        "UPDATE sessions SET status = $2, updated_at = $3 WHERE id = $1",
    )
    .await?;
    tx.execute(&st, &[&id, &to.as_str(), &now])
        .await
        .map_err(db_err)?;
    Ok(current)
}

pub(crate) async fn suspend_if_running(
    c: &impl GenericClient,
    id: Uuid,
    now: Timestamp,
) -> StoreResult<bool> {
    let st = prep(
        c,
        "UPDATE sessions SET status = 'suspended', updated_at = $2 \
         WHERE id = $1 AND status = 'running'",
    )
    .await?;
    let n = c.execute(&st, &[&id, &now]).await.map_err(db_err)?;
    Ok(n > 0)
}

pub(crate) async fn mark_attached(
    c: &impl GenericClient,
    seal: &Sealer,
    id: Uuid,
    now: Timestamp,
) -> StoreResult<SessionRecord> {
    let st = prep(
        c,
        concat!(
            "UPDATE sessions SET tether_enabled = true, updated_at = $2, \
             status = CASE WHEN status IN ('suspended', 'idle') THEN 'running' ELSE status END \
             WHERE id = $1 RETURNING ",
            session_cols!()
        ),
    )
    .await?;
    match c.query_opt(&st, &[&id, &now]).await.map_err(db_err)? {
        Some(row) => session_row(&row, seal),
        None => Err(StoreError::NotFound),
    }
}

/// Every status, zero counts included, in `SessionStatus::ALL` order.
pub(crate) async fn count_sessions_by_status(
    c: &impl GenericClient,
) -> StoreResult<Vec<(SessionStatus, u64)>> {
    let mut counts: Vec<(SessionStatus, u64)> =
        SessionStatus::ALL.iter().map(|s| (*s, 0)).collect();
    let st = prep(c, "SELECT status, COUNT(*) FROM sessions GROUP BY status").await?;
    for row in c.query(&st, &[]).await.map_err(db_err)? {
        let status = col_status(&row, 0)?;
        let n = col_u64(&row, 1)?;
        if let Some(slot) = counts.iter_mut().find(|(s, _)| *s == status) {
            slot.1 = n;
        }
    }
    Ok(counts)
}

// ---- messages ----

/// One statement for any number of messages: the columns travel as arrays and come back as rows,
/// numbered from `$2`.
pub(crate) const INSERT_MESSAGES: &str = "INSERT INTO messages \
     (session_id, seq, role, body, model_used, cost_usd, created_at) \
     SELECT $1, $2::bigint + m.n - 1, m.role, m.body, m.model_used, m.cost_usd, m.created_at \
     FROM UNNEST($3::text[], $4::text[], $5::text[], $6::float8[], $7::timestamptz[]) \
     WITH ORDINALITY AS m (role, body, model_used, cost_usd, created_at, n)";

/// Inserts `messages` at seqs `start..` with `st` (prepared [`INSERT_MESSAGES`]); `bodies` are
/// the bodies as stored ([`encode_bodies`]: `bodies[i]` is the body of `messages[i]`).
pub(crate) async fn insert_messages(
    c: &impl GenericClient,
    st: &Statement,
    session: Uuid,
    start: i64,
    messages: &[NewMessage],
    bodies: Vec<Cow<'_, str>>,
) -> StoreResult<()> {
    if messages.is_empty() {
        return Ok(());
    }
    if bodies.len() != messages.len() {
        return Err(StoreError::Backend(
            "encoded bodies do not match the messages".to_owned(),
        ));
    }
    let roles: Vec<Cow<'_, str>> = messages.iter().map(|m| text(&m.role)).collect();
    let models: Vec<Option<Cow<'_, str>>> =
        messages.iter().map(|m| opt_text(&m.model_used)).collect();
    let costs: Vec<Option<f64>> = messages.iter().map(|m| m.cost_usd).collect();
    let created: Vec<Timestamp> = messages.iter().map(|m| m.created_at).collect();
    c.execute(
        st,
        &[&session, &start, &roles, &bodies, &models, &costs, &created],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

pub(crate) fn len_i64(messages: &[NewMessage]) -> StoreResult<i64> {
    i64::try_from(messages.len()).map_err(|_| StoreError::Backend("too many messages".to_owned()))
}

pub(crate) async fn list_messages(
    c: &impl GenericClient,
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
    // PostgreSQL reads LIMIT NULL as "no limit".
    let limit = limit.map(i64::from);
    let st = prep(
        c,
        concat!(
            "SELECT ",
            message_cols!(),
            " FROM messages WHERE session_id = $1 AND seq > $2 \
             ORDER BY seq LIMIT $3"
        ),
    )
    .await?;
    let found = c
        .query(&st, &[&session, &after, &limit])
        .await
        .map_err(db_err)?;
    let sid = session.to_string();
    rows(&found, |r| message_row(r, seal, &sid))
}

// ---- snapshots ----

pub(crate) const INSERT_SNAPSHOT: &str = "INSERT INTO snapshots \
     (id, session_id, kind, step_count, message_count, model, current_task, created_at, state) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)";

/// Writes a snapshot with the given counts (the session's, as this transaction left them). Its
/// record is [`snapshot_written`]'s: nothing is read back.
pub(crate) async fn insert_snapshot(
    c: &impl GenericClient,
    seal: &Sealer,
    st: &Statement,
    session: Uuid,
    (steps, messages): (u64, u64),
    snap: &NewSnapshot,
) -> StoreResult<()> {
    let key = snap.id.to_string();
    let state = json(&snap.state)?;
    let state = seal.seal(Column::SnapshotState, &key, &state)?;
    let task = seal_text(seal, Column::SnapshotTask, &key, &snap.current_task)?;
    c.execute(
        st,
        &[
            &snap.id,
            &session,
            &snap.kind.as_str(),
            &int(steps)?,
            &int(messages)?,
            &opt_text(&snap.model),
            &task,
            &stored_time(snap.created_at),
            &state,
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

/// The record of `snap` written for `session` with these counts (by [`insert_snapshot`],
/// [`BEGIN_TURN`] or [`FINISH_TURN`]): equal to what a read of its row returns, so the writes
/// need not return the row and have it decoded.
fn snapshot_written(session: Uuid, counts: (u64, u64), snap: NewSnapshot) -> SnapshotRecord {
    written_snapshot(session, counts, snap, stored_text)
}

fn counts(s: &SessionRecord) -> (u64, u64) {
    (s.step_count, s.message_count)
}

/// Whether [`FINISH_TURN`] wrote the checkpoint: a counted step whose new count (the session's
/// after it) is a multiple of `every`.
fn checkpoint_due(count_step: bool, every: u32, session: &SessionRecord) -> bool {
    count_step && every > 0 && session.step_count.is_multiple_of(u64::from(every))
}

pub(crate) async fn latest_snapshot(
    c: &impl GenericClient,
    seal: &Sealer,
    session: Uuid,
    kind: Option<SnapshotKind>,
) -> StoreResult<Option<SnapshotRecord>> {
    let found = match kind {
        Some(kind) => {
            let st = prep(
                c,
                concat!(
                    "SELECT ",
                    snapshot_cols!(),
                    " FROM snapshots WHERE session_id = $1 AND kind = $2 \
                     ORDER BY ord DESC LIMIT 1"
                ),
            )
            .await?;
            c.query_opt(&st, &[&session, &kind.as_str()]).await
        }
        None => {
            let st = prep(
                c,
                concat!(
                    "SELECT ",
                    snapshot_cols!(),
                    " FROM snapshots WHERE session_id = $1 \
                     ORDER BY ord DESC LIMIT 1"
                ),
            )
            .await?;
            c.query_opt(&st, &[&session]).await
        }
    };
    found
        .map_err(db_err)?
        .map(|r| snapshot_row(&r, seal))
        .transpose()
}

pub(crate) async fn get_snapshot(
    c: &impl GenericClient,
    seal: &Sealer,
    id: Uuid,
) -> StoreResult<Option<SnapshotRecord>> {
    let st = prep(
        c,
        concat!("SELECT ", snapshot_cols!(), " FROM snapshots WHERE id = $1"),
    )
    .await?;
    c.query_opt(&st, &[&id])
        .await
        .map_err(db_err)?
        .map(|r| snapshot_row(&r, seal))
        .transpose()
}

pub(crate) async fn list_snapshots(
    c: &impl GenericClient,
    seal: &Sealer,
    session: Uuid,
    limit: u32,
) -> StoreResult<Vec<SnapshotRecord>> {
    let st = prep(
        c,
        concat!(
            "SELECT ",
            snapshot_cols!(),
            " FROM snapshots WHERE session_id = $1 ORDER BY ord DESC LIMIT $2"
        ),
    )
    .await?;
    let found = c
        .query(&st, &[&session, &i64::from(limit)])
        .await
        .map_err(db_err)?;
    rows(&found, |r| snapshot_row(r, seal))
}

// ---- tether ----

pub(crate) async fn tether_pending(
    c: &impl GenericClient,
    seal: &Sealer,
    session: Uuid,
    after: Option<u64>,
    limit: u32,
) -> StoreResult<Vec<TetherEntry>> {
    let after = match after {
        Some(a) => int(a)?,
        None => 0,
    };
    let st = prep(
        c,
        concat!(
            "SELECT ",
            tether_cols!(),
            " FROM tether WHERE session_id = $1 AND seq > $2 \
             ORDER BY seq LIMIT $3"
        ),
    )
    .await?;
    let found = c
        .query(&st, &[&session, &after, &i64::from(limit)])
        .await
        .map_err(db_err)?;
    rows(&found, |r| tether_row(r, seal))
}

async fn count(
    c: &impl GenericClient,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> StoreResult<u64> {
    let st = prep(c, sql).await?;
    let row = c.query_one(&st, params).await.map_err(db_err)?;
    col_u64(&row, 0)
}

pub(crate) async fn tether_count(c: &impl GenericClient, session: Uuid) -> StoreResult<u64> {
    count(
        c,
        "SELECT COUNT(*) FROM tether WHERE session_id = $1",
        &[&session],
    )
    .await
}

pub(crate) async fn tether_issued(c: &impl GenericClient, session: Uuid) -> StoreResult<u64> {
    // `tether_seq` is the next seq to issue.
    let st = prep(c, "SELECT tether_seq - 1 FROM sessions WHERE id = $1").await?;
    let row = c
        .query_opt(&st, &[&session])
        .await
        .map_err(db_err)?
        .ok_or(StoreError::NotFound)?;
    col_u64(&row, 0)
}

pub(crate) async fn tether_depth_total(c: &impl GenericClient) -> StoreResult<u64> {
    count(c, "SELECT COUNT(*) FROM tether", &[]).await
}

pub(crate) async fn tether_ack(
    c: &impl GenericClient,
    session: Uuid,
    up_to: u64,
) -> StoreResult<u64> {
    // Clamp rather than fail: "everything up to a huge seq" is simply everything.
    let up_to = i64::try_from(up_to).unwrap_or(i64::MAX);
    let st = prep(c, "DELETE FROM tether WHERE session_id = $1 AND seq <= $2").await?;
    c.execute(&st, &[&session, &up_to]).await.map_err(db_err)
}

pub(crate) async fn tether_remove(
    c: &impl GenericClient,
    session: Uuid,
    seqs: &[u64],
) -> StoreResult<u64> {
    // A seq beyond i64 was never handed out, so there is nothing to remove.
    let seqs: Vec<i64> = seqs.iter().filter_map(|s| i64::try_from(*s).ok()).collect();
    if seqs.is_empty() {
        return Ok(0);
    }
    let st = prep(
        c,
        "DELETE FROM tether WHERE session_id = $1 AND seq = ANY($2)",
    )
    .await?;
    c.execute(&st, &[&session, &seqs]).await.map_err(db_err)
}

// ---- turns ----

pub(crate) async fn get_turn(
    c: &impl GenericClient,
    seal: &Sealer,
    id: Uuid,
) -> StoreResult<Option<TurnRecord>> {
    let st = prep(
        c,
        concat!("SELECT ", turn_cols!(), " FROM turns WHERE id = $1"),
    )
    .await?;
    c.query_opt(&st, &[&id])
        .await
        .map_err(db_err)?
        .map(|r| turn_row(&r, seal))
        .transpose()
}

/// The seq of the first message a write appended, from the session's count after it.
fn first_seq(session: &SessionRecord, appended: i64) -> StoreResult<i64> {
    Ok(int(session.message_count)? - appended)
}

fn to_u64(v: i64) -> StoreResult<u64> {
    u64::try_from(v).map_err(|_| StoreError::Backend("negative message_count".to_owned()))
}

/// `begin_turn` on an existing session, as one statement: the session row first (its lock
/// serialises the turns of a session; a forbidden status change matches no row, and then nothing
/// else is written), then the turn, the messages (numbered from the count it left) and the
/// pre-action snapshot (with the counts that include them). Returns one row, the session's
/// columns; none when the session is missing or the change refused (and then no snapshot either).
const BEGIN_TURN: &str = concat!(
    "WITH s AS (UPDATE sessions SET message_count = message_count + $2, \
     status = COALESCE($3, status), last_task = COALESCE($4, last_task), \
     model = COALESCE($5, model), updated_at = $6, message_bytes = message_bytes + $22 \
     WHERE id = $1 AND ($7::text[] IS NULL OR status = ANY($7)) \
     RETURNING ",
    session_cols!(),
    "), \
     t AS (INSERT INTO turns (id, session_id, state, started_at, owner) \
     SELECT $8::uuid, s.id, $9::text, $6, $21::text FROM s), \
     m AS (INSERT INTO messages (session_id, seq, role, body, model_used, cost_usd, created_at) \
     SELECT s.id, s.message_count - $2 + v.n - 1, v.role, v.body, v.model_used, v.cost_usd, \
     v.created_at \
     FROM s, UNNEST($10::text[], $11::text[], $12::text[], $13::float8[], $14::timestamptz[]) \
     WITH ORDINALITY AS v (role, body, model_used, cost_usd, created_at, n)), \
     p AS (INSERT INTO snapshots \
     (id, session_id, kind, step_count, message_count, model, current_task, created_at, state) \
     SELECT $15::uuid, s.id, $16::text, s.step_count, s.message_count, $17::text, $18::text, \
     $19::timestamptz, $20::text FROM s WHERE $15::uuid IS NOT NULL) \
     SELECT s.* FROM s"
);

/// `finish_turn`'s writes as one statement. The turn is completed first and everything else only
/// if that matched (or there is no turn): a turn that is no longer running leaves the session as it
/// was, so the statement can commit on its own. Then the session row (counts past the new messages
/// and the step, the tether seq taken under its lock and with `tether_enabled` as it is at commit
/// time), the messages, the snapshots in the order given (the checkpoint only when the new step
/// count is a multiple of `$21`, as [`checkpoint_due`] says) and the tether entry. Returns one row,
/// the session's columns and its tether seq (the next to hand out); none when the session is
/// missing or the turn not running.
const FINISH_TURN: &str = concat!(
    "WITH t AS (UPDATE turns SET state = $8::text, finished_at = $4 \
     WHERE $7::uuid IS NOT NULL AND id = $7 AND session_id = $1 AND state = 'running' \
     RETURNING 1), \
     s AS (UPDATE sessions SET message_count = message_count + $2, \
     step_count = step_count + $3, updated_at = $4, message_bytes = message_bytes + $27, \
     tether_seq = tether_seq + CASE WHEN $5 AND (tether_enabled OR NOT $6) THEN 1 ELSE 0 END \
     WHERE id = $1 AND ($7::uuid IS NULL OR EXISTS (SELECT 1 FROM t)) \
     RETURNING ",
    session_cols!(),
    ", tether_seq), \
     m AS (INSERT INTO messages (session_id, seq, role, body, model_used, cost_usd, created_at) \
     SELECT s.id, s.message_count - $2 + v.n - 1, v.role, v.body, v.model_used, v.cost_usd, \
     v.created_at \
     FROM s, UNNEST($9::text[], $10::text[], $11::text[], $12::float8[], $13::timestamptz[]) \
     WITH ORDINALITY AS v (role, body, model_used, cost_usd, created_at, n)), \
     p AS (INSERT INTO snapshots \
     (id, session_id, kind, step_count, message_count, model, current_task, created_at, state) \
     SELECT v.id, s.id, v.kind, s.step_count, s.message_count, v.model, v.task, v.created_at, \
     v.state \
     FROM s, UNNEST($14::uuid[], $15::text[], $16::text[], $17::text[], $18::timestamptz[], \
     $19::text[], $20::bool[]) \
     WITH ORDINALITY AS v (id, kind, model, task, created_at, state, checkpoint, n) \
     WHERE NOT v.checkpoint OR ($3 = 1 AND $21::bigint > 0 AND s.step_count % $21 = 0) \
     ORDER BY v.n), \
     q AS (INSERT INTO tether (session_id, seq, role, content, model_used, created_at, chunk_id) \
     SELECT s.id, s.tether_seq - 1, $22::text, $23::text, $24::text, $25::timestamptz, $26::uuid \
     FROM s WHERE $5 AND (s.tether_enabled OR NOT $6)) \
     SELECT s.* FROM s"
);

/// Column of [`FINISH_TURN`]'s row after the session's: its tether seq.
const FINISH_TETHER_COL: usize = 13;

/// The columns of messages to append, as the arrays the statements unnest.
struct MessageArrays<'a> {
    roles: Vec<Cow<'a, str>>,
    bodies: Vec<Cow<'a, str>>,
    /// The bodies' total size, what `sessions.message_bytes` counts.
    bytes: i64,
    models: Vec<Option<Cow<'a, str>>>,
    costs: Vec<Option<f64>>,
    created: Vec<Timestamp>,
}

impl<'a> MessageArrays<'a> {
    fn new(seal: &Sealer, session: Uuid, messages: &'a [NewMessage]) -> StoreResult<Self> {
        let (bodies, bytes) = encode_bodies(seal, &session.to_string(), messages)?;
        Ok(Self {
            roles: messages.iter().map(|m| text(&m.role)).collect(),
            bytes,
            bodies,
            models: messages.iter().map(|m| opt_text(&m.model_used)).collect(),
            costs: messages.iter().map(|m| m.cost_usd).collect(),
            created: messages.iter().map(|m| m.created_at).collect(),
        })
    }
}

/// Whether `finish` is only the one statement [`FINISH_TURN`] (a turn's reply: no idempotency
/// record to complete, and no hold to check, as a pushed turn has).
pub(crate) fn finish_is_one_statement(f: &FinishTurn) -> bool {
    f.idempotency_done.is_none() && f.turn_id.is_some()
}

/// Runs on a connection with a transaction open ([`crate::postgres::PostgresStore`]'s `write`).
/// The statements are sent together in order (pipelined), so a turn costs one round trip and its
/// COMMIT. The hold guard ([`HOLD_GUARD`]) reads right after [`BEGIN_TURN`] locked the session
/// row: a lease committed before is seen, and none can commit before this transaction ends.
pub(crate) async fn begin_turn(
    c: &Tx,
    seal: &Sealer,
    b: BeginTurn,
) -> StoreResult<BeginTurnOutcome> {
    if b.create.as_ref().is_some_and(|c| c.id != b.session_id) {
        return Err(conflict(ConflictKind::CreatedIdDiffers));
    }
    // Everything prepared first (a cached statement costs nothing), so the executions below are
    // sent in this order: a first-time prepare would otherwise let a later statement overtake.
    let (create_st, main, guard, claim, retry) = tokio::try_join!(
        async {
            match &b.create {
                Some(_) => prep(c, INSERT_SESSION).await.map(Some),
                None => Ok(None),
            }
        },
        prep(c, BEGIN_TURN),
        prep(c, HOLD_GUARD),
        async {
            match &b.idempotency {
                Some(_) => prep(
                    c,
                    "INSERT INTO idempotency (key, session_id, turn_id, fingerprint, state, \
                     created_session, created_at, updated_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $7) ON CONFLICT (key) DO NOTHING",
                )
                .await
                .map(Some),
                None => Ok(None),
            }
        },
        async {
            match &b.retry_key {
                Some(_) => prep(
                    c,
                    "UPDATE idempotency SET state = $4, turn_id = $3, updated_at = $5 \
                     WHERE key = $1 AND session_id = $2 AND state = $6",
                )
                .await
                .map(Some),
                None => Ok(None),
            }
        },
    )?;
    let appended = len_i64(&b.new_messages)?;
    let allowed = b.status.map(allowed_from);
    let arrays = MessageArrays::new(seal, b.session_id, &b.new_messages)?;
    let sid = b.session_id.to_string();
    let last_task = seal_text(seal, Column::SessionLastTask, &sid, &b.last_task)?;
    let pre = b.pre_action.as_ref();
    let pre_created = pre.map(|s| stored_time(s.created_at));
    let (pre_state, pre_task) = match pre {
        Some(s) => {
            let key = s.id.to_string();
            let state = json(&s.state)?;
            let state = seal.seal(Column::SnapshotState, &key, &state)?.into_owned();
            let task = seal_text(seal, Column::SnapshotTask, &key, &s.current_task)?;
            (Some(state), task)
        }
        None => (None, None),
    };
    let in_progress = idem_state(IdempotencyState::InProgress);

    let create = async {
        match (&b.create, &create_st) {
            (Some(s), Some(st)) => exec_insert_session(c, seal, st, s).await,
            _ => Ok(()),
        }
    };
    let main = async {
        c.query(
            &main,
            &[
                &b.session_id,
                &appended,
                &b.status.map(SessionStatus::as_str),
                &last_task,
                &opt_text(&b.model),
                &b.now,
                &allowed,
                &b.turn_id,
                &turn_state(TurnState::Running),
                &arrays.roles,
                &arrays.bodies,
                &arrays.models,
                &arrays.costs,
                &arrays.created,
                &pre.map(|s| s.id),
                &pre.map(|s| s.kind.as_str()),
                &pre.and_then(|s| opt_text(&s.model)),
                &pre_task,
                &pre_created,
                &pre_state,
                &opt_text(&b.owner),
                &arrays.bytes,
            ],
        )
        .await
        .map_err(db_err)
    };
    let guard = async { c.query(&guard, &[&b.session_id]).await.map_err(db_err) };
    let claim = async {
        let (Some(idem), Some(st)) = (&b.idempotency, &claim) else {
            return Ok(());
        };
        let claimed = c
            .execute(
                st,
                &[
                    &idem.key,
                    &b.session_id,
                    &b.turn_id,
                    &idem.fingerprint,
                    &in_progress,
                    &idem.created_session,
                    &b.now,
                ],
            )
            .await
            .map_err(db_err)?;
        if claimed == 0 {
            return Err(conflict(ConflictKind::IdempotencyKeyClaimed));
        }
        Ok(())
    };
    let retry = async {
        let (Some(key), Some(st)) = (&b.retry_key, &retry) else {
            return Ok(());
        };
        let n = c
            .execute(
                st,
                &[
                    key,
                    &b.session_id,
                    &b.turn_id,
                    &in_progress,
                    &b.now,
                    &idem_state(IdempotencyState::Failed),
                ],
            )
            .await
            .map_err(db_err)?;
        if n == 0 {
            return Err(conflict(ConflictKind::IdempotencyKeyNotRetryable));
        }
        Ok(())
    };
    let (create, main, guard, claim, retry) = tokio::join!(create, main, guard, claim, retry);
    // A refused or missing session is the error to report, before what it made fail after it.
    let found = match &main {
        Ok(rows) => rows.first(),
        Err(_) => None,
    };
    if create.is_ok() && main.is_ok() && found.is_none() {
        return Err(match b.status {
            Some(to) => refused_transition(c, b.session_id, to).await,
            None => StoreError::NotFound,
        });
    }
    if let Ok(held) = &guard
        && let Some(kind) = guard_refusal(held, b.now)?
    {
        return Err(conflict(kind));
    }
    first_error([
        create.err(),
        main.as_ref().err().cloned(),
        guard.err(),
        claim.err(),
        retry.err(),
    ])?;
    let session = session_row(found.ok_or(StoreError::NotFound)?, seal)?;
    Ok(BeginTurnOutcome {
        pre_action_snapshot: b
            .pre_action
            .map(|s| snapshot_written(b.session_id, counts(&session), s)),
        session,
        new_messages: b.new_messages,
    })
}

/// Like [`begin_turn`]: on a connection with a transaction open, or on its own when
/// [`finish_is_one_statement`]. A pushed turn (no `turn_id`) reads the hold guard right after
/// [`FINISH_TURN`] locked the session row, as `begin_turn` does.
pub(crate) async fn finish_turn(
    c: &Tx,
    seal: &Sealer,
    f: FinishTurn,
) -> StoreResult<FinishTurnOutcome> {
    let pushed = f.turn_id.is_none();
    let (main, guard, idem) = tokio::try_join!(
        prep(c, FINISH_TURN),
        async {
            match pushed {
                true => prep(c, HOLD_GUARD).await.map(Some),
                false => Ok(None),
            }
        },
        async {
            match &f.idempotency_done {
                Some(_) => prep(
                    c,
                    "UPDATE idempotency SET state = $3, response_status = $4, \
                     response_body = $5, updated_at = $6 WHERE key = $1 AND session_id = $2",
                )
                .await
                .map(Some),
                None => Ok(None),
            }
        },
    )?;
    let appended = len_i64(&f.messages)?;
    let arrays = MessageArrays::new(seal, f.session_id, &f.messages)?;
    let sid = f.session_id.to_string();
    // The post-action snapshot, then the checkpoint (written only at a multiple of `every`).
    let snaps: Vec<(&NewSnapshot, bool)> = f
        .post_action
        .iter()
        .map(|s| (s, false))
        .chain(f.checkpoint.iter().map(|(s, _)| (s, true)))
        .collect();
    let every = f
        .checkpoint
        .as_ref()
        .map_or(0, |(_, every)| i64::from(*every));
    let snap_ids: Vec<Uuid> = snaps.iter().map(|(s, _)| s.id).collect();
    let snap_kinds: Vec<&str> = snaps.iter().map(|(s, _)| s.kind.as_str()).collect();
    let snap_models: Vec<Option<Cow<'_, str>>> =
        snaps.iter().map(|(s, _)| opt_text(&s.model)).collect();
    let snap_tasks: Vec<Option<String>> = snaps
        .iter()
        .map(|(s, _)| {
            seal_text(
                seal,
                Column::SnapshotTask,
                &s.id.to_string(),
                &s.current_task,
            )
        })
        .collect::<StoreResult<_>>()?;
    let snap_created: Vec<Timestamp> = snaps
        .iter()
        .map(|(s, _)| stored_time(s.created_at))
        .collect();
    let snap_states: Vec<String> = snaps
        .iter()
        .map(|(s, _)| {
            let state = json(&s.state)?;
            Ok(seal
                .seal(Column::SnapshotState, &s.id.to_string(), &state)?
                .into_owned())
        })
        .collect::<StoreResult<_>>()?;
    let snap_checkpoint: Vec<bool> = snaps.iter().map(|(_, c)| *c).collect();
    let tether = f.tether.as_ref();
    let idem_body = match &f.idempotency_done {
        Some((key, _, body)) => Some(
            seal.seal(Column::IdempotencyResponse, key, &json(body)?)?
                .into_owned(),
        ),
        None => None,
    };
    let tether_content = match tether {
        Some(t) => seal_text(seal, Column::TetherContent, &sid, &t.content)?,
        None => None,
    };

    let main = async {
        c.query(
            &main,
            &[
                &f.session_id,
                &appended,
                &i64::from(f.count_step),
                &f.now,
                &tether.is_some(),
                &f.tether_only_if_enabled,
                &f.turn_id,
                &turn_state(TurnState::Done),
                &arrays.roles,
                &arrays.bodies,
                &arrays.models,
                &arrays.costs,
                &arrays.created,
                &snap_ids,
                &snap_kinds,
                &snap_models,
                &snap_tasks,
                &snap_created,
                &snap_states,
                &snap_checkpoint,
                &every,
                &tether.map(|t| text(&t.role)),
                &tether_content,
                &tether.and_then(|t| opt_text(&t.model_used)),
                &tether.map(|t| t.created_at),
                &tether.map(|t| t.chunk_id),
                &arrays.bytes,
            ],
        )
        .await
        .map_err(db_err)
    };
    let idem = async {
        let (Some((key, status, _)), Some(st), Some(body), None) =
            (&f.idempotency_done, &idem, &idem_body, &f.idempotency_claim)
        else {
            return Ok(());
        };
        let n = c
            .execute(
                st,
                &[
                    key,
                    &f.session_id,
                    &idem_state(IdempotencyState::Done),
                    &i32::from(*status),
                    body,
                    &f.now,
                ],
            )
            .await
            .map_err(db_err)?;
        if n == 0 {
            return Err(conflict(ConflictKind::IdempotencyKeyNotHeld));
        }
        Ok(())
    };
    let guard = async {
        match &guard {
            Some(st) => c
                .query(st, &[&f.session_id])
                .await
                .map(Some)
                .map_err(db_err),
            None => Ok(None),
        }
    };
    let (main, guard, idem) = tokio::join!(main, guard, idem);
    let rows = main?;
    let Some(first) = rows.first() else {
        // Nothing written: the session is missing, or the turn is not running in it.
        return Err(match current_status(c, f.session_id).await? {
            None => StoreError::NotFound,
            Some(_) => conflict(ConflictKind::TurnNotRunning),
        });
    };
    if let Some(held) = guard?
        && let Some(kind) = guard_refusal(&held, f.now)?
    {
        return Err(conflict(kind));
    }
    idem?;
    let session = session_row(first, seal)?;
    let next_tether: i64 = get(first, FINISH_TETHER_COL)?;
    let tethered = tether.is_some() && (session.tether_enabled || !f.tether_only_if_enabled);
    let tether_seq = if tethered {
        Some(to_u64(next_tether - 1)?)
    } else {
        None
    };
    if let (Some((key, status, _)), Some(body), Some(fingerprint)) =
        (&f.idempotency_done, &idem_body, &f.idempotency_claim)
    {
        // After the main statement: the record keeps the tether seq it issued.
        let st = prep(
            c,
            "INSERT INTO idempotency (key, session_id, turn_id, fingerprint, state, \
             created_session, response_status, response_body, tether_seq, created_at, \
             updated_at) VALUES ($1, $2, NULL, $3, $4, false, $5, $6, $7, $8, $8) \
             ON CONFLICT (key) DO NOTHING",
        )
        .await?;
        let seq: Option<i64> = tether_seq.map(|_| next_tether - 1);
        let created = c
            .execute(
                &st,
                &[
                    key,
                    &f.session_id,
                    fingerprint,
                    &idem_state(IdempotencyState::Done),
                    &i32::from(*status),
                    body,
                    &seq,
                    &f.now,
                ],
            )
            .await
            .map_err(db_err)?;
        if created == 0 {
            return Err(conflict(ConflictKind::IdempotencyKeyClaimed));
        }
    }
    let post_action = f
        .post_action
        .map(|s| snapshot_written(f.session_id, counts(&session), s));
    let checkpoint = match f.checkpoint {
        Some((s, every)) if checkpoint_due(f.count_step, every, &session) => {
            Some(snapshot_written(f.session_id, counts(&session), s))
        }
        _ => None,
    };
    Ok(FinishTurnOutcome {
        tether_seq,
        post_action_snapshot: post_action,
        checkpoint_snapshot: checkpoint,
        first_message_seq: to_u64(first_seq(&session, appended)?)?,
        session,
    })
}

pub(crate) async fn record_progress(
    tx: &Tx,
    seal: &Sealer,
    p: TurnProgress,
) -> StoreResult<TurnProgressOutcome> {
    let not_running = || conflict(ConflictKind::TurnNotRunning);
    let (update, running, messages, snapshot) = tokio::try_join!(
        prep(
            tx,
            concat!(
                "UPDATE sessions SET message_count = message_count + $2, updated_at = $3, \
                 message_bytes = message_bytes + $4 WHERE id = $1 RETURNING ",
                session_cols!()
            )
        ),
        prep(
            tx,
            "SELECT 1 FROM turns WHERE id = $1 AND session_id = $2 AND state = 'running'"
        ),
        prep(tx, INSERT_MESSAGES),
        prep(tx, INSERT_SNAPSHOT),
    )?;
    // The session row first, like `finish_turn`: once its lock is held, a finish of this turn has
    // either committed (and the check below sees it) or waits for this write.
    let appended = len_i64(&p.messages)?;
    let (bodies, bytes) = encode_bodies(seal, &p.session_id.to_string(), &p.messages)?;
    let Some(row) = tx
        .query_opt(&update, &[&p.session_id, &appended, &p.now, &bytes])
        .await
        .map_err(db_err)?
    else {
        // No session, so no turn of it can be running.
        return Err(not_running());
    };
    let session = session_row(&row, seal)?;
    let start = first_seq(&session, appended)?;
    let running = async {
        match tx
            .query_opt(&running, &[&p.turn_id, &p.session_id])
            .await
            .map_err(db_err)?
        {
            Some(_) => Ok(()),
            None => Err(not_running()),
        }
    };
    let messages = insert_messages(tx, &messages, p.session_id, start, &p.messages, bodies);
    // One after another, so they are numbered in order (a tool round writes one or two).
    let snapshots = async {
        for snap in &p.snapshots {
            insert_snapshot(tx, seal, &snapshot, p.session_id, counts(&session), snap).await?;
        }
        Ok(())
    };
    let (running, messages, snapshots) = tokio::join!(running, messages, snapshots);
    first_error([
        running.err(),
        messages.err(),
        snapshots.as_ref().err().cloned(),
    ])?;
    let snapshots = p
        .snapshots
        .into_iter()
        .map(|s| snapshot_written(p.session_id, counts(&session), s))
        .collect();
    Ok(TurnProgressOutcome {
        session,
        snapshots,
        first_message_seq: to_u64(start)?,
    })
}

pub(crate) async fn fail_turn(tx: &Tx, seal: &Sealer, f: FailTurn) -> StoreResult<()> {
    // The lock makes a concurrent finish either complete first (then this is `Conflict`) or wait.
    let st = prep(
        tx,
        concat!(
            "SELECT ",
            turn_cols!(),
            " FROM turns WHERE id = $1 FOR UPDATE"
        ),
    )
    .await?;
    let turn = tx
        .query_opt(&st, &[&f.turn_id])
        .await
        .map_err(db_err)?
        .map(|r| turn_row(&r, seal))
        .transpose()?
        .filter(|t| t.session_id == f.session_id)
        .ok_or(StoreError::NotFound)?;
    match turn.state {
        TurnState::Done => return Err(conflict(ConflictKind::TurnFinished)),
        // Already failed (e.g. by restart recovery): keep its first error, still release the key.
        TurnState::Failed => {}
        TurnState::Running => {
            // An upstream's error text can quote the conversation.
            let error = seal
                .seal(Column::TurnError, &f.turn_id.to_string(), &text(&f.error))?
                .into_owned();
            let st = prep(
                tx,
                "UPDATE turns SET state = $2, finished_at = $3, error = $4 WHERE id = $1",
            )
            .await?;
            tx.execute(
                &st,
                &[&f.turn_id, &turn_state(TurnState::Failed), &f.now, &error],
            )
            .await
            .map_err(db_err)?;
        }
    }
    if let Some(key) = &f.idempotency_key {
        let st = prep(
            tx,
            "UPDATE idempotency SET state = $3, updated_at = $4 \
             WHERE key = $1 AND session_id = $2 AND state = $5",
        )
        .await?;
        tx.execute(
            &st,
            &[
                key,
                &f.session_id,
                &idem_state(IdempotencyState::Failed),
                &f.now,
                &idem_state(IdempotencyState::InProgress),
            ],
        )
        .await
        .map_err(db_err)?;
    }
    Ok(())
}

pub(crate) async fn recover_interrupted_turns(
    tx: &Tx,
    seal: &Sealer,
    now: Timestamp,
) -> StoreResult<Vec<TurnRecord>> {
    let st = prep(
        tx,
        concat!(
            "UPDATE turns SET state = $1, finished_at = $2, error = $3 \
             WHERE state = 'running' RETURNING ",
            turn_cols!()
        ),
    )
    .await?;
    let found = tx
        .query(&st, &[&turn_state(TurnState::Failed), &now, &INTERRUPTED])
        .await
        .map_err(db_err)?;
    let turns = rows(&found, |r| turn_row(r, seal))?;
    release_keys(tx, &turns, now).await?;
    Ok(turns)
}

pub(crate) async fn replica_heartbeat(
    c: &impl GenericClient,
    replica: &str,
    now: Timestamp,
) -> StoreResult<()> {
    let st = prep(
        c,
        "INSERT INTO replicas (id, heartbeat_at) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
    )
    .await?;
    c.execute(&st, &[&text(replica), &now])
        .await
        .map_err(db_err)?;
    Ok(())
}

/// [`recover_interrupted_turns`] for the running turns of no live replica: no owner, or an owner
/// without a heartbeat at or after `stale_before`. Of replicas recovering at once, each turn is
/// failed (and returned) by one: the others' updates wait for its row lock, then find it failed.
pub(crate) async fn recover_orphaned_turns(
    tx: &Tx,
    seal: &Sealer,
    now: Timestamp,
    stale_before: Timestamp,
) -> StoreResult<Vec<TurnRecord>> {
    let st = prep(
        tx,
        concat!(
            "UPDATE turns SET state = $1, finished_at = $2, error = $3 \
             WHERE state = 'running' AND (owner IS NULL OR NOT EXISTS \
             (SELECT 1 FROM replicas r WHERE r.id = turns.owner AND r.heartbeat_at >= $4)) \
             RETURNING ",
            turn_cols!()
        ),
    )
    .await?;
    let found = tx
        .query(
            &st,
            &[
                &turn_state(TurnState::Failed),
                &now,
                &INTERRUPTED,
                &stale_before,
            ],
        )
        .await
        .map_err(db_err)?;
    let turns = rows(&found, |r| turn_row(r, seal))?;
    release_keys(tx, &turns, now).await?;
    // A replica that is gone for good would otherwise keep its row forever. One that began a turn
    // since the update above is alive after all, and keeps its row.
    let st = prep(
        tx,
        "DELETE FROM replicas WHERE heartbeat_at < $1 AND NOT EXISTS \
         (SELECT 1 FROM turns WHERE state = 'running' AND owner = replicas.id)",
    )
    .await?;
    tx.execute(&st, &[&stale_before]).await.map_err(db_err)?;
    Ok(turns)
}

/// Makes the idempotency keys held by `turns`, which recovery just failed, retryable.
async fn release_keys(tx: &Tx, turns: &[TurnRecord], now: Timestamp) -> StoreResult<()> {
    if turns.is_empty() {
        return Ok(());
    }
    // The keys those turns held would otherwise stay in progress forever and block every retry.
    let ids: Vec<Uuid> = turns.iter().map(|t| t.id).collect();
    let st = prep(
        tx,
        "UPDATE idempotency SET state = $2, updated_at = $3 \
         WHERE turn_id = ANY($1) AND state = $4",
    )
    .await?;
    tx.execute(
        &st,
        &[
            &ids,
            &idem_state(IdempotencyState::Failed),
            &now,
            &idem_state(IdempotencyState::InProgress),
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

// ---- idempotency ----

pub(crate) async fn get_idempotency(
    c: &impl GenericClient,
    seal: &Sealer,
    key: &str,
) -> StoreResult<Option<IdempotencyRecord>> {
    let st = prep(
        c,
        concat!(
            "SELECT ",
            idempotency_cols!(),
            " FROM idempotency WHERE key = $1"
        ),
    )
    .await?;
    c.query_opt(&st, &[&key])
        .await
        .map_err(db_err)?
        .map(|r| idempotency_row(&r, seal))
        .transpose()
}
