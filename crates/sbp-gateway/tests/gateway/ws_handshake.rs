//! The WebSocket endpoint's handshake and connection rules (SPEC 11, the seeds' frame reference):
//! SESSION_ATTACHED, refusals with their close codes, frames after attach, PING/PONG, DETACH,
//! repeated attaches and displacement by a second surface.

use std::time::Duration;

use futures::SinkExt;
use sbp_gateway::GatewayConfig;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use uuid::Uuid;

use crate::support::{Options, TestGateway, TestGatewayExt, Ws, WsEvent};

fn with_config(edit: impl FnOnce(&mut GatewayConfig)) -> Options {
    let mut opts = Options::default();
    edit(&mut opts.config);
    opts
}

fn attach_frame(id: &str, token: &str) -> Value {
    json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token})
}

/// Pushes a backend turn and checks it reaches `ws` live: proof the connection is still usable.
async fn assert_usable(gw: &TestGateway, ws: &mut Ws, id: &str, token: &str, content: &str) {
    let pushed = gw.push(id, token, content).await;
    assert_eq!(pushed["delivery"], "live", "{pushed}");
    let (text, complete) = ws.live_turn().await;
    assert_eq!(text, content);
    assert_eq!(complete["seq"], pushed["seq"], "{complete}");
}

#[tokio::test]
async fn session_attached_describes_the_session_and_echoes_the_surface() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let surface = json!({
        "device_type": "mobile",
        "max_output_tokens": 300,
        "ui_capabilities": ["markdown", "streaming"],
        "locale": "en-US",
        "surface_id": "phone-1234",
        "mcp_tools": ["camera", "gps"],
        "future_field": {"nested": [1, 2]},
    });
    let (_ws, attached) = gw
        .attach(&id, &token, json!({"surface_context": surface}))
        .await;
    assert_eq!(attached["session_id"], id.as_str());
    assert_eq!(attached["device_type"], "mobile");
    assert_eq!(attached["surface_id"], "phone-1234");
    assert_eq!(attached["queued_turns"], 0);
    assert_eq!(attached["tether_turns_pending"], 0);
    assert!(attached["mcp_tools_registered"].is_array(), "{attached}");
    assert_eq!(attached["sbp_version"], "1.2");
    assert_eq!(
        attached["sbp_level"],
        GatewayConfig::default().sbp_level.as_str()
    );
    let extensions = attached["extensions"].as_array().expect("extensions array");
    for ext in ["ack", "last_seq"] {
        assert!(
            extensions.iter().any(|e| e == ext),
            "{ext} missing: {attached}"
        );
    }
    // Every declared field comes back, the unknown one untouched.
    assert_eq!(attached["surface_context"], surface, "{attached}");

    let view = gw.session_view(&id, &token).await;
    assert_eq!(view["surface_attached"], true);
    assert_eq!(view["status"], "running");
    assert_eq!(view["surface"]["device_type"], "mobile");
}

#[tokio::test]
async fn surface_context_is_optional_aliased_and_lenient() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let cases = [
        (json!({}), "unknown", Value::Null),
        (json!({"surface_context": null}), "unknown", Value::Null),
        (json!({"surface": null}), "unknown", Value::Null),
        (json!({"surface_context": {}}), "unknown", Value::Null),
        (
            json!({"surface": {"device_type": "voice", "surface_id": "car-7"}}),
            "voice",
            json!("car-7"),
        ),
        (
            json!({"surface_context": {"device_type": "hologram"}}),
            "hologram",
            Value::Null,
        ),
        (
            json!({"surface_context": {"device_type": "desktop"}, "last_seq": null}),
            "desktop",
            Value::Null,
        ),
    ];
    for (extra, device_type, surface_id) in cases {
        let (mut ws, attached) = gw.attach(&id, &token, extra.clone()).await;
        assert_eq!(attached["device_type"], device_type, "{extra}: {attached}");
        assert_eq!(attached["surface_id"], surface_id, "{extra}: {attached}");
        assert_eq!(
            attached["queued_turns"], attached["tether_turns_pending"],
            "{attached}"
        );
        ws.send(json!({"type": "DETACH"})).await;
        ws.expect_close(1000).await;
    }
}

