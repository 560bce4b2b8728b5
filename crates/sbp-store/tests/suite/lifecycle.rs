//! Conformance cases of the session lifecycle: listing newest first with filters and a keyset
//! position, and erasing a session with everything that holds its content (the lineage keeping
//! only ids, a consumed foreign export keeping its single use, shared bundles kept), refused while
//! the session moves, and no later write of a turn bringing any of it back.

use std::sync::Arc;

use sbp_protocol::SessionStatus;
use sbp_store::{
    AdoptSession, ConflictKind, LeaseRequest, NewBundle, NewExport, SessionQuery, Store,
    StoreError, TurnProgress,
};
use uuid::Uuid;

use super::sealing::write_everything;
use super::{begin, finish, msg, new_session, t};

fn page(limit: u32) -> SessionQuery {
    SessionQuery {
        limit,
        ..SessionQuery::default()
    }
}

/// Every page of `query` in turn, each at most `limit` long; the ids in order.
async fn all_pages(store: &Arc<dyn Store>, mut query: SessionQuery) -> Vec<Uuid> {
    let mut ids = Vec::new();
    loop {
        let got = store.list_sessions(query.clone()).await.expect("list");
        assert!(got.len() <= query.limit as usize);
        let Some(last) = got.last() else {
            return ids;
        };
        query.after = Some((last.created_at, last.id));
        let full = got.len() == query.limit as usize;
        ids.extend(got.iter().map(|s| s.id));
        if !full {
            return ids;
        }
    }
}

pub async fn list_sessions_newest_first_filtered_and_paged(store: Arc<dyn Store>) {
    // Seven sessions of two agents; two share a creation instant (the id breaks the tie).
    let mut made = Vec::new();
    for (i, agent) in ["a", "b", "a", "a", "b", "a", "b"].iter().enumerate() {
        let mut s = new_session(agent);
        s.created_at = t(if i == 6 { 5 } else { i as i64 });
        store.create_session(s.clone()).await.expect("create");
        made.push(s);
    }
    store
        .update_status(made[2].id, SessionStatus::Running, t(20))
        .await
        .expect("running");
    store
        .update_status(made[4].id, SessionStatus::Running, t(20))
        .await
        .expect("running");
    let mut newest_first = made.clone();
    newest_first.sort_by_key(|s| std::cmp::Reverse((s.created_at, s.id)));
    let expected: Vec<Uuid> = newest_first.iter().map(|s| s.id).collect();

    let first = store.list_sessions(page(100)).await.expect("list");
    assert_eq!(first.iter().map(|s| s.id).collect::<Vec<_>>(), expected);
    assert_eq!(first[0].agent_id, newest_first[0].agent_id);
    assert_eq!(first[0].metadata, newest_first[0].metadata);
    for limit in [1, 2, 3, 7] {
        assert_eq!(
            all_pages(&store, page(limit)).await,
            expected,
            "limit {limit}"
        );
    }

    let of_a: Vec<Uuid> = newest_first
        .iter()
        .filter(|s| s.agent_id == "a")
        .map(|s| s.id)
        .collect();
    let by_agent = SessionQuery {
        agent_id: Some("a".to_owned()),
        limit: 2,
        ..SessionQuery::default()
    };
    assert_eq!(all_pages(&store, by_agent).await, of_a);
    let running = SessionQuery {
        status: Some(SessionStatus::Running),
        limit: 1,
        ..SessionQuery::default()
    };
    assert_eq!(all_pages(&store, running).await, [made[4].id, made[2].id]);
    let both = SessionQuery {
        agent_id: Some("b".to_owned()),
        status: Some(SessionStatus::Idle),
        limit: 10,
        ..SessionQuery::default()
    };
    let idle_b: Vec<Uuid> = newest_first
        .iter()
        .filter(|s| s.agent_id == "b" && s.id != made[4].id)
        .map(|s| s.id)
        .collect();
    assert_eq!(all_pages(&store, both).await, idle_b);
    let nobody = SessionQuery {
        agent_id: Some("nobody".to_owned()),
        limit: 10,
        ..SessionQuery::default()
    };
    assert!(store.list_sessions(nobody).await.expect("list").is_empty());
    // A position past the oldest session: nothing after it.
    let oldest = &newest_first[newest_first.len() - 1];
    let past = SessionQuery {
        after: Some((oldest.created_at, oldest.id)),
        limit: 10,
        ..SessionQuery::default()
    };
    assert!(store.list_sessions(past).await.expect("list").is_empty());
}

