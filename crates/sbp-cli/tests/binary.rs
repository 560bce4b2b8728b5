//! End-to-end tests of the real `sbp` binary: durability across `kill -9`, an in-flight turn cut
//! by `kill -9`, startup output and files, configuration from env and TOML, graceful SIGTERM,
//! operator API keys, CORS origins and the OpenAPI document (`binary/cors_and_openapi.rs`); the
//! access log (`binary/access_log.rs`); OpenAI's SDKs (`binary/openai_sdks.rs`) and the reference
//! TypeScript client (`binary/refclient.rs`); several processes as replicas of one deployment
//! (`binary/replicas.rs`); PostgreSQL over TLS (`binary/postgres_tls.rs`); federation between
//! gateways and trackers (`binary/federation.rs`) and sessions moving between them with their
//! surface (`binary/federation_migration.rs`). Each test runs its own gateway processes on
//! 127.0.0.1:0 over temp data dirs.

mod support;

#[path = "binary/replicas.rs"]
mod replicas;

#[path = "binary/access_log.rs"]
mod access_log;

#[path = "binary/attach.rs"]
mod attach;
#[path = "binary/attach_tty.rs"]
mod attach_tty;

#[path = "binary/demo.rs"]
mod demo;

#[path = "binary/conformance.rs"]
mod conformance;

#[path = "binary/browser.rs"]
mod browser;

#[path = "binary/refclient.rs"]
mod refclient;

#[path = "binary/cors_and_openapi.rs"]
mod cors_and_openapi;
#[path = "binary/edge.rs"]
mod edge;
#[path = "binary/encryption.rs"]
mod encryption;
#[path = "binary/openai_sdks.rs"]
mod openai_sdks;
#[path = "binary/private_and_bounded.rs"]
mod private_and_bounded;

#[path = "binary/postgres_tls.rs"]
mod postgres_tls;

#[path = "binary/federation_readme.rs"]
mod federation_readme;

#[path = "binary/federation.rs"]
mod federation;

#[path = "binary/federation_migration.rs"]
mod federation_migration;

use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::time::Duration;

use sbp_fake_llm::FakeLlm;
use serde_json::{Value, json};
use support::{Proc, Sbp, WAIT, msg, psql, reply_text, sbp_serve, sbp_serve_in, send};

/// A transcript as (role, content) pairs.
type Transcript = Vec<(String, String)>;

fn pairs(v: &[(&str, &str)]) -> Transcript {
    v.iter()
        .map(|(r, c)| ((*r).to_owned(), (*c).to_owned()))
        .collect()
}

/// Every acknowledged write (an HTTP response received before the kill) survives `kill -9`:
/// sessions, their transcripts in order, and the tether of turns pushed while no surface was
/// attached, which a surface attaching to the restarted gateway drains in order.
#[tokio::test]
async fn acknowledged_writes_survive_kill_9() {
    acknowledged_writes_survive_kill_9_on(&[]).await;
}

/// The same on PostgreSQL (a fresh schema of the test database, dropped afterwards).
#[tokio::test]
async fn acknowledged_writes_survive_kill_9_on_postgres() {
    let base = support::test_database_url();
    let schema = format!("sbp_bin_{}", support::unique_suffix());
    psql(&base, &format!("CREATE SCHEMA {schema}"));
    let url = format!("{base}?options=-c%20search_path%3D{schema}");
    acknowledged_writes_survive_kill_9_on(&["--database", &url]).await;
    psql(&base, &format!("DROP SCHEMA {schema} CASCADE"));
}

