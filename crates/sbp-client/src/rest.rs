//! The HTTP side: [`Client`] for gateway-wide calls (create, import, token inspection) and
//! [`SessionClient`] for one session's endpoints, authenticated with its `X-Session-Token`.
//!
//! With federation (SBP L6) a session can move to another gateway (a surface attached there with
//! its id and token). The gateway it left answers its routes with 409 `SBP_SESSION_MOVED`, whose
//! `detail.gateway_url` names the new holder: a [`SessionClient`] follows it (see
//! [`SessionClient::base_url`]).

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use reqwest::header::HeaderMap;
use reqwest::{Method, Url};
use sbp_protocol::{ErrorBody, SbpResponseMeta};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::Error;
use crate::surface::SurfaceConfig;
use crate::types::{
    ChatOutcome, ChatReply, ChatRequest, Created, Export, ExportInfo, ExportList, ExportRequest,
    ForkInfo, ForkRequest, HandoffInfo, HandoffRequest, Health, ImportInfo, ImportRequest, Lineage,
    Memory, MemoryPut, MessagePage, MessagesQuery, NewSession, PushTurn, PushedTurn,
    SessionCreated, SessionInfo, SetStatus, Snapshot, SnapshotList, StatusChanged, ToolCallOutcome,
    ToolCallRequest,
};
use sbp_protocol::SessionStatus;

const SESSION_TOKEN: &str = "x-session-token";

/// The code of the answer a gateway gives for a session that moved to another gateway.
pub const SESSION_MOVED: &str = "SBP_SESSION_MOVED";

/// How many `SBP_SESSION_MOVED` answers one call follows: a session moves at most a few times
/// between two calls, and a chain longer than this is a loop or a misconfiguration.
pub const MAX_MOVES_PER_CALL: usize = 3;

/// A gateway's HTTP API. Cheap to clone (the connection pool is shared).
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    http: reqwest::Client,
    base: Url,
    api_key: Option<String>,
}

/// Builds a [`Client`].
#[derive(Debug)]
pub struct ClientBuilder {
    base: String,
    api_key: Option<String>,
    http: Option<reqwest::Client>,
    timeout: Option<Duration>,
    no_proxy: bool,
}

impl ClientBuilder {
    /// An operator API key, sent as `Authorization: Bearer <key>` on every HTTP call (the WebSocket
    /// authenticates with the session token only).
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// Use this reqwest client (its proxy, TLS and timeout settings) instead of building one.
    pub fn http_client(mut self, http: reqwest::Client) -> Self {
        self.http = Some(http);
        self
    }

    /// Timeout of each HTTP request (none by default: a completion may run for minutes).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Ignore the system's proxy settings (`HTTP_PROXY`, ...), e.g. for a gateway on loopback.
    pub fn no_proxy(mut self) -> Self {
        self.no_proxy = true;
        self
    }

    pub fn build(self) -> Result<Client, Error> {
        let base = parse_base(&self.base)?;
        let http = match self.http {
            Some(h) => h,
            None => {
                let mut b = reqwest::Client::builder();
                if let Some(t) = self.timeout {
                    b = b.timeout(t);
                }
                if self.no_proxy {
                    b = b.no_proxy();
                }
                b.build()?
            }
        };
        Ok(Client {
            inner: Arc::new(Inner {
                http,
                base,
                api_key: self.api_key,
            }),
        })
    }
}

/// Parses the gateway's base URL (`http(s)://host[:port][/prefix]`; `ws(s)://` is accepted too).
pub(crate) fn parse_base(raw: &str) -> Result<Url, Error> {
    let invalid = |reason: &str| Error::InvalidUrl {
        url: raw.to_owned(),
        reason: reason.to_owned(),
    };
    let mut url = Url::parse(raw).map_err(|e| invalid(&e.to_string()))?;
    let scheme = match url.scheme() {
        "http" | "ws" => "http",
        "https" | "wss" => "https",
        _ => return Err(invalid("the scheme must be http, https, ws or wss")),
    };
    if url.cannot_be_a_base() || url.host().is_none() {
        return Err(invalid("no host"));
    }
    url.set_scheme(scheme)
        .map_err(|()| invalid("cannot change the scheme"))?;
    url.set_query(None);
    url.set_fragment(None);
    Ok(url)
}

