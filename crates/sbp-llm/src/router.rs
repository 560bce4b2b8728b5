//! Picks a provider by model name, so one gateway can talk to several upstreams: the first
//! route whose prefix the requested model starts with wins, and anything unmatched goes to
//! the default provider.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use sbp_protocol::ChatRequest;
use serde_json::Value;

use crate::{ChunkStream, Completion, LlmError, Provider};

/// Which model names a route takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelMatch {
    prefix: String,
    strip: bool,
    exact: bool,
}

impl ModelMatch {
    /// Models whose name starts with `prefix` (case-sensitive), sent upstream unchanged.
    pub fn prefix(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            strip: false,
            exact: false,
        }
    }

    /// The one model named `name`, sent upstream unchanged (`sbp/echo` beside an upstream).
    pub fn exact(name: impl Into<String>) -> Self {
        Self {
            exact: true,
            ..Self::prefix(name)
        }
    }

    /// Sends the model upstream without the prefix: with `anthropic/`, `anthropic/claude-x`
    /// reaches the provider as `claude-x`. A name that is the prefix alone is kept whole rather
    /// than sent empty.
    pub fn stripping_prefix(mut self) -> Self {
        self.strip = true;
        self
    }

    pub fn matches(&self, model: &str) -> bool {
        if self.exact {
            model == self.prefix
        } else {
            model.starts_with(&self.prefix)
        }
    }

    /// The model name the provider is given for `model`, which this matches.
    fn upstream<'m>(&self, model: &'m str) -> &'m str {
        match model.strip_prefix(&self.prefix) {
            Some(rest) if self.strip && !rest.is_empty() => rest,
            _ => model,
        }
    }
}

/// A provider that hands each request to the provider its model routes to.
#[derive(Clone)]
pub struct Router {
    default: Arc<dyn Provider>,
    routes: Vec<(ModelMatch, Arc<dyn Provider>)>,
}

impl fmt::Debug for Router {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Providers are not `Debug`; the matches are what tells routers apart.
        let matches: Vec<&ModelMatch> = self.routes.iter().map(|(m, _)| m).collect();
        f.debug_struct("Router").field("routes", &matches).finish()
    }
}

impl Router {
    /// A router that sends everything to `default` until routes are added.
    pub fn new(default: Arc<dyn Provider>) -> Self {
        Self {
            default,
            routes: Vec::new(),
        }
    }

    /// Adds a route after the existing ones: earlier routes are tried first.
    pub fn with_route(mut self, matcher: ModelMatch, provider: Arc<dyn Provider>) -> Self {
        self.push(matcher, provider);
        self
    }

    /// Adds a route after the existing ones.
    pub fn push(&mut self, matcher: ModelMatch, provider: Arc<dyn Provider>) {
        self.routes.push((matcher, provider));
    }

    /// The provider for `model` and the model name to give it.
    pub fn resolve<'m>(&self, model: &'m str) -> (&Arc<dyn Provider>, &'m str) {
        self.routes
            .iter()
            .find(|(m, _)| m.matches(model))
            .map_or((&self.default, model), |(m, p)| (p, m.upstream(model)))
    }

    /// The provider for a request body, with the body's `model` rewritten when the route
    /// strips its prefix.
    fn route(&self, mut body: ChatRequest) -> (&Arc<dyn Provider>, ChatRequest) {
        let model = body.model.as_deref().unwrap_or("");
        let (provider, upstream) = self.resolve(model);
        let rewrite = (upstream != model).then(|| upstream.to_owned());
        tracing::debug!(
            model,
            upstream_model = upstream,
            default = Arc::ptr_eq(provider, &self.default),
            "routing request"
        );
        if let Some(upstream) = rewrite {
            body.model = Some(upstream);
        }
        (provider, body)
    }
}

#[async_trait]
impl Provider for Router {
    fn route_name(&self, requested: &str) -> String {
        let (provider, upstream) = self.resolve(requested);
        provider.route_name(upstream)
    }

