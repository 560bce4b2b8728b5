//! The fake's Anthropic Messages side: checks a request the way the real API does, reads it into
//! the shared [`Request`](crate::script::Request), and renders the decided answer as an Anthropic
//! `message` or its SSE events.
//!
//! The checks are those a translating client most easily gets wrong (alternation, tool ids,
//! tool definitions, `max_tokens`), so a bad translation fails here the way it would in
//! production: a 400 with an `invalid_request_error`.

use http::HeaderMap;
use serde_json::{Value, json};

use crate::script::{self, Dialect, Outcome, Request, Script, content_text, words};

/// Anthropic's error envelope; the error type follows the status as the real API's does.
pub fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// Checks and reads a Messages request. `Err` is the message of a 400 answer.
pub fn plan(body: &Value, headers: &HeaderMap) -> Result<Script, String> {
    if !headers.contains_key("anthropic-version") {
        return Err("anthropic-version: header is required".into());
    }
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .ok_or("model: Field required")?;
    match body.get("max_tokens").and_then(Value::as_u64) {
        Some(n) if n >= 1 => {}
        Some(_) => return Err("max_tokens: Input should be greater than or equal to 1".into()),
        None => return Err("max_tokens: Field required".into()),
    }
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("messages: Field required")?;
    let system = system_text(body.get("system"))?;
    check_tools(body.get("tools"))?;
    check_messages(messages)?;
    let has_tools = body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    let tool_blocks = messages
        .iter()
        .flat_map(blocks)
        .any(|b| matches!(kind(b), "tool_use" | "tool_result"));
    if tool_blocks && !has_tools {
        return Err(
            "Requests which include `tool_use` or `tool_result` blocks must define tools.".into(),
        );
    }

    let last_user = messages
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"));
    let tool_result = last_user
        .and_then(|m| blocks(m).iter().rev().find(|b| kind(b) == "tool_result"))
        .map(|b| content_text(b.get("content")));
    // Like the OpenAI side reading the last `user` message: tool results are not user text,
    // so the directives of the prompt that started a tool loop still hold while it runs.
    let prompt = messages
        .iter()
        .rev()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .map(|m| text_of(m.get("content")))
        .find(|t| !t.is_empty())
        .unwrap_or_default();
    let prompt_tokens = words(&system) + messages.iter().map(message_words).sum::<usize>();

    let script = script::decide(Request {
        dialect: Dialect::Anthropic,
        model,
        stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: false,
        prompt,
        tool_result,
        prompt_tokens,
    })?;
    if let Outcome::ToolCalls(calls) = &script.outcome {
        for call in calls {
            if input(&call.arguments).is_none() {
                return Err(format!(
                    "`tool` directive for `{}`: Anthropic tool input must be a JSON object, got `{}`",
                    call.name, call.arguments
                ));
            }
        }
    }
    Ok(script)
}

fn kind(block: &Value) -> &str {
    block.get("type").and_then(Value::as_str).unwrap_or("")
}

