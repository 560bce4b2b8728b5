//! The protocol's reference TypeScript client (`shared/sbp-spec/reference-client-typescript`,
//! beside the repository, not part of it) against the real `sbp serve`: the client's sources are
//! copied to a temp dir and compiled there with the TypeScript of `tests/refclient/` (installed
//! by scripts/browser-deps.sh), then `tests/refclient/drive.mjs` runs it through its public API
//! (tethered turns, a tool call answered by its MCPBridge, a streamed turn, the refusals).
//! Without the spec checkout (a clone elsewhere) the test says so and passes.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use sbp_fake_llm::FakeLlm;
use serde_json::{Value, json};

use crate::support::{Sbp, msg, reply_text, send};

/// The whole run: compiling the client and driving it (the script also limits itself).
const LIMIT: Duration = Duration::from_secs(120);

fn repo_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The reference client's sources, when the spec checkout is beside the repository.
fn reference_client() -> Option<PathBuf> {
    let dir = repo_dir().join("../shared/sbp-spec/reference-client-typescript");
    dir.join("src/client.ts")
        .is_file()
        .then(|| dir.canonicalize().unwrap_or(dir))
}

fn tooling_dir() -> PathBuf {
    let dir = repo_dir().join("tests/refclient");
    dir.canonicalize().unwrap_or(dir)
}

/// Runs `cmd` to its end within the limit; fails with its output unless it succeeded.
async fn run(what: &str, cmd: &mut tokio::process::Command) -> String {
    cmd.stdin(Stdio::null()).kill_on_drop(true);
    let out = tokio::time::timeout(LIMIT, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{what}: still running after {LIMIT:?}"))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({})\n--- stdout\n{stdout}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Copies the client's sources into `dir` and compiles them with `tsc` from `tests/refclient`
/// (the client's own tsconfig); returns the directory of the compiled modules.
async fn compile_client(src: &Path, dir: &Path) -> PathBuf {
    let tsc = tooling_dir().join("node_modules/typescript/bin/tsc");
    assert!(
        tsc.is_file(),
        "{} is missing: `bash scripts/test.sh` installs it (scripts/browser-deps.sh: \
         `npm ci --prefix tests/refclient`)",
        tsc.display()
    );
    let package: Value = serde_json::from_slice(
        &std::fs::read(src.join("package.json")).expect("the client's package.json"),
    )
    .expect("the client's package.json is JSON");
    // Its devDependencies are build and test tools (tsup, vitest) this test does not use; a
    // runtime dependency would have to be installed for the compiled client to load.
    assert!(
        package["dependencies"]
            .as_object()
            .is_none_or(|d| d.is_empty()),
        "the reference client now has runtime dependencies, which this test does not install: {}",
        package["dependencies"]
    );
    std::fs::create_dir_all(dir.join("src")).expect("mkdir src");
    for entry in std::fs::read_dir(src.join("src")).expect("the client's src/") {
        let path = entry.expect("dir entry").path();
        if path.extension().is_some_and(|e| e == "ts") {
            let name = path.file_name().expect("file name");
            std::fs::copy(&path, dir.join("src").join(name)).expect("copy a source");
        }
    }
    for file in ["tsconfig.json", "package.json"] {
        std::fs::copy(src.join(file), dir.join(file)).expect("copy a config file");
    }
    run(
        "tsc",
        tokio::process::Command::new("node")
            .arg(&tsc)
            .args(["-p", "tsconfig.json"])
            .current_dir(dir),
    )
    .await;
    let dist = dir.join("dist");
    assert!(
        dist.join("index.js").is_file(),
        "tsc wrote no dist/index.js"
    );
    // The output is ES modules (`"module": "ESNext"`), which node loads as such only when told.
    std::fs::write(dist.join("package.json"), "{\"type\": \"module\"}\n").expect("write");
    dist
}

/// `node`, with the flag that gives it a global WebSocket where it is not on by default (20, 21).
async fn node() -> tokio::process::Command {
    let global = tokio::process::Command::new("node")
        .args([
            "-e",
            "process.exit(typeof WebSocket === 'function' ? 0 : 1)",
        ])
        .status()
        .await
        .is_ok_and(|s| s.success());
    let mut cmd = tokio::process::Command::new("node");
    if !global {
        cmd.arg("--experimental-websocket");
    }
    cmd
}

fn text<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer} in {v}"))
}

