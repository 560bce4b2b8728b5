//! Conformance cases of L3 roaming storage: bundles and exports, sessions adopted with a history,
//! single-use consumption under contention, all-or-nothing adoption, lineage and session memory.

use std::sync::Arc;

use sbp_protocol::{SessionStatus, SnapshotKind};
use sbp_store::{
    AdoptSession, LinkKind, LinkRecord, NewBundle, NewExport, RestoredSnapshot, Store, StoreError,
};
use serde_json::json;
use tokio::task::JoinSet;
use uuid::Uuid;

use super::{created, msg, new_session, session, snap, t};

fn bundle(tag: &str) -> NewBundle {
    NewBundle {
        cid: format!("{:0>64}", tag),
        bytes: format!("{{\"tag\": \"{tag}\"}}").into_bytes(),
    }
}

fn export(session_id: Uuid, cid: &str) -> NewExport {
    NewExport {
        id: Uuid::new_v4(),
        session_id,
        bundle_cid: cid.to_owned(),
        label: Some("label".to_owned()),
        message_count: 3,
        created_at: t(30),
        expires_at: t(3600),
        foreign: false,
    }
}

fn link(kind: LinkKind, from: Uuid, to: Uuid, export_id: Option<Uuid>) -> LinkRecord {
    LinkRecord {
        id: Uuid::new_v4(),
        kind,
        from_session: Some(from),
        to_session: to,
        from_agent: Some("agent-a".to_owned()),
        to_agent: Some("agent-b".to_owned()),
        export_id,
        label: Some("label".to_owned()),
        reason: Some("why".to_owned()),
        fork_point: Some(3),
        reused: false,
        created_at: t(40),
        peer_gateway: None,
    }
}

fn adopt(from: Uuid, export_id: Option<Uuid>) -> AdoptSession {
    let session = new_session("agent-b");
    let to = session.id;
    AdoptSession {
        session,
        status: SessionStatus::Idle,
        step_count: 1,
        last_task: Some("task".to_owned()),
        model: Some("m-1".to_owned()),
        messages: vec![
            msg("user", "hi"),
            msg("assistant", "hello"),
            msg("system", "imported"),
        ],
        snapshot: Some(RestoredSnapshot {
            snapshot: snap(SnapshotKind::PostAction),
            step_count: 1,
            message_count: 2,
        }),
        memory: Some(("urn:test:memory".to_owned(), json!({"k": [1, 2.5]}))),
        bundle: None,
        export: None,
        consume_export: export_id,
        link: Some(link(LinkKind::Import, from, to, export_id)),
        suspend: None,
        now: t(40),
    }
}

async fn exported(store: &Arc<dyn Store>) -> (Uuid, NewExport) {
    let source = created(store, "agent-a").await.id;
    let b = bundle("a1");
    let e = export(source, &b.cid);
    store
        .create_export(e.clone(), b)
        .await
        .expect("create export");
    (source, e)
}

pub async fn export_and_bundle_round_trip(store: Arc<dyn Store>) {
    let (source, e) = exported(&store).await;
    let got = store.get_export(e.id).await.expect("get").expect("exists");
    assert_eq!(
        (got.session_id, &got.bundle_cid, got.message_count),
        (source, &e.bundle_cid, 3)
    );
    assert_eq!((got.created_at, got.expires_at), (t(30), t(3600)));
    assert_eq!((got.imported_at, got.import_session_id), (None, None));
    assert!(!got.foreign);
    assert_eq!(
        store.get_bundle(&e.bundle_cid).await.expect("bundle"),
        Some(bundle("a1").bytes)
    );
    assert_eq!(store.get_bundle("nope").await.expect("bundle"), None);
    assert_eq!(store.get_export(Uuid::new_v4()).await.expect("get"), None);
    // The same id twice is a conflict; a second export of the same content shares the bundle row.
    let again = store.create_export(e.clone(), bundle("a1")).await;
    assert!(matches!(again, Err(StoreError::Conflict(_))), "{again:?}");
    let second = export(source, &e.bundle_cid);
    store
        .create_export(second.clone(), bundle("a1"))
        .await
        .expect("second export of the same bundle");
    let lineage = store.lineage(source).await.expect("lineage");
    let ids: Vec<Uuid> = lineage.exports.iter().map(|x| x.id).collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&e.id) && ids.contains(&second.id));
}

