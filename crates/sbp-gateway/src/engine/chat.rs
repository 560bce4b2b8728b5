//! `POST /v1/chat/completions`: resolve the session (new, by token, resume, 202), work out which
//! messages are new, persist them, call the upstream (streaming to an attached surface and/or the
//! HTTP caller), persist the reply with its snapshots and tether entry, then answer. The turn runs
//! as its own task, so a caller that disconnects does not cancel it half-persisted.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use chrono::Utc;
use futures::StreamExt;
use sbp_llm::{Assembler, LlmError, content_text};
use sbp_protocol::{ErrorCode, SbpRequestOptions, SbpResponseMeta, SessionStatus, SnapshotKind};
use sbp_store::{
    BeginTurn, FailTurn, FinishTurn, IdempotencyRecord, IdempotencyState, MessageRecord,
    NewIdempotency, NewMessage, NewSession, NewSnapshot, NewTetherEntry, SessionRecord,
    TurnProgress,
};
use serde_json::{Map, Value, json};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use super::hub::{Attachment, LiveSink, TurnDone};
use super::sessions::new_agent_id;
use super::tools::{Catalog, ToolRun, ToolTarget};
use super::{Gateway, iso};
use crate::auth;
use crate::error::ApiError;

const MAX_TASK_CHARS: usize = 200;
const MAX_IDEMPOTENCY_KEY: usize = 255;

pub struct ChatInput {
    pub body: Map<String, Value>,
    /// `X-Session-Token`.
    pub session_token: Option<String>,
    /// `X-Agent-ID`.
    pub agent_id: Option<String>,
    pub idempotency_key: Option<String>,
    /// The caller authenticated with an operator API key.
    pub operator: bool,
}

/// A finished HTTP answer.
#[derive(Debug)]
pub struct ChatReply {
    pub status: u16,
    pub body: Value,
    pub headers: Vec<(&'static str, String)>,
}

/// One server-sent event of a streamed completion.
#[derive(Debug)]
pub enum SseEvent {
    Data(Value),
    /// The turn failed after streaming began.
    Failed(ApiError),
    Done,
}

pub enum ChatOutcome {
    Reply(ChatReply),
    /// `stream: true`: headers now, then the events.
    Stream {
        headers: Vec<(&'static str, String)>,
        first: SseEvent,
        events: mpsc::Receiver<SseEvent>,
    },
}

enum Resolved {
    Existing(SessionRecord),
    New { agent_id: String },
    ResumeAvailable(SessionRecord),
}

/// What a turn task needs, owned.
struct Turn {
    session: SessionRecord,
    created_token: Option<String>,
    turn_id: Uuid,
    body: Map<String, Value>,
    model: String,
    client_stream: bool,
    checkpoint_every: u32,
    last_task: Option<String>,
    idempotency_key: Option<String>,
    /// The session's surface when the turn starts (here or on another replica).
    surface: Option<Attachment>,
}

impl Gateway {
    pub async fn chat(&self, mut input: ChatInput) -> Result<ChatOutcome, ApiError> {
        // Only a request with an Idempotency-Key needs the fingerprint of its body.
        let fingerprint = input.idempotency_key.as_ref().map(|_| {
            auth::sha256_hex(
                serde_json::to_string(&input.body)
                    .unwrap_or_default()
                    .as_bytes(),
            )
        });
        let opts = match input.body.remove("sbp") {
            Some(v) => SbpRequestOptions::from_value(&v).map_err(ApiError::bad_request)?,
            None => None,
        };
        let messages = validate_messages(&input.body)?;
        let client_stream = match input.body.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::bad_request("`stream` must be a boolean")),
        };
        let model = match input.body.get("model") {
            None | Some(Value::Null) => self.config().default_model.clone(),
            Some(Value::String(m)) if !m.is_empty() => m.clone(),
            Some(_) => return Err(ApiError::bad_request("`model` must be a non-empty string")),
        };
        let token = input
            .session_token
            .take()
            .or_else(|| opts.as_ref().and_then(|o| o.session_token.clone()));
        if self.config().strict_sbp && opts.is_none() && token.is_none() {
            return self.passthrough(input.body, model, client_stream).await;
        }
        let opts = opts.unwrap_or_default();

        let mut retry: Option<IdempotencyRecord> = None;
        let mut store_key = None;
        if let Some(key) = &input.idempotency_key {
            if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY {
                return Err(ApiError::bad_request(
                    "Idempotency-Key must be 1 to 255 characters",
                ));
            }
            let scoped = scoped_idempotency_key(key, token.as_deref(), input.operator);
            let found = self.store().get_idempotency(&scoped).await?;
            store_key = Some(scoped);
            if let Some(rec) = found {
                if fingerprint.as_deref() != Some(rec.fingerprint.as_str()) {
                    return Err(ApiError::new(
                        ErrorCode::IdempotencyKeyReused,
                        "this Idempotency-Key was used for a different request",
                    ));
                }
                match rec.state {
                    IdempotencyState::Done => {
                        return Ok(ChatOutcome::Reply(self.replay(&rec, key)));
                    }
                    IdempotencyState::InProgress => {
                        return Err(ApiError::conflict(
                            "a request with this Idempotency-Key is still in progress",
                        ));
                    }
                    IdempotencyState::Failed => retry = Some(rec),
                }
            }
        }

