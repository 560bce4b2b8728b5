//! L5 surface tools: the agent loop (the LLM calls a tool the attached surface declared, the
//! gateway sends TOOL_CALL, feeds the TOOL_RESULT back and asks again), its failure modes
//! (timeout, disconnect, undeclared or refused tools), SSE callers, the transcript, snapshots and
//! export of a tool round, and backend-initiated calls (`POST .../tool_calls`).

use std::time::{Duration, Instant};

use sbp_gateway::GatewayConfig;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::support::{Options, TestGateway, TestGatewayExt, Upstream, Ws, sse_data};

/// The tool result the surface sends in most tests, and the exact text the LLM gets for it.
const GPS_FIX: &str = r#"{"lat":35.68,"lon":139.76}"#;

fn gps_fix() -> Value {
    json!({"lat": 35.68, "lon": 139.76})
}

/// A gateway in front of the fake upstream, with `edit` applied to its config.
async fn gateway(edit: impl FnOnce(&mut GatewayConfig)) -> TestGateway {
    let mut opts = Options {
        upstream: Upstream::Fake,
        ..Options::default()
    };
    edit(&mut opts.config);
    TestGateway::with(opts).await
}

fn tok(token: &str) -> [(&str, &str); 1] {
    [("x-session-token", token)]
}

/// A one-message completion request.
fn ask(text: &str) -> Value {
    json!({"model": "gpt-4o", "messages": [{"role": "user", "content": text}]})
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

fn reply_text(body: &Value) -> &str {
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("a text reply: {body}"))
}

fn is_uuid_v4(v: &Value) -> bool {
    v.as_str()
        .and_then(|s| Uuid::parse_str(s).ok())
        .is_some_and(|u| u.get_version_num() == 4)
}

/// A fresh idle session with a surface attached that declares `surface_context`; returns
/// (id, token, socket, SESSION_ATTACHED).
async fn attached(gw: &TestGateway, surface_context: Value) -> (String, String, Ws, Value) {
    let (id, token) = gw.idle_session().await;
    let (ws, frame) = gw
        .attach(&id, &token, json!({"surface_context": surface_context}))
        .await;
    (id, token, ws, frame)
}

/// The next frame, which must be a TOOL_CALL.
async fn expect_tool_call(ws: &mut Ws) -> Value {
    let f = ws.recv().await;
    assert_eq!(f["type"], "TOOL_CALL", "expected a TOOL_CALL, got {f}");
    f
}

async fn answer(ws: &mut Ws, call: &Value, result: Value) {
    ws.send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": result}))
        .await;
}

async fn answer_error(ws: &mut Ws, call: &Value, error: &str) {
    ws.send(
        json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": null, "error": error}),
    )
    .await;
}

/// The stored transcript.
fn roles(messages: &[Value]) -> Vec<&str> {
    messages
        .iter()
        .map(|m| m["role"].as_str().unwrap_or(""))
        .collect()
}

/// The function declarations of an upstream request's `tools`, by name.
fn offered<'a>(request: &'a Value, name: &str) -> Option<&'a Value> {
    request["tools"]
        .as_array()?
        .iter()
        .find(|t| t["function"]["name"] == name)
}

fn offered_names(request: &Value) -> Vec<&str> {
    request["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect()
}

/// Whether `key` occurs as an object key anywhere in `v`.
fn has_key(v: &Value, key: &str) -> bool {
    match v {
        Value::Object(m) => m.contains_key(key) || m.values().any(|x| has_key(x, key)),
        Value::Array(a) => a.iter().any(|x| has_key(x, key)),
        _ => false,
    }
}

/// The engine's snapshots of a session (their `state` is not in the HTTP list).
async fn snapshot_states(gw: &TestGateway, id: &str) -> Vec<(String, Value)> {
    gw.gateway
        .sessions()
        .snapshots(Uuid::parse_str(id).expect("session id"), 100)
        .await
        .expect("snapshots")
        .into_iter()
        .map(|s| (s.kind.as_str().to_owned(), s.state))
        .collect()
}

fn find_state<'a>(states: &'a [(String, Value)], kind: &str, action: &str) -> Vec<&'a Value> {
    states
        .iter()
        .filter(|(k, s)| k == kind && s["action"] == action)
        .map(|(_, s)| s)
        .collect()
}

