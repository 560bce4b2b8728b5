//! The HTTP edge as an attacker or a careless client meets it: JSON endpoints take only JSON, the
//! `Host` and a browser's `Origin` must be this gateway's, rate limits per address, session,
//! operator key and failed authentication, and every error, whichever layer makes it, in the
//! envelope. Malformed requests go over raw TCP, so nothing on the client side tidies them up.

use std::num::NonZeroU32;
use std::time::Duration;

use sbp_gateway::{GatewayConfig, Rate, RateLimits};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;

use crate::support::{Options, TestGateway, TestGatewayExt, WAIT, Ws};

/// An HTTP response read off the wire.
#[derive(Debug)]
struct Raw {
    status: u16,
    /// Names in lower case.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&self.body).into_owned()))
    }

    /// The envelope's code; fails the test when the body is not the envelope.
    fn code(&self) -> String {
        let v = self.json();
        let code = v["error"]["code"].as_str().unwrap_or_default();
        assert!(
            code.starts_with("SBP_") && v["error"]["message"].is_string(),
            "{} is not the error envelope: {v}",
            self.status
        );
        assert_eq!(self.header("content-type"), Some("application/json"), "{v}");
        code.to_owned()
    }
}

fn authority(gw: &TestGateway) -> &str {
    gw.url.trim_start_matches("http://")
}

