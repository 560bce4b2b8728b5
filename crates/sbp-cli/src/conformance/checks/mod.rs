//! The built-in checks, one module per level: each is an independent async function that makes
//! its own session, and the list below says which level it belongs to, what it verifies, and what
//! a node must serve for it to apply (a federation tracker serves no session: only its L6 checks
//! run against it).
//! They are derived from the seeds (which win over the spec where they differ); each says how
//! strongly what it verifies is required ([`Requirement`]): only a MUST check can fail, a SHOULD
//! or RECOMMENDED one that differs warns, and MUSTs no client can observe (durability across a
//! restart) are listed as such. Where field names differ between the seeds, the spec and the
//! reference server, every spelling is accepted.

mod l1;
mod l2;
mod l3;
mod l4;
mod l5;
pub mod l6;

use std::str::FromStr;
use std::sync::Arc;

use futures::future::BoxFuture;
use sbp_protocol::federation::Role;

use super::client::Ctx;
use super::outcome::{Outcome, Requirement};

/// A conformance level; levels are cumulative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    L1 = 1,
    L2,
    L3,
    L4,
    L5,
    L6,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Self::L1 => "L1",
            Self::L2 => "L2",
            Self::L3 => "L3",
            Self::L4 => "L4",
            Self::L5 => "L5",
            Self::L6 => "L6",
        }
    }
}

impl FromStr for Level {
    type Err = String;

    /// `L3`, `l3` or `3`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let digits = s.trim().trim_start_matches(['L', 'l']);
        match digits {
            "1" => Ok(Self::L1),
            "2" => Ok(Self::L2),
            "3" => Ok(Self::L3),
            "4" => Ok(Self::L4),
            "5" => Ok(Self::L5),
            "6" => Ok(Self::L6),
            _ => Err(format!(
                "'{s}' is not a level: use L1, L2, L3, L4, L5 or L6"
            )),
        }
    }
}

pub type CheckFn = fn(Arc<Ctx>) -> BoxFuture<'static, Outcome>;

/// What a node must serve for a check to apply to it: with federation a node may be a tracker
/// only, which serves no session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Sessions: every L1–L5 check and the gateway side of L6.
    Sessions,
    /// The registry: the tracker side of L6.
    Registry,
    /// Any federated node: its manifest.
    Federation,
}

impl Needs {
    /// Whether a node of `role` (`None`: no federation manifest, a plain gateway) is checked.
    pub fn applies_to(self, role: Option<Role>) -> bool {
        match (self, role) {
            (Self::Federation, _) | (Self::Sessions, None) => true,
            (Self::Sessions, Some(r)) => r.hosts_sessions(),
            (Self::Registry, Some(r)) => r.hosts_registry(),
            (Self::Registry, None) => false,
        }
    }
}

/// One built-in check.
pub struct Check {
    pub level: Level,
    pub id: &'static str,
    /// What it verifies, in one line (shown by `--format json` and in failures' context).
    pub title: &'static str,
    pub requirement: Requirement,
    pub needs: Needs,
    pub run: CheckFn,
}

macro_rules! check {
    ($level:ident, $id:literal, $title:literal, $f:path) => {
        check!($level, $id, $title, $f, Must)
    };
    ($level:ident, $id:literal, $title:literal, $f:path, $req:ident) => {
        check!($level, $id, $title, $f, $req, Sessions)
    };
    ($level:ident, $id:literal, $title:literal, $f:path, $req:ident, $needs:ident) => {
        Check {
            level: Level::$level,
            id: $id,
            title: $title,
            requirement: Requirement::$req,
            needs: Needs::$needs,
            run: |ctx| Box::pin($f(ctx)),
        }
    };
}

