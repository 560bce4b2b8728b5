//! L1 over HTTP: sessions, stateful completions in both client styles, streaming, upstream errors,
//! idempotent retries, strict mode and bad input, all in the SPEC 12 error envelope.

use std::time::Duration;

use reqwest::Method;
use sbp_gateway::GatewayConfig;
use serde_json::{Value, json};

use crate::support::{Options, TestGateway, TestGatewayExt, Upstream, db_path, sse_data};

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn is_uuid(v: &Value) -> bool {
    v.as_str().is_some_and(|s| uuid::Uuid::parse_str(s).is_ok())
}

fn error_code(body: &Value) -> &str {
    body["error"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("not an error envelope: {body}"))
}

#[tokio::test]
async fn first_completion_creates_a_session_and_returns_its_token() {
    let gw = TestGateway::start().await;
    let (status, headers, body) = gw
        .chat(json!({"model": "gpt-4o", "messages": [user("Hello")]}), &[])
        .await;
    assert_eq!(status, 200, "{body}");
    let token = headers["x-session-token"].to_str().expect("token header");
    assert!(is_uuid(&body["sbp"]["session_id"]), "{body}");
    assert_eq!(body["sbp"]["session_token"], token);
    assert_eq!(body["sbp"]["step_count"], 1);
    assert_eq!(body["sbp"]["model_routed_to"], "sbp/echo");
    assert!(is_uuid(&body["sbp"]["snapshot_id"]));
    assert_eq!(body["choices"][0]["message"]["content"], "Echo: Hello");
    assert!(body["sbp"].get("force_new_session").is_none());
    assert_eq!(
        headers["x-session-id"].to_str().ok(),
        body["sbp"]["session_id"].as_str()
    );
}

#[tokio::test]
async fn model_is_forwarded_verbatim_and_sbp_is_not() {
    let gw = TestGateway::with_fake().await;
    let body = json!({"model": "claude-opus-4-7", "messages": [user("Hello")], "temperature": 0.5,
                      "sbp": {"force_new_session": false, "checkpoint_every": 1}});
    let (status, _, resp) = gw
        .chat(body, &[("authorization", "Bearer client-openai-key")])
        .await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["sbp"]["model_routed_to"], "claude-opus-4-7");
    let sent = gw.fake().requests();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0]["model"], "claude-opus-4-7");
    assert_eq!(sent[0]["temperature"], 0.5);
    assert!(
        sent[0].get("sbp").is_none(),
        "sbp forwarded upstream: {}",
        sent[0]
    );
    let auth = gw.fake().request_headers()[0]
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    assert_eq!(
        auth.as_deref(),
        Some("Bearer upstream-key"),
        "the client's key must not reach the upstream"
    );
}

#[tokio::test]
async fn upstream_sees_stored_history_and_both_client_styles_store_no_duplicates() {
    let gw = TestGateway::with_fake().await;
    let (id, token) = gw.session().await;
    let auth = [("x-session-token", token.as_str())];
    // New-message-only client.
    let (s, _, b) = gw
        .chat(json!({"model": "m", "messages": [user("second")]}), &auth)
        .await;
    assert_eq!(s, 200, "{b}");
    let sent = gw.fake().requests();
    let msgs: Vec<&str> = sent[1]["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["content"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(msgs, vec!["Hello", "echo: Hello", "second"]);
    // Full-resend client: the whole conversation so far plus one new message.
    let full = json!({"model": "m", "messages": [user("Hello"), {"role": "assistant", "content": "echo: Hello"},
        user("second"), {"role": "assistant", "content": "echo: second"}, user("third")]});
    let (s, _, b) = gw.chat(full, &auth).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["sbp"]["step_count"], 3);
    let (_, page) = gw.get(&format!("/v1/sessions/{id}/messages"), &auth).await;
    let stored: Vec<&str> = page["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["content"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        stored,
        vec![
            "Hello",
            "echo: Hello",
            "second",
            "echo: second",
            "third",
            "echo: third"
        ]
    );
    assert_eq!(
        gw.fake().requests()[2]["messages"].as_array().map(Vec::len),
        Some(5)
    );
}

