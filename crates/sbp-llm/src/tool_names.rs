//! How the gateway names the functions it offers an LLM, shared by the gateway (which makes the
//! names) and the built-in `sbp/echo` model (which reads them back), so the two cannot drift.

use serde_json::{Map, Value};

/// Prefix of a surface tool's function name as the LLM sees it (`gps` -> `surface_gps`).
pub const SURFACE_PREFIX: &str = "surface_";
/// Prefix of a southbound MCP server's tool as the LLM sees it (`mcp__<server>__<tool>`).
pub const SERVER_PREFIX: &str = "mcp__";

/// Names of the functions in a request body's `tools`, in order: the OpenAI shape
/// (`{"function": {"name": ...}}`) or a bare `{"name": ...}`.
pub fn declared_functions(body: &Map<String, Value>) -> Vec<String> {
    body.get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| {
            t.pointer("/function/name")
                .or_else(|| t.get("name"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn both_tool_shapes_are_read_in_order() {
        let body: Map<String, Value> = serde_json::from_value(json!({
            "tools": [{"type": "function", "function": {"name": "surface_gps"}}, {"name": "bare"}, {}]
        }))
        .expect("object");
        assert_eq!(declared_functions(&body), vec!["surface_gps", "bare"]);
        assert!(declared_functions(&Map::new()).is_empty());
    }
}
