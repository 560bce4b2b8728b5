//! L5 endpoints: a backend calling a surface tool directly (`POST .../tool_calls`).

use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};

use sbp_protocol::ToolFailure;
use serde_json::{Value, json};

use super::extract::JsonObject;
use crate::Gateway;
use crate::engine::sessions::Caller;
use crate::engine::tools::BackendToolCall;
use crate::error::Error;

type ApiResult = Result<Response, Error>;

/// `POST /v1/sbp/sessions/{id}/tool_calls`: 200 with the TOOL_RESULT (or how the call ended),
/// 409 when no attached surface declared the tool, 403 when the allowlist refuses it.
pub async fn call(
    State(gw): State<Gateway>,
    caller: Caller,
    Path(id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult {
    let call = BackendToolCall::from_body(&body)?;
    let out = gw.tools().backend_call(&id, &caller, call).await?;
    // The answer mirrors TOOL_RESULT, with `status` saying how the call ended.
    let (status, result, error) = match out.call.outcome {
        Ok(v) => ("ok", v, Value::Null),
        Err(e) => {
            let status = match &e {
                ToolFailure::Timeout => "timeout",
                ToolFailure::Disconnected => "disconnected",
                ToolFailure::Surface(_) => "error",
            };
            (status, Value::Null, Value::String(e.to_string()))
        }
    };
    Ok(Json(json!({
        "session_id": out.session_id,
        "call_id": out.call.call_id,
        "tool_name": out.tool_name,
        "status": status,
        "result": result,
        "error": error,
        "duration_ms": out.call.elapsed.as_secs_f64() * 1000.0,
    }))
    .into_response())
}