/// Sends `head` (the request line, then header lines; `Host` is added unless given) and `body` on
/// a fresh connection, and reads the whole response.
async fn raw(gw: &TestGateway, head: &str, body: &[u8]) -> Raw {
    let mut text = head.trim_end().replace('\n', "\r\n");
    if !head.to_ascii_lowercase().contains("\nhost:") {
        text.push_str(&format!("\r\nHost: {}", authority(gw)));
    }
    text.push_str(&format!(
        "\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    let mut bytes = text.into_bytes();
    bytes.extend_from_slice(body);
    let exchange = async {
        let mut tcp = tokio::net::TcpStream::connect(authority(gw))
            .await
            .expect("connect");
        tcp.write_all(&bytes).await.expect("write");
        let mut out = Vec::new();
        tcp.read_to_end(&mut out).await.expect("read");
        out
    };
    let out = tokio::time::timeout(WAIT, exchange)
        .await
        .unwrap_or_else(|_| panic!("no response within the wait to {head}"));
    parse(&out).unwrap_or_else(|| panic!("not an HTTP response: {}", String::from_utf8_lossy(&out)))
}

fn parse(out: &[u8]) -> Option<Raw> {
    let split = out.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&out[..split]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = out[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"))
    {
        body = dechunk(&body)?;
    }
    Some(Raw {
        status,
        headers,
        body,
    })
}

fn dechunk(mut rest: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Some(body);
        }
        body.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

fn rate(count: u32, per: Duration, burst: u32) -> Option<Rate> {
    Some(Rate {
        count: NonZeroU32::new(count).expect("non-zero"),
        period: per,
        burst: NonZeroU32::new(burst).expect("non-zero"),
    })
}

const HOUR: Duration = Duration::from_secs(3600);

async fn with_config(config: GatewayConfig) -> TestGateway {
    TestGateway::with(Options {
        config: GatewayConfig {
            secret: vec![7; 32],
            ..config
        },
        ..Options::default()
    })
    .await
}

/// Defect 9: a cross-site page can send `text/plain` and form bodies without a preflight; the
/// gateway must not read them as JSON.
#[tokio::test]
async fn json_endpoints_take_only_bodies_sent_as_json() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.idle_session().await;
    let chat = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
    for (path, body) in [
        ("/v1/sessions", "{}"),
        ("/v1/chat/completions", chat),
        (
            &*format!("/v1/sbp/sessions/{id}/turns"),
            r#"{"content":"x"}"#,
        ),
        (&*format!("/v1/sbp/sessions/{id}/fork"), ""),
    ] {
        for content_type in [
            "text/plain",
            "text/plain;charset=UTF-8",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/json; charset=iso-8859-1",
            "application/jsonx",
        ] {
            let resp = raw(
                &gw,
                &format!(
                    "POST {path} HTTP/1.1\nContent-Type: {content_type}\nX-Session-Token: {token}"
                ),
                body.as_bytes(),
            )
            .await;
            assert_eq!(
                (resp.status, resp.code().as_str()),
                (415, "SBP_UNSUPPORTED_MEDIA_TYPE"),
                "{path} as {content_type}"
            );
        }
        let resp = raw(
            &gw,
            &format!("POST {path} HTTP/1.1\nX-Session-Token: {token}"),
            chat.as_bytes(),
        )
        .await;
        assert_eq!(resp.status, 415, "{path} with a body and no Content-Type");
    }
    // JSON, with parameters or a +json type, passes; so does a bodiless POST with no type.
    for content_type in [
        "application/json",
        "Application/JSON; charset=utf-8",
        "application/merge-patch+json",
    ] {
        let resp = raw(
            &gw,
            &format!("POST /v1/sessions HTTP/1.1\nContent-Type: {content_type}"),
            b"{}",
        )
        .await;
        assert_eq!(resp.status, 201, "{content_type}: {:?}", resp.json());
    }
    let resp = raw(&gw, "POST /v1/sessions HTTP/1.1", b"").await;
    assert_eq!(resp.status, 201, "{:?}", resp.json());
    let resp = raw(
        &gw,
        &format!("POST /v1/sbp/sessions/{id}/fork HTTP/1.1\nX-Session-Token: {token}"),
        b"",
    )
    .await;
    assert_eq!(resp.status, 201, "{:?}", resp.json());
}

/// Defect 9: DNS rebinding reaches a loopback gateway under the attacker's name; only the
/// gateway's own names pass.
#[tokio::test]
async fn foreign_host_names_are_refused() {
    let gw = TestGateway::start().await;
    for host in [
        "evil.example",
        "evil.example:80",
        "localhost.evil.example",
        "127.0.0.1.nip.io",
    ] {
        let resp = raw(
            &gw,
            &format!("GET /v1/sessions/x HTTP/1.1\nHost: {host}"),
            b"",
        )
        .await;
        assert_eq!(
            (resp.status, resp.code().as_str()),
            (403, "SBP_FORBIDDEN"),
            "{host}"
        );
        let resp = raw(
            &gw,
            &format!("POST /v1/sessions HTTP/1.1\nHost: {host}"),
            b"",
        )
        .await;
        assert_eq!(resp.status, 403, "{host}");
    }
    let port = authority(&gw).rsplit(':').next().expect("port");
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        "localhost".to_owned(),
        "LOCALHOST.:9".to_owned(),
        "app.localhost:1".to_owned(),
        format!("[::1]:{port}"),
        "192.0.2.10:8080".to_owned(),
    ] {
        let resp = raw(
            &gw,
            &format!("POST /v1/sessions HTTP/1.1\nHost: {host}"),
            b"",
        )
        .await;
        assert_eq!(resp.status, 201, "{host}: {:?}", resp.json());
    }
    // A load balancer's probe may use any name.
    let resp = raw(&gw, "GET /healthz HTTP/1.1\nHost: lb.internal", b"").await;
    assert_eq!(resp.status, 200);
}

/// Defect 9: a browser's cross-site request carries its page's `Origin`: refused, on the API and
/// on the page's own routes; the page's same-origin calls pass.
#[tokio::test]
async fn cross_origin_requests_are_refused_and_same_origin_ones_pass() {
    let gw = TestGateway::start().await;
    for origin in [
        "http://evil.example",
        "null",
        "http://localhost:1",
        "https://127.0.0.1",
    ] {
        let resp = raw(
            &gw,
            &format!(
                "POST /v1/sessions HTTP/1.1\nOrigin: {origin}\nContent-Type: application/json"
            ),
            b"{}",
        )
        .await;
        assert_eq!(
            (resp.status, resp.code().as_str()),
            (403, "SBP_FORBIDDEN"),
            "{origin}"
        );
    }
    // What the page does: load itself, then call the API from its own origin.
    let (s, _, _) = sbp_test_support::send(gw.request(reqwest::Method::GET, "/", &[])).await;
    assert_eq!(s, 200);
    let (s, _, v) = gw
        .post("/v1/sessions", json!({}), &[("origin", gw.url.as_str())])
        .await;
    assert_eq!(s, 201, "{v}");
    let token = v["session_token"].as_str().expect("token").to_owned();
    let id = v["session_id"].as_str().expect("id").to_owned();
    let (s, _, v) = gw
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
            &[("origin", gw.url.as_str()), ("x-session-token", &token)],
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = gw
        .get(
            &format!("/v1/sessions/{id}"),
            &[
                ("origin", "http://evil.example"),
                ("x-session-token", &token),
            ],
        )
        .await;
    assert_eq!(s, 403, "{v}");
}

/// Defect 9 and 10: what a page of another site makes a browser send without an `Origin` (an
/// image, a link) is refused as cross-site and costs the user's own address nothing.
#[tokio::test]
async fn cross_site_requests_do_not_spend_the_users_rate() {
    let gw = with_config(GatewayConfig {
        rate_limits: RateLimits {
            address: rate(1, HOUR, 3),
            ..RateLimits::off()
        },
        ..GatewayConfig::default()
    })
    .await;
    for _ in 0..10 {
        let resp = raw(
            &gw,
            "GET /v1/sessions/x HTTP/1.1\nSec-Fetch-Site: cross-site\nSec-Fetch-Mode: no-cors",
            b"",
        )
        .await;
        assert_eq!((resp.status, resp.code().as_str()), (403, "SBP_FORBIDDEN"));
    }
    // A link to the page from another site is a navigation: it opens.
    let resp = raw(
        &gw,
        "GET / HTTP/1.1\nSec-Fetch-Site: cross-site\nSec-Fetch-Mode: navigate\nSec-Fetch-Dest: document",
        b"",
    )
    .await;
    assert_eq!(resp.status, 200);
    for site in ["same-origin", "none"] {
        let resp = raw(
            &gw,
            &format!("POST /v1/sessions HTTP/1.1\nSec-Fetch-Site: {site}"),
            b"",
        )
        .await;
        assert_eq!(resp.status, 201, "{site}: {:?}", resp.json());
    }
}

/// Defect 9: browsers send `Origin` on a WebSocket handshake and no CORS protects it: a page of
/// another site must not open a surface's socket (cross-site WebSocket hijacking).
#[tokio::test]
async fn cross_site_websocket_handshakes_are_refused() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.idle_session().await;
    let url = format!("{}/v1/sbp/ws/{id}", gw.ws_base);
    let mut req = url.as_str().into_client_request().expect("request");
    req.headers_mut()
        .insert("origin", "http://evil.example".parse().expect("header"));
    match tokio_tungstenite::connect_async(req).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status().as_u16(), 403);
        }
        other => panic!("a cross-site handshake must be refused, got {other:?}"),
    }
    let mut req = url.as_str().into_client_request().expect("request");
    req.headers_mut()
        .insert("origin", gw.url.parse().expect("header"));
    let (stream, _) = tokio_tungstenite::connect_async(req)
        .await
        .expect("a same-origin handshake passes");
    let mut ws = Ws { stream };
    ws.send(json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token}))
        .await;
    assert_eq!(ws.recv().await["type"], "SESSION_ATTACHED");
}

