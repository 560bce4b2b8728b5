//! The OpenAI chat-completions request as the gateway reads it, parsed once at the edge: the fields
//! the gateway acts on are typed (`model`, `messages`, `tools`, `tool_choice`, `stream`, the `sbp`
//! namespace), everything else is kept verbatim in `rest` and reaches the upstream as sent.
//!
//! Messages, tool declarations and tool calls stay the JSON objects the client sent (they are
//! stored and exported as they are, vendor fields included); [`ChatMessage`], [`ToolDecl`] and
//! [`FunctionCall`] are views over them, the one place their keys are read.

use std::fmt;

use serde::ser::{Error as _, SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use crate::SbpRequestOptions;
use crate::prior::Prior;
use crate::schema::{InvalidField, check_message};

/// A `POST /v1/chat/completions` body.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatRequest {
    /// Absent: the gateway's default model.
    pub model: Option<String>,
    /// The stored transcript, sent ahead of `messages` (a request parsed from a client has none).
    #[cfg_attr(feature = "openapi", schemars(skip))]
    pub prior: Prior,
    pub messages: Vec<ChatMessage>,
    pub tools: Option<Vec<ToolDecl>>,
    pub tool_choice: Option<Value>,
    /// What the caller asked for; providers set their own when they call the upstream.
    pub stream: Option<bool>,
    /// The SBP namespace (SPEC 6.1). The gateway takes it out before anything goes upstream.
    pub sbp: Option<SbpRequestOptions>,
    /// Every other field (`max_tokens`, `temperature`, `stream_options`, vendor extensions ...).
    #[cfg_attr(feature = "openapi", schemars(flatten))]
    pub rest: Map<String, Value>,
}

/// The request as JSON: `model`, `messages` (the prior's, then its own), then the other fields.
impl Serialize for ChatRequest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        if let Some(model) = &self.model {
            map.serialize_entry("model", model)?;
        }
        map.serialize_entry("messages", &AllMessages(self))?;
        self.serialize_fields(&mut map)?;
        map.end()
    }
}

/// The prior's messages and the request's own, as one JSON array.
struct AllMessages<'a>(&'a ChatRequest);

impl Serialize for AllMessages<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.message_count()))?;
        for m in self.0.prior.iter() {
            let raw: &RawValue = serde_json::from_str(m.json()).map_err(S::Error::custom)?;
            seq.serialize_element(raw)?;
        }
        for m in &self.0.messages {
            seq.serialize_element(m)?;
        }
        seq.end()
    }
}

/// Every field but `model` and `messages`.
struct OtherFields<'a>(&'a ChatRequest);

impl Serialize for OtherFields<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        if let Some(model) = &self.0.model {
            map.serialize_entry("model", model)?;
        }
        self.0.serialize_fields(&mut map)?;
        map.end()
    }
}

/// Why a request body is not a chat-completions request: the field (OpenAI's `param`, e.g.
/// `messages[3].role`) and a text that names it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidChatRequest {
    pub param: Option<String>,
    pub message: String,
}

fn invalid(param: &str, msg: impl Into<String>) -> InvalidChatRequest {
    InvalidChatRequest {
        param: Some(param.to_owned()),
        message: msg.into(),
    }
}

impl From<InvalidField> for InvalidChatRequest {
    fn from(e: InvalidField) -> Self {
        Self {
            message: e.to_string(),
            param: Some(e.param),
        }
    }
}

