//! What an operator reads on stderr: with `--log-format json` one JSON access line per request
//! and per WebSocket connection (route template, status, latency, bytes, session and request
//! ids), never a token that travelled in the path; a WARN line for an upstream failure; the MCP
//! library's per-request INFO lines held back; no colour escapes when stderr is not a
//! terminal; and no line lost at exit when whatever reads stderr falls behind.

use sbp_fake_llm::FakeLlm;
use serde_json::{Value, json};

use crate::support::{Sbp, WAIT, client, eventually, msg, sbp_serve_in, send, url_in_banner};

/// The JSON lines of `stderr`; every line must be one.
fn json_lines(stderr: &str) -> Vec<Value> {
    stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect()
}

/// The access lines (target `sbp::access`) as their fields, with the level added.
fn access_lines(stderr: &str) -> Vec<Value> {
    json_lines(stderr)
        .into_iter()
        .filter(|l| l["target"] == "sbp::access")
        .map(|l| {
            let mut fields = l["fields"].clone();
            fields["level"] = l["level"].clone();
            fields
        })
        .collect()
}

/// Waits for an access line that `pick` accepts (lines are written when a response's last byte
/// is gone, or a connection ends).
async fn access_line(gw: &Sbp, what: &str, pick: impl Fn(&Value) -> bool) -> Value {
    eventually(WAIT, what, || {
        let found = access_lines(&gw.proc.stderr())
            .into_iter()
            .find(|l| pick(l));
        async move { found }
    })
    .await
}

fn completion(model: &str, text: &str) -> Value {
    json!({"model": model, "messages": [msg("user", text)]})
}

#[tokio::test]
async fn json_access_lines_name_the_route_template_and_never_carry_a_token() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(
        dir.path(),
        &["--log-format", "json", "--llm-base-url", &fake.base_url()],
    )
    .await;

    // A completion under the client's own request id, echoed back.
    let resp = gw
        .post("/v1/chat/completions", &completion("gpt-4o", "hello"))
        .header("x-request-id", "client-req.42")
        .send()
        .await
        .expect("completion");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "client-req.42");
    let token = resp.headers()["x-session-token"]
        .to_str()
        .expect("token")
        .to_owned();
    let body: Value = resp.json().await.expect("completion body");
    let id = body["sbp"]["session_id"].as_str().expect("id").to_owned();
    let line = access_line(&gw, "the completion's line", |l| {
        l["request_id"] == "client-req.42"
    })
    .await;
    assert_eq!(line["level"], "INFO", "{line}");
    assert_eq!(line["method"], "POST", "{line}");
    assert_eq!(line["route"], "/v1/chat/completions", "{line}");
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(line["session_id"], id.as_str(), "{line}");
    assert!(line["bytes"].as_u64().is_some_and(|b| b > 0), "{line}");
    assert!(line["latency_ms"].as_f64().is_some(), "{line}");

    // A roaming token in a path: the line names the template; the token is nowhere in the log.
    let (status, _, export) = send(
        gw.post(
            &format!("/v1/sbp/sessions/{id}/export"),
            &json!({"ttl_seconds": 600}),
        )
        .header("x-session-token", &token),
    )
    .await;
    assert_eq!(status, 201, "{export}");
    let roaming = export["roaming_token"].as_str().expect("roaming token");
    let resp = gw
        .get(&format!("/v1/sbp/token/{roaming}"))
        .send()
        .await
        .expect("inspect token");
    assert_eq!(resp.status(), 200);
    let generated = resp.headers()["x-request-id"]
        .to_str()
        .expect("request id")
        .to_owned();
    assert!(uuid::Uuid::parse_str(&generated).is_ok(), "{generated}");
    let line = access_line(&gw, "the token route's line", |l| {
        l["request_id"] == generated.as_str()
    })
    .await;
    assert_eq!(line["route"], "/v1/sbp/token/{token}", "{line}");
    let export_line = access_line(&gw, "the export's line", |l| {
        l["route"] == "/v1/sbp/sessions/{id}/export"
    })
    .await;
    assert_eq!(export_line["session_id"], id.as_str(), "{export_line}");
    assert_eq!(export_line["status"], 201, "{export_line}");

    // The MCP library logs each request it serves at INFO; that is held back (the access line
    // covers it).
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-03-26", "capabilities": {},
        "clientInfo": {"name": "ops-test", "version": "1"}}});
    let (status, _, body) = send(
        gw.post(&format!("/v1/sbp/sessions/{id}/mcp"), &initialize)
            .header("accept", "application/json, text/event-stream")
            .bearer_auth(&token),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    access_line(&gw, "the MCP request's line", |l| {
        l["route"] == "/v1/sbp/sessions/{id}/mcp" && l["status"] == 200
    })
    .await;

    // No route: a fixed label, not the path.
    let (status, _, _) = send(gw.get("/no/such/place")).await;
    assert_eq!(status, 404);
    access_line(&gw, "the unmatched line", |l| {
        l["route"] == "unmatched" && l["status"] == 404
    })
    .await;

    // A WebSocket connection: one line when it ends, with its frames.
    let (mut ws, attached) = gw.attach(&id, &token).await;
    assert_eq!(attached["type"], "SESSION_ATTACHED", "{attached}");
    ws.send(json!({"type": "DETACH"})).await;
    ws.expect_close(1000).await;
    let line = access_line(&gw, "the WebSocket's line", |l| {
        l["route"] == "/v1/sbp/ws/{id}"
    })
    .await;
    assert_eq!(line["status"], 101, "{line}");
    assert_eq!(line["session_id"], id.as_str(), "{line}");
    assert_eq!(line["frames_in"], 2, "ATTACH_SESSION and DETACH: {line}");
    assert!(
        line["frames_out"].as_u64().is_some_and(|n| n >= 1),
        "{line}"
    );
    assert!(line["request_id"].is_string(), "{line}");

    // An upstream failure: a WARN line naming model, provider and outcome, and the request's
    // own line at WARN with the status passed on.
    let (status, _, body) = send(gw.post(
        "/v1/chat/completions",
        &completion("gpt-4o", "[[fake:error=503]] fail"),
    ))
    .await;
    assert_eq!(status, 503, "{body}");
    let failed = eventually(WAIT, "the upstream failure's WARN line", || {
        let found = json_lines(&gw.proc.stderr())
            .into_iter()
            .find(|l| l["fields"]["message"] == "upstream request failed");
        async move { found }
    })
    .await;
    assert_eq!(failed["level"], "WARN", "{failed}");
    let f = &failed["fields"];
    assert_eq!(
        (&f["model"], &f["provider"], &f["outcome"], &f["status"]),
        (
            &json!("gpt-4o"),
            &json!("openai"),
            &json!("server_error"),
            &json!(503)
        ),
        "{failed}"
    );
    let line = access_line(&gw, "the failed completion's line", |l| l["status"] == 503).await;
    assert_eq!(line["level"], "WARN", "{line}");

    let stderr = gw.proc.stderr();
    let rmcp_info: Vec<Value> = json_lines(&stderr)
        .into_iter()
        .filter(|l| l["target"].as_str().is_some_and(|t| t.starts_with("rmcp")))
        .filter(|l| l["level"] == "INFO" || l["level"] == "DEBUG")
        .collect();
    assert!(rmcp_info.is_empty(), "rmcp held at WARN: {rmcp_info:?}");
    assert!(!stderr.contains(roaming), "the roaming token was logged");
    assert!(!stderr.contains(&token), "the session token was logged");
    assert!(!stderr.contains('\u{1b}'), "no escape sequences on a pipe");
}