/// Runs one turn in which the LLM calls `surface_gps` with `{"acc":"high"}` and the surface answers
/// with [`gps_fix`]; returns (the HTTP reply, the TOOL_CALL frame, the live turn's text).
async fn gps_turn(gw: &TestGateway, ws: &mut Ws, token: &str) -> (Value, Value, String) {
    let turn = gw.spawn_post(
        "/v1/chat/completions",
        ask(r#"where am I? [[fake:tool=surface_gps:{"acc":"high"}]]"#),
        &tok(token),
    );
    let call = expect_tool_call(ws).await;
    answer(ws, &call, gps_fix()).await;
    let (live, _) = ws.live_turn().await;
    let (s, _, body) = turn.await.expect("turn task");
    assert_eq!(s, 200, "{body}");
    (body, call, live)
}

#[tokio::test]
async fn surface_tool_result_goes_back_to_the_llm_and_is_recorded() {
    let gw = gateway(|_| {}).await;
    let (id, token, mut ws, frame) = attached(&gw, json!({"mcp_tools": ["gps"]})).await;
    assert_eq!(frame["mcp_tools_registered"], json!(["gps"]), "{frame}");

    let (body, call, live) = gps_turn(&gw, &mut ws, &token).await;
    assert!(is_uuid_v4(&call["call_id"]), "{call}");
    assert_eq!(call["tool_name"], "gps", "{call}");
    assert_eq!(call["tool_input"], json!({"acc": "high"}), "{call}");
    let expected = format!("tool result: {GPS_FIX}");
    assert_eq!(reply_text(&body), expected);
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    assert_eq!(live, expected, "the surface gets the final answer live");
    assert_eq!(
        body["sbp"]["step_count"], 1,
        "a tool round is part of one step"
    );

    // Upstream: the first request offers the tool, the second carries the round.
    let sent = gw.fake().requests();
    assert_eq!(sent.len(), 2, "{sent:?}");
    let decl = offered(&sent[0], "surface_gps").expect("surface_gps offered");
    assert_eq!(decl["type"], "function", "{decl}");
    assert_eq!(
        decl["function"]["parameters"],
        json!({"type": "object", "additionalProperties": true}),
        "{decl}"
    );
    let round = sent[1]["messages"].as_array().expect("messages");
    assert_eq!(roles(round), ["user", "assistant", "tool"], "{round:?}");
    let llm_call = &round[1]["tool_calls"][0];
    assert_eq!(llm_call["function"]["name"], "surface_gps", "{llm_call}");
    let args: Value = serde_json::from_str(
        llm_call["function"]["arguments"]
            .as_str()
            .expect("arguments text"),
    )
    .expect("arguments JSON");
    assert_eq!(args, json!({"acc": "high"}));
    let llm_call_id = llm_call["id"].as_str().expect("tool call id");
    assert_eq!(round[2]["tool_call_id"], llm_call_id, "{}", round[2]);
    assert_eq!(round[2]["content"], GPS_FIX, "{}", round[2]);

    // Transcript.
    let stored = gw.messages(&id, &token).await;
    assert_eq!(
        roles(&stored),
        ["user", "assistant", "tool", "assistant"],
        "{stored:?}"
    );
    assert_eq!(stored[1]["tool_calls"][0]["id"], llm_call_id, "{stored:?}");
    assert_eq!(stored[2]["tool_call_id"], llm_call_id, "{stored:?}");
    assert_eq!(stored[2]["content"], GPS_FIX, "{stored:?}");
    assert_eq!(stored[3]["content"], expected.as_str(), "{stored:?}");

    // Snapshots: one pre_action before the call, one post_action naming the TOOL_CALL.
    let (s, list) = gw
        .get(&format!("/v1/sbp/sessions/{id}/snapshots"), &tok(&token))
        .await;
    assert_eq!(s, 200, "{list}");
    let kinds: Vec<&str> = list["snapshots"]
        .as_array()
        .expect("snapshots")
        .iter()
        .filter_map(|x| x["kind"].as_str())
        .collect();
    let count = |k: &str| kinds.iter().filter(|x| **x == k).count();
    assert_eq!(
        (count("pre_action"), count("post_action")),
        (2, 2),
        "turn + tool call each: {kinds:?}"
    );
    let states = snapshot_states(&gw, &id).await;
    let pre = find_state(&states, "pre_action", "tool_call");
    assert_eq!(pre.len(), 1, "{states:?}");
    assert_eq!(pre[0]["tool_call_id"], llm_call_id, "{}", pre[0]);
    assert_eq!(pre[0]["function"], "surface_gps", "{}", pre[0]);
    assert_eq!(pre[0]["target"], json!({"surface": "gps"}), "{}", pre[0]);
    assert_eq!(pre[0]["round"], 0, "{}", pre[0]);
    let post = find_state(&states, "post_action", "tool_result");
    assert_eq!(post.len(), 1, "{states:?}");
    assert_eq!(post[0]["call_id"], call["call_id"], "{}", post[0]);
    assert_eq!(post[0]["tool_call_id"], llm_call_id, "{}", post[0]);
    assert_eq!(post[0]["ok"], true, "{}", post[0]);
    assert_eq!(post[0]["turn_id"], pre[0]["turn_id"], "{}", post[0]);

    assert_eq!(gw.session_view(&id, &token).await["step_count"], 1);
}

/// The brief's wording: the HTTP snapshot list itself shows what each tool snapshot recorded.
#[tokio::test]
async fn snapshot_list_shows_the_tool_call_states() {
    let gw = gateway(|_| {}).await;
    let (id, token, mut ws, _) = attached(&gw, json!({"mcp_tools": ["gps"]})).await;
    let (_, call, _) = gps_turn(&gw, &mut ws, &token).await;
    let (s, list) = gw
        .get(&format!("/v1/sbp/sessions/{id}/snapshots"), &tok(&token))
        .await;
    assert_eq!(s, 200, "{list}");
    let snaps = list["snapshots"].as_array().expect("snapshots");
    assert!(
        snaps
            .iter()
            .any(|x| x["kind"] == "pre_action" && x["state"]["action"] == "tool_call"),
        "no pre_action with state.action tool_call in {list}"
    );
    assert!(
        snaps.iter().any(|x| x["kind"] == "post_action"
            && x["state"]["action"] == "tool_result"
            && x["state"]["call_id"] == call["call_id"]),
        "no post_action with state.action tool_result for {} in {list}",
        call["call_id"]
    );
}

#[tokio::test]
async fn two_calls_run_concurrently_and_pair_with_their_results() {
    let gw = gateway(|_| {}).await;
    let (id, token, mut ws, frame) = attached(&gw, json!({"mcp_tools": ["gps", "camera"]})).await;
    assert_eq!(frame["mcp_tools_registered"], json!(["gps", "camera"]));
    let turn = gw.spawn_post(
        "/v1/chat/completions",
        ask("[[fake:tool=surface_gps]] [[fake:tool=surface_camera]]"),
        &tok(&token),
    );
    // Both calls are out before either is answered: they run at the same time.
    let a = expect_tool_call(&mut ws).await;
    let b = expect_tool_call(&mut ws).await;
    assert!(is_uuid_v4(&a["call_id"]) && is_uuid_v4(&b["call_id"]));
    assert_ne!(a["call_id"], b["call_id"]);
    let (gps, camera) = match (a["tool_name"].as_str(), b["tool_name"].as_str()) {
        (Some("gps"), Some("camera")) => (a, b),
        (Some("camera"), Some("gps")) => (b, a),
        other => panic!("expected one gps and one camera call, got {other:?}"),
    };
    // Answered in the opposite order of the LLM's calls.
    answer(&mut ws, &camera, json!("photo-1.jpg")).await;
    answer(&mut ws, &gps, gps_fix()).await;
    let (live, _) = ws.live_turn().await;
    let (s, _, body) = turn.await.expect("turn task");
    assert_eq!(s, 200, "{body}");
    // The fake answers with the last tool message: the camera's, second in the LLM's order.
    assert_eq!(reply_text(&body), "tool result: photo-1.jpg");
    assert_eq!(live, "tool result: photo-1.jpg");

    let stored = gw.messages(&id, &token).await;
    assert_eq!(
        roles(&stored),
        ["user", "assistant", "tool", "tool", "assistant"],
        "{stored:?}"
    );
    let calls = stored[1]["tool_calls"].as_array().expect("tool_calls");
    let function_of = |call_id: &Value| {
        calls
            .iter()
            .find(|c| c["id"] == *call_id)
            .and_then(|c| c["function"]["name"].as_str())
            .unwrap_or_else(|| panic!("no tool call {call_id} in {calls:?}"))
    };
    let mut pairs: Vec<(&str, &str)> = stored[2..4]
        .iter()
        .map(|m| {
            (
                function_of(&m["tool_call_id"]),
                m["content"].as_str().expect("tool content"),
            )
        })
        .collect();
    pairs.sort();
    assert_eq!(
        pairs,
        [("surface_camera", "photo-1.jpg"), ("surface_gps", GPS_FIX)]
    );
    // The tool messages follow the order of the LLM's calls, not of the answers.
    assert_eq!(stored[2]["tool_call_id"], calls[0]["id"]);
    assert_eq!(stored[3]["tool_call_id"], calls[1]["id"]);

    // Each post_action names the TOOL_CALL that served its function.
    let states = snapshot_states(&gw, &id).await;
    let post = find_state(&states, "post_action", "tool_result");
    assert_eq!(post.len(), 2, "{states:?}");
    for (function, frame) in [("surface_gps", &gps), ("surface_camera", &camera)] {
        assert!(
            post.iter()
                .any(|s| s["function"] == function && s["call_id"] == frame["call_id"]),
            "{function} vs {frame}: {post:?}"
        );
    }
}

#[tokio::test]
async fn unanswered_call_times_out_and_a_late_result_is_ignored() {
    let gw = gateway(|c| c.tool_timeout = Duration::from_millis(300)).await;
    let (id, token, mut ws, _) = attached(&gw, json!({"mcp_tools": ["gps"]})).await;
    let turn = gw.spawn_post(
        "/v1/chat/completions",
        ask("[[fake:tool=surface_gps]]"),
        &tok(&token),
    );
    let call = expect_tool_call(&mut ws).await;
    assert_eq!(call["timeout_ms"], 300, "{call}");
    // The surface stays silent; the turn goes on without it.
    let (live, _) = ws.live_turn().await;
    let (s, _, body) = turn.await.expect("turn task");
    assert_eq!(s, 200, "{body}");
    assert!(reply_text(&body).contains("timeout"), "{body}");
    assert_eq!(live, reply_text(&body));
    let states = snapshot_states(&gw, &id).await;
    let post = find_state(&states, "post_action", "tool_result");
    assert_eq!(post.len(), 1, "{states:?}");
    assert_eq!(
        (&post[0]["ok"], &post[0]["error"]),
        (&json!(false), &json!("timeout")),
        "{}",
        post[0]
    );

    // Too late: ignored, and the connection carries on.
    answer(&mut ws, &call, gps_fix()).await;
    let backend = gw.spawn_post(
        &format!("/v1/sbp/sessions/{id}/tool_calls"),
        json!({"tool_name": "gps", "tool_input": {"n": 2}}),
        &tok(&token),
    );
    let again = expect_tool_call(&mut ws).await;
    assert_ne!(again["call_id"], call["call_id"]);
    assert_eq!(again["tool_input"], json!({"n": 2}), "{again}");
    answer(&mut ws, &again, json!({"fix": 2})).await;
    let (s, _, v) = backend.await.expect("backend call task");
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["result"], json!({"fix": 2}), "{v}");
    assert_eq!(v["call_id"], again["call_id"], "{v}");
}

