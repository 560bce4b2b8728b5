//! `sbp attach`, the terminal surface, as a user runs it: the real binary with piped stdin and
//! stdout against a real gateway process. Creating a session and chatting (the reply streamed over
//! the WebSocket, shown once), turns pushed while away shown once under their heading, local tools
//! (built-ins, `read_file` confined to --allow-dir, a stdio MCP server's tools with their schemas)
//! called by a backend and by the model, a gateway killed and restarted on the same port, the
//! terminal closes (bad token, unknown session, displaced, unreachable, API key), /quit with a
//! gateway that does not answer (left on time), and a session that moved to another gateway
//! (messages follow it; a 1013 attach is tried again).

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sbp_fake_llm::FakeLlm;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support::{Proc, STARTUP, Sbp, WAIT, client, sbp_serve, send};

/// A running `sbp attach`: stdin to type into, stdout read line by line. Dropping it kills it.
struct Attach {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    /// Every stdout line read so far by the test.
    seen: Vec<String>,
    stderr: Arc<Mutex<String>>,
}

impl Attach {
    /// `sbp attach --url URL ARGS...` with no inherited `SBP_*` variable.
    fn start(url: &str, args: &[&str]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sbp"));
        cmd.arg("attach").arg("--url").arg(url).args(args);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("SBP_") {
                cmd.env_remove(key);
            }
        }
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn sbp attach");
        let stdin = child.stdin.take();
        let out = child.stdout.take().expect("stdout is piped");
        let mut err = child.stderr.take().expect("stderr is piped");
        let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Self {
            child,
            stdin,
            lines,
            seen: Vec::new(),
            stderr,
        }
    }

    fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Everything read from stdout so far.
    fn stdout(&self) -> String {
        self.seen.join("\n")
    }

    /// Reads stdout until a line containing `what`, and returns it.
    async fn expect(&mut self, what: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let next = tokio::time::timeout_at(deadline, self.lines.recv()).await;
            match next {
                Ok(Some(line)) => {
                    self.seen.push(line.clone());
                    if line.contains(what) {
                        return line;
                    }
                }
                Ok(None) => panic!(
                    "sbp attach ended its output before {what:?}\nstdout:\n{}\nstderr:\n{}",
                    self.stdout(),
                    self.stderr()
                ),
                Err(_) => panic!(
                    "no line with {what:?} within {WAIT:?}\nstdout:\n{}\nstderr:\n{}",
                    self.stdout(),
                    self.stderr()
                ),
            }
        }
    }

    /// Types one line.
    fn type_line(&mut self, text: &str) {
        let stdin = self.stdin.as_mut().expect("stdin still open");
        writeln!(stdin, "{text}").expect("write to sbp attach");
        stdin.flush().expect("flush");
    }

    /// Ends the input (Ctrl-D).
    fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// Waits for the process to exit, then reads the rest of its stdout.
    async fn exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + WAIT;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "sbp attach still running after {WAIT:?}\nstdout:\n{}\nstderr:\n{}",
                self.stdout(),
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        while let Ok(Some(line)) = tokio::time::timeout(WAIT, self.lines.recv()).await {
            self.seen.push(line);
        }
        status
    }
}

impl Drop for Attach {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A new idle session: (id, token).
async fn new_session(gw: &Sbp) -> (String, String) {
    let (status, _, body) = send(gw.post("/v1/sessions", &json!({}))).await;
    assert_eq!(status, 201, "{body}");
    (
        body["session_id"].as_str().expect("id").to_owned(),
        body["session_token"].as_str().expect("token").to_owned(),
    )
}

/// `POST /v1/sbp/sessions/{id}/tool_calls`: the gateway's answer (status "ok" or "error").
async fn call_tool(gw: &Sbp, id: &str, token: &str, tool: &str, input: Value) -> Value {
    let (status, _, body) = send(
        gw.post(
            &format!("/v1/sbp/sessions/{id}/tool_calls"),
            &json!({"tool_name": tool, "tool_input": input, "timeout_ms": 5000}),
        )
        .header("x-session-token", token),
    )
    .await;
    assert_eq!(status, 200, "{tool}: {body}");
    body
}

/// The word after `label` on `line` (`session  <id>`).
fn field(line: &str, label: &str) -> String {
    let mut words = line.split_whitespace();
    words.by_ref().find(|w| *w == label);
    words
        .next()
        .unwrap_or_else(|| panic!("no {label} in {line:?}"))
        .to_owned()
}

fn fixture_server() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../sbp-mcp/tests/fixtures/stdio_server.py")
        .canonicalize()
        .expect("the MCP fixture server");
    format!("python3 '{}'", path.display())
}

