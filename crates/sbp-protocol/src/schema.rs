//! OpenAI's chat message schema, checked before a message is stored: a message a strict upstream
//! would refuse must never enter a transcript, or every later turn of its session fails there.
//!
//! The check is per message (the shape of each field), as OpenAI's own request validation is; it
//! does not check the order of a conversation (a tool message answering an earlier call). Unknown
//! keys are allowed: vendor extensions travel with the message. A `null` optional field is absent.
//! Content-part types beyond OpenAI's are accepted in user messages only, where other
//! OpenAI-compatible servers define their own (vLLM's `video_url`).

use serde_json::{Map, Value};

/// The roles OpenAI's chat completions accept.
pub const ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// A field that does not fit the schema: where it is (`messages[3].role`) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{param}` {reason}")]
pub struct InvalidField {
    /// The path of the field, as OpenAI names it in its `param` (`messages[3].tool_calls[0].id`).
    pub param: String,
    pub reason: String,
}

impl InvalidField {
    pub fn new(param: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            param: param.into(),
            reason: reason.into(),
        }
    }
}

type Checked = Result<(), InvalidField>;

/// Checks one chat message found at `path` (e.g. `messages[3]`).
pub fn check_message(path: &str, message: &Value) -> Checked {
    let Value::Object(m) = message else {
        return Err(InvalidField::new(path, "must be an object"));
    };
    let at = |field: &str| format!("{path}.{field}");
    let role = match m.get("role") {
        Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.as_str(),
        None | Some(Value::Null) => return Err(InvalidField::new(at("role"), "is required")),
        Some(_) => {
            return Err(InvalidField::new(
                at("role"),
                format!("must be one of {}", ROLES.join(", ")),
            ));
        }
    };
    optional_string(m, "name", &at("name"))?;
    match role {
        "assistant" => check_assistant(m, path)?,
        "tool" => {
            required_string(m, "tool_call_id", &at("tool_call_id"))?;
            check_content(m, path, role, false)?;
        }
        "function" => {
            required_string(m, "name", &at("name"))?;
            check_content(m, path, role, true)?;
        }
        _ => check_content(m, path, role, false)?,
    }
    Ok(())
}

fn check_assistant(m: &Map<String, Value>, path: &str) -> Checked {
    let at = |field: &str| format!("{path}.{field}");
    let mut acts = false;
    match m.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            for (i, call) in calls.iter().enumerate() {
                check_tool_call(&format!("{path}.tool_calls[{i}]"), call)?;
            }
            acts |= !calls.is_empty();
        }
        Some(_) => return Err(InvalidField::new(at("tool_calls"), "must be an array")),
    }
    match m.get("function_call") {
        None | Some(Value::Null) => {}
        Some(Value::Object(f)) => {
            let base = at("function_call");
            required_string(f, "name", &format!("{base}.name"))?;
            required_string(f, "arguments", &format!("{base}.arguments"))?;
            acts = true;
        }
        Some(_) => return Err(InvalidField::new(at("function_call"), "must be an object")),
    }
    acts |= optional_string(m, "refusal", &at("refusal"))?;
    // An assistant audio reply is referred to by `audio.id` instead of content.
    acts |= m.get("audio").is_some_and(|a| !a.is_null());
    check_content(m, path, "assistant", acts)
}

fn check_tool_call(path: &str, call: &Value) -> Checked {
    let Value::Object(c) = call else {
        return Err(InvalidField::new(path, "must be an object"));
    };
    required_string(c, "id", &format!("{path}.id"))?;
    let (kind, fields): (&str, [&str; 2]) = match c.get("type") {
        Some(Value::String(t)) if t == "function" => ("function", ["name", "arguments"]),
        Some(Value::String(t)) if t == "custom" => ("custom", ["name", "input"]),
        _ => {
            return Err(InvalidField::new(
                format!("{path}.type"),
                "must be \"function\" (or \"custom\")",
            ));
        }
    };
    let base = format!("{path}.{kind}");
    let Some(Value::Object(f)) = c.get(kind) else {
        return Err(InvalidField::new(base, "must be an object"));
    };
    for field in fields {
        required_string(f, field, &format!("{base}.{field}"))?;
    }
    Ok(())
}

