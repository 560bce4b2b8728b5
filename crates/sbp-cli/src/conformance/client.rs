//! The checker's view of a gateway: raw HTTP (status, headers and JSON as sent, so a check can
//! say exactly what it got) and a raw WebSocket (so it can send a wrong first frame, drop the TCP
//! connection without DETACH and read close codes). Field names are looked up under every
//! spelling the seeds, the spec and the reference server use.

use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use reqwest::header::HeaderMap;
use reqwest::{Method, Url};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::outcome::{Problem, ensure, fail, short, skip};

/// How long a close handshake we start may take before the socket is simply dropped.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// How much of a response body a reason quotes.
const QUOTE: usize = 200;

/// Everything a check needs to reach the gateway.
pub struct Ctx {
    pub http: reqwest::Client,
    /// `http(s)://host[:port][/prefix]`, without a trailing slash.
    pub base: String,
    /// The same with `ws(s)://`.
    pub ws_base: String,
    pub api_key: Option<String>,
    /// Sent as `model` in every completion.
    pub model: String,
    /// How long any single wait (a response, a frame) may take.
    pub timeout: Duration,
}

/// Why `--url` cannot be used.
pub fn parse_base(raw: &str) -> Result<(String, String), String> {
    let url = Url::parse(raw).map_err(|e| format!("--url '{raw}' is not a URL: {e}"))?;
    let ws_scheme = match url.scheme() {
        "http" => "ws",
        "https" => "wss",
        other => {
            return Err(format!(
                "--url '{raw}': the scheme must be http or https, not {other}"
            ));
        }
    };
    if url.host_str().is_none() {
        return Err(format!("--url '{raw}' has no host"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(format!("--url '{raw}': no query or fragment, please"));
    }
    let base = url.as_str().trim_end_matches('/').to_owned();
    let ws = format!("{ws_scheme}{}", &base[url.scheme().len()..]);
    Ok((base, ws))
}

/// One HTTP answer.
#[derive(Debug)]
pub struct Resp {
    /// `METHOD /path`, for reasons.
    pub what: String,
    pub status: u16,
    pub headers: HeaderMap,
    /// The body as JSON, or as a JSON string when it is not JSON.
    pub body: Value,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    }

    /// The body, quoted for a reason.
    pub fn quote(&self) -> String {
        let text = match &self.body {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        if text.is_empty() {
            "(empty body)".to_owned()
        } else {
            short(&text, QUOTE)
        }
    }

    /// Fails unless the status is one of `ok`.
    pub fn expect(&self, ok: &[u16]) -> Result<(), Problem> {
        ensure(ok.contains(&self.status), || {
            format!(
                "{}: expected HTTP {}, got {} {}",
                self.what,
                statuses(ok),
                self.status,
                self.quote()
            )
        })
    }

    /// Whether the answer says the endpoint does not exist (404 / 405 that is not the SBP
    /// "no such session" error): an optional endpoint the gateway does not offer.
    pub fn endpoint_missing(&self) -> bool {
        matches!(self.status, 404 | 405) && self.error_code() != Some("SBP_SESSION_NOT_FOUND")
    }

    /// SKIP (reason: what was asked, the status, then `why`) when the endpoint is missing.
    pub fn skip_if_missing(&self, why: &str) -> Result<(), Problem> {
        if self.endpoint_missing() {
            return Err(skip(format!("{}: {} {why}", self.what, self.status)));
        }
        Ok(())
    }

    /// The whole body as text (not cut), for searching it.
    pub fn body_text(&self) -> String {
        match &self.body {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    }

    /// `error.code` of the SBP envelope.
    pub fn error_code(&self) -> Option<&str> {
        self.body.pointer("/error/code").and_then(Value::as_str)
    }

    /// Fails unless the status is one of `ok` and the body is the SBP error envelope
    /// `{"error": {"code": "SBP_...", "message": "..."}}` with `code` (any `SBP_` code when
    /// `code` is empty).
    pub fn expect_error(&self, ok: &[u16], code: &str) -> Result<(), Problem> {
        let want = if code.is_empty() { "SBP_*" } else { code };
        let got_code = self.error_code();
        let code_ok = match got_code {
            Some(c) if code.is_empty() => c.starts_with("SBP_"),
            Some(c) => c == code,
            None => false,
        };
        let message_ok = self
            .body
            .pointer("/error/message")
            .is_some_and(Value::is_string);
        ensure(ok.contains(&self.status) && code_ok && message_ok, || {
            format!(
                "{}: expected {} {{\"error\":{{\"code\":\"{want}\",\"message\":...}}}}, got {} {}",
                self.what,
                statuses(ok),
                self.status,
                self.quote()
            )
        })
    }
}

fn statuses(s: &[u16]) -> String {
    s.iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(" or ")
}

/// `v` at a dotted path (`sbp.session_id`), if present and not null.
pub fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(v, |v, k| v.get(k))
        .filter(|v| !v.is_null())
}

/// The first of `paths` present in `v`: one field under all its spellings.
pub fn first<'a>(v: &'a Value, paths: &[&str]) -> Option<&'a Value> {
    paths.iter().find_map(|p| at(v, p))
}