/// Without --session: a session is created and its id and token printed; a typed message's reply
/// streams over the WebSocket and is shown once (not the HTTP body as well); only the built-in
/// tools without --allow-dir; end of input waits for the last reply, then detaches with 0.
#[tokio::test]
async fn creates_a_session_chats_and_detaches_at_end_of_input() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let mut att = Attach::start(&gw.url, &[]);
    let id = field(&att.expect("session ").await, "session");
    let token = field(&att.expect("token ").await, "token");
    att.expect(&format!("--session {id} --token {token}")).await;
    let connected = att.expect("● connected").await;
    assert!(connected.contains(&id), "{connected}");
    assert!(connected.contains("desktop"), "{connected}");
    let tools = att.expect("tools:").await;
    assert_eq!(
        tools.trim(),
        "tools: clock, system_info",
        "no read_file without --allow-dir"
    );

    let view = gw.session(&id, &token).await;
    assert_eq!(view["surface_attached"], true, "{view}");
    assert_eq!(view["surface"]["device_type"], "desktop", "{view}");
    assert_eq!(
        view["surface"]["mcp_tools"],
        json!(["clock", "system_info"])
    );

    att.type_line("hello from the terminal");
    let reply = att.expect("Echo: hello from the terminal").await;
    assert!(reply.starts_with("assistant › "), "{reply}");
    att.expect("✓ turn complete").await;
    // Piped, a reply is the text as written: no Markdown rendering, no escape codes.
    att.type_line("a **plain** reply");
    att.expect("assistant › Echo: a **plain** reply").await;
    att.expect("✓ turn complete").await;

    // The last message goes out just before the input ends: its reply is still shown.
    att.type_line("one more thing");
    att.close_stdin();
    let status = att.exit().await;
    assert_eq!(status.code(), Some(0), "stderr:\n{}", att.stderr());
    let out = att.stdout();
    assert_eq!(
        out.matches("Echo: hello from the terminal").count(),
        1,
        "{out}"
    );
    assert_eq!(out.matches("Echo: one more thing").count(), 1, "{out}");
    assert!(out.ends_with("○ detached"), "{out}");
    assert!(!out.contains('\x1b'), "no escape codes when piped: {out:?}");

    let view = gw.session(&id, &token).await;
    assert_eq!(view["surface_attached"], false, "{view}");
    assert_eq!(view["status"], "suspended", "DETACH suspends: {view}");
}

/// Turns pushed while no surface is attached are shown under "while you were away" when the
/// user comes back with --session/--token, each once; a turn pushed while attached streams live;
/// the next attach has nothing waiting.
#[tokio::test]
async fn turns_pushed_while_away_are_shown_once_on_return() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let (id, token) = new_session(&gw).await;
    let args = ["--session", id.as_str(), "--token", token.as_str()];

    let mut first = Attach::start(&gw.url, &args);
    first.expect("● connected").await;
    first.type_line("/quit");
    assert_eq!(first.exit().await.code(), Some(0), "{}", first.stderr());

    let away = [
        "Your flight prices dropped.\nBook by Friday.",
        "The hotel confirmed.",
    ];
    for text in away {
        let body = gw.push(&id, &token, text).await;
        assert_eq!(body["delivery"], "tethered", "{body}");
    }

    let mut back = Attach::start(&gw.url, &args);
    let connected = back.expect("● connected").await;
    assert!(connected.contains("2 turns waiting"), "{connected}");
    back.expect("── while you were away ──").await;
    back.expect("assistant › Your flight prices dropped.").await;
    back.expect("  Book by Friday.").await;
    back.expect("assistant › The hotel confirmed.").await;
    back.expect("── end of what you missed ──").await;

    let body = gw.push(&id, &token, "A live update.").await;
    assert_eq!(body["delivery"], "live", "{body}");
    let live = back.expect("A live update.").await;
    assert!(live.starts_with("assistant › "), "{live}");
    back.expect("✓ turn complete").await;
    back.type_line("/quit");
    assert_eq!(back.exit().await.code(), Some(0), "{}", back.stderr());
    let out = back.stdout();
    assert_eq!(out.matches("while you were away").count(), 1, "{out}");
    for text in [
        "Your flight prices dropped.",
        "The hotel confirmed.",
        "A live update.",
    ] {
        assert_eq!(out.matches(text).count(), 1, "{text}: {out}");
    }

    let mut again = Attach::start(&gw.url, &args);
    let connected = again.expect("● connected").await;
    assert!(!connected.contains("waiting"), "all delivered: {connected}");
    again.type_line("/quit");
    assert_eq!(again.exit().await.code(), Some(0), "{}", again.stderr());
    assert!(
        !again.stdout().contains("while you were away"),
        "{}",
        again.stdout()
    );
}

