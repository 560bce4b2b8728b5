//! The MCP bridge (L5): calling tools that live on the attached surface (TOOL_CALL out, TOOL_RESULT
//! back, correlated by a fresh UUID per call, bounded by a timeout, failed at once when the surface
//! goes away), tools of operator-configured MCP servers (southbound), and the catalogue of both that
//! a turn offers to the LLM under names of the LLM's function-name alphabet.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sbp_protocol::frames::ToolCall;
use sbp_protocol::surface::pass_through_schema;
use sbp_protocol::{ErrorCode, ToolSchema};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::Gateway;
use super::hub::{Attachment, DISCONNECTED, Route, ToolReply};
use super::sessions::Caller;
use crate::error::ApiError;

pub use super::hub::TIMEOUT;
// The function-name scheme lives in sbp-llm, shared with the `sbp/echo` model that reads it back.
pub use sbp_llm::tool_names::{SERVER_PREFIX, SURFACE_PREFIX};
// The functions the client itself declared in the request (they stay the client's).
use sbp_llm::tool_names::declared_functions as client_functions;
/// Longest function name OpenAI and Anthropic accept.
const MAX_FUNCTION_NAME: usize = 64;

/// Tools of MCP servers the gateway itself calls (southbound). Implemented over `sbp_mcp`.
#[async_trait]
pub trait ServerTools: Send + Sync {
    /// Every tool of every connected server, as (server, schema).
    fn tools(&self) -> Vec<(String, ToolSchema)>;
    /// Calls a tool; `Ok((is_error, text))` is what the LLM gets, `Err` a failure to call at all.
    async fn call(
        &self,
        server: &str,
        tool: &str,
        arguments: Value,
        timeout: Duration,
    ) -> Result<(bool, String), String>;
}

/// No southbound servers configured.
pub struct NoServerTools;

#[async_trait]
impl ServerTools for NoServerTools {
    fn tools(&self) -> Vec<(String, ToolSchema)> {
        Vec::new()
    }

    async fn call(
        &self,
        server: &str,
        _: &str,
        _: Value,
        _: Duration,
    ) -> Result<(bool, String), String> {
        Err(format!("no MCP server named '{server}'"))
    }
}

/// The southbound MCP servers of `sbp_mcp`, as the engine uses them.
#[async_trait]
impl ServerTools for sbp_mcp::Southbound {
    fn tools(&self) -> Vec<(String, ToolSchema)> {
        sbp_mcp::Southbound::tools(self)
            .into_iter()
            .map(|(server, t)| {
                let schema = ToolSchema {
                    name: t.name,
                    description: t.description,
                    input_schema: t.input_schema,
                };
                (server, schema)
            })
            .collect()
    }

    async fn call(
        &self,
        server: &str,
        tool: &str,
        arguments: Value,
        timeout: Duration,
    ) -> Result<(bool, String), String> {
        sbp_mcp::Southbound::call(self, server, tool, arguments, timeout)
            .await
            .map(|out| (out.is_error, out.text))
            .map_err(|e| e.to_string())
    }
}

/// Why a surface tool call could not be made at all.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolCallError {
    /// No surface is attached, or it did not declare the tool (409).
    NoSurface(String),
    /// The operator's allowlist does not include the tool (403).
    NotAllowed(String),
}

impl From<ToolCallError> for ApiError {
    fn from(e: ToolCallError) -> Self {
        match e {
            ToolCallError::NoSurface(m) => ApiError::new(ErrorCode::SessionConflict, m),
            ToolCallError::NotAllowed(m) => ApiError::forbidden(m),
        }
    }
}

/// A finished surface tool call.
#[derive(Debug, Clone)]
pub struct SurfaceCallOutcome {
    pub call_id: Uuid,
    pub reply: ToolReply,
    pub elapsed: Duration,
}

/// Who runs a function the LLM may call.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolTarget {
    Surface(String),
    Server { server: String, tool: String },
}

/// The tools offered to the LLM in one round: function name -> target, plus the OpenAI-format
/// declarations to add to the request's `tools`.
#[derive(Debug, Default)]
pub struct Catalog {
    targets: HashMap<String, ToolTarget>,
    declarations: Vec<Value>,
}

