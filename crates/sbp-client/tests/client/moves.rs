//! A session that moved to another gateway (SBP L6): a `SessionClient` follows 409
//! `SBP_SESSION_MOVED` to the gateway it names and sends the call again there. Against two real
//! federated gateways in-process (a surface attaching to the second pulls the session over), and
//! against fake gateways that answer only "moved": to a real gateway, in a chain longer than a
//! call follows, and to URLs that must not get the session token.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use sbp_client::protocol::federation::{IdentityKey, Role};
use sbp_client::types::PushTurn;
use sbp_client::{Client, Error, Event, Surface, SurfaceConfig};
use sbp_gateway::config::{FederationConfig, PeerSpec};
use sbp_gateway::{Gateway, GatewayConfig};
use sbp_llm::EchoProvider;
use sbp_store::sqlite::{SqliteOptions, SqliteStore};
use serde_json::{Value, json};
use tokio::net::TcpListener;

use crate::support::{TestGateway, TestGatewayExt, WAIT, config, live_turn, next};

/// One in-process gateway of a federation, served on a listener bound before it started.
struct Node {
    url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    _dir: tempfile::TempDir,
}

impl Node {
    async fn start(listener: TcpListener, federation: FederationConfig) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(SqliteOptions::new(dir.path().join("sbp.db")))
            .await
            .expect("open store");
        let gateway = Gateway::start(
            GatewayConfig {
                federation: Some(federation),
                ..config()
            },
            Arc::new(store),
            Arc::new(EchoProvider),
        )
        .await
        .expect("a federated gateway starts");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(sbp_gateway::serve(listener, gateway, async move {
            let _ = stopped.await;
        }));
        Self {
            url,
            stop: Some(stop),
            handle: Some(handle),
            _dir: dir,
        }
    }

    fn client(&self) -> Client {
        Client::builder(&self.url)
            .no_proxy()
            .timeout(WAIT)
            .build()
            .expect("client")
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.handle.take() {
            tokio::time::timeout(WAIT, h)
                .await
                .expect("the gateway stops in time")
                .expect("serve task")
                .expect("serve result");
        }
    }
}

/// Two gateways that pin each other's key: a surface attaching to one with a session the other
/// holds brings the session over.
async fn federated_pair() -> (Node, Node) {
    let listeners = [bind().await, bind().await];
    let urls: Vec<String> = listeners
        .iter()
        .map(|l| format!("http://{}", l.local_addr().expect("addr")))
        .collect();
    let keys = [key(), key()];
    let mut nodes = Vec::new();
    for (i, listener) in listeners.into_iter().enumerate() {
        let other = 1 - i;
        let federation = FederationConfig {
            role: Role::Gateway,
            gateway_name: format!("gateway {i}"),
            key: keys[i].clone(),
            first_public_key: keys[i].public_key(),
            old_keys: Vec::new(),
            peers: vec![PeerSpec {
                url: urls[other].clone(),
                pin: Some(keys[other].public_key().to_b64_spki()),
            }],
            trackers: Vec::new(),
            peer_srv: Vec::new(),
            dns_server: None,
            tofu: false,
            allow_http: false,
            announce_exports: false,
            announce_ttl: Duration::from_secs(3600),
            tracker_max_records: 10_000,
            tracker_announce_rate: None,
            handover_lease: Duration::from_secs(30),
        };
        nodes.push(Node::start(listener, federation).await);
    }
    let b = nodes.pop().expect("two nodes");
    let a = nodes.pop().expect("two nodes");
    (a, b)
}

fn key() -> Arc<IdentityKey> {
    Arc::new(IdentityKey::from_seed(rand::random()))
}

async fn bind() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.expect("bind")
}

/// The URL as the SDK writes a base (`http://host:port/`).
fn base(url: &str) -> String {
    format!("{}/", url.trim_end_matches('/'))
}

