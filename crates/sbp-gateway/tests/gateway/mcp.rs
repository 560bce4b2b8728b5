//! The MCP bridge over loopback: rmcp's own client drives a session's attached surface through
//! `/v1/sbp/sessions/{id}/mcp` (northbound), the endpoint's session-token authentication, and a
//! real stdio MCP server (the Python fixture of sbp-mcp) whose tools the LLM calls in a turn
//! (southbound).

use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{CallToolRequestParams, CallToolResult, ErrorCode, JsonObject};
use rmcp::service::RunningService;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{RoleClient, ServiceError, ServiceExt};
use sbp_gateway::{GatewayConfig, ServerTools};
use sbp_mcp::Southbound;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::support::{Options, TestGateway, TestGatewayExt, Upstream, Ws};

/// The operator API key of the gateways that require one.
const OPERATOR_KEY: &str = "operator-key-for-mcp-tests";

fn mcp_path(id: &str) -> String {
    format!("/v1/sbp/sessions/{id}/mcp")
}

/// rmcp's streamable-HTTP client on a session's MCP endpoint, authenticated the way MCP clients
/// do it: `Authorization: Bearer <session token>`.
async fn mcp_client(gw: &TestGateway, id: &str, token: &str) -> RunningService<RoleClient, ()> {
    let config =
        StreamableHttpClientTransportConfig::with_uri(format!("{}{}", gw.url, mcp_path(id)))
            .auth_header(token);
    ().serve(StreamableHttpClientTransport::from_config(config))
        .await
        .expect("rmcp client initializes against the gateway")
}

fn call(tool: &str, arguments: Value) -> CallToolRequestParams {
    let arguments: JsonObject = match arguments {
        Value::Object(map) => map,
        other => panic!("arguments must be an object, got {other}"),
    };
    CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments)
}

/// The JSON-RPC error of a call that must fail at the protocol level.
fn rpc_error(result: Result<CallToolResult, ServiceError>) -> rmcp::ErrorData {
    match result {
        Err(ServiceError::McpError(error)) => error,
        other => panic!("expected a JSON-RPC error, got {other:?}"),
    }
}

/// The `data.sbp_error` kind the gateway puts on its JSON-RPC errors.
fn sbp_error(error: &rmcp::ErrorData) -> Option<&str> {
    error.data.as_ref()?.get("sbp_error")?.as_str()
}

/// The text of a result's single text block.
fn only_text(result: &CallToolResult) -> &str {
    assert_eq!(result.content.len(), 1, "{result:?}");
    result.content[0]
        .as_text()
        .map(|t| t.text.as_str())
        .unwrap_or_else(|| panic!("a text block: {result:?}"))
}

/// The next frame, which must be a TOOL_CALL.
async fn expect_tool_call(ws: &mut Ws) -> Value {
    let f = ws.recv().await;
    assert_eq!(f["type"], "TOOL_CALL", "expected a TOOL_CALL, got {f}");
    f
}

fn gps_schema() -> Value {
    json!({
        "type": "object",
        "properties": {"accuracy": {"type": "string", "enum": ["low", "high"]}},
        "required": ["accuracy"]
    })
}

/// Declares `camera` by name only and `gps` with a full schema.
fn phone_context() -> Value {
    json!({
        "device_type": "phone",
        "mcp_tools": ["camera", "gps"],
        "mcp_tool_schemas": [
            {"name": "gps", "description": "The device's position.", "input_schema": gps_schema()}
        ]
    })
}

