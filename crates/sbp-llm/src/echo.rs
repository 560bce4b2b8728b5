//! The built-in offline model `sbp/echo`: deterministic, no network, so a fresh gateway answers turns
//! with nothing configured. It repeats the last user message, bounded by `max_tokens` (in words),
//! and it can call tools, so the gateway's agent loop runs end to end without an LLM.
//!
//! The rules, applied to the request's `messages` (streamed or not, the same answer):
//!
//! - **A tool result**: when the last message has role `tool`, the reply is
//!   `Echo: <function> returned <content>`, where `<function>` is the name of the assistant
//!   `tool_calls` entry whose `id` is the message's `tool_call_id` (`a tool` when there is none).
//!   Several trailing tool messages (parallel calls) are answered in one reply, joined by `; `.
//! - **A tool call**: when the request offers `tools` (and `tool_choice` allows a call) and the
//!   last message is a user message whose text holds `[call NAME]` or `[call NAME {JSON object}]`,
//!   the reply calls every offered function that such a directive names, in the order written.
//!   `NAME` matches a function's name exactly, or with its gateway prefix removed (`surface_gps`
//!   and `mcp__files__gps` are both `gps`); an exact match wins, then the first in `tools`.
//!   `tool_choice`: `"none"` (or `{"type":"none"}`) allows no call; a named function
//!   (`{"type":"function","function":{"name":F}}`, or Anthropic's `{"type":"tool","name":F}`)
//!   allows only `F`, so directives naming other tools are ignored; `"auto"`, `"required"` or
//!   none at all allow every offered function. Echo cannot invent arguments, so even under
//!   `"required"` or a named function it calls only what a directive asks for: without one the
//!   reply is the echo below, where a real model would have had to call something. Each
//!   call has a fresh `call_<uuid>` id and its arguments as compact JSON text (`{}` without them);
//!   `finish_reason` is `tool_calls`, `content` null. Streamed, each call is a `tool_calls` delta
//!   carrying its index, id and name, then its arguments in two pieces, as OpenAI streams them.
//! - **Otherwise** (no tools offered, no directive, or no directive names an offered tool): the
//!   reply is `Echo: <last user message>`. When that message starts with a Markdown block (a
//!   heading, list item, quote, table row or code fence), `Echo:` stands on a line of its own so
//!   the blocks stay blocks: a Markdown message comes back as Markdown.
//!
//! `usage` counts words (prompt: every message's text; completion: the reply's text, or each
//! call's name and arguments); a stream carries it on its last chunk.

use async_trait::async_trait;
use futures::StreamExt;
use sbp_protocol::{ChatMessage, ChatRequest};
use serde_json::{Value, json};

use crate::tool_names::{SERVER_PREFIX, SURFACE_PREFIX};
use crate::{ChunkStream, Completion, LlmError, Provider};

pub const ECHO_MODEL: &str = "sbp/echo";

/// What opens a tool-call directive in a user message.
const DIRECTIVE: &str = "[call ";

#[derive(Debug, Default, Clone)]
pub struct EchoProvider;

/// What the model answers.
#[derive(Debug, Clone, PartialEq)]
enum Reply {
    Text(String),
    Calls(Vec<Call>),
}

/// One function call of a reply.
#[derive(Debug, Clone, PartialEq)]
struct Call {
    id: String,
    function: String,
    /// JSON text, as OpenAI sends arguments.
    arguments: String,
}

impl Call {
    fn json(&self) -> Value {
        json!({"id": self.id, "type": "function",
               "function": {"name": self.function, "arguments": self.arguments}})
    }
}

impl EchoProvider {
    /// The reply and its usage, from the request's messages read once (its prior parsed).
    fn answer(body: &ChatRequest) -> (Reply, Value) {
        let messages = body.all_messages();
        let reply = Self::reply(body, &messages);
        let usage = usage(&messages, &reply_words(&reply));
        (reply, usage)
    }

    fn reply(body: &ChatRequest, messages: &[ChatMessage]) -> Reply {
        if let Some(text) = tool_results(messages) {
            return Reply::Text(bounded(body, text));
        }
        if let Some(calls) = tool_calls(body, messages) {
            return Reply::Calls(calls);
        }
        let last_user = messages
            .iter()
            .rev()
            .find(|m| m.role() == Some("user"))
            .and_then(ChatMessage::text)
            .unwrap_or_default();
        let text = if last_user.trim().is_empty() {
            "Echo: (no user message)".to_owned()
        } else if starts_with_block(&last_user) {
            format!("Echo:\n\n{last_user}")
        } else {
            format!("Echo: {last_user}")
        };
        Reply::Text(bounded(body, text))
    }

