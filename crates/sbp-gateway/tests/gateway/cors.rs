//! CORS (`--cors-origin`): a web app on a configured origin gets its preflights answered without
//! credentials and reads the answers and session headers of its requests; any other origin is
//! still refused by the request policy, preflights included; without the option nothing changes;
//! and the page at `/` keeps its strict Content-Security-Policy.

use reqwest::Method;
use reqwest::header::HeaderMap;
use sbp_gateway::{GatewayConfig, PublicUrl};
use serde_json::json;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::support::{Options, TestGateway, TestGatewayExt, Ws};

const APP: &str = "http://app.example:3000";
const KEY: &str = "operator-key";

/// The page's policy, as `transport/page.rs` sends it.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// A gateway allowing `APP`, with an operator key (so a preflight answered without one shows it
/// needs none).
async fn with_cors() -> TestGateway {
    TestGateway::with(Options {
        config: GatewayConfig {
            cors_origins: vec![PublicUrl::parse_origin(APP).expect("origin")],
            api_keys: vec![KEY.into()],
            ..sbp_test_support::config()
        },
        ..Options::default()
    })
    .await
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> &'a str {
    h.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
}

/// A comma-separated header's items, lower case.
fn items(h: &HeaderMap, name: &str) -> Vec<String> {
    header(h, name)
        .split(',')
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

async fn preflight(gw: &TestGateway, origin: &str, path: &str) -> (u16, HeaderMap, String) {
    let resp = gw
        .request(
            Method::OPTIONS,
            path,
            &[
                ("origin", origin),
                ("access-control-request-method", "POST"),
                (
                    "access-control-request-headers",
                    "authorization, content-type, x-session-token, x-agent-id, idempotency-key, \
                     x-sbp-auto-resume, x-request-id",
                ),
            ],
        )
        .send()
        .await
        .expect("preflight");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.text().await.expect("body"))
}

#[tokio::test]
async fn preflights_from_a_configured_origin_are_answered_without_credentials() {
    let gw = with_cors().await;
    for path in [
        "/v1/chat/completions",
        "/v1/sessions",
        "/v1/sbp/sessions/0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b/memory",
    ] {
        let (status, h, _) = preflight(&gw, APP, path).await;
        assert!((200..300).contains(&status), "{path}: {status}");
        assert_eq!(header(&h, "access-control-allow-origin"), APP, "{path}");
        let methods = items(&h, "access-control-allow-methods");
        for m in ["get", "post", "put", "patch", "delete"] {
            assert!(methods.contains(&m.to_owned()), "{m}: {methods:?}");
        }
        let allowed = items(&h, "access-control-allow-headers");
        for name in [
            "authorization",
            "content-type",
            "x-session-token",
            "x-agent-id",
            "idempotency-key",
            "x-sbp-auto-resume",
            "x-request-id",
        ] {
            assert!(allowed.contains(&name.to_owned()), "{name}: {allowed:?}");
        }
        assert!(
            h.get("access-control-allow-credentials").is_none(),
            "no cookies are involved"
        );
        assert!(!header(&h, "access-control-max-age").is_empty());
    }
    // The default port of the scheme, written or not, is the same origin.
    let gw_default = TestGateway::with(Options {
        config: GatewayConfig {
            cors_origins: vec![PublicUrl::parse_origin("https://app.example").expect("origin")],
            ..sbp_test_support::config()
        },
        ..Options::default()
    })
    .await;
    let (status, h, _) = preflight(&gw_default, "https://app.example:443", "/v1/sessions").await;
    assert!((200..300).contains(&status), "{status}");
    assert_eq!(
        header(&h, "access-control-allow-origin"),
        "https://app.example:443"
    );
}

#[tokio::test]
async fn preflights_and_requests_from_other_origins_are_refused() {
    let gw = with_cors().await;
    for origin in [
        "http://evil.example",
        "http://app.example:3001",
        "https://app.example:3000",
        "null",
    ] {
        let (status, h, body) = preflight(&gw, origin, "/v1/chat/completions").await;
        assert_eq!(status, 403, "{origin}: {body}");
        assert!(body.contains("SBP_FORBIDDEN"), "{body}");
        assert!(h.get("access-control-allow-origin").is_none(), "{origin}");
        let (status, h, body) = gw
            .post(
                "/v1/sessions",
                json!({}),
                &[("origin", origin), ("authorization", "Bearer operator-key")],
            )
            .await;
        assert_eq!(status, 403, "{origin}: {body}");
        assert!(h.get("access-control-allow-origin").is_none(), "{origin}");
    }
}

