//! L3 roaming through the public HTTP API: export, import (token, raw bundle, foreign token),
//! single use under contention, reuse forks, integrity failures, token inspection, handoff, fork,
//! lineage, memory, and the reference server's golden bundle and token.

use std::path::PathBuf;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use sbp_gateway::GatewayConfig;
use sbp_protocol::bundle;
use sbp_protocol::token::{self, RoamingClaims};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use crate::support::{Options, TestGateway, TestGatewayExt, Upstream};

const SECRET: [u8; 32] = [7u8; 32];
const REFERENCE_SECRET: &str = "conformance-test-secret-must-be-32-chars-minimum";
const REFERENCE_TOKEN: &str = "eyJhbGciOiAiSFMyNTYiLCAidHlwIjogIkpXVCJ9.eyJzdWIiOiAiYjNjMjJkZTMtNzc0My00OTQ2LWFhZjctOTE3NGFmMTViNjU5IiwgInNpZCI6ICI5ZmE3M2U5OC1iZjUyLTQ2YzctYjlkMy0xMDEyYzQzODIxYjEiLCAiaWF0IjogMTc5NTMzOTY1NCwgImV4cCI6IDE3OTUzNDMyNTR9.YAFC4oY89fIZYM_0a_KaW_IAhGuN-EhAh_NEryls1Ao";

fn interop_file(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/interop")
        .join(name);
    p.is_file().then_some(p)
}

async fn with_secret(secret: Vec<u8>, upstream: Upstream) -> TestGateway {
    TestGateway::with(Options {
        upstream,
        config: GatewayConfig {
            secret,
            ..GatewayConfig::default()
        },
        ..Options::default()
    })
    .await
}

fn tok(token: &str) -> [(&str, &str); 1] {
    [("x-session-token", token)]
}

/// A session with `turns` completed turns; returns (id, token).
async fn session_with_turns(gw: &TestGateway, turns: usize) -> (String, String) {
    let (id, token) = gw.session().await;
    for i in 1..turns {
        let (s, _, b) = gw
            .chat(
                json!({"model": "gpt-4o", "messages": [{"role": "user", "content": format!("turn {i}")}]}),
                &tok(&token),
            )
            .await;
        assert_eq!(s, 200, "{b}");
    }
    (id, token)
}

async fn export(gw: &TestGateway, id: &str, token: &str, body: Value) -> Value {
    let (s, _, v) = gw
        .post(&format!("/v1/sbp/sessions/{id}/export"), body, &tok(token))
        .await;
    assert_eq!(s, 201, "{v}");
    v
}

async fn import(gw: &TestGateway, body: Value) -> (u16, Value) {
    let (s, _, v) = gw.post("/v1/sbp/sessions/import", body, &[]).await;
    (s, v)
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

fn is_uuid(v: &Value) -> bool {
    v.as_str().is_some_and(|s| Uuid::parse_str(s).is_ok())
}

fn parse_ts(v: &Value) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(v.as_str().expect("timestamp"))
        .expect("rfc3339")
        .with_timezone(&Utc)
}

#[tokio::test]
async fn export_import_then_continue_with_restored_history() {
    let gw = TestGateway::with_fake().await;
    let (id, token) = session_with_turns(&gw, 2).await;
    let source = gw.session_view(&id, &token).await;

    let ex = export(
        &gw,
        &id,
        &token,
        json!({"ttl_seconds": 3600, "label": "continue on mobile"}),
    )
    .await;
    assert!(is_uuid(&ex["export_id"]), "{ex}");
    let rt = ex["roaming_token"].as_str().expect("token");
    assert_eq!(rt.split('.').count(), 3);
    let cid = ex["bundle_cid"].as_str().expect("cid");
    assert!(cid.len() == 64 && cid.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(ex["bundle_hash"], ex["bundle_cid"]);
    assert_eq!(ex["message_count"], 4);
    assert_eq!(ex["label"], "continue on mobile");
    assert_eq!(ex["session_id"], id.as_str());
    let ttl = parse_ts(&ex["expires_at"]) - Utc::now();
    assert!(
        (3590..=3600).contains(&ttl.num_seconds()),
        "ttl {}",
        ttl.num_seconds()
    );
    let claims =
        token::verify(rt, &SECRET, Utc::now().timestamp()).expect("our own token verifies");
    assert_eq!(
        (claims.sub.as_str(), claims.sid.as_str()),
        (ex["export_id"].as_str().expect("id"), id.as_str())
    );
    assert_eq!(claims.exp - claims.iat, 3600);

    let (s, im) = import(&gw, json!({"roaming_token": rt})).await;
    assert_eq!(s, 201, "{im}");
    let new_id = im["session_id"].as_str().expect("id").to_owned();
    let new_token = im["session_token"].as_str().expect("token").to_owned();
    assert_ne!(new_id, id);
    assert_eq!(im["new_session_id"], im["session_id"]);
    assert_eq!(im["origin_export_id"], ex["export_id"]);
    assert_eq!(im["agent_id"], source["agent_id"]);
    assert_eq!(im["step_count"], 2);
    assert_eq!(im["messages_restored"], 4);
    assert_eq!(im["message_count"], 5, "history + one provenance message");
    assert_eq!(im["provenance"]["imported_from"], id.as_str());
    assert_eq!(im["provenance"]["export_id"], ex["export_id"]);
    assert_eq!(im["bundle_cid"], ex["bundle_cid"]);

    let old = gw.messages(&id, &token).await;
    let new = gw.messages(&new_id, &new_token).await;
    assert_eq!(new.len(), 5);
    for (a, b) in old.iter().zip(&new) {
        assert_eq!(
            (&a["role"], &a["content"], &a["model_used"]),
            (&b["role"], &b["content"], &b["model_used"])
        );
    }
    assert_eq!(new[4]["role"], "system");
    assert!(new[4]["content"].as_str().expect("text").contains(&id));

    // The imported session continues: the upstream sees the restored history first.
    gw.fake().clear();
    let (s, _, reply) = gw
        .chat(
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "and now?"}]}),
            &tok(&new_token),
        )
        .await;
    assert_eq!(s, 200, "{reply}");
    assert_eq!(reply["sbp"]["session_id"], new_id.as_str());
    let sent = gw.fake().requests();
    let msgs = sent.last().expect("upstream called")["messages"]
        .as_array()
        .expect("messages")
        .clone();
    assert_eq!(msgs.len(), 6);
    for (i, m) in old.iter().enumerate() {
        assert_eq!(msgs[i]["content"], m["content"], "message {i}");
    }
    assert_eq!(msgs[5]["content"], "and now?");
    // The source is untouched by the import.
    assert_eq!(gw.messages(&id, &token).await.len(), 4);
}

