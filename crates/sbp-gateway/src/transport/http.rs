//! HTTP handlers: each extracts its inputs, calls one engine function and maps the result.

use std::convert::Infallible;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use sbp_protocol::ErrorCode;
use sbp_protocol::rest::{Health, MessagesQuery, SessionsQuery, SetStatus};
use serde_json::{Map, Value, json};

use super::errors;
use super::extract::{ChatBody, JsonObject, Operator, fingerprint, header, session_token};
use super::headers::{add_headers, created, session_headers};
use super::to_wire;
use crate::Gateway;
use crate::engine::sessions::{Caller, ListRequest, PushTurn};
use crate::engine::turns::{ChatInput, ChatOutcome, IdempotencyKey, SseEvent};
use crate::error::Error;

type ApiResult = Result<Response, Error>;

pub async fn healthz() -> Json<Health> {
    Json(to_wire::health())
}

pub async fn metrics(State(gw): State<Gateway>) -> ApiResult {
    let text = gw.render_metrics().await?;
    Ok(([("content-type", crate::metrics::CONTENT_TYPE)], text).into_response())
}

/// `GET /v1/models`: OpenAI's list shape, so chat front ends and SDKs that list models first work.
pub async fn models(State(gw): State<Gateway>) -> ApiResult {
    let data = gw.turns().models().await?;
    Ok(Json(json!({ "object": "list", "data": data })).into_response())
}

/// `GET /v1/models/{id}`: one model of the list, or 404.
pub async fn model(State(gw): State<Gateway>, Path(id): Path<String>) -> ApiResult {
    gw.turns()
        .models()
        .await?
        .into_iter()
        .find(|m| m.get("id").and_then(Value::as_str) == Some(id.as_str()))
        .map(|m| Json(m).into_response())
        .ok_or_else(|| {
            Error::NotFound(format!(
                "no model '{}' here",
                id.chars().take(120).collect::<String>()
            ))
        })
}

pub async fn not_found() -> Response {
    errors::routing(ErrorCode::NotFound, "no such endpoint")
}

pub async fn method_not_allowed() -> Response {
    errors::routing(
        ErrorCode::MethodNotAllowed,
        "method not allowed on this endpoint",
    )
}

pub async fn chat_completions(
    State(gw): State<Gateway>,
    operator: Option<axum::Extension<Operator>>,
    headers: HeaderMap,
    ChatBody {
        request,
        fingerprint,
    }: ChatBody,
) -> ApiResult {
    let idempotency = header(&headers, "idempotency-key").map(|key| IdempotencyKey {
        key,
        fingerprint: fingerprint.unwrap_or_default(),
    });
    let operator = operator.is_some_and(|o| o.0.0);
    let token = session_token(&headers, operator);
    let openai_client = is_openai_client(&headers)
        || (token.is_some() && header(&headers, "x-session-token").is_none());
    let input = ChatInput {
        request,
        session_token: token,
        agent_id: header(&headers, "x-agent-id"),
        idempotency,
        operator,
        auto_resume: header(&headers, "x-sbp-auto-resume")
            .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1"),
        openai_client,
    };
    let (status, body, headers) = match gw.turns().chat(input).await? {
        ChatOutcome::Completed { body, session } => {
            (StatusCode::OK, body, session_headers(&session))
        }
        ChatOutcome::Proxied(body) => {
            return Ok(([(CONTENT_TYPE, "application/json")], body).into_response());
        }
        ChatOutcome::ResumeAvailable { meta, session } => (
            StatusCode::ACCEPTED,
            json!({"sbp": meta}),
            session_headers(&session),
        ),
        ChatOutcome::Replayed {
            status,
            body,
            session_id,
            new_token,
            chunks,
        } => {
            let mut headers = vec![
                ("x-session-id", session_id.to_string()),
                ("idempotent-replayed", "true".into()),
            ];
            headers.extend(new_token.map(|t| ("x-session-token", t)));
            if let Some(chunks) = chunks {
                let events = chunks
                    .into_iter()
                    .map(SseEvent::Data)
                    .chain([SseEvent::Done]);
                let mut resp = sse(futures::stream::iter(events)).into_response();
                add_headers(resp.headers_mut(), &headers);
                return Ok(resp);
            }
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            (status, body, headers)
        }
        ChatOutcome::Stream {
            session,
            first,
            events,
        } => {
            let rest = tokio_stream::wrappers::ReceiverStream::new(events);
            let events = futures::stream::once(async move { first }).chain(rest);
            let mut resp = sse(events).into_response();
            if let Some(session) = &session {
                add_headers(resp.headers_mut(), &session_headers(session));
            }
            return Ok(resp);
        }
    };
    let mut resp = (status, Json(body)).into_response();
    add_headers(resp.headers_mut(), &headers);
    Ok(resp)
}

