//! Several `sbp serve` processes as replicas of one deployment (one PostgreSQL schema, one Redis
//! bus, 0.2 s heartbeats, dead after 1 s): a turn on one replica streams live to the surface held
//! by another, tool calls (model, backend and MCP) go to that surface and their results come back,
//! tethered turns drain on whichever replica the surface attaches to next, one surface per session
//! across replicas (racing attaches, a surface moving mid-turn, a displacement lost in a bus
//! blip, then a turn or a detach before the next registry pass), deltas lost in a bus blip,
//! failover after `kill -9`, graceful SIGTERM with turns still running, and the flags that refuse
//! a replicated setup that cannot work.

use std::os::unix::process::ExitStatusExt as _;
use std::time::Duration;

use rmcp::ServiceExt as _;
use rmcp::model::CallToolRequestParams;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use sbp_fake_llm::FakeLlm;
use serde_json::{Value, json};

use crate::support::{
    Deployment, Proc, Sbp, WAIT, Ws, WsEvent, eventually, msg, reply_text, sbp_serve_in, send,
    strip_ansi, test_database_url, test_redis_url,
};

/// The model every request names (the fake upstream only echoes it back).
const MODEL: &str = "gpt-test";
/// The surface's GPS fix, and the exact text the model gets for it.
const GPS_FIX: &str = r#"{"lat":35.68,"lon":139.76}"#;

/// A completion request to `gw` with one user message; the keys of `extra` are added to the body.
fn ask(gw: &Sbp, token: Option<&str>, text: &str, extra: Value) -> reqwest::RequestBuilder {
    let mut body = json!({"model": MODEL, "messages": [msg("user", text)]});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    let req = gw.post("/v1/chat/completions", &body);
    match token {
        Some(t) => req.header("x-session-token", t),
        None => req,
    }
}

/// A turn of the session through `gw`, expecting 200; returns the body.
async fn turn(gw: &Sbp, token: &str, text: &str) -> Value {
    let (status, _, body) = send(ask(gw, Some(token), text, json!({}))).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// A new session with one turn, through `gw`: (id, token).
async fn new_session(gw: &Sbp) -> (String, String) {
    let (status, headers, body) = send(ask(gw, None, "hello", json!({}))).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(reply_text(&body), "echo: hello");
    let token = headers
        .get("x-session-token")
        .and_then(|v| v.to_str().ok())
        .expect("a new session's token")
        .to_owned();
    let id = body["sbp"]["session_id"].as_str().expect("id").to_owned();
    (id, token)
}

/// One live turn as a surface received it.
struct LiveTurn {
    chunk_id: String,
    /// The TURN_CHUNK deltas in arrival order.
    deltas: Vec<String>,
    complete: Value,
}

impl LiveTurn {
    fn text(&self) -> String {
        self.deltas.concat()
    }
}

/// Reads one live turn: TURN_CHUNKs of one chunk_id, then its TURN_COMPLETE. Chunks of `skip` (a
/// turn cut off earlier) are passed over; any other frame fails the test.
async fn live_turn(ws: &mut Ws, skip: Option<&str>) -> LiveTurn {
    let mut chunk_id: Option<String> = None;
    let mut deltas = Vec::new();
    loop {
        let f = ws.recv().await;
        let id = f["chunk_id"].as_str().unwrap_or_default().to_owned();
        match f["type"].as_str() {
            Some("TURN_CHUNK") if skip == Some(id.as_str()) => {}
            Some("TURN_CHUNK") => {
                let first = chunk_id.get_or_insert_with(|| id.clone());
                assert_eq!(*first, id, "one turn's chunks share its chunk_id: {f}");
                let delta = f["delta"].as_str().expect("delta");
                assert!(!delta.is_empty(), "{f}");
                deltas.push(delta.to_owned());
            }
            Some("TURN_COMPLETE") => {
                if let Some(c) = &chunk_id {
                    assert_eq!(*c, id, "TURN_COMPLETE names the streamed turn: {f}");
                }
                return LiveTurn {
                    chunk_id: id,
                    deltas,
                    complete: f,
                };
            }
            _ => panic!("a frame of a live turn expected, got {f}"),
        }
    }
}

fn gps_schema() -> Value {
    json!({
        "type": "object",
        "properties": {"accuracy": {"type": "string", "enum": ["low", "high"]}},
        "required": ["accuracy"]
    })
}

/// A surface declaring `gps` with a description and schema.
fn phone_context() -> Value {
    json!({
        "device_type": "phone",
        "mcp_tools": ["gps"],
        "mcp_tool_schemas": [
            {"name": "gps", "description": "The device's position.", "input_schema": gps_schema()}
        ]
    })
}

/// (role, content) pairs.
fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(r, c)| ((*r).to_owned(), (*c).to_owned()))
        .collect()
}

