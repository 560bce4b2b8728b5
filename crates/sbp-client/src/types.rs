//! Request and response bodies of the gateway's HTTP API. The REST bodies are the protocol crate's
//! ([`sbp_protocol::rest`], re-exported here under the names this SDK has always used): responses
//! type the fields a client acts on and keep everything else in `extra`, so a gateway that adds
//! fields (or another SBP gateway that names a few differently) still parses. The completion
//! request and its outcomes are this SDK's own.

pub use sbp_protocol::rest::{
    Delivery, Export, ExportImport, ExportInfo, ExportList, ExportRequest, ForkInfo, ForkLink,
    ForkOrigin, ForkRequest, HandoffInfo, HandoffRequest, Health, ImportInfo, ImportLink,
    ImportRequest, ImportedFrom, IncomingHandoff, Lineage, Memory, MemoryPut, MessagePage,
    MessagesQuery, NewSession, OutgoingHandoff, Provenance, PushTurn, PushedTurn, SessionCreated,
    SessionInfo, SetStatus, Snapshot, SnapshotInfo, SnapshotList, StatusChanged, StoredMessage,
    ToolCallOutcome, ToolCallRequest, ToolCallStatus,
};
use sbp_protocol::{SbpRequestOptions, SbpResponseMeta};
use serde_json::{Map, Value, json};

use crate::rest::SessionClient;

/// A new session and the typed body that created it (import, fork, handoff).
#[derive(Debug, Clone)]
pub struct Created<T> {
    /// A client for the new session, holding its token.
    pub session: SessionClient,
    pub info: T,
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

    /// The body as the protocol's typed request writes it: the typed fields win over `extra`'s.
    pub(crate) fn body(&self) -> sbp_protocol::ChatRequest {
        let sbp = (self.sbp != SbpRequestOptions::default()).then(|| self.sbp.clone());
        let mut rest = self.extra.clone();
        rest.remove("messages");
        if self.model.is_some() {
            rest.remove("model");
        }
        if sbp.is_some() {
            rest.remove("sbp");
        }
        sbp_protocol::ChatRequest {
            model: self.model.clone(),
            messages: self
                .messages
                .iter()
                .cloned()
                .map(sbp_protocol::ChatMessage::from_value)
                .collect(),
            sbp,
            rest,
            ..sbp_protocol::ChatRequest::default()
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_body_sends_sbp_only_when_set() {
        let plain = serde_json::to_value(ChatRequest::user("hi").body()).expect("serialises");
        assert_eq!(
            plain,
            json!({"messages": [{"role": "user", "content": "hi"}]})
        );
        let resumed = serde_json::to_value(
            ChatRequest::user("hi")
                .model("m")
                .resume()
                .field("max_tokens", json!(5))
                .body(),
        )
        .expect("serialises");
        assert_eq!(resumed["sbp"]["resume"], json!(true));
        // A typed field wins over the same key given with `field` (and is sent once).
        let text = serde_json::to_string(
            &ChatRequest::user("hi")
                .model("a")
                .field("model", json!("b"))
                .body(),
        )
        .expect("serialises");
        assert_eq!(text.matches("\"model\"").count(), 1, "{text}");
        assert!(text.contains("\"model\":\"a\""), "{text}");
        assert_eq!(resumed["model"], json!("m"));
        assert_eq!(resumed["max_tokens"], json!(5));
    }
}
