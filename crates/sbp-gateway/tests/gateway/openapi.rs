//! The OpenAPI document against the real gateway: the committed `docs/openapi.json` is what
//! `GET /openapi.json` serves, every documented route and method is routed and every route of the
//! router is documented, and what the endpoints answer, successes and errors, validates against
//! the document's schema for that status (a JSON Schema 2020-12 validator over the document's own
//! components).

use std::sync::Arc;
use std::time::Duration;

use reqwest::Method;
use reqwest::header::HeaderMap;
use sbp_gateway::GatewayConfig;
use sbp_gateway::config::FederationConfig;
use sbp_protocol::federation::{IdentityKey, Role};
use serde_json::{Value, json};

use crate::support::{Options, TestGateway, TestGatewayExt};

/// The committed document, from the crate's directory.
fn committed_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json")
}

async fn served(gw: &TestGateway) -> (HeaderMap, String) {
    let resp = gw
        .request(Method::GET, "/openapi.json", &[])
        .send()
        .await
        .expect("GET /openapi.json");
    assert_eq!(resp.status(), 200);
    let headers = resp.headers().clone();
    (headers, resp.text().await.expect("the document"))
}

/// The served document and what it says, for checking answers against it.
struct Api {
    doc: Value,
}

impl Api {
    async fn of(gw: &TestGateway) -> Self {
        let (_, text) = served(gw).await;
        Self {
            doc: serde_json::from_str(&text).expect("the document is JSON"),
        }
    }

    /// `#/...` in the document.
    fn resolve<'a>(&'a self, v: &'a Value) -> &'a Value {
        match v.get("$ref").and_then(Value::as_str) {
            Some(r) => self
                .doc
                .pointer(r.strip_prefix('#').expect("a local $ref"))
                .unwrap_or_else(|| panic!("{r} resolves")),
            None => v,
        }
    }

    fn operation(&self, method: &str, template: &str) -> &Value {
        self.doc["paths"]
            .get(template)
            .and_then(|item| item.get(method.to_ascii_lowercase()))
            .unwrap_or_else(|| panic!("{method} {template} is documented"))
    }

    /// Checks an answer of `method template` against the document: its status is documented,
    /// its media type is one the status has, its body validates against that type's schema, and
    /// the headers the status always sends are there.
    fn check(&self, method: &str, template: &str, status: u16, headers: &HeaderMap, body: &Value) {
        let problems = self.problems(method, template, status, headers, body);
        assert!(
            problems.is_empty(),
            "{method} {template} -> {status} is not as documented:\n{}\nbody: {body}",
            problems.join("\n")
        );
    }

    /// What differs between an answer and the document (see [`Api::check`]).
    fn problems(
        &self,
        method: &str,
        template: &str,
        status: u16,
        headers: &HeaderMap,
        body: &Value,
    ) -> Vec<String> {
        let op = self.operation(method, template);
        let Some(reply) = op["responses"].get(status.to_string()) else {
            return vec![format!("status {status} is not documented")];
        };
        let reply = self.resolve(reply);
        let mut problems: Vec<String> = reply["headers"]
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(name, h)| {
                self.resolve(h)["required"] == true && !headers.contains_key(name.as_str())
            })
            .map(|(name, _)| format!("{name} is not sent"))
            .collect();
        let Some(content) = reply["content"].as_object() else {
            if !body.as_str().is_some_and(str::is_empty) {
                problems.push("a body where none is documented".into());
            }
            return problems;
        };
        let media = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(|t| t.split(';').next().unwrap_or("").trim().to_owned())
            .unwrap_or_default();
        let Some(schema) = content
            .get(&media)
            .or_else(|| content.get("*/*"))
            .and_then(|c| c.get("schema"))
        else {
            problems.push(format!("{media} is not documented"));
            return problems;
        };
        if media != "application/json" {
            if !body.is_string() {
                problems.push(format!("a {media} body that is JSON"));
            }
            return problems;
        }
        // The schema with the document's components beside it, so its `$ref`s resolve.
        let root = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "allOf": [schema],
            "components": self.doc["components"],
        });
        let validator = jsonschema::validator_for(&root).expect("the schema compiles");
        problems.extend(
            validator
                .iter_errors(body)
                .map(|e| format!("{e} at {}", e.instance_path())),
        );
        problems
    }

    /// Sends `method path` and checks the answer as an answer of `template`.
    async fn call(
        &self,
        gw: &TestGateway,
        method: Method,
        template: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> (u16, HeaderMap, Value) {
        let mut req = gw.request(method.clone(), path, headers);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let (status, h, v) = sbp_test_support::send(req).await;
        self.check(method.as_str(), template, status, &h, &v);
        (status, h, v)
    }
}

