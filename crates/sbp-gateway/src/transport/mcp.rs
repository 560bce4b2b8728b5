//! `/v1/sbp/sessions/{id}/mcp`: the attached surface as a real MCP server (streamable HTTP, via
//! rmcp in `sbp-mcp`). `tools/list` shows the surface's callable tools; `tools/call` becomes a
//! TOOL_CALL frame on its WebSocket. The caller authenticates with the session token
//! (`Authorization: Bearer <session token>` as MCP clients send it, or `X-Session-Token`); a
//! request without one gets 401 with `WWW-Authenticate: Bearer`.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use sbp_mcp::{
    HostError, McpSession, NorthboundOptions, SurfaceToolHost, ToolOutput, ToolSpec,
    check_client_message, northbound_service,
};
use sbp_protocol::ErrorCode;
use serde_json::Value;
use uuid::Uuid;

use super::errors;
use super::extract::{Operator, bearer, is_json_media_type};
use crate::Gateway;
use crate::engine::sessions::Caller;
use crate::engine::tools::{CallRefused, tool_message_content};
use crate::error::Error;

/// The MCP route, behind its own authentication.
pub fn routes(gw: Gateway) -> Router<Gateway> {
    let host: Arc<dyn SurfaceToolHost> = Arc::new(Host(gw.clone()));
    let service = northbound_service(
        host,
        NorthboundOptions {
            // `Host` and `Origin` are checked for every route, this one included, by `policy.rs`
            // with the gateway's names: one policy, not a second list here.
            allowed_hosts: None,
            stateful: false,
            cancellation: gw.shutdown_token(),
        },
    );
    // From the outside in: the request's method and type, the caller, the body.
    Router::new()
        .route_service("/v1/sbp/sessions/{id}/mcp", service)
        .route_layer(from_fn_with_state(gw.clone(), parse_body))
        .route_layer(from_fn_with_state(gw, authenticate))
        .route_layer(from_fn(check_request))
}

/// The endpoint is stateless: one JSON-RPC message per `POST`. A `GET` (which would open a
/// server-to-client SSE stream) and a `DELETE` (which would end an MCP session) get 405, as the
/// streamable-HTTP transport allows a server without them; a body that is not JSON gets 415.
async fn check_request(req: Request, next: Next) -> Response {
    if req.method() != Method::POST {
        let mut resp = errors::routing(
            ErrorCode::MethodNotAllowed,
            "this MCP endpoint takes one JSON-RPC message per POST (no SSE stream, no sessions)",
        );
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        return resp;
    }
    let json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_json_media_type);
    if !json {
        return Error::UnsupportedMediaType(
            "an MCP request is a JSON-RPC message: send it with Content-Type: application/json"
                .into(),
        )
        .into_response();
    }
    next.run(req).await
}

/// Reads the body within the gateway's limit and checks it is one JSON-RPC message, so a
/// malformed request gets the envelope (400, 413) rather than the MCP library's plain text.
async fn parse_body(State(gw): State<Gateway>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let limit = gw.config().max_body_bytes;
    let bytes = match axum::body::to_bytes(body, limit).await {
        Ok(bytes) => bytes,
        Err(_) => {
            return Error::TooLarge(format!("an MCP request may have at most {limit} bytes"))
                .into_response();
        }
    };
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(&bytes) {
        return Error::invalid(format!("the request body is not valid JSON: {e}")).into_response();
    }
    if let Err(e) = check_client_message(&bytes) {
        return Error::invalid(format!("the request body is not a JSON-RPC message: {e}"))
            .into_response();
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// Checks the session token for the path's session and hands the session to the MCP handler.
async fn authenticate(
    State(gw): State<Gateway>,
    Path(id): Path<String>,
    mut req: Request,
    next: Next,
) -> Response {
    let operator = req.extensions().get::<Operator>().is_some_and(|o| o.0);
    let session_token = super::extract::header(req.headers(), "x-session-token")
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
        Err(Error::Unauthorized(_)) => unauthorized(),
        Err(e) => e.into_response(),
    }
}

/// 401 for a request without a token, saying how MCP clients authenticate here: the message and
/// the challenge (RFC 6750 3.1: no error code when no credentials were sent) name Bearer.
fn unauthorized() -> Response {
    let mut resp = Error::Unauthorized(
        "this MCP endpoint needs the session's token: send Authorization: Bearer <session token> \
         (or X-Session-Token: <session token>)"
            .into(),
    )
    .into_response();
    resp.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"sbp-session\""),
    );
    resp
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
                // MCP clients show the description to the user and the model: a tool declared by
                // name only gets one that says where it runs.
                description: t.description.or_else(|| {
                    Some(format!(
                        "Tool `{}` of the attached surface (runs on the user's device).",
                        t.name
                    ))
                }),
                name: t.name,
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
            // The text the MCP client gets as a tool error.
            Err(CallRefused::NoSurface(_)) if !tools.is_attached(session).await => {
                Err(HostError::NoSurface(format!(
                    "no surface is attached to this session, so the tool `{name}` cannot run \
                     now; try again once a surface (a device) has attached"
                )))
            }
            // `UnknownTool` carries the tool's name; the MCP error names it.
            Err(CallRefused::NoSurface(_) | CallRefused::NotAllowed(_)) => {
                Err(HostError::UnknownTool(name.to_owned()))
            }
        }
    }
}
