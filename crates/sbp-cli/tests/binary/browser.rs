//! End-to-end tests of the browser surface page in headless Chromium: the real `sbp serve`, and a
//! Node script of `tests/browser/` driving Debian's Chromium through playwright-core against it
//! (a reply streamed, Markdown rendered without running anything, a turn pushed while the
//! connection was cut shown exactly once, a reply cut mid-stream completed once, a joined session's
//! earlier conversation read from its transcript, tool calls behind the permission prompt,
//! operator keys).
//! Each script exits non-zero on failure; screenshots stay in
//! `target/browser-artifacts/<test>/`. Plus the page's headers, checked without a browser.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use sbp_fake_llm::FakeLlm;
use serde_json::Value;

use crate::support::{Sbp, send};

/// The browser tests run one at a time: each starts a Chromium, and the machine has two cores.
static BROWSER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A whole scenario, Chromium's start included (each script also limits itself).
const SCENARIO_LIMIT: Duration = Duration::from_secs(150);

const CHROMIUM: &str = "/usr/bin/chromium";

/// The page's Content-Security-Policy: scripts and styles from the gateway only, nothing inline.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn browser_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/browser");
    dir.canonicalize().unwrap_or(dir)
}

/// Chromium, node and playwright-core must be installed: a missing one fails the test (a
/// browser test that passes without a browser would prove nothing).
fn require_browser() {
    let hint = "`bash scripts/test.sh` installs them (scripts/browser-deps.sh: Debian's chromium, \
                node, and `npm ci --prefix tests/browser`)";
    assert!(
        Path::new(CHROMIUM).is_file(),
        "{CHROMIUM} is missing: {hint}"
    );
    let playwright = browser_dir().join("node_modules/playwright-core/package.json");
    assert!(
        playwright.is_file(),
        "{} is missing: {hint}",
        playwright.display()
    );
    let node = std::process::Command::new("node")
        .arg("--version")
        .output()
        .map(|o| o.status.success());
    assert!(matches!(node, Ok(true)), "node does not run: {hint}");
}

/// `target/browser-artifacts/<test>/`, emptied.
fn artifact_dir(test: &str) -> PathBuf {
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target dir above target/tmp")
        .to_path_buf();
    let dir = target.join("browser-artifacts").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the artifact dir");
    dir
}

/// The last `n` characters of `text`.
fn tail(text: &str, n: usize) -> &str {
    let start = text.len().saturating_sub(n);
    let start = (start..=text.len())
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(text.len());
    &text[start..]
}

/// Runs `node tests/browser/<script>` against `gw` and returns the JSON of its `RESULT` line;
/// fails with the script's output, the gateway's log and where the screenshots are when the
/// script fails.
async fn scenario(script: &str, test: &str, gw: &Sbp, env: &[(&str, &str)]) -> Value {
    require_browser();
    let artifacts = artifact_dir(test);
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg(browser_dir().join(script))
        .current_dir(browser_dir())
        .env("SBP_GATEWAY_URL", &gw.url)
        .env("SBP_ARTIFACT_DIR", &artifacts)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let started = Instant::now();
    let out = tokio::time::timeout(SCENARIO_LIMIT, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("node {script} still running after {SCENARIO_LIMIT:?}"))
        .expect("run node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "node {script} failed ({}) after {:?}; screenshots and the browser console in {}\n\
         --- stdout\n{stdout}\n--- stderr\n{stderr}\n--- gateway stderr (tail)\n{}",
        out.status,
        started.elapsed(),
        artifacts.display(),
        tail(&gw.proc.stderr(), 4000),
    );
    let shots = std::fs::read_dir(&artifacts)
        .expect("the artifact dir")
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "png"))
        .count();
    assert!(shots > 0, "no screenshot in {}", artifacts.display());
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line from {script}:\n{stdout}"));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("bad RESULT from {script} ({e}): {line}"))
}

