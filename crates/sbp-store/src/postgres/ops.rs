//! The store's operations on PostgreSQL. A multi-statement write runs inside one transaction (the
//! caller commits only an `Ok` and rolls back an `Err`); one that changes a session takes the
//! session row's lock first, so a session's writes serialise while other sessions' proceed. The
//! independent statements that follow are sent together (tokio-postgres pipelines requests issued
//! concurrently on one connection), so a turn costs a few round trips instead of one per row.

use std::borrow::Cow;

use deadpool_postgres::{GenericClient, Transaction};
use sbp_protocol::{SessionStatus, SnapshotKind};
use tokio_postgres::Statement;
use uuid::Uuid;

use super::codec::{
    col_status, col_u64, db_err, first_error, get, idem_state, idempotency_cols, idempotency_row,
    int, json, message_cols, message_row, opt_text, rows, session_cols, session_row, snapshot_cols,
    snapshot_row, tether_cols, tether_row, text, turn_cols, turn_row, turn_state,
};
use crate::{
    BeginTurn, BeginTurnOutcome, FailTurn, FinishTurn, FinishTurnOutcome, IdempotencyRecord,
    IdempotencyState, MessageRecord, NewMessage, NewSession, NewSnapshot, NewTetherEntry,
    SessionRecord, SnapshotRecord, StoreError, StoreResult, TetherEntry, Timestamp, TurnProgress,
    TurnProgressOutcome, TurnRecord, TurnState,
};

/// Error text of turns failed by `recover_interrupted_turns` (the same as SQLite's).
pub(crate) const INTERRUPTED: &str = "interrupted by gateway restart";

pub(crate) type Tx<'a> = Transaction<'a>;

pub(crate) fn conflict(msg: impl Into<String>) -> StoreError {
    StoreError::Conflict(msg.into())
}

pub(crate) async fn prep(c: &impl GenericClient, sql: &str) -> StoreResult<Statement> {
    c.prepare_cached(sql).await.map_err(db_err)
}

// ---- sessions ----

const INSERT_SESSION: &str = "INSERT INTO sessions \
     (id, agent_id, token_hash, status, created_at, updated_at, metadata) \
     VALUES ($1, $2, $3, $4, $5, $5, $6)";

pub(crate) async fn insert_session(c: &impl GenericClient, s: &NewSession) -> StoreResult<()> {
    let st = prep(c, INSERT_SESSION).await?;
    let metadata = json(&s.metadata)?;
    c.execute(
        &st,
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
    sql: &str,
    param: &(dyn tokio_postgres::types::ToSql + Sync),
) -> StoreResult<Option<SessionRecord>> {
    let st = prep(c, sql).await?;
    c.query_opt(&st, &[param])
        .await
        .map_err(db_err)?
        .map(|r| session_row(&r))
        .transpose()
}

pub(crate) async fn get_session(
    c: &impl GenericClient,
    id: Uuid,
) -> StoreResult<Option<SessionRecord>> {
    let sql = concat!("SELECT ", session_cols!(), " FROM sessions WHERE id = $1");
    session_where(c, sql, &id).await
}

pub(crate) async fn find_session_by_token(
    c: &impl GenericClient,
    token_hash: &str,
) -> StoreResult<Option<SessionRecord>> {
    let sql = concat!(
        "SELECT ",
        session_cols!(),
        " FROM sessions WHERE token_hash = $1"
    );
    session_where(c, sql, &token_hash).await
}

pub(crate) async fn latest_suspended_for_agent(
    c: &impl GenericClient,
    agent_id: &str,
) -> StoreResult<Option<SessionRecord>> {
    // `ord` breaks ties between sessions updated in the same microsecond: the later insert wins.
    let sql = concat!(
        "SELECT ",
        session_cols!(),
        " FROM sessions WHERE agent_id = $1 AND status = 'suspended' \
         ORDER BY updated_at DESC, ord DESC LIMIT 1"
    );
    session_where(c, sql, &text(agent_id)).await
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
        Err(conflict(format!(
            "session status cannot change from {from} to {to}"
        )))
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
            .unwrap_or_else(|| conflict(format!("session status changed concurrently to {from}"))),
    }
}