#[tokio::test]
async fn surface_dropping_mid_call_fails_the_call_at_once_and_the_turn_is_tethered() {
    // Default tool timeout (30 s): the prompt answer must come from the disconnect.
    let gw = gateway(|_| {}).await;
    let (id, token, mut ws, _) = attached(&gw, json!({"mcp_tools": ["gps"]})).await;
    let turn = gw.spawn_post(
        "/v1/chat/completions",
        ask("[[fake:tool=surface_gps]]"),
        &tok(&token),
    );
    expect_tool_call(&mut ws).await;
    let dropped = Instant::now();
    ws.close_abruptly().await;
    let (s, _, body) = tokio::time::timeout(Duration::from_secs(5), turn)
        .await
        .expect("the reply comes well before the 30 s tool timeout")
        .expect("turn task");
    let took = dropped.elapsed();
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_eq!(s, 200, "{body}");
    assert!(reply_text(&body).contains("surface disconnected"), "{body}");

    gw.wait_suspended(&id, &token).await;
    let (mut ws, frame) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(frame["queued_turns"], 1, "{frame}");
    let tethered = ws.recv().await;
    assert_eq!(tethered["type"], "TETHER_TURN", "{tethered}");
    assert!(
        tethered["content"]
            .as_str()
            .is_some_and(|c| c.contains("surface disconnected")),
        "{tethered}"
    );
}

