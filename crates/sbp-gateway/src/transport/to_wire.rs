//! Engine and store results as the REST bodies of `sbp_protocol::rest`: the one place each response
//! body is built (every value under each of its names, through the types' `with_aliases`).

use chrono::{DateTime, Utc};
use sbp_protocol::SessionStatus;
use sbp_protocol::rest::{
    Delivery, Export, ExportImport, ExportInfo, ExportList, ForkInfo, ForkLink, ForkOrigin,
    HANDOFF_COMPLETED, HandoffInfo, Health, ImportInfo, ImportLink, ImportedFrom, IncomingHandoff,
    Lineage, Memory, MessagePage, OutgoingHandoff, Provenance, PushedTurn, SessionCreated,
    SessionDeleted, SessionInfo, SessionList, SessionSummary, Snapshot, SnapshotInfo, SnapshotList,
    StatusChanged, StoredMessage, TetherLoaded, ToolCallOutcome, ToolCallStatus,
};
use sbp_store::{
    ExportRecord, LinkKind, LinkRecord, MemoryRecord, MessageRecord, SessionRecord, SnapshotRecord,
};
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::engine::roaming::{Exported, Forked, HandedOff, Imported, TokenInfo};
use crate::engine::sessions::{SessionPage, SessionView};
use crate::engine::tools::BackendCallOutcome;
use sbp_protocol::time::{iso, unix_iso};

fn id(u: Uuid) -> String {
    u.to_string()
}

fn opt_id(u: Option<Uuid>) -> Option<String> {
    u.map(id)
}

pub fn health() -> Health {
    Health {
        status: "ok".into(),
        extra: Map::new(),
    }
}

pub fn session_created(s: &SessionRecord, session_token: &str) -> SessionCreated {
    SessionCreated {
        session_id: id(s.id),
        session_token: session_token.to_owned(),
        agent_id: Some(s.agent_id.clone()),
        status: Some(s.status),
        step_count: s.step_count,
        created_at: Some(iso(&s.created_at)),
        metadata: s.metadata.clone(),
        extra: Map::new(),
    }
}

pub fn session_info(v: SessionView) -> SessionInfo {
    let s = v.session;
    SessionInfo {
        session_id: id(s.id),
        agent_id: Some(s.agent_id),
        status: s.status,
        step_count: s.step_count,
        message_count: s.message_count,
        created_at: Some(iso(&s.created_at)),
        updated_at: Some(iso(&s.updated_at)),
        last_task: s.last_task,
        model: s.model,
        surface_attached: v.surface.is_some(),
        surface: v.surface,
        tether_enabled: s.tether_enabled,
        tether_turns_pending: v.tether_pending,
        queued_turns: None,
        latest_snapshot_id: v.latest_snapshot.as_ref().map(|snap| id(snap.id)),
        last_checkpoint: v.latest_snapshot.as_ref().map(|snap| iso(&snap.created_at)),
        extra: Map::new(),
    }
    .with_aliases()
}

/// A page of `GET /v1/sessions`: each session's record without its content.
pub fn session_list(page: SessionPage) -> SessionList {
    let data = page
        .sessions
        .into_iter()
        .map(|s| SessionSummary {
            session_id: id(s.id),
            agent_id: Some(s.agent_id),
            status: s.status,
            step_count: s.step_count,
            message_count: s.message_count,
            created_at: Some(iso(&s.created_at)),
            updated_at: Some(iso(&s.updated_at)),
            model: s.model,
            tether_enabled: s.tether_enabled,
            extra: Map::new(),
        })
        .collect();
    SessionList {
        object: "list".into(),
        data,
        has_more: page.next_cursor.is_some(),
        next_cursor: page.next_cursor,
        extra: Map::new(),
    }
}

pub fn session_deleted(session: Uuid) -> SessionDeleted {
    SessionDeleted {
        session_id: id(session),
        deleted: true,
        extra: Map::new(),
    }
}

/// One page of the transcript; `next` is the seq to continue after, when there may be more.
pub fn message_page(
    session: &SessionRecord,
    messages: Vec<MessageRecord>,
    next: Option<u64>,
) -> MessagePage {
    MessagePage {
        session_id: Some(id(session.id)),
        messages: messages.into_iter().map(stored_message).collect(),
        message_count: session.message_count,
        has_more: next.is_some(),
        next_after: next,
        extra: Map::new(),
    }
}

