//! HTTP handlers of federation (L6): the signed manifest at `/.well-known/sbp`, bundles by CID
//! for peers holding a federation token, and a tracker's registry. Registered only when
//! federation is on (the registry only on trackers).

use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use sha2::{Digest, Sha256};

use super::extract::{JsonObject, bearer};
use crate::Gateway;
use crate::engine::federation::migration::{abort_path, commit_path, handover_path, locate_path};
use crate::engine::federation::tracker::Announced;
use crate::engine::federation::{REDEEM_PATH, is_cid, roaming_sid};
use crate::error::{Error, FedError, parse_uuid};
use crate::federation::auth::Caller;

type ApiResult = Result<Response, Error>;

/// `GET /.well-known/sbp`.
pub async fn well_known(State(gw): State<Gateway>) -> ApiResult {
    let manifest = gw.federation().manifest()?;
    let mut resp = axum::Json(manifest).into_response();
    resp.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=60"),
    );
    Ok(resp)
}

/// `GET /v1/sbp/bundles/{cid}`: 422 for a malformed CID, then the token (401/403), then 404 or
/// the verified bytes with `Content-Digest` and `Cache-Control: no-store`.
pub async fn bundle(State(gw): State<Gateway>, Path(cid): Path<String>, req: Request) -> ApiResult {
    if !is_cid(&cid) {
        return Err(FedError::InvalidCid(cid.chars().take(80).collect()).into());
    }
    let token = bearer(req.headers());
    gw.federation()
        .authenticate(token.as_deref(), "GET", req.uri().path(), &cid)
        .await?;
    let bytes = gw.federation().serve_bundle(&cid).await?;
    let digest = base64::engine::general_purpose::STANDARD.encode(Sha256::digest(&bytes));
    let mut resp = bytes.into_response();
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Ok(v) = HeaderValue::from_str(&format!("sha-256=:{digest}:")) {
        headers.insert("content-digest", v);
    }
    Ok(resp)
}

/// `POST /v1/sbp/registry` (trackers): a gateway's signed provider record.
pub async fn announce(State(gw): State<Gateway>, JsonObject(record): JsonObject) -> ApiResult {
    let outcome = gw.federation().tracker()?.announce(record).await?;
    let status = match outcome {
        Announced::Created => StatusCode::CREATED,
        Announced::Replaced | Announced::Unchanged => StatusCode::OK,
    };
    let body = serde_json::json!({
        "accepted": true,
        "outcome": match outcome {
            Announced::Created => "created",
            Announced::Replaced => "replaced",
            Announced::Unchanged => "unchanged",
        },
    });
    Ok((status, axum::Json(body)).into_response())
}

/// `POST /v1/sbp/registry/gateways` (trackers): a gateway makes itself known by its URL.
pub async fn register(State(gw): State<Gateway>, JsonObject(body): JsonObject) -> ApiResult {
    let url = match body.get("gateway_url") {
        Some(serde_json::Value::String(u)) if u.len() <= 2048 => u.trim().to_owned(),
        _ => return Err(Error::invalid("`gateway_url` must be the gateway's URL")),
    };
    let vouch = gw.federation().tracker()?.register(&url).await?;
    Ok(no_store(axum::Json(vouch).into_response()))
}

/// `GET /v1/sbp/registry/{cid}` (trackers): the signed list of providers.
pub async fn lookup(State(gw): State<Gateway>, Path(cid): Path<String>) -> ApiResult {
    if !is_cid(&cid) {
        return Err(FedError::InvalidCid(cid.chars().take(80).collect()).into());
    }
    let answer = gw.federation().tracker()?.lookup(&cid).await?;
    Ok(no_store(axum::Json(answer).into_response()))
}

/// `GET /v1/sbp/registry/gateways/{gateway_id}` (trackers): what this tracker verified about a
/// gateway, signed.
pub async fn vouch(State(gw): State<Gateway>, Path(gateway_id): Path<String>) -> ApiResult {
    if gateway_id.is_empty()
        || gateway_id.len() > 128
        || !gateway_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(Error::invalid("not a gateway id"));
    }
    let answer = gw.federation().tracker()?.vouch(&gateway_id).await?;
    Ok(no_store(axum::Json(answer).into_response()))
}

fn no_store(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// `POST /v1/sbp/federation/tokens/redeem` (gateways): a peer redeems a roaming token this
/// gateway minted; the federation token's `sub` is the roaming token's session id.
pub async fn redeem(
    State(gw): State<Gateway>,
    headers: HeaderMap,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let token = match body.get("roaming_token") {
        Some(serde_json::Value::String(t)) if t.len() <= 8192 => t.trim().to_owned(),
        _ => return Err(Error::invalid("`roaming_token` must be a string")),
    };
    let allow_reuse = match body.get("allow_reuse") {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Bool(b)) => *b,
        Some(_) => return Err(Error::invalid("`allow_reuse` must be a boolean")),
    };
    let sid = roaming_sid(&token).unwrap_or_default();
    let caller = gw
        .federation()
        .authenticate(bearer(&headers).as_deref(), "POST", REDEEM_PATH, &sid)
        .await?;
    let answer = gw
        .federation()
        .redeem_for(&caller, &token, allow_reuse)
        .await?;
    Ok(no_store(axum::Json(answer).into_response()))
}

