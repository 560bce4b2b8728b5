//! The Tether (SPEC 7.3/7.4): turns produced while no surface is attached are queued durably and
//! drained in order on the next ATTACH_SESSION; live delivery while attached; the ACK/last_seq
//! extension for drains interrupted by a dropped connection.

use std::sync::Arc;

use sbp_gateway::GatewayConfig;
use serde_json::{Value, json};

use crate::support::{Options, TestGateway, TestGatewayExt, Ws};

fn with_config(edit: impl FnOnce(&mut GatewayConfig)) -> Options {
    let mut opts = Options::default();
    edit(&mut opts.config);
    opts
}

/// Reads `n` TETHER_TURN frames.
async fn tether_turns(ws: &mut Ws, n: usize) -> Vec<Value> {
    let mut turns = Vec::with_capacity(n);
    for _ in 0..n {
        let f = ws.recv().await;
        assert_eq!(f["type"], "TETHER_TURN", "{f}");
        turns.push(f);
    }
    turns
}

fn contents(turns: &[Value]) -> Vec<&str> {
    turns
        .iter()
        .map(|t| t["content"].as_str().expect("content"))
        .collect()
}

fn seqs(turns: &[Value]) -> Vec<u64> {
    turns
        .iter()
        .map(|t| t["seq"].as_u64().expect("seq"))
        .collect()
}

fn assert_strictly_increasing(seqs: &[u64]) {
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "seqs not strictly increasing: {seqs:?}"
    );
}

/// Sends DETACH and waits for the normal close: every frame before it has been fully processed.
async fn detach(ws: &mut Ws) {
    ws.send(json!({"type": "DETACH"})).await;
    ws.expect_close(1000).await;
}

/// One user message on an existing session, with `sbp` options; returns (status, body).
async fn say(gw: &TestGateway, token: &str, text: &str, sbp: Value, stream: bool) -> (u16, Value) {
    let mut body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": text}], "stream": stream});
    if !sbp.is_null() {
        body["sbp"] = sbp;
    }
    let (status, _, v) = gw.chat(body, &[("x-session-token", token)]).await;
    (status, v)
}

/// A session a surface attached to and detached from: suspended, with the tether on for HTTP turns.
async fn detached_session(gw: &TestGateway) -> (String, String) {
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    detach(&mut ws).await;
    gw.wait_suspended(&id, &token).await;
    (id, token)
}

/// The close frame that answers DETACH acknowledges it: by then the session is suspended, so a
/// client reading the session right after its close never sees it still running.
#[tokio::test]
async fn detach_is_done_when_its_close_arrives() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    for round in 0..200 {
        let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
        ws.send(json!({"type": "DETACH"})).await;
        ws.expect_close(1000).await;
        let view = gw.session_view(&id, &token).await;
        assert_eq!(view["status"], "suspended", "round {round}: {view}");
        assert_eq!(view["surface_attached"], false, "round {round}: {view}");
    }
}

#[tokio::test]
async fn pushed_turns_are_tethered_and_drained_in_order() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let pushes = [
        json!({"content": "first", "model_used": "gpt-4o"}),
        json!({"content": "second", "role": "user"}),
        json!({"content": "third", "role": "assistant", "model_used": "claude-x"}),
    ];
    let mut pushed_seqs = Vec::new();
    for p in &pushes {
        let (s, _, v) = gw
            .post(
                &format!("/v1/sbp/sessions/{id}/turns"),
                p.clone(),
                &[("x-session-token", &token)],
            )
            .await;
        assert_eq!(s, 201, "{v}");
        assert_eq!(v["delivery"], "tethered", "{v}");
        pushed_seqs.push(v["seq"].as_u64().expect("seq"));
    }

    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 3, "{attached}");
    assert_eq!(attached["tether_turns_pending"], 3, "{attached}");
    let turns = tether_turns(&mut ws, 3).await;
    for (i, (turn, push)) in turns.iter().zip(&pushes).enumerate() {
        assert_eq!(turn["turn_index"], i, "{turn}");
        assert_eq!(turn["content"], push["content"], "{turn}");
        assert_eq!(
            turn["role"],
            push.get("role").cloned().unwrap_or(json!("assistant")),
            "{turn}"
        );
        assert_eq!(
            turn["model_used"],
            push.get("model_used").cloned().unwrap_or(Value::Null),
            "{turn}"
        );
        let created = turn["created_at"].as_str().expect("created_at");
        assert!(
            created.len() >= 20 && created.contains('T') && created.ends_with('Z'),
            "{turn}"
        );
    }
    assert_eq!(seqs(&turns), pushed_seqs);
    assert_strictly_increasing(&pushed_seqs);
    let created: Vec<&str> = turns
        .iter()
        .map(|t| t["created_at"].as_str().expect("created_at"))
        .collect();
    assert!(created.windows(2).all(|w| w[0] <= w[1]), "{created:?}");

    detach(&mut ws).await;
    let (_ws, again) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(again["queued_turns"], 0, "{again}");
}

