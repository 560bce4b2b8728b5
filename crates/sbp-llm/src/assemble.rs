//! Folds OpenAI streaming chunks into the final assistant message, the way OpenAI's own SDKs do:
//! content deltas are concatenated, tool-call deltas are merged by `index`.

use serde_json::{Map, Value, json};

use crate::LlmError;

/// Most tool calls one message may hold; a delta for a call past them is dropped.
const MAX_TOOL_CALLS: usize = 128;

#[derive(Debug, Default)]
pub struct Assembler {
    content: String,
    saw_content: bool,
    tool_calls: Vec<Map<String, Value>>,
    pub model: Option<String>,
    pub finish_reason: Option<String>,
    pub usage: Option<Value>,
    pub id: Option<String>,
    /// A tool-call delta was dropped (its index past [`MAX_TOOL_CALLS`]).
    dropped_call: bool,
}

impl Assembler {
    /// Adds one chunk; returns the content delta it carried, if any.
    pub fn push(&mut self, chunk: &Value) -> Option<String> {
        if self.id.is_none() {
            self.id = chunk.get("id").and_then(Value::as_str).map(str::to_owned);
        }
        if let Some(m) = chunk.get("model").and_then(Value::as_str) {
            self.model = Some(m.to_owned());
        }
        if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(u.clone());
        }
        let choice = chunk.get("choices").and_then(|c| c.get(0))?;
        if let Some(fr) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(fr.to_owned());
        }
        let delta = choice.get("delta")?;
        if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
            for call in calls {
                self.merge_tool_call(call);
            }
        }
        let text = delta.get("content").and_then(Value::as_str)?;
        self.saw_content = true;
        self.content.push_str(text);
        (!text.is_empty()).then(|| text.to_owned())
    }

    fn merge_tool_call(&mut self, call: &Value) {
        let index = call
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(self.tool_calls.len() as u64);
        // The upstream chooses the index: one far out would have every slot before it made.
        let Some(index) = usize::try_from(index).ok().filter(|&i| i < MAX_TOOL_CALLS) else {
            self.dropped_call = true;
            return;
        };
        while self.tool_calls.len() <= index {
            let mut fresh = Map::new();
            fresh.insert("type".into(), json!("function"));
            fresh.insert("function".into(), json!({"name": "", "arguments": ""}));
            self.tool_calls.push(fresh);
        }
        let slot = &mut self.tool_calls[index];
        if let Some(id) = call.get("id").and_then(Value::as_str) {
            slot.insert("id".into(), json!(id));
        }
        if let Some(t) = call.get("type").and_then(Value::as_str) {
            slot.insert("type".into(), json!(t));
        }
        if let Some(f) = call.get("function") {
            let func = slot
                .entry("function")
                .or_insert_with(|| json!({"name": "", "arguments": ""}));
            for key in ["name", "arguments"] {
                if let Some(part) = f.get(key).and_then(Value::as_str) {
                    // Appended in place: arguments streamed in many small deltas are not copied
                    // whole for each one.
                    match func.get_mut(key) {
                        Some(Value::String(whole)) => whole.push_str(part),
                        _ => func[key] = json!(part),
                    }
                }
            }
        }
    }

    /// An error once a chunk held a tool call the message cannot: a caller relaying the chunks
    /// stops there, so its client is not shown a call the message leaves out.
    pub fn check(&self) -> Result<(), LlmError> {
        match self.dropped_call {
            true => Err(LlmError::Protocol(format!(
                "a reply with a tool call past the {MAX_TOOL_CALLS} one message may hold"
            ))),
            false => Ok(()),
        }
    }

    pub fn content(&self) -> &str {
        &self.content
    }

    /// The assembled assistant message.
    pub fn message(&self) -> Value {
        let mut msg = Map::new();
        msg.insert("role".into(), json!("assistant"));
        let content = if self.saw_content || self.tool_calls.is_empty() {
            json!(self.content)
        } else {
            Value::Null
        };
        msg.insert("content".into(), content);
        if !self.tool_calls.is_empty() {
            msg.insert(
                "tool_calls".into(),
                Value::Array(self.tool_calls.iter().cloned().map(Value::Object).collect()),
            );
        }
        Value::Object(msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_and_tool_calls_are_merged() {
        let mut a = Assembler::default();
        let chunks = [
            json!({"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
            json!({"choices": [{"delta": {"content": "Hel"}}]}),
            json!({"choices": [{"delta": {"content": "lo"}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "gps", "arguments": "{\"a\""}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}}]}),
            json!({"choices": [{"delta": {}, "finish_reason": "tool_calls"}], "usage": {"total_tokens": 3}}),
        ];
        let deltas: Vec<String> = chunks.iter().filter_map(|c| a.push(c)).collect();
        assert_eq!(deltas, vec!["Hel", "lo"]);
        let msg = a.message();
        assert_eq!(msg["content"], json!("Hello"));
        assert_eq!(msg["tool_calls"][0]["id"], json!("call_1"));
        assert_eq!(msg["tool_calls"][0]["function"]["name"], json!("gps"));
        assert_eq!(
            msg["tool_calls"][0]["function"]["arguments"],
            json!("{\"a\":1}")
        );
        assert_eq!(a.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(a.model.as_deref(), Some("m"));
        assert_eq!(a.usage, Some(json!({"total_tokens": 3})));
    }

    /// The upstream's index places a call; one past the bound is dropped, not made room for,
    /// and many small argument deltas make the whole arguments.
    #[test]
    fn a_tool_call_index_far_out_is_dropped() {
        let mut a = Assembler::default();
        for index in [u64::MAX, 4_000_000_000, MAX_TOOL_CALLS as u64] {
            a.push(&json!({"choices": [{"delta": {"tool_calls": [{"index": index, "id": "far", "function": {"name": "f"}}]}}]}));
        }
        assert!(a.tool_calls.is_empty());
        assert!(matches!(a.check(), Err(LlmError::Protocol(_))));
        let mut fresh = Assembler::default();
        fresh.push(
            &json!({"choices": [{"delta": {"tool_calls": [{"index": MAX_TOOL_CALLS - 1}]}}]}),
        );
        assert_eq!(fresh.check(), Ok(()));
        a.push(&json!({"choices": [{"delta": {"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g", "arguments": ""}}]}}]}));
        for _ in 0..1000 {
            a.push(&json!({"choices": [{"delta": {"tool_calls": [{"index": 1, "function": {"arguments": "x"}}]}}]}));
        }
        let msg = a.message();
        let calls = msg["tool_calls"].as_array().expect("calls");
        assert_eq!(
            calls.len(),
            2,
            "the slot before the call is made, as before"
        );
        assert_eq!(calls[1]["id"], "b");
        assert_eq!(calls[1]["function"]["arguments"], "x".repeat(1000));
    }

    #[test]
    fn tool_only_message_has_null_content() {
        let mut a = Assembler::default();
        a.push(&json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "x", "function": {"name": "f", "arguments": "{}"}}]}}]}));
        assert_eq!(a.message()["content"], Value::Null);
    }
}
