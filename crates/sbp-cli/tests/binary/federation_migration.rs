//! Sessions follow their surface (L6) end to end: gateways as real `sbp serve` processes on
//! loopback that pin each other, a surface attaching on B with the id and token of a session A
//! holds, and what each side says afterwards (same id, token, transcript and Tether seqs on B;
//! 409 SBP_SESSION_MOVED naming B on A; lineage and metrics on both; the way back). Then the
//! failure modes: a wrong token, a session nobody holds, a running turn, the origin down, two
//! gateways at once, the target killed between adopt and commit, replayed and forged handovers
//! and commits, and the origin's answers while a lease runs. Tests marked
//! `ignore = "defect: ..."` show what the gateway gets wrong today.

use std::time::Duration;

use sbp_fake_llm::FakeLlm;
use sbp_protocol::federation::{IdentityKey, Role, sign_fed_token, verify_object};
use serde_json::{Value, json};
use tokio::time::Instant;
use uuid::Uuid;

use crate::federation::fakes::FakeNode;
use crate::federation::net::{Node, claims, conversation, metric, status_code};
use crate::support::{Sbp, WAIT, Ws, WsEvent, eventually, msg, reply_text, send, strip_ansi};

/// The environment variable that makes a gateway started with `--enable-test-hooks` pause
/// between adopting a moved session and committing it.
const PAUSE_ENV: &str = "SBP_TEST_HANDOVER_PAUSE_MS";

/// What an attach came to.
enum Attach {
    /// Boxed: a socket is large beside a refusal.
    Attached(Box<Ws>, Value),
    /// The frame sent before the close (`Null` when none came) and the close code.
    Refused { frame: Value, code: Option<u16> },
}

impl Attach {
    fn attached(self, what: &str) -> (Ws, Value) {
        match self {
            Attach::Attached(ws, frame) => (*ws, frame),
            Attach::Refused { frame, code } => {
                panic!("{what}: refused with close {code:?} after {frame}")
            }
        }
    }

    fn refused(self, what: &str) -> (Value, Option<u16>) {
        match self {
            Attach::Refused { frame, code } => (frame, code),
            Attach::Attached(_, frame) => panic!("{what}: attached ({frame})"),
        }
    }
}

/// Opens session `id`'s socket on `node` and sends ATTACH_SESSION with `extra`'s fields added.
async fn try_attach(node: &Node, id: &str, token: &str, extra: Value) -> Attach {
    let mut ws = Ws::open(&node.gw().ws_url, id).await;
    let mut frame = json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token});
    if let (Some(f), Some(e)) = (frame.as_object_mut(), extra.as_object()) {
        f.extend(e.clone());
    }
    ws.send(frame).await;
    match ws.next_event().await {
        WsEvent::Frame(f) if f["type"] == "SESSION_ATTACHED" => Attach::Attached(Box::new(ws), f),
        WsEvent::Frame(f) => {
            let code = ws.closed().await;
            Attach::Refused { frame: f, code }
        }
        WsEvent::Closed(code) => Attach::Refused {
            frame: Value::Null,
            code,
        },
    }
}

/// Reads frames (a live turn's, a notice) until the socket closes; the close code.
async fn close_code(ws: &mut Ws) -> Option<u16> {
    loop {
        if let WsEvent::Closed(code) = ws.next_event().await {
            return code;
        }
    }
}

/// Two gateways pinning each other, started with `a_extra` and `b_extra`.
async fn pair(seed: u8, a_extra: &[&str], b_extra: &[&str]) -> (Node, Node) {
    let mut a = Node::new(&format!("gw-a-{seed}"), seed).await;
    let mut b = Node::new(&format!("gw-b-{seed}"), seed + 1).await;
    let (a_pin, b_pin) = (a.pin(), b.pin());
    let mut a_args = vec!["--peer", &b_pin];
    a_args.extend_from_slice(a_extra);
    let mut b_args = vec!["--peer", &a_pin];
    b_args.extend_from_slice(b_extra);
    a.start(&a_args).await;
    b.start(&b_args).await;
    (a, b)
}

/// `GET /v1/sbp/federation/sessions/{id}` on `at`, asked as `asker` (whom `at` pins).
async fn locate(asker: &Node, at: &Node, id: &str) -> (u16, Value) {
    let path = format!("/v1/sbp/federation/sessions/{id}");
    let token = asker.token(&at.gateway_id, id, "GET", &path);
    let (status, _, body) = send(at.gw().get(&path).bearer_auth(token)).await;
    (status, body)
}

/// A chat turn continuing the session of `token`: (status, headers, body).
async fn chat(gw: &Sbp, token: &str, text: &str) -> (u16, reqwest::header::HeaderMap, Value) {
    send(
        gw.post(
            "/v1/chat/completions",
            &json!({"model": "sbp/echo", "messages": [msg("user", text)]}),
        )
        .header("x-session-token", token),
    )
    .await
}

/// `GET path` with the session token: (status, body).
async fn get_with(gw: &Sbp, path: &str, token: &str) -> (u16, Value) {
    let (status, _, body) = send(gw.get(path).header("x-session-token", token)).await;
    (status, body)
}

/// `POST path body` with the session token: (status, headers, body).
async fn post_with(
    gw: &Sbp,
    path: &str,
    token: &str,
    body: Value,
) -> (u16, reqwest::header::HeaderMap, Value) {
    send(gw.post(path, &body).header("x-session-token", token)).await
}

