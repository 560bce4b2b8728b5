//! The storage conformance suite: backend-agnostic cases that take an `Arc<dyn Store>`, so every backend
//! runs exactly the same checks.

use std::future::Future;
use std::sync::Arc;

use chrono::{DateTime, Duration, Utc};
use sbp_protocol::{SessionStatus, SnapshotKind};
use sbp_store::{
    BeginTurn, FailTurn, FinishTurn, IdempotencyState, NewIdempotency, NewMessage, NewSession,
    NewSnapshot, NewTetherEntry, SessionRecord, Store, StoreError, Timestamp, TurnProgress,
    TurnState,
};
use serde_json::json;
use tokio::task::JoinSet;
use uuid::Uuid;

pub mod federation;
mod holds;
mod lifecycle;
mod replicas;
mod reserved;
mod roaming;
pub mod sealing;
pub use federation::*;
pub use holds::*;
pub use lifecycle::*;
pub use replicas::*;
pub use reserved::*;
pub use roaming::*;

// ---- fixtures ----

/// A fixed instant with microseconds, so round trips are compared exactly.
fn t(secs: i64) -> Timestamp {
    let base = DateTime::parse_from_rfc3339("2025-03-04T05:06:07.123456Z")
        .expect("valid literal")
        .with_timezone(&Utc);
    base + Duration::seconds(secs)
}

