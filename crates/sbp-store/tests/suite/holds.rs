//! Conformance cases of session holds (L6): the origin's lease (busy, exclusive, idempotent,
//! expiring), the turn and push guards, the commit (idempotent, refused once expired or by another
//! gateway, the tether and lineage it changes), and the target's adoption (the round trip with the
//! tether's seqs, a stale copy replaced, a session held here refused) and finish.

use std::sync::Arc;

use sbp_protocol::{SessionStatus, SnapshotKind};
use sbp_store::{
    AdoptMigrated, AdoptSession, ConflictKind, HoldRow, HoldState, LeaseRequest, LinkKind,
    NewBundle, NewSession, NewTetherEntry, RestoredSnapshot, Store, StoreError,
};
use serde_json::json;
use tokio::task::JoinSet;
use uuid::Uuid;

use super::{begin, created, finish, msg, new_session, session, snap, t, tether_entry};

const B: &str = "gw-b";
const B_URL: &str = "https://b.example:8443";

fn lease(session_id: Uuid, to: &str, migration_id: Uuid, now: i64, until: i64) -> LeaseRequest {
    LeaseRequest {
        session_id,
        to_gateway: to.to_owned(),
        to_url: format!("https://{}.example:8443", to.trim_start_matches("gw-")),
        migration_id,
        now: t(now),
        until: t(until),
    }
}

fn conflict_of<T: std::fmt::Debug>(r: Result<T, StoreError>) -> ConflictKind {
    match r {
        Err(StoreError::Conflict(kind)) => kind,
        other => panic!("expected a conflict, got {other:?}"),
    }
}

/// A pushed turn with a tether entry, at `now`.
async fn push(store: &Arc<dyn Store>, id: Uuid, text: &str, now: i64) -> Result<u64, StoreError> {
    let mut f = finish(id, None);
    f.tether = Some(tether_entry(text));
    f.now = t(now);
    store
        .finish_turn(f)
        .await
        .map(|out| out.tether_seq.expect("tethered"))
}

async fn hold_of(store: &Arc<dyn Store>, id: Uuid) -> Option<HoldRow> {
    store.hold(id).await.expect("hold")
}

/// A session as its origin carries it: `session`'s id and token, three messages, a snapshot,
/// memory, a bundle and the tether entries given.
fn migrated(
    session: NewSession,
    epoch: u64,
    migration_id: Uuid,
    tether: Vec<(u64, NewTetherEntry)>,
    tether_next_seq: u64,
) -> AdoptMigrated {
    AdoptMigrated {
        adopt: AdoptSession {
            session,
            status: SessionStatus::Suspended,
            step_count: 2,
            last_task: Some("carried task".to_owned()),
            model: Some("m-1".to_owned()),
            messages: vec![
                msg("user", "from the origin"),
                msg("assistant", "answered there"),
                msg("user", "and again"),
            ],
            snapshot: Some(RestoredSnapshot {
                snapshot: snap(SnapshotKind::Checkpoint),
                step_count: 2,
                message_count: 3,
            }),
            memory: Some(("urn:test:memory".to_owned(), json!({"k": "carried"}))),
            bundle: Some(NewBundle {
                cid: format!("{:0>64}", migration_id.simple()),
                bytes: b"{\"bundle\": \"carried\"}".to_vec(),
            }),
            export: None,
            consume_export: None,
            link: None,
            suspend: None,
            now: t(50),
        },
        tether,
        tether_next_seq,
        epoch,
        from_gateway: "gw-a".to_owned(),
        from_url: "https://a.example:8443".to_owned(),
        migration_id,
    }
}

fn entries(texts: &[(u64, &str)]) -> Vec<(u64, NewTetherEntry)> {
    texts
        .iter()
        .map(|(seq, text)| (*seq, tether_entry(text)))
        .collect()
}

async fn pending(store: &Arc<dyn Store>, id: Uuid) -> Vec<(u64, String)> {
    store
        .tether_pending(id, None, 100)
        .await
        .expect("pending")
        .into_iter()
        .map(|e| (e.seq, e.content.unwrap_or_default()))
        .collect()
}

fn texts(v: &[(u64, &str)]) -> Vec<(u64, String)> {
    v.iter().map(|(s, x)| (*s, (*x).to_owned())).collect()
}

