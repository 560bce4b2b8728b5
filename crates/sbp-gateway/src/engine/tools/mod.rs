//! The MCP bridge (L5): tools that live on the attached surface (TOOL_CALL out, TOOL_RESULT back,
//! correlated by a fresh UUID per call, bounded by a timeout, failed at once when the surface goes
//! away), tools of operator-configured MCP servers (southbound), and the catalogue of both a turn
//! offers the LLM.

mod catalog;
mod server;

pub(crate) use catalog::{Catalog, ToolTarget};
pub use server::{NoServerTools, ServerTools};

use std::sync::Arc;
use std::time::{Duration, Instant};

use sbp_llm::tool_names::{SERVER_PREFIX, SURFACE_PREFIX};
use sbp_protocol::frames::{ToolCall, ToolResult};
use sbp_protocol::surface::pass_through_schema;
use sbp_protocol::{ChatRequest, ToolFailure, ToolOutcome, ToolSchema};
use serde_json::{Value, json};
use uuid::Uuid;

use super::calls::PendingCalls;
use super::connections::Attachment;
use super::replicas::Replicas;
use super::sessions::{Caller, Sessions};
use crate::config::GatewayConfig;
use crate::error::{Error, parse_uuid};
use crate::metrics::Metrics;

/// Longest `timeout_ms` a backend may ask for.
pub const MAX_BACKEND_TIMEOUT_MS: u64 = 300_000;

/// Why a surface tool call could not be made at all.
#[derive(Debug, Clone, PartialEq)]
pub enum CallRefused {
    /// No surface is attached, or it did not declare the tool.
    NoSurface(String),
    /// The operator's allowlist does not include the tool.
    NotAllowed(String),
}

impl CallRefused {
    pub fn message(&self) -> &str {
        match self {
            Self::NoSurface(m) | Self::NotAllowed(m) => m,
        }
    }
}

impl From<CallRefused> for Error {
    fn from(e: CallRefused) -> Self {
        match e {
            CallRefused::NoSurface(m) => Error::Conflict(m),
            CallRefused::NotAllowed(m) => Error::Forbidden(m),
        }
    }
}

/// A finished surface tool call.
#[derive(Debug, Clone)]
pub struct SurfaceCall {
    pub call_id: Uuid,
    pub outcome: ToolOutcome,
    pub elapsed: Duration,
}

/// `POST /v1/sbp/sessions/{id}/tool_calls`, parsed.
#[derive(Debug, Clone)]
pub struct BackendToolCall {
    pub tool_name: String,
    pub tool_input: Value,
    pub timeout: Option<Duration>,
}

/// How a backend's tool call ended.
#[derive(Debug, Clone)]
pub struct BackendCallOutcome {
    pub session_id: Uuid,
    pub tool_name: String,
    pub call: SurfaceCall,
}

/// What one function call of the LLM produced, for its tool message and snapshots.
#[derive(Debug, Clone)]
pub(crate) struct ToolRun {
    pub(crate) call_id: Option<Uuid>,
    /// The tool message's content.
    pub(crate) content: String,
    pub(crate) error: Option<String>,
}

impl ToolRun {
    /// A call that produced no result: the model reads `{"error": ...}`.
    pub(crate) fn failed(call_id: Option<Uuid>, error: String) -> Self {
        Self {
            call_id,
            content: json!({"error": error}).to_string(),
            error: Some(error),
        }
    }
}

#[derive(Clone)]
pub struct Tools {
    inner: Arc<Shared>,
}

struct Shared {
    config: Arc<GatewayConfig>,
    server: Arc<dyn ServerTools>,
    calls: Arc<PendingCalls>,
    replicas: Replicas,
    sessions: Sessions,
    metrics: Arc<Metrics>,
}

