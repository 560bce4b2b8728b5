//! What OpenAI's clients expect of `/v1/chat/completions`, over HTTP: the stream exactly as
//! OpenAI sends it, a suspended session as an error they raise, upstream errors in their words,
//! a session token given as `api_key`, and `n`. (The real SDKs drive it in the binary tests.)

use reqwest::Method;
use sbp_gateway::GatewayConfig;
use serde_json::{Value, json};

use crate::support::{Options, TestGateway, TestGatewayExt, sse_data};

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// OpenAI's Python SDK sends these with every request.
const SDK: [(&str, &str); 2] = [
    ("user-agent", "OpenAI/Python 3.57.0"),
    ("x-stainless-lang", "python"),
];

async fn stream(
    gw: &TestGateway,
    body: Value,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, Vec<Value>) {
    let resp = gw
        .request(Method::POST, "/v1/chat/completions", headers)
        .json(&body)
        .send()
        .await
        .expect("sent");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("body");
    (status, headers, sse_data(&text))
}

/// Every chunk before `[DONE]` has a first choice unless it is the usage chunk, which comes last.
fn assert_openai_stream(events: &[Value], include_usage: bool) {
    assert_eq!(events.last(), Some(&json!("[DONE]")), "{events:?}");
    let chunks = &events[..events.len() - 1];
    let (body, usage) = match include_usage {
        true => chunks.split_at(chunks.len() - 1),
        false => (chunks, &[][..]),
    };
    for c in body {
        assert_eq!(c["object"], "chat.completion.chunk", "{c}");
        assert!(
            c["choices"].as_array().is_some_and(|a| !a.is_empty()),
            "a chunk without choices before the end: {c}"
        );
        assert!(c.get("usage").is_none_or(Value::is_null), "{c}");
    }
    let finishes: Vec<&Value> = body
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"].is_string())
        .collect();
    assert_eq!(finishes.len(), 1, "one finish chunk: {events:?}");
    assert!(std::ptr::eq(finishes[0], body.last().expect("chunks")));
    if include_usage {
        assert_eq!(usage[0]["choices"], json!([]), "{}", usage[0]);
        assert!(usage[0]["usage"]["total_tokens"].is_u64(), "{}", usage[0]);
    }
}

#[tokio::test]
async fn a_stream_is_what_openai_sends_with_the_sbp_block_on_its_finish_chunk() {
    let gw = TestGateway::with_fake().await;
    let (s, h, events) = stream(
        &gw,
        json!({"model": "m", "stream": true, "messages": [user("[[fake:chunks=3]] one two three")]}),
        &[],
    )
    .await;
    assert_eq!(s, 200);
    assert_openai_stream(&events, false);
    let finish = &events[events.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    assert_eq!(finish["sbp"]["step_count"], 1, "{finish}");
    assert_eq!(
        finish["sbp"]["session_id"].as_str(),
        h["x-session-id"].to_str().ok()
    );
    let ids: std::collections::HashSet<&str> = events[..events.len() - 1]
        .iter()
        .filter_map(|c| c["id"].as_str())
        .collect();
    assert_eq!(ids.len(), 1, "one completion id across the chunks: {ids:?}");

    // Asked for usage: it comes last, in a chunk of its own with no choices.
    let token = h["x-session-token"].to_str().expect("token").to_owned();
    let (s, _, events) = stream(
        &gw,
        json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
               "messages": [user("again")]}),
        &[("x-session-token", &token)],
    )
    .await;
    assert_eq!(s, 200);
    assert_openai_stream(&events, true);
    assert_eq!(events[events.len() - 3]["sbp"]["step_count"], 2);
}

