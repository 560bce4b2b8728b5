//! TLS served directly: HTTPS and a WSS surface with a self-signed certificate, and the
//! certificate replaced when its files change (a renewal) without a restart.

use std::time::Duration;

use sbp_gateway::{EdgeConfig, GatewayConfig, TlsFiles};
use sbp_test_support::{TestCert, eventually, response};
use serde_json::json;

use crate::support::{Options, TestGateway, WAIT, Ws};

struct TlsGateway {
    gw: TestGateway,
    /// `https://127.0.0.1:PORT`
    https: String,
    /// `wss://127.0.0.1:PORT`
    wss: String,
    /// `127.0.0.1:PORT`
    addr: String,
    files: TlsFiles,
    _dir: tempfile::TempDir,
}

async fn tls_gateway(cert: &TestCert, reload_every: Duration) -> TlsGateway {
    let dir = tempfile::tempdir().expect("tempdir");
    let files = TlsFiles {
        cert: dir.path().join("cert.pem"),
        key: dir.path().join("key.pem"),
    };
    cert.write(&files.cert, &files.key);
    let defaults = sbp_test_support::config();
    let gw = TestGateway::with(Options {
        config: GatewayConfig {
            edge: EdgeConfig {
                tls: Some(files.clone()),
                tls_reload_interval: reload_every,
                ..EdgeConfig::default()
            },
            ..defaults
        },
        ..Options::default()
    })
    .await;
    let addr = gw.url.trim_start_matches("http://").to_owned();
    TlsGateway {
        https: format!("https://{addr}"),
        wss: format!("wss://{addr}"),
        addr,
        gw,
        files,
        _dir: dir,
    }
}

#[tokio::test]
async fn https_and_a_wss_surface_are_served_with_the_configured_certificate() {
    let cert = TestCert::new();
    let t = tls_gateway(&cert, Duration::from_secs(3600)).await;
    let https = cert.https_client();
    let (s, _, health) = response(
        https
            .get(format!("{}/healthz", t.https))
            .send()
            .await
            .expect("https request"),
    )
    .await;
    assert_eq!(s, 200, "{health}");
    let (s, _, created) = response(
        https
            .post(format!("{}/v1/sessions", t.https))
            .json(&json!({}))
            .send()
            .await
            .expect("https request"),
    )
    .await;
    assert_eq!(s, 201, "{created}");
    let id = created["session_id"].as_str().expect("id");
    let token = created["session_token"].as_str().expect("token");

    // A surface over wss:// gets a pushed turn live.
    let (mut surface, attached) = Ws::attach_tls(&t.wss, id, token, &cert).await;
    assert_eq!(attached["session_id"], id, "{attached}");
    let (s, _, pushed) = response(
        https
            .post(format!("{}/v1/sbp/sessions/{id}/turns", t.https))
            .header("x-session-token", token)
            .json(&json!({"content": "over TLS"}))
            .send()
            .await
            .expect("https request"),
    )
    .await;
    assert_eq!(s, 201, "{pushed}");
    assert_eq!(pushed["delivery"], "live", "{pushed}");
    let (text, _) = surface.live_turn().await;
    assert_eq!(text, "over TLS");

    // Plain HTTP on the TLS port gets no HTTP answer.
    let plain = sbp_test_support::client()
        .get(format!("http://{}/healthz", t.addr))
        .timeout(WAIT)
        .send()
        .await;
    assert!(
        plain.as_ref().map_or(true, |r| r.status() != 200),
        "{plain:?}"
    );
    drop(t.gw);
}

#[tokio::test]
async fn a_renewed_certificate_is_served_once_its_files_change() {
    let old = TestCert::new();
    let t = tls_gateway(&old, Duration::from_millis(100)).await;
    assert!(old.handshake(&t.addr).await);
    let new = TestCert::new();
    assert!(
        !new.handshake(&t.addr).await,
        "the new one is not served yet"
    );

    new.write(&t.files.cert, &t.files.key);
    eventually(WAIT, "the renewed certificate served", || async {
        new.handshake(&t.addr).await.then_some(())
    })
    .await;
    assert!(!old.handshake(&t.addr).await, "the old one is gone");

    drop(t.gw);
}