/// [`first`] as a string.
pub fn first_str(v: &Value, paths: &[&str]) -> Option<String> {
    first(v, paths).and_then(Value::as_str).map(str::to_owned)
}

/// [`first`] as an unsigned integer.
pub fn first_u64(v: &Value, paths: &[&str]) -> Option<u64> {
    first(v, paths).and_then(Value::as_u64)
}

pub fn is_uuid(s: &str) -> bool {
    uuid::Uuid::parse_str(s).is_ok()
}

/// The names of a session id in completion answers.
pub const SESSION_ID: [&str; 2] = ["sbp.session_id", "session_id"];
/// The names of a session token in completion and session answers.
pub const SESSION_TOKEN: [&str; 3] = ["sbp.session_token", "session_token", "token"];
/// The count of turns about to be drained, in SESSION_ATTACHED (spec and seeds' names).
pub const QUEUED: [&str; 2] = ["queued_turns", "tether_turns_pending"];

/// A session a check made for itself.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: String,
    pub token: String,
}

impl Ctx {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A request with the operator key, if any.
    pub fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        let mut req = self.http.request(method, self.url(path));
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        req
    }

    /// Sends `req`, reading the whole answer within the timeout.
    pub async fn send(&self, what: String, req: reqwest::RequestBuilder) -> Result<Resp, Problem> {
        let answer = tokio::time::timeout(self.timeout, async {
            let resp = req.send().await?;
            let status = resp.status().as_u16();
            let headers = resp.headers().clone();
            let text = resp.text().await?;
            Ok::<_, reqwest::Error>((status, headers, text))
        })
        .await;
        let (status, headers, text) = match answer {
            Err(_) => {
                return Err(fail(format!(
                    "{what}: no answer within {} s",
                    self.timeout.as_secs_f64()
                )));
            }
            Ok(Err(e)) => return Err(fail(format!("{what}: {}", error_chain(&e)))),
            Ok(Ok(r)) => r,
        };
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok(Resp {
            what,
            status,
            headers,
            body,
        })
    }

    /// `method path` with a JSON body (none when `body` is null) and optional session token.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: &Value,
    ) -> Result<Resp, Problem> {
        let what = format!("{method} {}", path.split('?').next().unwrap_or(path));
        let mut req = self.request(method, path);
        if let Some(t) = token {
            req = req.header("x-session-token", t);
        }
        if !body.is_null() {
            req = req.json(body);
        }
        self.send(what, req).await
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> Result<Resp, Problem> {
        self.call(Method::GET, path, token, &Value::Null).await
    }

    pub async fn post(
        &self,
        path: &str,
        token: Option<&str>,
        body: &Value,
    ) -> Result<Resp, Problem> {
        self.call(Method::POST, path, token, body).await
    }

    /// A completion of one user message; `sbp` is the request's `sbp` object (sent as `{}` when
    /// null, which asks a strict SPEC 6.1 gateway for session tracking too).
    pub async fn chat(&self, token: Option<&str>, text: &str, sbp: Value) -> Result<Resp, Problem> {
        let sbp = if sbp.is_null() { json!({}) } else { sbp };
        let body = json!({
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "sbp": sbp,
        });
        self.post("/v1/chat/completions", token, &body).await
    }

    /// A new session made by a completion (the L1 way every gateway supports), with its token.
    pub async fn new_session(&self, text: &str) -> Result<(Session, Resp), Problem> {
        let resp = self.chat(None, text, Value::Null).await?;
        resp.expect(&[200])?;
        let session = session_of(&resp)?;
        Ok((session, resp))
    }

    /// A session's status as `GET /v1/sessions/{id}` reports it.
    pub async fn status_of(&self, s: &Session) -> Result<String, Problem> {
        let resp = self
            .get(&format!("/v1/sessions/{}", s.id), Some(&s.token))
            .await?;
        resp.expect(&[200])?;
        first_str(&resp.body, &["status", "session.status"])
            .ok_or_else(|| fail(format!("{}: no `status` in {}", resp.what, resp.quote())))
    }

    /// Waits until the session's status is `want` (state another party changes without telling
    /// the checker, e.g. after a dropped connection): polls within the timeout.
    pub async fn wait_status(&self, s: &Session, want: &str) -> Result<(), Problem> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let status = self.status_of(s).await?;
            if status == want {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(fail(format!(
                    "session status stayed '{status}', expected '{want}' within {} s",
                    self.timeout.as_secs_f64()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The transcript as (role, text) pairs; SKIP when the gateway has no messages endpoint (the
    /// seeds name none).
    pub async fn transcript(&self, s: &Session) -> Result<Vec<(String, String)>, Problem> {
        let resp = self
            .get(
                &format!("/v1/sessions/{}/messages?limit=1000", s.id),
                Some(&s.token),
            )
            .await?;
        resp.skip_if_missing("(no transcript endpoint to read back)")?;
        resp.expect(&[200])?;
        let items = match &resp.body {
            Value::Array(a) => Some(a),
            b => first(b, &["messages", "items", "data"]).and_then(Value::as_array),
        }
        .ok_or_else(|| {
            fail(format!(
                "{}: no messages array in {}",
                resp.what,
                resp.quote()
            ))
        })?;
        Ok(items
            .iter()
            .map(|m| {
                let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
                let text = match m.get("content").unwrap_or(&Value::Null) {
                    Value::String(s) => s.clone(),
                    Value::Null => String::new(),
                    other => other.to_string(),
                };
                (role.to_owned(), text)
            })
            .collect())
    }

    /// Produces an assistant turn on a session without a surface attached: pushed from a backend
    /// (`POST .../turns`, this gateway's endpoint) or, where there is no such endpoint, a
    /// completion asking to resume the session. Neither is defined by the seeds or SPEC (which
    /// answer a suspended session with 202), so a gateway offering neither is SKIPped, not
    /// failed. Returns the text the surface should get.
    pub async fn produce_turn(&self, s: &Session, text: &str) -> Result<String, Problem> {
        let resp = self
            .post(
                &format!("/v1/sbp/sessions/{}/turns", s.id),
                Some(&s.token),
                &json!({"content": text}),
            )
            .await?;
        if !resp.endpoint_missing() {
            resp.expect(&[200, 201])?;
            return Ok(text.to_owned());
        }
        let resp = self
            .chat(
                Some(&s.token),
                text,
                json!({"session_id": s.id, "resume": true}),
            )
            .await?;
        if resp.status != 200 {
            return Err(skip(format!(
                "cannot produce a turn while detached: no backend turn endpoint, and a completion asking to resume answered {} {}",
                resp.status,
                resp.quote()
            )));
        }
        reply_text(&resp)
    }
}

/// The session a completion made or continued: id and token under any of their names.
pub fn session_of(resp: &Resp) -> Result<Session, Problem> {
    let id = first_str(&resp.body, &SESSION_ID)
        .or_else(|| resp.header("x-session-id"))
        .ok_or_else(|| {
            fail(format!(
                "{}: no session id (sbp.session_id or X-Session-ID) in {}",
                resp.what,
                resp.quote()
            ))
        })?;
    ensure(is_uuid(&id), || {
        format!("{}: session id '{id}' is not a UUID", resp.what)
    })?;
    let token = resp
        .header("x-session-token")
        .or_else(|| first_str(&resp.body, &SESSION_TOKEN))
        .ok_or_else(|| {
            fail(format!(
                "{}: no session token (X-Session-Token header or sbp.session_token)",
                resp.what
            ))
        })?;
    Ok(Session { id, token })
}

/// The session id a completion answered for (one that continued a session brings no new token).
pub fn session_id_of(resp: &Resp) -> Result<String, Problem> {
    first_str(&resp.body, &SESSION_ID)
        .or_else(|| resp.header("x-session-id"))
        .ok_or_else(|| {
            fail(format!(
                "{}: no sbp.session_id in {}",
                resp.what,
                resp.quote()
            ))
        })
}

/// The assistant text of a completion.
pub fn reply_text(resp: &Resp) -> Result<String, Problem> {
    resp.body
        .pointer("/choices/0/message/content")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| {
            fail(format!(
                "{}: no choices[0].message.content in {}",
                resp.what,
                resp.quote()
            ))
        })
}

/// Whether an answer naming model `answered` for requested `requested` is a substitution, which
/// SPEC 6.2 says `sbp.model_routed_to` must name. A dated or suffixed name of the same model
/// (`gpt-4o` answered as `gpt-4o-2024-08-06`) is not.
pub fn model_substituted(requested: &str, answered: &str) -> bool {
    !(answered.starts_with(requested) || requested.starts_with(answered)) || answered.is_empty()
}

/// A spawned task that is aborted when its handle is dropped, so a check that fails or times out
/// while a request is in flight leaves nothing running behind it.
pub struct Spawned<T>(tokio::task::JoinHandle<T>);

impl<T: Send + 'static> Spawned<T> {
    pub fn spawn(f: impl std::future::Future<Output = T> + Send + 'static) -> Self {
        Self(tokio::spawn(f))
    }

    /// The task's output; its failing (a panic) is a failure of the check.
    pub async fn join(mut self) -> Result<T, Problem> {
        (&mut self.0)
            .await
            .map_err(|e| fail(format!("a request task of the check failed: {e}")))
    }

    /// The task's handle, to wait on without consuming the guard (`select!`).
    pub fn handle(&mut self) -> &mut tokio::task::JoinHandle<T> {
        &mut self.0
    }
}

impl<T> Drop for Spawned<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `e` with its sources, which say what actually went wrong (refused, DNS, TLS).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// What a socket delivered next.
#[derive(Debug)]
pub enum WsEvent {
    Frame(Value),
    /// A close frame's code, or `None` when the connection ended without one.
    Closed(Option<u16>),
}

/// A surface's WebSocket, as raw as the checks need it.
pub struct Socket {
    stream: WebSocketStream<MaybeTlsStream<TcpStream>>,
    timeout: Duration,
    /// PINGs answered so far.
    pub pings: usize,
}

impl Socket {
    /// Opens `/v1/sbp/ws/{session_id}` without sending anything.
    pub async fn connect(ctx: &Ctx, session_id: &str) -> Result<Self, Problem> {
        Self::connect_path(ctx, &format!("/v1/sbp/ws/{session_id}")).await
    }

    /// Opens the WebSocket at `path` under the gateway's base.
    pub async fn connect_path(ctx: &Ctx, path: &str) -> Result<Self, Problem> {
        let url = format!("{}{path}", ctx.ws_base);
        let mut req = url
            .as_str()
            .into_client_request()
            .map_err(|e| fail(format!("WebSocket URL {url}: {e}")))?;
        if let Some(key) = &ctx.api_key
            && let Ok(v) = format!("Bearer {key}").parse()
        {
            req.headers_mut().insert("authorization", v);
        }
        let connected = tokio::time::timeout(ctx.timeout, tokio_tungstenite::connect_async(req))
            .await
            .map_err(|_| fail(format!("WebSocket {url}: no handshake within the timeout")))?;
        let (stream, _) =
            connected.map_err(|e| fail(format!("WebSocket {url}: {}", error_chain(&e))))?;
        Ok(Self {
            stream,
            timeout: ctx.timeout,
            pings: 0,
        })
    }

    pub async fn send(&mut self, frame: Value) -> Result<(), Problem> {
        self.send_text(frame.to_string()).await
    }

    /// Sends within the timeout: a peer that stops reading fills the TCP window and would
    /// otherwise block the send for ever.
    pub async fn send_text(&mut self, text: String) -> Result<(), Problem> {
        match tokio::time::timeout(self.timeout, self.stream.send(Message::Text(text.into()))).await
        {
            Err(_) => Err(fail(format!(
                "WebSocket send did not complete within {} s",
                self.timeout.as_secs_f64()
            ))),
            Ok(Err(e)) => Err(fail(format!("WebSocket send failed: {e}"))),
            Ok(Ok(())) => Ok(()),
        }
    }

    /// The next JSON frame or the end of the connection within `within`, answering PINGs.
    pub async fn next_within(&mut self, within: Duration) -> Result<Option<WsEvent>, Problem> {
        let deadline = Instant::now() + within;
        loop {
            let Ok(msg) = tokio::time::timeout_at(deadline, self.stream.next()).await else {
                return Ok(None);
            };
            match msg {
                Some(Ok(Message::Text(t))) => {
                    let v: Value = serde_json::from_str(t.as_str()).map_err(|e| {
                        fail(format!(
                            "the gateway sent a frame that is not JSON ({e}): {}",
                            short(t.as_str(), 120)
                        ))
                    })?;
                    if v["type"] == "PING" {
                        self.pings += 1;
                        self.send(json!({"type": "PONG"})).await?;
                        continue;
                    }
                    return Ok(Some(WsEvent::Frame(v)));
                }
                Some(Ok(Message::Close(f))) => {
                    return Ok(Some(WsEvent::Closed(f.map(|f| u16::from(f.code)))));
                }
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return Ok(Some(WsEvent::Closed(None))),
            }
        }
    }

    /// The next frame or close within the timeout.
    pub async fn next(&mut self, waiting_for: &str) -> Result<WsEvent, Problem> {
        self.next_within(self.timeout).await?.ok_or_else(|| {
            fail(format!(
                "nothing on the WebSocket within {} s while waiting for {waiting_for}",
                self.timeout.as_secs_f64()
            ))
        })
    }

    /// The next frame; the connection ending first is a failure.
    pub async fn frame(&mut self, waiting_for: &str) -> Result<Value, Problem> {
        match self.next(waiting_for).await? {
            WsEvent::Frame(v) => Ok(v),
            WsEvent::Closed(code) => Err(fail(format!(
                "the WebSocket closed ({}) while waiting for {waiting_for}",
                code_text(code)
            ))),
        }
    }

    /// The next frame, which must be of type `ty`.
    pub async fn expect_type(&mut self, ty: &str) -> Result<Value, Problem> {
        let f = self.frame(ty).await?;
        ensure(f["type"] == ty, || {
            format!("expected {ty}, got {}", short(&f.to_string(), 160))
        })?;
        Ok(f)
    }

    /// Expects the connection to end next (frames before it are returned: some gateways send an
    /// error frame first); returns the close code.
    pub async fn closed(
        &mut self,
        waiting_for: &str,
    ) -> Result<(Vec<Value>, Option<u16>), Problem> {
        let mut frames = Vec::new();
        loop {
            match self.next(waiting_for).await? {
                WsEvent::Frame(v) => frames.push(v),
                WsEvent::Closed(code) => return Ok((frames, code)),
            }
        }
    }

    /// Sends DETACH and then a close frame of our own (neither the seeds nor SPEC say the
    /// gateway closes after DETACH), and reads until the connection ends, for a bounded time.
    /// Returns the frames that came before the end: the gateway reads frames in order, so they
    /// are what it sent before it saw the DETACH. That it has *processed* the DETACH is another
    /// matter: where that matters, poll the session until it is `suspended`
    /// ([`Ctx::wait_status`]).
    pub async fn detach(mut self) -> Result<Vec<Value>, Problem> {
        self.send(json!({"type": "DETACH"})).await?;
        // The gateway may have closed already: a failed close frame changes nothing.
        let _ = tokio::time::timeout(CLOSE_WAIT, self.stream.send(Message::Close(None))).await;
        let deadline = Instant::now() + CLOSE_WAIT.min(self.timeout);
        let mut frames = Vec::new();
        loop {
            match tokio::time::timeout_at(deadline, self.stream.next()).await {
                // No end in time: the socket is dropped, which ends it.
                Err(_) => return Ok(frames),
                Ok(Some(Ok(Message::Text(t)))) => {
                    let v: Value = serde_json::from_str(t.as_str()).map_err(|e| {
                        fail(format!(
                            "the gateway sent a frame that is not JSON ({e}): {}",
                            short(t.as_str(), 120)
                        ))
                    })?;
                    // PINGs are keepalives, not output; no PONG once our close is sent.
                    if v.get("type").and_then(Value::as_str) != Some("PING") {
                        frames.push(v);
                    }
                }
                Ok(Some(Ok(Message::Close(_)) | Err(_)) | None) => return Ok(frames),
                Ok(Some(Ok(_))) => {}
            }
        }
    }

    /// Reads one live turn: TURN_CHUNKs of one `chunk_id`, then its TURN_COMPLETE. Returns the
    /// joined deltas and the TURN_COMPLETE frame.
    pub async fn live_turn(&mut self) -> Result<(String, Value), Problem> {
        let mut text = String::new();
        let mut chunk_id: Option<Value> = None;
        loop {
            let f = self.frame("TURN_CHUNK / TURN_COMPLETE").await?;
            match f["type"].as_str() {
                Some("TURN_CHUNK") => {
                    let id = f["chunk_id"].clone();
                    ensure(id.is_string(), || {
                        format!("TURN_CHUNK without a chunk_id: {f}")
                    })?;
                    if let Some(prev) = &chunk_id {
                        ensure(*prev == id, || {
                            format!("TURN_CHUNKs of one turn changed chunk_id: {prev} then {id}")
                        })?;
                    }
                    chunk_id = Some(id);
                    text.push_str(
                        f["delta"].as_str().ok_or_else(|| {
                            fail(format!("TURN_CHUNK without a string delta: {f}"))
                        })?,
                    );
                }
                Some("TURN_COMPLETE") => {
                    if let Some(id) = &chunk_id {
                        ensure(f["chunk_id"] == *id, || {
                            format!(
                                "TURN_COMPLETE chunk_id {} differs from its chunks' {id}",
                                f["chunk_id"]
                            )
                        })?;
                    }
                    return Ok((text, f));
                }
                _ => {
                    return Err(fail(format!(
                        "expected TURN_CHUNK / TURN_COMPLETE of a live turn, got {}",
                        short(&f.to_string(), 160)
                    )));
                }
            }
        }
    }

    /// Ends the TCP connection without a close handshake or DETACH, as a phone losing its
    /// network would.
    pub fn drop_tcp(self) {
        drop(self.stream);
    }
}

/// A close code for reasons.
pub fn code_text(code: Option<u16>) -> String {
    code.map_or_else(|| "no close code".to_owned(), |c| format!("code {c}"))
}

/// ATTACH_SESSION for `s` with `extra` fields merged in (surface_context, last_seq, ...).
pub fn attach_frame(s: &Session, extra: Value) -> Value {
    let mut frame = json!({"type": "ATTACH_SESSION", "session_id": s.id, "session_token": s.token});
    if let (Some(f), Value::Object(extra)) = (frame.as_object_mut(), extra) {
        f.extend(extra);
    }
    frame
}

/// Connects, attaches and reads SESSION_ATTACHED.
pub async fn attach(ctx: &Ctx, s: &Session, extra: Value) -> Result<(Socket, Value), Problem> {
    let mut ws = Socket::connect(ctx, &s.id).await?;
    ws.send(attach_frame(s, extra)).await?;
    let attached = match ws.next("SESSION_ATTACHED").await? {
        WsEvent::Frame(f) if f["type"] == "SESSION_ATTACHED" => f,
        WsEvent::Frame(f) => {
            return Err(fail(format!(
                "ATTACH_SESSION: expected SESSION_ATTACHED, got {}",
                short(&f.to_string(), 160)
            )));
        }
        WsEvent::Closed(code) => {
            return Err(fail(format!(
                "ATTACH_SESSION: the WebSocket closed ({}) instead of SESSION_ATTACHED",
                code_text(code)
            )));
        }
    };
    Ok((ws, attached))
}

/// The drain count of SESSION_ATTACHED under either name.
pub fn queued(attached: &Value) -> Result<u64, Problem> {
    first_u64(attached, &QUEUED).ok_or_else(|| {
        fail(format!(
            "SESSION_ATTACHED has no queued_turns / tether_turns_pending count: {}",
            short(&attached.to_string(), 160)
        ))
    })
}

/// Whether SESSION_ATTACHED advertises protocol extension `name`.
pub fn has_extension(attached: &Value, name: &str) -> bool {
    attached["extensions"]
        .as_array()
        .is_some_and(|a| a.iter().any(|e| e == name))
}
