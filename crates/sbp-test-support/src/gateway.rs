//! The real gateway in-process for tests: `Gateway::start` + `serve` (what `sbp serve` runs) on a
//! listener bound to 127.0.0.1:0, over a SQLite file in a temp dir, with the built-in echo model,
//! the real fake upstream, or any provider; stopped gracefully, its directory kept for a restart.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sbp_fake_llm::FakeLlm;
use sbp_gateway::{Gateway, GatewayConfig, ServerTools};
use sbp_llm::{EchoProvider, OpenAiOptions, OpenAiProvider, Provider};
use sbp_store::sqlite::{SqliteOptions, SqliteStore};
use serde_json::Value;

use crate::{WAIT, Ws, client};

/// What the gateway's provider talks to.
pub enum Upstream {
    /// The built-in `sbp/echo` model: no upstream at all.
    Echo,
    /// The fake upstream, through the OpenAI-compatible provider.
    Fake,
    /// An OpenAI-compatible base URL (e.g. a closed port).
    Url(String),
    /// The fake upstream behind a provider built from its base URL (e.g. a router to its
    /// Anthropic endpoint).
    FakeWith(fn(String) -> Arc<dyn Provider>),
}

pub struct Options {
    pub upstream: Upstream,
    pub config: GatewayConfig,
    /// Reuse this directory (and its SQLite file): a restart.
    pub dir: Option<Arc<tempfile::TempDir>>,
    /// Request and stream-idle timeout of the OpenAI-compatible provider.
    pub upstream_timeout: Duration,
    /// Southbound MCP servers' tools offered to the LLM (`Gateway::start_with_tools`); none if unset.
    pub server_tools: Option<Arc<dyn ServerTools>>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            upstream: Upstream::Echo,
            config: config(),
            dir: None,
            upstream_timeout: WAIT,
            server_tools: None,
        }
    }
}

/// The gateway configuration the tests start from: the defaults with a fixed signing secret.
pub fn config() -> GatewayConfig {
    GatewayConfig {
        secret: vec![7u8; 32],
        ..GatewayConfig::default()
    }
}

/// The SQLite file of a gateway's directory.
pub fn db_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("sbp.db")
}

pub struct TestGateway {
    /// `http://127.0.0.1:PORT`
    pub url: String,
    /// `ws://127.0.0.1:PORT`
    pub ws_base: String,
    pub gateway: Gateway,
    pub dir: Arc<tempfile::TempDir>,
    pub fake: Option<FakeLlm>,
    pub http: reqwest::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl TestGateway {
    pub async fn start() -> Self {
        Self::with(Options::default()).await
    }

    pub async fn with_fake() -> Self {
        Self::with(Options {
            upstream: Upstream::Fake,
            ..Options::default()
        })
        .await
    }

    pub async fn with(opts: Options) -> Self {
        let dir = opts
            .dir
            .unwrap_or_else(|| Arc::new(tempfile::tempdir().expect("tempdir")));
        let store = SqliteStore::open(SqliteOptions::new(db_path(&dir)))
            .await
            .expect("open store");
        let mut fake = None;
        let provider: Arc<dyn Provider> = match opts.upstream {
            Upstream::Echo => Arc::new(EchoProvider),
            Upstream::Fake => {
                let f = FakeLlm::start().await.expect("fake upstream");
                let p = openai(f.base_url(), opts.upstream_timeout);
                fake = Some(f);
                p
            }
            Upstream::Url(u) => openai(u, opts.upstream_timeout),
            Upstream::FakeWith(build) => {
                let f = FakeLlm::start().await.expect("fake upstream");
                let p = build(f.base_url());
                fake = Some(f);
                p
            }
        };
        let gateway = match opts.server_tools {
            None => Gateway::start(opts.config, Arc::new(store), provider).await,
            Some(tools) => {
                Gateway::start_with_tools(opts.config, Arc::new(store), provider, tools).await
            }
        }
        .expect("gateway starts");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(sbp_gateway::serve(listener, gateway.clone(), async move {
            let _ = stopped.await;
        }));
        Self {
            url: format!("http://{addr}"),
            ws_base: format!("ws://{addr}"),
            gateway,
            dir,
            fake,
            http: client(),
            stop: Some(stop),
            handle: Some(handle),
        }
    }

    /// Stops the server gracefully and waits for it; returns its data directory for a restart.
    pub async fn stop(mut self) -> Arc<tempfile::TempDir> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.handle.take() {
            tokio::time::timeout(WAIT, h)
                .await
                .expect("the gateway stops in time")
                .expect("serve task")
                .expect("serve result");
        }
        self.dir.clone()
    }

    pub fn fake(&self) -> &FakeLlm {
        self.fake.as_ref().expect("started with the fake upstream")
    }

    /// Opens session `id`'s WebSocket without sending anything.
    pub async fn ws(&self, id: &str) -> Ws {
        Ws::open(&self.ws_base, id).await
    }

    /// Connects and attaches (`extra`: more ATTACH_SESSION fields); returns the socket and the
    /// SESSION_ATTACHED frame.
    pub async fn attach(&self, id: &str, token: &str, extra: Value) -> (Ws, Value) {
        Ws::attach(&self.ws_base, id, token, extra).await
    }
}

fn openai(base_url: String, timeout: Duration) -> Arc<dyn Provider> {
    Arc::new(
        OpenAiProvider::new(OpenAiOptions {
            base_url,
            api_key: Some("upstream-key".into()),
            connect_timeout: Duration::from_secs(2),
            request_timeout: timeout,
            stream_idle_timeout: timeout,
        })
        .expect("provider"),
    )
}
