//! The HTTP plumbing every HTTP provider shares: the client, sending under a deadline, sorting
//! failures into `LlmError`, and reading an SSE body as a stream of OpenAI chunks.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures::StreamExt;
use futures::stream::BoxStream;
use serde_json::Value;
use tokio::time::Instant;

use crate::sse::{self, Event};
use crate::{ChunkStream, LlmError};

/// One upstream URL and the client that posts to it, tuned for many small streamed events to
/// one host.
#[derive(Debug, Clone)]
pub(crate) struct Endpoint {
    client: reqwest::Client,
    /// Parsed once: a request clones it instead of parsing the text again (3 % of a proxied
    /// request's CPU).
    url: reqwest::Url,
    base: String,
}

impl Endpoint {
    /// `path` appended to `base_url` (a trailing `/` on the base is ignored).
    pub(crate) fn new(
        base_url: &str,
        path: &str,
        connect_timeout: Duration,
    ) -> Result<Self, LlmError> {
        let client = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            .pool_max_idle_per_host(256)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| LlmError::Protocol(format!("cannot build HTTP client: {e}")))?;
        let base = base_url.trim_end_matches('/').to_owned();
        let url = reqwest::Url::parse(&format!("{base}/{path}"))
            // Not the URL itself: it may carry credentials (`user:pass@`, `?key=`).
            .map_err(|e| LlmError::Protocol(format!("the upstream URL is not valid: {e}")))?;
        Ok(Self { client, url, base })
    }

    pub(crate) fn post(&self) -> reqwest::RequestBuilder {
        self.client.post(self.url.clone())
    }

    /// `GET` of another path under the same base URL (`models`).
    pub(crate) fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.client.get(format!("{}/{path}", self.base))
    }
}

/// Sends `req`, waiting at most `timeout` for the response headers. A non-2xx answer becomes
/// `LlmError::Status` with its body (JSON when it parses, else the text as a string), read under
/// the same timeout so a stalled error body cannot hang the caller.
pub(crate) async fn send(
    req: reqwest::RequestBuilder,
    timeout: Duration,
) -> Result<reqwest::Response, LlmError> {
    let mut resp = tokio::time::timeout(timeout, req.send())
        .await
        .map_err(|_| LlmError::Timeout)?
        .map_err(classify)?;
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let (text, _) = tokio::time::timeout(timeout, read_at_most(&mut resp, MAX_ERROR_BODY_BYTES))
        .await
        .map_err(|_| LlmError::Timeout)?
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&text).into_owned();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Err(LlmError::Status {
        status: status.as_u16(),
        body,
    })
}

/// Reads the whole body as JSON, giving up at `deadline`.
pub(crate) async fn read_json(
    resp: reqwest::Response,
    deadline: Instant,
) -> Result<Value, LlmError> {
    parse_json(&read_bytes(resp, deadline).await?)
}

/// A whole body as JSON.
pub(crate) fn parse_json(bytes: &[u8]) -> Result<Value, LlmError> {
    serde_json::from_slice(bytes).map_err(not_json)
}

/// A whole body that does not parse.
pub(crate) fn not_json(e: serde_json::Error) -> LlmError {
    LlmError::Protocol(format!("response is not JSON: {e}"))
}

/// Most bytes of a whole upstream body held in memory (an answer): far above what a model sends,
/// low enough that a faulty or hostile upstream cannot take the gateway's memory.
pub(crate) const MAX_BODY_BYTES: usize = 32 << 20;
/// Most bytes of one server-sent event held while it is unfinished: an event is one chunk of a
/// streamed answer (a few hundred bytes; an inline image or audio part a few MiB).
pub(crate) const MAX_EVENT_BYTES: usize = 8 << 20;
/// Most bytes of an error body read (the rest is left unread): enough for the JSON error of a
/// server that quotes a long request back, whose message, type and code the envelope keeps.
pub(crate) const MAX_ERROR_BODY_BYTES: usize = 1 << 20;

fn too_large() -> LlmError {
    LlmError::Protocol(format!("response larger than {} MiB", MAX_BODY_BYTES >> 20))
}

/// Reads the whole body, giving up at `deadline`, or past [`MAX_BODY_BYTES`] (at once when its
/// `Content-Length` says so).
pub(crate) async fn read_bytes(
    mut resp: reqwest::Response,
    deadline: Instant,
) -> Result<Bytes, LlmError> {
    if resp
        .content_length()
        .is_some_and(|n| n > MAX_BODY_BYTES as u64)
    {
        return Err(too_large());
    }
    let (body, more) = tokio::time::timeout_at(deadline, read_at_most(&mut resp, MAX_BODY_BYTES))
        .await
        .map_err(|_| LlmError::Timeout)?
        .map_err(classify)?;
    match more {
        true => Err(too_large()),
        false => Ok(body.freeze()),
    }
}