/// `base` with `segments` appended as path segments (each percent-encoded as needed).
pub(crate) fn endpoint(base: &Url, segments: &[&str]) -> Result<Url, Error> {
    let mut url = base.clone();
    url.path_segments_mut()
        .map_err(|()| Error::InvalidUrl {
            url: base.to_string(),
            reason: "cannot be a base".into(),
        })?
        .pop_if_empty()
        .extend(segments);
    Ok(url)
}

/// The WebSocket endpoint of `session_id` under `base`.
pub(crate) fn ws_endpoint(base: &Url, session_id: &str) -> Result<Url, Error> {
    let mut url = endpoint(base, &["v1", "sbp", "ws", session_id])?;
    let scheme = if url.scheme() == "https" { "wss" } else { "ws" };
    url.set_scheme(scheme).map_err(|()| Error::InvalidUrl {
        url: base.to_string(),
        reason: "cannot derive the WebSocket URL".into(),
    })?;
    Ok(url)
}

impl Client {
    /// A client for the gateway at `base_url` with reqwest's defaults.
    pub fn new(base_url: impl Into<String>) -> Result<Self, Error> {
        Self::builder(base_url).build()
    }

    pub fn builder(base_url: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            base: base_url.into(),
            api_key: None,
            http: None,
            timeout: None,
            no_proxy: false,
        }
    }

    /// The gateway's base URL.
    pub fn base_url(&self) -> &Url {
        &self.inner.base
    }

    /// A client for an existing session, on this client's gateway.
    pub fn session(&self, id: impl Into<String>, token: impl Into<String>) -> SessionClient {
        self.session_at(self.inner.base.clone(), id, token)
    }

    /// A client for a session held at `base` (a gateway the session moved to, or the one that
    /// answered a call that made it).
    fn session_at(
        &self,
        base: Url,
        id: impl Into<String>,
        token: impl Into<String>,
    ) -> SessionClient {
        SessionClient {
            client: self.clone(),
            id: id.into(),
            token: token.into(),
            base: Arc::new(RwLock::new(base)),
        }
    }

    /// `POST /v1/sessions`: a new idle session.
    pub async fn create_session(&self, req: NewSession) -> Result<SessionClient, Error> {
        let created: SessionCreated = self
            .call(Method::POST, &["v1", "sessions"], None, Some(&req))
            .await?;
        Ok(self.session(created.session_id, created.session_token))
    }

    /// A completion without a session token: the gateway creates a session for it.
    pub async fn start_chat(&self, req: ChatRequest) -> Result<(SessionClient, ChatReply), Error> {
        let (reply, header_token) = match self.chat(None, &req).await? {
            (ChatOutcome::Reply(r), token) => (r, token),
            (ChatOutcome::ResumeAvailable(meta), _) => {
                return Err(Error::UnexpectedResponse {
                    status: 202,
                    reason: format!(
                        "a new chat was offered to resume session {}",
                        meta.session_id
                    ),
                });
            }
        };
        let token = reply
            .meta
            .session_token
            .clone()
            .or(header_token)
            .ok_or_else(|| Error::UnexpectedResponse {
                status: 200,
                reason: "a new session came without its token".into(),
            })?;
        Ok((self.session(reply.meta.session_id.clone(), token), reply))
    }

    /// `POST /v1/sbp/sessions/import`: a new session from a roaming token or a bundle.
    pub async fn import(&self, req: ImportRequest) -> Result<Created<ImportInfo>, Error> {
        let info: ImportInfo = self
            .call(
                Method::POST,
                &["v1", "sbp", "sessions", "import"],
                None,
                Some(&req),
            )
            .await?;
        Ok(Created {
            session: self.session(info.session_id.clone(), info.session_token.clone()),
            info,
        })
    }

    /// `GET /healthz`.
    pub async fn health(&self) -> Result<Health, Error> {
        self.call::<(), _>(Method::GET, &["healthz"], None, None)
            .await
    }

    /// `GET /v1/sbp/token/{token}`: what a roaming token refers to, without consuming it.
    pub async fn inspect_token(&self, roaming_token: &str) -> Result<ExportInfo, Error> {
        self.call::<(), _>(
            Method::GET,
            &["v1", "sbp", "token", roaming_token],
            None,
            None,
        )
        .await
    }

    fn request(&self, method: Method, url: Url, token: Option<&str>) -> reqwest::RequestBuilder {
        let mut req = self.inner.http.request(method, url);
        if let Some(key) = &self.inner.api_key {
            req = req.bearer_auth(key);
        }
        if let Some(t) = token {
            req = req.header(SESSION_TOKEN, t);
        }
        req
    }

    /// One JSON call to this client's gateway; a non-2xx answer becomes [`Error::Api`].
    async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &[&str],
        token: Option<&str>,
        body: Option<&B>,
    ) -> Result<T, Error> {
        let req = self.json_request(&self.inner.base, method, path, token, body)?;
        let (status, _, value) = send(req).await?;
        parse(status, value)
    }

    /// `method base/path` with an optional JSON body.
    fn json_request<B: Serialize>(
        &self,
        base: &Url,
        method: Method,
        path: &[&str],
        token: Option<&str>,
        body: Option<&B>,
    ) -> Result<reqwest::RequestBuilder, Error> {
        let url = endpoint(base, path)?;
        let mut req = self.request(method, url, token);
        if let Some(b) = body {
            req = req.json(b);
        }
        Ok(req)
    }

    /// A completion request to the gateway at `base`.
    fn chat_request(
        &self,
        base: &Url,
        token: Option<&str>,
        req: &ChatRequest,
    ) -> Result<reqwest::RequestBuilder, Error> {
        let url = endpoint(base, &["v1", "chat", "completions"])?;
        let mut http = self.request(Method::POST, url, token).json(&req.body());
        if let Some(key) = &req.idempotency_key {
            http = http.header("idempotency-key", key);
        }
        Ok(http)
    }

    /// A completion; also returns the `X-Session-Token` header (set when the call made a session).
    async fn chat(
        &self,
        token: Option<&str>,
        req: &ChatRequest,
    ) -> Result<(ChatOutcome, Option<String>), Error> {
        let http = self.chat_request(&self.inner.base, token, req)?;
        chat_outcome(send(http).await?)
    }
}