#[tokio::test]
async fn a_session_client_follows_its_session_to_the_gateway_it_moved_to() {
    let (a, b) = federated_pair().await;
    let session = a
        .client()
        .create_session(Default::default())
        .await
        .expect("a session on A");
    let first = session.send_message("hello from A").await.expect("reply");
    assert_eq!(session.base_url().as_str(), base(&a.url));

    // A phone attaches to B with the session's id and token: B brings the session over.
    let mut phone = Surface::connect(SurfaceConfig::new(&b.url, session.id(), session.token()))
        .await
        .expect("attached to B");
    assert_eq!(phone.attached().session_id, session.id());
    assert_eq!(phone.attached().sbp_level, "L6");
    assert!(matches!(next(&mut phone).await, Event::Connected { .. }));

    // A says where the session went.
    let raw = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("reqwest");
    let answer = raw
        .post(format!("{}/v1/sbp/sessions/{}/turns", a.url, session.id()))
        .header("x-session-token", session.token())
        .json(&json!({"content": "to A"}))
        .send()
        .await
        .expect("A answers");
    assert_eq!(answer.status(), 409);
    let body: Value = answer.json().await.expect("json");
    assert_eq!(body["error"]["code"], "SBP_SESSION_MOVED", "{body}");
    assert_eq!(
        body["error"]["detail"]["gateway_url"].as_str().map(base),
        Some(base(&b.url)),
        "{body}"
    );

    // The client still points at A: its next call is answered "moved" and sent again to B,
    // where the reply streams to the phone.
    let clone = session.clone();
    let http = tokio::spawn(async move { clone.send_message("and now?").await });
    let (streamed, complete) = live_turn(&mut phone).await;
    let reply = http.await.expect("task").expect("followed to B");
    assert_eq!(reply.meta.session_id, session.id());
    assert_eq!(streamed, reply.text);
    assert!(complete.seq.is_some());
    assert_eq!(
        session.base_url().as_str(),
        base(&b.url),
        "clones share where the session is"
    );
    assert_eq!(session.surface().base_url(), base(&b.url));

    // Later calls go straight to B, with the whole history there.
    let page = session.messages(None, None).await.expect("transcript on B");
    let texts: Vec<&str> = page.messages.iter().filter_map(|m| m.text()).collect();
    assert_eq!(
        texts,
        [
            "hello from A",
            first.text.as_str(),
            "and now?",
            reply.text.as_str()
        ]
    );
    let lineage = session.lineage().await.expect("lineage on B");
    assert_eq!(lineage.session_id, session.id());

    phone.close().await;
    a.stop().await;
    b.stop().await;
}

/// A fake gateway: answers every request with 409 SBP_SESSION_MOVED naming `to`, and records
/// the session token each request carried.
struct Mover {
    url: String,
    tokens: Arc<Mutex<Vec<Option<String>>>>,
    _task: AbortOnDrop,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Mover {
    async fn start(to: impl Fn(SocketAddr) -> String) -> Self {
        let listener = bind().await;
        let addr = listener.local_addr().expect("addr");
        let to = to(addr);
        let tokens = Arc::new(Mutex::new(Vec::new()));
        let seen = tokens.clone();
        let app = axum::Router::new().fallback(move |headers: HeaderMap| {
            let to = to.clone();
            let seen = seen.clone();
            async move {
                let token = headers
                    .get("x-session-token")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                seen.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(token);
                let body = json!({"error": {
                    "code": "SBP_SESSION_MOVED",
                    "message": "the session moved to another gateway",
                    "detail": {"gateway_id": "f00d", "gateway_url": to},
                }});
                (StatusCode::CONFLICT, axum::Json(body)).into_response()
            }
        });
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            url: format!("http://{addr}"),
            tokens,
            _task: AbortOnDrop(task),
        }
    }