fn new_session(agent: &str) -> NewSession {
    let id = Uuid::new_v4();
    NewSession {
        id,
        agent_id: agent.to_owned(),
        token_hash: format!("{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple()),
        created_at: t(0),
        metadata: json!({ "agent": agent, "n": 1 }),
    }
}

fn msg(role: &str, text: &str) -> NewMessage {
    NewMessage {
        role: role.to_owned(),
        body: json!({ "role": role, "content": text }).into(),
        model_used: (role == "assistant").then(|| "m-1".to_owned()),
        cost_usd: (role == "assistant").then_some(0.00125),
        created_at: t(1),
    }
}

fn snap(kind: SnapshotKind) -> NewSnapshot {
    NewSnapshot {
        id: Uuid::new_v4(),
        kind,
        model: Some("m-1".to_owned()),
        current_task: Some("task".to_owned()),
        created_at: t(2),
        state: json!({ "kind": kind.as_str() }),
    }
}

fn tether_entry(text: &str) -> NewTetherEntry {
    NewTetherEntry {
        role: "assistant".to_owned(),
        content: Some(text.to_owned()),
        model_used: Some("m-1".to_owned()),
        created_at: t(3),
        chunk_id: Uuid::new_v4(),
    }
}

fn begin(session_id: Uuid, messages: Vec<NewMessage>) -> BeginTurn {
    BeginTurn {
        session_id,
        turn_id: Uuid::new_v4(),
        create: None,
        new_messages: messages,
        status: None,
        last_task: None,
        model: None,
        pre_action: None,
        idempotency: None,
        retry_key: None,
        owner: None,
        now: t(10),
    }
}

fn finish(session_id: Uuid, turn_id: Option<Uuid>) -> FinishTurn {
    FinishTurn {
        session_id,
        turn_id,
        messages: vec![msg("assistant", "reply")],
        count_step: true,
        post_action: None,
        checkpoint: None,
        tether: None,
        tether_only_if_enabled: false,
        idempotency_done: None,
        idempotency_claim: None,
        now: t(20),
    }
}

fn idem(key: &str, created_session: bool) -> NewIdempotency {
    NewIdempotency {
        key: key.to_owned(),
        fingerprint: format!("fp-{key}"),
        created_session,
    }
}

async fn created(store: &Arc<dyn Store>, agent: &str) -> NewSession {
    let s = new_session(agent);
    store
        .create_session(s.clone())
        .await
        .expect("create session");
    s
}

async fn session(store: &Arc<dyn Store>, id: Uuid) -> SessionRecord {
    store
        .get_session(id)
        .await
        .expect("get session")
        .expect("session exists")
}

fn is_conflict<T>(r: &Result<T, StoreError>) -> bool {
    matches!(r, Err(StoreError::Conflict(_)))
}

// ---- sessions ----

pub async fn create_get_find_by_token(store: Arc<dyn Store>) {
    let s = created(&store, "agent-a").await;
    let expected = SessionRecord {
        id: s.id,
        agent_id: "agent-a".to_owned(),
        token_hash: s.token_hash.clone(),
        status: SessionStatus::Idle,
        step_count: 0,
        message_count: 0,
        message_bytes: 0,
        last_task: None,
        model: None,
        tether_enabled: false,
        created_at: t(0),
        updated_at: t(0),
        metadata: s.metadata.clone(),
    };
    assert_eq!(session(&store, s.id).await, expected);
    let by_token = store
        .find_session_by_token(&s.token_hash)
        .await
        .expect("find");
    assert_eq!(by_token, Some(expected));
    assert_eq!(store.get_session(Uuid::new_v4()).await.expect("get"), None);
    assert_eq!(
        store.find_session_by_token("00ff").await.expect("find"),
        None
    );
}

pub async fn duplicate_token_is_conflict(store: Arc<dyn Store>) {
    let first = created(&store, "agent-a").await;
    let mut same_token = new_session("agent-b");
    same_token.token_hash = first.token_hash.clone();
    assert!(is_conflict(&store.create_session(same_token.clone()).await));
    assert_eq!(store.get_session(same_token.id).await.expect("get"), None);

    let mut same_id = new_session("agent-b");
    same_id.id = first.id;
    assert!(is_conflict(&store.create_session(same_id).await));
    assert_eq!(session(&store, first.id).await.agent_id, "agent-a");
}

pub async fn status_transitions(store: Arc<dyn Store>) {
    let s = created(&store, "agent-a").await;
    let prev = store
        .update_status(s.id, SessionStatus::Running, t(5))
        .await
        .expect("idle -> running");
    assert_eq!(prev, SessionStatus::Idle);
    let prev = store
        .update_status(s.id, SessionStatus::Suspended, t(6))
        .await
        .expect("running -> suspended");
    assert_eq!(prev, SessionStatus::Running);
    let now = session(&store, s.id).await;
    assert_eq!(
        (now.status, now.updated_at),
        (SessionStatus::Suspended, t(6))
    );

    // suspended -> idle is not in the table.
    let forbidden = store.update_status(s.id, SessionStatus::Idle, t(7)).await;
    assert!(is_conflict(&forbidden), "{forbidden:?}");
    assert_eq!(
        session(&store, s.id).await,
        now,
        "a forbidden change writes nothing"
    );

    store
        .update_status(s.id, SessionStatus::Completed, t(8))
        .await
        .expect("suspended -> completed");
    for to in [
        SessionStatus::Running,
        SessionStatus::Idle,
        SessionStatus::Suspended,
    ] {
        assert!(is_conflict(&store.update_status(s.id, to, t(9)).await));
    }
    assert_eq!(session(&store, s.id).await.status, SessionStatus::Completed);

    let missing = store
        .update_status(Uuid::new_v4(), SessionStatus::Running, t(9))
        .await;
    assert_eq!(missing, Err(StoreError::NotFound));
}

pub async fn suspended_lookup_and_counts(store: Arc<dyn Store>) {
    let old = created(&store, "agent-s").await;
    let new = created(&store, "agent-s").await;
    let other = created(&store, "agent-other").await;
    let _idle = created(&store, "agent-s").await;
    for (s, at) in [(&new, 30), (&old, 20), (&other, 40)] {
        store
            .update_status(s.id, SessionStatus::Suspended, t(at))
            .await
            .expect("suspend");
    }
    let latest = store
        .latest_suspended_for_agent("agent-s")
        .await
        .expect("lookup")
        .expect("found");
    assert_eq!(latest.id, new.id, "the most recently updated one");
    assert_eq!(
        store
            .latest_suspended_for_agent("nobody")
            .await
            .expect("lookup"),
        None
    );

    // Re-suspending the old one later makes it the latest.
    store
        .update_status(old.id, SessionStatus::Suspended, t(50))
        .await
        .expect("same status is allowed");
    let latest = store
        .latest_suspended_for_agent("agent-s")
        .await
        .expect("lookup");
    assert_eq!(latest.map(|s| s.id), Some(old.id));

    let counts = store.count_sessions_by_status().await.expect("counts");
    let count = |st: SessionStatus| counts.iter().find(|(s, _)| *s == st).map_or(0, |(_, n)| *n);
    assert_eq!(count(SessionStatus::Suspended), 3);
    assert_eq!(count(SessionStatus::Idle), 1);
    assert_eq!(count(SessionStatus::Running), 0);
    assert_eq!(counts.iter().map(|(_, n)| n).sum::<u64>(), 4);
}

pub async fn mark_attached(store: Arc<dyn Store>) {
    let s = created(&store, "agent-a").await;
    store
        .update_status(s.id, SessionStatus::Suspended, t(1))
        .await
        .expect("suspend");
    let rec = store.mark_attached(s.id, t(2)).await.expect("attach");
    assert!(rec.tether_enabled);
    assert_eq!((rec.status, rec.updated_at), (SessionStatus::Running, t(2)));
    assert_eq!(session(&store, s.id).await, rec);

    let done = created(&store, "agent-a").await;
    store
        .update_status(done.id, SessionStatus::Completed, t(1))
        .await
        .expect("complete");
    let rec = store.mark_attached(done.id, t(2)).await.expect("attach");
    assert!(rec.tether_enabled);
    assert_eq!(
        rec.status,
        SessionStatus::Completed,
        "a terminal session stays terminal"
    );

    assert_eq!(
        store.mark_attached(Uuid::new_v4(), t(2)).await,
        Err(StoreError::NotFound)
    );
}

pub async fn suspend_if_running(store: Arc<dyn Store>) {
    let s = created(&store, "agent-a").await;
    assert!(
        !store.suspend_if_running(s.id, t(1)).await.expect("idle"),
        "an idle session is not suspended"
    );
    assert_eq!(session(&store, s.id).await.status, SessionStatus::Idle);
    store.mark_attached(s.id, t(2)).await.expect("attach");
    assert!(store.suspend_if_running(s.id, t(3)).await.expect("running"));
    let rec = session(&store, s.id).await;
    assert_eq!(
        (rec.status, rec.updated_at),
        (SessionStatus::Suspended, t(3))
    );
    assert!(
        !store.suspend_if_running(s.id, t(4)).await.expect("again"),
        "suspended once"
    );
    assert_eq!(session(&store, s.id).await.updated_at, t(3));

    let done = created(&store, "agent-a").await;
    store
        .update_status(done.id, SessionStatus::Completed, t(1))
        .await
        .expect("complete");
    assert!(!store.suspend_if_running(done.id, t(2)).await.expect("done"));
    assert_eq!(
        session(&store, done.id).await.status,
        SessionStatus::Completed
    );
    assert!(
        !store
            .suspend_if_running(Uuid::new_v4(), t(2))
            .await
            .expect("unknown")
    );
}

// ---- turns ----

pub async fn begin_turn_with_create(store: Arc<dyn Store>) {
    let s = new_session("agent-a");
    let mut b = begin(s.id, vec![msg("system", "be brief"), msg("user", "hi")]);
    b.create = Some(s.clone());
    b.status = Some(SessionStatus::Running);
    b.last_task = Some("greet".to_owned());
    b.model = Some("m-1".to_owned());
    b.pre_action = Some(snap(SnapshotKind::PreAction));
    b.idempotency = Some(idem("k-create", true));
    let out = store.begin_turn(b.clone()).await.expect("begin");

    assert_eq!(out.session.id, s.id);
    assert_eq!(
        out.new_messages, b.new_messages,
        "the messages come back as given"
    );
    assert_eq!(out.session.status, SessionStatus::Running);
    assert_eq!(out.session.message_count, 2);
    assert_eq!(out.session.step_count, 0);
    assert_eq!(out.session.last_task.as_deref(), Some("greet"));
    assert_eq!(out.session.model.as_deref(), Some("m-1"));
    assert_eq!(
        (out.session.created_at, out.session.updated_at),
        (t(0), t(10))
    );
    assert_eq!(out.session, session(&store, s.id).await);
    let by_token = store
        .find_session_by_token(&s.token_hash)
        .await
        .expect("find");
    assert_eq!(by_token.map(|r| r.id), Some(s.id));

    let pre = out.pre_action_snapshot.expect("pre_action written");
    assert_eq!(
        (pre.kind, pre.message_count, pre.step_count),
        (SnapshotKind::PreAction, 2, 0)
    );
    assert_eq!(pre.session_id, s.id);
    assert_eq!(
        store.get_snapshot(pre.id).await.expect("get"),
        Some(pre.clone())
    );

    let history = store.history(s.id).await.expect("history");
    assert_eq!(
        history.iter().map(|m| m.seq).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert_eq!(history[1].body, json!({ "role": "user", "content": "hi" }));
    assert_eq!(history[1].created_at, t(1));

    let turn = store
        .get_turn(b.turn_id)
        .await
        .expect("turn")
        .expect("exists");
    assert_eq!(
        (turn.state, turn.started_at, turn.finished_at),
        (TurnState::Running, t(10), None)
    );
    let key = store
        .get_idempotency("k-create")
        .await
        .expect("idem")
        .expect("exists");
    assert_eq!(key.state, IdempotencyState::InProgress);
    assert_eq!((key.session_id, key.created_session), (s.id, true));
    assert_eq!(key.fingerprint, "fp-k-create");
    assert_eq!((key.response_status, key.response_body), (None, None));

    let missing = store
        .begin_turn(begin(Uuid::new_v4(), vec![msg("user", "x")]))
        .await;
    assert_eq!(missing, Err(StoreError::NotFound));
}

pub async fn begin_turn_is_atomic(store: Arc<dyn Store>) {
    // A forbidden status change writes no message, turn, key or snapshot.
    let done = created(&store, "agent-a").await;
    store
        .update_status(done.id, SessionStatus::Completed, t(1))
        .await
        .expect("complete");
    let mut b = begin(done.id, vec![msg("user", "late")]);
    b.status = Some(SessionStatus::Running);
    b.pre_action = Some(snap(SnapshotKind::PreAction));
    b.idempotency = Some(idem("k-forbidden", false));
    let before = session(&store, done.id).await;
    assert!(is_conflict(&store.begin_turn(b.clone()).await));
    assert_eq!(session(&store, done.id).await, before);
    assert!(store.history(done.id).await.expect("history").is_empty());
    assert_eq!(store.get_turn(b.turn_id).await.expect("turn"), None);
    assert_eq!(
        store.get_idempotency("k-forbidden").await.expect("idem"),
        None
    );
    assert_eq!(
        store.latest_snapshot(done.id, None).await.expect("snap"),
        None
    );

    // A claimed key: the session that would have been created does not exist afterwards.
    let a = created(&store, "agent-a").await;
    let mut first = begin(a.id, vec![msg("user", "one")]);
    first.idempotency = Some(idem("k-dup", false));
    store.begin_turn(first).await.expect("first claim");

    let fresh = new_session("agent-a");
    let mut dup = begin(fresh.id, vec![msg("user", "two")]);
    dup.create = Some(fresh.clone());
    dup.idempotency = Some(idem("k-dup", true));
    let err = store.begin_turn(dup.clone()).await;
    assert!(is_conflict(&err), "{err:?}");
    assert_eq!(store.get_session(fresh.id).await.expect("get"), None);
    assert_eq!(
        store
            .find_session_by_token(&fresh.token_hash)
            .await
            .expect("find"),
        None
    );
    assert!(store.history(fresh.id).await.expect("history").is_empty());
    assert_eq!(store.get_turn(dup.turn_id).await.expect("turn"), None);
    let key = store
        .get_idempotency("k-dup")
        .await
        .expect("idem")
        .expect("exists");
    assert_eq!((key.session_id, key.created_session), (a.id, false));
    assert_eq!(session(&store, a.id).await.message_count, 1);
}

pub async fn finish_turn_counts_and_snapshots(store: Arc<dyn Store>) {
    let s = created(&store, "agent-a").await;
    let mut b = begin(s.id, vec![msg("user", "hi")]);
    b.idempotency = Some(idem("k-fin", false));
    store.begin_turn(b.clone()).await.expect("begin");

    let mut f = finish(s.id, Some(b.turn_id));
    f.messages = vec![msg("assistant", "calling tool"), msg("tool", "result")];
    f.post_action = Some(snap(SnapshotKind::PostAction));
    f.checkpoint = Some((snap(SnapshotKind::Checkpoint), 1));
    f.tether = Some(tether_entry("calling tool"));
    f.idempotency_done = Some(("k-fin".to_owned(), 200, json!({ "ok": true })));
    let out = store.finish_turn(f.clone()).await.expect("finish");

    assert_eq!(out.first_message_seq, 1);
    assert_eq!((out.session.step_count, out.session.message_count), (1, 3));
    assert_eq!(out.session.updated_at, t(20));
    assert_eq!(out.session, session(&store, s.id).await);
    let post = out.post_action_snapshot.expect("post_action");
    assert_eq!(
        (post.kind, post.step_count, post.message_count),
        (SnapshotKind::PostAction, 1, 3)
    );
    let cp = out.checkpoint_snapshot.expect("checkpoint every 1");
    assert_eq!(
        (cp.kind, cp.step_count, cp.message_count),
        (SnapshotKind::Checkpoint, 1, 3)
    );
    assert_eq!(out.tether_seq, Some(1));

    let turn = store
        .get_turn(b.turn_id)
        .await
        .expect("turn")
        .expect("exists");
    assert_eq!(
        (turn.state, turn.finished_at),
        (TurnState::Done, Some(t(20)))
    );
    let key = store
        .get_idempotency("k-fin")
        .await
        .expect("idem")
        .expect("exists");
    assert_eq!(key.state, IdempotencyState::Done);
    assert_eq!(
        (key.response_status, key.response_body),
        (Some(200), Some(json!({ "ok": true })))
    );
    assert_eq!(key.updated_at, t(20));

    let history = store.history(s.id).await.expect("history");
    assert_eq!(history.len(), 3);
    assert_eq!(history[1].cost_usd, Some(0.00125));
    assert_eq!(history[1].model_used.as_deref(), Some("m-1"));
    assert_eq!(history[2].role, "tool");

    // Finishing the same turn again is a conflict and changes nothing.
    let again = finish(s.id, Some(b.turn_id));
    assert!(is_conflict(&store.finish_turn(again).await));
    assert_eq!(session(&store, s.id).await, out.session);

    // A pushed turn without messages or a counted step.
    let mut pushed = finish(s.id, None);
    pushed.messages.clear();
    pushed.count_step = false;
    pushed.checkpoint = Some((snap(SnapshotKind::Checkpoint), 1));
    let out = store.finish_turn(pushed).await.expect("pushed");
    assert_eq!(
        out.first_message_seq, 3,
        "message_count when nothing is appended"
    );
    assert_eq!(out.session.step_count, 1);
    assert_eq!(
        out.checkpoint_snapshot, None,
        "no checkpoint without a counted step"
    );

    assert_eq!(
        store.finish_turn(finish(Uuid::new_v4(), None)).await,
        Err(StoreError::NotFound)
    );
}

/// The size of a message as `message_bytes` counts it: its body as compact JSON text.
fn body_bytes(messages: &[NewMessage]) -> u64 {
    messages.iter().map(|m| m.body.as_str().len() as u64).sum()
}

/// `message_bytes` follows every write that appends messages (the per-session byte limit reads
/// it), and a refused write adds nothing.
pub async fn message_bytes_follow_the_transcript(store: Arc<dyn Store>) {
    let s = created(&store, "agent-bytes").await;
    let first = vec![msg("user", "héllo — 東京"), msg("user", "again")];
    let b = begin(s.id, first.clone());
    let out = store.begin_turn(b.clone()).await.expect("begin");
    let mut expected = body_bytes(&first);
    assert_eq!(out.session.message_bytes, expected);

    let round = vec![msg("assistant", "calling"), msg("tool", "{\"lat\":1}")];
    let progress = TurnProgress {
        session_id: s.id,
        turn_id: b.turn_id,
        messages: round.clone(),
        snapshots: Vec::new(),
        now: t(15),
    };
    let out = store.record_progress(progress).await.expect("progress");
    expected += body_bytes(&round);
    assert_eq!(out.session.message_bytes, expected);

    let f = finish(s.id, Some(b.turn_id));
    let reply = f.messages.clone();
    let out = store.finish_turn(f.clone()).await.expect("finish");
    expected += body_bytes(&reply);
    assert_eq!(out.session.message_bytes, expected);
    assert!(is_conflict(&store.finish_turn(f).await));
    assert_eq!(session(&store, s.id).await.message_bytes, expected);

    let stored: u64 = store
        .history(s.id)
        .await
        .expect("history")
        .iter()
        .map(|m| serde_json::to_string(&m.body).expect("encodes").len() as u64)
        .sum();
    assert_eq!(
        stored, expected,
        "the counter is the sum of the stored bodies"
    );
}

pub async fn progress_of_a_running_turn(store: Arc<dyn Store>) {
    let s = created(&store, "agent-p").await;
    let b = begin(s.id, vec![msg("user", "where am I?")]);
    store.begin_turn(b.clone()).await.expect("begin");

    // A pre_action snapshot alone, then a tool round: the call and its result with a post_action.
    let pre = TurnProgress {
        session_id: s.id,
        turn_id: b.turn_id,
        messages: Vec::new(),
        snapshots: vec![snap(SnapshotKind::PreAction)],
        now: t(15),
    };
    let out = store.record_progress(pre).await.expect("pre");
    assert_eq!(out.first_message_seq, 1);
    assert_eq!(out.snapshots.len(), 1);
    assert_eq!(out.snapshots[0].message_count, 1);
    let round = TurnProgress {
        session_id: s.id,
        turn_id: b.turn_id,
        messages: vec![msg("assistant", "calling gps"), msg("tool", "{\"lat\":1}")],
        snapshots: vec![snap(SnapshotKind::PostAction)],
        now: t(16),
    };
    let out = store.record_progress(round.clone()).await.expect("round");
    assert_eq!(out.first_message_seq, 1);
    assert_eq!(
        (out.session.message_count, out.session.step_count),
        (3, 0),
        "a tool round is not a step"
    );
    assert_eq!(out.snapshots[0].message_count, 3);
    assert_eq!(out.session.updated_at, t(16));

    // The reply then lands after the round.
    let mut f = finish(s.id, Some(b.turn_id));
    f.messages = vec![msg("assistant", "you are here")];
    let done = store.finish_turn(f).await.expect("finish");
    assert_eq!(done.first_message_seq, 3);
    let roles: Vec<String> = store
        .history(s.id)
        .await
        .expect("history")
        .into_iter()
        .map(|m| m.role)
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);

    // A finished turn takes no more progress, and nothing of the refused write stays.
    assert!(is_conflict(&store.record_progress(round.clone()).await));
    assert_eq!(session(&store, s.id).await.message_count, 4);
    let mut unknown = round;
    unknown.turn_id = Uuid::new_v4();
    assert!(is_conflict(&store.record_progress(unknown).await));
    assert_eq!(session(&store, s.id).await.message_count, 4);
}

/// A snapshot that a turn's write returns is the one a read gives back, exactly: the timestamp
/// as kept (to the microsecond), text as the backend keeps it (a NUL included), every kind of
/// JSON value in the state. The writes build that record rather than read the row back.
pub async fn written_snapshots_read_back_equal(store: Arc<dyn Store>) {
    let s = created(&store, "agent-w").await;
    let odd = |kind: SnapshotKind| NewSnapshot {
        // Nanoseconds that no backend keeps.
        created_at: t(2) + Duration::nanoseconds(789),
        model: Some("m\0-1 sbp:raw".to_owned()),
        current_task: Some("sbp:enc:v1:task \0 \u{e9}\u{1F980}".to_owned()),
        state: json!({
            "f": 0.1, "tiny": 5e-324, "big": 1.7976931348623157e308, "neg": -7, "u": u64::MAX,
            "i": i64::MIN, "z": -0.0, "s": "\0sbp:x\u{2028}", "a": [null, true, {"n": 2.5}],
            "": {}
        }),
        ..snap(kind)
    };
    let read_back = |id: Uuid| {
        let store = store.clone();
        async move { store.get_snapshot(id).await.expect("get").expect("written") }
    };

    let mut b = begin(s.id, vec![msg("user", "hi")]);
    b.pre_action = Some(odd(SnapshotKind::PreAction));
    let pre = store
        .begin_turn(b.clone())
        .await
        .expect("begin")
        .pre_action_snapshot
        .expect("pre_action written");
    assert_eq!(pre.created_at, t(2), "kept to the microsecond");
    assert_eq!((pre.step_count, pre.message_count), (0, 1));
    assert_eq!(read_back(pre.id).await, pre);
    assert_eq!(
        store
            .latest_snapshot(s.id, Some(SnapshotKind::PreAction))
            .await
            .expect("latest"),
        Some(pre.clone())
    );

    let progress = TurnProgress {
        session_id: s.id,
        turn_id: b.turn_id,
        messages: vec![msg("assistant", "calling"), msg("tool", "done")],
        snapshots: vec![odd(SnapshotKind::PreAction), odd(SnapshotKind::PostAction)],
        now: t(15),
    };
    let round = store.record_progress(progress).await.expect("progress");
    assert_eq!(round.snapshots.len(), 2);
    for written in &round.snapshots {
        assert_eq!(written.message_count, 3);
        assert_eq!(&read_back(written.id).await, written);
    }

    let mut f = finish(s.id, Some(b.turn_id));
    f.post_action = Some(odd(SnapshotKind::PostAction));
    f.checkpoint = Some((odd(SnapshotKind::Checkpoint), 1));
    let out = store.finish_turn(f).await.expect("finish");
    let post = out.post_action_snapshot.expect("post_action");
    let cp = out.checkpoint_snapshot.expect("checkpoint every 1");
    assert_eq!((cp.step_count, cp.message_count), (1, 4));
    assert_eq!(read_back(post.id).await, post);
    assert_eq!(read_back(cp.id).await, cp);
    assert_eq!(
        store.latest_snapshot(s.id, None).await.expect("latest"),
        Some(cp.clone()),
        "the checkpoint is written after the post_action"
    );
    assert_eq!(
        store.list_snapshots(s.id, 10).await.expect("list"),
        vec![
            cp,
            post,
            round.snapshots[1].clone(),
            round.snapshots[0].clone(),
            pre
        ]
    );
}

pub async fn checkpoints_every_n(store: Arc<dyn Store>) {
    let s = created(&store, "agent-a").await;
    let mut checkpoints = Vec::new();
    for i in 0..5u64 {
        let b = begin(s.id, vec![msg("user", "go")]);
        let pre = {
            let mut b = b.clone();
            b.pre_action = Some(snap(SnapshotKind::PreAction));
            store
                .begin_turn(b)
                .await
                .expect("begin")
                .pre_action_snapshot
        };
        assert_eq!(
            pre.map(|p| (p.step_count, p.message_count)),
            Some((i, 2 * i + 1))
        );
        let mut f = finish(s.id, Some(b.turn_id));
        f.post_action = Some(snap(SnapshotKind::PostAction));
        f.checkpoint = Some((snap(SnapshotKind::Checkpoint), 2));
        let out = store.finish_turn(f).await.expect("finish");
        assert_eq!(out.session.step_count, i + 1);
        if let Some(cp) = out.checkpoint_snapshot {
            checkpoints.push((cp.step_count, cp.message_count));
        }
    }
    assert_eq!(checkpoints, vec![(2, 4), (4, 8)]);

    let latest_cp = store
        .latest_snapshot(s.id, Some(SnapshotKind::Checkpoint))
        .await
        .expect("latest")
        .expect("exists");
    assert_eq!(latest_cp.step_count, 4);
    let latest_any = store
        .latest_snapshot(s.id, None)
        .await
        .expect("latest")
        .expect("exists");
    assert_eq!(
        (latest_any.kind, latest_any.step_count),
        (SnapshotKind::PostAction, 5)
    );
    let latest_pre = store
        .latest_snapshot(s.id, Some(SnapshotKind::PreAction))
        .await
        .expect("latest")
        .expect("exists");
    assert_eq!((latest_pre.step_count, latest_pre.message_count), (4, 9));

    // 5 pre + 5 post + 2 checkpoints, newest first.
    let all = store.list_snapshots(s.id, 100).await.expect("list");
    assert_eq!(all.len(), 12);
    assert_eq!(all[0], latest_any);
    let steps: Vec<u64> = all.iter().map(|s| s.step_count).collect();
    assert!(
        steps.windows(2).all(|w| w[0] >= w[1]),
        "newest first: {steps:?}"
    );
    let page = store.list_snapshots(s.id, 3).await.expect("list");
    assert_eq!(page, all[..3].to_vec());
    assert!(
        store
            .list_snapshots(Uuid::new_v4(), 10)
            .await
            .expect("list")
            .is_empty()
    );
}

pub async fn tether_seq_never_reused(store: Arc<dyn Store>) {
    let s = created(&store, "agent-a").await;
    let push = |text: &'static str| {
        let store = Arc::clone(&store);
        async move {
            let mut f = finish(s.id, None);
            f.tether = Some(tether_entry(text));
            store
                .finish_turn(f)
                .await
                .expect("finish")
                .tether_seq
                .expect("seq")
        }
    };
    assert_eq!(
        [push("a").await, push("b").await, push("c").await],
        [1, 2, 3]
    );
    assert_eq!(store.tether_ack(s.id, 3).await.expect("ack"), 3);
    assert_eq!(store.tether_count(s.id).await.expect("count"), 0);
    assert_eq!(push("d").await, 4, "acked seqs are not reused");
    assert_eq!(store.tether_remove(s.id, &[4]).await.expect("remove"), 1);
    assert_eq!(push("e").await, 5, "removed seqs are not reused");
    let pending = store.tether_pending(s.id, None, 10).await.expect("pending");
    assert_eq!(pending.len(), 1);
    assert_eq!(
        (pending[0].seq, pending[0].content.as_deref()),
        (5, Some("e"))
    );
    assert_eq!(pending[0].session_id, s.id);
    assert_eq!(pending[0].created_at, t(3));
}

