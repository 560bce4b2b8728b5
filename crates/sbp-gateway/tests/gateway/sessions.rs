//! Listing sessions (`GET /v1/sessions`: pages, filters, who may list) and deleting one
//! (`DELETE /v1/sessions/{id}`: who may, what is left afterwards, the surface closed, a turn
//! streaming at the time, and the database files read as raw bytes).

use std::collections::HashSet;

use reqwest::Method;
use sbp_gateway::GatewayConfig;
use serde_json::{Value, json};

use crate::support::{Options, TestGateway, TestGatewayExt, Upstream, db_path, sse_data};

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn error_code(body: &Value) -> &str {
    body["error"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("not an error envelope: {body}"))
}

const OPERATOR: &str = "the-operator-key";

fn with_keys() -> Options {
    Options {
        config: GatewayConfig {
            api_keys: vec![OPERATOR.into()],
            secret: vec![7; 32],
            ..GatewayConfig::default()
        },
        ..Options::default()
    }
}

/// `POST /v1/sessions` for `agent`, with `headers`; returns (id, token).
async fn idle(gw: &TestGateway, agent: &str, headers: &[(&str, &str)]) -> (String, String) {
    let (s, _, v) = gw
        .post("/v1/sessions", json!({"agent_id": agent}), headers)
        .await;
    assert_eq!(s, 201, "{v}");
    (
        v["session_id"].as_str().expect("id").to_owned(),
        v["session_token"].as_str().expect("token").to_owned(),
    )
}

/// Every page of `GET {path}?{query}`, following `next_cursor`; the ids in order.
async fn walk(gw: &TestGateway, path: &str, query: &str, auth: &[(&str, &str)]) -> Vec<String> {
    let mut ids = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..100 {
        let url = match &cursor {
            Some(c) => format!("{path}?{query}&cursor={c}"),
            None => format!("{path}?{query}"),
        };
        let (s, page) = gw.get(&url, auth).await;
        assert_eq!(s, 200, "{page}");
        assert_eq!(page["object"], "list");
        for entry in page["data"].as_array().expect("data") {
            assert!(
                entry.get("metadata").is_none() && entry.get("last_task").is_none(),
                "a listing carries no content: {entry}"
            );
            ids.push(entry["session_id"].as_str().expect("id").to_owned());
        }
        match page["next_cursor"].as_str() {
            Some(c) => {
                assert_eq!(page["has_more"], true);
                cursor = Some(c.to_owned());
            }
            None => {
                assert_eq!(page["has_more"], false);
                return ids;
            }
        }
    }
    panic!("more than 100 pages");
}