async fn acknowledged_writes_survive_kill_9_on(extra: &[&str]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut gw = Sbp::start(dir.path(), extra).await;
    let backend = if extra.is_empty() {
        "sqlite://"
    } else {
        "postgres://"
    };
    assert!(
        gw.banner.contains(&format!("storage {backend}")),
        "{}",
        gw.banner
    );

    // (id, token, expected transcript)
    let mut sessions: Vec<(String, String, Transcript)> = Vec::new();
    for i in 0..3 {
        let first = format!("session {i}: what is {i} + {i}?");
        let (status, token, body) = gw.chat(None, json!([msg("user", &first)])).await;
        assert_eq!(status, 200, "{body}");
        let token = token.expect("a new session's token header");
        let id = body["sbp"]["session_id"]
            .as_str()
            .expect("sbp.session_id")
            .to_owned();
        let reply1 = reply_text(&body);
        assert_eq!(reply1, format!("Echo: {first}"));

        // The second turn resends the whole conversation, as OpenAI clients do.
        let second = format!("session {i}: and times {}?", i + 7);
        let (status, _, body) = gw
            .chat(
                Some(&token),
                json!([
                    msg("user", &first),
                    msg("assistant", &reply1),
                    msg("user", &second)
                ]),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["sbp"]["session_id"], id.as_str());
        assert_eq!(body["sbp"]["step_count"], 2, "{body}");
        let reply2 = reply_text(&body);
        assert_eq!(reply2, format!("Echo: {second}"));
        let transcript = pairs(&[
            ("user", &first),
            ("assistant", &reply1),
            ("user", &second),
            ("assistant", &reply2),
        ]);
        sessions.push((id, token, transcript));
    }

    let (tethered_id, tethered_token) = (sessions[1].0.clone(), sessions[1].1.clone());
    let mut pushed = Vec::new();
    for k in 0..5 {
        let content = format!("background result #{k} for session 1");
        let body = gw.push(&tethered_id, &tethered_token, &content).await;
        assert_eq!(body["delivery"], "tethered", "{body}");
        let seq = body["seq"].as_u64().expect("seq");
        sessions[1].2.push(("assistant".into(), content.clone()));
        pushed.push((seq, content));
    }
    assert!(pushed.windows(2).all(|w| w[0].0 < w[1].0), "{pushed:?}");
    let statuses_before: Vec<Value> = {
        let mut v = Vec::new();
        for (id, token, _) in &sessions {
            v.push(gw.session(id, token).await["status"].clone());
        }
        v
    };

    let status = gw.proc.kill9();
    assert_eq!(status.signal(), Some(9), "killed by SIGKILL: {status}");

    let gw = Sbp::start(dir.path(), extra).await;
    for (n, (id, token, transcript)) in sessions.iter().enumerate() {
        let view = gw.session(id, token).await;
        assert_eq!(view["session_id"], id.as_str(), "{view}");
        assert_eq!(view["status"], statuses_before[n], "{view}");
        assert_eq!(view["step_count"], 2, "{view}");
        assert_eq!(view["message_count"], transcript.len(), "{view}");
        let pending = if *id == tethered_id { 5 } else { 0 };
        assert_eq!(view["tether_turns_pending"], pending, "{view}");
        assert_eq!(gw.messages(id, token).await, *transcript, "session {n}");
    }

    let (ws, attached) = gw.attach(&tethered_id, &tethered_token).await;
    let mut ws = ws;
    assert_eq!(attached["queued_turns"], 5, "{attached}");
    for (index, (seq, content)) in pushed.iter().enumerate() {
        let frame = ws.recv().await;
        assert_eq!(frame["type"], "TETHER_TURN", "{frame}");
        assert_eq!(frame["turn_index"], index, "{frame}");
        assert_eq!(frame["role"], "assistant", "{frame}");
        assert_eq!(frame["content"], content.as_str(), "{frame}");
        assert_eq!(frame["seq"], *seq, "{frame}");
    }
    ws.close().await;

    // A session with an empty tether attaches with nothing queued.
    let (ws, attached) = gw.attach(&sessions[0].0, &sessions[0].1).await;
    assert_eq!(attached["queued_turns"], 0, "{attached}");
    ws.close().await;
}