        let resolved = match &retry {
            Some(rec) => Resolved::Existing(
                self.store()
                    .get_session(rec.session_id)
                    .await?
                    .ok_or_else(|| ApiError::session_not_found(rec.session_id))?,
            ),
            None => {
                self.resolve(
                    token.as_deref(),
                    &opts,
                    input.agent_id.clone(),
                    input.operator,
                )
                .await?
            }
        };

        let now = Utc::now();
        let (session_id, create, created_token, history, new_messages) = match resolved {
            Resolved::ResumeAvailable(s) => {
                return Ok(ChatOutcome::Reply(self.resume_available(&s).await?));
            }
            Resolved::New { agent_id } => {
                let id = Uuid::now_v7();
                let token = match &input.idempotency_key {
                    Some(key) => auth::idempotent_session_token(&self.config().secret, &id, key),
                    None => auth::new_session_token(),
                };
                let new = NewSession {
                    id,
                    agent_id,
                    token_hash: auth::hash_token(&token),
                    created_at: now,
                    metadata: json!({}),
                };
                (id, Some(new), Some(token), Vec::new(), messages)
            }
            Resolved::Existing(s) => {
                let history = self.store().history(s.id).await?;
                let new = if retry.is_some() {
                    Vec::new()
                } else {
                    new_part(&history, &messages)
                };
                // A retried request that created its session gets that session's token again.
                let token = match (&retry, &input.idempotency_key) {
                    (Some(rec), Some(key)) if rec.created_session => Some(
                        auth::idempotent_session_token(&self.config().secret, &s.id, key),
                    ),
                    _ => None,
                };
                (s.id, None, token, history, new)
            }
        };