#[tokio::test]
async fn token_errors_and_validation() {
    let gw = TestGateway::start().await;
    let (id, token) = session_with_turns(&gw, 1).await;
    let ex = export(&gw, &id, &token, json!({})).await;
    let rt = ex["roaming_token"].as_str().expect("token").to_owned();
    // Default TTL: 24 hours.
    let ttl = parse_ts(&ex["expires_at"]) - Utc::now();
    assert!((86_390..=86_400).contains(&ttl.num_seconds()));

    let (s, v) = import(&gw, json!({"roaming_token": rt})).await;
    assert_eq!(s, 201, "{v}");
    let (s, v) = import(&gw, json!({"roaming_token": rt})).await;
    assert_eq!((s, code(&v)), (410, "SBP_TOKEN_CONSUMED"), "{v}");

    // Signature, format, secret, algorithm.
    let (head, rest) = rt.split_once('.').expect("segments");
    let (payload, sig) = rest.split_once('.').expect("segments");
    let mut flipped: Vec<char> = sig.chars().collect();
    flipped[3] = if flipped[3] == 'A' { 'B' } else { 'A' };
    let bad_sig = format!("{head}.{payload}.{}", flipped.iter().collect::<String>());
    let foreign_secret = token::sign(
        &RoamingClaims {
            sub: ex["export_id"].as_str().expect("id").to_owned(),
            sid: id.clone(),
            iat: Utc::now().timestamp(),
            exp: Utc::now().timestamp() + 600,
            iss: None,
        },
        &[8u8; 32],
    );
    for bad in [
        bad_sig.as_str(),
        "not-a-token",
        "a.b.c",
        foreign_secret.as_str(),
        "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4In0.",
    ] {
        let (s, v) = import(&gw, json!({"roaming_token": bad})).await;
        assert_eq!((s, code(&v)), (422, "SBP_TOKEN_INVALID"), "{bad}: {v}");
    }

    // Expired: a correctly signed token whose exp has passed.
    let now = Utc::now().timestamp();
    let expired = token::sign(
        &RoamingClaims {
            sub: Uuid::new_v4().to_string(),
            sid: id.clone(),
            iat: now - 7200,
            exp: now - 3600,
            iss: None,
        },
        &SECRET,
    );
    let (s, v) = import(&gw, json!({"roaming_token": expired})).await;
    assert_eq!((s, code(&v)), (410, "SBP_TOKEN_EXPIRED"), "{v}");
    // Valid signature, but an export this gateway does not hold and no bundle sent along.
    let unknown = token::sign(
        &RoamingClaims {
            sub: Uuid::new_v4().to_string(),
            sid: id.clone(),
            iat: now,
            exp: now + 600,
            iss: None,
        },
        &SECRET,
    );
    let (s, v) = import(&gw, json!({"roaming_token": unknown})).await;
    assert_eq!((s, code(&v)), (404, "SBP_NOT_FOUND"), "{v}");

    // Request validation.
    for body in [
        json!({"ttl_seconds": 59}),
        json!({"ttl_seconds": 604_801}),
        json!({"ttl_seconds": "60"}),
        json!({"label": "x".repeat(121)}),
        json!({"label": 5}),
    ] {
        let (s, _, v) = gw
            .post(
                &format!("/v1/sbp/sessions/{id}/export"),
                body.clone(),
                &tok(&token),
            )
            .await;
        assert_eq!((s, code(&v)), (400, "SBP_BAD_REQUEST"), "{body}: {v}");
    }
    let (s, _, v) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/export"),
            json!({"ttl_seconds": 604_800, "label": "é".repeat(120)}),
            &tok(&token),
        )
        .await;
    assert_eq!(s, 201, "bounds are inclusive: {v}");
    for body in [
        json!({}),
        json!({"roaming_token": 5}),
        json!({"roaming_token": rt, "allow_reuse": "yes"}),
        json!({"bundle": "nope"}),
        json!({"roaming_token": rt, "target_agent_id": ""}),
    ] {
        let (s, v) = import(&gw, body.clone()).await;
        assert_eq!((s, code(&v)), (400, "SBP_BAD_REQUEST"), "{body}: {v}");
    }
    let resp = gw
        .http
        .post(format!("{}/v1/sbp/sessions/import", gw.url))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("sent");
    let (s, _, v) = crate::support::response(resp).await;
    assert_eq!((s, code(&v)), (400, "SBP_BAD_REQUEST"), "{v}");

    // Session-scoped endpoints need the session's token.
    for path in ["export", "handoff", "fork"] {
        let url = format!("/v1/sbp/sessions/{id}/{path}");
        let body = json!({"to_agent_id": "b"});
        let (s, _, v) = gw.post(&url, body.clone(), &[]).await;
        assert_eq!((s, code(&v)), (401, "SBP_UNAUTHORIZED"), "{path}: {v}");
        let (s, _, v) = gw.post(&url, body, &tok("sbp_wrong")).await;
        assert_eq!((s, code(&v)), (403, "SBP_FORBIDDEN"), "{path}: {v}");
    }
    for path in ["exports", "lineage", "memory"] {
        let (s, v) = gw.get(&format!("/v1/sbp/sessions/{id}/{path}"), &[]).await;
        assert_eq!((s, code(&v)), (401, "SBP_UNAUTHORIZED"), "{path}: {v}");
    }
    let missing = Uuid::new_v4();
    let (s, _, v) = gw
        .post(
            &format!("/v1/sbp/sessions/{missing}/export"),
            json!({}),
            &tok(&token),
        )
        .await;
    assert_eq!((s, code(&v)), (404, "SBP_SESSION_NOT_FOUND"), "{v}");
    let (s, _, v) = gw
        .post("/v1/sbp/sessions/not-a-uuid/fork", json!({}), &tok(&token))
        .await;
    assert_eq!((s, code(&v)), (422, "SBP_INVALID_UUID"), "{v}");
}

#[tokio::test]
async fn fifty_concurrent_imports_of_one_token_give_one_session() {
    let gw = TestGateway::start().await;
    let (id, token) = session_with_turns(&gw, 3).await;
    let rt = export(&gw, &id, &token, json!({})).await["roaming_token"]
        .as_str()
        .expect("token")
        .to_owned();
    let url = format!("{}/v1/sbp/sessions/import", gw.url);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let (http, url, rt) = (gw.http.clone(), url.clone(), rt.clone());
        tasks.spawn(async move {
            let resp = http
                .post(url)
                .json(&json!({"roaming_token": rt}))
                .send()
                .await
                .expect("sent");
            crate::support::response(resp).await
        });
    }
    let (mut created, mut consumed) = (Vec::new(), 0);
    while let Some(done) = tasks.join_next().await {
        let (s, _, v) = done.expect("task");
        match (s, code(&v)) {
            (201, _) => created.push(v["session_id"].as_str().expect("id").to_owned()),
            (410, "SBP_TOKEN_CONSUMED") => consumed += 1,
            other => panic!("unexpected {other:?}: {v}"),
        }
    }
    assert_eq!((created.len(), consumed), (1, 49));
    let (s, info) = gw.get(&format!("/v1/sbp/token/{rt}"), &[]).await;
    assert_eq!(s, 200, "{info}");
    assert_eq!(info["consumed"], true);
    assert_eq!(info["import_session_id"], created[0].as_str());
    let (s, m) = gw.get("/metrics", &[]).await;
    assert_eq!(s, 200);
    let text = m.as_str().expect("text");
    assert!(text.contains("sbp_imports_total 1"), "{text}");
    assert!(text.contains("sbp_sessions{status=\"idle\"} 1"), "{text}");
}

