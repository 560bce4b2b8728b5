//! Any OpenAI-compatible chat completions endpoint (OpenAI, vLLM, Ollama, llama.cpp, LiteLLM, ...).

use std::time::Duration;

use async_trait::async_trait;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::{Map, Value};

use crate::{ChunkStream, Completion, LlmError, Provider};

#[derive(Debug, Clone)]
pub struct OpenAiOptions {
    /// Base URL ending before `/chat/completions`, e.g. `http://127.0.0.1:11434/v1`.
    pub base_url: String,
    pub api_key: Option<String>,
    pub connect_timeout: Duration,
    /// Whole request (non-streamed) or time to the response headers (streamed).
    pub request_timeout: Duration,
    /// Longest silence allowed between two streamed chunks.
    pub stream_idle_timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct OpenAiProvider {
    client: reqwest::Client,
    url: String,
    opts: OpenAiOptions,
}

impl OpenAiProvider {
    pub fn new(opts: OpenAiOptions) -> Result<Self, LlmError> {
        let client = reqwest::Client::builder()
            .connect_timeout(opts.connect_timeout)
            .pool_max_idle_per_host(256)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| LlmError::Protocol(format!("cannot build HTTP client: {e}")))?;
        let url = format!("{}/chat/completions", opts.base_url.trim_end_matches('/'));
        Ok(Self { client, url, opts })
    }

    fn request(&self, body: &Map<String, Value>) -> reqwest::RequestBuilder {
        let mut req = self.client.post(&self.url).json(body);
        if let Some(key) = &self.opts.api_key {
            req = req.bearer_auth(key);
        }
        req
    }

    async fn send(
        &self,
        body: &Map<String, Value>,
        timeout: Duration,
    ) -> Result<reqwest::Response, LlmError> {
        let resp = tokio::time::timeout(timeout, self.request(body).send())
            .await
            .map_err(|_| LlmError::Timeout)?
            .map_err(classify)?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let text = tokio::time::timeout(timeout, resp.text())
            .await
            .map_err(|_| LlmError::Timeout)?
            .unwrap_or_default();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Err(LlmError::Status {
            status: status.as_u16(),
            body,
        })
    }
}

fn classify(e: reqwest::Error) -> LlmError {
    if e.is_timeout() {
        LlmError::Timeout
    } else if e.is_connect() {
        LlmError::Unreachable(e.to_string())
    } else if e.is_decode() || e.is_body() {
        LlmError::Protocol(e.to_string())
    } else {
        LlmError::Unreachable(e.to_string())
    }
}

#[async_trait]
impl Provider for OpenAiProvider {
    fn route_name(&self, requested: &str) -> String {
        requested.to_owned()
    }

    async fn complete(&self, mut body: Map<String, Value>) -> Result<Completion, LlmError> {
        body.insert("stream".into(), Value::Bool(false));
        let requested = body
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let deadline = tokio::time::Instant::now() + self.opts.request_timeout;
        let resp = self.send(&body, self.opts.request_timeout).await?;
        let bytes = tokio::time::timeout_at(deadline, resp.bytes())
            .await
            .map_err(|_| LlmError::Timeout)?
            .map_err(classify)?;
        let value: Value = serde_json::from_slice(&bytes)
            .map_err(|e| LlmError::Protocol(format!("response is not JSON: {e}")))?;
        Completion::from_body(value, &requested)
    }

    async fn stream(&self, mut body: Map<String, Value>) -> Result<ChunkStream, LlmError> {
        body.insert("stream".into(), Value::Bool(true));
        let resp = self.send(&body, self.opts.request_timeout).await?;
        let idle = self.opts.stream_idle_timeout;
        let mut events = resp.bytes_stream().eventsource();
        let stream = async_stream(move |tx| async move {
            loop {
                let next = match tokio::time::timeout(idle, events.next()).await {
                    Err(_) => {
                        let _ = tx.send(Err(LlmError::Timeout)).await;
                        return;
                    }
                    Ok(None) => {
                        let _ = tx
                            .send(Err(LlmError::Protocol(
                                "stream ended without [DONE]".into(),
                            )))
                            .await;
                        return;
                    }
                    Ok(Some(ev)) => ev,
                };
                let event = match next {
                    Ok(ev) => ev,
                    Err(e) => {
                        let _ = tx.send(Err(LlmError::Protocol(e.to_string()))).await;
                        return;
                    }
                };
                let data = event.data.trim();
                if data == "[DONE]" {
                    return;
                }
                if data.is_empty() {
                    continue;
                }
                let item = serde_json::from_str::<Value>(data)
                    .map_err(|e| LlmError::Protocol(format!("bad stream chunk: {e}")));
                if let Ok(v) = &item
                    && v.get("error").is_some()
                {
                    let _ = tx
                        .send(Err(LlmError::Status {
                            status: 502,
                            body: v.clone(),
                        }))
                        .await;
                    return;
                }
                if tx.send(item).await.is_err() {
                    return;
                }
            }
        });
        Ok(stream)
    }
}

/// Runs `producer` as a task feeding a channel, and returns the channel as a stream. The task ends
/// when the stream is dropped (its sends fail).
fn async_stream<F, Fut>(producer: F) -> ChunkStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Value, LlmError>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(producer(tx));
    tokio_stream_from(rx)
}

fn tokio_stream_from(mut rx: tokio::sync::mpsc::Receiver<Result<Value, LlmError>>) -> ChunkStream {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
}