#[tokio::test]
async fn session_token_in_the_sbp_namespace_and_as_bearer_continue_the_session() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("x")], "sbp": {"session_token": token}}),
            &[],
        )
        .await;
    assert_eq!(s, 200);
    assert_eq!(b["sbp"]["session_id"], id.as_str());
    assert_eq!(b["sbp"]["step_count"], 2);
    let bearer = format!("Bearer {token}");
    let (s, h, b) = gw
        .chat(
            json!({"messages": [user("y")]}),
            &[("authorization", &bearer)],
        )
        .await;
    assert_eq!(s, 200);
    // An OpenAI SDK's `api_key` holding the session token (issue 16): the same session.
    assert_eq!(b["sbp"]["session_id"], id.as_str());
    assert_eq!(b["sbp"]["step_count"], 3);
    assert!(h.get("x-session-token").is_none());
}

#[tokio::test]
async fn unknown_or_foreign_tokens_are_refused_and_callers_cannot_choose_tokens() {
    let gw = TestGateway::start().await;
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("x")]}),
            &[("x-session-token", "sbp_made-up")],
        )
        .await;
    assert_eq!(s, 403);
    assert_eq!(error_code(&b), "SBP_FORBIDDEN");
    let (id_a, _) = gw.session().await;
    let (_, token_b) = gw.session().await;
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("x")], "sbp": {"session_id": id_a}}),
            &[("x-session-token", &token_b)],
        )
        .await;
    assert_eq!(s, 403, "{b}");
}

#[tokio::test]
async fn agent_identity_is_stable_across_calls() {
    let gw = TestGateway::start().await;
    let (s, h, b) = gw
        .chat(
            json!({"messages": [user("x")]}),
            &[("x-agent-id", "agent-alpha")],
        )
        .await;
    assert_eq!(s, 200);
    assert_eq!(b["sbp"]["agent_id"], "agent-alpha");
    let token = h["x-session-token"].to_str().expect("token").to_owned();
    let (_, h2, b2) = gw
        .chat(
            json!({"messages": [user("y")]}),
            &[("x-session-token", &token), ("x-agent-id", "other")],
        )
        .await;
    assert_eq!(b2["sbp"]["agent_id"], "agent-alpha");
    assert_eq!(h2["x-agent-id"], "agent-alpha");
    let id = b["sbp"]["session_id"].as_str().expect("id");
    assert_eq!(gw.session_view(id, &token).await["agent_id"], "agent-alpha");
}

#[tokio::test]
async fn create_and_inspect_sessions() {
    let gw = TestGateway::start().await;
    let (s, h, b) = gw
        .post("/v1/sessions", json!({"agent_id": "agent-7"}), &[])
        .await;
    assert_eq!(s, 201, "{b}");
    assert!(is_uuid(&b["session_id"]));
    assert_eq!(b["status"], "idle");
    assert_eq!(b["agent_id"], "agent-7");
    let token = b["session_token"].as_str().expect("token").to_owned();
    assert_eq!(h["x-session-token"].to_str().ok(), Some(token.as_str()));
    assert!(token.len() >= 26, "token too short for 128 bits: {token}");
    let id = b["session_id"].as_str().expect("id").to_owned();
    let view = gw.session_view(&id, &token).await;
    assert_eq!(view["status"], "idle");
    assert_eq!(view["step_count"], 0);
    assert_eq!(view["surface_attached"], false);
    assert_eq!(view["tether_turns_pending"], 0);
    let (s, b) = gw.get(&format!("/v1/sessions/{id}"), &[]).await;
    assert_eq!((s, error_code(&b)), (401, "SBP_UNAUTHORIZED"));
    let (s, b) = gw
        .get(
            &format!("/v1/sessions/{id}"),
            &[("x-session-token", "sbp_wrong")],
        )
        .await;
    assert_eq!((s, error_code(&b)), (403, "SBP_FORBIDDEN"));
    let (s, b) = gw
        .get(
            &format!("/v1/sessions/{}", uuid::Uuid::new_v4()),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!((s, error_code(&b)), (404, "SBP_SESSION_NOT_FOUND"));
    let (s, b) = gw.get("/v1/sessions/not-a-uuid", &[]).await;
    assert_eq!((s, error_code(&b)), (422, "SBP_INVALID_UUID"));
    // The session continues through completions with its token.
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("go")]}),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(s, 200);
    assert_eq!(b["sbp"]["session_id"], id.as_str());
    assert_eq!(gw.session_view(&id, &token).await["status"], "running");
}

