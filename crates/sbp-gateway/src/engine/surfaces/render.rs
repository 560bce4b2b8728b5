//! What each surface receives (L4): the stored reply stays as the model wrote it; each delivery
//! adapts it for the surface it goes to — live chunks through a streaming adapter, whole turns
//! (tether drains) at once — or, when the operator configured a Contextual Translation Pipeline
//! for the device type, rewrites it with a second LLM pass (`ctp.rs`). The generating request also
//! hears about the surface attached when the turn starts ([`shape_request`]): a short system note
//! and `max_tokens` bounded by the surface's `max_output_tokens`. Pure: no IO.

use std::collections::HashMap;

use sbp_adapt::{Adapter, Profile, adapt};
use sbp_protocol::frames::{TurnChunk, TurnComplete};
use sbp_protocol::{ChatRequest, ServerFrame, SurfaceContext};
use uuid::Uuid;

use super::Frame;
use crate::config::CtpRule;

/// How one connection renders replies.
#[derive(Debug, Clone)]
pub enum Rendering {
    /// As the model wrote them (no adaptation needed).
    Raw,
    /// The deterministic adaptation.
    Adapt(Profile),
    /// A second LLM pass, its output still held to the profile (budget, no Markdown).
    Ctp { rule: CtpRule, profile: Profile },
}

/// Per-connection adaptation state: the rendering and the turns streaming live to it.
#[derive(Debug)]
pub struct Renderer {
    pub rendering: Rendering,
    live: HashMap<Uuid, Live>,
}

/// A turn streaming live to one connection.
#[derive(Debug)]
struct Live {
    /// The upstream round whose text is streaming (the stored reply is the last round's text).
    round: u32,
    /// That round's text as this connection received it. A delta that does not start where this
    /// ends (one was missed: a full inbox, a lost bus message) stops the live stream for good, so
    /// this stays a prefix of the round's text and the completed turn supplies the rest.
    received: String,
    broken: bool,
    adapter: Option<Adapter>,
}

/// Turns kept streaming per connection; beyond it the oldest is forgotten (a turn that failed
/// after streaming never completes).
const MAX_LIVE: usize = 16;

impl Renderer {
    pub fn new(rendering: Rendering) -> Self {
        Self {
            rendering,
            live: HashMap::new(),
        }
    }

    /// A live delta of turn `chunk_id`, `offset` bytes into the text of its upstream round
    /// `round`, as this surface gets it (`None`: nothing to send now).
    pub fn chunk(
        &mut self,
        chunk_id: Uuid,
        delta: &str,
        round: u32,
        offset: u64,
    ) -> Option<String> {
        let profile = match &self.rendering {
            // The rewrite starts when the reply is complete.
            Rendering::Ctp { .. } => return None,
            Rendering::Raw => None,
            Rendering::Adapt(profile) => Some(*profile),
        };
        if !self.live.contains_key(&chunk_id) && self.live.len() >= MAX_LIVE {
            // Chunk ids are UUIDv7: the smallest is the oldest turn.
            if let Some(oldest) = self.live.keys().min().copied() {
                self.live.remove(&oldest);
            }
        }
        let live = self.live.entry(chunk_id).or_insert_with(|| Live {
            round,
            received: String::new(),
            broken: false,
            adapter: profile.map(Adapter::new),
        });
        if round != live.round {
            live.round = round;
            live.received.clear();
        }
        if live.broken || offset != live.received.len() as u64 {
            live.broken = true;
            return None;
        }
        live.received.push_str(delta);
        match &mut live.adapter {
            None => Some(delta.to_owned()),
            Some(a) => {
                let out = a.push(delta);
                (!out.is_empty()).then_some(out)
            }
        }
    }

    /// The rest of turn `chunk_id` (`content`, the whole stored reply) after what streamed to
    /// this connection, adapted: all of it when nothing did, the remainder when streaming
    /// stopped early (the connection fell behind, a delta was lost, or the stream went to
    /// another connection). Not used for CTP.
    pub fn rest(&mut self, chunk_id: Uuid, content: &str) -> String {
        let live = self.live.remove(&chunk_id);
        let profile = match &self.rendering {
            Rendering::Raw => None,
            Rendering::Adapt(profile) | Rendering::Ctp { profile, .. } => Some(*profile),
        };
        let whole = |content: &str| match profile {
            None => content.to_owned(),
            Some(p) => adapt(&p, content),
        };
        let Some(live) = live else {
            return whole(content);
        };
        let Some(remaining) = content.strip_prefix(live.received.as_str()) else {
            // What streamed is not the start of the stored reply (it should be): better the
            // surface sees text twice than not at all.
            tracing::warn!(%chunk_id, "streamed text is not a prefix of the stored reply; sending it whole");
            return whole(content);
        };
        match live.adapter {
            None => remaining.to_owned(),
            Some(mut a) => {
                let mut out = a.push(remaining);
                out.push_str(&a.finish());
                out
            }
        }
    }

    /// A whole turn (TETHER_TURN) adapted without CTP.
    pub fn whole(&self, content: &str) -> String {
        match &self.rendering {
            Rendering::Raw => content.to_owned(),
            Rendering::Adapt(profile) | Rendering::Ctp { profile, .. } => adapt(profile, content),
        }
    }

    /// Forgets a turn's live state (it was delivered from the tether instead).
    pub fn drop_turn(&mut self, chunk_id: Uuid) {
        self.live.remove(&chunk_id);
    }
}

