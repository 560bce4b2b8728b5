//! Streamable HTTP on real loopback sockets: the northbound service driven by rmcp's own client and
//! by our Southbound, and its Host-header policy checked with raw reqwest.

use std::{sync::Arc, time::Duration};

use rmcp::{
    RoleClient, ServiceError, ServiceExt,
    model::{CallToolRequestParams, ErrorCode, JsonObject},
    service::RunningService,
    transport::{
        StreamableHttpClientTransport, streamable_http_client::StreamableHttpClientTransportConfig,
    },
};
use sbp_mcp::{McpError, NorthboundOptions, ServerConfig, ServerTransport, Southbound, ToolSpec};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::support::{GATHER, TOKEN, TestHost, TestServer, init_tracing};

const CALL: Duration = Duration::from_secs(10);

async fn rmcp_client(url: String) -> RunningService<RoleClient, ()> {
    let transport = StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(url).auth_header(TOKEN),
    );
    ().serve(transport).await.expect("rmcp client connects")
}

fn args(value: Value) -> JsonObject {
    match value {
        Value::Object(map) => map,
        other => panic!("arguments must be an object, got {other}"),
    }
}

fn rpc_error(result: Result<rmcp::model::CallToolResult, ServiceError>) -> rmcp::ErrorData {
    match result {
        Err(ServiceError::McpError(error)) => error,
        other => panic!("expected a JSON-RPC error, got {other:?}"),
    }
}

/// List, call, tool-level error, NoSurface and UnknownTool through rmcp's client.
async fn exercise_with_rmcp_client(opts: NorthboundOptions) {
    init_tracing();
    let (host, sessions) = TestHost::new();
    let server = TestServer::start(host, opts).await;

    let client = rmcp_client(server.url(sessions.phone)).await;
    let info = client.peer_info().expect("initialized");
    assert_eq!(
        info.server_info.as_ref().map(|i| i.name.as_str()),
        Some("sbp-gateway")
    );
    assert!(info.capabilities.tools.is_some());

    let tools = client.list_all_tools().await.expect("tools/list");
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(names, ["echo", "add", "camera", "gather"]);
    let camera = tools.iter().find(|t| t.name == "camera").expect("camera");
    assert_eq!(
        Value::Object((*camera.input_schema).clone()),
        ToolSpec::passthrough_schema()
    );
    assert_eq!(camera.description.as_deref(), Some("Take a photo."));
    let echo = tools.iter().find(|t| t.name == "echo").expect("echo");
    assert_eq!(echo.input_schema["required"], json!(["text"]));

    let echoed = client
        .call_tool(CallToolRequestParams::new("echo").with_arguments(args(json!({"text": "hi"}))))
        .await
        .expect("echo");
    assert_eq!(echoed.is_error, Some(false));
    assert_eq!(
        echoed.content[0].as_text().map(|t| t.text.as_str()),
        Some("hi")
    );

    let added = client
        .call_tool(CallToolRequestParams::new("add").with_arguments(args(json!({"a": 2, "b": 3}))))
        .await
        .expect("add");
    assert_eq!(added.structured_content, Some(json!({"sum": 5.0})));

    let denied = client
        .call_tool(CallToolRequestParams::new("camera"))
        .await
        .expect("a tool-level error is a result");
    assert_eq!(denied.is_error, Some(true));

    let unknown = rpc_error(
        client
            .call_tool(CallToolRequestParams::new("teleport"))
            .await,
    );
    assert_eq!(unknown.code, ErrorCode::INVALID_PARAMS);
    assert!(
        unknown.message.contains("unknown tool: teleport"),
        "{unknown:?}"
    );
    assert_eq!(
        unknown.data.as_ref().map(|d| d["sbp_error"].clone()),
        Some(json!("unknown_tool"))
    );
    client.cancel().await.expect("client closes");

    // A session without a surface: nothing to list, and calls say why they cannot run.
    let detached = rmcp_client(server.url(sessions.detached)).await;
    assert!(
        detached
            .list_all_tools()
            .await
            .expect("tools/list")
            .is_empty()
    );
    // A tool-level error, with the host's message as its text.
    let no_surface = detached
        .call_tool(CallToolRequestParams::new("echo"))
        .await
        .expect("a tool-level error is a result");
    assert_eq!(no_surface.is_error, Some(true), "{no_surface:?}");
    let text = no_surface.content[0].as_text().map(|t| t.text.as_str());
    assert_eq!(text, Some("no surface is attached"), "{no_surface:?}");
    detached.cancel().await.expect("client closes");

    // An unknown session: the host's NoSurface surfaces on tools/list as well.
    let stranger = rmcp_client(server.url(Uuid::new_v4())).await;
    let error = match stranger.list_all_tools().await {
        Err(ServiceError::McpError(error)) => error,
        other => panic!("expected an error, got {other:?}"),
    };
    assert_eq!(error.code, ErrorCode::INVALID_PARAMS);
    stranger.cancel().await.expect("client closes");

    server.stop().await;
}

