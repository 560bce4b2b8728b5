//! The HTTP side of the fake: routes, scripted waiting and the SSE body.
//!
//! Handlers do no logging and take no lock beyond the record push, so the zero-delay path
//! is cheap enough for benchmarks.

use std::future::Future;
use std::io;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::anthropic;
use crate::script::{self, Dialect, Outcome, Script};
use crate::state::FakeState;

/// Large enough for any conversation a benchmark replays.
const BODY_LIMIT: usize = 64 * 1024 * 1024;

#[derive(Clone)]
struct App {
    state: FakeState,
    /// Cancelled when the server starts shutting down, so hanging and slow answers stop
    /// and graceful shutdown does not wait for them forever.
    stopping: CancellationToken,
}

/// Serves the fake on an already-bound listener until `shutdown` completes; then stops
/// accepting, cuts short every scripted wait, and returns once open connections are done.
pub async fn serve(
    listener: TcpListener,
    state: FakeState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let stopping = CancellationToken::new();
    let app = router(App {
        state,
        stopping: stopping.clone(),
    });
    let listener = listener.tap_io(|tcp| {
        // Small SSE events must not sit behind Nagle's algorithm. Failing only costs
        // latency, so the error is not worth surfacing.
        let _ = tcp.set_nodelay(true);
    });
    let signal = async move {
        shutdown.await;
        stopping.cancel();
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(signal)
        .await
}

fn router(app: App) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/messages", post(messages))
        .route("/messages", post(messages))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/_fake/requests", get(recorded).delete(clear))
        .route("/healthz", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(app)
}

async fn chat(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    answer(app, headers, body, Dialect::OpenAi).await
}

async fn messages(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    answer(app, headers, body, Dialect::Anthropic).await
}

/// One request on either API: only reading the request and the shape of the bodies differ.
async fn answer(app: App, headers: HeaderMap, body: Bytes, dialect: Dialect) -> Response {
    if dialect == Dialect::OpenAi && !app.state.options().record {
        // Nothing to record: read the bytes without a tree of the whole conversation.
        if let Some(script) = script::plan_bytes(&body) {
            return perform(app, script, dialect).await;
        }
    }
    let body: Value = match serde_json::from_slice(&body) {
        Ok(body) => body,
        Err(e) => {
            return invalid_request(dialect, &format!("request body is not valid JSON: {e}"));
        }
    };
    let script = match dialect {
        Dialect::OpenAi => script::plan(&body),
        Dialect::Anthropic => anthropic::plan(&body, &headers),
    };
    app.state.record(body, &headers);
    perform(app, script, dialect).await
}

/// Waits, fails or answers as `script` says.
async fn perform(app: App, script: Result<Script, String>, dialect: Dialect) -> Response {
    let script = match script {
        Ok(script) => script,
        Err(message) => return invalid_request(dialect, &message),
    };

    if script.hang {
        app.stopping.cancelled().await;
        return shutting_down(dialect);
    }
    if let Outcome::Error(code) = script.outcome {
        if !wait(&app.stopping, script.slow).await {
            return shutting_down(dialect);
        }
        return json_response(
            StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            &dialect.error_body(code, "fake error"),
        );
    }
    if script.stream {
        return stream(script, app.stopping);
    }
    if !wait(&app.stopping, script.slow).await {
        return shutting_down(dialect);
    }
    if script.drop {
        // Headers go out, then the body fails: the client sees a reset mid-response.
        let failed = futures::stream::once(async {
            // One turn first so hyper flushes the headers (see `feed`).
            tokio::task::yield_now().await;
            Err::<Bytes, _>(dropped())
        });
        return Response::new(Body::from_stream(failed));
    }
    json_response(StatusCode::OK, &script.completion())
}

/// The SSE response. Headers go out at once; `slow` delays the first event.
fn stream(script: Script, stopping: CancellationToken) -> Response {
    let events = script.events();
    let body = if script.slow.is_zero() && script.chunk_delay.is_zero() && !script.drop {
        // Nothing to wait for: one write is cheapest, and SSE framing does not care.
        Body::from(events.concat())
    } else {
        Body::from_stream(feed(events, &script, stopping))
    };
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Emits `events` one by one with the scripted waits, failing the body after two events
/// when `drop` is set or when the server shuts down mid-wait.
fn feed(
    events: Vec<String>,
    script: &Script,
    stopping: CancellationToken,
) -> impl futures::Stream<Item = io::Result<Bytes>> + Send + 'static {
    struct Feed {
        events: std::vec::IntoIter<String>,
        sent: usize,
        slow: Duration,
        chunk_delay: Duration,
        drop: bool,
        done: bool,
        stopping: CancellationToken,
    }
    let feed = Feed {
        events: events.into_iter(),
        sent: 0,
        slow: script.slow,
        chunk_delay: script.chunk_delay,
        drop: script.drop,
        done: false,
        stopping,
    };
    futures::stream::unfold(feed, |mut feed| async move {
        if feed.done {
            return None;
        }
        if feed.drop && feed.sent == 2 {
            // Give hyper a turn to flush the two events before the body fails, otherwise
            // they can be discarded with the connection.
            tokio::task::yield_now().await;
            feed.done = true;
            return Some((Err(dropped()), feed));
        }
        let delay = if feed.sent == 0 {
            feed.slow
        } else {
            feed.chunk_delay
        };
        if !wait(&feed.stopping, delay).await {
            feed.done = true;
            return Some((Err(io::Error::other("fake LLM shutting down")), feed));
        }
        let event = feed.events.next()?;
        feed.sent += 1;
        Some((Ok(Bytes::from(event)), feed))
    })
}

/// Sleeps for `delay`; false when the server started shutting down first.
async fn wait(stopping: &CancellationToken, delay: Duration) -> bool {
    if delay.is_zero() {
        return true;
    }
    tokio::select! {
        () = tokio::time::sleep(delay) => true,
        () = stopping.cancelled() => false,
    }
}

fn dropped() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "fake LLM dropped the stream",
    )
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn invalid_request(dialect: Dialect, message: &str) -> Response {
    json_response(
        StatusCode::BAD_REQUEST,
        &dialect.invalid_request_body(message),
    )
}

fn shutting_down(dialect: Dialect) -> Response {
    json_response(
        StatusCode::SERVICE_UNAVAILABLE,
        &dialect.error_body(503, "fake LLM shutting down"),
    )
}

async fn models() -> Response {
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [
            {"id": "fake", "object": "model", "created": 0, "owned_by": "sbp-fake-llm"}
        ]}),
    )
}

async fn recorded(State(app): State<App>) -> Response {
    json_response(StatusCode::OK, &Value::Array(app.state.requests()))
}

async fn clear(State(app): State<App>) -> impl IntoResponse {
    app.state.clear();
    StatusCode::NO_CONTENT
}