/// A backend's TOOL_CALLs are answered with local tools: clock, system_info, read_file inside
/// --allow-dir (and refused outside it), and an `--mcp` server's tools, declared with their full
/// schemas; each call and its outcome is shown.
#[tokio::test]
async fn tool_calls_are_answered_with_local_tools() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let (id, token) = new_session(&gw).await;
    let shared = tempfile::tempdir().expect("tempdir");
    std::fs::write(shared.path().join("notes.txt"), "the shared note").expect("write");
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let secret: PathBuf = elsewhere.path().join("secret.txt");
    std::fs::write(&secret, "not for the agent").expect("write");
    let share = shared.path().to_str().expect("utf-8 path");
    let mcp = fixture_server();
    let mut att = Attach::start(
        &gw.url,
        &[
            "--session",
            &id,
            "--token",
            &token,
            "--allow-dir",
            share,
            "--mcp",
            &mcp,
        ],
    );
    att.expect("● connected").await;
    let tools = att.expect("tools:").await;
    for name in [
        "clock",
        "system_info",
        "read_file",
        "add (mcp1)",
        "shout (mcp1)",
    ] {
        assert!(tools.contains(name), "{name}: {tools}");
    }

    let view = gw.session(&id, &token).await;
    let surface = &view["surface"];
    let declared: Vec<&str> = surface["mcp_tools"]
        .as_array()
        .expect("mcp_tools")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for name in [
        "clock",
        "system_info",
        "read_file",
        "add",
        "shout",
        "getenv",
    ] {
        assert!(declared.contains(&name), "{name}: {declared:?}");
    }
    let schema = |name: &str| {
        surface["mcp_tool_schemas"]
            .as_array()
            .expect("mcp_tool_schemas")
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no schema for {name}: {surface}"))
            .clone()
    };
    let add = schema("add");
    assert_eq!(add["description"], "Add two numbers.");
    assert_eq!(add["input_schema"]["required"], json!(["a", "b"]), "{add}");
    assert_eq!(
        add["input_schema"]["properties"]["a"]["type"], "number",
        "{add}"
    );
    assert_eq!(
        schema("read_file")["input_schema"]["required"],
        json!(["path"])
    );

    let clock = call_tool(&gw, &id, &token, "clock", json!({})).await;
    assert_eq!(clock["status"], "ok", "{clock}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    let unix = clock["result"]["unix_time"].as_i64().expect("unix_time");
    assert!((unix - now).abs() < 60, "{clock}");
    assert!(clock["result"]["timezone"].is_string(), "{clock}");
    att.expect("⚙ tool clock({})").await;
    att.expect("⚙ clock → ").await;

    let info = call_tool(&gw, &id, &token, "system_info", json!({})).await;
    assert_eq!(info["result"]["os"], std::env::consts::OS, "{info}");
    assert_eq!(info["result"]["arch"], std::env::consts::ARCH, "{info}");
    assert!(
        info["result"]["cpus"].as_u64().expect("cpus") >= 1,
        "{info}"
    );

    let read = call_tool(&gw, &id, &token, "read_file", json!({"path": "notes.txt"})).await;
    assert_eq!(read["status"], "ok", "{read}");
    assert_eq!(read["result"]["content"], "the shared note", "{read}");
    att.expect("⚙ read_file → ").await;

    let climbing = format!(
        "../{}/secret.txt",
        elsewhere
            .path()
            .file_name()
            .expect("name")
            .to_str()
            .expect("utf-8")
    );
    for outside in [climbing.as_str(), secret.to_str().expect("utf-8")] {
        let refused = call_tool(&gw, &id, &token, "read_file", json!({"path": outside})).await;
        assert_eq!(refused["status"], "error", "{refused}");
        let error = refused["error"].as_str().expect("error text");
        assert!(error.contains("outside the shared directory"), "{refused}");
        assert!(!error.contains("not for the agent"), "{refused}");
        att.expect("⚙ read_file failed: ").await;
    }

    let sum = call_tool(&gw, &id, &token, "add", json!({"a": 2, "b": 3})).await;
    assert_eq!(sum["status"], "ok", "{sum}");
    assert_eq!(sum["result"], json!({"sum": 5}), "{sum}");
    att.expect("⚙ add → {\"sum\":5}").await;
    let failed = call_tool(&gw, &id, &token, "fail", json!({})).await;
    assert_eq!(failed["status"], "error", "{failed}");
    assert!(
        failed["error"]
            .as_str()
            .is_some_and(|e| e.contains("always fails")),
        "{failed}"
    );

    att.type_line("/quit");
    assert_eq!(att.exit().await.code(), Some(0), "{}", att.stderr());
}