/// A completion's answer: the reply (or the offer to resume), and the `X-Session-Token` header.
fn chat_outcome(
    (status, headers, body): (u16, HeaderMap, Value),
) -> Result<(ChatOutcome, Option<String>), Error> {
    let header_token = headers
        .get(SESSION_TOKEN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let meta: SbpResponseMeta = body
        .get("sbp")
        .cloned()
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| Error::UnexpectedResponse {
            status,
            reason: format!("bad `sbp` block: {e}"),
        })?
        .ok_or_else(|| Error::UnexpectedResponse {
            status,
            reason: "no `sbp` block".into(),
        })?;
    if status == 202 {
        return Ok((ChatOutcome::ResumeAvailable(meta), header_token));
    }
    let choice = &body["choices"][0];
    let reply = ChatReply {
        text: choice["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        finish_reason: choice["finish_reason"].as_str().map(str::to_owned),
        meta,
        body,
    };
    Ok((ChatOutcome::Reply(reply), header_token))
}

/// Sends the request; non-2xx statuses become [`Error::Api`] (or `UnexpectedResponse`).
async fn send(req: reqwest::RequestBuilder) -> Result<(u16, HeaderMap, Value), Error> {
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await?;
    if !(200..300).contains(&status) {
        return Err(match serde_json::from_str::<ErrorBody>(&text) {
            Ok(body) => Error::Api {
                status,
                code: body.error.code,
                message: body.error.message,
                detail: body.error.detail,
            },
            Err(_) => Error::UnexpectedResponse {
                status,
                reason: truncate(&text),
            },
        });
    }
    let value = serde_json::from_str(&text).map_err(|e| Error::UnexpectedResponse {
        status,
        reason: format!("body is not JSON ({e}): {}", truncate(&text)),
    })?;
    Ok((status, headers, value))
}

fn parse<T: DeserializeOwned>(status: u16, value: Value) -> Result<T, Error> {
    serde_json::from_value(value).map_err(|e| Error::UnexpectedResponse {
        status,
        reason: e.to_string(),
    })
}

fn truncate(text: &str) -> String {
    const MAX: usize = 300;
    match text.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

/// One session's HTTP endpoints, authenticated with its token. Cheap to clone.
///
/// The calls go to the gateway holding the session: at first the [`Client`]'s, and after a call
/// is answered 409 `SBP_SESSION_MOVED` (the session moved to another gateway of a federation),
/// the gateway its `detail.gateway_url` names. The call is then sent again there, and so are the
/// calls after it ([`SessionClient::base_url`]); clones share where the session is. Only
/// `http`/`https` URLs are followed (never to plain `http` from `https`, which would expose the
/// session token), at most [`MAX_MOVES_PER_CALL`] times per call; otherwise the 409 is the
/// call's error, as is a move with no URL to follow.
#[derive(Debug, Clone)]
pub struct SessionClient {
    client: Client,
    id: String,
    token: String,
    /// The gateway holding the session, as far as this client knows.
    base: Arc<RwLock<Url>>,
}

impl SessionClient {
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The base URL this session's calls go to: the client's, or the gateway the session was
    /// last found to have moved to.
    pub fn base_url(&self) -> Url {
        self.base
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A surface configuration for this session (its current gateway, id and token).
    pub fn surface(&self) -> SurfaceConfig {
        SurfaceConfig::for_url(self.base_url(), &self.id, &self.token)
    }

    /// Sends one user message and returns the reply; a suspended session is resumed.
    pub async fn send_message(&self, text: impl Into<String>) -> Result<ChatReply, Error> {
        match self.chat(ChatRequest::user(text).resume()).await? {
            ChatOutcome::Reply(r) => Ok(r),
            ChatOutcome::ResumeAvailable(meta) => Err(Error::UnexpectedResponse {
                status: 202,
                reason: format!("session {} was not resumed", meta.session_id),
            }),
        }
    }

    /// A completion in this session, as given (a suspended session answers 202 without `resume`).
    pub async fn chat(&self, req: ChatRequest) -> Result<ChatOutcome, Error> {
        let answer = self
            .following(|base| self.client.chat_request(base, Some(&self.token), &req))
            .await?;
        Ok(chat_outcome(answer)?.0)
    }

    /// `GET /v1/sessions/{id}`.
    pub async fn get(&self) -> Result<SessionInfo, Error> {
        self.get_json(&["v1", "sessions", &self.id]).await
    }

    /// `GET /v1/sessions/{id}/messages?after=&limit=`: one page of the transcript.
    pub async fn messages(
        &self,
        after: Option<u64>,
        limit: Option<u32>,
    ) -> Result<MessagePage, Error> {
        let (status, _, v) = self
            .following(|base| {
                let mut url = endpoint(base, &["v1", "sessions", &self.id, "messages"])?;
                // Two optional numbers: serialising them cannot fail, and each is a plain query
                // value.
                if let Ok(Value::Object(pairs)) =
                    serde_json::to_value(MessagesQuery { after, limit })
                {
                    let mut q = url.query_pairs_mut();
                    for (key, value) in pairs {
                        q.append_pair(&key, &value.to_string());
                    }
                }
                Ok(self.client.request(Method::GET, url, Some(&self.token)))
            })
            .await?;
        parse(status, v)
    }

    /// `PATCH /v1/sbp/sessions/{id}/status`: suspend, complete, fail or resume the session.
    pub async fn set_status(&self, status: SessionStatus) -> Result<StatusChanged, Error> {
        self.send_json(Method::PATCH, &["status"], &SetStatus::new(status))
            .await
    }

    /// `GET /v1/sbp/sessions/{id}/snapshots`: newest first.
    pub async fn snapshots(&self) -> Result<SnapshotList, Error> {
        self.get_json(&["v1", "sbp", "sessions", &self.id, "snapshots"])
            .await
    }

    /// `GET /v1/sbp/sessions/{id}/snapshots/latest`: the latest snapshot with its messages.
    pub async fn latest_snapshot(&self) -> Result<Snapshot, Error> {
        self.get_json(&["v1", "sbp", "sessions", &self.id, "snapshots", "latest"])
            .await
    }

    /// `POST /v1/sbp/sessions/{id}/turns`: a turn from a backend, live or tethered.
    pub async fn push_turn(&self, turn: PushTurn) -> Result<PushedTurn, Error> {
        self.post(&["turns"], &turn).await
    }

    /// `POST /v1/sbp/sessions/{id}/tool_calls`: calls a tool of the attached surface.
    pub async fn call_tool(&self, req: ToolCallRequest) -> Result<ToolCallOutcome, Error> {
        self.post(&["tool_calls"], &req).await
    }

    /// `POST /v1/sbp/sessions/{id}/export`: a roaming token and the bundle's CID.
    pub async fn export(&self, req: ExportRequest) -> Result<Export, Error> {
        self.post(&["export"], &req).await
    }

    /// `POST /v1/sbp/sessions/{id}/fork`: an independent copy at the latest checkpoint.
    pub async fn fork(&self, label: Option<&str>) -> Result<Created<ForkInfo>, Error> {
        self.fork_with(ForkRequest {
            label: label.map(str::to_owned),
            keep_last: None,
        })
        .await
    }

    /// [`SessionClient::fork`] with every option, e.g. `keep_last` to continue a full session.
    pub async fn fork_with(&self, body: ForkRequest) -> Result<Created<ForkInfo>, Error> {
        let info: ForkInfo = self.post(&["fork"], &body).await?;
        Ok(Created {
            session: self.sibling(&info.session_id, &info.session_token),
            info,
        })
    }

    /// `POST /v1/sbp/sessions/{id}/handoff`: the conversation moves to another agent's new session;
    /// this one is suspended.
    pub async fn handoff(&self, req: HandoffRequest) -> Result<Created<HandoffInfo>, Error> {
        let info: HandoffInfo = self.post(&["handoff"], &req).await?;
        Ok(Created {
            session: self.sibling(&info.session_id, &info.session_token),
            info,
        })
    }

    /// `GET /v1/sbp/sessions/{id}/lineage`.
    pub async fn lineage(&self) -> Result<Lineage, Error> {
        self.get_json(&["v1", "sbp", "sessions", &self.id, "lineage"])
            .await
    }

    /// `GET /v1/sbp/sessions/{id}/exports`: the session's exports and their imports.
    pub async fn exports(&self) -> Result<ExportList, Error> {
        self.get_json(&["v1", "sbp", "sessions", &self.id, "exports"])
            .await
    }

    /// `GET /v1/sbp/sessions/{id}/memory`.
    pub async fn memory(&self) -> Result<Memory, Error> {
        self.get_json(&["v1", "sbp", "sessions", &self.id, "memory"])
            .await
    }

    /// `PUT /v1/sbp/sessions/{id}/memory`: replaces the memory document.
    pub async fn put_memory(&self, memory: MemoryPut) -> Result<Memory, Error> {
        self.send_json(Method::PUT, &["memory"], &memory).await
    }

    /// A session made by a call of this one (fork, handoff): on the gateway that answered it.
    fn sibling(&self, id: &str, token: &str) -> SessionClient {
        self.client.session_at(self.base_url(), id, token)
    }

    async fn get_json<T: DeserializeOwned>(&self, path: &[&str]) -> Result<T, Error> {
        let (status, _, v) = self
            .following(|base| {
                self.client
                    .json_request::<()>(base, Method::GET, path, Some(&self.token), None)
            })
            .await?;
        parse(status, v)
    }

    /// `POST /v1/sbp/sessions/{id}/<tail>`.
    async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        tail: &[&str],
        body: &B,
    ) -> Result<T, Error> {
        self.send_json(Method::POST, tail, body).await
    }

    /// `<method> /v1/sbp/sessions/{id}/<tail>` with a JSON body.
    async fn send_json<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        tail: &[&str],
        body: &B,
    ) -> Result<T, Error> {
        let mut path = vec!["v1", "sbp", "sessions", self.id.as_str()];
        path.extend_from_slice(tail);
        let (status, _, v) = self
            .following(|base| {
                self.client
                    .json_request(base, method.clone(), &path, Some(&self.token), Some(body))
            })
            .await?;
        parse(status, v)
    }

    /// Sends the request `build` makes for the session's current gateway; when the answer is
    /// 409 `SBP_SESSION_MOVED` with a URL that may be followed, switches to that gateway and
    /// sends it again there (at most [`MAX_MOVES_PER_CALL`] times). A 409 means the gateway did
    /// nothing with the request, so sending it again is safe for every method.
    async fn following(
        &self,
        build: impl Fn(&Url) -> Result<reqwest::RequestBuilder, Error>,
    ) -> Result<(u16, HeaderMap, Value), Error> {
        let mut moves = 0;
        loop {
            let base = self.base_url();
            let answer = send(build(&base)?).await;
            let next = match &answer {
                Err(e) if moves < MAX_MOVES_PER_CALL => moved_to(e, &base),
                _ => None,
            };
            let Some(next) = next else {
                return answer;
            };
            moves += 1;
            tracing::info!(session_id = %self.id, from = %base, to = %next, "the session moved to another gateway; following it");
            *self.base.write().unwrap_or_else(PoisonError::into_inner) = next;
        }
    }
}

/// Where a 409 `SBP_SESSION_MOVED` answer from the gateway at `current` says to go, if this
/// client may follow it: `detail.gateway_url`, an `http(s)` URL with a host and no credentials,
/// other than `current`, and not plain `http` when `current` is `https` (the session token would
/// travel in clear).
fn moved_to(e: &Error, current: &Url) -> Option<Url> {
    let Error::Api {
        status: 409,
        code,
        detail,
        ..
    } = e
    else {
        return None;
    };
    if code != SESSION_MOVED {
        return None;
    }
    let raw = detail.as_ref()?.get("gateway_url")?.as_str()?;
    let next = followable(raw, current);
    if next.is_none() {
        tracing::warn!(gateway_url = %raw, from = %current, "not following a move to this URL");
    }
    next
}

/// `raw` as a base URL a session may be followed to from `current` (see [`moved_to`]).
fn followable(raw: &str, current: &Url) -> Option<Url> {
    let mut url = Url::parse(raw.trim()).ok()?;
    let scheme_ok = match url.scheme() {
        "https" => true,
        "http" => current.scheme() == "http",
        _ => false,
    };
    if !scheme_ok
        || url.cannot_be_a_base()
        || url.host_str().is_none_or(str::is_empty)
        || !url.username().is_empty()
        || url.password().is_some()
    {
        return None;
    }
    url.set_query(None);
    url.set_fragment(None);
    (url.as_str().trim_end_matches('/') != current.as_str().trim_end_matches('/')).then_some(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_derived_from_the_base() {
        let cases = [
            ("http://127.0.0.1:8080", "ws://127.0.0.1:8080/v1/sbp/ws/abc"),
            ("http://h:1/", "ws://h:1/v1/sbp/ws/abc"),
            (
                "https://gw.example/prefix",
                "wss://gw.example/prefix/v1/sbp/ws/abc",
            ),
            (
                "wss://gw.example/p/?q=1#f",
                "wss://gw.example/p/v1/sbp/ws/abc",
            ),
            ("ws://h", "ws://h/v1/sbp/ws/abc"),
        ];
        for (base, ws) in cases {
            let base = parse_base(base).expect(base);
            assert_eq!(ws_endpoint(&base, "abc").expect("ws url").as_str(), ws);
        }
        let base = parse_base("http://h").expect("base");
        let token_url = endpoint(&base, &["v1", "sbp", "token", "a/b c"]).expect("url");
        assert_eq!(token_url.as_str(), "http://h/v1/sbp/token/a%2Fb%20c");
    }

    #[test]
    fn moves_are_followed_only_to_http_urls_that_keep_the_token_safe() {
        let http = parse_base("http://127.0.0.1:8080").expect("base");
        let https = parse_base("https://a.example").expect("base");
        let cases = [
            (
                &http,
                "http://127.0.0.1:9090",
                Some("http://127.0.0.1:9090/"),
            ),
            (
                &http,
                "https://b.example/sbp/",
                Some("https://b.example/sbp/"),
            ),
            (
                &https,
                "https://b.example:8443?x=1#frag",
                Some("https://b.example:8443/"),
            ),
            // Never down to plain http from https, nor to anything but http(s).
            (&https, "http://b.example", None),
            (&http, "ws://127.0.0.1:9090", None),
            (&http, "ftp://127.0.0.1/", None),
            (&http, "javascript:alert(1)", None),
            (&http, "file:///etc/passwd", None),
            (&http, "data:text/plain,hi", None),
            (&http, "", None),
            (&http, "/relative/path", None),
            (&http, "http://user:pw@127.0.0.1:9090", None),
            (&http, "http://:pw@127.0.0.1:9090", None),
            // The gateway that answered: following it would loop.
            (&http, "http://127.0.0.1:8080/", None),
            (&https, "https://a.example", None),
        ];
        for (current, raw, want) in cases {
            assert_eq!(
                followable(raw, current).map(|u| u.to_string()).as_deref(),
                want,
                "{raw} from {current}"
            );
        }
    }

    #[test]
    fn only_a_409_session_moved_with_a_url_is_a_move() {
        let current = parse_base("http://127.0.0.1:8080").expect("base");
        let api = |status: u16, code: &str, detail: Option<Value>| Error::Api {
            status,
            code: code.into(),
            message: "moved".into(),
            detail,
        };
        let to_b =
            Some(serde_json::json!({"gateway_id": "b", "gateway_url": "http://127.0.0.1:9"}));
        assert_eq!(
            moved_to(&api(409, SESSION_MOVED, to_b.clone()), &current).map(|u| u.to_string()),
            Some("http://127.0.0.1:9/".to_owned())
        );
        for e in [
            api(409, "SBP_SESSION_MOVING", to_b.clone()),
            api(400, SESSION_MOVED, to_b.clone()),
            api(409, SESSION_MOVED, None),
            api(
                409,
                SESSION_MOVED,
                Some(serde_json::json!({"gateway_id": "b"})),
            ),
            api(
                409,
                SESSION_MOVED,
                Some(serde_json::json!({"gateway_url": 7})),
            ),
            api(
                409,
                SESSION_MOVED,
                Some(serde_json::json!({"gateway_url": ""})),
            ),
            Error::UnexpectedResponse {
                status: 409,
                reason: "moved".into(),
            },
        ] {
            assert_eq!(moved_to(&e, &current), None, "{e:?}");
        }
    }

    #[test]
    fn bad_bases_are_refused() {
        for bad in ["", "localhost:8080", "ftp://h", "mailto:x@y", "http://"] {
            assert!(
                matches!(parse_base(bad), Err(Error::InvalidUrl { .. })),
                "{bad}"
            );
        }
    }
}
