//! The OpenAPI 3.1 document of the HTTP API, served at `GET /openapi.json` and committed as
//! `docs/openapi.json` (`sbp openapi` prints it). Its schemas are generated from the wire types
//! (`sbp_protocol`'s `openapi` feature derives `schemars::JsonSchema`; schemars writes JSON Schema
//! 2020-12, the dialect of OpenAPI 3.1); its operations are the table of [`operations`], one
//! entry per route and method: documenting a new route is one entry there.
//!
//! Response schemas describe what the gateway sends (schemars' serialize contract: every field it
//! always writes is required), request schemas what it reads (the deserialize contract). Objects
//! stay open to fields they do not name: clients ignore what they do not know, and the error
//! envelope gains fields over time.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use sbp_protocol::rest::{
    Export, ExportInfo, ExportList, ExportRequest, ForkInfo, ForkRequest, HandoffInfo,
    HandoffRequest, Health, ImportInfo, ImportRequest, Lineage, Memory, MemoryPut, MessagePage,
    MessagesQuery, NewSession, PushTurn, PushedTurn, SessionCreated, SessionDeleted, SessionInfo,
    SessionList, SessionsQuery, SetStatus, Snapshot, SnapshotList, StatusChanged, ToolCallOutcome,
    ToolCallRequest,
};
use sbp_protocol::{ChatRequest, ErrorBody, SbpResponseMeta};
use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde_json::{Map, Value, json};

/// `GET /openapi.json`.
pub async fn serve() -> Response {
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        json(),
    )
        .into_response()
}

/// The document as the gateway serves it: pretty-printed, keys sorted, ending with a newline.
pub fn json() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| {
        let mut doc = document();
        // Sorted here rather than by the map type: a build with serde_json's `preserve_order`
        // (a dependency may turn it on) must print the same bytes.
        doc.sort_all_objects();
        // A `Value` always serialises (its keys are strings).
        let mut text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        text.push('\n');
        text
    })
}

/// Who may call an operation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Auth {
    /// Anyone: no data behind it (health, the page, this document), or a credential inside the
    /// protocol (the WebSocket's ATTACH_SESSION, a peer's signed record).
    Open,
    /// An operator key when the gateway has any (`--api-key`), nothing otherwise.
    Operator,
    /// The session's token, or an operator key (which acts on any session).
    Session,
    /// A federation token of a peer gateway.
    Peer,
}

/// A schema of the generator it is given: `schema::<T>`, or one of the loose shapes below.
type SchemaFn = fn(&mut SchemaGenerator) -> Schema;

fn schema<T: JsonSchema>(g: &mut SchemaGenerator) -> Schema {
    g.subschema_for::<T>()
}

/// What one status answers with.
struct Reply {
    status: &'static str,
    description: &'static str,
    /// Media type and schema; none for an answer without a body.
    content: Vec<(&'static str, SchemaFn)>,
    /// Names of `components.headers`, and whether each is always sent.
    headers: &'static [(&'static str, bool)],
}

/// One route and method.
struct Op {
    method: &'static str,
    path: &'static str,
    id: &'static str,
    tag: &'static str,
    summary: &'static str,
    auth: Auth,
    /// A type whose fields are the query parameters.
    query: Option<SchemaFn>,
    /// Names of `components.parameters` (request headers).
    header_params: &'static [&'static str],
    body: Option<SchemaFn>,
    replies: Vec<Reply>,
    errors: Vec<u16>,
}

impl Op {
    fn new(method: &'static str, path: &'static str, id: &'static str) -> Self {
        Self {
            method,
            path,
            id,
            tag: "",
            summary: "",
            auth: Auth::Operator,
            query: None,
            header_params: &[],
            body: None,
            replies: Vec::new(),
            errors: Vec::new(),
        }
    }

    fn get(path: &'static str, id: &'static str) -> Self {
        Self::new("get", path, id)
    }

    fn post(path: &'static str, id: &'static str) -> Self {
        Self::new("post", path, id)
    }

    fn put(path: &'static str, id: &'static str) -> Self {
        Self::new("put", path, id)
    }

    fn patch(path: &'static str, id: &'static str) -> Self {
        Self::new("patch", path, id)
    }

    fn delete(path: &'static str, id: &'static str) -> Self {
        Self::new("delete", path, id)
    }

    fn doc(mut self, tag: &'static str, summary: &'static str) -> Self {
        self.tag = tag;
        self.summary = summary;
        self
    }