#[tokio::test]
async fn the_committed_document_is_the_one_served() {
    let gw = TestGateway::start().await;
    let (headers, text) = served(&gw).await;
    assert_eq!(headers["content-type"], "application/json");
    let path = committed_path();
    if std::env::var_os("SBP_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &text).expect("write docs/openapi.json");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == text,
        "docs/openapi.json is not what the gateway serves at /openapi.json; regenerate it with\n  \
         SBP_BLESS=1 cargo test -p sbp-gateway --test gateway openapi::the_committed\n\
         or\n  cargo run -q -p sbp-cli -- openapi > docs/openapi.json"
    );
}

/// Every `$ref` resolves, operation ids are unique, path parameters are declared, and each
/// operation documents its errors in the envelope.
#[tokio::test]
async fn the_document_is_whole() {
    let gw = TestGateway::start().await;
    let api = Api::of(&gw).await;
    assert_eq!(api.doc["openapi"], "3.1.0");
    fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::Object(m) => m.iter().for_each(|(k, v)| match (k.as_str(), v) {
                ("$ref", Value::String(r)) => out.push(r),
                _ => refs(v, out),
            }),
            Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&api.doc, &mut all);
    for r in all {
        let pointer = r.strip_prefix('#').expect("local refs only");
        assert!(api.doc.pointer(pointer).is_some(), "{r} resolves");
    }
    let mut ids = std::collections::HashSet::new();
    let envelope = json!({"$ref": "#/components/schemas/ErrorBody"});
    for (path, item) in api.doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("path item") {
            let id = op["operationId"].as_str().expect("an operationId");
            assert!(ids.insert(id.to_owned()), "{id} is unique");
            let declared: Vec<&str> = op["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| api.resolve(p))
                .filter(|p| p["in"] == "path")
                .filter_map(|p| p["name"].as_str())
                .collect();
            let in_path: Vec<&str> = path
                .split('/')
                .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
                .collect();
            assert_eq!(declared, in_path, "{method} {path}");
            let default = api.resolve(&op["responses"]["default"]);
            assert_eq!(
                default["content"]["application/json"]["schema"], envelope,
                "{method} {path}"
            );
        }
    }
    let error = &api.doc["components"]["schemas"]["ErrorDetail"];
    assert_ne!(
        error["additionalProperties"], false,
        "the envelope may gain fields"
    );
}

/// A gateway with federation on (both roles): every route of the API is served.
async fn federated() -> TestGateway {
    let key = IdentityKey::from_seed([9; 32]);
    let first_public_key = key.public_key();
    let federation = FederationConfig {
        role: Role::Both,
        gateway_name: "openapi-test".into(),
        key: Arc::new(key),
        first_public_key,
        old_keys: Vec::new(),
        peers: Vec::new(),
        trackers: Vec::new(),
        peer_srv: Vec::new(),
        dns_server: None,
        tofu: false,
        allow_http: false,
        announce_exports: false,
        announce_ttl: Duration::from_secs(3600),
        tracker_max_records: 100,
        tracker_announce_rate: None,
        handover_lease: Duration::from_secs(30),
    };
    TestGateway::with(Options {
        config: GatewayConfig {
            federation: Some(federation),
            ..sbp_test_support::config()
        },
        ..Options::default()
    })
    .await
}