/// A message's content blocks; a string content has none.
fn blocks(message: &Value) -> &[Value] {
    message
        .get("content")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// The user-visible text of a content: the string, or its text blocks joined by `\n`.
fn text_of(content: Option<&Value>) -> String {
    match content {
        Some(Value::Array(blocks)) => {
            let texts: Vec<&str> = blocks
                .iter()
                .filter(|b| kind(b) == "text")
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect();
            texts.join("\n")
        }
        other => content_text(other),
    }
}

/// How many words a message carries in text and tool results, for the token count.
fn message_words(message: &Value) -> usize {
    let tool_results: usize = blocks(message)
        .iter()
        .filter(|b| kind(b) == "tool_result")
        .map(|b| words(&content_text(b.get("content"))))
        .sum();
    words(&text_of(message.get("content"))) + tool_results
}

/// A tool directive's arguments as Anthropic's `input` object.
fn input(arguments: &str) -> Option<Value> {
    serde_json::from_str::<Value>(arguments)
        .ok()
        .filter(Value::is_object)
}

fn system_text(system: Option<&Value>) -> Result<String, String> {
    match system {
        None | Some(Value::Null) | Some(Value::String(_)) => Ok(content_text(system)),
        Some(Value::Array(blocks)) if blocks.iter().all(|b| kind(b) == "text") => {
            Ok(content_text(system))
        }
        Some(_) => Err("system: Input should be a valid string or a list of text blocks".into()),
    }
}

fn check_tools(tools: Option<&Value>) -> Result<(), String> {
    let Some(tools) = tools else {
        return Ok(());
    };
    let tools = tools
        .as_array()
        .ok_or("tools: Input should be a valid list")?;
    for (i, tool) in tools.iter().enumerate() {
        if tool.get("name").and_then(Value::as_str).is_none() {
            return Err(format!("tools.{i}.name: Field required"));
        }
        if !tool.get("input_schema").is_some_and(Value::is_object) {
            return Err(format!("tools.{i}.input_schema: Field required"));
        }
    }
    Ok(())
}

fn check_messages(messages: &[Value]) -> Result<(), String> {
    if messages.is_empty() {
        return Err("messages: at least one message is required".into());
    }
    let mut expected = "user";
    for (i, message) in messages.iter().enumerate() {
        let role = message.get("role").and_then(Value::as_str).unwrap_or("");
        if role != "user" && role != "assistant" {
            return Err(format!(
                "messages.{i}.role: Input should be 'user' or 'assistant'"
            ));
        }
        if role != expected {
            return Err(if i == 0 {
                "messages: first message must use the \"user\" role".to_owned()
            } else {
                format!(
                    "messages: roles must alternate between \"user\" and \"assistant\", but found multiple \"{role}\" roles in a row"
                )
            });
        }
        expected = if role == "user" { "assistant" } else { "user" };
        check_content(i, message.get("content"))?;
    }
    for (i, pair) in messages.windows(2).enumerate() {
        check_tool_pairing(i, &pair[0], &pair[1])?;
    }
    if let Some(first) = messages.first()
        && blocks(first).iter().any(|b| kind(b) == "tool_result")
    {
        return Err("messages.0: `tool_result` block(s) provided when previous message does not contain any `tool_use` blocks".into());
    }
    Ok(())
}

fn check_content(i: usize, content: Option<&Value>) -> Result<(), String> {
    let blocks = match content {
        Some(Value::String(_)) => return Ok(()),
        Some(Value::Array(blocks)) => blocks,
        _ => return Err(format!("messages.{i}.content: Field required")),
    };
    for (j, block) in blocks.iter().enumerate() {
        let text = |key: &str| block.get(key).and_then(Value::as_str);
        let problem = match kind(block) {
            "" => Some(".type: Field required"),
            "text" if text("text").unwrap_or("").trim().is_empty() => {
                Some(".text: text content blocks must contain non-whitespace text")
            }
            "tool_use"
                if text("id").is_none_or(str::is_empty)
                    || text("name").is_none()
                    || !block.get("input").is_some_and(Value::is_object) =>
            {
                Some(": tool_use needs `id`, `name` and an object `input`")
            }
            _ => None,
        };
        if let Some(problem) = problem {
            return Err(format!("messages.{i}.content.{j}{problem}"));
        }
    }
    Ok(())
}

/// An assistant's `tool_use` blocks must each be answered by a `tool_result` in the next
/// message, and a `tool_result` must answer one of them.
fn check_tool_pairing(i: usize, assistant: &Value, next: &Value) -> Result<(), String> {
    let ids = |m: &Value, block_kind: &str, key: &str| -> Vec<String> {
        blocks(m)
            .iter()
            .filter(|b| kind(b) == block_kind)
            .map(|b| b.get(key).and_then(Value::as_str).unwrap_or("").to_owned())
            .collect()
    };
    let uses = ids(assistant, "tool_use", "id");
    let results = ids(next, "tool_result", "tool_use_id");
    if let Some(orphan) = results.iter().find(|r| !uses.contains(r)) {
        return Err(format!(
            "messages.{}: unexpected `tool_use_id` found in `tool_result` blocks: {orphan}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
            i + 1
        ));
    }
    let unanswered: Vec<&str> = uses
        .iter()
        .filter(|u| !results.contains(u))
        .map(String::as_str)
        .collect();
    if !unanswered.is_empty() {
        return Err(format!(
            "messages.{}: `tool_use` ids were found without `tool_result` blocks immediately after: {}. Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
            i + 1,
            unanswered.join(", ")
        ));
    }
    Ok(())
}

fn stop_reason(script: &Script) -> &'static str {
    match script.outcome {
        Outcome::ToolCalls(_) => "tool_use",
        Outcome::Text(_) | Outcome::Error(_) => "end_turn",
    }
}

fn message_id() -> String {
    format!("msg_{}", uuid::Uuid::new_v4().simple())
}

/// The content blocks of the answer, tool inputs as objects.
fn content(script: &Script) -> Vec<Value> {
    match &script.outcome {
        Outcome::Text(text) => vec![json!({"type": "text", "text": text})],
        Outcome::ToolCalls(calls) => calls
            .iter()
            .map(|c| {
                // `plan` refused arguments that are not an object, so `{}` is never used.
                let input = input(&c.arguments).unwrap_or_else(|| json!({}));
                json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input})
            })
            .collect(),
        Outcome::Error(_) => Vec::new(),
    }
}