#[tokio::test]
async fn a_streamed_tool_loop_ends_with_one_finish_chunk_and_usage_last() {
    let gw = TestGateway::with_fake().await;
    // A client tool call streams its deltas and finishes with `tool_calls`.
    let (s, _, events) = stream(
        &gw,
        json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
               "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
               "messages": [user("[[fake:tool=lookup:{\"q\":1}]] go")]}),
        &[],
    )
    .await;
    assert_eq!(s, 200);
    assert_openai_stream(&events, true);
    let finish = &events[events.len() - 3];
    assert_eq!(
        finish["choices"][0]["finish_reason"], "tool_calls",
        "{finish}"
    );
    let streamed_calls = events
        .iter()
        .filter(|c| c["choices"][0]["delta"]["tool_calls"].is_array())
        .count();
    assert!(streamed_calls >= 1, "{events:?}");
}

async fn suspended_session(gw: &TestGateway) -> (String, String) {
    let (id, token) = gw.session().await;
    suspend(gw, &id, &token).await;
    (id, token)
}

/// A gateway started with the operator key `operator-key`.
async fn with_operator_key() -> TestGateway {
    TestGateway::with(Options {
        config: GatewayConfig {
            api_keys: vec!["operator-key".into()],
            ..crate::support::Options::default().config
        },
        ..Options::default()
    })
    .await
}

#[tokio::test]
async fn a_suspended_session_is_an_error_an_openai_sdk_raises_and_does_not_retry() {
    let gw = TestGateway::start().await;
    let (id, token) = suspended_session(&gw).await;
    let before = gw.session_view(&id, &token).await["message_count"].clone();
    let mut sdk = SDK.to_vec();
    sdk.push(("x-session-token", &token));
    let (s, h, b) = gw.chat(json!({"messages": [user("hi")]}), &sdk).await;
    assert_eq!(s, 423, "{b}");
    assert_eq!(b["error"]["code"], "SBP_SESSION_SUSPENDED");
    assert_eq!(b["error"]["type"], "invalid_request_error");
    let message = b["error"]["message"].as_str().expect("message");
    assert!(
        message.contains("X-SBP-Auto-Resume") && message.contains("\"resume\": true"),
        "{message}"
    );
    assert_eq!(h["x-should-retry"], "false");
    assert_eq!(h["x-session-id"].to_str().ok(), Some(id.as_str()));

    // A stream gets the same error, not an empty event stream; so does a session token sent as
    // the SDK's api_key, whatever the client.
    let (s, _, b) = gw
        .chat(
            json!({"stream": true, "messages": [user("hi")]}),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(
        (s, &b["error"]["code"]),
        (423, &json!("SBP_SESSION_SUSPENDED")),
        "{b}"
    );
    let bearer = format!("Bearer {token}");
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("hi")]}),
            &[("authorization", &bearer)],
        )
        .await;
    assert_eq!(s, 423, "{b}");
    assert_eq!(gw.session_view(&id, &token).await["message_count"], before);

    // A caller that speaks SBP (an `sbp` object) keeps the spec's 202, SDK or not.
    let (s, _, b) = gw
        .chat(json!({"messages": [user("hi")], "sbp": {}}), &sdk)
        .await;
    assert_eq!(s, 202, "{b}");
    assert_eq!(b["sbp"]["resume_available"], true);
    // So does a plain HTTP client without one (the conformance vector L2-resume/01).
    let (s, _, _) = gw
        .chat(
            json!({"messages": [user("hi")]}),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(s, 202);

    // The opt-in resumes instead: the header (set once in an SDK's default_headers) ...
    let mut resume = sdk.clone();
    resume.push(("x-sbp-auto-resume", "true"));
    let (s, _, b) = gw.chat(json!({"messages": [user("back")]}), &resume).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["sbp"]["session_id"], id.as_str());
    assert_eq!(b["choices"][0]["message"]["content"], "Echo: back");
    // ... or `sbp.auto_resume`.
    suspend(&gw, &id, &token).await;
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("again")], "sbp": {"auto_resume": true}}),
            &sdk,
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["sbp"]["step_count"], 3);
}

async fn suspend(gw: &TestGateway, id: &str, token: &str) {
    let (s, b) = gw
        .patch(
            &format!("/v1/sbp/sessions/{id}/status"),
            json!({"status": "suspended"}),
            &[("x-session-token", token)],
        )
        .await;
    assert_eq!(s, 200, "{b}");
}

