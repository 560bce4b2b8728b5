//! The Redis bus between replicas, against the machine's Redis (`SBP_TEST_REDIS_URL`): every test
//! plays several replicas in one process, each test under a key prefix of its own (deleted
//! afterwards), with a short heartbeat and liveness ttl where liveness matters.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sbp_bus::{Bus, BusError, BusMsg, Holder, LiveChunk, RedisBus, RelayedOutcome, TurnDone};
use sbp_protocol::SurfaceContext;
use sbp_protocol::ToolFailure;
use sbp_protocol::frames::ToolCall;
use sbp_test_support::test_redis_url;
use serde_json::json;
use tokio::time::{Instant, timeout};
use uuid::Uuid;

use support::{Fixture, recv};

mod support {
    use std::future::Future;
    use std::sync::Arc;
    use std::time::Duration;

    use sbp_bus::{BusMsg, RedisBus, RedisBusOptions};
    use sbp_test_support::{delete_prefix, run_then_clean_up, test_redis_url};
    use tokio::sync::mpsc;

    /// One test's key prefix and liveness timing; every replica it connects shares them.
    #[derive(Debug, Clone)]
    pub struct Fixture {
        pub prefix: String,
        pub heartbeat: Duration,
        pub ttl: Duration,
    }

    impl Fixture {
        /// Runs `case` in its own task with a fresh prefix, deletes the prefix's keys, then passes
        /// a panic on.
        pub async fn run<F, Fut>(case: F)
        where
            F: FnOnce(Fixture) -> Fut,
            Fut: Future<Output = ()> + Send + 'static,
        {
            Self::run_with(Duration::from_millis(100), Duration::from_millis(400), case).await;
        }

        /// [`Fixture::run`] with the replicas' heartbeat interval and liveness ttl.
        pub async fn run_with<F, Fut>(heartbeat: Duration, ttl: Duration, case: F)
        where
            F: FnOnce(Fixture) -> Fut,
            Fut: Future<Output = ()> + Send + 'static,
        {
            let fx = Fixture {
                prefix: format!("sbptest:{}:", uuid::Uuid::new_v4().simple()),
                heartbeat,
                ttl,
            };
            let prefix = fx.prefix.clone();
            run_then_clean_up(case(fx), async move {
                if let Err(e) = delete_prefix(&test_redis_url(), &prefix).await {
                    eprintln!("could not delete redis keys {prefix}*: {e}");
                }
            })
            .await;
        }

        pub fn options(&self, replica: &str) -> RedisBusOptions {
            RedisBusOptions {
                prefix: self.prefix.clone(),
                heartbeat: self.heartbeat,
                ttl: self.ttl,
                ..RedisBusOptions::new(test_redis_url(), replica)
            }
        }

        /// Joins the bus as `replica`; panics (with how to fix it) if Redis is not there.
        pub async fn connect(&self, replica: &str) -> (Arc<RedisBus>, mpsc::Receiver<BusMsg>) {
            RedisBus::connect(self.options(replica))
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "joining the bus at {} as '{replica}' failed ({e}). These tests need \
                         Redis: run `bash scripts/services.sh` to start it, or set \
                         SBP_TEST_REDIS_URL.",
                        test_redis_url()
                    )
                })
        }
    }

    /// The next message on `rx`; fails the test if none comes within 30 s.
    pub async fn recv(rx: &mut mpsc::Receiver<BusMsg>) -> BusMsg {
        tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .expect("a message within 30 s")
            .expect("the bus's receiver is open")
    }
}

fn names(replicas: &[&str]) -> Vec<String> {
    replicas.iter().map(|r| (*r).to_owned()).collect()
}

