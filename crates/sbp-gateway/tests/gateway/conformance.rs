//! Runs the public conformance suite's vector files (read from ../shared/sbp-spec when present, never
//! copied into the project) against the gateway, for the levels it implements: L1, L2, L3, the L4
//! vectors and L5. A vector's `inject_server_frame` (a TOOL_CALL the suite makes the server send)
//! is produced through the backend tool-call endpoint; the gateway picks its own UUID `call_id`, so
//! the vector's literal reply (its own `call_id`) must be discarded silently and the same reply
//! with the real `call_id` must reach the caller.

use std::collections::HashMap;
use std::path::PathBuf;

use sbp_gateway::GatewayConfig;
use serde_json::Value;

use crate::support::{Event, Options, TestGateway, Upstream};

fn vectors_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/sbp-spec/conformance-vectors");
    dir.is_dir().then_some(dir)
}

/// Replaces `${name}` with extracted values, recursively.
fn subst(v: &Value, vars: &HashMap<String, String>) -> Value {
    match v {
        Value::String(s) => {
            let mut out = s.clone();
            for (k, val) in vars {
                out = out.replace(&format!("${{{k}}}"), val);
            }
            Value::String(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| subst(x, vars)).collect()),
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, x)| (k.clone(), subst(x, vars))).collect())
        }
        other => other.clone(),
    }
}

/// `$.a.b` or `a.b` into the body.
fn path<'a>(body: &'a Value, p: &str) -> Option<&'a Value> {
    p.trim_start_matches("$.")
        .split('.')
        .try_fold(body, |v, k| v.get(k))
}

/// Checks one `body_contains` expectation: a literal, or a matcher object.
fn check(name: &str, actual: Option<&Value>, expected: &Value) {
    let is_matcher = expected.as_object().is_some_and(|o| {
        o.keys()
            .all(|k| ["type", "format", "pattern", "not_equal", "min"].contains(&k.as_str()))
    });
    if !is_matcher {
        assert_eq!(actual, Some(expected), "{name}");
        return;
    }
    let actual = actual.unwrap_or_else(|| panic!("{name}: missing"));
    let m = expected.as_object().expect("matcher");
    match m.get("type").and_then(Value::as_str) {
        Some("string") => assert!(actual.is_string(), "{name}: {actual} is not a string"),
        Some("number") => assert!(actual.is_number(), "{name}: {actual} is not a number"),
        _ => {}
    }
    if m.get("format").and_then(Value::as_str) == Some("uuid") {
        assert!(
            actual
                .as_str()
                .is_some_and(|s| uuid::Uuid::parse_str(s).is_ok()),
            "{name}: {actual} is not a UUID"
        );
    }
    if let Some(ne) = m.get("not_equal") {
        assert_ne!(actual, ne, "{name}");
    }
    if let Some(min) = m.get("min").and_then(Value::as_f64) {
        assert!(
            actual.as_f64().is_some_and(|a| a >= min),
            "{name}: {actual} < {min}"
        );
    }
}

async fn http_step(gw: &TestGateway, step: &Value, vars: &mut HashMap<String, String>) {
    let req = subst(&step["request"], vars);
    let method = req["method"].as_str().expect("method");
    let url = format!("{}{}", gw.url, req["path"].as_str().expect("path"));
    let mut r = gw.http.request(method.parse().expect("method"), url);
    if let Some(h) = req["headers"].as_object() {
        for (k, v) in h {
            r = r.header(k.as_str(), v.as_str().unwrap_or(""));
        }
    }
    if !req["body"].is_null() {
        r = r.json(&req["body"]);
    }
    let (status, headers, body) = crate::support::response(r.send().await.expect("sent")).await;
    let expect = subst(&step["expect"], vars);
    let id = step["id"].as_str().unwrap_or("?");
    if let Some(s) = expect["status"].as_u64() {
        assert_eq!(u64::from(status), s, "step {id}: {body}");
    }
    if let Some(one_of) = expect["status_oneof"].as_array() {
        assert!(
            one_of.iter().any(|s| s.as_u64() == Some(u64::from(status))),
            "step {id}: {status}"
        );
        if status == 200 {
            // The model may be rerouted only if `model_routed_to` says so.
            assert!(
                body["sbp"]["model_routed_to"].is_string(),
                "step {id}: {body}"
            );
        }
    }
    for h in expect["headers_include"].as_array().into_iter().flatten() {
        assert!(
            headers.contains_key(h.as_str().expect("header")),
            "step {id}: missing header {h}"
        );
    }
    if let Some(c) = expect["body_contains"].as_object() {
        for (k, v) in c {
            check(&format!("step {id} {k}"), path(&body, k), v);
        }
    }
    for k in expect["body_excludes"].as_array().into_iter().flatten() {
        assert!(
            path(&body, k.as_str().expect("path")).is_none(),
            "step {id}: {k} present"
        );
    }
    if let Some(keys) = expect["upstream_body_excludes"].as_array() {
        let sent = gw.fake().requests();
        let last = sent.last().expect("an upstream request");
        for k in keys {
            assert!(
                last.get(k.as_str().expect("key")).is_none(),
                "step {id}: {k} forwarded upstream"
            );
        }
    }
    for (name, src) in step["extract"].as_object().into_iter().flatten() {
        let src = src.as_str().expect("source");
        let value = match src.strip_prefix("headers.") {
            Some(h) => headers
                .get(h)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
            None => path(&body, src).and_then(Value::as_str).map(str::to_owned),
        };
        vars.insert(
            name.clone(),
            value.unwrap_or_else(|| panic!("step {id}: cannot extract {src}")),
        );
    }
}

