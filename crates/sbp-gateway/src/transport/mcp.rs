//! `/v1/sbp/sessions/{id}/mcp`: the attached surface as a real MCP server (streamable HTTP, via
//! rmcp in `sbp-mcp`). `tools/list` shows the surface's callable tools; `tools/call` becomes a
//! TOOL_CALL frame on its WebSocket. The caller authenticates with the session token
//! (`X-Session-Token`, or `Authorization: Bearer <session token>` as MCP clients send it).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use sbp_mcp::{
    HostError, McpSession, NorthboundOptions, SurfaceToolHost, ToolOutput, ToolSpec,
    northbound_service,
};
use serde_json::Value;
use uuid::Uuid;

use super::extract::{Operator, bearer, header};
use crate::Gateway;
use crate::engine::sessions::Caller;
use crate::engine::tools::{CallRefused, tool_message_content};

/// The MCP route, behind its own authentication.
pub fn routes(gw: Gateway) -> Router<Gateway> {
    let host: Arc<dyn SurfaceToolHost> = Arc::new(Host(gw.clone()));
    let service = northbound_service(
        host,
        NorthboundOptions {
            // Callers are authenticated by session token, so any Host header is fine.
            allowed_hosts: None,
            stateful: false,
            cancellation: gw.shutdown_token(),
        },
    );
    Router::new()
        .route_service("/v1/sbp/sessions/{id}/mcp", service)
        .route_layer(from_fn_with_state(gw, authenticate))
}

/// Checks the session token for the path's session and hands the session to the MCP handler.
async fn authenticate(
    State(gw): State<Gateway>,
    Path(id): Path<String>,
    mut req: Request,
    next: Next,
) -> Response {
    let operator = req.extensions().get::<Operator>().is_some_and(|o| o.0);
    let session_token = header(req.headers(), "x-session-token")
        .or_else(|| bearer(req.headers()).filter(|_| !operator));
    let caller = Caller {
        session_token,
        operator,
    };
    match gw.sessions().authorized(&id, &caller).await {
        Ok(session) => {
            req.extensions_mut().insert(McpSession(session.id));
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

struct Host(Gateway);

#[async_trait::async_trait]
impl SurfaceToolHost for Host {
    async fn list_tools(&self, session: Uuid) -> Result<Vec<ToolSpec>, HostError> {
        Ok(self
            .0
            .tools()
            .surface_tools(session)
            .await
            .into_iter()
            .map(|t| ToolSpec {
                name: t.name,
                description: t.description,
                input_schema: t.input_schema,
            })
            .collect())
    }

    async fn call_tool(
        &self,
        session: Uuid,
        name: &str,
        arguments: Value,
    ) -> Result<ToolOutput, HostError> {
        let timeout: Duration = self.0.config().tool_timeout;
        let tools = self.0.tools();
        match tools.call_surface(session, name, arguments, timeout).await {
            Ok(out) => Ok(match out.outcome {
                Ok(v) => ToolOutput::json(v),
                failed @ Err(_) => ToolOutput::error(tool_message_content(&failed)),
            }),
            Err(CallRefused::NoSurface(m)) if !tools.is_attached(session).await => {
                Err(HostError::NoSurface(m))
            }
            // `UnknownTool` carries the tool's name; the MCP error names it.
            Err(CallRefused::NoSurface(_) | CallRefused::NotAllowed(_)) => {
                Err(HostError::UnknownTool(name.to_owned()))
            }
        }
    }
}