pub async fn adopt_session_with_history(store: Arc<dyn Store>) {
    let (source, e) = exported(&store).await;
    let a = adopt(source, Some(e.id));
    let new_id = a.session.id;
    let bytes: u64 = a
        .messages
        .iter()
        .map(|m| m.body.as_str().len() as u64)
        .sum();
    let rec = store.adopt_session(a).await.expect("adopt");
    assert_eq!(rec.id, new_id);
    assert_eq!(rec.message_bytes, bytes);
    assert_eq!(
        (rec.status, rec.step_count, rec.message_count),
        (SessionStatus::Idle, 1, 3)
    );
    assert_eq!(rec.last_task.as_deref(), Some("task"));
    assert_eq!(session(&store, new_id).await, rec);
    let history = store.history(new_id).await.expect("history");
    let texts: Vec<_> = history.iter().map(|m| m.body["content"].clone()).collect();
    assert_eq!(texts, vec![json!("hi"), json!("hello"), json!("imported")]);
    assert_eq!(history[1].cost_usd, Some(0.00125));
    let snap = store
        .latest_snapshot(new_id, None)
        .await
        .expect("snapshot")
        .expect("restored");
    assert_eq!(
        (snap.kind, snap.step_count, snap.message_count),
        (SnapshotKind::PostAction, 1, 2)
    );
    let memory = store
        .get_memory(new_id)
        .await
        .expect("memory")
        .expect("restored");
    assert_eq!(
        (memory.schema_id.as_str(), &memory.payload),
        ("urn:test:memory", &json!({"k": [1, 2.5]}))
    );
    let consumed = store.get_export(e.id).await.expect("get").expect("exists");
    assert_eq!(
        (consumed.imported_at, consumed.import_session_id),
        (Some(t(40)), Some(new_id))
    );
    let from = store.lineage(source).await.expect("lineage");
    assert_eq!(from.outgoing.len(), 1);
    assert_eq!(
        (from.outgoing[0].kind, from.outgoing[0].to_session),
        (LinkKind::Import, new_id)
    );
    assert!(from.incoming.is_empty());
    let to = store.lineage(new_id).await.expect("lineage");
    assert_eq!(to.incoming, from.outgoing);
    assert!(to.outgoing.is_empty() && to.exports.is_empty());
}

