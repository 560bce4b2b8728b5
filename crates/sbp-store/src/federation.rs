//! Records of gateway federation (L6): the node's identity, the peers it trusts, the replay cache
//! of federation tokens, the announcements a gateway made to its trackers, and a tracker's registry
//! (the providers' signed records and what it verified about each gateway). None of this is session
//! content: these values are stored as they are, also with encryption at rest on.

use serde::Serialize;
use serde_json::Value;

use crate::Timestamp;

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