/// A surface attached to replica A receives, live and in order, the chunks of a turn that runs on
/// replica B, then its TURN_COMPLETE; B answers the HTTP caller with the same text.
#[tokio::test]
async fn turn_on_one_replica_streams_live_to_the_surface_on_another() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    assert_ne!(a.replica_id(), b.replica_id());

    let (id, token) = new_session(&b).await;
    let (mut ws, attached) = a.attach(&id, &token).await;
    assert_eq!(attached["queued_turns"], 0, "{attached}");
    let view = b.session(&id, &token).await;
    assert_eq!(
        view["surface_attached"], true,
        "B sees the surface held by A: {view}"
    );

    let reply = "Every replica passes the chunks along in the order they were written.";
    let prompt = format!("stream it [[fake:reply={reply}]] [[fake:chunks=5]]");
    let body = turn(&b, &token, &prompt).await;
    assert_eq!(reply_text(&body), reply);
    assert_eq!(body["sbp"]["session_id"], id.as_str());

    let live = live_turn(&mut ws, None).await;
    assert_eq!(
        live.deltas.len(),
        5,
        "each upstream chunk arrives as it was streamed (none re-sent whole at the end): {:?}",
        live.deltas
    );
    assert_eq!(live.text(), reply, "the chunks, in order, are the reply");
    assert!(live.complete["seq"].is_u64(), "{}", live.complete);
    assert_eq!(live.complete["model_used"], MODEL, "{}", live.complete);

    // Again, the other way round: the session's next turn runs on A, where the surface is.
    let body = turn(&a, &token, "and here? [[fake:chunks=3]]").await;
    let live = live_turn(&mut ws, None).await;
    assert_eq!(live.deltas.len(), 3, "{:?}", live.deltas);
    assert_eq!(live.text(), "echo: and here?");
    assert_eq!(reply_text(&body), "echo: and here?");

    // A backend's pushed turn through B reaches the surface on A whole, with its seq.
    let pushed = b.push(&id, &token, "a result from the backend").await;
    assert_eq!(pushed["delivery"], "live", "{pushed}");
    let live = live_turn(&mut ws, None).await;
    assert_eq!(live.text(), "a result from the backend");
    assert_eq!(live.complete["seq"], pushed["seq"], "{}", live.complete);
}