/// Of 50 concurrent imports of one export exactly one wins; the others write nothing.
pub async fn adopt_consumes_once_concurrently(store: Arc<dyn Store>) {
    let (source, e) = exported(&store).await;
    let mut tasks = JoinSet::new();
    for _ in 0..50 {
        let store = Arc::clone(&store);
        let a = adopt(source, Some(e.id));
        tasks.spawn(async move {
            let id = a.session.id;
            (id, store.adopt_session(a).await.map(|s| s.id))
        });
    }
    let (mut won, mut lost) = (Vec::new(), Vec::new());
    while let Some(done) = tasks.join_next().await {
        match done.expect("task") {
            (id, Ok(_)) => won.push(id),
            (id, Err(StoreError::Consumed)) => lost.push(id),
            (_, Err(other)) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((won.len(), lost.len()), (1, 49));
    for id in lost {
        assert_eq!(store.get_session(id).await.expect("get"), None);
        assert!(store.history(id).await.expect("history").is_empty());
        assert_eq!(store.get_memory(id).await.expect("memory"), None);
    }
    let rec = store.get_export(e.id).await.expect("get").expect("exists");
    assert_eq!(rec.import_session_id, Some(won[0]));
    assert_eq!(
        store.lineage(source).await.expect("lineage").outgoing.len(),
        1
    );
}

/// A failing part (suspending a completed source, consuming an unknown export) undoes everything.
pub async fn adopt_is_all_or_nothing(store: Arc<dyn Store>) {
    let (source, e) = exported(&store).await;
    store
        .update_status(source, SessionStatus::Completed, t(50))
        .await
        .expect("complete");
    let mut a = adopt(source, Some(e.id));
    a.suspend = Some(source);
    let b = bundle("b2");
    a.bundle = Some(b.clone());
    let new_id = a.session.id;
    let r = store.adopt_session(a).await;
    assert!(matches!(r, Err(StoreError::Conflict(_))), "{r:?}");
    assert_eq!(store.get_session(new_id).await.expect("get"), None);
    assert_eq!(store.get_bundle(&b.cid).await.expect("bundle"), None);
    let rec = store.get_export(e.id).await.expect("get").expect("exists");
    assert_eq!(rec.imported_at, None, "the export must not be consumed");
    assert!(
        store
            .lineage(source)
            .await
            .expect("lineage")
            .outgoing
            .is_empty()
    );
    assert_eq!(
        session(&store, source).await.status,
        SessionStatus::Completed
    );

    let unknown = adopt(source, Some(Uuid::new_v4()));
    let id = unknown.session.id;
    assert_eq!(
        store.adopt_session(unknown).await,
        Err(StoreError::NotFound)
    );
    assert_eq!(store.get_session(id).await.expect("get"), None);
}

/// A handoff suspends its running source in the same write; a fork consumes nothing.
pub async fn adopt_suspends_source_and_forks(store: Arc<dyn Store>) {
    let source = created(&store, "agent-a").await.id;
    store
        .update_status(source, SessionStatus::Running, t(5))
        .await
        .expect("running");
    let mut handoff = adopt(source, None);
    handoff.suspend = Some(source);
    handoff.link = Some(link(LinkKind::Handoff, source, handoff.session.id, None));
    let to = store.adopt_session(handoff).await.expect("handoff").id;
    assert_eq!(
        session(&store, source).await.status,
        SessionStatus::Suspended
    );
    let mut fork = adopt(source, None);
    let fork_link = link(LinkKind::Fork, source, fork.session.id, None);
    fork.link = Some(fork_link.clone());
    let forked = store.adopt_session(fork).await.expect("fork").id;
    let lineage = store.lineage(source).await.expect("lineage");
    let kinds: Vec<_> = lineage
        .outgoing
        .iter()
        .map(|l| (l.kind, l.to_session))
        .collect();
    assert!(kinds.contains(&(LinkKind::Handoff, to)));
    assert!(kinds.contains(&(LinkKind::Fork, forked)));
    assert_eq!(
        store.lineage(forked).await.expect("lineage").incoming,
        vec![fork_link]
    );
}

/// A foreign export is recorded by its first import and is single-use from then on.
pub async fn foreign_export_is_recorded_once(store: Arc<dyn Store>) {
    let remote_session = Uuid::new_v4();
    let b = bundle("f3");
    let mut e = export(remote_session, &b.cid);
    e.foreign = true;
    let mut first = adopt(remote_session, Some(e.id));
    first.bundle = Some(b.clone());
    first.export = Some(e.clone());
    let winner = store.adopt_session(first).await.expect("first import").id;
    let rec = store
        .get_export(e.id)
        .await
        .expect("get")
        .expect("recorded");
    assert!(rec.foreign);
    assert_eq!(rec.import_session_id, Some(winner));
    assert_eq!(
        store.get_bundle(&b.cid).await.expect("bundle"),
        Some(b.bytes.clone())
    );
    let mut second = adopt(remote_session, Some(e.id));
    second.bundle = Some(b);
    second.export = Some(e);
    assert_eq!(store.adopt_session(second).await, Err(StoreError::Consumed));
}

pub async fn memory_put_get(store: Arc<dyn Store>) {
    let missing = store
        .put_memory(Uuid::new_v4(), "urn:x".to_owned(), json!({}), t(1))
        .await;
    assert_eq!(missing, Err(StoreError::NotFound));
    let id = created(&store, "agent-a").await.id;
    assert_eq!(store.get_memory(id).await.expect("get"), None);
    let put = store
        .put_memory(id, "urn:x".to_owned(), json!({"a": "東京", "n": 0.1}), t(2))
        .await
        .expect("put");
    assert_eq!(put.payload, json!({"a": "東京", "n": 0.1}));
    let replaced = store
        .put_memory(id, "urn:y".to_owned(), json!({"b": true}), t(3))
        .await
        .expect("replace");
    assert_eq!(
        store.get_memory(id).await.expect("get"),
        Some(replaced.clone())
    );
    assert_eq!(
        (replaced.schema_id.as_str(), replaced.updated_at),
        ("urn:y", t(3))
    );
}

/// A long history (encoded in pieces by backends that do so) is stored complete and in order.
pub async fn adopt_long_history_in_order(store: Arc<dyn Store>) {
    let source = created(&store, "agent-a").await.id;
    let mut a = adopt(source, None);
    a.messages = (0..1500)
        .map(|i| {
            let mut m = msg(if i % 2 == 0 { "user" } else { "assistant" }, "x");
            m.body = json!({"role": m.role, "content": format!("m{i} 東京"), "n": i}).into();
            m
        })
        .collect();
    let id = a.session.id;
    let bytes: u64 = a
        .messages
        .iter()
        .map(|m| m.body.as_str().len() as u64)
        .sum();
    let rec = store.adopt_session(a).await.expect("adopt");
    assert_eq!(rec.message_count, 1500);
    assert_eq!(
        rec.message_bytes, bytes,
        "pieces encoded ahead are counted too"
    );
    let history = store.history(id).await.expect("history");
    assert_eq!(history.len(), 1500);
    for (i, m) in history.iter().enumerate() {
        assert_eq!(m.seq, i as u64);
        assert_eq!(m.body["n"], json!(i), "message {i}");
        assert_eq!(m.body["content"], json!(format!("m{i} 東京")));
    }
}

pub async fn retention_sweeps_what_no_longer_serves(store: Arc<dyn Store>) {
    let source = created(&store, "agent-a").await.id;
    // Expires at t(3600); a live one; a single-use one consumed at t(40) by an import.
    let (expired, live, consumed) = (bundle("r1"), bundle("r2"), bundle("r3"));
    let e1 = export(source, &expired.cid);
    let mut e2 = export(source, &live.cid);
    e2.expires_at = t(100_000);
    let mut e3 = export(source, &consumed.cid);
    e3.expires_at = t(100_000);
    for (e, b) in [(&e1, expired), (&e2, live), (&e3, consumed)] {
        store
            .create_export(e.clone(), b)
            .await
            .expect("create export");
    }
    store
        .adopt_session(adopt(source, Some(e3.id)))
        .await
        .expect("adopt consumes e3");
    // Three snapshots of one session, one of another.
    for kind in [SnapshotKind::PreAction, SnapshotKind::PostAction] {
        let mut f = super::finish(source, None);
        f.count_step = false;
        f.post_action = Some(snap(kind));
        store.finish_turn(f).await.expect("finish");
    }
    let mut f = super::finish(source, None);
    f.post_action = Some(snap(SnapshotKind::Checkpoint));
    store.finish_turn(f).await.expect("finish");
    let other = created(&store, "agent-b").await.id;
    let mut f = super::finish(other, None);
    f.post_action = Some(snap(SnapshotKind::PostAction));
    store.finish_turn(f).await.expect("finish");

    // Nothing is old enough yet.
    let early = sbp_store::Sweep {
        exports_before: Some(t(1)),
        snapshots_before: Some(t(1)),
        expired_before: None,
    };
    assert_eq!(
        store.sweep(early).await.expect("sweep"),
        sbp_store::Swept::default()
    );
    let swept = store
        .sweep(sbp_store::Sweep {
            exports_before: Some(t(50_000)),
            snapshots_before: Some(t(50_000)),
            expired_before: None,
        })
        .await
        .expect("sweep");
    assert_eq!(
        (swept.exports, swept.bundles, swept.snapshots),
        (2, 2, 2),
        "{swept:?}"
    );
    assert!(store.get_export(e1.id).await.expect("get").is_none());
    assert!(store.get_export(e3.id).await.expect("get").is_none());
    assert!(store.get_export(e2.id).await.expect("get").is_some());
    assert!(store.get_bundle(&e2.bundle_cid).await.expect("b").is_some());
    assert!(store.get_bundle(&e1.bundle_cid).await.expect("b").is_none());
    // Each session keeps its latest snapshot.
    let kept = store.list_snapshots(source, 10).await.expect("list");
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].kind, SnapshotKind::Checkpoint);
    assert_eq!(
        store.list_snapshots(other, 10).await.expect("list").len(),
        1
    );
    // A sweep with no cut-offs removes nothing.
    assert_eq!(
        store
            .sweep(sbp_store::Sweep::default())
            .await
            .expect("sweep"),
        sbp_store::Swept::default()
    );
}

