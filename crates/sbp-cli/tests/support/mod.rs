//! Harness for the end-to-end tests: runs the real `sbp` binary as a child process on
//! 127.0.0.1:0, learns its port from the one stdout line, captures its output, and talks to it
//! with real clients (reqwest over HTTP, tokio-tungstenite over WebSocket).

#![allow(dead_code)]

use std::io::{BufRead as _, BufReader, Read as _};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// How long a debug build gets to open its database and print the startup line.
pub const STARTUP: Duration = Duration::from_secs(20);
/// How long any single expected event (response, frame, exit) may take.
pub const WAIT: Duration = Duration::from_secs(10);

/// `sbp serve` with a clean environment: no inherited `SBP_*` variable can change what a test
/// sets up, and output is piped so it can be inspected.
pub fn sbp_serve() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sbp"));
    cmd.arg("serve");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("SBP_") {
            cmd.env_remove(key);
        }
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// `sbp serve --listen 127.0.0.1:0 --data-dir DIR EXTRA...`.
pub fn sbp_serve_in(data_dir: &Path, extra: &[&str]) -> Command {
    let mut cmd = sbp_serve();
    cmd.arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(data_dir)
        .args(extra);
    cmd
}

/// Text a child wrote to one of its pipes, collected by a reader thread.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<String>>);

