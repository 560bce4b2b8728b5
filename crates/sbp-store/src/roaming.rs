//! Records of L3 roaming: stored bundles, exports (what a roaming token refers to), lineage links
//! (forks, handoffs, imports, and a session's moves between gateways) and the session memory
//! document that travels in a bundle.

use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::{NewMessage, NewSession, NewSnapshot, SessionRecord, Timestamp};
use sbp_protocol::SessionStatus;

/// How a peer's redeem of an export's token went (`RoamingStore::redeem_export`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedeemOutcome {
    /// Consumed now, by this peer.
    Redeemed,
    /// This peer redeemed it recently: the same answer again.
    AlreadyByThisPeer,
    /// Imported here or redeemed by another peer (or long ago).
    Consumed,
}

/// A bundle as stored: addressed by its CID, as the canonical bytes of the sealed bundle.
#[derive(Debug, Clone, PartialEq)]
pub struct NewBundle {
    pub cid: String,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NewExport {
    /// The roaming token's `sub`.
    pub id: Uuid,
    /// The exported session (on another gateway when `foreign`).
    pub session_id: Uuid,
    pub bundle_cid: String,
    pub label: Option<String>,
    pub message_count: u64,
    pub created_at: Timestamp,
    pub expires_at: Timestamp,
    /// Made by another gateway sharing the secret; recorded here when its token was first imported, so
    /// single use holds for it too.
    pub foreign: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExportRecord {
    pub id: Uuid,
    pub session_id: Uuid,
    pub bundle_cid: String,
    pub label: Option<String>,
    pub message_count: u64,
    pub created_at: Timestamp,
    pub expires_at: Timestamp,
    pub foreign: bool,
    /// Set by the one import that consumed the token.
    pub imported_at: Option<Timestamp>,
    pub import_session_id: Option<Uuid>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkKind {
    Fork,
    Handoff,
    Import,
    /// The session moved from this gateway to `peer_gateway` (L6; the session is both ends).
    MigratedTo,
    /// The session moved to this gateway from `peer_gateway` (L6; the session is both ends).
    MigratedFrom,
}

impl LinkKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fork => "fork",
            Self::Handoff => "handoff",
            Self::Import => "import",
            Self::MigratedTo => "migrated_to",
            Self::MigratedFrom => "migrated_from",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::Fork,
            Self::Handoff,
            Self::Import,
            Self::MigratedTo,
            Self::MigratedFrom,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

/// One edge of the lineage graph: `from_session` gave rise to `to_session`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LinkRecord {
    pub id: Uuid,
    pub kind: LinkKind,
    /// The origin; `None` when an imported bundle named no usable session id.
    pub from_session: Option<Uuid>,
    pub to_session: Uuid,
    pub from_agent: Option<String>,
    pub to_agent: Option<String>,
    pub export_id: Option<Uuid>,
    pub label: Option<String>,
    pub reason: Option<String>,
    /// Messages of the origin that the new session starts from.
    pub fork_point: Option<u64>,
    /// An import with `allow_reuse` (a fork of the bundle; the token was not consumed).
    pub reused: bool,
    pub created_at: Timestamp,
    /// The other gateway of a move (`MigratedTo`, `MigratedFrom`).
    pub peer_gateway: Option<String>,
}

/// The memory document of a session: opaque `payload` in the format named by `schema_id`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryRecord {
    pub schema_id: String,
    pub payload: Value,
    pub updated_at: Timestamp,
}

/// A snapshot copied into a new session with the counts it had at the origin (adjusted by the caller).
#[derive(Debug, Clone, PartialEq)]
pub struct RestoredSnapshot {
    pub snapshot: NewSnapshot,
    pub step_count: u64,
    pub message_count: u64,
}

/// A session created with a history (import, fork, handoff), in one atomic write with everything
/// that records where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct AdoptSession {
    pub session: NewSession,
    pub status: SessionStatus,
    pub step_count: u64,
    pub last_task: Option<String>,
    pub model: Option<String>,
    pub messages: Vec<NewMessage>,
    pub snapshot: Option<RestoredSnapshot>,
    pub memory: Option<(String, Value)>,
    /// Stored by CID (kept when already there).
    pub bundle: Option<NewBundle>,
    /// Inserted unless an export with this id exists.
    pub export: Option<NewExport>,
    /// Marks this export consumed by the new session; `StoreError::Consumed` if it already was, and
    /// then nothing of this write happens.
    pub consume_export: Option<Uuid>,
    pub link: Option<LinkRecord>,
    /// Moves this session to `suspended` in the same write (the source of a handoff); a status that
    /// cannot be suspended is `Conflict`.
    pub suspend: Option<Uuid>,
    pub now: Timestamp,
}

/// Everything lineage shows about one session.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Lineage {
    /// Exports of the session, oldest first.
    pub exports: Vec<ExportRecord>,
    /// Links whose origin is the session, oldest first.
    pub outgoing: Vec<LinkRecord>,
    /// Links that lead to the session, oldest first.
    pub incoming: Vec<LinkRecord>,
}

/// The new session of an [`AdoptSession`].
pub type AdoptOutcome = SessionRecord;