impl ChatRequest {
    /// Parses a request body (a JSON object), moving its values rather than copying them.
    pub fn from_object(mut body: Map<String, Value>) -> Result<Self, InvalidChatRequest> {
        let sbp = match body.remove("sbp") {
            Some(v) => SbpRequestOptions::from_value(&v).map_err(|m| invalid("sbp", m))?,
            None => None,
        };
        let messages = match body.remove("messages") {
            Some(Value::Array(list)) if list.is_empty() => {
                return Err(invalid("messages", "`messages` must not be empty"));
            }
            Some(Value::Array(list)) => list,
            _ => return Err(invalid("messages", "`messages` must be an array")),
        };
        // Each message as OpenAI checks it: one that a strict upstream refuses must never be stored.
        for (i, m) in messages.iter().enumerate() {
            check_message(&format!("messages[{i}]"), m)?;
        }
        let messages = messages.into_iter().map(ChatMessage::from_value).collect();
        let stream = match body.remove("stream") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(b),
            Some(_) => return Err(invalid("stream", "`stream` must be a boolean")),
        };
        let model = match body.remove("model") {
            None | Some(Value::Null) => None,
            Some(Value::String(m)) if !m.is_empty() => Some(m),
            Some(_) => return Err(invalid("model", "`model` must be a non-empty string")),
        };
        let tools = match body.remove("tools") {
            None | Some(Value::Null) => None,
            Some(Value::Array(list)) => Some(list.into_iter().map(ToolDecl).collect()),
            Some(_) => return Err(invalid("tools", "`tools` must be an array")),
        };
        let tool_choice = body.remove("tool_choice").filter(|v| !v.is_null());
        Ok(Self {
            model,
            prior: Prior::default(),
            messages,
            tools,
            tool_choice,
            stream,
            sbp,
            rest: body,
        })
    }

    fn serialize_fields<M: SerializeMap>(&self, map: &mut M) -> Result<(), M::Error> {
        if let Some(tools) = &self.tools {
            map.serialize_entry("tools", tools)?;
        }
        if let Some(choice) = &self.tool_choice {
            map.serialize_entry("tool_choice", choice)?;
        }
        if let Some(stream) = self.stream {
            map.serialize_entry("stream", &stream)?;
        }
        if let Some(sbp) = &self.sbp {
            map.serialize_entry("sbp", sbp)?;
        }
        for (k, v) in &self.rest {
            map.serialize_entry(k, v)?;
        }
        Ok(())
    }

    /// The request as the JSON body sent upstream, built without work per stored message: the
    /// prior's text is copied as it is kept, in one buffer sized for it.
    pub fn to_json(&self) -> Result<Vec<u8>, serde_json::Error> {
        let fields = serde_json::to_vec(&OtherFields(self))?;
        let mut own = Vec::new();
        for m in &self.messages {
            own.push(b',');
            serde_json::to_writer(&mut own, m)?;
        }
        let mut out = Vec::with_capacity(self.prior.json_len() + own.len() + fields.len() + 16);
        out.extend_from_slice(b"{\"messages\":[");
        self.prior.write_json(&mut out);
        // `own` starts with a comma, needed only after a prior message.
        let skip = usize::from(self.prior.is_empty() && !own.is_empty());
        out.extend_from_slice(&own[skip..]);
        out.push(b']');
        // `fields` is `{...}`: its entries follow the messages.
        if fields.len() > 2 {
            out.push(b',');
            out.extend_from_slice(&fields[1..]);
        } else {
            out.push(b'}');
        }
        Ok(out)
    }

    /// How many messages the request sends (the prior's and its own).
    pub fn message_count(&self) -> usize {
        self.prior.len() + self.messages.len()
    }

    /// Every message the request sends, in order: the prior's parsed (work per stored message,
    /// for the providers that read each one) and its own.
    pub fn all_messages(&self) -> std::borrow::Cow<'_, [ChatMessage]> {
        if self.prior.is_empty() {
            return std::borrow::Cow::Borrowed(&self.messages);
        }
        let mut all: Vec<ChatMessage> = self
            .prior
            .iter()
            .map(|m| ChatMessage::from_value(m.parse()))
            .collect();
        all.extend(self.messages.iter().cloned());
        std::borrow::Cow::Owned(all)
    }

    /// Whether the caller asked for server-sent events.
    pub fn wants_stream(&self) -> bool {
        self.stream == Some(true)
    }

    /// The functions the request itself declares in `tools`, in order (the OpenAI shape, or a bare
    /// `{"name": ...}`).
    pub fn declared_functions(&self) -> Vec<&str> {
        self.tools
            .iter()
            .flatten()
            .filter_map(ToolDecl::function_name)
            .collect()
    }

    /// Adds declarations after the request's own tools.
    pub fn add_tools(&mut self, decls: impl IntoIterator<Item = ToolDecl>) {
        self.tools.get_or_insert_with(Vec::new).extend(decls);
    }

    /// `max_tokens` (or `max_completion_tokens`, if that is what the client used) no larger than
    /// `limit`, set to `limit` when the client asked for none.
    pub fn cap_output_tokens(&mut self, limit: u64) {
        let key = if self.rest.contains_key("max_completion_tokens") {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        let bounded = self
            .rest
            .get(key)
            .and_then(Value::as_u64)
            .map_or(limit, |asked| asked.min(limit));
        self.rest.insert(key.into(), json!(bounded));
    }

    /// The most output tokens the request allows (`max_tokens`, else `max_completion_tokens`).
    pub fn output_token_limit(&self) -> Option<u64> {
        self.rest
            .get("max_tokens")
            .or_else(|| self.rest.get("max_completion_tokens"))
            .and_then(Value::as_u64)
    }

    /// A system message after the leading system messages.
    pub fn insert_system_note(&mut self, note: &str) {
        let note = ChatMessage::system(note);
        let lead = self
            .prior
            .stored()
            .take_while(|m| m.role() == "system")
            .count();
        if lead < self.prior.stored_count() {
            self.prior.insert(lead, "system", note.as_value());
            return;
        }
        let at = self
            .messages
            .iter()
            .take_while(|m| m.role() == Some("system"))
            .count();
        self.messages.insert(at, note);
    }

    /// Asks a streaming upstream for its usage chunk (the turn stores it; the caller gets it as it
    /// asked).
    pub fn request_stream_usage(&mut self) {
        match self.rest.get_mut("stream_options") {
            // The caller's other stream options stay; usage is asked for whatever it said.
            Some(Value::Object(options)) => {
                options.insert("include_usage".into(), Value::Bool(true));
            }
            _ => {
                self.rest
                    .insert("stream_options".into(), json!({"include_usage": true}));
            }
        }
    }
}

