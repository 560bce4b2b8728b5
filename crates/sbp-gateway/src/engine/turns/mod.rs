//! Turns (`POST /v1/chat/completions`): an Idempotency-Key's replay or retry, which session the
//! request continues (new, by token, explicit resume, or a 202 for a suspended one), which of its
//! messages are new, and the turn's first write (`begin_turn`). The turn itself — the agent loop,
//! streaming and the final write — runs as its own task (`agent.rs`), so a caller that disconnects
//! cannot cancel it half-persisted.

mod agent;
mod chunks;
mod passthrough;
mod transcript;

use std::sync::Arc;

use bytes::Bytes;
use chrono::Utc;
use sbp_llm::Provider;
use sbp_protocol::{
    ChatMessage, ChatRequest, SbpRequestOptions, SbpResponseMeta, SessionStatus, SnapshotKind,
};
use sbp_store::{
    BeginTurn, IdempotencyRecord, IdempotencyState, MessageJson, MessageRecord, NewIdempotency,
    NewMessage, NewSession, NewSnapshot, SessionRecord, Store, StoreError, Timestamp,
};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use super::connections::Attachment;
use super::federation::Federation;
use super::history::{Cached, History, HistoryCache};
use super::replicas::Replicas;
use super::sessions::{Sessions, new_agent_id};
use super::surfaces::render::shape_request;
use super::tasks::Tasks;
use super::tools::Tools;
use crate::auth;
use crate::config::GatewayConfig;
use crate::error::{Error, TurnSession, parse_uuid};
use crate::limits::Size;
use crate::metrics::{Metrics, Timed as _};
use sbp_protocol::time::iso;

/// A completion request, parsed at the edge.
pub struct ChatInput {
    pub request: ChatRequest,
    /// `X-Session-Token`.
    pub session_token: Option<String>,
    /// `X-Agent-ID`.
    pub agent_id: Option<String>,
    pub idempotency: Option<IdempotencyKey>,
    /// The caller authenticated with an operator API key.
    pub operator: bool,
    /// `X-SBP-Auto-Resume: true`: resume a suspended session (as `sbp.auto_resume`).
    pub auto_resume: bool,
    /// The caller is an OpenAI client (an SDK, or its session token sent as the SDK's
    /// `api_key`): it reads any 2xx as a completion, so the spec's 202 would break it.
    pub openai_client: bool,
}

pub use super::sessions::IdempotencyKey;

/// One server-sent event of a streamed completion.
#[derive(Debug)]
pub enum SseEvent {
    Data(Value),
    /// The turn failed after streaming began.
    Failed(Error),
    Done,
}

/// What a completion request came to.
pub enum ChatOutcome {
    /// A completed turn: the completion body with its `sbp` block.
    Completed { body: Value, session: TurnSession },
    /// The request of this Idempotency-Key completed before; its stored response.
    Replayed {
        status: u16,
        body: Value,
        session_id: Uuid,
        /// The session's token, when that request created the session.
        new_token: Option<String>,
        /// For a streamed request, the stored reply as the chunks of a stream.
        chunks: Option<Vec<Value>>,
    },
    /// SPEC 6.3: the session is suspended and the caller did not ask to resume it.
    ResumeAvailable {
        meta: SbpResponseMeta,
        session: TurnSession,
    },
    /// Strict mode without `sbp` or a token: the upstream's answer as JSON bytes (an
    /// OpenAI-compatible upstream's own, as they came), nothing stored.
    Proxied(Bytes),
    /// `stream: true`: the first event now, then the rest (`session` is `None` when proxied).
    Stream {
        session: Option<TurnSession>,
        first: SseEvent,
        events: mpsc::Receiver<SseEvent>,
    },
}

enum Resolved {
    Existing(SessionRecord),
    New { agent_id: String },
    ResumeAvailable(SessionRecord),
}

/// What an Idempotency-Key says about a request.
enum Keyed {
    Unkeyed,
    /// Not seen before: the turn claims it.
    Fresh {
        key: String,
        scoped: String,
        fingerprint: String,
    },
    /// It failed before: it runs again, in its session, with nothing new stored.
    Retry {
        key: String,
        record: IdempotencyRecord,
    },
}

