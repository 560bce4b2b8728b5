//! OpenAI chat-completions request → Anthropic Messages request. Pure: no IO, no clock.
//!
//! Anthropic keeps the system prompt out of the messages, wants user and assistant turns to
//! alternate, carries tool calls as `tool_use` blocks of an assistant turn and their results as
//! `tool_result` blocks of the next user turn. Translation never fails: what Anthropic cannot
//! express is dropped with a warning, and what is still wrong is left for the upstream's 400.

use sbp_protocol::{ChatMessage, ChatRequest, FunctionCall};
use serde_json::{Map, Value, json};

use crate::content_text;

/// The Anthropic request body for an OpenAI one.
pub(crate) fn translate(
    req: &ChatRequest,
    default_max_tokens: u32,
    stream: bool,
) -> Map<String, Value> {
    let mut out = Map::new();
    if let Some(model) = &req.model {
        out.insert("model".into(), json!(model));
    }
    let body = &req.rest;
    let Conversation { system, turns } = conversation(&req.all_messages());
    if !system.is_empty() {
        out.insert("system".into(), json!(system.join("\n\n")));
    }
    let uses_tools = turns.iter().flat_map(|t| &t.blocks).any(|b| {
        matches!(
            b.get("type").and_then(Value::as_str),
            Some("tool_use" | "tool_result")
        )
    });
    // Names of the tools the history called, for placeholder definitions (see `tools`).
    let mut used: Vec<String> = Vec::new();
    for b in turns.iter().flat_map(|t| &t.blocks) {
        if b.get("type").and_then(Value::as_str) == Some("tool_use")
            && let Some(name) = b.get("name").and_then(Value::as_str)
            && !used.iter().any(|u| u == name)
        {
            used.push(name.to_owned());
        }
    }
    out.insert(
        "messages".into(),
        Value::Array(turns.into_iter().map(Turn::into_message).collect()),
    );
    let max_tokens = req
        .output_token_limit()
        .unwrap_or(u64::from(default_max_tokens));
    out.insert("max_tokens".into(), json!(max_tokens));
    if let Some(stop) = stop_sequences(body.get("stop")) {
        out.insert("stop_sequences".into(), stop);
    }
    for key in ["temperature", "top_p"] {
        if let Some(v) = body.get(key).filter(|v| v.is_number()) {
            out.insert(key.into(), v.clone());
        }
    }
    if let Some(user) = body.get("user").and_then(Value::as_str) {
        out.insert("metadata".into(), json!({"user_id": user}));
    }
    tools(req, uses_tools, &mut out);
    if uses_tools && !out.contains_key("tools") {
        // Anthropic refuses tool blocks in a request that defines no tools (e.g. a later turn
        // once the device that had them is gone): define the called ones, and forbid their use.
        let placeholders: Vec<Value> = used
            .iter()
            .map(|name| {
                json!({"name": name, "description": "No longer available.",
                       "input_schema": {"type": "object", "additionalProperties": true}})
            })
            .collect();
        if !placeholders.is_empty() {
            out.insert("tools".into(), Value::Array(placeholders));
            out.insert("tool_choice".into(), json!({"type": "none"}));
        }
    }
    out.insert("stream".into(), Value::Bool(stream));
    out
}

/// The system prompt, pulled out of the messages, and the alternating turns.
struct Conversation {
    system: Vec<String>,
    turns: Vec<Turn>,
}

struct Turn {
    role: &'static str,
    blocks: Vec<Value>,
}

impl Turn {
    fn into_message(mut self) -> Value {
        if self.role == "user" {
            // Anthropic wants a user turn's tool results ahead of its other content; the sort is
            // stable, so everything keeps its order otherwise.
            self.blocks
                .sort_by_key(|b| b.get("type").and_then(Value::as_str) != Some("tool_result"));
        }
        json!({"role": self.role, "content": self.blocks})
    }
}

fn conversation(messages: &[ChatMessage]) -> Conversation {
    let mut system = Vec::new();
    let mut turns: Vec<Turn> = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        let role = message.role().unwrap_or("");
        let content = message.content();
        let (role, blocks) = match role {
            "system" | "developer" => {
                if let Some(text) = content.and_then(content_text)
                    && !text.trim().is_empty()
                {
                    system.push(text);
                }
                continue;
            }
            "user" => ("user", content_blocks(content)),
            "assistant" => {
                let mut blocks = content_blocks(content);
                blocks.extend(message.tool_calls().map(tool_use));
                ("assistant", blocks)
            }
            "tool" => ("user", vec![tool_result(message)]),
            other => {
                tracing::warn!(
                    index,
                    role = other,
                    "message role has no Anthropic equivalent; dropped"
                );
                continue;
            }
        };
        // Turns left empty (an assistant with neither text nor calls) would be rejected;
        // dropping them can leave two same-role turns side by side, which merge below.
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some(last) if last.role == role => last.blocks.extend(blocks),
            _ => turns.push(Turn { role, blocks }),
        }
    }
    Conversation { system, turns }
}

