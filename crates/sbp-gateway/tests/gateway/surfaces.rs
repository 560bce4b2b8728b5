//! L4: the same stored reply rendered for each surface — Markdown kept for a desktop, spoken prose
//! for a voice assistant, a short plain reply within the token budget for a watch — live (streamed
//! through the adapter), drained from the tether to a different device, and rewritten by a
//! Contextual Translation Pipeline pass streamed as TURN_CHUNK frames.

use sbp_adapt::{Profile, adapt, estimate_tokens};
use sbp_gateway::{CtpRule, GatewayConfig};
use sbp_protocol::SurfaceContext;
use serde_json::{Value, json};

use crate::support::{Options, TestGateway, TestGatewayExt, Upstream};

/// A reply using everything a plain surface cannot show.
const REPLY: &str = "# Weather today\n\nIt will be **sunny** in Tokyo. Details:\n\n- Morning: 18 degrees\n- Afternoon: 24 degrees\n\n| Time | Temp |\n|---|---|\n| 9:00 | 18 |\n| 15:00 | 24 |\n\nSee [the forecast](https://example.com/tokyo) for more. Have a good day and enjoy the sun while it lasts, because rain comes tomorrow evening.";

fn scripted(reply: &str, chunks: usize) -> String {
    format!("[[fake:reply={reply}]] [[fake:chunks={chunks}]]")
}

async fn fake_gateway(config: GatewayConfig) -> TestGateway {
    TestGateway::with(Options {
        upstream: Upstream::Fake,
        config: GatewayConfig {
            secret: vec![7u8; 32],
            ..config
        },
        ..Options::default()
    })
    .await
}

/// One completion on the session; returns the stored reply text.
async fn chat_text(gw: &TestGateway, token: &str, prompt: &str) -> String {
    let (status, _, body) = gw
        .chat(
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": prompt}]}),
            &[("x-session-token", token)],
        )
        .await;
    assert_eq!(status, 200, "{body}");
    body["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_owned()
}

async fn last_stored_reply(gw: &TestGateway, id: &str, token: &str) -> String {
    let messages = gw.messages(id, token).await;
    let last = messages.last().expect("a message");
    last["content"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| {
            last["body"]["content"]
                .as_str()
                .expect("stored content")
                .to_owned()
        })
}

fn profile(ctx: Value) -> Profile {
    Profile::for_surface(&SurfaceContext::from_value(&ctx))
}

#[tokio::test]
async fn one_reply_rendered_for_desktop_voice_and_watch() {
    let gw = fake_gateway(GatewayConfig::default()).await;
    let surfaces = [
        json!({"device_type": "desktop", "ui_capabilities": ["markdown", "tables", "streaming"]}),
        json!({"device_type": "voice"}),
        json!({"device_type": "iot", "max_output_tokens": 30}),
    ];
    let mut got = Vec::new();
    for ctx in &surfaces {
        let (id, token) = gw.session().await;
        let (mut ws, attached) = gw
            .attach(&id, &token, json!({"surface_context": ctx}))
            .await;
        assert_eq!(attached["surface_context"], *ctx, "context echoed");
        let stored = chat_text(&gw, &token, &scripted(REPLY, 9)).await;
        assert_eq!(stored, REPLY, "the HTTP caller gets the reply as written");
        let (text, complete) = ws.live_turn().await;
        assert_eq!(complete["type"], "TURN_COMPLETE");
        assert_eq!(
            last_stored_reply(&gw, &id, &token).await,
            REPLY,
            "the transcript keeps the original"
        );
        // Streamed in pieces, the surface's text is the whole-text adaptation exactly.
        assert_eq!(text, adapt(&profile(ctx.clone()), REPLY), "{ctx}");
        got.push(text);
    }

    let [desktop, voice, watch] = [&got[0], &got[1], &got[2]];
    assert_eq!(
        desktop, REPLY,
        "a Markdown desktop gets the reply untouched"
    );

    for marker in ["#", "**", "|", "- ", "\n", "https://"] {
        assert!(
            !voice.contains(marker),
            "voice output has {marker:?}: {voice}"
        );
    }
    assert!(voice.contains("Weather today."), "{voice}");
    assert!(voice.contains("Morning: 18 degrees."), "{voice}");
    assert!(voice.contains("the forecast"), "{voice}");

    assert!(!watch.contains("**") && !watch.contains('#'), "{watch}");
    let body = watch.trim_end_matches('…').trim_end();
    assert!(
        estimate_tokens(body) <= 30,
        "within the surface's budget: {watch}"
    );
    assert!(watch.ends_with('…'), "a cut reply says so: {watch}");
    assert!(watch.len() < REPLY.len() / 2, "{watch}");

    // The watch's request to the model was told about the surface.
    let requests = gw.fake().requests();
    let watch_request = requests.last().expect("requests recorded");
    assert_eq!(watch_request["max_tokens"], 30, "{watch_request}");
    let note = &watch_request["messages"][0];
    assert_eq!(note["role"], "system", "{watch_request}");
    // The note leads the stored transcript (the first turn), then the new message.
    let roles: Vec<&str> = watch_request["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["role"].as_str())
        .collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "user"],
        "{watch_request}"
    );
    assert!(
        note["content"]
            .as_str()
            .is_some_and(|c| c.contains("Markdown")),
        "{note}"
    );
    // Each surface made two requests: its session's first turn, then the scripted one.
    assert_eq!(requests.len(), 6);
    let desktop_request = &requests[1];
    assert!(
        desktop_request["messages"]
            .as_array()
            .is_some_and(|m| m.iter().all(|m| m["role"] != "system")),
        "a surface needing no adaptation adds no note: {desktop_request}"
    );
    assert!(desktop_request.get("max_tokens").is_none());
}