/// Defect 9: `--public-url` adds the names a gateway is reached by (behind a proxy), and their
/// origins.
#[tokio::test]
async fn public_urls_add_names_and_origins() {
    let gw = with_config(GatewayConfig {
        public_urls: vec![
            "https://gw.example.com".parse().expect("url"),
            "http://gw.lan:8080".parse().expect("url"),
        ],
        ..GatewayConfig::default()
    })
    .await;
    for (host, origin, status) in [
        ("gw.example.com", "https://gw.example.com", 201),
        ("gw.example.com:443", "https://gw.example.com:443", 201),
        // A proxy that passes its own upstream name: the public origin is still accepted.
        ("127.0.0.1", "https://gw.example.com", 201),
        ("gw.lan:8080", "http://gw.lan:8080", 201),
        ("gw.lan", "http://gw.lan:8080", 201),
        ("gw.example.com", "http://gw.example.com:8443", 403),
        ("gw.example.com", "https://evil.example", 403),
        ("evil.example", "https://gw.example.com", 403),
    ] {
        let resp = raw(
            &gw,
            &format!("POST /v1/sessions HTTP/1.1\nHost: {host}\nOrigin: {origin}"),
            b"",
        )
        .await;
        assert_eq!(resp.status, status, "{host} {origin}: {:?}", resp.json());
    }
}

