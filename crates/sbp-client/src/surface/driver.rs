//! The task behind a [`Surface`](super::Surface): owns the WebSocket, performs the ATTACH_SESSION
//! handshake, answers PING and TOOL_CALL, deduplicates by tether seq, sends ACKs for what the
//! application has taken, and reconnects with backoff after a drop.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use reqwest::Url;
use sbp_protocol::frames::{AttachSession, SessionAttached, ToolCall, ToolResult};
use sbp_protocol::{ClientFrame, ServerFrame, SurfaceContext};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::{Command, Disconnect, DisconnectKind, Event, SurfaceConfig};
use crate::Error;
use crate::reconnect::{CLOSE_TRY_AGAIN, ReconnectPolicy};
use crate::tools::ToolHandler;

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;
type WsError = tokio_tungstenite::tungstenite::Error;

/// Why a connect + attach attempt failed.
#[derive(Debug)]
pub(super) enum HandshakeError {
    /// The gateway refused or closed (FORBIDDEN, SESSION_NOT_FOUND, a close code) or the
    /// connection broke.
    Refused(Disconnect),
    /// The socket could not be opened or failed mid-handshake.
    Socket(WsError),
    Timeout(Duration),
    Encode(serde_json::Error),
}

impl HandshakeError {
    pub(super) fn into_error(self) -> Error {
        match self {
            Self::Refused(d) => d.into_error(),
            Self::Socket(e) => Error::from(e),
            Self::Timeout(t) => Error::Timeout(t),
            Self::Encode(e) => Error::Encode(e),
        }
    }
}

impl std::fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(d) => match (&d.detail, d.code) {
                (Some(detail), _) => write!(f, "{:?}: {detail}", d.kind),
                (None, Some(code)) => write!(f, "closed with {code}: {}", d.reason),
                (None, None) => write!(f, "{}", d.reason),
            },
            Self::Socket(e) => write!(f, "{e}"),
            Self::Timeout(t) => write!(f, "no SESSION_ATTACHED within {t:?}"),
            Self::Encode(e) => write!(f, "cannot encode ATTACH_SESSION: {e}"),
        }
    }
}

/// How one connection ended.
enum End {
    /// The application asked to close (or dropped the `Surface`); DETACH was sent.
    Detached(Disconnect),
    /// The gateway closed it or it broke.
    Dropped(Disconnect),
}

/// Tool calls in flight on one connection, with the `call_id` of each task so a handler that
/// panics still gets its TOOL_RESULT.
struct Calls {
    tasks: JoinSet<ClientFrame>,
    ids: HashMap<tokio::task::Id, String>,
}

pub(super) struct Driver {
    url: Url,
    session_id: String,
    session_token: String,
    context: SurfaceContext,
    tools: Option<Arc<dyn ToolHandler>>,
    policy: ReconnectPolicy,
    connect_timeout: Duration,
    idle_timeout: Option<Duration>,
    close_timeout: Duration,
    events: mpsc::UnboundedSender<Event>,
    commands: mpsc::UnboundedReceiver<Command>,
    /// What the application has taken (the `Surface` updates it).
    delivered: watch::Receiver<u64>,
    /// The same position, to start it again when the gateway does not know it.
    delivered_tx: Arc<watch::Sender<u64>>,
    /// Highest seq received from the gateway: anything at or below it is a repeat.
    received: u64,
    /// Highest seq acknowledged on the current connection (its attach's `last_seq` included).
    acked: u64,
}

impl Driver {
    pub(super) fn new(
        config: &SurfaceConfig,
        url: Url,
        context: SurfaceContext,
        events: mpsc::UnboundedSender<Event>,
        commands: mpsc::UnboundedReceiver<Command>,
        delivered_tx: Arc<watch::Sender<u64>>,
    ) -> Self {
        Self {
            url,
            session_id: config.session_id.clone(),
            session_token: config.session_token.clone(),
            context,
            tools: config.tools.clone(),
            policy: config.reconnect.clone(),
            connect_timeout: config.connect_timeout,
            idle_timeout: config.idle_timeout,
            close_timeout: config.close_timeout,
            events,
            commands,
            received: config.resume_from,
            acked: 0,
            delivered: delivered_tx.subscribe(),
            delivered_tx,
        }
    }

