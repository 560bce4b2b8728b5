//! Encryption at rest, backend-agnostic: a session that puts a marker string in every column that
//! holds content (written through every unit of work), a session moved in from another gateway
//! with the same, and the checks that read all of it back as it was written. The backend tests
//! then look at the raw rows (or files, or streams) for the marker.

use std::sync::Arc;

use sbp_protocol::{SessionStatus, SnapshotKind};
use sbp_store::{
    AdoptMigrated, AdoptSession, FailTurn, FinishTurn, LinkKind, LinkRecord, NewBundle, NewExport,
    NewSession, NewSnapshot, RestoredSnapshot, Store,
};
use serde_json::{Value, json};
use uuid::Uuid;

use super::{begin, idem, msg, new_session, t, tether_entry};

/// What [`write_everything`] wrote, to read back.
pub struct Written {
    pub marker: String,
    pub session: NewSession,
    pub adopted: Uuid,
    pub messages: Vec<Value>,
    pub tether: String,
    pub snapshot: NewSnapshot,
    pub idempotency_key: String,
    pub response: Value,
    pub failed_turn: Uuid,
    pub export: NewExport,
    pub bundle: NewBundle,
    pub link: LinkRecord,
    pub memory: Value,
}

fn marked(marker: &str, what: &str) -> String {
    format!("{what} {marker} héllo")
}

/// Writes a session with `marker` in every content column, through every unit of work: metadata,
/// messages (begin, progress, finish, adopt), the task label, snapshots (state and task), the
/// tether, an idempotency response, a failed turn's error, a bundle, an export label, a lineage
/// link's label and reason, and the memory document.
pub async fn write_everything(store: &Arc<dyn Store>, marker: &str) -> Written {
    let mut session = new_session("agent-sealed");
    session.metadata = json!({ "note": marked(marker, "metadata") });
    let id = session.id;
    let prompt = msg("user", &marked(marker, "prompt"));
    let mut snapshot = super::snap(SnapshotKind::PreAction);
    snapshot.current_task = Some(marked(marker, "task"));
    snapshot.state = json!({ "pending": marked(marker, "state") });
    let mut b = begin(id, vec![prompt.clone()]);
    b.create = Some(session.clone());
    b.last_task = Some(marked(marker, "last task"));
    b.pre_action = Some(snapshot.clone());
    let key = format!("key-{}", Uuid::new_v4().simple());
    b.idempotency = Some(idem(&key, true));
    b.status = Some(SessionStatus::Running);
    let turn = b.turn_id;
    store.begin_turn(b).await.expect("begin");
    store.mark_attached(id, t(11)).await.expect("tether on");
    let tool_round = msg("tool", &marked(marker, "tool result"));
    store
        .record_progress(sbp_store::TurnProgress {
            session_id: id,
            turn_id: turn,
            messages: vec![tool_round.clone()],
            snapshots: Vec::new(),
            now: t(12),
        })
        .await
        .expect("progress");
    let reply = msg("assistant", &marked(marker, "reply"));
    let tether = marked(marker, "tethered reply");
    let response = json!({ "choices": [{ "message": { "content": marked(marker, "response") } }] });
    let mut entry = tether_entry(&tether);
    entry.content = Some(tether.clone());
    store
        .finish_turn(FinishTurn {
            session_id: id,
            turn_id: Some(turn),
            messages: vec![reply.clone()],
            count_step: true,
            post_action: None,
            checkpoint: None,
            tether: Some(entry),
            tether_only_if_enabled: true,
            idempotency_done: Some((key.clone(), 200, response.clone())),
            idempotency_claim: None,
            now: t(20),
        })
        .await
        .expect("finish");

    let failing = begin(id, Vec::new());
    let failed_turn = failing.turn_id;
    store.begin_turn(failing).await.expect("second turn");
    store
        .fail_turn(FailTurn {
            session_id: id,
            turn_id: failed_turn,
            error: marked(marker, "upstream said"),
            idempotency_key: None,
            now: t(21),
        })
        .await
        .expect("fail");

    let memory = json!({ "facts": [marked(marker, "memory")] });
    store
        .put_memory(id, "sbp.memory.v1".to_owned(), memory.clone(), t(22))
        .await
        .expect("memory");

    let bundle = NewBundle {
        cid: format!("{:0>64}", Uuid::new_v4().simple()),
        bytes: format!("{{\"bundle\": \"{}\"}}", marked(marker, "bundle")).into_bytes(),
    };
    let export = NewExport {
        id: Uuid::new_v4(),
        session_id: id,
        bundle_cid: bundle.cid.clone(),
        label: Some(marked(marker, "export label")),
        message_count: 3,
        created_at: t(30),
        expires_at: t(3600),
        foreign: false,
    };
    store
        .create_export(export.clone(), bundle.clone())
        .await
        .expect("export");

    let fork = new_session("agent-sealed");
    let adopted = fork.id;
    let link = LinkRecord {
        id: Uuid::new_v4(),
        kind: LinkKind::Fork,
        from_session: Some(id),
        to_session: adopted,
        from_agent: None,
        to_agent: None,
        export_id: None,
        label: Some(marked(marker, "link label")),
        reason: Some(marked(marker, "link reason")),
        fork_point: Some(3),
        reused: false,
        created_at: t(40),
        peer_gateway: None,
    };
    let mut restored = super::snap(SnapshotKind::Checkpoint);
    restored.current_task = Some(marked(marker, "restored task"));
    store
        .adopt_session(AdoptSession {
            session: fork,
            status: SessionStatus::Idle,
            step_count: 1,
            last_task: Some(marked(marker, "fork task")),
            model: None,
            messages: vec![prompt.clone(), tool_round.clone(), reply.clone()],
            snapshot: Some(RestoredSnapshot {
                snapshot: restored,
                step_count: 1,
                message_count: 3,
            }),
            memory: Some(("sbp.memory.v1".to_owned(), memory.clone())),
            bundle: None,
            export: None,
            consume_export: None,
            link: Some(link.clone()),
            suspend: None,
            now: t(41),
        })
        .await
        .expect("fork");

    Written {
        marker: marker.to_owned(),
        session,
        adopted,
        messages: vec![
            prompt.body.to_value(),
            tool_round.body.to_value(),
            reply.body.to_value(),
        ],
        tether,
        snapshot,
        idempotency_key: key,
        response,
        failed_turn,
        export,
        bundle,
        link,
        memory,
    }
}