/// The peer calling `method path` about session `id` (its federation token's `sub`).
async fn session_peer(
    gw: &Gateway,
    headers: &HeaderMap,
    method: &str,
    path: &str,
    id: uuid::Uuid,
) -> Result<Caller, Error> {
    gw.federation()
        .authenticate(bearer(headers).as_deref(), method, path, &id.to_string())
        .await
}

/// `GET /v1/sbp/federation/sessions/{id}`: where a session is, for a peer that holds a token
/// for it (`sub` = the session id).
pub async fn locate(
    State(gw): State<Gateway>,
    Path(id): Path<String>,
    Query(query): Query<std::collections::HashMap<String, String>>,
    headers: HeaderMap,
) -> ApiResult {
    let id = parse_uuid(&id)?;
    let caller = session_peer(&gw, &headers, "GET", &locate_path(id), id).await?;
    let challenge = query.get("challenge").filter(|c| {
        !c.is_empty() && c.len() <= 128 && c.bytes().all(|b| b.is_ascii_alphanumeric())
    });
    match gw
        .federation()
        .session_location(
            id,
            challenge.map(|c| (c.as_str(), caller.gateway_id.as_str())),
        )
        .await?
    {
        Some(where_) => Ok(no_store(axum::Json(where_).into_response())),
        None => Err(Error::session_not_found(id)),
    }
}

/// `POST /v1/sbp/federation/sessions/{id}/handover {session_token, migration_id}`.
pub async fn handover(
    State(gw): State<Gateway>,
    Path(id): Path<String>,
    headers: HeaderMap,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let id = parse_uuid(&id)?;
    let caller = session_peer(&gw, &headers, "POST", &handover_path(id), id).await?;
    let token = match body.get("session_token") {
        Some(serde_json::Value::String(t)) if t.len() <= 512 => t.clone(),
        _ => return Err(Error::invalid("`session_token` must be a string")),
    };
    let migration_id = match body.get("migration_id") {
        Some(serde_json::Value::String(m)) => parse_uuid(m)?,
        _ => return Err(Error::invalid("`migration_id` must be a UUID")),
    };
    match gw
        .federation()
        .grant_handover(&caller, id, &token, migration_id)
        .await
    {
        Ok(envelope) => Ok(no_store(axum::Json(envelope).into_response())),
        Err(e @ Error::Forbidden(_)) => {
            let mut resp = e.into_response();
            resp.extensions_mut()
                .insert(super::limits::NotTheCallersFailure);
            Ok(resp)
        }
        Err(e) => Err(e),
    }
}

/// `POST /v1/sbp/federation/sessions/{id}/handover/{migration_id}/commit`.
pub async fn commit(
    State(gw): State<Gateway>,
    Path((id, migration_id)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let id = parse_uuid(&id)?;
    let migration_id = parse_uuid(&migration_id)?;
    let caller = session_peer(&gw, &headers, "POST", &commit_path(id, migration_id), id).await?;
    let answer = gw
        .federation()
        .commit_handover(&caller, id, migration_id)
        .await?;
    // Surfaces still attached here hear that the session left (4409).
    gw.surfaces().displace_everywhere(id).await;
    Ok(no_store(axum::Json(answer).into_response()))
}

/// `POST /v1/sbp/federation/sessions/{id}/handover/{migration_id}/abort`: the lease's gateway
/// gave up; the session is home again.
pub async fn abort(
    State(gw): State<Gateway>,
    Path((id, migration_id)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let id = parse_uuid(&id)?;
    let migration_id = parse_uuid(&migration_id)?;
    let caller = session_peer(&gw, &headers, "POST", &abort_path(id, migration_id), id).await?;
    let released = gw
        .federation()
        .abort_handover(&caller, id, migration_id)
        .await?;
    Ok(no_store(
        axum::Json(serde_json::json!({ "released": released })).into_response(),
    ))
}

/// With federation, session routes refuse a session that moved away (409 SBP_SESSION_MOVED
/// naming its holder) or is being handed over (409 SBP_SESSION_MOVING, Retry-After); reading a
/// session's own record still answers, saying where it went.
pub async fn guard(
    State(gw): State<Gateway>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some((id, read)) = session_in_path(req.uri().path(), req.method()) {
        let checked = if read {
            gw.federation().guard_read(id).await
        } else {
            gw.federation().guard(id).await
        };
        if let Err(e) = checked {
            return e.into_response();
        }
    }
    next.run(req).await
}

/// The session a session route names, and whether the request reads what stays true of a
/// session that moved away (its own record, its lineage).
fn session_in_path(path: &str, method: &axum::http::Method) -> Option<(uuid::Uuid, bool)> {
    let rest = path
        .strip_prefix("/v1/sbp/sessions/")
        .or_else(|| path.strip_prefix("/v1/sessions/"))?;
    let mut parts = rest.split('/');
    let id = sbp_protocol::id::parse_canonical(parts.next()?)?;
    let more = parts.next();
    let rest_empty = parts.next().is_none();
    let read =
        method == axum::http::Method::GET && rest_empty && matches!(more, None | Some("lineage"));
    Some((id, read))
}
