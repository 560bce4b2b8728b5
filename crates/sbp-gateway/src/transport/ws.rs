//! The WebSocket endpoint `/v1/sbp/ws/{session_id}`: the ATTACH_SESSION handshake with the close
//! codes of the frame reference, then one loop per connection that forwards engine messages (live
//! chunks, completed turns, displacement) to the socket, answers client frames, pings, and detaches.

use std::time::Duration;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::response::Response;
use sbp_protocol::frames::{
    CLOSE_FORBIDDEN, CLOSE_GOING_AWAY, CLOSE_NORMAL, CLOSE_NOT_FOUND, CLOSE_PROTOCOL_ERROR,
    CLOSE_TOO_BIG,
};
use sbp_protocol::{ClientFrame, ServerFrame};
use tokio::time::Instant;

use crate::Gateway;
use crate::engine::connections::{ConnMsg, Inbox};
use crate::engine::surfaces::{AttachError, CtpFrames, Delivery, Frame};

/// Close code sent to a connection displaced by a newer ATTACH_SESSION (docs/PROTOCOL-EXTENSIONS.md).
pub use sbp_protocol::frames::CLOSE_DISPLACED;
/// Read and write buffer size of a WebSocket connection.
const WS_BUFFER: usize = 1024;
/// Close code for an internal failure during attach.
const CLOSE_INTERNAL: u16 = 1011;

pub async fn upgrade(
    State(gw): State<Gateway>,
    Path(id): Path<String>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let ws = match ws {
        Ok(ws) => ws,
        Err(rejection) => return super::errors::not_a_websocket(rejection),
    };
    let max = gw.config().max_frame_bytes;
    // Small buffers: tungstenite's 128 KiB defaults would cost ~256 KiB per idle surface. Writes
    // are flushed frame by frame anyway; the cap gives backpressure against a surface that stops
    // reading.
    ws.max_message_size(max)
        .max_frame_size(max)
        .read_buffer_size(WS_BUFFER)
        .write_buffer_size(WS_BUFFER)
        .max_write_buffer_size(max.saturating_mul(4).max(WS_BUFFER * 2))
        .on_upgrade(move |socket| {
            let tracked = gw.clone();
            tracked.track(run(gw, id, socket))
        })
}

enum Incoming {
    Text(String),
    /// Binary frames are not part of the protocol.
    Binary,
    /// The client closed or the connection dropped.
    Closed,
    /// The frame exceeded the size limit.
    TooBig,
}

async fn next_frame(socket: &mut WebSocket) -> Incoming {
    loop {
        match socket.recv().await {
            None => return Incoming::Closed,
            Some(Err(e)) => {
                let too_big = e
                    .into_inner()
                    .downcast_ref::<tungstenite::Error>()
                    .is_some_and(|e| {
                        matches!(
                            e,
                            tungstenite::Error::Capacity(_)
                                | tungstenite::Error::Protocol(
                                    tungstenite::error::ProtocolError::ControlFrameTooBig
                                )
                        )
                    });
                return if too_big {
                    Incoming::TooBig
                } else {
                    Incoming::Closed
                };
            }
            Some(Ok(Message::Text(t))) => return Incoming::Text(t.as_str().to_owned()),
            Some(Ok(Message::Binary(_))) => return Incoming::Binary,
            Some(Ok(Message::Close(_))) => return Incoming::Closed,
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
        }
    }
}

async fn send(socket: &mut WebSocket, frame: &ServerFrame) -> bool {
    socket
        .send(Message::Text(frame.to_json().into()))
        .await
        .is_ok()
}

async fn close(socket: &mut WebSocket, code: u16, reason: &str) {
    let _ = socket
        .send(Message::Close(Some(CloseFrame {
            code,
            reason: reason.to_owned().into(),
        })))
        .await;
}

/// Sends an error frame, then closes with `code`.
async fn refuse(socket: &mut WebSocket, frame: ServerFrame, code: u16, reason: &str) {
    send(socket, &frame).await;
    close(socket, code, reason).await;
}

fn protocol_error(detail: String) -> ServerFrame {
    ServerFrame::ProtocolError { detail }
}