#[tokio::test]
async fn conformance_tether_hook_loads_turns() {
    let gw = TestGateway::with(with_config(|c| c.enable_test_hooks = true)).await;
    let (id, token) = gw.session().await;
    let body = json!({"turns": [
        {"type": "TETHER_TURN", "session_id": id, "turn": {"role": "assistant", "content": "Reply 1"}},
        {"type": "TETHER_TURN", "session_id": id, "turn": {"role": "assistant", "content": "Reply 2"}},
    ]});
    let (s, _, v) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/_test/tether"),
            body,
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["enqueued"], 2, "{v}");
    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 2, "{attached}");
    let turns = tether_turns(&mut ws, 2).await;
    assert_eq!(contents(&turns), ["Reply 1", "Reply 2"]);
    assert!(turns.iter().all(|t| t["role"] == "assistant"));
}

#[tokio::test]
async fn conformance_tether_hook_is_off_by_default() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let body =
        json!({"turns": [{"type": "TETHER_TURN", "turn": {"role": "assistant", "content": "x"}}]});
    let (s, _, v) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/_test/tether"),
            body,
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(s, 404, "{v}");
    assert_eq!(v["error"]["code"], "SBP_NOT_FOUND", "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    assert_eq!(
        gw.session_view(&id, &token).await["tether_turns_pending"],
        0
    );
}

#[tokio::test]
async fn a_hundred_turns_drain_in_order() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    for i in 0..100 {
        gw.push(&id, &token, &format!("turn {i}")).await;
    }
    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 100, "{attached}");
    let turns = tether_turns(&mut ws, 100).await;
    let expected: Vec<String> = (0..100).map(|i| format!("turn {i}")).collect();
    assert_eq!(contents(&turns), expected);
    let indexes: Vec<u64> = turns
        .iter()
        .map(|t| t["turn_index"].as_u64().expect("turn_index"))
        .collect();
    assert_eq!(indexes, (0..100).collect::<Vec<u64>>());
    assert_strictly_increasing(&seqs(&turns));
}

/// Reads one live turn, checking every chunk carries the same chunk_id as the TURN_COMPLETE;
/// returns (deltas, complete frame).
async fn live_chunks(ws: &mut Ws) -> (Vec<String>, Value) {
    let mut deltas = Vec::new();
    let mut ids = Vec::new();
    loop {
        let f = ws.recv().await;
        match f["type"].as_str() {
            Some("TURN_CHUNK") => {
                ids.push(f["chunk_id"].clone());
                deltas.push(f["delta"].as_str().expect("delta").to_owned());
            }
            Some("TURN_COMPLETE") => {
                assert!(f["chunk_id"].as_str().is_some_and(|c| !c.is_empty()), "{f}");
                assert!(
                    ids.iter().all(|i| *i == f["chunk_id"]),
                    "chunk ids {ids:?} vs {f}"
                );
                return (deltas, f);
            }
            _ => panic!("unexpected frame in a live turn: {f}"),
        }
    }
}

