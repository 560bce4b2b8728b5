//! Tools of the MCP servers the gateway itself calls (southbound, configured by the operator),
//! as the engine sees them: a list of schemas and a call.

use std::time::Duration;

use async_trait::async_trait;
use sbp_protocol::ToolSchema;
use serde_json::Value;

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
