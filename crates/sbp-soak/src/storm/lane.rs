//! The storm's load: lanes that each drive one session at a time with one request in flight (so
//! the order things were acknowledged in is the order they must be stored in), and the surface
//! of a surface lane's session, attaching with `last_seq` and acknowledging every turn.
//!
//! A request whose answer a kill cut off is uncertain: it is sent again, unchanged and with the
//! same `Idempotency-Key`, until the gateway gives a definite answer. Only a 2xx answer
//! acknowledges an item.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;

use crate::rng::Rng;

/// Where the gateway is listening now; `None` while it is down. `generation` counts starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: SocketAddr,
    pub generation: u64,
}

/// Waits until the gateway is up.
pub async fn endpoint(live: &mut watch::Receiver<Option<Endpoint>>) -> Endpoint {
    loop {
        if let Some(ep) = *live.borrow_and_update() {
            return ep;
        }
        if live.changed().await.is_err() {
            // The storm is over; nothing will come back up. Park: the caller is being stopped.
            std::future::pending::<()>().await;
        }
    }
}

/// After a failed attempt: until the gateway restarts, or a short pause if it does not.
async fn pause_after_failure(live: &mut watch::Receiver<Option<Endpoint>>, used: Endpoint) {
    let deadline = Instant::now() + Duration::from_millis(250);
    loop {
        let changed = live.borrow().is_none_or(|ep| ep != used);
        if changed {
            return;
        }
        if tokio::time::timeout_at(deadline, live.changed())
            .await
            .is_err()
        {
            return;
        }
    }
}

/// What is shared by every task of one storm.
#[derive(Clone)]
pub struct Ctx {
    pub http: reqwest::Client,
    pub live: watch::Receiver<Option<Endpoint>>,
    pub stop: watch::Receiver<bool>,
    /// Things that must not happen and are neither loss nor duplication (an unexpected status,
    /// a wrong reply, an error frame), described.
    pub anomalies: Arc<Mutex<Vec<String>>>,
    /// 5xx answers, retried (a description each).
    pub server_errors: Arc<Mutex<Vec<String>>>,
    /// Items acknowledged so far (to show the load between kills).
    pub acked: Arc<AtomicU64>,
    /// 429 answers, each waited out (its `Retry-After`) and retried with the same key.
    pub rate_limited: Arc<AtomicU64>,
}

impl Ctx {
    pub fn anomaly(&self, what: String) {
        if let Ok(mut v) = self.anomalies.lock() {
            v.push(what);
        }
    }

    /// A 429 is a definite "not done": wait as asked (at most 5 s) and try again.
    async fn rate_limited(&self, headers: &reqwest::header::HeaderMap) {
        self.rate_limited.fetch_add(1, Ordering::Relaxed);
        let secs = headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(1)
            .min(5);
        tokio::time::sleep(Duration::from_secs(secs)).await;
    }

    fn server_error(&self, what: String) {
        if let Ok(mut v) = self.server_errors.lock() {
            v.push(what);
        }
    }

    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Push,
}

/// One request of a lane and what became of it.
#[derive(Debug, Clone)]
pub struct Item {
    pub tag: String,
    pub kind: Kind,
    /// For a completion, the user's text (the reply is `echo: ` and it); for a push, the turn.
    pub text: String,
    pub acked: bool,
    /// Attempts made (1 when the first answer was definite).
    pub attempts: u32,
    /// Acknowledged by a replay of a stored answer (`Idempotent-Replayed: true`).
    pub replayed: bool,
    /// The tether seq a push was given.
    pub push_seq: Option<u64>,
}

/// One session a lane drove, and (for a surface lane) what its surface received.
#[derive(Debug, Clone, Default)]
pub struct SessionLog {
    pub name: String,
    pub id: String,
    pub token: String,
    pub items: Vec<Item>,
    pub surface: Option<SurfaceLog>,
}