/// A turn whose upstream call is in flight when the gateway is killed: after restart its user
/// message is there (begin_turn committed before the call), no reply was invented for it, and
/// the session takes the next turn with the full durable history sent upstream.
#[tokio::test]
async fn turn_in_flight_at_kill_9_leaves_session_usable() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let base = fake.base_url();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut gw = Sbp::start(dir.path(), &["--llm-base-url", &base]).await;
    assert!(gw.banner.contains(&base), "{}", gw.banner);

    let first = "first question";
    let (status, token, body) = gw.chat(None, json!([msg("user", first)])).await;
    assert_eq!(status, 200, "{body}");
    let token = token.expect("session token");
    let id = body["sbp"]["session_id"].as_str().expect("id").to_owned();
    let reply1 = reply_text(&body);
    assert_eq!(reply1, format!("echo: {first}"));

    let slow = "a long question [[fake:slow=5000]]";
    let history = json!([
        msg("user", first),
        msg("assistant", &reply1),
        msg("user", slow)
    ]);
    let in_flight = tokio::spawn({
        let req = gw
            .post(
                "/v1/chat/completions",
                &json!({"model": "gpt-test", "messages": history}),
            )
            .header("x-session-token", &token);
        async move { req.send().await.map(|r| r.status().as_u16()) }
    });
    let seen = tokio::time::timeout(WAIT, fake.wait_for_requests(2))
        .await
        .expect("the slow request reaches the upstream");
    assert_eq!(seen[1]["messages"][2]["content"], slow);

    let status = gw.proc.kill9();
    assert_eq!(status.signal(), Some(9), "{status}");
    let answer = tokio::time::timeout(WAIT, in_flight)
        .await
        .expect("the caller learns of the kill")
        .expect("task");
    assert!(
        answer.is_err(),
        "the interrupted turn was never answered, got {answer:?}"
    );

    let gw = Sbp::start(dir.path(), &["--llm-base-url", &base]).await;
    let view = gw.session(&id, &token).await;
    assert_eq!(view["step_count"], 1, "{view}");
    assert_eq!(
        gw.messages(&id, &token).await,
        pairs(&[("user", first), ("assistant", &reply1), ("user", slow)]),
        "the interrupted turn's user message is kept, without a reply"
    );

    let next = "are you still there?";
    let (status, _, body) = gw.chat(Some(&token), json!([msg("user", next)])).await;
    assert_eq!(status, 200, "the session is not stuck: {body}");
    assert_eq!(body["sbp"]["session_id"], id.as_str());
    let reply2 = reply_text(&body);
    assert_eq!(reply2, format!("echo: {next}"));
    let upstream = fake.requests();
    assert_eq!(upstream.len(), 3, "one more upstream call after restart");
    let sent: Transcript = upstream[2]["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(support::role_content)
        .collect();
    assert_eq!(
        sent,
        pairs(&[
            ("user", first),
            ("assistant", &reply1),
            ("user", slow),
            ("user", next)
        ]),
        "the upstream gets the durable history"
    );

    let view = gw.session(&id, &token).await;
    assert_eq!(view["step_count"], 2, "{view}");
    assert_eq!(view["status"], "running", "{view}");
    assert_eq!(
        gw.messages(&id, &token).await,
        pairs(&[
            ("user", first),
            ("assistant", &reply1),
            ("user", slow),
            ("user", next),
            ("assistant", &reply2)
        ])
    );
}

/// The startup line says where the gateway listens and how to use a real LLM; the data dir gets
/// the database and a private signing secret that is kept across restarts and never printed;
/// /healthz and /metrics answer.
#[tokio::test]
async fn startup_line_files_secret_health_and_metrics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = sbp_serve_in(dir.path(), &[]);
    // Debug logs make the "never printed" check cover as much output as possible.
    cmd.env("SBP_LOG", "debug");
    let mut gw = Sbp::spawn(cmd).await;
    assert!(
        gw.banner
            .starts_with(&format!("sbp gateway listening on {}", gw.url)),
        "{}",
        gw.banner
    );
    assert!(gw.banner.contains("--llm-base-url"), "{}", gw.banner);
    assert!(gw.banner.contains("sbp.db"), "{}", gw.banner);

    let db = dir.path().join("sbp.db");
    let secret_path = dir.path().join("secret");
    assert!(db.is_file(), "{} exists", db.display());
    let secret = std::fs::read_to_string(&secret_path).expect("secret file");
    let secret = secret.trim().to_owned();
    assert!(secret.len() >= 43, "at least 32 bytes of base64: {secret}");
    let mode = std::fs::metadata(&secret_path)
        .expect("secret metadata")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "secret mode {mode:o}");

    let (status, _, body) = send(gw.get("/healthz")).await;
    assert_eq!(status, 200);
    assert_eq!(body["status"], "ok", "{body}");

    let (status, _, body) = gw.chat(None, json!([msg("user", "count me")])).await;
    assert_eq!(status, 200, "{body}");
    let text = gw.metrics().await;
    for name in [
        "sbp_sessions",
        "sbp_turns_total",
        "sbp_attached_surfaces",
        "sbp_tether_depth",
        "sbp_upstream_latency_seconds_bucket",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(name)),
            "{name} in /metrics:\n{text}"
        );
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("sbp_sessions{status=\"running\"} 1")),
        "the new session is counted:\n{text}"
    );

    gw.proc.kill9();
    let (out, err) = gw.proc.output();
    assert!(!err.is_empty(), "the gateway logged to stderr");
    assert!(!out.contains(&secret) && !err.contains(&secret));

    let mut cmd = sbp_serve_in(dir.path(), &[]);
    cmd.env("SBP_LOG", "debug");
    let mut gw = Sbp::spawn(cmd).await;
    let (status, _, _) = send(gw.get("/healthz")).await;
    assert_eq!(status, 200);
    let again = std::fs::read_to_string(&secret_path).expect("secret file");
    assert_eq!(again.trim(), secret, "the secret is kept across restarts");
    gw.proc.kill9();
    let (out, err) = gw.proc.output();
    assert!(!out.contains(&secret) && !err.contains(&secret));
}