#[tokio::test]
async fn a_smaller_client_max_tokens_is_kept() {
    let gw = fake_gateway(GatewayConfig::default()).await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw
        .attach(
            &id,
            &token,
            json!({"surface": {"device_type": "mobile", "max_output_tokens": 500}}),
        )
        .await;
    let (status, _, body) = gw
        .chat(
            json!({"model": "gpt-4o", "max_completion_tokens": 50,
                   "messages": [{"role": "user", "content": "short please"}]}),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(status, 200, "{body}");
    ws.live_turn().await;
    let request = gw.fake().requests().pop().expect("request");
    assert_eq!(request["max_completion_tokens"], 50, "{request}");
    assert!(request.get("max_tokens").is_none(), "{request}");
}

#[tokio::test]
async fn tethered_turn_is_adapted_for_the_device_that_drains_it() {
    let gw = fake_gateway(GatewayConfig::default()).await;
    let (id, token) = gw.session().await;
    // A phone attaches (the tether is on from now), then goes away.
    let (ws, _) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"device_type": "desktop"}}),
        )
        .await;
    ws.close_abruptly().await;
    gw.wait_suspended(&id, &token).await;
    gw.push(&id, &token, REPLY).await;

    // A voice assistant attaches and drains it, spoken.
    let (mut voice, attached) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"device_type": "voice"}}),
        )
        .await;
    assert_eq!(attached["queued_turns"], 1);
    let turn = voice.recv().await;
    assert_eq!(turn["type"], "TETHER_TURN", "{turn}");
    let spoken = turn["content"].as_str().expect("content");
    assert_eq!(
        spoken,
        adapt(&profile(json!({"device_type": "voice"})), REPLY)
    );
    assert!(!spoken.contains('\n') && !spoken.contains("**"), "{spoken}");
    assert_eq!(last_stored_reply(&gw, &id, &token).await, REPLY);
}

#[tokio::test]
async fn unknown_device_and_null_surface_get_the_reply_untouched() {
    let gw = fake_gateway(GatewayConfig::default()).await;
    for (extra, device) in [
        (json!({"surface": null}), "unknown"),
        (
            json!({"surface_context": {"device_type": "hologram-9000", "brand_new_field": [1, 2]}}),
            "hologram-9000",
        ),
    ] {
        let (id, token) = gw.session().await;
        let (mut ws, attached) = gw.attach(&id, &token, extra.clone()).await;
        assert_eq!(attached["device_type"], device, "{attached}");
        chat_text(&gw, &token, &scripted(REPLY, 4)).await;
        let (text, _) = ws.live_turn().await;
        assert_eq!(text, REPLY, "{extra}");
    }
}