/// A typed message whose model asks for the surface's `clock`: the TOOL_CALL is answered locally
/// within the turn, and the model's answer (built from the result) streams back.
#[tokio::test]
async fn the_model_calls_a_local_tool_within_a_turn() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &["--llm-base-url", &fake.base_url()]).await;
    let mut att = Attach::start(&gw.url, &["--model", "gpt-test"]);
    att.expect("● connected").await;
    att.type_line("what time is it? [[fake:tool=surface_clock]]");
    att.expect("⚙ tool clock(").await;
    att.expect("⚙ clock → ").await;
    let reply = att.expect("assistant › tool result: ").await;
    assert!(reply.contains("unix_time"), "{reply}");
    att.expect("✓ turn complete · gpt-test").await;
    att.type_line("/quit");
    assert_eq!(att.exit().await.code(), Some(0), "{}", att.stderr());
}

/// `sbp serve` on a fixed port (to restart it where the surface will look for it). `None` when
/// it could not bind the port (something else took it).
async fn serve_on(data_dir: &Path, port: u16) -> Option<Sbp> {
    let mut cmd = sbp_serve();
    cmd.arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(data_dir);
    let mut proc = Proc::spawn(cmd);
    let banner = proc.next_line(STARTUP).await?;
    let url = format!("http://127.0.0.1:{port}");
    assert!(banner.contains(&url), "{banner}");
    Some(Sbp {
        proc,
        ws_url: format!("ws://127.0.0.1:{port}"),
        url,
        banner,
        http: client(),
    })
}

/// The gateway is killed (`kill -9`) under an attached terminal and started again on the same
/// data dir and port: the terminal shows the lost connection and its reconnect attempts, comes
/// back by itself, and chat and tools work again.
#[tokio::test]
async fn survives_the_gateway_restarting() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A port the OS picks, then held by the gateway itself; after the kill it is bound again at
    // once (SO_REUSEADDR), and a restart that cannot bind it is retried.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let mut gw = serve_on(dir.path(), port)
        .await
        .expect("gateway on its port");
    let (id, token) = new_session(&gw).await;
    let mut att = Attach::start(&gw.url, &["--session", &id, "--token", &token]);
    att.expect("● connected").await;

    gw.proc.kill9();
    att.expect("○ connection lost").await;
    let mut restarted = None;
    for _ in 0..3 {
        restarted = serve_on(dir.path(), port).await;
        if restarted.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let gw = restarted.expect("the gateway restarts on its port");
    att.expect("○ reconnecting in").await;
    att.expect("● reconnected").await;

    att.type_line("still there?");
    att.expect("assistant › Echo: still there?").await;
    let clock = call_tool(&gw, &id, &token, "clock", json!({})).await;
    assert_eq!(clock["status"], "ok", "tools are declared again: {clock}");
    att.type_line("/quit");
    assert_eq!(att.exit().await.code(), Some(0), "{}", att.stderr());
}

