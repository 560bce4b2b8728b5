//! Input that could poison a session or exhaust the gateway, refused at the edge before anything is
//! stored: chat messages as OpenAI checks them, request bodies past the JSON and message limits,
//! turns on a full session (and the trimmed fork that continues it), imported bundles out of type
//! or range, and ids in any but the canonical form.

use sbp_gateway::{GatewayConfig, Limits};
use sbp_protocol::bundle;
use serde_json::{Value, json};

use crate::support::{Options, TestGateway, TestGatewayExt, Upstream};

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn tok(token: &str) -> [(&str, &str); 1] {
    [("x-session-token", token)]
}

fn code(v: &Value) -> &str {
    v["error"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("not an error envelope: {v}"))
}

async fn with_limits(limits: Limits) -> TestGateway {
    TestGateway::with(Options {
        config: GatewayConfig {
            limits,
            ..sbp_test_support::config()
        },
        ..Options::default()
    })
    .await
}

/// Every shape OpenAI refuses is refused with 400 naming the field (in the message and as
/// `param`), for a new session and for a session's next turn, and nothing is stored: the session
/// keeps working.
#[tokio::test]
async fn malformed_messages_are_refused_by_field_and_never_stored() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let before = gw.messages(&id, &token).await.len();
    for (message, param) in [
        (json!({"role": "usr", "content": "x"}), "messages[0].role"),
        (json!({"content": "x"}), "messages[0].role"),
        (
            json!({"role": "user", "content": {"a": 1}}),
            "messages[0].content",
        ),
        (json!({"role": "user"}), "messages[0].content"),
        (
            json!({"role": "tool", "content": "x"}),
            "messages[0].tool_call_id",
        ),
        (
            json!({"role": "user", "content": [{"type": "text"}]}),
            "messages[0].content[0].text",
        ),
        (
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!({"role": "user", "content": "x", "name": 7}),
            "messages[0].name",
        ),
    ] {
        for headers in [&tok(&token)[..], &[][..]] {
            let (s, _, v) = gw.chat(json!({"messages": [message]}), headers).await;
            assert_eq!((s, code(&v)), (400, "SBP_BAD_REQUEST"), "{message}: {v}");
            assert_eq!(v["error"]["param"], param, "{v}");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(param)),
                "{v}"
            );
        }
    }
    assert_eq!(gw.messages(&id, &token).await.len(), before);
    let (s, _, v) = gw
        .chat(json!({"messages": [user("still fine")]}), &tok(&token))
        .await;
    assert_eq!(s, 200, "{v}");
    let (s, m) = gw.get("/metrics", &[]).await;
    assert_eq!(s, 200);
    let text = m.as_str().expect("metrics text");
    assert!(
        text.contains("sbp_sessions_created_total 1"),
        "no session was created by a refused request: {text}"
    );
}

