//! Anthropic Messages response → OpenAI `chat.completion`, and Anthropic's SSE events →
//! OpenAI `chat.completion.chunk`s. Pure: the caller supplies the `created` timestamp.
//!
//! Both paths build the same assistant message, so `Assembler` folding the translated stream
//! gives what the whole translation gives: a text block makes `content` a string (even an empty
//! one), tool calls alone leave it null, and each `tool_use` becomes a tool call whose
//! `arguments` are its input as JSON text.

use std::collections::{HashMap, VecDeque};

use serde_json::{Map, Value, json};

use crate::LlmError;
use crate::transport::Flow;

/// The OpenAI `finish_reason` for an Anthropic `stop_reason`.
fn finish_reason(stop_reason: &str) -> &'static str {
    match stop_reason {
        "tool_use" => "tool_calls",
        "max_tokens" | "model_context_window_exceeded" => "length",
        "refusal" => "content_filter",
        // end_turn, stop_sequence, pause_turn and whatever comes next: the turn is over.
        _ => "stop",
    }
}

/// OpenAI usage from Anthropic's, whose `input_tokens` leaves out cached prompt tokens where
/// OpenAI's `prompt_tokens` counts them.
fn usage(anthropic: &Map<String, Value>) -> Value {
    let count = |key: &str| anthropic.get(key).and_then(Value::as_u64).unwrap_or(0);
    let cached = count("cache_read_input_tokens");
    let prompt = count("input_tokens") + count("cache_creation_input_tokens") + cached;
    let completion = count("output_tokens");
    let mut usage = json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    });
    if cached > 0 {
        usage["prompt_tokens_details"] = json!({"cached_tokens": cached});
    }
    usage
}

fn tool_call(id: &Value, name: &Value, input: Option<&Value>) -> Value {
    let arguments = input.map_or_else(|| "{}".to_owned(), Value::to_string);
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// The OpenAI `chat.completion` for an Anthropic `message`.
pub(crate) fn completion_body(
    message: &Value,
    requested_model: &str,
    created: i64,
) -> Result<Value, LlmError> {
    let blocks = message
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| LlmError::Protocol("Anthropic response has no content array".into()))?;
    let mut text: Option<String> = None;
    let mut calls = Vec::new();
    for block in blocks {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => text
                .get_or_insert_default()
                .push_str(block.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("tool_use") => calls.push(tool_call(
                block.get("id").unwrap_or(&Value::Null),
                block.get("name").unwrap_or(&Value::Null),
                block.get("input"),
            )),
            // Thinking and server-tool blocks have no place in an OpenAI message.
            _ => {}
        }
    }
    let content = match text {
        Some(text) => Value::String(text),
        None if calls.is_empty() => Value::String(String::new()),
        None => Value::Null,
    };
    let mut assistant = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        assistant["tool_calls"] = Value::Array(calls);
    }
    let finish = message
        .get("stop_reason")
        .and_then(Value::as_str)
        .map(finish_reason);
    let model = message
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or(requested_model);
    let empty = Map::new();
    let anthropic_usage = message
        .get("usage")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    Ok(json!({
        "id": message.get("id").cloned().unwrap_or(Value::Null),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": assistant, "finish_reason": finish}],
        "usage": usage(anthropic_usage),
    }))
}

/// What one Anthropic content block is, by its index in the message.
#[derive(Debug, Clone, Copy)]
enum Block {
    Text,
    /// A `tool_use` block: its OpenAI tool-call index, and whether any input JSON arrived.
    Tool {
        index: usize,
        has_input: bool,
    },
}

/// Folds Anthropic's stream events into OpenAI chunks, one event at a time.
#[derive(Debug)]
pub(crate) struct StreamTranslator {
    id: String,
    model: String,
    created: i64,
    blocks: HashMap<u64, Block>,
    tools: usize,
    /// Anthropic usage so far: `message_start` has the input side, `message_delta` the output.
    usage: Map<String, Value>,
}