/// A transcript message: its stored chat message object with the gateway's fields, which replace
/// any of the same name in the object.
fn stored_message(m: MessageRecord) -> StoredMessage {
    // Every stored body is an object with a string `role` (the completion endpoint, bundles, pushed
    // turns and bridge messages all check or write one); the record's role is the same string.
    let mut body = match m.body {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    let role = match body.remove("role") {
        Some(Value::String(r)) => r,
        _ => m.role,
    };
    for key in ["seq", "model_used", "cost_usd", "created_at"] {
        body.remove(key);
    }
    StoredMessage {
        role,
        content: body.remove("content"),
        seq: Some(m.seq),
        model_used: m.model_used,
        cost_usd: m.cost_usd,
        created_at: Some(iso(&m.created_at)),
        extra: body,
    }
}

pub fn status_changed(updated: &SessionRecord, previous: SessionStatus) -> StatusChanged {
    StatusChanged {
        session_id: id(updated.id),
        status: updated.status,
        previous_status: Some(previous),
        step_count: updated.step_count,
        updated_at: Some(iso(&updated.updated_at)),
        extra: Map::new(),
    }
}

pub fn snapshot_list(session_id: Uuid, snaps: &[SnapshotRecord]) -> SnapshotList {
    SnapshotList {
        session_id: id(session_id),
        snapshots: snaps.iter().map(snapshot_info).collect(),
        extra: Map::new(),
    }
}

fn snapshot_info(s: &SnapshotRecord) -> SnapshotInfo {
    SnapshotInfo {
        snapshot_id: id(s.id),
        kind: Some(s.kind.as_str().to_owned()),
        step_count: s.step_count,
        message_count: s.message_count,
        created_at: Some(iso(&s.created_at)),
        current_task: s.current_task.clone(),
        model: s.model.clone(),
        state: s.state.clone(),
        extra: Map::new(),
    }
}

/// `GET .../snapshots/latest`: the snapshot with its messages (the transcript's first
/// `message_count`).
pub fn snapshot(s: &SnapshotRecord, messages: Vec<MessageRecord>) -> Snapshot {
    Snapshot {
        session_id: id(s.session_id),
        snapshot: snapshot_info(s),
        messages: messages.into_iter().map(|m| m.body).collect(),
    }
}

/// A backend's tool call: the surface's result, or how the call ended without one.
pub fn tool_call(out: BackendCallOutcome) -> ToolCallOutcome {
    let status = ToolCallStatus::of(&out.call.outcome);
    let (result, error) = match out.call.outcome {
        Ok(v) => (v, None),
        Err(e) => (Value::Null, Some(e.to_string())),
    };
    ToolCallOutcome {
        session_id: Some(id(out.session_id)),
        call_id: id(out.call.call_id),
        tool_name: out.tool_name,
        status,
        result,
        error,
        duration_ms: out.call.elapsed.as_secs_f64() * 1000.0,
        extra: Map::new(),
    }
}

pub fn pushed_turn(session_id: Uuid, seq: u64, attached: bool) -> PushedTurn {
    PushedTurn {
        session_id: id(session_id),
        seq,
        delivery: if attached {
            Delivery::Live
        } else {
            Delivery::Tethered
        },
        extra: Map::new(),
    }
}

pub fn tether_loaded(session_id: Uuid, seqs: Vec<u64>) -> TetherLoaded {
    TetherLoaded {
        session_id: id(session_id),
        enqueued: seqs.len() as u64,
        seqs,
        extra: Map::new(),
    }
}

pub fn export(out: Exported) -> Export {
    let e = out.export;
    Export {
        export_id: id(e.id),
        roaming_token: out.roaming_token,
        token: None,
        bundle_cid: e.bundle_cid,
        bundle_hash: None,
        expires_at: Some(iso(&e.expires_at)),
        created_at: Some(iso(&e.created_at)),
        message_count: Some(e.message_count),
        label: e.label,
        session_id: Some(id(e.session_id)),
        bundle: out.bundle,
        extra: Map::new(),
    }
    .with_aliases()
}

pub fn import(out: &Imported) -> ImportInfo {
    let s = &out.session;
    let export_id = opt_id(out.export_id);
    ImportInfo {
        session_id: id(s.id),
        new_session_id: None,
        session_token: out.session_token.clone(),
        agent_id: Some(s.agent_id.clone()),
        status: Some(s.status),
        step_count: s.step_count,
        message_count: s.message_count,
        messages_restored: out.messages_restored,
        memory_restored: out.memory_restored,
        memory_skipped_reason: out.memory_skipped.clone(),
        snapshot_restored: out.snapshot_restored,
        export_id: export_id.clone(),
        origin_export_id: None,
        source_session_id: out.source_session_id.clone(),
        bundle_cid: Some(out.bundle_cid.clone()),
        forked: out.allow_reuse,
        provenance: Some(Provenance {
            imported_from: out.source_session_id.clone(),
            export_id,
            bundle_cid: Some(out.bundle_cid.clone()),
            via: Some(
                if out.via_token {
                    "roaming_token"
                } else {
                    "bundle"
                }
                .to_owned(),
            ),
            allow_reuse: out.allow_reuse,
            imported_at: Some(iso(&s.created_at)),
            extra: Map::new(),
        }),
        extra: Map::new(),
    }
    .with_aliases()
}

/// An export as the token inspection and the export list show it (`expired` as of `now`).
pub fn export_info(e: &ExportRecord, now: DateTime<Utc>) -> ExportInfo {
    ExportInfo {
        export_id: id(e.id),
        session_id: id(e.session_id),
        label: e.label.clone(),
        bundle_cid: Some(e.bundle_cid.clone()),
        bundle_hash: None,
        message_count: Some(e.message_count),
        created_at: Some(iso(&e.created_at)),
        expires_at: Some(iso(&e.expires_at)),
        expired: now >= e.expires_at,
        consumed: e.imported_at.is_some(),
        imported_at: e.imported_at.as_ref().map(iso),
        import_session_id: opt_id(e.import_session_id),
        foreign: e.foreign,
        issued_at: None,
        imports: None,
        extra: Map::new(),
    }
    .with_aliases()
}

/// `GET /v1/sbp/token/{token}`: the export, with the token's `iat`.
pub fn token_info(info: &TokenInfo) -> ExportInfo {
    ExportInfo {
        issued_at: Some(unix_iso(info.claims.iat)),
        ..export_info(&info.export, Utc::now())
    }
}

pub fn handoff(out: &HandedOff) -> HandoffInfo {
    let s = &out.session;
    HandoffInfo {
        handoff_id: Some(id(out.handoff_id)),
        session_id: id(s.id),
        new_session_id: None,
        session_token: out.session_token.clone(),
        new_session_token: None,
        source_session_id: Some(id(out.source.id)),
        from_session_id: None,
        source_status: Some(out.source.status),
        from_agent_id: Some(out.source.agent_id.clone()),
        to_agent_id: Some(s.agent_id.clone()),
        agent_id: None,
        export_id: Some(id(out.export.id)),
        bundle_cid: Some(out.export.bundle_cid.clone()),
        bundle_hash: None,
        step_count: Some(s.step_count),
        message_count: Some(s.message_count),
        status: Some(HANDOFF_COMPLETED.to_owned()),
        extra: Map::new(),
    }
    .with_aliases()
}

pub fn fork(out: &Forked) -> ForkInfo {
    let s = &out.session;
    ForkInfo {
        fork_id: id(out.fork_id),
        session_id: id(s.id),
        fork_session_id: None,
        new_session_id: None,
        session_token: out.session_token.clone(),
        fork_session_token: None,
        label: out.label.clone(),
        fork_label: None,
        origin_session_id: Some(id(out.origin.id)),
        agent_id: Some(s.agent_id.clone()),
        fork_point_step: Some(out.fork_point_step),
        fork_point_msg: Some(out.fork_point_msg),
        step_count: Some(s.step_count),
        message_count: Some(s.message_count),
        extra: Map::new(),
    }
    .with_aliases()
}

pub fn export_list(session_id: Uuid, view: &sbp_store::Lineage) -> ExportList {
    ExportList {
        session_id: id(session_id),
        exports: listed_exports(view),
        extra: Map::new(),
    }
}

/// The session's exports with the import links of each, as the export list and the lineage show them.
fn listed_exports(view: &sbp_store::Lineage) -> Vec<ExportInfo> {
    let now = Utc::now();
    view.exports
        .iter()
        .map(|e| ExportInfo {
            imports: Some(imports_of(e, &view.outgoing)),
            ..export_info(e, now)
        })
        .collect()
}

/// The import links of one export.
fn imports_of(export: &ExportRecord, outgoing: &[LinkRecord]) -> Vec<ExportImport> {
    outgoing
        .iter()
        .filter(|l| l.kind == LinkKind::Import && l.export_id == Some(export.id))
        .map(|l| ExportImport {
            session_id: Some(id(l.to_session)),
            imported_at: Some(iso(&l.created_at)),
            allow_reuse: l.reused,
            agent_id: l.to_agent.clone(),
            extra: Map::new(),
        })
        .collect()
}

/// Forks made by the fork endpoint, and imports with allow_reuse (SPEC 8.4: they are forks).
fn is_fork(l: &&LinkRecord) -> bool {
    l.kind == LinkKind::Fork || (l.kind == LinkKind::Import && l.reused)
}

pub fn lineage(session_id: Uuid, view: &sbp_store::Lineage) -> Lineage {
    let out = |kind: LinkKind| view.outgoing.iter().filter(move |l| l.kind == kind);
    let inc = |kind: LinkKind| view.incoming.iter().filter(move |l| l.kind == kind);
    let completed = || Some(HANDOFF_COMPLETED.to_owned());
    Lineage {
        session_id: id(session_id),
        exports: listed_exports(view),
        outgoing_handoffs: out(LinkKind::Handoff)
            .map(|l| {
                OutgoingHandoff {
                    handoff_id: Some(id(l.id)),
                    to_session_id: Some(id(l.to_session)),
                    to_agent_id: l.to_agent.clone(),
                    to_agent: None,
                    from_agent: l.from_agent.clone(),
                    reason: l.reason.clone(),
                    export_id: opt_id(l.export_id),
                    status: completed(),
                    created_at: Some(iso(&l.created_at)),
                    extra: Map::new(),
                }
                .with_aliases()
            })
            .collect(),
        incoming_handoffs: inc(LinkKind::Handoff)
            .map(|l| {
                IncomingHandoff {
                    handoff_id: Some(id(l.id)),
                    from_session_id: opt_id(l.from_session),
                    from_agent_id: l.from_agent.clone(),
                    from_agent: None,
                    to_agent: l.to_agent.clone(),
                    reason: l.reason.clone(),
                    export_id: opt_id(l.export_id),
                    status: completed(),
                    created_at: Some(iso(&l.created_at)),
                    extra: Map::new(),
                }
                .with_aliases()
            })
            .collect(),
        forks: view
            .outgoing
            .iter()
            .filter(is_fork)
            .map(|l| ForkLink {
                fork_id: Some(id(l.id)),
                fork_session_id: id(l.to_session),
                fork_label: l.label.clone(),
                fork_point_msg: l.fork_point,
                via: Some(l.kind.as_str().to_owned()),
                export_id: opt_id(l.export_id),
                created_at: Some(iso(&l.created_at)),
                extra: Map::new(),
            })
            .collect(),
        origin: view.incoming.iter().find(is_fork).map(|l| ForkOrigin {
            origin_session_id: opt_id(l.from_session),
            fork_label: l.label.clone(),
            fork_point_msg: l.fork_point,
            forked_at: Some(iso(&l.created_at)),
            via: Some(l.kind.as_str().to_owned()),
            export_id: opt_id(l.export_id),
            extra: Map::new(),
        }),
        imported_from: view
            .incoming
            .iter()
            .find(|l| l.kind == LinkKind::Import && !l.reused)
            .map(|l| ImportedFrom {
                source_session_id: opt_id(l.from_session),
                export_id: opt_id(l.export_id),
                from_agent: l.from_agent.clone(),
                imported_at: Some(iso(&l.created_at)),
                extra: Map::new(),
            }),
        imports: out(LinkKind::Import)
            .filter(|l| !l.reused)
            .map(|l| ImportLink {
                import_session_id: Some(id(l.to_session)),
                export_id: opt_id(l.export_id),
                imported_at: Some(iso(&l.created_at)),
                extra: Map::new(),
            })
            .collect(),
        extra: migrations(view),
    }
}

/// Federation: the gateways this session moved to and from (`migrated_to` / `migrated_from`).
fn migrations(view: &sbp_store::Lineage) -> Map<String, Value> {
    let moves: Vec<Value> = view
        .outgoing
        .iter()
        .filter(|l| matches!(l.kind, LinkKind::MigratedTo | LinkKind::MigratedFrom))
        .map(|l| {
            serde_json::json!({
                "kind": l.kind.as_str(),
                "gateway_id": l.peer_gateway,
                "at": iso(&l.created_at),
            })
        })
        .collect();
    let mut extra = Map::new();
    if !moves.is_empty() {
        extra.insert("migrations".into(), Value::Array(moves));
    }
    extra
}

pub fn memory(session_id: Uuid, m: MemoryRecord) -> Memory {
    Memory {
        session_id: id(session_id),
        schema_id: Some(m.schema_id),
        payload: m.payload,
        updated_at: Some(iso(&m.updated_at)),
        extra: Map::new(),
    }
}