/// The model of a turn on replica B calls a tool of the surface attached to replica A: A's socket
/// gets the TOOL_CALL, the surface's TOOL_RESULT goes back to B, and B's answer is the model's
/// reply to it. A backend's direct tool call through B reaches the surface on A as well, with its
/// result, error or timeout.
#[tokio::test]
async fn tool_calls_reach_the_surface_on_another_replica() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    let (id, token) = new_session(&b).await;
    let (mut ws, attached) = a.attach_surface(&id, &token, json!({})).await;
    assert_eq!(attached["mcp_tools_registered"], json!([]), "{attached}");
    let gps_call = json!({"tool_name": "gps", "tool_input": {}});
    let (status, _, refused) = send(
        b.post(&format!("/v1/sbp/sessions/{id}/tool_calls"), &gps_call)
            .header("x-session-token", &token),
    )
    .await;
    assert_eq!(status, 409, "no surface declared gps yet: {refused}");
    // The surface declares its tool with a repeated ATTACH_SESSION on the same socket; B learns it,
    // schema and description included.
    ws.send(
        json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token,
                   "surface_context": phone_context()}),
    )
    .await;
    let attached = ws.recv().await;
    assert_eq!(attached["type"], "SESSION_ATTACHED", "{attached}");
    assert_eq!(
        attached["mcp_tools_registered"],
        json!(["gps"]),
        "{attached}"
    );

    let in_flight = tokio::spawn(send(ask(
        &b,
        Some(&token),
        r#"where am I? [[fake:tool=surface_gps:{"accuracy":"high"}]]"#,
        json!({}),
    )));
    let call = ws.recv().await;
    assert_eq!(call["type"], "TOOL_CALL", "{call}");
    assert_eq!(call["tool_name"], "gps", "{call}");
    assert_eq!(call["tool_input"], json!({"accuracy": "high"}), "{call}");
    ws.send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"],
                   "result": serde_json::from_str::<Value>(GPS_FIX).expect("json")}))
        .await;
    let expected = format!("tool result: {GPS_FIX}");
    let live = live_turn(&mut ws, None).await;
    assert_eq!(live.text(), expected);
    let (status, _, body) = in_flight.await.expect("turn task");
    assert_eq!(status, 200, "{body}");
    assert_eq!(reply_text(&body), expected);

    let requests = fake.requests();
    assert_eq!(
        requests.len(),
        3,
        "hello, the tool round, the answer: {requests:?}"
    );
    let offered = requests[1]["tools"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["function"]["name"] == "surface_gps"))
        .unwrap_or_else(|| panic!("B offers the surface's tool: {}", requests[1]));
    assert_eq!(offered["function"]["parameters"], gps_schema(), "{offered}");
    assert_eq!(
        offered["function"]["description"],
        "The device's position. (runs on the user's phone device)",
        "{offered}"
    );
    let last = requests[2]["messages"]
        .as_array()
        .and_then(|m| m.last())
        .cloned()
        .unwrap_or_default();
    assert_eq!(last["role"], "tool", "{last}");
    assert_eq!(last["content"], GPS_FIX, "{last}");
    let stored = a.messages(&id, &token).await;
    let roles: Vec<&str> = stored.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(
        roles,
        [
            "user",
            "assistant",
            "user",
            "assistant",
            "tool",
            "assistant"
        ],
        "{stored:?}"
    );
    assert_eq!(stored[4].1, GPS_FIX);

    // A backend calls the tool directly through B: a result, an error, and silence (timeout).
    let direct = |input: Value, timeout_ms: u64| {
        tokio::spawn(send(
            b.post(
                &format!("/v1/sbp/sessions/{id}/tool_calls"),
                &json!({"tool_name": "gps", "tool_input": input, "timeout_ms": timeout_ms}),
            )
            .header("x-session-token", &token),
        ))
    };
    let pending = direct(json!({"zoom": 3}), 5_000);
    let call = ws.recv().await;
    assert_eq!(call["type"], "TOOL_CALL", "{call}");
    assert_eq!(call["tool_input"], json!({"zoom": 3}), "{call}");
    ws.send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": {"lat": 1.5}}))
        .await;
    let (status, _, out) = pending.await.expect("call task");
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["status"], "ok", "{out}");
    assert_eq!(out["result"], json!({"lat": 1.5}), "{out}");
    assert_eq!(out["call_id"], call["call_id"], "{out}");
    assert_eq!(out["tool_name"], "gps", "{out}");

    let pending = direct(json!({}), 5_000);
    let call = ws.recv().await;
    assert_eq!(call["type"], "TOOL_CALL", "{call}");
    ws.send(
        json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": null,
                   "error": "gps switched off"}),
    )
    .await;
    let (status, _, out) = pending.await.expect("call task");
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        (&out["status"], &out["error"], &out["result"]),
        (&json!("error"), &json!("gps switched off"), &Value::Null),
        "{out}"
    );

    let pending = direct(json!({}), 300);
    let call = ws.recv().await;
    assert_eq!(call["type"], "TOOL_CALL", "{call}");
    assert_eq!(call["timeout_ms"], 300, "{call}");
    let (status, _, out) = pending.await.expect("call task");
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["status"], "timeout", "{out}");
    // The late answer changes nothing, and the next call still works.
    ws.send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": {"late": true}}))
        .await;
    let pending = direct(json!({"again": true}), 5_000);
    let call = ws.recv().await;
    assert_eq!(call["tool_input"], json!({"again": true}), "{call}");
    ws.send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": "fine"}))
        .await;
    let (status, _, out) = pending.await.expect("call task");
    assert_eq!((status, &out["result"]), (200, &json!("fine")), "{out}");

    // An MCP client of the session, connected to B, lists and calls the tools of the surface on A.
    let config = StreamableHttpClientTransportConfig::with_uri(format!(
        "{}/v1/sbp/sessions/{id}/mcp",
        b.url
    ))
    .auth_header(token.clone());
    let mcp =
        ().serve(StreamableHttpClientTransport::from_config(config))
            .await
            .expect("rmcp client initializes against B");
    let tools = mcp.list_all_tools().await.expect("tools/list");
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(names, ["gps"], "{tools:?}");
    assert_eq!(
        Value::Object((*tools[0].input_schema).clone()),
        gps_schema()
    );
    let arguments = json!({"accuracy": "low"})
        .as_object()
        .cloned()
        .unwrap_or_default();
    let surface = async {
        let call = ws.recv().await;
        assert_eq!(call["type"], "TOOL_CALL", "{call}");
        assert_eq!(call["tool_input"], json!({"accuracy": "low"}), "{call}");
        ws.send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": {"lat": 2.5}}))
            .await;
    };
    let (result, ()) = tokio::join!(
        mcp.call_tool(CallToolRequestParams::new("gps").with_arguments(arguments)),
        surface
    );
    let result = result.expect("tools/call");
    assert_eq!(result.is_error, Some(false), "{result:?}");
    assert_eq!(
        result.structured_content,
        Some(json!({"lat": 2.5})),
        "{result:?}"
    );
    mcp.cancel().await.expect("MCP client closes");

    // A surface attaching on B displaces A's while a call waits on it: the call ends at once
    // (well before its 30 s timeout) as "disconnected", and the next call goes to the new surface.
    let pending = direct(json!({"last": true}), 30_000);
    let call = ws.recv().await;
    assert_eq!(call["type"], "TOOL_CALL", "{call}");
    let (mut moved, _) = b
        .attach_surface(&id, &token, json!({"mcp_tools": ["gps"]}))
        .await;
    assert_eq!(ws.closed().await, Some(4409));
    let (status, _, out) = pending.await.expect("call task");
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["status"], "disconnected", "{out}");
    let pending = direct(json!({"moved": true}), 5_000);
    let call = moved.recv().await;
    assert_eq!(call["tool_input"], json!({"moved": true}), "{call}");
    moved
        .send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": "here"}))
        .await;
    let (status, _, out) = pending.await.expect("call task");
    assert_eq!((status, &out["result"]), (200, &json!("here")), "{out}");
}

/// A surface detaches from A; two turns through B go to the tether; a surface attaching to C
/// drains them in order; then a turn through A streams live to C.
#[tokio::test]
async fn turns_tethered_while_away_drain_on_another_replica_in_order() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (a, b, c) = tokio::join!(dep.replica("a"), dep.replica("b"), dep.replica("c"));
    let (id, token) = new_session(&b).await;
    let (mut ws, _) = a.attach(&id, &token).await;
    ws.send(json!({"type": "DETACH"})).await;
    assert_eq!(ws.closed().await, Some(1000));
    // A suspends the session after the close; wait until B sees it.
    let (bref, idref, tokref) = (&b, id.as_str(), token.as_str());
    eventually(WAIT, "B sees the session suspended", move || async move {
        let view = bref.session(idref, tokref).await;
        (view["status"] == "suspended" && view["surface_attached"] == false).then_some(())
    })
    .await;

    let away = ["first thing while away", "second thing while away"];
    for text in away {
        let (status, _, body) = send(ask(
            &b,
            Some(&token),
            text,
            json!({"sbp": {"resume": true}}),
        ))
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(reply_text(&body), format!("echo: {text}"));
    }
    let view = b.session(&id, &token).await;
    assert_eq!(view["tether_turns_pending"], 2, "{view}");

    let (mut ws, attached) = c.attach(&id, &token).await;
    assert_eq!(attached["queued_turns"], 2, "{attached}");
    let mut seqs = Vec::new();
    for (index, text) in away.iter().enumerate() {
        let f = ws.recv().await;
        assert_eq!(f["type"], "TETHER_TURN", "{f}");
        assert_eq!(f["turn_index"], index, "{f}");
        assert_eq!(f["role"], "assistant", "{f}");
        assert_eq!(f["content"], format!("echo: {text}"), "{f}");
        seqs.push(f["seq"].as_u64().expect("seq"));
    }
    assert!(seqs[0] < seqs[1], "{seqs:?}");

    let body = turn(&a, &token, "live again [[fake:chunks=3]]").await;
    assert_eq!(reply_text(&body), "echo: live again");
    let live = live_turn(&mut ws, None).await;
    assert_eq!(live.deltas.len(), 3, "{:?}", live.deltas);
    assert_eq!(live.text(), "echo: live again");
    let seq = live.complete["seq"].as_u64().expect("seq");
    assert!(seq > seqs[1], "{seq} after {seqs:?}");
}

