//! OpenAI `chat.completion` bodies and `chat.completion.chunk`s as the gateway edits them for the
//! HTTP caller, as pure functions: what the agent loop hides from streamed chunks, the closing
//! chunks it adds, a whole body assembled from a stream, and usage summed over a turn's rounds.

use chrono::Utc;
use sbp_llm::Assembler;
use sbp_protocol::ChatMessage;
use serde_json::{Map, Value, json};
use uuid::Uuid;

/// Removes what belongs to the tool loop from a chunk for the SSE caller: tool-call deltas,
/// finish reasons and per-round usage. False when nothing is left worth sending.
pub fn strip_loop_fields(chunk: &mut Value) -> bool {
    if let Some(obj) = chunk.as_object_mut() {
        obj.remove("usage");
    }
    let Some(choices) = chunk.get_mut("choices").and_then(Value::as_array_mut) else {
        return false;
    };
    let mut keep = false;
    for choice in choices.iter_mut() {
        if let Some(c) = choice.as_object_mut() {
            c.insert("finish_reason".into(), Value::Null);
            if let Some(delta) = c.get_mut("delta").and_then(Value::as_object_mut) {
                delta.remove("tool_calls");
                keep |= delta
                    .get("content")
                    .and_then(Value::as_str)
                    .is_some_and(|t| !t.is_empty())
                    || delta.contains_key("role")
                    || delta.contains_key("refusal");
            }
        }
    }
    keep
}

/// The whole `chat.completion` body of a streamed round.
pub fn assembled_body(asm: &Assembler, model: &str, finish_reason: &str) -> Value {
    json!({
        "id": asm.id.clone().unwrap_or_else(|| format!("chatcmpl-{}", Uuid::now_v7().simple())),
        "object": "chat.completion",
        "created": Utc::now().timestamp(),
        "model": model,
        "choices": [{"index": 0, "message": asm.message(), "finish_reason": finish_reason}],
        "usage": asm.usage.clone().unwrap_or(Value::Null),
    })
}

/// The chunk that tells an SSE caller how a turn whose loop fields were hidden ended: the final
/// round's own tool calls (indexed), its finish reason and the turn's usage.
pub fn closing_chunk(
    body: &Value,
    model: &str,
    message: &ChatMessage,
    finish_reason: Option<&str>,
) -> Value {
    let mut delta = Map::new();
    let calls: Vec<Value> = message
        .tool_calls()
        .enumerate()
        .map(|(i, c)| {
            let mut c = c.as_value().clone();
            if let Some(call) = c.as_object_mut() {
                call.insert("index".into(), json!(i));
            }
            c
        })
        .collect();
    if message.get("tool_calls").is_some_and(Value::is_array) {
        delta.insert("tool_calls".into(), Value::Array(calls));
    }
    json!({
        "id": body.get("id").cloned().unwrap_or(Value::Null),
        "object": "chat.completion.chunk",
        "created": body.get("created").cloned().unwrap_or(Value::Null),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason.unwrap_or("stop")}],
        "usage": body.get("usage").cloned().unwrap_or(Value::Null),
    })
}

/// The last chunk of a streamed turn: the completed reply's `sbp` block.
pub fn sbp_chunk(reply: &Value) -> Value {
    let mut last = json!({
        "id": reply.get("id").cloned().unwrap_or(Value::Null),
        "object": "chat.completion.chunk",
        "created": reply.get("created").cloned().unwrap_or(Value::Null),
        "model": reply.get("model").cloned().unwrap_or(Value::Null),
        "choices": [],
    });
    last["sbp"] = reply.get("sbp").cloned().unwrap_or(Value::Null);
    last
}

/// Token usage added up over the rounds of a turn.
#[derive(Default)]
pub struct UsageSum {
    fields: Map<String, Value>,
    any: bool,
}

impl UsageSum {
    pub fn add(&mut self, usage: Option<&Value>) {
        let Some(usage) = usage.and_then(Value::as_object) else {
            return;
        };
        self.any = true;
        for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            if let Some(n) = usage.get(key).and_then(Value::as_u64) {
                let prev = self.fields.get(key).and_then(Value::as_u64).unwrap_or(0);
                self.fields.insert(key.into(), json!(prev + n));
            }
        }
    }

    pub fn value(self) -> Option<Value> {
        self.any.then_some(Value::Object(self.fields))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_fields_are_hidden_and_empty_chunks_dropped() {
        let mut tool_delta = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]},
            "finish_reason": "tool_calls"}], "usage": {"total_tokens": 3}});
        assert!(!strip_loop_fields(&mut tool_delta));
        assert_eq!(
            tool_delta,
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": null}]})
        );
        let mut text = json!({"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}]});
        assert!(strip_loop_fields(&mut text));
        assert_eq!(text["choices"][0]["finish_reason"], Value::Null);
    }

    #[test]
    fn the_closing_chunk_carries_the_final_calls_indexed() {
        let message = ChatMessage::from_value(json!({"role": "assistant", "content": null,
            "tool_calls": [{"id": "a", "function": {"name": "f"}}, {"id": "b", "function": {"name": "g"}}]}));
        let body = json!({"id": "c1", "created": 5, "usage": {"total_tokens": 9}});
        let chunk = closing_chunk(&body, "m", &message, Some("tool_calls"));
        assert_eq!(
            chunk["choices"][0]["delta"]["tool_calls"][1]["index"],
            json!(1)
        );
        assert_eq!(chunk["choices"][0]["finish_reason"], json!("tool_calls"));
        assert_eq!(chunk["usage"]["total_tokens"], json!(9));
        let plain = ChatMessage::from_value(json!({"role": "assistant", "content": "x"}));
        let chunk = closing_chunk(&body, "m", &plain, None);
        assert_eq!(chunk["choices"][0]["delta"], json!({}));
        assert_eq!(chunk["choices"][0]["finish_reason"], json!("stop"));
    }

    #[test]
    fn usage_adds_up_only_when_reported() {
        let mut sum = UsageSum::default();
        sum.add(None);
        assert!(UsageSum::default().value().is_none());
        sum.add(Some(&json!({"prompt_tokens": 2, "total_tokens": 3})));
        sum.add(Some(
            &json!({"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}),
        ));
        assert_eq!(
            sum.value(),
            Some(json!({"prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 8}))
        );
    }
}