#[tokio::test]
async fn allow_reuse_makes_independent_forks_without_consuming() {
    let gw = TestGateway::with_fake().await;
    let (id, token) = session_with_turns(&gw, 1).await;
    let ex = export(&gw, &id, &token, json!({"label": "shared"})).await;
    let rt = ex["roaming_token"].as_str().expect("token");
    let mut forks = Vec::new();
    for _ in 0..2 {
        let (s, v) = import(&gw, json!({"roaming_token": rt, "allow_reuse": true})).await;
        assert_eq!(s, 201, "{v}");
        assert_eq!(v["forked"], true);
        forks.push((
            v["session_id"].as_str().expect("id").to_owned(),
            v["session_token"].as_str().expect("token").to_owned(),
        ));
    }
    assert_ne!(forks[0].0, forks[1].0);
    let (_, info) = gw.get(&format!("/v1/sbp/token/{rt}"), &[]).await;
    assert_eq!(info["consumed"], false, "{info}");

    // The forks diverge independently.
    for (i, (fid, ftok)) in forks.iter().enumerate() {
        let (s, _, v) = gw
            .chat(
                json!({"model": "gpt-4o", "messages": [{"role": "user", "content": format!("branch {i}")}]}),
                &tok(ftok),
            )
            .await;
        assert_eq!(s, 200, "{v}");
        let h = gw.messages(fid, ftok).await;
        assert_eq!(h.len(), 5);
        assert_eq!(h[3]["content"], format!("branch {i}"));
    }
    assert_eq!(gw.messages(&id, &token).await.len(), 2);

    // The lineage of the source shows them as forks made through an import.
    let (_, lineage) = gw
        .get(&format!("/v1/sbp/sessions/{id}/lineage"), &tok(&token))
        .await;
    let via: Vec<_> = lineage["forks"]
        .as_array()
        .expect("forks")
        .iter()
        .map(|f| (f["fork_session_id"].clone(), f["via"].clone()))
        .collect();
    for (fid, _) in &forks {
        assert!(via.contains(&(json!(fid), json!("import"))), "{lineage}");
    }
    let (_, fl) = gw
        .get(
            &format!("/v1/sbp/sessions/{}/lineage", forks[0].0),
            &tok(&forks[0].1),
        )
        .await;
    assert_eq!(fl["origin"]["origin_session_id"], id.as_str(), "{fl}");

    // A plain import still consumes it once.
    let (s, v) = import(&gw, json!({"roaming_token": rt})).await;
    assert_eq!(s, 201, "{v}");
    let (s, v) = import(&gw, json!({"roaming_token": rt})).await;
    assert_eq!((s, code(&v)), (410, "SBP_TOKEN_CONSUMED"));
    let (s, v) = import(&gw, json!({"roaming_token": rt, "allow_reuse": true})).await;
    assert_eq!(s, 201, "reuse still allowed after consumption: {v}");
}

/// Tampering with the stored bundle is caught on import, and the token stays unconsumed.
#[tokio::test]
async fn tampered_stored_bundle_is_rejected_without_consuming() {
    let gw = TestGateway::start().await;
    let (id, token) = session_with_turns(&gw, 2).await;
    let ex = export(&gw, &id, &token, json!({})).await;
    let rt = ex["roaming_token"].as_str().expect("token");
    let cid = ex["bundle_cid"].as_str().expect("cid").to_owned();

    let db = rusqlite::Connection::open(crate::support::db_path(&gw.dir)).expect("open db");
    db.busy_timeout(std::time::Duration::from_secs(5))
        .expect("timeout");
    let original: Vec<u8> = db
        .query_row("SELECT body FROM bundles WHERE cid = ?1", [&cid], |r| {
            r.get(0)
        })
        .expect("stored bundle");
    let text = String::from_utf8(original.clone()).expect("utf-8");
    assert!(text.contains("Echo: turn 1"), "{text}");
    let tampered = text.replace("Echo: turn 1", "Echo: turn 9");
    db.execute(
        "UPDATE bundles SET body = ?2 WHERE cid = ?1",
        rusqlite::params![cid, tampered.as_bytes()],
    )
    .expect("tamper");

    let (s, v) = import(&gw, json!({"roaming_token": rt})).await;
    assert_eq!((s, code(&v)), (422, "SBP_TOKEN_INTEGRITY"), "{v}");
    assert_eq!(v["error"]["detail"]["claimed"], cid.as_str());
    let (_, info) = gw.get(&format!("/v1/sbp/token/{rt}"), &[]).await;
    assert_eq!(info["consumed"], false, "{info}");

    db.execute(
        "UPDATE bundles SET body = ?2 WHERE cid = ?1",
        rusqlite::params![cid, original],
    )
    .expect("restore");
    let (s, v) = import(&gw, json!({"roaming_token": rt})).await;
    assert_eq!(s, 201, "{v}");
}

#[tokio::test]
async fn token_inspection_does_not_consume() {
    let gw = TestGateway::start().await;
    let (id, token) = session_with_turns(&gw, 1).await;
    let ex = export(
        &gw,
        &id,
        &token,
        json!({"label": "peek", "ttl_seconds": 120}),
    )
    .await;
    let rt = ex["roaming_token"].as_str().expect("token");
    for _ in 0..2 {
        let (s, info) = gw.get(&format!("/v1/sbp/token/{rt}"), &[]).await;
        assert_eq!(s, 200, "{info}");
        assert_eq!(info["export_id"], ex["export_id"]);
        assert_eq!(info["session_id"], id.as_str());
        assert_eq!(info["expires_at"], ex["expires_at"]);
        assert_eq!(info["label"], "peek");
        assert_eq!(info["message_count"], 2);
        assert_eq!(info["bundle_cid"], ex["bundle_cid"]);
        assert_eq!(info["consumed"], false);
        assert_eq!(info["expired"], false);
        assert!(info["imported_at"].is_null());
    }
    let (s, v) = import(&gw, json!({"roaming_token": rt})).await;
    assert_eq!(s, 201, "{v}");
    let (_, info) = gw.get(&format!("/v1/sbp/token/{rt}"), &[]).await;
    assert_eq!(info["consumed"], true);
    assert_eq!(info["import_session_id"], v["session_id"]);
    assert!(parse_ts(&info["imported_at"]) <= Utc::now());

    let (s, v) = gw.get("/v1/sbp/token/abc.def.ghi", &[]).await;
    assert_eq!((s, code(&v)), (422, "SBP_TOKEN_INVALID"), "{v}");
    let now = Utc::now().timestamp();
    let unknown = token::sign(
        &RoamingClaims {
            sub: Uuid::new_v4().to_string(),
            sid: id,
            iat: now,
            exp: now + 60,
            iss: None,
        },
        &SECRET,
    );
    let (s, v) = gw.get(&format!("/v1/sbp/token/{unknown}"), &[]).await;
    assert_eq!((s, code(&v)), (404, "SBP_NOT_FOUND"), "{v}");
}

