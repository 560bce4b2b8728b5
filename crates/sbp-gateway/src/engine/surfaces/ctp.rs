//! The Contextual Translation Pipeline: a second LLM pass rewriting a reply for a surface, when the
//! operator configured one for its device type. Streamed for a live turn (TURN_CHUNK frames as the
//! rewrite arrives, then TURN_COMPLETE), whole for tethered turns, and always held to the
//! surface's profile; a pass that fails or takes too long falls back to the deterministic
//! adaptation.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use sbp_adapt::{Adapter, Profile, adapt};
use sbp_llm::{Assembler, Provider};
use sbp_protocol::{ChatMessage, ChatRequest, ServerFrame, SurfaceContext};
use serde_json::json;
use tokio::sync::mpsc;

use super::Frame;
use super::render::{TurnTag, chunk_frame};
use crate::config::CtpRule;
use crate::engine::tasks::Tasks;

/// Frames produced by a CTP pass, in order; for a live turn the last one is its TURN_COMPLETE.
pub type CtpFrames = mpsc::Receiver<Frame>;

/// CTP passes run at once for one drain.
const CTP_PARALLEL: usize = 4;

#[derive(Clone)]
pub struct Ctp {
    provider: Arc<dyn Provider>,
    /// Longest a pass may take before the deterministic adaptation is used instead.
    timeout: Duration,
    /// Tethered turns rewritten in one drain (the most recent ones).
    drain_max: usize,
    tasks: Tasks,
}

impl Ctp {
    pub fn new(
        provider: Arc<dyn Provider>,
        timeout: Duration,
        drain_max: usize,
        tasks: Tasks,
    ) -> Self {
        Self {
            provider,
            timeout,
            drain_max,
            tasks,
        }
    }

    /// Streams the rewrite of a completed reply to one connection: TURN_CHUNK frames as the
    /// rewrite arrives (held to the profile), then `complete`. If the pass fails before it
    /// produced anything, the deterministic adaptation is sent instead.
    pub fn stream(
        &self,
        rule: &CtpRule,
        profile: &Profile,
        ctx: &SurfaceContext,
        content: String,
        tag: TurnTag,
        complete: Frame,
    ) -> CtpFrames {
        let chunk_id = tag.chunk_id;
        let (tx, rx) = mpsc::channel(64);
        let request = ctp_request(rule, profile, ctx, &content);
        let provider = self.provider.clone();
        let timeout = self.timeout;
        let profile = *profile;
        self.tasks.spawn(async move {
            let mut adapter = Adapter::new(profile);
            let mut sent_any = false;
            let deadline = tokio::time::Instant::now() + timeout;
            let outcome = tokio::time::timeout_at(deadline, async {
                let mut stream = provider.stream(request).await?;
                let mut asm = Assembler::default();
                while let Some(item) = stream.next().await {
                    let Some(delta) = asm.push(&item?) else {
                        continue;
                    };
                    let out = adapter.push(&delta);
                    if !out.is_empty() {
                        sent_any = true;
                        if tx.send(chunk_frame(&tag, out)).await.is_err() {
                            return Ok(());
                        }
                    }
                }
                Ok::<(), sbp_llm::LlmError>(())
            })
            .await;
            let failed = match outcome {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some("timed out".to_owned()),
            };
            let rest = match (&failed, sent_any) {
                (Some(e), false) => {
                    tracing::warn!(chunk_id = %chunk_id, error = %e, "CTP pass failed; sending the deterministic adaptation");
                    adapt(&profile, &content)
                }
                (Some(e), true) => {
                    tracing::warn!(chunk_id = %chunk_id, error = %e, "CTP pass failed midway; the rewrite ends here");
                    adapter.finish()
                }
                (None, _) => adapter.finish(),
            };
            if !rest.is_empty() {
                let _ = tx.send(chunk_frame(&tag, rest)).await;
            }
            let _ = tx.send(complete).await;
        });
        rx
    }

    /// The rewrite of a whole (tethered) turn, or the deterministic adaptation when the pass
    /// fails or takes longer than the timeout.
    pub async fn whole(
        &self,
        rule: &CtpRule,
        profile: &Profile,
        ctx: &SurfaceContext,
        content: &str,
    ) -> String {
        let request = ctp_request(rule, profile, ctx, content);
        let call = self.provider.complete(request);
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(c)) => match c.message.text() {
                Some(text) if !text.trim().is_empty() => adapt(profile, &text),
                _ => adapt(profile, content),
            },
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "CTP pass failed; using the deterministic adaptation");
                adapt(profile, content)
            }
            Err(_) => {
                tracing::warn!(
                    timeout_ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
                    "CTP pass timed out; using the deterministic adaptation"
                );
                adapt(profile, content)
            }
        }
    }

    /// An attach drain: the most recent `drain_max` turns rewritten (four at a time), older ones
    /// adapted deterministically, sent through a channel in their order.
    pub fn drain(
        &self,
        rule: &CtpRule,
        profile: Profile,
        surface: Arc<SurfaceContext>,
        frames: Vec<Frame>,
    ) -> CtpFrames {
        let (tx, rx) = mpsc::channel(CTP_PARALLEL * 2);
        let first_ctp = frames.len().saturating_sub(self.drain_max);
        let (ctp, rule) = (self.clone(), rule.clone());
        self.tasks.spawn(async move {
            let mut rewritten = futures::stream::iter(frames.into_iter().enumerate())
                .map(|(i, (mut frame, seq))| {
                    let (ctp, rule, surface) = (ctp.clone(), rule.clone(), surface.clone());
                    async move {
                        if let ServerFrame::TetherTurn(t) = &mut frame
                            && let Some(c) = &t.content
                        {
                            let rewritten = if i >= first_ctp {
                                ctp.whole(&rule, &profile, &surface, c).await
                            } else {
                                adapt(&profile, c)
                            };
                            t.set_content(rewritten);
                        }
                        (frame, seq)
                    }
                })
                .buffered(CTP_PARALLEL);
            while let Some(item) = rewritten.next().await {
                if tx.send(item).await.is_err() {
                    return;
                }
            }
        });
        rx
    }
}

/// The rewriting request: instructions for the surface, then the reply to rewrite.
fn ctp_request(
    rule: &CtpRule,
    profile: &Profile,
    ctx: &SurfaceContext,
    content: &str,
) -> ChatRequest {
    let constraints = profile.instructions(ctx).unwrap_or_default();
    let system = match &rule.prompt {
        Some(p) => format!("{p}\n{constraints}"),
        None => format!(
            "Rewrite the assistant reply below for the user's {} device. {constraints} Keep its \
             meaning and facts; add nothing. Answer with the rewritten reply only.",
            ctx.device_type_or_unknown()
        ),
    };
    let mut req = ChatRequest {
        model: Some(rule.model.clone()),
        messages: vec![
            ChatMessage::system(system.trim()),
            ChatMessage::from_value(json!({"role": "user", "content": content})),
        ],
        ..ChatRequest::default()
    };
    if let Some(budget) = profile.budget_tokens {
        req.rest.insert("max_tokens".into(), json!(budget));
    }
    req
}