/// Every built-in check, in the order they run.
pub fn all() -> Vec<Check> {
    vec![
        // L1: stateful proxy.
        check!(
            L1,
            "l1.create_session",
            "POST /v1/sessions returns a UUID session_id and a session_token",
            l1::create_session
        ),
        check!(
            L1,
            "l1.completion_creates_session",
            "a completion with `sbp` answers in OpenAI form with sbp.session_id (UUID) and the session token",
            l1::completion_creates_session
        ),
        check!(
            L1,
            "l1.session_view",
            "GET /v1/sessions/{id} reports the session's status and step count",
            l1::session_view
        ),
        check!(
            L1,
            "l1.continue_with_token",
            "a completion with X-Session-Token continues the same session and counts the step",
            l1::continue_with_token
        ),
        check!(
            L1,
            "l1.transcript_persists",
            "the transcript holds both turns in order across calls (GET .../messages)",
            l1::transcript_persists
        ),
        check!(
            L1,
            "l1.agent_identity_stable",
            "the agent id of a session stays the same across calls",
            l1::agent_identity_stable
        ),
        check!(
            L1,
            "l1.model_agnostic",
            "any model string is accepted or refused cleanly, and rerouting is named in sbp.model_routed_to",
            l1::model_agnostic
        ),
        check!(
            L1,
            "l1.sbp_namespace_consumed",
            "the request's sbp options are consumed: not echoed in the response (the upstream body is not observable here)",
            l1::sbp_namespace_consumed
        ),
        check!(
            L1,
            "l1.force_new_session",
            "sbp.force_new_session starts a new session even with a session token",
            l1::force_new_session
        ),
        check!(
            L1,
            "l1.error_bad_json",
            "malformed JSON gets 400 in the {\"error\":{\"code\":\"SBP_...\"}} envelope",
            l1::error_bad_json
        ),
        check!(
            L1,
            "l1.error_unknown_session",
            "an unknown session id gets 404 SBP_SESSION_NOT_FOUND",
            l1::error_unknown_session
        ),
        check!(
            L1,
            "l1.error_invalid_uuid",
            "a session path that is not a UUID gets 422 SBP_INVALID_UUID (or 404)",
            l1::error_invalid_uuid
        ),
        check!(
            L1,
            "l1.error_bad_token",
            "a wrong session token is refused (401/403) in the SBP envelope",
            l1::error_bad_token
        ),
        check!(
            L1,
            "l1.messages_survive_restart",
            "messages persist across a restart of the gateway (a MUST no client can observe)",
            l1::messages_survive_restart
        ),
        // L2: tether and resume.
        check!(
            L2,
            "l2.attach_handshake",
            "ATTACH_SESSION gets SESSION_ATTACHED with the session id and the queued-turns count",
            l2::attach_handshake
        ),
        check!(
            L2,
            "l2.first_frame_must_attach",
            "a first frame other than ATTACH_SESSION gets PROTOCOL_ERROR and close 1003",
            l2::first_frame_must_attach
        ),
        check!(
            L2,
            "l2.attach_unknown_session",
            "attaching to an unknown session gets SESSION_NOT_FOUND and close 4004",
            l2::attach_unknown_session
        ),
        check!(
            L2,
            "l2.attach_bad_token",
            "attaching with a wrong token gets FORBIDDEN and close 4003",
            l2::attach_bad_token
        ),
        check!(
            L2,
            "l2.live_streaming",
            "a turn while attached streams as TURN_CHUNKs and a TURN_COMPLETE of one chunk_id, equal to the reply",
            l2::live_streaming
        ),
        check!(
            L2,
            "l2.tether_after_detach",
            "after DETACH a turn is tethered, drained once as TETHER_TURN on re-attach, then gone",
            l2::tether_after_detach
        ),
        check!(
            L2,
            "l2.drop_suspends",
            "dropping the TCP connection without DETACH suspends the session",
            l2::drop_suspends
        ),
        check!(
            L2,
            "l2.drain_after_drop",
            "drop without DETACH, push a turn, re-attach with last_seq: the TETHER_TURN comes once; ACK; re-attach: nothing queued",
            l2::drain_after_drop
        ),
        check!(
            L2,
            "l2.suspended_returns_202",
            "a completion on a suspended session gets 202 resume_available (SPEC 6.3 SHOULD)",
            l2::suspended_returns_202,
            Should
        ),
        check!(
            L2,
            "l2.unknown_frames_ignored",
            "PONG and unknown frame types are ignored: the connection stays and streams the next turn",
            l2::unknown_frames_ignored
        ),
        check!(
            L2,
            "l2.second_surface_displaces",
            "a second surface attaching gets the next turn; if the first connection is closed, its code is noted",
            l2::second_surface_displaces,
            Optional
        ),
        check!(
            L2,
            "l2.tether_survives_restart",
            "the Tether survives a restart of the gateway (a MUST no client can observe)",
            l2::tether_survives_restart
        ),
        // L3: roaming.
        check!(
            L3,
            "l3.export",
            "export answers 201 with a JWT roaming_token and a 64-hex bundle_cid (and a UUID export_id, when it names one)",
            l3::export
        ),
        check!(
            L3,
            "l3.bundle_cid",
            "the exported bundle has the required fields and its bundle_cid is sha256 of its canonical JSON",
            l3::bundle_cid
        ),
        check!(
            L3,
            "l3.token_inspect",
            "GET /v1/sbp/token/{token} describes the export without consuming it",
            l3::token_inspect,
            Should
        ),
        check!(
            L3,
            "l3.import",
            "importing the token makes a new session holding the exported messages",
            l3::import
        ),
        check!(
            L3,
            "l3.single_use",
            "a second import of the same token is refused with 410 SBP_TOKEN_CONSUMED",
            l3::single_use
        ),
        check!(
            L3,
            "l3.allow_reuse_forks",
            "allow_reuse: true imports a consumed token again as an independent session",
            l3::allow_reuse_forks
        ),
        check!(
            L3,
            "l3.tampered_token",
            "a token with a changed payload or signature is refused with 422 SBP_TOKEN_INVALID",
            l3::tampered_token
        ),
        check!(
            L3,
            "l3.tampered_bundle",
            "a bundle whose content no longer matches its bundle_cid is refused with 422 SBP_TOKEN_INTEGRITY",
            l3::tampered_bundle
        ),
        check!(
            L3,
            "l3.fork",
            "fork makes an independent session with the same history",
            l3::fork,
            Should
        ),
        check!(
            L3,
            "l3.handoff",
            "handoff makes a session under the target agent and suspends the source",
            l3::handoff,
            Should
        ),
        check!(
            L3,
            "l3.lineage",
            "lineage lists the session's exports and forks",
            l3::lineage,
            Should
        ),
        // L4: surfaces.
        check!(
            L4,
            "l4.surface_context_accepted",
            "a full SurfaceContext is accepted; SESSION_ATTACHED names its device_type",
            l4::surface_context_accepted
        ),
        check!(
            L4,
            "l4.surface_field_alias",
            "the SurfaceContext is also accepted under `surface`",
            l4::surface_field_alias
        ),
        check!(
            L4,
            "l4.surface_null",
            "surface: null and an empty SurfaceContext are handled as device_type unknown",
            l4::surface_null
        ),
        check!(
            L4,
            "l4.unknown_fields_tolerated",
            "unknown fields, device types and capabilities are tolerated",
            l4::unknown_fields_tolerated
        ),
        check!(
            L4,
            "l4.iot_budget_shorter",
            "an iot surface with max_output_tokens gets a shorter rendering of a long reply than a desktop",
            l4::iot_budget_shorter
        ),
        // L5: MCP bridge.
        check!(
            L5,
            "l5.tools_registered",
            "declared mcp_tools are listed in SESSION_ATTACHED.mcp_tools_registered",
            l5::tools_registered
        ),
        check!(
            L5,
            "l5.tool_call_roundtrip",
            "POST .../tool_calls reaches the surface as TOOL_CALL (UUID call_id); its TOOL_RESULT is the HTTP answer",
            l5::tool_call_roundtrip
        ),
        check!(
            L5,
            "l5.unknown_call_id_ignored",
            "a TOOL_RESULT with an unknown call_id is discarded silently; the connection stays",
            l5::unknown_call_id_ignored
        ),
        check!(
            L5,
            "l5.concurrent_calls",
            "two calls in flight get distinct call_ids and each caller gets its own result, answered out of order",
            l5::concurrent_calls
        ),
        check!(
            L5,
            "l5.undeclared_tool_refused",
            "a tool the surface did not declare is refused and never sent to it",
            l5::undeclared_tool_refused
        ),
        check!(
            L5,
            "l5.tool_timeout",
            "an unanswered TOOL_CALL ends with a timeout result, not a hang",
            l5::tool_timeout
        ),
        check!(
            L5,
            "l5.disconnect_fails_calls",
            "a surface dropping mid-call ends the call with an error at once",
            l5::disconnect_fails_calls
        ),
        check!(
            L5,
            "l5.agent_tool_call",
            "the model calls a declared surface tool through TOOL_CALL and gets its TOOL_RESULT (sbp/echo only)",
            l5::agent_tool_call
        ),
        check!(
            L5,
            "l5.agent_tool_disconnect",
            "the surface dropping on the model's TOOL_CALL gives the model an error tool result; the completion still answers (sbp/echo only)",
            l5::agent_tool_disconnect
        ),
        // L6: federation, from outside (no key of the federation needed).
        check!(
            L6,
            "l6.manifest",
            "GET /.well-known/sbp has every field, the endpoints of its role, valid_until at most 7 days ahead, and verifies with its own public_key",
            l6::manifest,
            Must,
            Federation
        ),
        check!(
            L6,
            "l6.bundle_invalid_cid",
            "GET /v1/sbp/bundles/{not a CID} gets 422 SBP_INVALID_CID",
            l6::bundle_invalid_cid
        ),
        check!(
            L6,
            "l6.bundle_needs_token",
            "a bundle by CID without a federation token gets 401 with WWW-Authenticate: Bearer",
            l6::bundle_needs_token
        ),
        check!(
            L6,
            "l6.bundle_garbage_token",
            "a bundle by CID with a garbage Bearer token gets 401",
            l6::bundle_garbage_token
        ),
        check!(
            L6,
            "l6.bundle_alg_none",
            "a bundle by CID with an unsigned `alg: none` federation token gets 401",
            l6::bundle_alg_none
        ),
        check!(
            L6,
            "l6.session_attached_l6",
            "a federated gateway says sbp_level L6 in SESSION_ATTACHED",
            l6::session_attached_l6
        ),
        check!(
            L6,
            "l6.registry_lookup",
            "a tracker answers an unknown bundle 404, or signed for that CID with provider records only (no content)",
            l6::registry_lookup,
            Must,
            Registry
        ),
        check!(
            L6,
            "l6.registry_refuses_empty",
            "a tracker refuses an empty provider record with 400",
            l6::registry_refuses_empty,
            Must,
            Registry
        ),
    ]
}

/// Picks a per-check random marker, so concurrent runs against one gateway never mix data.
pub fn nonce() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}