/// Everything the reference client reads from the gateway's frames is there (tethered turns'
/// `turn.role/content/model_used`, chunks' `chunk/step/model`, TURN_COMPLETE's
/// `step/model/cost_usd`, the refusals' `session_id` and `detail`), and what it sends
/// (ATTACH_SESSION with `mcp_tools`, TOOL_RESULT) reaches the gateway.
#[tokio::test]
async fn the_reference_typescript_client_works_unchanged() {
    let Some(src) = reference_client() else {
        eprintln!(
            "skipped: the reference client is not at {} (the spec checkout beside the repository)",
            repo_dir()
                .join("../shared/sbp-spec/reference-client-typescript")
                .display()
        );
        return;
    };
    let build = tempfile::tempdir().expect("tempdir");
    let dist = compile_client(&src, build.path()).await;

    let fake = FakeLlm::start().await.expect("fake upstream");
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &["--llm-base-url", &fake.base_url()]).await;
    let model = "gpt-test";
    let (status, headers, first) = send(gw.post(
        "/v1/chat/completions",
        &json!({"model": model, "messages": [msg("user", "hello")]}),
    ))
    .await;
    assert_eq!(status, 200, "{first}");
    let token = headers["x-session-token"]
        .to_str()
        .expect("token")
        .to_owned();
    let id = text(&first, "/sbp/session_id").to_owned();
    // Two turns pushed while no surface is attached: the attach drains them.
    let pushed = [
        ("Your report is ready.", Value::from("gpt-4o")),
        ("The build finished.", Value::Null),
    ];
    for (content, model_used) in &pushed {
        let (status, _, body) = send(
            gw.post(
                &format!("/v1/sbp/sessions/{id}/turns"),
                &json!({"content": content, "model_used": model_used}),
            )
            .header("x-session-token", &token),
        )
        .await;
        assert_eq!(status, 201, "{body}");
    }

    let prompt = "where am I? [[fake:tool=surface_gps:{\"accuracy\":\"high\"}]] [[fake:chunks=3]]";
    let mut cmd = node().await;
    cmd.arg(tooling_dir().join("drive.mjs"))
        .current_dir(tooling_dir())
        .env("SBP_CLIENT_DIST", &dist)
        .env("SBP_GATEWAY_URL", &gw.url)
        .env("SBP_SESSION_ID", &id)
        .env("SBP_SESSION_TOKEN", &token)
        .env("SBP_PROMPT", prompt)
        .env("SBP_MODEL", model);
    let stdout = run("node drive.mjs", &mut cmd).await;
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line:\n{stdout}"));
    let seen: Value = serde_json::from_str(line).expect("RESULT is JSON");

    assert_eq!(seen["errors"], json!([]), "{seen}");
    assert_eq!(
        seen["attached"],
        json!({"queued_turns": 2, "mcp_tools_registered": ["gps"]}),
        "{seen}"
    );
    // The README's `tether_turn` handler got each turn, with its role, content and model.
    assert_eq!(
        seen["tether_turns"],
        json!([
            {"role": "assistant", "content": pushed[0].0, "model_used": "gpt-4o"},
            {"role": "assistant", "content": pushed[1].0, "model_used": null},
        ]),
        "{seen}"
    );

    // The tool call went to the client's MCPBridge, and its TOOL_RESULT back to the turn.
    assert_eq!(
        seen["tool_calls"],
        json!([{"name": "gps", "input": {"accuracy": "high"}}]),
        "{seen}"
    );
    let completion = &seen["completion"];
    assert_eq!(completion["status"], 200, "{seen}");
    let body = &completion["body"];
    let reply = reply_text(body);
    let transcript = gw.messages(&id, &token).await;
    let tool = transcript
        .iter()
        .find(|(role, _)| role == "tool")
        .unwrap_or_else(|| panic!("no tool message: {transcript:?}"));
    let result: Value = serde_json::from_str(&tool.1).expect("the tool result is JSON");
    assert_eq!(
        result,
        json!({"lat": 35.68, "lon": 139.76, "accuracy": "high"})
    );
    assert!(reply.contains("35.68"), "the model saw the result: {reply}");

    // The reply streamed to the client's `chunk` handler, each with its step and model, then
    // its `turn_complete` (no cost: the gateway does not price turns).
    let step = body["sbp"]["step_count"].as_u64().expect("step_count");
    assert_eq!(step, 2, "{body}");
    let routed = text(body, "/sbp/model_routed_to");
    let chunks = seen["chunks"].as_array().expect("chunks");
    assert!(chunks.len() >= 2, "the reply streamed: {seen}");
    for c in chunks {
        assert_eq!(
            (&c["step"], &c["model"]),
            (&json!(step), &json!(routed)),
            "{c}"
        );
    }
    let streamed: String = chunks
        .iter()
        .map(|c| c["chunk"].as_str().expect("chunk text"))
        .collect();
    assert_eq!(streamed, reply, "{seen}");
    assert_eq!(
        seen["completes"],
        json!([{"step": step, "model": routed, "cost_usd": null}]),
        "{seen}"
    );
    // `ready` after the reply (the attach announced turns, so not then).
    assert_eq!(seen["readies"], 1, "{seen}");
    let view = gw.session(&id, &token).await;
    assert_eq!(view["tether_turns_pending"], 0, "{view}");

    // The refusals reach connect()'s rejection with the fields the client prints.
    let unknown = text(&seen, "/not_found/session_id");
    assert_eq!(
        text(&seen, "/not_found/message"),
        format!("SBP: session not found — {unknown}"),
        "{seen}"
    );
    let forbidden = text(&seen, "/forbidden/message");
    assert!(
        forbidden.starts_with("SBP: forbidden — ") && !forbidden.contains("undefined"),
        "{forbidden}"
    );
}