#[tokio::test]
async fn undeclared_tool_goes_back_to_the_client_and_never_to_the_surface() {
    let gw = gateway(|_| {}).await;
    let (_, token, mut ws, _) = attached(&gw, json!({"mcp_tools": ["gps"]})).await;
    let turn = gw.spawn_post(
        "/v1/chat/completions",
        ask("take a picture [[fake:tool=surface_camera]]"),
        &tok(&token),
    );
    // Everything the surface sees up to the end of the turn is the turn itself.
    loop {
        let f = ws.recv().await;
        match f["type"].as_str() {
            Some("TURN_CHUNK") => continue,
            Some("TURN_COMPLETE") => break,
            _ => panic!("the surface got {f} for a tool it never declared"),
        }
    }
    let (s, _, body) = turn.await.expect("turn task");
    assert_eq!(s, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .expect("tool_calls for the client");
    assert_eq!(calls.len(), 1, "{body}");
    assert_eq!(calls[0]["function"]["name"], "surface_camera", "{body}");
    assert_eq!(
        gw.fake().requests().len(),
        1,
        "no second round: the gateway ran nothing"
    );
}

#[tokio::test]
async fn allowlist_limits_what_is_registered_offered_and_callable() {
    let gw = gateway(|c| c.tool_allowlist = Some(vec!["gps".into()])).await;
    let (id, token, mut ws, frame) = attached(&gw, json!({"mcp_tools": ["gps", "contacts"]})).await;
    assert_eq!(frame["mcp_tools_registered"], json!(["gps"]), "{frame}");

    let (s, _, body) = gw.chat(ask("hello"), &tok(&token)).await;
    assert_eq!(s, 200, "{body}");
    ws.live_turn().await;
    let sent = gw.fake().requests();
    assert_eq!(offered_names(&sent[0]), ["surface_gps"], "{}", sent[0]);

    // The LLM asking for the refused tool gets its call back to the client; nothing runs.
    let turn = gw.spawn_post(
        "/v1/chat/completions",
        ask("[[fake:tool=surface_contacts]]"),
        &tok(&token),
    );
    ws.live_turn().await;
    let (s, _, body) = turn.await.expect("turn task");
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls", "{body}");

    let (s, _, v) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/tool_calls"),
            json!({"tool_name": "contacts"}),
            &tok(&token),
        )
        .await;
    assert_eq!((s, code(&v)), (403, "SBP_FORBIDDEN"), "{v}");

    // The next thing the surface gets is this marker: no TOOL_CALL went out before it.
    gw.push(&id, &token, "marker").await;
    let (text, _) = ws.live_turn().await;
    assert_eq!(text, "marker");
}