#[tokio::test]
async fn sbp_version_comes_from_the_config() {
    let gw = TestGateway::with(with_config(|c| c.sbp_version = "0.9".into())).await;
    let (id, token) = gw.session().await;
    let (_ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["sbp_version"], "0.9");
}

#[tokio::test]
async fn first_frame_other_than_attach_is_a_protocol_error() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let firsts = [
        json!({"type": "PONG"}).to_string(),
        json!({"type": "DETACH"}).to_string(),
        json!({"type": "ACK", "seq": 1}).to_string(),
        json!({"type": "TOOL_RESULT", "call_id": "c1", "result": {}}).to_string(),
        json!({"type": "SOMETHING_NEW", "session_id": id}).to_string(),
        "this is not json".to_owned(),
        "[1, 2, 3]".to_owned(),
        "\"ATTACH_SESSION\"".to_owned(),
        "{}".to_owned(),
        json!({"type": 7}).to_string(),
        json!({"type": "ATTACH_SESSION", "session_token": token}).to_string(),
        json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token, "last_seq": -1})
            .to_string(),
    ];
    for first in &firsts {
        let mut ws = gw.ws(&id).await;
        ws.send_text(first).await;
        let frame = ws.expect_error_close("PROTOCOL_ERROR", 1003).await;
        assert!(
            frame["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{first}: {frame}"
        );
    }
    let mut ws = gw.ws(&id).await;
    ws.send(json!({"type": "PONG"})).await;
    let frame = ws.expect_error_close("PROTOCOL_ERROR", 1003).await;
    let detail = frame["detail"].as_str().expect("detail");
    assert!(
        detail.contains("ATTACH_SESSION") && detail.contains("PONG"),
        "{detail}"
    );

    // None of the refused sockets touched the session.
    let view = gw.session_view(&id, &token).await;
    assert_eq!(view["status"], "running");
    assert_eq!(view["surface_attached"], false);
    gw.attach(&id, &token, json!({})).await;
}

#[tokio::test]
async fn binary_first_frame_is_a_protocol_error() {
    let gw = TestGateway::start().await;
    let (id, _) = gw.session().await;
    let mut ws = gw.ws(&id).await;
    ws.stream
        .send(Message::Binary(vec![0x7b, 0x7d].into()))
        .await
        .expect("send binary");
    ws.expect_error_close("PROTOCOL_ERROR", 1003).await;
}

#[tokio::test]
async fn silent_socket_is_refused_after_the_attach_timeout() {
    let gw = TestGateway::with(with_config(|c| {
        c.attach_timeout = Duration::from_millis(300)
    }))
    .await;
    let (id, _) = gw.session().await;
    let started = tokio::time::Instant::now();
    let mut ws = gw.ws(&id).await;
    let frame = ws.expect_error_close("PROTOCOL_ERROR", 1003).await;
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "refused early: {:?}",
        started.elapsed()
    );
    assert!(
        frame["detail"]
            .as_str()
            .is_some_and(|d| d.contains("ATTACH_SESSION")),
        "{frame}"
    );
}

#[tokio::test]
async fn session_id_must_match_the_url() {
    let gw = TestGateway::start().await;
    let (id, _) = gw.session().await;
    let (other, other_token) = gw.session().await;
    let mut ws = gw.ws(&id).await;
    ws.send(attach_frame(&other, &other_token)).await;
    ws.expect_error_close("PROTOCOL_ERROR", 1003).await;
    // Not even the frame's own session got attached.
    assert_eq!(
        gw.session_view(&other, &other_token).await["surface_attached"],
        false
    );
}

#[tokio::test]
async fn unknown_session_is_not_found() {
    let gw = TestGateway::start().await;
    let (_, token) = gw.session().await;
    for id in [Uuid::new_v4().to_string(), "not-a-uuid".to_owned()] {
        let mut ws = gw.ws(&id).await;
        ws.send(attach_frame(&id, &token)).await;
        let frame = ws.expect_error_close("SESSION_NOT_FOUND", 4004).await;
        assert!(
            frame["detail"].as_str().is_some_and(|d| d.contains(&id)),
            "{frame}"
        );
    }
}