/// The session a request runs in and its messages, decided before anything is written.
struct Opening {
    session_id: Uuid,
    /// The session to create with the turn, when the request starts one.
    create: Option<NewSession>,
    created_token: Option<String>,
    history: Arc<History>,
    /// The request's messages that are new to the transcript.
    new_messages: Vec<ChatMessage>,
}

/// What the request asks of its turn, besides its messages.
struct Plan {
    /// The upstream request (model set; `stream` and `sbp` taken out).
    request: ChatRequest,
    model: String,
    client_stream: bool,
    /// `stream_options.include_usage`: the stream ends with a usage chunk.
    include_usage: bool,
    checkpoint_every: u32,
}

/// What a turn task needs, owned.
struct Turn {
    session: SessionRecord,
    /// This turn's request created the session: if the turn fails before its caller is told of
    /// it (`told`), nothing of it is kept.
    creates_session: bool,
    /// A streamed event (with the session's headers) went to the caller.
    told: std::sync::atomic::AtomicBool,
    created_token: Option<String>,
    turn_id: Uuid,
    /// The upstream request: the whole transcript, the model, shaped for the surface (taken by
    /// the agent loop when the turn runs).
    request: ChatRequest,
    model: String,
    client_stream: bool,
    include_usage: bool,
    checkpoint_every: u32,
    last_task: Option<String>,
    /// The (scoped) Idempotency-Key this turn holds.
    idempotency_key: Option<String>,
    /// The session's surface when the turn starts (here or on another replica).
    surface: Option<Attachment>,
}