/// The connection task. A plain function returning an `async move` block rather than an `async fn`:
/// an async fn keeps its arguments twice in its state (once as captured, once as locals), and this
/// state lives as long as the surface stays attached.
#[allow(clippy::manual_async_fn)] // deliberate: see above
fn run(gw: Gateway, path_id: String, mut socket: WebSocket) -> impl Future<Output = ()> + Send {
    async move {
        gw.metrics()
            .ws_connections
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let timeout = gw.config().attach_timeout;
        let first = match tokio::time::timeout(timeout, next_frame(&mut socket)).await {
            Err(_) => {
                let detail = format!("Expected ATTACH_SESSION within {} s", timeout.as_secs_f64());
                return refuse(
                    &mut socket,
                    protocol_error(detail),
                    CLOSE_PROTOCOL_ERROR,
                    "attach timeout",
                )
                .await;
            }
            Ok(Incoming::Closed) => return,
            Ok(Incoming::TooBig) => {
                return close(&mut socket, CLOSE_TOO_BIG, "frame too large").await;
            }
            Ok(Incoming::Binary) => {
                let detail =
                    "Expected ATTACH_SESSION as first frame, got a binary frame".to_owned();
                return refuse(
                    &mut socket,
                    protocol_error(detail),
                    CLOSE_PROTOCOL_ERROR,
                    "protocol error",
                )
                .await;
            }
            Ok(Incoming::Text(t)) => t,
        };
        let attach = match ClientFrame::parse(&first) {
            Ok(ClientFrame::Attach(a)) => a,
            Ok(other) => {
                let detail = format!(
                    "Expected ATTACH_SESSION as first frame, got '{}'",
                    other.type_name()
                );
                return refuse(
                    &mut socket,
                    protocol_error(detail),
                    CLOSE_PROTOCOL_ERROR,
                    "protocol error",
                )
                .await;
            }
            Err(e) => {
                return refuse(
                    &mut socket,
                    protocol_error(e.to_string()),
                    CLOSE_PROTOCOL_ERROR,
                    "protocol error",
                )
                .await;
            }
        };
        // Rarely-awaited, large futures are boxed: each connection task holds its state machine for
        // as long as the surface stays attached, so only the small idle loop should live inline.
        let attached = match Box::pin(gw.surfaces().attach(&path_id, attach)).await {
            Ok(a) => a,
            Err(e) => {
                let (frame, code, reason) = match e {
                    AttachError::NotFound(d) => (
                        ServerFrame::SessionNotFound { detail: d },
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
                    AttachError::Internal(d) => {
                        tracing::error!(error = %d, "attach failed");
                        (
                            protocol_error("internal error during attach".into()),
                            CLOSE_INTERNAL,
                            "internal error",
                        )
                    }
                };
                return refuse(&mut socket, frame, code, reason).await;
            }
        };
        let mut delivery = attached.delivery;
        let mut inbox = attached.inbox;
        let reason = if send_all(&gw, &mut socket, &delivery, attached.frames).await {
            connection_loop(&gw, &mut socket, &mut delivery, &mut inbox, attached.ctp).await
        } else {
            "socket write failed"
        };
        if reason != DETACHED {
            Box::pin(gw.surfaces().detach(&delivery, reason)).await;
        }
    }
}

/// The reason a connection ended with the surface's DETACH (already detached when returned).
const DETACHED: &str = "DETACH";

/// Writes frames in order; after each frame that carries a tether seq, reports it sent.
async fn send_all(gw: &Gateway, socket: &mut WebSocket, d: &Delivery, frames: Vec<Frame>) -> bool {
    let mut sent = Vec::new();
    let mut ok = true;
    for (frame, seq) in frames {
        if !send(socket, &frame).await {
            ok = false;
            break;
        }
        sent.extend(seq);
    }
    if !sent.is_empty() {
        Box::pin(gw.surfaces().sent(d, &sent)).await;
    }
    ok
}

/// A repeated ATTACH_SESSION on this connection. A rewrite in progress goes out first: its turn
/// precedes what the re-attach drains. `Err` is why the connection ends.
async fn reattach(
    gw: &Gateway,
    socket: &mut WebSocket,
    d: &mut Delivery,
    ctp: &mut Option<CtpFrames>,
    frame: sbp_protocol::frames::AttachSession,
) -> Result<(), &'static str> {
    if let Some(mut rx) = ctp.take() {
        while let Some(f) = rx.recv().await {
            if !send_all(gw, socket, d, vec![f]).await {
                return Err("socket write failed");
            }
        }
    }
    match gw.surfaces().reattach(d, frame).await {
        Ok(frames) => {
            if send_all(gw, socket, d, frames).await {
                Ok(())
            } else {
                Err("socket write failed")
            }
        }
        Err(AttachError::Forbidden(detail)) => {
            refuse(
                socket,
                ServerFrame::Forbidden { detail },
                CLOSE_FORBIDDEN,
                "forbidden",
            )
            .await;
            Err("forbidden re-attach")
        }
        Err(
            AttachError::NotFound(detail)
            | AttachError::Protocol(detail)
            | AttachError::Internal(detail),
        ) => {
            refuse(
                socket,
                protocol_error(detail),
                CLOSE_PROTOCOL_ERROR,
                "protocol error",
            )
            .await;
            Err("bad re-attach")
        }
    }
}