    fn id() -> String {
        format!("chatcmpl-echo-{}", uuid::Uuid::new_v4().simple())
    }
}

/// `text` cut to the request's `max_tokens` (or `max_completion_tokens`), counted in words.
fn bounded(body: &ChatRequest, text: String) -> String {
    match body.output_token_limit() {
        Some(n) => first_words(&text, usize::try_from(n).unwrap_or(usize::MAX)).to_owned(),
        None => text,
    }
}

/// The first `n` words of `text` (a word being a run of non-whitespace, as `usage` counts them),
/// with the whitespace between them as written: a Markdown reply keeps its line breaks, and a
/// newline counts as a separator just as a space does.
fn first_words(text: &str, n: usize) -> &str {
    if n == 0 {
        return "";
    }
    let mut words = 0;
    let mut in_word = false;
    for (i, c) in text.char_indices() {
        if c.is_whitespace() {
            if in_word {
                words += 1;
                in_word = false;
                if words == n {
                    return &text[..i];
                }
            }
        } else {
            if words == n {
                return &text[..i];
            }
            in_word = true;
        }
    }
    text.trim_end()
}

/// Whether the first line of `text` opens a Markdown block that a prefix would break.
fn starts_with_block(text: &str) -> bool {
    let first = text.trim_start_matches(['\n', '\r']);
    let ordered = first
        .split_once(". ")
        .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
    ["#", "- ", "* ", "+ ", "> ", "|", "```"]
        .iter()
        .any(|p| first.starts_with(p))
        || ordered
}

/// The answer to trailing tool messages, when the conversation ends with some.
fn tool_results(messages: &[ChatMessage]) -> Option<String> {
    let trailing = messages
        .iter()
        .rev()
        .take_while(|m| m.role() == Some("tool"))
        .count();
    if trailing == 0 {
        return None;
    }
    let results = &messages[messages.len() - trailing..];
    let parts: Vec<String> = results
        .iter()
        .map(|m| {
            let name = m
                .tool_call_id()
                .and_then(|id| called_function(messages, id))
                .unwrap_or("a tool");
            let content = m.text().unwrap_or_default();
            format!("{name} returned {content}")
        })
        .collect();
    Some(format!("Echo: {}", parts.join("; ")))
}

/// The function name of the assistant tool call whose id is `id`.
fn called_function<'a>(messages: &'a [ChatMessage], id: &str) -> Option<&'a str> {
    messages
        .iter()
        .rev()
        .filter(|m| m.role() == Some("assistant"))
        .flat_map(ChatMessage::tool_calls)
        .find(|c| c.id() == Some(id))
        .and_then(|c| c.name())
}

/// The calls the last user message asks for, when the request offers tools and at least one
/// directive names one of them.
fn tool_calls(body: &ChatRequest, messages: &[ChatMessage]) -> Option<Vec<Call>> {
    let mut offered = body.declared_functions();
    match tool_choice(body.tool_choice.as_ref()) {
        Choice::None => return None,
        Choice::Any => {}
        Choice::Only(name) => offered.retain(|f| *f == name),
    }
    if offered.is_empty() {
        return None;
    }
    let last = messages.last().filter(|m| m.role() == Some("user"))?;
    let text = last.text()?;
    let calls: Vec<Call> = directives(&text)
        .into_iter()
        .filter_map(|(name, arguments)| {
            let function = resolve(&offered, &name)?;
            Some(Call {
                id: format!("call_{}", uuid::Uuid::new_v4().simple()),
                function: function.to_owned(),
                arguments,
            })
        })
        .collect();
    (!calls.is_empty()).then_some(calls)
}

/// What the request's `tool_choice` lets the model call.
#[derive(Debug, PartialEq)]
enum Choice {
    None,
    /// Any offered function (`"auto"`, `"required"`, absent, or a value echo does not know).
    Any,
    /// Only the function of this name.
    Only(String),
}