        let last_task = new_messages
            .iter()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
            .and_then(|m| m.get("content"))
            .and_then(content_text)
            .map(|t| truncate_chars(t.trim(), MAX_TASK_CHARS))
            .filter(|t| !t.is_empty());
        let turn_id = Uuid::now_v7();
        let created = create.is_some();
        let begin = BeginTurn {
            session_id,
            turn_id,
            create,
            new_messages: new_messages
                .iter()
                .map(|m| NewMessage {
                    role: m
                        .get("role")
                        .and_then(Value::as_str)
                        .unwrap_or("user")
                        .to_owned(),
                    body: m.clone(),
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
            idempotency: match (&store_key, &retry, fingerprint) {
                (Some(key), None, Some(fingerprint)) => Some(NewIdempotency {
                    key: key.clone(),
                    fingerprint,
                    created_session: created,
                }),
                _ => None,
            },
            retry_key: retry.as_ref().map(|r| r.key.clone()),
            owner: Some(self.config().replica_id.clone()),
            now,
        };
        let outcome = self.store().begin_turn(begin).await.map_err(|e| match e {
            sbp_store::StoreError::Conflict(m) if m.contains("idempotency") => {
                ApiError::conflict("a request with this Idempotency-Key is still in progress")
            }
            sbp_store::StoreError::Conflict(_) => {
                ApiError::conflict("the session's state does not allow a new turn")
            }
            other => other.into(),
        })?;
        if created {
            self.metrics().sessions_created.fetch_add(1, Relaxed);
        }

        let mut upstream = input.body;
        upstream.insert("model".into(), Value::String(model.clone()));
        upstream.remove("stream");
        let mut all: Vec<Value> = history.into_iter().map(|m| m.body).collect();
        all.extend(new_messages);
        upstream.insert("messages".into(), Value::Array(all));
        let surface = self.locate(session_id).await;
        self.shape_for_surface(surface.as_ref(), &mut upstream);

        let turn = Turn {
            session: outcome.session,
            created_token,
            turn_id,
            body: upstream,
            model,
            client_stream,
            checkpoint_every: opts.checkpoint_every.unwrap_or(1),
            last_task,
            idempotency_key: store_key,
            surface,
        };
        let headers = session_headers(&turn.session, turn.created_token.as_deref());
        if client_stream {
            let (tx, mut rx) = mpsc::channel(256);
            let gw = self.clone();
            self.spawn(async move { gw.run_turn(turn, Some(tx)).await });
            let first = rx.recv().await.unwrap_or(SseEvent::Done);
            if let SseEvent::Failed(err) = first {
                return Err(err);
            }
            return Ok(ChatOutcome::Stream {
                headers,
                first,
                events: rx,
            });
        }
        let (tx, rx) = oneshot::channel();
        let gw = self.clone();
        self.spawn(async move {
            let _ = tx.send(gw.run_turn(turn, None).await);
        });
        let reply = rx
            .await
            .map_err(|_| ApiError::internal("running a turn", "turn task ended early"))??;
        Ok(ChatOutcome::Reply(reply))
    }

    async fn resolve(
        &self,
        token: Option<&str>,
        opts: &SbpRequestOptions,
        agent_header: Option<String>,
        operator: bool,
    ) -> Result<Resolved, ApiError> {
        let named = match &opts.session_id {
            Some(raw) => Some(super::parse_uuid(raw)?),
            None => None,
        };
        let explicit_resume = named.is_some() || opts.resume;
        let trusted = operator || self.config().insecure_no_session_auth;
        if let Some(token) = token {
            let session = self
                .store()
                .find_session_by_token(&auth::hash_token(token))
                .await?
                .ok_or_else(|| ApiError::forbidden("session token not recognised"))?;
            if named.is_some_and(|n| n != session.id) {
                return Err(ApiError::forbidden(
                    "the session token belongs to another session",
                ));
            }
            if opts.force_new_session {
                return Ok(Resolved::New {
                    agent_id: session.agent_id,
                });
            }
            return continue_session(session, explicit_resume);
        }
        if let Some(id) = named {
            let session = self
                .store()
                .get_session(id)
                .await?
                .ok_or_else(|| ApiError::session_not_found(id))?;
            if !trusted {
                return Err(ApiError::new(
                    ErrorCode::Unauthorized,
                    "continuing a session needs its token in X-Session-Token or sbp.session_token",
                ));
            }
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
            && let Some(s) = self.store().latest_suspended_for_agent(agent).await?
        {
            return continue_session(s, opts.resume);
        }
        Ok(Resolved::New {
            agent_id: agent_header.unwrap_or_else(new_agent_id),
        })
    }

    /// SPEC 6.3: HTTP 202 describing the suspended session the caller may resume.
    async fn resume_available(&self, s: &SessionRecord) -> Result<ChatReply, ApiError> {
        let snap = self.recovery_snapshot(s.id).await?;
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
        Ok(ChatReply {
            status: 202,
            body: json!({"sbp": meta}),
            headers: session_headers(s, None),
        })
    }

    fn replay(&self, rec: &IdempotencyRecord, key: &str) -> ChatReply {
        let mut body = rec.response_body.clone().unwrap_or(Value::Null);
        let mut headers = vec![
            ("x-session-id", rec.session_id.to_string()),
            ("idempotent-replayed", "true".into()),
        ];
        if rec.created_session {
            let token = auth::idempotent_session_token(&self.config().secret, &rec.session_id, key);
            if let Some(sbp) = body.get_mut("sbp").and_then(Value::as_object_mut) {
                sbp.insert("session_token".into(), Value::String(token.clone()));
            }
            headers.push(("x-session-token", token));
        }
        ChatReply {
            status: rec.response_status.unwrap_or(200),
            body,
            headers,
        }
    }

    /// Runs the upstream call and persists the outcome. With `events`, streams SSE to the caller.
    async fn run_turn(
        &self,
        turn: Turn,
        events: Option<mpsc::Sender<SseEvent>>,
    ) -> Result<ChatReply, ApiError> {
        let result = self.call_upstream(&turn, events.as_ref()).await;
        let outcome = match result {
            Ok(done) => {
                let finished = self.finish(&turn, done).await;
                if let Err(e) = &finished {
                    // The caller may be gone: this log line is then the only trace of it.
                    tracing::error!(session_id = %turn.session.id, turn_id = %turn.turn_id, error = %e.message, "persisting a completed turn failed; its reply is lost");
                }
                finished
            }
            Err(err) => {
                self.metrics().turns_failed.fetch_add(1, Relaxed);
                let fail = FailTurn {
                    session_id: turn.session.id,
                    turn_id: turn.turn_id,
                    error: err.message.clone(),
                    idempotency_key: turn.idempotency_key.clone(),
                    now: Utc::now(),
                };
                if let Err(e) = self.store().fail_turn(fail).await {
                    tracing::error!(session_id = %turn.session.id, error = %e, "recording a failed turn failed");
                }
                let mut err = err;
                let detail = err.detail.get_or_insert_with(|| json!({}));
                if let Some(obj) = detail.as_object_mut() {
                    obj.insert("session_id".into(), json!(turn.session.id));
                }
                err.headers.extend(session_headers(
                    &turn.session,
                    turn.created_token.as_deref(),
                ));
                Err(err)
            }
        };
        if let Some(tx) = events {
            match &outcome {
                Ok(reply) => {
                    let mut last = json!({
                        "id": reply.body.get("id").cloned().unwrap_or(Value::Null),
                        "object": "chat.completion.chunk",
                        "created": reply.body.get("created").cloned().unwrap_or(Value::Null),
                        "model": reply.body.get("model").cloned().unwrap_or(Value::Null),
                        "choices": [],
                    });
                    last["sbp"] = reply.body.get("sbp").cloned().unwrap_or(Value::Null);
                    let _ = tx.send(SseEvent::Data(last)).await;
                    let _ = tx.send(SseEvent::Done).await;
                }
                Err(e) => {
                    let _ = tx.send(SseEvent::Failed(e.clone())).await;
                }
            }
        }
        outcome
    }

    /// The agent loop: calls the upstream with the gateway's tools (surface and southbound MCP)
    /// added to the request; while the reply asks only for those tools, runs them (concurrently),
    /// records the round, and asks again, at most `max_tool_rounds` times. A reply asking for a
    /// tool of the client's own goes back to the client as is.
    async fn call_upstream(
        &self,
        turn: &Turn,
        events: Option<&mpsc::Sender<SseEvent>>,
    ) -> Result<Upstream, ApiError> {
        let mut sink = LiveSink::new(self.hub(), turn.session.id, turn.surface.clone());
        let started = Instant::now();
        let mut body = turn.body.clone();
        let mut usage = UsageSum::default();
        let max_rounds = self.config().max_tool_rounds;
        let mut round = 0;
        loop {
            // The surface may have gone (or come) since the turn started.
            let surface = match round {
                0 => turn.surface.clone(),
                _ => self.locate(turn.session.id).await,
            };
            let catalog = self.catalog(surface.as_ref(), &turn.body);
            if round > 0 {
                sink.new_round();
            }
            let mut request = body.clone();
            catalog.inject(&mut request);
            if round >= max_rounds && !catalog.is_empty() {
                // Out of rounds: the model must answer now.
                request.insert("tool_choice".into(), json!("none"));
            }
            let out = self
                .upstream_round(request, turn, &mut sink, events, !catalog.is_empty())
                .await?;
            usage.add(out.body.get("usage"));
            let calls = match gateway_calls(&out.message, &catalog) {
                Some(calls) if round < max_rounds => calls,
                _ => {
                    self.metrics().upstream_latency.observe(started.elapsed());
                    return Ok(self
                        .last_round(out, round, usage, events, &catalog, &sink)
                        .await);
                }
            };
            self.tool_round(turn, round, &out, calls, &mut body).await?;
            round += 1;
        }
    }

    /// One upstream call, streamed to the surface and/or the SSE caller when either wants it.
    /// With gateway tools on offer (`hide_tools`), the caller's chunks lose their tool-call deltas
    /// and finish reasons: those belong to the loop, and the last round says how the turn ended.
    async fn upstream_round(
        &self,
        mut request: Map<String, Value>,
        turn: &Turn,
        sink: &mut LiveSink<'_>,
        events: Option<&mpsc::Sender<SseEvent>>,
        hide_tools: bool,
    ) -> Result<RoundOut, ApiError> {
        let provider = &self.inner.provider;
        let routed = provider.route_name(&turn.model);
        if !(turn.client_stream || sink.is_live()) {
            let c = provider.complete(request).await.map_err(upstream_error)?;
            return Ok(RoundOut {
                message: c.message,
                model: c.model,
                body: c.body,
                finish_reason: c.finish_reason,
            });
        }
        if !turn.client_stream && !request.contains_key("stream_options") {
            // Streaming for the surface only: without this an OpenAI upstream sends no usage,
            // and the caller, who asked for a plain completion, would get `usage: null`.
            request.insert("stream_options".into(), json!({"include_usage": true}));
        }
        let mut stream = provider.stream(request).await.map_err(upstream_error)?;
        let mut asm = Assembler::default();
        let mut caller_gone = false;
        while let Some(item) = stream.next().await {
            let mut chunk = item.map_err(upstream_error)?;
            if let Some(delta) = asm.push(&chunk) {
                sink.chunk(&delta);
            }
            let Some(tx) = events.filter(|_| !caller_gone) else {
                continue;
            };
            if hide_tools && !strip_loop_fields(&mut chunk) {
                continue;
            }
            caller_gone = tx.send(SseEvent::Data(chunk)).await.is_err();
        }
        let model = asm.model.clone().unwrap_or(routed);
        let finish_reason = asm.finish_reason.clone().unwrap_or_else(|| "stop".into());
        let body = json!({
            "id": asm.id.clone().unwrap_or_else(|| format!("chatcmpl-{}", Uuid::now_v7().simple())),
            "object": "chat.completion",
            "created": Utc::now().timestamp(),
            "model": model,
            "choices": [{"index": 0, "message": asm.message(), "finish_reason": finish_reason}],
            "usage": asm.usage.clone().unwrap_or(Value::Null),
        });
        Ok(RoundOut {
            message: asm.message(),
            model,
            body,
            finish_reason: Some(finish_reason),
        })
    }

    /// The final round becomes the turn's reply; usage is summed over the rounds. An SSE caller
    /// whose chunks had the loop's fields hidden gets them now, in one closing chunk.
    async fn last_round(
        &self,
        out: RoundOut,
        rounds: u32,
        usage: UsageSum,
        events: Option<&mpsc::Sender<SseEvent>>,
        catalog: &Catalog,
        sink: &LiveSink<'_>,
    ) -> Upstream {
        let out = without_gateway_calls(out, catalog);
        let mut body = out.body;
        if rounds > 0
            && let Some(total) = usage.value()
            && let Some(obj) = body.as_object_mut()
        {
            obj.insert("usage".into(), total);
        }
        if let Some(tx) = events
            && !catalog.is_empty()
        {
            let mut delta = Map::new();
            if let Some(calls) = out.message.get("tool_calls").and_then(Value::as_array) {
                let indexed: Vec<Value> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        let mut c = c.clone();
                        c["index"] = json!(i);
                        c
                    })
                    .collect();
                delta.insert("tool_calls".into(), Value::Array(indexed));
            }
            let closing = json!({
                "id": body.get("id").cloned().unwrap_or(Value::Null),
                "object": "chat.completion.chunk",
                "created": body.get("created").cloned().unwrap_or(Value::Null),
                "model": out.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": out.finish_reason.clone().unwrap_or_else(|| "stop".into())}],
                "usage": body.get("usage").cloned().unwrap_or(Value::Null),
            });
            let _ = tx.send(SseEvent::Data(closing)).await;
        }
        Upstream {
            body,
            message: out.message,
            model: out.model,
            chunk_id: sink.chunk_id,
        }
    }