#[tokio::test]
async fn upstream_errors_reach_the_caller_in_the_upstreams_words() {
    let gw = TestGateway::with_fake().await;
    let (s, _, b) = gw
        .chat(
            json!({"model": "fake-error-404", "messages": [user("hi")]}),
            &[],
        )
        .await;
    assert_eq!(s, 404, "{b}");
    let e = &b["error"];
    assert_eq!(e["code"], "SBP_UPSTREAM_ERROR");
    assert_eq!(e["message"], "fake error");
    assert_eq!(e["type"], "invalid_request_error");
    assert_eq!(e["param"], "model");
    assert_eq!(e["upstream_code"], "model_not_found");
    assert_eq!(e["detail"]["upstream"]["error"]["code"], "model_not_found");

    // The same when the failure comes as the stream's first event.
    let (s, _, b) = gw
        .chat(
            json!({"model": "fake-error-400", "stream": true, "messages": [user("hi")]}),
            &[],
        )
        .await;
    assert_eq!(s, 400, "{b}");
    assert_eq!(b["error"]["upstream_code"], "context_length_exceeded");
    assert_eq!(b["error"]["param"], "messages");
}

#[tokio::test]
async fn every_gateway_error_has_an_openai_type() {
    let gw = with_operator_key().await;
    let (s, _, b) = gw.chat(json!({"messages": [user("hi")]}), &[]).await;
    assert_eq!(
        (s, &b["error"]["type"]),
        (401, &json!("authentication_error")),
        "{b}"
    );
    let key = [("authorization", "Bearer operator-key")];
    let (s, _, b) = gw
        .chat(
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            &key,
        )
        .await;
    assert_eq!(
        (s, &b["error"]["type"]),
        (400, &json!("invalid_request_error")),
        "{b}"
    );
    assert_eq!(b["error"]["param"], "messages[0].role");
    let (s, b) = gw.get("/v1/nothing-here", &key).await;
    assert_eq!(
        (s, &b["error"]["type"]),
        (404, &json!("not_found_error")),
        "{b}"
    );
}

#[tokio::test]
async fn what_openai_refuses_is_refused_and_nothing_is_stored() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let auth = [("x-session-token", token.as_str())];
    for (messages, param) in [
        (
            json!([{"role": "wizard", "content": "x"}]),
            "messages[0].role",
        ),
        (
            json!([{"role": "user", "content": 12}]),
            "messages[0].content",
        ),
        (
            json!([user("a"), {"role": "tool", "content": "r"}]),
            "messages[1].tool_call_id",
        ),
    ] {
        let (s, _, b) = gw.chat(json!({"messages": messages}), &auth).await;
        assert_eq!(s, 400, "{b}");
        assert_eq!(b["error"]["param"], param, "{b}");
        let message = b["error"]["message"].as_str().expect("message");
        assert!(message.contains(param), "{message}");
    }
    for (n, status) in [
        (json!(2), 400),
        (json!(0), 400),
        (json!("2"), 400),
        (json!(1), 200),
    ] {
        let (s, _, b) = gw
            .chat(json!({"n": n, "messages": [user("n?")]}), &auth)
            .await;
        assert_eq!(s, status, "n={n}: {b}");
        if status == 400 {
            assert_eq!(b["error"]["param"], "n");
        }
    }
    // Only the n=1 turn was stored.
    assert_eq!(gw.session_view(&id, &token).await["message_count"], 4);
}