fn tool_choice(choice: Option<&Value>) -> Choice {
    match choice {
        Some(Value::String(s)) if s == "none" => Choice::None,
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("none") => {
            Choice::None
        }
        Some(choice @ Value::Object(_)) => choice
            .pointer("/function/name")
            .or_else(|| choice.get("name"))
            .and_then(Value::as_str)
            .map_or(Choice::Any, |name| Choice::Only(name.to_owned())),
        _ => Choice::Any,
    }
}

/// The offered function `name` stands for: its exact name first, then one whose name without
/// the gateway's prefix is `name`.
fn resolve<'a>(offered: &[&'a str], name: &str) -> Option<&'a str> {
    let unprefixed = |f: &str| -> Option<String> {
        if let Some(tool) = f.strip_prefix(SURFACE_PREFIX) {
            return Some(tool.to_owned());
        }
        let (_server, tool) = f.strip_prefix(SERVER_PREFIX)?.split_once("__")?;
        Some(tool.to_owned())
    };
    offered
        .iter()
        .find(|f| **f == name)
        .or_else(|| {
            offered
                .iter()
                .find(|f| unprefixed(f).as_deref() == Some(name))
        })
        .copied()
}

/// Every well-formed `[call NAME]` / `[call NAME {...}]` in `text`: the name and the arguments as
/// compact JSON text. A directive whose arguments are not one JSON object is not one.
fn directives(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(DIRECTIVE) {
        let after = &rest[at + DIRECTIVE.len()..];
        match directive(after) {
            Some((name, args, used)) => {
                found.push((name, args));
                rest = &after[used..];
            }
            None => rest = after,
        }
    }
    found
}

/// Parses `NAME]` or `NAME {json}]` at the start of `s`; returns the name, the arguments and how
/// many bytes were read.
fn directive(s: &str) -> Option<(String, String, usize)> {
    let start = s.len() - s.trim_start().len();
    let name_len = s[start..]
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .unwrap_or(s.len() - start);
    if name_len == 0 {
        return None;
    }
    let name = s[start..start + name_len].to_owned();
    let mut pos = start + name_len;
    pos += s[pos..].len() - s[pos..].trim_start().len();
    let args = if s[pos..].starts_with('{') {
        let mut values = serde_json::Deserializer::from_str(&s[pos..]).into_iter::<Value>();
        let value = values.next()?.ok().filter(Value::is_object)?;
        pos += values.byte_offset();
        pos += s[pos..].len() - s[pos..].trim_start().len();
        value.to_string()
    } else {
        "{}".to_owned()
    };
    s[pos..]
        .starts_with(']')
        .then(|| (name, args, pos + ']'.len_utf8()))
}

fn usage(messages: &[ChatMessage], reply: &str) -> Value {
    let prompt_words: usize = messages
        .iter()
        .filter_map(ChatMessage::text)
        .map(|t| t.split_whitespace().count())
        .sum();
    let completion = reply.split_whitespace().count();
    json!({"prompt_tokens": prompt_words, "completion_tokens": completion, "total_tokens": prompt_words + completion})
}

/// The words a reply counts for `usage`: its text, or each call's name and arguments.
fn reply_words(reply: &Reply) -> String {
    match reply {
        Reply::Text(t) => t.clone(),
        Reply::Calls(calls) => calls
            .iter()
            .map(|c| format!("{} {}", c.function, c.arguments))
            .collect::<Vec<_>>()
            .join(" "),
    }
}

#[async_trait]
impl Provider for EchoProvider {
    fn route_name(&self, _requested: &str) -> String {
        ECHO_MODEL.to_owned()
    }