/// Options come from `SBP_*` environment variables and from a TOML file; SIGTERM stops the
/// gateway cleanly with exit status 0.
#[tokio::test]
async fn env_and_toml_config_and_sigterm_exits_cleanly() {
    // Environment only: no flags at all.
    let env_dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = sbp_serve();
    cmd.env("SBP_LISTEN", "127.0.0.1:0")
        .env("SBP_DATA_DIR", env_dir.path())
        .env("SBP_API_KEYS", "env-key-1,env-key-2");
    let mut gw = Sbp::spawn(cmd).await;
    assert!(env_dir.path().join("sbp.db").is_file());
    assert!(env_dir.path().join("secret").is_file());
    let (status, _, _) = send(gw.get("/metrics")).await;
    assert_eq!(status, 401, "SBP_API_KEYS is applied");
    let (status, _, _) = send(gw.get("/metrics").bearer_auth("env-key-2")).await;
    assert_eq!(status, 200);
    gw.proc.sigterm();
    let status = gw.proc.wait_exit(Duration::from_secs(5)).await;
    assert_eq!(status.code(), Some(0), "SIGTERM exits 0: {status}");
    let (_, err) = gw.proc.output();
    assert!(err.contains("gateway stopped"), "{err}");

    // A TOML file only.
    let toml_dir = tempfile::tempdir().expect("tempdir");
    let data_dir = toml_dir.path().join("data");
    let file = toml_dir.path().join("sbp.toml");
    std::fs::write(
        &file,
        format!(
            "listen = \"127.0.0.1:0\"\ndata_dir = {}\napi_keys = [\"file-key\"]\n",
            toml::Value::String(data_dir.display().to_string())
        ),
    )
    .expect("write config");
    let mut cmd = sbp_serve();
    cmd.arg("--config").arg(&file);
    let mut gw = Sbp::spawn(cmd).await;
    assert!(data_dir.join("sbp.db").is_file(), "data_dir from the file");
    let (status, _, body) = send(
        gw.post(
            "/v1/chat/completions",
            &json!({"messages": [msg("user", "configured by file")]}),
        )
        .bearer_auth("file-key"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(reply_text(&body), "Echo: configured by file");
    gw.proc.sigterm();
    let status = gw.proc.wait_exit(Duration::from_secs(5)).await;
    assert_eq!(status.code(), Some(0), "SIGTERM exits 0: {status}");
}

/// A bad option stops the binary before it listens, with a non-zero status and a message that
/// names the problem.
#[tokio::test]
async fn bad_options_exit_non_zero_with_a_clear_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad_toml = dir.path().join("bad.toml");
    std::fs::write(&bad_toml, "listen = \"127.0.0.1:0\"\nno_such_option = 1\n").expect("write");
    let bad_toml = bad_toml.display().to_string();
    // (flags, environment, what stderr must say)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 9] = [
        (
            &["--database", "mysql://x"],
            &[],
            "--database must look like sqlite://PATH",
        ),
        (
            &["--jwt-secret", "short"],
            &[],
            "--jwt-secret must be at least 32 bytes",
        ),
        (
            &["--sqlite-synchronous", "sometimes"],
            &[],
            "--sqlite-synchronous must be full or normal",
        ),
        (
            &[],
            &[("SBP_PING_INTERVAL", "-1")],
            "--ping-interval must be a positive number",
        ),
        (&["--config", &bad_toml], &[], "no_such_option"),
        (&["--ctp", "iot"], &[], "must be DEVICE_TYPE=MODEL"),
        (
            &["--max-tool-rounds", "100"],
            &[],
            "--max-tool-rounds must be at most 64",
        ),
        (
            &["--mcp-server", "no-equals-sign"],
            &[],
            "--mcp-server 'no-equals-sign'",
        ),
        (
            &["--llm-base-url", "notaurl"],
            &[],
            "--llm-base-url must be an absolute http(s) URL",
        ),
    ];
    for (args, envs, expected) in cases {
        let mut cmd = sbp_serve_in(dir.path(), args);
        cmd.envs(envs.iter().copied());
        let mut proc = Proc::spawn(cmd);
        let status = proc.wait_exit(WAIT).await;
        let (out, err) = proc.output();
        assert!(
            status.code().is_some_and(|c| c != 0),
            "{args:?} {envs:?}: exit {status}, stderr:\n{err}"
        );
        assert!(
            err.contains(expected),
            "{args:?} {envs:?}: stderr should say '{expected}':\n{err}"
        );
        assert!(!out.contains("listening"), "{args:?}: {out}");
    }
}

