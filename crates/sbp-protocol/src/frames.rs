//! The WebSocket frames of SPEC 11 / the seeds' frame reference, as two closed enums: what a surface
//! sends (`ClientFrame`) and what the gateway sends (`ServerFrame`). Unknown types parse to an explicit
//! `Unknown` variant, which the protocol says to ignore.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::surface::SurfaceContext;

pub const CLOSE_NORMAL: u16 = 1000;
pub const CLOSE_GOING_AWAY: u16 = 1001;
pub const CLOSE_PROTOCOL_ERROR: u16 = 1003;
pub const CLOSE_TOO_BIG: u16 = 1009;
pub const CLOSE_FORBIDDEN: u16 = 4003;
pub const CLOSE_NOT_FOUND: u16 = 4004;
/// Extension (docs/PROTOCOL-EXTENSIONS.md): another surface attached to the session.
pub const CLOSE_DISPLACED: u16 = 4409;

/// A frame from a surface.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum ClientFrame {
    #[serde(rename = "ATTACH_SESSION")]
    Attach(AttachSession),
    #[serde(rename = "DETACH")]
    Detach,
    #[serde(rename = "TOOL_RESULT")]
    ToolResult(ToolResult),
    #[serde(rename = "PONG")]
    Pong,
    /// Extension (docs/PROTOCOL-EXTENSIONS.md): acknowledges every tethered turn up to `seq`.
    #[serde(rename = "ACK")]
    Ack { seq: u64 },
    /// Any other `type`: ignored by the gateway.
    #[serde(skip)]
    Unknown { frame_type: String },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttachSession {
    pub session_id: String,
    #[serde(default)]
    pub session_token: String,
    /// The SurfaceContext, from `surface_context` or its alias `surface`; `None` when absent or null.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub surface_context: Option<SurfaceContext>,
    /// Extension: the highest tether `seq` the surface already has; older turns are not resent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seq: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    pub call_id: String,
    #[serde(default)]
    pub result: Option<Value>,
    #[serde(default)]
    pub error: Option<String>,
}

impl ToolResult {
    /// How the call ended: the surface's error, else its result (`null` when it sent none).
    pub fn outcome(self) -> crate::ToolOutcome {
        match self.error {
            Some(e) => Err(crate::ToolFailure::from_message(e)),
            None => Ok(self.result.unwrap_or(Value::Null)),
        }
    }
}

/// Why a text frame could not be parsed; each maps to PROTOCOL_ERROR + 1003.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FrameError {
    #[error("frame is not valid JSON: {0}")]
    NotJson(String),
    #[error("frame must be a JSON object")]
    NotObject,
    #[error("frame has no string \"type\" field")]
    MissingType,
    #[error("invalid {frame_type} frame: {reason}")]
    Invalid { frame_type: String, reason: String },
}