#[tokio::test]
async fn a_cross_origin_completion_from_the_configured_origin_exposes_its_headers() {
    let gw = with_cors().await;
    let bearer = format!("Bearer {KEY}");
    let hello = json!({"model": "sbp/echo", "messages": [{"role": "user", "content": "hi"}]});
    let (status, h, body) = gw
        .chat(
            hello.clone(),
            &[("origin", APP), ("authorization", bearer.as_str())],
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(header(&h, "access-control-allow-origin"), APP);
    let exposed = items(&h, "access-control-expose-headers");
    for name in [
        "x-session-id",
        "x-agent-id",
        "x-session-token",
        "idempotent-replayed",
        "x-request-id",
        "retry-after",
    ] {
        assert!(exposed.contains(&name.to_owned()), "{name}: {exposed:?}");
    }
    assert!(items(&h, "vary").contains(&"origin".to_owned()));
    let token = header(&h, "x-session-token").to_owned();
    assert!(!token.is_empty());
    // The app continues the session with the token it read, and a replay says so.
    for replayed in [false, true] {
        let (status, h, body) = gw
            .chat(
                json!({"messages": [{"role": "user", "content": "again"}]}),
                &[
                    ("origin", APP),
                    ("authorization", bearer.as_str()),
                    ("x-session-token", token.as_str()),
                    ("idempotency-key", "app-1"),
                ],
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(header(&h, "access-control-allow-origin"), APP);
        assert_eq!(h.contains_key("idempotent-replayed"), replayed);
    }
    // Errors reach the app too, so it can tell the user what went wrong.
    let (status, h, body) = gw.chat(hello, &[("origin", APP)]).await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(header(&h, "access-control-allow-origin"), APP);
    assert_eq!(body["error"]["code"], "SBP_UNAUTHORIZED");
}

#[tokio::test]
async fn without_cors_origins_cross_site_requests_stay_refused() {
    let gw = TestGateway::start().await;
    let (status, h, body) = preflight(&gw, APP, "/v1/chat/completions").await;
    assert_eq!(status, 403, "{body}");
    assert!(h.get("access-control-allow-origin").is_none());
    let (status, h, body) = gw
        .chat(
            json!({"messages": [{"role": "user", "content": "hi"}]}),
            &[("origin", APP)],
        )
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(h.get("access-control-allow-origin").is_none());
    // Same-origin calls are what they were: no CORS headers, and no preflight answered.
    let (status, h, _) = gw
        .post("/v1/sessions", json!({}), &[("origin", gw.url.as_str())])
        .await;
    assert_eq!(status, 201);
    assert!(h.get("access-control-allow-origin").is_none());
    let (status, ..) = preflight(&gw, gw.url.as_str(), "/v1/sessions").await;
    assert_eq!(status, 405, "OPTIONS is not a method of the API");
}

#[tokio::test]
async fn the_page_keeps_its_strict_policy_with_cors_on() {
    for gw in [with_cors().await, TestGateway::start().await] {
        for origin in [None, Some(APP)] {
            let headers: Vec<(&str, &str)> = origin.map(|o| ("origin", o)).into_iter().collect();
            let resp = gw
                .request(Method::GET, "/", &headers)
                .send()
                .await
                .expect("GET /");
            let status = resp.status().as_u16();
            if origin.is_some() && gw.gateway.config().cors_origins.is_empty() {
                assert_eq!(status, 403, "another origin, without CORS");
                continue;
            }
            assert_eq!(status, 200);
            assert_eq!(header(resp.headers(), "content-security-policy"), CSP);
            assert_eq!(header(resp.headers(), "x-frame-options"), "DENY");
        }
    }
}

/// The app may open a surface's WebSocket too (browsers send `Origin` on the handshake, and CORS
/// does not apply to it); another origin still may not.
#[tokio::test]
async fn the_configured_origin_may_open_a_surface_websocket() {
    let gw = with_cors().await;
    let bearer = format!("Bearer {KEY}");
    let (status, _, created) = gw
        .post(
            "/v1/sessions",
            json!({}),
            &[("origin", APP), ("authorization", bearer.as_str())],
        )
        .await;
    assert_eq!(status, 201, "{created}");
    let (id, token) = (
        created["session_id"].as_str().expect("id"),
        created["session_token"].as_str().expect("token"),
    );
    let url = format!("{}/v1/sbp/ws/{id}", gw.ws_base);
    let mut req = url.as_str().into_client_request().expect("request");
    req.headers_mut()
        .insert("origin", "http://evil.example".parse().expect("header"));
    match tokio_tungstenite::connect_async(req).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status().as_u16(), 403);
        }
        other => panic!("another origin's handshake must be refused, got {other:?}"),
    }
    let mut req = url.as_str().into_client_request().expect("request");
    req.headers_mut()
        .insert("origin", APP.parse().expect("header"));
    let (stream, _) = tokio_tungstenite::connect_async(req)
        .await
        .expect("the app's handshake passes");
    let mut ws = Ws { stream };
    ws.send(json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token}))
        .await;
    assert_eq!(ws.recv().await["type"], "SESSION_ATTACHED");
}

#[tokio::test]
async fn with_cors_on_an_options_that_is_no_preflight_is_still_405() {
    let gw = with_cors().await;
    for headers in [vec![], vec![("origin", APP)]] {
        for path in ["/v1/sessions", "/v1/sbp/sessions/x/mcp", "/nowhere"] {
            let resp = gw
                .request(reqwest::Method::OPTIONS, path, &headers)
                .send()
                .await
                .expect("sent");
            assert_eq!(resp.status().as_u16(), 405, "{path} {headers:?}");
            assert!(resp.headers().get("access-control-allow-origin").is_none());
        }
    }
    // A real preflight from the configured origin is still answered.
    let (status, h, _) = preflight(&gw, APP, "/v1/sessions").await;
    assert_eq!(status, 200);
    assert_eq!(header(&h, "access-control-allow-origin"), APP);
}
