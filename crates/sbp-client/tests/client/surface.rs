//! Attach, drain, live streaming, PING/PONG, ACK/DETACH and refusals, against the real gateway.

use std::time::Duration;

use sbp_client::types::{Delivery, PushTurn};
use sbp_client::{DisconnectKind, Error, Event, ReconnectPolicy, Surface, SurfaceConfig};
use sbp_gateway::GatewayConfig;
use sbp_protocol::{ServerFrame, SessionStatus, SurfaceContext};

use crate::support::{
    Options, TestGateway, TestGatewayExt, config, ended, live_turn, next, tether_turn, wait_session,
};

#[tokio::test]
async fn attach_drains_tethered_turns_then_streams_live_turns() {
    let gw = TestGateway::start().await;
    let session = gw.session().await;
    let first = session
        .push_turn(PushTurn::assistant("Your flight prices dropped."))
        .await
        .expect("push");
    let second = session
        .push_turn(PushTurn::assistant("The hotel confirmed."))
        .await
        .expect("push");
    assert_eq!(first.delivery, Delivery::Tethered);
    assert!(second.seq > first.seq);

    let ctx = SurfaceContext {
        device_type: Some("desktop".into()),
        locale: Some("en-GB".into()),
        ..SurfaceContext::default()
    };
    let mut surface = Surface::connect(session.surface().context(ctx))
        .await
        .expect("attached");
    assert_eq!(surface.attached().queued_turns, 2);
    assert_eq!(surface.attached().device_type, "desktop");
    match next(&mut surface).await {
        Event::Connected {
            attached,
            reconnected,
        } => {
            assert!(!reconnected);
            assert_eq!(attached.session_id, session.id());
            assert!(
                attached.extensions.iter().any(|e| e == "ack"),
                "{attached:?}"
            );
        }
        other => panic!("expected Connected first, got {other:?}"),
    }
    let drained = [
        tether_turn(&mut surface).await,
        tether_turn(&mut surface).await,
    ];
    assert_eq!(
        drained
            .iter()
            .map(|t| (t.seq, t.content.as_deref().unwrap_or_default()))
            .collect::<Vec<_>>(),
        [
            (first.seq, "Your flight prices dropped."),
            (second.seq, "The hotel confirmed."),
        ]
    );
    assert_eq!(surface.last_seq(), second.seq);

    // A completion over HTTP streams to the attached surface over the WebSocket.
    let reply = session.send_message("Plan day 2").await.expect("reply");
    let (streamed, complete) = live_turn(&mut surface).await;
    assert_eq!(streamed, reply.text);
    assert!(!reply.text.is_empty());
    let seq = complete
        .seq
        .expect("a live turn of a tethered session has a seq");
    assert!(seq > second.seq);
    assert_eq!(surface.last_seq(), seq);

    // A pushed turn while attached is live too.
    let pushed = session
        .push_turn(PushTurn::assistant("Live news"))
        .await
        .expect("push");
    assert_eq!(pushed.delivery, Delivery::Live);
    let (text, complete) = live_turn(&mut surface).await;
    assert_eq!(
        (text.as_str(), complete.seq),
        ("Live news", Some(pushed.seq))
    );
    surface.close().await;
}

#[tokio::test]
async fn pings_are_answered_so_the_connection_stays() {
    let gw = TestGateway::with(Options {
        config: GatewayConfig {
            ping_interval: Duration::from_millis(40),
            pong_timeout: Duration::from_secs(2),
            ..config()
        },
        ..Options::default()
    })
    .await;
    let session = gw.session().await;
    let mut surface = Surface::connect(session.surface()).await.expect("attached");
    assert!(matches!(
        surface.next_event().await,
        Some(Event::Connected { .. })
    ));
    // The gateway sends no further PING while one is unanswered, and closes (1001) when the pong
    // timeout passes: five PINGs on one connection mean four PONGs arrived.
    let mut pings = 0;
    while pings < 5 {
        match tokio::time::timeout(crate::support::WAIT, surface.next_event())
            .await
            .expect("event")
        {
            Some(Event::Frame(ServerFrame::Ping)) => pings += 1,
            other => panic!("expected only PINGs on an idle session, got {other:?}"),
        }
    }
    let pushed = session
        .push_turn(PushTurn::assistant("still here"))
        .await
        .expect("push");
    assert_eq!(
        pushed.delivery,
        Delivery::Live,
        "the same connection is attached"
    );
    let (text, _) = live_turn(&mut surface).await;
    assert_eq!(text, "still here");
    surface.close().await;
}

