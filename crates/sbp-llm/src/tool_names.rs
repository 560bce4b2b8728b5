//! How the gateway names the functions it offers an LLM, shared by the gateway (which makes the
//! names) and the built-in `sbp/echo` model (which reads them back), so the two cannot drift.
//! (The functions a request declares itself: `ChatRequest::declared_functions`.)

/// Prefix of a surface tool's function name as the LLM sees it (`gps` -> `surface_gps`).
pub const SURFACE_PREFIX: &str = "surface_";
/// Prefix of a southbound MCP server's tool as the LLM sees it (`mcp__<server>__<tool>`).
pub const SERVER_PREFIX: &str = "mcp__";