impl Turn {
    fn session(&self) -> TurnSession {
        TurnSession {
            id: self.session.id,
            agent_id: self.session.agent_id.clone(),
            new_token: self.created_token.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Turns {
    inner: Arc<Shared>,
}

struct Shared {
    store: Arc<dyn Store>,
    provider: Arc<dyn Provider>,
    config: Arc<GatewayConfig>,
    federation: Federation,
    replicas: Replicas,
    sessions: Sessions,
    tools: Tools,
    metrics: Arc<Metrics>,
    tasks: Tasks,
    history: Arc<HistoryCache>,
}

impl Turns {
    #[allow(clippy::too_many_arguments)] // One per dependency; a struct would only rename them.
    pub fn new(
        store: Arc<dyn Store>,
        provider: Arc<dyn Provider>,
        config: Arc<GatewayConfig>,
        federation: Federation,
        replicas: Replicas,
        sessions: Sessions,
        tools: Tools,
        metrics: Arc<Metrics>,
        tasks: Tasks,
        history: Arc<HistoryCache>,
    ) -> Self {
        Self {
            inner: Arc::new(Shared {
                store,
                provider,
                config,
                federation,
                replicas,
                sessions,
                tools,
                metrics,
                tasks,
                history,
            }),
        }
    }

    /// The models a completion may name (`GET /v1/models`): what the upstream (and each routed
    /// provider) lists.
    pub async fn models(&self) -> Result<Vec<Value>, Error> {
        self.inner.provider.models().await.map_err(Error::Upstream)
    }

    pub async fn chat(&self, input: ChatInput) -> Result<ChatOutcome, Error> {
        let ChatInput {
            mut request,
            session_token,
            agent_id,
            idempotency,
            operator,
            auto_resume,
            openai_client,
        } = input;
        let opts = request.sbp.take();
        let client_stream = request.wants_stream();
        request.stream = None;
        let model = request
            .model
            .clone()
            .unwrap_or_else(|| self.inner.config.default_model.clone());
        request.model = Some(model.clone());
        let token = session_token.or_else(|| opts.as_ref().and_then(|o| o.session_token.clone()));
        if self.inner.config.strict_sbp && opts.is_none() && token.is_none() {
            return self.passthrough(request, client_stream).await;
        }
        // The spec's 202 for a suspended session is for callers that can read it, asking for a
        // whole body: one that sent an `sbp` object, or a plain HTTP client. An OpenAI SDK without
        // one, and every stream (whose SDK loop would just see no chunk), get an error instead.
        let reads_202 = !client_stream && (opts.is_some() || !openai_client);
        let mut opts = opts.unwrap_or_default();
        opts.auto_resume |= auto_resume;
        check_choices(&request)?;
        let include_usage = client_stream
            && request
                .rest
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                == Some(&Value::Bool(true));
        let keyed = match idempotency {
            None => Keyed::Unkeyed,
            Some(k) => match self.idempotency(k, token.as_deref(), operator).await? {
                Ok(keyed) => keyed,
                Err(ChatOutcome::Replayed {
                    status,
                    body,
                    session_id,
                    new_token,
                    ..
                }) if client_stream && status == 200 => {
                    // A streamed request's retry gets a stream again.
                    let chunks = Some(chunks::replayed_chunks(&body, include_usage));
                    return Ok(ChatOutcome::Replayed {
                        status,
                        body,
                        session_id,
                        new_token,
                        chunks,
                    });
                }
                Err(replay) => return Ok(replay),
            },
        };
        let resolved = match &keyed {
            Keyed::Retry { record, .. } => {
                Resolved::Existing(self.inner.sessions.get(record.session_id).await?)
            }
            _ => {
                self.resolve(token.as_deref(), &opts, agent_id, operator)
                    .await?
            }
        };
        let now = Utc::now();
        let incoming = std::mem::take(&mut request.messages);
        let opening = match resolved {
            Resolved::ResumeAvailable(s) if reads_202 => return self.resume_available(&s).await,
            Resolved::ResumeAvailable(s) => return Err(suspended(&s)),
            Resolved::New { agent_id } => self.open_new(agent_id, &keyed, incoming, now)?,
            Resolved::Existing(s) => self.open_existing(&s, &keyed, incoming).await?,
        };
        let plan = Plan {
            request,
            model,
            client_stream,
            include_usage,
            checkpoint_every: opts.checkpoint_every.unwrap_or(1),
        };
        let turn = self.begin(opening, keyed, plan, now).await?;
        self.start(turn).await
    }

    /// A session this request creates: its record and token (derived from the Idempotency-Key,
    /// when there is one, so a retry can be given it again); every message is new.
    fn open_new(
        &self,
        agent_id: String,
        keyed: &Keyed,
        incoming: Vec<ChatMessage>,
        now: Timestamp,
    ) -> Result<Opening, Error> {
        let id = Uuid::now_v7();
        self.check_room(id, Size::default(), &incoming)?;
        let token = match keyed {
            Keyed::Fresh { key, .. } => {
                auth::idempotent_session_token(&self.inner.config.secret, &id, key)
            }
            _ => auth::new_session_token(),
        };
        let create = NewSession {
            id,
            agent_id,
            token_hash: auth::hash_token(&token),
            created_at: now,
            metadata: json!({}),
        };
        Ok(Opening {
            session_id: id,
            create: Some(create),
            created_token: Some(token),
            history: Arc::default(),
            new_messages: incoming,
        })
    }

    /// Refuses a turn whose new messages and reply (one message) would take the transcript past
    /// the session limits. Its tool rounds may still go past them: the next turn is refused.
    fn check_room(&self, id: Uuid, have: Size, new: &[ChatMessage]) -> Result<(), Error> {
        let mut add = Size::of(new.iter().map(ChatMessage::as_value));
        add.messages += 1;
        self.inner.config.limits.check_room(id, have, add)
    }

    /// A session this request continues: its history, and which of the request's messages are
    /// new to it (none for a retry, whose messages were stored by the failed attempt).
    async fn open_existing(
        &self,
        s: &SessionRecord,
        keyed: &Keyed,
        mut incoming: Vec<ChatMessage>,
    ) -> Result<Opening, Error> {
        let have = Size {
            messages: s.message_count,
            bytes: s.message_bytes,
        };
        // A full session is refused before its whole transcript is read.
        self.check_room(s.id, have, &[])?;
        let history = self.history(s).await?;
        let new_messages = match keyed {
            Keyed::Retry { .. } => Vec::new(),
            _ => incoming.split_off(transcript::new_start(&history, &incoming)),
        };
        self.check_room(s.id, have, &new_messages)?;
        // A retried request that created its session gets that session's token again.
        let created_token = match keyed {
            Keyed::Retry { key, record } if record.created_session => Some(
                auth::idempotent_session_token(&self.inner.config.secret, &s.id, key),
            ),
            _ => None,
        };
        Ok(Opening {
            session_id: s.id,
            create: None,
            created_token,
            history,
            new_messages,
        })
    }

    /// The session's transcript: what the cache holds of it, and from the store what it lacks
    /// (all of it, or what was appended since, here by a backend or on another replica).
    async fn history(&self, s: &SessionRecord) -> Result<Arc<History>, Error> {
        let cache = &self.inner.history;
        let mut history = match cache.get(s.id, s.message_count, s.message_bytes) {
            Cached::Whole(h) => {
                self.inner.metrics.history_cache_hits.inc();
                return Ok(h);
            }
            Cached::Prefix(h) => Arc::unwrap_or_clone(h),
            Cached::Nothing => History::default(),
        };
        self.inner.metrics.history_cache_misses.inc();
        let records = match (history.len() as u64).checked_sub(1) {
            None => self.inner.store.history(s.id).await?,
            after => {
                self.inner
                    .store
                    .list_messages(s.id, after, u32::MAX)
                    .await?
            }
        };
        history.extend_records(&records);
        let history = Arc::new(history);
        cache.put(s.id, history.clone());
        Ok(history)
    }

    /// The messages at `from..to` of the transcript, read after they were missed; none (as before
    /// the cache) if the store cannot say, since the turn is under way.
    async fn missed(&self, session: Uuid, from: u64, to: u64) -> Vec<MessageRecord> {
        let limit = u32::try_from(to - from).unwrap_or(u32::MAX);
        match self
            .inner
            .store
            .list_messages(session, from.checked_sub(1), limit)
            .await
        {
            Ok(records) => records,
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "reading messages appended during a turn's start failed; the upstream is sent the transcript as read");
                Vec::new()
            }
        }
    }

    /// The turn's first write (`begin_turn`: the session if new, the new messages, status,
    /// pre_action snapshot, the Idempotency-Key's claim), then the turn as its task will run it:
    /// the whole transcript, shaped for the surface attached now.
    async fn begin(
        &self,
        opening: Opening,
        keyed: Keyed,
        plan: Plan,
        now: Timestamp,
    ) -> Result<Turn, Error> {
        let Opening {
            session_id,
            create,
            created_token,
            history,
            new_messages,
        } = opening;
        let Plan {
            mut request,
            model,
            client_stream,
            include_usage,
            checkpoint_every,
        } = plan;
        let last_task = transcript::last_task(&new_messages);
        let turn_id = Uuid::now_v7();
        let created = create.is_some();
        let (idempotency, retry_key, store_key) = match keyed {
            Keyed::Fresh {
                scoped,
                fingerprint,
                ..
            } => (
                Some(NewIdempotency {
                    key: scoped.clone(),
                    fingerprint,
                    created_session: created,
                }),
                None,
                Some(scoped),
            ),
            Keyed::Retry { record, .. } => (None, Some(record.key.clone()), Some(record.key)),
            Keyed::Unkeyed => (None, None, None),
        };
        let begin = BeginTurn {
            session_id,
            turn_id,
            create,
            // Serialised once, and the parsed messages let go before the store's writer is
            // waited for: the text is what the store writes and hands back, the cache keeps and
            // the upstream is sent.
            new_messages: new_messages
                .into_iter()
                .map(|m| NewMessage {
                    role: stored_role(&m).to_owned(),
                    body: MessageJson::new(m.as_value()),
                    model_used: None,
                    cost_usd: None,
                    created_at: now,
                })
                .collect(),
            status: Some(SessionStatus::Running),
            last_task: last_task.clone(),
            model: Some(model.clone()),
            pre_action: Some(NewSnapshot {
                id: Uuid::now_v7(),
                kind: SnapshotKind::PreAction,
                model: Some(model.clone()),
                current_task: last_task.clone(),
                created_at: now,
                state: json!({"action": "llm_call", "turn_id": turn_id}),
            }),
            idempotency,
            retry_key,
            owner: Some(self.inner.config.replica_id.clone()),
            now,
        };
        let outcome = self
            .inner
            .store
            .begin_turn(begin)
            .timed(&self.inner.metrics, "begin_turn")
            .await
            .map_err(|e| match e {
                StoreError::Conflict(kind) if kind.is_idempotency() => {
                    Error::conflict("a request with this Idempotency-Key is still in progress")
                }
                StoreError::Conflict(_) => {
                    Error::conflict("the session's state does not allow a new turn")
                }
                other => other.into(),
            })?;
        if created {
            self.inner.metrics.sessions_created.inc();
        }
        let new_messages = outcome.new_messages;
        // The stored transcript goes as it is kept: its chunks are shared, not copied.
        let mut prior = history.prior().clone();
        let read = history.len() as u64;
        // Let go of the cache's transcript before appending to it, so it is not copied.
        drop(history);
        let first_seq = outcome
            .session
            .message_count
            .saturating_sub(new_messages.len() as u64);
        // The cache learns the new messages where the store put them (a new session's are its
        // whole transcript). It takes them only where its entry ends, so what it hands back is
        // the whole transcript as stored.
        let appended = if created {
            let mut whole = History::default();
            whole.extend(written(&new_messages));
            let whole = Arc::new(whole);
            self.inner.history.put(session_id, whole.clone());
            Some(whole)
        } else {
            self.inner
                .history
                .extend(session_id, first_seq, written(&new_messages))
        };
        // The request sends the new messages as the text the cache now holds (shared).
        request.prior = match appended {
            Some(whole) => whole.prior().clone(),
            None => {
                if first_seq > read {
                    // Another writer (a backend's push, another replica) appended between the
                    // read of the transcript and this write: the model gets those messages too,
                    // where they are.
                    for m in self.missed(session_id, read, first_seq).await {
                        prior.push(&m.role, &m.body);
                    }
                }
                for (role, json) in written(&new_messages) {
                    prior.push_json(role, json);
                }
                prior
            }
        };
        let surface = self.inner.replicas.locate(session_id).await;
        if let Some(att) = &surface {
            shape_request(&att.surface, &mut request);
        }
        Ok(Turn {
            session: outcome.session,
            created_token,
            turn_id,
            request,
            model,
            client_stream,
            include_usage,
            checkpoint_every,
            last_task,
            idempotency_key: store_key,
            surface,
            creates_session: created,
            told: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Runs the turn on its own task (a caller that goes away cannot cancel it half-persisted)
    /// and answers when it is done, or, streaming, with its first event.
    async fn start(&self, turn: Turn) -> Result<ChatOutcome, Error> {
        let session = turn.session();
        let turns = self.clone();
        if turn.client_stream {
            let (tx, mut rx) = mpsc::channel(256);
            self.inner
                .tasks
                .spawn(async move { turns.run_turn(turn, Some(tx)).await });
            let first = rx.recv().await.unwrap_or(SseEvent::Done);
            if let SseEvent::Failed(err) = first {
                return Err(err);
            }
            return Ok(ChatOutcome::Stream {
                session: Some(session),
                first,
                events: rx,
            });
        }
        let (tx, rx) = oneshot::channel();
        self.inner.tasks.spawn(async move {
            let _ = tx.send(turns.run_turn(turn, None).await);
        });
        let body = rx
            .await
            .map_err(|_| Error::internal("running a turn", "turn task ended early"))??;
        Ok(ChatOutcome::Completed { body, session })
    }

    /// Looks the key up (scoped to the caller): `Err` carries the stored response to replay.
    async fn idempotency(
        &self,
        k: IdempotencyKey,
        token: Option<&str>,
        operator: bool,
    ) -> Result<Result<Keyed, ChatOutcome>, Error> {
        k.check()?;
        let IdempotencyKey { key, fingerprint } = k;
        let scoped = scoped_idempotency_key(&key, token, operator);
        let Some(record) = self.inner.store.get_idempotency(&scoped).await? else {
            return Ok(Ok(Keyed::Fresh {
                key,
                scoped,
                fingerprint,
            }));
        };
        if fingerprint != record.fingerprint {
            return Err(Error::IdempotencyKeyReused);
        }
        match record.state {
            IdempotencyState::Done => Ok(Err(self.replay(&record, &key).await)),
            IdempotencyState::InProgress => Err(Error::conflict(
                "a request with this Idempotency-Key is still in progress",
            )),
            IdempotencyState::Failed => Ok(Ok(Keyed::Retry { key, record })),
        }
    }

    async fn resolve(
        &self,
        token: Option<&str>,
        opts: &SbpRequestOptions,
        agent_header: Option<String>,
        operator: bool,
    ) -> Result<Resolved, Error> {
        let named = match &opts.session_id {
            Some(raw) => Some(parse_uuid(raw)?),
            None => None,
        };
        let explicit_resume = named.is_some() || opts.resume || opts.auto_resume;
        let trusted = operator || self.inner.config.insecure_no_session_auth;
        if let Some(token) = token {
            let session = self
                .inner
                .sessions
                .by_token(token)
                .await?
                .ok_or_else(|| Error::forbidden("session token not recognised"))?;
            if named.is_some_and(|n| n != session.id) {
                return Err(Error::forbidden(
                    "the session token belongs to another session",
                ));
            }
            self.inner.sessions.admit(session.id)?;
            self.inner.federation.guard(session.id).await?;
            if opts.force_new_session {
                return Ok(Resolved::New {
                    agent_id: session.agent_id,
                });
            }
            return continue_session(session, explicit_resume);
        }
        if let Some(id) = named {
            let session = self.inner.sessions.get(id).await?;
            if !trusted {
                return Err(Error::Unauthorized(
                    "continuing a session needs its token in X-Session-Token or sbp.session_token"
                        .into(),
                ));
            }
            self.inner.sessions.admit(session.id)?;
            self.inner.federation.guard(session.id).await?;
            if opts.force_new_session {
                return Ok(Resolved::New {
                    agent_id: session.agent_id,
                });
            }
            return continue_session(session, true);
        }
        if let Some(agent) = &agent_header
            && !opts.force_new_session
            && trusted
            && let Some(s) = self.inner.store.latest_suspended_for_agent(agent).await?
        {
            self.inner.federation.guard(s.id).await?;
            return continue_session(s, opts.resume || opts.auto_resume);
        }
        Ok(Resolved::New {
            agent_id: agent_header.unwrap_or_else(new_agent_id),
        })
    }

    /// SPEC 6.3: what the caller needs to resume the suspended session.
    async fn resume_available(&self, s: &SessionRecord) -> Result<ChatOutcome, Error> {
        let snap = self.inner.sessions.recovery_snapshot(s.id).await?;
        let prompt = match &s.last_task {
            Some(task) => format!("You were last working on: {task} (step {}).", s.step_count),
            None => format!(
                "You have a suspended session with {} completed steps.",
                s.step_count
            ),
        };
        let meta = SbpResponseMeta {
            session_id: s.id.to_string(),
            snapshot_id: snap.as_ref().map(|x| x.id.to_string()),
            resume_available: true,
            resume_prompt: Some(prompt),
            last_checkpoint: snap.as_ref().map(|x| iso(&x.created_at)),
            step_count: s.step_count,
            agent_id: Some(s.agent_id.clone()),
            status: Some(s.status.as_str().to_owned()),
            ..Default::default()
        };
        Ok(ChatOutcome::ResumeAvailable {
            meta,
            session: TurnSession {
                id: s.id,
                agent_id: s.agent_id.clone(),
                new_token: None,
            },
        })
    }

    /// The stored response of a completed request, with the session's token again when that
    /// request created the session.
    async fn replay(&self, rec: &IdempotencyRecord, key: &str) -> ChatOutcome {
        let mut body = rec.response_body.clone().unwrap_or(Value::Null);
        let new_token = match rec.created_session {
            true => Some(self.replayed_token(rec.session_id, key).await),
            false => None,
        };
        if let Some(token) = &new_token
            && let Some(sbp) = body.get_mut("sbp").and_then(Value::as_object_mut)
        {
            sbp.insert("session_token".into(), Value::String(token.clone()));
        }
        ChatOutcome::Replayed {
            status: rec.response_status.unwrap_or(200),
            body,
            session_id: rec.session_id,
            new_token,
            chunks: None,
        }
    }

    /// The token a session created under `key` was given: derived from the signing secret, so
    /// after a rotation it may come from a previous one (the one whose token the session holds).
    async fn replayed_token(&self, session: Uuid, key: &str) -> String {
        let config = &self.inner.config;
        let current = auth::idempotent_session_token(&config.secret, &session, key);
        if config.previous_secrets.is_empty() {
            return current;
        }
        if let Ok(Some(s)) = self.inner.store.get_session(session).await {
            for secret in config.previous_secrets.iter() {
                let older = auth::idempotent_session_token(secret, &session, key);
                if auth::token_matches(&older, &s.token_hash) {
                    return older;
                }
            }
        }
        current
    }
}

/// Messages as written: (role column, body's JSON text).
fn written(messages: &[NewMessage]) -> impl Iterator<Item = (&str, &str)> {
    messages.iter().map(|m| (m.role.as_str(), m.body.as_str()))
}

/// A message's role column: a message without a role is the user's.
fn stored_role(message: &ChatMessage) -> &str {
    message.role().unwrap_or("user")
}

/// The key an Idempotency-Key is stored under: scoped to the caller's credentials, so only the
/// caller that made a request can replay its response (or retry it in its session). Without a
/// session token the scope is shared by every anonymous (or every operator) caller: a request that
/// creates a session has no other identity, so its key must be unguessable (a UUID).
fn scoped_idempotency_key(key: &str, token: Option<&str>, operator: bool) -> String {
    let scope = match (token, operator) {
        (Some(t), _) => format!("token:{}", auth::hash_token(t)),
        (None, true) => "operator".to_owned(),
        (None, false) => "anonymous".to_owned(),
    };
    auth::sha256_hex(format!("{scope}\n{key}").as_bytes())
}

/// One reply per turn is stored: `n` > 1 (several choices) is refused on a stateful turn; it passes
/// through only in strict pass-through mode, where nothing is stored.
fn check_choices(request: &ChatRequest) -> Result<(), Error> {
    let invalid = |message: &str| Error::InvalidField {
        param: "n".into(),
        message: message.into(),
    };
    match request.rest.get("n") {
        None | Some(Value::Null) => Ok(()),
        Some(n) => match n.as_u64() {
            Some(1) => Ok(()),
            Some(2..=128) => Err(invalid(
                "`n` > 1 is not supported on a stateful turn (one reply per turn is stored); send n: 1, or no sbp object and no session token to a gateway started with --strict-sbp",
            )),
            _ => Err(invalid("`n` must be an integer from 1 to 128")),
        },
    }
}

/// A suspended session's turn refused for a caller that cannot read the spec's 202 (an OpenAI SDK
/// would take it for a completion without choices; a stream would just end).
fn suspended(s: &SessionRecord) -> Error {
    Error::SessionSuspended {
        session_id: s.id,
        message: format!(
            "session {} is suspended (step {}); to resume it, send \"sbp\": {{\"resume\": true}} (extra_body in the OpenAI SDKs) or the header X-SBP-Auto-Resume: true (default_headers); to start a new session, send \"sbp\": {{\"force_new_session\": true}}",
            s.id, s.step_count
        ),
    }
}

fn continue_session(session: SessionRecord, explicit_resume: bool) -> Result<Resolved, Error> {
    match session.status {
        SessionStatus::Suspended if !explicit_resume => Ok(Resolved::ResumeAvailable(session)),
        SessionStatus::Completed | SessionStatus::Failed => Err(Error::SessionEnded(format!(
            "session {} is {}; send sbp.force_new_session: true to start a new one",
            session.id, session.status
        ))),
        _ => Ok(Resolved::Existing(session)),
    }
}