fn str_field<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or_else(|| panic!("no {key} in {v}"))
}

/// The gateway's view of a session (`GET /v1/sessions/{id}` with its token).
async fn session_view(gw: &Sbp, result: &Value) -> Value {
    gw.session(
        str_field(result, "session_id"),
        str_field(result, "session_token"),
    )
    .await
}

/// Scenario 1: a session created in the page, a message sent from it, the echo streamed back
/// (at least two TURN_CHUNKs before TURN_COMPLETE) and shown once; the page ACKed it.
#[tokio::test]
async fn browser_page_streams_a_reply() {
    let _one = BROWSER.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let result = scenario("chat.mjs", "browser_page_streams_a_reply", &gw, &[]).await;
    assert!(
        result["chunks"].as_u64().is_some_and(|n| n >= 2),
        "{result}"
    );
    let id = str_field(&result, "session_id");
    let token = str_field(&result, "session_token");
    let transcript = gw.messages(id, token).await;
    let message = "Plan a three-day trip to Lisbon with museums and good coffee";
    assert_eq!(
        transcript,
        [
            ("user".to_owned(), message.to_owned()),
            ("assistant".to_owned(), format!("Echo: {message}")),
        ],
    );
    let view = session_view(&gw, &result).await;
    assert_eq!(
        view["tether_turns_pending"], 0,
        "the page ACKed the reply: {view}"
    );
}

/// Scenario 2: model output with `<img onerror>`, `<script>`, a `javascript:` link and real
/// Markdown: nothing runs, the tags show as text, Markdown renders as elements.
#[tokio::test]
async fn browser_page_renders_markdown_safely() {
    let _one = BROWSER.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let result = scenario(
        "markdown.mjs",
        "browser_page_renders_markdown_safely",
        &gw,
        &[],
    )
    .await;
    assert_eq!(
        result["links"], 1,
        "only the https link is a link: {result}"
    );
}

/// Scenario 3: the connection is cut (a proxy in the script) while the backend pushes a turn;
/// back, the page shows it once under "While you were away", ACKs it, and a reload does not
/// show it again.
#[tokio::test]
async fn browser_page_shows_a_turn_pushed_while_away_once() {
    let _one = BROWSER.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let result = scenario(
        "reconnect.mjs",
        "browser_page_shows_a_turn_pushed_while_away_once",
        &gw,
        &[],
    )
    .await;
    let view = session_view(&gw, &result).await;
    assert_eq!(view["tether_turns_pending"], 0, "{view}");
    let id = str_field(&result, "session_id");
    let token = str_field(&result, "session_token");
    let pushed = gw
        .messages(id, token)
        .await
        .into_iter()
        .filter(|(role, text)| role == "assistant" && text.contains("gate B12"))
        .count();
    assert_eq!(pushed, 1, "the pushed turn is stored once");
}

/// The connection drops in the middle of a streamed reply (a slow fake upstream, the page behind
/// the script's proxy): the reply ends up whole in the bubble that was streaming, once, whether it
/// finished while the page was away (from the Tether, matched by chunk_id) or after it came back
/// (the new connection gets the whole text); the cut HTTP requests were sent again without
/// storing anything twice.
#[tokio::test]
async fn browser_page_completes_a_reply_cut_mid_stream_once() {
    let _one = BROWSER.lock().await;
    let fake = FakeLlm::start().await.expect("fake upstream");
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &["--llm-base-url", &fake.base_url()]).await;
    let result = scenario(
        "cut.mjs",
        "browser_page_completes_a_reply_cut_mid_stream_once",
        &gw,
        &[],
    )
    .await;
    let id = str_field(&result, "session_id");
    let token = str_field(&result, "session_token");
    let transcript = gw.messages(id, token).await;
    let roles: Vec<&str> = transcript.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(
        roles,
        ["user", "assistant", "user", "assistant"],
        "{transcript:?}"
    );
    assert!(
        transcript[1].1.starts_with("echo: first word1"),
        "{transcript:?}"
    );
    assert!(transcript[3].1.ends_with("word24"), "{transcript:?}");
    let view = session_view(&gw, &result).await;
    assert_eq!(view["tether_turns_pending"], 0, "{view}");
}