/// Every turn frame with a seq the surface received, in order, repeats included.
#[derive(Debug, Clone, Default)]
pub struct SurfaceLog {
    pub deliveries: Vec<(u64, String)>,
    pub max_seq: u64,
    pub connections: u32,
}

/// A lane: `surface` lanes mix pushes and completions on sessions with a surface attached;
/// the others chain completions, the first of each session creating it.
pub struct Lane {
    pub name: String,
    pub surface: bool,
    pub turns_per_session: u32,
    pub rng: Rng,
}

/// The filler words that make replies stream as several chunks.
const WORDS: [&str; 8] = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
];

impl Lane {
    /// Runs until the storm stops; returns every session it drove.
    pub async fn run(mut self, ctx: Ctx) -> Vec<SessionLog> {
        let mut logs = Vec::new();
        let mut session_no = 0u32;
        while !ctx.stopping() {
            let name = format!("{}.{session_no}", self.name);
            session_no += 1;
            let log = if self.surface {
                self.surface_session(&ctx, name).await
            } else {
                self.completion_session(&ctx, name).await
            };
            match log {
                Some(log) => logs.push(log),
                None => break,
            }
        }
        logs
    }

    fn text(&mut self, prefix: &str, tag: &str) -> String {
        let mut t = format!("{prefix} {tag}");
        for _ in 0..self.rng.below(24) {
            t.push(' ');
            let w = self.rng.pick(&WORDS);
            t.push_str(w);
        }
        t
    }

    /// Completions only; the first creates the session (an idempotent retry of it gets the
    /// same session and token back).
    async fn completion_session(&mut self, ctx: &Ctx, name: String) -> Option<SessionLog> {
        let mut log = SessionLog {
            name: name.clone(),
            ..SessionLog::default()
        };
        for n in 0..self.turns_per_session {
            if ctx.stopping() {
                break;
            }
            let tag = format!("{name}.{n}");
            let text = self.text("ask", &tag);
            let token = (!log.token.is_empty()).then(|| log.token.clone());
            let item = complete(ctx, &tag, text, token.as_deref(), false).await;
            let (item, created) = item?;
            if let Some((id, token)) = created {
                log.id = id;
                log.token = token;
            }
            let acked = item.acked;
            log.items.push(item);
            if log.token.is_empty() {
                // The creating request got no definite answer: nothing to continue.
                if !acked {
                    return Some(log);
                }
            }
        }
        Some(log)
    }

    /// A session made by `POST /v1/sessions`, its surface attached before the first turn (so
    /// every turn is tethered), then pushes and completions mixed.
    async fn surface_session(&mut self, ctx: &Ctx, name: String) -> Option<SessionLog> {
        let (id, token) = create_session(ctx).await?;
        let (attached_tx, mut attached_rx) = watch::channel(false);
        let (done_tx, done_rx) = watch::channel(false);
        let surface = Surface {
            name: name.clone(),
            id: id.clone(),
            token: token.clone(),
            rng: Rng::new(self.rng.next_u64()),
        };
        let surface_task = tokio::spawn(surface.run(ctx.clone(), attached_tx, done_rx));
        // Until the first SESSION_ATTACHED: from then on the session has had a surface.
        let first_attach = tokio::time::timeout(Duration::from_secs(60), async {
            while !*attached_rx.borrow_and_update() {
                if attached_rx.changed().await.is_err() {
                    break;
                }
            }
        });
        if first_attach.await.is_err() {
            ctx.anomaly(format!("{name}: the surface did not attach within 60 s"));
        }
        let mut log = SessionLog {
            name: name.clone(),
            id: id.clone(),
            token: token.clone(),
            ..SessionLog::default()
        };
        for n in 0..self.turns_per_session {
            if ctx.stopping() {
                break;
            }
            let tag = format!("{name}.{n}");
            let item = if self.rng.chance(50) {
                let text = self.text("push", &tag);
                push(ctx, &id, &token, &tag, text).await
            } else {
                let text = self.text("ask", &tag);
                complete(ctx, &tag, text, Some(&token), true)
                    .await
                    .map(|(i, _)| i)
            };
            match item {
                Some(i) => log.items.push(i),
                None => break,
            }
        }
        let _ = done_tx.send(true);
        log.surface = surface_task.await.ok();
        Some(log)
    }
}