/// Defect 10: one address cannot send without limit, loopback included; the answer says when to
/// come back. Health checks are never limited.
#[tokio::test]
async fn an_address_over_its_rate_is_told_when_to_retry() {
    let gw = with_config(GatewayConfig {
        rate_limits: RateLimits {
            address: rate(1, HOUR, 3),
            ..RateLimits::off()
        },
        ..GatewayConfig::default()
    })
    .await;
    for _ in 0..3 {
        let (s, _, v) = gw.post("/v1/sessions", json!({}), &[]).await;
        assert_eq!(s, 201, "{v}");
    }
    let (s, headers, v) = gw.post("/v1/sessions", json!({}), &[]).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (429, Some("SBP_RATE_LIMITED")),
        "{v}"
    );
    assert_eq!(v["error"]["detail"]["limit"], "address", "{v}");
    let retry: u64 = headers["retry-after"]
        .to_str()
        .expect("ascii")
        .parse()
        .expect("whole seconds");
    assert!((3000..=3600).contains(&retry), "{retry}");
    assert_eq!(v["error"]["detail"]["retry_after"], retry);
    // Every route counts, the WebSocket handshake too; /healthz does not.
    let resp = raw(&gw, "GET /v1/sbp/ws/x HTTP/1.1", b"").await;
    assert_eq!(resp.status, 429);
    let resp = raw(&gw, "GET /healthz HTTP/1.1", b"").await;
    assert_eq!(resp.status, 200);
}

/// Defect 10: a session's budget is its own, spent only by callers holding its credentials, and
/// completions continuing it count too.
#[tokio::test]
async fn a_session_over_its_rate_is_limited_alone() {
    let gw = with_config(GatewayConfig {
        rate_limits: RateLimits {
            session: rate(1, HOUR, 3),
            ..RateLimits::off()
        },
        ..GatewayConfig::default()
    })
    .await;
    let (a, token_a) = gw.idle_session().await;
    let (b, token_b) = gw.idle_session().await;
    // Without the token, nobody uses up session a's budget.
    for _ in 0..5 {
        let (s, v) = gw
            .get(
                &format!("/v1/sessions/{a}"),
                &[("x-session-token", "wrong")],
            )
            .await;
        assert_eq!(s, 403, "{v}");
    }
    for _ in 0..2 {
        gw.session_view(&a, &token_a).await;
    }
    let (s, _, v) = gw
        .chat(
            json!({"messages": [{"role": "user", "content": "hi"}]}),
            &[("x-session-token", &token_a)],
        )
        .await;
    assert_eq!(s, 200, "the third request: {v}");
    let (s, _, v) = gw
        .chat(
            json!({"messages": [{"role": "user", "content": "again"}]}),
            &[("x-session-token", &token_a)],
        )
        .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (429, Some("SBP_RATE_LIMITED")),
        "{v}"
    );
    assert_eq!(v["error"]["detail"]["limit"], "session", "{v}");
    let (s, _, v) = gw
        .post(
            &format!("/v1/sbp/sessions/{a}/turns"),
            json!({"content": "pushed"}),
            &[("x-session-token", &token_a)],
        )
        .await;
    assert_eq!(s, 429, "{v}");
    gw.session_view(&b, &token_b).await;
    let metrics = gw.metrics_text().await;
    assert!(
        metrics.contains("sbp_rate_limited_total{limit=\"session\"} 2\n"),
        "{metrics}"
    );
}

/// Defect 10: each operator key has a bucket of its own, in place of its address's.
#[tokio::test]
async fn each_operator_key_has_its_own_bucket() {
    let gw = with_config(GatewayConfig {
        api_keys: vec!["key-one".into(), "key-two".into()],
        rate_limits: RateLimits {
            operator_key: rate(1, HOUR, 2),
            address: rate(1, HOUR, 1),
            ..RateLimits::off()
        },
        ..GatewayConfig::default()
    })
    .await;
    let one = [("authorization", "Bearer key-one")];
    for _ in 0..2 {
        let (s, _, v) = gw.post("/v1/sessions", json!({}), &one).await;
        assert_eq!(s, 201, "{v}");
    }
    let (s, _, v) = gw.post("/v1/sessions", json!({}), &one).await;
    assert_eq!(
        (s, v["error"]["detail"]["limit"].as_str()),
        (429, Some("operator_key")),
        "{v}"
    );
    let two = [("authorization", "Bearer key-two")];
    for _ in 0..2 {
        let (s, _, v) = gw.post("/v1/sessions", json!({}), &two).await;
        assert_eq!(s, 201, "{v}");
    }
    // A wrong key is no key: the address's bucket (one request) applies.
    let bad = [("authorization", "Bearer nope")];
    let (s, _, _) = gw.post("/v1/sessions", json!({}), &bad).await;
    assert_eq!(s, 401);
    let (s, _, v) = gw.post("/v1/sessions", json!({}), &bad).await;
    assert_eq!(
        (s, v["error"]["detail"]["limit"].as_str()),
        (429, Some("address")),
        "{v}"
    );
}

