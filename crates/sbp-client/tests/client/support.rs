//! Test harness: the real gateway in-process on 127.0.0.1:0 over a SQLite file in a temp dir (the
//! same `Gateway::start` + `serve` the binary runs), optionally the real fake upstream, and helpers
//! that read a surface's events with a deadline.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use sbp_client::{Client, Event, SessionClient, Surface};
use sbp_fake_llm::FakeLlm;
use sbp_gateway::{Gateway, GatewayConfig};
use sbp_llm::{EchoProvider, OpenAiOptions, OpenAiProvider, Provider};
use sbp_protocol::ServerFrame;
use sbp_protocol::frames::{TetherTurn, TurnComplete};
use sbp_store::sqlite::{SqliteOptions, SqliteStore};

/// Upper bound on any single wait; a test that needs it has failed.
pub const WAIT: Duration = Duration::from_secs(10);

pub struct Options {
    /// Use the scripted fake upstream instead of the built-in echo model.
    pub fake: bool,
    pub config: GatewayConfig,
    /// Reuse this directory (and its SQLite file): a restart.
    pub dir: Option<Arc<tempfile::TempDir>>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            fake: false,
            config: config(),
            dir: None,
        }
    }
}

/// The gateway configuration the tests start from.
pub fn config() -> GatewayConfig {
    GatewayConfig {
        secret: vec![7u8; 32],
        ..GatewayConfig::default()
    }
}

pub struct TestGateway {
    /// `http://127.0.0.1:PORT`
    pub url: String,
    pub dir: Arc<tempfile::TempDir>,
    pub fake: Option<FakeLlm>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl TestGateway {
    pub async fn start() -> Self {
        Self::with(Options::default()).await
    }

    pub async fn with_fake() -> Self {
        Self::with(Options {
            fake: true,
            ..Options::default()
        })
        .await
    }

    pub async fn with(opts: Options) -> Self {
        let dir = opts
            .dir
            .unwrap_or_else(|| Arc::new(tempfile::tempdir().expect("tempdir")));
        let store = SqliteStore::open(SqliteOptions::new(dir.path().join("sbp.db")))
            .await
            .expect("open store");
        let mut fake = None;
        let provider: Arc<dyn Provider> = if opts.fake {
            let f = FakeLlm::start().await.expect("fake upstream");
            let p = OpenAiProvider::new(OpenAiOptions {
                base_url: f.base_url(),
                api_key: Some("upstream-key".into()),
                connect_timeout: Duration::from_secs(2),
                request_timeout: WAIT,
                stream_idle_timeout: WAIT,
            })
            .expect("provider");
            fake = Some(f);
            Arc::new(p)
        } else {
            Arc::new(EchoProvider)
        };
        let gateway = Gateway::start(opts.config, Arc::new(store), provider)
            .await
            .expect("gateway starts");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(sbp_gateway::serve(listener, gateway, async move {
            let _ = stopped.await;
        }));
        Self {
            url: format!("http://{addr}"),
            dir,
            fake,
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

    /// An SDK client for this gateway (no proxy: it is on loopback).
    pub fn client(&self) -> Client {
        Client::builder(&self.url)
            .no_proxy()
            .timeout(WAIT)
            .build()
            .expect("client")
    }

    /// A counter or gauge of `GET /metrics` (0 when absent).
    pub async fn metric(&self, name: &str) -> u64 {
        let text = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("http")
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Polls a metric until it reaches `at_least`.
    pub async fn wait_metric(&self, name: &str, at_least: u64) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.metric(name).await < at_least {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {name} >= {at_least}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A new idle session.
    pub async fn session(&self) -> SessionClient {
        self.client()
            .create_session(Default::default())
            .await
            .expect("session created")
    }
}

/// The next event, skipping PINGs (the SDK has answered them).
pub async fn next(s: &mut Surface) -> Event {
    loop {
        let ev = tokio::time::timeout(WAIT, s.next_event())
            .await
            .expect("an event within the wait")
            .expect("the surface is still running");
        if !matches!(ev, Event::Frame(ServerFrame::Ping)) {
            return ev;
        }
    }
}

/// The next frame event; panics on a state event.
pub async fn frame(s: &mut Surface) -> ServerFrame {
    match next(s).await {
        Event::Frame(f) => f,
        other => panic!("expected a frame, got {other:?}"),
    }
}

pub async fn tether_turn(s: &mut Surface) -> TetherTurn {
    match frame(s).await {
        ServerFrame::TetherTurn(t) => t,
        other => panic!("expected TETHER_TURN, got {other:?}"),
    }
}

/// One live turn: its TURN_CHUNKs' text and the TURN_COMPLETE.
pub async fn live_turn(s: &mut Surface) -> (String, TurnComplete) {
    let mut text = String::new();
    loop {
        match frame(s).await {
            ServerFrame::TurnChunk(c) => text.push_str(&c.delta),
            ServerFrame::TurnComplete(c) => return (text, c),
            other => panic!("unexpected frame in a live turn: {other:?}"),
        }
    }
}

/// Asserts the surface has ended: no further event.
pub async fn ended(s: &mut Surface) {
    let ev = tokio::time::timeout(WAIT, s.next_event())
        .await
        .expect("the surface ends within the wait");
    assert!(ev.is_none(), "expected the end, got {ev:?}");
}

/// Polls the session until `done` holds (e.g. the gateway has processed a close or an ACK).
pub async fn wait_session(
    session: &SessionClient,
    what: &str,
    done: impl Fn(&sbp_client::types::SessionInfo) -> bool,
) -> sbp_client::types::SessionInfo {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let info = session.get().await.expect("session view");
        if done(&info) {
            return info;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