/// Moves `id` away: leased to gw-b and committed.
async fn moved_away(store: &Arc<dyn Store>, id: Uuid) -> Uuid {
    let mid = Uuid::now_v7();
    store
        .lease_handover(lease(id, B, mid, 10, 100))
        .await
        .expect("lease");
    store
        .commit_handover(id, mid, B, t(11))
        .await
        .expect("commit");
    mid
}

pub async fn hold_lease_refused_while_a_turn_runs(store: Arc<dyn Store>) {
    let s = created(&store, "agent-h").await;
    assert_eq!(hold_of(&store, s.id).await, None, "no row: home, epoch 0");
    let b = begin(s.id, vec![msg("user", "hi")]);
    store.begin_turn(b.clone()).await.expect("begin");
    let mid = Uuid::now_v7();
    assert_eq!(
        conflict_of(store.lease_handover(lease(s.id, B, mid, 10, 40)).await),
        ConflictKind::SessionBusy
    );
    assert_eq!(hold_of(&store, s.id).await, None, "nothing written");
    store
        .finish_turn(finish(s.id, Some(b.turn_id)))
        .await
        .expect("finish");
    let leased = store
        .lease_handover(lease(s.id, B, mid, 21, 51))
        .await
        .expect("lease once the turn is done");
    assert_eq!(
        leased,
        HoldRow {
            session_id: s.id,
            epoch: 1,
            state: HoldState::Leased,
            peer_gateway: Some(B.to_owned()),
            peer_url: Some(B_URL.to_owned()),
            migration_id: Some(mid),
            lease_expires_at: Some(t(51)),
            updated_at: t(21),
        }
    );
    assert_eq!(hold_of(&store, s.id).await, Some(leased));
    assert!(matches!(
        store
            .lease_handover(lease(Uuid::now_v7(), B, mid, 21, 51))
            .await,
        Err(StoreError::NotFound)
    ));
}

