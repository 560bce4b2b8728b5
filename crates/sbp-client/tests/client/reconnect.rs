//! Reconnecting: across a gateway restart on the same SQLite file (turns pushed meanwhile arrive
//! exactly once, in order), giving up after `max_attempts`, and closing while waiting.

use std::time::Duration;

use sbp_client::types::{Delivery, PushTurn};
use sbp_client::{Backoff, DisconnectKind, Event, ReconnectPolicy, Surface};
use sbp_protocol::ServerFrame;

use crate::support::{
    Options, TestGateway, TestGatewayExt, WAIT, ended, live_turn, next, tether_turn,
};

fn quick(max_attempts: Option<u32>) -> ReconnectPolicy {
    ReconnectPolicy {
        backoff: Backoff {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(200),
            ..Backoff::default()
        },
        max_attempts,
        ..ReconnectPolicy::default()
    }
}

/// The restarted gateway listens on a new port 0 and the SDK is told its URL (`set_url`): binding
/// the old port again could race with any other process taking it meanwhile.
#[tokio::test]
async fn a_restart_delivers_missed_turns_exactly_once_in_order() {
    let a = TestGateway::start().await;
    let session = a.session().await;
    let mut surface = Surface::connect(session.surface().reconnect(quick(None)))
        .await
        .expect("attached");
    assert!(matches!(next(&mut surface).await, Event::Connected { .. }));

    // Two live turns the SDK receives but the application does not take before the restart: they
    // stay unacknowledged, so the restarted gateway sends them again, and the SDK must drop the
    // repeats. Waiting for the gateway to have written them makes sure they precede its close.
    let mut pushed = Vec::new();
    for text in ["a", "b"] {
        let p = session
            .push_turn(PushTurn::assistant(text))
            .await
            .expect("push");
        assert_eq!(p.delivery, Delivery::Live);
        pushed.push(p.seq);
    }
    a.wait_metric("sbp_tether_delivered_total", 2).await;
    let dir = a.stop().await;

    // The gateway comes back on the same database; the backend pushes while the surface is away.
    let b = TestGateway::with(Options {
        dir: Some(dir),
        ..Options::default()
    })
    .await;
    let session_b = b.client().session(session.id(), session.token());
    for text in ["c", "d"] {
        let p = session_b
            .push_turn(PushTurn::assistant(text))
            .await
            .expect("push");
        assert_eq!(p.delivery, Delivery::Tethered);
        pushed.push(p.seq);
    }

    // Told where the gateway is now, the surface comes back. The application reads nothing until
    // then, so the attach's `last_seq` is 0 and the gateway drains a and b again.
    surface.set_url(&b.url).expect("url");
    crate::support::wait_session(&session_b, "the surface back", |s| s.surface_attached).await;

    let mut seen = Vec::new();
    // a and b, live, then the close of the stopped gateway.
    for _ in 0..2 {
        let (text, complete) = live_turn(&mut surface).await;
        seen.push((text, complete.seq));
    }
    match next(&mut surface).await {
        Event::Disconnected(d) => {
            assert_eq!(
                (d.kind, d.code),
                (DisconnectKind::Closed, Some(1001)),
                "{d:?}"
            );
            assert!(d.will_reconnect);
        }
        other => panic!("expected Disconnected, got {other:?}"),
    }
    let mut attempts = Vec::new();
    let attached = loop {
        match next(&mut surface).await {
            Event::Reconnecting { attempt, .. } => attempts.push(attempt),
            Event::Connected {
                attached,
                reconnected,
            } => {
                assert!(reconnected);
                break attached;
            }
            other => panic!("unexpected event while reconnecting: {other:?}"),
        }
    };
    assert_eq!(
        attached.queued_turns, 4,
        "the gateway resends the unacknowledged a and b with c and d; the SDK drops a and b"
    );
    for _ in 0..2 {
        let t = tether_turn(&mut surface).await;
        seen.push((t.content.unwrap_or_default(), Some(t.seq)));
    }
    // Nothing else came in between: the next event is a new live turn.
    let e = session_b
        .push_turn(PushTurn::assistant("e"))
        .await
        .expect("push");
    assert_eq!(e.delivery, Delivery::Live);
    let (text, complete) = live_turn(&mut surface).await;
    seen.push((text, complete.seq));
    pushed.push(e.seq);

    let expected: Vec<_> = ["a", "b", "c", "d", "e"]
        .iter()
        .zip(&pushed)
        .map(|(t, s)| ((*t).to_owned(), Some(*s)))
        .collect();
    assert_eq!(seen, expected);
    assert_eq!(attempts.first(), Some(&1), "{attempts:?}");
    assert_eq!(surface.last_seq(), e.seq);

    // Everything was acknowledged: the tether is empty.
    crate::support::wait_session(&session_b, "every ACK", |s| s.tether_turns_pending == 0).await;
    surface.close().await;
}

#[tokio::test]
async fn it_gives_up_after_max_attempts() {
    let gw = TestGateway::start().await;
    let session = gw.session().await;
    let mut surface = Surface::connect(session.surface().reconnect(quick(Some(2))))
        .await
        .expect("attached");
    assert!(matches!(next(&mut surface).await, Event::Connected { .. }));
    gw.stop().await;
    assert!(matches!(
        next(&mut surface).await,
        Event::Disconnected(d) if d.will_reconnect
    ));
    assert!(matches!(
        next(&mut surface).await,
        Event::Reconnecting {
            attempt: 1,
            last_error: None,
            ..
        }
    ));
    match next(&mut surface).await {
        Event::Reconnecting {
            attempt: 2,
            last_error: Some(e),
            ..
        } => assert!(!e.is_empty()),
        other => panic!("expected attempt 2 with the first error, got {other:?}"),
    }
    match next(&mut surface).await {
        Event::Disconnected(d) => {
            assert_eq!(d.kind, DisconnectKind::GaveUp, "{d:?}");
            assert!(!d.will_reconnect && d.detail.is_some(), "{d:?}");
        }
        other => panic!("expected GaveUp, got {other:?}"),
    }
    ended(&mut surface).await;
}

#[tokio::test]
async fn close_while_waiting_to_reconnect_ends_at_once() {
    let gw = TestGateway::start().await;
    let session = gw.session().await;
    let slow = ReconnectPolicy {
        backoff: Backoff {
            initial: Duration::from_secs(3600),
            max: Duration::from_secs(3600),
            jitter: 0.0,
            ..Backoff::default()
        },
        ..ReconnectPolicy::default()
    };
    let mut surface = Surface::connect(session.surface().reconnect(slow))
        .await
        .expect("attached");
    gw.stop().await;
    loop {
        match next(&mut surface).await {
            Event::Reconnecting { delay, .. } => {
                assert_eq!(delay, Duration::from_secs(3600));
                break;
            }
            Event::Connected { .. } | Event::Disconnected(_) => {}
            Event::Frame(ServerFrame::Ping) | Event::Frame(_) | Event::InvalidFrame { .. } => {}
        }
    }
    tokio::time::timeout(WAIT, surface.close())
        .await
        .expect("close does not wait out the backoff");
    match next(&mut surface).await {
        Event::Disconnected(d) => assert_eq!(d.kind, DisconnectKind::Detached),
        other => panic!("expected Detached, got {other:?}"),
    }
    ended(&mut surface).await;
}