impl ClientFrame {
    pub fn parse(text: &str) -> Result<Self, FrameError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| FrameError::NotJson(e.to_string()))?;
        Self::from_value(value)
    }

    pub fn from_value(value: Value) -> Result<Self, FrameError> {
        let Value::Object(mut obj) = value else {
            return Err(FrameError::NotObject);
        };
        let frame_type = match obj.get("type") {
            Some(Value::String(t)) => t.clone(),
            _ => return Err(FrameError::MissingType),
        };
        let invalid = |reason: String| FrameError::Invalid {
            frame_type: frame_type.clone(),
            reason,
        };
        match frame_type.as_str() {
            "ATTACH_SESSION" => {
                let session_id = match obj.get("session_id") {
                    Some(Value::String(s)) => s.clone(),
                    _ => return Err(invalid("session_id must be a string".into())),
                };
                let session_token = match obj.get("session_token") {
                    Some(Value::String(s)) => s.clone(),
                    _ => String::new(),
                };
                let ctx_value = match obj.remove("surface_context") {
                    Some(v) if !v.is_null() => Some(v),
                    _ => obj.remove("surface").filter(|v| !v.is_null()),
                };
                let last_seq = match obj.get("last_seq") {
                    None | Some(Value::Null) => None,
                    Some(v) => Some(v.as_u64().ok_or_else(|| {
                        invalid("last_seq must be a non-negative integer".into())
                    })?),
                };
                Ok(Self::Attach(AttachSession {
                    session_id,
                    session_token,
                    surface_context: ctx_value.map(|v| SurfaceContext::from_value(&v)),
                    last_seq,
                }))
            }
            "DETACH" => Ok(Self::Detach),
            "PONG" => Ok(Self::Pong),
            "ACK" => {
                let seq = obj
                    .get("seq")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| invalid("seq must be a non-negative integer".into()))?;
                Ok(Self::Ack { seq })
            }
            "TOOL_RESULT" => {
                let call_id = match obj.get("call_id") {
                    Some(Value::String(s)) => s.clone(),
                    _ => return Err(invalid("call_id must be a string".into())),
                };
                let error = match obj.get("error") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(other) => Some(other.to_string()),
                };
                Ok(Self::ToolResult(ToolResult {
                    call_id,
                    result: obj.remove("result").filter(|v| !v.is_null()),
                    error,
                }))
            }
            _ => Ok(Self::Unknown { frame_type }),
        }
    }

    pub fn type_name(&self) -> &str {
        match self {
            Self::Attach(_) => "ATTACH_SESSION",
            Self::Detach => "DETACH",
            Self::ToolResult(_) => "TOOL_RESULT",
            Self::Pong => "PONG",
            Self::Ack { .. } => "ACK",
            Self::Unknown { frame_type } => frame_type,
        }
    }
}

/// A frame from the gateway.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum ServerFrame {
    #[serde(rename = "SESSION_ATTACHED")]
    SessionAttached(Box<SessionAttached>),
    #[serde(rename = "SESSION_NOT_FOUND")]
    SessionNotFound {
        detail: String,
        /// The session that was not found (the reference client names it in its error).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        session_id: Option<String>,
    },
    #[serde(rename = "FORBIDDEN")]
    Forbidden { detail: String },
    #[serde(rename = "PROTOCOL_ERROR")]
    ProtocolError { detail: String },
    #[serde(rename = "TETHER_TURN")]
    TetherTurn(TetherTurn),
    #[serde(rename = "TURN_CHUNK")]
    TurnChunk(TurnChunk),
    #[serde(rename = "TURN_COMPLETE")]
    TurnComplete(TurnComplete),
    #[serde(rename = "TOOL_CALL")]
    ToolCall(ToolCall),
    #[serde(rename = "PING")]
    Ping,
    /// A type this client does not know (forward compatibility).
    #[serde(other)]
    Unknown,
}