    fn emit(&self, event: Event) {
        // The application dropped the `Surface`: the task is about to detach anyway.
        let _ = self.events.send(event);
    }

    /// The attach of `Surface::connect`: its failure is the caller's error, not an event.
    pub(super) async fn first_attach(
        &mut self,
    ) -> Result<(Ws, Box<SessionAttached>, Vec<String>), HandshakeError> {
        let (ws, attached, early) = self.attach_once().await?;
        self.emit(Event::Connected {
            attached: attached.clone(),
            reconnected: false,
        });
        Ok((ws, attached, early))
    }

    /// One connect + ATTACH_SESSION with `last_seq` = what the application has taken.
    async fn attach_once(
        &mut self,
    ) -> Result<(Ws, Box<SessionAttached>, Vec<String>), HandshakeError> {
        let (text, last_seq) = self.attach_frame()?;
        let out = handshake(&self.url, text, self.connect_timeout).await?;
        self.attached_with(last_seq, &out.1);
        Ok(out)
    }

    /// The ATTACH_SESSION text and the `last_seq` it carries.
    fn attach_frame(&mut self) -> Result<(String, u64), HandshakeError> {
        let last_seq = *self.delivered.borrow_and_update();
        let frame = ClientFrame::Attach(AttachSession {
            session_id: self.session_id.clone(),
            session_token: self.session_token.clone(),
            surface_context: Some(self.context.clone()),
            last_seq: Some(last_seq),
        });
        let text = serde_json::to_string(&frame).map_err(HandshakeError::Encode)?;
        Ok((text, last_seq))
    }

    /// An attach with `last_seq` succeeded: it acknowledged everything up to it, unless the
    /// gateway says the position is not from this session's history (`last_seq_reset`): then
    /// every turn it sends is new, whatever its seq, and the position starts again from 0.
    fn attached_with(&mut self, last_seq: u64, attached: &SessionAttached) {
        if attached.last_seq_reset {
            tracing::warn!(url = %self.url, last_seq, "the gateway does not know this position; starting again from 0");
            self.received = 0;
            self.acked = 0;
            self.delivered_tx.send_replace(0);
            self.delivered.borrow_and_update();
            return;
        }
        self.acked = last_seq;
        tracing::info!(url = %self.url, last_seq, queued = attached.queued_turns, "surface attached");
    }

    /// Serves connections until the surface ends: one that drops is reconnected per the policy.
    pub(super) async fn run(mut self, ws: Ws, early: Vec<String>) {
        let mut attempt: u32 = 0;
        let mut conn = Some((ws, early));
        while let Some((ws, early)) = conn.take() {
            let since = Instant::now();
            // `serve` owns the socket: a dropped connection is closed before any reconnect, so the
            // gateway never sees this surface twice.
            let mut disconnect = match self.serve(ws, early).await {
                End::Detached(d) => {
                    self.emit(Event::Disconnected(d));
                    return;
                }
                End::Dropped(d) => d,
            };
            let retry =
                self.policy.enabled && !self.policy.is_terminal(disconnect.effective_code());
            disconnect.will_reconnect = retry;
            tracing::info!(kind = ?disconnect.kind, code = ?disconnect.code, reason = %disconnect.reason, retry, "surface disconnected");
            self.emit(Event::Disconnected(disconnect));
            if !retry {
                return;
            }
            if since.elapsed() >= self.policy.reset_after {
                attempt = 0;
            }
            conn = self.reconnect(&mut attempt).await;
        }
    }

