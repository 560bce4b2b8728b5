//! Turns one request into what the fake will do and the exact bytes it will send: the
//! non-streaming body or the list of SSE events. Reading an OpenAI request and rendering OpenAI
//! answers live here, with the decision every API shares ([`decide`]); the Anthropic side reads
//! and renders in `anthropic.rs`.
//!
//! Pure apart from ids and the `created` clock, so the HTTP layer only has to wait and write.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::de::value::MapAccessDeserializer;
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Value, json};

use crate::directives::{self, ToolDirective};

/// Which API a request came in on, and so which shapes the answer takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// OpenAI chat completions.
    OpenAi,
    /// Anthropic Messages.
    Anthropic,
}

impl Dialect {
    /// The body of an error answer with `status`.
    pub fn error_body(self, status: u16, message: &str) -> Value {
        match self {
            // As OpenAI words them: its `type`, `param` and `code` for the status.
            Dialect::OpenAi => {
                let (kind, param, code) = match status {
                    400 => (
                        "invalid_request_error",
                        json!("messages"),
                        json!("context_length_exceeded"),
                    ),
                    401 => (
                        "invalid_request_error",
                        Value::Null,
                        json!("invalid_api_key"),
                    ),
                    404 => (
                        "invalid_request_error",
                        json!("model"),
                        json!("model_not_found"),
                    ),
                    429 => ("requests", Value::Null, json!("rate_limit_exceeded")),
                    500..=599 => ("server_error", Value::Null, Value::Null),
                    _ => ("invalid_request_error", Value::Null, Value::Null),
                };
                json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
            }
            Dialect::Anthropic => crate::anthropic::error_body(status, message),
        }
    }

    /// The body of the 400 for a request the fake cannot read.
    pub fn invalid_request_body(self, message: &str) -> Value {
        match self {
            Dialect::OpenAi => json!({"error": {
                "message": message,
                "type": "invalid_request_error",
                "param": null,
                "code": null,
            }}),
            Dialect::Anthropic => crate::anthropic::error_body(400, message),
        }
    }
}

/// What to do for one request, decided before any waiting starts.
#[derive(Clone, Debug)]
pub struct Script {
    pub dialect: Dialect,
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    pub slow: Duration,
    pub chunk_delay: Duration,
    pub hang: bool,
    pub drop: bool,
    pub chunks: Option<usize>,
    pub outcome: Outcome,
    pub prompt_tokens: usize,
}

/// The answer itself.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// An HTTP error status with the dialect's error body.
    Error(u16),
    /// An assistant text reply.
    Text(String),
    /// An assistant message made only of tool calls.
    ToolCalls(Vec<ToolCall>),
}

#[derive(Clone, Debug)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// What the fake reads from a request, whichever API it came in on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request<'a> {
    pub dialect: Dialect,
    pub model: &'a str,
    pub stream: bool,
    pub include_usage: bool,
    /// The text of the last user message, where the directives are.
    pub prompt: String,
    /// The tool result the conversation ends with, if it does.
    pub tool_result: Option<String>,
    pub prompt_tokens: usize,
}

/// Reads an OpenAI chat-completions request. `Err` is a message for a 400 answer.
pub fn plan(body: &Value) -> Result<Script, String> {
    decide(read(body)?)
}

/// What [`plan`] reads from a parsed OpenAI request.
fn read(body: &Value) -> Result<Request<'_>, String> {
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .ok_or("`model` must be a string")?;
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("`messages` must be an array")?;
    let prompt = messages
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .map(|m| content_text(m.get("content")))
        .unwrap_or_default();
    let tool_result = messages
        .last()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("tool"))
        .map(|m| content_text(m.get("content")));
    Ok(Request {
        dialect: Dialect::OpenAi,
        model,
        stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        prompt,
        tool_result,
        prompt_tokens: messages
            .iter()
            .map(|m| words(&content_text(m.get("content"))))
            .sum(),
    })
}