/// `tether_only_if_enabled` enqueues only once the session's tether is on, judged at commit time.
pub async fn tether_only_if_enabled(store: Arc<dyn Store>) {
    let s = created(&store, "agent-t").await;
    let b = begin(s.id, vec![msg("user", "before any surface")]);
    store.begin_turn(b.clone()).await.expect("begin");
    let mut f = finish(s.id, Some(b.turn_id));
    f.tether = Some(tether_entry("not tethered"));
    f.tether_only_if_enabled = true;
    let out = store.finish_turn(f).await.expect("finish");
    assert_eq!(out.tether_seq, None);
    assert_eq!(store.tether_count(s.id).await.expect("count"), 0);

    // A surface attaches while the next turn runs: the turn is tethered.
    let b = begin(s.id, vec![msg("user", "during an attach")]);
    store.begin_turn(b.clone()).await.expect("begin");
    store.mark_attached(s.id, t(15)).await.expect("attach");
    let mut f = finish(s.id, Some(b.turn_id));
    f.tether = Some(tether_entry("tethered"));
    f.tether_only_if_enabled = true;
    let out = store.finish_turn(f).await.expect("finish");
    assert_eq!(out.tether_seq, Some(1));
    let pending = store.tether_pending(s.id, None, 10).await.expect("pending");
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].content.as_deref(), Some("tethered"));
}