/// The content blocks of an OpenAI `content`: a string, or an array of parts. Blank text is
/// left out because Anthropic rejects text blocks without visible text.
fn content_blocks(content: Option<&Value>) -> Vec<Value> {
    match content {
        Some(Value::String(text)) => text_block(text).into_iter().collect(),
        Some(Value::Array(parts)) => parts.iter().filter_map(part_block).collect(),
        Some(Value::Null) | None => Vec::new(),
        Some(other) => {
            tracing::warn!(content = %other, "message content is neither text nor parts; dropped");
            Vec::new()
        }
    }
}

fn text_block(text: &str) -> Option<Value> {
    (!text.trim().is_empty()).then(|| json!({"type": "text", "text": text}))
}

fn part_block(part: &Value) -> Option<Value> {
    match part.get("type").and_then(Value::as_str) {
        Some("text") | None => part
            .get("text")
            .and_then(Value::as_str)
            .and_then(text_block),
        Some("image_url") => {
            let url = part
                .get("image_url")
                .and_then(|i| i.get("url").or(Some(i)))
                .and_then(Value::as_str)
                .unwrap_or("");
            Some(image_block(url))
        }
        Some(other) => {
            tracing::warn!(
                part_type = other,
                "content part has no Anthropic equivalent; dropped"
            );
            None
        }
    }
}

/// A `data:<type>;base64,` URL becomes an inline image, an http(s) URL an image by reference;
/// anything else cannot be sent, and a placeholder says an image was there.
fn image_block(url: &str) -> Value {
    if let Some(rest) = url.strip_prefix("data:")
        && let Some((media_type, data)) = rest.split_once(";base64,")
    {
        return json!({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}});
    }
    if url.starts_with("https://") || url.starts_with("http://") {
        return json!({"type": "image", "source": {"type": "url", "url": url}});
    }
    tracing::warn!("image is neither a base64 data URL nor an http(s) URL; sent as a placeholder");
    json!({"type": "text", "text": "[image omitted]"})
}

fn tool_use(call: FunctionCall<'_>) -> Value {
    let id = call.id().unwrap_or("");
    let name = call.name().unwrap_or("");
    let arguments = call.arguments().unwrap_or("");
    json!({"type": "tool_use", "id": id, "name": name, "input": tool_input(id, name, arguments)})
}

/// Anthropic wants the input as a JSON object where OpenAI has a string that models do not
/// always get right; an empty string means no arguments, anything unusable becomes `{}`.
fn tool_input(id: &str, name: &str, arguments: &str) -> Value {
    if arguments.trim().is_empty() {
        return json!({});
    }
    match serde_json::from_str::<Value>(arguments) {
        Ok(input @ Value::Object(_)) => input,
        Ok(_) | Err(_) => {
            tracing::warn!(
                tool_call_id = id,
                tool = name,
                arguments,
                "tool call arguments are not a JSON object; sent as {{}}"
            );
            json!({})
        }
    }
}

fn tool_result(message: &ChatMessage) -> Value {
    let id = message.tool_call_id().unwrap_or("");
    let mut block = json!({"type": "tool_result", "tool_use_id": id});
    if let Some(text) = message.text()
        && !text.is_empty()
    {
        block["content"] = json!(text);
    }
    block
}