#[tokio::test]
async fn ctp_rewrites_for_the_watch_streamed_as_chunks() {
    let config = GatewayConfig {
        ctp: vec![CtpRule {
            device_type: "iot".into(),
            model: "ctp-rewriter".into(),
            prompt: None,
        }],
        ..GatewayConfig::default()
    };
    let gw = fake_gateway(config).await;
    let (id, token) = gw.session().await;
    let ctx = json!({"device_type": "iot", "max_output_tokens": 40});
    let (mut ws, _) = gw
        .attach(&id, &token, json!({"surface_context": ctx}))
        .await;
    let original = "The **meeting** moved to 3 pm. Bring the slides. Room 4 is booked.";
    chat_text(&gw, &token, &scripted(original, 3)).await;

    let mut chunks = Vec::new();
    let complete = loop {
        let f = ws.recv().await;
        match f["type"].as_str() {
            Some("TURN_CHUNK") => chunks.push(f["delta"].as_str().expect("delta").to_owned()),
            Some("TURN_COMPLETE") => break f,
            _ => panic!("unexpected frame {f}"),
        }
    };
    assert!(complete["seq"].is_u64(), "{complete}");
    // The fake rewriter echoes what it is given, word by word; held to the watch's budget the
    // rewrite streams a sentence at a time: several chunks, not one block at the end.
    assert!(chunks.len() >= 3, "streamed, not one block: {chunks:?}");
    let text: String = chunks.concat();
    assert_eq!(
        text,
        adapt(&profile(ctx.clone()), &format!("echo: {original}"))
    );

    let ctp_request = gw
        .fake()
        .requests()
        .into_iter()
        .find(|r| r["model"] == "ctp-rewriter")
        .expect("a CTP request");
    assert_eq!(ctp_request["messages"][1]["content"], original);
    let system = ctp_request["messages"][0]["content"]
        .as_str()
        .expect("system");
    assert!(system.contains("iot"), "{system}");
    assert_eq!(ctp_request["max_tokens"], 40);
    assert_eq!(last_stored_reply(&gw, &id, &token).await, original);

    // A desktop on another session is not rewritten (no rule for it).
    let (id2, token2) = gw.session().await;
    let (mut desk, _) = gw
        .attach(
            &id2,
            &token2,
            json!({"surface_context": {"device_type": "desktop", "ui_capabilities": ["markdown", "tables"]}}),
        )
        .await;
    chat_text(&gw, &token2, &scripted(original, 2)).await;
    assert_eq!(desk.live_turn().await.0, original);
}

#[tokio::test]
async fn failing_ctp_falls_back_to_the_deterministic_adaptation() {
    let config = GatewayConfig {
        ctp: vec![CtpRule {
            device_type: "*".into(),
            model: "fake-error-500".into(),
            prompt: None,
        }],
        ..GatewayConfig::default()
    };
    let gw = fake_gateway(config).await;
    let (id, token) = gw.session().await;
    let ctx = json!({"device_type": "voice"});
    let (mut ws, _) = gw
        .attach(&id, &token, json!({"surface_context": ctx}))
        .await;
    chat_text(&gw, &token, &scripted(REPLY, 5)).await;
    let (text, complete) = ws.live_turn().await;
    assert_eq!(complete["type"], "TURN_COMPLETE");
    assert_eq!(text, adapt(&profile(ctx), REPLY));
}

/// A drain rewritten by a slow CTP pass does not hold the connection: a tool call made meanwhile
/// reaches the surface and is answered before the rewritten turn arrives.
#[tokio::test]
async fn a_slow_ctp_drain_does_not_hold_up_tool_calls() {
    let config = GatewayConfig {
        ctp: vec![CtpRule {
            device_type: "iot".into(),
            model: "fake-slow-1500".into(),
            prompt: None,
        }],
        ..GatewayConfig::default()
    };
    let gw = fake_gateway(config).await;
    let (id, token) = gw.session().await;
    let (ws, _) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"device_type": "desktop"}}),
        )
        .await;
    ws.close_abruptly().await;
    gw.wait_suspended(&id, &token).await;
    gw.push(&id, &token, "Your table is booked for eight.")
        .await;

    let (mut watch, attached) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"device_type": "iot", "mcp_tools": ["gps"]}}),
        )
        .await;
    assert_eq!(attached["queued_turns"], 1);
    let call = gw.spawn_post(
        &format!("/v1/sbp/sessions/{id}/tool_calls"),
        json!({"tool_name": "gps", "timeout_ms": 1000}),
        &[("x-session-token", &token)],
    );
    let frame = watch.recv().await;
    assert_eq!(
        frame["type"], "TOOL_CALL",
        "the call is not queued behind the rewrite: {frame}"
    );
    watch
        .send(json!({"type": "TOOL_RESULT", "call_id": frame["call_id"], "result": {"lat": 1}}))
        .await;
    let (status, _, body) = call.await.expect("call");
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("ok")),
        "{body}"
    );
    let turn = watch.recv().await;
    assert_eq!(turn["type"], "TETHER_TURN", "{turn}");
    assert_eq!(
        turn["content"],
        adapt(
            &profile(json!({"device_type": "iot"})),
            "echo: Your table is booked for eight."
        )
    );
}