/// With operator API keys, every endpoint but /healthz needs `Authorization: Bearer <key>`;
/// any configured key works, and the refusal uses the SBP error envelope.
#[tokio::test]
async fn operator_api_keys_guard_the_api() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &["--api-key", "k1", "--api-key", "k2"]).await;
    let body = json!({"model": "sbp/echo", "messages": [msg("user", "let me in")]});

    for req in [
        gw.post("/v1/chat/completions", &body),
        gw.post("/v1/chat/completions", &body).bearer_auth("k3"),
        gw.post("/v1/chat/completions", &body)
            .header("authorization", "k2"),
    ] {
        let (status, _, err) = send(req).await;
        assert_eq!(status, 401, "{err}");
        assert_eq!(err["error"]["code"], "SBP_UNAUTHORIZED", "{err}");
        assert!(err["error"]["message"].is_string(), "{err}");
    }
    let (status, _, _) = send(gw.get("/metrics")).await;
    assert_eq!(status, 401, "/metrics is guarded too");

    let (status, headers, reply) =
        send(gw.post("/v1/chat/completions", &body).bearer_auth("k2")).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply_text(&reply), "Echo: let me in");
    assert!(headers.contains_key("x-session-token"));
    let id = reply["sbp"]["session_id"].as_str().expect("id");
    // The operator key alone is enough to read any session.
    let (status, _, view) = send(gw.get(&format!("/v1/sessions/{id}")).bearer_auth("k1")).await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["step_count"], 1, "{view}");

    let (status, _, health) = send(gw.get("/healthz")).await;
    assert_eq!(status, 200, "{health}");
    assert_eq!(health["status"], "ok");
}

/// `--public-url` and `--rate-limit-*` reach the gateway: the public name is accepted as `Host`
/// and its origin as `Origin` (other names are refused), and the address limit answers 429 with
/// `Retry-After` once used up.
#[tokio::test]
async fn public_url_and_rate_limit_flags() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(
        dir.path(),
        &[
            "--public-url",
            "https://gw.example.com",
            "--rate-limit-ip",
            "1/h,3",
            "--rate-limit-auth-failures",
            "0",
        ],
    )
    .await;
    let (status, _, v) = send(
        gw.post("/v1/sessions", &json!({}))
            .header("host", "gw.example.com")
            .header("origin", "https://gw.example.com"),
    )
    .await;
    assert_eq!(status, 201, "{v}");
    let (status, _, v) = send(
        gw.post("/v1/sessions", &json!({}))
            .header("host", "evil.example"),
    )
    .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (403, Some("SBP_FORBIDDEN")),
        "{v}"
    );
    let (status, _, v) = send(gw.post("/v1/sessions", &json!({}))).await;
    assert_eq!(status, 201, "{v}");
    let (status, _, v) = send(gw.post("/v1/sessions", &json!({}))).await;
    assert_eq!(status, 201, "{v}");
    let (status, headers, v) = send(gw.post("/v1/sessions", &json!({}))).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (429, Some("SBP_RATE_LIMITED")),
        "{v}"
    );
    assert!(headers.contains_key("retry-after"), "{headers:?}");
}

