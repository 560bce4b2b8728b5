//! Test harness: the shared in-process gateway ([`TestGateway`]: the same `Gateway::start` +
//! `serve` the binary runs, on 127.0.0.1:0 over a SQLite file in a temp dir, optionally the real
//! fake upstream), an SDK client for it, and helpers that read a surface's events with a deadline.

#![allow(dead_code)]

use sbp_client::types::SessionInfo;
use sbp_client::{Client, Event, SessionClient, Surface};
use sbp_protocol::ServerFrame;
use sbp_protocol::frames::{TetherTurn, TurnComplete};
use sbp_test_support::wait_until;

pub use sbp_test_support::{Options, TestGateway, WAIT, config};

/// What these tests do on a [`TestGateway`]: the SDK's client, metrics, sessions.
pub trait TestGatewayExt {
    /// An SDK client for this gateway (no proxy: it is on loopback).
    fn client(&self) -> Client;

    /// A counter or gauge of `GET /metrics` (0 when absent).
    async fn metric(&self, name: &str) -> u64;

    /// Polls a metric until it reaches `at_least`.
    async fn wait_metric(&self, name: &str, at_least: u64) {
        let what = format!("{name} >= {at_least}");
        wait_until(WAIT, &what, || self.metric(name), |v| *v >= at_least).await;
    }

    /// A new idle session.
    async fn session(&self) -> SessionClient {
        self.client()
            .create_session(Default::default())
            .await
            .expect("session created")
    }
}

impl TestGatewayExt for TestGateway {
    fn client(&self) -> Client {
        Client::builder(&self.url)
            .no_proxy()
            .timeout(WAIT)
            .build()
            .expect("client")
    }

    async fn metric(&self, name: &str) -> u64 {
        let text = self
            .http
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// The next event, skipping PINGs (the SDK has answered them).
pub async fn next(s: &mut Surface) -> Event {
    loop {
        let ev = tokio::time::timeout(WAIT, s.next_event())
            .await
            .expect("an event within the wait")
            .expect("the surface is still running");
        if !matches!(ev, Event::Frame(ServerFrame::Ping)) {
            return ev;
        }
    }
}

/// The next frame event; panics on a state event.
pub async fn frame(s: &mut Surface) -> ServerFrame {
    match next(s).await {
        Event::Frame(f) => f,
        other => panic!("expected a frame, got {other:?}"),
    }
}

pub async fn tether_turn(s: &mut Surface) -> TetherTurn {
    match frame(s).await {
        ServerFrame::TetherTurn(t) => t,
        other => panic!("expected TETHER_TURN, got {other:?}"),
    }
}

/// One live turn: its TURN_CHUNKs' text and the TURN_COMPLETE.
pub async fn live_turn(s: &mut Surface) -> (String, TurnComplete) {
    let mut text = String::new();
    loop {
        match frame(s).await {
            ServerFrame::TurnChunk(c) => text.push_str(&c.delta),
            ServerFrame::TurnComplete(c) => return (text, c),
            other => panic!("unexpected frame in a live turn: {other:?}"),
        }
    }
}

/// Asserts the surface has ended: no further event.
pub async fn ended(s: &mut Surface) {
    let ev = tokio::time::timeout(WAIT, s.next_event())
        .await
        .expect("the surface ends within the wait");
    assert!(ev.is_none(), "expected the end, got {ev:?}");
}

/// Polls the session until `done` holds (e.g. the gateway has processed a close or an ACK).
pub async fn wait_session(
    session: &SessionClient,
    what: &str,
    done: impl Fn(&SessionInfo) -> bool,
) -> SessionInfo {
    let fetch = || async { session.get().await.expect("session view") };
    wait_until(WAIT, what, fetch, done).await
}