#[tokio::test]
async fn session_tokens_are_stored_only_as_hashes() {
    let gw = TestGateway::start().await;
    let (_, token) = gw.session().await;
    let (_, _, b) = gw.post("/v1/sessions", json!({}), &[]).await;
    let token2 = b["session_token"].as_str().expect("token").to_owned();
    let dir = gw.stop().await;
    let mut bytes = Vec::new();
    for entry in std::fs::read_dir(dir.path()).expect("dir") {
        bytes.extend(std::fs::read(entry.expect("entry").path()).expect("read"));
    }
    for t in [token, token2] {
        let found = bytes.windows(t.len()).any(|w| w == t.as_bytes());
        assert!(!found, "a session token was written to disk in clear");
    }
    assert!(db_path(&dir).exists());
}

#[tokio::test]
async fn transcript_is_paginated() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let auth = [("x-session-token", token.as_str())];
    for t in ["two", "three"] {
        gw.chat(json!({"messages": [user(t)]}), &auth).await;
    }
    let (s, p1) = gw
        .get(&format!("/v1/sessions/{id}/messages?limit=4"), &auth)
        .await;
    assert_eq!(s, 200);
    assert_eq!(p1["messages"].as_array().map(Vec::len), Some(4));
    assert_eq!(p1["has_more"], true);
    assert_eq!(p1["message_count"], 6);
    let after = p1["next_after"].as_u64().expect("cursor");
    let (_, p2) = gw
        .get(
            &format!("/v1/sbp/sessions/{id}/messages?limit=4&after={after}"),
            &auth,
        )
        .await;
    let rest: Vec<&str> = p2["messages"]
        .as_array()
        .expect("page")
        .iter()
        .map(|m| m["content"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(rest, vec!["three", "Echo: three"]);
    assert_eq!(p2["has_more"], false);
    assert_eq!(p1["messages"][1]["model_used"], "sbp/echo");
    let (s, b) = gw
        .get(&format!("/v1/sessions/{id}/messages?limit=abc"), &auth)
        .await;
    assert_eq!((s, error_code(&b)), (400, "SBP_BAD_REQUEST"));
}

async fn sse(
    gw: &TestGateway,
    body: Value,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, Vec<Value>) {
    let req = gw.request(Method::POST, "/v1/chat/completions", headers);
    let resp = req.json(&body).send().await.expect("sent");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("body");
    (status, headers, sse_data(&text))
}

#[tokio::test]
async fn streaming_completion_is_sse_and_persisted() {
    let gw = TestGateway::with_fake().await;
    let (status, headers, events) =
        sse(&gw, json!({"model": "m", "stream": true, "messages": [user("[[fake:chunks=4]] one two three four")]}), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    let token = headers["x-session-token"]
        .to_str()
        .expect("token")
        .to_owned();
    assert_eq!(events.last(), Some(&json!("[DONE]")));
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "echo: one two three four");
    let sbp = events
        .iter()
        .find_map(|e| e.get("sbp"))
        .expect("an event carries sbp");
    assert_eq!(sbp["step_count"], 1);
    let id = sbp["session_id"].as_str().expect("id").to_owned();
    let (_, page) = gw
        .get(
            &format!("/v1/sessions/{id}/messages"),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(page["messages"][1]["content"], "echo: one two three four");
}

#[tokio::test]
async fn upstream_errors_map_to_clear_statuses_and_keep_the_users_message() {
    let gw = TestGateway::with(Options {
        upstream: Upstream::Fake,
        upstream_timeout: Duration::from_millis(400),
        ..Options::default()
    })
    .await;
    let (id, token) = gw.session().await;
    let auth = [("x-session-token", token.as_str())];
    let (s, h, b) = gw
        .chat(
            json!({"messages": [user("[[fake:error=429]] busy?")]}),
            &auth,
        )
        .await;
    assert_eq!((s, error_code(&b)), (429, "SBP_UPSTREAM_ERROR"), "{b}");
    assert_eq!(
        b["error"]["detail"]["upstream"]["error"]["message"],
        "fake error"
    );
    assert_eq!(h["x-session-id"].to_str().ok(), Some(id.as_str()));
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("[[fake:error=503]] down?")]}),
            &auth,
        )
        .await;
    assert_eq!((s, error_code(&b)), (503, "SBP_UPSTREAM_ERROR"));
    let (s, _, b) = gw
        .chat(json!({"messages": [user("[[fake:hang=1]] slow?")]}), &auth)
        .await;
    assert_eq!((s, error_code(&b)), (504, "SBP_UPSTREAM_TIMEOUT"));
    let (_, page) = gw.get(&format!("/v1/sessions/{id}/messages"), &auth).await;
    let roles: Vec<&str> = page["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["role"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(roles, vec!["user", "assistant", "user", "user", "user"]);
    assert_eq!(gw.session_view(&id, &token).await["step_count"], 1);
}