pub async fn tether_pending_order_after_limit(store: Arc<dyn Store>) {
    let a = created(&store, "agent-a").await;
    let b = created(&store, "agent-b").await;
    let mut chunks = Vec::new();
    for i in 0..5 {
        let mut f = finish(a.id, None);
        let entry = tether_entry(&format!("a{i}"));
        chunks.push(entry.chunk_id);
        f.tether = Some(entry);
        store.finish_turn(f).await.expect("finish");
    }
    let mut f = finish(b.id, None);
    f.tether = Some(tether_entry("b0"));
    assert_eq!(
        store.finish_turn(f).await.expect("finish").tether_seq,
        Some(1),
        "per session"
    );

    let seqs = |v: Vec<sbp_store::TetherEntry>| v.into_iter().map(|e| e.seq).collect::<Vec<_>>();
    let all = store
        .tether_pending(a.id, None, 100)
        .await
        .expect("pending");
    assert_eq!(all.iter().map(|e| e.chunk_id).collect::<Vec<_>>(), chunks);
    assert_eq!(seqs(all), vec![1, 2, 3, 4, 5]);
    assert_eq!(
        seqs(store.tether_pending(a.id, Some(2), 2).await.expect("p")),
        vec![3, 4]
    );
    assert_eq!(
        seqs(store.tether_pending(a.id, None, 2).await.expect("p")),
        vec![1, 2]
    );
    assert!(
        store
            .tether_pending(a.id, Some(5), 10)
            .await
            .expect("p")
            .is_empty()
    );
    assert_eq!(store.tether_depth_total().await.expect("depth"), 6);

    assert_eq!(store.tether_ack(a.id, 2).await.expect("ack"), 2);
    assert_eq!(store.tether_count(a.id).await.expect("count"), 3);
    assert_eq!(
        store.tether_remove(a.id, &[4, 99]).await.expect("remove"),
        1
    );
    assert_eq!(
        seqs(store.tether_pending(a.id, None, 10).await.expect("p")),
        vec![3, 5]
    );
    assert_eq!(
        store.tether_count(b.id).await.expect("count"),
        1,
        "other session untouched"
    );
    assert_eq!(store.tether_depth_total().await.expect("depth"), 3);
    // Acknowledging and removing entries leaves the highest issued seq where it was.
    assert_eq!(store.tether_issued(a.id).await.expect("issued"), 5);
    assert_eq!(store.tether_issued(b.id).await.expect("issued"), 1);
    assert!(matches!(
        store.tether_issued(Uuid::now_v7()).await,
        Err(StoreError::NotFound)
    ));
}

