//! One attached connection's delivery state: what it was sent (the highest tether seq, the next
//! TETHER_TURN index), whether its surface acknowledges turns, and how replies are rendered for it.

use std::sync::Arc;

use sbp_protocol::frames::TetherTurn;
use sbp_protocol::{ServerFrame, SurfaceContext};
use sbp_store::TetherEntry;
use uuid::Uuid;

use super::Frame;
use super::render::{Renderer, Rendering};
use sbp_protocol::time::iso;

#[derive(Debug)]
pub struct Delivery {
    pub session_id: Uuid,
    pub conn_id: u64,
    /// The surface sent `last_seq` or an ACK: turns leave the tether only when acknowledged.
    pub ack_mode: bool,
    /// Highest tether seq sent on this connection.
    pub(super) last_sent: u64,
    /// Next `turn_index` for a TETHER_TURN on this connection.
    tether_index: u64,
    /// The surface as it declared itself, and how replies are adapted for it.
    pub(super) surface: Arc<SurfaceContext>,
    pub(super) renderer: Renderer,
}

impl Delivery {
    pub(super) fn new(
        session_id: Uuid,
        conn_id: u64,
        last_seq: Option<u64>,
        surface: Arc<SurfaceContext>,
        rendering: Rendering,
    ) -> Self {
        Self {
            session_id,
            conn_id,
            ack_mode: last_seq.is_some(),
            last_sent: last_seq.unwrap_or(0),
            tether_index: 0,
            surface,
            renderer: Renderer::new(rendering),
        }
    }

    /// A TETHER_TURN for `e`, counted as sent on this connection.
    pub(super) fn tether_frame(&mut self, e: &TetherEntry) -> Frame {
        let frame = ServerFrame::TetherTurn(
            TetherTurn {
                turn_index: self.tether_index,
                role: e.role.clone(),
                content: e.content.clone(),
                model_used: e.model_used.clone(),
                created_at: iso(&e.created_at),
                seq: e.seq,
                session_id: Some(self.session_id.to_string()),
                chunk_id: Some(e.chunk_id.to_string()),
                turn: None,
            }
            .with_aliases(),
        );
        self.tether_index += 1;
        self.last_sent = self.last_sent.max(e.seq);
        (frame, Some(e.seq))
    }

    /// TETHER_TURN frames adapted for this surface with the deterministic adaptation (CTP
    /// surfaces too: only the attach drain and live turns wait for a rewrite).
    pub(super) fn render_tethered(&self, mut frames: Vec<Frame>) -> Vec<Frame> {
        if matches!(self.renderer.rendering, Rendering::Raw) {
            return frames;
        }
        for (frame, _) in &mut frames {
            if let ServerFrame::TetherTurn(t) = frame
                && let Some(c) = &t.content
            {
                let adapted = self.renderer.whole(c);
                t.set_content(adapted);
            }
        }
        frames
    }
}
