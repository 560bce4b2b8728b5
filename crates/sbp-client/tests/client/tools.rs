//! TOOL_CALLs answered by the SDK's handler: from the backend tool_calls endpoint and from an LLM
//! tool call through the gateway's agent loop (the fake upstream scripts the call).

use std::sync::Arc;

use sbp_client::types::{PushTurn, ToolCallRequest, ToolCallStatus};
use sbp_client::{Event, Surface, ToolSpec, Tools};
use sbp_protocol::frames::ToolCall;
use sbp_protocol::{ServerFrame, SurfaceContext};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};

use crate::support::{TestGateway, TestGatewayExt, WAIT, next};

fn gps_schema() -> Value {
    json!({"type": "object", "properties": {"acc": {"type": "string", "enum": ["low", "high"]}}})
}

/// A gps tool that reports each input it gets on `seen`.
fn gps(seen: mpsc::UnboundedSender<Value>) -> Tools {
    Tools::new().tool(
        ToolSpec::new("gps")
            .description("The device's position")
            .input_schema(gps_schema()),
        move |input| {
            let _ = seen.send(input.clone());
            async move { Ok(json!({"lat": 35.68, "lon": 139.76, "acc": input["acc"]})) }
        },
    )
}

/// Events until a live turn completes, collecting the TOOL_CALLs seen on the way.
async fn turn_with_calls(surface: &mut Surface) -> (Vec<ToolCall>, String) {
    let mut calls = Vec::new();
    let mut text = String::new();
    loop {
        match next(surface).await {
            Event::Frame(ServerFrame::ToolCall(c)) => calls.push(c),
            Event::Frame(ServerFrame::TurnChunk(c)) => text.push_str(&c.delta),
            Event::Frame(ServerFrame::TurnComplete(_)) => return (calls, text),
            other => panic!("unexpected event in a turn: {other:?}"),
        }
    }
}

#[tokio::test]
async fn backend_tool_calls_are_answered_concurrently_by_the_handler() {
    let gw = TestGateway::start().await;
    let session = gw.session().await;
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let (started_tx, mut started) = mpsc::unbounded_channel::<()>();
    let release = Arc::new(Notify::new());
    let gate = release.clone();
    let tools = gps(seen_tx)
        .tool(ToolSpec::new("slow"), move |_| {
            let (started, gate) = (started_tx.clone(), gate.clone());
            async move {
                let _ = started.send(());
                gate.notified().await;
                Ok(json!("finally"))
            }
        })
        .tool(ToolSpec::new("fail"), |_| async {
            Err("no signal".to_owned())
        })
        .tool(ToolSpec::new("boom"), |_| async {
            panic!("a handler bug");
        });
    let mut surface = Surface::connect(session.surface().tools(tools))
        .await
        .expect("attached");
    assert!(matches!(next(&mut surface).await, Event::Connected { .. }));
    assert_eq!(
        surface.attached().mcp_tools_registered,
        ["gps", "slow", "fail", "boom"]
    );
    // The gateway holds the declared schema.
    let declared = session.get().await.expect("view").surface.expect("surface");
    let schema = declared.tool_schema("gps").expect("gps schema");
    assert_eq!(
        (schema.input_schema.clone(), schema.description.as_deref()),
        (gps_schema(), Some("The device's position"))
    );

    // A call that waits until released...
    let slow = tokio::spawn({
        let session = session.clone();
        async move {
            session
                .call_tool(ToolCallRequest::new("slow", json!({})))
                .await
        }
    });
    tokio::time::timeout(WAIT, started.recv())
        .await
        .expect("the slow handler starts")
        .expect("started");
    // ...while others are answered, and the frame stream goes on.
    let ok = session
        .call_tool(ToolCallRequest::new("gps", json!({"acc": "high"})))
        .await
        .expect("gps call");
    assert_eq!(ok.status, ToolCallStatus::Ok, "{ok:?}");
    assert_eq!(
        ok.result,
        json!({"lat": 35.68, "lon": 139.76, "acc": "high"})
    );
    assert_eq!(seen.recv().await, Some(json!({"acc": "high"})));
    let failed = session
        .call_tool(ToolCallRequest::new("fail", json!({})))
        .await
        .expect("fail call");
    assert_eq!(
        (failed.status, failed.error.as_deref()),
        (ToolCallStatus::Error, Some("no signal"))
    );
    let crashed = session
        .call_tool(ToolCallRequest::new("boom", json!({})))
        .await
        .expect("boom call");
    assert_eq!(
        (crashed.status, crashed.error.as_deref()),
        (ToolCallStatus::Error, Some("the tool handler panicked"))
    );
    session
        .push_turn(PushTurn::assistant("meanwhile"))
        .await
        .expect("push");
    let (calls, text) = turn_with_calls(&mut surface).await;
    assert_eq!(text, "meanwhile");
    let names: Vec<_> = calls.iter().map(|c| c.tool_name.as_str()).collect();
    assert_eq!(
        names,
        ["slow", "gps", "fail", "boom"],
        "each call is also an event"
    );

    release.notify_one();
    let slow = slow.await.expect("task").expect("slow call");
    assert_eq!(
        (slow.status, slow.result),
        (ToolCallStatus::Ok, json!("finally"))
    );

    // Undeclared tools never reach the surface: the gateway refuses them.
    let err = session
        .call_tool(ToolCallRequest::new("camera", json!({})))
        .await
        .expect_err("camera is not declared");
    assert_eq!(
        (err.status(), err.code()),
        (Some(409), Some("SBP_SESSION_CONFLICT"))
    );
    surface.close().await;
}