pub async fn fail_turn_and_retry(store: Arc<dyn Store>) {
    let s = created(&store, "agent-a").await;
    let mut b = begin(s.id, vec![msg("user", "hi")]);
    b.idempotency = Some(idem("k-retry", false));
    store.begin_turn(b.clone()).await.expect("begin");

    // Retrying a key that is still in progress is refused.
    let mut early = begin(s.id, vec![]);
    early.retry_key = Some("k-retry".to_owned());
    assert!(is_conflict(&store.begin_turn(early.clone()).await));
    assert_eq!(store.get_turn(early.turn_id).await.expect("turn"), None);

    store
        .fail_turn(FailTurn {
            session_id: s.id,
            turn_id: b.turn_id,
            error: "upstream 500".to_owned(),
            idempotency_key: Some("k-retry".to_owned()),
            now: t(15),
        })
        .await
        .expect("fail");
    let turn = store
        .get_turn(b.turn_id)
        .await
        .expect("turn")
        .expect("exists");
    assert_eq!(turn.state, TurnState::Failed);
    assert_eq!(
        (turn.error.as_deref(), turn.finished_at),
        (Some("upstream 500"), Some(t(15)))
    );
    assert_eq!(
        session(&store, s.id).await.message_count,
        1,
        "messages stay"
    );
    assert_eq!(store.history(s.id).await.expect("history").len(), 1);
    let key = store
        .get_idempotency("k-retry")
        .await
        .expect("idem")
        .expect("exists");
    assert_eq!(key.state, IdempotencyState::Failed);

    // The retry key belongs to this session only.
    let other = created(&store, "agent-a").await;
    let mut foreign = begin(other.id, vec![]);
    foreign.retry_key = Some("k-retry".to_owned());
    assert!(is_conflict(&store.begin_turn(foreign).await));
    let mut unknown = begin(s.id, vec![]);
    unknown.retry_key = Some("k-never".to_owned());
    assert!(is_conflict(&store.begin_turn(unknown).await));

    // The retry runs again without storing the user message twice.
    let mut retry = begin(s.id, vec![]);
    retry.retry_key = Some("k-retry".to_owned());
    let out = store.begin_turn(retry.clone()).await.expect("retry");
    assert_eq!(out.session.message_count, 1);
    let key = store
        .get_idempotency("k-retry")
        .await
        .expect("idem")
        .expect("exists");
    assert_eq!(key.state, IdempotencyState::InProgress);

    let mut f = finish(s.id, Some(retry.turn_id));
    f.idempotency_done = Some(("k-retry".to_owned(), 200, json!({ "id": "r1" })));
    let out = store.finish_turn(f).await.expect("finish");
    assert_eq!((out.session.message_count, out.first_message_seq), (2, 1));
    let key = store
        .get_idempotency("k-retry")
        .await
        .expect("idem")
        .expect("exists");
    assert_eq!(key.state, IdempotencyState::Done);
    assert_eq!(key.response_body, Some(json!({ "id": "r1" })));

    // A done key is not retryable.
    let mut late = begin(s.id, vec![]);
    late.retry_key = Some("k-retry".to_owned());
    assert!(is_conflict(&store.begin_turn(late).await));
}

