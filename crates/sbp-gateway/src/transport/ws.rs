//! The WebSocket endpoint `/v1/sbp/ws/{session_id}`: the ATTACH_SESSION handshake with the close
//! codes of the frame reference, then one loop per connection that forwards engine messages (live
//! chunks, completed turns, displacement) to the socket, answers client frames, pings, and detaches.
//! Every write is bounded in time and every connection's queued turn traffic in bytes: a surface
//! that stops reading is dropped (1008) and its turns stay in the tether. The upgrade, the byte
//! stream and the closing handshake are in `ws/`.

mod handshake;
mod socket;
mod wire;

use std::convert::Infallible;
use std::time::Duration;

use axum::Extension;
use axum::extract::{MatchedPath, Path, State};
use axum::response::Response;
use hyper_util::rt::TokioIo;
use sbp_protocol::frames::FrameError;
use sbp_protocol::frames::{
    CLOSE_FORBIDDEN, CLOSE_GOING_AWAY, CLOSE_NORMAL, CLOSE_NOT_FOUND, CLOSE_PROTOCOL_ERROR,
};
use sbp_protocol::{ClientFrame, ServerFrame};
use tokio::time::Instant;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};

use crate::Gateway;
use crate::engine::connections::{ConnMsg, Inbox};
use crate::engine::surfaces::{AttachError, CtpFrames, Delivery, Frame};
use crate::transport::access::{self, RequestId};
use handshake::WsUpgrade;
pub(super) use socket::Totals;
use socket::{Close, Incoming, Socket, Tally, WriteFailed};
use wire::{FrameLimit, Wire};

/// Close code sent to a connection displaced by a newer ATTACH_SESSION (docs/PROTOCOL-EXTENSIONS.md).
pub use sbp_protocol::frames::CLOSE_DISPLACED;
/// Read and write buffer size of a WebSocket connection.
const WS_BUFFER: usize = 1024;
/// Close code for an internal failure during attach.
const CLOSE_INTERNAL: u16 = 1011;
/// RFC 6455 1013: try again later (a session another gateway could not hand over now).
const CLOSE_TRY_AGAIN: u16 = 1013;

pub async fn upgrade(
    State(gw): State<Gateway>,
    Path(id): Path<String>,
    route: MatchedPath,
    request_id: Option<Extension<RequestId>>,
    ws: WsUpgrade,
) -> Response {
    let (mut response, on_upgrade) = ws.accept();
    // The connection writes its own access line when it ends.
    let line = access::Connection::new(route.as_str(), &id, request_id.map(|Extension(r)| r));
    response.extensions_mut().insert(access::OwnLine);
    let tracked = gw.clone();
    let task = async move {
        let Ok(upgraded) = on_upgrade.await else {
            return;
        };
        let tally = Tally::new(gw.metrics().ws_frames.clone());
        let open = gw.metrics().ws_open.clone();
        open.inc();
        let cfg = gw.config();
        let max = cfg.max_frame_bytes;
        // Small buffers: tungstenite's 128 KiB defaults would cost ~256 KiB per idle surface. Writes
        // are flushed frame by frame, so the write buffer holds at most the frame being written:
        // it is not capped (a cap would make a turn larger than it undeliverable, on every
        // reconnect); a surface that stops reading is bounded by the write timeout and the
        // outbound budget instead. The size limits apply to what the client sends.
        let ws_config = WebSocketConfig::default()
            .max_message_size(Some(max))
            .max_frame_size(Some(max))
            .read_buffer_size(WS_BUFFER)
            .write_buffer_size(WS_BUFFER)
            .max_write_buffer_size(usize::MAX);
        let wire = Wire::new(
            TokioIo::new(upgraded),
            FrameLimit::new(cfg.ws_frame_rate, cfg.ws_frame_burst),
        );
        let stream = WebSocketStream::from_raw_socket(wire, Role::Server, Some(ws_config)).await;
        let socket = Socket::new(stream, cfg.ws_write_timeout, tally.clone());
        run(gw, id, socket).await;
        open.dec();
        line.ended(&tally.totals());
    };
    // In the request's span: what the connection logs carries its request id.
    tokio::spawn(tracked.track(tracing::Instrument::in_current_span(task)));
    response
}