    fn auth(mut self, auth: Auth) -> Self {
        self.auth = auth;
        self
    }

    fn query(mut self, query: SchemaFn) -> Self {
        self.query = Some(query);
        self
    }

    fn headers(mut self, names: &'static [&'static str]) -> Self {
        self.header_params = names;
        self
    }

    /// A JSON request body.
    fn body(mut self, body: SchemaFn) -> Self {
        self.body = Some(body);
        self
    }

    /// A JSON answer.
    fn json(self, status: &'static str, body: SchemaFn) -> Self {
        self.reply(status, "", vec![("application/json", body)], &[])
    }

    /// A JSON answer with headers (`components.headers` names, and whether each is always sent).
    fn json_with(
        self,
        status: &'static str,
        body: SchemaFn,
        headers: &'static [(&'static str, bool)],
    ) -> Self {
        self.reply(status, "", vec![("application/json", body)], headers)
    }

    fn reply(
        mut self,
        status: &'static str,
        description: &'static str,
        content: Vec<(&'static str, SchemaFn)>,
        headers: &'static [(&'static str, bool)],
    ) -> Self {
        self.replies.push(Reply {
            status,
            description,
            content,
            headers,
        });
        self
    }

    /// Error statuses beyond those every operation of its kind has (see [`Op::error_statuses`]).
    fn errors(mut self, statuses: &[u16]) -> Self {
        self.errors.extend_from_slice(statuses);
        self
    }

    /// The error statuses documented: the operation's own, and those its kind always has.
    fn error_statuses(&self) -> BTreeSet<u16> {
        let mut out: BTreeSet<u16> = self.errors.iter().copied().collect();
        if self.path != "/healthz" {
            // The request policy (`Host`, `Origin`) and the rate limits.
            out.extend([403, 429]);
        }
        match self.auth {
            Auth::Open => {}
            Auth::Operator => {
                out.insert(401);
            }
            Auth::Session => out.extend([401, 403]),
            Auth::Peer => {
                out.insert(401);
            }
        }
        if self.path.contains("{id}") {
            out.extend([404, 422]);
        }
        if self.body.is_some() {
            out.extend([400, 413, 415]);
        }
        out
    }
}

/// Headers naming the session a request ran in, always sent.
const SESSION_HEADERS: &[(&str, bool)] = &[
    ("X-Session-Id", true),
    ("X-Agent-Id", true),
    ("X-Session-Token", true),
];
/// A completion's: the session token only when the request created the session; none at all for
/// a completion passed through untracked (`--strict-sbp`).
const TURN_HEADERS: &[(&str, bool)] = &[
    ("X-Session-Id", false),
    ("X-Agent-Id", false),
    ("X-Session-Token", false),
    ("Idempotent-Replayed", false),
];
const REPLAY_HEADERS: &[(&str, bool)] = &[("Idempotent-Replayed", false)];