fn require_lineage_shape(v: &Value) {
    // The required members and types of the public lineage schema.
    assert!(is_uuid(&v["session_id"]), "{v}");
    for k in ["exports", "outgoing_handoffs", "incoming_handoffs", "forks"] {
        assert!(v[k].is_array(), "{k}: {v}");
    }
    assert!(v["origin"].is_null() || v["origin"].is_object(), "{v}");
    for e in v["exports"].as_array().into_iter().flatten() {
        assert!(is_uuid(&e["export_id"]), "{e}");
        parse_ts(&e["expires_at"]);
        parse_ts(&e["created_at"]);
        assert!(e["imported_at"].is_null() || e["imported_at"].is_string());
        assert!(e["import_session_id"].is_null() || is_uuid(&e["import_session_id"]));
    }
}

#[tokio::test]
async fn handoff_fork_and_lineage_of_three_sessions() {
    let gw = TestGateway::start().await;
    let (a, a_tok) = session_with_turns(&gw, 2).await;
    let a_agent = gw.session_view(&a, &a_tok).await["agent_id"].clone();

    // Validation first: nothing is created by a refused handoff.
    for body in [
        json!({}),
        json!({"to_agent_id": ""}),
        json!({"to_agent_id": "b", "handoff_message": "x".repeat(2001)}),
        json!({"to_agent_id": "b", "reason": "x".repeat(501)}),
    ] {
        let (s, _, v) = gw
            .post(
                &format!("/v1/sbp/sessions/{a}/handoff"),
                body.clone(),
                &tok(&a_tok),
            )
            .await;
        assert_eq!((s, code(&v)), (400, "SBP_BAD_REQUEST"), "{body}: {v}");
    }

    let (s, _, h) = gw
        .post(
            &format!("/v1/sbp/sessions/{a}/handoff"),
            json!({"to_agent_id": "agent-beta", "handoff_message": "Please book the flights.",
                   "reason": "planning done"}),
            &tok(&a_tok),
        )
        .await;
    assert_eq!(s, 201, "{h}");
    assert_eq!(h["from_session_id"], a.as_str());
    assert_eq!(h["source_session_id"], a.as_str());
    assert_eq!(h["to_agent_id"], "agent-beta");
    assert_eq!(h["new_session_id"], h["session_id"]);
    assert_eq!(h["new_session_token"], h["session_token"]);
    assert!(is_uuid(&h["export_id"]));
    let c = h["new_session_id"].as_str().expect("id").to_owned();
    let c_tok = h["new_session_token"].as_str().expect("token").to_owned();

    // The source is suspended; the new session belongs to agent-beta and starts with the bridge.
    assert_eq!(gw.session_view(&a, &a_tok).await["status"], "suspended");
    let cv = gw.session_view(&c, &c_tok).await;
    assert_eq!(
        (cv["agent_id"].as_str(), cv["step_count"].as_u64()),
        (Some("agent-beta"), Some(2))
    );
    let ch = gw.messages(&c, &c_tok).await;
    let ah = gw.messages(&a, &a_tok).await;
    assert_eq!(ch.len(), ah.len() + 1);
    assert_eq!(ch[0]["role"], "system");
    let bridge = ch[0]["content"].as_str().expect("bridge");
    assert!(
        bridge.contains("Please book the flights.") && bridge.contains("planning done"),
        "{bridge}"
    );
    for (x, y) in ah.iter().zip(&ch[1..]) {
        assert_eq!(x["content"], y["content"]);
    }
    // A token that is not the session's own cannot act on it.
    let (s, _, v) = gw
        .post(
            &format!("/v1/sbp/sessions/{a}/fork"),
            json!({}),
            &tok(&c_tok),
        )
        .await;
    assert_eq!((s, code(&v)), (403, "SBP_FORBIDDEN"), "{v}");

    let (s, _, f) = gw
        .post(
            &format!("/v1/sbp/sessions/{c}/fork"),
            json!({"label": "plan B"}),
            &tok(&c_tok),
        )
        .await;
    assert_eq!(s, 201, "{f}");
    let fk = f["fork_session_id"].as_str().expect("id").to_owned();

    let lineage = |id: String, t: String| {
        let gw = &gw;
        async move {
            let (s, v) = gw
                .get(&format!("/v1/sbp/sessions/{id}/lineage"), &tok(&t))
                .await;
            assert_eq!(s, 200, "{v}");
            require_lineage_shape(&v);
            v
        }
    };
    let la = lineage(a.clone(), a_tok.clone()).await;
    assert_eq!(
        la["outgoing_handoffs"].as_array().map(Vec::len),
        Some(1),
        "{la}"
    );
    let out = &la["outgoing_handoffs"][0];
    assert_eq!(out["to_session_id"], c.as_str());
    assert_eq!(out["to_agent"], "agent-beta");
    assert_eq!(out["reason"], "planning done");
    assert_eq!(la["exports"].as_array().map(Vec::len), Some(1));
    assert_eq!(la["exports"][0]["export_id"], h["export_id"]);
    assert_eq!(la["exports"][0]["import_session_id"], c.as_str());
    assert!(la["exports"][0]["imported_at"].is_string());
    assert!(la["incoming_handoffs"].as_array().expect("in").is_empty());
    assert!(la["forks"].as_array().expect("forks").is_empty());
    assert!(la["origin"].is_null());

    let lc = lineage(c.clone(), c_tok.clone()).await;
    assert_eq!(
        lc["incoming_handoffs"].as_array().map(Vec::len),
        Some(1),
        "{lc}"
    );
    let inc = &lc["incoming_handoffs"][0];
    assert_eq!(inc["from_session_id"], a.as_str());
    assert_eq!(inc["from_agent"], a_agent);
    assert_eq!(inc["handoff_id"], out["handoff_id"]);
    assert_eq!(lc["forks"].as_array().map(Vec::len), Some(1));
    assert_eq!(lc["forks"][0]["fork_session_id"], fk.as_str());
    assert_eq!(lc["forks"][0]["fork_label"], "plan B");
    assert_eq!(lc["forks"][0]["fork_point_msg"], ch.len());

    let lf = lineage(
        fk.clone(),
        f["session_token"].as_str().expect("t").to_owned(),
    )
    .await;
    assert_eq!(lf["origin"]["origin_session_id"], c.as_str(), "{lf}");
    assert_eq!(lf["origin"]["fork_label"], "plan B");
    assert!(lf["outgoing_handoffs"].as_array().expect("out").is_empty());

    // The exports list shows the handoff's export too.
    let (s, ex) = gw
        .get(&format!("/v1/sbp/sessions/{a}/exports"), &tok(&a_tok))
        .await;
    assert_eq!(s, 200, "{ex}");
    assert_eq!(ex["exports"][0]["import_session_id"], c.as_str());
    assert_eq!(ex["exports"][0]["consumed"], true);

    // Lifecycle conflicts: a completed session can be neither handed off nor forked.
    let (s, v) = gw
        .patch(
            &format!("/v1/sbp/sessions/{c}/status"),
            json!({"status": "completed"}),
            &tok(&c_tok),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    for (path, body) in [
        ("handoff", json!({"to_agent_id": "x"})),
        ("fork", json!({})),
    ] {
        let (s, _, v) = gw
            .post(&format!("/v1/sbp/sessions/{c}/{path}"), body, &tok(&c_tok))
            .await;
        assert_eq!((s, code(&v)), (409, "SBP_SESSION_CONFLICT"), "{path}: {v}");
    }
    let lc = lineage(c.clone(), c_tok.clone()).await;
    assert_eq!(
        lc["forks"].as_array().map(Vec::len),
        Some(1),
        "nothing recorded"
    );
    assert!(lc["exports"].as_array().expect("exports").is_empty());
}

#[tokio::test]
async fn fork_copies_history_then_diverges() {
    let gw = TestGateway::with_fake().await;
    let (a, a_tok) = session_with_turns(&gw, 2).await;
    let (s, _, f) = gw
        .post(
            &format!("/v1/sbp/sessions/{a}/fork"),
            json!({"label": "experiment-A"}),
            &tok(&a_tok),
        )
        .await;
    assert_eq!(s, 201, "{f}");
    assert_eq!(f["fork_label"], "experiment-A");
    assert_eq!(f["origin_session_id"], a.as_str());
    assert_eq!(f["fork_point_step"], 2);
    assert_eq!(f["fork_point_msg"], 4);
    assert_eq!(f["fork_session_token"], f["session_token"]);
    let fk = f["fork_session_id"].as_str().expect("id").to_owned();
    let f_tok = f["fork_session_token"].as_str().expect("token").to_owned();
    assert_eq!(
        gw.messages(&fk, &f_tok).await,
        gw.messages(&a, &a_tok).await
    );
    let fv = gw.session_view(&fk, &f_tok).await;
    assert_eq!(
        (fv["step_count"].as_u64(), fv["status"].as_str()),
        (Some(2), Some("idle"))
    );

    for (id, t, text) in [(&a, &a_tok, "origin path"), (&fk, &f_tok, "fork path")] {
        let (s, _, v) = gw
            .chat(
                json!({"model": "gpt-4o", "messages": [{"role": "user", "content": text}]}),
                &tok(t),
            )
            .await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["sbp"]["session_id"], id.as_str());
    }
    let ha = gw.messages(&a, &a_tok).await;
    let hf = gw.messages(&fk, &f_tok).await;
    assert_eq!((ha.len(), hf.len()), (6, 6));
    assert_eq!(ha[..4], hf[..4]);
    assert_eq!(
        (ha[4]["content"].as_str(), hf[4]["content"].as_str()),
        (Some("origin path"), Some("fork path"))
    );
    // The fork's upstream call saw only its own branch.
    let last = gw.fake().requests().into_iter().last().expect("requests");
    let texts: Vec<_> = last["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["content"].clone())
        .collect();
    assert!(texts.contains(&json!("fork path")) && !texts.contains(&json!("origin path")));
}

/// A bundle with non-ASCII text, floats and tool calls travels to another gateway (no shared secret)
/// as a raw bundle; its CID verifies on receipt and the messages arrive unchanged.
#[tokio::test]
async fn rich_bundle_round_trips_between_gateways_with_a_stable_cid() {
    let gw = TestGateway::start().await;
    let messages = json!([
        {"role": "system", "content": "Réponds en français — 日本語も OK ✈ 😀"},
        {"role": "user", "content": [{"type": "text", "text": "Budget: 1500.50 EUR,東京"}],
         "x_meta": {"score": 0.1, "tiny": 1e-05, "big": 1e16, "amount": 1500.5, "neg": -0.0, "n": 3}},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "gps", "arguments": "{\"lat\": 35.6762, \"lon\": 139.6503}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"lat\": 35.6762, \"lon\": 139.6503}"},
        {"role": "user", "content": "Et maintenant ? 🚄"}
    ]);
    let (s, headers, v) = gw
        .chat(json!({"model": "gpt-4o", "messages": messages}), &[])
        .await;
    assert_eq!(s, 200, "{v}");
    let id = v["sbp"]["session_id"].as_str().expect("id").to_owned();
    let t = headers["x-session-token"]
        .to_str()
        .expect("token")
        .to_owned();
    gw.put_memory(
        &id,
        &t,
        json!({"payload": {"fav": "ラーメン", "ratio": 0.25}}),
    )
    .await;

    let ex = export(&gw, &id, &t, json!({"include_bundle": true})).await;
    let sealed = ex["bundle"].as_object().expect("bundle").clone();
    assert_eq!(sealed["bundle_cid"], ex["bundle_cid"]);
    // Recomputing the digest after a trip through JSON text gives the same CID.
    let reparsed: Map<String, Value> =
        serde_json::from_str(&serde_json::to_string(&sealed).expect("text")).expect("parse");
    assert_eq!(
        bundle::verify_cid(&reparsed).expect("verifies"),
        ex["bundle_cid"].as_str().expect("cid")
    );
    assert_eq!(sealed["messages"].as_array().map(Vec::len), Some(6));
    assert_eq!(
        sealed["messages"][1]["x_meta"]["tiny"].as_f64(),
        Some(1e-05)
    );

    let other = with_secret(vec![42u8; 32], Upstream::Echo).await;
    let (s, im) = import(&other, json!({"bundle": reparsed})).await;
    assert_eq!(s, 201, "{im}");
    assert_eq!(im["bundle_cid"], ex["bundle_cid"]);
    assert_eq!(im["memory_restored"], true);
    assert_eq!(im["provenance"]["via"], "bundle");
    let nid = im["session_id"].as_str().expect("id").to_owned();
    let ntok = im["session_token"].as_str().expect("token").to_owned();
    let (_, mem) = other
        .get(&format!("/v1/sbp/sessions/{nid}/memory"), &tok(&ntok))
        .await;
    assert_eq!(mem["payload"], json!({"fav": "ラーメン", "ratio": 0.25}));

    // Re-exported from the second gateway, the messages are byte-identical in canonical form.
    let ex2 = export(&other, &nid, &ntok, json!({"include_bundle": true})).await;
    let m1 = &sealed["messages"];
    let m2 = ex2["bundle"]["messages"].as_array().expect("messages");
    assert_eq!(m2.len(), 7, "6 restored + provenance");
    let first_six = Value::Array(m2[..6].to_vec());
    assert_eq!(
        sbp_protocol::canonical::to_canonical_bytes(m1),
        sbp_protocol::canonical::to_canonical_bytes(&first_six)
    );
    // A single changed character is caught.
    let mut tampered = reparsed.clone();
    tampered["messages"][4]["content"] = json!("Et maintenant ? 🚅");
    let (s, v) = import(&other, json!({"bundle": tampered})).await;
    assert_eq!((s, code(&v)), (422, "SBP_TOKEN_INTEGRITY"), "{v}");
    let mut unsigned = reparsed.clone();
    unsigned.remove("bundle_cid");
    let (s, v) = import(&other, json!({"bundle": unsigned})).await;
    assert_eq!((s, code(&v)), (422, "SBP_TOKEN_INTEGRITY"), "{v}");
}