/// The surface moves from replica C to replica B while a turn on A streams to it: C's socket gets
/// the first chunks and then 4409; B gets the turn once, whole, when it completes (its live
/// stream went to C, so B cannot be sent just the rest).
#[tokio::test]
async fn surface_moving_mid_turn_gets_the_turn_whole_on_its_new_replica() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (a, b, c) = tokio::join!(dep.replica("a"), dep.replica("b"), dep.replica("c"));
    let (id, token) = new_session(&a).await;
    let (mut old, _) = c.attach(&id, &token).await;

    let story = "moving house [[fake:chunks=6]] [[fake:chunk_delay=200]]";
    let in_flight = tokio::spawn(send(ask(&a, Some(&token), story, json!({}))));
    let first = old.recv().await;
    assert_eq!(first["type"], "TURN_CHUNK", "{first}");
    let (mut new, attached) = b.attach(&id, &token).await;
    let moved_before_the_end = attached["queued_turns"] == 0;
    loop {
        match old.next_event().await {
            WsEvent::Frame(f) => {
                assert_eq!(f["type"], "TURN_CHUNK", "only chunks before the close: {f}");
                assert_eq!(f["chunk_id"], first["chunk_id"], "{f}");
            }
            WsEvent::Closed(code) => {
                assert_eq!(code, Some(4409));
                break;
            }
        }
    }
    let (status, _, body) = in_flight.await.expect("turn task");
    assert_eq!(status, 200, "{body}");
    assert_eq!(reply_text(&body), "echo: moving house");
    if moved_before_the_end {
        let live = live_turn(&mut new, None).await;
        assert_eq!(
            live.chunk_id,
            first["chunk_id"].as_str().unwrap_or_default()
        );
        assert_eq!(live.text(), "echo: moving house", "{:?}", live.deltas);
    } else {
        // A very slow machine: the turn was complete before B attached, and drained there.
        let drained = new.recv().await;
        assert_eq!(drained["type"], "TETHER_TURN", "{drained}");
        assert_eq!(drained["content"], "echo: moving house", "{drained}");
    }
    // Nothing else follows: the next frame on B is the next turn.
    turn(&c, &token, "settled in").await;
    let next = live_turn(&mut new, None).await;
    assert_eq!(next.text(), "echo: settled in");
}

/// `kill -9` of replica A while its turn streams to the surface on B: once A stops heartbeating,
/// B marks the turn failed, so a retry with the same Idempotency-Key runs it again (on B, live to
/// the surface on B) instead of answering 409 forever; the user's message is stored once.
#[tokio::test]
async fn turn_of_a_killed_replica_is_failed_and_can_be_retried_on_another() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (mut a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    let (id, token) = new_session(&b).await;
    let (mut ws, _) = b.attach(&id, &token).await;

    let story = "tell me a story [[fake:chunks=6]] [[fake:chunk_delay=150]]";
    let key = format!("story-{id}");
    let keyed = |gw: &Sbp| ask(gw, Some(&token), story, json!({})).header("idempotency-key", &key);
    let in_flight = tokio::spawn(keyed(&a).send());
    let first = ws.recv().await;
    assert_eq!(
        first["type"], "TURN_CHUNK",
        "A streams to B's surface: {first}"
    );
    let cut = first["chunk_id"].as_str().expect("chunk_id").to_owned();

    let status = a.proc.kill9();
    assert_eq!(status.signal(), Some(9), "{status}");
    let answer = tokio::time::timeout(WAIT, in_flight)
        .await
        .expect("the caller learns of the kill")
        .expect("task");
    assert!(answer.is_err(), "never answered: {answer:?}");

    let killed = tokio::time::Instant::now();
    let (status, headers, body) =
        eventually(WAIT, "the retry runs once A's turn is failed", || async {
            let out = send(keyed(&b)).await;
            (out.0 != 409).then_some(out)
        })
        .await;
    eprintln!("retry accepted {:?} after the kill", killed.elapsed());
    assert_eq!(status, 200, "{body}");
    assert!(
        headers.get("idempotent-replayed").is_none(),
        "a new answer, not a replay"
    );
    assert_eq!(reply_text(&body), "echo: tell me a story");
    let live = live_turn(&mut ws, Some(&cut)).await;
    assert_ne!(live.chunk_id, cut);
    assert_eq!(live.deltas.len(), 6, "{:?}", live.deltas);
    assert_eq!(live.text(), "echo: tell me a story");
    assert_eq!(
        b.messages(&id, &token).await,
        pairs(&[
            ("user", "hello"),
            ("assistant", "echo: hello"),
            ("user", story),
            ("assistant", "echo: tell me a story"),
        ]),
        "the retried turn's message is stored once, with one reply"
    );
    let (status, headers, again) = send(keyed(&b)).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        headers
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok()),
        Some("true")
    );
    assert_eq!(reply_text(&again), "echo: tell me a story");

    let body = turn(&b, &token, "still there? [[fake:chunks=2]]").await;
    assert_eq!(reply_text(&body), "echo: still there?");
    assert_eq!(live_turn(&mut ws, None).await.text(), "echo: still there?");
}