#[tokio::test]
async fn an_mcp_client_lists_and_calls_the_attached_surfaces_tools() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.idle_session().await;
    let (mut ws, _) = gw
        .attach(&id, &token, json!({"surface_context": phone_context()}))
        .await;
    let client = mcp_client(&gw, &id, &token).await;

    // tools/list: what the surface declared, with its schema or the pass-through one.
    let tools = client.list_all_tools().await.expect("tools/list");
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(names, ["camera", "gps"], "{tools:?}");
    let gps = &tools[1];
    assert_eq!(Value::Object((*gps.input_schema).clone()), gps_schema());
    assert_eq!(gps.description.as_deref(), Some("The device's position."));
    assert_eq!(
        Value::Object((*tools[0].input_schema).clone()),
        json!({"type": "object", "additionalProperties": true})
    );
    // Declared by name only: still described, for the client's user and model.
    let camera = tools[0].description.as_deref().unwrap_or_default();
    assert!(
        camera.contains("`camera`") && camera.contains("attached surface"),
        "{camera}"
    );

    // tools/call: a TOOL_CALL frame to the surface; its TOOL_RESULT is the MCP result.
    let fix = json!({"lat": 35.68, "lon": 139.76});
    let surface = async {
        let frame = expect_tool_call(&mut ws).await;
        ws.send(json!({"type": "TOOL_RESULT", "call_id": frame["call_id"], "result": fix}))
            .await;
        frame
    };
    let (result, frame) = tokio::join!(
        client.call_tool(call("gps", json!({"accuracy": "high"}))),
        surface
    );
    assert_eq!(frame["tool_name"], "gps", "{frame}");
    assert_eq!(frame["tool_input"], json!({"accuracy": "high"}), "{frame}");
    let call_id = frame["call_id"].as_str().expect("call_id");
    assert_eq!(
        Uuid::parse_str(call_id).map(|u| u.get_version_num()),
        Ok(4),
        "{frame}"
    );
    assert!(
        frame["timeout_ms"].as_u64().is_some_and(|t| t > 0),
        "{frame}"
    );
    let result = result.expect("gps answers");
    assert_eq!(result.is_error, Some(false), "{result:?}");
    assert_eq!(result.structured_content, Some(fix.clone()), "{result:?}");
    let text: Value = serde_json::from_str(only_text(&result)).expect("the text is the JSON");
    assert_eq!(text, fix);

    // A surface that answers with an error: a tool-level failure, not a protocol error.
    let surface = async {
        let frame = expect_tool_call(&mut ws).await;
        ws.send(json!({
            "type": "TOOL_RESULT", "call_id": frame["call_id"], "result": null,
            "error": "location permission denied"
        }))
        .await;
    };
    let (result, ()) = tokio::join!(
        client.call_tool(call("gps", json!({"accuracy": "low"}))),
        surface
    );
    let result = result.expect("a tool-level error is a result");
    assert_eq!(result.is_error, Some(true), "{result:?}");
    assert!(
        only_text(&result).contains("location permission denied"),
        "{result:?}"
    );

    // An undeclared tool: a JSON-RPC error, and the surface is not asked.
    let error = rpc_error(
        client
            .call_tool(call("microphone", json!({"seconds": 3})))
            .await,
    );
    assert_eq!(error.code, ErrorCode::INVALID_PARAMS, "{error:?}");
    assert!(error.message.contains("microphone"), "{error:?}");
    assert_eq!(sbp_error(&error), Some("unknown_tool"), "{error:?}");
    assert_eq!(
        error.data.as_ref().and_then(|d| d.get("tool")),
        Some(&json!("microphone")),
        "{error:?}"
    );
    // The socket is ordered: if a TOOL_CALL for the microphone had been sent, it would come first.
    let surface = async {
        let frame = expect_tool_call(&mut ws).await;
        ws.send(json!({"type": "TOOL_RESULT", "call_id": frame["call_id"], "result": "click"}))
            .await;
        frame
    };
    let (result, frame) = tokio::join!(client.call_tool(call("camera", json!({}))), surface);
    assert_eq!(frame["tool_name"], "camera", "{frame}");
    let result = result.expect("camera answers");
    assert_eq!(result.is_error, Some(false), "{result:?}");
    assert_eq!(only_text(&result), "\"click\"", "{result:?}");
    assert_eq!(
        result.structured_content, None,
        "structured content only for objects"
    );

    // The surface goes away: nothing to list, and calls say there is no surface.
    ws.close_code(1000).await;
    gw.wait_view(&id, &token, "the surface detached", |v| {
        v["surface_attached"] == false
    })
    .await;
    let tools = client.list_all_tools().await.expect("tools/list");
    assert!(tools.is_empty(), "{tools:?}");
    // A tool-level error the client's model can read (not a JSON-RPC error that stops it).
    let result = client
        .call_tool(call("gps", json!({"accuracy": "high"})))
        .await
        .expect("no surface is a tool-level error");
    assert_eq!(result.is_error, Some(true), "{result:?}");
    let text = only_text(&result);
    assert!(
        text.contains("no surface is attached") && text.contains("`gps`"),
        "{text}"
    );

    client.cancel().await.expect("client closes");
    gw.stop().await;
}

/// A raw JSON-RPC POST to a session's MCP endpoint with extra headers; returns (status, body).
async fn raw_mcp(
    gw: &TestGateway,
    id: &str,
    method: &str,
    params: Value,
    headers: &[(&str, &str)],
) -> (u16, Value) {
    let mut req = gw
        .http
        .post(format!("{}{}", gw.url, mcp_path(id)))
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let (status, _, body) = crate::support::response(req.send().await.expect("request sent")).await;
    (status, body)
}

fn initialize_params() -> Value {
    json!({
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "raw-test-client", "version": "1"}
    })
}