/// A definite answer or why there was none.
enum Answer {
    Status(u16, reqwest::header::HeaderMap, Value),
    Uncertain(String),
}

async fn post(
    ctx: &Ctx,
    ep: Endpoint,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> Answer {
    let mut req = ctx
        .http
        .post(format!("http://{}{path}", ep.addr))
        .json(body);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    match req.send().await {
        Err(e) => Answer::Uncertain(format!("{e}")),
        Ok(resp) => {
            let status = resp.status().as_u16();
            let headers = resp.headers().clone();
            match resp.bytes().await {
                // The status line came but the body was cut: the outcome is still unknown.
                Err(e) => Answer::Uncertain(format!("body cut: {e}")),
                Ok(b) => Answer::Status(
                    status,
                    headers,
                    serde_json::from_slice(&b)
                        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&b).into())),
                ),
            }
        }
    }
}

/// How many times one item is tried before it is given up (a definite refusal ends it sooner).
const MAX_ATTEMPTS: u32 = 400;

/// A completion, retried until definite. Returns the item and, when it created the session,
/// `(id, token)`; `None` when the storm stopped while the gateway was down for good.
async fn complete(
    ctx: &Ctx,
    tag: &str,
    text: String,
    token: Option<&str>,
    resume: bool,
) -> Option<(Item, Option<(String, String)>)> {
    let key = uuid::Uuid::new_v4().to_string();
    let mut body = json!({
        "model": "soak-model",
        "messages": [{"role": "user", "content": text}],
    });
    if resume {
        body["sbp"] = json!({"resume": true});
    }
    let mut item = Item {
        tag: tag.to_owned(),
        kind: Kind::Completion,
        text: text.clone(),
        acked: false,
        attempts: 0,
        replayed: false,
        push_seq: None,
    };
    let mut headers = vec![("idempotency-key", key.as_str())];
    if let Some(t) = token {
        headers.push(("x-session-token", t));
    }
    let mut live = ctx.live.clone();
    let mut last_failure = String::new();
    while item.attempts < MAX_ATTEMPTS {
        let ep = endpoint(&mut live).await;
        item.attempts += 1;
        match post(ctx, ep, "/v1/chat/completions", &headers, &body).await {
            Answer::Uncertain(why) => {
                last_failure = why;
                pause_after_failure(&mut live, ep).await;
            }
            Answer::Status(200, h, v) => {
                let reply = v["choices"][0]["message"]["content"].as_str();
                let want = format!("echo: {text}");
                if reply != Some(want.as_str()) {
                    ctx.anomaly(format!("{tag}: reply {reply:?}, expected {want:?}"));
                }
                item.acked = true;
                ctx.acked.fetch_add(1, Ordering::Relaxed);
                item.replayed = h
                    .get("idempotent-replayed")
                    .is_some_and(|v| v.as_bytes() == b"true");
                let created = match (token, h.get("x-session-token")) {
                    (None, Some(t)) => {
                        let id = v["sbp"]["session_id"].as_str().unwrap_or_default();
                        Some((id.to_owned(), String::from_utf8_lossy(t.as_bytes()).into()))
                    }
                    (None, None) => {
                        ctx.anomaly(format!("{tag}: the creating completion has no token"));
                        None
                    }
                    _ => None,
                };
                return Some((item, created));
            }
            // The first attempt is still running (it will be failed at the next start if the
            // gateway died under it).
            Answer::Status(409, _, v) => {
                last_failure = format!("409 {v}");
                pause_after_failure(&mut live, ep).await;
            }
            Answer::Status(429, h, _) => ctx.rate_limited(&h).await,
            Answer::Status(s, _, v) if s >= 500 => {
                ctx.server_error(format!("{tag}: completion {s} {v}"));
                pause_after_failure(&mut live, ep).await;
            }
            Answer::Status(s, _, v) => {
                ctx.anomaly(format!("{tag}: completion answered {s} {v}"));
                return Some((item, None));
            }
        }
    }
    ctx.anomaly(format!(
        "{tag}: no definite answer in {MAX_ATTEMPTS} attempts (last: {last_failure})"
    ));
    Some((item, None))
}