/// `kill -9` of the replica holding the surface while a turn on B waits for one of its tool
/// calls: the call ends as "surface disconnected" once A stops heartbeating (well before the
/// 30 s tool timeout) and the turn completes; it and a turn pushed later are tethered; the
/// surface reconnects to B, drains them in order and gets the next turn live.
#[tokio::test]
async fn surface_of_a_killed_replica_reconnects_to_another_and_drains() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (mut a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    let (id, token) = new_session(&b).await;
    let (mut ws, _) = a
        .attach_surface(&id, &token, json!({"mcp_tools": ["gps"]}))
        .await;
    turn(&b, &token, "are you on A? [[fake:chunks=2]]").await;
    assert_eq!(live_turn(&mut ws, None).await.text(), "echo: are you on A?");

    let waiting = tokio::spawn(send(ask(
        &b,
        Some(&token),
        "where am I? [[fake:tool=surface_gps]]",
        json!({}),
    )));
    let call = ws.recv().await;
    assert_eq!(call["type"], "TOOL_CALL", "{call}");
    let status = a.proc.kill9();
    assert_eq!(status.signal(), Some(9), "{status}");
    assert_eq!(
        ws.closed().await,
        None,
        "a killed gateway sends no close frame"
    );
    let (status, _, body) = waiting.await.expect("turn task");
    assert_eq!(status, 200, "{body}");
    let answer = r#"tool result: {"error":"surface disconnected"}"#;
    assert_eq!(reply_text(&body), answer);

    let (bref, idref, tokref) = (&b, id.as_str(), token.as_str());
    eventually(WAIT, "B stops seeing A's surface", move || async move {
        let view = bref.session(idref, tokref).await;
        (view["surface_attached"] == false).then_some(())
    })
    .await;
    let pushed = b.push(&id, &token, "a background result").await;
    assert_eq!(pushed["delivery"], "tethered", "{pushed}");

    let (mut ws, attached) = b.attach(&id, &token).await;
    assert_eq!(attached["queued_turns"], 2, "{attached}");
    let missed = ws.recv().await;
    assert_eq!(missed["type"], "TETHER_TURN", "{missed}");
    assert_eq!(missed["content"], answer, "{missed}");
    let background = ws.recv().await;
    assert_eq!(background["type"], "TETHER_TURN", "{background}");
    assert_eq!(background["content"], "a background result", "{background}");
    assert_eq!(background["seq"], pushed["seq"], "{background}");
    assert!(
        missed["seq"].as_u64() < background["seq"].as_u64(),
        "{missed} {background}"
    );

    turn(&b, &token, "back on B [[fake:chunks=2]]").await;
    assert_eq!(live_turn(&mut ws, None).await.text(), "echo: back on B");
}

/// Replica A's pub/sub connection to Redis drops (a network blip) just as a surface on B takes the
/// session over from A's surface, so the displacement notice published for A is lost (pub/sub is
/// at-most-once). A must still learn that it no longer holds the session once its subscription is
/// back: its surface is closed with 4409, and A's own turns go to the surface on B.
#[tokio::test]
async fn displacement_lost_in_a_bus_blip_still_closes_the_old_surface() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    let (id, token) = new_session(&b).await;
    let (mut old, _) = a.attach(&id, &token).await;

    assert_eq!(
        dep.cut_subscription(a.proc.pid()),
        1,
        "A has one pub/sub connection"
    );
    let (mut new, _) = b.attach(&id, &token).await;
    let event = old.next_event_within(WAIT).await;
    let a_log = || {
        strip_ansi(&a.proc.stderr())
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("bus"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(
        matches!(event, Some(WsEvent::Closed(Some(4409)))),
        "the surface on A is displaced, got {event:?}; A's log:\n{}",
        a_log()
    );

    turn(&a, &token, "who gets this? [[fake:chunks=2]]").await;
    assert_eq!(
        live_turn(&mut new, None).await.text(),
        "echo: who gets this?"
    );
}

/// SIGTERM of replica A while a turn runs there whose caller has gone (the turn goes on as its
/// own task): A finishes the turn before it exits, so the surface on B gets all of it and the turn
/// is recorded done; B must not count A as dead meanwhile (A keeps heartbeating until its turns
/// are over), or B would fail the turn under A's feet and a retry would run it twice.
#[tokio::test]
async fn sigterm_lets_a_replica_finish_a_turn_whose_caller_left() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (mut a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    let (id, token) = new_session(&b).await;
    let (mut ws, _) = b.attach(&id, &token).await;

    // 10 chunks 250 ms apart: the turn outlives A's 1 s replica timeout by far.
    let story = "a long story [[fake:chunks=10]] [[fake:chunk_delay=250]]";
    let key = format!("long-{id}");
    // Streamed, so that A notices at its next write that the caller left.
    let keyed = |gw: &Sbp| {
        ask(gw, Some(&token), story, json!({"stream": true})).header("idempotency-key", &key)
    };
    let caller = tokio::time::timeout(WAIT, keyed(&a).send())
        .await
        .expect("response headers within the wait")
        .expect("request sent");
    assert_eq!(caller.status(), 200);
    let first = ws.recv().await;
    assert_eq!(first["type"], "TURN_CHUNK", "{first}");
    drop(caller);
    a.proc.sigterm();
    let status = a.proc.wait_exit(WAIT).await;
    assert_eq!(status.code(), Some(0), "{status}");

    let (status, headers, body) = send(keyed(&b)).await;
    let failed_by_b: Vec<String> = strip_ansi(&b.proc.stderr())
        .lines()
        .filter(|l| l.contains("marked failed"))
        .map(str::to_owned)
        .collect();
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        headers
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok()),
        Some("true"),
        "the turn A finished before exiting is done, not failed and run again; B's log: \
         {failed_by_b:#?}"
    );
    // A streamed request's replay is a stream again (issue 16).
    let replayed: String = sbp_test_support::sse_data(body.as_str().unwrap_or_default())
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(replayed, "echo: a long story", "{body}");
    let rest = live_turn(&mut ws, None).await;
    assert_eq!(
        rest.chunk_id,
        first["chunk_id"].as_str().unwrap_or_default()
    );
    let text = format!(
        "{}{}",
        first["delta"].as_str().unwrap_or_default(),
        rest.text()
    );
    assert_eq!(text, "echo: a long story", "{:?}", rest.deltas);
}