pub async fn recover_interrupted_turns(store: Arc<dyn Store>) {
    let a = created(&store, "agent-a").await;
    let b = created(&store, "agent-b").await;
    let mut running_a = begin(a.id, vec![msg("user", "a")]);
    running_a.idempotency = Some(idem("k-interrupted", false));
    let running_b = begin(b.id, vec![msg("user", "b")]);
    let finished = begin(b.id, vec![msg("user", "c")]);
    for turn in [&running_a, &running_b, &finished] {
        store.begin_turn(turn.clone()).await.expect("begin");
    }
    store
        .finish_turn(finish(b.id, Some(finished.turn_id)))
        .await
        .expect("finish");

    let mut recovered = store
        .recover_interrupted_turns(t(99))
        .await
        .expect("recover");
    recovered.sort_by_key(|t| t.id);
    let mut expected = vec![running_a.turn_id, running_b.turn_id];
    expected.sort();
    assert_eq!(recovered.iter().map(|t| t.id).collect::<Vec<_>>(), expected);
    for turn in &recovered {
        assert_eq!(turn.state, TurnState::Failed);
        assert_eq!(
            turn.error.as_deref(),
            Some("interrupted by gateway restart")
        );
        assert_eq!(turn.finished_at, Some(t(99)));
        assert_eq!(
            store.get_turn(turn.id).await.expect("turn").as_ref(),
            Some(turn)
        );
    }
    let done = store
        .get_turn(finished.turn_id)
        .await
        .expect("turn")
        .expect("exists");
    assert_eq!(done.state, TurnState::Done);
    assert!(
        store
            .recover_interrupted_turns(t(100))
            .await
            .expect("again")
            .is_empty()
    );
    assert_eq!(
        session(&store, a.id).await.message_count,
        1,
        "messages stay"
    );
    // The key the interrupted turn held becomes retryable, like after `fail_turn`.
    let key = store
        .get_idempotency("k-interrupted")
        .await
        .expect("idem")
        .expect("exists");
    assert_eq!(key.state, IdempotencyState::Failed);
    // An interrupted turn cannot be finished any more.
    assert!(is_conflict(
        &store
            .finish_turn(finish(a.id, Some(running_a.turn_id)))
            .await
    ));
}