#[tokio::test]
async fn unreachable_upstream_is_502_and_a_new_session_is_not_kept() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let gw = TestGateway::with(Options {
        upstream: Upstream::Url(format!("http://127.0.0.1:{port}/v1")),
        ..Options::default()
    })
    .await;
    let (s, h, b) = gw.chat(json!({"messages": [user("anyone?")]}), &[]).await;
    assert_eq!(
        (s, error_code(&b)),
        (502, "SBP_UPSTREAM_UNREACHABLE"),
        "{b}"
    );
    // Issue 16: a session whose first turn failed is erased, and its caller not told of it.
    assert!(h.get("x-session-token").is_none() && h.get("x-session-id").is_none());
    assert!(b["error"]["detail"].get("session_id").is_none(), "{b}");
    let (_, list) = gw.get("/v1/sessions", &[]).await;
    assert_eq!(list["data"], json!([]), "{list}");
    // An existing session keeps the user's message of a failed turn, and learns its session.
    let (id, token) = gw.idle_session().await;
    let (s, h, b) = gw
        .chat(
            json!({"messages": [user("anyone?")]}),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(s, 502, "{b}");
    assert_eq!(h["x-session-id"].to_str().ok(), Some(id.as_str()));
    assert_eq!(b["error"]["detail"]["session_id"], id.as_str());
    let (_, page) = gw
        .get(
            &format!("/v1/sessions/{id}/messages"),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(page["messages"][0]["content"], "anyone?");
}

#[tokio::test]
async fn idempotent_retry_after_failure_stores_nothing_twice() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let down = TestGateway::with(Options {
        upstream: Upstream::Url(format!("http://127.0.0.1:{port}/v1")),
        ..Options::default()
    })
    .await;
    let body = json!({"model": "m", "messages": [user("pay the invoice")]});
    // A request that would create its session leaves nothing when it fails (issue 16) ...
    let key = [("idempotency-key", "key-123")];
    let (s, h1, _) = down.chat(body.clone(), &key).await;
    assert_eq!(s, 502);
    assert!(h1.get("x-session-token").is_none());
    // ... so its retries fail the same way, never "in progress" nor another session's.
    let (s, _, _) = down.chat(body.clone(), &key).await;
    assert_eq!(s, 502);
    // In an existing session, the failed attempt keeps the user's message once.
    let (_, token1) = down.idle_session().await;
    let key = [("idempotency-key", "key-123"), ("x-session-token", &token1)];
    let (s, _, _) = down.chat(body.clone(), &key).await;
    assert_eq!(s, 502);
    let dir = down.stop().await;
    // Same store, upstream back: the retry runs the turn in the same session, without a second user message.
    let up = TestGateway::with(Options {
        dir: Some(dir),
        ..Options::default()
    })
    .await;
    let (s, h2, b2) = up.chat(body.clone(), &key).await;
    assert_eq!(s, 200, "{b2}");
    assert!(h2.get("x-session-token").is_none(), "no new session");
    let id = b2["sbp"]["session_id"].as_str().expect("id").to_owned();
    let (_, page) = up
        .get(
            &format!("/v1/sessions/{id}/messages"),
            &[("x-session-token", &token1)],
        )
        .await;
    let contents: Vec<&str> = page["messages"]
        .as_array()
        .expect("msgs")
        .iter()
        .map(|m| m["content"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(contents, vec!["pay the invoice", "Echo: pay the invoice"]);
    // A second retry replays the stored response.
    let (s, h3, b3) = up.chat(body.clone(), &key).await;
    assert_eq!(s, 200);
    assert_eq!(b3["choices"], b2["choices"]);
    assert_eq!(h3["idempotent-replayed"], "true");
    assert_eq!(up.session_view(&id, &token1).await["message_count"], 2);
    // The same key for another request is refused.
    let (s, _, b) = up
        .chat(json!({"messages": [user("something else")]}), &key)
        .await;
    assert_eq!((s, error_code(&b)), (422, "SBP_IDEMPOTENCY_KEY_REUSED"));
}

#[tokio::test]
async fn idempotent_replay_does_not_call_the_upstream_again() {
    let gw = TestGateway::with_fake().await;
    let (id, token) = gw.session().await;
    let headers = [
        ("x-session-token", token.as_str()),
        ("idempotency-key", "abc"),
    ];
    let body = json!({"messages": [user("once")]});
    let (s1, _, b1) = gw.chat(body.clone(), &headers).await;
    let (s2, _, b2) = gw.chat(body, &headers).await;
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(b1, b2);
    assert_eq!(gw.fake().requests().len(), 2, "session creation + one turn");
    assert_eq!(gw.session_view(&id, &token).await["message_count"], 4);
}

/// A retry is the same request whatever its key order or spacing: an Idempotency-Key's
/// fingerprint is taken over the body as JSON, not over its bytes.
#[tokio::test]
async fn an_idempotent_retry_may_order_and_space_its_keys_differently() {
    let gw = TestGateway::with_fake().await;
    let (_, token) = gw.session().await;
    let send = |body: &'static str| {
        sbp_test_support::send(
            gw.http
                .post(format!("{}/v1/chat/completions", gw.url))
                .header("content-type", "application/json")
                .header("x-session-token", token.as_str())
                .header("idempotency-key", "k-order")
                .body(body),
        )
    };
    let (s1, _, first) =
        send(r#"{"model":"m","messages":[{"role":"user","content":"once"}]}"#).await;
    let (s2, h2, again) = send(
        r#"{ "messages" : [ { "content" : "once", "role" : "user" } ],
            "model" : "m" }"#,
    )
    .await;
    assert_eq!((s1, s2), (200, 200), "{first} {again}");
    assert_eq!(h2["idempotent-replayed"], "true");
    assert_eq!(again["choices"], first["choices"]);
    assert_eq!(gw.fake().requests().len(), 2, "session creation + one turn");
    // Another body under the key is another request.
    let (s3, _, other) =
        send(r#"{"model":"m","messages":[{"role":"user","content":"twice"}]}"#).await;
    assert_eq!(
        (s3, error_code(&other)),
        (422, "SBP_IDEMPOTENCY_KEY_REUSED")
    );
}

/// An Idempotency-Key belongs to the caller that used it: someone else presenting the same key and
/// body (without the session's token, or with another session's) gets no replay of the stored
/// response and cannot run a retry in that session.
#[tokio::test]
async fn idempotency_keys_are_scoped_to_the_caller() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let body = json!({"messages": [user("my bank balance")]});
    let (s, _, mine) = gw
        .chat(
            body.clone(),
            &[("x-session-token", &token), ("idempotency-key", "k-1")],
        )
        .await;
    assert_eq!(s, 200, "{mine}");
    // The owner's retry is a replay.
    let (_, h, again) = gw
        .chat(
            body.clone(),
            &[("x-session-token", &token), ("idempotency-key", "k-1")],
        )
        .await;
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(again["choices"], mine["choices"]);

    // Without the token: a new request of its own, not the stored one.
    let (s, h, theirs) = gw.chat(body.clone(), &[("idempotency-key", "k-1")]).await;
    assert_eq!(s, 200, "{theirs}");
    assert!(h.get("idempotent-replayed").is_none(), "{theirs}");
    assert_ne!(theirs["sbp"]["session_id"], id.as_str(), "{theirs}");
    // With another session's token: its own turn in its own session.
    let (other, other_token) = gw.session().await;
    let (s, h, b) = gw
        .chat(
            body.clone(),
            &[
                ("x-session-token", &other_token),
                ("idempotency-key", "k-1"),
            ],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert!(h.get("idempotent-replayed").is_none(), "{b}");
    assert_eq!(b["sbp"]["session_id"], other.as_str(), "{b}");
    // The owner's session holds its one turn.
    assert_eq!(gw.session_view(&id, &token).await["message_count"], 4);
}

#[tokio::test]
async fn strict_mode_passes_plain_requests_through_untracked() {
    let config = GatewayConfig {
        strict_sbp: true,
        secret: vec![1; 32],
        ..GatewayConfig::default()
    };
    let gw = TestGateway::with(Options {
        config,
        upstream: Upstream::Fake,
        ..Options::default()
    })
    .await;
    let (s, h, b) = gw
        .chat(json!({"model": "m", "messages": [user("plain")]}), &[])
        .await;
    assert_eq!(s, 200);
    assert!(b.get("sbp").is_none(), "{b}");
    assert!(h.get("x-session-token").is_none());
    assert_eq!(b["choices"][0]["message"]["content"], "echo: plain");
    let (s, h, b) = gw
        .chat(
            json!({"model": "m", "messages": [user("tracked")], "sbp": {}}),
            &[],
        )
        .await;
    assert_eq!(s, 200);
    assert!(is_uuid(&b["sbp"]["session_id"]));
    assert!(h.get("x-session-token").is_some());
}

/// An OpenAI-compatible upstream of the test's own on loopback, answering `/v1/chat/completions`
/// with `answer`: its base URL, and its task (aborted when the test is done).
async fn own_upstream<H, T>(answer: H) -> (String, tokio::task::JoinHandle<std::io::Result<()>>)
where
    H: axum::handler::Handler<T, ()>,
    T: 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let app = axum::Router::new().route("/v1/chat/completions", axum::routing::post(answer));
    let task = tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://127.0.0.1:{port}/v1"), task)
}

/// A completion of an OpenAI-compatible upstream, spelled as no serialiser of a parsed tree would
/// (keys unsorted, numbers in exponent form, an escaped character, fields the gateway does not
/// know).
const UPSTREAM_ANSWER: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1.7e9,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"caf\u00e9","refusal":null},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1E0,"total_tokens":4},"system_fingerprint":"fp_x"}"#;

