//! The backend tool-call endpoint (`POST /v1/sbp/sessions/{id}/tool_calls`): a backend calls a tool
//! of the session's attached surface directly.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The request. The gateway also takes `name` / `tool` for `tool_name` and `arguments` / `input`
/// for `tool_input` (default `{}`); `timeout_ms` is 1 to 300,000.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallRequest {
    pub tool_name: String,
    pub tool_input: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

impl ToolCallRequest {
    pub fn new(tool_name: impl Into<String>, tool_input: Value) -> Self {
        Self {
            tool_name: tool_name.into(),
            tool_input,
            timeout_ms: None,
        }
    }

    pub fn timeout_ms(mut self, ms: u64) -> Self {
        self.timeout_ms = Some(ms);
        self
    }
}

/// How a backend tool call ended.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolCallStatus {
    Ok,
    /// The surface answered with an error.
    Error,
    Timeout,
    /// The surface went away while the call was in flight.
    Disconnected,
    /// A value this version does not know (never sent by this gateway).
    #[serde(other)]
    #[cfg_attr(feature = "openapi", schemars(skip))]
    Other,
}

impl ToolCallStatus {
    /// How a call with this outcome ended.
    pub fn of(outcome: &crate::ToolOutcome) -> Self {
        match outcome {
            Ok(_) => Self::Ok,
            Err(crate::ToolFailure::Timeout) => Self::Timeout,
            Err(crate::ToolFailure::Disconnected) => Self::Disconnected,
            Err(crate::ToolFailure::Surface(_)) => Self::Error,
        }
    }
}

/// The 200 answer: the surface's TOOL_RESULT, or how the call ended without one.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallOutcome {
    #[serde(default)]
    pub session_id: Option<String>,
    pub call_id: String,
    pub tool_name: String,
    pub status: ToolCallStatus,
    /// The result (`null` unless `status` is `ok`).
    #[serde(default)]
    pub result: Value,
    /// The surface's error, `timeout` or `surface disconnected` (`null` when `ok`).
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub duration_ms: f64,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::rest::test_support::{parses, round_trips};

    #[test]
    fn gateway_answers_round_trip() {
        let base = json!({
            "session_id": "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", "call_id": "c1",
            "tool_name": "gps", "duration_ms": 12.5
        });
        let endings = [
            ("ok", json!({"lat": 1.5}), Value::Null),
            ("error", Value::Null, json!("camera busy")),
            ("timeout", Value::Null, json!("timeout")),
            ("disconnected", Value::Null, json!("surface disconnected")),
        ];
        for (status, result, error) in endings {
            let mut body = base.clone();
            body["status"] = json!(status);
            body["result"] = result;
            body["error"] = error;
            round_trips::<ToolCallOutcome>(&body);
        }
    }

    #[test]
    fn minimal_and_unknown_answers_parse() {
        let out: ToolCallOutcome = parses(&json!({
            "call_id": "c", "tool_name": "gps", "status": "cancelled"
        }));
        assert_eq!(
            (out.status, out.result, out.session_id),
            (ToolCallStatus::Other, Value::Null, None)
        );
    }

    #[test]
    fn optional_request_fields_are_left_out() {
        let cases = [
            (
                ToolCallRequest::new("gps", json!({})),
                json!({"tool_name": "gps", "tool_input": {}}),
            ),
            (
                ToolCallRequest::new("gps", json!({})).timeout_ms(5),
                json!({"tool_name": "gps", "tool_input": {}, "timeout_ms": 5}),
            ),
        ];
        for (req, want) in cases {
            assert_eq!(serde_json::to_value(req).expect("serialises"), want);
        }
    }
}