/// The L4/L5 flags reach the gateway: `claude*` models go to the Anthropic Messages API, a
/// southbound stdio MCP server's tools are offered to the model and called by the gateway, the tool
/// allowlist filters what a surface registers, and the MCP server's process goes away with the
/// gateway.
#[tokio::test]
async fn anthropic_route_southbound_mcp_and_tool_allowlist_flags() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let base = fake.base_url();
    let dir = tempfile::tempdir().expect("tempdir");
    let fixture = format!(
        "{}/../sbp-mcp/tests/fixtures/stdio_server.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let server = format!("calc=stdio:python3 '{fixture}'");
    let gw = Sbp::start(
        dir.path(),
        &[
            "--llm-base-url",
            &base,
            "--anthropic-base-url",
            &base,
            "--anthropic-api-key",
            "test-key",
            "--mcp-server",
            &server,
            "--tool-allow",
            "gps",
        ],
    )
    .await;
    assert!(gw.banner.contains("via Anthropic"), "{}", gw.banner);

    let (status, token, body) = gw.chat(None, json!([msg("user", "hello")])).await;
    assert_eq!(status, 200, "{body}");
    let token = token.expect("token");
    let id = body["sbp"]["session_id"].as_str().expect("id").to_owned();
    let (status, _, body) = send(
        gw.post(
            "/v1/chat/completions",
            &json!({"model": "claude-test", "messages": [
                msg("user", "sum please [[fake:tool=mcp__calc__add:{\"a\":2,\"b\":3}]]")]}),
        )
        .header("x-session-token", &token),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(reply_text(&body), "tool result: 5");
    let requests = fake.requests();
    let anthropic: Vec<&Value> = requests
        .iter()
        .filter(|r| r["model"] == "claude-test")
        .collect();
    assert_eq!(
        anthropic.len(),
        2,
        "a tool round and the answer: {requests:?}"
    );
    assert!(
        anthropic[0]["tools"].as_array().is_some_and(|t| t
            .iter()
            .any(|t| t["name"] == "mcp__calc__add" && t["input_schema"].is_object())),
        "{}",
        anthropic[0]
    );
    assert!(gw.metrics().await.contains("sbp_server_tool_calls_total 1"));

    let mut ws = gw.connect(&id).await;
    ws.send(
        json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token,
                   "surface_context": {"device_type": "mobile", "mcp_tools": ["gps", "camera"]}}),
    )
    .await;
    let attached = ws.recv().await;
    assert_eq!(
        attached["mcp_tools_registered"],
        json!(["gps"]),
        "{attached}"
    );
    assert_eq!(attached["sbp_level"], "L5");

    let mut gw = gw;
    gw.proc.sigterm();
    let status = gw.proc.wait_exit(WAIT).await;
    assert_eq!(status.code(), Some(0), "{status}");
    let still_running = std::process::Command::new("pgrep")
        .args(["-f", &fixture])
        .output()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    assert!(!still_running, "the MCP server stopped with the gateway");
}