    /// Attempts with backoff until one attaches (`Some`), or the surface ends: closed by the
    /// application, a terminal refusal, or `max_attempts` used up (each emits its `Disconnected`).
    async fn reconnect(&mut self, attempt: &mut u32) -> Option<(Ws, Vec<String>)> {
        let mut last_error: Option<String> = None;
        loop {
            *attempt += 1;
            if let Some(max) = self.policy.max_attempts
                && *attempt > max
            {
                self.emit(Event::Disconnected(Disconnect {
                    kind: DisconnectKind::GaveUp,
                    code: None,
                    reason: format!("gave up after {max} reconnect attempts"),
                    detail: last_error,
                    will_reconnect: false,
                }));
                return None;
            }
            let delay = self.policy.backoff.delay(*attempt);
            self.emit(Event::Reconnecting {
                attempt: *attempt,
                delay,
                last_error: last_error.take(),
            });
            if !self.pause(delay).await {
                self.emit(Event::Disconnected(closed_while_reconnecting()));
                return None;
            }
            let (text, last_seq) = match self.attach_frame() {
                Ok(f) => f,
                Err(e) => {
                    self.emit(Event::Disconnected(Disconnect {
                        kind: DisconnectKind::ProtocolError,
                        code: None,
                        reason: e.to_string(),
                        detail: None,
                        will_reconnect: false,
                    }));
                    return None;
                }
            };
            let url = self.url.clone();
            let attach = handshake(&url, text, self.connect_timeout);
            tokio::pin!(attach);
            // A close requested mid-attempt ends it; a new URL is used from the next attempt on.
            let outcome = loop {
                tokio::select! {
                    r = &mut attach => break Some(r),
                    cmd = self.commands.recv() => match cmd {
                        Some(Command::SetUrl(u)) => self.url = u,
                        Some(Command::Close) | None => break None,
                    },
                }
            };
            let Some(outcome) = outcome else {
                self.emit(Event::Disconnected(closed_while_reconnecting()));
                return None;
            };
            match outcome {
                Ok((ws, attached, early)) => {
                    self.attached_with(last_seq, &attached);
                    self.emit(Event::Connected {
                        attached,
                        reconnected: true,
                    });
                    return Some((ws, early));
                }
                Err(HandshakeError::Refused(mut d))
                    if self.policy.is_terminal(d.effective_code()) =>
                {
                    d.will_reconnect = false;
                    self.emit(Event::Disconnected(d));
                    return None;
                }
                Err(e) => {
                    tracing::debug!(attempt = *attempt, error = %e, "reconnect attempt failed");
                    last_error = Some(e.to_string());
                }
            }
        }
    }

    /// Waits `delay`; `false` if the application closed meanwhile. A new URL cuts the wait short.
    async fn pause(&mut self, delay: Duration) -> bool {
        let sleep = tokio::time::sleep(delay);
        tokio::pin!(sleep);
        tokio::select! {
            () = &mut sleep => true,
            cmd = self.commands.recv() => match cmd {
                Some(Command::SetUrl(url)) => {
                    self.url = url;
                    true
                }
                Some(Command::Close) | None => false,
            },
        }
    }