#[tokio::test]
async fn text_logs_on_a_pipe_carry_no_colour() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let (status, _, _) = send(gw.get("/healthz")).await;
    assert_eq!(status, 200);
    let line = eventually(WAIT, "the health check's line", || {
        let stderr = gw.proc.stderr();
        let found = stderr
            .lines()
            .find(|l| l.contains("sbp::access") && l.contains("/healthz"))
            .map(str::to_owned);
        async move { found }
    })
    .await;
    assert!(line.contains("status=200"), "{line}");
    assert!(
        !gw.proc.stderr().contains('\u{1b}'),
        "no escape sequences on a pipe:\n{}",
        gw.proc.stderr()
    );
}

/// Whatever reads the gateway's stderr (a log collector) stalls while the gateway has more lines
/// than the pipe holds, and the gateway is told to stop meanwhile: it finishes writing every line
/// before it exits, as it did when it wrote each line itself, instead of exiting with lines still
/// queued (which are then lost).
#[tokio::test]
async fn a_stalled_stderr_loses_no_line_at_exit() {
    use std::io::{BufRead as _, Read as _};
    /// Access lines of about 150 bytes: several times a 64 KiB pipe.
    const REQUESTS: usize = 2000;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = sbp_serve_in(dir.path(), &[]).spawn().expect("spawn sbp");
    let stdout = child.stdout.take().expect("stdout piped");
    // Held open and not read until the gateway has been asked to stop.
    let mut stderr = child.stderr.take().expect("stderr piped");
    let banner = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("startup line");
        line
    })
    .await
    .expect("reader");
    let url = url_in_banner(&banner);
    let http = client();
    for _ in 0..REQUESTS {
        let status = tokio::time::timeout(WAIT, http.get(format!("{url}/healthz")).send())
            .await
            .expect("answered while stderr is stalled")
            .expect("request")
            .status();
        assert_eq!(status, 200);
    }
    let term = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(term.success());
    // The stall outlasts any grace a log writer might allow itself at exit.
    let stalled_until = tokio::time::Instant::now() + std::time::Duration::from_secs(3);
    while tokio::time::Instant::now() < stalled_until {
        if child.try_wait().expect("try_wait").is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let log = tokio::task::spawn_blocking(move || {
        let mut text = String::new();
        stderr.read_to_string(&mut text).expect("stderr");
        text
    })
    .await
    .expect("reader");
    let status = child.wait().expect("exit");
    assert_eq!(status.code(), Some(0), "{status}");
    let lines = log
        .lines()
        .filter(|l| l.contains("sbp::access") && l.contains("/healthz"))
        .count();
    assert_eq!(lines, REQUESTS, "access lines written before exit");
    assert!(
        log.trim_end().ends_with("gateway stopped"),
        "the last line is written too:\n{}",
        &log[log.len().saturating_sub(600)..]
    );
}