/// OpenAI's SDKs (Python, Node and the others generated alike) send `X-Stainless-*` headers and a
/// `User-Agent` of `OpenAI/<lang> <version>`.
fn is_openai_client(headers: &HeaderMap) -> bool {
    headers.contains_key("x-stainless-lang")
        || header(headers, "user-agent").is_some_and(|ua| {
            ua.get(..7)
                .is_some_and(|p| p.eq_ignore_ascii_case("openai/"))
        })
}

/// A streamed completion as server-sent events; nothing is sent after `[DONE]` or an error.
fn sse(
    events: impl futures::Stream<Item = SseEvent> + Send + 'static,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let stream = events.scan(false, |finished, ev| {
        if *finished {
            return futures::future::ready(None);
        }
        let event = match ev {
            SseEvent::Data(v) => Event::default().data(v.to_string()),
            SseEvent::Failed(e) => {
                *finished = true;
                Event::default().data(serde_json::to_string(&errors::body(&e)).unwrap_or_default())
            }
            SseEvent::Done => {
                *finished = true;
                Event::default().data("[DONE]")
            }
        };
        futures::future::ready(Some(Ok::<_, Infallible>(event)))
    });
    Sse::new(stream)
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
            return Err(Error::invalid(
                "`agent_id` must be a string of 1 to 256 characters",
            ));
        }
    };
    let metadata = match body.get("metadata") {
        None | Some(Value::Null) => json!({}),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return Err(Error::invalid("`metadata` must be an object")),
    };
    let (session, token) = gw.sessions().create(agent, metadata).await?;
    let body = to_wire::session_created(&session, &token);
    Ok(created(&body, &session, &token))
}

pub async fn get_session(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let sid = session.id;
    let view = gw.sessions().view(session).await?;
    let mut body = serde_json::to_value(to_wire::session_info(view))
        .map_err(|e| Error::internal("writing a session", e))?;
    // A session that moved to another gateway says where it went.
    if gw.federation().enabled()
        && let Some(location) = gw.federation().session_location(sid, None).await?
        && location.get("state").and_then(Value::as_str) == Some("moved")
        && let Some(obj) = body.as_object_mut()
    {
        obj.insert("federation".into(), Value::Object(location));
    }
    Ok(Json(body).into_response())
}