/// Defect 10: wrong-token guesses are counted per address; once the allowance is used up the
/// address is refused, a right guess included, until it refills.
#[tokio::test]
async fn failed_authentications_block_the_address_even_for_a_right_token() {
    let gw = with_config(GatewayConfig {
        api_keys: vec!["the-operator-key".into()],
        rate_limits: RateLimits {
            auth_failures: rate(1, HOUR, 3),
            ..RateLimits::off()
        },
        ..GatewayConfig::default()
    })
    .await;
    let key = [("authorization", "Bearer the-operator-key")];
    let (s, _, v) = gw.post("/v1/sessions", json!({}), &key).await;
    assert_eq!(s, 201, "{v}");
    let id = v["session_id"].as_str().expect("id").to_owned();
    let path = format!("/v1/sessions/{id}");
    // A request with no credential guesses nothing: not counted.
    for _ in 0..5 {
        let (s, v) = gw.get(&path, &[]).await;
        assert_eq!(s, 401, "{v}");
    }
    for guess in ["a", "b", "c", "d"] {
        let (s, v) = gw
            .get(&path, &[("authorization", &format!("Bearer {guess}"))])
            .await;
        assert_eq!(s, 401, "{v}");
    }
    let (s, v) = gw.get(&path, &key).await;
    assert_eq!(
        (s, v["error"]["detail"]["limit"].as_str()),
        (429, Some("auth_failures")),
        "{v}"
    );
    assert_eq!(v["error"]["code"], "SBP_RATE_LIMITED");
}

/// Defect 11: the MCP endpoint's errors are the envelope with the right status (invalid JSON was
/// a plain-text 415).
#[tokio::test]
async fn mcp_endpoint_errors_are_envelopes() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.idle_session().await;
    let path = format!("/v1/sbp/sessions/{id}/mcp");
    let accept = "Accept: application/json, text/event-stream";
    let json_head = format!(
        "POST {path} HTTP/1.1\n{accept}\nContent-Type: application/json\nX-Session-Token: {token}"
    );
    let cases: Vec<(String, &[u8], u16, &str)> = vec![
        (json_head.clone(), b"{not json", 400, "SBP_BAD_REQUEST"),
        (json_head.clone(), b"[1, 2]", 400, "SBP_BAD_REQUEST"),
        (
            json_head.clone(),
            br#"{"hello": "world"}"#,
            400,
            "SBP_BAD_REQUEST",
        ),
        (
            format!(
                "POST {path} HTTP/1.1\n{accept}\nContent-Type: text/plain\nX-Session-Token: {token}"
            ),
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            415,
            "SBP_UNSUPPORTED_MEDIA_TYPE",
        ),
        (
            format!(
                "POST {path} HTTP/1.1\nContent-Type: application/json\nX-Session-Token: {token}"
            ),
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            406,
            "SBP_NOT_ACCEPTABLE",
        ),
        (
            format!("GET {path} HTTP/1.1\n{accept}\nX-Session-Token: {token}"),
            b"",
            405,
            "SBP_METHOD_NOT_ALLOWED",
        ),
        (
            format!("DELETE {path} HTTP/1.1\nX-Session-Token: {token}"),
            b"",
            405,
            "SBP_METHOD_NOT_ALLOWED",
        ),
        (
            format!("POST {path} HTTP/1.1\n{accept}\nContent-Type: application/json"),
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            401,
            "SBP_UNAUTHORIZED",
        ),
    ];
    for (head, body, status, code) in cases {
        let resp = raw(&gw, &head, body).await;
        assert_eq!(
            (resp.status, resp.code().as_str()),
            (status, code),
            "{head} {}",
            String::from_utf8_lossy(body)
        );
        if status == 405 {
            assert_eq!(resp.header("allow"), Some("POST"));
        }
    }
    // A well-formed request still reaches the MCP server.
    let resp = raw(
        &gw,
        &json_head,
        br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}"#,
    )
    .await;
    assert_eq!(resp.status, 200, "{:?}", resp.json());
    assert_eq!(resp.json()["jsonrpc"], "2.0");
}