    /// Runs one round of gateway tool calls: a pre_action snapshot per call before anything is
    /// sent, the calls concurrently (each answers, whatever happens to the surface), then the
    /// assistant's tool-call message, the tool messages and a post_action snapshot per call in
    /// one write; the messages join the next request.
    async fn tool_round(
        &self,
        turn: &Turn,
        round: u32,
        out: &RoundOut,
        calls: Vec<LoopCall>,
        body: &mut Map<String, Value>,
    ) -> Result<(), ApiError> {
        let session_id = turn.session.id;
        let snapshot = |kind: SnapshotKind, state: Value| NewSnapshot {
            id: Uuid::now_v7(),
            kind,
            model: Some(turn.model.clone()),
            current_task: turn.last_task.clone(),
            created_at: Utc::now(),
            state,
        };
        let pre = calls
            .iter()
            .map(|c| {
                snapshot(
                    SnapshotKind::PreAction,
                    json!({"action": "tool_call", "turn_id": turn.turn_id, "round": round,
                           "tool_call_id": c.id, "function": c.function, "target": c.target_json(),
                           "arguments": c.arguments}),
                )
            })
            .collect();
        self.store()
            .record_progress(TurnProgress {
                session_id,
                turn_id: turn.turn_id,
                messages: Vec::new(),
                snapshots: pre,
                now: Utc::now(),
            })
            .await?;
        let runs = futures::future::join_all(calls.iter().map(|c| async move {
            match &c.arguments {
                Ok(args) => self.run_tool(session_id, &c.target, args.clone()).await,
                Err(e) => ToolRun {
                    call_id: None,
                    content: json!({"error": e}).to_string(),
                    error: Some(e.clone()),
                },
            }
        }))
        .await;
        let now = Utc::now();
        let mut messages = vec![NewMessage {
            role: "assistant".into(),
            body: out.message.clone(),
            model_used: Some(out.model.clone()),
            cost_usd: None,
            created_at: now,
        }];
        let mut post = Vec::with_capacity(calls.len());
        for (c, run) in calls.iter().zip(&runs) {
            messages.push(NewMessage {
                role: "tool".into(),
                body: json!({"role": "tool", "tool_call_id": c.id, "content": run.content}),
                model_used: None,
                cost_usd: None,
                created_at: now,
            });
            post.push(snapshot(
                SnapshotKind::PostAction,
                json!({"action": "tool_result", "turn_id": turn.turn_id, "round": round,
                       "tool_call_id": c.id, "call_id": run.call_id, "function": c.function,
                       "ok": run.error.is_none(), "error": run.error}),
            ));
        }
        let bodies: Vec<Value> = messages.iter().map(|m| m.body.clone()).collect();
        self.store()
            .record_progress(TurnProgress {
                session_id,
                turn_id: turn.turn_id,
                messages,
                snapshots: post,
                now,
            })
            .await?;
        if let Some(Value::Array(list)) = body.get_mut("messages") {
            list.extend(bodies);
        }
        Ok(())
    }