impl ServerFrame {
    /// The frame's `type`, as sent.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::SessionAttached(_) => "SESSION_ATTACHED",
            Self::SessionNotFound { .. } => "SESSION_NOT_FOUND",
            Self::Forbidden { .. } => "FORBIDDEN",
            Self::ProtocolError { .. } => "PROTOCOL_ERROR",
            Self::TetherTurn(_) => "TETHER_TURN",
            Self::TurnChunk(_) => "TURN_CHUNK",
            Self::TurnComplete(_) => "TURN_COMPLETE",
            Self::ToolCall(_) => "TOOL_CALL",
            Self::Ping => "PING",
            Self::Unknown => "UNKNOWN",
        }
    }

    /// Serialises the frame to its JSON text.
    pub fn to_json(&self) -> String {
        // Serialising these plain structs (string keys, no non-finite floats) cannot fail.
        serde_json::to_string(self).unwrap_or_else(|_| String::from("{\"type\":\"PING\"}"))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionAttached {
    pub session_id: String,
    pub surface_id: Option<String>,
    pub device_type: String,
    /// Tether turns about to be delivered (the spec's name).
    #[serde(default)]
    pub queued_turns: u64,
    /// The same count under the seeds' L2 name (absent from gateways that only send the spec's).
    #[serde(default)]
    pub tether_turns_pending: u64,
    #[serde(default)]
    pub mcp_tools_registered: Vec<String>,
    #[serde(default)]
    pub sbp_version: String,
    #[serde(default)]
    pub sbp_level: String,
    /// The stored SurfaceContext, echoed back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub surface_context: Option<SurfaceContext>,
    /// Protocol extensions this gateway supports (docs/PROTOCOL-EXTENSIONS.md).
    #[serde(default)]
    pub extensions: Vec<String>,
    /// The attach's `last_seq` was beyond every seq this session ever issued (the surface's
    /// position comes from another history): it was ignored, nothing was acknowledged, and the
    /// drain starts at the oldest pending turn. Sent only when true.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub last_seq_reset: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TetherTurn {
    /// Zero-based position in this drain.
    pub turn_index: u64,
    pub role: String,
    pub content: Option<String>,
    pub model_used: Option<String>,
    pub created_at: String,
    /// Extension: the turn's per-session monotonic sequence number, for ACK and `last_seq`
    /// (0 from gateways without it).
    #[serde(default)]
    pub seq: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Extension: the `chunk_id` its live TURN_CHUNKs carried, so a client that saw part of the
    /// turn stream can replace that partial text with this whole turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_id: Option<String>,
    /// The same role, content and model nested, where the reference client reads them
    /// (`turn.content`); `with_aliases` fills it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<TurnBody>,
}

/// A tethered turn's role, content and model, as TETHER_TURN's `turn` repeats them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnBody {
    pub role: String,
    pub content: Option<String>,
    pub model_used: Option<String>,
}

impl TetherTurn {
    /// Fills `turn` from the flat fields: call it on what is sent, after any change to them.
    pub fn with_aliases(mut self) -> Self {
        self.fill_aliases();
        self
    }

    /// Replaces the content (an adaptation for the surface), keeping `turn` in step.
    pub fn set_content(&mut self, content: String) {
        self.content = Some(content);
        self.fill_aliases();
    }

    fn fill_aliases(&mut self) {
        self.turn = Some(TurnBody {
            role: self.role.clone(),
            content: self.content.clone(),
            model_used: self.model_used.clone(),
        });
    }
}

/// A streamed piece of a turn. Besides the spec's `chunk_id` and `delta`, the gateway sends the
/// fields the reference client reads: the delta again as `chunk`, the session, the step and the
/// model (extension, docs/PROTOCOL-EXTENSIONS.md); a client must not require them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnChunk {
    pub chunk_id: String,
    pub delta: String,
    /// `delta` again, under the reference client's name; `with_aliases` fills it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The session's step this turn is (its `step_count` once the turn is committed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// The model writing the turn, as far as the gateway knows it yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl TurnChunk {
    /// A chunk of `delta`, with `chunk` filled.
    pub fn new(chunk_id: String, delta: String) -> Self {
        Self {
            chunk_id,
            delta,
            chunk: None,
            session_id: None,
            step: None,
            model: None,
        }
        .with_aliases()
    }

    /// Fills `chunk` from `delta`.
    pub fn with_aliases(mut self) -> Self {
        self.chunk = Some(self.delta.clone());
        self
    }
}

/// The end of a streamed turn. Besides the spec's `chunk_id`, the fields the reference client
/// reads (extension, docs/PROTOCOL-EXTENSIONS.md): the session, the step, the model (`model_used`
/// again, as `model`) and the turn's cost; a client must not require them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnComplete {
    pub chunk_id: String,
    /// Extension: the tether `seq` of the completed turn, when it has one (ACK it like a TETHER_TURN).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_used: Option<String>,
    /// `model_used` again, under the reference client's name; `with_aliases` fills it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The session's step this turn completed (its `step_count` after it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// The turn's cost in USD (SPEC 6.2's `cost_usd`), always sent: `null` when unknown (a local
    /// model, or a gateway that does not price turns, like this one).
    #[serde(default)]
    pub cost_usd: Option<f64>,
}