/// One chat message, as sent (or as stored): when parsed from a request, an object that passed
/// [`check_message`]. Messages of a stored transcript travel in a request's [`Prior`] instead.
#[derive(Clone, Default, PartialEq)]
pub struct ChatMessage(Value);

impl fmt::Debug for ChatMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ChatMessage").field(&self.0).finish()
    }
}

impl Serialize for ChatMessage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl ChatMessage {
    /// A message as stored (any JSON; a stored body is what a client or the model once sent).
    pub fn from_value(v: Value) -> Self {
        Self(v)
    }

    pub fn system(text: &str) -> Self {
        Self::from_value(json!({"role": "system", "content": text}))
    }

    /// The tool message answering call `call_id` with `content`.
    pub fn tool_result(call_id: &str, content: &str) -> Self {
        Self::from_value(json!({"role": "tool", "tool_call_id": call_id, "content": content}))
    }

    pub fn as_value(&self) -> &Value {
        &self.0
    }

    pub fn into_value(self) -> Value {
        self.0
    }

    /// The message as a borrowed view (what its accessors read).
    pub fn view(&self) -> MessageView<'_> {
        MessageView(self.as_value())
    }

    /// A field without an accessor of its own (a vendor extension, `refusal`, ...).
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.as_value().get(key)
    }

    pub fn role(&self) -> Option<&str> {
        self.view().role()
    }

    pub fn content(&self) -> Option<&Value> {
        self.view().content()
    }

    /// The text of `content`: a string, or the text parts of an array of parts.
    pub fn text(&self) -> Option<String> {
        self.view().text()
    }

    pub fn tool_call_id(&self) -> Option<&str> {
        self.view().tool_call_id()
    }

    /// The function calls of an assistant message (none when it has no `tool_calls` array).
    pub fn tool_calls(&self) -> impl Iterator<Item = FunctionCall<'_>> {
        self.view().tool_calls()
    }

    pub fn has_tool_calls(&self) -> bool {
        self.view().has_tool_calls()
    }

    /// Keeps only the calls `keep` accepts; without any left, the message has no `tool_calls`
    /// and its `content` is at least `""`. Returns how many were removed.
    pub fn retain_tool_calls(&mut self, keep: impl Fn(&FunctionCall<'_>) -> bool) -> usize {
        let Some(msg) = self.0.as_object_mut() else {
            return 0;
        };
        let Some(Value::Array(calls)) = msg.get_mut("tool_calls") else {
            return 0;
        };
        let before = calls.len();
        calls.retain(|c| keep(&FunctionCall(c)));
        let removed = before - calls.len();
        if removed > 0 && calls.is_empty() {
            msg.remove("tool_calls");
            if msg.get("content").is_none_or(Value::is_null) {
                msg.insert("content".into(), json!(""));
            }
        }
        removed
    }
}