impl Catalog {
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    pub fn target(&self, function: &str) -> Option<&ToolTarget> {
        self.targets.get(function)
    }

    /// Adds the gateway's tools to the request body's `tools`, after the client's own.
    pub fn inject(&self, body: &mut Map<String, Value>) {
        if self.declarations.is_empty() {
            return;
        }
        let tools = body
            .entry("tools")
            .or_insert_with(|| Value::Array(Vec::new()));
        if !tools.is_array() {
            *tools = Value::Array(Vec::new());
        }
        if let Value::Array(list) = tools {
            list.extend(self.declarations.iter().cloned());
        }
    }

    fn add(&mut self, function: String, target: ToolTarget, description: String, schema: Value) {
        if self.targets.contains_key(&function) {
            tracing::warn!(
                function,
                "two tools map to one function name; the first is kept"
            );
            return;
        }
        self.declarations.push(json!({
            "type": "function",
            "function": {"name": function, "description": description, "parameters": schema},
        }));
        self.targets.insert(function, target);
    }
}

/// A name in the alphabet function names allow (`[A-Za-z0-9_-]`, at most 64 characters).
fn function_name(raw: &str) -> String {
    let mut name: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    name.truncate(MAX_FUNCTION_NAME);
    name
}

impl Gateway {
    /// Whether the operator's allowlist lets surfaces' `tool` be called (no allowlist: any).
    pub fn tool_allowed(&self, tool: &str) -> bool {
        self.config()
            .tool_allowlist
            .as_ref()
            .is_none_or(|list| list.iter().any(|t| t == tool))
    }

    /// Whether a surface is attached to the session (on this replica or another).
    pub async fn is_attached(&self, session: Uuid) -> bool {
        self.locate(session).await.is_some()
    }

    /// Tools of the session's attached surface that may be called now.
    pub async fn surface_tools(&self, session: Uuid) -> Vec<ToolSchema> {
        self.tools_of(self.locate(session).await.as_ref())
    }

    /// Tools of the attached surface `att` that may be called: declared and allowed, with the
    /// surface's schema or the pass-through one.
    pub(crate) fn tools_of(&self, att: Option<&Attachment>) -> Vec<ToolSchema> {
        let Some(att) = att else {
            return Vec::new();
        };
        att.surface
            .mcp_tools
            .iter()
            .filter(|t| self.tool_allowed(t))
            .map(|t| {
                att.surface
                    .tool_schema(t)
                    .cloned()
                    .unwrap_or_else(|| ToolSchema {
                        name: t.clone(),
                        description: None,
                        input_schema: pass_through_schema(),
                    })
            })
            .collect()
    }

    /// The tools a turn offers the LLM now, given the session's surface `att` and the request
    /// `body` (whose own tools keep their names).
    pub fn catalog(&self, att: Option<&Attachment>, body: &Map<String, Value>) -> Catalog {
        let taken = client_functions(body);
        let mut catalog = Catalog::default();
        let device = att
            .map(|a| a.surface.device_type_or_unknown().to_owned())
            .unwrap_or_default();
        for tool in self.tools_of(att) {
            let function = function_name(&format!("{SURFACE_PREFIX}{}", tool.name));
            if taken.contains(&function) {
                continue;
            }
            let description = match &tool.description {
                Some(d) => format!("{d} (runs on the user's {device} device)"),
                None => format!(
                    "Runs the tool '{}' on the user's {device} device.",
                    tool.name
                ),
            };
            catalog.add(
                function,
                ToolTarget::Surface(tool.name),
                description,
                tool.input_schema,
            );
        }
        for (server, tool) in self.server_tools().tools() {
            let function = function_name(&format!("{SERVER_PREFIX}{server}__{}", tool.name));
            if taken.contains(&function) {
                continue;
            }
            let description = tool.description.unwrap_or_else(|| {
                format!("The tool '{}' of the MCP server '{server}'.", tool.name)
            });
            let target = ToolTarget::Server {
                server,
                tool: tool.name,
            };
            catalog.add(function, target, description, tool.input_schema);
        }
        catalog
    }