/// Two gateways that share the secret: a token minted by one imports on the other when the bundle
/// travels with it, once.
#[tokio::test]
async fn foreign_token_with_bundle_imports_once() {
    let a = with_secret(SECRET.to_vec(), Upstream::Echo).await;
    let b = with_secret(SECRET.to_vec(), Upstream::Echo).await;
    let (id, t) = session_with_turns(&a, 2).await;
    let ex = export(&a, &id, &t, json!({"include_bundle": true})).await;
    let rt = ex["roaming_token"].as_str().expect("token");
    let (s, v) = import(&b, json!({"roaming_token": rt})).await;
    assert_eq!((s, code(&v)), (404, "SBP_NOT_FOUND"), "{v}");
    let (s, v) = import(&b, json!({"roaming_token": rt, "bundle": ex["bundle"]})).await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["messages_restored"], 4);
    assert_eq!(v["origin_export_id"], ex["export_id"]);
    let (s, v) = import(&b, json!({"roaming_token": rt, "bundle": ex["bundle"]})).await;
    assert_eq!((s, code(&v)), (410, "SBP_TOKEN_CONSUMED"), "{v}");
    // A bundle of another export does not ride on this token.
    let ex2 = export(&a, &id, &t, json!({"include_bundle": true})).await;
    let fresh = ex2["roaming_token"].as_str().expect("token");
    let (s, v) = import(&b, json!({"roaming_token": fresh, "bundle": ex["bundle"]})).await;
    assert_eq!((s, code(&v)), (422, "SBP_TOKEN_INTEGRITY"), "{v}");
    // On the minting gateway the token is still unconsumed: single use is per gateway.
    let (_, info) = a.get(&format!("/v1/sbp/token/{rt}"), &[]).await;
    assert_eq!(info["consumed"], false);
}

