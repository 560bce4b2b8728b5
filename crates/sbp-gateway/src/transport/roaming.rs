//! HTTP handlers of L3 roaming. Responses carry the names of SPEC 8, the HTTP API docs and the
//! reference server at once (e.g. `session_id` and `new_session_id`), so every client finds its own;
//! `to_wire` builds them.
//!
//! Request bodies are parsed into the engine's inputs by the lenient parsers of `requests.rs`
//! (`ExportRequest::from_body` and the others) rather than as `sbp_protocol::rest`'s request types:
//! they take other names (`token`, `agent_id`, `target_agent_id`), take `null` for absent, and
//! refuse out-of-range values with messages clients and tests rely on.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::extract::JsonObject;
use super::headers::created;
use super::requests::CidImport;
use super::to_wire;
use crate::Gateway;
use crate::engine::roaming::{ExportRequest, ForkRequest, HandoffRequest, ImportRequest};
use crate::engine::sessions::Caller;
use crate::error::Error;

type ApiResult = Result<Response, Error>;

pub async fn export(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let req = ExportRequest::from_body(&body)?;
    let announce = match body.get("announce") {
        None | Some(Value::Null) => gw.federation().announces_every_export(),
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(Error::invalid("`announce` must be a boolean")),
    };
    if announce && !gw.federation().enabled() {
        return Err(Error::invalid(
            "`announce` needs federation (this gateway runs without trackers)",
        ));
    }
    let out = gw.roaming().export(&session, req).await?;
    let announced = if announce {
        Some(gw.federation().announce(&out.export.bundle_cid).await)
    } else {
        None
    };
    let mut body = serde_json::to_value(to_wire::export(out))
        .map_err(|e| Error::internal("writing an export", e))?;
    if let (Some(ids), Some(obj)) = (announced, body.as_object_mut()) {
        obj.insert("announced_to".into(), Value::from(ids));
    }
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

pub async fn import(State(gw): State<Gateway>, JsonObject(body): JsonObject) -> ApiResult {
    let out = match CidImport::from_body(&body)? {
        Some(req) => {
            gw.federation()
                .import_by_cid(&req.bundle_cid, req.from.as_deref(), req.target_agent_id)
                .await?
        }
        None if gw.federation().enabled() => {
            gw.federation()
                .import(ImportRequest::from_body(body)?)
                .await?
        }
        None => gw.roaming().import(ImportRequest::from_body(body)?).await?,
    };
    Ok(created(
        &to_wire::import(&out),
        &out.session,
        &out.session_token,
    ))
}

pub async fn inspect_token(State(gw): State<Gateway>, Path(token): Path<String>) -> ApiResult {
    let info = gw.roaming().inspect_token(&token).await?;
    Ok(Json(to_wire::token_info(&info)).into_response())
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
    Ok(created(
        &to_wire::handoff(&out),
        &out.session,
        &out.session_token,
    ))
}

pub async fn fork(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let origin = gw.sessions().authorized(&id, &caller).await?;
    let req = ForkRequest::from_body(&body)?;
    let out = gw.roaming().fork(&origin, req).await?;
    Ok(created(
        &to_wire::fork(&out),
        &out.session,
        &out.session_token,
    ))
}

pub async fn exports(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let view = gw.roaming().lineage(&session).await?;
    Ok(Json(to_wire::export_list(session.id, &view)).into_response())
}

pub async fn lineage(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let view = gw.roaming().lineage(&session).await?;
    Ok(Json(to_wire::lineage(session.id, &view)).into_response())
}

pub async fn get_memory(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let m = gw.roaming().memory(&session).await?;
    Ok(Json(to_wire::memory(session.id, m)).into_response())
}

/// The body is parsed here rather than as a `rest::MemoryPut`: a missing `payload` and a
/// `schema_id` that is not a string have messages of their own, and `null` is an absent `schema_id`.
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
    Ok(Json(to_wire::memory(session.id, m)).into_response())
}