/// Everything [`write_everything`] wrote reads back as it was written. `tether`: whether the
/// tether entry is still there to read (a drain removes it).
pub async fn reads_everything(store: &Arc<dyn Store>, w: &Written, tether: bool) {
    let id = w.session.id;
    let s = store.get_session(id).await.expect("session").expect("kept");
    assert_eq!(s.metadata, w.session.metadata);
    assert_eq!(
        s.last_task.as_deref(),
        Some(marked(&w.marker, "last task").as_str())
    );
    let found = store
        .find_session_by_token(&w.session.token_hash)
        .await
        .expect("by token")
        .expect("found");
    assert_eq!(found.metadata, w.session.metadata);
    let expected = s.message_bytes;
    let plain: u64 = w
        .messages
        .iter()
        .map(|b| serde_json::to_string(b).expect("json").len() as u64)
        .sum();
    assert_eq!(expected, plain, "message_bytes counts the plaintext");
    let history: Vec<Value> = store
        .history(id)
        .await
        .expect("history")
        .into_iter()
        .map(|m| m.body)
        .collect();
    assert_eq!(history, w.messages);
    let page = store.list_messages(id, Some(0), 1).await.expect("page");
    assert_eq!(page[0].body, w.messages[1]);
    let snap = store
        .get_snapshot(w.snapshot.id)
        .await
        .expect("snapshot")
        .expect("kept");
    assert_eq!(snap.current_task, w.snapshot.current_task);
    assert_eq!(snap.state, w.snapshot.state);
    let listed = store.list_snapshots(id, 10).await.expect("snapshots");
    assert!(listed.iter().any(|s| s.state == w.snapshot.state));
    if tether {
        let pending = store.tether_pending(id, None, 10).await.expect("tether");
        assert_eq!(pending.len(), 1);
        assert_eq!(pending[0].content.as_deref(), Some(w.tether.as_str()));
    }
    let idem = store
        .get_idempotency(&w.idempotency_key)
        .await
        .expect("idempotency")
        .expect("kept");
    assert_eq!(idem.response_body.as_ref(), Some(&w.response));
    let failed = store
        .get_turn(w.failed_turn)
        .await
        .expect("turn")
        .expect("kept");
    assert_eq!(
        failed.error.as_deref(),
        Some(marked(&w.marker, "upstream said").as_str())
    );
    let memory = store.get_memory(id).await.expect("memory").expect("kept");
    assert_eq!(memory.payload, w.memory);
    let export = store
        .get_export(w.export.id)
        .await
        .expect("export")
        .expect("kept");
    assert_eq!(export.label, w.export.label);
    let bundle = store
        .get_bundle(&w.bundle.cid)
        .await
        .expect("bundle")
        .expect("kept");
    assert_eq!(bundle, w.bundle.bytes, "the bundle's bytes exactly");
    let lineage = store.lineage(id).await.expect("lineage");
    assert_eq!(lineage.exports[0].label, w.export.label);
    assert_eq!(lineage.outgoing, vec![w.link.clone()]);
    let fork = store
        .get_session(w.adopted)
        .await
        .expect("fork")
        .expect("kept");
    assert_eq!(
        fork.last_task.as_deref(),
        Some(marked(&w.marker, "fork task").as_str())
    );
    let fork_history: Vec<Value> = store
        .history(w.adopted)
        .await
        .expect("fork history")
        .into_iter()
        .map(|m| m.body)
        .collect();
    assert_eq!(fork_history, w.messages);
    assert_eq!(fork.message_bytes, plain);
    let restored = store
        .latest_snapshot(w.adopted, None)
        .await
        .expect("restored")
        .expect("kept");
    assert_eq!(
        restored.current_task.as_deref(),
        Some(marked(&w.marker, "restored task").as_str())
    );
}