/// The session's moves in its lineage on `gw`: (kind, gateway_id) in order.
async fn migrations(gw: &Sbp, id: &str, token: &str) -> Vec<(String, String)> {
    let (status, body) = get_with(gw, &format!("/v1/sbp/sessions/{id}/lineage"), token).await;
    assert_eq!(status, 200, "lineage: {body}");
    body["migrations"]
        .as_array()
        .map(|moves| {
            moves
                .iter()
                .map(|m| {
                    assert!(m["at"].is_string(), "{m}");
                    (
                        m["kind"].as_str().unwrap_or_default().to_owned(),
                        m["gateway_id"].as_str().unwrap_or_default().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn moves(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(k, g)| ((*k).to_owned(), (*g).to_owned()))
        .collect()
}

/// Asserts a 409 SBP_SESSION_MOVED naming `to`.
fn assert_moved_to(status: u16, body: &Value, to: &Node, what: &str) {
    assert_eq!(
        status_code(status, body),
        (409, "SBP_SESSION_MOVED".to_owned()),
        "{what}: {body}"
    );
    let detail = &body["error"]["detail"];
    assert_eq!(
        detail["gateway_id"],
        to.gateway_id.as_str(),
        "{what}: {body}"
    );
    assert_eq!(detail["gateway_url"], to.url.as_str(), "{what}: {body}");
}

/// A handovers counter of `node`.
async fn handovers(node: &Node, outcome: &str) -> f64 {
    metric(
        &node.metrics().await,
        &format!("sbp_federation_handovers_total{{outcome=\"{outcome}\"}}"),
    )
}

/// Pushes `content` as a tethered turn (no surface attached); its seq.
async fn push_tethered(gw: &Sbp, id: &str, token: &str, content: &str) -> u64 {
    let body = gw.push(id, token, content).await;
    assert_eq!(body["delivery"], "tethered", "{body}");
    body["seq"].as_u64().expect("seq")
}

/// The next frame is the TETHER_TURN of `seq` with `content`.
async fn expect_tether(ws: &mut Ws, seq: u64, content: &str) {
    let f = ws.recv().await;
    assert_eq!(f["type"], "TETHER_TURN", "{f}");
    assert_eq!(f["seq"], seq, "{f}");
    assert_eq!(f["content"], content, "{f}");
    assert_eq!(f["role"], "assistant", "{f}");
}

/// The handover route of session `id` on `at`, called as `from` with `session_token`.
async fn handover(
    from_key: &IdentityKey,
    from_id: &str,
    at: &Node,
    id: &str,
    session_token: &str,
    migration_id: Uuid,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let path = format!("/v1/sbp/federation/sessions/{id}/handover");
    let token = sign_fed_token(
        &claims(from_id, &at.gateway_id, id, "POST", &path),
        from_key,
    );
    handover_with(at, &path, &token, session_token, migration_id).await
}

async fn handover_with(
    at: &Node,
    path: &str,
    bearer: &str,
    session_token: &str,
    migration_id: Uuid,
) -> (u16, reqwest::header::HeaderMap, Value) {
    send(
        at.gw()
            .post(
                path,
                &json!({"session_token": session_token, "migration_id": migration_id}),
            )
            .bearer_auth(bearer),
    )
    .await
}

/// The commit route of migration `migration_id` of session `id` on `at`, called as `from`.
async fn commit(
    from_key: &IdentityKey,
    from_id: &str,
    at: &Node,
    id: &str,
    migration_id: Uuid,
) -> (u16, Value) {
    let path = format!("/v1/sbp/federation/sessions/{id}/handover/{migration_id}/commit");
    let token = sign_fed_token(
        &claims(from_id, &at.gateway_id, id, "POST", &path),
        from_key,
    );
    let (status, _, body) = send(at.gw().post(&path, &json!({})).bearer_auth(token)).await;
    (status, body)
}

/// 1. A session on A (two chat turns, two turns pushed while no surface is attached: seqs 1 and
/// 2) follows its surface to B: SESSION_ATTACHED on B (L6, the same id, two queued turns drained
/// in order with their seqs), the surface's `last_seq` honoured as A would, B's transcript
/// equal to A's, B continuing the session and its seqs; A refusing every session route with 409
/// SBP_SESSION_MOVED naming B while its record says where it went; lineage and handover metrics
/// on both sides. Then the surface attaches on A again and the session comes back with what was
/// said on B, B's surface is displaced (4409), B names A, and the epoch has grown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_follows_its_surface_to_another_gateway_and_back() {
    let (a, b) = pair(111, &[], &[]).await;
    let (id, token) = conversation(a.gw(), "moving house").await;
    let first = push_tethered(a.gw(), &id, &token, "background result one").await;
    let second = push_tethered(a.gw(), &id, &token, "background result two").await;
    assert_eq!((first, second), (1, 2));
    let on_a = a.gw().messages(&id, &token).await;
    assert_eq!(on_a.len(), 6, "two turns and two pushed turns: {on_a:?}");
    // A second session, whose surface already holds seq 1.
    let (id2, token2) = conversation(a.gw(), "second session").await;
    push_tethered(a.gw(), &id2, &token2, "second: one").await;
    push_tethered(a.gw(), &id2, &token2, "second: two").await;

    let (mut ws, attached) = try_attach(
        &b,
        &id,
        &token,
        json!({"surface_context": {"device_type": "mobile"}}),
    )
    .await
    .attached("the surface on B");
    assert_eq!(attached["session_id"], id.as_str(), "{attached}");
    assert_eq!(attached["sbp_level"], "L6", "{attached}");
    assert_eq!(attached["queued_turns"], 2, "{attached}");
    expect_tether(&mut ws, 1, "background result one").await;
    expect_tether(&mut ws, 2, "background result two").await;

    let on_b = b.gw().messages(&id, &token).await;
    assert_eq!(on_b, on_a, "B has A's transcript verbatim");

    // The surface's `last_seq` applies on B as it would have on A: only seq 2 comes, and B
    // continues the seqs (a turn pushed now is seq 3, live).
    let (mut ws2, attached2) = try_attach(&b, &id2, &token2, json!({"last_seq": 1}))
        .await
        .attached("the second session's surface on B");
    assert_eq!(attached2["queued_turns"], 1, "{attached2}");
    expect_tether(&mut ws2, 2, "second: two").await;
    let live = b.gw().push(&id2, &token2, "pushed on B").await;
    assert_eq!(live["seq"], 3, "{live}");
    assert_eq!(live["delivery"], "live", "{live}");
    // Streamed live, with nothing (seq 1) before it.
    let (text, complete) = ws2.live_turn().await;
    assert_eq!(text, "pushed on B");
    assert_eq!(complete["seq"], 3, "{complete}");
    ws2.close().await;

    // B continues the session: same id, one more step.
    let (status, _, body) = chat(b.gw(), &token, "said on B").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["sbp"]["session_id"], id.as_str(), "{body}");
    assert_eq!(body["sbp"]["step_count"], 3, "{body}");
    let said_on_b = reply_text(&body);

    // A refuses the session's routes, naming B.
    let (status, _, body) = chat(a.gw(), &token, "still here?").await;
    assert_moved_to(status, &body, &b, "chat on A");
    let (status, _, body) = post_with(
        a.gw(),
        &format!("/v1/sbp/sessions/{id}/turns"),
        &token,
        json!({"content": "a push"}),
    )
    .await;
    assert_moved_to(status, &body, &b, "push on A");
    let (status, _, body) = post_with(
        a.gw(),
        &format!("/v1/sbp/sessions/{id}/export"),
        &token,
        json!({}),
    )
    .await;
    assert_moved_to(status, &body, &b, "export on A");
    let (status, body) = get_with(a.gw(), &format!("/v1/sessions/{id}/messages"), &token).await;
    assert_moved_to(status, &body, &b, "messages on A");
    let view = a.gw().session(&id, &token).await;
    let fed = &view["federation"];
    assert_eq!(fed["state"], "moved", "{view}");
    assert_eq!(fed["gateway_id"], b.gateway_id.as_str(), "{view}");
    assert_eq!(fed["gateway_url"], b.url.as_str(), "{view}");
    let first_epoch = fed["epoch"].as_u64().expect("epoch");
    assert_eq!(first_epoch, 1, "{view}");
    assert_eq!(
        locate(&b, &a, &id).await.1["state"],
        "moved",
        "A's locate answer"
    );
    assert_eq!(locate(&a, &b, &id).await.1["state"], "held");

    assert_eq!(
        migrations(b.gw(), &id, &token).await,
        moves(&[("migrated_from", &a.gateway_id)])
    );
    assert_eq!(handovers(&a, "origin_granted").await, 2.0);
    assert_eq!(handovers(&a, "origin_committed").await, 2.0);
    assert_eq!(handovers(&b, "target_committed").await, 2.0);

    // Back to A: the session comes with what was said on B; the surface still attached on B
    // hears that it left.
    let (back, attached) = try_attach(&a, &id, &token, json!({"last_seq": 2}))
        .await
        .attached("the surface back on A");
    assert_eq!(attached["session_id"], id.as_str(), "{attached}");
    assert_eq!(
        attached["queued_turns"], 0,
        "seqs 1 and 2 were received on B: {attached}"
    );
    assert_eq!(
        close_code(&mut ws).await,
        Some(4409),
        "B's surface displaced"
    );
    let mut expected = on_a.clone();
    expected.push(("user".into(), "said on B".into()));
    expected.push(("assistant".into(), said_on_b));
    assert_eq!(a.gw().messages(&id, &token).await, expected);
    let (status, _, body) = chat(b.gw(), &token, "still on B?").await;
    assert_moved_to(status, &body, &a, "chat on B after the way back");
    let view = b.gw().session(&id, &token).await;
    assert_eq!(view["federation"]["gateway_id"], a.gateway_id.as_str());
    let epoch = view["federation"]["epoch"].as_u64().expect("epoch");
    assert!(
        epoch > first_epoch,
        "the epoch grows: {epoch} after {first_epoch}"
    );
    assert_eq!(locate(&b, &a, &id).await.1["state"], "held");
    assert_eq!(
        migrations(a.gw(), &id, &token).await,
        moves(&[
            ("migrated_to", &b.gateway_id),
            ("migrated_from", &b.gateway_id)
        ])
    );
    let (status, _, body) = chat(a.gw(), &token, "home again").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["sbp"]["step_count"], 4, "{body}");
    back.close().await;
}

/// 1b. The origin's lineage says where the session went while it is away (the issue: lineage
/// records the move on both sides).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_origin_shows_the_move_in_lineage_while_the_session_is_away() {
    let (a, b) = pair(115, &[], &[]).await;
    let (id, token) = conversation(a.gw(), "lineage").await;
    let (ws, _) = try_attach(&b, &id, &token, json!({}))
        .await
        .attached("the surface on B");
    ws.close().await;
    assert_eq!(
        migrations(a.gw(), &id, &token).await,
        moves(&[("migrated_to", &b.gateway_id)])
    );
}

/// 2. A wrong token on B for A's session closes 4003 after FORBIDDEN and moves nothing (A still
/// serves the session, B has no copy); a session no gateway holds is SESSION_NOT_FOUND (4004).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_moves_nothing_and_an_unknown_session_is_not_found() {
    let (a, b) = pair(121, &[], &[]).await;
    let (id, token) = conversation(a.gw(), "guarded").await;
    let (_, other_token) = conversation(a.gw(), "another session").await;

    for wrong in [other_token.as_str(), "not-a-token"] {
        let (frame, code) = try_attach(&b, &id, wrong, json!({}))
            .await
            .refused("a wrong token");
        assert_eq!(frame["type"], "FORBIDDEN", "{frame}");
        assert_eq!(code, Some(4003));
    }
    let (status, _, body) = chat(a.gw(), &token, "still mine").await;
    assert_eq!(status, 200, "A still serves the session: {body}");
    assert_eq!(locate(&b, &a, &id).await.1["state"], "held");
    let (status, body) = get_with(b.gw(), &format!("/v1/sessions/{id}"), &token).await;
    assert_eq!(status, 404, "B has no copy: {body}");
    // B found that A holds the session but could not check A's proof against the presented
    // token: it sent A nothing (the token goes only to a holder that proves it holds the
    // session), and A granted nothing.
    assert_eq!(handovers(&b, "target_forbidden").await, 2.0);
    assert_eq!(handovers(&a, "origin_forbidden").await, 0.0);
    assert_eq!(handovers(&a, "origin_granted").await, 0.0);

    let nobody = Uuid::now_v7().to_string();
    let (frame, code) = try_attach(&b, &nobody, &token, json!({}))
        .await
        .refused("a session nobody holds");
    assert_eq!(frame["type"], "SESSION_NOT_FOUND", "{frame}");
    assert_eq!(code, Some(4004));
}

