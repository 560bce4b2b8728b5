//! Southbound over stdio, against a Python MCP server (not rmcp) run as a real child process.

use std::time::{Duration, Instant};

use sbp_mcp::{McpError, ServerConfig, ServerTransport, Southbound};
use serde_json::json;

use crate::support::{fixture_path, init_tracing, process_alive, python_server, wait_gone};

const CONNECT: Duration = Duration::from_secs(20);
const CALL: Duration = Duration::from_secs(10);

#[tokio::test]
async fn connects_lists_and_calls_a_python_server() {
    init_tracing();
    let south = Southbound::connect(vec![python_server("py", "")], CONNECT).await;
    assert_eq!(south.servers(), vec!["py".to_owned()]);

    let tools = south.tools();
    let names: Vec<&str> = tools.iter().map(|(_, t)| t.name.as_str()).collect();
    assert!(names.contains(&"add") && names.contains(&"shout") && names.contains(&"fail"));
    assert!(tools.iter().all(|(server, _)| server == "py"));
    let (_, add) = tools
        .iter()
        .find(|(_, t)| t.name == "add")
        .expect("add listed");
    assert_eq!(add.description.as_deref(), Some("Add two numbers."));
    assert_eq!(add.input_schema["properties"]["a"]["type"], "number");

    let sum = south
        .call("py", "add", json!({"a": 2, "b": 3}), CALL)
        .await
        .expect("add answers");
    assert!(!sum.is_error);
    assert_eq!(sum.content, json!({"sum": 5}));
    assert_eq!(sum.text, "5");

    let shout = south
        .call("py", "shout", json!({"text": "hello"}), CALL)
        .await
        .expect("shout answers");
    assert_eq!(shout.content, json!("HELLO"));
    assert_eq!(shout.text, "HELLO");

    let failed = south
        .call("py", "fail", json!({}), CALL)
        .await
        .expect("a tool-level error is still an answer");
    assert!(failed.is_error);
    assert_eq!(failed.text, "the fail tool always fails");

    assert_eq!(
        south.call("py", "nope", json!({}), CALL).await,
        Err(McpError::UnknownTool {
            server: "py".into(),
            tool: "nope".into()
        })
    );
    assert_eq!(
        south.call("ghost", "add", json!({}), CALL).await,
        Err(McpError::UnknownServer("ghost".into()))
    );
    assert_eq!(
        south.call("py", "add", json!([1, 2]), CALL).await,
        Err(McpError::InvalidArguments)
    );

    south.shutdown().await;
}

#[tokio::test]
async fn a_failing_server_is_left_out_without_failing_the_others() {
    init_tracing();
    let configs = vec![
        "ghost=stdio:/nonexistent/definitely-not-a-command --flag"
            .parse::<ServerConfig>()
            .expect("valid line"),
        python_server("py", ""),
        // Starts, then exits before answering initialize.
        "crasher=stdio:python3 -c 'import sys; print(\"boom\", file=sys.stderr); sys.exit(3)'"
            .parse()
            .expect("valid line"),
        // Never answers: must be cut off by the connect timeout.
        "mute=stdio:sleep 300".parse().expect("valid line"),
        // Nobody listens there.
        ServerConfig {
            name: "closed".into(),
            transport: ServerTransport::Http {
                url: "http://127.0.0.1:9/mcp".into(),
                bearer: None,
            },
        },
        // A second server with a name already taken.
        python_server("py", ""),
    ];
    let started = Instant::now();
    let south = Southbound::connect(configs, Duration::from_secs(5)).await;
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "connect is bounded by its timeout, took {:?}",
        started.elapsed()
    );
    assert_eq!(south.servers(), vec!["py".to_owned()]);
    let sum = south
        .call("py", "add", json!({"a": 1.5, "b": 1}), CALL)
        .await
        .expect("the healthy server still works");
    assert_eq!(sum.content, json!({"sum": 2.5}));
    south.shutdown().await;
}

#[tokio::test]
async fn environment_from_the_config_line_reaches_the_child() {
    init_tracing();
    let south = Southbound::connect(
        vec![python_server("envy", "SBP_FIXTURE_GREETING='hi there'")],
        CONNECT,
    )
    .await;
    let out = south
        .call(
            "envy",
            "getenv",
            json!({"name": "SBP_FIXTURE_GREETING"}),
            CALL,
        )
        .await
        .expect("getenv answers");
    assert_eq!(out.text, "hi there");
    south.shutdown().await;
}

#[tokio::test]
async fn shutdown_kills_the_child_and_what_it_started() {
    init_tracing();
    let south = Southbound::connect(vec![python_server("py", "")], CONNECT).await;
    let pid: u32 = south
        .call("py", "pid", json!({}), CALL)
        .await
        .expect("pid answers")
        .text
        .parse()
        .expect("a pid");
    let sleeper: u32 = south
        .call("py", "spawn_sleeper", json!({}), CALL)
        .await
        .expect("spawn_sleeper answers")
        .text
        .parse()
        .expect("a pid");
    assert!(process_alive(pid) && process_alive(sleeper));

    // Clones share the connections: shutting down through one closes them for all.
    let clone = south.clone();
    clone.shutdown().await;

    // rmcp waits for (reaps) the server itself before close returns.
    assert!(
        !process_alive(pid),
        "server {pid} still running after shutdown"
    );
    assert!(
        wait_gone(sleeper).await,
        "grandchild {sleeper} survived shutdown"
    );
    assert_eq!(
        south.call("py", "add", json!({"a": 1, "b": 1}), CALL).await,
        Err(McpError::Closed("py".into()))
    );
    // Idempotent.
    south.shutdown().await;
}

#[tokio::test]
async fn empty_has_no_tools() {
    let south = Southbound::empty();
    assert!(south.tools().is_empty());
    assert_eq!(
        south.call("any", "t", json!({}), CALL).await,
        Err(McpError::UnknownServer("any".into()))
    );
    south.shutdown().await;
}

#[test]
fn fixture_exists() {
    assert!(std::path::Path::new(&fixture_path()).exists());
}
