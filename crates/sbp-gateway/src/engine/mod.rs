//! The engine: everything the gateway does, independent of HTTP and WebSocket types, as one
//! service per concept. [`Gateway`] is only the composition root: it builds the services, hands
//! each what it needs, and gives the transport their handles.
//!
//! ```text
//! turns ─► surfaces ─► federation ─► roaming ─► tools ─► sessions ─► replicas ─► connections, calls, tasks
//! retention (a background sweep of the store)
//! ```
//! (each service uses only those to its right). Services are handles around one `Arc`.
//!
//! Ids the engine makes are UUIDv7 (time-ordered): stored keys then grow at the end of their
//! B-trees instead of dirtying a random page per insert, which is most of the cost of a durable
//! write. They carry no secret; session tokens do.

mod calls;
pub(crate) mod connections;
pub mod federation;
mod history;
pub(crate) mod replicas;
mod retention;
pub mod roaming;
pub mod sessions;
pub mod surfaces;
mod tasks;
pub mod tools;
pub mod turns;

use std::sync::Arc;

use sbp_llm::Provider;
use sbp_store::Store;

use crate::config::GatewayConfig;
use crate::error::Error;
use crate::metrics::{LiveGauges, Metrics, Observed};
use calls::PendingCalls;
use connections::Connections;
use federation::Federation;
use history::HistoryCache;
use replicas::{BusLink, Replicas};
use roaming::Roaming;
use sessions::Sessions;
use surfaces::Surfaces;
use tasks::Tasks;
use tools::{NoServerTools, ServerTools, Tools};
use turns::Turns;

/// The cheap-to-clone handle to one running gateway.
#[derive(Clone)]
pub struct Gateway {
    inner: Arc<Inner>,
}

struct Inner {
    config: Arc<GatewayConfig>,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    tasks: Tasks,
    connections: Arc<Connections>,
    history: Arc<HistoryCache>,
    replicas: Replicas,
    sessions: Sessions,
    tools: Tools,
    surfaces: Surfaces,
    turns: Turns,
    roaming: Roaming,
    federation: Federation,
}

impl Gateway {
    /// Builds the engine and recovers from an unclean stop: turns still marked running were
    /// interrupted and are marked failed (their sessions keep their last snapshot).
    pub async fn start(
        config: GatewayConfig,
        store: Arc<dyn Store>,
        provider: Arc<dyn Provider>,
    ) -> Result<Self, Error> {
        Self::start_with_tools(config, store, provider, Arc::new(NoServerTools)).await
    }

    /// [`Gateway::start`] with the tools of southbound MCP servers offered to the LLM.
    pub async fn start_with_tools(
        config: GatewayConfig,
        store: Arc<dyn Store>,
        provider: Arc<dyn Provider>,
        server_tools: Arc<dyn ServerTools>,
    ) -> Result<Self, Error> {
        Self::start_replica(config, store, provider, server_tools, None).await
    }