// ---- messages ----

pub async fn list_messages_pagination(store: Arc<dyn Store>) {
    let s = created(&store, "agent-a").await;
    let messages: Vec<NewMessage> = (0..7).map(|i| msg("user", &format!("m{i}"))).collect();
    store
        .begin_turn(begin(s.id, messages))
        .await
        .expect("begin");

    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = store.list_messages(s.id, after, 3).await.expect("page");
        assert!(page.len() <= 3);
        let Some(last) = page.last() else { break };
        after = Some(last.seq);
        seen.extend(page.into_iter().map(|m| (m.seq, m.body["content"].clone())));
    }
    let expected: Vec<_> = (0..7u64).map(|i| (i, json!(format!("m{i}")))).collect();
    assert_eq!(seen, expected);
    let tail = store.list_messages(s.id, Some(4), 100).await.expect("tail");
    assert_eq!(tail.iter().map(|m| m.seq).collect::<Vec<_>>(), vec![5, 6]);
    assert!(
        store
            .list_messages(s.id, Some(6), 10)
            .await
            .expect("end")
            .is_empty()
    );
    assert!(
        store
            .list_messages(Uuid::new_v4(), None, 10)
            .await
            .expect("other")
            .is_empty()
    );
}

// ---- concurrency ----

pub async fn concurrent_turns_across_sessions(store: Arc<dyn Store>) {
    const SESSIONS: usize = 20;
    const TURNS: usize = 10;
    let mut ids = Vec::new();
    for _ in 0..SESSIONS {
        ids.push(created(&store, "agent-c").await.id);
    }
    let mut tasks = JoinSet::new();
    for i in 0..SESSIONS * TURNS {
        let store = Arc::clone(&store);
        let sid = ids[i % SESSIONS];
        tasks.spawn(async move {
            let mut b = begin(sid, vec![msg("user", &format!("q{i}"))]);
            b.idempotency = Some(idem(&format!("k-{i}"), false));
            store.begin_turn(b.clone()).await.expect("begin");
            let mut f = finish(sid, Some(b.turn_id));
            f.tether = Some(tether_entry(&format!("r{i}")));
            f.idempotency_done = Some((format!("k-{i}"), 200, json!(i)));
            store.finish_turn(f).await.expect("finish");
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("task");
    }
    for sid in &ids {
        let rec = session(&store, *sid).await;
        assert_eq!(
            (rec.step_count, rec.message_count),
            (TURNS as u64, 2 * TURNS as u64)
        );
        let seqs: Vec<u64> = store
            .history(*sid)
            .await
            .expect("h")
            .iter()
            .map(|m| m.seq)
            .collect();
        assert_eq!(seqs, (0..2 * TURNS as u64).collect::<Vec<_>>());
        let tether = store.tether_pending(*sid, None, 100).await.expect("tether");
        let tseqs: Vec<u64> = tether.iter().map(|e| e.seq).collect();
        assert_eq!(tseqs, (1..=TURNS as u64).collect::<Vec<_>>());
    }
    assert_eq!(
        store.tether_depth_total().await.expect("depth"),
        (SESSIONS * TURNS) as u64
    );
    for i in 0..SESSIONS * TURNS {
        let key = store
            .get_idempotency(&format!("k-{i}"))
            .await
            .expect("idem")
            .expect("exists");
        assert_eq!(key.state, IdempotencyState::Done);
        assert_eq!(key.session_id, ids[i % SESSIONS]);
    }
}

pub async fn concurrent_finish_one_session(store: Arc<dyn Store>) {
    let s = created(&store, "agent-a").await;
    let mut tasks = JoinSet::new();
    for i in 0..100 {
        let store = Arc::clone(&store);
        tasks.spawn(async move {
            let mut f = finish(s.id, None);
            f.tether = Some(tether_entry(&format!("t{i}")));
            let out = store.finish_turn(f).await.expect("finish");
            (out.tether_seq.expect("seq"), out.first_message_seq)
        });
    }
    let mut tether_seqs = Vec::new();
    let mut message_seqs = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (t, m) = done.expect("task");
        tether_seqs.push(t);
        message_seqs.push(m);
    }
    tether_seqs.sort_unstable();
    message_seqs.sort_unstable();
    assert_eq!(tether_seqs, (1..=100).collect::<Vec<u64>>());
    assert_eq!(message_seqs, (0..100).collect::<Vec<u64>>());
    let rec = session(&store, s.id).await;
    assert_eq!((rec.step_count, rec.message_count), (100, 100));
    assert_eq!(store.tether_count(s.id).await.expect("count"), 100);
}

/// Failing and succeeding writes submitted together: each failure undoes only itself.
pub async fn concurrent_conflicts_are_isolated(store: Arc<dyn Store>) {
    let base = created(&store, "agent-a").await;
    let mut tasks = JoinSet::new();
    for i in 0..100 {
        let store = Arc::clone(&store);
        tasks.spawn(async move {
            if i % 2 == 0 {
                // Every even task races for the same key with a session of its own.
                let fresh = new_session("agent-x");
                let mut b = begin(fresh.id, vec![msg("user", "claim")]);
                b.create = Some(fresh.clone());
                b.idempotency = Some(idem("k-contended", true));
                (fresh.id, store.begin_turn(b).await.map(|o| o.session.id))
            } else {
                let mut f = finish(base.id, None);
                f.tether = Some(tether_entry("ok"));
                (base.id, store.finish_turn(f).await.map(|o| o.session.id))
            }
        });
    }
    let mut winners = Vec::new();
    let mut losers = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (sid, result) = done.expect("task");
        match result {
            Ok(_) if sid != base.id => winners.push(sid),
            Ok(_) => {}
            Err(StoreError::Conflict(_)) => losers.push(sid),
            Err(e) => panic!("unexpected error {e:?}"),
        }
    }
    assert_eq!((winners.len(), losers.len()), (1, 49));
    let key = store
        .get_idempotency("k-contended")
        .await
        .expect("idem")
        .expect("exists");
    assert_eq!(key.session_id, winners[0]);
    assert_eq!(session(&store, winners[0]).await.message_count, 1);
    for sid in losers {
        assert_eq!(store.get_session(sid).await.expect("get"), None);
        assert!(store.history(sid).await.expect("history").is_empty());
    }
    let rec = session(&store, base.id).await;
    assert_eq!((rec.step_count, rec.message_count), (50, 50));
    let seqs: Vec<u64> = store
        .tether_pending(base.id, None, 100)
        .await
        .expect("pending")
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seqs, (1..=50).collect::<Vec<u64>>());
    let counts = store.count_sessions_by_status().await.expect("counts");
    assert_eq!(counts.iter().map(|(_, n)| n).sum::<u64>(), 2);
}