/// The body's first `max` bytes, and whether it goes on (the rest is not read).
async fn read_at_most(
    resp: &mut reqwest::Response,
    max: usize,
) -> Result<(BytesMut, bool), reqwest::Error> {
    // The length an upstream declares sizes the buffer only up to what a body usually is.
    let hint = resp.content_length().unwrap_or(0).min(1 << 20);
    let mut body = BytesMut::with_capacity(usize::try_from(hint).unwrap_or(0).min(max));
    while let Some(chunk) = resp.chunk().await? {
        let room = max - body.len();
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            return Ok((body, true));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((body, false))
}

/// The models of an OpenAI-style list (`{"data": [{"id", ...}]}`), in OpenAI's shape, with
/// `owned_by` defaulting to `owner`.
pub(crate) fn model_list(value: &Value, owner: &str) -> Vec<Value> {
    value
        .get("data")
        .and_then(Value::as_array)
        .map(|items| {
            items
                .iter()
                .filter_map(|m| {
                    let id = m.get("id")?.as_str()?;
                    Some(serde_json::json!({
                        "id": id,
                        "object": "model",
                        "created": m.get("created").and_then(Value::as_i64).unwrap_or(0),
                        "owned_by": m.get("owned_by").and_then(Value::as_str).unwrap_or(owner),
                    }))
                })
                .collect()
        })
        .unwrap_or_default()
}

pub(crate) fn classify(e: reqwest::Error) -> LlmError {
    // The URL may carry credentials (`user:pass@`, `?key=`): it stays out of the message.
    let e = e.without_url();
    if e.is_timeout() {
        LlmError::Timeout
    } else if e.is_connect() {
        LlmError::Unreachable(e.to_string())
    } else if e.is_decode() || e.is_body() {
        LlmError::Protocol(e.to_string())
    } else {
        LlmError::Unreachable(e.to_string())
    }
}

/// Whether an SSE body goes on after one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flow {
    Continue,
    /// The provider's end-of-stream event: nothing after it is read.
    End,
}

/// Reads `resp` as SSE, handing each event to `decode`, which appends the OpenAI chunks it
/// stands for. The stream fails with `Timeout` after `idle` without an event, with
/// `Protocol(unfinished)` when the body ends before `decode` said `Flow::End`, and with a
/// `Protocol` error when an event passes [`MAX_EVENT_BYTES`] or the stream is not UTF-8; the
/// first error ends it. Nothing is spawned: dropping the stream drops the connection at once.
pub(crate) fn sse_chunks<D>(
    resp: reqwest::Response,
    idle: Duration,
    unfinished: &'static str,
    decode: D,
) -> ChunkStream
where
    D: FnMut(&Event, &mut VecDeque<Value>) -> Result<Flow, LlmError> + Send + 'static,
{
    struct Reader<D> {
        body: BoxStream<'static, reqwest::Result<Bytes>>,
        parser: sse::Parser,
        /// What the parser has not taken yet of the last read (it stops after each event).
        unread: Bytes,
        decode: D,
        ready: VecDeque<Value>,
        finished: bool,
    }
    let reader = Reader {
        body: resp.bytes_stream().boxed(),
        parser: sse::Parser::new(MAX_EVENT_BYTES),
        unread: Bytes::new(),
        decode,
        ready: VecDeque::new(),
        finished: false,
    };
    futures::stream::unfold(reader, move |mut r| async move {
        // Reset by each event, not by bytes: a trickle that never completes one times out.
        let mut deadline = Instant::now() + idle;
        loop {
            if let Some(chunk) = r.ready.pop_front() {
                return Some((Ok(chunk), r));
            }
            if r.finished {
                return None;
            }
            let parsed = match r.unread.is_empty() {
                true => Ok(None),
                false => r.parser.feed(&r.unread).map(|(taken, event)| {
                    r.unread.advance(taken);
                    event
                }),
            };
            let failure = match parsed {
                Err(e) => LlmError::Protocol(e.to_string()),
                Ok(Some(event)) => {
                    deadline = Instant::now() + idle;
                    match (r.decode)(&event, &mut r.ready) {
                        Ok(Flow::Continue) => continue,
                        Ok(Flow::End) => {
                            r.finished = true;
                            continue;
                        }
                        Err(e) => {
                            // Chunks decoded from the failing event are not worth delivering.
                            r.ready.clear();
                            e
                        }
                    }
                }
                Ok(None) => match tokio::time::timeout_at(deadline, r.body.next()).await {
                    Err(_) => LlmError::Timeout,
                    Ok(None) => LlmError::Protocol(unfinished.to_owned()),
                    // The URL may carry credentials (`user:pass@`, `?key=`): it stays out.
                    Ok(Some(Err(e))) => {
                        LlmError::Protocol(format!("reading the stream: {}", e.without_url()))
                    }
                    Ok(Some(Ok(bytes))) => {
                        r.unread = bytes;
                        continue;
                    }
                },
            };
            r.finished = true;
            return Some((Err(failure), r));
        }
    })
    .boxed()
}