#[tokio::test]
async fn northbound_stateless_serves_rmcp_client() {
    exercise_with_rmcp_client(NorthboundOptions::default()).await;
}

#[tokio::test]
async fn northbound_stateful_serves_rmcp_client() {
    exercise_with_rmcp_client(NorthboundOptions {
        stateful: true,
        ..NorthboundOptions::default()
    })
    .await;
}

#[tokio::test]
async fn northbound_answers_concurrent_calls() {
    init_tracing();
    for stateful in [false, true] {
        let (host, sessions) = TestHost::new();
        let server = TestServer::start(
            host,
            NorthboundOptions {
                stateful,
                ..NorthboundOptions::default()
            },
        )
        .await;
        let client = Arc::new(rmcp_client(server.url(sessions.phone)).await);
        // `gather` answers only once GATHER calls are waiting in the host, so this finishes only if
        // all of them are in flight at the same time.
        let calls = (0..GATHER).map(|n| {
            let client = Arc::clone(&client);
            async move {
                client
                    .call_tool(
                        CallToolRequestParams::new("gather").with_arguments(args(json!({"n": n}))),
                    )
                    .await
            }
        });
        let results =
            tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(calls))
                .await
                .unwrap_or_else(|_| panic!("calls were not concurrent (stateful = {stateful})"));
        for (n, result) in results.into_iter().enumerate() {
            let result = result.expect("gather answers");
            assert_eq!(result.structured_content, Some(json!({"n": n})), "call {n}");
        }
        if let Ok(client) = Arc::try_unwrap(client) {
            client.cancel().await.expect("client closes");
        }
        server.stop().await;
    }
}

#[tokio::test]
async fn southbound_over_http_reaches_a_northbound_surface() {
    init_tracing();
    let (host, sessions) = TestHost::new();
    let server = TestServer::start(host, NorthboundOptions::default()).await;
    let configs = vec![
        ServerConfig {
            name: "phone".into(),
            transport: ServerTransport::Http {
                url: server.url(sessions.phone),
                bearer: Some(TOKEN.into()),
            },
        },
        // Same endpoint without the token: rejected by the gateway's middleware, left out.
        ServerConfig {
            name: "anonymous".into(),
            transport: ServerTransport::Http {
                url: server.url(sessions.phone),
                bearer: None,
            },
        },
    ];
    let south = Southbound::connect(configs, Duration::from_secs(10)).await;
    assert_eq!(south.servers(), vec!["phone".to_owned()]);

    let tools = south.tools();
    let camera = tools
        .iter()
        .find(|(_, t)| t.name == "camera")
        .map(|(_, t)| t)
        .expect("camera listed");
    assert_eq!(camera.input_schema, ToolSpec::passthrough_schema());

    let sum = south
        .call("phone", "add", json!({"a": 20, "b": 22}), CALL)
        .await
        .expect("add");
    assert!(!sum.is_error);
    assert_eq!(sum.content, json!({"sum": 42.0}));
    assert_eq!(sum.text, "42");

    let echo = south
        .call("phone", "echo", json!({"text": "over http"}), CALL)
        .await
        .expect("echo");
    assert_eq!(echo.content, json!("over http"));

    let denied = south
        .call("phone", "camera", Value::Null, CALL)
        .await
        .expect("tool-level error");
    assert!(denied.is_error);
    assert_eq!(denied.text, "camera permission denied by the user");

    // `gather` waits for more calls than this one: the deadline cuts it off.
    let slow = south
        .call(
            "phone",
            "gather",
            json!({"n": 0}),
            Duration::from_millis(300),
        )
        .await;
    assert!(matches!(slow, Err(McpError::Timeout { .. })), "{slow:?}");

    south.shutdown().await;
    server.stop().await;
}

