//! The SurfaceContext a surface declares in ATTACH_SESSION. Every field is optional and parsing never
//! fails: a value of the wrong type is treated as absent, unknown fields are kept in `extra`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Device types with a defined adaptation; any other string is accepted and adapted as "unknown".
pub const WELL_KNOWN_DEVICE_TYPES: [&str; 6] =
    ["mobile", "desktop", "iot", "browser", "voice", "unknown"];

#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SurfaceContext {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ui_capabilities: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub locale: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub surface_id: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_tools: Vec<String>,
    /// Extension (docs/PROTOCOL-EXTENSIONS.md): full schemas of declared tools, from
    /// `mcp_tool_schemas` or from object entries of `mcp_tools`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_tool_schemas: Vec<ToolSchema>,
    /// Fields this gateway does not know, echoed back untouched.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl SurfaceContext {
    /// Lenient parse: `null` or a non-object gives the empty ("unknown") context.
    pub fn from_value(value: &Value) -> Self {
        let Some(obj) = value.as_object() else {
            return Self::default();
        };
        let mut ctx = Self::default();
        // Schemas given inline in `mcp_tools`; the explicit `mcp_tool_schemas` list wins over them.
        let mut inline = Vec::new();
        for (key, v) in obj {
            match key.as_str() {
                "device_type" => ctx.device_type = v.as_str().map(str::to_owned),
                "max_output_tokens" => ctx.max_output_tokens = v.as_u64().filter(|n| *n > 0),
                "ui_capabilities" => ctx.ui_capabilities = string_list(v),
                "locale" => ctx.locale = v.as_str().map(str::to_owned),
                "surface_id" => ctx.surface_id = v.as_str().map(str::to_owned),
                "mcp_tools" => {
                    for item in v.as_array().into_iter().flatten() {
                        match item {
                            Value::String(name) => push_unique(&mut ctx.mcp_tools, name),
                            Value::Object(_) => {
                                if let Some(schema) = ToolSchema::from_value(item) {
                                    push_unique(&mut ctx.mcp_tools, &schema.name);
                                    inline.push(schema);
                                }
                            }
                            _ => {}
                        }
                    }
                }
                "mcp_tool_schemas" => {
                    ctx.mcp_tool_schemas.extend(
                        v.as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(ToolSchema::from_value),
                    );
                }
                _ => {
                    ctx.extra.insert(key.clone(), v.clone());
                }
            }
        }
        ctx.mcp_tool_schemas.extend(inline);
        // A schema also declares its tool; the first schema of a name wins.
        let mut seen = Vec::new();
        ctx.mcp_tool_schemas.retain(|t| {
            let fresh = !seen.contains(&t.name);
            seen.push(t.name.clone());
            fresh
        });
        for t in &ctx.mcp_tool_schemas {
            push_unique(&mut ctx.mcp_tools, &t.name);
        }
        ctx
    }

    /// The schema the surface gave for `tool`, if any.
    pub fn tool_schema(&self, tool: &str) -> Option<&ToolSchema> {
        self.mcp_tool_schemas.iter().find(|t| t.name == tool)
    }

    /// Whether the surface declared `tool`.
    pub fn declares_tool(&self, tool: &str) -> bool {
        self.mcp_tools.iter().any(|t| t == tool)
    }

    /// The device type as given, or "unknown" when absent.
    pub fn device_type_or_unknown(&self) -> &str {
        self.device_type.as_deref().unwrap_or("unknown")
    }

    /// The device type used for adaptation: unknown strings collapse to "unknown".
    pub fn adaptation_class(&self) -> &str {
        let dt = self.device_type_or_unknown();
        if WELL_KNOWN_DEVICE_TYPES.contains(&dt) {
            dt
        } else {
            "unknown"
        }
    }

    pub fn has_capability(&self, cap: &str) -> bool {
        self.ui_capabilities.iter().any(|c| c == cap)
    }
}

