//! Upstream LLM calls observed where every one of them passes: [`Observed`] wraps the gateway's
//! provider (turns, strict passthrough and CTP rewrites alike) and records each call's outcome,
//! latency and, for streams, time to first token, by model and provider; a failed call also gets a
//! WARN line. The model label is the name a client asked for, which a client chooses: a name
//! becomes a label value only once the upstream has answered it (so an upstream vouches for it),
//! at most [`MAX_MODELS`] of them; the rest are counted under `other`.

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{Stream, StreamExt as _};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use sbp_llm::{ChunkStream, Completion, LlmError, Provider};
use sbp_protocol::ChatRequest;
use serde_json::Value;

use super::{Latencies, Metrics, latencies};

/// Most distinct model names used as label values.
pub const MAX_MODELS: usize = 64;
/// Longest model name used as a label value.
const MAX_MODEL_LEN: usize = 128;
/// The label value of models not (yet) admitted.
pub const OTHER_MODEL: &str = "other";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub model: String,
    pub provider: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: String,
    pub provider: &'static str,
}

#[derive(Debug)]
pub struct UpstreamMetrics {
    requests: Family<CallLabels, Counter>,
    latency: Latencies<CallLabels>,
    first_token: Latencies<ModelLabels>,
    models: Mutex<HashSet<String>>,
}

impl UpstreamMetrics {
    pub(super) fn register(r: &mut Registry) -> Self {
        let requests = Family::default();
        r.register(
            "sbp_upstream_requests",
            "Upstream LLM requests by model, provider and outcome (ok, or how they failed)",
            requests.clone(),
        );
        let latency = latencies();
        r.register(
            "sbp_upstream_latency_seconds",
            "Time from sending one request upstream to its complete reply (or failure), by model, provider and outcome",
            latency.clone(),
        );
        let first_token = latencies();
        r.register(
            "sbp_upstream_time_to_first_token_seconds",
            "Time from sending a streamed request upstream to its first content or tool-call delta, by model and provider",
            first_token.clone(),
        );
        Self {
            requests,
            latency,
            first_token,
            models: Mutex::new(HashSet::new()),
        }
    }

    /// The label value for `model`; with `answered`, the upstream answered it, which admits the
    /// name while there is room.
    fn model_label(&self, model: &str, answered: bool) -> String {
        // A poisoned lock only means a panic elsewhere while admitting: the set is still whole.
        let mut known = self.models.lock().unwrap_or_else(|e| e.into_inner());
        if known.contains(model) {
            return model.to_owned();
        }
        let fits = model.len() <= MAX_MODEL_LEN && !model.is_empty();
        if answered && fits && known.len() < MAX_MODELS {
            known.insert(model.to_owned());
            return model.to_owned();
        }
        OTHER_MODEL.to_owned()
    }
}

/// A model name as a log field shows it: the caller chose it, so it is cut to the label's length
/// and its control characters (a newline would forge a line of the text log) are escaped.
fn shown(model: &str) -> String {
    model
        .chars()
        .take(MAX_MODEL_LEN)
        .flat_map(|c| {
            let escaped: Vec<char> = match c.is_control() {
                true => c.escape_default().collect(),
                false => vec![c],
            };
            escaped
        })
        .collect()
}

/// How an upstream call ended, as a label value.
fn outcome(e: Option<&LlmError>) -> &'static str {
    match e {
        None => "ok",
        Some(LlmError::Timeout) => "timeout",
        Some(LlmError::Unreachable(_)) => "unreachable",
        Some(LlmError::Status { status: 429, .. }) => "rate_limited",
        Some(LlmError::Status { status, .. }) if *status < 500 => "client_error",
        Some(LlmError::Status { .. }) => "server_error",
        Some(LlmError::Protocol(_)) => "protocol_error",
    }
}

/// The gateway's provider with every call observed.
pub struct Observed {
    inner: Arc<dyn Provider>,
    metrics: Arc<Metrics>,
}

impl Observed {
    pub fn new(inner: Arc<dyn Provider>, metrics: Arc<Metrics>) -> Self {
        Self { inner, metrics }
    }

    fn start(&self, request: &ChatRequest) -> Call {
        let model = request.model.clone().unwrap_or_default();
        Call {
            provider: self.inner.provider_name(&model),
            model,
            metrics: self.metrics.clone(),
            started: Instant::now(),
        }
    }
}

/// One call in flight.
struct Call {
    model: String,
    provider: &'static str,
    metrics: Arc<Metrics>,
    started: Instant,
}

impl Call {
    fn first_token(&self) {
        let up = &self.metrics.upstream;
        let labels = ModelLabels {
            model: up.model_label(&self.model, true),
            provider: self.provider,
        };
        up.first_token
            .get_or_create(&labels)
            .observe(self.started.elapsed().as_secs_f64());
    }