#[tokio::test]
async fn backend_calls_a_surface_tool_directly() {
    let gw = gateway(|_| {}).await;
    let (id, token) = gw.idle_session().await;
    let path = format!("/v1/sbp/sessions/{id}/tool_calls");

    let (s, _, v) = gw
        .post(&path, json!({"tool_name": "gps"}), &tok(&token))
        .await;
    assert_eq!(
        (s, code(&v)),
        (409, "SBP_SESSION_CONFLICT"),
        "no surface: {v}"
    );
    let (s, _, v) = gw.post(&path, json!({"tool_name": "gps"}), &[]).await;
    assert_eq!((s, code(&v)), (401, "SBP_UNAUTHORIZED"), "{v}");
    let (s, _, v) = gw
        .post(&path, json!({"tool_name": "gps"}), &tok("not-the-token"))
        .await;
    assert_eq!((s, code(&v)), (403, "SBP_FORBIDDEN"), "{v}");

    let (mut ws, _) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"mcp_tools": ["gps", "camera"]}}),
        )
        .await;
    for bad in [
        json!({"tool_input": {}}),
        json!({"tool_name": ""}),
        json!({"tool_name": "gps", "timeout_ms": 0}),
        json!({"tool_name": "gps", "timeout_ms": 300_001}),
        json!({"tool_name": "gps", "timeout_ms": "soon"}),
    ] {
        let (s, _, v) = gw.post(&path, bad.clone(), &tok(&token)).await;
        assert_eq!((s, code(&v)), (400, "SBP_BAD_REQUEST"), "{bad}: {v}");
    }
    let (s, _, v) = gw
        .post(&path, json!({"tool_name": "contacts"}), &tok(&token))
        .await;
    assert_eq!(
        (s, code(&v)),
        (409, "SBP_SESSION_CONFLICT"),
        "undeclared: {v}"
    );

    // Answered.
    let call = gw.spawn_post(
        &path,
        json!({"tool_name": "gps", "tool_input": {"acc": "low"}, "timeout_ms": 5000}),
        &tok(&token),
    );
    let f = expect_tool_call(&mut ws).await;
    assert_eq!(
        (&f["tool_name"], &f["tool_input"], &f["timeout_ms"]),
        (&json!("gps"), &json!({"acc": "low"}), &json!(5000)),
        "{f}"
    );
    assert!(is_uuid_v4(&f["call_id"]), "{f}");
    answer(&mut ws, &f, gps_fix()).await;
    let (s, _, v) = call.await.expect("call task");
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["session_id"], id.as_str(), "{v}");
    assert_eq!(v["call_id"], f["call_id"], "{v}");
    assert_eq!(v["tool_name"], "gps", "{v}");
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["result"], gps_fix(), "{v}");
    assert_eq!(v["error"], Value::Null, "{v}");
    assert!(v["duration_ms"].as_f64().is_some_and(|d| d >= 0.0), "{v}");

    // The tool fails on the surface.
    let call = gw.spawn_post(&path, json!({"tool_name": "camera"}), &tok(&token));
    let f = expect_tool_call(&mut ws).await;
    assert_eq!(f["tool_name"], "camera", "{f}");
    assert_eq!(f["tool_input"], json!({}), "{f}");
    answer_error(&mut ws, &f, "camera busy").await;
    let (s, _, v) = call.await.expect("call task");
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (&v["status"], &v["error"], &v["result"]),
        (&json!("error"), &json!("camera busy"), &Value::Null),
        "{v}"
    );

    // Never answered.
    let call = gw.spawn_post(
        &path,
        json!({"tool_name": "gps", "timeout_ms": 200}),
        &tok(&token),
    );
    let f = expect_tool_call(&mut ws).await;
    assert_eq!(f["timeout_ms"], 200, "{f}");
    let (s, _, v) = call.await.expect("call task");
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (&v["status"], &v["error"]),
        (&json!("timeout"), &json!("timeout")),
        "{v}"
    );
    assert_eq!(v["call_id"], f["call_id"], "{v}");

    // Backend calls are not part of the transcript.
    assert!(gw.messages(&id, &token).await.is_empty());
    assert!(gw.fake().requests().is_empty(), "no LLM was involved");
}