/// A pushed turn is stored as a chat message: a `tool` one could never be valid on its own.
#[tokio::test]
async fn pushed_turns_that_would_poison_the_transcript_are_refused() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let path = format!("/v1/sbp/sessions/{id}/turns");
    for (body, param) in [
        (json!({"role": "tool", "content": "x"}), "role"),
        (json!({"role": "usr", "content": "x"}), "role"),
        (json!({"content": {"a": 1}}), "content"),
    ] {
        let (s, _, v) = gw.post(&path, body.clone(), &tok(&token)).await;
        assert_eq!((s, code(&v)), (400, "SBP_BAD_REQUEST"), "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    assert_eq!(gw.messages(&id, &token).await.len(), 2);
}

/// The body of 240,000 tiny messages that took ~1 GB to parse and store is refused before it is
/// parsed, at the default limits (it fits the default body limit).
#[tokio::test]
async fn a_body_of_countless_tiny_messages_is_refused_before_parsing() {
    let gw = TestGateway::start().await;
    let body = json!({"messages": vec![user("xxxx"); 240_000]});
    let (s, _, v) = gw.chat(body, &[]).await;
    assert_eq!((s, code(&v)), (413, "SBP_PAYLOAD_TOO_LARGE"), "{v}");
    assert_eq!(v["error"]["detail"]["limit"], "max_json_objects", "{v}");
    let (s, _, v) = gw
        .chat(json!({"messages": vec![user("x"); 10_001]}), &[])
        .await;
    assert_eq!((s, code(&v)), (413, "SBP_PAYLOAD_TOO_LARGE"), "{v}");
    assert_eq!(v["error"]["detail"]["limit"], "max_request_messages", "{v}");
    assert_eq!(v["error"]["detail"]["max"], 10_000, "{v}");
}

/// Each limit refuses with 413 naming it; within them the same requests pass.
#[tokio::test]
async fn each_request_limit_is_named_when_exceeded() {
    let limits = Limits {
        max_request_messages: 3,
        max_message_bytes: 200,
        max_json_depth: 10,
        max_json_objects: 20,
        max_json_values: 200,
        ..Limits::default()
    };
    let gw = with_limits(limits).await;
    let nested = |depth: usize| {
        let mut v = json!(1);
        for _ in 0..depth {
            v = json!([v]);
        }
        v
    };
    let deep = |levels: usize| {
        let mut m = user("x");
        m["x_vendor"] = nested(levels);
        json!({"messages": [m]})
    };
    let within = [
        json!({"messages": [user("a"), user("b"), user("c")]}),
        json!({"messages": [user(&"x".repeat(150))]}),
        deep(7),
    ];
    for body in within {
        let (s, _, v) = gw.chat(body.clone(), &[]).await;
        assert_eq!(s, 200, "{body}: {v}");
    }
    let mut many_values = user("x");
    many_values["x_vendor"] = json!(vec![0; 300]);
    let mut many_objects = user("x");
    many_objects["x_vendor"] = json!(vec![json!({}); 25]);
    for (body, limit) in [
        (
            json!({"messages": [user("a"), user("b"), user("c"), user("d")]}),
            "max_request_messages",
        ),
        (
            json!({"messages": [user("a"), user(&"x".repeat(250))]}),
            "max_message_bytes",
        ),
        (deep(12), "max_json_depth"),
        (json!({"messages": [many_objects]}), "max_json_objects"),
        (json!({"messages": [many_values]}), "max_json_values"),
    ] {
        let (s, _, v) = gw.chat(body, &[]).await;
        assert_eq!(
            (s, code(&v)),
            (413, "SBP_PAYLOAD_TOO_LARGE"),
            "{limit}: {v}"
        );
        assert_eq!(v["error"]["detail"]["limit"], limit, "{v}");
    }
    // Depth is held on every JSON body, not only completions.
    let (s, _, v) = gw
        .post("/v1/sessions", json!({"metadata": {"a": nested(12)}}), &[])
        .await;
    assert_eq!((s, code(&v)), (413, "SBP_PAYLOAD_TOO_LARGE"), "{v}");
    // Pushes are held to the size of a message.
    let (id, token) = gw.session().await;
    let (s, _, v) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/turns"),
            json!({"content": "y".repeat(300)}),
            &tok(&token),
        )
        .await;
    assert_eq!((s, code(&v)), (413, "SBP_PAYLOAD_TOO_LARGE"), "{v}");
}

/// A session at its message limit refuses turns and pushes with 422 SBP_SESSION_FULL naming the
/// limit, stores nothing of them, and continues in a fork that keeps its last messages.
#[tokio::test]
async fn a_full_session_refuses_turns_and_continues_in_a_trimmed_fork() {
    let gw = with_limits(Limits {
        max_session_messages: 7,
        ..Limits::default()
    })
    .await;
    let (id, token) = gw.idle_session().await;
    let turn = |text: &str| json!({"messages": [user(text)]});
    let (s, _, v) = gw
        .chat(
            json!({"messages": [{"role": "system", "content": "Be brief."}, user("one")]}),
            &tok(&token),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    for text in ["two", "three"] {
        let (s, _, v) = gw.chat(turn(text), &tok(&token)).await;
        assert_eq!(s, 200, "{v}");
    }
    assert_eq!(gw.messages(&id, &token).await.len(), 7);

    let (s, _, v) = gw.chat(turn("four"), &tok(&token)).await;
    assert_eq!((s, code(&v)), (422, "SBP_SESSION_FULL"), "{v}");
    let detail = &v["error"]["detail"];
    assert_eq!(
        (detail["limit"].as_str(), detail["max"].as_u64()),
        (Some("max_session_messages"), Some(7)),
        "{v}"
    );
    assert_eq!(detail["session_id"], id.as_str());
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("keep_last")),
        "the error says how to continue: {v}"
    );
    let (s, _, v) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/turns"),
            json!({"content": "pushed"}),
            &tok(&token),
        )
        .await;
    assert_eq!((s, code(&v)), (422, "SBP_SESSION_FULL"), "{v}");
    assert_eq!(gw.messages(&id, &token).await.len(), 7);

    let (s, _, v) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/fork"),
            json!({"keep_last": 2}),
            &tok(&token),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let fork = v["session_id"].as_str().expect("fork id").to_owned();
    let fork_token = v["session_token"].as_str().expect("fork token").to_owned();
    let kept = gw.messages(&fork, &fork_token).await;
    let texts: Vec<&str> = kept
        .iter()
        .map(|m| m["content"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        texts[0], "Be brief.",
        "the instructions are kept: {texts:?}"
    );
    assert_eq!(&texts[1..], ["three", "Echo: three"]);
    let (s, _, v) = gw.chat(turn("four"), &tok(&fork_token)).await;
    assert_eq!(s, 200, "the fork takes turns: {v}");
    for bad in [json!({"keep_last": 0}), json!({"keep_last": "2"})] {
        let (s, _, v) = gw
            .post(&format!("/v1/sbp/sessions/{id}/fork"), bad, &tok(&token))
            .await;
        assert_eq!((s, code(&v)), (400, "SBP_BAD_REQUEST"), "{v}");
        assert_eq!(v["error"]["param"], "keep_last");
    }
}