/// A chat message borrowed from wherever it is kept (a request, a stored transcript).
#[derive(Debug, Clone, Copy)]
pub struct MessageView<'a>(pub &'a Value);

impl<'a> MessageView<'a> {
    pub fn role(self) -> Option<&'a str> {
        self.0.get("role").and_then(Value::as_str)
    }

    pub fn content(self) -> Option<&'a Value> {
        self.0.get("content")
    }

    pub fn text(self) -> Option<String> {
        self.content().and_then(content_text)
    }

    pub fn tool_call_id(self) -> Option<&'a str> {
        self.0.get("tool_call_id").and_then(Value::as_str)
    }

    pub fn tool_calls(self) -> impl Iterator<Item = FunctionCall<'a>> {
        self.0
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(FunctionCall)
    }

    pub fn has_tool_calls(self) -> bool {
        self.tool_calls().next().is_some()
    }
}

impl std::ops::Index<&str> for ChatMessage {
    type Output = Value;

    /// The field `key`, `null` when absent (as indexing a `Value` does).
    fn index(&self, key: &str) -> &Value {
        &self.as_value()[key]
    }
}

impl From<ChatMessage> for Value {
    fn from(m: ChatMessage) -> Self {
        m.into_value()
    }
}

impl PartialEq<ChatMessage> for Value {
    fn eq(&self, other: &ChatMessage) -> bool {
        self == other.as_value()
    }
}

/// One entry of a request's `tools`.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDecl(Value);

impl Serialize for ToolDecl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl ToolDecl {
    /// An OpenAI function declaration.
    pub fn function(name: &str, description: &str, parameters: Value) -> Self {
        Self(json!({
            "type": "function",
            "function": {"name": name, "description": description, "parameters": parameters},
        }))
    }

    pub fn as_value(&self) -> &Value {
        &self.0
    }

    /// `function.name` (OpenAI), or a bare `name`.
    pub fn function_name(&self) -> Option<&str> {
        self.0
            .pointer("/function/name")
            .or_else(|| self.0.get("name"))
            .and_then(Value::as_str)
    }
}

/// One entry of an assistant message's `tool_calls`.
#[derive(Debug, Clone, Copy)]
pub struct FunctionCall<'a>(&'a Value);

impl<'a> FunctionCall<'a> {
    pub fn id(&self) -> Option<&'a str> {
        self.0.get("id").and_then(Value::as_str)
    }

    pub fn name(&self) -> Option<&'a str> {
        self.0.pointer("/function/name").and_then(Value::as_str)
    }

    /// The arguments as the model wrote them (a JSON text).
    pub fn arguments(&self) -> Option<&'a str> {
        self.0
            .pointer("/function/arguments")
            .and_then(Value::as_str)
    }

    pub fn as_value(&self) -> &'a Value {
        self.0
    }
}