#[tokio::test]
async fn declared_schemas_reach_the_llm_unchanged() {
    let gw = gateway(|_| {}).await;
    let schema = json!({"type": "object", "properties": {"accuracy": {"type": "string"}}});
    let (_, token, mut ws, frame) = attached(
        &gw,
        json!({"device_type": "mobile", "mcp_tool_schemas": [
            {"name": "gps", "description": "Current position", "input_schema": schema}
        ]}),
    )
    .await;
    assert_eq!(frame["mcp_tools_registered"], json!(["gps"]), "{frame}");
    let (s, _, body) = gw.chat(ask("hello"), &tok(&token)).await;
    assert_eq!(s, 200, "{body}");
    ws.live_turn().await;
    let sent = gw.fake().requests();
    assert_eq!(offered_names(&sent[0]), ["surface_gps"], "{}", sent[0]);
    let decl = offered(&sent[0], "surface_gps").expect("surface_gps offered");
    assert_eq!(decl["function"]["parameters"], schema, "{decl}");
    let description = decl["function"]["description"]
        .as_str()
        .expect("description");
    assert!(description.contains("Current position"), "{decl}");
}

#[tokio::test]
async fn sse_caller_sees_only_the_final_answer_of_a_tool_turn() {
    let gw = gateway(|_| {}).await;
    let (_, token, mut ws, _) = attached(&gw, json!({"mcp_tools": ["gps"]})).await;
    let mut request = ask("[[fake:tool=surface_gps]]");
    request["stream"] = json!(true);
    request["stream_options"] = json!({"include_usage": true});
    let turn = gw.spawn_post("/v1/chat/completions", request, &tok(&token));
    let call = expect_tool_call(&mut ws).await;
    answer(&mut ws, &call, gps_fix()).await;
    ws.live_turn().await;
    let (s, headers, body) = turn.await.expect("turn task");
    assert_eq!(s, 200, "{body}");
    assert_eq!(headers["content-type"], "text/event-stream");
    let events = sse_data(body.as_str().expect("an SSE body"));
    assert_eq!(events.last(), Some(&json!("[DONE]")), "{events:?}");
    for e in &events {
        assert!(
            !has_key(e, "tool_calls"),
            "a tool call leaked to the caller: {e}"
        );
    }
    let finishes: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"].as_array())
        .flatten()
        .map(|c| &c["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes, [&json!("stop")], "{events:?}");
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, format!("tool result: {GPS_FIX}"));
    // As OpenAI streams: every chunk has a choice, but the usage chunk, last, with both rounds'
    // usage; the `sbp` block rides on the finish chunk.
    let [.., finish, usage, _done] = events.as_slice() else {
        panic!("too few events: {events:?}");
    };
    for e in &events[..events.len() - 2] {
        assert!(
            e["choices"].as_array().is_some_and(|c| !c.is_empty()),
            "{e}"
        );
    }
    assert_eq!(usage["choices"], json!([]), "{usage}");
    let rounds = gw.fake().requests().len() as u64;
    assert_eq!(rounds, 2);
    assert!(
        usage["usage"]["total_tokens"].as_u64().unwrap_or(0) >= rounds,
        "{usage}"
    );
    assert_eq!(finish["sbp"]["step_count"], 1, "{finish}");
}

#[tokio::test]
async fn export_carries_the_tool_round() {
    let gw = gateway(|_| {}).await;
    let (id, token, mut ws, _) = attached(&gw, json!({"mcp_tools": ["gps"]})).await;
    gps_turn(&gw, &mut ws, &token).await;
    let (s, _, ex) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/export"),
            json!({"include_bundle": true}),
            &tok(&token),
        )
        .await;
    assert_eq!(s, 201, "{ex}");
    let bundled = ex["bundle"]["messages"]
        .as_array()
        .expect("bundle messages");
    let asked = bundled
        .iter()
        .find(|m| m["role"] == "assistant" && m["tool_calls"].is_array())
        .unwrap_or_else(|| panic!("no assistant tool-call message in {bundled:?}"));
    assert_eq!(
        asked["tool_calls"][0]["function"]["name"], "surface_gps",
        "{asked}"
    );
    let tool = bundled
        .iter()
        .find(|m| m["role"] == "tool")
        .unwrap_or_else(|| panic!("no tool message in {bundled:?}"));
    assert_eq!(tool["tool_call_id"], asked["tool_calls"][0]["id"], "{tool}");
    assert_eq!(tool["content"], GPS_FIX, "{tool}");
}