#[tokio::test]
async fn http_turns_stream_live_to_the_attached_surface() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;

    let (status, body) = say(&gw, &token, "hello over there", Value::Null, false).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "Echo: hello over there"
    );
    let (deltas, first) = live_chunks(&mut ws).await;
    assert!(!deltas.is_empty());
    assert_eq!(deltas.concat(), "Echo: hello over there");

    let (status, body) = say(&gw, &token, "now streamed", Value::Null, true).await;
    assert_eq!(status, 200, "{body}");
    let (deltas, second) = live_chunks(&mut ws).await;
    assert_eq!(deltas.concat(), "Echo: now streamed");
    assert_ne!(first["chunk_id"], second["chunk_id"]);

    // Delivered live means delivered: nothing waits in the tether for the next attach.
    detach(&mut ws).await;
    let (_ws, again) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(again["queued_turns"], 0, "{again}");
}

#[tokio::test]
async fn upstream_chunks_reach_the_surface_one_by_one() {
    let gw = TestGateway::with_fake().await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    let (status, body) = say(
        &gw,
        &token,
        "one two three four five six seven [[fake:chunks=5]]",
        Value::Null,
        false,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let reply = body["choices"][0]["message"]["content"]
        .as_str()
        .expect("reply text");
    assert!(reply.contains("one two three"), "{reply}");
    let (deltas, _) = live_chunks(&mut ws).await;
    assert_eq!(deltas.len(), 5, "{deltas:?}");
    assert_eq!(deltas.concat(), reply);
}

/// A caller that did not ask for a stream still gets the turn's usage when the gateway streams
/// upstream on its own account (for the attached surface): it asks for the usage chunk.
#[tokio::test]
async fn usage_survives_streaming_for_the_surface() {
    let gw = TestGateway::with_fake().await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    let (status, body) = say(&gw, &token, "count these five words", Value::Null, false).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body["usage"]["completion_tokens"]
            .as_u64()
            .is_some_and(|n| n > 0),
        "{body}"
    );
    let upstream = gw.fake().requests();
    let last = upstream.last().expect("the turn's request");
    assert_eq!(last["stream"], true, "{last}");
    assert_eq!(last["stream_options"]["include_usage"], true, "{last}");
    live_chunks(&mut ws).await;
}

/// The next frame that is not a TURN_CHUNK, with the deltas of the chunks before it added to
/// `deltas` (all of turn `chunk_id`, if set).
async fn frame_after_chunks(ws: &mut Ws, deltas: &mut Vec<String>, chunk_id: &Value) -> Value {
    loop {
        let f = ws.recv().await;
        if f["type"] != "TURN_CHUNK" {
            return f;
        }
        assert!(chunk_id.is_null() || f["chunk_id"] == *chunk_id, "{f}");
        deltas.push(f["delta"].as_str().expect("delta").to_owned());
    }
}

/// A repeated ATTACH_SESSION on the socket while a turn streams to it (SPEC 7.4: resuming is
/// idempotent) keeps what already streamed there: the surface ends up with the reply exactly
/// once, whether the re-attach comes between chunks or after the last one (when only the turn's
/// completion is left), and is not sent the whole reply again on top.
#[tokio::test]
async fn reattach_mid_stream_does_not_repeat_what_streamed() {
    let gw = TestGateway::with_fake().await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    let reply = "one two three four five six";
    // 300 ms between upstream events: after the last chunk the finish event and [DONE] are
    // still to come, time enough for the re-attach to be handled first.
    let prompt = format!("[[fake:reply={reply}]] [[fake:chunks=3]] [[fake:chunk_delay=300]]");
    let turn = gw.spawn_post(
        "/v1/chat/completions",
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": prompt}]}),
        &[("x-session-token", &token)],
    );
    let reattach = json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token});

    let first = ws.recv().await;
    assert_eq!(first["type"], "TURN_CHUNK", "{first}");
    let chunk_id = first["chunk_id"].clone();
    let mut deltas = vec![first["delta"].as_str().expect("delta").to_owned()];
    ws.send(reattach.clone()).await;
    let f = frame_after_chunks(&mut ws, &mut deltas, &chunk_id).await;
    assert_eq!(f["type"], "SESSION_ATTACHED", "{f}");
    while deltas.len() < 3 {
        let f = ws.recv().await;
        assert_eq!(f["type"], "TURN_CHUNK", "the turn streams on: {f}");
        assert_eq!(f["chunk_id"], chunk_id, "{f}");
        deltas.push(f["delta"].as_str().expect("delta").to_owned());
    }
    ws.send(reattach).await;
    let f = ws.recv().await;
    assert_eq!(
        f["type"], "SESSION_ATTACHED",
        "re-attached before the turn completed (else raise chunk_delay): {f}"
    );
    let complete = frame_after_chunks(&mut ws, &mut deltas, &chunk_id).await;
    assert_eq!(complete["type"], "TURN_COMPLETE", "{complete}");
    assert_eq!(complete["chunk_id"], chunk_id, "{complete}");
    assert_eq!(deltas.concat(), reply, "what the surface got: {deltas:?}");

    let (status, _, body) = turn.await.expect("turn task");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], reply);
}