/// [`plan`] straight from the body's bytes, in one pass and without building a tree of the whole
/// conversation: a long conversation costs a scan, not an allocation per message (benchmarks
/// replay growing sessions, and the fake's CPU is not what they measure). `None` when the body is
/// not the plain shape read here (not JSON, a field of another type, a duplicate field, a value
/// the tree cannot hold): the caller then reads it as a [`Value`], which also words the 400.
pub fn plan_bytes(body: &[u8]) -> Option<Result<Script, String>> {
    let wire: WireRequest<'_> = serde_json::from_slice(body).ok()?;
    Some(decide(wire.request()?))
}

/// Any JSON value, dropped once it has passed the checks a [`Value`] makes when it is built
/// (numbers in range, strings of valid UTF-8 without a lone surrogate).
struct Checked;

impl<'de> Deserialize<'de> for Checked {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Checked)
    }
}

impl<'de> Visitor<'de> for Checked {
    type Value = Checked;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_str<E>(self, _: &str) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_unit<E>(self) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Checked, A::Error> {
        while seq.next_element::<Checked>()?.is_some() {}
        Ok(Checked)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Checked, A::Error> {
        while map.next_key::<Key<'de>>()?.is_some() {
            map.next_value::<Checked>()?;
        }
        Ok(Checked)
    }
}

/// Keys `serde_json` gives a meaning of its own when it builds a [`Value`] (with its
/// `raw_value` and `arbitrary_precision` features): an object holding one is not read here.
const TREE_TOKENS: [&str; 2] = [
    "$serde_json::private::RawValue",
    "$serde_json::private::Number",
];

/// An object key, borrowed where it has no escapes; one of [`TREE_TOKENS`] is an error, so the
/// body goes to the tree.
struct Key<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Key<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Text(key) = Text::deserialize(d)?;
        if TREE_TOKENS.contains(&&*key) {
            return Err(serde::de::Error::custom("a key the tree reads its own way"));
        }
        Ok(Key(key))
    }
}

/// What the fake needs of an OpenAI request, read as the body is scanned: every other value is
/// only [`Checked`].
struct WireRequest<'a> {
    model: Cow<'a, str>,
    stream: Option<bool>,
    include_usage: Option<bool>,
    messages: WireMessages<'a>,
}

/// The messages, folded as they are read: the last user message, the last message, and the
/// words of them all.
#[derive(Default)]
struct WireMessages<'a> {
    last_user: Option<Content<'a>>,
    /// The last message, when it is a tool result.
    last_tool: Option<Content<'a>>,
    words: usize,
}

/// A message's `content`.
enum Content<'a> {
    Absent,
    Text(Cow<'a, str>),
    /// An array of parts, or another JSON value (rare: read as the tree reads it).
    Other(Value),
}

impl Content<'_> {
    fn text(&self) -> String {
        match self {
            Content::Absent => String::new(),
            Content::Text(t) => t.clone().into_owned(),
            Content::Other(v) => content_text(Some(v)),
        }
    }

    fn words(&self) -> usize {
        match self {
            Content::Absent => 0,
            Content::Text(t) => words(t),
            Content::Other(v) => words(&content_text(Some(v))),
        }
    }
}

/// Fails on a second `key`, as the tree's reader would see only one of them.
fn once<T, E: serde::de::Error>(slot: &Option<T>, key: &'static str) -> Result<(), E> {
    match slot {
        Some(_) => Err(E::duplicate_field(key)),
        None => Ok(()),
    }
}

/// A string borrowed from the body where it has no escapes (serde's own `Cow<str>` always copies).
struct Text<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Str<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for Str<'a> {
            type Value = Text<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Borrowed(v)))
            }

            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }

            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }

        d.deserialize_str(Str(PhantomData))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for WireRequest<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for Fields<'a> {
            type Value = WireRequest<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                use serde::de::Error;
                let (mut model, mut messages) = (None, None);
                let (mut stream, mut options): (Option<Option<bool>>, Option<Option<bool>>) =
                    (None, None);
                while let Some(key) = map.next_key::<Key<'de>>()? {
                    match &*key.0 {
                        "model" => {
                            once(&model, "model")?;
                            model = Some(map.next_value::<Text<'de>>()?.0);
                        }
                        "messages" => {
                            once(&messages, "messages")?;
                            messages = Some(map.next_value::<WireMessages<'de>>()?);
                        }
                        "stream" => {
                            once(&stream, "stream")?;
                            stream = Some(map.next_value::<Option<bool>>()?);
                        }
                        "stream_options" => {
                            once(&options, "stream_options")?;
                            options =
                                Some(map.next_value::<Option<StreamOptions>>()?.and_then(|o| o.0));
                        }
                        _ => {
                            map.next_value::<Checked>()?;
                        }
                    }
                }
                Ok(WireRequest {
                    model: model.ok_or_else(|| A::Error::missing_field("model"))?,
                    messages: messages.ok_or_else(|| A::Error::missing_field("messages"))?,
                    stream: stream.flatten(),
                    include_usage: options.flatten(),
                })
            }
        }

        d.deserialize_map(Fields(PhantomData))
    }
}

