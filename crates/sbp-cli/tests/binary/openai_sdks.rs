//! OpenAI's official SDKs (Python and Node, versions pinned in `tests/sdk/`) against the real
//! `sbp serve` with the fake upstream, changing only the base URL: completions, the streaming loop
//! of OpenAI's docs, usage with `include_usage`, a session token as `api_key`, a suspended session
//! raised and not retried (then resumed by the opt-in header), an upstream 404 in the upstream's
//! words, refused requests naming their field, and the model list. The scripts live in
//! `tests/sdk/`; `scripts/sdk-deps.sh` (run by `scripts/test.sh`) installs the SDKs.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use sbp_fake_llm::FakeLlm;

use crate::support::Sbp;

const LIMIT: Duration = Duration::from_secs(120);

fn sdk_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/sdk");
    dir.canonicalize().unwrap_or(dir)
}

/// Runs one SDK script against a fresh gateway; returns the scenarios it reported `ok`.
async fn run(program: &Path, script: &str) -> Vec<String> {
    let hint = "`bash scripts/test.sh` installs the SDKs (scripts/sdk-deps.sh)";
    assert!(
        !program.is_absolute() || program.exists(),
        "{} is missing: {hint}",
        program.display()
    );
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &["--llm-base-url", &fake.base_url()]).await;
    let child = tokio::process::Command::new(program)
        .arg(sdk_dir().join(script))
        .arg(&gw.url)
        .current_dir(sdk_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("running {}: {e} ({hint})", program.display()));
    let out = tokio::time::timeout(LIMIT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{script} did not finish within {LIMIT:?}"))
        .expect("script output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{stdout}\n{stderr}\ngateway stderr:\n{}",
        out.status,
        gw.proc.stderr()
    );
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("ok "))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn the_python_sdk_works_unchanged() {
    let python = sdk_dir().join(".venv/bin/python");
    let done = run(&python, "openai_python.py").await;
    assert_eq!(
        done,
        [
            "create",
            "stream_loop",
            "stream_usage",
            "session_token_as_api_key",
            "suspended_session",
            "upstream_error",
            "refused_requests",
            "no_orphan_sessions",
            "models",
        ]
    );
}

#[tokio::test]
async fn the_node_sdk_works_unchanged() {
    let done = run(Path::new("node"), "openai_node.mjs").await;
    assert_eq!(
        done,
        [
            "streamLoop",
            "streamUsage",
            "sessionTokenAsApiKey",
            "suspendedSession",
            "upstreamError",
            "models",
        ]
    );
}