impl Captured {
    fn push(&self, text: &str) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_str(text);
    }

    fn get(&self) -> String {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A running child process. Dropping it sends SIGKILL and reaps it, so no process outlives a test.
pub struct Proc {
    child: Child,
    stdout: Captured,
    stderr: Captured,
    readers: Vec<JoinHandle<()>>,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl Proc {
    pub fn spawn(mut cmd: Command) -> Self {
        let mut child = cmd.spawn().expect("spawn the sbp binary");
        let out = child.stdout.take().expect("stdout is piped");
        let err = child.stderr.take().expect("stderr is piped");
        let (stdout, stderr) = (Captured::default(), Captured::default());
        let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
        let sink = stdout.clone();
        let out_reader = std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                sink.push(&line);
                sink.push("\n");
                let _ = tx.send(line);
            }
        });
        let sink = stderr.clone();
        let err_reader = std::thread::spawn(move || {
            let mut err = err;
            let mut buf = [0u8; 8192];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.push(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Self {
            child,
            stdout,
            stderr,
            readers: vec![out_reader, err_reader],
            lines,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next stdout line, or `None` if stdout closed (the process exited) first.
    pub async fn next_line(&mut self, within: Duration) -> Option<String> {
        match tokio::time::timeout(within, self.lines.recv()).await {
            Ok(line) => line,
            Err(_) => panic!(
                "no stdout line within {within:?}; stderr so far:\n{}",
                self.stderr()
            ),
        }
    }

    pub fn stdout(&self) -> String {
        self.stdout.get()
    }

    pub fn stderr(&self) -> String {
        self.stderr.get()
    }

    /// `kill -9`, then reaps the process.
    pub fn kill9(&mut self) -> ExitStatus {
        // Already exited is fine: the point is that it is not running afterwards.
        let _ = self.child.kill();
        self.child.wait().expect("reap the killed child")
    }

    /// `kill -TERM <pid>` through the real `kill` command.
    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed: {status}");
    }

    /// Waits for the process to exit on its own, polling until `within` runs out.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "process {} still running after {within:?}; stderr:\n{}",
                self.pid(),
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// After the process has exited: waits for the readers to reach EOF so the captured output is
    /// complete, and returns (stdout, stderr).
    pub fn output(&mut self) -> (String, String) {
        assert!(
            self.child.try_wait().expect("try_wait").is_some(),
            "output() needs an exited process"
        );
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        (self.stdout(), self.stderr())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running gateway: the process and the address it printed.
pub struct Sbp {
    pub proc: Proc,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// `ws://127.0.0.1:PORT`.
    pub ws_url: String,
    /// The startup line as printed.
    pub banner: String,
    pub http: reqwest::Client,
}

impl Sbp {
    /// Runs `sbp serve --listen 127.0.0.1:0 --data-dir DIR EXTRA...` and waits for its banner.
    pub async fn start(data_dir: &Path, extra: &[&str]) -> Self {
        Self::spawn(sbp_serve_in(data_dir, extra)).await
    }

    /// Runs `cmd` (which must make the gateway listen on some port) and waits for its banner.
    pub async fn spawn(cmd: Command) -> Self {
        let mut proc = Proc::spawn(cmd);
        let Some(banner) = proc.next_line(STARTUP).await else {
            let status = proc.wait_exit(WAIT).await;
            let (_, err) = proc.output();
            panic!("sbp exited ({status}) before printing its address; stderr:\n{err}");
        };
        let url = banner
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no http:// URL in the startup line: {banner}"))
            .to_owned();
        let addr: std::net::SocketAddr = url["http://".len()..]
            .parse()
            .unwrap_or_else(|e| panic!("bad address in '{banner}': {e}"));
        assert!(addr.ip().is_loopback(), "{banner}");
        assert_ne!(addr.port(), 0, "the real port is printed: {banner}");
        Self {
            proc,
            ws_url: format!("ws://{addr}"),
            url,
            banner,
            http: client(),
        }
    }

    pub fn post(&self, path: &str, body: &Value) -> reqwest::RequestBuilder {
        self.http.post(format!("{}{path}", self.url)).json(body)
    }

    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.http.get(format!("{}{path}", self.url))
    }

    /// A completion; `token` continues a session. Returns (status, session token header, body).
    pub async fn chat(&self, token: Option<&str>, messages: Value) -> (u16, Option<String>, Value) {
        let mut req = self.post(
            "/v1/chat/completions",
            &json!({"model": "sbp/echo", "messages": messages}),
        );
        if let Some(t) = token {
            req = req.header("x-session-token", t);
        }
        let (status, headers, body) = send(req).await;
        let token = headers
            .get("x-session-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        (status, token, body)
    }

    /// `GET /v1/sessions/{id}`, expecting 200.
    pub async fn session(&self, id: &str, token: &str) -> Value {
        let (status, _, body) = send(
            self.get(&format!("/v1/sessions/{id}"))
                .header("x-session-token", token),
        )
        .await;
        assert_eq!(status, 200, "GET session {id}: {body}");
        body
    }

    /// `GET /v1/sessions/{id}/messages` as (role, content) pairs, checking seqs increase.
    pub async fn messages(&self, id: &str, token: &str) -> Vec<(String, String)> {
        let (status, _, body) = send(
            self.get(&format!("/v1/sessions/{id}/messages?limit=1000"))
                .header("x-session-token", token),
        )
        .await;
        assert_eq!(status, 200, "GET messages of {id}: {body}");
        let items = body["messages"].as_array().expect("messages array");
        let seqs: Vec<u64> = items
            .iter()
            .map(|m| m["seq"].as_u64().expect("seq"))
            .collect();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "message seqs must increase: {seqs:?}"
        );
        items.iter().map(role_content).collect()
    }

    /// `POST /v1/sbp/sessions/{id}/turns`, expecting 201; returns the body.
    pub async fn push(&self, id: &str, token: &str, content: &str) -> Value {
        let (status, _, body) = send(
            self.post(
                &format!("/v1/sbp/sessions/{id}/turns"),
                &json!({"content": content}),
            )
            .header("x-session-token", token),
        )
        .await;
        assert_eq!(status, 201, "push turn: {body}");
        body
    }

    /// Opens the session's WebSocket and sends ATTACH_SESSION; returns the socket and the
    /// SESSION_ATTACHED frame.
    pub async fn attach(&self, id: &str, token: &str) -> (Ws, Value) {
        let url = format!("{}/v1/sbp/ws/{id}", self.ws_url);
        let (stream, _) = tokio::time::timeout(WAIT, tokio_tungstenite::connect_async(url))
            .await
            .expect("ws connect within the wait")
            .expect("ws connect");
        let mut ws = Ws { stream };
        ws.send(json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token}))
            .await;
        let attached = ws.recv().await;
        assert_eq!(attached["type"], "SESSION_ATTACHED", "{attached}");
        (ws, attached)
    }

    /// `GET /metrics` text, expecting 200.
    pub async fn metrics(&self) -> String {
        let resp = tokio::time::timeout(WAIT, self.get("/metrics").send())
            .await
            .expect("metrics within the wait")
            .expect("metrics request");
        assert_eq!(resp.status(), 200);
        resp.text().await.expect("metrics body")
    }
}

/// An HTTP client that never goes through a proxy (the gateway is on loopback).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("http client")
}

/// Sends a request with the standard wait; returns (status, headers, body as JSON or a string).
pub async fn send(req: reqwest::RequestBuilder) -> (u16, reqwest::header::HeaderMap, Value) {
    let resp = tokio::time::timeout(WAIT, req.send())
        .await
        .expect("response within the wait")
        .expect("request sent");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("response body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, headers, body)
}

/// A chat message as (role, text content); a message without text (only tool calls) gives "".
pub fn role_content(m: &Value) -> (String, String) {
    let content = match &m["content"] {
        Value::Null => "",
        c => c.as_str().expect("text content"),
    };
    (
        m["role"].as_str().expect("role").to_owned(),
        content.to_owned(),
    )
}

/// The assistant text of a completion body.
pub fn reply_text(body: &Value) -> String {
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no reply text in {body}"))
        .to_owned()
}

pub fn msg(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

pub struct Ws {
    pub stream: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

impl Ws {
    pub async fn send(&mut self, v: Value) {
        self.stream
            .send(Message::Text(v.to_string().into()))
            .await
            .expect("ws send");
    }

    /// The next JSON frame, answering PINGs on the way.
    pub async fn recv(&mut self) -> Value {
        loop {
            let msg = tokio::time::timeout(WAIT, self.stream.next())
                .await
                .expect("ws frame within the wait");
            match msg {
                Some(Ok(Message::Text(t))) => {
                    let v: Value = serde_json::from_str(t.as_str()).expect("server sends JSON");
                    if v["type"] == "PING" {
                        self.send(json!({"type": "PONG"})).await;
                        continue;
                    }
                    return v;
                }
                Some(Ok(Message::Close(f))) => {
                    panic!("socket closed ({f:?}) while a frame was expected")
                }
                Some(Ok(_)) => continue,
                Some(Err(e)) => panic!("ws error while a frame was expected: {e}"),
                None => panic!("socket ended while a frame was expected"),
            }
        }
    }

    pub async fn close(mut self) {
        let _ = self.stream.close(None).await;
    }
}
