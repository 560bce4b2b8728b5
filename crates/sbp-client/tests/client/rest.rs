//! The REST helpers against the real gateway: sessions, completions (200 and 202), transcript,
//! export -> inspect -> import (single use), fork, handoff, lineage, and operator API keys.

use sbp_client::types::{
    ChatOutcome, ChatRequest, ExportRequest, HandoffRequest, ImportRequest, MemoryPut, NewSession,
};
use sbp_client::{Client, Error, Surface};
use sbp_gateway::GatewayConfig;
use sbp_protocol::SessionStatus;
use serde_json::json;

use crate::support::{Options, TestGateway, TestGatewayExt, config, wait_session};

#[tokio::test]
async fn sessions_messages_and_the_resume_flow() {
    let gw = TestGateway::start().await;
    let client = gw.client();
    let session = client
        .create_session(NewSession {
            agent_id: Some("travel-agent".into()),
            metadata: Some(json!({"user": "ana"})),
        })
        .await
        .expect("created");
    let info = session.get().await.expect("view");
    assert_eq!(
        (info.status, info.agent_id.as_deref(), info.message_count),
        (SessionStatus::Idle, Some("travel-agent"), 0)
    );

    let reply = session
        .send_message("Plan a trip to Tokyo")
        .await
        .expect("reply");
    assert!(
        reply.text.contains("Plan a trip to Tokyo"),
        "{}",
        reply.text
    );
    assert_eq!(reply.meta.session_id, session.id());
    assert_eq!(reply.meta.step_count, 1);
    assert_eq!(reply.finish_reason.as_deref(), Some("stop"));

    // A surface that detaches suspends the session: a plain completion gets 202, a resume goes on.
    let mut surface = Surface::connect(session.surface()).await.expect("attached");
    surface.close().await;
    wait_session(&session, "the detach", |s| {
        s.status == SessionStatus::Suspended
    })
    .await;
    match session
        .chat(ChatRequest::user("Day 2?"))
        .await
        .expect("chat")
    {
        ChatOutcome::ResumeAvailable(meta) => {
            assert!(
                meta.resume_available && meta.resume_prompt.is_some(),
                "{meta:?}"
            );
        }
        other => panic!("expected 202, got {other:?}"),
    }
    let reply = session.send_message("Day 2?").await.expect("resumed");
    assert_eq!(reply.meta.step_count, 2);

    let page = session.messages(None, Some(3)).await.expect("page");
    assert!(page.has_more);
    let roles: Vec<_> = page.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["user", "assistant", "user"]);
    assert_eq!(page.messages[0].text(), Some("Plan a trip to Tokyo"));
    let rest = session
        .messages(page.next_after, None)
        .await
        .expect("next page");
    assert_eq!(rest.messages.len(), 1);
    assert!(!rest.has_more);

    // A chat without a token creates its session.
    let (other, first) = client
        .start_chat(ChatRequest::user("hello"))
        .await
        .expect("new chat");
    assert_ne!(other.id(), session.id());
    assert_eq!(first.meta.session_id, other.id());
    assert_eq!(other.get().await.expect("view").step_count, 1);

    // Another session's token is refused, in the gateway's error envelope.
    let err = client
        .session(session.id(), other.token())
        .get()
        .await
        .expect_err("wrong token");
    assert_eq!(
        (err.status(), err.code()),
        (Some(403), Some("SBP_FORBIDDEN"))
    );
}