/// 3. A turn running on A: the attach on B closes 1013 (try again) and nothing moves; once the
/// turn ended, a retry moves the session with that turn in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_turn_makes_the_attach_try_again() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let base = fake.base_url();
    let (a, b) = pair(131, &["--llm-base-url", &base], &[]).await;
    let (id, token) = conversation(a.gw(), "busy").await;
    let before = fake.requests().len();

    let slow = "think long [[fake:slow=3000]]";
    let in_flight = tokio::spawn({
        let req = a
            .gw()
            .post(
                "/v1/chat/completions",
                &json!({"model": "gpt-test", "messages": [msg("user", slow)]}),
            )
            .header("x-session-token", &token);
        async move { send(req).await }
    });
    tokio::time::timeout(WAIT, fake.wait_for_requests(before + 1))
        .await
        .expect("the slow turn reaches the upstream");

    let (frame, code) = try_attach(&b, &id, &token, json!({}))
        .await
        .refused("an attach during a turn");
    assert_eq!(code, Some(1013), "{frame}");
    assert_eq!(frame["type"], "PROTOCOL_ERROR", "{frame}");
    assert_eq!(handovers(&b, "target_refused").await, 1.0);
    let (status, body) = get_with(b.gw(), &format!("/v1/sessions/{id}"), &token).await;
    assert_eq!(status, 404, "nothing moved: {body}");

    let (status, _, body) = tokio::time::timeout(WAIT, in_flight)
        .await
        .expect("the slow turn ends")
        .expect("task");
    assert_eq!(status, 200, "{body}");
    let (ws, attached) = try_attach(&b, &id, &token, json!({}))
        .await
        .attached("the retry");
    assert_eq!(attached["session_id"], id.as_str());
    let on_b = b.gw().messages(&id, &token).await;
    assert_eq!(
        on_b[on_b.len() - 2..].to_vec(),
        vec![
            ("user".to_owned(), slow.to_owned()),
            ("assistant".to_owned(), reply_text(&body))
        ],
        "the turn that ran on A moved with the session"
    );
    ws.close().await;
}