/// A session with turns made over HTTP and a pushed (tethered) turn: the page joining it (id and
/// token, then a shared link in a second browser) shows the earlier conversation from
/// `GET /v1/sessions/{id}/messages` in order, the pushed turn once although it is also drained,
/// then goes on live; nothing is stored twice and the tether ends empty.
#[tokio::test]
async fn browser_page_joining_a_session_shows_its_earlier_conversation() {
    let _one = BROWSER.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let result = scenario(
        "history.mjs",
        "browser_page_joining_a_session_shows_its_earlier_conversation",
        &gw,
        &[],
    )
    .await;
    let id = str_field(&result, "session_id");
    let token = str_field(&result, "session_token");
    let transcript = gw.messages(id, token).await;
    let roles: Vec<&str> = transcript.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(
        roles,
        [
            "user",
            "assistant",
            "user",
            "assistant",
            "assistant",
            "user",
            "assistant"
        ],
        "{transcript:?}"
    );
    let view = session_view(&gw, &result).await;
    assert_eq!(view["tether_turns_pending"], 0, "{view}");
}

/// Scenario 4: geolocation (with the position Playwright gives the browser), Deny, page_info
/// without the URL fragment, notify, the model calling geolocation inside a turn, and a browser
/// that refuses the location, each behind the page's permission prompt.
#[tokio::test]
async fn browser_page_answers_tool_calls_after_a_prompt() {
    let _one = BROWSER.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let result = scenario(
        "tools.mjs",
        "browser_page_answers_tool_calls_after_a_prompt",
        &gw,
        &[],
    )
    .await;
    assert!(
        str_field(&result, "geo_error").contains("denied"),
        "{result}"
    );
    // Backend calls are not part of the transcript; the model's call is, as a whole tool round.
    let id = str_field(&result, "session_id");
    let token = str_field(&result, "session_token");
    let transcript = gw.messages(id, token).await;
    let roles: Vec<&str> = transcript.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(
        roles,
        ["user", "assistant", "tool", "assistant"],
        "{transcript:?}"
    );
    assert!(transcript[2].1.contains("48.8584"), "{transcript:?}");
    assert!(
        transcript[3]
            .1
            .starts_with("Echo: surface_geolocation returned"),
        "{transcript:?}"
    );
    assert!(
        !transcript.iter().any(|(_, c)| c.contains("Boarding soon")),
        "{transcript:?}"
    );
}

/// Scenario 5: with `--api-key` the page and its assets load without a key, its API calls are
/// refused until the key is entered in the page, then everything works.
#[tokio::test]
async fn browser_page_with_operator_keys() {
    let _one = BROWSER.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let key = "page-test-key";
    let gw = Sbp::start(dir.path(), &["--api-key", key]).await;
    let result = scenario(
        "operator.mjs",
        "browser_page_with_operator_keys",
        &gw,
        &[("SBP_API_KEY", key)],
    )
    .await;
    let id = str_field(&result, "session_id");
    let (status, _, view) = send(gw.get(&format!("/v1/sessions/{id}")).bearer_auth(key)).await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["step_count"], 1, "{view}");
}