#[tokio::test]
async fn pushed_turn_while_attached_is_delivered_live_with_its_seq() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    let pushed = gw.push(&id, &token, "breaking news").await;
    assert_eq!(pushed["delivery"], "live", "{pushed}");
    let (deltas, complete) = live_chunks(&mut ws).await;
    assert_eq!(deltas, ["breaking news"]);
    assert_eq!(complete["seq"], pushed["seq"], "{complete}");
    assert!(complete["seq"].as_u64().is_some(), "{complete}");
}

#[tokio::test]
async fn tethered_turns_come_before_new_live_turns() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    gw.push(&id, &token, "queued 1").await;
    gw.push(&id, &token, "queued 2").await;
    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 2);
    gw.push(&id, &token, "live 3").await;
    let turns = tether_turns(&mut ws, 2).await;
    assert_eq!(contents(&turns), ["queued 1", "queued 2"]);
    let (text, complete) = ws.live_turn().await;
    assert_eq!(text, "live 3");
    assert!(complete["seq"].as_u64().expect("seq") > turns[1]["seq"].as_u64().expect("seq"));
}

#[tokio::test]
async fn http_turns_after_detach_are_tethered() {
    let gw = TestGateway::start().await;
    let (id, token) = detached_session(&gw).await;

    // A suspended session answers 202 unless the caller asks to resume.
    let (status, body) = say(&gw, &token, "are you there?", Value::Null, false).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["sbp"]["resume_available"], true, "{body}");

    let (status, body) = say(&gw, &token, "one", json!({"resume": true}), false).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = say(&gw, &token, "two", json!({"session_id": id}), false).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = say(&gw, &token, "three", json!({"resume": true}), true).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        gw.session_view(&id, &token).await["tether_turns_pending"],
        3
    );

    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 3, "{attached}");
    let turns = tether_turns(&mut ws, 3).await;
    assert_eq!(contents(&turns), ["Echo: one", "Echo: two", "Echo: three"]);
    assert!(
        turns
            .iter()
            .all(|t| t["role"] == "assistant" && t["model_used"].is_string()),
        "{turns:?}"
    );
    assert_strictly_increasing(&seqs(&turns));
}

#[tokio::test]
async fn dropped_drain_resumes_from_last_seq_without_loss() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    for i in 1..=20 {
        gw.push(&id, &token, &format!("t{i}")).await;
    }
    let (mut ws, attached) = gw.attach(&id, &token, json!({"last_seq": 0})).await;
    assert_eq!(attached["queued_turns"], 20, "{attached}");
    let read = tether_turns(&mut ws, 5).await;
    assert_eq!(contents(&read), ["t1", "t2", "t3", "t4", "t5"]);
    let third = read[2]["seq"].as_u64().expect("seq");
    ws.close_abruptly().await;

    let (mut ws, attached) = gw.attach(&id, &token, json!({"last_seq": third})).await;
    assert_eq!(attached["queued_turns"], 17, "{attached}");
    let rest = tether_turns(&mut ws, 17).await;
    let expected: Vec<String> = (4..=20).map(|i| format!("t{i}")).collect();
    assert_eq!(contents(&rest), expected);
    let rest_seqs = seqs(&rest);
    assert!(rest_seqs[0] > third, "{rest_seqs:?} after {third}");
    assert_strictly_increasing(&rest_seqs);
    let indexes: Vec<u64> = rest
        .iter()
        .map(|t| t["turn_index"].as_u64().expect("turn_index"))
        .collect();
    assert_eq!(indexes, (0..17).collect::<Vec<u64>>());

    // ACK everything; DETACH's close proves the ACK was processed.
    let last = *rest_seqs.last().expect("a last seq");
    ws.send(json!({"type": "ACK", "seq": last})).await;
    detach(&mut ws).await;
    assert_eq!(
        gw.wait_suspended(&id, &token).await["tether_turns_pending"],
        0
    );
    let (mut ws, attached) = gw.attach(&id, &token, json!({"last_seq": 0})).await;
    assert_eq!(attached["queued_turns"], 0, "{attached}");
    detach(&mut ws).await;
    let (_ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 0, "{attached}");
}