fn stop_sequences(stop: Option<&Value>) -> Option<Value> {
    let list: Vec<&str> = match stop? {
        Value::String(s) => vec![s.as_str()],
        Value::Array(items) => items.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    (!list.is_empty()).then(|| json!(list))
}

/// Copies `tools` and `tool_choice`. `none` drops the tools, unless the conversation already
/// holds tool blocks: Anthropic refuses those without tool definitions, so then the tools stay
/// and the choice says `none`.
fn tools(req: &ChatRequest, uses_tools: bool, out: &mut Map<String, Value>) {
    let tools: Vec<Value> = req
        .tools
        .iter()
        .flatten()
        .map(|t| t.as_value())
        .filter_map(tool_definition)
        .collect();
    if tools.is_empty() {
        return;
    }
    let mut choice = match req.tool_choice.as_ref() {
        None | Some(Value::Null) => json!({"type": "auto"}),
        Some(Value::String(s)) if s == "auto" => json!({"type": "auto"}),
        Some(Value::String(s)) if s == "required" => json!({"type": "any"}),
        Some(Value::String(s)) if s == "none" => {
            if !uses_tools {
                return;
            }
            json!({"type": "none"})
        }
        Some(named) => match named
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
        {
            Some(name) => json!({"type": "tool", "name": name}),
            None => {
                tracing::warn!(tool_choice = %named, "unknown tool_choice; using auto");
                json!({"type": "auto"})
            }
        },
    };
    let explicit = req.tool_choice.as_ref().is_some_and(|c| !c.is_null());
    let serial = req.rest.get("parallel_tool_calls") == Some(&Value::Bool(false));
    if serial && choice["type"] != "none" {
        choice["disable_parallel_tool_use"] = Value::Bool(true);
    }
    out.insert("tools".into(), Value::Array(tools));
    // Auto is Anthropic's default: say it only when the caller did or something rides on it.
    if explicit || serial {
        out.insert("tool_choice".into(), choice);
    }
}

fn tool_definition(tool: &Value) -> Option<Value> {
    let kind = tool
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("function");
    let function = tool.get("function").filter(|_| kind == "function");
    let Some(name) = function.and_then(|f| f.get("name")).and_then(Value::as_str) else {
        tracing::warn!(tool = %tool, "tool is not a named function; dropped");
        return None;
    };
    let mut def = json!({"name": name});
    if let Some(description) = function
        .and_then(|f| f.get("description"))
        .and_then(Value::as_str)
    {
        def["description"] = json!(description);
    }
    def["input_schema"] = function
        .and_then(|f| f.get("parameters"))
        .filter(|p| p.is_object())
        .cloned()
        .unwrap_or_else(|| json!({"type": "object"}));
    Some(def)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> ChatRequest {
        crate::test_request(v)
    }

    fn translated(v: Value) -> Value {
        Value::Object(translate(&body(v), 4096, false))
    }

    /// Each case: an OpenAI body and what its Anthropic translation must contain (every listed
    /// key equal; keys not listed are not checked, `null` means absent).
    #[test]
    fn requests_translate() {
        let cases = [
            (
                "system messages anywhere are joined and taken out",
                json!({"model": "claude-x", "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                    {"role": "developer", "content": [{"type": "text", "text": "no emoji"}]},
                ]}),
                json!({
                    "model": "claude-x",
                    "system": "be brief\n\nno emoji",
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                    "max_tokens": 4096,
                    "stream": false,
                }),
            ),
            (
                "same-role messages merge; blank text and empty assistants vanish",
                json!({"messages": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "  "}]},
                    {"role": "assistant", "content": ""},
                    {"role": "user", "content": "c"},
                ]}),
                json!({"messages": [{"role": "user", "content": [
                    {"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "text", "text": "c"},
                ]}]}),
            ),
            (
                "images: base64 data URLs inline, http URLs by reference, others a placeholder",
                json!({"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                    {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
                    {"type": "input_audio", "input_audio": {}},
                ]}]}),
                json!({"messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
                    {"type": "text", "text": "[image omitted]"},
                ]}]}),
            ),
            (
                "sampling: max_completion_tokens, stop string, temperature, top_p, user",
                json!({"messages": [], "max_completion_tokens": 77, "stop": "END",
                       "temperature": 0.5, "top_p": 0.9, "user": "u1", "n": 1, "seed": 3}),
                json!({"max_tokens": 77, "stop_sequences": ["END"], "temperature": 0.5,
                       "top_p": 0.9, "metadata": {"user_id": "u1"}, "n": null, "seed": null}),
            ),
            (
                "max_tokens wins; stop arrays pass",
                json!({"messages": [], "max_tokens": 5, "max_completion_tokens": 9, "stop": ["a", "b"]}),
                json!({"max_tokens": 5, "stop_sequences": ["a", "b"]}),
            ),
            (
                "tools become input_schema definitions; auto is left implicit",
                json!({"messages": [], "tools": [
                    {"type": "function", "function": {"name": "gps", "description": "where am I",
                        "parameters": {"type": "object", "properties": {"p": {"type": "string"}}}}},
                    {"type": "function", "function": {"name": "clock"}},
                    {"type": "function", "function": {"description": "nameless"}},
                ]}),
                json!({"tools": [
                    {"name": "gps", "description": "where am I",
                     "input_schema": {"type": "object", "properties": {"p": {"type": "string"}}}},
                    {"name": "clock", "input_schema": {"type": "object"}},
                ], "tool_choice": null}),
            ),
            (
                "tool_choice auto",
                json!({"messages": [], "tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}),
                json!({"tool_choice": {"type": "auto"}}),
            ),
            (
                "tool_choice required",
                json!({"messages": [], "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}),
                json!({"tool_choice": {"type": "any"}}),
            ),
            (
                "tool_choice by name, no parallel calls",
                json!({"messages": [], "parallel_tool_calls": false,
                       "tool_choice": {"type": "function", "function": {"name": "f"}},
                       "tools": [{"type": "function", "function": {"name": "f"}}]}),
                json!({"tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": true}}),
            ),
            (
                "tool_choice none drops the tools",
                json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
                       "tools": [{"type": "function", "function": {"name": "f"}}]}),
                json!({"tools": null, "tool_choice": null}),
            ),
            (
                "tool_choice none keeps the tools when the history holds tool blocks",
                json!({"messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                ], "tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}}]}),
                json!({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "none"}}),
            ),
            (
                "unusable tool arguments become {} and an empty tool result has no content",
                json!({"messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "[1]"}},
                        {"id": "c3", "type": "function", "function": {"name": "h", "arguments": ""}},
                    ]},
                    {"role": "tool", "tool_call_id": "c1", "content": ""},
                ]}),
                json!({"messages": [
                    {"role": "user", "content": [{"type": "text", "text": "x"}]},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "c1", "name": "f", "input": {}},
                        {"type": "tool_use", "id": "c2", "name": "g", "input": {}},
                        {"type": "tool_use", "id": "c3", "name": "h", "input": {}},
                    ]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1"}]},
                ]}),
            ),
        ];
        for (name, openai, expected) in cases {
            let got = translated(openai);
            for (key, want) in expected.as_object().into_iter().flatten() {
                let have = got.get(key).unwrap_or(&Value::Null);
                assert_eq!(have, want, "{name}: `{key}` in {got:#}");
            }
        }
    }

    #[test]
    fn streaming_is_set_by_the_call() {
        let b = body(json!({"stream": false, "messages": []}));
        assert_eq!(translate(&b, 10, true)["stream"], json!(true));
        assert_eq!(translate(&b, 10, false)["max_tokens"], json!(10));
    }

    /// A multi-round tool conversation: the assistant calls two tools, both answer, the user
    /// follows up. Anthropic must see strictly alternating turns starting with the user, each
    /// `tool_use` answered by a `tool_result` in the very next turn, results first.
    #[test]
    fn tool_rounds_become_alternating_turns() {
        let got = translated(json!({"model": "claude-x", "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "weather in Paris and the time?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "call_b", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "12:00"}]},
            {"role": "user", "content": "and tomorrow?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_c", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Paris\",\"day\":1}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_c", "content": "rain"},
        ]}));
        assert_eq!(got["system"], "sys");
        assert_eq!(
            got["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "weather in Paris and the time?"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "call_a", "name": "weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "call_b", "name": "clock", "input": {}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_a", "content": "sunny"},
                    {"type": "tool_result", "tool_use_id": "call_b", "content": "12:00"},
                    {"type": "text", "text": "and tomorrow?"},
                ]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "call_c", "name": "weather", "input": {"city": "Paris", "day": 1}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_c", "content": "rain"},
                ]},
            ])
        );
        let roles: Vec<&str> = got["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["role"].as_str())
            .collect();
        assert_eq!(
            roles,
            ["user", "assistant", "user", "assistant", "user"],
            "alternating, user first"
        );
    }

    #[test]
    fn a_user_turn_puts_tool_results_first() {
        let got = translated(json!({"messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "user", "content": "interjection"},
            {"role": "tool", "tool_call_id": "c", "content": "done"},
        ]}));
        assert_eq!(
            got["messages"][2]["content"],
            json!([
                {"type": "tool_result", "tool_use_id": "c", "content": "done"},
                {"type": "text", "text": "interjection"},
            ])
        );
    }

    #[test]
    fn tool_blocks_without_tools_get_placeholder_definitions() {
        let out = translated(json!({
            "model": "claude-x",
            "messages": [
                {"role": "user", "content": "where am I?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "surface_gps", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "{\"error\":\"surface disconnected\"}"},
                {"role": "user", "content": "and now?"}
            ]
        }));
        assert_eq!(out["tools"][0]["name"], "surface_gps", "{out}");
        assert!(out["tools"][0]["input_schema"].is_object());
        assert_eq!(out["tool_choice"], json!({"type": "none"}));
        // Without tool blocks in the history nothing is added.
        let plain =
            translated(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}));
        assert!(plain.get("tools").is_none() && plain.get("tool_choice").is_none());
    }
}