/// The rendering for a surface: CTP when a rule names its device type (or "*") and it needs
/// adaptation, the deterministic adaptation when it needs any, else raw.
pub fn rendering_for(rules: &[CtpRule], ctx: &SurfaceContext) -> Rendering {
    let profile = Profile::for_surface(ctx);
    if profile.is_passthrough() {
        return Rendering::Raw;
    }
    let class = ctx.adaptation_class();
    let rule = rules
        .iter()
        .find(|r| r.device_type == class)
        .or_else(|| rules.iter().find(|r| r.device_type == "*"));
    match rule {
        Some(rule) => Rendering::Ctp {
            rule: rule.clone(),
            profile,
        },
        None => Rendering::Adapt(profile),
    }
}

/// Tells the generating request about the surface attached when the turn starts: a system note
/// after the leading system messages, and `max_tokens` (or `max_completion_tokens`, if that is
/// what the client used) no larger than the surface's `max_output_tokens`.
pub fn shape_request(ctx: &SurfaceContext, req: &mut ChatRequest) {
    if let Some(limit) = ctx.max_output_tokens {
        req.cap_output_tokens(limit);
    }
    if let Some(note) = Profile::for_surface(ctx).instructions(ctx) {
        req.insert_system_note(&note);
    }
}

/// The turn a TURN_CHUNK or TURN_COMPLETE belongs to: its chunk id, and the session, the step
/// and the model, which the reference client reads (docs/PROTOCOL-EXTENSIONS.md).
#[derive(Debug, Clone, PartialEq)]
pub struct TurnTag {
    pub chunk_id: Uuid,
    pub session_id: Uuid,
    pub step: Option<u64>,
    pub model: Option<String>,
}

/// A TURN_CHUNK frame of the turn.
pub fn chunk_frame(tag: &TurnTag, delta: String) -> Frame {
    let chunk = TurnChunk {
        session_id: Some(tag.session_id.to_string()),
        step: tag.step,
        model: tag.model.clone(),
        ..TurnChunk::new(tag.chunk_id.to_string(), delta)
    };
    (ServerFrame::TurnChunk(chunk), None)
}

/// The turn's TURN_COMPLETE frame, its `model_used` the tag's model; `seq` marks it for removal
/// from the tether once sent.
pub fn complete_frame(tag: &TurnTag, seq: Option<u64>, cost_usd: Option<f64>) -> Frame {
    let complete = TurnComplete {
        session_id: Some(tag.session_id.to_string()),
        step: tag.step,
        cost_usd,
        ..TurnComplete::new(tag.chunk_id.to_string(), seq, tag.model.clone())
    };
    (ServerFrame::TurnComplete(complete), seq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn voice() -> Profile {
        let ctx = SurfaceContext::from_value(&json!({"device_type": "voice"}));
        Profile::for_surface(&ctx)
    }

    #[test]
    fn the_rest_of_a_turn_continues_what_streamed() {
        let reply = "First part. **Second** part.";
        let id = Uuid::now_v7();
        let mut raw = Renderer::new(Rendering::Raw);
        assert_eq!(raw.chunk(id, "First ", 0, 0), Some("First ".into()));
        assert_eq!(raw.rest(id, reply), "part. **Second** part.");
        // Nothing streamed here: all of it.
        assert_eq!(raw.rest(Uuid::now_v7(), reply), reply);
        // A missed delta stops the stream; the rest follows what did arrive.
        let gap = Uuid::now_v7();
        assert!(raw.chunk(gap, "First ", 0, 0).is_some());
        assert_eq!(raw.chunk(gap, "**Second** ", 0, 12), None);
        assert_eq!(raw.chunk(gap, "part.", 0, 23), None);
        assert_eq!(raw.rest(gap, reply), "part. **Second** part.");
        // Tool rounds: the stored reply is the last round's text.
        let rounds = Uuid::now_v7();
        raw.chunk(rounds, "Let me check. ", 0, 0);
        raw.chunk(rounds, "First ", 1, 0);
        assert_eq!(raw.rest(rounds, reply), "part. **Second** part.");
        // What streamed is not the stored reply's start: all of it rather than nothing.
        let other = Uuid::now_v7();
        raw.chunk(other, "Something else", 0, 0);
        assert_eq!(raw.rest(other, reply), reply);
    }

    #[test]
    fn turns_that_never_complete_do_not_pile_up() {
        let mut raw = Renderer::new(Rendering::Raw);
        let first = Uuid::now_v7();
        raw.chunk(first, "abandoned", 0, 0);
        for _ in 0..MAX_LIVE {
            raw.chunk(Uuid::now_v7(), "x", 0, 0);
        }
        assert_eq!(raw.live.len(), MAX_LIVE);
        // The oldest was forgotten: its completion is sent whole.
        assert_eq!(raw.rest(first, "abandoned text"), "abandoned text");
    }

    #[test]
    fn adapted_streams_finish_like_the_whole_adaptation() {
        let reply = "First part. **Second** part with `code` and more words.";
        let whole = adapt(&voice(), reply);
        for cut in [0, 3, 12, 20, reply.len()] {
            let id = Uuid::now_v7();
            let mut r = Renderer::new(Rendering::Adapt(voice()));
            let mut got = String::new();
            if cut > 0 {
                got.push_str(&r.chunk(id, &reply[..cut], 0, 0).unwrap_or_default());
            }
            got.push_str(&r.rest(id, reply));
            assert_eq!(got, whole, "streamed {cut} bytes first");
        }
    }
}