/// A bundle holding `text`, under a CID of its own.
fn bundle_with(text: &str) -> NewBundle {
    NewBundle {
        cid: format!("{:0>64}", Uuid::new_v4().simple()),
        bytes: format!("{{\"carried\": \"{text}\"}}").into_bytes(),
    }
}

fn imported(bundle: Option<NewBundle>, export: Option<NewExport>) -> AdoptSession {
    let consume = export.as_ref().map(|e| e.id);
    AdoptSession {
        session: new_session("agent-i"),
        status: SessionStatus::Idle,
        step_count: 0,
        last_task: None,
        model: None,
        messages: vec![msg("user", "imported history")],
        snapshot: None,
        memory: None,
        bundle,
        export,
        consume_export: consume,
        link: None,
        suspend: None,
        now: t(50),
    }
}

pub async fn delete_session_erases_everything_of_it(store: Arc<dyn Store>) {
    let marker = format!("ERASE-{}", Uuid::new_v4().simple());
    let w = write_everything(&store, &marker).await;
    let id = w.session.id;
    store
        .next_announcement(&w.bundle.cid, 1, t(9_000), t(50))
        .await
        .expect("announced");
    let kept = write_everything(&store, "KEPT").await;

    store.delete_session(id, t(60)).await.expect("delete");

    assert_eq!(store.get_session(id).await.expect("get"), None);
    assert!(store.history(id).await.expect("history").is_empty());
    assert!(
        store
            .list_snapshots(id, 10)
            .await
            .expect("snaps")
            .is_empty()
    );
    assert_eq!(
        store.get_snapshot(w.snapshot.id).await.expect("snapshot"),
        None
    );
    assert!(
        store
            .tether_pending(id, None, 10)
            .await
            .expect("tether")
            .is_empty()
    );
    assert_eq!(store.tether_count(id).await.expect("count"), 0);
    assert_eq!(store.get_turn(w.failed_turn).await.expect("turn"), None);
    assert_eq!(
        store
            .get_idempotency(&w.idempotency_key)
            .await
            .expect("key"),
        None
    );
    assert_eq!(store.get_memory(id).await.expect("memory"), None);
    assert_eq!(store.get_export(w.export.id).await.expect("export"), None);
    assert_eq!(store.get_bundle(&w.bundle.cid).await.expect("bundle"), None);
    let announced = store
        .announcements_expiring_before(t(100_000))
        .await
        .expect("announcements");
    assert!(announced.iter().all(|a| a.bundle_cid != w.bundle.cid));
    let listed = store.list_sessions(page(100)).await.expect("list");
    assert!(listed.iter().all(|s| s.id != id));
    assert!(listed.iter().any(|s| s.id == kept.session.id));

    // The fork keeps its own copy; the link between them keeps only its ids.
    let fork = store.lineage(w.adopted).await.expect("lineage");
    let link = &fork.incoming[0];
    assert_eq!(
        (link.id, link.from_session, link.to_session),
        (w.link.id, Some(id), w.adopted)
    );
    assert_eq!((&link.label, &link.reason), (&None, &None));
    assert_eq!(store.history(w.adopted).await.expect("history").len(), 3);

    // The other session is whole.
    let other = kept.session.id;
    assert_eq!(store.history(other).await.expect("history").len(), 3);
    assert!(store.get_memory(other).await.expect("memory").is_some());
    assert!(
        store
            .get_bundle(&kept.bundle.cid)
            .await
            .expect("bundle")
            .is_some()
    );
    assert_eq!(
        store.lineage(other).await.expect("lineage").outgoing[0].label,
        kept.link.label
    );

    // Gone for good: a second erasure, and any write naming the session, find nothing.
    assert_eq!(
        store.delete_session(id, t(61)).await,
        Err(StoreError::NotFound)
    );
    let late_export = NewExport {
        id: Uuid::new_v4(),
        ..w.export.clone()
    };
    assert_eq!(
        store.create_export(late_export, w.bundle.clone()).await,
        Err(StoreError::NotFound)
    );
    assert_eq!(store.get_bundle(&w.bundle.cid).await.expect("bundle"), None);
    assert!(
        store
            .put_memory(id, "sbp.memory.v1".to_owned(), serde_json::json!({}), t(62))
            .await
            .is_err()
    );
    assert_eq!(store.get_memory(id).await.expect("memory"), None);
}