#[tokio::test]
async fn a_last_seq_beyond_every_issued_seq_acknowledges_nothing() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    for i in 1..=3 {
        gw.push(&id, &token, &format!("kept {i}")).await;
    }
    // Far beyond the three seqs issued, then beyond i64 (which once closed the socket with 1011).
    for claimed in [json!(1000), json!(1u64 << 63), json!(u64::MAX)] {
        let (mut ws, attached) = gw
            .attach(&id, &token, json!({"last_seq": claimed.clone()}))
            .await;
        assert_eq!(attached["queued_turns"], 3, "{claimed}: {attached}");
        assert_eq!(attached["last_seq_reset"], true, "{attached}");
        let turns = tether_turns(&mut ws, 3).await;
        assert_eq!(contents(&turns), ["kept 1", "kept 2", "kept 3"]);
        detach(&mut ws).await;
    }
    // A re-attach on the same connection with a wild position redelivers everything too.
    let (mut ws, attached) = gw.attach(&id, &token, json!({"last_seq": 0})).await;
    assert!(attached.get("last_seq_reset").is_none(), "{attached}");
    let first = tether_turns(&mut ws, 3).await;
    ws.send(
        json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token,
        "last_seq": 5000}),
    )
    .await;
    let again = ws.recv().await;
    assert_eq!(again["type"], "SESSION_ATTACHED", "{again}");
    assert_eq!(again["last_seq_reset"], true, "{again}");
    assert_eq!(seqs(&tether_turns(&mut ws, 3).await), seqs(&first));
    // A genuine position still acknowledges what it covers.
    let second = seqs(&first)[1];
    detach(&mut ws).await;
    let (mut ws, attached) = gw.attach(&id, &token, json!({"last_seq": second})).await;
    assert_eq!(attached["queued_turns"], 1, "{attached}");
    assert_eq!(contents(&tether_turns(&mut ws, 1).await), ["kept 3"]);
}

#[tokio::test]
async fn unacknowledged_turns_stay_queued_in_ack_mode() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    for i in 1..=3 {
        gw.push(&id, &token, &format!("a{i}")).await;
    }
    let (mut ws, _) = gw.attach(&id, &token, json!({"last_seq": 0})).await;
    let first = tether_turns(&mut ws, 3).await;
    detach(&mut ws).await;
    // Sent but not acknowledged: all three come again.
    let (mut ws, attached) = gw.attach(&id, &token, json!({"last_seq": 0})).await;
    assert_eq!(attached["queued_turns"], 3, "{attached}");
    let again = tether_turns(&mut ws, 3).await;
    assert_eq!(seqs(&again), seqs(&first));

    // After an ACK empties the queue, new turns get higher seqs, so an old last_seq drops nothing.
    let last = seqs(&again)[2];
    ws.send(json!({"type": "ACK", "seq": last})).await;
    detach(&mut ws).await;
    gw.push(&id, &token, "a4").await;
    let (mut ws, attached) = gw.attach(&id, &token, json!({"last_seq": last})).await;
    assert_eq!(attached["queued_turns"], 1, "{attached}");
    let newer = tether_turns(&mut ws, 1).await;
    assert_eq!(contents(&newer), ["a4"]);
    assert!(newer[0]["seq"].as_u64().expect("seq") > last);
}