#[tokio::test]
async fn memory_is_restored_only_for_known_schemas() {
    let gw = TestGateway::start().await;
    let (id, t) = session_with_turns(&gw, 1).await;
    let (s, m) = gw
        .get(&format!("/v1/sbp/sessions/{id}/memory"), &tok(&t))
        .await;
    assert_eq!(s, 200, "{m}");
    assert_eq!(
        (m["schema_id"].as_str(), &m["payload"]),
        (Some("urn:sbp:memory:kv:v1"), &json!({}))
    );
    for body in [
        json!({"schema_id": "urn:other:v1", "payload": {}}),
        json!({"payload": [1, 2]}),
        json!({}),
    ] {
        let (s, v) = gw
            .put(
                &format!("/v1/sbp/sessions/{id}/memory"),
                body.clone(),
                &tok(&t),
            )
            .await;
        assert_eq!((s, code(&v)), (400, "SBP_BAD_REQUEST"), "{body}: {v}");
    }
    gw.put_memory(
        &id,
        &t,
        json!({"schema_id": "urn:sbp:memory:kv:v1", "payload": {"city": "Kyoto"}}),
    )
    .await;
    let ex = export(&gw, &id, &t, json!({"include_bundle": true})).await;
    assert_eq!(ex["bundle"]["memory"]["payload"]["city"], "Kyoto");
    let (s, im) = import(&gw, json!({"roaming_token": ex["roaming_token"]})).await;
    assert_eq!(s, 201, "{im}");
    assert_eq!(im["memory_restored"], true);
    let nid = im["session_id"].as_str().expect("id");
    let nt = im["session_token"].as_str().expect("token");
    let (_, m) = gw
        .get(&format!("/v1/sbp/sessions/{nid}/memory"), &tok(nt))
        .await;
    assert_eq!(m["payload"]["city"], "Kyoto");

    // A bundle whose memory has a schema this gateway does not know imports without it.
    let mut foreign = ex["bundle"].as_object().expect("bundle").clone();
    foreign.insert(
        "memory".into(),
        json!({"schema_id": "silkbridge.memory.v1", "payload": {"facts": ["x"]}}),
    );
    bundle::seal(&mut foreign);
    let (s, im) = import(&gw, json!({"bundle": foreign})).await;
    assert_eq!(s, 201, "{im}");
    assert_eq!(im["memory_restored"], false);
    assert!(
        im["memory_skipped_reason"]
            .as_str()
            .expect("reason")
            .contains("silkbridge.memory.v1")
    );
    let nid = im["session_id"].as_str().expect("id");
    let nt = im["session_token"].as_str().expect("token");
    let (_, m) = gw
        .get(&format!("/v1/sbp/sessions/{nid}/memory"), &tok(nt))
        .await;
    assert_eq!(m["payload"], json!({}));
}

