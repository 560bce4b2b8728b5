//! Conformance cases of turn ownership across gateway replicas sharing one database: the owner a
//! turn records, heartbeats, and the recovery a replica runs, which fails the turns of replicas that
//! stopped heartbeating and leaves those of live replicas alone.

use std::sync::Arc;

use sbp_store::{FailTurn, IdempotencyState, Store, TurnRecord, TurnState};
use uuid::Uuid;

use super::{begin, created, finish, idem, is_conflict, msg, session, t};

/// What recovery writes into the turns it fails (as `recover_interrupted_turns` does).
const INTERRUPTED: &str = "interrupted by gateway restart";

/// A running turn of a new session, begun by `owner` (claiming `key` when given): (session, turn).
async fn running(store: &Arc<dyn Store>, owner: Option<&str>, key: Option<&str>) -> (Uuid, Uuid) {
    let s = created(store, "agent-r").await;
    let mut b = begin(s.id, vec![msg("user", "hi")]);
    b.owner = owner.map(str::to_owned);
    b.idempotency = key.map(|k| idem(k, false));
    store.begin_turn(b.clone()).await.expect("begin");
    (s.id, b.turn_id)
}

async fn turn(store: &Arc<dyn Store>, id: Uuid) -> TurnRecord {
    store
        .get_turn(id)
        .await
        .expect("get turn")
        .expect("turn exists")
}

fn sorted_ids(turns: &[TurnRecord]) -> Vec<Uuid> {
    sorted(turns.iter().map(|t| t.id).collect())
}

fn sorted(mut ids: Vec<Uuid>) -> Vec<Uuid> {
    ids.sort();
    ids
}

pub async fn turn_owner_round_trips(store: Arc<dyn Store>) {
    // With a key (a transaction on PostgreSQL) and without (one statement on its own).
    let (_, keyed) = running(&store, Some("replica-a"), Some("k-owner")).await;
    let (sid, plain) = running(&store, Some("replica-b"), None).await;
    let (_, single) = running(&store, None, None).await;
    let rec = turn(&store, keyed).await;
    assert_eq!(
        (rec.owner.as_deref(), rec.state),
        (Some("replica-a"), TurnState::Running)
    );
    assert_eq!(
        turn(&store, plain).await.owner.as_deref(),
        Some("replica-b")
    );
    assert_eq!(turn(&store, single).await.owner, None);

    store
        .finish_turn(finish(sid, Some(plain)))
        .await
        .expect("finish");
    let done = turn(&store, plain).await;
    assert_eq!(
        (done.owner.as_deref(), done.state),
        (Some("replica-b"), TurnState::Done),
        "the owner stays after the turn"
    );
}