/// A client frame parsed, and counted by its type.
fn parse(socket: &Socket, text: &str) -> Result<ClientFrame, FrameError> {
    let parsed = ClientFrame::parse(text);
    let kind = match &parsed {
        Ok(ClientFrame::Attach(_)) => "ATTACH_SESSION",
        Ok(ClientFrame::Detach) => "DETACH",
        Ok(ClientFrame::ToolResult(_)) => "TOOL_RESULT",
        Ok(ClientFrame::Pong) => "PONG",
        Ok(ClientFrame::Ack { .. }) => "ACK",
        // The client names these types: one label for all of them keeps the set closed.
        Ok(ClientFrame::Unknown { .. }) => "UNKNOWN",
        Err(_) => "INVALID",
    };
    socket.received(kind, text.len());
    parsed
}

/// Why a connection ended, and how it is closed.
struct End {
    reason: &'static str,
    close: Close,
    /// The tether seq of a frame whose write was abandoned part-way: if the close frame still
    /// gets out, that frame went out whole before it.
    abandoned_seq: Option<u64>,
}

impl End {
    fn closing(reason: &'static str, code: u16, why: &'static str) -> Self {
        Self {
            reason,
            close: Close::Send(code, why),
            abandoned_seq: None,
        }
    }

    /// The client ended it (closed, broke the protocol, or went away).
    fn by_client(close: Close) -> Self {
        let reason = match close {
            Close::Gone | Close::Answer => "disconnected",
            Close::Send(socket::CLOSE_TOO_BIG, _) => "frame too large",
            Close::Send(socket::CLOSE_POLICY, _) => "frame flood",
            Close::Send(socket::CLOSE_INVALID_DATA, _) => "invalid UTF-8",
            Close::Send(..) => "WebSocket protocol violation",
        };
        Self {
            reason,
            close,
            abandoned_seq: None,
        }
    }
}

impl From<WriteFailed> for End {
    fn from(w: WriteFailed) -> Self {
        match w {
            WriteFailed::Gone => Self {
                reason: "socket write failed",
                close: Close::Gone,
                abandoned_seq: None,
            },
            WriteFailed::Timeout => Self::closing(
                SLOW_WRITE,
                socket::CLOSE_POLICY,
                "surface not reading: write timed out",
            ),
            WriteFailed::Overflow => Self::closing(
                SLOW_BACKLOG,
                socket::CLOSE_POLICY,
                "surface not reading: outbound budget exceeded",
            ),
        }
    }
}

/// Reasons a surface is dropped as a slow consumer.
const SLOW_WRITE: &str = "write timeout";
const SLOW_BACKLOG: &str = "outbound budget exceeded";

async fn send(socket: &mut Socket, frame: &ServerFrame) -> Result<(), End> {
    Ok(socket.send_frame(frame).await?)
}

/// Sends an error frame; the connection then closes with `code`.
async fn refused(socket: &mut Socket, frame: ServerFrame, code: u16, reason: &'static str) -> End {
    // Best effort: the close follows whether or not this was written.
    let _ = socket.send_frame(&frame).await;
    End::closing(reason, code, reason)
}

/// Sends an error frame, then closes with `code` (before attach).
async fn refuse(mut socket: Socket, frame: ServerFrame, code: u16, reason: &'static str) {
    let end = refused(&mut socket, frame, code, reason).await;
    socket.finish(end.close).await;
}

fn protocol_error(detail: String) -> ServerFrame {
    ServerFrame::ProtocolError { detail }
}