    /// Sends TOOL_CALL for `tool` to the session's surface and waits for its TOOL_RESULT, at most
    /// `timeout`. Timeouts and disconnects are results ("timeout", "surface disconnected"), never
    /// errors: the caller always gets an answer.
    pub async fn call_surface_tool(
        &self,
        session: Uuid,
        tool: &str,
        input: Value,
        timeout: Duration,
    ) -> Result<SurfaceCallOutcome, ToolCallError> {
        let att = self.locate(session).await;
        self.call_surface_tool_on(session, att, tool, input, timeout)
            .await
    }

    /// [`Gateway::call_surface_tool`] with the session's surface already located.
    async fn call_surface_tool_on(
        &self,
        session: Uuid,
        att: Option<Attachment>,
        tool: &str,
        input: Value,
        timeout: Duration,
    ) -> Result<SurfaceCallOutcome, ToolCallError> {
        let att = att.ok_or_else(|| {
            ToolCallError::NoSurface("no surface is attached to this session".into())
        })?;
        if !att.surface.declares_tool(tool) {
            return Err(ToolCallError::NoSurface(format!(
                "the attached surface did not declare the tool '{tool}'"
            )));
        }
        if !self.tool_allowed(tool) {
            return Err(ToolCallError::NotAllowed(format!(
                "the tool '{tool}' is not in this gateway's tool allowlist"
            )));
        }
        let call_id = Uuid::new_v4();
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        let frame = ToolCall {
            call_id: call_id.to_string(),
            tool_name: tool.to_owned(),
            tool_input: input,
            timeout_ms: Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)),
        };
        self.metrics().tool_calls.fetch_add(1, Relaxed);
        let mut rx = match &att.route {
            Route::Local { calls, .. } => {
                let rx = self.hub().register_call(session, att.conn_id, call_id);
                tracing::info!(session_id = %session, %call_id, tool, conn_id = att.conn_id, "TOOL_CALL sent");
                if !calls.push(Box::new(frame)) {
                    self.hub()
                        .finish_call(call_id, ToolReply::Error(DISCONNECTED.into()));
                }
                rx
            }
            Route::Remote(replica) => {
                let rx =
                    self.hub()
                        .register_remote_call(session, att.conn_id, call_id, replica.clone());
                tracing::info!(session_id = %session, %call_id, tool, conn_id = att.conn_id, replica = %replica, "TOOL_CALL sent through another replica");
                let sent = self.bus().is_some_and(|bus| {
                    bus.send(
                        replica,
                        sbp_bus::BusMsg::ToolCall {
                            session,
                            conn: att.conn_id,
                            reply_to: bus.replica().to_owned(),
                            call: frame,
                        },
                    )
                });
                if !sent {
                    self.hub()
                        .finish_call(call_id, ToolReply::Error(DISCONNECTED.into()));
                }
                rx
            }
        };
        // If this future is dropped while waiting (the HTTP caller went away), the pending entry
        // goes with it instead of waiting for an answer nobody will read.
        let _forget = ForgetCall { gw: self, call_id };
        let reply = match tokio::time::timeout_at(deadline, &mut rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => ToolReply::Error(DISCONNECTED.into()),
            Err(_) => {
                // A result racing the deadline wins; otherwise the call ends as a timeout.
                self.hub()
                    .finish_call(call_id, ToolReply::Error(TIMEOUT.into()));
                rx.try_recv().unwrap_or(ToolReply::Error(TIMEOUT.into()))
            }
        };
        let elapsed = started.elapsed();
        self.metrics().tool_call_latency.observe(elapsed);
        match &reply {
            ToolReply::Result(_) => {
                tracing::info!(session_id = %session, %call_id, tool, elapsed_ms = elapsed.as_millis() as u64, "TOOL_RESULT received");
            }
            ToolReply::Error(e) => {
                self.metrics().tool_call_errors.fetch_add(1, Relaxed);
                if e == TIMEOUT {
                    self.metrics().tool_call_timeouts.fetch_add(1, Relaxed);
                }
                tracing::warn!(session_id = %session, %call_id, tool, error = %e, elapsed_ms = elapsed.as_millis() as u64, "tool call failed");
            }
        }
        Ok(SurfaceCallOutcome {
            call_id,
            reply,
            elapsed,
        })
    }

    /// A TOOL_RESULT arrived on a connection. Late, unknown or foreign call ids are logged and
    /// ignored (SPEC 10.3 says to match the pending call; nothing else may be disturbed).
    pub fn tool_result(
        &self,
        session: Uuid,
        conn_id: u64,
        result: sbp_protocol::frames::ToolResult,
    ) {
        let reply = match result.error {
            Some(e) => ToolReply::Error(e),
            None => ToolReply::Result(result.result.unwrap_or(Value::Null)),
        };
        if !self
            .hub()
            .complete_call(session, conn_id, &result.call_id, reply)
        {
            tracing::warn!(session_id = %session, conn_id, call_id = %result.call_id, "TOOL_RESULT for no pending call ignored");
        }
    }

    /// A TOOL_CALL from a turn on replica `reply_to` for this process's connection `conn`: sent to
    /// the surface, its outcome routed back. Kept no longer than the call's own timeout (swept by
    /// the replica upkeep), after which the waiting replica has given up anyway.
    pub(crate) fn relay_tool_call(
        &self,
        session: Uuid,
        conn: u64,
        reply_to: String,
        call: ToolCall,
    ) {
        let timeout = call
            .timeout_ms
            .map(Duration::from_millis)
            .unwrap_or(self.config().tool_timeout);
        tracing::debug!(session_id = %session, call_id = %call.call_id, tool = %call.tool_name, conn_id = conn, from = %reply_to, "TOOL_CALL relayed for another replica");
        let until = Instant::now() + timeout.min(Duration::from_secs(86_400));
        self.hub().relay_call(session, conn, call, reply_to, until);
    }

    /// Runs one function call of the LLM on its target; the text is the tool message's content.
    pub(crate) async fn run_tool(
        &self,
        session: Uuid,
        target: &ToolTarget,
        arguments: Value,
    ) -> ToolRun {
        let timeout = self.config().tool_timeout;
        match target {
            ToolTarget::Surface(tool) => {
                match self
                    .call_surface_tool(session, tool, arguments, timeout)
                    .await
                {
                    Ok(out) => ToolRun {
                        call_id: Some(out.call_id),
                        content: tool_message_content(&out.reply),
                        error: match out.reply {
                            ToolReply::Error(e) => Some(e),
                            ToolReply::Result(_) => None,
                        },
                    },
                    // The surface went away (or changed its tools) since the catalogue was made.
                    Err(ToolCallError::NoSurface(m) | ToolCallError::NotAllowed(m)) => ToolRun {
                        call_id: None,
                        content: json!({"error": m}).to_string(),
                        error: Some(m),
                    },
                }
            }
            ToolTarget::Server { server, tool } => {
                self.metrics().server_tool_calls.fetch_add(1, Relaxed);
                match self
                    .server_tools()
                    .call(server, tool, arguments, timeout)
                    .await
                {
                    Ok((false, text)) => ToolRun {
                        call_id: None,
                        content: text,
                        error: None,
                    },
                    Ok((true, text)) => ToolRun {
                        call_id: None,
                        content: json!({"error": text}).to_string(),
                        error: Some(text),
                    },
                    Err(e) => ToolRun {
                        call_id: None,
                        content: json!({"error": e}).to_string(),
                        error: Some(e),
                    },
                }
            }
        }
    }
}