#[tokio::test]
async fn sessions_are_listed_newest_first_page_by_page_and_filtered() {
    let gw = TestGateway::start().await;
    let mut made = Vec::new();
    for agent in ["agent-x", "agent-y", "agent-x", "agent-x", "agent-y"] {
        made.push(idle(&gw, agent, &[]).await.0);
    }
    // One running: a completion continuing an idle session.
    let (running, token) = idle(&gw, "agent-y", &[]).await;
    let (s, _, b) = gw
        .chat(
            json!({"model": "m", "messages": [user("hi")]}),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    made.push(running.clone());
    let newest_first: Vec<String> = made.iter().rev().cloned().collect();

    for path in ["/v1/sessions", "/v1/sbp/sessions"] {
        for limit in [1, 2, 4, 100] {
            assert_eq!(
                walk(&gw, path, &format!("limit={limit}"), &[]).await,
                newest_first,
                "{path} limit {limit}"
            );
        }
    }
    let (s, first) = gw.get("/v1/sessions", &[]).await;
    assert_eq!(s, 200, "{first}");
    assert_eq!(
        first["data"].as_array().map(Vec::len),
        Some(6),
        "20 by default"
    );
    assert_eq!(first["data"][0]["session_id"], running.as_str());
    assert_eq!(first["data"][0]["agent_id"], "agent-y");
    assert_eq!(first["data"][0]["status"], "running");
    assert_eq!(first["data"][0]["step_count"], 1);
    assert_eq!(first["data"][0]["message_count"], 2);
    assert!(first["data"][0]["created_at"].is_string());
    assert_eq!(first["next_cursor"], Value::Null);

    let of_x: Vec<String> = [3, 2, 0].iter().map(|i| made[*i].clone()).collect();
    assert_eq!(
        walk(&gw, "/v1/sessions", "limit=2&agent_id=agent-x", &[]).await,
        of_x
    );
    assert_eq!(
        walk(&gw, "/v1/sessions", "limit=1&status=running", &[]).await,
        std::slice::from_ref(&running)
    );
    let idle_y: Vec<String> = [4, 1].iter().map(|i| made[*i].clone()).collect();
    assert_eq!(
        walk(
            &gw,
            "/v1/sessions",
            "limit=1&status=idle&agent_id=agent-y",
            &[]
        )
        .await,
        idle_y
    );
    assert!(
        walk(&gw, "/v1/sessions", "limit=5&status=completed", &[])
            .await
            .is_empty()
    );

    for (query, param) in [
        ("limit=0", Some("limit")),
        ("limit=101", Some("limit")),
        ("limit=ten", None),
        ("status=asleep", None),
        ("cursor=bm90LWEtY3Vyc29y", Some("cursor")),
        ("cursor=%25%25", Some("cursor")),
        ("agent_id=", Some("agent_id")),
    ] {
        let (s, b) = gw.get(&format!("/v1/sessions?{query}"), &[]).await;
        assert_eq!(
            (s, error_code(&b)),
            (400, "SBP_BAD_REQUEST"),
            "{query}: {b}"
        );
        if let Some(param) = param {
            assert_eq!(b["error"]["param"], param, "{query}: {b}");
        }
    }
}

/// With operator keys configured only the operator lists (a session token is no key); without
/// keys anyone may (the listing carries no content).
#[tokio::test]
async fn listing_needs_the_operator_key_where_keys_are_configured() {
    let gw = TestGateway::with(with_keys()).await;
    let bearer = format!("Bearer {OPERATOR}");
    let key = [("authorization", bearer.as_str())];
    let (id, token) = idle(&gw, "agent-k", &key).await;
    let both = [
        ("authorization", bearer.as_str()),
        ("x-session-token", token.as_str()),
    ];
    for headers in [
        &[][..],
        &[("x-session-token", token.as_str())][..],
        &[("authorization", "Bearer not-the-key")][..],
    ] {
        let (s, b) = gw.get("/v1/sessions", headers).await;
        assert_eq!((s, error_code(&b)), (401, "SBP_UNAUTHORIZED"), "{b}");
    }
    for headers in [&key[..], &both[..]] {
        let (s, b) = gw.get("/v1/sessions", headers).await;
        assert_eq!(s, 200, "{b}");
        assert_eq!(b["data"][0]["session_id"], id.as_str());
    }

    let open = TestGateway::start().await;
    let (id, _) = idle(&open, "agent-o", &[]).await;
    let (s, b) = open.get("/v1/sbp/sessions", &[]).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["data"][0]["session_id"], id.as_str());
}