    /// One attached connection, until it ends.
    async fn serve(&mut self, mut ws: Ws, early: Vec<String>) -> End {
        let ws = &mut ws;
        let mut calls = Calls {
            tasks: JoinSet::new(),
            ids: HashMap::new(),
        };
        let mut refusal: Option<(DisconnectKind, String)> = None;
        for text in early {
            if let Err(e) = self.on_text(ws, &text, &mut calls, &mut refusal).await {
                return End::Dropped(broken(&e));
            }
        }
        // Anything taken while this connection was being made.
        if let Err(e) = self.flush_ack(ws).await {
            return End::Dropped(broken(&e));
        }
        let mut last_rx = Instant::now();
        let mut probed = false;
        loop {
            let idle_at = self
                .idle_timeout
                .map(|t| if probed { last_rx + t } else { last_rx + t / 2 });
            tokio::select! {
                cmd = self.commands.recv() => match cmd {
                    Some(Command::SetUrl(url)) => self.url = url,
                    Some(Command::Close) | None => return End::Detached(self.detach(ws).await),
                },
                changed = self.delivered.changed() => {
                    // The `Surface` was dropped: detach as `close` would.
                    if changed.is_err() {
                        return End::Detached(self.detach(ws).await);
                    }
                    if let Err(e) = self.flush_ack(ws).await {
                        return End::Dropped(broken(&e));
                    }
                }
                Some(done) = calls.tasks.join_next_with_id() => {
                    let frame = match done {
                        Ok((id, frame)) => {
                            calls.ids.remove(&id);
                            frame
                        }
                        Err(e) => match calls.ids.remove(&e.id()) {
                            Some(call_id) => tool_result(call_id, Err("the tool handler panicked".into())),
                            None => continue,
                        },
                    };
                    if let Err(e) = send(ws, &frame).await {
                        return End::Dropped(broken(&e));
                    }
                }
                msg = ws.next() => {
                    last_rx = Instant::now();
                    probed = false;
                    match msg {
                        None => return End::Dropped(lost(refusal, "connection closed without a close frame".into())),
                        Some(Err(e)) => return End::Dropped(lost(refusal, e.to_string())),
                        Some(Ok(Message::Close(frame))) => {
                            // Lets tungstenite answer the close before the socket is dropped.
                            let _ = tokio::time::timeout(self.close_timeout, ws.flush()).await;
                            return End::Dropped(closed(frame, refusal));
                        }
                        Some(Ok(Message::Text(text))) => {
                            if let Err(e) = self.on_text(ws, text.as_str(), &mut calls, &mut refusal).await {
                                return End::Dropped(broken(&e));
                            }
                        }
                        Some(Ok(_)) => {}
                    }
                }
                () = sleep_until(idle_at), if idle_at.is_some() => {
                    if probed {
                        return End::Dropped(Disconnect {
                            kind: DisconnectKind::IdleTimeout,
                            code: None,
                            reason: "nothing received within the idle timeout".into(),
                            detail: None,
                            will_reconnect: false,
                        });
                    }
                    probed = true;
                    if let Err(e) = ws.send(Message::Ping(Default::default())).await {
                        return End::Dropped(broken(&e));
                    }
                }
            }
        }
    }

    /// Handles one text frame: answers what needs answering, drops repeats, emits the rest.
    async fn on_text(
        &mut self,
        ws: &mut Ws,
        text: &str,
        calls: &mut Calls,
        refusal: &mut Option<(DisconnectKind, String)>,
    ) -> Result<(), WsError> {
        let frame = match serde_json::from_str::<ServerFrame>(text) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(error = %e, "invalid frame from the gateway");
                self.emit(Event::InvalidFrame {
                    text: text.to_owned(),
                    error: e.to_string(),
                });
                return Ok(());
            }
        };
        match &frame {
            ServerFrame::Ping => send(ws, &ClientFrame::Pong).await?,
            ServerFrame::ToolCall(call) => self.start_call(call.clone(), calls),
            ServerFrame::TetherTurn(t) => {
                if !self.fresh(Some(t.seq)) {
                    return Ok(());
                }
            }
            ServerFrame::TurnComplete(c) => {
                if !self.fresh(c.seq) {
                    return Ok(());
                }
            }
            ServerFrame::Forbidden { detail } => {
                *refusal = Some((DisconnectKind::Forbidden, detail.clone()));
                return Ok(());
            }
            ServerFrame::SessionNotFound { detail, .. } => {
                *refusal = Some((DisconnectKind::SessionNotFound, detail.clone()));
                return Ok(());
            }
            ServerFrame::ProtocolError { detail } => {
                *refusal = Some((DisconnectKind::ProtocolError, detail.clone()));
                return Ok(());
            }
            ServerFrame::SessionAttached(_) | ServerFrame::TurnChunk(_) | ServerFrame::Unknown => {}
        }
        self.emit(Event::Frame(frame));
        Ok(())
    }

    /// Whether a turn with this seq is new; records it. Turns without a seq are always new.
    fn fresh(&mut self, seq: Option<u64>) -> bool {
        let Some(seq) = seq else {
            return true;
        };
        if seq <= self.received {
            tracing::debug!(seq, received = self.received, "repeated turn dropped");
            return false;
        }
        self.received = seq;
        true
    }

    /// Runs the handler for one TOOL_CALL on a task of its own.
    fn start_call(&self, call: ToolCall, calls: &mut Calls) {
        let handler = self.tools.clone();
        let call_id = call.call_id.clone();
        let abort = calls.tasks.spawn(async move {
            let outcome = match handler {
                Some(h) => h.call(&call.tool_name, call.tool_input).await,
                None => Err(format!(
                    "this surface has no tool handler (tool '{}')",
                    call.tool_name
                )),
            };
            tool_result(call.call_id, outcome)
        });
        calls.ids.insert(abort.id(), call_id);
    }

    /// ACKs the highest seq the application has taken, if it is newer than the last ACK.
    async fn flush_ack(&mut self, ws: &mut Ws) -> Result<(), WsError> {
        let taken = *self.delivered.borrow_and_update();
        if taken > self.acked {
            send(ws, &ClientFrame::Ack { seq: taken }).await?;
            self.acked = taken;
        }
        Ok(())
    }

    /// ACK, DETACH, then waits (bounded) for the gateway's close. Frames arriving meanwhile are not
    /// handed out, so they stay unacknowledged and come again at the next attach.
    async fn detach(&mut self, ws: &mut Ws) -> Disconnect {
        let _ = self.flush_ack(ws).await;
        let sent = send(ws, &ClientFrame::Detach).await;
        let mut code = None;
        if sent.is_ok() {
            let wait = async {
                loop {
                    match ws.next().await {
                        None | Some(Err(_)) => return None,
                        Some(Ok(Message::Close(f))) => return f.map(|f| u16::from(f.code)),
                        Some(Ok(_)) => {}
                    }
                }
            };
            code = tokio::time::timeout(self.close_timeout, wait)
                .await
                .ok()
                .flatten();
        }
        let _ = tokio::time::timeout(self.close_timeout, ws.close(None)).await;
        tracing::info!(code = ?code, "surface detached");
        Disconnect {
            kind: DisconnectKind::Detached,
            code,
            reason: "DETACH sent".into(),
            detail: None,
            will_reconnect: false,
        }
    }
}

