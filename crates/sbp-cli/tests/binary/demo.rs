//! End-to-end tests of `sbp demo`, the real binary as a user runs it: it tells the whole story
//! and exits 0 within a time limit, and its output carries the facts each step claims (headings
//! in order, the watch's renderings within its 40-token budget, the desktop's Markdown, the gps
//! coordinates in the final reply, the import's message count, the lineage with its fork and
//! handoff, the session moving to the second gateway with its tethered turn while the first answers
//! SESSION_MOVED); colour only when asked for; a failure names where it happened and exits 1; Ctrl-C
//! stops it with exit status 130 and nothing left behind.

use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use sbp_adapt::estimate_tokens;
use serde_json::Value;

use crate::support::{self, Proc};

/// A debug build on two shared cores: the demo itself takes well under a second.
const LIMIT: Duration = Duration::from_secs(60);

const HEADINGS: [&str; 8] = [
    "[1/8] A phone attaches and asks",
    "[2/8] The phone goes offline; the agent keeps working",
    "[3/8] A watch attaches and drains the tether",
    "[4/8] A desktop takes over and gets Markdown",
    "[5/8] The agent calls the phone's gps",
    "[6/8] The session roams: export, import, fork, handoff",
    "[7/8] The phone attaches to gateway B; the session follows",
    "[8/8] What you just saw",
];

/// `sbp demo ARGS...` with no inherited `SBP_*` or `NO_COLOR`, run to its end within [`LIMIT`].
async fn demo(args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, String, String, Duration) {
    let started = Instant::now();
    let mut proc = Proc::spawn(demo_command(args, env));
    let status = proc.wait_exit(LIMIT).await;
    let elapsed = started.elapsed();
    let (out, err) = proc.output();
    (status, out, err, elapsed)
}

/// The `sbp demo ARGS...` command (clean environment, output piped) with `env` added.
fn demo_command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = support::sbp_command("demo", args);
    cmd.envs(env.iter().copied());
    cmd
}

/// The demo's temp directory, from the path of gateway A's database in its output.
fn demo_dir(out: &str) -> std::path::PathBuf {
    let db = line_with(out, "gateway A: http://");
    let path = &db[db.find("(SQLite ").expect("the database path") + "(SQLite ".len()..]
        .trim_end_matches(')');
    std::path::Path::new(path)
        .parent()
        .and_then(|p| p.parent())
        .expect("the demo's directory")
        .to_owned()
}

/// The text of step `n` (1-based): from its heading to the next one.
fn section(out: &str, n: usize) -> &str {
    let start = out
        .find(HEADINGS[n - 1])
        .unwrap_or_else(|| panic!("no heading {n}:\n{out}"));
    let end = HEADINGS
        .get(n)
        .and_then(|h| out.find(h))
        .unwrap_or(out.len());
    &out[start..end]
}

/// The number just before `marker` in `line` ("12 messages restored" → 12).
fn number_before(line: &str, marker: &str) -> u64 {
    let head = &line[..line
        .find(marker)
        .unwrap_or_else(|| panic!("no '{marker}' in: {line}"))];
    head.split_whitespace()
        .last()
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no number before '{marker}' in: {line}"))
}

/// The line of `text` containing `needle`.
fn line_with<'a>(text: &'a str, needle: &str) -> &'a str {
    text.lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line with '{needle}' in:\n{text}"))
}

/// The short session id (`…` and 8 hex digits) following `after` in `line`.
fn short_id_after<'a>(line: &'a str, after: &str) -> &'a str {
    let at = line
        .find(after)
        .unwrap_or_else(|| panic!("no '{after}' in: {line}"))
        + after.len();
    let id = line[at..]
        .split(|c: char| c.is_whitespace() || c == ',' || c == ')')
        .next()
        .unwrap_or_default();
    assert!(
        id.starts_with('…') && id.chars().count() == 9,
        "not a short id: '{id}' in {line}"
    );
    id
}

/// The JSON object in `line` that starts at its first `{` (text may follow it).
fn json_in(line: &str) -> Value {
    let at = line
        .find('{')
        .unwrap_or_else(|| panic!("no JSON in: {line}"));
    serde_json::Deserializer::from_str(&line[at..])
        .into_iter::<Value>()
        .next()
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("bad JSON in: {line}"))
}