#[tokio::test]
async fn live_turns_in_ack_mode_wait_for_their_ack() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({"last_seq": 0})).await;
    let pushed = gw.push(&id, &token, "live but unacked").await;
    let (text, complete) = ws.live_turn().await;
    assert_eq!(text, "live but unacked");
    let seq = complete["seq"]
        .as_u64()
        .expect("TURN_COMPLETE carries the seq");
    assert_eq!(pushed["seq"], seq);
    detach(&mut ws).await;

    let (mut ws, attached) = gw.attach(&id, &token, json!({"last_seq": 0})).await;
    assert_eq!(attached["queued_turns"], 1, "{attached}");
    let again = tether_turns(&mut ws, 1).await;
    assert_eq!(
        (again[0]["content"].clone(), again[0]["seq"].clone()),
        (json!("live but unacked"), json!(seq))
    );
    // The redelivered turn names the chunk_id it streamed under, so a client can match the two.
    assert_eq!(again[0]["chunk_id"], complete["chunk_id"], "{}", again[0]);
    ws.send(json!({"type": "ACK", "seq": seq})).await;
    detach(&mut ws).await;
    let (_ws, attached) = gw.attach(&id, &token, json!({"last_seq": 0})).await;
    assert_eq!(attached["queued_turns"], 0, "{attached}");
}

#[tokio::test]
async fn without_ack_delivered_turns_are_not_redelivered() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    for i in 1..=4 {
        gw.push(&id, &token, &format!("once {i}")).await;
    }
    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 4);
    tether_turns(&mut ws, 4).await;
    ws.close_abruptly().await;
    gw.wait_suspended(&id, &token).await;
    gw.push(&id, &token, "once 5").await;
    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 1, "{attached}");
    assert_eq!(contents(&tether_turns(&mut ws, 1).await), ["once 5"]);
}

#[tokio::test]
async fn unclean_disconnect_suspends_and_tethers() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (ws, _) = gw.attach(&id, &token, json!({})).await;
    ws.close_abruptly().await;
    gw.wait_suspended(&id, &token).await;

    let pushed = gw.push(&id, &token, "while you were gone").await;
    assert_eq!(pushed["delivery"], "tethered", "{pushed}");
    let (status, body) = say(
        &gw,
        &token,
        "background work",
        json!({"resume": true}),
        false,
    )
    .await;
    assert_eq!(status, 200, "{body}");

    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 2, "{attached}");
    assert_eq!(
        contents(&tether_turns(&mut ws, 2).await),
        ["while you were gone", "Echo: background work"]
    );
    assert_eq!(gw.session_view(&id, &token).await["status"], "running");
}

#[tokio::test]
async fn tether_survives_a_gateway_restart() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    for i in 1..=3 {
        gw.push(&id, &token, &format!("durable {i}")).await;
    }
    let dir: Arc<tempfile::TempDir> = gw.stop().await;

    let gw = TestGateway::with(Options {
        dir: Some(dir),
        ..Options::default()
    })
    .await;
    assert_eq!(
        gw.session_view(&id, &token).await["tether_turns_pending"],
        3
    );
    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 3, "{attached}");
    assert_eq!(
        contents(&tether_turns(&mut ws, 3).await),
        ["durable 1", "durable 2", "durable 3"]
    );
}

#[tokio::test]
async fn session_view_tracks_the_tether_and_the_surface() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    for i in 1..=3 {
        gw.push(&id, &token, &format!("v{i}")).await;
    }
    let view = gw.session_view(&id, &token).await;
    assert_eq!(view["tether_turns_pending"], 3, "{view}");
    assert_eq!(view["queued_turns"], 3, "{view}");
    assert_eq!(view["surface_attached"], false, "{view}");

    let (mut ws, _) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"device_type": "iot"}}),
        )
        .await;
    tether_turns(&mut ws, 3).await;
    let view = gw
        .wait_view(&id, &token, "the drain to be recorded", |v| {
            v["tether_turns_pending"] == 0
        })
        .await;
    assert_eq!(view["surface_attached"], true, "{view}");
    assert_eq!(view["surface"]["device_type"], "iot", "{view}");
    assert_eq!(view["tether_enabled"], true, "{view}");

    detach(&mut ws).await;
    let view = gw.wait_suspended(&id, &token).await;
    assert_eq!(view["tether_turns_pending"], 0, "{view}");
}

