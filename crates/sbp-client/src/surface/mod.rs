//! A surface attached over WebSocket: [`SurfaceConfig`] says who it is, [`Surface::connect`]
//! attaches, and [`Surface::next_event`] (or the `Stream` impl) hands the application the server's
//! frames and the connection's state changes. A background task owns the socket: it answers PING
//! and TOOL_CALL, acknowledges what the application has taken, and reconnects with backoff.

mod driver;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use reqwest::Url;
use sbp_protocol::frames::{
    CLOSE_FORBIDDEN, CLOSE_NOT_FOUND, CLOSE_PROTOCOL_ERROR, SessionAttached,
};
use sbp_protocol::{ServerFrame, SurfaceContext};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::Error;
use crate::reconnect::{CLOSE_DISPLACED, ReconnectPolicy};
use crate::rest::{parse_base, ws_endpoint};
use crate::tools::{ToolHandler, declare};

/// How to attach: the gateway, the session and its token, and what this surface is.
#[derive(Clone)]
pub struct SurfaceConfig {
    base: String,
    session_id: String,
    session_token: String,
    context: SurfaceContext,
    tools: Option<Arc<dyn ToolHandler>>,
    reconnect: ReconnectPolicy,
    resume_from: u64,
    connect_timeout: Duration,
    idle_timeout: Option<Duration>,
    close_timeout: Duration,
}

impl std::fmt::Debug for SurfaceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SurfaceConfig")
            .field("base", &self.base)
            .field("session_id", &self.session_id)
            .field("context", &self.context)
            .field("tools", &self.tools.as_ref().map(|t| t.tools()))
            .field("reconnect", &self.reconnect)
            .field("resume_from", &self.resume_from)
            .finish_non_exhaustive()
    }
}

impl SurfaceConfig {
    /// `base_url` is the gateway's HTTP (or WebSocket) base URL, e.g. `http://127.0.0.1:8080`.
    pub fn new(
        base_url: impl Into<String>,
        session_id: impl Into<String>,
        session_token: impl Into<String>,
    ) -> Self {
        Self {
            base: base_url.into(),
            session_id: session_id.into(),
            session_token: session_token.into(),
            context: SurfaceContext::default(),
            tools: None,
            reconnect: ReconnectPolicy::default(),
            resume_from: 0,
            connect_timeout: Duration::from_secs(10),
            idle_timeout: Some(Duration::from_secs(60)),
            close_timeout: Duration::from_secs(5),
        }
    }

    pub(crate) fn for_url(base: Url, session_id: &str, session_token: &str) -> Self {
        Self::new(String::from(base), session_id, session_token)
    }

    /// The gateway base URL this surface attaches to.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The SurfaceContext sent in every ATTACH_SESSION (the handler's tools are added to it).
    pub fn context(mut self, context: SurfaceContext) -> Self {
        self.context = context;
        self
    }

    /// Shorthand for a context with only a `device_type`.
    pub fn device_type(mut self, device_type: impl Into<String>) -> Self {
        self.context.device_type = Some(device_type.into());
        self
    }

    /// Answers TOOL_CALLs; its tools are declared at attach.
    pub fn tools(mut self, handler: impl ToolHandler) -> Self {
        self.tools = Some(Arc::new(handler));
        self
    }

    /// Like [`tools`](Self::tools), for a handler that is already shared.
    pub fn tools_arc(mut self, handler: Arc<dyn ToolHandler>) -> Self {
        self.tools = Some(handler);
        self
    }

    pub fn reconnect(mut self, policy: ReconnectPolicy) -> Self {
        self.reconnect = policy;
        self
    }

    /// The highest tether seq the application already has from an earlier run (see
    /// [`Surface::last_seq`]): older turns are acknowledged and not delivered again.
    pub fn resume_from(mut self, last_seq: u64) -> Self {
        self.resume_from = last_seq;
        self
    }

    /// Limit on connecting plus the ATTACH_SESSION handshake (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// A connection that receives nothing for half this time is probed with a WebSocket ping, and
    /// treated as lost after the whole time (default 60 s; `None`: never).
    pub fn idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// How long [`Surface::close`] waits for the gateway to confirm a DETACH (default 5 s).
    pub fn close_timeout(mut self, timeout: Duration) -> Self {
        self.close_timeout = timeout;
        self
    }

    pub fn session_id(&self) -> &str {
        &self.session_id
    }
}