/// A pushed turn, retried until definite with the same `Idempotency-Key`.
async fn push(ctx: &Ctx, id: &str, token: &str, tag: &str, text: String) -> Option<Item> {
    let key = uuid::Uuid::new_v4().to_string();
    let body = json!({"content": text, "role": "assistant"});
    let headers = [
        ("idempotency-key", key.as_str()),
        ("x-session-token", token),
    ];
    let mut item = Item {
        tag: tag.to_owned(),
        kind: Kind::Push,
        text: text.clone(),
        acked: false,
        attempts: 0,
        replayed: false,
        push_seq: None,
    };
    let path = format!("/v1/sbp/sessions/{id}/turns");
    let mut live = ctx.live.clone();
    let mut last_failure = String::new();
    while item.attempts < MAX_ATTEMPTS {
        let ep = endpoint(&mut live).await;
        item.attempts += 1;
        match post(ctx, ep, &path, &headers, &body).await {
            Answer::Uncertain(why) => {
                last_failure = why;
                pause_after_failure(&mut live, ep).await;
            }
            Answer::Status(200 | 201, h, v) => {
                item.acked = true;
                ctx.acked.fetch_add(1, Ordering::Relaxed);
                item.push_seq = v["seq"].as_u64();
                item.replayed = h
                    .get("idempotent-replayed")
                    .is_some_and(|v| v.as_bytes() == b"true");
                if item.push_seq.is_none() {
                    ctx.anomaly(format!("{tag}: push answer without a seq: {v}"));
                }
                return Some(item);
            }
            Answer::Status(409, _, v) => {
                last_failure = format!("409 {v}");
                pause_after_failure(&mut live, ep).await;
            }
            Answer::Status(429, h, _) => ctx.rate_limited(&h).await,
            Answer::Status(s, _, v) if s >= 500 => {
                ctx.server_error(format!("{tag}: push {s} {v}"));
                pause_after_failure(&mut live, ep).await;
            }
            Answer::Status(s, _, v) => {
                ctx.anomaly(format!("{tag}: push answered {s} {v}"));
                return Some(item);
            }
        }
    }
    ctx.anomaly(format!(
        "{tag}: no definite answer in {MAX_ATTEMPTS} attempts (last: {last_failure})"
    ));
    Some(item)
}

/// `POST /v1/sessions` until one is made (an uncertain attempt may leave an unused session
/// behind: harmless, it is never checked). `None` when the storm stops first.
async fn create_session(ctx: &Ctx) -> Option<(String, String)> {
    let mut live = ctx.live.clone();
    for _ in 0..MAX_ATTEMPTS {
        if ctx.stopping() {
            return None;
        }
        let ep = endpoint(&mut live).await;
        match post(ctx, ep, "/v1/sessions", &[], &json!({})).await {
            Answer::Status(200 | 201, _, v) => {
                let id = v["session_id"].as_str();
                let token = v["session_token"].as_str();
                if let (Some(id), Some(token)) = (id, token) {
                    return Some((id.to_owned(), token.to_owned()));
                }
                ctx.anomaly(format!("session creation answered {v}"));
                return None;
            }
            Answer::Status(429, h, _) => ctx.rate_limited(&h).await,
            Answer::Status(s, _, v) if s < 500 => {
                ctx.anomaly(format!("session creation answered {s} {v}"));
                return None;
            }
            _ => pause_after_failure(&mut live, ep).await,
        }
    }
    None
}