    /// Records the ending: `Ok(())`, the upstream's error, or `Err(None)` when the caller dropped
    /// a stream before its end.
    fn finish(self, end: Result<(), Option<&LlmError>>) {
        let elapsed = self.started.elapsed();
        let up = &self.metrics.upstream;
        let outcome = match end {
            Ok(()) => outcome(None),
            Err(Some(e)) => outcome(Some(e)),
            Err(None) => "cancelled",
        };
        let labels = CallLabels {
            model: up.model_label(&self.model, end.is_ok()),
            provider: self.provider,
            outcome,
        };
        up.latency
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
        up.requests.get_or_create(&labels).inc();
        let latency_ms = elapsed.as_secs_f64() * 1000.0;
        match end {
            Err(Some(error)) => {
                let status = match error {
                    LlmError::Status { status, .. } => Some(*status),
                    _ => None,
                };
                tracing::warn!(model = %shown(&self.model), provider = self.provider, outcome, status, latency_ms, %error, "upstream request failed");
            }
            Err(None) => {
                tracing::debug!(model = %shown(&self.model), provider = self.provider, latency_ms, "upstream stream dropped before its end");
            }
            Ok(()) => {}
        }
    }
}

/// Whether a chunk carries the first token: content, reasoning, a refusal or a tool call (a
/// first chunk with only the role is not one).
fn has_token(chunk: &Value) -> bool {
    let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
        return false;
    };
    choices.iter().filter_map(|c| c.get("delta")).any(|d| {
        ["content", "reasoning_content", "refusal"].iter().any(|k| {
            d.get(k)
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty())
        }) || d.get("tool_calls").is_some_and(|t| !t.is_null())
    })
}

/// A stream that records its call when it ends (or is dropped before its end).
struct ObservedStream {
    inner: ChunkStream,
    call: Option<Call>,
    first_seen: bool,
}

impl Stream for ObservedStream {
    type Item = Result<Value, LlmError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = std::task::ready!(self.inner.poll_next_unpin(cx));
        match &item {
            Some(Ok(chunk)) => {
                if !self.first_seen && has_token(chunk) {
                    self.first_seen = true;
                    if let Some(call) = &self.call {
                        call.first_token();
                    }
                }
            }
            Some(Err(e)) => {
                if let Some(call) = self.call.take() {
                    call.finish(Err(Some(e)));
                }
            }
            None => {
                if let Some(call) = self.call.take() {
                    call.finish(Ok(()));
                }
            }
        }
        Poll::Ready(item)
    }
}

impl Drop for ObservedStream {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            call.finish(Err(None));
        }
    }
}

#[async_trait]
impl Provider for Observed {
    fn route_name(&self, requested: &str) -> String {
        self.inner.route_name(requested)
    }

    fn provider_name(&self, requested: &str) -> &'static str {
        self.inner.provider_name(requested)
    }

    async fn complete(&self, request: ChatRequest) -> Result<Completion, LlmError> {
        let call = self.start(&request);
        let result = self.inner.complete(request).await;
        call.finish(result.as_ref().map(|_| ()).map_err(Some));
        result
    }

    async fn complete_bytes(&self, request: ChatRequest) -> Result<Bytes, LlmError> {
        let call = self.start(&request);
        let result = self.inner.complete_bytes(request).await;
        call.finish(result.as_ref().map(|_| ()).map_err(Some));
        result
    }

    async fn stream(&self, request: ChatRequest) -> Result<ChunkStream, LlmError> {
        let call = self.start(&request);
        match self.inner.stream(request).await {
            Ok(inner) => Ok(Box::pin(ObservedStream {
                inner,
                call: Some(call),
                first_seen: false,
            })),
            Err(e) => {
                call.finish(Err(Some(&e)));
                Err(e)
            }
        }
    }

    async fn models(&self) -> Result<Vec<Value>, LlmError> {
        self.inner.models().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_model_name_in_a_log_line_cannot_start_another_line() {
        assert_eq!(shown("gpt-4o"), "gpt-4o");
        assert_eq!(shown("a\nINFO forged"), "a\\nINFO forged");
        assert_eq!(shown(&"m".repeat(500)).len(), MAX_MODEL_LEN);
    }

    #[test]
    fn model_labels_are_admitted_by_an_answer_and_capped() {
        let m = Metrics::default();
        let up = &m.upstream;
        assert_eq!(up.model_label("gpt-x", false), OTHER_MODEL);
        assert_eq!(up.model_label("gpt-x", true), "gpt-x");
        assert_eq!(up.model_label("gpt-x", false), "gpt-x", "known now");
        assert_eq!(up.model_label(&"m".repeat(200), true), OTHER_MODEL);
        for i in 0..MAX_MODELS * 2 {
            up.model_label(&format!("model-{i}"), true);
        }
        assert_eq!(up.model_label("late", true), OTHER_MODEL);
        assert_eq!(up.models.lock().expect("lock").len(), MAX_MODELS);
    }

    #[test]
    fn the_first_token_is_content_or_a_tool_call_not_the_role() {
        let role = json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]});
        assert!(!has_token(&role));
        assert!(has_token(
            &json!({"choices": [{"delta": {"content": "Hi"}}]})
        ));
        assert!(has_token(
            &json!({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})
        ));
        assert!(!has_token(&json!({"choices": [], "usage": {}})));
    }

    #[test]
    fn outcomes_name_how_a_call_failed() {
        let status = |status| LlmError::Status {
            status,
            body: json!({}),
        };
        assert_eq!(outcome(None), "ok");
        assert_eq!(outcome(Some(&status(429))), "rate_limited");
        assert_eq!(outcome(Some(&status(404))), "client_error");
        assert_eq!(outcome(Some(&status(503))), "server_error");
        assert_eq!(outcome(Some(&LlmError::Timeout)), "timeout");
    }
}