// ---- durability ----

/// Writes, drops the store, reopens the same database with `reopen` and reads everything back; a turn
/// left running across the restart is recovered.
pub async fn survives_reopen<F, Fut>(store: Arc<dyn Store>, reopen: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Arc<dyn Store>>,
{
    let s = new_session("agent-r");
    let mut b = begin(s.id, vec![msg("user", "remember me")]);
    b.create = Some(s.clone());
    b.status = Some(SessionStatus::Running);
    b.pre_action = Some(snap(SnapshotKind::PreAction));
    b.idempotency = Some(idem("k-reopen", true));
    store.begin_turn(b.clone()).await.expect("begin");
    let mut f = finish(s.id, Some(b.turn_id));
    f.tether = Some(tether_entry("reply"));
    f.post_action = Some(snap(SnapshotKind::PostAction));
    f.checkpoint = Some((snap(SnapshotKind::Checkpoint), 1));
    f.idempotency_done = Some(("k-reopen".to_owned(), 201, json!({ "a": [1, 2.5, null] })));
    let finished = store.finish_turn(f).await.expect("finish");
    let interrupted = begin(s.id, vec![msg("user", "cut off")]);
    store.begin_turn(interrupted.clone()).await.expect("begin");
    store.tether_ack(s.id, 1).await.expect("ack");

    let before_session = session(&store, s.id).await;
    let before_history = store.history(s.id).await.expect("history");
    let before_snapshots = store.list_snapshots(s.id, 10).await.expect("snapshots");
    let before_key = store.get_idempotency("k-reopen").await.expect("idem");
    drop(store);

    let store = reopen().await;
    assert_eq!(session(&store, s.id).await, before_session);
    let by_token = store
        .find_session_by_token(&s.token_hash)
        .await
        .expect("find");
    assert_eq!(by_token, Some(before_session.clone()));
    assert_eq!(store.history(s.id).await.expect("history"), before_history);
    assert_eq!(before_history.len(), 3);
    assert_eq!(
        store.list_snapshots(s.id, 10).await.expect("snapshots"),
        before_snapshots
    );
    assert_eq!(before_snapshots.len(), 3);
    assert_eq!(
        store
            .latest_snapshot(s.id, Some(SnapshotKind::Checkpoint))
            .await
            .expect("cp"),
        finished.checkpoint_snapshot
    );
    assert_eq!(
        store.get_idempotency("k-reopen").await.expect("idem"),
        before_key
    );
    assert_eq!(
        before_key.and_then(|k| k.response_body),
        Some(json!({ "a": [1, 2.5, null] }))
    );

    let recovered = store
        .recover_interrupted_turns(t(50))
        .await
        .expect("recover");
    assert_eq!(
        recovered.iter().map(|t| t.id).collect::<Vec<_>>(),
        vec![interrupted.turn_id]
    );
    let done = store
        .get_turn(b.turn_id)
        .await
        .expect("turn")
        .expect("exists");
    assert_eq!(done.state, TurnState::Done);

    // The tether counter survived too: the acked seq 1 is not handed out again.
    let mut next = finish(s.id, None);
    next.tether = Some(tether_entry("after restart"));
    assert_eq!(
        store.finish_turn(next).await.expect("finish").tether_seq,
        Some(2)
    );
}