#[tokio::test]
async fn n_passes_through_in_strict_mode() {
    let gw = TestGateway::with(Options {
        upstream: crate::support::Upstream::Fake,
        config: GatewayConfig {
            strict_sbp: true,
            ..crate::support::Options::default().config
        },
        ..Options::default()
    })
    .await;
    let (s, h, b) = gw
        .chat(
            json!({"model": "m", "n": 2, "messages": [user("two?")]}),
            &[],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert!(h.get("x-session-id").is_none());
    assert_eq!(gw.fake().requests()[0]["n"], 2);
}

#[tokio::test]
async fn a_session_token_sent_as_the_sdks_api_key_continues_its_session() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let bearer = format!("Bearer {token}");
    let (s, h, b) = gw
        .chat(
            json!({"messages": [user("still me")]}),
            &[("authorization", &bearer)],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["sbp"]["session_id"], id.as_str());
    assert!(h.get("x-session-token").is_none(), "no new session");
    assert_eq!(b["sbp"]["step_count"], 2);
    // Read endpoints take it too.
    let (s, view) = gw
        .get(&format!("/v1/sessions/{id}"), &[("authorization", &bearer)])
        .await;
    assert_eq!((s, &view["message_count"]), (200, &json!(4)), "{view}");
    // A token of the right shape that is no session's is refused, not a new session.
    let fake = format!("Bearer sbp_{}", "A".repeat(43));
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("x")]}),
            &[("authorization", &fake)],
        )
        .await;
    assert_eq!(s, 403, "{b}");
    // Any other Bearer value (an OpenAI key left in place) is not a credential here.
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("x")]}),
            &[("authorization", "Bearer sk-proj-123")],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_ne!(b["sbp"]["session_id"], id.as_str());
}

#[tokio::test]
async fn with_operator_keys_a_session_token_is_not_an_operator_key() {
    let gw = with_operator_key().await;
    let key = [("authorization", "Bearer operator-key")];
    let (s, h, b) = gw.chat(json!({"messages": [user("hi")]}), &key).await;
    assert_eq!(s, 200, "{b}");
    let token = h["x-session-token"].to_str().expect("token").to_owned();
    let id = b["sbp"]["session_id"].as_str().expect("id").to_owned();
    let bearer = format!("Bearer {token}");
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("again")]}),
            &[("authorization", &bearer)],
        )
        .await;
    assert_eq!(s, 401, "{b}");
    assert!(
        b["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("X-Session-Token")),
        "{b}"
    );
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("again")]}),
            &[key[0], ("x-session-token", &token)],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["sbp"]["session_id"], id.as_str());
}

#[tokio::test]
async fn a_stream_on_a_suspended_session_is_an_error_even_with_an_sbp_object() {
    let gw = TestGateway::start().await;
    let (_, token) = suspended_session(&gw).await;
    let (s, h, b) = gw
        .chat(
            json!({"stream": true, "messages": [user("hi")], "sbp": {"checkpoint_every": 2}}),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(s, 423, "{b}");
    assert_eq!(h["content-type"], "application/json");
    assert_eq!(b["error"]["code"], "SBP_SESSION_SUSPENDED");
}

#[tokio::test]
async fn a_replayed_streamed_request_is_a_stream_again() {
    let gw = TestGateway::with_fake().await;
    let body = json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
                      "messages": [user("[[fake:chunks=2]] once only")]});
    let key = [("idempotency-key", "0b8c5a1e-7f7e-4a53-9f0e-3c1d2b4a5e6f")];
    let (s, h, first) = stream(&gw, body.clone(), &key).await;
    assert_eq!(s, 200);
    assert_openai_stream(&first, true);
    let (s, h2, again) = stream(&gw, body, &key).await;
    assert_eq!(s, 200);
    assert_eq!(h2["content-type"], "text/event-stream");
    assert_eq!(h2["idempotent-replayed"], "true");
    assert_eq!(h2["x-session-token"], h["x-session-token"]);
    assert_openai_stream(&again, true);
    let text = |events: &[Value]| -> String {
        events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .collect()
    };
    assert_eq!(text(&again), text(&first));
    assert_eq!(text(&again), "echo: once only");
    assert_eq!(
        gw.fake().requests().len(),
        1,
        "the replay did not call the upstream"
    );
}