/// SIGTERM of replica A while its turn (whose caller has gone) waits for a tool of the surface on
/// B: A finishes the turn promptly and exits, rather than ignoring the surface's answer and waiting
/// out the 30 s tool timeout. The turn's answer uses the surface's result (or, if A gives up on
/// calls to other replicas when it stops, "surface disconnected") and reaches the surface on B.
#[tokio::test]
async fn sigterm_lets_a_replica_finish_a_tool_call_to_another_replica() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (mut a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    let (id, token) = new_session(&b).await;
    let (mut ws, _) = b
        .attach_surface(&id, &token, json!({"mcp_tools": ["gps"]}))
        .await;
    // A surface of another session on A closes (1001) when A's shutdown begins.
    let (other, other_token) = new_session(&a).await;
    let (mut canary, _) = a.attach(&other, &other_token).await;

    let caller = tokio::time::timeout(
        WAIT,
        ask(
            &a,
            Some(&token),
            "where am I? [[fake:tool=surface_gps]]",
            json!({"stream": true}),
        )
        .send(),
    )
    .await
    .expect("response headers within the wait")
    .expect("request sent");
    assert_eq!(caller.status(), 200);
    let call = ws.recv().await;
    assert_eq!(call["type"], "TOOL_CALL", "{call}");
    drop(caller);
    a.proc.sigterm();
    assert_eq!(canary.closed().await, Some(1001), "A is shutting down");
    ws.send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"],
                   "result": serde_json::from_str::<Value>(GPS_FIX).expect("json")}))
        .await;
    let status = a.proc.wait_exit(WAIT).await;
    assert_eq!(status.code(), Some(0), "{status}");
    let live = live_turn(&mut ws, None).await;
    let answers = [
        format!("tool result: {GPS_FIX}"),
        r#"tool result: {"error":"surface disconnected"}"#.to_owned(),
    ];
    assert!(answers.contains(&live.text()), "{:?}", live.deltas);
}

/// Two surfaces attach the same session at the same moment on A and B: one of them is closed with
/// 4409, and a turn through C reaches the other. Several rounds, so either may win.
#[tokio::test]
async fn racing_attaches_on_two_replicas_leave_exactly_one_surface() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (a, b, c) = tokio::join!(dep.replica("a"), dep.replica("b"), dep.replica("c"));
    let mut wins = [0u32; 2];
    for round in 0..5 {
        let (id, token) = new_session(&c).await;
        let (mut wa, mut wb) = tokio::join!(a.connect(&id), b.connect(&id));
        let frame = json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token});
        tokio::join!(wa.send(frame.clone()), wb.send(frame.clone()));
        let (fa, fb) = tokio::join!(wa.recv(), wb.recv());
        assert_eq!(fa["type"], "SESSION_ATTACHED", "{fa}");
        assert_eq!(fb["type"], "SESSION_ATTACHED", "{fb}");

        // Whichever attached first is displaced by the other: the first event on either socket.
        let (lost, event) = tokio::select! {
            e = wa.next_event() => (0, e),
            e = wb.next_event() => (1, e),
        };
        assert!(
            matches!(event, WsEvent::Closed(Some(4409))),
            "round {round}: the displaced surface is closed with 4409, got {event:?}"
        );
        let mut survivor = if lost == 0 { wb } else { wa };
        wins[1 - lost] += 1;

        let text = format!("round {round}");
        turn(&c, &token, &format!("{text} [[fake:chunks=2]]")).await;
        let live = live_turn(&mut survivor, None).await;
        assert_eq!(live.text(), format!("echo: {text}"), "round {round}");
        let view = c.session(&id, &token).await;
        assert_eq!(
            (&view["status"], &view["surface_attached"]),
            (&json!("running"), &json!(true)),
            "round {round}: the loser's close changed nothing: {view}"
        );
    }
    eprintln!("surfaces kept: A {} times, B {} times", wins[0], wins[1]);
}

