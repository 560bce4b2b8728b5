//! Extractors: JSON bodies parsed into objects (and chat-completions requests) with errors in the
//! SBP envelope, the caller's credentials, and operator API-key authentication.
//!
//! Every body's shape (nesting, number of objects) is checked on its bytes before it is parsed,
//! and a completion's messages are counted and measured before each is parsed, so what a body
//! costs in memory is bounded by the limits, not by how its bytes are spent.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sbp_protocol::ChatRequest;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::Gateway;
use crate::engine::sessions::Caller;
use crate::error::Error;
use crate::limits::Limits;

/// A request body that must be a JSON object (an empty body is `{}`), sent as JSON (see
/// [`json_body`]).
pub struct JsonObject(pub Map<String, Value>);

impl FromRequest<Gateway> for JsonObject {
    type Rejection = Error;

    async fn from_request(req: Request, gw: &Gateway) -> Result<Self, Self::Rejection> {
        let bytes = json_body(req, gw).await?;
        gw.config().limits.check_shape(&bytes)?;
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
        Ok(_) => Err(not_an_object()),
        Err(e) => Err(not_json(&e)),
    }
}

fn not_an_object() -> Error {
    Error::invalid("request body must be a JSON object")
}

fn not_json(e: &serde_json::Error) -> Error {
    Error::invalid(format!("request body is not valid JSON: {e}"))
}

/// A completion body as an object, its `messages` counted and each measured before it is parsed:
/// the entries are first delimited (borrowed slices of the body, nothing built), then parsed.
fn chat_object(bytes: &[u8], limits: &Limits) -> Result<Map<String, Value>, Error> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    // Later duplicates replace earlier ones, as when parsing into a `Map`.
    let entries: Vec<(String, &RawValue)> = match serde_json::from_slice::<Entries<'_>>(bytes) {
        Ok(Entries(entries)) => entries,
        Err(e) if e.classify() == serde_json::error::Category::Data => {
            return Err(not_an_object());
        }
        Err(e) => return Err(not_json(&e)),
    };
    let mut map = Map::new();
    for (key, raw) in entries {
        let value = if key == "messages" {
            messages(raw, limits)?
        } else {
            serde_json::from_str(raw.get()).map_err(|e| not_json(&e))?
        };
        map.insert(key, value);
    }
    Ok(map)
}

/// `messages`: when an array, its length and each entry's size are checked before any is parsed.
fn messages(raw: &RawValue, limits: &Limits) -> Result<Value, Error> {
    if !raw.get().trim_start().starts_with('[') {
        return serde_json::from_str(raw.get()).map_err(|e| not_json(&e));
    }
    let items: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|e| not_json(&e))?;
    limits.check_request_messages(items.len())?;
    for (i, item) in items.iter().enumerate() {
        limits.check_message_bytes(&format!("messages[{i}]"), item.get().len())?;
    }
    items
        .into_iter()
        .map(|item| serde_json::from_str(item.get()).map_err(|e| not_json(&e)))
        .collect::<Result<Vec<Value>, Error>>()
        .map(Value::Array)
}

/// A JSON object's entries as borrowed slices of the text, in order.
struct Entries<'a>(Vec<(String, &'a RawValue)>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for Entries<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = Entries<'a>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    entries.push((key, map.next_value::<&'de RawValue>()?));
                }
                Ok(Entries(entries))
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// A `POST /v1/chat/completions` body, typed. With an `Idempotency-Key`, also the key's
/// fingerprint: the SHA-256 of the body as compact JSON with sorted keys, so a retry matches
/// whatever its key order or spacing (and records stored by earlier versions still match).
pub struct ChatBody {
    pub request: ChatRequest,
    pub fingerprint: Option<String>,
}

impl FromRequest<Gateway> for ChatBody {
    type Rejection = Error;

    async fn from_request(req: Request, gw: &Gateway) -> Result<Self, Self::Rejection> {
        let keyed = req.headers().contains_key("idempotency-key");
        let limits = gw.config().limits;
        let bytes = json_body(req, gw).await?;
        limits.check_shape(&bytes)?;
        let body = chat_object(&bytes, &limits)?;
        let fingerprint = keyed.then(|| fingerprint(&body)).transpose()?;
        let request = ChatRequest::from_object(body).map_err(|e| match e.param {
            Some(param) => Error::InvalidField {
                param,
                message: e.message,
            },
            None => Error::Invalid(e.message),
        })?;
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
        let operator = parts.extensions.get::<Operator>().is_some_and(|o| o.0);
        Ok(Caller {
            session_token: session_token(&parts.headers, operator),
            operator,
        })
    }
}