#[tokio::test]
async fn demo_tells_the_whole_story() {
    let (status, out, err, elapsed) = demo(&["--color", "never"], &[]).await;
    assert!(
        status.success(),
        "exit {status}\nstdout:\n{out}\nstderr:\n{err}"
    );
    assert!(elapsed < LIMIT, "took {elapsed:?}");
    assert!(
        !out.contains('\u{1b}'),
        "--color never printed escapes:\n{out}"
    );
    assert!(!err.contains("panicked"), "{err}");

    // Every step's heading, in order.
    let mut at = 0;
    for h in HEADINGS {
        let found = out[at..]
            .find(h)
            .unwrap_or_else(|| panic!("heading '{h}' missing or out of order:\n{out}"));
        at += found + h.len();
    }

    // 1: the reply streamed to the phone and the turn completed.
    let one = section(&out, 1);
    let session_a = short_id_after(line_with(one, "POST /v1/sessions on A"), "session ");
    assert!(
        one.contains("agent › Echo: What should I see in Tokyo"),
        "{one}"
    );
    let complete = line_with(one, "turn complete:");
    assert!(number_before(complete, "TURN_CHUNKs") > 1, "{complete}");

    // 2: three turns tethered while nobody was attached.
    let two = section(&out, 2);
    assert!(two.contains("session suspended"), "{two}");
    assert_eq!(number_before(two, "turns tethered"), 3, "{two}");

    // 3: the watch's renderings fit its budget; the long ones were cut with "…".
    let three = section(&out, 3);
    let mut renderings: Vec<(String, Vec<String>)> = Vec::new();
    for line in three.lines() {
        if line.contains("TETHER_TURN seq") {
            renderings.push((line.to_owned(), Vec::new()));
        } else if let (Some(text), Some((_, lines))) =
            (line.strip_prefix("    │ "), renderings.last_mut())
        {
            lines.push(text.to_owned());
        }
    }
    assert_eq!(renderings.len(), 3, "{three}");
    let mut cut = 0;
    for (fact, lines) in &renderings {
        let shown = lines.join("\n");
        let stored = number_before(fact, "tokens stored");
        let claimed = number_before(fact, "on the watch");
        assert_eq!(
            u64::from(estimate_tokens(&shown)),
            claimed,
            "{fact}\n{shown}"
        );
        assert!(claimed <= 40, "over the watch's budget: {fact}\n{shown}");
        if shown.ends_with('…') {
            cut += 1;
            assert!(stored > 40, "cut though it fitted: {fact}");
            assert!(fact.ends_with("(cut)"), "{fact}");
        }
        assert!(
            !shown.contains("**"),
            "the watch got Markdown syntax: {shown}"
        );
    }
    assert!(cut >= 1, "no rendering was cut:\n{three}");
    assert!(
        three.contains("the transcript holds all 3 originals verbatim"),
        "{three}"
    );

    // 4: the watch was displaced; the desktop's reply is the Markdown as written.
    let four = section(&out, 4);
    assert!(four.contains("closed with code 4409"), "{four}");
    let reply = &four[four.find("agent › ").expect("the desktop's reply")..];
    for marker in [
        "**Pick one**",
        "| Keio Plaza | ¥21,000 | 4 min |",
        "|---|---|---|",
    ] {
        assert!(reply.contains(marker), "'{marker}' missing from:\n{reply}");
    }
    assert!(four.contains("desktop got Markdown untouched"), "{four}");

    // 5: the gps call went to the phone and its answer is in the final reply.
    let five = section(&out, 5);
    let call = line_with(five, "TOOL_CALL → phone: gps");
    assert_eq!(json_in(call), serde_json::json!({"accuracy": "fine"}));
    let result = json_in(line_with(five, "TOOL_RESULT ← phone:"));
    assert!(result["lat"].is_f64() && result["lon"].is_f64(), "{result}");
    let final_reply = line_with(five, "agent › Echo: surface_gps returned");
    assert_eq!(json_in(final_reply), result, "{five}");
    assert!(
        five.contains("assistant (tool_calls surface_gps) → tool → assistant"),
        "{five}"
    );

    // 6: B restored every exported message; the lineage lists the fork and the handoff.
    let six = section(&out, 6);
    let exported = number_before(line_with(six, "export on A:"), "messages exported");
    let import = line_with(six, "import on B:");
    assert_eq!(
        number_before(import, "messages restored"),
        exported,
        "{import}"
    );
    assert!(exported >= 10, "{six}");
    let session_b = short_id_after(import, "new session ");
    let fork = short_id_after(line_with(six, "fork on B:"), "session ");
    let handoff = short_id_after(line_with(six, "handoff on B to booking-agent:"), "session ");
    assert!(six.contains("410 SBP_TOKEN_CONSUMED"), "{six}");
    assert!(
        line_with(six, "· roaming token ").contains(" characters, HS256, expires"),
        "{six}"
    );
    assert_eq!(number_before(import, "on B with"), exported + 1, "{import}");
    let tree = &six[six.find("/lineage on B:").expect("the lineage")..];
    assert!(
        tree.contains(&format!("session {session_a} on gateway A")),
        "{tree}"
    );
    assert!(
        tree.contains(&format!("as session {session_b} on gateway B")),
        "{tree}"
    );
    assert!(
        tree.contains(&format!("fork \"plan B\" → session {fork}")),
        "{tree}"
    );
    assert!(
        tree.contains(&format!("handoff → booking-agent → session {handoff}")),
        "{tree}"
    );

    // 7: the phone attached to B with the same session; the turn tethered on A came along; A
    // answers SESSION_MOVED naming B, which the SDK followed.
    let b_url = {
        let line = line_with(&out, "gateway B: http://");
        let at = line.find("http://").expect("B's URL");
        line[at..]
            .split_whitespace()
            .next()
            .expect("B's URL")
            .to_owned()
    };
    let seven = section(&out, 7);
    let attached = line_with(seven, "SESSION_ATTACHED from gateway B:");
    assert_eq!(
        short_id_after(attached, "session "),
        session_a,
        "the same session id: {attached}"
    );
    assert!(attached.contains("sbp_level L6"), "{attached}");
    assert_eq!(number_before(attached, "queued"), 1, "{attached}");
    let pushed_seq = number_before(line_with(seven, "backend pushed a turn on A: seq"), ",");
    let drained = line_with(seven, "TETHER_TURN seq");
    assert_eq!(number_before(drained, "on B"), pushed_seq, "{drained}");
    assert!(
        seven.contains("│ Boarding for Sapporo starts at 10:10 at gate 62."),
        "{seven}"
    );
    let moved = line_with(seven, "409 SBP_SESSION_MOVED");
    assert!(moved.contains("on A:"), "{moved}");
    assert!(moved.ends_with(&format!("gateway_url {b_url}")), "{moved}");
    assert!(
        seven.contains("agent › Echo: I landed in Sapporo. What now?"),
        "{seven}"
    );
    assert!(
        line_with(seven, "the SDK followed SBP_SESSION_MOVED")
            .contains(&format!("now calls {b_url};")),
        "{seven}"
    );
    assert!(
        line_with(seven, "/lineage on B: migrated_from gateway")
            .split_whitespace()
            .last()
            .is_some_and(|id| id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit())),
        "{seven}"
    );

    // 8, and the temp directory is gone.
    let eight = section(&out, 8);
    assert!(eight.contains("story told in"), "{out}");
    assert!(
        line_with(eight, "L6 federation:").contains("with its 1 tethered turn(s)"),
        "{eight}"
    );
    let dir = demo_dir(&out);
    assert!(!dir.exists(), "{} was left behind", dir.display());
}