/// The surface of one session: attaches with `last_seq` (the highest seq it holds, 0 at first:
/// ack mode), records and ACKs every turn, answers PINGs, and now and then leaves (DETACH or a
/// plain drop) and comes back.
struct Surface {
    name: String,
    id: String,
    token: String,
    rng: Rng,
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

impl Surface {
    async fn run(
        mut self,
        ctx: Ctx,
        attached: watch::Sender<bool>,
        mut done: watch::Receiver<bool>,
    ) -> SurfaceLog {
        let mut log = SurfaceLog::default();
        let mut live = ctx.live.clone();
        while !*done.borrow() {
            let ep = tokio::select! {
                ep = endpoint(&mut live) => ep,
                _ = done.changed() => break,
            };
            let url = format!("ws://{}/v1/sbp/ws/{}", ep.addr, self.id);
            let ws = tokio::time::timeout(
                Duration::from_secs(5),
                tokio_tungstenite::connect_async(url),
            )
            .await;
            let mut ws = match ws {
                Ok(Ok((ws, _))) => ws,
                _ => {
                    pause_after_failure(&mut live, ep).await;
                    continue;
                }
            };
            log.connections += 1;
            let stay = Duration::from_millis(self.rng.range(1500, 6000));
            let polite = self.rng.chance(50);
            self.connection(&ctx, &mut ws, &mut log, &attached, &mut done, stay, polite)
                .await;
        }
        log
    }

