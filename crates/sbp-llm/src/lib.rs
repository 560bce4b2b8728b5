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
mod sse;
pub mod tool_names;
mod transport;

pub use anthropic::{ANTHROPIC_VERSION, AnthropicOptions, AnthropicProvider};
pub use assemble::Assembler;
pub use echo::{ECHO_MODEL, EchoProvider};
pub use openai::{OpenAiOptions, OpenAiProvider};
pub use router::{ModelMatch, Router};

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
pub use sbp_protocol::chat::content_text;
use sbp_protocol::{ChatMessage, ChatRequest};
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

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
    /// The response as an OpenAI `chat.completion` body: the upstream's own, parsed, for
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

    /// Checks a `chat.completion` body's bytes as [`Completion::from_body`] and the parse before
    /// it check them (JSON a [`Value`] could be built from, an object whose first choice has an
    /// object `message`), without building the tree: for a body relayed as it came.
    pub fn check_body(bytes: &[u8]) -> Result<(), LlmError> {
        type Fields<'a> = HashMap<Cow<'a, str>, &'a RawValue>;
        serde_json::from_slice::<Checked>(bytes).map_err(transport::not_json)?;
        // Valid JSON from here: what does not parse as wanted is only of another shape.
        let first = serde_json::from_slice::<Fields<'_>>(bytes)
            .ok()
            .and_then(|body| {
                let choices = body.get("choices")?;
                serde_json::from_str::<Vec<&RawValue>>(choices.get()).ok()
            })
            .and_then(|c| c.first().copied())
            .ok_or_else(|| LlmError::Protocol("response has no choices".into()))?;
        serde_json::from_str::<Fields<'_>>(first.get())
            .ok()
            .and_then(|choice| choice.get("message").copied())
            .filter(|m| m.get().starts_with('{'))
            .map(|_| ())
            .ok_or_else(|| LlmError::Protocol("choice has no message".into()))
    }

    /// The message text, when the content is a string.
    pub fn text(&self) -> Option<&str> {
        self.message.content().and_then(Value::as_str)
    }
}

/// One streamed chunk: the raw OpenAI `chat.completion.chunk` object.
pub type ChunkStream = BoxStream<'static, Result<Value, LlmError>>;

/// Any JSON value, dropped once it has passed the checks building a [`Value`] makes (numbers in
/// range, strings without a lone surrogate, serde_json's depth limit), which skipping a value
/// does not.
struct Checked;

impl<'de> Deserialize<'de> for Checked {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Checked)
    }
}

impl<'de> Visitor<'de> for Checked {
    type Value = Checked;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_str<E>(self, _: &str) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_unit<E>(self) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Checked, A::Error> {
        while seq.next_element::<Checked>()?.is_some() {}
        Ok(Checked)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Checked, A::Error> {
        while map.next_key::<Key>()?.is_some() {
            map.next_value::<Checked>()?;
        }
        Ok(Checked)
    }
}

/// An object key, refused when it is one serde_json gives a meaning of its own when it builds a
/// tree (its `raw_value` feature): a body using one is not relayed as if it were plain.
struct Key;

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(Key)
    }
}