/// `GET /v1/sessions`: a page of sessions, newest first.
pub async fn list_sessions(
    State(gw): State<Gateway>,
    caller: Caller,
    query: Result<Query<SessionsQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult {
    let Query(q) = query.map_err(|e| Error::invalid(format!("bad query: {e}")))?;
    let request = ListRequest {
        agent_id: q.agent_id,
        status: q.status,
        cursor: q.cursor,
        limit: q.limit,
    };
    let page = gw.sessions().list(&caller, request).await?;
    Ok(Json(to_wire::session_list(page)).into_response())
}

/// `DELETE /v1/sessions/{id}`: the session and everything that holds its content, erased.
pub async fn delete_session(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    gw.sessions().delete(&session).await?;
    Ok(Json(to_wire::session_deleted(session.id)).into_response())
}

pub async fn list_messages(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    query: Result<Query<MessagesQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult {
    let Query(page) = query.map_err(|e| Error::invalid(format!("bad query: {e}")))?;
    let session = gw.sessions().authorized(&id, &caller).await?;
    let limit = page.limit.unwrap_or(100).clamp(1, 1000);
    let messages = gw.sessions().messages(&session, page.after, limit).await?;
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
    let session = gw.sessions().authorized(&id, &caller).await?;
    // Parsed with the wire type: it fails exactly when `status` is missing or not a string (other
    // fields are ignored), which is what this message says.
    let SetStatus { status } = serde_json::from_value(Value::Object(body))
        .map_err(|_| Error::invalid("`status` must be a string"))?;
    let previous = session.status;
    let updated = gw.sessions().set_status(&session, &status).await?;
    Ok(Json(to_wire::status_changed(&updated, previous)).into_response())
}

pub async fn latest_snapshot(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let snap = gw
        .sessions()
        .latest_snapshot(session.id)
        .await?
        .ok_or_else(|| Error::NotFound("this session has no snapshot yet".into()))?;
    let messages = gw.sessions().snapshot_messages(&snap).await?;
    Ok(Json(to_wire::snapshot(&snap, messages)).into_response())
}

pub async fn list_snapshots(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let snaps = gw.sessions().snapshots(session.id, 100).await?;
    Ok(Json(to_wire::snapshot_list(session.id, &snaps)).into_response())
}

/// A pushed turn, parsed here rather than as a `rest::PushTurn`: `role` defaults to `assistant` and
/// is checked against the roles a pushed message can have, a `model_used` that is not a string is
/// ignored, and each field has its own message.
///
/// It is stored as the chat message `{"role", "content"}`, so it must be one a strict upstream
/// takes in any later turn: a `tool` message must answer a call of the assistant message before
/// it (with its `tool_call_id`), which a push, appended on its own, cannot do.
fn push_from(v: &Map<String, Value>) -> Result<PushTurn, Error> {
    let field = |param: &str, message: &str| Error::InvalidField {
        param: param.to_owned(),
        message: message.to_owned(),
    };
    let content = v
        .get("content")
        .and_then(Value::as_str)
        .ok_or_else(|| field("content", "`content` must be a string"))?
        .to_owned();
    let role = match v.get("role") {
        None | Some(Value::Null) => "assistant".to_owned(),
        Some(Value::String(r))
            if matches!(r.as_str(), "assistant" | "user" | "system" | "developer") =>
        {
            r.clone()
        }
        Some(Value::String(r)) if r == "tool" => {
            return Err(field(
                "role",
                "`role` cannot be tool in a pushed turn: a tool message must answer an assistant \
                 tool call, so send it in a completion request",
            ));
        }
        Some(_) => {
            return Err(field(
                "role",
                "`role` must be assistant, user, system or developer",
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
    headers: HeaderMap,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let push = push_from(&body)?;
    let key = match header(&headers, "idempotency-key") {
        Some(key) => Some(IdempotencyKey {
            key,
            fingerprint: fingerprint(&body)?,
        }),
        None => None,
    };
    let pushed = gw.sessions().push_turn(&session, push, key).await?;
    let mut response = (
        StatusCode::CREATED,
        Json(to_wire::pushed_turn(
            session.id,
            pushed.seq,
            pushed.attached,
        )),
    )
        .into_response();
    if pushed.replayed {
        response.headers_mut().insert(
            "idempotent-replayed",
            axum::http::HeaderValue::from_static("true"),
        );
    }
    Ok(response)
}

/// The public conformance suite's tether loader (only with `--enable-test-hooks`):
/// `{"turns": [{"type": "TETHER_TURN", "turn": {"role": ..., "content": ...}}, ...]}`.
pub async fn test_tether(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let session = gw.sessions().authorized(&id, &caller).await?;
    let turns = body
        .get("turns")
        .and_then(Value::as_array)
        .ok_or_else(|| Error::invalid("`turns` must be an array"))?;
    let mut pushes = Vec::with_capacity(turns.len());
    for t in turns {
        let inner = t.get("turn").unwrap_or(t);
        let obj = inner
            .as_object()
            .ok_or_else(|| Error::invalid("each turn must be an object"))?;
        pushes.push(push_from(obj)?);
    }
    let mut seqs = Vec::with_capacity(pushes.len());
    for p in pushes {
        seqs.push(gw.sessions().push_turn(&session, p, None).await?.seq);
    }
    Ok(Json(to_wire::tether_loaded(session.id, seqs)).into_response())
}