    async fn finish(&self, turn: &Turn, up: Upstream) -> Result<ChatReply, ApiError> {
        let now = Utc::now();
        let session = &turn.session;
        let text = up.message.get("content").and_then(content_text);
        let post_id = Uuid::now_v7();
        let meta = SbpResponseMeta {
            session_id: session.id.to_string(),
            snapshot_id: Some(post_id.to_string()),
            resume_available: false,
            resume_prompt: None,
            last_checkpoint: Some(iso(&now)),
            step_count: session.step_count + 1,
            cost_usd: None,
            model_routed_to: Some(up.model.clone()),
            agent_id: Some(session.agent_id.clone()),
            status: Some(SessionStatus::Running.as_str().to_owned()),
            session_token: None,
        };
        let mut body = up.body;
        if !body.is_object() {
            body = json!({});
        }
        body["sbp"] = serde_json::to_value(&meta).unwrap_or(Value::Null);
        let snapshot = |id: Uuid, kind: SnapshotKind| NewSnapshot {
            id,
            kind,
            model: Some(up.model.clone()),
            current_task: turn.last_task.clone(),
            created_at: now,
            state: json!({"turn_id": turn.turn_id}),
        };
        // Whether it is tethered is decided by the store at commit time: a surface may have
        // attached (turning the tether on) since this turn began.
        let tether = Some(NewTetherEntry {
            role: "assistant".into(),
            content: text.clone(),
            model_used: Some(up.model.clone()),
            created_at: now,
            chunk_id: up.chunk_id,
        });
        let finish = FinishTurn {
            session_id: session.id,
            turn_id: Some(turn.turn_id),
            messages: vec![NewMessage {
                role: "assistant".into(),
                body: up.message,
                model_used: Some(up.model.clone()),
                cost_usd: None,
                created_at: now,
            }],
            count_step: true,
            post_action: Some(snapshot(post_id, SnapshotKind::PostAction)),
            checkpoint: Some((
                snapshot(Uuid::now_v7(), SnapshotKind::Checkpoint),
                turn.checkpoint_every,
            )),
            tether,
            tether_only_if_enabled: true,
            idempotency_done: turn.idempotency_key.clone().map(|k| (k, 200, body.clone())),
            now,
        };
        let outcome = self.store().finish_turn(finish).await?;
        self.metrics().turns_completed.fetch_add(1, Relaxed);
        if outcome.tether_seq.is_some() {
            self.metrics().tether_enqueued.fetch_add(1, Relaxed);
        }
        body["sbp"]["step_count"] = json!(outcome.session.step_count);
        self.turn_done(
            session.id,
            TurnDone {
                chunk_id: up.chunk_id,
                seq: outcome.tether_seq,
                role: "assistant".into(),
                content: text,
                model_used: Some(up.model),
            },
        )
        .await;
        if let Some(token) = &turn.created_token {
            body["sbp"]["session_token"] = Value::String(token.clone());
        }
        Ok(ChatReply {
            status: 200,
            body,
            headers: session_headers(session, turn.created_token.as_deref()),
        })
    }

