//! HTTP handlers of L3 roaming. Responses carry the names of SPEC 8, the HTTP API docs and the
//! reference server at once (e.g. `session_id` and `new_session_id`), so every client finds its own.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use sbp_store::{ExportRecord, Lineage, LinkKind, LinkRecord};
use serde_json::{Value, json};

use super::errors::add_headers;
use super::extract::JsonObject;
use super::requests::optional_label;
use crate::Gateway;
use crate::engine::iso;
use crate::engine::roaming::{ExportRequest, HandoffRequest, ImportRequest, unix_iso};
use crate::engine::sessions::Caller;
use crate::error::Error;

type ApiResult = Result<Response, Error>;

fn created(body: Value, session_id: &str, token: &str, agent_id: &str) -> Response {
    let mut resp = (StatusCode::CREATED, Json(body)).into_response();
    add_headers(
        resp.headers_mut(),
        &[
            ("x-session-token", token.to_owned()),
            ("x-session-id", session_id.to_owned()),
            ("x-agent-id", agent_id.to_owned()),
        ],
    );
    resp
}

fn export_json(e: &ExportRecord, now: chrono::DateTime<chrono::Utc>) -> Value {
    json!({
        "export_id": e.id,
        "session_id": e.session_id,
        "label": e.label,
        "bundle_cid": e.bundle_cid,
        "bundle_hash": e.bundle_cid,
        "message_count": e.message_count,
        "created_at": iso(&e.created_at),
        "expires_at": iso(&e.expires_at),
        "expired": now >= e.expires_at,
        "consumed": e.imported_at.is_some(),
        "imported_at": e.imported_at.as_ref().map(iso),
        "import_session_id": e.import_session_id,
        "foreign": e.foreign,
    })
}