/// Creates an idle session; with operator keys configured the request carries one.
async fn new_session(gw: &TestGateway, operator: Option<&str>) -> (String, String) {
    let auth = operator.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| ("authorization", a))
        .into_iter()
        .collect();
    let (s, _, v) = gw.post("/v1/sessions", json!({}), &headers).await;
    assert_eq!(s, 201, "{v}");
    (
        v["session_id"].as_str().expect("session id").to_owned(),
        v["session_token"].as_str().expect("token").to_owned(),
    )
}

#[tokio::test]
async fn the_mcp_endpoint_takes_the_session_token_with_or_without_operator_keys() {
    for api_keys in [vec![], vec![OPERATOR_KEY.to_owned()]] {
        let operator = api_keys.first().map(String::as_str);
        let gw = TestGateway::with(Options {
            config: GatewayConfig {
                api_keys: api_keys.clone(),
                ..Options::default().config
            },
            ..Options::default()
        })
        .await;
        let (id, token) = new_session(&gw, operator).await;
        let (_, other_token) = new_session(&gw, operator).await;
        let (_ws, _) = gw
            .attach(
                &id,
                &token,
                json!({"surface_context": {"mcp_tools": ["camera"]}}),
            )
            .await;
        let case = format!("api_keys = {api_keys:?}");

        let (s, v) = raw_mcp(&gw, &id, "initialize", initialize_params(), &[]).await;
        assert_eq!(s, 401, "no token ({case}): {v}");
        assert_eq!(v["error"]["code"], "SBP_UNAUTHORIZED", "{case}: {v}");
        // The 401 says how to authenticate, in its challenge and its message.
        let resp = gw
            .http
            .post(format!("{}{}", gw.url, mcp_path(&id)))
            .header("accept", "application/json, text/event-stream")
            .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
            .send()
            .await
            .expect("request sent");
        assert_eq!(resp.status(), 401, "{case}");
        let challenge = resp
            .headers()
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        assert!(challenge.starts_with("Bearer"), "{case}: {challenge:?}");
        let v: Value = resp.json().await.expect("the envelope");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("Authorization: Bearer <session token>"),
            "{case}: {v}"
        );

        let bearer_other = format!("Bearer {other_token}");
        for header in [
            ("authorization", bearer_other.as_str()),
            ("x-session-token", other_token.as_str()),
        ] {
            let (s, v) = raw_mcp(&gw, &id, "initialize", initialize_params(), &[header]).await;
            assert_eq!(
                s, 403,
                "another session's token in {} ({case}): {v}",
                header.0
            );
            assert_eq!(v["error"]["code"], "SBP_FORBIDDEN", "{case}: {v}");
        }

        // The session's own token alone, in either header, is enough: no operator key needed.
        let bearer = format!("Bearer {token}");
        for header in [
            ("authorization", bearer.as_str()),
            ("x-session-token", token.as_str()),
        ] {
            let (s, v) = raw_mcp(&gw, &id, "initialize", initialize_params(), &[header]).await;
            assert_eq!(s, 200, "initialize with {} ({case}): {v}", header.0);
            assert_eq!(v["result"]["serverInfo"]["name"], "sbp-gateway", "{v}");
            let (s, v) = raw_mcp(&gw, &id, "tools/list", json!({}), &[header]).await;
            assert_eq!(s, 200, "tools/list with {} ({case}): {v}", header.0);
            assert_eq!(v["result"]["tools"][0]["name"], "camera", "{case}: {v}");
        }
        let client = mcp_client(&gw, &id, &token).await;
        let tools = client.list_all_tools().await.expect("tools/list");
        assert_eq!(tools.len(), 1, "{case}: {tools:?}");
        client.cancel().await.expect("client closes");

        // Other session endpoints still need the operator key when one is configured.
        let (s, v) = gw
            .get(
                &format!("/v1/sessions/{id}"),
                &[("x-session-token", &token)],
            )
            .await;
        let expected = if operator.is_some() { 401 } else { 200 };
        assert_eq!(s, expected, "GET session with the token only ({case}): {v}");

        gw.stop().await;
    }
}

/// `name=stdio:python3 '<sbp-mcp's fixture server>'`.
fn calc_server() -> sbp_mcp::ServerConfig {
    let fixture = format!(
        "{}/../sbp-mcp/tests/fixtures/stdio_server.py",
        env!("CARGO_MANIFEST_DIR")
    );
    format!("calc=stdio:python3 '{fixture}'")
        .parse()
        .expect("server config line parses")
}

fn reply_text(body: &Value) -> &str {
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("a text reply: {body}"))
}

/// The function declaration named `name` among an upstream request's `tools`.
fn offered<'a>(request: &'a Value, name: &str) -> Option<&'a Value> {
    request["tools"]
        .as_array()?
        .iter()
        .find(|t| t["function"]["name"] == name)
}

