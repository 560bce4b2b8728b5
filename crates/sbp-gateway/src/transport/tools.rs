//! L5 endpoints: a backend calling a surface tool directly (`POST .../tool_calls`).

use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use sbp_protocol::rest::ToolCallOutcome;

use super::extract::JsonObject;
use super::to_wire;
use crate::engine::{BackendToolCall, Caller};
use crate::{ApiError, Gateway};

type ApiResult = Result<Response, ApiError>;

/// `POST /v1/sbp/sessions/{id}/tool_calls`: 200 with the TOOL_RESULT (or how the call ended),
/// 409 when no attached surface declared the tool, 403 when the allowlist refuses it.
///
/// The body is parsed by the engine's `BackendToolCall::from_body`, not as a
/// `rest::ToolCallRequest`: it takes `name` / `tool`, `arguments` / `input`, and a `null` or
/// missing input as `{}`.
pub async fn call(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let call = BackendToolCall::from_body(&body)?;
    let answer = gw.backend_tool_call(&id, &caller, call).await?;
    let outcome: ToolCallOutcome = to_wire::typed("answering a backend tool call", answer)?;
    Ok(Json(outcome).into_response())
}
