//! Shared helpers for the provider tests: a fake upstream on loopback, providers pointed at it,
//! request bodies, and draining a chunk stream.

use std::time::Duration;

use futures::StreamExt;
use sbp_fake_llm::FakeLlm;
use sbp_llm::{
    AnthropicOptions, AnthropicProvider, Assembler, LlmError, OpenAiOptions, OpenAiProvider,
    Provider,
};
use sbp_protocol::ChatRequest;
use serde_json::{Value, json};

pub async fn fake() -> FakeLlm {
    FakeLlm::start().await.expect("fake starts")
}

pub fn anthropic_options(fake: &FakeLlm) -> AnthropicOptions {
    AnthropicOptions {
        base_url: fake.base_url(),
        api_key: Some("sk-ant-test".into()),
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(10),
        stream_idle_timeout: Duration::from_secs(10),
        ..AnthropicOptions::default()
    }
}

pub fn anthropic(fake: &FakeLlm) -> AnthropicProvider {
    AnthropicProvider::new(anthropic_options(fake)).expect("provider")
}

pub fn openai(fake: &FakeLlm) -> OpenAiProvider {
    OpenAiProvider::new(OpenAiOptions {
        base_url: fake.base_url(),
        api_key: Some("sk-test".into()),
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(10),
        stream_idle_timeout: Duration::from_secs(10),
    })
    .expect("provider")
}

/// An OpenAI request body.
pub fn body(v: Value) -> ChatRequest {
    match v {
        Value::Object(map) => ChatRequest::from_object(map).expect("a valid request"),
        other => panic!("a body is an object, not {other}"),
    }
}

/// A one-message OpenAI request for `model`.
pub fn user(model: &str, text: &str) -> ChatRequest {
    body(json!({"model": model, "messages": [{"role": "user", "content": text}]}))
}

/// Streams `body` and folds every chunk; the error that ended the stream, if one did.
pub async fn stream(
    provider: &dyn Provider,
    body: ChatRequest,
) -> Result<(Assembler, Vec<Value>), LlmError> {
    let mut s = provider.stream(body).await?;
    let mut asm = Assembler::default();
    let mut chunks = Vec::new();
    while let Some(item) = s.next().await {
        let chunk = item?;
        asm.push(&chunk);
        chunks.push(chunk);
    }
    Ok((asm, chunks))
}
