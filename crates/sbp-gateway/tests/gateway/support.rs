//! Test harness: a real gateway on 127.0.0.1:0 over a real SQLite file, a real fake upstream, and
//! real HTTP (reqwest) and WebSocket (tokio-tungstenite) clients.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use sbp_fake_llm::FakeLlm;
use sbp_gateway::ServerTools;
use sbp_gateway::{Gateway, GatewayConfig};
use sbp_llm::{EchoProvider, OpenAiOptions, OpenAiProvider, Provider};
use sbp_store::sqlite::{SqliteOptions, SqliteStore};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

pub const WAIT: Duration = Duration::from_secs(10);

pub enum Upstream {
    Echo,
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
    pub dir: Option<Arc<tempfile::TempDir>>,
    pub upstream_timeout: Duration,
    /// Southbound MCP servers' tools offered to the LLM (`Gateway::start_with_tools`); none if unset.
    pub server_tools: Option<Arc<dyn ServerTools>>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            upstream: Upstream::Echo,
            config: GatewayConfig {
                secret: vec![7u8; 32],
                ..GatewayConfig::default()
            },
            dir: None,
            upstream_timeout: Duration::from_secs(10),
            server_tools: None,
        }
    }
}

pub struct TestGateway {
    pub url: String,
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
            http: reqwest::Client::new(),
            stop: Some(stop),
            handle: Some(handle),
        }
    }

    /// Stops the server gracefully and waits for it.
    pub async fn stop(mut self) -> Arc<tempfile::TempDir> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.handle.take() {
            let _ = tokio::time::timeout(WAIT, h).await;
        }
        self.dir.clone()
    }

    pub fn fake(&self) -> &FakeLlm {
        self.fake.as_ref().expect("started with the fake upstream")
    }

    pub async fn post(
        &self,
        path: &str,
        body: Value,
        headers: &[(&str, &str)],
    ) -> (u16, reqwest::header::HeaderMap, Value) {
        let mut req = self.http.post(format!("{}{path}", self.url)).json(&body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        response(req.send().await.expect("request sent")).await
    }

    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> (u16, Value) {
        let mut req = self.http.get(format!("{}{path}", self.url));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let (s, _, v) = response(req.send().await.expect("request sent")).await;
        (s, v)
    }

    pub async fn patch(&self, path: &str, body: Value, headers: &[(&str, &str)]) -> (u16, Value) {
        let mut req = self.http.patch(format!("{}{path}", self.url)).json(&body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let (s, _, v) = response(req.send().await.expect("request sent")).await;
        (s, v)
    }

    pub async fn put(&self, path: &str, body: Value, headers: &[(&str, &str)]) -> (u16, Value) {
        let mut req = self.http.put(format!("{}{path}", self.url)).json(&body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let (s, _, v) = response(req.send().await.expect("request sent")).await;
        (s, v)
    }

    /// Replaces a session's memory document; asserts success.
    pub async fn put_memory(&self, id: &str, token: &str, body: Value) -> Value {
        let (s, v) = self
            .put(
                &format!("/v1/sbp/sessions/{id}/memory"),
                body,
                &[("x-session-token", token)],
            )
            .await;
        assert_eq!(s, 200, "{v}");
        v
    }

    /// A completion; returns status, headers, body.
    pub async fn chat(
        &self,
        body: Value,
        headers: &[(&str, &str)],
    ) -> (u16, reqwest::header::HeaderMap, Value) {
        self.post("/v1/chat/completions", body, headers).await
    }

    /// Creates a session through a first completion; returns (session_id, token).
    pub async fn session(&self) -> (String, String) {
        let (status, headers, body) = self
            .chat(
                json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "Hello"}]}),
                &[],
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let token = headers["x-session-token"]
            .to_str()
            .expect("token")
            .to_owned();
        (
            body["sbp"]["session_id"]
                .as_str()
                .expect("session id")
                .to_owned(),
            token,
        )
    }

    pub async fn session_view(&self, id: &str, token: &str) -> Value {
        let (s, v) = self
            .get(&format!("/v1/sessions/{id}"), &[("x-session-token", token)])
            .await;
        assert_eq!(s, 200, "{v}");
        v
    }

    /// The stored transcript (up to 1,000 messages), expecting 200.
    pub async fn messages(&self, id: &str, token: &str) -> Vec<Value> {
        let (s, v) = self
            .get(
                &format!("/v1/sbp/sessions/{id}/messages?limit=1000"),
                &[("x-session-token", token)],
            )
            .await;
        assert_eq!(s, 200, "{v}");
        v["messages"].as_array().expect("messages").clone()
    }

    pub async fn push(&self, id: &str, token: &str, content: &str) -> Value {
        let (s, _, v) = self
            .post(
                &format!("/v1/sbp/sessions/{id}/turns"),
                json!({"content": content}),
                &[("x-session-token", token)],
            )
            .await;
        assert_eq!(s, 201, "{v}");
        v
    }

    pub async fn ws(&self, id: &str) -> Ws {
        let (stream, _) =
            tokio_tungstenite::connect_async(format!("{}/v1/sbp/ws/{id}", self.ws_base))
                .await
                .expect("ws connect");
        Ws { stream }
    }

    /// Connects and attaches; returns the socket and the SESSION_ATTACHED frame.
    pub async fn attach(&self, id: &str, token: &str, extra: Value) -> (Ws, Value) {
        let mut ws = self.ws(id).await;
        let mut frame = json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token});
        if let (Some(f), Some(e)) = (frame.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                f.insert(k.clone(), v.clone());
            }
        }
        ws.send(frame).await;
        let attached = ws.recv().await;
        assert_eq!(attached["type"], "SESSION_ATTACHED", "{attached}");
        (ws, attached)
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

