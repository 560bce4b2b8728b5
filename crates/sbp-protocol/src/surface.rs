//! The SurfaceContext a surface declares in ATTACH_SESSION. Every field is optional and parsing never
//! fails: a value of the wrong type is treated as absent, unknown fields are kept in `extra`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Device types with a defined adaptation; any other string is accepted and adapted as "unknown".
pub const WELL_KNOWN_DEVICE_TYPES: [&str; 6] =
    ["mobile", "desktop", "iot", "browser", "voice", "unknown"];

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
        for (key, v) in obj {
            match key.as_str() {
                "device_type" => ctx.device_type = v.as_str().map(str::to_owned),
                "max_output_tokens" => ctx.max_output_tokens = v.as_u64().filter(|n| *n > 0),
                "ui_capabilities" => ctx.ui_capabilities = string_list(v),
                "locale" => ctx.locale = v.as_str().map(str::to_owned),
                "surface_id" => ctx.surface_id = v.as_str().map(str::to_owned),
                "mcp_tools" => ctx.mcp_tools = string_list(v),
                _ => {
                    ctx.extra.insert(key.clone(), v.clone());
                }
            }
        }
        ctx
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
        assert_eq!(ctx.extra["another_new_field"], json!({"nested": true}));
        let echoed = serde_json::to_value(&ctx).expect("serialises");
        assert_eq!(echoed["another_new_field"], json!({"nested": true}));
    }
}