/// Final closes end the terminal with a non-zero status and a clear message:
/// a wrong token (3), an unknown session (4), another surface taking over (5), no gateway (1).
#[tokio::test]
async fn terminal_closes_exit_non_zero() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let (id, token) = new_session(&gw).await;

    let mut bad = Attach::start(&gw.url, &["--session", &id, "--token", "not-the-token"]);
    assert_eq!(bad.exit().await.code(), Some(3), "{}", bad.stdout());
    assert!(bad.stderr().contains("forbidden"), "{}", bad.stderr());

    let unknown = "01900000-0000-7000-8000-000000000000";
    let mut missing = Attach::start(&gw.url, &["--session", unknown, "--token", &token]);
    assert_eq!(missing.exit().await.code(), Some(4), "{}", missing.stdout());
    assert!(
        missing.stderr().contains("session not found"),
        "{}",
        missing.stderr()
    );

    let mut att = Attach::start(&gw.url, &["--session", &id, "--token", &token]);
    att.expect("● connected").await;
    let (ws, _) = gw.attach(&id, &token).await;
    att.expect("✖ displaced").await;
    assert_eq!(att.exit().await.code(), Some(5), "{}", att.stdout());
    assert!(att.stderr().contains("displaced"), "{}", att.stderr());
    ws.close().await;

    let closed_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let mut nowhere = Attach::start(&format!("http://127.0.0.1:{closed_port}"), &[]);
    assert_eq!(nowhere.exit().await.code(), Some(1));
    assert!(
        nowhere.stderr().contains("cannot reach the gateway"),
        "{}",
        nowhere.stderr()
    );

    let mut half = Attach::start(&gw.url, &["--session", &id]);
    assert_eq!(half.exit().await.code(), Some(1));
    assert!(
        half.stderr().contains("--session needs --token"),
        "{}",
        half.stderr()
    );
}

/// Leaving does not wait on the gateway: with the gateway process stopped (SIGSTOP), so that the
/// DETACH is never answered, /quit ends `sbp attach` with 0 within its exit deadline (1.5 s, then
/// 0.5 s for the runtime), not after the SDK's close timeouts (5 s each), and says so.
#[tokio::test]
async fn quit_is_prompt_when_the_gateway_does_not_answer() {
    // Between the deadline (2 s) and the SDK's first close timeout (5 s), with room for a loaded
    // machine.
    const BOUND: Duration = Duration::from_secs(4);
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let (id, token) = new_session(&gw).await;
    let mut att = Attach::start(&gw.url, &["--session", &id, "--token", &token]);
    att.expect("● connected").await;

    gw.proc.signal("STOP");
    let quit = Instant::now();
    att.type_line("/quit");
    let status = att.exit().await;
    let took = quit.elapsed();
    gw.proc.signal("CONT");
    assert_eq!(status.code(), Some(0), "{}", att.stderr());
    assert!(
        took < BOUND,
        "sbp attach took {took:?} to leave\nstdout:\n{}\nstderr:\n{}",
        att.stdout(),
        att.stderr()
    );
    let out = att.stdout();
    assert!(
        out.ends_with("○ the gateway did not confirm the detach in time: left anyway"),
        "{out}"
    );
}

/// A gateway with operator API keys: creating a session needs --api-key.
#[tokio::test]
async fn api_key_is_sent_on_http_calls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &["--api-key", "operator-key-1"]).await;
    let mut without = Attach::start(&gw.url, &[]);
    assert_eq!(without.exit().await.code(), Some(1));
    assert!(without.stderr().contains("401"), "{}", without.stderr());

    let mut with = Attach::start(&gw.url, &["--api-key", "operator-key-1"]);
    with.expect("created session").await;
    with.expect("● connected").await;
    with.type_line("keyed");
    with.expect("Echo: keyed").await;
    with.type_line("/quit");
    assert_eq!(with.exit().await.code(), Some(0), "{}", with.stderr());
}

/// A gateway the session has left, in front of the one holding it: WebSocket upgrades pass
/// through to `holder` (after `busy` of them were refused with PROTOCOL_ERROR and close 1013, as a
/// gateway that cannot take the session over yet does), and every other request is answered 409
/// SBP_SESSION_MOVED naming `holder`. Stops when dropped.
struct MovedFront {
    url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MovedFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl MovedFront {
    async fn start(holder: &str, busy: usize) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let holder_addr = holder.trim_start_matches("http://").to_owned();
        let moved = json!({"error": {
            "code": "SBP_SESSION_MOVED",
            "message": "the session moved to another gateway",
            "detail": {"gateway_id": "0f".repeat(16), "gateway_url": holder},
        }})
        .to_string();
        let busy = Arc::new(std::sync::atomic::AtomicUsize::new(busy));
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (holder_addr, moved, busy) = (holder_addr.clone(), moved.clone(), busy.clone());
                tokio::spawn(async move {
                    let _ = serve_front(stream, &holder_addr, &moved, &busy).await;
                });
            }
        });
        Self { url, task }
    }
}