    fn provider_name(&self, requested: &str) -> &'static str {
        let (provider, upstream) = self.resolve(requested);
        provider.provider_name(upstream)
    }

    async fn complete(&self, body: ChatRequest) -> Result<Completion, LlmError> {
        let (provider, body) = self.route(body);
        provider.complete(body).await
    }

    async fn complete_bytes(&self, body: ChatRequest) -> Result<Bytes, LlmError> {
        let (provider, body) = self.route(body);
        provider.complete_bytes(body).await
    }

    async fn stream(&self, body: ChatRequest) -> Result<ChunkStream, LlmError> {
        let (provider, body) = self.route(body);
        provider.stream(body).await
    }

    /// The routes' models (a stripping route's under its prefix, as callers name them), then the
    /// default provider's; each id once. A provider that cannot list is left out (logged); an
    /// error only when none could.
    async fn models(&self) -> Result<Vec<Value>, LlmError> {
        let mut out: Vec<Value> = Vec::new();
        let mut last_err = None;
        let mut answered = 0;
        for (matcher, provider) in &self.routes {
            match provider.models().await {
                Ok(models) => {
                    answered += 1;
                    for mut m in models {
                        if matcher.strip
                            && let Some(id) = m.get("id").and_then(Value::as_str)
                            && !id.starts_with(&matcher.prefix)
                        {
                            m["id"] = Value::String(format!("{}{id}", matcher.prefix));
                        }
                        push_model(&mut out, m);
                    }
                }
                Err(e) => {
                    tracing::warn!(route = %matcher.prefix, error = %e, "listing a route's models failed");
                    last_err = Some(e);
                }
            }
        }
        match self.default.models().await {
            Ok(models) => {
                answered += 1;
                for m in models {
                    push_model(&mut out, m);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "listing the upstream's models failed");
                last_err = Some(e);
            }
        }
        match (answered, last_err) {
            (0, Some(e)) => Err(e),
            _ => Ok(out),
        }
    }
}

