//! The built-in offline model `sbp/echo`: deterministic, no network, so a fresh gateway answers turns
//! with nothing configured. It repeats the last user message, bounded by `max_tokens` (in words).

use async_trait::async_trait;
use futures::StreamExt;
use serde_json::{Map, Value, json};

use crate::{ChunkStream, Completion, LlmError, Provider, content_text};

pub const ECHO_MODEL: &str = "sbp/echo";

#[derive(Debug, Default, Clone)]
pub struct EchoProvider;

impl EchoProvider {
    fn reply(body: &Map<String, Value>) -> String {
        let messages = body.get("messages").and_then(Value::as_array);
        let last_user = messages
            .into_iter()
            .flatten()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
            .and_then(|m| m.get("content"))
            .and_then(content_text)
            .unwrap_or_default();
        let text = if last_user.trim().is_empty() {
            "Echo: (no user message)".to_owned()
        } else {
            format!("Echo: {last_user}")
        };
        let limit = body
            .get("max_tokens")
            .or_else(|| body.get("max_completion_tokens"))
            .and_then(Value::as_u64);
        match limit {
            Some(n) => text
                .split_inclusive(' ')
                .take(n as usize)
                .collect::<String>()
                .trim_end()
                .to_owned(),
            None => text,
        }
    }

    fn id() -> String {
        format!("chatcmpl-echo-{}", uuid::Uuid::new_v4().simple())
    }
}

fn usage(body: &Map<String, Value>, reply: &str) -> Value {
    let prompt_words: usize = body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("content").and_then(content_text))
        .map(|t| t.split_whitespace().count())
        .sum();
    let completion = reply.split_whitespace().count();
    json!({"prompt_tokens": prompt_words, "completion_tokens": completion, "total_tokens": prompt_words + completion})
}

#[async_trait]
impl Provider for EchoProvider {
    fn route_name(&self, _requested: &str) -> String {
        ECHO_MODEL.to_owned()
    }

    async fn complete(&self, body: Map<String, Value>) -> Result<Completion, LlmError> {
        let reply = Self::reply(&body);
        let response = json!({
            "id": Self::id(),
            "object": "chat.completion",
            "created": chrono::Utc::now().timestamp(),
            "model": ECHO_MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
            "usage": usage(&body, &reply),
        });
        Completion::from_body(response, ECHO_MODEL)
    }

    async fn stream(&self, body: Map<String, Value>) -> Result<ChunkStream, LlmError> {
        let reply = Self::reply(&body);
        let id = Self::id();
        let created = chrono::Utc::now().timestamp();
        let chunk = move |delta: Value, finish: Value| {
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": ECHO_MODEL,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        };
        let mut chunks = vec![chunk(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        )];
        chunks.extend(
            reply
                .split_inclusive(' ')
                .map(|w| chunk(json!({"content": w}), Value::Null)),
        );
        chunks.push(chunk(json!({}), json!("stop")));
        Ok(futures::stream::iter(chunks.into_iter().map(Ok)).boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Assembler;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[tokio::test]
    async fn echoes_the_last_user_message_deterministically() {
        let b = body(json!({"model": "gpt-4o", "messages": [
            {"role": "user", "content": "first"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]}));
        let c = EchoProvider.complete(b.clone()).await.expect("completes");
        assert_eq!(c.text(), Some("Echo: hello there"));
        assert_eq!(c.model, ECHO_MODEL);
        let mut s = EchoProvider.stream(b).await.expect("streams");
        let mut a = Assembler::default();
        while let Some(chunk) = s.next().await {
            a.push(&chunk.expect("chunk"));
        }
        assert_eq!(a.content(), "Echo: hello there");
        assert_eq!(a.finish_reason.as_deref(), Some("stop"));
    }

    #[tokio::test]
    async fn max_tokens_bounds_the_reply() {
        let b = body(
            json!({"max_tokens": 3, "messages": [{"role": "user", "content": "one two three four five"}]}),
        );
        let c = EchoProvider.complete(b).await.expect("completes");
        assert_eq!(c.text(), Some("Echo: one two"));
    }
}