#[tokio::test]
async fn wrong_or_missing_token_is_forbidden() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (_, other_token) = gw.session().await;
    let frames = [
        attach_frame(&id, "not-the-token"),
        attach_frame(&id, &other_token),
        attach_frame(&id, ""),
        json!({"type": "ATTACH_SESSION", "session_id": id}),
        json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": null}),
    ];
    for frame in frames {
        let mut ws = gw.ws(&id).await;
        ws.send(frame.clone()).await;
        let refused = ws.expect_error_close("FORBIDDEN", 4003).await;
        assert!(refused["detail"].is_string(), "{frame}: {refused}");
    }
    assert_eq!(
        gw.session_view(&id, &token).await["surface_attached"],
        false
    );
    gw.attach(&id, &token, json!({})).await;
}

#[tokio::test]
async fn ignorable_frames_after_attach_leave_the_connection_usable() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    for frame in [
        json!({"type": "HELLO_FROM_THE_FUTURE", "payload": {"x": 1}}),
        json!({"type": "TOOL_RESULT", "call_id": Uuid::new_v4().to_string(), "result": {"ok": true}, "error": null}),
        json!({"type": "TOOL_RESULT", "call_id": "no-such-call", "error": "camera busy"}),
        json!({"type": "PONG"}),
    ] {
        ws.send(frame).await;
    }
    assert_usable(&gw, &mut ws, &id, &token, "still here").await;
    assert_eq!(gw.session_view(&id, &token).await["surface_attached"], true);
}

#[tokio::test]
async fn malformed_frames_after_attach_are_protocol_errors() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let bad = [
        "{not json",
        "[]",
        "42",
        "{\"no_type\": true}",
        "{\"type\":\"ACK\",\"seq\":\"x\"}",
    ];
    for text in bad {
        let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
        ws.send_text(text).await;
        let frame = ws.expect_error_close("PROTOCOL_ERROR", 1003).await;
        assert!(frame["detail"].is_string(), "{text}: {frame}");
        // A connection closed for a protocol error is a detach like any other.
        gw.wait_suspended(&id, &token).await;
    }
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    ws.stream
        .send(Message::Binary(vec![1, 2, 3].into()))
        .await
        .expect("send binary");
    ws.expect_error_close("PROTOCOL_ERROR", 1003).await;
}

#[tokio::test]
async fn oversized_frame_closes_with_1009() {
    let gw = TestGateway::with(with_config(|c| c.max_frame_bytes = 4096)).await;
    let (id, token) = gw.session().await;
    let big = json!({"type": "HELLO_FROM_THE_FUTURE", "padding": "x".repeat(8192)}).to_string();

    // A frame just under the limit is fine.
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    ws.send(json!({"type": "HELLO_FROM_THE_FUTURE", "padding": "x".repeat(3000)}))
        .await;
    assert_usable(&gw, &mut ws, &id, &token, "small frames pass").await;

    ws.send_text(&big).await;
    ws.expect_close(1009).await;
    gw.wait_suspended(&id, &token).await;

    // Also as the very first frame.
    let mut ws = gw.ws(&id).await;
    ws.send_text(&big).await;
    ws.expect_close(1009).await;
}

#[tokio::test]
async fn detach_closes_normally_and_suspends_the_session() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"device_type": "desktop"}}),
        )
        .await;
    assert_eq!(gw.session_view(&id, &token).await["surface_attached"], true);
    ws.send(json!({"type": "DETACH"})).await;
    ws.expect_close(1000).await;
    let view = gw.wait_suspended(&id, &token).await;
    assert_eq!(view["surface"], Value::Null, "{view}");
    // Attaching again resumes it.
    let (_ws, _) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(gw.session_view(&id, &token).await["status"], "running");
}

#[tokio::test]
async fn unanswered_ping_closes_with_1001() {
    let gw = TestGateway::with(with_config(|c| {
        c.ping_interval = Duration::from_millis(200);
        c.pong_timeout = Duration::from_millis(300);
    }))
    .await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    match ws.next_raw().await {
        WsEvent::Frame(f) => assert_eq!(f, json!({"type": "PING"})),
        WsEvent::Closed(c) => panic!("closed ({c:?}) before any PING"),
    }
    // Never answered: the next event is the close, with no second PING before it.
    match ws.next_raw().await {
        WsEvent::Closed(code) => assert_eq!(code, Some(1001)),
        WsEvent::Frame(f) => panic!("expected close 1001, got {f}"),
    }
    gw.wait_suspended(&id, &token).await;
}