/// 4. The origin is down (`kill -9`) when the surface attaches on B: B closes 1013 within its
/// attach timeout and writes nothing; once A is back, the same attach moves the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_origin_down_makes_the_attach_try_again() {
    let (mut a, b) = pair(141, &[], &["--attach-timeout", "3"]).await;
    let (id, token) = conversation(a.gw(), "origin down").await;
    a.kill9();

    let started = Instant::now();
    let (frame, code) = try_attach(&b, &id, &token, json!({}))
        .await
        .refused("an attach while the origin is down");
    let took = started.elapsed();
    assert_eq!(code, Some(1013), "{frame}");
    assert!(
        took < Duration::from_millis(3500),
        "within the attach timeout: {took:?}"
    );
    let (status, body) = get_with(b.gw(), &format!("/v1/sessions/{id}"), &token).await;
    assert_eq!(status, 404, "nothing written on B: {body}");

    a.restart().await;
    let (ws, _) = try_attach(&b, &id, &token, json!({}))
        .await
        .attached("the attach once A is back");
    ws.close().await;
}

/// 4b. Whatever B answers while the origin is down, it writes nothing, answers within its
/// attach timeout, and the same attach moves the session once A is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_written_while_the_origin_is_down_and_the_move_works_once_it_is_back() {
    let (mut a, b) = pair(145, &[], &["--attach-timeout", "3"]).await;
    let (id, token) = conversation(a.gw(), "origin down").await;
    let transcript = a.gw().messages(&id, &token).await;
    a.kill9();

    let started = Instant::now();
    let (frame, code) = try_attach(&b, &id, &token, json!({}))
        .await
        .refused("an attach while the origin is down");
    let took = started.elapsed();
    assert!(
        matches!(code, Some(1013) | Some(4004)),
        "{code:?} after {frame}"
    );
    assert!(
        took < Duration::from_millis(3500),
        "within the attach timeout: {took:?}"
    );
    let (status, body) = get_with(b.gw(), &format!("/v1/sessions/{id}"), &token).await;
    assert_eq!(status, 404, "nothing written on B: {body}");

    a.restart().await;
    let (ws, attached) = try_attach(&b, &id, &token, json!({}))
        .await
        .attached("the attach once A is back");
    assert_eq!(attached["session_id"], id.as_str());
    assert_eq!(b.gw().messages(&id, &token).await, transcript);
    ws.close().await;
}