/// Every documented operation, one line each: a route added to the router gets its line here
/// (the tests `openapi::every_route_is_documented` and `every_documented_operation_is_routed`
/// hold the two in step). A table, so rustfmt leaves it as one.
#[rustfmt::skip]
fn operations() -> Vec<Op> {
    use Auth::{Open, Peer, Session};
    let sessions = "sessions";
    let roaming = "roaming";
    let openai = "openai";
    let federation = "federation";
    let ops = "operations";
    vec![
        // The OpenAI-compatible API.
        Op::post("/v1/chat/completions", "createChatCompletion")
            .doc(openai, "A chat completion in a durable session (OpenAI-compatible; `stream: true` answers with server-sent events)")
            .headers(&["X-Session-Token", "X-Agent-Id", "Idempotency-Key", "X-SBP-Auto-Resume"])
            .body(schema::<ChatRequest>)
            .reply("200", "The completion, with the `sbp` block of the session it ran in", vec![("application/json", schema::<ChatCompletion>), ("text/event-stream", schema::<EventStream>)], TURN_HEADERS)
            .json_with("202", schema::<ResumeAvailable>, TURN_HEADERS)
            .errors(&[404, 409, 410, 422, 423, 502, 503, 504]),
        Op::get("/v1/models", "listModels").doc(openai, "The models this gateway routes to (OpenAI's list)").json("200", schema::<ModelList>),
        Op::get("/v1/models/{model}", "getModel").doc(openai, "One model of the list").json("200", schema::<Model>).errors(&[404]),
        // Sessions.
        Op::post("/v1/sessions", "createSession").doc(sessions, "A new idle session").body(schema::<NewSession>).json_with("201", schema::<SessionCreated>, SESSION_HEADERS),
        Op::post("/v1/sbp/sessions", "createSessionSbp").doc(sessions, "A new idle session (same as POST /v1/sessions)").body(schema::<NewSession>).json_with("201", schema::<SessionCreated>, SESSION_HEADERS),
        Op::get("/v1/sessions", "listSessions").doc(sessions, "The sessions, newest first, a page at a time (the operator key where keys are configured)").auth(Auth::Operator).query(schema::<SessionsQuery>).json("200", schema::<SessionList>).errors(&[400]),
        Op::get("/v1/sbp/sessions", "listSessionsSbp").doc(sessions, "The sessions (same as GET /v1/sessions)").auth(Auth::Operator).query(schema::<SessionsQuery>).json("200", schema::<SessionList>).errors(&[400]),
        Op::delete("/v1/sessions/{id}", "deleteSession").doc(sessions, "Erases the session and everything of it (lineage keeps only ids)").auth(Session).json("200", schema::<SessionDeleted>).errors(&[409]),
        Op::delete("/v1/sbp/sessions/{id}", "deleteSessionSbp").doc(sessions, "Erases the session (same as DELETE /v1/sessions/{id})").auth(Session).json("200", schema::<SessionDeleted>).errors(&[409]),
        Op::get("/v1/sessions/{id}", "getSession").doc(sessions, "A session's state").auth(Session).json("200", schema::<SessionInfo>).errors(&[409]),
        Op::get("/v1/sbp/sessions/{id}", "getSessionSbp").doc(sessions, "A session's state (same as GET /v1/sessions/{id})").auth(Session).json("200", schema::<SessionInfo>).errors(&[409]),
        Op::get("/v1/sessions/{id}/messages", "listMessages").doc(sessions, "One page of the stored transcript").auth(Session).query(schema::<MessagesQuery>).json("200", schema::<MessagePage>).errors(&[400]),
        Op::get("/v1/sbp/sessions/{id}/messages", "listMessagesSbp").doc(sessions, "One page of the stored transcript (same as GET /v1/sessions/{id}/messages)").auth(Session).query(schema::<MessagesQuery>).json("200", schema::<MessagePage>).errors(&[400]),
        Op::patch("/v1/sbp/sessions/{id}/status", "setStatus").doc(sessions, "Moves the session to another status").auth(Session).body(schema::<SetStatus>).json("200", schema::<StatusChanged>).errors(&[409]),
        Op::post("/v1/sbp/sessions/{id}/status", "setStatusPost").doc(sessions, "Moves the session to another status (same as PATCH)").auth(Session).body(schema::<SetStatus>).json("200", schema::<StatusChanged>).errors(&[409]),
        Op::get("/v1/sbp/sessions/{id}/snapshots", "listSnapshots").doc(sessions, "The session's snapshots, newest first").auth(Session).json("200", schema::<SnapshotList>),
        Op::get("/v1/sbp/sessions/{id}/snapshots/latest", "latestSnapshot").doc(sessions, "The latest snapshot with its messages").auth(Session).json("200", schema::<Snapshot>),
        Op::post("/v1/sbp/sessions/{id}/turns", "pushTurn").doc(sessions, "A turn pushed by a backend: streamed to the attached surface, or tethered until one attaches").auth(Session).headers(&["Idempotency-Key"]).body(schema::<PushTurn>).json_with("201", schema::<PushedTurn>, REPLAY_HEADERS).errors(&[409]),
        // Roaming (L3).
        Op::post("/v1/sbp/sessions/{id}/export", "exportSession").doc(roaming, "Seals the session into a bundle and issues a roaming token").auth(Session).body(schema::<ExportRequest>).json("201", schema::<Export>).errors(&[409]),
        Op::post("/v1/sbp/sessions/import", "importSession").doc(roaming, "A new session from a roaming token, a sealed bundle, or a bundle CID (federation)").body(schema::<ImportRequest>).json_with("201", schema::<ImportInfo>, SESSION_HEADERS).errors(&[404, 409, 410, 422, 502]),
        Op::post("/v1/sbp/sessions/{id}/handoff", "handoffSession").doc(roaming, "Hands the session to another agent: a new session, the source suspended").auth(Session).body(schema::<HandoffRequest>).json_with("201", schema::<HandoffInfo>, SESSION_HEADERS).errors(&[409]),
        Op::post("/v1/sbp/sessions/{id}/fork", "forkSession").doc(roaming, "A copy of the session that goes its own way").auth(Session).body(schema::<ForkRequest>).json_with("201", schema::<ForkInfo>, SESSION_HEADERS).errors(&[409]),
        Op::get("/v1/sbp/sessions/{id}/exports", "listExports").doc(roaming, "The session's exports with their imports").auth(Session).json("200", schema::<ExportList>),
        Op::get("/v1/sbp/sessions/{id}/lineage", "sessionLineage").doc(roaming, "The session's family: exports, handoffs, forks, imports").auth(Session).json("200", schema::<Lineage>),
        Op::get("/v1/sbp/sessions/{id}/memory", "getMemory").doc(roaming, "The session's memory document").auth(Session).json("200", schema::<Memory>),
        Op::put("/v1/sbp/sessions/{id}/memory", "putMemory").doc(roaming, "Replaces the session's memory document").auth(Session).body(schema::<MemoryPut>).json("200", schema::<Memory>),
        Op::get("/v1/sbp/token/{token}", "inspectToken").doc(roaming, "What a roaming token names (the token itself is the credential)").json("200", schema::<ExportInfo>).errors(&[404, 410, 422]),
        // Surfaces and tools.
        Op::post("/v1/sbp/sessions/{id}/tool_calls", "callSurfaceTool").doc("tools", "A backend calls a tool of the attached surface and waits for its result").auth(Session).body(schema::<ToolCallRequest>).json("200", schema::<ToolCallOutcome>).errors(&[409]),
        Op::post("/v1/sbp/sessions/{id}/mcp", "mcp").doc("tools", "The attached surface as an MCP server (streamable HTTP, one JSON-RPC message per POST)").auth(Session).body(schema::<JsonRpc>).json("200", schema::<JsonRpc>).reply("202", "A notification or response, accepted", vec![], &[]).errors(&[406]),
        Op::get("/v1/sbp/ws/{id}", "attachSurface").doc("surfaces", "The surface WebSocket (SBP frames; authenticated by ATTACH_SESSION)").auth(Open).reply("101", "Switched to the WebSocket protocol", vec![], &[]).errors(&[400, 426]),
        // Operations.
        Op::get("/healthz", "health").doc(ops, "Liveness (never rate limited)").auth(Open).json("200", schema::<Health>),
        Op::get("/metrics", "metrics").doc(ops, "Prometheus metrics").reply("200", "Prometheus text format", vec![("text/plain", schema::<Text>)], &[]),
        Op::get("/openapi.json", "openapi").doc(ops, "This document").auth(Open).json("200", schema::<JsonObject>),
        Op::get("/", "page").doc("page", "The browser surface page").auth(Open).reply("200", "The page (with a strict Content-Security-Policy)", vec![("text/html", schema::<Text>)], &[]).reply("304", "Not modified (`If-None-Match`)", vec![], &[]),
        Op::get("/assets/{file}", "pageAsset").doc("page", "A file of the page").auth(Open).reply("200", "The file", vec![("*/*", schema::<Text>)], &[]).reply("304", "Not modified (`If-None-Match`)", vec![], &[]).errors(&[404]),
        // Federation (L6): served only when started with `--role`.
        Op::get("/.well-known/sbp", "federationManifest").doc(federation, "The node's signed manifest").auth(Open).json("200", schema::<JsonObject>),
        Op::get("/v1/sbp/bundles/{cid}", "getBundle").doc(federation, "A sealed bundle by CID, for a peer").auth(Peer).json("200", schema::<JsonObject>).errors(&[404, 422]),
        Op::post("/v1/sbp/federation/tokens/redeem", "redeemRoamingToken").doc(federation, "A peer redeems a roaming token this node issued").auth(Peer).body(schema::<JsonObject>).json("200", schema::<JsonObject>).errors(&[404, 409, 410, 422]),
        Op::get("/v1/sbp/federation/sessions/{id}", "locateSession").doc(federation, "Where a session lives (for a peer)").auth(Peer).json("200", schema::<JsonObject>),
        Op::post("/v1/sbp/federation/sessions/{id}/handover", "handoverSession").doc(federation, "A peer takes a session over (its surface attached there)").auth(Peer).body(schema::<JsonObject>).json("200", schema::<JsonObject>).errors(&[409]),
        Op::post("/v1/sbp/federation/sessions/{id}/handover/{migration_id}/commit", "commitHandover").doc(federation, "Completes a handover").auth(Peer).json("200", schema::<JsonObject>).errors(&[409]),
        Op::post("/v1/sbp/federation/sessions/{id}/handover/{migration_id}/abort", "abortHandover").doc(federation, "Abandons a handover").auth(Peer).json("200", schema::<JsonObject>).errors(&[409]),
        Op::post("/v1/sbp/registry", "announceBundle").doc(federation, "A gateway announces a signed bundle record (trackers)").auth(Open).body(schema::<JsonObject>).json("200", schema::<JsonObject>).json("201", schema::<JsonObject>).errors(&[409]),
        Op::get("/v1/sbp/registry/{cid}", "lookupBundle").doc(federation, "The gateways holding a bundle (trackers)").auth(Open).json("200", schema::<JsonObject>).errors(&[404, 422]),
        Op::post("/v1/sbp/registry/gateways", "registerGateway").doc(federation, "A gateway registers its URL (trackers)").auth(Open).body(schema::<JsonObject>).json("200", schema::<JsonObject>).errors(&[502]),
        Op::get("/v1/sbp/registry/gateways/{gateway_id}", "vouchGateway").doc(federation, "A tracker's signed word on a gateway").auth(Open).json("200", schema::<JsonObject>).errors(&[404]),
    ]
}

