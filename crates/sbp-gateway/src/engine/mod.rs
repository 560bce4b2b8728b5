//! The engine: everything the gateway does, independent of HTTP and WebSocket types. Transport
//! handlers extract their inputs, call one engine function and map its result.
//!
//! Ids the engine makes are UUIDv7 (time-ordered): stored keys then grow at the end of their
//! B-trees instead of dirtying a random page per insert, which is most of the cost of a durable
//! write. They carry no secret; session tokens do.

mod chat;
pub mod hub;
mod render;
mod roaming;
mod sessions;
mod surface;
mod tools;

pub use chat::{ChatInput, ChatOutcome, ChatReply, SseEvent};
pub use render::{CtpFrames, Rendering};
pub use roaming::{
    ExportRequest, Exported, Forked, HandedOff, HandoffRequest, ImportRequest, Imported,
    KNOWN_MEMORY_SCHEMAS, MEMORY_SCHEMA_KV, TokenInfo, optional_label, unix_iso,
};
pub use sessions::{Caller, PushTurn, SessionView};
pub use surface::{AttachError, Attached, Delivery, TurnFrames};
pub use tools::{
    BackendToolCall, Catalog, MAX_BACKEND_TIMEOUT_MS, NoServerTools, SURFACE_PREFIX, ServerTools,
    SurfaceCallOutcome, TIMEOUT, ToolCallError, ToolTarget, tool_message_content,
};

use std::sync::Arc;

use chrono::{SecondsFormat, Utc};
use sbp_llm::Provider;
use sbp_store::{Store, Timestamp};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::config::GatewayConfig;
use crate::error::ApiError;
use crate::metrics::{LiveGauges, Metrics};
use hub::Hub;

/// The cheap-to-clone handle to one running gateway.
#[derive(Clone)]
pub struct Gateway {
    inner: Arc<Inner>,
}

struct Inner {
    config: GatewayConfig,
    store: Arc<dyn Store>,
    provider: Arc<dyn Provider>,
    server_tools: Arc<dyn ServerTools>,
    hub: Hub,
    metrics: Metrics,
    tasks: TaskTracker,
    shutdown: CancellationToken,
}

impl Gateway {
    /// Builds the engine and recovers from an unclean stop: turns still marked running were
    /// interrupted and are marked failed (their sessions keep their last snapshot).
    pub async fn start(
        config: GatewayConfig,
        store: Arc<dyn Store>,
        provider: Arc<dyn Provider>,
    ) -> Result<Self, ApiError> {
        Self::start_with_tools(config, store, provider, Arc::new(NoServerTools)).await
    }

    /// [`Gateway::start`] with the tools of southbound MCP servers offered to the LLM.
    pub async fn start_with_tools(
        config: GatewayConfig,
        store: Arc<dyn Store>,
        provider: Arc<dyn Provider>,
        server_tools: Arc<dyn ServerTools>,
    ) -> Result<Self, ApiError> {
        if config.secret.len() < 32 {
            return Err(ApiError::internal(
                "starting the gateway",
                "the signing secret must be at least 32 bytes",
            ));
        }
        let recovered = store.recover_interrupted_turns(Utc::now()).await?;
        for turn in &recovered {
            tracing::warn!(session_id = %turn.session_id, turn_id = %turn.id, "turn interrupted by restart marked failed");
        }
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                store,
                provider,
                server_tools,
                hub: Hub::default(),
                metrics: Metrics::default(),
                tasks: TaskTracker::new(),
                shutdown: CancellationToken::new(),
            }),
        })
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.inner.config
    }

    pub(crate) fn store(&self) -> &dyn Store {
        self.inner.store.as_ref()
    }

    pub(crate) fn server_tools(&self) -> &dyn ServerTools {
        self.inner.server_tools.as_ref()
    }

    pub(crate) fn hub(&self) -> &Hub {
        &self.inner.hub
    }

    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Cancelled when the gateway stops; long-lived tasks (sockets, streams) watch it.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.inner.shutdown.clone()
    }

    /// Runs `fut` as a tracked task: shutdown waits for it.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.inner.tasks.spawn(fut)
    }

    /// Runs `f` as a tracked task on the blocking pool.
    pub fn blocking<F, R>(&self, f: F) -> tokio::task::JoinHandle<R>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        self.inner.tasks.spawn_blocking(f)
    }

    /// Tracks a future that is already running on its own task (e.g. an upgraded WebSocket).
    pub fn track<F: std::future::Future>(
        &self,
        fut: F,
    ) -> tokio_util::task::task_tracker::TrackedFuture<F> {
        self.inner.tasks.track_future(fut)
    }

    /// Stops accepting work, signals connections to close and waits for tracked tasks.
    pub async fn shutdown(&self) {
        self.inner.shutdown.cancel();
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }

    /// The Prometheus text for `/metrics`.
    pub async fn render_metrics(&self) -> Result<String, ApiError> {
        let counts = self.store().count_sessions_by_status().await?;
        let sessions_by_status = sbp_protocol::SessionStatus::ALL
            .iter()
            .map(|st| {
                let n = counts
                    .iter()
                    .find(|(s, _)| s == st)
                    .map(|(_, n)| *n)
                    .unwrap_or(0);
                (st.as_str(), n)
            })
            .collect();
        let live = LiveGauges {
            sessions_by_status,
            tether_depth: self.store().tether_depth_total().await?,
            attached_surfaces: self.hub().attached_count() as u64,
        };
        Ok(self.metrics().render(&live))
    }
}

/// RFC 3339 with milliseconds, UTC: the timestamp form of every response and frame.
pub fn iso(ts: &Timestamp) -> String {
    ts.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Parses a path id, or fails with SPEC 12's `SBP_INVALID_UUID`.
pub fn parse_uuid(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| {
        ApiError::new(
            sbp_protocol::ErrorCode::InvalidUuid,
            format!("'{raw}' is not a valid UUID"),
        )
    })
}
