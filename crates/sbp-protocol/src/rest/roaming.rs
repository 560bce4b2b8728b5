//! L3 roaming endpoints: export, token inspection, import, fork, handoff, the export list, the
//! lineage and the session's memory.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::present;
use crate::SessionStatus;

/// The `status` of a handoff and of the handoff links of a lineage (a handoff is one atomic write:
/// once it is visible it has completed).
pub const HANDOFF_COMPLETED: &str = "completed";

/// `POST /v1/sbp/sessions/{id}/export`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExportRequest {
    /// 60 to 604800; the gateway's default when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    /// At most 120 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Return the sealed bundle too, for a gateway that does not share this one's secret.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub include_bundle: bool,
}

/// The 201 answer to [`ExportRequest`].
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Export {
    pub export_id: String,
    pub roaming_token: String,
    /// `roaming_token` under the reference server's name.
    #[serde(default)]
    pub token: Option<String>,
    pub bundle_cid: String,
    /// `bundle_cid` under the reference server's name.
    #[serde(default)]
    pub bundle_hash: Option<String>,
    #[serde(default)]
    pub expires_at: Option<String>,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub message_count: Option<u64>,
    #[serde(default)]
    pub label: Option<String>,
    #[serde(default)]
    pub session_id: Option<String>,
    /// The sealed bundle, only when asked for (`include_bundle`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Export {
    /// Fills the fields that repeat another under a second name.
    pub fn with_aliases(mut self) -> Self {
        self.token = Some(self.roaming_token.clone());
        self.bundle_hash = Some(self.bundle_cid.clone());
        self
    }
}

/// `POST /v1/sbp/sessions/import`: a roaming token, a raw bundle, or both. The gateway also takes
/// `token` for `roaming_token` and `agent_id` for `target_agent_id`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ImportRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roaming_token: Option<String>,
    /// A sealed bundle (a JSON object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_agent_id: Option<String>,
    /// Do not consume the token: the import is a fork.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_reuse: bool,
}

impl ImportRequest {
    pub fn token(roaming_token: impl Into<String>) -> Self {
        Self {
            roaming_token: Some(roaming_token.into()),
            ..Self::default()
        }
    }
}

/// The 201 answer to [`ImportRequest`]: the new session.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImportInfo {
    pub session_id: String,
    /// `session_id` under the HTTP API docs' name.
    #[serde(default)]
    pub new_session_id: Option<String>,
    pub session_token: String,
    #[serde(default)]
    pub agent_id: Option<String>,
    #[serde(default)]
    pub status: Option<SessionStatus>,
    #[serde(default)]
    pub step_count: u64,
    #[serde(default)]
    pub message_count: u64,
    #[serde(default)]
    pub messages_restored: u64,
    #[serde(default)]
    pub memory_restored: bool,
    /// Why the bundle's memory was not restored, when it was not.
    #[serde(default)]
    pub memory_skipped_reason: Option<String>,
    #[serde(default)]
    pub snapshot_restored: bool,
    /// The export the token named (none for a raw bundle of an unknown export).
    #[serde(default)]
    pub export_id: Option<String>,
    /// `export_id` under the reference server's name.
    #[serde(default)]
    pub origin_export_id: Option<String>,
    #[serde(default)]
    pub source_session_id: Option<String>,
    #[serde(default)]
    pub bundle_cid: Option<String>,
    /// Imported with `allow_reuse`: a fork of the bundle.
    #[serde(default)]
    pub forked: bool,
    #[serde(default)]
    pub provenance: Option<Provenance>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ImportInfo {
    /// Fills the fields that repeat another under a second name.
    pub fn with_aliases(mut self) -> Self {
        self.new_session_id = Some(self.session_id.clone());
        self.origin_export_id = self.export_id.clone();
        self
    }
}