/// The session token of a request: `X-Session-Token`, or a session token sent as
/// `Authorization: Bearer` (an OpenAI SDK's `api_key`). A Bearer value that authenticated the
/// operator is the operator's key, never a session token.
pub fn session_token(headers: &HeaderMap, operator: bool) -> Option<String> {
    header(headers, "x-session-token").or_else(|| {
        bearer(headers).filter(|b| !operator && crate::auth::looks_like_session_token(b))
    })
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

/// With operator API keys configured, every endpoint but `/healthz`, `/openapi.json`, the browser
/// page and its assets (which hold no data) and the WebSocket (which authenticates with the session token in
/// ATTACH_SESSION) needs `Authorization: Bearer <key>`.
/// Routes peers call: they authenticate with a federation token or a signed record, and the
/// manifest is public.
fn is_federation_path(path: &str) -> bool {
    path == "/.well-known/sbp"
        || path.starts_with("/v1/sbp/bundles/")
        || path.starts_with("/v1/sbp/federation/")
        || path == "/v1/sbp/registry"
        || path.starts_with("/v1/sbp/registry/")
}

pub async fn operator_auth(State(gw): State<Gateway>, mut req: Request, next: Next) -> Response {
    let keys = &gw.config().api_keys;
    if keys.is_empty() {
        req.extensions_mut().insert(Operator(false));
        return next.run(req).await;
    }
    let path = req.uri().path();
    // The WebSocket and MCP endpoints authenticate with the session token instead; the page, its
    // assets and the API's description are static files, and the API calls the page makes carry
    // the key themselves.
    let open = path == "/healthz"
        || path == "/openapi.json"
        || path == "/"
        || path
            .strip_prefix("/assets/")
            .is_some_and(|file| !file.is_empty() && !file.contains('/'))
        || path.starts_with("/v1/sbp/ws/")
        || is_mcp_path(path)
        || (gw.federation().enabled() && is_federation_path(path));
    let sent = bearer(req.headers());
    let valid = sent
        .as_deref()
        .is_some_and(|k| crate::auth::api_key_matches(k, keys));
    if !valid && !open {
        let message = match sent.as_deref() {
            Some(b) if crate::auth::looks_like_session_token(b) => {
                "a valid operator API key is required (Authorization: Bearer <key>); a session token is not one: send it in X-Session-Token beside the key"
            }
            _ => "a valid operator API key is required (Authorization: Bearer <key>)",
        };
        return Error::Unauthorized(message.into()).into_response();
    }
    req.extensions_mut().insert(Operator(valid));
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SizeLimit;

    fn limits(max_request_messages: usize, max_message_bytes: usize) -> Limits {
        Limits {
            max_request_messages,
            max_message_bytes,
            ..Limits::default()
        }
    }

    fn limit_of(r: Result<Map<String, Value>, Error>) -> Option<SizeLimit> {
        match r {
            Err(Error::OverLimit { limit, .. }) => Some(limit),
            _ => None,
        }
    }

    #[test]
    fn messages_are_counted_and_measured_however_the_body_is_spaced() {
        let body = br#" {
            "model" : "m",
            "messages" :
              [ {"role": "user", "content": "a"} ,
                {"role": "user", "content": "b"}, {"role": "user", "content": "c"} ] ,
            "messages_extra": [1, 2, 3, 4]
        } "#;
        let map = chat_object(body, &limits(3, 100)).expect("within the limits");
        assert_eq!(map["messages"].as_array().map(Vec::len), Some(3));
        assert_eq!(map["messages_extra"], serde_json::json!([1, 2, 3, 4]));
        assert_eq!(
            limit_of(chat_object(body, &limits(2, 100))),
            Some(SizeLimit::RequestMessages)
        );
        assert_eq!(
            limit_of(chat_object(body, &limits(3, 20))),
            Some(SizeLimit::MessageBytes)
        );
    }

    #[test]
    fn bodies_parse_like_a_map() {
        let dup = br#"{"model": "a", "model": "b", "messages": "x"}"#;
        let map = chat_object(dup, &limits(1, 1)).expect("parses");
        assert_eq!(map["model"], "b", "the last duplicate wins, as in a Map");
        assert_eq!(
            map["messages"], "x",
            "not an array: left to the request's checks"
        );
        assert_eq!(
            chat_object(b"  ", &limits(1, 1)).expect("empty"),
            Map::new()
        );
        for (bad, text) in [
            (&b"[1]"[..], "must be a JSON object"),
            (b"{\"a\": }", "not valid JSON"),
            (b"{\"messages\": [1,}", "not valid JSON"),
        ] {
            match chat_object(bad, &limits(5, 100)) {
                Err(Error::Invalid(m)) => assert!(m.contains(text), "{m}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }
}