/// The byte limit counts the transcript as stored, across turns and pushes.
#[tokio::test]
async fn the_session_byte_limit_counts_what_is_stored() {
    let gw = with_limits(Limits {
        max_session_bytes: 600,
        ..Limits::default()
    })
    .await;
    let (id, token) = gw.session().await;
    let path = format!("/v1/sbp/sessions/{id}/turns");
    let mut stored = gw.messages(&id, &token).await.len();
    loop {
        let (s, _, v) = gw
            .post(&path, json!({"content": "x".repeat(100)}), &tok(&token))
            .await;
        if s != 201 {
            assert_eq!((s, code(&v)), (422, "SBP_SESSION_FULL"), "{v}");
            assert_eq!(v["error"]["detail"]["limit"], "max_session_bytes", "{v}");
            break;
        }
        stored += 1;
        assert!(stored < 10, "the byte limit never applied");
    }
    // About 85 bytes for the first turn, 134 per push: three pushes fit, the fourth does not.
    assert_eq!(gw.messages(&id, &token).await.len(), stored);
    assert_eq!(
        stored, 5,
        "the pushes that fit were stored, the refused one was not"
    );
    // A turn is measured the same way: a long one is refused, a short one still fits.
    let (s, _, v) = gw
        .chat(json!({"messages": [user(&"y".repeat(100))]}), &tok(&token))
        .await;
    assert_eq!((s, code(&v)), (422, "SBP_SESSION_FULL"), "{v}");
    let (s, _, v) = gw
        .chat(json!({"messages": [user("ok")]}), &tok(&token))
        .await;
    assert_eq!(s, 200, "{v}");
}

fn idle_sessions(metrics: &str) -> &str {
    metrics
        .lines()
        .find(|l| l.starts_with("sbp_sessions{status=\"idle\"}"))
        .unwrap_or("none")
}