/// Where an imported session came from (SPEC 8's `provenance`).
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Provenance {
    /// The source session.
    pub imported_from: Option<String>,
    pub export_id: Option<String>,
    pub bundle_cid: Option<String>,
    /// `roaming_token` or `bundle`.
    pub via: Option<String>,
    pub allow_reuse: bool,
    pub imported_at: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// An export, as `GET /v1/sbp/token/{token}`, the export list and the lineage describe it.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportInfo {
    pub export_id: String,
    pub session_id: String,
    #[serde(default)]
    pub label: Option<String>,
    #[serde(default)]
    pub bundle_cid: Option<String>,
    /// `bundle_cid` under the reference server's name.
    #[serde(default)]
    pub bundle_hash: Option<String>,
    #[serde(default)]
    pub message_count: Option<u64>,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub expires_at: Option<String>,
    #[serde(default)]
    pub expired: bool,
    /// Its token was consumed by an import.
    #[serde(default)]
    pub consumed: bool,
    #[serde(default)]
    pub imported_at: Option<String>,
    #[serde(default)]
    pub import_session_id: Option<String>,
    /// Recorded from another gateway's bundle.
    #[serde(default)]
    pub foreign: bool,
    /// Token inspection only: the token's `iat` (`Some(None)`: sent as `null`, an `iat` with no
    /// calendar date).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub issued_at: Option<Option<String>>,
    /// The export list and the lineage only: the imports of this export.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imports: Option<Vec<ExportImport>>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ExportInfo {
    /// Fills the fields that repeat another under a second name.
    pub fn with_aliases(mut self) -> Self {
        self.bundle_hash = self.bundle_cid.clone();
        self
    }
}

/// An import of an export, in the export list.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ExportImport {
    /// The session the import created.
    pub session_id: Option<String>,
    pub imported_at: Option<String>,
    pub allow_reuse: bool,
    pub agent_id: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `GET /v1/sbp/sessions/{id}/exports`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportList {
    pub session_id: String,
    #[serde(default)]
    pub exports: Vec<ExportInfo>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `POST /v1/sbp/sessions/{id}/fork`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ForkRequest {
    /// At most 120 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Keep only the leading system messages and the last this many (>= 1): how a session at its
    /// size limit continues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_last: Option<u64>,
}

/// The 201 answer to [`ForkRequest`]: the new session.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkInfo {
    pub fork_id: String,
    pub session_id: String,
    /// `session_id` under SPEC 8's name.
    #[serde(default)]
    pub fork_session_id: Option<String>,
    /// `session_id` under the HTTP API docs' name.
    #[serde(default)]
    pub new_session_id: Option<String>,
    pub session_token: String,
    /// `session_token` under SPEC 8's name.
    #[serde(default)]
    pub fork_session_token: Option<String>,
    #[serde(default)]
    pub label: Option<String>,
    /// `label` under SPEC 8's name.
    #[serde(default)]
    pub fork_label: Option<String>,
    #[serde(default)]
    pub origin_session_id: Option<String>,
    #[serde(default)]
    pub agent_id: Option<String>,
    /// The origin's step count at the fork.
    #[serde(default)]
    pub fork_point_step: Option<u64>,
    /// The origin's messages the fork starts from.
    #[serde(default)]
    pub fork_point_msg: Option<u64>,
    #[serde(default)]
    pub step_count: Option<u64>,
    #[serde(default)]
    pub message_count: Option<u64>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ForkInfo {
    /// Fills the fields that repeat another under a second name.
    pub fn with_aliases(mut self) -> Self {
        self.fork_session_id = Some(self.session_id.clone());
        self.new_session_id = Some(self.session_id.clone());
        self.fork_session_token = Some(self.session_token.clone());
        self.fork_label = self.label.clone();
        self
    }
}

/// `POST /v1/sbp/sessions/{id}/handoff`. The gateway also takes `target_agent_id`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HandoffRequest {
    /// 1 to 256 characters.
    pub to_agent_id: String,
    /// Put in front of the new session's transcript (at most 2000 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff_message: Option<String>,
    /// At most 500 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl HandoffRequest {
    pub fn to(agent_id: impl Into<String>) -> Self {
        Self {
            to_agent_id: agent_id.into(),
            handoff_message: None,
            reason: None,
        }
    }
}

/// The 201 answer to [`HandoffRequest`]: the other agent's new session.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HandoffInfo {
    #[serde(default)]
    pub handoff_id: Option<String>,
    /// The new session.
    pub session_id: String,
    /// `session_id` under the HTTP API docs' name.
    #[serde(default)]
    pub new_session_id: Option<String>,
    pub session_token: String,
    /// `session_token` under the HTTP API docs' name.
    #[serde(default)]
    pub new_session_token: Option<String>,
    #[serde(default)]
    pub source_session_id: Option<String>,
    /// `source_session_id` under the reference server's name.
    #[serde(default)]
    pub from_session_id: Option<String>,
    /// The source's status after the handoff (`suspended`).
    #[serde(default)]
    pub source_status: Option<SessionStatus>,
    #[serde(default)]
    pub from_agent_id: Option<String>,
    #[serde(default)]
    pub to_agent_id: Option<String>,
    /// `to_agent_id`, the new session's agent, under the session views' name.
    #[serde(default)]
    pub agent_id: Option<String>,
    #[serde(default)]
    pub export_id: Option<String>,
    #[serde(default)]
    pub bundle_cid: Option<String>,
    /// `bundle_cid` under the reference server's name.
    #[serde(default)]
    pub bundle_hash: Option<String>,
    #[serde(default)]
    pub step_count: Option<u64>,
    #[serde(default)]
    pub message_count: Option<u64>,
    /// [`HANDOFF_COMPLETED`].
    #[serde(default)]
    pub status: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl HandoffInfo {
    /// Fills the fields that repeat another under a second name.
    pub fn with_aliases(mut self) -> Self {
        self.new_session_id = Some(self.session_id.clone());
        self.new_session_token = Some(self.session_token.clone());
        self.from_session_id = self.source_session_id.clone();
        self.agent_id = self.to_agent_id.clone();
        self.bundle_hash = self.bundle_cid.clone();
        self
    }
}

