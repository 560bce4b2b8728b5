//! An attached surface exposed as an MCP server over streamable HTTP: `tools/list` and `tools/call`
//! are answered by a [`SurfaceToolHost`] that the gateway implements on top of TOOL_CALL frames.

use std::sync::Arc;

use rmcp::{
    ErrorData, RoleServer, ServerHandler,
    model::{
        CallToolRequestParams, CallToolResponse, Implementation, ListToolsResult,
        PaginatedRequestParams, ServerCapabilities, ServerConfig,
    },
    service::RequestContext,
    transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    },
};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::{ToolOutput, ToolSpec};

/// Why the host could not run or list a session's tools. A tool that ran and failed is not a
/// `HostError`; it is `Ok(ToolOutput { is_error: true, .. })`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// No surface is attached to the session (or the session does not exist); the message says
    /// which. From `tools/call` it is a tool-level error (`isError: true`) with this message as
    /// its text: the client's model can read it and try later, when a surface has attached.
    #[error("no surface attached: {0}")]
    NoSurface(String),
    /// The attached surface does not offer this tool (the tool's name).
    #[error("unknown tool: {0}")]
    UnknownTool(String),
    /// Anything else; logged, and answered with a generic internal error.
    #[error("internal error: {0}")]
    Internal(String),
}

/// The gateway's side of the northbound server: a session's surface and its tools.
#[async_trait::async_trait]
pub trait SurfaceToolHost: Send + Sync + 'static {
    /// Tools the session's attached surface offers now (empty when none attached).
    async fn list_tools(&self, session: Uuid) -> Result<Vec<ToolSpec>, HostError>;
    /// Runs one tool on the surface; `Ok(ToolOutput)` also for a tool-level error (`is_error = true`).
    async fn call_tool(
        &self,
        session: Uuid,
        name: &str,
        arguments: Value,
    ) -> Result<ToolOutput, HostError>;
}

/// The SBP session an MCP request is for. The gateway inserts it into the HTTP request's extensions
/// after authenticating the caller; the MCP handler reads it back from there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct McpSession(pub Uuid);

/// How the northbound MCP endpoint behaves.
#[derive(Debug, Clone, Default)]
pub struct NorthboundOptions {
    /// Accepted `Host` header values (`host` or `host:port`). `None` accepts any host: the gateway
    /// authenticates callers by session token, and rmcp's loopback-only default would reject every
    /// real deployment. `Some(empty list)` falls back to rmcp's loopback list (`localhost`,
    /// `127.0.0.1`, `::1`) rather than meaning "any", so an empty list never silently opens up.
    pub allowed_hosts: Option<Vec<String>>,
    /// `false` (default): stateless, one self-contained POST per request, JSON responses.
    /// `true`: MCP sessions (`Mcp-Session-Id`), SSE responses, `GET`/`DELETE` supported.
    pub stateful: bool,
    /// Cancelling it ends open SSE streams and sessions and makes the service refuse new requests.
    pub cancellation: CancellationToken,
}

/// The tower service returned by [`northbound_service`]: rmcp's streamable-HTTP server. It accepts
/// any `http::Request` body, answers with `http::Response<BoxBody<Bytes, Infallible>>`, is `Clone`,
/// and ignores the request path, so it can be mounted anywhere.
pub type NorthboundService = StreamableHttpService<SurfaceMcpServer, LocalSessionManager>;

/// The MCP server handler behind [`NorthboundService`]; one value is shared by every request.
#[derive(Clone)]
pub struct SurfaceMcpServer {
    host: Arc<dyn SurfaceToolHost>,
}

impl SurfaceMcpServer {
    pub fn new(host: Arc<dyn SurfaceToolHost>) -> Self {
        SurfaceMcpServer { host }
    }
}