    /// One connection, until it drops, the surface leaves or the lane is done.
    #[allow(clippy::too_many_arguments)]
    async fn connection(
        &mut self,
        ctx: &Ctx,
        ws: &mut Ws,
        log: &mut SurfaceLog,
        attached: &watch::Sender<bool>,
        done: &mut watch::Receiver<bool>,
        stay: Duration,
        polite: bool,
    ) {
        let attach = json!({
            "type": "ATTACH_SESSION",
            "session_id": self.id,
            "session_token": self.token,
            "last_seq": log.max_seq,
        });
        if ws.send(Message::text(attach.to_string())).await.is_err() {
            return;
        }
        let leave_at = Instant::now() + stay;
        let mut partial: HashMap<String, String> = HashMap::new();
        loop {
            let msg = tokio::select! {
                m = ws.next() => m,
                _ = tokio::time::sleep_until(leave_at) => {
                    if polite {
                        let _ = ws.send(Message::text(r#"{"type":"DETACH"}"#)).await;
                        // The close that acknowledges the DETACH, briefly.
                        let _ = tokio::time::timeout(Duration::from_secs(2), async {
                            while let Some(Ok(m)) = ws.next().await {
                                if matches!(m, Message::Close(_)) { break; }
                            }
                        }).await;
                    }
                    return;
                }
                _ = done.changed() => {
                    let _ = ws.close(None).await;
                    return;
                }
            };
            let text = match msg {
                Some(Ok(Message::Text(t))) => t,
                Some(Ok(Message::Close(frame))) => {
                    if let Some(f) = frame
                        && u16::from(f.code) == sbp_protocol::frames::CLOSE_DISPLACED
                    {
                        ctx.anomaly(format!("{}: surface displaced (4409)", self.name));
                    }
                    return;
                }
                Some(Ok(_)) => continue,
                // Dropped (the gateway was killed).
                Some(Err(_)) | None => return,
            };
            let Ok(v) = serde_json::from_str::<Value>(text.as_str()) else {
                ctx.anomaly(format!("{}: frame is not JSON: {text}", self.name));
                return;
            };
            let seq_text = match v["type"].as_str() {
                Some("SESSION_ATTACHED") => {
                    let _ = attached.send(true);
                    None
                }
                Some("PING") => {
                    let _ = ws.send(Message::text(r#"{"type":"PONG"}"#)).await;
                    None
                }
                Some("TURN_CHUNK") => {
                    let id = v["chunk_id"].as_str().unwrap_or_default().to_owned();
                    partial
                        .entry(id)
                        .or_default()
                        .push_str(v["delta"].as_str().unwrap_or_default());
                    None
                }
                Some("TURN_COMPLETE") => {
                    let id = v["chunk_id"].as_str().unwrap_or_default();
                    let text = partial.remove(id).unwrap_or_default();
                    v["seq"].as_u64().map(|s| (s, text))
                }
                Some("TETHER_TURN") => {
                    if let Some(id) = v["chunk_id"].as_str() {
                        partial.remove(id);
                    }
                    let text = v["content"].as_str().unwrap_or_default().to_owned();
                    v["seq"].as_u64().map(|s| (s, text))
                }
                Some("TOOL_CALL") => None,
                _ => {
                    ctx.anomaly(format!("{}: unexpected frame {v}", self.name));
                    None
                }
            };
            if let Some((seq, text)) = seq_text {
                log.deliveries.push((seq, text));
                log.max_seq = log.max_seq.max(seq);
                let ack = json!({"type": "ACK", "seq": seq});
                if ws.send(Message::text(ack.to_string())).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// After the storm: attaches once more with `last_seq` and takes everything still queued
/// (acknowledging it), then detaches. Returns the deliveries, or why the drain failed.
pub async fn final_drain(addr: SocketAddr, log: &SessionLog) -> Result<Vec<(u64, String)>, String> {
    let last_seq = log.surface.as_ref().map_or(0, |s| s.max_seq);
    let url = format!("ws://{addr}/v1/sbp/ws/{}", log.id);
    let (mut ws, _) = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_tungstenite::connect_async(url),
    )
    .await
    .map_err(|_| "connect timed out".to_owned())?
    .map_err(|e| format!("connect: {e}"))?;
    let attach = json!({
        "type": "ATTACH_SESSION",
        "session_id": log.id,
        "session_token": log.token,
        "last_seq": last_seq,
    });
    ws.send(Message::text(attach.to_string()))
        .await
        .map_err(|e| format!("send: {e}"))?;
    let mut queued: Option<u64> = None;
    let mut got = Vec::new();
    while queued.is_none_or(|q| (got.len() as u64) < q) {
        let m = tokio::time::timeout(Duration::from_secs(10), ws.next())
            .await
            .map_err(|_| format!("drain stalled after {} turns", got.len()))?;
        let text = match m {
            Some(Ok(Message::Text(t))) => t,
            Some(Ok(Message::Close(f))) => return Err(format!("closed during the drain: {f:?}")),
            Some(Ok(_)) => continue,
            Some(Err(e)) => return Err(format!("{e}")),
            None => return Err("closed during the drain".into()),
        };
        let v: Value = serde_json::from_str(text.as_str()).map_err(|e| format!("{e}"))?;
        match v["type"].as_str() {
            Some("SESSION_ATTACHED") => queued = v["queued_turns"].as_u64(),
            Some("TETHER_TURN") => {
                let seq = v["seq"].as_u64().ok_or("TETHER_TURN without seq")?;
                got.push((seq, v["content"].as_str().unwrap_or_default().to_owned()));
                let ack = json!({"type": "ACK", "seq": seq});
                ws.send(Message::text(ack.to_string()))
                    .await
                    .map_err(|e| format!("ack: {e}"))?;
            }
            Some("PING") => {
                let _ = ws.send(Message::text(r#"{"type":"PONG"}"#)).await;
            }
            _ => return Err(format!("unexpected frame during the drain: {v}")),
        }
    }
    let _ = ws.send(Message::text(r#"{"type":"DETACH"}"#)).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(m)) = ws.next().await {
            if matches!(m, Message::Close(_)) {
                break;
            }
        }
    })
    .await;
    Ok(got)
}