/// Ctrl-C mid-story: the gateways stop, the (private) directory goes, the exit status is 130.
#[tokio::test]
async fn demo_interrupted_cleans_up_and_exits_130() {
    // `--slow` pauses between steps, so the signal lands while the story is still going.
    let mut proc = Proc::spawn(demo_command(&["--color", "never", "--slow"], &[]));
    let mut seen = String::new();
    while !seen.contains(HEADINGS[0]) {
        let line = proc
            .next_line(LIMIT)
            .await
            .unwrap_or_else(|| panic!("the demo ended before its first step:\n{seen}"));
        seen.push_str(&line);
        seen.push('\n');
    }
    let dir = demo_dir(&seen);
    let mode = std::fs::metadata(&dir)
        .unwrap_or_else(|e| panic!("{} mid-story: {e}", dir.display()))
        .permissions();
    // Private to the user: the sessions' SQLite files are inside.
    #[cfg(unix)]
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o700,
        "{}",
        dir.display()
    );
    let status = Command::new("kill")
        .arg("-INT")
        .arg(proc.pid().to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -INT failed: {status}");
    let status = proc.wait_exit(LIMIT).await;
    let (out, err) = proc.output();
    assert_eq!(status.code(), Some(130), "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains("sbp demo: interrupted"), "{err}");
    assert!(!out.contains(HEADINGS[7]), "the story went on:\n{out}");
    assert!(!dir.exists(), "{} was left behind", dir.display());
}

#[tokio::test]
async fn demo_colours_only_when_asked() {
    let (status, always, err, _) = demo(&["--color", "always"], &[]).await;
    assert!(status.success(), "exit {status}\n{err}");
    assert!(always.contains("\u{1b}[1;34m[1/8]"), "{always}");
    assert!(always.contains("\u{1b}[0m"), "{always}");
    // auto: stdout is a pipe here, so no colour (nor with NO_COLOR, whatever stdout is).
    for env in [&[][..], &[("NO_COLOR", "1")][..]] {
        let (status, auto, err, _) = demo(&[], env).await;
        assert!(status.success(), "exit {status}\n{err}");
        assert!(!auto.contains('\u{1b}'), "{env:?}: {auto}");
        assert!(auto.contains(HEADINGS[7]), "{auto}");
    }
}

/// A demo that cannot set up says so and exits 1: here its temp directory cannot be created
/// (TMPDIR names a file).
#[tokio::test]
async fn demo_failure_names_the_place_and_exits_1() {
    let file = tempfile::NamedTempFile::new().expect("temp file");
    let tmpdir = file.path().to_str().expect("utf-8 path");
    let (status, out, err, _) = demo(&["--color", "never"], &[("TMPDIR", tmpdir)]).await;
    assert_eq!(status.code(), Some(1), "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        err.contains("sbp demo: setup failed: creating a temporary directory"),
        "{err}"
    );
    assert!(out.contains("✗ setup failed"), "{out}");
    assert!(!out.contains(HEADINGS[0]), "{out}");
}
