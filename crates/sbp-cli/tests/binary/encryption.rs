//! Encryption at rest through the real binary: with `--encryption-key` no database file (the WAL
//! and shared memory included, read raw while the gateway runs and after it stopped) holds a
//! marker the session's content carries, while the same session without a key leaves it there;
//! a restart reads everything back; a rotation, `sbp store reseal` and a start with only the new
//! key keep everything readable; an unrelated key or none is refused at start.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use super::support::{Proc, Sbp, WAIT, msg, reply_text, sbp_serve_in, send};

/// `sbp encryption-key generate --out DIR/NAME`: the file the gateway is given.
fn key_file(dir: &Path, name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let path = dir.join(name);
    let out = Command::new(env!("CARGO_BIN_EXE_sbp"))
        .args(["encryption-key", "generate", "--out"])
        .arg(&path)
        .output()
        .expect("run sbp encryption-key generate");
    assert!(out.status.success(), "{out:?}");
    let mode = std::fs::metadata(&path)
        .expect("key file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "a key file is private");
    path
}

/// A path as a command-line argument.
fn arg(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// Whether a database file (`sbp.db`, `sbp.db-wal`, `sbp.db-shm`) holds `needle`, read as raw
/// bytes: nothing is checkpointed first.
fn database_files_contain(dir: &Path, needle: &str) -> bool {
    let mut seen = 0;
    let mut found = false;
    for suffix in ["", "-wal", "-shm"] {
        let path = dir.join(format!("sbp.db{suffix}"));
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        seen += 1;
        found |= bytes.windows(needle.len()).any(|w| w == needle.as_bytes());
    }
    assert!(seen >= 1, "no database file in {}", dir.display());
    found
}

/// What [`populate`] left in a gateway.
struct Session {
    id: String,
    token: String,
    roaming_token: String,
    marker: String,
    /// The idempotent request and its response.
    request: Value,
    key: String,
    response: Value,
}

/// A session with `marker` in every kind of content: a completion sent with an
/// `Idempotency-Key` (prompt, reply, task label, replayable response), its memory, a turn pushed
/// while no surface is attached (tethered), and an export with a label (a stored bundle).
async fn populate(gw: &Sbp, marker: &str) -> Session {
    let request =
        json!({"model": "sbp/echo", "messages": [msg("user", &format!("remember {marker}"))]});
    let key = format!("idem-{marker}");
    let (status, headers, response) = send(
        gw.post("/v1/chat/completions", &request)
            .header("idempotency-key", &key),
    )
    .await;
    assert_eq!(status, 200, "{response}");
    assert!(reply_text(&response).contains(marker), "{response}");
    let token = headers
        .get("x-session-token")
        .and_then(|v| v.to_str().ok())
        .expect("session token")
        .to_owned();
    let id = response["sbp"]["session_id"]
        .as_str()
        .expect("session id")
        .to_owned();
    let (status, _, body) = send(
        gw.http
            .put(format!("{}/v1/sbp/sessions/{id}/memory", gw.url))
            .header("x-session-token", &token)
            .json(&json!({"payload": {"note": format!("memory {marker}")}})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let pushed = gw.push(&id, &token, &format!("pushed {marker}")).await;
    assert_eq!(pushed["delivery"], "tethered", "{pushed}");
    let (status, _, export) = send(
        gw.post(
            &format!("/v1/sbp/sessions/{id}/export"),
            &json!({"ttl_seconds": 3600, "label": format!("label {marker}")}),
        )
        .header("x-session-token", &token),
    )
    .await;
    assert_eq!(status, 201, "{export}");
    Session {
        id,
        token,
        roaming_token: export["roaming_token"]
            .as_str()
            .expect("roaming token")
            .to_owned(),
        marker: marker.to_owned(),
        request,
        key,
        response,
    }
}

/// Everything [`populate`] wrote reads back as plaintext: the transcript, the task label, the
/// memory, the replayed response, and the stored bundle (imported as a fork, which leaves the
/// token usable). `drain`: attach and expect the pushed turn from the tether.
async fn reads_back(gw: &Sbp, s: &Session, drain: bool) {
    let m = &s.marker;
    let transcript = gw.messages(&s.id, &s.token).await;
    assert!(
        transcript.iter().any(|(r, c)| r == "user" && c.contains(m)),
        "{transcript:?}"
    );
    assert!(
        transcript
            .iter()
            .any(|(r, c)| r == "assistant" && c == &format!("pushed {m}")),
        "{transcript:?}"
    );
    let view = gw.session(&s.id, &s.token).await;
    assert_eq!(view["last_task"], format!("remember {m}"), "{view}");
    let (status, _, memory) = send(
        gw.get(&format!("/v1/sbp/sessions/{}/memory", s.id))
            .header("x-session-token", &s.token),
    )
    .await;
    assert_eq!(status, 200, "{memory}");
    assert_eq!(memory["payload"]["note"], format!("memory {m}"), "{memory}");
    let (status, _, replay) = send(
        gw.post("/v1/chat/completions", &s.request)
            .header("idempotency-key", &s.key),
    )
    .await;
    assert_eq!(status, 200, "{replay}");
    assert_eq!(
        reply_text(&replay),
        reply_text(&s.response),
        "the stored response replays"
    );
    let (status, _, fork) = send(gw.post(
        "/v1/sbp/sessions/import",
        &json!({"roaming_token": s.roaming_token, "allow_reuse": true}),
    ))
    .await;
    assert_eq!(status, 201, "the stored bundle opens and verifies: {fork}");
    let forked = gw
        .messages(
            fork["session_id"].as_str().expect("fork id"),
            fork["session_token"].as_str().expect("fork token"),
        )
        .await;
    assert!(forked.iter().any(|(_, c)| c.contains(m)), "{forked:?}");
    if drain {
        let (mut ws, attached) = gw.attach(&s.id, &s.token).await;
        assert_eq!(attached["queued_turns"], 1, "{attached}");
        let frame = ws.recv().await;
        assert_eq!(frame["type"], "TETHER_TURN", "{frame}");
        assert_eq!(frame["content"], format!("pushed {m}"), "{frame}");
        ws.close().await;
    }
}

async fn stop(mut gw: Sbp) {
    gw.proc.sigterm();
    let status = gw.proc.wait_exit(WAIT).await;
    assert!(status.success(), "{status}; stderr:\n{}", gw.proc.stderr());
}

/// `sbp serve` that must refuse to start: returns its stderr.
async fn refused(dir: &Path, extra: &[&str]) -> String {
    let mut proc = Proc::spawn(sbp_serve_in(dir, extra));
    let status = proc.wait_exit(WAIT).await;
    let (out, err) = proc.output();
    assert!(!status.success(), "must not start: {out}");
    assert!(!out.contains("listening"), "{out}");
    err
}

fn unique(tag: &str) -> String {
    format!("{tag}{}", uuid::Uuid::new_v4().simple())
}

#[tokio::test]
async fn encrypted_database_files_hold_no_plaintext_and_keys_rotate() {
    let keys = tempfile::tempdir().expect("key dir");
    let (k1, k2, k3) = (
        key_file(keys.path(), "k1"),
        key_file(keys.path(), "k2"),
        key_file(keys.path(), "k3"),
    );
    let dir = tempfile::tempdir().expect("data dir");
    let marker = unique("MARKER");

    let gw = Sbp::start(dir.path(), &["--encryption-key", arg(&k1)]).await;
    assert!(
        gw.banner.contains("encrypted at rest under key"),
        "{}",
        gw.banner
    );
    let first = populate(&gw, &marker).await;
    assert!(
        !database_files_contain(dir.path(), &marker),
        "no plaintext in the database, WAL or shared memory while it runs"
    );
    stop(gw).await;
    assert!(
        !database_files_contain(dir.path(), &marker),
        "nor after it stopped"
    );

    // The same without a key: the search finds the marker (in the WAL, before any checkpoint).
    let plain = tempfile::tempdir().expect("control dir");
    let gw = Sbp::start(plain.path(), &[]).await;
    populate(&gw, &marker).await;
    assert!(
        database_files_contain(plain.path(), &marker),
        "the control finds its marker"
    );
    stop(gw).await;

    // Restarted with the same key: everything reads back, the tether drains.
    let gw = Sbp::start(dir.path(), &["--encryption-key", arg(&k1)]).await;
    reads_back(&gw, &first, true).await;
    stop(gw).await;

    // Rotated: the old key opens what it sealed, the new one seals what is new.
    let rotated = [
        "--encryption-key",
        arg(&k2),
        "--previous-encryption-key",
        arg(&k1),
    ];
    let gw = Sbp::start(dir.path(), &rotated).await;
    reads_back(&gw, &first, false).await;
    let second = populate(&gw, &unique("SECOND")).await;
    stop(gw).await;
    assert!(!database_files_contain(dir.path(), &second.marker));

    let reseal = Command::new(env!("CARGO_BIN_EXE_sbp"))
        .args(["store", "reseal", "--data-dir"])
        .arg(dir.path())
        .args(rotated)
        .output()
        .expect("run sbp store reseal");
    let report = String::from_utf8_lossy(&reseal.stdout);
    assert!(
        reseal.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&reseal.stderr)
    );
    assert!(report.contains("resealed"), "{report}");

    // Only the new key: everything still reads; the old key alone, another key or none is refused.
    let gw = Sbp::start(dir.path(), &["--encryption-key", arg(&k2)]).await;
    reads_back(&gw, &first, false).await;
    reads_back(&gw, &second, true).await;
    stop(gw).await;
    for (extra, says) in [
        (
            vec!["--encryption-key", arg(&k3)],
            "neither --encryption-key nor",
        ),
        (
            vec!["--encryption-key", arg(&k1)],
            "neither --encryption-key nor",
        ),
        (vec![], "start with --encryption-key"),
    ] {
        let err = refused(dir.path(), &extra).await;
        assert!(err.contains(says), "{extra:?}: {err}");
    }
    assert!(!database_files_contain(dir.path(), &marker));
    assert!(!database_files_contain(dir.path(), &second.marker));
}

/// A key file that is not 32 bytes is refused with the reason, and its text is not repeated.
#[tokio::test]
async fn a_bad_key_file_is_refused_clearly() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().expect("data dir");
    let bad = dir.path().join("bad.key");
    std::fs::write(&bad, "c2VjcmV0LXNob3J0").expect("write");
    std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let err = refused(dir.path(), &["--encryption-key", arg(&bad)]).await;
    assert!(err.contains("32 bytes"), "{err}");
    assert!(
        !err.contains("c2VjcmV0LXNob3J0"),
        "the key text is never printed: {err}"
    );
}