/// Connects to `url`, sends `attach`, and reads until SESSION_ATTACHED (frames before it are
/// returned to be handled after it) or a refusal.
async fn handshake(
    url: &Url,
    attach: String,
    timeout: Duration,
) -> Result<(Ws, Box<SessionAttached>, Vec<String>), HandshakeError> {
    let attempt = async {
        // Nagle off: an ACK or TOOL_RESULT right after another small frame must not wait for the
        // gateway's delayed ACK (up to 40 ms).
        let (mut ws, _) = tokio_tungstenite::connect_async_with_config(url.as_str(), None, true)
            .await
            .map_err(HandshakeError::Socket)?;
        ws.send(Message::text(attach))
            .await
            .map_err(HandshakeError::Socket)?;
        let mut early = Vec::new();
        let mut refusal = None;
        loop {
            let msg = match ws.next().await {
                None => {
                    return Err(HandshakeError::Refused(lost(
                        refusal,
                        "connection closed before SESSION_ATTACHED".into(),
                    )));
                }
                Some(Err(e)) if refusal.is_some() => {
                    return Err(HandshakeError::Refused(lost(refusal, e.to_string())));
                }
                Some(Err(e)) => return Err(HandshakeError::Socket(e)),
                Some(Ok(m)) => m,
            };
            match msg {
                Message::Text(text) => match serde_json::from_str::<ServerFrame>(text.as_str()) {
                    Ok(ServerFrame::SessionAttached(a)) => return Ok((ws, a, early)),
                    Ok(ServerFrame::Forbidden { detail }) => {
                        refusal = Some((DisconnectKind::Forbidden, detail));
                    }
                    Ok(ServerFrame::SessionNotFound { detail, .. }) => {
                        refusal = Some((DisconnectKind::SessionNotFound, detail));
                    }
                    Ok(ServerFrame::ProtocolError { detail }) => {
                        refusal = Some((DisconnectKind::ProtocolError, detail));
                    }
                    // A SESSION_ATTACHED the protocol types cannot read would otherwise leave the
                    // attach waiting for its timeout.
                    Err(e) if frame_type(text.as_str()).as_deref() == Some("SESSION_ATTACHED") => {
                        return Err(HandshakeError::Refused(Disconnect {
                            kind: DisconnectKind::ProtocolError,
                            code: None,
                            reason: "unreadable SESSION_ATTACHED".into(),
                            detail: Some(e.to_string()),
                            will_reconnect: false,
                        }));
                    }
                    _ => early.push(text.as_str().to_owned()),
                },
                Message::Close(frame) => {
                    return Err(HandshakeError::Refused(closed(frame, refusal)));
                }
                _ => {}
            }
        }
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| HandshakeError::Timeout(timeout))?
}

