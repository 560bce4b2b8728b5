//! The access log and the HTTP request metrics, the outermost layer of the router: one line per
//! request, written when its response's last byte is gone (or the client left), and one per
//! WebSocket connection, written by the connection when it ends. A line names the route template
//! (`/v1/sbp/token/{token}`), never the raw path, which may carry a roaming token. Each request
//! gets an id: the client's `X-Request-Id` when it is a sane one, else a new UUID, echoed in the
//! response and set on the request's span, so what the request and the tasks it starts log can be
//! matched with its line.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};
use tracing::Instrument as _;

use crate::Gateway;
use crate::metrics::{HttpLabels, UNMATCHED_ROUTE};

use super::ws::Totals;

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// Longest client request id taken as is.
const MAX_REQUEST_ID: usize = 128;
/// Where the lines go (`SBP_LOG=sbp::access=warn` keeps only failed requests).
const TARGET: &str = "sbp::access";

/// The request's id, in the request's extensions for handlers that log on their own.
#[derive(Debug, Clone)]
pub struct RequestId(pub Arc<str>);

/// On a response: its connection writes its own line (an accepted WebSocket).
#[derive(Debug, Clone, Copy)]
pub struct OwnLine;

/// The client's id when it is short and plain (it goes into logs and a header as is), else a new
/// one.
fn request_id(headers: &HeaderMap) -> Arc<str> {
    let sane = |v: &&str| {
        (1..=MAX_REQUEST_ID).contains(&v.len())
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
    };
    match headers
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(sane)
    {
        Some(id) => id.into(),
        None => uuid::Uuid::new_v4().to_string().into(),
    }
}

/// The method as a label: the ones the gateway serves, every other one as `other`.
fn method_label(m: &Method) -> &'static str {
    match *m {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        _ => "other",
    }
}

/// The session a path names: the `{id}` after `sessions/` (or `ws/`) in the route template, when
/// the path has a canonical session id there.
fn session_in_path(route: &str, path: &str) -> Option<String> {
    let template: Vec<&str> = route.split('/').collect();
    let at = template
        .windows(2)
        .position(|w| matches!(w[0], "sessions" | "ws") && w[1] == "{id}")?
        + 1;
    let raw = path.split('/').nth(at)?;
    sbp_protocol::id::parse_canonical(raw).map(|id| id.to_string())
}

/// The layer: gives the request its id, runs it, and hands the response a body that writes the
/// line and counts the request when it is done.
pub async fn log(State(gw): State<Gateway>, mut req: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = request_id(req.headers());
    req.extensions_mut().insert(RequestId(id.clone()));
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or(UNMATCHED_ROUTE, MatchedPath::as_str)
        .to_owned();
    let path_session = session_in_path(&route, req.uri().path());
    let method = method_label(req.method());
    let span = tracing::info_span!("request", request_id = %id);
    let mut resp = next.run(req).instrument(span).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert(REQUEST_ID, v);
    }
    let session_id = resp
        .headers()
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .and_then(sbp_protocol::id::parse_canonical)
        .map(|id| id.to_string())
        .or(path_session);
    let line = Line {
        gw,
        labels: HttpLabels {
            method,
            route,
            status: resp.status().as_u16(),
        },
        started,
        request_id: id,
        session_id,
        bytes: 0,
        write: resp.extensions().get::<OwnLine>().is_none(),
    };
    resp.map(|body| Body::new(Counted { body, line }))
}

/// One request's line, written when dropped.
struct Line {
    gw: Gateway,
    labels: HttpLabels,
    started: Instant,
    request_id: Arc<str>,
    session_id: Option<String>,
    bytes: u64,
    /// False when the connection writes its own line.
    write: bool,
}

fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

impl Drop for Line {
    fn drop(&mut self) {
        let elapsed = self.started.elapsed();
        let l = &self.labels;
        if self.write {
            let (method, route, status) = (l.method, l.route.as_str(), l.status);
            let (bytes, latency_ms) = (self.bytes, millis(elapsed));
            let (request_id, session_id) = (&*self.request_id, self.session_id.as_deref());
            if status >= 500 {
                tracing::warn!(target: TARGET, method, route, status, latency_ms, bytes, session_id, request_id, "request");
            } else {
                tracing::info!(target: TARGET, method, route, status, latency_ms, bytes, session_id, request_id, "request");
            }
        }
        let labels = std::mem::replace(
            &mut self.labels,
            HttpLabels {
                method: "",
                route: String::new(),
                status: 0,
            },
        );
        self.gw.metrics().http_request(labels, elapsed);
    }
}

/// A response body that counts its bytes for the line.
struct Counted {
    body: Body,
    line: Line,
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.line.bytes += data.len() as u64;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A WebSocket connection's line, written by the connection when it ends.
pub struct Connection {
    route: String,
    session_id: Option<String>,
    request_id: Option<RequestId>,
    started: Instant,
}

impl Connection {
    pub fn new(route: &str, path_id: &str, request_id: Option<RequestId>) -> Self {
        Self {
            route: route.to_owned(),
            session_id: sbp_protocol::id::parse_canonical(path_id).map(|id| id.to_string()),
            request_id,
            started: Instant::now(),
        }
    }

    /// Writes the line: the connection lasted from the upgrade to now.
    pub fn ended(&self, t: &Totals) {
        let request_id = self.request_id.as_ref().map(|r| &*r.0);
        tracing::info!(
            target: TARGET,
            method = "GET",
            route = %self.route,
            status = 101,
            latency_ms = millis(self.started.elapsed()),
            bytes = t.bytes_out,
            bytes_in = t.bytes_in,
            frames_in = t.frames_in,
            frames_out = t.frames_out,
            session_id = self.session_id.as_deref(),
            request_id,
            "websocket"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sane_request_id_is_kept_and_any_other_replaced() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(REQUEST_ID, HeaderValue::from_str(v).expect("header value"));
            request_id(&h)
        };
        assert_eq!(&*with("abc-123_x.y:z"), "abc-123_x.y:z");
        for bad in [
            "has space",
            "a\"quote",
            &"x".repeat(129),
            "tab\there",
            "ünï",
        ] {
            let Ok(v) = HeaderValue::from_str(bad) else {
                continue;
            };
            let mut h = HeaderMap::new();
            h.insert(REQUEST_ID, v);
            let id = request_id(&h);
            assert!(uuid::Uuid::parse_str(&id).is_ok(), "{bad} gave {id}");
        }
        assert!(uuid::Uuid::parse_str(&request_id(&HeaderMap::new())).is_ok());
    }

    #[test]
    fn the_session_comes_from_its_place_in_the_template_only() {
        let id = "0190b6a2-3c4d-7e5f-8a9b-0c1d2e3f4a5b";
        assert_eq!(
            session_in_path(
                "/v1/sbp/sessions/{id}/messages",
                &format!("/v1/sbp/sessions/{id}/messages")
            )
            .as_deref(),
            Some(id)
        );
        assert_eq!(
            session_in_path("/v1/sbp/ws/{id}", &format!("/v1/sbp/ws/{id}")).as_deref(),
            Some(id)
        );
        assert_eq!(
            session_in_path("/v1/models/{id}", &format!("/v1/models/{id}")),
            None
        );
        assert_eq!(
            session_in_path("/v1/sbp/token/{token}", "/v1/sbp/token/secret"),
            None
        );
        assert_eq!(
            session_in_path("/v1/sessions/{id}", "/v1/sessions/NOT-A-UUID"),
            None
        );
    }
}
