//! Surface-side tools (L5): the [`ToolHandler`] a surface answers TOOL_CALLs with, the
//! [`ToolSpec`]s it declares at attach, and [`Tools`], a handler built from async closures.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;
use sbp_protocol::surface::pass_through_schema;
use sbp_protocol::{SurfaceContext, ToolSchema};
use serde_json::Value;

/// Answers the gateway's TOOL_CALLs. The SDK calls it on a task of its own per call, so calls run
/// concurrently with each other and with the event stream; whatever it returns is sent back as the
/// TOOL_RESULT (`Ok` as `result`, `Err` as `error`). A call still running when its connection drops
/// is cancelled: the gateway has already answered it with "surface disconnected".
#[async_trait::async_trait]
pub trait ToolHandler: Send + Sync + 'static {
    /// The tools this surface declares in its SurfaceContext at every attach.
    fn tools(&self) -> Vec<ToolSpec>;

    /// Runs tool `name` with the model's (or backend's) `input`.
    async fn call(&self, name: &str, input: Value) -> Result<Value, String>;
}

/// One declared tool: its name, and optionally a description and JSON Schema for its input (sent as
/// the `mcp_tool_schemas` extension; without them the gateway offers a pass-through schema).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    pub input_schema: Option<Value>,
}

impl ToolSpec {
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            description: None,
            input_schema: None,
        }
    }

    pub fn description(mut self, text: impl Into<String>) -> Self {
        self.description = Some(text.into());
        self
    }

    /// A JSON Schema object for the tool's input.
    pub fn input_schema(mut self, schema: Value) -> Self {
        self.input_schema = Some(schema);
        self
    }
}

/// Adds the handler's tools to `ctx`: every name to `mcp_tools`, and a `mcp_tool_schemas` entry for
/// each tool with a schema or description. Tools the application declared itself are kept.
pub(crate) fn declare(ctx: &mut SurfaceContext, specs: &[ToolSpec]) {
    for spec in specs {
        if spec.name.is_empty() {
            continue;
        }
        if !ctx.mcp_tools.contains(&spec.name) {
            ctx.mcp_tools.push(spec.name.clone());
        }
        if spec.input_schema.is_none() && spec.description.is_none() {
            continue;
        }
        let schema = ToolSchema {
            name: spec.name.clone(),
            description: spec.description.clone(),
            input_schema: spec
                .input_schema
                .clone()
                .unwrap_or_else(pass_through_schema),
        };
        match ctx
            .mcp_tool_schemas
            .iter_mut()
            .find(|t| t.name == spec.name)
        {
            Some(existing) => *existing = schema,
            None => ctx.mcp_tool_schemas.push(schema),
        }
    }
}

type ToolFn = Arc<dyn Fn(Value) -> BoxFuture<'static, Result<Value, String>> + Send + Sync>;

/// A [`ToolHandler`] made of async closures, one per tool.
///
/// ```
/// use sbp_client::{ToolSpec, Tools};
/// use serde_json::json;
///
/// let tools = Tools::new().tool(
///     ToolSpec::new("gps").description("Where the device is"),
///     |_input| async { Ok(json!({"lat": 35.68, "lon": 139.76})) },
/// );
/// ```
#[derive(Clone, Default)]
pub struct Tools {
    specs: Vec<ToolSpec>,
    funcs: HashMap<String, ToolFn>,
}

impl std::fmt::Debug for Tools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tools").field("specs", &self.specs).finish()
    }
}

impl Tools {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a tool.
    pub fn tool<F, Fut>(mut self, spec: ToolSpec, f: F) -> Self
    where
        F: Fn(Value) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, String>> + Send + 'static,
    {
        let func: ToolFn = Arc::new(move |input| Box::pin(f(input)));
        self.specs.retain(|s| s.name != spec.name);
        self.funcs.insert(spec.name.clone(), func);
        self.specs.push(spec);
        self
    }
}

#[async_trait::async_trait]
impl ToolHandler for Tools {
    fn tools(&self) -> Vec<ToolSpec> {
        self.specs.clone()
    }

    async fn call(&self, name: &str, input: Value) -> Result<Value, String> {
        match self.funcs.get(name) {
            Some(f) => f(input).await,
            None => Err(format!("unknown tool '{name}'")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn declaring_merges_names_and_schemas() {
        let mut ctx = SurfaceContext::from_value(&json!({
            "mcp_tools": ["camera", "gps"],
            "mcp_tool_schemas": [{"name": "gps", "input_schema": {"type": "object"}}]
        }));
        declare(
            &mut ctx,
            &[
                ToolSpec::new("gps").input_schema(json!({"type": "object", "required": ["acc"]})),
                ToolSpec::new("clock"),
                ToolSpec::new("files").description("reads files"),
                ToolSpec::new(""),
            ],
        );
        assert_eq!(ctx.mcp_tools, ["camera", "gps", "clock", "files"]);
        let names: Vec<_> = ctx
            .mcp_tool_schemas
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(names, ["gps", "files"]);
        assert_eq!(
            ctx.tool_schema("gps").expect("gps").input_schema["required"],
            json!(["acc"]),
            "the handler's schema wins"
        );
        assert_eq!(
            ctx.tool_schema("files").expect("files").input_schema,
            pass_through_schema()
        );
        // What the gateway parses back is what was declared.
        let wire = serde_json::to_value(&ctx).expect("serialises");
        assert_eq!(SurfaceContext::from_value(&wire), ctx);
    }

    #[tokio::test]
    async fn tools_dispatch_by_name() {
        let tools = Tools::new()
            .tool(ToolSpec::new("double"), |v| async move {
                v.as_i64()
                    .map(|n| json!(n * 2))
                    .ok_or_else(|| "not a number".to_owned())
            })
            .tool(ToolSpec::new("double").description("replaced"), |_| async {
                Ok(json!("second"))
            });
        assert_eq!(tools.tools().len(), 1);
        assert_eq!(tools.call("double", json!(2)).await, Ok(json!("second")));
        assert_eq!(
            tools.call("nope", json!({})).await,
            Err("unknown tool 'nope'".to_owned())
        );
    }
}