#[tokio::test]
async fn taken_turns_are_acknowledged_and_close_detaches() {
    let gw = TestGateway::start().await;
    let session = gw.session().await;
    let mut surface = Surface::connect(session.surface()).await.expect("attached");
    assert!(matches!(next(&mut surface).await, Event::Connected { .. }));
    for text in ["one", "two"] {
        session
            .push_turn(PushTurn::assistant(text))
            .await
            .expect("push");
    }
    // Both turns are live; in ack mode they stay in the tether until the SDK ACKs them, which it
    // does once the application has taken them.
    live_turn(&mut surface).await;
    let (_, complete) = live_turn(&mut surface).await;
    wait_session(&session, "the ACK of both turns", |s| {
        s.tether_turns_pending == 0
    })
    .await;

    // A turn the application never takes is not acknowledged: close() leaves it for next time.
    let unread = session
        .push_turn(PushTurn::assistant("three"))
        .await
        .expect("push");
    let seen = surface.last_seq();
    assert_eq!(Some(seen), complete.seq);
    surface.close().await;
    let info = wait_session(&session, "the DETACH", |s| {
        s.status == SessionStatus::Suspended && !s.surface_attached
    })
    .await;
    assert_eq!(info.tether_turns_pending, 1, "{info:?}");
    // The rest of the events end with the detach.
    let mut last = None;
    while let Some(ev) = surface.next_event().await {
        last = Some(ev);
    }
    match last {
        Some(Event::Disconnected(d)) => {
            assert_eq!(d.kind, DisconnectKind::Detached);
            assert_eq!(
                d.code,
                Some(1000),
                "the gateway confirms a DETACH with 1000"
            );
            assert!(!d.will_reconnect);
        }
        other => panic!("expected Detached last, got {other:?}"),
    }

    // A new surface resuming from what the application had gets exactly the unread turn.
    session
        .push_turn(PushTurn::assistant("four"))
        .await
        .expect("push");
    let mut again = Surface::connect(session.surface().resume_from(seen))
        .await
        .expect("attached");
    assert_eq!(again.attached().queued_turns, 2);
    assert!(matches!(next(&mut again).await, Event::Connected { .. }));
    let t = tether_turn(&mut again).await;
    assert_eq!((t.seq, t.content.as_deref()), (unread.seq, Some("three")));
    assert_eq!(
        tether_turn(&mut again).await.content.as_deref(),
        Some("four")
    );
    again.close().await;
}

#[tokio::test]
async fn displacement_is_surfaced_and_not_reconnected() {
    let gw = TestGateway::start().await;
    let session = gw.session().await;
    let mut phone = Surface::connect(session.surface().device_type("mobile"))
        .await
        .expect("phone attached");
    assert!(matches!(next(&mut phone).await, Event::Connected { .. }));
    let mut desktop = Surface::connect(session.surface().device_type("desktop"))
        .await
        .expect("desktop attached");
    match next(&mut phone).await {
        Event::Disconnected(d) => {
            assert_eq!(d.kind, DisconnectKind::Displaced, "{d:?}");
            assert_eq!(d.code, Some(4409));
            assert!(!d.will_reconnect, "a displaced surface must not fight back");
        }
        other => panic!("expected Displaced, got {other:?}"),
    }
    ended(&mut phone).await;

    // The session now belongs to the desktop.
    assert!(matches!(next(&mut desktop).await, Event::Connected { .. }));
    session
        .push_turn(PushTurn::assistant("for the desktop"))
        .await
        .expect("push");
    let (text, _) = live_turn(&mut desktop).await;
    assert_eq!(text, "for the desktop");
    let info = session.get().await.expect("view");
    assert_eq!(
        info.surface.and_then(|s| s.device_type).as_deref(),
        Some("desktop")
    );
    desktop.close().await;
}