impl Tools {
    pub fn new(
        config: Arc<GatewayConfig>,
        server: Arc<dyn ServerTools>,
        calls: Arc<PendingCalls>,
        replicas: Replicas,
        sessions: Sessions,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            inner: Arc::new(Shared {
                config,
                server,
                calls,
                replicas,
                sessions,
                metrics,
            }),
        }
    }

    /// Tools of the session's attached surface that may be called now (the MCP endpoint's list).
    pub async fn surface_tools(&self, session: Uuid) -> Vec<ToolSchema> {
        self.tools_of(self.inner.replicas.locate(session).await.as_ref())
    }

    /// Whether a surface is attached to the session (on this replica or another).
    pub async fn is_attached(&self, session: Uuid) -> bool {
        self.inner.replicas.locate(session).await.is_some()
    }

    /// Tools of the attached surface `att` that may be called: declared and allowed, with the
    /// surface's schema or the pass-through one.
    fn tools_of(&self, att: Option<&Attachment>) -> Vec<ToolSchema> {
        let Some(att) = att else {
            return Vec::new();
        };
        att.surface
            .mcp_tools
            .iter()
            .filter(|t| self.inner.config.tool_allowed(t))
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
    /// (whose own tools keep their names).
    pub(crate) fn catalog(&self, att: Option<&Attachment>, req: &ChatRequest) -> Catalog {
        let taken = req.declared_functions();
        let mut catalog = Catalog::default();
        let device = att
            .map(|a| a.surface.device_type_or_unknown().to_owned())
            .unwrap_or_default();
        for tool in self.tools_of(att) {
            let description = match &tool.description {
                Some(d) => format!("{d} (runs on the user's {device} device)"),
                None => format!(
                    "Runs the tool '{}' on the user's {device} device.",
                    tool.name
                ),
            };
            catalog.add(
                &format!("{SURFACE_PREFIX}{}", tool.name),
                ToolTarget::Surface(tool.name),
                description,
                tool.input_schema,
                &taken,
            );
        }
        for (server, tool) in self.inner.server.tools() {
            let name = format!("{SERVER_PREFIX}{server}__{}", tool.name);
            let description = tool.description.unwrap_or_else(|| {
                format!("The tool '{}' of the MCP server '{server}'.", tool.name)
            });
            let target = ToolTarget::Server {
                server,
                tool: tool.name,
            };
            catalog.add(&name, target, description, tool.input_schema, &taken);
        }
        catalog
    }

    /// Sends TOOL_CALL for `tool` to the session's surface and waits for its TOOL_RESULT, at most
    /// `timeout`. Timeouts and disconnects are outcomes, never errors: the caller always gets an
    /// answer.
    pub async fn call_surface(
        &self,
        session: Uuid,
        tool: &str,
        input: Value,
        timeout: Duration,
    ) -> Result<SurfaceCall, CallRefused> {
        let att = self.inner.replicas.locate(session).await;
        self.call_surface_on(session, att, tool, input, timeout)
            .await
    }

    /// [`Tools::call_surface`] with the session's surface already located.
    async fn call_surface_on(
        &self,
        session: Uuid,
        att: Option<Attachment>,
        tool: &str,
        input: Value,
        timeout: Duration,
    ) -> Result<SurfaceCall, CallRefused> {
        let att = att.ok_or_else(|| {
            CallRefused::NoSurface("no surface is attached to this session".into())
        })?;
        if !att.surface.declares_tool(tool) {
            return Err(CallRefused::NoSurface(format!(
                "the attached surface did not declare the tool '{tool}'"
            )));
        }
        if !self.inner.config.tool_allowed(tool) {
            return Err(CallRefused::NotAllowed(format!(
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
        self.inner.metrics.tool_calls.inc();
        // Registered before it is sent: a fast TOOL_RESULT must find its call.
        let mut rx = self
            .inner
            .calls
            .register(session, att.conn_id, call_id, att.replica());
        if !self.inner.replicas.deliver_tool_call(session, &att, frame) {
            self.inner
                .calls
                .finish(call_id, Err(ToolFailure::Disconnected));
        }
        // If this future is dropped while waiting (the HTTP caller went away), the pending entry
        // goes with it instead of waiting for an answer nobody will read.
        let _forget = ForgetCall {
            calls: &self.inner.calls,
            call_id,
        };
        let outcome = self.inner.calls.wait(call_id, &mut rx, deadline).await;
        let elapsed = started.elapsed();
        let metrics = &self.inner.metrics;
        metrics.tool_call_latency.observe(elapsed.as_secs_f64());
        metrics.tool_outcome(
            "surface",
            match &outcome {
                Ok(_) => "ok",
                Err(ToolFailure::Timeout) => "timeout",
                Err(ToolFailure::Disconnected) => "disconnected",
                Err(ToolFailure::Surface(_)) => "error",
            },
        );
        let elapsed_ms = elapsed.as_millis() as u64;
        match &outcome {
            Ok(_) => {
                tracing::info!(session_id = %session, %call_id, tool, elapsed_ms, "TOOL_RESULT received");
            }
            Err(e) => {
                self.inner.metrics.tool_call_errors.inc();
                if *e == ToolFailure::Timeout {
                    self.inner.metrics.tool_call_timeouts.inc();
                }
                tracing::warn!(session_id = %session, %call_id, tool, error = %e, elapsed_ms, "tool call failed");
            }
        }
        Ok(SurfaceCall {
            call_id,
            outcome,
            elapsed,
        })
    }

    /// The connection closed: every call in flight on it fails now ("surface disconnected").
    /// Returns how many.
    pub fn connection_closed(&self, conn_id: u64) -> usize {
        self.inner.calls.cancel_conn(conn_id)
    }

    /// A TOOL_RESULT arrived on a connection. Late, unknown or foreign call ids are logged and
    /// ignored (SPEC 10.3 says to match the pending call; nothing else may be disturbed).
    pub fn result(&self, session: Uuid, conn_id: u64, result: ToolResult) {
        let call_id = result.call_id.clone();
        if !self
            .inner
            .calls
            .complete(session, conn_id, &call_id, result.outcome())
        {
            tracing::warn!(session_id = %session, conn_id, %call_id, "TOOL_RESULT for no pending call ignored");
        }
    }

    /// Runs one function call of the LLM on its target; the text is the tool message's content.
    pub(crate) async fn run(
        &self,
        session: Uuid,
        target: &ToolTarget,
        arguments: Value,
    ) -> ToolRun {
        let timeout = self.inner.config.tool_timeout;
        match target {
            ToolTarget::Surface(tool) => {
                match self.call_surface(session, tool, arguments, timeout).await {
                    Ok(out) => ToolRun {
                        call_id: Some(out.call_id),
                        content: tool_message_content(&out.outcome),
                        error: out.outcome.err().map(|e| e.to_string()),
                    },
                    // The surface went away (or changed its tools) since the catalogue was made.
                    Err(refused) => ToolRun::failed(None, refused.message().to_owned()),
                }
            }
            ToolTarget::Server { server, tool } => {
                self.inner.metrics.server_tool_calls.inc();
                let called = self
                    .inner
                    .server
                    .call(server, tool, arguments, timeout)
                    .await;
                let ok = matches!(called, Ok((false, _)));
                let outcome = if ok { "ok" } else { "error" };
                self.inner.metrics.tool_outcome("server", outcome);
                match called {
                    Ok((false, text)) => ToolRun {
                        call_id: None,
                        content: text,
                        error: None,
                    },
                    Ok((true, text)) | Err(text) => ToolRun::failed(None, text),
                }
            }
        }
    }

    /// A backend invokes a surface tool directly. The call is not part of the transcript (no agent
    /// acted). The caller is authorised for session `raw_id` while its surface is looked up (with
    /// replicas, a database read and a registry read: at the same time, not one after the other).
    pub async fn backend_call(
        &self,
        raw_id: &str,
        caller: &Caller,
        call: BackendToolCall,
    ) -> Result<BackendCallOutcome, Error> {
        let id = parse_uuid(raw_id)?;
        let (session, att) = tokio::join!(
            self.inner.sessions.authorized_id(raw_id, caller),
            self.inner.replicas.locate(id)
        );
        let session_id = session?;
        let timeout = call.timeout.unwrap_or(self.inner.config.tool_timeout);
        let out = self
            .call_surface_on(session_id, att, &call.tool_name, call.tool_input, timeout)
            .await?;
        Ok(BackendCallOutcome {
            session_id,
            tool_name: call.tool_name,
            call: out,
        })
    }
}

/// Removes a surface call's pending entry when its waiter ends, however it ends (a no-op once the
/// call was answered).
struct ForgetCall<'a> {
    calls: &'a PendingCalls,
    call_id: Uuid,
}

impl Drop for ForgetCall<'_> {
    fn drop(&mut self) {
        self.calls
            .finish(self.call_id, Err(ToolFailure::Disconnected));
    }
}

/// The content of the tool message the LLM gets: the result as JSON text, or `{"error": ...}`.
pub fn tool_message_content(outcome: &ToolOutcome) -> String {
    match outcome {
        Ok(Value::String(s)) => s.clone(),
        Ok(v) => v.to_string(),
        Err(e) => json!({"error": e.message()}).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_content_is_text_or_json() {
        assert_eq!(tool_message_content(&Ok(json!("plain"))), "plain");
        assert_eq!(tool_message_content(&Ok(json!({"a": 1}))), "{\"a\":1}");
        assert_eq!(
            tool_message_content(&Err(ToolFailure::Timeout)),
            "{\"error\":\"timeout\"}"
        );
        assert_eq!(
            tool_message_content(&Err(ToolFailure::Surface("camera busy".into()))),
            "{\"error\":\"camera busy\"}"
        );
    }
}