    /// Strict mode without `sbp` or a token: a plain proxy, nothing stored.
    async fn passthrough(
        &self,
        mut body: Map<String, Value>,
        model: String,
        stream: bool,
    ) -> Result<ChatOutcome, ApiError> {
        body.insert("model".into(), Value::String(model));
        body.remove("stream");
        let provider = self.inner.provider.clone();
        if !stream {
            let c = provider.complete(body).await.map_err(upstream_error)?;
            return Ok(ChatOutcome::Reply(ChatReply {
                status: 200,
                body: c.body,
                headers: Vec::new(),
            }));
        }
        let mut upstream = provider.stream(body).await.map_err(upstream_error)?;
        let (tx, rx) = mpsc::channel(256);
        self.spawn(async move {
            while let Some(item) = upstream.next().await {
                let ev = match item {
                    Ok(chunk) => SseEvent::Data(chunk),
                    Err(e) => {
                        let _ = tx.send(SseEvent::Failed(upstream_error(e))).await;
                        return;
                    }
                };
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
            let _ = tx.send(SseEvent::Done).await;
        });
        let mut events = rx;
        let first = events.recv().await.unwrap_or(SseEvent::Done);
        if let SseEvent::Failed(err) = first {
            return Err(err);
        }
        Ok(ChatOutcome::Stream {
            headers: Vec::new(),
            first,
            events,
        })
    }
}

/// One upstream call's outcome.
struct RoundOut {
    message: Value,
    model: String,
    body: Value,
    finish_reason: Option<String>,
}

/// A function call of the LLM that the gateway runs.
struct LoopCall {
    /// The LLM's tool_call id.
    id: String,
    function: String,
    target: ToolTarget,
    /// The parsed arguments, or why they could not be parsed.
    arguments: Result<Value, String>,
}

impl LoopCall {
    fn target_json(&self) -> Value {
        match &self.target {
            ToolTarget::Surface(tool) => json!({"surface": tool}),
            ToolTarget::Server { server, tool } => json!({"server": server, "tool": tool}),
        }
    }
}

/// The calls of `message` when every one is a gateway tool; `None` when there are none or any
/// belongs to the client.
fn gateway_calls(message: &Value, catalog: &Catalog) -> Option<Vec<LoopCall>> {
    let calls = message.get("tool_calls")?.as_array()?;
    if calls.is_empty() || catalog.is_empty() {
        return None;
    }
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let function = c.pointer("/function/name")?.as_str()?.to_owned();
            let target = catalog.target(&function)?.clone();
            let raw = c
                .pointer("/function/arguments")
                .and_then(Value::as_str)
                .unwrap_or("");
            let arguments = if raw.trim().is_empty() {
                Ok(json!({}))
            } else {
                serde_json::from_str(raw)
                    .map_err(|e| format!("the arguments are not valid JSON: {e}"))
            };
            let id = c
                .get("id")
                .and_then(Value::as_str)
                .map(str::to_owned)
                .unwrap_or_else(|| format!("call_{i}"));
            Some(LoopCall {
                id,
                function,
                target,
                arguments,
            })
        })
        .collect()
}

/// A final reply keeps only calls the client can answer: gateway calls in a reply that also calls a
/// client tool, or made after the round limit, are dropped (not run). Returned to the client they
/// would stay unanswered in the transcript, which every later request would then be refused for.
fn without_gateway_calls(mut out: RoundOut, catalog: &Catalog) -> RoundOut {
    let Some(calls) = out.message.get("tool_calls").and_then(Value::as_array) else {
        return out;
    };
    let kept: Vec<Value> = calls
        .iter()
        .filter(|c| {
            c.pointer("/function/name")
                .and_then(Value::as_str)
                .is_none_or(|name| catalog.target(name).is_none())
        })
        .cloned()
        .collect();
    if kept.len() == calls.len() {
        return out;
    }
    tracing::warn!(
        dropped = calls.len() - kept.len(),
        "gateway tool calls the loop could not run were dropped from the reply"
    );
    if let Some(msg) = out.message.as_object_mut() {
        if kept.is_empty() {
            msg.remove("tool_calls");
            if msg.get("content").is_none_or(Value::is_null) {
                msg.insert("content".into(), json!(""));
            }
            out.finish_reason = Some("stop".into());
        } else {
            msg.insert("tool_calls".into(), Value::Array(kept));
        }
    }
    if let Some(choice) = out
        .body
        .pointer_mut("/choices/0")
        .and_then(Value::as_object_mut)
    {
        choice.insert("message".into(), out.message.clone());
        choice.insert("finish_reason".into(), json!(out.finish_reason));
    }
    out
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

/// Removes what belongs to the tool loop from a chunk for the SSE caller: tool-call deltas,
/// finish reasons and per-round usage. False when nothing is left worth sending.
fn strip_loop_fields(chunk: &mut Value) -> bool {
    if let Some(obj) = chunk.as_object_mut() {
        obj.remove("usage");
    }
    let Some(choices) = chunk.get_mut("choices").and_then(Value::as_array_mut) else {
        return false;
    };
    let mut keep = false;
    for choice in choices.iter_mut() {
        if let Some(c) = choice.as_object_mut() {
            c.insert("finish_reason".into(), Value::Null);
            if let Some(delta) = c.get_mut("delta").and_then(Value::as_object_mut) {
                delta.remove("tool_calls");
                keep |= delta
                    .get("content")
                    .and_then(Value::as_str)
                    .is_some_and(|t| !t.is_empty())
                    || delta.contains_key("role")
                    || delta.contains_key("refusal");
            }
        }
    }
    keep
}

/// Token usage added up over the rounds of a turn.
#[derive(Default)]
struct UsageSum {
    fields: Map<String, Value>,
    any: bool,
}

impl UsageSum {
    fn add(&mut self, usage: Option<&Value>) {
        let Some(usage) = usage.and_then(Value::as_object) else {
            return;
        };
        self.any = true;
        for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            if let Some(n) = usage.get(key).and_then(Value::as_u64) {
                let prev = self.fields.get(key).and_then(Value::as_u64).unwrap_or(0);
                self.fields.insert(key.into(), json!(prev + n));
            }
        }
    }

    fn value(self) -> Option<Value> {
        self.any.then_some(Value::Object(self.fields))
    }
}