/// The connection task. A plain function returning an `async move` block rather than an `async fn`:
/// an async fn keeps its arguments twice in its state (once as captured, once as locals), and this
/// state lives as long as the surface stays attached.
#[allow(clippy::manual_async_fn)] // deliberate: see above
fn run(gw: Gateway, path_id: String, mut socket: Socket) -> impl Future<Output = ()> + Send {
    async move {
        gw.metrics().ws_connections.inc();
        let timeout = gw.config().attach_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let first = match tokio::time::timeout_at(deadline, socket.recv()).await {
            Err(_) => {
                let detail = format!("Expected ATTACH_SESSION within {} s", timeout.as_secs_f64());
                return refuse(
                    socket,
                    protocol_error(detail),
                    CLOSE_PROTOCOL_ERROR,
                    "attach timeout",
                )
                .await;
            }
            Ok(Incoming::Ended(close)) => {
                count_flood(&gw, close);
                socket.finish(close).await;
                return;
            }
            Ok(Incoming::Binary) => {
                let detail =
                    "Expected ATTACH_SESSION as first frame, got a binary frame".to_owned();
                return refuse(
                    socket,
                    protocol_error(detail),
                    CLOSE_PROTOCOL_ERROR,
                    "protocol error",
                )
                .await;
            }
            Ok(Incoming::Text(t)) => t,
        };
        let attach = match parse(&socket, first.as_str()) {
            Ok(ClientFrame::Attach(a)) => a,
            Ok(other) => {
                let detail = format!(
                    "Expected ATTACH_SESSION as first frame, got '{}'",
                    other.type_name()
                );
                return refuse(
                    socket,
                    protocol_error(detail),
                    CLOSE_PROTOCOL_ERROR,
                    "protocol error",
                )
                .await;
            }
            Err(e) => {
                return refuse(
                    socket,
                    protocol_error(e.to_string()),
                    CLOSE_PROTOCOL_ERROR,
                    "protocol error",
                )
                .await;
            }
        };
        drop(first);
        // Rarely-awaited, large futures are boxed: each connection task holds its state machine for
        // as long as the surface stays attached, so only the small idle loop should live inline.
        let attached = match Box::pin(gw.surfaces().attach(&path_id, attach, deadline)).await {
            Ok(a) => a,
            Err(e) => {
                let (frame, code, reason) = match e {
                    AttachError::NotFound(d) => (
                        ServerFrame::SessionNotFound {
                            detail: d,
                            session_id: Some(path_id.clone()),
                        },
                        CLOSE_NOT_FOUND,
                        "session not found",
                    ),
                    AttachError::Forbidden(d) => (
                        ServerFrame::Forbidden { detail: d },
                        CLOSE_FORBIDDEN,
                        "forbidden",
                    ),
                    AttachError::Protocol(d) => {
                        (protocol_error(d), CLOSE_PROTOCOL_ERROR, "protocol error")
                    }
                    AttachError::TryAgain(d) => {
                        // The reason names peers: logged, not sent to the surface.
                        tracing::info!(reason = %d, "attach to try again later");
                        (
                            protocol_error(
                                "this session is held by another gateway that cannot hand it over now; try again"
                                    .into(),
                            ),
                            CLOSE_TRY_AGAIN,
                            "try again later",
                        )
                    }
                    AttachError::Internal(d) => {
                        tracing::error!(error = %d, "attach failed");
                        (
                            protocol_error("internal error during attach".into()),
                            CLOSE_INTERNAL,
                            "internal error",
                        )
                    }
                };
                return refuse(socket, frame, code, reason).await;
            }
        };
        let mut delivery = attached.delivery;
        let mut inbox = attached.inbox;
        socket.watch(inbox.backlog.clone());
        let end = match send_all(&gw, &mut socket, &delivery, attached.frames).await {
            Ok(()) => {
                let Err(end) = Box::pin(connection_loop(
                    &gw,
                    &mut socket,
                    &mut delivery,
                    &mut inbox,
                    attached.ctp,
                ))
                .await;
                end
            }
            Err(end) => end,
        };
        count_flood(&gw, end.close);
        let slow = matches!(end.reason, SLOW_WRITE | SLOW_BACKLOG);
        // Displaced while a write to it stalled: it must hear 4409, not "reconnect" (1008).
        let end = if slow && !gw.surfaces().is_current(&delivery) {
            End {
                abandoned_seq: end.abandoned_seq,
                ..displaced()
            }
        } else {
            end
        };
        if slow {
            gw.metrics().ws_slow_consumers.inc();
            tracing::warn!(session_id = %delivery.session_id, conn_id = delivery.conn_id, reason = end.reason, queued_bytes = inbox.backlog.queued(), "dropping a surface that does not read");
        }
        // Detached before the closing handshake, which may take a while: from now on turns go to
        // the tether, whatever the socket does.
        if end.reason != DETACHED {
            Box::pin(gw.surfaces().detach(&delivery, end.reason)).await;
        }
        drop(inbox);
        if socket.finish(end.close).await
            && let Some(seq) = end.abandoned_seq
        {
            Box::pin(gw.surfaces().sent(&delivery, &[seq])).await;
        }
    }
}