/// The `type` of a JSON frame, if it has one.
fn frame_type(text: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    v.get("type")?.as_str().map(str::to_owned)
}

async fn send(ws: &mut Ws, frame: &ClientFrame) -> Result<(), WsError> {
    // Every frame this SDK builds is a plain struct of strings and numbers: encoding cannot fail,
    // and an `Unknown` frame (not serialisable) is never built here.
    let text = serde_json::to_string(frame).unwrap_or_default();
    ws.send(Message::text(text)).await
}

fn tool_result(call_id: String, outcome: Result<serde_json::Value, String>) -> ClientFrame {
    let (result, error) = match outcome {
        Ok(v) => (Some(v), None),
        Err(e) => (None, Some(e)),
    };
    ClientFrame::ToolResult(ToolResult {
        call_id,
        result,
        error,
    })
}

/// A close from the gateway, with the error frame that preceded it, if any. A close with 1013
/// (try again: a session another gateway could not hand over now) is a retryable close whatever
/// error frame came first, not a refusal.
fn closed(frame: Option<CloseFrame>, refusal: Option<(DisconnectKind, String)>) -> Disconnect {
    let code = frame.as_ref().map(|f| u16::from(f.code));
    let reason = frame.map(|f| f.reason.to_string()).unwrap_or_default();
    let (kind, detail) = match refusal {
        Some((_, detail)) if code == Some(CLOSE_TRY_AGAIN) => {
            (DisconnectKind::Closed, Some(detail))
        }
        Some((kind, detail)) => (kind, Some(detail)),
        None => (DisconnectKind::from_code(code), None),
    };
    Disconnect {
        kind,
        code,
        reason,
        detail,
        will_reconnect: false,
    }
}

/// A connection that ended without a close frame (an error frame before it still names the kind).
fn lost(refusal: Option<(DisconnectKind, String)>, reason: String) -> Disconnect {
    let (kind, detail) = match refusal {
        Some((kind, detail)) => (kind, Some(detail)),
        None => (DisconnectKind::Network, None),
    };
    Disconnect {
        kind,
        code: None,
        reason,
        detail,
        will_reconnect: false,
    }
}

fn broken(e: &WsError) -> Disconnect {
    lost(None, e.to_string())
}

fn closed_while_reconnecting() -> Disconnect {
    Disconnect {
        kind: DisconnectKind::Detached,
        code: None,
        reason: "closed while reconnecting".into(),
        detail: None,
        will_reconnect: false,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

    fn close(code: u16) -> Option<CloseFrame> {
        Some(CloseFrame {
            code: CloseCode::from(code),
            reason: "why".into(),
        })
    }

    #[test]
    fn try_again_is_a_retryable_close_whatever_frame_came_first() {
        let refusal = || Some((DisconnectKind::ProtocolError, "try again: busy".to_owned()));
        let d = closed(close(CLOSE_TRY_AGAIN), refusal());
        assert_eq!(
            (d.kind, d.effective_code(), d.detail.as_deref()),
            (
                DisconnectKind::Closed,
                Some(CLOSE_TRY_AGAIN),
                Some("try again: busy")
            )
        );
        assert!(!ReconnectPolicy::default().is_terminal(d.effective_code()));
        let e = d.into_error();
        assert!(e.is_try_again(), "{e:?}");

        // Other refusals keep their kind (and their terminal close).
        let d = closed(close(1003), refusal());
        assert_eq!(d.kind, DisconnectKind::ProtocolError);
        assert!(!d.into_error().is_try_again());
        let d = closed(
            close(4003),
            Some((DisconnectKind::Forbidden, "bad token".into())),
        );
        assert_eq!(d.kind, DisconnectKind::Forbidden);
        let d = closed(close(CLOSE_TRY_AGAIN), None);
        assert_eq!(d.kind, DisconnectKind::Closed);
        assert!(d.into_error().is_try_again());
    }
}
