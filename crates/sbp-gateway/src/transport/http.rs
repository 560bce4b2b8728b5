//! HTTP handlers: each extracts its inputs, calls one engine function and maps the result.

use std::convert::Infallible;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use sbp_protocol::ErrorCode;
use sbp_protocol::rest::{Health, MessagesQuery, SetStatus, Snapshot};
use serde_json::{Map, Value, json};

use super::extract::{JsonObject, Operator, add_headers, created, header};
use super::to_wire;
use crate::engine::{Caller, ChatInput, ChatOutcome, ChatReply, PushTurn, SseEvent};
use crate::{ApiError, Gateway};

type ApiResult = Result<Response, ApiError>;

pub async fn healthz() -> Json<Health> {
    Json(to_wire::health())
}

pub async fn metrics(State(gw): State<Gateway>) -> ApiResult {
    let text = gw.render_metrics().await?;
    Ok(([("content-type", "text/plain; version=0.0.4")], text).into_response())
}

pub async fn not_found() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "no such endpoint")
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        "method not allowed on this endpoint",
    )
}

pub async fn chat_completions(
    State(gw): State<Gateway>,
    operator: Option<axum::Extension<Operator>>,
    headers: HeaderMap,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let input = ChatInput {
        body,
        session_token: header(&headers, "x-session-token"),
        agent_id: header(&headers, "x-agent-id"),
        idempotency_key: header(&headers, "idempotency-key"),
        operator: operator.is_some_and(|o| o.0.0),
    };
    match gw.chat(input).await? {
        ChatOutcome::Reply(reply) => Ok(reply_response(reply)),
        ChatOutcome::Stream {
            headers,
            first,
            events,
        } => {
            let rest = futures::stream::unfold(events, |mut rx| async move {
                rx.recv().await.map(|ev| (ev, rx))
            });
            let stream = futures::stream::once(async move { first })
                .chain(rest)
                .scan(false, |finished, ev| {
                    // Nothing is sent after [DONE] or an error event.
                    if *finished {
                        return futures::future::ready(None);
                    }
                    let event = match ev {
                        SseEvent::Data(v) => Event::default().data(v.to_string()),
                        SseEvent::Failed(e) => {
                            *finished = true;
                            Event::default()
                                .data(serde_json::to_string(&e.body()).unwrap_or_default())
                        }
                        SseEvent::Done => {
                            *finished = true;
                            Event::default().data("[DONE]")
                        }
                    };
                    futures::future::ready(Some(Ok::<_, Infallible>(event)))
                });
            let mut resp = Sse::new(stream).into_response();
            add_headers(resp.headers_mut(), &headers);
            Ok(resp)
        }
    }
}

fn reply_response(reply: ChatReply) -> Response {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::OK);
    let mut resp = (status, Json(reply.body)).into_response();
    add_headers(resp.headers_mut(), &reply.headers);
    resp
}

/// The body stays a JSON object parsed here rather than a `rest::NewSession`: the gateway tells a
/// wrong `agent_id` and a wrong `metadata` apart in its messages, falls back to `X-Agent-Id`, and
/// takes `null` for absent.
pub async fn create_session(
    State(gw): State<Gateway>,
    headers: HeaderMap,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let agent = match body.get("agent_id") {
        None | Some(Value::Null) => header(&headers, "x-agent-id"),
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 256 => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "`agent_id` must be a string of 1 to 256 characters",
            ));
        }
    };
    let metadata = match body.get("metadata") {
        None | Some(Value::Null) => json!({}),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return Err(ApiError::bad_request("`metadata` must be an object")),
    };
    let (session, token) = gw.create_session(agent, metadata).await?;
    let body = to_wire::session_created(&session, &token);
    Ok(created(&body, &session, &token))
}

pub async fn get_session(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.authorized_session(&id, &caller).await?;
    let view = gw.session_view(&session).await?;
    Ok(Json(to_wire::session_info(view)).into_response())
}