/// `--replicated` without `--bus` is refused (replicas could not reach each other's surfaces),
/// and so is `--bus` over SQLite (replicas need one shared PostgreSQL database); a bus that cannot
/// be reached stops the start too.
#[tokio::test]
async fn replicated_without_a_bus_or_over_sqlite_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (pg, redis) = (test_database_url(), test_redis_url());
    let sqlite = format!("sqlite://{}", dir.path().join("x.db").display());
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 5] = [
        (&["--replicated"], &[], "--replicated needs --bus"),
        (
            &["--replicated", "--database", &pg],
            &[],
            "--replicated needs --bus",
        ),
        (
            &[],
            &[("SBP_REPLICATED", "true")],
            "--replicated needs --bus",
        ),
        (
            &["--bus", &redis],
            &[],
            "--bus needs --database postgres://",
        ),
        (
            &["--replicated", "--bus", &redis, "--database", &sqlite],
            &[],
            "--bus needs --database postgres://",
        ),
    ];
    for (args, envs, expected) in cases {
        let mut cmd = sbp_serve_in(dir.path(), args);
        cmd.envs(envs.iter().copied());
        let mut proc = Proc::spawn(cmd);
        let status = proc.wait_exit(WAIT).await;
        let (out, err) = proc.output();
        assert!(
            status.code().is_some_and(|c| c != 0),
            "{args:?} {envs:?}: exit {status}, stderr:\n{err}"
        );
        assert!(
            err.contains(expected),
            "{args:?} {envs:?}: stderr should say '{expected}':\n{err}"
        );
        assert!(!out.contains("listening"), "{args:?}: {out}");
    }
    assert!(
        !dir.path().join("x.db").exists(),
        "refused before opening any database"
    );

    let dep = Deployment::new(None);
    let mut args = dep.args("a");
    let bus = args
        .iter()
        .position(|a| a == "--bus")
        .expect("--bus in the args");
    args[bus + 1] = "redis://127.0.0.1:1".into();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut proc = Proc::spawn(sbp_serve_in(dir.path(), &args));
    let status = proc.wait_exit(WAIT).await;
    let (out, err) = proc.output();
    assert!(
        status.code().is_some_and(|c| c != 0),
        "exit {status}:\n{err}"
    );
    assert!(
        err.contains("joining the replica bus at redis://127.0.0.1:1"),
        "{err}"
    );
    assert!(!out.contains("listening"), "{out}");
}

/// Replica B's pub/sub connection drops mid-stream while a turn on A streams to the surface on B,
/// so deltas published meanwhile are lost (pub/sub is at-most-once) and later ones arrive after a
/// hole. The surface must still get the reply exactly once: what streamed before the hole, then
/// the rest before TURN_COMPLETE; never the text after the hole glued on, nor a repeat.
// Several threads: the fake upstream keeps streaming while the test blocks on redis-cli.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_lost_in_a_bus_blip_leave_no_hole_in_the_surface_text() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    let (id, token) = new_session(&a).await;
    let (mut ws, _) = b.attach(&id, &token).await;

    let words: Vec<String> = (1..=20).map(|i| format!("w{i}")).collect();
    let reply = words.join(" ");
    // 20 deltas 50 ms apart: B's bus waits 100 ms before it subscribes again, so a cut loses two
    // or more of them, and more follow once it is back.
    let prompt = format!("[[fake:reply={reply}]] [[fake:chunks=20]] [[fake:chunk_delay=50]]");
    let in_flight = tokio::spawn(send(ask(&a, Some(&token), &prompt, json!({}))));
    let first = ws.recv().await;
    assert_eq!(first["type"], "TURN_CHUNK", "{first}");
    assert_eq!(dep.cut_subscription(b.proc.pid()), 1, "B's subscription");

    let (status, _, body) = in_flight.await.expect("turn task");
    assert_eq!(status, 200, "{body}");
    assert_eq!(reply_text(&body), reply);
    let rest = live_turn(&mut ws, None).await;
    assert_eq!(
        rest.chunk_id,
        first["chunk_id"].as_str().unwrap_or_default()
    );
    let mut deltas = vec![first["delta"].as_str().expect("delta").to_owned()];
    deltas.extend(rest.deltas);
    assert_eq!(deltas.concat(), reply, "the surface's text: {deltas:?}");
    assert!(
        deltas.len() < 20,
        "some deltas were lost in the blip (else this test shows nothing): {deltas:?}"
    );
    // Delivered live: B clears the tethered copy once the surface has it, which may land just
    // after the TURN_COMPLETE the surface read; a copy left pending for good fails the wait.
    let (bref, idref, tokref) = (&b, id.as_str(), token.as_str());
    eventually(
        WAIT,
        "no tethered copy of the live turn left",
        move || async move {
            (bref.session(idref, tokref).await["tether_turns_pending"] == 0).then_some(())
        },
    )
    .await;
}

/// The displacement sent to replica `gw` never arrived (else the test around this proves nothing).
fn assert_displacement_unheard(gw: &Sbp) {
    let log = strip_ansi(&gw.proc.stderr());
    assert!(
        !log.contains("surface displaced by an attach on another replica"),
        "the displacement got through the cut subscription:\n{log}"
    );
}

