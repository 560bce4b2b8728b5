//! OpenAI `chat.completion` bodies and `chat.completion.chunk`s as the gateway edits them for the
//! HTTP caller, as pure functions: what the agent loop hides from streamed chunks, the closing
//! chunks it adds, a whole body assembled from a stream, and usage summed over a turn's rounds.

use chrono::Utc;
use sbp_llm::Assembler;
use serde_json::{Map, Value, json};
use uuid::Uuid;

/// Edits an upstream chunk for the SSE caller: its usage and finish reason go (the gateway sends
/// the turn's own at the end, once the reply is stored), and with gateway tools on offer
/// (`hide_tools`) its tool-call deltas too (they belong to the loop). False when nothing is left
/// worth sending (a usage-only chunk, a bare finish).
pub fn strip_loop_fields(chunk: &mut Value, hide_tools: bool) -> bool {
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
            keep |= c.get("logprobs").is_some_and(|l| !l.is_null());
            if let Some(delta) = c.get_mut("delta").and_then(Value::as_object_mut) {
                if hide_tools {
                    delta.remove("tool_calls");
                }
                // Whatever else the delta carries (audio, reasoning, a role) is the caller's.
                keep |= delta.iter().any(|(key, v)| match v {
                    Value::Null => false,
                    Value::String(t) => !t.is_empty() || key == "role",
                    _ => true,
                });
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

/// The finish chunk of a streamed turn, sent once its reply is stored: its finish reason, the
/// final round's tool calls (indexed) when the loop hid them, and the turn's `sbp` block (where
/// OpenAI's SDKs ignore it).
pub fn closing_chunk(reply: &Value, tools_hidden: bool) -> Value {
    let choice = reply.pointer("/choices/0");
    let finish_reason = choice
        .and_then(|c| c.get("finish_reason"))
        .filter(|f| f.is_string())
        .cloned()
        .unwrap_or_else(|| json!("stop"));
    let mut delta = Map::new();
    if tools_hidden
        && let Some(calls) = choice
            .and_then(|c| c.pointer("/message/tool_calls"))
            .and_then(Value::as_array)
    {
        delta.insert("tool_calls".into(), indexed(calls));
    }
    let mut chunk = chunk_head(reply);
    chunk["choices"] = json!([{"index": 0, "delta": delta, "finish_reason": finish_reason}]);
    if let Some(sbp) = reply.get("sbp") {
        chunk["sbp"] = sbp.clone();
    }
    chunk
}

/// The usage chunk OpenAI sends last when `stream_options.include_usage` is set: no choices,
/// the turn's usage.
pub fn usage_chunk(reply: &Value) -> Value {
    let mut chunk = chunk_head(reply);
    chunk["choices"] = json!([]);
    chunk["usage"] = reply.get("usage").cloned().unwrap_or(Value::Null);
    chunk
}

/// A stored reply as the stream that first delivered it: one chunk with the whole message, the
/// finish chunk, the usage chunk when asked for (an Idempotency-Key replay of a streamed request).
pub fn replayed_chunks(reply: &Value, include_usage: bool) -> Vec<Value> {
    let mut delta = Map::new();
    delta.insert("role".into(), json!("assistant"));
    if let Some(message) = reply
        .pointer("/choices/0/message")
        .and_then(Value::as_object)
    {
        for (key, value) in message {
            if key == "tool_calls"
                && let Some(calls) = value.as_array()
            {
                delta.insert(key.clone(), indexed(calls));
            } else if key != "role" {
                delta.insert(key.clone(), value.clone());
            }
        }
    }
    let mut first = chunk_head(reply);
    first["choices"] = json!([{"index": 0, "delta": delta, "finish_reason": null}]);
    let mut chunks = vec![first, closing_chunk(reply, false)];
    if include_usage {
        chunks.push(usage_chunk(reply));
    }
    chunks
}

/// Tool calls as a chunk's delta carries them: each with its `index`.
fn indexed(calls: &[Value]) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut c = c.clone();
            if let Some(call) = c.as_object_mut() {
                call.insert("index".into(), json!(i));
            }
            c
        })
        .collect()
}