/// The routes the router declares (`.route("PATH", get(..).post(..))` and `.route_service`, in
/// `src/transport/`), as (path with its parameters unnamed, methods; none for a service, which
/// takes any method).
fn declared_routes() -> Vec<(String, Vec<String>)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/transport");
    let mut routes = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("src/transport") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("source");
        for (at, _) in text.match_indices(".route") {
            let rest = &text[at..];
            let Some(open) = rest.find('(') else { continue };
            if !matches!(&rest[..open], ".route" | ".route_service") {
                continue;
            }
            // The call's text, to its closing parenthesis.
            let mut depth = 0;
            let end = rest[open..]
                .char_indices()
                .find_map(|(i, c)| {
                    match c {
                        '(' => depth += 1,
                        ')' => depth -= 1,
                        _ => {}
                    }
                    (depth == 0).then_some(open + i)
                })
                .expect("a closed call");
            let call = &rest[open + 1..end];
            let Some(route) = call.split('"').nth(1) else {
                continue;
            };
            let methods = ["get", "post", "put", "patch", "delete"]
                .into_iter()
                .filter(|m| {
                    call.match_indices(&format!("{m}("))
                        .any(|(i, _)| i == 0 || !call.as_bytes()[i - 1].is_ascii_alphanumeric())
                })
                .map(str::to_owned)
                .collect();
            routes.push((unnamed(route), methods));
        }
    }
    routes
}

/// A path with its parameters' names left out (`/v1/models/{}`).
fn unnamed(path: &str) -> String {
    path.split('/')
        .map(|seg| if seg.starts_with('{') { "{}" } else { seg })
        .collect::<Vec<_>>()
        .join("/")
}

/// The other direction: every route of the router has its operations in the document (but the
/// conformance suite's test hook), so a new route cannot go undocumented.
#[tokio::test]
async fn every_route_is_documented() {
    let gw = TestGateway::start().await;
    let api = Api::of(&gw).await;
    let documented: Vec<(String, Vec<String>)> = api.doc["paths"]
        .as_object()
        .expect("paths")
        .iter()
        .map(|(p, item)| {
            let methods = item.as_object().expect("item").keys().cloned().collect();
            (unnamed(p), methods)
        })
        .collect();
    let routes = declared_routes();
    assert!(routes.len() >= 35, "the routes were found: {routes:?}");
    for (route, methods) in routes {
        if route.contains("/_test/") {
            continue;
        }
        let Some((_, doc_methods)) = documented.iter().find(|(p, _)| *p == route) else {
            panic!("{route} is routed but not in the OpenAPI document (transport/openapi.rs)");
        };
        for m in methods {
            assert!(
                doc_methods.contains(&m),
                "{} {route} is not documented",
                m.to_uppercase()
            );
        }
    }
}

/// Whether an answer came from a route rather than the router's "no such endpoint" or "method not
/// allowed".
fn routed(status: u16, body: &Value) -> bool {
    status != 405 && !(status == 404 && body["error"]["message"] == "no such endpoint")
}

/// The router knows every documented path and method: none is answered by its "no such
/// endpoint" or "method not allowed".
#[tokio::test]
async fn every_documented_operation_is_routed() {
    let gw = federated().await;
    let api = Api::of(&gw).await;
    let (id, _) = gw.idle_session().await;
    let mut count = 0;
    for (template, item) in api.doc["paths"].as_object().expect("paths") {
        let path = template
            .replace("{id}", &id)
            .replace("{migration_id}", "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b")
            .replace("{cid}", &"0".repeat(64))
            .replace("{token}", "not-a-token")
            .replace("{model}", "no-such-model")
            .replace("{gateway_id}", "gw")
            .replace("{file}", "app.js");
        for (method, op) in item.as_object().expect("path item") {
            let method =
                Method::from_bytes(method.to_ascii_uppercase().as_bytes()).expect("method");
            let mut req = gw.request(method.clone(), &path, &[]);
            if op.get("requestBody").is_some() {
                req = req.json(&json!({}));
            }
            let (status, _, body) = sbp_test_support::send(req).await;
            assert!(
                routed(status, &body),
                "{method} {template}: {status} {body}"
            );
            count += 1;
        }
    }
    assert!(count >= 40, "{count} operations");
    // What an undocumented route or method gets, which the check above would catch.
    for (method, path) in [(Method::GET, "/v1/nothing"), (Method::DELETE, "/healthz")] {
        let (status, _, body) = sbp_test_support::send(gw.request(method, path, &[])).await;
        assert!(!routed(status, &body), "{path}: {status} {body}");
    }
}