/// The next frame of a running CTP rewrite (`None` when it ended).
async fn next_ctp(ctp: &mut Option<CtpFrames>) -> Option<Frame> {
    match ctp {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Runs until the connection ends; returns why.
async fn connection_loop(
    gw: &Gateway,
    socket: &mut WebSocket,
    d: &mut Delivery,
    inbox: &mut Inbox,
    mut ctp: Option<CtpFrames>,
) -> &'static str {
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
                close(socket, CLOSE_GOING_AWAY, "gateway shutting down").await;
                return "gateway shutdown";
            }
            incoming = next_frame(socket) => match incoming {
                Incoming::Closed => return "disconnected",
                Incoming::TooBig => {
                    close(socket, CLOSE_TOO_BIG, "frame too large").await;
                    return "frame too large";
                }
                Incoming::Binary => {
                    Box::pin(refuse(socket, protocol_error("binary frames are not supported".into()), CLOSE_PROTOCOL_ERROR, "protocol error")).await;
                    return "protocol error";
                }
                Incoming::Text(text) => match ClientFrame::parse(&text) {
                    Err(e) => {
                        Box::pin(refuse(socket, protocol_error(e.to_string()), CLOSE_PROTOCOL_ERROR, "protocol error")).await;
                        return "protocol error";
                    }
                    Ok(ClientFrame::Detach) => {
                        // Suspended before the close frame acknowledges the DETACH: a client that
                        // saw its close complete then reads the session suspended.
                        Box::pin(gw.surfaces().detach(d, DETACHED)).await;
                        close(socket, CLOSE_NORMAL, "detached").await;
                        return DETACHED;
                    }
                    Ok(ClientFrame::Pong) => pong_deadline = None,
                    Ok(ClientFrame::Ack { seq }) => Box::pin(gw.surfaces().ack(d, seq)).await,
                    Ok(ClientFrame::ToolResult(r)) => gw.tools().result(d.session_id, d.conn_id, r),
                    Ok(ClientFrame::Attach(a)) => {
                        if let Err(reason) = Box::pin(reattach(gw, socket, d, &mut ctp, a)).await {
                            return reason;
                        }
                    }
                    Ok(ClientFrame::Unknown { frame_type }) => {
                        tracing::debug!(session_id = %d.session_id, frame_type, "unknown frame type ignored");
                    }
                },
            },
            // While a CTP rewrite streams, the inbox waits: later turns must not overtake it.
            () = inbox.calls.ready() => {
                while let Some(call) = inbox.calls.pop() {
                    if !send(socket, &ServerFrame::ToolCall(*call)).await {
                        return "socket write failed";
                    }
                }
            }
            msg = inbox.msgs.recv(), if ctp.is_none() => {
                let frames = match msg {
                    None | Some(ConnMsg::Displaced) => {
                        close(socket, CLOSE_DISPLACED, "another surface attached to this session").await;
                        return "displaced";
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
                if !Box::pin(send_all(gw, socket, d, frames)).await {
                    return "socket write failed";
                }
            }
            item = next_ctp(&mut ctp), if ctp.is_some() => match item {
                // The inbox (and its Displaced) waits while a rewrite streams: check directly.
                Some(_) if !gw.surfaces().is_current(d) => {
                    close(socket, CLOSE_DISPLACED, "another surface attached to this session").await;
                    return "displaced";
                }
                Some(frame) => {
                    if !Box::pin(send_all(gw, socket, d, vec![frame])).await {
                        return "socket write failed";
                    }
                }
                None => ctp = None,
            },
            _ = ping.tick() => {
                if pong_deadline.is_none() {
                    if !send(socket, &ServerFrame::Ping).await {
                        return "socket write failed";
                    }
                    pong_deadline = Some(Instant::now() + cfg.pong_timeout);
                }
                if ctp.is_some() {
                    continue;
                }
                let missed = Box::pin(gw.surfaces().catch_up(d)).await;
                if !Box::pin(send_all(gw, socket, d, missed)).await {
                    return "socket write failed";
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                close(socket, CLOSE_GOING_AWAY, "no PONG received in time").await;
                return "pong timeout";
            }
        }
    }
}