/// `stream_options`: its `include_usage`.
struct StreamOptions(Option<bool>);

impl<'de> Deserialize<'de> for StreamOptions {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;

        impl<'de> Visitor<'de> for Fields {
            type Value = StreamOptions;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<StreamOptions, A::Error> {
                let mut usage: Option<Option<bool>> = None;
                while let Some(key) = map.next_key::<Key<'de>>()? {
                    if key.0 == "include_usage" {
                        once(&usage, "include_usage")?;
                        usage = Some(map.next_value()?);
                    } else {
                        map.next_value::<Checked>()?;
                    }
                }
                Ok(StreamOptions(usage.flatten()))
            }
        }

        d.deserialize_map(Fields)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for WireMessages<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Elements<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for Elements<'a> {
            type Value = WireMessages<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of message objects")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut folded = WireMessages::default();
                while let Some(WireMessage { role, content }) = seq.next_element()? {
                    folded.words += content.words();
                    folded.last_tool = None;
                    match role.as_deref() {
                        Some("user") => folded.last_user = Some(content),
                        Some("tool") => folded.last_tool = Some(content),
                        _ => {}
                    }
                }
                Ok(folded)
            }
        }

        d.deserialize_seq(Elements(PhantomData))
    }
}

/// One message: its `role` (a string, or none) and `content`.
struct WireMessage<'a> {
    role: Option<Cow<'a, str>>,
    content: Content<'a>,
}

impl<'de: 'a, 'a> Deserialize<'de> for WireMessage<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for Fields<'a> {
            type Value = WireMessage<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a message object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut role: Option<Option<Text<'de>>> = None;
                let mut content: Option<Content<'de>> = None;
                while let Some(key) = map.next_key::<Key<'de>>()? {
                    match &*key.0 {
                        "role" => {
                            once(&role, "role")?;
                            role = Some(map.next_value()?);
                        }
                        "content" => {
                            once(&content, "content")?;
                            content = Some(map.next_value::<ContentSeed<'de>>()?.0);
                        }
                        _ => {
                            map.next_value::<Checked>()?;
                        }
                    }
                }
                Ok(WireMessage {
                    role: role.flatten().map(|r| r.0),
                    content: content.unwrap_or(Content::Absent),
                })
            }
        }

        d.deserialize_map(Fields(PhantomData))
    }
}

/// A `content` value: a string borrowed where it has no escapes, `null` as none, anything else
/// as the tree holds it.
struct ContentSeed<'a>(Content<'a>);

impl<'de: 'a, 'a> Deserialize<'de> for ContentSeed<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Any<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for Any<'a> {
            type Value = ContentSeed<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }

            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(ContentSeed(Content::Text(Cow::Borrowed(v))))
            }

            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ContentSeed(Content::Text(Cow::Owned(v.to_owned()))))
            }

            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(ContentSeed(Content::Text(Cow::Owned(v))))
            }

            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(ContentSeed(Content::Absent))
            }

            fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
                Ok(ContentSeed(Content::Other(Value::Bool(v))))
            }

            fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
                Ok(ContentSeed(Content::Other(Value::from(v))))
            }

            fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
                Ok(ContentSeed(Content::Other(Value::from(v))))
            }

            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
                serde_json::Number::from_f64(v)
                    .map(|n| ContentSeed(Content::Other(Value::Number(n))))
                    .ok_or_else(|| E::custom("a number the tree cannot hold"))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                let v = Value::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))?;
                Ok(ContentSeed(Content::Other(v)))
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let v = Value::deserialize(MapAccessDeserializer::new(map))?;
                Ok(ContentSeed(Content::Other(v)))
            }
        }

        d.deserialize_any(Any(PhantomData))
    }
}