/// Whether `body` is one JSON-RPC message an MCP client may send (request, notification,
/// response or error), so the endpoint can refuse anything else with its own error before the
/// service sees it. `Err` says what is wrong.
pub fn check_client_message(body: &[u8]) -> Result<(), String> {
    serde_json::from_slice::<rmcp::model::ClientJsonRpcMessage>(body)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// A tower/axum service speaking MCP streamable HTTP for every session's surface. Mount it under
/// `/v1/sbp/sessions/{id}/mcp` behind a middleware that authenticates the caller and inserts
/// [`McpSession`] into the request extensions (see the crate docs for the axum snippet).
pub fn northbound_service(
    host: Arc<dyn SurfaceToolHost>,
    opts: NorthboundOptions,
) -> NorthboundService {
    let mut config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(opts.stateful)
        // JSON when stateless: a tool call is one request and one answer, and plain JSON is what
        // simple clients (curl, scripts) handle best. rmcp falls back to SSE by itself if a handler
        // ever emits a notification before its answer.
        .with_json_response(!opts.stateful)
        .with_cancellation_token(opts.cancellation);
    config = match opts.allowed_hosts {
        None => config.disable_allowed_hosts(),
        Some(hosts) if hosts.is_empty() => config,
        Some(hosts) => config.with_allowed_hosts(hosts),
    };
    let server = SurfaceMcpServer::new(host);
    StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    )
}

/// The session id the gateway attached to the HTTP request this MCP request came in.
fn session_of(context: &RequestContext<RoleServer>) -> Result<Uuid, ErrorData> {
    context
        .extensions
        .get::<http::request::Parts>()
        .and_then(|parts| parts.extensions.get::<McpSession>())
        // Also accept it directly on the MCP request, for transports other than streamable HTTP.
        .or_else(|| context.extensions.get::<McpSession>())
        .map(|session| session.0)
        .ok_or_else(|| {
            tracing::error!(
                "MCP request without an McpSession extension: the northbound service was mounted without its session middleware"
            );
            ErrorData::internal_error("request is not bound to an SBP session", None)
        })
}

fn host_error(session: Uuid, error: HostError) -> ErrorData {
    match error {
        HostError::NoSurface(message) => ErrorData::invalid_params(
            format!("no surface attached to session {session}: {message}"),
            Some(json!({"sbp_error": "no_surface"})),
        ),
        HostError::UnknownTool(tool) => ErrorData::invalid_params(
            format!("unknown tool: {tool}"),
            Some(json!({"sbp_error": "unknown_tool", "tool": tool})),
        ),
        HostError::Internal(message) => {
            tracing::error!(%session, error = %message, "surface tool host failed");
            ErrorData::internal_error("the gateway could not reach the surface", None)
        }
    }
}

impl ServerHandler for SurfaceMcpServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new(
                "sbp-gateway",
                env!("CARGO_PKG_VERSION"),
            ))
            .with_instructions(
                "Tools of the device surface attached to this SBP session (phone, watch, ...). \
                 Each call runs on the device and may wait for the user.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let session = session_of(&context)?;
        let tools = self
            .host
            .list_tools(session)
            .await
            .map_err(|e| host_error(session, e))?;
        tracing::debug!(%session, tools = tools.len(), "northbound tools/list");
        Ok(ListToolsResult::with_all_items(
            tools.iter().map(ToolSpec::to_mcp).collect(),
        ))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let session = session_of(&context)?;
        let arguments = request.arguments.map(Value::Object).unwrap_or(json!({}));
        let name = request.name;
        // rmcp cancels `ct` when the client sends notifications/cancelled or (stateless) hangs up;
        // nobody would read the answer, so stop waiting and drop the host's future.
        let output = tokio::select! {
            output = self.host.call_tool(session, &name, arguments) => match output {
                Err(HostError::NoSurface(message)) => ToolOutput::error(message),
                other => other.map_err(|e| host_error(session, e))?,
            },
            () = context.ct.cancelled() => {
                tracing::debug!(%session, tool = %name, "northbound tools/call cancelled by the client");
                return Err(ErrorData::internal_error("request cancelled", None));
            }
        };
        tracing::debug!(%session, tool = %name, is_error = output.is_error, "northbound tools/call");
        Ok(output.to_mcp().into())
    }
}