/// Declares a shape with a hand-written schema: the OpenAI bodies the gateway passes through,
/// and bodies it builds from untyped JSON. The fields it reads or writes are named; every other
/// one is open.
macro_rules! shape {
    ($name:ident, $g:ident => $schema:expr) => {
        enum $name {}

        impl JsonSchema for $name {
            fn schema_name() -> Cow<'static, str> {
                stringify!($name).into()
            }

            fn json_schema($g: &mut SchemaGenerator) -> Schema {
                $schema
            }
        }
    };
}

shape!(ChatCompletion, g => json_schema!({
    "description": "OpenAI's `chat.completion` object as the model answered, with the `sbp` block (absent on a completion passed through untracked).",
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": ["object", "null"]},
        "sbp": g.subschema_for::<SbpResponseMeta>()
    },
    "additionalProperties": true
}));

shape!(ResumeAvailable, g => json_schema!({
    "description": "A session that was interrupted can be resumed: send the same request again with `sbp.resume: true`.",
    "type": "object",
    "required": ["sbp"],
    "properties": {"sbp": g.subschema_for::<SbpResponseMeta>()},
    "additionalProperties": true
}));

shape!(EventStream, _g => json_schema!({
    "description": "Server-sent events: `data: {chat.completion.chunk}` lines, then `data: [DONE]` (or an error envelope).",
    "type": "string"
}));

