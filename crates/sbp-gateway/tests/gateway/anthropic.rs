//! L5 through the Anthropic adapter: a model routed to the Messages API gets the surface's tools in
//! Anthropic's format (`tools[].input_schema`), asks for one with a `tool_use` block, the surface
//! answers the TOOL_CALL, and the result goes back as a `tool_result` block.

use std::sync::Arc;
use std::time::Duration;

use sbp_llm::{
    AnthropicOptions, AnthropicProvider, ModelMatch, OpenAiOptions, OpenAiProvider, Provider,
    Router,
};
use serde_json::{Value, json};

use crate::support::{Options, TestGateway, TestGatewayExt, Upstream};

/// OpenAI-compatible by default; `claude*` models to the fake's Anthropic endpoint.
fn router(base_url: String) -> Arc<dyn Provider> {
    let timeout = Duration::from_secs(10);
    let openai = OpenAiProvider::new(OpenAiOptions {
        base_url: base_url.clone(),
        api_key: Some("upstream-key".into()),
        connect_timeout: timeout,
        request_timeout: timeout,
        stream_idle_timeout: timeout,
    })
    .expect("openai provider");
    let anthropic = AnthropicProvider::new(AnthropicOptions {
        base_url,
        api_key: Some("anthropic-key".into()),
        ..AnthropicOptions::default()
    })
    .expect("anthropic provider");
    Arc::new(
        Router::new(Arc::new(openai)).with_route(ModelMatch::prefix("claude"), Arc::new(anthropic)),
    )
}

#[tokio::test]
async fn surface_tool_round_trip_through_the_anthropic_adapter() {
    let gw = TestGateway::with(Options {
        upstream: Upstream::FakeWith(router),
        ..Options::default()
    })
    .await;
    let (id, token) = gw.session().await;
    let (mut ws, attached) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"device_type": "mobile", "mcp_tools": ["gps"],
                   "mcp_tool_schemas": [{"name": "gps", "description": "Where the phone is",
                       "input_schema": {"type": "object", "properties": {"acc": {"type": "string"}}}}]}}),
        )
        .await;
    assert_eq!(attached["mcp_tools_registered"], json!(["gps"]));
    gw.fake().clear();

    let reply = gw.spawn_post(
        "/v1/chat/completions",
        json!({"model": "claude-test-1", "messages": [
            {"role": "user", "content": "where am I? [[fake:tool=surface_gps:{\"acc\":\"high\"}]]"}]}),
        &[("x-session-token", &token)],
    );
    let call = ws.recv().await;
    assert_eq!(call["type"], "TOOL_CALL", "{call}");
    assert_eq!(call["tool_name"], "gps");
    assert_eq!(call["tool_input"], json!({"acc": "high"}));
    ws.send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": {"lat": 35.68}}))
        .await;
    let (status, _, body) = reply.await.expect("reply task");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "tool result: {\"lat\":35.68}"
    );
    let (text, _) = ws.live_turn().await;
    assert_eq!(text, "tool result: {\"lat\":35.68}");

    // What the Anthropic endpoint received: two Messages API requests.
    let requests = gw.fake().requests();
    assert_eq!(requests.len(), 2, "{requests:?}");
    let first = &requests[0];
    let tool = first["tools"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["name"] == "surface_gps"))
        .unwrap_or_else(|| panic!("surface_gps offered in Anthropic form: {first}"));
    assert_eq!(
        tool["input_schema"],
        json!({"type": "object", "properties": {"acc": {"type": "string"}}})
    );
    assert!(
        tool.get("function").is_none(),
        "not the OpenAI shape: {tool}"
    );
    assert!(
        first["max_tokens"].is_u64(),
        "Anthropic requires max_tokens: {first}"
    );

    let second = &requests[1];
    let messages = second["messages"].as_array().expect("messages");
    let tool_use = messages
        .iter()
        .filter(|m| m["role"] == "assistant")
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .find(|b| b["type"] == "tool_use")
        .unwrap_or_else(|| panic!("assistant tool_use block: {second}"));
    assert_eq!(tool_use["name"], "surface_gps");
    assert_eq!(tool_use["input"], json!({"acc": "high"}));
    let tool_result = messages
        .iter()
        .filter(|m| m["role"] == "user")
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .find(|b| b["type"] == "tool_result")
        .unwrap_or_else(|| panic!("user tool_result block: {second}"));
    assert_eq!(tool_result["tool_use_id"], tool_use["id"]);
    let content = match &tool_result["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
        other => panic!("tool_result content {other}"),
    };
    assert_eq!(content, "{\"lat\":35.68}");

    // The transcript is stored in the OpenAI shape whatever the provider.
    let (_, history) = gw
        .get(
            &format!("/v1/sessions/{id}/messages"),
            &[("x-session-token", &token)],
        )
        .await;
    let roles: Vec<&str> = history["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|m| m["role"].as_str())
        .collect();
    assert_eq!(
        roles[roles.len() - 4..],
        ["user", "assistant", "tool", "assistant"]
    );
}

/// Once the device with the tools is gone, a later turn routed to Anthropic still works: the
/// history's tool blocks need tool definitions, which the adapter supplies.
#[tokio::test]
async fn a_later_turn_without_the_surface_still_works_on_anthropic() {
    let gw = TestGateway::with(Options {
        upstream: Upstream::FakeWith(router),
        ..Options::default()
    })
    .await;
    let (id, token) = gw.session().await;
    let (mut ws, _) = gw
        .attach(
            &id,
            &token,
            json!({"surface_context": {"mcp_tools": ["gps"]}}),
        )
        .await;
    let reply = gw.spawn_post(
        "/v1/chat/completions",
        json!({"model": "claude-test-1", "messages": [
            {"role": "user", "content": "where? [[fake:tool=surface_gps]]"}]}),
        &[("x-session-token", &token)],
    );
    let call = ws.recv().await;
    ws.send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": {"lat": 1}}))
        .await;
    let (status, _, body) = reply.await.expect("reply");
    assert_eq!(status, 200, "{body}");
    ws.close_abruptly().await;
    gw.wait_suspended(&id, &token).await;

    let (status, _, body) = gw
        .chat(
            json!({"model": "claude-test-1", "sbp": {"resume": true},
                   "messages": [{"role": "user", "content": "thanks"}]}),
            &[("x-session-token", &token)],
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "echo: thanks");
    let last = gw.fake().requests().pop().expect("request");
    assert_eq!(last["tool_choice"], json!({"type": "none"}), "{last}");
}