async fn metric(gw: &TestGateway, name: &str) -> Option<String> {
    let (s, body) = gw.get("/metrics", &[]).await;
    assert_eq!(s, 200, "{body}");
    let text = body.as_str().expect("metrics are text").to_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")).map(str::to_owned))
}

#[tokio::test]
async fn a_southbound_stdio_servers_tool_is_called_in_a_turn() {
    let south = Arc::new(Southbound::connect(vec![calc_server()], Duration::from_secs(10)).await);
    assert_eq!(
        south.servers(),
        ["calc"],
        "the Python fixture server did not connect: python3 must be on PATH for these tests"
    );
    let gw = TestGateway::with(Options {
        upstream: Upstream::Fake,
        server_tools: Some(south.clone() as Arc<dyn ServerTools>),
        ..Options::default()
    })
    .await;

    let (s, headers, body) = gw
        .chat(
            json!({"model": "gpt-4o", "messages": [
                {"role": "user", "content": r#"add them [[fake:tool=mcp__calc__add:{"a":2,"b":3}]]"#}
            ]}),
            &[],
        )
        .await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(reply_text(&body), "tool result: 5", "{body}");
    let id = body["sbp"]["session_id"].as_str().expect("session id");
    let token = headers["x-session-token"].to_str().expect("token");

    // Upstream: the first request offers the server's tools, the second carries the round.
    let sent = gw.fake().requests();
    assert_eq!(sent.len(), 2, "{sent:?}");
    let add = offered(&sent[0], "mcp__calc__add").expect("mcp__calc__add offered");
    assert_eq!(add["type"], "function", "{add}");
    assert_eq!(
        add["function"]["parameters"],
        json!({
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"]
        }),
        "{add}"
    );
    assert_eq!(add["function"]["description"], "Add two numbers.", "{add}");
    for other in ["mcp__calc__shout", "mcp__calc__fail"] {
        assert!(offered(&sent[0], other).is_some(), "{other} offered");
    }
    let round = sent[1]["messages"].as_array().expect("messages");
    let last = round.last().expect("a tool message");
    assert_eq!(last["role"], "tool", "{last}");
    assert_eq!(last["content"], "5", "{last}");

    // The transcript keeps the round.
    let (s, v) = gw
        .get(
            &format!("/v1/sessions/{id}/messages?limit=1000"),
            &[("x-session-token", token)],
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let stored = v["messages"].as_array().expect("messages");
    let asked = stored
        .iter()
        .find(|m| m["role"] == "assistant" && m["tool_calls"].is_array())
        .unwrap_or_else(|| panic!("an assistant tool_calls message: {stored:?}"));
    let llm_call = &asked["tool_calls"][0];
    assert_eq!(llm_call["function"]["name"], "mcp__calc__add", "{asked}");
    let args: Value = serde_json::from_str(
        llm_call["function"]["arguments"]
            .as_str()
            .expect("arguments are a JSON string"),
    )
    .expect("arguments parse");
    assert_eq!(args, json!({"a": 2, "b": 3}));
    let tool = stored
        .iter()
        .find(|m| m["role"] == "tool")
        .unwrap_or_else(|| panic!("a tool message: {stored:?}"));
    assert_eq!(tool["tool_call_id"], llm_call["id"], "{tool}");
    assert_eq!(tool["content"], "5", "{tool}");
    assert_eq!(
        metric(&gw, "sbp_server_tool_calls_total").await.as_deref(),
        Some("1")
    );

    // A tool that fails: the LLM gets the error, and the turn still completes.
    let (s, _, body) = gw
        .chat(
            json!({"model": "gpt-4o", "messages": [
                {"role": "user", "content": "now fail [[fake:tool=mcp__calc__fail:{}]]"}
            ]}),
            &[("x-session-token", token)],
        )
        .await;
    assert_eq!(s, 200, "{body}");
    let sent = gw.fake().requests();
    let tool_message = sent
        .last()
        .and_then(|r| r["messages"].as_array())
        .and_then(|m| m.last())
        .expect("the last upstream request ends with the tool message");
    assert_eq!(tool_message["role"], "tool", "{tool_message}");
    let content: Value = serde_json::from_str(
        tool_message["content"]
            .as_str()
            .expect("tool content is text"),
    )
    .expect("the failure is JSON");
    assert_eq!(
        content,
        json!({"error": "the fail tool always fails"}),
        "{tool_message}"
    );
    assert_eq!(
        reply_text(&body),
        format!(
            "tool result: {}",
            tool_message["content"].as_str().unwrap_or_default()
        ),
        "{body}"
    );
    assert_eq!(
        metric(&gw, "sbp_server_tool_calls_total").await.as_deref(),
        Some("2")
    );

    gw.stop().await;
    south.shutdown().await;
}
