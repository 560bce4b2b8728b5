//! Request and response bodies of the gateway's HTTP API. Responses type the fields a client acts
//! on and keep everything else in `extra`, so a gateway that adds fields (or another SBP gateway that
//! names a few differently) still parses.

use sbp_protocol::{SbpRequestOptions, SbpResponseMeta, SessionStatus, SurfaceContext};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value, json};

use crate::rest::SessionClient;

/// A new session and the typed body that created it (import, fork, handoff).
#[derive(Debug, Clone)]
pub struct Created<T> {
    /// A client for the new session, holding its token.
    pub session: SessionClient,
    pub info: T,
}

/// `POST /v1/sessions`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NewSession {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
}

/// The body of `POST /v1/sessions`.
#[derive(Debug, Clone, Deserialize)]
pub struct SessionCreated {
    pub session_id: String,
    pub session_token: String,
    #[serde(default)]
    pub agent_id: Option<String>,
    #[serde(default)]
    pub status: Option<SessionStatus>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `POST /v1/chat/completions`. Build one with [`ChatRequest::user`].
#[derive(Debug, Clone, Default)]
pub struct ChatRequest {
    /// The new messages (the gateway also accepts the whole conversation resent).
    pub messages: Vec<Value>,
    /// The model to route to; the gateway's default when `None`.
    pub model: Option<String>,
    /// The `sbp` namespace; sent only when it differs from the default.
    pub sbp: SbpRequestOptions,
    /// Sent as the `Idempotency-Key` header: a retry with the same key stores nothing twice.
    pub idempotency_key: Option<String>,
    /// Any other top-level fields (`tools`, `max_tokens`, ...), passed through.
    pub extra: Map<String, Value>,
}

impl ChatRequest {
    /// One user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self {
            messages: vec![json!({"role": "user", "content": text.into()})],
            ..Self::default()
        }
    }

    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// Resume the session if it is suspended (`sbp.resume: true`) instead of getting a 202.
    pub fn resume(mut self) -> Self {
        self.sbp.resume = true;
        self
    }

    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// Adds a top-level field of the completion request.
    pub fn field(mut self, key: impl Into<String>, value: Value) -> Self {
        self.extra.insert(key.into(), value);
        self
    }

    pub(crate) fn body(&self) -> Value {
        let mut body = self.extra.clone();
        body.insert("messages".into(), Value::Array(self.messages.clone()));
        if let Some(m) = &self.model {
            body.insert("model".into(), Value::String(m.clone()));
        }
        if self.sbp != SbpRequestOptions::default() {
            // Plain strings, bools and maps: serialising them cannot fail.
            if let Ok(v) = serde_json::to_value(&self.sbp) {
                body.insert("sbp".into(), v);
            }
        }
        Value::Object(body)
    }
}

/// What a completion answered.
#[derive(Debug, Clone)]
pub enum ChatOutcome {
    /// 200: the assistant's reply.
    Reply(ChatReply),
    /// 202 (SPEC 6.3): the session is suspended; resend with [`ChatRequest::resume`] to continue it.
    ResumeAvailable(SbpResponseMeta),
}

/// A completed turn.
#[derive(Debug, Clone)]
pub struct ChatReply {
    /// `choices[0].message.content` (empty when the model answered only with tool calls).
    pub text: String,
    pub finish_reason: Option<String>,
    /// The `sbp` block: session id, step count, routed model, ...
    pub meta: SbpResponseMeta,
    /// The whole response body (the client's own `tool_calls`, `usage`, ...).
    pub body: Value,
}