async fn serve_front(
    mut stream: tokio::net::TcpStream,
    holder: &str,
    moved: &str,
    busy: &std::sync::atomic::AtomicUsize,
) -> std::io::Result<()> {
    use futures::{SinkExt as _, StreamExt as _};
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::protocol::CloseFrame;

    // The request line, without taking it off the socket (a WebSocket is passed on untouched).
    let mut head = [0u8; 32];
    let mut seen = 0;
    while seen < head.len() {
        seen = stream.peek(&mut head).await?;
        if seen == 0 {
            return Ok(());
        }
        tokio::task::yield_now().await;
    }
    if head.starts_with(b"GET /v1/sbp/ws/") {
        let refuse = busy
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if refuse {
            let mut ws = tokio_tungstenite::accept_async(stream)
                .await
                .map_err(std::io::Error::other)?;
            let _attach = ws.next().await;
            let error = json!({"type": "PROTOCOL_ERROR", "detail": "try again: a turn is running on the gateway holding the session"});
            ws.send(Message::text(error.to_string()))
                .await
                .map_err(std::io::Error::other)?;
            ws.close(Some(CloseFrame {
                code: 1013.into(),
                reason: "try again later".into(),
            }))
            .await
            .map_err(std::io::Error::other)?;
            while let Some(Ok(_)) = ws.next().await {}
            return Ok(());
        }
        let mut upstream = tokio::net::TcpStream::connect(holder).await?;
        tokio::io::copy_bidirectional(&mut stream, &mut upstream).await?;
        return Ok(());
    }
    // Any other request: its head (and body, by Content-Length) read, then "moved".
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    let body_at = loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        request.extend_from_slice(&buf[..n]);
        if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = String::from_utf8_lossy(&request[..body_at]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while request.len() < body_at + length {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let answer = format!(
        "HTTP/1.1 409 Conflict\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{moved}",
        moved.len()
    );
    stream.write_all(answer.as_bytes()).await?;
    stream.shutdown().await
}

/// Federation: attached through a gateway the session has left (whose WebSocket, like any
/// federated gateway's, brings the session to the surface), the typed messages are answered
/// "moved" there and follow the session to the gateway holding it, which the terminal says once;
/// the first attach, refused with 1013 while the session could not be taken over, is tried again.
#[tokio::test]
async fn messages_follow_a_moved_session_and_a_busy_attach_is_retried() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let (id, token) = new_session(&gw).await;
    let front = MovedFront::start(&gw.url, 2).await;

    let mut att = Attach::start(&front.url, &["--session", &id, "--token", &token]);
    let retry = att.expect("could not take the session over yet").await;
    assert!(retry.contains("trying again in"), "{retry}");
    let connected = att.expect("● connected").await;
    assert!(connected.contains(&front.url), "{connected}");
    assert_eq!(
        att.stdout()
            .matches("could not take the session over yet")
            .count(),
        2,
        "{}",
        att.stdout()
    );

    att.type_line("where did you go?");
    let moved = att.expect("the session moved to").await;
    assert!(
        moved.ends_with(&format!("the session moved to {}", gw.url)),
        "{moved}"
    );
    att.expect("Echo: where did you go?").await;
    att.expect("✓ turn complete").await;
    att.type_line("still there?");
    att.expect("Echo: still there?").await;
    att.type_line("/quit");
    let status = att.exit().await;
    assert_eq!(status.code(), Some(0), "stderr:\n{}", att.stderr());
    let out = att.stdout();
    assert_eq!(out.matches("the session moved to").count(), 1, "{out}");
    assert!(!out.contains("message not answered"), "{out}");
    let messages = gw.messages(&id, &token).await;
    assert_eq!(
        messages.len(),
        4,
        "both messages reached the holder: {messages:?}"
    );
}