/// A client that resends the conversation as it saw it (without the gateway's tool round) stores
/// only its new message: the transcript does not grow duplicates turn after turn.
#[tokio::test]
async fn a_client_resending_its_history_after_a_tool_turn_stores_nothing_twice() {
    let gw = gateway(|_| {}).await;
    let (id, token, mut ws, _) = attached(&gw, json!({"mcp_tools": ["gps"]})).await;
    let prompt = r#"where am I? [[fake:tool=surface_gps:{"acc":"high"}]]"#;
    let (body, _, _) = gps_turn(&gw, &mut ws, &token).await;
    let answer_text = reply_text(&body).to_owned();
    let resend = json!({"model": "gpt-4o", "messages": [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": answer_text},
        {"role": "user", "content": "thanks"}
    ]});
    let (s, _, body) = gw.chat(resend, &tok(&token)).await;
    assert_eq!(s, 200, "{body}");
    ws.live_turn().await;
    let stored = gw.messages(&id, &token).await;
    assert_eq!(
        roles(&stored),
        [
            "user",
            "assistant",
            "tool",
            "assistant",
            "user",
            "assistant"
        ],
        "{stored:?}"
    );
    // The model saw the whole history once, tool round included.
    let last = gw.fake().requests().pop().expect("request");
    assert_eq!(
        roles(last["messages"].as_array().expect("messages")),
        ["user", "assistant", "tool", "assistant", "user"]
    );
}

