//! Extractors: JSON bodies parsed into objects (and chat-completions requests) with errors in the
//! SBP envelope, the caller's credentials, and operator API-key authentication.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sbp_protocol::ChatRequest;
use serde_json::{Map, Value};

use crate::Gateway;
use crate::engine::sessions::Caller;
use crate::error::Error;

/// A request body that must be a JSON object (an empty body is `{}`), sent as JSON (see
/// [`json_body`]).
pub struct JsonObject(pub Map<String, Value>);

impl<S: Send + Sync> FromRequest<S> for JsonObject {
    type Rejection = Error;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = json_body(req, state).await?;
        json_object(&bytes).map(Self)
    }
}

/// The body of a request to a JSON endpoint. A body must come with `Content-Type:
/// application/json` (or an `application/*+json` type; a `charset` other than UTF-8 is refused):
/// anything else is 415, an empty body with a non-JSON type included, so no HTML form and no
/// `text/plain` request a cross-site page can send without a preflight is ever read as JSON. A
/// request with no `Content-Type` at all is accepted only without a body (`curl -X POST`): a
/// browser sends such a request only from script, with an `Origin` that `policy.rs` checks.
async fn json_body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, Error> {
    let declared = req.headers().get(header::CONTENT_TYPE).map(|v| {
        v.to_str()
            .is_ok_and(|t| is_json_media_type(t) && utf8_charset(t))
    });
    let refused = || {
        Error::UnsupportedMediaType(
            "this endpoint takes JSON: send the body with Content-Type: application/json".into(),
        )
    };
    if declared == Some(false) {
        return Err(refused());
    }
    let bytes = body_bytes(req, state).await?;
    if declared.is_none() && !bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(refused());
    }
    Ok(bytes)
}

/// `application/json` or `application/*+json`, parameters aside.
pub fn is_json_media_type(value: &str) -> bool {
    let essence = value.split(';').next().unwrap_or("").trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json") || subtype.to_ascii_lowercase().ends_with("+json"))
}

/// No `charset`, or UTF-8 (JSON is UTF-8, RFC 8259 8.1).
fn utf8_charset(value: &str) -> bool {
    value.split(';').skip(1).all(|param| {
        let Some((name, v)) = param.split_once('=') else {
            return true;
        };
        !name.trim().eq_ignore_ascii_case("charset")
            || matches!(
                v.trim().trim_matches('"').to_ascii_lowercase().as_str(),
                "utf-8" | "utf8"
            )
    })
}

async fn body_bytes<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, Error> {
    Bytes::from_request(req, state).await.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Error::TooLarge("request body is too large".into())
        } else {
            Error::invalid(format!("cannot read request body: {e}"))
        }
    })
}

fn json_object(bytes: &[u8]) -> Result<Map<String, Value>, Error> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Error::invalid("request body must be a JSON object")),
        Err(e) => Err(Error::invalid(format!(
            "request body is not valid JSON: {e}"
        ))),
    }
}

/// A `POST /v1/chat/completions` body, typed. With an `Idempotency-Key`, also the key's
/// fingerprint: the SHA-256 of the body as compact JSON with sorted keys, so a retry matches
/// whatever its key order or spacing (and records stored by earlier versions still match).
pub struct ChatBody {
    pub request: ChatRequest,
    pub fingerprint: Option<String>,
}

impl<S: Send + Sync> FromRequest<S> for ChatBody {
    type Rejection = Error;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let keyed = req.headers().contains_key("idempotency-key");
        let body = json_object(&json_body(req, state).await?)?;
        let fingerprint = keyed.then(|| fingerprint(&body)).transpose()?;
        let request = ChatRequest::from_object(body).map_err(|e| Error::Invalid(e.0))?;
        Ok(Self {
            request,
            fingerprint,
        })
    }
}

/// What tells a retry from another request under one `Idempotency-Key`: the SHA-256 of the body
/// as compact JSON with sorted keys (`serde_json`'s map is ordered by key), whatever the key order
/// or spacing the client sent.
pub fn fingerprint(body: &Map<String, Value>) -> Result<String, Error> {
    serde_json::to_string(body)
        .map(|text| crate::auth::sha256_hex(text.as_bytes()))
        .map_err(|e| Error::internal("fingerprinting a request", e))
}

/// Set by `operator_auth` when the request carried a valid operator API key.
#[derive(Clone, Copy)]
pub struct Operator(pub bool);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Ok(Caller {
            session_token: header(&parts.headers, "x-session-token"),
            operator: parts.extensions.get::<Operator>().is_some_and(|o| o.0),
        })
    }
}

pub fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// Exactly `/v1/sbp/sessions/{id}/mcp`.
fn is_mcp_path(path: &str) -> bool {
    path.strip_prefix("/v1/sbp/sessions/")
        .and_then(|rest| rest.strip_suffix("/mcp"))
        .is_some_and(|id| !id.is_empty() && !id.contains('/'))
}

pub fn bearer(headers: &HeaderMap) -> Option<String> {
    let value = header(headers, "authorization")?;
    let (scheme, key) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| key.trim().to_owned())
}

/// With operator API keys configured, every endpoint but `/healthz`, the browser page and its
/// assets (which hold no data) and the WebSocket (which authenticates with the session token in
/// ATTACH_SESSION) needs `Authorization: Bearer <key>`.
pub async fn operator_auth(State(gw): State<Gateway>, mut req: Request, next: Next) -> Response {
    let keys = &gw.config().api_keys;
    if keys.is_empty() {
        req.extensions_mut().insert(Operator(false));
        return next.run(req).await;
    }
    let path = req.uri().path();
    // The WebSocket and MCP endpoints authenticate with the session token instead; the page and
    // its assets are static files, and the API calls the page makes carry the key themselves.
    let open = path == "/healthz"
        || path == "/"
        || path
            .strip_prefix("/assets/")
            .is_some_and(|file| !file.is_empty() && !file.contains('/'))
        || path.starts_with("/v1/sbp/ws/")
        || is_mcp_path(path);
    let valid = bearer(req.headers()).is_some_and(|k| crate::auth::api_key_matches(&k, keys));
    if !valid && !open {
        return Error::Unauthorized(
            "a valid operator API key is required (Authorization: Bearer <key>)".into(),
        )
        .into_response();
    }
    req.extensions_mut().insert(Operator(valid));
    next.run(req).await
}