/// Counts a connection closed for sending frames too fast.
fn count_flood(gw: &Gateway, close: Close) {
    if close == Close::Send(socket::CLOSE_POLICY, socket::FLOOD) {
        gw.metrics().ws_frame_floods.inc();
    }
}

/// The reason a connection ended with the surface's DETACH (already detached when returned).
const DETACHED: &str = "DETACH";

/// Writes frames in order; after each frame that carries a tether seq, reports it sent.
async fn send_all(
    gw: &Gateway,
    socket: &mut Socket,
    d: &Delivery,
    frames: Vec<Frame>,
) -> Result<(), End> {
    let mut sent = Vec::new();
    let mut result = Ok(());
    for (frame, seq) in frames {
        if let Err(mut end) = send(socket, &frame).await {
            if socket.abandoned() {
                end.abandoned_seq = seq;
            }
            result = Err(end);
            break;
        }
        sent.extend(seq);
    }
    if !sent.is_empty() {
        Box::pin(gw.surfaces().sent(d, &sent)).await;
    }
    result
}

/// A repeated ATTACH_SESSION on this connection. A rewrite in progress goes out first: its turn
/// precedes what the re-attach drains. `Err` is why the connection ends.
async fn reattach(
    gw: &Gateway,
    socket: &mut Socket,
    d: &mut Delivery,
    ctp: &mut Option<CtpFrames>,
    frame: sbp_protocol::frames::AttachSession,
) -> Result<(), End> {
    if let Some(mut rx) = ctp.take() {
        while let Some(f) = rx.recv().await {
            send_all(gw, socket, d, vec![f]).await?;
        }
    }
    match gw.surfaces().reattach(d, frame).await {
        Ok(frames) => send_all(gw, socket, d, frames).await,
        Err(AttachError::Forbidden(detail)) => Err(refused(
            socket,
            ServerFrame::Forbidden { detail },
            CLOSE_FORBIDDEN,
            "forbidden re-attach",
        )
        .await),
        Err(
            AttachError::NotFound(detail)
            | AttachError::Protocol(detail)
            | AttachError::Internal(detail)
            | AttachError::TryAgain(detail),
        ) => Err(refused(
            socket,
            protocol_error(detail),
            CLOSE_PROTOCOL_ERROR,
            "bad re-attach",
        )
        .await),
    }
}

