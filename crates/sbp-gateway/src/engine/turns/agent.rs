//! The agent loop of one turn, on its own task: call the upstream with the gateway's tools offered
//! (surface and southbound MCP), stream deltas to the attached surface and/or the SSE caller, run
//! the tools the model asks for and record each round, ask again; then persist the reply with its
//! snapshots and tether entry (`finish_turn`) and only then answer and notify the surface.

use std::sync::atomic::Ordering::Relaxed;

use chrono::Utc;
use futures::StreamExt;
use sbp_bus::{LiveChunk, TurnDone};
use sbp_llm::Assembler;
use sbp_protocol::{ChatMessage, ChatRequest, SbpResponseMeta, SessionStatus, SnapshotKind};
use sbp_store::{
    FailTurn, FinishTurn, MessageJson, NewMessage, NewSnapshot, NewTetherEntry, TurnProgress,
};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use uuid::Uuid;

use super::chunks::{UsageSum, assembled_body, closing_chunk, strip_loop_fields, usage_chunk};
use super::{SseEvent, Turn, Turns};
use crate::engine::connections::Attachment;
use crate::engine::replicas::Replicas;
use crate::engine::tools::{Catalog, ToolRun, ToolTarget};
use crate::error::Error;
use crate::metrics::Timed as _;
use sbp_protocol::time::iso;

/// One upstream call's outcome.
struct RoundOut {
    message: ChatMessage,
    model: String,
    body: Value,
    finish_reason: Option<String>,
}

/// The final round, the turn's reply.
struct Upstream {
    body: Value,
    message: ChatMessage,
    model: String,
    chunk_id: Uuid,
    /// The loop hid the caller's tool-call deltas (gateway tools were on offer): the finish
    /// chunk carries the reply's calls.
    tools_hidden: bool,
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

impl Turns {
    /// Runs the upstream call and persists the outcome. With `events`, streams SSE to the caller.
    pub(super) async fn run_turn(
        &self,
        mut turn: Turn,
        events: Option<mpsc::Sender<SseEvent>>,
    ) -> Result<Value, Error> {
        // The loop owns the request (it may be the whole transcript: moved, not copied).
        let request = std::mem::take(&mut turn.request);
        // Past the shutdown grace the turn is given up where it stands (a hung upstream, a tool
        // call nobody answers): every write it made so far is a whole unit, and failing it below
        // releases its idempotency key, so a retry runs it again.
        let aborting = self.inner.tasks.aborting();
        let upstream = tokio::select! {
            done = self.call_upstream(&turn, request, events.as_ref()) => done,
            _ = aborting.cancelled() => Err(Error::Unavailable(
                "the gateway shut down before this turn finished; retry it".into(),
            )),
        };
        let mut tools_hidden = false;
        let outcome = match upstream {
            Ok(done) => {
                tools_hidden = done.tools_hidden;
                let finished = self.finish(&turn, done).await;
                if let Err(e) = &finished {
                    // The caller may be gone: this log line is then the only trace of it.
                    tracing::error!(session_id = %turn.session.id, turn_id = %turn.turn_id, error = %e, "persisting a completed turn failed; its reply is lost");
                }
                finished
            }
            Err(err) => {
                self.inner.metrics.turns_failed.inc();
                // A session this turn created, that its caller has not learnt of (no streamed
                // event carried its headers yet), is erased whole, its Idempotency-Key with it (a
                // retry starts afresh; until then the key stays in progress): an SDK's retries of
                // a failing first request leave no orphan sessions.
                let untold = turn.creates_session && !turn.told.load(Relaxed);
                if untold && self.discard(&turn).await {
                    Err(err)
                } else {
                    let fail = FailTurn {
                        session_id: turn.session.id,
                        turn_id: turn.turn_id,
                        error: err.to_string(),
                        idempotency_key: turn.idempotency_key.clone(),
                        now: Utc::now(),
                    };
                    let failed = self.inner.store.fail_turn(fail);
                    if let Err(e) = failed.timed(&self.inner.metrics, "fail_turn").await {
                        tracing::error!(session_id = %turn.session.id, error = %e, "recording a failed turn failed");
                    }
                    Err(Error::InTurn {
                        session: turn.session(),
                        cause: Box::new(err),
                    })
                }
            }
        };
        if let Some(tx) = events {
            match &outcome {
                // The stream ends as OpenAI's does, once the reply is stored: the finish chunk
                // (with the `sbp` block), the usage chunk when asked for, `[DONE]`.
                Ok(reply) => {
                    let _ = tx
                        .send(SseEvent::Data(closing_chunk(reply, tools_hidden)))
                        .await;
                    if turn.include_usage {
                        let _ = tx.send(SseEvent::Data(usage_chunk(reply))).await;
                    }
                    let _ = tx.send(SseEvent::Done).await;
                }
                Err(e) => {
                    let _ = tx.send(SseEvent::Failed(e.clone())).await;
                }
            }
        }
        outcome
    }

