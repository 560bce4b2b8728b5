//! The history cache seen from outside: whatever it holds or has evicted, and whoever appended to
//! a transcript meanwhile (a backend's pushed turn, another session's turns pushing it out of a
//! small budget), every upstream request carries the session's whole transcript in order; the
//! cache's hits, misses and size are on `/metrics`.

use serde_json::{Value, json};

use crate::support::{Options, TestGateway, TestGatewayExt as _, Upstream};

/// (role, content) of each message the upstream was sent last.
fn last_sent(gw: &TestGateway) -> Transcript {
    let sent = gw.fake().requests().pop().expect("an upstream request");
    sent["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| {
            let field = |k: &str| m[k].as_str().unwrap_or_default().to_owned();
            (field("role"), field("content"))
        })
        .collect()
}

/// A transcript as (role, content) pairs.
type Transcript = Vec<(String, String)>;

fn pair(role: &str, content: &str) -> (String, String) {
    (role.to_owned(), content.to_owned())
}

async fn turn(gw: &TestGateway, token: &str, text: &str) -> String {
    let (status, _, body) = gw
        .chat(
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": text}]}),
            &[("x-session-token", token)],
        )
        .await;
    assert_eq!(status, 200, "{body}");
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

async fn start(budget: usize) -> TestGateway {
    let mut options = Options {
        upstream: Upstream::Fake,
        ..Options::default()
    };
    options.config.history_cache_bytes = budget;
    TestGateway::with(options).await
}

/// Three sessions take turns in a cache with room for about one transcript, and a backend pushes
/// a turn into one of them between its turns: each request still carries its whole transcript.
#[tokio::test]
async fn evicted_and_appended_transcripts_are_sent_whole() {
    for budget in [0, 2048, 32 << 20] {
        let gw = start(budget).await;
        let mut sessions: Vec<(String, String, Transcript)> = Vec::new();
        for s in 0..3 {
            let first = format!("session {s} says hello");
            let (id, token) = gw.session_saying(&first).await;
            let reply = format!("echo: {first}");
            sessions.push((
                id,
                token,
                vec![pair("user", &first), pair("assistant", &reply)],
            ));
        }
        for round in 0..4 {
            for (s, (id, token, expected)) in sessions.iter_mut().enumerate() {
                if round == 2 && s == 1 {
                    let pushed = format!("a reminder for session {s}");
                    gw.push(id, token, &pushed).await;
                    expected.push(pair("assistant", &pushed));
                }
                // Non-ASCII and escaped characters: the cache counts the JSON text's bytes as
                // the store does (else every turn would miss).
                let text = format!(
                    "session {s} round {round} é \"q\" 😀\n\u{1}\\ {}",
                    "x".repeat(200)
                );
                let reply = turn(&gw, token, &text).await;
                expected.push(pair("user", &text));
                assert_eq!(
                    &last_sent(&gw),
                    expected,
                    "budget {budget}, session {s}, round {round}"
                );
                expected.push(pair("assistant", &reply));
            }
        }
        let hits = gw.metric("sbp_history_cache_hits_total").await;
        let misses = gw.metric("sbp_history_cache_misses_total").await;
        let bytes = gw.metric("sbp_history_cache_bytes").await.expect("gauge");
        assert!(
            bytes <= budget as u64,
            "budget {budget}: {bytes} bytes held"
        );
        match budget {
            0 => assert_eq!((hits, misses), (Some(0), Some(12)), "nothing is kept"),
            2048 => assert!(misses > Some(3), "evictions make turns read: {misses:?}"),
            // Only the turn after the pushed one reads (the part it lacks).
            _ => assert_eq!((hits, misses), (Some(11), Some(1))),
        }
    }
}

/// A deleted session's transcript leaves the cache with it.
#[tokio::test]
async fn a_deleted_sessions_transcript_is_dropped() {
    let gw = start(32 << 20).await;
    let (id, token) = gw.session_saying("remember the secret word").await;
    turn(&gw, &token, "and again").await;
    assert_eq!(gw.metric("sbp_history_cache_sessions").await, Some(1));
    let (status, body): (u16, Value) = gw
        .delete(
            &format!("/v1/sessions/{id}"),
            &[("x-session-token", &token)],
        )
        .await;
    assert!(status == 200 || status == 204, "{status} {body}");
    assert_eq!(gw.metric("sbp_history_cache_sessions").await, Some(0));
    assert_eq!(gw.metric("sbp_history_cache_bytes").await, Some(0));
}