/// 5. B and C attach the same session at once: exactly one gateway ends up holding it (A's
/// locate names it, it says held, the other does not); a surface refused with 1013 retries and
/// follows the move to the winner; a surface displaced by a later move hears 4409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_attaching_at_once_leave_one_owner() {
    let mut a = Node::new("gw-a-race", 151).await;
    let mut b = Node::new("gw-b-race", 152).await;
    let mut c = Node::new("gw-c-race", 153).await;
    let (ap, bp, cp) = (a.pin(), b.pin(), c.pin());
    a.start(&["--peer", &bp, "--peer", &cp]).await;
    b.start(&["--peer", &ap, "--peer", &cp]).await;
    c.start(&["--peer", &ap, "--peer", &bp]).await;
    let (id, token) = conversation(a.gw(), "contested").await;
    let transcript = a.gw().messages(&id, &token).await;

    let (on_b, on_c) = tokio::join!(
        try_attach(&b, &id, &token, json!({})),
        try_attach(&c, &id, &token, json!({}))
    );
    // A names the gateway it handed the session to.
    let (status, at_a) = locate(&b, &a, &id).await;
    assert_eq!(status, 200, "{at_a}");
    assert_eq!(at_a["state"], "moved", "{at_a}");
    let (first, second, first_result, second_result) =
        if at_a["gateway_id"] == b.gateway_id.as_str() {
            (&b, &c, on_b, on_c)
        } else {
            assert_eq!(at_a["gateway_id"], c.gateway_id.as_str(), "{at_a}");
            (&c, &b, on_c, on_b)
        };
    let (mut first_ws, _) = first_result.attached("the gateway A handed the session to");
    let second_ws = match second_result {
        Attach::Refused { frame, code } => {
            // The loser was refused: it holds nothing, the winner holds the session.
            assert_eq!(code, Some(1013), "the loser is told to try again: {frame}");
            assert_eq!(locate(&a, first, &id).await.1["state"], "held");
            let (status, body) = locate(&a, second, &id).await;
            assert_eq!(status, 404, "the loser holds nothing: {body}");
            // Its retry follows the move to the winner.
            let (ws, attached) = try_attach(second, &id, &token, json!({}))
                .await
                .attached("the loser's retry");
            assert_eq!(attached["session_id"], id.as_str());
            ws
        }
        // Both attached: one after the other, the second taking it from the first.
        Attach::Attached(ws, _) => *ws,
    };
    assert_eq!(
        close_code(&mut first_ws).await,
        Some(4409),
        "the first holder's surface hears the session left"
    );
    // Exactly one holder now: `second`, having taken it from `first`.
    assert_eq!(locate(&a, second, &id).await.1["state"], "held");
    let (_, at_first) = locate(&a, first, &id).await;
    assert_eq!(at_first["state"], "moved", "{at_first}");
    assert_eq!(at_first["gateway_id"], second.gateway_id.as_str());
    let (status, _, body) = chat(second.gw(), &token, "who has it?").await;
    assert_eq!(status, 200, "{body}");
    let mut expected = transcript;
    expected.push(("user".into(), "who has it?".into()));
    expected.push(("assistant".into(), reply_text(&body)));
    assert_eq!(second.gw().messages(&id, &token).await, expected);
    let (status, _, body) = chat(first.gw(), &token, "and you?").await;
    assert_moved_to(status, &body, second, "the first holder");
    second_ws.close().await;
}

/// Three gateways pinning one another: (A, B, C); B gets `b_env` and `b_extra`.
async fn triangle(seed: u8, b_env: Option<(&str, &str)>, b_extra: &[&str]) -> (Node, Node, Node) {
    let mut a = Node::new(&format!("gw-a-{seed}"), seed).await;
    let mut b = Node::new(&format!("gw-b-{seed}"), seed + 1).await;
    let mut c = Node::new(&format!("gw-c-{seed}"), seed + 2).await;
    let (ap, bp, cp) = (a.pin(), b.pin(), c.pin());
    if let Some((k, v)) = b_env {
        b.set_env(k, Some(v));
    }
    let mut b_args = vec!["--peer", &ap, "--peer", &cp];
    b_args.extend_from_slice(b_extra);
    a.start(&["--peer", &bp, "--peer", &cp]).await;
    b.start(&b_args).await;
    c.start(&["--peer", &ap, "--peer", &bp]).await;
    (a, b, c)
}

/// Sends ATTACH_SESSION on `node` for a surface whose answer is read later.
async fn start_attach(node: &Node, id: &str, token: &str) -> Ws {
    let mut ws = Ws::open(&node.gw().ws_url, id).await;
    ws.send(json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token}))
        .await;
    ws
}

/// Waits until `node` logs the test hook's pause; the migration id it paused.
async fn paused_migration(node: &Node) -> Uuid {
    eventually(
        WAIT,
        &format!("{} pauses between adopt and commit", node.name),
        || {
            let log = strip_ansi(&node.gw().proc.stderr());
            let found = log
                .lines()
                .find(|l| l.contains("handover paused"))
                .and_then(|l| {
                    let (_, rest) = l.split_once("migration_id=")?;
                    Uuid::parse_str(rest.split_whitespace().next()?).ok()
                });
            async move { found }
        },
    )
    .await
}