impl TurnComplete {
    /// The end of turn `chunk_id`, with `model` filled from `model_used`.
    pub fn new(chunk_id: String, seq: Option<u64>, model_used: Option<String>) -> Self {
        Self {
            chunk_id,
            seq,
            model_used,
            model: None,
            session_id: None,
            step: None,
            cost_usd: None,
        }
        .with_aliases()
    }

    /// Fills `model` from `model_used`.
    pub fn with_aliases(mut self) -> Self {
        self.model.clone_from(&self.model_used);
        self
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub call_id: String,
    pub tool_name: String,
    pub tool_input: Value,
    /// Extension: how long the gateway waits for the TOOL_RESULT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// Builds a JSON object from pairs; a helper for tests and clients.
pub fn object(pairs: impl IntoIterator<Item = (&'static str, Value)>) -> Value {
    Value::Object(
        pairs
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect::<Map<_, _>>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parse_errors_are_classified() {
        type Check = fn(&FrameError) -> bool;
        let cases: &[(&str, Check)] = &[
            ("not json", |e| matches!(e, FrameError::NotJson(_))),
            ("[1,2]", |e| matches!(e, FrameError::NotObject)),
            ("\"PONG\"", |e| matches!(e, FrameError::NotObject)),
            ("{}", |e| matches!(e, FrameError::MissingType)),
            ("{\"type\": 5}", |e| matches!(e, FrameError::MissingType)),
            ("{\"type\":\"ATTACH_SESSION\"}", |e| {
                matches!(e, FrameError::Invalid { .. })
            }),
            ("{\"type\":\"ACK\",\"seq\":-1}", |e| {
                matches!(e, FrameError::Invalid { .. })
            }),
            ("{\"type\":\"TOOL_RESULT\"}", |e| {
                matches!(e, FrameError::Invalid { .. })
            }),
        ];
        for (text, check) in cases {
            let err = ClientFrame::parse(text).expect_err(text);
            assert!(check(&err), "{text}: {err:?}");
        }
    }

    #[test]
    fn attach_accepts_both_context_names_and_null() {
        let base = json!({"type": "ATTACH_SESSION", "session_id": "s", "session_token": "t"});
        let with = |key: &str, ctx: Value| {
            let mut v = base.clone();
            v[key] = ctx;
            match ClientFrame::from_value(v).expect("parses") {
                ClientFrame::Attach(a) => a,
                other => panic!("unexpected {other:?}"),
            }
        };
        let a = with("surface_context", json!({"device_type": "iot"}));
        assert_eq!(
            a.surface_context.expect("ctx").device_type.as_deref(),
            Some("iot")
        );
        let a = with("surface", json!({"device_type": "voice"}));
        assert_eq!(
            a.surface_context.expect("ctx").device_type.as_deref(),
            Some("voice")
        );
        assert_eq!(with("surface", Value::Null).surface_context, None);
        let a = with("last_seq", json!(7));
        assert_eq!(a.last_seq, Some(7));
        assert_eq!(a.session_token, "t");
    }

    #[test]
    fn unknown_types_are_explicit() {
        let f = ClientFrame::parse("{\"type\":\"HELLO_FROM_THE_FUTURE\",\"x\":1}").expect("parses");
        assert_eq!(
            f,
            ClientFrame::Unknown {
                frame_type: "HELLO_FROM_THE_FUTURE".into()
            }
        );
        let s: ServerFrame = serde_json::from_str("{\"type\":\"NEW_THING\"}").expect("parses");
        assert_eq!(s, ServerFrame::Unknown);
    }

    #[test]
    fn tool_result_error_is_text() {
        let f = ClientFrame::parse(
            "{\"type\":\"TOOL_RESULT\",\"call_id\":\"c\",\"result\":null,\"error\":{\"m\":1}}",
        )
        .expect("parses");
        assert_eq!(
            f,
            ClientFrame::ToolResult(ToolResult {
                call_id: "c".into(),
                result: None,
                error: Some("{\"m\":1}".into())
            })
        );
    }

    #[test]
    fn server_frames_use_spec_names() {
        let cases = [
            (ServerFrame::Ping, json!({"type": "PING"})),
            (
                ServerFrame::ProtocolError { detail: "d".into() },
                json!({"type": "PROTOCOL_ERROR", "detail": "d"}),
            ),
            (
                ServerFrame::TurnChunk(TurnChunk::new("c".into(), "x".into())),
                json!({"type": "TURN_CHUNK", "chunk_id": "c", "delta": "x", "chunk": "x"}),
            ),
            (
                ServerFrame::TurnComplete(TurnComplete::new("c".into(), None, None)),
                json!({"type": "TURN_COMPLETE", "chunk_id": "c", "cost_usd": null}),
            ),
            (
                ServerFrame::SessionNotFound {
                    detail: "d".into(),
                    session_id: Some("s".into()),
                },
                json!({"type": "SESSION_NOT_FOUND", "detail": "d", "session_id": "s"}),
            ),
        ];
        for (frame, expected) in cases {
            let text = frame.to_json();
            assert_eq!(frame.type_name(), expected["type"]);
            assert_eq!(serde_json::from_str::<Value>(&text).ok(), Some(expected));
            assert_eq!(serde_json::from_str::<ServerFrame>(&text).ok(), Some(frame));
        }
    }

    /// What the reference client reads beside the spec's fields: `turn.{role,content,model_used}`,
    /// `chunk`/`step`/`model`/`session_id`, `step`/`model`/`cost_usd`; each second name carries
    /// the same value as the first, also after the content is replaced.
    #[test]
    fn frames_carry_the_reference_clients_names_too() {
        let mut tether = TetherTurn {
            turn_index: 0,
            role: "assistant".into(),
            content: Some("raw **text**".into()),
            model_used: Some("m".into()),
            created_at: "2026-01-01T00:00:00Z".into(),
            seq: 3,
            session_id: Some("s".into()),
            chunk_id: None,
            turn: None,
        }
        .with_aliases();
        tether.set_content("raw text".into());
        let v = serde_json::to_value(ServerFrame::TetherTurn(tether)).expect("serialises");
        assert_eq!(v["content"], "raw text", "{v}");
        assert_eq!(
            v["turn"],
            json!({"role": "assistant", "content": "raw text", "model_used": "m"}),
            "{v}"
        );

        let chunk = TurnChunk {
            session_id: Some("s".into()),
            step: Some(2),
            model: Some("m".into()),
            ..TurnChunk::new("c".into(), "hi".into())
        };
        let v = serde_json::to_value(ServerFrame::TurnChunk(chunk)).expect("serialises");
        assert_eq!(
            v,
            json!({"type": "TURN_CHUNK", "chunk_id": "c", "delta": "hi", "chunk": "hi",
                   "session_id": "s", "step": 2, "model": "m"})
        );

        let done = TurnComplete {
            session_id: Some("s".into()),
            step: Some(2),
            cost_usd: Some(0.25),
            ..TurnComplete::new("c".into(), Some(9), Some("m".into()))
        };
        let v = serde_json::to_value(ServerFrame::TurnComplete(done)).expect("serialises");
        assert_eq!(
            v,
            json!({"type": "TURN_COMPLETE", "chunk_id": "c", "seq": 9, "model_used": "m",
                   "model": "m", "session_id": "s", "step": 2, "cost_usd": 0.25})
        );

        // A gateway that sends only the spec's fields still parses.
        let spec: ServerFrame =
            serde_json::from_value(json!({"type": "TURN_CHUNK", "chunk_id": "c", "delta": "x"}))
                .expect("parses");
        assert_eq!(
            spec,
            ServerFrame::TurnChunk(TurnChunk {
                chunk: None,
                ..TurnChunk::new("c".into(), "x".into())
            })
        );
    }
}