async fn ws_step(
    gw: &TestGateway,
    step: &Value,
    vars: &mut HashMap<String, String>,
) -> crate::support::Ws {
    let step = subst(step, vars);
    let id = step["id"].as_str().unwrap_or("?");
    let target = step["connect"].as_str().expect("connect");
    let (stream, _) = tokio_tungstenite::connect_async(format!("{}{target}", gw.ws_base))
        .await
        .expect("connect");
    let mut ws = crate::support::Ws { stream };
    ws.send(step["send"].clone()).await;
    let mut expected: Vec<Value> = step["expect_receive_sequence"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if !step["expect_receive"].is_null() {
        expected.push(step["expect_receive"].clone());
    }
    for want in expected {
        let got = match ws.next_event().await {
            Event::Frame(v) => v,
            Event::Closed(c) => panic!("step {id}: closed ({c:?}) before {want}"),
        };
        for (k, v) in want.as_object().expect("frame") {
            assert_eq!(got.get(k), Some(v), "step {id}: field {k} of {got}");
        }
    }
    if let Some(code) = step["expect_close_code"].as_u64() {
        ws.expect_close(code as u16).await;
    }
    ws
}

/// `websocket_continue` with `inject_server_frame`: the TOOL_CALL comes from the backend endpoint.
async fn tool_call_step(
    gw: &TestGateway,
    ws: &mut crate::support::Ws,
    step: &Value,
    vars: &HashMap<String, String>,
) {
    let step = subst(step, vars);
    let inject = &step["inject_server_frame"];
    assert_eq!(
        inject["type"], "TOOL_CALL",
        "only TOOL_CALL can be injected"
    );
    let session = vars
        .get("session_id")
        .expect("session_id extracted")
        .clone();
    let token = vars.get("session_token").cloned().unwrap_or_default();
    let http = gw.http.clone();
    let url = format!("{}/v1/sbp/sessions/{session}/tool_calls", gw.url);
    let body = serde_json::json!({
        "tool_name": inject["tool_name"],
        "tool_input": inject["tool_input"],
        "timeout_ms": 10_000,
    });
    let call = tokio::spawn(async move {
        let resp = http
            .post(url)
            .header("x-session-token", token)
            .json(&body)
            .send()
            .await
            .expect("tool call request");
        crate::support::response(resp).await
    });
    let got = ws.recv().await;
    assert_eq!(got["type"], "TOOL_CALL", "{got}");
    assert_eq!(got["tool_name"], inject["tool_name"]);
    assert_eq!(got["tool_input"], inject["tool_input"]);
    let call_id = got["call_id"].as_str().expect("call_id").to_owned();
    assert!(
        uuid::Uuid::parse_str(&call_id).is_ok(),
        "call_id {call_id} is a UUID"
    );
    // The vector's literal reply names a call this gateway never made: discarded silently.
    let reply = step["surface_replies"].clone();
    ws.send(reply.clone()).await;
    let mut matching = reply.clone();
    matching["call_id"] = Value::String(call_id.clone());
    ws.send(matching).await;
    let (status, _, answer) = call.await.expect("call task");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["status"], "ok", "{answer}");
    assert_eq!(answer["call_id"], call_id.as_str());
    assert_eq!(answer["result"], reply["result"]);
}

async fn run_vector(file: &PathBuf) {
    let vector: Value =
        serde_json::from_str(&std::fs::read_to_string(file).expect("read")).expect("json");
    let config = GatewayConfig {
        sbp_version: "0.9".into(),
        enable_test_hooks: true,
        insecure_no_session_auth: true,
        secret: vec![9; 32],
        ..GatewayConfig::default()
    };
    let gw = TestGateway::with(Options {
        config,
        upstream: Upstream::Fake,
        ..Options::default()
    })
    .await;
    let mut vars = HashMap::new();
    let steps = match vector["steps"].as_array() {
        Some(s) => s.clone(),
        None => vec![vector.clone()],
    };
    let mut socket = None;
    for step in &steps {
        match step["protocol"].as_str() {
            Some("websocket") => socket = Some(ws_step(&gw, step, &mut vars).await),
            Some("websocket_continue") => {
                let ws = socket.as_mut().expect("a websocket step came first");
                tool_call_step(&gw, ws, step, &vars).await;
            }
            _ => http_step(&gw, step, &mut vars).await,
        }
    }
}

#[tokio::test]
async fn public_conformance_vectors_pass() {
    let Some(dir) = vectors_dir() else {
        eprintln!("conformance vectors not found beside the checkout; nothing to run");
        return;
    };
    let files = [
        "L1-stateful-proxy/01-basic-completion.json",
        "L1-stateful-proxy/02-model-agnostic.json",
        "L1-stateful-proxy/03-sbp-namespace-not-forwarded.json",
        "L2-resume/01-suspended-returns-202.json",
        "L2-resume/02-force-new-session.json",
        "L3-roaming/01-export-import.json",
        "L3-roaming/02-single-use-token.json",
        "L3-roaming/03-tampered-token-rejected.json",
        "L3-roaming/04-handoff.json",
        "L3-roaming/05-fork.json",
        "L4-surfaces/01-attach-session-handshake.json",
        "L4-surfaces/02-attach-first-frame-required.json",
        "L4-surfaces/03-unknown-surface-fields-tolerated.json",
        "L5-mcp-bridge/01-tether-drain.json",
        "L5-mcp-bridge/02-tool-call-roundtrip.json",
    ];
    for f in files {
        let path = dir.join(f);
        assert!(path.is_file(), "vector {f} is missing");
        run_vector(&path).await;
    }
}
