//! Upstream LLM providers. A provider takes a typed OpenAI-format request ([`ChatRequest`], parsed
//! once at the gateway's edge) and returns either a whole completion or a stream of OpenAI-format
//! chunks; `Assembler` folds chunks into the final message.
//! The OpenAI chat-completions format is the gateway's lingua franca: providers for other APIs
//! translate both ways at their edge, so nothing above them sees another format.
//!
//! Providers: any OpenAI-compatible HTTP endpoint (`OpenAiProvider`), Anthropic's Messages API
//! (`AnthropicProvider`), and the built-in offline `sbp/echo` (`EchoProvider`). `Router` is a
//! provider too: it picks one of the others by model-name prefix (`claude` → Anthropic, the rest
//! to a default). The HTTP providers share one transport (timeouts, error statuses, SSE reading).
//! `tool_names` holds the gateway's naming of the functions it offers (shared with `sbp/echo`).

mod anthropic;
mod assemble;
mod echo;
mod openai;
mod router;
pub mod tool_names;
mod transport;

pub use anthropic::{ANTHROPIC_VERSION, AnthropicOptions, AnthropicProvider};
pub use assemble::Assembler;
pub use echo::{ECHO_MODEL, EchoProvider};
pub use openai::{OpenAiOptions, OpenAiProvider};
pub use router::{ModelMatch, Router};

use async_trait::async_trait;
use futures::stream::BoxStream;
pub use sbp_protocol::chat::content_text;
use sbp_protocol::{ChatMessage, ChatRequest};
use serde_json::Value;

/// An upstream failure, classified the way the gateway reports it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LlmError {
    #[error("upstream unreachable: {0}")]
    Unreachable(String),
    #[error("upstream timed out")]
    Timeout,
    /// The upstream answered with an error status; `body` is its error body (JSON, or text as a string).
    #[error("upstream returned HTTP {status}")]
    Status { status: u16, body: Value },
    #[error("upstream protocol error: {0}")]
    Protocol(String),
}

/// A whole (non-streamed) completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The response as an OpenAI `chat.completion` body: the upstream's own, untouched, for
    /// OpenAI-compatible upstreams; the translation for others.
    pub body: Value,
    /// The assistant message (`role`, `content`, `tool_calls`, ...).
    pub message: ChatMessage,
    pub model: String,
    pub finish_reason: Option<String>,
}

impl Completion {
    /// Builds the completion from an OpenAI `chat.completion` body.
    pub fn from_body(body: Value, requested_model: &str) -> Result<Self, LlmError> {
        let choice = body
            .get("choices")
            .and_then(|c| c.get(0))
            .ok_or_else(|| LlmError::Protocol("response has no choices".into()))?;
        let message = choice
            .get("message")
            .filter(|m| m.is_object())
            .cloned()
            .ok_or_else(|| LlmError::Protocol("choice has no message".into()))?;
        let finish_reason = choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let model = body
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or(requested_model)
            .to_owned();
        Ok(Self {
            body,
            message: ChatMessage::from_value(message),
            model,
            finish_reason,
        })
    }

    /// The message text, when the content is a string.
    pub fn text(&self) -> Option<&str> {
        self.message.content().and_then(Value::as_str)
    }
}

/// One streamed chunk: the raw OpenAI `chat.completion.chunk` object.
pub type ChunkStream = BoxStream<'static, Result<Value, LlmError>>;

#[async_trait]
pub trait Provider: Send + Sync {
    /// The model name reported as `model_routed_to` when the provider does not say otherwise.
    fn route_name(&self, requested: &str) -> String;
    /// The kind of upstream `requested` goes to (`openai` for any OpenAI-compatible endpoint,
    /// `anthropic`, `echo`), a closed set for metrics and logs.
    fn provider_name(&self, _requested: &str) -> &'static str {
        "other"
    }
    /// A whole completion of `request` (its `stream` and `sbp` are not sent).
    async fn complete(&self, request: ChatRequest) -> Result<Completion, LlmError>;
    /// `request` answered as a stream of chunks (its `sbp` is not sent).
    async fn stream(&self, request: ChatRequest) -> Result<ChunkStream, LlmError>;
    /// The models it offers, as OpenAI's `GET /v1/models` lists them (`{"id", "object":
    /// "model", "created", "owned_by"}`); none known unless the provider says.
    async fn models(&self) -> Result<Vec<Value>, LlmError> {
        Ok(Vec::new())
    }
}

/// A request parsed from a JSON object, for tests; `messages` may be missing or empty (panics on
/// any other invalid field).
#[cfg(test)]
pub(crate) fn test_request(v: Value) -> ChatRequest {
    let Value::Object(mut body) = v else {
        panic!("not an object: {v}");
    };
    let placeholder = serde_json::json!([{"role": "user", "content": "x"}]);
    let messages = match body.insert("messages".into(), placeholder) {
        Some(Value::Array(list)) => list.into_iter().map(ChatMessage::from_value).collect(),
        _ => Vec::new(),
    };
    let mut req = ChatRequest::from_object(body).expect("a valid chat request");
    req.messages = messages;
    req
}