/// Defect 11: a plain GET on the WebSocket route is told to upgrade, in the envelope.
#[tokio::test]
async fn a_plain_get_on_the_websocket_route_is_told_to_upgrade() {
    let gw = TestGateway::start().await;
    let (id, _) = gw.idle_session().await;
    let resp = raw(&gw, &format!("GET /v1/sbp/ws/{id} HTTP/1.1"), b"").await;
    assert_eq!(
        (resp.status, resp.code().as_str()),
        (426, "SBP_UPGRADE_REQUIRED")
    );
    assert_eq!(resp.header("upgrade"), Some("websocket"));
    let resp = raw(
        &gw,
        &format!(
            "GET /v1/sbp/ws/{id} HTTP/1.1\nConnection: Upgrade\nUpgrade: websocket\n\
             Sec-WebSocket-Version: 8\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="
        ),
        b"",
    )
    .await;
    assert_eq!(
        (resp.status, resp.code().as_str()),
        (426, "SBP_UPGRADE_REQUIRED")
    );
    assert_eq!(resp.header("sec-websocket-version"), Some("13"));
    let resp = raw(
        &gw,
        &format!("GET /v1/sbp/ws/{id} HTTP/1.1\nConnection: Upgrade\nUpgrade: websocket\nSec-WebSocket-Version: 13"),
        b"",
    )
    .await;
    assert_eq!(
        (resp.status, resp.code().as_str()),
        (400, "SBP_BAD_REQUEST")
    );
}

/// Defect 11: a percent-encoded path id that is not UTF-8 is a 400 in the envelope.
#[tokio::test]
async fn a_path_id_that_is_not_utf8_is_a_bad_request() {
    let gw = TestGateway::start().await;
    for path in [
        "/v1/sessions/%FF",
        "/v1/sbp/sessions/%C3/messages",
        "/v1/sbp/ws/%80%80",
        "/v1/sbp/token/%FE",
        "/v1/sbp/sessions/%FF/mcp",
        "/assets/%FF.js",
    ] {
        let resp = raw(&gw, &format!("GET {path} HTTP/1.1"), b"").await;
        assert_eq!(
            (resp.status, resp.code().as_str()),
            (400, "SBP_BAD_REQUEST"),
            "{path}"
        );
    }
}