/// Adds `model` unless a model of its id is listed already.
fn push_model(out: &mut Vec<Value>, model: Value) {
    let id = model.get("id").and_then(Value::as_str).unwrap_or_default();
    if !out
        .iter()
        .any(|m| m.get("id").and_then(Value::as_str) == Some(id))
    {
        out.push(model);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use serde_json::json;

    /// Answers with its own name and the model it was given.
    struct Named(&'static str);

    #[async_trait]
    impl Provider for Named {
        fn route_name(&self, requested: &str) -> String {
            format!("{}:{requested}", self.0)
        }

        async fn complete(&self, body: ChatRequest) -> Result<Completion, LlmError> {
            let model = body.model;
            let reply = json!({"model": model, "choices": [{"message": {"role": "assistant", "content": self.0}}]});
            Completion::from_body(reply, "")
        }

        /// Bytes no serialised completion would be: the route is seen to be delegated.
        async fn complete_bytes(&self, body: ChatRequest) -> Result<Bytes, LlmError> {
            let model = body.model.unwrap_or_default();
            Ok(Bytes::from(format!("{}|{model}", self.0)))
        }

        async fn stream(&self, body: ChatRequest) -> Result<ChunkStream, LlmError> {
            let c = self.complete(body).await?;
            let chunk = json!({"model": c.model, "choices": [{"delta": {"content": self.0}}]});
            Ok(futures::stream::iter([Ok(chunk)]).boxed())
        }
    }

    fn router() -> Router {
        Router::new(Arc::new(Named("default")))
            .with_route(
                ModelMatch::prefix("anthropic/").stripping_prefix(),
                Arc::new(Named("anthropic")),
            )
            .with_route(ModelMatch::prefix("claude"), Arc::new(Named("claude")))
            .with_route(ModelMatch::prefix("cla"), Arc::new(Named("shadowed")))
    }

    fn body(model: &str) -> ChatRequest {
        ChatRequest {
            model: Some(model.to_owned()),
            ..ChatRequest::default()
        }
    }

    /// Each case: requested model, provider that answers, model it is given.
    const CASES: [(&str, &str, &str); 6] = [
        ("claude-sonnet-4", "claude", "claude-sonnet-4"),
        ("anthropic/claude-x", "anthropic", "claude-x"),
        ("anthropic/", "anthropic", "anthropic/"),
        ("clam", "shadowed", "clam"),
        ("gpt-4o", "default", "gpt-4o"),
        ("Claude-x", "default", "Claude-x"),
    ];

    #[tokio::test]
    async fn first_matching_route_wins_and_strips_when_asked() {
        let r = router();
        for (model, provider, upstream) in CASES {
            assert_eq!(
                r.route_name(model),
                format!("{provider}:{upstream}"),
                "{model}"
            );
            let c = r.complete(body(model)).await.expect("completes");
            assert_eq!(c.text(), Some(provider), "{model}");
            assert_eq!(c.model, upstream, "{model}");
            let bytes = r.complete_bytes(body(model)).await.expect("relays");
            assert_eq!(
                bytes,
                format!("{provider}|{upstream}").as_bytes(),
                "{model}"
            );
            let mut s = r.stream(body(model)).await.expect("streams");
            let chunk = s.next().await.expect("a chunk").expect("ok");
            assert_eq!(chunk["choices"][0]["delta"]["content"], provider, "{model}");
            assert_eq!(chunk["model"], upstream, "{model}");
        }
    }

    #[tokio::test]
    async fn a_body_without_a_model_goes_to_the_default() {
        let r = router();
        let c = r
            .complete(ChatRequest::default())
            .await
            .expect("the default answers");
        assert_eq!(c.text(), Some("default"));
        assert!(format!("{r:?}").contains("anthropic/"));
    }

    #[test]
    fn the_provider_name_is_the_routed_providers() {
        let r = Router::new(Arc::new(Named("default")))
            .with_route(ModelMatch::prefix("sbp/"), Arc::new(crate::EchoProvider));
        assert_eq!(r.provider_name("sbp/echo"), "echo");
        assert_eq!(
            r.provider_name("gpt-4o"),
            "other",
            "a provider that names no kind"
        );
    }

    #[test]
    fn matches_are_prefixes() {
        let m = ModelMatch::prefix("claude");
        assert!(m.matches("claude"));
        assert!(m.matches("claude-3"));
        assert!(!m.matches("xclaude"));
        assert_eq!(m.upstream("claude-3"), "claude-3");
        let s = ModelMatch::prefix("a/").stripping_prefix();
        assert_eq!(s.upstream("a/b"), "b");
        let e = ModelMatch::exact("sbp/echo");
        assert!(e.matches("sbp/echo"));
        assert!(!e.matches("sbp/echo-2"), "an exact match is not a prefix");
        assert_eq!(e.upstream("sbp/echo"), "sbp/echo");
    }

    /// Lists fixed models (or fails).
    struct Listing(Option<Vec<&'static str>>);

    #[async_trait]
    impl Provider for Listing {
        fn route_name(&self, requested: &str) -> String {
            requested.to_owned()
        }

        async fn complete(&self, _body: ChatRequest) -> Result<Completion, LlmError> {
            Err(LlmError::Timeout)
        }

        async fn stream(&self, _body: ChatRequest) -> Result<ChunkStream, LlmError> {
            Err(LlmError::Timeout)
        }

        async fn models(&self) -> Result<Vec<Value>, LlmError> {
            match &self.0 {
                Some(ids) => Ok(ids
                    .iter()
                    .map(|id| json!({"id": id, "object": "model"}))
                    .collect()),
                None => Err(LlmError::Timeout),
            }
        }
    }

    #[tokio::test]
    async fn models_merge_routes_under_their_names_and_skip_a_failing_provider() {
        let router = Router::new(Arc::new(Listing(Some(vec!["gpt-x", "claude-1"]))))
            .with_route(
                ModelMatch::prefix("anthropic/").stripping_prefix(),
                Arc::new(Listing(Some(vec!["claude-1"]))),
            )
            .with_route(ModelMatch::prefix("down/"), Arc::new(Listing(None)));
        let ids: Vec<String> = router
            .models()
            .await
            .expect("listed")
            .iter()
            .map(|m| m["id"].as_str().unwrap_or_default().to_owned())
            .collect();
        // A stripping route's models as callers name them; each id once; the failing one left out.
        assert_eq!(ids, vec!["anthropic/claude-1", "gpt-x", "claude-1"]);
        let all_down = Router::new(Arc::new(Listing(None)));
        assert!(all_down.models().await.is_err());
    }
}