/// Replica A's pub/sub connection is down while a surface on B takes the session from A's, so
/// A never hears of the displacement. A turn asked through A right away (before A's next
/// registry pass, a heartbeat away) must go to the surface on B, which the registry names, not
/// to A's stale one; A's surface is closed with 4409.
#[tokio::test]
async fn turn_right_after_a_lost_displacement_goes_to_the_new_surface() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    // One registry pass a second: A's upkeep cannot fix things before the turn does.
    let dep = Deployment::new(Some(&fake.base_url())).with_heartbeat("1", "5");
    let (a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    let (id, token) = new_session(&b).await;
    let (mut old, _) = a.attach(&id, &token).await;

    let cutting = dep.keep_cutting_subscription(a.proc.pid());
    let (mut new, _) = b.attach(&id, &token).await;
    assert!(cutting.stop() > 0, "A's subscription was cut");

    let body = turn(&a, &token, "who gets this? [[fake:chunks=2]]").await;
    assert_eq!(reply_text(&body), "echo: who gets this?");
    let event = old.next_event_within(WAIT).await;
    assert!(
        matches!(event, Some(WsEvent::Closed(Some(4409)))),
        "the stale surface on A gets no turn and is closed as displaced, got {event:?}"
    );
    assert_eq!(
        live_turn(&mut new, None).await.text(),
        "echo: who gets this?"
    );
    assert_displacement_unheard(&a);
}

/// Replica A's pub/sub connection is down while a surface on B takes the session from A's (the
/// displacement is lost), and that surface then detaches: the session is suspended and the
/// registry names no surface. A must not take the empty registry for one that lost its entry and
/// register its stale surface again: within a few heartbeats that surface is closed with 4409, and
/// turns go to the tether.
#[tokio::test]
async fn surface_displaced_unheard_is_not_revived_when_its_successor_detaches() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    // One registry pass a second: A's pass comes after the new surface has come and gone.
    let dep = Deployment::new(Some(&fake.base_url())).with_heartbeat("1", "5");
    let (a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    let (id, token) = new_session(&b).await;
    let (mut old, _) = a.attach(&id, &token).await;

    let cutting = dep.keep_cutting_subscription(a.proc.pid());
    let (mut new, _) = b.attach(&id, &token).await;
    new.send(json!({"type": "DETACH"})).await;
    assert_eq!(new.closed().await, Some(1000));
    assert!(cutting.stop() > 0, "A's subscription was cut");
    let (bref, idref, tokref) = (&b, id.as_str(), token.as_str());
    eventually(WAIT, "the session is suspended", move || async move {
        let view = bref.session(idref, tokref).await;
        (view["status"] == "suspended").then_some(())
    })
    .await;

    let event = old.next_event_within(Duration::from_secs(4)).await;
    assert!(
        matches!(event, Some(WsEvent::Closed(Some(4409)))),
        "the stale surface on A is closed within a few heartbeats, got {event:?}"
    );
    let view = b.session(&id, &token).await;
    assert_eq!(
        (&view["status"], &view["surface_attached"]),
        (&json!("suspended"), &json!(false)),
        "no surface was registered again: {view}"
    );
    let pushed = b.push(&id, &token, "after the surface left").await;
    assert_eq!(pushed["delivery"], "tethered", "{pushed}");
    assert_displacement_unheard(&a);
}

/// A session deleted through replica B while its surface is attached to replica A: A closes the
/// surface with 4004 (the bus carries the deletion), and neither replica knows the session after.
#[tokio::test]
async fn a_session_deleted_on_one_replica_closes_its_surface_on_another() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    let (id, token) = new_session(&b).await;
    let (mut ws, _) = a.attach(&id, &token).await;
    let path = format!("/v1/sessions/{id}");
    let (status, _, body) = send(
        b.http
            .delete(format!("{}{path}", b.url))
            .header("x-session-token", &token),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    ws.expect_close(4004).await;
    for gw in [&a, &b] {
        let (status, _, body) = send(gw.get(&path).header("x-session-token", &token)).await;
        assert_eq!(status, 404, "{body}");
    }
    let mut again = a.connect(&id).await;
    again
        .send(json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token}))
        .await;
    again.expect_error_close("SESSION_NOT_FOUND", 4004).await;
}

/// Turns of one session alternate between two replicas, each with its own history cache: every
/// upstream request carries the whole transcript in order, the turns the other replica appended
/// included (a cache is topped up from the store, never trusted past the session's count).
#[tokio::test]
async fn turns_alternating_between_replicas_send_the_whole_transcript() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dep = Deployment::new(Some(&fake.base_url()));
    let (a, b) = tokio::join!(dep.replica("a"), dep.replica("b"));
    let (_, token) = new_session(&a).await;
    let mut expected = vec![("user".to_owned(), "hello".to_owned())];
    expected.push(("assistant".to_owned(), "echo: hello".to_owned()));
    for i in 0..6 {
        let (gw, other) = if i % 2 == 0 { (&b, &a) } else { (&a, &b) };
        // Each replica also runs a turn of a session of its own, so its cache holds more than one.
        new_session(other).await;
        let text = format!("turn {i}");
        let body = turn(gw, &token, &text).await;
        let sent = fake.requests().pop().expect("the turn's upstream request");
        let sent: Vec<(String, String)> = sent["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| {
                let field = |k: &str| m[k].as_str().unwrap_or_default().to_owned();
                (field("role"), field("content"))
            })
            .collect();
        expected.push(("user".to_owned(), text.clone()));
        assert_eq!(sent, expected, "turn {i}: the whole transcript, in order");
        expected.push(("assistant".to_owned(), reply_text(&body)));
    }
}
