//! A surface's WebSocket for tests, over tokio-tungstenite: JSON frames out, frames or the close in,
//! every read bounded by [`WAIT`]; PINGs answered with PONG or shown, as the test asks.

use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::WAIT;

pub struct Ws {
    /// For what the helpers do not send (binary frames, raw text).
    pub stream: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

/// What the socket delivered next.
#[derive(Debug)]
pub enum WsEvent {
    Frame(Value),
    /// A close frame with its code, or `None` when the connection ended without one (the gateway
    /// died, or the TCP connection was reset).
    Closed(Option<u16>),
}

impl Ws {
    /// Opens the WebSocket at `url`.
    pub async fn connect(url: &str) -> Ws {
        let (stream, _) = tokio::time::timeout(WAIT, tokio_tungstenite::connect_async(url))
            .await
            .expect("ws connect within the wait")
            .expect("ws connect");
        Ws { stream }
    }

    /// Opens session `id`'s socket on the gateway at `ws_base` (`ws://HOST:PORT`) without sending
    /// anything.
    pub async fn open(ws_base: &str, id: &str) -> Ws {
        Self::connect(&format!("{ws_base}/v1/sbp/ws/{id}")).await
    }

    /// Opens session `id`'s socket and sends ATTACH_SESSION with `extra`'s fields added (e.g.
    /// `surface_context`); returns the socket and the SESSION_ATTACHED frame.
    pub async fn attach(ws_base: &str, id: &str, token: &str, extra: Value) -> (Ws, Value) {
        let mut ws = Self::open(ws_base, id).await;
        let mut frame = json!({"type": "ATTACH_SESSION", "session_id": id, "session_token": token});
        if let (Some(f), Some(e)) = (frame.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                f.insert(k.clone(), v.clone());
            }
        }
        ws.send(frame).await;
        let attached = ws.recv().await;
        assert_eq!(attached["type"], "SESSION_ATTACHED", "{attached}");
        (ws, attached)
    }

    pub async fn send(&mut self, v: Value) {
        self.send_text(&v.to_string()).await;
    }

    pub async fn send_text(&mut self, t: &str) {
        self.stream
            .send(Message::Text(t.to_owned().into()))
            .await
            .expect("ws send");
    }

    /// The next JSON frame, PINGs included, or the end of the connection; `None` if nothing came
    /// by `deadline`.
    async fn next_raw_by(&mut self, deadline: Instant) -> Option<WsEvent> {
        loop {
            let msg = tokio::time::timeout_at(deadline, self.stream.next())
                .await
                .ok()?;
            match msg {
                Some(Ok(Message::Text(t))) => {
                    let v = serde_json::from_str(t.as_str()).expect("server sends JSON");
                    return Some(WsEvent::Frame(v));
                }
                Some(Ok(Message::Close(f))) => {
                    return Some(WsEvent::Closed(f.map(|f| u16::from(f.code))));
                }
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return Some(WsEvent::Closed(None)),
            }
        }
    }

    /// The next JSON frame, PINGs included (not answered), or the end of the connection: for
    /// tests of the keepalive itself.
    pub async fn next_raw(&mut self) -> WsEvent {
        self.next_raw_by(Instant::now() + WAIT)
            .await
            .expect("ws frame or close within the wait")
    }

    /// The next JSON frame or the end of the connection, answering PINGs on the way.
    pub async fn next_event(&mut self) -> WsEvent {
        self.next_event_within(WAIT)
            .await
            .expect("ws frame or close within the wait")
    }

    /// [`Ws::next_event`], or `None` if nothing came within `within`.
    pub async fn next_event_within(&mut self, within: Duration) -> Option<WsEvent> {
        let deadline = Instant::now() + within;
        loop {
            match self.next_raw_by(deadline).await? {
                WsEvent::Frame(v) if v["type"] == "PING" => {
                    self.send(json!({"type": "PONG"})).await
                }
                event => return Some(event),
            }
        }
    }

    /// The next JSON frame, answering PINGs on the way.
    pub async fn recv(&mut self) -> Value {
        match self.next_event().await {
            WsEvent::Frame(v) => v,
            WsEvent::Closed(code) => {
                panic!("socket closed ({code:?}) while a frame was expected")
            }
        }
    }

    /// Expects the connection to end next (no frame before; PINGs answered); returns the close
    /// code, if any.
    pub async fn closed(&mut self) -> Option<u16> {
        match self.next_event().await {
            WsEvent::Closed(code) => code,
            WsEvent::Frame(f) => panic!("a frame ({f}) where the socket was expected to close"),
        }
    }

    /// Expects a close with `code` next; PINGs before it are passed over, not answered.
    pub async fn expect_close(&mut self, code: u16) {
        loop {
            match self.next_raw().await {
                WsEvent::Closed(c) => {
                    assert_eq!(c, Some(code));
                    return;
                }
                WsEvent::Frame(v) if v["type"] == "PING" => continue,
                WsEvent::Frame(v) => panic!("expected close {code}, got frame {v}"),
            }
        }
    }

    /// Asserts the next frame has this type, then that the socket closes with `code`.
    pub async fn expect_error_close(&mut self, frame_type: &str, code: u16) -> Value {
        let frame = match self.next_raw().await {
            WsEvent::Frame(v) => v,
            WsEvent::Closed(c) => panic!("closed ({c:?}) before the {frame_type} frame"),
        };
        assert_eq!(frame["type"], frame_type, "{frame}");
        self.expect_close(code).await;
        frame
    }

    /// Reads the frames of one live turn: TURN_CHUNKs then TURN_COMPLETE; returns (text, complete
    /// frame).
    pub async fn live_turn(&mut self) -> (String, Value) {
        let mut text = String::new();
        loop {
            let f = self.recv().await;
            match f["type"].as_str() {
                Some("TURN_CHUNK") => text.push_str(f["delta"].as_str().expect("delta")),
                Some("TURN_COMPLETE") => return (text, f),
                _ => panic!("unexpected frame in a live turn: {f}"),
            }
        }
    }

    /// Closes with the close handshake.
    pub async fn close(mut self) {
        let _ = self.stream.close(None).await;
    }

    /// Sends a close frame with `code` (and does not wait for the answer).
    pub async fn close_code(&mut self, code: u16) {
        let _ = self
            .stream
            .send(Message::Close(Some(CloseFrame {
                code: CloseCode::from(code),
                reason: "".into(),
            })))
            .await;
    }

    /// Drops the connection without a close frame.
    pub async fn close_abruptly(self) {
        drop(self.stream);
    }
}