    fn tokens(&self) -> Vec<Option<String>> {
        self.tokens
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[tokio::test]
async fn a_move_to_a_real_gateway_is_followed_and_sessions_made_there_stay_there() {
    let gw = TestGateway::start().await;
    let real = gw.session().await;
    let target = gw.url.clone();
    let mover = Mover::start(move |_| target.clone()).await;
    let client = Client::builder(&mover.url)
        .no_proxy()
        .timeout(WAIT)
        .build()
        .expect("client");
    let session = client.session(real.id(), real.token());

    let pushed = session
        .push_turn(PushTurn::assistant("found you"))
        .await
        .expect("followed to the real gateway");
    assert!(pushed.seq > 0);
    assert_eq!(session.base_url().as_str(), base(&gw.url));
    assert_eq!(mover.tokens(), [Some(real.token().to_owned())]);

    // A fork is made where the session is, and its client starts there.
    let fork = session.fork(Some("copy")).await.expect("fork");
    assert_eq!(fork.session.base_url().as_str(), base(&gw.url));
    assert_eq!(
        fork.session.get().await.expect("fork view").message_count,
        1
    );
    assert_eq!(
        mover.tokens().len(),
        1,
        "nothing more went to the old gateway"
    );
    // The client itself still names the gateway it was made for.
    assert_eq!(client.base_url().as_str(), base(&mover.url));
}

#[tokio::test]
async fn one_call_follows_at_most_three_moves() {
    // m0 → m1 → m2 → m3 → m4: each says the session moved to the next; m4 names itself.
    let last = Mover::start(|addr| format!("http://{addr}")).await;
    let mut chain = vec![last];
    for _ in 0..4 {
        let next = chain.last().expect("one").url.clone();
        chain.push(Mover::start(move |_| next.clone()).await);
    }
    chain.reverse();
    let client = Client::builder(&chain[0].url)
        .no_proxy()
        .timeout(WAIT)
        .build()
        .expect("client");
    let session = client.session("0192f0a1-7c3e-7d11-8a2b-9c2e41d03f5a", "secret-token");
    let err = session
        .push_turn(PushTurn::assistant("hello?"))
        .await
        .expect_err("still moved after three moves");
    assert!(
        matches!(&err, Error::Api { status: 409, code, .. } if code == "SBP_SESSION_MOVED"),
        "{err:?}"
    );
    let asked: Vec<usize> = chain.iter().map(|m| m.tokens().len()).collect();
    assert_eq!(asked, [1, 1, 1, 1, 0], "the first gateway and three moves");
    assert_eq!(session.base_url().as_str(), base(&chain[3].url));

    // The next call starts where the last one stopped; a gateway naming itself is not followed
    // again (that would loop).
    let err = session.memory().await.expect_err("moved");
    assert_eq!(err.code(), Some("SBP_SESSION_MOVED"));
    assert_eq!(chain[3].tokens().len(), 2);
    assert_eq!(chain[4].tokens().len(), 1);
    assert_eq!(session.base_url().as_str(), base(&chain[4].url));
}

#[tokio::test]
async fn the_token_never_goes_to_a_url_that_is_not_http() {
    // A gateway that records any request, named through schemes that must not be followed.
    let bystander = Mover::start(|_| "http://127.0.0.1:9/".to_owned()).await;
    let port = bystander.url.rsplit(':').next().expect("port").to_owned();
    for to in [
        format!("ws://127.0.0.1:{port}"),
        format!("ftp://127.0.0.1:{port}/"),
        "javascript:alert(document.cookie)".to_owned(),
        "file:///etc/passwd".to_owned(),
        format!("//127.0.0.1:{port}"),
        format!("http://user:pw@127.0.0.1:{port}"),
        String::new(),
    ] {
        let mover = Mover::start(move |_| to.clone()).await;
        let client = Client::builder(&mover.url)
            .no_proxy()
            .timeout(WAIT)
            .build()
            .expect("client");
        let session = client.session("0192f0a1-7c3e-7d11-8a2b-9c2e41d03f5a", "secret-token");
        let err = session.send_message("hi").await.expect_err("not followed");
        assert_eq!(err.code(), Some("SBP_SESSION_MOVED"), "{err:?}");
        assert_eq!(mover.tokens().len(), 1);
        assert_eq!(session.base_url().as_str(), base(&mover.url));
    }
    assert!(bystander.tokens().is_empty(), "{:?}", bystander.tokens());
}