/// `kill -9` in the middle of a tool-using turn, after its tool round was recorded and while the
/// model is writing the answer: after the restart the round is there whole (the call and its
/// result, never one without the other), the interrupted turn is not left running, and the next
/// turn sends the model a valid history.
#[tokio::test]
async fn kill_9_after_a_tool_round_keeps_the_round_whole() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let base = fake.base_url();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut gw = Sbp::start(dir.path(), &["--llm-base-url", &base]).await;
    let (status, token, body) = gw.chat(None, json!([msg("user", "hello")])).await;
    assert_eq!(status, 200, "{body}");
    let token = token.expect("token");
    let id = body["sbp"]["session_id"].as_str().expect("id").to_owned();

    let mut ws = gw.connect(&id).await;
    ws.send(
        json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token,
                   "surface_context": {"device_type": "mobile", "mcp_tools": ["gps"]}}),
    )
    .await;
    assert_eq!(ws.recv().await["type"], "SESSION_ATTACHED");

    // Every upstream request of this turn takes 3 s: the kill lands while the answer is awaited.
    let ask = "where am I? [[fake:tool=surface_gps]] [[fake:slow=3000]]";
    let in_flight = tokio::spawn({
        let req = gw
            .post(
                "/v1/chat/completions",
                &json!({"model": "gpt-test", "messages": [msg("user", ask)]}),
            )
            .header("x-session-token", &token);
        async move { req.send().await.map(|r| r.status().as_u16()) }
    });
    let call = ws.recv().await;
    assert_eq!(call["type"], "TOOL_CALL", "{call}");
    ws.send(json!({"type": "TOOL_RESULT", "call_id": call["call_id"], "result": {"lat": 35.68}}))
        .await;
    // The round is recorded (5 messages) and the model has the second request.
    let deadline = tokio::time::Instant::now() + WAIT;
    while gw.messages(&id, &token).await.len() < 5 || fake.requests().len() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the round was recorded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = gw.proc.kill9();
    assert_eq!(status.signal(), Some(9), "{status}");
    let answer = tokio::time::timeout(WAIT, in_flight)
        .await
        .expect("the caller learns of the kill")
        .expect("task");
    assert!(answer.is_err(), "never answered: {answer:?}");

    let gw = Sbp::start(dir.path(), &["--llm-base-url", &base]).await;
    let stored = gw.messages(&id, &token).await;
    let roles: Vec<&str> = stored.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(
        roles,
        ["user", "assistant", "user", "assistant", "tool"],
        "{stored:?}"
    );
    assert_eq!(stored[4].1, "{\"lat\":35.68}");
    let view = gw.session(&id, &token).await;
    assert_eq!(
        view["step_count"], 1,
        "the interrupted turn is not a step: {view}"
    );

    let (status, _, body) = gw
        .chat(Some(&token), json!([msg("user", "still there?")]))
        .await;
    assert_eq!(status, 200, "the session is usable: {body}");
    let sent = fake.requests().pop().expect("request");
    let sent_roles: Vec<&str> = sent["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|m| m["role"].as_str())
        .collect();
    assert_eq!(
        sent_roles,
        ["user", "assistant", "user", "assistant", "tool", "user"],
        "the call and its result reach the model together: {sent}"
    );
}

/// With an upstream and an Anthropic route, `GET /v1/models` lists the upstream's models, the
/// route's under the names callers use, and the built-in `sbp/echo`, which still answers by
/// itself beside the upstream.
#[tokio::test]
async fn models_list_the_upstreams_the_routes_and_the_built_in() {
    let fake = FakeLlm::start().await.expect("fake upstream");
    let base = fake.base_url();
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(
        dir.path(),
        &[
            "--llm-base-url",
            &base,
            "--anthropic-base-url",
            &base,
            "--anthropic-api-key",
            "test-key",
        ],
    )
    .await;
    let (status, _, list) = send(gw.get("/v1/models")).await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["object"], "list", "{list}");
    let mut ids: Vec<&str> = list["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, vec!["anthropic/fake", "fake", "sbp/echo"], "{list}");
    for id in ["sbp/echo", "anthropic/fake"] {
        let (status, _, model) = send(gw.get(&format!("/v1/models/{id}"))).await;
        assert_eq!(status, 200, "{model}");
        assert_eq!(model["id"], id, "{model}");
    }

    let asked = fake.requests().len();
    let (status, _, body) = send(gw.post(
        "/v1/chat/completions",
        &json!({"model": "sbp/echo", "messages": [msg("user", "who answers?")]}),
    ))
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["content"], "Echo: who answers?",
        "{body}"
    );
    assert_eq!(fake.requests().len(), asked, "the upstream was not asked");
    let (status, _, body) = gw.chat(None, json!([msg("user", "and now?")])).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        fake.requests().len(),
        asked + 1,
        "the upstream answers the rest"
    );
}