shape!(ModelList, g => json_schema!({
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": g.subschema_for::<Model>()}
    },
    "additionalProperties": true
}));

shape!(Model, _g => json_schema!({
    "description": "A model as OpenAI lists it (an upstream's fields kept).",
    "type": "object",
    "required": ["id"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"}
    },
    "additionalProperties": true
}));

shape!(JsonRpc, _g => json_schema!({
    "description": "A JSON-RPC 2.0 message (MCP).",
    "type": "object",
    "properties": {"jsonrpc": {"const": "2.0"}},
    "additionalProperties": true
}));

shape!(JsonObject, _g => json_schema!({"type": "object", "additionalProperties": true}));

shape!(Text, _g => json_schema!({"type": "string"}));

/// Each error status: its name in `components.responses`, what it means across the API, and
/// whether it says when to retry.
fn error_status(status: u16) -> (&'static str, &'static str, bool) {
    match status {
        400 => (
            "BadRequest",
            "The request is malformed: a field of the wrong type, a body that is not JSON, a bad query",
            false,
        ),
        401 => (
            "Unauthorized",
            "No valid operator key (`Authorization: Bearer`) or federation token",
            false,
        ),
        403 => (
            "Forbidden",
            "Refused: the session token does not match, the `Host` or `Origin` is not allowed, or the tool is not allowed",
            false,
        ),
        404 => ("NotFound", "No such session or resource", false),
        406 => (
            "NotAcceptable",
            "The `Accept` header excludes every type this endpoint answers with",
            false,
        ),
        409 => (
            "Conflict",
            "The session's state does not allow it now (another turn running, moving or moved, no surface with the tool)",
            true,
        ),
        410 => (
            "Gone",
            "The roaming token expired or was already used",
            false,
        ),
        413 => ("PayloadTooLarge", "The body is over the size limit", false),
        415 => (
            "UnsupportedMediaType",
            "The body is not sent as JSON",
            false,
        ),
        422 => (
            "Unprocessable",
            "A value is invalid: an id that is not a UUID, a token, a bundle, a session at its size limit",
            false,
        ),
        426 => ("UpgradeRequired", "Not a WebSocket handshake", false),
        429 => ("RateLimited", "Over a rate limit", true),
        502 => (
            "BadGateway",
            "The upstream LLM or a peer failed or could not be reached",
            false,
        ),
        503 => (
            "Unavailable",
            "The gateway is stopping, or a dependency is unavailable",
            true,
        ),
        504 => ("GatewayTimeout", "The upstream LLM timed out", false),
        _ => ("Error", "Any other error, in the same envelope", false),
    }
}