pub fn db_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("sbp.db")
}

pub async fn response(resp: reqwest::Response) -> (u16, reqwest::header::HeaderMap, Value) {
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, headers, body)
}

pub struct Ws {
    pub stream: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

/// What the next WebSocket event was.
#[derive(Debug)]
pub enum Event {
    Frame(Value),
    Closed(Option<u16>),
}

impl Ws {
    pub async fn send(&mut self, v: Value) {
        self.stream
            .send(Message::Text(v.to_string().into()))
            .await
            .expect("ws send");
    }

    pub async fn send_text(&mut self, t: &str) {
        self.stream
            .send(Message::Text(t.to_owned().into()))
            .await
            .expect("ws send");
    }

    pub async fn next_event(&mut self) -> Event {
        loop {
            let msg = tokio::time::timeout(WAIT, self.stream.next())
                .await
                .expect("ws event within the wait");
            match msg {
                None => return Event::Closed(None),
                Some(Err(_)) => return Event::Closed(None),
                Some(Ok(Message::Text(t))) => {
                    return Event::Frame(
                        serde_json::from_str(t.as_str()).expect("server sends JSON"),
                    );
                }
                Some(Ok(Message::Close(frame))) => {
                    return Event::Closed(frame.map(|f| u16::from(f.code)));
                }
                Some(Ok(_)) => continue,
            }
        }
    }

    /// The next frame, skipping PINGs (answered with PONG).
    pub async fn recv(&mut self) -> Value {
        loop {
            match self.next_event().await {
                Event::Frame(v) if v["type"] == "PING" => self.send(json!({"type": "PONG"})).await,
                Event::Frame(v) => return v,
                Event::Closed(code) => {
                    panic!("socket closed ({code:?}) while a frame was expected")
                }
            }
        }
    }

    /// Asserts the next frame has this type, then that the socket closes with `code`.
    pub async fn expect_error_close(&mut self, frame_type: &str, code: u16) -> Value {
        let frame = match self.next_event().await {
            Event::Frame(v) => v,
            Event::Closed(c) => panic!("closed ({c:?}) before the {frame_type} frame"),
        };
        assert_eq!(frame["type"], frame_type, "{frame}");
        self.expect_close(code).await;
        frame
    }

    pub async fn expect_close(&mut self, code: u16) {
        loop {
            match self.next_event().await {
                Event::Closed(c) => {
                    assert_eq!(c, Some(code));
                    return;
                }
                Event::Frame(v) if v["type"] == "PING" => continue,
                Event::Frame(v) => panic!("expected close {code}, got frame {v}"),
            }
        }
    }

    /// Reads the frames of one live turn: TURN_CHUNKs then TURN_COMPLETE; returns (text, complete frame).
    pub async fn live_turn(&mut self) -> (String, Value) {
        let mut text = String::new();
        loop {
            let f = self.recv().await;
            match f["type"].as_str() {
                Some("TURN_CHUNK") => text.push_str(f["delta"].as_str().expect("delta")),
                Some("TURN_COMPLETE") => return (text, f),
                _ => panic!("unexpected frame in a live turn: {f}"),
            }
        }
    }

    pub async fn close_abruptly(self) {
        drop(self.stream);
    }

    pub async fn close_code(&mut self, code: u16) {
        let _ = self
            .stream
            .send(Message::Close(Some(
                tokio_tungstenite::tungstenite::protocol::CloseFrame {
                    code: CloseCode::from(code),
                    reason: "".into(),
                },
            )))
            .await;
    }
}

impl TestGateway {
    /// Polls GET /v1/sessions/{id} until `done` holds (e.g. the server has processed a close);
    /// returns that view. Fails after `WAIT`, naming `what`.
    pub async fn wait_view(
        &self,
        id: &str,
        token: &str,
        what: &str,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let v = self.session_view(id, token).await;
            if done(&v) {
                return v;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}: {v}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until the session is suspended with no surface attached (a close has been fully processed).
    pub async fn wait_suspended(&self, id: &str, token: &str) -> Value {
        self.wait_view(id, token, "suspended and detached", |v| {
            v["status"] == "suspended" && v["surface_attached"] == false
        })
        .await
    }
}

impl TestGateway {
    /// Starts a POST in its own task, for requests that only finish once a surface has answered.
    pub fn spawn_post(
        &self,
        path: &str,
        body: Value,
        headers: &[(&str, &str)],
    ) -> tokio::task::JoinHandle<(u16, reqwest::header::HeaderMap, Value)> {
        let mut req = self.http.post(format!("{}{path}", self.url)).json(&body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        tokio::spawn(async move { response(req.send().await.expect("request sent")).await })
    }

    /// Creates an idle session with no turns (`POST /v1/sessions`); returns (session_id, token).
    pub async fn idle_session(&self) -> (String, String) {
        let (s, _, v) = self.post("/v1/sessions", json!({}), &[]).await;
        assert_eq!(s, 201, "{v}");
        (
            v["session_id"].as_str().expect("session id").to_owned(),
            v["session_token"].as_str().expect("token").to_owned(),
        )
    }
}

/// The `data:` payloads of an SSE body, `[DONE]` as the JSON string "[DONE]".
pub fn sse_data(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| {
            if d == "[DONE]" {
                json!("[DONE]")
            } else {
                serde_json::from_str(d).expect("SSE data is JSON")
            }
        })
        .collect()
}
