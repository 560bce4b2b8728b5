//! Any OpenAI-compatible chat completions endpoint (OpenAI, vLLM, Ollama, llama.cpp, LiteLLM, ...).

use std::collections::VecDeque;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use sbp_protocol::ChatRequest;
use serde_json::Value;

use crate::sse::Event;
use crate::transport::{self, Endpoint, Flow};
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
    endpoint: Endpoint,
    opts: OpenAiOptions,
}

impl OpenAiProvider {
    pub fn new(opts: OpenAiOptions) -> Result<Self, LlmError> {
        let endpoint = Endpoint::new(&opts.base_url, "chat/completions", opts.connect_timeout)?;
        Ok(Self { endpoint, opts })
    }

    /// The request as sent upstream: without the SBP namespace, streamed or not as asked. The
    /// body is built by `ChatRequest::to_json` (the stored transcript copied as kept).
    fn request(
        &self,
        mut body: ChatRequest,
        stream: bool,
    ) -> Result<reqwest::RequestBuilder, LlmError> {
        body.sbp = None;
        body.stream = Some(stream);
        let json = body
            .to_json()
            .map_err(|e| LlmError::Protocol(format!("request not serialisable: {e}")))?;
        let mut req = self
            .endpoint
            .post()
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(json);
        if let Some(key) = &self.opts.api_key {
            req = req.bearer_auth(key);
        }
        Ok(req)
    }

    /// A whole (non-streamed) answer's body, within the request timeout.
    async fn fetch(&self, body: ChatRequest) -> Result<Bytes, LlmError> {
        let deadline = tokio::time::Instant::now() + self.opts.request_timeout;
        let resp = transport::send(self.request(body, false)?, self.opts.request_timeout).await?;
        transport::read_bytes(resp, deadline).await
    }
}

#[async_trait]
impl Provider for OpenAiProvider {
    fn route_name(&self, requested: &str) -> String {
        requested.to_owned()
    }

    fn provider_name(&self, _requested: &str) -> &'static str {
        "openai"
    }

    async fn complete(&self, body: ChatRequest) -> Result<Completion, LlmError> {
        let requested = body.model.clone().unwrap_or_default();
        let value = transport::parse_json(&self.fetch(body).await?)?;
        Completion::from_body(value, &requested)
    }

    /// The upstream's body as it came, once checked.
    async fn complete_bytes(&self, body: ChatRequest) -> Result<Bytes, LlmError> {
        let bytes = self.fetch(body).await?;
        Completion::check_body(&bytes)?;
        Ok(bytes)
    }

    async fn stream(&self, body: ChatRequest) -> Result<ChunkStream, LlmError> {
        let resp = transport::send(self.request(body, true)?, self.opts.request_timeout).await?;
        Ok(transport::sse_chunks(
            resp,
            self.opts.stream_idle_timeout,
            "stream ended without [DONE]",
            decode_event,
        ))
    }

    async fn models(&self) -> Result<Vec<Value>, LlmError> {
        let mut req = self.endpoint.get("models");
        if let Some(key) = &self.opts.api_key {
            req = req.bearer_auth(key);
        }
        let deadline = tokio::time::Instant::now() + self.opts.request_timeout;
        let resp = transport::send(req, self.opts.request_timeout).await?;
        let value = transport::read_json(resp, deadline).await?;
        Ok(transport::model_list(&value, "upstream"))
    }
}

/// One OpenAI SSE event: a chunk, `[DONE]`, or an in-band `{"error": ...}` object (which some
/// compatible servers send after a 200 when generation fails part way).
fn decode_event(event: &Event, out: &mut VecDeque<Value>) -> Result<Flow, LlmError> {
    let data = event.data.trim();
    if data == "[DONE]" {
        return Ok(Flow::End);
    }
    if data.is_empty() {
        return Ok(Flow::Continue);
    }
    let chunk: Value = serde_json::from_str(data)
        .map_err(|e| LlmError::Protocol(format!("bad stream chunk: {e}")))?;
    if chunk.get("error").is_some() {
        return Err(LlmError::Status {
            status: 502,
            body: chunk,
        });
    }
    out.push_back(chunk);
    Ok(Flow::Continue)
}
