//! MCP on both sides of the SBP gateway (SBP L5, "MCP bridge"), built on `rmcp`, the official Rust MCP SDK.
//!
//! The gateway sits between device *surfaces* (phone, watch, ...) attached over WebSocket and an LLM.
//! Tools reach the LLM from two places, and this crate speaks MCP for both; it knows nothing about
//! WebSockets, frames or the agent loop, which stay in the gateway.
//!
//! # Southbound: the gateway as an MCP client
//!
//! The operator configures MCP servers, one per line of the form `name=stdio:<command line>` or
//! `name=https://host/path` (see [`ServerConfig`]'s `FromStr`). [`Southbound::connect`] starts or
//! dials every one of them concurrently, runs `initialize` + `tools/list` (each bounded by the
//! connect timeout), and returns; one broken server never takes the others down.
//! [`Southbound::tools`] lists `(server, tool)` pairs of the servers connected *now* for the LLM,
//! [`Southbound::call`] runs one call with a deadline and returns a [`ToolOutput`] (the JSON the agent
//! keeps plus the text an LLM reads), and [`Southbound::shutdown`] closes everything.
//!
//! ## Healing
//!
//! Every configured server is kept, connected or not. A connection is *dead* when its rmcp service
//! ended (a stdio child exited and closed its stdout, the HTTP worker gave up) or a call on it failed
//! at the transport level. A dead or never-connected server is reconnected (the stdio child
//! re-spawned in a new process group, or HTTP re-initialized, followed by `tools/list`):
//!
//! * **in the background**: a task started by `connect` (and stopped by `shutdown`) reconnects every
//!   server that is down, as soon as its backoff allows, so its tools appear in `tools()` (with the
//!   tool list it gives at that reconnect) without any call;
//! * **by a call** to a server that is down, once, within the call's timeout.
//!
//! Attempts on one server are at least [`RECONNECT_BACKOFF`] (2 s) apart, measured from the end of a
//! failed attempt (or the start of a successful one); the gap doubles after each failure up to
//! [`RECONNECT_BACKOFF_MAX`] (60 s) and is back to 2 s after a success. A successful initial connect
//! does not count, so a server that dies right after start is reconnected at once. A call that finds
//! its server down within the backoff fails fast with [`McpError::Unavailable`] (nothing is spawned
//! or sent). There is at most one attempt per server at a time: calls and the background task that
//! need the server while an attempt runs wait for that attempt, so a burst of calls after a crash
//! starts one child.
//!
//! **Retry rule.** A call is retried (once, on a new connection) only if its request provably never
//! reached the server: rmcp's service loop had already ended when the call was handed to it, or
//! writing the request to a stdio child's stdin failed because nothing reads it any more (`EPIPE`:
//! no complete request line can have been read). Every other failure is returned and not retried:
//! an answer (a result, a tool error with `isError`, a JSON-RPC error), a timeout, and a transport
//! failure after the request was handed over (the child died mid-call, an HTTP POST failed; the
//! server may have run the call), which fails with [`McpError::Transport`] saying so and has the
//! connection rebuilt for the next call. So a tool never runs twice because of a retry here.
//! Expired HTTP sessions (`404`) are re-initialized by rmcp itself, inside the call.
//!
//! * **stdio** servers are child processes (rmcp's `TokioChildProcess`), each the leader of its own
//!   process group so that shutting down also reaches grandchildren (`npx` → `node`). The child's stdout
//!   carries JSON-RPC only; its stderr is piped and re-logged line by line through `tracing`
//!   (target `sbp_mcp::server_stderr`, field `server`), never mixed into any stdout.
//!   Closing a connection (shutdown, or retiring a broken one) follows the MCP stdio sequence: close
//!   stdin, wait, `SIGTERM`, wait, `SIGKILL`, reap, then kill what is left of its process group.
//! * **http** servers use rmcp's streamable-HTTP client over reqwest 0.13 (rustls), with an optional
//!   bearer token.
//!
//! # Northbound: an attached surface as an MCP server
//!
//! Surfaces declare device-local tools (`mcp_tools: ["camera", "gps"]`). Besides offering them to its
//! own LLM, the gateway can expose each session's surface as a real MCP server at
//! `/v1/sbp/sessions/{id}/mcp`, so that any MCP client can `tools/list` the phone's tools and
//! `tools/call` them. [`northbound_service`] returns rmcp's streamable-HTTP tower service; it turns
//! `tools/list` and `tools/call` into calls on a [`SurfaceToolHost`], which the gateway implements by
//! sending a TOOL_CALL frame over the surface's WebSocket and awaiting TOOL_RESULT.
//!
//! The service is shared by all sessions. The gateway authenticates each request (session token) and
//! puts [`McpSession`] into the request's extensions; rmcp hands the request's
//! [`http::request::Parts`] to the handler through `RequestContext::extensions`, and the handler reads
//! the session id from there. A request without it is answered with an internal error (and logged),
//! because that means the route was mounted without its middleware.
//!
//! Error mapping: [`HostError::UnknownTool`] becomes JSON-RPC `-32602 invalid params` (the code
//! MCP specifies for an unknown tool) with a readable message and `data.sbp_error` =
//! `"unknown_tool"`, and so does [`HostError::NoSurface`] from `tools/list` (`"no_surface"`);
//! [`HostError::Internal`] is logged and answered with a generic `-32603`. A tool that ran and failed
//! is not a protocol error: the host returns `Ok(ToolOutput { is_error: true, .. })` and the MCP
//! client sees `isError: true`. Neither is a `tools/call` while no surface is attached: the host's
//! `NoSurface` message comes back as a result with `isError: true`, which a model can read and act
//! on (try later), where a JSON-RPC error would stop the client.
//!
//! By default the service is **stateless** (rmcp's `legacy_session_mode = false`, JSON responses):
//! every POST is self-contained, nothing is kept between requests, no `Mcp-Session-Id` is issued, and
//! `GET`/`DELETE` answer 405. rmcp's own client (and other spec clients) handle this; the surface's
//! state lives in the gateway anyway. [`NorthboundOptions::stateful`] switches to MCP sessions with SSE
//! streams if a client ever needs server-to-client messages.
//!
//! rmcp accepts only loopback `Host` headers by default (DNS-rebinding protection for local servers).
//! The gateway is a public, token-authenticated service, so [`NorthboundOptions::allowed_hosts`]
//! defaults to `None`, meaning any `Host`; give a list to pin the public host names.
//!
//! # Mounting under axum
//!
//! ```no_run
//! use std::sync::Arc;
//! use axum::{Router, extract::{Path, Request}, middleware::{self, Next}, response::Response};
//! use sbp_mcp::{McpSession, NorthboundOptions, SurfaceToolHost, northbound_service};
//!
//! async fn bind_session(Path(id): Path<uuid::Uuid>, mut req: Request, next: Next) -> Response {
//!     // ... authenticate the caller for session `id` (session token), or return 401 here ...
//!     req.extensions_mut().insert(McpSession(id));
//!     next.run(req).await
//! }
//!
//! fn routes(host: Arc<dyn SurfaceToolHost>) -> Router {
//!     Router::new()
//!         // One service for all sessions. route_service hands rmcp the full path, which it ignores
//!         // (nest_service would strip the prefix; that works too).
//!         .route_service("/v1/sbp/sessions/{id}/mcp", northbound_service(host, NorthboundOptions::default()))
//!         // route_layer runs after routing, so the middleware can extract the `{id}` capture.
//!         .route_layer(middleware::from_fn(bind_session))
//! }
//! ```

mod config;
mod northbound;
mod southbound;
mod tool;

pub use config::{ConfigError, ServerConfig, ServerTransport};
pub use northbound::{
    HostError, McpSession, NorthboundOptions, NorthboundService, SurfaceMcpServer, SurfaceToolHost,
    check_client_message, northbound_service,
};
pub use southbound::{McpError, RECONNECT_BACKOFF, RECONNECT_BACKOFF_MAX, Southbound};
pub use tool::{ToolOutput, ToolSpec};
