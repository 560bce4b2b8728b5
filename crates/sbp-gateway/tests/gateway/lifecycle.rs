//! L2 lifecycle over HTTP: status changes, HTTP 202 resume (SPEC 6.3), force_new_session, snapshots.

use sbp_gateway::GatewayConfig;
use serde_json::{Value, json};

use crate::support::{Options, TestGateway, TestGatewayExt};

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn insecure() -> Options {
    Options {
        config: GatewayConfig {
            insecure_no_session_auth: true,
            secret: vec![3; 32],
            ..GatewayConfig::default()
        },
        ..Options::default()
    }
}

#[tokio::test]
async fn suspended_session_answers_202_then_resumes_on_request() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let auth = [("x-session-token", token.as_str())];
    let (s, b) = gw
        .patch(
            &format!("/v1/sbp/sessions/{id}/status"),
            json!({"status": "suspended"}),
            &auth,
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        (b["status"].as_str(), b["previous_status"].as_str()),
        (Some("suspended"), Some("running"))
    );
    let (s, _, b) = gw
        .chat(
            json!({"model": "gpt-4o", "messages": [user("continue")]}),
            &auth,
        )
        .await;
    assert_eq!(s, 202, "{b}");
    let sbp = &b["sbp"];
    assert_eq!(sbp["resume_available"], true);
    assert_eq!(sbp["session_id"], id.as_str());
    assert_eq!(sbp["step_count"], 1);
    assert!(
        sbp["resume_prompt"]
            .as_str()
            .is_some_and(|p| p.contains("Hello")),
        "{sbp}"
    );
    assert!(
        sbp["snapshot_id"].is_string() && sbp["last_checkpoint"].is_string(),
        "{sbp}"
    );
    assert!(b.get("choices").is_none());
    // Nothing of the 202 request was stored.
    assert_eq!(gw.session_view(&id, &token).await["message_count"], 2);
    // Resending with the session id resumes it.
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("continue")], "sbp": {"session_id": id}}),
            &auth,
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["sbp"]["session_id"], id.as_str());
    assert_eq!(b["sbp"]["step_count"], 2);
    assert_eq!(gw.session_view(&id, &token).await["status"], "running");
}

#[tokio::test]
async fn resume_flag_also_resumes() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let auth = [("x-session-token", token.as_str())];
    gw.patch(
        &format!("/v1/sbp/sessions/{id}/status"),
        json!({"status": "suspended"}),
        &auth,
    )
    .await;
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("go on")], "sbp": {"resume": true}}),
            &auth,
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["sbp"]["session_id"], id.as_str());
}

#[tokio::test]
async fn force_new_session_always_starts_a_new_session_for_the_same_agent() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let auth = [("x-session-token", token.as_str())];
    let (s, h, b) = gw
        .chat(
            json!({"messages": [user("New task")], "sbp": {"force_new_session": true}}),
            &auth,
        )
        .await;
    assert_eq!(s, 200);
    assert_ne!(b["sbp"]["session_id"], id.as_str());
    assert_ne!(h["x-session-token"].to_str().ok(), Some(token.as_str()));
    assert_eq!(
        b["sbp"]["agent_id"],
        gw.session_view(&id, &token).await["agent_id"]
    );
    // Also while suspended: no 202.
    gw.patch(
        &format!("/v1/sbp/sessions/{id}/status"),
        json!({"status": "suspended"}),
        &auth,
    )
    .await;
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("x")], "sbp": {"force_new_session": true}}),
            &auth,
        )
        .await;
    assert_eq!(s, 200);
    assert_ne!(b["sbp"]["session_id"], id.as_str());
}

#[tokio::test]
async fn an_agent_with_a_suspended_session_gets_202_when_the_caller_is_trusted() {
    let gw = TestGateway::with(insecure()).await;
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("plan the Tokyo trip")]}),
            &[("x-agent-id", "travel-agent")],
        )
        .await;
    assert_eq!(s, 200);
    let id = b["sbp"]["session_id"].as_str().expect("id").to_owned();
    // The conformance suite suspends without a token (insecure mode).
    let (s, _) = gw
        .patch(
            &format!("/v1/sbp/sessions/{id}/status"),
            json!({"status": "suspended"}),
            &[],
        )
        .await;
    assert_eq!(s, 200);
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("what now?")]}),
            &[("x-agent-id", "travel-agent")],
        )
        .await;
    assert_eq!(s, 202, "{b}");
    assert_eq!(b["sbp"]["session_id"], id.as_str());
    assert!(
        b["sbp"]["resume_prompt"]
            .as_str()
            .is_some_and(|p| p.contains("Tokyo"))
    );
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("what now?")], "sbp": {"session_id": id}}),
            &[("x-agent-id", "travel-agent")],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["sbp"]["session_id"], id.as_str());
    // Another agent is not affected.
    let (s, _, _) = gw
        .chat(
            json!({"messages": [user("hi")]}),
            &[("x-agent-id", "someone-else")],
        )
        .await;
    assert_eq!(s, 200);
}