/// Without a browser: `GET /` and every asset it references answer 200 with their content type,
/// the strict CSP and the other headers, even with operator keys; a second request with the
/// ETag gets 304; an unknown asset 404s; the API itself still wants the key.
#[tokio::test]
async fn page_and_assets_are_served_with_strict_headers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &["--api-key", "k1"]).await;
    let header = |h: &reqwest::header::HeaderMap, name: &str| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_else(|| panic!("no {name} header"))
            .to_owned()
    };

    let (status, headers, body) = send(gw.get("/")).await;
    assert_eq!(status, 200, "{body}");
    let html = body.as_str().expect("HTML text").to_owned();
    let mut assets: Vec<String> = html
        .split(['"', '\''])
        .filter(|s| s.starts_with("/assets/"))
        .map(str::to_owned)
        .collect();
    assets.sort();
    assets.dedup();
    assert_eq!(
        assets,
        ["/assets/app.js", "/assets/icon.svg", "/assets/style.css"],
        "what the page loads"
    );
    let handler_attribute = html.match_indices(" on").any(|(i, _)| {
        let rest = &html[i + 3..];
        let name: String = rest.chars().take_while(char::is_ascii_alphabetic).collect();
        !name.is_empty() && rest[name.len()..].starts_with('=')
    });
    assert!(
        !html.contains("<script>") && !html.contains(" style=") && !handler_attribute,
        "nothing inline in the page"
    );
    let mut checks = vec![("/".to_owned(), "text/html; charset=utf-8", headers)];
    // app.js imports markdown.js.
    for (path, content_type) in [
        ("/assets/app.js", "text/javascript; charset=utf-8"),
        ("/assets/markdown.js", "text/javascript; charset=utf-8"),
        ("/assets/style.css", "text/css; charset=utf-8"),
        ("/assets/icon.svg", "image/svg+xml"),
    ] {
        let (status, headers, _) = send(gw.get(path)).await;
        assert_eq!(status, 200, "{path}");
        checks.push((path.to_owned(), content_type, headers));
    }
    for (path, content_type, h) in &checks {
        assert_eq!(header(h, "content-type"), *content_type, "{path}");
        assert_eq!(header(h, "content-security-policy"), CSP, "{path}");
        assert_eq!(header(h, "x-content-type-options"), "nosniff", "{path}");
        assert_eq!(header(h, "referrer-policy"), "no-referrer", "{path}");
        assert_eq!(header(h, "cache-control"), "no-cache", "{path}");
        assert_eq!(header(h, "x-frame-options"), "DENY", "{path}");

        let etag = header(h, "etag");
        let (status, again, _) = send(gw.get(path).header("if-none-match", &etag)).await;
        assert_eq!(status, 304, "{path} revalidates");
        assert_eq!(header(&again, "etag"), etag);
    }
    let (_, _, app) = send(gw.get("/assets/app.js")).await;
    let app = app.as_str().expect("script text");
    assert!(
        app.contains("from './markdown.js'"),
        "the module the page imports"
    );
    let (_, _, markdown) = send(gw.get("/assets/markdown.js")).await;
    let markdown = markdown.as_str().expect("script text");
    for js in [app, markdown] {
        assert!(js.contains("createElement") && !js.contains("innerHTML"));
    }

    for path in [
        "/assets/nope.js",
        "/assets/",
        "/assets/app.js/x",
        "/assets/..%2Fsecret",
    ] {
        let (status, _, body) = send(gw.get(path)).await;
        assert!(status == 404 || status == 401, "{path}: {status} {body}");
    }
    let (status, _, body) = send(gw.get("/assets/nope.js")).await;
    assert_eq!(status, 404, "an unknown asset, without a key: {body}");
    assert_eq!(body["error"]["code"], "SBP_NOT_FOUND", "{body}");
    let (status, _, body) = send(gw.get("/assets/app.js/x")).await;
    assert_eq!(status, 401, "only the asset files are open: {body}");

    let (status, _, body) = send(gw.post("/v1/sbp/sessions", &serde_json::json!({}))).await;
    assert_eq!(status, 401, "the API still needs the key: {body}");
    let (status, _, body) = send(
        gw.post("/v1/sbp/sessions", &serde_json::json!({}))
            .bearer_auth("k1"),
    )
    .await;
    assert_eq!(status, 201, "{body}");
}