    fn provider_name(&self, _requested: &str) -> &'static str {
        "echo"
    }

    async fn complete(&self, body: ChatRequest) -> Result<Completion, LlmError> {
        let (reply, usage) = Self::answer(&body);
        let (message, finish) = match &reply {
            Reply::Text(text) => (json!({"role": "assistant", "content": text}), "stop"),
            Reply::Calls(calls) => (
                json!({"role": "assistant", "content": null,
                       "tool_calls": calls.iter().map(Call::json).collect::<Vec<_>>()}),
                "tool_calls",
            ),
        };
        let response = json!({
            "id": Self::id(),
            "object": "chat.completion",
            "created": chrono::Utc::now().timestamp(),
            "model": ECHO_MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage,
        });
        Completion::from_body(response, ECHO_MODEL)
    }

    async fn models(&self) -> Result<Vec<Value>, LlmError> {
        Ok(vec![serde_json::json!({
            "id": ECHO_MODEL,
            "object": "model",
            "created": 0,
            "owned_by": "sbp",
        })])
    }

    async fn stream(&self, body: ChatRequest) -> Result<ChunkStream, LlmError> {
        let (reply, usage) = Self::answer(&body);
        let id = Self::id();
        let created = chrono::Utc::now().timestamp();
        let chunk = move |delta: Value, finish: Value| {
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": ECHO_MODEL,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        };
        // The last chunk carries the usage, as OpenAI's does with `include_usage`: a caller that
        // assembles the stream gets the same counts as a whole completion.
        let last = |finish: &str| {
            let mut c = chunk(json!({}), json!(finish));
            c["usage"] = usage.clone();
            c
        };
        let chunks = match reply {
            Reply::Text(text) => {
                let mut chunks = vec![chunk(
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                )];
                chunks.extend(
                    text.split_inclusive(' ')
                        .map(|w| chunk(json!({"content": w}), Value::Null)),
                );
                chunks.push(last("stop"));
                chunks
            }
            Reply::Calls(calls) => {
                // A tool-call turn has no text: `content` is null, so assemblers keep it null.
                let mut chunks = vec![chunk(
                    json!({"role": "assistant", "content": null}),
                    Value::Null,
                )];
                for (index, call) in calls.iter().enumerate() {
                    chunks.push(chunk(
                        json!({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                               "function": {"name": call.function, "arguments": ""}}]}),
                        Value::Null,
                    ));
                    // Arguments arrive in pieces upstream; two exercise the merging by index.
                    let mid = call.arguments.len() / 2;
                    let mid = (0..=mid)
                        .rev()
                        .find(|&i| call.arguments.is_char_boundary(i))
                        .unwrap_or(0);
                    for piece in [&call.arguments[..mid], &call.arguments[mid..]] {
                        chunks.push(chunk(
                            json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}),
                            Value::Null,
                        ));
                    }
                }
                chunks.push(last("tool_calls"));
                chunks
            }
        };
        Ok(futures::stream::iter(chunks.into_iter().map(Ok)).boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Assembler;

    fn body(v: Value) -> ChatRequest {
        crate::test_request(v)
    }

    fn gps_tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "surface_gps", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "mcp__files__read", "parameters": {"type": "object"}}},
        ])
    }

    async fn streamed(b: ChatRequest) -> (Assembler, Vec<Value>) {
        let mut s = EchoProvider.stream(b).await.expect("streams");
        let mut a = Assembler::default();
        let mut chunks = Vec::new();
        while let Some(chunk) = s.next().await {
            let chunk = chunk.expect("chunk");
            a.push(&chunk);
            chunks.push(chunk);
        }
        (a, chunks)
    }

    #[tokio::test]
    async fn echoes_the_last_user_message_deterministically() {
        let b = body(json!({"model": "gpt-4o", "messages": [
            {"role": "user", "content": "first"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]}));
        let c = EchoProvider.complete(b.clone()).await.expect("completes");
        assert_eq!(c.text(), Some("Echo: hello there"));
        assert_eq!(c.model, ECHO_MODEL);
        let (a, _) = streamed(b).await;
        assert_eq!(a.content(), "Echo: hello there");
        assert_eq!(a.finish_reason.as_deref(), Some("stop"));
        assert_eq!(
            a.usage.as_ref(),
            c.body.get("usage"),
            "streamed usage is the same"
        );
        assert_eq!(c.body["usage"]["completion_tokens"], 3);
    }

    #[tokio::test]
    async fn max_tokens_bounds_the_reply() {
        let b = body(
            json!({"max_tokens": 3, "messages": [{"role": "user", "content": "one two three four five"}]}),
        );
        let c = EchoProvider.complete(b).await.expect("completes");
        assert_eq!(c.text(), Some("Echo: one two"));
    }

    #[tokio::test]
    async fn max_tokens_counts_words_across_line_breaks() {
        let md = "- one\n- two\n- three\n- four";
        let b = body(json!({"max_tokens": 5, "messages": [{"role": "user", "content": md}]}));
        let c = EchoProvider.complete(b).await.expect("completes");
        // Five words (`Echo:`, the dashes, the items): line breaks separate words and are kept.
        assert_eq!(c.text(), Some("Echo:\n\n- one\n- two"));
        assert_eq!(c.body["usage"]["completion_tokens"], 5);
    }

    #[test]
    fn first_words_keeps_the_separators_as_written() {
        assert_eq!(first_words("a\tb\n\nc d", 2), "a\tb");
        assert_eq!(first_words("a\tb\n\nc d", 3), "a\tb\n\nc");
        assert_eq!(first_words("  a b  ", 5), "  a b");
        assert_eq!(first_words("a b", 0), "");
        assert_eq!(first_words("", 3), "");
    }

    #[tokio::test]
    async fn a_named_tool_choice_allows_only_that_function() {
        let text = r#"[call lookup {"q":"x"}] [call gps]"#;
        for choice in [
            json!({"type": "function", "function": {"name": "surface_gps"}}),
            json!({"type": "tool", "name": "surface_gps"}),
        ] {
            let b = body(json!({"tools": gps_tools(), "tool_choice": choice,
                                "messages": [{"role": "user", "content": text}]}));
            let c = EchoProvider.complete(b).await.expect("completes");
            let calls = c.message["tool_calls"].as_array().expect("tool_calls");
            let names: Vec<&str> = calls
                .iter()
                .filter_map(|c| c["function"]["name"].as_str())
                .collect();
            assert_eq!(names, vec!["surface_gps"], "{choice}");
        }
        // A named function no directive asks for: echo cannot make up its arguments.
        let b = body(json!({"tools": gps_tools(),
            "tool_choice": {"type": "function", "function": {"name": "lookup"}},
            "messages": [{"role": "user", "content": "[call gps]"}]}));
        let c = EchoProvider.complete(b).await.expect("completes");
        assert_eq!(c.text(), Some("Echo: [call gps]"));
    }

    #[tokio::test]
    async fn required_tool_choice_still_needs_a_directive() {
        let with = body(json!({"tools": gps_tools(), "tool_choice": "required",
                               "messages": [{"role": "user", "content": "[call gps]"}]}));
        let c = EchoProvider.complete(with).await.expect("completes");
        assert_eq!(c.finish_reason.as_deref(), Some("tool_calls"));
        let without = body(json!({"tools": gps_tools(), "tool_choice": "required",
                                  "messages": [{"role": "user", "content": "where am I?"}]}));
        let c = EchoProvider.complete(without).await.expect("completes");
        assert_eq!(c.text(), Some("Echo: where am I?"));
        let none = body(
            json!({"tools": gps_tools(), "tool_choice": {"type": "none"},
                               "messages": [{"role": "user", "content": "[call gps]"}]}),
        );
        let c = EchoProvider.complete(none).await.expect("completes");
        assert_eq!(c.text(), Some("Echo: [call gps]"));
    }

    #[tokio::test]
    async fn a_directive_naming_an_offered_tool_is_a_tool_call() {
        let b = body(json!({"tools": gps_tools(), "messages": [
            {"role": "user", "content": "Where am I? [call gps]"}]}));
        let c = EchoProvider.complete(b).await.expect("completes");
        assert_eq!(c.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(c.message["content"], Value::Null);
        let calls = c.message["tool_calls"].as_array().expect("tool_calls");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(
            calls[0]["function"]["name"], "surface_gps",
            "the prefix is stripped to match"
        );
        assert_eq!(calls[0]["function"]["arguments"], "{}");
        let id = calls[0]["id"].as_str().expect("id");
        assert!(id.starts_with("call_") && id.len() > 10, "{id}");
        assert_eq!(c.body["choices"][0]["finish_reason"], "tool_calls");
    }

    #[tokio::test]
    async fn arguments_are_parsed_and_names_match_exactly_or_unprefixed() {
        let text = r#"[call read {"path": "a]b", "n": [1, 2]}] then [call lookup {"q":"x"} ] and [call surface_gps]"#;
        let b =
            body(json!({"tools": gps_tools(), "messages": [{"role": "user", "content": text}]}));
        let c = EchoProvider.complete(b).await.expect("completes");
        let calls = c.message["tool_calls"].as_array().expect("tool_calls");
        let got: Vec<(&str, Value)> = calls
            .iter()
            .map(|c| {
                let args = c["function"]["arguments"].as_str().expect("text");
                (
                    c["function"]["name"].as_str().expect("name"),
                    serde_json::from_str(args).expect("arguments are JSON text"),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("mcp__files__read", json!({"path": "a]b", "n": [1, 2]})),
                ("lookup", json!({"q": "x"})),
                ("surface_gps", json!({})),
            ]
        );
        let ids: std::collections::HashSet<&str> =
            calls.iter().filter_map(|c| c["id"].as_str()).collect();
        assert_eq!(ids.len(), 3, "each call has its own id");
    }

    #[tokio::test]
    async fn streamed_deltas_assemble_to_the_same_calls() {
        let b = body(json!({"tools": gps_tools(), "messages": [
            {"role": "user", "content": r#"[call gps {"accuracy": "fine"}] [call lookup]"#}]}));
        let whole = EchoProvider.complete(b.clone()).await.expect("completes");
        let (a, chunks) = streamed(b).await;
        assert_eq!(a.finish_reason.as_deref(), Some("tool_calls"));
        let msg = a.message();
        assert_eq!(msg["content"], Value::Null);
        let strip_ids = |calls: &Value| -> Vec<Value> {
            calls
                .as_array()
                .expect("calls")
                .iter()
                .map(|c| {
                    let mut c = c.clone();
                    c["id"] = Value::Null;
                    c
                })
                .collect()
        };
        // Ids are fresh per answer; everything else is the same call.
        assert_eq!(
            strip_ids(&msg["tool_calls"]),
            strip_ids(&whole.message["tool_calls"])
        );
        assert_eq!(
            msg["tool_calls"][0]["function"]["arguments"],
            r#"{"accuracy":"fine"}"#
        );
        // The arguments really came in more than one delta.
        let pieces = chunks
            .iter()
            .filter(|c| {
                c.pointer("/choices/0/delta/tool_calls/0/function/arguments")
                    .is_some()
            })
            .count();
        assert!(pieces >= 4, "{chunks:?}");
    }

    #[tokio::test]
    async fn a_tool_result_is_echoed_with_the_called_function() {
        let b = body(json!({"tools": gps_tools(), "messages": [
            {"role": "user", "content": "Where am I? [call gps]"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "surface_gps", "arguments": "{}"}},
                {"id": "call_b", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_a", "content": "{\"lat\":35.68,\"lon\":139.76}"},
            {"role": "tool", "tool_call_id": "call_b", "content": "nothing"}]}));
        let c = EchoProvider.complete(b.clone()).await.expect("completes");
        let want =
            "Echo: surface_gps returned {\"lat\":35.68,\"lon\":139.76}; lookup returned nothing";
        assert_eq!(c.text(), Some(want));
        assert_eq!(c.finish_reason.as_deref(), Some("stop"));
        let (a, _) = streamed(b).await;
        assert_eq!(a.content(), want);
        assert!(a.message().get("tool_calls").is_none());
    }

    #[tokio::test]
    async fn without_tools_or_a_known_name_the_reply_is_the_echo() {
        let text = "Where am I? [call gps]";
        let cases = [
            json!({"messages": [{"role": "user", "content": text}]}),
            json!({"tools": [], "messages": [{"role": "user", "content": text}]}),
            json!({"tools": gps_tools(), "tool_choice": "none", "messages": [{"role": "user", "content": text}]}),
            json!({"tools": gps_tools(), "messages": [{"role": "user", "content": "[call camera] [call gps {oops}]"}]}),
        ];
        for case in cases {
            let want = format!(
                "Echo: {}",
                case["messages"][0]["content"].as_str().expect("text")
            );
            let c = EchoProvider
                .complete(body(case.clone()))
                .await
                .expect("completes");
            assert_eq!(c.text(), Some(want.as_str()), "{case}");
            assert!(c.message.get("tool_calls").is_none(), "{case}");
            let (a, _) = streamed(body(case.clone())).await;
            assert_eq!(a.content(), want, "{case}");
            assert_eq!(a.finish_reason.as_deref(), Some("stop"), "{case}");
        }
    }

    #[tokio::test]
    async fn markdown_comes_back_as_markdown() {
        let md = "- **Day 1**: Shinjuku\n- **Day 2**: Asakusa";
        let b = body(json!({"messages": [{"role": "user", "content": md}]}));
        let c = EchoProvider.complete(b).await.expect("completes");
        assert_eq!(c.text(), Some(format!("Echo:\n\n{md}").as_str()));
        let inline = "Plan:\n\n| a | b |\n|---|---|";
        let b = body(json!({"messages": [{"role": "user", "content": inline}]}));
        let c = EchoProvider.complete(b).await.expect("completes");
        assert_eq!(c.text(), Some(format!("Echo: {inline}").as_str()));
    }
}
