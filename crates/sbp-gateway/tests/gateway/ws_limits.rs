//! The WebSocket endpoint's limits seen from a client that misbehaves: a surface that stops
//! reading is dropped (write timeout, outbound byte budget) without losing a turn, a frame flood is
//! closed with 1008, and a first frame far over the size limit gets a 1009 the client can read.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::SinkExt as _;
use sbp_gateway::GatewayConfig;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

use crate::support::{Options, TestGateway, TestGatewayExt as _, WsEvent};
use crate::ws_raw::{CLOSE, In, Out, RawWs};

/// Receive buffer of a stalled client: small, so the gateway's writes stall after little data.
const STALLED_RCVBUF: u32 = 4096;
/// Size of each pushed turn.
const TURN_BYTES: usize = 32 << 10;
/// Pushes after which a surface that reads nothing must have been dropped.
const MAX_PUSHES: usize = 400;

async fn gateway(config: GatewayConfig) -> TestGateway {
    TestGateway::with(Options {
        config,
        ..Options::default()
    })
    .await
}

/// A raw client attached to `id` (with `extra` ATTACH_SESSION fields) that will read nothing more.
async fn stalled_surface(gw: &TestGateway, id: &str, token: &str, extra: Value) -> RawWs {
    let path = format!("/v1/sbp/ws/{id}");
    let mut raw = RawWs::connect_with(&gw.url, &path, Some(STALLED_RCVBUF)).await;
    let mut attach = json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token});
    if let (Some(a), Some(e)) = (attach.as_object_mut(), extra.as_object()) {
        a.extend(e.clone());
    }
    raw.send(&Out::text(attach.to_string())).await;
    assert_eq!(raw.frame().await.json()["type"], "SESSION_ATTACHED");
    raw
}

/// Pushes big turns until one is reported tethered (the surface was dropped); returns every turn
/// pushed as (seq, content), and how many were reported live first.
async fn push_until_tethered(
    gw: &TestGateway,
    id: &str,
    token: &str,
) -> (Vec<(u64, String)>, usize) {
    let padding = "x".repeat(TURN_BYTES);
    let mut pushed = Vec::new();
    let mut live = 0;
    loop {
        assert!(
            pushed.len() < MAX_PUSHES,
            "a surface that reads nothing is still attached after {MAX_PUSHES} pushes of {TURN_BYTES} bytes"
        );
        let content = format!("turn {} {padding}", pushed.len());
        let v = gw.push(id, token, &content).await;
        pushed.push((v["seq"].as_u64().expect("seq"), content));
        match v["delivery"].as_str() {
            Some("live") => live += 1,
            Some("tethered") => return (pushed, live),
            other => panic!("delivery {other:?}"),
        }
    }
}

/// The session is detached and later pushes are tethered; returns them too.
async fn dropped_then_tethered(gw: &TestGateway, id: &str, token: &str) -> Vec<(u64, String)> {
    let view = gw.wait_suspended(id, token).await;
    assert_eq!(view["surface_attached"], false, "{view}");
    let mut later = Vec::new();
    for i in 0..2 {
        let content = format!("after the drop {i}");
        let v = gw.push(id, token, &content).await;
        assert_eq!(v["delivery"], "tethered", "{v}");
        later.push((v["seq"].as_u64().expect("seq"), content));
    }
    later
}