/// A sweep after the clock stepped back between snapshots (one written later carries an older
/// time, one far in the future): it removes every snapshot older than its cut-off but each
/// session's latest, in every session, and every snapshot it leaves is still listed, newest
/// written first.
pub async fn sweeping_snapshots_written_while_the_clock_stepped_back(store: Arc<dyn Store>) {
    let a = created(&store, "agent-a").await.id;
    let b = created(&store, "agent-b").await.id;
    let mut written: Vec<(Uuid, Uuid, i64)> = Vec::new();
    let order = [
        (a, 10),
        (a, 100_000),
        (b, 20),
        (a, 1_000_000),
        (b, 21),
        (a, 20),
        (b, 22),
        (a, 30),
        (a, 200_000),
        (b, 23),
        (a, 40),
    ];
    for (session, at) in order {
        let mut f = super::finish(session, None);
        f.count_step = false;
        let mut s = snap(SnapshotKind::Checkpoint);
        s.created_at = t(at);
        written.push((session, s.id, at));
        f.post_action = Some(s);
        store.finish_turn(f).await.expect("finish");
    }
    let swept = store
        .sweep(sbp_store::Sweep {
            exports_before: None,
            snapshots_before: Some(t(50_000)),
            expired_before: None,
        })
        .await
        .expect("sweep");
    for session in [a, b] {
        let mine: Vec<_> = written.iter().filter(|w| w.0 == session).collect();
        let latest = mine.last().expect("written").1;
        let mut left = Vec::new();
        for (_, id, at) in mine.iter().rev() {
            let kept = store.get_snapshot(*id).await.expect("get").is_some();
            assert_eq!(kept, *at >= 50_000 || *id == latest, "snapshot of t({at})");
            if kept {
                left.push(*id);
            }
        }
        let listed: Vec<Uuid> = store
            .list_snapshots(session, 100)
            .await
            .expect("list")
            .iter()
            .map(|s| s.id)
            .collect();
        assert_eq!(
            listed, left,
            "every snapshot left is listed, newest written first"
        );
        let newest = store.latest_snapshot(session, Some(SnapshotKind::Checkpoint));
        assert_eq!(newest.await.expect("latest").map(|s| s.id), Some(latest));
    }
    assert_eq!(swept.snapshots, 6, "{swept:?}");
    assert!(
        store.list_snapshots(a, 0).await.expect("list").is_empty(),
        "a limit of 0 lists nothing"
    );
}