/// A bundle is checked by type and range before anything is written: counts beyond i64 (once a
/// 500) and up to it (once accepted, and then every turn of the session failed), ids that are
/// not UUIDs, timestamps that do not parse and messages a strict upstream refuses are each 422
/// SBP_BUNDLE_INVALID naming the path, and no session is created.
#[tokio::test]
async fn bundles_out_of_type_or_range_are_refused_before_anything_is_written() {
    let gw = TestGateway::with(Options {
        upstream: Upstream::Echo,
        ..Options::default()
    })
    .await;
    let (id, token) = gw.session().await;
    let (s, _, ex) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/export"),
            json!({"include_bundle": true}),
            &tok(&token),
        )
        .await;
    assert_eq!(s, 201, "{ex}");
    let sealed = ex["bundle"].clone();
    let (_, before) = gw.get("/metrics", &[]).await;
    let before = idle_sessions(before.as_str().expect("text")).to_owned();

    let edit = |path: &[&str], value: Value| {
        let mut b = sealed.clone();
        let mut at = &mut b;
        for key in &path[..path.len() - 1] {
            at = match key.parse::<usize>() {
                Ok(i) => &mut at[i],
                Err(_) => &mut at[*key],
            };
        }
        at[path[path.len() - 1]] = value;
        let mut map = b.as_object().expect("object").clone();
        bundle::seal(&mut map);
        Value::Object(map)
    };
    for (bundle, path) in [
        (
            edit(
                &["session", "step_count"],
                json!(9_223_372_036_854_775_808u64),
            ),
            "session.step_count",
        ),
        (
            edit(
                &["session", "step_count"],
                json!(9_223_372_036_854_775_807u64),
            ),
            "session.step_count",
        ),
        (
            edit(&["session", "step_count"], json!(-1)),
            "session.step_count",
        ),
        (edit(&["session", "id"], json!("not-a-uuid")), "session.id"),
        (
            edit(&["metadata", "export_id"], json!(42)),
            "metadata.export_id",
        ),
        (edit(&["exported_at"], json!("yesterday")), "exported_at"),
        (
            edit(
                &["messages", "0", "created_at"],
                json!("2026-02-30T00:00:00Z"),
            ),
            "messages[0].created_at",
        ),
        (
            edit(&["messages", "0", "role"], json!("usr")),
            "messages[0].role",
        ),
        (
            edit(&["messages", "1", "content"], json!({"a": 1})),
            "messages[1].content",
        ),
        (
            edit(
                &["state_snapshot"],
                json!({"kind": "checkpoint", "step_count": 9_223_372_036_854_775_807u64}),
            ),
            "state_snapshot.step_count",
        ),
    ] {
        let (s, _, v) = gw
            .post("/v1/sbp/sessions/import", json!({"bundle": bundle}), &[])
            .await;
        assert_eq!((s, code(&v)), (422, "SBP_BUNDLE_INVALID"), "{path}: {v}");
        assert_eq!(v["error"]["detail"]["path"], path, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(path)),
            "{v}"
        );
    }
    let (_, after) = gw.get("/metrics", &[]).await;
    assert_eq!(idle_sessions(after.as_str().expect("text")), before);

    // The largest count accepted leaves room: the imported session takes turns.
    let (s, _, v) = gw
        .post(
            "/v1/sbp/sessions/import",
            json!({"bundle": edit(&["session", "step_count"], json!(bundle::MAX_COUNT))}),
            &[],
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let new_token = v["session_token"].as_str().expect("token").to_owned();
    let (s, _, v) = gw
        .chat(json!({"messages": [user("go on")]}), &tok(&new_token))
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["sbp"]["step_count"], bundle::MAX_COUNT + 1);
}

/// One spelling of an id: upper case, braces, `urn:uuid:` and no hyphens are refused alike on
/// every route (422 SBP_INVALID_UUID over HTTP, SESSION_NOT_FOUND over the WebSocket), never
/// aliases of the session.
#[tokio::test]
async fn only_the_canonical_id_names_a_session() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let uuid = uuid::Uuid::parse_str(&id).expect("uuid");
    let aliases = [
        id.to_uppercase(),
        format!("{{{id}}}"),
        format!("urn:uuid:{id}"),
        uuid.simple().to_string(),
    ];
    let (s, v) = gw.get(&format!("/v1/sessions/{id}"), &tok(&token)).await;
    assert_eq!(s, 200, "{v}");
    for alias in &aliases {
        for path in [
            format!("/v1/sessions/{alias}"),
            format!("/v1/sbp/sessions/{alias}/messages"),
            format!("/v1/sbp/sessions/{alias}/lineage"),
        ] {
            let (s, v) = gw.get(&path, &tok(&token)).await;
            assert_eq!((s, code(&v)), (422, "SBP_INVALID_UUID"), "{path}: {v}");
        }
        let (s, _, v) = gw
            .post(
                &format!("/v1/sbp/sessions/{alias}/turns"),
                json!({"content": "x"}),
                &tok(&token),
            )
            .await;
        assert_eq!((s, code(&v)), (422, "SBP_INVALID_UUID"), "{v}");
        let (s, _, v) = gw
            .chat(
                json!({"messages": [user("x")], "sbp": {"session_id": alias}}),
                &tok(&token),
            )
            .await;
        assert_eq!((s, code(&v)), (422, "SBP_INVALID_UUID"), "{v}");

        let mut ws = gw.ws(alias).await;
        ws.send(json!({"type": "ATTACH_SESSION", "session_id": alias, "session_token": token}))
            .await;
        ws.expect_error_close("SESSION_NOT_FOUND", 4004).await;
    }
    assert_eq!(gw.messages(&id, &token).await.len(), 2);
}