/// A surface tool's full description (extension): what an MCP server's `tools/list` gives.
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSchema {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON Schema object for the tool's input.
    pub input_schema: Value,
}

impl ToolSchema {
    /// Lenient: needs a non-empty string `name`; the schema may be named `input_schema`,
    /// `inputSchema` (MCP) or `parameters` (OpenAI) and defaults to any object.
    pub fn from_value(v: &Value) -> Option<Self> {
        let name = v
            .get("name")?
            .as_str()
            .filter(|n| !n.is_empty())?
            .to_owned();
        let input_schema = ["input_schema", "inputSchema", "parameters"]
            .iter()
            .find_map(|k| v.get(*k).filter(|s| s.is_object()).cloned())
            .unwrap_or_else(pass_through_schema);
        Some(Self {
            name,
            description: v
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_owned),
            input_schema,
        })
    }
}

/// The generic schema of a tool declared by name only: any JSON object.
pub fn pass_through_schema() -> Value {
    let mut m = Map::new();
    m.insert("type".into(), Value::String("object".into()));
    m.insert("additionalProperties".into(), Value::Bool(true));
    Value::Object(m)
}

fn push_unique(list: &mut Vec<String>, name: &str) {
    if !name.is_empty() && !list.iter().any(|n| n == name) {
        list.push(name.to_owned());
    }
}

fn string_list(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|i| i.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn null_and_non_objects_are_unknown() {
        for v in [Value::Null, json!(3), json!("mobile"), json!([1])] {
            let ctx = SurfaceContext::from_value(&v);
            assert_eq!(ctx, SurfaceContext::default());
            assert_eq!(ctx.adaptation_class(), "unknown");
        }
    }

    #[test]
    fn wrong_types_are_dropped_and_unknown_fields_kept() {
        let ctx = SurfaceContext::from_value(&json!({
            "device_type": "hologram",
            "max_output_tokens": "lots",
            "ui_capabilities": ["markdown", 7, "tables"],
            "mcp_tools": "camera",
            "another_new_field": {"nested": true}
        }));
        assert_eq!(ctx.device_type.as_deref(), Some("hologram"));
        assert_eq!(ctx.adaptation_class(), "unknown");
        assert_eq!(ctx.max_output_tokens, None);
        assert_eq!(ctx.ui_capabilities, vec!["markdown", "tables"]);
        assert!(ctx.mcp_tools.is_empty());
        assert!(ctx.mcp_tool_schemas.is_empty());
        assert_eq!(ctx.extra["another_new_field"], json!({"nested": true}));
        let echoed = serde_json::to_value(&ctx).expect("serialises");
        assert_eq!(echoed["another_new_field"], json!({"nested": true}));
    }

    #[test]
    fn tools_by_name_object_or_schema_list() {
        let ctx = SurfaceContext::from_value(&json!({
            "mcp_tools": ["camera", {"name": "gps", "description": "where", "inputSchema": {"type": "object"}}, 5, {"no": "name"}, "camera"],
            "mcp_tool_schemas": [
                {"name": "contacts", "parameters": {"type": "object"}},
                {"name": "gps", "description": "explicit", "input_schema": {"type": "object", "properties": {"acc": {"type": "string"}}}}
            ]
        }));
        assert_eq!(ctx.mcp_tools, vec!["camera", "gps", "contacts"]);
        assert!(ctx.declares_tool("contacts") && !ctx.declares_tool("mic"));
        let gps = ctx.tool_schema("gps").expect("gps schema");
        assert_eq!(gps.description.as_deref(), Some("explicit"));
        assert_eq!(
            gps.input_schema["properties"]["acc"]["type"],
            json!("string")
        );
        assert_eq!(ctx.tool_schema("camera"), None);
        assert_eq!(ctx.mcp_tool_schemas.len(), 2, "first schema of a name wins");
        let t = ToolSchema::from_value(&json!({"name": "x"})).expect("named");
        assert_eq!(t.input_schema, pass_through_schema());
    }
}