/// `GET /v1/sessions/{id}`.
#[derive(Debug, Clone, Deserialize)]
pub struct SessionInfo {
    pub session_id: String,
    #[serde(default)]
    pub agent_id: Option<String>,
    pub status: SessionStatus,
    #[serde(default)]
    pub step_count: u64,
    #[serde(default)]
    pub message_count: u64,
    #[serde(default)]
    pub surface_attached: bool,
    /// The attached surface's context, when one is attached.
    #[serde(default, deserialize_with = "lenient_surface")]
    pub surface: Option<SurfaceContext>,
    /// Tether turns waiting for a surface.
    #[serde(default)]
    pub tether_turns_pending: u64,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One page of `GET /v1/sessions/{id}/messages`.
#[derive(Debug, Clone, Deserialize)]
pub struct MessagePage {
    pub messages: Vec<StoredMessage>,
    #[serde(default)]
    pub has_more: bool,
    /// Pass as `after` to get the next page.
    #[serde(default)]
    pub next_after: Option<u64>,
    #[serde(default)]
    pub message_count: u64,
}

/// A message of the stored transcript.
#[derive(Debug, Clone, Deserialize)]
pub struct StoredMessage {
    pub role: String,
    /// A string, an array of content parts, or null (a tool-call message).
    #[serde(default)]
    pub content: Value,
    #[serde(default)]
    pub seq: Option<u64>,
    #[serde(default)]
    pub model_used: Option<String>,
    #[serde(default)]
    pub created_at: Option<String>,
    /// `tool_calls`, `tool_call_id`, `name`, `cost_usd`, ...
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl StoredMessage {
    /// The content when it is plain text.
    pub fn text(&self) -> Option<&str> {
        self.content.as_str()
    }
}

/// `POST /v1/sbp/sessions/{id}/turns`: a turn pushed by a backend.
#[derive(Debug, Clone, Serialize)]
pub struct PushTurn {
    pub content: String,
    /// `assistant` (the default), `user`, `tool` or `system`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_used: Option<String>,
}

impl PushTurn {
    /// An assistant turn.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            role: None,
            model_used: None,
        }
    }
}

/// How a pushed turn was delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Delivery {
    /// Streamed to the attached surface (and tethered until acknowledged).
    Live,
    /// No surface attached: waiting in the tether.
    Tethered,
    #[serde(other)]
    Other,
}

#[derive(Debug, Clone, Deserialize)]
pub struct PushedTurn {
    pub session_id: String,
    /// The turn's tether seq (what TETHER_TURN / TURN_COMPLETE will carry).
    pub seq: u64,
    pub delivery: Delivery,
}

