//! Session endpoints: create, list, inspect, delete, transcript, status, snapshots,
//! backend-pushed turns, the conformance suite's tether loader, and the health check.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use super::present;
use crate::{SessionStatus, SurfaceContext};

/// `GET /healthz`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Health {
    /// `ok`.
    pub status: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `POST /v1/sessions` (or `/v1/sbp/sessions`): a new idle session.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NewSession {
    /// 1 to 256 characters; without it, `X-Agent-Id` or a generated id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    /// A JSON object, kept with the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
}

/// The 201 answer to [`NewSession`].
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionCreated {
    pub session_id: String,
    /// Returned once; the gateway keeps only its hash.
    pub session_token: String,
    #[serde(default)]
    pub agent_id: Option<String>,
    #[serde(default)]
    pub status: Option<SessionStatus>,
    #[serde(default)]
    pub step_count: u64,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub metadata: Value,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `GET /v1/sessions/{id}`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub session_id: String,
    #[serde(default)]
    pub agent_id: Option<String>,
    pub status: SessionStatus,
    #[serde(default)]
    pub step_count: u64,
    #[serde(default)]
    pub message_count: u64,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub updated_at: Option<String>,
    #[serde(default)]
    pub last_task: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub surface_attached: bool,
    /// The attached surface's context, when one is attached.
    #[serde(default, deserialize_with = "lenient_surface")]
    pub surface: Option<SurfaceContext>,
    #[serde(default)]
    pub tether_enabled: bool,
    /// Tether turns waiting for a surface.
    #[serde(default)]
    pub tether_turns_pending: u64,
    /// `tether_turns_pending` under the reference server's name.
    #[serde(default)]
    pub queued_turns: Option<u64>,
    #[serde(default)]
    pub latest_snapshot_id: Option<String>,
    /// When the snapshot a recovery resumes from was taken.
    #[serde(default)]
    pub last_checkpoint: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl SessionInfo {
    /// Fills the fields that repeat another under a second name.
    pub fn with_aliases(mut self) -> Self {
        self.queued_turns = Some(self.tether_turns_pending);
        self
    }
}

/// The query of `GET /v1/sessions`. The gateway parses it with this type.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionsQuery {
    /// 1 to 100; 20 by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page (opaque).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<String>,
    /// Only this agent's sessions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    /// Only sessions in this status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<SessionStatus>,
}

/// A session as `GET /v1/sessions` lists it: what identifies and counts it, none of its content
/// (no metadata, no task: `GET /v1/sessions/{id}` with its token shows those).
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionSummary {
    pub session_id: String,
    #[serde(default)]
    pub agent_id: Option<String>,
    pub status: SessionStatus,
    #[serde(default)]
    pub step_count: u64,
    #[serde(default)]
    pub message_count: u64,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub updated_at: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub tether_enabled: bool,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `GET /v1/sessions`: one page of sessions, newest first (by creation, then id).
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionList {
    /// `list`.
    #[serde(default)]
    pub object: String,
    #[serde(default)]
    pub data: Vec<SessionSummary>,
    #[serde(default)]
    pub has_more: bool,
    /// Pass as `cursor` to get the next page; `null` on the last one.
    #[serde(default)]
    pub next_cursor: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The answer to `DELETE /v1/sessions/{id}`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionDeleted {
    pub session_id: String,
    /// `true`.
    #[serde(default)]
    pub deleted: bool,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The query of `GET /v1/sessions/{id}/messages`. The gateway parses it with this type.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessagesQuery {
    /// Only messages after this seq (`next_after` of the previous page).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u64>,
    /// 1 to 1000 (clamped); 100 by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// One page of `GET /v1/sessions/{id}/messages`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessagePage {
    #[serde(default)]
    pub session_id: Option<String>,
    pub messages: Vec<StoredMessage>,
    /// The whole transcript's length.
    #[serde(default)]
    pub message_count: u64,
    #[serde(default)]
    pub has_more: bool,
    /// Pass as `after` to get the next page.
    #[serde(default)]
    pub next_after: Option<u64>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A message of the stored transcript: the chat message object as it was given, with the gateway's
/// `seq`, `model_used`, `cost_usd` and `created_at`.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredMessage {
    pub role: String,
    /// A string, an array of content parts, `null` (a tool-call message) or, when the message had
    /// none, absent (`None`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub content: Option<Value>,
    #[serde(default)]
    pub seq: Option<u64>,
    #[serde(default)]
    pub model_used: Option<String>,
    #[serde(default)]
    pub cost_usd: Option<f64>,
    #[serde(default)]
    pub created_at: Option<String>,
    /// `tool_calls`, `tool_call_id`, `name`, ...
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl StoredMessage {
    /// The content when it is plain text.
    pub fn text(&self) -> Option<&str> {
        self.content.as_ref().and_then(Value::as_str)
    }
}

/// `PATCH` (or `POST`) `/v1/sbp/sessions/{id}/status`. The gateway parses it with this type: a
/// status it does not know is refused with its own message, so `status` is a string here.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetStatus {
    /// `running`, `suspended`, `completed` or `failed`.
    pub status: String,
}

impl SetStatus {
    pub fn new(status: SessionStatus) -> Self {
        Self {
            status: status.as_str().to_owned(),
        }
    }
}

/// The answer to [`SetStatus`].
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusChanged {
    pub session_id: String,
    pub status: SessionStatus,
    #[serde(default)]
    pub previous_status: Option<SessionStatus>,
    #[serde(default)]
    pub step_count: u64,
    #[serde(default)]
    pub updated_at: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A snapshot as `GET /v1/sbp/sessions/{id}/snapshots` lists it.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub snapshot_id: String,
    /// `pre_action`, `post_action` or `checkpoint`.
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub step_count: u64,
    /// The snapshot's messages are the transcript's first `message_count`.
    #[serde(default)]
    pub message_count: u64,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub current_task: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub state: Value,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `GET /v1/sbp/sessions/{id}/snapshots`: newest first.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotList {
    pub session_id: String,
    #[serde(default)]
    pub snapshots: Vec<SnapshotInfo>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `GET /v1/sbp/sessions/{id}/snapshots/latest`: the snapshot with its messages.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub session_id: String,
    #[serde(flatten)]
    pub snapshot: SnapshotInfo,
    /// The chat message objects, as stored.
    #[serde(default)]
    pub messages: Vec<Value>,
}

/// `POST /v1/sbp/sessions/{id}/turns`: a turn pushed by a backend.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushTurn {
    pub content: String,
    /// `assistant` (the default), `user`, `tool` or `system`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_used: Option<String>,
}

impl PushTurn {
    /// An assistant turn.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            role: None,
            model_used: None,
        }
    }
}

/// How a pushed turn was delivered.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Delivery {
    /// Streamed to the attached surface (and tethered until acknowledged).
    Live,
    /// No surface attached: waiting in the tether.
    Tethered,
    /// A value this version does not know (never sent by this gateway).
    #[serde(other)]
    #[cfg_attr(feature = "openapi", schemars(skip))]
    Other,
}