/// Defect 11: a few dozen malformed requests across every route: none gets a 5xx, and every error
/// is the envelope.
#[tokio::test]
async fn malformed_requests_never_get_a_5xx_or_a_bare_error() {
    let gw = TestGateway::start().await;
    let (id, token) = gw.idle_session().await;
    let t = format!("X-Session-Token: {token}");
    let json = "Content-Type: application/json";
    let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    let big_number = format!(r#"{{"content": "x", "role": {}}}"#, "9".repeat(400));
    let session_posts = ["turns", "export", "handoff", "fork", "tool_calls", "status"];
    let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
    for tail in session_posts {
        for body in [
            "{not json",
            "[1,2]",
            "\"text\"",
            "null",
            "{\"a\":",
            &deep,
            &big_number,
        ] {
            cases.push((
                format!("POST /v1/sbp/sessions/{id}/{tail} HTTP/1.1\n{json}\n{t}"),
                body.as_bytes().to_vec(),
            ));
        }
        cases.push((
            format!("POST /v1/sbp/sessions/{id}/{tail} HTTP/1.1\n{json}\n{t}"),
            vec![0xff, 0xfe, b'{', b'}'],
        ));
        cases.push((
            format!("DELETE /v1/sbp/sessions/{id}/{tail} HTTP/1.1\n{t}"),
            Vec::new(),
        ));
    }
    for (head, body) in [
        (
            format!("POST /v1/chat/completions HTTP/1.1\n{json}"),
            "{\"messages\": 5}".to_owned(),
        ),
        (
            format!("POST /v1/chat/completions HTTP/1.1\n{json}"),
            "{\"messages\": [{}]}".to_owned(),
        ),
        (
            format!("POST /v1/chat/completions HTTP/1.1\n{json}"),
            deep.clone(),
        ),
        (
            format!("POST /v1/chat/completions HTTP/1.1\n{json}\nIdempotency-Key: k"),
            "{".to_owned(),
        ),
        (
            format!("POST /v1/chat/completions HTTP/1.1\n{json}\n{t}"),
            r#"{"messages":[{"role":"user","content":"x"}],"sbp":5}"#.to_owned(),
        ),
        (
            format!("POST /v1/sbp/sessions/import HTTP/1.1\n{json}"),
            r#"{"bundle": {"bundle_cid": 5}}"#.to_owned(),
        ),
        (
            format!("POST /v1/sbp/sessions/import HTTP/1.1\n{json}"),
            r#"{"roaming_token": "a.b.c"}"#.to_owned(),
        ),
        (
            format!("PUT /v1/sbp/sessions/{id}/memory HTTP/1.1\n{json}\n{t}"),
            "[]".to_owned(),
        ),
        (
            format!("PATCH /v1/sbp/sessions/{id}/status HTTP/1.1\n{json}\n{t}"),
            r#"{"status": 5}"#.to_owned(),
        ),
        (
            format!("PATCH /v1/sbp/sessions/{id}/status HTTP/1.1\ncontent-type: text/plain\n{t}"),
            "{}".to_owned(),
        ),
        (
            format!("GET /v1/sbp/sessions/{id}/messages?limit=abc&after=-1 HTTP/1.1\n{t}"),
            String::new(),
        ),
        (
            format!("GET /v1/sbp/sessions/{id}/messages?limit=%FF HTTP/1.1\n{t}"),
            String::new(),
        ),
        (
            "GET /v1/sessions/not-a-uuid HTTP/1.1".to_owned(),
            String::new(),
        ),
        ("GET /v1/sessions/%00 HTTP/1.1".to_owned(), String::new()),
        (
            "GET /v1/sessions/%E2%98%83 HTTP/1.1".to_owned(),
            String::new(),
        ),
        (
            format!("GET /v1/sessions/{} HTTP/1.1", "a".repeat(4000)),
            String::new(),
        ),
        (
            "GET /v1/sbp/token/not.a.token HTTP/1.1".to_owned(),
            String::new(),
        ),
        ("GET /v1/sbp/token/%FF HTTP/1.1".to_owned(), String::new()),
        ("GET /v1/sbp/ws/x HTTP/1.1".to_owned(), String::new()),
        ("POST /v1/sbp/ws/x HTTP/1.1".to_owned(), String::new()),
        (
            "GET /v1/sbp/ws/x HTTP/1.1\nConnection: Upgrade\nUpgrade: h2c".to_owned(),
            String::new(),
        ),
        (
            format!("GET /v1/sbp/sessions/{id}/mcp HTTP/1.1\n{t}"),
            String::new(),
        ),
        (
            format!("POST /v1/sbp/sessions/{id}/mcp HTTP/1.1\n{json}\n{t}"),
            "{}".to_owned(),
        ),
        ("GET /nowhere HTTP/1.1".to_owned(), String::new()),
        ("GET /assets/nothing.js HTTP/1.1".to_owned(), String::new()),
        (
            "GET /assets/..%2F..%2Fetc%2Fpasswd HTTP/1.1".to_owned(),
            String::new(),
        ),
        ("DELETE / HTTP/1.1".to_owned(), String::new()),
        (
            "GET /v1/sessions/x HTTP/1.1\nHost: bad host".to_owned(),
            String::new(),
        ),
        (
            "GET /v1/sessions/x HTTP/1.1\nOrigin: ::::".to_owned(),
            String::new(),
        ),
        (
            "POST /v1/sessions HTTP/1.1\nContent-Type: ;;;".to_owned(),
            "{}".to_owned(),
        ),
        (
            "POST /v1/sessions HTTP/1.1\nContent-Type: application/json; charset".to_owned(),
            "{}".to_owned(),
        ),
    ] {
        cases.push((head, body.into_bytes()));
    }
    assert!(cases.len() >= 60, "{}", cases.len());
    for (head, body) in &cases {
        let resp = raw(&gw, head, body).await;
        assert!(
            resp.status < 500,
            "{head}: {} {:?}",
            resp.status,
            resp.json()
        );
        if resp.status >= 400 {
            resp.code();
        }
    }
    // And the gateway still serves.
    gw.session_view(&id, &token).await;
}
