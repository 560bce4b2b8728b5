//! One load-generating worker: a keep-alive connection that sends chat completions, either
//! straight to the upstream or through the gateway as stateful turns of its own session.

use std::net::SocketAddr;

use anyhow::{Context, bail};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, Uri};

use crate::http::{HttpConn, SESSION_ID, SESSION_TOKEN, uri};

/// The model every completion asks for (a peer gateway's route is configured for it).
pub const MODEL: &str = "bench-model";

/// Where a worker's completions go.
#[derive(Debug, Clone, Copy)]
pub enum Target {
    /// Straight to the fake upstream: no session, one user message.
    Direct,
    /// Through the gateway: the first completion creates a session, later ones send only the new
    /// user message with `X-Session-Token`. With `Some(n)`, a new session every n turns.
    Stateful { turns_per_session: Option<u32> },
}

/// The session a stateful worker is currently talking in.
#[derive(Debug, Default)]
pub struct SessionState {
    pub id: Option<String>,
    pub token: Option<HeaderValue>,
    /// Completions answered 200 in this session.
    pub ok_turns: u64,
    /// Completions in this session that failed.
    pub failed_turns: u64,
    pub sessions_started: u64,
}

pub struct Client {
    conn: HttpConn,
    completions: Uri,
    target: Target,
    worker: usize,
    sent: u64,
    pub session: SessionState,
}

impl Client {
    pub async fn connect(addr: SocketAddr, worker: usize, target: Target) -> anyhow::Result<Self> {
        Ok(Self {
            conn: HttpConn::connect(addr).await?,
            completions: uri("/v1/chat/completions")?,
            target,
            worker,
            sent: 0,
            session: SessionState::default(),
        })
    }

    /// [`Client::connect`], sending `headers` with every request.
    pub async fn connect_with(
        addr: SocketAddr,
        worker: usize,
        target: Target,
        headers: &HeaderMap,
    ) -> anyhow::Result<Self> {
        let mut c = Self::connect(addr, worker, target).await?;
        c.conn.set_extra_headers(headers.clone());
        Ok(c)
    }

    /// For a stateful worker: the first completion, which creates its session. Fails if it fails.
    pub async fn start_session(&mut self) -> anyhow::Result<()> {
        if let Err(e) = self.complete().await {
            bail!("worker {}: creating a session failed: {e}", self.worker);
        }
        Ok(())
    }

    /// Sends one completion and reads the whole answer. `Err` describes a failure (a non-200
    /// answer or a broken connection, which is replaced).
    pub async fn complete(&mut self) -> Result<(), String> {
        self.sent += 1;
        let (token, new_session) = match self.target {
            Target::Direct => (None, false),
            Target::Stateful { turns_per_session } => {
                let rotate = turns_per_session.is_some_and(|n| {
                    self.session.ok_turns + self.session.failed_turns >= u64::from(n)
                });
                if rotate || self.session.token.is_none() {
                    self.session = SessionState {
                        sessions_started: self.session.sessions_started,
                        ..SessionState::default()
                    };
                    (None, true)
                } else {
                    (self.session.token.clone(), false)
                }
            }
        };
        let body = Bytes::from(format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"worker {} message {}: what next?"}}]}}"#,
            self.worker, self.sent
        ));
        let result = self
            .conn
            .post(&self.completions, token.as_ref(), body)
            .await;
        let outcome = match result {
            Err(e) => {
                let msg = format!("transport: {e:#}");
                if let Err(e) = self.conn.reconnect().await {
                    return Err(format!("{msg}; reconnecting: {e:#}"));
                }
                Err(msg)
            }
            Ok(resp) if resp.status != StatusCode::OK => Err(resp.describe()),
            Ok(resp) => {
                if new_session {
                    self.session.token = resp.headers.get(SESSION_TOKEN).cloned();
                    self.session.id = resp
                        .headers
                        .get(SESSION_ID)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    self.session.sessions_started += 1;
                    if self.session.token.is_none() {
                        return Err("a new session's response has no X-Session-Token".into());
                    }
                }
                Ok(())
            }
        };
        if matches!(self.target, Target::Stateful { .. }) {
            match outcome {
                Ok(()) => self.session.ok_turns += 1,
                Err(_) => self.session.failed_turns += 1,
            }
        }
        outcome
    }

    /// Checks that the gateway counted every successful turn of the current session
    /// (`step_count`); `Ok(None)` when there is nothing checkable (no session, or failed turns).
    pub async fn verify_session(&mut self) -> anyhow::Result<Option<bool>> {
        let (Some(id), Some(token)) = (&self.session.id, &self.session.token) else {
            return Ok(None);
        };
        if self.session.failed_turns > 0 {
            return Ok(None);
        }
        let u = uri(&format!("/v1/sessions/{id}"))?;
        let resp = self.conn.get(&u, Some(token)).await?;
        if resp.status != StatusCode::OK {
            bail!("GET /v1/sessions/{id}: {}", resp.describe());
        }
        let v = resp.json()?;
        let steps = v
            .get("step_count")
            .and_then(serde_json::Value::as_u64)
            .context("no step_count in the session view")?;
        Ok(Some(steps == self.session.ok_turns))
    }
}