/// The 201 answer to [`PushTurn`].
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushedTurn {
    pub session_id: String,
    /// The turn's tether seq (what TETHER_TURN / TURN_COMPLETE will carry).
    pub seq: u64,
    pub delivery: Delivery,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The answer of the conformance suite's tether loader (`POST .../_test/tether`, only with
/// `--enable-test-hooks`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TetherLoaded {
    pub session_id: String,
    #[serde(default)]
    pub enqueued: u64,
    /// The tether seq of each turn, in order.
    #[serde(default)]
    pub seqs: Vec<u64>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A SurfaceContext as a gateway echoes it, parsed with the lenient parser (never fails).
fn lenient_surface<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SurfaceContext>, D::Error> {
    let v = Option::<Value>::deserialize(d)?;
    Ok(v.filter(|v| !v.is_null())
        .map(|v| SurfaceContext::from_value(&v)))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::rest::test_support::{has_aliases, parses, round_trips};

    #[test]
    fn gateway_bodies_round_trip() {
        let ts = "2025-01-02T03:04:05.678Z";
        let id = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";
        round_trips::<Health>(&json!({"status": "ok"}));
        round_trips::<SessionCreated>(&json!({
            "session_id": id, "session_token": "tok", "agent_id": "a1", "status": "idle",
            "step_count": 0, "created_at": ts, "metadata": {"k": 1}
        }));
        let view = json!({
            "session_id": id, "agent_id": "a1", "status": "running", "step_count": 1,
            "message_count": 5, "created_at": ts, "updated_at": ts, "last_task": null,
            "model": "sbp/echo", "surface_attached": true,
            "surface": {"device_type": "mobile", "mcp_tools": ["gps"], "x_custom": 1},
            "tether_enabled": true, "tether_turns_pending": 2, "queued_turns": 2,
            "latest_snapshot_id": id, "last_checkpoint": ts
        });
        round_trips::<SessionInfo>(&view);
        let mut detached = view;
        detached["surface"] = Value::Null;
        detached["latest_snapshot_id"] = Value::Null;
        round_trips::<SessionInfo>(&detached);
        round_trips::<MessagePage>(&json!({
            "session_id": id, "message_count": 3, "has_more": true, "next_after": 1,
            "messages": [
                {"role": "user", "content": "hi", "seq": 0, "model_used": null,
                 "cost_usd": null, "created_at": ts},
                {"role": "user", "seq": 1, "model_used": null, "cost_usd": 0.25, "created_at": ts},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c"}], "seq": 2,
                 "model_used": "m", "cost_usd": null, "created_at": ts}
            ]
        }));
        round_trips::<StatusChanged>(&json!({
            "session_id": id, "status": "completed", "previous_status": "idle",
            "step_count": 1, "updated_at": ts
        }));
        let snapshot = json!({
            "snapshot_id": id, "kind": "checkpoint", "step_count": 1, "message_count": 3,
            "created_at": ts, "current_task": null, "model": "sbp/echo", "state": {"turn_id": id}
        });
        round_trips::<SnapshotList>(&json!({"session_id": id, "snapshots": [snapshot]}));
        let mut latest = snapshot;
        latest["session_id"] = json!(id);
        latest["messages"] = json!([{"role": "user"}, {"role": "assistant", "content": "x"}]);
        round_trips::<Snapshot>(&latest);
        for delivery in ["live", "tethered"] {
            round_trips::<PushedTurn>(&json!({"session_id": id, "seq": 3, "delivery": delivery}));
        }
        round_trips::<TetherLoaded>(&json!({"session_id": id, "enqueued": 2, "seqs": [4, 5]}));
        let listed = json!({
            "session_id": id, "agent_id": "a1", "status": "suspended", "step_count": 2,
            "message_count": 4, "created_at": ts, "updated_at": ts, "model": null,
            "tether_enabled": true
        });
        for next in [json!("abc"), Value::Null] {
            round_trips::<SessionList>(&json!({
                "object": "list", "data": [listed.clone()], "has_more": next.is_string(),
                "next_cursor": next
            }));
        }
        round_trips::<SessionDeleted>(&json!({"session_id": id, "deleted": true}));
        round_trips::<SessionsQuery>(&json!({"limit": 5, "cursor": "c", "status": "idle"}));
        round_trips::<SessionsQuery>(&json!({}));
    }

    #[test]
    fn minimal_foreign_bodies_parse() {
        parses::<SessionCreated>(&json!({"session_id": "s", "session_token": "t"}));
        let info: SessionInfo = parses(&json!({"session_id": "s", "status": "idle"}));
        assert_eq!(info.queued_turns, None);
        let page: MessagePage = parses(&json!({"messages": [{"role": "user"}]}));
        assert_eq!(page.messages[0].content, None);
        parses::<StatusChanged>(&json!({"session_id": "s", "status": "failed"}));
        parses::<SnapshotList>(&json!({"session_id": "s"}));
        parses::<Snapshot>(&json!({"session_id": "s", "snapshot_id": "n"}));
        parses::<TetherLoaded>(&json!({"session_id": "s"}));
        let list: SessionList = parses(&json!({"data": [{"session_id": "s", "status": "idle"}]}));
        assert_eq!((list.has_more, list.next_cursor), (false, None));
        parses::<SessionDeleted>(&json!({"session_id": "s"}));
        parses::<Health>(&json!({"status": "ok"}));
    }

    #[test]
    fn sent_views_carry_every_name() {
        let info: SessionInfo = parses(&json!({
            "session_id": "s", "status": "idle", "tether_turns_pending": 4
        }));
        has_aliases(
            &info.with_aliases(),
            &[("tether_turns_pending", "queued_turns")],
        );
    }

    #[test]
    fn unknown_enum_values_and_fields_parse() {
        let pushed: PushedTurn =
            parses(&json!({"session_id": "s", "seq": 3, "delivery": "queued"}));
        assert_eq!(pushed.delivery, Delivery::Other);
        let info: SessionInfo = parses(&json!({
            "session_id": "s", "status": "running", "surface": {"device_type": 5, "x": 1},
            "something_new": true
        }));
        let surface = info.surface.expect("surface");
        assert_eq!(
            surface.device_type, None,
            "a wrong type is dropped, not fatal"
        );
        assert_eq!(info.extra["something_new"], json!(true));
    }

    #[test]
    fn absent_and_null_content_stay_apart() {
        let cases = [
            (json!({"role": "user"}), None),
            (
                json!({"role": "assistant", "content": null}),
                Some(Value::Null),
            ),
            (json!({"role": "user", "content": "hi"}), Some(json!("hi"))),
        ];
        for (body, content) in cases {
            let m: StoredMessage = parses(&body);
            assert_eq!(m.content, content, "{body}");
            let back = serde_json::to_value(&m).expect("serialises");
            assert_eq!(back.get("content"), body.get("content"), "{body}");
        }
    }

    #[test]
    fn optional_request_fields_are_left_out() {
        let cases = [
            (serde_json::to_value(NewSession::default()), json!({})),
            (
                serde_json::to_value(PushTurn::assistant("x")),
                json!({"content": "x"}),
            ),
            (
                serde_json::to_value(SetStatus::new(SessionStatus::Suspended)),
                json!({"status": "suspended"}),
            ),
            (serde_json::to_value(MessagesQuery::default()), json!({})),
        ];
        for (got, want) in cases {
            assert_eq!(got.expect("serialises"), want);
        }
    }
}
