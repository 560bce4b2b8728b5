//! Shared helpers for the fake LLM's integration tests: request bodies, a client, SSE reading.

use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures::StreamExt;
use sbp_fake_llm::FakeLlm;
use serde_json::{Value, json};

pub fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// A one-message chat request.
pub fn user(text: &str) -> Value {
    json!({"model": "test-model", "messages": [{"role": "user", "content": text}]})
}

/// The same request with `stream: true`.
pub fn streaming(text: &str) -> Value {
    let mut body = user(text);
    body["stream"] = json!(true);
    body
}

pub async fn post(fake: &FakeLlm, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}/chat/completions", fake.base_url()))
        .json(body)
        .send()
        .await
        .expect("request reaches the fake")
}

/// Posts a body that is not JSON, labelled as JSON, to `path` below the base URL; returns the
/// status and the parsed error body.
pub async fn post_garbage(fake: &FakeLlm, path: &str) -> (u16, Value) {
    let response = client()
        .post(format!("{}/{path}", fake.base_url()))
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("request");
    let status = response.status().as_u16();
    (status, response.json().await.expect("JSON error body"))
}

/// Posts and returns status and parsed JSON body.
pub async fn post_json(fake: &FakeLlm, body: &Value) -> (u16, Value) {
    let response = post(fake, body).await;
    let status = response.status().as_u16();
    let body = response.json().await.expect("JSON body");
    (status, body)
}

/// What a streamed answer looked like on the wire.
#[derive(Debug)]
pub struct Streamed {
    /// Parsed `data:` payloads, `[DONE]` excluded.
    pub chunks: Vec<Value>,
    /// Whether the last event was `data: [DONE]`.
    pub done: bool,
    /// The error that ended the stream, if it did not end cleanly.
    pub error: Option<String>,
    /// Time from sending the request to the first event.
    pub first_event_after: Option<Duration>,
    pub content_type: String,
}

impl Streamed {
    /// Every `delta.content` string, in order.
    pub fn contents(&self) -> Vec<String> {
        self.chunks
            .iter()
            .filter_map(|c| c.pointer("/choices/0/delta/content"))
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect()
    }

    pub fn text(&self) -> String {
        self.contents().concat()
    }

    /// The `finish_reason` of the last chunk that has one.
    pub fn finish_reason(&self) -> Option<String> {
        self.chunks
            .iter()
            .filter_map(|c| c.pointer("/choices/0/finish_reason"))
            .filter_map(Value::as_str)
            .next_back()
            .map(str::to_owned)
    }
}

pub async fn stream(fake: &FakeLlm, body: &Value) -> Streamed {
    let started = Instant::now();
    let response = post(fake, body).await;
    assert_eq!(response.status(), 200, "streaming answer status");
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let mut events = response.bytes_stream().eventsource();
    let mut streamed = Streamed {
        chunks: Vec::new(),
        done: false,
        error: None,
        first_event_after: None,
        content_type,
    };
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                streamed.error = Some(e.to_string());
                break;
            }
        };
        streamed
            .first_event_after
            .get_or_insert_with(|| started.elapsed());
        assert!(!streamed.done, "event after [DONE]: {}", event.data);
        if event.data == "[DONE]" {
            streamed.done = true;
        } else {
            streamed
                .chunks
                .push(serde_json::from_str(&event.data).expect("chunk is JSON"));
        }
    }
    streamed
}

/// Posts to the Anthropic Messages endpoint with the version header the real API requires.
pub async fn post_messages(fake: &FakeLlm, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}/messages", fake.base_url()))
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .expect("request reaches the fake")
}

/// A one-message Anthropic request.
pub fn anthropic_user(text: &str) -> Value {
    json!({"model": "claude-test", "max_tokens": 256, "messages": [{"role": "user", "content": text}]})
}

/// Every event of a streamed Anthropic answer: its `event:` name and parsed data, checking
/// that the two agree as the real API's do.
pub async fn anthropic_events(fake: &FakeLlm, body: &Value) -> Vec<(String, Value)> {
    let response = post_messages(fake, body).await;
    assert_eq!(response.status(), 200, "streaming answer status");
    let mut events = response.bytes_stream().eventsource();
    let mut out = Vec::new();
    while let Some(event) = events.next().await {
        let event = event.expect("a whole event");
        let data: Value = serde_json::from_str(&event.data).expect("event data is JSON");
        assert_eq!(
            data["type"],
            event.event.as_str(),
            "event name matches type"
        );
        out.push((event.event, data));
    }
    out
}