/// Strict mode relays a plain request's answer as the upstream sent it, byte for byte; an answer
/// that is not a completion is refused there as it is in a tracked turn.
#[tokio::test]
async fn strict_mode_relays_the_upstreams_answer_byte_for_byte() {
    let (url, upstream) = own_upstream(|body: String| async move {
        let answer = match body.contains("broken") {
            true => r#"{"id":"chatcmpl-2","choices":[]}"#,
            false => UPSTREAM_ANSWER,
        };
        ([("content-type", "application/json")], answer)
    })
    .await;
    let gw = TestGateway::with(Options {
        config: GatewayConfig {
            strict_sbp: true,
            secret: vec![1; 32],
            ..GatewayConfig::default()
        },
        upstream: Upstream::Url(url),
        ..Options::default()
    })
    .await;
    let resp = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.url))
        .json(&json!({"model": "m", "messages": [user("hi")]}))
        .send()
        .await
        .expect("sent");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().ok(),
        Some("application/json")
    );
    assert!(resp.headers().get("x-session-id").is_none());
    assert_eq!(resp.text().await.expect("body"), UPSTREAM_ANSWER);

    let (plain, _, plain_body) = gw
        .chat(json!({"model": "m", "messages": [user("broken")]}), &[])
        .await;
    let (tracked, _, tracked_body) = gw
        .chat(
            json!({"model": "m", "messages": [user("broken")], "sbp": {}}),
            &[],
        )
        .await;
    assert_eq!(plain, 502, "{plain_body}");
    assert_eq!(
        (plain, error_code(&plain_body)),
        (tracked, error_code(&tracked_body)),
        "{plain_body} {tracked_body}"
    );
    upstream.abort();
}

