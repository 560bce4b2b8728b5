//! A southbound that heals, against real Python children: a dead child is replaced, a call is
//! retried only if it never reached the server, a server that could not start joins later, and
//! shutdown leaves nothing behind.

use std::{collections::HashSet, time::Duration};

use sbp_mcp::{McpError, ServerConfig, Southbound};
use serde_json::json;

use crate::support::{
    TempDir, eventually, fixture_path, init_tracing, kill9, process_alive, processes_mentioning,
    started_pids, wait_gone,
};

const CONNECT: Duration = Duration::from_secs(20);
const CALL: Duration = Duration::from_secs(10);
/// Bound on waiting for a background reconnect: the first retry of a server that failed at start
/// comes after `RECONNECT_BACKOFF`, the next ones later.
const RECONNECTED: Duration = Duration::from_secs(30);

/// `name=stdio:` the fixture at `script`, logging every start to `dir`'s `pids` file.
fn server(dir: &TempDir, name: &str, script: &str) -> ServerConfig {
    format!(
        "{name}=stdio:SBP_FIXTURE_PIDFILE='{}' python3 '{script}'",
        dir.path("pids")
    )
    .parse()
    .expect("fixture config line parses")
}

async fn pid(south: &Southbound, server: &str) -> Result<u32, McpError> {
    let out = south.call(server, "pid", json!({}), CALL).await?;
    Ok(out.text.parse().expect("pid answers a number"))
}

#[tokio::test]
async fn a_killed_child_is_replaced_and_the_next_call_succeeds() {
    init_tracing();
    let dir = TempDir::new();
    let south = Southbound::connect(vec![server(&dir, "py", &fixture_path())], CONNECT).await;
    let first = pid(&south, "py").await.expect("pid answers");
    assert_eq!(south.child_pid("py"), Some(first));

    kill9(first);
    assert!(wait_gone(first).await, "{first} survived kill -9");
    // Once the gateway has seen the connection end (its stdout closed), the next call is sent on a
    // new connection, started by the call or already by the background task.
    assert!(
        eventually(CALL, || south.child_pid("py") != Some(first)).await,
        "the dead child was never noticed"
    );
    let second = pid(&south, "py").await.expect("the next call succeeds");
    assert_ne!(second, first);
    assert!(process_alive(second));
    assert_eq!(
        pid(&south, "py").await,
        Ok(second),
        "calls stay on the new child"
    );
    assert_eq!(started_pids(&dir.path("pids")), [first, second]);
    assert_eq!(south.servers(), ["py"]);

    south.shutdown().await;
    assert!(!process_alive(second));
}

#[tokio::test]
async fn a_call_that_could_not_be_written_is_retried_on_a_new_child() {
    init_tracing();
    let dir = TempDir::new();
    let south = Southbound::connect(vec![server(&dir, "py", &fixture_path())], CONNECT).await;
    let first = pid(&south, "py").await.expect("pid answers");
    let deaf = south
        .call("py", "deafen", json!({}), CALL)
        .await
        .expect("deafen answers");
    assert_eq!(deaf.text, "deaf");

    // The child is alive with its stdout open, but has closed its stdin: writing the next request
    // fails, so it never reached the server and is retried once, on a new child.
    let second = pid(&south, "py").await.expect("the call is retried");
    assert_ne!(second, first);
    assert_eq!(started_pids(&dir.path("pids")), [first, second]);
    // The old child is closed in the background (stdin closed, wait, SIGTERM).
    assert!(
        eventually(Duration::from_secs(20), || !process_alive(first)).await,
        "the deaf child {first} was not closed"
    );
    south.shutdown().await;
}

#[tokio::test]
async fn a_call_in_flight_when_the_server_dies_is_not_retried() {
    init_tracing();
    let dir = TempDir::new();
    let south = Southbound::connect(vec![server(&dir, "py", &fixture_path())], CONNECT).await;
    let first = pid(&south, "py").await.expect("pid answers");
    let marker = dir.path("marker");

    // `exit` runs (writes the marker) and the server dies before answering: the server may have
    // run the call, so it fails instead of running twice.
    let died = south
        .call("py", "exit", json!({"marker": marker}), CALL)
        .await;
    match died {
        Err(McpError::Transport { server, message }) => {
            assert_eq!(server, "py");
            assert!(message.contains("may have run"), "{message}");
        }
        other => panic!("expected a transport error, got {other:?}"),
    }
    let runs = std::fs::read_to_string(&marker).expect("exit ran");
    assert_eq!(runs.lines().count(), 1, "exit ran more than once");

    // The next call reconnects.
    let second = pid(&south, "py").await.expect("the next call succeeds");
    assert_ne!(second, first);
    assert_eq!(started_pids(&dir.path("pids")), [first, second]);
    south.shutdown().await;
}