/// The next frame of a running CTP rewrite (`None` when it ended).
async fn next_ctp(ctp: &mut Option<CtpFrames>) -> Option<Frame> {
    match ctp {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

fn displaced() -> End {
    End::closing(
        "displaced",
        CLOSE_DISPLACED,
        "another surface attached to this session",
    )
}

/// Runs until the connection ends; returns why.
async fn connection_loop(
    gw: &Gateway,
    socket: &mut Socket,
    d: &mut Delivery,
    inbox: &mut Inbox,
    mut ctp: Option<CtpFrames>,
) -> Result<Infallible, End> {
    let cfg = gw.config();
    let shutdown = gw.shutdown_token();
    let mut ping = tokio::time::interval_at(Instant::now() + cfg.ping_interval, cfg.ping_interval);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut pong_deadline: Option<Instant> = None;
    let far = Duration::from_secs(86_400 * 365);
    loop {
        let deadline = pong_deadline.unwrap_or_else(|| Instant::now() + far);
        tokio::select! {
            _ = shutdown.cancelled() => {
                return Err(End::closing("gateway shutdown", CLOSE_GOING_AWAY, "gateway shutting down"));
            }
            // Turn traffic went over the budget while this task was busy elsewhere.
            () = inbox.backlog.overflowed() => return Err(WriteFailed::Overflow.into()),
            incoming = socket.recv() => match incoming {
                Incoming::Ended(close) => return Err(End::by_client(close)),
                Incoming::Binary => {
                    return Err(Box::pin(refused(socket, protocol_error("binary frames are not supported".into()), CLOSE_PROTOCOL_ERROR, "protocol error")).await);
                }
                Incoming::Text(text) => match parse(socket, text.as_str()) {
                    Err(e) => {
                        return Err(Box::pin(refused(socket, protocol_error(e.to_string()), CLOSE_PROTOCOL_ERROR, "protocol error")).await);
                    }
                    Ok(ClientFrame::Detach) => {
                        // Suspended before the close frame acknowledges the DETACH: a client that
                        // saw its close complete then reads the session suspended.
                        Box::pin(gw.surfaces().detach(d, DETACHED)).await;
                        return Err(End::closing(DETACHED, CLOSE_NORMAL, "detached"));
                    }
                    Ok(ClientFrame::Pong) => pong_deadline = None,
                    Ok(ClientFrame::Ack { seq }) => Box::pin(gw.surfaces().ack(d, seq)).await,
                    Ok(ClientFrame::ToolResult(r)) => gw.tools().result(d.session_id, d.conn_id, r),
                    Ok(ClientFrame::Attach(a)) => Box::pin(reattach(gw, socket, d, &mut ctp, a)).await?,
                    Ok(ClientFrame::Unknown { frame_type }) => {
                        tracing::debug!(session_id = %d.session_id, frame_type, "unknown frame type ignored");
                    }
                },
            },
            // While a CTP rewrite streams, the inbox waits: later turns must not overtake it.
            () = inbox.calls.ready() => {
                while let Some(call) = inbox.calls.pop() {
                    send(socket, &ServerFrame::ToolCall(*call)).await?;
                }
            }
            msg = inbox.msgs.recv(), if ctp.is_none() => {
                // Off the queue: the budget bounds what waits, the write timeout what is written.
                inbox.backlog.release(msg.as_ref().map_or(0, ConnMsg::weight));
                let frames = match msg {
                    None | Some(ConnMsg::Displaced) => return Err(displaced()),
                    Some(ConnMsg::Deleted) => {
                        return Err(End::closing("session deleted", CLOSE_NOT_FOUND, "session deleted"));
                    }
                    Some(ConnMsg::Chunk(c)) => {
                        gw.surfaces().live_chunk(d, &c).into_iter().collect()
                    }
                    Some(ConnMsg::TurnDone(done)) => {
                        let turn = Box::pin(gw.surfaces().turn_done(d, *done)).await;
                        ctp = turn.ctp;
                        turn.frames
                    }
                };
                Box::pin(send_all(gw, socket, d, frames)).await?;
            }
            item = next_ctp(&mut ctp), if ctp.is_some() => match item {
                // The inbox (and its Displaced) waits while a rewrite streams: check directly.
                Some(_) if !gw.surfaces().is_current(d) => return Err(displaced()),
                Some(frame) => Box::pin(send_all(gw, socket, d, vec![frame])).await?,
                None => ctp = None,
            },
            _ = ping.tick() => {
                if pong_deadline.is_none() {
                    send(socket, &ServerFrame::Ping).await?;
                    pong_deadline = Some(Instant::now() + cfg.pong_timeout);
                }
                if ctp.is_some() {
                    continue;
                }
                let missed = Box::pin(gw.surfaces().catch_up(d)).await;
                Box::pin(send_all(gw, socket, d, missed)).await?;
            }
            _ = tokio::time::sleep_until(deadline) => {
                return Err(End::closing("pong timeout", CLOSE_GOING_AWAY, "no PONG received in time"));
            }
        }
    }
}