/// The session endpoints, the OpenAI-compatible ones, roaming and the page: each answer, success
/// or error, as documented.
#[tokio::test]
async fn every_answer_validates_against_the_document() {
    let gw = TestGateway::start().await;
    let api = Api::of(&gw).await;
    let none: &[(&str, &str)] = &[];

    // The checks can fail: a body of the wrong shape, a status or media type not documented.
    let json_type: HeaderMap = [(
        reqwest::header::CONTENT_TYPE,
        "application/json".parse().expect("header"),
    )]
    .into_iter()
    .collect();
    for (status, body) in [
        (200, json!({"status": 5})),
        (200, json!([])),
        (418, json!({})),
    ] {
        let problems = api.problems("GET", "/healthz", status, &json_type, &body);
        assert!(!problems.is_empty(), "{status} {body} is refused");
    }
    let created = api.problems("POST", "/v1/sessions", 201, &json_type, &json!({}));
    assert!(
        created
            .iter()
            .any(|p| p.contains("X-Session-Token is not sent"))
            && created.iter().any(|p| p.contains("session_id")),
        "{created:?}"
    );

    api.call(&gw, Method::GET, "/healthz", "/healthz", none, None)
        .await;
    api.call(
        &gw,
        Method::GET,
        "/openapi.json",
        "/openapi.json",
        none,
        None,
    )
    .await;
    api.call(&gw, Method::GET, "/metrics", "/metrics", none, None)
        .await;
    api.call(&gw, Method::GET, "/", "/", none, None).await;
    api.call(
        &gw,
        Method::GET,
        "/assets/{file}",
        "/assets/app.js",
        none,
        None,
    )
    .await;
    let (s, ..) = api
        .call(
            &gw,
            Method::GET,
            "/assets/{file}",
            "/assets/nope.js",
            none,
            None,
        )
        .await;
    assert_eq!(s, 404);

    // The OpenAI-compatible API.
    let (s, _, models) = api
        .call(&gw, Method::GET, "/v1/models", "/v1/models", none, None)
        .await;
    assert_eq!(s, 200);
    let model = models["data"][0]["id"]
        .as_str()
        .expect("a model")
        .replace('/', "%2F");
    let (s, ..) = api
        .call(
            &gw,
            Method::GET,
            "/v1/models/{model}",
            &format!("/v1/models/{model}"),
            none,
            None,
        )
        .await;
    assert_eq!(s, 200);
    let (s, ..) = api
        .call(
            &gw,
            Method::GET,
            "/v1/models/{model}",
            "/v1/models/nope",
            none,
            None,
        )
        .await;
    assert_eq!(s, 404);
    let chat = "/v1/chat/completions";
    let hello = json!({"model": "sbp/echo", "messages": [{"role": "user", "content": "hello"}]});
    let (s, h, v) = api
        .call(&gw, Method::POST, chat, chat, none, Some(hello.clone()))
        .await;
    assert_eq!(s, 200, "{v}");
    let id = v["sbp"]["session_id"]
        .as_str()
        .expect("session id")
        .to_owned();
    let token = h["x-session-token"].to_str().expect("token").to_owned();
    let auth = [("x-session-token", token.as_str())];
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            chat,
            chat,
            &auth,
            Some(json!({"messages": [{"role": "user", "content": "again"}], "stream": true})),
        )
        .await;
    assert_eq!(s, 200);
    let keyed = [("idempotency-key", "k-1")];
    for _ in 0..2 {
        api.call(&gw, Method::POST, chat, chat, &keyed, Some(hello.clone()))
            .await;
    }
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            chat,
            chat,
            none,
            Some(json!({"messages": "hi"})),
        )
        .await;
    assert_eq!(s, 400);
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            chat,
            chat,
            &[("x-session-token", "wrong")],
            Some(hello.clone()),
        )
        .await;
    assert!(matches!(s, 403 | 404), "{s}");
    let plain = gw
        .request(Method::POST, chat, &[("content-type", "text/plain")])
        .body("{}");
    let (s, h, v) = sbp_test_support::send(plain).await;
    assert_eq!(s, 415);
    api.check("POST", chat, s, &h, &v);

    // Sessions.
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            "/v1/sessions",
            "/v1/sessions",
            none,
            Some(json!({"metadata": {"k": 1}})),
        )
        .await;
    assert_eq!(s, 201);
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            "/v1/sbp/sessions",
            "/v1/sbp/sessions",
            none,
            Some(json!({"agent_id": 5})),
        )
        .await;
    assert_eq!(s, 400);
    for template in ["/v1/sessions/{id}", "/v1/sbp/sessions/{id}"] {
        let at = |id: &str| template.replace("{id}", id);
        let (s, _, v) = api
            .call(&gw, Method::GET, template, &at(&id), &auth, None)
            .await;
        assert_eq!((s, v["surface"].is_null()), (200, true));
        let (s, ..) = api
            .call(
                &gw,
                Method::GET,
                template,
                &at(&id),
                &[("x-session-token", "wrong")],
                None,
            )
            .await;
        assert_eq!(s, 403);
        let (s, ..) = api
            .call(
                &gw,
                Method::GET,
                template,
                &at(&uuid::Uuid::new_v4().to_string()),
                &auth,
                None,
            )
            .await;
        assert_eq!(s, 404);
        let (s, ..) = api
            .call(&gw, Method::GET, template, &at("not-a-uuid"), &auth, None)
            .await;
        assert_eq!(s, 422);
    }
    for template in [
        "/v1/sessions/{id}/messages",
        "/v1/sbp/sessions/{id}/messages",
    ] {
        let path = template.replace("{id}", &id);
        let (s, _, v) = api
            .call(
                &gw,
                Method::GET,
                template,
                &format!("{path}?limit=1"),
                &auth,
                None,
            )
            .await;
        assert_eq!((s, v["has_more"].as_bool()), (200, Some(true)));
        let (s, ..) = api
            .call(
                &gw,
                Method::GET,
                template,
                &format!("{path}?limit=x"),
                &auth,
                None,
            )
            .await;
        assert_eq!(s, 400);
    }
    let at = |template: &str| template.replace("{id}", &id);
    let snaps = "/v1/sbp/sessions/{id}/snapshots";
    api.call(&gw, Method::GET, snaps, &at(snaps), &auth, None)
        .await;
    let latest = "/v1/sbp/sessions/{id}/snapshots/latest";
    let (s, ..) = api
        .call(&gw, Method::GET, latest, &at(latest), &auth, None)
        .await;
    assert_eq!(s, 200);
    let turns = "/v1/sbp/sessions/{id}/turns";
    let keyed_auth = [
        ("x-session-token", token.as_str()),
        ("idempotency-key", "t-1"),
    ];
    for _ in 0..2 {
        let (s, ..) = api
            .call(
                &gw,
                Method::POST,
                turns,
                &at(turns),
                &keyed_auth,
                Some(json!({"content": "pushed"})),
            )
            .await;
        assert_eq!(s, 201);
    }
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            turns,
            &at(turns),
            &auth,
            Some(json!({"role": "tool", "content": "x"})),
        )
        .await;
    assert_eq!(s, 400);
    let memory = "/v1/sbp/sessions/{id}/memory";
    let (s, ..) = api
        .call(
            &gw,
            Method::PUT,
            memory,
            &at(memory),
            &auth,
            Some(json!({"payload": {"k": "v"}})),
        )
        .await;
    assert_eq!(s, 200);
    let (s, ..) = api
        .call(
            &gw,
            Method::PUT,
            memory,
            &at(memory),
            &auth,
            Some(json!({})),
        )
        .await;
    assert_eq!(s, 400);
    api.call(&gw, Method::GET, memory, &at(memory), &auth, None)
        .await;
    let tools = "/v1/sbp/sessions/{id}/tool_calls";
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            tools,
            &at(tools),
            &auth,
            Some(json!({"tool_name": "gps"})),
        )
        .await;
    assert_eq!(s, 409, "no surface declared it");
    let mcp = "/v1/sbp/sessions/{id}/mcp";
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "openapi-test", "version": "1"}
    }});
    let mcp_auth = [
        ("x-session-token", token.as_str()),
        ("accept", "application/json, text/event-stream"),
    ];
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            mcp,
            &at(mcp),
            &mcp_auth,
            Some(initialize),
        )
        .await;
    assert_eq!(s, 200);
    let ws = "/v1/sbp/ws/{id}";
    let (s, ..) = api.call(&gw, Method::GET, ws, &at(ws), none, None).await;
    assert_eq!(s, 426);

    // Roaming.
    let export = "/v1/sbp/sessions/{id}/export";
    let (s, _, exported) = api
        .call(
            &gw,
            Method::POST,
            export,
            &at(export),
            &auth,
            Some(json!({"label": "L"})),
        )
        .await;
    assert_eq!(s, 201);
    let roaming_token = exported["roaming_token"].as_str().expect("roaming token");
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            export,
            &at(export),
            &auth,
            Some(json!({"ttl_seconds": 1})),
        )
        .await;
    assert_eq!(s, 400);
    let inspect = "/v1/sbp/token/{token}";
    let (s, ..) = api
        .call(
            &gw,
            Method::GET,
            inspect,
            &format!("/v1/sbp/token/{roaming_token}"),
            none,
            None,
        )
        .await;
    assert_eq!(s, 200);
    let (s, ..) = api
        .call(
            &gw,
            Method::GET,
            inspect,
            "/v1/sbp/token/garbage",
            none,
            None,
        )
        .await;
    assert_eq!(s, 422);
    let import = "/v1/sbp/sessions/import";
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            import,
            import,
            none,
            Some(json!({"roaming_token": roaming_token})),
        )
        .await;
    assert_eq!(s, 201);
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            import,
            import,
            none,
            Some(json!({"roaming_token": roaming_token})),
        )
        .await;
    assert_eq!(s, 410, "a token is used once");
    let fork = "/v1/sbp/sessions/{id}/fork";
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            fork,
            &at(fork),
            &auth,
            Some(json!({"label": "F"})),
        )
        .await;
    assert_eq!(s, 201);
    for template in [
        "/v1/sbp/sessions/{id}/exports",
        "/v1/sbp/sessions/{id}/lineage",
    ] {
        let (s, ..) = api
            .call(&gw, Method::GET, template, &at(template), &auth, None)
            .await;
        assert_eq!(s, 200);
    }
    let handoff = "/v1/sbp/sessions/{id}/handoff";
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            handoff,
            &at(handoff),
            &auth,
            Some(json!({})),
        )
        .await;
    assert_eq!(s, 400);
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            handoff,
            &at(handoff),
            &auth,
            Some(json!({"to_agent_id": "b"})),
        )
        .await;
    assert_eq!(s, 201);
    let status = "/v1/sbp/sessions/{id}/status";
    let (s, ..) = api
        .call(
            &gw,
            Method::PATCH,
            status,
            &at(status),
            &auth,
            Some(json!({"status": "completed"})),
        )
        .await;
    assert_eq!(s, 200);
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            status,
            &at(status),
            &auth,
            Some(json!({"status": "running"})),
        )
        .await;
    assert_eq!(s, 409, "a completed session stays completed");

    // The request policy: another site's page.
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            "/v1/sessions",
            "/v1/sessions",
            &[("origin", "http://evil.example")],
            Some(json!({})),
        )
        .await;
    assert_eq!(s, 403);
}