impl<'a> WireRequest<'a> {
    /// The same [`Request`] as [`read`] gives for this body.
    fn request(&'a self) -> Option<Request<'a>> {
        let m = &self.messages;
        Some(Request {
            dialect: Dialect::OpenAi,
            model: &self.model,
            stream: self.stream.unwrap_or(false),
            include_usage: self.include_usage.unwrap_or(false),
            prompt: m.last_user.as_ref().map(Content::text).unwrap_or_default(),
            tool_result: m.last_tool.as_ref().map(Content::text),
            prompt_tokens: m.words,
        })
    }
}

/// Decides the answer from what the request says, the same way for every API: the model name
/// and the prompt's directives script it; a tool result ends a tool loop.
pub fn decide(req: Request<'_>) -> Result<Script, String> {
    let model = req.model;
    let mut slow = Duration::ZERO;
    let mut forced_error = None;
    if let Some(code) = model.strip_prefix("fake-error-") {
        forced_error = Some(directives::status(code).map_err(|e| e.0)?);
    } else if let Some(ms) = model.strip_prefix("fake-slow-") {
        let ms: u64 = ms
            .parse()
            .map_err(|_| format!("model `{model}`: `fake-slow-` wants milliseconds"))?;
        slow = Duration::from_millis(ms);
    }

    let parsed = directives::parse(&req.prompt).map_err(|e| e.0)?;
    let d = parsed.directives;
    let last_tool = req.tool_result;

    let outcome = if let Some(code) = d.error.or(forced_error) {
        Outcome::Error(code)
    } else if last_tool.is_none() && !d.tools.is_empty() {
        let calls = d.tools.into_iter().map(|t| tool_call(req.dialect, t));
        Outcome::ToolCalls(calls.collect())
    } else if let Some(reply) = d.reply {
        Outcome::Text(reply)
    } else if let Some(result) = last_tool {
        Outcome::Text(format!("tool result: {result}"))
    } else {
        Outcome::Text(format!("echo: {}", parsed.text))
    };

    Ok(Script {
        dialect: req.dialect,
        model: model.to_owned(),
        stream: req.stream,
        include_usage: req.include_usage,
        slow: d.slow.unwrap_or(slow),
        chunk_delay: d.chunk_delay.unwrap_or_default(),
        hang: d.hang,
        drop: d.drop,
        chunks: d.chunks,
        outcome,
        prompt_tokens: req.prompt_tokens,
    })
}

fn tool_call(dialect: Dialect, t: ToolDirective) -> ToolCall {
    let prefix = match dialect {
        Dialect::OpenAi => "call",
        Dialect::Anthropic => "toolu",
    };
    ToolCall {
        id: format!("{prefix}_{}", uuid::Uuid::new_v4().simple()),
        name: t.name,
        arguments: t.arguments,
    }
}

/// The text of a message `content`: a string, or the `text` of an array's blocks joined by
/// `\n` (OpenAI parts and Anthropic blocks alike).
pub fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect();
            texts.join("\n")
        }
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

pub fn words(text: &str) -> usize {
    text.split_whitespace().count()
}

impl Script {
    /// The answer body of a non-streaming success, in the request's dialect.
    pub fn completion(&self) -> Value {
        match self.dialect {
            Dialect::OpenAi => self.openai_completion(),
            Dialect::Anthropic => crate::anthropic::message(self),
        }
    }

    /// Every SSE event of a streaming success, each already framed, in the request's dialect.
    pub fn events(&self) -> Vec<String> {
        match self.dialect {
            Dialect::OpenAi => self.openai_events(),
            Dialect::Anthropic => crate::anthropic::events(self),
        }
    }

