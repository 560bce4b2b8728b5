//! L5 endpoints: a backend calling a surface tool directly (`POST .../tool_calls`).

use super::extract::JsonObject;
use super::to_wire;
use crate::Gateway;
use crate::engine::sessions::Caller;
use crate::engine::tools::BackendToolCall;
use crate::error::Error;
use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};

type ApiResult = Result<Response, Error>;

/// `POST /v1/sbp/sessions/{id}/tool_calls`: 200 with the TOOL_RESULT (or how the call ended),
/// 409 when no attached surface declared the tool, 403 when the allowlist refuses it.
///
/// The body is parsed by `BackendToolCall::from_body` (`requests.rs`), not as a
/// `rest::ToolCallRequest`: it takes `name` / `tool`, `arguments` / `input`, and a `null` or
/// missing input as `{}`.
pub async fn call(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let call = BackendToolCall::from_body(&body)?;
    let out = gw.tools().backend_call(&id, &caller, call).await?;
    Ok(Json(to_wire::tool_call(out)).into_response())
}