/// `content`: a string or a non-empty array of parts; absent or `null` only when `may_be_empty`
/// (an assistant message that calls a tool, refuses or answers with audio; a function result).
fn check_content(m: &Map<String, Value>, path: &str, role: &str, may_be_empty: bool) -> Checked {
    let at = format!("{path}.content");
    match m.get("content") {
        Some(Value::String(_)) => Ok(()),
        None | Some(Value::Null) if may_be_empty => Ok(()),
        None | Some(Value::Null) => Err(InvalidField::new(
            at,
            match role {
                "assistant" => {
                    "is required unless the message has tool_calls, function_call, \
                                refusal or audio"
                }
                _ => "is required",
            },
        )),
        Some(Value::Array(parts)) if parts.is_empty() => Err(InvalidField::new(
            at,
            "must be a string or a non-empty array of content parts",
        )),
        Some(Value::Array(parts)) => {
            for (i, part) in parts.iter().enumerate() {
                check_part(&format!("{at}[{i}]"), role, part)?;
            }
            Ok(())
        }
        Some(_) => Err(InvalidField::new(
            at,
            "must be a string or an array of content parts",
        )),
    }
}

/// The part types each role may send, as OpenAI's schema lists them.
fn part_allowed(role: &str, kind: &str) -> bool {
    match role {
        // Other servers add their own types (vLLM's `video_url`): user messages keep them.
        "user" => kind != "refusal",
        "assistant" => matches!(kind, "text" | "refusal"),
        _ => kind == "text",
    }
}

fn check_part(path: &str, role: &str, part: &Value) -> Checked {
    let Value::Object(p) = part else {
        return Err(InvalidField::new(path, "must be an object"));
    };
    let kind = match p.get("type") {
        Some(Value::String(t)) if !t.is_empty() => t.as_str(),
        _ => {
            return Err(InvalidField::new(
                format!("{path}.type"),
                "must be a non-empty string",
            ));
        }
    };
    if !part_allowed(role, kind) {
        return Err(InvalidField::new(
            format!("{path}.type"),
            format!("'{kind}' parts are not allowed in {role} messages"),
        ));
    }
    let field = |name: &str| format!("{path}.{name}");
    match kind {
        "text" => required_string(p, "text", &field("text")),
        "refusal" => required_string(p, "refusal", &field("refusal")),
        "image_url" => {
            let obj = required_object(p, "image_url", &field("image_url"))?;
            required_string(obj, "url", &field("image_url.url"))
        }
        "input_audio" => {
            let obj = required_object(p, "input_audio", &field("input_audio"))?;
            required_string(obj, "data", &field("input_audio.data"))?;
            required_string(obj, "format", &field("input_audio.format"))
        }
        "file" => required_object(p, "file", &field("file")).map(|_| ()),
        _ => Ok(()),
    }
}

fn required_string(m: &Map<String, Value>, key: &str, path: &str) -> Checked {
    match m.get(key) {
        Some(Value::String(_)) => Ok(()),
        None | Some(Value::Null) => Err(InvalidField::new(path, "is required (a string)")),
        Some(_) => Err(InvalidField::new(path, "must be a string")),
    }
}

/// Whether the optional string `key` is present.
fn optional_string(m: &Map<String, Value>, key: &str, path: &str) -> Result<bool, InvalidField> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::String(_)) => Ok(true),
        Some(_) => Err(InvalidField::new(path, "must be a string")),
    }
}