    /// How a streamed text reply is cut: `chunks=N` pieces, else one per word.
    pub fn text_pieces<'t>(&self, text: &'t str) -> Vec<&'t str> {
        match self.chunks {
            Some(n) => split_even(text, n),
            None => split_words(text),
        }
    }

    /// How streamed tool arguments are cut: `chunks=N` pieces, else two (so clients must
    /// join them; fewer only for arguments shorter than two characters).
    pub fn argument_pieces<'t>(&self, arguments: &'t str) -> Vec<&'t str> {
        let n = self
            .chunks
            .unwrap_or_else(|| arguments.chars().take(2).count());
        split_even(arguments, n)
    }

    pub fn completion_tokens(&self) -> usize {
        match &self.outcome {
            Outcome::Error(_) => 0,
            Outcome::Text(text) => words(text),
            Outcome::ToolCalls(calls) => calls.iter().map(|c| 1 + words(&c.arguments)).sum(),
        }
    }

    fn usage(&self) -> Value {
        let completion = self.completion_tokens();
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        })
    }

    /// The `chat.completion` object for a non-streaming success.
    fn openai_completion(&self) -> Value {
        let (message, finish_reason) = match &self.outcome {
            Outcome::ToolCalls(calls) => {
                let calls: Vec<Value> = calls
                    .iter()
                    .map(|c| {
                        json!({
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        })
                    })
                    .collect();
                (
                    json!({"role": "assistant", "content": null, "tool_calls": calls}),
                    "tool_calls",
                )
            }
            Outcome::Text(text) => (json!({"role": "assistant", "content": text}), "stop"),
            Outcome::Error(_) => (json!({"role": "assistant", "content": null}), "stop"),
        };
        json!({
            "id": completion_id(),
            "object": "chat.completion",
            "created": now(),
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": null,
                "finish_reason": finish_reason,
            }],
            "usage": self.usage(),
        })
    }

    /// Every SSE event of a streaming success, `data: [DONE]` included, each already framed
    /// as `data: ...\n\n`.
    fn openai_events(&self) -> Vec<String> {
        let id = completion_id();
        let created = now();
        let chunk = |delta: Value, finish_reason: Option<&str>| {
            let mut c = json!({
                "id": id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "delta": delta,
                    "logprobs": null,
                    "finish_reason": finish_reason,
                }],
            });
            if self.include_usage {
                c["usage"] = Value::Null;
            }
            sse(&c)
        };

        let mut events = Vec::new();
        let finish_reason = match &self.outcome {
            Outcome::Text(text) => {
                let pieces = self.text_pieces(text);
                if pieces.is_empty() {
                    events.push(chunk(json!({"role": "assistant", "content": ""}), None));
                }
                for (i, piece) in pieces.iter().enumerate() {
                    let delta = if i == 0 {
                        json!({"role": "assistant", "content": piece})
                    } else {
                        json!({"content": piece})
                    };
                    events.push(chunk(delta, None));
                }
                "stop"
            }
            Outcome::ToolCalls(calls) => {
                for (index, call) in calls.iter().enumerate() {
                    let head = json!([{
                        "index": index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }]);
                    let delta = if index == 0 {
                        json!({"role": "assistant", "content": null, "tool_calls": head})
                    } else {
                        json!({"tool_calls": head})
                    };
                    events.push(chunk(delta, None));
                    for piece in self.argument_pieces(&call.arguments) {
                        let delta = json!({"tool_calls": [{
                            "index": index,
                            "function": {"arguments": piece},
                        }]});
                        events.push(chunk(delta, None));
                    }
                }
                "tool_calls"
            }
            Outcome::Error(_) => "stop",
        };
        events.push(chunk(json!({}), Some(finish_reason)));
        if self.include_usage {
            events.push(sse(&json!({
                "id": id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model,
                "choices": [],
                "usage": self.usage(),
            })));
        }
        events.push("data: [DONE]\n\n".to_owned());
        events
    }
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