/// What a surface hands the application, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// SESSION_ATTACHED: the first attach, or a reconnect (`reconnected`). Its `queued_turns` is the
    /// gateway's count; TETHER_TURNs this surface already had are not delivered again.
    Connected {
        attached: Box<SessionAttached>,
        reconnected: bool,
    },
    /// A frame from the gateway: TETHER_TURN, TURN_CHUNK, TURN_COMPLETE, TOOL_CALL (already being
    /// answered by the handler), PING (already answered), or a type this SDK does not know.
    /// FORBIDDEN, SESSION_NOT_FOUND and PROTOCOL_ERROR arrive as [`Event::Disconnected`] instead.
    Frame(ServerFrame),
    /// A text frame that is not a valid server frame (kept, not fatal).
    InvalidFrame { text: String, error: String },
    /// The connection ended. Unless `will_reconnect`, this is the last event.
    Disconnected(Disconnect),
    /// Waiting `delay` before reconnect attempt `attempt` (1-based); `last_error` is why the
    /// previous attempt failed.
    Reconnecting {
        attempt: u32,
        delay: Duration,
        last_error: Option<String>,
    },
}

impl Event {
    /// The tether seq this event delivers (TETHER_TURN, or a TURN_COMPLETE that carries one).
    pub fn seq(&self) -> Option<u64> {
        match self {
            Self::Frame(ServerFrame::TetherTurn(t)) => Some(t.seq),
            Self::Frame(ServerFrame::TurnComplete(c)) => c.seq,
            _ => None,
        }
    }
}

/// Why a connection ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Disconnect {
    pub kind: DisconnectKind,
    /// The WebSocket close code, when the gateway sent one.
    pub code: Option<u16>,
    /// The close reason, or the error that ended the connection.
    pub reason: String,
    /// The `detail` of a FORBIDDEN / SESSION_NOT_FOUND / PROTOCOL_ERROR frame before the close.
    pub detail: Option<String>,
    /// Whether the surface is going to reconnect.
    pub will_reconnect: bool,
}

/// The kinds of [`Disconnect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DisconnectKind {
    /// This surface sent DETACH ([`Surface::close`], or the `Surface` was dropped).
    Detached,
    /// FORBIDDEN / 4003: the token is not (or no longer) this session's.
    Forbidden,
    /// SESSION_NOT_FOUND / 4004.
    SessionNotFound,
    /// 4409: another surface attached to the session.
    Displaced,
    /// PROTOCOL_ERROR / 1003.
    ProtocolError,
    /// Any other close from the gateway (1001 when it shuts down or missed a PONG, ...).
    Closed,
    /// The connection broke, or could not be made, without a close frame.
    Network,
    /// Nothing was received for the idle timeout.
    IdleTimeout,
    /// `max_attempts` reconnects failed in a row.
    GaveUp,
}

impl DisconnectKind {
    /// The kind a close code (or, before it, an error frame) names.
    pub(crate) fn from_code(code: Option<u16>) -> Self {
        match code {
            Some(CLOSE_FORBIDDEN) => Self::Forbidden,
            Some(CLOSE_NOT_FOUND) => Self::SessionNotFound,
            Some(CLOSE_DISPLACED) => Self::Displaced,
            Some(CLOSE_PROTOCOL_ERROR) => Self::ProtocolError,
            Some(_) => Self::Closed,
            None => Self::Network,
        }
    }

    /// The close code the protocol pairs with this kind, for an error frame whose close was lost.
    pub(crate) fn implied_code(self) -> Option<u16> {
        match self {
            Self::Forbidden => Some(CLOSE_FORBIDDEN),
            Self::SessionNotFound => Some(CLOSE_NOT_FOUND),
            Self::Displaced => Some(CLOSE_DISPLACED),
            Self::ProtocolError => Some(CLOSE_PROTOCOL_ERROR),
            _ => None,
        }
    }
}

impl Disconnect {
    /// The close code, or the one implied by an error frame that came without a close.
    pub fn effective_code(&self) -> Option<u16> {
        self.code.or_else(|| self.kind.implied_code())
    }

    pub(crate) fn into_error(self) -> Error {
        let detail = self.detail.unwrap_or(self.reason.clone());
        match self.kind {
            DisconnectKind::Forbidden => Error::Forbidden { detail },
            DisconnectKind::SessionNotFound => Error::SessionNotFound { detail },
            DisconnectKind::ProtocolError => Error::Protocol { detail },
            _ => Error::Closed {
                code: self.code,
                reason: detail,
            },
        }
    }
}

/// Commands from the application to the connection task.
#[derive(Debug)]
enum Command {
    SetUrl(Url),
    Close,
}

/// An attached surface. Read its events with [`next_event`](Self::next_event) or as a `Stream`;
/// finish with [`close`](Self::close) (dropping it detaches too, in the background).
#[derive(Debug)]
pub struct Surface {
    events: mpsc::UnboundedReceiver<Event>,
    commands: mpsc::UnboundedSender<Command>,
    /// Highest tether seq handed to the application: ACKed, and `last_seq` of the next attach.
    delivered: Arc<watch::Sender<u64>>,
    task: Option<JoinHandle<()>>,
    attached: Box<SessionAttached>,
    session_id: String,
}