#[tokio::test]
async fn a_session_is_deleted_with_its_token_and_is_gone_after() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (other, other_token) = gw.session().await;
    let path = format!("/v1/sessions/{id}");
    let (s, b) = gw.delete(&path, &[]).await;
    assert_eq!((s, error_code(&b)), (401, "SBP_UNAUTHORIZED"), "{b}");
    let (s, b) = gw
        .delete(&path, &[("x-session-token", other_token.as_str())])
        .await;
    assert_eq!((s, error_code(&b)), (403, "SBP_FORBIDDEN"), "{b}");
    let auth = [("x-session-token", token.as_str())];
    let (s, b) = gw.delete(&path, &auth).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b, json!({"session_id": id, "deleted": true}));

    for read in [
        path.clone(),
        format!("/v1/sessions/{id}/messages"),
        format!("/v1/sbp/sessions/{id}/snapshots"),
        format!("/v1/sbp/sessions/{id}/lineage"),
        format!("/v1/sbp/sessions/{id}/memory"),
    ] {
        let (s, b) = gw.get(&read, &auth).await;
        assert_eq!(
            (s, error_code(&b)),
            (404, "SBP_SESSION_NOT_FOUND"),
            "{read}: {b}"
        );
    }
    let (s, b) = gw.delete(&path, &auth).await;
    assert_eq!(
        (s, error_code(&b)),
        (404, "SBP_SESSION_NOT_FOUND"),
        "twice: {b}"
    );
    // Its token continues nothing: a completion with it is refused as any unknown token is, and
    // creates nothing.
    let (s, _, b) = gw
        .chat(json!({"model": "m", "messages": [user("again")]}), &auth)
        .await;
    assert_eq!((s, error_code(&b)), (403, "SBP_FORBIDDEN"), "{b}");
    let listed = walk(&gw, "/v1/sessions", "limit=100", &[]).await;
    assert_eq!(listed, std::slice::from_ref(&other));

    // The alias, and the other session untouched until then.
    assert_eq!(gw.messages(&other, &other_token).await.len(), 2);
    let (s, b) = gw
        .delete(
            &format!("/v1/sbp/sessions/{other}"),
            &[("x-session-token", other_token.as_str())],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert!(walk(&gw, "/v1/sessions", "limit=5", &[]).await.is_empty());
}

/// Where operator keys are configured every call carries the key: with it alone the operator
/// deletes any session; a session token without it is refused before anything is looked up.
#[tokio::test]
async fn the_operator_key_deletes_any_session() {
    let gw = TestGateway::with(with_keys()).await;
    let bearer = format!("Bearer {OPERATOR}");
    let key = [("authorization", bearer.as_str())];
    let (id, token) = idle(&gw, "agent-k", &key).await;
    let path = format!("/v1/sessions/{id}");
    let (s, b) = gw
        .delete(&path, &[("x-session-token", token.as_str())])
        .await;
    assert_eq!((s, error_code(&b)), (401, "SBP_UNAUTHORIZED"), "{b}");
    let (s, b) = gw.delete(&path, &key).await;
    assert_eq!(s, 200, "{b}");
    let (s, b) = gw.get(&path, &key).await;
    assert_eq!((s, error_code(&b)), (404, "SBP_SESSION_NOT_FOUND"), "{b}");
}

/// The surface attached to a deleted session is closed with 4004 (session not found), and an
/// attach afterwards finds no session.
#[tokio::test]
async fn deleting_closes_the_attached_surface() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw.attach(&id, &token, json!({})).await;
    let (s, b) = gw
        .delete(
            &format!("/v1/sessions/{id}"),
            &[("x-session-token", token.as_str())],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    ws.expect_close(4004).await;
    let mut again = gw.ws(&id).await;
    again
        .send(json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token}))
        .await;
    again.expect_error_close("SESSION_NOT_FOUND", 4004).await;
    let (s, b) = gw.get("/v1/sessions", &[]).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["data"], json!([]));
}

/// Whether any file in `dir` (the database, its WAL and shared memory) holds `needle`, read as
/// raw bytes.
fn files_contain(dir: &std::path::Path, needle: &str) -> bool {
    std::fs::read_dir(dir)
        .expect("dir")
        .map(|e| std::fs::read(e.expect("entry").path()).expect("read"))
        .any(|bytes| bytes.windows(needle.len()).any(|w| w == needle.as_bytes()))
}