/// The bundle captured from the Python reference server verifies and imports; its messages and
/// snapshot are restored.
#[tokio::test]
async fn reference_bundle_imports() {
    let Some(path) = interop_file("reference-bundle.json") else {
        eprintln!("../shared/interop not present; skipping");
        return;
    };
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json");
    let gw = TestGateway::start().await;
    let (s, im) = import(&gw, json!({"bundle": golden})).await;
    assert_eq!(s, 201, "{im}");
    assert_eq!(
        im["bundle_cid"],
        "bdce608edc8a1902042ac2a977f612a56dd57e77a99745e86404a150263e52f2"
    );
    assert_eq!(im["messages_restored"], 4);
    assert_eq!(im["agent_id"], "anonymous");
    assert_eq!(
        im["origin_export_id"],
        "b3c22de3-7743-4946-aaf7-9174af15b659"
    );
    assert_eq!(
        im["source_session_id"],
        "9fa73e98-bf52-46c7-b9d3-1012c43821b1"
    );
    assert_eq!(im["snapshot_restored"], true);
    assert_eq!(im["memory_restored"], false);
    let id = im["session_id"].as_str().expect("id");
    let t = im["session_token"].as_str().expect("token");
    let h = gw.messages(id, t).await;
    assert_eq!(h[0]["content"], "Plan a trip to Tokyo — 東京 ✈");
    assert_eq!(h[1]["model_used"], "gpt-4o");
    assert_eq!(h[3]["content"], "Fake reply #1 to: Budget: 1500.50 EUR");
    let (s, snap) = gw
        .get(&format!("/v1/sbp/sessions/{id}/snapshots/latest"), &tok(t))
        .await;
    assert_eq!(s, 200, "{snap}");
    assert_eq!(
        (snap["step_count"].as_u64(), snap["message_count"].as_u64()),
        (Some(2), Some(4))
    );

    let mut tampered = golden.clone();
    tampered["messages"][2]["content"] = json!("Budget: 1500.51 EUR");
    let (s, v) = import(&gw, json!({"bundle": tampered})).await;
    assert_eq!((s, code(&v)), (422, "SBP_TOKEN_INTEGRITY"), "{v}");
}

/// The reference server's token verifies under its secret: it is rejected only for having expired
/// (it was minted with a one-hour lifetime), never for its signature, on import and inspection; under
/// another secret it is invalid.
#[tokio::test]
async fn reference_token_verifies_with_its_secret() {
    let Some(path) = interop_file("reference-bundle.json") else {
        eprintln!("../shared/interop not present; skipping");
        return;
    };
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json");
    let gw = with_secret(REFERENCE_SECRET.as_bytes().to_vec(), Upstream::Echo).await;
    let claims = token::verify(REFERENCE_TOKEN, REFERENCE_SECRET.as_bytes(), 1_795_339_655)
        .expect("verifies while valid");
    let expired = Utc::now().timestamp() >= claims.exp;
    let (s, v) = import(
        &gw,
        json!({"roaming_token": REFERENCE_TOKEN, "bundle": golden}),
    )
    .await;
    if expired {
        assert_eq!((s, code(&v)), (410, "SBP_TOKEN_EXPIRED"), "{v}");
    } else {
        assert_eq!(s, 201, "{v}");
    }
    // Inspection checks the signature but not expiry; the export lives on the reference server.
    let (s, v) = gw
        .get(&format!("/v1/sbp/token/{REFERENCE_TOKEN}"), &[])
        .await;
    assert_eq!((s, code(&v)), (404, "SBP_NOT_FOUND"), "{v}");

    let other = TestGateway::start().await;
    let (s, v) = import(
        &other,
        json!({"roaming_token": REFERENCE_TOKEN, "bundle": golden}),
    )
    .await;
    assert_eq!((s, code(&v)), (422, "SBP_TOKEN_INVALID"), "{v}");
    let (s, v) = other
        .get(&format!("/v1/sbp/token/{REFERENCE_TOKEN}"), &[])
        .await;
    assert_eq!((s, code(&v)), (422, "SBP_TOKEN_INVALID"), "{v}");
}

#[tokio::test]
async fn roaming_survives_restart() {
    let gw = TestGateway::start().await;
    let (id, t) = session_with_turns(&gw, 2).await;
    let ex = export(&gw, &id, &t, json!({})).await;
    let dir: Arc<tempfile::TempDir> = gw.stop().await;
    let gw = TestGateway::with(Options {
        dir: Some(dir),
        ..Options::default()
    })
    .await;
    let (s, v) = import(&gw, json!({"roaming_token": ex["roaming_token"]})).await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["messages_restored"], 4);
    let (s, v) = import(&gw, json!({"roaming_token": ex["roaming_token"]})).await;
    assert_eq!((s, code(&v)), (410, "SBP_TOKEN_CONSUMED"), "{v}");
}

#[tokio::test]
async fn tokens_signed_before_a_secret_rotation_still_import() {
    let old = vec![1u8; 32];
    let new = vec![2u8; 40];
    let gw = with_secret(old.clone(), Upstream::Echo).await;
    let (id, t) = session_with_turns(&gw, 1).await;
    let before = export(&gw, &id, &t, json!({})).await;
    let spare = export(&gw, &id, &t, json!({})).await;
    // A session created by an idempotent request before the rotation.
    let (s, _, created) = gw
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "sbp": {}}),
            &[("idempotency-key", "rotation-created-1")],
        )
        .await;
    assert_eq!(s, 200, "{created}");
    let dir: Arc<tempfile::TempDir> = gw.stop().await;

    let gw = TestGateway::with(Options {
        dir: Some(dir.clone()),
        config: GatewayConfig {
            secret: new.clone(),
            previous_secrets: vec![old.clone()],
            ..GatewayConfig::default()
        },
        ..Options::default()
    })
    .await;
    let (id2, t2) = session_with_turns(&gw, 1).await;
    let after = export(&gw, &id2, &t2, json!({})).await;
    let (s, v) = import(&gw, json!({"roaming_token": before["roaming_token"]})).await;
    assert_eq!(s, 201, "a token of the previous secret imports: {v}");
    // New tokens are signed with the new secret only.
    let after_token = after["roaming_token"].as_str().expect("token");
    assert!(token::verify(after_token, &new, 0).is_ok());
    assert!(token::verify(after_token, &old, 0).is_err());
    // The replay of the idempotent request hands out the token the session really has.
    let (s, _, replayed) = gw
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "sbp": {}}),
            &[("idempotency-key", "rotation-created-1")],
        )
        .await;
    assert_eq!(s, 200, "{replayed}");
    assert_eq!(
        replayed["sbp"]["session_token"],
        created["sbp"]["session_token"]
    );
    let sid = created["sbp"]["session_id"].as_str().expect("session id");
    let st = replayed["sbp"]["session_token"].as_str().expect("token");
    let (s, _) = gw.get(&format!("/v1/sessions/{sid}"), &tok(st)).await;
    assert_eq!(s, 200);
    gw.stop().await;

    // Without the previous secret, a token it signed is refused.
    let gw = TestGateway::with(Options {
        dir: Some(dir),
        config: GatewayConfig {
            secret: new,
            ..GatewayConfig::default()
        },
        ..Options::default()
    })
    .await;
    let (s, v) = import(&gw, json!({"roaming_token": spare["roaming_token"]})).await;
    assert_eq!((s, code(&v)), (422, "SBP_TOKEN_INVALID"), "{v}");
}