/// 5a. The race made deterministic with the test hook: while B takes the session (paused
/// between adopt and commit, A's lease running), C's attach closes 1013 and writes nothing;
/// B's attach then completes, and C's retry follows the move to B: one owner at every step
/// (A names B, B names C, C holds it), B's surface displaced with 4409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_during_a_move_tries_again_then_follows_the_move() {
    let (a, b, c) = triangle(155, Some((PAUSE_ENV, "2000")), &["--enable-test-hooks"]).await;
    let (id, token) = conversation(a.gw(), "contested").await;
    let transcript = a.gw().messages(&id, &token).await;

    let mut on_b = start_attach(&b, &id, &token).await;
    paused_migration(&b).await;
    let (frame, code) = try_attach(&c, &id, &token, json!({}))
        .await
        .refused("C while A's lease to B runs");
    assert_eq!(code, Some(1013), "{frame}");
    let (status, body) = get_with(c.gw(), &format!("/v1/sessions/{id}"), &token).await;
    assert_eq!(status, 404, "nothing written on C: {body}");

    let attached = on_b.recv().await;
    assert_eq!(attached["type"], "SESSION_ATTACHED", "{attached}");
    assert_eq!(
        locate(&b, &a, &id).await.1["gateway_id"],
        b.gateway_id.as_str()
    );
    assert_eq!(locate(&a, &b, &id).await.1["state"], "held");

    let (on_c, _) = try_attach(&c, &id, &token, json!({}))
        .await
        .attached("C's retry");
    assert_eq!(
        close_code(&mut on_b).await,
        Some(4409),
        "B's surface displaced"
    );
    assert_eq!(locate(&a, &c, &id).await.1["state"], "held");
    let (_, at_b) = locate(&a, &b, &id).await;
    assert_eq!(
        (at_b["state"].as_str(), at_b["gateway_id"].as_str()),
        (Some("moved"), Some(c.gateway_id.as_str())),
        "{at_b}"
    );
    assert_eq!(c.gw().messages(&id, &token).await, transcript);
    let (status, _, body) = chat(c.gw(), &token, "who has it?").await;
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = chat(b.gw(), &token, "and you?").await;
    assert_moved_to(status, &body, &c, "B after C took the session");
    assert_eq!(
        migrations(c.gw(), &id, &token).await,
        moves(&[("migrated_from", &b.gateway_id)])
    );
    on_c.close().await;
}

/// 5b. The loser of a race that looks just after the origin committed, while the winner's copy
/// is still `incoming` (made deterministic: the test commits at A as B, with B's key, while B
/// is paused): A says the session moved to B, B does not yet say it holds it. The session
/// exists and is about to be B's, so C must close 1013 (try again), not tell the surface its
/// session does not exist; the retry after B settles follows the move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_attaching_while_the_winner_settles_is_told_to_try_again() {
    let (a, b, c) = triangle(158, Some((PAUSE_ENV, "3000")), &["--enable-test-hooks"]).await;
    let (id, token) = conversation(a.gw(), "settling").await;

    let mut on_b = start_attach(&b, &id, &token).await;
    let migration_id = paused_migration(&b).await;
    let (status, body) = commit(&b.key, &b.gateway_id, &a, &id, migration_id).await;
    assert_eq!(status, 200, "the commit B would make: {body}");
    assert_eq!(locate(&c, &a, &id).await.1["state"], "moved");

    let (frame, code) = try_attach(&c, &id, &token, json!({}))
        .await
        .refused("C while B settles");
    assert_eq!(
        code,
        Some(1013),
        "try again, not 'no such session': {frame}"
    );

    let attached = on_b.recv().await;
    assert_eq!(attached["type"], "SESSION_ATTACHED", "{attached}");
    let (on_c, _) = try_attach(&c, &id, &token, json!({}))
        .await
        .attached("C's retry");
    on_c.close().await;
}

/// 6. The target is killed between adopt and commit (test hook): the origin's lease expires and
/// it serves the session again; the restarted target settles its `incoming` copy at start (the
/// commit is refused, the copy dropped); a fresh attach then moves the session properly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_target_dying_mid_handover_leaves_the_session_at_the_origin() {
    let mut a = Node::new("gw-a-mid", 161).await;
    let mut b = Node::new("gw-b-mid", 162).await;
    let (ap, bp) = (a.pin(), b.pin());
    a.start(&["--peer", &bp, "--handover-lease", "2"]).await;
    b.set_env(PAUSE_ENV, Some("30000"));
    b.start(&["--peer", &ap, "--enable-test-hooks"]).await;
    let (id, token) = conversation(a.gw(), "interrupted").await;

    let mut ws = start_attach(&b, &id, &token).await;
    paused_migration(&b).await;
    let leased_at = Instant::now();
    b.kill9();
    assert!(
        matches!(ws.next_event().await, WsEvent::Closed(_)),
        "the surface loses B"
    );

    // The lease expires: A serves the session again.
    let (status, _, body) = chat(a.gw(), &token, "during the lease").await;
    assert_eq!(
        status_code(status, &body).1,
        "SBP_SESSION_MOVING",
        "the lease still runs: {body}"
    );
    let after = eventually(WAIT, "A serves the session after the lease", || {
        let gw = a.gw();
        let token = token.clone();
        async move {
            let (status, _, body) = chat(gw, &token, "after the lease").await;
            (status == 200).then_some(body)
        }
    })
    .await;
    let waited = leased_at.elapsed();
    assert!(waited < Duration::from_secs(4), "the 2 s lease: {waited:?}");
    assert_eq!(after["sbp"]["session_id"], id.as_str());
    assert_eq!(locate(&b, &a, &id).await.1["state"], "held");

    // Restarted, B settles its copy: A refuses the commit, the copy is dropped.
    b.set_env(PAUSE_ENV, None);
    b.restart().await;
    // Watched through its metrics: reading the copy with the token before it is dropped would
    // leave its token cached (see `a_dropped_incoming_copy_does_not_block_the_next_attach`).
    eventually(WAIT, "B settles its incoming copy", || {
        let b = &b;
        async move { (handovers(b, "target_commit_refused").await == 1.0).then_some(()) }
    })
    .await;
    let (status, body) = get_with(b.gw(), &format!("/v1/sessions/{id}"), &token).await;
    assert_eq!(status, 404, "the incoming copy is dropped: {body}");
    assert_eq!(handovers(&a, "origin_commit_refused").await, 1.0);
    assert_eq!(handovers(&a, "origin_committed").await, 0.0);

    // A fresh attach moves it properly, with what A said after the lease.
    let transcript = a.gw().messages(&id, &token).await;
    let (ws, attached) = try_attach(&b, &id, &token, json!({}))
        .await
        .attached("a fresh attach on B");
    assert_eq!(attached["session_id"], id.as_str());
    assert_eq!(b.gw().messages(&id, &token).await, transcript);
    let (status, _, body) = chat(a.gw(), &token, "gone?").await;
    assert_moved_to(status, &body, &b, "A after the fresh move");
    ws.close().await;
}