/// The text of a chat message's `content`: a string, or the text parts of an array of parts.
pub fn content_text(content: &Value) -> Option<String> {
    match content {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect();
            (!texts.is_empty()).then(|| texts.join(""))
        }
        _ => None,
    }
}

/// Messages and tool declarations pass through as sent, vendor fields included: their schemas
/// name the fields the gateway reads and leave every other one open.
#[cfg(feature = "openapi")]
mod openapi {
    use std::borrow::Cow;

    use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};

    impl JsonSchema for super::ChatMessage {
        fn schema_name() -> Cow<'static, str> {
            "ChatMessage".into()
        }

        fn json_schema(_: &mut SchemaGenerator) -> Schema {
            json_schema!({
                "description": "An OpenAI chat message, kept as sent (vendor fields included).",
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"type": "string", "description": "system, developer, user, assistant or tool"},
                    "content": {"description": "A string, an array of content parts, or null (an assistant message with tool_calls)."},
                    "name": {"type": "string"},
                    "tool_calls": {"type": "array", "items": {"type": "object"}},
                    "tool_call_id": {"type": "string"}
                },
                "additionalProperties": true
            })
        }
    }

    impl JsonSchema for super::ToolDecl {
        fn schema_name() -> Cow<'static, str> {
            "ToolDecl".into()
        }

        fn json_schema(_: &mut SchemaGenerator) -> Schema {
            json_schema!({
                "description": "An OpenAI tool declaration (`{\"type\": \"function\", \"function\": {...}}`).",
                "type": "object",
                "properties": {
                    "type": {"type": "string"},
                    "function": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "description": {"type": "string"},
                            "parameters": {"type": "object"}
                        }
                    }
                },
                "additionalProperties": true
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ChatRequest, InvalidChatRequest> {
        match v {
            Value::Object(m) => ChatRequest::from_object(m),
            _ => unreachable!("tests pass objects"),
        }
    }

    /// A request with a stored transcript goes upstream as the same JSON whichever way it is
    /// written: the prior's messages first, a system note after the leading system messages.
    #[test]
    fn a_prior_is_sent_ahead_of_the_own_messages() {
        let stored = [
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "assistant", "content": null, "x_vendor": [1.5, "é"],
                   "tool_calls": [{"id": "a", "function": {"name": "f"}}]}),
            json!({"role": "tool", "tool_call_id": "a", "content": "ok"}),
        ];
        let mut req = parse(json!({"model": "m", "max_tokens": 5,
                                   "messages": [{"role": "user", "content": "hi"}]}))
        .expect("valid");
        for m in &stored {
            req.prior.push(m["role"].as_str().unwrap_or_default(), m);
        }
        req.insert_system_note("note");
        let fast: Value = serde_json::from_slice(&req.to_json().expect("json")).expect("parses");
        let slow = serde_json::to_value(&req).expect("serialises");
        assert_eq!(fast, slow);
        let roles: Vec<_> = fast["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| m["role"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(roles, ["system", "system", "assistant", "tool", "user"]);
        assert_eq!(fast["messages"][1]["content"], "note");
        assert_eq!(fast["messages"][2], stored[1], "vendor fields kept");
        assert_eq!(fast["max_tokens"], 5);
        assert_eq!(fast["model"], "m");
        assert_eq!(req.message_count(), 5);
        let all = req.all_messages();
        assert_eq!(all.len(), 5);
        assert_eq!(all[2].as_value(), &stored[1]);
        assert_eq!(all[4].text().as_deref(), Some("hi"));
        // Without own messages, and without other fields.
        let mut bare = ChatRequest::default();
        bare.prior
            .push("user", &json!({"role": "user", "content": "x"}));
        let body: Value = serde_json::from_slice(&bare.to_json().expect("json")).expect("parses");
        assert_eq!(
            body,
            json!({"messages": [{"role": "user", "content": "x"}]})
        );
    }

    /// Every arrangement of prior and own messages, with and without other fields, is written
    /// by `to_json` as valid JSON equal to what `Serialize` writes and to the request with the
    /// whole transcript in `messages` (how it was sent before the prior): no comma too many or
    /// missing, nothing lost, the note where `insert_system_note` put it.
    #[test]
    fn to_json_equals_the_whole_transcript_sent_as_messages() {
        let stored = [
            json!({"role": "system", "content": "s \"q\" é 😀 \u{1}"}),
            json!({"role": "user", "content": "u1"}),
            json!({"role": "assistant", "content": "a1", "x": [1.5, null, {"k": "]"}]}),
        ];
        let own = [
            json!({"role": "system", "content": "own system"}),
            json!({"role": "user", "content": "u2"}),
        ];
        let fields = [
            json!({}),
            json!({"model": "m"}),
            json!({"model": "m", "max_tokens": 5, "temperature": 0.5, "stream": false,
                   "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
                   "stream_options": {"include_usage": true}, "x_vendor": {"a": [1, 2]}}),
        ];
        for prior_len in [0, 1, 3] {
            for own_len in [0, 1, 2] {
                for note in [false, true] {
                    for extra in &fields {
                        let mut body = extra.as_object().cloned().unwrap_or_default();
                        body.insert("messages".into(), json!([{"role": "user", "content": "x"}]));
                        let mut req = ChatRequest::from_object(body).expect("valid");
                        req.messages = own[..own_len]
                            .iter()
                            .cloned()
                            .map(ChatMessage::from_value)
                            .collect();
                        for m in &stored[..prior_len] {
                            req.prior.push(m["role"].as_str().unwrap_or_default(), m);
                        }
                        if note {
                            req.insert_system_note("note");
                        }
                        let case =
                            format!("prior {prior_len}, own {own_len}, note {note}, {extra}");
                        let bytes = req.to_json().expect("json");
                        let fast: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                            panic!("{case}: {e}: {}", String::from_utf8_lossy(&bytes))
                        });
                        assert_eq!(
                            fast,
                            serde_json::to_value(&req).expect("serialises"),
                            "{case}"
                        );
                        let text = serde_json::to_string(&req).expect("serialises");
                        assert_eq!(
                            text.len(),
                            bytes.len(),
                            "{case}: the same text, keys reordered"
                        );
                        // The whole transcript as messages, as before the prior existed.
                        let mut whole: Vec<Value> = stored[..prior_len].to_vec();
                        whole.extend(own[..own_len].iter().cloned());
                        if note {
                            let lead = whole.iter().take_while(|m| m["role"] == "system").count();
                            whole.insert(lead, json!({"role": "system", "content": "note"}));
                        }
                        let mut want = extra.clone();
                        want["messages"] = Value::Array(whole);
                        assert_eq!(fast, want, "{case}");
                        assert_eq!(
                            req.message_count(),
                            want["messages"].as_array().map_or(0, Vec::len),
                            "{case}"
                        );
                        let all: Vec<Value> = req
                            .all_messages()
                            .iter()
                            .map(|m| m.as_value().clone())
                            .collect();
                        assert_eq!(Value::Array(all), want["messages"], "{case}");
                    }
                }
            }
        }
    }

    #[test]
    fn unknown_fields_reach_the_upstream_as_sent() {
        let req = parse(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi", "x_vendor": [1.5, null]}],
            "temperature": 0.25, "logit_bias": {"50256": -100}, "user": "u-1",
            "sbp": {"checkpoint_every": 2}, "stream": true,
        }))
        .expect("valid");
        assert_eq!(req.sbp.as_ref().and_then(|o| o.checkpoint_every), Some(2));
        assert!(req.wants_stream());
        let mut upstream = req.clone();
        upstream.sbp = None;
        upstream.stream = None;
        assert_eq!(
            serde_json::to_value(&upstream).expect("serialises"),
            json!({"model": "m", "messages": [{"role": "user", "content": "hi", "x_vendor": [1.5, null]}],
                   "temperature": 0.25, "logit_bias": {"50256": -100}, "user": "u-1"})
        );
    }

    #[test]
    fn each_bad_field_is_named() {
        let hi = json!({"role": "user", "content": "hi"});
        for (body, param, want) in [
            (json!({}), "messages", "`messages` must be an array"),
            (
                json!({"messages": []}),
                "messages",
                "`messages` must not be empty",
            ),
            (
                json!({"messages": [hi, {"content": "x"}]}),
                "messages[1].role",
                "`messages[1].role` is required",
            ),
            (
                json!({"messages": [hi, {"role": "tool", "content": "x"}]}),
                "messages[1].tool_call_id",
                "`messages[1].tool_call_id` is required (a string)",
            ),
            (
                json!({"messages": [hi], "stream": "yes"}),
                "stream",
                "`stream` must be a boolean",
            ),
            (
                json!({"messages": [hi], "model": ""}),
                "model",
                "`model` must be a non-empty string",
            ),
            (
                json!({"messages": [hi], "tools": {}}),
                "tools",
                "`tools` must be an array",
            ),
            (
                json!({"messages": [hi], "sbp": "x"}),
                "sbp",
                "`sbp` must be an object",
            ),
        ] {
            assert_eq!(parse(body).map(|_| ()), Err(invalid(param, want)));
        }
    }

    #[test]
    fn tools_and_calls_are_read_in_one_place() {
        let mut req = parse(json!({"messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "surface_gps"}}, {"name": "bare"}, {}]}))
        .expect("valid");
        assert_eq!(req.declared_functions(), vec!["surface_gps", "bare"]);
        assert!(ChatRequest::default().declared_functions().is_empty());
        req.add_tools([ToolDecl::function("x", "d", json!({}))]);
        assert_eq!(req.declared_functions(), vec!["surface_gps", "bare", "x"]);

        let mut msg = ChatMessage::from_value(json!({"role": "assistant", "content": null,
            "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}},
                           {"id": "b", "function": {"name": "g"}}]}));
        let names: Vec<_> = msg.tool_calls().filter_map(|c| c.name()).collect();
        assert_eq!(names, vec!["f", "g"]);
        assert_eq!(msg.retain_tool_calls(|c| c.name() == Some("f")), 1);
        assert_eq!(msg.tool_calls().count(), 1);
        assert_eq!(msg.retain_tool_calls(|_| false), 1);
        assert_eq!(msg.as_value(), &json!({"role": "assistant", "content": ""}));
    }

    #[test]
    fn output_tokens_are_capped_under_the_clients_own_key() {
        let mut req =
            parse(json!({"messages": [{"role": "user", "content": "x"}]})).expect("valid");
        req.cap_output_tokens(40);
        assert_eq!(req.rest["max_tokens"], json!(40));
        let mut req = parse(json!({"messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 10}))
        .expect("valid");
        req.cap_output_tokens(40);
        assert_eq!(req.rest["max_completion_tokens"], json!(10));
        assert!(!req.rest.contains_key("max_tokens"));
        assert_eq!(req.output_token_limit(), Some(10));
    }

    #[test]
    fn the_system_note_follows_the_leading_system_messages() {
        let mut req = parse(json!({"messages": [{"role": "system", "content": "a"},
            {"role": "user", "content": "b"}]}))
        .expect("valid");
        req.insert_system_note("note");
        let roles: Vec<_> = req.messages.iter().filter_map(ChatMessage::role).collect();
        assert_eq!(roles, vec!["system", "system", "user"]);
        assert_eq!(req.messages[1].text().as_deref(), Some("note"));
    }
}