/// The `message` object of a non-streaming success.
pub fn message(script: &Script) -> Value {
    json!({
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": script.model,
        "content": content(script),
        "stop_reason": stop_reason(script),
        "stop_sequence": null,
        "usage": {
            "input_tokens": script.prompt_tokens,
            "output_tokens": script.completion_tokens(),
        },
    })
}

fn event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// Every SSE event of a streaming success, in the real API's order: `message_start`, then per
/// content block a start, deltas and a stop (a `ping` after the first start), `message_delta`
/// with the stop reason and usage, `message_stop`.
pub fn events(script: &Script) -> Vec<String> {
    let mut start = message(script);
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    // The real API reports a token or so of output up front and the true count at the end.
    start["usage"]["output_tokens"] = json!(1);
    let mut events = vec![event(
        "message_start",
        &json!({"type": "message_start", "message": start}),
    )];
    for (index, block) in content(script).into_iter().enumerate() {
        let (empty, deltas) = match (&script.outcome, kind(&block)) {
            (Outcome::Text(text), "text") => {
                let deltas: Vec<Value> = script
                    .text_pieces(text)
                    .into_iter()
                    .map(|piece| json!({"type": "text_delta", "text": piece}))
                    .collect();
                (json!({"type": "text", "text": ""}), deltas)
            }
            _ => {
                let whole = block.get("input").map(Value::to_string).unwrap_or_default();
                let deltas: Vec<Value> = script
                    .argument_pieces(&whole)
                    .into_iter()
                    .map(|piece| json!({"type": "input_json_delta", "partial_json": piece}))
                    .collect();
                let mut empty = block;
                empty["input"] = json!({});
                (empty, deltas)
            }
        };
        events.push(event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": empty}),
        ));
        if index == 0 {
            events.push(event("ping", &json!({"type": "ping"})));
        }
        for delta in deltas {
            events.push(event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": index, "delta": delta}),
            ));
        }
        events.push(event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": index}),
        ));
    }
    events.push(event(
        "message_delta",
        &json!({
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(script), "stop_sequence": null},
            "usage": {"output_tokens": script.completion_tokens()},
        }),
    ));
    events.push(event("message_stop", &json!({"type": "message_stop"})));
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            "anthropic-version",
            http::HeaderValue::from_static("2023-06-01"),
        );
        h
    }

    fn body(messages: Value) -> Value {
        json!({"model": "claude-test", "max_tokens": 100, "messages": messages,
               "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
    }

    #[test]
    fn tool_blocks_need_tool_definitions() {
        let mut b = body(json!([
            user("go"),
            tool_turn(&["t1"]),
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}
        ]));
        assert!(plan(&b, &headers()).is_ok());
        b.as_object_mut().map(|o| o.remove("tools"));
        let err = plan(&b, &headers()).map(|_| ()).expect_err("refused");
        assert!(err.contains("must define tools"), "{err}");
    }

    fn text_of_plan(b: &Value) -> String {
        match plan(b, &headers()).map(|s| s.outcome) {
            Ok(Outcome::Text(t)) => t,
            other => panic!("expected text, got {other:?}"),
        }
    }

    fn user(text: &str) -> Value {
        json!({"role": "user", "content": text})
    }

    fn tool_turn(ids: &[&str]) -> Value {
        let uses: Vec<Value> = ids
            .iter()
            .map(|id| json!({"type": "tool_use", "id": id, "name": "f", "input": {}}))
            .collect();
        json!({"role": "assistant", "content": uses})
    }

    fn results(ids: &[&str]) -> Value {
        let results: Vec<Value> = ids
            .iter()
            .map(|id| json!({"type": "tool_result", "tool_use_id": id, "content": format!("r-{id}")}))
            .collect();
        json!({"role": "user", "content": results})
    }

    /// Each case: a request the real API refuses, and a word its message must contain.
    #[test]
    fn invalid_requests_are_refused_like_the_real_api() {
        let ok = body(json!([user("hi")]));
        let without = |key: &str| {
            let mut b = ok.clone();
            b.as_object_mut().map(|o| o.remove(key));
            b
        };
        let cases = [
            (without("max_tokens"), "max_tokens"),
            (without("model"), "model"),
            (without("messages"), "messages"),
            (body(json!([])), "at least one"),
            (body(json!([{"role": "system", "content": "x"}])), "role"),
            (
                body(json!([user("a"), {"role": "tool", "content": "x"}])),
                "role",
            ),
            (
                body(json!([{"role": "assistant", "content": "x"}])),
                "first",
            ),
            (body(json!([user("a"), user("b")])), "alternate"),
            (
                body(
                    json!([user("a"), {"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]),
                ),
                "alternate",
            ),
            (
                body(json!([user("a"), tool_turn(&["t1"]), results(&["t2"])])),
                "t2",
            ),
            (
                body(json!([
                    user("a"),
                    tool_turn(&["t1", "t2"]),
                    results(&["t1"])
                ])),
                "t2",
            ),
            (body(json!([results(&["t1"])])), "tool_result"),
            (
                body(json!([{"role": "user", "content": [{"type": "text", "text": " "}]}])),
                "non-whitespace",
            ),
            (
                body(json!([{"role": "user", "content": [{"text": "x"}]}])),
                "type",
            ),
            (body(json!([{"role": "user"}])), "content"),
            (
                {
                    let mut b = ok.clone();
                    b["tools"] = json!([{"input_schema": {"type": "object"}}]);
                    b
                },
                "tools.0.name",
            ),
            (
                {
                    let mut b = ok.clone();
                    b["tools"] = json!([{"name": "f", "parameters": {"type": "object"}}]);
                    b
                },
                "input_schema",
            ),
            (
                {
                    let mut b = ok.clone();
                    b["system"] = json!(42);
                    b
                },
                "system",
            ),
            (body(json!([user("[[fake:tool=f:[1,2]]]")])), "JSON object"),
            (body(json!([user("[[fake:nope=1]]")])), "nope"),
        ];
        for (bad, needle) in cases {
            let err = plan(&bad, &headers()).expect_err(&bad.to_string());
            assert!(err.contains(needle), "{bad}: `{err}` lacks `{needle}`");
        }
        assert!(
            plan(&ok, &HeaderMap::new()).is_err(),
            "anthropic-version is required"
        );
        assert!(plan(&ok, &headers()).is_ok());
    }

    #[test]
    fn answers_follow_the_openai_rules() {
        // Echo of the last user text, text blocks joined, directives stripped.
        let b = body(json!([{"role": "user", "content": [
            {"type": "text", "text": "hello"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}},
            {"type": "text", "text": "there [[fake:slow=5]]"},
        ]}]));
        let s = plan(&b, &headers()).expect("plan");
        assert_eq!(text_of_plan(&b), "echo: hello\nthere");
        assert_eq!(s.slow, std::time::Duration::from_millis(5));
        assert_eq!(s.dialect, Dialect::Anthropic);

        // The last tool result ends the loop, even though the prompt asked for a tool.
        let loop_body = body(json!([
            user("go [[fake:tool=f]]"),
            tool_turn(&["t1", "t2"]),
            results(&["t1", "t2"]),
        ]));
        assert_eq!(text_of_plan(&loop_body), "tool result: r-t2");

        // ... unless a reply is scripted.
        let replied = body(json!([
            user("go [[fake:tool=f]] [[fake:reply=done]]"),
            tool_turn(&["t1"]),
            results(&["t1"]),
        ]));
        assert_eq!(text_of_plan(&replied), "done");

        // Tool directives make tool_use blocks with toolu_ ids.
        let tools = body(json!([user(
            r#"[[fake:tool=get_weather:{"city":"Paris"}]][[fake:tool=clock]]"#
        )]));
        let s = plan(&tools, &headers()).expect("plan");
        let m = message(&s);
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(m["content"][0]["name"], "get_weather");
        assert_eq!(m["content"][0]["input"], json!({"city": "Paris"}));
        assert_eq!(m["content"][1]["input"], json!({}));
        assert!(
            m["content"][0]["id"]
                .as_str()
                .is_some_and(|id| id.starts_with("toolu_"))
        );
    }

    /// Each event is `event: NAME` and one `data:` line whose `type` is NAME (the order is
    /// checked over HTTP in the integration tests).
    #[test]
    fn events_are_framed_like_the_api() {
        let b = body(json!([user("[[fake:tool=f:{\"a\":1}]]")]));
        for framed in events(&plan(&b, &headers()).expect("plan")) {
            let (name, rest) = framed
                .strip_prefix("event: ")
                .and_then(|e| e.split_once("\ndata: "))
                .expect("event and data lines");
            let data = rest.strip_suffix("\n\n").expect("blank line after");
            let data: Value = serde_json::from_str(data).expect("one line of JSON");
            assert_eq!(data["type"], name);
        }
    }
}