pub(crate) async fn update_status(
    tx: &Tx<'_>,
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

pub(crate) async fn mark_attached(
    c: &impl GenericClient,
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
        Some(row) => session_row(&row),
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

/// Inserts `messages` at seqs `start..` with `st` (prepared [`INSERT_MESSAGES`]); `bodies`, when
/// given, are the bodies already encoded as JSON text (`bodies[i]` is the body of `messages[i]`).
pub(crate) async fn insert_messages(
    c: &impl GenericClient,
    st: &Statement,
    session: Uuid,
    start: i64,
    messages: &[NewMessage],
    bodies: Option<Vec<String>>,
) -> StoreResult<()> {
    if messages.is_empty() {
        return Ok(());
    }
    let bodies = match bodies {
        Some(b) if b.len() == messages.len() => b,
        Some(_) => {
            return Err(StoreError::Backend(
                "encoded bodies do not match the messages".to_owned(),
            ));
        }
        None => messages
            .iter()
            .map(|m| json(&m.body))
            .collect::<StoreResult<_>>()?,
    };
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
    rows(&found, message_row)
}

// ---- snapshots ----

pub(crate) const INSERT_SNAPSHOT: &str = "INSERT INTO snapshots \
     (id, session_id, kind, step_count, message_count, model, current_task, created_at, state) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
     RETURNING id, session_id, kind, step_count, message_count, model, current_task, created_at, \
     state";

/// Writes a snapshot with the given counts (the session's, as this transaction left them).
pub(crate) async fn insert_snapshot(
    c: &impl GenericClient,
    st: &Statement,
    session: Uuid,
    (steps, messages): (u64, u64),
    snap: &NewSnapshot,
) -> StoreResult<SnapshotRecord> {
    let state = json(&snap.state)?;
    let row = c
        .query_one(
            st,
            &[
                &snap.id,
                &session,
                &snap.kind.as_str(),
                &int(steps)?,
                &int(messages)?,
                &opt_text(&snap.model),
                &opt_text(&snap.current_task),
                &snap.created_at,
                &state,
            ],
        )
        .await
        .map_err(db_err)?;
    snapshot_row(&row)
}

fn counts(s: &SessionRecord) -> (u64, u64) {
    (s.step_count, s.message_count)
}

pub(crate) async fn latest_snapshot(
    c: &impl GenericClient,
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
    found.map_err(db_err)?.map(|r| snapshot_row(&r)).transpose()
}

pub(crate) async fn get_snapshot(
    c: &impl GenericClient,
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
        .map(|r| snapshot_row(&r))
        .transpose()
}

pub(crate) async fn list_snapshots(
    c: &impl GenericClient,
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
    rows(&found, snapshot_row)
}

// ---- tether ----

const INSERT_TETHER: &str = "INSERT INTO tether \
     (session_id, seq, role, content, model_used, created_at, chunk_id) \
     VALUES ($1, $2, $3, $4, $5, $6, $7)";

async fn insert_tether(
    c: &impl GenericClient,
    st: &Statement,
    session: Uuid,
    seq: i64,
    entry: &NewTetherEntry,
) -> StoreResult<()> {
    c.execute(
        st,
        &[
            &session,
            &seq,
            &text(&entry.role),
            &opt_text(&entry.content),
            &opt_text(&entry.model_used),
            &entry.created_at,
            &entry.chunk_id,
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

pub(crate) async fn tether_pending(
    c: &impl GenericClient,
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
    rows(&found, tether_row)
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

pub(crate) async fn get_turn(c: &impl GenericClient, id: Uuid) -> StoreResult<Option<TurnRecord>> {
    let st = prep(
        c,
        concat!("SELECT ", turn_cols!(), " FROM turns WHERE id = $1"),
    )
    .await?;
    c.query_opt(&st, &[&id])
        .await
        .map_err(db_err)?
        .map(|r| turn_row(&r))
        .transpose()
}

/// The seq of the first message a write appended, from the session's count after it.
fn first_seq(session: &SessionRecord, appended: i64) -> StoreResult<i64> {
    Ok(int(session.message_count)? - appended)
}

fn to_u64(v: i64) -> StoreResult<u64> {
    u64::try_from(v).map_err(|_| StoreError::Backend("negative message_count".to_owned()))
}

pub(crate) async fn begin_turn(tx: &Tx<'_>, b: BeginTurn) -> StoreResult<BeginTurnOutcome> {
    if let Some(create) = &b.create {
        if create.id != b.session_id {
            return Err(conflict("begin_turn: create.id differs from session_id"));
        }
        insert_session(tx, create).await?;
    }
    // First the session row: its lock serialises the turns of a session, and the status check
    // happens in the same statement (a forbidden change updates nothing).
    let (update, claim, retry, turn, messages, snapshot) = tokio::try_join!(
        prep(
            tx,
            concat!(
                "UPDATE sessions SET message_count = message_count + $2, \
                 status = COALESCE($3, status), last_task = COALESCE($4, last_task), \
                 model = COALESCE($5, model), updated_at = $6 \
                 WHERE id = $1 AND ($7::text[] IS NULL OR status = ANY($7)) \
                 RETURNING ",
                session_cols!()
            )
        ),
        prep(
            tx,
            "INSERT INTO idempotency (key, session_id, turn_id, fingerprint, state, \
             created_session, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $7) \
             ON CONFLICT (key) DO NOTHING"
        ),
        prep(
            tx,
            "UPDATE idempotency SET state = $4, turn_id = $3, updated_at = $5 \
             WHERE key = $1 AND session_id = $2 AND state = $6"
        ),
        prep(
            tx,
            "INSERT INTO turns (id, session_id, state, started_at) VALUES ($1, $2, $3, $4)"
        ),
        prep(tx, INSERT_MESSAGES),
        prep(tx, INSERT_SNAPSHOT),
    )?;
    let appended = len_i64(&b.new_messages)?;
    let allowed = b.status.map(allowed_from);
    let row = tx
        .query_opt(
            &update,
            &[
                &b.session_id,
                &appended,
                &b.status.map(SessionStatus::as_str),
                &opt_text(&b.last_task),
                &opt_text(&b.model),
                &b.now,
                &allowed,
            ],
        )
        .await
        .map_err(db_err)?;
    let session = match row {
        Some(row) => session_row(&row)?,
        None => {
            return Err(match b.status {
                Some(to) => refused_transition(tx, b.session_id, to).await,
                None => StoreError::NotFound,
            });
        }
    };
    let start = first_seq(&session, appended)?;
    let in_progress = idem_state(IdempotencyState::InProgress);
    let claim = async {
        let Some(idem) = &b.idempotency else {
            return Ok(());
        };
        let claimed = tx
            .execute(
                &claim,
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
            return Err(conflict("idempotency key exists"));
        }
        Ok(())
    };
    let retry = async {
        let Some(key) = &b.retry_key else {
            return Ok(());
        };
        let n = tx
            .execute(
                &retry,
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
            return Err(conflict(
                "idempotency key is not a failed request of this session",
            ));
        }
        Ok(())
    };
    let turn = async {
        tx.execute(
            &turn,
            &[
                &b.turn_id,
                &b.session_id,
                &turn_state(TurnState::Running),
                &b.now,
            ],
        )
        .await
        .map(drop)
        .map_err(db_err)
    };
    let messages = insert_messages(tx, &messages, b.session_id, start, &b.new_messages, None);
    // After the messages (its counts include them), so it covers the prompt it is about to act on.
    let pre_action = async {
        match &b.pre_action {
            Some(snap) => insert_snapshot(tx, &snapshot, b.session_id, counts(&session), snap)
                .await
                .map(Some),
            None => Ok(None),
        }
    };
    let (claim, retry, turn, messages, pre_action) =
        tokio::join!(claim, retry, turn, messages, pre_action);
    first_error([
        claim.err(),
        retry.err(),
        turn.err(),
        messages.err(),
        pre_action.as_ref().err().cloned(),
    ])?;
    Ok(BeginTurnOutcome {
        session,
        pre_action_snapshot: pre_action?,
    })
}

pub(crate) async fn finish_turn(tx: &Tx<'_>, f: FinishTurn) -> StoreResult<FinishTurnOutcome> {
    // The tether seq is taken here too, under the row lock and reading tether_enabled as it is at
    // commit time; from the session row (not MAX(seq) of the table) it keeps growing after the
    // newest entries were acknowledged or removed.
    let (update, done, messages, snapshot, tether, idem) = tokio::try_join!(
        prep(
            tx,
            concat!(
                "UPDATE sessions SET message_count = message_count + $2, \
                 step_count = step_count + $3, updated_at = $4, \
                 tether_seq = tether_seq + CASE WHEN $5 AND (tether_enabled OR NOT $6) \
                 THEN 1 ELSE 0 END \
                 WHERE id = $1 RETURNING ",
                session_cols!(),
                ", tether_seq"
            )
        ),
        prep(
            tx,
            "UPDATE turns SET state = $3, finished_at = $4 \
             WHERE id = $1 AND session_id = $2 AND state = 'running'"
        ),
        prep(tx, INSERT_MESSAGES),
        prep(tx, INSERT_SNAPSHOT),
        prep(tx, INSERT_TETHER),
        prep(
            tx,
            "UPDATE idempotency SET state = $3, response_status = $4, response_body = $5, \
             updated_at = $6 WHERE key = $1 AND session_id = $2"
        ),
    )?;
    // One update moves the counts past the new messages and the step, so the snapshots below get
    // the final values; a missing session is `NotFound` before anything else is checked.
    let appended = len_i64(&f.messages)?;
    let row = tx
        .query_opt(
            &update,
            &[
                &f.session_id,
                &appended,
                &i64::from(f.count_step),
                &f.now,
                &f.tether.is_some(),
                &f.tether_only_if_enabled,
            ],
        )
        .await
        .map_err(db_err)?
        .ok_or(StoreError::NotFound)?;
    let session = session_row(&row)?;
    let next_tether: i64 = get(&row, 12)?;
    let start = first_seq(&session, appended)?;
    let tether_entry = f
        .tether
        .as_ref()
        .filter(|_| session.tether_enabled || !f.tether_only_if_enabled);

    let done = async {
        let Some(turn) = f.turn_id else {
            return Ok(());
        };
        let n = tx
            .execute(
                &done,
                &[&turn, &f.session_id, &turn_state(TurnState::Done), &f.now],
            )
            .await
            .map_err(db_err)?;
        if n == 0 {
            return Err(conflict("turn is not running in this session"));
        }
        Ok(())
    };
    let messages = insert_messages(tx, &messages, f.session_id, start, &f.messages, None);
    let post_action = async {
        match &f.post_action {
            Some(snap) => insert_snapshot(tx, &snapshot, f.session_id, counts(&session), snap)
                .await
                .map(Some),
            None => Ok(None),
        }
    };
    let checkpoint = async {
        match &f.checkpoint {
            Some((snap, every))
                if f.count_step && *every > 0 && session.step_count % u64::from(*every) == 0 =>
            {
                insert_snapshot(tx, &snapshot, f.session_id, counts(&session), snap)
                    .await
                    .map(Some)
            }
            _ => Ok(None),
        }
    };
    let tether = async {
        match tether_entry {
            Some(entry) => {
                let seq = next_tether - 1;
                insert_tether(tx, &tether, f.session_id, seq, entry).await?;
                Ok(Some(to_u64(seq)?))
            }
            None => Ok(None),
        }
    };
    let idem = async {
        let Some((key, status, body)) = &f.idempotency_done else {
            return Ok(());
        };
        let body = json(body)?;
        let n = tx
            .execute(
                &idem,
                &[
                    key,
                    &f.session_id,
                    &idem_state(IdempotencyState::Done),
                    &i32::from(*status),
                    &body,
                    &f.now,
                ],
            )
            .await
            .map_err(db_err)?;
        if n == 0 {
            return Err(conflict("idempotency key was not claimed by this session"));
        }
        Ok(())
    };
    let (done, messages, post_action, checkpoint, tether, idem) =
        tokio::join!(done, messages, post_action, checkpoint, tether, idem);
    first_error([
        done.err(),
        messages.err(),
        post_action.as_ref().err().cloned(),
        checkpoint.as_ref().err().cloned(),
        tether.as_ref().err().cloned(),
        idem.err(),
    ])?;
    Ok(FinishTurnOutcome {
        session,
        tether_seq: tether?,
        post_action_snapshot: post_action?,
        checkpoint_snapshot: checkpoint?,
        first_message_seq: to_u64(start)?,
    })
}

pub(crate) async fn record_progress(
    tx: &Tx<'_>,
    p: TurnProgress,
) -> StoreResult<TurnProgressOutcome> {
    let not_running = || conflict("turn is not running in this session");
    let (update, running, messages, snapshot) = tokio::try_join!(
        prep(
            tx,
            concat!(
                "UPDATE sessions SET message_count = message_count + $2, updated_at = $3 \
                 WHERE id = $1 RETURNING ",
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
    let Some(row) = tx
        .query_opt(&update, &[&p.session_id, &appended, &p.now])
        .await
        .map_err(db_err)?
    else {
        // No session, so no turn of it can be running.
        return Err(not_running());
    };
    let session = session_row(&row)?;
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
    let messages = insert_messages(tx, &messages, p.session_id, start, &p.messages, None);
    // One after another, so they are numbered in order (a tool round writes one or two).
    let snapshots = async {
        let mut written = Vec::with_capacity(p.snapshots.len());
        for snap in &p.snapshots {
            written
                .push(insert_snapshot(tx, &snapshot, p.session_id, counts(&session), snap).await?);
        }
        Ok(written)
    };
    let (running, messages, snapshots) = tokio::join!(running, messages, snapshots);
    first_error([
        running.err(),
        messages.err(),
        snapshots.as_ref().err().cloned(),
    ])?;
    Ok(TurnProgressOutcome {
        session,
        snapshots: snapshots?,
        first_message_seq: to_u64(start)?,
    })
}

pub(crate) async fn fail_turn(tx: &Tx<'_>, f: FailTurn) -> StoreResult<()> {
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
        .map(|r| turn_row(&r))
        .transpose()?
        .filter(|t| t.session_id == f.session_id)
        .ok_or(StoreError::NotFound)?;
    match turn.state {
        TurnState::Done => return Err(conflict("turn already finished")),
        // Already failed (e.g. by restart recovery): keep its first error, still release the key.
        TurnState::Failed => {}
        TurnState::Running => {
            let st = prep(
                tx,
                "UPDATE turns SET state = $2, finished_at = $3, error = $4 WHERE id = $1",
            )
            .await?;
            tx.execute(
                &st,
                &[
                    &f.turn_id,
                    &turn_state(TurnState::Failed),
                    &f.now,
                    &text(&f.error),
                ],
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
    tx: &Tx<'_>,
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
    let turns = rows(&found, turn_row)?;
    if turns.is_empty() {
        return Ok(turns);
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
    Ok(turns)
}

// ---- idempotency ----

pub(crate) async fn get_idempotency(
    c: &impl GenericClient,
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
        .map(|r| idempotency_row(&r))
        .transpose()
}