    /// [`Gateway::start_with_tools`] as one of several replicas sharing the store, connected by
    /// `bus`. Alone (no bus) every turn still running in the store was interrupted by this
    /// process's own restart and is failed now; among replicas only the turns of replicas that
    /// stopped heartbeating are, now and periodically.
    pub async fn start_replica(
        config: GatewayConfig,
        store: Arc<dyn Store>,
        provider: Arc<dyn Provider>,
        server_tools: Arc<dyn ServerTools>,
        bus: Option<BusLink>,
    ) -> Result<Self, Error> {
        if config.verifying_secrets().any(|s| s.len() < 32) {
            return Err(Error::internal(
                "starting the gateway",
                "the signing secret must be at least 32 bytes",
            ));
        }
        let mut config = config;
        if config.federation.is_some() && config.sbp_level == sbp_protocol::SBP_LEVEL {
            config.sbp_level = "L6".to_owned();
        }
        Replicas::recover_turns(store.as_ref(), &config, bus.is_some()).await?;
        let (bus, inbox) = match bus {
            Some(link) => (Some(link.bus), Some(link.inbox)),
            None => (None, None),
        };
        let config = Arc::new(config);
        let metrics = Arc::new(Metrics::default());
        // Every upstream call (turns, passthrough, CTP) is counted and timed where it is made.
        let provider: Arc<dyn Provider> = Arc::new(Observed::new(provider, metrics.clone()));
        let tasks = Tasks::default();
        let connections = Arc::new(Connections::new(config.ws_outbound_budget));
        let calls = Arc::new(PendingCalls::default());
        let replicas = Replicas::new(
            bus,
            connections.clone(),
            calls.clone(),
            store.clone(),
            config.clone(),
        );
        let history = Arc::new(HistoryCache::new(config.history_cache_bytes));
        let sessions = Sessions::new(
            store.clone(),
            config.clone(),
            replicas.clone(),
            metrics.clone(),
            history.clone(),
        );
        let tools = Tools::new(
            config.clone(),
            server_tools,
            calls,
            replicas.clone(),
            sessions.clone(),
            metrics.clone(),
        );
        let roaming = Roaming::new(
            store.clone(),
            config.clone(),
            sessions.clone(),
            metrics.clone(),
            tasks.clone(),
        );
        let federation = Federation::start(
            config.clone(),
            store.clone(),
            metrics.clone(),
            roaming.clone(),
            &tasks,
        )
        .await?;
        let surfaces = Surfaces::new(
            store.clone(),
            config.clone(),
            federation.clone(),
            connections.clone(),
            replicas.clone(),
            sessions.clone(),
            tools.clone(),
            provider.clone(),
            tasks.clone(),
            metrics.clone(),
        );
        let turns = Turns::new(
            store.clone(),
            provider,
            config.clone(),
            federation.clone(),
            replicas.clone(),
            sessions.clone(),
            tools.clone(),
            metrics.clone(),
            tasks.clone(),
            history.clone(),
        );
        if let Some(inbox) = inbox {
            replicas.start(inbox);
        }
        retention::start(store.clone(), config.clone(), metrics.clone(), &tasks);
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                store,
                metrics,
                tasks,
                connections,
                history,
                replicas,
                sessions,
                tools,
                surfaces,
                turns,
                roaming,
                federation,
            }),
        })
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.inner.config
    }

    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    pub fn sessions(&self) -> &Sessions {
        &self.inner.sessions
    }

    pub fn turns(&self) -> &Turns {
        &self.inner.turns
    }

    pub fn surfaces(&self) -> &Surfaces {
        &self.inner.surfaces
    }

    pub fn tools(&self) -> &Tools {
        &self.inner.tools
    }

    pub fn roaming(&self) -> &Roaming {
        &self.inner.roaming
    }

    pub fn federation(&self) -> &Federation {
        &self.inner.federation
    }

    /// Cancelled when the gateway stops; long-lived tasks (sockets, streams) watch it.
    pub fn shutdown_token(&self) -> tokio_util::sync::CancellationToken {
        self.inner.tasks.stopping()
    }

    /// Tracks a future that is already running on its own task (e.g. an upgraded WebSocket).
    pub fn track<F: std::future::Future>(
        &self,
        fut: F,
    ) -> tokio_util::task::task_tracker::TrackedFuture<F> {
        self.inner.tasks.track(fut)
    }

    /// Stops accepting work, signals connections to close and waits for tracked tasks, for at
    /// most the configured `shutdown_grace`; then stops the replica's own tasks.
    pub async fn shutdown(&self) {
        let deadline = tokio::time::Instant::now() + self.inner.config.shutdown_grace;
        self.shutdown_by(deadline).await;
    }

    /// [`Gateway::shutdown`] with the grace ending at `deadline`: turns still running then are
    /// failed (their idempotency keys left retryable), and tasks that still do not end are left
    /// behind (logged) so the process can exit.
    pub async fn shutdown_by(&self, deadline: tokio::time::Instant) {
        let left = self.inner.tasks.stop_by(deadline).await;
        if left > 0 {
            tracing::warn!(
                tasks = left,
                "shutdown grace over: stopping without waiting for these tasks"
            );
        }
        self.inner.replicas.stop().await;
    }

    /// Fails every turn still running, now (the shutdown grace is over): each records its failure
    /// and releases its idempotency key, and its caller gets `Error::Unavailable`.
    pub fn abort_turns(&self) {
        self.inner.tasks.abort();
    }

    /// The Prometheus text for `/metrics`.
    pub async fn render_metrics(&self) -> Result<String, Error> {
        let store = &self.inner.store;
        let counts = store.count_sessions_by_status().await?;
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
            tether_depth: store.tether_depth_total().await?,
            attached_surfaces: self.inner.connections.count() as u64,
            history_cache: self.inner.history.usage(),
        };
        Ok(self.metrics().render(&live))
    }
}