struct Upstream {
    body: Value,
    message: Value,
    model: String,
    chunk_id: Uuid,
}

fn continue_session(session: SessionRecord, explicit_resume: bool) -> Result<Resolved, ApiError> {
    match session.status {
        SessionStatus::Suspended if !explicit_resume => Ok(Resolved::ResumeAvailable(session)),
        SessionStatus::Completed | SessionStatus::Failed => Err(ApiError::conflict(format!(
            "session {} is {}; send sbp.force_new_session: true to start a new one",
            session.id, session.status
        ))),
        _ => Ok(Resolved::Existing(session)),
    }
}

fn session_headers(s: &SessionRecord, created_token: Option<&str>) -> Vec<(&'static str, String)> {
    let mut h = vec![
        ("x-session-id", s.id.to_string()),
        ("x-agent-id", s.agent_id.clone()),
    ];
    if let Some(t) = created_token {
        h.push(("x-session-token", t.to_owned()));
    }
    h
}

fn upstream_error(e: LlmError) -> ApiError {
    match e {
        LlmError::Unreachable(m) => ApiError::new(
            ErrorCode::UpstreamUnreachable,
            format!("the upstream LLM is unreachable: {m}"),
        ),
        LlmError::Timeout => {
            ApiError::new(ErrorCode::UpstreamTimeout, "the upstream LLM timed out")
        }
        LlmError::Status { status, body } => {
            let status = if (400..=599).contains(&status) {
                status
            } else {
                502
            };
            ApiError::new(
                ErrorCode::UpstreamError,
                format!("the upstream LLM answered HTTP {status}"),
            )
            .with_status(status)
            .with_detail(json!({"upstream": body}))
        }
        LlmError::Protocol(m) => ApiError::new(
            ErrorCode::UpstreamError,
            format!("the upstream LLM sent an invalid reply: {m}"),
        ),
    }
}

fn validate_messages(body: &Map<String, Value>) -> Result<Vec<Value>, ApiError> {
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_request("`messages` must be an array"))?;
    if messages.is_empty() {
        return Err(ApiError::bad_request("`messages` must not be empty"));
    }
    for (i, m) in messages.iter().enumerate() {
        if m.get("role").and_then(Value::as_str).is_none() {
            return Err(ApiError::bad_request(format!(
                "messages[{i}] must be an object with a string `role`"
            )));
        }
    }
    Ok(messages.clone())
}

/// The part of `incoming` that is new: clients that resend the whole conversation send the stored
/// history as a prefix; clients that send only new messages do not. System prompts already stored
/// at the start are not stored again either.
fn new_part(history: &[MessageRecord], incoming: &[Value]) -> Vec<Value> {
    let is_prefix = |stored: &[&Value]| {
        !stored.is_empty()
            && incoming.len() >= stored.len()
            && stored.iter().zip(incoming).all(|(h, m)| same_message(h, m))
    };
    let all: Vec<&Value> = history.iter().map(|h| &h.body).collect();
    if is_prefix(&all) {
        return incoming[all.len()..].to_vec();
    }
    // A client never saw the gateway's own tool rounds: it resends the transcript without them.
    let seen = client_view(history);
    if seen.len() < all.len() && is_prefix(&seen) {
        return incoming[seen.len()..].to_vec();
    }
    let mut skip = 0;
    for stored in history.iter().take_while(|h| h.role == "system") {
        match incoming.get(skip) {
            Some(m) if same_message(&stored.body, m) => skip += 1,
            _ => break,
        }
    }
    incoming[skip..].to_vec()
}