/// Longest `timeout_ms` a backend may ask for.
pub const MAX_BACKEND_TIMEOUT_MS: u64 = 300_000;

/// `POST /v1/sbp/sessions/{id}/tool_calls`, parsed.
#[derive(Debug, Clone)]
pub struct BackendToolCall {
    pub tool_name: String,
    pub tool_input: Value,
    pub timeout: Option<Duration>,
}

impl BackendToolCall {
    /// Accepts `tool_name` (or `name` / `tool`), `tool_input` (or `arguments` / `input`, default
    /// `{}`) and `timeout_ms` (1 to 300,000).
    pub fn from_body(body: &Map<String, Value>) -> Result<Self, ApiError> {
        let tool_name = ["tool_name", "name", "tool"]
            .iter()
            .find_map(|k| body.get(*k))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| ApiError::bad_request("`tool_name` (a non-empty string) is required"))?
            .to_owned();
        let tool_input = ["tool_input", "arguments", "input"]
            .iter()
            .find_map(|k| body.get(*k))
            .cloned()
            .filter(|v| !v.is_null())
            .unwrap_or_else(|| json!({}));
        let timeout = match body.get("timeout_ms") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(ms @ 1..=MAX_BACKEND_TIMEOUT_MS) => Some(Duration::from_millis(ms)),
                _ => {
                    return Err(ApiError::bad_request(format!(
                        "`timeout_ms` must be an integer from 1 to {MAX_BACKEND_TIMEOUT_MS}"
                    )));
                }
            },
        };
        Ok(Self {
            tool_name,
            tool_input,
            timeout,
        })
    }
}