/// A surface with tools declared by name and by schema, a `|` in a string and an unknown field:
/// everything the holder value has to carry across replicas intact.
fn phone_surface() -> SurfaceContext {
    let ctx = SurfaceContext::from_value(&json!({
        "device_type": "mobile",
        "surface_id": "phone|1",
        "locale": "de-DE",
        "ui_capabilities": ["markdown"],
        "mcp_tools": [
            "gps",
            {
                "name": "camera",
                "description": "takes a photo",
                "inputSchema": {"type": "object", "properties": {"zoom": {"type": "number"}}}
            }
        ],
        "vendor_field": {"nested": [1, 2]}
    }));
    assert_eq!(ctx.mcp_tools, vec!["gps", "camera"]);
    assert_eq!(ctx.mcp_tool_schemas.len(), 1);
    ctx
}

fn desktop_surface(tools: &[&str]) -> SurfaceContext {
    SurfaceContext::from_value(&json!({"device_type": "desktop", "mcp_tools": tools}))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_arrive_at_their_replica_in_send_order() {
    Fixture::run(|fx| async move {
        let (a, mut a_rx) = fx.connect("a").await;
        let (b, mut b_rx) = fx.connect("b").await;
        let session = Uuid::now_v7();
        let chunk_id = Uuid::now_v7();
        // More than one publishing batch, queued faster than it is published.
        let mut sent: Vec<BusMsg> = (0..1000)
            .map(|i| BusMsg::Chunk {
                session,
                conn: 7,
                chunk: LiveChunk {
                    chunk_id,
                    delta: format!("délta {i} |"),
                    round: 0,
                    offset: i,
                    step: Some(3),
                    model: Some("m".into()),
                },
            })
            .collect();
        sent.extend([
            BusMsg::TurnDone {
                session,
                done: TurnDone {
                    chunk_id,
                    seq: Some(12),
                    role: "assistant".into(),
                    content: Some("the whole answer".into()),
                    model_used: Some("m".into()),
                    step: Some(3),
                    cost_usd: None,
                },
            },
            BusMsg::ToolCall {
                session,
                conn: u64::MAX,
                reply_to: "a".into(),
                call: ToolCall {
                    call_id: Uuid::new_v4().to_string(),
                    tool_name: "gps".into(),
                    tool_input: json!({"accuracy": "high"}),
                    timeout_ms: Some(5000),
                },
            },
            BusMsg::ToolReply {
                call_id: Uuid::new_v4(),
                outcome: RelayedOutcome(Ok(json!({"lat": 1.5}))),
            },
            BusMsg::ToolReply {
                call_id: Uuid::new_v4(),
                outcome: RelayedOutcome(Err(ToolFailure::Timeout)),
            },
        ]);
        for m in &sent {
            assert!(a.send("b", m.clone()), "queued");
        }
        let end_of_b = BusMsg::Displace {
            session: Uuid::new_v4(),
            conn: 1,
        };
        assert!(a.send("b", end_of_b.clone()));
        // Published after everything for b on the same connection: had any of it gone to a's own
        // channel, it would arrive at a before this.
        let marker = BusMsg::Displace {
            session: Uuid::new_v4(),
            conn: 2,
        };
        assert!(a.send("a", marker.clone()));

        for (i, want) in sent.iter().enumerate() {
            assert_eq!(&recv(&mut b_rx).await, want, "message {i} at b");
        }
        assert_eq!(recv(&mut b_rx).await, end_of_b, "b got nothing extra");
        assert_eq!(
            recv(&mut a_rx).await,
            marker,
            "nothing sent to b arrived at a"
        );

        // And back the other way.
        let reply = BusMsg::ToolReply {
            call_id: Uuid::new_v4(),
            outcome: RelayedOutcome(Ok(json!(["ok"]))),
        };
        assert!(b.send("a", reply.clone()));
        assert_eq!(recv(&mut a_rx).await, reply);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_publishes_what_is_queued_then_refuses_to_send() {
    Fixture::run(|fx| async move {
        let (a, _a_rx) = fx.connect("a").await;
        let (_b, mut b_rx) = fx.connect("b").await;
        let session = Uuid::now_v7();
        let sent: Vec<BusMsg> = (0..2000)
            .map(|i| BusMsg::Displace { session, conn: i })
            .collect();
        for m in &sent {
            assert!(a.send("b", m.clone()));
        }
        // Straight away: most of it is still queued.
        a.close().await;
        for (i, want) in sent.iter().enumerate() {
            assert_eq!(&recv(&mut b_rx).await, want, "message {i}");
        }
        assert!(
            !a.send("b", BusMsg::Displace { session, conn: 0 }),
            "a closed bus cannot queue"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_holder_update_release() {
    Fixture::run(|fx| async move {
        let (a, _a_rx) = fx.connect("a").await;
        let (b, _b_rx) = fx.connect("b").await;
        let session = Uuid::now_v7();
        let phone = phone_surface();

        assert_eq!(b.holder(session).await.expect("holder"), None);
        assert_eq!(a.claim(session, 1, &phone).await.expect("claim"), None);
        let held_by_a = Holder {
            replica: "a".into(),
            conn: 1,
            surface: phone.clone(),
        };
        assert_eq!(
            b.holder(session).await.expect("holder"),
            Some(held_by_a.clone())
        );
        assert_eq!(
            a.holder(session).await.expect("holder"),
            Some(held_by_a.clone())
        );
        assert_eq!(
            b.holder(Uuid::now_v7()).await.expect("holder"),
            None,
            "another session is not held"
        );

        // b's surface takes over (conn 21, so that a "b|2" prefix without its '|' would match it).
        let desk = desktop_surface(&["files"]);
        assert_eq!(
            b.claim(session, 21, &desk).await.expect("claim"),
            Some(held_by_a),
            "the displaced holder is reported"
        );
        let held_by_b = Holder {
            replica: "b".into(),
            conn: 21,
            surface: desk.clone(),
        };

        // The displaced connection can neither remove nor overwrite its successor.
        assert!(!a.release(session, 1).await.expect("release"));
        assert!(!a.update(session, 1, &phone).await.expect("update"));
        assert!(
            !a.update(session, 21, &phone).await.expect("update"),
            "same conn, other replica"
        );
        assert!(
            !b.update(session, 2, &phone).await.expect("update"),
            "same replica, other conn"
        );
        assert!(!b.release(session, 2).await.expect("release"));
        assert_eq!(a.holder(session).await.expect("holder"), Some(held_by_b));

        // The holder changes its surface; every replica sees the change.
        let desk2 = desktop_surface(&["files", "clipboard"]);
        assert!(b.update(session, 21, &desk2).await.expect("update"));
        let seen = a.holder(session).await.expect("holder").expect("held");
        assert_eq!((seen.replica.as_str(), seen.conn), ("b", 21));
        assert_eq!(seen.surface, desk2);
        assert_eq!(seen.surface.mcp_tools, vec!["files", "clipboard"]);

        // The holder lets go.
        assert!(b.release(session, 21).await.expect("release"));
        assert_eq!(a.holder(session).await.expect("holder"), None);
        assert_eq!(b.holder(session).await.expect("holder"), None);
        assert!(
            !b.release(session, 21).await.expect("release"),
            "already released"
        );
        assert!(
            !b.update(session, 21, &desk).await.expect("update"),
            "an update does not resurrect a released holder"
        );
        assert_eq!(a.holder(session).await.expect("holder"), None);
        assert_eq!(a.claim(session, 3, &phone).await.expect("claim"), None);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_withdraws_liveness_at_once() {
    Fixture::run(|fx| async move {
        let (a, _a_rx) = fx.connect("a").await;
        let (b, _b_rx) = fx.connect("b").await;
        let session = Uuid::now_v7();
        let phone = phone_surface();
        assert_eq!(a.claim(session, 1, &phone).await.expect("claim"), None);
        assert_eq!(
            b.alive(&names(&["a", "b", "nobody"])).await.expect("alive"),
            [true, true, false]
        );
        assert_eq!(b.alive(&[]).await.expect("alive"), Vec::<bool>::new());

        a.close().await;
        // No waiting for a ttl: close deleted a's key.
        assert_eq!(
            b.alive(&names(&["a", "b"])).await.expect("alive"),
            [false, true]
        );
        assert_eq!(
            b.holder(session).await.expect("holder"),
            None,
            "a dead replica holds nothing"
        );
        assert_eq!(
            b.claim(session, 2, &desktop_surface(&[]))
                .await
                .expect("claim"),
            None,
            "a dead holder is not reported as displaced"
        );
        assert_eq!(
            b.holder(session)
                .await
                .expect("holder")
                .map(|h| (h.replica, h.conn)),
            Some(("b".to_owned(), 2))
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_heartbeat_stops_dies_after_its_ttl() {
    let heartbeat = Duration::from_millis(100);
    let ttl = Duration::from_millis(600);
    Fixture::run_with(heartbeat, ttl, move |fx| async move {
        let (a, a_rx) = fx.connect("a").await;
        let (b, _b_rx) = fx.connect("b").await;
        let session = Uuid::now_v7();
        assert_eq!(
            a.claim(session, 1, &phone_surface()).await.expect("claim"),
            None
        );

        // The heartbeat keeps a alive for several ttls.
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        let watch_until = Instant::now() + ttl * 3;
        while Instant::now() < watch_until {
            tick.tick().await;
            assert_eq!(b.alive(&names(&["a"])).await.expect("alive"), [true]);
        }

        // Dropping the bus without close stops its heartbeat but leaves its key to expire: the
        // way a replica that stalls or is killed looks to the others.
        drop(a);
        drop(a_rx);
        let stopped = Instant::now();
        assert_eq!(
            b.alive(&names(&["a"])).await.expect("alive"),
            [true],
            "alive until the ttl runs out"
        );
        assert!(b.holder(session).await.expect("holder").is_some());

        // Expiry is not an event the bus reports, so poll for it.
        let deadline = stopped + ttl + Duration::from_secs(3);
        loop {
            tick.tick().await;
            if b.alive(&names(&["a"])).await.expect("alive") == [false] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "a still alive {:?} after it stopped",
                stopped.elapsed()
            );
        }
        assert_eq!(b.holder(session).await.expect("holder"), None);
        assert_eq!(
            b.alive(&names(&["b"])).await.expect("alive"),
            [true],
            "b's heartbeat goes on"
        );

        // Its id is free again.
        let (again, _rx) = fx.connect("a").await;
        assert_eq!(b.alive(&names(&["a"])).await.expect("alive"), [true]);
        again.close().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_id_is_taken_while_its_replica_lives() {
    Fixture::run(|fx| async move {
        let (first, _first_rx) = fx.connect("a").await;
        let (b, _b_rx) = fx.connect("b").await;
        match RedisBus::connect(fx.options("a")).await {
            Err(BusError::Config(msg)) => assert!(msg.contains("'a'"), "{msg}"),
            other => panic!("a second 'a' joined: {other:?}"),
        }
        // The refused attempt left the first one alone.
        assert_eq!(b.alive(&names(&["a"])).await.expect("alive"), [true]);

        first.close().await;
        let (second, mut second_rx) = fx.connect("a").await;
        assert_eq!(second.replica(), "a");
        let msg = BusMsg::Displace {
            session: Uuid::now_v7(),
            conn: 9,
        };
        assert!(b.send("a", msg.clone()));
        assert_eq!(
            recv(&mut second_rx).await,
            msg,
            "the new 'a' gets a's messages"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_options_are_refused() {
    Fixture::run(|fx| async move {
        for id in ["a|b", "", "a b", &"x".repeat(65)] {
            match RedisBus::connect(fx.options(id)).await {
                Err(BusError::Config(msg)) => assert!(msg.contains("replica id"), "{msg}"),
                other => panic!("replica id {id:?} accepted: {other:?}"),
            }
        }
        let mut opts = fx.options("a");
        opts.ttl = opts.heartbeat;
        assert!(matches!(
            RedisBus::connect(opts).await,
            Err(BusError::Config(_))
        ));
        let mut opts = fx.options("a");
        opts.url = "not a url".into();
        assert!(matches!(
            RedisBus::connect(opts).await,
            Err(BusError::Config(_))
        ));
        // None of the refusals claimed the id.
        let (a, _a_rx) = fx.connect("a").await;
        a.close().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_is_unavailable() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind")
        .port();
    let fx = Fixture {
        prefix: format!("sbptest:{}:", Uuid::new_v4().simple()),
        heartbeat: Duration::from_millis(100),
        ttl: Duration::from_millis(400),
    };
    let mut opts = fx.options("a");
    opts.url = format!("redis://127.0.0.1:{port}");
    opts.timeout = Duration::from_millis(500);
    match RedisBus::connect(opts).await {
        Err(BusError::Unavailable(_)) => {}
        other => panic!("joined a bus nobody serves: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_lock_has_one_holder_at_a_time() {
    Fixture::run(|fx| async move {
        let (a, _a_rx) = fx.connect("a").await;
        let (b, _b_rx) = fx.connect("b").await;
        let session = Uuid::now_v7();
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let entries = Arc::new(AtomicUsize::new(0));
        const TASKS: usize = 4;
        const ROUNDS: usize = 100;
        let mut tasks = Vec::new();
        for i in 0..TASKS {
            let bus = if i % 2 == 0 { a.clone() } else { b.clone() };
            let (inside, most, entries) = (inside.clone(), most.clone(), entries.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    let lock = bus.lock(session).await.expect("lock");
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    entries.fetch_add(1, Ordering::SeqCst);
                    // A round trip while holding it, so that a second holder would overlap.
                    bus.alive(&[bus.replica().to_owned()]).await.expect("alive");
                    tokio::task::yield_now().await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    bus.unlock(lock).await;
                }
            }));
        }
        for t in tasks {
            t.await.expect("contender");
        }
        assert_eq!(entries.load(Ordering::SeqCst), TASKS * ROUNDS);
        assert_eq!(most.load(Ordering::SeqCst), 1, "two held the lock at once");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_of_different_sessions_are_independent() {
    Fixture::run(|fx| async move {
        let (a, _a_rx) = fx.connect("a").await;
        let (b, _b_rx) = fx.connect("b").await;
        let (s1, s2) = (Uuid::now_v7(), Uuid::now_v7());
        let l1 = a.lock(s1).await.expect("lock");
        // A blocked lock waits 10 s; these must not.
        let l2 = timeout(Duration::from_secs(2), b.lock(s2))
            .await
            .expect("another session's lock is free")
            .expect("lock");
        assert!(
            timeout(Duration::from_millis(300), b.lock(s1))
                .await
                .is_err(),
            "s1 is taken"
        );
        a.unlock(l1).await;
        let l1 = timeout(Duration::from_secs(2), b.lock(s1))
            .await
            .expect("s1 is free once unlocked")
            .expect("lock");
        b.unlock(l1).await;
        b.unlock(l2).await;
        let l2 = timeout(Duration::from_secs(2), a.lock(s2))
            .await
            .expect("s2 is free once unlocked")
            .expect("lock");
        a.unlock(l2).await;
    })
    .await;
}

/// Slow: waits out the lock's 10 s lifetime (it is not configurable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lock_is_taken_over_and_its_stale_unlock_is_harmless() {
    Fixture::run(|fx| async move {
        let (a, _a_rx) = fx.connect("a").await;
        let (b, _b_rx) = fx.connect("b").await;
        let session = Uuid::now_v7();
        // a takes the lock and, as if it had stalled, does not give it back in time.
        let stale = a.lock(session).await.expect("lock");
        let taken = Instant::now();
        // `lock` gives up after 10 s, about when a's lock expires: ask again if it did.
        let fresh = loop {
            match b.lock(session).await {
                Ok(l) => break l,
                Err(BusError::Unavailable(e)) if taken.elapsed() < Duration::from_secs(30) => {
                    eprintln!("retrying: {e}");
                }
                Err(e) => panic!("the expired lock was never taken over: {e}"),
            }
        };
        assert!(
            taken.elapsed() >= Duration::from_secs(9),
            "b got the lock after {:?}, before it expired",
            taken.elapsed()
        );
        // a's late unlock must not release b's lock.
        a.unlock(stale).await;
        assert!(
            timeout(Duration::from_millis(500), a.lock(session))
                .await
                .is_err(),
            "b's lock was released by a stale token"
        );
        b.unlock(fresh).await;
        let again = timeout(Duration::from_secs(2), a.lock(session))
            .await
            .expect("free once b unlocks")
            .expect("lock");
        a.unlock(again).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_does_not_wait_for_a_full_inbox_to_drain() {
    Fixture::run(|fx| async move {
        let (a, _a_rx) = fx.connect("a").await;
        let (b, b_rx) = fx.connect("b").await;
        let session = Uuid::now_v7();
        // More than b's inbox holds; b never reads it.
        let count = b_rx.max_capacity() as u64 + 100;
        for conn in 0..count {
            let m = BusMsg::Displace { session, conn };
            // The outgoing queue is about as long: let the publisher catch up when it is full.
            while !a.send("b", m.clone()) {
                tokio::task::yield_now().await;
            }
        }
        // The channel does not say when it fills up, so poll for it. The deadline only bounds a
        // failure: a busy machine takes a while to push this many messages through.
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        while b_rx.len() < b_rx.max_capacity() {
            assert!(
                Instant::now() < deadline,
                "b's inbox stuck at {}",
                b_rx.len()
            );
            tick.tick().await;
        }
        // b's subscriber now waits for room in the inbox; close must not wait with it.
        timeout(Duration::from_secs(5), b.close())
            .await
            .expect("close returns while the inbox is full");
        assert_eq!(a.alive(&names(&["b"])).await.expect("alive"), [false]);
    })
    .await;
}

/// `url` with its host and port replaced by `addr`.
fn url_via(url: &str, addr: std::net::SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let user = authority
        .rsplit_once('@')
        .map(|(user, _)| format!("{user}@"))
        .unwrap_or_default();
    format!("{scheme}://{user}{addr}{path}")
}

/// The `host:port` of `url`.
fn host_port(url: &str) -> String {
    let rest = url.split_once("://").expect("a URL").1;
    let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, hp)| hp)
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_join_gives_its_id_back() {
    // A long ttl: an id left behind would still be taken when checked.
    let ttl = Duration::from_secs(30);
    Fixture::run_with(Duration::from_millis(100), ttl, |fx| async move {
        // In front of Redis: forwards the first connection (the bus's commands) and hangs up on
        // every later one (its subscription), so joining fails after the id was announced.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let proxy_addr = listener.local_addr().expect("address");
        let upstream = host_port(&test_redis_url());
        let proxy = tokio::spawn(async move {
            let (mut first, _) = listener.accept().await.expect("accept");
            let mut redis = tokio::net::TcpStream::connect(upstream)
                .await
                .expect("connect to redis");
            let forward = tokio::io::copy_bidirectional(&mut first, &mut redis);
            tokio::pin!(forward);
            loop {
                tokio::select! {
                    _ = &mut forward => return,
                    later = listener.accept() => match later {
                        Ok((later, _)) => drop(later),
                        Err(_) => return,
                    },
                }
            }
        });
        let mut opts = fx.options("a");
        opts.url = url_via(&test_redis_url(), proxy_addr);
        match RedisBus::connect(opts).await {
            Err(BusError::Unavailable(_)) => {}
            other => panic!("joined without a subscription: {other:?}"),
        }
        proxy.abort();
        let _ = proxy.await;

        let (b, _b_rx) = fx.connect("b").await;
        assert_eq!(
            b.alive(&names(&["a"])).await.expect("alive"),
            [false],
            "a never joined"
        );
        // At once, not after the ttl.
        let (a, _a_rx) = fx.connect("a").await;
        a.close().await;
    })
    .await;
}
