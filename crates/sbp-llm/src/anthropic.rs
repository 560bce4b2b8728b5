//! Anthropic's Messages API (`POST {base_url}/messages`), spoken from and back to the gateway's
//! OpenAI chat-completions format: requests are translated on the way out, responses and stream
//! events on the way back, so callers never see Anthropic's shapes (error bodies excepted: an
//! upstream error status carries Anthropic's body as it came).

mod request;
mod response;

use std::time::Duration;

use async_trait::async_trait;
use sbp_protocol::ChatRequest;
use serde_json::Value;

use crate::transport::{self, Endpoint};
use crate::{ChunkStream, Completion, LlmError, Provider};

use response::StreamTranslator;

/// The API version this translation is written against.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

#[derive(Debug, Clone)]
pub struct AnthropicOptions {
    /// Base URL ending before `/messages`, e.g. `https://api.anthropic.com/v1`.
    pub base_url: String,
    /// Sent as `x-api-key`.
    pub api_key: Option<String>,
    /// Sent as `anthropic-version`.
    pub version: String,
    /// `max_tokens` when the request has neither `max_tokens` nor `max_completion_tokens`:
    /// Anthropic requires one where OpenAI does not.
    pub default_max_tokens: u32,
    pub connect_timeout: Duration,
    /// Whole request (non-streamed) or time to the response headers (streamed).
    pub request_timeout: Duration,
    /// Longest silence allowed between two streamed events (Anthropic pings keep a slow
    /// stream alive).
    pub stream_idle_timeout: Duration,
}

impl Default for AnthropicOptions {
    fn default() -> Self {
        Self {
            base_url: "https://api.anthropic.com/v1".to_owned(),
            api_key: None,
            version: ANTHROPIC_VERSION.to_owned(),
            default_max_tokens: 4096,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(120),
            stream_idle_timeout: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, Clone)]
pub struct AnthropicProvider {
    endpoint: Endpoint,
    opts: AnthropicOptions,
}

impl AnthropicProvider {
    pub fn new(opts: AnthropicOptions) -> Result<Self, LlmError> {
        let endpoint = Endpoint::new(&opts.base_url, "messages", opts.connect_timeout)?;
        Ok(Self { endpoint, opts })
    }

    /// The translated request, ready to send, and the model it asked for.
    fn request(&self, req: &ChatRequest, stream: bool) -> (reqwest::RequestBuilder, String) {
        let requested = req.model.clone().unwrap_or_default();
        let translated = request::translate(req, self.opts.default_max_tokens, stream);
        let count = |key: &str| {
            translated
                .get(key)
                .and_then(Value::as_array)
                .map_or(0, Vec::len)
        };
        let (messages, tools) = (count("messages"), count("tools"));
        tracing::debug!(model = %requested, stream, messages, tools, "sending Anthropic request");
        let mut req = self
            .endpoint
            .post()
            .header("anthropic-version", &self.opts.version)
            .json(&translated);
        if let Some(key) = &self.opts.api_key {
            req = req.header("x-api-key", key);
        }
        (req, requested)
    }
}

#[async_trait]
impl Provider for AnthropicProvider {
    fn route_name(&self, requested: &str) -> String {
        requested.to_owned()
    }

    fn provider_name(&self, _requested: &str) -> &'static str {
        "anthropic"
    }

    async fn complete(&self, request: ChatRequest) -> Result<Completion, LlmError> {
        let (req, requested) = self.request(&request, false);
        let deadline = tokio::time::Instant::now() + self.opts.request_timeout;
        let resp = transport::send(req, self.opts.request_timeout).await?;
        let message = transport::read_json(resp, deadline).await?;
        let body = response::completion_body(&message, &requested, chrono::Utc::now().timestamp())?;
        Completion::from_body(body, &requested)
    }

    async fn stream(&self, request: ChatRequest) -> Result<ChunkStream, LlmError> {
        let (req, requested) = self.request(&request, true);
        let resp = transport::send(req, self.opts.request_timeout).await?;
        let mut translator = StreamTranslator::new(&requested, chrono::Utc::now().timestamp());
        Ok(transport::sse_chunks(
            resp,
            self.opts.stream_idle_timeout,
            "stream ended without message_stop",
            move |event, out| translator.event(&event.event, &event.data, out),
        ))
    }

    /// Anthropic's `GET /v1/models` (`{"data": [{"id", "display_name", "created_at", ...}]}`),
    /// in OpenAI's shape.
    async fn models(&self) -> Result<Vec<Value>, LlmError> {
        let mut req = self
            .endpoint
            .get("models")
            .header("anthropic-version", &self.opts.version);
        if let Some(key) = &self.opts.api_key {
            req = req.header("x-api-key", key);
        }
        let deadline = tokio::time::Instant::now() + self.opts.request_timeout;
        let resp = transport::send(req, self.opts.request_timeout).await?;
        let value = transport::read_json(resp, deadline).await?;
        Ok(transport::model_list(&value, "anthropic"))
    }
}