/// Drains the session on a fresh attach: (seq, content) of every TETHER_TURN.
async fn drain(gw: &TestGateway, id: &str, token: &str, extra: Value) -> Vec<(u64, String)> {
    let (mut ws, attached) = gw.attach(id, token, extra).await;
    let queued = attached["queued_turns"].as_u64().expect("queued_turns");
    let mut turns = Vec::new();
    for _ in 0..queued {
        let f = ws.recv().await;
        assert_eq!(f["type"], "TETHER_TURN", "{f}");
        let content = f["content"].as_str().expect("content").to_owned();
        turns.push((f["seq"].as_u64().expect("seq"), content));
    }
    ws.close().await;
    turns
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn surface_that_stops_reading_is_dropped_by_the_write_timeout_and_loses_no_turn() {
    let gw = gateway(GatewayConfig {
        ws_write_timeout: Duration::from_secs(1),
        ..sbp_test_support::config()
    })
    .await;
    let (id, token) = gw.idle_session().await;
    // Ack mode: nothing leaves the tether before it is acknowledged, whatever was written.
    let _stalled = stalled_surface(&gw, &id, &token, json!({"last_seq": 0})).await;
    let (mut pushed, live) = push_until_tethered(&gw, &id, &token).await;
    assert!(live > 0, "the surface was attached at first");
    pushed.extend(dropped_then_tethered(&gw, &id, &token).await);
    let drained = drain(&gw, &id, &token, json!({"last_seq": 0})).await;
    assert_eq!(drained, pushed, "every turn, in order, once");
    assert_eq!(metric(&gw, "sbp_ws_slow_consumers_total").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn surface_over_its_outbound_budget_is_dropped_at_once_and_loses_no_turn() {
    // A write timeout far beyond the test: only the byte budget can drop the surface.
    let gw = gateway(GatewayConfig {
        ws_write_timeout: Duration::from_secs(600),
        ws_outbound_budget: 256 << 10,
        ..sbp_test_support::config()
    })
    .await;
    let (id, token) = gw.idle_session().await;
    // Without ACKs a turn leaves the tether once written to the socket: the stalled client still
    // holds those in its buffers, and reads them below.
    let mut stalled = stalled_surface(&gw, &id, &token, json!({})).await;
    let (mut pushed, live) = push_until_tethered(&gw, &id, &token).await;
    assert!(live > 0, "the surface was attached at first");
    pushed.extend(dropped_then_tethered(&gw, &id, &token).await);
    // What the gateway wrote before the drop reaches the client once it reads again.
    let frames = stalled.rest().await;
    let written: Vec<u64> = frames
        .iter()
        .filter(|f| f.opcode != CLOSE)
        .map(In::json)
        .filter(|f| f["type"] == "TURN_COMPLETE")
        .map(|f| f["seq"].as_u64().expect("seq"))
        .collect();
    let drained: Vec<u64> = drain(&gw, &id, &token, json!({}))
        .await
        .into_iter()
        .map(|(seq, _)| seq)
        .collect();
    let written_set: BTreeSet<u64> = written.iter().copied().collect();
    let drained_set: BTreeSet<u64> = drained.iter().copied().collect();
    assert!(
        written_set.is_disjoint(&drained_set),
        "delivered twice: written {written:?}, drained {drained:?}"
    );
    let all: BTreeSet<u64> = pushed.iter().map(|(seq, _)| *seq).collect();
    let delivered: BTreeSet<u64> = written_set.union(&drained_set).copied().collect();
    assert_eq!(delivered, all, "written {written:?}, drained {drained:?}");
    // The budget overflowed with turns queued for the surface and not written: those were
    // reported live and must come from the drain.
    let queued_at_drop = pushed[..live]
        .iter()
        .filter(|(seq, _)| drained_set.contains(seq))
        .count();
    assert!(
        queued_at_drop > 0,
        "no turn reported live came from the drain: written {written:?}, drained {drained:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_flood_is_closed_with_1008() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.idle_session().await;
    let mut raw = RawWs::connect(&gw.url, &format!("/v1/sbp/ws/{id}")).await;
    let attach = json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token});
    raw.send(&Out::text(attach.to_string())).await;
    assert_eq!(raw.frame().await.json()["type"], "SESSION_ATTACHED");
    // Frames the gateway ignores, far more than the default burst, at once.
    let burst = gw.gateway.config().ws_frame_burst as usize;
    let noise = Out::text(r#"{"type":"NOISE"}"#).encode();
    let flood: Vec<u8> = noise
        .iter()
        .copied()
        .cycle()
        .take(noise.len() * burst * 3)
        .collect();
    raw.try_write(&flood).await;
    let close = raw.frame().await;
    assert_eq!(close.close_code(), Some(1008), "{close:?}");
    assert_eq!(close.close_reason(), "too many frames");
    gw.wait_suspended(&id, &token).await;
    assert_eq!(metric(&gw, "sbp_ws_frame_floods_total").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_megabyte_first_frame_gets_a_1009_the_client_reads() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.idle_session().await;
    let mut ws = gw.ws(&id).await;
    let attach = json!({
        "type": "ATTACH_SESSION",
        "session_id": id,
        "session_token": token,
        "padding": "x".repeat(10_000_000),
    });
    // The gateway refuses the frame from its header; the client is still sending it.
    let sent = ws
        .stream
        .send(Message::Text(attach.to_string().into()))
        .await;
    assert!(sent.is_ok(), "the frame was read to its end: {sent:?}");
    match ws.next_raw().await {
        WsEvent::Closed(code) => assert_eq!(code, Some(1009)),
        WsEvent::Frame(f) => panic!("a close was expected, got {f}"),
    }
}

/// A counter's value from `/metrics`.
async fn metric(gw: &TestGateway, name: &str) -> u64 {
    gw.metric(name)
        .await
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_larger_than_four_frames_reaches_the_surface() {
    let gw = TestGateway::with(Options {
        config: GatewayConfig {
            limits: sbp_gateway::Limits {
                max_message_bytes: 8 << 20,
                ..sbp_gateway::Limits::default()
            },
            ..sbp_test_support::config()
        },
        ..Options::default()
    })
    .await;
    let (id, token) = gw.idle_session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    // Frames from the gateway are not bound by the inbound frame limit; a big turn (a backend may
    // push up to the body limit) must not make its surface undeliverable.
    let content = "y".repeat(gw.gateway.config().max_frame_bytes * 5);
    let v = gw.push(&id, &token, &content).await;
    assert_eq!(v["delivery"], "live");
    let (text, complete) = ws.live_turn().await;
    assert_eq!(text.len(), content.len());
    assert_eq!(complete["seq"], v["seq"]);
}