/// Puts `marker` everywhere a session keeps content: its metadata, a completion (prompt, reply,
/// and an idempotency record with the response), a pushed turn in the tether, its memory and an
/// export (bundle and label). Returns (id, token).
async fn session_marked(gw: &TestGateway, marker: &str) -> (String, String) {
    let (s, _, v) = gw
        .post(
            "/v1/sessions",
            json!({"metadata": {"note": format!("metadata {marker}")}}),
            &[],
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let id = v["session_id"].as_str().expect("id").to_owned();
    let token = v["session_token"].as_str().expect("token").to_owned();
    let auth = [("x-session-token", token.as_str())];
    let key = format!("key-{marker}");
    let (s, _, b) = gw
        .chat(
            json!({"model": "m", "messages": [user(&format!("prompt {marker}"))]}),
            &[
                ("x-session-token", token.as_str()),
                ("idempotency-key", &key),
            ],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    gw.push(&id, &token, &format!("pushed {marker}")).await;
    gw.put_memory(
        &id,
        &token,
        json!({"payload": {"facts": [format!("memory {marker}")]}}),
    )
    .await;
    let (s, _, b) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/export"),
            json!({"label": format!("label {marker}")}),
            &auth,
        )
        .await;
    assert_eq!(s, 201, "{b}");
    (id, token)
}

/// After a deletion the SQLite files hold nothing of the session (its marker, written in every
/// place a session keeps content), while the gateway still runs and after it stopped; a control
/// session's marker is still found.
#[tokio::test]
async fn a_deleted_session_leaves_nothing_in_the_database_files() {
    let gw = TestGateway::start().await;
    let erased = format!("ERASED{}", uuid::Uuid::new_v4().simple());
    let kept = format!("KEPT{}", uuid::Uuid::new_v4().simple());
    let (id, token) = session_marked(&gw, &erased).await;
    session_marked(&gw, &kept).await;
    let dir = gw.dir.clone();
    assert!(db_path(&dir).exists());
    assert!(files_contain(dir.path(), &erased), "the marker was written");

    let (s, b) = gw
        .delete(
            &format!("/v1/sessions/{id}"),
            &[("x-session-token", token.as_str())],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert!(!files_contain(dir.path(), &erased), "gateway running");
    assert!(files_contain(dir.path(), &kept), "the control stays");
    gw.stop().await;
    assert!(!files_contain(dir.path(), &erased), "gateway stopped");
    assert!(files_contain(dir.path(), &kept));
}

/// A session deleted while one of its turns streams: the stream ends without a stored reply, and
/// nothing of the turn is written afterwards (the files hold neither its prompt nor its reply).
#[tokio::test]
async fn a_turn_streaming_during_the_deletion_writes_nothing_after_it() {
    let gw = TestGateway::with(Options {
        upstream: Upstream::Fake,
        ..Options::default()
    })
    .await;
    let (id, token) = gw.idle_session().await;
    let marker = format!("STREAMED{}", uuid::Uuid::new_v4().simple());
    let body = json!({"model": "m", "stream": true, "messages": [user(&format!(
        "[[fake:chunks=8]] [[fake:chunk_delay=100]] {marker} a b c d e f"
    ))]});
    let mut resp = gw
        .request(Method::POST, "/v1/chat/completions", &[])
        .header("x-session-token", &token)
        .json(&body)
        .send()
        .await
        .expect("sent");
    assert_eq!(resp.status(), 200);
    let mut text =
        String::from_utf8_lossy(&resp.chunk().await.expect("read").expect("a chunk")).into_owned();
    let (s, b) = gw
        .delete(
            &format!("/v1/sessions/{id}"),
            &[("x-session-token", token.as_str())],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    while let Some(more) = resp.chunk().await.expect("read") {
        text.push_str(&String::from_utf8_lossy(&more));
    }
    let events = sse_data(&text);
    assert!(
        !text.contains("[DONE]"),
        "the turn did not complete: {text}"
    );
    let last = events.last().expect("events");
    assert_eq!(error_code(last), "SBP_SESSION_NOT_FOUND", "{text}");
    let (s, b) = gw
        .get(
            &format!("/v1/sessions/{id}"),
            &[("x-session-token", token.as_str())],
        )
        .await;
    assert_eq!((s, error_code(&b)), (404, "SBP_SESSION_NOT_FOUND"), "{b}");
    let listed: HashSet<String> = walk(&gw, "/v1/sessions", "limit=10", &[])
        .await
        .into_iter()
        .collect();
    assert!(!listed.contains(&id));
    let dir = gw.dir.clone();
    assert!(!files_contain(dir.path(), &marker), "nothing of the turn");
    gw.stop().await;
    assert!(!files_contain(dir.path(), &marker));
}