fn required_object<'a>(
    m: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<&'a Map<String, Value>, InvalidField> {
    match m.get(key) {
        Some(Value::Object(o)) => Ok(o),
        None | Some(Value::Null) => Err(InvalidField::new(path, "is required (an object)")),
        Some(_) => Err(InvalidField::new(path, "must be an object")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(m: Value) -> Option<String> {
        check_message("messages[3]", &m).err().map(|e| e.param)
    }

    #[test]
    fn valid_messages_of_every_role_pass() {
        for m in [
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "developer", "content": [{"type": "text", "text": "x"}]}),
            json!({"role": "user", "content": "hi", "name": "ann", "x_vendor": [1]}),
            json!({"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}},
                {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
                {"type": "file", "file": {"file_id": "f1"}},
                {"type": "video_url", "video_url": {"url": "https://x"}},
            ]}),
            json!({"role": "assistant", "content": "hello"}),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "custom", "custom": {"name": "g", "input": "x"}}]}),
            json!({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}),
            json!({"role": "assistant", "content": null, "refusal": "no"}),
            json!({"role": "assistant", "audio": {"id": "a1"}}),
            json!({"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}),
            json!({"role": "assistant", "content": "", "tool_calls": []}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"}),
            json!({"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "s"}]}),
            json!({"role": "function", "name": "f", "content": null}),
            json!({"role": "user", "content": "x", "name": null}),
        ] {
            assert_eq!(check_message("m", &m), Ok(()), "{m}");
        }
    }

    #[test]
    fn each_defect_is_named_by_its_path() {
        for (m, want) in [
            (json!("user"), "messages[3]"),
            (json!({"content": "x"}), "messages[3].role"),
            (json!({"role": "usr", "content": "x"}), "messages[3].role"),
            (json!({"role": 1, "content": "x"}), "messages[3].role"),
            (json!({"role": "user"}), "messages[3].content"),
            (
                json!({"role": "user", "content": null}),
                "messages[3].content",
            ),
            (
                json!({"role": "user", "content": {"a": 1}}),
                "messages[3].content",
            ),
            (json!({"role": "user", "content": 5}), "messages[3].content"),
            (
                json!({"role": "user", "content": []}),
                "messages[3].content",
            ),
            (
                json!({"role": "user", "content": ["x"]}),
                "messages[3].content[0]",
            ),
            (
                json!({"role": "user", "content": [{"text": "x"}]}),
                "messages[3].content[0].type",
            ),
            (
                json!({"role": "user", "content": [{"type": "text", "text": 1}]}),
                "messages[3].content[0].text",
            ),
            (
                json!({"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}),
                "messages[3].content[0].image_url",
            ),
            (
                json!({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}),
                "messages[3].content[0].image_url.url",
            ),
            (
                json!({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "A"}}]}),
                "messages[3].content[0].input_audio.format",
            ),
            (
                json!({"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}),
                "messages[3].content[0].type",
            ),
            (
                json!({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}),
                "messages[3].content[0].type",
            ),
            (
                json!({"role": "user", "content": "x", "name": 3}),
                "messages[3].name",
            ),
            (
                json!({"role": "tool", "content": "x"}),
                "messages[3].tool_call_id",
            ),
            (
                json!({"role": "tool", "tool_call_id": 7, "content": "x"}),
                "messages[3].tool_call_id",
            ),
            (
                json!({"role": "tool", "tool_call_id": "c"}),
                "messages[3].content",
            ),
            (
                json!({"role": "function", "content": "x"}),
                "messages[3].name",
            ),
            (json!({"role": "assistant"}), "messages[3].content"),
            (
                json!({"role": "assistant", "content": null, "tool_calls": []}),
                "messages[3].content",
            ),
            (
                json!({"role": "assistant", "content": "x", "tool_calls": {}}),
                "messages[3].tool_calls",
            ),
            (
                json!({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
                "messages[3].tool_calls[0].id",
            ),
            (
                json!({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}),
                "messages[3].tool_calls[0].type",
            ),
            (
                json!({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}),
                "messages[3].tool_calls[0].function",
            ),
            (
                json!({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}),
                "messages[3].tool_calls[0].function.arguments",
            ),
            (
                json!({"role": "assistant", "function_call": {"name": "f"}}),
                "messages[3].function_call.arguments",
            ),
            (
                json!({"role": "assistant", "refusal": 1}),
                "messages[3].refusal",
            ),
        ] {
            assert_eq!(param(m.clone()).as_deref(), Some(want), "{m}");
        }
    }

    #[test]
    fn the_error_text_names_the_field() {
        let err = check_message("messages[0]", &json!({"role": "usr"})).expect_err("refused");
        assert_eq!(
            err.to_string(),
            "`messages[0].role` must be one of system, developer, user, assistant, tool, function"
        );
    }
}