/// 6b. A copy dropped because its commit was refused leaves nothing behind: when the surface
/// (or anyone with the token) read it while it was `incoming`, the next attach still pulls the
/// session anew from the holder (here refused again, the pause outlasting the lease: 1013 and
/// a second lease granted), rather than failing inside the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_incoming_copy_does_not_block_the_next_attach() {
    let mut a = Node::new("gw-a-dropped", 165).await;
    let mut b = Node::new("gw-b-dropped", 166).await;
    let (ap, bp) = (a.pin(), b.pin());
    a.start(&["--peer", &bp, "--handover-lease", "1"]).await;
    b.set_env(PAUSE_ENV, Some("2000"));
    b.start(&["--peer", &ap, "--enable-test-hooks"]).await;
    let (id, token) = conversation(a.gw(), "dropped").await;

    let mut ws = start_attach(&b, &id, &token).await;
    paused_migration(&b).await;
    // Reading the incoming copy with the token (B answers 200 with it) is what leaves its
    // token hash cached.
    get_with(b.gw(), &format!("/v1/sessions/{id}"), &token).await;
    let frame = ws.recv().await;
    assert_eq!(frame["type"], "PROTOCOL_ERROR", "{frame}");
    assert_eq!(
        ws.closed().await,
        Some(1013),
        "the commit came after the lease"
    );
    let (status, body) = get_with(b.gw(), &format!("/v1/sessions/{id}"), &token).await;
    assert_eq!(status, 404, "the copy is dropped: {body}");
    assert_eq!(handovers(&a, "origin_granted").await, 1.0);

    let (frame, code) = try_attach(&b, &id, &token, json!({}))
        .await
        .refused("the pause outlasts the lease again");
    assert_eq!(
        code,
        Some(1013),
        "the session is pulled again, not 1011: {frame}"
    );
    assert_eq!(handovers(&a, "origin_granted").await, 2.0);
}

/// 7. The handover and commit routes refuse what a peer may not do: a wrong session token (403,
/// no lease: A still serves the session), a token signed by a key A does not trust for the
/// issuer (401), a replayed token (401 replayed), a commit by a gateway that does not hold the
/// lease or of another migration (409 SBP_SESSION_LEASE_EXPIRED). The lease's holder commits,
/// idempotently, and A then names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_and_forged_handovers_and_commits_are_refused() {
    let f = FakeNode::start(Role::Gateway, 171).await;
    let g = FakeNode::start(Role::Gateway, 172).await;
    let mut a = Node::new("gw-a-forged", 173).await;
    a.start(&["--peer", &f.pin(), "--peer", &g.pin()]).await;
    let (id, token) = conversation(a.gw(), "forged").await;

    let m1 = Uuid::now_v7();
    let (status, _, body) = handover(&f.key, &f.gateway_id, &a, &id, "wrong-token", m1).await;
    assert_eq!(status_code(status, &body).0, 403, "{body}");
    let (status, _, body) = chat(a.gw(), &token, "no lease").await;
    assert_eq!(status, 200, "a refused handover takes no lease: {body}");

    // Signed by G's key, claiming to be F.
    let (status, _, body) = handover(&g.key, &f.gateway_id, &a, &id, &token, m1).await;
    assert_eq!(status, 401, "{body}");

    let path = format!("/v1/sbp/federation/sessions/{id}/handover");
    let good = f.key.clone();
    let bearer = sign_fed_token(
        &claims(&f.gateway_id, &a.gateway_id, &id, "POST", &path),
        &good,
    );
    let (status, _, envelope) = handover_with(&a, &path, &bearer, &token, m1).await;
    assert_eq!(status, 200, "{envelope}");
    let envelope = envelope.as_object().expect("an object").clone();
    verify_object(&envelope, &a.public_key()).expect("signed by A");
    assert_eq!(envelope["session_id"], id.as_str());
    assert_eq!(envelope["migration_id"], m1.to_string());
    assert_eq!(envelope["from_gateway"], a.gateway_id.as_str());
    assert_eq!(envelope["to_gateway"], f.gateway_id.as_str());
    assert_eq!(envelope["epoch"], 1);

    let (status, headers, body) = handover_with(&a, &path, &bearer, &token, m1).await;
    assert_eq!(
        status_code(status, &body),
        (401, "SBP_FEDERATION_TOKEN_REPLAYED".to_owned()),
        "{body}"
    );
    assert!(
        headers
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("replayed")),
        "{headers:?}"
    );

    let (status, body) = commit(&g.key, &g.gateway_id, &a, &id, m1).await;
    assert_eq!(
        status_code(status, &body),
        (409, "SBP_SESSION_LEASE_EXPIRED".to_owned()),
        "a commit by a gateway without the lease: {body}"
    );
    let (status, body) = commit(&f.key, &f.gateway_id, &a, &id, Uuid::now_v7()).await;
    assert_eq!(
        status_code(status, &body),
        (409, "SBP_SESSION_LEASE_EXPIRED".to_owned()),
        "a commit of another migration: {body}"
    );
    assert_eq!(handovers(&a, "origin_commit_refused").await, 2.0);

    // The lease's holder commits; again is the same answer.
    for _ in 0..2 {
        let (status, body) = commit(&f.key, &f.gateway_id, &a, &id, m1).await;
        assert_eq!(status, 200, "{body}");
        let answer = body.as_object().expect("an object").clone();
        verify_object(&answer, &a.public_key()).expect("signed by A");
        assert_eq!(answer["state"], "committed", "{body}");
        assert_eq!(answer["epoch"], 1, "{body}");
    }
    let (status, _, body) = chat(a.gw(), &token, "moved?").await;
    assert_eq!(status_code(status, &body).1, "SBP_SESSION_MOVED", "{body}");
    assert_eq!(body["error"]["detail"]["gateway_id"], f.gateway_id.as_str());
}