fn completion_id() -> String {
    format!("chatcmpl-{}", uuid::Uuid::new_v4().simple())
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One piece per word, each keeping the whitespace after it (and the first also any before
/// it), so the pieces concatenate back to `text` exactly.
fn split_words(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut prev_space = false;
    let mut in_piece_word = false;
    for (i, c) in text.char_indices() {
        let space = c.is_whitespace();
        if prev_space && !space && in_piece_word {
            pieces.push(&text[start..i]);
            start = i;
        }
        in_piece_word |= !space;
        prev_space = space;
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    pieces
}

/// Exactly `n` pieces of as equal a number of characters as possible (some are empty when
/// `text` has fewer than `n` characters).
fn split_even(text: &str, n: usize) -> Vec<&str> {
    if n == 0 {
        return Vec::new();
    }
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain(std::iter::once(text.len()))
        .collect();
    let chars = bounds.len() - 1;
    (0..n)
        .map(|k| &text[bounds[k * chars / n]..bounds[(k + 1) * chars / n]])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_read_as_the_tree_reads_them() {
        let bodies = [
            json!({"model": "m", "messages": [{"role": "user", "content": "hi there"}]}),
            json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
            "messages": [
                {"role": "system", "content": "be  brief"},
                {"role": "user", "content": "caf\u{e9} \"quoted\"\n[[fake:reply=ok]]"},
                {"role": "assistant", "content": null, "tool_calls": []},
                {"content": "no role here"},
                {"role": "user", "content": [{"type": "text", "text": "part one"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "text", "text": "part two"}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42 degrees"},
            ]}),
            json!({"model": "m", "stream": false, "messages": [{"role": "assistant", "content": 7}]}),
            json!({"model": "m", "messages": []}),
            // A tool result that is not the last message is not the conversation's end; the
            // other fields, and values of every kind in `content`, are read as the tree reads them.
            json!({"model": "m", "stream": null, "stream_options": null, "temperature": 0.5,
            "user": "u\u{1F600}", "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [
                {"role": "tool", "tool_call_id": "c0", "content": "early result"},
                {"role": "user", "content": "tab\there", "name": "x"},
                {"role": null, "content": 7.5},
                {"role": "assistant", "content": {"odd": ["shape", 1]}},
                {"role": "assistant", "content": true},
            ]}),
        ];
        for body in bodies {
            let bytes = serde_json::to_vec(&body).expect("encodes");
            let wire: WireRequest<'_> = serde_json::from_slice(&bytes).expect("the plain shape");
            assert_eq!(
                wire.request(),
                Some(read(&body).expect("readable")),
                "{body}"
            );
            assert!(plan_bytes(&bytes).is_some_and(|s| s.is_ok()), "{body}");
        }
    }

    #[test]
    fn bytes_of_another_shape_are_left_to_the_tree() {
        for bytes in [
            &b"not json"[..],
            br#"{"model": 3, "messages": []}"#,
            br#"{"model": "m", "messages": {}}"#,
            br#"{"model": "m", "messages": [], "stream": "yes"}"#,
            br#"{"model": "m", "messages": ["hello"]}"#,
            br#"{"model": "m", "model": "n", "messages": []}"#,
            // Serde reads a struct from an array of its fields too; the tree reads no field of one.
            br#"["m", [{"role": "user", "content": "hi"}]]"#,
            br#"{"model": "m", "messages": [["user", "hi"]]}"#,
            br#"{"model": "m", "messages": [], "stream_options": [true]}"#,
            // What the tree cannot hold, even in a field the fake does not read, is its 400.
            br#"{"model": "m", "messages": [], "temperature": 1e400}"#,
            br#"{"model": "m", "messages": [], "user": "\ud800"}"#,
            br#"{"model": "m", "messages": [{"role": "user", "content": "hi", "name": "\udc00"}]}"#,
            b"{\"model\": \"m\", \"messages\": [], \"user\": \"\xff\"}",
            // Duplicates the tree would read the last of, wherever they are.
            br#"{"model": "m", "messages": [{"role": "user", "role": "tool", "content": "x"}]}"#,
            br#"{"model": "m", "messages": [{"role": "user", "content": "a", "content": "b"}]}"#,
            br#"{"model": "m", "messages": [], "str\u0065am": true, "stream": false}"#,
            br#"{"model": "m", "messages": [], "stream_options": {"include_usage": true, "include_usage": false}}"#,
            // Types the tree reads as absent.
            br#"{"model": "m", "messages": [{"role": 7, "content": "x"}]}"#,
            br#"{"model": "m", "messages": [], "stream_options": {"include_usage": "yes"}}"#,
            br#"{"model": "m", "messages": [], "stream_options": 1}"#,
            b"null",
            br#"{"model": "m", "messages": []} trailing"#,
            // Keys serde_json's tree gives a meaning of its own (`raw_value`): a message, stream
            // options, or any other object, read or not.
            br#"{"model": "m", "messages": [{"$serde_json::private::RawValue": "{\"role\":\"user\",\"content\":\"hi there\"}"}]}"#,
            br#"{"model": "m", "messages": [], "stream_options": {"$serde_json::private::RawValue": "{\"include_usage\":true}"}}"#,
            br#"{"model": "m", "messages": [], "metadata": {"$serde_json::private::RawValue": "nope"}}"#,
            br#"{"$serde_json::private::RawValue": "{}", "model": "m", "messages": []}"#,
            br#"{"model": "m", "messages": [{"$serde_json::private::RawValue": "{}", "role": "user", "content": "hi"}]}"#,
        ] {
            assert!(
                plan_bytes(bytes).is_none(),
                "{}",
                String::from_utf8_lossy(bytes)
            );
        }
        // A directive error is an answer (a 400), not a fallback.
        let bad =
            br#"{"model": "m", "messages": [{"role": "user", "content": "[[fake:error=abc]]"}]}"#;
        assert!(plan_bytes(bad).is_some_and(|s| s.is_err()));
    }

    #[test]
    fn words_keep_their_spaces() {
        assert_eq!(
            split_words(" echo:  héllo\tworld "),
            [" echo:  ", "héllo\t", "world "]
        );
        assert!(split_words("").is_empty());
    }

    #[test]
    fn even_split_has_exactly_n_pieces() {
        for (text, n) in [("abcdefg", 3), ("héllo", 5), ("ab", 4), ("", 2), ("x", 1)] {
            let pieces = split_even(text, n);
            assert_eq!(pieces.len(), n, "{text:?} / {n}");
            assert_eq!(pieces.concat(), text);
        }
        assert_eq!(split_even("abcdefg", 3), ["ab", "cd", "efg"]);
    }

    fn body(model: &str, messages: Value) -> Value {
        json!({"model": model, "messages": messages})
    }

    fn text_of(script: &Script) -> &str {
        match &script.outcome {
            Outcome::Text(t) => t,
            other => panic!("expected text, got {other:?}"),
        }
    }

    #[test]
    fn echo_uses_the_last_user_message_without_directives() {
        let b = body(
            "m",
            json!([
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": [
                    {"type": "text", "text": "hello"},
                    {"type": "image_url", "image_url": {"url": "u"}},
                    {"type": "text", "text": "there [[fake:slow=5]]"}
                ]},
            ]),
        );
        let s = plan(&b).expect("plan");
        assert_eq!(text_of(&s), "echo: hello\nthere");
        assert_eq!(s.slow, Duration::from_millis(5));
        assert_eq!(s.prompt_tokens, 1 + 1 + 3);
    }

    #[test]
    fn tool_message_ends_the_tool_loop() {
        let b = body(
            "m",
            json!([
                {"role": "user", "content": "go [[fake:tool=f]]"},
                {"role": "assistant", "content": null, "tool_calls": []},
                {"role": "tool", "tool_call_id": "c", "content": "42"},
            ]),
        );
        assert_eq!(text_of(&plan(&b).expect("plan")), "tool result: 42");
    }

    #[test]
    fn model_names_script_errors_and_delays() {
        let user = json!([{"role": "user", "content": "x"}]);
        let s = plan(&body("fake-error-503", user.clone())).expect("plan");
        assert!(matches!(s.outcome, Outcome::Error(503)));
        let s = plan(&body("fake-slow-250", user.clone())).expect("plan");
        assert_eq!(s.slow, Duration::from_millis(250));
        assert!(plan(&body("fake-slow-soon", user)).is_err());
        assert!(plan(&json!({"messages": []})).is_err());
        assert!(plan(&json!({"model": "m"})).is_err());
    }
}