impl Surface {
    /// Connects and attaches. The first attach fails fast: a refusal (forbidden, not found) or an
    /// unreachable gateway is an error here; later drops are reconnected per the policy.
    pub async fn connect(config: SurfaceConfig) -> Result<Self, Error> {
        let base = parse_base(&config.base)?;
        let url = ws_endpoint(&base, &config.session_id)?;
        let mut context = config.context.clone();
        if let Some(tools) = &config.tools {
            declare(&mut context, &tools.tools());
        }
        let (events_tx, events) = mpsc::unbounded_channel();
        let (commands, commands_rx) = mpsc::unbounded_channel();
        let delivered = Arc::new(watch::Sender::new(config.resume_from));
        let mut driver = driver::Driver::new(
            &config,
            url,
            context,
            events_tx,
            commands_rx,
            delivered.clone(),
        );
        let span = tracing::info_span!("sbp_surface", session_id = %config.session_id);
        let (ws, attached, early) = driver
            .first_attach()
            .instrument(span.clone())
            .await
            .map_err(|e| e.into_error())?;
        let task = tokio::spawn(driver.run(ws, early).instrument(span));
        Ok(Self {
            events,
            commands,
            delivered,
            task: Some(task),
            attached,
            session_id: config.session_id,
        })
    }

    /// The next event; `None` once the surface has ended (after its last `Disconnected`).
    pub async fn next_event(&mut self) -> Option<Event> {
        let event = self.events.recv().await;
        if let Some(e) = &event {
            self.mark_delivered(e);
        }
        event
    }

    /// The first SESSION_ATTACHED.
    pub fn attached(&self) -> &SessionAttached {
        &self.attached
    }

    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// The highest tether seq handed to the application so far. Persist it and pass it to
    /// [`SurfaceConfig::resume_from`] to resume in a later run without repeats.
    pub fn last_seq(&self) -> u64 {
        *self.delivered.borrow()
    }

    /// Reconnect to another base URL from now on (the gateway moved, or came back elsewhere). A
    /// surface waiting to reconnect tries it at once; an attached one keeps its connection.
    pub fn set_url(&self, base_url: &str) -> Result<(), Error> {
        let url = ws_endpoint(&parse_base(base_url)?, &self.session_id)?;
        // The task ended: there is nothing left to reconnect.
        let _ = self.commands.send(Command::SetUrl(url));
        Ok(())
    }

    /// Sends DETACH (after acknowledging what was handed out), waits for the gateway to close the
    /// connection and for the task to end. Events still queued stay readable, the last being
    /// `Disconnected` with [`DisconnectKind::Detached`]. Turns the application has not taken yet
    /// are not acknowledged: the gateway keeps them for the next attach.
    pub async fn close(&mut self) {
        // An error means the task has already ended.
        let _ = self.commands.send(Command::Close);
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            tracing::error!(session_id = %self.session_id, error = %e, "surface task failed");
        }
    }

    fn mark_delivered(&self, event: &Event) {
        if let Some(seq) = event.seq() {
            self.delivered.send_if_modified(|d| {
                let newer = seq > *d;
                if newer {
                    *d = seq;
                }
                newer
            });
        }
    }
}

impl Stream for Surface {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        let polled = self.events.poll_recv(cx);
        if let Poll::Ready(Some(e)) = &polled {
            self.mark_delivered(e);
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_codes_name_kinds_and_back() {
        for (code, kind) in [
            (4003, DisconnectKind::Forbidden),
            (4004, DisconnectKind::SessionNotFound),
            (4409, DisconnectKind::Displaced),
            (1003, DisconnectKind::ProtocolError),
        ] {
            assert_eq!(DisconnectKind::from_code(Some(code)), kind);
            assert_eq!(kind.implied_code(), Some(code));
        }
        assert_eq!(
            DisconnectKind::from_code(Some(1001)),
            DisconnectKind::Closed
        );
        assert_eq!(DisconnectKind::from_code(None), DisconnectKind::Network);
        assert_eq!(DisconnectKind::Network.implied_code(), None);
    }

    #[test]
    fn refusals_become_typed_errors() {
        let d = |kind, code, detail: Option<&str>| Disconnect {
            kind,
            code,
            reason: "reason".into(),
            detail: detail.map(str::to_owned),
            will_reconnect: false,
        };
        assert!(matches!(
            d(DisconnectKind::Forbidden, Some(4003), Some("bad token")).into_error(),
            Error::Forbidden { detail } if detail == "bad token"
        ));
        assert!(matches!(
            d(DisconnectKind::SessionNotFound, None, None).into_error(),
            Error::SessionNotFound { detail } if detail == "reason"
        ));
        assert!(matches!(
            d(DisconnectKind::Closed, Some(1011), None).into_error(),
            Error::Closed {
                code: Some(1011),
                ..
            }
        ));
        assert_eq!(
            d(DisconnectKind::Forbidden, None, None).effective_code(),
            Some(4003)
        );
    }
}
