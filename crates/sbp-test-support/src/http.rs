//! HTTP helpers over reqwest: a client for loopback, a response as (status, headers, JSON), and
//! the `data:` payloads of an SSE body.

use reqwest::header::HeaderMap;
use serde_json::{Value, json};

use crate::WAIT;

/// An HTTP client that never goes through a proxy (the gateways under test are on loopback).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("http client")
}

/// Sends a request, waiting at most [`WAIT`] for the response; see [`response`].
pub async fn send(req: reqwest::RequestBuilder) -> (u16, HeaderMap, Value) {
    let resp = tokio::time::timeout(WAIT, req.send())
        .await
        .expect("response within the wait")
        .expect("request sent");
    response(resp).await
}

/// A response as (status, headers, body): the body as JSON, or as a JSON string when it is not
/// JSON.
pub async fn response(resp: reqwest::Response) -> (u16, HeaderMap, Value) {
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("response body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, headers, body)
}

/// The `data:` payloads of an SSE body, `[DONE]` as the JSON string `"[DONE]"`.
pub fn sse_data(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| {
            if d == "[DONE]" {
                json!("[DONE]")
            } else {
                serde_json::from_str(d).expect("SSE data is JSON")
            }
        })
        .collect()
}
