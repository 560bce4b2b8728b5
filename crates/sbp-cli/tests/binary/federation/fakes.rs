//! Peers that lie, written in the test: an HTTP server with a valid signed manifest (its own key,
//! which the gateway under test pins) that serves whatever bundle bytes and tracker answers the
//! test sets, and records the federation tokens it is sent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{Duration, Utc};
use sbp_protocol::federation::{Endpoints, IdentityKey, Manifest, Role};
use serde_json::{Map, Value, json};
use tokio::task::JoinHandle;

/// What the fake serves, set by the test while it runs.
pub struct FakeState {
    key: IdentityKey,
    /// The id its manifest claims (its key's, unless it impersonates another node).
    gateway_id: String,
    url: String,
    role: Role,
    /// Bytes served at `GET /v1/sbp/bundles/{cid}` (404 for other CIDs).
    bundles: Mutex<HashMap<String, Vec<u8>>>,
    /// The bearer tokens sent to the bundle route, in order.
    bearers: Mutex<Vec<String>>,
    /// Bytes served at `GET /v1/sbp/registry/{cid}` for any CID (404 when unset).
    answer: Mutex<Option<Vec<u8>>>,
    lookups: AtomicUsize,
    /// `GET /.well-known/sbp` requests served.
    manifests: AtomicUsize,
    /// Signed vouches served at `GET /v1/sbp/registry/gateways/{id}`.
    vouches: Mutex<HashMap<String, Value>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A fake node on 127.0.0.1:0; stopped on drop.
pub struct FakeNode {
    pub url: String,
    pub key: IdentityKey,
    pub gateway_id: String,
    state: Arc<FakeState>,
    task: JoinHandle<()>,
}

impl FakeNode {
    pub async fn start(role: Role, seed: u8) -> Self {
        let id = IdentityKey::from_seed([seed; 32])
            .public_key()
            .derive_gateway_id();
        Self::claiming(role, seed, &id).await
    }

    /// A fake whose manifest, signed by its own key, claims `gateway_id`.
    pub async fn claiming(role: Role, seed: u8, gateway_id: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake node");
        let url = format!(
            "http://{}",
            listener.local_addr().expect("the fake node's address")
        );
        let key = IdentityKey::from_seed([seed; 32]);
        let state = Arc::new(FakeState {
            key: key.clone(),
            gateway_id: gateway_id.to_owned(),
            url: url.clone(),
            role,
            bundles: Mutex::default(),
            bearers: Mutex::default(),
            answer: Mutex::default(),
            lookups: AtomicUsize::new(0),
            manifests: AtomicUsize::new(0),
            vouches: Mutex::default(),
        });
        let app = Router::new()
            .route("/.well-known/sbp", get(manifest))
            .route("/v1/sbp/bundles/{cid}", get(bundle))
            .route("/v1/sbp/registry/gateways", post(register))
            .route("/v1/sbp/registry/gateways/{id}", get(vouch))
            .route("/v1/sbp/registry/{cid}", get(lookup))
            .with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            url,
            gateway_id: gateway_id.to_owned(),
            key,
            state,
            task,
        }
    }

    /// `URL#KEY`.
    pub fn pin(&self) -> String {
        format!("{}#{}", self.url, self.key.public_key().to_b64_spki())
    }

    /// Serves `bytes` as bundle `cid` from now on.
    pub fn serve_bundle(&self, cid: &str, bytes: Vec<u8>) {
        lock(&self.state.bundles).insert(cid.to_owned(), bytes);
    }

    pub fn bearers(&self) -> Vec<String> {
        lock(&self.state.bearers).clone()
    }

    /// Answers every registry lookup with `bytes` from now on.
    pub fn answer_lookups(&self, bytes: Vec<u8>) {
        *lock(&self.state.answer) = Some(bytes);
    }

    pub fn lookups(&self) -> usize {
        self.state.lookups.load(Ordering::SeqCst)
    }

    /// How often its manifest was fetched.
    pub fn manifest_fetches(&self) -> usize {
        self.state.manifests.load(Ordering::SeqCst)
    }

    /// Serves `vouch` for `gateway_id`.
    pub fn vouch_for(&self, gateway_id: &str, vouch: Map<String, Value>) {
        lock(&self.state.vouches).insert(gateway_id.to_owned(), Value::Object(vouch));
    }
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A manifest of `gateway_id` in `role` at `url`, signed now by `key`.
pub fn signed_manifest(
    key: &IdentityKey,
    gateway_id: &str,
    role: Role,
    url: &str,
) -> Map<String, Value> {
    let now = Utc::now();
    Manifest {
        sbp_version: sbp_protocol::DEFAULT_SBP_VERSION.to_owned(),
        gateway_id: gateway_id.to_owned(),
        gateway_name: "fake".to_owned(),
        role,
        public_key: key.public_key().to_b64_spki(),
        key_id: key.key_id(),
        old_keys: Vec::new(),
        issued_at: now,
        valid_until: now + Duration::days(1),
        endpoints: Endpoints::for_role(role, url),
    }
    .to_signed_map(key, None)
}

fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(json!({"error": {"code": "SBP_NOT_FOUND", "message": "not here"}})),
    )
        .into_response()
}

fn json_bytes(bytes: Vec<u8>) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], bytes).into_response()
}

async fn manifest(State(s): State<Arc<FakeState>>) -> Response {
    s.manifests.fetch_add(1, Ordering::SeqCst);
    axum::Json(signed_manifest(&s.key, &s.gateway_id, s.role, &s.url)).into_response()
}

async fn bundle(
    State(s): State<Arc<FakeState>>,
    Path(cid): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(token) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        lock(&s.bearers).push(token.to_owned());
    }
    let bytes = lock(&s.bundles).get(&cid).cloned();
    match bytes {
        Some(b) => json_bytes(b),
        None => not_found(),
    }
}

async fn register() -> Response {
    axum::Json(json!({})).into_response()
}

async fn vouch(State(s): State<Arc<FakeState>>, Path(id): Path<String>) -> Response {
    let vouch = lock(&s.vouches).get(&id).cloned();
    match vouch {
        Some(v) => axum::Json(v).into_response(),
        None => not_found(),
    }
}

async fn lookup(State(s): State<Arc<FakeState>>, Path(_cid): Path<String>) -> Response {
    s.lookups.fetch_add(1, Ordering::SeqCst);
    let answer = lock(&s.answer).clone();
    match answer {
        Some(b) => json_bytes(b),
        None => not_found(),
    }
}