pub async fn hold_lease_is_exclusive_and_idempotent(store: Arc<dyn Store>) {
    let s = created(&store, "agent-h").await;
    let first = Uuid::now_v7();
    let leased = store
        .lease_handover(lease(s.id, B, first, 10, 40))
        .await
        .expect("lease");
    assert_eq!(
        conflict_of(
            store
                .lease_handover(lease(s.id, "gw-c", Uuid::now_v7(), 11, 41))
                .await
        ),
        ConflictKind::SessionMoving,
        "another migration while the lease runs"
    );
    assert_eq!(
        conflict_of(
            store
                .lease_handover(lease(s.id, "gw-c", first, 11, 41))
                .await
        ),
        ConflictKind::SessionMoving,
        "the same migration id from another gateway"
    );
    let again = store
        .lease_handover(lease(s.id, B, first, 12, 42))
        .await
        .expect("a retry");
    assert_eq!(again, leased, "the lease unchanged");

    // Of many gateways asking at once, one gets the lease.
    let contested = created(&store, "agent-h").await.id;
    let mut tasks = JoinSet::new();
    for i in 0..8 {
        let store = Arc::clone(&store);
        tasks.spawn(async move {
            let to = format!("gw-{i}");
            store
                .lease_handover(lease(contested, &to, Uuid::now_v7(), 10, 40))
                .await
        });
    }
    let (mut won, mut moving) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        match r.expect("task") {
            Ok(h) => {
                assert_eq!(h.epoch, 1);
                won += 1;
            }
            Err(StoreError::Conflict(ConflictKind::SessionMoving)) => moving += 1,
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!((won, moving), (1, 7));
}

/// A turn beginning and a lease taken at once: exactly one of them happens.
pub async fn hold_lease_and_turn_race_to_one(store: Arc<dyn Store>) {
    for _ in 0..12 {
        let s = created(&store, "agent-h").await;
        let (a, b) = (Arc::clone(&store), Arc::clone(&store));
        let b_turn = begin(s.id, vec![msg("user", "racing")]);
        let turn_id = b_turn.turn_id;
        let turn = tokio::spawn(async move { a.begin_turn(b_turn).await });
        let leased = tokio::spawn(async move {
            b.lease_handover(lease(s.id, B, Uuid::now_v7(), 10, 100))
                .await
        });
        let (turn, leased) = (turn.await.expect("task"), leased.await.expect("task"));
        match (&turn, &leased) {
            (Ok(_), Err(StoreError::Conflict(ConflictKind::SessionBusy))) => {}
            (Err(StoreError::Conflict(ConflictKind::SessionMoving)), Ok(_)) => {
                assert_eq!(store.get_turn(turn_id).await.expect("turn"), None);
                assert_eq!(session(&store, s.id).await.message_count, 0);
            }
            other => panic!("exactly one must win: {other:?}"),
        }
    }
}

pub async fn hold_lease_expires_and_returns_home(store: Arc<dyn Store>) {
    let s = created(&store, "agent-h").await;
    let first = Uuid::now_v7();
    store
        .lease_handover(lease(s.id, B, first, 10, 30))
        .await
        .expect("lease");
    assert_eq!(store.expire_leases(t(29)).await.expect("expire"), 0);
    assert_eq!(
        hold_of(&store, s.id).await.map(|h| h.state),
        Some(HoldState::Leased)
    );
    // Past its expiry the lease holds nothing, before and after the reaper's update.
    let mut late = begin(s.id, Vec::new());
    late.now = t(31);
    store
        .begin_turn(late.clone())
        .await
        .expect("a turn after the lease expired");
    let mut done = finish(s.id, Some(late.turn_id));
    done.now = t(32);
    store.finish_turn(done).await.expect("finish");
    assert_eq!(store.expire_leases(t(30)).await.expect("expire"), 1);
    assert_eq!(
        hold_of(&store, s.id).await,
        Some(HoldRow {
            session_id: s.id,
            epoch: 1,
            state: HoldState::Home,
            peer_gateway: None,
            peer_url: None,
            migration_id: None,
            lease_expires_at: None,
            updated_at: t(30),
        }),
        "home, epoch kept"
    );
    assert_eq!(store.expire_leases(t(99)).await.expect("expire"), 0);
    let second = store
        .lease_handover(lease(s.id, "gw-c", Uuid::now_v7(), 40, 70))
        .await
        .expect("leasable again");
    assert_eq!((second.epoch, second.state), (2, HoldState::Leased));
    // An expired lease is leased again without waiting for the reaper.
    let third = store
        .lease_handover(lease(s.id, B, Uuid::now_v7(), 71, 90))
        .await
        .expect("over an expired lease");
    assert_eq!((third.epoch, third.peer_gateway.as_deref()), (3, Some(B)));
}

pub async fn hold_guards_turns_and_pushes(store: Arc<dyn Store>) {
    let s = created(&store, "agent-h").await;
    assert_eq!(push(&store, s.id, "before", 5).await.expect("push"), 1);
    let mid = Uuid::now_v7();
    store
        .lease_handover(lease(s.id, B, mid, 10, 100))
        .await
        .expect("lease");
    let mut b = begin(s.id, vec![msg("user", "while leased")]);
    b.now = t(20);
    assert_eq!(
        conflict_of(store.begin_turn(b.clone()).await),
        ConflictKind::SessionMoving
    );
    assert_eq!(
        conflict_of(push(&store, s.id, "while leased", 20).await),
        ConflictKind::SessionMoving
    );
    let now = session(&store, s.id).await;
    assert_eq!(now.message_count, 1, "nothing written");
    assert_eq!(texts(&[(1, "before")]), pending(&store, s.id).await);
    // Attaching is not a write to the transcript: it is not refused.
    store.mark_attached(s.id, t(21)).await.expect("attach");

    store
        .commit_handover(s.id, mid, B, t(30))
        .await
        .expect("commit");
    b.now = t(200);
    assert_eq!(
        conflict_of(store.begin_turn(b.clone()).await),
        ConflictKind::SessionMoved
    );
    assert_eq!(
        conflict_of(push(&store, s.id, "after the move", 200).await),
        ConflictKind::SessionMoved
    );
    assert_eq!(session(&store, s.id).await.message_count, 1);
    assert!(pending(&store, s.id).await.is_empty());

    // Another session of the store is not affected.
    let other = created(&store, "agent-h").await;
    store
        .begin_turn(begin(other.id, vec![msg("user", "free")]))
        .await
        .expect("another session's turn");
}

pub async fn hold_commit_moves_the_session(store: Arc<dyn Store>) {
    let s = created(&store, "agent-h").await;
    push(&store, s.id, "one", 5).await.expect("push");
    push(&store, s.id, "two", 6).await.expect("push");
    assert_eq!(
        pending(&store, s.id).await.len(),
        2,
        "streamed, if a tether"
    );
    let mid = Uuid::now_v7();
    let leased = store
        .lease_handover(lease(s.id, B, mid, 10, 40))
        .await
        .expect("lease");
    assert_eq!(
        conflict_of(store.commit_handover(s.id, mid, "gw-c", t(20)).await),
        ConflictKind::LeaseExpired,
        "by another gateway"
    );
    assert_eq!(
        conflict_of(store.commit_handover(s.id, Uuid::now_v7(), B, t(20)).await),
        ConflictKind::LeaseExpired,
        "another migration"
    );
    assert_eq!(hold_of(&store, s.id).await, Some(leased), "unchanged");

    let moved = store
        .commit_handover(s.id, mid, B, t(20))
        .await
        .expect("commit");
    let expected = HoldRow {
        session_id: s.id,
        epoch: 1,
        state: HoldState::Moved,
        peer_gateway: Some(B.to_owned()),
        peer_url: Some(B_URL.to_owned()),
        migration_id: Some(mid),
        lease_expires_at: None,
        updated_at: t(20),
    };
    assert_eq!(moved, expected);
    assert!(pending(&store, s.id).await.is_empty(), "B has the tether");
    assert_eq!(store.tether_count(s.id).await.expect("count"), 0);
    assert_eq!(store.tether_depth_total().await.expect("depth"), 0);
    assert_eq!(
        store.tether_issued(s.id).await.expect("issued"),
        2,
        "the seqs stay issued"
    );
    let again = store
        .commit_handover(s.id, mid, B, t(60))
        .await
        .expect("a retry, even after the lease's expiry");
    assert_eq!(again, expected);

    let lineage = store.lineage(s.id).await.expect("lineage");
    assert_eq!(lineage.outgoing.len(), 1, "{lineage:?}");
    let link = &lineage.outgoing[0];
    assert_eq!(
        (
            link.id,
            link.kind,
            link.from_session,
            link.to_session,
            link.peer_gateway.as_deref(),
            link.created_at,
        ),
        (mid, LinkKind::MigratedTo, Some(s.id), s.id, Some(B), t(20))
    );
    assert_eq!(
        lineage.incoming, lineage.outgoing,
        "the session is both ends"
    );
    // The session's own content stays as a copy.
    assert_eq!(session(&store, s.id).await.message_count, 2);

    // No lease to commit; no session.
    let home = created(&store, "agent-h").await;
    assert_eq!(
        conflict_of(store.commit_handover(home.id, mid, B, t(20)).await),
        ConflictKind::LeaseExpired
    );
    assert!(matches!(
        store.commit_handover(Uuid::now_v7(), mid, B, t(20)).await,
        Err(StoreError::NotFound)
    ));
    // A moved session is not leased again here (its holder leases it).
    assert_eq!(
        conflict_of(
            store
                .lease_handover(lease(s.id, "gw-c", Uuid::now_v7(), 61, 90))
                .await
        ),
        ConflictKind::SessionMoved
    );
}

pub async fn hold_commit_after_expiry_is_refused(store: Arc<dyn Store>) {
    let s = created(&store, "agent-h").await;
    push(&store, s.id, "kept", 5).await.expect("push");
    let mid = Uuid::now_v7();
    store
        .lease_handover(lease(s.id, B, mid, 10, 30))
        .await
        .expect("lease");
    assert_eq!(
        conflict_of(store.commit_handover(s.id, mid, B, t(30)).await),
        ConflictKind::LeaseExpired
    );
    assert_eq!(
        hold_of(&store, s.id).await.map(|h| h.state),
        Some(HoldState::Leased)
    );
    assert_eq!(pending(&store, s.id).await, texts(&[(1, "kept")]));
    assert!(
        store
            .lineage(s.id)
            .await
            .expect("lineage")
            .outgoing
            .is_empty()
    );
    store.expire_leases(t(31)).await.expect("expire");
    assert_eq!(
        conflict_of(store.commit_handover(s.id, mid, B, t(31)).await),
        ConflictKind::LeaseExpired,
        "home again"
    );
}

pub async fn hold_adopt_migrated_round_trip(store: Arc<dyn Store>) {
    let origin = new_session("agent-m");
    let mid = Uuid::now_v7();
    let m = migrated(
        origin.clone(),
        3,
        mid,
        entries(&[(4, "four"), (6, "six")]),
        9,
    );
    let carried = m.tether.clone();
    let rec = store.adopt_migrated(m.clone()).await.expect("adopt");
    assert_eq!(
        (rec.id, rec.token_hash.as_str(), rec.agent_id.as_str()),
        (origin.id, origin.token_hash.as_str(), "agent-m")
    );
    assert_eq!(
        (rec.status, rec.step_count, rec.message_count),
        (SessionStatus::Suspended, 2, 3)
    );
    assert_eq!(rec.metadata, origin.metadata);
    assert_eq!(session(&store, origin.id).await, rec);
    let found = store
        .find_session_by_token(&origin.token_hash)
        .await
        .expect("by token");
    assert_eq!(found.map(|f| f.id), Some(origin.id));
    let history: Vec<_> = store
        .history(origin.id)
        .await
        .expect("history")
        .into_iter()
        .map(|h| h.body)
        .collect();
    let sent: Vec<_> = m.adopt.messages.iter().map(|x| x.body.to_value()).collect();
    assert_eq!(history, sent, "verbatim, no note added");
    let restored = store
        .latest_snapshot(origin.id, None)
        .await
        .expect("snapshot")
        .expect("restored");
    assert_eq!(
        (restored.step_count, restored.message_count, restored.kind),
        (2, 3, SnapshotKind::Checkpoint)
    );
    let memory = store
        .get_memory(origin.id)
        .await
        .expect("memory")
        .expect("kept");
    assert_eq!(memory.payload, json!({"k": "carried"}));
    let bundle = m.adopt.bundle.clone().expect("bundle");
    assert_eq!(
        store.get_bundle(&bundle.cid).await.expect("bundle"),
        Some(bundle.bytes)
    );

    // The tether under the origin's seqs, and the origin's next seq.
    let got = store
        .tether_pending(origin.id, None, 100)
        .await
        .expect("pending");
    assert_eq!(got.len(), 2);
    for (entry, (seq, new)) in got.iter().zip(&carried) {
        assert_eq!(
            (
                entry.seq,
                &entry.role,
                &entry.content,
                &entry.model_used,
                entry.created_at,
                entry.chunk_id
            ),
            (
                *seq,
                &new.role,
                &new.content,
                &new.model_used,
                new.created_at,
                new.chunk_id
            )
        );
        assert_eq!(entry.session_id, origin.id);
    }
    assert_eq!(
        store
            .tether_pending(origin.id, Some(4), 100)
            .await
            .expect("after")
            .len(),
        1
    );
    assert_eq!(store.tether_issued(origin.id).await.expect("issued"), 8);

    let incoming = HoldRow {
        session_id: origin.id,
        epoch: 3,
        state: HoldState::Incoming,
        peer_gateway: Some("gw-a".to_owned()),
        peer_url: Some("https://a.example:8443".to_owned()),
        migration_id: Some(mid),
        lease_expires_at: None,
        updated_at: t(50),
    };
    assert_eq!(hold_of(&store, origin.id).await, Some(incoming.clone()));
    assert_eq!(
        store.incoming_holds().await.expect("incoming"),
        vec![incoming]
    );
    // Until the move is finished, the session takes no turn and cannot be leased on.
    assert_eq!(
        conflict_of(store.begin_turn(begin(origin.id, Vec::new())).await),
        ConflictKind::SessionMoving
    );
    assert_eq!(
        conflict_of(
            store
                .lease_handover(lease(origin.id, "gw-c", Uuid::now_v7(), 51, 90))
                .await
        ),
        ConflictKind::SessionMoving
    );
    assert_eq!(
        conflict_of(
            store
                .finish_incoming(origin.id, Uuid::now_v7(), true, t(51))
                .await
        ),
        ConflictKind::LeaseExpired,
        "another migration's finish"
    );

    store
        .finish_incoming(origin.id, mid, true, t(52))
        .await
        .expect("finish");
    assert_eq!(
        hold_of(&store, origin.id).await,
        Some(HoldRow {
            session_id: origin.id,
            epoch: 3,
            state: HoldState::Home,
            peer_gateway: None,
            peer_url: None,
            migration_id: Some(mid),
            lease_expires_at: None,
            updated_at: t(52),
        })
    );
    store
        .finish_incoming(origin.id, mid, true, t(53))
        .await
        .expect("again: nothing to do");
    assert!(store.incoming_holds().await.expect("incoming").is_empty());
    let lineage = store.lineage(origin.id).await.expect("lineage");
    assert_eq!(lineage.incoming.len(), 1, "{lineage:?}");
    let link = &lineage.incoming[0];
    assert_eq!(
        (
            link.id,
            link.kind,
            link.from_session,
            link.peer_gateway.as_deref(),
            link.created_at
        ),
        (
            mid,
            LinkKind::MigratedFrom,
            Some(origin.id),
            Some("gw-a"),
            t(52)
        )
    );

    // Home: a pushed turn continues the origin's seqs, a turn runs.
    assert_eq!(
        push(&store, origin.id, "new here", 60).await.expect("push"),
        9
    );
    assert_eq!(
        pending(&store, origin.id).await,
        texts(&[(4, "four"), (6, "six"), (9, "new here")])
    );
    store
        .begin_turn(begin(origin.id, vec![msg("user", "here now")]))
        .await
        .expect("a turn");
}

/// A session that left and comes back replaces its stale copy (and its tether's stream); a
/// session held here is never replaced.
pub async fn hold_adopt_replaces_only_a_moved_copy(store: Arc<dyn Store>) {
    let s = created(&store, "agent-m").await;
    push(&store, s.id, "one", 5).await.expect("push");
    push(&store, s.id, "two", 6).await.expect("push");
    // Read, so a Redis tether has streamed them (and recorded seq 2 as streamed).
    assert_eq!(pending(&store, s.id).await.len(), 2);
    let back = Uuid::now_v7();
    assert_eq!(
        conflict_of(
            store
                .adopt_migrated(migrated(s.clone(), 2, back, Vec::new(), 3))
                .await
        ),
        ConflictKind::Duplicate(format!("session {} is held here", s.id)),
        "at home"
    );
    assert_eq!(pending(&store, s.id).await.len(), 2, "untouched");
    assert_eq!(session(&store, s.id).await.message_count, 2);

    let away = moved_away(&store, s.id).await;
    // Its holder carries the same two entries back, with a later one.
    let m = migrated(
        s.clone(),
        2,
        back,
        entries(&[(1, "one"), (2, "two"), (3, "three")]),
        4,
    );
    let rec = store
        .adopt_migrated(m.clone())
        .await
        .expect("over the stale copy");
    assert_eq!(rec.message_count, 3);
    assert_eq!(
        store.history(s.id).await.expect("history").len(),
        3,
        "the carried history, not the copy's"
    );
    assert_eq!(
        pending(&store, s.id).await,
        texts(&[(1, "one"), (2, "two"), (3, "three")]),
        "the carried seqs, also those this gateway streamed before"
    );
    assert_eq!(
        hold_of(&store, s.id).await.map(|h| (h.state, h.epoch)),
        Some((HoldState::Incoming, 2))
    );
    let lineage = store.lineage(s.id).await.expect("lineage");
    assert_eq!(
        lineage.outgoing.iter().map(|l| l.id).collect::<Vec<_>>(),
        vec![away],
        "the earlier move stays in the lineage"
    );
    // An unfinished adoption is not replaced either.
    assert!(matches!(
        store.adopt_migrated(m).await,
        Err(StoreError::Conflict(ConflictKind::Duplicate(_)))
    ));
}

pub async fn hold_finish_incoming_false_deletes(store: Arc<dyn Store>) {
    let origin = new_session("agent-m");
    let mid = Uuid::now_v7();
    store
        .adopt_migrated(migrated(origin.clone(), 1, mid, entries(&[(1, "x")]), 2))
        .await
        .expect("adopt");
    let unfinished = created(&store, "agent-m").await;
    store
        .finish_incoming(origin.id, Uuid::now_v7(), false, t(51))
        .await
        .expect("another migration's: nothing happens");
    assert!(store.get_session(origin.id).await.expect("get").is_some());
    assert_eq!(
        store
            .incoming_holds()
            .await
            .expect("incoming")
            .iter()
            .map(|h| h.session_id)
            .collect::<Vec<_>>(),
        vec![origin.id],
        "the unfinished one"
    );

    store
        .finish_incoming(origin.id, mid, false, t(52))
        .await
        .expect("failed move");
    assert_eq!(store.get_session(origin.id).await.expect("get"), None);
    assert_eq!(
        store
            .find_session_by_token(&origin.token_hash)
            .await
            .expect("by token"),
        None
    );
    assert_eq!(hold_of(&store, origin.id).await, None);
    assert!(store.history(origin.id).await.expect("history").is_empty());
    assert!(pending(&store, origin.id).await.is_empty());
    assert_eq!(store.get_memory(origin.id).await.expect("memory"), None);
    assert!(store.incoming_holds().await.expect("incoming").is_empty());
    store
        .finish_incoming(origin.id, mid, false, t(53))
        .await
        .expect("again");
    assert!(matches!(
        store.finish_incoming(origin.id, mid, true, t(54)).await,
        Err(StoreError::NotFound)
    ));
    // A session at home is never deleted by a finish.
    store
        .finish_incoming(unfinished.id, mid, false, t(55))
        .await
        .expect("not this move's");
    assert!(
        store
            .get_session(unfinished.id)
            .await
            .expect("get")
            .is_some()
    );
    // The same session can arrive again (the origin's lease was retried).
    let again = Uuid::now_v7();
    store
        .adopt_migrated(migrated(origin.clone(), 2, again, Vec::new(), 2))
        .await
        .expect("adopt again");
    store
        .finish_incoming(origin.id, again, true, t(56))
        .await
        .expect("finish");
}

/// The epoch grows with every lease, wherever the session is held: A leases (1) and commits, B
/// leases it back (2) and A adopts it, A leases again (3).
pub async fn hold_epoch_grows_across_moves(store: Arc<dyn Store>) {
    let s = created(&store, "agent-m").await;
    let out = Uuid::now_v7();
    let first = store
        .lease_handover(lease(s.id, B, out, 10, 40))
        .await
        .expect("lease");
    assert_eq!(first.epoch, 1);
    let moved = store
        .commit_handover(s.id, out, B, t(11))
        .await
        .expect("commit");
    assert_eq!((moved.state, moved.epoch), (HoldState::Moved, 1));
    let back = Uuid::now_v7();
    store
        .adopt_migrated(migrated(s.clone(), first.epoch + 1, back, Vec::new(), 1))
        .await
        .expect("adopt");
    store
        .finish_incoming(s.id, back, true, t(60))
        .await
        .expect("finish");
    assert_eq!(
        hold_of(&store, s.id).await.map(|h| (h.state, h.epoch)),
        Some((HoldState::Home, 2))
    );
    let third = store
        .lease_handover(lease(s.id, "gw-c", Uuid::now_v7(), 70, 100))
        .await
        .expect("lease again");
    assert_eq!(third.epoch, 3);
    let kinds: Vec<LinkKind> = store
        .lineage(s.id)
        .await
        .expect("lineage")
        .outgoing
        .iter()
        .map(|l| l.kind)
        .collect();
    assert_eq!(kinds, vec![LinkKind::MigratedTo, LinkKind::MigratedFrom]);
}

pub async fn hold_release_ends_only_its_own_lease(store: Arc<dyn Store>) {
    let s = created(&store, "agent-h").await;
    let mid = Uuid::now_v7();
    store
        .lease_handover(lease(s.id, B, mid, 10, 40))
        .await
        .expect("lease");
    // Another migration's id, or another gateway, releases nothing.
    assert!(
        !store
            .release_lease(s.id, Uuid::now_v7(), B, t(11))
            .await
            .expect("release")
    );
    assert!(
        !store
            .release_lease(s.id, mid, "gw-c", t(11))
            .await
            .expect("release")
    );
    assert_eq!(
        hold_of(&store, s.id).await.map(|h| h.state),
        Some(HoldState::Leased)
    );
    // The lease's own gateway ends it: home at once, epoch kept, turns allowed again.
    assert!(
        store
            .release_lease(s.id, mid, B, t(12))
            .await
            .expect("release")
    );
    let h = hold_of(&store, s.id).await.expect("a hold");
    assert_eq!(
        (h.state, h.epoch, h.migration_id),
        (HoldState::Home, 1, None)
    );
    let mut turn = begin(s.id, Vec::new());
    turn.now = t(13);
    store.begin_turn(turn).await.expect("a turn once released");
    // Released once: a second release, or a commit of that migration, finds no lease.
    assert!(
        !store
            .release_lease(s.id, mid, B, t(14))
            .await
            .expect("release")
    );
    assert_eq!(
        conflict_of(store.commit_handover(s.id, mid, B, t(15)).await),
        ConflictKind::LeaseExpired
    );
}