async fn post_initialize(
    addr: std::net::SocketAddr,
    session: Uuid,
    host: &str,
) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("http://{addr}/v1/sbp/sessions/{session}/mcp"))
        .header(reqwest::header::HOST, host)
        .header(reqwest::header::AUTHORIZATION, format!("Bearer {TOKEN}"))
        .header(
            reqwest::header::ACCEPT,
            "application/json, text/event-stream",
        )
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(
            json!({
                "jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "curl-like", "version": "1"}
                }
            })
            .to_string(),
        )
        .send()
        .await
        .expect("request sent")
}

#[tokio::test]
async fn any_host_header_is_accepted_by_default() {
    init_tracing();
    let (host, sessions) = TestHost::new();
    let server = TestServer::start(host, NorthboundOptions::default()).await;
    let response = post_initialize(server.addr, sessions.phone, "gateway.example.com").await;
    assert_eq!(response.status(), reqwest::StatusCode::OK);
    // Stateless mode answers with plain JSON.
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        content_type.starts_with("application/json"),
        "{content_type}"
    );
    let body: Value = response.json().await.expect("JSON body");
    assert_eq!(body["result"]["serverInfo"]["name"], "sbp-gateway");
    assert_eq!(body["result"]["protocolVersion"], "2025-06-18");
    server.stop().await;
}

#[tokio::test]
async fn allowed_hosts_pin_the_host_header() {
    init_tracing();
    let (host, sessions) = TestHost::new();
    let server = TestServer::start(
        host,
        NorthboundOptions {
            allowed_hosts: Some(vec!["gateway.example.com".into()]),
            ..NorthboundOptions::default()
        },
    )
    .await;
    let ok = post_initialize(server.addr, sessions.phone, "gateway.example.com").await;
    assert_eq!(ok.status(), reqwest::StatusCode::OK);
    let rebound = post_initialize(server.addr, sessions.phone, "evil.example.net").await;
    assert_eq!(rebound.status(), reqwest::StatusCode::FORBIDDEN);
    server.stop().await;

    // An empty list is not "anything goes": it falls back to loopback only.
    let (host, sessions) = TestHost::new();
    let server = TestServer::start(
        host,
        NorthboundOptions {
            allowed_hosts: Some(Vec::new()),
            ..NorthboundOptions::default()
        },
    )
    .await;
    let loopback = post_initialize(server.addr, sessions.phone, &server.addr.to_string()).await;
    assert_eq!(loopback.status(), reqwest::StatusCode::OK);
    let public = post_initialize(server.addr, sessions.phone, "gateway.example.com").await;
    assert_eq!(public.status(), reqwest::StatusCode::FORBIDDEN);
    server.stop().await;
}

#[tokio::test]
async fn a_route_without_the_session_middleware_fails_loudly() {
    init_tracing();
    let (host, _sessions) = TestHost::new();
    let app = axum::Router::new().route_service(
        "/mcp",
        sbp_mcp::northbound_service(host, NorthboundOptions::default()),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        }
    });
    let client = ()
        .serve(StreamableHttpClientTransport::from_uri(format!(
            "http://{addr}/mcp"
        )))
        .await
        .expect("initialize needs no session");
    let error = match client.list_all_tools().await {
        Err(ServiceError::McpError(error)) => error,
        other => panic!("expected an error, got {other:?}"),
    };
    assert_eq!(error.code, ErrorCode::INTERNAL_ERROR);
    client.cancel().await.expect("client closes");
    stop.cancel();
    let _ = task.await;
}