#[tokio::test]
async fn a_tool_declared_without_a_handler_gets_an_error_result() {
    let gw = TestGateway::start().await;
    let session = gw.session().await;
    let ctx = SurfaceContext {
        mcp_tools: vec!["camera".into()],
        ..SurfaceContext::default()
    };
    let mut surface = Surface::connect(session.surface().context(ctx))
        .await
        .expect("attached");
    let out = session
        .call_tool(ToolCallRequest::new("camera", json!({})))
        .await
        .expect("camera call");
    assert_eq!(out.status, ToolCallStatus::Error);
    assert!(
        out.error
            .as_deref()
            .is_some_and(|e| e.contains("no tool handler")),
        "{out:?}"
    );
    surface.close().await;
}

#[tokio::test]
async fn an_llm_tool_call_is_answered_and_the_turn_goes_on() {
    let gw = TestGateway::with_fake().await;
    let session = gw.session().await;
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let mut surface = Surface::connect(session.surface().tools(gps(seen_tx)))
        .await
        .expect("attached");
    assert!(matches!(next(&mut surface).await, Event::Connected { .. }));

    let reply = session
        .send_message(r#"where am I? [[fake:tool=surface_gps:{"acc":"low"}]]"#)
        .await
        .expect("reply");
    let fix = json!({"lat": 35.68, "lon": 139.76, "acc": "low"});
    assert_eq!(reply.text, format!("tool result: {fix}"));
    assert_eq!(seen.recv().await, Some(json!({"acc": "low"})));

    let (calls, streamed) = turn_with_calls(&mut surface).await;
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(
        (calls[0].tool_name.as_str(), &calls[0].tool_input),
        ("gps", &json!({"acc": "low"}))
    );
    assert_eq!(streamed, reply.text);

    // The model was offered the tool with the schema the handler declared.
    let first = gw.fake.as_ref().expect("fake").requests()[0].clone();
    let offered = first["tools"]
        .as_array()
        .expect("tools offered")
        .iter()
        .find(|t| t["function"]["name"] == "surface_gps")
        .cloned()
        .expect("surface_gps offered");
    assert_eq!(offered["function"]["parameters"], gps_schema(), "{offered}");
    surface.close().await;
}
