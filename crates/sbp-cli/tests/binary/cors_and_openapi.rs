//! The real binary's `--cors-origin` (flag, `SBP_CORS_ORIGINS`, refused values) and its OpenAPI
//! document: `sbp openapi` and `GET /openapi.json` print the committed `docs/openapi.json`.

use std::path::Path;

use crate::support::{Sbp, sbp_serve, sbp_serve_in};

const APP: &str = "http://app.example:3000";

fn committed() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json");
    std::fs::read_to_string(path).expect("docs/openapi.json")
}

/// A preflight for a completion from `origin`: (status, `Access-Control-Allow-Origin`).
async fn preflight(gw: &Sbp, origin: &str) -> (u16, Option<String>) {
    let resp = gw
        .http
        .request(
            reqwest::Method::OPTIONS,
            format!("{}/v1/chat/completions", gw.url),
        )
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "content-type, x-session-token",
        )
        .send()
        .await
        .expect("preflight");
    let allowed = resp
        .headers()
        .get("access-control-allow-origin")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    (resp.status().as_u16(), allowed)
}

#[tokio::test]
async fn cors_origins_from_the_flag_and_the_environment() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &["--cors-origin", APP]).await;
    let (status, allowed) = preflight(&gw, APP).await;
    assert!((200..300).contains(&status), "{status}");
    assert_eq!(allowed.as_deref(), Some(APP));
    assert_eq!(preflight(&gw, "http://other.example").await, (403, None));
    drop(gw);

    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = sbp_serve_in(dir.path(), &[]);
    cmd.env(
        "SBP_CORS_ORIGINS",
        "http://other.example, http://app.example:3000",
    );
    let gw = Sbp::spawn(cmd).await;
    assert_eq!(preflight(&gw, APP).await.1.as_deref(), Some(APP));
    drop(gw);

    // Off by default: the same preflight is refused.
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    assert_eq!(preflight(&gw, APP).await, (403, None));
}

#[test]
fn a_wildcard_or_a_path_is_not_an_origin() {
    for bad in ["*", "https://app.example.com/app"] {
        let out = sbp_serve()
            .args(["--listen", "127.0.0.1:0", "--cors-origin", bad])
            .output()
            .expect("run sbp serve");
        assert!(!out.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--cors-origin"), "{bad}: {err}");
    }
}

#[tokio::test]
async fn the_binary_prints_and_serves_the_committed_document() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sbp"))
        .arg("openapi")
        .output()
        .expect("run sbp openapi");
    assert!(out.status.success());
    let printed = String::from_utf8(out.stdout).expect("UTF-8");
    assert!(
        printed == committed(),
        "`sbp openapi` differs from docs/openapi.json: regenerate it with \
         `cargo run -q -p sbp-cli -- openapi > docs/openapi.json`"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let served = gw
        .get("/openapi.json")
        .send()
        .await
        .expect("GET /openapi.json")
        .text()
        .await
        .expect("body");
    assert!(served == printed, "the served document is the printed one");
}