impl<'de> Visitor<'de> for Key {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Key, E> {
        match s.starts_with("$serde_json::private::") {
            true => Err(E::custom("a serde_json token in the body")),
            false => Ok(Key),
        }
    }
}

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
    /// A whole completion as the JSON bytes to relay, for the strict proxy hop that hands the
    /// client the upstream's own answer: an OpenAI-compatible upstream's body as it came (its key
    /// order and number spellings kept, nothing parsed into a tree and written again), checked as
    /// [`Completion::from_body`] checks it. A provider that translates gives its translation.
    async fn complete_bytes(&self, request: ChatRequest) -> Result<Bytes, LlmError> {
        let completion = self.complete(request).await?;
        // Cannot fail: a `Value`'s keys are strings.
        serde_json::to_vec(&completion.body)
            .map(Bytes::from)
            .map_err(|e| LlmError::Protocol(format!("completion not serialisable: {e}")))
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes check accepts exactly the bodies the tree check accepts.
    #[test]
    fn a_body_relayed_as_bytes_is_checked_as_its_tree_would_be() {
        let bodies = [
            (
                r#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}"#,
                true,
            ),
            (r#"{"choices":[{"message":{}}],"choices2":1}"#, true),
            (r#"{"choices":[{"message":{"content":"a"}},7]}"#, true),
            (
                r#"{"choices":[{"message":{"content":"\u00e9\"q"}, "fin\u0069sh_reason": "stop"}]}"#,
                true,
            ),
            (
                r#" {"choices" : [ {"message" : {"content":"spaced"}} ] } "#,
                true,
            ),
            (r#"{"choices":[{"message":null}]}"#, false),
            (r#"{"choices":[{"message":"text"}]}"#, false),
            (r#"{"choices":[{"message":[]}]}"#, false),
            (r#"{"choices":[{}]}"#, false),
            (r#"{"choices":[7]}"#, false),
            (r#"{"choices":[]}"#, false),
            (r#"{"choices":{"0":{"message":{}}}}"#, false),
            (r#"{"choices":null}"#, false),
            (r#"{"error":{"message":"no"}}"#, false),
            (r#"[{"message":{}}]"#, false),
            (r#""text""#, false),
            (r#"{"choices":[{"message":{}}]} trailing"#, false),
            (r#"{"choices":[{"message":{}}]"#, false),
            (r#"{"choices":[{"message":{"content":"bad \x"}}]}"#, false),
            ("", false),
            // Duplicate keys: the tree keeps the last one.
            (r#"{"choices":[{"message":{}}],"choices":null}"#, false),
            (r#"{"choices":null,"choices":[{"message":{}}]}"#, true),
            (r#"{"choices":[{"message":{},"message":5}]}"#, false),
            (r#"{"choices":[{"message":5,"message":{}}]}"#, true),
            // serde_json's token is refused as a key, and is plain text as a value.
            (
                r#"{"$serde_json::private::RawValue":"{}","choices":[{"message":{}}]}"#,
                false,
            ),
            (
                r#"{"choices":[{"message":{"content":"$serde_json::private::RawValue"}}]}"#,
                true,
            ),
            // Escaped keys are the keys they spell.
            (r#"{"choic\u0065s":[{"m\u0065ssage":{}}]}"#, true),
            // What skipping a value would let through and building a tree does not.
            (r#"{"choices":[{"message":{}}],"usage":{"x":1e400}}"#, false),
            (r#"{"choices":[{"message":{"content":"\ud800"}}]}"#, false),
            (r#"{"choices":[{"message":{}}],"x":"\udc00 alone"}"#, false),
        ];
        let deep = format!(
            r#"{{"choices":[{{"message":{{}}}}],"x":{}1{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        let big = format!(
            r#"{{"choices":[{{"message":{{}}}}],"n":1{}}}"#,
            "0".repeat(400)
        );
        let bodies = bodies
            .iter()
            .map(|(b, ok)| (b.to_string(), *ok))
            .chain([(deep, false), (big, false)]);
        for (body, ok) in bodies {
            let tree = serde_json::from_str::<Value>(&body)
                .map_err(|e| LlmError::Protocol(format!("response is not JSON: {e}")))
                .and_then(|v| Completion::from_body(v, "m"));
            assert_eq!(tree.is_ok(), ok, "the tree check on {body}");
            let bytes = Completion::check_body(body.as_bytes());
            assert_eq!(bytes.is_ok(), ok, "{body}");
            if let (Err(LlmError::Protocol(tree)), Err(LlmError::Protocol(bytes))) = (tree, bytes) {
                let kind = |m: &str| m.split(':').next().unwrap_or_default().to_owned();
                assert_eq!(kind(&tree), kind(&bytes), "the same failure: {body}");
            }
        }
    }
}
