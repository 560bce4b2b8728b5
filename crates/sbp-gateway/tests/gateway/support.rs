//! Test harness: the shared in-process gateway ([`TestGateway`]: the real gateway on 127.0.0.1:0
//! over a real SQLite file, optionally the real fake upstream) and the SBP API calls these tests
//! make on it with real clients (reqwest; tokio-tungstenite through [`Ws`]).

#![allow(dead_code)]

use reqwest::header::HeaderMap;
use reqwest::{Method, RequestBuilder};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

pub use sbp_test_support::{
    Options, TestGateway, Upstream, WAIT, Ws, WsEvent, db_path, response, sse_data,
};
use sbp_test_support::{send, wait_until};

/// What these tests do on a [`TestGateway`]: the SBP API over HTTP. Every call is built on
/// [`TestGatewayExt::request`].
pub trait TestGatewayExt {
    /// A request to `path` of this gateway with `headers`.
    fn request(&self, method: Method, path: &str, headers: &[(&str, &str)]) -> RequestBuilder;

    /// A POST; returns status, headers, body.
    async fn post(
        &self,
        path: &str,
        body: Value,
        headers: &[(&str, &str)],
    ) -> (u16, HeaderMap, Value) {
        send(self.request(Method::POST, path, headers).json(&body)).await
    }

    /// The `/metrics` page, as Prometheus text.
    async fn metrics_text(&self) -> String {
        self.request(Method::GET, "/metrics", &[])
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text")
    }

    /// One series' value on `/metrics` (`series`: the name with its labels, if any).
    async fn metric(&self, series: &str) -> Option<u64> {
        self.metrics_text().await.lines().find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
    }

    async fn get(&self, path: &str, headers: &[(&str, &str)]) -> (u16, Value) {
        let (s, _, v) = send(self.request(Method::GET, path, headers)).await;
        (s, v)
    }

    async fn delete(&self, path: &str, headers: &[(&str, &str)]) -> (u16, Value) {
        let (s, _, v) = send(self.request(Method::DELETE, path, headers)).await;
        (s, v)
    }

    async fn patch(&self, path: &str, body: Value, headers: &[(&str, &str)]) -> (u16, Value) {
        let (s, _, v) = send(self.request(Method::PATCH, path, headers).json(&body)).await;
        (s, v)
    }

    async fn put(&self, path: &str, body: Value, headers: &[(&str, &str)]) -> (u16, Value) {
        let (s, _, v) = send(self.request(Method::PUT, path, headers).json(&body)).await;
        (s, v)
    }

    /// Starts a POST in its own task, for requests that only finish once a surface has answered.
    fn spawn_post(
        &self,
        path: &str,
        body: Value,
        headers: &[(&str, &str)],
    ) -> JoinHandle<(u16, HeaderMap, Value)> {
        tokio::spawn(send(self.request(Method::POST, path, headers).json(&body)))
    }

    /// Replaces a session's memory document; asserts success.
    async fn put_memory(&self, id: &str, token: &str, body: Value) -> Value {
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
    async fn chat(&self, body: Value, headers: &[(&str, &str)]) -> (u16, HeaderMap, Value) {
        self.post("/v1/chat/completions", body, headers).await
    }

    /// Creates a session through a first completion; returns (session_id, token).
    async fn session(&self) -> (String, String) {
        self.session_saying("Hello").await
    }

    /// [`TestGatewayExt::session`] whose first user message is `content`.
    async fn session_saying(&self, content: &str) -> (String, String) {
        let (status, headers, body) = self
            .chat(
                json!({"model": "gpt-4o", "messages": [{"role": "user", "content": content}]}),
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

    /// Creates an idle session with no turns (`POST /v1/sessions`); returns (session_id, token).
    async fn idle_session(&self) -> (String, String) {
        let (s, _, v) = self.post("/v1/sessions", json!({}), &[]).await;
        assert_eq!(s, 201, "{v}");
        (
            v["session_id"].as_str().expect("session id").to_owned(),
            v["session_token"].as_str().expect("token").to_owned(),
        )
    }

    async fn session_view(&self, id: &str, token: &str) -> Value {
        let (s, v) = self
            .get(&format!("/v1/sessions/{id}"), &[("x-session-token", token)])
            .await;
        assert_eq!(s, 200, "{v}");
        v
    }

    /// The stored transcript (up to 1,000 messages), expecting 200.
    async fn messages(&self, id: &str, token: &str) -> Vec<Value> {
        let (s, v) = self
            .get(
                &format!("/v1/sbp/sessions/{id}/messages?limit=1000"),
                &[("x-session-token", token)],
            )
            .await;
        assert_eq!(s, 200, "{v}");
        v["messages"].as_array().expect("messages").clone()
    }

    async fn push(&self, id: &str, token: &str, content: &str) -> Value {
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

    /// Polls GET /v1/sessions/{id} until `done` holds (e.g. the server has processed a close);
    /// returns that view. Fails after `WAIT`, naming `what`.
    async fn wait_view(
        &self,
        id: &str,
        token: &str,
        what: &str,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        wait_until(WAIT, what, || self.session_view(id, token), done).await
    }

    /// Waits until the session is suspended with no surface attached (a close has been fully
    /// processed).
    async fn wait_suspended(&self, id: &str, token: &str) -> Value {
        self.wait_view(id, token, "suspended and detached", |v| {
            v["status"] == "suspended" && v["surface_attached"] == false
        })
        .await
    }
}

impl TestGatewayExt for TestGateway {
    fn request(&self, method: Method, path: &str, headers: &[(&str, &str)]) -> RequestBuilder {
        let mut req = self.http.request(method, format!("{}{path}", self.url));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req
    }
}