impl Gateway {
    /// A backend invokes a surface tool directly. The call is not part of the transcript (no
    /// agent acted); the answer mirrors TOOL_RESULT, with `status` saying how it ended.
    /// The caller is authorised for session `raw_id` while its surface is looked up (with
    /// replicas, a database read and a registry read: at the same time, not one after the other).
    pub async fn backend_tool_call(
        &self,
        raw_id: &str,
        caller: &Caller,
        call: BackendToolCall,
    ) -> Result<Value, ApiError> {
        let id = super::parse_uuid(raw_id)?;
        let (session, att) =
            tokio::join!(self.authorized_session_id(raw_id, caller), self.locate(id));
        let session = session?;
        let timeout = call.timeout.unwrap_or(self.config().tool_timeout);
        let out = self
            .call_surface_tool_on(session, att, &call.tool_name, call.tool_input, timeout)
            .await?;
        let (status, result, error) = match out.reply {
            ToolReply::Result(v) => ("ok", v, Value::Null),
            ToolReply::Error(e) => {
                let status = match e.as_str() {
                    TIMEOUT => "timeout",
                    DISCONNECTED => "disconnected",
                    _ => "error",
                };
                (status, Value::Null, Value::String(e))
            }
        };
        Ok(json!({
            "session_id": session,
            "call_id": out.call_id,
            "tool_name": call.tool_name,
            "status": status,
            "result": result,
            "error": error,
            "duration_ms": out.elapsed.as_secs_f64() * 1000.0,
        }))
    }
}

/// Removes a surface call's pending entry when its waiter ends, however it ends (a no-op once the
/// call was answered).
struct ForgetCall<'a> {
    gw: &'a Gateway,
    call_id: Uuid,
}

impl Drop for ForgetCall<'_> {
    fn drop(&mut self) {
        self.gw
            .hub()
            .finish_call(self.call_id, ToolReply::Error(DISCONNECTED.into()));
    }
}

/// What one function call produced, for the tool message and the snapshots.
#[derive(Debug, Clone)]
pub(crate) struct ToolRun {
    pub call_id: Option<Uuid>,
    pub content: String,
    pub error: Option<String>,
}

/// The content of the tool message the LLM gets: the result as JSON text, or `{"error": ...}`.
pub fn tool_message_content(reply: &ToolReply) -> String {
    match reply {
        ToolReply::Result(Value::String(s)) => s.clone(),
        ToolReply::Result(v) => v.to_string(),
        ToolReply::Error(e) => json!({"error": e}).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn function_names_fit_the_alphabet() {
        assert_eq!(function_name("surface_gps"), "surface_gps");
        assert_eq!(
            function_name("mcp__files__read.file"),
            "mcp__files__read_file"
        );
        assert_eq!(function_name(&"x".repeat(80)).len(), 64);
        assert_eq!(function_name("surface_caméra"), "surface_cam_ra");
    }

    #[test]
    fn tool_content_is_text_or_json() {
        assert_eq!(
            tool_message_content(&ToolReply::Result(json!("plain"))),
            "plain"
        );
        assert_eq!(
            tool_message_content(&ToolReply::Result(json!({"a": 1}))),
            "{\"a\":1}"
        );
        assert_eq!(
            tool_message_content(&ToolReply::Error("timeout".into())),
            "{\"error\":\"timeout\"}"
        );
    }

    #[test]
    fn client_tools_keep_their_names() {
        let body: Map<String, Value> = serde_json::from_value(json!({
            "tools": [{"type": "function", "function": {"name": "surface_gps"}}, {"name": "bare"}]
        }))
        .expect("object");
        assert_eq!(client_functions(&body), vec!["surface_gps", "bare"]);
    }
}