/// A reply that calls a client tool and a gateway tool at once goes back with the client's call
/// only (the gateway's is not run), so the client can answer it and the conversation goes on.
#[tokio::test]
async fn a_mixed_reply_keeps_only_the_clients_calls_and_the_session_stays_usable() {
    let gw = gateway(|_| {}).await;
    let (id, token, mut ws, _) = attached(&gw, json!({"mcp_tools": ["gps"]})).await;
    let client_tool = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object"}}});
    let first = json!({"model": "gpt-4o", "tools": [client_tool],
        "messages": [{"role": "user", "content":
            "weather here? [[fake:tool=get_weather:{\"city\":\"Tokyo\"}]] [[fake:tool=surface_gps]]"}]});
    let (s, _, body) = gw.chat(first.clone(), &tok(&token)).await;
    assert_eq!(s, 200, "{body}");
    let message = &body["choices"][0]["message"];
    let calls = message["tool_calls"].as_array().expect("tool calls");
    assert_eq!(calls.len(), 1, "{message}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    // Nothing went to the surface: the next frames are this turn's own completion.
    let f = ws.recv().await;
    assert_ne!(f["type"], "TOOL_CALL", "{f}");

    let mut follow = first;
    let history = follow["messages"].as_array_mut().expect("messages");
    history.push(message.clone());
    history.push(json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}));
    let (s, _, body) = gw.chat(follow, &tok(&token)).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(reply_text(&body), "tool result: sunny");
    let stored = gw.messages(&id, &token).await;
    assert_eq!(
        roles(&stored),
        ["user", "assistant", "tool", "assistant"],
        "{stored:?}"
    );
}

/// A fork taken while a tool round is running copies the session up to its last completed turn,
/// never half a turn.
#[tokio::test]
async fn a_fork_during_a_tool_round_stops_at_the_last_completed_turn() {
    let gw = gateway(|_| {}).await;
    let (id, token, mut ws, _) = attached(&gw, json!({"mcp_tools": ["gps"]})).await;
    gps_turn(&gw, &mut ws, &token).await;
    // A second turn: its tool round completes, then the model is slow to answer (every request
    // of this turn waits 800 ms): fork in that window, after the round's results are recorded.
    let turn = gw.spawn_post(
        "/v1/chat/completions",
        ask(r#"again [[fake:tool=surface_gps]] [[fake:slow=800]]"#),
        &tok(&token),
    );
    let call = expect_tool_call(&mut ws).await;
    answer(&mut ws, &call, gps_fix()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while find_state(
        &snapshot_states(&gw, &id).await,
        "post_action",
        "tool_result",
    )
    .len()
        < 2
    {
        assert!(
            Instant::now() < deadline,
            "the second round's results were recorded"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (s, _, fork) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/fork"),
            json!({"label": "mid-turn"}),
            &tok(&token),
        )
        .await;
    assert_eq!(s, 201, "{fork}");
    let (s, _, _) = turn.await.expect("turn");
    assert_eq!(s, 200);
    let fork_id = fork["session_id"].as_str().expect("fork id").to_owned();
    let fork_token = fork["session_token"]
        .as_str()
        .expect("fork token")
        .to_owned();
    let origin = gw.messages(&id, &token).await;
    assert_eq!(origin.len(), 8, "{origin:?}");
    let copied = gw.messages(&fork_id, &fork_token).await;
    assert_eq!(
        roles(&copied),
        ["user", "assistant", "tool", "assistant"],
        "the first turn whole, nothing of the second: {copied:?}"
    );
}