#[tokio::test]
async fn without_trust_an_agent_name_reveals_nothing() {
    let gw = TestGateway::start().await;
    let (s, h, b) = gw
        .chat(
            json!({"messages": [user("secret plans")]}),
            &[("x-agent-id", "a1")],
        )
        .await;
    assert_eq!(s, 200);
    let id = b["sbp"]["session_id"].as_str().expect("id").to_owned();
    let token = h["x-session-token"].to_str().expect("token").to_owned();
    gw.patch(
        &format!("/v1/sbp/sessions/{id}/status"),
        json!({"status": "suspended"}),
        &[("x-session-token", &token)],
    )
    .await;
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("hello")]}),
            &[("x-agent-id", "a1")],
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_ne!(b["sbp"]["session_id"], id.as_str());
    let (s, _, b) = gw
        .chat(
            json!({"messages": [user("hello")], "sbp": {"session_id": id}}),
            &[("x-agent-id", "a1")],
        )
        .await;
    assert_eq!(s, 401, "{b}");
}

#[tokio::test]
async fn status_changes_follow_the_lifecycle() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.session().await;
    let auth = [("x-session-token", token.as_str())];
    let path = format!("/v1/sbp/sessions/{id}/status");
    let (s, b) = gw.patch(&path, json!({"status": "paused"}), &auth).await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (400, Some("SBP_BAD_REQUEST"))
    );
    let (s, b) = gw.patch(&path, json!({"status": "completed"}), &[]).await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (401, Some("SBP_UNAUTHORIZED"))
    );
    let (s, b) = gw.patch(&path, json!({"status": "completed"}), &auth).await;
    assert_eq!((s, b["status"].as_str()), (200, Some("completed")));
    let (s, b) = gw.patch(&path, json!({"status": "running"}), &auth).await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (409, Some("SBP_SESSION_CONFLICT"))
    );
    let (s, _, b) = gw.chat(json!({"messages": [user("more")]}), &auth).await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (409, Some("SBP_SESSION_CONFLICT")),
        "{b}"
    );
    let (s, b) = gw.patch(&path, json!({"status": "completed"}), &auth).await;
    assert_eq!(s, 200, "same state is idempotent: {b}");
    // Pushing into a completed session is a conflict too.
    let (s, _, b) = gw
        .post(
            &format!("/v1/sbp/sessions/{id}/turns"),
            json!({"content": "late"}),
            &auth,
        )
        .await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (409, Some("SBP_SESSION_CONFLICT"))
    );
    let (s, b) = gw
        .patch(
            &format!("/v1/sbp/sessions/{}/status", uuid::Uuid::new_v4()),
            json!({"status": "failed"}),
            &auth,
        )
        .await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (404, Some("SBP_SESSION_NOT_FOUND"))
    );
}

#[tokio::test]
async fn snapshots_are_taken_around_each_turn_and_every_n_turns() {
    let gw = TestGateway::start().await;
    let (s, h, b) = gw
        .chat(
            json!({"messages": [user("one")], "sbp": {"checkpoint_every": 2}}),
            &[],
        )
        .await;
    assert_eq!(s, 200);
    let id = b["sbp"]["session_id"].as_str().expect("id").to_owned();
    let token = h["x-session-token"].to_str().expect("token").to_owned();
    let auth = [("x-session-token", token.as_str())];
    for t in ["two", "three", "four"] {
        let (s, _, _) = gw
            .chat(
                json!({"messages": [user(t)], "sbp": {"checkpoint_every": 2}}),
                &auth,
            )
            .await;
        assert_eq!(s, 200);
    }
    let (s, list) = gw
        .get(&format!("/v1/sbp/sessions/{id}/snapshots"), &auth)
        .await;
    assert_eq!(s, 200);
    let kinds: Vec<&str> = list["snapshots"]
        .as_array()
        .expect("list")
        .iter()
        .map(|x| x["kind"].as_str().unwrap_or(""))
        .collect();
    let count = |k: &str| kinds.iter().filter(|x| **x == k).count();
    assert_eq!(
        (
            count("pre_action"),
            count("post_action"),
            count("checkpoint")
        ),
        (4, 4, 2),
        "{kinds:?}"
    );
    let (s, latest) = gw
        .get(&format!("/v1/sbp/sessions/{id}/snapshots/latest"), &auth)
        .await;
    assert_eq!(s, 200);
    assert_eq!(latest["step_count"], 4);
    assert_eq!(latest["messages"].as_array().map(Vec::len), Some(8));
    assert_eq!(latest["messages"][7]["content"], "Echo: four");
    assert_eq!(latest["current_task"], "four");
    // The 200 response names the post_action snapshot of its turn.
    let view = gw.session_view(&id, &token).await;
    assert!(view["latest_snapshot_id"].is_string());
}
