//! The real binary keeps its data private (data dir 0700, database, WAL, shared memory and secret
//! 0600, from the first start and narrowed on a later one), and a body built to cost memory is
//! refused without costing it.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use serde_json::json;

use crate::support::{Sbp, WAIT, msg, send};

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

/// Every file of the data dir and the dir itself, with the mode each must have.
fn private_files(dir: &Path) -> Vec<(std::path::PathBuf, u32)> {
    let mut files = vec![(dir.to_path_buf(), 0o700)];
    for name in ["sbp.db", "sbp.db-wal", "sbp.db-shm", "secret"] {
        files.push((dir.join(name), 0o600));
    }
    files
}

fn assert_private(dir: &Path, when: &str) {
    for (path, want) in private_files(dir) {
        assert_eq!(
            mode(&path),
            want,
            "{} {when}: mode {:o}",
            path.display(),
            mode(&path)
        );
    }
}

#[tokio::test]
async fn data_is_private_from_the_first_start_and_narrowed_on_later_ones() {
    let parent = tempfile::tempdir().expect("tempdir");
    let dir = parent.path().join("data");
    let mut gw = Sbp::start(&dir, &[]).await;
    assert_private(&dir, "after the first start");
    let (status, _, body) = gw.chat(None, json!([msg("user", "hello")])).await;
    assert_eq!(status, 200, "{body}");
    assert_private(&dir, "after a turn");
    gw.proc.kill9();

    // A data dir left readable by others (an older version, a careless copy) is narrowed.
    for (path, _) in private_files(&dir) {
        let wide = if path == dir { 0o755 } else { 0o644 };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(wide)).expect("chmod");
    }
    let mut gw = Sbp::start(&dir, &[]).await;
    assert_private(&dir, "after a restart");
    let (status, _, body) = gw.chat(None, json!([msg("user", "again")])).await;
    assert_eq!(status, 200, "{body}");
    assert_private(&dir, "after a turn on the restarted gateway");
    gw.proc.sigterm();
    gw.proc.wait_exit(WAIT).await;
    let (_, err) = gw.proc.output();
    assert!(err.contains("narrowed"), "the change is logged: {err}");
}

/// The peak resident memory of the process (`VmHWM`), in bytes.
#[cfg(target_os = "linux")]
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kib * 1024
}

/// 240,000 tiny messages in 7.5 MiB (within the default body limit) once took ~0.8 GB to parse
/// and store; refused before parsing, they cost the gateway about their own size.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_body_of_tiny_messages_is_refused_without_costing_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let (status, _, _) = send(gw.get("/healthz")).await;
    assert_eq!(status, 200);
    let before = peak_rss(gw.proc.pid());
    let body = json!({"messages": vec![msg("user", "xxxx"); 240_000]});
    let (status, _, v) = send(gw.post("/v1/chat/completions", &body)).await;
    assert_eq!(status, 413, "{v}");
    let grown = peak_rss(gw.proc.pid()).saturating_sub(before);
    assert!(
        grown < 64 << 20,
        "the refused body raised the peak RSS by {} MiB",
        grown >> 20
    );
}