#[tokio::test]
async fn refused_attaches_are_typed_errors() {
    let gw = TestGateway::start().await;
    let session = gw.session().await;
    let client = gw.client();

    let bad_token = client.session(session.id(), "not-the-token").surface();
    match Surface::connect(bad_token).await {
        Err(Error::Forbidden { detail }) => assert!(!detail.is_empty()),
        other => panic!("expected Forbidden, got {other:?}"),
    }
    let unknown = client
        .session("0190a5a4-0000-7000-8000-000000000000", session.token())
        .surface();
    assert!(
        matches!(
            Surface::connect(unknown).await,
            Err(Error::SessionNotFound { .. })
        ),
        "an unknown session id"
    );
    // A refused attach did not take the session.
    let info = session.get().await.expect("view");
    assert!(!info.surface_attached, "{info:?}");
}

#[tokio::test]
async fn without_reconnect_a_drop_ends_the_surface() {
    let gw = TestGateway::start().await;
    let session = gw.session().await;
    let mut surface = Surface::connect(session.surface().reconnect(ReconnectPolicy::disabled()))
        .await
        .expect("attached");
    assert!(matches!(next(&mut surface).await, Event::Connected { .. }));
    gw.stop().await;
    match next(&mut surface).await {
        Event::Disconnected(d) => {
            assert_eq!(d.kind, DisconnectKind::Closed, "{d:?}");
            assert_eq!(d.code, Some(1001), "the gateway says it is going away");
            assert!(!d.will_reconnect);
        }
        other => panic!("expected Disconnected, got {other:?}"),
    }
    ended(&mut surface).await;
}

/// A `https://` gateway is reached over `wss://`: the SDK speaks TLS (a ClientHello is the first
/// thing the server sees) and a failed handshake is an error, not "TLS support not compiled in".
#[tokio::test]
async fn https_gateways_are_attached_over_tls() {
    use tokio::io::AsyncReadExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        let (mut tcp, _) = listener.accept().await.expect("accept");
        let mut first = [0u8; 1];
        tcp.read_exact(&mut first).await.expect("read");
        // Not a TLS server: dropping the connection fails the handshake.
        first[0]
    });
    let config = SurfaceConfig::new(
        format!("https://{addr}"),
        "0190a5a4-0000-7000-8000-000000000000",
        "token",
    )
    .reconnect(ReconnectPolicy::disabled());
    let Err(err) = Surface::connect(config).await else {
        panic!("no TLS server here");
    };
    let first = server.await.expect("server");
    assert_eq!(first, 0x16, "a TLS handshake record opens the connection");
    assert!(
        !format!("{err}").contains("not compiled"),
        "TLS is built in: {err}"
    );
}

#[tokio::test]
async fn a_position_the_gateway_never_issued_starts_again_from_zero() {
    let gw = TestGateway::start().await;
    let session = gw.session().await;
    for text in ["one", "two"] {
        session
            .push_turn(PushTurn::assistant(text))
            .await
            .expect("push");
    }
    // A stored position from another history (say, a restored gateway database).
    let mut surface = Surface::connect(session.surface().resume_from(500))
        .await
        .expect("attached");
    assert!(surface.attached().last_seq_reset);
    assert_eq!(surface.attached().queued_turns, 2);
    assert!(matches!(next(&mut surface).await, Event::Connected { .. }));
    let first = tether_turn(&mut surface).await;
    let second = tether_turn(&mut surface).await;
    assert_eq!(
        (first.content.as_deref(), second.content.as_deref()),
        (Some("one"), Some("two"))
    );
    // The position follows this session's seqs again, and the turns taken are acknowledged.
    assert_eq!(surface.last_seq(), second.seq);
    wait_session(&session, "the ACK of both turns", |s| {
        s.tether_turns_pending == 0
    })
    .await;
    surface.close().await;
}