/// With operator keys: a missing key, a rate limit, and the document open to all.
#[tokio::test]
async fn operator_key_and_rate_limit_answers_validate() {
    let mut config = sbp_test_support::config();
    config.api_keys = vec!["operator-key".into()];
    config.rate_limits.address = Some(sbp_gateway::Rate {
        count: std::num::NonZeroU32::new(1).expect("non-zero"),
        period: Duration::from_secs(3600),
        burst: std::num::NonZeroU32::new(3).expect("non-zero"),
    });
    let gw = TestGateway::with(Options {
        config,
        ..Options::default()
    })
    .await;
    let api = Api::of(&gw).await;
    let (s, ..) = api
        .call(
            &gw,
            Method::POST,
            "/v1/sessions",
            "/v1/sessions",
            &[],
            Some(json!({})),
        )
        .await;
    assert_eq!(s, 401);
    let (s, ..) = api
        .call(
            &gw,
            Method::GET,
            "/openapi.json",
            "/openapi.json",
            &[],
            None,
        )
        .await;
    assert_eq!(s, 200, "open without a key");
    let (s, h, _) = api
        .call(&gw, Method::GET, "/metrics", "/metrics", &[], None)
        .await;
    assert_eq!(s, 429, "the address's burst is spent");
    assert!(h.contains_key("retry-after"));
}