/// `POST /v1/sbp/sessions/{id}/tool_calls`: call a tool of the attached surface from a backend.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallRequest {
    pub tool_name: String,
    pub tool_input: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolCallStatus {
    Ok,
    /// The surface answered with an error.
    Error,
    Timeout,
    /// The surface went away while the call was in flight.
    Disconnected,
    #[serde(other)]
    Other,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ToolCallOutcome {
    pub call_id: String,
    pub tool_name: String,
    pub status: ToolCallStatus,
    #[serde(default)]
    pub result: Value,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub duration_ms: f64,
}

/// `POST /v1/sbp/sessions/{id}/export`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ExportRequest {
    /// 60 to 604800; the gateway's default when `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Return the sealed bundle too, for a gateway that does not share this one's secret.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub include_bundle: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Export {
    pub export_id: String,
    pub roaming_token: String,
    pub bundle_cid: String,
    #[serde(default)]
    pub expires_at: Option<String>,
    #[serde(default)]
    pub message_count: Option<u64>,
    #[serde(default)]
    pub label: Option<String>,
    #[serde(default)]
    pub bundle: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `POST /v1/sbp/sessions/import`: a roaming token, a raw bundle, or both.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ImportRequest {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub roaming_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bundle: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_agent_id: Option<String>,
    /// Do not consume the token: the import is a fork.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub allow_reuse: bool,
}

impl ImportRequest {
    pub fn token(roaming_token: impl Into<String>) -> Self {
        Self {
            roaming_token: Some(roaming_token.into()),
            ..Self::default()
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ImportInfo {
    pub session_id: String,
    pub session_token: String,
    #[serde(default)]
    pub agent_id: Option<String>,
    #[serde(default)]
    pub messages_restored: u64,
    #[serde(default)]
    pub memory_restored: bool,
    #[serde(default)]
    pub snapshot_restored: bool,
    #[serde(default)]
    pub bundle_cid: Option<String>,
    #[serde(default)]
    pub source_session_id: Option<String>,
    #[serde(default)]
    pub export_id: Option<String>,
    #[serde(default)]
    pub forked: bool,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// An export as `GET /v1/sbp/token/{token}` and the lineage describe it.
#[derive(Debug, Clone, Deserialize)]
pub struct ExportInfo {
    pub export_id: String,
    pub session_id: String,
    #[serde(default)]
    pub label: Option<String>,
    #[serde(default)]
    pub bundle_cid: Option<String>,
    #[serde(default)]
    pub message_count: Option<u64>,
    #[serde(default)]
    pub expires_at: Option<String>,
    #[serde(default)]
    pub expired: bool,
    #[serde(default)]
    pub consumed: bool,
    #[serde(default)]
    pub import_session_id: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `POST /v1/sbp/sessions/{id}/fork`.
#[derive(Debug, Clone, Deserialize)]
pub struct ForkInfo {
    pub fork_id: String,
    pub session_id: String,
    pub session_token: String,
    #[serde(default)]
    pub label: Option<String>,
    #[serde(default)]
    pub origin_session_id: Option<String>,
    #[serde(default)]
    pub fork_point_msg: Option<u64>,
    #[serde(default)]
    pub message_count: Option<u64>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `POST /v1/sbp/sessions/{id}/handoff`.
#[derive(Debug, Clone, Serialize)]
pub struct HandoffRequest {
    pub to_agent_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handoff_message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl HandoffRequest {
    pub fn to(agent_id: impl Into<String>) -> Self {
        Self {
            to_agent_id: agent_id.into(),
            handoff_message: None,
            reason: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct HandoffInfo {
    #[serde(default)]
    pub handoff_id: Option<String>,
    /// The new session (the other agent's).
    pub session_id: String,
    pub session_token: String,
    #[serde(default)]
    pub source_session_id: Option<String>,
    /// The source's status after the handoff (`suspended`).
    #[serde(default)]
    pub source_status: Option<SessionStatus>,
    #[serde(default)]
    pub to_agent_id: Option<String>,
    #[serde(default)]
    pub export_id: Option<String>,
    #[serde(default)]
    pub bundle_cid: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `GET /v1/sbp/sessions/{id}/lineage`: the session's family tree.
#[derive(Debug, Clone, Deserialize)]
pub struct Lineage {
    pub session_id: String,
    #[serde(default)]
    pub exports: Vec<ExportInfo>,
    #[serde(default)]
    pub forks: Vec<ForkLink>,
    #[serde(default)]
    pub outgoing_handoffs: Vec<Value>,
    #[serde(default)]
    pub incoming_handoffs: Vec<Value>,
    /// Where this session was forked from (fork, or an import with `allow_reuse`).
    #[serde(default)]
    pub origin: Option<Value>,
    /// The session this one was imported from (a consuming import).
    #[serde(default)]
    pub imported_from: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A fork of the session in its lineage.
#[derive(Debug, Clone, Deserialize)]
pub struct ForkLink {
    #[serde(default)]
    pub fork_id: Option<String>,
    pub fork_session_id: String,
    #[serde(default)]
    pub fork_label: Option<String>,
    /// `fork` (the fork endpoint) or `import` (an import with `allow_reuse`).
    #[serde(default)]
    pub via: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A SurfaceContext as the gateway echoes it, parsed with the protocol crate's lenient parser.
fn lenient_surface<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SurfaceContext>, D::Error> {
    let v = Option::<Value>::deserialize(d)?;
    Ok(v.filter(|v| !v.is_null())
        .map(|v| SurfaceContext::from_value(&v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_body_sends_sbp_only_when_set() {
        let plain = ChatRequest::user("hi").body();
        assert_eq!(
            plain,
            json!({"messages": [{"role": "user", "content": "hi"}]})
        );
        let resumed = ChatRequest::user("hi")
            .model("m")
            .resume()
            .field("max_tokens", json!(5))
            .body();
        assert_eq!(resumed["sbp"]["resume"], json!(true));
        assert_eq!(resumed["model"], json!("m"));
        assert_eq!(resumed["max_tokens"], json!(5));
    }

    #[test]
    fn optional_request_fields_are_left_out() {
        let cases = [
            (serde_json::to_value(ExportRequest::default()), json!({})),
            (
                serde_json::to_value(ImportRequest::token("t")),
                json!({"roaming_token": "t"}),
            ),
            (
                serde_json::to_value(PushTurn::assistant("x")),
                json!({"content": "x"}),
            ),
            (
                serde_json::to_value(ToolCallRequest::new("gps", json!({})).timeout_ms(5)),
                json!({"tool_name": "gps", "tool_input": {}, "timeout_ms": 5}),
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got.expect("serialises"), want);
        }
    }

    #[test]
    fn unknown_enum_values_and_fields_parse() {
        let pushed: PushedTurn =
            serde_json::from_value(json!({"session_id": "s", "seq": 3, "delivery": "queued"}))
                .expect("parses");
        assert_eq!(pushed.delivery, Delivery::Other);
        let info: SessionInfo = serde_json::from_value(json!({
            "session_id": "s", "status": "running", "surface": {"device_type": 5, "x": 1},
            "something_new": true
        }))
        .expect("parses");
        let surface = info.surface.expect("surface");
        assert_eq!(
            surface.device_type, None,
            "a wrong type is dropped, not fatal"
        );
        assert_eq!(info.extra["something_new"], json!(true));
    }
}