/// An upstream's error that quotes a long request back reaches the client with its message, type
/// and code, and only the start of its body (every client of a failing upstream gets it).
#[tokio::test]
async fn a_long_upstream_error_body_is_cut_in_the_envelope() {
    let long = json!({
        "error": {"message": "input too long", "type": "invalid_request_error", "code": "ctx"},
        "input": "q".repeat(100 << 10),
    })
    .to_string();
    let (url, upstream) = own_upstream(move || async move {
        (
            axum::http::StatusCode::BAD_REQUEST,
            [("content-type", "application/json")],
            long,
        )
    })
    .await;
    let gw = TestGateway::with(Options {
        upstream: Upstream::Url(url),
        ..Options::default()
    })
    .await;
    let (s, _, b) = gw.chat(json!({"messages": [user("hi")]}), &[]).await;
    assert_eq!((s, error_code(&b)), (400, "SBP_UPSTREAM_ERROR"), "{b}");
    assert_eq!(b["error"]["message"], "input too long");
    assert_eq!(b["error"]["upstream_code"], "ctx");
    let shown = b["error"]["detail"]["upstream"]
        .as_str()
        .expect("the body's text, cut");
    assert!(shown.starts_with(r#"{"error":{"#), "{}", &shown[..40]);
    assert!(shown.len() <= (16 << 10) + 3, "{}", shown.len());
    assert!(shown.ends_with("q…"));
    upstream.abort();
}

#[tokio::test]
async fn bad_input_gets_the_error_envelope() {
    let config = GatewayConfig {
        max_body_bytes: 4096,
        secret: vec![1; 32],
        ..GatewayConfig::default()
    };
    let gw = TestGateway::with(Options {
        config,
        ..Options::default()
    })
    .await;
    let raw = |body: &'static str| {
        let req = gw
            .http
            .post(format!("{}/v1/chat/completions", gw.url))
            .header("content-type", "application/json")
            .body(body);
        async move { crate::support::response(req.send().await.expect("sent")).await }
    };
    for body in [
        "{not json",
        "[1,2]",
        "\"str\"",
        "{}",
        "{\"messages\": []}",
        "{\"messages\": [{\"content\": \"no role\"}]}",
        "{\"messages\": [{\"role\":\"user\",\"content\":\"x\"}], \"stream\": \"yes\"}",
        "{\"messages\": [{\"role\":\"user\",\"content\":\"x\"}], \"sbp\": {\"checkpoint_every\": 0}}",
        "{\"messages\": [{\"role\":\"user\",\"content\":\"x\"}], \"sbp\": \"on\"}",
        "{\"messages\": [{\"role\":\"user\",\"content\":\"x\"}], \"model\": 42}",
    ] {
        let (s, _, b) = raw(body).await;
        assert_eq!((s, error_code(&b)), (400, "SBP_BAD_REQUEST"), "{body}");
    }
    let big = json!({"messages": [user(&"x".repeat(10_000))]});
    let (s, _, b) = gw.chat(big, &[]).await;
    assert_eq!((s, error_code(&b)), (413, "SBP_PAYLOAD_TOO_LARGE"));
    let (s, b) = gw.get("/v1/nowhere", &[]).await;
    assert_eq!((s, error_code(&b)), (404, "SBP_NOT_FOUND"));
    let (s, b) = gw.get("/v1/chat/completions", &[]).await;
    assert_eq!((s, error_code(&b)), (405, "SBP_METHOD_NOT_ALLOWED"));
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("x")], "sbp": {"session_id": "nope"}}),
            &[],
        )
        .await;
    assert_eq!((s, error_code(&b)), (422, "SBP_INVALID_UUID"));
}

