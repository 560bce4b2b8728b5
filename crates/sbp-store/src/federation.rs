//! Records of gateway federation (L6): the node's identity, the peers it trusts, the replay cache
//! of federation tokens, the announcements a gateway made to its trackers, a tracker's registry
//! (the providers' signed records and what it verified about each gateway), and where a session is
//! held while it moves between gateways. None of this is session content: these values are stored
//! as they are, also with encryption at rest on (a migrated session's own content is sealed like
//! any other session's).

use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::{AdoptSession, ConflictKind, NewTetherEntry, Timestamp};

/// The node's federation identity, written once and shared by every replica of a deployment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FederationIdentity {
    /// Derived from the first identity key; kept for ever, also across key rotations.
    pub gateway_id: String,
    pub first_key_id: String,
    pub created_at: Timestamp,
}

/// How a peer's key came to be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerSource {
    /// Pinned in the configuration (`--peer URL#KEY`, `--tracker URL#KEY`).
    Pin,
    /// Vouched for by a pinned tracker.
    Tracker,
    /// Trusted on first use (`--federation-tofu`).
    Tofu,
}

impl PeerSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pin => "pin",
            Self::Tracker => "tracker",
            Self::Tofu => "tofu",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::Pin, Self::Tracker, Self::Tofu]
            .into_iter()
            .find(|k| k.as_str() == s)
    }
}

/// A peer gateway (or tracker) and the key this node trusts for it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PeerRecord {
    pub gateway_id: String,
    pub url: String,
    /// The manifest's `public_key` (standard base64 of the SPKI DER).
    pub public_key: String,
    pub key_id: String,
    /// The manifest's `old_keys` (a JSON array), stored as given.
    pub old_keys: Value,
    pub source: PeerSource,
    pub verified_at: Timestamp,
    pub updated_at: Timestamp,
}

/// What this gateway last announced to its trackers for one bundle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Announcement {
    pub bundle_cid: String,
    /// The record's `seq`: grows with every announcement of the bundle.
    pub seq: u64,
    pub expires_at: Timestamp,
    pub announced_at: Timestamp,
}

/// A provider record held by a tracker: the typed fields it is looked up and ordered by, and the
/// signed JSON exactly as the announcing gateway sent it (served back verbatim).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegistryRecordRow {
    pub gateway_id: String,
    pub bundle_cid: String,
    pub bundle_url: String,
    pub seq: u64,
    pub issued_at: Timestamp,
    pub expires_at: Timestamp,
    pub record: String,
}

/// What [`crate::RegistryStore::put_record`] did with a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PutRecord {
    /// No live record of this gateway for the CID existed; this one is stored.
    Inserted,
    /// It replaced the live record of a lower `seq`.
    Replaced,
    /// The live record has this `seq` and these very bytes: nothing changed.
    Unchanged,
    /// The live record has a higher `seq`, or this `seq` with other bytes: nothing changed.
    Stale,
    /// The gateway already has its maximum of live records: nothing changed.
    QuotaExceeded,
}

/// What a tracker verified about a gateway (its manifest at `verified_at`), which it vouches for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VouchRow {
    pub gateway_id: String,
    pub gateway_url: String,
    pub public_key: String,
    pub key_id: String,
    pub verified_at: Timestamp,
}

/// Where a session is held, as this gateway sees it (`session_holds.state`; no row is `Home`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HoldState {
    /// Held here: turns and pushes run here.
    Home,
    /// Held here, leased to a peer for a handover until `lease_expires_at`: no turn may begin.
    Leased,
    /// Held by the peer it moved to; the row here is a stale copy.
    Moved,
    /// Adopted from a peer whose commit is not confirmed yet.
    Incoming,
}

impl HoldState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Home => "home",
            Self::Leased => "leased",
            Self::Moved => "moved",
            Self::Incoming => "incoming",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::Home, Self::Leased, Self::Moved, Self::Incoming]
            .into_iter()
            .find(|k| k.as_str() == s)
    }
}

/// Why a hold refuses a turn or a pushed turn of its session at `now`, if it does: an unexpired
/// lease or an unfinished adoption (the session is on its way), or a move away. The one rule
/// both backends apply inside the write.
pub(crate) fn hold_refuses_writes(
    state: HoldState,
    lease_expires_at: Option<Timestamp>,
    now: Timestamp,
) -> Option<ConflictKind> {
    match state {
        HoldState::Home => None,
        HoldState::Leased if lease_expires_at.is_some_and(|until| until > now) => {
            Some(ConflictKind::SessionMoving)
        }
        // An expired lease no longer holds the session: it is home again (the reaper's row
        // update only catches up).
        HoldState::Leased => None,
        HoldState::Incoming => Some(ConflictKind::SessionMoving),
        HoldState::Moved => Some(ConflictKind::SessionMoved),
    }
}

/// A session's hold (`session_holds`). `epoch` grows by one with every lease, on whichever
/// gateway, so the latest holder of a session has the highest epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HoldRow {
    pub session_id: Uuid,
    pub epoch: u64,
    pub state: HoldState,
    /// The other gateway of the move: the lessee or new holder (`Leased`, `Moved`), the origin
    /// (`Incoming`); `None` at home.
    pub peer_gateway: Option<String>,
    pub peer_url: Option<String>,
    /// The move this row is about (also kept at home after an incoming move finished).
    pub migration_id: Option<Uuid>,
    /// Set while `Leased`.
    pub lease_expires_at: Option<Timestamp>,
    pub updated_at: Timestamp,
}

/// The origin's lease of a session to the gateway that asked for it ([`crate::HoldStore::lease_handover`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRequest {
    pub session_id: Uuid,
    pub to_gateway: String,
    pub to_url: String,
    pub migration_id: Uuid,
    pub now: Timestamp,
    /// The lease's expiry.
    pub until: Timestamp,
}

/// A session the target adopts under its origin's id and token ([`crate::HoldStore::adopt_migrated`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AdoptMigrated {
    /// The session (the origin's id and `token_hash`), status, counts, messages (verbatim),
    /// snapshot, memory and bundle; its `link`, `export`, `consume_export` and `suspend` are for
    /// imports and stay `None`.
    pub adopt: AdoptSession,
    /// The origin's undelivered tether entries, each under the seq it had there.
    pub tether: Vec<(u64, NewTetherEntry)>,
    /// The origin's next tether seq, so no seq is ever issued twice.
    pub tether_next_seq: u64,
    /// The epoch of the origin's lease.
    pub epoch: u64,
    pub from_gateway: String,
    pub from_url: String,
    pub migration_id: Uuid,
}