/// The statuses [`error_status`] names (besides `default`).
const ERROR_STATUSES: [u16; 15] = [
    400, 401, 403, 404, 406, 409, 410, 413, 415, 422, 426, 429, 502, 503, 504,
];

/// What each `{name}` of a path is.
fn path_parameter(name: &str) -> (&'static str, Value) {
    match name {
        "id" => (
            "The session's id",
            json!({"type": "string", "format": "uuid"}),
        ),
        "migration_id" => (
            "The handover's id",
            json!({"type": "string", "format": "uuid"}),
        ),
        "cid" => (
            "A bundle CID: the SHA-256 of its canonical JSON, 64 lowercase hex characters",
            json!({"type": "string", "pattern": "^[0-9a-f]{64}$"}),
        ),
        "token" => ("A roaming token", json!({"type": "string"})),
        "model" => ("A model id of GET /v1/models", json!({"type": "string"})),
        "gateway_id" => ("A gateway id", json!({"type": "string", "maxLength": 128})),
        "file" => ("A file name", json!({"type": "string"})),
        _ => ("A path parameter", json!({"type": "string"})),
    }
}

/// The names between braces in `path`.
fn path_names(path: &str) -> impl Iterator<Item = &str> {
    path.split('/')
        .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
}

fn security(auth: Auth) -> Value {
    match auth {
        Auth::Open => json!([]),
        // `{}`: no credential needed when the gateway has no operator keys.
        Auth::Operator => json!([{"operatorKey": []}, {}]),
        Auth::Session => json!([{"sessionToken": []}, {"operatorKey": []}]),
        Auth::Peer => json!([{"federationToken": []}]),
    }
}

fn content(g: &mut SchemaGenerator, media: &[(&'static str, SchemaFn)]) -> Value {
    media
        .iter()
        .map(|(ty, schema)| (ty.to_string(), json!({"schema": schema(g).to_value()})))
        .collect::<Map<String, Value>>()
        .into()
}

/// The definition a `$ref` schema names.
fn referenced<'a>(schema: &Value, defs: &'a Map<String, Value>) -> Option<&'a Value> {
    schema
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix(&format!("#{SCHEMAS}/")))
        .and_then(|name| defs.get(name))
}

/// The parameters a query type's properties describe (`schema` is a `$ref` into `defs`).
fn query_parameters(schema: &Value, defs: &Map<String, Value>) -> Vec<Value> {
    let Some(def) = referenced(schema, defs) else {
        return Vec::new();
    };
    let required: Vec<&str> = def
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let Some(props) = def.get("properties").and_then(Value::as_object) else {
        return Vec::new();
    };
    props
        .iter()
        .map(|(name, prop)| {
            let mut p = json!({
                "name": name,
                "in": "query",
                "required": required.contains(&name.as_str()),
                "schema": prop,
            });
            if let Some(d) = prop.get("description") {
                p["description"] = d.clone();
            }
            p
        })
        .collect()
}