    /// Erases a session whose first turn failed: its messages, snapshots and Idempotency-Key go
    /// (a retry with the key starts afresh). False when it could not be erased (it is then kept,
    /// and its caller told about it as for any failed turn).
    async fn discard(&self, turn: &Turn) -> bool {
        match self.inner.sessions.delete(&turn.session).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(session_id = %turn.session.id, error = %e, "erasing a session whose first turn failed failed; it is kept");
                false
            }
        }
    }

    /// The agent loop: calls the upstream with the gateway's tools (surface and southbound MCP)
    /// added to the request; while the reply asks only for those tools, runs them (concurrently),
    /// records the round, and asks again, at most `max_tool_rounds` times. A reply asking for a
    /// tool of the client's own goes back to the client as is.
    async fn call_upstream(
        &self,
        turn: &Turn,
        request: ChatRequest,
        events: Option<&mpsc::Sender<SseEvent>>,
    ) -> Result<Upstream, Error> {
        let mut sink = LiveSink::new(
            &self.inner.replicas,
            turn.session.id,
            turn.session.step_count + 1,
            turn.surface.clone(),
        );
        let mut transcript = request;
        let mut usage = UsageSum::default();
        let max_rounds = self.inner.config.max_tool_rounds;
        let mut round = 0;
        loop {
            // The surface may have gone (or come) since the turn started.
            let surface = match round {
                0 => turn.surface.clone(),
                _ => self.inner.replicas.locate(turn.session.id).await,
            };
            // The transcript's tools are the caller's: the catalog's are added to each round's copy.
            let catalog = self.inner.tools.catalog(surface.as_ref(), &transcript);
            if round > 0 {
                sink.new_round();
            }
            // Without gateway tools on offer this round is the last: it takes the transcript.
            let mut request = if catalog.is_empty() {
                std::mem::take(&mut transcript)
            } else {
                transcript.clone()
            };
            catalog.offer(&mut request);
            if round >= max_rounds && !catalog.is_empty() {
                // Out of rounds: the model must answer now.
                request.tool_choice = Some(json!("none"));
            }
            let out = self
                .upstream_round(request, turn, &mut sink, events, !catalog.is_empty())
                .await?;
            usage.add(out.body.get("usage"));
            let calls = match gateway_calls(&out.message, &catalog) {
                Some(calls) if round < max_rounds => calls,
                _ => return Ok(last_round(out, round, usage, &catalog, &sink)),
            };
            self.tool_round(turn, round, &out, calls, &mut transcript)
                .await?;
            round += 1;
        }
    }

    /// One upstream call, streamed to the surface and/or the SSE caller when either wants it.
    /// With gateway tools on offer (`hide_tools`), the caller's chunks lose their tool-call deltas
    /// and finish reasons: those belong to the loop, and the last round says how the turn ended.
    async fn upstream_round(
        &self,
        mut request: ChatRequest,
        turn: &Turn,
        sink: &mut LiveSink<'_>,
        events: Option<&mpsc::Sender<SseEvent>>,
        hide_tools: bool,
    ) -> Result<RoundOut, Error> {
        let routed = self.inner.provider.route_name(&turn.model);
        if !(turn.client_stream || sink.is_live()) {
            let c = self
                .inner
                .provider
                .complete(request)
                .await
                .map_err(Error::Upstream)?;
            return Ok(RoundOut {
                message: c.message,
                model: c.model,
                body: c.body,
                finish_reason: c.finish_reason,
            });
        }
        // Without this an OpenAI upstream streams no usage, and the turn's would be `null` (the
        // caller gets it as it asked: in the body, or in a last chunk of its own).
        request.request_stream_usage();
        let mut stream = self
            .inner
            .provider
            .stream(request)
            .await
            .map_err(Error::Upstream)?;
        let mut asm = Assembler::default();
        let mut caller_gone = false;
        while let Some(item) = stream.next().await {
            let mut chunk = item.map_err(Error::Upstream)?;
            let delta = asm.push(&chunk);
            asm.check().map_err(Error::Upstream)?;
            if let Some(delta) = delta {
                sink.chunk(&delta, asm.model.as_deref().unwrap_or(&routed));
            }
            let Some(tx) = events.filter(|_| !caller_gone) else {
                continue;
            };
            if !strip_loop_fields(&mut chunk, hide_tools) {
                continue;
            }
            // The first event carries the session's headers: from here its caller knows it.
            turn.told.store(true, Relaxed);
            caller_gone = tx.send(SseEvent::Data(chunk)).await.is_err();
        }
        let model = asm.model.clone().unwrap_or(routed);
        let finish_reason = asm.finish_reason.clone().unwrap_or_else(|| "stop".into());
        let body = assembled_body(&asm, &model, &finish_reason);
        Ok(RoundOut {
            message: ChatMessage::from_value(asm.message()),
            model,
            body,
            finish_reason: Some(finish_reason),
        })
    }

    /// Runs one round of gateway tool calls: a pre_action snapshot per call before anything is
    /// sent, the calls concurrently (each answers, whatever happens to the surface), then the
    /// assistant's tool-call message, the tool messages and a post_action snapshot per call in
    /// one write; the messages join the transcript of the next request.
    async fn tool_round(
        &self,
        turn: &Turn,
        round: u32,
        out: &RoundOut,
        calls: Vec<LoopCall>,
        transcript: &mut ChatRequest,
    ) -> Result<(), Error> {
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
                           "tool_call_id": c.id, "function": c.function, "target": c.target.to_json(),
                           "arguments": c.arguments}),
                )
            })
            .collect();
        self.inner
            .store
            .record_progress(TurnProgress {
                session_id,
                turn_id: turn.turn_id,
                messages: Vec::new(),
                snapshots: pre,
                now: Utc::now(),
            })
            .timed(&self.inner.metrics, "record_progress")
            .await?;
        let runs = futures::future::join_all(calls.iter().map(|c| async move {
            match &c.arguments {
                Ok(args) => {
                    self.inner
                        .tools
                        .run(session_id, &c.target, args.clone())
                        .await
                }
                Err(e) => ToolRun::failed(None, e.clone()),
            }
        }))
        .await;
        let now = Utc::now();
        let mut answered = vec![out.message.clone()];
        let mut post = Vec::with_capacity(calls.len());
        for (c, run) in calls.iter().zip(&runs) {
            answered.push(ChatMessage::tool_result(&c.id, &run.content));
            post.push(snapshot(
                SnapshotKind::PostAction,
                json!({"action": "tool_result", "turn_id": turn.turn_id, "round": round,
                       "tool_call_id": c.id, "call_id": run.call_id, "function": c.function,
                       "ok": run.error.is_none(), "error": run.error}),
            ));
        }
        // The round's messages as stored (and cached): the assistant's call, then its results.
        let roles = std::iter::once("assistant").chain(std::iter::repeat("tool"));
        let messages: Vec<NewMessage> = roles
            .zip(&answered)
            .enumerate()
            .map(|(i, (role, body))| NewMessage {
                role: role.into(),
                body: body.as_value().into(),
                model_used: (i == 0).then(|| out.model.clone()),
                cost_usd: None,
                created_at: now,
            })
            .collect();
        // The store takes the messages; the cache learns them once the store says where they
        // went (a round's calls and results are small: a copy of their text, not a re-encoding).
        let cached = messages.clone();
        let progress = self
            .inner
            .store
            .record_progress(TurnProgress {
                session_id,
                turn_id: turn.turn_id,
                messages,
                snapshots: post,
                now,
            })
            .timed(&self.inner.metrics, "record_progress")
            .await?;
        self.inner.history.extend(
            session_id,
            progress.first_message_seq,
            super::written(&cached),
        );
        transcript.messages.extend(answered);
        Ok(())
    }

    /// Persists the reply with its snapshots and tether entry in one write, then tells the
    /// session's surface; returns the completion body with its `sbp` block.
    async fn finish(&self, turn: &Turn, up: Upstream) -> Result<Value, Error> {
        let now = Utc::now();
        let session = &turn.session;
        let text = up.message.text();
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
        let reply = MessageJson::new(up.message.as_value());
        let finish = FinishTurn {
            session_id: session.id,
            turn_id: Some(turn.turn_id),
            messages: vec![NewMessage {
                role: "assistant".into(),
                body: reply.clone(),
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
            idempotency_claim: None,
            now,
        };
        let finished = self.inner.store.finish_turn(finish);
        let outcome = finished.timed(&self.inner.metrics, "finish_turn").await?;
        self.inner.history.extend(
            session.id,
            outcome.first_message_seq,
            [("assistant", reply.as_str())],
        );
        self.inner.metrics.turns_completed.inc();
        if outcome.tether_seq.is_some() {
            self.inner.metrics.tether_enqueued.inc();
        }
        body["sbp"]["step_count"] = json!(outcome.session.step_count);
        self.inner
            .replicas
            .notify_turn_done(
                session.id,
                TurnDone {
                    chunk_id: up.chunk_id,
                    seq: outcome.tether_seq,
                    role: "assistant".into(),
                    content: text,
                    model_used: Some(up.model),
                    step: Some(outcome.session.step_count),
                    // The gateway does not price turns.
                    cost_usd: None,
                },
            )
            .await;
        if let Some(token) = &turn.created_token {
            body["sbp"]["session_token"] = Value::String(token.clone());
        }
        Ok(body)
    }
}

/// The final round becomes the turn's reply; usage is summed over the rounds.
fn last_round(
    out: RoundOut,
    rounds: u32,
    usage: UsageSum,
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
    Upstream {
        body,
        message: out.message,
        model: out.model,
        chunk_id: sink.chunk_id,
        tools_hidden: !catalog.is_empty(),
    }
}

/// The calls of `message` when every one is a gateway tool; `None` when there are none or any
/// belongs to the client.
fn gateway_calls(message: &ChatMessage, catalog: &Catalog) -> Option<Vec<LoopCall>> {
    if !message.has_tool_calls() || catalog.is_empty() {
        return None;
    }
    message
        .tool_calls()
        .enumerate()
        .map(|(i, c)| {
            let function = c.name()?.to_owned();
            let target = catalog.target(&function)?.clone();
            let raw = c.arguments().unwrap_or("");
            let arguments = if raw.trim().is_empty() {
                Ok(json!({}))
            } else {
                serde_json::from_str(raw)
                    .map_err(|e| format!("the arguments are not valid JSON: {e}"))
            };
            Some(LoopCall {
                id: c.id().map_or_else(|| format!("call_{i}"), str::to_owned),
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
    let dropped = out
        .message
        .retain_tool_calls(|c| c.name().is_none_or(|name| catalog.target(name).is_none()));
    if dropped == 0 {
        return out;
    }
    tracing::warn!(
        dropped,
        "gateway tool calls the loop could not run were dropped from the reply"
    );
    if !out.message.has_tool_calls() {
        out.finish_reason = Some("stop".into());
    }
    if let Some(choice) = out
        .body
        .pointer_mut("/choices/0")
        .and_then(Value::as_object_mut)
    {
        choice.insert("message".into(), out.message.as_value().clone());
        choice.insert("finish_reason".into(), json!(out.finish_reason));
    }
    out
}

/// Streams one turn's deltas live to the connection attached when the turn started. If that
/// connection goes away, is displaced or falls behind, live streaming of this turn stops for good
/// (the turn is then delivered whole, from storage).
struct LiveSink<'a> {
    replicas: &'a Replicas,
    session: Uuid,
    /// The step the turn will be once committed.
    step: u64,
    chunk_id: Uuid,
    target: Option<Attachment>,
    /// The upstream round streaming now, and the bytes of its text sent so far.
    round: u32,
    offset: u64,
}

impl<'a> LiveSink<'a> {
    fn new(replicas: &'a Replicas, session: Uuid, step: u64, target: Option<Attachment>) -> Self {
        Self {
            replicas,
            session,
            step,
            chunk_id: Uuid::now_v7(),
            target,
            round: 0,
            offset: 0,
        }
    }

    /// The agent loop asks the model again: its text starts over (the stored reply is the last
    /// round's text).
    fn new_round(&mut self) {
        self.round += 1;
        self.offset = 0;
    }

    fn is_live(&self) -> bool {
        self.target.is_some()
    }

    /// Sends `delta`, written by `model`.
    fn chunk(&mut self, delta: &str, model: &str) {
        let Some(target) = &self.target else { return };
        let chunk = LiveChunk {
            chunk_id: self.chunk_id,
            delta: delta.to_owned(),
            round: self.round,
            offset: self.offset,
            step: Some(self.step),
            model: Some(model.to_owned()),
        };
        if self.replicas.send_chunk(self.session, target, chunk) {
            self.offset += delta.len() as u64;
        } else {
            self.target = None;
        }
    }
}