pub async fn list_messages(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    query: Result<Query<MessagesQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult {
    let Query(page) = query.map_err(|e| ApiError::bad_request(format!("bad query: {e}")))?;
    let session = gw.authorized_session(&id, &caller).await?;
    let limit = page.limit.unwrap_or(100).clamp(1, 1000);
    let messages = gw.list_messages(&session, page.after, limit).await?;
    let next = messages
        .last()
        .map(|m| m.seq)
        .filter(|_| messages.len() as u32 == limit);
    Ok(Json(to_wire::message_page(&session, messages, next)).into_response())
}

pub async fn set_status(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let session = gw.authorized_session(&id, &caller).await?;
    // Parsed with the wire type: it fails exactly when `status` is missing or not a string (other
    // fields are ignored), which is what this message says.
    let SetStatus { status } = serde_json::from_value(Value::Object(body))
        .map_err(|_| ApiError::bad_request("`status` must be a string"))?;
    let previous = session.status;
    let updated = gw.set_status(&session, &status).await?;
    Ok(Json(to_wire::status_changed(&updated, previous)).into_response())
}

pub async fn latest_snapshot(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.authorized_session(&id, &caller).await?;
    let snap = gw
        .store_latest_snapshot(session.id)
        .await?
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, "this session has no snapshot yet"))?;
    let body: Snapshot = to_wire::typed("reading a snapshot", gw.snapshot_json(&snap).await?)?;
    Ok(Json(body).into_response())
}

pub async fn list_snapshots(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.authorized_session(&id, &caller).await?;
    let snaps = gw.snapshots(session.id, 100).await?;
    Ok(Json(to_wire::snapshot_list(session.id, &snaps)).into_response())
}

/// A pushed turn, parsed here rather than as a `rest::PushTurn`: `role` defaults to `assistant` and
/// is checked against the four roles, a `model_used` that is not a string is ignored, and each
/// field has its own message.
fn push_from(v: &Map<String, Value>) -> Result<PushTurn, ApiError> {
    let content = v
        .get("content")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("`content` must be a string"))?
        .to_owned();
    let role = match v.get("role") {
        None | Some(Value::Null) => "assistant".to_owned(),
        Some(Value::String(r))
            if matches!(r.as_str(), "assistant" | "user" | "tool" | "system") =>
        {
            r.clone()
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "`role` must be assistant, user, tool or system",
            ));
        }
    };
    let model_used = v
        .get("model_used")
        .and_then(Value::as_str)
        .map(str::to_owned);
    Ok(PushTurn {
        role,
        content,
        model_used,
    })
}

pub async fn push_turn(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let session = gw.authorized_session(&id, &caller).await?;
    let push = push_from(&body)?;
    let (seq, attached) = gw.push_turn(&session, push).await?;
    Ok((
        StatusCode::CREATED,
        Json(to_wire::pushed_turn(session.id, seq, attached)),
    )
        .into_response())
}

/// The public conformance suite's tether loader (only with `--enable-test-hooks`):
/// `{"turns": [{"type": "TETHER_TURN", "turn": {"role": ..., "content": ...}}, ...]}`.
pub async fn test_tether(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let session = gw.authorized_session(&id, &caller).await?;
    let turns = body
        .get("turns")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_request("`turns` must be an array"))?;
    let mut pushes = Vec::with_capacity(turns.len());
    for t in turns {
        let inner = t.get("turn").unwrap_or(t);
        let obj = inner
            .as_object()
            .ok_or_else(|| ApiError::bad_request("each turn must be an object"))?;
        pushes.push(push_from(obj)?);
    }
    let mut seqs = Vec::with_capacity(pushes.len());
    for p in pushes {
        seqs.push(gw.push_turn(&session, p).await?.0);
    }
    Ok(Json(to_wire::tether_loaded(session.id, seqs)).into_response())
}