fn chunk_head(reply: &Value) -> Value {
    json!({
        "id": reply.get("id").cloned().unwrap_or(Value::Null),
        "object": "chat.completion.chunk",
        "created": reply.get("created").cloned().unwrap_or(Value::Null),
        "model": reply.get("model").cloned().unwrap_or(Value::Null),
    })
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
        assert!(!strip_loop_fields(&mut tool_delta, true));
        assert_eq!(
            tool_delta,
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": null}]})
        );
        let mut client_call = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]},
            "finish_reason": "tool_calls"}]});
        assert!(strip_loop_fields(&mut client_call, false));
        assert_eq!(client_call["choices"][0]["finish_reason"], Value::Null);
        let mut text = json!({"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}]});
        assert!(strip_loop_fields(&mut text, false));
        assert_eq!(text["choices"][0]["finish_reason"], Value::Null);
        let mut usage_only = json!({"choices": [], "usage": {"total_tokens": 3}});
        assert!(!strip_loop_fields(&mut usage_only, false));
        let mut bare_finish =
            json!({"choices": [{"delta": {"content": null}, "finish_reason": "stop"}]});
        assert!(!strip_loop_fields(&mut bare_finish, false));
        for delta in [
            json!({"reasoning_content": "thinking", "content": null}),
            json!({"audio": {"id": "a1", "data": "AAA"}}),
            json!({"role": "assistant", "content": ""}),
        ] {
            let mut chunk = json!({"choices": [{"index": 0, "delta": delta}]});
            assert!(strip_loop_fields(&mut chunk, true), "{chunk}");
        }
    }

    #[test]
    fn the_closing_chunk_carries_the_final_calls_indexed_and_the_sbp_block() {
        let reply = json!({"id": "c1", "created": 5, "model": "m", "usage": {"total_tokens": 9},
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant",
                "content": null, "tool_calls": [{"id": "a", "function": {"name": "f"}},
                {"id": "b", "function": {"name": "g"}}]}}],
            "sbp": {"step_count": 2}});
        let chunk = closing_chunk(&reply, true);
        assert_eq!(
            chunk["choices"][0]["delta"]["tool_calls"][1]["index"],
            json!(1)
        );
        assert_eq!(chunk["choices"][0]["finish_reason"], json!("tool_calls"));
        assert_eq!(chunk["sbp"]["step_count"], json!(2));
        assert!(chunk.get("usage").is_none(), "{chunk}");
        assert_eq!(
            closing_chunk(&reply, false)["choices"][0]["delta"],
            json!({})
        );
        let usage = usage_chunk(&reply);
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["total_tokens"], json!(9));
        assert_eq!(usage["id"], json!("c1"));
        let plain = json!({"choices": [{"message": {"role": "assistant", "content": "x"}}]});
        assert_eq!(
            closing_chunk(&plain, true)["choices"][0]["finish_reason"],
            json!("stop")
        );
    }

    #[test]
    fn a_replayed_reply_streams_whole() {
        let reply = json!({"id": "c1", "created": 5, "model": "m", "usage": {"total_tokens": 9},
            "choices": [{"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": "hi"}}], "sbp": {"step_count": 1}});
        let chunks = replayed_chunks(&reply, true);
        assert_eq!(chunks.len(), 3);
        assert_eq!(
            chunks[0]["choices"][0]["delta"],
            json!({"role": "assistant", "content": "hi"})
        );
        assert_eq!(chunks[1]["choices"][0]["finish_reason"], "stop");
        assert_eq!(chunks[1]["sbp"]["step_count"], 1);
        assert_eq!(chunks[2]["usage"]["total_tokens"], 9);
        assert_eq!(replayed_chunks(&reply, false).len(), 2);
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