#[tokio::test]
async fn gateway_shutdown_closes_surfaces_and_the_session_resumes_after_restart() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    let dir = gw.stop().await;
    ws.expect_close(1001).await;

    let gw = TestGateway::with(Options {
        dir: Some(dir),
        ..Options::default()
    })
    .await;
    let view = gw.session_view(&id, &token).await;
    assert_eq!(
        (view["status"].clone(), view["surface_attached"].clone()),
        (json!("suspended"), json!(false)),
        "{view}"
    );
    let pushed = gw.push(&id, &token, "after the restart").await;
    assert_eq!(pushed["delivery"], "tethered", "{pushed}");
    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 1, "{attached}");
    assert_eq!(
        contents(&tether_turns(&mut ws, 1).await),
        ["after the restart"]
    );
}

#[tokio::test]
async fn turn_outliving_the_first_attach_is_tethered() {
    let gw = TestGateway::with_fake().await;
    let (id, token) = gw.session().await;
    let text = "long job [[fake:slow=1000]]";
    let req = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.url))
        .header("x-session-token", &token)
        .json(&json!({"model": "gpt-4o", "messages": [{"role": "user", "content": text}]}));
    let turn = tokio::spawn(async move {
        crate::support::response(req.send().await.expect("request sent")).await
    });
    // The upstream has the request: the turn has begun (and read the session) before the attach.
    let deadline = tokio::time::Instant::now() + crate::support::WAIT;
    while !gw
        .fake()
        .requests()
        .iter()
        .any(|r| r.to_string().contains("long job"))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the turn never reached the upstream"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    detach(&mut ws).await;
    gw.wait_suspended(&id, &token).await;
    assert!(
        !turn.is_finished(),
        "the upstream answered before the detach: raise slow="
    );

    let (status, _, body) = turn.await.expect("turn task");
    assert_eq!(status, 200, "{body}");
    let reply = body["choices"][0]["message"]["content"]
        .as_str()
        .expect("reply")
        .to_owned();
    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(
        attached["queued_turns"], 1,
        "the reply finished after the surface left: {attached}"
    );
    assert_eq!(contents(&tether_turns(&mut ws, 1).await), [reply.as_str()]);
}

#[tokio::test]
async fn a_push_retried_with_its_idempotency_key_is_stored_once() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let path = format!("/v1/sbp/sessions/{id}/turns");
    let keyed = |key: &'static str| {
        [
            ("x-session-token", token.as_str()),
            ("idempotency-key", key),
        ]
    };
    let (s, headers, first) = gw
        .post(
            &path,
            json!({"content": "once", "role": "assistant"}),
            &keyed("push-1"),
        )
        .await;
    assert_eq!(s, 201, "{first}");
    assert!(headers.get("idempotent-replayed").is_none());
    // The retry (keys in another order) replays the first answer's seq; nothing is pushed again.
    let (s, headers, again) = gw
        .post(
            &path,
            json!({"role": "assistant", "content": "once"}),
            &keyed("push-1"),
        )
        .await;
    assert_eq!(s, 201, "{again}");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(again["seq"], first["seq"], "{again}");
    // Another body under the same key is refused; a new key pushes a new turn.
    let (s, _, reused) = gw
        .post(&path, json!({"content": "twice"}), &keyed("push-1"))
        .await;
    assert_eq!(s, 422, "{reused}");
    assert_eq!(reused["error"]["code"], "SBP_IDEMPOTENCY_KEY_REUSED");
    let (s, _, second) = gw
        .post(&path, json!({"content": "second"}), &keyed("push-2"))
        .await;
    assert_eq!(s, 201, "{second}");
    assert!(second["seq"].as_u64() > first["seq"].as_u64(), "{second}");

    let (_, page) = gw
        .get(
            &format!("/v1/sessions/{id}/messages"),
            &[("x-session-token", token.as_str())],
        )
        .await;
    let stored: Vec<&str> = page["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|m| m["content"].as_str())
        .collect();
    assert_eq!(stored[stored.len() - 2..], ["once", "second"], "{page}");
    let (mut ws, attached) = gw.attach(&id, &token, json!({})).await;
    assert_eq!(attached["queued_turns"], 2, "{attached}");
    assert_eq!(
        contents(&tether_turns(&mut ws, 2).await),
        ["once", "second"]
    );
}