/// A turn that began before the erasure writes nothing after it: its progress and its finish
/// find no session.
pub async fn delete_session_under_a_running_turn(store: Arc<dyn Store>) {
    let s = new_session("agent-r");
    let id = s.id;
    let mut b = begin(id, vec![msg("user", "start")]);
    b.create = Some(s);
    let turn = b.turn_id;
    store.begin_turn(b).await.expect("begin");
    store.delete_session(id, t(11)).await.expect("delete");
    let progress = store
        .record_progress(TurnProgress {
            session_id: id,
            turn_id: turn,
            messages: vec![msg("tool", "late tool result")],
            snapshots: Vec::new(),
            now: t(12),
        })
        .await;
    assert!(progress.is_err(), "{progress:?}");
    let mut f = finish(id, Some(turn));
    f.tether = Some(super::tether_entry("late reply"));
    let finished = store.finish_turn(f).await;
    assert!(finished.is_err(), "{finished:?}");
    let pushed = store.finish_turn(finish(id, None)).await;
    assert_eq!(pushed.map(drop), Err(StoreError::NotFound));
    assert_eq!(store.get_session(id).await.expect("get"), None);
    assert!(store.history(id).await.expect("history").is_empty());
    assert!(
        store
            .tether_pending(id, None, 10)
            .await
            .expect("tether")
            .is_empty()
    );
}

/// The bundles a session came in with go with it, unless another session came in with the same
/// one; a foreign export it consumed stays (without its label), so its token still imports once.
pub async fn delete_session_bundles_it_came_in_with(store: Arc<dyn Store>) {
    // Two sessions imported from the same raw bundle.
    let shared = bundle_with("shared history");
    let first = imported(Some(shared.clone()), None);
    let second = imported(Some(shared.clone()), None);
    let (first_id, second_id) = (first.session.id, second.session.id);
    store.adopt_session(first).await.expect("first import");
    store.adopt_session(second).await.expect("second import");
    store.delete_session(first_id, t(60)).await.expect("delete");
    assert!(
        store
            .get_bundle(&shared.cid)
            .await
            .expect("bundle")
            .is_some(),
        "the other session came in with it"
    );
    store
        .delete_session(second_id, t(61))
        .await
        .expect("delete");
    assert_eq!(store.get_bundle(&shared.cid).await.expect("bundle"), None);

    // A foreign token's export, consumed by the import.
    let carried = bundle_with("foreign history");
    let export = NewExport {
        id: Uuid::new_v4(),
        session_id: Uuid::new_v4(),
        bundle_cid: carried.cid.clone(),
        label: Some("foreign label".to_owned()),
        message_count: 1,
        created_at: t(30),
        expires_at: t(3600),
        foreign: true,
    };
    let import = imported(Some(carried.clone()), Some(export.clone()));
    let imported_id = import.session.id;
    store.adopt_session(import).await.expect("import");
    store
        .delete_session(imported_id, t(62))
        .await
        .expect("delete");
    assert_eq!(store.get_bundle(&carried.cid).await.expect("bundle"), None);
    let record = store
        .get_export(export.id)
        .await
        .expect("export")
        .expect("kept as the record of its single use");
    assert_eq!(record.label, None);
    assert_eq!(record.import_session_id, Some(imported_id));
    assert!(record.imported_at.is_some());
    let again = imported(Some(carried.clone()), Some(export.clone()));
    assert_eq!(
        store.adopt_session(again).await.map(drop),
        Err(StoreError::Consumed)
    );
    assert_eq!(store.get_bundle(&carried.cid).await.expect("bundle"), None);
}

pub async fn delete_session_waits_for_a_move_to_end(store: Arc<dyn Store>) {
    let s = new_session("agent-m");
    let id = s.id;
    store.create_session(s).await.expect("create");
    let migration = Uuid::new_v4();
    store
        .lease_handover(LeaseRequest {
            session_id: id,
            to_gateway: "gw-b".to_owned(),
            to_url: "https://b.example:8443".to_owned(),
            migration_id: migration,
            now: t(10),
            until: t(100),
        })
        .await
        .expect("lease");
    assert_eq!(
        store.delete_session(id, t(20)).await,
        Err(StoreError::Conflict(ConflictKind::SessionMoving))
    );
    assert!(store.get_session(id).await.expect("get").is_some());
    // Once moved away, the copy left here may go.
    store
        .commit_handover(id, migration, "gw-b", t(30))
        .await
        .expect("commit");
    store.delete_session(id, t(40)).await.expect("delete");
    assert_eq!(store.get_session(id).await.expect("get"), None);
    assert_eq!(store.hold(id).await.expect("hold"), None);
}