#[tokio::test]
async fn answered_pings_keep_the_connection_open() {
    let gw = TestGateway::with(with_config(|c| {
        c.ping_interval = Duration::from_millis(150);
        // Generous, so a busy test machine answering late does not look like a dead surface.
        c.pong_timeout = Duration::from_millis(500);
    }))
    .await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    // A PING goes out only once the previous one was answered, and six intervals outlast the
    // pong timeout: each PONG was taken as an answer.
    for i in 0..6 {
        match ws.next_raw().await {
            WsEvent::Frame(f) if f["type"] == "PING" => ws.send(json!({"type": "PONG"})).await,
            other => panic!("ping {i}: expected PING, got {other:?}"),
        }
    }
    assert_usable(&gw, &mut ws, &id, &token, "alive after pings").await;
}

#[tokio::test]
async fn repeated_attach_on_one_socket_is_idempotent() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (mut ws, first) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"device_type": "mobile"}}),
        )
        .await;
    assert_eq!(first["device_type"], "mobile");
    ws.send(
        json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token,
                   "surface_context": {"device_type": "desktop", "surface_id": "s2"}}),
    )
    .await;
    let second = ws.recv().await;
    assert_eq!(second["type"], "SESSION_ATTACHED", "{second}");
    assert_eq!(second["session_id"], id.as_str());
    assert_eq!(second["device_type"], "desktop");
    assert_eq!(second["surface_id"], "s2");
    assert_eq!(second["queued_turns"], 0);
    assert_usable(&gw, &mut ws, &id, &token, "after the second attach").await;
    let view = gw.session_view(&id, &token).await;
    assert_eq!(
        (view["status"].clone(), view["surface_attached"].clone()),
        (json!("running"), json!(true))
    );
}

#[tokio::test]
async fn repeated_attach_is_still_validated() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (other, other_token) = gw.session().await;

    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    ws.send(attach_frame(&id, "wrong")).await;
    ws.expect_error_close("FORBIDDEN", 4003).await;

    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    ws.send(attach_frame(&other, &other_token)).await;
    ws.expect_error_close("PROTOCOL_ERROR", 1003).await;
    gw.wait_suspended(&id, &token).await;
}

#[tokio::test]
async fn second_surface_displaces_the_first() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (mut a, _) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"device_type": "mobile", "surface_id": "a"}}),
        )
        .await;
    let (mut b, attached) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"device_type": "desktop", "surface_id": "b"}}),
        )
        .await;
    assert_eq!(attached["surface_id"], "b");
    a.expect_close(4409).await;

    // A's close did not suspend the session: B is its surface and gets the next turn live.
    let pushed = gw.push(&id, &token, "for b only").await;
    assert_eq!(pushed["delivery"], "live", "{pushed}");
    let (text, _) = b.live_turn().await;
    assert_eq!(text, "for b only");
    // Written to B's socket, the turn leaves the tether (no ACK mode) just after.
    let view = gw
        .wait_view(&id, &token, "the live turn to leave the tether", |v| {
            v["tether_turns_pending"] == 0
        })
        .await;
    assert_eq!(view["status"], "running", "{view}");
    assert_eq!(view["surface_attached"], true);
    assert_eq!(view["surface"]["surface_id"], "b", "{view}");

    b.send(json!({"type": "DETACH"})).await;
    b.expect_close(1000).await;
    gw.wait_suspended(&id, &token).await;
}

#[tokio::test]
async fn repeated_attach_records_the_new_surface() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"device_type": "mobile", "surface_id": "s1"}}),
        )
        .await;
    ws.send(
        json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token,
                   "surface_context": {"device_type": "desktop", "surface_id": "s2"}}),
    )
    .await;
    let second = ws.recv().await;
    assert_eq!(second["device_type"], "desktop", "{second}");
    let view = gw.session_view(&id, &token).await;
    assert_eq!(
        view["surface"]["device_type"], "desktop",
        "SESSION_ATTACHED and the session disagree: {view}"
    );
    assert_eq!(view["surface"]["surface_id"], "s2", "{view}");
}