impl StreamTranslator {
    pub(crate) fn new(requested_model: &str, created: i64) -> Self {
        Self {
            id: String::new(),
            model: requested_model.to_owned(),
            created,
            blocks: HashMap::new(),
            tools: 0,
            usage: Map::new(),
        }
    }

    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    }

    fn tool_delta(&self, call: Value) -> Value {
        self.chunk(json!({"tool_calls": [call]}), None)
    }

    /// Translates one SSE event (`name` is its `event:` line, `data` its payload), appending
    /// the chunks it stands for. `Flow::End` at `message_stop`.
    pub(crate) fn event(
        &mut self,
        name: &str,
        data: &str,
        out: &mut VecDeque<Value>,
    ) -> Result<Flow, LlmError> {
        if data.trim().is_empty() {
            return Ok(Flow::Continue);
        }
        let event: Value = serde_json::from_str(data)
            .map_err(|e| LlmError::Protocol(format!("bad Anthropic stream event: {e}")))?;
        let kind = event.get("type").and_then(Value::as_str).unwrap_or(name);
        let index = event.get("index").and_then(Value::as_u64).unwrap_or(0);
        match kind {
            "message_start" => {
                let message = event.get("message");
                let field = |key: &str| message.and_then(|m| m.get(key)).and_then(Value::as_str);
                if let Some(id) = field("id") {
                    self.id = id.to_owned();
                }
                if let Some(model) = field("model") {
                    self.model = model.to_owned();
                }
                if let Some(usage) = message
                    .and_then(|m| m.get("usage"))
                    .and_then(Value::as_object)
                {
                    self.usage.extend(usage.clone());
                }
                out.push_back(self.chunk(json!({"role": "assistant"}), None));
            }
            "content_block_start" => {
                let block = event.get("content_block");
                match block.and_then(|b| b.get("type")).and_then(Value::as_str) {
                    Some("text") => {
                        self.blocks.insert(index, Block::Text);
                        // Even an empty start is sent: it is what makes `content` a string.
                        let text = block
                            .and_then(|b| b.get("text"))
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        out.push_back(self.chunk(json!({"content": text}), None));
                    }
                    Some("tool_use") => {
                        let call = self.tools;
                        self.tools += 1;
                        self.blocks.insert(
                            index,
                            Block::Tool {
                                index: call,
                                has_input: false,
                            },
                        );
                        let field = |key: &str| {
                            block
                                .and_then(|b| b.get(key))
                                .cloned()
                                .unwrap_or(Value::Null)
                        };
                        out.push_back(self.tool_delta(json!({
                            "index": call,
                            "id": field("id"),
                            "type": "function",
                            "function": {"name": field("name"), "arguments": ""},
                        })));
                    }
                    _ => {}
                }
            }
            "content_block_delta" => {
                let delta = event.get("delta");
                let text = |key: &str| delta.and_then(|d| d.get(key)).and_then(Value::as_str);
                match (self.blocks.get_mut(&index), text("type")) {
                    (Some(Block::Text), Some("text_delta")) => {
                        let piece = text("text").unwrap_or("");
                        out.push_back(self.chunk(json!({"content": piece}), None));
                    }
                    (Some(Block::Tool { index, has_input }), Some("input_json_delta")) => {
                        let piece = text("partial_json").unwrap_or("");
                        *has_input |= !piece.is_empty();
                        let call = *index;
                        out.push_back(
                            self.tool_delta(
                                json!({"index": call, "function": {"arguments": piece}}),
                            ),
                        );
                    }
                    // Thinking, signatures, citations: nothing OpenAI-shaped to say.
                    _ => {}
                }
            }
            "content_block_stop" => {
                // A tool without arguments streams no JSON; the whole translation says `{}`.
                if let Some(Block::Tool {
                    index,
                    has_input: false,
                }) = self.blocks.get(&index).copied()
                {
                    out.push_back(
                        self.tool_delta(json!({"index": index, "function": {"arguments": "{}"}})),
                    );
                }
            }
            "message_delta" => {
                if let Some(usage) = event.get("usage").and_then(Value::as_object) {
                    // Later counts replace earlier ones: they are cumulative.
                    self.usage.extend(usage.clone());
                }
                let finish = event
                    .pointer("/delta/stop_reason")
                    .and_then(Value::as_str)
                    .map(finish_reason);
                let mut chunk = self.chunk(json!({}), finish);
                chunk["usage"] = usage(&self.usage);
                out.push_back(chunk);
            }
            "message_stop" => return Ok(Flow::End),
            "error" => {
                return Err(LlmError::Status {
                    status: 502,
                    body: event,
                });
            }
            // `ping`, and event types added later: the API says to ignore them.
            _ => {}
        }
        Ok(Flow::Continue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Assembler;

    /// Each case: an Anthropic message and the OpenAI choice it must become.
    #[test]
    fn responses_translate() {
        let cases = [
            (
                json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
                       "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}],
                       "stop_reason": "end_turn", "usage": {"input_tokens": 3, "output_tokens": 2}}),
                json!({"index": 0, "message": {"role": "assistant", "content": "Hello there"}, "finish_reason": "stop"}),
            ),
            (
                json!({"id": "msg_2", "model": "claude-x", "stop_reason": "tool_use",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "gps", "input": {"precise": true}},
                    {"type": "tool_use", "id": "toolu_2", "name": "clock", "input": {}},
                ]}),
                json!({"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "gps", "arguments": "{\"precise\":true}"}},
                    {"id": "toolu_2", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
                ]}, "finish_reason": "tool_calls"}),
            ),
            (
                json!({"id": "msg_3", "content": [{"type": "text", "text": "Sure."},
                           {"type": "tool_use", "id": "toolu_3", "name": "f", "input": {"a": [1]}}],
                       "stop_reason": "tool_use"}),
                json!({"index": 0, "message": {"role": "assistant", "content": "Sure.", "tool_calls": [
                    {"id": "toolu_3", "type": "function", "function": {"name": "f", "arguments": "{\"a\":[1]}"}},
                ]}, "finish_reason": "tool_calls"}),
            ),
            (
                json!({"id": "m", "content": [{"type": "text", "text": "cut"}], "stop_reason": "max_tokens"}),
                json!({"index": 0, "message": {"role": "assistant", "content": "cut"}, "finish_reason": "length"}),
            ),
            (
                json!({"id": "m", "content": [{"type": "text", "text": "x"}], "stop_reason": "stop_sequence"}),
                json!({"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}),
            ),
            (
                json!({"id": "m", "content": [], "stop_reason": null}),
                json!({"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": null}),
            ),
        ];
        for (anthropic, choice) in cases {
            let body = completion_body(&anthropic, "asked", 7).expect("translates");
            assert_eq!(body["choices"][0], choice, "{anthropic}");
            assert_eq!(body["object"], "chat.completion");
            assert_eq!(body["id"], anthropic["id"]);
            assert_eq!(body["created"], 7);
            let model = anthropic["model"].as_str().unwrap_or("asked");
            assert_eq!(body["model"], model);
        }
        assert!(completion_body(&json!({"type": "message"}), "m", 0).is_err());
    }

    #[test]
    fn usage_counts_cached_prompt_tokens() {
        let body = completion_body(
            &json!({"content": [], "usage": {"input_tokens": 10, "output_tokens": 4,
                    "cache_creation_input_tokens": 5, "cache_read_input_tokens": 20}}),
            "m",
            0,
        )
        .expect("translates");
        assert_eq!(
            body["usage"],
            json!({"prompt_tokens": 35, "completion_tokens": 4, "total_tokens": 39,
                   "prompt_tokens_details": {"cached_tokens": 20}})
        );
    }

    /// The SSE events Anthropic would send for `message`, with the text and the tool input
    /// split in two, thinking blocks and pings mixed in.
    fn events_for(message: &Value) -> Vec<(String, Value)> {
        let mut start = message.clone();
        start["content"] = json!([]);
        start["stop_reason"] = Value::Null;
        start["usage"] =
            json!({"input_tokens": message["usage"]["input_tokens"], "output_tokens": 1});
        let mut events = vec![
            (
                "message_start",
                json!({"type": "message_start", "message": start}),
            ),
            ("ping", json!({"type": "ping"})),
        ];
        for (index, block) in message["content"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let (empty, delta) = match block["type"].as_str() {
                Some("text") => (json!({"type": "text", "text": ""}), "text_delta"),
                Some("tool_use") => {
                    let mut b = block.clone();
                    b["input"] = json!({});
                    (b, "input_json_delta")
                }
                _ => (
                    json!({"type": "thinking", "thinking": ""}),
                    "thinking_delta",
                ),
            };
            events.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": index, "content_block": empty}),
            ));
            let whole = match delta {
                "text_delta" => block["text"].as_str().unwrap_or("").to_owned(),
                "input_json_delta" => block["input"].to_string(),
                _ => "thought".to_owned(),
            };
            let key = match delta {
                "text_delta" => "text",
                "input_json_delta" => "partial_json",
                _ => "thinking",
            };
            let mid = whole
                .char_indices()
                .nth(whole.chars().count() / 2)
                .map_or(0, |(i, _)| i);
            for piece in [&whole[..mid], &whole[mid..]] {
                if delta == "input_json_delta" && block["input"] == json!({}) {
                    // Like the API: a tool without arguments streams no input JSON at all.
                    continue;
                }
                events.push((
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index,
                           "delta": {"type": delta, key: piece}}),
                ));
            }
            events.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
        events.push((
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": message["stop_reason"], "stop_sequence": null},
                   "usage": {"output_tokens": message["usage"]["output_tokens"]}}),
        ));
        events.push(("ping", json!({"type": "ping"})));
        events.push(("message_stop", json!({"type": "message_stop"})));
        events
            .into_iter()
            .map(|(name, data)| (name.to_owned(), data))
            .collect()
    }

    fn translate_stream(events: &[(String, Value)]) -> Result<(Vec<Value>, Flow), LlmError> {
        let mut t = StreamTranslator::new("asked", 7);
        let mut out = VecDeque::new();
        let mut flow = Flow::Continue;
        for (name, data) in events {
            assert_eq!(flow, Flow::Continue, "event after message_stop");
            flow = t.event(name, &data.to_string(), &mut out)?;
        }
        Ok((out.into_iter().collect(), flow))
    }

    #[test]
    fn assembled_stream_equals_the_whole_translation() {
        let messages = [
            json!({"id": "msg_t", "type": "message", "role": "assistant", "model": "claude-x",
                   "content": [{"type": "text", "text": "Hello, wörld"}],
                   "stop_reason": "end_turn", "usage": {"input_tokens": 9, "output_tokens": 3}}),
            json!({"id": "msg_u", "type": "message", "role": "assistant", "model": "claude-x",
                   "content": [
                       {"type": "thinking", "thinking": "t", "signature": "s"},
                       {"type": "text", "text": "Checking."},
                       {"type": "tool_use", "id": "toolu_a", "name": "weather", "input": {"city": "Paris", "days": [1, 2]}},
                       {"type": "tool_use", "id": "toolu_b", "name": "clock", "input": {}},
                   ],
                   "stop_reason": "tool_use", "usage": {"input_tokens": 20, "output_tokens": 11}}),
            json!({"id": "msg_v", "type": "message", "role": "assistant", "model": "claude-x",
                   "content": [{"type": "tool_use", "id": "toolu_c", "name": "gps", "input": {"p": 1}}],
                   "stop_reason": "tool_use", "usage": {"input_tokens": 1, "output_tokens": 1}}),
            json!({"id": "msg_w", "type": "message", "role": "assistant", "model": "claude-x",
                   "content": [{"type": "text", "text": "long"}],
                   "stop_reason": "max_tokens", "usage": {"input_tokens": 1, "output_tokens": 1}}),
        ];
        for message in messages {
            let whole = completion_body(&message, "asked", 7).expect("translates");
            let (chunks, flow) =
                translate_stream(&events_for(&message)).expect("stream translates");
            assert_eq!(flow, Flow::End);
            let mut asm = Assembler::default();
            for chunk in &chunks {
                assert_eq!(chunk["object"], "chat.completion.chunk");
                assert_eq!(chunk["id"], message["id"]);
                asm.push(chunk);
            }
            assert_eq!(asm.message(), whole["choices"][0]["message"], "{message}");
            assert_eq!(
                asm.finish_reason.as_deref(),
                whole["choices"][0]["finish_reason"].as_str()
            );
            assert_eq!(asm.usage.as_ref(), Some(&whole["usage"]));
            assert_eq!(asm.model.as_deref(), Some("claude-x"));
            assert_eq!(asm.id.as_deref(), message["id"].as_str());
        }
    }

    #[test]
    fn tool_deltas_carry_openai_indexes() {
        let message = json!({"id": "m", "model": "c", "content": [
            {"type": "text", "text": "hi"},
            {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {"x": 1}},
            {"type": "tool_use", "id": "toolu_b", "name": "g", "input": {"y": 2}},
        ], "stop_reason": "tool_use", "usage": {"input_tokens": 1, "output_tokens": 1}});
        let (chunks, _) = translate_stream(&events_for(&message)).expect("translates");
        let calls: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c.pointer("/choices/0/delta/tool_calls/0"))
            .collect();
        assert_eq!(
            calls[0],
            &json!({"index": 0, "id": "toolu_a", "type": "function", "function": {"name": "f", "arguments": ""}})
        );
        assert_eq!(
            calls[1],
            &json!({"index": 0, "function": {"arguments": "{\"x"}})
        );
        assert_eq!(calls[3]["index"], 1);
        assert_eq!(calls[3]["id"], "toolu_b");
        let last = chunks.last().expect("chunks");
        assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(
            last["usage"],
            json!({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
        );
    }

    #[test]
    fn error_events_and_garbage_fail_the_stream() {
        let mut t = StreamTranslator::new("m", 0);
        let mut out = VecDeque::new();
        let overloaded = json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
        assert_eq!(
            t.event("error", &overloaded.to_string(), &mut out),
            Err(LlmError::Status {
                status: 502,
                body: overloaded
            })
        );
        assert!(matches!(
            t.event("message_start", "{nope", &mut out),
            Err(LlmError::Protocol(_))
        ));
        // Unknown events and pings are ignored; the event name stands in for a missing type.
        assert_eq!(t.event("future_event", "{}", &mut out), Ok(Flow::Continue));
        assert_eq!(t.event("ping", "", &mut out), Ok(Flow::Continue));
        assert_eq!(t.event("message_stop", "{}", &mut out), Ok(Flow::End));
        assert!(out.is_empty());
    }
}