#[tokio::test]
async fn concurrent_calls_after_a_kill_start_exactly_one_child() {
    init_tracing();
    let dir = TempDir::new();
    let south = Southbound::connect(vec![server(&dir, "py", &fixture_path())], CONNECT).await;
    let first = pid(&south, "py").await.expect("pid answers");

    kill9(first);
    assert!(wait_gone(first).await, "{first} survived kill -9");
    let calls = (0..10).map(|_| pid(&south, "py"));
    let results = futures::future::join_all(calls).await;

    let mut children = HashSet::new();
    for result in results {
        match result {
            Ok(pid) => {
                children.insert(pid);
            }
            // Allowed by the retry rule: a request handed to the old connection just before the
            // gateway saw it end may have reached the server, so it is not retried.
            Err(McpError::Transport { message, .. }) if message.contains("may have run") => {}
            Err(other) => panic!("unexpected failure: {other}"),
        }
    }
    let last = pid(&south, "py").await.expect("a later call succeeds");
    children.insert(last);
    assert_eq!(
        children,
        HashSet::from([last]),
        "calls reached several children"
    );
    assert_ne!(last, first);
    assert_eq!(
        started_pids(&dir.path("pids")),
        [first, last],
        "exactly one new child was started"
    );
    south.shutdown().await;
}

#[tokio::test]
async fn a_server_that_could_not_start_joins_after_a_background_retry() {
    init_tracing();
    let dir = TempDir::new();
    let late = dir.path("late.py");
    let south = Southbound::connect(
        vec![
            server(&dir, "late", &late),
            server(&dir, "py", &fixture_path()),
        ],
        CONNECT,
    )
    .await;
    assert_eq!(south.servers(), ["py"]);
    assert!(south.tools().iter().all(|(server, _)| server == "py"));

    // Configured but down: the call fails fast, and nothing is started for it within the backoff.
    let down = south
        .call("late", "add", json!({"a": 1, "b": 2}), CALL)
        .await;
    assert!(
        matches!(&down, Err(McpError::Unavailable { server, .. }) if server == "late"),
        "{down:?}"
    );
    assert_eq!(
        south.call("nope", "add", json!({}), CALL).await,
        Err(McpError::UnknownServer("nope".into()))
    );

    std::fs::copy(fixture_path(), &late).expect("the server appears");
    assert!(
        eventually(RECONNECTED, || south
            .tools()
            .iter()
            .any(|(server, tool)| server == "late" && tool.name == "add"))
        .await,
        "late's tools never appeared"
    );
    assert_eq!(south.servers(), ["late", "py"], "configuration order");
    let sum = south
        .call("late", "add", json!({"a": 1, "b": 2}), CALL)
        .await
        .expect("late answers");
    assert_eq!(sum.content, json!({"sum": 3}));
    south.shutdown().await;
}

#[tokio::test]
async fn shutdown_during_backoff_leaves_no_child_and_no_task() {
    init_tracing();
    let dir = TempDir::new();
    let script = dir.path("server.py");
    std::fs::copy(fixture_path(), &script).expect("copy the fixture");
    let south = Southbound::connect(
        vec![
            server(&dir, "py", &script),
            server(&dir, "late", &dir.path("late.py")),
        ],
        CONNECT,
    )
    .await;
    let first = pid(&south, "py").await.expect("pid answers");

    // py: killed, replaced in the background, killed again within the backoff of that reconnect.
    kill9(first);
    assert!(wait_gone(first).await);
    assert!(
        eventually(RECONNECTED, || south
            .child_pid("py")
            .is_some_and(|p| p != first))
        .await,
        "py was not reconnected"
    );
    let second = south.child_pid("py").expect("py is up");
    kill9(second);
    assert!(wait_gone(second).await);
    // late: failed at start, waiting for its first retry.
    let down = south
        .call("late", "add", json!({"a": 1, "b": 2}), CALL)
        .await;
    assert!(
        matches!(down, Err(McpError::Unavailable { .. })),
        "{down:?}"
    );
    assert!(south.background_tasks() > 0, "the background task runs");

    south.shutdown().await;
    assert_eq!(south.background_tasks(), 0, "tasks left after shutdown");
    let needle = dir.path("");
    assert!(
        eventually(Duration::from_secs(10), || processes_mentioning(&needle)
            .is_empty())
        .await,
        "children left after shutdown: {:?}",
        processes_mentioning(&needle)
    );
    for server in ["py", "late"] {
        assert_eq!(
            south
                .call(server, "add", json!({"a": 1, "b": 2}), CALL)
                .await,
            Err(McpError::Closed(server.into()))
        );
    }
    assert!(south.tools().is_empty());
}