/// What [`write_migrated`] wrote, to read back.
pub struct Migrated {
    pub session: NewSession,
    pub messages: Vec<Value>,
    pub tether: String,
}

/// Adopts a session moving in from another gateway with `marker` in its metadata, task,
/// messages, snapshot, memory and carried tether entry (L6).
pub async fn write_migrated(store: &Arc<dyn Store>, marker: &str) -> Migrated {
    let mut session = new_session("agent-moved");
    session.metadata = json!({ "note": marked(marker, "moved metadata") });
    let messages = vec![
        msg("user", &marked(marker, "moved prompt")),
        msg("assistant", &marked(marker, "moved reply")),
    ];
    let tether = marked(marker, "moved tether");
    let mut snapshot = super::snap(SnapshotKind::Checkpoint);
    snapshot.current_task = Some(marked(marker, "moved snapshot task"));
    store
        .adopt_migrated(AdoptMigrated {
            adopt: AdoptSession {
                session: session.clone(),
                status: SessionStatus::Suspended,
                step_count: 1,
                last_task: Some(marked(marker, "moved task")),
                model: None,
                messages: messages.clone(),
                snapshot: Some(RestoredSnapshot {
                    snapshot,
                    step_count: 1,
                    message_count: 2,
                }),
                memory: Some((
                    "sbp.memory.v1".to_owned(),
                    json!({ "facts": [marked(marker, "moved memory")] }),
                )),
                bundle: None,
                export: None,
                consume_export: None,
                link: None,
                suspend: None,
                now: t(50),
            },
            tether: vec![(7, tether_entry(&tether))],
            tether_next_seq: 8,
            epoch: 1,
            from_gateway: "gw-a".to_owned(),
            from_url: "https://a.example".to_owned(),
            migration_id: Uuid::now_v7(),
        })
        .await
        .expect("adopt migrated");
    Migrated {
        session,
        messages: messages.into_iter().map(|m| m.body.to_value()).collect(),
        tether,
    }
}

/// Everything [`write_migrated`] wrote reads back as it was written.
pub async fn reads_migrated(store: &Arc<dyn Store>, m: &Migrated) {
    let id = m.session.id;
    let s = store.get_session(id).await.expect("session").expect("kept");
    assert_eq!(s.metadata, m.session.metadata);
    let history: Vec<Value> = store
        .history(id)
        .await
        .expect("history")
        .into_iter()
        .map(|x| x.body)
        .collect();
    assert_eq!(history, m.messages);
    let pending = store.tether_pending(id, None, 10).await.expect("tether");
    assert_eq!(pending.len(), 1);
    assert_eq!(
        (pending[0].seq, pending[0].content.as_deref()),
        (7, Some(m.tether.as_str()))
    );
}