/// Replaces `$ref`s to `from` by `to`, everywhere in `v`.
fn rename_refs(v: &mut Value, from: &str, to: &str) {
    match v {
        Value::Object(map) => {
            for (key, inner) in map.iter_mut() {
                if key == "$ref" && inner.as_str() == Some(from) {
                    *inner = Value::String(to.to_owned());
                } else {
                    rename_refs(inner, from, to);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|i| rename_refs(i, from, to)),
        _ => {}
    }
}

const SCHEMAS: &str = "/components/schemas";

/// The whole document.
fn document() -> Value {
    let settings = SchemaSettings::draft2020_12().with(|s| {
        s.definitions_path = SCHEMAS.into();
        s.meta_schema = None;
    });
    let mut responses = settings.clone().for_serialize().into_generator();
    let mut requests = settings.for_deserialize().into_generator();
    let error = schema::<ErrorBody>(&mut responses).to_value();

    // Requests first, in their own generator: a type read and written may have two schemas.
    let ops = operations();
    let mut inputs: Vec<(Option<Value>, Option<Value>)> = ops
        .iter()
        .map(|op| {
            (
                op.query.map(|q| q(&mut requests).to_value()),
                op.body.map(|b| b(&mut requests).to_value()),
            )
        })
        .collect();
    let mut request_defs = requests.take_definitions(true);
    let mut paths = Map::new();
    let mut all_outputs = Vec::new();
    for op in &ops {
        let replies: Vec<(String, Value)> = op
            .replies
            .iter()
            .map(|r| {
                let mut reply = json!({"description": if r.description.is_empty() { "Success" } else { r.description }});
                if !r.content.is_empty() {
                    reply["content"] = content(&mut responses, &r.content);
                }
                if !r.headers.is_empty() {
                    reply["headers"] = r
                        .headers
                        .iter()
                        .map(|(name, always)| {
                            let mut h = json!({"$ref": format!("#/components/headers/{name}")});
                            if *always {
                                // A `$ref` header cannot say `required` beside it: inlined.
                                h = header_component(name);
                                h["required"] = json!(true);
                            }
                            (name.to_string(), h)
                        })
                        .collect::<Map<String, Value>>()
                        .into();
                }
                (r.status.to_owned(), reply)
            })
            .collect();
        all_outputs.push(replies);
    }
    let response_defs = responses.take_definitions(true);

    // A request schema whose name a different response schema took is renamed `<Name>Input`.
    for (name, def) in request_defs.clone() {
        if response_defs.get(&name).is_some_and(|d| d != &def) {
            let (from, to) = (
                format!("#{SCHEMAS}/{name}"),
                format!("#{SCHEMAS}/{name}Input"),
            );
            for (q, b) in &mut inputs {
                for v in [q, b].into_iter().flatten() {
                    rename_refs(v, &from, &to);
                }
            }
            request_defs.remove(&name);
            request_defs.insert(format!("{name}Input"), def);
            for d in request_defs.values_mut() {
                rename_refs(d, &from, &to);
            }
        }
    }
    let mut schemas = response_defs;
    schemas.extend(request_defs);

    for ((op, replies), (query, body)) in ops.iter().zip(all_outputs).zip(inputs) {
        let mut responses: Map<String, Value> = replies.into_iter().collect();
        for status in op.error_statuses() {
            let (name, _, _) = error_status(status);
            responses.insert(status.to_string(), response_ref(name));
        }
        responses.insert("default".into(), response_ref("Error"));
        let mut parameters: Vec<Value> = path_names(op.path)
            .map(|name| {
                let (description, schema) = path_parameter(name);
                json!({"name": name, "in": "path", "required": true, "description": description, "schema": schema})
            })
            .collect();
        if let Some(q) = &query {
            parameters.extend(query_parameters(q, &schemas));
        }
        parameters.extend(
            op.header_params
                .iter()
                .map(|name| json!({"$ref": format!("#/components/parameters/{name}")})),
        );
        let mut operation = json!({
            "operationId": op.id,
            "tags": [op.tag],
            "summary": op.summary,
            "security": security(op.auth),
            "responses": responses,
        });
        if !parameters.is_empty() {
            operation["parameters"] = Value::Array(parameters);
        }
        if let Some(body) = body {
            // An empty body reads as `{}`: it may be left out when no field is required.
            let required = referenced(&body, &schemas)
                .and_then(|def| def.get("required"))
                .and_then(Value::as_array)
                .is_some_and(|r| !r.is_empty());
            operation["requestBody"] = json!({
                "required": required,
                "content": {"application/json": {"schema": body}},
            });
        }
        let item = paths.entry(op.path.to_owned()).or_insert_with(|| json!({}));
        item[op.method] = operation;
    }

    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "sbp gateway",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "The HTTP API of the State Bridge Protocol gateway: an OpenAI-compatible chat completions endpoint whose sessions are durable, and the SBP endpoints of sessions, roaming, surface tools and federation. Errors are `{\"error\": {\"code\": \"SBP_...\", \"message\": ..., \"detail\": ...}}`. The surface protocol itself runs over the WebSocket of GET /v1/sbp/ws/{id}.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"}
        },
        "tags": [
            {"name": "openai", "description": "The OpenAI-compatible API"},
            {"name": "sessions", "description": "Sessions, their transcript, status and snapshots"},
            {"name": "roaming", "description": "Export, import, handoff and fork (L3)"},
            {"name": "tools", "description": "A backend calling the attached surface's tools (L5)"},
            {"name": "surfaces", "description": "The surface WebSocket (L2)"},
            {"name": "federation", "description": "Between gateways and trackers (L6): only with --role"},
            {"name": "operations", "description": "Health, metrics and this document"},
            {"name": "page", "description": "The browser surface page"}
        ],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "operatorKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An operator API key (`sbp serve --api-key`). Once the gateway has keys, every route but the open ones needs one; it also acts on any session without the session's token."
                },
                "sessionToken": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "X-Session-Token",
                    "description": "The session's token, returned once by the request that created the session."
                },
                "federationToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "bearerFormat": "JWT",
                    "description": "A federation token signed with a peer gateway's Ed25519 identity key."
                }
            },
            "parameters": {
                "X-Session-Token": {
                    "name": "X-Session-Token", "in": "header", "required": false,
                    "description": "Continue this session's conversation (without it, a completion starts a new session).",
                    "schema": {"type": "string"}
                },
                "X-Agent-Id": {
                    "name": "X-Agent-Id", "in": "header", "required": false,
                    "description": "The agent a new session belongs to.",
                    "schema": {"type": "string", "minLength": 1, "maxLength": 256}
                },
                "Idempotency-Key": {
                    "name": "Idempotency-Key", "in": "header", "required": false,
                    "description": "A retry with the same key and body gets the first answer again (`Idempotent-Replayed: true`) instead of running twice.",
                    "schema": {"type": "string"}
                },
                "X-SBP-Auto-Resume": {
                    "name": "X-SBP-Auto-Resume", "in": "header", "required": false,
                    "description": "`true`: a suspended session is resumed instead of answered 202 (or 423 for an OpenAI client).",
                    "schema": {"type": "string", "enum": ["true", "false", "1", "0"]}
                }
            },
            "responses": error_responses(&error),
            "headers": {
                "Retry-After": header_component("Retry-After"),
                "X-Session-Id": header_component("X-Session-Id"),
                "X-Agent-Id": header_component("X-Agent-Id"),
                "X-Session-Token": header_component("X-Session-Token"),
                "Idempotent-Replayed": header_component("Idempotent-Replayed"),
            }
        }
    })
}