/// 8. While a lease runs (a handover the test asked for, not committed), A answers turns and
/// pushes for the session with 409 SBP_SESSION_MOVING and `Retry-After`, and still shows its
/// record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_origin_answers_moving_while_the_lease_runs() {
    let f = FakeNode::start(Role::Gateway, 181).await;
    let mut a = Node::new("gw-a-lease", 182).await;
    a.start(&["--peer", &f.pin()]).await;
    let (id, token) = conversation(a.gw(), "leased").await;
    let (status, _, body) = handover(&f.key, &f.gateway_id, &a, &id, &token, Uuid::now_v7()).await;
    assert_eq!(status, 200, "{body}");

    let retry_after = |headers: &reqwest::header::HeaderMap| -> u64 {
        headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("a Retry-After in seconds: {headers:?}"))
    };
    let (status, headers, body) = chat(a.gw(), &token, "now?").await;
    assert_eq!(
        status_code(status, &body),
        (409, "SBP_SESSION_MOVING".to_owned()),
        "{body}"
    );
    let secs = retry_after(&headers);
    assert!((1..=30).contains(&secs), "{secs}");
    let (status, headers, body) = post_with(
        a.gw(),
        &format!("/v1/sbp/sessions/{id}/turns"),
        &token,
        json!({"content": "a push"}),
    )
    .await;
    assert_eq!(
        status_code(status, &body),
        (409, "SBP_SESSION_MOVING".to_owned()),
        "{body}"
    );
    assert!((1..=30).contains(&retry_after(&headers)));
    let view = a.gw().session(&id, &token).await;
    assert_eq!(view["session_id"], id.as_str(), "{view}");
    // Another gateway asking meanwhile is refused too (B would close 1013).
    let (status, _, body) = handover(&f.key, &f.gateway_id, &a, &id, &token, Uuid::now_v7()).await;
    assert_eq!(status, 409, "{body}");
}

/// 6c. The origin is killed with `kill -9` in the middle of a handover (after its lease and the
/// adoption on B, before B's commit): the surface on B hears 1013 within B's attach timeout and
/// B serves nothing of the session while its copy waits (409 MOVING, never 200); once A is back
/// with its lease expired, B's copy is settled without any surface (the commit is refused, the
/// copy dropped), A serves the session again, and a fresh attach on B moves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_origin_dying_mid_handover_keeps_the_session_whole() {
    let mut a = Node::new("gw-a-origin-dies", 191).await;
    let mut b = Node::new("gw-b-origin-dies", 192).await;
    let (ap, bp) = (a.pin(), b.pin());
    a.start(&["--peer", &bp, "--handover-lease", "2"]).await;
    b.set_env(PAUSE_ENV, Some("1000"));
    b.start(&[
        "--peer",
        &ap,
        "--enable-test-hooks",
        "--attach-timeout",
        "4",
        "--handover-lease",
        "4",
    ])
    .await;
    let (id, token) = conversation(a.gw(), "the origin dies").await;
    let transcript = a.gw().messages(&id, &token).await;

    let started = Instant::now();
    let mut ws = start_attach(&b, &id, &token).await;
    paused_migration(&b).await;
    a.kill9();
    let code = close_code(&mut ws).await;
    let took = started.elapsed();
    assert_eq!(code, Some(1013), "the surface is told to try again");
    assert!(
        took < Duration::from_secs(6),
        "within B's 4 s attach timeout: {took:?}"
    );
    // B's adopted copy is not served while its commit's outcome is unknown.
    let (status, body) = get_with(b.gw(), &format!("/v1/sessions/{id}"), &token).await;
    assert_eq!(status, 409, "the copy waits: {body}");
    assert_eq!(body["error"]["code"], "SBP_SESSION_MOVING", "{body}");

    // A comes back after its lease expired: B settles its copy by itself.
    tokio::time::sleep_until(started + Duration::from_secs(3)).await;
    a.restart().await;
    eventually(WAIT, "B settles its copy with A", || {
        let b = &b;
        async move { (handovers(b, "target_commit_refused").await >= 1.0).then_some(()) }
    })
    .await;
    let (status, _, body) = chat(a.gw(), &token, "still here").await;
    assert_eq!(status, 200, "A serves the session again: {body}");
    let on_a = a.gw().messages(&id, &token).await;
    assert!(
        on_a.starts_with(&transcript) && on_a.len() > transcript.len(),
        "nothing of the session was lost, and the new turn is on A: {on_a:?}"
    );

    // A fresh attach on B then moves the whole session.
    let now_on_a = a.gw().messages(&id, &token).await;
    let (ws, attached) = try_attach(&b, &id, &token, json!({}))
        .await
        .attached("a fresh attach on B");
    assert_eq!(attached["session_id"], id.as_str());
    assert_eq!(b.gw().messages(&id, &token).await, now_on_a);
    ws.close().await;
}