#[tokio::test]
async fn an_upstream_refusing_the_gateways_key_is_not_the_callers_auth_failure() {
    let gw = TestGateway::with_fake().await;
    let (s, _, b) = gw
        .chat(
            json!({"model": "fake-error-401", "messages": [user("hi")]}),
            &[("authorization", "Bearer sk-callers-own")],
        )
        .await;
    assert_eq!(s, 502, "{b}");
    assert_eq!(b["error"]["type"], "upstream_error");
    assert_eq!(b["error"]["upstream_code"], "invalid_api_key");
    assert!(
        b["error"]
            .get("detail")
            .is_none_or(|d| d.get("upstream").is_none()),
        "{b}"
    );
    assert_ne!(b["error"]["message"], "fake error");
    // An upstream's own type stays; otherwise the type is the status's.
    let (s, _, b) = gw
        .chat(
            json!({"model": "fake-error-429", "messages": [user("hi")]}),
            &[],
        )
        .await;
    assert_eq!((s, &b["error"]["type"]), (429, &json!("requests")), "{b}");
}

#[tokio::test]
async fn an_ended_session_is_a_conflict_the_sdks_do_not_retry() {
    let gw = TestGateway::start().await;
    let (sid, token) = gw.session().await;
    let (s, b) = gw
        .patch(
            &format!("/v1/sbp/sessions/{sid}/status"),
            json!({"status": "completed"}),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    let (s, h, b) = gw
        .chat(
            json!({"messages": [user("more?")]}),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(
        (s, &b["error"]["code"]),
        (409, &json!("SBP_SESSION_CONFLICT")),
        "{b}"
    );
    assert_eq!(h["x-should-retry"], "false");
}

async fn session_count(gw: &TestGateway) -> usize {
    let (s, list) = gw.get("/v1/sessions?limit=100", &[]).await;
    assert_eq!(s, 200, "{list}");
    list["data"].as_array().expect("data").len()
}

#[tokio::test]
async fn a_new_session_whose_first_turn_fails_is_not_kept() {
    let gw = TestGateway::with_fake().await;
    let (_, token) = gw.session().await;
    assert_eq!(session_count(&gw).await, 1);
    let key = [("idempotency-key", "5f1c2e3d-4b5a-4c6d-8e7f-9a0b1c2d3e4f")];
    for headers in [&[][..], &key[..], &key[..]] {
        let (s, h, b) = gw
            .chat(
                json!({"model": "fake-error-503", "messages": [user("hi")]}),
                headers,
            )
            .await;
        assert_eq!(s, 503, "{b}");
        assert!(h.get("x-session-id").is_none() && h.get("x-session-token").is_none());
        assert!(b["error"]["detail"].get("session_id").is_none(), "{b}");
    }
    // Streamed: the failure arrives as the first event, with no session either.
    let (s, h, b) = gw
        .chat(
            json!({"model": "fake-error-500", "stream": true, "messages": [user("hi")]}),
            &[],
        )
        .await;
    assert_eq!(s, 500, "{b}");
    assert!(h.get("x-session-id").is_none());
    assert_eq!(session_count(&gw).await, 1);
    // Cut after streaming began: the caller learnt the session from the headers, so it is kept
    // (with the user's message), as any session a failed turn ran in.
    let (s, h, _) = stream(
        &gw,
        json!({"model": "m", "stream": true, "messages": [user("[[fake:drop=1]] [[fake:chunks=5]] a b c d e")]}),
        &[],
    )
    .await;
    assert_eq!(s, 200);
    let id = h["x-session-id"].to_str().expect("id").to_owned();
    let cut = h["x-session-token"].to_str().expect("token").to_owned();
    let (s, b) = gw
        .get(&format!("/v1/sessions/{id}"), &[("x-session-token", &cut)])
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(session_count(&gw).await, 2);

    // An existing session keeps the user's message of a failed turn.
    let (s, h, _) = gw
        .chat(
            json!({"model": "fake-error-503", "messages": [user("kept")]}),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(s, 503);
    assert!(h.get("x-session-id").is_some());
    assert_eq!(session_count(&gw).await, 2);
}