#[tokio::test]
async fn operator_keys_guard_every_endpoint_but_healthz() {
    let config = GatewayConfig {
        api_keys: vec!["k1".into()],
        secret: vec![1; 32],
        ..GatewayConfig::default()
    };
    let gw = TestGateway::with(Options {
        config,
        ..Options::default()
    })
    .await;
    let (s, b) = gw.get("/healthz", &[]).await;
    assert_eq!((s, &b["status"]), (200, &json!("ok")));
    let (s, _, b) = gw.chat(json!({"messages": [user("x")]}), &[]).await;
    assert_eq!((s, error_code(&b)), (401, "SBP_UNAUTHORIZED"));
    let (s, b) = gw
        .get("/metrics", &[("authorization", "Bearer wrong")])
        .await;
    assert_eq!((s, error_code(&b)), (401, "SBP_UNAUTHORIZED"));
    let (s, h, b) = gw
        .chat(
            json!({"messages": [user("x")]}),
            &[("authorization", "Bearer k1")],
        )
        .await;
    assert_eq!(s, 200);
    // An operator key also authorises session-scoped endpoints.
    let id = b["sbp"]["session_id"].as_str().expect("id");
    let (s, v) = gw
        .get(
            &format!("/v1/sessions/{id}"),
            &[("authorization", "Bearer k1")],
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert!(h.get("x-session-token").is_some());
}

#[tokio::test]
async fn metrics_count_turns_and_sessions() {
    let gw = TestGateway::start().await;
    gw.session().await;
    let text = gw.metrics_text().await;
    assert!(text.contains("sbp_turns_total 1"), "{text}");
    assert!(
        text.contains("sbp_sessions{status=\"running\"} 1"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("sbp_upstream_latency_seconds_count{")
                && l.contains("provider=\"echo\",outcome=\"ok\"")
                && l.ends_with(" 1")),
        "{text}"
    );
    assert!(text.contains("sbp_attached_surfaces 0"));
}

#[tokio::test]
async fn a_caller_that_disconnects_mid_stream_does_not_lose_the_turn() {
    let gw = TestGateway::with_fake().await;
    let (id, token) = gw.session().await;
    let body = json!({"model": "m", "stream": true,
                      "messages": [user("[[fake:chunks=6]] [[fake:chunk_delay=100]] a b c d e f")]});
    let mut resp = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.url))
        .header("x-session-token", &token)
        .json(&body)
        .send()
        .await
        .expect("sent");
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.expect("read").expect("a first chunk");
    assert!(!first.is_empty());
    drop(resp);
    // The turn finishes without its caller and is persisted.
    let deadline = tokio::time::Instant::now() + crate::support::WAIT;
    loop {
        let v = gw.session_view(&id, &token).await;
        if v["step_count"] == 2 {
            assert_eq!(v["message_count"], 4);
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "turn was lost: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, page) = gw
        .get(
            &format!("/v1/sessions/{id}/messages?after=2"),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(page["messages"][0]["content"], "echo: a b c d e f");
}

/// A prompt that reads like a sealed value (encryption off, the default) is stored as text: the
/// session stays readable and its next turn goes through.
#[tokio::test]
async fn a_prompt_that_looks_sealed_does_not_break_its_session() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session_saying("sbp:enc:v1:hello").await;
    let auth = [("x-session-token", token.as_str())];
    let (status, _, body) = gw
        .chat(
            json!({"model": "m", "messages": [user("sbp:raw:again")]}),
            &auth,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["sbp"]["step_count"], 2);
    let (_, page) = gw.get(&format!("/v1/sessions/{id}/messages"), &auth).await;
    let stored: Vec<&str> = page["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["content"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(stored[0], "sbp:enc:v1:hello");
    assert_eq!(stored[2], "sbp:raw:again");
    let (status, session) = gw.get(&format!("/v1/sessions/{id}"), &auth).await;
    assert_eq!(status, 200, "{session}");
}

/// `GET /v1/models` lists what completions may name, in OpenAI's shape (SDKs and chat front ends
/// list models first): the upstream's models through an OpenAI-compatible upstream, the built-in
/// model without one; `GET /v1/models/{id}` answers one of them, or 404 in the envelope.
#[tokio::test]
async fn models_are_listed_as_openai_lists_them() {
    let offline = TestGateway::start().await;
    let list: Value = offline
        .http
        .get(format!("{}/v1/models", offline.url))
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("json");
    assert_eq!(list["object"], "list", "{list}");
    let ids: Vec<&str> = list["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, vec!["sbp/echo"], "{list}");
    assert_eq!(list["data"][0]["object"], "model");

    let upstream = TestGateway::with_fake().await;
    let resp = upstream
        .http
        .get(format!("{}/v1/models", upstream.url))
        .send()
        .await
        .expect("models");
    assert_eq!(resp.status(), 200);
    let list: Value = resp.json().await.expect("json");
    assert_eq!(list["data"][0]["id"], "fake", "the upstream's list: {list}");
    assert_eq!(list["data"][0]["owned_by"], "sbp-fake-llm", "{list}");

    let one = upstream
        .http
        .get(format!("{}/v1/models/fake", upstream.url))
        .send()
        .await
        .expect("model");
    assert_eq!(one.status(), 200);
    let one: Value = one.json().await.expect("json");
    assert_eq!(
        (one["id"].as_str(), one["object"].as_str()),
        (Some("fake"), Some("model"))
    );
    let missing = upstream
        .http
        .get(format!("{}/v1/models/no-such-model", upstream.url))
        .send()
        .await
        .expect("model");
    assert_eq!(missing.status(), 404);
    let body: Value = missing.json().await.expect("json");
    assert_eq!(error_code(&body), "SBP_NOT_FOUND", "{body}");
}