#[tokio::test]
async fn export_import_fork_handoff_and_lineage() {
    let gw = TestGateway::start().await;
    let client = gw.client();
    let session = gw.session().await;
    session
        .send_message("remember the plan")
        .await
        .expect("reply");

    let export = session
        .export(ExportRequest {
            ttl_seconds: Some(3600),
            label: Some("to mobile".into()),
            include_bundle: false,
        })
        .await
        .expect("export");
    assert_eq!(export.bundle_cid.len(), 64, "{export:?}");
    assert_eq!(export.label.as_deref(), Some("to mobile"));

    let info = client
        .inspect_token(&export.roaming_token)
        .await
        .expect("inspect");
    assert_eq!(
        (
            info.export_id.as_str(),
            info.session_id.as_str(),
            info.consumed
        ),
        (export.export_id.as_str(), session.id(), false)
    );

    let imported = client
        .import(ImportRequest::token(&export.roaming_token))
        .await
        .expect("import");
    assert_ne!(imported.session.id(), session.id());
    assert_eq!(imported.info.messages_restored, 2);
    assert_eq!(
        imported.info.source_session_id.as_deref(),
        Some(session.id())
    );
    // The imported session works with the token it came with.
    let copy = imported
        .session
        .messages(None, None)
        .await
        .expect("messages");
    assert_eq!(copy.messages[0].text(), Some("remember the plan"));
    let again = client
        .import(ImportRequest::token(&export.roaming_token))
        .await
        .expect_err("single use");
    assert_eq!(
        (again.status(), again.code()),
        (Some(410), Some("SBP_TOKEN_CONSUMED"))
    );
    assert!(
        client
            .inspect_token(&export.roaming_token)
            .await
            .expect("inspect")
            .consumed
    );

    let fork = session.fork(Some("plan B")).await.expect("fork");
    assert_eq!(fork.info.label.as_deref(), Some("plan B"));
    assert_eq!(fork.info.origin_session_id.as_deref(), Some(session.id()));
    let forked = fork
        .session
        .messages(None, None)
        .await
        .expect("fork messages");
    assert_eq!(forked.messages.len(), 2);
    // Independent: a turn in the fork does not reach the origin.
    fork.session
        .send_message("only in the fork")
        .await
        .expect("reply");
    assert_eq!(session.get().await.expect("view").message_count, 2);

    let lineage = session.lineage().await.expect("lineage");
    assert_eq!(lineage.exports.len(), 1);
    assert!(lineage.exports[0].consumed);
    assert_eq!(
        lineage
            .forks
            .iter()
            .map(|f| (f.fork_session_id.as_str(), f.via.as_deref()))
            .collect::<Vec<_>>(),
        [(fork.session.id(), Some("fork"))]
    );

    let handoff = session
        .handoff(HandoffRequest {
            to_agent_id: "booking-agent".into(),
            handoff_message: Some("Please book the flights.".into()),
            reason: None,
        })
        .await
        .expect("handoff");
    assert_eq!(handoff.info.to_agent_id.as_deref(), Some("booking-agent"));
    assert_eq!(handoff.info.source_status, Some(SessionStatus::Suspended));
    let bridged = handoff
        .session
        .messages(None, None)
        .await
        .expect("messages");
    assert_eq!(bridged.messages[0].role, "system");
    assert!(
        bridged.messages[0]
            .text()
            .is_some_and(|t| t.contains("Please book the flights.")),
        "{:?}",
        bridged.messages[0]
    );
    assert_eq!(
        session
            .lineage()
            .await
            .expect("lineage")
            .outgoing_handoffs
            .len(),
        1
    );
    assert_eq!(
        handoff
            .session
            .get()
            .await
            .expect("view")
            .agent_id
            .as_deref(),
        Some("booking-agent")
    );
}

#[tokio::test]
async fn status_snapshots_exports_and_memory() {
    let gw = TestGateway::start().await;
    let client = gw.client();
    assert_eq!(client.health().await.expect("health").status, "ok");
    let session = gw.session().await;
    session.send_message("checkpoint me").await.expect("reply");

    let snapshots = session.snapshots().await.expect("snapshots");
    assert_eq!(snapshots.session_id, session.id());
    assert!(!snapshots.snapshots.is_empty());
    let latest = session.latest_snapshot().await.expect("latest");
    assert_eq!(
        latest.snapshot.snapshot_id,
        snapshots.snapshots[0].snapshot_id
    );
    assert_eq!(latest.messages.len() as u64, latest.snapshot.message_count);

    let memory = session
        .put_memory(MemoryPut {
            schema_id: None,
            payload: json!({"seat": "window"}),
        })
        .await
        .expect("put memory");
    assert_eq!(memory.payload, json!({"seat": "window"}));
    assert_eq!(
        session.memory().await.expect("memory").payload,
        memory.payload
    );

    let export = session
        .export(ExportRequest::default())
        .await
        .expect("export");
    assert_eq!(export.token.as_deref(), Some(export.roaming_token.as_str()));
    client
        .import(ImportRequest::token(&export.roaming_token))
        .await
        .expect("import");
    let exports = session.exports().await.expect("exports");
    assert_eq!(exports.exports.len(), 1);
    assert_eq!(
        exports.exports[0].imports.as_ref().map(Vec::len),
        Some(1),
        "{exports:?}"
    );

    let changed = session
        .set_status(SessionStatus::Completed)
        .await
        .expect("status");
    assert_eq!(changed.status, SessionStatus::Completed);
    assert!(changed.previous_status.is_some(), "{changed:?}");
    let err = session
        .set_status(SessionStatus::Running)
        .await
        .expect_err("completed is final");
    assert_eq!(err.status(), Some(409));
}

#[tokio::test]
async fn operator_api_keys_are_sent_as_bearer() {
    let gw = TestGateway::with(Options {
        config: GatewayConfig {
            api_keys: vec!["op-key-1".into()],
            ..config()
        },
        ..Options::default()
    })
    .await;
    let anonymous = gw.client();
    let err = anonymous
        .create_session(NewSession::default())
        .await
        .expect_err("needs the key");
    assert_eq!(
        (err.status(), err.code()),
        (Some(401), Some("SBP_UNAUTHORIZED"))
    );
    assert!(matches!(err, Error::Api { .. }));

    let operator = Client::builder(&gw.url)
        .no_proxy()
        .api_key("op-key-1")
        .build()
        .expect("client");
    let session = operator
        .create_session(NewSession::default())
        .await
        .expect("created with the key");
    session.send_message("hi").await.expect("reply");
    // The WebSocket authenticates with the session token alone.
    let mut surface = Surface::connect(session.surface()).await.expect("attached");
    surface.close().await;
}