/// `GET /v1/sbp/sessions/{id}/lineage`: the session's family tree.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lineage {
    pub session_id: String,
    /// With their imports.
    #[serde(default)]
    pub exports: Vec<ExportInfo>,
    #[serde(default)]
    pub outgoing_handoffs: Vec<OutgoingHandoff>,
    #[serde(default)]
    pub incoming_handoffs: Vec<IncomingHandoff>,
    /// Forks of this session: by the fork endpoint, or imports with `allow_reuse`.
    #[serde(default)]
    pub forks: Vec<ForkLink>,
    /// Where this session was forked from (fork, or an import with `allow_reuse`).
    #[serde(default)]
    pub origin: Option<ForkOrigin>,
    /// The session this one was imported from (a consuming import).
    #[serde(default)]
    pub imported_from: Option<ImportedFrom>,
    /// Consuming imports of this session's exports.
    #[serde(default)]
    pub imports: Vec<ImportLink>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A handoff from this session, in its lineage.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OutgoingHandoff {
    pub handoff_id: Option<String>,
    pub to_session_id: Option<String>,
    pub to_agent_id: Option<String>,
    /// `to_agent_id` under the reference server's name.
    pub to_agent: Option<String>,
    pub from_agent: Option<String>,
    pub reason: Option<String>,
    pub export_id: Option<String>,
    /// [`HANDOFF_COMPLETED`].
    pub status: Option<String>,
    pub created_at: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl OutgoingHandoff {
    /// Fills the fields that repeat another under a second name.
    pub fn with_aliases(mut self) -> Self {
        self.to_agent = self.to_agent_id.clone();
        self
    }
}

/// A handoff into this session, in its lineage.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct IncomingHandoff {
    pub handoff_id: Option<String>,
    pub from_session_id: Option<String>,
    pub from_agent_id: Option<String>,
    /// `from_agent_id` under the reference server's name.
    pub from_agent: Option<String>,
    pub to_agent: Option<String>,
    pub reason: Option<String>,
    pub export_id: Option<String>,
    /// [`HANDOFF_COMPLETED`].
    pub status: Option<String>,
    pub created_at: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl IncomingHandoff {
    /// Fills the fields that repeat another under a second name.
    pub fn with_aliases(mut self) -> Self {
        self.from_agent = self.from_agent_id.clone();
        self
    }
}

/// A fork of the session in its lineage.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkLink {
    #[serde(default)]
    pub fork_id: Option<String>,
    pub fork_session_id: String,
    #[serde(default)]
    pub fork_label: Option<String>,
    #[serde(default)]
    pub fork_point_msg: Option<u64>,
    /// `fork` (the fork endpoint) or `import` (an import with `allow_reuse`).
    #[serde(default)]
    pub via: Option<String>,
    #[serde(default)]
    pub export_id: Option<String>,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Where a forked session came from, in its lineage.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ForkOrigin {
    pub origin_session_id: Option<String>,
    pub fork_label: Option<String>,
    pub fork_point_msg: Option<u64>,
    pub forked_at: Option<String>,
    /// `fork` or `import`.
    pub via: Option<String>,
    pub export_id: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The session an imported session came from, in its lineage.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImportedFrom {
    pub source_session_id: Option<String>,
    pub export_id: Option<String>,
    pub from_agent: Option<String>,
    pub imported_at: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A consuming import of one of the session's exports, in its lineage.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImportLink {
    pub import_session_id: Option<String>,
    pub export_id: Option<String>,
    pub imported_at: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `PUT /v1/sbp/sessions/{id}/memory`: replaces the session's memory document.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryPut {
    /// The payload's format; the gateway's key-value schema when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_id: Option<String>,
    pub payload: Value,
}

/// `GET` (and the answer to `PUT`) `/v1/sbp/sessions/{id}/memory`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    pub session_id: String,
    #[serde(default)]
    pub schema_id: Option<String>,
    #[serde(default)]
    pub payload: Value,
    #[serde(default)]
    pub updated_at: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::rest::test_support::{has_aliases, parses, round_trips};

    const TS: &str = "2025-01-02T03:04:05.678Z";
    const ID: &str = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";
    const CID: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    fn export_info(consumed: bool) -> Value {
        json!({
            "export_id": ID, "session_id": ID, "label": null, "bundle_cid": CID,
            "bundle_hash": CID, "message_count": 5, "created_at": TS, "expires_at": TS,
            "expired": false, "consumed": consumed,
            "imported_at": if consumed { json!(TS) } else { Value::Null },
            "import_session_id": if consumed { json!(ID) } else { Value::Null },
            "foreign": false
        })
    }

    #[test]
    fn gateway_bodies_round_trip() {
        let export = json!({
            "export_id": ID, "roaming_token": "a.b.c", "token": "a.b.c", "bundle_cid": CID,
            "bundle_hash": CID, "expires_at": TS, "created_at": TS, "message_count": 5,
            "label": null, "session_id": ID
        });
        round_trips::<Export>(&export);
        let mut with_bundle = export;
        with_bundle["label"] = json!("L");
        with_bundle["bundle"] = json!({"bundle_cid": CID, "messages": []});
        round_trips::<Export>(&with_bundle);

        for (via, reuse, skipped) in [
            ("roaming_token", false, Value::Null),
            ("bundle", true, json!("unknown schema")),
        ] {
            round_trips::<ImportInfo>(&json!({
                "session_id": ID, "new_session_id": ID, "session_token": "t", "agent_id": "a1",
                "status": "idle", "step_count": 1, "message_count": 6, "messages_restored": 5,
                "memory_restored": skipped.is_null(), "memory_skipped_reason": skipped,
                "snapshot_restored": true, "origin_export_id": ID, "export_id": ID,
                "source_session_id": ID, "bundle_cid": CID, "forked": reuse,
                "provenance": {"imported_from": ID, "export_id": ID, "bundle_cid": CID,
                               "via": via, "allow_reuse": reuse, "imported_at": TS}
            }));
        }

        for consumed in [false, true] {
            let mut token = export_info(consumed);
            token["issued_at"] = json!(TS);
            round_trips::<ExportInfo>(&token);
            token["issued_at"] = Value::Null;
            round_trips::<ExportInfo>(&token);
        }
        let mut listed = export_info(true);
        listed["imports"] =
            json!([{"session_id": ID, "imported_at": TS, "allow_reuse": false, "agent_id": "a1"}]);
        round_trips::<ExportList>(&json!({"session_id": ID, "exports": [listed.clone()]}));

        for label in [json!("F"), Value::Null] {
            round_trips::<ForkInfo>(&json!({
                "fork_id": ID, "fork_session_id": ID, "new_session_id": ID, "session_id": ID,
                "fork_session_token": "t", "session_token": "t", "fork_label": label,
                "label": label, "origin_session_id": ID, "agent_id": "a1", "fork_point_step": 1,
                "fork_point_msg": 5, "step_count": 1, "message_count": 5
            }));
        }
        round_trips::<HandoffInfo>(&json!({
            "handoff_id": ID, "source_session_id": ID, "from_session_id": ID,
            "source_status": "suspended", "from_agent_id": "a1", "new_session_id": ID,
            "session_id": ID, "new_session_token": "t", "session_token": "t",
            "to_agent_id": "b", "agent_id": "b", "export_id": ID, "bundle_cid": CID,
            "bundle_hash": CID, "step_count": 1, "message_count": 6, "status": "completed"
        }));

        round_trips::<Lineage>(&json!({
            "session_id": ID, "exports": [listed],
            "outgoing_handoffs": [{"handoff_id": ID, "to_session_id": ID, "to_agent": "b",
                "to_agent_id": "b", "from_agent": "a1", "reason": null, "export_id": ID,
                "status": "completed", "created_at": TS}],
            "incoming_handoffs": [{"handoff_id": ID, "from_session_id": null, "from_agent": null,
                "from_agent_id": null, "to_agent": "a1", "reason": "r", "export_id": null,
                "status": "completed", "created_at": TS}],
            "forks": [{"fork_id": ID, "fork_session_id": ID, "fork_label": null,
                "fork_point_msg": 5, "via": "import", "export_id": ID, "created_at": TS}],
            "origin": {"origin_session_id": ID, "fork_label": "F", "fork_point_msg": 5,
                "forked_at": TS, "via": "fork", "export_id": null},
            "imported_from": {"source_session_id": ID, "export_id": ID, "from_agent": "a1",
                "imported_at": TS},
            "imports": [{"import_session_id": ID, "export_id": ID, "imported_at": TS}]
        }));
        round_trips::<Lineage>(&json!({
            "session_id": ID, "exports": [], "outgoing_handoffs": [], "incoming_handoffs": [],
            "forks": [], "origin": null, "imported_from": null, "imports": []
        }));

        round_trips::<Memory>(&json!({
            "session_id": ID, "schema_id": "urn:sbp:memory:kv:v1", "payload": {"x": 1},
            "updated_at": TS
        }));
    }

    #[test]
    fn minimal_foreign_bodies_parse() {
        let export: Export = parses(&json!({
            "export_id": "e", "roaming_token": "a.b.c", "bundle_cid": CID
        }));
        assert_eq!((export.token, export.bundle), (None, None));
        parses::<ImportInfo>(&json!({"session_id": "s", "session_token": "t"}));
        let info: ExportInfo = parses(&json!({"export_id": "e", "session_id": "s"}));
        assert_eq!((info.issued_at, info.imports), (None, None));
        parses::<ExportList>(&json!({"session_id": "s"}));
        parses::<ForkInfo>(&json!({"fork_id": "f", "session_id": "s", "session_token": "t"}));
        parses::<HandoffInfo>(&json!({"session_id": "s", "session_token": "t"}));
        let lineage: Lineage = parses(&json!({
            "session_id": "s", "outgoing_handoffs": [{}], "incoming_handoffs": [{"x": 1}],
            "forks": [{"fork_session_id": "f"}], "origin": {}, "imported_from": {}
        }));
        assert_eq!(lineage.incoming_handoffs[0].extra["x"], json!(1));
        parses::<Memory>(&json!({"session_id": "s"}));
    }

    #[test]
    fn sent_bodies_carry_every_name() {
        let export: Export = parses(&json!({
            "export_id": "e", "roaming_token": "a.b.c", "bundle_cid": CID
        }));
        has_aliases(
            &export.with_aliases(),
            &[("roaming_token", "token"), ("bundle_cid", "bundle_hash")],
        );
        let import: ImportInfo = parses(&json!({
            "session_id": "s", "session_token": "t", "export_id": "e"
        }));
        has_aliases(
            &import.with_aliases(),
            &[
                ("session_id", "new_session_id"),
                ("export_id", "origin_export_id"),
            ],
        );
        let info: ExportInfo = parses(&json!({
            "export_id": "e", "session_id": "s", "bundle_cid": CID
        }));
        has_aliases(&info.with_aliases(), &[("bundle_cid", "bundle_hash")]);
        let fork: ForkInfo = parses(&json!({
            "fork_id": "f", "session_id": "s", "session_token": "t", "label": "F"
        }));
        has_aliases(
            &fork.with_aliases(),
            &[
                ("session_id", "fork_session_id"),
                ("session_id", "new_session_id"),
                ("session_token", "fork_session_token"),
                ("label", "fork_label"),
            ],
        );
        let handoff: HandoffInfo = parses(&json!({
            "session_id": "s", "session_token": "t", "source_session_id": "o",
            "to_agent_id": "b", "bundle_cid": CID
        }));
        has_aliases(
            &handoff.with_aliases(),
            &[
                ("session_id", "new_session_id"),
                ("session_token", "new_session_token"),
                ("source_session_id", "from_session_id"),
                ("to_agent_id", "agent_id"),
                ("bundle_cid", "bundle_hash"),
            ],
        );
        let out: OutgoingHandoff = parses(&json!({"to_agent_id": "b"}));
        has_aliases(&out.with_aliases(), &[("to_agent_id", "to_agent")]);
        let inc: IncomingHandoff = parses(&json!({"from_agent_id": "a"}));
        has_aliases(&inc.with_aliases(), &[("from_agent_id", "from_agent")]);
    }

    #[test]
    fn optional_request_fields_are_left_out() {
        let cases = [
            (serde_json::to_value(ExportRequest::default()), json!({})),
            (
                serde_json::to_value(ImportRequest::token("t")),
                json!({"roaming_token": "t"}),
            ),
            (serde_json::to_value(ForkRequest::default()), json!({})),
            (
                serde_json::to_value(HandoffRequest::to("b")),
                json!({"to_agent_id": "b"}),
            ),
            (
                serde_json::to_value(MemoryPut {
                    schema_id: None,
                    payload: json!({"k": 1}),
                }),
                json!({"payload": {"k": 1}}),
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got.expect("serialises"), want);
        }
    }
}