pub async fn recover_orphaned_turns(store: Arc<dyn Store>) {
    for (replica, at) in [("fresh", 100), ("edge", 90), ("stale", 30)] {
        store
            .replica_heartbeat(replica, t(at))
            .await
            .expect("heartbeat");
    }
    let (fresh_sid, fresh) = running(&store, Some("fresh"), Some("k-fresh")).await;
    // A heartbeat exactly at `stale_before` is recent enough.
    let (_, edge) = running(&store, Some("edge"), None).await;
    let (stale_sid, stale) = running(&store, Some("stale"), Some("k-stale")).await;
    let (_, silent) = running(&store, Some("never-heartbeated"), None).await;
    let (_, ownerless) = running(&store, None, None).await;
    // Turns of the stale replica that already ended are left as they are.
    let (done_sid, done) = running(&store, Some("stale"), None).await;
    store
        .finish_turn(finish(done_sid, Some(done)))
        .await
        .expect("finish");
    let (failed_sid, failed) = running(&store, Some("stale"), None).await;
    store
        .fail_turn(FailTurn {
            session_id: failed_sid,
            turn_id: failed,
            error: "upstream 500".to_owned(),
            idempotency_key: None,
            now: t(15),
        })
        .await
        .expect("fail");

    let recovered = store
        .recover_orphaned_turns(t(120), t(90))
        .await
        .expect("recover");
    assert_eq!(
        sorted_ids(&recovered),
        sorted(vec![stale, silent, ownerless])
    );
    for rec in &recovered {
        assert_eq!(rec.state, TurnState::Failed);
        assert_eq!(rec.error.as_deref(), Some(INTERRUPTED));
        assert_eq!(rec.finished_at, Some(t(120)));
        assert_eq!(&turn(&store, rec.id).await, rec);
    }
    let owner_of = |id: Uuid| {
        recovered
            .iter()
            .find(|r| r.id == id)
            .and_then(|r| r.owner.clone())
    };
    assert_eq!(owner_of(stale).as_deref(), Some("stale"));
    assert_eq!(owner_of(ownerless), None);
    for id in [fresh, edge] {
        let rec = turn(&store, id).await;
        assert_eq!(
            (rec.state, rec.finished_at),
            (TurnState::Running, None),
            "a live replica's turn"
        );
    }
    assert_eq!(turn(&store, done).await.state, TurnState::Done);
    let rec = turn(&store, failed).await;
    assert_eq!(
        (rec.error.as_deref(), rec.finished_at),
        (Some("upstream 500"), Some(t(15))),
        "a failed turn keeps its first error"
    );
    assert!(
        store
            .recover_orphaned_turns(t(121), t(90))
            .await
            .expect("again")
            .is_empty()
    );
    assert_eq!(
        session(&store, stale_sid).await.message_count,
        1,
        "messages stay"
    );

    // The key the orphaned turn held becomes retryable, like after `fail_turn`; a live one's not.
    let key = store
        .get_idempotency("k-stale")
        .await
        .expect("idem")
        .expect("exists");
    assert_eq!(key.state, IdempotencyState::Failed);
    let key = store
        .get_idempotency("k-fresh")
        .await
        .expect("idem")
        .expect("exists");
    assert_eq!(key.state, IdempotencyState::InProgress);
    let mut retry = begin(stale_sid, vec![]);
    retry.retry_key = Some("k-stale".to_owned());
    retry.owner = Some("fresh".to_owned());
    store
        .begin_turn(retry)
        .await
        .expect("retry on a live replica");

    // An orphaned turn cannot be finished any more; a live replica's can.
    assert!(is_conflict(
        &store.finish_turn(finish(stale_sid, Some(stale))).await
    ));
    store
        .finish_turn(finish(fresh_sid, Some(fresh)))
        .await
        .expect("finish a live replica's turn");
}

pub async fn heartbeat_keeps_a_replica_alive(store: Arc<dyn Store>) {
    for replica in ["renewed", "lapsed"] {
        store
            .replica_heartbeat(replica, t(10))
            .await
            .expect("heartbeat");
    }
    let (_, renewed) = running(&store, Some("renewed"), None).await;
    let (_, lapsed) = running(&store, Some("lapsed"), None).await;
    store
        .replica_heartbeat("renewed", t(100))
        .await
        .expect("heartbeat again");

    let recovered = store
        .recover_orphaned_turns(t(110), t(50))
        .await
        .expect("recover");
    assert_eq!(sorted_ids(&recovered), vec![lapsed]);
    assert_eq!(turn(&store, renewed).await.state, TurnState::Running);

    // A stale replica that heartbeats again is live again: its next turn is left alone.
    store
        .replica_heartbeat("lapsed", t(120))
        .await
        .expect("heartbeat after lapsing");
    let (_, again) = running(&store, Some("lapsed"), None).await;
    assert!(
        store
            .recover_orphaned_turns(t(130), t(90))
            .await
            .expect("recover")
            .is_empty()
    );
    for id in [renewed, again] {
        assert_eq!(turn(&store, id).await.state, TurnState::Running);
    }
}

pub async fn stale_replicas_are_forgotten(store: Arc<dyn Store>) {
    store
        .replica_heartbeat("gone", t(10))
        .await
        .expect("heartbeat");
    store
        .replica_heartbeat("alive", t(55))
        .await
        .expect("heartbeat");
    assert!(
        store
            .recover_orphaned_turns(t(60), t(50))
            .await
            .expect("recover")
            .is_empty()
    );

    // Both begin a turn without heartbeating again. A recovery whose horizon would count "gone"'s
    // last heartbeat as recent still fails its turn: that heartbeat was forgotten, so "gone" counts
    // as never heartbeated. "alive" was not stale, and kept its row.
    let (_, gone) = running(&store, Some("gone"), None).await;
    let (_, alive) = running(&store, Some("alive"), None).await;
    let recovered = store
        .recover_orphaned_turns(t(70), t(5))
        .await
        .expect("recover");
    assert_eq!(sorted_ids(&recovered), vec![gone]);
    assert_eq!(turn(&store, alive).await.state, TurnState::Running);
}