fn header_component(name: &str) -> Value {
    let (description, schema) = match name {
        "X-Session-Id" => (
            "The session the request ran in.",
            json!({"type": "string", "format": "uuid"}),
        ),
        "X-Agent-Id" => ("The session's agent.", json!({"type": "string"})),
        "X-Session-Token" => (
            "The session's token: sent once, by the request that created the session.",
            json!({"type": "string"}),
        ),
        "Idempotent-Replayed" => (
            "`true` when this answer replays an earlier request with the same Idempotency-Key.",
            json!({"const": "true"}),
        ),
        "Retry-After" => (
            "Seconds to wait before retrying.",
            json!({"type": "string", "pattern": "^[0-9]+$"}),
        ),
        _ => ("", json!({"type": "string"})),
    };
    json!({"description": description, "schema": schema})
}

fn response_ref(name: &str) -> Value {
    json!({"$ref": format!("#/components/responses/{name}")})
}

/// `components.responses`: the error envelope under each error status's name.
fn error_responses(error: &Value) -> Value {
    ERROR_STATUSES
        .iter()
        .chain(&[0])
        .map(|status| {
            let (name, description, retry) = error_status(*status);
            let mut r = json!({
                "description": description,
                "content": {"application/json": {"schema": error}},
            });
            if retry {
                r["headers"] = json!({"Retry-After": {"$ref": "#/components/headers/Retry-After"}});
            }
            (name.to_owned(), r)
        })
        .collect::<Map<String, Value>>()
        .into()
}