/// A transcript long enough to be read and canonicalised in two pieces exports to the same bundle
/// a whole-tree serialisation gives, in order, and imports back complete.
#[tokio::test]
async fn long_session_exports_in_pieces_and_imports_complete() {
    let gw = TestGateway::start().await;
    let messages: Vec<Value> = (0..1301u32)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": format!("message {i} — 東京 {}", "x".repeat(i as usize % 7)),
                   "x": {"n": i, "f": f64::from(i) / 8.0}})
        })
        .collect();
    let mut seed = json!({
        "sbp_version": "1.0", "exported_at": "2026-01-01T00:00:00Z", "label": null,
        "session": {"id": Uuid::new_v4(), "agent_id": "long", "status": "idle",
                    "created_at": "2026-01-01T00:00:00Z", "step_count": 650},
        "messages": messages, "memory": {}, "state_snapshot": null,
        "metadata": {"export_id": Uuid::new_v4(), "message_count": 1301},
    })
    .as_object()
    .expect("object")
    .clone();
    bundle::seal(&mut seed);
    let (s, im) = import(&gw, json!({"bundle": seed})).await;
    assert_eq!(s, 201, "{im}");
    let id = im["session_id"].as_str().expect("id").to_owned();
    let t = im["session_token"].as_str().expect("token").to_owned();

    let ex = export(&gw, &id, &t, json!({"include_bundle": true})).await;
    assert_eq!(ex["message_count"], 1302);
    let sealed = ex["bundle"].as_object().expect("bundle");
    assert_eq!(
        bundle::verify_cid(sealed).expect("verifies"),
        ex["bundle_cid"].as_str().expect("cid")
    );
    let out = sealed["messages"].as_array().expect("messages");
    assert_eq!(out.len(), 1302);
    for (i, (a, b)) in messages.iter().zip(out).enumerate() {
        assert_eq!(
            (&a["role"], &a["content"], &a["x"]),
            (&b["role"], &b["content"], &b["x"]),
            "{i}"
        );
    }
    assert_eq!(out[1301]["role"], "system");
    let (s, im) = import(&gw, json!({"roaming_token": ex["roaming_token"]})).await;
    assert_eq!(s, 201, "{im}");
    assert_eq!(im["messages_restored"], 1302);
    let nid = im["session_id"].as_str().expect("id");
    let nt = im["session_token"].as_str().expect("token");
    let h = gw.messages(nid, nt).await;
    assert_eq!(h.len(), 1000, "first page");
    assert_eq!(h[700]["content"], messages[700]["content"]);
}

/// A session without messages exports and imports too; the exports list shows every import of an
/// export, reuse imports included.
#[tokio::test]
async fn empty_session_roams_and_exports_list_its_imports() {
    let gw = TestGateway::start().await;
    let (s, _, created) = gw
        .post("/v1/sessions", json!({"agent_id": "quiet"}), &[])
        .await;
    assert_eq!(s, 201, "{created}");
    let id = created["session_id"].as_str().expect("id").to_owned();
    let t = created["session_token"].as_str().expect("token").to_owned();
    let ex = export(&gw, &id, &t, json!({"include_bundle": true})).await;
    assert_eq!(ex["message_count"], 0);
    assert_eq!(ex["bundle"]["messages"], json!([]));
    let rt = ex["roaming_token"].as_str().expect("token");
    let (s, reuse) = import(&gw, json!({"roaming_token": rt, "allow_reuse": true})).await;
    assert_eq!(s, 201, "{reuse}");
    let (s, im) = import(&gw, json!({"roaming_token": rt, "target_agent_id": "loud"})).await;
    assert_eq!(s, 201, "{im}");
    assert_eq!(
        (im["messages_restored"].as_u64(), im["agent_id"].as_str()),
        (Some(0), Some("loud"))
    );

    let (s, list) = gw
        .get(&format!("/v1/sbp/sessions/{id}/exports"), &tok(&t))
        .await;
    assert_eq!(s, 200, "{list}");
    let e = &list["exports"][0];
    assert_eq!(e["export_id"], ex["export_id"]);
    assert_eq!(e["import_session_id"], im["session_id"]);
    let imports: Vec<_> = e["imports"]
        .as_array()
        .expect("imports")
        .iter()
        .map(|i| (i["session_id"].clone(), i["allow_reuse"].clone()))
        .collect();
    assert_eq!(
        imports,
        vec![
            (reuse["session_id"].clone(), json!(true)),
            (im["session_id"].clone(), json!(false))
        ]
    );
    let (_, lineage) = gw
        .get(&format!("/v1/sbp/sessions/{id}/lineage"), &tok(&t))
        .await;
    assert_eq!(lineage["imports"][0]["import_session_id"], im["session_id"]);
    let nid = im["session_id"].as_str().expect("id");
    let nt = im["session_token"].as_str().expect("token");
    let (_, mine) = gw
        .get(&format!("/v1/sbp/sessions/{nid}/lineage"), &tok(nt))
        .await;
    assert_eq!(
        mine["imported_from"]["source_session_id"],
        id.as_str(),
        "{mine}"
    );
    assert!(mine["origin"].is_null());
}

#[tokio::test]
async fn retention_sweeps_consumed_exports_and_old_snapshots() {
    use std::time::Duration;
    let gw = TestGateway::with(Options {
        config: GatewayConfig {
            retention_interval: Duration::from_millis(50),
            export_retention: Some(Duration::ZERO),
            snapshot_retention: Some(Duration::ZERO),
            ..sbp_test_support::config()
        },
        ..Options::default()
    })
    .await;
    let (id, t) = session_with_turns(&gw, 3).await;
    let ex = export(&gw, &id, &t, json!({})).await;
    let (s, v) = import(&gw, json!({"roaming_token": ex["roaming_token"]})).await;
    assert_eq!(s, 201, "{v}");
    let swept = |kind: &'static str| {
        let gw = &gw;
        async move {
            gw.metric(&format!("sbp_retention_swept_total{{kind=\"{kind}\"}}"))
                .await
                .unwrap_or(0)
        }
    };
    sbp_test_support::eventually(
        sbp_test_support::WAIT,
        "the consumed export is swept",
        || async { (swept("exports").await >= 1).then_some(()) },
    )
    .await;
    assert!(swept("bundles").await >= 1);
    let (s, list) = gw
        .get(&format!("/v1/sbp/sessions/{id}/exports"), &tok(&t))
        .await;
    assert_eq!(s, 200, "{list}");
    assert_eq!(list["exports"].as_array().map(Vec::len), Some(0), "{list}");
    // The consumed token names nothing any more: it cannot import.
    let (s, v) = import(&gw, json!({"roaming_token": ex["roaming_token"]})).await;
    assert_ne!(s, 201, "{v}");
    // Only the latest snapshot of the session stays.
    sbp_test_support::eventually(
        sbp_test_support::WAIT,
        "old snapshots are swept",
        || async {
            let (_, snaps) = gw
                .get(&format!("/v1/sbp/sessions/{id}/snapshots"), &tok(&t))
                .await;
            (snaps["snapshots"].as_array().map(Vec::len) == Some(1)).then_some(())
        },
    )
    .await;
}