pub async fn export(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let req = ExportRequest::from_body(&body)?;
    let out = gw.roaming().export(&session, req).await?;
    let e = &out.export;
    let mut body = json!({
        "export_id": e.id,
        "roaming_token": out.roaming_token,
        "token": out.roaming_token,
        "bundle_cid": e.bundle_cid,
        "bundle_hash": e.bundle_cid,
        "expires_at": iso(&e.expires_at),
        "created_at": iso(&e.created_at),
        "message_count": e.message_count,
        "label": e.label,
        "session_id": e.session_id,
    });
    if let Some(bundle) = out.bundle {
        body["bundle"] = bundle;
    }
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

pub async fn import(State(gw): State<Gateway>, JsonObject(body): JsonObject) -> ApiResult {
    let req = ImportRequest::from_body(body)?;
    let out = gw.roaming().import(req).await?;
    let s = &out.session;
    let body = json!({
        "session_id": s.id,
        "new_session_id": s.id,
        "session_token": out.session_token,
        "agent_id": s.agent_id,
        "status": s.status,
        "step_count": s.step_count,
        "message_count": s.message_count,
        "messages_restored": out.messages_restored,
        "memory_restored": out.memory_restored,
        "memory_skipped_reason": out.memory_skipped,
        "snapshot_restored": out.snapshot_restored,
        "origin_export_id": out.export_id,
        "export_id": out.export_id,
        "source_session_id": out.source_session_id,
        "bundle_cid": out.bundle_cid,
        "forked": out.allow_reuse,
        "provenance": {
            "imported_from": out.source_session_id,
            "export_id": out.export_id,
            "bundle_cid": out.bundle_cid,
            "via": if out.via_token { "roaming_token" } else { "bundle" },
            "allow_reuse": out.allow_reuse,
            "imported_at": iso(&s.created_at),
        },
    });
    Ok(created(
        body,
        &s.id.to_string(),
        &out.session_token,
        &s.agent_id,
    ))
}

pub async fn inspect_token(State(gw): State<Gateway>, Path(token): Path<String>) -> ApiResult {
    let info = gw.roaming().inspect_token(&token).await?;
    // `expired` comes with the export (its expiry is the token's `exp`).
    let mut body = export_json(&info.export, chrono::Utc::now());
    body["issued_at"] = json!(unix_iso(info.claims.iat));
    Ok(Json(body).into_response())
}

pub async fn handoff(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let source = gw.sessions().authorized(&id, &caller).await?;
    let req = HandoffRequest::from_body(&body)?;
    let out = gw.roaming().handoff(&source, req).await?;
    let s = &out.session;
    let body = json!({
        "handoff_id": out.handoff_id,
        "source_session_id": out.source.id,
        "from_session_id": out.source.id,
        "source_status": out.source.status,
        "from_agent_id": out.source.agent_id,
        "new_session_id": s.id,
        "session_id": s.id,
        "new_session_token": out.session_token,
        "session_token": out.session_token,
        "to_agent_id": s.agent_id,
        "agent_id": s.agent_id,
        "export_id": out.export.id,
        "bundle_cid": out.export.bundle_cid,
        "bundle_hash": out.export.bundle_cid,
        "step_count": s.step_count,
        "message_count": s.message_count,
        "status": "completed",
    });
    Ok(created(
        body,
        &s.id.to_string(),
        &out.session_token,
        &s.agent_id,
    ))
}

pub async fn fork(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let origin = gw.sessions().authorized(&id, &caller).await?;
    let label = optional_label(&body)?;
    let out = gw.roaming().fork(&origin, label).await?;
    let s = &out.session;
    let body = json!({
        "fork_id": out.fork_id,
        "fork_session_id": s.id,
        "new_session_id": s.id,
        "session_id": s.id,
        "fork_session_token": out.session_token,
        "session_token": out.session_token,
        "fork_label": out.label,
        "label": out.label,
        "origin_session_id": out.origin.id,
        "agent_id": s.agent_id,
        "fork_point_step": out.fork_point_step,
        "fork_point_msg": out.fork_point_msg,
        "step_count": s.step_count,
        "message_count": s.message_count,
    });
    Ok(created(
        body,
        &s.id.to_string(),
        &out.session_token,
        &s.agent_id,
    ))
}

/// The import links of one export, as the export list shows them.
fn imports_of(export: &ExportRecord, outgoing: &[LinkRecord]) -> Vec<Value> {
    outgoing
        .iter()
        .filter(|l| l.kind == LinkKind::Import && l.export_id == Some(export.id))
        .map(|l| {
            json!({
                "session_id": l.to_session,
                "imported_at": iso(&l.created_at),
                "allow_reuse": l.reused,
                "agent_id": l.to_agent,
            })
        })
        .collect()
}

fn exports_json(view: &Lineage) -> Vec<Value> {
    let now = chrono::Utc::now();
    view.exports
        .iter()
        .map(|e| {
            let mut v = export_json(e, now);
            v["imports"] = Value::Array(imports_of(e, &view.outgoing));
            v
        })
        .collect()
}

pub async fn exports(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let view = gw.roaming().lineage(&session).await?;
    Ok(Json(json!({
        "session_id": session.id,
        "exports": exports_json(&view),
    }))
    .into_response())
}

pub async fn lineage(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let view = gw.roaming().lineage(&session).await?;
    let out = |kind: LinkKind| view.outgoing.iter().filter(move |l| l.kind == kind);
    let inc = |kind: LinkKind| view.incoming.iter().filter(move |l| l.kind == kind);
    let outgoing_handoffs: Vec<Value> = out(LinkKind::Handoff)
        .map(|l| {
            json!({
                "handoff_id": l.id,
                "to_session_id": l.to_session,
                "to_agent": l.to_agent,
                "to_agent_id": l.to_agent,
                "from_agent": l.from_agent,
                "reason": l.reason,
                "export_id": l.export_id,
                "status": "completed",
                "created_at": iso(&l.created_at),
            })
        })
        .collect();
    let incoming_handoffs: Vec<Value> = inc(LinkKind::Handoff)
        .map(|l| {
            json!({
                "handoff_id": l.id,
                "from_session_id": l.from_session,
                "from_agent": l.from_agent,
                "from_agent_id": l.from_agent,
                "to_agent": l.to_agent,
                "reason": l.reason,
                "export_id": l.export_id,
                "status": "completed",
                "created_at": iso(&l.created_at),
            })
        })
        .collect();
    // Forks made by the fork endpoint, and imports with allow_reuse (SPEC 8.4: they are forks).
    let is_fork =
        |l: &&LinkRecord| l.kind == LinkKind::Fork || (l.kind == LinkKind::Import && l.reused);
    let forks: Vec<Value> = view
        .outgoing
        .iter()
        .filter(is_fork)
        .map(|l| {
            json!({
                "fork_id": l.id,
                "fork_session_id": l.to_session,
                "fork_label": l.label,
                "fork_point_msg": l.fork_point,
                "via": l.kind.as_str(),
                "export_id": l.export_id,
                "created_at": iso(&l.created_at),
            })
        })
        .collect();
    let origin = view.incoming.iter().find(is_fork).map(|l| {
        json!({
            "origin_session_id": l.from_session,
            "fork_label": l.label,
            "fork_point_msg": l.fork_point,
            "forked_at": iso(&l.created_at),
            "via": l.kind.as_str(),
            "export_id": l.export_id,
        })
    });
    let imported_from = view
        .incoming
        .iter()
        .find(|l| l.kind == LinkKind::Import && !l.reused)
        .map(|l| {
            json!({
                "source_session_id": l.from_session,
                "export_id": l.export_id,
                "from_agent": l.from_agent,
                "imported_at": iso(&l.created_at),
            })
        });
    let imports: Vec<Value> = out(LinkKind::Import)
        .filter(|l| !l.reused)
        .map(|l| {
            json!({
                "import_session_id": l.to_session,
                "export_id": l.export_id,
                "imported_at": iso(&l.created_at),
            })
        })
        .collect();
    Ok(Json(json!({
        "session_id": session.id,
        "exports": exports_json(&view),
        "outgoing_handoffs": outgoing_handoffs,
        "incoming_handoffs": incoming_handoffs,
        "forks": forks,
        "origin": origin,
        "imported_from": imported_from,
        "imports": imports,
    }))
    .into_response())
}

fn memory_json(session_id: uuid::Uuid, m: &sbp_store::MemoryRecord) -> Value {
    json!({
        "session_id": session_id,
        "schema_id": m.schema_id,
        "payload": m.payload,
        "updated_at": iso(&m.updated_at),
    })
}

pub async fn get_memory(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let m = gw.roaming().memory(&session).await?;
    Ok(Json(memory_json(session.id, &m)).into_response())
}

pub async fn put_memory(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let schema_id = match body.get("schema_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(Error::invalid("`schema_id` must be a string")),
    };
    let payload = body
        .get("payload")
        .cloned()
        .ok_or_else(|| Error::invalid("`payload` (an object) is required"))?;
    let m = gw
        .roaming()
        .put_memory(&session, schema_id, payload)
        .await?;
    Ok(Json(memory_json(session.id, &m)).into_response())
}