/// The transcript as the HTTP client saw it: without the assistant messages that called only gateway
/// tools (`surface_*`, `mcp__*`) and the tool messages answering them.
fn client_view(history: &[MessageRecord]) -> Vec<&Value> {
    let mut gateway_ids: Vec<&str> = Vec::new();
    let mut seen = Vec::with_capacity(history.len());
    for h in history {
        let body = &h.body;
        if h.role == "assistant"
            && let Some(calls) = body.get("tool_calls").and_then(Value::as_array)
            && !calls.is_empty()
            && calls.iter().all(|c| {
                c.pointer("/function/name")
                    .and_then(Value::as_str)
                    .is_some_and(is_gateway_function)
            })
        {
            gateway_ids.extend(
                calls
                    .iter()
                    .filter_map(|c| c.get("id").and_then(Value::as_str)),
            );
            continue;
        }
        if h.role == "tool"
            && body
                .get("tool_call_id")
                .and_then(Value::as_str)
                .is_some_and(|id| gateway_ids.contains(&id))
        {
            continue;
        }
        seen.push(body);
    }
    seen
}

/// Whether a function name is one the gateway offers (its surface and MCP-server tools).
fn is_gateway_function(name: &str) -> bool {
    name.starts_with(super::tools::SURFACE_PREFIX) || name.starts_with(super::tools::SERVER_PREFIX)
}

/// Whether two chat messages say the same thing: role, content (text compared as text), tool calls
/// and tool call id. Vendor extras on stored replies are ignored; absent equals null.
fn same_message(a: &Value, b: &Value) -> bool {
    let field = |v: &Value, k: &str| v.get(k).cloned().unwrap_or(Value::Null);
    if field(a, "role") != field(b, "role") || field(a, "tool_call_id") != field(b, "tool_call_id")
    {
        return false;
    }
    let (ca, cb) = (field(a, "content"), field(b, "content"));
    let content_same = match (content_text(&ca), content_text(&cb)) {
        (Some(x), Some(y)) => x == y,
        _ => ca == cb,
    };
    let calls = |v: &Value| {
        field(v, "tool_calls")
            .as_array()
            .filter(|a| !a.is_empty())
            .cloned()
    };
    content_same && calls(a) == calls(b)
}

fn truncate_chars(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64, v: Value) -> MessageRecord {
        MessageRecord {
            seq,
            role: v["role"].as_str().unwrap_or("user").to_owned(),
            body: v,
            model_used: None,
            cost_usd: None,
            created_at: Utc::now(),
        }
    }

    #[test]
    fn full_resend_keeps_only_the_new_tail() {
        let history = vec![
            rec(0, json!({"role": "system", "content": "be brief"})),
            rec(1, json!({"role": "user", "content": "hi"})),
            rec(
                2,
                json!({"role": "assistant", "content": "hello", "refusal": null}),
            ),
        ];
        let incoming = vec![
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": [{"type": "text", "text": "hi"}]}),
            json!({"role": "assistant", "content": "hello"}),
            json!({"role": "user", "content": "again"}),
        ];
        assert_eq!(
            new_part(&history, &incoming),
            vec![json!({"role": "user", "content": "again"})]
        );
    }

    #[test]
    fn new_message_only_clients_and_repeated_text() {
        let history = vec![
            rec(0, json!({"role": "user", "content": "hi"})),
            rec(1, json!({"role": "assistant", "content": "hello"})),
        ];
        let incoming = vec![json!({"role": "user", "content": "hi"})];
        assert_eq!(new_part(&history, &incoming), incoming);
        assert_eq!(new_part(&[], &incoming), incoming);
    }

    #[test]
    fn stored_system_prompt_is_not_duplicated() {
        let history = vec![
            rec(0, json!({"role": "system", "content": "sys"})),
            rec(1, json!({"role": "user", "content": "a"})),
            rec(2, json!({"role": "assistant", "content": "b"})),
        ];
        let incoming = vec![
            json!({"role": "system", "content": "sys"}),
            json!({"role": "user", "content": "c"}),
        ];
        assert_eq!(
            new_part(&history, &incoming),
            vec![json!({"role": "user", "content": "c"})]
        );
    }

    #[test]
    fn gateway_tool_rounds_are_not_expected_back() {
        let history = vec![
            rec(0, json!({"role": "user", "content": "where am I?"})),
            rec(
                1,
                json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "surface_gps", "arguments": "{}"}}]}),
            ),
            rec(
                2,
                json!({"role": "tool", "tool_call_id": "c1", "content": "{}"}),
            ),
            rec(3, json!({"role": "assistant", "content": "Tokyo"})),
        ];
        let client = vec![
            json!({"role": "user", "content": "where am I?"}),
            json!({"role": "assistant", "content": "Tokyo"}),
            json!({"role": "user", "content": "thanks"}),
        ];
        assert_eq!(
            new_part(&history, &client),
            vec![json!({"role": "user", "content": "thanks"})]
        );
        // A client that resends the rounds too is understood as well.
        let mut full: Vec<Value> = history.iter().map(|h| h.body.clone()).collect();
        full.push(json!({"role": "user", "content": "thanks"}));
        assert_eq!(
            new_part(&history, &full),
            vec![json!({"role": "user", "content": "thanks"})]
        );
    }

    #[test]
    fn tool_calls_must_match() {
        let a = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]});
        let b = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "2"}]});
        assert!(!same_message(&a, &b));
        assert!(same_message(&a, &a));
    }

    #[test]
    fn truncation_is_char_safe() {
        assert_eq!(truncate_chars("日本語テキスト", 3), "日本語…");
        assert_eq!(truncate_chars("short", 10), "short");
    }
}
